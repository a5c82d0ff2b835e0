//! Sizes and places: the receive region, window and output plans (the pools of regions handed
//! out as tensor storage are [`RegionPool`](crate::region_pool::RegionPool)s over them).

use ep_kernels::intranode as k;

use crate::config::BufferOptions;

const ALIGN: usize = 256;
pub(super) const ERROR_OFFSET: usize = 0;
pub(super) const HOST_INFO_OFFSET: usize = 64;
/// FP8 scales cover this many channels each.
pub const FP8_BLOCK: usize = 128;

/// Largest `max_hidden`: rows of up to 2 MiB of BF16, so that every byte count the kernels take
/// as `i32` (`row_bytes`, `hidden`) stays far inside its range.
pub(crate) const MAX_HIDDEN: usize = 1 << 20;
/// Largest `max_topk` (the layout kernel's duplicate check is quadratic in it).
pub(crate) const MAX_TOPK: usize = 1024;
/// Largest `max_live_outputs` (each is a receive region of the window peers map).
pub(crate) const MAX_LIVE_OUTPUTS: usize = 1024;
/// Largest `expert_alignment`: per-expert counts (at most `ranks × max_tokens_per_rank`, below
/// `i32::MAX / 8`) rounded up to it stay inside `i32` on the GPU.
pub(crate) const MAX_EXPERT_ALIGNMENT: usize = 1 << 24;

fn align_up(x: usize) -> Option<usize> {
    x.checked_next_multiple_of(ALIGN)
}

/// `a × b × …` or `None` when it does not fit a `usize`.
pub(super) fn product(factors: &[usize]) -> Option<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
}

/// Bump allocation of aligned sections with checked arithmetic.
pub(super) struct Sections {
    pub(super) at: usize,
}

impl Sections {
    pub(super) fn new(start: usize) -> Option<Self> {
        Some(Self {
            at: align_up(start)?,
        })
    }
    /// `n` bytes (`None` when the product overflowed); returns the section's offset.
    pub(super) fn take(&mut self, n: Option<usize>) -> Option<usize> {
        let here = self.at;
        self.at = align_up(here.checked_add(n?)?)?;
        Some(here)
    }
}

fn too_big(what: &str, o: &BufferOptions, ranks: usize) -> String {
    format!(
        "{what} of {ranks} ranks × max_tokens_per_rank {} × max_hidden {} × max_topk {} \
         (× max_live_outputs {}) does not fit a usize",
        o.max_tokens_per_rank, o.max_hidden, o.max_topk, o.max_live_outputs
    )
}

/// Where the sections of a receive region lie, for given options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionPlan {
    pub(crate) layout: k::RegionLayout,
    pub(crate) bytes: usize,
    /// Rows it holds: `ranks × max_tokens_per_rank`.
    pub(crate) cap: usize,
}

impl RegionPlan {
    /// The plan, or why the sizes do not fit (every product checked).
    pub(crate) fn new(o: &BufferOptions, ranks: usize) -> Result<Self, String> {
        let plan = || -> Option<Self> {
            let cap = ranks.checked_mul(o.max_tokens_per_rank)?;
            let local = o.num_experts / ranks.max(1);
            let mut s =
                Sections::new(std::mem::size_of::<k::Meta>().checked_add(local.checked_mul(4)?)?)?;
            let x = s.take(product(&[cap, o.max_hidden, 2]))?;
            let scales = s.take(product(&[cap, o.max_hidden.div_ceil(FP8_BLOCK), 4]))?;
            let topk_idx = s.take(product(&[cap, o.max_topk, 4]))?;
            let topk_weights = s.take(product(&[cap, o.max_topk, 4]))?;
            Some(Self {
                layout: k::RegionLayout {
                    x: x as u64,
                    scales: scales as u64,
                    topk_idx: topk_idx as u64,
                    topk_weights: topk_weights as u64,
                },
                bytes: s.at,
                cap,
            })
        };
        plan().ok_or_else(|| too_big("a receive region", o, ranks))
    }
}

/// Where the sections of one pooled combine output lie: `[max_tokens][max_hidden]` BF16 rows,
/// then `[max_tokens][max_topk]` f32 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutputPlan {
    /// Offset of the weights.
    pub(crate) weights: usize,
    /// Bytes of one output.
    pub(crate) bytes: usize,
    /// Bytes of the pool (`max_live_outputs` outputs).
    pub(crate) pool_bytes: usize,
}

impl OutputPlan {
    /// The plan, or why the sizes do not fit (every product checked).
    pub(crate) fn new(o: &BufferOptions) -> Result<Self, String> {
        let plan = || -> Option<Self> {
            let mut s = Sections::new(0)?;
            s.take(product(&[o.max_tokens_per_rank, o.max_hidden, 2]))?;
            let weights = s.take(product(&[o.max_tokens_per_rank, o.max_topk, 4]))?;
            Some(Self {
                weights,
                bytes: s.at,
                pool_bytes: s.at.checked_mul(o.max_live_outputs)?,
            })
        };
        plan().ok_or_else(|| too_big("the combine output pool", o, 1))
    }
}

