//! The CUDA driver calls the NIC side needs: exporting GPU memory as a dma-buf, and mapping the
//! UAR (NIC doorbell page) into the GPU's address space.
//!
//! `libcuda` is loaded at run time by cudarc, which panics when it is absent; every entry point
//! here checks [`driver_present`] (`ibgda_device::cuda`'s, the one check of the workspace) first
//! and returns [`VerbsError::CudaDriverMissing`] instead.

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use crate::error::{Result, VerbsError};

pub use ibgda_device::cuda::driver_present;
use ibgda_device::cuda::error_string;

/// Turns a `CUresult` into this crate's error, naming the call.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(VerbsError::Cuda {
        call,
        code: r as u32,
        text: error_string(r),
    })
}

/// `Ok` when `libcuda` is loadable, else [`VerbsError::CudaDriverMissing`] naming `what`.
pub(crate) fn ensure_driver(what: &'static str) -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(VerbsError::CudaDriverMissing(what))
    }
}

/// Checks for the driver and makes `ctx` current on this thread.
pub(crate) fn enter(ctx: &CudaContext, what: &'static str) -> Result<()> {
    ensure_driver(what)?;
    ctx.bind_to_thread().map_err(|e| VerbsError::Cuda {
        call: "cuCtxSetCurrent",
        code: e.0 as u32,
        text: error_string(e.0),
    })
}

/// A dma-buf file descriptor exported for the CUDA allocation that holds a device range.
#[derive(Debug)]
pub(crate) struct DmaBuf {
    /// The dma-buf; closed on drop (registrations keep their own reference).
    pub fd: OwnedFd,
    /// Offset of the requested address inside the exported allocation.
    pub offset: u64,
}

/// Exports the whole allocation that contains `[dptr, dptr + len)` as a dma-buf.
///
/// The allocation's base and size satisfy the driver's alignment rules for
/// `cuMemGetHandleForAddressRange` (host-page aligned), which an arbitrary sub-range may not.
pub(crate) fn export_dma_buf(ctx: &CudaContext, dptr: u64, len: usize) -> Result<DmaBuf> {
    enter(ctx, "exporting GPU memory as a dma-buf")?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers are valid locals; the driver validates `dptr`.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr)
    })?;
    let end = dptr
        .checked_add(len as u64)
        .ok_or_else(|| VerbsError::Invalid("GPU range overflows".into()))?;
    if end > base + size as u64 {
        return Err(VerbsError::Invalid(format!(
            "GPU range {dptr:#x}+{len:#x} runs past its allocation {base:#x}+{size:#x}"
        )));
    }
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is a valid out-pointer for an int, as DMA_BUF_FD handles are; the range is a
    // whole live allocation checked above.
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            base,
            size,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(VerbsError::Invalid(
            "cuMemGetHandleForAddressRange returned no descriptor".into(),
        ));
    }
    // SAFETY: the driver just created this descriptor and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DmaBuf {
        fd,
        offset: dptr - base,
    })
}

/// Whether `ctx`'s GPU can export its memory as a dma-buf, the first way [`MemoryRegion`] and
/// [`Umem`] register GPU memory: the device attribute must say so and a 2 MiB test allocation
/// must actually export (which needs NVIDIA's open kernel modules). `Ok(false)` means the
/// peer-memory path (`nvidia-peermem`) is the only one left.
///
/// [`MemoryRegion`]: crate::MemoryRegion
/// [`Umem`]: crate::Umem
pub fn dma_buf_export_supported(ctx: &CudaContext) -> Result<bool> {
    enter(ctx, "probing dma-buf export")?;
    let mut attr = 0;
    // SAFETY: valid out-pointer; the device handle comes from a live context.
    check("cuDeviceGetAttribute(DMA_BUF_SUPPORTED)", unsafe {
        sys::cuDeviceGetAttribute(
            &mut attr,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            ctx.cu_device(),
        )
    })?;
    if attr == 0 {
        return Ok(false);
    }
    const PROBE: usize = 2 << 20;
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: context bound by `enter`; valid out-pointer.
    check("cuMemAlloc", unsafe {
        sys::cuMemAlloc_v2(&mut dptr, PROBE)
    })?;
    let exported = export_dma_buf(ctx, dptr, PROBE);
    // SAFETY: allocated just above; the dma-buf (if any) is closed already or on drop below,
    // and the driver keeps exported pages alive until then.
    let freed = check("cuMemFree", unsafe { sys::cuMemFree_v2(dptr) });
    let supported = match exported {
        Ok(buf) => {
            drop(buf);
            true
        }
        Err(VerbsError::Cuda { code, .. })
            if code == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as u32 =>
        {
            false
        }
        Err(e) => return Err(e),
    };
    freed?;
    Ok(supported)
}

/// Maps `[ptr, ptr + len)` of I/O memory (a mmapped UAR page) into the GPU and returns the device
/// address of `ptr`. Error 800 becomes [`VerbsError::GpuDoorbellMappingNotPermitted`].
///
/// # Safety
/// `ptr..ptr + len` must be a live, page-aligned mapping that stays mapped until
/// [`unregister_io_memory`] is called with the same `ptr`.
pub(crate) unsafe fn register_io_memory(
    ctx: &CudaContext,
    ptr: *mut u8,
    len: usize,
) -> Result<u64> {
    enter(ctx, "mapping the NIC doorbell into the GPU")?;
    let flags = sys::CU_MEMHOSTREGISTER_IOMEMORY
        | sys::CU_MEMHOSTREGISTER_DEVICEMAP
        | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: the caller guarantees the range is a live mapping; the driver pins it.
    let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) };
    if r == sys::CUresult::CUDA_ERROR_NOT_PERMITTED {
        return Err(VerbsError::GpuDoorbellMappingNotPermitted);
    }
    check("cuMemHostRegister(IOMEMORY)", r)?;
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` was registered with DEVICEMAP just above; `dptr` is a valid out-pointer.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0) };
    if let Err(e) = check("cuMemHostGetDevicePointer", r) {
        // SAFETY: undoes the registration made above.
        unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        return Err(e);
    }
    Ok(dptr)
}

/// Undoes [`register_io_memory`].
///
/// # Safety
/// `ptr` was registered by [`register_io_memory`] and no GPU work uses the mapping any more.
pub(crate) unsafe fn unregister_io_memory(ctx: &CudaContext, ptr: *mut u8) -> Result<()> {
    enter(ctx, "unmapping the NIC doorbell from the GPU")?;
    // SAFETY: per the contract, `ptr` is a registered range.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr.cast())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_errors_name_the_call() {
        let e = VerbsError::Cuda {
            call: "cuMemHostRegister(IOMEMORY)",
            code: 1,
            text: "invalid argument".into(),
        };
        assert_eq!(
            e.to_string(),
            "cuMemHostRegister(IOMEMORY) failed: CUDA error 1 (invalid argument)"
        );
        assert!(check("x", sys::CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn missing_driver_is_an_error_not_a_panic() {
        match ensure_driver("mapping the NIC doorbell into the GPU") {
            Ok(()) => {
                eprintln!("note: libcuda is installed here; the no-driver path is not exercised")
            }
            Err(e) => {
                assert!(matches!(e, VerbsError::CudaDriverMissing(_)));
                let text = e.to_string();
                assert!(
                    text.contains("libcuda.so") && text.contains("doorbell"),
                    "{text}"
                );
            }
        }
    }
}
