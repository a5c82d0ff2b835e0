//! DEVX user memory (umem): host or GPU memory that firmware objects (CQ rings, work queues,
//! doorbell records) live in.

use std::fmt;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::cuda;
use crate::device::Context;
use crate::error::{Result, VerbsError};
use crate::ffi;
use crate::mr::{Access, GpuPath, MemoryKind};
use crate::prm::UmemRef;

/// Page sizes the NIC may use to map a umem: every power of two from 4 KiB up.
const PGSZ_BITMAP: u64 = !0xfff;

/// A registered umem. CQs and QPs whose rings or doorbell records live in it hold an `Arc`.
pub struct Umem {
    umem: NonNull<ffi::mlx5dv_devx_umem>,
    addr: u64,
    len: usize,
    kind: MemoryKind,
    ctx: Arc<Context>,
}

// SAFETY: a umem is a kernel handle; deregistration in Drop is the only operation on it.
unsafe impl Send for Umem {}
// SAFETY: `&Umem` only reads immutable fields.
unsafe impl Sync for Umem {}

impl fmt::Debug for Umem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Umem")
            .field("id", &self.id())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Umem {
    /// Registers host memory `[ptr, ptr + len)` (`mlx5dv_devx_umem_reg`).
    ///
    /// # Safety
    /// As [`MemoryRegion::register_host`](crate::MemoryRegion::register_host): the memory must
    /// outlive the umem and is shared with the NIC, which writes CQEs and reads WQEs there.
    pub unsafe fn register_host(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<Self>> {
        ctx.require_devx()?;
        // SAFETY: DEVX context; the caller guarantees the range.
        let umem = unsafe { ffi::mlx5dv_devx_umem_reg(ctx.raw(), ptr.cast(), len, access.bits()) };
        let umem = NonNull::new(umem).ok_or_else(|| VerbsError::last_os("mlx5dv_devx_umem_reg"))?;
        Ok(Arc::new(Self {
            umem,
            addr: ptr as u64,
            len,
            kind: MemoryKind::Host,
            ctx: ctx.clone(),
        }))
    }

    /// Registers GPU memory `[dptr, dptr + len)`: dma-buf first (`mlx5dv_devx_umem_reg_ex`),
    /// then peer memory (`mlx5dv_devx_umem_reg` of the GPU address, needs `nvidia-peermem`).
    ///
    /// The device allocation must outlive the umem.
    pub fn register_gpu(
        ctx: &Arc<Context>,
        cuda: &CudaContext,
        dptr: u64,
        len: usize,
        access: Access,
    ) -> Result<Arc<Self>> {
        ctx.require_devx()?;
        if !cuda::driver_present() {
            return Err(VerbsError::CudaDriverMissing(
                "registering GPU memory as a umem",
            ));
        }
        let dma_buf_err = match Self::register_dma_buf(ctx, cuda, dptr, len, access) {
            Ok(u) => return Ok(u),
            Err(e) => e,
        };
        tracing::debug!(
            "dma-buf umem of {dptr:#x}+{len:#x} failed ({dma_buf_err}); trying peer memory"
        );
        // SAFETY: a device address, not host memory; the kernel validates and pins it.
        let umem =
            unsafe { ffi::mlx5dv_devx_umem_reg(ctx.raw(), dptr as *mut _, len, access.bits()) };
        match NonNull::new(umem) {
            Some(umem) => Ok(Arc::new(Self {
                umem,
                addr: dptr,
                len,
                kind: MemoryKind::Gpu(GpuPath::PeerMemory),
                ctx: ctx.clone(),
            })),
            None => Err(VerbsError::GpuRegistration {
                addr: dptr,
                len,
                dma_buf: dma_buf_err.to_string(),
                peer_mem: VerbsError::last_os("mlx5dv_devx_umem_reg").to_string(),
            }),
        }
    }

    fn register_dma_buf(
        ctx: &Arc<Context>,
        cuda: &CudaContext,
        dptr: u64,
        len: usize,
        access: Access,
    ) -> Result<Arc<Self>> {
        let buf = cuda::export_dma_buf(cuda, dptr, len)?;
        // With a dma-buf the kernel reads `addr` as the offset into the buffer.
        let mut input = ffi::mlx5dv_devx_umem_in {
            addr: buf.offset as *mut _,
            size: len,
            access: access.bits(),
            pgsz_bitmap: PGSZ_BITMAP,
            comp_mask: u64::from(ffi::MLX5DV_UMEM_MASK_DMABUF),
            dmabuf_fd: buf.fd.as_raw_fd(),
        };
        // SAFETY: DEVX context; `input` names a live dma-buf and a range inside it.
        let umem = unsafe { ffi::mlx5dv_devx_umem_reg_ex(ctx.raw(), &mut input) };
        let umem = NonNull::new(umem)
            .ok_or_else(|| VerbsError::last_os("mlx5dv_devx_umem_reg_ex(dma-buf)"))?;
        Ok(Arc::new(Self {
            umem,
            addr: dptr,
            len,
            kind: MemoryKind::Gpu(GpuPath::DmaBuf),
            ctx: ctx.clone(),
        }))
    }

    /// The umem id firmware commands name.
    pub fn id(&self) -> u32 {
        // SAFETY: the umem is live; umem_id is set at registration.
        unsafe { (*self.umem.as_ptr()).umem_id }
    }

    /// Start address (host pointer or GPU virtual address).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the umem is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or GPU, and how.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// A place `offset` bytes into this umem.
    pub fn at(self: &Arc<Self>, offset: u64) -> UmemAt {
        UmemAt {
            umem: self.clone(),
            offset,
        }
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: every CQ/QP placed in this umem holds an Arc and is gone.
        let rc = unsafe { ffi::mlx5dv_devx_umem_dereg(self.umem.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", crate::devx::rc_error("mlx5dv_devx_umem_dereg", rc));
        }
    }
}

/// A byte offset inside a umem, holding the umem alive.
#[derive(Clone, Debug)]
pub struct UmemAt {
    /// The umem.
    pub umem: Arc<Umem>,
    /// Byte offset from its start.
    pub offset: u64,
}

impl UmemAt {
    /// The firmware view: umem id and offset.
    pub fn prm(&self) -> UmemRef {
        UmemRef::new(self.umem.id(), self.offset)
    }

    /// Address of this place (host pointer or GPU virtual address).
    pub fn addr(&self) -> u64 {
        self.umem.addr() + self.offset
    }

    /// Checks that `len` bytes fit at this place and that the offset is `align`-aligned.
    pub(crate) fn check(&self, what: &str, len: u64, align: u64) -> Result<()> {
        if self.offset % align != 0 {
            return Err(VerbsError::Invalid(format!(
                "{what} at umem offset {:#x} must be {align}-byte aligned",
                self.offset
            )));
        }
        if self
            .offset
            .checked_add(len)
            .is_none_or(|end| end > self.umem.len() as u64)
        {
            return Err(VerbsError::Invalid(format!(
                "{what} ({len} bytes at offset {:#x}) does not fit its {}-byte umem",
                self.offset,
                self.umem.len()
            )));
        }
        Ok(())
    }
}
