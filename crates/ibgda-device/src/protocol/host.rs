//! The submit/quiet protocol of `include/ibgda/protocol.cuh`, step for step, in Rust over host
//! memory: host threads stand in for GPU submitters, against the emulator's host backend or any
//! NIC that reads rings and writes CQEs in host memory. It is the CPU model CI runs (the three
//! upstream bugs are properties of the protocol, not of the GPU), and the reference the device
//! code is read against: same counters, same order, same fences, same bounded waits, same error
//! record.
//!
//! ```no_run
//! # use ibgda_device::protocol::HostQp;
//! # fn run(desc: *mut ibgda_device::qp_desc::QpDesc) -> Result<(), Box<dyn std::error::Error>> {
//! // SAFETY (of the example): `desc` and every pointer in it are live host memory.
//! let qp = unsafe { HostQp::new(desc)? };
//! qp.nop(true)?;   // reserve, write, publish, doorbell
//! qp.quiet()?;     // completions cover ready_head
//! # Ok(()) }
//! ```

use core::ptr::{self, addr_of_mut, NonNull};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::status::{Stopped, ERROR_INVALID_DESC};
use crate::qp_desc::{ErrorKind, ErrorRecord, NicHandler, QpCounters, QpDesc, QpDescError};
use crate::wire::{
    db_word, dbr_send_word, wqe_index_from_counter, Be32, Cqe64, CqeState, CqeStatus, FenceMode,
    FetchAdd64, InlineWrite, LocalAddr, Nop, RdmaWrite, RemoteAddr, Sge, WqeBB, DBR_SEND_OFFSET,
    WQEBB_BYTES,
};

/// Polls before a waiter starts yielding its core between polls (`IBGDA_SPIN_FAST`).
const SPIN_FAST: u32 = 64;
/// A waiter looks at the error record once per this many polls (`IBGDA_ERROR_POLL_MASK + 1`).
const ERROR_POLL_EVERY: u32 = 256;

/// A result of the protocol: `Err` names why the call stopped (the device's status).
pub type Step<T = ()> = Result<T, Stopped>;

/// What [`HostQp::reserve`] hands to [`HostQp::publish`] (`ibgda_ticket`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The first reserved WQEBB index.
    pub base: u64,
    /// `ready_head` as read (relaxed) right after the reservation: equal to `base` when the
    /// publish turn was already free then, which spares the publish a load of its own.
    pub head: u64,
}

/// One QP driven by host threads with the device algorithm. Shared by reference among the
/// submitting threads (it is `Sync`); every piece of shared state is an atomic in the descriptor.
#[derive(Debug)]
pub struct HostQp {
    desc: NonNull<QpDesc>,
    /// The descriptor's configuration, read once (the counters in it are not used).
    cfg: QpDesc,
}

// SAFETY: the only state behind `desc` that changes is accessed through atomics (`counters`,
// the producer slot, the error record's claim and kind) or is owned by one thread at a time under
// the protocol's locks (CQ consumption, ringing); `new`'s contract keeps the memory alive.
unsafe impl Send for HostQp {}
// SAFETY: as for Send: `&self` methods only use atomics and the protocol's own locks.
unsafe impl Sync for HostQp {}

impl HostQp {
    /// Drives the QP described by `desc`.
    ///
    /// # Safety
    ///
    /// `desc` points to a 64-byte-aligned [`QpDesc`] in host memory that outlives the `HostQp`,
    /// whose configuration does not change meanwhile, and whose counters are only touched through
    /// this protocol (this type, or device code following the same one). Its pointers are host
    /// addresses of live memory: `wq_base` (`nwqes` WQEBBs), `cq_base` (`ncqes` CQEs, written by
    /// the NIC), `dbr`, and per mode `db_reg` (8 bytes the NIC watches) or `producer_slot` (an
    /// 8-byte-aligned `u64` the proxy watches); `error_record` and `cq_dbr` are 0 or live too.
    pub unsafe fn new(desc: *mut QpDesc) -> Result<Self, QpDescError> {
        let desc = NonNull::new(desc).ok_or(QpDescError::BadPointer {
            field: "desc",
            value: 0,
            align: 64,
            mode: "any",
        })?;
        // SAFETY: the caller promises a live descriptor; nothing else runs on it yet.
        let cfg = unsafe { ptr::read(desc.as_ptr()) };
        cfg.validate()?;
        Ok(Self { desc, cfg })
    }

