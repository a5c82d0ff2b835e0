//! What the normal-mode classes ([`Intranode`](crate::intranode::Intranode) and
//! [`Internode`](crate::internode::Internode)) share: the tokens to send over caller memory,
//! and the output objects handed to the Python layer.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ep::{Bf16, DispatchX, Fp8E4M3, RecvX};
use pyo3::prelude::*;

use crate::view::{input, DeviceView};

/// What a dispatch produced, as views of native memory (internal).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Dispatched {
    /// Received rows (BF16 as `<i2`, FP8 as `|u1`).
    #[pyo3(get)]
    x: Py<DeviceView>,
    /// FP8 scales, f32 `[rows, hidden / 128]`.
    #[pyo3(get)]
    scales: Option<Py<DeviceView>>,
    /// Local expert ids, i32 `[rows, k]`.
    #[pyo3(get)]
    topk_idx: Option<Py<DeviceView>>,
    /// Weights, f32 `[rows, k]`.
    #[pyo3(get)]
    topk_weights: Option<Py<DeviceView>>,
    /// Rows received, when known on the host.
    #[pyo3(get)]
    num_recv_tokens: Option<usize>,
    /// Rows per local expert (aligned), when known on the host.
    #[pyo3(get)]
    num_recv_tokens_per_expert: Option<Vec<usize>>,
    /// For combine and cached dispatch: an intranode `Handle` or an internode `InternodeHandle`.
    #[pyo3(get)]
    handle: PyObject,
}

/// The parts of a dispatch output that [`Dispatched`] views, borrowed from the core's output
/// (intranode or internode).
pub struct RecvParts<'a> {
    /// The received rows.
    pub x: &'a RecvX,
    /// Local expert ids, when top-k was given.
    pub topk_idx: Option<&'a ep::Tensor<i32>>,
    /// Weights, when top-k was given.
    pub topk_weights: Option<&'a ep::Tensor<f32>>,
    /// Rows received, when known on the host.
    pub num_recv_tokens: Option<usize>,
    /// Rows per local expert, when known on the host.
    pub num_recv_tokens_per_expert: Option<Vec<usize>>,
}

impl Dispatched {
    /// Views of `parts` (kept alive by the views), with `handle` for the next operations.
    pub fn new(py: Python<'_>, parts: RecvParts<'_>, handle: PyObject) -> PyResult<Self> {
        let (x, scales) = match parts.x {
            RecvX::Bf16(x) => (DeviceView::py(py, x)?, None),
            RecvX::Fp8 { x, scales } => (DeviceView::py(py, x)?, Some(DeviceView::py(py, scales)?)),
        };
        Ok(Self {
            x,
            scales,
            topk_idx: parts.topk_idx.map(|t| DeviceView::py(py, t)).transpose()?,
            topk_weights: parts
                .topk_weights
                .map(|t| DeviceView::py(py, t))
                .transpose()?,
            num_recv_tokens: parts.num_recv_tokens,
            num_recv_tokens_per_expert: parts.num_recv_tokens_per_expert,
            handle,
        })
    }
}

/// What a combine produced (internal).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Combined {
    /// BF16 `[tokens, hidden]`.
    #[pyo3(get)]
    x: Py<DeviceView>,
    /// f32 `[tokens, k]`, when weights were given.
    #[pyo3(get)]
    topk_weights: Option<Py<DeviceView>>,
}

impl Combined {
    /// Views of a combine's output (kept alive by the views).
    pub fn new(py: Python<'_>, out: &ep::CombineOutput) -> PyResult<Self> {
        Ok(Self {
            x: DeviceView::py(py, &out.x)?,
            topk_weights: out
                .topk_weights
                .as_ref()
                .map(|t| DeviceView::py(py, t))
                .transpose()?,
        })
    }
}

/// The tokens to send, over caller memory.
pub enum XIn {
    /// BF16 `[tokens, hidden]`.
    Bf16(ep::Tensor<Bf16>),
    /// FP8 `[tokens, hidden]` and f32 scales `[tokens, hidden / 128]`.
    Fp8(ep::Tensor<Fp8E4M3>, ep::Tensor<f32>),
}

