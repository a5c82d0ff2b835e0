//! Intranode dispatch/combine benchmark with DeepEP's sizes and byte counting.
//!
//! One rank per visible GPU (at most 8), as threads of this process and as processes
//! (`ep::bootstrap::Launcher` re-executes this program once per GPU; windows shared through CUDA
//! IPC). Combine pulls every copy in one pass in both modes; it combines the dispatch output,
//! which lies in the buffer's window, so processes need no staging copy. Each rank sends 4096 tokens of hidden 7168, each
//! to the ranks of its top-8 of 256 experts (uniform random; the same inputs in both modes).
//! Dispatch is timed as a cached dispatch (as DeepEP tunes it: the routes are known, only x
//! moves), combine over the same handle. GB/s = rows received × hidden × bytes per element ÷
//! time (FP8: 1 + 4/128 bytes per element), averaged over ranks. Sweeps SMs and block size;
//! prints a table per mode (rank 0 prints the processes' one) and writes the best block size per
//! (op, dtype, SMs) as JSON records with `"mode": "threads"` or `"mode": "procs"`.
//!
//! `bench_intranode [--mode threads|procs|both] [--procs] [--json PATH] [--tokens N]
//!  [--hidden H] [--topk K] [--experts E] [--sms 8,16,24] [--threads 256,512,1024] [--iters N]`
//!
//! `--mode both` (the default) runs the threads, then the processes, and writes one JSON with both
//! modes' records; `--procs` is `--mode procs`.

use ep_examples::bench::utc_date as date_utc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use ep::bootstrap::{Communicator, Launcher, TcpCommunicator};
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, Config, DispatchArgs, DispatchX, Event, Fp8E4M3,
    StreamOrder, Tensor, TopK,
};
use ep_examples::ranks::random_topk_ids;
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;

/// How the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Threads,
    Procs,
    Both,
}

#[derive(Debug, Clone)]
struct Args {
    mode: Mode,
    json: Option<String>,
    ranks: Option<usize>,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    sms: Vec<u32>,
    threads: Vec<u32>,
    iters: usize,
}

const USAGE: &str = "\
usage: bench_intranode [--mode threads|procs|both] [--procs] [--json PATH] [--ranks N]
                       [--tokens N] [--hidden H] [--topk K] [--experts E] [--sms 8,16,24]
                       [--threads 256,512,1024] [--iters N]

