//! [`RankTransport`] composed from `ibgda-verbs`: a device context, a protection domain, a UAR,
//! memory regions, and per QP a umem-backed send ring and CQ with their doorbell records,
//! brought RST→INIT→RTR→RTS by PRM firmware commands. The same code runs on whichever verbs
//! driver the context was opened with: the emulated NIC's firmware (`ibgda-emu`, which decodes
//! every command image and builds its QPs from them; here and in CI) or rdma-core on a ConnectX,
//! where only the final ioctl differs. The kernels get the same [`QpDesc`] as from the emulated
//! transport.
//!
//! Where each piece of a QP lives follows the mode's [`ModePlan`]: send ring and CQ in GPU
//! memory (host memory on the host backend), the QP doorbell record in GPU memory in mode `gpu`
//! on a real NIC and in pinned host memory otherwise (the proxy writes it), producer slots and
//! the error record in pinned host memory. Mode `gpu` stores to the UAR page mapped into the GPU
//! ([`Uar::map_into_gpu`]); the CPU modes ring it from the proxy ([`Mlx5UarDoorbell`]).
//!
//! On the emulated driver the peers must be devices of one [`EmuSubnet`] (ranks as threads of
//! one process, or host threads in CI); connection info is the verbs [`ConnectInfo`] (QPN, PSN,
//! LID, GID).

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{check_record, HandlerProbe, HostQp, ModePlan, NicImpl, Placement};
use ibgda_device::proxy::{Mlx5UarDoorbell, ProducerSlot, Proxy, ProxyQp, ProxyReport};
use ibgda_device::qp_desc::{ErrorRecord, NicHandler, QpCounters, QpDesc, QP_FLAG_EMULATED};
use ibgda_device::wire::DoorbellRecord;
use ibgda_emu::firmware::{EmuCaps, EmuDevice, EmuSubnet};
use ibgda_emu::HostBuffer;
use ibgda_verbs::{
    preferred_roce_gid, random_psn, Access, ConnectInfo, Context, CqBuilder, GidEntry,
    GpuUarMapping, InitAttrs, LinkLayer, MemoryRegion, PortInfo, ProtectionDomain, Qp, QpBuilder,
    Reset, RtrAttrs, Rts, RtsAttrs, Uar, Umem, VerbsError,
};

use super::backend::{ConnInfo, QpSet, RankTransport, Registration, Responder};
use super::emulated::{QpGroupConfig, ARENA_SCRATCH_BYTES};
use super::error::TransportError;
use super::nic::NicKind;

/// The port every QP uses.
const PORT: u8 = 1;
/// Send-ring and CQ size (WQEBBs, CQEs) of the responder QPs: they never post.
const RESPONDER_LOG_RING: u8 = 6;
/// Rings, CQs and the umems under them are placed on 4 KiB pages.
const PAGE: usize = 4096;
/// Byte 63 of a CQE that hardware still owns: invalid opcode (15), owner bit 1.
const CQE_HW_OWNED: u8 = 0xf1;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Memory a transport allocates: host memory (pinned and mapped for the GPU where the driver
/// provides it) or GPU memory.
#[derive(Debug, Clone)]
enum Block {
    Host(Arc<HostBuffer>),
    Device(Arc<DeviceBuffer>),
}

impl Block {
    /// The address device code (or, on the host backend, host threads) use.
    fn dev_addr(&self) -> u64 {
        match self {
            Block::Host(h) => h.device_addr().unwrap_or(h.addr()),
            Block::Device(d) => d.ptr(),
        }
    }
}

/// One rank's NIC through `ibgda-verbs`.
pub struct VerbsTransport {
    rank: u32,
    cuda: Option<Arc<CudaContext>>,
    /// The UAR mapped into the GPU (mode `gpu` with a GPU), or why it cannot be.
    gpu_uar: Option<Result<Arc<GpuUarMapping>, String>>,
    uar: Arc<Uar>,
    pd: Arc<ProtectionDomain>,
    port: PortInfo,
    gid: Option<GidEntry>,
    /// Whether the driver is the emulated NIC's firmware.
    emulated: bool,
    /// The emulated device (its NIC allocates host memory mapped for the GPU).
    emu: Option<EmuDevice>,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("rank", &self.rank)
            .field("device", &self.ctx.name())
            .field("driver", &self.ctx.driver().kind())
            .finish_non_exhaustive()
    }
}

