//! The emulated GDR view: a CPU-side mirror of a small range of GPU memory (the producer slots
//! of mode `cpu`), refreshed by copy-engine reads, for machines without GDRCopy whose NIC is
//! emulated.
//!
//! # What it emulates
//!
//! Mode `cpu` keeps each QP's producer slot in GPU memory: the GPU raises it with system-scope
//! stores and atomics, and the proxy polls it. On real hardware the proxy reads it through a
//! GDRCopy mapping (a BAR1 window: each CPU load is an uncached PCIe read of GPU memory). Here
//! the slots are the same GPU memory, written by the same device code; only the CPU's read path
//! differs. A pump thread copies the range into pinned staging memory with
//! `cuMemcpyDtoHAsync` on a stream of the caller's (a copy engine, no SM), waits for the copy
//! with a time bound, and publishes each 8-byte word into the mirror with one atomic store. The
//! proxy reads the mirror with ordinary 8-byte loads, as it reads a GDRCopy mapping.
//!
//! What holds, as with GDRCopy: the proxy sees a value only after the GPU wrote it (the copy
//! reads GPU memory after the GPU's system-scope store), each 8-byte word whole (the copy engine
//! reads an aligned word in one piece and the pump publishes it with one store), and a word's
//! successive values in the order the GPU wrote them (copies run one after another on one
//! stream). The slots' own rule, that they only grow, is kept by the device code, not here.
//!
//! What it cannot emulate: the latency (a copy round trip, several microseconds, instead of a
//! PCIe read of about one); BAR1 limits and `gdr_pin_buffer`'s failures; CPU writes into GPU
//! memory through the mapping (the mirror is read-only: stores to it never reach the GPU, so
//! this type offers no writes); the mapping's attributes (uncached, write-combining) and
//! their ordering effects. A proxy that works here can still fail where GDRCopy itself does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::error::{GdrError, Result};
use crate::host::HostMapping;
use crate::view::CpuView;

/// How the pump runs.
#[derive(Clone, Debug)]
pub struct MirrorConfig {
    /// Longest wait for one copy before the pump gives up (the error stays readable through
    /// [`CopyMirror::error`], and the mirror stops changing).
    pub copy_bound: Duration,
    /// After this long without a change, the pump sleeps [`MirrorConfig::idle_sleep`] between
    /// copies (until the next change).
    pub idle_after: Duration,
    /// The pause between copies once idle.
    pub idle_sleep: Duration,
    /// Thread name.
    pub name: String,
}

impl Default for MirrorConfig {
    fn default() -> Self {
        Self {
            copy_bound: Duration::from_secs(5),
            idle_after: Duration::from_millis(2),
            idle_sleep: Duration::from_micros(20),
            name: "ibgda-gdr-mirror".into(),
        }
    }
}

struct Shared {
    words: Box<[AtomicU64]>,
    stop: AtomicBool,
    error: Mutex<Option<String>>,
    copies: AtomicU64,
}

