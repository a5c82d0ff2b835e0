//! The CUDA driver, loaded at run time and checked before first use.
//!
//! cudarc loads `libcuda` lazily and panics when it is absent; every GPU entry point in this
//! project goes through [`context`] or [`device_count`], which look for the library first and
//! turn its absence into [`CudaError::DriverMissing`].
//!
//! The one home of the driver layer: the "is libcuda present" check ([`driver_present`]), GPU
//! count and context lookup, [`DeviceBuffer`], and the bounded stream waits ([`wait_stream`],
//! [`wait_legacy_stream`]). `ibgda-verbs`, `ibgda-gdr` and `ep` call these (or re-export them)
//! rather than keeping copies of their own.

use std::sync::Arc;

pub use cudarc::driver::{CudaContext, CudaStream, DriverError};

/// Why the GPU could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded: no NVIDIA driver on this machine.
    #[error("the CUDA driver (libcuda.so) is not installed on this machine: no GPU work is possible here")]
    DriverMissing,
    /// A driver call failed.
    #[error("{call} failed: {source}")]
    Driver {
        /// The driver call (or cudarc function) that failed.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The two GPUs cannot reach each other's memory.
    #[error("GPU {from} cannot access GPU {to}'s memory (cuDeviceCanAccessPeer = 0)")]
    NoPeerAccess {
        /// The accessing GPU.
        from: usize,
        /// The GPU whose memory would be accessed.
        to: usize,
    },
    /// A copy outside a buffer.
    #[error("range {offset}+{len} outside a buffer of {size} bytes")]
    OutOfRange {
        /// Start of the range, in bytes.
        offset: usize,
        /// Length of the range, in bytes.
        len: usize,
        /// Size of the buffer.
        size: usize,
    },
    /// A device ordinal past the number of visible GPUs.
    #[error("GPU {ordinal} requested but only {count} visible")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many GPUs are visible.
        count: usize,
    },
    /// A host wait for the device ran past its bound (work queued ahead of it never finished).
    #[error("{what} still not done after {waited:?} (bound {bound:?})")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long the wait lasted.
        waited: std::time::Duration,
        /// The bound it ran past.
        bound: std::time::Duration,
    },
}

/// Whether `libcuda` can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops the handles.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The driver's text for a `CUresult` (`cuGetErrorString`), or the code's name when the driver
/// has none.
pub fn error_string(r: cudarc::driver::sys::CUresult) -> String {
    use cudarc::driver::sys;
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `p` is a valid out-pointer; the driver only writes a pointer to a static string.
    let ok = unsafe { sys::cuGetErrorString(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: on success the driver returns a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{r:?}")
    }
}

/// Number of visible CUDA devices, or an error when there is no driver.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::DriverMissing);
    }
    cudarc::driver::result::init().map_err(|source| CudaError::Driver {
        call: "cuInit",
        source,
    })?;
    let n = CudaContext::device_count().map_err(|source| CudaError::Driver {
        call: "cuDeviceGetCount",
        source,
    })?;
    Ok(n.max(0) as usize)
}

/// Retains the primary context of GPU `ordinal`.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    CudaContext::new(ordinal).map_err(|source| CudaError::Driver {
        call: "cuDevicePrimaryCtxRetain",
        source,
    })
}

