//! Strict mode: the NIC holds device code to what an RC QP on mlx5 promises, and to nothing the
//! spec leaves open, so code that leans on unpromised ordering fails a test instead of a cluster.
//!
//! Two parts, each switchable ([`StrictMode`]):
//! - **Control-segment checks**: each WQE's QPN must be its QP's and its WQE index the low 16
//!   bits of its position in the ring; a mismatch fails the WQE with `LOCAL_QP_OP_ERR` (vendor
//!   [`CTRL_QPN`](crate::vendor_syndrome::CTRL_QPN) /
//!   [`CTRL_INDEX`](crate::vendor_syndrome::CTRL_INDEX)) and moves the QP to error.
//! - **Relaxed ordering** ([`Reorder`], seeded per QP, so a failure replays): what an RC QP
//!   guarantees is kept, what it does not is shuffled (the table is on [`StrictMode`]). Held
//!   atomics and the chunks of writes wait in a per-QP [`Pipeline`] until their turn.
//!
//! RDMA read is not executed by this NIC at all, so the read half of the fence rule has nothing
//! to act on; fence modes are not told apart (any but none, undefined ones included, waits for
//! every earlier WQE).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::exec::{Effect, Planned};
use crate::mr::Region;

/// Environment variable read by [`StrictMode::from_env`] (and so by `NicConfig::default()`):
/// `0` / `off` turns strict mode off, `checks` keeps the control-segment checks and executes in
/// order, anything else (or unset) is full strict mode.
pub const STRICT_ENV: &str = "IBGDA_EMU_STRICT";

/// Environment variable with the reordering seed (decimal or `0x` hex) for
/// [`StrictMode::from_env`]; [`DEFAULT_SEED`] when unset.
pub const SEED_ENV: &str = "IBGDA_EMU_SEED";

/// The reordering seed when [`SEED_ENV`] is unset.
pub const DEFAULT_SEED: u64 = 0x1bda_5eed;

/// Atomics a QP may hold back while later WQEs pass them, at most this many progress steps
/// each: long enough for any later unfenced WQE to overtake, short enough that a lone atomic
/// completes within a few rounds.
const MAX_HOLD_STEPS: u32 = 3;

/// How strict a NIC is.
///
/// | after … | a later WQE without a fence | with a fence (any fence mode) |
/// |---|---|---|
/// | an RDMA write | a write lands after it (CUDA: unless submitted with it, see below); an atomic executes after it has landed | same |
/// | an atomic | a write or NOP may execute, and land, before the atomic is performed and its result written locally; an atomic executes after it | waits until every earlier WQE has completed |
///
/// The data of one write lands in chunks, in a shuffled order spread over progress rounds
/// (other QPs' writes land in between). On the CUDA backend, the writes a QP submits together
/// (one progress round's) may also land in any order among themselves, unless one depends on
/// another (see the crate docs); the ordered modes submit each WQE's writes on their own. CQEs stay in WQE order, each written once its WQE and
/// every earlier one have completed. Checks (keys, ranges, rights, and here the control
/// segment's QPN and WQE index) happen in WQE order, and every WQE before a failing one
/// completes before its error CQE.
///
/// ```
/// use ibgda_emu::{NicConfig, StrictMode};
/// let cfg = NicConfig::named("a").strict(StrictMode::full(42));
/// assert!(cfg.strict.check_ctrl);
/// assert_eq!(cfg.strict.reorder.unwrap().seed, 42);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StrictMode {
    /// Check each control segment's QPN and WQE index against the ring.
    pub check_ctrl: bool,
    /// Reorder what the spec leaves unordered; `None` executes every WQE at once, in order.
    pub reorder: Option<Reorder>,
}

impl StrictMode {
    /// Everything in order, nothing checked beyond keys, ranges and rights.
    pub const fn off() -> Self {
        Self {
            check_ctrl: false,
            reorder: None,
        }
    }

    /// Control-segment checks, and reordering with `seed`.
    pub const fn full(seed: u64) -> Self {
        Self {
            check_ctrl: true,
            reorder: Some(Reorder::new(seed)),
        }
    }

    /// Control-segment checks only, everything in order.
    pub const fn checks_only() -> Self {
        Self {
            check_ctrl: true,
            reorder: None,
        }
    }

