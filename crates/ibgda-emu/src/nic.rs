//! One emulated NIC: its registrations, its QPs and the progress thread that drives them.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::wire::{db_word, dbr_send_word, Cqe64, WqeBB, UAR_BF_OFFSET, WQEBB_BYTES};

use crate::backend::MemoryBackend;
use crate::cq::{CqConfig, CqMode, CQE_BYTES};
use crate::doorbell::{DoorbellConfig, DoorbellState, UAR_PAGE_BYTES};
use crate::error::EmuError;
use crate::exec::FetchOrder;
use crate::fabric::{FabricInner, NodeId, QpInfo};
use crate::fault::{FaultPlan, Wire};
use crate::host::HostBuffer;
use crate::mr::{Access, Mr, Place, Region, Registry};
use crate::qp::{Peer, QpConfig, QpEngine, QpHandle, QpState, QpStatus, StepCtx};
use crate::strict::StrictMode;

/// Who drives the NIC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ProgressMode {
    /// A progress thread per NIC polls doorbells and executes WQEs.
    #[default]
    Thread,
    /// Nothing runs unless the program calls [`Nic::progress`] (deterministic tests).
    Manual,
}

/// How a NIC behaves.
#[derive(Clone, Debug, PartialEq)]
pub struct NicConfig {
    /// A name for messages and thread names.
    pub name: String,
    /// Progress thread or manual progress.
    pub progress: ProgressMode,
    /// Longest sleep of an idle progress thread (it spins, then yields, then sleeps this long
    /// between polls). Bounds the doorbell latency after a long idle period.
    pub idle_sleep: Duration,
    /// Doorbell words in GPU memory are read (by a copy) at most this often.
    pub device_poll_interval: Duration,
    /// Byte order of atomic results.
    pub fetch_order: FetchOrder,
    /// Bound of every wait inside the engine (stream drains around atomics and fences).
    pub op_timeout: Duration,
    /// WQEs one QP may execute per round before the next QP's turn.
    pub wqe_budget: usize,
    /// How strictly device code is held to what the hardware promises ([`StrictMode`]; from
    /// the environment by default: full strict mode unless `IBGDA_EMU_STRICT=0`).
    pub strict: StrictMode,
    /// Progress threads ([`ProgressMode::Thread`]); QP `n`'s WQEs are always executed by thread
    /// `n % progress_threads`, so each QP keeps its order. One thread decodes and checks a few
    /// million WQEs a second; more serve more busy QPs, each spinning a core while busy.
    pub progress_threads: usize,
}

impl Default for NicConfig {
    fn default() -> Self {
        Self {
            name: "emu".into(),
            progress: ProgressMode::Thread,
            idle_sleep: Duration::from_micros(50),
            device_poll_interval: Duration::from_micros(20),
            fetch_order: FetchOrder::Mlx5,
            op_timeout: Duration::from_secs(10),
            wqe_budget: 64,
            strict: StrictMode::from_env(),
            progress_threads: 1,
        }
    }
}

impl NicConfig {
    /// The default configuration under another name.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    /// With manual progress.
    pub fn manual(mut self) -> Self {
        self.progress = ProgressMode::Manual;
        self
    }

    /// With strict mode `strict`.
    pub fn strict(mut self, strict: StrictMode) -> Self {
        self.strict = strict;
        self
    }

    /// With `n` progress threads (at least one).
    pub fn progress_threads(mut self, n: usize) -> Self {
        self.progress_threads = n.max(1);
        self
    }
}

pub(crate) struct QpSlot {
    pub engine: Mutex<QpEngine>,
    direct: Arc<AtomicU64>,
    /// Set by [`Nic::destroy_qp`] under the engine lock. The progress thread may still hold the
    /// slot in an older snapshot of the QP list; it checks this under the same lock and never
    /// touches a destroyed QP's rings, CQ or doorbell words again, which the QP's owner is free
    /// to release as soon as `destroy_qp` returns.
    retired: AtomicBool,
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

/// Whether the progress thread is (about to be) parked, on a cache line of its own: every
/// direct doorbell reads it, and the progress thread writes it only when it goes to sleep or
/// wakes up.
#[repr(align(64))]
#[derive(Debug, Default)]
struct Sleeping(AtomicBool);

pub(crate) struct NicShared {
    pub node: NodeId,
    pub index: u32,
    pub cfg: NicConfig,
    pub backend: Arc<dyn MemoryBackend>,
    pub registry: Arc<Registry>,
    pub ctx: Option<Arc<CudaContext>>,
    pub fabric: Weak<FabricInner>,
    pub imported: Mutex<HashMap<u64, crate::ipc::Imported>>,
    qps: Mutex<BTreeMap<u32, Arc<QpSlot>>>,
    qps_gen: AtomicU64,
    next_qpn: AtomicU32,
    next_key: AtomicU32,
    plan: RwLock<FaultPlan>,
    /// WQEs executed since the plan was set (all QPs), for [`FaultPlan::die_after_wqes`].
    executed: AtomicU64,
    wire: Mutex<Wire>,
    stop: AtomicBool,
    /// One per progress thread: whether it sleeps, and its handle for wake-ups that must not
    /// take a lock (doorbells).
    sleepers: Vec<Sleeper>,
}

/// A progress thread's sleeping flag and handle.
#[derive(Debug, Default)]
struct Sleeper {
    sleeping: Sleeping,
    handle: std::sync::OnceLock<std::thread::Thread>,
}

impl NicShared {
    fn slot(&self, qpn: u32) -> Result<Arc<QpSlot>, EmuError> {
        self.qps
            .lock()
            .expect("qps lock")
            .get(&qpn)
            .cloned()
            .ok_or_else(|| EmuError::NoSuchQp {
                nic: self.cfg.name.clone(),
                qpn,
            })
    }

