//! Memory registration of host and GPU memory.

use std::fmt;
use std::ops::BitOr;
use std::os::fd::AsFd;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::cuda;
use crate::driver::{DmaBufRange, DriverMr, MemRange};
use crate::error::{Result, VerbsError};
use crate::pd::ProtectionDomain;

/// Access rights of a registration (`enum ibv_access_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Access(u32);

impl Access {
    /// The local NIC may write (needed for any remote write or read into it).
    pub const LOCAL_WRITE: Access = Access(1 << 0);
    /// Remote peers may RDMA-write.
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// Remote peers may RDMA-read.
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// Remote peers may run atomics.
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    /// PCIe relaxed ordering (`IBV_ACCESS_RELAXED_ORDERING`, an optional flag ignored where
    /// unsupported).
    pub const RELAXED_ORDERING: Access = Access(1 << 20);

    /// Everything a peer of the IBGDA path does: local write, remote write/read/atomic.
    pub const fn rdma() -> Access {
        Access(
            Self::LOCAL_WRITE.0
                | Self::REMOTE_WRITE.0
                | Self::REMOTE_READ.0
                | Self::REMOTE_ATOMIC.0,
        )
    }

    /// The raw `ibv_access_flags` bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// How GPU memory reached the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPath {
    /// `cuMemGetHandleForAddressRange` → dma-buf → `ibv_reg_dmabuf_mr` /
    /// `mlx5dv_devx_umem_reg_ex` (upstream kernels ≥ 5.12, no extra module).
    DmaBuf,
    /// The GPU virtual address straight to `ibv_reg_mr` / `mlx5dv_devx_umem_reg`, which needs
    /// the `nvidia-peermem` kernel module.
    PeerMemory,
}

/// What a registration covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory.
    Host,
    /// GPU memory, and how it was registered.
    Gpu(GpuPath),
}

/// A registered memory region. Holds its protection domain.
pub struct MemoryRegion {
    // Declared first: deregistered before the PD is released.
    mr: Box<dyn DriverMr>,
    kind: MemoryKind,
    addr: u64,
    len: usize,
    pd: Arc<ProtectionDomain>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl MemoryRegion {
    /// Registers host memory `[ptr, ptr + len)` (`ibv_reg_mr`).
    ///
    /// # Safety
    /// The memory must stay allocated until the region is dropped, and the caller must treat it
    /// as shared with the NIC: with remote access, peers write it at any time, so Rust code may
    /// reach it only through raw pointers (volatile or atomic accesses), never `&`/`&mut`
    /// references that assume nobody else writes.
    pub unsafe fn register_host(
        pd: &Arc<ProtectionDomain>,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self> {
        let mem = MemRange {
            addr: ptr as u64,
            len,
            gpu: false,
        };
        let driver = pd.context().driver();
        // SAFETY: the caller guarantees the range is live for the region's lifetime.
        let mr = unsafe { driver.reg_mr(pd.handle(), mem, access)? };
        Ok(Self {
            mr,
            kind: MemoryKind::Host,
            addr: ptr as u64,
            len,
            pd: pd.clone(),
        })
    }

    /// Registers GPU memory `[dptr, dptr + len)` of `cuda`'s device: through dma-buf first, then
    /// through peer memory (`nvidia-peermem`); the error says why each failed.
    ///
    /// The device allocation must outlive the region: the NIC writes it directly.
    pub fn register_gpu(
        pd: &Arc<ProtectionDomain>,
        cuda: &CudaContext,
        dptr: u64,
        len: usize,
        access: Access,
    ) -> Result<Self> {
        if !cuda::driver_present() {
            return Err(VerbsError::CudaDriverMissing("registering GPU memory"));
        }
        let dma_buf_err = match Self::register_dma_buf(pd, cuda, dptr, len, access) {
            Ok(mr) => return Ok(mr),
            Err(e) => e,
        };
        tracing::debug!(
            "dma-buf registration of {dptr:#x}+{len:#x} failed ({dma_buf_err}); trying peer memory"
        );
        let mem = MemRange {
            addr: dptr,
            len,
            gpu: true,
        };
        let driver = pd.context().driver();
        // SAFETY: the caller keeps the device allocation alive for the region's lifetime; the
        // kernel (nvidia-peermem) validates and pins it.
        match unsafe { driver.reg_mr(pd.handle(), mem, access) } {
            Ok(mr) => Ok(Self {
                mr,
                kind: MemoryKind::Gpu(GpuPath::PeerMemory),
                addr: dptr,
                len,
                pd: pd.clone(),
            }),
            Err(peer_mem) => Err(VerbsError::GpuRegistration {
                addr: dptr,
                len,
                dma_buf: dma_buf_err.to_string(),
                peer_mem: peer_mem.to_string(),
            }),
        }
    }

    fn register_dma_buf(
        pd: &Arc<ProtectionDomain>,
        cuda: &CudaContext,
        dptr: u64,
        len: usize,
        access: Access,
    ) -> Result<Self> {
        let buf = cuda::export_dma_buf(cuda, dptr, len)?;
        let range = DmaBufRange {
            fd: buf.fd.as_fd(),
            offset: buf.offset,
            len,
            iova: dptr,
        };
        let driver = pd.context().driver();
        // SAFETY: `buf.fd` is a live dma-buf of an allocation the caller keeps alive; offset/len
        // lie inside it; iova = dptr so work requests address the region by its GPU address.
        let mr = unsafe { driver.reg_dmabuf_mr(pd.handle(), range, access)? };
        // The MR keeps its own reference to the dma-buf; `buf.fd` closes here.
        Ok(Self {
            mr,
            kind: MemoryKind::Gpu(GpuPath::DmaBuf),
            addr: dptr,
            len,
            pd: pd.clone(),
        })
    }

    /// The local key (for data segments this side posts).
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The remote key (what peers put in their remote-address segments).
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Start address (host pointer or GPU virtual address).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the region covers and how it was registered.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_bits_match_verbs_h() {
        assert_eq!(Access::LOCAL_WRITE.bits(), 1);
        assert_eq!(Access::REMOTE_WRITE.bits(), 2);
        assert_eq!(Access::REMOTE_READ.bits(), 4);
        assert_eq!(Access::REMOTE_ATOMIC.bits(), 8);
        assert_eq!(Access::rdma().bits(), 0xf);
        assert!((Access::rdma() | Access::RELAXED_ORDERING).contains(Access::REMOTE_ATOMIC));
        assert!(!Access::LOCAL_WRITE.contains(Access::REMOTE_WRITE));
    }
}
