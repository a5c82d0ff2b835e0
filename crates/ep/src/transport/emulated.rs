//! QPs on the emulated NIC: a rank's NIC ([`EmuRank`]), its registered memory ([`Arena`]), and a
//! group of RC QPs to a peer ([`QpGroup`]) with every piece of protocol memory placed where its
//! handler mode puts it, the device descriptors filled, and the CPU proxy started when the mode
//! needs one.
//!
//! | | `gpu` | `cpu` | `cpu_host_memory` |
//! |---|---|---|---|
//! | send ring, CQ | [`RingPlacement`]: pinned host memory (the emulator reads it with CPU loads) or GPU memory | same | same |
//! | doorbell record | pinned host memory, written by the GPU | host, written by the proxy | host, written by the proxy |
//! | doorbell | GPU stores to the emulated UAR page (`db_reg`) | proxy | proxy |
//! | producer slot | none | GPU memory mapped by GDRCopy | pinned host memory, 8 bytes per QP, packed |
//! | descriptors, counters | GPU memory | GPU memory | GPU memory |
//! | error record | pinned host memory, one per group | same | same |
//!
//! The emulator is never told where producer slots are: in the CPU modes only the proxy rings, as
//! on real hardware. On the host backend (CI) the same layout lives in plain host memory and
//! host threads drive it through [`HostQp`].
//!
//! A group has two sides: this rank's QPs, descriptors and proxy ([`QpGroup`]), and the peer's
//! passive QPs that answer them ([`PassiveQps`]). With the peer in this process,
//! [`EmuRank::connect`] builds both and connects them both ways. With the peer in another process
//! (each process its own NIC), the two sides meet through [`QpInfo`]s sent as bytes: each rank
//! makes passive QPs for the peer ([`EmuRank::passive_for`], exporting its registered GPU memory
//! as CUDA IPC handles), the peer connects its group to them ([`EmuRank::connect_remote`], opening
//! the handles), and the passive QPs accept the group's QPs ([`QpGroup::infos_for_ipc`],
//! [`PassiveQps::accept`]). The same build serves both.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{
    check_record, select, HandlerChoice, HandlerProbe, HostQp, ModePlan, NicImpl, SlotPlacement,
};
use ibgda_device::proxy::{ProducerSlot, Proxy, ProxyConfig, ProxyQp, ProxyReport};
use ibgda_device::qp_desc::{ErrorRecord, NicHandler, QpCounters, QpDesc, QP_FLAG_EMULATED};
use ibgda_emu::{
    Access, CqConfig, CqMode, DoorbellConfig, Fabric, HostBuffer, Loc, Mr, Nic, NicConfig,
    QpConfig, QpInfo,
};

use super::backend::Registration;
use super::doorbell::{DoorbellHook, EmuDoorbell, ProxyDoorbell};
use super::error::TransportError;
use super::gpu_slots::GpuSlots;

/// Bytes at the end of every [`Arena`] for the fetched values of non-fetching atomics (the
/// descriptor's `scratch`), one 64-byte line.
pub const ARENA_SCRATCH_BYTES: usize = 64;
/// Send-ring size of the passive peer QPs: they never post.
const PEER_RING: u32 = 64;

/// Where send rings and CQs live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RingPlacement {
    /// Pinned host memory mapped into the GPU: the emulator reads WQEs and writes CQEs with CPU
    /// loads and stores; the GPU writes WQEs and polls CQEs across PCIe.
    #[default]
    HostPinned,
    /// GPU memory, as on real hardware: the emulator reaches it with copies.
    Device,
}

/// How to build a [`QpGroup`].
#[derive(Clone, Debug)]
pub struct QpGroupConfig {
    /// Who rings the doorbells (already [`select`]ed: see [`EmuRank::select`]).
    pub handler: NicHandler,
    /// QPs in the group.
    pub nqps: u32,
    /// Send-ring size in WQEBBs (a power of two, at most 32768); the CQ has as many entries, so
    /// it can never overflow (at most `nwqes` submissions are outstanding).
    pub nwqes: u32,
    /// Bound of every device-side wait (the descriptors' `timeout_ns`).
    pub timeout: Duration,
    /// Where rings and CQs live.
    pub placement: RingPlacement,
    /// The proxy's threads and polling (CPU modes).
    pub proxy: ProxyConfig,
    /// How the proxy rings the emulated NIC.
    pub proxy_doorbell: ProxyDoorbell,
    /// The rank at the other end, for diagnostics.
    pub peer_rank: u32,
    /// Called by the proxy after each doorbell (CPU modes; benchmarks and tests).
    pub on_doorbell: Option<DoorbellHook>,
}

