//! The submit/quiet protocol on the GPU (`ibgda/protocol.cuh`, kernels in
//! `ep-kernels/cuda/tests/protocol.cu`) against the emulated NIC, in handler modes `gpu` and
//! `cpu_host_memory` (and `cpu` where GDRCopy works), with the upstream CPU-assisted bugs as
//! regression tests:
//!
//! 1. the first submission is seen (by the proxy in the CPU modes) and completes;
//! 2. after a heavy multi-block workload on shared QPs, a barrier kernel on the same QPs completes
//!    and `ready_head == resv_head`; a lost reservation ends in the bounded ready-wait error;
//! 3. with completions delayed by the emulator, quiet does not return before they arrive;
//! 4. producer slots are 8-byte-aligned u64s (host and device checks).
//!
//! Plus: the emulator progresses while waiting kernels fill every SM, error CQEs come back as
//! `Err` naming rank, QP and syndrome, inline writes and signal adds land. Every kernel runs on
//! its own non-blocking stream, and every host wait is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use ep::transport::{Arena, EmuRank, QpGroup, QpGroupConfig, RingPlacement, TransportError};
use ep_kernels::testing::{gpus, seed, Rng};
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::{HandlerChoice, ERROR_INVALID_DESC};
use ibgda_device::proxy::ProxyConfig;
use ibgda_device::qp_desc::{ErrorKind, NicHandler, QpDesc};
use ibgda_emu::{Fabric, FaultPlan};

const MODULE: &str = "tests/protocol";

/// The handler modes this machine can run: all three on the emulated NIC with a GPU (`cpu`
/// through GDRCopy, or the emulated GDR view where GDRCopy is absent); a mode refused is said
/// loudly.
fn modes(rank: &EmuRank) -> Vec<NicHandler> {
    let mut m = vec![NicHandler::Gpu, NicHandler::CpuHostMemory];
    match rank.select(HandlerChoice::Cpu) {
        Ok(_) => m.push(NicHandler::Cpu),
        Err(e) => eprintln!("mode cpu not run here: {e}"),
    }
    m
}

struct Rig {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `stream`'s hardware queue.
    _lease: ibgda_device::stream_pool::StreamLease,
    /// Loaded once, before any kernel runs: loading a module while a kernel spins could wait
    /// for it.
    put: CudaFunction,
    me: EmuRank,
    peer: EmuRank,
    src: Arena,
    dst: Arena,
    _fabric: Fabric,
}

fn rig(ctx: &Arc<CudaContext>, peer_ctx: &Arc<CudaContext>, bytes: usize) -> Rig {
    let fabric = Fabric::new();
    let me = EmuRank::cuda(&fabric, ctx, 0).expect("emulated NIC for rank 0");
    let peer = EmuRank::cuda(&fabric, peer_ctx, 1).expect("emulated NIC for rank 1");
    let src = me.arena(bytes).expect("source arena");
    let dst = peer.arena(bytes).expect("destination arena");
    // The test kernels spin for the NIC: a hardware queue of their own (`stream_pool`).
    let (stream, lease) =
        ibgda_device::stream_pool::waiting(ctx).expect("a waiting stream for the test kernels");
    let put = ep_kernels::load_function(ctx, MODULE, "protocol_put_quiet")
        .expect("loading protocol_put_quiet");
    Rig {
        ctx: ctx.clone(),
        stream,
        _lease: lease,
        put,
        me,
        peer,
        src,
        dst,
        _fabric: fabric,
    }
}

impl Rig {
    fn group(
        &self,
        mode: NicHandler,
        nqps: u32,
        nwqes: u32,
        timeout: Duration,
        placement: RingPlacement,
    ) -> QpGroup {
        let cfg = QpGroupConfig {
            handler: mode,
            nqps,
            nwqes,
            timeout,
            placement,
            proxy: ProxyConfig::default(),
            peer_rank: 1,
            ..Default::default()
        };
        self.me
            .connect(&self.peer, &self.src, &cfg)
            .unwrap_or_else(|e| panic!("building {nqps} QPs in mode {}: {e}", mode.name()))
    }

