//! Shared by the low-latency GPU tests (ranks as threads in `gpu_low_latency.rs`, ranks as
//! processes in `gpu_low_latency_procs.rs`): options, the case matrix, random inputs, one rank's
//! dispatch/combine (plain, two in flight, captured in a graph) and the checks against the CPU
//! reference. Every rank's inputs derive from one generator, so a rank in its own process
//! draws the whole group's inputs from the seed and checks its own results itself.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use cudarc::driver::sys;
use ep::low_latency::reference::{self, Routing};
use ep::low_latency::{
    Fp8Options, LlCombineArgs, LlCombineX, LlDispatchArgs, LlDispatchOutput, LlRecvX, LlScales,
    LowLatencyBuffer, LowLatencyOptions,
};
use ep::{Bf16, Element, EpError, Tensor};
use ep_kernels::testing::Rng;
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;
use std::time::Duration;

pub const MAX_TOKENS: usize = 128;
pub const MAX_HIDDEN: usize = 8192;
pub const MAX_TOPK: usize = 11;

pub fn experts_for(ranks: usize) -> usize {
    12 * ranks
}

pub fn options(ranks: usize) -> LowLatencyOptions {
    let mut o = LowLatencyOptions::new(MAX_TOKENS, MAX_HIDDEN, MAX_TOPK, experts_for(ranks));
    o.poison_outputs = true;
    o.timeout = Duration::from_secs(20);
    o
}

/// The handler modes every machine runs on the emulated NIC (NVLink disabled). Mode `cpu` keeps
/// its producer slots in GPU memory; without GDRCopy the proxy reads them through the emulated
/// GDR view (copy-engine reads into a host mirror, `ibgda_gdr::CopyMirror`).
pub const TRANSPORT_MODES: [(HandlerChoice, NicHandler); 3] = [
    (HandlerChoice::Gpu, NicHandler::Gpu),
    (HandlerChoice::CpuHostMemory, NicHandler::CpuHostMemory),
    (HandlerChoice::Cpu, NicHandler::Cpu),
];

/// [`options`] with NVLink disabled: every byte to another rank through the transport, in mode
/// `handler`.
pub fn transport_options(ranks: usize, handler: HandlerChoice) -> LowLatencyOptions {
    let mut o = options(ranks);
    o.allow_nvlink = false;
    o.nic_handler = handler;
    o
}

#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub hidden: usize,
    pub topk: usize,
    pub fp8: Option<Fp8Options>,
    pub hook: bool,
    pub zero_copy: bool,
}

/// One rank's inputs.
#[derive(Debug, Clone)]
pub struct RankData {
    pub tokens: usize,
    pub x: Vec<Bf16>,
    pub idx: Vec<i32>,
    pub weights: Vec<f32>,
    /// Expert outputs `[local][cap][hidden]`.
    pub comb_in: Vec<Bf16>,
}

/// What one rank got back.
#[derive(Debug, Default)]
pub struct RankResult {
    pub count: Vec<i32>,
    pub layout: Vec<i32>,
    pub src_info: Vec<i32>,
    /// Packed rows, raw bytes `[local][cap][row bytes]`.
    pub x: Vec<u8>,
    pub scales_f32: Vec<f32>,
    pub scales_ue8m0: Vec<i32>,
    pub out: Vec<Bf16>,
}

/// Runs `f` on every rank's buffer, each on a thread of its own (ranks as threads), and
/// returns the results in rank order; a rank that panics fails the caller.
pub fn on_ranks<R: Send>(
    bufs: &mut [LowLatencyBuffer],
    f: impl Fn(&mut LowLatencyBuffer) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let joins: Vec<_> = bufs.iter_mut().map(|b| s.spawn(move || f(b))).collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("rank thread panicked"))
            .collect()
    })
}

pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<Bf16> {
    (0..n)
        .map(|_| {
            let v = (rng.below(1 << 20) as f32 / (1 << 19) as f32) - 1.0;
            // Some channels far larger, so the per-128 scales differ.
            let big = if rng.below(64) == 0 { 40.0 } else { 1.0 };
            Bf16::from_f32(v * big)
        })
        .collect()
}

pub fn random_data(
    rng: &mut Rng,
    ranks: usize,
    hidden: usize,
    topk: usize,
    tokens: Option<usize>,
) -> Vec<RankData> {
    let experts = experts_for(ranks);
    let local = experts / ranks;
    // One generator per rank, seeded from `rng` (so a seed still replays the whole case), each
    // rank's data made on its own thread: at EP8 the combine inputs alone are hundreds of
    // millions of values, which one thread took over a second per case to draw.
    let seeds: Vec<u64> = (0..ranks).map(|_| rng.next_u64()).collect();
    std::thread::scope(|s| {
        let joins: Vec<_> = seeds
            .into_iter()
            .map(|seed| {
                s.spawn(move || {
                    let mut rng = Rng::new(seed);
                    let t = tokens.unwrap_or_else(|| 1 + rng.below(MAX_TOKENS as u64) as usize);
                    let mut idx = Vec::with_capacity(t * topk);
                    for _ in 0..t {
                        let nowhere = rng.below(20) == 0;
                        let mut chosen: Vec<i32> = Vec::new();
                        while chosen.len() < topk {
                            let e = rng.below(experts as u64) as i32;
                            if !chosen.contains(&e) {
                                chosen.push(e);
                            }
                        }
                        for e in chosen {
                            idx.push(if nowhere || rng.below(10) == 0 { -1 } else { e });
                        }
                    }
                    RankData {
                        tokens: t,
                        x: random_bf16(&mut rng, t * hidden),
                        weights: (0..t * topk)
                            .map(|_| rng.below(1 << 16) as f32 / (1 << 16) as f32)
                            .collect(),
                        idx,
                        comb_in: random_bf16(&mut rng, local * ranks * MAX_TOKENS * hidden),
                    }
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("generating a rank's data panicked"))
            .collect()
    })
}

/// Copies `data` into the existing tensor `dst` (ordered on the buffer's stream, then waited for).
pub fn upload_into<T: Element>(
    buf: &LowLatencyBuffer,
    dst: &Tensor<T>,
    data: &[T],
) -> Result<(), EpError> {
    let src = Tensor::from_host(buf.context(), data, &[data.len()])?;
    assert!(data.len() <= dst.numel());
    // SAFETY: both ranges lie inside live device allocations of this GPU (`src` has exactly
    // `data.len()` elements, `dst` at least that many); the copy is ordered on the buffer's stream,
    // and `src` outlives it because the stream is synchronized before it is dropped.
    let r = unsafe {
        sys::cuMemcpyDtoDAsync_v2(
            dst.device_address(),
            src.device_address(),
            std::mem::size_of_val(data),
            buf.stream().cu_stream(),
        )
    }
    .result();
    r.map_err(|source| EpError::Cuda {
        rank: buf.rank(),
        call: "cuMemcpyDtoDAsync",
        source,
    })?;
    buf.stream().synchronize().map_err(|source| EpError::Cuda {
        rank: buf.rank(),
        call: "cuStreamSynchronize",
        source,
    })
}

pub fn read_dispatch(out: &LlDispatchOutput, res: &mut RankResult) -> Result<(), EpError> {
    res.count = out.recv_count.to_host()?;
    res.layout = out.handle.layout_range().to_host()?;
    res.src_info = out.handle.src_info().to_host()?;
    match &out.x {
        LlRecvX::Bf16(x) => {
            res.x = bytemuck::cast_slice(&x.to_host()?).to_vec();
        }
        LlRecvX::Fp8 { x, scales } => {
            res.x = bytemuck::cast_slice(&x.to_host()?).to_vec();
            match scales {
                LlScales::F32(s) => res.scales_f32 = s.to_host()?,
                LlScales::Ue8m0(s) => res.scales_ue8m0 = s.to_host()?,
            }
        }
    }
    Ok(())
}

/// One dispatch + combine on this rank, outputs downloaded.
pub fn run_case(buf: &mut LowLatencyBuffer, d: &RankData, c: &Case) -> Result<RankResult, EpError> {
    // EP_TEST_PHASES=1: rank 0 prints where a case's host time goes.
    let phases = buf.rank() == 0 && std::env::var("EP_TEST_PHASES").is_ok_and(|v| v == "1");
    let mut marks: Vec<(&str, std::time::Instant)> = vec![("start", std::time::Instant::now())];
    let mut mark = |what: &'static str| {
        if phases {
            marks.push((what, std::time::Instant::now()));
        }
    };
    let ctx = buf.context().clone();
    let x = Tensor::from_host(&ctx, &d.x, &[d.tokens, c.hidden])?;
    let idx = Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk])?;
    let w = Tensor::from_host(&ctx, &d.weights, &[d.tokens, c.topk])?;
    mark("inputs");
    let mut res = RankResult::default();
    let mut args = LlDispatchArgs::new(&x, &idx);
    args.fp8 = c.fp8;
    args.return_recv_hook = c.hook;
    let mut out = buf.dispatch(&args)?;
    if let Some(h) = out.hook.take() {
        h.call()?;
    }
    mark("dispatch");
    buf.synchronize()?;
    mark("dispatch sync");
    read_dispatch(&out, &mut res)?;
    mark("dispatch read");

    let (local, cap) = (buf.num_local_experts(), buf.ranks() * MAX_TOKENS);
    let comb_in;
    let cx = if c.zero_copy {
        let dst = buf.combine_input(c.hidden)?;
        upload_into(buf, &dst, &d.comb_in)?;
        LlCombineX::ZeroCopy
    } else {
        comb_in = Tensor::from_host(&ctx, &d.comb_in, &[local, cap, c.hidden])?;
        LlCombineX::Tensor(&comb_in)
    };
    mark("combine input");
    let mut cargs = LlCombineArgs::new(cx, &idx, &w, &out.handle);
    cargs.return_recv_hook = c.hook;
    let mut co = buf.combine(&cargs)?;
    if let Some(h) = co.hook.take() {
        h.call()?;
    }
    mark("combine");
    buf.synchronize()?;
    mark("combine sync");
    res.out = co.x.to_host()?;
    mark("combine read");
    if phases {
        let steps: Vec<String> = marks
            .windows(2)
            .map(|w| format!("{} {:.1?}", w[1].0, w[1].1 - w[0].1))
            .collect();
        eprintln!("  rank 0 phases: {}", steps.join(", "));
    }
    Ok(res)
}

