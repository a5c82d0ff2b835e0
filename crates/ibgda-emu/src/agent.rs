//! The GPU agent: one block (eight warps) per (process, GPU), running while there is work and
//! ending after [`AGENT_IDLE_EXIT`] without any, that executes the emulated NICs' small
//! operations — copies up to [`AGENT_COPY_MAX`], inline data, atomics, device CQEs — with device
//! loads, stores and atomics, from a command ring in pinned host memory (`cuda/agent.cu`, layout
//! in [`crate::agent_cmd`]).
//!
//! # Why, and what it costs
//!
//! Without it every small operation is a driver call on the NIC thread (1–3 µs each) and every
//! atomic on GPU memory a round trip through host memory ([`crate::cuda_deferred`]). With it the
//! NIC thread writes 64 bytes into a ring slot per operation, the agent runs a batch of 32 per
//! PCIe round trip, atomics are real GPU atomics (system scope: atomic with respect to each
//! other whichever NIC, QP or process issues them, and with respect to GPU kernels on the same
//! word), and nothing waits on the host.
//!
//! The agent's SM is one of those `ep::residency::EMULATED_NIC_SMS` keeps free of waiting
//! kernels, so a relaunch never waits for an SM that kernels waiting for the NIC hold. It is
//! launched on a waiting stream of [`ibgda_device::stream_pool`]: a hardware queue of its own,
//! so no other work queues behind it.
//!
//! # Idle exit, and what a user sees
//!
//! `cuMemFree`, `cuMemFreeHost`, module loads and unloads and `cuCtxSynchronize` wait until
//! every kernel of the context has ended (and hold a driver lock meanwhile that launches and
//! event calls in other threads wait on). A kernel that never ended would hang them, so the
//! agent ends once it has seen no command for [`AGENT_IDLE_EXIT`]: **such a call waits at most
//! about that long behind the emulator** after its last command (plus whatever the user's own
//! kernels take). The cost is a relaunch (one `cuLaunchKernel` from the NIC thread, some
//! microseconds) for the first command after an idle period.
//!
//! What it does not remove: while the emulator keeps getting commands, such a call waits until
//! it has been quiet for [`AGENT_IDLE_EXIT`]; and the NIC thread still makes driver calls (a
//! relaunch, copy-engine work for large copies), which wait behind such a call. A kernel that
//! waits for NIC traffic needing one of those, while another thread frees memory, is a cycle
//! no emulator design that calls the driver from its NIC thread can break (a hardware NIC has
//! none): free memory when no kernel waits for the NIC.
//!
//! The protocol (`cuda/agent.cu` has the kernel's side) keeps every published command covered
//! by an agent: a producer publishes its slot, fences, and reads the state word
//! (`generation << 32 | phase`); the kernel, idle long enough, writes `STOPPING`, fences, and
//! reads the ring once more, going back to `RUNNING` if a command came in. Whatever the
//! producer reads then tells it what to do ([`after_publish`]): nothing (an agent will see its
//! command), wait a moment (`STOPPING` resolves in microseconds), or relaunch (the agent has
//! `EXITED`; one producer launches the next generation, the others see it enqueued). Launches
//! happen under a mutex of their own that nothing the agent needs is behind; the ring's
//! producer lock is not held.
//!
//! Why a stream may wait on the agent at all (a lane's copy-engine work waits on its done
//! word): such a wait is only ever enqueued for commands already in the ring, hence covered by
//! a running or enqueued agent (`cuda_agent` publishes held commands before it), so every wait
//! ends by GPU progress alone, never by a host thread that might itself be stuck in a driver
//! call behind a `cuMemFree` that waits for that stream.
//!
//! Creation probes the calls the project makes while NICs live (a device allocation and free,
//! a pinned allocation and free, a module load and unload) on a helper thread while the agent
//! runs: each must return within [`PROBE_BOUND`] (the idle exit plus a margin); if one does not,
//! the agent is stopped, the backend falls back to the copy-engine path, and the log says why.
//!
//! # Lifetime
//!
//! Agents are shared through a process-wide registry of weak references: every `CudaMemory` on
//! a context holds the context's agent; the last one dropped stops it (a flag in pinned memory
//! the agent polls when idle) and waits, at most [`STOP_BOUND`], for the kernel to end.
//! The agent is on by default; [`AGENT_ENV`]`=0` turns it off (see [`agent_enabled_by_env`]).

