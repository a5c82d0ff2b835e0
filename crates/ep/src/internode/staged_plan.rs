//! Where everything lives in a rank's registered net buffer of the staged internode path
//! ([`InternodeBuffer`](super::InternodeBuffer)); mirrored by the comment at the top of
//! `ep-kernels/cuda/internode.cu`. Offsets are equal on every rank (peers write at them).

use ep_kernels::internode::{MAX_NODES, MAX_SEGS};

/// The four signal-word arrays at the start of the buffer, each `u64 [MAX_NODES]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Words {
    /// `(seq << 32) | rows`: a node's rail peer's dispatch rows have landed.
    DispatchData = 0,
    /// A node's rail peer has consumed the previous dispatch (its receive slot is free).
    DispatchAck = 1,
    /// A node's partial sums of this rank's tokens have landed.
    CombineData = 2,
    /// A node's rail peer has reduced the previous combine.
    CombineAck = 3,
}

/// Bytes of the signal words.
pub(crate) const WORDS_BYTES: usize = 4 * MAX_NODES * 8;

/// Rounds up to 16 bytes (the granularity of every section and every put).
pub(crate) fn up16(n: usize) -> Option<usize> {
    n.checked_add(15).map(|v| v & !15)
}

/// The layout of one rank's net buffer for `nodes` nodes, slots of `cap` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StagedPlan {
    /// Rows per slot (`max_tokens_per_rank`: a rank sends a node at most all its tokens).
    pub cap: usize,
    /// Nodes.
    pub nodes: usize,
    /// In a dispatch slot: scales, ids and weights after the rows.
    pub d_scales: usize,
    pub d_idx: usize,
    pub d_w: usize,
    /// Bytes of a dispatch slot.
    pub d_slot: usize,
    /// In a combine slot: the weights after the BF16 rows.
    pub c_w: usize,
    /// Bytes of a combine slot.
    pub c_slot: usize,
    /// Where the four slot arrays start.
    pub d_recv: usize,
    pub d_stage: usize,
    pub c_recv: usize,
    pub c_stage: usize,
    /// Total bytes.
    pub bytes: usize,
}

impl StagedPlan {
    /// The plan for rows of up to `max_hidden` BF16 elements (the widest row: FP8 rows and their
    /// scales fit in the same slot), top-`max_topk`; `None` when a size overflows.
    pub(crate) fn new(
        cap: usize,
        max_hidden: usize,
        max_topk: usize,
        nodes: usize,
    ) -> Option<Self> {
        if nodes == 0 || nodes > MAX_NODES || cap == 0 {
            return None;
        }
        let rows = |row: usize| cap.checked_mul(row).and_then(up16);
        let x = rows(max_hidden.checked_mul(2)?)?;
        let scales = rows(max_hidden.div_ceil(crate::FP8_BLOCK).checked_mul(4)?)?;
        let ids = rows(max_topk.checked_mul(4)?)?;
        let d_scales = x;
        let d_idx = d_scales.checked_add(scales)?;
        let d_w = d_idx.checked_add(ids)?;
        let d_slot = d_w.checked_add(ids)?;
        let c_w = x;
        let c_slot = c_w.checked_add(ids)?;
        let d_all = d_slot.checked_mul(nodes)?;
        let c_all = c_slot.checked_mul(nodes)?;
        let d_recv = WORDS_BYTES;
        let d_stage = d_recv.checked_add(d_all)?;
        let c_recv = d_stage.checked_add(d_all)?;
        let c_stage = c_recv.checked_add(c_all)?;
        let bytes = c_stage.checked_add(c_all)?;
        Some(Self {
            cap,
            nodes,
            d_scales,
            d_idx,
            d_w,
            d_slot,
            c_w,
            c_slot,
            d_recv,
            d_stage,
            c_recv,
            c_stage,
            bytes,
        })
    }

    /// Offset of signal word `node` of array `w`.
    pub(crate) fn word(&self, w: Words, node: usize) -> usize {
        (w as usize * MAX_NODES + node) * 8
    }

    /// Offset of node `n`'s dispatch receive slot.
    pub(crate) fn d_recv_slot(&self, n: usize) -> usize {
        self.d_recv + n * self.d_slot
    }
    /// Offset of node `n`'s dispatch stage slot.
    pub(crate) fn d_stage_slot(&self, n: usize) -> usize {
        self.d_stage + n * self.d_slot
    }
    /// Offset of node `n`'s combine receive slot.
    pub(crate) fn c_recv_slot(&self, n: usize) -> usize {
        self.c_recv + n * self.c_slot
    }
    /// Offset of node `n`'s combine stage slot.
    pub(crate) fn c_stage_slot(&self, n: usize) -> usize {
        self.c_stage + n * self.c_slot
    }
}

