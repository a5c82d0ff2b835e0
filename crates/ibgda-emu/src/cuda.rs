//! The CUDA backend: data moved by copy engines (peer copies between GPUs of a host) on one
//! non-blocking stream per QP, CQEs written by stream memory operations behind the data, and no
//! kernel launches anywhere, so the emulator progresses even when kernels fill every SM.
//!
//! Atomics on GPU memory are a read (device to pinned host), a compute on the host and a write
//! back, on the QP's stream after its earlier writes ([`crate::cuda_atomic`]: no process-wide
//! lock, and only the read is waited for). See the crate docs for the atomicity this gives.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, DriverError};

use crate::backend::{AtomicOp, Lane, Loc, Mark, MemoryBackend};
use crate::cuda_atomic::{atomic_on_device, is_word, store_word, WriteBackEvent};
use crate::error::EmuError;
use crate::host::{host_atomic, store_cqe_host, HostBuffer};

/// Bytes of the pinned staging buffer for synchronous reads of GPU memory (ring slots, doorbell
/// words); larger reads go in pieces.
const STAGING_BYTES: usize = 64 << 10;

fn check(call: &'static str, r: sys::CUresult) -> Result<(), EmuError> {
    r.result().map_err(EmuError::cuda(call))
}

/// A non-blocking stream (never synchronises with the legacy default stream, so a kernel that
/// spins on another stream cannot hold the emulator's copies back).
#[derive(Debug)]
struct Stream {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream may be used from any thread once its context is current, which every user
// of this type makes sure of (the NIC binds its thread; API calls bind first).
unsafe impl Send for Stream {}

impl Stream {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        ctx.bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, flags)
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Waits until everything enqueued has completed, polling so that the wait is bounded.
    fn wait(&self, timeout: Duration, what: &'static str) -> Result<(), EmuError> {
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
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.wait(Duration::from_secs(5), "stream teardown");
            // SAFETY: `raw` was created in `new` and is destroyed once, here.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
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
}

impl CudaMemory {
    /// A backend on `ctx`'s GPU, with a 10 s bound on its waits.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, EmuError> {
        Self::with_timeout(ctx, Duration::from_secs(10))
    }

