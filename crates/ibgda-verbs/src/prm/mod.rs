//! Firmware command images for DEVX, built to the mlx5 PRM field offsets.
//!
//! The commands this crate sends through `mlx5dv_devx_obj_create` / `_modify` /
//! `mlx5dv_devx_general_cmd` are plain byte images in the layout of the kernel's
//! `include/linux/mlx5/mlx5_ifc.h`. [`BitWriter`] sets big-endian bit fields by (offset, width);
//! [`layout`] names every field used, with its PRM struct and offset; the builders
//! ([`CreateCq`], [`CreateQp`], [`Rst2Init`], [`Init2Rtr`], [`Rtr2Rts`], [`QueryHcaCap`]) take
//! typed inputs and produce images that the tests check byte by byte against those offsets.
//! Nothing here touches a device.

mod bits;
mod cmd_cq;
mod cmd_hca;
mod cmd_qp;
pub mod layout;
mod status;

pub use bits::{BitReader, BitWriter, Field, PrmError};
pub use cmd_cq::{parse_create_cq_out, CreateCq, UmemRef};
pub use cmd_hca::{
    capability_page, AtomicCaps, AtomicMode, GeneralCaps, HcaCap, QueryHcaCap, TsFormat,
};
pub use cmd_qp::{
    parse_create_qp_out, parse_modify_qp_out, parse_query_qp_out, AddressPath, CreateQp,
    FirmwareQpState, Grh, Init2Rtr, Mtu, QpContext, QueryQp, RemoteAccess, RqSpec, Rst2Init,
    Rtr2Rts,
};
pub use status::{check_output, status_text, CommandFailed};
