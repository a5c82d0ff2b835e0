//! Ranks as threads of one process: the same collectives through shared memory.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::wire::Op;
use super::{BootstrapError, Communicator, DEFAULT_TIMEOUT, MAX_WORLD_SIZE};

/// Creates the communicators of a group of ranks that are threads of this process.
///
/// ```
/// use ep::bootstrap::{Communicator, ThreadGroup};
///
/// let comms = ThreadGroup::new(3).unwrap();
/// let all: Vec<_> = std::thread::scope(|s| {
///     let handles: Vec<_> = comms
///         .iter()
///         .map(|c| s.spawn(move || c.all_gather_bytes(&[c.rank() as u8 * 10]).unwrap()))
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert!(all.iter().all(|g| *g == vec![vec![0], vec![10], vec![20]]));
/// ```
#[derive(Debug)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// One communicator per rank, `world_size` in `1..=MAX_WORLD_SIZE`, each collective bounded by
    /// [`DEFAULT_TIMEOUT`]. Hand communicator `i` to the thread that is rank `i`.
    #[allow(
        clippy::new_ret_no_self,
        reason = "a thread group is nothing but its members' communicators"
    )]
    pub fn new(world_size: usize) -> Result<Vec<ThreadCommunicator>, BootstrapError> {
        Self::with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// As [`new`](Self::new), each collective bounded by `timeout`.
    pub fn with_timeout(
        world_size: usize,
        timeout: Duration,
    ) -> Result<Vec<ThreadCommunicator>, BootstrapError> {
        if !(1..=MAX_WORLD_SIZE).contains(&world_size) {
            return Err(BootstrapError::Config(format!(
                "thread group of {world_size} ranks: must be 1..={MAX_WORLD_SIZE}"
            )));
        }
        if let Err(e) = ibgda_device::timeout::check(timeout) {
            return Err(BootstrapError::Config(format!(
                "thread group of {world_size} ranks: timeout: {e}"
            )));
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                gen: 0,
                op: None,
                slots: vec![None; world_size],
                arrived: 0,
                done: None,
                left: vec![false; world_size],
                aborted: None,
            }),
            cv: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadCommunicator {
                rank,
                shared: shared.clone(),
                calls: Mutex::new(0),
            })
            .collect())
    }
}

/// A rank that is a thread of this process (see [`ThreadGroup`]).
///
/// Dropping it tells the group this rank has left: ranks waiting for it in a collective fail at
/// once instead of at their time bound (which is what happens when a rank's thread panics).
#[derive(Debug)]
pub struct ThreadCommunicator {
    rank: usize,
    shared: Arc<Shared>,
    /// Number of this rank's next collective; held through a call to serialize this rank's calls.
    calls: Mutex<u64>,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug)]
struct State {
    /// The collective being gathered: every rank has finished all earlier ones.
    gen: u64,
    /// Its kind and the first rank that called it, once a rank has.
    op: Option<(Op, usize)>,
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    /// The last finished collective and its parts. Only one is kept: a collective cannot finish
    /// before every rank has taken the result of the one before, since each must contribute.
    done: Option<(u64, Arc<Vec<Vec<u8>>>)>,
    /// Ranks whose communicator was dropped.
    left: Vec<bool>,
    aborted: Option<String>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state if something did.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ThreadCommunicator {
    /// The time bound of each collective.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn collective(&self, op: Op, mine: &[u8]) -> Result<Arc<Vec<Vec<u8>>>, BootstrapError> {
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = *calls;
        *calls += 1;
        let step = format!("{} #{seq}", op.name());
        let rank = self.rank;
        let sh = &*self.shared;
        let started = Instant::now();
        let deadline = ibgda_device::timeout::deadline_after(started, sh.timeout);
        let mut st = sh.lock();
        let abort = |st: &mut State, err: &BootstrapError| {
            st.aborted.get_or_insert_with(|| err.to_string());
            sh.cv.notify_all();
        };
        if let Some(reason) = &st.aborted {
            return Err(BootstrapError::Aborted {
                rank,
                step,
                reason: reason.clone(),
            });
        }
        debug_assert_eq!(
            st.gen, seq,
            "a rank cannot run ahead of an unfinished collective"
        );
        match st.op {
            None => st.op = Some((op, rank)),
            Some((first, by)) if first != op => {
                let err = BootstrapError::Protocol {
                    rank,
                    step: step.clone(),
                    peer: format!("rank {by}"),
                    detail: format!(
                        "rank {by} called {} #{seq} where rank {rank} called {step}: every rank \
                         must call the same collectives in the same order",
                        first.name()
                    ),
                };
                abort(&mut st, &err);
                return Err(err);
            }
            Some(_) => {}
        }
        st.slots[rank] = Some(mine.to_vec());
        st.arrived += 1;
        if st.arrived == sh.world_size {
            let parts: Vec<Vec<u8>> = st
                .slots
                .iter_mut()
                .map(|s| s.take().unwrap_or_default())
                .collect();
            let parts = Arc::new(parts);
            st.done = Some((seq, parts.clone()));
            st.gen += 1;
            st.arrived = 0;
            st.op = None;
            sh.cv.notify_all();
            return Ok(parts);
        }
        loop {
            if let Some((g, parts)) = &st.done {
                if *g == seq {
                    return Ok(parts.clone());
                }
            }
            if let Some(reason) = &st.aborted {
                return Err(BootstrapError::Aborted {
                    rank,
                    step,
                    reason: reason.clone(),
                });
            }
            let gone: Vec<usize> = (0..sh.world_size)
                .filter(|&r| st.left[r] && st.slots[r].is_none())
                .collect();
            if !gone.is_empty() {
                let err = BootstrapError::Protocol {
                    rank,
                    step: step.clone(),
                    peer: format!("ranks {gone:?}"),
                    detail: format!(
                        "ranks {gone:?} left the group (their communicators were dropped, or their \
                         threads ended) before {step}"
                    ),
                };
                abort(&mut st, &err);
                return Err(err);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..sh.world_size)
                    .filter(|&r| st.slots[r].is_none())
                    .collect();
                let err = BootstrapError::Timeout {
                    rank,
                    step: step.clone(),
                    waited: now - started,
                    detail: format!(
                        "ranks {missing:?} of {} did not reach {step}",
                        sh.world_size
                    ),
                };
                abort(&mut st, &err);
                return Err(err);
            }
            st = sh
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Communicator for ThreadCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn same_process(&self) -> bool {
        true
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        Ok((*self.collective(Op::AllGather, mine)?).clone())
    }

    fn barrier(&self) -> Result<(), BootstrapError> {
        self.collective(Op::Barrier, &[]).map(drop)
    }
}

impl Drop for ThreadCommunicator {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.left[self.rank] = true;
        self.shared.cv.notify_all();
    }
}
