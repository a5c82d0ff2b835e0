//! Atomics on GPU memory that never make the NIC thread wait: a **group** of consecutive atomics
//! of one QP (under strict mode's relaxed ordering, a round's atomics of the QP, the writes
//! between them going first) is enqueued on the QP's stream at once, and the host computes it
//! when the GPU has read the words.
//!
//! On the QP's stream, behind everything the QP enqueued before (so after its earlier writes):
//! 1. for each word's stripe last written back by another stream, a wait for that write-back
//!    (`cuStreamWaitEvent`), so the read below sees it;
//! 2. a copy of every distinct target word into pinned host memory (one batched call);
//! 3. in one `cuStreamBatchMemOp`: a store of the group's number into a pinned host word (the
//!    lane's read counter: the words are in host memory once the host sees it), and a wait
//!    (`CU_STREAM_MEM_OP_WAIT_VALUE_32`, GEQ) until the lane's release counter, another pinned
//!    word, reaches the group's number;
//! 4. copies of the new values from pinned memory to the words, and of the replies to their
//!    result buffers (one batched call; sources read in stream order, so after step 3), then the
//!    slot's event (`done`: the pinned slots may be reused; step 1 of the next group on these
//!    words from another stream waits for it).
//!
//! Four driver calls per group, whatever its size, and the host learns of the read with a load.
//!
//! Once the read counter says the words are in host memory, a thread applies the group's
//! operations in order on the host (a word that several atomics of the group touch is read once
//! and chained), writes the new values and replies into the pinned slots (replies to host
//! memory directly), and stores the group's number into the release counter (release order).
//! The stream then finishes the group; work enqueued after it (later writes, the CQEs) follows
//! in stream order. No SM, no host wait on the data path; one round trip per group, not per
//! atomic.
//!
//! # Who releases: never a thread that may be stuck in a driver call
//!
//! `cuMemFree` (and module loads, context synchronisation) wait for all outstanding work of the
//! context while holding a driver lock that `cuEventRecord`, `cuLaunchKernel` and most other
//! calls in other threads wait on. A stream waiting on a host-released counter is outstanding
//! work; had only the NIC thread released it, a NIC thread blocked in such a call (recording
//! the next group's event, say) behind a `cuMemFree` that waits for that stream would never
//! release it: a deadlock (seen on an H200, two ranks as threads, 2026-12-02). So a process-wide
//! **release thread** ([`release_loop`]) computes and releases every group whose read has
//! landed. It touches nothing but host memory (the read counter is a stream memory store, not
//! an event, so it learns of the read with a load), so it can never be stuck behind the driver.
//! The NIC threads compute ready groups too when they poll or wait (the lowest latency when they
//! are free; [`help_all`]); whoever holds a lane's queue first computes it. No thread holds a
//! queue across a driver call, and a group is in its lane's queue (so the release thread sees
//! it) as soon as its wait is enqueued, before the NIC thread's next driver call.
//!
//! Atomicity is that of [`crate::cuda_atomic`]: the stripes order every emulator atomic on a
//! word in this process, across QPs and NICs, because a group holds the locks of its words'
//! stripes from step 1 to step 4 (enqueueing only: microseconds) and steps only ever wait for
//! groups enqueued before them, so no cycle can form. Every word is written back, changed or
//! not (a compare-swap that fails writes the old value back).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};

use crate::backend::{AtomicOp, Loc};
use crate::cuda_atomic::{stripe_index, LastWrite, WriteBackEvent, STRIPES};
use crate::cuda_batch::copy_many;
use crate::error::{check, EmuError};
use crate::exec::{fetch_reply, FetchOrder};
use crate::host::HostBuffer;
use crate::spin_wait::SpinWait;

/// Atomics in one group at most.
pub(crate) const GROUP_ATOMICS: usize = 128;

/// Groups of one lane enqueued and not yet finished at most (each has its pinned slots).
const GROUPS_IN_FLIGHT: usize = 8;

/// Bytes of one group's pinned slots: the words as read, as written back, and the replies, one
/// 8-byte slot each.
const GROUP_BYTES: usize = 3 * 8 * GROUP_ATOMICS;

/// Offset of the release counter in the arena (its own cache line, after the slots).
const FLAG_OFFSET: usize = GROUPS_IN_FLIGHT * GROUP_BYTES;

/// Offset of the read counter (the stream stores a group's number once its words are read).
const READ_OFFSET: usize = FLAG_OFFSET + 64;

