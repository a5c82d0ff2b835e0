//! The interface every kind of rank group offers.

use super::BootstrapError;

/// A rank's handle on its group: small collective exchanges among all ranks of a job.
///
/// Collectives are matched by order: every rank must call the same collectives in the same
/// sequence (a rank calling `barrier` where another calls `all_gather_bytes` is detected and
/// reported as an error on all ranks). Calls from several threads of one rank are serialized, in
/// an unspecified order. Every call returns within the group's time bound, with an error that
/// names the ranks that did not arrive when some did not; after an error the group is unusable.
pub trait Communicator: Send + Sync {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// This rank's index on its host, which picks its GPU.
    fn local_rank(&self) -> usize {
        self.rank()
    }

    /// Whether all ranks are threads of this process: then addresses (host pointers, device
    /// pointers once peer access is enabled) mean the same on every rank. When `false`, ranks
    /// may be other processes and share GPU memory only through CUDA IPC.
    fn same_process(&self) -> bool;

    /// Every rank's `mine`, indexed by rank. Ranks may contribute different lengths.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<(), BootstrapError>;

    /// `data` of rank `root`, on every rank (other ranks' `data` is ignored).
    fn broadcast_bytes(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, BootstrapError> {
        if root >= self.world_size() {
            return Err(BootstrapError::Config(format!(
                "broadcast root {root} is not below world size {}",
                self.world_size()
            )));
        }
        let mine = if self.rank() == root { data } else { &[] };
        Ok(self.all_gather_bytes(mine)?.swap_remove(root))
    }
}
