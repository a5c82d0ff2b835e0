//! Real mlx5 resources for GPU-initiated RDMA (IBGDA).
//!
//! Owns: device discovery and capabilities, protection domains, memory registration (host and GPU
//! memory, dma-buf first), DEVX UAR / umem / CQ / QP objects whose rings live in GPU memory, and RC
//! connection bring-up (RST→INIT→RTR→RTS).
//!
//! Must not know about: the WQE wire format the GPU writes, the submit protocol, experts or tokens.
//! Nothing in this crate has run on a real NIC in this project's CI: see README.md.
