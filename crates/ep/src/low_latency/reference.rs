//! The CPU definition of low-latency dispatch and combine: what the GPU must reproduce, bit for
//! bit (the FP8 cast included: the same f32 operations in the same order).
//!
//! ```
//! use ep::low_latency::reference::{route, Routing};
//! // 2 ranks, 4 experts (2 per rank), top-2; rank 0 sends 2 tokens, rank 1 one.
//! let r: Routing = route(&[vec![0, 3, 1, -1], vec![3, 2]], 2, 4);
//! // Rank 1's local expert 1 (global 3) gets rank 0's token 0, then rank 1's token 0.
//! assert_eq!(r.rows[1][1], vec![(0, 0), (1, 0)]);
//! assert_eq!(r.layout[1][1], vec![(0, 1), (1, 1)]);
//! ```

use crate::dtype::{Bf16, Fp8E4M3};

/// Channels per FP8 scale.
pub const FP8_BLOCK: usize = 128;

/// Where every (token, expert) pair lands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing {
    /// `rows[rank][local expert]`: (source rank, source token) of each packed row, in order.
    pub rows: Vec<Vec<Vec<(usize, usize)>>>,
    /// `layout[rank][local expert][source rank]`: (first row, rows).
    pub layout: Vec<Vec<Vec<(usize, usize)>>>,
}

impl Routing {
    /// The packed row of (source rank, token) at global expert `e`, if it went there.
    pub fn row_of(&self, e: usize, src: usize, token: usize, local: usize) -> Option<usize> {
        let (d, l) = (e / local, e % local);
        let (first, n) = self.layout[d][l][src];
        self.rows[d][l][first..first + n]
            .binary_search_by_key(&token, |&(_, t)| t)
            .ok()
            .map(|i| first + i)
    }
}

/// Routes each rank's top-k ids (`topk_idx[rank]` is `[tokens][k]`, -1 for none; a repeated id
/// counts once) to `ranks` ranks of `num_experts / ranks` experts each.
pub fn route(topk_idx: &[Vec<i32>], topk: usize, num_experts: usize) -> Routing {
    let ranks = topk_idx.len();
    let local = num_experts / ranks;
    let mut r = Routing {
        rows: vec![vec![Vec::new(); local]; ranks],
        layout: vec![vec![vec![(0, 0); ranks]; local]; ranks],
    };
    for (src, ids) in topk_idx.iter().enumerate() {
        for (t, row) in ids.chunks(topk).enumerate() {
            for (j, &e) in row.iter().enumerate() {
                if e < 0 || row[..j].contains(&e) {
                    continue;
                }
                let e = e as usize;
                r.rows[e / local][e % local].push((src, t));
            }
        }
    }
    for d in 0..ranks {
        for l in 0..local {
            for src in 0..ranks {
                let first = r.rows[d][l].iter().take_while(|&&(s, _)| s < src).count();
                let n = r.rows[d][l].iter().filter(|&&(s, _)| s == src).count();
                r.layout[d][l][src] = (first, n);
            }
        }
    }
    r
}

/// Rank masks (`enable_shrink`): rank `me`'s top-k ids with every expert on a rank it is not
/// linked to replaced by -1 (the definition, shared with normal mode, is in
/// [`crate::reference::masked_ids`]): [`route`] over every rank's masked ids is the dispatch
/// under the masks, and [`combine`] over `me`'s masked ids its combine (an absent expert adds
/// nothing).
pub use crate::reference::masked_ids;

/// The FP8 cast of one BF16 row: per 128 channels `scale = max(amax, 1e-4) / 448` (rounded up to
/// a power of two with `round_scale`), values `x × (1 / scale)` rounded to e4m3 (saturating).
/// Returns the values and the scales.
pub fn fp8_cast(row: &[Bf16], round_scale: bool) -> (Vec<Fp8E4M3>, Vec<f32>) {
    let mut q = Vec::with_capacity(row.len());
    let mut scales = Vec::with_capacity(row.len() / FP8_BLOCK);
    for block in row.chunks(FP8_BLOCK) {
        let amax = block
            .iter()
            .fold(0.0f32, |m, v| m.max(v.to_f32().abs()))
            .max(1e-4);
        let mut scale = amax / 448.0;
        if round_scale {
            scale = pow2_ceil(scale);
        }
        let inv = 1.0 / scale;
        q.extend(block.iter().map(|v| Fp8E4M3::from_f32(v.to_f32() * inv)));
        scales.push(scale);
    }
    (q, scales)
}

