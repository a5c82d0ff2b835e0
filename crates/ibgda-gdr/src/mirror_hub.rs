//! The pump behind every [`CopyMirror`](crate::CopyMirror): one thread per CUDA context that
//! serves all of that context's mirrors, and the process-wide registry of those threads.
//!
//! The bookkeeping lives here, apart from the CUDA calls: a hub drives an [`Engine`] (in
//! production the copy-engine reads of `mirror.rs`, in this file's tests a fake over host
//! memory), so entries coming and going, the thread starting with the first mirror and stopping
//! with the last, and a failed round's errors are tested without a GPU.
//!
//! # Locks
//!
//! Two, always taken in this order: the registry's (which hubs exist) and a hub's state (its
//! entries and engine). The hub thread takes only its state lock, and holds it for one whole
//! round: issue every copy, wait (bounded by the copy bound), publish. So once
//! [`Registry::unregister`] has removed an entry under that lock, no round touches the entry's
//! range again. Callers waiting for the state lock announce themselves (`pending`) and the hub
//! thread lets them in before its next round, so a busy hub cannot starve a mirror's creation or
//! drop. No CUDA call is made under the registry lock by this file; staging memory of a removed
//! entry is freed after both locks are released.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{GdrError, Result};
use crate::mirror::MirrorConfig;

/// How long a hub left without entries (after a failed round, while its mirrors still live)
/// parks between looks: it is woken early when an entry joins or the hub stops.
const EMPTY_PARK: Duration = Duration::from_millis(1);

/// What a mirror shares with its hub: the words the proxy reads, why the mirror stopped, and how
/// many copies it has seen.
pub(crate) struct Shared {
    words: Box<[AtomicU64]>,
    error: Mutex<Option<String>>,
    copies: AtomicU64,
}

impl Shared {
    /// `words` zeroed words, no error, no copies.
    pub(crate) fn new(words: usize) -> Self {
        Self {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            error: Mutex::new(None),
            copies: AtomicU64::new(0),
        }
    }

    /// The mirror's words, in order.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        &self.words
    }

    /// Copies completed so far.
    pub(crate) fn copies(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// Why the mirror stopped, if it did.
    pub(crate) fn error(&self) -> Option<String> {
        lock(&self.error).clone()
    }

    /// Publishes one completed copy, word `i` being `word(i)`, each with one release store;
    /// whether any word changed.
    pub(crate) fn publish(&self, word: impl Fn(usize) -> u64) -> bool {
        let mut changed = false;
        for (i, w) in self.words.iter().enumerate() {
            let v = word(i);
            if w.load(Ordering::Relaxed) != v {
                w.store(v, Ordering::Release);
                changed = true;
            }
        }
        self.copies.fetch_add(1, Ordering::Relaxed);
        changed
    }

    fn fail(&self, why: &str) {
        *lock(&self.error) = Some(why.to_owned());
    }
}

/// The GPU side of a hub: what it copies with. A hub calls it only under its state lock.
pub(crate) trait Engine: Send + 'static {
    /// What one mirror brings: its device range and staging memory.
    type Slot: Send + 'static;

    /// A slot joins the hub (the first one after a start or a failure gives the hub its stream).
    fn joined(&mut self, slot: &Self::Slot);

    /// Copies every entry's range into its staging, then waits until all of those copies have
    /// completed, within the copy bound.
    fn copy_all(&mut self, entries: &[Entry<Self::Slot>]) -> Result<()>;

    /// Word `i` of `slot`'s staging, as the last successful [`Engine::copy_all`] left it.
    fn word(slot: &Self::Slot, i: usize) -> u64;

    /// The slots of a failed round, no longer copied: keeps whatever a copy may still write into
    /// and forgets the stream they were copied on.
    fn retire(&mut self, slots: Vec<Self::Slot>);
}

/// One mirror as its hub sees it.
pub(crate) struct Entry<S> {
    id: u64,
    shared: Arc<Shared>,
    /// The engine's part.
    pub(crate) slot: S,
}