pub fn expected_row_bytes(d: &RankData, t: usize, c: &Case) -> (Vec<u8>, Vec<f32>) {
    let row = &d.x[t * c.hidden..(t + 1) * c.hidden];
    match c.fp8 {
        None => (bytemuck::cast_slice(row).to_vec(), Vec::new()),
        Some(f) => {
            let (q, s) = reference::fp8_cast(row, f.round_scale || f.ue8m0);
            (bytemuck::cast_slice(&q).to_vec(), s)
        }
    }
}

/// The reference routing of every rank's top-k ids.
pub fn routing(ranks: usize, c: &Case, data: &[RankData]) -> Routing {
    let ids: Vec<Vec<i32>> = data.iter().map(|d| d.idx.clone()).collect();
    reference::route(&ids, c.topk, experts_for(ranks))
}

/// Checks every rank's results against the reference; panics with the first differences.
pub fn check(ranks: usize, c: &Case, data: &[RankData], res: &[RankResult], what: &str) {
    let routing = routing(ranks, c, data);
    // Each rank's results are checked on a thread of its own (EP8 took over a second on one).
    let inexact: usize = std::thread::scope(|s| {
        let routing = &routing;
        let joins: Vec<_> = res
            .iter()
            .enumerate()
            .map(|(r, got)| {
                s.spawn(move || {
                    check_dispatch(ranks, c, data, routing, r, got, what);
                    check_combine(ranks, c, data, routing, r, got, what)
                })
            })
            .collect();
        joins
            .into_iter()
            .enumerate()
            .map(|(r, j)| {
                j.join()
                    .unwrap_or_else(|_| panic!("{what}: rank {r}'s results differ (above)"))
            })
            .sum()
    });
    if inexact > 0 {
        eprintln!("{what}: {inexact} combine values within one BF16 unit of the reference");
    }
}

