//! DEVX UARs (the NIC's doorbell pages) and their mapping into the GPU.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::cuda;
use crate::device::Context;
use crate::driver::DriverUar;
use crate::error::{Result, VerbsError};

/// Size of a UAR page as mapped into the process.
pub const UAR_PAGE_SIZE: usize = ibgda_device::wire::UAR_PAGE_BYTES;

/// Offset of the doorbell (BlueFlame) register in a UAR page (`MLX5_BF_OFFSET`).
pub const DOORBELL_OFFSET: usize = ibgda_device::wire::UAR_BF_OFFSET;

/// How a UAR page is mapped, in the order [`Uar::alloc`] tries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UarKind {
    /// A non-cached page of this context alone (rdma-core ≥ 45 and a recent kernel): the best
    /// for GPU doorbells, no other user shares the register.
    NcDedicated,
    /// The context's shared non-cached page.
    Nc,
    /// A write-combining BlueFlame page.
    Bf,
}

impl UarKind {
    /// The order of preference.
    pub const PREFERENCE: [UarKind; 3] = [UarKind::NcDedicated, UarKind::Nc, UarKind::Bf];
}

/// A DEVX UAR. CQs and QPs that ring through it hold an `Arc` of it.
pub struct Uar {
    // Declared first: freed before the context is released.
    uar: Box<dyn DriverUar>,
    kind: UarKind,
    ctx: Arc<Context>,
}

impl fmt::Debug for Uar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Uar")
            .field("kind", &self.kind)
            .field("page_id", &self.page_id())
            .finish()
    }
}

impl Uar {
    /// Allocates a UAR, trying non-cached dedicated, then non-cached, then BlueFlame.
    pub fn alloc(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        let mut last = None;
        for kind in UarKind::PREFERENCE {
            match Self::alloc_kind(ctx, kind) {
                Ok(uar) => return Ok(uar),
                Err(e) => {
                    tracing::debug!(device = %ctx.name(), ?kind, "UAR allocation failed: {e}");
                    if matches!(e, VerbsError::DevxUnavailable { .. }) {
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| VerbsError::Invalid("no UAR kind to try".into())))
    }

    /// Allocates a UAR of exactly `kind`.
    pub fn alloc_kind(ctx: &Arc<Context>, kind: UarKind) -> Result<Arc<Self>> {
        ctx.require_devx()?;
        let uar = ctx.driver().alloc_uar(kind)?;
        Ok(Arc::new(Self {
            uar,
            kind,
            ctx: ctx.clone(),
        }))
    }

    /// The page's kind.
    pub fn kind(&self) -> UarKind {
        self.kind
    }

    /// The UAR page index that CQ and QP contexts name (`uar_page`).
    pub fn page_id(&self) -> u32 {
        self.uar.page_id()
    }

    /// CPU address of the doorbell register (UAR + 0x800), mapped into this process.
    pub fn register_ptr(&self) -> *mut u8 {
        self.uar.register_ptr()
    }

    /// CPU address of the start of the UAR page.
    pub fn page_ptr(&self) -> *mut u8 {
        let base = self.uar.page_ptr();
        if base.is_null() {
            ((self.register_ptr() as usize) & !(UAR_PAGE_SIZE - 1)) as *mut u8
        } else {
            base
        }
    }

    /// Offset of the doorbell register within the page.
    pub fn register_offset(&self) -> usize {
        self.register_ptr() as usize - self.page_ptr() as usize
    }

    /// Rings the doorbell from the CPU: one 64-bit store of the first 8 bytes of a control
    /// segment (already big-endian) to the register.
    ///
    /// The caller must have written the WQE and the doorbell record before (a release fence is
    /// issued here so those stores are visible to the NIC first).
    pub fn ring_doorbell(&self, ctrl_first_8_bytes: [u8; 8]) {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        let reg = self.register_ptr().cast::<u64>();
        // SAFETY: `reg` is the live, 8-byte-aligned doorbell register of this UAR; MMIO takes a
        // single 64-bit store, which `write_volatile` of a u64 is on every 64-bit target.
        unsafe { reg.write_volatile(u64::from_ne_bytes(ctrl_first_8_bytes)) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Maps the UAR page into `cuda`'s GPU so kernels can ring the doorbell themselves
    /// (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_IOMEMORY`).
    ///
    /// Fails with [`VerbsError::GpuDoorbellMappingNotPermitted`] when the NVIDIA driver does not
    /// allow it (no `PeerMappingOverride=1`); the CPU NIC-handler modes are the way out.
    ///
    /// A page its driver has mapped for the GPUs already (the emulated NIC's) is used as it is.
    pub fn map_into_gpu(self: &Arc<Self>, cuda: &Arc<CudaContext>) -> Result<GpuUarMapping> {
        let page = self.page_ptr();
        if let Some(device_page) = self.uar.gpu_page() {
            return Ok(GpuUarMapping {
                device_page,
                host_page: page,
                registered: false,
                uar: self.clone(),
                cuda: cuda.clone(),
            });
        }
        // SAFETY: the page is the UAR's live, page-aligned mapping; the returned mapping holds
        // the Arc<Uar> and unregisters before the UAR can be freed.
        let device_page = unsafe { cuda::register_io_memory(cuda, page, UAR_PAGE_SIZE)? };
        Ok(GpuUarMapping {
            device_page,
            host_page: page,
            registered: true,
            uar: self.clone(),
            cuda: cuda.clone(),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

/// A UAR page mapped into a GPU's address space. Unmapped on drop, before the UAR is freed.
pub struct GpuUarMapping {
    device_page: u64,
    host_page: *mut u8,
    /// Registered by `map_into_gpu` (and so unregistered on drop), not mapped by the driver.
    registered: bool,
    uar: Arc<Uar>,
    cuda: Arc<CudaContext>,
}

// SAFETY: holds a registered host range and the GPU address for it; no CPU access through it;
// unregistration in Drop is a driver call valid from any thread once the context is bound.
unsafe impl Send for GpuUarMapping {}
// SAFETY: `&GpuUarMapping` only reads immutable addresses.
unsafe impl Sync for GpuUarMapping {}

impl fmt::Debug for GpuUarMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuUarMapping")
            .field("device_page", &format_args!("{:#x}", self.device_page))
            .finish()
    }
}

impl GpuUarMapping {
    /// GPU address of the UAR page.
    pub fn device_page(&self) -> u64 {
        self.device_page
    }

    /// GPU address of the doorbell register (page + 0x800), where kernels store 8 bytes.
    pub fn doorbell_device_ptr(&self) -> u64 {
        self.device_page + self.uar.register_offset() as u64
    }

    /// The UAR.
    pub fn uar(&self) -> &Arc<Uar> {
        &self.uar
    }
}

impl Drop for GpuUarMapping {
    fn drop(&mut self) {
        if !self.registered {
            return;
        }
        // SAFETY: the page was registered by `map_into_gpu`; the owner guarantees no kernel still
        // rings through it (it dropped the mapping).
        if let Err(e) = unsafe { cuda::unregister_io_memory(&self.cuda, self.host_page) } {
            tracing::error!("unmapping UAR from the GPU: {e}");
        }
    }
}
