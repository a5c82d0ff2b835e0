//! Low-latency `enable_shrink` rank masks, wait-cost statistics and LogFMT combine, ranks as
//! threads, against the CPU reference on fresh random data (outputs poisoned before every
//! operation):
//!
//! - a masked rank at EP2 and EP4 (over NVLink, and through the transport in mode `gpu` at EP2):
//!   the other ranks mask it, it masks everyone; every rank's dispatch and combine equal the
//!   reference over the masked top-k ids (`reference::masked_ids`), the query reports the masks,
//!   the wait costs are counted for the linked ranks only; then every mask is cleaned and a plain
//!   case matches the unmasked reference (the ranks stayed in step);
//! - a timed-out wait: rank 0 masks rank 1, rank 1 masks nobody and waits for rank 0 in vain;
//!   with shrink on its wait runs out, masks rank 0 instead of failing, and the query says so;
//!   then `clean` (the collective reset) and a plain case;
//! - LogFMT combine at EP2 and EP4 (NVLink) and EP2 through the transport: within the format's
//!   tolerance of the exact BF16 combine, and close to the CPU LogFMT reference.

mod gpu_low_latency_common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::low_latency::reference::masked_ids;
use ep::low_latency::{
    logfmt, LlCombineArgs, LlCombineX, LlDispatchArgs, LowLatencyBuffer, LowLatencyOptions,
};
use ep::{Bf16, EpError, Tensor};
use ep_kernels::testing::{rank_gpus, seed, Rng};
use gpu_low_latency_common::{
    check_rank, experts_for, on_ranks, options, random_data, read_dispatch, routing, run_case,
    transport_options, Case, RankData, RankResult, MAX_TOKENS,
};
use ibgda_device::protocol::HandlerChoice;

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

fn shrink(mut o: LowLatencyOptions) -> LowLatencyOptions {
    o.enable_shrink = true;
    o
}

fn case(hidden: usize, topk: usize, hook: bool) -> Case {
    Case {
        hidden,
        topk,
        fp8: None,
        hook,
        zero_copy: false,
    }
}

/// What one rank got, with its wait costs (`[ranks]` each) and its mask status after.
struct Shrunk {
    res: RankResult,
    dispatch_wait: Vec<i64>,
    combine_wait: Vec<i64>,
    mask: Vec<i32>,
}

/// One dispatch + combine with wait-cost statistics (and LogFMT when asked), outputs downloaded;
/// the ranks meet at `meet` between the two, when given (a rank whose dispatch waited out its
/// bound comes late to the combine's launch gate, which has the same bound).
fn run_stats(
    buf: &mut LowLatencyBuffer,
    d: &RankData,
    c: &Case,
    use_logfmt: bool,
    meet: Option<&Barrier>,
) -> Result<Shrunk, EpError> {
    let ctx = buf.context().clone();
    let ranks = buf.ranks();
    let x = Tensor::from_host(&ctx, &d.x, &[d.tokens, c.hidden])?;
    let idx = Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk])?;
    let w = Tensor::from_host(&ctx, &d.weights, &[d.tokens, c.topk])?;
    let dstats = Tensor::filled(&ctx, 0i64, &[ranks])?;
    let cstats = Tensor::filled(&ctx, 0i64, &[ranks])?;
    let mut res = RankResult::default();
    let mut args = LlDispatchArgs::new(&x, &idx);
    args.return_recv_hook = c.hook;
    args.wait_stats = Some(&dstats);
    let mut out = buf.dispatch(&args)?;
    if let Some(h) = out.hook.take() {
        h.call()?;
    }
    buf.synchronize()?;
    read_dispatch(&out, &mut res)?;
    if let Some(m) = meet {
        m.wait();
    }
    let comb_in = Tensor::from_host(
        &ctx,
        &d.comb_in,
        &[buf.num_local_experts(), ranks * MAX_TOKENS, c.hidden],
    )?;
    let mut cargs = LlCombineArgs::new(LlCombineX::Tensor(&comb_in), &idx, &w, &out.handle);
    cargs.return_recv_hook = c.hook;
    cargs.wait_stats = Some(&cstats);
    cargs.use_logfmt = use_logfmt;
    let mut co = buf.combine(&cargs)?;
    if let Some(h) = co.hook.take() {
        h.call()?;
    }
    buf.synchronize()?;
    res.out = co.x.to_host()?;
    let mask = if buf.options().enable_shrink {
        buf.mask_status()?
    } else {
        Vec::new()
    };
    Ok(Shrunk {
        res,
        dispatch_wait: dstats.to_host()?,
        combine_wait: cstats.to_host()?,
        mask,
    })
}

/// `data` with every rank's top-k ids masked as `masked[r][s]` says.
fn masked_data(data: &[RankData], masked: &[Vec<bool>], local: usize) -> Vec<RankData> {
    data.iter()
        .enumerate()
        .map(|(r, d)| RankData {
            idx: masked_ids(&d.idx, r, local, masked),
            ..d.clone()
        })
        .collect()
}

