//! CUDA graphs of internode operations with `num_worst_tokens`: capture and replay.
//!
//! What is captured is everything an operation queues: on the buffer's communication stream and,
//! forked from it by an event and joined back, on the NVLink hop's (the intranode buffer's)
//! stream. Kernels that spin are not gated while capturing (nothing runs then); each replay is
//! gated instead, as the low-latency buffer's are: ranks of this process sharing the GPU meet on
//! the host around it, so every rank's graph is queued before any rank allocates or frees.

use std::sync::Arc;

use super::buffer::InternodeBuffer;
use crate::error::EpError;
use crate::graph::{capture, CapturedGraph, GraphOf};
use crate::residency::LaunchGate;

/// A captured sequence of internode operations, replayed on the buffer's communication stream
/// ([`CapturedGraph::replay`]).
pub type InternodeGraph = CapturedGraph;

impl InternodeBuffer {
    /// Captures what `f` queues on the [communication stream](Self::comm_stream) into a graph
    /// (thread-local capture mode, so ranks as threads capture at once). Only operations that
    /// make no host wait are accepted inside: the dispatch layout (recomputed by every replay
    /// from the ids its input tensor then holds), dispatch with `num_worst_tokens`, cached
    /// dispatch and combine over its handle; dispatch without `num_worst_tokens` and
    /// [`synchronize`](Self::synchronize) are refused. Every rank captures the same operations.
    ///
    /// Replays rewrite the outputs `f` returned (keep them, or their handles, alive while the
    /// graph is replayed) and read the inputs given at capture (write fresh inputs into those
    /// tensors between replays); sequence numbers are counted on the GPU, so replays and eager
    /// calls may interleave when every rank does the same. Call
    /// [`synchronize`](Self::synchronize) after a replay to wait for it and report device errors.
    pub fn capture<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, EpError>,
    ) -> Result<(InternodeGraph, R), EpError> {
        let rank = self.rank;
        let stream = self.stream.clone();
        let (graph, r) = capture(self, &stream, rank, f)?;
        let gate = self
            .launch_gate()
            .map(|g| (g.clone(), self.opts.buffer.timeout));
        Ok((CapturedGraph::new(graph, rank, gate, GraphOf::Internode), r))
    }

    /// The host rendezvous of the ranks of this process sharing this GPU (`None` when this rank
    /// has it to itself): launch a graph captured from this buffer's operations through it
    /// ([`LaunchGate::around`]), as [`InternodeGraph::replay`] does.
    pub fn launch_gate(&self) -> Option<&Arc<LaunchGate>> {
        self.gate.as_ref()
    }
}
