//! A queue pair: its configuration and state machine, and the engine step that turns doorbells
//! into executed WQEs and CQEs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ibgda_device::wire::{parse_wqe, syndrome, Cqe64, FenceMode, WqeOp, WQEBB_BYTES};

use crate::backend::{Lane, Loc, Mark, MemoryBackend};
use crate::cq::{CqConfig, CqWriter};
use crate::doorbell::{DoorbellConfig, DoorbellState, UarInfo};
use crate::error::EmuError;
use crate::exec::{apply, execute, plan, vendor_syndrome, wire_bytes, ExecCtx, Outcome, Planned};
use crate::fabric::NodeId;
use crate::fault::{FaultPlan, Wire};
use crate::host::store_cqe_host;
use crate::mr::Registry;
use crate::nic::NicConfig;
use crate::strict::{Kind, Owed, Pipeline, StrictMode};

/// Largest send ring: 16-bit WQE counters must name every outstanding WQEBB unambiguously.
pub const MAX_WQEBBS: u32 = 1 << 15;

/// The state of a QP (the verbs state machine, reduced to what a requester needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Created or reset: doorbells are not looked at.
    Reset,
    /// Connected and ready to send: WQEs execute.
    Rts,
    /// A WQE failed (or the QP was forced to error): every WQE is flushed with
    /// `WR_FLUSH_ERR` until the QP is reset.
    Error,
}

/// Where a QP's rings and doorbells are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpConfig {
    /// The send ring: `nwqebbs` 64-byte slots, 64-byte aligned.
    pub sq: Loc,
    /// Ring size in WQEBBs: a power of two, at most [`MAX_WQEBBS`].
    pub nwqebbs: u32,
    /// Where completions go.
    pub cq: CqConfig,
    /// How the NIC learns the producer index.
    pub doorbell: DoorbellConfig,
}

impl QpConfig {
    pub(crate) fn validate(&self, backend: &dyn MemoryBackend) -> Result<(), EmuError> {
        if !self.nwqebbs.is_power_of_two() || self.nwqebbs > MAX_WQEBBS {
            return Err(EmuError::BadConfig(format!(
                "send ring of {} WQEBBs: must be a power of two, at most {MAX_WQEBBS}",
                self.nwqebbs
            )));
        }
        if self.sq.addr() % WQEBB_BYTES as u64 != 0 {
            return Err(EmuError::BadConfig(format!(
                "send ring at {:#x} is not 64-byte aligned",
                self.sq.addr()
            )));
        }
        self.cq.validate()?;
        if let Some(d) = self.doorbell.dbr {
            if d.addr() % 8 != 0 {
                return Err(EmuError::BadConfig(format!(
                    "doorbell record at {:#x} is not 8-byte aligned",
                    d.addr()
                )));
            }
        }
        if let Some(s) = self.doorbell.producer_slot {
            if s.addr() % 8 != 0 {
                return Err(EmuError::BadConfig(format!(
                    "producer slot at {:#x} is not 8-byte aligned",
                    s.addr()
                )));
            }
        }
        let locs = [
            Some(self.sq),
            Some(self.cq.loc),
            self.doorbell.dbr,
            self.doorbell.producer_slot,
        ];
        if !backend.supports_device() && locs.iter().flatten().any(|l| !l.is_host()) {
            return Err(EmuError::Unsupported {
                backend: backend.name(),
                what: "place rings or doorbells in GPU memory",
            });
        }
        Ok(())
    }
}

/// What [`Nic::create_qp`](crate::Nic::create_qp) hands back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpHandle {
    /// The QP number (24 bits, unique in its fabric).
    pub qpn: u32,
    /// The emulated UAR page, when [`DoorbellConfig::uar`] asked for one.
    pub uar: Option<UarInfo>,
}

/// The first error a QP hit.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct QpError {
    /// 64-bit index of the failed WQE's first WQEBB.
    pub wqe_index: u64,
    /// Its opcode.
    pub wqe_opcode: u8,
    /// The CQE syndrome reported.
    pub syndrome: u8,
    /// The emulator's vendor syndrome ([`vendor_syndrome`](crate::vendor_syndrome)).
    pub vendor_syndrome: u8,
    /// Why, in words.
    pub reason: String,
}

