//! CPU-proxy benchmarks on the emulated NIC (device machine), handler mode `cpu_host_memory`.
//!
//! 1. `proxy_publish_latency`: GPU publish → doorbell rung by the proxy. A one-thread kernel
//!    publishes a NOP (the system-scope max on the producer slot) and spins until the proxy's
//!    doorbell hook writes the new producer index back to pinned host memory; the round trip
//!    minus half a plain GPU→CPU→GPU ping-pong (measured the same way) estimates the one-way
//!    time. A third round trip runs the protocol's publish instruction sequence with a bare CPU
//!    echo in place of the proxy (same ring placement): the proxy's round trip minus that one is
//!    what the proxy and the doorbell path add; the rest is the GPU's publish (its system-scope
//!    release waits for the WQE's stores) and PCIe. Measured with the send ring and CQ in GPU
//!    memory (where the mode places them) and in pinned host memory (the emulator's default).
//!    p50/p99 over `--iters` samples. Target: one-way p50 ≤ 2 µs.
//! 2. `proxy_doorbell_rate`, sink `counter`: the proxy alone. Kernel threads raise 1…64 producer
//!    slots in pinned host memory as fast as they can; the proxy sweeps them and rings a doorbell
//!    that only counts. Doorbells per second over `--ms`. Target: ≥ 5 M/s.
//! 3. `proxy_doorbell_rate`, sink `emulator`: end to end: kernel threads publish NOPs on 1…64 QPs
//!    of the emulated NIC, the proxy rings the emulator (doorbell record, direct doorbell); bounded
//!    by what the emulator executes.
//!
//! `bench_proxy [--json PATH] [--iters N] [--qps 1,2,4,8,16,32,64] [--ms N]
//!  [--proxy-threads 1,4] [--nops N]`
//!
//! Exits with status 2 when no GPU is visible.

use ep_examples::bench::{json_num, percentile, utc_timestamp as date_utc};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use ep::transport::{wait_stream, DoorbellHook, EmuRank, QpGroupConfig, RingPlacement};
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::proxy::{ProducerSlot, Proxy, ProxyConfig, ProxyQp};
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::{Fabric, HostBuffer};

const MODULE: &str = "tests/protocol";