impl QpGroupConfig {
    /// Whether a set of QPs connected to `remote` peer QPs can be built from this, or why not:
    /// one peer QP per QP (at least one), a power-of-two ring in 2..=32768 WQEBBs and a valid
    /// time bound. Every transport checks this before it allocates.
    pub fn check(&self, remote: usize) -> Result<(), TransportError> {
        let n = self.nqps as usize;
        if n == 0 || remote != n {
            return Err(TransportError::Config(format!(
                "{remote} peer QP infos for a set of {n} QPs (to rank {}); at least one QP",
                self.peer_rank
            )));
        }
        if !self.nwqes.is_power_of_two()
            || self.nwqes > ibgda_device::protocol::MAX_NWQES
            || self.nwqes < 2
        {
            return Err(TransportError::Config(format!(
                "nwqes = {}: must be a power of two in 2..=32768",
                self.nwqes
            )));
        }
        ibgda_device::timeout::check(self.timeout)
            .map(|_| ())
            .map_err(|e| {
                TransportError::Config(format!("QPs to rank {}: timeout: {e}", self.peer_rank))
            })
    }
}

impl Default for QpGroupConfig {
    fn default() -> Self {
        Self {
            handler: NicHandler::Gpu,
            nqps: 1,
            nwqes: 1024,
            timeout: Duration::from_secs(10),
            placement: RingPlacement::default(),
            proxy: ProxyConfig::default(),
            proxy_doorbell: ProxyDoorbell::default(),
            peer_rank: 0,
            on_doorbell: None,
        }
    }
}

/// One rank's emulated NIC.
#[derive(Debug, Clone)]
pub struct EmuRank {
    nic: Arc<Nic>,
    rank: u32,
    ctx: Option<Arc<CudaContext>>,
}

/// Registered memory of a rank: the source of its puts (under the `lkey` every descriptor
/// carries), the target of its peers' writes and atomics, and the scratch word.
#[derive(Debug)]
pub struct Arena {
    mem: ArenaMem,
    mr: Mr,
    len: usize,
}

#[derive(Debug)]
enum ArenaMem {
    Device(Arc<DeviceBuffer>),
    Host(Arc<HostBuffer>),
}

impl Arena {
    /// Address of the first data byte, as WQEs and kernels name it.
    pub fn addr(&self) -> u64 {
        self.mr.addr
    }

    /// Data bytes (the scratch line after them excluded).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no data bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The registration (keys, range, rights).
    pub fn mr(&self) -> &Mr {
        &self.mr
    }

    /// The scratch line: fetched values nobody reads.
    pub fn scratch(&self) -> u64 {
        self.mr.addr + self.len as u64
    }

    /// The GPU buffer (CUDA backend).
    pub fn device(&self) -> Option<&Arc<DeviceBuffer>> {
        match &self.mem {
            ArenaMem::Device(b) => Some(b),
            ArenaMem::Host(_) => None,
        }
    }

    /// The host buffer (host backend).
    pub fn host(&self) -> Option<&Arc<HostBuffer>> {
        match &self.mem {
            ArenaMem::Host(b) => Some(b),
            ArenaMem::Device(_) => None,
        }
    }
}

impl EmuRank {
    /// Rank `rank`'s NIC on the CUDA backend of `ctx`'s GPU.
    pub fn cuda(
        fabric: &Fabric,
        ctx: &Arc<CudaContext>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let nic = fabric.cuda_nic(ctx, NicConfig::named(format!("rank{rank}")))?;
        Ok(Self {
            nic: Arc::new(nic),
            rank,
            ctx: Some(ctx.clone()),
        })
    }

    /// Rank `rank`'s NIC on the host backend (no GPU: host threads submit, CI).
    pub fn host(fabric: &Fabric, rank: u32) -> Result<Self, TransportError> {
        let nic = fabric.host_nic(NicConfig::named(format!("rank{rank}")))?;
        Ok(Self {
            nic: Arc::new(nic),
            rank,
            ctx: None,
        })
    }

