//! Pinned host memory mapped into the GPU: the CPU view for the `cpu_host_memory` NIC handler,
//! which needs neither GDRCopy nor gdrdrv.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use ibgda_device::cuda::CudaError;

use crate::error::{GdrError, Result};
use crate::view::CpuView;

pub use ibgda_device::cuda::driver_present as cuda_driver_present;

fn cuda_error(call: &'static str, r: sys::CUresult) -> GdrError {
    GdrError::Cuda {
        call,
        code: r as u32,
        text: ibgda_device::cuda::error_string(r),
    }
}

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(call, r))
    }
}

/// This crate's error for a failed [`ibgda_device::cuda`] lookup of the GPUs.
fn from_device(e: CudaError) -> GdrError {
    match e {
        CudaError::DriverMissing => GdrError::CudaDriverMissing("counting GPUs"),
        CudaError::Driver { call, source } => cuda_error(call, source.0),
        CudaError::NoSuchDevice { ordinal, count } => GdrError::NoSuchGpu { ordinal, count },
        // Not returned by `device_count` or `context`.
        other => GdrError::Cuda {
            call: "the CUDA driver",
            code: 0,
            text: other.to_string(),
        },
    }
}

/// Number of visible GPUs; [`GdrError::CudaDriverMissing`] without a driver.
pub fn gpu_count() -> Result<usize> {
    ibgda_device::cuda::device_count().map_err(from_device)
}

/// Pinned host memory mapped into a GPU (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`), zeroed.
pub struct HostMapping {
    ptr: NonNull<u8>,
    dptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned here and freed in Drop; Rust reaches it only through CpuView's
// atomic accesses.
unsafe impl Send for HostMapping {}
// SAFETY: as above.
unsafe impl Sync for HostMapping {}

impl fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMapping")
            .field("cpu", &self.ptr)
            .field("device", &format_args!("{:#x}", self.dptr))
            .field("len", &self.len)
            .finish()
    }
}

impl HostMapping {
    /// Allocates `len` bytes of pinned host memory visible to `ctx`'s GPU.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(GdrError::Empty);
        }
        if !cuda_driver_present() {
            return Err(GdrError::CudaDriverMissing("allocating pinned host memory"));
        }
        ctx.bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e.0))?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: context bound; `p` is a valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len, flags)
        })?;
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| cuda_error("cuMemHostAlloc", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `p` was allocated with DEVICEMAP just above.
        if let Err(e) = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0)
        }) {
            // SAFETY: frees the allocation made above, never used.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        // SAFETY: fresh allocation of `len` bytes that nothing else references yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self {
            ptr,
            dptr,
            len,
            ctx: ctx.clone(),
        })
    }

    /// Allocates on GPU `ordinal` (retaining its primary context).
    pub fn for_device(ordinal: usize, len: usize) -> Result<Self> {
        let ctx = ibgda_device::cuda::context(ordinal).map_err(from_device)?;
        Self::new(&ctx, len)
    }

    /// The CUDA context the memory is mapped into.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!("freeing pinned host memory: cuCtxSetCurrent: {e}");
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once; whoever drops the mapping
        // guarantees no GPU work still uses it.
        if let Err(e) = check("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(self.ptr.as_ptr().cast())
        }) {
            tracing::error!("{e}");
        }
    }
}

// SAFETY: cuMemHostAlloc returns page-aligned memory of `len` bytes, valid until Drop, and this
// type never hands out references to it.
unsafe impl CpuView for HostMapping {
    fn cpu_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn device_ptr(&self) -> u64 {
        self.dptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_or_no_gpu_is_an_error_not_a_panic() {
        if cuda_driver_present() {
            match HostMapping::for_device(usize::MAX, 64) {
                Err(GdrError::NoSuchGpu { .. }) => {}
                other => panic!("expected NoSuchGpu, got {other:?}"),
            }
        } else {
            let e = HostMapping::for_device(0, 64).unwrap_err();
            assert!(matches!(e, GdrError::CudaDriverMissing(_)), "{e}");
            assert!(e.to_string().contains("libcuda.so"));
            assert!(matches!(gpu_count(), Err(GdrError::CudaDriverMissing(_))));
        }
    }
}
