//! The byte budget of the internode rings: how big each RDMA and NVLink ring is, where each
//! slot lies, all sums and products checked.
//!
//! A channel is a contiguous range of each rank's tokens, worked by two SMs (one sends and
//! forwards, one receives), so `num_sms / 2` channels. Per channel:
//!
//! - **RDMA**: for every node, a ring of `rdma_ring_tokens` slots on the receiving side (written
//!   by the sender's NIC) and as many on the sending side (the registered memory a chunk is
//!   posted from, so the sender may pack the next chunk while the NIC still reads this one:
//!   a slot of the send ring is rewritten only after quiet says the NIC is done with it). A
//!   chunk of `rdma_chunk_tokens` never wraps (the ring is a multiple of it), so one chunk is one
//!   contiguous write. Each ring has a tail (advanced by the sender, written after the data on
//!   the same QP) and a head (returned by the receiver), both monotonic u64 counters.
//! - **NVLink**: for every rank of the node, a ring of `nvl_ring_tokens` slots in the receiver's
//!   memory, with its u64 head and tail.
//!
//! One slot holds one dispatched token: its BF16 row (an FP8 row and its scales are smaller),
//! FP8 scales, top-k ids and weights, and 16 bytes of source metadata. Combine sends a BF16 row
//! and top-k weights per token, which fit the same slot, so the rings serve both directions.

use crate::config::BufferOptions;
use crate::intranode::FP8_BLOCK;

use super::Topology;

/// Alignment of every slot, section and ring: 16-byte vector loads and stores.
pub const SLOT_ALIGN: usize = 16;

/// Bytes of a slot's source metadata: the source rank, its token index, and the bit mask of
/// the node's ranks the forwarder hands it to (four u32 words).
pub const SLOT_META_BYTES: usize = 16;

/// Bytes of one ring counter (head or tail): a monotonic u64, never reset, so a reader compares
/// without wrap-around.
pub const COUNTER_BYTES: usize = 8;

/// Per-launch tuning of the internode rings (DeepEP's `Config` for normal mode).
///
/// ```
/// use ep::internode::plan::RingConfig;
/// let c = RingConfig::default();
/// assert_eq!(c.channels().unwrap(), 12);
/// c.validate().unwrap();
/// assert!(RingConfig { rdma_chunk_tokens: 24, ..c }.validate().is_err()); // 128 % 24 != 0
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// SMs per rank, even: two per channel.
    pub num_sms: u32,
    /// Tokens a forwarder moves per NVLink step, `1..=nvl_ring_tokens`.
    pub nvl_chunk_tokens: u32,
    /// Slots of each NVLink ring.
    pub nvl_ring_tokens: u32,
    /// Tokens per RDMA write, `1..=rdma_ring_tokens`, dividing it.
    pub rdma_chunk_tokens: u32,
    /// Slots of each RDMA ring.
    pub rdma_ring_tokens: u32,
}

impl Default for RingConfig {
    /// 24 SMs (the issue's budget), NVLink 16 of 256, RDMA 16 of 128: DeepEP's EP16 settings
    /// rounded so a chunk divides its ring.
    fn default() -> Self {
        Self {
            num_sms: 24,
            nvl_chunk_tokens: 16,
            nvl_ring_tokens: 256,
            rdma_chunk_tokens: 16,
            rdma_ring_tokens: 128,
        }
    }
}

/// Why a ring configuration, or the plan for it, cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A tuning field is out of range.
    #[error("ring config: {field} = {value}: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u32,
        /// What should hold.
        reason: String,
    },
    /// The sizes do not fit a `usize` (or a slot index an `i32`).
    #[error(
        "{what} does not fit: max_hidden {max_hidden}, max_topk {max_topk}, {nodes} nodes × \
         {ranks_per_node} ranks, {channels} channels"
    )]
    TooBig {
        /// Which sum or product overflowed.
        what: &'static str,
        /// Options' hidden size.
        max_hidden: usize,
        /// Options' top-k.
        max_topk: usize,
        /// Nodes.
        nodes: usize,
        /// Ranks per node.
        ranks_per_node: usize,
        /// Channels.
        channels: usize,
    },
}

