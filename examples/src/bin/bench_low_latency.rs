//! Low-latency dispatch/combine benchmark with DeepEP's sizes: 128 tokens per rank of hidden
//! 7168, each to its top-8 of 288 experts (uniform random), ranks as threads, one per visible
//! GPU (at most 8; `--ranks N` for another count: ranks share GPUs round robin where there are
//! fewer, and such figures are not NVLink figures). Runs twice: NVLink allowed (the targets),
//! then with NVLink disabled, every byte through the IBGDA transport on the emulated NIC (reported, no
//! target; `--transport-handler gpu|cpu_host_memory`, `--no-transport` to skip).
//!
//! Dispatch (BF16, FP8) and dispatch + combine are each captured `--iters` times (rounded up to
//! even, so the double-buffered halves keep alternating across replays) into one CUDA graph on
//! the buffer's (non-default) stream, instantiated once, replayed once to warm up, then replayed
//! `REPLAYS` times between two events recorded on that stream outside the capture; after a
//! synchronize the elapsed time is divided by the operations run (combine = the pair minus the
//! dispatch). The host's launch rate does not show; the mean over ranks is reported. Hook-mode
//! send and receive halves are timed with host-queued events behind a sleep kernel (median), an
//! upper bound (printed, and recorded as `hook_send_us`/`hook_recv_us` on the BF16 records).
//! Fixed-cost diagnostics, graph-timed the same way and recorded on the BF16 records: dispatch
//! and combine with only 8 tokens per rank (`us_8_tokens`; close to the full time means a
//! per-kernel cost, not a per-byte one) and dispatch on half the SMs (`us_half_sms`).
//! GB/s = rows received × hidden × bytes per element ÷ time (FP8: 1 + 4/128 bytes per element).
//!
//! With `--procs` the ranks are processes: the program starts them itself
//! (`ep::bootstrap::Launcher`: one copy of itself per GPU, rendezvous over TCP on loopback), rank
//! 0 gathers the timings, prints the tables and writes the JSON (records carry `"mode": "procs"`,
//! else `"threads"`). Both runs as with threads: NVLink (the buffers shared through CUDA IPC),
//! then the transport (one emulated NIC per process, each opening its peers' registered buffers
//! through CUDA IPC).
//!
//! `bench_low_latency [--procs] [--json PATH] [--ranks N] [--tokens N] [--hidden H] [--topk K]
//!  [--experts E] [--iters N] [--transport-iters N] [--transport-handler MODE] [--no-transport]`;
//! exits 2 with a message where there is no GPU.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ep::bootstrap::{Communicator, Launcher, TcpCommunicator};
use ep::low_latency::{
    Fp8Options, LlCombineArgs, LlCombineX, LlDispatchArgs, LowLatencyBuffer, LowLatencyOptions,
};
use ep::{Bf16, EpError, Event, Tensor};
use ep_examples::bench::utc_date as date_utc;
use ep_examples::ranks::random_topk_ids;
use ep_kernels::testing::Rng;
use ibgda_device::cuda::CudaContext;
use ibgda_device::protocol::HandlerChoice;
use std::time::Duration;

/// Timed replays of each graph (after one warm-up replay).
const REPLAYS: usize = 5;

struct Args {
    procs: bool,
    json: Option<String>,
    ranks: Option<usize>,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    iters: usize,
    transport_iters: usize,
    transport_handler: HandlerChoice,
    transport: bool,
}

const USAGE: &str = "\
usage: bench_low_latency [--procs] [--json PATH] [--ranks N] [--tokens N] [--hidden H]
                         [--topk K] [--experts E] [--iters N] [--transport-iters N]
                         [--transport-handler MODE] [--no-transport]

