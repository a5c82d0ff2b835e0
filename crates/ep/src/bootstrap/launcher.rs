//! A program that starts its own ranks: re-executed once per rank, output prefixed, the first
//! failure ends the job.

use std::ffi::OsString;
use std::io::{BufRead as _, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::vars;
use super::{BootstrapError, JobToken, RankConfig, TcpCommunicator, MAX_WORLD_SIZE};

/// How often the launcher checks on its ranks.
const POLL: Duration = Duration::from_millis(5);

/// How long the other ranks get to end on their own after one failed, before they are killed:
/// they usually fail within milliseconds (the bootstrap tells them), and their own error
/// messages and exit statuses say more than a SIGKILL.
const FAILURE_GRACE: Duration = Duration::from_secs(1);

/// How long a killed rank gets to disappear before the launcher stops waiting for it (a process
/// stuck in the GPU driver can take a while to die).
const REAP_BOUND: Duration = Duration::from_secs(10);

/// How long the launcher waits for the last output of its ranks after they ended (a grandchild
/// that kept the pipe open must not hold the launcher).
const DRAIN_BOUND: Duration = Duration::from_secs(2);

/// Starts the ranks of a job as copies of the current program, or, inside such a copy, runs one
/// rank.
///
/// Without `RANK` in the environment, [`run`](Self::run) is the *launcher*: it binds a listening
/// socket on a free loopback port (which rank 0 inherits, so no other process can take the port
/// between choosing and binding it) and makes a fresh [`JobToken`], re-executes the current program `world_size` times with
/// `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `EP_JOB_TOKEN` and `EP_LOCAL_RANK` (= rank:
/// the GPU it uses) set, prints each rank's output with a `[rank N] ` prefix, and waits. When a
/// rank fails, the others get a second to end on their own, then are killed, and the error lists
/// how every rank ended; ranks still running at the time bound are killed too. With `RANK` set,
/// `run` joins the job over TCP and calls the function with the communicator.
///
/// Code after `run` executes in the launcher and in every rank; the function only in ranks. A
/// program launches once.
/// On Linux a rank is killed when the thread that launched it exits, so no orphan outlives the
/// launcher.
///
/// ```no_run
/// use ep::bootstrap::{Communicator, Launcher};
/// use std::time::Duration;
///
/// Launcher::new(2)
///     .timeout(Duration::from_secs(120))
///     .run(|comm| {
///         println!("hello from rank {} of {}", comm.rank(), comm.world_size());
///         comm.barrier()
///     })
///     .unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Launcher {
    world_size: usize,
    timeout: Option<Duration>,
    args: Option<Vec<OsString>>,
    envs: Vec<(OsString, OsString)>,
    master_addr: String,
}

impl Launcher {
    /// The time bound of a launch when neither [`timeout`](Self::timeout) nor
    /// `EP_LAUNCH_TIMEOUT_S` sets one.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(240);

