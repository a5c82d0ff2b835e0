//! Benchmark of the emulated NIC on one GPU (two emulated NICs on GPU 0: a loopback), or between
//! two GPUs with `--gpus 2`: small-operation rates by size and QP count, 8-byte atomics/s,
//! 8-byte write latency (p50/p99), large-write bandwidth, and a NIC shaped to 50 GB/s and 2 µs
//! (a 400 Gb/s port) at 1 and 8 QPs. With `--host`, the same measurements of two host-backend
//! NICs over host memory, no GPU needed: what the NIC's progress thread itself costs per WQE.
//!
//! ```text
//! bench_emu [--json PATH] [--quick] [--gpus 1|2] [--host] [--manual] [--only LIST]
//!           [--threads N] [--help]
//! ```
//!
//! Prints a table; with `--json`, writes one record per measurement, each with `bench`, `qps`,
//! `bytes`, `ranks` (emulated NICs: 2), `gpus` (0 with `--host`), `memory` (`gpu`, or `host`
//! with `--host`), `strict` (the NICs' strict mode), `date`, `machine`, `progress_threads` (of
//! the sending NIC: `--threads`, default 1; 0 with `--manual`), `agent` (whether the NICs'
//! small operations ran on the GPU agent: the default; with `IBGDA_EMU_AGENT=0` the copy-engine
//! path; always false with `--host`), and:
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
use ibgda_emu::{
    Access, CqMode, Fabric, FaultPlan, HostBuffer, HostQp, Mr, Nic, NicConfig, StrictMode,
};