struct Args {
    json: Option<String>,
    iters: u32,
    qps: Vec<u32>,
    ms: u64,
    proxy_threads: Vec<usize>,
    nops: u32,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        json: None,
        iters: 20_000,
        qps: vec![1, 2, 4, 8, 16, 32, 64],
        ms: 300,
        proxy_threads: vec![1, 4],
        nops: 4000,
    };
    let mut it = std::env::args().skip(1);
    let list = |s: String| -> Result<Vec<u64>> {
        s.split(',')
            .map(|x| x.trim().parse().context("bad number"))
            .collect()
    };
    while let Some(f) = it.next() {
        let mut v = || it.next().with_context(|| format!("{f} needs a value"));
        match f.as_str() {
            "--json" => a.json = Some(v()?),
            "--iters" => a.iters = v()?.parse()?,
            "--qps" => a.qps = list(v()?)?.into_iter().map(|x| x as u32).collect(),
            "--ms" => a.ms = v()?.parse()?,
            "--proxy-threads" => {
                a.proxy_threads = list(v()?)?.into_iter().map(|x| x as usize).collect()
            }
            "--nops" => a.nops = v()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    if a.qps.iter().any(|&q| q == 0 || q > 1024) {
        bail!("--qps: values in 1..=1024");
    }
    Ok(a)
}

fn sorted_us(ns: &[u64]) -> Vec<f64> {
    let mut v: Vec<f64> = ns.iter().map(|&x| x as f64 / 1e3).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

/// A word of pinned host memory the GPU polls or writes, with its device address.
fn pinned(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Arc<HostBuffer>> {
    let b = HostBuffer::pinned(ctx, bytes).context("pinned host memory")?;
    Ok(Arc::new(b))
}

fn dev_addr(b: &HostBuffer) -> Result<u64> {
    b.device_addr()
        .context("pinned memory has no device address")
}

/// The GPU side of one protocol publish with no proxy behind it, as a ping-pong: for
/// `i = 1..=iters`, one thread writes a 64-byte record into ring slot `i % nslots` (four 16-byte
/// stores, as `ibgda_wqebb_store`), then publishes `i` exactly as `ibgda_publish` does for one
/// WQEBB (`membar.gl`; acquire load and release store of a head word in GPU memory;
/// `red.release.sys.max` on the producer slot), and spins until `*ack >= i`. A CPU thread echoes
/// the slot into `ack`. `rtt[i-1]` is timed from just before the publish, like
/// `protocol_bench_rtt`, so the proxy's round trip minus this one is what the proxy and the
/// doorbell add. `*status = 1` if an ack takes longer than `limit_ns`.
const PUBLISH_PINGPONG_PTX: &str = r#"
.version 7.8
.target sm_80
.address_size 64

.visible .entry publish_pingpong(
    .param .u64 p_ring,
    .param .u32 p_nslots,
    .param .u64 p_head,
    .param .u64 p_slot,
    .param .u64 p_ack,
    .param .u32 p_iters,
    .param .u64 p_rtt,
    .param .u64 p_limit,
    .param .u64 p_status
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<20>;

    ld.param.u64 %rd1, [p_ring];
    ld.param.u32 %r1, [p_nslots];
    ld.param.u64 %rd2, [p_head];
    ld.param.u64 %rd3, [p_slot];
    ld.param.u64 %rd4, [p_ack];
    ld.param.u32 %r2, [p_iters];
    ld.param.u64 %rd5, [p_rtt];
    ld.param.u64 %rd6, [p_limit];
    ld.param.u64 %rd7, [p_status];
    mov.u32 %r3, 1;
    sub.u32 %r4, %r1, 1;
LOOP:
    setp.gt.u32 %p1, %r3, %r2;
    @%p1 bra DONE;
    and.b32 %r5, %r3, %r4;
    mul.wide.u32 %rd8, %r5, 64;
    add.u64 %rd9, %rd1, %rd8;
    cvt.u64.u32 %rd10, %r3;
    st.v4.u32 [%rd9], {%r3, %r3, %r3, %r3};
    st.v4.u32 [%rd9+16], {%r3, %r3, %r3, %r3};
    st.v4.u32 [%rd9+32], {%r3, %r3, %r3, %r3};
    st.v4.u32 [%rd9+48], {%r3, %r3, %r3, %r3};
    mov.u64 %rd11, %globaltimer;
    membar.gl;
    ld.acquire.gpu.u64 %rd12, [%rd2];
    st.release.gpu.u64 [%rd2], %rd10;
    red.release.sys.max.u64 [%rd3], %rd10;
POLL:
    ld.relaxed.sys.u64 %rd13, [%rd4];
    setp.ge.u64 %p2, %rd13, %rd10;
    @%p2 bra GOT;
    mov.u64 %rd14, %globaltimer;
    sub.u64 %rd15, %rd14, %rd11;
    setp.gt.u64 %p3, %rd15, %rd6;
    @%p3 bra TIMEOUT;
    bra.uni POLL;
GOT:
    mov.u64 %rd14, %globaltimer;
    sub.u64 %rd15, %rd14, %rd11;
    sub.u32 %r6, %r3, 1;
    mul.wide.u32 %rd16, %r6, 8;
    add.u64 %rd17, %rd5, %rd16;
    st.u64 [%rd17], %rd15;
    add.u32 %r3, %r3, 1;
    bra.uni LOOP;
TIMEOUT:
    mov.u32 %r7, 1;
    st.u32 [%rd7], %r7;
DONE:
    ret;
}
"#;

/// Ring slots the publish ping-pong cycles through (a power of two).
const PINGPONG_SLOTS: u32 = 64;

/// Where the latency run puts the QP's send ring and CQ.
fn placement_name(p: RingPlacement) -> &'static str {
    match p {
        RingPlacement::Device => "device",
        RingPlacement::HostPinned => "host_pinned",
    }
}

struct Latency {
    placement: RingPlacement,
    /// Publish → proxy doorbell → hook → GPU sees the ack.
    rtt_ns: Vec<u64>,
    /// `st.relaxed.sys` ping, CPU echo, GPU sees the ack.
    pingpong_ns: Vec<u64>,
    /// The protocol's publish (same ring placement), CPU echo of the slot, GPU sees the ack; or
    /// why that measurement failed.
    publish_pingpong_ns: std::result::Result<Vec<u64>, String>,
}

/// A CPU thread that copies `from` (word 0) into `to` (word 0) whenever it changes, until
/// `stop` (at most 60 s).
fn echo(
    from: Arc<HostBuffer>,
    to: Arc<HostBuffer>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut last = 0;
        let mut n = 0u32;
        while !stop.load(Ordering::Relaxed) {
            let v = from.load_u64(0);
            if v != last {
                to.store_u64(0, v);
                last = v;
            }
            n = n.wrapping_add(1);
            if n % 4096 == 0 && t0.elapsed() > Duration::from_secs(60) {
                break;
            }
            std::hint::spin_loop();
        }
    })
}