    /// A launcher of `world_size` ranks.
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: None,
            args: None,
            envs: Vec::new(),
            master_addr: super::DEFAULT_MASTER_ADDR.into(),
        }
    }

    /// Kill the ranks and fail if they have not all finished after `timeout` (default:
    /// `EP_LAUNCH_TIMEOUT_S` seconds, else [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)). It must
    /// lie in `(0, 1 day]`: [`run`](Self::run) refuses anything else before starting a rank.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The arguments each rank's process gets (default: the launcher's own).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = Some(args.into_iter().map(Into::into).collect());
        self
    }

    /// Arguments that make a test binary (libtest harness) run only the test `test_name` in each
    /// rank, with its output shown. Use it from a `#[test]` that launches ranks, with the test's
    /// path inside its binary (its function name, for a test at the top of the file).
    pub fn libtest(self, test_name: &str) -> Self {
        self.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
    }

    /// An extra environment variable for every rank.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// The address rank 0 listens on (default `127.0.0.1`).
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = addr.into();
        self
    }

    /// Whether this process is a rank (`RANK` is set) rather than a launcher.
    pub fn is_rank_process() -> bool {
        std::env::var_os(vars::RANK).is_some_and(|v| !v.is_empty())
    }

    /// Launches the ranks and waits for them (in the launcher), or runs `f` as one rank (in a
    /// rank). See the type's docs.
    pub fn run<F, E>(self, f: F) -> Result<(), BootstrapError>
    where
        F: FnOnce(&TcpCommunicator) -> Result<(), E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.run_shared(|comm| f(&comm))
    }

    /// As [`run`](Self::run), but a rank gets its communicator shared, for objects that keep
    /// it: a [`LowLatencyBuffer`](crate::low_latency::LowLatencyBuffer) holds its group for the
    /// teardown barrier.
    ///
    /// ```no_run
    /// use ep::bootstrap::{Communicator, Launcher};
    /// use ep::low_latency::{LowLatencyBuffer, LowLatencyOptions};
    ///
    /// Launcher::new(2)
    ///     .run_shared(|comm| {
    ///         let ctx = ibgda_device::cuda::context(comm.local_rank())?;
    ///         let opts = LowLatencyOptions::new(128, 7168, 8, 288);
    ///         let buf = LowLatencyBuffer::new(&ctx, comm, &opts)?;
    ///         // dispatch, combine: every rank, in the same order.
    ///         buf.shutdown()?;
    ///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    ///     })
    ///     .unwrap();
    /// ```
    pub fn run_shared<F, E>(self, f: F) -> Result<(), BootstrapError>
    where
        F: FnOnce(Arc<TcpCommunicator>) -> Result<(), E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if Self::is_rank_process() {
            // A second launch in a rank would rejoin the first job's (closed) rendezvous.
            static RAN: AtomicBool = AtomicBool::new(false);
            if RAN.swap(true, Ordering::SeqCst) {
                return Err(BootstrapError::Config(
                    "a rank process runs one launch: the program called Launcher::run twice".into(),
                ));
            }
            let cfg = RankConfig::from_env()?;
            if cfg.world_size != self.world_size {
                return Err(BootstrapError::EnvInvalid {
                    var: vars::WORLD_SIZE,
                    value: cfg.world_size.to_string(),
                    reason: format!("this program runs {} ranks", self.world_size),
                });
            }
            // Rank 0 takes the socket the launcher bound for it (EP_LISTEN_FD).
            let comm = Arc::new(TcpCommunicator::connect(&cfg)?);
            return f(comm).map_err(|e| BootstrapError::Rank {
                rank: cfg.rank,
                source: e.into(),
            });
        }
        self.supervise()
    }

    fn supervise(self) -> Result<(), BootstrapError> {
        let n = self.world_size;
        if !(1..=MAX_WORLD_SIZE).contains(&n) {
            return Err(BootstrapError::Config(format!(
                "launcher of {n} ranks: must be 1..={MAX_WORLD_SIZE}"
            )));
        }
        let timeout = match self.timeout {
            Some(t) => ibgda_device::timeout::check(t)
                .map_err(|e| BootstrapError::Config(format!("launcher timeout: {e}")))?,
            None => launch_timeout_from(|v| std::env::var(v).ok())?,
        };
        let token = JobToken::generate()?;
        let listener = listen(&self.master_addr)?;
        let port = listener.port;
        let exe = std::env::current_exe().map_err(|source| BootstrapError::Os {
            step: "launcher: finding the current executable".into(),
            source,
        })?;
        let args = self
            .args
            .clone()
            .unwrap_or_else(|| std::env::args_os().skip(1).collect());
        tracing::info!(
            "launching {n} ranks of {} on {}:{port}",
            exe.display(),
            self.master_addr
        );

        let mut children: Vec<Child> = Vec::with_capacity(n);
        let mut pumps: Vec<JoinHandle<()>> = Vec::with_capacity(2 * n);
        for rank in 0..n {
            let mut cmd = Command::new(&exe);
            cmd.args(&args)
                .envs(self.envs.iter().map(|(k, v)| (k, v)))
                .env(vars::RANK, rank.to_string())
                .env(vars::WORLD_SIZE, n.to_string())
                .env(vars::MASTER_ADDR, &self.master_addr)
                .env(vars::MASTER_PORT, port.to_string())
                .env(vars::EP_JOB_TOKEN, token.to_hex())
                .env(vars::EP_LOCAL_RANK, rank.to_string())
                .env_remove(vars::EP_LISTEN_FD)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if rank == 0 {
                listener.pass_to(&mut cmd);
            }
            die_with_parent(&mut cmd);
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(source) => {
                    let mut killed = vec![true; children.len()];
                    stop(&mut children, &mut killed);
                    return Err(BootstrapError::Spawn {
                        rank,
                        program: exe.display().to_string(),
                        source,
                    });
                }
            };
            let prefix = format!("[rank {rank}] ");
            if let Some(out) = child.stdout.take() {
                pumps.push(pump(out, prefix.clone(), Stream::Stdout));
            }
            if let Some(err) = child.stderr.take() {
                pumps.push(pump(err, prefix, Stream::Stderr));
            }
            children.push(child);
        }
        // Rank 0 holds the socket now; a copy here would keep queueing connections to a rank 0
        // that died.
        drop(listener);

        let started = Instant::now();
        let deadline = ibgda_device::timeout::deadline_after(started, timeout);
        let mut status: Vec<Option<ExitStatus>> = vec![None; n];
        let mut killed = vec![false; n];
        let mut first_failed = None;
        let mut timed_out = Vec::new();
        let mut kill_at = deadline;
        loop {
            for r in 0..n {
                if status[r].is_some() {
                    continue;
                }
                match children[r].try_wait() {
                    Ok(Some(s)) => {
                        status[r] = Some(s);
                        if !s.success() && first_failed.is_none() {
                            first_failed = Some(r);
                            kill_at = Instant::now() + FAILURE_GRACE;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!("launcher: checking on rank {r}: {e}");
                    }
                }
            }
            if status.iter().all(Option::is_some) {
                break;
            }
            if first_failed.is_some() && Instant::now() >= kill_at {
                break;
            }
            if Instant::now() >= deadline {
                timed_out = (0..n).filter(|&r| status[r].is_none()).collect();
                break;
            }
            std::thread::sleep(POLL);
        }
        for r in 0..n {
            if status[r].is_none() {
                killed[r] = true;
            }
        }
        let reaped = stop(&mut children, &mut killed);
        for (r, s) in reaped.into_iter().enumerate() {
            if status[r].is_none() {
                status[r] = s;
            }
        }
        let drain_until = Instant::now() + DRAIN_BOUND;
        while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < drain_until {
            std::thread::sleep(POLL);
        }
        for p in pumps {
            if p.is_finished() {
                if let Err(payload) = p.join() {
                    tracing::warn!(
                        "launcher: a thread copying rank output panicked: {}",
                        panic_text(payload.as_ref())
                    );
                }
            }
        }

        let summary = (0..n)
            .map(|r| format!("rank {r}: {}", describe(status[r], killed[r])))
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(r) = first_failed {
            return Err(BootstrapError::RankFailed {
                first_failed: r,
                status: describe(status[r], false),
                summary,
            });
        }
        if !timed_out.is_empty() {
            return Err(BootstrapError::LaunchTimeout {
                running: timed_out,
                waited: timeout,
                summary,
            });
        }
        Ok(())
    }
}

