//! Internode dispatch and combine on virtual nodes: the ranks (threads of this process, spread
//! round robin over the visible GPUs) are split into `--nodes` nodes of `--ranks-per-node`
//! ranks, NVLink off between nodes, so every byte between nodes goes through the (emulated)
//! NIC. Each rank draws random tokens and top-k routes, computes the layout, dispatches, returns
//! random expert outputs and combines; dispatch must match `ep::internode::reference` bit for
//! bit, combine within the rounding of the BF16 node sums. Prints host timings and the bytes each
//! hop carried. With no GPU it exits with status 2 and says so.
//!
//! With `--procs` the ranks are processes: the program starts them itself
//! (`ep::bootstrap::Launcher`: one copy of itself per rank, rendezvous over TCP on loopback, the
//! seed passed on), each builds its buffer with `InternodeBuffer::new` over the job's
//! communicator and checks its own part against the reference.
//!
//! `internode [--nodes N] [--ranks-per-node R] [--tokens T] [--hidden H] [--topk K]
//!  [--experts E] [--fp8] [--handler gpu|cpu_host_memory|cpu|auto] [--iters I] [--seed S]
//!  [--procs]` (`--help` says what each does).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use ep::bootstrap::{Communicator, Launcher, TcpCommunicator};
use ep::internode::reference::{self, InternodeDispatch};
use ep::internode::{
    InternodeBuffer, InternodeCombineArgs, InternodeDispatchArgs, InternodeOptions, Topology,
};
use ep::reference::{CombineInput, RankInput};
use ep::transport::NicChoice;
use ep::{Bf16, BufferOptions, DispatchX, Fp8E4M3, RecvX, StreamOrder, Tensor, TopK};
use ep_examples::ranks::{
    drop_on_rank_threads, on_rank_threads, random_bf16, random_topk_ids, seed_or_clock,
};
use ep_examples::{visible_gpus_or_exit, Flags, InternodeSize};
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;
use ibgda_device::protocol::HandlerChoice;

const USAGE: &str = "\
usage: internode [options]

Internode dispatch and combine on virtual nodes (every inter-node byte through the NIC), ranks as
threads (or with --procs processes) on the visible GPUs, checked against the CPU reference.

options:
  --nodes N            nodes, 2..=8 (default 2)
  --ranks-per-node R   ranks per node, 1..=8, nodes x R at most 8 (default 2)
  --tokens T           tokens per rank (default 512)
  --hidden H           hidden size (default 7168)
  --topk K             experts per token (default 8)
  --experts E          experts in all, a multiple of the rank count (default 64)
  --fp8                dispatch FP8 rows with one f32 scale per 128 channels (default BF16)
  --handler M          NIC handler mode: gpu, cpu_host_memory, cpu or auto (default gpu)
  --iters I            dispatch+combine rounds, each checked (default 2)
  --seed S             seed of the random inputs (default: from the clock)
  --procs              ranks as processes (this program started once per rank) instead of threads
  -h, --help           this text

EP_NIC picks the NIC (default: the emulated NIC); IBGDA_NIC_HANDLER overrides --handler.
";