    /// The NIC.
    pub fn nic(&self) -> &Arc<Nic> {
        &self.nic
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// What the handler modes need, on this NIC: the emulated UAR page is host memory the GPU
    /// (or the submitting host thread) can store to, so mode `gpu` always works; mode `cpu`
    /// needs GPU memory, read through GDRCopy or, without it, the emulated GDR view.
    pub fn probe(&self) -> HandlerProbe {
        // Mode cpu's view of GPU memory: GDRCopy, or (this NIC being emulated) the emulated
        // GDR view when GDRCopy is absent; either needs GPU memory.
        let gdrcopy = match &self.ctx {
            None => Err("the host backend has no GPU memory to map".to_string()),
            Some(_) => Ok(()),
        };
        HandlerProbe {
            gpu_doorbell: Ok(()),
            gdrcopy,
        }
    }

    /// The handler mode for `choice` on this NIC (logged).
    pub fn select(&self, choice: HandlerChoice) -> Result<NicHandler, TransportError> {
        Ok(select(choice, &self.probe())?)
    }

    /// `bytes` of registered memory (GPU memory on the CUDA backend, zeroed), plus the scratch
    /// line, with every access right.
    pub fn arena(&self, bytes: usize) -> Result<Arena, TransportError> {
        let total = bytes.div_ceil(64) * 64 + ARENA_SCRATCH_BYTES;
        let (mem, mr) = match &self.ctx {
            Some(ctx) => {
                let buf = Arc::new(DeviceBuffer::new(ctx, total)?);
                buf.fill_bytes(0)?;
                let mr = self.nic.register_device(&buf, 0, total, Access::ALL)?;
                (ArenaMem::Device(buf), mr)
            }
            None => {
                let buf = Arc::new(HostBuffer::new(total));
                let mr = self.nic.register_host(&buf, 0, total, Access::ALL)?;
                (ArenaMem::Host(buf), mr)
            }
        };
        Ok(Arena {
            mem,
            mr,
            len: total - ARENA_SCRATCH_BYTES,
        })
    }

    /// Builds `cfg.nqps` RC QPs from this rank to `peer` (a NIC of this process), connected both
    /// ways, their descriptors (local buffers under `local`'s key), and in the CPU modes the
    /// proxy. The peer's passive QPs belong to the group (destroyed with it).
    pub fn connect(
        &self,
        peer: &EmuRank,
        local: &Arena,
        cfg: &QpGroupConfig,
    ) -> Result<QpGroup, TransportError> {
        let passive = peer.passive(self.rank, cfg.nqps)?;
        let remote = passive.infos(false)?;
        let mut group = QpGroup::build(self, &remote, local, cfg)?;
        passive.accept(&group.infos(false)?)?;
        group.passive = Some(passive);
        Ok(group)
    }

    /// The responder side of the QPs rank `peer_rank`, in another process, will connect to this
    /// rank with [`connect_remote`](EmuRank::connect_remote): `nqps` passive RC QPs on this NIC
    /// (they never post), and what the peer needs to connect to each, in QP order. Send the infos
    /// to the peer ([`QpInfo::to_bytes`]); once its group is built, connect the passive QPs to its
    /// QPs with [`PassiveQps::accept`].
    ///
    /// The infos export every registration of GPU memory on this NIC as a CUDA IPC handle, so
    /// register the memory peers write into (the [`arena`](EmuRank::arena)) first. Keep the
    /// returned [`PassiveQps`], this rank and its arena alive until every peer has stopped using
    /// them (a barrier after every rank's last kernel), then close them. On the host backend
    /// nothing can be exported: the infos reach only peers of the same fabric (CI).
    pub fn passive_for(
        &self,
        peer_rank: u32,
        nqps: u32,
    ) -> Result<(Vec<QpInfo>, PassiveQps), TransportError> {
        let passive = self.passive(peer_rank, nqps)?;
        let infos = passive.infos(true)?;
        Ok((infos, passive))
    }

    /// Builds `cfg.nqps` RC QPs from this rank to a peer in another process, connected to the
    /// peer's passive QPs `remote` (what its [`passive_for`](EmuRank::passive_for) returned, one
    /// per QP, in order): the peer's exported registrations are opened here (CUDA IPC) so this
    /// NIC writes into them directly. Descriptors and proxy as for
    /// [`connect`](EmuRank::connect). Send [`QpGroup::infos_for_ipc`] back to the peer, whose
    /// passive QPs [`accept`](PassiveQps::accept) them. The imported mappings stay open until
    /// this NIC is dropped (its progress thread stopped first), so drop every clone of this rank
    /// before the peers free the memory they exported.
    pub fn connect_remote(
        &self,
        remote: &[QpInfo],
        local: &Arena,
        cfg: &QpGroupConfig,
    ) -> Result<QpGroup, TransportError> {
        QpGroup::build(self, remote, local, cfg)
    }

    /// `nqps` passive QPs on this NIC for rank `peer_rank`'s QPs, not yet connected.
    pub(super) fn passive(&self, peer_rank: u32, nqps: u32) -> Result<PassiveQps, TransportError> {
        if nqps == 0 {
            return Err(TransportError::Config(
                "a QP group needs at least one QP".into(),
            ));
        }
        let mut p = PassiveQps {
            nic: self.nic.clone(),
            rank: self.rank,
            peer_rank,
            qps: Vec::with_capacity(nqps as usize),
        };
        for _ in 0..nqps {
            // On error, `p` drops and destroys the QPs made so far.
            p.qps.push(
                self.nic
                    .create_host_qp(PEER_RING, CqMode::Ring, PEER_RING)?,
            );
        }
        Ok(p)
    }
}

/// The responder side of a peer's [`QpGroup`]: passive RC QPs on this rank's NIC, one per QP of
/// the peer's group. They never post (a write or atomic from the peer lands in this rank's
/// registered memory without them), but each is connected to its peer QP, as on hardware.
///
/// Made by [`EmuRank::passive_for`] (peer in another process) or inside
/// [`EmuRank::connect`] (peer in this process; the group keeps them). Dropping them destroys
/// the QPs (errors are logged); [`close`](PassiveQps::close) reports them.
pub struct PassiveQps {
    nic: Arc<Nic>,
    rank: u32,
    peer_rank: u32,
    qps: Vec<ibgda_emu::HostQp>,
}

impl std::fmt::Debug for PassiveQps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PassiveQps")
            .field("rank", &self.rank)
            .field("peer_rank", &self.peer_rank)
            .field(
                "qpns",
                &self.qps.iter().map(|q| q.qpn()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl PassiveQps {
    /// Number of QPs.
    pub fn len(&self) -> usize {
        self.qps.len()
    }

    /// Whether there are none (never, once made).
    pub fn is_empty(&self) -> bool {
        self.qps.is_empty()
    }

    /// QP `i`'s number on this rank's NIC.
    pub fn qpn(&self, i: usize) -> u32 {
        self.qps[i].qpn()
    }

    /// The rank whose QPs these answer.
    pub fn peer_rank(&self) -> u32 {
        self.peer_rank
    }

    /// What the peer connects its QPs to, in order (`ipc`: with this NIC's registrations
    /// exported, for a peer in another process).
    pub(super) fn infos(&self, ipc: bool) -> Result<Vec<QpInfo>, TransportError> {
        let qpns: Vec<u32> = self.qps.iter().map(|q| q.qpn()).collect();
        qp_infos(&self.nic, &qpns, ipc)
    }

    /// Connects passive QP `i` to the peer's QP `initiators[i]` (what the peer's
    /// [`QpGroup::infos_for_ipc`] returned; one per QP). A peer in another process has its
    /// exported registrations opened here, as for [`EmuRank::connect_remote`].
    pub fn accept(&self, initiators: &[QpInfo]) -> Result<(), TransportError> {
        if initiators.len() != self.qps.len() {
            return Err(TransportError::Config(format!(
                "rank {}: {} QP infos from rank {} for {} passive QPs",
                self.rank,
                initiators.len(),
                self.peer_rank,
                self.qps.len()
            )));
        }
        for (q, info) in self.qps.iter().zip(initiators) {
            self.nic.connect(q.qpn(), info)?;
        }
        Ok(())
    }

    /// Destroys the QPs; the first error.
    pub fn close(mut self) -> Result<(), TransportError> {
        self.destroy()
    }

    fn destroy(&mut self) -> Result<(), TransportError> {
        let mut first = None;
        for q in self.qps.drain(..) {
            if let Err(e) = self.nic.destroy_qp(q.qpn()) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), |e| Err(e.into()))
    }
}

impl Drop for PassiveQps {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::error!(
                target: "ep",
                "rank {}: destroying the passive QPs for rank {}: {e}",
                self.rank,
                self.peer_rank
            );
        }
    }
}

