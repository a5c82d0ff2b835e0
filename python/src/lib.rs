//! `ep_ibgda._ep`: the native half of the `ep_ibgda` Python package.
//!
//! The Python layer (`python/ep_ibgda/`) owns DeepEP's API: it checks every torch tensor
//! (dtype, shape, device, contiguity) and hands this module plain integers: device addresses,
//! sizes, stream handles. Nothing here links against libtorch or imports torch. Inputs become
//! [`ep::Tensor`]s over the caller's memory ([`ep::Tensor::from_device_ptr`]); outputs come back
//! as [`DeviceView`]s (`__cuda_array_interface__`), which the Python layer copies into
//! torch-allocated tensors on the communication stream, so the caller owns every output.
//!
//! Ranks meet through the caller's `torch.distributed` group: [`group::PyGroup`] implements
//! [`ep::bootstrap::Communicator`] by calling back into Python (`all_gather_object`).

use pyo3::prelude::*;

mod group;
mod handoff;
mod internode;
mod intranode;
mod kept_streams;
mod low_latency;
mod normal;
mod view;

pub use group::PyGroup;
pub use view::DeviceView;

/// Maps an [`ep::EpError`] to the Python exception a caller expects: `ValueError` for a bad
/// argument, `TimeoutError` for a wait that ran out, `RuntimeError` otherwise. The message is the
/// error's own (it names the rank, the argument and the values).
pub(crate) fn to_py(e: ep::EpError) -> PyErr {
    use ep::EpError as E;
    let msg = e.to_string();
    match e {
        E::InvalidArgument { .. }
        | E::ExpertIdOutOfRange { .. }
        | E::TopkMismatch { .. }
        | E::ForeignHandle { .. }
        | E::SmBudget { .. } => pyo3::exceptions::PyValueError::new_err(msg),
        E::PeerTimeout { .. }
        | E::HostTimeout { .. }
        | E::StreamTimeout { .. }
        | E::SharedGpuTimeout { .. } => pyo3::exceptions::PyTimeoutError::new_err(msg),
        _ => pyo3::exceptions::PyRuntimeError::new_err(msg),
    }
}

/// Nanoseconds since `t0`, saturating (the host-time counters of the native buffers).
pub(crate) fn elapsed_ns(t0: std::time::Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Whether a CUDA driver can be loaded here (no GPU is touched).
#[pyfunction]
fn cuda_driver_present() -> bool {
    ibgda_device::cuda::driver_present()
}

/// GPU bytes an intranode buffer of `ranks` ranks built with `o` takes on each rank: the
/// window (signal region, combine staging for ranks as processes, `max_live_outputs` receive
/// regions) plus the pooled combine outputs. `None` when the sizes overflow.
pub(crate) fn intranode_window_bytes(o: &ep::BufferOptions, ranks: usize) -> Option<usize> {
    let out = o
        .max_hidden
        .checked_mul(2)?
        .checked_add(o.max_topk.checked_mul(4)?)?
        .checked_mul(o.max_tokens_per_rank)?;
    o.recv_region_bytes(ranks)?
        .checked_add(out)?
        .checked_mul(o.max_live_outputs)?
        .checked_add(o.combine_region_bytes(ranks)?)
}

/// GPU bytes an intranode buffer takes on each rank, for the given shape limits (what
/// `Buffer` sizes its `num_nvl_bytes` budget against; see [`intranode_window_bytes`]). `None`
/// when the sizes overflow.
#[pyfunction]
#[pyo3(signature = (ranks, max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs))]
fn intranode_bytes(
    ranks: usize,
    max_tokens_per_rank: usize,
    max_hidden: usize,
    max_topk: usize,
    num_experts: usize,
    max_live_outputs: usize,
) -> Option<usize> {
    let mut o = ep::BufferOptions::new(max_tokens_per_rank, max_hidden, max_topk, num_experts);
    o.max_live_outputs = max_live_outputs;
    intranode_window_bytes(&o, ranks)
}

/// GPU bytes an internode buffer takes on each rank of `nodes × ranks_per_node` ranks for the
/// given shape limits, as `(nvl, rdma)`: the NVLink hop's intranode buffer over the node's ranks
/// (what `Buffer` sizes `num_nvl_bytes` against) and the registered net buffer of the RDMA hop
/// (`num_rdma_bytes`). `None` when the topology is out of range or the sizes overflow.
#[pyfunction]
#[pyo3(signature = (nodes, ranks_per_node, max_tokens_per_rank, max_hidden, max_topk,
    num_experts, max_live_outputs))]
fn internode_bytes(
    nodes: usize,
    ranks_per_node: usize,
    max_tokens_per_rank: usize,
    max_hidden: usize,
    max_topk: usize,
    num_experts: usize,
    max_live_outputs: usize,
) -> Option<(usize, usize)> {
    let mut o = ep::BufferOptions::new(max_tokens_per_rank, max_hidden, max_topk, num_experts);
    o.max_live_outputs = max_live_outputs;
    internode::bytes(nodes, ranks_per_node, &o)
}

/// GPU bytes a low-latency buffer takes on each rank for the given limits (`None` for limits
/// the buffer refuses).
#[pyfunction]
fn low_latency_bytes(
    ranks: usize,
    max_tokens_per_rank: usize,
    max_hidden: usize,
    max_topk: usize,
    num_experts: usize,
) -> Option<usize> {
    ep::low_latency::LowLatencyOptions::new(max_tokens_per_rank, max_hidden, max_topk, num_experts)
        .bytes_per_rank(ranks)
}

/// The module.
#[pymodule]
fn _ep(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<view::DeviceView>()?;
    m.add_class::<intranode::Intranode>()?;
    m.add_class::<intranode::Layout>()?;
    m.add_class::<intranode::Handle>()?;
    m.add_class::<normal::Dispatched>()?;
    m.add_class::<normal::Combined>()?;
    m.add_class::<internode::Internode>()?;
    m.add_class::<internode::InternodeLayout>()?;
    m.add_class::<internode::InternodeHandle>()?;
    m.add_class::<low_latency::LowLatency>()?;
    m.add_class::<low_latency::LlHandle>()?;
    m.add_class::<low_latency::LlDispatched>()?;
    m.add_class::<low_latency::LlCombined>()?;
    m.add_class::<low_latency::Hook>()?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(intranode_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(internode_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(low_latency_bytes, m)?)?;
    m.add("FP8_BLOCK", ep::FP8_BLOCK)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
