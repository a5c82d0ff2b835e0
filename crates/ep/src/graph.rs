//! CUDA graphs of a buffer's operations: capture on the buffer's stream, gated replay, and the
//! refusal of host waits while a capture is open. The internode and low-latency buffers capture
//! through [`capture`] and hand out a [`CapturedGraph`]; the intranode and internode buffers
//! refuse host waits through [`refuse_host_wait`].

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaGraph, CudaStream};

use crate::error::{invalid, EpError};
use crate::residency::{gated, LaunchGate};

/// Which buffer's operations a [`CapturedGraph`] holds: names it in `Debug` and in a launch
/// gate's errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GraphOf {
    /// An [`InternodeBuffer`](crate::internode::InternodeBuffer)'s.
    Internode,
    /// A [`LowLatencyBuffer`](crate::low_latency::LowLatencyBuffer)'s.
    LowLatency,
}

impl GraphOf {
    /// The public name of the graph type for this buffer.
    fn type_name(self) -> &'static str {
        match self {
            Self::Internode => "InternodeGraph",
            Self::LowLatency => "LlGraph",
        }
    }

    /// The call a replay makes, as the launch gate reports it.
    fn launch_call(self) -> &'static str {
        match self {
            Self::Internode => "cuGraphLaunch (internode graph)",
            Self::LowLatency => "cuGraphLaunch (low-latency graph)",
        }
    }
}

/// A captured sequence of a buffer's operations, replayed on the stream it was captured from
/// ([`InternodeGraph`](crate::internode::InternodeGraph),
/// [`LlGraph`](crate::low_latency::LlGraph)).
pub struct CapturedGraph {
    graph: CudaGraph,
    rank: usize,
    /// The launch gate of ranks sharing this GPU, and its bound (`None`: not shared).
    gate: Option<(Arc<LaunchGate>, Duration)>,
    of: GraphOf,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(self.of.type_name())
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl CapturedGraph {
    /// A graph `rank` captured from `of`'s operations, replayed through `gate` when ranks of
    /// this process share the GPU.
    pub(crate) fn new(
        graph: CudaGraph,
        rank: usize,
        gate: Option<(Arc<LaunchGate>, Duration)>,
        of: GraphOf,
    ) -> Self {
        Self {
            graph,
            rank,
            gate,
            of,
        }
    }

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
        gated(gate, self.rank, self.of.launch_call(), go)
    }
}

/// Captures what `f` queues on `stream` (the stream of `buf`) into a graph, in thread-local
/// capture mode so that ranks as threads capture at once. The capture is ended even when `f`
/// fails, and `f`'s error is the one reported; a capture that recorded nothing is refused.
pub(crate) fn capture<B, R>(
    buf: &mut B,
    stream: &Arc<CudaStream>,
    rank: usize,
    f: impl FnOnce(&mut B) -> Result<R, EpError>,
) -> Result<(CudaGraph, R), EpError> {
    let cuda = move |call, source| EpError::Cuda { rank, call, source };
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda("cuStreamBeginCapture", e))?;
    let r = f(buf);
    let g = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| cuda("cuStreamEndCapture", e));
    let r = r?;
    let graph = g?.ok_or_else(|| invalid(rank, "the capture recorded no work"))?;
    Ok((graph, r))
}

/// Whether `stream` is being captured into a CUDA graph.
pub(crate) fn is_capturing(stream: &CudaStream, rank: usize) -> Result<bool, EpError> {
    let status = stream.capture_status().map_err(|source| EpError::Cuda {
        rank,
        call: "cuStreamIsCapturing",
        source,
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Refuses `what`, an operation that waits on the host, while `stream` (a buffer's communication
/// stream) is captured; `hint` ends the message, after "call it before or after the capture".
pub(crate) fn refuse_host_wait(
    stream: &CudaStream,
    rank: usize,
    what: &str,
    hint: &str,
) -> Result<(), EpError> {
    if is_capturing(stream, rank)? {
        return Err(invalid(
            rank,
            format!(
                "{what} waits on the host, which a CUDA-graph capture of the communication \
                 stream cannot hold: call it before or after the capture{hint}"
            ),
        ));
    }
    Ok(())
}
