//! The driver seam: every rdma-core, mlx5dv and DEVX call this crate makes goes through
//! [`Driver`] and the handles it returns.
//!
//! Two implementations exist: [`rdma_core`](crate::rdma_core), the libibverbs/libmlx5 calls a
//! ConnectX needs, and the emulated NIC (`ibgda-emu`'s firmware), which answers the same PRM
//! command images in software. Everything above the seam (the RAII objects, the command
//! builders, the connection typestate) is the same code for both, so the real path runs end to
//! end in CI except for the final ioctl.
//!
//! The seam is deliberately thin: it moves bytes and handles, never policy. Firmware commands
//! travel as PRM images ([`Driver::devx_obj_create`], [`DriverObj::modify`], ...): a driver
//! writes the command's output mailbox (status and syndrome included) into `out` whether the
//! command succeeded or not, and returns an error carrying `errno` when it did not; the caller
//! reads firmware's status from the mailbox.
//!
//! Handles release what they hold when dropped (`ibv_dealloc_pd`, `mlx5dv_devx_obj_destroy`,
//! ...). The objects of this crate drop a handle before the `Arc`s of what it was made from, so
//! a driver may assume a handle outlives nothing it depends on.

use std::any::Any;
use std::fmt;
use std::os::fd::BorrowedFd;

use crate::device::{DeviceAttrs, DeviceInfo, DvAttrs, GidEntry, PortInfo};
use crate::error::Result;
use crate::mr::Access;
use crate::uar::UarKind;

/// Memory handed to a registration by address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemRange {
    /// Start: a host pointer, or a GPU virtual address when `gpu` is set.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// The address is GPU memory (registered through peer memory, `nvidia-peermem`).
    pub gpu: bool,
}

/// GPU memory handed to a registration as a dma-buf.
#[derive(Clone, Copy, Debug)]
pub struct DmaBufRange<'a> {
    /// The dma-buf.
    pub fd: BorrowedFd<'a>,
    /// Offset of the range inside the dma-buf.
    pub offset: u64,
    /// Length in bytes.
    pub len: usize,
    /// The address work requests use for the start of the range (the GPU virtual address).
    pub iova: u64,
}

/// The route an address handle resolves (RoCE next-hop lookup).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AhRoute {
    /// Local port, 1-based.
    pub port: u8,
    /// Local GID index.
    pub sgid_index: u8,
    /// Destination GID, network order.
    pub dgid: [u8; 16],
    /// Hop limit.
    pub hop_limit: u8,
}

/// An opened device, as the objects of this crate use it.
///
/// Every method names, in its errors, the C call it stands for (`ibv_alloc_pd`,
/// `mlx5dv_devx_obj_create`, ...), whichever implementation answered.
pub trait Driver: Send + Sync + fmt::Debug {
    /// Which implementation this is (`"rdma-core"`, `"ibgda-emu"`), for messages.
    fn kind(&self) -> &'static str;

    /// What the device list says about the device.
    fn info(&self) -> &DeviceInfo;

    /// `None` when DEVX objects can be created, else why not.
    fn devx_unavailable(&self) -> Option<&str>;

    /// `ibv_query_device`.
    fn query_device(&self) -> Result<DeviceAttrs>;

    /// `mlx5dv_query_device` (mlx5 devices only).
    fn query_dv(&self) -> Result<DvAttrs>;

    /// `ibv_query_port` for `port` (1-based).
    fn query_port(&self, port: u8) -> Result<PortInfo>;

    /// The non-empty entries among the first `table_len` of `port`'s GID table.
    fn query_gids(&self, port: u8, table_len: u32) -> Result<Vec<GidEntry>>;

    /// `mlx5dv_devx_query_eqn`: the EQ behind completion vector `vector`.
    fn query_eqn(&self, vector: u32) -> Result<u32>;

    /// `ibv_alloc_pd` and the PD number (`mlx5dv_init_obj`).
    fn alloc_pd(&self) -> Result<Box<dyn DriverPd>>;

    /// `ibv_reg_mr` of `mem` in `pd`.
    ///
    /// # Safety
    /// `mem` must stay valid memory of the kind it names until the handle is dropped; the NIC
    /// reads and writes it whenever work requests say so.
    unsafe fn reg_mr(
        &self,
        pd: &dyn DriverPd,
        mem: MemRange,
        access: Access,
    ) -> Result<Box<dyn DriverMr>>;

