//! The one launch every ep-kernels kernel takes: a 1-D grid of 1-D blocks and a single by-value
//! parameter struct.

use cudarc::driver::{
    CudaFunction, CudaStream, DeviceRepr, DriverError, LaunchConfig, PushKernelArg,
};

/// Launches `f` on `stream` over `grid` blocks of `block` threads with `smem` bytes of dynamic
/// shared memory and `p` as its only argument.
///
/// # Safety
///
/// `f` takes exactly one by-value parameter struct and `P` is its `#[repr(C)]` mirror; every
/// address in `p` stays valid for as long as the kernel runs.
pub(crate) unsafe fn launch_with_params<P: DeviceRepr>(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: u32,
    block: u32,
    smem: u32,
    p: &P,
) -> Result<(), DriverError> {
    let mut b = stream.launch_builder(f);
    b.arg(p);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: the caller's promise above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
