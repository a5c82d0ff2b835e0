//! What operations take and return: layouts, arguments, outputs and the dispatch handle.

use std::sync::Arc;

use crate::config::Config;
use crate::dtype::{Bf16, Fp8E4M3};
use crate::event::Event;
use crate::tensor::{Region, Tensor};

#[cfg(doc)]
use super::setup::Buffer;
#[cfg(doc)]
use crate::error::EpError;

/// Where each token goes: the result of [`Buffer::get_dispatch_layout`]. Its tensors are
/// [read-only](Tensor::is_read_only): dispatch reads them, and they must agree with the send
/// order the layout keeps privately (the kernels check them all the same, and report a value
/// edited out of range as [`EpError::CorruptRouting`] instead of writing by it).
#[derive(Debug, Clone)]
pub struct DispatchLayout {
    pub(super) tokens_per_rank: Tensor<i32>,
    pub(super) tokens_per_expert: Tensor<i32>,
    pub(super) is_token_in_rank: Tensor<u8>,
    /// Each token's position among those sent to each rank, or -1, `[tokens][ranks]`.
    pub(super) send_pos: Tensor<i32>,
    pub(super) num_tokens: usize,
    pub(super) buffer_id: u64,
}

impl DispatchLayout {
    /// Tokens this rank sends to each rank, `[ranks]`.
    pub fn tokens_per_rank(&self) -> &Tensor<i32> {
        &self.tokens_per_rank
    }
    /// Tokens this rank sends to each expert, `[num_experts]`.
    pub fn tokens_per_expert(&self) -> &Tensor<i32> {
        &self.tokens_per_expert
    }
    /// Whether each token goes to each rank (0/1), `[tokens][ranks]`.
    pub fn is_token_in_rank(&self) -> &Tensor<u8> {
        &self.is_token_in_rank
    }
    /// Tokens the layout was computed for.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

/// The token rows to dispatch.
#[derive(Debug, Clone, Copy)]
pub enum DispatchX<'a> {
    /// BF16 `[tokens][hidden]`; `hidden` a multiple of 8 (16-byte rows).
    Bf16(&'a Tensor<Bf16>),
    /// FP8 e4m3 `[tokens][hidden]` with f32 scales `[tokens][hidden / 128]`; `hidden` a multiple
    /// of 128.
    Fp8 {
        /// The values.
        x: &'a Tensor<Fp8E4M3>,
        /// One scale per 128 channels.
        scales: &'a Tensor<f32>,
    },
}

/// Top-k routing sent along with the tokens.
#[derive(Debug, Clone, Copy)]
pub struct TopK<'a> {
    /// Global expert ids `[tokens][k]`, -1 for none.
    pub idx: &'a Tensor<i32>,
    /// Weights `[tokens][k]`.
    pub weights: &'a Tensor<f32>,
}

/// Ordering of an operation against the caller's work.
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamOrder<'a> {
    /// Start after this event instead of after the compute stream's current work.
    pub previous_event: Option<&'a Event>,
    /// Do not make the compute stream wait for the operation: the caller waits on the returned
    /// event when it needs the outputs.
    pub async_finish: bool,
}

/// The arguments of [`Buffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct DispatchArgs<'a> {
    /// The tokens.
    pub x: DispatchX<'a>,
    /// Where they go.
    pub layout: &'a DispatchLayout,
    /// Top-k ids and weights to send along (returned as local expert ids), or none.
    pub topk: Option<TopK<'a>>,
    /// Return exactly this many rows with no host wait (CUDA-graph capturable: see
    /// [`Buffer::dispatch`]); rows past the received ones have top-k id -1. `None`: as many rows
    /// as received, after a bounded host wait.
    pub num_worst_tokens: Option<usize>,
    /// Per-expert counts are rounded up to a multiple of this (at least 1).
    pub expert_alignment: usize,
    /// Kernel tuning.
    pub config: Config,
    /// Stream ordering.
    pub order: StreamOrder<'a>,
}