/// A read-only CPU mirror of `len` bytes of GPU memory, kept current by a pump thread (see the
/// module docs). Dropping it stops the pump (bounded by one copy's bound).
pub struct CopyMirror {
    shared: Arc<Shared>,
    dptr: u64,
    len: usize,
    pump: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CopyMirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyMirror")
            .field("device", &format_args!("{:#x}", self.dptr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The stream handle, moved into the pump thread.
struct StreamHandle(Arc<CudaStream>);

// SAFETY: a CUDA stream may be used from any thread once its context is current there (the pump
// binds it first); cudarc's CudaStream is only not Send because it holds a raw handle.
unsafe impl Send for StreamHandle {}

/// The GPU range, moved into the pump thread.
#[derive(Clone, Copy)]
struct DeviceRange {
    dptr: u64,
    len: usize,
}

impl CopyMirror {
    /// Starts mirroring `len` bytes (a multiple of 8, at most 64 KiB) of `ctx`'s GPU memory at
    /// `dptr` (8-byte aligned), copied on `stream`, which should be a stream that never waits
    /// behind spinning kernels (a service stream of `ibgda_device::stream_pool`).
    ///
    /// # Safety
    ///
    /// `dptr .. dptr + len` is GPU memory of `ctx` that stays allocated until the mirror is
    /// dropped.
    pub unsafe fn new(
        ctx: &Arc<CudaContext>,
        stream: Arc<CudaStream>,
        dptr: u64,
        len: usize,
        cfg: MirrorConfig,
    ) -> Result<Self> {
        if len == 0 {
            return Err(GdrError::Empty);
        }
        if len % 8 != 0 || dptr % 8 != 0 || len > 64 << 10 {
            return Err(GdrError::Cuda {
                call: "CopyMirror::new",
                code: 1,
                text: format!(
                    "{len} bytes at {dptr:#x}: the mirror takes an 8-byte aligned range of whole \
                     8-byte words, at most 64 KiB"
                ),
            });
        }
        let staging = HostMapping::new(ctx, len)?;
        let shared = Arc::new(Shared {
            words: (0..len / 8).map(|_| AtomicU64::new(0)).collect(),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            copies: AtomicU64::new(0),
        });
        // The first copy before anyone reads: the mirror starts equal to the GPU memory.
        let range = DeviceRange { dptr, len };
        copy_once(ctx, &stream, range, &staging, cfg.copy_bound)?;
        publish(&shared, &staging);
        let (sh, c, ctx2) = (shared.clone(), cfg.clone(), ctx.clone());
        let stream = StreamHandle(stream);
        let pump = std::thread::Builder::new()
            .name(cfg.name.clone())
            .spawn(move || {
                let stream = stream;
                pump(&sh, &ctx2, &stream.0, range, &staging, &c)
            })
            .map_err(|e| GdrError::Cuda {
                call: "std::thread::spawn",
                code: e.raw_os_error().unwrap_or(0) as u32,
                text: e.to_string(),
            })?;
        tracing::debug!(
            target: "ibgda",
            "emulated GDR view: {len} bytes of GPU memory at {dptr:#x} mirrored by copy-engine reads"
        );
        Ok(Self {
            shared,
            dptr,
            len,
            pump: Some(pump),
        })
    }

    /// CPU address of the mirror's first byte: 8-byte words that only the pump stores (each
    /// with one atomic store). Read it with 8-byte loads; never write it.
    pub fn cpu_ptr(&self) -> *const u8 {
        self.shared.words.as_ptr().cast()
    }

    /// GPU address of the mirrored range.
    pub fn device_ptr(&self) -> u64 {
        self.dptr
    }

    /// Bytes mirrored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mirror is empty (never: `new` refuses an empty range).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The word at byte `offset` as last copied (acquire).
    ///
    /// # Panics
    /// If `offset` is not a multiple of 8 inside the range.
    pub fn read_u64(&self, offset: usize) -> u64 {
        assert!(
            offset % 8 == 0 && offset < self.len,
            "u64 at {offset} in {}",
            self.len
        );
        self.shared.words[offset / 8].load(Ordering::Acquire)
    }

    /// Copies completed so far (the first one in `new` included).
    pub fn copies(&self) -> u64 {
        self.shared.copies.load(Ordering::Relaxed)
    }

    /// Why the pump stopped, if it did (a copy that failed or ran past its bound).
    pub fn error(&self) -> Option<String> {
        self.shared
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for CopyMirror {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.pump.take() {
            // Bounded: the pump checks `stop` between copies, and a copy waits at most its bound.
            if h.join().is_err() {
                tracing::error!(target: "ibgda", "emulated GDR view: the pump thread panicked");
            }
        }
    }
}

/// Publishes the staging copy into the mirror, a word at a time.
fn publish(shared: &Shared, staging: &HostMapping) -> bool {
    let mut changed = false;
    for (i, w) in shared.words.iter().enumerate() {
        let v = staging.read_u64(8 * i);
        if w.load(Ordering::Relaxed) != v {
            w.store(v, Ordering::Release);
            changed = true;
        }
    }
    shared.copies.fetch_add(1, Ordering::Relaxed);
    changed
}

/// One copy of the range into `staging`, waited for at most `bound`.
fn copy_once(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    range: DeviceRange,
    staging: &HostMapping,
    bound: Duration,
) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| GdrError::Cuda {
        call: "cuCtxSetCurrent",
        code: e.0 as u32,
        text: e.to_string(),
    })?;
    let cuda = |call: &'static str, r: sys::CUresult| {
        r.result().map_err(|e| GdrError::Cuda {
            call,
            code: e.0 as u32,
            text: e.to_string(),
        })
    };
    // SAFETY: the staging buffer is pinned and `len` bytes; the device range is live (`new`'s
    // contract); the stream belongs to the bound context.
    cuda("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            staging.cpu_ptr().cast(),
            range.dptr,
            range.len,
            stream.cu_stream(),
        )
    })?;
    let start = Instant::now();
    loop {
        // SAFETY: a live stream of the bound context.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            e => return cuda("cuStreamQuery", e),
        }
        if start.elapsed() > bound {
            return Err(GdrError::Cuda {
                call: "cuStreamQuery",
                code: sys::CUresult::CUDA_ERROR_NOT_READY as u32,
                text: format!(
                    "a {}-byte copy of GPU memory at {:#x} did not finish within {bound:?}",
                    range.len, range.dptr
                ),
            });
        }
        std::hint::spin_loop();
    }
}

fn pump(
    shared: &Shared,
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    range: DeviceRange,
    staging: &HostMapping,
    cfg: &MirrorConfig,
) {
    let mut last_change = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        if let Err(e) = copy_once(ctx, stream, range, staging, cfg.copy_bound) {
            tracing::error!(target: "ibgda", "emulated GDR view stopped: {e}");
            *shared.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            return;
        }
        if publish(shared, staging) {
            last_change = Instant::now();
        } else if last_change.elapsed() >= cfg.idle_after {
            std::thread::sleep(cfg.idle_sleep);
        }
    }
}
