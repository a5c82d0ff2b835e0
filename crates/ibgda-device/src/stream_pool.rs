//! Streams on hardware queues of their own, so that a kernel which spins never holds back work
//! it is waiting for.
//!
//! A GPU takes a context's stream work through a fixed number of hardware queues
//! (`CUDA_DEVICE_MAX_CONNECTIONS`: 8 unless set, at most 32), and the driver gives each new
//! stream the next queue, round robin, counting every stream the context ever created. Work of
//! two streams on one queue is taken in one order: whatever is queued behind a running kernel
//! waits for that kernel. For ordinary work that is only a delay; for a kernel that spins until
//! other stream work lands, it is a deadlock. Seen on an H200 on 2026-12-02, with ranks as
//! threads sharing the GPU and the emulated NIC: both NIC threads were stuck in a copy on their
//! QP's stream while both ranks' send kernels spun in quiet, waiting for the completions those
//! copies precede; it came and went with how many streams the process had created before.
//!
//! The pool creates one stream per queue, one after another, the first time a context asks, so
//! its streams sit on distinct queues whatever was created before, and it never destroys them.
//! - A **waiting** stream ([`waiting`]) carries kernels that spin for other ranks or for the NIC.
//!   It is leased exclusively: no other stream of this pool shares its queue while the
//!   [`StreamLease`] lives.
//! - **Service** streams ([`service`]) carry work that never spins: the emulated NIC's copies and
//!   stream memory operations, host transfers. They share the queues kept for them
//!   ([`SERVICE_SHARE`] of the total).
//!
//! When the waiting queues are all leased, [`waiting`] falls back to a fresh stream and says so
//! once in the log: it may then share a queue again (raise `CUDA_DEVICE_MAX_CONNECTIONS`). A
//! stream created outside the pool after it (another library's) lands on one of its queues; that
//! can delay such work behind a waiting kernel, never the pool's own service work.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};

use crate::cuda::CudaError;

/// The environment variable the CUDA driver reads, at context creation, for the number of
/// hardware queues.
pub const MAX_CONNECTIONS_ENV: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// Hardware queues when [`MAX_CONNECTIONS_ENV`] is unset (the driver's default).
pub const DEFAULT_QUEUES: usize = 8;

/// The most hardware queues the driver gives a context.
pub const MAX_QUEUES: usize = 32;

/// One queue in this many is kept for service streams (at least one): 8 of 32, 2 of 8. The
/// emulated NIC's lanes share them; the rest are leased one to a waiting stream (a rank's
/// low-latency stream, an intranode buffer's communication and compute streams), so 24 of 32
/// cover eight ranks with both kinds of buffer on one GPU.
pub const SERVICE_SHARE: usize = 4;

/// The number of hardware queues this process's contexts have: [`MAX_CONNECTIONS_ENV`] when it
/// holds a number (clamped to 1..=[`MAX_QUEUES`]), else [`DEFAULT_QUEUES`].
///
/// ```
/// let q = ibgda_device::stream_pool::queues();
/// assert!((1..=32).contains(&q));
/// ```
pub fn queues() -> usize {
    std::env::var(MAX_CONNECTIONS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(DEFAULT_QUEUES, |q| q.clamp(1, MAX_QUEUES))
}

/// How `queues` hardware queues are split: (waiting, service).
///
/// ```
/// use ibgda_device::stream_pool::split;
/// assert_eq!(split(32), (24, 8));
/// assert_eq!(split(8), (6, 2));
/// assert_eq!(split(1), (0, 1));
/// ```
pub fn split(queues: usize) -> (usize, usize) {
    let service = (queues / SERVICE_SHARE).max(1).min(queues);
    (queues - service, service)
}

/// One context's pooled streams.
struct Pool {
    ctx: Arc<CudaContext>,
    /// Raw streams, one per queue, created consecutively and never destroyed.
    streams: Vec<usize>,
    /// Indices (into `streams`) of the waiting streams not leased now.
    free_waiting: Mutex<Vec<usize>>,
    /// First service index; service streams are `streams[first_service..]`.
    first_service: usize,
    next_service: AtomicUsize,
    warned: AtomicBool,
}

impl Pool {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let q = queues();
        let (waiting, _) = split(q);
        ctx.bind_to_thread().map_err(|source| CudaError::Driver {
            call: "cuCtxSetCurrent",
            source,
        })?;
        let mut streams = Vec::with_capacity(q);
        for _ in 0..q {
            let mut raw: sys::CUstream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: a valid out-pointer; the context is current on this thread.
            let r = unsafe { sys::cuStreamCreate(&mut raw, flags) };
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                return Err(CudaError::Driver {
                    call: "cuStreamCreate (stream pool)",
                    source: DriverError(r),
                });
            }
            streams.push(raw as usize);
        }
        tracing::debug!(
            target: "ibgda",
            "stream pool on GPU {}: {q} hardware queues, {waiting} for waiting streams",
            ctx.ordinal()
        );
        Ok(Self {
            ctx: ctx.clone(),
            streams,
            // Lease from the front.
            free_waiting: Mutex::new((0..waiting).rev().collect()),
            first_service: waiting,
            next_service: AtomicUsize::new(0),
            warned: AtomicBool::new(false),
        })
    }

    fn wrap(&self, i: usize) -> Arc<CudaStream> {
        // SAFETY: the stream belongs to this context and is never destroyed (the pool lives as
        // long as the process); work through the wrapper is ordered by its users, as for any
        // stream.
        unsafe {
            self.ctx
                .wrap_borrowed_stream(self.streams[i] as sys::CUstream)
        }
    }
}

