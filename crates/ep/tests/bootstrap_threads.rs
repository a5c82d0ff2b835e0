//! Ranks as threads of one process: the same collectives as over TCP, the same bounded failures.

use std::thread;
use std::time::{Duration, Instant};

use ep::bootstrap::{BootstrapError, Communicator, ThreadCommunicator, ThreadGroup};

/// Runs `f` on one thread per communicator and returns each rank's result.
fn run<T: Send>(
    comms: Vec<ThreadCommunicator>,
    f: impl Fn(ThreadCommunicator) -> T + Sync,
) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn payload(rank: usize, round: usize) -> Vec<u8> {
    let len = (rank * 5 + round) % 17;
    (0..len).map(|i| (rank ^ round ^ i) as u8).collect()
}

#[test]
fn collectives_1_2_4_8_ranks() {
    for world in [1, 2, 4, 8] {
        let comms = ThreadGroup::new(world).unwrap();
        let out = run(comms, |c| {
            assert!(c.same_process());
            for round in 0..200 {
                let all = c.all_gather_bytes(&payload(c.rank(), round)).unwrap();
                let want: Vec<Vec<u8>> = (0..world).map(|r| payload(r, round)).collect();
                assert_eq!(all, want, "world {world} round {round}");
                if round % 3 == 0 {
                    c.barrier().unwrap();
                }
                let root = round % world;
                assert_eq!(
                    c.broadcast_bytes(root, &payload(c.rank(), round)).unwrap(),
                    payload(root, round)
                );
            }
            c.rank()
        });
        assert_eq!(out, (0..world).collect::<Vec<_>>());
    }
}

#[test]
fn barrier_waits_for_the_slowest_rank() {
    let delay = Duration::from_millis(300);
    let out = run(ThreadGroup::new(4).unwrap(), |c| {
        if c.rank() == 3 {
            thread::sleep(delay);
        }
        let t = Instant::now();
        c.barrier().unwrap();
        t.elapsed()
    });
    assert!(out[0] >= delay - Duration::from_millis(50), "{:?}", out[0]);
}

#[test]
fn missing_rank_times_out_naming_it() {
    let timeout = Duration::from_millis(300);
    let mut comms = ThreadGroup::with_timeout(3, timeout).unwrap();
    // Rank 2 stays alive but never calls the collective.
    let absent = comms.pop().unwrap();
    let t = Instant::now();
    let out = run(comms, |c| c.all_gather_bytes(b"x").unwrap_err().to_string());
    let took = t.elapsed();
    for msg in &out {
        assert!(
            msg.contains("ranks [2] of 3 did not reach all_gather #0"),
            "{msg}"
        );
    }
    assert!(took < timeout + Duration::from_secs(1), "took {took:?}");
    // The group stays failed, also for the rank that was late.
    let late = absent.barrier().unwrap_err();
    assert!(
        matches!(late, BootstrapError::Aborted { rank: 2, .. }),
        "{late}"
    );
}

#[test]
fn dropped_rank_fails_the_others_at_once() {
    let mut comms = ThreadGroup::with_timeout(3, Duration::from_secs(60)).unwrap();
    drop(comms.remove(1));
    let t = Instant::now();
    let out = run(comms, |c| c.barrier().unwrap_err().to_string());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    for msg in out {
        assert!(msg.contains("ranks [1] left the group"), "{msg}");
    }
}

#[test]
fn panicking_rank_fails_the_others_at_once() {
    let comms = ThreadGroup::with_timeout(2, Duration::from_secs(60)).unwrap();
    let t = Instant::now();
    let out: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    if c.rank() == 1 {
                        panic!("rank 1 fails on purpose");
                    }
                    c.barrier()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    assert!(out[1].is_err());
    let err = out[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(err.to_string().contains("left the group"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn ranks_calling_different_collectives_are_caught() {
    let out = run(
        ThreadGroup::with_timeout(2, Duration::from_secs(60)).unwrap(),
        |c| {
            if c.rank() == 0 {
                thread::sleep(Duration::from_millis(50));
                c.barrier().unwrap_err().to_string()
            } else {
                c.all_gather_bytes(b"x").unwrap_err().to_string()
            }
        },
    );
    for msg in out {
        assert!(
            msg.contains("rank 1 called all_gather #0 where rank 0 called barrier #0"),
            "{msg}"
        );
    }
}

#[test]
fn group_sizes_are_checked() {
    for n in [0, 65] {
        let err = ThreadGroup::new(n).unwrap_err();
        assert!(matches!(err, BootstrapError::Config(_)), "{err}");
    }
    assert!(ThreadGroup::with_timeout(2, Duration::ZERO).is_err());
}

#[test]
fn one_rank_calls_from_several_threads() {
    // Calls of one rank from several threads are serialized, not mixed up.
    let comms = ThreadGroup::with_timeout(2, Duration::from_secs(30)).unwrap();
    let out = run(comms, |c| {
        thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| c.all_gather_bytes(&[c.rank() as u8]).unwrap()))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    for per_rank in out {
        for all in per_rank {
            assert_eq!(all, vec![vec![0], vec![1]]);
        }
    }
}

#[test]
fn thread_group_timeouts_are_validated() {
    use ep::bootstrap::{BootstrapError, ThreadGroup};
    use std::time::Duration;
    // Duration::MAX used to be accepted and then panic (`Instant + Duration`) in the first
    // collective; zero failed every collective at once.
    for bad in [Duration::ZERO, Duration::MAX, Duration::from_secs(86_401)] {
        let e = ThreadGroup::with_timeout(2, bad).unwrap_err();
        assert!(
            matches!(e, BootstrapError::Config(_)) && e.to_string().contains("timeout"),
            "{bad:?}: {e}"
        );
    }
    assert!(ThreadGroup::with_timeout(2, Duration::from_secs(86_400)).is_ok());
}
