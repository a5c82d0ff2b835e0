//! The transport layer of one rank: choosing a real or emulated NIC ([`decide_nic`], `EP_NIC`),
//! opening it behind the one interface every multi-node path uses ([`RankTransport`], opened by
//! [`open_transport`]), and connecting RC QPs to every peer through the bootstrap
//! ([`connect_mesh`]) in a handler mode, with the device descriptors filled and the CPU proxy
//! running in the CPU modes.
//!
//! Implementations of [`RankTransport`]: [`EmulatedTransport`] (the software NIC's QP groups,
//! [`EmuRank`] → [`QpGroup`], built directly) and [`VerbsTransport`] (QPs composed from
//! `ibgda-verbs` objects on a [`VerbsDriver`]: the emulated firmware here, rdma-core on a
//! ConnectX, which [`open_transport`] opens for `EP_NIC=real`; never run on hardware).
//!
//! Device code uses the group through its descriptor array ([`QpGroup::descs`]) and the functions
//! of `ibgda/protocol.cuh`; the host waits for kernels with a bound ([`QpGroup::wait`]) and turns
//! a recorded device failure into [`TransportError::Device`], whose message names rank, QP, the
//! four indices, the mode and the syndrome.
//!
//! ```no_run
//! use ep::transport::{EmuRank, QpGroupConfig};
//! use ibgda_device::protocol::HandlerChoice;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = ibgda_device::cuda::context(0)?;
//! let fabric = ibgda_emu::Fabric::new();
//! let (me, peer) = (EmuRank::cuda(&fabric, &ctx, 0)?, EmuRank::cuda(&fabric, &ctx, 1)?);
//! let (src, dst) = (me.arena(1 << 20)?, peer.arena(1 << 20)?);
//! let handler = me.select(HandlerChoice::Auto)?; // logs the mode and why
//! let qps = me.connect(&peer, &src, &QpGroupConfig { handler, nqps: 4, peer_rank: 1, ..Default::default() })?;
//! // launch kernels with qps.descs().unwrap(), src.addr(), dst.addr(), dst.mr().rkey ...
//! # let stream = ctx.new_stream()?;
//! qps.wait(&stream, None)?; // bounded; Err(TransportError::Device { .. }) on a protocol failure
//! # Ok(()) }
//! ```

mod backend;
mod doorbell;
mod emulated;
mod emulated_transport;
mod error;
mod gpu_slots;
mod mesh;
mod nic;
mod verbs;

pub(crate) use backend::{handler_for, HandlerRefusal};
pub use backend::{ConnInfo, QpSet, RankTransport, Registration, Responder};
pub use doorbell::{DoorbellHook, EmuDoorbell, ProxyDoorbell};
pub use emulated::{
    wait_stream, Arena, EmuRank, PassiveQps, QpGroup, QpGroupConfig, RingPlacement,
    ARENA_SCRATCH_BYTES,
};
pub use emulated_transport::EmulatedTransport;
pub use error::TransportError;
pub use ibgda_emu::QpInfo;
pub use mesh::{connect_mesh, connect_mesh_among, Mesh};
pub use nic::{
    choose_nic, decide_nic, find_real_nic, open_transport, NicChoice, NicDecision, NicKind,
    RealNic, NIC_ENV,
};
pub use verbs::{
    path_mtu, LinkKind, LocalAddress, RealNicSpec, RemoteWindow, VerbsConnInfo, VerbsDriver,
    VerbsTransport, NIC_DEVICE_ENV, NIC_GID_INDEX_ENV, NIC_PORT_ENV,
};
