//! Low-latency dispatch/combine, ranks as threads of one process over NVLink, against the CPU
//! reference (`ep::low_latency::reference`) on fresh random data: dispatch bit-exact (rows,
//! FP8 values and scales, counts, layout, source tokens), combine within one BF16 unit (the
//! reference makes the same f32 fused multiply-adds in the same order). Outputs are poisoned
//! (0xAB) before every operation. Each case runs at every rank count in {2, 4, 8} the machine
//! has GPUs for: every hidden size of the issue, top-k up to 11, BF16 / FP8 / power-of-two /
//! UE8M0, hook mode, zero-copy combine, CUDA-graph capture and replay, a bounded-wait timeout
//! that names rank, peer and expert, and repeated create / use / teardown.
//!
//! With NVLink disabled (every byte to another rank through the IBGDA transport on the emulated
//! NIC): a representative matrix (hidden 2048 and 7168, BF16 and FP8, top-1 and top-8, hook on
//! and off) in NIC-handler modes `gpu` and `cpu_host_memory`, mode `cpu` failing cleanly where
//! GDRCopy is missing, and create / dispatch / combine / teardown 20 times in a row per mode.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext};
use ep::low_latency::reference::{self, Routing};
use ep::low_latency::{
    Fp8Options, LlCombineArgs, LlCombineX, LlDispatchArgs, LlDispatchOutput, LlRecvX, LlScales,
    LowLatencyBuffer, LowLatencyOptions,
};
use ep::{Bf16, Element, EpError, Tensor};
use ep_kernels::testing::{gpus, seed, Rng};
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;

const MAX_TOKENS: usize = 128;
const MAX_HIDDEN: usize = 8192;
const MAX_TOPK: usize = 11;

fn rank_counts() -> Vec<usize> {
    let n = ibgda_device::cuda::device_count().unwrap_or(0);
    [2usize, 4, 8].into_iter().filter(|&r| r <= n).collect()
}

fn experts_for(ranks: usize) -> usize {
    12 * ranks
}

fn options(ranks: usize) -> LowLatencyOptions {
    let mut o = LowLatencyOptions::new(MAX_TOKENS, MAX_HIDDEN, MAX_TOPK, experts_for(ranks));
    o.poison_outputs = true;
    o.timeout = Duration::from_secs(20);
    o
}

#[derive(Debug, Clone, Copy)]
struct Case {
    hidden: usize,
    topk: usize,
    fp8: Option<Fp8Options>,
    hook: bool,
    zero_copy: bool,
}

/// One rank's inputs.
#[derive(Debug, Clone)]
struct RankData {
    tokens: usize,
    x: Vec<Bf16>,
    idx: Vec<i32>,
    weights: Vec<f32>,
    /// Expert outputs `[local][cap][hidden]`.
    comb_in: Vec<Bf16>,
}

/// What one rank got back.
#[derive(Debug, Default)]
struct RankResult {
    count: Vec<i32>,
    layout: Vec<i32>,
    src_info: Vec<i32>,
    /// Packed rows, raw bytes `[local][cap][row bytes]`.
    x: Vec<u8>,
    scales_f32: Vec<f32>,
    scales_ue8m0: Vec<i32>,
    out: Vec<Bf16>,
}

fn random_bf16(rng: &mut Rng, n: usize) -> Vec<Bf16> {
    (0..n)
        .map(|_| {
            let v = (rng.below(1 << 20) as f32 / (1 << 19) as f32) - 1.0;
            // Some channels far larger, so the per-128 scales differ.
            let big = if rng.below(64) == 0 { 40.0 } else { 1.0 };
            Bf16::from_f32(v * big)
        })
        .collect()
}

fn random_data(
    rng: &mut Rng,
    ranks: usize,
    hidden: usize,
    topk: usize,
    tokens: Option<usize>,
) -> Vec<RankData> {
    let experts = experts_for(ranks);
    let local = experts / ranks;
    (0..ranks)
        .map(|_| {
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
                x: random_bf16(rng, t * hidden),
                weights: (0..t * topk)
                    .map(|_| rng.below(1 << 16) as f32 / (1 << 16) as f32)
                    .collect(),
                idx,
                comb_in: random_bf16(rng, local * ranks * MAX_TOKENS * hidden),
            }
        })
        .collect()
}

