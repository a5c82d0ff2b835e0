//! Launch parameters of the internode kernels (`cuda/internode.cu`), mirrored from the structs at
//! the top of that file and passed by value. Sizes and key offsets are asserted here and in the
//! `.cu`, so a change made on one side only fails the build.
//!
//! Addresses are device addresses (`u64`, 0 meaning "none"); offsets are bytes into a rank's
//! registered net buffer (equal on all ranks). The safe API that fills them in is `ep::internode`.

use cudarc::driver::DeviceRepr;

/// Kernel module of the internode kernels.
pub const MODULE: &str = "internode";
/// Nodes one buffer can span (the world is at most 8 ranks).
pub const MAX_NODES: usize = 8;
/// Segments one destination's put carries (x, scales, ids, weights).
pub const MAX_SEGS: usize = 4;
/// Threads per block of the pack, put and reduce kernels.
pub const THREADS: u32 = 256;
/// Threads of the wait kernel (one per node).
pub const WAIT_THREADS: u32 = 32;

/// What a timed-out wait was for (the error word's `what`).
pub mod wait_what {
    /// A node's rail peer's dispatch rows (and count) landing here.
    pub const DISPATCH_DATA: u32 = 41;
    /// A node's rail peer acknowledging the previous dispatch (its receive slot is free).
    pub const DISPATCH_ACK: u32 = 42;
    /// A node's partial sums of this rank's tokens landing here.
    pub const COMBINE_DATA: u32 = 43;
    /// A node's rail peer acknowledging the previous combine.
    pub const COMBINE_ACK: u32 = 44;
}

/// Error codes beside `intranode::error_code` (timeout 1, bad routing 3).
pub mod error_code {
    /// A transport call failed: `peer` is the destination rank, `what` 21 (put), 22 (signal) or
    /// 23 (quiet), `epoch` the protocol status, `detail` the destination node.
    pub const TRANSPORT: u32 = 17;
}

/// `ep_internode_pack`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PackParams {
    /// `[T][row_bytes]`.
    pub x: u64,
    /// f32 `[T][scale_words]` or 0.
    pub scales: u64,
    /// i32 `[T][topk]`, global expert ids.
    pub topk_idx: u64,
    /// f32 `[T][topk]` or 0.
    pub weights: u64,
    /// i32 `[T][nodes]`: position among the tokens sent to node n, or -1.
    pub node_pos: u64,
    /// i32 `[nodes]`.
    pub tokens_per_node: u64,
    /// Node n's slot (local address).
    pub slot: [u64; MAX_NODES],
    /// Offset of the scales inside a slot.
    pub off_scales: u64,
    /// Offset of the ids inside a slot.
    pub off_idx: u64,
    /// Offset of the weights inside a slot.
    pub off_w: u64,
    /// The device error slot.
    pub error: u64,
    /// Tokens.
    pub num_tokens: i32,
    /// Bytes per row.
    pub row_bytes: i32,
    /// f32 scales per row (0 for BF16).
    pub scale_words: i32,
    /// Top-k width.
    pub topk: i32,
    /// Nodes.
    pub nodes: i32,
    /// Experts per node.
    pub experts_per_node: i32,
    /// Rows per slot.
    pub cap: i32,
    /// This rank.
    pub rank: i32,
}

/// `ep_internode_put`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PutParams {
    /// `ibgda_qp_desc*` to node n's rail peer; 0 for none or this rank's node.
    pub descs: [u64; MAX_NODES],
    /// Its registered net buffer.
    pub rbase: [u64; MAX_NODES],
    /// Its rkey.
    pub rkey: [u64; MAX_NODES],
    /// This rank's registered net buffer.
    pub local_base: u64,
    /// Offsets into `local_base` of what goes to node n.
    pub seg_local: [[u64; MAX_SEGS]; MAX_NODES],
    /// Offsets into `rbase[n]` where it lands.
    pub seg_remote: [[u64; MAX_SEGS]; MAX_NODES],
    /// Bytes (multiples of 16; 0 for none).
    pub seg_bytes: [[u64; MAX_SEGS]; MAX_NODES],
    /// Offset of the signal word (this rank's node's entry) in the peer's buffer.
    pub signal_off: u64,
    /// What to add to node n's word (0: no signal).
    pub delta: [u64; MAX_NODES],
    /// The device error slot.
    pub error: u64,
    /// This rank.
    pub rank: i32,
    /// Nodes.
    pub nodes: i32,
    /// This rank's node.
    pub my_node: i32,
    /// Node n's rail peer (for error reports).
    pub peer_rank: [i32; MAX_NODES],
    /// Padding.
    pub pad: i32,
}

/// `ep_internode_wait`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WaitParams {
    /// Local u64 `[nodes]`.
    pub words: u64,
    /// i32 `[nodes]` (low 32 bits of each word, clamped to `cap`) or 0.
    pub counts_out: u64,
    /// The device error slot.
    pub error: u64,
    /// The wait's bound.
    pub timeout_ns: u64,
    /// Wait until `word >> shift >= target`.
    pub target: u64,
    /// This rank.
    pub rank: i32,
    /// Nodes.
    pub nodes: i32,
    /// This rank's node (not waited for).
    pub my_node: i32,
    /// See `target`.
    pub shift: i32,
    /// A [`wait_what`] value.
    pub what: i32,
    /// Largest count reported.
    pub cap: i32,
    /// Node n's rail peer (for error reports).
    pub peer_rank: [i32; MAX_NODES],
}

/// `ep_internode_reduce`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ReduceParams {
    /// Combine receive slot of node n (local address).
    pub slot: [u64; MAX_NODES],
    /// Offset of the weights inside a slot.
    pub off_w: u64,
    /// i32 `[T][nodes]`.
    pub node_pos: u64,
    /// BF16 `[T][hidden]` or 0.
    pub bias0: u64,
    /// BF16 `[T][hidden]` or 0.
    pub bias1: u64,
    /// BF16 `[T][hidden]`.
    pub out_x: u64,
    /// f32 `[T][topk]` or 0.
    pub out_w: u64,
    /// The device error slot.
    pub error: u64,
    /// Tokens.
    pub num_tokens: i32,
    /// Hidden.
    pub hidden: i32,
    /// Top-k width.
    pub topk: i32,
    /// Nodes.
    pub nodes: i32,
    /// This rank.
    pub rank: i32,
    /// Padding.
    pub pad: i32,
    /// Valid rows in node n's slot.
    pub rows: [i32; MAX_NODES],
}

// SAFETY: plain #[repr(C)] structs of integers, passed by value to the kernel whose parameter
// struct they mirror (layouts asserted below and in the .cu).
unsafe impl DeviceRepr for PackParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for PutParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for WaitParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ReduceParams {}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<PackParams>() == 176);
    assert!(offset_of!(PackParams, num_tokens) == 144);
    assert!(size_of::<PutParams>() == 1096);
    assert!(offset_of!(PutParams, signal_off) == 968);
    assert!(size_of::<WaitParams>() == 96);
    assert!(size_of::<ReduceParams>() == 176);
};
