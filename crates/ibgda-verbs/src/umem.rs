//! DEVX user memory (umem): host or GPU memory that firmware objects (CQ rings, work queues,
//! doorbell records) live in.

use std::fmt;
use std::os::fd::AsFd;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::cuda;
use crate::device::Context;
use crate::driver::{DmaBufRange, DriverUmem, MemRange};
use crate::error::{Result, VerbsError};
use crate::mr::{Access, GpuPath, MemoryKind};
use crate::prm::UmemRef;

/// A registered umem. CQs and QPs whose rings or doorbell records live in it hold an `Arc`.
pub struct Umem {
    // Declared first: deregistered before the context is released.
    umem: Box<dyn DriverUmem>,
    addr: u64,
    len: usize,
    kind: MemoryKind,
    ctx: Arc<Context>,
}

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
        let mem = MemRange {
            addr: ptr as u64,
            len,
            gpu: false,
        };
        // SAFETY: the caller guarantees the range for the umem's lifetime.
        let umem = unsafe { ctx.driver().reg_umem(mem, access)? };
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
        let mem = MemRange {
            addr: dptr,
            len,
            gpu: true,
        };
        // SAFETY: a device address the caller keeps allocated; the kernel validates and pins it.
        match unsafe { ctx.driver().reg_umem(mem, access) } {
            Ok(umem) => Ok(Arc::new(Self {
                umem,
                addr: dptr,
                len,
                kind: MemoryKind::Gpu(GpuPath::PeerMemory),
                ctx: ctx.clone(),
            })),
            Err(peer_mem) => Err(VerbsError::GpuRegistration {
                addr: dptr,
                len,
                dma_buf: dma_buf_err.to_string(),
                peer_mem: peer_mem.to_string(),
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
        let range = DmaBufRange {
            fd: buf.fd.as_fd(),
            offset: buf.offset,
            len,
            iova: dptr,
        };
        // SAFETY: DEVX context; `range` names a live dma-buf of an allocation the caller keeps
        // alive, and a range inside it.
        let umem = unsafe { ctx.driver().reg_dmabuf_umem(range, access)? };
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
        self.umem.id()
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
