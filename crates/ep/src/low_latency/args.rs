//! What the low-latency operations take and return.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ibgda_device::cuda::DeviceBuffer;

use super::hook::RecvHook;
#[cfg(doc)]
use super::setup::LowLatencyBuffer;
use crate::dtype::{Bf16, Fp8E4M3};
#[cfg(doc)]
use crate::error::EpError;
use crate::tensor::Tensor;

/// In-kernel FP8 cast of the dispatched rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp8Options {
    /// Round each scale up to a power of two.
    pub round_scale: bool,
    /// Return the scales as UE8M0 exponent bytes packed 4 per `i32` (implies `round_scale`;
    /// hidden must be a multiple of 512).
    pub ue8m0: bool,
}

/// The arguments of [`LowLatencyBuffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct LlDispatchArgs<'a> {
    /// BF16 `[tokens][hidden]`.
    pub x: &'a Tensor<Bf16>,
    /// Global expert ids `[tokens][k]`, -1 for none.
    pub topk_idx: &'a Tensor<i32>,
    /// Cast to FP8 in the kernel, or send BF16.
    pub fp8: Option<Fp8Options>,
    /// Send only and return a [`RecvHook`] that receives.
    pub return_recv_hook: bool,
    /// Thread blocks (at most one per SM); `None`: every SM.
    pub num_sms: Option<u32>,
    /// `i64 [ranks]`: the receive adds the GPU cycles it waited for each source rank (DeepEP's
    /// `dispatch_wait_recv_cost_stats`).
    pub wait_stats: Option<&'a Tensor<i64>>,
    /// Where the receive writes the rows (`[local][ranks × max tokens][hidden]`, BF16, or FP8
    /// with `fp8`) instead of the buffer's output half, which then holds only the scales and
    /// the routing: a caller's tensor the output is returned as, kept as long as the caller
    /// likes, with no copy. Rows past each expert's count are left as they were. The tensor
    /// must stay alive until the receive has run on the stream (with a hook: the hook's).
    pub recv_into: Option<LlRecvInto<'a>>,
    /// Where the receive writes the rows per local expert (`i32 [local]`) instead of the
    /// buffer's output half; as `recv_into`.
    pub recv_count_into: Option<&'a Tensor<i32>>,
}

