//! Bringing ranks together: who is in the job, how they exchange small messages, and how they see
//! each other's GPU buffers.
//!
//! A job is `world_size` ranks that all call the same collectives in the same order. Two kinds of
//! rank share one interface, [`Communicator`]:
//!
//! - **ranks as processes** ([`TcpCommunicator`]): rank 0 listens on `MASTER_ADDR:MASTER_PORT`
//!   (loopback by default), the others connect to it; every message goes through rank 0. A per-job
//!   [`JobToken`], required for a job of several ranks (an opt-out must be explicit), lets rank 0
//!   and each rank prove to each other that they belong to the job (challenge and response, the
//!   token never on the wire), so a stray process (another job, an old run, a process that took
//!   the port) can neither join nor pose as rank 0. Configured from the environment
//!   ([`RankConfig::from_env`]) or through [`RankConfig::new`].
//! - **ranks as threads** of one process ([`ThreadGroup`]): the same collectives through shared
//!   memory.
//!
//! GPU buffers are shared with [`exchange_buffers`]: through CUDA IPC between processes
//! ([`IpcHandle`], [`PeerMapping`]) and through peer access between threads of one process.
//!
//! [`Launcher`] (or [`launch`]) lets a program start its own ranks: run without `RANK` set, it
//! re-executes itself once per rank with the environment filled in (a fresh token; rank 0 inherits
//! the listening socket the launcher bound), prefixes each rank's output with `[rank N] `, and
//! fails as soon as one rank fails.
//!
//! Across hosts, ranks started by `torchrun`, `srun` or `mpirun` read their place from those
//! launchers' variables ([`LaunchEnv`]) and join over TCP as above
//! ([`TcpCommunicator::from_launcher_env`]).
//!
//! Every wait here has a time bound (in `(0, 1 day]`: see [`ibgda_device::timeout`]), and every
//! error names the rank, the step and, for sockets, the peer's address.
//!
//! ```no_run
//! use ep::bootstrap::{launch, Communicator};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!     launch(4, |comm| {
//!         let all = comm.all_gather_bytes(&[comm.rank() as u8])?;
//!         assert_eq!(all, vec![vec![0], vec![1], vec![2], vec![3]]);
//!         comm.barrier()
//!     })?;
//!     Ok(())
//! }
//! ```

mod communicator;
mod config;
mod error;
mod ipc;
mod launcher;
mod launcher_env;
mod subgroup;
mod tcp;
mod thread;
mod token;
mod wire;

pub use communicator::Communicator;
pub use config::{vars, RankConfig, DEFAULT_MASTER_ADDR, DEFAULT_TIMEOUT, MAX_WORLD_SIZE};
pub use error::BootstrapError;
pub use ipc::{exchange_buffers, export, IpcHandle, PeerBuffer, PeerMapping};
pub(crate) use launcher::panic_text;
pub use launcher::{launch, Launcher};
pub use launcher_env::{
    launcher_vars, LaunchEnv, LaunchEnvError, LauncherKind, Rendezvous, RendezvousSource,
};
pub use subgroup::SubGroup;
pub use tcp::TcpCommunicator;
pub use thread::{ThreadCommunicator, ThreadGroup};
pub use token::JobToken;
