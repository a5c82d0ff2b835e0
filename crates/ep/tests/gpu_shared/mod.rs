//! What the intranode and internode GPU test helpers share and needs `ep` types (the rest is in
//! `ep_kernels::testing`); each includes it with `#[path]`.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ep::reference::RankInput;
use ep::{Bf16, Tensor};
use ep_kernels::testing::{random_f32, Rng};

/// `n` BF16 values, uniform in [-1, 1) in steps of 2^-19.
pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<Bf16> {
    (0..n)
        .map(|_| Bf16::from_f32((rng.below(1 << 20) as f32 / (1 << 19) as f32) - 1.0))
        .collect()
}

/// `data` on the GPU of `ctx` as a tensor of `shape`, the error as text.
pub fn upload<T: ep::Element>(
    ctx: &Arc<CudaContext>,
    data: &[T],
    shape: &[usize],
) -> Result<Tensor<T>, String> {
    Tensor::from_host(ctx, data, shape).map_err(|e| e.to_string())
}

/// One rank's input: `tokens` random rows of `hidden` channels (FP8 bytes that are not NaN with
/// a scale per 128 channels, or BF16) routed by `ids` (`[tokens][topk]`), and random weights.
pub fn random_rank_input(
    rng: &mut Rng,
    tokens: usize,
    hidden: usize,
    topk: usize,
    fp8: bool,
    ids: Vec<i32>,
) -> RankInput {
    let (row_bytes, x, scale_words, scales) = if fp8 {
        let x: Vec<u8> = (0..tokens * hidden)
            .map(|_| loop {
                let b = rng.below(256) as u8;
                if b & 0x7f != 0x7f {
                    break b;
                }
            })
            .collect();
        let sw = hidden / 128;
        (hidden, x, sw, random_f32(rng, tokens * sw))
    } else {
        let x = random_bf16(rng, tokens * hidden);
        (hidden * 2, bytemuck::cast_slice(&x).to_vec(), 0, Vec::new())
    };
    RankInput {
        tokens,
        row_bytes,
        x,
        scale_words,
        scales,
        topk,
        topk_idx: ids,
        weights: random_f32(rng, tokens * topk),
    }
}

/// Overwrites a tensor with 0xAB bytes (what `poison_outputs` writes too), the error as text.
pub fn poison_host<T: ep::Element>(t: &Tensor<T>) -> Result<(), String> {
    // Words, so that the bytes are aligned for any element type.
    let n = t.numel() * std::mem::size_of::<T>();
    let words = vec![0xABAB_ABABu32; n.div_ceil(4)];
    let bytes: &[u8] = bytemuck::cast_slice(&words);
    t.copy_from_host(bytemuck::cast_slice(&bytes[..n]))
        .map_err(|e| e.to_string())
}