/// Whether counter value `have` has reached `want` (wrapping, as the stream wait compares).
fn reached(have: u32, want: u32) -> bool {
    (have.wrapping_sub(want) as i32) >= 0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Word {
    addr: u64,
    width: usize,
}

#[derive(Clone, Copy, Debug)]
struct Atom {
    word: usize,
    op: AtomicOp,
    result: Loc,
    order: FetchOrder,
}

#[derive(Debug)]
struct Open {
    slot: usize,
    words: Vec<Word>,
    atoms: Vec<Atom>,
}

#[derive(Debug)]
pub(crate) struct Inflight {
    seq: u32,
    slot: usize,
    words: Vec<Word>,
    atoms: Vec<Atom>,
    computed: bool,
    /// Its write-backs and `done` event are enqueued (the slot's event is this group's).
    enqueued: bool,
}

/// A lane's pinned slots and its groups enqueued and not yet finished: what any thread may
/// compute ([`help_all`]).
#[derive(Debug)]
pub(crate) struct Groups {
    arena: HostBuffer,
    q: Mutex<VecDeque<Inflight>>,
}

/// Every lane's [`Groups`] in the process, for threads that help while they wait.
static ALL_GROUPS: Mutex<Vec<Weak<Groups>>> = Mutex::new(Vec::new());

/// Computes every group of every lane in the process whose words have been read (lanes another
/// thread is working on right now are skipped). Returns whether it computed any.
pub(crate) fn help_all() -> bool {
    help_pass().computed
}

/// What one pass over every lane's groups came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Pass {
    /// Some group was computed and released.
    computed: bool,
    /// Some group is still waiting for its read, or a lane was busy (another thread held it).
    waiting: bool,
}

fn help_pass() -> Pass {
    let all: Vec<Arc<Groups>> = ALL_GROUPS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let mut pass = Pass::default();
    for g in all {
        match g.q.try_lock() {
            Ok(mut q) => {
                // An error here is the owner's to see when it polls.
                pass.computed |= compute_ready(&g.arena, &mut q).unwrap_or(false);
                pass.waiting |= q.iter().any(|i| !i.computed);
            }
            Err(_) => pass.waiting = true,
        }
    }
    pass
}

/// Longest sleep of the release thread between passes while a group waits for its read: the
/// worst added latency of an atomic whose NIC thread is busy elsewhere (a free NIC thread
/// computes its groups itself).
const RELEASE_SLEEP_MAX: Duration = Duration::from_micros(50);

/// How long the release thread sleeps when no group is in flight, unless woken ([`wake_releaser`]
/// when a group is enqueued): a bound, so that a lost wake-up costs at most this.
const RELEASE_IDLE: Duration = Duration::from_millis(20);

/// The release thread (module docs), started with the first lane of deferred atomics; `None`
/// when it could not be spawned (said once in the log: the NIC threads then release alone, and
/// a `cuMemFree` in another thread may deadlock with them as before).
fn releaser() -> Option<&'static std::thread::Thread> {
    static THREAD: OnceLock<Option<std::thread::Thread>> = OnceLock::new();
    THREAD
        .get_or_init(|| {
            match std::thread::Builder::new()
                .name("ibgda-emu-release".into())
                .spawn(release_loop)
            {
                Ok(h) => Some(h.thread().clone()),
                Err(e) => {
                    tracing::error!("no release thread for deferred atomics: {e}");
                    None
                }
            }
        })
        .as_ref()
}

/// Wakes the release thread: a group has been enqueued.
fn wake_releaser() {
    if let Some(t) = releaser() {
        t.unpark();
    }
}

/// Computes and releases ready groups for the life of the process: host memory only, never a
/// driver call. Spins briefly after work, then backs off to [`RELEASE_SLEEP_MAX`] while groups
/// wait, and parks (at most [`RELEASE_IDLE`]) when none does.
fn release_loop() {
    let mut quiet = 0u32;
    loop {
        let pass = help_pass();
        if pass.computed {
            quiet = 0;
            continue;
        }
        if !pass.waiting {
            quiet = 0;
            std::thread::park_timeout(RELEASE_IDLE);
            continue;
        }
        quiet = quiet.saturating_add(1);
        match quiet {
            0..=64 => std::hint::spin_loop(),
            65..=256 => std::thread::yield_now(),
            n => {
                std::thread::sleep(Duration::from_micros(u64::from(n - 256)).min(RELEASE_SLEEP_MAX))
            }
        }
    }
}

