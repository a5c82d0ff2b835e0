//! What a low-latency buffer is built for: its options and their bounds.

use std::time::Duration;

use ep_kernels::low_latency as k;
use ibgda_device::protocol::HandlerChoice;

use super::plan::{Dims, NetPlan, OutPlan};
#[cfg(doc)]
use super::setup::LowLatencyBuffer;
use crate::error::{invalid, EpError};
use crate::transport::{NicChoice, RingPlacement};

/// Most experts a buffer holds: with the other bounds of [`check_options`] (tokens, hidden) every
/// region size stays far inside a `u64` and every row index inside the kernels' `i32`/`i64`.
const MAX_EXPERTS: usize = 1 << 14;

/// What a [`LowLatencyBuffer`] must hold; fixed at creation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowLatencyOptions {
    /// Most tokens one rank dispatches at once (DeepEP's `num_max_dispatch_tokens_per_rank`).
    pub max_tokens_per_rank: usize,
    /// Largest hidden size: a multiple of 8, at most 8192.
    pub max_hidden: usize,
    /// Largest top-k width, at most 16.
    pub max_topk: usize,
    /// Experts over all ranks (a multiple of the rank count).
    pub num_experts: usize,
    /// Move data by NVLink stores between ranks whose GPUs can map each other. `false` sends every
    /// byte to another rank through the IBGDA transport (RDMA writes and remote adds on the
    /// emulated NIC, QPs to every peer, in the [`nic_handler`](Self::nic_handler) mode), with the
    /// ranks as threads ([`LowLatencyBuffer::create_group`]: one NIC per rank in one fabric) or
    /// as processes ([`LowLatencyBuffer::new`] over a
    /// [`TcpCommunicator`](crate::bootstrap::TcpCommunicator): one NIC per process, the peers'
    /// net buffers opened through CUDA IPC by the NIC, not the kernels). Threads of one process
    /// calling [`LowLatencyBuffer::new`] need `true`.
    pub allow_nvlink: bool,
    /// Who rings the NIC's doorbells when NVLink is disabled: `Gpu`, `CpuHostMemory`, `Cpu`
    /// (producer slots in GPU memory, read through GDRCopy, or on the emulated NIC without it
    /// through the emulated GDR view; a real NIC without GDRCopy fails cleanly) or `Auto`.
    pub nic_handler: HandlerChoice,
    /// Which NIC carries the transport when NVLink is disabled (`Auto`: a real mlx5 device when
    /// one is usable, else the emulated NIC; `EP_NIC` overrides).
    pub nic: NicChoice,
    /// Bound of every wait, on the GPU and on the host.
    pub timeout: Duration,
    /// Fill each output region with the byte 0xAB before every operation (tests).
    pub poison_outputs: bool,
    /// Rank masks (DeepEP's `enable_shrink`): ranks can be left out of the operations
    /// ([`LowLatencyBuffer::update_mask`]), and a receive wait that runs out of time masks the
    /// rank it waited for instead of failing the operation ([`LowLatencyBuffer::query_mask`]
    /// says who). Without it a timeout is an error.
    pub enable_shrink: bool,
    /// Where the emulated NIC's send rings and CQs live when the transport builds QPs directly
    /// (`EP_NIC=emulated`): pinned host memory (the default, the fastest for the emulator) or
    /// GPU memory, as on real hardware and as the verbs path always places them.
    pub emulated_rings: RingPlacement,
}

impl LowLatencyOptions {
    /// Options for `max_tokens_per_rank` tokens of up to `max_hidden` channels, top-`max_topk`
    /// of `num_experts`; NVLink allowed, a 10 s bound, no poisoning.
    ///
    /// ```
    /// let o = ep::low_latency::LowLatencyOptions::new(128, 7168, 8, 288);
    /// assert!(o.allow_nvlink);
    /// ```
    pub fn new(
        max_tokens_per_rank: usize,
        max_hidden: usize,
        max_topk: usize,
        num_experts: usize,
    ) -> Self {
        Self {
            max_tokens_per_rank,
            max_hidden,
            max_topk,
            num_experts,
            allow_nvlink: true,
            nic_handler: HandlerChoice::Auto,
            nic: NicChoice::Auto,
            emulated_rings: RingPlacement::HostPinned,
            timeout: Duration::from_secs(10),
            poison_outputs: false,
            enable_shrink: false,
        }
    }

