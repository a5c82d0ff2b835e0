//! Launch parameters of the low-latency kernels (`cuda/low_latency.cu`), mirrored from the
//! structs at the top of that file. Each struct is passed to its kernel by value; sizes are
//! asserted here and in the `.cu`, so a change on one side that is not made on the other fails
//! the build.
//!
//! Addresses are device addresses (`u64`), 0 meaning "none"; offsets are bytes into every rank's
//! net buffer (equal on all ranks). The safe API that fills them in is `ep::low_latency`.

use cudarc::driver::DeviceRepr;

/// Kernel module of the low-latency kernels.
pub const MODULE: &str = "low_latency";
/// Ranks one buffer can span; per-rank arrays have this length.
pub const MAX_RANKS: usize = 8;
/// Threads per block of both kernels (one block per SM).
pub const THREADS: u32 = 1024;
/// Largest top-k width the kernels accept.
pub const MAX_TOPK: usize = 16;
/// Largest hidden size the kernels accept (the dispatch message is staged in shared memory).
pub const MAX_HIDDEN: usize = 8192;
/// Channels per FP8 scale.
pub const FP8_BLOCK: usize = 128;

/// Phase bits of a launch ([`LlDispatchParams::phases`], [`LlCombineParams::phases`]).
pub mod phase {
    /// Send the data and the signals, then return.
    pub const SEND: i32 = 1;
    /// Wait for the signals and unpack / reduce.
    pub const RECV: i32 = 2;
}

/// What a timed-out device wait was for (the error word's `what`; the expert is in `epoch`).
pub mod wait_what {
    /// This rank's own warps finishing their sends to an expert.
    pub const SEND_DONE: u32 = 11;
    /// A source rank's count signal for a local expert (dispatch receive).
    pub const DISPATCH_RECV: u32 = 12;
    /// An expert's rank flagging its rows back (combine receive).
    pub const COMBINE_RECV: u32 = 13;
}

/// Error codes of the low-latency kernels beside `intranode::error_code::TIMEOUT` (1).
pub mod error_code {
    /// A top-k id outside `[-1, experts)` (dispatch) or `[-1, experts)` and not the dispatch's
    /// (combine: see [`TOPK_MISMATCH`]); the error word's `epoch` holds the id (as i64 bits),
    /// `detail` the token, `what` the top-k slot, | [`BAD_EXPERT_IN_COMBINE`](super::BAD_EXPERT_IN_COMBINE)
    /// in a combine.
    pub const BAD_EXPERT: u32 = 16;
    /// A transport call (`ibgda/protocol.cuh`) failed: `peer` is the destination, `what` one of
    /// [`transport_what`](super::transport_what), `epoch` the protocol status, `detail` the QP
    /// key. The QP group's error record says why.
    pub const TRANSPORT: u32 = 17;
    /// A routing value of the combine's handle is out of range (nothing was written by it):
    /// `what` is a [`routing_what`](super::routing_what) value, `epoch` the value's flat index,
    /// `detail` the value (i64 bits), `peer` the largest value allowed.
    pub const BAD_ROUTING: u32 = 18;
    /// A combine's top-k id (≥ 0) differs from the dispatch's in that place (that copy is not
    /// summed): `epoch` is the token, `what` the slot, `detail` the dispatch's id (high 32 bits)
    /// and the combine's (low 32 bits).
    pub const TOPK_MISMATCH: u32 = 19;
}

/// Set in the error word's `what` with [`error_code::BAD_EXPERT`] when a combine found the id.
pub const BAD_EXPERT_IN_COMBINE: u32 = 0x100;

/// Which handle value was out of range ([`error_code::BAD_ROUTING`]).
pub mod routing_what {
    /// `layout_range[local][rank][0]`, the first row, outside `[0, ranks × max tokens]`.
    pub const LAYOUT_OFFSET: u32 = 31;
    /// `layout_range[local][rank][1]`, the rows, outside `[0, max tokens]` or past the expert's
    /// rows.
    pub const LAYOUT_COUNT: u32 = 32;
    /// `src_info[local][row]`, a source token, outside `[0, max tokens)`.
    pub const SRC_INFO: u32 = 33;
}

