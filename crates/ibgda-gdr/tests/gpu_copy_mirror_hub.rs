//! On a GPU machine: many emulated GDR views ([`CopyMirror`]) of one CUDA context share one pump
//! thread. 64 mirrors (more than the 56 of an internode test with eight ranks on one GPU) follow
//! values written by `cuMemcpyHtoD` and by a kernel, within a bound, while exactly one pump
//! thread exists; the thread goes with the last mirror and comes back with the next one.
//!
//! In a file of its own: the test counts this process's threads by name, and a concurrently
//! running test of the same context would share (and could restart) the pump it counts.

use std::io::Write as _;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, LaunchConfig, PushKernelArg as _};
use ibgda_gdr::{gpu_count, CopyMirror, MirrorConfig};

/// Mirrors made (the hung internode test had 56).
const MIRRORS: usize = 64;
/// Bytes between two mirrors' ranges.
const STRIDE: u64 = 256;
/// Bytes each mirror follows.
const MIRRORED: usize = 64;
/// Pump thread name (at most 15 bytes: what /proc keeps).
const PUMP: &str = "mirror-hub-gpu";
/// Longest a value may take to show in every mirror.
const BOUND: Duration = Duration::from_secs(5);

/// `put_strided(base, stride, value)`: thread `t` stores `value` at `base + t * stride`, then a
/// system-scope fence (as device code raises a producer slot).
const PUT_STRIDED_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry put_strided(
    .param .u64 base,
    .param .u64 stride,
    .param .u64 value
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [base];
    ld.param.u64 %rd2, [stride];
    ld.param.u64 %rd3, [value];
    mov.u32 %r1, %tid.x;
    cvt.u64.u32 %rd4, %r1;
    mad.lo.u64 %rd5, %rd4, %rd2, %rd1;
    st.global.u64 [%rd5], %rd3;
    membar.sys;
    ret;
}
"#;