impl VerbsTransport {
    /// Rank `rank`'s transport on an emulated device of `subnet`, host backend (no GPU; CI).
    pub fn emulated_host(subnet: &EmuSubnet, rank: u32) -> Result<Self, TransportError> {
        let dev = subnet.open_host(&format!("emu_verbs_r{rank}"))?;
        Self::on_emulated(dev, None, rank)
    }

    /// Rank `rank`'s transport on an emulated device of `subnet` on `cuda`'s GPU: rings and
    /// registrations in GPU memory, the UAR page mapped for the GPU.
    pub fn emulated_cuda(
        subnet: &EmuSubnet,
        cuda: &Arc<CudaContext>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let dev = subnet.open_cuda(&format!("emu_verbs_r{rank}"), cuda, EmuCaps::default())?;
        Self::on_emulated(dev, Some(cuda.clone()), rank)
    }

    fn on_emulated(
        dev: EmuDevice,
        cuda: Option<Arc<CudaContext>>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let ctx = Context::with_driver(dev.clone());
        Self::on_context(ctx, Some(dev), cuda, rank)
    }

    /// Rank `rank`'s transport on an opened device context (any driver), with `cuda`'s GPU or
    /// on the host.
    fn on_context(
        ctx: Arc<Context>,
        emu: Option<EmuDevice>,
        cuda: Option<Arc<CudaContext>>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let verbs = |doing: &'static str| move |source| TransportError::Verbs { doing, source };
        let pd = ProtectionDomain::new(&ctx).map_err(verbs("allocating the PD"))?;
        let uar = Uar::alloc(&ctx).map_err(verbs("allocating the UAR"))?;
        let port = ctx.port(PORT).map_err(verbs("querying port 1"))?;
        let gid = match port.link_layer {
            LinkLayer::Ethernet => {
                let gids = ctx.gids(PORT).map_err(verbs("reading the GID table"))?;
                Some(*preferred_roce_gid(&gids).ok_or_else(|| {
                    TransportError::Config(format!(
                        "{}: port 1 is Ethernet (RoCE) but has no RoCE v2 GID: configure an IP \
                         address on its interface",
                        ctx.name()
                    ))
                })?)
            }
            _ => None,
        };
        let gpu_uar = cuda
            .as_ref()
            .map(|c| uar.map_into_gpu(c).map(Arc::new).map_err(|e| e.to_string()));
        Ok(Self {
            rank,
            emulated: ctx.driver().kind() == "ibgda-emu",
            cuda,
            gpu_uar,
            uar,
            pd,
            port,
            gid,
            emu,
            ctx,
        })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// `len` bytes of zeroed host memory: pinned and mapped for the GPU when the device is
    /// emulated on a GPU.
    fn host_block(&self, len: usize) -> Result<Arc<HostBuffer>, TransportError> {
        Ok(Arc::new(match (&self.emu, &self.cuda) {
            (Some(dev), _) => dev.nic().backend().alloc_host(len)?,
            (None, None) => HostBuffer::new(len),
            (None, Some(_)) => {
                return Err(TransportError::RealNicUnsupported {
                    device: self.ctx.name().to_string(),
                    what: "pinned host memory for QP doorbell records and producer slots",
                })
            }
        }))
    }

    /// `len` bytes of zeroed GPU memory (host memory on the host backend).
    fn ring_block(&self, len: usize) -> Result<Block, TransportError> {
        match &self.cuda {
            Some(c) => {
                let b = DeviceBuffer::new(c, len)?;
                b.fill_bytes(0)?;
                Ok(Block::Device(Arc::new(b)))
            }
            None => Ok(Block::Host(self.host_block(len)?)),
        }
    }

    /// A umem over all of `block`.
    fn umem(&self, block: &Block) -> Result<Arc<Umem>, TransportError> {
        let r = match block {
            // SAFETY: the host block is kept by the QP set (or responder) that owns the umem and
            // everything placed in it, and is dropped after them (field order); it is only
            // touched through HostBuffer's copies and atomics and by the NIC.
            Block::Host(h) => unsafe {
                Umem::register_host(&self.ctx, h.addr() as *mut u8, h.len(), Access::LOCAL_WRITE)
            },
            Block::Device(d) => Umem::register_gpu(
                &self.ctx,
                d.context(),
                d.ptr(),
                d.len(),
                Access::LOCAL_WRITE,
            ),
        };
        r.map_err(|source| TransportError::Verbs {
            doing: "registering a umem",
            source,
        })
    }

    fn plan(&self, mode: NicHandler) -> ModePlan {
        ModePlan::new(
            mode,
            if self.emulated {
                NicImpl::Emulated
            } else {
                NicImpl::Mlx5
            },
        )
    }

    /// RST→INIT on this rank's port with every right the device grants.
    fn init(&self, qp: Qp<Reset>) -> Result<Qp<ibgda_verbs::Init>, TransportError> {
        qp.init(&InitAttrs::new(&self.ctx, PORT))
            .map_err(|e| TransportError::Verbs {
                doing: "RST→INIT",
                source: e.into(),
            })
    }

    /// INIT→RTR→RTS towards `peer`, sending from `psn`.
    fn rtr_rts(
        &self,
        qp: Qp<ibgda_verbs::Init>,
        peer: &ConnectInfo,
        psn: u32,
    ) -> Result<Qp<Rts>, TransportError> {
        let attrs = RtrAttrs::for_port(&self.port, self.gid.as_ref()).map_err(|source| {
            TransportError::Verbs {
                doing: "RTR attributes",
                source,
            }
        })?;
        let qp = qp.rtr(peer, &attrs).map_err(|e| TransportError::Verbs {
            doing: "INIT→RTR",
            source: e.into(),
        })?;
        qp.rts(&RtsAttrs::new(psn))
            .map_err(|e| TransportError::Verbs {
                doing: "RTR→RTS",
                source: e.into(),
            })
    }
}

/// One QP's rings in a ring block: send ring, then CQ, then the CQ doorbell record and (when
/// it lives with the rings) the QP doorbell record, each on its own page.
#[derive(Clone, Copy, Debug)]
struct RingLayout {
    sq: usize,
    cq: usize,
    cq_dbr: usize,
    qp_dbr: usize,
    bytes: usize,
}

impl RingLayout {
    fn new(nwqes: u32, ncqes: u32) -> Self {
        let sq = 0;
        let cq = round_up(nwqes as usize * 64, PAGE);
        let cq_dbr = cq + round_up(ncqes as usize * 64, PAGE);
        Self {
            sq,
            cq,
            cq_dbr,
            qp_dbr: cq_dbr + 64,
            bytes: cq_dbr + PAGE,
        }
    }
}

/// The CQ ring's initial bytes: every CQE owned by hardware and invalid.
fn cq_image(ncqes: u32) -> Vec<u8> {
    let mut v = vec![0u8; ncqes as usize * 64];
    for c in v.chunks_exact_mut(64) {
        c[63] = CQE_HW_OWNED;
    }
    v
}

fn write_block(block: &Block, offset: usize, bytes: &[u8]) -> Result<(), TransportError> {
    match block {
        Block::Host(h) => h.write(offset, bytes),
        Block::Device(d) => d.upload(offset, bytes)?,
    }
    Ok(())
}

/// The registered memory of a [`VerbsTransport`].
#[derive(Debug)]
struct VerbsRegistration {
    mr: MemoryRegion,
    len: usize,
    mem: Block,
}

impl Registration for VerbsRegistration {
    fn addr(&self) -> u64 {
        self.mr.addr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    fn scratch(&self) -> u64 {
        self.mr.addr() + self.len as u64
    }

    fn device(&self) -> Option<&Arc<DeviceBuffer>> {
        match &self.mem {
            Block::Device(d) => Some(d),
            Block::Host(_) => None,
        }
    }

    fn host(&self) -> Option<&Arc<HostBuffer>> {
        match &self.mem {
            Block::Host(h) => Some(h),
            Block::Device(_) => None,
        }
    }
}

impl RankTransport for VerbsTransport {
    fn nic(&self) -> NicKind {
        if self.emulated {
            NicKind::EmulatedVerbs
        } else {
            NicKind::Real(self.ctx.name().to_string())
        }
    }