fn on_ranks<R: Send>(
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

/// Copies `data` into the existing tensor `dst` (ordered on the buffer's stream, then waited for).
fn upload_into<T: Element>(
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

fn read_dispatch(out: &LlDispatchOutput, res: &mut RankResult) -> Result<(), EpError> {
    res.count = out.recv_count.to_host()?;
    res.layout = out.handle.layout_range.to_host()?;
    res.src_info = out.handle.src_info.to_host()?;
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
fn run_case(buf: &mut LowLatencyBuffer, d: &RankData, c: &Case) -> Result<RankResult, EpError> {
    let ctx = buf.context().clone();
    let x = Tensor::from_host(&ctx, &d.x, &[d.tokens, c.hidden])?;
    let idx = Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk])?;
    let w = Tensor::from_host(&ctx, &d.weights, &[d.tokens, c.topk])?;
    let mut res = RankResult::default();
    let mut args = LlDispatchArgs::new(&x, &idx);
    args.fp8 = c.fp8;
    args.return_recv_hook = c.hook;
    let mut out = buf.dispatch(&args)?;
    if let Some(h) = out.hook.take() {
        h.call()?;
    }
    buf.synchronize()?;
    read_dispatch(&out, &mut res)?;

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
    let mut cargs = LlCombineArgs::new(cx, &idx, &w, &out.handle);
    cargs.return_recv_hook = c.hook;
    let mut co = buf.combine(&cargs)?;
    if let Some(h) = co.hook.take() {
        h.call()?;
    }
    buf.synchronize()?;
    res.out = co.x.to_host()?;
    Ok(res)
}

fn expected_row_bytes(d: &RankData, t: usize, c: &Case) -> (Vec<u8>, Vec<f32>) {
    let row = &d.x[t * c.hidden..(t + 1) * c.hidden];
    match c.fp8 {
        None => (bytemuck::cast_slice(row).to_vec(), Vec::new()),
        Some(f) => {
            let (q, s) = reference::fp8_cast(row, f.round_scale || f.ue8m0);
            (bytemuck::cast_slice(&q).to_vec(), s)
        }
    }
}

/// Checks every rank's results against the reference; panics with the first differences.
fn check(ranks: usize, c: &Case, data: &[RankData], res: &[RankResult], what: &str) {
    let experts = experts_for(ranks);
    let local = experts / ranks;
    let cap = ranks * MAX_TOKENS;
    let ids: Vec<Vec<i32>> = data.iter().map(|d| d.idx.clone()).collect();
    let routing: Routing = reference::route(&ids, c.topk, experts);
    let row_bytes = if c.fp8.is_some() {
        c.hidden
    } else {
        2 * c.hidden
    };
    let scale_words = c.hidden / 128;
    for (r, got) in res.iter().enumerate() {
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
    // Combine: rows come from the ranks' expert inputs at the packed positions.
    let h = c.hidden;
    let mut inexact = 0usize;
    for (s, d) in data.iter().enumerate() {
        let want = reference::combine(&d.idx, &d.weights, c.topk, h, |e, t| {
            let j = routing
                .row_of(e, s, t, local)
                .expect("routed token has a row");
            let (dr, l) = (e / local, e % local);
            &data[dr].comb_in[(l * cap + j) * h..(l * cap + j + 1) * h]
        });
        let have = &res[s].out;
        assert_eq!(have.len(), want.len(), "{what}: rank {s}: combine size");
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
    }
    if inexact > 0 {
        eprintln!("{what}: {inexact} combine values within one BF16 unit of the reference");
    }
}

fn cases() -> Vec<Case> {
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

fn group(ctxs: &[Arc<CudaContext>], opts: &LowLatencyOptions) -> Vec<LowLatencyBuffer> {
    LowLatencyBuffer::create_group(ctxs, opts).expect("creating the low-latency buffers")
}

#[test]
fn dispatch_combine_match_reference() {
    let Some(_) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for ranks in rank_counts() {
        let Some(ctxs) = gpus(ranks) else { continue };
        run_matrix(&ctxs, ranks, &mut rng);
    }
}

/// Tears every rank's buffer down at once (teardown is a collective), each must succeed.
fn shutdown_all(bufs: Vec<LowLatencyBuffer>) {
    std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        for (r, j) in joins.into_iter().enumerate() {
            j.join()
                .expect("teardown panicked")
                .unwrap_or_else(|e| panic!("rank {r}: teardown: {e}"));
        }
    });
}

fn run_matrix(ctxs: &[Arc<CudaContext>], ranks: usize, rng: &mut Rng) {
    let mut bufs = group(ctxs, &options(ranks));
    for c in cases() {
        let data = random_data(rng, ranks, c.hidden, c.topk, None);
        let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        check(ranks, &c, &data, &res, &format!("EP{ranks} {c:?}"));
    }
    // Back-to-back dispatches in hook mode: both sends first, then both receives (two results
    // held at once, one per half), then both combines.
    let c = Case {
        hidden: 7168,
        topk: 8,
        fp8: None,
        hook: true,
        zero_copy: false,
    };
    let d1 = random_data(rng, ranks, c.hidden, c.topk, None);
    let d2 = random_data(rng, ranks, c.hidden, c.topk, None);
    let res: Vec<(RankResult, RankResult)> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        two_in_flight(b, &d1[r], &d2[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    let (r1, r2): (Vec<_>, Vec<_>) = res.into_iter().unzip();
    check(
        ranks,
        &c,
        &d1,
        &r1,
        &format!("EP{ranks} two in flight, first"),
    );
    check(
        ranks,
        &c,
        &d2,
        &r2,
        &format!("EP{ranks} two in flight, second"),
    );
    shutdown_all(bufs);
    eprintln!("EP{ranks}: {} cases passed", cases().len() + 1);
}

fn two_in_flight(
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

/// Dispatch + combine captured into one graph per rank (one plain, one in hook mode), replayed
/// with fresh data written into the captured inputs before each replay.
#[test]
fn cuda_graph_replays_match_reference() {
    let Some(_) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for ranks in rank_counts() {
        let Some(ctxs) = gpus(ranks) else { continue };
        let mut bufs = group(&ctxs, &options(ranks));
        for hook in [false, true] {
            let c = Case {
                hidden: 7168,
                topk: 8,
                fp8: if hook {
                    Some(Fp8Options::default())
                } else {
                    None
                },
                hook,
                zero_copy: false,
            };
            // Fixed token counts per rank (captured), fresh contents per replay.
            let tokens: Vec<usize> = (0..ranks)
                .map(|_| 1 + rng.below(MAX_TOKENS as u64) as usize)
                .collect();
            let rounds: Vec<Vec<RankData>> = (0..3)
                .map(|_| {
                    (0..ranks)
                        .map(|r| {
                            random_data(&mut rng, ranks, c.hidden, c.topk, Some(tokens[r]))
                                .swap_remove(r)
                        })
                        .collect()
                })
                .collect();
            let res: Vec<Vec<RankResult>> = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                let mine: Vec<RankData> = rounds.iter().map(|v| v[r].clone()).collect();
                graph_rank(b, &mine, &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
            });
            let mut res = res;
            for (i, data) in rounds.iter().enumerate() {
                let per_rank: Vec<RankResult> =
                    res.iter_mut().map(|v| std::mem::take(&mut v[i])).collect();
                check(
                    ranks,
                    &c,
                    data,
                    &per_rank,
                    &format!("EP{ranks} graph hook={hook} replay {i}"),
                );
            }
        }
        shutdown_all(bufs);
    }
}

fn graph_rank(
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

/// A rank that never joins: the others' receive wait runs out and the `Err` names the rank, the
/// peer and the expert; teardown still succeeds everywhere after.
#[test]
fn a_missing_rank_times_out_with_a_named_error() {
    let Some(ctxs) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    let mut o = options(2);
    o.timeout = Duration::from_secs(2);
    let mut bufs = group(&ctxs, &o);
    let data = random_data(&mut rng, 2, 2048, 4, Some(16));
    let errs: Vec<Option<String>> = on_ranks(&mut bufs, |b| {
        if b.rank() == 1 {
            return None;
        }
        let ctx = b.context().clone();
        let d = &data[0];
        let x = Tensor::from_host(&ctx, &d.x, &[16, 2048]).unwrap();
        let idx = Tensor::from_host(&ctx, &d.idx, &[16, 4]).unwrap();
        let out = b.dispatch(&LlDispatchArgs::new(&x, &idx)).unwrap();
        let e = b
            .synchronize()
            .expect_err("rank 1 never sent: the wait must run out");
        drop(out);
        // The buffer stays poisoned: no more work is queued on it.
        assert!(matches!(
            b.dispatch(&LlDispatchArgs::new(&x, &idx)),
            Err(EpError::Poisoned { .. })
        ));
        Some(e.to_string())
    });
    let msg = errs[0].clone().expect("rank 0 reports");
    eprintln!("rank 0: {msg}");
    assert!(msg.contains("rank 0") && msg.contains("rank 1"), "{msg}");
    assert!(msg.contains("local expert"), "{msg}");
    // Teardown: rank 0 reports its recorded error again, rank 1 is clean; both free and return.
    std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        let r: Vec<_> = joins
            .into_iter()
            .map(|j| j.join().expect("no panic"))
            .collect();
        assert!(r[0].is_err());
        r[1].as_ref().expect("rank 1 tears down cleanly");
    });
}

/// Create, use, tear down, several times in a row: nothing leaks into the next buffer.
#[test]
fn repeated_create_use_teardown() {
    let Some(ctxs) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for round in 0..3 {
        let mut bufs = group(&ctxs, &options(2));
        let c = Case {
            hidden: 4096,
            topk: 8,
            fp8: Some(Fp8Options::default()),
            hook: round % 2 == 1,
            zero_copy: round == 2,
        };
        let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
        let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        check(2, &c, &data, &res, &format!("round {round}"));
        shutdown_all(bufs);
    }
}

// ---- NVLink disabled: every byte through the transport ------------------------------------------

/// The handler modes every machine runs on the emulated NIC.
const TRANSPORT_MODES: [(HandlerChoice, NicHandler); 2] = [
    (HandlerChoice::Gpu, NicHandler::Gpu),
    (HandlerChoice::CpuHostMemory, NicHandler::CpuHostMemory),
];

fn transport_options(ranks: usize, handler: HandlerChoice) -> LowLatencyOptions {
    let mut o = options(ranks);
    o.allow_nvlink = false;
    o.nic_handler = handler;
    o
}

/// Hidden 2048 and 7168 × BF16 and FP8 × top-1 and top-8 × hook off and on; zero-copy combine
/// on every other case.
fn transport_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for hidden in [2048, 7168] {
        for fp8 in [None, Some(Fp8Options::default())] {
            for topk in [1, 8] {
                for hook in [false, true] {
                    v.push(Case {
                        hidden,
                        topk,
                        fp8,
                        hook,
                        zero_copy: v.len() % 2 == 1,
                    });
                }
            }
        }
    }
    v
}

fn transport_group(
    ctxs: &[Arc<CudaContext>],
    mode: (HandlerChoice, NicHandler),
) -> Vec<LowLatencyBuffer> {
    let bufs = LowLatencyBuffer::create_group(ctxs, &transport_options(ctxs.len(), mode.0))
        .unwrap_or_else(|e| {
            panic!(
                "creating the buffers with NVLink disabled, mode {}: {e}",
                mode.1.name()
            )
        });
    for b in &bufs {
        assert_eq!(
            b.nic_handler(),
            Some(mode.1),
            "rank {}: handler mode",
            b.rank()
        );
    }
    bufs
}

#[test]
fn transport_matrix_matches_reference_in_gpu_and_cpu_host_memory_modes() {
    let Some(_) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for ranks in rank_counts() {
        let Some(ctxs) = gpus(ranks) else { continue };
        for mode in TRANSPORT_MODES {
            let mut bufs = transport_group(&ctxs, mode);
            for c in transport_cases() {
                let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
                let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                    let r = b.rank();
                    run_case(b, &data[r], &c)
                        .unwrap_or_else(|e| panic!("rank {r}, mode {}: {e}", mode.1.name()))
                });
                check(
                    ranks,
                    &c,
                    &data,
                    &res,
                    &format!("EP{ranks} transport mode {} {c:?}", mode.1.name()),
                );
            }
            shutdown_all(bufs);
            eprintln!(
                "EP{ranks} transport mode {}: {} cases passed",
                mode.1.name(),
                transport_cases().len()
            );
        }
    }
}