Intranode dispatch/combine bandwidth (DeepEP's byte counting) per SM count and block size.
  --mode      threads, processes, or both (default both); --procs is --mode procs
  --json      write the best block size per (op, dtype, SMs) as JSON records
  --ranks     ranks, 2..=8 (default: one per visible GPU); ranks share GPUs round robin where
              there are fewer (such figures are not NVLink figures)
  --sms       SM counts to sweep (default 8,16,24,32; counts past what ranks sharing a GPU fit
              are left out, and said so)
  --threads   block sizes to sweep (default 256,512,1024)
  --iters     timed iterations per configuration (default 20)
";

fn parse() -> Result<Args> {
    ep_examples::exit_on_help(USAGE);
    let mut a = Args {
        mode: Mode::Both,
        json: None,
        ranks: None,
        tokens: 4096,
        hidden: 7168,
        topk: 8,
        experts: 256,
        sms: vec![8, 16, 24, 32],
        threads: vec![256, 512, 1024],
        iters: 20,
    };
    let mut it = std::env::args().skip(1);
    let list = |s: String| -> Result<Vec<u32>> {
        s.split(',')
            .map(|x| x.parse().context("bad number"))
            .collect()
    };
    while let Some(f) = it.next() {
        if f == "--procs" {
            a.mode = Mode::Procs;
            continue;
        }
        let mut v = || it.next().with_context(|| format!("{f} needs a value"));
        match f.as_str() {
            "--mode" => {
                a.mode = match v()?.as_str() {
                    "threads" => Mode::Threads,
                    "procs" => Mode::Procs,
                    "both" => Mode::Both,
                    m => bail!("--mode {m}: expected threads, procs or both"),
                }
            }
            "--json" => a.json = Some(v()?),
            "--ranks" => a.ranks = Some(v()?.parse()?),
            "--tokens" => a.tokens = v()?.parse()?,
            "--hidden" => a.hidden = v()?.parse()?,
            "--topk" => a.topk = v()?.parse()?,
            "--experts" => a.experts = v()?.parse()?,
            "--sms" => a.sms = list(v()?)?,
            "--threads" => a.threads = list(v()?)?,
            "--iters" => a.iters = v()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

/// The arguments of a rank process: these settings, processes only, the JSON to `json`.
fn rank_args(a: &Args, json: Option<&str>) -> Vec<String> {
    let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let mut v: Vec<String> = [
        "--mode",
        "procs",
        "--tokens",
        &a.tokens.to_string(),
        "--hidden",
        &a.hidden.to_string(),
        "--topk",
        &a.topk.to_string(),
        "--experts",
        &a.experts.to_string(),
        "--sms",
        &join(&a.sms),
        "--threads",
        &join(&a.threads),
        "--iters",
        &a.iters.to_string(),
        "--ranks",
        &a.ranks.map_or(String::new(), |r| r.to_string()),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if a.ranks.is_none() {
        v.truncate(v.len() - 2);
    }
    if let Some(j) = json {
        v.extend(["--json".to_string(), j.to_string()]);
    }
    v
}

/// (op, dtype, sms, threads, µs, GB/s) per measurement, averaged over ranks.
type Row = (&'static str, &'static str, u32, u32, f64, f64);

struct RankData {
    ids: Tensor<i32>,
    weights: Tensor<f32>,
    x_bf16: Tensor<Bf16>,
    x_fp8: Tensor<Fp8E4M3>,
    scales: Tensor<f32>,
}

/// Rank `rank`'s inputs: the generator's draws for ranks 0, 1, .. in turn (so that threads, which
/// draw for every rank, and a rank's own process get the same inputs).
fn make_rank_alone(ctx: &Arc<CudaContext>, a: &Args, rank: usize) -> Result<RankData> {
    let mut rng = Rng::new(0x5eed);
    for _ in 0..rank {
        draw_rank(a, &mut rng);
    }
    upload_rank(ctx, a, draw_rank(a, &mut rng))
}

type HostData = (Vec<i32>, Vec<f32>, Vec<Bf16>, Vec<Fp8E4M3>, Vec<f32>);

fn make_rank(ctx: &Arc<CudaContext>, a: &Args, rng: &mut Rng) -> Result<RankData> {
    upload_rank(ctx, a, draw_rank(a, rng))
}

fn upload_rank(ctx: &Arc<CudaContext>, a: &Args, d: HostData) -> Result<RankData> {
    let (t, h, k) = (a.tokens, a.hidden, a.topk);
    let (ids, w, xb, xf, s) = d;
    Ok(RankData {
        ids: Tensor::from_host(ctx, &ids, &[t, k])?,
        weights: Tensor::from_host(ctx, &w, &[t, k])?,
        x_bf16: Tensor::from_host(ctx, &xb, &[t, h])?,
        x_fp8: Tensor::from_host(ctx, &xf, &[t, h])?,
        scales: Tensor::from_host(ctx, &s, &[t, h / 128])?,
    })
}

fn draw_rank(a: &Args, rng: &mut Rng) -> HostData {
    let (t, h, k) = (a.tokens, a.hidden, a.topk);
    let ids = random_topk_ids(rng, t, k, a.experts);
    let w: Vec<f32> = (0..t * k)
        .map(|_| rng.below(1000) as f32 / 1000.0)
        .collect();
    let xb: Vec<Bf16> = (0..t * h)
        .map(|_| Bf16::from_f32(rng.below(2000) as f32 / 1000.0 - 1.0))
        .collect();
    let xf: Vec<Fp8E4M3> = xb
        .iter()
        .map(|v| Fp8E4M3::from_f32(v.to_f32() * 100.0))
        .collect();
    let s: Vec<f32> = (0..t * (h / 128)).map(|_| 0.01).collect();
    (ids, w, xb, xf, s)
}

/// One rank's whole sweep; returns its rows.
fn rank_sweep(buf: &mut Buffer, d: &RankData, a: &Args) -> Result<Vec<Row>> {
    let ranks = buf.ranks();
    let layout = buf.get_dispatch_layout(&d.ids)?;
    let mut args = DispatchArgs::new(DispatchX::Bf16(&d.x_bf16), &layout, ranks);
    args.topk = Some(TopK {
        idx: &d.ids,
        weights: &d.weights,
    });
    let first = buf.dispatch(&args)?;
    let recv = first.num_recv_tokens.context("row count")?;
    let handle = first.handle.clone();
    let y = match &first.x {
        ep::RecvX::Bf16(t) => t.clone(),
        _ => unreachable!(),
    };
    drop(first);
    buf.synchronize()?;
    let timeout = Duration::from_secs(60);
    let mut rows = Vec::new();
    for &sms in &a.sms {
        for &threads in &a.threads {
            let config = Config {
                num_sms: sms,
                block_threads: threads,
            };
            for (dtype, elem) in [("bf16", 2.0), ("fp8", 1.0 + 4.0 / 128.0)] {
                let x = if dtype == "bf16" {
                    DispatchX::Bf16(&d.x_bf16)
                } else {
                    DispatchX::Fp8 {
                        x: &d.x_fp8,
                        scales: &d.scales,
                    }
                };
                let order = StreamOrder::default();
                for _ in 0..3 {
                    drop(buf.dispatch_cached(x, &handle, &config, &order)?);
                }
                let start = Event::timed(buf.comm_stream())?;
                for _ in 0..a.iters {
                    drop(buf.dispatch_cached(x, &handle, &config, &order)?);
                }
                let end = Event::timed(buf.comm_stream())?;
                end.wait_host(timeout, "dispatch timing")?;
                buf.synchronize()?;
                let us = f64::from(start.elapsed_ms(&end)?) * 1000.0 / a.iters as f64;
                let bytes = recv as f64 * a.hidden as f64 * elem;
                rows.push((
                    "intranode_dispatch",
                    dtype,
                    sms,
                    threads,
                    us,
                    bytes / us / 1000.0,
                ));
            }
            let cargs = CombineArgs {
                config,
                ..CombineArgs::new(&y, &handle, ranks)
            };
            for _ in 0..3 {
                drop(buf.combine(&cargs)?);
            }
            let start = Event::timed(buf.comm_stream())?;
            for _ in 0..a.iters {
                drop(buf.combine(&cargs)?);
            }
            let end = Event::timed(buf.comm_stream())?;
            end.wait_host(timeout, "combine timing")?;
            buf.synchronize()?;
            let us = f64::from(start.elapsed_ms(&end)?) * 1000.0 / a.iters as f64;
            let bytes = recv as f64 * a.hidden as f64 * 2.0;
            rows.push((
                "intranode_combine",
                "bf16",
                sms,
                threads,
                us,
                bytes / us / 1000.0,
            ));
        }
    }
    Ok(rows)
}

/// Averages every rank's rows (all measured the same configurations in the same order), prints
/// the table and the best block size per (op, dtype, SMs); returns those as JSON records.
fn summarize(
    a: &Args,
    n: usize,
    machine: &str,
    mode: &str,
    per_rank: &[Vec<Row>],
) -> Result<Vec<String>> {
    ensure!(
        per_rank.iter().all(|r| r.len() == per_rank[0].len()),
        "ranks measured different numbers of configurations"
    );
    let mut avg: Vec<Row> = per_rank[0].clone();
    for (i, row) in avg.iter_mut().enumerate() {
        row.4 = per_rank.iter().map(|r| r[i].4).sum::<f64>() / n as f64;
        row.5 = per_rank.iter().map(|r| r[i].5).sum::<f64>() / n as f64;
    }
    let how = if mode == "procs" {
        "ranks as processes"
    } else {
        "ranks as threads"
    };
    println!(
        "EP{n} on {machine} ({how}): {} tokens x {} hidden, top-{} of {} experts",
        a.tokens, a.hidden, a.topk, a.experts
    );
    println!(
        "{:<20} {:<5} {:>4} {:>7} {:>10} {:>8}",
        "bench", "dtype", "sms", "threads", "us", "GB/s"
    );
    for r in &avg {
        println!(
            "{:<20} {:<5} {:>4} {:>7} {:>10.1} {:>8.1}",
            r.0, r.1, r.2, r.3, r.4, r.5
        );
    }
    // Best block size per (op, dtype, SMs).
    let mut best: Vec<Row> = Vec::new();
    for r in &avg {
        match best
            .iter_mut()
            .find(|b| b.0 == r.0 && b.1 == r.1 && b.2 == r.2)
        {
            Some(b) if b.5 >= r.5 => {}
            Some(b) => *b = *r,
            None => best.push(*r),
        }
    }
    println!("best per SM count ({how}):");
    let date = date_utc();
    let mut records = Vec::new();
    for r in &best {
        println!(
            "  {:<20} {:<5} {:>3} SMs: {:>7.1} GB/s {:>8.1} us (threads {})",
            r.0, r.1, r.2, r.5, r.4, r.3
        );
        records.push(format!(
            "  {{\"bench\": \"{}\", \"ranks\": {n}, \"gpus\": {}, \"mode\": \"{mode}\", \"dtype\": \"{}\", \"sms\": {}, \"gbps\": {:.1}, \"us\": {:.1}, \"date\": \"{date}\", \"machine\": \"{machine}\", \"block_threads\": {}, \"tokens\": {}, \"hidden\": {}, \"topk\": {}, \"experts\": {}}}",
            ep_kernels::testing::visible_gpus().min(n),
            r.0,
            r.1,
            r.2,
            r.5,
            r.4,
            r.3,
            a.tokens,
            a.hidden,
            a.topk,
            a.experts
        ));
    }
    Ok(records)
}

fn write_json(path: &str, records: &[String]) -> Result<()> {
    ep_examples::bench::write_records(path, records)
}

fn machine_name(n: usize, ctx: &Arc<CudaContext>) -> String {
    format!("{}x {}", n, ctx.name().unwrap_or_default())
}

fn options(a: &Args) -> BufferOptions {
    let mut opts = BufferOptions::new(a.tokens, a.hidden, a.topk, a.experts);
    opts.max_live_outputs = 4;
    opts
}

/// Ranks as threads of this process; returns the JSON records.
fn run_threads(a: &Args, n: usize) -> Result<Vec<String>> {
    let gpus = ep_kernels::testing::visible_gpus().min(n).max(1);
    let ctxs: Vec<Arc<CudaContext>> = ep_kernels::testing::rank_contexts(n, gpus)?;
    let machine = machine_name(gpus, &ctxs[0]);
    let mut bufs = Buffer::create_group(&ctxs, &options(a))?;
    // Ranks of this process sharing a GPU must fit on it together: SM counts past what the
    // busiest GPU allows are left out, the same on every rank.
    let budget = bufs.iter().map(Buffer::sm_budget).min().unwrap_or(1);
    let mut a = a.clone();
    let skipped: Vec<u32> = a.sms.iter().copied().filter(|&s| s > budget).collect();
    a.sms.retain(|&s| s <= budget);
    if !skipped.is_empty() {
        println!(
            "threads: SM counts {skipped:?} left out: ranks sharing a GPU fit at most {budget} each"
        );
    }
    ensure!(
        !a.sms.is_empty(),
        "no SM count of --sms fits ({budget} per rank at most)"
    );
    let a = &a;
    let mut rng = Rng::new(0x5eed);
    let data: Vec<RankData> = ctxs
        .iter()
        .map(|c| make_rank(c, a, &mut rng))
        .collect::<Result<_>>()?;
    let per_rank: Vec<Result<Vec<Row>>> = std::thread::scope(|s| {
        let js: Vec<_> = bufs
            .iter_mut()
            .zip(&data)
            .map(|(b, d)| s.spawn(|| rank_sweep(b, d, a)))
            .collect();
        js.into_iter()
            .map(|j| j.join().unwrap_or_else(|_| bail!("rank thread panicked")))
            .collect()
    });
    let per_rank: Vec<Vec<Row>> = per_rank.into_iter().collect::<Result<_>>()?;
    summarize(a, n, &machine, "threads", &per_rank)
}

/// A rank's measurements as bytes for the gather to rank 0: `[1, (µs, GB/s) as f64 LE...]` or
/// `[0, error text]`.
fn encode(rows: &Result<Vec<Row>, String>) -> Vec<u8> {
    match rows {
        Ok(rows) => {
            let mut b = vec![1u8];
            for r in rows {
                b.extend(r.4.to_le_bytes());
                b.extend(r.5.to_le_bytes());
            }
            b
        }
        Err(e) => [&[0u8][..], e.as_bytes()].concat(),
    }
}

/// Another rank's measurements, labelled like this rank's `mine` (same sweep, same order).
fn decode(b: &[u8], mine: &[Row]) -> Result<Vec<Row>, String> {
    match b.first() {
        Some(1) if b.len() == 1 + 16 * mine.len() => Ok(mine
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let f =
                    |at: usize| f64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
                (r.0, r.1, r.2, r.3, f(1 + 16 * i), f(9 + 16 * i))
            })
            .collect()),
        Some(1) => Err("measured a different number of configurations".into()),
        Some(0) => Err(String::from_utf8_lossy(&b[1..]).into_owned()),
        _ => Err("malformed report".into()),
    }
}

/// One rank as a process: its GPU, its buffer over CUDA IPC, the sweep; rank 0 gathers every
/// rank's numbers, prints the table and writes the JSON.
fn rank_process(comm: &TcpCommunicator, a: &Args, n: usize) -> Result<()> {
    let ctx = ep_kernels::testing::rank_context(comm.local_rank())?;
    let mut buf = Buffer::new(&ctx, comm, &options(a))?;
    let mine = make_rank_alone(&ctx, a, comm.rank())
        .and_then(|d| rank_sweep(&mut buf, &d, a))
        .map_err(|e| format!("rank {}: {e:#}", comm.rank()));
    let shut = buf.shutdown(comm);
    let all = comm.all_gather_bytes(&encode(&mine))?;
    shut?;
    let mine = mine.map_err(|e| anyhow::anyhow!(e))?;
    let per_rank: Vec<Result<Vec<Row>, String>> = all.iter().map(|b| decode(b, &mine)).collect();
    let failed: Vec<String> = per_rank
        .iter()
        .enumerate()
        .filter_map(|(r, p)| p.as_ref().err().map(|e| format!("rank {r}: {e}")))
        .collect();
    ensure!(failed.is_empty(), "{}", failed.join("; "));
    if comm.rank() == 0 {
        let per_rank: Vec<Vec<Row>> = per_rank
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(anyhow::Error::msg)?;
        let records = summarize(a, n, &machine_name(n, &ctx), "procs", &per_rank)?;
        if let Some(p) = &a.json {
            write_json(p, &records)?;
        }
    }
    Ok(())
}

/// Ranks as processes: this program re-executed once per GPU (`--mode procs`, JSON to `json`).
fn run_processes(a: &Args, n: usize, json: Option<&str>) -> Result<()> {
    Launcher::new(n)
        .args(rank_args(a, json))
        .run(|comm| rank_process(comm, a, n))?;
    Ok(())
}

/// The records of a JSON array this program wrote (one record per line).
fn read_records(path: &str) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    Ok(text
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| l.trim_end().trim_end_matches(',').to_string())
        .collect())
}

fn main() -> Result<()> {
    let a = parse()?;
    let n = match ibgda_device::cuda::device_count() {
        Ok(0) | Err(_) => {
            eprintln!(
                "bench_intranode: no CUDA GPU is visible on this machine; run it on a GPU machine"
            );
            std::process::exit(2);
        }
        Ok(g) => g,
    };
    let gpus = n;
    let n = a.ranks.unwrap_or(gpus.min(8));
    if !(2..=8).contains(&n) {
        eprintln!(
            "bench_intranode: needs 2..=8 ranks, got {n} ({gpus} GPU(s) visible; --ranks N shares them)"
        );
        std::process::exit(2);
    }
    println!(
        "bench_intranode: {}{}",
        ep_kernels::testing::mapping(n, gpus),
        if n > gpus {
            " (ranks share GPUs: these are not NVLink figures)"
        } else {
            ""
        }
    );
    match a.mode {
        Mode::Threads => {
            let records = run_threads(&a, n)?;
            if let Some(p) = &a.json {
                write_json(p, &records)?;
            }
        }
        Mode::Procs => run_processes(&a, n, a.json.as_deref())?,
        Mode::Both => {
            let mut records = run_threads(&a, n)?;
            // The threads' records stay written if the processes fail.
            if let Some(p) = &a.json {
                write_json(p, &records)?;
            }
            // Rank 0 writes the processes' records next to the final file; merged below.
            let part = a.json.as_ref().map(|p| format!("{p}.procs.part"));
            run_processes(&a, n, part.as_deref())?;
            if let (Some(p), Some(part)) = (&a.json, &part) {
                records.extend(read_records(part)?);
                std::fs::remove_file(part).with_context(|| format!("removing {part}"))?;
                write_json(p, &records)?;
            }
        }
    }
    Ok(())
}
