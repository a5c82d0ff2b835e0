//! The transport interface: what every multi-node path asks of a rank's NIC, whatever NIC it is.
//!
//! A [`RankTransport`] is one rank's NIC. Through it a rank registers the memory its peers write
//! into ([`register`](RankTransport::register) → [`Registration`]), makes the responder QPs a
//! peer's QPs will connect to ([`respond`](RankTransport::respond) → [`Responder`]), connects its
//! own QPs to a peer's responders in a handler mode ([`connect`](RankTransport::connect) →
//! [`QpSet`], with the device descriptors filled and, in the CPU modes, the proxy running), and
//! tears it all down ([`QpSet::shutdown`], [`Responder::close`]). Connection info travels between
//! ranks as opaque bytes ([`ConnInfo`]) through the bootstrap ([`connect_mesh`](super::connect_mesh)),
//! so one code path serves ranks as threads and ranks as processes.
//!
//! Implementations: [`EmulatedTransport`](super::EmulatedTransport) (the software NIC's QPs
//! built directly) and [`VerbsTransport`](super::VerbsTransport) (QPs composed from
//! `ibgda-verbs` objects: PD, MR, umem rings, CQ, UAR, RST→RTS, on whichever verbs driver the
//! device was opened with: the emulated firmware here, rdma-core on a ConnectX). Both hand the
//! kernels the same [`QpDesc`](ibgda_device::qp_desc::QpDesc) array.

use std::fmt;
use std::sync::Arc;

use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{select_why, HandlerChoice, HandlerProbe, HostQp};
use ibgda_device::proxy::ProxyReport;
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::HostBuffer;

use super::emulated::QpGroupConfig;
use super::error::TransportError;
use super::nic::NicKind;

/// What a peer needs to connect one QP to one of this rank's (QPN, addressing, PSN, MTU, the
/// registrations it may write into), as bytes for the bootstrap. Only the implementation that
/// made it reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo(pub Vec<u8>);

/// Memory registered with a rank's NIC: the source of its puts (under [`lkey`](Self::lkey)),
/// the target of its peers' writes and atomics (under [`rkey`](Self::rkey)), and a scratch
/// line after the data for the fetched values of non-fetching atomics.
pub trait Registration: Send + Sync + fmt::Debug {
    /// Address of the first data byte, as WQEs and kernels name it.
    fn addr(&self) -> u64;
    /// Data bytes (the scratch line excluded).
    fn len(&self) -> usize;
    /// Whether there are no data bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The local key.
    fn lkey(&self) -> u32;
    /// The remote key.
    fn rkey(&self) -> u32;
    /// Address of the scratch line.
    fn scratch(&self) -> u64;
    /// The GPU buffer under the registration (`None` on a host backend).
    fn device(&self) -> Option<&Arc<DeviceBuffer>>;
    /// The host buffer under the registration (host backend, CI; `None` with a GPU).
    fn host(&self) -> Option<&Arc<HostBuffer>>;
}

/// This rank's side of a set of connected RC QPs to one peer, ready for device code.
pub trait QpSet: Send + Sync + fmt::Debug {
    /// The handler mode the QPs run in.
    fn mode(&self) -> NicHandler;
    /// Number of QPs.
    fn len(&self) -> usize;
    /// Whether there are none (never, once built).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device address of the descriptor array (`ibgda_qp_desc[len]`); `None` on a host backend.
    fn descs(&self) -> Option<u64>;
    /// The QPs as host threads drive them (host backend; empty with a GPU).
    fn host_qps(&self) -> &[HostQp];
    /// What the peer's [`Responder::accept`] takes, in QP order.
    fn conn_infos(&self) -> Result<Vec<ConnInfo>, TransportError>;
    /// `Err` with the failure device code recorded, if it recorded one.
    fn check(&self) -> Result<(), TransportError>;
    /// The QP numbers, in QP order (what a fault plan names).
    fn qpns(&self) -> Vec<u32>;
    /// Stops the proxy (after one last sweep) and destroys the QPs; what the proxy did.
    fn shutdown(self: Box<Self>) -> Result<Option<ProxyReport>, TransportError>;
}

/// The responder QPs on this rank's NIC that one peer's [`QpSet`] connects to. They never post.
pub trait Responder: Send + Sync + fmt::Debug {
    /// Connects responder QP `i` to the peer's QP `initiators[i]` (its
    /// [`QpSet::conn_infos`]).
    fn accept(&self, initiators: &[ConnInfo]) -> Result<(), TransportError>;
    /// Destroys the QPs; the first error.
    fn close(self: Box<Self>) -> Result<(), TransportError>;
}

/// One rank's NIC, as the multi-node paths use it.
pub trait RankTransport: Send + Sync + fmt::Debug {
    /// Which NIC this is.
    fn nic(&self) -> NicKind;
    /// This rank.
    fn rank(&self) -> u32;
    /// What the handler modes need, on this NIC and machine.
    fn probe(&self) -> HandlerProbe;
    /// The emulated NIC behind this transport (to inject faults in tests); `None` on hardware.
    fn emulated_nic(&self) -> Option<&ibgda_emu::Nic> {
        None
    }
    /// The handler mode for `choice` and why (not logged: the caller says it, with the NIC, in
    /// one line).
    fn select(&self, choice: HandlerChoice) -> Result<(NicHandler, String), TransportError> {
        Ok(select_why(choice, &self.probe())?)
    }
    /// `bytes` of registered memory (GPU memory with a GPU, zeroed), plus the scratch line, with
    /// every access right.
    fn register(&self, bytes: usize) -> Result<Box<dyn Registration>, TransportError>;
    /// `nqps` responder QPs for rank `peer_rank`'s QPs, and what that rank connects to.
    /// Registrations peers write into are made first (the infos may carry them).
    fn respond(
        &self,
        peer_rank: u32,
        nqps: u32,
    ) -> Result<(Vec<ConnInfo>, Box<dyn Responder>), TransportError>;
    /// `cfg.nqps` QPs connected to a peer's responders `remote` (one per QP, in order), local
    /// buffers under `local`'s key, in mode `cfg.handler`; the descriptors filled and, in the
    /// CPU modes, the proxy started.
    fn connect(
        &self,
        remote: &[ConnInfo],
        local: &dyn Registration,
        cfg: &QpGroupConfig,
    ) -> Result<Box<dyn QpSet>, TransportError>;
}

/// Why [`handler_for`] found no mode.
pub(crate) enum HandlerRefusal {
    /// `IBGDA_NIC_HANDLER` holds no mode's name.
    Env(String),
    /// The transport cannot run the asked mode: what was asked (with what mode `cpu` needs), and
    /// the transport's reason.
    Select(String, TransportError),
}

/// The handler mode a buffer runs on `t`: `option` unless `IBGDA_NIC_HANDLER` overrides it, as
/// the transport selects it, and why.
pub(crate) fn handler_for<T: RankTransport + ?Sized>(
    t: &T,
    option: HandlerChoice,
) -> Result<(NicHandler, String), HandlerRefusal> {
    let asked = HandlerChoice::from_env_or(option).map_err(|e| {
        HandlerRefusal::Env(format!("{}: {e}", ibgda_device::protocol::HANDLER_ENV))
    })?;
    t.select(asked).map_err(|e| {
        let need = if asked == HandlerChoice::Cpu {
            " (mode cpu keeps producer slots in GPU memory: a real NIC needs GDRCopy, \
             libgdrapi and the gdrdrv driver; the emulated NIC needs only a GPU)"
        } else {
            ""
        };
        HandlerRefusal::Select(format!("NIC handler {}{need}", asked.name()), e)
    })
}