Low-latency dispatch/combine latency (CUDA-graph replay) over NVLink, then over the IBGDA
transport on the emulated NIC (NVLink disabled).
  --procs               ranks as processes (CUDA IPC) instead of threads
  --json PATH           write the records as JSON
  --ranks N             ranks (default: one per visible GPU); ranks share GPUs round robin where
                        there are fewer (such figures are not NVLink figures)
  --tokens/--hidden/--topk/--experts   the problem (default 128 x 7168, top-8 of 288)
  --iters N             operations per graph over NVLink (default 50)
  --transport-iters N   operations per graph over the transport (default 10)
  --transport-handler   gpu | cpu_host_memory | cpu | auto (default gpu)
  --no-transport        skip the transport run
";

fn parse() -> Result<Args> {
    ep_examples::exit_on_help(USAGE);
    let mut a = Args {
        procs: false,
        json: None,
        ranks: None,
        tokens: 128,
        hidden: 7168,
        topk: 8,
        experts: 288,
        iters: 50,
        transport_iters: 10,
        transport_handler: HandlerChoice::Gpu,
        transport: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        let mut v = || it.next().with_context(|| format!("{f} needs a value"));
        match f.as_str() {
            "--procs" => a.procs = true,
            "--json" => a.json = Some(v()?),
            "--ranks" => a.ranks = Some(v()?.parse()?),
            "--tokens" => a.tokens = v()?.parse()?,
            "--hidden" => a.hidden = v()?.parse()?,
            "--topk" => a.topk = v()?.parse()?,
            "--experts" => a.experts = v()?.parse()?,
            "--iters" => a.iters = v()?.parse()?,
            "--transport-iters" => a.transport_iters = v()?.parse()?,
            "--transport-handler" => a.transport_handler = v()?.parse()?,
            "--no-transport" => a.transport = false,
            other => bail!("unknown argument {other}"),
        }
    }
    // An even count: a graph's dispatches (and combines) then start and end on the same half, so
    // back-to-back replays keep alternating halves.
    a.iters = a.iters.max(2).div_ceil(2) * 2;
    a.transport_iters = a.transport_iters.max(2).div_ceil(2) * 2;
    Ok(a)
}

/// Median microseconds per timed phase of one rank.
#[derive(Debug, Default, Clone)]
struct Times {
    dispatch_bf16: f64,
    dispatch_fp8: f64,
    combine: f64,
    dispatch_send: f64,
    dispatch_recv: f64,
    combine_send: f64,
    combine_recv: f64,
    /// Diagnostics of the fixed cost: BF16 dispatch and combine with only [`SMALL_TOKENS`]
    /// tokens per rank, and BF16 dispatch on half the SMs.
    dispatch_small: f64,
    combine_small: f64,
    dispatch_half_sms: f64,
    rows: usize,
}

impl Times {
    /// Every field as an f64 (the row count exactly: far below 2^53), for the gather to rank 0.
    fn to_words(&self) -> [f64; 11] {
        [
            self.dispatch_bf16,
            self.dispatch_fp8,
            self.combine,
            self.dispatch_send,
            self.dispatch_recv,
            self.combine_send,
            self.combine_recv,
            self.dispatch_small,
            self.combine_small,
            self.dispatch_half_sms,
            self.rows as f64,
        ]
    }

    fn from_words(w: [f64; 11]) -> Self {
        Self {
            dispatch_bf16: w[0],
            dispatch_fp8: w[1],
            combine: w[2],
            dispatch_send: w[3],
            dispatch_recv: w[4],
            combine_send: w[5],
            combine_recv: w[6],
            dispatch_small: w[7],
            combine_small: w[8],
            dispatch_half_sms: w[9],
            rows: w[10] as usize,
        }
    }
}

/// Tokens per rank of the fixed-cost diagnostic (a time close to the full run's means the cost
/// is per kernel, not per byte).
const SMALL_TOKENS: usize = 8;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn us(a: &Event, b: &Event) -> Result<f64, EpError> {
    Ok(f64::from(a.elapsed_ms(b)?) * 1000.0)
}

