//! Pinned host memory mapped into the GPU's address space: where kernels report errors and the
//! numbers the host waits for, readable by the host without a copy or a stream synchronization.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, DriverError};

use crate::error::EpError;

/// `cuMemHostAlloc` memory with `DEVICEMAP | PORTABLE`, zeroed, freed on drop.
#[derive(Debug)]
pub(crate) struct MappedHost {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    device: u64,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone and lives until drop; all reads and writes
// through it are volatile accesses of naturally aligned words, which are sound from any thread.
unsafe impl Send for MappedHost {}
// SAFETY: as for Send: `&self` methods only do volatile loads and stores of aligned words.
unsafe impl Sync for MappedHost {}

impl MappedHost {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize, rank: usize) -> Result<Self, EpError> {
        let cuda = |call, source: DriverError| EpError::Cuda { rank, call, source };
        ctx.bind_to_thread()
            .map_err(|e| cuda("cuCtxSetCurrent", e))?;
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the flags are the documented DEVICEMAP | PORTABLE.
        unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                len,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .result()
        .map_err(|e| cuda("cuMemHostAlloc", e))?;
        let host = p.cast::<u8>();
        // SAFETY: cuMemHostAlloc returned `len` writable bytes at `host`.
        unsafe { std::ptr::write_bytes(host, 0, len) };
        let mut device = 0;
        // SAFETY: `p` is a live DEVICEMAP allocation of this context; `device` is a valid out-pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, p, 0) }.result();
        if let Err(e) = r {
            // SAFETY: `p` came from cuMemHostAlloc above and is freed once.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(cuda("cuMemHostGetDevicePointer", e));
        }
        Ok(Self {
            ctx: ctx.clone(),
            host,
            device,
            len,
        })
    }

    /// The address kernels use.
    pub(crate) fn device_addr(&self, offset: usize) -> u64 {
        self.device + offset as u64
    }

    fn at<T>(&self, offset: usize) -> *mut T {
        assert!(
            offset % std::mem::align_of::<T>() == 0
                && offset + std::mem::size_of::<T>() <= self.len
        );
        // SAFETY: the offset was checked to lie inside the allocation.
        unsafe { self.host.add(offset).cast() }
    }

    pub(crate) fn read_u32(&self, offset: usize) -> u32 {
        // SAFETY: `at` checked bounds and alignment; the GPU may write concurrently, hence volatile.
        unsafe { std::ptr::read_volatile(self.at::<u32>(offset)) }
    }

    pub(crate) fn read_u64(&self, offset: usize) -> u64 {
        // SAFETY: as in read_u32.
        unsafe { std::ptr::read_volatile(self.at::<u64>(offset)) }
    }

    pub(crate) fn read_i32(&self, offset: usize) -> i32 {
        self.read_u32(offset) as i32
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once, here.
            unsafe { sys::cuMemFreeHost(self.host.cast()) };
        }
    }
}