/// Checks rank `r`'s results against the reference computed from every rank's inputs (a rank
/// in its own process checks itself); panics with the first differences.
pub fn check_rank(
    ranks: usize,
    c: &Case,
    data: &[RankData],
    r: usize,
    got: &RankResult,
    what: &str,
) {
    let routing = routing(ranks, c, data);
    check_dispatch(ranks, c, data, &routing, r, got, what);
    let inexact = check_combine(ranks, c, data, &routing, r, got, what);
    if inexact > 0 {
        eprintln!(
            "{what}: rank {r}: {inexact} combine values within one BF16 unit of the reference"
        );
    }
}

/// Rank `r`'s dispatch outputs: counts, layout ranges, source tokens, rows and scales.
fn check_dispatch(
    ranks: usize,
    c: &Case,
    data: &[RankData],
    routing: &Routing,
    r: usize,
    got: &RankResult,
    what: &str,
) {
    let experts = experts_for(ranks);
    let local = experts / ranks;
    let cap = ranks * MAX_TOKENS;
    let row_bytes = if c.fp8.is_some() {
        c.hidden
    } else {
        2 * c.hidden
    };
    let scale_words = c.hidden / 128;
    for l in 0..local {
        let rows = &routing.rows[r][l];
        assert_eq!(
            got.count[l] as usize,
            rows.len(),
            "{what}: rank {r} local expert {l}: count"
        );
        for s in 0..ranks {
            let (first, n) = routing.layout[r][l][s];
            assert_eq!(
                (
                    got.layout[(l * ranks + s) * 2],
                    got.layout[(l * ranks + s) * 2 + 1]
                ),
                (first as i32, n as i32),
                "{what}: rank {r} local expert {l} source {s}: layout range"
            );
        }
        for (j, &(s, t)) in rows.iter().enumerate() {
            let row = l * cap + j;
            assert_eq!(
                got.src_info[row] as usize, t,
                "{what}: rank {r} expert {l} row {j}: source token"
            );
            let (want, scales) = expected_row_bytes(&data[s], t, c);
            let have = &got.x[row * row_bytes..(row + 1) * row_bytes];
            if have != want.as_slice() {
                let i = have
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{what}: rank {r} expert {l} row {j} (from rank {s} token {t}): byte {i} is {:#x}, expected {:#x}",
                    have[i], want[i]
                );
            }
            match c.fp8 {
                Some(f) if f.ue8m0 => {
                    let words = scale_words / 4;
                    assert_eq!(
                        &got.scales_ue8m0[row * words..(row + 1) * words],
                        reference::ue8m0_pack(&scales).as_slice(),
                        "{what}: rank {r} expert {l} row {j}: UE8M0 scales"
                    );
                }
                Some(_) => assert_eq!(
                    &got.scales_f32[row * scale_words..(row + 1) * scale_words],
                    scales.as_slice(),
                    "{what}: rank {r} expert {l} row {j}: scales"
                ),
                None => {}
            }
        }
    }
}

