//! Launch parameters of the layout and intranode kernels (`cuda/layout.cu`, `cuda/intranode.cu`),
//! mirrored from `cuda/include/ep/intranode.cuh`. Each struct is passed to its kernel by value;
//! sizes and field offsets are asserted here and (sizes) in the header, so a change on one side
//! that is not made on the other fails the build.
//!
//! Addresses are device addresses (`u64`), 0 meaning "none". The safe API that fills them in
//! lives in the `ep` crate.

use cudarc::driver::DeviceRepr;

/// Ranks of one host that can reach each other over NVLink; per-rank arrays have this length.
pub const MAX_RANKS: usize = 8;
/// Tag of a published combine input that lies in the publisher's window (`kInWindow`): the
/// rest of the word is the byte offset there.
pub const IN_WINDOW: u64 = 1 << 63;
/// Threads per block of the push and reduce kernels (one block per SM).
pub const PUSH_THREADS: u32 = 1024;
/// Threads of the one-block notify and barrier kernels.
pub const NOTIFY_THREADS: u32 = 256;
/// Threads per block of the layout kernel.
pub const LAYOUT_THREADS: u32 = 1024;

/// Kernel module of the layout kernel.
pub const LAYOUT_MODULE: &str = "layout";
/// Kernel module of the intranode kernels.
pub const INTRANODE_MODULE: &str = "intranode";

/// Error codes in [`ErrorWord::code`].
pub mod error_code {
    /// No error.
    pub const NONE: u32 = 0;
    /// A bounded wait on peer flags ran out.
    pub const TIMEOUT: u32 = 1;
    /// More tokens arrived than `num_worst_tokens` rows: [`ErrorWord::what`](super::ErrorWord)
    /// holds `num_worst_tokens`, `detail` the rows received.
    pub const WORST_TOKENS_EXCEEDED: u32 = 2;
    /// A routing value read from a layout tensor is out of range (nothing was written by it):
    /// `what` is a [`routing_what`](super::routing_what) value, `epoch` the value's flat index,
    /// `detail` the value (i64 bits), `peer` the largest value allowed.
    pub const BAD_ROUTING: u32 = 3;
    /// Rank masks the kernels cannot honour (nothing was sent under them): `what` is a
    /// [`mask_what`](super::mask_what) value, `peer` the rank that disagrees (this rank for a
    /// cached handle), `detail` = (the other link set << 32) | this rank's link set, each a
    /// bitmask over ranks.
    pub const MASK_MISMATCH: u32 = 4;
}

/// Which mask disagreement ([`ErrorWord::what`] with [`error_code::MASK_MISMATCH`]).
pub mod mask_what {
    /// A linked peer links another set of ranks: masks that are not symmetric and transitive.
    pub const PEER_LINKS: u32 = 1;
    /// A cached dispatch's handle was made under other links than the current masks give.
    pub const CACHED_HANDLE: u32 = 2;
    /// A peer this rank links masks this rank (seen while waiting for it, once the peer
    /// reached the same operation): a one-sided mask.
    pub const ONE_SIDED: u32 = 3;
}

/// The ranks a rank links (exchanges data with), as the kernels compute them (`links_of` in
/// `device.cuh`): bit `r` set for every rank `r < ranks` that `masked` does not mask, and
/// always for `rank` itself.
///
/// ```
/// use ep_kernels::intranode::links_of;
/// assert_eq!(links_of(&[false, true, false, false], 0), 0b1101);
/// assert_eq!(links_of(&[true, true], 1), 0b10);
/// ```
pub fn links_of(masked: &[bool], rank: usize) -> u32 {
    masked
        .iter()
        .take(MAX_RANKS)
        .enumerate()
        .filter(|&(r, &m)| r == rank || !m)
        .fold(0, |acc, (r, _)| acc | (1 << r))
}

/// Which routing value was out of range ([`ErrorWord::what`] with
/// [`error_code::BAD_ROUTING`]).
pub mod routing_what {
    /// `tokens_per_rank[dst]` outside `[0, tokens]` (notify; published clamped).
    pub const TOKENS_PER_RANK: u32 = 1;
    /// `tokens_per_expert[e]` outside `[0, tokens]` (notify; published clamped).
    pub const TOKENS_PER_EXPERT: u32 = 2;
    /// A token's send position to a rank (flat index `token × ranks + rank`) at or past the
    /// count this rank published to it (push; the row was not sent).
    pub const SEND_POSITION: u32 = 3;
}

