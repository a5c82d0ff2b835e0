//! The CUDA backend. With the GPU agent (the default where it starts; see the last section and
//! [`crate::agent`]) small operations run on a GPU block that ends when idle. Without it: data moved by
//! copy engines (peer copies between GPUs of a host) on one non-blocking stream per QP, words
//! and CQEs written by stream memory operations behind the data, atomics computed by the host
//! between stream operations, and no kernel launches anywhere. Either way the emulator
//! progresses when kernels fill every other SM.
//!
//! # Where the time goes (per WQE, on the NIC's one progress thread)
//!
//! A driver call costs the thread 1–3 µs (an RDMA write of 4 KiB measured 2.7 µs per WQE with
//! one QP busy, 1.8 µs with eight: 2× H200, 2026-11-29), so what matters is how many calls a WQE
//! costs and whether the thread waits. Before issue 18:
//!
//! | step | cost |
//! |---|---|
//! | doorbell poll | host doorbell record / UAR word: a load; GPU-resident record: a copy and a wait every `device_poll_interval` |
//! | ring read | host ring: a `memcpy`; GPU ring: a copy and a wait per 256 WQEBBs |
//! | decode, key and range checks | ~0.1–0.3 µs (a read lock and a hash lookup per key) |
//! | RDMA write (gather) | one `cuMemcpyAsync` per WQE |
//! | inline write | one `cuStreamBatchMemOp` (aligned 4/8 B) or a staged copy per WQE |
//! | CQE, GPU CQ | one `cuStreamBatchMemOp` of 8 stores |
//! | CQE, host CQ | one `cuEventRecord`, then `cuEventQuery` each round until the data landed |
//! | atomic on GPU memory | copy to host, then **the thread waits** for the QP's stream to drain (every earlier write of the QP, then the read: 10–50 µs), then a store back; every other QP of the NIC waits too |
//!
//! The atomic was the cliff: low-latency dispatch at EP2 sends 144 fenced signal atomics per
//! rank behind its token writes and took 6–14 ms.
//!
//! Now ([`crate::cuda_batch`], [`crate::cuda_deferred`]): a QP's operations of one progress
//! round are gathered and submitted once at the end of the round (or when a dependency asks):
//! all its device-to-device copies in one `cuMemcpyBatchAsync` (at most
//! [`MAX_BATCH_COPIES`](crate::cuda_batch::MAX_BATCH_COPIES)), all its word stores and device
//! CQEs in one `cuStreamBatchMemOp` per 248 stores, one `cuEventRecord` for all the round's
//! host-CQ completions (marks are lazy); consecutive atomics on GPU memory form a group (up to
//! [`GROUP_ATOMICS`](crate::cuda_deferred::GROUP_ATOMICS); under strict mode's relaxed ordering
//! also across the writes between them, which may land first, and across fenced atomics) that
//! costs four driver calls (two batched copies, one store-and-wait, one event record), and **no
//! wait** on the thread: the host computes the
//! group in a later round, once the GPU has read its words, and releases the stream. A round of
//! 64 small WQEs thus costs about three driver calls instead of 64–128, and an atomic costs the
//! thread nothing but its share of a group's calls; its latency (read, host turn, write-back,
//! about 10 µs) overlaps every other QP's work.
//!
//! Host copies (`Loc::Host` on either side) are rare (registrations of host memory) and stay one
//! ordered call each; the synchronous atomic of [`crate::cuda_atomic`] remains the fallback for
//! atomics on host memory and where the driver refuses stream waits.
//!
//! # The GPU agent
//!
//! Where it can be started ([`crate::agent`]; on by default, `IBGDA_EMU_AGENT=0` turns it off),
//! lanes are [`AgentLane`](crate::cuda_agent::AgentLane)s: small device operations (copies up
//! to [`AGENT_COPY_MAX`](crate::agent::AGENT_COPY_MAX), inline data, atomics, device CQEs) are
//! commands a GPU block executes, and only large copies and copies to or from host memory use
//! the copy engines as described above. The block ends after
//! [`AGENT_IDLE_EXIT`](crate::agent::AGENT_IDLE_EXIT) without commands and is relaunched with
//! the next one, because frees, module loads and context-wide synchronisations wait for every
//! kernel of the context: they wait at most about that long behind the emulator. The agent's
//! creation checks that they do return in that time and falls back to the path above when they
//! do not.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, DriverError};

