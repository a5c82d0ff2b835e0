//! The internode (normal-mode) buffer for Python: [`ep::internode::InternodeBuffer`] driven with
//! raw device addresses, ranks as processes over the caller's group.
//!
//! The contract is the intranode module's ([`crate::intranode`]): every `*_ptr` argument is the
//! `data_ptr()` of a torch tensor whose dtype, shape, device and contiguity `ep_ibgda/buffer.py`
//! checked and keeps alive until the work queued on it has finished; 0 means "not given". Every
//! operation runs on the buffer's communication stream, starts after an event recorded there
//! (the Python layer first makes that stream wait for the caller's stream or `previous_event`)
//! and makes no other stream wait; the Python layer orders the caller's stream after the copies
//! of the outputs.
//!
//! What differs from the intranode buffer: the layout and every dispatch wait on the host
//! (bounded; the staged core counts the rows each node sent before the NVLink hop), dispatch
//! always routes by top-k ids (the Python layer stands one expert per destination rank in for a
//! dispatch without top-k), the outputs are fresh allocations of each call (pooled regions of
//! the core with `num_worst_tokens`), the SMs of the NVLink hop are the core's choice (what
//! keeps every rank sharing the GPU co-resident), not the caller's `Config.num_sms`, and device
//! errors are not reported by any wait after the kernels of a combine (or of anything with
//! `num_worst_tokens`): the Python layer calls [`Internode::check_errors`] before every
//! operation, so an earlier failure raises instead of feeding incomplete outputs on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ep::internode::{
    InternodeBuffer, InternodeCombineArgs, InternodeDispatchArgs, InternodeOptions, Topology,
};
use ep::{Event, StreamOrder, TopK};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::group::PyGroup;
use crate::handoff::Handoff;
use crate::intranode::released;
use crate::normal::{CombineIn, CombineShape, Combined, Dispatched, RecvParts, XIn};
use crate::to_py;
use crate::view::{input, DeviceView};

/// One rank's internode buffer (internal: use `ep_ibgda.Buffer`).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct Internode {
    inner: Option<InternodeBuffer>,
    ctx: Arc<CudaContext>,
    /// Host time spent inside the `ep` core's operations (see [`core_ns`](Self::core_ns)).
    core_ns: u64,
    /// The events of the hand-off between the caller's stream and the communication stream.
    handoff: Handoff,
}

/// An internode dispatch layout computed by the native side (internal).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct InternodeLayout {
    inner: ep::internode::InternodeLayout,
}

/// How an internode dispatch routed tokens: what combine and a cached dispatch need (opaque to
/// callers).
#[pyclass(module = "ep_ibgda._ep", unsendable)]
pub struct InternodeHandle {
    inner: ep::internode::InternodeHandle,
}

#[pymethods]
impl InternodeHandle {
    /// Tokens the source side sent (rows of the combine output).
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    /// Rows of the dispatch output (and of the combine input), worst-token padding included.
    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.num_rows()
    }
}

/// The topology of `nodes × ranks_per_node` ranks: virtual nodes of one host, or hosts.
fn topology(nodes: usize, ranks_per_node: usize, virtual_nodes: bool) -> PyResult<Topology> {
    let t = if virtual_nodes {
        Topology::virtual_nodes(nodes, ranks_per_node)
    } else {
        Topology::new(nodes, ranks_per_node)
    };
    t.map_err(|e| PyValueError::new_err(e.to_string()))
}

/// GPU bytes each rank's internode buffer takes for these limits, as `(NVLink hop, net
/// buffer)`: the node's intranode buffer (see [`crate::intranode_window_bytes`]) and the
/// registered buffer the RDMA hop writes into. `None` when the topology is out of range or the
/// sizes overflow. Each operation's outputs are allocated apart from these.
pub fn bytes(
    nodes: usize,
    ranks_per_node: usize,
    opts: &ep::BufferOptions,
) -> Option<(usize, usize)> {
    let topo = Topology::new(nodes, ranks_per_node).ok()?;
    let o = InternodeOptions::new(opts.clone());
    let nvl = crate::intranode_window_bytes(&o.nvlink_options(&topo), ranks_per_node)?;
    Some((nvl, o.net_bytes(&topo)?))
}

impl Internode {
    /// Adds the time since `t0` to [`core_ns`](Self::core_ns).
    fn lap(&mut self, t0: Instant) {
        self.core_ns = self.core_ns.saturating_add(crate::elapsed_ns(t0));
    }

    fn buf(&mut self) -> PyResult<&mut InternodeBuffer> {
        self.inner.as_mut().ok_or_else(released)
    }

