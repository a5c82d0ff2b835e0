//! The handles rdma-core hands out (PD, MR, umem, UAR, DEVX object), each freed on drop.

use std::any::Any;
use std::ptr::NonNull;

use super::loader::Api;
use crate::driver::{DriverMr, DriverObj, DriverPd, DriverUar, DriverUmem};
use crate::error::{rc_error, Result, VerbsError};
use crate::ffi;

/// `ibv_pd`, with its number when the device is mlx5.
pub(super) struct RcPd {
    api: &'static Api,
    pd: NonNull<ffi::ibv_pd>,
    pdn: Option<u32>,
}

// SAFETY: a PD is a kernel handle used only through thread-safe verbs; owned, freed in Drop.
unsafe impl Send for RcPd {}
// SAFETY: `&RcPd` only hands the pointer to thread-safe verbs.
unsafe impl Sync for RcPd {}

impl RcPd {
    pub(super) fn alloc(api: &'static Api, ctx: *mut ffi::ibv_context, mlx5: bool) -> Result<Self> {
        // SAFETY: the caller passes an open context.
        let pd = unsafe { (api.alloc_pd)(ctx) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsError::last_os("ibv_alloc_pd"))?;
        let mut this = Self { api, pd, pdn: None };
        if mlx5 {
            let mut dv_pd = ffi::mlx5dv_pd::default();
            let mut obj = ffi::mlx5dv_obj::default();
            obj.pd.in_ = pd.as_ptr();
            obj.pd.out = &mut dv_pd;
            // SAFETY: `obj` names a live PD of an mlx5 context and a valid output struct.
            let rc = unsafe { (api.mlx5_init_obj)(&mut obj, u64::from(ffi::MLX5DV_OBJ_PD)) };
            if rc != 0 {
                // `this` drops here and deallocates the PD.
                return Err(rc_error("mlx5dv_init_obj(PD)", rc));
            }
            this.pdn = Some(dv_pd.pdn);
        }
        Ok(this)
    }

    pub(super) fn raw(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }
}

