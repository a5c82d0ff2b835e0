//! The one error type of the bootstrap: every variant says which rank saw it and at which step.

use std::time::Duration;

use ibgda_device::cuda::CudaError;

/// Why bringing up or talking to the group of ranks failed.
///
/// Socket errors carry the OS error text (through `source`), the peer's address and the step
/// (`"rendezvous"`, `"all_gather #3"`, …); timeouts say what was still missing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A required environment variable is not set.
    #[error("environment variable {var} is not set ({hint})")]
    EnvMissing {
        /// The variable.
        var: &'static str,
        /// What it should hold.
        hint: &'static str,
    },
    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    EnvInvalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An existing launcher's environment (torchrun, srun, mpirun) does not describe a usable
    /// rank.
    #[error(transparent)]
    LaunchEnv(#[from] super::LaunchEnvError),
    /// A configuration given through the API cannot be used.
    #[error("invalid bootstrap configuration: {0}")]
    Config(String),
    /// A socket operation failed.
    #[error("rank {rank}: {step} with {peer} failed: {source}")]
    Io {
        /// The rank that saw the failure.
        rank: usize,
        /// What it was doing.
        step: String,
        /// The other side: an address, and its rank when known.
        peer: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A step did not finish within its time bound.
    #[error("rank {rank}: {step} timed out after {waited:.1?}: {detail}")]
    Timeout {
        /// The rank that gave up.
        rank: usize,
        /// What it was doing.
        step: String,
        /// How long it waited.
        waited: Duration,
        /// What was still missing.
        detail: String,
    },
    /// The other side belongs to another job (its `EP_JOB_TOKEN` differs).
    #[error("rank {rank}: {step}: job token mismatch with {peer}: {detail}")]
    TokenMismatch {
        /// The rank that saw the mismatch.
        rank: usize,
        /// What it was doing.
        step: String,
        /// The other side.
        peer: String,
        /// Which side lacks a token, if one does, and what to check.
        detail: String,
    },
    /// Two ranks of one job disagree on the number of ranks.
    #[error(
        "rank {rank}: world size mismatch with {peer}: this rank has WORLD_SIZE={ours}, the other \
         side has {theirs}"
    )]
    WorldSizeMismatch {
        /// The rank that saw the mismatch.
        rank: usize,
        /// The other side.
        peer: String,
        /// This rank's world size.
        ours: usize,
        /// The other side's world size.
        theirs: usize,
    },
    /// The other side broke the protocol: not a bootstrap peer, a rank that joined twice, ranks
    /// calling different collectives, a malformed message.
    #[error("rank {rank}: {step} with {peer}: {detail}")]
    Protocol {
        /// The rank that saw it.
        rank: usize,
        /// What it was doing.
        step: String,
        /// The other side.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The other side closed the connection: its process exited, or dropped its communicator.
    #[error("rank {rank}: {step}: {peer} closed the connection (did its process exit or fail?)")]
    Disconnected {
        /// The rank that saw it.
        rank: usize,
        /// What it was doing.
        step: String,
        /// The other side.
        peer: String,
    },
    /// The group was shut down because of an earlier failure (possibly on another rank), whose
    /// description is `reason`.
    #[error("rank {rank}: {step}: the group was aborted: {reason}")]
    Aborted {
        /// The rank that was told.
        rank: usize,
        /// What it was doing.
        step: String,
        /// The failure that aborted the group.
        reason: String,
    },
    /// A CUDA call failed while sharing buffers.
    #[error("rank {rank}: {step}: {source}")]
    Cuda {
        /// The rank.
        rank: usize,
        /// What it was doing.
        step: String,
        /// The driver error.
        #[source]
        source: CudaError,
    },
    /// An operating-system call outside the sockets failed (random bytes, the current executable).
    #[error("{step}: {source}")]
    Os {
        /// What was being done.
        step: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The launcher could not start a rank's process.
    #[error("launcher: could not start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program it tried to run.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A rank's process failed; the launcher killed the others.
    #[error("launcher: rank {first_failed} failed first ({status}); all ranks: {summary}")]
    RankFailed {
        /// The first rank seen to fail.
        first_failed: usize,
        /// How it ended (`exit status 1`, `signal 11`).
        status: String,
        /// How every rank ended.
        summary: String,
    },
    /// Some ranks were still running when the launcher's time bound passed; they were killed.
    #[error("launcher: ranks {running:?} still running after {waited:.1?}, killed; all ranks: {summary}")]
    LaunchTimeout {
        /// The ranks that had not finished.
        running: Vec<usize>,
        /// The launcher's time bound.
        waited: Duration,
        /// How every rank ended.
        summary: String,
    },
    /// The function a rank ran under the launcher returned an error.
    #[error("rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// The function's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}