impl RingConfig {
    /// Channels: `num_sms / 2`.
    pub fn channels(&self) -> Result<usize, PlanError> {
        self.validate()?;
        Ok(self.num_sms as usize / 2)
    }

    /// Checks every field: an even, non-zero SM count; chunks in `1..=ring`; an RDMA ring that
    /// is a multiple of its chunk.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |field, value, reason: &str| {
            Err(PlanError::Config {
                field,
                value,
                reason: reason.into(),
            })
        };
        if self.num_sms == 0 || self.num_sms % 2 != 0 {
            return bad(
                "num_sms",
                self.num_sms,
                "must be even and non-zero (two SMs per channel)",
            );
        }
        for (field, chunk, ring_field, ring) in [
            (
                "nvl_chunk_tokens",
                self.nvl_chunk_tokens,
                "nvl_ring_tokens",
                self.nvl_ring_tokens,
            ),
            (
                "rdma_chunk_tokens",
                self.rdma_chunk_tokens,
                "rdma_ring_tokens",
                self.rdma_ring_tokens,
            ),
        ] {
            if ring == 0 {
                return bad(ring_field, ring, "a ring needs at least one slot");
            }
            if !(1..=ring).contains(&chunk) {
                return bad(field, chunk, &format!("must be in 1..={ring_field}={ring}"));
            }
        }
        if self.rdma_ring_tokens % self.rdma_chunk_tokens != 0 {
            return bad(
                "rdma_ring_tokens",
                self.rdma_ring_tokens,
                &format!(
                    "must be a multiple of rdma_chunk_tokens={} (a chunk is one contiguous \
                     write, never wrapping the ring)",
                    self.rdma_chunk_tokens
                ),
            );
        }
        Ok(())
    }
}

/// Where the parts of one slot lie, from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLayout {
    /// The row: `max_hidden` BF16 (or FP8 in its first half).
    pub x: usize,
    /// `ceil(max_hidden / 128)` f32 FP8 scales.
    pub scales: usize,
    /// `max_topk` i32 expert ids.
    pub topk_idx: usize,
    /// `max_topk` f32 weights.
    pub topk_weights: usize,
    /// [`SLOT_META_BYTES`] of source metadata.
    pub meta: usize,
    /// Bytes of a slot, a multiple of [`SLOT_ALIGN`].
    pub bytes: usize,
}

/// The byte budget of one rank's internode buffers.
///
/// ```
/// use ep::internode::plan::{RingConfig, RingPlan};
/// use ep::internode::Topology;
/// use ep::BufferOptions;
///
/// // DeepEP's benchmark shape: hidden 7168, top-8, on 2 nodes × 8 ranks.
/// let o = BufferOptions::new(4096, 7168, 8, 256);
/// let p = RingPlan::new(&o, &Topology::new(2, 8).unwrap(), &RingConfig::default()).unwrap();
/// assert_eq!(p.slot.bytes, 14336 + 224 + 32 + 32 + 16);
/// // 12 channels × 2 nodes × 128 slots, received and sent, plus counters.
/// assert_eq!(p.rdma_bytes, 2 * 12 * 2 * 128 * p.slot.bytes + 12 * 2 * 2 * 8);
/// assert_eq!(p.nvl_bytes, 12 * 8 * 256 * p.slot.bytes + 12 * 8 * 2 * 8);
/// assert_eq!(p.rdma_recv_slot(11, 1, 127).unwrap() + p.slot.bytes, p.rdma_send);
/// assert!(p.rdma_recv_slot(12, 0, 0).is_none());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPlan {
    /// The slot.
    pub slot: SlotLayout,
    /// Channels.
    pub channels: usize,
    /// Nodes: RDMA rings per channel.
    pub nodes: usize,
    /// Ranks per node: NVLink rings per channel.
    pub ranks_per_node: usize,
    /// The configuration planned for.
    pub config: RingConfig,
    /// Offset of the RDMA receive rings (`[channel][node][slot]`) in the RDMA region: 0.
    pub rdma_recv: usize,
    /// Offset of the RDMA send rings (`[channel][node][slot]`).
    pub rdma_send: usize,
    /// Offset of the RDMA counters (`[channel][node]{tail, head}`).
    pub rdma_counters: usize,
    /// Bytes of the RDMA region (registered with the NIC, the same on every rank).
    pub rdma_bytes: usize,
    /// Offset of the NVLink rings (`[channel][source local rank][slot]`) in the NVLink region: 0.
    pub nvl_rings: usize,
    /// Offset of the NVLink counters (`[channel][source local rank]{tail, head}`).
    pub nvl_counters: usize,
    /// Bytes of the NVLink region (mapped by the node's peers).
    pub nvl_bytes: usize,
}