/// Microseconds per operation of `iters` calls of `op` captured into one graph: the graph is
/// instantiated once, replayed once to warm up, then [`REPLAYS`] times between two events
/// recorded on the buffer's stream outside the capture (a graph replays on the stream it was
/// captured from). Every rank replays the same number of times: the operations are collectives.
fn time_graph(
    b: &mut LowLatencyBuffer,
    stream: &Arc<ibgda_device::cuda::CudaStream>,
    iters: usize,
    op: impl Fn(&mut LowLatencyBuffer) -> Result<(), EpError>,
) -> Result<f64, EpError> {
    let (g, ()) = b.capture(|b| (0..iters).try_for_each(|_| op(b)))?;
    g.replay()?;
    b.synchronize()?;
    let e0 = Event::timed(stream)?;
    for _ in 0..REPLAYS {
        g.replay()?;
    }
    let e1 = Event::timed(stream)?;
    b.synchronize()?;
    Ok(us(&e0, &e1)? / (iters * REPLAYS).max(1) as f64)
}

/// One rank's whole benchmark.
fn run_rank(b: &mut LowLatencyBuffer, a: &Args, iters: usize, seed: u64) -> Result<Times, EpError> {
    let ctx = b.context().clone();
    let stream = b.stream().clone();
    let mut rng = Rng::new(seed);
    let t = a.tokens;
    let x_host: Vec<Bf16> = (0..t * a.hidden)
        .map(|_| Bf16::from_f32(rng.below(2000) as f32 / 1000.0 - 1.0))
        .collect();
    let ids = random_topk_ids(&mut rng, t, a.topk, a.experts);
    let w_host: Vec<f32> = (0..t * a.topk).map(|_| 1.0 / a.topk as f32).collect();
    let x = Tensor::from_host(&ctx, &x_host, &[t, a.hidden])?;
    let idx = Tensor::from_host(&ctx, &ids, &[t, a.topk])?;
    let w = Tensor::from_host(&ctx, &w_host, &[t, a.topk])?;
    let ts = t.min(SMALL_TOKENS);
    let xs = Tensor::from_host(&ctx, &x_host[..ts * a.hidden], &[ts, a.hidden])?;
    let idxs = Tensor::from_host(&ctx, &ids[..ts * a.topk], &[ts, a.topk])?;
    let ws = Tensor::from_host(&ctx, &w_host[..ts * a.topk], &[ts, a.topk])?;
    let (local, cap) = (b.num_local_experts(), b.ranks() * a.tokens);
    let comb_in = Tensor::filled(&ctx, Bf16::from_f32(0.5), &[local, cap, a.hidden])?;
    let fp8 = Some(Fp8Options::default());

    // Warm-up, and the received row count.
    let mut rows = 0;
    for i in 0..5 {
        let mut d = LlDispatchArgs::new(&x, &idx);
        d.fp8 = if i % 2 == 1 { fp8 } else { None };
        let o = b.dispatch(&d)?;
        let c = b.combine(&LlCombineArgs::new(
            LlCombineX::Tensor(&comb_in),
            &idx,
            &w,
            &o.handle,
        ))?;
        b.synchronize()?;
        rows = o
            .recv_count
            .to_host()?
            .iter()
            .map(|&n| n.max(0) as usize)
            .sum();
        drop((o, c));
    }

    // Whole-graph timings: `iters` operations captured into one graph, replayed once to warm up
    // and once between two events (events inside a graph carry no timestamps).
    let d16 = time_graph(b, &stream, iters, |b| {
        b.dispatch(&LlDispatchArgs::new(&x, &idx)).map(drop)
    })?;
    let d8 = time_graph(b, &stream, iters, |b| {
        let mut d = LlDispatchArgs::new(&x, &idx);
        d.fp8 = fp8;
        b.dispatch(&d).map(drop)
    })?;
    let pair = time_graph(b, &stream, iters, |b| {
        let o = b.dispatch(&LlDispatchArgs::new(&x, &idx))?;
        let c = b.combine(&LlCombineArgs::new(
            LlCombineX::Tensor(&comb_in),
            &idx,
            &w,
            &o.handle,
        ))?;
        drop((o, c));
        Ok(())
    })?;

    // Fixed-cost diagnostics: a few tokens per rank, and half the SMs.
    let ds_small = time_graph(b, &stream, iters, |b| {
        b.dispatch(&LlDispatchArgs::new(&xs, &idxs)).map(drop)
    })?;
    let pair_small = time_graph(b, &stream, iters, |b| {
        let o = b.dispatch(&LlDispatchArgs::new(&xs, &idxs))?;
        let c = b.combine(&LlCombineArgs::new(
            LlCombineX::Tensor(&comb_in),
            &idxs,
            &ws,
            &o.handle,
        ))?;
        drop((o, c));
        Ok(())
    })?;
    let half_sms = (b.sm_budget() / 2).max(1);
    let d_half = time_graph(b, &stream, iters, |b| {
        let mut d = LlDispatchArgs::new(&x, &idx);
        d.num_sms = Some(half_sms);
        b.dispatch(&d).map(drop)
    })?;

    // Hook mode: send and receive halves timed separately with events queued by the host
    // (behind a sleep kernel long enough for the host to queue them all: about 1 ms per
    // iteration, with ranks as threads sharing the driver); where the host still queues slower
    // than the GPU runs, these include launch gaps and are upper bounds.
    let mut hooks = Vec::new();
    b.sleep_on_stream(Duration::from_millis(20 + iters as u64))?;
    for _ in 0..iters {
        let mut d = LlDispatchArgs::new(&x, &idx);
        d.return_recv_hook = true;
        let e0 = Event::timed(&stream)?;
        let mut o = b.dispatch(&d)?;
        let e1 = Event::timed(&stream)?;
        if let Some(h) = o.hook.take() {
            h.call()?;
        }
        let e2 = Event::timed(&stream)?;
        let mut ca = LlCombineArgs::new(LlCombineX::Tensor(&comb_in), &idx, &w, &o.handle);
        ca.return_recv_hook = true;
        let mut c = b.combine(&ca)?;
        let e3 = Event::timed(&stream)?;
        if let Some(h) = c.hook.take() {
            h.call()?;
        }
        let e4 = Event::timed(&stream)?;
        drop((o, c));
        hooks.push([e0, e1, e2, e3, e4]);
    }
    b.synchronize()?;
    let mut phases: [Vec<f64>; 4] = Default::default();
    for e in &hooks {
        for (p, v) in phases.iter_mut().enumerate() {
            v.push(us(&e[p], &e[p + 1])?);
        }
    }
    let [ds, dr, cs, cr] = phases;
    Ok(Times {
        dispatch_bf16: d16,
        dispatch_fp8: d8,
        combine: pair - d16,
        dispatch_small: ds_small,
        combine_small: pair_small - ds_small,
        dispatch_half_sms: d_half,
        dispatch_send: median(ds),
        dispatch_recv: median(dr),
        combine_send: median(cs),
        combine_recv: median(cr),
        rows,
    })
}