    /// Locks QP `qpn`'s engine unless the QP has been destroyed (a caller that looked the slot up
    /// just before `destroy_qp` removed it).
    fn live<'a>(
        &self,
        qpn: u32,
        slot: &'a QpSlot,
    ) -> Result<std::sync::MutexGuard<'a, QpEngine>, EmuError> {
        let e = slot.engine.lock().expect("qp lock");
        if slot.retired.load(Ordering::Relaxed) {
            return Err(EmuError::NoSuchQp {
                nic: self.cfg.name.clone(),
                qpn,
            });
        }
        Ok(e)
    }

    fn snapshot(&self) -> (u64, Vec<Arc<QpSlot>>) {
        self.shard(0, 1)
    }

    /// The QPs progress thread `k` of `n` serves.
    fn shard(&self, k: usize, n: usize) -> (u64, Vec<Arc<QpSlot>>) {
        let qps = self.qps.lock().expect("qps lock");
        (
            self.qps_gen.load(Ordering::Acquire),
            qps.iter()
                .filter(|(qpn, _)| **qpn as usize % n == k)
                .map(|(_, s)| s.clone())
                .collect(),
        )
    }

    fn round(&self, qps: &[Arc<QpSlot>]) -> bool {
        let plan = self.plan.read().expect("plan lock");
        // A dead NIC (peer death) does nothing at all any more.
        if plan.dead(self.executed.load(Ordering::Relaxed)) {
            return false;
        }
        let cx = StepCtx {
            backend: &*self.backend,
            local: &self.registry,
            plan: &plan,
            wire: &self.wire,
            cfg: &self.cfg,
            executed: &self.executed,
        };
        let mut did = false;
        for slot in qps {
            let mut e = slot.engine.lock().expect("qp lock");
            // A QP destroyed since this snapshot was taken: its memory may be gone.
            if slot.retired.load(Ordering::Relaxed) {
                continue;
            }
            match e.step(&cx) {
                Ok(d) => did |= d,
                Err(err) => {
                    if e.state != QpState::Error {
                        tracing::error!(nic = %self.cfg.name, qpn = e.qpn, "QP moved to error: {err}");
                    }
                    e.force_error(format!("engine failure: {err}"));
                }
            }
        }
        did
    }

    fn wake(&self) {
        for t in self.sleepers.iter().filter_map(|s| s.handle.get()) {
            t.unpark();
        }
    }

    /// Wakes the progress thread if it sleeps; lock-free, for doorbells. Pairs with the
    /// progress loop's "announce sleep, look once more, then park": either this sees the flag
    /// and unparks (a token that makes the coming park return at once), or the loop's last look
    /// sees the doorbell word, which the caller stored before (both sides SeqCst).
    fn wake_if_sleeping(&self) {
        for s in &self.sleepers {
            if s.sleeping.0.load(Ordering::SeqCst) {
                if let Some(t) = s.handle.get() {
                    t.unpark();
                }
            }
        }
    }
}

