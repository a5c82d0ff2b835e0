//! [`VerbsTransport`]: one rank's device context, PD, UAR and port, and the interface's
//! entry points on them.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{HandlerProbe, ModePlan, NicImpl};
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::firmware::{EmuCaps, EmuDevice, EmuSubnet};
use ibgda_emu::HostBuffer;
use ibgda_verbs::prm::Mtu;
use ibgda_verbs::{
    random_psn, Access, Context, CqBuilder, GpuUarMapping, InitAttrs, LinkLayer, MemoryRegion,
    PortInfo, PortState, ProtectionDomain, Qp, QpBuilder, Reset, RtrAttrs, Rts, RtsAttrs, Uar,
    Umem,
};

use crate::transport::backend::{ConnInfo, QpSet, RankTransport, Registration, Responder};
use crate::transport::emulated::{QpGroupConfig, ARENA_SCRATCH_BYTES};
use crate::transport::error::TransportError;
use crate::transport::nic::NicKind;

use super::address::{path_mtu, LocalAddress, RealNicSpec, RemoteWindow, VerbsConnInfo};
use super::memory::{cq_image, round_up, write_block, Block, RingLayout, RESPONDER_LOG_RING};
use super::qp_set::VerbsQpSet;
use super::registration::VerbsRegistration;
use super::responder::{ResponderCtx, Stage, VerbsResponder};

/// The verbs driver a [`VerbsTransport`] runs on.
#[derive(Debug)]
pub enum VerbsDriver {
    /// A device of the emulated NIC's firmware (`ibgda-emu`): every command image decoded and
    /// answered in software. Its peers must be devices of the same
    /// [`EmuSubnet`](ibgda_emu::firmware::EmuSubnet).
    Emulated(EmuDevice),
    /// A ConnectX through rdma-core (libibverbs and libmlx5, loaded at run time), on the
    /// device, port and GID index named.
    RdmaCore(RealNicSpec),
}

