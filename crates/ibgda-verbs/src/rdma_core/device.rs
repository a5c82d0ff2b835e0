//! An opened rdma-core device context and the [`Driver`] calls made on it.

use std::ffi::CStr;
use std::ptr::NonNull;

use super::handles::{RcDevxObj, RcMr, RcPd, RcUar, RcUmem};
use super::loader::Api;
use crate::device::{
    AtomicCap, DeviceAttrs, DeviceInfo, DvAttrs, GidEntry, GidType, LinkLayer, PortInfo, PortState,
};
use crate::driver::{
    AhRoute, DmaBufRange, Driver, DriverMr, DriverObj, DriverPd, DriverUar, DriverUmem, MemRange,
};
use crate::error::{rc_error, Result, VerbsError};
use crate::ffi;
use crate::mr::Access;
use crate::uar::UarKind;

/// Page sizes the NIC may use to map a umem: every power of two from 4 KiB up.
const PGSZ_BITMAP: u64 = !0xfff;

/// A device opened through libibverbs (with DEVX when it is mlx5 and the kernel allows it).
#[derive(Debug)]
pub struct RdmaCoreDevice {
    api: &'static Api,
    ctx: NonNull<ffi::ibv_context>,
    info: DeviceInfo,
    /// `None` when opened through `mlx5dv_open_device` with DEVX, else why not.
    devx_unavailable: Option<String>,
}

// SAFETY: libibverbs and libmlx5 document every verb on a context as thread-safe; the pointer is
// owned by this value and only freed in Drop, after every handle made from it is gone (the
// objects holding handles hold the `Context` that owns this value).
unsafe impl Send for RdmaCoreDevice {}
// SAFETY: as above; `&RdmaCoreDevice` only passes the pointer to thread-safe verbs.
unsafe impl Sync for RdmaCoreDevice {}

impl RdmaCoreDevice {
    pub(super) fn open(
        api: &'static Api,
        dev: *mut ffi::ibv_device,
        info: DeviceInfo,
    ) -> Result<Self> {
        let mut devx_unavailable = Some(String::from("not an mlx5 device"));
        let mut ctx = std::ptr::null_mut();
        if info.mlx5 {
            let mut attr = ffi::mlx5dv_context_attr {
                flags: ffi::MLX5DV_CONTEXT_FLAGS_DEVX,
                comp_mask: 0,
            };
            // SAFETY: `dev` is a live list entry and `attr` a valid attribute struct.
            ctx = unsafe { (api.mlx5_open_device)(dev, &mut attr) };
            if ctx.is_null() {
                let e = VerbsError::last_os("mlx5dv_open_device(DEVX)");
                tracing::warn!(device = %info.name, "DEVX unavailable: {e}");
                devx_unavailable = Some(e.to_string());
            } else {
                devx_unavailable = None;
            }
        }
        if ctx.is_null() {
            // SAFETY: `dev` is a live list entry.
            ctx = unsafe { (api.open_device)(dev) };
        }
        let ctx = NonNull::new(ctx).ok_or_else(|| VerbsError::last_os("ibv_open_device"))?;
        Ok(Self {
            api,
            ctx,
            info,
            devx_unavailable,
        })
    }

    fn raw(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }

    fn own_pd<'a>(&self, pd: &'a dyn DriverPd) -> Result<&'a RcPd> {
        pd.as_any()
            .downcast_ref::<RcPd>()
            .ok_or_else(|| VerbsError::Invalid("a protection domain of another driver".into()))
    }

    fn untyped_gid(&self, port: u8, index: u32) -> Option<GidEntry> {
        // SAFETY: ibv_gid is plain data.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` a valid out-pointer.
        let rc = unsafe { (self.api.query_gid)(self.raw(), port, index as i32, &mut gid) };
        if rc != 0 {
            return None;
        }
        // SAFETY: both union views are 16 plain bytes.
        let raw = unsafe { gid.raw };
        (raw != [0; 16]).then_some(GidEntry {
            index,
            gid: raw,
            kind: GidType::Unknown,
        })
    }
}