/// Rank `masked_rank` masked by every other rank, and masking every rank itself.
fn one_rank_out(ranks: usize, m: usize) -> Vec<Vec<bool>> {
    (0..ranks)
        .map(|r| (0..ranks).map(|s| r == m || s == m).collect())
        .collect()
}

fn masked_rank_is_skipped(ctxs: &[Arc<CudaContext>], opts: &LowLatencyOptions, what: &str) {
    let ranks = ctxs.len();
    let mut rng = Rng::new(seed());
    let local = experts_for(ranks) / ranks;
    let m = ranks - 1;
    let masked = one_rank_out(ranks, m);
    let mut bufs = LowLatencyBuffer::create_group(ctxs, opts).expect("creating the buffers");
    for c in [case(2048, 4, false), case(7168, 8, true)] {
        let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
        let got: Vec<Shrunk> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            for (s, &on) in masked[r].iter().enumerate() {
                if on {
                    b.update_mask(s, true).expect("update_mask");
                }
            }
            run_stats(b, &data[r], &c, false, None).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        let want = masked_data(&data, &masked, local);
        for (r, g) in got.iter().enumerate() {
            let tag = format!("{what} EP{ranks} rank {m} masked {c:?}");
            check_rank(ranks, &c, &want, r, &g.res, &tag);
            let expect_mask: Vec<i32> = masked[r].iter().map(|&b| i32::from(b)).collect();
            assert_eq!(g.mask, expect_mask, "{tag}: rank {r}: mask status");
            for s in 0..ranks {
                let linked = !masked[r][s] && !masked[s][r];
                for (name, cost) in [("dispatch", &g.dispatch_wait), ("combine", &g.combine_wait)] {
                    if !linked {
                        assert_eq!(cost[s], 0, "{tag}: rank {r}: {name} waited on masked {s}");
                    } else {
                        assert!(
                            cost[s] >= 0,
                            "{tag}: rank {r}: {name} wait cost {}",
                            cost[s]
                        );
                    }
                }
            }
            if r != m {
                let waited: i64 = g.dispatch_wait.iter().sum();
                assert!(waited > 0, "{tag}: rank {r}: no dispatch wait counted");
            }
        }
        eprintln!("{what} EP{ranks}: rank {m} masked, {c:?} passed");
    }
    // Unmasked again (every rank made every call meanwhile): back to the full reference.
    let c = case(4096, 8, false);
    let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
    let got: Vec<RankResult> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        b.clean_mask().expect("clean_mask");
        run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    for (r, g) in got.iter().enumerate() {
        check_rank(
            ranks,
            &c,
            &data,
            r,
            g,
            &format!("{what} EP{ranks} unmasked"),
        );
    }
    shutdown_all(bufs);
}

#[test]
fn a_masked_rank_is_skipped_by_dispatch_and_combine() {
    for ranks in [2, 4] {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        masked_rank_is_skipped(&ctxs, &shrink(options(ranks)), "NVLink");
    }
}

#[test]
fn a_masked_rank_is_skipped_through_the_transport() {
    let Some(ctxs) = rank_gpus(2) else { return };
    masked_rank_is_skipped(
        &ctxs,
        &shrink(transport_options(2, HandlerChoice::Gpu)),
        "transport gpu",
    );
}

/// Rank 0 masks rank 1; rank 1 masks nobody and waits for rank 0, which sends it nothing: its
/// wait runs out and masks rank 0 (no error), and both ranks' results are those of the two
/// masks.
#[test]
fn a_timed_out_wait_masks_its_rank_instead_of_failing() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut rng = Rng::new(seed());
    let mut o = shrink(options(2));
    o.timeout = Duration::from_secs(2);
    let mut bufs = LowLatencyBuffer::create_group(&ctxs, &o).expect("creating the buffers");
    let c = case(2048, 4, false);
    let data = random_data(&mut rng, 2, c.hidden, c.topk, Some(32));
    let meet = Barrier::new(2);
    let got: Vec<Shrunk> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        if r == 0 {
            b.update_mask(1, true).expect("update_mask");
        }
        run_stats(b, &data[r], &c, false, Some(&meet)).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    assert_eq!(got[0].mask, vec![0, 1], "rank 0 masked rank 1 itself");
    assert_eq!(
        got[1].mask,
        vec![1, 0],
        "rank 1's wait on rank 0 ran out and masked it"
    );
    assert!(
        got[1].dispatch_wait[0] > 0,
        "rank 1 waited on rank 0: {:?}",
        got[1].dispatch_wait
    );
    let masked = vec![vec![false, true], vec![true, false]];
    let want = masked_data(&data, &masked, experts_for(2) / 2);
    for (r, g) in got.iter().enumerate() {
        check_rank(2, &c, &want, r, &g.res, "timed-out rank masked");
    }
    // The collective reset, masks cleaned: a plain case matches the unmasked reference.
    let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
    let got: Vec<RankResult> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        b.clean().expect("clean");
        b.clean_mask().expect("clean_mask");
        run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    for (r, g) in got.iter().enumerate() {
        check_rank(2, &c, &data, r, g, "after clean");
    }
    shutdown_all(bufs);
}