    /// The configuration this QP was built from.
    pub fn config(&self) -> &QpDesc {
        &self.cfg
    }

    /// The handler mode.
    pub fn mode(&self) -> NicHandler {
        self.cfg.handler().unwrap_or(NicHandler::CpuHostMemory)
    }

    fn counters_ptr(&self) -> *mut QpCounters {
        // SAFETY: in bounds of the live descriptor (`new`'s contract); no reference is formed.
        unsafe { addr_of_mut!((*self.desc.as_ptr()).counters) }
    }

    fn resv_head(&self) -> &AtomicU64 {
        // SAFETY: an aligned u64 of the live counters, only accessed atomically while this QP is
        // in use (`new`'s contract). The same holds for the four accessors below.
        unsafe { AtomicU64::from_ptr(addr_of_mut!((*self.counters_ptr()).resv_head)) }
    }
    fn ready_head(&self) -> &AtomicU64 {
        // SAFETY: see `resv_head`.
        unsafe { AtomicU64::from_ptr(addr_of_mut!((*self.counters_ptr()).ready_head)) }
    }
    fn prod_idx(&self) -> &AtomicU64 {
        // SAFETY: see `resv_head`.
        unsafe { AtomicU64::from_ptr(addr_of_mut!((*self.counters_ptr()).prod_idx)) }
    }
    fn cons_idx(&self) -> &AtomicU64 {
        // SAFETY: see `resv_head`.
        unsafe { AtomicU64::from_ptr(addr_of_mut!((*self.counters_ptr()).cons_idx)) }
    }
    fn cq_cons_idx(&self) -> &AtomicU64 {
        // SAFETY: see `resv_head`.
        unsafe { AtomicU64::from_ptr(addr_of_mut!((*self.counters_ptr()).cq_cons_idx)) }
    }

    fn poll_lock(&self) -> &AtomicU32 {
        // SAFETY: an aligned u32 of the live counters, only accessed atomically.
        unsafe { AtomicU32::from_ptr(addr_of_mut!((*self.counters_ptr()).poll_lock)) }
    }

    /// The doorbell lock of mode gpu: the counters' `db_lock` word, as in `protocol.cuh`.
    fn db_lock(&self) -> &AtomicU32 {
        // SAFETY: an aligned u32 of the live counters, only accessed atomically.
        unsafe { AtomicU32::from_ptr(addr_of_mut!((*self.counters_ptr()).db_lock)) }
    }

    fn producer_slot(&self) -> &AtomicU64 {
        // SAFETY: in the CPU modes `validate` checked a non-zero, 8-byte-aligned slot, live by
        // `new`'s contract; only this protocol writes it (atomically), the proxy only reads.
        unsafe { AtomicU64::from_ptr(self.cfg.producer_slot as *mut u64) }
    }

    /// The counters now (each read atomically; together only a snapshot).
    pub fn counters(&self) -> QpCounters {
        QpCounters {
            resv_head: self.resv_head().load(Ordering::Acquire),
            ready_head: self.ready_head().load(Ordering::Acquire),
            prod_idx: self.prod_idx().load(Ordering::Acquire),
            cons_idx: self.cons_idx().load(Ordering::Acquire),
            cq_cons_idx: self.cq_cons_idx().load(Ordering::Acquire),
            poll_lock: self.poll_lock().load(Ordering::Relaxed),
            db_lock: self.db_lock().load(Ordering::Relaxed),
            reserved1: [0; 2],
        }
    }

    // -----------------------------------------------------------------------------------------
    // Errors

    fn error_record(&self) -> Option<NonNull<ErrorRecord>> {
        NonNull::new(self.cfg.error_record as *mut ErrorRecord)
    }

    /// Whether a failure is recorded in this QP's error record (by anyone).
    pub fn error_seen(&self) -> bool {
        self.error_record().is_some_and(|r| {
            // SAFETY: the record is live (`new`'s contract) and `kind` is only accessed atomically.
            unsafe { AtomicU32::from_ptr(addr_of_mut!((*r.as_ptr()).kind)) }.load(Ordering::Acquire)
                != 0
        })
    }