/// Byte offsets of a group's protocol memory in its pinned host block.
#[derive(Debug, Clone)]
struct HostLayout {
    err: usize,
    slots: usize,
    dbr: Vec<usize>,
    ring: Vec<usize>,
    cq: Vec<usize>,
    total: usize,
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl HostLayout {
    fn new(n: usize, ring_bytes: usize, cq_bytes: usize, rings_here: bool) -> Self {
        let err = 0;
        let slots = 64;
        let mut at = round_up(slots + 8 * n, 64);
        let dbr: Vec<usize> = (0..n).map(|i| at + 64 * i).collect();
        at += 64 * n;
        let (mut ring, mut cq) = (Vec::new(), Vec::new());
        if rings_here {
            at = round_up(at, 4096);
            for _ in 0..n {
                ring.push(at);
                at += round_up(ring_bytes, 4096);
                cq.push(at);
                at += round_up(cq_bytes, 4096);
            }
        }
        Self {
            err,
            slots,
            dbr,
            ring,
            cq,
            total: at.max(64),
        }
    }
}

/// The infos of QPs `qpns` of `nic`; with `ipc` and a CUDA NIC, with every registration of GPU
/// memory on it exported for a peer in another process.
fn qp_infos(nic: &Nic, qpns: &[u32], ipc: bool) -> Result<Vec<QpInfo>, TransportError> {
    let export = ipc && nic.cuda_context().is_some();
    qpns.iter()
        .map(|&qpn| {
            Ok(if export {
                nic.qp_info_for_ipc(qpn)?
            } else {
                nic.qp_info(qpn)?
            })
        })
        .collect()
}

enum Descs {
    Device(DeviceBuffer),
    /// Host backend: the descriptors the host QPs point into.
    Host {
        _store: Arc<HostBuffer>,
    },
}

/// `nqps` connected RC QPs from one rank to a peer, ready for device code (CUDA backend: pass
/// [`descs`](QpGroup::descs) to kernels) or for host threads (host backend:
/// [`host_qps`](QpGroup::host_qps)).
///
/// Dropping the group stops the proxy and destroys the QPs (errors are logged);
/// [`shutdown`](QpGroup::shutdown) does the same and reports them.
pub struct QpGroup {
    mode: NicHandler,
    rank: u32,
    nic: Arc<Nic>,
    qpns: Vec<u32>,
    /// The peer's passive QPs, when the peer is in this process (destroyed after this side's).
    passive: Option<PassiveQps>,
    host: Arc<HostBuffer>,
    layout: HostLayout,
    descs: Option<Descs>,
    host_qps: Vec<HostQp>,
    proxy: Option<Proxy>,
    timeout: Duration,
    _rings: Option<Arc<DeviceBuffer>>,
    _gdr: Option<Arc<GpuSlots>>,
}

impl std::fmt::Debug for QpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpGroup")
            .field("mode", &self.mode.name())
            .field("rank", &self.rank)
            .field("qpns", &self.qpns)
            .finish_non_exhaustive()
    }
}