fn main() -> Result<()> {
    let a = parse()?;
    let n = match ibgda_device::cuda::device_count() {
        Ok(0) | Err(_) => {
            eprintln!("bench_low_latency: no CUDA GPU is visible on this machine; run it on a GPU machine");
            std::process::exit(2);
        }
        Ok(n) => n.min(8),
    };
    let ranks = a.ranks.unwrap_or(n);
    if !(1..=8).contains(&ranks) {
        eprintln!("bench_low_latency: --ranks {ranks} out of 1..=8");
        std::process::exit(2);
    }
    println!(
        "bench_low_latency: {}{}",
        ep_kernels::testing::mapping(ranks, n),
        if ranks > n {
            " (ranks share GPUs: these are not NVLink figures)"
        } else {
            ""
        }
    );
    if a.experts % ranks != 0 {
        bail!("{} experts do not split over {ranks} ranks", a.experts);
    }
    if a.procs {
        return run_processes(&a, n, ranks);
    }
    let ctxs: Vec<Arc<CudaContext>> = ep_kernels::testing::rank_contexts(ranks, n)?;
    let machine = format!("{}x {}", n, ctxs[0].name().unwrap_or_default());
    let mut records = Vec::new();
    records.extend(run_config(&ctxs, &a, None, &machine)?);
    // A failing transport run still leaves the NVLink records written, then fails the run.
    let transport = if a.transport {
        run_config(&ctxs, &a, Some(a.transport_handler), &machine)
            .map(|r| records.extend(r))
            .context("the transport run (NVLink disabled)")
    } else {
        Ok(())
    };
    if let Some(p) = &a.json {
        ep_examples::bench::write_records(p, &records)?;
    }
    transport
}