/// Progress thread `k` of the NIC's `n`: the QPs whose number is `k` modulo `n`.
fn progress_loop(shared: Arc<NicShared>, k: usize) {
    let n = shared.sleepers.len();
    let me = &shared.sleepers[k];
    if let Err(e) = shared.backend.bind_thread() {
        tracing::error!(nic = %shared.cfg.name, "progress thread cannot start: {e}");
        return;
    }
    const SPIN: Duration = Duration::from_micros(200);
    const YIELD: Duration = Duration::from_millis(5);
    /// Idle rounds between clock reads while spinning (a clock read can be a system call in a
    /// VM; a round is far cheaper).
    const CLOCK_EVERY: u32 = 64;
    let (mut gen, mut qps) = shared.shard(k, n);
    let mut idle_since: Option<Instant> = None;
    let mut idle_rounds = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        if shared.qps_gen.load(Ordering::Acquire) != gen {
            // The old snapshot is dropped here, outside any round: QPs destroyed meanwhile are
            // released on this thread (their lanes need its context).
            (gen, qps) = shared.shard(k, n);
        }
        if shared.round(&qps) {
            idle_since = None;
            idle_rounds = 0;
            continue;
        }
        idle_rounds = idle_rounds.wrapping_add(1);
        if idle_rounds % CLOCK_EVERY != 0 {
            std::hint::spin_loop();
            continue;
        }
        // Idle time counts from the first clock read of the idle period.
        let idle = idle_since.get_or_insert_with(Instant::now).elapsed();
        if idle < SPIN {
            std::hint::spin_loop();
        } else if idle < YIELD {
            std::thread::yield_now();
        } else {
            me.sleeping.0.store(true, Ordering::SeqCst);
            // Orders the flag before the doorbell words this round reads (see wake_if_sleeping).
            std::sync::atomic::fence(Ordering::SeqCst);
            // One more look after announcing the sleep: a doorbell stored before a ringer read
            // the flag as false is seen here.
            let did = shared.round(&qps);
            if !did && !shared.stop.load(Ordering::Acquire) {
                std::thread::park_timeout(shared.cfg.idle_sleep);
            }
            me.sleeping.0.store(false, Ordering::SeqCst);
            if did {
                idle_since = None;
                idle_rounds = 0;
            }
        }
    }
}

/// An emulated mlx5 NIC. Create it through a [`Fabric`](crate::Fabric); dropping it stops its
/// progress thread.
///
/// ```
/// use ibgda_emu::{Access, CqMode, Fabric, NicConfig};
/// use ibgda_device::wire::{InlineWrite, RemoteAddr};
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// let fabric = Fabric::new();
/// let (a, b) = (fabric.host_nic(NicConfig::named("a"))?, fabric.host_nic(NicConfig::named("b"))?);
/// let dst = Arc::new(ibgda_emu::HostBuffer::new(64));
/// let mr = b.register_host(&dst, 0, 64, Access::REMOTE_WRITE)?;
/// let qp = a.create_host_qp(64, CqMode::Ring, 64)?;
/// let peer = b.create_host_qp(64, CqMode::Ring, 64)?;
/// a.connect(qp.qpn(), &b.qp_info(peer.qpn())?)?;
/// qp.post(0, &InlineWrite::new(qp.qpn(), 0, RemoteAddr { addr: mr.addr, rkey: mr.rkey }, b"hi").cqe(true).build());
/// qp.ring_dbr(1);
/// a.wait_idle(qp.qpn(), Duration::from_secs(5))?;
/// assert_eq!(dst.read_vec(0, 2), b"hi");
/// assert!(qp.poll_cqe(0).is_some());
/// # Ok::<(), ibgda_emu::EmuError>(())
/// ```
pub struct Nic {
    pub(crate) shared: Arc<NicShared>,
    join: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic")
            .field("name", &self.shared.cfg.name)
            .field("node", &self.shared.node)
            .field("backend", &self.shared.backend.name())
            .finish()
    }
}

impl Nic {
    pub(crate) fn start(
        node: NodeId,
        index: u32,
        cfg: NicConfig,
        backend: Arc<dyn MemoryBackend>,
        ctx: Option<Arc<CudaContext>>,
        fabric: Weak<FabricInner>,
    ) -> Result<Self, EmuError> {
        let cfg_threads = match cfg.progress {
            ProgressMode::Manual => 0,
            ProgressMode::Thread => cfg.progress_threads.max(1),
        };
        let shared = Arc::new(NicShared {
            node,
            index,
            cfg,
            backend,
            registry: Arc::new(Registry::default()),
            ctx,
            fabric,
            imported: Mutex::new(HashMap::new()),
            qps: Mutex::new(BTreeMap::new()),
            qps_gen: AtomicU64::new(0),
            next_qpn: AtomicU32::new(1),
            next_key: AtomicU32::new(1),
            plan: RwLock::new(FaultPlan::default()),
            executed: AtomicU64::new(0),
            wire: Mutex::new(Wire::default()),
            stop: AtomicBool::new(false),
            sleepers: (0..cfg_threads).map(|_| Sleeper::default()).collect(),
        });
        let mut nic = Self {
            shared,
            join: Vec::new(),
        };
        for k in 0..cfg_threads {
            let s = nic.shared.clone();
            let name = match cfg_threads {
                1 => format!("nic-{}", s.cfg.name),
                _ => format!("nic-{}-{k}", s.cfg.name),
            };
            // On failure `nic` drops here, which stops and joins the threads already started.
            let h = std::thread::Builder::new()
                .name(name)
                .spawn(move || progress_loop(s, k))
                .map_err(|e| EmuError::BadConfig(format!("spawning a progress thread: {e}")))?;
            let _ = nic.shared.sleepers[k].handle.set(h.thread().clone());
            nic.join.push(h);
        }
        Ok(nic)
    }

