//! LogFMT-10, the optional wire format of low-latency combine rows ([`LlCombineArgs::use_logfmt`],
//! DeepEP's `use_logfmt`): the CPU definition of what the kernels (`include/ep/logfmt.cuh`)
//! send and how the receiver reads it back.
//!
//! A BF16 row of `hidden` channels (a multiple of 128) is cut into groups of 128 channels. Per
//! group the sender takes the largest and smallest magnitude, `amax` and `amin` (BF16), and
//! `lmax = log2(amax)`, `lmin = max(log2(amin), lmax - 32)`. When `lmax < 0` and `lmin < lmax`
//! the group is cast: each value becomes a 10-bit code, its sign and a magnitude code `m` in
//! 0..=511 with `m = 0` for zero and `2^(lmin + (m - 1) × step)` otherwise, `step = (lmax -
//! lmin) / 510`, the code chosen nearest in the linear domain. Otherwise the group travels as
//! BF16. The row on the wire:
//!
//! | bytes | what |
//! |---|---|
//! | `u32 [hidden / 128]`, padded to 16 | per group: `amax` bits (low half), `amin` bits (high half) |
//! | 160 per cast group, 256 per other | the groups in order: cast ones as 16 chunks of 10 bytes (channels `8i..8i+8` as an 80-bit little-endian field, channel `8i + j` at bit `10j`: bit 9 the sign, bits 0..9 `m`), others as BF16 |
//!
//! Groups of magnitudes below 1 (expert outputs usually are) move 37.5 % fewer bytes; a value's
//! relative error is at most about half a step, `2^(step / 2) - 1` (≤ 2.2 %, usually far less:
//! `step` is `(lmax - lmin) / 510`).
//!
//! ```
//! use ep::low_latency::logfmt::{decode, encode};
//! use ep::Bf16;
//! let row: Vec<Bf16> = (0..128).map(|i| Bf16::from_f32((i as f32 - 64.0) / 100.0)).collect();
//! let wire = encode(&row);
//! assert_eq!(wire.len(), 16 + 160); // meta, one cast group
//! let back = decode(&wire, 128);
//! // A zero in the group puts lmin at lmax - 32: steps of 2^(32/510), errors up to 2.2 %.
//! assert!(row.iter().zip(&back).all(|(a, b)| (a.to_f32() - b).abs() <= 0.023 * a.to_f32().abs()));
//! ```
//!
//! [`LlCombineArgs::use_logfmt`]: super::LlCombineArgs::use_logfmt

use crate::dtype::Bf16;
pub use ep_kernels::low_latency::{combine_slot_bytes, logfmt_meta_bytes, LOGFMT_GROUP};

/// Bytes of a cast group (128 × 10 bits).
pub const CAST_BYTES: usize = 160;
/// Bytes of a group sent as BF16.
pub const RAW_BYTES: usize = 256;
const MIN_CLIP: f32 = 32.0;
const STEPS: f32 = 510.0;
const MAX_CODE: u32 = 511;

/// The code parameters of a cast group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Group {
    /// log2 of the smallest magnitude code 1 stands for.
    pub lmin: f32,
    /// log2 distance between neighbouring codes.
    pub step: f32,
}

impl Group {
    /// The group of magnitudes `amax`, `amin` (BF16 bits without sign), or `None` when it travels
    /// as BF16.
    pub fn of(amax_bits: u16, amin_bits: u16) -> Option<Group> {
        let lmax = Bf16(amax_bits).to_f32().log2();
        let lmin = Bf16(amin_bits).to_f32().log2().max(lmax - MIN_CLIP);
        if !(lmax < 0.0 && lmin < lmax) {
            return None;
        }
        Some(Group {
            lmin,
            step: (lmax - lmin) / STEPS,
        })
    }