fn measure_latency(
    ctx: &Arc<CudaContext>,
    iters: u32,
    placement: RingPlacement,
) -> Result<Latency> {
    let fabric = Fabric::new();
    let me = EmuRank::cuda(&fabric, ctx, 0)?;
    let peer = EmuRank::cuda(&fabric, ctx, 1)?;
    let src = me.arena(4096)?;
    let ack = pinned(ctx, 64)?;
    let hook_ack = ack.clone();
    let cfg = QpGroupConfig {
        handler: NicHandler::CpuHostMemory,
        nqps: 1,
        nwqes: 1024,
        timeout: Duration::from_secs(10),
        placement,
        peer_rank: 1,
        on_doorbell: Some(DoorbellHook(Arc::new(move |_qp, pi| {
            hook_ack.store_u64(0, pi)
        }))),
        ..Default::default()
    };
    let group = me.connect(&peer, &src, &cfg)?;
    let f = ep_kernels::load_function(ctx, MODULE, "protocol_bench_rtt")?;
    let stream = ctx.new_stream()?;
    let status = DeviceBuffer::new(ctx, 4)?;
    status.fill_bytes(0)?;
    let rtt = DeviceBuffer::new(ctx, 8 * iters as usize)?;
    let ping = pinned(ctx, 64)?;
    let pp_ack = pinned(ctx, 64)?;

    let run = |pingpong: u32, ack_dev: u64| -> Result<()> {
        let (descs, qp, ping_dev, rp, sp) = (
            group.descs().context("descriptors")?,
            0u32,
            dev_addr(&ping)?,
            rtt.ptr(),
            status.ptr(),
        );
        let mut l = stream.launch_builder(&f);
        l.arg(&descs)
            .arg(&qp)
            .arg(&iters)
            .arg(&pingpong)
            .arg(&ping_dev)
            .arg(&ack_dev)
            .arg(&rp)
            .arg(&sp);
        // SAFETY: protocol_bench_rtt(ibgda_qp_desc*, u32, u32, u32, u64*, const u64*, u64*, int*)
        // matches; `ping` and the ack are live pinned words, `rtt` holds `iters` u64s.
        unsafe { l.launch(ONE_THREAD) }.context("launch protocol_bench_rtt")?;
        Ok(())
    };

    // The protocol round trip, through the proxy.
    run(0, dev_addr(&ack)?)?;
    group.wait(&stream, Some(Duration::from_secs(60)))?;
    let st: i32 = status.download(0, 1)?[0];
    if st != 0 {
        bail!("latency kernel stopped with status {st}");
    }
    let rtt_ns: Vec<u64> = rtt.download(0, iters as usize)?;

    // The plain PCIe round trip: a host thread echoes `ping` into `pp_ack`.
    let pp_ack_dev = dev_addr(&pp_ack)?;
    let stop = Arc::new(AtomicBool::new(false));
    let echoing = echo(ping.clone(), pp_ack.clone(), stop.clone());
    let waited = run(1, pp_ack_dev)
        .and_then(|()| wait_stream(&stream, Duration::from_secs(60)).map_err(anyhow::Error::from));
    stop.store(true, Ordering::Relaxed);
    let _ = echoing.join();
    waited?;
    let pingpong_ns: Vec<u64> = rtt.download(0, iters as usize)?;

    // The protocol's publish with a CPU echo instead of the proxy, rings placed the same way.
    let publish_pingpong_ns =
        measure_publish_pingpong(ctx, &stream, &rtt, &status, iters, placement)
            .map_err(|e| format!("{e:#}"));
    group.shutdown()?;
    // Drop warm-up samples (first touches, clocks ramping).
    let skip = (iters as usize / 20).min(500);
    Ok(Latency {
        placement,
        rtt_ns: rtt_ns[skip..].to_vec(),
        pingpong_ns: pingpong_ns[skip..].to_vec(),
        publish_pingpong_ns: publish_pingpong_ns.map(|v| v[skip..].to_vec()),
    })
}

