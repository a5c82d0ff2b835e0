//! What a kernel's `timeout_ns` means on the GPU: 0 is the default bound (10 s, as in the
//! protocol headers and `ibgda_device::timeout`), and `ep::wait_for_peers` stops early, without
//! waiting out its bound, once another wait of its rank has recorded an error.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use ep_kernels::testing::gpus;
use std::time::{Duration, Instant};

fn one_block(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[test]
fn zero_means_the_default_bound_in_ep_kernels() {
    let Some(ctxs) = gpus(1) else { return };
    let stream = ctxs[0].new_stream().expect("stream");
    let f = ep_kernels::load_function(&ctxs[0], "tests/timeouts", "timeouts_bound_of")
        .expect("load timeouts_bound_of");
    for (given, want) in [
        (0u64, ibgda_device::protocol::DEFAULT_TIMEOUT_NS),
        (7, 7),
        (u64::MAX, u64::MAX),
    ] {
        let out = stream.alloc_zeros::<u64>(1).expect("alloc");
        let mut launch = stream.launch_builder(&f);
        launch.arg(&given).arg(&out);
        // SAFETY: timeouts_bound_of(uint64_t, uint64_t*) matches; `out` holds one u64.
        unsafe { launch.launch(one_block(32)) }.expect("launch");
        let got = stream.clone_dtoh(&out).expect("download")[0];
        assert_eq!(got, want, "bound of timeout_ns {given}");
        assert_eq!(
            got,
            ibgda_device::timeout::wait_bound_ns(given),
            "host twin"
        );
    }
}

#[test]
fn wait_for_peers_stops_once_an_error_is_recorded() {
    let Some(ctxs) = gpus(1) else { return };
    let stream = ctxs[0].new_stream().expect("stream");
    let f = ep_kernels::load_function(&ctxs[0], "tests/timeouts", "timeouts_wait_for_peers")
        .expect("load timeouts_wait_for_peers");
    // A SignalHead's worth of zeroed flags (far more than its size), and an error slot.
    let signal = stream.alloc_zeros::<u64>(1 << 14).expect("alloc signal");
    let run = |epoch: u64, timeout_ns: u64, code: u64| -> (u64, Duration, Duration) {
        // ErrorSlot {code, pad, host}: a non-zero code is an error another wait recorded, so
        // this wait must not record its own (host stays 0: nothing may be written there).
        let error = stream.clone_htod(&[code, 0u64]).expect("error slot");
        let out = stream.alloc_zeros::<u64>(2).expect("alloc out");
        let (sig, _g1) = signal.device_ptr(&stream);
        let (err, _g2) = error.device_ptr(&stream);
        let t = Instant::now();
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&sig)
            .arg(&epoch)
            .arg(&timeout_ns)
            .arg(&err)
            .arg(&out);
        // SAFETY: timeouts_wait_for_peers(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t*)
        // matches; `sig` is zeroed device memory larger than a SignalHead, `err` an ErrorSlot
        // whose code is non-zero whenever the wait can fail, `out` holds two u64.
        unsafe { launch.launch(one_block(32)) }.expect("launch");
        ibgda_device::cuda::wait_stream(&stream, Duration::from_secs(60), "the wait kernel")
            .expect("the wait kernel ended");
        let host_took = t.elapsed();
        let o = stream.clone_dtoh(&out).expect("download");
        (o[0], Duration::from_nanos(o[1]), host_took)
    };
    // Already released (epoch 0 <= flag 0): returns true at once.
    let (ok, _, _) = run(0, 30_000_000_000, 1);
    assert_eq!(ok, 1);
    // Never released, a 30 s bound, an error already recorded: false, long before the bound.
    let (ok, took, host_took) = run(1, 30_000_000_000, 1);
    assert_eq!(ok, 0, "the wait must report failure");
    assert!(
        took < Duration::from_secs(2),
        "wait_for_peers waited {took:?} (host saw {host_took:?}) after an error was recorded"
    );
}

#[test]
fn legacy_stream_waits_are_bounded_and_downloads_keep_their_order() {
    use ibgda_device::cuda::{wait_legacy_stream, CudaError, DeviceBuffer};
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    let buf = DeviceBuffer::new(ctx, 64).expect("alloc");
    buf.fill_bytes(0).expect("zero");
    let f = ep_kernels::load_function(ctx, "tests/timeouts", "timeouts_sleep_then_store")
        .expect("load timeouts_sleep_then_store");
    // On the legacy default stream, where the driver's "synchronous" copies run.
    let legacy = ctx.default_stream();
    let (ns, ptr, value) = (2_000_000_000u64, buf.ptr(), 0x5eed_u64);
    let mut launch = legacy.launch_builder(&f);
    launch.arg(&ns).arg(&ptr).arg(&value);
    // SAFETY: timeouts_sleep_then_store(uint64_t, uint64_t*, uint64_t) matches; `ptr` is a live
    // 64-byte allocation.
    unsafe { launch.launch(one_block(32)) }.expect("launch");
    let t = Instant::now();
    match wait_legacy_stream(ctx, Duration::from_millis(200), "a sleeping kernel") {
        Err(CudaError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The download waits (bounded) for the kernel queued before it, then copies.
    let got: Vec<u64> = buf.download(0, 1).expect("download");
    assert_eq!(got[0], value);
}
