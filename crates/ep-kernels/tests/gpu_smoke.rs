//! The GPU loop works end to end: the embedded fatbin loads on every visible GPU, a kernel runs
//! there, and a buffer moves GPU→GPU both by a peer copy (copy engine) and by a kernel reading the
//! peer's memory (NVLink loads), with every byte checked against a CPU reference.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use ep_kernels::testing::{gpus, seed};
use std::sync::Arc;

/// 64 MiB: several times the L2, so the copies really go through memory.
const WORDS: usize = 16 << 20;
const POISON: u32 = 0xDEAD_BEEF;

/// CPU mirror of `pattern_word` in `cuda/smoke.cu`.
fn pattern_word(i: u64, seed: u32) -> u32 {
    let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(seed);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    x as u32
}

fn poisoned(stream: &Arc<CudaStream>) -> CudaSlice<u32> {
    stream
        .clone_htod(&vec![POISON; WORDS])
        .expect("upload poison")
}

fn check(stream: &Arc<CudaStream>, buf: &CudaSlice<u32>, seed: u32, what: &str) {
    let host = stream.clone_dtoh(buf).expect("download");
    let wrong: Vec<usize> = (0..WORDS)
        .filter(|&i| host[i] != pattern_word(i as u64, seed))
        .collect();
    assert!(
        wrong.is_empty(),
        "{what}: {} of {WORDS} words wrong, first at {:?}: got {:#x}",
        wrong.len(),
        &wrong[..wrong.len().min(5)],
        host[wrong[0]]
    );
}

