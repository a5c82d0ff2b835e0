//! The low-latency buffer for Python: [`ep::low_latency::LowLatencyBuffer`] driven with raw
//! device addresses (internal API for `ep_ibgda/buffer.py`, same contract as
//! [`intranode`](crate::intranode): checked, live torch tensors; 0 for "not given").
//!
//! Everything runs on the buffer's stream; the Python layer orders it against the caller's
//! stream and copies the outputs into torch tensors there (after the receive: at once, or when
//! the hook is called).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ep::low_latency::{
    Fp8Options, LlCombineArgs, LlCombineX, LlDispatchArgs, LlRecvInto, LlRecvX, LlScales,
    LowLatencyBuffer, LowLatencyOptions, RecvHook,
};
use ep::{Bf16, Exchange, Fp8E4M3};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::group::PyGroup;
use crate::handoff::Handoff;
use crate::to_py;
use crate::view::{input, DeviceView};

/// One rank's low-latency buffer (internal: use `ep_ibgda.Buffer(low_latency_mode=True)`).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct LowLatency {
    inner: Option<LowLatencyBuffer>,
    ctx: Arc<CudaContext>,
    /// Host time spent inside the `ep` core's operations (see [`core_ns`](Self::core_ns)).
    core_ns: u64,
    /// The events of the hand-off between the caller's stream and the communication stream.
    handoff: Handoff,
}

/// What a low-latency combine needs about its dispatch (opaque to callers).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct LlHandle {
    inner: ep::low_latency::LlHandle,
}

#[pymethods]
impl LlHandle {
    /// Tokens the dispatch sent (rows of the combine output).
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    /// The dispatch's hidden size.
    #[getter]
    fn hidden(&self) -> usize {
        self.inner.hidden()
    }
}

/// The receive half of a hook-mode operation; [`call`](Hook::call) queues it once.
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Hook {
    inner: Option<RecvHook>,
}

#[pymethods]
impl Hook {
    /// Queues the receive on the buffer's stream (no host wait). A second call is an error.
    fn call(&mut self) -> PyResult<()> {
        match self.inner.take() {
            Some(h) => h.call().map_err(to_py),
            None => Err(PyRuntimeError::new_err(
                "this receive hook was already called (each hook runs once)",
            )),
        }
    }
}

/// What a low-latency dispatch produced, as views of the buffer's memory (internal).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct LlDispatched {
    /// `[local, ranks * max_tokens, hidden]` BF16 (`<i2`) or FP8 (`|u1`).
    #[pyo3(get)]
    x: Py<DeviceView>,
    /// FP8 scales: f32 `[local, ranks * max_tokens, hidden / 128]` or packed UE8M0 i32
    /// `[.., hidden / 512]`.
    #[pyo3(get)]
    scales: Option<Py<DeviceView>>,
    /// Rows per local expert, i32 `[local]`.
    #[pyo3(get)]
    recv_count: Py<DeviceView>,
    /// For combine.
    #[pyo3(get)]
    handle: Py<LlHandle>,
    /// The receive, in hook mode.
    #[pyo3(get)]
    hook: Option<Py<Hook>>,
}

/// What a low-latency combine produced (internal).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct LlCombined {
    /// BF16 `[tokens, hidden]`.
    #[pyo3(get)]
    x: Py<DeviceView>,
    /// The receive, in hook mode.
    #[pyo3(get)]
    hook: Option<Py<Hook>>,
}

fn released() -> PyErr {
    PyRuntimeError::new_err("the low-latency buffer was destroyed (Buffer.destroy)")
}

impl LowLatency {
    /// Adds the time since `t0` to [`core_ns`](Self::core_ns).
    fn lap(&mut self, t0: Instant) {
        self.core_ns = self.core_ns.saturating_add(crate::elapsed_ns(t0));
    }

    fn buf(&mut self) -> PyResult<&mut LowLatencyBuffer> {
        self.inner.as_mut().ok_or_else(released)
    }
}

fn hook(py: Python<'_>, h: Option<RecvHook>) -> PyResult<Option<Py<Hook>>> {
    h.map(|h| Py::new(py, Hook { inner: Some(h) })).transpose()
}

