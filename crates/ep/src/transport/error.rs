//! What can go wrong building or running QPs.

use std::time::Duration;

use ibgda_device::protocol::{DeviceFailure, HandlerUnavailable};

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Device code (or the host model) recorded a protocol failure: a bounded wait that ran out or
    /// an error completion. The message names rank, QP, the four indices, the mode and the
    /// syndrome.
    #[error("IBGDA protocol failure: {failure}")]
    Device {
        /// The error record, with what the host adds.
        failure: DeviceFailure,
    },
    /// The handler mode asked for cannot run here (the message says what is missing).
    #[error(transparent)]
    Handler(#[from] HandlerUnavailable),
    /// An `ibgda-verbs` call failed (its message names the verbs call or firmware command, with
    /// errno or firmware status and syndrome).
    #[error("{doing}: {source}")]
    Verbs {
        /// What was being done.
        doing: &'static str,
        /// The verbs error.
        #[source]
        source: ibgda_verbs::VerbsError,
    },
    /// The emulated NIC refused a call.
    #[error("emulated NIC: {0}")]
    Emu(#[from] ibgda_emu::EmuError),
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] ibgda_device::cuda::CudaError),
    /// GDRCopy (mode `cpu`) failed.
    #[error("GDRCopy: {0}")]
    Gdr(#[from] ibgda_gdr::GdrError),
    /// The CPU proxy could not start or stop cleanly.
    #[error("CPU proxy: {0}")]
    Proxy(#[from] ibgda_device::proxy::ProxyError),
    /// A descriptor failed its checks (a bug in this module, reported rather than run).
    #[error("QP {qp}: invalid descriptor: {source}")]
    Descriptor {
        /// The QP's index.
        qp: usize,
        /// What is wrong.
        #[source]
        source: ibgda_device::qp_desc::QpDescError,
    },
    /// The producer slot given to the proxy is not an 8-byte-aligned u64.
    #[error("QP {qp}: {source}")]
    Slot {
        /// The QP's index.
        qp: usize,
        /// What is wrong.
        #[source]
        source: ibgda_device::proxy::SlotError,
    },
    /// A real NIC was asked for and there is none.
    #[error("no usable mlx5 NIC: {hint}")]
    NoRealNic {
        /// Why (from `ibgda-verbs`).
        hint: String,
    },
    /// A real NIC is present but the preflight says no handler mode can run on it here.
    #[error("mlx5 device {device}: no NIC-handler mode can run on this machine: {reason}")]
    RealNicNotReady {
        /// The device found.
        device: String,
        /// The preflight's first reason, with its fix.
        reason: String,
    },
    /// A stream did not finish within its bound (a kernel still spinning past every device-side
    /// bound: a protocol bug, or a kernel that never checks its status).
    #[error("stream did not finish within {waited:?}{}", record.as_ref().map(|f| format!("; error record: {f}")).unwrap_or_default())]
    StreamTimeout {
        /// How long the host waited.
        waited: Duration,
        /// What the error record held by then, if anything.
        record: Option<DeviceFailure>,
    },
    /// A configuration this module cannot build.
    #[error("invalid transport configuration: {0}")]
    Config(String),
}

impl From<DeviceFailure> for TransportError {
    fn from(failure: DeviceFailure) -> Self {
        Self::Device { failure }
    }
}