/// Token t's LogFMT combine on rank `s` against the exact BF16 reference (within the format's
/// error: half a code step of each weighted term) and the CPU LogFMT reference.
fn check_logfmt(ranks: usize, c: &Case, data: &[RankData], s: usize, got: &[Bf16], what: &str) {
    let local = experts_for(ranks) / ranks;
    let cap = ranks * MAX_TOKENS;
    let h = c.hidden;
    let routing = routing(ranks, c, data);
    let d = &data[s];
    let row = |e: usize, t: usize| -> &[Bf16] {
        let j = routing
            .row_of(e, s, t, local)
            .expect("routed token has a row");
        let (dr, l) = (e / local, e % local);
        &data[dr].comb_in[(l * cap + j) * h..(l * cap + j + 1) * h]
    };
    let cpu = logfmt::combine(&d.idx, &d.weights, c.topk, h, row);
    assert_eq!(got.len(), cpu.len(), "{what}: rank {s}: combine size");
    let (mut worst, mut off_cpu) = (0.0f32, 0usize);
    for (i, (g, l)) in got.iter().zip(&cpu).enumerate() {
        let (t, ch) = (i / h, i % h);
        // Σ_k |w x|: the scale of the sum's error.
        let mut mag = 0.0f32;
        let mut exact = 0.0f32;
        for k in 0..c.topk {
            let e = d.idx[t * c.topk + k];
            if e < 0 {
                continue;
            }
            let (w, v) = (d.weights[t * c.topk + k], row(e as usize, t)[ch].to_f32());
            mag += (w * v).abs();
            exact = w.mul_add(v, exact);
        }
        let (g, l) = (g.to_f32(), l.to_f32());
        let tol = 0.025 * mag + exact.abs() / 128.0 + 1e-6;
        assert!(
            (g - exact).abs() <= tol,
            "{what}: rank {s} token {t} channel {ch}: LogFMT combine {g}, exact {exact} (tolerance {tol})"
        );
        worst = worst.max((g - exact).abs() / mag.max(1e-6));
        if (g - l).abs() > l.abs() / 64.0 + 1e-4 {
            off_cpu += 1;
        }
    }
    // The GPU's log2/exp2 may pick a neighbouring code where the CPU's does not: rare.
    assert!(
        off_cpu * 1000 <= got.len(),
        "{what}: rank {s}: {off_cpu} of {} values far from the CPU LogFMT reference",
        got.len()
    );
    eprintln!(
        "{what}: rank {s}: worst relative error {worst:.4}, {off_cpu} values off the CPU reference"
    );
}

fn logfmt_group(ctxs: &[Arc<CudaContext>], opts: &LowLatencyOptions, what: &str) {
    let ranks = ctxs.len();
    let mut rng = Rng::new(seed());
    let mut bufs = LowLatencyBuffer::create_group(ctxs, opts).expect("creating the buffers");
    for c in [
        case(7168, 8, false),
        case(2048, 1, true),
        case(4096, 11, false),
    ] {
        let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
        let got: Vec<Shrunk> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            run_stats(b, &data[r], &c, true, None).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        for (s, g) in got.iter().enumerate() {
            check_logfmt(
                ranks,
                &c,
                &data,
                s,
                &g.res.out,
                &format!("{what} EP{ranks} {c:?}"),
            );
        }
    }
    // LogFMT with zero-copy is refused before any launch, on every rank alike.
    let refused: Vec<bool> = on_ranks(&mut bufs, |b| {
        let ctx = b.context().clone();
        let d = &random_data(&mut Rng::new(1), b.ranks(), 2048, 2, Some(4))[b.rank()];
        let x = Tensor::from_host(&ctx, &d.x, &[4, 2048]).unwrap();
        let idx = Tensor::from_host(&ctx, &d.idx, &[4, 2]).unwrap();
        let w = Tensor::from_host(&ctx, &d.weights, &[4, 2]).unwrap();
        let out = b.dispatch(&LlDispatchArgs::new(&x, &idx)).unwrap();
        let mut a = LlCombineArgs::new(LlCombineX::ZeroCopy, &idx, &w, &out.handle);
        a.use_logfmt = true;
        let r = matches!(b.combine(&a), Err(EpError::InvalidArgument { .. }));
        // Complete the group's step with a plain combine.
        let mut a = LlCombineArgs::new(LlCombineX::ZeroCopy, &idx, &w, &out.handle);
        a.use_logfmt = false;
        b.combine(&a).unwrap();
        b.synchronize().unwrap();
        r
    });
    assert!(
        refused.iter().all(|&r| r),
        "LogFMT with zero-copy must be refused"
    );
    shutdown_all(bufs);
}

#[test]
fn logfmt_combine_is_within_the_format_tolerance() {
    for ranks in [2, 4] {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        logfmt_group(&ctxs, &options(ranks), "NVLink");
    }
}

#[test]
fn logfmt_combine_through_the_transport() {
    let Some(ctxs) = rank_gpus(2) else { return };
    logfmt_group(
        &ctxs,
        &transport_options(2, HandlerChoice::Gpu),
        "transport gpu",
    );
}
