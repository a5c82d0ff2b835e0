//! The intranode (NVLink) buffer for Python: [`ep::Buffer`] driven with raw device addresses.
//!
//! Every method taking `*_ptr` arguments is internal API for `ep_ibgda/buffer.py`, which passes
//! `data_ptr()` of torch tensors whose dtype, shape, device and contiguity it checked, and keeps
//! them alive until the work queued on them has finished (references held by the returned
//! event, `record_stream` on the communication stream). A pointer of 0 means "not given".
//!
//! Ordering: every operation runs on the buffer's communication stream and starts after an
//! event recorded there (the Python layer first makes that stream wait for the caller's stream
//! or `previous_event`), and never makes another stream wait (`async_finish`): the Python layer
//! orders the caller's stream after the copies of the outputs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ep::{CombineArgs, DispatchArgs, Event, StreamOrder, TopK};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::group::PyGroup;
use crate::handoff::Handoff;
use crate::normal::{CombineIn, CombineShape, Combined, Dispatched, RecvParts, XIn};
use crate::to_py;
use crate::view::{input, DeviceView};

/// One rank's intranode buffer (internal: use `ep_ibgda.Buffer`).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Intranode {
    inner: Option<ep::Buffer>,
    group: PyGroup,
    ctx: Arc<CudaContext>,
    /// Host time spent inside the `ep` core's operations (see [`core_ns`](Self::core_ns)).
    core_ns: u64,
    /// The events of the hand-off between the caller's stream and the communication stream.
    handoff: Handoff,
}

/// A dispatch layout computed by the native side (internal).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Layout {
    inner: ep::DispatchLayout,
}

/// How a dispatch routed tokens: what combine and a cached dispatch need (opaque to callers).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Handle {
    inner: ep::Handle,
}

#[pymethods]
impl Handle {
    /// Tokens the source side sent (rows of the combine output).
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    /// Rows of the dispatch output (and of the combine input).
    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.num_rows()
    }
}

pub(crate) fn released() -> PyErr {
    PyRuntimeError::new_err("the buffer was destroyed (Buffer.destroy)")
}

impl Intranode {
    /// Adds the time since `t0` to [`core_ns`](Self::core_ns).
    fn lap(&mut self, t0: Instant) {
        self.core_ns = self.core_ns.saturating_add(crate::elapsed_ns(t0));
    }

    fn buf(&mut self) -> PyResult<&mut ep::Buffer> {
        self.inner.as_mut().ok_or_else(released)
    }

    /// An event at the current end of the communication stream: the operation's start.
    fn here(&mut self) -> PyResult<Event> {
        Event::on(self.buf()?.comm_stream()).map_err(to_py)
    }

    fn config(&mut self, num_sms: u32) -> PyResult<ep::Config> {
        let mut c = ep::Config::default_for(self.buf()?.ranks());
        if num_sms > 0 {
            c.num_sms = num_sms;
        }
        Ok(c)
    }
}

fn dispatched(py: Python<'_>, out: ep::DispatchOutput) -> PyResult<Dispatched> {
    let parts = RecvParts {
        x: &out.x,
        topk_idx: out.topk_idx.as_ref(),
        topk_weights: out.topk_weights.as_ref(),
        num_recv_tokens: out.num_recv_tokens,
        num_recv_tokens_per_expert: out.num_recv_tokens_per_expert.clone(),
    };
    let handle = Py::new(py, Handle { inner: out.handle })?.into_any();
    Dispatched::new(py, parts, handle)
}

