//! Pinned host memory mapped into the GPU's address space: where kernels report errors and the
//! numbers the host waits for, readable by the host without a copy or a stream synchronization.

use std::sync::Arc;

use std::sync::atomic::{fence, Ordering};

use cudarc::driver::CudaContext;
use ep_kernels::intranode::{ErrorSlot, ErrorWord};
use ibgda_device::cuda::DeviceBuffer;
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

    /// The error a kernel recorded in the [`ErrorWord`] at `offset`, if any (its code is stored
    /// last, after a system fence, so the other fields are complete once it reads non-zero).
    pub(crate) fn read_error(&self, offset: usize) -> Option<ErrorWord> {
        let code = self.read_u32(offset);
        if code == 0 {
            return None;
        }
        fence(Ordering::Acquire);
        Some(ErrorWord {
            code,
            rank: self.read_u32(offset + 4),
            peer: self.read_u32(offset + 8),
            what: self.read_u32(offset + 12),
            epoch: self.read_u64(offset + 16),
            detail: self.read_u64(offset + 24),
        })
    }
}

/// Where a buffer's kernels report errors: an [`ErrorSlot`] in device memory that points at the
/// [`ErrorWord`] of a [`MappedHost`]. Kernels claim the slot and check it (an L2 read, cheap in
/// every block, where a read of host-mapped memory is an uncached PCIe round trip that serialises
/// across blocks); the host reads the word ([`MappedHost::read_error`]).
#[derive(Debug)]
pub(crate) struct ErrorReport {
    slot: DeviceBuffer,
}

impl ErrorReport {
    /// A zeroed slot pointing at the [`ErrorWord`] at `offset` of `mapped`.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        mapped: &MappedHost,
        offset: usize,
        rank: usize,
    ) -> Result<Self, EpError> {
        assert!(offset + std::mem::size_of::<ErrorWord>() <= mapped.mapping.len());
        let slot = ErrorSlot {
            host: mapped.device_addr(offset),
            ..Default::default()
        };
        let slot = DeviceBuffer::from_slice(ctx, &slot.to_words())
            .map_err(|source| EpError::Device { rank, source })?;
        Ok(Self { slot })
    }

    /// The address kernels get as their `error` parameter.
    pub(crate) fn kernel_addr(&self) -> u64 {
        self.slot.ptr()
    }
}
