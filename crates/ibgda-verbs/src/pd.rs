//! Protection domains.

use std::fmt;
use std::sync::Arc;

use crate::device::Context;
use crate::driver::DriverPd;
use crate::error::{Result, VerbsError};

/// A protection domain. Memory regions and QPs hold an `Arc` of it, so it is freed last.
pub struct ProtectionDomain {
    // Declared first: released before the context.
    handle: Box<dyn DriverPd>,
    ctx: Arc<Context>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.ctx.name())
            .field("pdn", &self.handle.pdn())
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a PD on `ctx` (`ibv_alloc_pd`) and reads its number (`mlx5dv_init_obj`).
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        let handle = ctx.driver().alloc_pd()?;
        Ok(Arc::new(Self {
            handle,
            ctx: ctx.clone(),
        }))
    }

    /// The PD number that firmware commands name (`qpc.pd`); mlx5 devices only.
    pub fn pdn(&self) -> Result<u32> {
        self.handle.pdn().ok_or_else(|| VerbsError::NotMlx5 {
            device: self.ctx.name().to_string(),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The driver's handle.
    pub(crate) fn handle(&self) -> &dyn DriverPd {
        &*self.handle
    }
}
