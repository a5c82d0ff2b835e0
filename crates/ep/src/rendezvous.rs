//! The small facts the ranks of a group swap while they build a buffer (layouts, options,
//! status words), as collectives of `u64` words over the group's
//! [`Communicator`](crate::bootstrap::Communicator): TCP between processes, shared memory between
//! threads ([`bootstrap::ThreadGroup`](crate::bootstrap::ThreadGroup)). Buffers themselves are
//! shared with [`exchange_buffers`](crate::bootstrap::exchange_buffers).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;

use crate::bootstrap::{Communicator, ThreadCommunicator, ThreadGroup};
use crate::error::EpError;

/// Word-sized collectives on any [`Communicator`], with errors as [`EpError`]. Implemented for
/// every communicator (including `dyn Communicator`); bring it into scope and call it.
///
/// ```
/// use ep::bootstrap::{Communicator, ThreadGroup};
/// use ep::Exchange;
///
/// let comms = ThreadGroup::new(2).unwrap();
/// let all: Vec<_> = std::thread::scope(|s| {
///     let hs: Vec<_> = comms
///         .iter()
///         .map(|c| s.spawn(move || c.all_gather(&[c.rank() as u64, 7]).unwrap()))
///         .collect();
///     hs.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert!(all.iter().all(|g| *g == vec![vec![0, 7], vec![1, 7]]));
/// ```
pub trait Exchange: Communicator {
    /// Ranks in the group (the communicator's world size).
    fn ranks(&self) -> usize {
        self.world_size()
    }

    /// Every rank's `mine`, indexed by rank; returns within the communicator's time bound.
    fn all_gather(&self, mine: &[u64]) -> Result<Vec<Vec<u64>>, EpError> {
        let rank = self.rank();
        let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
        let all = self
            .all_gather_bytes(&bytes)
            .map_err(|source| EpError::Bootstrap { rank, source })?;
        all.iter()
            .enumerate()
            .map(|(r, b)| {
                if b.len() % 8 != 0 {
                    return Err(EpError::Rendezvous {
                        rank,
                        what: format!("rank {r} sent {} bytes, not whole u64 words", b.len()),
                    });
                }
                Ok(b.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect())
            })
            .collect()
    }
}

impl<C: Communicator + ?Sized> Exchange for C {}

/// Runs `build(ctx, comm)` for every rank as a thread of this process (rank `i` on `ctxs[i]`),
/// the ranks joined by one [`ThreadGroup`] bounded by `timeout`; returns the results by rank. A
/// rank whose thread panics gives [`EpError::Panicked`] with the panic's text.
///
/// The joins have no bound of their own, and need none: every wait inside `build` is bounded
/// (the group's collectives by `timeout`, GPU waits by theirs), and a rank that panics drops its
/// communicator, which fails the others' next collective at once.
pub(crate) fn build_as_threads<T: Send>(
    ctxs: &[Arc<CudaContext>],
    timeout: Duration,
    build: impl Fn(&Arc<CudaContext>, ThreadCommunicator) -> Result<T, EpError> + Sync,
) -> Result<Vec<T>, EpError> {
    let comms = ThreadGroup::with_timeout(ctxs.len(), timeout)
        .map_err(|source| EpError::Bootstrap { rank: 0, source })?;
    let build = &build;
    std::thread::scope(|s| {
        let joins: Vec<_> = ctxs
            .iter()
            .zip(comms)
            .map(|(ctx, comm)| s.spawn(move || build(ctx, comm)))
            .collect();
        join_ranks(joins, "buffer creation")
    })
}

/// Joins the threads of ranks `0..`, in rank order; a thread that panicked while doing `what`
/// gives [`EpError::Panicked`] with the panic's text.
fn join_ranks<T>(
    joins: Vec<std::thread::ScopedJoinHandle<'_, Result<T, EpError>>>,
    what: &'static str,
) -> Result<Vec<T>, EpError> {
    joins
        .into_iter()
        .enumerate()
        .map(|(r, j)| {
            j.join().unwrap_or_else(|payload| {
                Err(EpError::Panicked {
                    rank: r,
                    what,
                    message: crate::bootstrap::panic_text(payload.as_ref()),
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bootstrap::ThreadGroup;

    #[test]
    fn all_gather_orders_by_rank_over_several_rounds() {
        let comms = ThreadGroup::new(4).unwrap();
        std::thread::scope(|s| {
            for (r, m) in comms.iter().enumerate() {
                s.spawn(move || {
                    assert_eq!(m.ranks(), 4);
                    for round in 0..50u64 {
                        let all = m
                            .all_gather(&[r as u64, round, u64::MAX - r as u64])
                            .unwrap();
                        for (q, v) in all.iter().enumerate() {
                            assert_eq!(v, &vec![q as u64, round, u64::MAX - q as u64]);
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_rank_keeps_its_message() {
        let r: Result<Vec<()>, EpError> = std::thread::scope(|s| {
            let joins = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        if rank == 1 {
                            panic!("rank {rank} lost its GPU");
                        }
                        Ok(())
                    })
                })
                .collect();
            join_ranks(joins, "buffer creation")
        });
        let e = r.unwrap_err();
        assert!(matches!(e, EpError::Panicked { rank: 1, .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "rank 1: buffer creation panicked: rank 1 lost its GPU"
        );
    }

    #[test]
    fn a_missing_rank_is_named() {
        let comms = ThreadGroup::with_timeout(3, Duration::from_millis(100)).unwrap();
        let m: &dyn Communicator = &comms[1];
        let e = m.all_gather(&[1]).unwrap_err();
        assert!(matches!(e, EpError::Bootstrap { rank: 1, .. }), "{e}");
        assert!(e.to_string().contains("[0, 2]"), "{e}");
    }
}