/// A registered mirror's claim on its hub, returned by [`Registry::register`].
#[derive(Debug)]
pub(crate) struct Ticket {
    key: usize,
    id: u64,
}

struct HubState<E: Engine> {
    engine: E,
    /// The entries each round copies.
    entries: Vec<Entry<E::Slot>>,
    /// Mirrors registered and not yet dropped (entries of a failed round included).
    live: usize,
    next_id: u64,
    stop: bool,
}

struct HubShared<E: Engine> {
    state: Mutex<HubState<E>>,
    /// Callers waiting for `state` (the thread gives way to them between rounds).
    pending: AtomicUsize,
    idle_after: Duration,
    idle_sleep: Duration,
}

struct Hub<E: Engine> {
    key: usize,
    shared: Arc<HubShared<E>>,
    thread: JoinHandle<()>,
}

/// The hubs of a process, one per key (a CUDA context's raw handle).
pub(crate) struct Registry<E: Engine> {
    hubs: Mutex<Vec<Hub<E>>>,
}

impl<E: Engine> Registry<E> {
    /// No hubs.
    pub(crate) const fn new() -> Self {
        Self {
            hubs: Mutex::new(Vec::new()),
        }
    }

    /// Adds a mirror to `key`'s hub, starting the hub (its engine made by `engine`, its thread
    /// named and paced by `cfg`) if it has none. The mirror's words must already hold its first
    /// copy: the hub's rounds only keep them current.
    pub(crate) fn register(
        &self,
        key: usize,
        cfg: &MirrorConfig,
        engine: impl FnOnce() -> E,
        shared: Arc<Shared>,
        slot: E::Slot,
    ) -> Result<Ticket> {
        let mut hubs = lock(&self.hubs);
        let at = match hubs.iter().position(|h| h.key == key) {
            Some(at) => at,
            None => {
                hubs.push(start(key, cfg, engine())?);
                hubs.len() - 1
            }
        };
        let hub = &hubs[at];
        let id = {
            let mut st = lock_as_caller(&hub.shared);
            st.engine.joined(&slot);
            let id = st.next_id;
            st.next_id += 1;
            st.live += 1;
            st.entries.push(Entry { id, shared, slot });
            id
        };
        hub.thread.thread().unpark();
        Ok(Ticket { key, id })
    }

    /// Removes a mirror from its hub: once this returns, the hub never copies its range again.
    /// The last mirror of a hub stops and joins its thread.
    pub(crate) fn unregister(&self, ticket: Ticket) {
        let mut hubs = lock(&self.hubs);
        let Some(at) = hubs.iter().position(|h| h.key == ticket.key) else {
            tracing::error!(target: "ibgda", "emulated GDR view: a mirror's hub is gone");
            return;
        };
        let (removed, last) = {
            let mut st = lock_as_caller(&hubs[at].shared);
            let removed = st
                .entries
                .iter()
                .position(|e| e.id == ticket.id)
                .map(|i| st.entries.swap_remove(i));
            st.live -= 1;
            st.stop = st.live == 0;
            (removed, st.stop)
        };
        let stopped = last.then(|| hubs.swap_remove(at));
        drop(hubs);
        if let Some(hub) = stopped {
            hub.thread.thread().unpark();
            // Bounded: the thread sees `stop` before its next round, and a round is bounded.
            if hub.thread.join().is_err() {
                tracing::error!(target: "ibgda", "emulated GDR view: the pump thread panicked");
            }
        }
        // The entry's staging is freed here, outside both locks.
        drop(removed);
    }

    /// Per hub: its key, the entries its rounds copy, and its live mirrors (for tests).
    #[cfg(test)]
    fn census(&self) -> Vec<(usize, usize, usize)> {
        lock(&self.hubs)
            .iter()
            .map(|h| {
                let st = lock_as_caller(&h.shared);
                (h.key, st.entries.len(), st.live)
            })
            .collect()
    }
}

