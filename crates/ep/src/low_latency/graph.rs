//! CUDA graphs of low-latency operations: capture and replay.

use super::setup::LowLatencyBuffer;
use crate::error::EpError;
use crate::graph::{capture, CapturedGraph, GraphOf};

/// A captured sequence of low-latency operations, replayed on the buffer's stream
/// ([`CapturedGraph::replay`]).
pub type LlGraph = CapturedGraph;

impl LowLatencyBuffer {
    /// Captures what `f` queues on the buffer's stream into a graph (no host waits are allowed
    /// inside; the low-latency operations make none). The buffer's halves alternate at capture
    /// time, so a graph's replays reuse the halves and outputs that capture returned.
    pub fn capture<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, EpError>,
    ) -> Result<(LlGraph, R), EpError> {
        let rank = self.rank;
        let stream = self.stream.clone();
        let (graph, r) = capture(self, &stream, rank, |b: &mut Self| {
            b.capturing = true;
            let r = f(b);
            b.capturing = false;
            r
        })?;
        Ok((
            CapturedGraph::new(graph, rank, self.gate_for_hook(), GraphOf::LowLatency),
            r,
        ))
    }
}