use crate::agent::Agent;
use crate::backend::{atomic_then_put, AtomicOp, Lane, Loc, Mark, MemoryBackend};
use crate::cuda_agent::AgentLane;
use crate::cuda_atomic::{atomic_on_device, WriteBackEvent};
use crate::cuda_batch::{cqe_words, words_of, Batch};
use crate::cuda_deferred::{Added, Deferred};
use crate::error::{check, EmuError};
use crate::exec::FetchOrder;
use crate::host::{host_atomic, store_cqe_host, HostBuffer};

/// Bytes of the pinned staging buffer for synchronous reads of GPU memory (ring slots, doorbell
/// words); larger reads go in pieces.
const STAGING_BYTES: usize = 64 << 10;

/// A non-blocking service stream of the context's stream pool
/// ([`ibgda_device::stream_pool::service`]): it never synchronises with the legacy default
/// stream, and it sits on a hardware queue that no rank's waiting kernel uses, so a kernel that
/// spins for the emulator's work cannot hold that work back. Pooled streams are shared (by
/// lanes of this and other NICs) and never destroyed.
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) raw: sys::CUstream,
    /// Keeps the pooled stream's wrapper (the pool keeps the stream itself).
    _pooled: Arc<cudarc::driver::CudaStream>,
}

// SAFETY: a CUstream may be used from any thread once its context is current, which every user
// of this type makes sure of (the NIC binds its thread; API calls bind first).
unsafe impl Send for Stream {}

impl Stream {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        let pooled = ibgda_device::stream_pool::service(ctx)?;
        ctx.bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
        Ok(Self {
            ctx: ctx.clone(),
            raw: pooled.cu_stream(),
            _pooled: pooled,
        })
    }

    /// Waits until everything enqueued has completed, polling so that the wait is bounded.
    ///
    /// Pooled streams are shared, so this may wait for another lane's deferred atomics, which
    /// wait for a host thread to compute them: while it waits it computes every ready group of
    /// every lane ([`crate::cuda_deferred`]), so no two threads can wait for each other here.
    pub(crate) fn wait(&self, timeout: Duration, what: &'static str) -> Result<(), EmuError> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            // SAFETY: `raw` is a live stream.
            let r = unsafe { sys::cuStreamQuery(self.raw) };
            match r {
                sys::cudaError_enum::CUDA_SUCCESS => return Ok(()),
                sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                e => {
                    return Err(EmuError::Cuda {
                        call: "cuStreamQuery",
                        source: DriverError(e),
                    })
                }
            }
            let waited = start.elapsed();
            if waited > timeout {
                return Err(EmuError::BackendTimeout {
                    backend: "cuda",
                    what,
                    waited,
                });
            }
            polls += 1;
            if polls % 64 == 0 {
                crate::cuda_deferred::help_all();
            }
            if polls < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // The stream is the pool's: wait for this user's work, never destroy it.
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.wait(Duration::from_secs(5), "stream teardown");
        }
    }
}

#[derive(Debug)]
struct Ctrl {
    stream: Stream,
    staging: HostBuffer,
}

/// The CUDA backend of one NIC (one GPU's context).
#[derive(Debug)]
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    ctrl: Mutex<Ctrl>,
    timeout: Duration,
    /// The GPU's agent, shared with every other backend on this context in the process.
    agent: Option<Arc<Agent>>,
}