#[test]
fn transport_mode_cpu_fails_cleanly_without_gdrcopy() {
    let Some(ctxs) = gpus(2) else { return };
    match LowLatencyBuffer::create_group(&ctxs, &transport_options(2, HandlerChoice::Cpu)) {
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("GDRCopy") && msg.contains("cpu"),
                "the error should say mode cpu needs GDRCopy: {msg}"
            );
            eprintln!("mode cpu refused as expected: {msg}");
        }
        Ok(mut bufs) => {
            // GDRCopy works here: the mode must then work too.
            eprintln!("GDRCopy is available: running one case in mode cpu");
            let c = transport_cases()[5];
            let mut rng = Rng::new(seed());
            let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
            let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}, mode cpu: {e}"))
            });
            check(2, &c, &data, &res, "transport mode cpu");
            shutdown_all(bufs);
        }
    }
}

/// Create, dispatch, combine, tear down (barrier, free, QP shutdown) 20 times in a row in each
/// mode; every teardown must succeed.
#[test]
fn transport_create_use_teardown_20_times_per_mode() {
    let Some(ctxs) = gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for mode in TRANSPORT_MODES {
        for round in 0..20 {
            let mut bufs = transport_group(&ctxs, mode);
            let c = Case {
                hidden: 2048,
                topk: 8,
                fp8: (round % 2 == 1).then(Fp8Options::default),
                hook: round % 3 == 2,
                zero_copy: round % 4 == 3,
            };
            let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
            let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                run_case(b, &data[r], &c).unwrap_or_else(|e| {
                    panic!("round {round}, rank {r}, mode {}: {e}", mode.1.name())
                })
            });
            check(
                2,
                &c,
                &data,
                &res,
                &format!("mode {} round {round}", mode.1.name()),
            );
            shutdown_all(bufs);
        }
        eprintln!("transport mode {}: 20 rounds passed", mode.1.name());
    }
}
