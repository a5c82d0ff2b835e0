//! Low-latency dispatch and combine, ranks as threads (by default one per visible GPU, at most 8;
//! `--ranks N` runs N ranks round robin over the GPUs, sharing them where there are fewer): each rank
//! sends its tokens to its top-k experts with an in-kernel FP8 cast, "runs" the experts (each
//! returns its dequantized input), and combines the outputs back weighted by the top-k weights.
//! With weights summing to 1 the combined row is the token again, up to FP8 and BF16 rounding;
//! the program checks that, checks the routing against `ep::low_latency::reference`, and prints
//! one line per rank. Exits 2 where there is no GPU, or only one and no `--ranks`.
//!
//! `--no-nvlink` sends every byte between ranks through the IBGDA transport on the emulated NIC
//! (`--handler gpu|cpu_host_memory|cpu|auto` picks who rings the doorbells).
//!
//! `low_latency [--ranks N] [--tokens N] [--hidden H] [--topk K] [--experts-per-rank E] [--hook]
//!  [--no-nvlink] [--handler MODE]` (`--help` says what each does).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ep::low_latency::{
    reference, Fp8Options, LlCombineArgs, LlCombineX, LlDispatchArgs, LlRecvX, LlScales,
    LowLatencyBuffer, LowLatencyOptions,
};
use ep::{Bf16, Tensor};
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;
use ibgda_device::protocol::HandlerChoice;

const USAGE: &str = "\
usage: low_latency [options]

Low-latency dispatch (FP8) and combine, ranks as threads, checked against the reference.

options:
  --ranks N               ranks, 2..=8 (default: one per visible GPU); round robin over the
                          GPUs, several per GPU when there are fewer GPUs than ranks
  --tokens N              tokens per rank (default 128)
  --hidden H              hidden size (default 7168)
  --topk K                experts per token (default 8)
  --experts-per-rank E    local experts per rank (default 16)
  --hook                  receive through the hook (send, then receive on demand)
  --no-nvlink             every byte between ranks through the IBGDA transport (emulated NIC)
  --handler MODE          NIC-handler mode with --no-nvlink: gpu | cpu | cpu_host_memory | auto
  -h, --help              this text
";