/// Which transport call failed (the error word's `what` with [`error_code::TRANSPORT`]).
pub mod transport_what {
    /// `ibgda_put_warp` of token rows.
    pub const PUT: u32 = 21;
    /// `ibgda_signal_add` of a count or flag.
    pub const SIGNAL: u32 = 22;
    /// `ibgda_quiet` at the end of a send.
    pub const QUIET: u32 = 23;
}

/// Per-rank state in local device memory (`LlState`), zeroed at creation; followed by
/// `u64 last_signal[2][experts]`, `u64 last_flag[2][experts]`, then `i32 finish[experts]`
/// ([`state_bytes`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LlState {
    /// Combines completed on each half.
    pub combine_seq: [u64; 2],
    /// Dispatches received on each half.
    pub dispatch_seq: [u64; 2],
    /// Blocks of the current combine receive that have finished.
    pub combine_blocks_done: u32,
    /// Blocks of the current dispatch receive that have finished.
    pub dispatch_blocks_done: u32,
    /// Padding.
    pub pad: [u32; 6],
}

/// Bytes of the per-rank state for `num_experts` experts ([`LlState`] and its arrays).
pub const fn state_bytes(num_experts: usize) -> usize {
    std::mem::size_of::<LlState>() + 32 * num_experts + 4 * num_experts
}

/// Channels per LogFMT group (one amax/amin pair, one cast decision).
pub const LOGFMT_GROUP: usize = 128;

/// Bytes of a LogFMT row's meta (`u32` per group, padded to 16), as `logfmt_meta_bytes` in
/// `include/ep/logfmt.cuh`.
pub const fn logfmt_meta_bytes(hidden: usize) -> usize {
    (hidden / LOGFMT_GROUP * 4).div_ceil(16) * 16
}

/// Bytes of one combine receive slot, as `combine_slot_bytes` in `include/ep/logfmt.cuh`: a BF16
/// row, or (LogFMT) the meta and the row with no group cast, its largest encoding.
pub const fn combine_slot_bytes(hidden: usize, logfmt: bool) -> usize {
    hidden * 2 + if logfmt { logfmt_meta_bytes(hidden) } else { 0 }
}

/// Entries of a rank mask (`i32`, 1 = masked), one per possible rank.
pub const MASK_WORDS: usize = MAX_RANKS;

/// The transport of a buffer with NVLink disabled (`LlTransport`, in device memory; the
/// kernels' `transport` parameter points at it).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LlTransport {
    /// Per rank: device address of this rank's `ibgda_qp_desc[nqps]` to it; 0 for this rank.
    pub descs: [u64; MAX_RANKS],
    /// Per rank: its registered net buffer's address.
    pub rbase: [u64; MAX_RANKS],
    /// Per rank: that registration's rkey.
    pub rkey: [u64; MAX_RANKS],
    /// QPs per peer.
    pub nqps: u64,
    /// Offset of the dispatch send staging in this rank's net buffer.
    pub stage_off: u64,
    /// Offset of the combine send rows (the zero-copy input) in this rank's net buffer.
    pub comb_send_off: u64,
    /// Padding.
    pub pad: [u64; 5],
}

impl LlTransport {
    /// The struct as the words it is uploaded as.
    pub fn to_words(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(32);
        w.extend_from_slice(&self.descs);
        w.extend_from_slice(&self.rbase);
        w.extend_from_slice(&self.rkey);
        w.extend_from_slice(&[self.nqps, self.stage_off, self.comb_send_off]);
        w.extend_from_slice(&self.pad);
        w
    }
}

