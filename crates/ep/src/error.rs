//! Everything that can go wrong in the EP API, named precisely enough to act on.

use std::time::Duration;

/// Why an EP operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// A CUDA driver call failed.
    #[error("{call} failed on rank {rank}: {source}")]
    Cuda {
        /// The rank.
        rank: usize,
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// Opening a GPU, enabling peer access or allocating failed.
    #[error("rank {rank}: {source}")]
    Device {
        /// The rank.
        rank: usize,
        /// What failed.
        #[source]
        source: ibgda_device::cuda::CudaError,
    },
    /// Pinned host memory mapped into the GPU could not be allocated.
    #[error("rank {rank}: {source}")]
    HostMemory {
        /// The rank.
        rank: usize,
        /// What failed.
        #[source]
        source: ibgda_gdr::GdrError,
    },
    /// A kernel could not be loaded.
    #[error("rank {rank}: {source}")]
    Kernel {
        /// The rank.
        rank: usize,
        /// What failed.
        #[source]
        source: ep_kernels::KernelError,
    },
    /// An argument is invalid; nothing was launched.
    #[error("rank {rank}: invalid argument: {what}")]
    InvalidArgument {
        /// The rank.
        rank: usize,
        /// What was wrong.
        what: String,
    },
    /// Top-k ids outside `[-1, num_experts)`.
    #[error("rank {rank}: {count} top-k id(s) outside [-1, {num_experts})")]
    ExpertIdOutOfRange {
        /// The rank.
        rank: usize,
        /// How many ids were out of range.
        count: usize,
        /// The number of experts.
        num_experts: usize,
    },
    /// A handle or layout made by another buffer (or another rank).
    #[error("rank {rank}: {what} belongs to another buffer")]
    ForeignHandle {
        /// The rank.
        rank: usize,
        /// "handle" or "layout".
        what: &'static str,
    },
    /// A device-side wait for peers ran past its time bound.
    #[error("rank {rank}: timed out after {timeout:?} waiting for rank {peer} ({what}, epoch {epoch}, last flag seen {seen})")]
    PeerTimeout {
        /// The rank that waited.
        rank: usize,
        /// The rank it waited for.
        peer: usize,
        /// What it waited for.
        what: &'static str,
        /// The barrier epoch.
        epoch: u64,
        /// The last flag value seen.
        seen: u64,
        /// The bound.
        timeout: Duration,
    },
    /// More tokens arrived than the fixed output (`num_worst_tokens`) holds.
    #[error("rank {rank}: {received} tokens received but num_worst_tokens is {worst}")]
    WorstTokensExceeded {
        /// The rank.
        rank: usize,
        /// Tokens received.
        received: usize,
        /// The fixed output rows.
        worst: usize,
    },
    /// A host-side wait ran past its time bound.
    #[error("rank {rank}: host timed out after {timeout:?} waiting for {what}")]
    HostTimeout {
        /// The rank.
        rank: usize,
        /// What it waited for.
        what: &'static str,
        /// The bound.
        timeout: Duration,
    },
    /// The group rendezvous failed (a rank missing, or mismatched calls).
    #[error("rank {rank}: rendezvous failed: {what}")]
    Rendezvous {
        /// The rank.
        rank: usize,
        /// What happened.
        what: String,
    },
    /// The rank bootstrap failed: a collective of the group's
    /// [`Communicator`](crate::bootstrap::Communicator) (a rank missing, mismatched calls, a
    /// socket error) or sharing the buffers (CUDA IPC).
    #[error("bootstrap failed on rank {rank}: {source}")]
    Bootstrap {
        /// The rank.
        rank: usize,
        /// What failed.
        #[source]
        source: crate::bootstrap::BootstrapError,
    },
    /// Every pooled output region is still referenced by a live output or handle.
    #[error("rank {rank}: all {limit} {what} regions are in use; drop older outputs or handles, or raise BufferOptions::max_live_outputs")]
    RegionsInUse {
        /// The rank.
        rank: usize,
        /// Which pool.
        what: &'static str,
        /// The pool's limit.
        limit: usize,
    },
    /// A rank's thread panicked while the ranks of a group (threads of this process) built or used
    /// their buffers; `message` is the panic's own text.
    #[error("rank {rank}: {what} panicked: {message}")]
    Panicked {
        /// The rank whose thread panicked.
        rank: usize,
        /// What it was doing.
        what: &'static str,
        /// The panic message.
        message: String,
    },
    /// An earlier error left the peers' flags in an unknown state; the buffer must be rebuilt.
    #[error("rank {rank}: buffer unusable after an earlier error: {first}")]
    Poisoned {
        /// The rank.
        rank: usize,
        /// The first error.
        first: String,
    },
}

/// Shorthand for an [`EpError::InvalidArgument`].
pub(crate) fn invalid(rank: usize, what: impl Into<String>) -> EpError {
    EpError::InvalidArgument {
        rank,
        what: what.into(),
    }
}
