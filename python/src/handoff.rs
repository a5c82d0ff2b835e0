//! The stream hand-off between the caller's stream and a buffer's communication stream, done
//! here rather than with torch events in Python (two torch `Event` calls per direction cost
//! several microseconds of host time each; two driver calls cost well under one).
//!
//! Each native buffer owns one [`Handoff`]: two events made once (timing disabled) and
//! re-recorded at every operation. A `cuStreamWaitEvent` takes the event's state when it is
//! queued, so re-recording later never moves an earlier wait (as with the torch events this
//! replaces). The caller's stream arrives as a raw `CUstream` handle
//! (`torch._C._cuda_getCurrentRawStream`), a stream of the buffer's GPU.

use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUevent_wait_flags, CUstream};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, DriverError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::PyResult;

/// Two re-recorded events: into the communication stream, and out of it.
pub(crate) struct Handoff {
    into_comm: CudaEvent,
    out_of_comm: CudaEvent,
    /// The buffer's rank, for errors.
    rank: usize,
}

fn failed(rank: usize, call: &str, e: DriverError) -> pyo3::PyErr {
    PyRuntimeError::new_err(format!("rank {rank}: {call} (stream hand-off) failed: {e}"))
}

impl Handoff {
    /// The two events, made in `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>, rank: usize) -> PyResult<Self> {
        let make = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| failed(rank, "cuEventCreate", e))
        };
        Ok(Self {
            into_comm: make()?,
            out_of_comm: make()?,
            rank,
        })
    }

    /// `comm` waits (on the GPU) for the work queued on `caller` so far.
    pub(crate) fn comm_after(&self, comm: &CudaStream, caller: u64) -> PyResult<()> {
        Self::order(
            &self.into_comm,
            caller as CUstream,
            comm.cu_stream(),
            self.rank,
        )
    }

    /// `caller` waits (on the GPU) for the work queued on `comm` so far.
    pub(crate) fn caller_after(&self, comm: &CudaStream, caller: u64) -> PyResult<()> {
        Self::order(
            &self.out_of_comm,
            comm.cu_stream(),
            caller as CUstream,
            self.rank,
        )
    }

    /// Records `ev` on `from` and makes `to` wait for it.
    fn order(ev: &CudaEvent, from: CUstream, to: CUstream, rank: usize) -> PyResult<()> {
        ev.context()
            .bind_to_thread()
            .map_err(|e| failed(rank, "cuCtxSetCurrent", e))?;
        // The buffer's stream is kept for the process's life (`kept_streams`); torch keeps the
        // caller's current stream while it is current (read just before this call).
        // SAFETY: `ev` is a live event of this context (owned by `self`); `from` and `to` are
        // live streams of the same GPU (see above).
        unsafe { result::event::record(ev.cu_event(), from) }
            .map_err(|e| failed(rank, "cuEventRecord", e))?;
        // SAFETY: as above.
        unsafe {
            result::stream::wait_event(to, ev.cu_event(), CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(|e| failed(rank, "cuStreamWaitEvent", e))
    }
}