/// A snapshot of a QP's progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpStatus {
    /// The QP.
    pub qpn: u32,
    /// Its state.
    pub state: QpState,
    /// WQEBBs read and executed or flushed.
    pub fetched: u64,
    /// Producer index the doorbells announced.
    pub announced: u64,
    /// WQEs executed (successfully or not), flushes excluded.
    pub wqes_executed: u64,
    /// WQEs flushed in the error state.
    pub wqes_flushed: u64,
    /// CQEs written.
    pub cqes_written: u64,
    /// CQEs waiting for their data to land or for an injected delay.
    pub pending_cqes: usize,
    /// Strict mode: WQEs started whose effects have not all happened yet (held atomics, writes
    /// with chunks still to land), or whose CQE waits for an earlier such WQE.
    pub in_flight: usize,
    /// Doorbells seen (each a larger producer index, from any source).
    pub doorbells: u64,
    /// The first error, if any.
    pub first_error: Option<QpError>,
    /// The peer's node and QP number, once connected.
    pub peer: Option<(NodeId, u32)>,
    /// While CQEs are pending: the first one's mark and the lane's ordering state (else
    /// empty).
    pub lane: String,
}

impl std::fmt::Display for QpStatus {
    /// One line: the indices and counts that tell where a QP's work stopped.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "qpn {:#x} {:?}: doorbells {}, announced {}, fetched {}, executed {}, flushed {}, \
             CQEs written {}, CQEs pending {}, in flight {}",
            self.qpn,
            self.state,
            self.doorbells,
            self.announced,
            self.fetched,
            self.wqes_executed,
            self.wqes_flushed,
            self.cqes_written,
            self.pending_cqes,
            self.in_flight
        )?;
        if let Some(e) = &self.first_error {
            write!(f, ", first error at WQE {}: {}", e.wqe_index, e.reason)?;
        }
        if !self.lane.is_empty() {
            write!(f, " [{}]", self.lane)?;
        }
        Ok(())
    }
}

/// The other end of a connected QP.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    pub node: NodeId,
    pub qpn: u32,
    pub registry: Arc<Registry>,
    /// The responder QP's granted rights (`Access` bits), when its firmware set them.
    pub access: Option<Arc<AtomicU32>>,
}

#[derive(Debug)]
struct PendingCqe {
    mark: Mark,
    due: Option<Instant>,
    loc: Loc,
    bytes: [u8; 64],
}

/// WQEBBs read from the ring in one go (a copy per batch, not per WQE, when the ring is in GPU
/// memory).
const RING_READ_AHEAD: u64 = 256;

/// Everything the progress thread changes about one QP.
#[derive(Debug)]
pub(crate) struct QpEngine {
    pub qpn: u32,
    pub state: QpState,
    pub cfg: QpConfig,
    pub lane: Box<dyn Lane>,
    pub peer: Option<Peer>,
    pub db: DoorbellState,
    cq: CqWriter,
    pub fetched: u64,
    pub announced: u64,
    announce_times: VecDeque<(u64, Instant)>,
    wqes_executed: u64,
    wqes_flushed: u64,
    cqes_written: u64,
    /// CQEs this QP has produced (written, queued or lost), for the fault plan's lost CQEs.
    cqes_emitted: u64,
    /// The fault plan's CQEs of this QP to lose (1-based), refreshed every step.
    lost_cqes: Vec<u64>,
    pending: VecDeque<PendingCqe>,
    first_error: Option<QpError>,
    ring_cache: (u64, Vec<u8>),
    /// Strict mode: check each control segment's QPN and WQE index.
    check_ctrl: bool,
    /// Strict mode: WQEs started but not completed (reordering on).
    pipeline: Option<Pipeline>,
}