/// One rank's NIC through `ibgda-verbs`.
pub struct VerbsTransport {
    pub(super) rank: u32,
    pub(super) cuda: Option<Arc<CudaContext>>,
    /// The UAR mapped into the GPU (mode `gpu` with a GPU), or why it cannot be.
    pub(super) gpu_uar: Option<Result<Arc<GpuUarMapping>, String>>,
    pub(super) uar: Arc<Uar>,
    pub(super) pd: Arc<ProtectionDomain>,
    /// The port every QP uses (1-based).
    pub(super) port_num: u8,
    pub(super) port: PortInfo,
    /// This port's address: LID (InfiniBand) or GID (RoCE).
    pub(super) address: LocalAddress,
    /// The memory registered last: what responder infos offer peers.
    pub(super) window: Mutex<Option<RemoteWindow>>,
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
            .field("port", &self.port_num)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl VerbsTransport {
    /// Rank `rank`'s transport on `driver`, with `cuda`'s GPU (rings and registrations in GPU
    /// memory, the UAR mapped into the GPU where it can be) or on the host (`None`: host memory,
    /// host threads drive the QPs; CI). The one constructor: the emulated firmware and a
    /// ConnectX go through the same code from here on.
    pub fn new(
        driver: VerbsDriver,
        cuda: Option<Arc<CudaContext>>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        match driver {
            VerbsDriver::Emulated(dev) => {
                let ctx = Context::with_driver(dev.clone());
                Self::on_context(ctx, Some(dev), cuda, rank, 1, None)
            }
            VerbsDriver::RdmaCore(spec) => {
                let ctx = Context::open(&spec.device).map_err(|source| TransportError::Verbs {
                    doing: "opening the mlx5 device through rdma-core",
                    source,
                })?;
                if let Some(why) = ctx.devx_unavailable_reason() {
                    return Err(TransportError::Config(format!(
                        "{}: DEVX is unavailable ({why}): run with CAP_NET_RAW (or as root), or a \
                         kernel and rdma-core with DEVX",
                        spec.device
                    )));
                }
                Self::on_context(ctx, None, cuda, rank, spec.port, spec.gid_index)
            }
        }
    }

    /// Rank `rank`'s transport on the real mlx5 device `spec` names, on `cuda`'s GPU.
    pub fn real(
        spec: &RealNicSpec,
        cuda: &Arc<CudaContext>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        Self::new(
            VerbsDriver::RdmaCore(spec.clone()),
            Some(cuda.clone()),
            rank,
        )
    }

    /// Rank `rank`'s transport on an emulated device of `subnet`, host backend (no GPU; CI).
    pub fn emulated_host(subnet: &EmuSubnet, rank: u32) -> Result<Self, TransportError> {
        let dev = subnet.open_host(&format!("emu_verbs_r{rank}"))?;
        Self::new(VerbsDriver::Emulated(dev), None, rank)
    }

    /// Rank `rank`'s transport on an emulated device of `subnet` on `cuda`'s GPU: rings and
    /// registrations in GPU memory, the UAR page mapped for the GPU.
    pub fn emulated_cuda(
        subnet: &EmuSubnet,
        cuda: &Arc<CudaContext>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let dev = subnet.open_cuda(&format!("emu_verbs_r{rank}"), cuda, EmuCaps::default())?;
        Self::new(VerbsDriver::Emulated(dev), Some(cuda.clone()), rank)
    }

    /// Rank `rank`'s transport on an opened device context (any driver), with `cuda`'s GPU or
    /// on the host, its QPs on `port_num`, sending from `gid_index` on RoCE.
    pub(super) fn on_context(
        ctx: Arc<Context>,
        emu: Option<EmuDevice>,
        cuda: Option<Arc<CudaContext>>,
        rank: u32,
        port_num: u8,
        gid_index: Option<u32>,
    ) -> Result<Self, TransportError> {
        let verbs = |doing: &'static str| move |source| TransportError::Verbs { doing, source };
        let pd = ProtectionDomain::new(&ctx).map_err(verbs("allocating the PD"))?;
        let uar = Uar::alloc(&ctx).map_err(verbs("allocating the UAR"))?;
        let port = ctx.port(port_num).map_err(verbs("querying the port"))?;
        if port.state != PortState::Active {
            return Err(TransportError::Config(format!(
                "{} port {port_num} is {:?}, not ACTIVE",
                ctx.name(),
                port.state
            )));
        }
        let gids = match port.link_layer {
            LinkLayer::Ethernet => ctx.gids(port_num).map_err(verbs("reading the GID table"))?,
            _ => Vec::new(),
        };
        let address = LocalAddress::choose(&port, &gids, gid_index)
            .map_err(|why| TransportError::Config(format!("{}: {why}", ctx.name())))?;
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
            port_num,
            port,
            address,
            window: Mutex::new(None),
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
            // A real NIC reads it by DMA, the GPU stores to it through its device mapping.
            (None, Some(c)) => HostBuffer::pinned(c, len)?,
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
        qp.init(&InitAttrs::new(&self.ctx, self.port_num))
            .map_err(|e| TransportError::Verbs {
                doing: "RST→INIT",
                source: e.into(),
            })
    }

    /// INIT→RTR→RTS towards `peer`, sending from `psn`.
    pub(super) fn rtr_rts(
        &self,
        qp: Qp<ibgda_verbs::Init>,
        peer: &VerbsConnInfo,
        psn: u32,
    ) -> Result<Qp<Rts>, TransportError> {
        let attrs = rtr_attrs(&self.port, &self.address, peer)?;
        let qp = qp
            .rtr(&peer.qp, &attrs)
            .map_err(|e| TransportError::Verbs {
                doing: "INIT→RTR",
                source: e.into(),
            })?;
        qp.rts(&RtsAttrs::new(psn))
            .map_err(|e| TransportError::Verbs {
                doing: "RTR→RTS",
                source: e.into(),
            })
    }

    /// What a peer needs to connect to `qp`, which sends from `psn`.
    pub(super) fn conn_info(&self, qp: &Qp<Reset>, psn: u32) -> ConnInfo {
        let window = *self.window.lock().unwrap_or_else(|p| p.into_inner());
        ConnInfo(
            VerbsConnInfo {
                qp: qp.connect_info(&self.port, self.address.gid(), psn),
                link: self.address.link(),
                mtu: Mtu::from_code(self.port.active_mtu).unwrap_or(Mtu::Mtu1024),
                window,
            }
            .to_bytes()
            .to_vec(),
        )
    }

    /// This port's address (LID or GID) and link layer.
    pub fn address(&self) -> &LocalAddress {
        &self.address
    }
}

/// The RTR attributes towards `peer` from a port at `address`: the path by the link layer (LID,
/// or GID with a GRH), the smaller of the two MTUs. A peer on another link layer, or without
/// the address its link needs, is refused by name.
pub(super) fn rtr_attrs(
    port: &PortInfo,
    address: &LocalAddress,
    peer: &VerbsConnInfo,
) -> Result<RtrAttrs, TransportError> {
    peer.reachable_from(address).map_err(|why| {
        TransportError::Config(format!("connecting to QP {:#x}: {why}", peer.qp.qpn))
    })?;
    let mut attrs =
        RtrAttrs::for_port(port, address.gid()).map_err(|source| TransportError::Verbs {
            doing: "RTR attributes",
            source,
        })?;
    attrs.mtu = path_mtu(attrs.mtu, peer.mtu);
    Ok(attrs)
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
        *self.window.lock().unwrap_or_else(|p| p.into_inner()) = Some(RemoteWindow {
            addr: mr.addr(),
            len: len as u64,
            rkey: mr.rkey(),
        });
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
            infos.push(self.conn_info(&qp, psn));
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
                    port_num: self.port_num,
                    port: self.port,
                    address: self.address,
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
