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
//! `cuMemcpyDtoHAsync` (a copy engine, no SM), waits for the copy with a time bound, and
//! publishes each 8-byte word into the mirror with one atomic store. The proxy reads the mirror
//! with ordinary 8-byte loads, as it reads a GDRCopy mapping.
//!
//! # One pump per CUDA context
//!
//! The pump is shared: every mirror of a CUDA context is served by that context's hub
//! (`mirror_hub.rs`), one thread started by the context's first mirror and stopped (joined) when
//! its last mirror is dropped. A round of the hub issues one copy per mirror, all on one stream
//! (the stream given to the mirror that started the hub, or after a failure the next one to
//! join), waits once for the stream, then publishes every mirror. Rounds follow one another at
//! once while anything changes; after [`MirrorConfig::idle_after`] without a change they are
//! [`MirrorConfig::idle_sleep`] apart. Why one thread and not one per mirror: eight ranks as
//! threads on one H200, internode in mode `cpu` (two nodes of four), make 56 mirrors (one per QP
//! group, full mesh); with a pump thread each, the 56 threads' back-to-back
//! `cuMemcpyDtoHAsync`/`cuStreamQuery` calls held the driver's lock so often that the ranks'
//! `cuLaunchKernel` calls starved (a dump of the hung test showed all 56 pumps and all 8 ranks
//! waiting for that lock). The hub also gives the driver lock away while it waits: it spins only
//! briefly between stream queries, then yields.
//!
//! What holds, as with GDRCopy: the proxy sees a value only after the GPU wrote it (a copy reads
//! GPU memory after the GPU's system-scope store, and a round publishes only after its stream
//! has completed every copy of the round), each 8-byte word whole (the copy engine reads an
//! aligned word in one piece and the hub publishes it with one store), and a word's successive
//! values in the order the GPU wrote them (a mirror's copies never overlap: the first completes
//! in [`CopyMirror::new`] before the hub knows the mirror, and each round completes before the
//! next is issued). The slots' own rule, that they only grow, is kept by the device code, not
//! here. Once a mirror's drop has returned, the hub never copies its range again (the drop
//! removes the mirror under the lock a round holds).
//!
//! What it cannot emulate: the latency (a copy round trip, several microseconds, plus one small
//! copy per other mirror of the context in the same round, instead of a PCIe read of about
//! one); BAR1 limits and `gdr_pin_buffer`'s failures; CPU writes into GPU memory through the
//! mapping (the mirror is read-only: stores to it never reach the GPU, so this type offers no
//! writes); the mapping's attributes (uncached, write-combining) and their ordering effects. A
//! proxy that works here can still fail where GDRCopy itself does.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::error::{GdrError, Result};
use crate::host::HostMapping;
use crate::mirror_hub::{Engine, Entry, Registry, Shared, Ticket};
use crate::view::CpuView;

/// While a copy has been waited for less than this, the pump spins between stream queries;
/// after it, it yields its core between queries, so that other threads (the ranks launching
/// kernels) get the driver's lock between two of its queries.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(5);

/// `spin_loop` hints between two stream queries while spinning (a few hundred nanoseconds).
const SPINS_BETWEEN_QUERIES: u32 = 64;