#[pymethods]
impl LowLatency {
    /// Builds this rank's buffer on GPU `device` with every rank of the group.
    #[new]
    #[pyo3(signature = (device, rank, world, all_gather, barrier, max_tokens_per_rank, max_hidden,
        max_topk, num_experts, allow_nvlink, timeout_s, enable_shrink=false))]
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
        allow_nvlink: bool,
        timeout_s: f64,
        enable_shrink: bool,
    ) -> PyResult<Self> {
        let ctx = ibgda_device::cuda::context(device)
            .map_err(|e| PyRuntimeError::new_err(format!("rank {rank}: GPU {device}: {e}")))?;
        let group: Arc<dyn Exchange> =
            Arc::new(PyGroup::new(rank, world, device, all_gather, barrier));
        let mut opts =
            LowLatencyOptions::new(max_tokens_per_rank, max_hidden, max_topk, num_experts);
        opts.allow_nvlink = allow_nvlink;
        opts.enable_shrink = enable_shrink;
        opts.timeout = Duration::from_secs_f64(timeout_s.max(0.001));
        // Before the buffer: a failure here drops no built buffer (whose teardown is a collective).
        let handoff = Handoff::new(&ctx, rank)?;
        let inner = LowLatencyBuffer::new(&ctx, group, &opts).map_err(to_py)?;
        Ok(Self {
            inner: Some(inner),
            ctx,
            core_ns: 0,
            handoff,
        })
    }

    /// The stream every operation runs on (a `CUstream` handle), never destroyed (see
    /// `kept_streams`).
    #[getter]
    fn stream(&mut self) -> PyResult<u64> {
        Ok(crate::kept_streams::keep(self.buf()?.stream()))
    }

    /// Makes the communication stream wait (on the GPU) for the work queued so far on
    /// `caller`, the caller's current stream (a raw `CUstream` of this buffer's GPU).
    fn comm_after(&mut self, caller: u64) -> PyResult<()> {
        let comm = self.inner.as_ref().ok_or_else(released)?.stream();
        self.handoff.comm_after(comm, caller)
    }

    /// Makes `caller` (a raw `CUstream` of this buffer's GPU) wait (on the GPU) for the work
    /// queued so far on the communication stream.
    fn caller_after(&mut self, caller: u64) -> PyResult<()> {
        let comm = self.inner.as_ref().ok_or_else(released)?.stream();
        self.handoff.caller_after(comm, caller)
    }

    /// `[max_tokens_per_rank, max_hidden, max_topk, num_experts]`.
    #[getter]
    fn limits(&mut self) -> PyResult<Vec<usize>> {
        let o = self.buf()?.options();
        Ok(vec![
            o.max_tokens_per_rank,
            o.max_hidden,
            o.max_topk,
            o.num_experts,
        ])
    }

    /// SMs the kernels use by default.
    #[getter]
    fn num_sms(&mut self) -> PyResult<u32> {
        Ok(self.buf()?.num_sms())
    }

    /// Dispatches BF16 `x` `[tokens, hidden]` by i32 `topk_idx` `[tokens, k]`; the receive adds
    /// its wait cycles per source rank to the i64 `[ranks]` tensor at `wait_stats_ptr` (0: none),
    /// and writes the rows straight into the tensor at `recv_x_ptr` (`[local, ranks *
    /// max_tokens, hidden]` of the dispatched type) and the counts into the i32 `[local]` tensor
    /// at `recv_count_ptr` when given (0: the buffer's own output half).
    #[pyo3(signature = (x_ptr, tokens, hidden, topk_idx_ptr, k, use_fp8, round_scale, use_ue8m0,
        return_recv_hook, wait_stats_ptr=0, recv_x_ptr=0, recv_count_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        py: Python<'_>,
        x_ptr: u64,
        tokens: usize,
        hidden: usize,
        topk_idx_ptr: u64,
        k: usize,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        return_recv_hook: bool,
        wait_stats_ptr: u64,
        recv_x_ptr: u64,
        recv_count_ptr: u64,
    ) -> PyResult<LlDispatched> {
        let ranks = self.buf()?.ranks();
        let local = self.buf()?.num_local_experts();
        let cap = ranks * self.buf()?.options().max_tokens_per_rank;
        // SAFETY: the module's contract: live, checked tensors of these shapes.
        let x = unsafe { input::<Bf16>(&self.ctx, x_ptr, &[tokens, hidden]) };
        // SAFETY: as above, i32 `[tokens, k]`.
        let idx = unsafe { input::<i32>(&self.ctx, topk_idx_ptr, &[tokens, k]) };
        let mut args = LlDispatchArgs::new(&x, &idx);
        args.fp8 = use_fp8.then_some(Fp8Options {
            round_scale,
            ue8m0: use_ue8m0,
        });
        args.return_recv_hook = return_recv_hook;
        let stats = (wait_stats_ptr != 0)
            // SAFETY: the module's contract: a live, checked i64 `[ranks]` tensor.
            .then(|| unsafe { input::<i64>(&self.ctx, wait_stats_ptr, &[ranks]) });
        args.wait_stats = stats.as_ref();
        let recv_shape = [local, cap, hidden];
        let into_bf16 = (recv_x_ptr != 0 && !use_fp8)
            // SAFETY: the module's contract: a live, checked BF16 tensor of this shape.
            .then(|| unsafe { input::<Bf16>(&self.ctx, recv_x_ptr, &recv_shape) });
        let into_fp8 = (recv_x_ptr != 0 && use_fp8)
            // SAFETY: the module's contract: a live, checked FP8 tensor of this shape.
            .then(|| unsafe { input::<Fp8E4M3>(&self.ctx, recv_x_ptr, &recv_shape) });
        args.recv_into = match (&into_bf16, &into_fp8) {
            (Some(t), _) => Some(LlRecvInto::Bf16(t)),
            (_, Some(t)) => Some(LlRecvInto::Fp8(t)),
            _ => None,
        };
        let count_into = (recv_count_ptr != 0)
            // SAFETY: the module's contract: a live, checked i32 `[local]` tensor.
            .then(|| unsafe { input::<i32>(&self.ctx, recv_count_ptr, &[local]) });
        args.recv_count_into = count_into.as_ref();
        let t0 = Instant::now();
        let out = self.buf()?.dispatch(&args);
        self.lap(t0);
        let out = out.map_err(to_py)?;
        let (x, scales) = match &out.x {
            LlRecvX::Bf16(x) => (DeviceView::py(py, x)?, None),
            LlRecvX::Fp8 { x, scales } => (
                DeviceView::py(py, x)?,
                Some(match scales {
                    LlScales::F32(s) => DeviceView::py(py, s)?,
                    LlScales::Ue8m0(s) => DeviceView::py(py, s)?,
                }),
            ),
        };
        Ok(LlDispatched {
            x,
            scales,
            recv_count: DeviceView::py(py, &out.recv_count)?,
            handle: Py::new(py, LlHandle { inner: out.handle })?,
            hook: hook(py, out.hook)?,
        })
    }

    /// Combines expert outputs (BF16 `[local, ranks * max_tokens, hidden]` at `x_ptr`, or the
    /// zero-copy buffer when `x_ptr` is 0) with the dispatch's i32 `topk_idx` and f32
    /// `topk_weights` `[tokens, k]`; LogFMT rows with `use_logfmt`; wait cycles per source rank
    /// added to the i64 `[ranks]` tensor at `wait_stats_ptr` (0: none); the combined BF16
    /// `[tokens, hidden]` rows written straight into the tensor at `out_ptr` when given (0: the
    /// buffer's own output half).
    #[pyo3(signature = (handle, x_ptr, x_shape, topk_idx_ptr, topk_weights_ptr, tokens, k,
        return_recv_hook, use_logfmt=false, wait_stats_ptr=0, out_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        py: Python<'_>,
        handle: &LlHandle,
        x_ptr: u64,
        x_shape: Vec<usize>,
        topk_idx_ptr: u64,
        topk_weights_ptr: u64,
        tokens: usize,
        k: usize,
        return_recv_hook: bool,
        use_logfmt: bool,
        wait_stats_ptr: u64,
        out_ptr: u64,
    ) -> PyResult<LlCombined> {
        let ranks = self.buf()?.ranks();
        let ctx = self.ctx.clone();
        let x = (x_ptr != 0)
            // SAFETY: the module's contract: live, checked tensors of these shapes.
            .then(|| unsafe { input::<Bf16>(&ctx, x_ptr, &x_shape) });
        // SAFETY: as above, i32 `[tokens, k]`.
        let idx = unsafe { input::<i32>(&ctx, topk_idx_ptr, &[tokens, k]) };
        // SAFETY: as above, f32 `[tokens, k]`.
        let w = unsafe { input::<f32>(&ctx, topk_weights_ptr, &[tokens, k]) };
        let cx = match &x {
            Some(x) => LlCombineX::Tensor(x),
            None => LlCombineX::ZeroCopy,
        };
        let stats = (wait_stats_ptr != 0)
            // SAFETY: the module's contract: a live, checked i64 `[ranks]` tensor.
            .then(|| unsafe { input::<i64>(&ctx, wait_stats_ptr, &[ranks]) });
        let mut args = LlCombineArgs::new(cx, &idx, &w, &handle.inner);
        args.return_recv_hook = return_recv_hook;
        args.use_logfmt = use_logfmt;
        args.wait_stats = stats.as_ref();
        let hidden = handle.inner.hidden();
        let into = (out_ptr != 0)
            // SAFETY: the module's contract: a live, checked BF16 `[tokens, hidden]` tensor.
            .then(|| unsafe { input::<Bf16>(&ctx, out_ptr, &[tokens, hidden]) });
        args.out_into = into.as_ref();
        let t0 = Instant::now();
        let out = self.buf()?.combine(&args);
        self.lap(t0);
        let out = out.map_err(to_py)?;
        Ok(LlCombined {
            x: DeviceView::py(py, &out.x)?,
            hook: hook(py, out.hook)?,
        })
    }

    /// Nanoseconds of host time spent inside the `ep` core's dispatch and combine, summed
    /// since the buffer was built: what a Rust caller would spend on the same calls (see
    /// `python/bench/host_overhead.py`).
    #[getter]
    fn core_ns(&self) -> u64 {
        self.core_ns
    }

    /// This rank's network buffer as raw bytes, `u8 [len]` (`Buffer.get_local_buffer_tensor`
    /// with `use_rdma_buffer=True`).
    fn local_buffer(&mut self, py: Python<'_>) -> PyResult<Py<DeviceView>> {
        let t = self.buf()?.local_net_buffer();
        DeviceView::py(py, &t)
    }

    /// The zero-copy combine input for `hidden`: BF16 `[local, ranks * max_tokens, hidden]`.
    fn combine_input(&mut self, py: Python<'_>, hidden: usize) -> PyResult<Py<DeviceView>> {
        let t = self.buf()?.combine_input(hidden).map_err(to_py)?;
        DeviceView::py(py, &t)
    }

    /// Masks (or unmasks) `rank` on this rank, ordered on the buffer's stream (`enable_shrink`).
    fn update_mask(&mut self, rank: usize, mask: bool) -> PyResult<()> {
        self.buf()?.update_mask(rank, mask).map_err(to_py)
    }

    /// Copies who is masked (i32 `[ranks]`, 1 = masked) to `ptr`, ordered on the buffer's stream.
    fn query_mask(&mut self, ptr: u64) -> PyResult<()> {
        let ranks = self.buf()?.ranks();
        // SAFETY: the module's contract: a live, checked i32 `[ranks]` tensor.
        let out = unsafe { input::<i32>(&self.ctx, ptr, &[ranks]) };
        self.buf()?.query_mask(&out).map_err(to_py)
    }

    /// Unmasks every rank, ordered on the buffer's stream.
    fn clean_mask(&mut self) -> PyResult<()> {
        self.buf()?.clean_mask().map_err(to_py)
    }

    /// Resets every rank's signals and sequence numbers (a collective, host-synchronous).
    fn clean(&mut self) -> PyResult<()> {
        self.buf()?.clean().map_err(to_py)
    }

    /// Waits (bounded) for the buffer's stream; reports errors the kernels recorded.
    fn synchronize(&mut self) -> PyResult<()> {
        self.buf()?.synchronize().map_err(to_py)
    }

    /// Raises, without waiting, a device error that kernels of earlier operations recorded
    /// (`LowLatencyBuffer::check_errors`); the Python layer calls it before every dispatch and
    /// combine, which make no host wait that would report their kernels' errors.
    fn check_errors(&mut self) -> PyResult<()> {
        self.buf()?.check_errors().map_err(to_py)
    }

    /// Tears the buffer down together with every rank (a collective); idempotent.
    fn shutdown(&mut self) -> PyResult<()> {
        match self.inner.take() {
            Some(b) => b.shutdown().map_err(to_py),
            None => Ok(()),
        }
    }
}