impl RingPlan {
    /// The plan for buffers holding `o.max_hidden` and `o.max_topk` on `topo` with `cfg`.
    pub fn new(o: &BufferOptions, topo: &Topology, cfg: &RingConfig) -> Result<Self, PlanError> {
        let channels = cfg.channels()?;
        let (nodes, rpn) = (topo.nodes(), topo.ranks_per_node());
        let too_big = |what| PlanError::TooBig {
            what,
            max_hidden: o.max_hidden,
            max_topk: o.max_topk,
            nodes,
            ranks_per_node: rpn,
            channels,
        };
        let slot = slot_layout(o).ok_or(too_big("a slot"))?;
        let ring = |peers: usize, tokens: u32| -> Option<(usize, usize)> {
            let slots = product(&[channels, peers, tokens as usize])?;
            // Slot indices travel as i32 in the kernels.
            (slots <= i32::MAX as usize).then_some(())?;
            Some((slots, slots.checked_mul(slot.bytes)?))
        };
        let (_, rdma_ring_bytes) =
            ring(nodes, cfg.rdma_ring_tokens).ok_or(too_big("the RDMA rings"))?;
        let (_, nvl_ring_bytes) =
            ring(rpn, cfg.nvl_ring_tokens).ok_or(too_big("the NVLink rings"))?;
        let counters = |peers: usize| product(&[channels, peers, 2, COUNTER_BYTES]);
        let rdma = || -> Option<(usize, usize, usize)> {
            let send = align(rdma_ring_bytes)?;
            let counters_at = align(send.checked_add(rdma_ring_bytes)?)?;
            Some((
                send,
                counters_at,
                counters_at.checked_add(counters(nodes)?)?,
            ))
        };
        let (rdma_send, rdma_counters, rdma_bytes) = rdma().ok_or(too_big("the RDMA region"))?;
        let nvl = || -> Option<(usize, usize)> {
            let at = align(nvl_ring_bytes)?;
            Some((at, at.checked_add(counters(rpn)?)?))
        };
        let (nvl_counters, nvl_bytes) = nvl().ok_or(too_big("the NVLink region"))?;
        Ok(Self {
            slot,
            channels,
            nodes,
            ranks_per_node: rpn,
            config: *cfg,
            rdma_recv: 0,
            rdma_send,
            rdma_counters,
            rdma_bytes,
            nvl_rings: 0,
            nvl_counters,
            nvl_bytes,
        })
    }

    /// Offset of `slot` of the RDMA receive ring that `node` writes on `channel`; `None` out of
    /// range.
    pub fn rdma_recv_slot(&self, channel: usize, node: usize, slot: usize) -> Option<usize> {
        self.slot_at(
            self.rdma_recv,
            channel,
            node,
            self.nodes,
            slot,
            self.config.rdma_ring_tokens,
        )
    }

    /// Offset of `slot` of the RDMA send ring toward `node` on `channel`.
    pub fn rdma_send_slot(&self, channel: usize, node: usize, slot: usize) -> Option<usize> {
        self.slot_at(
            self.rdma_send,
            channel,
            node,
            self.nodes,
            slot,
            self.config.rdma_ring_tokens,
        )
    }

