//! The CPU proxy: threads that poll the producer slots of their QPs and ring each QP's doorbell
//! when its slot advances.
//!
//! Why it cannot lose a publish: slots only grow (the GPU raises them in publish order, or with
//! `atomicMax`; see `protocol.cuh`'s `ibgda_publish`), and every
//! sweep reads every slot of the thread and rings up to the value read, so the latest value covers
//! every earlier one. At shutdown each thread sweeps once more after it has seen the stop request,
//! so everything published before [`Proxy::stop`] was called is rung. The proxy starts from
//! `rung_from` (0 for a fresh QP): a first submission, whatever its value, is seen (the upstream
//! proxy never saw one because the GPU published to a counter it did not poll).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::doorbell::Doorbell;
use super::slot::ProducerSlot;

/// One QP as the proxy serves it.
pub struct ProxyQp {
    /// Where the GPU publishes the QP's producer index.
    pub slot: ProducerSlot,
    /// How to ring the QP's NIC.
    pub doorbell: Box<dyn Doorbell>,
    /// The producer index already rung (0 for a fresh QP): the proxy rings when the slot passes it.
    pub rung_from: u64,
    /// For diagnostics: the rank owning the QP.
    pub rank: u32,
    /// For diagnostics: the QP's index among the rank's QPs.
    pub qp_index: u32,
}

impl std::fmt::Debug for ProxyQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyQp")
            .field("slot", &self.slot)
            .field("rung_from", &self.rung_from)
            .field("rank", &self.rank)
            .field("qp_index", &self.qp_index)
            .finish_non_exhaustive()
    }
}

/// How the proxy runs.
///
/// A thread sweeps its slots back to back (one 8-byte load each) and rings as soon as a sweep
/// finds a slot that moved. Only after `spins_before_yield` empty sweeps in a row does it back
/// off: it yields its core between sweeps, and once idle for `sleep_after` it sleeps
/// `idle_sleep` between sweeps. Any doorbell returns it to busy polling at once. The clock is not
/// read while it spins.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Polling threads; QPs are dealt to them round-robin. At least 1, at most one per QP.
    pub threads: usize,
    /// The spin budget: empty sweeps a thread busy-polls (no system call, no clock read) before
    /// it starts yielding its core between sweeps. The default, 2^16 sweeps, is a few
    /// milliseconds: every publish of a running workload is seen within a sweep.
    pub spins_before_yield: u32,
    /// After this long with nothing to ring (counted from the end of the spin budget), sleep
    /// `idle_sleep` between sweeps (`None`: never sleep, for the lowest latency after long idle
    /// periods at the cost of a busy core).
    pub sleep_after: Option<Duration>,
    /// How long to sleep between sweeps once idle past `sleep_after`.
    pub idle_sleep: Duration,
    /// How long [`Proxy::stop`] waits for the threads to finish.
    pub shutdown_timeout: Duration,
    /// Thread name prefix.
    pub name: String,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            threads: 1,
            spins_before_yield: 1 << 16,
            sleep_after: None,
            idle_sleep: Duration::from_micros(50),
            shutdown_timeout: Duration::from_secs(5),
            name: "ibgda-proxy".into(),
        }
    }
}

/// Why the proxy could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// `std::thread::Builder::spawn` failed.
    #[error("starting proxy thread {name}: {source}")]
    Spawn {
        /// The thread's name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A thread did not finish within the shutdown bound (a doorbell call that blocks).
    #[error("proxy thread {name} did not stop within {after:?}; it was left running")]
    ShutdownTimeout {
        /// The thread's name.
        name: String,
        /// The bound that ran out.
        after: Duration,
    },
    /// A thread panicked (in a doorbell call); its QPs were no longer served from then on.
    #[error("proxy thread {name} panicked: {message}")]
    Panicked {
        /// The thread's name.
        name: String,
        /// The panic message.
        message: String,
    },
}

/// What a stopped proxy did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyReport {
    /// Doorbells rung, all QPs together.
    pub doorbells: u64,
    /// The last producer index rung, per QP (in the order the QPs were given).
    pub rung: Vec<u64>,
}