/// One RDMA write of a put: (offset in this rank's buffer, offset in the peer's, bytes).
pub(crate) type Segment = (usize, usize, usize);

/// The host's model of every put (the device plans them, `ep_internode_plan_put`, by
/// [`PutShape`]; tests hold the two equal).
#[cfg_attr(not(test), allow(dead_code))]
impl StagedPlan {
    /// The writes that carry `rows` dispatch rows (of `row_bytes`, `scale_words` scales and
    /// `topk` ids and weights each) from this rank's stage slot for node `to` into the receive
    /// slot for node `from` at the peer: rows, scales, then ids and weights of at least one row
    /// (a node sent nothing still gets one padding row of ids -1). Every write is rounded up to
    /// 16 bytes and stays inside its section. `None` when the sizes exceed the slot.
    pub(crate) fn dispatch_segments(
        &self,
        to: usize,
        from: usize,
        rows: usize,
        row_bytes: usize,
        scale_words: usize,
        topk: usize,
    ) -> Option<[Segment; 4]> {
        if to >= self.nodes || from >= self.nodes || rows > self.cap {
            return None;
        }
        let padded = rows.max(1);
        let sections = [
            (0, self.d_scales, rows.checked_mul(row_bytes)?),
            (
                self.d_scales,
                self.d_idx,
                rows.checked_mul(scale_words)?.checked_mul(4)?,
            ),
            (
                self.d_idx,
                self.d_w,
                padded.checked_mul(topk)?.checked_mul(4)?,
            ),
            (
                self.d_w,
                self.d_slot,
                padded.checked_mul(topk)?.checked_mul(4)?,
            ),
        ];
        let (src, dst) = (self.d_stage_slot(to), self.d_recv_slot(from));
        let mut out = [(0, 0, 0); 4];
        for (o, (start, end, bytes)) in out.iter_mut().zip(sections) {
            let bytes = up16(bytes)?;
            if bytes > end - start {
                return None;
            }
            *o = (src + start, dst + start, bytes);
        }
        Some(out)
    }

    /// The writes that carry `rows` combined rows (BF16 of `hidden`, `topk` weights each) from
    /// this rank's combine stage slot for node `to` into the peer's receive slot for node
    /// `from`; as [`dispatch_segments`](Self::dispatch_segments).
    pub(crate) fn combine_segments(
        &self,
        to: usize,
        from: usize,
        rows: usize,
        hidden: usize,
        topk: usize,
    ) -> Option<[Segment; 2]> {
        if to >= self.nodes || from >= self.nodes || rows > self.cap {
            return None;
        }
        let sections = [
            (0, self.c_w, rows.checked_mul(hidden)?.checked_mul(2)?),
            (
                self.c_w,
                self.c_slot,
                rows.checked_mul(topk)?.checked_mul(4)?,
            ),
        ];
        let (src, dst) = (self.c_stage_slot(to), self.c_recv_slot(from));
        let mut out = [(0, 0, 0); 2];
        for (o, (start, end, bytes)) in out.iter_mut().zip(sections) {
            let bytes = up16(bytes)?;
            if bytes > end - start {
                return None;
            }
            *o = (src + start, dst + start, bytes);
        }
        Some(out)
    }
}

/// The shape of a put planned on the device (`ep_internode_plan_put`) from row counts the host
/// never sees: per section its start and size in a slot, its bytes per row and the rows it sends
/// at least; where node n's slot starts here and where this rank's node's slot starts at a peer.
/// [`segments`](Self::segments) is the device's rule, on the host: it must equal
/// [`StagedPlan::dispatch_segments`] / [`StagedPlan::combine_segments`] (tested).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PutShape {
    pub src_base: usize,
    pub dst_base: usize,
    pub slot_bytes: usize,
    pub sec_off: [usize; MAX_SEGS],
    pub sec_cap: [usize; MAX_SEGS],
    pub sec_row: [usize; MAX_SEGS],
    pub sec_min_rows: [usize; MAX_SEGS],
    pub cap: usize,
}