use std::ffi::c_void;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};
use ibgda_device::stream_pool::StreamLease;

use crate::agent_cmd::{
    slot_of, AgentCmd, AgentParams, CTRL_BYTES, CTRL_CE_WORDS, CTRL_DONE, CTRL_LANE_DONE,
    CTRL_STATE, CTRL_STOP, MAX_LANES, PAYLOAD_BYTES, PHASE_EXITED, PHASE_RUNNING, PHASE_STOPPING,
    SLOT_BYTES,
};
use crate::error::{check, EmuError};
use crate::host::HostBuffer;
use crate::spin_wait::SpinWait;

mod modules {
    include!(concat!(env!("OUT_DIR"), "/agent_modules.rs"));
}

/// Environment variable: `0` runs the CUDA backend without the GPU agent (every operation on
/// copy engines and stream memory operations, atomics computed on the host); anything else, or
/// unset, uses the agent where it can be started.
pub const AGENT_ENV: &str = "IBGDA_EMU_AGENT";

/// Largest device-to-device copy the agent executes; larger ones go to the copy engines.
///
/// Chosen without measurement: the agent's block moves a copy at some tens of GB/s, so a 16 KiB
/// copy holds it (and every other QP's small operations queued behind it) for about a
/// microsecond, less than one copy-engine submission costs the NIC thread; larger copies are
/// cheaper on the copy engines, which also reach NVLink's full rate. A low-latency token of
/// hidden size 7168 in BF16 (14 KiB) stays on the agent.
pub const AGENT_COPY_MAX: u64 = 16 << 10;

/// SMs the agent occupies on its GPU (one block on one SM while it runs): part of what
/// `ep::residency::EMULATED_NIC_SMS` keeps free of waiting kernels.
pub const AGENT_SMS: u32 = 1;

/// Threads of the agent's block (`EMU_AGENT_MAX_THREADS` in `cuda/agent_cmd.cuh` is the most):
/// warp 0 reads the ring and runs atomics and CQEs; copies use all eight warps, because a copy's
/// rate is bound by the bytes it has in flight (32 KiB with eight warps, about 10 GB/s a warp).
/// A quarter of one SM's threads and a little over half its registers.
const AGENT_THREADS: u32 = 256;

/// Ring slots (a power of two, at least 32: the agent reads 32 at a time).
const RING_SLOTS: usize = 4096;

/// How long the agent runs without a command before its kernel ends (measured on the GPU's
/// globaltimer, checked about every 16 µs while idle).
///
/// The trade-off: a `cuMemFree`, `cuMemFreeHost`, module load or context synchronisation
/// anywhere in the process waits up to about this long after the emulator's last command (they
/// wait for every kernel of the context); the first command after an idle period pays a
/// relaunch (a `cuLaunchKernel` from the NIC thread and the kernel's start, some microseconds).
/// 2 ms is far above the gaps inside a dispatch or combine (microseconds), so busy phases never
/// relaunch, and far below what a free that waits would notice next to a step of a model.
pub const AGENT_IDLE_EXIT: Duration = Duration::from_millis(2);

/// How long creation waits for the agent to report that it started.
const START_BOUND: Duration = Duration::from_secs(5);

/// How long a probed driver call may take while the agent runs: the idle exit, plus a margin
/// for the call itself (a module load takes milliseconds) and for the helper thread being
/// scheduled on a busy host. A call that waits on the agent for any other reason never returns.
pub(crate) const PROBE_BOUND: Duration = Duration::from_millis(250);

/// How long dropping the agent waits for the kernel to end, and a producer for a `STOPPING`
/// agent to decide (microseconds on the GPU).
pub(crate) const STOP_BOUND: Duration = Duration::from_secs(5);

/// The agent's state word as the host reads it (`cuda/agent_cmd.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AgentState {
    /// The launch that wrote it (0: none has started yet).
    pub generation: u32,
    /// `PHASE_RUNNING`, `PHASE_STOPPING`, `PHASE_EXITED`, or 0 before the first start.
    pub phase: u32,
}

impl AgentState {
    pub fn decode(word: u64) -> Self {
        Self {
            generation: (word >> 32) as u32,
            phase: word as u32,
        }
    }
}