impl CudaMemory {
    /// A backend on `ctx`'s GPU, with a 10 s bound on its waits.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        Self::with_timeout(ctx, Duration::from_secs(10))
    }

    /// A backend whose waits (ring reads, atomics, fences) give up after `timeout`. Uses the
    /// GPU agent ([`uses_agent`](Self::uses_agent)) when [`AGENT_ENV`](crate::AGENT_ENV)`=1` asks for it and it can be
    /// started here (logged once per context).
    pub fn with_timeout(ctx: &Arc<CudaContext>, timeout: Duration) -> Result<Self, EmuError> {
        Self::build(ctx, timeout, crate::agent::shared(ctx))
    }

    /// A backend that never uses the GPU agent, whatever [`AGENT_ENV`](crate::AGENT_ENV) says (the copy-engine
    /// path of the module docs), with a 10 s bound on its waits.
    pub fn without_agent(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        Self::build(ctx, Duration::from_secs(10), None)
    }

    fn build(
        ctx: &Arc<CudaContext>,
        timeout: Duration,
        agent: Option<Arc<Agent>>,
    ) -> Result<Self, EmuError> {
        let stream = Stream::new(ctx)?;
        let staging = HostBuffer::pinned(ctx, STAGING_BYTES)?;
        Ok(Self {
            ctx: ctx.clone(),
            ctrl: Mutex::new(Ctrl { stream, staging }),
            timeout,
            agent,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether new QPs' small operations go through the GPU agent.
    pub fn uses_agent(&self) -> bool {
        self.agent.is_some()
    }
}

impl MemoryBackend for CudaMemory {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn new_lane(&self) -> Result<Box<dyn Lane>, EmuError> {
        if let Some(agent) = &self.agent {
            if let Some(lane) = AgentLane::new(agent, &self.ctx, self.timeout)? {
                return Ok(Box::new(lane));
            }
            tracing::warn!("the GPU agent's lanes are all taken; this QP uses the copy engines");
        }
        let mut deferred = match Deferred::new(&self.ctx) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!("deferred atomics unavailable, each waits for its read: {e}");
                None
            }
        };
        let stream = Stream::new(&self.ctx)?;
        let defer = match deferred.as_mut() {
            // SAFETY: a live stream of this context, current on this thread (`Stream::new`).
            Some(d) => unsafe { d.probe(stream.raw) },
            None => false,
        };
        stream.wait(self.timeout, "the probes of a new lane")?;
        Ok(Box::new(CudaLane {
            stream,
            events: VecDeque::new(),
            free: Vec::new(),
            next_mark: 0,
            recorded_upto: 0,
            landed_upto: 0,
            scratch: HostBuffer::pinned(&self.ctx, 64)?,
            wb: WriteBackEvent::new(&self.ctx)?,
            memops: true,
            batch_copies: crate::cuda_batch::batch_copies_from_env(),
            batch: Batch::default(),
            defer,
            relaxed: false,
            deferred,
            device: self.ctx.ordinal() as i32,
            timeout: self.timeout,
        }))
    }

    unsafe fn read(&self, src: Loc, out: &mut [u8]) -> Result<(), EmuError> {
        match src {
            Loc::Host(a) => {
                // SAFETY: the caller guarantees the source range.
                unsafe { std::ptr::copy(a as *const u8, out.as_mut_ptr(), out.len()) };
                Ok(())
            }
            Loc::Device(a) => {
                let ctrl = self.ctrl.lock().expect("ctrl lock");
                let mut done = 0usize;
                while done < out.len() {
                    let n = (out.len() - done).min(STAGING_BYTES);
                    // SAFETY: the caller guarantees the device range; the staging buffer is
                    // pinned, at least `n` bytes, and only used under this lock.
                    check("cuMemcpyDtoHAsync", unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            ctrl.staging.addr() as *mut c_void,
                            a + done as u64,
                            n,
                            ctrl.stream.raw,
                        )
                    })?;
                    ctrl.stream.wait(self.timeout, "a read of GPU memory")?;
                    ctrl.staging.read(0, &mut out[done..done + n]);
                    done += n;
                }
                Ok(())
            }
        }
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuffer, EmuError> {
        HostBuffer::pinned(&self.ctx, len)
    }

    fn supports_device(&self) -> bool {
        true
    }

    fn bind_thread(&self) -> Result<(), EmuError> {
        self.ctx
            .bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))
    }
}

#[derive(Debug, Clone, Copy)]
struct Event(sys::CUevent);

// SAFETY: CUevent handles may be recorded and queried from any thread with the context current.
unsafe impl Send for Event {}

