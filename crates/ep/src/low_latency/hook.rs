//! Receive hooks: the second half of a dispatch or combine, run when the caller chooses.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream};
use ep_kernels::low_latency as k;
use ibgda_device::cuda::DeviceBuffer;

use super::launch::launch;
use crate::error::EpError;
use crate::mapped::{ErrorReport, MappedHost};
use crate::residency::LaunchGate;
use crate::tensor::Tensor;

#[derive(Debug, Clone, Copy)]
pub(super) enum HookParams {
    Dispatch(k::LlDispatchParams),
    Combine(k::LlCombineParams),
}

/// The receive half of a hook-mode operation: [`call`](Self::call) queues it on the buffer's
/// stream. It keeps the memory it writes alive; call it before the buffer's next operation on
/// the same half, and before tearing the buffer down. A dispatch's handle is refused by combine
/// until its hook has been called.
#[must_use = "a dispatch or combine whose receive hook is never called receives nothing"]
pub struct RecvHook {
    pub(super) params: HookParams,
    /// Set once the receive is queued (the dispatch handle's flag; unused for combine).
    pub(super) received: Option<Arc<AtomicBool>>,
    pub(super) func: CudaFunction,
    pub(super) stream: Arc<CudaStream>,
    pub(super) grid: u32,
    pub(super) rank: usize,
    /// The launch gate of ranks sharing this GPU, and its bound (`None`: not shared).
    pub(super) gate: Option<(Arc<LaunchGate>, Duration)>,
    pub(super) _keep: Vec<Arc<DeviceBuffer>>,
    pub(super) _keep_routing: Option<(Tensor<i32>, Tensor<f32>)>,
    pub(super) _keep_stats: Option<Tensor<i64>>,
    pub(super) _mapped: Arc<MappedHost>,
    pub(super) _errors: Arc<ErrorReport>,
}

impl std::fmt::Debug for RecvHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvHook")
            .field("params", &self.params)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl RecvHook {
    /// Queues the receive on the buffer's stream (no host wait).
    pub fn call(self) -> Result<(), EpError> {
        let gate = self.gate.as_ref().map(|(g, t)| (&**g, *t));
        let queued = match &self.params {
            HookParams::Dispatch(p) => launch(
                gate,
                &self.stream,
                &self.func,
                self.grid,
                p,
                self.rank,
                "cuLaunchKernel(ep_ll_dispatch recv)",
            ),
            HookParams::Combine(p) => launch(
                gate,
                &self.stream,
                &self.func,
                self.grid,
                p,
                self.rank,
                "cuLaunchKernel(ep_ll_combine recv)",
            ),
        };
        if queued.is_ok() {
            if let Some(r) = &self.received {
                r.store(true, Ordering::Release);
            }
        }
        queued
    }
}