/// A new hub for `key`, its thread running (with no entries yet).
fn start<E: Engine>(key: usize, cfg: &MirrorConfig, engine: E) -> Result<Hub<E>> {
    let shared = Arc::new(HubShared {
        state: Mutex::new(HubState {
            engine,
            entries: Vec::new(),
            live: 0,
            next_id: 0,
            stop: false,
        }),
        pending: AtomicUsize::new(0),
        idle_after: cfg.idle_after,
        idle_sleep: cfg.idle_sleep,
    });
    // The thread holds only the shared state, never the registry or a mirror: no cycle keeps it
    // alive once the last mirror asks it to stop.
    let for_thread = shared.clone();
    let thread = std::thread::Builder::new()
        .name(cfg.name.clone())
        .spawn(move || pump(&for_thread))
        .map_err(|e| GdrError::Cuda {
            call: "std::thread::spawn",
            code: e.raw_os_error().unwrap_or(0) as u32,
            text: e.to_string(),
        })?;
    Ok(Hub {
        key,
        shared,
        thread,
    })
}

/// The hub thread: rounds back to back while something changes, `idle_sleep` apart once nothing
/// has for `idle_after`, until the last mirror stops it.
fn pump<E: Engine>(hub: &HubShared<E>) {
    let mut last_change = Instant::now();
    loop {
        while hub.pending.load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
        let changed = {
            let mut st = lock(&hub.state);
            if st.stop {
                return;
            }
            (!st.entries.is_empty()).then(|| st.round())
        };
        match changed {
            None => std::thread::park_timeout(EMPTY_PARK),
            Some(true) => last_change = Instant::now(),
            Some(false) => {
                if last_change.elapsed() >= hub.idle_after {
                    std::thread::sleep(hub.idle_sleep);
                }
            }
        }
    }
}

impl<E: Engine> HubState<E> {
    /// One round over every entry; whether any mirror changed. A failure stops every entry of
    /// the round: each keeps the error, and the engine keeps what a copy may still write into.
    fn round(&mut self) -> bool {
        match self.engine.copy_all(&self.entries) {
            Ok(()) => {
                let mut changed = false;
                for e in &self.entries {
                    changed |= e.shared.publish(|i| E::word(&e.slot, i));
                }
                changed
            }
            Err(e) => {
                let why = e.to_string();
                tracing::error!(
                    target: "ibgda",
                    "emulated GDR view: {} mirrors stopped following GPU memory: {why}",
                    self.entries.len()
                );
                let slots = std::mem::take(&mut self.entries)
                    .into_iter()
                    .map(|e| {
                        e.shared.fail(&why);
                        e.slot
                    })
                    .collect();
                self.engine.retire(slots);
                false
            }
        }
    }
}

/// The hub's state lock for a caller other than the hub thread, which gives way to it.
fn lock_as_caller<E: Engine>(hub: &HubShared<E>) -> MutexGuard<'_, HubState<E>> {
    hub.pending.fetch_add(1, Ordering::AcqRel);
    let st = lock(&hub.state);
    hub.pending.fetch_sub(1, Ordering::AcqRel);
    st
}

