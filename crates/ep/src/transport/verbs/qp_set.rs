//! This rank's verbs QPs to one peer: their memory, their bring-up, their descriptors and
//! proxy.

use std::sync::Arc;

use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{check_record, HostQp, ModePlan, Placement, SlotPlacement};
use ibgda_device::proxy::{Mlx5UarDoorbell, ProducerSlot, Proxy, ProxyQp, ProxyReport};
use ibgda_device::qp_desc::{ErrorRecord, NicHandler, QpCounters, QpDesc, QP_FLAG_EMULATED};
use ibgda_device::wire::DoorbellRecord;
use ibgda_emu::HostBuffer;
use ibgda_verbs::{random_psn, CqBuilder, GpuUarMapping, Qp, QpBuilder, Rts, Uar, Umem};

use crate::transport::backend::{ConnInfo, QpSet, RankTransport, Registration};
use crate::transport::emulated::QpGroupConfig;
use crate::transport::error::TransportError;
use crate::transport::gpu_slots::GpuSlots;

use super::address::VerbsConnInfo;
use super::memory::{cq_image, round_up, write_block, Block, RingLayout, PAGE};
use super::responder::parse_infos;
use super::transport::VerbsTransport;

/// Offsets in a set's host block: the error record, the producer slots, the QP doorbell
/// records (when they live in host memory).
#[derive(Clone, Copy, Debug)]
pub(super) struct HostLayout {
    pub(super) err: usize,
    pub(super) slots: usize,
    pub(super) dbr: usize,
    pub(super) bytes: usize,
}