/// Lets kernels and copies on `from` access memory of `to` over NVLink/PCIe (idempotent).
pub fn enable_peer_access(from: &CudaContext, to: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    if from.cu_device() == to.cu_device() {
        return Ok(());
    }
    let mut can = 0i32;
    // SAFETY: both device handles come from live contexts; `can` is a valid out-pointer.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device()) }
        .result()
        .map_err(|source| CudaError::Driver {
            call: "cuDeviceCanAccessPeer",
            source,
        })?;
    if can == 0 {
        return Err(CudaError::NoPeerAccess {
            from: from.ordinal(),
            to: to.ordinal(),
        });
    }
    from.bind_to_thread().map_err(|source| CudaError::Driver {
        call: "cuCtxSetCurrent",
        source,
    })?;
    // SAFETY: `from` is bound to this thread and `to.cu_ctx()` is a live context.
    let r = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
    match r {
        sys::cudaError_enum::CUDA_SUCCESS
        | sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => Err(CudaError::Driver {
            call: "cuCtxEnablePeerAccess",
            source: DriverError(other),
        }),
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
///
/// Unlike cudarc's stream-ordered allocations (`cuMemAllocAsync`, from a memory pool), this
/// memory can be read and written by peer GPUs once [`enable_peer_access`] has run, and exported
/// through CUDA IPC: use it for anything another GPU or the NIC touches.
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
}

// SAFETY: the buffer is a device address plus the context that owns it; CUDA driver calls on it
// are thread-safe once the context is bound, which every method does first.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as for Send; `&self` methods only issue synchronous driver copies.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1) on `ctx`'s GPU. The contents are undefined: poison or fill.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        use cudarc::driver::sys;
        bind(ctx)?;
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer and the context is current.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) }
            .result()
            .map_err(|source| CudaError::Driver {
                call: "cuMemAlloc",
                source,
            })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: bytemuck::Pod>(
        ctx: &Arc<CudaContext>,
        data: &[T],
    ) -> Result<Self, CudaError> {
        let b = Self::new(ctx, std::mem::size_of_val(data))?;
        b.upload(0, data)?;
        Ok(b)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The owning context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Copies `data` to byte offset `offset`. Synchronous: the bytes are in device memory when
    /// it returns, so work on any stream (non-blocking ones included) may read them at once.
    pub fn upload<T: bytemuck::Pod>(&self, offset: usize, data: &[T]) -> Result<(), CudaError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.check_range(offset, bytes.len())?;
        bind(&self.ctx)?;
        // SAFETY: the range was checked to lie inside this live allocation; `bytes` is readable.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                bytes.as_ptr().cast(),
                bytes.len(),
            )
        }
        .result()
        .map_err(|source| CudaError::Driver {
            call: "cuMemcpyHtoD",
            source,
        })?;
        // From pageable memory cuMemcpyHtoD returns once the last piece is staged, with its DMA
        // still queued on the legacy stream, which a non-blocking stream does not wait for.
        legacy_stream_synchronize()
    }

    /// Copies `count` elements of `T` from byte offset `offset` to the host (synchronous), after
    /// the work queued before on the legacy default stream, as `cuMemcpyDtoH` would, but bounded:
    /// a kernel that never ends there gives [`CudaError::Timeout`] after
    /// [`LEGACY_STREAM_BOUND`] instead of a hang.
    ///
    /// The copy itself runs on a stream of its own that waits for no other work (non-blocking),
    /// so once the legacy stream has drained, its time is the copy's own (bytes over PCIe); into
    /// pageable memory the driver returns only once it is done, so no DMA into `out` outlives
    /// this call.
    pub fn download<T: bytemuck::Pod>(
        &self,
        offset: usize,
        count: usize,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::zeroed(); count];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        self.check_range(offset, bytes.len())?;
        bind(&self.ctx)?;
        legacy_stream_synchronize()?;
        // A service stream of the pool: creating a stream per copy would move other streams'
        // queues (see `stream_pool`), and a copy must never queue behind a spinning kernel.
        let stream = crate::stream_pool::service(&self.ctx)?;
        // SAFETY: the range was checked to lie inside this live allocation; `bytes` is writable
        // and outlives the copy (a pageable destination makes the call return after the copy,
        // and the stream is waited for below); the stream is live in the current context.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                bytes.as_mut_ptr().cast(),
                self.ptr + offset as u64,
                bytes.len(),
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|source| CudaError::Driver {
            call: "cuMemcpyDtoHAsync",
            source,
        })?;
        wait_stream(&stream, LEGACY_STREAM_BOUND, "a copy to the host")?;
        Ok(out)
    }

    /// Fills the whole buffer with the byte `value`. Synchronous, as [`DeviceBuffer::upload`]:
    /// done in device memory when it returns.
    pub fn fill_bytes(&self, value: u8) -> Result<(), CudaError> {
        bind(&self.ctx)?;
        // SAFETY: the whole live allocation is written.
        unsafe { cudarc::driver::sys::cuMemsetD8_v2(self.ptr, value, self.len) }
            .result()
            .map_err(|source| CudaError::Driver {
                call: "cuMemsetD8",
                source,
            })?;
        // cuMemsetD8 on device memory is asynchronous to the host (legacy stream).
        legacy_stream_synchronize()
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CudaError::OutOfRange {
                offset,
                len,
                size: self.len,
            });
        }
        Ok(())
    }
}