/// Rank `s`'s combine output: rows come from the ranks' expert inputs at the packed positions.
/// Returns how many values differ from the reference (each within one BF16 unit).
fn check_combine(
    ranks: usize,
    c: &Case,
    data: &[RankData],
    routing: &Routing,
    s: usize,
    got: &RankResult,
    what: &str,
) -> usize {
    let local = experts_for(ranks) / ranks;
    let cap = ranks * MAX_TOKENS;
    let h = c.hidden;
    let d = &data[s];
    let want = reference::combine(&d.idx, &d.weights, c.topk, h, |e, t| {
        let j = routing
            .row_of(e, s, t, local)
            .expect("routed token has a row");
        let (dr, l) = (e / local, e % local);
        &data[dr].comb_in[(l * cap + j) * h..(l * cap + j + 1) * h]
    });
    let have = &got.out;
    assert_eq!(have.len(), want.len(), "{what}: rank {s}: combine size");
    let mut inexact = 0usize;
    for (i, (a, b)) in have.iter().zip(&want).enumerate() {
        if a == b {
            continue;
        }
        let (fa, fb) = (a.to_f32(), b.to_f32());
        let ulp = fb.abs().max(fa.abs()) / 128.0;
        assert!(
            (fa - fb).abs() <= ulp,
            "{what}: rank {s} token {} channel {}: combine {fa} expected {fb}",
            i / h,
            i % h
        );
        inexact += 1;
    }
    inexact
}

/// The NVLink matrix: every hidden size × BF16 / FP8 / power-of-two scales / UE8M0, top-k from
/// 1 to 11, hook mode and zero-copy combine spread over the cases.
pub fn cases() -> Vec<Case> {
    let fp8 = |round_scale, ue8m0| Some(Fp8Options { round_scale, ue8m0 });
    let hiddens = [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192];
    let dtypes = [None, fp8(false, false), fp8(true, false), fp8(false, true)];
    let mut v = Vec::new();
    for (i, &hidden) in hiddens.iter().enumerate() {
        for (j, &f) in dtypes.iter().enumerate() {
            v.push(Case {
                hidden,
                topk: [1, 4, 8, 9, 11][(i + j) % 5],
                fp8: f,
                hook: (i + j) % 2 == 1,
                zero_copy: (i + 2 * j) % 3 == 0,
            });
        }
    }
    v
}

/// The case of [`two_in_flight`]: hook mode, so both sends can go before both receives.
pub fn two_in_flight_case() -> Case {
    Case {
        hidden: 7168,
        topk: 8,
        fp8: None,
        hook: true,
        zero_copy: false,
    }
}

/// Back-to-back dispatches in hook mode: both sends first, then both receives (two results
/// held at once, one per half), then both combines.
pub fn two_in_flight(
    b: &mut LowLatencyBuffer,
    d1: &RankData,
    d2: &RankData,
    c: &Case,
) -> Result<(RankResult, RankResult), EpError> {
    let ctx = b.context().clone();
    let up = |d: &RankData| -> Result<_, EpError> {
        Ok((
            Tensor::from_host(&ctx, &d.x, &[d.tokens, c.hidden])?,
            Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk])?,
            Tensor::from_host(&ctx, &d.weights, &[d.tokens, c.topk])?,
            Tensor::from_host(
                &ctx,
                &d.comb_in,
                &[b.num_local_experts(), b.ranks() * MAX_TOKENS, c.hidden],
            )?,
        ))
    };
    let (x1, i1, w1, c1) = up(d1)?;
    let (x2, i2, w2, c2) = up(d2)?;
    let mut a1 = LlDispatchArgs::new(&x1, &i1);
    a1.return_recv_hook = true;
    let mut a2 = LlDispatchArgs::new(&x2, &i2);
    a2.return_recv_hook = true;
    let mut o1 = b.dispatch(&a1)?;
    let mut o2 = b.dispatch(&a2)?;
    o1.hook.take().expect("hook").call()?;
    o2.hook.take().expect("hook").call()?;
    b.synchronize()?;
    let (mut r1, mut r2) = (RankResult::default(), RankResult::default());
    read_dispatch(&o1, &mut r1)?;
    read_dispatch(&o2, &mut r2)?;
    let mut ca1 = LlCombineArgs::new(LlCombineX::Tensor(&c1), &i1, &w1, &o1.handle);
    ca1.return_recv_hook = true;
    let mut ca2 = LlCombineArgs::new(LlCombineX::Tensor(&c2), &i2, &w2, &o2.handle);
    ca2.return_recv_hook = true;
    let mut q1 = b.combine(&ca1)?;
    let mut q2 = b.combine(&ca2)?;
    q1.hook.take().expect("hook").call()?;
    q2.hook.take().expect("hook").call()?;
    b.synchronize()?;
    r1.out = q1.x.to_host()?;
    r2.out = q2.x.to_host()?;
    Ok((r1, r2))
}