impl DriverPd for RcPd {
    fn pdn(&self) -> Option<u32> {
        self.pdn
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for RcPd {
    fn drop(&mut self) {
        // SAFETY: every MR, QP and AH of this PD is gone (their owners hold the PD).
        let rc = unsafe { (self.api.dealloc_pd)(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", rc_error("ibv_dealloc_pd", rc));
        }
    }
}

/// `ibv_mr`.
pub(super) struct RcMr(&'static Api, NonNull<ffi::ibv_mr>);

// SAFETY: an MR is a kernel handle; deregistration is the only operation and happens in Drop.
unsafe impl Send for RcMr {}
// SAFETY: `&RcMr` only reads the immutable keys.
unsafe impl Sync for RcMr {}

impl RcMr {
    pub(super) fn new(api: &'static Api, mr: NonNull<ffi::ibv_mr>) -> Self {
        Self(api, mr)
    }
}

impl DriverMr for RcMr {
    fn lkey(&self) -> u32 {
        // SAFETY: the MR is live; lkey is set at registration and never changes.
        unsafe { (*self.1.as_ptr()).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as `lkey`.
        unsafe { (*self.1.as_ptr()).rkey }
    }
}

impl Drop for RcMr {
    fn drop(&mut self) {
        // SAFETY: the MR is live and deregistered once.
        let rc = unsafe { (self.0.dereg_mr)(self.1.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", rc_error("ibv_dereg_mr", rc));
        }
    }
}

/// `mlx5dv_devx_umem`.
pub(super) struct RcUmem(&'static Api, NonNull<ffi::mlx5dv_devx_umem>);

// SAFETY: a umem is a kernel handle; deregistration in Drop is the only operation on it.
unsafe impl Send for RcUmem {}
// SAFETY: `&RcUmem` only reads the immutable id.
unsafe impl Sync for RcUmem {}

impl RcUmem {
    pub(super) fn new(api: &'static Api, umem: NonNull<ffi::mlx5dv_devx_umem>) -> Self {
        Self(api, umem)
    }
}

impl DriverUmem for RcUmem {
    fn id(&self) -> u32 {
        // SAFETY: the umem is live; umem_id is set at registration.
        unsafe { (*self.1.as_ptr()).umem_id }
    }
}

impl Drop for RcUmem {
    fn drop(&mut self) {
        // SAFETY: every CQ/QP placed in this umem is gone (their owners hold the umem).
        let rc = unsafe { (self.0.devx_umem_dereg)(self.1.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", rc_error("mlx5dv_devx_umem_dereg", rc));
        }
    }
}

/// `mlx5dv_devx_uar`.
pub(super) struct RcUar(&'static Api, NonNull<ffi::mlx5dv_devx_uar>);

// SAFETY: the UAR is a kernel object plus an mmapped page; the page is only written through
// single 64-bit volatile stores, which the NIC accepts from any thread, and freed in Drop.
unsafe impl Send for RcUar {}
// SAFETY: as above.
unsafe impl Sync for RcUar {}

impl RcUar {
    pub(super) fn new(api: &'static Api, uar: NonNull<ffi::mlx5dv_devx_uar>) -> Self {
        Self(api, uar)
    }
}

impl DriverUar for RcUar {
    fn page_id(&self) -> u32 {
        // SAFETY: the UAR is live; page_id is set at allocation.
        unsafe { (*self.1.as_ptr()).page_id }
    }

    fn register_ptr(&self) -> *mut u8 {
        // SAFETY: the UAR is live; reg_addr is set at allocation.
        unsafe { (*self.1.as_ptr()).reg_addr.cast() }
    }

    fn page_ptr(&self) -> *mut u8 {
        // SAFETY: the UAR is live.
        unsafe { (*self.1.as_ptr()).base_addr.cast() }
    }
}

impl Drop for RcUar {
    fn drop(&mut self) {
        // SAFETY: every CQ/QP/GPU mapping using the page is gone (their owners hold the UAR).
        unsafe { (self.0.devx_free_uar)(self.1.as_ptr()) }
    }
}

/// `mlx5dv_devx_obj`.
pub(super) struct RcDevxObj(&'static Api, NonNull<ffi::mlx5dv_devx_obj>);

// SAFETY: DEVX objects are handles to kernel objects; rdma-core's DEVX calls on them are
// thread-safe, and the pointer is owned and freed only in Drop.
unsafe impl Send for RcDevxObj {}
// SAFETY: `&RcDevxObj` only allows modify and query, thread-safe ioctls.
unsafe impl Sync for RcDevxObj {}

impl RcDevxObj {
    pub(super) fn new(api: &'static Api, obj: NonNull<ffi::mlx5dv_devx_obj>) -> Self {
        Self(api, obj)
    }
}

impl DriverObj for RcDevxObj {
    fn modify(&self, input: &[u8], out: &mut [u8]) -> Result<()> {
        // SAFETY: the object is live; `input` and `out` are valid buffers of the lengths passed.
        let rc = unsafe {
            (self.0.devx_obj_modify)(
                self.1.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if rc != 0 {
            return Err(rc_error("mlx5dv_devx_obj_modify", rc));
        }
        Ok(())
    }

    fn query(&self, input: &[u8], out: &mut [u8]) -> Result<()> {
        // SAFETY: as `modify`.
        let rc = unsafe {
            (self.0.devx_obj_query)(
                self.1.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if rc != 0 {
            return Err(rc_error("mlx5dv_devx_obj_query", rc));
        }
        Ok(())
    }
}

impl Drop for RcDevxObj {
    fn drop(&mut self) {
        // SAFETY: the object is live and destroyed exactly once; objects that reference it (a QP
        // referencing a CQ) are gone first, their owners holding Arcs of its owner.
        let rc = unsafe { (self.0.devx_obj_destroy)(self.1.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                "destroying a DEVX object: {}",
                rc_error("mlx5dv_devx_obj_destroy", rc)
            );
        }
    }
}
