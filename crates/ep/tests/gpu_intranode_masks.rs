//! Rank masks in normal (intranode) mode, ranks as threads of one process sharing however many
//! GPUs are visible, at EP2, EP4 and EP8: fresh random inputs each round, checked against the
//! CPU reference under the masks (`ep::reference::masked_inputs`), outputs poisoned (0xAB).
//!
//! Every rank makes every call (the barrier epochs stay in step); the masks split the ranks into
//! groups that exchange only inside themselves, change between rounds (unmasking included), and
//! masks the kernels cannot honour fail with a named error instead of a wrong layout.

mod gpu_intranode_common;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::reference::normal_mode_links;
use ep::{Bf16, Buffer, DispatchArgs, DispatchX, EpError, StreamOrder, TopK};
use ep_kernels::testing::{on_rank_counts, on_rank_threads, rank_gpus, seed};
use gpu_intranode_common::{case_options, config_for, rank_rngs, upload, Case, RankPlan, Round};

const RANK_COUNTS: [usize; 3] = [2, 4, 8];

/// `masked[r][s]` for ranks in groups: ranks of different groups mask each other.
fn groups(ranks: usize, group_of: impl Fn(usize) -> usize) -> Vec<Vec<bool>> {
    (0..ranks)
        .map(|r| (0..ranks).map(|s| group_of(r) != group_of(s)).collect())
        .collect()
}

/// The mask patterns every case walks through, in order, on one group of buffers: the last
/// rank cut off (a failed rank that still runs), two halves, nobody masked (everyone unmasked
/// again), the last rank cut off again.
fn patterns(ranks: usize) -> Vec<(&'static str, Vec<Vec<bool>>)> {
    let last = |r| usize::from(r == ranks - 1);
    vec![
        ("last rank cut off", groups(ranks, last)),
        ("halves", groups(ranks, |r| r * 2 / ranks)),
        ("none", groups(ranks, |_| 0)),
        ("last rank cut off again", groups(ranks, last)),
    ]
}

/// Sets rank `r`'s mask to row `r` of `masked` (from a clean mask) and checks what it reports.
fn set_masks(buf: &mut Buffer, r: usize, masked: &[Vec<bool>]) -> Result<(), String> {
    let e = |e: EpError| e.to_string();
    buf.clean_mask().map_err(e)?;
    for (s, &m) in masked[r].iter().enumerate() {
        if m {
            buf.update_mask(s, true).map_err(e)?;
        }
    }
    let got = buf.mask_status().map_err(e)?;
    let want: Vec<i32> = masked[r].iter().map(|&m| i32::from(m)).collect();
    if got != want {
        return Err(format!("mask_status {got:?}, expected {want:?}"));
    }
    Ok(())
}

fn run_case(c: &Case) {
    on_rank_counts(&RANK_COUNTS, |ctxs| run_case_on(c, ctxs));
}

fn run_case_on(c: &Case, ctxs: &[Arc<CudaContext>]) {
    let ranks = ctxs.len();
    let s = seed();
    let mut bufs = Buffer::create_group(ctxs, &case_options(c, ranks)).expect("create buffers");
    let mut rngs = rank_rngs(s, ranks);
    for (name, masked) in patterns(ranks) {
        assert!(normal_mode_links(&masked).is_ok(), "{name}: a bad pattern");
        eprintln!("case {} on {ranks} ranks, masks {name}: {c:?}", c.name);
        for it in 0..c.iterations {
            let round = Round::generate_masked(c, ranks, &mut rngs, Some(&masked));
            let results = on_rank_threads(&mut bufs, |r, buf| {
                let what = format!("{} masks {name} it {it} rank {r}/{ranks}", c.name);
                set_masks(buf, r, &masked).map_err(|e| format!("{what}: {e}"))?;
                round.check_rank(c, r, buf, &ctxs[r], &what)
            });
            let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
        }
    }
    eprintln!(
        "case {} on {ranks} ranks: every mask pattern matches the reference",
        c.name
    );
}

#[test]
fn gpu_intranode_masks_bf16_topk() {
    run_case(&Case {
        alignment: 4,
        biases: 1,
        max_tokens: 256,
        iterations: 2,
        ..Case::new("masks_bf16_topk")
    });
}

#[test]
fn gpu_intranode_masks_fp8_cached() {
    run_case(&Case {
        fp8: true,
        cached: true,
        max_tokens: 256,
        hidden: 2048,
        ..Case::new("masks_fp8_cached")
    });
}

#[test]
fn gpu_intranode_masks_worst_tokens() {
    run_case(&Case {
        worst: true,
        max_tokens: 128,
        hidden: 1024,
        ..Case::new("masks_worst")
    });
}

/// Rank `r`'s dispatch of its plan's inputs (BF16, with top-k), with the layout it needs.
fn dispatch_once(
    buf: &mut Buffer,
    ctx: &Arc<CudaContext>,
    c: &Case,
    plan: &RankPlan,
    r: usize,
) -> Result<ep::DispatchOutput, EpError> {
    let inp = &plan.inputs[r];
    let t = inp.tokens;
    let up = |e: String| EpError::InvalidArgument { rank: r, what: e };
    let ids = upload(ctx, &inp.topk_idx, &[t, c.topk]).map_err(up)?;
    let weights = upload(ctx, &inp.weights, &[t, c.topk]).map_err(up)?;
    let x = upload(
        ctx,
        bytemuck::cast_slice::<u8, Bf16>(&inp.x),
        &[t, c.hidden],
    )
    .map_err(up)?;
    let layout = buf.get_dispatch_layout(&ids)?;
    let mut args = DispatchArgs::new(DispatchX::Bf16(&x), &layout, buf.ranks());
    args.config = config_for(buf);
    args.topk = Some(TopK {
        idx: &ids,
        weights: &weights,
    });
    let out = buf.dispatch(&args)?;
    buf.synchronize()?;
    Ok(out)
}

