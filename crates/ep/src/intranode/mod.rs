//! The intranode (NVLink) [`Buffer`]: ranks on one host whose GPUs map each other's memory.
//!
//! Ranks are processes (one per GPU, rendezvous over TCP, memory shared through CUDA IPC) or
//! threads of one process (peer access); both run the same kernels. Per rank the buffer holds
//! one *window*, a device allocation that every peer maps once, at creation, through
//! [`exchange_buffers`]: a signal region (flags, counts; peers write it), a pool of receive
//! regions (peers push tokens straight into their final rows there, so the returned tensors are
//! views with no copy) and, for ranks as processes, a combine staging region. Kernels get every
//! peer's window base and exchange offsets into it, never addresses, since a process maps a
//! peer's window wherever its driver chooses. Besides the window: pooled combine outputs and a
//! host-mapped word where kernels report errors.
//!
//! Combine pulls each token's copies straight from the ranks holding them and sums them in one
//! pass. Ranks as threads read each other's combine inputs wherever they are; a process can
//! read only its peers' windows, so with ranks as processes each rank's input must lie in its
//! window: a dispatch output of the buffer already does, and any other input is first copied
//! into the window's combine staging region (a copy-engine copy on the communication stream).
//! Operations run on the buffer's communication stream; every wait, on the GPU and on the host,
//! is bounded.
//!
//! Rank masks ([`Buffer::update_mask`], DeepEP's `enable_shrink` in normal mode): a masked rank
//! gets none of this rank's tokens and its rows and expert outputs are absent; ranks that mask
//! each other never wait on each other. The masks must be symmetric and transitive (the ranks
//! fall into groups); the kernels report masks that are not (see `masks.rs`).
//!
//! Every rank of a group must call the same operations in the same order (they are collectives).
//! With `num_worst_tokens` the operations can be captured in a CUDA graph and replayed (see
//! [`Buffer::dispatch`]): barrier epochs are counted on the GPU, outputs are the tensors the
//! capture returned.

#[cfg(doc)]
use crate::bootstrap::exchange_buffers;

mod args;
pub(crate) mod errors;
mod launch;
mod masks;
mod ops;
mod plan;
mod setup;

pub use args::{
    CombineArgs, CombineOutput, DispatchArgs, DispatchLayout, DispatchOutput, DispatchX, Handle,
    RecvX, StreamOrder, TopK,
};
pub(crate) use ops::layout_params;
pub(crate) use plan::RegionPlan;
pub use plan::FP8_BLOCK;
pub use setup::Buffer;
