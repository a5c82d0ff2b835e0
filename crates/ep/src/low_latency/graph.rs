//! CUDA graphs of low-latency operations: capture and replay.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaGraph};

use super::setup::LowLatencyBuffer;
use crate::error::{invalid, EpError};
use crate::residency::{gated, LaunchGate};

/// A captured sequence of low-latency operations, replayed on the buffer's stream.
pub struct LlGraph {
    graph: CudaGraph,
    rank: usize,
    /// The launch gate of ranks sharing this GPU, and its bound (`None`: not shared).
    gate: Option<(Arc<LaunchGate>, Duration)>,
}

impl std::fmt::Debug for LlGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlGraph")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl LlGraph {
    /// Queues one replay (no host wait). Every rank replays its graph the same number of times;
    /// ranks of this process sharing a GPU meet around each replay, as around every launch.
    pub fn replay(&self) -> Result<(), EpError> {
        let go = || {
            self.graph.launch().map_err(|source| EpError::Cuda {
                rank: self.rank,
                call: "cuGraphLaunch",
                source,
            })
        };
        let gate = self.gate.as_ref().map(|(g, t)| (&**g, *t));
        gated(gate, self.rank, "cuGraphLaunch (low-latency graph)", go)
    }
}

impl LowLatencyBuffer {
    /// Captures what `f` queues on the buffer's stream into a graph (no host waits are allowed
    /// inside; the low-latency operations make none). The buffer's halves alternate at capture
    /// time, so a graph's replays reuse the halves and outputs that capture returned.
    pub fn capture<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, EpError>,
    ) -> Result<(LlGraph, R), EpError> {
        let rank = self.rank;
        let cuda = move |call, source| EpError::Cuda { rank, call, source };
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda("cuStreamBeginCapture", e))?;
        self.capturing = true;
        let r = f(self);
        self.capturing = false;
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| cuda("cuStreamEndCapture", e));
        let r = r?;
        let graph = g?.ok_or_else(|| invalid(self.rank, "the capture recorded no work"))?;
        Ok((
            LlGraph {
                graph,
                rank: self.rank,
                gate: self.gate_for_hook(),
            },
            r,
        ))
    }
}