impl HostLayout {
    pub(super) fn new(n: usize) -> Self {
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
pub(super) struct VerbsQpSet {
    pub(super) mode: NicHandler,
    pub(super) rank: u32,
    pub(super) peer_rank: u32,
    pub(super) proxy: Option<Proxy>,
    pub(super) host_qps: Vec<HostQp>,
    pub(super) descs: Descs,
    pub(super) infos: Vec<ConnInfo>,
    pub(super) qps: Vec<Qp<Rts>>,
    /// Umems of the rings and of the host block, after the QPs and CQs placed in them.
    pub(super) _umems: Vec<Arc<Umem>>,
    pub(super) _gpu_uars: Vec<GpuUarMapping>,
    pub(super) host: Arc<HostBuffer>,
    pub(super) layout: HostLayout,
    pub(super) _rings: Block,
    /// Mode `cpu`'s producer slots in GPU memory (after the proxy, which reads them).
    pub(super) gpu_slots: Option<Arc<GpuSlots>>,
    /// The emulated device, when the firmware is the emulator's: its engine's view of a QP
    /// goes into a failure report.
    pub(super) emu: Option<ibgda_emu::firmware::EmuDevice>,
}

pub(super) enum Descs {
    Device(DeviceBuffer),
    /// Host backend: the descriptors the host QPs point into.
    Host {
        _store: Arc<HostBuffer>,
    },
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

/// A set's memory, placed as its mode's plan says: the ring block (send rings, CQs, CQ
/// doorbell records, and the QP doorbell records when they live with the rings) and the host
/// block (error record, producer slots, and the QP doorbell records when the proxy writes
/// them), with the umems the firmware objects are placed in.
pub(super) struct SetMemory {
    pub(super) plan: ModePlan,
    pub(super) ring: RingLayout,
    pub(super) rings: Block,
    pub(super) layout: HostLayout,
    pub(super) host: Arc<HostBuffer>,
    pub(super) ring_umem: Arc<Umem>,
    /// The umem the QP doorbell records are in (the host block's or the rings').
    pub(super) dbr_umem: Arc<Umem>,
    pub(super) dbr_in_host: bool,
    pub(super) umems: Vec<Arc<Umem>>,
    /// Mode `cpu`'s producer slots in GPU memory and the proxy's view of them (GDRCopy, or
    /// the emulated GDR view on the emulated firmware); `None` when the slots are in the host
    /// block.
    pub(super) gpu_slots: Option<Arc<GpuSlots>>,
}

impl SetMemory {
    pub(super) fn new(
        t: &VerbsTransport,
        plan: ModePlan,
        cfg: &QpGroupConfig,
    ) -> Result<Self, TransportError> {
        let n = cfg.nqps as usize;
        let ring = RingLayout::new(cfg.nwqes, cfg.nwqes);
        let rings = t.ring_block(ring.bytes * n)?;
        let layout = HostLayout::new(n);
        let host = t.host_block(layout.bytes)?;
        let dbr_in_host = plan.doorbell_record == Placement::PinnedHost;
        let ring_umem = t.umem(&rings)?;
        let gpu_slots = match (plan.producer_slot, &t.cuda) {
            (Some(SlotPlacement::GpuViaGdrCopy), Some(c)) => Some(Arc::new(GpuSlots::new(
                c,
                n,
                plan.emulated_gdr_view_allowed(),
                t.rank,
            )?)),
            (Some(SlotPlacement::GpuViaGdrCopy), None) => {
                return Err(TransportError::Config(
                    "mode cpu keeps producer slots in GPU memory: the host backend has none".into(),
                ))
            }
            _ => None,
        };
        let mut umems = vec![ring_umem.clone()];
        let dbr_umem = if dbr_in_host {
            let u = t.umem(&Block::Host(host.clone()))?;
            umems.push(u.clone());
            u
        } else {
            ring_umem.clone()
        };
        Ok(Self {
            plan,
            ring,
            rings,
            layout,
            host,
            ring_umem,
            dbr_umem,
            dbr_in_host,
            umems,
            gpu_slots,
        })
    }
}

/// One QP at RTS, with what the peer and device code need of it.
pub(super) struct BuiltQp {
    pub(super) qp: Qp<Rts>,
    pub(super) info: ConnInfo,
    pub(super) desc: QpDesc,
    pub(super) gpu_uar: Option<GpuUarMapping>,
}

/// QP `i` of a set: its UAR page, CQ and QP placed in `mem`, brought to RTS towards `peer`,
/// and its descriptor.
pub(super) fn build_qp(
    t: &VerbsTransport,
    mem: &SetMemory,
    i: usize,
    peer: &VerbsConnInfo,
    local: &dyn Registration,
    cfg: &QpGroupConfig,
) -> Result<BuiltQp, TransportError> {
    let verbs = |doing: &'static str| move |source| TransportError::Verbs { doing, source };
    let (nwqes, ncqes) = (cfg.nwqes, cfg.nwqes);
    let log = nwqes.trailing_zeros() as u8;
    let (ring, plan) = (mem.ring, mem.plan);
    let base = i * ring.bytes;
    // A UAR page per QP, as each QP's doorbells are independent stores; the QP and its CQ hold
    // it.
    let uar = Uar::alloc(&t.ctx).map_err(verbs("allocating a UAR"))?;
    write_block(&mem.rings, base + ring.cq, &cq_image(ncqes))?;
    let cq = CqBuilder::new(
        &uar,
        mem.ring_umem.at((base + ring.cq) as u64),
        mem.ring_umem.at((base + ring.cq_dbr) as u64),
        log,
    )
    // A ring (the builder's default): the protocol polls each completion's own entry.
    .create()
    .map_err(verbs("creating a CQ"))?;
    let host_dev = Block::Host(mem.host.clone()).dev_addr();
    let (dbr_at, dbr_dev) = if mem.dbr_in_host {
        let off = mem.layout.dbr + 64 * i;
        (mem.dbr_umem.at(off as u64), host_dev + off as u64)
    } else {
        let off = base + ring.qp_dbr;
        (
            mem.dbr_umem.at(off as u64),
            mem.rings.dev_addr() + off as u64,
        )
    };
    let qp = QpBuilder::new(
        &t.pd,
        &uar,
        &cq,
        &cq,
        mem.ring_umem.at((base + ring.sq) as u64),
        dbr_at,
        log,
    )
    .create()
    .map_err(verbs("creating a QP"))?;
    let psn = random_psn();
    let info = t.conn_info(&qp, psn);
    let qp = t.rtr_rts(t.init(qp)?, peer, psn)?;
    let (db_reg, gpu_uar) = match (&t.cuda, plan.uar_in_gpu) {
        (Some(c), true) => {
            let m = uar
                .map_into_gpu(c)
                .map_err(verbs("mapping the UAR into the GPU"))?;
            (m.doorbell_device_ptr(), Some(m))
        }
        // Host backend: the submitting thread stores to the page itself.
        (None, true) => (uar.register_ptr() as u64, None),
        (_, false) => (0, None),
    };
    let desc = QpDesc {
        wq_base: mem.rings.dev_addr() + (base + ring.sq) as u64,
        dbr: dbr_dev,
        db_reg,
        producer_slot: match (&mem.gpu_slots, plan.proxy) {
            (Some(g), _) => g.device_addr(i),
            (None, true) => host_dev + (mem.layout.slots + 8 * i) as u64,
            (None, false) => 0,
        },
        nwqes,
        qpn: qp.qpn(),
        handler_mode: cfg.handler as u32,
        lkey: local.lkey(),
        cq_base: mem.rings.dev_addr() + (base + ring.cq) as u64,
        cq_dbr: 0,
        ncqes,
        flags: if t.emulated { QP_FLAG_EMULATED } else { 0 },
        rank: t.rank,
        qp_index: i as u32,
        peer_rank: cfg.peer_rank,
        reserved0: 0,
        timeout_ns: ibgda_device::timeout::device_ns(cfg.timeout),
        error_record: host_dev + mem.layout.err as u64,
        scratch: local.scratch(),
        reserved1: [0; 2],
        counters: QpCounters::default(),
    };
    desc.validate()
        .map_err(|source| TransportError::Descriptor { qp: i, source })?;
    Ok(BuiltQp {
        qp,
        info,
        desc,
        gpu_uar,
    })
}

/// The descriptor array where device code reads it (GPU memory), or on the host backend in
/// host memory with the host threads' view of each QP.
pub(super) fn store_descs(
    t: &VerbsTransport,
    descs: &[QpDesc],
) -> Result<(Descs, Vec<HostQp>), TransportError> {
    if let Some(c) = &t.cuda {
        return Ok((
            Descs::Device(DeviceBuffer::from_slice(c, descs)?),
            Vec::new(),
        ));
    }
    let size = std::mem::size_of::<QpDesc>();
    let store = Arc::new(HostBuffer::new(std::mem::size_of_val(descs)));
    store.write(0, bytemuck::cast_slice(descs));
    let mut host_qps = Vec::with_capacity(descs.len());
    for i in 0..descs.len() {
        let p = (store.addr() as usize + i * size) as *mut QpDesc;
        // SAFETY: `store` (4096-aligned, so each descriptor is 64-aligned) and all the memory
        // the descriptor names are kept by the set, which drops its host QPs first; the
        // counters are only touched through the protocol.
        let q = unsafe { HostQp::new(p) }
            .map_err(|source| TransportError::Descriptor { qp: i, source })?;
        host_qps.push(q);
    }
    Ok((Descs::Host { _store: store }, host_qps))
}

impl VerbsQpSet {
    pub(super) fn build(
        t: &VerbsTransport,
        remote: &[ConnInfo],
        local: &dyn Registration,
        cfg: &QpGroupConfig,
    ) -> Result<Self, TransportError> {
        cfg.check(remote.len())?;
        let peers = parse_infos(remote)?;
        let mode = cfg.handler;
        let plan = t.plan(mode);
        // Say what is missing before allocating anything.
        plan.check(&t.probe())?;
        if let (true, Some(Err(why))) = (plan.uar_in_gpu, &t.gpu_uar) {
            return Err(TransportError::Config(format!(
                "mode gpu: the UAR cannot be mapped into the GPU: {why}"
            )));
        }
        let mem = SetMemory::new(t, plan, cfg)?;
        // Declared after `mem`, so on an early return the QPs go before the memory under them.
        let mut built = Vec::with_capacity(peers.len());
        for (i, peer) in peers.iter().enumerate() {
            built.push(build_qp(t, &mem, i, peer, local, cfg)?);
        }
        let descs: Vec<QpDesc> = built.iter().map(|b| b.desc).collect();
        let (descs, host_qps) = store_descs(t, &descs)?;
        let (mut qps, mut infos, mut gpu_uars) = (Vec::new(), Vec::new(), Vec::new());
        for b in built {
            qps.push(b.qp);
            infos.push(b.info);
            gpu_uars.extend(b.gpu_uar);
        }
        let mut set = VerbsQpSet {
            mode,
            rank: t.rank,
            peer_rank: cfg.peer_rank,
            proxy: None,
            host_qps,
            descs,
            infos,
            qps,
            _umems: mem.umems,
            _gpu_uars: gpu_uars,
            host: mem.host,
            layout: mem.layout,
            _rings: mem.rings,
            gpu_slots: mem.gpu_slots,
            emu: t.emu.clone(),
        };
        if plan.proxy {
            set.proxy = Some(set.start_proxy(cfg)?);
        }
        tracing::debug!(
            target: "ep",
            "rank {}: {} verbs QP(s) on {} ({}) to rank {}, mode {}",
            t.rank,
            set.qps.len(),
            t.ctx.name(),
            t.ctx.driver().kind(),
            cfg.peer_rank,
            mode.name()
        );
        Ok(set)
    }

    /// The CPU proxy over the set's QPs: it polls each QP's producer slot and rings the QP's
    /// UAR register after writing its doorbell record (both in the host block).
    pub(super) fn start_proxy(&self, cfg: &QpGroupConfig) -> Result<Proxy, TransportError> {
        let mut pqs = Vec::with_capacity(self.qps.len());
        for (i, qp) in self.qps.iter().enumerate() {
            let dbr = self.host.addr() + (self.layout.dbr + 64 * i) as u64;
            // SAFETY: the doorbell record is in `self.host` and the register in the QP's UAR
            // page, kept by the set and the QP until after the proxy stops (Drop stops it
            // first); only the proxy rings this QP.
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
            let slot_cpu = match &self.gpu_slots {
                Some(g) => g.cpu_addr(i),
                None => self.host.addr() + (self.layout.slots + 8 * i) as u64,
            };
            // SAFETY: the slot is in `self.host` or in the view of `self.gpu_slots`, both kept
            // by the set until after the proxy stops (Drop stops it first); device code (or the
            // host model) writes it only as a whole 8-byte word.
            let slot = unsafe { ProducerSlot::new(slot_cpu as *const u64) }
                .map_err(|source| TransportError::Slot { qp: i, source })?;
            pqs.push(ProxyQp {
                slot,
                doorbell: Box::new(doorbell),
                rung_from: 0,
                rank: self.rank,
                qp_index: i as u32,
            });
        }
        let mut pcfg = cfg.proxy.clone();
        pcfg.name = format!("{}-r{}", pcfg.name, self.rank);
        Ok(Proxy::start(pqs, pcfg)?)
    }

    pub(super) fn error_record(&self) -> ErrorRecord {
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
            Descs::Host { .. } => None,
        }
    }

    fn host_qps(&self) -> &[HostQp] {
        &self.host_qps
    }

    fn conn_infos(&self) -> Result<Vec<ConnInfo>, TransportError> {
        Ok(self.infos.clone())
    }

    fn qpns(&self) -> Vec<u32> {
        self.qps.iter().map(|q| q.qpn()).collect()
    }

    fn check(&self) -> Result<(), TransportError> {
        let r = self.error_record();
        let rung = self
            .proxy
            .as_ref()
            .and_then(|p| p.last_rung(r.qp_index as usize));
        check_record(&r, rung).map_err(|mut f| {
            // What the NIC itself says of the QP: how far it has read the send queue.
            let qp = self.qps.get(r.qp_index as usize);
            f.nic_consumed = qp
                .and_then(|q| q.query().ok())
                .map(|c| c.hw_sq_wqebb_counter);
            f.nic_state = match (&self.emu, qp) {
                (Some(dev), Some(q)) => {
                    Some(crate::transport::emulated::engine_state(dev.nic(), q.qpn()))
                }
                _ => None,
            };
            if let Some(why) = self.gpu_slots.as_ref().and_then(|g| g.view_error()) {
                let s = f.nic_state.take().unwrap_or_default();
                f.nic_state = Some(format!("{s}; the emulated GDR view stopped: {why}"));
            }
            TransportError::from(f)
        })
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