impl StagedPlan {
    /// The put of a dispatch from this rank's node `me`: rows of `row_bytes`, `scale_words`
    /// scales and `topk` ids and weights (those at least one row).
    pub(crate) fn dispatch_shape(
        &self,
        me: usize,
        row_bytes: usize,
        scale_words: usize,
        topk: usize,
    ) -> PutShape {
        PutShape {
            src_base: self.d_stage,
            dst_base: self.d_recv_slot(me),
            slot_bytes: self.d_slot,
            sec_off: [0, self.d_scales, self.d_idx, self.d_w],
            sec_cap: [
                self.d_scales,
                self.d_idx - self.d_scales,
                self.d_w - self.d_idx,
                self.d_slot - self.d_w,
            ],
            sec_row: [row_bytes, scale_words * 4, topk * 4, topk * 4],
            sec_min_rows: [0, 0, 1, 1],
            cap: self.cap,
        }
    }

    /// The put of a combine from this rank's node `me`: BF16 rows of `hidden`, `topk` weights.
    pub(crate) fn combine_shape(&self, me: usize, hidden: usize, topk: usize) -> PutShape {
        PutShape {
            src_base: self.c_stage,
            dst_base: self.c_recv_slot(me),
            slot_bytes: self.c_slot,
            sec_off: [0, self.c_w, 0, 0],
            sec_cap: [self.c_w, self.c_slot - self.c_w, 0, 0],
            sec_row: [hidden * 2, topk * 4, 0, 0],
            sec_min_rows: [0; MAX_SEGS],
            cap: self.cap,
        }
    }
}