/// Builds the buffers (NVLink allowed, or disabled with the transport in mode `transport`), runs
/// every rank, tears down, prints; returns the JSON records.
fn run_config(
    ctxs: &[Arc<CudaContext>],
    a: &Args,
    transport: Option<HandlerChoice>,
    machine: &str,
) -> Result<Vec<String>> {
    let ranks = ctxs.len();
    let mut opts = LowLatencyOptions::new(a.tokens, a.hidden, a.topk, a.experts);
    let iters = match transport {
        None => a.iters,
        Some(h) => {
            opts.allow_nvlink = false;
            opts.nic_handler = h;
            a.transport_iters
        }
    };
    let mut bufs = LowLatencyBuffer::create_group(ctxs, &opts)?;
    let sms = bufs[0].sm_budget();
    let path = match bufs[0].nic_handler() {
        None => "NVLink".to_string(),
        Some(m) => format!(
            "NVLink disabled, IBGDA on the emulated NIC, mode {}",
            m.name()
        ),
    };
    let results: Vec<Result<Times, EpError>> = std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, b)| s.spawn(move || run_rank(b, a, iters, 0x5eed + r as u64)))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("rank thread panicked"))
            .collect()
    });
    let times: Vec<Times> = results.into_iter().collect::<Result<_, _>>()?;
    std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        joins
            .into_iter()
            .try_for_each(|j| j.join().expect("teardown panicked"))
    })?;
    let run = Run {
        ranks,
        gpus: ep_kernels::testing::distinct_gpus(ctxs),
        sms,
        path,
        machine,
        iters,
        transport,
        mode: "threads",
    };
    Ok(report(a, &run, &times))
}

/// How a measured run was set up, for the table and the JSON records.
struct Run<'a> {
    ranks: usize,
    /// Distinct GPUs the ranks ran on (fewer than `ranks`: ranks shared GPUs).
    gpus: usize,
    sms: u32,
    /// How the data moved, in words.
    path: String,
    machine: &'a str,
    iters: usize,
    transport: Option<HandlerChoice>,
    /// `threads` or `procs`.
    mode: &'static str,
}

