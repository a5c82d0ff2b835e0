//! Optional phase timing of the internode operations: where a dispatch or a combine spends its
//! time, for benchmarks ([`InternodeBuffer::record_phases`]).
//!
//! Off by default; then each phase boundary costs one test of an `Option`. On, each boundary
//! records a timing event on the communication stream (where every phase's GPU work is ordered,
//! the NVLink hop's joined back to it) and reads the host clock. A phase is the span between two
//! boundaries:
//! - `gpu_us`: from the previous boundary's event to this one's, on the stream: the GPU work of
//!   the phase, plus any time the stream sat idle because the host had not queued it yet (a host
//!   wait, an allocation or a launch gate before it);
//! - `host_us`: the host's time between the two boundaries: launches, allocations, host waits
//!   and launch-gate meetings with the ranks that share the GPU.
//!
//! A phase that is GPU-bound has `gpu_us` above `host_us`; one where the host waits has them
//! about equal (the stream drained); a large `host_us` over little GPU work points at the host.
//! Nothing is recorded while the stream is being captured into a CUDA graph.

use std::time::Instant;

use super::buffer::InternodeBuffer;
use crate::error::EpError;
use crate::event::Event;

/// The RDMA writes one put posts to one node, as the host plans them (the device plans the same
/// put from the same counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutCount {
    /// The destination node.
    pub node: usize,
    /// Non-empty sections written (rows, scales, ids, weights).
    pub segments: usize,
    /// RDMA-write WQEs: each section cut into pieces of at most
    /// [`PUT_CHUNK_BYTES`](ibgda_device::protocol::PUT_CHUNK_BYTES).
    pub write_wqes: u64,
    /// Signal WQEs behind them (a fenced atomic add).
    pub signal_wqes: u64,
    /// Payload bytes of the writes.
    pub bytes: u64,
    /// The largest write WQE's payload.
    pub largest_wqe: u64,
}

/// One phase of an operation (see the module docs for what the two times mean).
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTiming {
    /// The operation: `dispatch`, `cached dispatch` or `combine`.
    pub op: &'static str,
    /// The phase.
    pub name: &'static str,
    /// The source or destination node the phase is about, where it is per node.
    pub node: Option<usize>,
    /// Stream time from the previous boundary, µs.
    pub gpu_us: f64,
    /// Host time from the previous boundary, µs.
    pub host_us: f64,
    /// Bytes the phase moves (as the host knows them; 0 where the counts stay on the GPU).
    pub bytes: u64,
    /// The puts of a put phase, per destination node.
    pub puts: Vec<PutCount>,
}

impl PhaseTiming {
    /// `name`, with `[node]` where the phase is per node: unique within an operation.
    pub fn label(&self) -> String {
        match self.node {
            Some(n) => format!("{}[{n}]", self.name),
            None => self.name.to_string(),
        }
    }
}

/// One recorded boundary.
#[derive(Debug)]
struct Mark {
    op: &'static str,
    /// `None` for the start of an operation.
    name: Option<&'static str>,
    node: Option<usize>,
    event: Event,
    host: Instant,
    bytes: u64,
    puts: Vec<PutCount>,
}

/// The boundaries recorded since the last [`InternodeBuffer::take_phases`].
#[derive(Debug, Default)]
pub(super) struct PhaseRecorder {
    marks: Vec<Mark>,
    /// The operation the next boundaries belong to.
    op: Option<&'static str>,
}

/// What one boundary carries besides its name.
#[derive(Debug, Default)]
pub(super) struct PhaseInfo {
    pub node: Option<usize>,
    pub bytes: u64,
    pub puts: Vec<PutCount>,
}

impl PhaseInfo {
    /// A phase about node `n` that moves `bytes`.
    pub(super) fn node(n: usize, bytes: u64) -> Self {
        Self {
            node: Some(n),
            bytes,
            puts: Vec::new(),
        }
    }

    /// A phase that moves `bytes`.
    pub(super) fn bytes(bytes: u64) -> Self {
        Self {
            bytes,
            ..Self::default()
        }
    }
}

/// The writes of one section of `bytes` cut as `ibgda_put_warp` cuts them: (WQEs, largest).
pub(super) fn chunks(bytes: u64) -> (u64, u64) {
    let chunk = u64::from(ibgda_device::protocol::PUT_CHUNK_BYTES);
    (bytes.div_ceil(chunk), bytes.min(chunk))
}

