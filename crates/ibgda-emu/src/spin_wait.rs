//! A bounded host wait of the CUDA backend: spin for the first polls, then yield the thread,
//! and give up with [`EmuError::BackendTimeout`] after a deadline.

use std::time::{Duration, Instant};

use crate::error::EmuError;

/// One wait in progress: call [`SpinWait::pause`] after each poll that found the condition unmet.
pub(crate) struct SpinWait {
    t0: Instant,
    polls: u32,
    spins: u32,
    timeout: Duration,
    what: &'static str,
}

impl SpinWait {
    /// Starts the clock: `spins` polls spin before the wait yields; `what` names it in the error.
    pub(crate) fn new(timeout: Duration, spins: u32, what: &'static str) -> Self {
        SpinWait {
            t0: Instant::now(),
            polls: 0,
            spins,
            timeout,
            what,
        }
    }

    /// Fails once the deadline has passed; otherwise spins or yields before the next poll.
    pub(crate) fn pause(&mut self) -> Result<(), EmuError> {
        if self.t0.elapsed() > self.timeout {
            return Err(EmuError::BackendTimeout {
                backend: "cuda",
                what: self.what,
                waited: self.t0.elapsed(),
            });
        }
        self.polls += 1;
        if self.polls < self.spins {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        Ok(())
    }
}
