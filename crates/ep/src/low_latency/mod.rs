//! The low-latency path ([`LowLatencyBuffer`]): few tokens per rank (decode), every token sent
//! straight into its final slot in the receiving rank's per-expert region, one signal per
//! (expert, source rank) announcing the count; no host wait anywhere, so dispatch and combine
//! capture into a CUDA graph.
//!
//! - [`LowLatencyBuffer::dispatch`]: BF16 rows in; out come per-expert packed rows
//!   `[local experts][ranks × max tokens][hidden]` (BF16, or FP8 e4m3 cast in the kernel with one
//!   scale per 128 channels, optionally powers of two, optionally packed UE8M0), rows per expert,
//!   and the [`LlHandle`] combine needs. Rows of an expert are ordered by source rank, then by
//!   token index at the source.
//! - [`LowLatencyBuffer::combine`]: expert outputs in, each token's top-k-weighted sum out (BF16,
//!   f32 accumulation); [`LlCombineX::ZeroCopy`] takes them from
//!   [`LowLatencyBuffer::combine_input`], where the experts wrote them.
//! - Hook mode (`return_recv_hook`): the kernel only sends and returns; [`RecvHook::call`]
//!   launches the receive, so no SM waits while the data is in flight. Combine refuses a
//!   dispatch's handle until its hook has been called (the routing is written by the receive).
//! - The handle is opaque (its routing tensors are read-only) and the kernels check every value
//!   they read from it and every top-k id a combine is given (in range, and the dispatch's in
//!   that place or -1): a bad one is a named error, and nothing is written by it.
//! - Rank masks ([`LowLatencyOptions::enable_shrink`], DeepEP's `enable_shrink`): a rank masked
//!   on this rank ([`LowLatencyBuffer::update_mask`]) gets nothing from it and what it sends is
//!   treated as absent; with shrink on, a receive wait that runs out of time masks its rank
//!   instead of failing ([`LowLatencyBuffer::query_mask`] reports it). [`LowLatencyBuffer::clean`]
//!   resets every rank's signals (a collective). The CPU definition is
//!   `reference::masked_ids`.
//! - Wait costs: [`LlDispatchArgs::wait_stats`] / [`LlCombineArgs::wait_stats`] add the GPU cycles
//!   each receive waited per source rank (DeepEP's `*_wait_recv_cost_stats`).
//! - LogFMT combine ([`LlCombineArgs::use_logfmt`]): rows of small magnitudes travel as 10-bit
//!   log-domain codes; the format and its CPU definition are in [`logfmt`].
//! - Results are double buffered: the outputs of a dispatch (and of a combine) stay valid until
//!   the second next one; a call whose half is still referenced fails with
//!   [`EpError::RegionsInUse`](crate::EpError::RegionsInUse) instead of overwriting it.
//!
//! Every rank of a group makes the same calls in the same order (they are collectives), and
//! between two dispatches on the same half every rank has received the earlier one (a combine
//! in between guarantees it). All work runs on [`LowLatencyBuffer::stream`]. Every device wait is
//! bounded; a timeout becomes an `Err` naming the rank, the peer and the expert.
//!
//! The ranks are threads of one process ([`LowLatencyBuffer::create_group`]) or processes
//! ([`LowLatencyBuffer::new`] over a [`TcpCommunicator`](crate::bootstrap::TcpCommunicator)).
//! With NVLink allowed the data moves by NVLink stores (processes map each other's buffers
//! through CUDA IPC). With [`LowLatencyOptions::allow_nvlink`] `= false` every byte to another
//! rank goes through the IBGDA transport on the emulated NIC (RDMA writes of the rows from
//! registered staging, fenced remote adds for the counts and flags, a quiet before each send
//! kernel ends), in the NIC-handler mode [`LowLatencyOptions::nic_handler`] names (`gpu`,
//! `cpu_host_memory`; `cpu` needs GDRCopy): ranks as threads get one NIC each on one fabric;
//! ranks as processes run one NIC per process, connect QPs to every peer through the group's
//! all-gather (QP infos carrying the registered buffers as CUDA IPC handles, opened by the NICs,
//! never by the kernels) and close them behind a second teardown barrier, so no buffer is freed
//! while a peer's NIC has it open. The kernels send through one small device interface
//! (`put_warp`, `signal`, `quiet` in `low_latency.cu`) that picks the path per destination.

mod args;
mod errors;
mod faults;
mod graph;
mod hook;
mod launch;
pub mod logfmt;
mod ops;
mod options;
mod plan;
pub mod reference;
mod setup;

pub use args::{
    Fp8Options, LlCombineArgs, LlCombineOutput, LlCombineX, LlDispatchArgs, LlDispatchOutput,
    LlHandle, LlRecvInto, LlRecvX, LlScales,
};
pub use faults::LlTransportQps;
pub use graph::LlGraph;
pub use hook::RecvHook;
pub use options::LowLatencyOptions;
pub use setup::LowLatencyBuffer;