/// Masks the kernels cannot honour fail on every rank with `EpError::MaskMismatch`, soon (no
/// rank waits out its bound), and nothing is received: ranks 0 and 1 mask each other while the
/// others link both (not transitive); the last rank masks rank 0, which does not mask it back
/// (one-sided: rank 0 learns it while waiting, the others from the link sets). Then, on fresh
/// buffers, a cached dispatch whose handle was made under other masks.
#[test]
fn gpu_intranode_masks_that_cannot_be_honoured() {
    for ranks in ep_kernels::testing::rank_counts(&[4, 8]) {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        let c = Case {
            max_tokens: 64,
            hidden: 512,
            ..Case::new("masks_mismatch")
        };
        let mut opts = case_options(&c, ranks);
        opts.timeout = Duration::from_secs(5);
        let s = seed();

        let mut rngs = rank_rngs(s, ranks);
        let round = Round::generate(&c, ranks, &mut rngs);
        let mut not_transitive = groups(ranks, |_| 0);
        not_transitive[0][1] = true;
        not_transitive[1][0] = true;
        let mut one_sided = groups(ranks, |_| 0);
        one_sided[ranks - 1][0] = true;
        for (name, masked) in [("not transitive", not_transitive), ("one-sided", one_sided)] {
            assert!(normal_mode_links(&masked).is_err(), "{name}");
            let mut bufs = Buffer::create_group(&ctxs, &opts).expect("create buffers");
            let started = std::time::Instant::now();
            let results = on_rank_threads(&mut bufs, |r, buf| {
                set_masks(buf, r, &masked)?;
                match dispatch_once(buf, &ctxs[r], &c, &round.plan, r) {
                    Err(EpError::MaskMismatch { .. }) => Ok(()),
                    Err(e) => Err(format!("{name}: rank {r}: expected MaskMismatch, got {e}")),
                    Ok(_) => Err(format!(
                        "{name}: rank {r}: dispatch under bad masks succeeded"
                    )),
                }
            });
            let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
            assert!(
                started.elapsed() < opts.timeout,
                "{name}: the mismatch took {:?}: a rank waited out its bound",
                started.elapsed()
            );
        }

        // A cached dispatch under other masks than its handle's.
        let isolated = groups(ranks, |r| usize::from(r == ranks - 1));
        let mut bufs = Buffer::create_group(&ctxs, &opts).expect("create buffers");
        let results = on_rank_threads(&mut bufs, |r, buf| {
            let e = |e: EpError| format!("rank {r}: {e}");
            let out = dispatch_once(buf, &ctxs[r], &c, &round.plan, r).map_err(e)?;
            set_masks(buf, r, &isolated)?;
            let inp = &round.plan.inputs[r];
            let x = upload(
                &ctxs[r],
                bytemuck::cast_slice::<u8, Bf16>(&inp.x),
                &[inp.tokens, c.hidden],
            )?;
            let cfg = config_for(buf);
            let again = buf
                .dispatch_cached(
                    DispatchX::Bf16(&x),
                    &out.handle,
                    &cfg,
                    &StreamOrder::default(),
                )
                .and_then(|_| buf.synchronize());
            match again {
                Err(EpError::MaskMismatch { .. }) => Ok(()),
                Err(e) => Err(format!("rank {r}: expected MaskMismatch, got {e}")),
                Ok(()) => Err(format!(
                    "rank {r}: cached dispatch under other masks succeeded"
                )),
            }
        });
        let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
    }
}

/// Host-side checks: a rank cannot mask itself, a rank out of range is refused, and
/// `query_mask` wants an `i32 [ranks]` tensor.
#[test]
fn gpu_intranode_masks_arguments() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let c = Case::new("masks_arguments");
    let mut bufs = Buffer::create_group(&ctxs, &case_options(&c, 2)).expect("create buffers");
    let results = on_rank_threads(&mut bufs, |r, buf| {
        let bad = |what: &str, res: Result<(), EpError>| match res {
            Err(EpError::InvalidArgument { .. }) => Ok(()),
            other => Err(format!(
                "rank {r}: {what}: expected InvalidArgument, got {other:?}"
            )),
        };
        bad("masking itself", buf.update_mask(r, true))?;
        bad("rank out of range", buf.update_mask(2, true))?;
        let wrong = ep::Tensor::filled(&ctxs[r], 0i32, &[3]).map_err(|e| e.to_string())?;
        bad("query into [3]", buf.query_mask(&wrong))?;
        buf.update_mask(r, false).map_err(|e| e.to_string())?;
        let st = buf.mask_status().map_err(|e| e.to_string())?;
        if st != vec![0, 0] {
            return Err(format!("rank {r}: mask_status {st:?}"));
        }
        Ok(())
    });
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
