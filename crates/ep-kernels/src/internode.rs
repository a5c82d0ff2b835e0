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

/// `ErrorWord::what` of a bad-routing error (`intranode::error_code::BAD_ROUTING`) for a top-k id
/// out of range in a layout computed under capture: `epoch` is the token, `detail` the id,
/// `peer` the number of experts.
pub const ROUTING_TOPK_ID: u32 = 5;

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
    /// The layout's `LayoutInvalid` when the host never read it (computed under capture), or 0.
    pub layout_invalid: u64,
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
    /// A [`PutTable`] replacing `seg_*` and `delta`, or 0.
    pub table: u64,
}

/// `ep_internode_wait`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WaitParams {
    /// Local u64 `[nodes]`.
    pub words: u64,
    /// i32 `[nodes]` in device memory (low 32 bits of each word, clamped to `cap`) or 0.
    pub counts_out: u64,
    /// The same counts in host-mapped memory (read by the host) or 0.
    pub counts_host: u64,
    /// i32 rows of this rank's own node, copied to the counts at `my_node`, or 0.
    pub own_count: u64,
    /// u64 target: a device-counted sequence number ([`Ctrl`]), read at kernel start.
    pub target_seq: u64,
    /// The device error slot.
    pub error: u64,
    /// The wait's bound.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: i32,
    /// Nodes.
    pub nodes: i32,
    /// This rank's node (not waited for).
    pub my_node: i32,
    /// Wait until `word >> shift >= *target_seq`.
    pub shift: i32,
    /// A [`wait_what`] value.
    pub what: i32,
    /// Largest count reported.
    pub cap: i32,
    /// Node n's rail peer (for error reports).
    pub peer_rank: [i32; MAX_NODES],
}

/// A buffer's device-counted operation state (`InterCtrl`, device memory, zeroed at creation):
/// the sequence numbers the waits target and the dispatch data words this rank last stored at
/// each node's rail peer. Counted on the GPU so that CUDA-graph replays advance them as eager
/// calls do.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Ctrl {
    /// Dispatches started.
    pub dispatch_seq: u64,
    /// Combines started.
    pub combine_seq: u64,
    /// What this rank last stored into node n's dispatch data word.
    pub last_data: [u64; MAX_NODES],
}

/// The writes and signals of one put, computed on the device (`InterPutTable`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PutTable {
    /// Offsets into the local buffer.
    pub seg_local: [[u64; MAX_SEGS]; MAX_NODES],
    /// Offsets into the peer's buffer.
    pub seg_remote: [[u64; MAX_SEGS]; MAX_NODES],
    /// Bytes.
    pub seg_bytes: [[u64; MAX_SEGS]; MAX_NODES],
    /// What to add to node n's word.
    pub delta: [u64; MAX_NODES],
}

/// [`PlanParams::kind`] of a dispatch: stores `(seq << 32) | rows`.
pub const PLAN_DISPATCH: i32 = 0;
/// [`PlanParams::kind`] of a combine: adds one.
pub const PLAN_COMBINE: i32 = 1;

/// `ep_internode_plan_put`: a put's writes from device-resident row counts.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanParams {
    /// i32 `[nodes]`: rows for each node.
    pub counts: u64,
    /// [`Ctrl`] (the operation's sequence number is counted here).
    pub ctrl: u64,
    /// [`PutTable`] (written).
    pub table: u64,
    /// The device error slot.
    pub error: u64,
    /// Offset of node 0's source slot; node n's at `+ n * slot_bytes`.
    pub src_base: u64,
    /// Offset, at every peer, of the receive slot of this rank's node.
    pub dst_base: u64,
    /// Bytes of a slot.
    pub slot_bytes: u64,
    /// A section's start inside a slot.
    pub sec_off: [u64; MAX_SEGS],
    /// A section's bytes.
    pub sec_cap: [u64; MAX_SEGS],
    /// Bytes per row of a section (0: not sent).
    pub sec_row: [u64; MAX_SEGS],
    /// Rows a section sends at least.
    pub sec_min_rows: [i32; MAX_SEGS],
    /// [`PLAN_DISPATCH`] or [`PLAN_COMBINE`].
    pub kind: i32,
    /// Nodes.
    pub nodes: i32,
    /// This rank's node.
    pub my_node: i32,
    /// Rows per slot (counts are clamped to it).
    pub cap: i32,
    /// This rank.
    pub rank: i32,
    /// Node n's rail peer (for error reports).
    pub peer_rank: [i32; MAX_NODES],
    /// Padding.
    pub pad: i32,
}

/// `ep_internode_recv_prep`: ids -1 past each node's count in its dispatch receive slot.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PrepParams {
    /// Dispatch receive slot of node n (local address).
    pub slot: [u64; MAX_NODES],
    /// i32 `[nodes]`: valid rows in each.
    pub counts: u64,
    /// Offset of the ids inside a slot.
    pub off_idx: u64,
    /// Offset of the weights inside a slot.
    pub off_w: u64,
    /// Nodes.
    pub nodes: i32,
    /// Top-k width.
    pub topk: i32,
    /// Rows per slot.
    pub cap: i32,
    /// Padding.
    pub pad: i32,
}