#[derive(Debug, Clone)]
struct Args {
    size: InternodeSize,
    fp8: bool,
    handler: HandlerChoice,
    seed: u64,
    procs: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        size: InternodeSize {
            nodes: 2,
            rpn: 2,
            tokens: 512,
            hidden: 7168,
            topk: 8,
            experts: 64,
            iters: 2,
        },
        fp8: false,
        handler: HandlerChoice::Gpu,
        seed: 0,
        procs: false,
    };
    let mut flags = Flags::new(USAGE);
    while let Some(f) = flags.next_flag() {
        if a.size.set(&f, &mut flags)? {
            continue;
        }
        match f.as_str() {
            "--fp8" => a.fp8 = true,
            "--procs" => a.procs = true,
            "--seed" => a.seed = flags.value(&f)?,
            "--handler" => {
                a.handler = match flags.string(&f)?.as_str() {
                    "gpu" => HandlerChoice::Gpu,
                    "cpu_host_memory" => HandlerChoice::CpuHostMemory,
                    "cpu" => HandlerChoice::Cpu,
                    "auto" => HandlerChoice::Auto,
                    other => bail!("unknown handler mode {other}\n{USAGE}"),
                }
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    a.size.check(if a.fp8 { 128 } else { 8 })?;
    a.seed = seed_or_clock(a.seed)?;
    Ok(a)
}

fn gen(a: &Args, rng: &mut Rng) -> RankInput {
    let (tokens, hidden, topk) = (a.size.tokens, a.size.hidden, a.size.topk);
    let ids = random_topk_ids(rng, tokens, topk, a.size.experts);
    let (row_bytes, x, scale_words, scales) = if a.fp8 {
        let x = (0..tokens * hidden)
            .map(|_| (rng.below(126) + 1) as u8)
            .collect();
        let sw = hidden / 128;
        let s = (0..tokens * sw)
            .map(|_| rng.below(1000) as f32 / 1000.0 + 0.5)
            .collect();
        (hidden, x, sw, s)
    } else {
        (
            hidden * 2,
            bytemuck_bytes(&random_bf16(rng, tokens * hidden)),
            0,
            Vec::new(),
        )
    };
    RankInput {
        tokens,
        row_bytes,
        x,
        scale_words,
        scales,
        topk,
        topk_idx: ids,
        weights: (0..tokens * topk)
            .map(|_| rng.below(1000) as f32 / 1000.0)
            .collect(),
    }
}

fn bytemuck_bytes(x: &[Bf16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.0.to_le_bytes()).collect()
}

struct Report {
    received: usize,
    dispatch: Duration,
    combine: Duration,
    worst_err: f32,
}

#[allow(clippy::too_many_arguments)]
fn run_rank(
    buf: &mut InternodeBuffer,
    ctx: &Arc<CudaContext>,
    a: &Args,
    inp: &RankInput,
    want: &InternodeDispatch,
    comb_in: &CombineInput,
    want_out: &[Bf16],
    scale: &[Bf16],
) -> Result<Report> {
    let r = buf.rank();
    let t = inp.tokens;
    let ids = Tensor::from_host(ctx, &inp.topk_idx, &[t, a.size.topk])?;
    let weights = Tensor::from_host(ctx, &inp.weights, &[t, a.size.topk])?;
    let (xb, xf, sf);
    let x = if a.fp8 {
        let fp8: Vec<Fp8E4M3> = inp.x.iter().map(|&b| Fp8E4M3(b)).collect();
        xf = Tensor::from_host(ctx, &fp8, &[t, a.size.hidden])?;
        sf = Tensor::from_host(ctx, &inp.scales, &[t, a.size.hidden / 128])?;
        DispatchX::Fp8 {
            x: &xf,
            scales: &sf,
        }
    } else {
        let v: Vec<Bf16> = inp
            .x
            .chunks_exact(2)
            .map(|c| Bf16(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        xb = Tensor::from_host(ctx, &v, &[t, a.size.hidden])?;
        DispatchX::Bf16(&xb)
    };
    let layout = buf.get_dispatch_layout(&ids)?;
    let t0 = Instant::now();
    let out = buf.dispatch(&InternodeDispatchArgs {
        x,
        layout: &layout,
        topk: TopK {
            idx: &ids,
            weights: &weights,
        },
        num_worst_tokens: None,
        expert_alignment: 1,
        order: StreamOrder::default(),
    })?;
    buf.synchronize()?;
    let dispatch = t0.elapsed();
    let w = &want.received[r];
    let n = out.num_recv_tokens;
    ensure!(
        n == w.sources.len(),
        "rank {r}: received {n} rows, reference {}",
        w.sources.len()
    );
    let got: Vec<u8> = match &out.x {
        RecvX::Bf16(t) => bytemuck_bytes(&t.to_host()?),
        RecvX::Fp8 { x, scales } => {
            ensure!(
                scales.to_host()? == w.scales,
                "rank {r}: received scales differ from the reference"
            );
            x.to_host()?.iter().map(|v| v.0).collect()
        }
    };
    ensure!(
        got == w.x,
        "rank {r}: received rows differ from the reference"
    );
    ensure!(
        out.topk_idx.as_ref().context("ids")?.to_host()? == w.topk_idx,
        "rank {r}: received top-k ids differ"
    );
    ensure!(
        out.topk_weights.as_ref().context("weights")?.to_host()? == w.weights,
        "rank {r}: received weights differ"
    );
    ensure!(
        out.num_recv_tokens_per_expert.as_ref() == Some(&w.per_expert),
        "rank {r}: per-expert counts differ"
    );

    let cx = Tensor::from_host(ctx, &comb_in.x, &[n, a.size.hidden])?;
    let cw = Tensor::from_host(ctx, &comb_in.weights, &[n, a.size.topk])?;
    let t1 = Instant::now();
    let comb = buf.combine(&InternodeCombineArgs {
        x: &cx,
        handle: &out.handle,
        topk_weights: Some(&cw),
        bias: [None, None],
        order: StreamOrder::default(),
    })?;
    buf.synchronize()?;
    let combine = t1.elapsed();
    let got = comb.x.to_host()?;
    let mut worst_err = 0f32;
    for (i, ((g, w), s)) in got.iter().zip(want_out).zip(scale).enumerate() {
        let err = (g.to_f32() - w.to_f32()).abs();
        ensure!(
            err <= s.to_f32() / 64.0 + 1e-5,
            "rank {r}: combined element {i} is {}, reference {}",
            g.to_f32(),
            w.to_f32()
        );
        worst_err = worst_err.max(err);
    }
    Ok(Report {
        received: n,
        dispatch,
        combine,
        worst_err,
    })
}

/// One iteration's inputs on every rank and the reference's answers.
struct Round {
    inputs: Vec<RankInput>,
    want: InternodeDispatch,
    comb_in: Vec<CombineInput>,
    want_out: Vec<(Vec<Bf16>, Vec<f32>)>,
    /// The combine of the inputs' magnitudes: the rounding bound of each element.
    scale: Vec<(Vec<Bf16>, Vec<f32>)>,
}

impl Round {
    /// Draws every rank's inputs from its generator (so a rank in its own process draws the
    /// whole group's, and computes the reference itself).
    fn generate(a: &Args, topo: &Topology, rngs: &mut [Rng]) -> Result<Round> {
        let world = topo.world();
        let inputs: Vec<RankInput> = rngs.iter_mut().map(|rng| gen(a, rng)).collect();
        let want = reference::dispatch(topo, &inputs, a.size.experts, 1)?;
        let comb_in: Vec<CombineInput> = (0..world)
            .map(|d| CombineInput {
                x: random_bf16(&mut rngs[d], want.received[d].sources.len() * a.size.hidden),
                weights: want.received[d].weights.clone(),
            })
            .collect();
        let tokens: Vec<usize> = inputs.iter().map(|i| i.tokens).collect();
        let nob = vec![[None, None]; world];
        let want_out = reference::combine(
            topo,
            &want,
            &comb_in,
            &tokens,
            a.size.hidden,
            a.size.topk,
            &nob,
        )?
        .out;
        let abs_in: Vec<CombineInput> = comb_in
            .iter()
            .map(|c| CombineInput {
                x: c.x
                    .iter()
                    .map(|v| Bf16::from_f32(v.to_f32().abs()))
                    .collect(),
                weights: c.weights.clone(),
            })
            .collect();
        let scale = reference::combine(
            topo,
            &want,
            &abs_in,
            &tokens,
            a.size.hidden,
            a.size.topk,
            &nob,
        )?
        .out;
        Ok(Round {
            inputs,
            want,
            comb_in,
            want_out,
            scale,
        })
    }
}

/// One generator per rank, all from the seed.
fn rank_rngs(seed: u64, world: usize) -> Vec<Rng> {
    (0..world)
        .map(|r| Rng::new(seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect()
}

fn options(a: &Args) -> InternodeOptions {
    let mut bo = BufferOptions::new(a.size.tokens, a.size.hidden, a.size.topk, a.size.experts);
    bo.timeout = Duration::from_secs(30);
    bo.max_live_outputs = 2;
    InternodeOptions {
        buffer: bo,
        nic: NicChoice::Emulated,
        nic_handler: a.handler,
    }
}

fn print_report(it: usize, r: usize, rep: &Result<Report>) -> bool {
    match rep {
        Ok(p) => {
            println!(
                "  it {it} rank {r}: {} rows received; dispatch {:.1} ms, combine {:.1} ms (host, incl. syncs); combine max err {:e}",
                p.received,
                p.dispatch.as_secs_f64() * 1e3,
                p.combine.as_secs_f64() * 1e3,
                p.worst_err
            );
            true
        }
        Err(e) => {
            println!("  it {it} rank {r}: FAILED: {e:#}");
            false
        }
    }
}

/// Ranks as processes: this program re-executed once per rank, the seed passed on.
fn run_processes(a: &Args, topo: &Topology) -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.extend(["--seed".to_string(), a.seed.to_string()]);
    Launcher::new(topo.world())
        .args(args)
        .run_shared(|comm| rank_process(comm, a, topo))?;
    if Launcher::is_rank_process() {
        return Ok(());
    }
    println!(
        "internode: OK, {} iteration(s) match the reference on every rank (processes)",
        a.size.iters
    );
    Ok(())
}

/// One rank process: its buffer over the job's communicator, every iteration (each rank stays
/// in step whatever an earlier one gave), then the shutdown every rank makes together.
fn rank_process(comm: Arc<TcpCommunicator>, a: &Args, topo: &Topology) -> Result<()> {
    let r = comm.rank();
    let ctx = ep_kernels::testing::rank_context(comm.local_rank())?;
    let mut buf = InternodeBuffer::new(&ctx, comm.clone(), topo, &options(a))?;
    let mut rngs = rank_rngs(a.seed, topo.world());
    let mut ok = true;
    for it in 0..a.size.iters {
        let round = Round::generate(a, topo, &mut rngs)?;
        let rep = run_rank(
            &mut buf,
            &ctx,
            a,
            &round.inputs[r],
            &round.want,
            &round.comb_in[r],
            &round.want_out[r].0,
            &round.scale[r].0,
        );
        ok &= print_report(it, r, &rep);
    }
    buf.shutdown()?;
    ensure!(
        ok,
        "rank {r}: did not match the reference (seed {})",
        a.seed
    );
    Ok(())
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let a = parse()?;
    let gpus = visible_gpus_or_exit("internode");
    let topo = Topology::virtual_nodes(a.size.nodes, a.size.rpn)?;
    let world = topo.world();
    println!(
        "internode: {} nodes x {} ranks ({}), {} tokens x {} {}, top-{} of {} experts, handler {:?}, seed {}",
        a.size.nodes,
        a.size.rpn,
        ep_kernels::testing::mapping(world, gpus),
        a.size.tokens,
        a.size.hidden,
        if a.fp8 { "FP8" } else { "BF16" },
        a.size.topk,
        a.size.experts,
        a.handler,
        a.seed
    );
    if a.procs {
        return run_processes(&a, &topo);
    }
    let ctxs = ep_kernels::testing::rank_contexts(world, gpus)?;
    let mut bufs = InternodeBuffer::create_group(&ctxs, &topo, &options(&a))?;
    let mut rngs = rank_rngs(a.seed, world);
    for it in 0..a.size.iters {
        let Round {
            inputs,
            want,
            comb_in,
            want_out,
            scale,
        } = Round::generate(&a, &topo, &mut rngs)?;
        let reports: Vec<Result<Report>> = on_rank_threads(&mut bufs, |r, buf| {
            run_rank(
                buf,
                &ctxs[r],
                &a,
                &inputs[r],
                &want,
                &comb_in[r],
                &want_out[r].0,
                &scale[r].0,
            )
        });
        let mut failed = false;
        for (r, rep) in reports.iter().enumerate() {
            failed |= !print_report(it, r, rep);
        }
        let row = inputs[0].row_bytes;
        println!(
            "  it {it}: {} token copies crossed the NIC ({:.1} MiB of rows), {} NVLink hand-overs",
            want.rdma_copies.len(),
            (want.rdma_copies.len() * row) as f64 / (1 << 20) as f64,
            want.nvl_forwarded.iter().flatten().sum::<usize>()
        );
        if failed {
            bail!(
                "iteration {it} did not match the reference (seed {})",
                a.seed
            );
        }
    }
    drop_on_rank_threads(bufs);
    println!(
        "internode: OK, {} iteration(s) match the reference",
        a.size.iters
    );
    Ok(())
}
