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
    /// Top-k ids outside `[-1, num_experts)` (`[0, num_experts)` or -1 in a combine): nothing
    /// was sent for them.
    #[error(
        "rank {rank}: {op}: top-k id {id} of token {token}{} outside [-1, {num_experts}){}",
        .slot.map_or(String::new(), |k| format!(", slot {k}")),
        .count.map_or(String::new(), |n| format!(" ({n} such id(s) in all)"))
    )]
    ExpertIdOutOfRange {
        /// The rank.
        rank: usize,
        /// Where the id was read: "dispatch layout", "low-latency dispatch", "low-latency combine".
        op: &'static str,
        /// The first bad id found (the lowest token and slot where the whole tensor was scanned).
        id: i64,
        /// Its token (row of `topk_idx`).
        token: usize,
        /// Its top-k slot (column), where known.
        slot: Option<usize>,
        /// How many ids were out of range, where they were all counted.
        count: Option<usize>,
        /// The number of experts.
        num_experts: usize,
    },
    /// A low-latency combine's `topk_idx` names an expert the dispatch did not send that token to
    /// (its rows there are stale): that copy was not summed.
    #[error(
        "rank {rank}: low-latency combine: topk_idx[{token}][{slot}] is {combined}, the dispatch \
         sent that token to {dispatched} there: pass the dispatch's topk_idx (or -1 to skip a copy)"
    )]
    TopkMismatch {
        /// The rank.
        rank: usize,
        /// The token (row of `topk_idx`).
        token: usize,
        /// The top-k slot (column).
        slot: usize,
        /// The id the dispatch had there.
        dispatched: i64,
        /// The id the combine was given.
        combined: i64,
    },
    /// A routing value a kernel read from a handle or layout tensor is out of range (the tensor
    /// was written to outside this API, or comes from a dispatch whose receive never ran): the
    /// kernel wrote nothing at the place it names.
    #[error(
        "rank {rank}: {what}[{index}] is {value}, outside [0, {limit}]: nothing was written there"
    )]
    CorruptRouting {
        /// The rank whose kernel found it.
        rank: usize,
        /// Which tensor: "tokens_per_rank", "tokens_per_expert", "send position",
        /// "layout_range offset", "layout_range count", "src_info".
        what: &'static str,
        /// The flat index of the value.
        index: u64,
        /// The value found.
        value: i64,
        /// The largest value allowed there.
        limit: u64,
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
    #[error(
        "rank {rank}: timed out after {timeout:?} waiting for rank {peer} ({what}{}, epoch {epoch}, last flag seen {seen})",
        .expert.map_or(String::new(), |e| format!(", expert {e}"))
    )]
    PeerTimeout {
        /// The rank that waited.
        rank: usize,
        /// The rank it waited for.
        peer: usize,
        /// What it waited for.
        what: &'static str,
        /// The expert the wait was for (low-latency waits), global or local as `what` says.
        expert: Option<u64>,
        /// The barrier epoch.
        epoch: u64,
        /// The last flag value seen.
        seen: u64,
        /// The bound.
        timeout: Duration,
    },
    /// The IBGDA transport failed: a call in a kernel returned an error status (an error
    /// completion, a QP in error, a bounded wait in the protocol that ran out), or setting the
    /// transport up or down failed.
    #[error(
        "rank {rank}: IBGDA transport{}: {what}{}",
        .peer.map_or(String::new(), |p| format!(" to rank {p}")),
        .source.as_ref().map_or(String::new(), |e| format!(": {e}"))
    )]
    Transport {
        /// The rank.
        rank: usize,
        /// The peer the failing QPs lead to, where one is known.
        peer: Option<usize>,
        /// What failed: the call, its status, the QP, the mode (or what was being set up).
        what: String,
        /// The QP group's record of the failure, where it kept one.
        #[source]
        source: Option<Box<crate::transport::TransportError>>,
    },
    /// A tensor could not be made, read or written (no buffer involved, so no rank).
    #[error(
        "tensor on GPU {gpu}: {what}{}",
        .source.as_ref().map_or(String::new(), |e| format!(": {e}"))
    )]
    Tensor {
        /// The GPU ordinal of the tensor's context.
        gpu: usize,
        /// What was wrong.
        what: String,
        /// The CUDA failure, if it was one.
        #[source]
        source: Option<ibgda_device::cuda::CudaError>,
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
    /// A CUDA driver call on an event of the caller's own stream ([`Event::on`](crate::Event::on),
    /// [`Event::timed`](crate::Event::timed)) failed: no buffer, so no rank.
    #[error("{call} failed on GPU {gpu}: {source}")]
    Stream {
        /// The GPU ordinal of the stream's context.
        gpu: usize,
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A host wait on an event of the caller's own stream ran past its time bound.
    #[error("GPU {gpu}: host timed out after {timeout:?} waiting for {what}")]
    StreamTimeout {
        /// The GPU ordinal of the stream's context.
        gpu: usize,
        /// What it waited for.
        what: &'static str,
        /// The bound.
        timeout: Duration,
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
    /// Ranks of this process sharing this rank's GPU did not all reach the launch of a kernel
    /// that waits for them within the bound (see [`crate::residency::LaunchGate`]); nothing of
    /// this operation was launched by this rank.
    #[error(
        "rank {rank}: {} sharing GPU {gpu} in this process did not reach {what} within \
         {timeout:?} (every rank on a shared GPU must make the same calls in the same order)",
        crate::error::rank_list(missing)
    )]
    SharedGpuTimeout {
        /// The rank that waited.
        rank: usize,
        /// The operation about to launch.
        what: &'static str,
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// The GPU's ordinal in this process.
        gpu: usize,
        /// The bound.
        timeout: Duration,
    },
    /// Ranks of one process sharing a GPU would not fit on it together with this SM budget:
    /// their waiting kernels could not all be resident, so nothing was launched.
    #[error(
        "rank {rank}: {what} asks {budget} SMs per rank, and {ranks_on_gpu} ranks of this \
         process share GPU {gpu} ({sms} SMs, {reserved} kept for the emulated NIC): \
         {ranks_on_gpu} x {budget} does not fit; use at most {fits} SMs per rank, or fewer \
         ranks per GPU"
    )]
    SmBudget {
        /// The rank.
        rank: usize,
        /// The operation (or buffer) that asked.
        what: String,
        /// SMs (blocks) per rank asked for.
        budget: u32,
        /// Ranks of this process on this GPU.
        ranks_on_gpu: u32,
        /// The GPU's ordinal in this process.
        gpu: usize,
        /// SMs of the GPU.
        sms: u32,
        /// SMs kept free for the emulated NIC.
        reserved: u32,
        /// The largest budget that fits.
        fits: u32,
    },
    /// Rank masks that an intranode operation cannot honour (nothing was sent under them): a
    /// linked peer links other ranks than this rank does (masks not symmetric and transitive),
    /// or a cached dispatch's handle was made under other masks.
    #[error("rank {rank}: rank masks disagree with rank {peer}: {what}")]
    MaskMismatch {
        /// The rank that found it.
        rank: usize,
        /// The peer whose links differ (this rank, for a cached handle).
        peer: usize,
        /// What differs.
        what: String,
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

/// `rank 1, rank 3` for `[1, 3]`: errors name every rank as "rank N".
pub(crate) fn rank_list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| format!("rank {r}")).collect();
    names.join(", ")
}

/// Shorthand for an [`EpError::InvalidArgument`].
pub(crate) fn invalid(rank: usize, what: impl Into<String>) -> EpError {
    EpError::InvalidArgument {
        rank,
        what: what.into(),
    }
}