    /// Offset of `slot` of the NVLink ring that local rank `from` writes on `channel`.
    pub fn nvl_slot(&self, channel: usize, from: usize, slot: usize) -> Option<usize> {
        self.slot_at(
            self.nvl_rings,
            channel,
            from,
            self.ranks_per_node,
            slot,
            self.config.nvl_ring_tokens,
        )
    }

    fn slot_at(
        &self,
        base: usize,
        channel: usize,
        peer: usize,
        peers: usize,
        slot: usize,
        ring: u32,
    ) -> Option<usize> {
        let ring = ring as usize;
        if channel >= self.channels || peer >= peers || slot >= ring {
            return None;
        }
        // Checked although `new` bounded the totals: the fields are public.
        let index = channel
            .checked_mul(peers)?
            .checked_add(peer)?
            .checked_mul(ring)?
            .checked_add(slot)?;
        base.checked_add(index.checked_mul(self.slot.bytes)?)
    }
}

fn slot_layout(o: &BufferOptions) -> Option<SlotLayout> {
    let mut at = 0usize;
    let mut take = |bytes: usize| -> Option<usize> {
        let here = at;
        at = align(at.checked_add(bytes)?)?;
        Some(here)
    };
    let x = take(o.max_hidden.checked_mul(2)?)?;
    let scales = take(o.max_hidden.div_ceil(FP8_BLOCK).checked_mul(4)?)?;
    let topk_idx = take(o.max_topk.checked_mul(4)?)?;
    let topk_weights = take(o.max_topk.checked_mul(4)?)?;
    let meta = take(SLOT_META_BYTES)?;
    Some(SlotLayout {
        x,
        scales,
        topk_idx,
        topk_weights,
        meta,
        bytes: at,
    })
}

fn align(x: usize) -> Option<usize> {
    x.checked_next_multiple_of(SLOT_ALIGN)
}

