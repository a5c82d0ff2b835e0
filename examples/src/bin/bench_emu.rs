//! Benchmark of the emulated NIC on one GPU (two emulated NICs on GPU 0: a loopback), or between
//! two GPUs with `--gpus 2`: small-operation rates by size and QP count, 8-byte atomics/s,
//! 8-byte write latency (p50/p99), large-write bandwidth, and a NIC shaped to 50 GB/s and 2 µs
//! (a 400 Gb/s port) at 1 and 8 QPs.
//!
//! ```text
//! bench_emu [--json PATH] [--quick] [--gpus 1|2] [--threads N] [--help]
//! ```
//!
//! Prints a table; with `--json`, writes one record per measurement, each with `bench`, `qps`,
//! `bytes`, `ranks` (emulated NICs: 2), `gpus`, `strict` (the NICs' strict mode), `date`,
//! `machine`, `progress_threads` (of the sending NIC: `--threads`, default 1), `agent` (whether
//! the NICs' small operations ran on the GPU agent: the default; with `IBGDA_EMU_AGENT=0`
//! the copy-engine path), and:
//! - `emu_small_ops`: `mops` (million WQEs/s, all QPs together), `inline` (inline WQE or a
//!   gather from GPU memory);
//! - `emu_atomics`: `mops` of 8-byte fetch-adds, `shared` (every QP on one word, or each on its
//!   own);
//! - `emu_write_latency`: `us` (p50) and `p99_us`, doorbell-record store to CQE seen, one
//!   8-byte write at a time, `inline` or not;
//! - `emu_write_bw`: `gbps` of RDMA writes from GPU memory;
//! - `emu_shaped`: `gbps` measured and `line_rate_gbps` asked (50), `us` (p50 8-byte write
//!   latency on the shaped NIC) and `latency_target_us` (2).
//!
//! Exits with status 2 and a message when no GPU (or fewer than `--gpus`) is visible.
//!
//! Setup: the NICs in one fabric; send rings, CQs and doorbell records in pinned host memory
//! (written here, as a CPU proxy would); sources in `a`'s GPU memory, destinations in `b`'s,
//! consecutive WQEs of a QP to consecutive slots of its own 16 MiB slice (as kernels write
//! distinct token slots; writes to one slot would depend on each other and could not share a
//! submission).
//! Rates: each QP posts a batch (only the last WQE signalled), all QPs ring, and the time runs
//! from the first doorbell to the last CQE; the best of several repetitions counts.

use ep_examples::bench::{json_num, json_str, percentile, utc_timestamp};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cudarc::driver::CudaContext;
use ibgda_device::cuda::{enable_peer_access, wait_legacy_stream, DeviceBuffer};
use ibgda_device::wire::{Cqe64, FetchAdd64, InlineWrite, LocalAddr, RdmaWrite, RemoteAddr, Sge};
use ibgda_emu::{Access, CqMode, Fabric, FaultPlan, HostQp, Mr, Nic, NicConfig, StrictMode};

const USAGE: &str = "usage: bench_emu [--json PATH] [--quick] [--gpus 1|2] [--threads N] [--help]
  --json PATH  write the records as a JSON array to PATH
  --quick      fewer repetitions and samples
  --gpus N     1 (default): both emulated NICs on GPU 0; 2: the second NIC on GPU 1
  --threads N  progress threads of the sending NIC (default 1; QPs are spread over them)
  --help       this text";

const MAX_QPS: usize = 8;
const MAX_BYTES: usize = 16 << 20;
const RING: u32 = 1024;
/// WQEs each QP posts per timed batch of small operations: half the ring, enough to keep the NIC
/// busy for a while, and the batch never waits for room.
const SMALL_BATCH: usize = 512;
const TIMEOUT: Duration = Duration::from_secs(60);
/// What `FaultPlan::nic_400g` asks for.
const LINE_RATE_GBPS: f64 = 50.0;
const LINE_LATENCY_US: f64 = 2.0;