/// What the layout kernel reports about top-k ids outside `[-1, experts)` (`LayoutInvalid`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayoutInvalid {
    /// How many ids were out of range.
    pub count: i32,
    /// The flat index (`token × topk + slot`) of the first, or `i32::MAX`.
    pub first: i32,
    /// The id there.
    pub id: i32,
    /// Padding.
    pub pad: i32,
}

/// What a device wait was waiting for ([`ErrorWord::what`]).
pub mod wait_what {
    /// The count exchange that starts a dispatch.
    pub const DISPATCH_COUNTS: u32 = 1;
    /// Every peer's tokens having landed.
    pub const DISPATCH_DATA: u32 = 2;
    /// Every peer being ready for a combine.
    pub const COMBINE_START: u32 = 3;
    /// Every peer's combine rows having landed.
    pub const COMBINE_DATA: u32 = 4;
}

/// One rank's error report, in host-mapped memory (`ErrorWord` in the header).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorWord {
    /// An [`error_code`]; 0 while no error was recorded.
    pub code: u32,
    /// The rank that recorded it.
    pub rank: u32,
    /// The peer waited for.
    pub peer: u32,
    /// A [`wait_what`] value.
    pub what: u32,
    /// The epoch waited for.
    pub epoch: u64,
    /// The last value seen (timeouts) or the count that overflowed.
    pub detail: u64,
}

/// Where kernels report errors (`ErrorSlot` in the header), in device memory: the first error's
/// code, which every block can check cheaply, and the device address of the host-mapped
/// [`ErrorWord`] the host reads. The `error` field of every params struct points at one.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorSlot {
    /// 0 until the first error, then its [`error_code`]; never cleared.
    pub code: u32,
    /// Padding.
    pub pad: u32,
    /// Device address of the [`ErrorWord`] (host-mapped memory).
    pub host: u64,
}

impl ErrorSlot {
    /// The slot as the two 8-byte words it occupies (little-endian, as the GPU reads it).
    pub fn to_words(&self) -> [u64; 2] {
        [
            u64::from(self.code) | (u64::from(self.pad) << 32),
            self.host,
        ]
    }
}

/// The start of each rank's signal region (`SignalHead`), at the start of its window; per-expert
/// counts follow it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SignalHead {
    /// Barrier flags, indexed by source rank.
    pub flag: [u64; MAX_RANKS],
    /// Byte offset, in each rank's window, of its receive region for the dispatch in flight.
    pub recv_offset: [u64; MAX_RANKS],
    /// Each rank's combine input rows: its own address (ranks as threads), or [`IN_WINDOW`] |
    /// the byte offset in its window (ranks as processes).
    pub comb_src: [u64; MAX_RANKS],
    /// Each rank's combine input weights, as `comb_src`.
    pub comb_w_src: [u64; MAX_RANKS],
    /// Tokens `[src][dst]`.
    pub tokens: [[i32; MAX_RANKS]; MAX_RANKS],
    /// Blocks of the owner's push kernel that have finished.
    pub blocks_done: u32,
    /// Padding.
    pub pad0: u32,
    /// The last barrier epoch the owner's kernels used; each epoch-taking kernel advances it by
    /// one on the GPU (so replays of a captured graph take fresh epochs). Peers read it only to
    /// tell a one-sided mask ([`mask_what::ONE_SIDED`]).
    pub epoch: u64,
    /// The link set (see [`links_of`]) each source published with its last notify or barrier
    /// release to the owner: linked ranks must agree on it.
    pub links: [u32; MAX_RANKS],
    /// Padding.
    pub pad: [u32; 4],
}

/// Per-dispatch facts at the start of a receive region (`Meta`); expert counts follow it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Meta {
    /// Where this rank's tokens start in each destination's rows.
    pub send_offset: [i32; MAX_RANKS],
    /// Where each source's tokens start in this rank's rows; `[ranks]` is the total.
    pub recv_offset: [i32; MAX_RANKS + 1],
    /// Rows received.
    pub num_recv: i32,
    /// Tokens this rank sends to each destination (as published, clamped): no row past
    /// `send_offset + send_count` is written.
    pub send_count: [i32; MAX_RANKS],
    /// The ranks this rank was linked with for this dispatch (see [`links_of`]): combine pulls
    /// nothing from a rank outside them, and a cached dispatch needs the same links.
    pub links: u32,
    /// Padding.
    pub pad: [i32; 5],
}

/// What the host waits for after the count exchange (`HostInfo`); expert counts follow it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct HostInfo {
    /// The epoch of the dispatch the numbers belong to, written last.
    pub tag: u64,
    /// Rows received.
    pub num_recv: i32,
    /// Padding.
    pub pad: i32,
}