    /// Fills the error record unless someone did first: `kind` last, after a fence.
    fn record_error(&self, kind: u32, cqe: Option<&CqeStatus>) {
        let Some(r) = self.error_record() else { return };
        let r = r.as_ptr();
        // SAFETY: `claim` is an aligned u32 of the live record, only accessed atomically.
        let claim = unsafe { AtomicU32::from_ptr(addr_of_mut!((*r).claim)) };
        if claim
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let c = self.counters();
        let prod = if self.mode().uses_proxy() {
            self.producer_slot().load(Ordering::Acquire)
        } else {
            c.prod_idx
        };
        let mut rec = ErrorRecord {
            kind: 0,
            rank: self.cfg.rank,
            qp_index: self.cfg.qp_index,
            qpn: self.cfg.qpn,
            resv_head: c.resv_head,
            ready_head: c.ready_head,
            prod_idx: prod,
            cons_idx: c.cons_idx,
            handler_mode: self.cfg.handler_mode,
            claim: 1,
            ..bytemuck::Zeroable::zeroed()
        };
        if let Some(s) = cqe {
            rec.syndrome = s.syndrome;
            rec.vendor_syndrome = s.vendor_syndrome;
            rec.cqe_opcode = s.opcode;
            rec.wqe_opcode = s.wqe_opcode;
            rec.wqe_counter = s.wqe_counter;
        }
        // Everything but `kind` and `claim` (bytes [4,60)), then `kind` with release.
        let src = bytemuck::bytes_of(&rec);
        for (i, b) in src.iter().enumerate().take(60).skip(4) {
            // SAFETY: byte i of the live record; nobody else writes these bytes after the claim.
            unsafe { ptr::write_volatile((r as *mut u8).add(i), *b) };
        }
        fence(Ordering::SeqCst);
        // SAFETY: `kind` is an aligned u32 of the live record, only accessed atomically.
        unsafe { AtomicU32::from_ptr(addr_of_mut!((*r).kind)) }.store(kind, Ordering::Release);
    }

    fn wait_begin(&self) -> Waiter {
        // 0 is the default bound, as on the device (`ibgda_wait_bound_ns`).
        let ns = crate::timeout::wait_bound_ns(self.cfg.timeout_ns);
        Waiter {
            deadline: crate::timeout::deadline_after(Instant::now(), Duration::from_nanos(ns)),
            polls: 0,
        }
    }