    /// `ibv_reg_dmabuf_mr` of `buf` in `pd`.
    ///
    /// # Safety
    /// The dma-buf's memory must stay allocated until the handle is dropped.
    unsafe fn reg_dmabuf_mr(
        &self,
        pd: &dyn DriverPd,
        buf: DmaBufRange<'_>,
        access: Access,
    ) -> Result<Box<dyn DriverMr>>;

    /// `mlx5dv_devx_umem_reg` of `mem`.
    ///
    /// # Safety
    /// As [`reg_mr`](Driver::reg_mr): firmware objects placed in the umem are read and written
    /// by the NIC until they are destroyed.
    unsafe fn reg_umem(&self, mem: MemRange, access: Access) -> Result<Box<dyn DriverUmem>>;

    /// `mlx5dv_devx_umem_reg_ex` of a dma-buf.
    ///
    /// # Safety
    /// As [`reg_dmabuf_mr`](Driver::reg_dmabuf_mr).
    unsafe fn reg_dmabuf_umem(
        &self,
        buf: DmaBufRange<'_>,
        access: Access,
    ) -> Result<Box<dyn DriverUmem>>;

    /// `mlx5dv_devx_alloc_uar` of `kind`.
    fn alloc_uar(&self, kind: UarKind) -> Result<Box<dyn DriverUar>>;

    /// `mlx5dv_devx_general_cmd`: runs a command that creates no object. The output mailbox is
    /// written into `out` in every case.
    fn devx_general_cmd(&self, input: &[u8], out: &mut [u8]) -> Result<()>;

    /// `mlx5dv_devx_obj_create`: creates a firmware object from a `*_in` image. The output
    /// mailbox is written into `out` in every case.
    fn devx_obj_create(&self, input: &[u8], out: &mut [u8]) -> Result<Box<dyn DriverObj>>;

    /// The Ethernet MAC of the next hop towards `route.dgid` (`ibv_create_ah`, then the mlx5
    /// address vector).
    fn roce_next_hop_mac(&self, pd: &dyn DriverPd, route: &AhRoute) -> Result<[u8; 6]>;
}

/// A protection domain.
pub trait DriverPd: Send + Sync {
    /// The PD number firmware commands name (`None` on a device that is not mlx5).
    fn pdn(&self) -> Option<u32>;

    /// The handle as `Any`, so its driver can recognise its own handles.
    fn as_any(&self) -> &dyn Any;
}

/// A memory registration.
pub trait DriverMr: Send + Sync {
    /// The local key.
    fn lkey(&self) -> u32;

    /// The remote key.
    fn rkey(&self) -> u32;
}

/// A DEVX umem.
pub trait DriverUmem: Send + Sync {
    /// The umem id firmware commands name.
    fn id(&self) -> u32;
}

/// A DEVX UAR page mapped into this process.
pub trait DriverUar: Send + Sync {
    /// The page index CQ and QP contexts name (`uar_page`).
    fn page_id(&self) -> u32;

    /// CPU address of the doorbell register (the page + 0x800 on mlx5).
    fn register_ptr(&self) -> *mut u8;

    /// CPU address of the start of the page (null when the driver does not report it).
    fn page_ptr(&self) -> *mut u8;

    /// The GPU address of the page when the driver has mapped it into the GPUs already (the
    /// emulated NIC's page is pinned host memory mapped for every GPU); `None` when it must be
    /// registered as I/O memory ([`Uar::map_into_gpu`](crate::Uar::map_into_gpu) does).
    fn gpu_page(&self) -> Option<u64> {
        None
    }
}

/// A firmware object created through DEVX; destroyed when dropped (the driver builds the
/// matching destroy command itself, as the kernel does).
pub trait DriverObj: Send + Sync {
    /// `mlx5dv_devx_obj_modify` (a QP state transition). `out` receives the output mailbox.
    fn modify(&self, input: &[u8], out: &mut [u8]) -> Result<()>;

    /// `mlx5dv_devx_obj_query`. `out` receives the output mailbox.
    fn query(&self, input: &[u8], out: &mut [u8]) -> Result<()>;
}
