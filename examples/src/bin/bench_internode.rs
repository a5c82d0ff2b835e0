//! Internode dispatch/combine benchmark at DeepEP's internode sizes (4096 tokens per rank,
//! hidden 7168, top-8 of 256 experts, uniform random), ranks as threads on virtual nodes (every
//! inter-node byte through the emulated NIC, each rank's NIC shaped to a 400 Gb/s port: 50 GB/s,
//! 2 µs per operation).
//!
//! Counted as DeepEP counts: RDMA GB/s = token rows this rank sent to other nodes × row bytes ÷
//! time; NVL GB/s = rows this rank received × row bytes ÷ time (FP8 rows count 1 + 4/128 bytes
//! per element); averaged over ranks. Times are host times of a whole operation (the staged
//! version waits on the host inside dispatch), after one warm-up round; the rank threads meet on
//! a host barrier before each timed operation, and the combine input is allocated once, so that
//! a rank's time is its operation's, not another rank's preparation. Writes one JSON record
//! per (op, dtype) with `--json`.
//!
//! `--phases` adds one round after the timed ones with the buffer's phase timing on
//! ([`InternodeBuffer::record_phases`]) and prints, per rank, each phase of the dispatch and of
//! the combine (stream time from CUDA events, host time, bytes) and every put's WQEs and bytes;
//! the records then carry a `phases` object (means over ranks).
//!
//! `bench_internode [--nodes N] [--ranks-per-node R] [--tokens T] [--hidden H] [--topk K]
//!  [--experts E] [--dtype bf16|fp8|both] [--iters I] [--no-shape] [--phases] [--json PATH]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use ep::bootstrap::{Communicator, ThreadCommunicator, ThreadGroup};
use ep::internode::reference;
use ep::internode::{
    InternodeBuffer, InternodeCombineArgs, InternodeDispatchArgs, InternodeOptions, PhaseTiming,
    Topology,
};
use ep::transport::NicChoice;
use ep::{Bf16, BufferOptions, DispatchX, Fp8E4M3, StreamOrder, Tensor, TopK};
use ep_examples::bench::{json_num, json_str, utc_date};
use ep_examples::ranks::{drop_on_rank_threads, on_rank_threads, random_bf16, random_topk_ids};
use ep_examples::{visible_gpus_or_exit, Flags, InternodeSize};
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;
use ibgda_device::protocol::HandlerChoice;

const USAGE: &str = "\
usage: bench_internode [options]

options:
  --nodes N            nodes (default 2)
  --ranks-per-node R   ranks per node, nodes x R at most 8 (default 2)
  --tokens T           tokens per rank (default 4096)
  --hidden H           hidden size (default 7168)
  --topk K             experts per token (default 8)
  --experts E          experts in all (default 256)
  --dtype D            bf16, fp8 or both (default both)
  --iters I            timed rounds per op (default 5)
  --no-shape           leave the emulated NIC unshaped (default: 400 Gb/s, 2 us per op)
  --phases             after the timed rounds, time each phase of one dispatch and one
                       combine (CUDA events and host clock) and print them per rank
  --json PATH          write the records there
  -h, --help           this text
";

/// A 400 Gb/s port: what the emulated NIC is shaped to.
const LINE_RATE_GBPS: f64 = 50.0;