    fn func(&self, name: &str) -> CudaFunction {
        ep_kernels::load_function(&self.ctx, MODULE, name)
            .unwrap_or_else(|e| panic!("loading {name}: {e}"))
    }

    /// Fills the source arena with random bytes and poisons the destination; returns the bytes.
    fn fill(&self, rng: &mut Rng) -> Vec<u8> {
        let n = self.src.len();
        let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
        self.src.device().unwrap().upload(0, &bytes).unwrap();
        self.dst.device().unwrap().fill_bytes(0xEE).unwrap();
        bytes
    }

    fn dst_bytes(&self, off: usize, len: usize) -> Vec<u8> {
        self.dst.device().unwrap().download(off, len).unwrap()
    }
}

fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> DeviceBuffer {
    let b = DeviceBuffer::new(ctx, bytes).unwrap();
    b.fill_bytes(0).unwrap();
    b
}

fn one_thread() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn status_of(buf: &DeviceBuffer) -> i32 {
    buf.download::<i32>(0, 1).unwrap()[0]
}

/// Launches `protocol_put_quiet` on QP `qp`: a put of `bytes` at `off` (same offset in both
/// arenas), a quiet, and the kernel's own check of the destination after the quiet. Returns
/// (status, [t_start, t_published, t_quiet_done], mismatching bytes).
fn put_quiet(r: &Rig, g: &QpGroup, qp: u32, off: u64, bytes: u32) -> (i32, [u64; 3], u32) {
    let status = zeroed(&r.ctx, 4);
    let times = zeroed(&r.ctx, 24);
    let bad = zeroed(&r.ctx, 4);
    bad.upload(0, &[u32::MAX]).unwrap();
    let descs = g.descs().unwrap();
    let (raddr, rkey, laddr) = (r.dst.addr() + off, r.dst.mr().rkey, r.src.addr() + off);
    let (verify, expect) = (raddr, laddr);
    let (sp, tp, bp) = (status.ptr(), times.ptr(), bad.ptr());
    let mut l = r.stream.launch_builder(&r.put);
    l.arg(&descs)
        .arg(&qp)
        .arg(&raddr)
        .arg(&rkey)
        .arg(&laddr)
        .arg(&bytes)
        .arg(&verify)
        .arg(&expect);
    l.arg(&sp).arg(&tp).arg(&bp);
    // SAFETY: protocol_put_quiet(ibgda_qp_desc*, u32, u64, u32, u64, u32, u64, u64, int*, u64*,
    // u32*) matches the arguments; every pointer is a live device allocation of the right size;
    // `verify` is the destination on this GPU (loopback) and `expect` the source.
    unsafe { l.launch(one_thread()) }.expect("launch protocol_put_quiet");
    let waited = g.wait(&r.stream, None);
    let st = status_of(&status);
    if st == 0 {
        waited.unwrap_or_else(|e| panic!("mode {}: {e}", g.mode().name()));
    }
    let t: Vec<u64> = times.download(0, 3).unwrap();
    (
        st,
        [t[0], t[1], t[2]],
        bad.download::<u32>(0, 1).unwrap()[0],
    )
}