    /// The 10-bit code of `v` (sign in bit 9).
    pub fn code(&self, v: Bf16) -> u32 {
        let sign = if v.0 & 0x8000 != 0 { 0x200 } else { 0 };
        let mag = Bf16(v.0 & 0x7fff).to_f32();
        if mag == 0.0 {
            return sign;
        }
        let inv = 1.0 / self.step;
        let rounding = 2.0 - ((1.0 + self.step.exp2()) * 0.5).log2() * inv;
        let c = (mag.log2() * inv + (rounding - self.lmin * inv))
            .max(0.0)
            .floor();
        sign | if c >= MAX_CODE as f32 {
            MAX_CODE
        } else {
            c as u32
        }
    }

    /// The value of a 10-bit code.
    pub fn value(&self, code: u32) -> f32 {
        let m = code & 0x1ff;
        let mag = if m == 0 {
            0.0
        } else {
            ((m - 1) as f32 * self.step + self.lmin).exp2()
        };
        if code & 0x200 != 0 {
            -mag
        } else {
            mag
        }
    }
}

fn extremes(group: &[Bf16]) -> (u16, u16) {
    group.iter().fold((0u16, 0x7fffu16), |(hi, lo), v| {
        let m = v.0 & 0x7fff;
        (hi.max(m), lo.min(m))
    })
}

/// The wire bytes of one row (`row.len()` a multiple of 128).
pub fn encode(row: &[Bf16]) -> Vec<u8> {
    assert_eq!(row.len() % LOGFMT_GROUP, 0, "LogFMT rows are groups of 128");
    let meta = logfmt_meta_bytes(row.len());
    let mut out = vec![0u8; meta];
    for (g, group) in row.chunks(LOGFMT_GROUP).enumerate() {
        let (amax, amin) = extremes(group);
        out[4 * g..4 * g + 4]
            .copy_from_slice(&(u32::from(amax) | (u32::from(amin) << 16)).to_le_bytes());
        match Group::of(amax, amin) {
            Some(q) => {
                for chunk in group.chunks(8) {
                    let bits = chunk.iter().enumerate().fold(0u128, |acc, (j, &v)| {
                        acc | (u128::from(q.code(v)) << (10 * j))
                    });
                    out.extend_from_slice(&bits.to_le_bytes()[..10]);
                }
            }
            None => out.extend(group.iter().flat_map(|v| v.0.to_le_bytes())),
        }
    }
    out
}

/// The values the receiver reads back from the wire bytes of a row of `hidden` channels.
pub fn decode(wire: &[u8], hidden: usize) -> Vec<f32> {
    let mut at = logfmt_meta_bytes(hidden);
    let mut out = Vec::with_capacity(hidden);
    for g in 0..hidden / LOGFMT_GROUP {
        let m = u32::from_le_bytes(wire[4 * g..4 * g + 4].try_into().expect("4 bytes"));
        match Group::of(m as u16, (m >> 16) as u16) {
            Some(q) => {
                for chunk in wire[at..at + CAST_BYTES].chunks(10) {
                    let mut b = [0u8; 16];
                    b[..10].copy_from_slice(chunk);
                    let bits = u128::from_le_bytes(b);
                    out.extend((0..8).map(|j| q.value((bits >> (10 * j)) as u32 & 0x3ff)));
                }
                at += CAST_BYTES;
            }
            None => {
                out.extend(
                    wire[at..at + RAW_BYTES]
                        .chunks(2)
                        .map(|b| Bf16(u16::from_le_bytes([b[0], b[1]])).to_f32()),
                );
                at += RAW_BYTES;
            }
        }
    }
    out
}

