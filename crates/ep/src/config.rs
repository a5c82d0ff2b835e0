//! Sizes a [`Buffer`](crate::Buffer) is built for, and per-launch tuning.

use std::time::Duration;

/// What a [`Buffer`](crate::Buffer) must hold; fixed at creation. Arguments beyond these limits
/// are rejected before any launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferOptions {
    /// Most tokens one rank sends in one dispatch.
    pub max_tokens_per_rank: usize,
    /// Largest hidden size (elements per token).
    pub max_hidden: usize,
    /// Largest top-k width.
    pub max_topk: usize,
    /// Experts over all ranks (a multiple of the rank count).
    pub num_experts: usize,
    /// How many dispatch outputs (with their handles) and combine outputs may be alive at once
    /// per kind; each holds one pooled region. Every region is allocated when the buffer is
    /// built (the receive regions are part of the memory peers map once, at creation).
    pub max_live_outputs: usize,
    /// Bound of every wait, on the GPU and on the host.
    pub timeout: Duration,
    /// Fill each output region with the byte 0xAB before use (tests: unwritten rows show).
    pub poison_outputs: bool,
}

impl BufferOptions {
    /// Options for `max_tokens_per_rank` tokens of `max_hidden` elements, top-`max_topk` of
    /// `num_experts` experts; 4 live outputs, a 10 s time bound, no poisoning.
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
            max_live_outputs: 4,
            timeout: Duration::from_secs(10),
            poison_outputs: false,
        }
    }

    /// Bytes of one receive region for `ranks` ranks (GPU memory per live dispatch output; a
    /// buffer holds `max_live_outputs` of them); `None` when the sizes overflow a `usize`.
    pub fn recv_region_bytes(&self, ranks: usize) -> Option<usize> {
        crate::intranode::RegionPlan::new(self, ranks)
            .ok()
            .map(|p| p.bytes)
    }

    /// Bytes of the combine staging region (GPU memory, once per buffer, for ranks as
    /// processes; ranks as threads combine without it); `None` when the sizes overflow a
    /// `usize`.
    pub fn combine_region_bytes(&self, ranks: usize) -> Option<usize> {
        let row = self
            .max_hidden
            .checked_mul(2)?
            .checked_add(self.max_topk.checked_mul(4)?)?;
        ranks
            .checked_mul(self.max_tokens_per_rank)?
            .checked_mul(row)
    }
}

/// Per-launch tuning of the intranode kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// SMs (thread blocks) the push and reduce kernels use.
    pub num_sms: u32,
    /// Threads per block (a multiple of 32, at most 1024): each warp moves one token at a time.
    pub block_threads: u32,
}

impl Config {
    /// Tuned defaults for `ranks` ranks (measured on H200, see bench/results).
    pub fn default_for(ranks: usize) -> Self {
        let _ = ranks;
        Self {
            num_sms: 24,
            block_threads: 1024,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self::default_for(8)
    }
}
