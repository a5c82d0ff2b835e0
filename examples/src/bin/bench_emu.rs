//! Benchmark of the emulated NIC between two GPUs: RDMA-write bandwidth from 4 KiB to 16 MiB over
//! 1 and 8 QPs, and doorbell-to-CQE latency of an 8-byte write.
//!
//! `bench_emu [--json PATH] [--quick]`. Prints a table; with `--json`, writes one record per
//! measurement: `{"bench": "emu_write_bw" | "emu_write_latency", "qps", "bytes", "gbps", "us",
//! "date", "machine"}`. Exits with status 2 and a message when fewer than two GPUs are visible.
//!
//! Setup: one CUDA NIC per GPU in one fabric; send rings, CQs and doorbell records in pinned host
//! memory (written here, as a CPU proxy would); sources in GPU 0's memory, destinations in GPU 1's.
//! Bandwidth: each QP posts a batch of writes (only the last signalled), all QPs ring, and the
//! time runs from the first doorbell to the last CQE. Latency: one write at a time, from the
//! doorbell-record store to the CQE seen by this thread.

use ep_examples::bench::{json_str, utc_timestamp as utc_now};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ibgda_device::cuda::{enable_peer_access, DeviceBuffer};
use ibgda_device::wire::{Cqe64, RdmaWrite, RemoteAddr, Sge};
use ibgda_emu::{Access, CqMode, Fabric, HostQp, Mr, NicConfig};

const MAX_QPS: usize = 8;
const MAX_BYTES: usize = 16 << 20;
const RING: u32 = 1024;
const TIMEOUT: Duration = Duration::from_secs(60);

struct Record {
    bench: &'static str,
    qps: usize,
    bytes: usize,
    gbps: f64,
    us: f64,
}

fn wait_cqe(qp: &HostQp, cons: u64) -> Result<Cqe64> {
    let t0 = Instant::now();
    loop {
        if let Some(c) = qp.poll_cqe(cons) {
            if c.is_error() {
                bail!("error completion on QP {:#x}: {c}", qp.qpn());
            }
            return Ok(c);
        }
        if t0.elapsed() > TIMEOUT {
            bail!("no CQE {cons} on QP {:#x} within {TIMEOUT:?}", qp.qpn());
        }
        std::hint::spin_loop();
    }
}

/// A QP with its producer and consumer positions.
struct Lane {
    qp: HostQp,
    pi: u64,
    cons: u64,
    dst_off: u64,
}

impl Lane {
    fn post_writes(&mut self, n: usize, bytes: usize, src: &Mr, dst: &Mr) {
        for k in 0..n {
            let w = RdmaWrite::new(
                self.qp.qpn(),
                self.pi as u16,
                RemoteAddr {
                    addr: dst.addr + self.dst_off,
                    rkey: dst.rkey,
                },
                Sge {
                    addr: src.addr,
                    len: bytes as u32,
                    lkey: src.lkey,
                },
            )
            .cqe(k + 1 == n)
            .build();
            self.qp.post(self.pi, &w);
            self.pi += 1;
        }
    }
}

fn bandwidth(lanes: &mut [Lane], bytes: usize, src: &Mr, dst: &Mr, reps: usize) -> Result<f64> {
    // Enough writes per QP to run for a while, never more than the ring holds.
    let n = ((256usize << 20) / bytes).clamp(8, RING as usize);
    let mut best = f64::MAX;
    for rep in 0..=reps {
        for l in lanes.iter_mut() {
            l.post_writes(n, bytes, src, dst);
        }
        let t0 = Instant::now();
        for l in lanes.iter() {
            l.qp.ring_dbr(l.pi);
        }
        for l in lanes.iter_mut() {
            wait_cqe(&l.qp, l.cons)?;
            l.cons += 1;
        }
        let t = t0.elapsed().as_secs_f64();
        if rep > 0 {
            best = best.min(t);
        }
    }
    Ok((lanes.len() * n * bytes) as f64 / best / 1e9)
}

