//! `ibgda-device`: what the GPU and the NIC agree on.
//!
//! Owns: the mlx5 wire format (segments, CQE, doorbell record) once, as Rust `#[repr(C)]` types and
//! as CUDA headers under `include/`, kept equal by static assertions on both sides; the device QP
//! descriptor the kernels read; the device submit/quiet protocol; the CPU proxy that rings doorbells
//! in the CPU NIC-handler modes; and [`cuda`], the checked entry to the CUDA driver.
//!
//! Must not know about: experts, tokens or the layouts of dispatch/combine.

pub mod cuda;
pub mod protocol;
pub mod proxy;
pub mod qp_desc;
pub mod stream_pool;
pub mod timeout;
pub mod wire;

/// Folder holding this crate's CUDA headers (`#include "ibgda/…"`), for build tools.
pub const INCLUDE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