    /// Bytes of GPU memory a buffer of `ranks` ranks takes on each rank; `None` for options a
    /// buffer would refuse (their sizes are only computed once the options are in range, where
    /// none of them can overflow).
    ///
    /// ```
    /// let o = ep::low_latency::LowLatencyOptions::new(128, 7168, 8, 288);
    /// assert!(o.bytes_per_rank(4).is_some());
    /// assert!(ep::low_latency::LowLatencyOptions::new(128, 1 << 40, 8, 288)
    ///     .bytes_per_rank(4)
    ///     .is_none());
    /// ```
    pub fn bytes_per_rank(&self, ranks: usize) -> Option<usize> {
        check_options(0, ranks, self).ok()?;
        let d = self.dims(ranks);
        Some(
            NetPlan::new(&d).bytes
                + 2 * OutPlan::new(&d).bytes
                + 2 * self.max_tokens_per_rank * self.max_hidden * 2,
        )
    }

    pub(super) fn dims(&self, ranks: usize) -> Dims {
        Dims {
            ranks,
            max_tokens: self.max_tokens_per_rank,
            max_hidden: self.max_hidden,
            num_experts: self.num_experts,
        }
    }
}

pub(crate) fn check_options(
    rank: usize,
    ranks: usize,
    o: &LowLatencyOptions,
) -> Result<(), EpError> {
    let bad = |what: String| Err(invalid(rank, what));
    if ranks == 0 || ranks > k::MAX_RANKS {
        return bad(format!(
            "{ranks} ranks: the low-latency buffer supports 1..={}",
            k::MAX_RANKS
        ));
    }
    if o.num_experts == 0 || o.num_experts % ranks != 0 || o.num_experts > MAX_EXPERTS {
        return bad(format!(
            "num_experts {} is not a positive multiple of {ranks} ranks in 1..={MAX_EXPERTS}",
            o.num_experts
        ));
    }
    if o.max_tokens_per_rank == 0
        || o.max_tokens_per_rank
            .checked_mul(ranks)
            .is_none_or(|rows| rows > i32::MAX as usize / 64)
    {
        return bad(format!(
            "max_tokens_per_rank {} out of range",
            o.max_tokens_per_rank
        ));
    }
    if o.max_hidden == 0 || o.max_hidden % 8 != 0 || o.max_hidden > k::MAX_HIDDEN {
        return bad(format!(
            "max_hidden {}: expected a multiple of 8 in 8..={}",
            o.max_hidden,
            k::MAX_HIDDEN
        ));
    }
    if o.max_topk == 0 || o.max_topk > k::MAX_TOPK {
        return bad(format!(
            "max_topk {}: expected 1..={}",
            o.max_topk,
            k::MAX_TOPK
        ));
    }
    if let Err(e) = ibgda_device::timeout::check(o.timeout) {
        return bad(format!("timeout: {e}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_counts_are_bounded() {
        let ok = LowLatencyOptions::new(128, 7168, 8, 288);
        assert!(check_options(0, 4, &ok).is_ok());
        let many = LowLatencyOptions::new(128, 7168, 8, 1 << 40);
        assert!(matches!(
            check_options(0, 8, &many),
            Err(EpError::InvalidArgument { .. })
        ));
        // A token count whose product with the ranks overflows is refused, not a panic.
        let huge = LowLatencyOptions::new(usize::MAX / 2, 7168, 8, 288);
        assert!(check_options(0, 4, &huge).is_err());
        assert_eq!(huge.bytes_per_rank(4), None);
    }
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    #[test]
    fn low_latency_timeouts_are_validated() {
        let ok = LowLatencyOptions::new(128, 7168, 8, 288);
        check_options(0, 2, &ok).unwrap();
        for bad in [Duration::ZERO, Duration::MAX, Duration::from_secs(86_401)] {
            let o = LowLatencyOptions {
                timeout: bad,
                ..ok.clone()
            };
            let e = check_options(0, 2, &o).unwrap_err();
            assert!(e.to_string().contains("timeout"), "{bad:?}: {e}");
        }
    }
}
