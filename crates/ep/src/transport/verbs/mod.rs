//! [`RankTransport`](crate::transport::RankTransport) composed from `ibgda-verbs`: a device context, a protection domain, a UAR,
//! memory regions, and per QP a umem-backed send ring and CQ with their doorbell records,
//! brought RST→INIT→RTR→RTS by PRM firmware commands. The same code runs on whichever verbs
//! driver the context was opened with: the emulated NIC's firmware (`ibgda-emu`, which decodes
//! every command image and builds its QPs from them; here and in CI) or rdma-core on a ConnectX,
//! where only the final ioctl differs. The kernels get the same [`QpDesc`](ibgda_device::qp_desc::QpDesc) as from the emulated
//! transport.
//!
//! Where each piece of a QP lives follows the mode's [`ModePlan`](ibgda_device::protocol::ModePlan): send ring and CQ in GPU
//! memory (host memory on the host backend), the QP doorbell record in GPU memory in mode `gpu`
//! on a real NIC and in pinned host memory otherwise (the proxy writes it), producer slots and
//! the error record in pinned host memory. Mode `gpu` stores to the UAR page mapped into the GPU
//! ([`Uar::map_into_gpu`](ibgda_verbs::Uar::map_into_gpu)); the CPU modes ring it from the proxy ([`Mlx5UarDoorbell`](ibgda_device::proxy::Mlx5UarDoorbell)).
//!
//! The driver is a parameter ([`VerbsTransport::new`] with a [`VerbsDriver`]): the emulated
//! firmware, whose peers must be devices of one [`EmuSubnet`](ibgda_emu::firmware::EmuSubnet)
//! (ranks as threads of one process, or host threads in CI), or rdma-core on the device, port
//! and GID index of a [`RealNicSpec`] (`EP_NIC_DEVICE`, `EP_NIC_PORT`, `EP_NIC_GID_INDEX`), ranks
//! as threads or as processes. The port's link layer chooses the address ([`LocalAddress`]: LID
//! on InfiniBand, GID with a GRH on RoCE). Connection info is a [`VerbsConnInfo`]: the verbs
//! [`ConnectInfo`](ibgda_verbs::ConnectInfo) (QPN, PSN, LID, GID), the link layer, the port's
//! MTU (the path takes the smaller) and the registered window (address, length, rkey).
//!
//! On rdma-core this has never run: no machine of the project has an RDMA NIC. Everything above
//! the driver seam runs in CI and on the GPU machine on the emulated firmware.

mod address;
mod memory;
mod qp_set;
mod registration;
mod responder;
mod transport;

pub use address::{
    path_mtu, LinkKind, LocalAddress, RealNicSpec, RemoteWindow, VerbsConnInfo, NIC_DEVICE_ENV,
    NIC_GID_INDEX_ENV, NIC_PORT_ENV,
};
pub use transport::{VerbsDriver, VerbsTransport};