/// The smallest power of two at least `s` (positive, finite).
pub fn pow2_ceil(s: f32) -> f32 {
    let mut b = s.to_bits();
    if b & 0x007f_ffff != 0 {
        b = (b & 0xff80_0000) + 0x0080_0000;
    }
    f32::from_bits(b)
}

/// Power-of-two scales as UE8M0 exponent bytes, four per word (byte j of word w is scale 4w + j).
pub fn ue8m0_pack(scales: &[f32]) -> Vec<i32> {
    scales
        .chunks(4)
        .map(|c| {
            c.iter().enumerate().fold(0u32, |w, (j, s)| {
                w | (((s.to_bits() >> 23) & 0xff) << (8 * j))
            }) as i32
        })
        .collect()
}

/// Combine for one source rank: token t's output is, over k in order, the f32 fused multiply-add
/// of `weights[t][k]` and the row its expert returned (`expert_row(e, t)`), rounded to BF16.
pub fn combine<'a>(
    topk_idx: &[i32],
    weights: &[f32],
    topk: usize,
    hidden: usize,
    expert_row: impl Fn(usize, usize) -> &'a [Bf16],
) -> Vec<Bf16> {
    let tokens = topk_idx.len().checked_div(topk).unwrap_or(0);
    let mut out = Vec::with_capacity(tokens * hidden);
    let mut acc = vec![0.0f32; hidden];
    for t in 0..tokens {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for j in 0..topk {
            let e = topk_idx[t * topk + j];
            if e < 0 {
                continue;
            }
            let w = weights[t * topk + j];
            for (a, v) in acc.iter_mut().zip(expert_row(e as usize, t)) {
                *a = w.mul_add(v.to_f32(), *a);
            }
        }
        out.extend(acc.iter().map(|&a| Bf16::from_f32(a)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_orders_by_source_then_token_and_skips_repeats() {
        // 2 ranks, 4 experts, top-3.
        let ids = vec![vec![1, 1, 2, -1, 0, 3], vec![0, -1, -1, 2, 1, 0]];
        let r = route(&ids, 3, 4);
        assert_eq!(r.rows[0][0], vec![(0, 1), (1, 0), (1, 1)]);
        assert_eq!(r.rows[0][1], vec![(0, 0), (1, 1)]);
        assert_eq!(r.rows[1][0], vec![(0, 0), (1, 1)]);
        assert_eq!(r.rows[1][1], vec![(0, 1)]);
        assert_eq!(r.layout[0][0], vec![(0, 1), (1, 2)]);
        assert_eq!(r.row_of(0, 1, 1, 2), Some(2));
        assert_eq!(r.row_of(3, 1, 0, 2), None);
    }

    #[test]
    fn fp8_cast_scales_and_packs() {
        let row: Vec<Bf16> = (0..256).map(|i| Bf16::from_f32(i as f32 - 100.0)).collect();
        let (q, s) = fp8_cast(&row, false);
        assert_eq!(s, vec![100.0 / 448.0, 155.0 / 448.0]);
        assert_eq!(q[0].to_f32(), -448.0);
        let (_, s2) = fp8_cast(&row, true);
        assert_eq!(s2, vec![0.25, 0.5]);
        assert_eq!(pow2_ceil(0.25), 0.25);
        assert_eq!(pow2_ceil(0.3), 0.5);
        let packed = ue8m0_pack(&[0.25, 0.5, 1.0, 2.0]);
        assert_eq!(packed, vec![i32::from_le_bytes([125, 126, 127, 128])]);
        let zeros = vec![Bf16::from_f32(0.0); 128];
        assert_eq!(fp8_cast(&zeros, false).1, vec![1e-4 / 448.0]);
    }

    #[test]
    fn combine_weights_each_copy() {
        let rows = [
            vec![Bf16::from_f32(1.0), Bf16::from_f32(2.0)],
            vec![Bf16::from_f32(3.0), Bf16::from_f32(4.0)],
        ];
        let out = combine(&[0, 1, -1, 1], &[0.5, 0.25, 9.0, 2.0], 2, 2, |e, _| {
            &rows[e]
        });
        let f: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        assert_eq!(f, vec![1.25, 2.0, 6.0, 8.0]);
    }
}
