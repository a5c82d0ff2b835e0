//! A [`Communicator`] over the caller's `torch.distributed` group.

use ep::bootstrap::{BootstrapError, Communicator};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The ranks of a `torch.distributed` group (or any object all-gather), reached through two
/// Python callables the Python layer builds over it:
///
/// - `all_gather(bytes) -> list[bytes]`: every rank's bytes, indexed by rank
///   (`torch.distributed.all_gather_object` on `group`);
/// - `barrier() -> None`.
///
/// Their time bound is the group's own (`timeout=` of `init_process_group` / `new_group`). The
/// ranks are processes ([`same_process`](Communicator::same_process) is `false`), so buffers are
/// shared through CUDA IPC.
pub struct PyGroup {
    rank: usize,
    world: usize,
    local_rank: usize,
    all_gather: Py<PyAny>,
    barrier: Py<PyAny>,
}

impl PyGroup {
    /// A group where this process is `rank` of `world`, on GPU `local_rank`.
    pub fn new(
        rank: usize,
        world: usize,
        local_rank: usize,
        all_gather: Py<PyAny>,
        barrier: Py<PyAny>,
    ) -> Self {
        Self {
            rank,
            world,
            local_rank,
            all_gather,
            barrier,
        }
    }

    fn failed(&self, step: &str, e: PyErr) -> BootstrapError {
        BootstrapError::Protocol {
            rank: self.rank,
            step: step.to_string(),
            peer: "the torch.distributed group".to_string(),
            detail: Python::with_gil(|py| {
                let tb = e
                    .traceback(py)
                    .and_then(|t| t.format().ok())
                    .unwrap_or_default();
                format!("{e}{}{tb}", if tb.is_empty() { "" } else { "\n" })
            }),
        }
    }
}

impl Communicator for PyGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn same_process(&self) -> bool {
        false
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let step = "all_gather_object over the torch.distributed group";
        let all: Vec<Vec<u8>> = Python::with_gil(|py| -> PyResult<Vec<Vec<u8>>> {
            let out = self.all_gather.call1(py, (PyBytes::new(py, mine),))?;
            let list: Vec<Bound<'_, PyBytes>> = out.extract(py)?;
            Ok(list.iter().map(|b| b.as_bytes().to_vec()).collect())
        })
        .map_err(|e| self.failed(step, e))?;
        if all.len() != self.world {
            return Err(BootstrapError::Protocol {
                rank: self.rank,
                step: step.to_string(),
                peer: "the torch.distributed group".to_string(),
                detail: format!(
                    "{} entries came back, the group has {}",
                    all.len(),
                    self.world
                ),
            });
        }
        Ok(all)
    }

    fn barrier(&self) -> Result<(), BootstrapError> {
        Python::with_gil(|py| self.barrier.call0(py).map(|_| ()))
            .map_err(|e| self.failed("barrier over the torch.distributed group", e))
    }
}