/// `ep_ll_dispatch` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LlDispatchParams {
    /// Every rank's net buffer as this GPU sees it (NVLink window); 0: reachable only by the
    /// transport.
    pub peer_base: [u64; MAX_RANKS],
    /// `bf16 [tokens][hidden]`.
    pub x: u64,
    /// `i32 [tokens][topk]`, -1 for none.
    pub topk_idx: u64,
    /// [`LlState`].
    pub state: u64,
    /// `[local][ranks * max_tokens][hidden]`, BF16 or FP8.
    pub out_x: u64,
    /// `f32 [..][hidden / 128]` or packed UE8M0 `u32 [..][hidden / 512]`, or 0.
    pub out_scales: u64,
    /// `i32 [local][ranks * max_tokens]`: source token of each row.
    pub out_src_info: u64,
    /// `i32 [local][ranks][2]`: (first row, rows) per source rank.
    pub out_layout: u64,
    /// `i32 [local]`: rows per local expert.
    pub out_count: u64,
    /// `i32 [tokens][topk]`: a copy of `topk_idx`, which combine checks its own against.
    pub out_topk: u64,
    /// Where errors are reported (`ep_kernels::intranode::ErrorSlot`, pointing at the host-mapped
    /// error word).
    pub error: u64,
    /// Bound of every wait, ns.
    pub timeout_ns: u64,
    /// This half's dispatch signals.
    pub signal_off: u64,
    /// This half's dispatch receive messages.
    pub recv_off: u64,
    /// [`LlTransport`] in device memory, or 0: NVLink only.
    pub transport: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks.
    pub ranks: i32,
    /// Tokens this rank sends.
    pub num_tokens: i32,
    /// Capacity in tokens per rank.
    pub max_tokens: i32,
    /// Hidden size.
    pub hidden: i32,
    /// Top-k width.
    pub topk: i32,
    /// Experts over all ranks.
    pub num_experts: i32,
    /// Experts per rank.
    pub num_local: i32,
    /// [`phase`] bits.
    pub phases: i32,
    /// 1: cast to FP8 e4m3 with per-128-channel scales.
    pub fp8: i32,
    /// 1: round scales up to powers of two.
    pub round_scale: i32,
    /// 1: pack scales as UE8M0 exponent bytes, 4 per `u32`.
    pub ue8m0: i32,
    /// Bytes per message (header + row + scales, a multiple of 16).
    pub msg_bytes: i32,
    /// Which half (0 or 1).
    pub half: i32,
    /// `i32 [MASK_WORDS]` rank mask (`enable_shrink`), or 0: no masks, a timeout fails.
    pub mask: u64,
    /// `i64 [ranks]`: cycles waited for each source rank are added here, or 0.
    pub wait_stats: u64,
}

/// `ep_ll_combine` parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LlCombineParams {
    /// As in [`LlDispatchParams::peer_base`].
    pub peer_base: [u64; MAX_RANKS],
    /// `bf16 [local][ranks * max_tokens][hidden]`: the expert outputs.
    pub x: u64,
    /// The dispatch's `src_info`.
    pub src_info: u64,
    /// The dispatch's layout ranges.
    pub layout: u64,
    /// `i32 [tokens][topk]` of this rank's tokens.
    pub topk_idx: u64,
    /// `f32 [tokens][topk]`.
    pub topk_weights: u64,
    /// The dispatch's `out_topk`: its top-k ids `[tokens][topk]`.
    pub dispatch_topk: u64,
    /// `bf16 [tokens][hidden]`.
    pub out: u64,
    /// [`LlState`].
    pub state: u64,
    /// Where errors are reported (`ep_kernels::intranode::ErrorSlot`, pointing at the host-mapped
    /// error word).
    pub error: u64,
    /// Bound of every wait, ns.
    pub timeout_ns: u64,
    /// This half's combine flags.
    pub flag_off: u64,
    /// This half's combine receive rows.
    pub recv_off: u64,
    /// [`LlTransport`] in device memory, or 0: NVLink only.
    pub transport: u64,
    /// This rank.
    pub rank: i32,
    /// Ranks.
    pub ranks: i32,
    /// Tokens this rank dispatched.
    pub num_tokens: i32,
    /// Capacity in tokens per rank.
    pub max_tokens: i32,
    /// Hidden size.
    pub hidden: i32,
    /// Top-k width.
    pub topk: i32,
    /// Experts over all ranks.
    pub num_experts: i32,
    /// Experts per rank.
    pub num_local: i32,
    /// [`phase`] bits.
    pub phases: i32,
    /// Which half (0 or 1).
    pub half: i32,
    /// As in [`LlDispatchParams::mask`].
    pub mask: u64,
    /// As in [`LlDispatchParams::wait_stats`].
    pub wait_stats: u64,
    /// LogFMT: where this rank encodes its rows before sending them
    /// (`[local][ranks × max tokens][combine_slot_bytes(hidden, true)]` in its net buffer), or 0:
    /// rows travel as BF16.
    pub logfmt_stage: u64,
}