    /// The order of an operation: after an event at the current end of the communication
    /// stream, and no other stream made to wait.
    fn here(&mut self) -> PyResult<Event> {
        Event::on(self.buf()?.comm_stream()).map_err(to_py)
    }
}

fn order(start: &Event) -> StreamOrder<'_> {
    StreamOrder {
        previous_event: Some(start),
        async_finish: true,
    }
}

fn dispatched(py: Python<'_>, out: ep::internode::InternodeDispatchOutput) -> PyResult<Dispatched> {
    let parts = RecvParts {
        x: &out.x,
        topk_idx: out.topk_idx.as_ref(),
        topk_weights: out.topk_weights.as_ref(),
        num_recv_tokens: Some(out.num_recv_tokens),
        num_recv_tokens_per_expert: out.num_recv_tokens_per_expert.clone(),
    };
    let handle = Py::new(py, InternodeHandle { inner: out.handle })?.into_any();
    Dispatched::new(py, parts, handle)
}

#[pymethods]
impl Internode {
    /// Builds this rank's buffer on GPU `device` together with every rank of the group
    /// (`all_gather`, `barrier`: see [`PyGroup`]): rank `r` is local rank `r % ranks_per_node`
    /// of node `r / ranks_per_node`; `virtual_nodes`: the nodes split one host (inter-node
    /// bytes go through the NIC all the same).
    #[new]
    #[pyo3(signature = (device, rank, world, all_gather, barrier, nodes, ranks_per_node,
        virtual_nodes, max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs,
        timeout_s))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        rank: usize,
        world: usize,
        all_gather: Py<PyAny>,
        barrier: Py<PyAny>,
        nodes: usize,
        ranks_per_node: usize,
        virtual_nodes: bool,
        max_tokens_per_rank: usize,
        max_hidden: usize,
        max_topk: usize,
        num_experts: usize,
        max_live_outputs: usize,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let topo = topology(nodes, ranks_per_node, virtual_nodes)?;
        let ctx = ibgda_device::cuda::context(device)
            .map_err(|e| PyRuntimeError::new_err(format!("rank {rank}: GPU {device}: {e}")))?;
        let group = Arc::new(PyGroup::new(rank, world, device, all_gather, barrier));
        let mut buffer =
            ep::BufferOptions::new(max_tokens_per_rank, max_hidden, max_topk, num_experts);
        buffer.max_live_outputs = max_live_outputs;
        buffer.timeout = Duration::from_secs_f64(timeout_s.max(0.001));
        let opts = InternodeOptions::new(buffer);
        // Before the buffer: a failure here drops no built buffer (whose teardown is a collective).
        let handoff = Handoff::new(&ctx, rank)?;
        let inner = InternodeBuffer::new(&ctx, group, &topo, &opts).map_err(to_py)?;
        Ok(Self {
            inner: Some(inner),
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

    /// `[max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs, nodes,
    /// ranks_per_node]`.
    #[getter]
    fn limits(&mut self) -> PyResult<Vec<usize>> {
        let b = self.buf()?;
        let o = &b.options().buffer;
        let t = b.topology();
        Ok(vec![
            o.max_tokens_per_rank,
            o.max_hidden,
            o.max_topk,
            o.num_experts,
            o.max_live_outputs,
            t.nodes(),
            t.ranks_per_node(),
        ])
    }

    /// The routing of `tokens` tokens by global top-k ids (i32 `[tokens, k]` at
    /// `topk_idx_ptr`). Waits (bounded) on the host.
    fn layout(&mut self, topk_idx_ptr: u64, tokens: usize, k: usize) -> PyResult<InternodeLayout> {
        // SAFETY: the module's contract: a live, checked i32 tensor `[tokens, k]`.
        let idx = unsafe { input::<i32>(&self.ctx, topk_idx_ptr, &[tokens, k]) };
        let t0 = Instant::now();
        let inner = self.buf()?.get_dispatch_layout(&idx);
        self.lap(t0);
        Ok(InternodeLayout {
            inner: inner.map_err(to_py)?,
        })
    }

    /// Dispatches `x` (BF16, or FP8 with f32 scales) by `layout` and the top-k ids (i32, global)
    /// and weights (f32) `[tokens, k]`. `num_worst_tokens` > 0 pads the outputs to that many
    /// rows. Waits (bounded) on the host.
    #[pyo3(signature = (layout, x_ptr, fp8, tokens, hidden, scales_ptr, topk_idx_ptr,
        topk_weights_ptr, k, num_worst_tokens, expert_alignment))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        py: Python<'_>,
        layout: &InternodeLayout,
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
    ) -> PyResult<Dispatched> {
        if topk_idx_ptr == 0 || topk_weights_ptr == 0 {
            return Err(PyValueError::new_err(
                "internode dispatch routes by top-k ids and weights: both are required",
            ));
        }
        let ctx = self.ctx.clone();
        // SAFETY: the module's contract: live, checked tensors of these shapes.
        let xin = unsafe { XIn::new(&ctx, x_ptr, fp8, tokens, hidden, scales_ptr) };
        // SAFETY: as above, i32 `[tokens, k]`.
        let idx = unsafe { input::<i32>(&ctx, topk_idx_ptr, &[tokens, k]) };
        // SAFETY: as above, f32 `[tokens, k]`.
        let weights = unsafe { input::<f32>(&ctx, topk_weights_ptr, &[tokens, k]) };
        let start = self.here()?;
        let args = InternodeDispatchArgs {
            x: xin.arg(),
            layout: &layout.inner,
            topk: TopK {
                idx: &idx,
                weights: &weights,
            },
            num_worst_tokens: (num_worst_tokens > 0).then_some(num_worst_tokens),
            expert_alignment: expert_alignment.max(1),
            order: order(&start),
        };
        let t0 = Instant::now();
        let out = self.buf()?.dispatch(&args);
        self.lap(t0);
        dispatched(py, out.map_err(to_py)?)
    }

    /// Sends `x` along the routes of `handle`'s dispatch (no top-k). Waits (bounded) on the
    /// host.
    #[pyo3(signature = (handle, x_ptr, fp8, tokens, hidden, scales_ptr))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_cached(
        &mut self,
        py: Python<'_>,
        handle: &InternodeHandle,
        x_ptr: u64,
        fp8: bool,
        tokens: usize,
        hidden: usize,
        scales_ptr: u64,
    ) -> PyResult<Dispatched> {
        // SAFETY: the module's contract: live, checked tensors of these shapes.
        let xin = unsafe { XIn::new(&self.ctx, x_ptr, fp8, tokens, hidden, scales_ptr) };
        let start = self.here()?;
        let t0 = Instant::now();
        let out = self
            .buf()?
            .dispatch_cached(xin.arg(), &handle.inner, &order(&start));
        self.lap(t0);
        dispatched(py, out.map_err(to_py)?)
    }

    /// Sums every copy of each token back (BF16 `[rows, hidden]` at `x_ptr`), with weights
    /// (f32 `[rows, k]`) and up to two biases (BF16 `[tokens, hidden]`) when given.
    #[pyo3(signature = (handle, x_ptr, rows, hidden, topk_weights_ptr, k, bias0_ptr, bias1_ptr))]
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        py: Python<'_>,
        handle: &InternodeHandle,
        x_ptr: u64,
        rows: usize,
        hidden: usize,
        topk_weights_ptr: u64,
        k: usize,
        bias0_ptr: u64,
        bias1_ptr: u64,
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
        let start = self.here()?;
        let args = InternodeCombineArgs {
            x: &inputs.x,
            handle: &handle.inner,
            topk_weights: inputs.topk_weights.as_ref(),
            bias: inputs.bias(),
            order: order(&start),
        };
        let t0 = Instant::now();
        let out = self.buf()?.combine(&args);
        self.lap(t0);
        Combined::new(py, &out.map_err(to_py)?)
    }

    /// Nanoseconds of host time spent inside the `ep` core's operations (layout, dispatch,
    /// cached dispatch, combine), summed since the buffer was built.
    #[getter]
    fn core_ns(&self) -> u64 {
        self.core_ns
    }

    /// The NVLink hop's window on this rank as raw bytes, `u8 [len]`
    /// (`Buffer.get_local_buffer_tensor`).
    fn local_buffer(&mut self, py: Python<'_>) -> PyResult<Py<DeviceView>> {
        let t = self.buf()?.intranode().local_window();
        DeviceView::py(py, &t)
    }

    /// Waits (bounded) for the communication stream; reports errors the kernels recorded.
    fn synchronize(&mut self) -> PyResult<()> {
        self.buf()?.synchronize().map_err(to_py)
    }

    /// Raises, without waiting, a device error that kernels of earlier operations recorded
    /// (`InternodeBuffer::check_errors`): after one, outputs are incomplete (a combine sums only
    /// the parts that arrived) and the buffer is unusable. The Python layer calls it before
    /// every operation, since combine (and every operation with `num_worst_tokens`) makes no
    /// host wait that would report its kernels' errors.
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

impl Drop for Internode {
    fn drop(&mut self) {
        if let Some(b) = self.inner.take() {
            // The core's teardown meets every rank; a Python object is dropped whenever the
            // garbage collector gets to it (at exit too, after the group may be gone), where
            // meeting could wait for peers that never come. Leak it instead, as the intranode
            // buffer leaks its window when dropped without `shutdown`: the process's exit frees
            // the memory.
            std::mem::forget(b);
        }
    }
}
