//! The emulated NIC behind `ibgda-verbs`' [`Driver`] seam: verbs calls become table entries
//! and engine registrations, DEVX command images go to the firmware decoders.

use std::any::Any;
use std::sync::Arc;

use ibgda_verbs::{
    AhRoute, AtomicCap, DeviceAttrs, DeviceInfo, DmaBufRange, Driver, DriverMr, DriverObj,
    DriverPd, DriverUar, DriverUmem, DvAttrs, GidEntry, GidType, LinkLayer, MemRange, PortInfo,
    PortState, Result as VerbsResult, UarKind, VerbsError,
};

use super::caps::{EmuCaps, EQN_BASE};
use super::objects::{write_refusal, Firmware, ObjKind, UmemRec};
use super::refusal::Refused;
use super::subnet::port_gid;
use crate::backend::Loc;
use crate::doorbell::UAR_PAGE_BYTES;
use crate::host::HostBuffer;
use crate::mr::{Access, Mr, Place};
use crate::nic::Nic;

/// `EREMOTEIO`: what the kernel returns with a firmware refusal in the output mailbox.
const EREMOTEIO: i32 = 121;
/// `EINVAL`.
const EINVAL: i32 = 22;
/// `EOPNOTSUPP`.
const EOPNOTSUPP: i32 = 95;

/// Offset of the doorbell (BlueFlame) register in a UAR page.
const BF_OFFSET: u64 = ibgda_device::wire::UAR_BF_OFFSET as u64;

/// One emulated mlx5 device: open it in `ibgda-verbs` with
/// [`Context::with_driver`](ibgda_verbs::Context::with_driver). Cloning gives another handle to
/// the same device (keep one to reach its [`Nic`] while the context owns the other).
#[derive(Clone, Debug)]
pub struct EmuDevice {
    fw: Arc<Firmware>,
    info: DeviceInfo,
}

impl EmuDevice {
    pub(crate) fn new(fw: Arc<Firmware>) -> Self {
        let info = DeviceInfo {
            name: fw.name.clone(),
            guid: fw.guid,
            node_type: 1,
            transport: 0,
            mlx5: true,
        };
        Self { fw, info }
    }

    /// The NIC that executes the device's QPs.
    pub fn nic(&self) -> &Nic {
        &self.fw.nic
    }

    /// The port's LID in the emulated subnet.
    pub fn lid(&self) -> u16 {
        self.fw.lid
    }

    /// The device's capabilities.
    pub fn caps(&self) -> &EmuCaps {
        &self.fw.caps
    }
}

/// The error of a call the emulator does not implement.
fn unsupported(call: &'static str, what: &str) -> VerbsError {
    tracing::debug!("emulated NIC: {call}: {what}");
    VerbsError::from_errno(call, EOPNOTSUPP)
}

/// The driver's answer to a refused command: the mailbox, and `EREMOTEIO` as the kernel gives.
fn refused(call: &'static str, out: &mut [u8], r: &Refused) -> VerbsError {
    tracing::debug!("emulated firmware: {r}");
    write_refusal(out, r);
    VerbsError::from_errno(call, if out.len() >= 16 { EREMOTEIO } else { EINVAL })
}

impl Driver for EmuDevice {
    fn kind(&self) -> &'static str {
        "ibgda-emu"
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn devx_unavailable(&self) -> Option<&str> {
        None
    }

    fn query_device(&self) -> VerbsResult<DeviceAttrs> {
        let c = &self.fw.caps;
        Ok(DeviceAttrs {
            fw_ver: "ibgda-emu firmware".into(),
            node_guid: self.fw.guid,
            vendor_id: 0x02c9,
            vendor_part_id: 0,
            hw_ver: 0,
            phys_port_cnt: 1,
            max_qp: 1 << 16,
            max_qp_wr: 1 << c.log_max_qp_sz,
            max_cq: 1 << 16,
            max_cqe: 1 << c.log_max_cq_sz,
            max_mr: 1 << 16,
            max_mr_size: 1 << c.log_max_msg,
            max_pd: 1 << 16,
            max_qp_rd_atom: 1 << c.log_max_ra_res_qp,
            max_qp_init_rd_atom: 1 << c.log_max_ra_req_qp,
            atomic_cap: AtomicCap::Hca,
        })
    }

    fn query_dv(&self) -> VerbsResult<DvAttrs> {
        Ok(DvAttrs {
            cqe_version: 1,
            flags: 0,
        })
    }

