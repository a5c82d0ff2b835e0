//! The CPU definition of layout, dispatch and combine: what the GPU paths must reproduce (bit for
//! bit for layout and dispatch; within f32-accumulation rounding for combine).

use crate::dtype::Bf16;

/// One rank's dispatch inputs on the host. Rows are opaque bytes (BF16 or FP8).
#[derive(Debug, Clone, Default)]
pub struct RankInput {
    /// Tokens.
    pub tokens: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// `[tokens][row_bytes]`.
    pub x: Vec<u8>,
    /// f32 scales per row (0 for BF16).
    pub scale_words: usize,
    /// `[tokens][scale_words]`.
    pub scales: Vec<f32>,
    /// Top-k width.
    pub topk: usize,
    /// Global expert ids `[tokens][topk]`, -1 for none.
    pub topk_idx: Vec<i32>,
    /// Weights `[tokens][topk]`.
    pub weights: Vec<f32>,
}

/// The outputs of `get_dispatch_layout` for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// `[ranks]`.
    pub tokens_per_rank: Vec<i32>,
    /// `[experts]`.
    pub tokens_per_expert: Vec<i32>,
    /// `[tokens][ranks]`, 0/1.
    pub is_token_in_rank: Vec<u8>,
}

/// The layout of top-k ids `[tokens][topk]`.
pub fn layout(topk_idx: &[i32], topk: usize, ranks: usize, num_experts: usize) -> Layout {
    let tokens = topk_idx.len().checked_div(topk).unwrap_or(0);
    let per_rank_experts = num_experts / ranks;
    let mut l = Layout {
        tokens_per_rank: vec![0; ranks],
        tokens_per_expert: vec![0; num_experts],
        is_token_in_rank: vec![0; tokens * ranks],
    };
    for t in 0..tokens {
        let ids = &topk_idx[t * topk..(t + 1) * topk];
        for (k, &e) in ids.iter().enumerate() {
            if e >= 0 && !ids[..k].contains(&e) {
                l.tokens_per_expert[e as usize] += 1;
            }
        }
        for r in 0..ranks {
            if ids
                .iter()
                .any(|&e| e >= 0 && e as usize / per_rank_experts == r)
            {
                l.is_token_in_rank[t * ranks + r] = 1;
                l.tokens_per_rank[r] += 1;
            }
        }
    }
    l
}

/// What one rank receives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Received {
    /// (source rank, token index at the source) of each row, in row order.
    pub sources: Vec<(usize, usize)>,
    /// `[rows][row_bytes]`.
    pub x: Vec<u8>,
    /// `[rows][scale_words]`.
    pub scales: Vec<f32>,
    /// Local expert ids `[rows][topk]`, -1 where the expert lives elsewhere.
    pub topk_idx: Vec<i32>,
    /// `[rows][topk]`, 0 where the id is -1.
    pub weights: Vec<f32>,
    /// Tokens per local expert, rounded up to the alignment.
    pub per_expert: Vec<usize>,
}

/// Dispatch over all ranks' inputs: rows ordered by source rank, then token.
pub fn dispatch(inputs: &[RankInput], num_experts: usize, alignment: usize) -> Vec<Received> {
    let ranks = inputs.len();
    let local = num_experts / ranks;
    let mut out = vec![Received::default(); ranks];
    for (d, recv) in out.iter_mut().enumerate() {
        let lo = (d * local) as i32;
        let hi = lo + local as i32;
        let mut counts = vec![0usize; local];
        for (r, inp) in inputs.iter().enumerate() {
            for t in 0..inp.tokens {
                let ids = &inp.topk_idx[t * inp.topk..(t + 1) * inp.topk];
                if !ids.iter().any(|&e| e >= lo && e < hi) {
                    continue;
                }
                recv.sources.push((r, t));
                recv.x
                    .extend_from_slice(&inp.x[t * inp.row_bytes..(t + 1) * inp.row_bytes]);
                recv.scales
                    .extend_from_slice(&inp.scales[t * inp.scale_words..(t + 1) * inp.scale_words]);
                for (k, &e) in ids.iter().enumerate() {
                    let l = if e >= lo && e < hi { e - lo } else { -1 };
                    recv.topk_idx.push(l);
                    recv.weights.push(if l >= 0 {
                        inp.weights[t * inp.topk + k]
                    } else {
                        0.0
                    });
                    if l >= 0 && !ids[..k].contains(&e) {
                        counts[l as usize] += 1;
                    }
                }
            }
        }
        let a = alignment.max(1);
        recv.per_expert = counts.iter().map(|c| c.div_ceil(a) * a).collect();
    }
    out
}