/// What one engine step reads besides its QP.
pub(crate) struct StepCtx<'a> {
    pub backend: &'a dyn MemoryBackend,
    pub local: &'a Registry,
    pub plan: &'a FaultPlan,
    pub wire: &'a Mutex<Wire>,
    pub cfg: &'a NicConfig,
    /// WQEs the NIC executed under this plan, all QPs (peer death).
    pub executed: &'a std::sync::atomic::AtomicU64,
}

impl QpEngine {
    /// A QP in state Reset; `device`: whether the backend reaches GPU memory (strict mode's
    /// chunking depends on it).
    pub fn new(
        qpn: u32,
        cfg: QpConfig,
        lane: Box<dyn Lane>,
        db: DoorbellState,
        strict: &StrictMode,
        device: bool,
    ) -> Self {
        let mut lane = lane;
        lane.set_relaxed(strict.reorder.is_some());
        Self {
            qpn,
            state: QpState::Reset,
            cfg,
            lane,
            peer: None,
            db,
            cq: CqWriter::new(cfg.cq),
            fetched: 0,
            announced: 0,
            announce_times: VecDeque::new(),
            wqes_executed: 0,
            wqes_flushed: 0,
            cqes_written: 0,
            cqes_emitted: 0,
            lost_cqes: Vec::new(),
            pending: VecDeque::new(),
            first_error: None,
            ring_cache: (0, Vec::new()),
            check_ctrl: strict.check_ctrl,
            pipeline: strict.reorder.map(|r| Pipeline::new(r, qpn, device)),
        }
    }

    pub fn status(&self) -> QpStatus {
        QpStatus {
            qpn: self.qpn,
            state: self.state,
            fetched: self.fetched,
            announced: self.announced,
            wqes_executed: self.wqes_executed,
            wqes_flushed: self.wqes_flushed,
            cqes_written: self.cqes_written,
            pending_cqes: self.pending.len(),
            in_flight: self.pipeline.as_ref().map_or(0, Pipeline::len),
            doorbells: self.db.events,
            first_error: self.first_error.clone(),
            peer: self.peer.as_ref().map(|p| (p.node, p.qpn)),
            lane: match self.pending.front() {
                Some(p) => format!(
                    "first pending CQE: mark {}, {}; {}",
                    p.mark.0,
                    match p.due {
                        Some(d) =>
                            format!("due in {:?}", d.saturating_duration_since(Instant::now())),
                        None => "no delay".to_string(),
                    },
                    self.lane.describe()
                ),
                None => String::new(),
            },
        }
    }

    /// Back to [`QpState::Reset`] with every index at zero, as after `ibv_modify_qp(RESET)`.
    /// CQEs still pending are dropped, as a reset drops them.
    pub fn reset(&mut self) {
        self.state = QpState::Reset;
        self.peer = None;
        self.db.reset();
        self.cq = CqWriter::new(self.cfg.cq);
        self.fetched = 0;
        self.announced = 0;
        self.announce_times.clear();
        self.wqes_executed = 0;
        self.wqes_flushed = 0;
        self.cqes_written = 0;
        self.cqes_emitted = 0;
        self.pending.clear();
        self.first_error = None;
        self.ring_cache = (0, Vec::new());
        if let Some(p) = &mut self.pipeline {
            p.clear();
        }
    }