impl Drop for RdmaCoreDevice {
    fn drop(&mut self) {
        // SAFETY: every handle made from this context is gone (see the Send comment).
        let rc = unsafe { (self.api.close_device)(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::error!(device = %self.info.name, "{}", rc_error("ibv_close_device", rc));
        }
    }
}

impl Driver for RdmaCoreDevice {
    fn kind(&self) -> &'static str {
        "rdma-core"
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn devx_unavailable(&self) -> Option<&str> {
        self.devx_unavailable.as_deref()
    }

    fn query_device(&self) -> Result<DeviceAttrs> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid bit pattern.
        let mut a: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `a` is a valid out-pointer.
        let rc = unsafe { (self.api.query_device)(self.raw(), &mut a) };
        if rc != 0 {
            return Err(rc_error("ibv_query_device", rc));
        }
        // SAFETY: fw_ver is a NUL-terminated array filled by the provider.
        let fw = unsafe { CStr::from_ptr(a.fw_ver.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok(DeviceAttrs {
            fw_ver: fw,
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            hw_ver: a.hw_ver,
            phys_port_cnt: a.phys_port_cnt,
            max_qp: a.max_qp,
            max_qp_wr: a.max_qp_wr,
            max_cq: a.max_cq,
            max_cqe: a.max_cqe,
            max_mr: a.max_mr,
            max_mr_size: a.max_mr_size,
            max_pd: a.max_pd,
            max_qp_rd_atom: a.max_qp_rd_atom,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom,
            atomic_cap: AtomicCap::from_raw(a.atomic_cap),
        })
    }

    fn query_dv(&self) -> Result<DvAttrs> {
        let mut dv = ffi::mlx5dv_context::default();
        // SAFETY: the caller checked the context is mlx5; `dv` is a valid out-pointer with
        // comp_mask 0.
        let rc = unsafe { (self.api.mlx5_query_device)(self.raw(), &mut dv) };
        if rc != 0 {
            return Err(rc_error("mlx5dv_query_device", rc));
        }
        Ok(DvAttrs {
            cqe_version: u8::from(dv.flags & u64::from(ffi::MLX5DV_CONTEXT_FLAGS_CQE_V1) != 0),
            flags: dv.flags,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortInfo> {
        // SAFETY: ibv_port_attr is plain data; zero is a valid bit pattern.
        let mut a: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `a` is a valid out-pointer to a whole `ibv_port_attr`
        // (the provider fills it entirely; the legacy entry point takes the same pointer).
        let rc = unsafe { (self.api.query_port)(self.raw(), port, &mut a) };
        if rc != 0 {
            return Err(rc_error("ibv_query_port", rc));
        }
        Ok(PortInfo {
            port,
            state: PortState::from_raw(a.state),
            link_layer: LinkLayer::from_raw(a.link_layer),
            lid: a.lid,
            sm_lid: a.sm_lid,
            active_mtu: a.active_mtu,
            max_mtu: a.max_mtu,
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            pkey_tbl_len: a.pkey_tbl_len,
            active_width: a.active_width,
            active_speed: a.active_speed,
            phys_state: a.phys_state,
        })
    }

    fn query_gids(&self, port: u8, table_len: u32) -> Result<Vec<GidEntry>> {
        let mut out = Vec::new();
        let mut typed = self.api.query_gid_ex;
        for index in 0..table_len {
            if let Some(query_gid_ex) = typed {
                let mut e = ffi::ibv_gid_entry {
                    // SAFETY: ibv_gid is a plain 16-byte union; zero is valid.
                    gid: unsafe { std::mem::zeroed() },
                    gid_index: 0,
                    port_num: 0,
                    gid_type: 0,
                    ndev_ifindex: 0,
                };
                // SAFETY: the context is open; `e` is a valid out-pointer of the size passed.
                let rc = unsafe {
                    query_gid_ex(
                        self.raw(),
                        u32::from(port),
                        index,
                        &mut e,
                        0,
                        std::mem::size_of::<ffi::ibv_gid_entry>(),
                    )
                };
                match rc.abs() {
                    0 => {
                        // SAFETY: both union views are 16 plain bytes.
                        let raw = unsafe { e.gid.raw };
                        if raw != [0; 16] {
                            out.push(GidEntry {
                                index,
                                gid: raw,
                                kind: GidType::from_raw(e.gid_type),
                            });
                        }
                        continue;
                    }
                    // ENODATA / EINVAL: an empty or unusable slot.
                    61 | 22 => continue,
                    // Older kernels or libraries: fall back to the untyped query.
                    _ => typed = None,
                }
            }
            out.extend(self.untyped_gid(port, index));
        }
        Ok(out)
    }

    fn query_eqn(&self, vector: u32) -> Result<u32> {
        let mut eqn = 0u32;
        // SAFETY: DEVX context (the caller checked), valid out-pointer.
        let rc = unsafe { (self.api.devx_query_eqn)(self.raw(), vector, &mut eqn) };
        if rc != 0 {
            return Err(rc_error("mlx5dv_devx_query_eqn", rc));
        }
        Ok(eqn)
    }

    fn alloc_pd(&self) -> Result<Box<dyn DriverPd>> {
        Ok(Box::new(RcPd::alloc(self.api, self.raw(), self.info.mlx5)?))
    }

    unsafe fn reg_mr(
        &self,
        pd: &dyn DriverPd,
        mem: MemRange,
        access: Access,
    ) -> Result<Box<dyn DriverMr>> {
        let pd = self.own_pd(pd)?;
        // SAFETY: the caller guarantees the range is live for the handle's lifetime; for GPU
        // memory the kernel (nvidia-peermem) validates and pins it.
        let mr = unsafe {
            (self.api.reg_mr)(pd.raw(), mem.addr as *mut _, mem.len, access.bits() as i32)
        };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::last_os("ibv_reg_mr"))?;
        Ok(Box::new(RcMr::new(self.api, mr)))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: &dyn DriverPd,
        buf: DmaBufRange<'_>,
        access: Access,
    ) -> Result<Box<dyn DriverMr>> {
        use std::os::fd::AsRawFd;
        let pd = self.own_pd(pd)?;
        let reg_dmabuf_mr = self
            .api
            .reg_dmabuf_mr
            .ok_or_else(|| VerbsError::from_errno("ibv_reg_dmabuf_mr", 95))?;
        // SAFETY: `buf.fd` is a live dma-buf and the range lies inside it; iova = the GPU
        // virtual address so that work requests address the region by it.
        let mr = unsafe {
            reg_dmabuf_mr(
                pd.raw(),
                buf.offset,
                buf.len,
                buf.iova,
                buf.fd.as_raw_fd(),
                access.bits() as i32,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::last_os("ibv_reg_dmabuf_mr"))?;
        Ok(Box::new(RcMr::new(self.api, mr)))
    }

    unsafe fn reg_umem(&self, mem: MemRange, access: Access) -> Result<Box<dyn DriverUmem>> {
        // SAFETY: DEVX context; the caller guarantees the range.
        let umem = unsafe {
            (self.api.devx_umem_reg)(self.raw(), mem.addr as *mut _, mem.len, access.bits())
        };
        let umem = NonNull::new(umem).ok_or_else(|| VerbsError::last_os("mlx5dv_devx_umem_reg"))?;
        Ok(Box::new(RcUmem::new(self.api, umem)))
    }

    unsafe fn reg_dmabuf_umem(
        &self,
        buf: DmaBufRange<'_>,
        access: Access,
    ) -> Result<Box<dyn DriverUmem>> {
        use std::os::fd::AsRawFd;
        let umem_reg_ex = self
            .api
            .devx_umem_reg_ex
            .ok_or_else(|| VerbsError::from_errno("mlx5dv_devx_umem_reg_ex", 95))?;
        // With a dma-buf the kernel reads `addr` as the offset into the buffer.
        let mut input = ffi::mlx5dv_devx_umem_in {
            addr: buf.offset as *mut _,
            size: buf.len,
            access: access.bits(),
            pgsz_bitmap: PGSZ_BITMAP,
            comp_mask: u64::from(ffi::MLX5DV_UMEM_MASK_DMABUF),
            dmabuf_fd: buf.fd.as_raw_fd(),
        };
        // SAFETY: DEVX context; `input` names a live dma-buf and a range inside it.
        let umem = unsafe { umem_reg_ex(self.raw(), &mut input) };
        let umem = NonNull::new(umem)
            .ok_or_else(|| VerbsError::last_os("mlx5dv_devx_umem_reg_ex(dma-buf)"))?;
        Ok(Box::new(RcUmem::new(self.api, umem)))
    }

    fn alloc_uar(&self, kind: UarKind) -> Result<Box<dyn DriverUar>> {
        let flag = match kind {
            UarKind::NcDedicated => ffi::MLX5DV_UAR_ALLOC_TYPE_NC_DEDICATED,
            UarKind::Nc => ffi::MLX5DV_UAR_ALLOC_TYPE_NC,
            UarKind::Bf => ffi::MLX5DV_UAR_ALLOC_TYPE_BF,
        };
        // SAFETY: DEVX context; the flag is one of the documented allocation types.
        let uar = unsafe { (self.api.devx_alloc_uar)(self.raw(), flag) };
        let uar = NonNull::new(uar).ok_or_else(|| VerbsError::last_os("mlx5dv_devx_alloc_uar"))?;
        Ok(Box::new(RcUar::new(self.api, uar)))
    }

    fn devx_general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<()> {
        // SAFETY: DEVX context; `input` and `out` are valid buffers of the lengths passed.
        let rc = unsafe {
            (self.api.devx_general_cmd)(
                self.raw(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if rc != 0 {
            return Err(rc_error("mlx5dv_devx_general_cmd", rc));
        }
        Ok(())
    }

    fn devx_obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<Box<dyn DriverObj>> {
        // SAFETY: DEVX context; `input` and `out` are valid buffers of the lengths passed.
        let obj = unsafe {
            (self.api.devx_obj_create)(
                self.raw(),
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        let obj = NonNull::new(obj).ok_or_else(|| VerbsError::last_os("mlx5dv_devx_obj_create"))?;
        Ok(Box::new(RcDevxObj::new(self.api, obj)))
    }

    fn roce_next_hop_mac(&self, pd: &dyn DriverPd, route: &AhRoute) -> Result<[u8; 6]> {
        let pd = self.own_pd(pd)?;
        let mut attr = ffi::ibv_ah_attr {
            grh: ffi::ibv_global_route {
                dgid: ffi::ibv_gid { raw: route.dgid },
                flow_label: 0,
                sgid_index: route.sgid_index,
                hop_limit: route.hop_limit,
                traffic_class: 0,
            },
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: route.port,
        };
        // SAFETY: live PD; `attr` is a fully initialised ibv_ah_attr.
        let ah = unsafe { (self.api.create_ah)(pd.raw(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(|| VerbsError::last_os("ibv_create_ah"))?;
        struct Ah(&'static Api, NonNull<ffi::ibv_ah>);
        impl Drop for Ah {
            fn drop(&mut self) {
                // SAFETY: created above, destroyed once.
                unsafe { (self.0.destroy_ah)(self.1.as_ptr()) };
            }
        }
        let ah = Ah(self.api, ah);
        let mut dv_ah = ffi::mlx5dv_ah::default();
        let mut obj = ffi::mlx5dv_obj::default();
        obj.ah.in_ = ah.1.as_ptr();
        obj.ah.out = &mut dv_ah;
        // SAFETY: `obj` names a live AH of an mlx5 context and a valid output struct.
        let rc = unsafe { (self.api.mlx5_init_obj)(&mut obj, u64::from(ffi::MLX5DV_OBJ_AH)) };
        if rc != 0 {
            return Err(rc_error("mlx5dv_init_obj(AH)", rc));
        }
        if dv_ah.av.is_null() {
            return Err(VerbsError::Invalid(
                "mlx5dv_init_obj(AH) returned no address vector".into(),
            ));
        }
        // SAFETY: the address vector lives inside the AH, which is alive until `ah` drops.
        Ok(unsafe { (*dv_ah.av).rmac })
    }
}