impl QpGroup {
    /// This rank's side of a group: `cfg.nqps` QPs on `me`'s NIC, QP `i` connected to the
    /// peer's QP `remote[i]` (in this process or, with exported registrations, in another),
    /// the descriptors and, in the CPU modes, the proxy. The peer's side is a [`PassiveQps`].
    pub(super) fn build(
        me: &EmuRank,
        remote: &[QpInfo],
        local: &dyn Registration,
        cfg: &QpGroupConfig,
    ) -> Result<Self, TransportError> {
        cfg.check(remote.len())?;
        let n = cfg.nqps as usize;
        let mode = cfg.handler;
        let plan = ModePlan::new(mode, NicImpl::Emulated);
        // Say what is missing before allocating anything.
        plan.check(&me.probe())?;
        let (nwqes, ncqes) = (cfg.nwqes, cfg.nwqes);
        let ring_bytes = nwqes as usize * 64;
        let cq_bytes = ncqes as usize * 64;
        let rings_in_host = cfg.placement == RingPlacement::HostPinned || me.ctx.is_none();
        let layout = HostLayout::new(n, ring_bytes, cq_bytes, rings_in_host);
        let host = Arc::new(me.nic.backend().alloc_host(layout.total)?);
        let host_cpu = host.addr();
        let host_dev = host.device_addr().unwrap_or(host_cpu);
        let rings = match (rings_in_host, &me.ctx) {
            (false, Some(ctx)) => {
                let b = Arc::new(DeviceBuffer::new(ctx, n * (ring_bytes + cq_bytes))?);
                b.fill_bytes(0)?;
                Some(b)
            }
            _ => None,
        };
        let gdr = if plan.producer_slot == Some(SlotPlacement::GpuViaGdrCopy) {
            let ctx = me
                .ctx
                .as_ref()
                .ok_or_else(|| TransportError::Config("mode cpu needs a GPU".into()))?;
            let slots = GpuSlots::new(ctx, n, plan.emulated_gdr_view_allowed(), me.rank)?;
            Some(Arc::new(slots))
        } else {
            None
        };
        let mut group = QpGroup {
            mode,
            rank: me.rank,
            nic: me.nic.clone(),
            qpns: Vec::with_capacity(n),
            passive: None,
            host: host.clone(),
            layout: layout.clone(),
            descs: None,
            host_qps: Vec::new(),
            proxy: None,
            timeout: cfg.timeout,
            _rings: rings.clone(),
            _gdr: gdr.clone(),
        };

        let wants_uar = plan.uar_in_gpu || cfg.proxy_doorbell == ProxyDoorbell::UarPage;
        let mut descs = Vec::with_capacity(n);
        let mut uars = Vec::with_capacity(n);
        for (i, peer_qp) in remote.iter().enumerate() {
            let (sq, sq_dev, cq, cq_dev) = match &rings {
                Some(b) => {
                    let r = b.ptr() + (i * (ring_bytes + cq_bytes)) as u64;
                    let c = r + ring_bytes as u64;
                    (Loc::Device(r), r, Loc::Device(c), c)
                }
                None => (
                    Loc::Host(host_cpu + layout.ring[i] as u64),
                    host_dev + layout.ring[i] as u64,
                    Loc::Host(host_cpu + layout.cq[i] as u64),
                    host_dev + layout.cq[i] as u64,
                ),
            };
            let qcfg = QpConfig {
                sq,
                nwqebbs: nwqes,
                cq: CqConfig::ring(cq, ncqes),
                doorbell: DoorbellConfig {
                    dbr: Some(Loc::Host(host_cpu + layout.dbr[i] as u64)),
                    uar: wants_uar,
                    producer_slot: None,
                },
            };
            // SAFETY: the ring, CQ and doorbell record live in `host` / `rings`, which the group
            // keeps until it has destroyed this QP (Drop destroys QPs before fields drop).
            let handle = unsafe { me.nic.create_qp(qcfg) }?;
            group.qpns.push(handle.qpn);
            me.nic.connect(handle.qpn, peer_qp)?;

            let slot_dev = match &gdr {
                Some(g) => g.device_addr(i),
                None => host_dev + (layout.slots + 8 * i) as u64,
            };
            let d = QpDesc {
                wq_base: sq_dev,
                dbr: host_dev + layout.dbr[i] as u64,
                db_reg: if plan.uar_in_gpu {
                    handle
                        .uar
                        .and_then(|u| u.bf_reg_device.or((me.ctx.is_none()).then_some(u.bf_reg)))
                        .ok_or_else(|| {
                            TransportError::Config(
                                "the emulated UAR page is not mapped for the GPU".into(),
                            )
                        })?
                } else {
                    0
                },
                producer_slot: if plan.producer_slot.is_some() {
                    slot_dev
                } else {
                    0
                },
                nwqes,
                qpn: handle.qpn,
                handler_mode: mode as u32,
                lkey: local.lkey(),
                cq_base: cq_dev,
                cq_dbr: 0,
                ncqes,
                flags: QP_FLAG_EMULATED,
                rank: me.rank,
                qp_index: i as u32,
                peer_rank: cfg.peer_rank,
                reserved0: 0,
                timeout_ns: ibgda_device::timeout::device_ns(cfg.timeout),
                error_record: host_dev + layout.err as u64,
                scratch: local.scratch(),
                reserved1: [0; 2],
                counters: QpCounters::default(),
            };
            d.validate()
                .map_err(|source| TransportError::Descriptor { qp: i, source })?;
            descs.push(d);
            uars.push(handle.uar.map(|u| u.bf_reg));
        }

        match &me.ctx {
            Some(ctx) => group.descs = Some(Descs::Device(DeviceBuffer::from_slice(ctx, &descs)?)),
            None => {
                let store = Arc::new(HostBuffer::new(n * std::mem::size_of::<QpDesc>()));
                store.write(0, bytemuck::cast_slice(&descs));
                for i in 0..n {
                    let p =
                        (store.addr() as usize + i * std::mem::size_of::<QpDesc>()) as *mut QpDesc;
                    // SAFETY: `store` (4096-aligned, so each descriptor is 64-aligned) and all the
                    // memory the descriptor names are kept by the group, which drops its host QPs
                    // first; the counters are only touched through the protocol.
                    let q = unsafe { HostQp::new(p) }
                        .map_err(|source| TransportError::Descriptor { qp: i, source })?;
                    group.host_qps.push(q);
                }
                group.descs = Some(Descs::Host { _store: store });
            }
        }

        if plan.proxy {
            let mut pqs = Vec::with_capacity(n);
            for (i, &qpn) in group.qpns.iter().enumerate() {
                let slot_cpu = match &gdr {
                    Some(g) => g.cpu_addr(i),
                    None => host_cpu + (layout.slots + 8 * i) as u64,
                };
                // SAFETY: the slot is in `host` or the view of GPU slots, both kept alive by the
                // doorbell below for as long as the proxy thread holds it; the GPU writes it only
                // as a whole 8-byte word.
                let slot = unsafe { ProducerSlot::new(slot_cpu as *const u64) }
                    .map_err(|source| TransportError::Slot { qp: i, source })?;
                let mut keep: Vec<Arc<dyn Any + Send + Sync>> = vec![host.clone()];
                if let Some(g) = &gdr {
                    keep.push(g.clone());
                }
                // SAFETY: the doorbell record is in `host` (kept); the UAR page belongs to the QP,
                // which the group destroys only after stopping the proxy.
                let doorbell = unsafe {
                    EmuDoorbell::new(
                        me.nic.clone(),
                        qpn,
                        host_cpu + layout.dbr[i] as u64,
                        cfg.proxy_doorbell,
                        uars[i],
                        keep,
                    )
                }
                .ok_or_else(|| {
                    TransportError::Config(format!(
                        "QP {i} (qpn {qpn:#x}): no doorbell for the proxy (QP unknown to the NIC, \
                         or no emulated UAR page for {:?})",
                        cfg.proxy_doorbell
                    ))
                })?
                .with_hook(cfg.on_doorbell.clone(), i as u32);
                pqs.push(ProxyQp {
                    slot,
                    doorbell: Box::new(doorbell),
                    rung_from: 0,
                    rank: me.rank,
                    qp_index: i as u32,
                });
            }
            let mut pcfg = cfg.proxy.clone();
            pcfg.name = format!("{}-r{}", pcfg.name, me.rank);
            group.proxy = Some(Proxy::start(pqs, pcfg)?);
        }
        tracing::debug!(
            target: "ep",
            "rank {}: {n} emulated QP(s) to rank {}, mode {}, rings in {:?}",
            me.rank,
            cfg.peer_rank,
            mode.name(),
            if rings_in_host { RingPlacement::HostPinned } else { RingPlacement::Device }
        );
        Ok(group)
    }

