//! Events that order work between the communication stream and the caller's streams, and bounded
//! host waits on them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::EpError;

/// A point in a stream's work: wait on it from another stream, or (bounded) from the host.
#[derive(Debug, Clone)]
pub struct Event {
    pub(crate) inner: Arc<CudaEvent>,
    pub(crate) rank: usize,
}

impl Event {
    pub(crate) fn record(stream: &CudaStream, rank: usize) -> Result<Self, EpError> {
        let inner = stream.record_event(None).map_err(|source| EpError::Cuda {
            rank,
            call: "cuEventRecord",
            source,
        })?;
        Ok(Self {
            inner: Arc::new(inner),
            rank,
        })
    }

    /// Records the current end of `stream`'s work.
    pub fn on(stream: &Arc<CudaStream>) -> Result<Self, EpError> {
        Self::record(stream, usize::MAX)
    }

    /// Records the current end of `stream`'s work in an event that can be timed with
    /// [`elapsed_ms`](Self::elapsed_ms).
    pub fn timed(stream: &Arc<CudaStream>) -> Result<Self, EpError> {
        let inner = stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|source| EpError::Cuda {
                rank: usize::MAX,
                call: "cuEventRecord",
                source,
            })?;
        Ok(Self {
            inner: Arc::new(inner),
            rank: usize::MAX,
        })
    }

    /// Milliseconds from this event to `end` (both from [`timed`](Self::timed), both complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, EpError> {
        self.inner
            .elapsed_ms(&end.inner)
            .map_err(|source| EpError::Cuda {
                rank: self.rank,
                call: "cuEventElapsedTime",
                source,
            })
    }

    /// Makes `stream` wait (on the GPU) for this event.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), EpError> {
        stream.wait(&self.inner).map_err(|source| EpError::Cuda {
            rank: self.rank,
            call: "cuStreamWaitEvent",
            source,
        })
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> Result<bool, EpError> {
        match self.inner.try_is_complete() {
            Ok(done) => Ok(done),
            Err(source) => Err(EpError::Cuda {
                rank: self.rank,
                call: "cuEventQuery",
                source,
            }),
        }
    }

    /// Waits on the host until the work before the event has finished, at most `timeout`.
    pub fn wait_host(&self, timeout: Duration, what: &'static str) -> Result<(), EpError> {
        let start = Instant::now();
        let mut spins = 0u32;
        while !self.is_complete()? {
            if start.elapsed() > timeout {
                return Err(EpError::HostTimeout {
                    rank: self.rank,
                    what,
                    timeout,
                });
            }
            backoff(&mut spins);
        }
        Ok(())
    }
}

/// Spin briefly, then yield, then sleep: short waits stay fast, long ones stay cheap.
pub(crate) fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 1000 {
        std::hint::spin_loop();
    } else if *spins < 2000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}
