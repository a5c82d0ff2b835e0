//! Ranks over TCP on loopback, each rank a thread with its own `TcpCommunicator`: rendezvous,
//! collectives, and every way a job can go wrong (stranger, wrong world size, missing rank, rank
//! that exits, ranks calling different collectives), each ending in a clear error within its bound.

use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use ep::bootstrap::{BootstrapError, Communicator, JobToken, RankConfig, TcpCommunicator};

fn bound_listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

fn cfg(rank: usize, world: usize, port: u16, token: JobToken, timeout: Duration) -> RankConfig {
    RankConfig::new(rank, world, port)
        .unwrap()
        .with_token(token)
        .with_timeout(timeout)
}

/// Runs `world` ranks as threads; rank 0 listens on a fresh port. Returns each rank's result.
fn run_ranks<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(TcpCommunicator) -> Result<T, BootstrapError> + Sync,
) -> Vec<Result<T, BootstrapError>> {
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let f = &f;
    thread::scope(|s| {
        let mut listener = Some(listener);
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let c = cfg(r, world, port, token, timeout);
                let l = if r == 0 { listener.take() } else { None };
                s.spawn(move || {
                    let comm = match l {
                        Some(l) => TcpCommunicator::with_listener(&c, l)?,
                        None => TcpCommunicator::connect(&c)?,
                    };
                    f(comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn payload(rank: usize, round: usize) -> Vec<u8> {
    // Different lengths per rank and round, rank 1 sometimes empty.
    let len = (rank * 7 + round * 3) % 23;
    (0..len)
        .map(|i| (rank * 31 + round * 17 + i) as u8)
        .collect()
}

#[test]
fn all_gather_barrier_broadcast_1_2_4_8_ranks() {
    for world in [1, 2, 4, 8] {
        let results = run_ranks(world, Duration::from_secs(30), |comm| {
            assert_eq!(comm.world_size(), world);
            for round in 0..20 {
                let all = comm.all_gather_bytes(&payload(comm.rank(), round))?;
                let want: Vec<Vec<u8>> = (0..world).map(|r| payload(r, round)).collect();
                assert_eq!(
                    all,
                    want,
                    "world {world}, round {round}, rank {}",
                    comm.rank()
                );
                comm.barrier()?;
                let root = round % world;
                let b = comm.broadcast_bytes(root, &payload(comm.rank(), round))?;
                assert_eq!(b, payload(root, round));
            }
            // A large message: frames longer than a socket buffer.
            let big: Vec<u8> = (0..(1 << 20) + 3)
                .map(|i| (i * 7 + comm.rank()) as u8)
                .collect();
            let all = comm.all_gather_bytes(&big)?;
            for (r, part) in all.iter().enumerate() {
                assert_eq!(part.len(), big.len());
                assert!(part
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i * 7 + r) as u8));
            }
            Ok(comm.rank())
        });
        for (r, res) in results.into_iter().enumerate() {
            assert_eq!(res.unwrap(), r, "world {world}");
        }
    }
}

#[test]
fn barrier_waits_for_the_slowest_rank() {
    let delay = Duration::from_millis(400);
    let results = run_ranks(3, Duration::from_secs(30), |comm| {
        if comm.rank() == 2 {
            thread::sleep(delay);
        }
        let t = Instant::now();
        comm.barrier()?;
        Ok(t.elapsed())
    });
    let waited = results[0].as_ref().unwrap();
    assert!(
        *waited >= delay - Duration::from_millis(100),
        "rank 0 waited only {waited:?}"
    );
}

#[test]
fn stranger_with_another_token_is_turned_away_and_the_job_goes_on() {
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || {
        let comm = TcpCommunicator::with_listener(&cfg(0, 2, port, token, timeout), listener)?;
        comm.all_gather_bytes(b"zero")
    });

    let other = JobToken::generate().unwrap();
    let t = Instant::now();
    let err = TcpCommunicator::connect(&cfg(1, 2, port, other, timeout)).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "rejection took {:?}",
        t.elapsed()
    );
    let msg = err.to_string();
    assert!(
        matches!(err, BootstrapError::TokenMismatch { rank: 1, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("job token mismatch") && msg.contains("different EP_JOB_TOKEN"),
        "{msg}"
    );

    // A process with no token at all is told so.
    let err = TcpCommunicator::connect(&cfg(1, 2, port, JobToken::UNSET, timeout)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("the joining process has no EP_JOB_TOKEN"),
        "{msg}"
    );

    // Something that is not a bootstrap peer at all.
    let mut junk = TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::io::Write::write_all(&mut junk, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();

    // The real rank 1 still gets in.
    let comm = TcpCommunicator::connect(&cfg(1, 2, port, token, timeout)).unwrap();
    let all = comm.all_gather_bytes(b"one").unwrap();
    assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
    assert_eq!(root.join().unwrap().unwrap(), all);
}

#[test]
fn root_names_the_strangers_it_turned_away_when_a_rank_never_comes() {
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_millis(1500);
    let root = thread::spawn(move || {
        TcpCommunicator::with_listener(&cfg(0, 2, port, token, timeout), listener)
    });
    let other = JobToken::generate().unwrap();
    assert!(TcpCommunicator::connect(&cfg(1, 2, port, other, timeout)).is_err());
    let err = root.join().unwrap().unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, BootstrapError::Timeout { rank: 0, .. }),
        "{msg}"
    );
    assert!(msg.contains("ranks [1] of 2 did not join"), "{msg}");
    assert!(
        msg.contains("turned away") && msg.contains("job token mismatch"),
        "{msg}"
    );
}

#[test]
fn world_size_mismatch_fails_both_sides() {
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_secs(20);
    let t = Instant::now();
    let root = thread::spawn(move || {
        TcpCommunicator::with_listener(&cfg(0, 2, port, token, timeout), listener)
    });
    let err = TcpCommunicator::connect(&cfg(1, 3, port, token, timeout)).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            BootstrapError::WorldSizeMismatch {
                rank: 1,
                ours: 3,
                theirs: 2,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("WORLD_SIZE=3") && msg.contains("has 2"),
        "{msg}"
    );
    let err = root.join().unwrap().unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            BootstrapError::WorldSizeMismatch {
                rank: 0,
                ours: 2,
                theirs: 3,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn duplicate_rank_fails_the_job() {
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || {
        TcpCommunicator::with_listener(&cfg(0, 3, port, token, timeout), listener)
    });
    let first = thread::spawn(move || TcpCommunicator::connect(&cfg(1, 3, port, token, timeout)));
    // Let the first rank 1 in before the second.
    thread::sleep(Duration::from_millis(300));
    let err = TcpCommunicator::connect(&cfg(1, 3, port, token, timeout)).unwrap_err();
    assert!(err.to_string().contains("joined twice"), "{err}");
    let err = root.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("rank 1 joined twice"), "{err}");
    // The first rank 1 hears why the job ended.
    let err = first.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("joined twice"), "{err}");
}

#[test]
fn rank_that_never_joins_times_out_naming_it() {
    let timeout = Duration::from_secs(1);
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let t = Instant::now();
    let root = thread::spawn(move || {
        TcpCommunicator::with_listener(&cfg(0, 3, port, token, timeout), listener)
    });
    let r1 = TcpCommunicator::connect(&cfg(1, 3, port, token, timeout));
    let e0 = root.join().unwrap().unwrap_err();
    let elapsed = t.elapsed();
    let m0 = e0.to_string();
    assert!(
        matches!(e0, BootstrapError::Timeout { rank: 0, .. }),
        "{m0}"
    );
    assert!(
        m0.contains("ranks [2] of 3 did not join") && m0.contains("joined: [1]"),
        "{m0}"
    );
    let m1 = r1.unwrap_err().to_string();
    assert!(
        m1.contains("rank 1") && m1.contains("ranks [2] of 3 did not join"),
        "{m1}"
    );
    // The bound, plus the grace the other ranks give rank 0, plus scheduling slack.
    assert!(
        elapsed < timeout + Duration::from_secs(2),
        "took {elapsed:?}"
    );
}

#[test]
fn nobody_listening_times_out() {
    let (listener, port) = bound_listener();
    drop(listener);
    let timeout = Duration::from_millis(600);
    let t = Instant::now();
    let err = TcpCommunicator::connect(&cfg(1, 2, port, JobToken::UNSET, timeout)).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, BootstrapError::Timeout { rank: 1, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("could not reach rank 0") && msg.contains(&port.to_string()),
        "{msg}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn rank_missing_from_a_collective_is_named() {
    let timeout = Duration::from_secs(1);
    let joined = Arc::new(Barrier::new(2));
    let results = run_ranks(3, timeout, |comm| {
        if comm.rank() == 2 {
            // Joined, but never calls the collective; stays connected past the others' bound.
            thread::sleep(timeout * 2);
            return Ok(String::new());
        }
        joined.wait();
        let err = comm.all_gather_bytes(b"x").unwrap_err();
        // Once failed, the communicator stays failed.
        let again = comm.barrier().unwrap_err();
        assert!(matches!(again, BootstrapError::Aborted { .. }), "{again}");
        Ok(err.to_string())
    });
    let m0 = results[0].as_ref().unwrap();
    let m1 = results[1].as_ref().unwrap();
    assert!(m0.contains("rank 0: all_gather #0 timed out"), "{m0}");
    assert!(m0.contains("ranks [2] of 3 did not send"), "{m0}");
    assert!(
        m1.contains("rank 1: all_gather #0") && m1.contains("ranks [2] of 3"),
        "{m1}"
    );
}

#[test]
fn rank_that_exits_is_reported_at_once() {
    let timeout = Duration::from_secs(30);
    let results = run_ranks(3, timeout, |comm| {
        if comm.rank() == 2 {
            drop(comm);
            return Ok((String::new(), Duration::ZERO));
        }
        let t = Instant::now();
        let err = comm.all_gather_bytes(b"x").unwrap_err();
        Ok((err.to_string(), t.elapsed()))
    });
    for (r, res) in results.iter().enumerate().take(2) {
        let (msg, took) = res.as_ref().unwrap();
        assert!(
            msg.contains("rank 2") && msg.contains("closed the connection"),
            "{msg}"
        );
        assert!(*took < Duration::from_secs(5), "rank {r} took {took:?}");
    }
}

#[test]
fn ranks_calling_different_collectives_are_caught() {
    let results = run_ranks(2, Duration::from_secs(30), |comm| {
        let r = if comm.rank() == 0 {
            comm.barrier()
        } else {
            comm.all_gather_bytes(b"x").map(drop)
        };
        Ok(r.unwrap_err().to_string())
    });
    for res in results {
        let msg = res.unwrap();
        assert!(
            msg.contains("rank 1 called all_gather #0 where rank 0 called barrier #0"),
            "{msg}"
        );
    }
}

#[test]
fn only_rank_zero_listens() {
    let (listener, port) = bound_listener();
    let err = TcpCommunicator::with_listener(
        &cfg(1, 2, port, JobToken::UNSET, Duration::from_secs(1)),
        listener,
    )
    .unwrap_err();
    assert!(matches!(err, BootstrapError::Config(_)), "{err}");
}

#[test]
fn a_job_of_one_needs_no_network() {
    let comm = TcpCommunicator::connect(&RankConfig::new(0, 1, 0).unwrap()).unwrap();
    assert!(comm.same_process());
    assert_eq!(
        comm.all_gather_bytes(b"solo").unwrap(),
        vec![b"solo".to_vec()]
    );
    comm.barrier().unwrap();
    assert_eq!(comm.broadcast_bytes(0, b"b").unwrap(), b"b");
    assert!(comm.broadcast_bytes(1, b"b").is_err());
}