fn put(dptr: u64, v: u64) {
    // SAFETY: `dptr` is 8 bytes of a live device allocation; the source is a local.
    let r = unsafe { sys::cuMemcpyHtoD_v2(dptr, (&v as *const u64).cast(), 8) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

/// Asserts that `n` threads are named like the pump, waiting up to a second for it (a thread
/// names itself once it runs, and a joined one leaves /proc a moment after the join).
fn pumps(n: usize, when: &str) {
    let t0 = Instant::now();
    while threads_named(PUMP) != n {
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "{when}: {} pump threads, want {n}",
            threads_named(PUMP)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Threads of this process named `name` (as /proc keeps it).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// Waits until every mirror `i` of `which` shows `want(i)` at `off`; returns how long it took.
fn wait_all(
    mirrors: &[CopyMirror],
    which: impl Fn(usize) -> bool,
    off: usize,
    want: impl Fn(usize) -> u64,
) -> Duration {
    let t0 = Instant::now();
    for (i, m) in mirrors.iter().enumerate().filter(|(i, _)| which(*i)) {
        while m.read_u64(off) != want(i) {
            assert!(
                t0.elapsed() < BOUND,
                "mirror {i} word {off}: shows {:#x}, want {:#x} (pump error: {:?})",
                m.read_u64(off),
                want(i),
                m.error()
            );
            std::thread::yield_now();
        }
    }
    t0.elapsed()
}

/// A mirror of `dptr`, with a stream of its own (the pump copies on the first mirror's).
fn mirror(ctx: &std::sync::Arc<CudaContext>, dptr: u64) -> CopyMirror {
    let cfg = MirrorConfig {
        name: PUMP.into(),
        ..Default::default()
    };
    let stream = ctx.new_stream().expect("stream");
    // SAFETY: the allocation outlives every mirror (freed at the end of the test, after them).
    unsafe { CopyMirror::new(ctx, stream, dptr, MIRRORED, cfg) }.expect("mirror")
}

#[test]
fn gpu_copy_mirror_one_pump_serves_many_mirrors() {
    let found = gpu_count().unwrap_or(0);
    if found < 1 {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (needs 1 GPUs, found {found}): gpu_copy_mirror_one_pump_serves_many_mirrors"
        );
        return;
    }
    let _ = writeln!(std::io::stderr(), "gpus: 1 of {found} visible");
    let ctx = CudaContext::new(0).expect("context");
    ctx.bind_to_thread().unwrap();
    let bytes = MIRRORS * STRIDE as usize;
    let mut dptr = 0u64;
    // SAFETY: valid out-pointer, context bound.
    let r = unsafe { sys::cuMemAlloc_v2(&mut dptr, bytes) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: the allocation just made.
    let r = unsafe { sys::cuMemsetD8_v2(dptr, 0, bytes) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: context bound.
    let r = unsafe { sys::cuCtxSynchronize() };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let at = |i: usize| dptr + i as u64 * STRIDE;
    pumps(0, "before any mirror");

    let mut mirrors: Vec<CopyMirror> = (0..MIRRORS).map(|i| mirror(&ctx, at(i))).collect();
    pumps(1, "64 mirrors of one context");
    assert!(mirrors.iter().all(|m| m.read_u64(8) == 0));

    // Host writes into every mirror's range.
    for i in 0..MIRRORS {
        put(at(i) + 8, 0x1000 + i as u64);
    }
    let took = wait_all(&mirrors, |_| true, 8, |i| 0x1000 + i as u64);
    let _ = writeln!(
        std::io::stderr(),
        "cuMemcpyHtoD: all {MIRRORS} mirrors within {took:?}"
    );

    // A kernel's stores (one thread per mirror), seen without the host waiting for the kernel.
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(PUT_STRIDED_PTX))
        .expect("PTX module");
    let put_strided = module.load_function("put_strided").expect("kernel");
    let launch_stream = ctx.new_stream().expect("stream");
    let (base, stride, value) = (at(0) + 16, STRIDE, 0xabcd_0123_4567_89efu64);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (MIRRORS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let t0 = Instant::now();
    let mut launch = launch_stream.launch_builder(&put_strided);
    launch.arg(&base).arg(&stride).arg(&value);
    // SAFETY: put_strided takes three u64s; thread t writes 8 bytes at base + t * STRIDE, inside
    // mirror t's range of the live allocation.
    unsafe { launch.launch(cfg) }.expect("launch");
    wait_all(&mirrors, |_| true, 16, |_| value);
    let took = t0.elapsed();
    let _ = writeln!(
        std::io::stderr(),
        "kernel: all {MIRRORS} mirrors within {took:?}"
    );
    launch_stream.synchronize().expect("kernel");

    // A rising word in the first and last mirror: never a value not held, never going back.
    for m in [0, MIRRORS - 1] {
        let mut seen = 0u64;
        for v in 1..=200u64 {
            put(at(m) + 24, v);
            let now = mirrors[m].read_u64(24);
            assert!(
                now <= v && now >= seen,
                "mirror {m} word 24 went from {seen} to {now} (wrote {v})"
            );
            seen = now;
        }
        wait_all(&mirrors, |i| i == m, 24, |_| 200);
    }

    // Half of them gone: the other half still follows, on the same single pump.
    let mut odd = Vec::new();
    for (i, m) in mirrors.drain(..).enumerate() {
        if i % 2 == 1 {
            odd.push(m);
        }
    }
    mirrors = odd;
    pumps(1, "after dropping half");
    for (j, i) in (1..MIRRORS).step_by(2).enumerate() {
        put(at(i) + 32, 0x2000 + j as u64);
    }
    wait_all(&mirrors, |_| true, 32, |j| 0x2000 + j as u64);
    for m in &mirrors {
        assert!(m.copies() > 1, "copies: {}", m.copies());
        assert!(m.error().is_none(), "{:?}", m.error());
    }

    // The last mirror takes the pump with it; the next one brings it back.
    drop(mirrors);
    pumps(0, "after the last mirror");
    let again = mirror(&ctx, at(5));
    pumps(1, "a new mirror");
    put(at(5) + 40, 99);
    wait_all(std::slice::from_ref(&again), |_| true, 40, |_| 99);
    drop(again);
    pumps(0, "after that mirror");

    // SAFETY: allocated above; every mirror (and the pump) is gone.
    let r = unsafe { sys::cuMemFree_v2(dptr) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}