/// Prints the table of every rank's `times` (means over ranks); returns the JSON records.
fn report(a: &Args, run: &Run<'_>, times: &[Times]) -> Vec<String> {
    let Run {
        ranks,
        gpus,
        sms,
        ref path,
        machine,
        iters,
        transport,
        mode,
    } = *run;
    let how = if mode == "procs" {
        "ranks as processes"
    } else {
        "ranks as threads"
    };
    let mean = |f: fn(&Times) -> f64| times.iter().map(f).sum::<f64>() / times.len() as f64;
    let rows = times.iter().map(|t| t.rows).sum::<usize>() as f64 / times.len() as f64;
    let h = a.hidden as f64;
    let d16 = mean(|t| t.dispatch_bf16);
    let d8 = mean(|t| t.dispatch_fp8);
    let c = mean(|t| t.combine);
    let gbps = |bytes_per: f64, us: f64| rows * h * bytes_per / us / 1000.0;
    println!(
        "low-latency EP{ranks}, {} tokens x {} hidden, top-{} of {} experts, {sms} SMs, {path}, {how} ({machine}); \
         {rows:.0} rows received per rank; {iters} ops per graph x {REPLAYS} replays",
        a.tokens, a.hidden, a.topk, a.experts
    );
    println!(
        "  dispatch BF16   {d16:8.1} us  {:7.1} GB/s",
        gbps(2.0, d16)
    );
    println!(
        "  dispatch FP8    {d8:8.1} us  {:7.1} GB/s",
        gbps(1.0 + 4.0 / 128.0, d8)
    );
    println!("  combine  BF16   {c:8.1} us  {:7.1} GB/s", gbps(2.0, c));
    let (ds, dr) = (mean(|t| t.dispatch_send), mean(|t| t.dispatch_recv));
    let (cs, cr) = (mean(|t| t.combine_send), mean(|t| t.combine_recv));
    println!(
        "  hook mode, BF16 (host-queued events, upper bounds): dispatch send {ds:8.1} us  recv {dr:8.1} us"
    );
    println!(
        "                                                      combine  send {cs:8.1} us  recv {cr:8.1} us"
    );
    let (d_small, c_small) = (mean(|t| t.dispatch_small), mean(|t| t.combine_small));
    let d_half = mean(|t| t.dispatch_half_sms);
    println!(
        "  diagnostics (BF16): {SMALL_TOKENS} tokens per rank: dispatch {d_small:8.1} us  combine {c_small:8.1} us; dispatch on {} SMs {d_half:8.1} us",
        (sms / 2).max(1)
    );
    for (r, t) in times.iter().enumerate() {
        println!(
            "  rank {r}: dispatch {:.1}/{:.1} us (bf16/fp8), combine {:.1} us",
            t.dispatch_bf16, t.dispatch_fp8, t.combine
        );
    }
    let date = date_utc();
    let nvlink = transport.is_none();
    let handler = transport.map_or("none", HandlerChoice::name);
    // Hook-mode halves ride along on the BF16 records (host-queued events: upper bounds).
    // Extra fields ride along on the BF16 records: the hook-mode halves (host-queued events:
    // upper bounds) and the fixed-cost diagnostics.
    let rec = |bench: &str, dtype: &str, g: f64, u: f64, extra: &str| {
        format!(
            "  {{\"bench\": \"{bench}\", \"ranks\": {ranks}, \"gpus\": {gpus}, \"mode\": \"{mode}\", \"dtype\": \"{dtype}\", \"sms\": {sms}, \"gbps\": {g:.1}, \"us\": {u:.1}, \"date\": \"{date}\", \"machine\": \"{machine}\", \"nvlink\": {nvlink}, \"nic_handler\": \"{handler}\", \"timing\": \"cuda-graph replay, {iters} ops x {REPLAYS} replays\", \"tokens\": {}, \"hidden\": {}, \"topk\": {}, \"experts\": {}, \"rows_per_rank\": {rows:.0}{extra}}}",
            a.tokens, a.hidden, a.topk, a.experts
        )
    };
    let hook_timing =
        "\"hook_timing\": \"host-queued events behind a sleep kernel, median, upper bound\"";
    let d_extra = format!(
        ", \"us_{SMALL_TOKENS}_tokens\": {d_small:.1}, \"us_half_sms\": {d_half:.1}, \"hook_send_us\": {ds:.1}, \"hook_recv_us\": {dr:.1}, {hook_timing}"
    );
    let c_extra = format!(
        ", \"us_{SMALL_TOKENS}_tokens\": {c_small:.1}, \"hook_send_us\": {cs:.1}, \"hook_recv_us\": {cr:.1}, {hook_timing}"
    );
    vec![
        rec("ll_dispatch", "bf16", gbps(2.0, d16), d16, &d_extra),
        rec("ll_dispatch", "fp8", gbps(1.0 + 4.0 / 128.0, d8), d8, ""),
        rec("ll_combine", "bf16", gbps(2.0, c), c, &c_extra),
    ]
}

/// A rank's timings as bytes for the gather to rank 0: `[1, f64 LE words..]` or
/// `[0, error text]`.
fn encode(times: &Result<Times, String>) -> Vec<u8> {
    match times {
        Ok(t) => [1u8]
            .into_iter()
            .chain(t.to_words().iter().flat_map(|w| w.to_le_bytes()))
            .collect(),
        Err(e) => [&[0u8][..], e.as_bytes()].concat(),
    }
}