#[test]
fn gpu_first_submission_is_seen_and_completes_in_every_mode() {
    let Some(ctxs) = gpus(1) else { return };
    let mut rng = Rng::new(seed());
    let r = rig(&ctxs[0], &ctxs[0], 1 << 20);
    for mode in modes(&r.me) {
        for placement in [RingPlacement::HostPinned, RingPlacement::Device] {
            let src = r.fill(&mut rng);
            let g = r.group(mode, 3, 256, Duration::from_secs(10), placement);
            let (off, len) = (4096u64, 65536u32);
            let t0 = Instant::now();
            let (st, t, bad) = put_quiet(&r, &g, 2, off, len);
            let what = format!("mode {} rings in {placement:?}", mode.name());
            assert_eq!(st, 0, "{what}: status");
            assert_eq!(
                bad, 0,
                "{what}: the kernel saw wrong bytes right after its quiet"
            );
            assert!(
                r.dst_bytes(off as usize, len as usize) == src[off as usize..][..len as usize],
                "{what}: data"
            );
            let c = g.counters(2).unwrap();
            assert_eq!(
                (c.resv_head, c.ready_head, c.cons_idx),
                (1, 1, 1),
                "{what}: {c:?}"
            );
            let emu = g.emu_status(2).unwrap();
            assert!(
                emu.doorbells >= 1 && emu.cqes_written == 1,
                "{what}: {emu:?}"
            );
            if mode.uses_proxy() {
                assert_eq!(
                    g.proxy().unwrap().last_rung(2),
                    Some(1),
                    "{what}: the proxy did not ring the first publish"
                );
            } else {
                assert_eq!(c.prod_idx, 1, "{what}: the GPU rang");
            }
            eprintln!(
                "{what}: first put+quiet {:.1} µs on the GPU (publish {:.1} µs), {:.2} ms host",
                (t[2] - t[0]) as f64 / 1e3,
                (t[1] - t[0]) as f64 / 1e3,
                t0.elapsed().as_secs_f64() * 1e3
            );
            g.shutdown().expect("clean shutdown");
        }
    }
}

fn heavy_then_barrier(r: &Rig, mode: NicHandler, placement: RingPlacement, rng: &mut Rng) {
    let (blocks, threads, iters, bytes, chunk, batch, nqps) =
        (16u32, 128u32, 12u32, 8192u32, 2048u32, 3u32, 4u32);
    let warps = blocks * threads / 32;
    let data = warps as usize * iters as usize * bytes as usize;
    assert!(data + 4096 <= r.src.len());
    let src = r.fill(rng);
    // A 64-WQEBB ring for 4-WQE submissions from 64 warps: reservations wait for ring space.
    let g = r.group(mode, nqps, 64, Duration::from_secs(20), placement);
    let what = format!("mode {} rings in {placement:?}", mode.name());
    let status = zeroed(&r.ctx, 4);
    let heavy = r.func("protocol_heavy");
    let (descs, raddr, rkey, laddr, sp) = (
        g.descs().unwrap(),
        r.dst.addr(),
        r.dst.mr().rkey,
        r.src.addr(),
        status.ptr(),
    );
    let t0 = Instant::now();
    let mut l = r.stream.launch_builder(&heavy);
    l.arg(&descs)
        .arg(&nqps)
        .arg(&iters)
        .arg(&batch)
        .arg(&raddr)
        .arg(&rkey)
        .arg(&laddr)
        .arg(&bytes)
        .arg(&chunk)
        .arg(&sp);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: protocol_heavy(ibgda_qp_desc*, u32, u32, u32, u64, u32, u64, u32, u32, int*)
    // matches; both arenas hold warps * iters * bytes bytes (asserted above).
    unsafe { l.launch(cfg) }.expect("launch protocol_heavy");
    g.wait(&r.stream, None)
        .unwrap_or_else(|e| panic!("{what}: workload: {e}"));
    assert_eq!(status_of(&status), 0, "{what}: workload status");
    let t_heavy = t0.elapsed();

    // The other submitter: a barrier kernel on the same QPs (upstream: spun forever).
    let counters_off = data as u64;
    let barrier = r.func("protocol_barrier");
    let craddr = raddr + counters_off;
    let mut l = r.stream.launch_builder(&barrier);
    l.arg(&descs).arg(&nqps).arg(&craddr).arg(&rkey).arg(&sp);
    // SAFETY: protocol_barrier(ibgda_qp_desc*, u32, u64, u32, int*) matches; the counters lie
    // inside the destination arena (8 bytes per QP after the data).
    unsafe { l.launch(LaunchConfig::for_num_elems(nqps)) }.expect("launch protocol_barrier");
    g.wait(&r.stream, None)
        .unwrap_or_else(|e| panic!("{what}: barrier: {e}"));
    assert_eq!(status_of(&status), 0, "{what}: barrier status");
    for q in 0..nqps as usize {
        let c = g.counters(q).unwrap();
        assert_eq!(
            c.ready_head, c.resv_head,
            "{what} QP {q}: ready_head != resv_head: {c:?}"
        );
        assert_eq!(c.cons_idx, c.ready_head, "{what} QP {q}: {c:?}");
        let v: Vec<u64> = r
            .dst
            .device()
            .unwrap()
            .download(counters_off as usize + 8 * q, 1)
            .unwrap();
        let poison = u64::from_ne_bytes([0xEE; 8]);
        assert_eq!(
            v[0],
            poison.wrapping_add(1),
            "{what} QP {q}: barrier signal"
        );
    }
    assert!(r.dst_bytes(0, data) == src[..data], "{what}: workload data");
    eprintln!(
        "{what}: {warps} warps x {iters} puts of {bytes} B in {:.1} ms, then the barrier",
        t_heavy.as_secs_f64() * 1e3
    );
    g.shutdown().expect("clean shutdown");
}