/// Where the sections of a rank's window lie: equal on every rank (checked at creation), so
/// an offset means the same in every peer's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowPlan {
    /// Bytes of the signal region, at offset 0.
    pub(super) signal_bytes: usize,
    /// Combine staging rows: room for `ranks × max_tokens` rows of `max_hidden` BF16 (ranks as
    /// processes only: a combine input outside the window is copied here to be read by peers).
    pub(super) comb_x: usize,
    /// Combine staging weights: `ranks × max_tokens × max_topk` f32 (as `comb_x`).
    pub(super) comb_w: usize,
    /// The first receive region; the others follow every `recv_bytes`.
    pub(super) recv_at: usize,
    pub(super) recv_bytes: usize,
    recv_count: usize,
    /// Whole window.
    pub(super) bytes: usize,
}

impl WindowPlan {
    /// The plan, or why the sizes do not fit (every product and sum checked).
    pub(crate) fn new(o: &BufferOptions, ranks: usize, staging: bool) -> Result<Self, String> {
        let recv_bytes = RegionPlan::new(o, ranks)?.bytes;
        let plan = || -> Option<Self> {
            let num_local_experts = o.num_experts / ranks.max(1);
            let signal_bytes =
                align_up(std::mem::size_of::<k::SignalHead>().checked_add(product(&[
                    4,
                    ranks,
                    num_local_experts,
                ])?)?)?;
            let comb_x = signal_bytes;
            let (x_bytes, w_bytes) = if staging {
                let rows = ranks.checked_mul(o.max_tokens_per_rank)?;
                (
                    align_up(product(&[rows, o.max_hidden, 2])?)?,
                    align_up(product(&[rows, o.max_topk, 4])?)?,
                )
            } else {
                (0, 0)
            };
            let comb_w = comb_x.checked_add(x_bytes)?;
            let recv_at = comb_w.checked_add(w_bytes)?;
            let recv_count = o.max_live_outputs;
            Some(Self {
                signal_bytes,
                comb_x,
                comb_w,
                recv_at,
                recv_bytes,
                recv_count,
                bytes: recv_at.checked_add(recv_bytes.checked_mul(recv_count)?)?,
            })
        };
        plan().ok_or_else(|| too_big("the window", o, ranks))
    }

    /// Bytes of the staging section at `offset` (`comb_x` or `comb_w`; 0 without staging).
    pub(super) fn staging_bytes(&self, offset: usize) -> usize {
        if offset == self.comb_x {
            self.comb_w - self.comb_x
        } else if offset == self.comb_w {
            self.recv_at - self.comb_w
        } else {
            0
        }
    }

    /// The words every rank compares at creation: a rank whose window differs (other options,
    /// another kind of group) would read and write the wrong bytes of its peers' windows.
    pub(super) fn words(&self) -> [u64; 7] {
        [
            self.signal_bytes,
            self.comb_x,
            self.comb_w,
            self.recv_at,
            self.recv_bytes,
            self.recv_count,
            self.bytes,
        ]
        .map(|w| w as u64)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::intranode) fn opts(
        max_tokens: usize,
        hidden: usize,
        topk: usize,
        experts: usize,
    ) -> BufferOptions {
        BufferOptions::new(max_tokens, hidden, topk, experts)
    }

    #[test]
    fn plans_keep_their_sizes_for_ordinary_options() {
        let o = opts(128, 7168, 8, 64);
        let p = RegionPlan::new(&o, 4).unwrap();
        assert_eq!(p.cap, 512);
        // Meta + 16 local expert counts, then the sections, each 256-aligned.
        assert_eq!(p.layout.x, 256);
        assert_eq!(p.layout.scales, 256 + 512 * 7168 * 2);
        assert_eq!(p.layout.topk_idx, p.layout.scales + 512 * 56 * 4);
        assert_eq!(p.layout.topk_weights, p.layout.topk_idx + 512 * 8 * 4);
        assert_eq!(p.bytes, p.layout.topk_weights as usize + 512 * 8 * 4);
        let w = WindowPlan::new(&o, 4, true).unwrap();
        assert_eq!(w.recv_bytes, p.bytes);
        assert!(w.comb_x >= std::mem::size_of::<k::SignalHead>() + 4 * 4 * 16);
        assert_eq!(w.staging_bytes(w.comb_x), 512 * 7168 * 2);
        assert_eq!(w.bytes, w.recv_at + 4 * p.bytes);
        let out = OutputPlan::new(&o).unwrap();
        assert_eq!(out.weights, 128 * 7168 * 2);
        assert_eq!(out.pool_bytes, 4 * out.bytes);
        assert_eq!(o.recv_region_bytes(4), Some(p.bytes));
    }

    #[test]
    fn plans_refuse_sizes_that_would_wrap() {
        // Each product below overflows a usize: the plans must say so, not wrap (release) or
        // panic (debug).
        let huge_hidden = opts(1 << 20, (usize::MAX / 8) & !7, 8, 8);
        assert!(RegionPlan::new(&huge_hidden, 8).is_err());
        assert!(WindowPlan::new(&huge_hidden, 8, false).is_err());
        assert!(OutputPlan::new(&huge_hidden).is_err());
        assert_eq!(huge_hidden.recv_region_bytes(8), None);
        assert_eq!(huge_hidden.combine_region_bytes(8), None);
        let huge_topk = opts(1 << 20, 8, usize::MAX / 16, 8);
        assert!(RegionPlan::new(&huge_topk, 8).is_err());
        let mut many_regions = opts(1 << 20, MAX_HIDDEN, 8, 8);
        many_regions.max_live_outputs = usize::MAX / 2;
        let e = WindowPlan::new(&many_regions, 8, true).unwrap_err();
        assert!(e.contains("does not fit"), "{e}");
    }
}