/// One rank's combine inputs.
#[derive(Debug, Clone, Default)]
pub struct CombineInput {
    /// Expert outputs, one row per received row `[rows][hidden]`.
    pub x: Vec<Bf16>,
    /// Weights `[rows][topk]`, or empty.
    pub weights: Vec<f32>,
}

/// Combine: for every rank and token, the f32 sum over destination ranks (ascending) of the
/// copies that came back, then `bias0`, then `bias1`, rounded to BF16; and the summed weights.
/// `received` is [`dispatch`]'s result; `bias[r]` are rank r's biases (`[tokens][hidden]`).
pub fn combine(
    received: &[Received],
    inputs: &[CombineInput],
    tokens: &[usize],
    hidden: usize,
    topk: usize,
    bias: &[[Option<Vec<Bf16>>; 2]],
) -> Vec<(Vec<Bf16>, Vec<f32>)> {
    let ranks = received.len();
    let mut acc: Vec<Vec<f32>> = tokens.iter().map(|&t| vec![0.0; t * hidden]).collect();
    let mut wacc: Vec<Vec<f32>> = tokens.iter().map(|&t| vec![0.0; t * topk]).collect();
    for d in 0..ranks {
        for (row, &(r, t)) in received[d].sources.iter().enumerate() {
            let src = &inputs[d].x[row * hidden..(row + 1) * hidden];
            for (a, v) in acc[r][t * hidden..(t + 1) * hidden].iter_mut().zip(src) {
                *a += v.to_f32();
            }
            if topk > 0 && !inputs[d].weights.is_empty() {
                for k in 0..topk {
                    wacc[r][t * topk + k] += inputs[d].weights[row * topk + k];
                }
            }
        }
    }
    (0..ranks)
        .map(|r| {
            let mut a = std::mem::take(&mut acc[r]);
            for b in bias.get(r).into_iter().flatten().flatten() {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y.to_f32();
                }
            }
            (
                a.into_iter().map(Bf16::from_f32).collect(),
                std::mem::take(&mut wacc[r]),
            )
        })
        .collect()
}

/// Rank masks (`enable_shrink`, both modes): `masked[r][s]` says rank `r` masks rank `s`. Two
/// ranks exchange data only when neither masks the other: the sender sends nothing to a rank it
/// masks, the receiver treats what a rank it masks sends as absent. This returns rank `me`'s
/// top-k ids (`local` experts per rank) with every expert on a rank it is not linked to replaced
/// by -1: the dispatch of every rank's masked ids is the dispatch under the masks, and the
/// combine of `me`'s masked ids its combine (an absent expert adds nothing). [`masked_inputs`]
/// applies it to the inputs of [`dispatch`].
///
/// ```
/// use ep::reference::masked_ids;
/// // 2 ranks, 2 experts each; rank 1 masks rank 0.
/// let masked = vec![vec![false, false], vec![true, false]];
/// assert_eq!(masked_ids(&[0, 3, 1, 2], 0, 2, &masked), vec![0, -1, 1, -1]);
/// assert_eq!(masked_ids(&[0, 3], 1, 2, &masked), vec![-1, 3]);
/// ```
pub fn masked_ids(topk_idx: &[i32], me: usize, local: usize, masked: &[Vec<bool>]) -> Vec<i32> {
    topk_idx
        .iter()
        .map(|&e| {
            if e < 0 {
                return e;
            }
            let d = e as usize / local;
            if masked[me][d] || masked[d][me] {
                -1
            } else {
                e
            }
        })
        .collect()
}