    /// Moves to the error state for a reason outside any WQE (the program, a backend failure).
    pub fn force_error(&mut self, reason: String) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        if self.first_error.is_none() {
            self.first_error = Some(QpError {
                wqe_index: self.fetched,
                wqe_opcode: 0,
                syndrome: syndrome::LOCAL_QP_OP_ERR,
                vendor_syndrome: vendor_syndrome::BACKEND,
                reason,
            });
        }
    }

    /// Whether everything announced has been executed and every CQE written (enqueued, on a
    /// device CQ).
    pub fn is_idle(&self) -> bool {
        self.fetched >= self.announced
            && self.pending.is_empty()
            && self.pipeline.as_ref().is_none_or(Pipeline::is_empty)
            && !self.lane.busy()
    }

    /// One round: doorbells, WQEs, completions. Returns whether anything happened.
    pub fn step(&mut self, cx: &StepCtx<'_>) -> Result<bool, EmuError> {
        let mut did = false;
        if !cx.plan.lost_cqes.is_empty() || !self.lost_cqes.is_empty() {
            self.lost_cqes = cx.plan.lost_cqes_of(self.qpn);
        }
        did |= self.lane.poll()?;
        if matches!(self.state, QpState::Rts | QpState::Error) {
            did |= self.poll_doorbells(cx)?;
            did |= self.run_wqes(cx)?;
        }
        // What the round gathered goes to the hardware once, then the completions it owes.
        self.lane.flush()?;
        if !self.pending.is_empty() {
            did |= self.drain_pending()?;
            self.lane.flush()?;
        }
        Ok(did)
    }

    pub fn poll_doorbells(&mut self, cx: &StepCtx<'_>) -> Result<bool, EmuError> {
        let polled = self.db.poll(
            cx.backend,
            self.qpn,
            self.fetched,
            self.announced,
            self.cfg.nwqebbs,
            cx.cfg.device_poll_interval,
        )?;
        let Some(pi) = polled.pi else {
            return Ok(false);
        };
        self.db.events += 1;
        if cx.plan.drops_doorbell(self.qpn, self.db.events) {
            tracing::debug!(
                qpn = self.qpn,
                pi,
                nth = self.db.events,
                "fault plan: doorbell dropped"
            );
            self.db.ignore_upto = pi;
            return Ok(true);
        }
        self.announced = pi;
        self.announce_times.push_back((pi, Instant::now()));
        Ok(true)
    }

    /// When the WQE at `index` was announced.
    fn announced_at(&mut self, index: u64) -> Instant {
        while self
            .announce_times
            .front()
            .is_some_and(|&(pi, _)| pi <= index)
        {
            self.announce_times.pop_front();
        }
        self.announce_times
            .front()
            .map(|&(_, t)| t)
            .unwrap_or_else(Instant::now)
    }

    /// The WQEBBs `[index, index + count)`, read through the cache.
    fn ring_bytes(
        &mut self,
        backend: &dyn MemoryBackend,
        index: u64,
        count: u64,
    ) -> Result<Vec<u8>, EmuError> {
        let bb = WQEBB_BYTES as u64;
        let (start, cached) = &self.ring_cache;
        let have = cached.len() as u64 / bb;
        if index < *start || index + count > start + have {
            let want = (self.announced - index).clamp(count, RING_READ_AHEAD.max(count));
            let mut buf = vec![0u8; (want * bb) as usize];
            let n = self.cfg.nwqebbs as u64;
            let mut done = 0;
            while done < want {
                let slot = (index + done) & (n - 1);
                let run = (n - slot).min(want - done);
                let dst = &mut buf[(done * bb) as usize..((done + run) * bb) as usize];
                // SAFETY: the ring was validated at creation and lives while the QP does; `slot
                // + run <= n` keeps the read inside it.
                unsafe { backend.read(self.cfg.sq.offset(slot * bb), dst)? };
                done += run;
            }
            self.ring_cache = (index, buf);
        }
        let (start, cached) = &self.ring_cache;
        let from = ((index - start) * bb) as usize;
        Ok(cached[from..from + (count * bb) as usize].to_vec())
    }

    fn run_wqes(&mut self, cx: &StepCtx<'_>) -> Result<bool, EmuError> {
        let mut did = false;
        if self.pipeline.as_ref().is_some_and(|p| !p.is_empty()) {
            if self.state == QpState::Error {
                // Forced to error with WQEs in flight: they complete before anything is flushed.
                self.finish_pipeline(cx);
                did = true;
            } else {
                did |= self.pump_pipeline(cx);
            }
        }
        let mut budget = cx.cfg.wqe_budget.max(1);
        while self.fetched < self.announced && budget > 0 {
            budget -= 1;
            let index = self.fetched;
            let avail = self.announced - index;
            let first = self.ring_bytes(cx.backend, index, 1)?;
            let opcode = first[3];
            let ds = first[7] & 0x3f;
            let nbb = ((ds as u64 * 16).div_ceil(WQEBB_BYTES as u64)).max(1);
            if self.state == QpState::Error {
                self.flush(index, opcode)?;
                self.fetched += nbb.min(avail);
                did = true;
                continue;
            }
            if nbb > avail {
                self.fail(
                    cx,
                    index,
                    opcode,
                    syndrome::LOCAL_QP_OP_ERR,
                    vendor_syndrome::PAST_PRODUCER,
                    format!(
                        "WQE of {nbb} WQEBBs at index {index} reaches past the producer index {}",
                        self.announced
                    ),
                )?;
                self.fetched += avail;
                did = true;
                continue;
            }
            if self.check_ctrl {
                if let Some((vendor, reason)) = ctrl_mismatch(&first, self.qpn, index) {
                    self.fail(cx, index, opcode, syndrome::LOCAL_QP_OP_ERR, vendor, reason)?;
                    self.fetched += nbb;
                    did = true;
                    continue;
                }
            }
            let bytes = if nbb == 1 {
                first
            } else {
                self.ring_bytes(cx.backend, index, nbb)?
            };
            let parsed = parse_wqe(&bytes);
            if self.pipeline.is_some() {
                let (kind, fenced) = match &parsed {
                    Ok(p) => (kind_of(&p.op), !matches!(p.fence(), Some(FenceMode::None))),
                    Err(_) => (Kind::Other, false),
                };
                if !self.admits(kind, fenced) {
                    // One more turn for what is in flight; still in the way: the next round.
                    self.pump_pipeline(cx);
                    did = true;
                    if !self.admits(kind, fenced) {
                        break;
                    }
                }
                if fenced && kind != Kind::Atomic {
                    // Everything earlier has been performed: it lands before this WQE's effects.
                    // (An atomic is performed after every earlier write has landed and after the
                    // earlier atomics of its group, in order, whether fenced or not.)
                    self.lane.barrier()?;
                }
            }
            // Peer death: past its last WQE the NIC stops here, mid-round, for good.
            if cx.plan.dead(cx.executed.load(Ordering::Relaxed)) {
                break;
            }
            let mut due = None;
            if cx.plan.shaped() {
                let wb = parsed.as_ref().map(|p| wire_bytes(&p.op)).unwrap_or(0);
                let at = self.announced_at(index);
                let mut wire = cx.wire.lock().expect("wire lock");
                match wire.schedule(cx.plan, at, wb, Instant::now()) {
                    Some(done) => due = Some(done),
                    None => break,
                }
            }
            if !cx.plan.delay_completions.is_zero() {
                let d = ibgda_device::timeout::deadline_after(
                    Instant::now(),
                    cx.plan.delay_completions,
                );
                due = Some(due.map_or(d, |x: Instant| x.max(d)));
            }
            self.wqes_executed += 1;
            cx.executed.fetch_add(1, Ordering::Relaxed);
            let mut reason = String::new();
            let mut planned = Planned::default();
            let outcome = if let Some(s) = cx.plan.wqe_fault(self.qpn, self.wqes_executed) {
                reason = format!("fault plan: WQE {} of this QP fails", self.wqes_executed);
                Outcome::Failed {
                    syndrome: s,
                    vendor: vendor_syndrome::INJECTED,
                }
            } else {
                match &parsed {
                    Err(e) => {
                        reason = format!("undecodable WQE: {e}");
                        Outcome::Failed {
                            syndrome: e.syndrome(),
                            vendor: vendor_syndrome::BAD_WQE,
                        }
                    }
                    Ok(p) => {
                        let ecx = ExecCtx {
                            local: cx.local,
                            remote: self.peer.as_ref().map(|p| &*p.registry),
                            remote_qp_access: self.peer.as_ref().and_then(|p| {
                                let bits = p.access.as_ref()?.load(Ordering::Acquire);
                                Some(crate::mr::Access::from_bits(bits))
                            }),
                            fetch_order: cx.cfg.fetch_order,
                            timeout: cx.cfg.op_timeout,
                        };
                        let run = if self.pipeline.is_some() {
                            Ok(plan(&p.op, &ecx, &mut planned))
                        } else {
                            execute(&p.op, &ecx, self.lane.as_mut())
                        };
                        match run {
                            Ok(o) => o,
                            Err(e) => {
                                tracing::error!(qpn = self.qpn, index, "backend failure: {e}");
                                reason = format!("backend failure: {e}");
                                Outcome::Failed {
                                    syndrome: syndrome::LOCAL_QP_OP_ERR,
                                    vendor: vendor_syndrome::BACKEND,
                                }
                            }
                        }
                    }
                }
            };
            match outcome {
                Outcome::Done { byte_count } => {
                    let wants_cqe = parsed.as_ref().is_ok_and(|p| p.cqe_requested());
                    if self.pipeline.is_some() {
                        let owed = Owed {
                            index,
                            opcode,
                            cqe: wants_cqe.then_some((byte_count, due)),
                        };
                        if let Err(e) = self.start_in_pipeline(cx, owed, planned) {
                            tracing::error!(qpn = self.qpn, index, "backend failure: {e}");
                            self.fail(
                                cx,
                                index,
                                opcode,
                                syndrome::LOCAL_QP_OP_ERR,
                                vendor_syndrome::BACKEND,
                                format!("backend failure: {e}"),
                            )?;
                        }
                    } else if wants_cqe {
                        let qpn = self.qpn;
                        self.emit(
                            |owner| Cqe64::requester(owner, index as u16, qpn, opcode, byte_count),
                            due,
                        )?;
                    }
                }
                Outcome::Failed { syndrome, vendor } => {
                    if reason.is_empty() {
                        reason = describe(syndrome, vendor);
                    }
                    self.fail(cx, index, opcode, syndrome, vendor, reason)?;
                }
            }
            self.fetched += nbb;
            did = true;
            if self.pipeline.is_none() {
                // In order: this WQE's writes land before the next one's.
                self.lane.order_point()?;
            }
        }
        Ok(did)
    }

    /// Whether strict mode lets a WQE of `kind` start now (always, without reordering).
    fn admits(&self, kind: Kind, fenced: bool) -> bool {
        self.pipeline
            .as_ref()
            .is_none_or(|p| p.admits(kind, fenced))
    }

    /// Starts a checked WQE in the strict pipeline and writes the CQEs that became due.
    fn start_in_pipeline(
        &mut self,
        cx: &StepCtx<'_>,
        owed: Owed,
        planned: Planned,
    ) -> Result<(), EmuError> {
        let (order, timeout) = (cx.cfg.fetch_order, cx.cfg.op_timeout);
        let lane = &mut self.lane;
        let p = self.pipeline.as_mut().expect("strict pipeline");
        p.start(owed, planned, &mut |e| {
            // SAFETY: the effect was planned against live registrations, which the pipeline
            // holds until it completes.
            unsafe { apply(e, lane.as_mut(), order, timeout) }
        })?;
        self.emit_completed()
    }

    /// One turn for the WQEs in flight; returns whether any are. A backend failure moves the QP
    /// to error (its CQE names the oldest WQE in flight).
    fn pump_pipeline(&mut self, cx: &StepCtx<'_>) -> bool {
        let (order, timeout) = (cx.cfg.fetch_order, cx.cfg.op_timeout);
        let lane = &mut self.lane;
        let Some(p) = self.pipeline.as_mut() else {
            return false;
        };
        let r = p.pump(&mut |e| {
            // SAFETY: as in `start_in_pipeline`.
            unsafe { apply(e, lane.as_mut(), order, timeout) }
        });
        match r {
            Ok(busy) => {
                if let Err(e) = self.emit_completed() {
                    self.force_error(format!("writing a CQE: {e}"));
                }
                busy
            }
            Err(e) => {
                tracing::error!(qpn = self.qpn, "backend failure in flight: {e}");
                self.finish_pipeline(cx);
                self.force_error(format!("backend failure: {e}"));
                true
            }
        }
    }

    /// Completes every WQE in flight, in order, and writes their CQEs (before an error CQE, and
    /// when the QP was forced to error). A backend failure here is logged: the QP is failing
    /// anyway, and what is left in flight is dropped.
    fn finish_pipeline(&mut self, cx: &StepCtx<'_>) {
        let (order, timeout) = (cx.cfg.fetch_order, cx.cfg.op_timeout);
        let lane = &mut self.lane;
        let Some(p) = self.pipeline.as_mut() else {
            return;
        };
        if p.is_empty() {
            return;
        }
        let r = p.finish_all(&mut |e| {
            // SAFETY: as in `start_in_pipeline`.
            unsafe { apply(e, lane.as_mut(), order, timeout) }
        });
        if let Err(e) = r {
            tracing::error!(
                qpn = self.qpn,
                "backend failure completing WQEs in flight: {e}"
            );
        }
        if let Err(e) = self.emit_completed() {
            tracing::error!(qpn = self.qpn, "writing CQEs of WQEs in flight: {e}");
        }
        if let Some(p) = self.pipeline.as_mut() {
            p.clear();
        }
    }

    /// Writes the CQEs of the WQEs the pipeline has completed, in WQE order.
    fn emit_completed(&mut self) -> Result<(), EmuError> {
        let Some(p) = self.pipeline.as_mut() else {
            return Ok(());
        };
        let done: Vec<Owed> = p.completed().collect();
        let qpn = self.qpn;
        for o in done {
            if let Some((byte_count, due)) = o.cqe {
                let (index, opcode) = (o.index, o.opcode);
                self.emit(
                    |owner| Cqe64::requester(owner, index as u16, qpn, opcode, byte_count),
                    due,
                )?;
            }
        }
        Ok(())
    }

    /// An error CQE (always written, whatever the WQE asked) and the move to the error state.
    fn fail(
        &mut self,
        cx: &StepCtx<'_>,
        index: u64,
        opcode: u8,
        syndrome: u8,
        vendor: u8,
        reason: String,
    ) -> Result<(), EmuError> {
        // Every WQE before this one completes (and reports) first.
        self.finish_pipeline(cx);
        tracing::debug!(
            qpn = self.qpn,
            index,
            syndrome,
            vendor,
            "WQE failed: {reason}"
        );
        if self.first_error.is_none() {
            self.first_error = Some(QpError {
                wqe_index: index,
                wqe_opcode: opcode,
                syndrome,
                vendor_syndrome: vendor,
                reason,
            });
        }
        self.state = QpState::Error;
        let qpn = self.qpn;
        self.emit(
            |owner| Cqe64::requester_error(owner, index as u16, qpn, opcode, syndrome, vendor),
            None,
        )
    }

    fn flush(&mut self, index: u64, opcode: u8) -> Result<(), EmuError> {
        self.wqes_flushed += 1;
        let qpn = self.qpn;
        self.emit(
            |owner| {
                Cqe64::requester_error(
                    owner,
                    index as u16,
                    qpn,
                    opcode,
                    syndrome::WR_FLUSH_ERR,
                    vendor_syndrome::FLUSH,
                )
            },
            None,
        )
    }

    /// Writes a CQE now when the lane orders it behind its data by itself, else queues it until
    /// the data has landed (and any delay has passed). CQEs are written in order.
    fn emit(
        &mut self,
        make: impl FnOnce(u8) -> Cqe64,
        due: Option<Instant>,
    ) -> Result<(), EmuError> {
        self.cqes_emitted += 1;
        let (loc, bytes) = self.cq.next(make);
        if self.lost_cqes.contains(&self.cqes_emitted) {
            // Lost (fault plan): its slot in the CQ is used up and never written, so a consumer
            // waits at it, as when a NIC's completion is lost on the way to memory.
            tracing::warn!(
                qpn = self.qpn,
                cqe = self.cqes_emitted,
                "fault plan: CQE lost"
            );
            return Ok(());
        }
        if self.pending.is_empty() && due.is_none() && self.lane.cqe_in_order(loc) {
            // SAFETY: the CQ was validated at creation (aligned, sized) and lives with the QP.
            unsafe { self.lane.put_cqe(loc, &bytes)? };
            self.cqes_written += 1;
        } else {
            let mark = self.lane.mark()?;
            self.pending.push_back(PendingCqe {
                mark,
                due,
                loc,
                bytes,
            });
        }
        Ok(())
    }

    fn drain_pending(&mut self) -> Result<bool, EmuError> {
        let mut did = false;
        while let Some(p) = self.pending.front() {
            if p.due.is_some_and(|d| Instant::now() < d) {
                break;
            }
            let mark = p.mark;
            if !self.lane.landed(mark)? {
                break;
            }
            let p = self.pending.pop_front().expect("front exists");
            match p.loc {
                // SAFETY: the CQ was validated at creation and lives with the QP.
                Loc::Host(a) => unsafe { store_cqe_host(a, &p.bytes) },
                // SAFETY: as above.
                Loc::Device(_) => unsafe { self.lane.put_cqe(p.loc, &p.bytes)? },
            }
            self.cqes_written += 1;
            did = true;
        }
        Ok(did)
    }
}

