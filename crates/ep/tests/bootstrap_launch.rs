//! The launcher re-executes this test binary once per rank (running only the launching test, with
//! `RANK` set); the same test function is the launcher in the parent and a rank in the children.

use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ep::bootstrap::{BootstrapError, Communicator, Launcher};

#[test]
fn three_ranks_succeed() {
    Launcher::new(3)
        .libtest("three_ranks_succeed")
        .timeout(Duration::from_secs(120))
        .env("EP_LAUNCH_TEST_EXTRA", "passed through")
        .run(|comm| {
            let rank = comm.rank();
            assert_eq!(comm.world_size(), 3);
            assert_eq!(comm.local_rank(), rank);
            assert_eq!(std::env::var("EP_LOCAL_RANK").unwrap(), rank.to_string());
            assert_eq!(std::env::var("EP_JOB_TOKEN").unwrap().len(), 32);
            assert_eq!(
                std::env::var("EP_LAUNCH_TEST_EXTRA").unwrap(),
                "passed through"
            );
            let all = comm.all_gather_bytes(&[rank as u8; 3])?;
            assert_eq!(all, vec![vec![0; 3], vec![1; 3], vec![2; 3]]);
            println!("rank {rank} saw all three ranks");
            comm.barrier()
        })
        .unwrap();
}

#[test]
fn failing_rank_fails_the_launch() {
    let t = Instant::now();
    let r = Launcher::new(3)
        .libtest("failing_rank_fails_the_launch")
        .timeout(Duration::from_secs(120))
        .run(|comm| {
            if comm.rank() == 1 {
                return Err("rank 1 fails on purpose".into());
            }
            // Ranks 0 and 2 wait for rank 1, which never comes; they are killed or fail.
            comm.barrier()?;
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        });
    if Launcher::is_rank_process() {
        // In a rank: fail the way the rank failed, so the launcher sees it.
        r.unwrap();
        return;
    }
    let err = r.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, BootstrapError::RankFailed { .. }), "{msg}");
    assert!(msg.contains("rank 1: exit status 101"), "{msg}");
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn hanging_rank_is_killed_at_the_bound() {
    let bound = Duration::from_secs(3);
    let t = Instant::now();
    let r = Launcher::new(2)
        .libtest("hanging_rank_is_killed_at_the_bound")
        .timeout(bound)
        .run(|comm| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_secs(120));
            }
            Ok::<(), BootstrapError>(())
        });
    if Launcher::is_rank_process() {
        r.unwrap();
        return;
    }
    let took = t.elapsed();
    let err = r.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, BootstrapError::LaunchTimeout { running, .. } if running == &[1]),
        "{msg}"
    );
    assert!(
        msg.contains("rank 0: ok") && msg.contains("rank 1: killed by the launcher"),
        "{msg}"
    );
    assert!(took < bound + Duration::from_secs(10), "took {took:?}");
}

/// Runs this binary's `three_ranks_succeed` as a launcher in a child process and reads what it
/// printed: every rank's output comes with its `[rank N] ` prefix.
#[test]
fn rank_output_is_prefixed() {
    if Launcher::is_rank_process() {
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "three_ranks_succeed",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        out.read_to_string(&mut s).unwrap();
        s
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the launcher did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = reader.join().unwrap();
    assert!(status.success(), "launcher failed; stdout:\n{stdout}");
    for r in 0..3 {
        let (prefix, text) = (
            format!("[rank {r}] "),
            format!("rank {r} saw all three ranks"),
        );
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&prefix) && l.contains(&text)),
            "no line {prefix:?}…{text:?} in:\n{stdout}"
        );
    }
}

#[test]
fn rank_0_listens_on_the_socket_the_launcher_bound() {
    Launcher::new(2)
        .libtest("rank_0_listens_on_the_socket_the_launcher_bound")
        .timeout(Duration::from_secs(120))
        .run(|comm| {
            // Only rank 0 inherits the socket; nobody binds the port a second time.
            let fd = std::env::var("EP_LISTEN_FD").ok();
            assert_eq!(fd.is_some(), comm.rank() == 0, "EP_LISTEN_FD = {fd:?}");
            comm.barrier()
        })
        .unwrap();
}
