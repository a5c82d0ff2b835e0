//! The main job: expert-parallel dispatch and combine across the visible GPUs (by default one
//! rank per GPU, at most 8; `--ranks N` runs N ranks on however many GPUs there are, round robin,
//! ranks sharing a GPU where there are fewer), checked against the CPU reference, with timings.
//! Figures of ranks that share a GPU are not NVLink figures.
//!
//! Ranks are threads of this process by default; with `--procs` they are processes: the program
//! starts them itself (`ep::bootstrap::Launcher`: one copy of itself per GPU, rendezvous over TCP
//! on loopback, buffers shared through CUDA IPC), each printing with a `[rank N]` prefix.
//!
//! Each rank draws random BF16 tokens and top-k routes, computes the dispatch layout, dispatches,
//! scales every received row by 2 as a stand-in expert, and combines. Dispatch must match the
//! CPU reference bit for bit; combine must equal the reference sum within BF16 rounding. Every
//! rank's inputs derive from one seed, so a rank in its own process computes the reference too.
//! With no GPU it exits with status 2 and says so.
//!
//! `dispatch_combine [--procs] [--ranks N] [--tokens N] [--hidden H] [--topk K] [--experts E]
//!  [--sms S] [--seed S]` (`--help` says what each does).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use ep::bootstrap::{Communicator, Launcher, TcpCommunicator};
use ep::reference::{self, CombineInput, RankInput};
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, Config, DispatchArgs, DispatchX, Event, RecvX,
    Tensor, TopK,
};
use ep_examples::ranks::{on_rank_threads, random_bf16, random_topk_ids, seed_or_clock};
use ep_examples::Flags;
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;

#[derive(Debug, Clone)]
struct Args {
    procs: bool,
    ranks: Option<usize>,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    sms: Option<u32>,
    seed: u64,
}

const USAGE: &str = "\
usage: dispatch_combine [options]

Expert-parallel dispatch and combine on the visible GPUs, checked against the CPU reference.

options:
  --procs        ranks as processes (launched by this program; CUDA IPC) instead of threads
  --ranks N      ranks, 1..=8 (default: one per visible GPU); spread round robin over the GPUs,
                 several per GPU when there are fewer GPUs than ranks
  --tokens N     tokens per rank (default 1024)
  --hidden H     hidden size, BF16 elements (default 7168)
  --topk K       experts per token (default 8)
  --experts E    experts in all, a multiple of the rank count (default 256)
  --sms S        SMs per rank for the kernels (default 24, or fewer so that ranks sharing a GPU
                 fit on it together)
  --seed S       seed of the random inputs (default: from the clock)
  -h, --help     this text
";

