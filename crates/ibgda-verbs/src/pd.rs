//! Protection domains.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::Context;
use crate::devx::rc_error;
use crate::error::{Result, VerbsError};
use crate::ffi;

/// A protection domain. Memory regions and QPs hold an `Arc` of it, so it is freed last.
pub struct ProtectionDomain {
    pd: NonNull<ffi::ibv_pd>,
    pdn: Option<u32>,
    ctx: Arc<Context>,
}

// SAFETY: a PD is a kernel handle used only through thread-safe verbs; owned, freed in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: `&ProtectionDomain` only hands the pointer to thread-safe verbs.
unsafe impl Sync for ProtectionDomain {}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.ctx.name())
            .field("pdn", &self.pdn)
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a PD on `ctx` (`ibv_alloc_pd`) and reads its number (`mlx5dv_init_obj`).
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        // SAFETY: the context is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.raw()) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsError::last_os("ibv_alloc_pd"))?;
        let mut this = Self {
            pd,
            pdn: None,
            ctx: ctx.clone(),
        };
        if ctx.info().mlx5 {
            let mut dv_pd = ffi::mlx5dv_pd::default();
            let mut obj = ffi::mlx5dv_obj::default();
            obj.pd.in_ = pd.as_ptr();
            obj.pd.out = &mut dv_pd;
            // SAFETY: `obj` names a live PD of an mlx5 context and a valid output struct.
            let rc = unsafe { ffi::mlx5dv_init_obj(&mut obj, u64::from(ffi::MLX5DV_OBJ_PD)) };
            if rc != 0 {
                return Err(rc_error("mlx5dv_init_obj(PD)", rc));
            }
            this.pdn = Some(dv_pd.pdn);
        }
        Ok(Arc::new(this))
    }

    /// The PD number that firmware commands name (`qpc.pd`); mlx5 devices only.
    pub fn pdn(&self) -> Result<u32> {
        self.pdn.ok_or_else(|| VerbsError::NotMlx5 {
            device: self.ctx.name().to_string(),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR, QP and AH of this PD holds an Arc to it and is already gone.
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::error!(device = %self.ctx.name(), "{}", rc_error("ibv_dealloc_pd", rc));
        }
    }
}