/// A lock whose holder cannot leave its data half-changed (no panics under these locks).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Host "device memory" and its staging, copied by [`Fake`].
    struct FakeSlot {
        device: Arc<[AtomicU64]>,
        staging: Box<[AtomicU64]>,
    }

    /// What the tests watch and steer.
    #[derive(Default)]
    struct Probe {
        engines: AtomicUsize,
        dropped: AtomicUsize,
        rounds: AtomicU64,
        joined: AtomicUsize,
        retired: AtomicUsize,
        fail_next: AtomicBool,
    }

    struct Fake(Arc<Probe>);

    impl Drop for Fake {
        fn drop(&mut self) {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Engine for Fake {
        type Slot = FakeSlot;

        fn joined(&mut self, _: &FakeSlot) {
            self.0.joined.fetch_add(1, Ordering::SeqCst);
        }

        fn copy_all(&mut self, entries: &[Entry<FakeSlot>]) -> Result<()> {
            self.0.rounds.fetch_add(1, Ordering::SeqCst);
            if self.0.fail_next.swap(false, Ordering::SeqCst) {
                return Err(GdrError::Cuda {
                    call: "fake copy",
                    code: 999,
                    text: "injected".into(),
                });
            }
            for e in entries {
                for (d, s) in e.slot.device.iter().zip(e.slot.staging.iter()) {
                    s.store(d.load(Ordering::Acquire), Ordering::Relaxed);
                }
            }
            Ok(())
        }

        fn word(slot: &FakeSlot, i: usize) -> u64 {
            slot.staging[i].load(Ordering::Relaxed)
        }

        fn retire(&mut self, slots: Vec<FakeSlot>) {
            self.0.retired.fetch_add(slots.len(), Ordering::SeqCst);
        }
    }

    fn cfg(name: &str) -> MirrorConfig {
        MirrorConfig {
            name: name.into(),
            ..Default::default()
        }
    }

    /// A registered fake mirror: its device words and what the hub publishes.
    struct FakeMirror {
        device: Arc<[AtomicU64]>,
        shared: Arc<Shared>,
        ticket: Ticket,
    }

    fn add(reg: &Registry<Fake>, key: usize, name: &str, probe: &Arc<Probe>) -> FakeMirror {
        let device: Arc<[AtomicU64]> = (0..4).map(|_| AtomicU64::new(0)).collect();
        let shared = Arc::new(Shared::new(4));
        let slot = FakeSlot {
            device: device.clone(),
            staging: (0..4).map(|_| AtomicU64::new(0)).collect(),
        };
        let engine = || {
            probe.engines.fetch_add(1, Ordering::SeqCst);
            Fake(probe.clone())
        };
        let ticket = reg
            .register(key, &cfg(name), engine, shared.clone(), slot)
            .expect("register");
        FakeMirror {
            device,
            shared,
            ticket,
        }
    }

    /// Waits (bounded) until exactly `n` threads of this process are named `name`: a thread
    /// names itself once it runs, and a joined one leaves /proc a moment after the join.
    fn threads(name: &str, n: usize) {
        wait_until(&format!("{n} threads named {name}"), || {
            threads_named(name) == n
        });
    }

    /// Threads of this process whose name (as the kernel keeps it) is `name`.
    fn threads_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == name)
            .count()
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    #[test]
    fn one_thread_per_key_started_once_and_stopped_with_the_last_mirror() {
        let reg = Registry::new();
        let probe = Arc::new(Probe::default());
        let mut a: Vec<_> = (0..5).map(|_| add(&reg, 1, "hubtest-a", &probe)).collect();
        let b = add(&reg, 2, "hubtest-b", &probe);
        assert_eq!(
            probe.engines.load(Ordering::SeqCst),
            2,
            "one engine per key"
        );
        threads("hubtest-a", 1);
        threads("hubtest-b", 1);
        let mut census = reg.census();
        census.sort();
        assert_eq!(census, vec![(1, 5, 5), (2, 1, 1)]);

        // Every mirror follows its own device words.
        for (i, m) in a.iter().enumerate() {
            m.device[1].store(100 + i as u64, Ordering::Release);
        }
        b.device[3].store(7, Ordering::Release);
        for (i, m) in a.iter().enumerate() {
            wait_until("key 1 mirrors", || {
                m.shared.words()[1].load(Ordering::Acquire) == 100 + i as u64
            });
        }
        wait_until("key 2 mirror", || {
            b.shared.words()[3].load(Ordering::Acquire) == 7
        });

        // Dropping all but one keeps the thread; the survivor still follows.
        for m in a.drain(1..) {
            reg.unregister(m.ticket);
        }
        threads("hubtest-a", 1);
        let mut census = reg.census();
        census.sort();
        assert_eq!(census, vec![(1, 1, 1), (2, 1, 1)]);
        a[0].device[0].store(42, Ordering::Release);
        wait_until("survivor", || {
            a[0].shared.words()[0].load(Ordering::Acquire) == 42
        });

        // The last mirror of key 1 stops and joins its thread, and frees its engine.
        reg.unregister(a.pop().expect("one left").ticket);
        threads("hubtest-a", 0);
        assert_eq!(probe.dropped.load(Ordering::SeqCst), 1);
        assert_eq!(reg.census(), vec![(2, 1, 1)]);

        // Key 1 again: a fresh hub and thread.
        let again = add(&reg, 1, "hubtest-a", &probe);
        assert_eq!(probe.engines.load(Ordering::SeqCst), 3);
        threads("hubtest-a", 1);
        reg.unregister(again.ticket);
        reg.unregister(b.ticket);
        threads("hubtest-a", 0);
        threads("hubtest-b", 0);
        assert_eq!(probe.dropped.load(Ordering::SeqCst), 3);
        assert!(reg.census().is_empty());
        assert_eq!(probe.joined.load(Ordering::SeqCst), 7);
    }

    #[test]
    fn a_failed_round_stops_its_entries_and_the_hub_serves_newcomers() {
        let reg = Registry::new();
        let probe = Arc::new(Probe::default());
        let old: Vec<_> = (0..3)
            .map(|_| add(&reg, 9, "hubtest-fail", &probe))
            .collect();
        old[0].device[0].store(1, Ordering::Release);
        wait_until("first value", || {
            old[0].shared.words()[0].load(Ordering::Acquire) == 1
        });
        probe.fail_next.store(true, Ordering::SeqCst);
        wait_until("failure seen", || {
            old.iter().all(|m| m.shared.error().is_some())
        });
        assert_eq!(probe.retired.load(Ordering::SeqCst), 3);
        let why = old[1].shared.error().expect("error");
        assert!(
            why.contains("fake copy") && why.contains("injected"),
            "{why}"
        );
        assert_eq!(reg.census(), vec![(9, 0, 3)], "entries gone, mirrors live");

        // Stopped mirrors no longer change.
        let copies = old[2].shared.copies();
        old[2].device[2].store(5, Ordering::Release);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(old[2].shared.words()[2].load(Ordering::Acquire), 0);
        assert_eq!(old[2].shared.copies(), copies);

        // The same hub (no second engine, one thread) serves a newcomer.
        let new = add(&reg, 9, "hubtest-fail", &probe);
        assert_eq!(probe.engines.load(Ordering::SeqCst), 1);
        threads("hubtest-fail", 1);
        new.device[1].store(3, Ordering::Release);
        wait_until("newcomer", || {
            new.shared.words()[1].load(Ordering::Acquire) == 3
        });
        assert!(new.shared.error().is_none());

        // Dropping the failed mirrors keeps the hub for the newcomer; its drop ends the hub.
        for m in old {
            reg.unregister(m.ticket);
        }
        assert_eq!(reg.census(), vec![(9, 1, 1)]);
        threads("hubtest-fail", 1);
        reg.unregister(new.ticket);
        threads("hubtest-fail", 0);
        assert_eq!(probe.dropped.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_unregistered_range_is_never_copied_again() {
        let reg = Registry::new();
        let probe = Arc::new(Probe::default());
        let keep = add(&reg, 3, "hubtest-gone", &probe);
        let gone = add(&reg, 3, "hubtest-gone", &probe);
        // Keep the hub busy: a changing word means rounds back to back.
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (dev, stop) = (keep.device.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut v = 0;
                while !stop.load(Ordering::Relaxed) {
                    v += 1;
                    dev[0].store(v, Ordering::Release);
                    std::thread::yield_now();
                }
            })
        };
        let (dev, shared) = (gone.device.clone(), gone.shared.clone());
        reg.unregister(gone.ticket);
        let copies = shared.copies();
        dev[0].store(77, Ordering::Release);
        let rounds = probe.rounds.load(Ordering::SeqCst);
        wait_until("more rounds", || {
            probe.rounds.load(Ordering::SeqCst) > rounds + 10
        });
        assert_eq!(shared.copies(), copies, "copied after unregister returned");
        assert_eq!(shared.words()[0].load(Ordering::Acquire), 0);
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("writer");
        reg.unregister(keep.ticket);
        assert!(reg.census().is_empty());
    }
}