/// What a producer does once it has published a command, fenced, and read the state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterPublish {
    /// An agent will see the command: the one that wrote the state word (running, so it reads
    /// the ring again before it ends), or a later launch already enqueued (it starts after the
    /// read, so it reads the ring after the command was published).
    Covered,
    /// The agent is ending and re-reading the ring: read the state word again.
    Recheck,
    /// The agent of generation `exited` has ended (or none ever started): launch the next one,
    /// unless another producer already has.
    Launch { exited: u32 },
}

/// The host's side of the idle-exit protocol (module docs): `seen` is the state word read after
/// publishing, `launched` the generation of the latest launch enqueued (read after `seen`).
pub(crate) fn after_publish(seen: AgentState, launched: u32) -> AfterPublish {
    // Generations grow by one per launch; compared wrapping.
    if (launched.wrapping_sub(seen.generation) as i32) > 0 {
        return AfterPublish::Covered;
    }
    match seen.phase {
        PHASE_RUNNING => AfterPublish::Covered,
        PHASE_STOPPING => AfterPublish::Recheck,
        _ => AfterPublish::Launch {
            exited: seen.generation,
        },
    }
}

/// Whether [`AGENT_ENV`] leaves the agent on: on unless it says `0` (or `off`, `false`).
///
/// On by default since it passed on an H200 (2026-12-02): the `gpu_emu` agent tests, and, where
/// the stream-only path left a kernel waiting for completions the NIC had queued on its streams
/// until the kernel's bound ran out (`gpu_low_latency_verbs` at EP4, the internode tests), the
/// same runs with the agent passed.
pub fn agent_enabled_by_env() -> bool {
    !std::env::var(AGENT_ENV).is_ok_and(|v| matches!(v.trim(), "0" | "off" | "false"))
}

/// Whether this build embeds the agent kernel (`cargo xtask build-kernels` built it).
pub fn agent_built() -> bool {
    modules::MODULES.iter().any(|(n, _)| *n == "agent")
}

struct Registry {
    agents: Vec<(usize, Weak<Agent>)>,
    /// Contexts on which the agent could not be used, and why (said once in the log).
    refused: Vec<(usize, String)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    agents: Vec::new(),
    refused: Vec::new(),
});

/// The agent of `ctx`'s GPU in this process, started on first use; `None` when it is switched
/// off, not built, or could not be started or would block driver calls here (logged once per
/// context, with the reason).
pub(crate) fn shared(ctx: &Arc<CudaContext>) -> Option<Arc<Agent>> {
    if !agent_enabled_by_env() {
        return None;
    }
    let key = ctx.cu_ctx() as usize;
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    reg.agents.retain(|(_, w)| w.strong_count() > 0);
    if let Some(a) = reg
        .agents
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Some(a);
    }
    if reg.refused.iter().any(|(k, _)| *k == key) {
        return None;
    }
    match Agent::start(ctx) {
        Ok(a) => {
            let a = Arc::new(a);
            reg.agents.push((key, Arc::downgrade(&a)));
            tracing::info!(
                "emulated NIC on GPU {}: GPU agent running ({AGENT_ENV}=0 turns it off)",
                ctx.ordinal()
            );
            Some(a)
        }
        Err(e) => {
            reg.refused.push((key, e.to_string()));
            tracing::warn!(
                "emulated NIC on GPU {}: no GPU agent, small operations go through copy engines \
                 and host-computed atomics: {e}",
                ctx.ordinal()
            );
            None
        }
    }
}

/// Stops every live agent of the process when it exits (from `.fini_array`, after `main`
/// returns or `exit` is called), in case a NIC was never dropped: the driver's teardown of a
/// context should not find the agent mid-command. Waits a little (bounded) for each to end.
extern "C" fn stop_agents_at_exit() {
    let Ok(reg) = REGISTRY.try_lock() else {
        return;
    };
    let live: Vec<Arc<Agent>> = reg.agents.iter().filter_map(|(_, w)| w.upgrade()).collect();
    drop(reg);
    for a in &live {
        a.ctrl.store_u32(CTRL_STOP, 1);
    }
    let t0 = Instant::now();
    while live.iter().any(|a| a.alive()) && t0.elapsed() < Duration::from_millis(200) {
        std::thread::yield_now();
    }
    // The Arcs are forgotten, not dropped: no driver calls while the process is going away.
    std::mem::forget(live);
}

