//! Intranode dispatch/combine benchmark with DeepEP's sizes and byte counting.
//!
//! Ranks are threads, one per visible GPU (at most 8). Each rank sends 4096 tokens of hidden
//! 7168, each to the ranks of its top-8 of 256 experts (uniform random). Dispatch is timed as a
//! cached dispatch (as DeepEP tunes it: the routes are known, only x moves), combine over the
//! same handle. GB/s = rows received × hidden × bytes per element ÷ time (FP8: 1 + 4/128 bytes
//! per element), averaged over ranks. Sweeps SMs and block size; prints a table and writes
//! the best block size per (op, dtype, SMs) as JSON records.
//!
//! `bench_intranode [--json PATH] [--tokens N] [--hidden H] [--topk K] [--experts E]
//!  [--sms 8,16,24] [--threads 256,512,1024] [--iters N]`

use ep_examples::bench::utc_date as date_utc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, Config, DispatchArgs, DispatchX, Event, Fp8E4M3,
    StreamOrder, Tensor, TopK,
};
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;

struct Args {
    json: Option<String>,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    sms: Vec<u32>,
    threads: Vec<u32>,
    iters: usize,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        json: None,
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
        let mut v = || it.next().with_context(|| format!("{f} needs a value"));
        match f.as_str() {
            "--json" => a.json = Some(v()?),
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

/// (op, dtype, sms, threads, µs, GB/s) per measurement, averaged over ranks.
type Row = (&'static str, &'static str, u32, u32, f64, f64);

struct RankData {
    ids: Tensor<i32>,
    weights: Tensor<f32>,
    x_bf16: Tensor<Bf16>,
    x_fp8: Tensor<Fp8E4M3>,
    scales: Tensor<f32>,
}

fn make_rank(ctx: &Arc<CudaContext>, a: &Args, rng: &mut Rng) -> Result<RankData> {
    let (t, h, k) = (a.tokens, a.hidden, a.topk);
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<i32> = Vec::with_capacity(k);
        while row.len() < k {
            let e = rng.below(a.experts as u64) as i32;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        ids.extend(row);
    }
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
    Ok(RankData {
        ids: Tensor::from_host(ctx, &ids, &[t, k])?,
        weights: Tensor::from_host(ctx, &w, &[t, k])?,
        x_bf16: Tensor::from_host(ctx, &xb, &[t, h])?,
        x_fp8: Tensor::from_host(ctx, &xf, &[t, h])?,
        scales: Tensor::from_host(ctx, &s, &[t, h / 128])?,
    })
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

fn main() -> Result<()> {
    let a = parse()?;
    let n = match ibgda_device::cuda::device_count() {
        Ok(0) | Err(_) => {
            eprintln!(
                "bench_intranode: no CUDA GPU is visible on this machine; run it on a GPU machine"
            );
            std::process::exit(2);
        }
        Ok(n) => n.min(8),
    };
    if n < 2 {
        eprintln!("bench_intranode: needs at least 2 GPUs, found {n}");
        std::process::exit(2);
    }
    let ctxs: Vec<Arc<CudaContext>> = (0..n)
        .map(ibgda_device::cuda::context)
        .collect::<Result<_, _>>()?;
    let machine = format!("{}x {}", n, ctxs[0].name().unwrap_or_default());
    let mut opts = BufferOptions::new(a.tokens, a.hidden, a.topk, a.experts);
    opts.max_live_outputs = 4;
    let mut bufs = Buffer::create_group(&ctxs, &opts)?;
    let mut rng = Rng::new(0x5eed);
    let data: Vec<RankData> = ctxs
        .iter()
        .map(|c| make_rank(c, &a, &mut rng))
        .collect::<Result<_>>()?;
    let per_rank: Vec<Result<Vec<Row>>> = std::thread::scope(|s| {
        let js: Vec<_> = bufs
            .iter_mut()
            .zip(&data)
            .map(|(b, d)| s.spawn(|| rank_sweep(b, d, &a)))
            .collect();
        js.into_iter()
            .map(|j| j.join().unwrap_or_else(|_| bail!("rank thread panicked")))
            .collect()
    });
    let per_rank: Vec<Vec<Row>> = per_rank.into_iter().collect::<Result<_>>()?;
    // Average over ranks (every rank measured the same configurations in the same order).
    let mut avg: Vec<Row> = per_rank[0].clone();
    for (i, row) in avg.iter_mut().enumerate() {
        row.4 = per_rank.iter().map(|r| r[i].4).sum::<f64>() / n as f64;
        row.5 = per_rank.iter().map(|r| r[i].5).sum::<f64>() / n as f64;
    }
    println!(
        "EP{n} on {machine}: {} tokens x {} hidden, top-{} of {} experts",
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
    println!("best per SM count:");
    let date = date_utc();
    let mut json = String::from("[\n");
    for (i, r) in best.iter().enumerate() {
        println!(
            "  {:<20} {:<5} {:>3} SMs: {:>7.1} GB/s {:>8.1} us (threads {})",
            r.0, r.1, r.2, r.5, r.4, r.3
        );
        json.push_str(&format!(
            "  {{\"bench\": \"{}\", \"ranks\": {n}, \"dtype\": \"{}\", \"sms\": {}, \"gbps\": {:.1}, \"us\": {:.1}, \"date\": \"{date}\", \"machine\": \"{machine}\", \"block_threads\": {}, \"tokens\": {}, \"hidden\": {}, \"topk\": {}, \"experts\": {}}}{}\n",
            r.0, r.1, r.2, r.5, r.4, r.3, a.tokens, a.hidden, a.topk, a.experts, if i + 1 < best.len() { "," } else { "" }
        ));
    }
    json.push_str("]\n");
    if let Some(p) = &a.json {
        std::fs::write(p, json).with_context(|| format!("writing {p}"))?;
        println!("wrote {p}");
    }
    Ok(())
}