    /// As [`STRICT_ENV`] and [`SEED_ENV`] say; full strict mode with [`DEFAULT_SEED`] when
    /// neither is set. An unparsable seed falls back to the default and says so.
    pub fn from_env() -> Self {
        let seed = match std::env::var(SEED_ENV) {
            Ok(s) => parse_seed(&s).unwrap_or_else(|| {
                tracing::warn!("{SEED_ENV}={s:?} is not a number: using {DEFAULT_SEED:#x}");
                DEFAULT_SEED
            }),
            Err(_) => DEFAULT_SEED,
        };
        match std::env::var(STRICT_ENV).as_deref() {
            Ok("0") | Ok("off") | Ok("false") => Self::off(),
            Ok("checks") => Self::checks_only(),
            _ => Self::full(seed),
        }
    }
}

impl Default for StrictMode {
    /// [`StrictMode::from_env`].
    fn default() -> Self {
        Self::from_env()
    }
}

fn parse_seed(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Relaxed ordering: the seed and how writes are cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reorder {
    /// Seeds every decision (per QP: mixed with the QP number), so a run replays.
    pub seed: u64,
    /// Smallest chunk a write is cut into, in bytes; 0 picks the backend's: 64 bytes on the host
    /// backend, 2 MiB on CUDA (each chunk is a copy there, a few microseconds of driver time:
    /// smaller chunks would cost large writes their bandwidth).
    pub min_chunk: u64,
    /// Most chunks one write is cut into; 0 picks the backend's: 64 on the host, 4 on CUDA.
    pub max_chunks: u32,
}

impl Reorder {
    /// Reordering with `seed` and the backend's chunking.
    pub const fn new(seed: u64) -> Self {
        Self {
            seed,
            min_chunk: 0,
            max_chunks: 0,
        }
    }

    /// The chunking actually used on a backend that does (`device`) or does not reach GPU
    /// memory.
    pub(crate) fn resolved(self, device: bool) -> (u64, u32) {
        let (c, m) = if device { (2 << 20, 4) } else { (64, 64) };
        (
            if self.min_chunk == 0 {
                c
            } else {
                self.min_chunk
            },
            if self.max_chunks == 0 {
                m
            } else {
                self.max_chunks
            },
        )
    }
}

/// A small, seedable generator (splitmix64): reproducible decisions, no dependency.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
}

/// What a WQE asks of the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An RDMA write (inline or gathered).
    Write,
    /// An atomic.
    Atomic,
    /// No memory effect (NOP, or a WQE that fails).
    Other,
}

/// A completion the pipeline owes: which WQE, and the CQE to write once it and every earlier
/// WQE have completed.
#[derive(Debug)]
pub(crate) struct Owed {
    pub index: u64,
    pub opcode: u8,
    /// `Some((byte_count, due))` when the WQE asked for a CQE.
    pub cqe: Option<(u32, Option<Instant>)>,
}

#[derive(Debug)]
enum Work {
    Done,
    /// Chunks still to land, in the (shuffled) order they will.
    Write(VecDeque<Effect>),
    /// The atomic, and the steps it has been held back so far.
    Atomic(Effect, u32),
}

#[derive(Debug)]
struct Entry {
    owed: Owed,
    work: Work,
    /// The registrations the work touches, kept alive until it has completed.
    _held: Vec<Arc<Region>>,
}

/// One QP's WQEs that have been checked and started but not completed, in WQE order.
#[derive(Debug)]
pub(crate) struct Pipeline {
    rng: Rng,
    min_chunk: u64,
    max_chunks: u32,
    q: VecDeque<Entry>,
}

