//! How the ranks of a group swap the small facts a [`Buffer`](crate::Buffer) needs at creation
//! (GPU ordinals, region addresses). Ranks as threads of one process use [`ThreadGroup`]; ranks
//! as processes plug in through the same trait (with CUDA IPC handles in place of addresses).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::EpError;

/// A rank's view of its group: one collective, all-gather of `u64` words.
pub trait Exchange: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn ranks(&self) -> usize;
    /// Whether every rank is a thread of this process, so device addresses mean the same on all
    /// (once peer access is enabled).
    fn same_process(&self) -> bool;
    /// Every rank's `mine`, indexed by rank; returns within the group's time bound.
    fn all_gather(&self, mine: &[u64]) -> Result<Vec<Vec<u64>>, EpError>;
}

#[derive(Debug)]
struct Round {
    generation: u64,
    slots: Vec<Option<Vec<u64>>>,
    last: Arc<Vec<Vec<u64>>>,
}

/// The shared state of a group of ranks that are threads of one process.
#[derive(Debug)]
pub struct ThreadGroup {
    ranks: usize,
    timeout: Duration,
    state: Mutex<Round>,
    cv: Condvar,
}

impl ThreadGroup {
    /// A group of `ranks` threads whose collectives wait at most `timeout` for the others.
    pub fn new(ranks: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            ranks,
            timeout,
            state: Mutex::new(Round {
                generation: 0,
                slots: vec![None; ranks],
                last: Arc::new(Vec::new()),
            }),
            cv: Condvar::new(),
        })
    }

    /// Rank `rank`'s handle on the group.
    pub fn member(self: &Arc<Self>, rank: usize) -> ThreadMember {
        ThreadMember {
            group: self.clone(),
            rank,
        }
    }
}

/// One rank's handle on a [`ThreadGroup`].
#[derive(Debug, Clone)]
pub struct ThreadMember {
    group: Arc<ThreadGroup>,
    rank: usize,
}

impl Exchange for ThreadMember {
    fn rank(&self) -> usize {
        self.rank
    }
    fn ranks(&self) -> usize {
        self.group.ranks
    }
    fn same_process(&self) -> bool {
        true
    }
    fn all_gather(&self, mine: &[u64]) -> Result<Vec<Vec<u64>>, EpError> {
        let g = &*self.group;
        let fail = |what: String| EpError::Rendezvous {
            rank: self.rank,
            what,
        };
        let mut s = g
            .state
            .lock()
            .map_err(|_| fail("a rank panicked inside the rendezvous".into()))?;
        if s.slots[self.rank].is_some() {
            return Err(fail(
                "this rank called all_gather twice in one round".into(),
            ));
        }
        let my_generation = s.generation;
        s.slots[self.rank] = Some(mine.to_vec());
        if s.slots.iter().all(Option::is_some) {
            let all: Vec<Vec<u64>> = s
                .slots
                .iter_mut()
                .map(|x| x.take().unwrap_or_default())
                .collect();
            s.last = Arc::new(all);
            s.generation += 1;
            g.cv.notify_all();
            return Ok((*s.last).clone());
        }
        let deadline = Instant::now() + g.timeout;
        while s.generation == my_generation {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> = (0..g.ranks).filter(|&r| s.slots[r].is_none()).collect();
                s.slots[self.rank] = None;
                return Err(fail(format!(
                    "ranks {missing:?} did not arrive within {:?}",
                    g.timeout
                )));
            }
            s =
                g.cv.wait_timeout(s, left)
                    .map_err(|_| fail("a rank panicked inside the rendezvous".into()))?
                    .0;
        }
        Ok((*s.last).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_orders_by_rank_over_several_rounds() {
        let g = ThreadGroup::new(4, Duration::from_secs(10));
        std::thread::scope(|s| {
            for r in 0..4 {
                let m = g.member(r);
                s.spawn(move || {
                    for round in 0..50u64 {
                        let all = m.all_gather(&[r as u64, round]).unwrap();
                        for (q, v) in all.iter().enumerate() {
                            assert_eq!(v, &vec![q as u64, round]);
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_missing_rank_is_named() {
        let g = ThreadGroup::new(3, Duration::from_millis(100));
        let e = g.member(1).all_gather(&[1]).unwrap_err().to_string();
        assert!(e.contains("[0, 2]"), "{e}");
    }
}
