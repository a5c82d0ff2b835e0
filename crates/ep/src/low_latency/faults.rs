//! Fault injection into a low-latency buffer's transport (tests): the emulated NIC's
//! [`FaultPlan`] applied to this rank's NIC, with the QP numbers a plan names.

use ibgda_emu::FaultPlan;

use super::setup::LowLatencyBuffer;
use crate::error::{invalid, EpError};

/// This rank's QPs in transport mode: `to[r]` are the QP numbers of its QPs to rank `r` (empty
/// for itself), in the order the kernels pick them (`key % len`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlTransportQps {
    /// This rank.
    pub rank: usize,
    /// Per rank, this rank's QP numbers to it.
    pub to: Vec<Vec<u32>>,
}

impl LowLatencyBuffer {
    /// This rank's QPs on the emulated NIC, or `None` when the data moves by NVLink.
    pub fn transport_qps(&self) -> Option<LlTransportQps> {
        self.emulated_qps().map(|(_, to)| LlTransportQps {
            rank: self.rank(),
            to,
        })
    }

    /// Replaces the fault plan of this rank's emulated NIC (it applies from the NIC's next
    /// round): error CQEs, delayed completions, dropped doorbells, lost CQEs, the NIC dying after
    /// n WQEs ([`FaultPlan::die_after_wqes`], peer death). With ranks as threads each rank has
    /// its own NIC, so a plan here touches only the WQEs this rank posts; ranks as processes
    /// share one NIC per process. `Err` when the data moves by NVLink (there is no NIC).
    pub fn set_fault_plan(&self, plan: FaultPlan) -> Result<(), EpError> {
        let Some((nic, _)) = self.emulated_qps() else {
            return Err(invalid(
                self.rank(),
                "a fault plan needs the transport (allow_nvlink = false): NVLink has no NIC",
            ));
        };
        nic.set_fault_plan(plan);
        Ok(())
    }
}