/// One JSON record: its fields in order, values already JSON.
struct Record(Vec<(&'static str, String)>);

impl Record {
    fn new(bench: &str, qps: usize, bytes: usize) -> Self {
        Self(vec![
            ("bench", json_str(bench)),
            ("qps", qps.to_string()),
            ("bytes", bytes.to_string()),
        ])
    }

    fn num(mut self, k: &'static str, v: f64) -> Self {
        self.0.push((k, json_num(v)));
        self
    }

    fn flag(mut self, k: &'static str, v: bool) -> Self {
        self.0.push((k, v.to_string()));
        self
    }
}

fn wait_cqe(qp: &HostQp, cons: u64) -> Result<Cqe64> {
    let t0 = Instant::now();
    loop {
        if let Some(c) = qp.poll_cqe(cons) {
            if c.is_error() {
                bail!("error completion on QP {:#x} (CQE {cons}): {c}", qp.qpn());
            }
            return Ok(c);
        }
        if t0.elapsed() > TIMEOUT {
            bail!("no CQE {cons} on QP {:#x} within {TIMEOUT:?}", qp.qpn());
        }
        std::hint::spin_loop();
    }
}

/// A QP with its producer and consumer positions and its own slice of the destination.
struct Lane {
    qp: HostQp,
    pi: u64,
    cons: u64,
    dst_off: u64,
}

/// What a lane posts.
#[derive(Clone, Copy)]
enum Op {
    /// RDMA write of `bytes` from the source registration.
    Write(usize),
    /// Inline write of `bytes` (at most 28: one WQEBB).
    Inline(usize),
    /// 8-byte fetch-add on the word at `off` of the atomics target.
    FetchAdd(u64),
}

struct Mem {
    src: Mr,
    dst: Mr,
    atom: Mr,
    fetch: Mr,
}

impl Lane {
    /// Where the write of `bytes` at producer index `pi` lands in this lane's slice: consecutive
    /// WQEs write consecutive slots (as kernels write distinct token slots), wrapping in the
    /// slice.
    fn dst(&self, m: &Mem, bytes: usize) -> u64 {
        let slots = (MAX_BYTES / bytes.max(1)) as u64;
        m.dst.addr + self.dst_off + (self.pi % slots) * bytes as u64
    }

    fn post(&mut self, n: usize, op: Op, m: &Mem) {
        let q = self.qp.qpn();
        for k in 0..n {
            let i = self.pi as u16;
            let last = k + 1 == n;
            let w = match op {
                Op::Write(bytes) => RdmaWrite::new(
                    q,
                    i,
                    RemoteAddr {
                        addr: self.dst(m, bytes),
                        rkey: m.dst.rkey,
                    },
                    Sge {
                        addr: m.src.addr,
                        len: bytes as u32,
                        lkey: m.src.lkey,
                    },
                )
                .cqe(last)
                .build(),
                Op::Inline(bytes) => InlineWrite::new(
                    q,
                    i,
                    RemoteAddr {
                        addr: self.dst(m, bytes.next_multiple_of(8)),
                        rkey: m.dst.rkey,
                    },
                    &[0x5a; 28][..bytes],
                )
                .cqe(last)
                .build(),
                Op::FetchAdd(off) => FetchAdd64::new(
                    q,
                    i,
                    RemoteAddr {
                        addr: m.atom.addr + off,
                        rkey: m.atom.rkey,
                    },
                    LocalAddr {
                        addr: m.fetch.addr + 8 * (self.pi % 512),
                        lkey: m.fetch.lkey,
                    },
                    1,
                )
                .cqe(last)
                .build(),
            };
            self.qp.post(self.pi, &w);
            self.pi += 1;
        }
    }
}

/// Seconds of the best of `reps` timed batches (after one untimed warm-up) of `n` WQEs on each
/// lane; `op(lane index)` says what lane `k` posts.
fn batches(
    lanes: &mut [Lane],
    n: usize,
    op: &dyn Fn(usize) -> Op,
    m: &Mem,
    reps: usize,
) -> Result<f64> {
    let mut best = f64::MAX;
    for rep in 0..=reps {
        for (k, l) in lanes.iter_mut().enumerate() {
            l.post(n, op(k), m);
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
    Ok(best)
}

/// Doorbell-to-CQE times in µs (sorted) of `iters` single WQEs on each of `lanes` at once.
fn latency(lanes: &mut [Lane], op: Op, m: &Mem, iters: usize) -> Result<Vec<f64>> {
    let warm = 100;
    let mut us = Vec::with_capacity(iters * lanes.len());
    for i in 0..iters + warm {
        for l in lanes.iter_mut() {
            l.post(1, op, m);
        }
        let t0 = Instant::now();
        for l in lanes.iter() {
            l.qp.ring_dbr(l.pi);
        }
        for l in lanes.iter_mut() {
            wait_cqe(&l.qp, l.cons)?;
            l.cons += 1;
            if i >= warm {
                us.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    us.sort_by(|a, b| a.total_cmp(b));
    Ok(us)
}

struct Args {
    json: Option<String>,
    quick: bool,
    gpus: usize,
    threads: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        json: None,
        quick: false,
        gpus: 1,
        threads: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(s) = it.next() {
        match s.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--json" => a.json = Some(it.next().context(format!("--json needs a path\n{USAGE}"))?),
            "--quick" => a.quick = true,
            "--gpus" => {
                a.gpus = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| (1..=2).contains(n))
                    .context(format!("--gpus needs 1 or 2\n{USAGE}"))?
            }
            "--threads" => {
                a.threads = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| (1..=16).contains(n))
                    .context(format!("--threads needs 1 to 16\n{USAGE}"))?
            }
            other => bail!("unknown option {other}\n{USAGE}"),
        }
    }
    Ok(a)
}

fn strict_name(s: &StrictMode) -> String {
    match (s.check_ctrl, s.reorder) {
        (_, Some(r)) => format!("full (seed {:#x})", r.seed),
        (true, None) => "checks".into(),
        (false, None) => "off".into(),
    }
}

struct Bench {
    a: Nic,
    lanes: Vec<Lane>,
    mem: Mem,
    atom_buf: Arc<DeviceBuffer>,
    reps: usize,
    records: Vec<Record>,
}

impl Bench {
    fn small_ops(&mut self) -> Result<()> {
        for &qps in &[1usize, 4, MAX_QPS] {
            for op in [
                Op::Inline(8),
                Op::Inline(28),
                Op::Write(64),
                Op::Write(512),
                Op::Write(4096),
            ] {
                let (bytes, inline) = match op {
                    Op::Inline(b) => (b, true),
                    Op::Write(b) => (b, false),
                    Op::FetchAdd(_) => unreachable!(),
                };
                let t = batches(
                    &mut self.lanes[..qps],
                    SMALL_BATCH,
                    &|_| op,
                    &self.mem,
                    self.reps,
                )?;
                let mops = (qps * SMALL_BATCH) as f64 / t / 1e6;
                println!(
                    "{:<18} {qps:>4} {bytes:>9} {:>7} {mops:>10.3} Mops/s",
                    "emu_small_ops",
                    if inline { "inline" } else { "gather" }
                );
                self.records.push(
                    Record::new("emu_small_ops", qps, bytes)
                        .num("mops", mops)
                        .flag("inline", inline),
                );
            }
        }
        Ok(())
    }

    fn atomics(&mut self) -> Result<()> {
        for (qps, shared) in [
            (1usize, false),
            (4, false),
            (MAX_QPS, false),
            (MAX_QPS, true),
        ] {
            self.atom_buf.fill_bytes(0)?;
            settle(self.atom_buf.context())?;
            // Each QP's own word on its own 64-byte line, or all on word 0.
            let off = move |k: usize| Op::FetchAdd(if shared { 0 } else { 64 * k as u64 });
            let t = batches(
                &mut self.lanes[..qps],
                SMALL_BATCH,
                &off,
                &self.mem,
                self.reps,
            )?;
            let words: Vec<u64> = self.atom_buf.download(0, 64 * MAX_QPS / 8)?;
            let per_qp = (SMALL_BATCH * (self.reps + 1)) as u64;
            let ok = if shared {
                words[0] == per_qp * qps as u64
            } else {
                (0..qps).all(|k| words[8 * k] == per_qp)
            };
            if !ok {
                bail!("atomics lost updates: {qps} QPs, shared {shared}, words {words:?}, want {per_qp} per QP");
            }
            let mops = (qps * SMALL_BATCH) as f64 / t / 1e6;
            println!(
                "{:<18} {qps:>4} {:>9} {:>7} {mops:>10.3} Mops/s",
                "emu_atomics",
                8,
                if shared { "shared" } else { "own" }
            );
            self.records.push(
                Record::new("emu_atomics", qps, 8)
                    .num("mops", mops)
                    .flag("shared", shared),
            );
        }
        Ok(())
    }

    fn write_latency(&mut self, iters: usize) -> Result<()> {
        for (op, inline) in [(Op::Inline(8), true), (Op::Write(8), false)] {
            let lat = latency(&mut self.lanes[..1], op, &self.mem, iters)?;
            let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
            println!(
                "{:<18} {:>4} {:>9} {:>7} {p50:>10.2} us p50, {p99:.2} us p99 ({} samples)",
                "emu_write_latency",
                1,
                8,
                if inline { "inline" } else { "gather" },
                lat.len()
            );
            self.records.push(
                Record::new("emu_write_latency", 1, 8)
                    .num("us", p50)
                    .num("p99_us", p99)
                    .flag("inline", inline),
            );
        }
        Ok(())
    }

    fn bandwidth(&mut self) -> Result<()> {
        for &qps in &[1usize, MAX_QPS] {
            for bytes in [64usize << 10, 1 << 20, 4 << 20, MAX_BYTES] {
                let n = ((256usize << 20) / bytes).clamp(8, RING as usize);
                let t = batches(
                    &mut self.lanes[..qps],
                    n,
                    &|_| Op::Write(bytes),
                    &self.mem,
                    self.reps,
                )?;
                let gbps = (qps * n * bytes) as f64 / t / 1e9;
                println!(
                    "{:<18} {qps:>4} {bytes:>9} {:>7} {gbps:>10.1} GB/s",
                    "emu_write_bw", "gather"
                );
                self.records
                    .push(Record::new("emu_write_bw", qps, bytes).num("gbps", gbps));
            }
        }
        Ok(())
    }

    fn shaped(&mut self, iters: usize) -> Result<()> {
        self.a.set_fault_plan(FaultPlan::nic_400g());
        let r = self.shaped_runs(iters);
        self.a.set_fault_plan(FaultPlan::default());
        r
    }

    fn shaped_runs(&mut self, iters: usize) -> Result<()> {
        for &qps in &[1usize, MAX_QPS] {
            let bytes = 1usize << 20;
            // 256 MiB in all: about 5 ms at the line rate.
            let n = 256 / qps;
            let t = batches(
                &mut self.lanes[..qps],
                n,
                &|_| Op::Write(bytes),
                &self.mem,
                self.reps,
            )?;
            let gbps = (qps * n * bytes) as f64 / t / 1e9;
            let lat = latency(&mut self.lanes[..qps], Op::Inline(8), &self.mem, iters)?;
            let p50 = percentile(&lat, 0.5);
            println!(
                "{:<18} {qps:>4} {bytes:>9} {:>7} {gbps:>10.2} GB/s of {LINE_RATE_GBPS} ({:.1} %); 8-byte write {p50:.2} us p50 of {LINE_LATENCY_US} us",
                "emu_shaped",
                "gather",
                100.0 * gbps / LINE_RATE_GBPS
            );
            self.records.push(
                Record::new("emu_shaped", qps, bytes)
                    .num("gbps", gbps)
                    .num("line_rate_gbps", LINE_RATE_GBPS)
                    .num("us", p50)
                    .num("latency_target_us", LINE_LATENCY_US),
            );
        }
        Ok(())
    }
}

fn contexts(gpus: usize) -> Result<(Arc<CudaContext>, Arc<CudaContext>)> {
    let n = match ibgda_device::cuda::device_count() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("bench_emu: {e}; it needs a GPU: run it on a GPU machine");
            std::process::exit(2);
        }
    };
    if n < gpus {
        eprintln!("bench_emu: --gpus {gpus} needs {gpus} GPUs, found {n}");
        std::process::exit(2);
    }
    let c0 = ibgda_device::cuda::context(0)?;
    let c1 = if gpus == 2 {
        let c1 = ibgda_device::cuda::context(1)?;
        enable_peer_access(&c0, &c1)?;
        enable_peer_access(&c1, &c0)?;
        c1
    } else {
        c0.clone()
    };
    Ok((c0, c1))
}

/// Waits (bounded) for the memsets on `ctx`'s legacy stream. Not a context-wide synchronisation:
/// that would wait forever for the NICs' GPU agent, which runs as long as they live.
fn settle(ctx: &CudaContext) -> Result<()> {
    wait_legacy_stream(ctx, TIMEOUT, "a memset before a measurement")?;
    Ok(())
}

fn main() -> Result<()> {
    let args = args()?;
    let (c0, c1) = contexts(args.gpus)?;
    let machine = format!(
        "{} / {}x {}",
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into()),
        args.gpus,
        c0.name().unwrap_or_default()
    );
    let cfg = |name: &str| NicConfig::named(name);
    let strict = strict_name(&cfg("x").strict);
    // The NICs below share this GPU's agent, if it runs (it lives while any backend holds it).
    let holder = ibgda_emu::CudaMemory::new(&c0)?;
    let agent = holder.uses_agent();
    if let Some(why) = ibgda_emu::agent_refusal(&c0) {
        println!("GPU agent refused: {why}");
    }
    println!(
        "emulated NICs: 2 on {} GPU(s), {} progress thread(s) on the sender; strict mode {strict} \
         (IBGDA_EMU_STRICT=0 turns it off); GPU agent {} ({}=0 turns it off)",
        args.gpus,
        args.threads,
        if agent { "on" } else { "off" },
        ibgda_emu::AGENT_ENV
    );

    let fabric = Fabric::new();
    let a = fabric.cuda_nic(&c0, cfg("nic-a").progress_threads(args.threads))?;
    let b = fabric.cuda_nic(&c1, cfg("nic-b"))?;
    let src = Arc::new(DeviceBuffer::new(&c0, MAX_BYTES)?);
    let dst = Arc::new(DeviceBuffer::new(&c1, MAX_QPS * MAX_BYTES)?);
    let atom_buf = Arc::new(DeviceBuffer::new(&c1, 64 * MAX_QPS)?);
    let fetch = Arc::new(DeviceBuffer::new(&c0, 8 * 512)?);
    src.fill_bytes(0x5a)?;
    settle(&c0)?;
    let mem = Mem {
        src: a.register_device(&src, 0, MAX_BYTES, Access::NONE)?,
        dst: b.register_device(&dst, 0, MAX_QPS * MAX_BYTES, Access::REMOTE_WRITE)?,
        atom: b.register_device(&atom_buf, 0, 64 * MAX_QPS, Access::REMOTE_ATOMIC)?,
        fetch: a.register_device(&fetch, 0, 8 * 512, Access::LOCAL_WRITE)?,
    };
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
    let mut bench = Bench {
        a,
        lanes,
        mem,
        atom_buf,
        reps: if args.quick { 1 } else { 3 },
        records: Vec::new(),
    };
    let iters = if args.quick { 500 } else { 5000 };
    println!(
        "{:<18} {:>4} {:>9} {:>7} {:>10}",
        "bench", "qps", "bytes", "kind", "result"
    );
    bench.small_ops()?;
    bench.atomics()?;
    bench.write_latency(iters)?;
    bench.bandwidth()?;
    bench.shaped(iters / 5)?;
    drop(holder);
    for l in &bench.lanes {
        let st = bench.a.qp_status(l.qp.qpn())?;
        if st.first_error.is_some() {
            bail!("QP {:#x} failed: {:?}", l.qp.qpn(), st.first_error);
        }
    }

    if let Some(path) = args.json {
        let date = utc_timestamp();
        let body: Vec<String> = bench
            .records
            .iter()
            .map(|r| {
                let mut f: Vec<String> = r.0.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
                f.push(format!("\"ranks\": 2, \"gpus\": {}", args.gpus));
                f.push(format!("\"progress_threads\": {}", args.threads));
                f.push(format!("\"strict\": {}", json_str(&strict)));
                f.push(format!("\"agent\": {agent}"));
                f.push(format!("\"date\": {}", json_str(&date)));
                f.push(format!("\"machine\": {}", json_str(&machine)));
                format!("  {{{}}}", f.join(", "))
            })
            .collect();
        ep_examples::bench::write_records(&path, &body)?;
    }
    Ok(())
}
