//! Fixed slots of one device allocation handed out as tensor storage, reused once nothing
//! refers to them: the intranode receive and combine-output pools and the internode
//! `num_worst_tokens` pools.

use std::sync::Arc;

use ibgda_device::cuda::DeviceBuffer;

use crate::error::EpError;
use crate::tensor::Region;

/// Regions handed out as tensor storage: `n` slots of `bytes` each of one allocation, made at
/// creation (the intranode receive regions are part of the window peers map), a slot free again
/// once no tensor or handle holds it.
#[derive(Debug)]
pub(crate) struct RegionPool {
    what: &'static str,
    slots: Vec<Arc<Region>>,
}

impl RegionPool {
    /// `n` slots of `bytes` each, from byte `at` of `buf`; `what` names them in errors.
    pub(crate) fn new(
        what: &'static str,
        buf: &Arc<DeviceBuffer>,
        at: usize,
        bytes: usize,
        n: usize,
    ) -> Self {
        Self {
            what,
            slots: (0..n)
                .map(|i| Arc::new(Region::part(buf, at + i * bytes, bytes)))
                .collect(),
        }
    }

    /// A slot no tensor or handle holds, or [`EpError::RegionsInUse`] when all are held.
    pub(crate) fn acquire(&self, rank: usize) -> Result<Arc<Region>, EpError> {
        self.slots
            .iter()
            .find(|r| Arc::strong_count(r) == 1)
            .cloned()
            .ok_or(EpError::RegionsInUse {
                rank,
                what: self.what,
                limit: self.slots.len(),
            })
    }

    /// Every slot, in address order.
    pub(crate) fn slots(&self) -> &[Arc<Region>] {
        &self.slots
    }
}