    /// One more poll of a bounded wait; on expiry records `kind` and stops with it.
    fn wait_step(&self, w: &mut Waiter, kind: ErrorKind) -> Step {
        w.polls += 1;
        if w.polls > SPIN_FAST {
            // Host threads outnumber cores in the model: let the one we wait for run.
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        if w.polls % ERROR_POLL_EVERY == 0 && self.error_seen() {
            return Err(Stopped::ABORTED);
        }
        if Instant::now() > w.deadline {
            self.record_error(kind as u32, None);
            return Err(Stopped(kind as u32));
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Completions

    /// Consumes the CQEs present, unless another thread is; an error CQE is left in place,
    /// recorded, and returned.
    pub fn poll_cq(&self) -> Step {
        let lock = self.poll_lock();
        if lock
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Ok(());
        }
        let ncqes = self.cfg.ncqes;
        let cq = self.cfg.cq_base as *const Cqe64;
        let start_ci = self.cq_cons_idx().load(Ordering::Relaxed);
        let cons = self.cons_idx().load(Ordering::Relaxed);
        let (mut ci, mut done) = (start_ci, cons);
        let mut out = Ok(());
        for _ in 0..ncqes {
            // SAFETY: slot `ci mod ncqes` of the live CQ (`new`'s contract).
            let slot = unsafe { cq.add((ci & (u64::from(ncqes) - 1)) as usize) };
            // The last 8 bytes (owner, opcode, wqe_counter) in one load, as the GPU reads them.
            // SAFETY: an aligned 8-byte word of the live slot; the NIC writes it, hence volatile.
            let tail = unsafe { ptr::read_volatile((slot as *const u8).add(56) as *const u64) };
            let op_own = (tail >> 56) as u8;
            if !crate::wire::cqe_sw_owned(op_own, ci, ncqes) {
                break;
            }
            fence(Ordering::Acquire);
            // SAFETY: as above, the whole slot, now that the owner bit says it is complete.
            let cqe = unsafe { ptr::read_volatile(slot) };
            let st = CqeStatus::parse(&cqe, ci, ncqes);
            if st.state() == Some(CqeState::Error) {
                self.record_error(ErrorKind::Cqe as u32, Some(&st));
                out = Err(Stopped(ErrorKind::Cqe as u32));
                break;
            }
            // Every written WQEBB lies in [cons_idx, cons_idx + nwqes): the counter names one
            // index in [done, done + 65536).
            done = wqe_index_from_counter(st.wqe_counter, done + 65536) + 1;
            ci += 1;
        }
        if ci != start_ci {
            self.cq_cons_idx().store(ci, Ordering::Relaxed);
            if self.cfg.cq_dbr != 0 {
                // SAFETY: the live CQ doorbell record (`new`'s contract); the NIC reads it.
                unsafe {
                    ptr::write_volatile(
                        self.cfg.cq_dbr as *mut Be32,
                        Be32::new((ci as u32) & 0xff_ffff),
                    )
                };
            }
        }
        if done > cons {
            self.cons_idx().store(done, Ordering::Release);
        }
        lock.store(0, Ordering::Release);
        out
    }

    // -----------------------------------------------------------------------------------------
    // Doorbells

    /// Mode gpu: rings up to the current `ready_head` unless `prod_idx` already covers `target`,
    /// under the doorbell lock, so the doorbell record and register only move forward. With
    /// `wait` = false it gives up when another thread holds the lock.
    fn ring_gpu(&self, target: u64, wait: bool) -> Step {
        let mut w = self.wait_begin();
        loop {
            if self.prod_idx().load(Ordering::Acquire) >= target {
                return Ok(());
            }
            if self
                .db_lock()
                .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                let v = self.ready_head().load(Ordering::Acquire);
                if v > self.prod_idx().load(Ordering::Relaxed) {
                    fence(Ordering::SeqCst);
                    // SAFETY: the live doorbell record (`new`'s contract); the NIC reads it.
                    unsafe {
                        ptr::write_volatile(
                            (self.cfg.dbr as *mut u8).add(DBR_SEND_OFFSET) as *mut Be32,
                            dbr_send_word(v),
                        )
                    };
                    fence(Ordering::SeqCst);
                    // SAFETY: the live, 8-byte-aligned doorbell register (`validate`, `new`).
                    unsafe {
                        ptr::write_volatile(self.cfg.db_reg as *mut u64, db_word(self.cfg.qpn, v))
                    };
                    fence(Ordering::SeqCst);
                    self.prod_idx().store(v, Ordering::Release);
                }
                self.db_lock().store(0, Ordering::Release);
                return Ok(());
            }
            if !wait {
                return Ok(());
            }
            self.wait_step(&mut w, ErrorKind::TimeoutOther)?;
        }
    }

    /// Makes a doorbell cover `target` (at most `ready_head`): rings in mode gpu, raises the
    /// producer slot for the proxy in the CPU modes.
    pub fn ring_to(&self, target: u64) -> Step {
        if self.mode().uses_proxy() {
            self.producer_slot().fetch_max(target, Ordering::Release);
            Ok(())
        } else {
            self.ring_gpu(target, true)
        }
    }

    /// Flushes batched publishes: a doorbell up to the current `ready_head`.
    pub fn ring_published(&self) -> Step {
        self.ring_to(self.ready_head().load(Ordering::Acquire))
    }

    /// Waits until `cons_idx >= target`, consuming CQEs and keeping the doorbell up to
    /// `ready_head` meanwhile; `kind` on expiry.
    fn wait_cons(&self, target: u64, kind: ErrorKind) -> Step {
        let mut w = self.wait_begin();
        let mut pushed = 0u64;
        loop {
            if self.cons_idx().load(Ordering::Acquire) >= target {
                return Ok(());
            }
            self.poll_cq()?;
            if self.cons_idx().load(Ordering::Acquire) >= target {
                return Ok(());
            }
            let ready = self.ready_head().load(Ordering::Acquire);
            if !self.mode().uses_proxy() {
                self.ring_gpu(ready, false)?;
            } else if ready > pushed {
                self.producer_slot().fetch_max(ready, Ordering::Release);
                pushed = ready;
            }
            self.wait_step(&mut w, kind)?;
        }
    }

    // -----------------------------------------------------------------------------------------
    // Submit

    /// Step 1: reserves `n` WQEBBs and waits until their slots are free; returns the [`Ticket`]
    /// (the first index, and the turn as read right after). The caller then writes and
    /// publishes exactly `[base, base + n)` with it before reserving again.
    pub fn reserve(&self, n: u32) -> Step<Ticket> {
        if n == 0 || n > self.cfg.nwqes {
            self.record_error(ErrorKind::TimeoutReserve as u32, None);
            return Err(Stopped(ErrorKind::TimeoutReserve as u32));
        }
        let base = self.resv_head().fetch_add(u64::from(n), Ordering::Relaxed);
        let end = base + u64::from(n);
        let nwqes = u64::from(self.cfg.nwqes);
        if end > nwqes && self.cons_idx().load(Ordering::Acquire) < end - nwqes {
            self.wait_cons(end - nwqes, ErrorKind::TimeoutReserve)?;
        }
        Ok(Ticket {
            base,
            head: self.ready_head().load(Ordering::Relaxed),
        })
    }

    /// Step 2: stores one WQEBB at index `idx` (reserved by this caller).
    pub fn write(&self, idx: u64, wqe: &WqeBB) {
        let slot = (idx & (u64::from(self.cfg.nwqes) - 1)) as usize * WQEBB_BYTES;
        // SAFETY: a slot of the live ring (`new`'s contract) that this caller reserved and the
        // NIC has finished with (the reservation's wait), so no one else accesses it now.
        unsafe { ptr::write_volatile((self.cfg.wq_base as *mut u8).add(slot) as *mut WqeBB, *wqe) };
    }

    /// Steps 3 and 4: publishes `[t.base, t.base + n)` in order and, with `ring`, makes a
    /// doorbell cover it.
    ///
    /// As on the GPU: the turn is the ticket's relaxed read when it found `ready_head == base`,
    /// else a bounded wait with acquire loads; then one fence (acquire for that read, release for
    /// the WQEs), in the CPU modes a plain store of the producer slot while holding the turn, and
    /// the `ready_head` store that passes the turn on. `protocol.cuh`'s `ibgda_publish` says why
    /// the slot still only grows.
    pub fn publish(&self, t: Ticket, n: u32, ring: bool) -> Step {
        if t.head != t.base {
            let mut w = self.wait_begin();
            while self.ready_head().load(Ordering::Acquire) != t.base {
                self.wait_step(&mut w, ErrorKind::TimeoutReady)?;
            }
        }
        let end = t.base + u64::from(n);
        let raise = ring && self.mode().uses_proxy();
        fence(Ordering::AcqRel);
        if raise {
            self.producer_slot().store(end, Ordering::Relaxed);
            self.ready_head().store(end, Ordering::Release);
            return Ok(());
        }
        self.ready_head().store(end, Ordering::Relaxed);
        if ring {
            self.ring_gpu(end, true)
        } else {
            Ok(())
        }
    }

    /// Step 5: waits until every WQE published so far on this QP has completed.
    pub fn quiet(&self) -> Step {
        let target = self.ready_head().load(Ordering::Acquire);
        if self.cons_idx().load(Ordering::Acquire) >= target {
            return Ok(());
        }
        self.ring_to(target)?;
        self.wait_cons(target, ErrorKind::TimeoutQuiet)
    }

    /// One submission of `n` WQEBBs: reserve, `build(index, last)` for each (the last must ask
    /// for a CQE: `last` says which), publish. Returns the end index.
    pub fn submit(
        &self,
        n: u32,
        ring: bool,
        mut build: impl FnMut(u64, bool) -> WqeBB,
    ) -> Step<u64> {
        let t = self.reserve(n)?;
        for i in 0..u64::from(n) {
            let wqe = build(t.base + i, i + 1 == u64::from(n));
            self.write(t.base + i, &wqe);
        }
        self.publish(t, n, ring)?;
        Ok(t.base + u64::from(n))
    }

    /// A NOP asking for a CQE.
    pub fn nop(&self, ring: bool) -> Step<u64> {
        let qpn = self.cfg.qpn;
        self.submit(1, ring, |i, _| Nop::new(qpn, i as u16).cqe(true).build())
    }

    /// RDMA write of `len` bytes from local `laddr` (under the descriptor's lkey) to `remote`.
    pub fn put(&self, remote: RemoteAddr, laddr: u64, len: u32, ring: bool) -> Step<u64> {
        let (qpn, lkey) = (self.cfg.qpn, self.cfg.lkey);
        self.submit(1, ring, |i, _| {
            RdmaWrite::new(
                qpn,
                i as u16,
                remote,
                Sge {
                    addr: laddr,
                    len,
                    lkey,
                },
            )
            .cqe(true)
            .build()
        })
    }

    /// A put cut into WQEs of `chunk` bytes, up to 32 per submission, as a warp of the device
    /// posts it (`ibgda_put_warp`). Returns the end index of the last submission.
    pub fn put_chunked(
        &self,
        remote: RemoteAddr,
        laddr: u64,
        len: u64,
        chunk: u32,
        ring: bool,
    ) -> Step<u64> {
        let (qpn, lkey) = (self.cfg.qpn, self.cfg.lkey);
        let chunk = u64::from(chunk.max(1));
        let nchunks = len.div_ceil(chunk);
        let per_sub = u64::from(self.cfg.nwqes.min(32));
        let mut end = self.ready_head().load(Ordering::Acquire);
        let mut first = 0;
        while first < nchunks {
            let n = (nchunks - first).min(per_sub);
            let mut k = first;
            end = self.submit(n as u32, ring, |i, last| {
                let off = k * chunk;
                k += 1;
                let this = chunk.min(len - off) as u32;
                let dst = RemoteAddr {
                    addr: remote.addr + off,
                    rkey: remote.rkey,
                };
                RdmaWrite::new(
                    qpn,
                    i as u16,
                    dst,
                    Sge {
                        addr: laddr + off,
                        len: this,
                        lkey,
                    },
                )
                .cqe(last)
                .build()
            })?;
            first += n;
        }
        Ok(end)
    }

    /// Inline RDMA write of up to 28 bytes.
    pub fn put_inline(&self, remote: RemoteAddr, data: &[u8], ring: bool) -> Step<u64> {
        let qpn = self.cfg.qpn;
        self.submit(1, ring, |i, _| {
            InlineWrite::new(qpn, i as u16, remote, data)
                .cqe(true)
                .build()
        })
    }

    /// Non-fetching 64-bit remote add (the fetched value goes to the descriptor's scratch word);
    /// with `fence`, after this QP's earlier WQEs complete.
    pub fn signal_add(
        &self,
        remote: RemoteAddr,
        add: u64,
        fence_before: bool,
        ring: bool,
    ) -> Step<u64> {
        let (qpn, scratch) = (
            self.cfg.qpn,
            LocalAddr {
                addr: self.cfg.scratch,
                lkey: self.cfg.lkey,
            },
        );
        let fm = if fence_before {
            FenceMode::SmallAndFence
        } else {
            FenceMode::None
        };
        self.submit(1, ring, |i, _| {
            FetchAdd64::new(qpn, i as u16, remote, scratch, add)
                .fence(fm)
                .cqe(true)
                .build()
        })
    }

    /// Checks the descriptor as `ibgda_check_desc` does; records [`ERROR_INVALID_DESC`] if bad.
    pub fn check_desc(&self) -> Step {
        match self.cfg.validate() {
            Ok(()) if self.cfg.ncqes >= self.cfg.nwqes => Ok(()),
            _ => {
                self.record_error(ERROR_INVALID_DESC, None);
                Err(Stopped(ERROR_INVALID_DESC))
            }
        }
    }
}

struct Waiter {
    deadline: Instant,
    polls: u32,
}