/// What strict mode needs to know about a WQE's effects.
fn kind_of(op: &WqeOp<'_>) -> Kind {
    match op {
        WqeOp::RdmaWrite { .. } | WqeOp::InlineWrite { .. } => Kind::Write,
        WqeOp::FetchAdd64 { .. }
        | WqeOp::CompareSwap64 { .. }
        | WqeOp::MaskedFetchAdd32 { .. }
        | WqeOp::MaskedCompareSwap32 { .. }
        | WqeOp::MaskedFetchAdd64 { .. } => Kind::Atomic,
        WqeOp::Nop | WqeOp::Other => Kind::Other,
    }
}

/// Strict mode's control-segment check of the WQE whose first WQEBB is `first`, at ring
/// position `index` of QP `qpn`: the vendor syndrome and the reason for a mismatch.
fn ctrl_mismatch(first: &[u8], qpn: u32, index: u64) -> Option<(u8, String)> {
    let wqe_index = u16::from_be_bytes([first[1], first[2]]);
    let ctrl_qpn = u32::from_be_bytes([0, first[4], first[5], first[6]]);
    if ctrl_qpn != qpn & 0xff_ffff {
        return Some((
            vendor_syndrome::CTRL_QPN,
            format!(
                "control segment at index {index} names QP {ctrl_qpn:#x}, not this QP ({qpn:#x})"
            ),
        ));
    }
    if wqe_index != index as u16 {
        return Some((
            vendor_syndrome::CTRL_INDEX,
            format!(
                "control segment at index {index} carries WQE index {wqe_index:#06x}, want {:#06x}",
                index as u16
            ),
        ));
    }
    None
}