/// `ep_ll_sleep` parameters (benchmarks: keep the stream busy while the host queues work).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LlSleepParams {
    /// How long, ns.
    pub ns: u64,
}

// SAFETY: each is a #[repr(C)] struct of plain integers whose layout matches the CUDA struct of
// the same name in low_latency.cu (sizes asserted below and there), so its bytes are a valid
// kernel parameter.
unsafe impl DeviceRepr for LlDispatchParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for LlCombineParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for LlSleepParams {}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<LlState>() == 64);
    assert!(size_of::<LlTransport>() == 256);
    assert!(offset_of!(LlState, dispatch_seq) == 16);
    assert!(offset_of!(LlState, dispatch_blocks_done) == 36);
    assert!(offset_of!(LlTransport, nqps) == 192);
    assert!(size_of::<LlDispatchParams>() == 248);
    assert!(offset_of!(LlDispatchParams, mask) == 232);
    assert!(offset_of!(LlCombineParams, mask) == 208);
    assert!(logfmt_meta_bytes(7168) == 224 && combine_slot_bytes(7168, true) == 14560);
    assert!(offset_of!(LlDispatchParams, out_topk) == 128);
    assert!(offset_of!(LlDispatchParams, rank) == 176);
    assert!(size_of::<LlCombineParams>() == 232);
    assert!(offset_of!(LlCombineParams, dispatch_topk) == 104);
    assert!(offset_of!(LlCombineParams, rank) == 168);
    assert!(size_of::<LlSleepParams>() == 8);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_words_follow_the_struct_layout() {
        let t = LlTransport {
            descs: [1, 2, 3, 4, 5, 6, 7, 8],
            rbase: [11, 12, 13, 14, 15, 16, 17, 18],
            rkey: [21, 22, 23, 24, 25, 26, 27, 28],
            nqps: 4,
            stage_off: 40,
            comb_send_off: 50,
            pad: [0; 5],
        };
        let w = t.to_words();
        assert_eq!(w.len() * 8, std::mem::size_of::<LlTransport>());
        assert_eq!(w[std::mem::offset_of!(LlTransport, rbase) / 8], 11);
        assert_eq!(w[std::mem::offset_of!(LlTransport, rkey) / 8 + 7], 28);
        assert_eq!(w[std::mem::offset_of!(LlTransport, nqps) / 8], 4);
        assert_eq!(w[std::mem::offset_of!(LlTransport, stage_off) / 8], 40);
        assert_eq!(w[std::mem::offset_of!(LlTransport, comb_send_off) / 8], 50);
    }

    #[test]
    fn state_arrays_follow_the_header() {
        // u64 last_signal[2][experts], u64 last_flag[2][experts], then i32 finish[experts], as
        // last_flag_of() and finish_of() in the .cu.
        assert_eq!(state_bytes(288), 64 + 16 * 288 + 16 * 288 + 4 * 288);
    }
}
