//! Real mlx5 resources for GPU-initiated RDMA (IBGDA).
//!
//! Owns: device discovery and capabilities, protection domains, memory registration (host and GPU
//! memory, dma-buf first), DEVX UAR / umem / CQ / QP objects whose rings live in GPU memory, and RC
//! connection bring-up (RST→INIT→RTR→RTS).
//!
//! Must not know about: the WQE wire format the GPU writes, the submit protocol, experts or tokens.
//! Nothing in this crate has run on a real NIC in this project's CI: see README.md.
//!
//! # Layers
//!
//! - [`Driver`]: the one seam every rdma-core / mlx5dv / DEVX call goes through (open and query,
//!   PD, MR and umem registration, UAR allocation, DEVX objects with PRM command bytes in and
//!   out). [`rdma_core`] implements it for a real ConnectX; `ibgda-emu`'s emulated firmware
//!   implements it too, and [`Context::with_driver`] runs everything below on either.
//! - [`prm`]: firmware command images (`CREATE_CQ`, `CREATE_QP`, the QP transitions,
//!   `QUERY_HCA_CAP`) built with a big-endian bit-field writer to the mlx5 PRM offsets. Pure
//!   data, tested byte by byte without hardware.
//! - Verbs and DEVX objects as RAII types, each holding an `Arc` of what it was made from, so
//!   nothing outlives its parent:
//!
//! ```text
//! Context ─┬─ ProtectionDomain ─┬─ MemoryRegion
//!          │                    └─ Qp<S> ──┬─ Cq ─┬─ Uar
//!          ├─ Uar ── GpuUarMapping          │      └─ Umem (CQ ring, CQ doorbell record)
//!          └─ Umem                          └─ Umem (work queue, QP doorbell record)
//! ```
//!
//! - Connection bring-up as a typestate: [`Qp<Reset>`](Qp) → [`Qp<Init>`](Qp) →
//!   [`Qp<Rtr>`](Qp) → [`Qp<Rts>`](Qp); a refused transition hands the QP back in its old state.
//!
//! # No device
//!
//! [`list_devices`] returns an empty list on a machine without RDMA (and [`no_device_hint`] says
//! why); every other entry point returns an error naming the C call and its `errno`. GPU
//! entry points check for `libcuda` first and return [`VerbsError::CudaDriverMissing`].
//!
//! ```no_run
//! use ibgda_verbs::{list_devices, no_device_hint, Context};
//! let devices = list_devices()?;
//! if devices.is_empty() {
//!     println!("{}", no_device_hint());
//! } else {
//!     let ctx = Context::open(&devices[0].name)?;
//!     let caps = ctx.capabilities()?;
//!     println!("{}: fw {}, DEVX {}", ctx.name(), caps.device.fw_ver, caps.devx);
//! }
//! # Ok::<(), ibgda_verbs::VerbsError>(())
//! ```

mod cq;
pub mod cuda;
mod device;
mod devx;
mod driver;
mod error;
mod ffi;
mod mr;
mod pd;
pub mod prm;
mod qp;
pub mod rdma_core;
mod uar;
mod umem;

pub use cq::{Cq, CqBuilder, CQE_SIZE, CQ_DBR_SIZE};
pub use device::{
    format_gid, no_device_hint, preferred_roce_gid, AtomicCap, Capabilities, Context, DeviceAttrs,
    DeviceInfo, DvAttrs, GidEntry, GidType, LinkLayer, PortInfo, PortState, SYSFS_INFINIBAND,
};
pub use driver::{
    AhRoute, DmaBufRange, Driver, DriverMr, DriverObj, DriverPd, DriverUar, DriverUmem, MemRange,
};
pub use error::{RdmaCoreMissing, Result, VerbsError, PEER_MAPPING_HINT};
pub use mr::{Access, GpuPath, MemoryKind, MemoryRegion};
pub use pd::ProtectionDomain;
pub use qp::{
    random_psn, resolve_roce_mac, roce_udp_sport, ConnectInfo, Init, InitAttrs, PathKind, Qp,
    QpBuilder, QpState, Reset, Rtr, RtrAttrs, Rts, RtsAttrs, TransitionError, QP_DBR_SIZE,
    WQEBB_SIZE,
};
pub use rdma_core::list_devices;
pub use uar::{GpuUarMapping, Uar, UarKind, DOORBELL_OFFSET, UAR_PAGE_SIZE};
pub use umem::{Umem, UmemAt};