fn parse() -> Result<Args> {
    let mut a = Args {
        procs: false,
        ranks: None,
        tokens: 1024,
        hidden: 7168,
        topk: 8,
        experts: 256,
        sms: None,
        seed: 0,
    };
    let mut flags = Flags::new(USAGE);
    while let Some(f) = flags.next_flag() {
        match f.as_str() {
            "--procs" => a.procs = true,
            "--tokens" => a.tokens = flags.value(&f)?,
            "--hidden" => a.hidden = flags.value(&f)?,
            "--topk" => a.topk = flags.value(&f)?,
            "--experts" => a.experts = flags.value(&f)?,
            "--sms" => a.sms = Some(flags.value(&f)?),
            "--ranks" => a.ranks = Some(flags.value(&f)?),
            "--seed" => a.seed = flags.value(&f)?,
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    a.seed = seed_or_clock(a.seed)?;
    Ok(a)
}

fn gen(a: &Args, rng: &mut Rng) -> (RankInput, Vec<Bf16>) {
    let ids = random_topk_ids(rng, a.tokens, a.topk, a.experts);
    let x: Vec<Bf16> = random_bf16(rng, a.tokens * a.hidden);
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.0.to_le_bytes()).collect();
    let weights = (0..a.tokens * a.topk)
        .map(|_| rng.below(1000) as f32 / 1000.0)
        .collect();
    (
        RankInput {
            tokens: a.tokens,
            row_bytes: a.hidden * 2,
            x: bytes,
            topk: a.topk,
            topk_idx: ids,
            weights,
            ..Default::default()
        },
        x,
    )
}

struct RankReport {
    received: usize,
    dispatch_us: f64,
    combine_us: f64,
}

fn run_rank(
    buf: &mut Buffer,
    ctx: &Arc<CudaContext>,
    a: &Args,
    inp: &RankInput,
    x: &[Bf16],
    want: &reference::Received,
    want_out: &[Bf16],
) -> Result<RankReport> {
    let ranks = buf.ranks();
    let r = buf.rank();
    let ids = Tensor::from_host(ctx, &inp.topk_idx, &[a.tokens, a.topk])?;
    let weights = Tensor::from_host(ctx, &inp.weights, &[a.tokens, a.topk])?;
    let xt = Tensor::from_host(ctx, x, &[a.tokens, a.hidden])?;
    let layout = buf.get_dispatch_layout(&ids)?;
    let config = Config {
        num_sms: sms_for(a, buf),
        ..Config::default_for(ranks)
    };
    let mut args = DispatchArgs::new(DispatchX::Bf16(&xt), &layout, ranks);
    args.topk = Some(TopK {
        idx: &ids,
        weights: &weights,
    });
    args.config = config;

    // Warm up once, then time one dispatch and one combine with events.
    drop(buf.dispatch(&args)?);
    buf.synchronize()?;
    let t0 = Event::timed(buf.comm_stream())?;
    let out = buf.dispatch(&args)?;
    let t1 = Event::timed(buf.comm_stream())?;
    buf.synchronize()?;
    let n = out.num_recv_tokens.context("row count")?;
    ensure!(
        n == want.sources.len(),
        "rank {r}: received {n} rows, reference {}",
        want.sources.len()
    );
    let RecvX::Bf16(rx) = &out.x else {
        bail!("rank {r}: expected BF16 rows")
    };
    let got: Vec<u8> = rx
        .to_host()?
        .iter()
        .flat_map(|v| v.0.to_le_bytes())
        .collect();
    ensure!(
        got == want.x,
        "rank {r}: received rows differ from the reference"
    );
    let got_ids = out.topk_idx.as_ref().context("ids")?.to_host()?;
    ensure!(
        got_ids == want.topk_idx,
        "rank {r}: received top-k ids differ from the reference"
    );

    // The "expert": every row times 2 (exact in BF16).
    let y: Vec<Bf16> = rx
        .to_host()?
        .iter()
        .map(|v| Bf16::from_f32(v.to_f32() * 2.0))
        .collect();
    let yt = Tensor::from_host(ctx, &y, &[n, a.hidden])?;
    let cargs = CombineArgs {
        config,
        ..CombineArgs::new(&yt, &out.handle, ranks)
    };
    drop(buf.combine(&cargs)?);
    buf.synchronize()?;
    let c0 = Event::timed(buf.comm_stream())?;
    let comb = buf.combine(&cargs)?;
    let c1 = Event::timed(buf.comm_stream())?;
    buf.synchronize()?;
    let got = comb.x.to_host()?;
    let bad = got
        .iter()
        .zip(want_out)
        .filter(|(g, w)| (g.to_f32() - w.to_f32()).abs() > w.to_f32().abs() / 128.0 + 1e-6)
        .count();
    ensure!(
        bad == 0,
        "rank {r}: {bad} combined elements differ from the reference"
    );
    Ok(RankReport {
        received: n,
        dispatch_us: f64::from(t0.elapsed_ms(&t1)?) * 1e3,
        combine_us: f64::from(c0.elapsed_ms(&c1)?) * 1e3,
    })
}

/// Every rank's inputs and what each must get back, from the seed alone.
struct Problem {
    inputs: Vec<RankInput>,
    xs: Vec<Vec<Bf16>>,
    want: Vec<reference::Received>,
    want_out: Vec<(Vec<Bf16>, Vec<f32>)>,
}

fn problem(a: &Args, n: usize) -> Problem {
    let mut rng = Rng::new(a.seed);
    let (inputs, xs): (Vec<RankInput>, Vec<Vec<Bf16>>) = (0..n).map(|_| gen(a, &mut rng)).unzip();
    let want = reference::dispatch(&inputs, a.experts, 1);
    let combine_in: Vec<CombineInput> = want
        .iter()
        .map(|w| {
            let x: Vec<Bf16> =
                w.x.chunks_exact(2)
                    .map(|b| Bf16::from_f32(Bf16(u16::from_le_bytes([b[0], b[1]])).to_f32() * 2.0))
                    .collect();
            CombineInput {
                x,
                weights: Vec::new(),
            }
        })
        .collect();
    let want_out = reference::combine(
        &want,
        &combine_in,
        &vec![a.tokens; n],
        a.hidden,
        0,
        &vec![[None, None]; n],
    );
    Problem {
        inputs,
        xs,
        want,
        want_out,
    }
}

/// `--sms`, or 24 capped to what ranks of this process sharing the GPU can have together.
fn sms_for(a: &Args, buf: &Buffer) -> u32 {
    a.sms.unwrap_or_else(|| 24.min(buf.sm_budget()))
}

fn options(a: &Args) -> BufferOptions {
    let mut opts = BufferOptions::new(a.tokens, a.hidden, a.topk, a.experts);
    opts.timeout = Duration::from_secs(20);
    opts
}

fn header(a: &Args, n: usize, gpus: usize, kind: &str) {
    let shared = if n > gpus.min(n) {
        " (ranks share GPUs: the figures are not NVLink figures)"
    } else {
        ""
    };
    println!(
        "dispatch_combine: {n} rank(s) as {kind}; {}{shared}; {} tokens x {} hidden, top-{} of {} experts; seed {}",
        ep_kernels::testing::mapping(n, gpus),
        a.tokens,
        a.hidden,
        a.topk,
        a.experts,
        a.seed
    );
}

fn ready(a: &Args, n: usize, started: Instant) {
    println!(
        "  buffers ready in {:.1} ms ({} MiB receive region per rank)",
        started.elapsed().as_secs_f64() * 1e3,
        options(a).recv_region_bytes(n).unwrap_or(0) >> 20
    );
}

/// Prints the per-rank table; fails if any rank did.
fn report(a: &Args, reports: Vec<Result<RankReport, String>>) -> Result<()> {
    println!(
        "{:>4} {:>9} {:>12} {:>10} {:>12} {:>10}",
        "rank", "received", "dispatch us", "GB/s", "combine us", "GB/s"
    );
    let mut failed = false;
    for (r, rep) in reports.into_iter().enumerate() {
        match rep {
            Ok(rep) => {
                let bytes = rep.received as f64 * a.hidden as f64 * 2.0;
                println!(
                    "{r:>4} {:>9} {:>12.1} {:>10.1} {:>12.1} {:>10.1}",
                    rep.received,
                    rep.dispatch_us,
                    bytes / rep.dispatch_us / 1e3,
                    rep.combine_us,
                    bytes / rep.combine_us / 1e3
                );
            }
            Err(e) => {
                failed = true;
                println!("{r:>4} FAILED: {e}");
            }
        }
    }
    if failed {
        bail!("dispatch/combine did not match the CPU reference");
    }
    let sms = a
        .sms
        .map_or("24 or the shared-GPU budget".to_string(), |s| s.to_string());
    println!("dispatch bit-exact and combine within BF16 rounding of the CPU reference on every rank (sms {sms})");
    Ok(())
}

/// Ranks as threads of this process.
fn run_threads(a: &Args, n: usize, gpus: usize) -> Result<()> {
    header(a, n, gpus, "threads");
    let ctxs: Vec<Arc<CudaContext>> = ep_kernels::testing::rank_contexts(n, gpus)?;
    let started = Instant::now();
    let mut bufs = Buffer::create_group(&ctxs, &options(a))?;
    ready(a, n, started);
    let p = problem(a, n);
    let reports: Vec<Result<RankReport, String>> = on_rank_threads(&mut bufs, |r, b| {
        run_rank(
            b,
            &ctxs[r],
            a,
            &p.inputs[r],
            &p.xs[r],
            &p.want[r],
            &p.want_out[r].0,
        )
        .map_err(|e| format!("{e:#}"))
    });
    report(a, reports)
}

/// A rank's report as bytes, for the gather to rank 0: `[1, received, dispatch_us, combine_us]`
/// or `[0, error text]`.
fn encode(rep: &Result<RankReport, String>) -> Vec<u8> {
    match rep {
        Ok(r) => [
            &[1u8][..],
            &(r.received as u64).to_le_bytes(),
            &r.dispatch_us.to_le_bytes(),
            &r.combine_us.to_le_bytes(),
        ]
        .concat(),
        Err(e) => [&[0u8][..], e.as_bytes()].concat(),
    }
}

fn decode(b: &[u8]) -> Result<RankReport, String> {
    let word = |i: usize| -> [u8; 8] { b[1 + 8 * i..9 + 8 * i].try_into().unwrap_or_default() };
    match b.first() {
        Some(1) if b.len() == 25 => Ok(RankReport {
            received: u64::from_le_bytes(word(0)) as usize,
            dispatch_us: f64::from_le_bytes(word(1)),
            combine_us: f64::from_le_bytes(word(2)),
        }),
        Some(0) => Err(String::from_utf8_lossy(&b[1..]).into_owned()),
        _ => Err("malformed report".into()),
    }
}

/// One rank as a process: rank 0's seed for everyone, the buffer over CUDA IPC, the run, the
/// table on rank 0.
fn rank_process(comm: &TcpCommunicator, a: &Args, n: usize, gpus: usize) -> Result<()> {
    let mut a = a.clone();
    let seed = comm.broadcast_bytes(0, &a.seed.to_le_bytes())?;
    a.seed = u64::from_le_bytes(seed.try_into().map_err(|_| anyhow::anyhow!("bad seed"))?);
    let first = comm.rank() == 0;
    if first {
        header(&a, n, gpus, "processes");
    }
    let ctx = ep_kernels::testing::rank_context(comm.local_rank())?;
    let started = Instant::now();
    let mut buf = Buffer::new(&ctx, comm, &options(&a))?;
    if first {
        ready(&a, n, started);
    }
    let p = problem(&a, n);
    let r = comm.rank();
    let rep = run_rank(
        &mut buf,
        &ctx,
        &a,
        &p.inputs[r],
        &p.xs[r],
        &p.want[r],
        &p.want_out[r].0,
    )
    .map_err(|e| format!("{e:#}"));
    buf.shutdown(comm)?;
    let all = comm.all_gather_bytes(&encode(&rep))?;
    let reports: Vec<Result<RankReport, String>> = all.iter().map(|b| decode(b)).collect();
    if first {
        return report(&a, reports);
    }
    ensure!(
        reports.iter().all(Result::is_ok),
        "dispatch/combine did not match the CPU reference (rank 0 has the table)"
    );
    Ok(())
}

/// Ranks as processes: this program re-executed once per rank by the launcher.
fn run_processes(a: &Args, n: usize, gpus: usize) -> Result<()> {
    Launcher::new(n).run(|comm| rank_process(comm, a, n, gpus))?;
    Ok(())
}

fn main() -> Result<()> {
    let a = parse()?;
    let n = match ibgda_device::cuda::device_count() {
        Ok(0) => {
            eprintln!(
                "dispatch_combine: no CUDA GPU is visible on this machine; run it on a GPU machine"
            );
            std::process::exit(2);
        }
        Ok(g) => g,
        Err(e) => {
            eprintln!("dispatch_combine: {e}");
            std::process::exit(2);
        }
    };
    let gpus = n;
    let n = a.ranks.unwrap_or(gpus.min(8));
    ensure!((1..=8).contains(&n), "--ranks {n} out of 1..=8");
    ensure!(
        a.experts % n == 0,
        "{} experts do not split over {n} ranks",
        a.experts
    );
    if a.procs {
        run_processes(&a, n, gpus)
    } else {
        run_threads(&a, n, gpus)
    }
}
