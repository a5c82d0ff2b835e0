//! Intranode teardown never frees memory a kernel may still write (issue 16, item 7): a buffer
//! dropped, or shut down, while its communication stream is still busy past the time bound
//! leaks its memory (with a logged error) instead of freeing it under the kernel; a buffer
//! dropped cleanly gives its memory back. Measured with `cuMemGetInfo` on one GPU, one rank;
//! one test, so that no other test of this binary allocates meanwhile.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use ep::bootstrap::ThreadGroup;
use ep::{Buffer, BufferOptions, EpError};
use ep_kernels::low_latency::LlSleepParams;
use ep_kernels::testing::gpus;

/// Options whose window and combine outputs take about 1 GiB, far above the noise of the
/// allocator; a short bound, so that a busy stream outlasts the host's wait (twice the bound).
fn options() -> BufferOptions {
    let mut o = BufferOptions::new(8192, 7168, 8, 8);
    o.timeout = Duration::from_millis(200);
    o
}

/// What the buffer allocates: its receive regions (all in the window) and combine outputs.
fn buffer_bytes() -> usize {
    let o = options();
    o.recv_region_bytes(1).expect("plan") * o.max_live_outputs
        + o.max_live_outputs * o.max_tokens_per_rank * o.max_hidden * 2
}

/// Allocations the driver rounds and the context's own memory stay well below this.
const SLACK: usize = 64 << 20;

fn free_bytes(ctx: &Arc<CudaContext>) -> usize {
    ctx.bind_to_thread().expect("cuCtxSetCurrent");
    ibgda_device::cuda::wait_legacy_stream(
        ctx,
        std::time::Duration::from_secs(60),
        "the test's own copies and memsets",
    )
    .expect("the legacy stream");
    cudarc::driver::result::mem_get_info()
        .expect("cuMemGetInfo")
        .0
}

/// Keeps the buffer's communication stream busy for `d` (the low-latency sleep kernel, which
/// touches no memory). Returns the kernel, whose module must stay loaded until it has run.
fn keep_busy(ctx: &Arc<CudaContext>, buf: &Buffer, d: Duration) -> CudaFunction {
    let f = ep_kernels::load_function(ctx, ep_kernels::low_latency::MODULE, "ep_ll_sleep")
        .expect("loading ep_ll_sleep");
    let p = LlSleepParams {
        ns: d.as_nanos() as u64,
    };
    let mut b = buf.comm_stream().launch_builder(&f);
    b.arg(&p);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: ep_ll_sleep takes one by-value LlSleepParams (its #[repr(C)] mirror) and touches
    // no memory.
    unsafe { b.launch(cfg) }.expect("launching ep_ll_sleep");
    f
}

fn one_rank(ctx: &Arc<CudaContext>) -> Buffer {
    Buffer::create_group(std::slice::from_ref(ctx), &options())
        .expect("create buffer")
        .pop()
        .expect("one rank")
}

#[test]
fn gpu_intranode_teardown_never_frees_memory_under_a_busy_stream() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    let want = buffer_bytes();
    let busy = options().timeout * 6;

    // A clean drop gives everything back.
    let start = free_bytes(ctx);
    let buf = one_rank(ctx);
    let held = start.saturating_sub(free_bytes(ctx));
    assert!(
        held + SLACK >= want,
        "the buffer holds {held} bytes, expected about {want}"
    );
    drop(buf);
    let after = free_bytes(ctx);
    assert!(
        after + SLACK >= start,
        "a clean drop kept {} bytes",
        start.saturating_sub(after)
    );

    // Dropped while its stream is busy past the bound: leaked, not freed under the kernel.
    let start = free_bytes(ctx);
    let buf = one_rank(ctx);
    let sleeper = keep_busy(ctx, &buf, busy);
    drop(buf);
    let leaked = start.saturating_sub(free_bytes(ctx));
    drop(sleeper);
    assert!(
        leaked + SLACK >= want,
        "drop with a busy stream gave back memory: {leaked} bytes kept, expected about {want}"
    );

    // Shut down after a synchronize that timed out: the same, and the error says so.
    let comm = ThreadGroup::new(1)
        .expect("thread group")
        .pop()
        .expect("one rank");
    let start = free_bytes(ctx);
    let mut buf = Buffer::new(ctx, &comm, &options()).expect("create buffer");
    let sleeper = keep_busy(ctx, &buf, busy);
    let e = buf.synchronize().expect_err("synchronize must time out");
    assert!(matches!(e, EpError::HostTimeout { .. }), "{e}");
    let e = buf
        .shutdown(&comm)
        .expect_err("shutdown must report the busy stream");
    assert!(matches!(e, EpError::HostTimeout { .. }), "{e}");
    let leaked = start.saturating_sub(free_bytes(ctx));
    drop(sleeper);
    assert!(
        leaked + SLACK >= want,
        "shutdown after a timeout gave back memory: {leaked} bytes kept, expected about {want}"
    );

    // And a clean shutdown frees.
    let start = free_bytes(ctx);
    let buf = Buffer::new(ctx, &comm, &options()).expect("create buffer");
    buf.shutdown(&comm).expect("clean shutdown");
    let after = free_bytes(ctx);
    assert!(
        after + SLACK >= start,
        "a clean shutdown kept {} bytes",
        start.saturating_sub(after)
    );
}