/// Computes the groups of `q` whose reads have completed, in order. Returns whether it computed
/// any.
fn compute_ready(arena: &HostBuffer, q: &mut VecDeque<Inflight>) -> Result<bool, EmuError> {
    let mut did = false;
    for g in q.iter_mut() {
        if g.computed {
            continue;
        }
        if !reached(arena.load_u32(READ_OFFSET), g.seq) {
            break;
        }
        // SAFETY: the read completed; the registrations the group names stay valid while its
        // QP has work in flight.
        unsafe { compute(arena, g) };
        did = true;
    }
    Ok(did)
}

fn old_at(slot: usize, i: usize) -> usize {
    slot * GROUP_BYTES + 8 * i
}

fn new_at(slot: usize, i: usize) -> usize {
    slot * GROUP_BYTES + 8 * (GROUP_ATOMICS + i)
}

fn reply_at(slot: usize, i: usize) -> usize {
    slot * GROUP_BYTES + 8 * (2 * GROUP_ATOMICS + i)
}

/// Applies the group's atomics on the host from the words as read, fills the slots and releases
/// the stream (stores the group's number into the release counter).
///
/// # Safety
/// The read counter has reached the group's number; its host result buffers are live.
unsafe fn compute(arena: &HostBuffer, g: &mut Inflight) {
    let mut cur: Vec<u64> = g
        .words
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let at = old_at(g.slot, i);
            if w.width == 8 {
                arena.load_u64(at)
            } else {
                arena.load_u32(at) as u64
            }
        })
        .collect();
    for (k, a) in g.atoms.iter().enumerate() {
        let old = cur[a.word];
        let mut new = a.op.apply(old);
        if a.op.width() == 4 {
            new &= 0xffff_ffff;
        }
        cur[a.word] = new;
        let reply = fetch_reply(&a.op, old, a.order);
        match a.result {
            Loc::Device(_) => arena.write(reply_at(g.slot, k), &reply),
            Loc::Host(h) => {
                // SAFETY: the result range was checked against a live registration with
                // LOCAL_WRITE; the stream writes nothing there before the release below.
                unsafe { std::ptr::copy(reply.as_ptr(), h as *mut u8, reply.len()) }
            }
        }
    }
    for (i, w) in g.words.iter().enumerate() {
        let bytes = cur[i].to_ne_bytes();
        arena.write(new_at(g.slot, i), &bytes[..w.width]);
    }
    // Release (and monotonic: a group is computed only after every earlier group of its lane,
    // whose release its read waits behind): the slots above are visible before the counter.
    arena.store_u32(FLAG_OFFSET, g.seq);
    g.computed = true;
}

/// Makes `groups` visible to the release thread (and to [`help_all`]), starting the thread on
/// first use.
fn register(groups: &Arc<Groups>) {
    {
        let mut all = ALL_GROUPS.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(groups));
    }
    releaser();
}

/// What adding an atomic to the open group came to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Added {
    /// It joined the group.
    Joined,
    /// The group is full, or the word overlaps a word of the group at another width: close the
    /// group and try again.
    CloseFirst,
}

/// One lane's deferred atomics (see the module docs).
#[derive(Debug)]
pub(crate) struct Deferred {
    ctx: Arc<CudaContext>,
    groups: Arc<Groups>,
    arena_dev: u64,
    /// The last group number handed out (the release counter reaches it when it is computed).
    seq: u32,
    open: Option<Open>,
    free_slots: Vec<usize>,
    /// One per slot, recorded after the slot's group: when it may be reused, and what a later
    /// group on the same words from another stream waits for.
    done: Vec<Arc<WriteBackEvent>>,
}