impl Pipeline {
    pub fn new(r: Reorder, qpn: u32, device: bool) -> Self {
        let (min_chunk, max_chunks) = r.resolved(device);
        Self {
            rng: Rng::new(r.seed ^ (qpn as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)),
            min_chunk: min_chunk.max(1),
            max_chunks: max_chunks.max(1),
            q: VecDeque::new(),
        }
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// WQEs in flight.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Forgets everything in flight (QP reset).
    pub fn clear(&mut self) {
        self.q.clear();
    }

    fn unfinished_write(&self) -> bool {
        self.q.iter().any(|e| matches!(e.work, Work::Write(_)))
    }

    /// Whether a WQE of `kind` (`fenced`: it carries a fence) may start now.
    pub fn admits(&self, kind: Kind, fenced: bool) -> bool {
        if fenced {
            return self.q.iter().all(|e| matches!(e.work, Work::Done));
        }
        match kind {
            // Writes land in order; atomics execute after earlier writes have landed.
            Kind::Write | Kind::Atomic => !self.unfinished_write(),
            Kind::Other => true,
        }
    }

    /// Starts a checked WQE with its effects (all writes, or one atomic, or none): the first
    /// chunks of a write land at once, an atomic may be held back.
    pub fn start(
        &mut self,
        owed: Owed,
        planned: Planned,
        apply: &mut dyn FnMut(&Effect) -> Result<(), crate::EmuError>,
    ) -> Result<(), crate::EmuError> {
        let Planned { effects, held } = planned;
        let work = match effects.first() {
            None => Work::Done,
            Some(Effect::Atomic { .. }) => {
                Work::Atomic(effects.into_iter().next().expect("one effect"), 0)
            }
            Some(_) => Work::Write(self.cut(effects)),
        };
        self.q.push_back(Entry {
            owed,
            work,
            _held: held,
        });
        let last = self.q.len() - 1;
        self.advance(last, apply)?;
        Ok(())
    }

    /// Cuts a write's effects into chunks and shuffles them.
    fn cut(&mut self, effects: Vec<Effect>) -> VecDeque<Effect> {
        let total: u64 = effects.iter().map(Effect::len).sum();
        let n = total
            .div_ceil(self.min_chunk)
            .clamp(1, self.max_chunks as u64);
        let size = total.div_ceil(n).max(1);
        let mut chunks = Vec::with_capacity(n as usize + effects.len());
        for e in &effects {
            let len = e.len();
            let mut from = 0;
            while from < len {
                let l = size.min(len - from);
                chunks.extend(e.piece(from, l));
                from += l;
            }
        }
        for i in (1..chunks.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            chunks.swap(i, j);
        }
        chunks.into()
    }

    /// One step of entry `at`'s work: some chunks of a write (at least one), or the atomic, if
    /// its turn has come and the dice (or the hold limit) say so. Returns whether it did
    /// anything.
    fn advance(
        &mut self,
        at: usize,
        apply: &mut dyn FnMut(&Effect) -> Result<(), crate::EmuError>,
    ) -> Result<bool, crate::EmuError> {
        let older_write = self
            .q
            .iter()
            .take(at)
            .any(|e| matches!(e.work, Work::Write(_)));
        let older_atomic = self
            .q
            .iter()
            .take(at)
            .any(|e| matches!(e.work, Work::Atomic(..)));
        let go = {
            let coin = self.rng.coin();
            let k = self.rng.below(u64::MAX);
            match &mut self.q[at].work {
                Work::Done => return Ok(false),
                Work::Write(left) => {
                    if older_write {
                        return Ok(false);
                    }
                    Some(1 + (k % left.len() as u64) as usize)
                }
                Work::Atomic(_, held) => {
                    if older_write || older_atomic {
                        return Ok(false);
                    }
                    if coin || *held >= MAX_HOLD_STEPS {
                        Some(1)
                    } else {
                        *held += 1;
                        None
                    }
                }
            }
        };
        let Some(n) = go else {
            return Ok(false);
        };
        let e = &mut self.q[at];
        match &mut e.work {
            Work::Write(left) => {
                for _ in 0..n {
                    let c = left.pop_front().expect("n <= chunks left");
                    apply(&c)?;
                }
                if left.is_empty() {
                    e.work = Work::Done;
                }
            }
            Work::Atomic(a, _) => {
                apply(a)?;
                e.work = Work::Done;
            }
            Work::Done => {}
        }
        Ok(true)
    }

    /// One progress step over everything in flight: the oldest unfinished write and the oldest
    /// held atomic each get a turn. Returns whether anything is (still) in flight, so that the
    /// progress thread keeps coming back.
    pub fn pump(
        &mut self,
        apply: &mut dyn FnMut(&Effect) -> Result<(), crate::EmuError>,
    ) -> Result<bool, crate::EmuError> {
        if self.q.is_empty() {
            return Ok(false);
        }
        if let Some(w) = self.q.iter().position(|e| matches!(e.work, Work::Write(_))) {
            self.advance(w, apply)?;
        }
        if let Some(a) = self
            .q
            .iter()
            .position(|e| matches!(e.work, Work::Atomic(..)))
        {
            if self.advance(a, apply)? {
                // The atomics queued behind the one just performed go with it, up to the first
                // write still landing: held one at a time, only one atomic a round would pass.
                for i in a + 1..self.q.len() {
                    match &self.q[i].work {
                        Work::Write(_) => break,
                        Work::Done => {}
                        Work::Atomic(e, _) => {
                            apply(e)?;
                            self.q[i].work = Work::Done;
                        }
                    }
                }
            }
        }
        Ok(true)
    }

    /// Completes everything in flight, in order (before an error CQE, a reset of the order by a
    /// fence the caller cannot wait for, or a drain).
    pub fn finish_all(
        &mut self,
        apply: &mut dyn FnMut(&Effect) -> Result<(), crate::EmuError>,
    ) -> Result<(), crate::EmuError> {
        for e in self.q.iter_mut() {
            match std::mem::replace(&mut e.work, Work::Done) {
                Work::Done => {}
                Work::Write(left) => {
                    for c in &left {
                        apply(c)?;
                    }
                }
                Work::Atomic(a, _) => apply(&a)?,
            }
        }
        Ok(())
    }

    /// The completions now due, in WQE order: the completed WQEs at the front.
    pub fn completed(&mut self) -> impl Iterator<Item = Owed> + '_ {
        std::iter::from_fn(|| {
            if self.q.front().is_some_and(|e| matches!(e.work, Work::Done)) {
                self.q.pop_front().map(|e| e.owed)
            } else {
                None
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AtomicOp, Loc};

    fn owed(index: u64) -> Owed {
        Owed {
            index,
            opcode: 0,
            cqe: None,
        }
    }

    fn planned(effects: Vec<Effect>) -> Planned {
        Planned {
            effects,
            held: Vec::new(),
        }
    }

    fn put(at: u64, len: usize) -> Effect {
        Effect::Put {
            dst: Loc::Host(at),
            bytes: vec![0; len],
        }
    }

    #[test]
    fn seeds_parse() {
        assert_eq!(parse_seed("42"), Some(42));
        assert_eq!(parse_seed(" 0x1f "), Some(31));
        assert_eq!(parse_seed("x"), None);
    }

    #[test]
    fn a_write_is_cut_and_every_byte_lands_once() {
        let mut p = Pipeline::new(Reorder::new(7), 1, false);
        let mut landed = Vec::new();
        p.start(
            owed(0),
            planned(vec![put(0, 1000), put(1000, 24)]),
            &mut |e| {
                landed.push(e.clone());
                Ok(())
            },
        )
        .unwrap();
        while !p.is_empty() {
            p.pump(&mut |e| {
                landed.push(e.clone());
                Ok(())
            })
            .unwrap();
            p.completed().for_each(drop);
        }
        let mut bytes = vec![0u32; 1024];
        for e in &landed {
            let Effect::Put { dst, bytes: b } = e else {
                panic!("{e:?}")
            };
            for i in 0..b.len() {
                bytes[dst.addr() as usize + i] += 1;
            }
        }
        assert!(bytes.iter().all(|&n| n == 1));
        assert!(landed.len() > 2 && landed.len() <= 64 + 2);
        let starts: Vec<u64> = landed
            .iter()
            .map(|e| match e {
                Effect::Put { dst, .. } => dst.addr(),
                _ => unreachable!(),
            })
            .collect();
        let mut sorted = starts.clone();
        sorted.sort();
        assert_ne!(starts, sorted, "seed 7 shuffles the chunks");
    }

    #[test]
    fn a_fence_waits_for_a_held_atomic_and_cqes_stay_in_order() {
        let atomic = Effect::Atomic {
            target: Loc::Host(64),
            op: AtomicOp::FetchAdd64 { add: 1 },
            result: Loc::Host(128),
        };
        // Find a seed where the atomic is held at its start.
        let mut p = (0..64)
            .map(|s| {
                let mut p = Pipeline::new(Reorder::new(s), 1, false);
                let mut ran = false;
                p.start(owed(0), planned(vec![atomic.clone()]), &mut |_| {
                    ran = true;
                    Ok(())
                })
                .unwrap();
                (p, ran)
            })
            .find(|(_, ran)| !ran)
            .expect("some seed holds the atomic back")
            .0;
        assert!(p.admits(Kind::Write, false), "an unfenced write may pass");
        assert!(!p.admits(Kind::Write, true), "a fenced one may not");
        p.start(owed(1), planned(vec![put(0, 8)]), &mut |_| Ok(()))
            .unwrap();
        assert_eq!(p.completed().count(), 0, "CQE 1 waits for WQE 0");
        for _ in 0..=MAX_HOLD_STEPS {
            p.pump(&mut |_| Ok(())).unwrap();
        }
        let done: Vec<u64> = p.completed().map(|o| o.index).collect();
        assert_eq!(done, [0, 1]);
        assert!(p.is_empty());
    }
}