/// One QP's stream, and what the QP has asked of it since the last submission.
#[derive(Debug)]
struct CudaLane {
    stream: Stream,
    /// Recorded events, each with the highest mark it covers.
    events: VecDeque<(u64, Event)>,
    free: Vec<Event>,
    /// The last mark handed out. Marks are lazy: one event, recorded at the next submission,
    /// covers every mark handed out before it.
    next_mark: u64,
    /// The highest mark an event has been recorded for.
    recorded_upto: u64,
    landed_upto: u64,
    /// Pinned bytes for the synchronous atomic path: [0, 8) the old value.
    scratch: HostBuffer,
    /// Recorded after each atomic's write-back (see [`crate::cuda_atomic`]).
    wb: Arc<WriteBackEvent>,
    /// Whether stream memory operations (word stores) work here (cleared after the first
    /// failure: words are then copied).
    memops: bool,
    /// Whether `cuMemcpyBatchAsync` works here (cleared after the first failure).
    batch_copies: bool,
    /// Copies and word stores not yet submitted ([`crate::cuda_batch`]).
    batch: Batch,
    /// Atomics on GPU memory gathered into groups the host computes later
    /// ([`crate::cuda_deferred`]); `None` when its pinned memory could not be had.
    deferred: Option<Deferred>,
    /// Whether new atomics may be deferred (cleared when the driver refuses stream waits).
    defer: bool,
    /// Strict mode's relaxed ordering: a write after an atomic may land before it (unless the
    /// engine puts a [`barrier`](Lane::barrier) between them for a fence), so writes do not
    /// close the open group of deferred atomics.
    relaxed: bool,
    device: i32,
    timeout: Duration,
}

impl CudaLane {
    fn recycle_all(&mut self) {
        self.landed_upto = self.recorded_upto;
        while let Some((_, e)) = self.events.pop_front() {
            self.free.push(e);
        }
    }

    /// Submits the gathered copies and word stores.
    fn submit_batch(&mut self) -> Result<(), EmuError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        // SAFETY: every range in the batch was checked by the engine against live registrations
        // (or is a CQ slot validated at QP creation); the stream is live and its context current.
        unsafe {
            self.batch.submit(
                self.stream.raw,
                self.device,
                &mut self.batch_copies,
                &mut self.memops,
            )
        }
    }

    /// Enqueues the open group of deferred atomics, if any, behind the gathered writes: those
    /// that came before its atomics must land first, and those that came after them (relaxed
    /// ordering only; in order a write closes the group before it joins) may.
    fn close_group(&mut self) -> Result<(), EmuError> {
        if !self.deferred.as_ref().is_some_and(Deferred::is_open) {
            return Ok(());
        }
        self.submit_batch()?;
        let d = self.deferred.as_mut().expect("open above");
        // SAFETY: the group's words and results were checked against live registrations; the
        // stream is live and its context current.
        let ok = unsafe { d.close(self.stream.raw, &mut self.batch_copies, self.timeout)? };
        if !ok {
            self.defer = false;
        }
        Ok(())
    }

    /// Everything gathered enqueued, and an event recorded for the marks handed out.
    fn submit_all(&mut self) -> Result<(), EmuError> {
        self.close_group()?;
        self.submit_batch()?;
        if self.next_mark > self.recorded_upto {
            self.record(self.next_mark)?;
        }
        Ok(())
    }

    /// Records an event covering marks up to `seq`.
    fn record(&mut self, seq: u64) -> Result<(), EmuError> {
        let ev = match self.free.pop() {
            Some(e) => e,
            None => {
                let mut raw: sys::CUevent = std::ptr::null_mut();
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                // SAFETY: valid out-pointer; the context is current on this thread.
                check("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut raw, flags)
                })?;
                Event(raw)
            }
        };
        // SAFETY: a live event and a live stream of the same context.
        if let Err(e) = check("cuEventRecord", unsafe {
            sys::cuEventRecord(ev.0, self.stream.raw)
        }) {
            self.free.push(ev);
            return Err(e);
        }
        self.recorded_upto = seq;
        self.events.push_back((seq, ev));
        Ok(())
    }

    /// Everything enqueued and every deferred atomic computed (bounded), so that a wait on the
    /// stream cannot wait for this thread.
    fn settle(&mut self, timeout: Duration) -> Result<(), EmuError> {
        self.submit_all()?;
        if let Some(d) = self.deferred.as_mut() {
            d.settle(timeout)?;
        }
        Ok(())
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        if self.stream.ctx.bind_to_thread().is_ok() {
            if self.settle(Duration::from_secs(5)).is_err() {
                if let Some(d) = self.deferred.as_mut() {
                    d.release_all();
                }
            }
            let _ = self.stream.wait(Duration::from_secs(5), "lane teardown");
            for (_, e) in self
                .events
                .drain(..)
                .chain(self.free.drain(..).map(|e| (0, e)))
            {
                // SAFETY: each event was created by this lane and is destroyed once, here.
                let _ = unsafe { sys::cuEventDestroy_v2(e.0) };
            }
        }
    }
}