/// [`Launcher::new`]`(world_size).run(f)`: the usual way for a program to run as `world_size`
/// ranks.
pub fn launch<F, E>(world_size: usize, f: F) -> Result<(), BootstrapError>
where
    F: FnOnce(&TcpCommunicator) -> Result<(), E>,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Launcher::new(world_size).run(f)
}

/// The launch bound from `EP_LAUNCH_TIMEOUT_S` (read through `lookup`), else the default.
fn launch_timeout_from(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Duration, BootstrapError> {
    let Some(v) = lookup(vars::EP_LAUNCH_TIMEOUT_S).filter(|v| !v.trim().is_empty()) else {
        return Ok(Launcher::DEFAULT_TIMEOUT);
    };
    ibgda_device::timeout::parse_secs(&v).map_err(|e| BootstrapError::EnvInvalid {
        var: vars::EP_LAUNCH_TIMEOUT_S,
        value: v.clone(),
        reason: e.to_string(),
    })
}

/// The text of a panic payload (`&str` or `String`, what `panic!` makes), for an error that must
/// not lose why a thread died.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic with a payload that is not text)".into())
}

/// Rank 0's listening socket, bound by the launcher on a free port and inherited by rank 0's
/// process (`EP_LISTEN_FD`), so the port cannot be taken between choosing and binding it.
struct Listener {
    socket: std::net::TcpListener,
    port: u16,
}

