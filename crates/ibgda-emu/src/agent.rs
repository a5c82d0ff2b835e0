//! The GPU agent: one persistent block (eight warps) per (process, GPU) that executes the emulated NICs' small
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
//! The agent holds one SM's worth of a warp from the moment the backend is created until it is
//! dropped, so it never asks for an SM while kernels that wait for the NIC fill the GPU
//! (`ep::residency::EMULATED_NIC_SMS` keeps SMs free of waiting kernels; the agent's is one of
//! them). It is launched on a waiting stream of [`ibgda_device::stream_pool`]: a hardware queue
//! of its own, so no other work queues behind it.
//!
//! # The hazard of a kernel that never ends
//!
//! A context-wide synchronisation (`cuCtxSynchronize`) waits for it forever, and on some driver
//! versions so do `cuMemFree`, `cuMemFreeHost` and pinned allocations. Creation therefore probes
//! the calls the project makes while NICs live (a module load and unload, a device allocation
//! and free, a pinned allocation and free) on a helper thread while the agent runs: if one does not return within
//! [`PROBE_BOUND`], the agent is stopped (which releases the call), the backend falls back to the
//! copy-engine path, and the log says why. Code that synchronises a whole context while an
//! emulated NIC lives must wait on its own streams instead (bounded).
//!
//! # Lifetime
//!
//! Agents are shared through a process-wide registry of weak references: every `CudaMemory` on
//! a context holds the context's agent; the last one dropped stops it (a flag in pinned memory
//! the agent polls when idle, and while it waits) and waits, at most [`STOP_BOUND`], for the
//! kernel to end. [`AGENT_ENV`]`=0` turns the agent off.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};
use ibgda_device::stream_pool::StreamLease;

use crate::agent_cmd::{
    slot_of, AgentCmd, AgentParams, CTRL_BYTES, CTRL_CE_WORDS, CTRL_DONE, CTRL_LANE_DONE,
    CTRL_STATE, CTRL_STOP, MAX_LANES, PAYLOAD_BYTES, SLOT_BYTES,
};
use crate::error::EmuError;
use crate::host::HostBuffer;

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

/// SMs the agent occupies on its GPU (one block on one SM, from creation on): part of what
/// `ep::residency::EMULATED_NIC_SMS` keeps free of waiting kernels.
pub const AGENT_SMS: u32 = 1;

/// Threads of the agent's block (`EMU_AGENT_MAX_THREADS` in `cuda/agent_cmd.cuh` is the most):
/// warp 0 reads the ring and runs atomics and CQEs; copies use all eight warps, because a copy's
/// rate is bound by the bytes it has in flight (32 KiB with eight warps, about 10 GB/s a warp).
/// A quarter of one SM's threads and a little over half its registers.
const AGENT_THREADS: u32 = 256;

/// Ring slots (a power of two, at least 32: the agent reads 32 at a time).
const RING_SLOTS: usize = 4096;

/// How long creation waits for the agent to report that it runs.
const START_BOUND: Duration = Duration::from_secs(5);

/// How long a probed driver call may take while the agent runs before the agent is judged to
/// block it (such calls take microseconds on an idle GPU; a blocked one never returns).
pub(crate) const PROBE_BOUND: Duration = Duration::from_millis(500);

/// How long dropping the agent waits for the kernel to end.
pub(crate) const STOP_BOUND: Duration = Duration::from_secs(5);

const STATE_RUNNING: u32 = 1;
const STATE_EXITED: u32 = 2;

fn check(call: &'static str, r: sys::CUresult) -> Result<(), EmuError> {
    r.result().map_err(EmuError::cuda(call))
}