/// How long [`DeviceBuffer::upload`] and [`DeviceBuffer::fill_bytes`] wait for the legacy
/// stream: far above any copy (a GiB crosses PCIe in well under a second) and above the bound of
/// every kernel this project queues there.
pub const LEGACY_STREAM_BOUND: std::time::Duration = std::time::Duration::from_secs(120);

/// Waits (bounded by [`LEGACY_STREAM_BOUND`]) for the current context's legacy default stream,
/// where the driver's "synchronous" copies and memsets run.
fn legacy_stream_synchronize() -> Result<(), CudaError> {
    // SAFETY: the null handle names the current context's legacy default stream, which exists
    // while a context is current (the callers bound one).
    unsafe {
        poll_stream(
            core::ptr::null_mut(),
            LEGACY_STREAM_BOUND,
            "the legacy stream (a copy or memset to device memory)",
        )
    }
}

/// Waits, at most `bound`, for the legacy default stream of `ctx`, where the driver's
/// "synchronous" copies and memsets run ([`CudaError::Timeout`] naming `what` after it). The
/// bounded replacement for `cuCtxSynchronize` after such calls: that waits for every stream of a
/// context, which ranks sharing a GPU's primary context share too, and without a bound.
pub fn wait_legacy_stream(
    ctx: &CudaContext,
    bound: std::time::Duration,
    what: &'static str,
) -> Result<(), CudaError> {
    bind(ctx)?;
    // SAFETY: the null handle names the legacy default stream of the context just made current.
    unsafe { poll_stream(core::ptr::null_mut(), bound, what) }
}

/// Polls `stream` until its work has finished, at most `bound` ([`CudaError::Timeout`] naming
/// `what`); a failed stream is [`CudaError::Driver`]. For waits that must not hang on a kernel
/// that never ends.
pub fn wait_stream(
    stream: &cudarc::driver::CudaStream,
    bound: std::time::Duration,
    what: &'static str,
) -> Result<(), CudaError> {
    bind(stream.context())?;
    // SAFETY: a live stream of the context just made current (the `CudaStream` keeps both).
    unsafe { poll_stream(stream.cu_stream(), bound, what) }
}

/// The polling behind [`wait_stream`] and [`legacy_stream_synchronize`].
///
/// # Safety
///
/// `stream` is a live stream of the current context, or null (its legacy default stream).
unsafe fn poll_stream(
    stream: cudarc::driver::sys::CUstream,
    bound: std::time::Duration,
    what: &'static str,
) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    let start = std::time::Instant::now();
    loop {
        // SAFETY: `stream` is live (or null) in the current context (this function's contract).
        let r = unsafe { sys::cuStreamQuery(stream) };
        if r != sys::cudaError_enum::CUDA_ERROR_NOT_READY {
            return r.result().map_err(|source| CudaError::Driver {
                call: "cuStreamQuery",
                source,
            });
        }
        let waited = start.elapsed();
        if waited > bound {
            return Err(CudaError::Timeout {
                what,
                waited,
                bound,
            });
        }
        // Short work (a copy's last DMA) ends within microseconds: spin through that, then
        // sleep between polls.
        if waited < std::time::Duration::from_micros(200) {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once, here.
            let _ = unsafe { cudarc::driver::sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Makes `ctx` current on this thread (`cuCtxSetCurrent`), as every driver call on its memory
/// or streams needs first.
pub fn bind(ctx: &CudaContext) -> Result<(), CudaError> {
    ctx.bind_to_thread().map_err(|source| CudaError::Driver {
        call: "cuCtxSetCurrent",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        match device_count() {
            Ok(n) => eprintln!("driver present, {n} GPU(s)"),
            Err(CudaError::DriverMissing) => assert!(!driver_present()),
            Err(e) => eprintln!("driver present but unusable: {e}"),
        }
    }
}