    /// What the peer's passive QPs connect to, in QP order (`ipc`: with this NIC's registrations
    /// exported).
    pub(super) fn infos(&self, ipc: bool) -> Result<Vec<QpInfo>, TransportError> {
        qp_infos(&self.nic, &self.qpns, ipc)
    }

    /// What a peer in another process passes to its [`PassiveQps::accept`]: this group's QPs,
    /// in order, with this NIC's registrations of GPU memory exported (CUDA IPC). On the host
    /// backend nothing can be exported: the infos reach only peers of the same fabric (CI).
    pub fn infos_for_ipc(&self) -> Result<Vec<QpInfo>, TransportError> {
        self.infos(true)
    }

    /// The handler mode.
    pub fn mode(&self) -> NicHandler {
        self.mode
    }

    /// Number of QPs.
    pub fn len(&self) -> usize {
        self.qpns.len()
    }

    /// Whether the group has no QPs (never, once built).
    pub fn is_empty(&self) -> bool {
        self.qpns.is_empty()
    }

    /// QP `i`'s number on this rank's NIC.
    pub fn qpn(&self, i: usize) -> u32 {
        self.qpns[i]
    }

    /// The NIC.
    pub fn nic(&self) -> &Arc<Nic> {
        &self.nic
    }

    /// Device address of the descriptor array (`ibgda_qp_desc[len]`), CUDA backend.
    pub fn descs(&self) -> Option<u64> {
        match &self.descs {
            Some(Descs::Device(b)) => Some(b.ptr()),
            _ => None,
        }
    }