#[test]
fn gpu_barrier_after_heavy_workload_completes() {
    let Some(ctxs) = gpus(1) else { return };
    let mut rng = Rng::new(seed());
    let r = rig(&ctxs[0], &ctxs[0], 8 << 20);
    for mode in modes(&r.me) {
        heavy_then_barrier(&r, mode, RingPlacement::HostPinned, &mut rng);
    }
    heavy_then_barrier(
        &r,
        NicHandler::CpuHostMemory,
        RingPlacement::Device,
        &mut rng,
    );
    heavy_then_barrier(&r, NicHandler::Gpu, RingPlacement::Device, &mut rng);
}

#[test]
fn gpu_barrier_after_heavy_workload_across_two_gpus() {
    let Some(ctxs) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    let r = rig(&ctxs[0], &ctxs[1], 8 << 20);
    for mode in [NicHandler::Gpu, NicHandler::CpuHostMemory] {
        // The kernel's own destination check reads the peer GPU; the host check is enough here.
        heavy_then_barrier(&r, mode, RingPlacement::HostPinned, &mut rng);
    }
}

#[test]
fn gpu_lost_reservation_ends_in_the_bounded_ready_wait_error() {
    let Some(ctxs) = gpus(1) else { return };
    let r = rig(&ctxs[0], &ctxs[0], 1 << 16);
    for mode in modes(&r.me) {
        let bound = Duration::from_millis(300);
        let g = r.group(mode, 2, 64, bound, RingPlacement::HostPinned);
        let (st, _, _) = put_quiet(&r, &g, 1, 0, 256);
        assert_eq!(st, 0);
        let lose = r.func("protocol_lose_reservation");
        let (descs, qp, n) = (g.descs().unwrap(), 1u32, 2u32);
        let mut l = r.stream.launch_builder(&lose);
        l.arg(&descs).arg(&qp).arg(&n);
        // SAFETY: protocol_lose_reservation(ibgda_qp_desc*, u32, u32) matches.
        unsafe { l.launch(one_thread()) }.expect("launch protocol_lose_reservation");
        let t0 = Instant::now();
        let (st, _, _) = put_quiet(&r, &g, 1, 512, 256);
        let took = t0.elapsed();
        assert_eq!(
            st,
            ErrorKind::TimeoutReady as i32,
            "mode {}: status",
            mode.name()
        );
        assert!(
            took >= bound && took < bound * 20,
            "mode {}: {took:?}",
            mode.name()
        );
        let e = g.wait(&r.stream, None).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, TransportError::Device { .. }), "{msg}");
        for want in [
            "rank 0",
            "QP 1",
            "resv_head=4",
            "ready_head=1",
            "cons_idx=1",
            mode.name(),
            "ready_head to reach",
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        eprintln!("mode {}: {msg} (after {took:?})", mode.name());
    }
}