#[derive(Debug, Clone)]
struct Args {
    size: InternodeSize,
    dtypes: Vec<bool>,
    shape: bool,
    phases: bool,
    json: Option<String>,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        size: InternodeSize {
            nodes: 2,
            rpn: 2,
            tokens: 4096,
            hidden: 7168,
            topk: 8,
            experts: 256,
            iters: 5,
        },
        dtypes: vec![false, true],
        shape: true,
        phases: false,
        json: None,
    };
    let mut flags = Flags::new(USAGE);
    while let Some(f) = flags.next_flag() {
        if a.size.set(&f, &mut flags)? {
            continue;
        }
        match f.as_str() {
            "--no-shape" => a.shape = false,
            "--phases" => a.phases = true,
            "--json" => a.json = Some(flags.string(&f)?),
            "--dtype" => {
                a.dtypes = match flags.string(&f)?.as_str() {
                    "bf16" => vec![false],
                    "fp8" => vec![true],
                    "both" => vec![false, true],
                    other => bail!("unknown dtype {other}"),
                }
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    a.size.check(128)?;
    Ok(a)
}

/// One rank's inputs.
struct Input {
    ids: Vec<i32>,
    weights: Vec<f32>,
    x: Vec<Bf16>,
    fp8: Vec<Fp8E4M3>,
    scales: Vec<f32>,
}

fn gen(a: &Args, rng: &mut Rng) -> Input {
    let ids = random_topk_ids(rng, a.size.tokens, a.size.topk, a.size.experts);
    Input {
        ids,
        weights: (0..a.size.tokens * a.size.topk)
            .map(|_| rng.below(1000) as f32 / 1000.0)
            .collect(),
        x: random_bf16(rng, a.size.tokens * a.size.hidden),
        fp8: (0..a.size.tokens * a.size.hidden)
            .map(|_| Fp8E4M3((rng.below(126) + 1) as u8))
            .collect(),
        scales: (0..a.size.tokens * a.size.hidden / 128)
            .map(|_| 1.0)
            .collect(),
    }
}

/// One rank's mean times (µs) and bytes.
struct Timing {
    dispatch_us: f64,
    combine_us: f64,
    rdma_bytes: f64,
    nvl_bytes: f64,
    /// With `--phases`: the phases of one dispatch and one combine.
    phases: Option<RankPhases>,
}

/// One rank's timed phases of one dispatch and one combine, and the host time of the bench's
/// own `synchronize` after each (outside the operation).
struct RankPhases {
    dispatch: Vec<PhaseTiming>,
    combine: Vec<PhaseTiming>,
    dispatch_sync_us: f64,
    combine_sync_us: f64,
}

/// How long a rank waits for the others at the barrier before each timed operation.
const MEET_BOUND: Duration = Duration::from_secs(120);

#[allow(clippy::too_many_arguments)]
fn run_rank(
    buf: &mut InternodeBuffer,
    ctx: &Arc<CudaContext>,
    a: &Args,
    inp: &Input,
    fp8: bool,
    want_rows: usize,
    rdma_tokens: usize,
    meet: &ThreadCommunicator,
) -> Result<Timing> {
    let r = buf.rank();
    let t = a.size.tokens;
    let ids = Tensor::from_host(ctx, &inp.ids, &[t, a.size.topk])?;
    let weights = Tensor::from_host(ctx, &inp.weights, &[t, a.size.topk])?;
    let (xb, xf, sf);
    let x = if fp8 {
        xf = Tensor::from_host(ctx, &inp.fp8, &[t, a.size.hidden])?;
        sf = Tensor::from_host(ctx, &inp.scales, &[t, a.size.hidden / 128])?;
        DispatchX::Fp8 {
            x: &xf,
            scales: &sf,
        }
    } else {
        xb = Tensor::from_host(ctx, &inp.x, &[t, a.size.hidden])?;
        DispatchX::Bf16(&xb)
    };
    let layout = buf.get_dispatch_layout(&ids)?;
    let args = InternodeDispatchArgs {
        x,
        layout: &layout,
        topk: TopK {
            idx: &ids,
            weights: &weights,
        },
        num_worst_tokens: None,
        expert_alignment: 1,
        order: StreamOrder::default(),
    };
    // The combine input: one per rank for every round (routing is the same every round).
    let cx = Tensor::<Bf16>::filled(ctx, Bf16::from_f32(0.5), &[want_rows, a.size.hidden])?;
    let (mut d_total, mut c_total) = (Duration::ZERO, Duration::ZERO);
    let mut phases = None;
    // Round 0 warms up; the last round, with --phases, is timed by phase instead.
    let rounds = a.size.iters + usize::from(a.phases);
    for round in 0..=rounds {
        let timing_phases = a.phases && round == rounds;
        buf.record_phases(timing_phases);
        meet.barrier()?;
        let t0 = Instant::now();
        let out = buf.dispatch(&args)?;
        let d_ret = t0.elapsed();
        buf.synchronize()?;
        let d = t0.elapsed();
        ensure!(
            out.num_recv_tokens == want_rows && out.handle.num_rows() == want_rows,
            "rank {r}: received {} rows, reference {want_rows}",
            out.num_recv_tokens
        );
        meet.barrier()?;
        let t1 = Instant::now();
        let comb = buf.combine(&InternodeCombineArgs {
            x: &cx,
            handle: &out.handle,
            topk_weights: None,
            bias: [None, None],
            order: StreamOrder::default(),
        })?;
        let c_ret = t1.elapsed();
        buf.synchronize()?;
        let c = t1.elapsed();
        drop(comb);
        if timing_phases {
            let all = buf.take_phases()?;
            let (dispatch, combine) = all.into_iter().partition(|p| p.op != "combine");
            phases = Some(RankPhases {
                dispatch,
                combine,
                dispatch_sync_us: (d - d_ret).as_secs_f64() * 1e6,
                combine_sync_us: (c - c_ret).as_secs_f64() * 1e6,
            });
        } else if round > 0 {
            d_total += d;
            c_total += c;
        }
    }
    buf.record_phases(false);
    let elem = if fp8 { 1.0 + 4.0 / 128.0 } else { 2.0 };
    let n = a.size.iters as f64;
    Ok(Timing {
        dispatch_us: d_total.as_secs_f64() * 1e6 / n,
        combine_us: c_total.as_secs_f64() * 1e6 / n,
        rdma_bytes: rdma_tokens as f64 * a.size.hidden as f64 * elem,
        nvl_bytes: want_rows as f64 * a.size.hidden as f64 * elem,
        phases,
    })
}

/// Prints one rank's phases of one operation: stream and host time, bytes, and the puts.
fn print_phases(rank: usize, dtype: &str, op: &str, phases: &[PhaseTiming], sync_us: f64) {
    println!("phases of one {op} ({dtype}), rank {rank}:");
    println!(
        "  {:<28} {:>10} {:>10} {:>12} {:>9}",
        "phase", "gpu us", "host us", "bytes", "GB/s"
    );
    let (mut gpu, mut host) = (0.0, 0.0);
    for p in phases {
        gpu += p.gpu_us;
        host += p.host_us;
        let rate = if p.bytes > 0 && p.gpu_us > 0.0 {
            format!("{:.1}", p.bytes as f64 / p.gpu_us / 1e3)
        } else {
            String::new()
        };
        println!(
            "  {:<28} {:>10.1} {:>10.1} {:>12} {rate:>9}",
            p.label(),
            p.gpu_us,
            p.host_us,
            p.bytes
        );
    }
    println!("  {:<28} {gpu:>10.1} {host:>10.1}", "total (operation)");
    println!(
        "  {:<28} {:>10} {sync_us:>10.1}",
        "then synchronize (bench)", ""
    );
    for p in phases {
        for c in &p.puts {
            println!(
                "  {} to node {}: {} bytes in {} sections, {} write WQEs (largest {} bytes) + {} signal",
                p.label(),
                c.node,
                c.bytes,
                c.segments,
                c.write_wqes,
                c.largest_wqe,
                c.signal_wqes
            );
        }
    }
}

/// The `phases` object of a record: per phase label, the means over ranks of its times and
/// bytes (ranks whose phases differ in labels are left out: every rank runs the same code, so
/// they do not).
fn phases_json(per_rank: &[&[PhaseTiming]], sync_us: f64) -> String {
    let Some(first) = per_rank.first() else {
        return "{}".into();
    };
    let same = |p: &&[PhaseTiming]| {
        p.len() == first.len()
            && p.iter()
                .zip(first.iter())
                .all(|(a, b)| a.label() == b.label())
    };
    let ranks: Vec<&[PhaseTiming]> = per_rank.iter().copied().filter(same).collect();
    let n = ranks.len() as f64;
    let mut fields: Vec<String> = (0..first.len())
        .map(|i| {
            let mean = |f: fn(&PhaseTiming) -> f64| ranks.iter().map(|r| f(&r[i])).sum::<f64>() / n;
            let writes: u64 = first[i].puts.iter().map(|c| c.write_wqes).sum();
            let signals: u64 = first[i].puts.iter().map(|c| c.signal_wqes).sum();
            let wqes = if first[i].puts.is_empty() {
                String::new()
            } else {
                format!(", \"write_wqes\": {writes}, \"signal_wqes\": {signals}")
            };
            format!(
                "{}: {{\"gpu_us\": {}, \"host_us\": {}, \"bytes\": {}{wqes}}}",
                json_str(&first[i].label()),
                json_num(mean(|p| p.gpu_us)),
                json_num(mean(|p| p.host_us)),
                json_num(mean(|p| p.bytes as f64)),
            )
        })
        .collect();
    fields.push(format!(
        "\"synchronize (bench)\": {{\"host_us\": {}}}",
        json_num(sync_us)
    ));
    format!("{{{}}}", fields.join(", "))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let a = parse()?;
    let gpus = visible_gpus_or_exit("bench_internode");
    let topo = Topology::virtual_nodes(a.size.nodes, a.size.rpn)?;
    let world = topo.world();
    let ctxs = ep_kernels::testing::rank_contexts(world, gpus)?;
    let used_gpus = gpus.min(world);
    let machine = format!("{}x {}", used_gpus, ctxs[0].name().unwrap_or_default());
    println!(
        "bench_internode: {} nodes x {} ranks ({}), {} tokens x {}, top-{} of {} experts, NIC {}",
        a.size.nodes,
        a.size.rpn,
        ep_kernels::testing::mapping(world, gpus),
        a.size.tokens,
        a.size.hidden,
        a.size.topk,
        a.size.experts,
        if a.shape {
            "shaped to 400 Gb/s (50 GB/s, 2 us)"
        } else {
            "unshaped"
        }
    );
    let mut bo = BufferOptions::new(a.size.tokens, a.size.hidden, a.size.topk, a.size.experts);
    bo.timeout = Duration::from_secs(60);
    bo.max_live_outputs = 1;
    let opts = InternodeOptions {
        buffer: bo,
        nic: NicChoice::Emulated,
        nic_handler: HandlerChoice::Gpu,
    };
    let mut bufs = InternodeBuffer::create_group(&ctxs, &topo, &opts)?;
    if a.shape {
        for b in &bufs {
            b.set_fault_plan(ibgda_emu::FaultPlan::nic_400g())?;
        }
    }
    let sms = bufs[0].nvl_sms();
    let mut rng = Rng::new(0x5eed);
    let inputs: Vec<Input> = (0..world).map(|_| gen(&a, &mut rng)).collect();
    // Rows each rank receives and tokens it sends to other nodes, from the reference layout.
    let rpn = a.size.rpn;
    let mut want_rows = vec![0usize; world];
    let mut rdma_tokens = vec![0usize; world];
    for (s, inp) in inputs.iter().enumerate() {
        let l = reference::layout(&inp.ids, a.size.topk, &topo, a.size.experts)?;
        for (d, c) in l.tokens_per_rank.iter().enumerate() {
            want_rows[d] += *c as usize;
        }
        rdma_tokens[s] = l
            .tokens_per_rdma_rank
            .iter()
            .enumerate()
            .filter(|(n, _)| *n != s / rpn)
            .map(|(_, c)| *c as usize)
            .sum();
    }
    let date = utc_date();
    let meet = ThreadGroup::with_timeout(world, MEET_BOUND)?;
    let mut records = Vec::new();
    println!(
        "{:<20} {:<5} {:>4} {:>10} {:>10} {:>10}",
        "bench", "dtype", "sms", "us", "rdma GB/s", "nvl GB/s"
    );
    for &fp8 in &a.dtypes {
        let timings: Vec<Result<Timing>> = on_rank_threads(&mut bufs, |r, buf| {
            run_rank(
                buf,
                &ctxs[r],
                &a,
                &inputs[r],
                fp8,
                want_rows[r],
                rdma_tokens[r],
                &meet[r],
            )
        });
        let timings: Vec<Timing> = timings.into_iter().collect::<Result<_>>()?;
        let dtype = if fp8 { "fp8" } else { "bf16" };
        for (bench, us_of) in [
            (
                "internode_dispatch",
                (|t: &Timing| t.dispatch_us) as fn(&Timing) -> f64,
            ),
            ("internode_combine", |t: &Timing| t.combine_us),
        ] {
            // Combine moves BF16 rows back whatever the dispatch dtype.
            let scale = if bench == "internode_combine" && fp8 {
                2.0 / (1.0 + 4.0 / 128.0)
            } else {
                1.0
            };
            let n = timings.len() as f64;
            let us = timings.iter().map(us_of).sum::<f64>() / n;
            let rdma = timings
                .iter()
                .map(|t| t.rdma_bytes * scale / us_of(t) / 1e3)
                .sum::<f64>()
                / n;
            let nvl = timings
                .iter()
                .map(|t| t.nvl_bytes * scale / us_of(t) / 1e3)
                .sum::<f64>()
                / n;
            println!("{bench:<20} {dtype:<5} {sms:>4} {us:>10.1} {rdma:>10.2} {nvl:>10.2}");
            let phases = match timings.iter().all(|t| t.phases.is_some()) {
                true => {
                    let combine = bench == "internode_combine";
                    let per_rank: Vec<&[PhaseTiming]> = timings
                        .iter()
                        .filter_map(|t| t.phases.as_ref())
                        .map(|p| {
                            if combine {
                                &p.combine[..]
                            } else {
                                &p.dispatch[..]
                            }
                        })
                        .collect();
                    let sync = timings
                        .iter()
                        .filter_map(|t| t.phases.as_ref())
                        .map(|p| {
                            if combine {
                                p.combine_sync_us
                            } else {
                                p.dispatch_sync_us
                            }
                        })
                        .sum::<f64>()
                        / n;
                    format!(", \"phases\": {}", phases_json(&per_rank, sync))
                }
                false => String::new(),
            };
            records.push(format!(
                "  {{\"bench\": \"{bench}\", \"dtype\": \"{dtype}\", \"rdma_gbps\": {rdma:.2}, \"nvl_gbps\": {nvl:.2}, \"line_rate_gbps\": {}, \"us\": {us:.1}, \"sms\": {sms}, \"ranks\": {}, \"nodes\": {}, \"ranks_per_node\": {}, \"gpus\": {used_gpus}, \"tokens\": {}, \"hidden\": {}, \"topk\": {}, \"experts\": {}, \"shaped\": {}, \"date\": \"{date}\", \"machine\": \"{machine}\"{phases}}}",
                if a.shape { format!("{LINE_RATE_GBPS:.1}") } else { "null".into() },
                a.size.nodes * a.size.rpn,
                a.size.nodes,
                a.size.rpn,
                a.size.tokens,
                a.size.hidden,
                a.size.topk,
                a.size.experts,
                a.shape
            ));
        }
        for (r, t) in timings.iter().enumerate() {
            if let Some(p) = &t.phases {
                print_phases(r, dtype, "dispatch", &p.dispatch, p.dispatch_sync_us);
                print_phases(r, dtype, "combine", &p.combine, p.combine_sync_us);
            }
        }
    }
    drop_on_rank_threads(bufs);
    if let Some(p) = &a.json {
        ep_examples::bench::write_records(p, &records)?;
    }
    Ok(())
}
