//! [`VerbsTransport`]: one rank's device context, PD, UAR and port, and the interface's
//! entry points on them.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{HandlerProbe, ModePlan, NicImpl};
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::firmware::{EmuCaps, EmuDevice, EmuSubnet};
use ibgda_emu::HostBuffer;
use ibgda_verbs::{
    preferred_roce_gid, random_psn, Access, ConnectInfo, Context, CqBuilder, GidEntry,
    GpuUarMapping, InitAttrs, LinkLayer, MemoryRegion, PortInfo, ProtectionDomain, Qp, QpBuilder,
    Reset, RtrAttrs, Rts, RtsAttrs, Uar, Umem,
};

use crate::transport::backend::{ConnInfo, QpSet, RankTransport, Registration, Responder};
use crate::transport::emulated::{QpGroupConfig, ARENA_SCRATCH_BYTES};
use crate::transport::error::TransportError;
use crate::transport::nic::NicKind;

use super::memory::{cq_image, round_up, write_block, Block, RingLayout, PORT, RESPONDER_LOG_RING};
use super::qp_set::VerbsQpSet;
use super::registration::VerbsRegistration;
use super::responder::{ResponderCtx, Stage, VerbsResponder};

/// One rank's NIC through `ibgda-verbs`.
pub struct VerbsTransport {
    pub(super) rank: u32,
    pub(super) cuda: Option<Arc<CudaContext>>,
    /// The UAR mapped into the GPU (mode `gpu` with a GPU), or why it cannot be.
    pub(super) gpu_uar: Option<Result<Arc<GpuUarMapping>, String>>,
    pub(super) uar: Arc<Uar>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) port: PortInfo,
    pub(super) gid: Option<GidEntry>,
    /// Whether the driver is the emulated NIC's firmware.
    pub(super) emulated: bool,
    /// The emulated device (its NIC allocates host memory mapped for the GPU).
    pub(super) emu: Option<EmuDevice>,
    pub(super) ctx: Arc<Context>,
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

    pub(super) fn on_emulated(
        dev: EmuDevice,
        cuda: Option<Arc<CudaContext>>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let ctx = Context::with_driver(dev.clone());
        Self::on_context(ctx, Some(dev), cuda, rank)
    }

    /// Rank `rank`'s transport on an opened device context (any driver), with `cuda`'s GPU or
    /// on the host.
    pub(super) fn on_context(
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
    pub(super) fn host_block(&self, len: usize) -> Result<Arc<HostBuffer>, TransportError> {
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
    pub(super) fn ring_block(&self, len: usize) -> Result<Block, TransportError> {
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
    pub(super) fn umem(&self, block: &Block) -> Result<Arc<Umem>, TransportError> {
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

    pub(super) fn plan(&self, mode: NicHandler) -> ModePlan {
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
    pub(super) fn init(&self, qp: Qp<Reset>) -> Result<Qp<ibgda_verbs::Init>, TransportError> {
        qp.init(&InitAttrs::new(&self.ctx, PORT))
            .map_err(|e| TransportError::Verbs {
                doing: "RST→INIT",
                source: e.into(),
            })
    }

    /// INIT→RTR→RTS towards `peer`, sending from `psn`.
    pub(super) fn rtr_rts(
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

    fn emulated_nic(&self) -> Option<&ibgda_emu::Nic> {
        self.emu.as_ref().map(|d| d.nic())
    }

    fn probe(&self) -> HandlerProbe {
        HandlerProbe {
            gpu_doorbell: match &self.gpu_uar {
                // Host threads store to the UAR page directly.
                None => Ok(()),
                Some(r) => r.as_ref().map(|_| ()).map_err(Clone::clone),
            },
            // Mode cpu's producer slots are GPU memory the proxy reads through GDRCopy, or, on
            // the emulated firmware without GDRCopy, through the emulated GDR view.
            gdrcopy: match (&self.cuda, self.emulated) {
                (None, _) => Err("the host backend has no GPU memory for producer slots".into()),
                (Some(_), true) => Ok(()),
                (Some(_), false) => ibgda_gdr::Gdr::open()
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            },
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