#[test]
fn gpu_quiet_waits_for_delayed_completions_in_every_mode() {
    let Some(ctxs) = gpus(1) else { return };
    let mut rng = Rng::new(seed());
    let r = rig(&ctxs[0], &ctxs[0], 1 << 20);
    for mode in modes(&r.me) {
        let src = r.fill(&mut rng);
        let g = r.group(
            mode,
            1,
            64,
            Duration::from_secs(10),
            RingPlacement::HostPinned,
        );
        let delay = Duration::from_millis(100);
        g.nic()
            .set_fault_plan(FaultPlan::default().delay_completions(delay));
        let (st, t, bad) = put_quiet(&r, &g, 0, 0, 1 << 18);
        assert_eq!(st, 0, "mode {}", mode.name());
        let quiet_ns = t[2] - t[1];
        assert!(
            quiet_ns >= delay.as_nanos() as u64 * 9 / 10,
            "mode {}: quiet returned {:.3} ms after the publish, before the delayed completion",
            mode.name(),
            quiet_ns as f64 / 1e6
        );
        assert_eq!(
            bad,
            0,
            "mode {}: data not there when quiet returned",
            mode.name()
        );
        assert!(r.dst_bytes(0, 1 << 18) == src[..1 << 18]);
        assert_eq!(g.counters(0).unwrap().cons_idx, 1);
        g.nic().set_fault_plan(FaultPlan::default());
    }
}

#[test]
fn gpu_producer_slots_are_aligned_u64s_on_both_sides() {
    let Some(ctxs) = gpus(1) else { return };
    let r = rig(&ctxs[0], &ctxs[0], 1 << 16);
    let check = r.func("protocol_check_descs");
    for mode in modes(&r.me) {
        let nqps = 16u32;
        let g = r.group(
            mode,
            nqps,
            64,
            Duration::from_secs(5),
            RingPlacement::HostPinned,
        );
        let descs_dev = g.descs().unwrap();
        let host = download_descs(&r.ctx, descs_dev, nqps as usize);
        for (i, d) in host.iter().enumerate() {
            if mode.uses_proxy() {
                assert_eq!(d.producer_slot % 8, 0, "QP {i}");
                assert_ne!(d.producer_slot, 0, "QP {i}");
            }
            d.validate().unwrap();
            if let Some(cpu) = g.producer_slot_cpu(i) {
                assert_eq!(cpu % 8, 0, "QP {i}: CPU view");
            }
        }
        let status = zeroed(&r.ctx, 4 * nqps as usize);
        let sp = status.ptr();
        let mut l = r.stream.launch_builder(&check);
        l.arg(&descs_dev).arg(&nqps).arg(&sp);
        // SAFETY: protocol_check_descs(ibgda_qp_desc*, u32, int*) matches; `status` holds nqps ints.
        unsafe { l.launch(LaunchConfig::for_num_elems(nqps)) }.unwrap();
        g.wait(&r.stream, None).unwrap();
        assert_eq!(
            status.download::<i32>(0, nqps as usize).unwrap(),
            vec![0; nqps as usize],
            "mode {}",
            mode.name()
        );

        // A descriptor whose slot is misaligned by 4 bytes is refused by the device check too.
        if mode.uses_proxy() {
            let mut bad = host[0];
            bad.producer_slot += 4;
            let one = DeviceBuffer::from_slice(&r.ctx, &[bad]).unwrap();
            let (bp, one_qp) = (one.ptr(), 1u32);
            let mut l = r.stream.launch_builder(&check);
            l.arg(&bp).arg(&one_qp).arg(&sp);
            // SAFETY: as above, one descriptor.
            unsafe { l.launch(one_thread()) }.unwrap();
            let e = g.wait(&r.stream, None).unwrap_err();
            assert_eq!(status_of(&status), ERROR_INVALID_DESC as i32);
            assert!(e.to_string().contains("invalid QP descriptor"), "{e}");
        }
    }
}