fn launch_cfg() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (264, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn fill(stream: &Arc<CudaStream>, buf: &mut CudaSlice<u32>, seed: u32) {
    let f = ep_kernels::load_function(stream.context(), "smoke", "smoke_fill")
        .expect("load smoke_fill");
    let n = WORDS as u64;
    let mut launch = stream.launch_builder(&f);
    launch.arg(buf).arg(&n).arg(&seed);
    // SAFETY: smoke_fill(uint32_t*, uint64_t, uint32_t) matches the three arguments, and `buf`
    // holds `n` words.
    unsafe { launch.launch(launch_cfg()) }.expect("launch smoke_fill");
}

#[test]
fn gpu_kernel_runs_on_every_gpu() {
    let Some(first) = gpus(1) else { return };
    drop(first);
    let n = ibgda_device::cuda::device_count().unwrap();
    let s = seed() as u32;
    for ord in 0..n {
        let ctx = ibgda_device::cuda::context(ord).unwrap();
        let stream = ctx.default_stream();
        let mut buf = poisoned(&stream);
        fill(&stream, &mut buf, s ^ ord as u32);
        stream.synchronize().expect("synchronize");
        check(&stream, &buf, s ^ ord as u32, &format!("fill on GPU {ord}"));
        eprintln!(
            "GPU {ord} ({}): kernel output checked, {WORDS} words",
            ctx.name().unwrap_or_default()
        );
    }
}

#[test]
fn gpu_peer_copy_and_peer_loads_are_exact() {
    let Some(ctxs) = gpus(2) else { return };
    let s = seed() as u32;
    for (a, b) in [(0usize, 1usize), (1, 0)] {
        let (ca, cb) = (&ctxs[a], &ctxs[b]);
        ibgda_device::cuda::enable_peer_access(cb, ca).expect("peer access b->a");
        ibgda_device::cuda::enable_peer_access(ca, cb).expect("peer access a->b");
        let (sa, sb) = (ca.default_stream(), cb.default_stream());
        let mut src = poisoned(&sa);
        fill(&sa, &mut src, s ^ 0x55);
        sa.synchronize().unwrap();

        // 1. Copy engine: cuMemcpyPeerAsync from GPU a to GPU b.
        let mut dst = poisoned(&sb);
        {
            let (src_ptr, _g1) = src.device_ptr(&sa);
            let (dst_ptr, _g2) = dst.device_ptr_mut(&sb);
            // SAFETY: both allocations are live and WORDS*4 bytes long; the guards keep them
            // ordered with their streams.
            unsafe {
                cudarc::driver::result::memcpy_peer_async(
                    cb.cu_ctx(),
                    dst_ptr,
                    ca.cu_ctx(),
                    src_ptr,
                    WORDS * 4,
                    sb.cu_stream(),
                )
            }
            .expect("cuMemcpyPeerAsync");
        }
        sb.synchronize().unwrap();
        check(
            &sb,
            &dst,
            s ^ 0x55,
            &format!("peer copy GPU {a} -> GPU {b}"),
        );

        // 2. A kernel on GPU b reading GPU a's memory directly. The source must come from
        // cuMemAlloc: memory-pool allocations (cudarc's default) are not peer-mapped by
        // cuCtxEnablePeerAccess.
        let peer_src =
            ibgda_device::cuda::DeviceBuffer::new(ca, WORDS * 4).expect("cuMemAlloc on GPU a");
        {
            let (src_ptr, _g) = src.device_ptr(&sa);
            // SAFETY: both are live WORDS*4-byte allocations on GPU a.
            unsafe { cudarc::driver::sys::cuMemcpyDtoD_v2(peer_src.ptr(), src_ptr, WORDS * 4) }
                .result()
                .expect("cuMemcpyDtoD");
        }
        let mut dst2 = poisoned(&sb);
        let f = ep_kernels::load_function(cb, "smoke", "smoke_copy").expect("load smoke_copy");
        let n_vec = (WORDS / 4) as u64;
        let src_ptr = peer_src.ptr();
        let mut launch = sb.launch_builder(&f);
        launch.arg(&src_ptr).arg(&mut dst2).arg(&n_vec);
        // SAFETY: smoke_copy(const uint4*, uint4*, uint64_t): `src_ptr` is GPU a's live cuMemAlloc
        // allocation, readable from b after enable_peer_access; both hold n_vec 16-B vectors.
        unsafe { launch.launch(launch_cfg()) }.expect("launch smoke_copy");
        sb.synchronize().unwrap();
        check(
            &sb,
            &dst2,
            s ^ 0x55,
            &format!("peer loads GPU {b} <- GPU {a}"),
        );
        eprintln!(
            "GPU {a} -> GPU {b}: peer copy and peer loads checked, {} MiB",
            (WORDS * 4) >> 20
        );
    }
}

/// `DeviceBuffer::upload` and `fill_bytes` are complete in device memory when they return: a
/// copy queued at once on a non-blocking stream (which does not wait for the legacy stream the
/// driver's pageable copies and memsets run on) reads every byte as written. Before they waited
/// for the legacy stream, a pageable upload could return with its last DMA still queued; the
/// low-latency graph tests read inputs torn that way (rows correct up to a byte, zeros after).
#[test]
fn gpu_upload_and_fill_are_in_device_memory_when_they_return() {
    use cudarc::driver::sys;
    use ibgda_device::cuda::DeviceBuffer;
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    // Created first: cudarc synchronizes the context when it makes a context's first stream.
    let stream = ctx.new_stream().expect("stream");
    let s = seed() as u32;
    let bytes = WORDS * 4;
    let copy_back = |src: &DeviceBuffer| -> Vec<u32> {
        let dst = DeviceBuffer::new(ctx, bytes).expect("alloc");
        ctx.bind_to_thread().expect("bind");
        // SAFETY: both allocations are live and `bytes` long; the copy is ordered on `stream`,
        // which is synchronized before either buffer is dropped.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), bytes, stream.cu_stream()) }
            .result()
            .expect("cuMemcpyDtoDAsync");
        stream.synchronize().expect("synchronize");
        dst.download(0, WORDS).expect("download")
    };
    for round in 0..6u32 {
        let want: Vec<u32> = (0..WORDS as u64)
            .map(|i| pattern_word(i, s ^ round))
            .collect();
        let up = DeviceBuffer::from_slice(ctx, &want).expect("upload");
        let got = copy_back(&up);
        let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            wrong, 0,
            "round {round}: {wrong} of {WORDS} uploaded words read stale"
        );

        let filled = DeviceBuffer::new(ctx, bytes).expect("alloc");
        let v = 0x11u8.wrapping_mul(round as u8 + 1);
        filled.fill_bytes(v).expect("fill");
        let got = copy_back(&filled);
        let word = u32::from_ne_bytes([v; 4]);
        let wrong = got.iter().filter(|&&w| w != word).count();
        assert_eq!(
            wrong, 0,
            "round {round}: {wrong} of {WORDS} filled words read stale"
        );
    }
    eprintln!("6 rounds of {bytes} bytes uploaded and filled, each read back at once on a non-blocking stream");
}
