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
    let no_token = RankConfig::new(1, 2, port)
        .unwrap()
        .without_token()
        .with_timeout(timeout);
    let err = TcpCommunicator::connect(&no_token).unwrap_err();
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
    let token = JobToken::generate().unwrap();
    let err = TcpCommunicator::connect(&cfg(1, 2, port, token, timeout)).unwrap_err();
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
        &cfg(
            1,
            2,
            port,
            JobToken::generate().unwrap(),
            Duration::from_secs(1),
        ),
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

#[test]
fn several_ranks_without_a_token_are_refused_unless_asked_for() {
    let (listener, port) = bound_listener();
    let t = Instant::now();
    for (rank, l) in [(1, None), (0, Some(listener))] {
        let c = RankConfig::new(rank, 2, port)
            .unwrap()
            .with_timeout(Duration::from_secs(5));
        let err = match l {
            Some(l) => TcpCommunicator::with_listener(&c, l).unwrap_err(),
            None => TcpCommunicator::connect(&c).unwrap_err(),
        };
        let msg = err.to_string();
        assert!(matches!(err, BootstrapError::Config(_)), "{msg}");
        assert!(
            msg.contains("no job token") && msg.contains("EP_JOB_TOKEN"),
            "{msg}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );

    // Opting out on both sides, explicitly, still works.
    let (listener, port) = bound_listener();
    let open = move |r| {
        RankConfig::new(r, 2, port)
            .unwrap()
            .without_token()
            .with_timeout(Duration::from_secs(20))
    };
    let root = thread::spawn(move || {
        let c = TcpCommunicator::with_listener(&open(0), listener)?;
        c.all_gather_bytes(b"0")
    });
    let c = TcpCommunicator::connect(&open(1)).unwrap();
    assert_eq!(
        c.all_gather_bytes(b"1").unwrap(),
        vec![b"0".to_vec(), b"1".to_vec()]
    );
    root.join().unwrap().unwrap();
}

#[test]
fn silent_connections_do_not_hold_up_the_rendezvous() {
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_secs(30);
    // Connections that never say anything, queued before the real rank: each would hold a
    // one-at-a-time rendezvous for its whole hello bound (5 s).
    let silent: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let t = Instant::now();
    let root = thread::spawn(move || {
        TcpCommunicator::with_listener(&cfg(0, 2, port, token, timeout), listener)
            .map(|c| c.barrier())
    });
    thread::sleep(Duration::from_millis(50));
    let comm = TcpCommunicator::connect(&cfg(1, 2, port, token, timeout)).unwrap();
    comm.barrier().unwrap();
    root.join().unwrap().unwrap().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "the rendezvous took {:?} behind {} silent connections",
        t.elapsed(),
        silent.len()
    );
}

/// Reads one bootstrap frame (length prefix, payload) as raw bytes.
fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    use std::io::Read as _;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut p = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut p).unwrap();
    p
}

/// Writes one bootstrap handshake frame: kind, the protocol's magic, then `body`.
fn write_frame(s: &mut TcpStream, kind: u8, body: &[u8]) {
    use std::io::Write as _;
    let mut p = vec![kind];
    p.extend_from_slice(b"EPBOOT02");
    p.extend_from_slice(body);
    let mut f = (p.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&p);
    s.write_all(&f).unwrap();
}

/// A process that took rank 0's port: it answers the handshake without knowing the token, and
/// records every byte the joining rank sends.
fn impostor(listener: TcpListener) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut seen = read_frame(&mut s);
        write_frame(&mut s, 7, &[0x5a; 32]); // challenge
        seen.extend(read_frame(&mut s)); // the joining rank's proof
        write_frame(&mut s, 2, &[0xa5; 32]); // a welcome with a made-up tag
        thread::sleep(Duration::from_millis(200));
        seen
    })
}