/// Every rank's inputs with its top-k ids masked ([`masked_ids`]): [`dispatch`] and [`combine`]
/// over them are the normal-mode (intranode) dispatch and combine under the masks.
pub fn masked_inputs(
    inputs: &[RankInput],
    num_experts: usize,
    masked: &[Vec<bool>],
) -> Vec<RankInput> {
    let local = num_experts / inputs.len().max(1);
    inputs
        .iter()
        .enumerate()
        .map(|(me, inp)| RankInput {
            topk_idx: masked_ids(&inp.topk_idx, me, local, masked),
            ..inp.clone()
        })
        .collect()
}

/// Whether normal-mode (intranode) kernels can honour the masks: every rank links (does not
/// mask) itself and the ranks it does not mask, and linked ranks must link the same ranks
/// (masks symmetric and transitive: the ranks fall into groups). Returns each rank's link set
/// (bit `r` = rank `r`, as `ep_kernels::intranode::links_of`), or the first pair that breaks
/// the rule, `(rank, peer)`, where `rank` links `peer` but their link sets differ. The kernels
/// report such a pair as [`EpError::MaskMismatch`](crate::EpError::MaskMismatch) (where one
/// side masks the other and not back, on the side that still links: see `intranode::masks`).
///
/// ```
/// use ep::reference::normal_mode_links;
/// // 3 ranks; ranks 0 and 1 mask rank 2, rank 2 masks them: groups {0, 1} and {2}.
/// let m = vec![vec![false, false, true], vec![false, false, true], vec![true, true, false]];
/// assert_eq!(normal_mode_links(&m), Ok(vec![0b011, 0b011, 0b100]));
/// // Rank 2 keeps linking rank 0: they disagree.
/// let m = vec![vec![false, false, true], vec![false, false, true], vec![false, true, false]];
/// assert_eq!(normal_mode_links(&m), Err((2, 0)));
/// ```
pub fn normal_mode_links(masked: &[Vec<bool>]) -> Result<Vec<u32>, (usize, usize)> {
    let links: Vec<u32> = masked
        .iter()
        .enumerate()
        .map(|(me, row)| {
            row.iter()
                .enumerate()
                .filter(|&(r, &m)| r == me || !m)
                .fold(0, |acc, (r, _)| acc | (1 << r))
        })
        .collect();
    for (me, &mine) in links.iter().enumerate() {
        for (peer, &theirs) in links.iter().enumerate() {
            if mine >> peer & 1 == 1 && theirs != mine {
                return Err((me, peer));
            }
        }
    }
    Ok(links)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_dispatch_by_hand() {
        // 2 ranks, 4 experts (2 per rank), top-2.
        let a = RankInput {
            tokens: 3,
            row_bytes: 1,
            x: vec![10, 11, 12],
            topk: 2,
            topk_idx: vec![0, 3, -1, -1, 1, 1],
            weights: vec![0.5, 0.25, 1.0, 1.0, 0.75, 0.125],
            ..Default::default()
        };
        let b = RankInput {
            tokens: 1,
            row_bytes: 1,
            x: vec![20],
            topk: 2,
            topk_idx: vec![2, 3],
            weights: vec![0.1, 0.2],
            ..Default::default()
        };
        let l = layout(&a.topk_idx, 2, 2, 4);
        assert_eq!(l.tokens_per_rank, vec![2, 1]);
        assert_eq!(l.tokens_per_expert, vec![1, 1, 0, 1]);
        assert_eq!(l.is_token_in_rank, vec![1, 1, 0, 0, 1, 0]);
        let r = dispatch(&[a, b], 4, 1);
        assert_eq!(r[0].sources, vec![(0, 0), (0, 2)]);
        assert_eq!(r[0].x, vec![10, 12]);
        assert_eq!(r[0].topk_idx, vec![0, -1, 1, 1]);
        assert_eq!(r[0].weights, vec![0.5, 0.0, 0.75, 0.125]);
        assert_eq!(r[0].per_expert, vec![1, 1]);
        assert_eq!(r[1].sources, vec![(0, 0), (1, 0)]);
        assert_eq!(r[1].topk_idx, vec![-1, 1, 0, 1]);
        assert_eq!(r[1].per_expert, vec![1, 2]);
        let r4 = dispatch(
            &[RankInput {
                tokens: 1,
                row_bytes: 1,
                x: vec![1],
                topk: 1,
                topk_idx: vec![0],
                weights: vec![1.0],
                ..Default::default()
            }],
            1,
            4,
        );
        assert_eq!(r4[0].per_expert, vec![4]);
    }

    #[test]
    fn combine_sums_copies_and_biases() {
        let recv = vec![
            Received {
                sources: vec![(0, 0)],
                ..Default::default()
            },
            Received {
                sources: vec![(0, 0), (0, 1)],
                ..Default::default()
            },
        ];
        let f = |v: &[f32]| v.iter().map(|&x| Bf16::from_f32(x)).collect::<Vec<_>>();
        let inputs = vec![
            CombineInput {
                x: f(&[1.0, 2.0]),
                weights: vec![0.5],
            },
            CombineInput {
                x: f(&[3.0, 4.0, 5.0, 6.0]),
                weights: vec![0.25, 1.0],
            },
        ];
        let bias = vec![[Some(f(&[0.5, 0.5, 0.5, 0.5])), None], [None, None]];
        let out = combine(&recv, &inputs, &[2, 0], 2, 1, &bias);
        assert_eq!(out[0].0, f(&[4.5, 6.5, 5.5, 6.5]));
        assert_eq!(out[0].1, vec![0.75, 1.0]);
    }

    /// Rank masks in normal mode: 3 ranks, 1 expert each, top-3; rank 2 is cut off from ranks 0
    /// and 1 (both sides mask), so each group only exchanges inside itself and combine sums only
    /// the linked copies.
    #[test]
    fn masked_dispatch_and_combine_by_hand() {
        let m = vec![
            vec![false, false, true],
            vec![false, false, true],
            vec![true, true, false],
        ];
        assert_eq!(normal_mode_links(&m), Ok(vec![0b011, 0b011, 0b100]));
        let input = |x: u8| RankInput {
            tokens: 1,
            row_bytes: 1,
            x: vec![x],
            topk: 3,
            topk_idx: vec![0, 1, 2],
            weights: vec![1.0, 2.0, 4.0],
            ..Default::default()
        };
        let inputs = masked_inputs(&[input(10), input(11), input(12)], 3, &m);
        assert_eq!(inputs[0].topk_idx, vec![0, 1, -1]);
        assert_eq!(inputs[2].topk_idx, vec![-1, -1, 2]);
        let r = dispatch(&inputs, 3, 1);
        assert_eq!(r[0].sources, vec![(0, 0), (1, 0)]);
        assert_eq!(r[1].sources, vec![(0, 0), (1, 0)]);
        assert_eq!(r[2].sources, vec![(2, 0)]);
        assert_eq!(r[2].x, vec![12]);
        assert_eq!(r[0].per_expert, vec![2]);
        // Each received row comes back as 1.0 (its weight): rank 0's token gets 2 copies.
        let back: Vec<CombineInput> = r
            .iter()
            .map(|rv| CombineInput {
                x: vec![Bf16::from_f32(1.0); rv.sources.len()],
                weights: rv.weights.clone(),
            })
            .collect();
        let out = combine(&r, &back, &[1, 1, 1], 1, 3, &[]);
        assert_eq!(out[0].0, vec![Bf16::from_f32(2.0)]);
        assert_eq!(out[0].1, vec![1.0, 2.0, 0.0]);
        assert_eq!(out[2].0, vec![Bf16::from_f32(1.0)]);
        assert_eq!(out[2].1, vec![0.0, 0.0, 4.0]);
        // A mask on one side only, and a non-transitive one, are refused.
        let mut one_sided = m.clone();
        one_sided[2][0] = false;
        assert!(normal_mode_links(&one_sided).is_err());
        let chain = vec![
            vec![false, false, true],
            vec![false, false, false],
            vec![true, false, false],
        ];
        assert_eq!(normal_mode_links(&chain), Err((0, 1)));
        // The kernels' link sets are these.
        for (me, row) in m.iter().enumerate() {
            assert_eq!(
                ep_kernels::intranode::links_of(row, me),
                normal_mode_links(&m).unwrap()[me]
            );
        }
    }
}
