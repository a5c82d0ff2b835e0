//! The emulator's errors: API misuse, CUDA failures and bounded waits that ran out.
//!
//! A WQE that fails is *not* an [`EmuError`]: like on hardware it becomes an error CQE and moves
//! its QP to the error state ([`QpStatus::first_error`](crate::QpStatus::first_error) says why).

use std::time::Duration;

use cudarc::driver::sys;
pub use cudarc::driver::DriverError;

use crate::qp::QpState;

/// Why an emulator call failed.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// A CUDA driver call failed.
    #[error("{call} failed: {source}")]
    Cuda {
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// Setting up the GPU failed (no driver, no such device, no peer access).
    #[error(transparent)]
    CudaSetup(#[from] ibgda_device::cuda::CudaError),
    /// No QP with this number on this NIC.
    #[error("NIC {nic}: no QP {qpn:#x}")]
    NoSuchQp {
        /// The NIC's name.
        nic: String,
        /// The QP number asked for.
        qpn: u32,
    },
    /// The QP is not in a state that allows the call.
    #[error("QP {qpn:#x}: cannot {what} in state {state:?}")]
    BadState {
        /// The QP.
        qpn: u32,
        /// Its state.
        state: QpState,
        /// What was attempted.
        what: &'static str,
    },
    /// A configuration the emulator cannot run (sizes, alignment, placement).
    #[error("invalid configuration: {0}")]
    BadConfig(String),
    /// No registration with this key on this NIC.
    #[error("NIC {nic}: no memory region with key {key:#x}")]
    NoSuchKey {
        /// The NIC's name.
        nic: String,
        /// The key.
        key: u32,
    },
    /// The peer named in a [`QpInfo`](crate::QpInfo) is neither in this NIC's fabric nor
    /// described by imported registrations.
    #[error("peer node {node:#x} is not reachable: not in this process's fabric and no exported registrations were given")]
    UnknownPeer {
        /// The peer's node id.
        node: u64,
    },
    /// A bounded wait ran out. Names the QP and its indices, so a hang is never silent.
    #[error(
        "NIC {nic} QP {qpn:#x}: waited {waited:?} for {what}: fetched {fetched}, announced {announced}, \
         completions written {cqes}, pending {pending}"
    )]
    Timeout {
        /// The NIC's name.
        nic: String,
        /// The QP.
        qpn: u32,
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
        /// WQEBBs the NIC has read and executed (or flushed).
        fetched: u64,
        /// Producer index the doorbells announced.
        announced: u64,
        /// CQEs written so far.
        cqes: u64,
        /// CQEs waiting for their data to land (or for an injected delay).
        pending: usize,
    },
    /// A backend stream did not drain in time.
    #[error("{backend} backend: {what} did not finish within {waited:?}")]
    BackendTimeout {
        /// The backend.
        backend: &'static str,
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// The backend cannot do this (for example GPU memory on the host backend).
    #[error("the {backend} backend cannot {what}")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// What was asked.
        what: &'static str,
    },
    /// Peer information that does not decode.
    #[error("malformed peer information: {0}")]
    BadPeerInfo(String),
}

impl EmuError {
    pub(crate) fn cuda(call: &'static str) -> impl FnOnce(DriverError) -> EmuError {
        move |source| EmuError::Cuda { call, source }
    }
}

/// The result of driver call `call`: `Ok` for `CUDA_SUCCESS`, else [`EmuError::Cuda`].
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<(), EmuError> {
    r.result().map_err(EmuError::cuda(call))
}