fn listen(addr: &str) -> Result<Listener, BootstrapError> {
    let io = |source| BootstrapError::Io {
        rank: 0,
        step: "launcher: binding rank 0's listening socket".into(),
        peer: format!("{addr}:0"),
        source,
    };
    let socket = std::net::TcpListener::bind((addr, 0)).map_err(io)?;
    let port = socket.local_addr().map_err(io)?.port();
    Ok(Listener { socket, port })
}

impl Listener {
    /// Has `cmd`'s process inherit the socket (std opens it close-on-exec) and names it in
    /// `EP_LISTEN_FD`. Only the process `cmd` starts gets it.
    #[cfg(unix)]
    fn pass_to(&self, cmd: &mut Command) {
        use std::os::unix::io::AsRawFd as _;
        use std::os::unix::process::CommandExt as _;
        let fd = self.socket.as_raw_fd();
        cmd.env(vars::EP_LISTEN_FD, fd.to_string());
        // SAFETY: runs in the child between fork and exec, where only async-signal-safe calls are
        // allowed: one fcntl on a descriptor the child inherited; nothing is allocated.
        unsafe {
            cmd.pre_exec(move || super::tcp::set_cloexec(fd, false));
        }
    }

    #[cfg(not(unix))]
    fn pass_to(&self, _cmd: &mut Command) {}
}

/// Kills the children marked in `kill` that are still running and reaps them all, within
/// [`REAP_BOUND`]. Returns how each ended (`None`: still there).
fn stop(children: &mut [Child], kill: &mut [bool]) -> Vec<Option<ExitStatus>> {
    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    for (r, c) in children.iter_mut().enumerate() {
        match c.try_wait() {
            Ok(Some(s)) => {
                status[r] = Some(s);
                kill[r] = false;
            }
            _ if kill[r] => {
                let _ = c.kill();
            }
            _ => {}
        }
    }
    let until = Instant::now() + REAP_BOUND;
    while Instant::now() < until {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                status[r] = c.try_wait().ok().flatten();
            }
        }
        if status.iter().all(Option::is_some) {
            break;
        }
        std::thread::sleep(POLL);
    }
    status
}

fn describe(status: Option<ExitStatus>, killed_by_launcher: bool) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match status {
        None => "still running after SIGKILL".into(),
        Some(_) if killed_by_launcher => "killed by the launcher".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(0), _) => "ok".into(),
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            (None, None) => format!("{s}"),
        },
    }
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// Copies a rank's output, line by line with `prefix`, to the launcher's own stdout or stderr.
fn pump(from: impl Read + Send + 'static, prefix: String, to: Stream) -> JoinHandle<()> {
    // `print!` rather than a raw handle: under libtest the output is then captured with the
    // test's and shown when it fails. A failing write (closed pipe) stops the printing, not the
    // draining, so the rank never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut printing = true;
        prefix_lines(from, &prefix, |line| {
            if printing {
                printing = std::panic::catch_unwind(|| match to {
                    Stream::Stdout => print!("{line}"),
                    Stream::Stderr => eprint!("{line}"),
                })
                .is_ok();
            }
        });
    })
}

