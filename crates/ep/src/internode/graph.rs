//! CUDA graphs of internode operations with `num_worst_tokens`: capture and replay.
//!
//! What is captured is everything an operation queues: on the buffer's communication stream and,
//! forked from it by an event and joined back, on the NVLink hop's (the intranode buffer's)
//! stream. Kernels that spin are not gated while capturing (nothing runs then); each replay is
//! gated instead, as the low-latency buffer's are: ranks of this process sharing the GPU meet on
//! the host around it, so every rank's graph is queued before any rank allocates or frees.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaGraph};

use super::buffer::InternodeBuffer;
use crate::error::{invalid, EpError};
use crate::residency::{gated, LaunchGate};

/// A captured sequence of internode operations, replayed on the buffer's communication stream.
pub struct InternodeGraph {
    graph: CudaGraph,
    rank: usize,
    /// The launch gate of ranks sharing this GPU, and its bound (`None`: not shared).
    gate: Option<(Arc<LaunchGate>, Duration)>,
}

impl std::fmt::Debug for InternodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InternodeGraph")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl InternodeGraph {
    /// Queues one replay (no host wait). Every rank replays its graph the same number of times,
    /// in the same order as its other operations; ranks of this process sharing a GPU meet
    /// around each replay, as around every launch of a kernel that spins.
    pub fn replay(&self) -> Result<(), EpError> {
        let go = || {
            self.graph.launch().map_err(|source| EpError::Cuda {
                rank: self.rank,
                call: "cuGraphLaunch",
                source,
            })
        };
        let gate = self.gate.as_ref().map(|(g, t)| (&**g, *t));
        gated(gate, self.rank, "cuGraphLaunch (internode graph)", go)
    }
}

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
        let cuda = move |call, source| EpError::Cuda { rank, call, source };
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda("cuStreamBeginCapture", e))?;
        let r = f(self);
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| cuda("cuStreamEndCapture", e));
        let r = r?;
        let graph = g?.ok_or_else(|| invalid(self.rank, "the capture recorded no work"))?;
        Ok((
            InternodeGraph {
                graph,
                rank: self.rank,
                gate: self
                    .launch_gate()
                    .map(|g| (g.clone(), self.opts.buffer.timeout)),
            },
            r,
        ))
    }

    /// The host rendezvous of the ranks of this process sharing this GPU (`None` when this rank
    /// has it to itself): launch a graph captured from this buffer's operations through it
    /// ([`LaunchGate::around`]), as [`InternodeGraph::replay`] does.
    pub fn launch_gate(&self) -> Option<&Arc<LaunchGate>> {
        self.gate.as_ref()
    }
}
