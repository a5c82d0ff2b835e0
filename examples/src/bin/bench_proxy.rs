//! CPU-proxy benchmarks on the emulated NIC (device machine), handler mode `cpu_host_memory`.
//!
//! 1. `proxy_publish_latency`: GPU publish → doorbell rung by the proxy. A one-thread kernel
//!    publishes a NOP (the system-scope max on the producer slot) and spins until the proxy's
//!    doorbell hook writes the new producer index back to pinned host memory; the round trip
//!    minus half a plain GPU→CPU→GPU ping-pong (measured the same way) estimates the one-way
//!    time. p50/p99 over `--iters` samples. Target: p50 ≤ 2 µs.
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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use ep::transport::{wait_stream, DoorbellHook, EmuRank, QpGroupConfig};
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

fn date_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = (secs / 86400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let s = secs % 86400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
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

struct Latency {
    rtt_ns: Vec<u64>,
    pingpong_ns: Vec<u64>,
}

fn measure_latency(ctx: &Arc<CudaContext>, iters: u32) -> Result<Latency> {
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
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: protocol_bench_rtt(ibgda_qp_desc*, u32, u32, u32, u64*, const u64*, u64*, int*)
        // matches; `ping` and the ack are live pinned words, `rtt` holds `iters` u64s.
        unsafe { l.launch(one) }.context("launch protocol_bench_rtt")?;
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
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let (ping, pp_ack, stop) = (ping.clone(), pp_ack.clone(), stop.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut last = 0;
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(60) {
                let v = ping.load_u64(0);
                if v != last {
                    pp_ack.store_u64(0, v);
                    last = v;
                }
                std::hint::spin_loop();
            }
        })
    };
    run(1, dev_addr(&pp_ack)?)?;
    let waited = wait_stream(&stream, Duration::from_secs(60));
    stop.store(true, Ordering::Relaxed);
    let _ = echo.join();
    waited?;
    let pingpong_ns: Vec<u64> = rtt.download(0, iters as usize)?;
    group.shutdown()?;
    // Drop warm-up samples (first touches, clocks ramping).
    let skip = (iters as usize / 20).min(500);
    Ok(Latency {
        rtt_ns: rtt_ns[skip..].to_vec(),
        pingpong_ns: pingpong_ns[skip..].to_vec(),
    })
}

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
    let lat = measure_latency(&ctx, a.iters)?;
    let rtt = sorted_us(&lat.rtt_ns);
    let pp = sorted_us(&lat.pingpong_ns);
    let half_pp = percentile(&pp, 0.5) / 2.0;
    let mut one_way: Vec<f64> = rtt.iter().map(|r| r - half_pp).collect();
    one_way.sort_by(|x, y| x.total_cmp(y));
    let (p50, p99) = (percentile(&one_way, 0.5), percentile(&one_way, 0.99));
    println!(
        "\npublish -> doorbell rung by the proxy ({} samples)",
        rtt.len()
    );
    println!("  {:<34} {:>9} {:>9}", "", "p50 µs", "p99 µs");
    println!(
        "  {:<34} {:>9.2} {:>9.2}",
        "round trip via proxy",
        percentile(&rtt, 0.5),
        percentile(&rtt, 0.99)
    );
    println!(
        "  {:<34} {:>9.2} {:>9.2}",
        "plain GPU-CPU-GPU ping-pong",
        percentile(&pp, 0.5),
        percentile(&pp, 0.99)
    );
    println!(
        "  {:<34} {:>9.2} {:>9.2}   (target p50 <= 2)",
        "one way (round trip - ping-pong/2)", p50, p99
    );
    records.push(format!(
        "{{\"bench\": \"proxy_publish_latency\", \"mode\": \"cpu_host_memory\", \"qps\": 1, \"p50_us\": {p50:.3}, \"p99_us\": {p99:.3}, \"rtt_p50_us\": {:.3}, \"rtt_p99_us\": {:.3}, \"pingpong_p50_us\": {:.3}, \"samples\": {}, \"date\": \"{date}\", \"machine\": \"{machine}\"}}",
        percentile(&rtt, 0.5),
        percentile(&rtt, 0.99),
        percentile(&pp, 0.5),
        rtt.len()
    ));

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
            let (rate, raises) = measure_counter_rate(&ctx, q, t, a.ms)?;
            println!("  {q:>5} {t:>8} {rate:>12.2} {raises:>16.2}");
            records.push(format!(
                "{{\"bench\": \"proxy_doorbell_rate\", \"mode\": \"cpu_host_memory\", \"sink\": \"counter\", \"qps\": {q}, \"proxy_threads\": {t}, \"mdoorbells_per_s\": {rate:.3}, \"gpu_mraises_per_s\": {raises:.3}, \"date\": \"{date}\", \"machine\": \"{machine}\"}}"
            ));
        }
    }

    println!("\nend to end on the emulated NIC: NOP publishes, proxy -> emulator; sink: emulator");
    println!(
        "  {:>5} {:>14} {:>16}",
        "QPs", "M doorbells/s", "M publishes/s"
    );
    for &q in &a.qps {
        let (rate, pubs) = measure_emulator_rate(&ctx, q, a.nops)?;
        println!("  {q:>5} {rate:>14.3} {pubs:>16.3}");
        records.push(format!(
            "{{\"bench\": \"proxy_doorbell_rate\", \"mode\": \"cpu_host_memory\", \"sink\": \"emulator\", \"qps\": {q}, \"proxy_threads\": 1, \"mdoorbells_per_s\": {rate:.3}, \"mpublishes_per_s\": {pubs:.3}, \"date\": \"{date}\", \"machine\": \"{machine}\"}}"
        ));
    }

    let json = format!("[\n  {}\n]\n", records.join(",\n  "));
    if let Some(p) = &a.json {
        std::fs::write(p, json).with_context(|| format!("writing {p}"))?;
        println!("\nJSON: {p}");
    }
    Ok(())
}