/// `ep_dispatch_layout` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LayoutParams {
    /// `i32 [tokens][topk]`.
    pub topk_idx: u64,
    /// `i32 [ranks]`.
    pub tokens_per_rank: u64,
    /// `i32 [experts]`.
    pub tokens_per_expert: u64,
    /// `u8 [tokens][ranks]`.
    pub is_token_in_rank: u64,
    /// `i32 [tokens][ranks]`: position among the tokens sent to that rank, or -1.
    pub send_pos: u64,
    /// [`LayoutInvalid`]: ids outside `[-1, num_experts)`.
    pub invalid: u64,
    /// Tokens.
    pub num_tokens: i32,
    /// Top-k width.
    pub topk: i32,
    /// Ranks.
    pub ranks: i32,
    /// Experts over all ranks.
    pub num_experts: i32,
}

/// `ep_intranode_notify` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NotifyParams {
    /// Every rank's signal region.
    pub signal: [u64; MAX_RANKS],
    /// This rank's receive region for this dispatch.
    pub recv_base: u64,
    /// The same region as a byte offset in this rank's window (what peers are told).
    pub recv_offset: u64,
    /// A previous dispatch's [`Meta`] to reuse (cached dispatch), or 0.
    pub cached_meta: u64,
    /// `i32 [ranks]`.
    pub tokens_per_rank: u64,
    /// `i32 [experts]`, or 0.
    pub tokens_per_expert: u64,
    /// [`HostInfo`] in mapped memory, or 0.
    pub host_info: u64,
    /// [`ErrorSlot`] (device memory; points at the host-mapped [`ErrorWord`]).
    pub error: u64,
    /// The host's sequence number of the call (the notify kernel tags [`HostInfo`] with it);
    /// barrier epochs come from [`SignalHead::epoch`], on the GPU.
    pub epoch: u64,
    /// Bound of every wait, ns.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks.
    pub ranks: i32,
    /// Experts per rank.
    pub num_local_experts: i32,
    /// Per-expert counts are rounded up to this.
    pub expert_alignment: i32,
    /// Fixed output rows, or 0.
    pub num_worst_tokens: i32,
    /// Tokens this rank sends: every published count must lie in `[0, num_tokens]`.
    pub num_tokens: i32,
    /// This rank's `i32 [MAX_RANKS]` rank mask (1 = masked), or 0: every rank linked.
    pub mask: u64,
}

/// Byte offsets of a receive region's sections (`RegionLayout`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionLayout {
    /// Token rows.
    pub x: u64,
    /// FP8 scales.
    pub scales: u64,
    /// Local expert ids.
    pub topk_idx: u64,
    /// Top-k weights.
    pub topk_weights: u64,
}

/// `ep_intranode_dispatch` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchParams {
    /// Every rank's signal region.
    pub signal: [u64; MAX_RANKS],
    /// Every rank's window as mapped by this rank (destination rows are at `window[d]` plus the
    /// offset `d` published).
    pub window: [u64; MAX_RANKS],
    /// Receive-region sections.
    pub region: RegionLayout,
    /// This rank's [`Meta`] for this dispatch.
    pub meta: u64,
    /// `[tokens][row_bytes]`.
    pub x: u64,
    /// `f32 [tokens][scale_words]`, or 0.
    pub scales: u64,
    /// `i32 [tokens][topk]`, or 0.
    pub topk_idx: u64,
    /// `f32 [tokens][topk]`, or 0.
    pub topk_weights: u64,
    /// `i32 [tokens][ranks]`.
    pub send_pos: u64,
    /// [`ErrorSlot`].
    pub error: u64,
    /// The host's sequence number of the call (the notify kernel tags [`HostInfo`] with it);
    /// barrier epochs come from [`SignalHead::epoch`], on the GPU.
    pub epoch: u64,
    /// Bound of every wait, ns.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks.
    pub ranks: i32,
    /// Tokens sent.
    pub num_tokens: i32,
    /// Bytes per token row (multiple of 16).
    pub row_bytes: i32,
    /// f32 scales per row.
    pub scale_words: i32,
    /// Top-k width, 0 without top-k.
    pub topk: i32,
    /// Experts per rank.
    pub num_local_experts: i32,
    /// Fixed output rows, or 0.
    pub num_worst_tokens: i32,
    /// Rows of every receive region (`ranks × max_tokens_per_rank`): no row at or past it is
    /// written.
    pub cap: i32,
    /// Padding.
    pub pad: i32,
}