/// Combine with LogFMT rows: as [`reference::combine`](super::reference::combine), each expert
/// row read back through [`encode`] and [`decode`].
pub fn combine<'a>(
    topk_idx: &[i32],
    weights: &[f32],
    topk: usize,
    hidden: usize,
    expert_row: impl Fn(usize, usize) -> &'a [Bf16],
) -> Vec<Bf16> {
    let tokens = topk_idx.len().checked_div(topk).unwrap_or(0);
    let mut out = Vec::with_capacity(tokens * hidden);
    for t in 0..tokens {
        let mut acc = vec![0.0f32; hidden];
        for j in 0..topk {
            let e = topk_idx[t * topk + j];
            if e < 0 {
                continue;
            }
            let w = weights[t * topk + j];
            let row = decode(&encode(expert_row(e as usize, t)), hidden);
            for (a, v) in acc.iter_mut().zip(row) {
                *a = w.mul_add(v, *a);
            }
        }
        out.extend(acc.iter().map(|&a| Bf16::from_f32(a)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(f: impl Fn(usize) -> f32, n: usize) -> Vec<Bf16> {
        (0..n).map(|i| Bf16::from_f32(f(i))).collect()
    }

    #[test]
    fn small_groups_are_cast_and_large_ones_kept() {
        // Group 0 below 1 (cast), group 1 with a 3.0 (BF16), group 2 all zero (BF16: lmin = lmax).
        let r = row(
            |i| match i / 128 {
                0 => ((i % 17) as f32 - 8.0) / 16.0,
                1 => ((i % 5) as f32 - 2.0) * 1.5,
                _ => 0.0,
            },
            384,
        );
        let wire = encode(&r);
        assert_eq!(
            wire.len(),
            logfmt_meta_bytes(384) + CAST_BYTES + 2 * RAW_BYTES
        );
        assert!(wire.len() <= combine_slot_bytes(384, true));
        let back = decode(&wire, 384);
        for (i, (a, b)) in r.iter().zip(&back).enumerate() {
            let a = a.to_f32();
            if i >= 128 {
                assert_eq!(a, *b, "channel {i} travels as BF16");
            } else {
                assert!((a - b).abs() <= 0.023 * a.abs(), "channel {i}: {a} -> {b}");
                assert_eq!(a == 0.0, *b == 0.0, "channel {i}: zero stays zero");
            }
        }
    }

    #[test]
    fn codes_span_the_group_and_round_to_the_nearest_value() {
        let q = Group::of(Bf16::from_f32(0.5).0, Bf16::from_f32(0.5f32.powi(9)).0).unwrap();
        assert_eq!(q.code(Bf16::from_f32(0.5)), 511);
        assert_eq!(q.code(Bf16::from_f32(-0.5)), 0x200 | 511);
        assert_eq!(q.code(Bf16::from_f32(0.5f32.powi(9))), 1);
        assert_eq!(q.code(Bf16::from_f32(0.0)), 0);
        for v in [0.3f32, -0.01, 0.0021, 0.49] {
            let b = Bf16::from_f32(v);
            let c = q.code(b);
            let got = q.value(c);
            // No other code is nearer.
            for d in [c.wrapping_sub(1), c + 1] {
                if d & 0x1ff != 0 && d <= 511 {
                    assert!((q.value(d) - b.to_f32()).abs() >= (got - b.to_f32()).abs() * 0.999);
                }
            }
        }
    }

    #[test]
    fn the_wire_layout_packs_ten_bits_per_value() {
        let r = row(|i| if i == 9 { -0.25 } else { 0.25 / (1 + i) as f32 }, 128);
        let wire = encode(&r);
        let meta = u32::from_le_bytes(wire[0..4].try_into().unwrap());
        assert_eq!(meta as u16, Bf16::from_f32(0.25).0);
        assert_eq!((meta >> 16) as u16, Bf16::from_f32(0.25 / 128.0).0);
        // Channel 9 is chunk 1's channel 1: bits 10..19 of bytes 10..20 after the meta.
        let chunk = &wire[16 + 10..16 + 20];
        let bits = u128::from_le_bytes([chunk, &[0u8; 6]].concat().try_into().unwrap());
        assert_eq!((bits >> 10) as u32 & 0x3ff, 0x200 | 511);
    }
}