#[repr(align(64))]
#[derive(Debug, Default)]
struct Padded(AtomicU64);

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    /// Per QP: the last producer index rung.
    rung: Vec<Padded>,
    /// Per thread: doorbells rung.
    doorbells: Vec<Padded>,
}

#[derive(Debug)]
struct Worker {
    name: String,
    handle: Option<JoinHandle<()>>,
    /// In a mutex only so that `Proxy` is `Sync`; `shutdown` has `&mut` access.
    exited: Mutex<mpsc::Receiver<()>>,
}

/// The running proxy. [`stop`](Proxy::stop) it to learn whether it shut down cleanly; dropping it
/// stops it too (logging any failure).
#[derive(Debug)]
pub struct Proxy {
    shared: Arc<Shared>,
    workers: Vec<Worker>,
    shutdown_timeout: Duration,
}

/// Sends on drop: tells `stop` that a thread has finished, even by panicking.
struct ExitSignal(mpsc::Sender<()>);

impl Drop for ExitSignal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

impl Proxy {
    /// Starts the threads serving `qps`.
    pub fn start(qps: Vec<ProxyQp>, cfg: ProxyConfig) -> Result<Self, ProxyError> {
        let nthreads = cfg.threads.clamp(1, qps.len().max(1));
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            rung: qps
                .iter()
                .map(|q| Padded(AtomicU64::new(q.rung_from)))
                .collect(),
            doorbells: (0..nthreads).map(|_| Padded::default()).collect(),
        });
        let mut groups: Vec<Vec<(usize, ProxyQp)>> = (0..nthreads).map(|_| Vec::new()).collect();
        for (i, q) in qps.into_iter().enumerate() {
            groups[i % nthreads].push((i, q));
        }
        let mut proxy = Self {
            shared: shared.clone(),
            workers: Vec::with_capacity(nthreads),
            shutdown_timeout: cfg.shutdown_timeout,
        };
        for (t, group) in groups.into_iter().enumerate() {
            let name = format!("{}-{t}", cfg.name);
            let (tx, rx) = mpsc::channel();
            let (sh, c) = (shared.clone(), cfg.clone());
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    let _exit = ExitSignal(tx);
                    serve(&sh, t, group, &c);
                })
                .map_err(|source| ProxyError::Spawn {
                    name: name.clone(),
                    source,
                })?;
            proxy.workers.push(Worker {
                name,
                handle: Some(handle),
                exited: Mutex::new(rx),
            });
        }
        tracing::debug!(target: "ibgda", "proxy started: {} QP(s) on {nthreads} thread(s)", shared.rung.len());
        Ok(proxy)
    }

    /// Number of QPs served.
    pub fn qps(&self) -> usize {
        self.shared.rung.len()
    }

    /// The last producer index rung on QP `qp` (in the order given to [`start`](Proxy::start)).
    pub fn last_rung(&self, qp: usize) -> Option<u64> {
        self.shared
            .rung
            .get(qp)
            .map(|p| p.0.load(Ordering::Relaxed))
    }

    /// Doorbells rung so far, all QPs together.
    pub fn doorbells(&self) -> u64 {
        self.shared
            .doorbells
            .iter()
            .map(|p| p.0.load(Ordering::Relaxed))
            .sum()
    }

    /// Whether every thread is still serving its QPs.
    pub fn is_running(&self) -> bool {
        self.workers
            .iter()
            .all(|w| w.handle.as_ref().is_some_and(|h| !h.is_finished()))
    }

    /// Stops the threads after one last sweep each (everything published before this call is
    /// rung), waiting at most the configured shutdown bound.
    pub fn stop(mut self) -> Result<ProxyReport, ProxyError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<ProxyReport, ProxyError> {
        self.shared.stop.store(true, Ordering::Release);
        let deadline = crate::timeout::deadline_after(Instant::now(), self.shutdown_timeout);
        let mut first_err = None;
        for w in &mut self.workers {
            let Some(handle) = w.handle.take() else {
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let exited = w.exited.get_mut().unwrap_or_else(|p| p.into_inner());
            match exited.recv_timeout(left) {
                Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    if let Err(p) = handle.join() {
                        let message = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "(no message)".into());
                        first_err.get_or_insert(ProxyError::Panicked {
                            name: w.name.clone(),
                            message,
                        });
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    first_err.get_or_insert(ProxyError::ShutdownTimeout {
                        name: w.name.clone(),
                        after: self.shutdown_timeout,
                    });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(ProxyReport {
                doorbells: self.doorbells(),
                rung: self
                    .shared
                    .rung
                    .iter()
                    .map(|p| p.0.load(Ordering::Relaxed))
                    .collect(),
            }),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.workers.iter().any(|w| w.handle.is_some()) {
            if let Err(e) = self.shutdown() {
                tracing::error!(target: "ibgda", "proxy shutdown: {e}");
            }
        }
    }
}

/// What one proxy thread serves: its QPs' slots and doorbells, and the last index rung on each,
/// side by side so a sweep walks one array.
struct Served {
    /// Index of the QP in the proxy's list (for `Shared::rung`).
    index: usize,
    /// The last producer index rung.
    last: u64,
    qp: ProxyQp,
}

/// One thread's loop over its QPs.
fn serve(shared: &Shared, thread: usize, qps: Vec<(usize, ProxyQp)>, cfg: &ProxyConfig) {
    let mut served: Vec<Served> = qps
        .into_iter()
        .map(|(index, qp)| Served {
            index,
            last: qp.rung_from,
            qp,
        })
        .collect();
    let mut rung_total = 0u64;
    let mut empty_sweeps = 0u32;
    // Set when the spin budget runs out; the clock is never read while spinning.
    let mut idle_since: Option<Instant> = None;
    loop {
        // Read the stop request before the sweep: the sweep that follows it is the last, and it
        // sees everything published before `stop` was called.
        let stopping = shared.stop.load(Ordering::Acquire);
        let mut rang = false;
        for s in served.iter_mut() {
            // Slots only grow: ringing up to the value read covers every publish before it.
            let v = s.qp.slot.load();
            if v > s.last {
                s.qp.doorbell.ring(v);
                s.last = v;
                shared.rung[s.index].0.store(v, Ordering::Relaxed);
                rung_total += 1;
                rang = true;
            }
        }
        if stopping {
            break;
        }
        if rang {
            shared.doorbells[thread]
                .0
                .store(rung_total, Ordering::Relaxed);
            empty_sweeps = 0;
            idle_since = None;
            continue;
        }
        empty_sweeps = empty_sweeps.saturating_add(1);
        if empty_sweeps <= cfg.spins_before_yield {
            std::hint::spin_loop();
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if cfg.sleep_after.is_some_and(|d| since.elapsed() >= d) {
            std::thread::sleep(cfg.idle_sleep);
        } else {
            std::thread::yield_now();
        }
    }
    shared.doorbells[thread]
        .0
        .store(rung_total, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn slots(n: usize) -> Arc<Vec<AtomicU64>> {
        Arc::new((0..n).map(|_| AtomicU64::new(0)).collect())
    }

    fn proxy_over(
        words: &Arc<Vec<AtomicU64>>,
        seen: &Arc<Mutex<Vec<Vec<u64>>>>,
        threads: usize,
    ) -> Proxy {
        let qps = (0..words.len())
            .map(|i| {
                let seen = seen.clone();
                let keep = words.clone();
                ProxyQp {
                    // SAFETY: `keep` (moved into the doorbell) holds the words alive as long as
                    // the proxy thread that reads them.
                    slot: unsafe { ProducerSlot::new(words[i].as_ptr()) }.unwrap(),
                    doorbell: Box::new(move |pi: u64| {
                        let _ = &keep;
                        seen.lock().unwrap()[i].push(pi);
                    }),
                    rung_from: 0,
                    rank: 0,
                    qp_index: i as u32,
                }
            })
            .collect();
        Proxy::start(
            qps,
            ProxyConfig {
                threads,
                spins_before_yield: 64,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn first_publish_is_rung_and_nothing_is_lost() {
        let words = slots(5);
        let seen = Arc::new(Mutex::new(vec![Vec::new(); 5]));
        let proxy = proxy_over(&words, &seen, 2);
        // The very first publish on a fresh QP.
        words[3].fetch_max(1, Ordering::Release);
        let t0 = Instant::now();
        while proxy.last_rung(3) != Some(1) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "first publish never rung"
            );
            std::thread::yield_now();
        }
        // Publishers racing on every QP; the last values must be rung by the time stop returns.
        std::thread::scope(|s| {
            for q in 0..5 {
                let w = &words;
                s.spawn(move || {
                    for v in 1..=2000u64 {
                        w[q].fetch_max(v, Ordering::Release);
                    }
                });
            }
        });
        let report = proxy.stop().unwrap();
        assert_eq!(report.rung, vec![2000; 5]);
        for (q, rung) in seen.lock().unwrap().iter().enumerate() {
            assert!(
                rung.windows(2).all(|w| w[0] < w[1]),
                "QP {q}: doorbells not increasing"
            );
            assert_eq!(rung.last(), Some(&2000), "QP {q}");
        }
        assert_eq!(
            report.doorbells,
            seen.lock().unwrap().iter().map(Vec::len).sum::<usize>() as u64
        );
    }

    #[test]
    fn an_idle_proxy_backs_off_and_still_rings_the_next_publish() {
        let words = slots(2);
        let keep = words.clone();
        let qps = (0..2)
            .map(|i| {
                let keep = keep.clone();
                ProxyQp {
                    // SAFETY: `keep` (moved into the doorbell) keeps the words alive.
                    slot: unsafe { ProducerSlot::new(words[i].as_ptr()) }.unwrap(),
                    doorbell: Box::new(move |_pi: u64| {
                        let _ = &keep;
                    }),
                    rung_from: 0,
                    rank: 0,
                    qp_index: i as u32,
                }
            })
            .collect();
        let proxy = Proxy::start(
            qps,
            ProxyConfig {
                spins_before_yield: 16,
                sleep_after: Some(Duration::from_millis(1)),
                idle_sleep: Duration::from_micros(200),
                ..Default::default()
            },
        )
        .unwrap();
        for v in 1..=6u64 {
            // Idle long enough to be sleeping between sweeps.
            std::thread::sleep(Duration::from_millis(5));
            let q = (v % 2) as usize;
            words[q].fetch_max(v, Ordering::Release);
            let t0 = Instant::now();
            while proxy.last_rung(q) != Some(v) {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "publish {v} never rung"
                );
                std::thread::yield_now();
            }
        }
        let report = proxy.stop().unwrap();
        assert_eq!(report.rung, vec![6, 5]);
        assert_eq!(report.doorbells, 6);
    }

    #[test]
    fn shutdown_is_bounded_and_panics_are_reported() {
        let words = slots(1);
        let keep = words.clone();
        let qp = ProxyQp {
            // SAFETY: `keep` (moved into the doorbell) keeps the word alive.
            slot: unsafe { ProducerSlot::new(words[0].as_ptr()) }.unwrap(),
            doorbell: Box::new(move |_pi: u64| {
                let _ = &keep;
                panic!("doorbell exploded")
            }),
            rung_from: 0,
            rank: 0,
            qp_index: 0,
        };
        let proxy = Proxy::start(vec![qp], ProxyConfig::default()).unwrap();
        words[0].store(3, Ordering::Release);
        let t0 = Instant::now();
        while proxy.is_running() {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::yield_now();
        }
        let e = proxy.stop().unwrap_err();
        assert!(e.to_string().contains("doorbell exploded"), "{e}");

        let words = slots(1);
        let keep = words.clone();
        let blocker = ProxyQp {
            // SAFETY: as above.
            slot: unsafe { ProducerSlot::new(words[0].as_ptr()) }.unwrap(),
            doorbell: Box::new(move |_pi: u64| {
                let _ = &keep;
                std::thread::sleep(Duration::from_secs(2))
            }),
            rung_from: 0,
            rank: 0,
            qp_index: 0,
        };
        let proxy = Proxy::start(
            vec![blocker],
            ProxyConfig {
                shutdown_timeout: Duration::from_millis(100),
                ..Default::default()
            },
        )
        .unwrap();
        words[0].store(1, Ordering::Release);
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        let e = proxy.stop().unwrap_err();
        assert!(matches!(e, ProxyError::ShutdownTimeout { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}