fn describe(syn: u8, vendor: u8) -> String {
    let why = match vendor {
        vendor_syndrome::BAD_WQE => "the WQE does not decode (opcode, opcode modifier or DS)",
        vendor_syndrome::BAD_LKEY => "a local key names no registration",
        vendor_syndrome::LOCAL_RANGE => "a local range lies outside its registration",
        vendor_syndrome::LOCAL_ACCESS => "the local registration lacks LOCAL_WRITE",
        vendor_syndrome::BAD_RKEY => "the remote key names no registration on the peer",
        vendor_syndrome::REMOTE_RANGE => "the remote range lies outside its registration",
        vendor_syndrome::REMOTE_ACCESS => "the remote registration lacks the right",
        vendor_syndrome::MISALIGNED => "the atomic's remote address is not aligned to its size",
        vendor_syndrome::LENGTH => "a length is invalid",
        vendor_syndrome::NO_PEER => "the QP has no peer",
        vendor_syndrome::REMOTE_QP_ACCESS => "the responder QP was not granted the right",
        vendor_syndrome::CTRL_QPN => "the control segment names another QP",
        vendor_syndrome::CTRL_INDEX => "the control segment's WQE index is not its ring position",
        _ => "error",
    };
    format!("{} ({syn:#04x}): {why}", syndrome::name(syn))
}