/// Whether [`AGENT_ENV`] allows the agent.
pub(crate) fn enabled_by_env() -> bool {
    std::env::var(AGENT_ENV).map_or(true, |v| v.trim() != "0")
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
    if !enabled_by_env() {
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
/// context must not find a kernel that never ends. Waits a little (bounded) for each to end.
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
    while live.iter().any(|a| !a.exited()) && t0.elapsed() < Duration::from_millis(200) {
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
    stream: Arc<CudaStream>,
    _lease: StreamLease,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("gpu", &self.ctx.ordinal())
            .field("done", &self.done())
            .finish()
    }
}

// SAFETY: the raw module handle is only used by `Drop` (with the context bound); every other
// field is Send and Sync (pinned buffers are, the stream wrapper is, the counters are behind
// mutexes or atomics).
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
        let mut params = AgentParams {
            ring: ring_dev,
            ctrl: ctrl_dev,
            nslots: RING_SLOTS as u32,
            pad: 0,
        };
        let mut args = [&mut params as *mut AgentParams as *mut c_void];
        // SAFETY: `emu_agent(emu_agent_params)` takes one 24-byte struct, which `AgentParams`
        // is (asserted on both sides); the ring and control block are pinned and outlive the
        // kernel (the agent is stopped and waited for before they are freed, see Drop).
        check("cuLaunchKernel (emu_agent)", unsafe {
            sys::cuLaunchKernel(
                func,
                1,
                1,
                1,
                AGENT_THREADS,
                1,
                1,
                0,
                stream.cu_stream(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        let agent = Agent {
            ctx: ctx.clone(),
            ring,
            ring_dev,
            ctrl,
            ctrl_dev,
            producer: Mutex::new(1),
            free_lanes: Mutex::new((0..MAX_LANES as u32).rev().collect()),
            module: Some(module),
            stream,
            _lease: lease,
        };
        let t0 = Instant::now();
        while agent.ctrl.load_u32(CTRL_STATE) != STATE_RUNNING {
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

    /// Runs, on a helper thread, the driver calls the project makes while NICs live (a module
    /// load and unload, a device allocation and free, a pinned allocation and free); when one
    /// does not return within [`PROBE_BOUND`] the agent blocks it: stop the agent (which lets
    /// the call finish) and refuse.
    fn probe_driver_calls(&self, image: Vec<u64>) -> Result<(), EmuError> {
        let ctx = self.ctx.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let helper = std::thread::spawn(move || {
            let r = (|| -> Result<(), EmuError> {
                ctx.bind_to_thread()
                    .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
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
                let mut dptr = 0u64;
                // SAFETY: a valid out-pointer; the context is current.
                check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut dptr, 4096) })?;
                // SAFETY: allocated just above, freed once.
                check("cuMemFree", unsafe { sys::cuMemFree_v2(dptr) })?;
                let pinned = HostBuffer::pinned(&ctx, 4096)?;
                drop(pinned);
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
                what: "run a persistent agent here: device or pinned allocations and frees wait \
                       for running kernels on this driver",
            });
        }
        Ok(())
    }

    /// Every command numbered up to this has landed.
    pub fn done(&self) -> u64 {
        self.ctrl.load_u64(CTRL_DONE)
    }

    /// Whether the kernel has ended (stopped, or failed).
    pub fn exited(&self) -> bool {
        self.ctrl.load_u32(CTRL_STATE) == STATE_EXITED
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
    /// named by `cmd.src` when not empty) and returns its number. Waits, at most `timeout`, for a
    /// free slot.
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
        Ok(seq)
    }

    /// Waits, at most `timeout`, until command `seq` has landed.
    pub fn wait_done(
        &self,
        seq: u64,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(), EmuError> {
        let t0 = Instant::now();
        let mut polls = 0u32;
        while self.done() < seq {
            if self.exited() {
                return Err(EmuError::Unsupported {
                    backend: "cuda",
                    what: "execute commands: the GPU agent has exited",
                });
            }
            if t0.elapsed() > timeout {
                return Err(EmuError::BackendTimeout {
                    backend: "cuda",
                    what,
                    waited: t0.elapsed(),
                });
            }
            polls += 1;
            if polls < 4000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
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