/// `ep_internode_gather`: the NVLink hop's outputs concatenated into fixed rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GatherParams {
    /// The NVLink hop's receive region of source node n (its `Meta`), or 0.
    pub meta: [u64; MAX_NODES],
    /// Its rows.
    pub x: [u64; MAX_NODES],
    /// Its scales, or 0.
    pub scales: [u64; MAX_NODES],
    /// Its local ids, or 0.
    pub ids: [u64; MAX_NODES],
    /// Its weights, or 0.
    pub w: [u64; MAX_NODES],
    /// `[rows][row_bytes]`.
    pub out_x: u64,
    /// f32 `[rows][scale_words]` or 0.
    pub out_scales: u64,
    /// i32 `[rows][topk]` or 0.
    pub out_ids: u64,
    /// f32 `[rows][topk]` or 0.
    pub out_w: u64,
    /// i32 `[experts]` or 0.
    pub out_experts: u64,
    /// The device error slot.
    pub error: u64,
    /// Byte offset of `Meta::num_recv`.
    pub meta_num_recv: u64,
    /// Byte offset of the expert counts after `Meta`.
    pub meta_experts: u64,
    /// Nodes.
    pub nodes: i32,
    /// Output rows (`num_worst_tokens`).
    pub rows: i32,
    /// Bytes per row.
    pub row_bytes: i32,
    /// f32 scales per row.
    pub scale_words: i32,
    /// Top-k width (0: none).
    pub topk: i32,
    /// Local experts.
    pub experts: i32,
    /// Per-expert counts are rounded up to this.
    pub alignment: i32,
    /// Rows a region holds.
    pub region_cap: i32,
    /// This rank.
    pub rank: i32,
    /// Padding.
    pub pad: i32,
}

/// `ep_internode_scatter`: a combine input split back into the NVLink hop's regions.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ScatterParams {
    /// The dispatch's NVLink-hop receive region of node n (its `Meta`), or 0.
    pub meta: [u64; MAX_NODES],
    /// Where node n's rows go: bf16 `[region rows][hidden]`.
    pub x: [u64; MAX_NODES],
    /// f32 `[region rows][topk]`, or 0.
    pub w: [u64; MAX_NODES],
    /// bf16 `[rows][hidden]`.
    pub in_x: u64,
    /// f32 `[rows][topk]` or 0.
    pub in_w: u64,
    /// Byte offset of `Meta::num_recv`.
    pub meta_num_recv: u64,
    /// Nodes.
    pub nodes: i32,
    /// Input rows.
    pub rows: i32,
    /// Hidden.
    pub hidden: i32,
    /// Top-k width.
    pub topk: i32,
    /// Rows a region holds.
    pub region_cap: i32,
    /// Padding.
    pub pad: i32,
}

/// `ep_internode_stage`: each node's sums into its combine stage slot, by a device count.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct StageParams {
    /// The NVLink hop's sums for node n: bf16 `[rows][hidden]`.
    pub src_x: [u64; MAX_NODES],
    /// f32 `[rows][topk]` or 0.
    pub src_w: [u64; MAX_NODES],
    /// Node n's combine stage slot (this rank's node: its receive slot), or 0.
    pub dst: [u64; MAX_NODES],
    /// Offset of the weights inside a slot.
    pub off_w: u64,
    /// i32 `[nodes]`: rows for node n.
    pub counts: u64,
    /// Nodes.
    pub nodes: i32,
    /// Hidden.
    pub hidden: i32,
    /// Top-k width.
    pub topk: i32,
    /// Rows per slot.
    pub cap: i32,
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
// SAFETY: as above.
unsafe impl DeviceRepr for PlanParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for PrepParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for GatherParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ScatterParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for StageParams {}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<PackParams>() == 184);
    assert!(offset_of!(PackParams, num_tokens) == 144);
    assert!(offset_of!(PackParams, layout_invalid) == 176);
    assert!(size_of::<PutParams>() == 1104);
    assert!(offset_of!(PutParams, signal_off) == 968);
    assert!(offset_of!(PutParams, table) == 1096);
    assert!(size_of::<WaitParams>() == 112);
    assert!(offset_of!(WaitParams, rank) == 56);
    assert!(size_of::<ReduceParams>() == 176);
    assert!(size_of::<Ctrl>() == 80);
    assert!(offset_of!(Ctrl, combine_seq) == 8);
    assert!(offset_of!(Ctrl, last_data) == 16);
    assert!(offset_of!(PutTable, delta) == 768);
    assert!(offset_of!(PrepParams, nodes) == 88);
    assert!(offset_of!(ScatterParams, nodes) == 216);
    assert!(offset_of!(StageParams, nodes) == 208);
    assert!(size_of::<PutTable>() == 832);
    assert!(size_of::<PlanParams>() == 224);
    assert!(offset_of!(PlanParams, sec_min_rows) == 152);
    assert!(size_of::<PrepParams>() == 104);
    assert!(size_of::<GatherParams>() == 424);
    assert!(offset_of!(GatherParams, nodes) == 384);
    assert!(size_of::<ScatterParams>() == 240);
    assert!(size_of::<StageParams>() == 224);
};