fn decode(b: &[u8]) -> Result<Times, String> {
    match b.first() {
        Some(1) if b.len() == 1 + 8 * 11 => {
            let mut w = [0f64; 11];
            for (i, c) in b[1..].chunks_exact(8).enumerate() {
                w[i] = f64::from_le_bytes(c.try_into().unwrap_or_default());
            }
            Ok(Times::from_words(w))
        }
        Some(0) => Err(String::from_utf8_lossy(&b[1..]).into_owned()),
        _ => Err("malformed report".into()),
    }
}

/// One rank as a process: its GPU, the NVLink run, then (unless `--no-transport`) the transport
/// run; rank 0 writes the JSON of both. A failing transport run still leaves the NVLink records
/// written, then fails the run.
fn rank_process(comm: Arc<TcpCommunicator>, a: &Args, n: usize) -> Result<()> {
    let ctx = ep_kernels::testing::rank_context(comm.local_rank())?;
    let mut records = rank_config(&comm, &ctx, a, n, None)?;
    let transport = if a.transport {
        rank_config(&comm, &ctx, a, n, Some(a.transport_handler))
            .map(|r| records.extend(r))
            .context("the transport run (NVLink disabled)")
    } else {
        Ok(())
    };
    if comm.rank() == 0 {
        if let Some(p) = &a.json {
            ep_examples::bench::write_records(p, &records)?;
        }
    }
    transport
}

/// One configuration on this rank as a process (NVLink, or NVLink disabled with the transport in
/// mode `transport`): its buffer, the benchmark, the teardown; rank 0 gathers every rank's
/// timings, prints the table and returns the JSON records (the other ranks return none).
fn rank_config(
    comm: &Arc<TcpCommunicator>,
    ctx: &Arc<CudaContext>,
    a: &Args,
    n: usize,
    transport: Option<HandlerChoice>,
) -> Result<Vec<String>> {
    let (rank, ranks) = (comm.rank(), comm.world_size());
    let mut opts = LowLatencyOptions::new(a.tokens, a.hidden, a.topk, a.experts);
    let iters = match transport {
        None => a.iters,
        Some(h) => {
            opts.allow_nvlink = false;
            opts.nic_handler = h;
            a.transport_iters
        }
    };
    let mut buf = LowLatencyBuffer::new(ctx, comm.clone(), &opts)?;
    let sms = buf.sm_budget();
    let path = match buf.nic_handler() {
        None => "NVLink".to_string(),
        Some(m) => format!(
            "NVLink disabled, IBGDA on the emulated NIC (one per process), mode {}",
            m.name()
        ),
    };
    let mine =
        run_rank(&mut buf, a, iters, 0x5eed + rank as u64).map_err(|e| format!("rank {rank}: {e}"));
    // Every rank tears down and reports, also after a failure, so none waits for a peer that
    // has given up.
    let shut = buf.shutdown();
    let all = comm.all_gather_bytes(&encode(&mine))?;
    shut?;
    mine.map_err(anyhow::Error::msg)?;
    let times: Vec<Times> = all
        .iter()
        .enumerate()
        .map(|(r, b)| decode(b).map_err(|e| format!("rank {r}: {e}")))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    if rank != 0 {
        return Ok(Vec::new());
    }
    let machine = format!("{}x {}", n, ctx.name().unwrap_or_default());
    let run = Run {
        ranks,
        gpus: n.min(ranks),
        sms,
        path,
        machine: &machine,
        iters,
        transport,
        mode: "procs",
    };
    Ok(report(a, &run, &times))
}

/// Ranks as processes: this program re-executed once per rank by the launcher.
fn run_processes(a: &Args, n: usize, ranks: usize) -> Result<()> {
    Launcher::new(ranks).run_shared(|comm| rank_process(comm, a, n))?;
    Ok(())
}