impl Deferred {
    /// Pinned slots and a release counter in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        let arena = HostBuffer::pinned(ctx, READ_OFFSET + 64)?;
        let done = (0..GROUPS_IN_FLIGHT)
            .map(|_| WriteBackEvent::new(ctx))
            .collect::<Result<Vec<_>, _>>()?;
        let arena_dev = arena
            .device_addr()
            .ok_or_else(|| EmuError::BadConfig("pinned arena without a device address".into()))?;
        let groups = Arc::new(Groups {
            arena,
            q: Mutex::new(VecDeque::new()),
        });
        register(&groups);
        Ok(Self {
            ctx: ctx.clone(),
            groups,
            arena_dev,
            seq: 0,
            open: None,
            free_slots: (0..GROUPS_IN_FLIGHT).rev().collect(),
            done,
        })
    }

    /// Enqueues, once at lane creation, a batched copy and the read-counter store and stream
    /// wait of a group (already satisfied: group 0), so that the driver sets up whatever these
    /// calls need while the GPU is idle, never while kernels that wait for the NIC fill it.
    /// Returns whether stream waits work. (A refused copy here, pinned to pinned, says nothing
    /// about device copies: their first use decides for them.)
    ///
    /// # Safety
    /// `stream` is a live stream of `ctx`, current on this thread.
    pub unsafe fn probe(&mut self, stream: sys::CUstream) -> bool {
        let mut batch_copies = true;
        let device = self.ctx.ordinal() as i32;
        let (mut d, mut s, mut n) = (
            [self.arena_dev + new_at(0, 0) as u64],
            [self.arena_dev + old_at(0, 0) as u64],
            [8usize],
        );
        // SAFETY: two 8-byte slots of the pinned arena; the caller vouches for the stream.
        let copied = unsafe {
            copy_many(
                stream,
                device,
                &mut d,
                &mut s,
                &mut n,
                &mut batch_copies,
                false,
            )
        };
        if let Err(e) = copied {
            tracing::warn!("copies refused at lane creation: {e}");
        }
        // SAFETY: both counters are words of the pinned arena; the release counter is 0, so
        // the wait for 0 is satisfied at once.
        match unsafe {
            read_then_wait(
                stream,
                self.arena_dev + READ_OFFSET as u64,
                self.arena_dev + FLAG_OFFSET as u64,
                0,
            )
        } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("stream waits unavailable, atomics wait for their reads: {e}");
                false
            }
        }
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<Inflight>> {
        self.groups.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a group is open (atomics gathered, nothing enqueued yet).
    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Whether the host still owes work (an open group, or groups enqueued and not finished).
    pub fn busy(&self) -> bool {
        self.open.is_some() || !self.queue().is_empty()
    }

    /// Adds `op` on the device word at `target` to the open group (opening one, which may wait,
    /// bounded, for a slot), its reply to go to `result` as `order` formats it.
    pub fn add(
        &mut self,
        target: u64,
        op: AtomicOp,
        result: Loc,
        order: FetchOrder,
        timeout: Duration,
    ) -> Result<Added, EmuError> {
        if self.open.is_none() {
            let slot = self.free_slot(timeout)?;
            self.open = Some(Open {
                slot,
                words: Vec::new(),
                atoms: Vec::new(),
            });
        }
        let g = self.open.as_mut().expect("opened above");
        let width = op.width();
        if g.atoms.len() >= GROUP_ATOMICS {
            return Ok(Added::CloseFirst);
        }
        let word = match g
            .words
            .iter()
            .position(|w| w.addr == target && w.width == width)
        {
            Some(i) => i,
            None => {
                if g.words
                    .iter()
                    .any(|w| target < w.addr + w.width as u64 && w.addr < target + width as u64)
                {
                    return Ok(Added::CloseFirst);
                }
                g.words.push(Word {
                    addr: target,
                    width,
                });
                g.words.len() - 1
            }
        };
        g.atoms.push(Atom {
            word,
            op,
            result,
            order,
        });
        Ok(Added::Joined)
    }

    fn free_slot(&mut self, timeout: Duration) -> Result<usize, EmuError> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.free_slots.pop() {
                return Ok(s);
            }
            self.poll()?;
            help_all();
            if start.elapsed() > timeout {
                return Err(EmuError::BackendTimeout {
                    backend: "cuda",
                    what: "a slot for deferred atomics",
                    waited: start.elapsed(),
                });
            }
            std::thread::yield_now();
        }
    }

    /// Enqueues the open group on `stream` (module docs, steps 1–4). When the stream wait is
    /// refused, the group is computed at once (a bounded host wait for the read) and
    /// `Ok(false)` says to stop deferring.
    ///
    /// # Safety
    /// Every word and device result of the group must be valid device memory until the stream
    /// has executed the group (the engine checked them against live registrations, which it
    /// holds); `stream` is a live stream of a context current on this thread.
    pub unsafe fn close(
        &mut self,
        stream: sys::CUstream,
        batch_copies: &mut bool,
        timeout: Duration,
    ) -> Result<bool, EmuError> {
        let Some(g) = self.open.take() else {
            return Ok(true);
        };
        let mut stripes: Vec<usize> = g.words.iter().map(|w| stripe_index(w.addr)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let mut guards: Vec<MutexGuard<'static, Option<LastWrite>>> = stripes
            .iter()
            .map(|&i| STRIPES[i].lock().unwrap_or_else(|p| p.into_inner()))
            .collect();
        for l in guards.iter().filter_map(|g| g.as_ref()) {
            if l.stream != stream as usize {
                // SAFETY: a live event (the stripe holds it) and a live stream.
                check("cuStreamWaitEvent", unsafe {
                    sys::cuStreamWaitEvent(stream, l.event.raw, 0)
                })?;
            }
        }
        let device = self.ctx.ordinal() as i32;
        let slot = g.slot;
        // 2. The reads.
        let mut dsts: Vec<u64> = (0..g.words.len())
            .map(|i| self.arena_dev + old_at(slot, i) as u64)
            .collect();
        let mut srcs: Vec<u64> = g.words.iter().map(|w| w.addr).collect();
        let mut sizes: Vec<usize> = g.words.iter().map(|w| w.width).collect();
        // SAFETY: the words are valid device memory (the caller's promise); the slots are pinned
        // and this group's until `done`.
        unsafe {
            copy_many(
                stream,
                device,
                &mut dsts,
                &mut srcs,
                &mut sizes,
                batch_copies,
                false,
            )?
        };
        // 3. The read counter and the wait for the host, in one call.
        let seq = self.seq.wrapping_add(1);
        self.seq = seq;
        let mut inflight = Inflight {
            seq,
            slot,
            words: g.words,
            atoms: g.atoms,
            computed: false,
            enqueued: false,
        };
        // SAFETY: both counters are 4-aligned words of the pinned arena, mapped for the device.
        let deferred = match unsafe {
            read_then_wait(
                stream,
                self.arena_dev + READ_OFFSET as u64,
                self.arena_dev + FLAG_OFFSET as u64,
                seq,
            )
        } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("stream waits unavailable, atomics are computed in place: {e}");
                // Nothing in the stream waits for the host: draining it waits for the reads.
                let start = Instant::now();
                // SAFETY: a live stream of the current context.
                while unsafe { sys::cuStreamQuery(stream) }
                    == sys::cudaError_enum::CUDA_ERROR_NOT_READY
                {
                    if start.elapsed() > timeout {
                        return Err(EmuError::BackendTimeout {
                            backend: "cuda",
                            what: "the read of an atomic",
                            waited: start.elapsed(),
                        });
                    }
                    std::thread::yield_now();
                }
                // SAFETY: the reads completed; the registrations the engine checked are live.
                unsafe { compute(&self.groups.arena, &mut inflight) };
                false
            }
        };
        // 4. Write-backs and replies (a device result that several atomics of the group name
        // receives the last one's reply: copies in one batch are unordered).
        let mut dsts: Vec<u64> = inflight.words.iter().map(|w| w.addr).collect();
        let mut srcs: Vec<u64> = (0..inflight.words.len())
            .map(|i| self.arena_dev + new_at(slot, i) as u64)
            .collect();
        let mut sizes: Vec<usize> = inflight.words.iter().map(|w| w.width).collect();
        let word_count = inflight.words.len();
        for (k, a) in inflight.atoms.iter().enumerate() {
            if let Loc::Device(r) = a.result {
                let src = self.arena_dev + reply_at(slot, k) as u64;
                let len = a.op.width();
                match dsts[word_count..].iter().position(|&d| d == r) {
                    Some(j) => {
                        let j = word_count + j;
                        (srcs[j], sizes[j]) = (src, len);
                    }
                    None => {
                        dsts.push(r);
                        srcs.push(src);
                        sizes.push(len);
                    }
                }
            }
        }
        // The group is the release thread's to compute from here on, before this thread makes
        // another driver call (one may block behind a `cuMemFree` that waits for this stream).
        let waits = !inflight.computed;
        self.queue().push_back(inflight);
        if waits {
            wake_releaser();
        }
        // SAFETY: as for the reads; the sources are this group's pinned slots.
        unsafe {
            copy_many(
                stream,
                device,
                &mut dsts,
                &mut srcs,
                &mut sizes,
                batch_copies,
                false,
            )?
        };
        let done = &self.done[slot];
        // SAFETY: a live event of this context and a live stream.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(done.raw, stream)
        })?;
        for guard in guards.iter_mut() {
            **guard = Some(LastWrite {
                event: done.clone(),
                stream: stream as usize,
            });
        }
        drop(guards);
        // Its slot may be freed once `done` has completed.
        if let Some(g) = self.queue().iter_mut().rev().find(|g| g.seq == seq) {
            g.enqueued = true;
        }
        Ok(deferred)
    }

    /// Computes every group whose words have been read, in order, and frees the slots of groups
    /// the stream has finished. Returns whether the host still owes work or did some.
    ///
    /// The queue is not held across the event queries (driver calls): the release thread must
    /// always be able to compute it.
    pub fn poll(&mut self) -> Result<bool, EmuError> {
        let (did, computed_slots) = {
            let mut q = self.queue();
            let did = compute_ready(&self.groups.arena, &mut q)?;
            let slots: Vec<usize> = q
                .iter()
                .take_while(|g| g.computed && g.enqueued)
                .map(|g| g.slot)
                .collect();
            (did, slots)
        };
        let mut finished = 0;
        for slot in computed_slots {
            if !query(self.done[slot].raw)? {
                break;
            }
            finished += 1;
        }
        let groups = self.groups.clone();
        let mut q = groups.q.lock().unwrap_or_else(|p| p.into_inner());
        // Only this lane's owner pops (and pushes), so the front is still what was queried.
        for g in q.drain(..finished) {
            self.free_slots.push(g.slot);
        }
        Ok(did || !q.is_empty())
    }

    /// Computes every group enqueued so far (bounded wait for their reads).
    pub fn settle(&mut self, timeout: Duration) -> Result<(), EmuError> {
        let mut wait = SpinWait::new(timeout, 2000, "the reads of deferred atomics");
        while self.queue().iter().any(|g| !g.computed) {
            self.poll()?;
            help_all();
            wait.pause()?;
        }
        Ok(())
    }

    /// Lets the stream past every group still waiting for the host, computed or not (teardown
    /// after [`settle`](Self::settle) failed: a group never computed writes back whatever its
    /// slots hold).
    pub fn release_all(&mut self) {
        if self.queue().iter().any(|g| !g.computed) {
            tracing::error!("deferred atomics released uncomputed at teardown");
        }
        self.groups.arena.store_u32(FLAG_OFFSET, self.seq);
    }
}