#[pymethods]
impl Intranode {
    /// Builds this rank's buffer on GPU `device` together with every rank of the group
    /// (`all_gather`, `barrier`: see [`PyGroup`]).
    #[new]
    #[pyo3(signature = (device, rank, world, all_gather, barrier, max_tokens_per_rank, max_hidden,
        max_topk, num_experts, max_live_outputs, timeout_s))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        rank: usize,
        world: usize,
        all_gather: Py<PyAny>,
        barrier: Py<PyAny>,
        max_tokens_per_rank: usize,
        max_hidden: usize,
        max_topk: usize,
        num_experts: usize,
        max_live_outputs: usize,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let ctx = ibgda_device::cuda::context(device)
            .map_err(|e| PyRuntimeError::new_err(format!("rank {rank}: GPU {device}: {e}")))?;
        let group = PyGroup::new(rank, world, device, all_gather, barrier);
        let mut opts =
            ep::BufferOptions::new(max_tokens_per_rank, max_hidden, max_topk, num_experts);
        opts.max_live_outputs = max_live_outputs;
        opts.timeout = Duration::from_secs_f64(timeout_s.max(0.001));
        // Before the buffer: a failure here drops no built buffer (whose teardown is a collective).
        let handoff = Handoff::new(&ctx, rank)?;
        let inner = ep::Buffer::new(&ctx, &group, &opts).map_err(to_py)?;
        Ok(Self {
            inner: Some(inner),
            group,
            ctx,
            core_ns: 0,
            handoff,
        })
    }

    /// The communication stream (a `CUstream` handle), never destroyed (see `kept_streams`).
    #[getter]
    fn comm_stream(&mut self) -> PyResult<u64> {
        Ok(crate::kept_streams::keep(self.buf()?.comm_stream()))
    }

    /// Makes the communication stream wait (on the GPU) for the work queued so far on
    /// `caller`, the caller's current stream (a raw `CUstream` of this buffer's GPU).
    fn comm_after(&mut self, caller: u64) -> PyResult<()> {
        let comm = self.inner.as_ref().ok_or_else(released)?.comm_stream();
        self.handoff.comm_after(comm, caller)
    }

    /// Makes `caller` (a raw `CUstream` of this buffer's GPU) wait (on the GPU) for the work
    /// queued so far on the communication stream.
    fn caller_after(&mut self, caller: u64) -> PyResult<()> {
        let comm = self.inner.as_ref().ok_or_else(released)?.comm_stream();
        self.handoff.caller_after(comm, caller)
    }

    /// `[max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs]`.
    #[getter]
    fn limits(&mut self) -> PyResult<Vec<usize>> {
        let o = self.buf()?.options();
        Ok(vec![
            o.max_tokens_per_rank,
            o.max_hidden,
            o.max_topk,
            o.num_experts,
            o.max_live_outputs,
        ])
    }

    /// The routing of `tokens` tokens by top-k ids (i32 `[tokens, k]` at `topk_idx_ptr`).
    /// Waits (bounded) on the host.
    fn layout(&mut self, topk_idx_ptr: u64, tokens: usize, k: usize) -> PyResult<Layout> {
        // SAFETY: the module's contract: a live, checked i32 tensor `[tokens, k]`.
        let idx = unsafe { input::<i32>(&self.ctx, topk_idx_ptr, &[tokens, k]) };
        let t0 = Instant::now();
        let inner = self.buf()?.get_dispatch_layout(&idx);
        self.lap(t0);
        Ok(Layout {
            inner: inner.map_err(to_py)?,
        })
    }

    /// Dispatches `x` (BF16, or FP8 with f32 scales) by `layout`, with top-k when
    /// `topk_idx_ptr` (i32) and `topk_weights_ptr` (f32) are given. `num_worst_tokens` 0: rows
    /// as received (host wait, bounded).
    #[pyo3(signature = (layout, x_ptr, fp8, tokens, hidden, scales_ptr, topk_idx_ptr,
        topk_weights_ptr, k, num_worst_tokens, expert_alignment, num_sms))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        py: Python<'_>,
        layout: &Layout,
        x_ptr: u64,
        fp8: bool,
        tokens: usize,
        hidden: usize,
        scales_ptr: u64,
        topk_idx_ptr: u64,
        topk_weights_ptr: u64,
        k: usize,
        num_worst_tokens: usize,
        expert_alignment: usize,
        num_sms: u32,
    ) -> PyResult<Dispatched> {
        let ctx = self.ctx.clone();
        // SAFETY: the module's contract: live, checked tensors of these shapes.
        let xin = unsafe { XIn::new(&self.ctx, x_ptr, fp8, tokens, hidden, scales_ptr) };
        let topk = (topk_idx_ptr != 0).then(|| {
            // SAFETY: the module's contract: i32 and f32 `[tokens, k]`.
            unsafe {
                (
                    input::<i32>(&ctx, topk_idx_ptr, &[tokens, k]),
                    input::<f32>(&ctx, topk_weights_ptr, &[tokens, k]),
                )
            }
        });
        let config = self.config(num_sms)?;
        let start = self.here()?;
        let x = xin.arg();
        let ranks = self.buf()?.ranks();
        let mut args = DispatchArgs::new(x, &layout.inner, ranks);
        args.topk = topk.as_ref().map(|(idx, weights)| TopK { idx, weights });
        args.num_worst_tokens = (num_worst_tokens > 0).then_some(num_worst_tokens);
        args.expert_alignment = expert_alignment.max(1);
        args.config = config;
        args.order = StreamOrder {
            previous_event: Some(&start),
            async_finish: true,
        };
        let t0 = Instant::now();
        let out = self.buf()?.dispatch(&args);
        self.lap(t0);
        dispatched(py, out.map_err(to_py)?)
    }

    /// Sends `x` along the routes of `handle`'s dispatch (no top-k, no host wait).
    #[pyo3(signature = (handle, x_ptr, fp8, tokens, hidden, scales_ptr, num_sms))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_cached(
        &mut self,
        py: Python<'_>,
        handle: &Handle,
        x_ptr: u64,
        fp8: bool,
        tokens: usize,
        hidden: usize,
        scales_ptr: u64,
        num_sms: u32,
    ) -> PyResult<Dispatched> {
        // SAFETY: the module's contract: live, checked tensors of these shapes.
        let xin = unsafe { XIn::new(&self.ctx, x_ptr, fp8, tokens, hidden, scales_ptr) };
        let config = self.config(num_sms)?;
        let start = self.here()?;
        let x = xin.arg();
        let order = StreamOrder {
            previous_event: Some(&start),
            async_finish: true,
        };
        let t0 = Instant::now();
        let out = self
            .buf()?
            .dispatch_cached(x, &handle.inner, &config, &order);
        self.lap(t0);
        dispatched(py, out.map_err(to_py)?)
    }

    /// Sums every copy of each token back (BF16 `[rows, hidden]` at `x_ptr`), with weights
    /// (f32 `[rows, k]`) and up to two biases (BF16 `[tokens, hidden]`) when given.
    #[pyo3(signature = (handle, x_ptr, rows, hidden, topk_weights_ptr, k, bias0_ptr, bias1_ptr,
        num_sms))]
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        py: Python<'_>,
        handle: &Handle,
        x_ptr: u64,
        rows: usize,
        hidden: usize,
        topk_weights_ptr: u64,
        k: usize,
        bias0_ptr: u64,
        bias1_ptr: u64,
        num_sms: u32,
    ) -> PyResult<Combined> {
        let shape = CombineShape {
            rows,
            hidden,
            k,
            tokens: handle.inner.num_tokens(),
        };
        let bias_ptrs = [bias0_ptr, bias1_ptr];
        let inputs =
            // SAFETY: the module's contract: live, checked tensors of these shapes.
            unsafe { CombineIn::new(&self.ctx, shape, x_ptr, topk_weights_ptr, bias_ptrs) };
        let config = self.config(num_sms)?;
        let start = self.here()?;
        let ranks = self.buf()?.ranks();
        let mut args = CombineArgs::new(&inputs.x, &handle.inner, ranks);
        args.topk_weights = inputs.topk_weights.as_ref();
        args.bias = inputs.bias();
        args.config = config;
        args.order = StreamOrder {
            previous_event: Some(&start),
            async_finish: true,
        };
        let t0 = Instant::now();
        let out = self.buf()?.combine(&args);
        self.lap(t0);
        Combined::new(py, &out.map_err(to_py)?)
    }

    /// Nanoseconds of host time spent inside the `ep` core's operations (layout, dispatch,
    /// cached dispatch, combine), summed since the buffer was built: what a Rust caller would
    /// spend on the same calls. The Python layer's overhead is a call's wall time less this
    /// counter's growth over it (`python/bench/host_overhead.py`).
    #[getter]
    fn core_ns(&self) -> u64 {
        self.core_ns
    }

    /// This rank's window as raw bytes, `u8 [len]` (`Buffer.get_local_buffer_tensor`).
    fn local_buffer(&mut self, py: Python<'_>) -> PyResult<Py<DeviceView>> {
        let t = self.buf()?.local_window();
        DeviceView::py(py, &t)
    }

    /// Masks (or unmasks) `rank` on this rank, ordered on the communication stream (rank masks
    /// in normal mode: see `ep::Buffer::update_mask` for what the masks of all ranks must be).
    fn update_mask(&mut self, rank: usize, mask: bool) -> PyResult<()> {
        self.buf()?.update_mask(rank, mask).map_err(to_py)
    }

    /// Copies who is masked (i32 `[ranks]`, 1 = masked) to `ptr`, ordered on the communication
    /// stream.
    fn query_mask(&mut self, ptr: u64) -> PyResult<()> {
        let ranks = self.buf()?.ranks();
        // SAFETY: the module's contract: a live, checked i32 `[ranks]` tensor.
        let out = unsafe { input::<i32>(&self.ctx, ptr, &[ranks]) };
        self.buf()?.query_mask(&out).map_err(to_py)
    }

    /// Unmasks every rank, ordered on the communication stream.
    fn clean_mask(&mut self) -> PyResult<()> {
        self.buf()?.clean_mask().map_err(to_py)
    }

    /// Waits (bounded) for the communication stream; reports errors the kernels recorded.
    fn synchronize(&mut self) -> PyResult<()> {
        self.buf()?.synchronize().map_err(to_py)
    }

    /// Raises, without waiting, a device error that kernels of earlier operations recorded
    /// (`Buffer::check_errors`). The Python layer calls it before every operation: combine makes
    /// no host wait that would report its kernels' errors.
    fn check_errors(&mut self) -> PyResult<()> {
        self.buf()?.check_errors().map_err(to_py)
    }

    /// Tears the buffer down together with every rank (a collective); idempotent.
    fn shutdown(&mut self) -> PyResult<()> {
        match self.inner.take() {
            Some(b) => b.shutdown(&self.group).map_err(to_py),
            None => Ok(()),
        }
    }
}
