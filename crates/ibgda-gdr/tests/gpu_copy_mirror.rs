//! On a GPU machine: the emulated GDR view ([`CopyMirror`]) of GPU memory. Values the GPU side
//! writes into a few 8-byte words (here by `cuMemcpyHtoD`, as device code's stores would land)
//! appear in the mirror whole and in order, within a bound; a word written many times is only
//! ever seen at values it held, never going back.

use std::io::Write as _;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use ibgda_gdr::{gpu_count, CopyMirror, MirrorConfig};

fn put(dptr: u64, v: u64) {
    // SAFETY: `dptr` is 8 bytes of a live device allocation; the source is a local.
    let r = unsafe { sys::cuMemcpyHtoD_v2(dptr, (&v as *const u64).cast(), 8) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

fn wait_for(m: &CopyMirror, off: usize, want: u64) {
    let t0 = Instant::now();
    while m.read_u64(off) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "word {off}: mirror shows {:#x}, want {want:#x} (pump error: {:?})",
            m.read_u64(off),
            m.error()
        );
        std::thread::yield_now();
    }
}

#[test]
fn gpu_copy_mirror_follows_gpu_memory() {
    let found = gpu_count().unwrap_or(0);
    if found < 1 {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (needs 1 GPUs, found {found}): gpu_copy_mirror_follows_gpu_memory"
        );
        return;
    }
    let _ = writeln!(std::io::stderr(), "gpus: 1 of {found} visible");
    let ctx = CudaContext::new(0).expect("context");
    ctx.bind_to_thread().unwrap();
    let mut dptr = 0u64;
    // SAFETY: valid out-pointer, context bound.
    let r = unsafe { sys::cuMemAlloc_v2(&mut dptr, 4096) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: the allocation just made.
    let r = unsafe { sys::cuMemsetD8_v2(dptr, 0, 4096) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: context bound.
    let r = unsafe { sys::cuCtxSynchronize() };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let stream = ctx.new_stream().expect("stream");
    {
        // SAFETY: the allocation outlives the mirror (freed after this block).
        let m = unsafe { CopyMirror::new(&ctx, stream, dptr, 64, MirrorConfig::default()) }
            .expect("mirror");
        assert_eq!(m.read_u64(0), 0);
        put(dptr + 8, 0x1122_3344_5566_7788);
        wait_for(&m, 8, 0x1122_3344_5566_7788);
        // A rising word: the mirror never shows a value it did not hold, nor goes back.
        let mut seen = 0u64;
        for v in 1..=200u64 {
            put(dptr + 16, v);
            let now = m.read_u64(16);
            assert!(
                now <= v && now >= seen,
                "word 16 went from {seen} to {now} (wrote {v})"
            );
            seen = now;
        }
        wait_for(&m, 16, 200);
        assert!(m.copies() > 1 && m.error().is_none());
    }
    // SAFETY: allocated above; the mirror (and its pump) is gone.
    let r = unsafe { sys::cuMemFree_v2(dptr) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}