/// How the pump runs.
///
/// A context's pump (its hub) is started by the first mirror of that context and runs with that
/// mirror's configuration until the last mirror of the context is dropped; later mirrors of the
/// same context join it and their configuration is not used.
#[derive(Clone, Debug)]
pub struct MirrorConfig {
    /// Longest wait for one round of copies before the pump gives up (the error stays readable
    /// through [`CopyMirror::error`] of every mirror of the round, and those mirrors stop
    /// changing). Also bounds the first copy, made by [`CopyMirror::new`].
    pub copy_bound: Duration,
    /// After this long without a change, the pump sleeps [`MirrorConfig::idle_sleep`] between
    /// rounds (until the next change).
    pub idle_after: Duration,
    /// The pause between rounds once idle.
    pub idle_sleep: Duration,
    /// Name of the pump thread (the kernel keeps its first 15 bytes).
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

/// Every context's hub in this process, keyed by the context's raw handle.
static HUBS: Registry<CudaEngine> = Registry::new();

/// A read-only CPU mirror of `len` bytes of GPU memory, kept current by its context's pump
/// thread (see the module docs). Dropping it takes it off the pump (bounded by one round's
/// bound); dropping the context's last mirror stops the pump.
pub struct CopyMirror {
    shared: Arc<Shared>,
    dptr: u64,
    len: usize,
    ticket: Option<Ticket>,
}

impl std::fmt::Debug for CopyMirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyMirror")
            .field("device", &format_args!("{:#x}", self.dptr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A mirrored GPU range.
#[derive(Clone, Copy, Debug)]
struct DeviceRange {
    dptr: u64,
    len: usize,
}

impl CopyMirror {
    /// Starts mirroring `len` bytes (a multiple of 8, at most 64 KiB) of `ctx`'s GPU memory at
    /// `dptr` (8-byte aligned). The first copy is made here, on `stream`, before this returns;
    /// later copies are made by the context's pump, on the stream of the mirror that started
    /// it. Either should be a stream that never waits behind spinning kernels (a service stream
    /// of `ibgda_device::stream_pool`).
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
        let shared = Arc::new(Shared::new(len / 8));
        // The first copy before anyone reads: the mirror starts equal to the GPU memory.
        let range = DeviceRange { dptr, len };
        bind(ctx)?;
        // SAFETY: the range is live GPU memory of `ctx` (this function's contract), `staging`
        // is `len` bytes of pinned memory, and `stream` belongs to `ctx`, bound just above.
        unsafe { issue(&stream, range, &staging) }?;
        if let Err(e) = wait(&stream, cfg.copy_bound, || describe(&[range])) {
            // The copy may still land: its staging must outlive it.
            std::mem::forget(staging);
            return Err(e);
        }
        shared.publish(|i| staging.read_u64(8 * i));
        let slot = CudaSlot {
            range,
            staging,
            stream,
        };
        let engine = || CudaEngine::new(ctx.clone(), cfg.copy_bound);
        let ticket = HUBS.register(ctx.cu_ctx() as usize, &cfg, engine, shared.clone(), slot)?;
        tracing::debug!(
            target: "ibgda",
            "emulated GDR view: {len} bytes of GPU memory at {dptr:#x} mirrored by copy-engine reads"
        );
        Ok(Self {
            shared,
            dptr,
            len,
            ticket: Some(ticket),
        })
    }

    /// CPU address of the mirror's first byte: 8-byte words that only the pump stores (each
    /// with one atomic store). Read it with 8-byte loads; never write it.
    pub fn cpu_ptr(&self) -> *const u8 {
        self.shared.words().as_ptr().cast()
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
        self.shared.words()[offset / 8].load(Ordering::Acquire)
    }

    /// Copies completed so far (the first one in `new` included).
    pub fn copies(&self) -> u64 {
        self.shared.copies()
    }

    /// Why the pump stopped following this mirror, if it did (a round of copies that failed or
    /// ran past its bound).
    pub fn error(&self) -> Option<String> {
        self.shared.error()
    }
}

impl Drop for CopyMirror {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            HUBS.unregister(ticket);
        }
    }
}

/// A mirror's part of its hub: the range, the staging it is copied into, and the stream it was
/// created with (the hub's stream if it is the first to join).
struct CudaSlot {
    range: DeviceRange,
    staging: HostMapping,
    stream: Arc<CudaStream>,
}

/// Staging that a copy may still write into, with the stream that copy runs on.
struct Grave {
    stream: Arc<CudaStream>,
    staging: Vec<HostMapping>,
}

/// A hub's CUDA side: copy-engine reads on one stream of its context.
struct CudaEngine {
    ctx: Arc<CudaContext>,
    /// The stream every round copies on (none after a failed round, until a mirror joins).
    stream: Option<Arc<CudaStream>>,
    copy_bound: Duration,
    /// Whether the last failed round may have left copies running.
    in_flight: bool,
    graves: Vec<Grave>,
}

impl CudaEngine {
    fn new(ctx: Arc<CudaContext>, copy_bound: Duration) -> Self {
        Self {
            ctx,
            stream: None,
            copy_bound,
            in_flight: false,
            graves: Vec::new(),
        }
    }
}

impl Engine for CudaEngine {
    type Slot = CudaSlot;

    fn joined(&mut self, slot: &CudaSlot) {
        if self.stream.is_none() {
            self.stream = Some(slot.stream.clone());
        }
    }