    /// The QPs as host threads drive them (host backend; empty on CUDA).
    pub fn host_qps(&self) -> &[HostQp] {
        &self.host_qps
    }

    /// The proxy (CPU modes).
    pub fn proxy(&self) -> Option<&Proxy> {
        self.proxy.as_ref()
    }

    /// The emulator's view of QP `i`.
    pub fn emu_status(&self, i: usize) -> Result<ibgda_emu::QpStatus, TransportError> {
        Ok(self.nic.qp_status(self.qpns[i])?)
    }

    /// CPU address of QP `i`'s producer slot (pinned host memory; `None` in other modes).
    pub fn producer_slot_cpu(&self, i: usize) -> Option<u64> {
        (ModePlan::new(self.mode, NicImpl::Emulated).producer_slot
            == Some(SlotPlacement::PinnedHost))
        .then(|| self.host.addr() + (self.layout.slots + 8 * i) as u64)
    }

    /// The error record as it is now.
    pub fn error_record(&self) -> ErrorRecord {
        let kind = self.host.load_u32(self.layout.err);
        let mut b = [0u8; 64];
        self.host.read(self.layout.err, &mut b);
        let mut r: ErrorRecord = bytemuck::pod_read_unaligned(&b);
        // `kind` was read first (acquire): the rest of a record it announces is complete.
        r.kind = kind;
        r
    }