    fn rank(&self) -> u32 {
        self.rank
    }

    fn probe(&self) -> HandlerProbe {
        HandlerProbe {
            gpu_doorbell: match &self.gpu_uar {
                // Host threads store to the UAR page directly.
                None => Ok(()),
                Some(r) => r.as_ref().map(|_| ()).map_err(Clone::clone),
            },
            gdrcopy: Err(
                "mode cpu (producer slots in GPU memory through GDRCopy) is not composed into \
                 the verbs transport yet"
                    .into(),
            ),
        }
    }

    fn register(&self, bytes: usize) -> Result<Box<dyn Registration>, TransportError> {
        let len = round_up(bytes, 64);
        let total = len + ARENA_SCRATCH_BYTES;
        let verbs = |source| TransportError::Verbs {
            doing: "registering memory",
            source,
        };
        let (mem, mr) = match &self.cuda {
            Some(c) => {
                let b = Arc::new(DeviceBuffer::new(c, total)?);
                b.fill_bytes(0)?;
                let mr = MemoryRegion::register_gpu(&self.pd, c, b.ptr(), total, Access::rdma())
                    .map_err(verbs)?;
                (Block::Device(b), mr)
            }
            None => {
                let h = self.host_block(total)?;
                // SAFETY: `h` is kept by the registration, dropped after the MR (field order);
                // Rust code reaches it only through HostBuffer's copies and atomics.
                let mr = unsafe {
                    MemoryRegion::register_host(
                        &self.pd,
                        h.addr() as *mut u8,
                        total,
                        Access::rdma(),
                    )
                }
                .map_err(verbs)?;
                (Block::Host(h), mr)
            }
        };
        Ok(Box::new(VerbsRegistration { mr, len, mem }))
    }