/// `ep_intranode_notify_barrier` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BarrierParams {
    /// Every rank's signal region.
    pub signal: [u64; MAX_RANKS],
    /// Combine input rows to publish to every peer, or 0.
    pub publish_x: u64,
    /// Combine input weights to publish to every peer, or 0.
    pub publish_w: u64,
    /// [`ErrorSlot`].
    pub error: u64,
    /// The host's sequence number of the call (the notify kernel tags [`HostInfo`] with it);
    /// barrier epochs come from [`SignalHead::epoch`], on the GPU.
    pub epoch: u64,
    /// Bound of the wait, ns.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks.
    pub ranks: i32,
    /// A [`wait_what`] value for the error report.
    pub what: i32,
    /// Padding.
    pub pad: i32,
    /// This rank's `i32 [MAX_RANKS]` rank mask (1 = masked), or 0: every rank linked.
    pub mask: u64,
}

/// `ep_intranode_combine_pull` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CombinePullParams {
    /// Every rank's signal region (this rank's holds the peers' published inputs).
    pub signal: [u64; MAX_RANKS],
    /// The handle's [`Meta`].
    pub meta: u64,
    /// `i32 [tokens][ranks]`.
    pub send_pos: u64,
    /// `bf16 [tokens][hidden]`, or 0.
    pub bias0: u64,
    /// `bf16 [tokens][hidden]`, or 0.
    pub bias1: u64,
    /// `bf16 [tokens][hidden]`.
    pub out: u64,
    /// `f32 [tokens][topk]`, or 0.
    pub out_weights: u64,
    /// [`ErrorSlot`].
    pub error: u64,
    /// The host's sequence number of the call (the notify kernel tags [`HostInfo`] with it);
    /// barrier epochs come from [`SignalHead::epoch`], on the GPU.
    pub epoch: u64,
    /// Bound of every wait, ns.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks.
    pub ranks: i32,
    /// Tokens.
    pub num_tokens: i32,
    /// Hidden size.
    pub hidden: i32,
    /// Top-k width, 0 without weights.
    pub topk: i32,
    /// Padding.
    pub pad: i32,
    /// This rank's `i32 [MAX_RANKS]` rank mask (1 = masked), or 0: every rank linked.
    pub mask: u64,
}

// SAFETY: each is a #[repr(C)] struct of plain integers whose layout matches the CUDA struct of
// the same name (sizes asserted below and in the header), so its bytes are a valid kernel
// parameter.
unsafe impl DeviceRepr for LayoutParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for NotifyParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for DispatchParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for BarrierParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for CombinePullParams {}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ErrorWord>() == 32);
    assert!(size_of::<ErrorSlot>() == 16);
    assert!(offset_of!(ErrorSlot, host) == 8);
    assert!(size_of::<SignalHead>() == 576);
    assert!(offset_of!(SignalHead, tokens) == 256);
    assert!(offset_of!(SignalHead, blocks_done) == 512);
    assert!(offset_of!(SignalHead, epoch) == 520);
    assert!(size_of::<Meta>() == 128);
    assert!(offset_of!(Meta, num_recv) == 68);
    assert!(offset_of!(Meta, send_count) == 72);
    assert!(size_of::<HostInfo>() == 16);
    assert!(size_of::<LayoutParams>() == 64);
    assert!(offset_of!(SignalHead, recv_offset) == 64);
    assert!(size_of::<NotifyParams>() == 168);
    assert!(offset_of!(NotifyParams, mask) == 160);
    assert!(offset_of!(SignalHead, links) == 528);
    assert!(offset_of!(Meta, links) == 104);
    assert!(offset_of!(BarrierParams, mask) == 120);
    assert!(offset_of!(CombinePullParams, mask) == 160);
    assert!(offset_of!(NotifyParams, recv_offset) == 72);
    assert!(offset_of!(NotifyParams, rank) == 136);
    assert!(size_of::<RegionLayout>() == 32);
    assert!(size_of::<DispatchParams>() == 272);
    assert!(offset_of!(DispatchParams, cap) == 264);
    assert!(offset_of!(NotifyParams, num_tokens) == 156);
    assert!(size_of::<LayoutInvalid>() == 16);
    assert!(offset_of!(DispatchParams, region) == 128);
    assert!(offset_of!(DispatchParams, rank) == 232);
    assert!(size_of::<BarrierParams>() == 128);
    assert!(size_of::<CombinePullParams>() == 168);
    assert!(offset_of!(CombinePullParams, rank) == 136);
};