    /// `Err` with the recorded failure, if device code (or the model) recorded one.
    pub fn check(&self) -> Result<(), TransportError> {
        let r = self.error_record();
        let rung = self
            .proxy
            .as_ref()
            .and_then(|p| p.last_rung(r.qp_index as usize));
        check_record(&r, rung).map_err(|mut f| {
            f.nic_state = self
                .qpns
                .get(r.qp_index as usize)
                .map(|&qpn| engine_state(&self.nic, qpn));
            if let Some(why) = self._gdr.as_ref().and_then(|g| g.view_error()) {
                let s = f.nic_state.take().unwrap_or_default();
                f.nic_state = Some(format!("{s}; the emulated GDR view stopped: {why}"));
            }
            TransportError::from(f)
        })
    }

    /// QP `i`'s counters (a copy from the device descriptor on CUDA: call after the kernels that
    /// use the group have finished).
    pub fn counters(&self, i: usize) -> Result<QpCounters, TransportError> {
        match &self.descs {
            Some(Descs::Device(b)) => {
                let d: Vec<QpDesc> = b.download(i * std::mem::size_of::<QpDesc>(), 1)?;
                Ok(d[0].counters)
            }
            _ => Ok(self.host_qps[i].counters()),
        }
    }

    /// Host-side bound for waiting on kernels that use this group: twice the device bound plus
    /// five seconds, so the device always reports first.
    pub fn host_bound(&self) -> Duration {
        self.timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(5))
    }

    /// Waits (bounded by `bound`, default [`host_bound`](QpGroup::host_bound)) until `stream` has
    /// finished, then reports any recorded failure.
    pub fn wait(&self, stream: &CudaStream, bound: Option<Duration>) -> Result<(), TransportError> {
        match wait_stream(stream, bound.unwrap_or_else(|| self.host_bound())) {
            Err(TransportError::StreamTimeout { waited, .. }) => {
                Err(TransportError::StreamTimeout {
                    waited,
                    record: match self.check() {
                        Err(TransportError::Device { failure }) => Some(failure),
                        _ => None,
                    },
                })
            }
            Err(e) => Err(e),
            Ok(()) => self.check(),
        }
    }

    /// Stops the proxy (after one last sweep) and destroys the QPs; reports what the proxy did.
    pub fn shutdown(mut self) -> Result<Option<ProxyReport>, TransportError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<Option<ProxyReport>, TransportError> {
        let mut first: Option<TransportError> = None;
        let report = match self.proxy.take().map(Proxy::stop) {
            Some(Ok(r)) => Some(r),
            Some(Err(e)) => {
                first.get_or_insert(e.into());
                None
            }
            None => None,
        };
        self.host_qps.clear();
        for qpn in self.qpns.drain(..) {
            if let Err(e) = self.nic.destroy_qp(qpn) {
                first.get_or_insert(e.into());
            }
        }
        if let Some(Err(e)) = self.passive.take().map(PassiveQps::close) {
            first.get_or_insert(e);
        }
        match first {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}

impl Drop for QpGroup {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::error!(target: "ep", "rank {}: tearing down QPs: {e}", self.rank);
        }
    }
}

/// Polls `stream` until its work has finished, at most `bound` (then
/// [`TransportError::StreamTimeout`]); a failed stream is a CUDA error.
pub fn wait_stream(stream: &CudaStream, bound: Duration) -> Result<(), TransportError> {
    use ibgda_device::cuda::CudaError;
    match ibgda_device::cuda::wait_stream(stream, bound, "the stream") {
        Err(CudaError::Timeout { waited, .. }) => Err(TransportError::StreamTimeout {
            waited,
            record: None,
        }),
        r => r.map_err(TransportError::Cuda),
    }
}

/// How long a failure report waits for a QP's engine before saying its progress thread is busy
/// inside the QP's round.
const ENGINE_STATE_WAIT: Duration = Duration::from_millis(200);

/// The emulated NIC's account of QP `qpn`, for a failure report: its status line, or why there
/// is none (the progress thread held the QP's engine for all of [`ENGINE_STATE_WAIT`]: it is
/// stuck inside that QP's round).
pub(crate) fn engine_state(nic: &Nic, qpn: u32) -> String {
    match nic.qp_status_within(qpn, ENGINE_STATE_WAIT) {
        Ok(Some(st)) => st.to_string(),
        Ok(None) => format!(
            "qpn {qpn:#x}: the progress thread held the QP's engine for {ENGINE_STATE_WAIT:?} \
             (inside its round: a backend wait)"
        ),
        Err(e) => format!("qpn {qpn:#x}: {e}"),
    }
}