impl XIn {
    /// The tokens at `x_ptr` (FP8 with scales at `scales_ptr` when `fp8`), `tokens × hidden`.
    ///
    /// # Safety
    ///
    /// As [`input`]: the addresses are live, checked tensors of these shapes on `ctx`'s GPU
    /// that outlive the work queued with them (the Python layer's promise).
    pub unsafe fn new(
        ctx: &Arc<CudaContext>,
        x_ptr: u64,
        fp8: bool,
        tokens: usize,
        hidden: usize,
        scales_ptr: u64,
    ) -> Self {
        if fp8 {
            // SAFETY: our caller's promise (above): FP8 `[tokens, hidden]`.
            let x = unsafe { input::<Fp8E4M3>(ctx, x_ptr, &[tokens, hidden]) };
            let words = hidden.div_ceil(ep::FP8_BLOCK);
            // SAFETY: as above, scales `[tokens, hidden / 128]` f32.
            let scales = unsafe { input::<f32>(ctx, scales_ptr, &[tokens, words]) };
            XIn::Fp8(x, scales)
        } else {
            // SAFETY: our caller's promise (above): BF16 `[tokens, hidden]`.
            XIn::Bf16(unsafe { input::<Bf16>(ctx, x_ptr, &[tokens, hidden]) })
        }
    }

    /// As the core's dispatch argument.
    pub fn arg(&self) -> DispatchX<'_> {
        match self {
            XIn::Bf16(x) => DispatchX::Bf16(x),
            XIn::Fp8(x, scales) => DispatchX::Fp8 { x, scales },
        }
    }
}

/// The inputs of a combine over caller memory: rows, weights, biases.
pub struct CombineIn {
    /// BF16 `[rows, hidden]`.
    pub x: ep::Tensor<Bf16>,
    /// f32 `[rows, k]`, when given.
    pub topk_weights: Option<ep::Tensor<f32>>,
    /// BF16 `[tokens, hidden]` each, when given.
    pub bias: [Option<ep::Tensor<Bf16>>; 2],
}

impl CombineIn {
    /// Rows at `x_ptr`, weights at `topk_weights_ptr` and biases at `bias_ptrs` (0: not given).
    ///
    /// # Safety
    ///
    /// As [`input`]: every non-zero address is a live, checked tensor of the shape said above
    /// on `ctx`'s GPU that outlives the work queued with it (the Python layer's promise).
    pub unsafe fn new(
        ctx: &Arc<CudaContext>,
        shape: CombineShape,
        x_ptr: u64,
        topk_weights_ptr: u64,
        bias_ptrs: [u64; 2],
    ) -> Self {
        let CombineShape {
            rows,
            hidden,
            k,
            tokens,
        } = shape;
        // SAFETY: our caller's promise (above): BF16 `[rows, hidden]`.
        let x = unsafe { input::<Bf16>(ctx, x_ptr, &[rows, hidden]) };
        let topk_weights = (topk_weights_ptr != 0)
            // SAFETY: as above, f32 `[rows, k]`.
            .then(|| unsafe { input::<f32>(ctx, topk_weights_ptr, &[rows, k]) });
        let bias = bias_ptrs.map(|p| {
            // SAFETY: as above, BF16 `[tokens, hidden]`.
            (p != 0).then(|| unsafe { input::<Bf16>(ctx, p, &[tokens, hidden]) })
        });
        Self {
            x,
            topk_weights,
            bias,
        }
    }

    /// The biases as the core's argument.
    pub fn bias(&self) -> [Option<&ep::Tensor<Bf16>>; 2] {
        [self.bias[0].as_ref(), self.bias[1].as_ref()]
    }
}

/// The shapes of a combine's inputs.
#[derive(Debug, Clone, Copy)]
pub struct CombineShape {
    /// Rows of `x` and the weights (the dispatch's output rows).
    pub rows: usize,
    /// Elements per row.
    pub hidden: usize,
    /// Top-k width of the weights (0 without).
    pub k: usize,
    /// Rows of the biases (the dispatch's input tokens).
    pub tokens: usize,
}