    /// This NIC's node id (what peers' [`QpInfo`] name).
    pub fn node(&self) -> NodeId {
        self.shared.node
    }

    /// The NIC's name.
    pub fn name(&self) -> &str {
        &self.shared.cfg.name
    }

    /// The memory backend.
    pub fn backend(&self) -> &Arc<dyn MemoryBackend> {
        &self.shared.backend
    }

    /// The CUDA context of a CUDA NIC.
    pub fn cuda_context(&self) -> Option<&Arc<CudaContext>> {
        self.shared.ctx.as_ref()
    }

    // ---- registrations ------------------------------------------------------------------

    fn insert_region(
        &self,
        addr: u64,
        len: u64,
        place: Place,
        access: Access,
        keep: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Mr, EmuError> {
        if place == Place::Device && !self.shared.backend.supports_device() {
            return Err(EmuError::Unsupported {
                backend: self.shared.backend.name(),
                what: "register GPU memory",
            });
        }
        if addr.checked_add(len).is_none() {
            return Err(EmuError::BadConfig(format!(
                "range {addr:#x}+{len} overflows"
            )));
        }
        let seq = self.shared.next_key.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        let key = ((self.shared.index & 0xff) << 24) | seq;
        let mr = Mr {
            lkey: key,
            rkey: key,
            addr,
            len,
            access,
            place,
        };
        self.shared.registry.insert(Region {
            mr,
            base: addr,
            _keep: keep,
        });
        Ok(mr)
    }

    /// Registers `[addr, addr + len)` of `place` memory.
    ///
    /// # Safety
    /// The range must stay valid (and, for [`Place::Host`], mapped in this process) until it is
    /// deregistered and every QP that could name it has been idle since: the NIC reads and writes
    /// it whenever WQEs say so.
    pub unsafe fn register_raw(
        &self,
        addr: u64,
        len: u64,
        place: Place,
        access: Access,
    ) -> Result<Mr, EmuError> {
        self.insert_region(addr, len, place, access, None)
    }

    /// Registers `len` bytes at `offset` of a host buffer (the registration keeps it alive).
    pub fn register_host(
        &self,
        buf: &Arc<HostBuffer>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<Mr, EmuError> {
        if offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(EmuError::BadConfig(format!(
                "range {offset}+{len} outside a host buffer of {} bytes",
                buf.len()
            )));
        }
        let keep: Arc<dyn Any + Send + Sync> = buf.clone();
        self.insert_region(
            buf.addr() + offset as u64,
            len as u64,
            Place::Host,
            access,
            Some(keep),
        )
    }

    /// Registers `len` bytes at `offset` of GPU memory (CUDA NICs; the registration keeps the
    /// buffer alive).
    pub fn register_device(
        &self,
        buf: &Arc<DeviceBuffer>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<Mr, EmuError> {
        if offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(EmuError::BadConfig(format!(
                "range {offset}+{len} outside a device buffer of {} bytes",
                buf.len()
            )));
        }
        let keep: Arc<dyn Any + Send + Sync> = buf.clone();
        self.insert_region(
            buf.ptr() + offset as u64,
            len as u64,
            Place::Device,
            access,
            Some(keep),
        )
    }

    /// Removes a registration. WQEs that name it afterwards fail like hardware's would.
    pub fn deregister(&self, mr: &Mr) -> Result<(), EmuError> {
        self.shared
            .registry
            .remove(mr.lkey)
            .map(|_| ())
            .ok_or_else(|| EmuError::NoSuchKey {
                nic: self.shared.cfg.name.clone(),
                key: mr.lkey,
            })
    }

    /// Every current registration.
    pub fn registrations(&self) -> Vec<Mr> {
        self.shared.registry.all().iter().map(|r| r.mr).collect()
    }

    // ---- QPs ----------------------------------------------------------------------------

    fn create_qp_keep(
        &self,
        cfg: QpConfig,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<QpHandle, EmuError> {
        let uar = if cfg.doorbell.uar {
            Some(Arc::new(self.shared.backend.alloc_host(UAR_PAGE_BYTES)?))
        } else {
            None
        };
        self.create_qp_with_uar(cfg, uar, false, keep)
    }

    /// Creates a QP whose UAR page and CQ are firmware objects: `uar` may be shared by other
    /// QPs (doorbell words naming another QP are then expected, not suspect), and the CQ was
    /// initialised by its owner before `CREATE_CQ` and may serve other QPs, so it is not
    /// rewritten here.
    ///
    /// # Safety
    /// As [`create_qp`](Nic::create_qp).
    pub(crate) unsafe fn create_qp_on_page(
        &self,
        cfg: QpConfig,
        uar: Arc<HostBuffer>,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<QpHandle, EmuError> {
        self.create_qp_with_uar(cfg, Some(uar), true, keep)
    }

    /// `from_firmware`: see [`create_qp_on_page`](Nic::create_qp_on_page).
    fn create_qp_with_uar(
        &self,
        cfg: QpConfig,
        uar: Option<Arc<HostBuffer>>,
        from_firmware: bool,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<QpHandle, EmuError> {
        let backend = &*self.shared.backend;
        cfg.validate(backend)?;
        backend.bind_thread()?;
        let seq = self.shared.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xffff;
        let qpn = ((self.shared.index & 0xff) << 16) | seq;
        let mut lane = backend.new_lane()?;
        // The NIC owns the CQ's contents: start with every entry invalid (opcode 15, owner 0),
        // which a poller reads as empty on the first pass.
        let invalid = Cqe64::invalid();
        let n = if from_firmware {
            0
        } else {
            cfg.cq.bytes() / CQE_BYTES
        };
        for i in 0..n {
            // SAFETY: the caller of `create_qp` vouched for the CQ memory; `i < n` keeps the
            // write inside it.
            unsafe {
                lane.put(
                    cfg.cq.loc.offset(i * CQE_BYTES),
                    bytemuck::bytes_of(&invalid),
                )?
            };
        }
        lane.fence(self.shared.cfg.op_timeout)?;
        let db = DoorbellState::new(cfg.doorbell, uar, from_firmware);
        let handle = QpHandle {
            qpn,
            uar: db.uar_info(),
        };
        let direct = db.direct.clone();
        let engine = QpEngine::new(
            qpn,
            cfg,
            lane,
            db,
            &self.shared.cfg.strict,
            backend.supports_device(),
        );
        let slot = Arc::new(QpSlot {
            engine: Mutex::new(engine),
            direct,
            retired: AtomicBool::new(false),
            _keep: keep,
        });
        self.shared.qps.lock().expect("qps lock").insert(qpn, slot);
        self.shared.qps_gen.fetch_add(1, Ordering::AcqRel);
        Ok(handle)
    }

    /// Creates a QP (state [`QpState::Reset`]) over rings the caller placed.
    ///
    /// # Safety
    /// The send ring, the CQ and the doorbell words named in `cfg` must stay valid memory of the
    /// kinds named until the QP is destroyed or the NIC dropped: the NIC reads and writes them
    /// from its own thread.
    pub unsafe fn create_qp(&self, cfg: QpConfig) -> Result<QpHandle, EmuError> {
        self.create_qp_keep(cfg, Vec::new())
    }

    /// Creates a QP whose send ring (`nwqebbs` WQEBBs), CQ and doorbell record are allocated
    /// here, in host memory the NIC reads directly (pinned and mapped for GPU code on a CUDA
    /// NIC), with an emulated UAR page. The returned [`HostQp`] writes WQEs and rings like a
    /// CPU proxy would.
    pub fn create_host_qp(
        &self,
        nwqebbs: u32,
        cq_mode: CqMode,
        ncqes: u32,
    ) -> Result<HostQp, EmuError> {
        let backend = &*self.shared.backend;
        let ncqes = if cq_mode == CqMode::Collapsed {
            1
        } else {
            ncqes
        };
        let sq = Arc::new(backend.alloc_host(nwqebbs.max(1) as usize * WQEBB_BYTES)?);
        let cq = Arc::new(backend.alloc_host(ncqes.max(1) as usize * CQE_BYTES as usize)?);
        let dbr = Arc::new(backend.alloc_host(64)?);
        let cfg = QpConfig {
            sq: sq.loc(0),
            nwqebbs,
            cq: CqConfig {
                loc: cq.loc(0),
                ncqes,
                mode: cq_mode,
            },
            doorbell: DoorbellConfig {
                dbr: Some(dbr.loc(0)),
                uar: true,
                producer_slot: None,
            },
        };
        let keep: Vec<Arc<dyn Any + Send + Sync>> = vec![sq.clone(), cq.clone(), dbr.clone()];
        let handle = self.create_qp_keep(cfg, keep)?;
        let uar = handle.uar.expect("asked for a UAR page");
        Ok(HostQp {
            handle,
            cfg,
            sq,
            cq,
            dbr,
            uar_reg: uar.bf_reg,
        })
    }

    /// Destroys a QP. Work in flight on its lane is waited for (bounded). Once this returns the
    /// NIC never touches the QP's rings, CQ or doorbell words again, whatever the outcome, so
    /// their owner may free them.
    pub fn destroy_qp(&self, qpn: u32) -> Result<(), EmuError> {
        let slot = self
            .shared
            .qps
            .lock()
            .expect("qps lock")
            .remove(&qpn)
            .ok_or_else(|| EmuError::NoSuchQp {
                nic: self.shared.cfg.name.clone(),
                qpn,
            })?;
        self.shared.qps_gen.fetch_add(1, Ordering::AcqRel);
        let mut e = slot.engine.lock().expect("qp lock");
        // Retired first, under the engine lock: from here on no round steps this QP, even one
        // over a snapshot taken before the removal above.
        slot.retired.store(true, Ordering::Relaxed);
        self.shared.backend.bind_thread()?;
        e.lane.fence(self.shared.cfg.op_timeout)
    }

    /// What a peer needs to connect to QP `qpn` in this process.
    pub fn qp_info(&self, qpn: u32) -> Result<QpInfo, EmuError> {
        self.shared.slot(qpn)?;
        Ok(QpInfo {
            node: self.shared.node,
            qpn,
            exports: Vec::new(),
        })
    }

    fn peer_registry(&self, remote: &QpInfo) -> Result<Arc<Registry>, EmuError> {
        if let Some(peer) = self
            .shared
            .fabric
            .upgrade()
            .and_then(|f| FabricInner::lookup(&f, remote.node))
        {
            if let (Some(a), Some(b)) = (&self.shared.ctx, &peer.ctx) {
                if let Err(e) = ibgda_device::cuda::enable_peer_access(a, b) {
                    tracing::warn!(
                        nic = %self.shared.cfg.name,
                        "no peer access to {}: copies will be staged through the host ({e})",
                        peer.cfg.name
                    );
                }
                self.shared.backend.bind_thread()?;
            }
            return Ok(peer.registry.clone());
        }
        if remote.exports.is_empty() {
            return Err(EmuError::UnknownPeer {
                node: remote.node.0,
            });
        }
        crate::ipc::import(&self.shared, remote)
    }

    /// Connects QP `qpn` (in [`QpState::Reset`]) to the remote QP `remote` and moves it to
    /// [`QpState::Rts`]. Peers in this process are found through the fabric; peers in another
    /// process through the registrations exported in `remote` (CUDA IPC).
    pub fn connect(&self, qpn: u32, remote: &QpInfo) -> Result<(), EmuError> {
        self.connect_with_access(qpn, remote, None)
    }

    /// [`connect`](Nic::connect), with the responder QP's granted rights (`Access` bits, read
    /// at every WQE) checked besides the registrations: what the firmware path sets up.
    pub(crate) fn connect_with_access(
        &self,
        qpn: u32,
        remote: &QpInfo,
        access: Option<Arc<AtomicU32>>,
    ) -> Result<(), EmuError> {
        let registry = self.peer_registry(remote)?;
        let slot = self.shared.slot(qpn)?;
        let mut e = self.shared.live(qpn, &slot)?;
        if e.state != QpState::Reset {
            return Err(EmuError::BadState {
                qpn,
                state: e.state,
                what: "connect",
            });
        }
        e.peer = Some(Peer {
            node: remote.node,
            qpn: remote.qpn,
            registry,
            access,
        });
        e.state = QpState::Rts;
        drop(e);
        self.shared.wake();
        Ok(())
    }

    /// Moves QP `qpn` to [`QpState::Reset`]: indices back to zero, peer forgotten, host-resident
    /// doorbell words zeroed (a GPU-resident doorbell record must be zeroed by its owner).
    pub fn reset_qp(&self, qpn: u32) -> Result<(), EmuError> {
        let slot = self.shared.slot(qpn)?;
        self.shared.backend.bind_thread()?;
        let mut e = self.shared.live(qpn, &slot)?;
        e.lane.fence(self.shared.cfg.op_timeout)?;
        e.reset();
        Ok(())
    }

    /// Forces QP `qpn` into [`QpState::Error`] (`ibv_modify_qp(IBV_QPS_ERR)`): every WQE from
    /// now on is flushed.
    pub fn set_error(&self, qpn: u32) -> Result<(), EmuError> {
        let slot = self.shared.slot(qpn)?;
        self.shared
            .live(qpn, &slot)?
            .force_error("moved to the error state by the program".into());
        self.shared.wake();
        Ok(())
    }

    /// The direct doorbell: tells the NIC that QP `qpn`'s ring is valid below `pi` (absolute,
    /// 64-bit). What a CPU proxy in this process calls instead of storing to a UAR page.
    pub fn ring_doorbell(&self, qpn: u32, pi: u64) -> Result<(), EmuError> {
        let slot = self.shared.slot(qpn)?;
        slot.direct.fetch_max(pi, Ordering::SeqCst);
        self.shared.wake_if_sleeping();
        Ok(())
    }

    /// QP `qpn`'s direct doorbell as a handle: [`DirectDoorbell::ring`] is
    /// [`ring_doorbell`](Nic::ring_doorbell) without the QP lookup (no lock, no allocation), for
    /// a CPU proxy's hot path. Ringing after the QP was destroyed does nothing.
    pub fn direct_doorbell(&self, qpn: u32) -> Result<DirectDoorbell, EmuError> {
        let slot = self.shared.slot(qpn)?;
        Ok(DirectDoorbell {
            word: slot.direct.clone(),
            nic: self.shared.clone(),
            qpn,
        })
    }

    /// A snapshot of QP `qpn`'s progress.
    pub fn qp_status(&self, qpn: u32) -> Result<QpStatus, EmuError> {
        let slot = self.shared.slot(qpn)?;
        let e = slot.engine.lock().expect("qp lock");
        Ok(e.status())
    }

    /// [`qp_status`](Nic::qp_status) without waiting longer than `wait` for the QP's engine:
    /// `Ok(None)` when the engine stayed busy that long (a progress thread is inside this QP's
    /// round, for example blocked in a backend wait), which is itself what a diagnosis needs.
    pub fn qp_status_within(&self, qpn: u32, wait: Duration) -> Result<Option<QpStatus>, EmuError> {
        let slot = self.shared.slot(qpn)?;
        let deadline = ibgda_device::timeout::deadline_after(Instant::now(), wait);
        loop {
            match slot.engine.try_lock() {
                Ok(e) => return Ok(Some(e.status())),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    return Ok(Some(p.into_inner().status()))
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }

    /// Replaces the fault plan (applies from the next round).
    pub fn set_fault_plan(&self, plan: FaultPlan) {
        let mut p = self.shared.plan.write().expect("plan lock");
        // Counted afresh under the new plan (rounds hold the read lock while they count).
        self.shared.executed.store(0, Ordering::Relaxed);
        *p = plan;
        drop(p);
        *self.shared.wire.lock().expect("wire lock") = Wire::default();
    }

    /// Runs one progress round over every QP in the calling thread (the only progress with
    /// [`ProgressMode::Manual`]; harmless besides a progress thread). Returns whether anything
    /// happened.
    pub fn progress(&self) -> Result<bool, EmuError> {
        self.shared.backend.bind_thread()?;
        let (_, qps) = self.shared.snapshot();
        Ok(self.shared.round(&qps))
    }

    /// Waits until QP `qpn` has executed everything its doorbells announced (doorbells rung
    /// before this call included) and written every CQE, and its data has landed; at most
    /// `timeout`, after which the error names the QP and its indices.
    pub fn wait_idle(&self, qpn: u32, timeout: Duration) -> Result<QpStatus, EmuError> {
        let slot = self.shared.slot(qpn)?;
        self.shared.backend.bind_thread()?;
        let start = Instant::now();
        let manual = self.shared.cfg.progress == ProgressMode::Manual;
        loop {
            if manual {
                self.progress()?;
            }
            {
                let mut e = self.shared.live(qpn, &slot)?;
                if e.state == QpState::Reset {
                    return Err(EmuError::BadState {
                        qpn,
                        state: e.state,
                        what: "wait for completions",
                    });
                }
                let plan = self.shared.plan.read().expect("plan lock");
                let cx = StepCtx {
                    backend: &*self.shared.backend,
                    local: &self.shared.registry,
                    plan: &plan,
                    wire: &self.shared.wire,
                    cfg: &self.shared.cfg,
                    executed: &self.shared.executed,
                };
                // A dead NIC reads no doorbell.
                if !plan.dead(self.shared.executed.load(Ordering::Relaxed)) {
                    e.poll_doorbells(&cx)?;
                }
                if e.is_idle() {
                    e.lane.fence(self.shared.cfg.op_timeout)?;
                    return Ok(e.status());
                }
                let waited = start.elapsed();
                if waited > timeout {
                    let s = e.status();
                    return Err(EmuError::Timeout {
                        nic: self.shared.cfg.name.clone(),
                        qpn,
                        what: "the QP to go idle",
                        waited,
                        fetched: s.fetched,
                        announced: s.announced,
                        cqes: s.cqes_written,
                        pending: s.pending_cqes,
                    });
                }
            }
            self.shared.wake();
            if !manual {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        // The progress threads check `stop` between steps, and every step is bounded by
        // `op_timeout` (stream drains) or the idle sleep; give them that and a margin, then leave
        // them (each owns an `Arc` of the shared state, so nothing it touches is freed).
        let bound = self
            .shared
            .cfg
            .op_timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(1));
        let start = std::time::Instant::now();
        for j in self.join.drain(..) {
            while !j.is_finished() && start.elapsed() < bound {
                std::thread::sleep(Duration::from_millis(1));
            }
            if !j.is_finished() {
                tracing::warn!(
                    "emulated NIC {}: progress thread still running {bound:?} after stop; left \
                     to end on its own",
                    self.shared.cfg.name
                );
            } else if let Err(payload) = j.join() {
                let text = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(a payload that is not text)".into());
                tracing::error!(
                    "emulated NIC {}: progress thread panicked: {text}",
                    self.shared.cfg.name
                );
            }
        }
        if let Some(f) = self.shared.fabric.upgrade() {
            f.remove(self.shared.node);
        }
    }
}

/// One QP's direct doorbell (see [`Nic::direct_doorbell`]). Keeps the NIC's shared state alive,
/// not its progress thread: ringing after the [`Nic`] was dropped does nothing.
#[derive(Clone)]
pub struct DirectDoorbell {
    word: Arc<AtomicU64>,
    nic: Arc<NicShared>,
    qpn: u32,
}

impl std::fmt::Debug for DirectDoorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectDoorbell")
            .field("nic", &self.nic.cfg.name)
            .field("qpn", &self.qpn)
            .finish()
    }
}

impl DirectDoorbell {
    /// Tells the NIC that the QP's ring is valid below `pi` (absolute, 64-bit; monotonic, a
    /// smaller value than one already rung is ignored). One atomic on the QP's doorbell word, and
    /// an unpark only when the progress thread sleeps. Writes before this call (the WQEs, a
    /// doorbell record) are visible to the NIC once it sees the new index.
    #[inline]
    pub fn ring(&self, pi: u64) {
        self.word.fetch_max(pi, Ordering::SeqCst);
        self.nic.wake_if_sleeping();
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
}

/// A QP whose send ring, CQ and doorbell record live in host memory allocated by the NIC (see
/// [`Nic::create_host_qp`]), with the producer's side of the protocol as plain calls: write a
/// WQE, ring (doorbell record, UAR page or direct), poll a CQE.
#[derive(Debug, Clone)]
pub struct HostQp {
    /// The QP's number and UAR page.
    pub handle: QpHandle,
    /// Where everything is (for a device QP descriptor: `sq` is `wq_base`, and so on).
    pub cfg: QpConfig,
    /// The send ring.
    pub sq: Arc<HostBuffer>,
    /// The CQ.
    pub cq: Arc<HostBuffer>,
    /// The doorbell record (8 bytes).
    pub dbr: Arc<HostBuffer>,
    uar_reg: u64,
}

impl HostQp {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.handle.qpn
    }

    /// Writes `wqe` into the slot of WQEBB index `index`.
    pub fn post(&self, index: u64, wqe: &WqeBB) {
        let slot = (index & (self.cfg.nwqebbs as u64 - 1)) as usize * WQEBB_BYTES;
        self.sq.write(slot, wqe.as_bytes());
    }

    /// Writes the doorbell record's send counter for producer index `pi` (release store).
    pub fn ring_dbr(&self, pi: u64) {
        self.dbr
            .store_u32(4, u32::from_ne_bytes(dbr_send_word(pi).to_bytes()));
    }

    /// Stores the doorbell word for producer index `pi` to the emulated UAR page.
    pub fn ring_uar(&self, pi: u64) {
        let page = self.uar_reg - UAR_BF_OFFSET as u64;
        // SAFETY: the UAR page is owned by the QP's engine, which lives as long as the NIC keeps
        // the QP; the register is 8-byte aligned inside the 4096-byte page.
        unsafe {
            std::sync::atomic::AtomicU64::from_ptr((page + UAR_BF_OFFSET as u64) as *mut u64)
        }
        .store(db_word(self.qpn(), pi), Ordering::Release);
    }

    /// The CQE in entry `slot`, as it is now.
    pub fn cqe(&self, slot: u32) -> Cqe64 {
        let off = slot as usize * CQE_BYTES as usize;
        // The NIC writes a CQE's first 56 bytes, then its last 8 (WQE counter, signature,
        // opcode and owner bit) with release order. Those 8 are read first, with acquire order,
        // so the body read after them is at least the one they were published with: one plain
        // copy of 64 bytes could pair a new owner bit with the slot's previous byte count
        // (seen on an H200: a 1 MiB write's CQE read with `byte_cnt` 0, 2026-12-02).
        let tail = self.cq.load_u64(off + 56);
        let mut b = [0u8; 64];
        self.cq.read(off, &mut b[..56]);
        b[56..].copy_from_slice(&tail.to_ne_bytes());
        bytemuck::pod_read_unaligned(&b)
    }

    /// The CQE a consumer at index `cons_idx` would read next, if the NIC has written it (ring
    /// CQs: owner-bit rule; collapsed CQs: entry 0 whenever it holds anything).
    pub fn poll_cqe(&self, cons_idx: u64) -> Option<Cqe64> {
        match self.cfg.cq.mode {
            CqMode::Ring => {
                let n = self.cfg.cq.ncqes;
                let c = self.cqe((cons_idx & (n as u64 - 1)) as u32);
                c.status(cons_idx, n)
                    .state()
                    .filter(|s| *s != ibgda_device::wire::CqeState::Empty)
                    .map(|_| c)
            }
            CqMode::Collapsed => {
                let c = self.cqe(0);
                (c.opcode() != ibgda_device::wire::cqe_opcode::INVALID).then_some(c)
            }
        }
    }
}