    /// A backend whose waits (ring reads, atomics, fences) give up after `timeout`.
    pub fn with_timeout(ctx: &Arc<CudaContext>, timeout: Duration) -> Result<Self, EmuError> {
        let stream = Stream::new(ctx)?;
        let staging = HostBuffer::pinned(ctx, STAGING_BYTES)?;
        Ok(Self {
            ctx: ctx.clone(),
            ctrl: Mutex::new(Ctrl { stream, staging }),
            timeout,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl MemoryBackend for CudaMemory {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn new_lane(&self) -> Result<Box<dyn Lane>, EmuError> {
        Ok(Box::new(CudaLane {
            stream: Stream::new(&self.ctx)?,
            events: VecDeque::new(),
            free: Vec::new(),
            next_mark: 0,
            landed_upto: 0,
            scratch: HostBuffer::pinned(&self.ctx, 64)?,
            wb: WriteBackEvent::new(&self.ctx)?,
            memops: true,
            memop_stores: true,
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

/// One QP's stream.
#[derive(Debug)]
struct CudaLane {
    stream: Stream,
    events: VecDeque<(u64, Event)>,
    free: Vec<Event>,
    next_mark: u64,
    landed_upto: u64,
    /// Pinned bytes for atomics: [0, 8) the old value.
    scratch: HostBuffer,
    /// Recorded after each atomic's write-back (see [`crate::cuda_atomic`]).
    wb: Arc<WriteBackEvent>,
    /// Whether stream batch memory operations work here (cleared after the first failure).
    memops: bool,
    /// Whether single-word stream stores work here, for words and write-backs (cleared after the
    /// first failure).
    memop_stores: bool,
    timeout: Duration,
}

impl CudaLane {
    fn recycle_all(&mut self) {
        self.landed_upto = self.next_mark;
        while let Some((_, e)) = self.events.pop_front() {
            self.free.push(e);
        }
    }

    /// Writes a CQE with 8 stream writes of 8 bytes, in order: the owner byte's word last.
    ///
    /// # Safety
    /// `a` must be a valid, 8-byte aligned, 64-byte device slot.
    unsafe fn cqe_memops(&mut self, a: u64, cqe: &[u8; 64]) -> Result<(), EmuError> {
        // The parameter blocks are built from literals: `mem::zeroed` is not valid for them
        // (their `operation` enum has no zero variant).
        let mut params = [sys::CUstreamBatchMemOpParams { pad: [0; 6] }; 8];
        for (i, p) in params.iter_mut().enumerate() {
            let word = u64::from_ne_bytes(cqe[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            p.writeValue = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st {
                operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64,
                address: a + 8 * i as u64,
                __bindgen_anon_1:
                    sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 {
                        value64: word,
                    },
                flags: 0,
                alias: 0,
            };
        }
        // SAFETY: the parameters describe 8 aligned writes inside the slot the caller vouched for.
        let r = unsafe { sys::cuStreamBatchMemOp_v2(self.stream.raw, 8, params.as_mut_ptr(), 0) };
        check("cuStreamBatchMemOp", r)
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        if self.stream.ctx.bind_to_thread().is_ok() {
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
            // SAFETY: the caller guarantees both ranges until the copy lands.
            (Loc::Device(d), Loc::Host(sa)) => check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(d, sa as *const c_void, n, s)
            }),
            // SAFETY: as above.
            (Loc::Host(d), Loc::Device(sa)) => check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(d as *mut c_void, sa, n, s)
            }),
            (Loc::Device(d), Loc::Device(sa)) => {
                // SAFETY: as above; unified addressing routes peer copies over NVLink.
                let r = unsafe { sys::cuMemcpyAsync(d, sa, n, s) };
                check("cuMemcpyAsync", r)
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
                if self.memop_stores && is_word(d, bytes.len()) {
                    // An aligned 4- or 8-byte word (inline signals, atomic replies): one stream
                    // store instead of a staged copy.
                    // SAFETY: the caller guarantees the range; the stream is live.
                    match unsafe { store_word(self.stream.raw, d, bytes) } {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            tracing::warn!("word stores fall back to copies: {e}");
                            self.memop_stores = false;
                        }
                    }
                }
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
                        &mut self.memop_stores,
                        a,
                        op,
                    )?
                };
                // Everything marked so far preceded the read, which has completed; the
                // write-back, if any, follows every mark taken so far.
                self.recycle_all();
                Ok(old)
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
                if self.memops {
                    // SAFETY: the caller guarantees an aligned device slot.
                    match unsafe { self.cqe_memops(a, cqe) } {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            tracing::warn!("stream memory operations unavailable, CQEs fall back to two ordered copies: {e}");
                            self.memops = false;
                        }
                    }
                }
                // Two stream-ordered copies: the body, then the last 8 bytes with the owner bit.
                // SAFETY: the caller guarantees the slot; pageable sources are staged at once.
                unsafe {
                    check(
                        "cuMemcpyHtoDAsync",
                        sys::cuMemcpyHtoDAsync_v2(
                            a,
                            cqe.as_ptr() as *const c_void,
                            56,
                            self.stream.raw,
                        ),
                    )?;
                    check(
                        "cuMemcpyHtoDAsync",
                        sys::cuMemcpyHtoDAsync_v2(
                            a + 56,
                            cqe[56..].as_ptr() as *const c_void,
                            8,
                            self.stream.raw,
                        ),
                    )
                }
            }
        }
    }

    fn cqe_in_order(&self, dst: Loc) -> bool {
        !dst.is_host()
    }

    fn mark(&mut self) -> Result<Mark, EmuError> {
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
        self.next_mark += 1;
        self.events.push_back((self.next_mark, ev));
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
        self.stream.wait(timeout, "a QP's stream to drain")?;
        self.recycle_all();
        Ok(())
    }
}