// The pools of this process, by context handle. Never emptied: the streams live as long as the
// process, so no work of a destroyed buffer can find its stream gone.
static POOLS: Mutex<Vec<(usize, Arc<Pool>)>> = Mutex::new(Vec::new());

fn pool(ctx: &Arc<CudaContext>) -> Result<Arc<Pool>, CudaError> {
    let key = ctx.cu_ctx() as usize;
    let mut pools = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, p)) = pools.iter().find(|(k, _)| *k == key) {
        return Ok(p.clone());
    }
    let p = Arc::new(Pool::new(ctx)?);
    pools.push((key, p.clone()));
    Ok(p)
}

/// A waiting stream's hold on its queue: the queue goes back to the pool when this drops. Keep
/// it as long as the stream may carry work.
pub struct StreamLease {
    pool: Option<(Arc<Pool>, usize)>,
}

impl StreamLease {
    /// Whether the stream has a queue of its own (else it is a fresh stream of the fallback).
    pub fn is_exclusive(&self) -> bool {
        self.pool.is_some()
    }
}

impl std::fmt::Debug for StreamLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLease")
            .field("queue", &self.pool.as_ref().map(|(_, i)| *i))
            .finish()
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        if let Some((pool, i)) = self.pool.take() {
            pool.free_waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(i);
        }
    }
}

/// A stream for kernels that spin (for other ranks, or for the NIC), on a hardware queue that no
/// other stream of the pool uses while the lease lives. Falls back to a fresh stream (logged
/// once per context) when every waiting queue is leased.
///
/// ```no_run
/// let ctx = ibgda_device::cuda::context(0)?;
/// let (stream, lease) = ibgda_device::stream_pool::waiting(&ctx)?;
/// assert!(lease.is_exclusive());
/// # drop(stream);
/// # Ok::<(), ibgda_device::cuda::CudaError>(())
/// ```
pub fn waiting(ctx: &Arc<CudaContext>) -> Result<(Arc<CudaStream>, StreamLease), CudaError> {
    let p = pool(ctx)?;
    let slot = p
        .free_waiting
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop();
    match slot {
        Some(i) => Ok((p.wrap(i), StreamLease { pool: Some((p, i)) })),
        None => {
            if !p.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    target: "ibgda",
                    "GPU {}: all {} waiting hardware queues are leased; a new waiting stream may \
                     share a queue with other work (set {MAX_CONNECTIONS_ENV}=32 before the \
                     first CUDA call for more)",
                    ctx.ordinal(),
                    p.first_service
                );
            }
            let s = ctx.new_stream().map_err(|source| CudaError::Driver {
                call: "cuStreamCreate",
                source,
            })?;
            Ok((s, StreamLease { pool: None }))
        }
    }
}

/// A stream for work that never spins (copies, stream memory operations), on one of the queues
/// kept for such work, shared round robin. Never destroyed.
///
/// ```no_run
/// let ctx = ibgda_device::cuda::context(0)?;
/// let s = ibgda_device::stream_pool::service(&ctx)?;
/// # drop(s);
/// # Ok::<(), ibgda_device::cuda::CudaError>(())
/// ```
pub fn service(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>, CudaError> {
    let p = pool(ctx)?;
    let n = p.streams.len() - p.first_service;
    let i = p.first_service + p.next_service.fetch_add(1, Ordering::Relaxed) % n;
    Ok(p.wrap(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_split_keeps_a_service_queue_and_uses_every_queue() {
        for q in 1..=MAX_QUEUES {
            let (w, s) = split(q);
            assert!(s >= 1, "{q} queues: no service queue");
            assert_eq!(w + s, q, "{q} queues");
        }
        assert_eq!(
            split(32).0,
            24,
            "eight ranks × three waiting streams fit in 32 queues"
        );
    }
}
