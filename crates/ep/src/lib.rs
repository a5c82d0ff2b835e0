//! `ep`: expert-parallel (MoE) dispatch and combine.
//!
//! Owns the user API: buffers, configuration, rank bootstrap, dispatch layout, dispatch/combine
//! (intranode and low-latency), handles and events, and the choice of real or emulated NIC.
//!
//! The intranode path ([`Buffer`]) moves tokens between the GPUs of one host over NVLink: ranks
//! build their buffers together, as processes (each calls [`Buffer::new`] with its
//! [`bootstrap::Communicator`]; [`bootstrap::Launcher`] starts them) or as threads of one process
//! ([`Buffer::create_group`]), compute a [`DispatchLayout`] from top-k expert ids,
//! [`dispatch`](Buffer::dispatch) tokens to the ranks holding their experts and
//! [`combine`](Buffer::combine) the expert outputs back.
//! [`internode`] is the path across nodes: [`internode::InternodeBuffer`] (each token crosses
//! to another node once, over the transport, and is forwarded over NVLink there), its
//! [`internode::Topology`] (virtual nodes included) and CPU reference; ranks on several hosts
//! find each other through [`bootstrap::LaunchEnv`] (torchrun, srun, mpirun).
//! [`reference`](mod@reference) is the CPU definition of every result, used by the tests.

pub mod bootstrap;
mod checks;
mod config;
mod dtype;
mod error;
mod event;
mod graph;
pub mod internode;
mod intranode;
mod kernel_launch;
pub mod low_latency;
mod mapped;
mod mask;
pub mod preflight;
pub mod reference;
mod region_pool;
mod rendezvous;
pub mod residency;
mod tensor;
pub mod transport;

pub use config::{BufferOptions, Config};
pub use dtype::{Bf16, Element, Fp8E4M3};
pub use error::EpError;
pub use event::Event;
pub use graph::CapturedGraph;
pub use intranode::{
    Buffer, CombineArgs, CombineOutput, DispatchArgs, DispatchLayout, DispatchOutput, DispatchX,
    Handle, RecvX, StreamOrder, TopK, FP8_BLOCK,
};
pub use preflight::preflight;
pub use rendezvous::Exchange;
pub use tensor::Tensor;