    fn respond(
        &self,
        peer_rank: u32,
        nqps: u32,
    ) -> Result<(Vec<ConnInfo>, Box<dyn Responder>), TransportError> {
        if nqps == 0 {
            return Err(TransportError::Config(
                "a QP set needs at least one QP".into(),
            ));
        }
        let n = 1u32 << RESPONDER_LOG_RING;
        let layout = RingLayout::new(n, n);
        // Responders never post: their rings stay in host memory, on any NIC.
        let block = Block::Host(self.host_block(layout.bytes * nqps as usize)?);
        let umem = self.umem(&block)?;
        let mut qps = Vec::with_capacity(nqps as usize);
        let mut infos = Vec::with_capacity(nqps as usize);
        for i in 0..nqps as usize {
            let base = (i * layout.bytes) as u64;
            write_block(&block, i * layout.bytes + layout.cq, &cq_image(n))?;
            let cq = CqBuilder::new(
                &self.uar,
                umem.at(base + layout.cq as u64),
                umem.at(base + layout.cq_dbr as u64),
                RESPONDER_LOG_RING,
            )
            .collapsed(false)
            .create()
            .map_err(|source| TransportError::Verbs {
                doing: "creating a responder CQ",
                source,
            })?;
            let qp = QpBuilder::new(
                &self.pd,
                &self.uar,
                &cq,
                &cq,
                umem.at(base + layout.sq as u64),
                umem.at(base + layout.qp_dbr as u64),
                RESPONDER_LOG_RING,
            )
            .create()
            .map_err(|source| TransportError::Verbs {
                doing: "creating a responder QP",
                source,
            })?;
            let psn = random_psn();
            infos.push(ConnInfo(
                qp.connect_info(&self.port, self.gid.as_ref(), psn)
                    .to_bytes()
                    .to_vec(),
            ));
            qps.push(Stage::Reset(qp, psn));
        }
        Ok((
            infos,
            Box::new(VerbsResponder {
                rank: self.rank,
                peer_rank,
                qps: Mutex::new(qps),
                transport: ResponderCtx {
                    ctx: self.ctx.clone(),
                    port: self.port,
                    gid: self.gid,
                },
                _block: block,
            }),
        ))
    }