fn product(factors: &[usize]) -> Option<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(hidden: usize, topk: usize) -> BufferOptions {
        BufferOptions::new(4096, hidden, topk, 64)
    }

    #[test]
    fn config_errors_name_the_field() {
        let ok = RingConfig::default();
        let cases: &[(RingConfig, &str)] = &[
            (RingConfig { num_sms: 0, ..ok }, "num_sms = 0"),
            (RingConfig { num_sms: 23, ..ok }, "num_sms = 23"),
            (
                RingConfig {
                    nvl_chunk_tokens: 0,
                    ..ok
                },
                "nvl_chunk_tokens = 0: must be in 1..=nvl_ring_tokens=256",
            ),
            (
                RingConfig {
                    nvl_chunk_tokens: 257,
                    ..ok
                },
                "nvl_chunk_tokens = 257",
            ),
            (
                RingConfig {
                    nvl_ring_tokens: 0,
                    ..ok
                },
                "nvl_ring_tokens = 0",
            ),
            (
                RingConfig {
                    rdma_ring_tokens: 0,
                    ..ok
                },
                "rdma_ring_tokens = 0",
            ),
            (
                RingConfig {
                    rdma_chunk_tokens: 129,
                    ..ok
                },
                "rdma_chunk_tokens = 129",
            ),
            (
                RingConfig {
                    rdma_ring_tokens: 120,
                    ..ok
                },
                "rdma_ring_tokens = 120: must be a multiple of rdma_chunk_tokens=16",
            ),
        ];
        for (cfg, needle) in cases {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{cfg:?}: {e}");
            let plan = RingPlan::new(&opts(16, 1), &Topology::new(2, 2).unwrap(), cfg);
            assert_eq!(plan.unwrap_err().to_string(), e);
        }
        // An NVLink ring need not be a multiple of its chunk (DeepEP's 6 of 256).
        RingConfig {
            nvl_chunk_tokens: 6,
            ..ok
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn slots_are_aligned_and_disjoint() {
        for (hidden, topk) in [(1, 1), (7, 3), (128, 8), (7168, 8), (4096, 9), (0, 0)] {
            let s = slot_layout(&opts(hidden, topk)).unwrap();
            let parts = [
                (s.x, hidden * 2),
                (s.scales, hidden.div_ceil(FP8_BLOCK) * 4),
                (s.topk_idx, topk * 4),
                (s.topk_weights, topk * 4),
                (s.meta, SLOT_META_BYTES),
            ];
            for w in parts.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{hidden}/{topk}: {s:?}");
            }
            let (last, len) = parts[4];
            assert!(last + len <= s.bytes);
            for (at, _) in parts {
                assert_eq!(at % SLOT_ALIGN, 0);
            }
            assert_eq!(s.bytes % SLOT_ALIGN, 0);
            // A combine token (BF16 row and f32 weights) fits a slot.
            assert!(hidden * 2 + topk * 4 <= s.bytes);
        }
    }

    #[test]
    fn every_slot_lies_inside_its_region_and_none_overlap() {
        let cfg = RingConfig {
            num_sms: 4,
            nvl_chunk_tokens: 2,
            nvl_ring_tokens: 6,
            rdma_chunk_tokens: 2,
            rdma_ring_tokens: 4,
        };
        for (n, r) in [(2, 1), (2, 2), (2, 4), (4, 2), (1, 8)] {
            let topo = Topology::new(n, r).unwrap();
            let p = RingPlan::new(&opts(100, 3), &topo, &cfg).unwrap();
            let mut rdma = Vec::new();
            let mut nvl = Vec::new();
            for c in 0..p.channels {
                for node in 0..n {
                    for s in 0..cfg.rdma_ring_tokens as usize {
                        rdma.push(p.rdma_recv_slot(c, node, s).unwrap());
                        rdma.push(p.rdma_send_slot(c, node, s).unwrap());
                    }
                    assert!(p
                        .rdma_recv_slot(c, node, cfg.rdma_ring_tokens as usize)
                        .is_none());
                }
                assert!(p.rdma_send_slot(c, n, 0).is_none());
                for l in 0..r {
                    for s in 0..cfg.nvl_ring_tokens as usize {
                        nvl.push(p.nvl_slot(c, l, s).unwrap());
                    }
                }
                assert!(p.nvl_slot(c, r, 0).is_none());
            }
            assert!(p.nvl_slot(p.channels, 0, 0).is_none());
            for (offsets, end) in [(&mut rdma, p.rdma_counters), (&mut nvl, p.nvl_counters)] {
                offsets.sort_unstable();
                for w in offsets.windows(2) {
                    assert!(w[0] + p.slot.bytes <= w[1], "{n}x{r}: overlap");
                }
                assert!(offsets.last().unwrap() + p.slot.bytes <= end);
            }
            assert_eq!(
                p.rdma_bytes - p.rdma_counters,
                p.channels * n * 2 * COUNTER_BYTES
            );
            assert_eq!(
                p.nvl_bytes - p.nvl_counters,
                p.channels * r * 2 * COUNTER_BYTES
            );
            assert_eq!(p.rdma_counters % SLOT_ALIGN, 0);
        }
    }

    #[test]
    fn sizes_that_overflow_are_errors_not_panics() {
        let topo = Topology::new(8, 8).unwrap();
        let cfg = RingConfig {
            num_sms: u32::MAX - 1,
            nvl_chunk_tokens: 1,
            nvl_ring_tokens: u32::MAX,
            rdma_chunk_tokens: 1,
            rdma_ring_tokens: u32::MAX,
        };
        for (o, c, what) in [
            (opts(usize::MAX, 8), RingConfig::default(), "a slot"),
            (opts(8, usize::MAX / 2), RingConfig::default(), "a slot"),
            (opts(7168, 8), cfg, "the RDMA rings"),
            (
                opts(usize::MAX / 64, 0),
                RingConfig {
                    rdma_ring_tokens: 1 << 20,
                    ..RingConfig::default()
                },
                "the RDMA rings",
            ),
        ] {
            let e = RingPlan::new(&o, &topo, &c).unwrap_err().to_string();
            assert!(e.contains(what) && e.contains("does not fit"), "{e}");
        }
    }
}