/// The round trip of [`PUBLISH_PINGPONG_PTX`]: the protocol's publish with a bare CPU echo of the
/// producer slot, the ring placed like the QP's. `rtt` (at least `iters` u64s) and `status` are
/// reused from the proxy run.
fn measure_publish_pingpong(
    ctx: &Arc<CudaContext>,
    stream: &Arc<cudarc::driver::CudaStream>,
    rtt: &DeviceBuffer,
    status: &DeviceBuffer,
    iters: u32,
    placement: RingPlacement,
) -> Result<Vec<u64>> {
    let ring_bytes = PINGPONG_SLOTS as usize * 64;
    let (ring_dev, _ring_keep): (u64, Box<dyn std::any::Any>) = match placement {
        RingPlacement::Device => {
            let b = DeviceBuffer::new(ctx, ring_bytes)?;
            (b.ptr(), Box::new(b))
        }
        RingPlacement::HostPinned => {
            let b = pinned(ctx, ring_bytes)?;
            (dev_addr(&b)?, Box::new(b))
        }
    };
    let head = DeviceBuffer::new(ctx, 8)?;
    head.fill_bytes(0)?;
    let slot = pinned(ctx, 64)?;
    let slot_ack = pinned(ctx, 64)?;
    status.fill_bytes(0)?;
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(PUBLISH_PINGPONG_PTX))
        .context("JIT-compiling the publish ping-pong kernel")?;
    let pf = module
        .load_function("publish_pingpong")
        .context("publish_pingpong")?;
    let (nslots, head_dev, slot_dev, ack_dev, rp, limit, sp) = (
        PINGPONG_SLOTS,
        head.ptr(),
        dev_addr(&slot)?,
        dev_addr(&slot_ack)?,
        rtt.ptr(),
        10_000_000_000u64,
        status.ptr(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let echoing = echo(slot.clone(), slot_ack.clone(), stop.clone());
    let mut l = stream.launch_builder(&pf);
    l.arg(&ring_dev)
        .arg(&nslots)
        .arg(&head_dev)
        .arg(&slot_dev)
        .arg(&ack_dev)
        .arg(&iters)
        .arg(&rp)
        .arg(&limit)
        .arg(&sp);
    // SAFETY: publish_pingpong(u64, u32, u64, u64, u64, u32, u64, u64, u64) matches the PTX
    // entry; the ring holds PINGPONG_SLOTS 64-byte slots, `head` one u64 of GPU memory,
    // `slot` and `slot_ack` live pinned words, `rtt` `iters` u64s, `status` one u32.
    let launched = unsafe { l.launch(ONE_THREAD) }.context("launch publish_pingpong");
    let waited = launched
        .and_then(|_| wait_stream(stream, Duration::from_secs(60)).map_err(anyhow::Error::from));
    stop.store(true, Ordering::Relaxed);
    let _ = echoing.join();
    waited?;
    let st: i32 = status.download(0, 1)?[0];
    if st != 0 {
        bail!("publish ping-pong kernel timed out waiting for the echo");
    }
    Ok(rtt.download(0, iters as usize)?)
}

/// One thread, for the latency kernels.
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// Doorbells per second of a bare proxy over `nqps` slots raised by the GPU, and the GPU's own
/// raise rate, both in millions per second.
fn measure_counter_rate(
    ctx: &Arc<CudaContext>,
    nqps: u32,
    threads: usize,
    ms: u64,
) -> Result<(f64, f64)> {
    let slots = pinned(ctx, 8 * nqps as usize)?;
    let stop = pinned(ctx, 64)?;
    let raised = DeviceBuffer::new(ctx, 8 * nqps as usize)?;
    let qps = (0..nqps)
        .map(|q| {
            let keep = slots.clone();
            Ok(ProxyQp {
                // SAFETY: the slot lies in `slots`, kept alive by the doorbell closure below for
                // as long as the proxy thread holds it; the GPU writes it as whole words.
                slot: unsafe {
                    ProducerSlot::new((slots.addr() + 8 * u64::from(q)) as *const u64)
                }?,
                doorbell: Box::new(move |_pi: u64| {
                    let _ = &keep;
                }),
                rung_from: 0,
                rank: 0,
                qp_index: q,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let proxy = Proxy::start(
        qps,
        ProxyConfig {
            threads,
            ..Default::default()
        },
    )?;
    let f = ep_kernels::load_function(ctx, MODULE, "protocol_bench_slots")?;
    let stream = ctx.new_stream()?;
    let (sp, stp, rp, limit) = (
        dev_addr(&slots)?,
        dev_addr(&stop)?,
        raised.ptr(),
        10_000_000_000u64,
    );
    let mut l = stream.launch_builder(&f);
    l.arg(&sp).arg(&nqps).arg(&stp).arg(&limit).arg(&rp);
    let launched = Instant::now();
    // SAFETY: protocol_bench_slots(u64*, u32, const u32*, u64, u64*) matches; `slots` holds
    // nqps words, `raised` as many.
    unsafe { l.launch(LaunchConfig::for_num_elems(nqps)) }
        .context("launch protocol_bench_slots")?;
    std::thread::sleep(Duration::from_millis(30));
    let (d0, t0) = (proxy.doorbells(), Instant::now());
    std::thread::sleep(Duration::from_millis(ms));
    let (d1, t1) = (proxy.doorbells(), Instant::now());
    stop.store_u32(0, 1);
    let ran = launched.elapsed();
    wait_stream(&stream, Duration::from_secs(30))?;
    proxy.stop()?;
    let raised_sum: u64 = raised.download::<u64>(0, nqps as usize)?.iter().sum();
    Ok((
        (d1 - d0) as f64 / (t1 - t0).as_secs_f64() / 1e6,
        raised_sum as f64 / ran.as_secs_f64() / 1e6,
    ))
}

/// End to end on the emulated NIC: (doorbells per second, publishes per second), in millions.
fn measure_emulator_rate(ctx: &Arc<CudaContext>, nqps: u32, nops: u32) -> Result<(f64, f64)> {
    let fabric = Fabric::new();
    let me = EmuRank::cuda(&fabric, ctx, 0)?;
    let peer = EmuRank::cuda(&fabric, ctx, 1)?;
    let src = me.arena(4096)?;
    let cfg = QpGroupConfig {
        handler: NicHandler::CpuHostMemory,
        nqps,
        nwqes: 1024,
        timeout: Duration::from_secs(30),
        peer_rank: 1,
        ..Default::default()
    };
    let group = me.connect(&peer, &src, &cfg)?;
    let f = ep_kernels::load_function(ctx, MODULE, "protocol_bench_publish")?;
    let stream = ctx.new_stream()?;
    let status = DeviceBuffer::new(ctx, 4)?;
    status.fill_bytes(0)?;
    let (descs, sp) = (group.descs().context("descriptors")?, status.ptr());
    let d0 = group.proxy().map(Proxy::doorbells).unwrap_or(0);
    let t0 = Instant::now();
    let mut l = stream.launch_builder(&f);
    l.arg(&descs).arg(&nqps).arg(&nops).arg(&sp);
    // SAFETY: protocol_bench_publish(ibgda_qp_desc*, u32, u32, int*) matches.
    unsafe { l.launch(LaunchConfig::for_num_elems(nqps)) }
        .context("launch protocol_bench_publish")?;
    group.wait(&stream, Some(Duration::from_secs(120)))?;
    let secs = t0.elapsed().as_secs_f64();
    let st: i32 = status.download(0, 1)?[0];
    if st != 0 {
        bail!("publish kernel stopped with status {st}");
    }
    let d1 = group.proxy().map(Proxy::doorbells).unwrap_or(0);
    group.shutdown()?;
    Ok((
        (d1 - d0) as f64 / secs / 1e6,
        f64::from(nqps) * f64::from(nops) / secs / 1e6,
    ))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let a = parse()?;
    match ibgda_device::cuda::device_count() {
        Ok(0) => {
            eprintln!(
                "bench_proxy: no CUDA GPU is visible on this machine; run it on a GPU machine"
            );
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("bench_proxy: {e}");
            std::process::exit(2);
        }
        Ok(_) => {}
    }
    let ctx = ibgda_device::cuda::context(0)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let machine = format!(
        "{} ({} cores), {}",
        ctx.name().unwrap_or_default(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        host.trim()
    );
    let date = date_utc();
    let mut records = Vec::new();

    println!("bench_proxy on {machine}, emulated NIC, mode cpu_host_memory");
    // A failed measurement is reported in its table and fails the run at the end; the others
    // still run and the JSON is still written.
    let mut failures: Vec<String> = Vec::new();

    // Rings in GPU memory first: where the cpu_host_memory mode puts them (and hardware reads
    // them); then in pinned host memory, the emulator's default.
    for placement in [RingPlacement::Device, RingPlacement::HostPinned] {
        let name = placement_name(placement);
        let lat = match measure_latency(&ctx, a.iters, placement) {
            Ok(l) => l,
            Err(e) => {
                println!("\npublish -> doorbell, rings {name}: FAILED: {e:#}");
                failures.push(format!("latency, rings {name}: {e:#}"));
                continue;
            }
        };
        let rtt = sorted_us(&lat.rtt_ns);
        let pp = sorted_us(&lat.pingpong_ns);
        let floor = lat.publish_pingpong_ns.as_deref().map(sorted_us);
        let half_pp = percentile(&pp, 0.5) / 2.0;
        let mut one_way: Vec<f64> = rtt.iter().map(|r| r - half_pp).collect();
        one_way.sort_by(|x, y| x.total_cmp(y));
        let (p50, p99) = (percentile(&one_way, 0.5), percentile(&one_way, 0.99));
        // The proxy's and the doorbell's share: NaN (JSON null) if the baseline failed.
        let at = |p: f64| floor.as_deref().map_or(f64::NAN, |f| percentile(f, p));
        let (floor50, floor99) = (at(0.5), at(0.99));
        let share50 = percentile(&rtt, 0.5) - floor50;
        let share99 = percentile(&rtt, 0.99) - floor99;
        println!(
            "\npublish -> doorbell rung by the proxy, send ring and CQ in {} ({} samples)",
            match lat.placement {
                RingPlacement::Device => "GPU memory (as the mode places them)",
                RingPlacement::HostPinned => "pinned host memory",
            },
            rtt.len()
        );
        println!("  {:<46} {:>9} {:>9}", "", "p50 µs", "p99 µs");
        let row = |label: &str, v: &[f64]| {
            println!(
                "  {label:<46} {:>9.2} {:>9.2}",
                percentile(v, 0.5),
                percentile(v, 0.99)
            )
        };
        row("round trip via proxy", &rtt);
        row("plain GPU-CPU-GPU ping-pong", &pp);
        match &floor {
            Ok(f) => row("publish ping-pong, CPU echo, no proxy", f),
            Err(e) => {
                println!("  publish ping-pong, CPU echo, no proxy: FAILED: {e}");
                failures.push(format!("publish ping-pong, rings {name}: {e}"));
            }
        }
        println!(
            "  {:<46} {:>9.2} {:>9.2}   (target p50 <= 2)",
            "one way (round trip - ping-pong/2)", p50, p99
        );
        if floor.is_ok() {
            println!(
                "  {:<46} {:>9.2} {:>9.2}",
                "proxy + doorbell (round trip - publish p-p)", share50, share99
            );
        }
        records.push(format!(
            "{{\"bench\": \"proxy_publish_latency\", \"mode\": \"cpu_host_memory\", \"rings\": \"{name}\", \"qps\": 1, \"p50_us\": {p50:.3}, \"p99_us\": {p99:.3}, \"rtt_p50_us\": {:.3}, \"rtt_p99_us\": {:.3}, \"pingpong_p50_us\": {:.3}, \"publish_pingpong_p50_us\": {}, \"publish_pingpong_p99_us\": {}, \"proxy_share_p50_us\": {}, \"proxy_share_p99_us\": {}, \"samples\": {}, \"date\": \"{date}\", \"machine\": \"{machine}\"}}",
            percentile(&rtt, 0.5),
            percentile(&rtt, 0.99),
            percentile(&pp, 0.5),
            json_num(floor50),
            json_num(floor99),
            json_num(share50),
            json_num(share99),
            rtt.len()
        ));
    }

    println!("\nproxy doorbells/s (millions), GPU raising producer slots; sink: counter");
    println!(
        "  {:>5} {:>8} {:>12} {:>16}",
        "QPs", "threads", "M doorbells/s", "GPU M raises/s"
    );
    for &q in &a.qps {
        for &t in &a.proxy_threads {
            if t > q as usize {
                continue;
            }
            match measure_counter_rate(&ctx, q, t, a.ms) {
                Ok((rate, raises)) => {
                    println!("  {q:>5} {t:>8} {rate:>12.2} {raises:>16.2}");
                    records.push(format!(
                        "{{\"bench\": \"proxy_doorbell_rate\", \"mode\": \"cpu_host_memory\", \"sink\": \"counter\", \"qps\": {q}, \"proxy_threads\": {t}, \"mdoorbells_per_s\": {rate:.3}, \"gpu_mraises_per_s\": {raises:.3}, \"date\": \"{date}\", \"machine\": \"{machine}\"}}"
                    ));
                }
                Err(e) => {
                    println!("  {q:>5} {t:>8} FAILED: {e:#}");
                    failures.push(format!("counter rate, {q} QPs, {t} threads: {e:#}"));
                }
            }
        }
    }

    println!("\nend to end on the emulated NIC: NOP publishes, proxy -> emulator; sink: emulator");
    println!(
        "  {:>5} {:>14} {:>16}",
        "QPs", "M doorbells/s", "M publishes/s"
    );
    for &q in &a.qps {
        match measure_emulator_rate(&ctx, q, a.nops) {
            Ok((rate, pubs)) => {
                println!("  {q:>5} {rate:>14.3} {pubs:>16.3}");
                records.push(format!(
                    "{{\"bench\": \"proxy_doorbell_rate\", \"mode\": \"cpu_host_memory\", \"sink\": \"emulator\", \"qps\": {q}, \"proxy_threads\": 1, \"mdoorbells_per_s\": {rate:.3}, \"mpublishes_per_s\": {pubs:.3}, \"date\": \"{date}\", \"machine\": \"{machine}\"}}"
                ));
            }
            Err(e) => {
                println!("  {q:>5} FAILED: {e:#}");
                failures.push(format!("emulator rate, {q} QPs: {e:#}"));
            }
        }
    }

    let json = format!("[\n  {}\n]\n", records.join(",\n  "));
    if let Some(p) = &a.json {
        std::fs::write(p, json).with_context(|| format!("writing {p}"))?;
        println!("\nJSON: {p}");
    }
    if !failures.is_empty() {
        bail!(
            "{} measurement(s) failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    Ok(())
}
