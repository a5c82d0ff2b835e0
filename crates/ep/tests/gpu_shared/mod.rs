//! What the intranode and internode GPU test helpers share and needs `ep` types (the rest is in
//! `ep_kernels::testing`); each includes it with `#[path]`.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ep::{Bf16, Tensor};
use ep_kernels::testing::Rng;

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