    fn query_port(&self, port: u8) -> VerbsResult<PortInfo> {
        if port != 1 {
            return Err(VerbsError::from_errno("ibv_query_port", EINVAL));
        }
        Ok(PortInfo {
            port,
            state: PortState::Active,
            link_layer: LinkLayer::InfiniBand,
            lid: self.fw.lid,
            sm_lid: 1,
            active_mtu: u32::from(self.fw.caps.max_mtu),
            max_mtu: u32::from(self.fw.caps.max_mtu),
            gid_tbl_len: 1,
            pkey_tbl_len: 1,
            active_width: 0,
            active_speed: 0,
            phys_state: 5,
        })
    }

    fn query_gids(&self, port: u8, table_len: u32) -> VerbsResult<Vec<GidEntry>> {
        if port != 1 {
            return Err(VerbsError::from_errno("ibv_query_gid_ex", EINVAL));
        }
        Ok((0..table_len.min(1))
            .map(|index| GidEntry {
                index,
                gid: port_gid(self.fw.guid),
                kind: GidType::Ib,
            })
            .collect())
    }

    fn query_eqn(&self, vector: u32) -> VerbsResult<u32> {
        if vector >= self.fw.caps.comp_vectors {
            return Err(VerbsError::from_errno("mlx5dv_devx_query_eqn", EINVAL));
        }
        Ok(EQN_BASE + vector)
    }

    fn alloc_pd(&self) -> VerbsResult<Box<dyn DriverPd>> {
        let pdn = self.fw.tables().new_pdn();
        Ok(Box::new(EmuPd {
            fw: self.fw.clone(),
            pdn,
        }))
    }

    unsafe fn reg_mr(
        &self,
        pd: &dyn DriverPd,
        mem: MemRange,
        access: ibgda_verbs::Access,
    ) -> VerbsResult<Box<dyn DriverMr>> {
        let own = pd
            .as_any()
            .downcast_ref::<EmuPd>()
            .is_some_and(|p| Arc::ptr_eq(&p.fw, &self.fw));
        if !own {
            return Err(VerbsError::from_errno("ibv_reg_mr", EINVAL));
        }
        let place = if mem.gpu { Place::Device } else { Place::Host };
        // SAFETY: the caller of `reg_mr` guarantees the range for the handle's lifetime, which
        // ends with the deregistration in EmuMr's Drop.
        let mr = unsafe {
            self.fw.nic.register_raw(
                mem.addr,
                mem.len as u64,
                place,
                Access::from_bits(access.bits()),
            )
        }
        .map_err(|e| {
            tracing::debug!("emulated NIC: ibv_reg_mr: {e}");
            VerbsError::from_errno("ibv_reg_mr", EINVAL)
        })?;
        Ok(Box::new(EmuMr {
            fw: self.fw.clone(),
            mr,
        }))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        _pd: &dyn DriverPd,
        _buf: DmaBufRange<'_>,
        _access: ibgda_verbs::Access,
    ) -> VerbsResult<Box<dyn DriverMr>> {
        Err(unsupported(
            "ibv_reg_dmabuf_mr",
            "the emulator reaches GPU memory by address (the peer-memory path)",
        ))
    }

    unsafe fn reg_umem(
        &self,
        mem: MemRange,
        _access: ibgda_verbs::Access,
    ) -> VerbsResult<Box<dyn DriverUmem>> {
        if mem.gpu && !self.fw.nic.backend().supports_device() {
            return Err(unsupported(
                "mlx5dv_devx_umem_reg",
                "GPU memory on the host backend",
            ));
        }
        let loc = if mem.gpu {
            Loc::Device(mem.addr)
        } else {
            Loc::Host(mem.addr)
        };
        let id = self.fw.tables().new_umem(UmemRec {
            loc,
            len: mem.len as u64,
        });
        Ok(Box::new(EmuUmem {
            fw: self.fw.clone(),
            id,
        }))
    }

    unsafe fn reg_dmabuf_umem(
        &self,
        _buf: DmaBufRange<'_>,
        _access: ibgda_verbs::Access,
    ) -> VerbsResult<Box<dyn DriverUmem>> {
        Err(unsupported(
            "mlx5dv_devx_umem_reg_ex(dma-buf)",
            "the emulator reaches GPU memory by address (the peer-memory path)",
        ))
    }