    fn connect(
        &self,
        remote: &[ConnInfo],
        local: &dyn Registration,
        cfg: &QpGroupConfig,
    ) -> Result<Box<dyn QpSet>, TransportError> {
        Ok(Box::new(VerbsQpSet::build(self, remote, local, cfg)?))
    }
}

/// What a responder needs of its transport to go to RTS.
struct ResponderCtx {
    ctx: Arc<Context>,
    port: PortInfo,
    gid: Option<GidEntry>,
}

enum Stage {
    Reset(Qp<Reset>, u32),
    Rts(Qp<Rts>),
    Gone,
}

/// Responder QPs of a [`VerbsTransport`].
struct VerbsResponder {
    rank: u32,
    peer_rank: u32,
    qps: Mutex<Vec<Stage>>,
    transport: ResponderCtx,
    /// Rings, CQs and doorbell records of the QPs (dropped after them).
    _block: Block,
}

impl std::fmt::Debug for VerbsResponder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        let qpns: Vec<String> = qps
            .iter()
            .map(|s| match s {
                Stage::Reset(qp, _) => format!("{:#x} (reset)", qp.qpn()),
                Stage::Rts(qp) => format!("{:#x}", qp.qpn()),
                Stage::Gone => "gone".into(),
            })
            .collect();
        f.debug_struct("VerbsResponder")
            .field("rank", &self.rank)
            .field("peer_rank", &self.peer_rank)
            .field("qpns", &qpns)
            .finish_non_exhaustive()
    }
}

fn parse_infos(remote: &[ConnInfo]) -> Result<Vec<ConnectInfo>, TransportError> {
    remote
        .iter()
        .map(|c| {
            ConnectInfo::from_bytes(&c.0).map_err(|source| TransportError::Verbs {
                doing: "reading a peer's connection info",
                source,
            })
        })
        .collect()
}

impl Responder for VerbsResponder {
    fn accept(&self, initiators: &[ConnInfo]) -> Result<(), TransportError> {
        let infos = parse_infos(initiators)?;
        let t = &self.transport;
        let mut qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        if infos.len() != qps.len() {
            return Err(TransportError::Config(format!(
                "rank {}: {} QP infos from rank {} for {} responder QPs",
                self.rank,
                infos.len(),
                self.peer_rank,
                qps.len()
            )));
        }
        for (stage, peer) in qps.iter_mut().zip(&infos) {
            let Stage::Reset(qp, psn) = std::mem::replace(stage, Stage::Gone) else {
                return Err(TransportError::Config(
                    "a responder QP was accepted twice".into(),
                ));
            };
            let step = |doing: &'static str| {
                move |e: VerbsError| TransportError::Verbs { doing, source: e }
            };
            let qp = qp
                .init(&InitAttrs::new(&t.ctx, PORT))
                .map_err(|e| step("responder RST→INIT")(e.into()))?;
            let attrs =
                RtrAttrs::for_port(&t.port, t.gid.as_ref()).map_err(step("RTR attributes"))?;
            let qp = qp
                .rtr(peer, &attrs)
                .map_err(|e| step("responder INIT→RTR")(e.into()))?;
            let qp = qp
                .rts(&RtsAttrs::new(psn))
                .map_err(|e| step("responder RTR→RTS")(e.into()))?;
            *stage = Stage::Rts(qp);
        }
        Ok(())
    }

    fn close(self: Box<Self>) -> Result<(), TransportError> {
        // The QPs' firmware objects are destroyed as they drop, before their rings.
        let mut qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        qps.clear();
        Ok(())
    }
}

/// Offsets in a set's host block: the error record, the producer slots, the QP doorbell
/// records (when they live in host memory).
#[derive(Clone, Copy, Debug)]
struct HostLayout {
    err: usize,
    slots: usize,
    dbr: usize,
    bytes: usize,
}

