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
    /// Where its errors say they happened: a buffer's rank, or (an event of the caller's own
    /// stream, [`Event::on`], [`Event::timed`]) the GPU.
    at: Where,
}

/// What an event's errors name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    Rank(usize),
    Gpu(usize),
}

impl Where {
    fn cuda(self, call: &'static str, source: cudarc::driver::DriverError) -> EpError {
        match self {
            Where::Rank(rank) => EpError::Cuda { rank, call, source },
            Where::Gpu(gpu) => EpError::Stream { gpu, call, source },
        }
    }
}

impl Event {
    pub(crate) fn record(stream: &CudaStream, rank: usize) -> Result<Self, EpError> {
        Self::make(stream, Where::Rank(rank), None)
    }

    fn make(
        stream: &CudaStream,
        at: Where,
        flags: Option<cudarc::driver::sys::CUevent_flags>,
    ) -> Result<Self, EpError> {
        let inner = stream
            .record_event(flags)
            .map_err(|source| at.cuda("cuEventRecord", source))?;
        Ok(Self {
            inner: Arc::new(inner),
            at,
        })
    }

    /// Records the current end of `stream`'s work.
    pub fn on(stream: &Arc<CudaStream>) -> Result<Self, EpError> {
        Self::make(stream, Where::Gpu(stream.context().ordinal()), None)
    }

    /// Records the current end of `stream`'s work in an event that can be timed with
    /// [`elapsed_ms`](Self::elapsed_ms).
    pub fn timed(stream: &Arc<CudaStream>) -> Result<Self, EpError> {
        Self::make(
            stream,
            Where::Gpu(stream.context().ordinal()),
            Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT),
        )
    }

    /// Milliseconds from this event to `end` (both from [`timed`](Self::timed), both complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, EpError> {
        self.inner
            .elapsed_ms(&end.inner)
            .map_err(|source| self.at.cuda("cuEventElapsedTime", source))
    }

    /// Makes `stream` wait (on the GPU) for this event.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), EpError> {
        stream
            .wait(&self.inner)
            .map_err(|source| self.at.cuda("cuStreamWaitEvent", source))
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> Result<bool, EpError> {
        match self.inner.try_is_complete() {
            Ok(done) => Ok(done),
            Err(source) => Err(self.at.cuda("cuEventQuery", source)),
        }
    }

    /// Waits on the host until the work before the event has finished, at most `timeout`.
    pub fn wait_host(&self, timeout: Duration, what: &'static str) -> Result<(), EpError> {
        let start = Instant::now();
        let mut spins = 0u32;
        while !self.is_complete()? {
            if start.elapsed() > timeout {
                return Err(match self.at {
                    Where::Rank(rank) => EpError::HostTimeout {
                        rank,
                        what,
                        timeout,
                    },
                    Where::Gpu(gpu) => EpError::StreamTimeout { gpu, what, timeout },
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_of_the_callers_own_events_name_the_gpu_not_a_rank() {
        let e = cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY);
        assert!(matches!(
            Where::Gpu(3).cuda("cuEventQuery", e),
            EpError::Stream {
                gpu: 3,
                call: "cuEventQuery",
                ..
            }
        ));
        assert!(matches!(
            Where::Rank(1).cuda("cuEventQuery", e),
            EpError::Cuda {
                rank: 1,
                call: "cuEventQuery",
                ..
            }
        ));
        let t = EpError::StreamTimeout {
            gpu: 3,
            what: "the compute stream",
            timeout: Duration::from_secs(1),
        };
        assert!(!t.to_string().contains(&usize::MAX.to_string()), "{t}");
    }
}