fn latency(lane: &mut Lane, src: &Mr, dst: &Mr, iters: usize) -> Result<Vec<f64>> {
    let mut us = Vec::with_capacity(iters);
    for i in 0..iters + 100 {
        lane.post_writes(1, 8, src, dst);
        let t0 = Instant::now();
        lane.qp.ring_dbr(lane.pi);
        wait_cqe(&lane.qp, lane.cons)?;
        let t = t0.elapsed();
        lane.cons += 1;
        if i >= 100 {
            us.push(t.as_secs_f64() * 1e6);
        }
    }
    us.sort_by(|a, b| a.total_cmp(b));
    Ok(us)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .iter()
        .position(|a| a == "--json")
        .map(|i| args.get(i + 1).cloned().context("--json needs a path"))
        .transpose()?;
    let quick = args.iter().any(|a| a == "--quick");

    let n = match ibgda_device::cuda::device_count() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("bench_emu: {e}; it needs 2 GPUs: run it on a GPU machine");
            std::process::exit(2);
        }
    };
    if n < 2 {
        eprintln!("bench_emu: needs 2 GPUs, found {n}: run it on a machine with two GPUs");
        std::process::exit(2);
    }
    let c0 = ibgda_device::cuda::context(0)?;
    let c1 = ibgda_device::cuda::context(1)?;
    enable_peer_access(&c0, &c1)?;
    enable_peer_access(&c1, &c0)?;
    let machine = format!(
        "{} / 2x {}",
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into()),
        c0.name().unwrap_or_default()
    );

    let fabric = Fabric::new();
    let a = fabric.cuda_nic(&c0, NicConfig::named("gpu0"))?;
    let b = fabric.cuda_nic(&c1, NicConfig::named("gpu1"))?;
    let src = Arc::new(DeviceBuffer::new(&c0, MAX_BYTES)?);
    let dst = Arc::new(DeviceBuffer::new(&c1, MAX_QPS * MAX_BYTES)?);
    src.fill_bytes(0x5a)?;
    let src_mr = a.register_device(&src, 0, MAX_BYTES, Access::NONE)?;
    let dst_mr = b.register_device(&dst, 0, MAX_QPS * MAX_BYTES, Access::REMOTE_WRITE)?;
    let mut lanes = Vec::new();
    let mut peers = Vec::new();
    for k in 0..MAX_QPS {
        let qp = a.create_host_qp(RING, CqMode::Ring, RING)?;
        let peer = b.create_host_qp(8, CqMode::Ring, 8)?;
        a.connect(qp.qpn(), &b.qp_info(peer.qpn())?)?;
        peers.push(peer);
        lanes.push(Lane {
            qp,
            pi: 0,
            cons: 0,
            dst_off: (k * MAX_BYTES) as u64,
        });
    }

    let mut records = Vec::new();
    let sizes: Vec<usize> = (0..=6).map(|i| 4096usize << (2 * i)).collect();
    let reps = if quick { 1 } else { 3 };
    println!(
        "{:<20} {:>4} {:>10} {:>10} {:>12}",
        "bench", "qps", "bytes", "GB/s", "us/write"
    );
    for &qps in &[1usize, MAX_QPS] {
        for &bytes in &sizes {
            let gbps = bandwidth(&mut lanes[..qps], bytes, &src_mr, &dst_mr, reps)?;
            let us = bytes as f64 / (gbps * 1e3) * qps as f64;
            println!(
                "{:<20} {qps:>4} {bytes:>10} {gbps:>10.1} {us:>12.2}",
                "emu_write_bw"
            );
            records.push(Record {
                bench: "emu_write_bw",
                qps,
                bytes,
                gbps,
                us,
            });
        }
    }
    let lat = latency(
        &mut lanes[0],
        &src_mr,
        &dst_mr,
        if quick { 500 } else { 5000 },
    )?;
    let (p50, p99) = (lat[lat.len() / 2], lat[lat.len() * 99 / 100]);
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    println!(
        "{:<20} {:>4} {:>10} {:>10.3} {p50:>12.2}   (p99 {p99:.2} us, mean {mean:.2} us, {} samples)",
        "emu_write_latency",
        1,
        8,
        8.0 / (p50 * 1e3),
        lat.len()
    );
    records.push(Record {
        bench: "emu_write_latency",
        qps: 1,
        bytes: 8,
        gbps: 8.0 / (p50 * 1e3),
        us: p50,
    });
    for l in &lanes {
        let st = a.qp_status(l.qp.qpn())?;
        if st.first_error.is_some() {
            bail!("QP {:#x} failed: {:?}", l.qp.qpn(), st.first_error);
        }
    }

    if let Some(path) = json {
        let date = utc_now();
        let body: Vec<String> = records
            .iter()
            .map(|r| {
                format!(
                    "  {{\"bench\": {}, \"qps\": {}, \"bytes\": {}, \"gbps\": {:.3}, \"us\": {:.3}, \"date\": {}, \"machine\": {}}}",
                    json_str(r.bench),
                    r.qps,
                    r.bytes,
                    r.gbps,
                    r.us,
                    json_str(&date),
                    json_str(&machine)
                )
            })
            .collect();
        std::fs::write(&path, format!("[\n{}\n]\n", body.join(",\n")))
            .with_context(|| format!("writing {path}"))?;
        println!("wrote {path}");
    }
    Ok(())
}