impl HostLayout {
    fn new(n: usize) -> Self {
        let err = 0;
        let slots = 64;
        let dbr = round_up(slots + 8 * n, 64);
        Self {
            err,
            slots,
            dbr,
            bytes: round_up(dbr + 64 * n, PAGE),
        }
    }
}

/// This rank's QPs to one peer through `ibgda-verbs`.
struct VerbsQpSet {
    mode: NicHandler,
    rank: u32,
    peer_rank: u32,
    proxy: Option<Proxy>,
    host_qps: Vec<HostQp>,
    descs: Descs,
    infos: Vec<ConnInfo>,
    qps: Vec<Qp<Rts>>,
    /// Umems of the rings and of the host block, after the QPs and CQs placed in them.
    _umems: Vec<Arc<Umem>>,
    _gpu_uars: Vec<GpuUarMapping>,
    host: Arc<HostBuffer>,
    layout: HostLayout,
    _rings: Block,
}

enum Descs {
    Device(DeviceBuffer),
    Host(Arc<HostBuffer>),
}

impl std::fmt::Debug for VerbsQpSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsQpSet")
            .field("mode", &self.mode.name())
            .field("rank", &self.rank)
            .field("peer_rank", &self.peer_rank)
            .field(
                "qpns",
                &self.qps.iter().map(|q| q.qpn()).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl VerbsQpSet {
    fn build(
        t: &VerbsTransport,
        remote: &[ConnInfo],
        local: &dyn Registration,
        cfg: &QpGroupConfig,
    ) -> Result<Self, TransportError> {
        let n = cfg.nqps as usize;
        if n == 0 || remote.len() != n {
            return Err(TransportError::Config(format!(
                "{} peer QP infos for a set of {n} QPs (to rank {}); at least one QP",
                remote.len(),
                cfg.peer_rank
            )));
        }
        if !cfg.nwqes.is_power_of_two()
            || cfg.nwqes > ibgda_device::protocol::MAX_NWQES
            || cfg.nwqes < 2
        {
            return Err(TransportError::Config(format!(
                "nwqes = {}: must be a power of two in 2..=32768",
                cfg.nwqes
            )));
        }
        ibgda_device::timeout::check(cfg.timeout).map_err(|e| {
            TransportError::Config(format!("QPs to rank {}: timeout: {e}", cfg.peer_rank))
        })?;
        let peers = parse_infos(remote)?;
        let mode = cfg.handler;
        let plan = t.plan(mode);
        plan.check(&t.probe())?;
        if let (true, Some(Err(why))) = (plan.uar_in_gpu, &t.gpu_uar) {
            return Err(TransportError::Config(format!(
                "mode gpu: the UAR cannot be mapped into the GPU: {why}"
            )));
        }
        let (nwqes, ncqes) = (cfg.nwqes, cfg.nwqes);
        let log = nwqes.trailing_zeros() as u8;
        let ring = RingLayout::new(nwqes, ncqes);
        let rings = t.ring_block(ring.bytes * n)?;
        let layout = HostLayout::new(n);
        let host = t.host_block(layout.bytes)?;
        let host_block = Block::Host(host.clone());
        let dbr_in_host = plan.doorbell_record == Placement::PinnedHost;
        let mut umems = vec![t.umem(&rings)?];
        if dbr_in_host {
            umems.push(t.umem(&host_block)?);
        }
        let ring_umem = umems[0].clone();
        let dbr_umem = umems[umems.len() - 1].clone();

        let mut qps = Vec::with_capacity(n);
        let mut infos = Vec::with_capacity(n);
        let mut descs = Vec::with_capacity(n);
        let mut gpu_uars = Vec::new();
        for (i, peer) in peers.iter().enumerate() {
            let base = i * ring.bytes;
            // A UAR page per QP, as each QP's doorbells are independent stores; the QP and its
            // CQ hold it.
            let uar = Uar::alloc(&t.ctx).map_err(|source| TransportError::Verbs {
                doing: "allocating a UAR",
                source,
            })?;
            write_block(&rings, base + ring.cq, &cq_image(ncqes))?;
            let cq = CqBuilder::new(
                &uar,
                ring_umem.at((base + ring.cq) as u64),
                ring_umem.at((base + ring.cq_dbr) as u64),
                log,
            )
            // The protocol polls the CQE of each completion's own index (`ibgda_quiet`).
            .collapsed(false)
            .create()
            .map_err(|source| TransportError::Verbs {
                doing: "creating a CQ",
                source,
            })?;
            let (dbr_at, dbr_dev) = if dbr_in_host {
                let off = layout.dbr + 64 * i;
                (dbr_umem.at(off as u64), host_block.dev_addr() + off as u64)
            } else {
                let off = base + ring.qp_dbr;
                (ring_umem.at(off as u64), rings.dev_addr() + off as u64)
            };
            let qp = QpBuilder::new(
                &t.pd,
                &uar,
                &cq,
                &cq,
                ring_umem.at((base + ring.sq) as u64),
                dbr_at,
                log,
            )
            .create()
            .map_err(|source| TransportError::Verbs {
                doing: "creating a QP",
                source,
            })?;
            let psn = random_psn();
            infos.push(ConnInfo(
                qp.connect_info(&t.port, t.gid.as_ref(), psn)
                    .to_bytes()
                    .to_vec(),
            ));
            let qp = t.rtr_rts(t.init(qp)?, peer, psn)?;
            let db_reg = match (&t.cuda, plan.uar_in_gpu) {
                (Some(c), true) => {
                    let m = uar
                        .map_into_gpu(c)
                        .map_err(|source| TransportError::Verbs {
                            doing: "mapping the UAR into the GPU",
                            source,
                        })?;
                    let reg = m.doorbell_device_ptr();
                    gpu_uars.push(m);
                    reg
                }
                // Host backend: the submitting thread stores to the page itself.
                (None, true) => uar.register_ptr() as u64,
                (_, false) => 0,
            };
            let d = QpDesc {
                wq_base: rings.dev_addr() + (base + ring.sq) as u64,
                dbr: dbr_dev,
                db_reg,
                producer_slot: if plan.proxy {
                    host_block.dev_addr() + (layout.slots + 8 * i) as u64
                } else {
                    0
                },
                nwqes,
                qpn: qp.qpn(),
                handler_mode: mode as u32,
                lkey: local.lkey(),
                cq_base: rings.dev_addr() + (base + ring.cq) as u64,
                cq_dbr: 0,
                ncqes,
                flags: if t.emulated { QP_FLAG_EMULATED } else { 0 },
                rank: t.rank,
                qp_index: i as u32,
                peer_rank: cfg.peer_rank,
                reserved0: 0,
                timeout_ns: ibgda_device::timeout::device_ns(cfg.timeout),
                error_record: host_block.dev_addr() + layout.err as u64,
                scratch: local.scratch(),
                reserved1: [0; 2],
                counters: QpCounters::default(),
            };
            d.validate()
                .map_err(|source| TransportError::Descriptor { qp: i, source })?;
            descs.push(d);
            qps.push(qp);
        }
        let mut set = VerbsQpSet {
            mode,
            rank: t.rank,
            peer_rank: cfg.peer_rank,
            proxy: None,
            host_qps: Vec::new(),
            descs: Descs::Host(Arc::new(HostBuffer::new(n * std::mem::size_of::<QpDesc>()))),
            infos,
            qps,
            _umems: umems,
            _gpu_uars: gpu_uars,
            host: host.clone(),
            layout,
            _rings: rings,
        };
        match &t.cuda {
            Some(c) => set.descs = Descs::Device(DeviceBuffer::from_slice(c, &descs)?),
            None => {
                let Descs::Host(store) = &set.descs else {
                    unreachable!("set.descs starts as host descriptors")
                };
                store.write(0, bytemuck::cast_slice(&descs));
                for i in 0..n {
                    let p =
                        (store.addr() as usize + i * std::mem::size_of::<QpDesc>()) as *mut QpDesc;
                    // SAFETY: `store` (4096-aligned, so each descriptor is 64-aligned) and all
                    // the memory the descriptor names are kept by the set, which drops its host
                    // QPs first; the counters are only touched through the protocol.
                    let q = unsafe { HostQp::new(p) }
                        .map_err(|source| TransportError::Descriptor { qp: i, source })?;
                    set.host_qps.push(q);
                }
            }
        }
        if plan.proxy {
            let mut pqs = Vec::with_capacity(n);
            for (i, qp) in set.qps.iter().enumerate() {
                let dbr = host.addr() + (layout.dbr + 64 * i) as u64;
                // SAFETY: the doorbell record is in `host` and the register in the QP's UAR
                // page, kept by the set and the QP until after the proxy stops;
                // only the proxy rings this QP.
                let doorbell = unsafe {
                    Mlx5UarDoorbell::new(
                        dbr as *mut DoorbellRecord,
                        qp.uar().register_ptr().cast::<u64>(),
                        qp.qpn(),
                    )
                }
                .ok_or_else(|| {
                    TransportError::Config(format!("QP {i}: misaligned doorbell record or UAR"))
                })?;
                let slot_cpu = host.addr() + (layout.slots + 8 * i) as u64;
                // SAFETY: the slot is in `host`, kept by the set until after the proxy stops;
                // device code (or the host model) writes it only as a whole 8-byte word.
                let slot = unsafe { ProducerSlot::new(slot_cpu as *const u64) }
                    .map_err(|source| TransportError::Slot { qp: i, source })?;
                pqs.push(ProxyQp {
                    slot,
                    doorbell: Box::new(doorbell),
                    rung_from: 0,
                    rank: t.rank,
                    qp_index: i as u32,
                });
            }
            let mut pcfg = cfg.proxy.clone();
            pcfg.name = format!("{}-r{}", pcfg.name, t.rank);
            set.proxy = Some(Proxy::start(pqs, pcfg)?);
        }
        tracing::debug!(
            target: "ep",
            "rank {}: {n} verbs QP(s) on {} ({}) to rank {}, mode {}",
            t.rank,
            t.ctx.name(),
            t.ctx.driver().kind(),
            cfg.peer_rank,
            mode.name()
        );
        Ok(set)
    }

    fn error_record(&self) -> ErrorRecord {
        let kind = self.host.load_u32(self.layout.err);
        let mut b = [0u8; 64];
        self.host.read(self.layout.err, &mut b);
        let mut r: ErrorRecord = bytemuck::pod_read_unaligned(&b);
        // `kind` was read first (acquire): the rest of a record it announces is complete.
        r.kind = kind;
        r
    }
}

impl QpSet for VerbsQpSet {
    fn mode(&self) -> NicHandler {
        self.mode
    }

    fn len(&self) -> usize {
        self.qps.len()
    }

    fn descs(&self) -> Option<u64> {
        match &self.descs {
            Descs::Device(b) => Some(b.ptr()),
            Descs::Host(_) => None,
        }
    }

    fn host_qps(&self) -> &[HostQp] {
        &self.host_qps
    }

    fn conn_infos(&self) -> Result<Vec<ConnInfo>, TransportError> {
        Ok(self.infos.clone())
    }

    fn check(&self) -> Result<(), TransportError> {
        let r = self.error_record();
        let rung = self
            .proxy
            .as_ref()
            .and_then(|p| p.last_rung(r.qp_index as usize));
        check_record(&r, rung).map_err(TransportError::from)
    }

    fn shutdown(mut self: Box<Self>) -> Result<Option<ProxyReport>, TransportError> {
        let report = self.proxy.take().map(Proxy::stop).transpose()?;
        self.host_qps.clear();
        // The QPs, CQs and umems are destroyed as the set drops, before the memory under them.
        Ok(report)
    }
}

impl Drop for VerbsQpSet {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.proxy.take().map(Proxy::stop) {
            tracing::error!(target: "ep", "rank {}: stopping the proxy: {e}", self.rank);
        }
        self.host_qps.clear();
        self.qps.clear();
    }
}
