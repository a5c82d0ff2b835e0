//! Internode normal mode: ranks on several nodes (hosts, or [virtual nodes](NodeKind::Virtual)
//! of one host), tokens crossing between nodes through the NIC and inside a node over NVLink.
//!
//! A token crosses to another node at most once, to the rank with its own rank's local index
//! there ([`Topology::rdma_peer`]), which forwards it over NVLink to the ranks of that node that
//! need it; combine reduces inside each node before the one copy crosses back, then across nodes.
//!
//! [`InternodeBuffer`] is the GPU path (first version: staged, see its docs); with
//! `num_worst_tokens` its operations make no host wait and can be captured in a CUDA graph
//! ([`InternodeBuffer::capture`], [`InternodeGraph`]); [`InternodeBuffer::record_phases`] times
//! each phase of its operations ([`PhaseTiming`]) for benchmarks. The rest needs no
//! GPU: the [`Topology`] the kernels read, the CPU [`reference`](mod@reference) of layout,
//! dispatch and combine they must reproduce, and the byte budget of a pipelined ring design
//! ([`plan`]).

mod buffer;
mod graph;
mod ops;
mod phases;
pub mod plan;
pub mod reference;
mod staged_plan;
mod topology;
mod worst;

pub use buffer::{InternodeBuffer, InternodeOptions};
pub use graph::InternodeGraph;
pub use ops::{
    InternodeCombineArgs, InternodeDispatchArgs, InternodeDispatchOutput, InternodeHandle,
    InternodeLayout,
};
pub use phases::{PhaseTiming, PutCount};
pub use topology::{NodeKind, Topology, TopologyError, MAX_RANKS_PER_NODE};
