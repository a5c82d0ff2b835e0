//! The transport layer of one rank: choosing a real or emulated NIC ([`choose_nic`], one log
//! line), choosing the NIC-handler mode ([`EmuRank::select`], one log line), and building RC QPs
//! whose protocol memory sits where the mode needs it, with the device descriptors filled and the
//! CPU proxy running in the CPU modes ([`EmuRank::connect`] → [`QpGroup`]; a peer in another
//! process: [`EmuRank::passive_for`] and [`EmuRank::connect_remote`], the [`QpInfo`]s sent as
//! bytes).
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

mod doorbell;
mod emulated;
mod error;
mod nic;

pub use doorbell::{DoorbellHook, EmuDoorbell, ProxyDoorbell};
pub use emulated::{
    wait_stream, Arena, EmuRank, PassiveQps, QpGroup, QpGroupConfig, RingPlacement,
    ARENA_SCRATCH_BYTES,
};
pub use error::TransportError;
pub use ibgda_emu::QpInfo;
pub use nic::{choose_nic, find_real_nic, NicChoice, NicKind, RealNic, NIC_ENV};
