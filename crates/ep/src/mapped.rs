//! Pinned host memory mapped into the GPU's address space: where kernels report errors and the
//! numbers the host waits for, readable by the host without a copy or a stream synchronization.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ibgda_gdr::{CpuView, HostMapping};

use crate::error::EpError;

/// A zeroed [`HostMapping`] read word by word with volatile loads (the GPU writes concurrently).
#[derive(Debug)]
pub(crate) struct MappedHost {
    mapping: HostMapping,
}

impl MappedHost {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize, rank: usize) -> Result<Self, EpError> {
        let mapping =
            HostMapping::new(ctx, len).map_err(|source| EpError::HostMemory { rank, source })?;
        Ok(Self { mapping })
    }

    /// The address kernels use.
    pub(crate) fn device_addr(&self, offset: usize) -> u64 {
        self.mapping.device_ptr() + offset as u64
    }

    fn at<T>(&self, offset: usize) -> *mut T {
        assert!(
            offset % std::mem::align_of::<T>() == 0
                && offset + std::mem::size_of::<T>() <= self.mapping.len()
        );
        // SAFETY: the offset was checked to lie inside the mapping, which lives as long as self.
        unsafe { self.mapping.cpu_ptr().add(offset).cast() }
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