impl Drop for Deferred {
    /// Freeing the pinned arena is a driver call, which the release thread must never make: it
    /// must not hold the last reference. Unlisted first (the release thread takes references
    /// only under the list's lock), then a bounded wait for a pass in progress to let go.
    fn drop(&mut self) {
        let me = Arc::as_ptr(&self.groups);
        ALL_GROUPS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), me));
        let t0 = Instant::now();
        while Arc::strong_count(&self.groups) > 1 {
            if t0.elapsed() > Duration::from_secs(1) {
                tracing::error!("a lane's deferred atomics are still referenced; its arena leaks");
                std::mem::forget(self.groups.clone());
                return;
            }
            std::thread::yield_now();
        }
    }
}

/// Enqueues, in one call, a store of `seq` into the 32-bit word at device address `read` and a
/// wait until the word at `release` reaches `seq` (GEQ, wrapping comparison).
///
/// # Safety
/// Both are 4-aligned words of pinned, mapped memory that outlives the stream's use; `stream`
/// is live.
unsafe fn read_then_wait(
    stream: sys::CUstream,
    read: u64,
    release: u64,
    seq: u32,
) -> Result<(), EmuError> {
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st as WaitValue;
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 as WaitV;
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st as WriteValue;
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as WriteV;
    let mut ops = [
        sys::CUstreamBatchMemOpParams {
            // Default flags: a memory barrier first, so the words read are visible in host
            // memory before the counter says so.
            writeValue: WriteValue {
                operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32,
                address: read,
                __bindgen_anon_1: WriteV { value: seq },
                flags: 0,
                alias: 0,
            },
        },
        sys::CUstreamBatchMemOpParams {
            waitValue: WaitValue {
                operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32,
                address: release,
                __bindgen_anon_1: WaitV { value: seq },
                flags: sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                alias: 0,
            },
        },
    ];
    // SAFETY: a store and a wait on words the caller vouched for, on a live stream.
    check("cuStreamBatchMemOp", unsafe {
        sys::cuStreamBatchMemOp_v2(stream, 2, ops.as_mut_ptr(), 0)
    })
}