/// The count of a put to `node` of `segments` section sizes and `signals` signal WQEs.
pub(super) fn put_count(node: usize, segments: &[usize], signals: u64) -> PutCount {
    let mut c = PutCount {
        node,
        segments: 0,
        write_wqes: 0,
        signal_wqes: signals,
        bytes: 0,
        largest_wqe: 0,
    };
    for &b in segments.iter().filter(|&&b| b > 0) {
        let (wqes, largest) = chunks(b as u64);
        c.segments += 1;
        c.write_wqes += wqes;
        c.bytes += b as u64;
        c.largest_wqe = c.largest_wqe.max(largest);
    }
    c
}

impl InternodeBuffer {
    /// Turns phase timing of the following operations on or off (off drops what was recorded).
    ///
    /// On, dispatch, cached dispatch and combine record a timing event on the communication
    /// stream and read the host clock at each boundary between their phases (layout of the put,
    /// pack, put and quiet, signal waits, host waits, the NVLink hop, gather and scatter,
    /// reduction, acks); [`take_phases`](Self::take_phases) returns the phases. Costs a few
    /// microseconds of host time per boundary, so benchmarks time their rounds with it off.
    /// Nothing is recorded under CUDA-graph capture.
    pub fn record_phases(&mut self, on: bool) {
        self.phases = on.then(Box::default);
    }

    /// The phases recorded since phase timing was turned on or last taken, in order (waits,
    /// bounded, for the work they time to finish). Empty when phase timing is off.
    pub fn take_phases(&mut self) -> Result<Vec<PhaseTiming>, EpError> {
        let Some(rec) = self.phases.as_mut() else {
            return Ok(Vec::new());
        };
        let marks = std::mem::take(&mut rec.marks);
        rec.op = None;
        if let Some(last) = marks.last() {
            last.event
                .wait_host(self.opts.buffer.timeout, "the timed internode phases")?;
        }
        let mut out = Vec::new();
        for w in marks.windows(2) {
            let (prev, m) = (&w[0], &w[1]);
            let Some(name) = m.name else { continue };
            if prev.op != m.op {
                continue;
            }
            out.push(PhaseTiming {
                op: m.op,
                name,
                node: m.node,
                gpu_us: f64::from(prev.event.elapsed_ms(&m.event)?) * 1e3,
                host_us: m.host.duration_since(prev.host).as_secs_f64() * 1e6,
                bytes: m.bytes,
                puts: m.puts.clone(),
            });
        }
        Ok(out)
    }

    /// Whether phase boundaries are being recorded (cheap: no driver call).
    pub(super) fn timing_phases(&self) -> bool {
        self.phases.is_some()
    }

    /// Starts the phases of operation `op` (when phase timing is on).
    pub(super) fn phase_begin(&mut self, op: &'static str) -> Result<(), EpError> {
        if self.phases.is_none() {
            return Ok(());
        }
        self.push_mark(op, None, PhaseInfo::default())
    }

    /// Ends phase `name` of the current operation (when phase timing is on and an operation
    /// was begun).
    pub(super) fn phase(&mut self, name: &'static str, info: PhaseInfo) -> Result<(), EpError> {
        let Some(op) = self.phases.as_ref().and_then(|p| p.op) else {
            return Ok(());
        };
        self.push_mark(op, Some(name), info)
    }

    fn push_mark(
        &mut self,
        op: &'static str,
        name: Option<&'static str>,
        info: PhaseInfo,
    ) -> Result<(), EpError> {
        if self.is_capturing()? {
            return Ok(());
        }
        let event = Event::timed(&self.stream)?;
        let host = Instant::now();
        if let Some(rec) = self.phases.as_mut() {
            rec.op = Some(op);
            rec.marks.push(Mark {
                op,
                name,
                node: info.node,
                event,
                host,
                bytes: info.bytes,
                puts: info.puts,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_are_cut_as_the_device_cuts_them() {
        let chunk = ibgda_device::protocol::PUT_CHUNK_BYTES as usize;
        let c = put_count(1, &[3 * chunk + 16, 0, 4096, 4096], 1);
        assert_eq!(c.segments, 3);
        assert_eq!(c.write_wqes, 4 + 1 + 1);
        assert_eq!(c.signal_wqes, 1);
        assert_eq!(c.bytes as usize, 3 * chunk + 16 + 8192);
        assert_eq!(c.largest_wqe as usize, chunk);
        assert_eq!(chunks(0), (0, 0));
    }
}