/// The descriptors as the device holds them (a copy).
fn download_descs(ctx: &Arc<CudaContext>, dptr: u64, n: usize) -> Vec<QpDesc> {
    let mut out = vec![QpDesc::default(); n];
    ctx.bind_to_thread().unwrap();
    // SAFETY: `dptr` is the group's live descriptor array of `n` entries; `out` holds as many.
    unsafe {
        cudarc::driver::sys::cuMemcpyDtoH_v2(
            out.as_mut_ptr().cast(),
            dptr,
            n * std::mem::size_of::<QpDesc>(),
        )
    }
    .result()
    .unwrap();
    out
}

#[test]
fn gpu_emulator_progresses_while_waiting_kernels_fill_the_gpu() {
    let Some(ctxs) = gpus(1) else { return };
    let mut rng = Rng::new(seed());
    let r = rig(&ctxs[0], &ctxs[0], 1 << 20);
    let fill = r.func("protocol_fill_gpu");
    // Blocks as large as a block can be: the GPU's block scheduler spreads blocks over every
    // SM, so the room left free is the room of a few whole blocks, spread over some SMs. With
    // 256-thread blocks that room was too fragmented for the emulator's GPU agent (one
    // 256-thread block, but with more registers per thread than the fill kernel), which then
    // never started while the waiting blocks held the GPU (H200, 2026-12-02).
    let threads = 1024u32;
    let per_sm = fill
        .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
        .unwrap();
    let sms = r
        .ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap() as u32;
    // Every SM taken by waiting blocks but the emulated NIC's share: the NIC and its target are
    // on this one GPU, and the emulator's same-device copies (and its GPU agent, relaunched after
    // an idle exit) need an SM that no waiting kernel holds (`ep::residency::EMULATED_NIC_SMS`,
    // the room every kernel of the project that waits for the NIC leaves; a real NIC needs none).
    // A GPU filled to the last SM is the configuration `ep` refuses before launch.
    let blocks = (sms - ep::residency::EMULATED_NIC_SMS) * per_sm;
    assert!(8 * blocks as usize <= r.src.len());
    for mode in modes(&r.me) {
        let src = r.fill(&mut rng);
        let nqps = 8u32;
        let g = r.group(
            mode,
            nqps,
            1024,
            Duration::from_secs(30),
            RingPlacement::HostPinned,
        );
        let status = zeroed(&r.ctx, 4);
        let done = zeroed(&r.ctx, 4 * blocks as usize);
        let (descs, raddr, rkey, laddr, sp, dp) = (
            g.descs().unwrap(),
            r.dst.addr(),
            r.dst.mr().rkey,
            r.src.addr(),
            status.ptr(),
            done.ptr(),
        );
        let t0 = Instant::now();
        let mut l = r.stream.launch_builder(&fill);
        l.arg(&descs)
            .arg(&nqps)
            .arg(&raddr)
            .arg(&rkey)
            .arg(&laddr)
            .arg(&sp)
            .arg(&dp);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: protocol_fill_gpu(ibgda_qp_desc*, u32, u64, u32, u64, int*, u32*) matches;
        // 8 bytes per block fit both arenas (asserted) and `done` holds one word per block.
        unsafe { l.launch(cfg) }.expect("launch protocol_fill_gpu");
        g.wait(&r.stream, None)
            .unwrap_or_else(|e| panic!("mode {}: {e}", mode.name()));
        assert_eq!(status_of(&status), 0);
        assert_eq!(
            done.download::<u32>(0, blocks as usize).unwrap(),
            vec![1; blocks as usize]
        );
        let n = 8 * blocks as usize;
        assert!(r.dst_bytes(0, n) == src[..n], "mode {}: data", mode.name());
        eprintln!(
            "mode {}: {blocks} resident blocks ({} of {sms} SMs x {per_sm}) each put+quiet in {:.1} ms",
            mode.name(),
            sms - ep::residency::EMULATED_NIC_SMS,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

#[test]
fn gpu_error_completion_comes_back_as_err_with_the_syndrome() {
    let Some(ctxs) = gpus(1) else { return };
    let r = rig(&ctxs[0], &ctxs[0], 1 << 16);
    for mode in modes(&r.me) {
        let g = r.group(
            mode,
            1,
            64,
            Duration::from_secs(10),
            RingPlacement::HostPinned,
        );
        let status = zeroed(&r.ctx, 4);
        let times = zeroed(&r.ctx, 24);
        let bad = zeroed(&r.ctx, 4);
        let (descs, qp, raddr, rkey, laddr, len, zero) = (
            g.descs().unwrap(),
            0u32,
            r.dst.addr(),
            r.dst.mr().rkey ^ 0x00a5_a5a5,
            r.src.addr(),
            64u32,
            0u64,
        );
        let (sp, tp, bp) = (status.ptr(), times.ptr(), bad.ptr());
        let mut l = r.stream.launch_builder(&r.put);
        l.arg(&descs)
            .arg(&qp)
            .arg(&raddr)
            .arg(&rkey)
            .arg(&laddr)
            .arg(&len)
            .arg(&zero)
            .arg(&zero);
        l.arg(&sp).arg(&tp).arg(&bp);
        // SAFETY: as in `put_quiet`; the wrong rkey makes the emulator fail the write, no memory
        // is touched.
        unsafe { l.launch(one_thread()) }.unwrap();
        let e = g.wait(&r.stream, None).unwrap_err();
        assert_eq!(
            status_of(&status),
            ErrorKind::Cqe as i32,
            "mode {}",
            mode.name()
        );
        let msg = e.to_string();
        for want in [
            "rank 0",
            "QP 0",
            "REMOTE_ACCESS_ERR",
            "RDMA_WRITE",
            mode.name(),
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
    }
}

#[test]
fn gpu_inline_writes_and_signal_adds_land_and_quiet_flushes_batches() {
    let Some(ctxs) = gpus(1) else { return };
    let r = rig(&ctxs[0], &ctxs[0], 1 << 16);
    let small = r.func("protocol_small_ops");
    for mode in modes(&r.me) {
        r.dst.device().unwrap().fill_bytes(0).unwrap();
        let g = r.group(
            mode,
            2,
            64,
            Duration::from_secs(10),
            RingPlacement::HostPinned,
        );
        let status = zeroed(&r.ctx, 4);
        let (descs, qp, raddr, rkey, v4, v8, add, sp) = (
            g.descs().unwrap(),
            1u32,
            r.dst.addr() + 128,
            r.dst.mr().rkey,
            0xA1B2_C3D4u32,
            0x0102_0304_0506_0708u64,
            5u64,
            status.ptr(),
        );
        let mut l = r.stream.launch_builder(&small);
        l.arg(&descs)
            .arg(&qp)
            .arg(&raddr)
            .arg(&rkey)
            .arg(&v4)
            .arg(&v8)
            .arg(&add)
            .arg(&sp);
        // SAFETY: protocol_small_ops(ibgda_qp_desc*, u32, u64, u32, u32, u64, u64, int*)
        // matches; the 24 bytes at raddr lie in the destination arena.
        unsafe { l.launch(one_thread()) }.unwrap();
        g.wait(&r.stream, None)
            .unwrap_or_else(|e| panic!("mode {}: {e}", mode.name()));
        assert_eq!(status_of(&status), 0);
        let d = r.dst.device().unwrap();
        assert_eq!(
            d.download::<u32>(128, 1).unwrap()[0],
            v4,
            "mode {}: inline 4",
            mode.name()
        );
        assert_eq!(
            d.download::<u64>(136, 1).unwrap()[0],
            v8,
            "mode {}: inline 8",
            mode.name()
        );
        assert_eq!(
            d.download::<u64>(144, 1).unwrap()[0],
            add,
            "mode {}: signal add",
            mode.name()
        );
        let c = g.counters(1).unwrap();
        assert_eq!(
            (c.ready_head, c.cons_idx),
            (3, 3),
            "mode {}: {c:?}",
            mode.name()
        );
    }
}