#[test]
fn a_forged_rank_0_is_refused_and_never_sees_the_token() {
    let (listener, port) = bound_listener();
    let seen = impostor(listener);
    let token = JobToken::generate().unwrap();
    let err = TcpCommunicator::connect(&cfg(1, 2, port, token, Duration::from_secs(10)))
        .expect_err("a rank 0 that cannot prove it holds the token must be refused");
    let msg = err.to_string();
    assert!(
        matches!(err, BootstrapError::TokenMismatch { rank: 1, .. }),
        "{msg}"
    );
    assert!(msg.contains("did not prove it holds this job's"), "{msg}");
    let seen = seen.join().unwrap();
    let raw = token.as_bytes();
    assert!(
        !seen.windows(raw.len()).any(|w| w == raw),
        "the token crossed the wire in clear"
    );
    assert!(!String::from_utf8_lossy(&seen).contains(&token.to_hex()));
}

#[test]
fn ranks_wait_for_a_rank_0_that_starts_late_on_a_bound_socket() {
    // As under the launcher: the socket is bound (and queues connections) before rank 0's
    // process gets to accept them, which can take longer than a handshake's own bound (5 s).
    let (listener, port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_secs(30);
    let member = thread::spawn(move || {
        TcpCommunicator::connect(&cfg(1, 2, port, token, timeout)).map(|c| c.barrier())
    });
    thread::sleep(Duration::from_secs(6));
    let root = TcpCommunicator::with_listener(&cfg(0, 2, port, token, timeout), listener).unwrap();
    root.barrier().unwrap();
    member.join().unwrap().unwrap().unwrap();
}

/// Relays a joining rank's connection to rank 0 (a process between the two, e.g. on the path
/// between hosts), passing the handshake through untouched and flipping one byte of the first
/// frame the joining rank sends after it (its first collective contribution).
fn tamperer(listener: TcpListener, root_port: u16) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        let (mut member, _) = listener.accept().unwrap();
        let mut root = TcpStream::connect(("127.0.0.1", root_port)).unwrap();
        let (mut m2, mut r2) = (member.try_clone().unwrap(), root.try_clone().unwrap());
        // Rank 0 → joining rank: verbatim.
        let down = thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = r2.read(&mut buf) {
                if n == 0 || m2.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        // Joining rank → rank 0: frame by frame; hello and proof pass, the third is altered.
        for i in 0.. {
            let mut len = [0u8; 4];
            if member.read_exact(&mut len).is_err() {
                break;
            }
            let mut p = vec![0u8; u32::from_le_bytes(len) as usize];
            if member.read_exact(&mut p).is_err() {
                break;
            }
            if i == 2 {
                p[10] ^= 0x01; // inside the contribution's data
            }
            if root
                .write_all(&len)
                .and_then(|_| root.write_all(&p))
                .is_err()
            {
                break;
            }
        }
        let _ = root.shutdown(std::net::Shutdown::Both);
        let _ = down.join();
    })
}

#[test]
fn bytes_changed_between_the_ranks_fail_the_collective() {
    let (listener, port) = bound_listener();
    let (relay, relay_port) = bound_listener();
    let token = JobToken::generate().unwrap();
    let timeout = Duration::from_secs(10);
    let root = thread::spawn(move || {
        let c = TcpCommunicator::with_listener(&cfg(0, 2, port, token, timeout), listener)?;
        c.all_gather_bytes(b"zero")
    });
    let relaying = tamperer(relay, port);
    let member = TcpCommunicator::connect(&cfg(1, 2, relay_port, token, timeout)).unwrap();
    let mine = member.all_gather_bytes(b"one, to be altered on the way");
    let theirs = root.join().unwrap();
    let err = theirs.expect_err("rank 0 must not take altered bytes as rank 1's part");
    let msg = err.to_string();
    assert!(msg.contains("failed authentication"), "{msg}");
    assert!(mine.is_err(), "rank 1 got {mine:?}");
    // Closing rank 1's end lets the relay finish.
    drop(member);
    relaying.join().unwrap();
}