// Linux runs the functions listed in `.fini_array` at exit.
#[used]
#[link_section = ".fini_array"]
static STOP_AGENTS_AT_EXIT: extern "C" fn() = stop_agents_at_exit;

/// Why this process runs `ctx`'s GPU without the agent, once a backend on it has tried to start
/// one and failed (`None`: it has not tried, or the agent runs, or it is switched off by
/// [`AGENT_ENV`]).
pub fn agent_refusal(ctx: &CudaContext) -> Option<String> {
    let key = ctx.cu_ctx() as usize;
    REGISTRY
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .refused
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, why)| why.clone())
}

/// How many times this process has launched the agent on `ctx`'s GPU (its first start and
/// every relaunch after an idle exit); `None` when no agent lives there.
pub fn agent_launches(ctx: &CudaContext) -> Option<u32> {
    let key = ctx.cu_ctx() as usize;
    let reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    reg.agents
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
        .map(|a| a.launched.load(Ordering::Acquire))
}

/// A loaded module (unloaded by `Agent::drop` once the kernel has ended).
struct Module(sys::CUmodule);

/// One GPU's agent: the kernel, its ring and control block, and who may write to the ring.
pub(crate) struct Agent {
    ctx: Arc<CudaContext>,
    ring: HostBuffer,
    ring_dev: u64,
    ctrl: HostBuffer,
    ctrl_dev: u64,
    /// The next command number to hand out; held while a slot is written, so slots are
    /// published in number order.
    producer: Mutex<u64>,
    /// Lane indices not in use.
    free_lanes: Mutex<Vec<u32>>,
    module: Option<Module>,
    func: sys::CUfunction,
    /// The generation of the latest launch enqueued (0: none yet); written under `launch`.
    launched: AtomicU32,
    /// Held while a launch is decided and enqueued (never while anything else is held).
    launch: Mutex<()>,
    stream: Arc<CudaStream>,
    _lease: StreamLease,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("gpu", &self.ctx.ordinal())
            .field("done", &self.done())
            .field("state", &self.state())
            .finish()
    }
}

// The raw module handle is only used by `Drop` (with the context bound), the function handle
// only by launches, under `launch` and with the context bound (driver handles may be used from
// any thread); every other field is Send and Sync (pinned buffers are, the stream wrapper is,
// the counters are behind mutexes or atomics).
// SAFETY: no field is tied to the thread that made it, as said above.
unsafe impl Send for Agent {}
// SAFETY: as for Send: shared use goes through `&self` methods that lock or use atomics.
unsafe impl Sync for Agent {}