struct Args {
    ranks: Option<usize>,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts_per_rank: usize,
    hook: bool,
    nvlink: bool,
    handler: HandlerChoice,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        ranks: None,
        tokens: 128,
        hidden: 7168,
        topk: 8,
        experts_per_rank: 16,
        hook: false,
        nvlink: true,
        handler: HandlerChoice::Auto,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        let mut v = || it.next().with_context(|| format!("{f} needs a value"));
        match f.as_str() {
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            "--ranks" => a.ranks = Some(v()?.parse()?),
            "--tokens" => a.tokens = v()?.parse()?,
            "--hidden" => a.hidden = v()?.parse()?,
            "--topk" => a.topk = v()?.parse()?,
            "--experts-per-rank" => a.experts_per_rank = v()?.parse()?,
            "--hook" => a.hook = true,
            "--no-nvlink" => a.nvlink = false,
            "--handler" => a.handler = v()?.parse()?,
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    Ok(a)
}

struct Report {
    rows: usize,
    max_rel_err: f32,
}

fn rank_main(
    b: &mut LowLatencyBuffer,
    a: &Args,
    ids: &[i32],
    routing: &reference::Routing,
) -> Result<Report> {
    let ctx = b.context().clone();
    let r = b.rank();
    let mut rng = Rng::new(0x1234 + r as u64);
    let x: Vec<Bf16> = (0..a.tokens * a.hidden)
        .map(|_| Bf16::from_f32(rng.below(4000) as f32 / 1000.0 - 2.0))
        .collect();
    let xt = Tensor::from_host(&ctx, &x, &[a.tokens, a.hidden])?;
    let idx = Tensor::from_host(&ctx, ids, &[a.tokens, a.topk])?;
    // Weights of each token sum to 1 over its experts.
    let mut w = vec![0.0f32; a.tokens * a.topk];
    for t in 0..a.tokens {
        let n = ids[t * a.topk..(t + 1) * a.topk]
            .iter()
            .filter(|&&e| e >= 0)
            .count()
            .max(1);
        for k in 0..a.topk {
            if ids[t * a.topk + k] >= 0 {
                w[t * a.topk + k] = 1.0 / n as f32;
            }
        }
    }
    let wt = Tensor::from_host(&ctx, &w, &[a.tokens, a.topk])?;

    let mut d = LlDispatchArgs::new(&xt, &idx);
    d.fp8 = Some(Fp8Options {
        round_scale: true,
        ue8m0: false,
    });
    d.return_recv_hook = a.hook;
    let mut out = b.dispatch(&d)?;
    if let Some(h) = out.hook.take() {
        h.call()?;
    }
    b.synchronize()?;

    // The "experts": each returns its dequantized input, written straight into the combine
    // buffer (zero-copy).
    let (local, cap, h) = (b.num_local_experts(), b.ranks() * a.tokens, a.hidden);
    let counts = out.recv_count.to_host()?;
    let LlRecvX::Fp8 { x: q, scales } = &out.x else {
        bail!("asked for FP8")
    };
    let LlScales::F32(scales) = scales else {
        bail!("asked for f32 scales")
    };
    let (q, s) = (q.to_host()?, scales.to_host()?);
    let mut expert_out = vec![Bf16::from_f32(0.0); local * cap * h];
    for (l, &n) in counts.iter().enumerate().take(local) {
        if n as usize != routing.rows[r][l].len() {
            bail!(
                "rank {r} expert {l}: {n} rows, the reference says {}",
                routing.rows[r][l].len()
            );
        }
        for j in 0..n as usize {
            let row = l * cap + j;
            for c in 0..h {
                expert_out[row * h + c] =
                    Bf16::from_f32(q[row * h + c].to_f32() * s[row * (h / 128) + c / 128]);
            }
        }
    }
    let staged = Tensor::from_host(&ctx, &expert_out, &[local, cap, h])?;
    let mut c = LlCombineArgs::new(LlCombineX::Tensor(&staged), &idx, &wt, &out.handle);
    c.return_recv_hook = a.hook;
    let mut co = b.combine(&c)?;
    if let Some(hk) = co.hook.take() {
        hk.call()?;
    }
    b.synchronize()?;
    let y = co.x.to_host()?;
    let mut max_rel_err = 0.0f32;
    for t in 0..a.tokens {
        if ids[t * a.topk..(t + 1) * a.topk].iter().all(|&e| e < 0) {
            continue;
        }
        for c in 0..h {
            let (got, want) = (y[t * h + c].to_f32(), x[t * h + c].to_f32());
            max_rel_err = max_rel_err.max((got - want).abs() / want.abs().max(0.25));
        }
    }
    Ok(Report {
        rows: counts.iter().map(|&n| n as usize).sum(),
        max_rel_err,
    })
}

fn main() -> Result<()> {
    let a = parse()?;
    let gpus = match ibgda_device::cuda::device_count() {
        Ok(0) => {
            eprintln!("low_latency: no CUDA GPU is visible on this machine");
            std::process::exit(2);
        }
        Ok(g) => g,
        Err(e) => {
            eprintln!("low_latency: {e}");
            std::process::exit(2);
        }
    };
    let n = match a.ranks {
        Some(n) if (2..=8).contains(&n) => n,
        Some(n) => bail!("--ranks {n} out of 2..=8"),
        None if gpus >= 2 => gpus.min(8),
        None => {
            eprintln!(
                "low_latency: needs at least 2 ranks; one GPU found: pass --ranks N to share it"
            );
            std::process::exit(2);
        }
    };
    let shared = if n > gpus {
        " (ranks share GPUs: timings here are not NVLink figures)"
    } else {
        ""
    };
    println!(
        "low_latency: {}{shared}",
        ep_kernels::testing::mapping(n, gpus)
    );
    let experts = a.experts_per_rank * n;
    let ctxs: Vec<Arc<CudaContext>> = ep_kernels::testing::rank_contexts(n, gpus)?;
    let mut opts = LowLatencyOptions::new(a.tokens, a.hidden, a.topk, experts);
    opts.allow_nvlink = a.nvlink;
    opts.nic_handler = a.handler;
    let mut bufs = LowLatencyBuffer::create_group(&ctxs, &opts)?;

    let mut rng = Rng::new(42);
    let ids: Vec<Vec<i32>> = (0..n)
        .map(|_| {
            let mut v = Vec::new();
            for _ in 0..a.tokens {
                let mut chosen: Vec<i32> = Vec::new();
                while chosen.len() < a.topk.min(experts) {
                    let e = rng.below(experts as u64) as i32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                chosen.resize(a.topk, -1);
                v.extend(chosen);
            }
            v
        })
        .collect();
    let routing = reference::route(&ids, a.topk, experts);
    let reports: Vec<Result<Report>> = std::thread::scope(|s| {
        let (a, ids, routing) = (&a, &ids, &routing);
        let joins: Vec<_> = bufs
            .iter_mut()
            .map(|b| s.spawn(move || rank_main(b, a, &ids[b.rank()], routing)))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("rank thread panicked"))
            .collect()
    });
    std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        joins
            .into_iter()
            .try_for_each(|j| j.join().expect("teardown panicked"))
    })?;
    let mut worst = 0.0f32;
    for (r, rep) in reports.into_iter().enumerate() {
        let rep = rep?;
        println!(
            "rank {r}: received {} rows over {} local experts; combine max relative error {:.4}",
            rep.rows, a.experts_per_rank, rep.max_rel_err
        );
        worst = worst.max(rep.max_rel_err);
    }
    // FP8 e4m3 keeps 3 mantissa bits (relative step 1/16), BF16 8.
    if worst > 0.1 {
        bail!("combined rows differ from the tokens by up to {worst:.4} (relative)");
    }
    println!("low_latency: EP{n} dispatch (FP8) + combine round trip OK");
    Ok(())
}