    fn alloc_uar(&self, _kind: UarKind) -> VerbsResult<Box<dyn DriverUar>> {
        // Every kind is the same emulated page: host memory the NIC polls (pinned and mapped
        // for GPUs on a CUDA NIC).
        let page = self
            .fw
            .nic
            .backend()
            .alloc_host(UAR_PAGE_BYTES)
            .map_err(|e| {
                tracing::debug!("emulated NIC: UAR page: {e}");
                VerbsError::from_errno("mlx5dv_devx_alloc_uar", 12)
            })?;
        let page = Arc::new(page);
        let id = self.fw.tables().new_uar(page.clone());
        Ok(Box::new(EmuUar {
            fw: self.fw.clone(),
            id,
            page,
        }))
    }

    fn devx_general_cmd(&self, input: &[u8], out: &mut [u8]) -> VerbsResult<()> {
        self.fw
            .general(input, out)
            .map_err(|r| refused("mlx5dv_devx_general_cmd", out, &r))
    }

    fn devx_obj_create(&self, input: &[u8], out: &mut [u8]) -> VerbsResult<Box<dyn DriverObj>> {
        match self.fw.create(input, out) {
            Ok(kind) => Ok(Box::new(EmuObj {
                fw: self.fw.clone(),
                kind,
            })),
            Err(r) => Err(refused("mlx5dv_devx_obj_create", out, &r)),
        }
    }

    fn roce_next_hop_mac(&self, _pd: &dyn DriverPd, _route: &AhRoute) -> VerbsResult<[u8; 6]> {
        Err(unsupported(
            "ibv_create_ah",
            "the emulated ports are InfiniBand: paths name LIDs, not MACs",
        ))
    }
}

/// A protection domain of the emulated device.
struct EmuPd {
    fw: Arc<Firmware>,
    pdn: u32,
}

impl DriverPd for EmuPd {
    fn pdn(&self) -> Option<u32> {
        Some(self.pdn)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for EmuPd {
    fn drop(&mut self) {
        self.fw.tables().pds.remove(&self.pdn);
    }
}

/// A registration with the emulated NIC.
struct EmuMr {
    fw: Arc<Firmware>,
    mr: Mr,
}

impl DriverMr for EmuMr {
    fn lkey(&self) -> u32 {
        self.mr.lkey
    }

    fn rkey(&self) -> u32 {
        self.mr.rkey
    }
}

impl Drop for EmuMr {
    fn drop(&mut self) {
        if let Err(e) = self.fw.nic.deregister(&self.mr) {
            tracing::error!("emulated NIC: ibv_dereg_mr: {e}");
        }
    }
}

/// A umem of the emulated device.
struct EmuUmem {
    fw: Arc<Firmware>,
    id: u32,
}

impl DriverUmem for EmuUmem {
    fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for EmuUmem {
    fn drop(&mut self) {
        self.fw.tables().umems.remove(&self.id);
    }
}

/// A UAR page of the emulated device.
struct EmuUar {
    fw: Arc<Firmware>,
    id: u32,
    page: Arc<HostBuffer>,
}

impl DriverUar for EmuUar {
    fn page_id(&self) -> u32 {
        self.id
    }

    fn register_ptr(&self) -> *mut u8 {
        (self.page.addr() + BF_OFFSET) as *mut u8
    }

    fn page_ptr(&self) -> *mut u8 {
        self.page.addr() as *mut u8
    }

    fn gpu_page(&self) -> Option<u64> {
        self.page.device_addr()
    }
}

impl Drop for EmuUar {
    fn drop(&mut self) {
        // QPs created on the page keep it alive in the engine until they are destroyed.
        self.fw.tables().uars.remove(&self.id);
    }
}

/// A CQ or QP of the emulated firmware.
struct EmuObj {
    fw: Arc<Firmware>,
    kind: ObjKind,
}

impl DriverObj for EmuObj {
    fn modify(&self, input: &[u8], out: &mut [u8]) -> VerbsResult<()> {
        self.fw
            .modify(self.kind, input, out)
            .map_err(|r| refused("mlx5dv_devx_obj_modify", out, &r))
    }

    fn query(&self, input: &[u8], out: &mut [u8]) -> VerbsResult<()> {
        self.fw
            .query(self.kind, input, out)
            .map_err(|r| refused("mlx5dv_devx_obj_query", out, &r))
    }
}

impl Drop for EmuObj {
    fn drop(&mut self) {
        if let Err(r) = self.fw.destroy(self.kind) {
            tracing::error!("emulated firmware: destroying {:?}: {r}", self.kind);
        }
    }
}