impl Agent {
    /// Loads the kernel, allocates the ring, launches the agent, waits until it runs and probes
    /// that the driver calls the project makes while NICs live still return.
    fn start(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        let fatbin = modules::MODULES
            .iter()
            .find(|(n, _)| *n == "agent")
            .map(|(_, b)| *b)
            .ok_or_else(|| {
                EmuError::BadConfig(
                    "the agent kernel is not built (cargo xtask build-kernels)".into(),
                )
            })?;
        ctx.bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
        // The driver wants the image 8-byte aligned; include_bytes! promises 1.
        let image: Vec<u64> = fatbin
            .chunks(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                u64::from_ne_bytes(w)
            })
            .collect();
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a complete fatbin image in aligned memory that lives
        // across the call; the context is current.
        check("cuModuleLoadData (agent)", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void)
        })?;
        let module = Module(module);
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a live module and a NUL-terminated name.
        check("cuModuleGetFunction (emu_agent)", unsafe {
            sys::cuModuleGetFunction(&mut func, module.0, c"emu_agent".as_ptr())
        })?;
        let ring = HostBuffer::pinned(ctx, RING_SLOTS * SLOT_BYTES)?;
        let ctrl = HostBuffer::pinned(ctx, CTRL_BYTES)?;
        let no_dev = || EmuError::BadConfig("pinned memory without a device address".into());
        let ring_dev = ring.device_addr().ok_or_else(no_dev)?;
        let ctrl_dev = ctrl.device_addr().ok_or_else(no_dev)?;
        let (stream, lease) = ibgda_device::stream_pool::waiting(ctx)?;
        let agent = Agent {
            ctx: ctx.clone(),
            ring,
            ring_dev,
            ctrl,
            ctrl_dev,
            producer: Mutex::new(1),
            free_lanes: Mutex::new((0..MAX_LANES as u32).rev().collect()),
            module: Some(module),
            func,
            launched: AtomicU32::new(0),
            launch: Mutex::new(()),
            stream,
            _lease: lease,
        };
        agent.relaunch(0)?;
        let t0 = Instant::now();
        while agent.state().generation == 0 {
            if t0.elapsed() > START_BOUND {
                // Dropping stops it should it start later.
                return Err(EmuError::BackendTimeout {
                    backend: "cuda",
                    what: "the GPU agent to start",
                    waited: t0.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        agent.probe_driver_calls(image)?;
        Ok(agent)
    }

    /// Runs, on a helper thread, the driver calls the project makes while NICs live (a device
    /// allocation and free, a pinned allocation and free, a module load and unload); these wait
    /// for the agent's idle exit, so they must return within [`PROBE_BOUND`]; when one does not,
    /// something keeps the agent (or the call) from ending: stop the agent and refuse.
    fn probe_driver_calls(&self, image: Vec<u64>) -> Result<(), EmuError> {
        let ctx = self.ctx.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let helper = std::thread::spawn(move || {
            let r = (|| -> Result<(), EmuError> {
                ctx.bind_to_thread()
                    .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
                // The free first: the agent has just started, so it still runs.
                let mut dptr = 0u64;
                // SAFETY: a valid out-pointer; the context is current.
                check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut dptr, 4096) })?;
                // SAFETY: allocated just above, freed once.
                check("cuMemFree", unsafe { sys::cuMemFree_v2(dptr) })?;
                let pinned = HostBuffer::pinned(&ctx, 4096)?;
                drop(pinned);
                let mut module: sys::CUmodule = std::ptr::null_mut();
                // SAFETY: a valid out-pointer and a complete, aligned fatbin image that lives
                // across the call; the context is current.
                check("cuModuleLoadData (probe)", unsafe {
                    sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void)
                })?;
                // SAFETY: loaded just above, nothing of it runs, unloaded once.
                check("cuModuleUnload (probe)", unsafe {
                    sys::cuModuleUnload(module)
                })?;
                Ok(())
            })();
            let _ = tx.send(r);
        });
        let outcome = rx.recv_timeout(PROBE_BOUND);
        let blocked = outcome.is_err();
        if blocked {
            self.ctrl.store_u32(CTRL_STOP, 1);
        }
        let helper_result = match outcome {
            Ok(r) => r,
            Err(_) => rx
                .recv_timeout(STOP_BOUND)
                .unwrap_or(Err(EmuError::BackendTimeout {
                    backend: "cuda",
                    what: "driver calls after the agent stopped",
                    waited: STOP_BOUND,
                })),
        };
        if helper.is_finished() || !blocked {
            let _ = helper.join();
        }
        helper_result?;
        if blocked {
            return Err(EmuError::Unsupported {
                backend: "cuda",
                what: "run the GPU agent here: device or pinned allocations, frees or module \
                       loads did not return within the agent's idle exit and a margin",
            });
        }
        Ok(())
    }

    /// Every command numbered up to this has landed.
    pub fn done(&self) -> u64 {
        self.ctrl.load_u64(CTRL_DONE)
    }

    /// The state word as it is now.
    pub fn state(&self) -> AgentState {
        AgentState::decode(self.ctrl.load_u64(CTRL_STATE))
    }

    /// Whether a launch of the kernel is running (not ended; one enqueued and not yet started
    /// does not count).
    fn alive(&self) -> bool {
        !matches!(self.state().phase, PHASE_EXITED | 0)
    }

    /// Enqueues launch `generation` of the kernel on the agent's stream.
    fn launch_kernel(&self, generation: u32) -> Result<(), EmuError> {
        self.ctx
            .bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
        let mut params = AgentParams {
            ring: self.ring_dev,
            ctrl: self.ctrl_dev,
            nslots: RING_SLOTS as u32,
            generation,
            idle_exit_ns: AGENT_IDLE_EXIT.as_nanos() as u64,
        };
        let mut args = [&mut params as *mut AgentParams as *mut c_void];
        // `emu_agent(emu_agent_params)` takes one 32-byte struct, which `AgentParams` is
        // (asserted on both sides); the ring and control block are pinned and outlive the
        // kernel (the agent is stopped and waited for before they are freed, see Drop).
        // SAFETY: the arguments match the kernel, as said above, and the context is current.
        check("cuLaunchKernel (emu_agent)", unsafe {
            sys::cuLaunchKernel(
                self.func,
                1,
                1,
                1,
                AGENT_THREADS,
                1,
                1,
                0,
                self.stream.cu_stream(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Launches generation `exited + 1`, unless a launch after generation `exited` has been
    /// enqueued already (by another producer). Launches on one stream run one after another, so
    /// at most one agent runs at a time.
    fn relaunch(&self, exited: u32) -> Result<(), EmuError> {
        let _launching = self.launch.lock().unwrap_or_else(|p| p.into_inner());
        let launched = self.launched.load(Ordering::Acquire);
        if launched != exited {
            return Ok(());
        }
        self.launch_kernel(exited.wrapping_add(1))?;
        self.launched
            .store(exited.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// After publishing a command: makes sure an agent will run it (module docs), relaunching
    /// the kernel if it has ended. Waits, at most [`STOP_BOUND`], for an ending agent to decide.
    fn cover_published(&self) -> Result<(), EmuError> {
        // The publish (a release store) is visible before the state word is read; the kernel
        // fences between its state store and its ring read the same way.
        fence(Ordering::SeqCst);
        let t0 = Instant::now();
        loop {
            let seen = self.state();
            match after_publish(seen, self.launched.load(Ordering::Acquire)) {
                AfterPublish::Covered => return Ok(()),
                AfterPublish::Launch { exited } => return self.relaunch(exited),
                AfterPublish::Recheck => {
                    if t0.elapsed() > STOP_BOUND {
                        return Err(EmuError::BackendTimeout {
                            backend: "cuda",
                            what: "the GPU agent to end or go on",
                            waited: t0.elapsed(),
                        });
                    }
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Device address of lane `i`'s done word (what its copy-engine stream waits on).
    pub fn lane_done_dev(&self, i: u32) -> u64 {
        self.ctrl_dev + (CTRL_LANE_DONE + 4 * i as usize) as u64
    }

    /// Lane `i`'s done word as it is now: the `lane_seq` of its last landed command.
    pub fn lane_done(&self, i: u32) -> u32 {
        self.ctrl.load_u32(CTRL_LANE_DONE + 4 * i as usize)
    }

    /// Device address of lane `i`'s copy-engine word.
    pub fn ce_word_dev(&self, i: u32) -> u64 {
        self.ctrl_dev + (CTRL_CE_WORDS + 4 * i as usize) as u64
    }

    /// Lane `i`'s copy-engine word as it is now.
    pub fn ce_word(&self, i: u32) -> u32 {
        self.ctrl.load_u32(CTRL_CE_WORDS + 4 * i as usize)
    }

    /// A lane index for a new QP, `None` when all [`MAX_LANES`] are in use.
    pub fn alloc_lane(&self) -> Option<u32> {
        self.free_lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
    }

    /// Gives a lane index back (its QP's work has landed).
    pub fn free_lane(&self, i: u32) {
        self.free_lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(i);
    }

    /// Publishes `cmd` (with `payload`, at most [`PAYLOAD_BYTES`], copied into its slot and
    /// named by `cmd.src` when not empty) and returns its number once an agent is sure to run it
    /// (relaunching the kernel after an idle exit). Waits, at most `timeout`, for a free slot.
    pub fn push(
        &self,
        mut cmd: AgentCmd,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<u64, EmuError> {
        debug_assert!(payload.len() <= PAYLOAD_BYTES);
        let mut next = self.producer.lock().unwrap_or_else(|p| p.into_inner());
        let seq = *next;
        if seq - self.done() > RING_SLOTS as u64 {
            self.wait_done(
                seq - RING_SLOTS as u64,
                timeout,
                "a free slot in the agent's ring",
            )?;
        }
        let at = slot_of(seq, RING_SLOTS) * SLOT_BYTES;
        if !payload.is_empty() {
            self.ring.write(at + 64, payload);
            cmd.src = self.ring_dev + (at + 64) as u64;
        }
        cmd.seq = 0;
        self.ring.write(at + 8, &cmd.to_bytes()[8..]);
        // Release: the fields and payload above are visible before the number.
        self.ring.store_u64(at, seq);
        *next = seq + 1;
        // A relaunch is a driver call: not under the producer lock.
        drop(next);
        self.cover_published()?;
        Ok(seq)
    }

    /// Waits, at most `timeout`, until command `seq` has landed.
    pub fn wait_done(
        &self,
        seq: u64,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(), EmuError> {
        let mut wait = SpinWait::new(timeout, 4000, what);
        // Every published command is covered by a running or enqueued agent (`cover_published`).
        while self.done() < seq {
            wait.pause()?;
        }
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.ctrl.store_u32(CTRL_STOP, 1);
        let t0 = Instant::now();
        let mut ended = false;
        if self.ctx.bind_to_thread().is_ok() {
            while t0.elapsed() < STOP_BOUND {
                // SAFETY: a live stream of the context just bound.
                match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                    sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
                        std::thread::sleep(Duration::from_micros(100))
                    }
                    _ => {
                        ended = true;
                        break;
                    }
                }
            }
        }
        if !ended {
            tracing::error!(
                "GPU {}: the emulated NIC's agent did not stop within {STOP_BOUND:?}; its ring \
                 and module are leaked so that it never reads freed memory",
                self.ctx.ordinal()
            );
            std::mem::forget(std::mem::replace(&mut self.ring, HostBuffer::new(0)));
            std::mem::forget(std::mem::replace(&mut self.ctrl, HostBuffer::new(0)));
            // The module is simply not unloaded (`Module` has no Drop).
            return;
        }
        if let Some(m) = self.module.take() {
            // SAFETY: the module was loaded by `start`, its kernel has ended, unloaded once.
            let _ = unsafe { sys::cuModuleUnload(m.0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(generation: u32, phase: u32) -> AgentState {
        AgentState { generation, phase }
    }

    #[test]
    fn the_state_word_is_generation_and_phase() {
        assert_eq!(
            AgentState::decode((7u64 << 32) | PHASE_STOPPING as u64),
            st(7, PHASE_STOPPING)
        );
        assert_eq!(AgentState::decode(0), st(0, 0));
    }

    #[test]
    fn a_running_agent_or_a_later_launch_covers_a_command() {
        assert_eq!(
            after_publish(st(3, PHASE_RUNNING), 3),
            AfterPublish::Covered
        );
        // Launched, not started yet: it reads the ring after it starts.
        assert_eq!(after_publish(st(0, 0), 1), AfterPublish::Covered);
        assert_eq!(after_publish(st(3, PHASE_EXITED), 4), AfterPublish::Covered);
        assert_eq!(
            after_publish(st(3, PHASE_STOPPING), 4),
            AfterPublish::Covered
        );
        // The new generation already runs while its launcher has not yet counted it.
        assert_eq!(
            after_publish(st(4, PHASE_RUNNING), 3),
            AfterPublish::Covered
        );
    }

    #[test]
    fn an_ending_agent_is_read_again_and_an_ended_one_relaunched() {
        assert_eq!(
            after_publish(st(3, PHASE_STOPPING), 3),
            AfterPublish::Recheck
        );
        assert_eq!(
            after_publish(st(3, PHASE_EXITED), 3),
            AfterPublish::Launch { exited: 3 }
        );
        assert_eq!(
            after_publish(st(0, 0), 0),
            AfterPublish::Launch { exited: 0 },
            "nothing launched yet"
        );
        // The new generation ended before its launcher counted it: launch the one after
        // (`relaunch` waits for the launcher under the launch mutex, then sees 4 == 4).
        assert_eq!(
            after_publish(st(4, PHASE_EXITED), 3),
            AfterPublish::Launch { exited: 4 }
        );
    }

    #[test]
    fn generations_compare_across_the_wrap() {
        assert_eq!(
            after_publish(st(u32::MAX, PHASE_EXITED), 0),
            AfterPublish::Covered,
            "generation 0 after u32::MAX is a later launch"
        );
        assert_eq!(
            after_publish(st(u32::MAX, PHASE_EXITED), u32::MAX),
            AfterPublish::Launch { exited: u32::MAX }
        );
    }
}