impl<'a> DispatchArgs<'a> {
    /// Dispatch `x` by `layout`, no top-k, default config for `ranks`.
    pub fn new(x: DispatchX<'a>, layout: &'a DispatchLayout, ranks: usize) -> Self {
        Self {
            x,
            layout,
            topk: None,
            num_worst_tokens: None,
            expert_alignment: 1,
            config: Config::default_for(ranks),
            order: StreamOrder::default(),
        }
    }
}

/// Received token rows.
#[derive(Debug, Clone)]
pub enum RecvX {
    /// BF16 `[rows][hidden]`.
    Bf16(Tensor<Bf16>),
    /// FP8 `[rows][hidden]` and scales `[rows][hidden / 128]`.
    Fp8 {
        /// The values.
        x: Tensor<Fp8E4M3>,
        /// The scales.
        scales: Tensor<f32>,
    },
}

/// What a dispatch returns. Rows are ordered by source rank, then by token index at the source.
#[derive(Debug)]
pub struct DispatchOutput {
    /// The received rows.
    pub x: RecvX,
    /// Local expert ids `[rows][k]` (-1 where the expert is not on this rank), with top-k.
    pub topk_idx: Option<Tensor<i32>>,
    /// Weights `[rows][k]` (0 where the id is -1), with top-k.
    pub topk_weights: Option<Tensor<f32>>,
    /// Rows received; `None` with `num_worst_tokens` (the count stays on the GPU).
    pub num_recv_tokens: Option<usize>,
    /// Tokens per local expert, rounded up to the alignment; `None` with `num_worst_tokens`.
    pub num_recv_tokens_per_expert: Option<Vec<usize>>,
    /// The same per-expert counts on the GPU, `[num_local_experts]`.
    pub recv_tokens_per_expert: Tensor<i32>,
    /// What combine and cached dispatch need.
    pub handle: Handle,
    /// Recorded after the dispatch on the communication stream.
    pub event: Event,
}

/// How a dispatch routed tokens: the input of [`Buffer::combine`] and cached dispatch.
#[derive(Debug, Clone)]
pub struct Handle {
    pub(super) buffer_id: u64,
    pub(super) region: Arc<Region>,
    pub(super) send_pos: Tensor<i32>,
    pub(super) num_tokens: usize,
    pub(super) rows: usize,
    pub(super) num_recv: Option<usize>,
    pub(super) worst: bool,
}

impl Handle {
    /// Tokens the source side sent (rows of the combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// Rows of the dispatch output (and of the combine input).
    pub fn num_rows(&self) -> usize {
        self.rows
    }
    /// Rows actually received, when known on the host.
    pub fn num_recv_tokens(&self) -> Option<usize> {
        self.num_recv
    }
    /// The receive region of the dispatch (its `Meta` first, then the rows).
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

/// The arguments of [`Buffer::combine`].
#[derive(Debug, Clone, Copy)]
pub struct CombineArgs<'a> {
    /// Expert outputs, one row per dispatch output row, BF16 `[rows][hidden]`.
    pub x: &'a Tensor<Bf16>,
    /// The dispatch's handle.
    pub handle: &'a Handle,
    /// Weights `[rows][k]` to sum per token, or none.
    pub topk_weights: Option<&'a Tensor<f32>>,
    /// Up to two BF16 `[tokens][hidden]` tensors added to the sum.
    pub bias: [Option<&'a Tensor<Bf16>>; 2],
    /// Kernel tuning.
    pub config: Config,
    /// Stream ordering.
    pub order: StreamOrder<'a>,
}

impl<'a> CombineArgs<'a> {
    /// Combine `x` over `handle`, no weights or bias, default config for `ranks`.
    pub fn new(x: &'a Tensor<Bf16>, handle: &'a Handle, ranks: usize) -> Self {
        Self {
            x,
            handle,
            topk_weights: None,
            bias: [None, None],
            config: Config::default_for(ranks),
            order: StreamOrder::default(),
        }
    }
}

/// What a combine returns.
#[derive(Debug)]
pub struct CombineOutput {
    /// The sum of every copy of each token (f32 accumulation) plus the biases, BF16 `[tokens][hidden]`.
    pub x: Tensor<Bf16>,
    /// The summed weights `[tokens][k]`, when weights were given.
    pub topk_weights: Option<Tensor<f32>>,
    /// Recorded after the combine on the communication stream.
    pub event: Event,
}