const USAGE: &str =
    "usage: bench_emu [--json PATH] [--quick] [--gpus 1|2] [--host] [--manual] [--only LIST] [--threads N] [--help]
  --json PATH  write the records as a JSON array to PATH
  --quick      fewer repetitions and samples
  --gpus N     1 (default): both emulated NICs on GPU 0; 2: the second NIC on GPU 1
  --host       host-backend NICs over host memory (no GPU): the engine's own cost
  --manual     no progress thread on the sender: the bench runs its rounds while it waits
               (the engine's cost per WQE without a hand-off between threads)
  --only LIST  run only these comma-separated parts: small,atomics,latency,bw,shaped
  --threads N  progress threads of the sending NIC (default 1; QPs are spread over them)
  --help       this text";

/// What `--only` may name.
const PARTS: [&str; 5] = ["small", "atomics", "latency", "bw", "shaped"];

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

/// Waits for CQE `cons` of `qp`; with `drive`, runs that NIC's progress rounds on this thread
/// meanwhile (`--manual`).
fn wait_cqe(qp: &HostQp, cons: u64, drive: Option<&Nic>) -> Result<Cqe64> {
    let t0 = Instant::now();
    loop {
        if let Some(nic) = drive {
            nic.progress()?;
        }
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

/// A buffer the bench registers: GPU memory, or host memory with `--host`.
#[derive(Clone)]
enum Buf {
    Device(Arc<DeviceBuffer>),
    Host(Arc<HostBuffer>),
}

impl Buf {
    /// `len` bytes on `ctx`'s GPU, or in host memory when `ctx` is `None`.
    fn new(ctx: Option<&Arc<CudaContext>>, len: usize) -> Result<Self> {
        Ok(match ctx {
            Some(c) => Buf::Device(Arc::new(DeviceBuffer::new(c, len)?)),
            None => {
                let b = HostBuffer::new(len);
                // Touched once now, so that no measurement pays the first touch of its pages.
                b.fill(0);
                Buf::Host(Arc::new(b))
            }
        })
    }

    fn register(&self, nic: &Nic, len: usize, access: Access) -> Result<Mr> {
        Ok(match self {
            Buf::Device(b) => nic.register_device(b, 0, len, access)?,
            Buf::Host(b) => nic.register_host(b, 0, len, access)?,
        })
    }

    /// Sets every byte to `value` and waits (bounded) until it has landed.
    fn fill(&self, value: u8) -> Result<()> {
        match self {
            Buf::Device(b) => {
                b.fill_bytes(value)?;
                settle(b.context())
            }
            Buf::Host(b) => {
                b.fill(value);
                Ok(())
            }
        }
    }

    /// The first `n` 8-byte words.
    fn words(&self, n: usize) -> Result<Vec<u64>> {
        Ok(match self {
            Buf::Device(b) => b.download(0, n)?,
            Buf::Host(b) => (0..n).map(|i| b.load_u64(8 * i)).collect(),
        })
    }
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
    drive: Option<&Nic>,
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
            wait_cqe(&l.qp, l.cons, drive)?;
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
fn latency(
    drive: Option<&Nic>,
    lanes: &mut [Lane],
    op: Op,
    m: &Mem,
    iters: usize,
) -> Result<Vec<f64>> {
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
            wait_cqe(&l.qp, l.cons, drive)?;
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
    host: bool,
    manual: bool,
    threads: usize,
    only: Option<Vec<String>>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        json: None,
        quick: false,
        gpus: 1,
        host: false,
        manual: false,
        threads: 1,
        only: None,
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
            "--host" => a.host = true,
            "--manual" => a.manual = true,
            "--gpus" => {
                a.gpus = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| (1..=2).contains(n))
                    .context(format!("--gpus needs 1 or 2\n{USAGE}"))?
            }
            "--only" => {
                let list = it.next().context(format!("--only needs a list\n{USAGE}"))?;
                let parts: Vec<String> = list.split(',').map(|p| p.trim().to_string()).collect();
                if let Some(p) = parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
                    bail!(
                        "--only: unknown part {p:?} (parts: {})\n{USAGE}",
                        PARTS.join(",")
                    );
                }
                a.only = Some(parts);
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
    /// `--manual`: `a` has no progress thread; the bench runs its rounds while it waits.
    manual: bool,
    lanes: Vec<Lane>,
    mem: Mem,
    atom_buf: Buf,
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
                    self.manual.then_some(&self.a),
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
                        .num("ns_per_wqe", 1e3 / mops)
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
            self.atom_buf.fill(0)?;
            // Each QP's own word on its own 64-byte line, or all on word 0.
            let off = move |k: usize| Op::FetchAdd(if shared { 0 } else { 64 * k as u64 });
            let t = batches(
                self.manual.then_some(&self.a),
                &mut self.lanes[..qps],
                SMALL_BATCH,
                &off,
                &self.mem,
                self.reps,
            )?;
            let words = self.atom_buf.words(64 * MAX_QPS / 8)?;
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
                    .num("ns_per_wqe", 1e3 / mops)
                    .flag("shared", shared),
            );
        }
        Ok(())
    }

    fn write_latency(&mut self, iters: usize) -> Result<()> {
        for (op, inline) in [(Op::Inline(8), true), (Op::Write(8), false)] {
            let lat = latency(
                self.manual.then_some(&self.a),
                &mut self.lanes[..1],
                op,
                &self.mem,
                iters,
            )?;
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
                    self.manual.then_some(&self.a),
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
                self.manual.then_some(&self.a),
                &mut self.lanes[..qps],
                n,
                &|_| Op::Write(bytes),
                &self.mem,
                self.reps,
            )?;
            let gbps = (qps * n * bytes) as f64 / t / 1e9;
            let lat = latency(
                self.manual.then_some(&self.a),
                &mut self.lanes[..qps],
                Op::Inline(8),
                &self.mem,
                iters,
            )?;
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

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The two NICs (the sender with `threads` progress threads) and, on GPUs, the backend that
/// holds GPU 0's agent while they live, the contexts and the machine in words.
struct Setup {
    /// Kept alive: peers find each other through it.
    fabric: Fabric,
    a: Nic,
    b: Nic,
    holder: Option<ibgda_emu::CudaMemory>,
    ctxs: Option<(Arc<CudaContext>, Arc<CudaContext>)>,
    agent: bool,
    machine: String,
}

fn setup(args: &Args, strict: &str) -> Result<Setup> {
    let cfg = |name: &str| NicConfig::named(name);
    let sender = |name: &str| {
        let c = cfg(name).progress_threads(args.threads);
        if args.manual {
            c.manual()
        } else {
            c
        }
    };
    let fabric = Fabric::new();
    if args.host {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!(
            "emulated NICs: 2 on host memory ({cores} cores), {} on the sender; strict mode \
             {strict} (IBGDA_EMU_STRICT=0 turns it off)",
            if args.manual {
                "no progress thread (--manual)".to_string()
            } else {
                format!("{} progress thread(s)", args.threads)
            }
        );
        return Ok(Setup {
            a: fabric.host_nic(sender("nic-a"))?,
            b: fabric.host_nic(cfg("nic-b"))?,
            fabric,
            holder: None,
            ctxs: None,
            agent: false,
            machine: format!("{} / host memory, {cores} cores", hostname()),
        });
    }
    let (c0, c1) = contexts(args.gpus)?;
    let machine = format!(
        "{} / {}x {}",
        hostname(),
        args.gpus,
        c0.name().unwrap_or_default()
    );
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
    Ok(Setup {
        a: fabric.cuda_nic(&c0, sender("nic-a"))?,
        b: fabric.cuda_nic(&c1, cfg("nic-b"))?,
        fabric,
        holder: Some(holder),
        ctxs: Some((c0, c1)),
        agent,
        machine,
    })
}

fn main() -> Result<()> {
    let args = args()?;
    let strict = strict_name(&NicConfig::named("x").strict);
    let Setup {
        fabric: _fabric,
        a,
        b,
        holder,
        ctxs,
        agent,
        machine,
    } = setup(&args, &strict)?;
    let (c0, c1) = match &ctxs {
        Some((c0, c1)) => (Some(c0), Some(c1)),
        None => (None, None),
    };
    let src = Buf::new(c0, MAX_BYTES)?;
    let dst = Buf::new(c1, MAX_QPS * MAX_BYTES)?;
    let atom_buf = Buf::new(c1, 64 * MAX_QPS)?;
    let fetch = Buf::new(c0, 8 * 512)?;
    src.fill(0x5a)?;
    let mem = Mem {
        src: src.register(&a, MAX_BYTES, Access::NONE)?,
        dst: dst.register(&b, MAX_QPS * MAX_BYTES, Access::REMOTE_WRITE)?,
        atom: atom_buf.register(&b, 64 * MAX_QPS, Access::REMOTE_ATOMIC)?,
        fetch: fetch.register(&a, 8 * 512, Access::LOCAL_WRITE)?,
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
        manual: args.manual,
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
    let runs = |part: &str| {
        args.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|p| p == part))
    };
    if runs("small") {
        bench.small_ops()?;
    }
    if runs("atomics") {
        bench.atomics()?;
    }
    if runs("latency") {
        bench.write_latency(iters)?;
    }
    if runs("bw") {
        bench.bandwidth()?;
    }
    if runs("shaped") {
        bench.shaped(iters / 5)?;
    }
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
                let (gpus, memory) = if args.host {
                    (0, "host")
                } else {
                    (args.gpus, "gpu")
                };
                f.push(format!("\"ranks\": 2, \"gpus\": {gpus}"));
                f.push(format!("\"memory\": {}", json_str(memory)));
                let threads = if args.manual { 0 } else { args.threads };
                f.push(format!("\"progress_threads\": {threads}"));
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