    fn copy_all(&mut self, entries: &[Entry<CudaSlot>]) -> Result<()> {
        self.in_flight = false;
        let Some(stream) = self.stream.as_ref() else {
            // Unreachable: a hub with entries has had one join since its last failure.
            return Err(GdrError::Cuda {
                call: "CopyMirror pump",
                code: 0,
                text: "no stream to copy on".into(),
            });
        };
        bind(&self.ctx)?;
        for (i, e) in entries.iter().enumerate() {
            // The mirror's drop removes its entry (under this round's lock) before its memory
            // may go.
            // SAFETY: each entry's range is live GPU memory of this context, its staging `len`
            // pinned bytes; the stream belongs to the context, bound above.
            let issued = unsafe { issue(stream, e.slot.range, &e.slot.staging) };
            if issued.is_err() {
                // Copies issued before this one may still run.
                self.in_flight = i > 0;
                return issued;
            }
        }
        let waited = wait(stream, self.copy_bound, || {
            describe(&entries.iter().map(|e| e.slot.range).collect::<Vec<_>>())
        });
        self.in_flight = waited.is_err();
        waited
    }

    fn word(slot: &CudaSlot, i: usize) -> u64 {
        slot.staging.read_u64(8 * i)
    }

    fn retire(&mut self, slots: Vec<CudaSlot>) {
        let stream = self.stream.take();
        if let (true, Some(stream)) = (self.in_flight, stream) {
            self.graves.push(Grave {
                stream,
                staging: slots.into_iter().map(|s| s.staging).collect(),
            });
        }
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        for grave in self.graves.drain(..) {
            let done = bind(&self.ctx).is_ok() && {
                // SAFETY: a live stream (the grave holds it) of the context bound just before.
                let r = unsafe { sys::cuStreamQuery(grave.stream.cu_stream()) };
                r == sys::CUresult::CUDA_SUCCESS
            };
            if !done {
                tracing::warn!(
                    target: "ibgda",
                    "emulated GDR view: {} staging buffers of a failed copy are leaked (the copy \
                     may still write into them)",
                    grave.staging.len()
                );
                std::mem::forget(grave.staging);
            }
        }
    }
}

fn cuda(call: &'static str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| GdrError::Cuda {
        call,
        code: e.0 as u32,
        text: e.to_string(),
    })
}

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| GdrError::Cuda {
        call: "cuCtxSetCurrent",
        code: e.0 as u32,
        text: e.to_string(),
    })
}

/// Issues one copy of `range` into `staging` on `stream`.
///
/// # Safety
///
/// `range` is live GPU memory of the current context, `staging` is at least `range.len` bytes
/// and outlives the copy, and `stream` belongs to the current context.
unsafe fn issue(stream: &CudaStream, range: DeviceRange, staging: &HostMapping) -> Result<()> {
    debug_assert!(staging.len() >= range.len);
    // SAFETY: this function's contract.
    cuda("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            staging.cpu_ptr().cast(),
            range.dptr,
            range.len,
            stream.cu_stream(),
        )
    })
}

/// Waits at most `bound` for everything issued on `stream` (of the current context) to
/// complete: a short spin between queries at first, then a yield between queries.
fn wait(stream: &CudaStream, bound: Duration, what: impl Fn() -> String) -> Result<()> {
    let start = Instant::now();
    loop {
        // SAFETY: a live stream of the current context.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => {}
            e => return cuda("cuStreamQuery", e),
        }
        let waited = start.elapsed();
        if waited > bound {
            return Err(GdrError::Cuda {
                call: "cuStreamQuery",
                code: sys::CUresult::CUDA_ERROR_NOT_READY as u32,
                text: format!("{} did not finish within {bound:?}", what()),
            });
        }
        if waited < SPIN_BEFORE_YIELD {
            for _ in 0..SPINS_BETWEEN_QUERIES {
                std::hint::spin_loop();
            }
        } else {
            std::thread::yield_now();
        }
    }
}

/// The copies of a round, for an error message.
fn describe(ranges: &[DeviceRange]) -> String {
    match ranges {
        [r] => format!("a {}-byte copy of GPU memory at {:#x}", r.len, r.dptr),
        _ => format!(
            "{} copies of GPU memory ({} bytes in all, the first at {:#x})",
            ranges.len(),
            ranges.iter().map(|r| r.len).sum::<usize>(),
            ranges.first().map_or(0, |r| r.dptr)
        ),
    }
}