/// A caller's tensor the received rows are written into ([`LlDispatchArgs::recv_into`]).
#[derive(Debug, Clone, Copy)]
pub enum LlRecvInto<'a> {
    /// For a BF16 dispatch.
    Bf16(&'a Tensor<Bf16>),
    /// For an FP8 dispatch (the scales stay in the buffer's output half).
    Fp8(&'a Tensor<Fp8E4M3>),
}

impl<'a> LlDispatchArgs<'a> {
    /// A BF16 dispatch of `x` by `topk_idx` on every SM, receiving in the same kernel.
    pub fn new(x: &'a Tensor<Bf16>, topk_idx: &'a Tensor<i32>) -> Self {
        Self {
            x,
            topk_idx,
            fp8: None,
            return_recv_hook: false,
            num_sms: None,
            wait_stats: None,
            recv_into: None,
            recv_count_into: None,
        }
    }
}

/// One scale per 128 channels of each received row.
#[derive(Debug, Clone)]
pub enum LlScales {
    /// f32 `[local][ranks × max tokens][hidden / 128]`.
    F32(Tensor<f32>),
    /// UE8M0 exponents, byte `j` of word `w` for channels `(4w + j) × 128 ..`:
    /// `[local][ranks × max tokens][hidden / 512]`.
    Ue8m0(Tensor<i32>),
}

/// The received rows, packed per local expert.
#[derive(Debug, Clone)]
pub enum LlRecvX {
    /// BF16 `[local][ranks × max tokens][hidden]`.
    Bf16(Tensor<Bf16>),
    /// FP8 `[local][ranks × max tokens][hidden]` with its scales.
    Fp8 {
        /// The values.
        x: Tensor<Fp8E4M3>,
        /// The scales (`x ≈ value × scale`).
        scales: LlScales,
    },
}

/// What combine needs to know about a dispatch. Opaque: its routing tensors are
/// [read-only](Tensor::is_read_only), and the kernels check every offset they take from them all
/// the same (a value out of range is reported as [`EpError::CorruptRouting`], never written by).
/// A hook-mode dispatch's handle is usable by combine only once its [`RecvHook`] has been called.
#[derive(Debug, Clone)]
pub struct LlHandle {
    pub(super) buffer_id: u64,
    pub(super) src_info: Tensor<i32>,
    pub(super) layout_range: Tensor<i32>,
    /// The dispatch's output region (its top-k ids are there, read by the combine receive).
    pub(super) region: Arc<DeviceBuffer>,
    /// The dispatch's top-k width.
    pub(super) topk: usize,
    /// Whether the receive that fills the routing tensors has been queued.
    pub(super) received: Arc<AtomicBool>,
    pub(super) num_tokens: usize,
    pub(super) hidden: usize,
}

impl LlHandle {
    /// Source token of each packed row, `[local][ranks × max tokens]` (read-only).
    pub fn src_info(&self) -> &Tensor<i32> {
        &self.src_info
    }
    /// (first row, rows) of each source rank in each local expert, `[local][ranks][2]`
    /// (read-only).
    pub fn layout_range(&self) -> &Tensor<i32> {
        &self.layout_range
    }
    /// Whether the dispatch's receive has been queued (always, without a hook; after
    /// [`RecvHook::call`] with one): combine refuses a handle whose receive never ran.
    pub fn is_received(&self) -> bool {
        self.received.load(Ordering::Acquire)
    }
    /// The dispatch's top-k width (combine's `topk_idx` must have it).
    pub fn topk(&self) -> usize {
        self.topk
    }
    /// Tokens this rank dispatched (rows of the combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// The dispatch's hidden size.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

/// What a dispatch returns. With a hook, nothing but the handle's shape is valid until the hook
/// has run (on the stream).
#[derive(Debug)]
pub struct LlDispatchOutput {
    /// Packed rows per local expert.
    pub x: LlRecvX,
    /// Rows received per local expert, `[local]`.
    pub recv_count: Tensor<i32>,
    /// For combine.
    pub handle: LlHandle,
    /// The receive, when `return_recv_hook` was set.
    pub hook: Option<RecvHook>,
}

/// The expert outputs to combine.
#[derive(Debug, Clone, Copy)]
pub enum LlCombineX<'a> {
    /// BF16 `[local][ranks × max tokens][hidden]`, rows as the dispatch packed them.
    Tensor(&'a Tensor<Bf16>),
    /// Already in [`LowLatencyBuffer::combine_input`] (zero-copy), with the dispatch's hidden.
    ZeroCopy,
}

/// The arguments of [`LowLatencyBuffer::combine`].
#[derive(Debug, Clone, Copy)]
pub struct LlCombineArgs<'a> {
    /// The expert outputs.
    pub x: LlCombineX<'a>,
    /// The dispatch's top-k ids `[tokens][k]`.
    pub topk_idx: &'a Tensor<i32>,
    /// Weights `[tokens][k]`.
    pub topk_weights: &'a Tensor<f32>,
    /// The dispatch's handle.
    pub handle: &'a LlHandle,
    /// Send only and return a [`RecvHook`] that receives and reduces.
    pub return_recv_hook: bool,
    /// Thread blocks; `None`: every SM.
    pub num_sms: Option<u32>,
    /// `i64 [ranks]`: the receive adds the GPU cycles it waited for each source rank (DeepEP's
    /// `combine_wait_recv_cost_stats`).
    pub wait_stats: Option<&'a Tensor<i64>>,
    /// Send the rows in LogFMT-10 (see [`logfmt`](super::logfmt)): groups of 128 channels whose
    /// magnitudes are below 1 travel as 10-bit log-domain codes (160 bytes instead of 256).
    /// Lossy (about 2^-8 relative per value); hidden a multiple of 128; not with zero-copy.
    pub use_logfmt: bool,
    /// Where the receive writes the combined rows (BF16 `[tokens][hidden]`, every row) instead
    /// of the buffer's output half: a caller's tensor the output is returned as, with no copy.
    /// It must stay alive until the receive has run on the stream (with a hook: the hook's).
    pub out_into: Option<&'a Tensor<Bf16>>,
}

impl<'a> LlCombineArgs<'a> {
    /// Combine `x` over `handle` with the dispatch's routing, receiving in the same kernel.
    pub fn new(
        x: LlCombineX<'a>,
        topk_idx: &'a Tensor<i32>,
        topk_weights: &'a Tensor<f32>,
        handle: &'a LlHandle,
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights,
            handle,
            return_recv_hook: false,
            num_sms: None,
            wait_stats: None,
            use_logfmt: false,
            out_into: None,
        }
    }
}

/// What a combine returns.
#[derive(Debug)]
pub struct LlCombineOutput {
    /// `Σ_k weight × expert output` per token (f32 accumulation), BF16 `[tokens][hidden]`.
    pub x: Tensor<Bf16>,
    /// The receive, when `return_recv_hook` was set.
    pub hook: Option<RecvHook>,
}