fn query(e: sys::CUevent) -> Result<bool, EmuError> {
    // SAFETY: a live, recorded event.
    match unsafe { sys::cuEventQuery(e) } {
        sys::cudaError_enum::CUDA_SUCCESS => Ok(true),
        sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(EmuError::Cuda {
            call: "cuEventQuery",
            source: cudarc::driver::DriverError(e),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_do_not_overlap_and_the_counter_has_its_own_line() {
        let last = reply_at(GROUPS_IN_FLIGHT - 1, GROUP_ATOMICS - 1) + 8;
        assert_eq!(last, FLAG_OFFSET);
        assert_eq!(new_at(0, 0), old_at(0, GROUP_ATOMICS));
        assert_eq!(FLAG_OFFSET % 64, 0);
        assert_eq!(READ_OFFSET - FLAG_OFFSET, 64);
    }

    /// A lane's queue in plain host memory, with one group of two fetch-adds on one word (the
    /// word as read: 40) and a compare-swap on another (as read: 7), replies to device results.
    fn one_group() -> Groups {
        let arena = HostBuffer::new(READ_OFFSET + 64);
        let slot = 2;
        arena.store_u64(old_at(slot, 0), 40);
        arena.store_u64(old_at(slot, 1), 7);
        let atom = |word, op| Atom {
            word,
            op,
            result: Loc::Device(0x1000),
            order: FetchOrder::HostOrder,
        };
        let g = Inflight {
            seq: 1,
            slot,
            words: vec![
                Word {
                    addr: 0x10,
                    width: 8,
                },
                Word {
                    addr: 0x18,
                    width: 8,
                },
            ],
            atoms: vec![
                atom(0, AtomicOp::FetchAdd64 { add: 2 }),
                atom(
                    1,
                    AtomicOp::CompareSwap64 {
                        swap: 9,
                        compare: 7,
                    },
                ),
                atom(0, AtomicOp::FetchAdd64 { add: 3 }),
            ],
            computed: false,
            enqueued: true,
        };
        Groups {
            arena,
            q: Mutex::new(VecDeque::from([g])),
        }
    }

    fn assert_released(g: &Groups) {
        let a = &g.arena;
        assert_eq!(a.load_u32(FLAG_OFFSET), 1, "released");
        assert_eq!(a.load_u64(new_at(2, 0)), 45, "both adds, chained");
        assert_eq!(a.load_u64(new_at(2, 1)), 9, "the swap");
        let replies: Vec<u64> = (0..3).map(|k| a.load_u64(reply_at(2, k))).collect();
        assert_eq!(replies, [40, 7, 42]);
        assert!(g.q.lock().unwrap().iter().all(|i| i.computed));
    }

    #[test]
    fn a_group_is_computed_and_released_once_its_read_has_landed() {
        let g = one_group();
        let mut q = g.q.lock().unwrap();
        assert!(!compute_ready(&g.arena, &mut q).unwrap(), "not read yet");
        assert_eq!(g.arena.load_u32(FLAG_OFFSET), 0, "not released");
        g.arena.store_u32(READ_OFFSET, 1);
        assert!(compute_ready(&g.arena, &mut q).unwrap());
        assert!(!compute_ready(&g.arena, &mut q).unwrap(), "computed once");
        drop(q);
        assert_released(&g);
    }

    /// The owner never polls (as a NIC thread stuck in a driver call would not): the release
    /// thread computes and releases the group once its read lands.
    #[test]
    fn the_release_thread_releases_without_the_owner() {
        let g = Arc::new(one_group());
        register(&g);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(g.arena.load_u32(FLAG_OFFSET), 0, "not read yet");
        g.arena.store_u32(READ_OFFSET, 1);
        wake_releaser();
        let t0 = Instant::now();
        while g.arena.load_u32(FLAG_OFFSET) != 1 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the release thread did not release the group"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        assert_released(&g);
        // As `Deferred::drop`: unlisted, then the last reference is ours.
        ALL_GROUPS
            .lock()
            .unwrap()
            .retain(|w| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&g)));
        let t0 = Instant::now();
        while Arc::strong_count(&g) > 1 {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::yield_now();
        }
    }

    #[test]
    fn counters_compare_across_the_wrap() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u32::MAX) && !reached(u32::MAX, 2));
    }
}
