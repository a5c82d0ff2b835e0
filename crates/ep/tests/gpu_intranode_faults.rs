//! Peer death intranode (issue 16, item 11; there is no NIC, so no fault plan): a rank that dies
//! mid-operation, after a dispatch that matched the reference and before the combine. The other
//! rank's combine must end in a bounded `Err` naming the rank that never came (the kernel's
//! bounded wait on separate GPUs, the launch gate on a shared one), the buffers must drop within
//! their bound, and a fresh group must then match the reference. (`gpu_intranode`'s
//! `peer_missing_is_a_bounded_error` covers a rank that never launches at all, before dispatch.)

mod gpu_intranode_common;

use std::time::{Duration, Instant};

use ep::{Buffer, CombineArgs, DispatchArgs, DispatchX, EpError, TopK};
use ep_kernels::testing::{rank_gpus, seed};
use gpu_intranode_common::{case_options, check_dispatch, rank_rngs, upload, Case, Round};

const BOUND: Duration = Duration::from_secs(1);

fn case() -> Case {
    Case {
        max_tokens: 64,
        hidden: 512,
        topk: 2,
        experts_per_rank: 2,
        ..Case::new("peer_death")
    }
}

/// Rank 0's combine without its peer: what it ended in, and how long it took.
type Combined = (Result<(), EpError>, Duration);

/// Rank `r`: layout, dispatch (checked), then rank 1 stops; rank 0 combines and returns what
/// that ended in and how long it took.
fn rank_until_death(
    c: &Case,
    round: &Round,
    r: usize,
    buf: &mut Buffer,
) -> Result<Option<Combined>, String> {
    let ctx = buf.context().clone();
    let e = |e: EpError| e.to_string();
    let inp = &round.plan.inputs[r];
    let ids = upload(&ctx, &inp.topk_idx, &[inp.tokens, c.topk])?;
    let weights = upload(&ctx, &inp.weights, &[inp.tokens, c.topk])?;
    let x = upload(
        &ctx,
        bytemuck::cast_slice::<u8, ep::Bf16>(&inp.x),
        &[inp.tokens, c.hidden],
    )?;
    let layout = buf.get_dispatch_layout(&ids).map_err(e)?;
    let mut args = DispatchArgs::new(DispatchX::Bf16(&x), &layout, 2);
    args.topk = Some(TopK {
        idx: &ids,
        weights: &weights,
    });
    let out = buf.dispatch(&args).map_err(e)?;
    buf.synchronize().map_err(e)?;
    check_dispatch(
        &out,
        &round.expected[r],
        inp.row_bytes,
        Some(c.topk),
        &format!("rank {r} dispatch"),
    )?;
    if r == 1 {
        return Ok(None);
    }
    let rows = out.handle.num_rows();
    let y = upload(
        &ctx,
        &round.plan.combine_x[r][..rows * c.hidden],
        &[rows, c.hidden],
    )?;
    let mut cargs = CombineArgs::new(&y, &out.handle, 2);
    cargs.topk_weights = out.topk_weights.as_ref();
    let t0 = Instant::now();
    let res = buf.combine(&cargs).and_then(|_| buf.synchronize());
    Ok(Some((res, t0.elapsed())))
}

#[test]
fn gpu_intranode_a_rank_dying_between_dispatch_and_combine_is_a_bounded_named_error() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let shared = ctxs[0].cu_device() == ctxs[1].cu_device();
    let c = case();
    let mut opts = case_options(&c, 2);
    opts.timeout = BOUND;
    let mut rngs = rank_rngs(seed(), 2);
    let mut bufs = Buffer::create_group(&ctxs, &opts).expect("create buffers");
    let round = Round::generate(&c, 2, &mut rngs);
    let outs: Vec<_> = std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, b)| {
                let (c, round) = (&c, &round);
                s.spawn(move || rank_until_death(c, round, r, b))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("rank thread panicked"))
            .collect()
    });
    let outs: Vec<_> = outs
        .into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r} before the death: {e}")))
        .collect();
    assert!(outs[1].is_none(), "rank 1 stopped");
    let (res, took) = outs[0].as_ref().expect("rank 0 combined");
    let err = match res {
        Ok(()) => panic!("rank 0's combine succeeded without rank 1"),
        Err(e) => e,
    };
    eprintln!("rank 0: combine without rank 1 failed after {took:?}: {err}");
    assert!(
        *took < BOUND * 4 + Duration::from_secs(2),
        "not bounded: {took:?}"
    );
    match err {
        EpError::PeerTimeout {
            rank: 0, peer: 1, ..
        } if !shared => {}
        EpError::SharedGpuTimeout {
            rank: 0, missing, ..
        } if shared => assert_eq!(missing, &vec![1]),
        other => panic!("expected a timeout naming rank 1, got {other}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("rank 0") && msg.contains('1'), "{msg}");
    // The buffers go within their bound (the dead rank's included).
    let t0 = Instant::now();
    drop(bufs);
    let took = t0.elapsed();
    eprintln!("dropped the group after the death in {took:?}");
    assert!(took < BOUND * 4 + Duration::from_secs(2), "drop: {took:?}");

    // A fresh group works and matches the reference.
    let mut bufs = Buffer::create_group(&ctxs, &opts).expect("rebuild");
    let round = Round::generate(&c, 2, &mut rngs);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, b)| {
                let (c, round, ctx) = (&c, &round, ctxs[r].clone());
                s.spawn(move || round.check_rank(c, r, b, &ctx, &format!("rebuilt rank {r}")))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("rank thread panicked"))
            .collect()
    });
    for r in results {
        r.expect("the rebuilt group matches the reference");
    }
    eprintln!("rebuilt group matches the reference");
}