/// The case of a graph test: one plain (BF16), one in hook mode (FP8).
pub fn graph_case(hook: bool) -> Case {
    Case {
        hidden: 7168,
        topk: 8,
        fp8: if hook {
            Some(Fp8Options::default())
        } else {
            None
        },
        hook,
        zero_copy: false,
    }
}

/// Three rounds of every rank's inputs for a graph: token counts fixed per rank (captured),
/// fresh contents per replay. `rounds[replay][rank]`.
pub fn graph_rounds(rng: &mut Rng, ranks: usize, c: &Case) -> Vec<Vec<RankData>> {
    let tokens: Vec<usize> = (0..ranks)
        .map(|_| 1 + rng.below(MAX_TOKENS as u64) as usize)
        .collect();
    (0..3)
        .map(|_| {
            (0..ranks)
                .map(|r| random_data(rng, ranks, c.hidden, c.topk, Some(tokens[r])).swap_remove(r))
                .collect()
        })
        .collect()
}

/// Dispatch + combine captured into one graph on this rank, replayed once per round with that
/// round's data written into the captured inputs first; the results of every replay.
pub fn graph_rank(
    b: &mut LowLatencyBuffer,
    rounds: &[RankData],
    c: &Case,
) -> Result<Vec<RankResult>, EpError> {
    let ctx = b.context().clone();
    let d0 = &rounds[0];
    let (local, cap) = (b.num_local_experts(), b.ranks() * MAX_TOKENS);
    let x = Tensor::from_host(&ctx, &d0.x, &[d0.tokens, c.hidden])?;
    let idx = Tensor::from_host(&ctx, &d0.idx, &[d0.tokens, c.topk])?;
    let w = Tensor::from_host(&ctx, &d0.weights, &[d0.tokens, c.topk])?;
    let comb_in = Tensor::from_host(&ctx, &d0.comb_in, &[local, cap, c.hidden])?;
    let (graph, (dout, cout)) = b.capture(|b| {
        let mut a = LlDispatchArgs::new(&x, &idx);
        a.fp8 = c.fp8;
        a.return_recv_hook = c.hook;
        let mut dout = b.dispatch(&a)?;
        if let Some(h) = dout.hook.take() {
            h.call()?;
        }
        let mut ca = LlCombineArgs::new(LlCombineX::Tensor(&comb_in), &idx, &w, &dout.handle);
        ca.return_recv_hook = c.hook;
        let mut cout = b.combine(&ca)?;
        if let Some(h) = cout.hook.take() {
            h.call()?;
        }
        Ok((dout, cout))
    })?;
    let mut out = Vec::new();
    for d in rounds {
        upload_into(b, &x, &d.x)?;
        upload_into(b, &idx, &d.idx)?;
        upload_into(b, &w, &d.weights)?;
        upload_into(b, &comb_in, &d.comb_in)?;
        graph.replay()?;
        b.synchronize()?;
        let mut r = RankResult::default();
        read_dispatch(&dout, &mut r)?;
        r.out = cout.x.to_host()?;
        out.push(r);
    }
    Ok(out)
}