impl Lane for CudaLane {
    unsafe fn copy(&mut self, dst: Loc, src: Loc, len: u64) -> Result<(), EmuError> {
        let n = len as usize;
        let s = self.stream.raw;
        match (dst, src) {
            (Loc::Host(d), Loc::Host(sa)) => {
                self.fence(self.timeout)?;
                // SAFETY: the caller guarantees both ranges; earlier work has landed.
                unsafe { std::ptr::copy(sa as *const u8, d as *mut u8, n) };
                Ok(())
            }
            (Loc::Device(d), Loc::Device(sa)) => {
                // In order, a write after an atomic lands after it; a dependent copy closes the
                // batch either way.
                if !self.relaxed {
                    self.close_group()?;
                }
                if !self.batch.admits_copy(d, sa, len) {
                    self.submit_batch()?;
                }
                self.batch.push_copy(d, sa, len);
                Ok(())
            }
            (Loc::Device(d), Loc::Host(sa)) => {
                // Host sources may be pageable: one ordered call, behind what was gathered.
                self.close_group()?;
                self.submit_batch()?;
                // SAFETY: the caller guarantees both ranges until the copy lands.
                check("cuMemcpyHtoDAsync", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(d, sa as *const c_void, n, s)
                })
            }
            (Loc::Host(d), Loc::Device(sa)) => {
                self.close_group()?;
                self.submit_batch()?;
                // SAFETY: as above.
                check("cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(d as *mut c_void, sa, n, s)
                })
            }
        }
    }

    unsafe fn put(&mut self, dst: Loc, bytes: &[u8]) -> Result<(), EmuError> {
        match dst {
            Loc::Host(d) => {
                self.fence(self.timeout)?;
                // SAFETY: the caller guarantees the range; earlier work has landed.
                unsafe { std::ptr::copy(bytes.as_ptr(), d as *mut u8, bytes.len()) };
                Ok(())
            }
            Loc::Device(d) => {
                if !self.relaxed {
                    self.close_group()?;
                }
                let len = bytes.len() as u64;
                if self.memops {
                    // Inline data and atomic replies: stream stores, no staging, gathered.
                    if let Some(words) = words_of(d, bytes) {
                        if !self.batch.admits_words(d, len, words.len()) {
                            self.submit_batch()?;
                        }
                        self.batch.push_words(d, len, words);
                        return Ok(());
                    }
                }
                self.close_group()?;
                self.submit_batch()?;
                // SAFETY: the caller guarantees the range. From pageable memory the driver
                // stages the bytes before returning, so `bytes` need not outlive the call.
                check("cuMemcpyHtoDAsync", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        d,
                        bytes.as_ptr() as *const c_void,
                        bytes.len(),
                        self.stream.raw,
                    )
                })
            }
        }
    }

    unsafe fn atomic(
        &mut self,
        target: Loc,
        op: AtomicOp,
        timeout: Duration,
    ) -> Result<u64, EmuError> {
        match target {
            Loc::Host(a) => {
                self.fence(timeout)?;
                // SAFETY: the caller guarantees an aligned, writable word; earlier writes landed.
                Ok(unsafe { host_atomic(a, op) })
            }
            Loc::Device(a) => {
                // The read below waits for the stream: nothing may be left for this thread.
                self.settle(timeout)?;
                let stream = self.stream.raw;
                let s = &self.stream;
                let mut drain = || s.wait(timeout, "the read of an atomic");
                // SAFETY: the caller guarantees an aligned, writable device word; the stream is
                // live and its context current (the NIC binds its thread); the scratch is this
                // lane's.
                let old = unsafe {
                    atomic_on_device(
                        stream,
                        &mut drain,
                        &self.scratch,
                        &self.wb,
                        &mut self.memops,
                        a,
                        op,
                    )?
                };
                // Everything recorded so far preceded the read, which has completed; the
                // write-back, if any, follows.
                self.recycle_all();
                Ok(old)
            }
        }
    }

    unsafe fn atomic_into(
        &mut self,
        target: Loc,
        op: AtomicOp,
        result: Loc,
        order: FetchOrder,
        timeout: Duration,
    ) -> Result<(), EmuError> {
        let Loc::Device(a) = target else {
            // SAFETY: forwarded from the caller.
            return unsafe { atomic_then_put(self, target, op, result, order, timeout) };
        };
        if !(self.defer && self.memops && self.deferred.is_some()) {
            // SAFETY: forwarded from the caller.
            return unsafe { atomic_then_put(self, target, op, result, order, timeout) };
        }
        // The QP's earlier writes are submitted before the group (`close_group`), so a round's
        // atomics share one group even with writes between them (relaxed ordering).
        loop {
            let d = self.deferred.as_mut().expect("checked above");
            match d.add(a, op, result, order, timeout)? {
                Added::Joined => return Ok(()),
                Added::CloseFirst => self.close_group()?,
            }
        }
    }

    unsafe fn put_cqe(&mut self, dst: Loc, cqe: &[u8; 64]) -> Result<(), EmuError> {
        match dst {
            Loc::Host(a) => {
                self.fence(self.timeout)?;
                // SAFETY: the caller guarantees an aligned slot; the data before it landed.
                unsafe { store_cqe_host(a, cqe) };
                Ok(())
            }
            Loc::Device(a) => {
                // Eight stores behind the data (the first with a memory barrier), the owner
                // word last (with another); copies when stream stores are refused.
                self.close_group()?;
                if !self.batch.admits_words(a, 64, 8) {
                    self.submit_batch()?;
                }
                self.batch.push_words(a, 64, cqe_words(a, cqe));
                Ok(())
            }
        }
    }

    fn cqe_in_order(&self, dst: Loc) -> bool {
        !dst.is_host()
    }

    fn mark(&mut self) -> Result<Mark, EmuError> {
        self.next_mark += 1;
        Ok(Mark(self.next_mark))
    }

    fn landed(&mut self, mark: Mark) -> Result<bool, EmuError> {
        while mark.0 > self.landed_upto {
            let Some(&(seq, ev)) = self.events.front() else {
                break;
            };
            // SAFETY: a live, recorded event.
            match unsafe { sys::cuEventQuery(ev.0) } {
                sys::cudaError_enum::CUDA_SUCCESS => {
                    self.landed_upto = seq;
                    self.events.pop_front();
                    self.free.push(ev);
                }
                sys::cudaError_enum::CUDA_ERROR_NOT_READY => break,
                e => {
                    return Err(EmuError::Cuda {
                        call: "cuEventQuery",
                        source: DriverError(e),
                    })
                }
            }
        }
        Ok(mark.0 <= self.landed_upto)
    }

    fn fence(&mut self, timeout: Duration) -> Result<(), EmuError> {
        self.settle(timeout)?;
        self.stream.wait(timeout, "a QP's stream to drain")?;
        if let Some(d) = self.deferred.as_mut() {
            d.poll()?;
        }
        self.recycle_all();
        Ok(())
    }

    fn flush(&mut self) -> Result<(), EmuError> {
        self.submit_all()
    }

    fn order_point(&mut self) -> Result<(), EmuError> {
        self.submit_batch()
    }

    fn barrier(&mut self) -> Result<(), EmuError> {
        self.close_group()?;
        self.submit_batch()
    }

    fn set_relaxed(&mut self, relaxed: bool) {
        self.relaxed = relaxed;
    }

    fn poll(&mut self) -> Result<bool, EmuError> {
        match self.deferred.as_mut() {
            Some(d) => d.poll(),
            None => Ok(false),
        }
    }

    fn busy(&self) -> bool {
        self.deferred.as_ref().is_some_and(Deferred::busy)
    }

    fn describe(&self) -> String {
        format!(
            "copy-engine lane: marks {} (recorded up to {}, landed up to {}), events {}, \
             deferred atomics owed {}",
            self.next_mark,
            self.recorded_upto,
            self.landed_upto,
            self.events.len(),
            self.deferred.as_ref().is_some_and(Deferred::busy),
        )
    }
}