impl PutShape {
    /// The writes to node `to` of `rows` rows, as the device computes them: rows clamped to
    /// the slot, each section's bytes rounded up to 16; a section that would not fit is not
    /// sent (`None` here; the device reports it). Unsent sections are `(0, 0, 0)`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn segments(&self, to: usize, rows: i64) -> Option<[Segment; MAX_SEGS]> {
        let rows = rows.clamp(0, self.cap as i64) as usize;
        let mut out = [(0, 0, 0); MAX_SEGS];
        for (s, o) in out.iter_mut().enumerate() {
            if self.sec_row[s] == 0 {
                continue;
            }
            let bytes = up16(rows.max(self.sec_min_rows[s]) * self.sec_row[s])?;
            if bytes > self.sec_cap[s] {
                return None;
            }
            *o = (
                self.src_base + to * self.slot_bytes + self.sec_off[s],
                self.dst_base + self.sec_off[s],
                bytes,
            );
        }
        Some(out)
    }

    /// The device plan kernel's parameters for this shape (counts, state, table and the
    /// identity fields are the caller's).
    pub(crate) fn params(&self, kind: i32) -> ep_kernels::internode::PlanParams {
        let w = |a: [usize; MAX_SEGS]| a.map(|v| v as u64);
        ep_kernels::internode::PlanParams {
            src_base: self.src_base as u64,
            dst_base: self.dst_base as u64,
            slot_bytes: self.slot_bytes as u64,
            sec_off: w(self.sec_off),
            sec_cap: w(self.sec_cap),
            sec_row: w(self.sec_row),
            sec_min_rows: self.sec_min_rows.map(|v| v as i32),
            kind,
            cap: self.cap as i32,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_aligned_disjoint_and_inside() {
        for (cap, h, k, nodes) in [
            (1, 8, 1, 2),
            (4096, 7168, 8, 2),
            (33, 136, 3, 8),
            (7, 128, 2, 4),
        ] {
            let p = StagedPlan::new(cap, h, k, nodes).unwrap();
            for off in [
                p.d_scales, p.d_idx, p.d_w, p.d_slot, p.c_w, p.c_slot, p.d_recv, p.bytes,
            ] {
                assert_eq!(off % 16, 0, "{p:?}");
            }
            // Each section holds cap rows of its widest element.
            assert!(p.d_scales >= cap * h * 2);
            assert!(p.d_idx - p.d_scales >= cap * h.div_ceil(128) * 4);
            assert!(p.d_w - p.d_idx >= cap * k * 4 && p.d_slot - p.d_w >= cap * k * 4);
            assert!(p.c_slot - p.c_w >= cap * k * 4);
            assert_eq!(p.d_stage_slot(nodes - 1) + p.d_slot, p.c_recv);
            assert_eq!(p.c_stage_slot(nodes - 1) + p.c_slot, p.bytes);
            assert!(p.word(Words::CombineAck, MAX_NODES - 1) + 8 <= p.d_recv);
            assert!(p.d_recv_slot(0) >= WORDS_BYTES);
        }
    }

    #[test]
    fn overflow_and_bad_shapes_are_none() {
        assert!(StagedPlan::new(usize::MAX / 2, 7168, 8, 2).is_none());
        assert!(StagedPlan::new(16, 7168, 8, 0).is_none());
        assert!(StagedPlan::new(16, 7168, 8, MAX_NODES + 1).is_none());
        assert!(StagedPlan::new(0, 7168, 8, 2).is_none());
    }

    #[test]
    fn rounding_to_16() {
        assert_eq!(up16(0), Some(0));
        assert_eq!(up16(1), Some(16));
        assert_eq!(up16(32), Some(32));
        assert_eq!(up16(usize::MAX), None);
    }

    #[test]
    fn segments_stay_inside_their_slots() {
        let (cap, h, k, nodes) = (33, 1024, 6, 4);
        let p = StagedPlan::new(cap, h, k, nodes).unwrap();
        for rows in [0, 1, 7, cap] {
            for (row_bytes, sw) in [(h * 2, 0), (h, h / 128), (16, 0)] {
                let segs = p.dispatch_segments(1, 2, rows, row_bytes, sw, k).unwrap();
                for (i, &(src, dst, bytes)) in segs.iter().enumerate() {
                    assert_eq!(bytes % 16, 0);
                    let (lo, hi) = [
                        (0, p.d_scales),
                        (p.d_scales, p.d_idx),
                        (p.d_idx, p.d_w),
                        (p.d_w, p.d_slot),
                    ][i];
                    assert!(
                        src >= p.d_stage_slot(1) + lo && src + bytes <= p.d_stage_slot(1) + hi,
                        "{i}"
                    );
                    assert!(
                        dst >= p.d_recv_slot(2) + lo && dst + bytes <= p.d_recv_slot(2) + hi,
                        "{i}"
                    );
                }
                // Ids of at least one row travel, so a node that sent nothing has a padding row.
                assert!(segs[2].2 >= k * 4);
            }
            let segs = p.combine_segments(3, 0, rows, h, k).unwrap();
            assert!(
                segs[0].0 >= p.c_stage_slot(3)
                    && segs[1].0 + segs[1].2 <= p.c_stage_slot(3) + p.c_slot
            );
            assert!(
                segs[0].1 >= p.c_recv_slot(0)
                    && segs[1].1 + segs[1].2 <= p.c_recv_slot(0) + p.c_slot
            );
            assert_eq!(segs[0].2, up16(rows * h * 2).unwrap());
        }
        assert!(p.dispatch_segments(0, 1, cap + 1, h * 2, 0, k).is_none());
        assert!(
            p.dispatch_segments(0, 1, cap, h * 4, 0, k).is_none(),
            "rows wider than the plan's"
        );
        assert!(p.dispatch_segments(nodes, 1, 1, 16, 0, k).is_none());
        assert!(p.combine_segments(0, nodes, 1, h, k).is_none());
        assert!(p
            .combine_segments(0, 1, 1, h, k + 1)
            .is_some_and(|s| s[1].2 <= p.c_slot - p.c_w));
    }

    /// Every write of every put, for every sender and receiver of the GPU tests' topologies and
    /// sizes (and the example's and benchmark's), lands inside the receiver's registered buffer
    /// (`bytes`, equal on every rank) in the receive slot of the sender's node, reads inside the
    /// sender's stage slot for the receiver's node, and never touches the signal words; the
    /// signal words of the four arrays are distinct for every node.
    #[test]
    fn every_put_of_the_test_topologies_stays_in_the_registered_buffers() {
        // (nodes, max tokens, max hidden, top-k, FP8)
        let shapes = [
            (96, 1024, 6, false),
            (96, 512, 6, true),
            (512, 7168, 8, false),
            (4096, 7168, 8, true),
        ];
        for (nodes, _rpn) in [(2, 1), (2, 2), (2, 4), (4, 2)] {
            for (cap, hidden, k, fp8) in shapes {
                let p = StagedPlan::new(cap, hidden, k, nodes).unwrap();
                let (row_bytes, sw) = if fp8 {
                    (hidden, hidden / 128)
                } else {
                    (hidden * 2, 0)
                };
                let inside = |off: usize, bytes: usize, lo: usize, hi: usize| {
                    off >= lo && off + bytes <= hi && off + bytes <= p.bytes && off >= WORDS_BYTES
                };
                for from in 0..nodes {
                    for to in (0..nodes).filter(|&t| t != from) {
                        for rows in [0, 1, cap / 2, cap] {
                            let d = p
                                .dispatch_segments(to, from, rows, row_bytes, sw, k)
                                .unwrap();
                            for (src, dst, bytes) in d {
                                assert!(
                                    inside(
                                        src,
                                        bytes,
                                        p.d_stage_slot(to),
                                        p.d_stage_slot(to) + p.d_slot
                                    ),
                                    "{nodes} nodes, {cap}x{hidden}: dispatch src {src}+{bytes}"
                                );
                                assert!(
                                    inside(
                                        dst,
                                        bytes,
                                        p.d_recv_slot(from),
                                        p.d_recv_slot(from) + p.d_slot
                                    ),
                                    "{nodes} nodes, {cap}x{hidden}: dispatch dst {dst}+{bytes}"
                                );
                            }
                            let c = p.combine_segments(to, from, rows, hidden, k).unwrap();
                            for (src, dst, bytes) in c {
                                assert!(inside(
                                    src,
                                    bytes,
                                    p.c_stage_slot(to),
                                    p.c_stage_slot(to) + p.c_slot
                                ));
                                assert!(inside(
                                    dst,
                                    bytes,
                                    p.c_recv_slot(from),
                                    p.c_recv_slot(from) + p.c_slot
                                ));
                            }
                        }
                    }
                }
                let mut words: Vec<usize> = [
                    Words::DispatchData,
                    Words::DispatchAck,
                    Words::CombineData,
                    Words::CombineAck,
                ]
                .into_iter()
                .flat_map(|w| (0..nodes).map(move |n| (w, n)))
                .map(|(w, n)| p.word(w, n))
                .collect();
                assert!(words.iter().all(|&o| o % 8 == 0 && o + 8 <= WORDS_BYTES));
                let all = words.len();
                words.sort_unstable();
                words.dedup();
                assert_eq!(words.len(), all);
            }
        }
    }

    /// The device's put rule ([`PutShape::segments`], what `ep_internode_plan_put` computes)
    /// equals the host's, for every row count a slot holds, both kinds, BF16 and FP8 rows.
    #[test]
    fn the_device_put_plan_equals_the_host_segments() {
        let (cap, h, k, nodes) = (33, 1024, 6, 4);
        let p = StagedPlan::new(cap, h, k, nodes).unwrap();
        for me in 0..nodes {
            for (row_bytes, sw) in [(h * 2, 0), (h, h / 128), (512, 4)] {
                let shape = p.dispatch_shape(me, row_bytes, sw, k);
                for to in (0..nodes).filter(|&t| t != me) {
                    for rows in 0..=cap {
                        let host = p.dispatch_segments(to, me, rows, row_bytes, sw, k).unwrap();
                        let dev = shape.segments(to, rows as i64).unwrap();
                        for s in 0..4 {
                            if host[s].2 == 0 {
                                assert_eq!(dev[s].2, 0, "{rows} rows, section {s}");
                            } else {
                                assert_eq!(dev[s], host[s], "{rows} rows, section {s}");
                            }
                        }
                    }
                    // Counts past the slot are clamped to it, negative ones to zero.
                    assert_eq!(
                        shape.segments(to, cap as i64 + 5),
                        shape.segments(to, cap as i64)
                    );
                    assert_eq!(shape.segments(to, -3), shape.segments(to, 0));
                }
            }
            let shape = p.combine_shape(me, h, k);
            for to in (0..nodes).filter(|&t| t != me) {
                for rows in 0..=cap {
                    let host = p.combine_segments(to, me, rows, h, k).unwrap();
                    let dev = shape.segments(to, rows as i64).unwrap();
                    assert_eq!(&dev[..2], &host[..], "{rows} rows");
                    assert_eq!(dev[2..], [(0, 0, 0); 2]);
                }
            }
        }
        // A row wider than the plan's does not fit: the device sends nothing and reports it.
        assert!(p
            .dispatch_shape(0, h * 4, 0, k)
            .segments(1, cap as i64)
            .is_none());
        let params = p
            .dispatch_shape(1, h * 2, 0, k)
            .params(ep_kernels::internode::PLAN_DISPATCH);
        assert_eq!(params.dst_base, p.d_recv_slot(1) as u64);
        assert_eq!(params.sec_min_rows, [0, 0, 1, 1]);
        assert_eq!(params.cap, cap as i32);
    }
}