/// Calls `emit` with each line of `from` (lossily decoded, newline-terminated) behind `prefix`.
fn prefix_lines(from: impl Read, prefix: &str, mut emit: impl FnMut(&str)) {
    let mut reader = BufReader::new(from);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&buf);
                let nl = if text.ends_with('\n') { "" } else { "\n" };
                emit(&format!("{prefix}{text}{nl}"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Has the kernel kill the rank when the launching thread dies, so a launcher killed by a
/// timeout or a signal leaves no rank behind holding a GPU.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    extern "C" {
        fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
    }
    const PR_SET_PDEATHSIG: std::ffi::c_int = 1;
    const SIGKILL: std::ffi::c_ulong = 9;
    fn set_death_signal() -> std::io::Result<()> {
        // SAFETY: prctl(PR_SET_PDEATHSIG, signal) reads no memory of ours; the variadic argument
        // is the unsigned long the kernel expects.
        if unsafe { prctl(PR_SET_PDEATHSIG, SIGKILL) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    // SAFETY: the hook runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: it makes one system call and allocates nothing.
    unsafe {
        cmd.pre_exec(set_death_signal);
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        prefix_lines(input, "[rank 3] ", |l| out.push(l.to_string()));
        out
    }

    #[test]
    fn output_is_prefixed_per_line() {
        assert_eq!(
            lines(b"one\ntwo\n\nlast without newline"),
            [
                "[rank 3] one\n",
                "[rank 3] two\n",
                "[rank 3] \n",
                "[rank 3] last without newline\n"
            ]
        );
        assert!(lines(b"").is_empty());
        assert_eq!(lines(b"bad \xff byte\n"), ["[rank 3] bad \u{fffd} byte\n"]);
    }

    #[test]
    fn statuses_are_described() {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(describe(Some(ExitStatus::from_raw(0)), false), "ok");
        assert_eq!(
            describe(Some(ExitStatus::from_raw(3 << 8)), false),
            "exit status 3"
        );
        assert_eq!(
            describe(Some(ExitStatus::from_raw(11)), false),
            "killed by signal 11"
        );
        assert_eq!(
            describe(Some(ExitStatus::from_raw(9)), true),
            "killed by the launcher"
        );
        assert_eq!(describe(None, true), "still running after SIGKILL");
    }

    #[test]
    fn launch_timeouts_are_validated_without_panics() {
        assert_eq!(
            launch_timeout_from(|_| None).unwrap(),
            Launcher::DEFAULT_TIMEOUT
        );
        assert_eq!(
            launch_timeout_from(|_| Some("1.5".into())).unwrap(),
            Duration::from_millis(1500)
        );
        for bad in ["0", "-3", "NaN", "inf", "1e300", "1e19", "86401", "later"] {
            let e = launch_timeout_from(|_| Some(bad.into())).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(e, BootstrapError::EnvInvalid { .. })
                    && msg.contains("EP_LAUNCH_TIMEOUT_S")
                    && msg.contains(bad),
                "{bad}: {msg}"
            );
        }
        // Through the API: refused before any rank starts (Duration::MAX used to panic on
        // `Instant + Duration`, zero to kill every rank at once).
        for bad in [Duration::ZERO, Duration::MAX] {
            let e = Launcher::new(2).timeout(bad).supervise().unwrap_err();
            assert!(matches!(e, BootstrapError::Config(_)), "{bad:?}: {e}");
        }
    }

    #[test]
    fn panic_payloads_keep_their_text() {
        let p = std::thread::spawn(|| panic!("rank {} broke", 3))
            .join()
            .unwrap_err();
        assert_eq!(panic_text(p.as_ref()), "rank 3 broke");
        let p = std::thread::spawn(|| panic!("plain")).join().unwrap_err();
        assert_eq!(panic_text(p.as_ref()), "plain");
    }
}
