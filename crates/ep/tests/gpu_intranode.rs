//! Intranode dispatch/combine, ranks as threads of one process, against the CPU reference
//! (`ep::reference`) on fresh random data: layout and dispatch bit-exact, combine within
//! f32-accumulation rounding. Outputs are poisoned (0xAB) before every operation. Each case runs
//! at every rank count in {2, 4, 8} that the machine has GPUs for. (Ranks as processes:
//! `gpu_intranode_procs.rs`, same cases and checks.)

mod gpu_intranode_common;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, DispatchArgs, DispatchOutput, DispatchX, EpError,
    Fp8E4M3, Tensor,
};
use ep_kernels::testing::{gpus, seed, Rng};
use gpu_intranode_common::{case_options, random_bf16, rank_rngs, Case, Round, Routing};

fn rank_counts() -> Vec<usize> {
    let n = ibgda_device::cuda::device_count().unwrap_or(0);
    [2usize, 4, 8].into_iter().filter(|&r| r <= n).collect()
}

fn run_case(c: &Case) {
    for ranks in rank_counts() {
        let Some(ctxs) = gpus(ranks) else { return };
        run_case_on(c, &ctxs);
    }
}

fn run_case_on(c: &Case, ctxs: &[Arc<CudaContext>]) {
    let ranks = ctxs.len();
    let s = seed();
    eprintln!("case {} on {ranks} ranks: {c:?}", c.name);
    let mut bufs = Buffer::create_group(ctxs, &case_options(c, ranks)).expect("create buffers");
    let mut rngs = rank_rngs(s, ranks);
    for it in 0..c.iterations {
        let round = Round::generate(c, ranks, &mut rngs);
        let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
            let joins: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(r, buf)| {
                    let round = &round;
                    let ctx = ctxs[r].clone();
                    sc.spawn(move || {
                        let what = format!("{} it {it} rank {r}/{ranks}", c.name);
                        round.check_rank(c, r, buf, &ctx, &what)
                    })
                })
                .collect();
            joins
                .into_iter()
                .map(|j| {
                    j.join()
                        .unwrap_or_else(|_| Err("rank thread panicked".into()))
                })
                .collect()
        });
        let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
    }
    eprintln!(
        "case {} on {ranks} ranks: {} iteration(s) match the reference",
        c.name, c.iterations
    );
}

#[test]
fn gpu_intranode_bf16_topk() {
    run_case(&Case {
        alignment: 4,
        biases: 2,
        ..Case::new("bf16_topk")
    });
}

#[test]
fn gpu_intranode_fp8_topk() {
    run_case(&Case {
        fp8: true,
        biases: 1,
        ..Case::new("fp8_topk")
    });
}

#[test]
fn gpu_intranode_without_topk() {
    run_case(&Case {
        send_topk: false,
        biases: 1,
        ..Case::new("bf16_no_topk")
    });
    run_case(&Case {
        send_topk: false,
        fp8: true,
        hidden: 256,
        ..Case::new("fp8_no_topk")
    });
}

#[test]
fn gpu_intranode_cached() {
    run_case(&Case {
        cached: true,
        ..Case::new("bf16_cached")
    });
    run_case(&Case {
        cached: true,
        fp8: true,
        hidden: 1024,
        ..Case::new("fp8_cached")
    });
}

#[test]
fn gpu_intranode_worst_tokens() {
    run_case(&Case {
        worst: true,
        max_tokens: 128,
        ..Case::new("bf16_worst")
    });
    run_case(&Case {
        worst: true,
        fp8: true,
        cached: true,
        max_tokens: 128,
        hidden: 2048,
        ..Case::new("fp8_worst_cached")
    });
}

#[test]
fn gpu_intranode_async_chain_repeated() {
    // Async finish, each operation ordered after the previous one's event; several rounds on
    // one buffer reuse the pooled regions and advance the barrier epochs.
    run_case(&Case {
        async_chain: true,
        iterations: 4,
        max_tokens: 256,
        hidden: 4096,
        biases: 1,
        ..Case::new("async_chain")
    });
}

#[test]
fn gpu_intranode_edge_cases() {
    // Only rank 0 receives anything; the others get zero rows and combine zero rows.
    run_case(&Case {
        routing: Routing::OnlyRank0,
        max_tokens: 64,
        hidden: 512,
        ..Case::new("only_rank0")
    });
    run_case(&Case {
        routing: Routing::OnlyRank0,
        worst: true,
        max_tokens: 64,
        hidden: 512,
        ..Case::new("only_rank0_worst")
    });
    // One token per rank.
    run_case(&Case {
        tokens: Some(1),
        max_tokens: 1,
        hidden: 128,
        topk: 2,
        experts_per_rank: 2,
        ..Case::new("one_token")
    });
    // Small hidden, odd token counts, top-1.
    run_case(&Case {
        max_tokens: 37,
        hidden: 8,
        topk: 1,
        experts_per_rank: 1,
        biases: 2,
        ..Case::new("tiny_rows")
    });
}

#[test]
fn gpu_intranode_peer_missing_is_a_bounded_error() {
    let Some(ctxs) = gpus(2) else { return };
    let s = seed();
    let mut opts = BufferOptions::new(16, 128, 2, 4);
    opts.timeout = Duration::from_millis(300);
    let mut bufs = Buffer::create_group(&ctxs, &opts).expect("create buffers");
    let mut rng = Rng::new(s);
    let ids: Vec<i32> = (0..16).map(|_| rng.below(4) as i32).collect();
    let x = random_bf16(&mut rng, 16 * 128);
    let b0 = &mut bufs[0];
    let ids = Tensor::from_host(&ctxs[0], &ids, &[8, 2]).unwrap();
    let x = Tensor::from_host(&ctxs[0], &x, &[16, 128]).unwrap();
    let layout = b0.get_dispatch_layout(&ids).unwrap();
    let x8 = Tensor::from_host(&ctxs[0], &x.to_host().unwrap()[..8 * 128], &[8, 128]).unwrap();
    // Rank 1 never joins: rank 0 must come back with an error naming rank 1 and the wait.
    let t0 = std::time::Instant::now();
    let err = b0
        .dispatch(&DispatchArgs::new(DispatchX::Bf16(&x8), &layout, 2))
        .unwrap_err();
    eprintln!("after {:?}: {err}", t0.elapsed());
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "not bounded: {:?}",
        t0.elapsed()
    );
    match &err {
        EpError::PeerTimeout {
            rank: 0,
            peer: 1,
            what,
            ..
        } => assert_eq!(*what, "dispatch count exchange"),
        other => panic!("unexpected error: {other}"),
    }
    let again = b0
        .dispatch(&DispatchArgs::new(DispatchX::Bf16(&x8), &layout, 2))
        .unwrap_err();
    assert!(matches!(again, EpError::Poisoned { .. }), "{again}");
}

fn err<T>(r: Result<T, EpError>) -> EpError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn gpu_intranode_bad_inputs_are_errors_before_launch() {
    let Some(ctxs) = gpus(2) else { return };
    let _ = seed();
    let opts = BufferOptions::new(8, 256, 2, 4);
    let mut a = Buffer::create_group(&ctxs, &opts).expect("create buffers");
    let mut b = Buffer::create_group(&ctxs, &opts).expect("create buffers");
    let ctx = &ctxs[0];
    let buf = &mut a[0];

    // Expert id out of range.
    let bad_ids = Tensor::from_host(ctx, &[0, 4, 1, -1], &[2, 2]).unwrap();
    let e = err(buf.get_dispatch_layout(&bad_ids));
    assert!(
        matches!(e, EpError::ExpertIdOutOfRange { count: 1, .. }),
        "{e}"
    );
    let bad_ids = Tensor::from_host(ctx, &[0, -2, 1, -1], &[2, 2]).unwrap();
    assert!(matches!(
        err(buf.get_dispatch_layout(&bad_ids)),
        EpError::ExpertIdOutOfRange { .. }
    ));
    // More tokens than capacity.
    let many = Tensor::from_host(ctx, &[0i32; 18], &[9, 2]).unwrap();
    assert!(matches!(
        err(buf.get_dispatch_layout(&many)),
        EpError::InvalidArgument { .. }
    ));

    let ids = Tensor::from_host(ctx, &[0, 1, 2, 3], &[2, 2]).unwrap();
    let layout = buf.get_dispatch_layout(&ids).unwrap();
    // FP8 hidden not a multiple of 128.
    let x = Tensor::from_host(ctx, &[Fp8E4M3(0); 2 * 64], &[2, 64]).unwrap();
    let s = Tensor::from_host(ctx, &[1.0f32; 2], &[2, 1]).unwrap();
    let e = err(buf.dispatch(&DispatchArgs::new(
        DispatchX::Fp8 { x: &x, scales: &s },
        &layout,
        2,
    )));
    assert!(e.to_string().contains("multiple of 128"), "{e}");
    // BF16 rows not 16-byte aligned.
    let x = Tensor::from_host(ctx, &[Bf16(0); 2 * 12], &[2, 12]).unwrap();
    let e = err(buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &layout, 2)));
    assert!(e.to_string().contains("multiple of 16"), "{e}");
    // Wrong scales shape (a dtype/shape mismatch).
    let x = Tensor::from_host(ctx, &[Fp8E4M3(0); 2 * 256], &[2, 256]).unwrap();
    let s = Tensor::from_host(ctx, &[1.0f32; 2], &[2, 1]).unwrap();
    let e = err(buf.dispatch(&DispatchArgs::new(
        DispatchX::Fp8 { x: &x, scales: &s },
        &layout,
        2,
    )));
    assert!(e.to_string().contains("scales"), "{e}");
    // Token count differing from the layout's.
    let x = Tensor::from_host(ctx, &[Bf16(0); 3 * 256], &[3, 256]).unwrap();
    assert!(matches!(
        err(buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &layout, 2))),
        EpError::InvalidArgument { .. }
    ));
    // A layout from another buffer.
    let x = Tensor::from_host(ctx, &[Bf16(0); 2 * 256], &[2, 256]).unwrap();
    let foreign = b[0].get_dispatch_layout(&ids).unwrap();
    let e = err(buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &foreign, 2)));
    assert!(
        matches!(e, EpError::ForeignHandle { what: "layout", .. }),
        "{e}"
    );
    // A tensor on the wrong GPU.
    let x1 = Tensor::from_host(&ctxs[1], &[Bf16(0); 2 * 256], &[2, 256]).unwrap();
    let e = err(buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x1), &layout, 2)));
    assert!(e.to_string().contains("GPU 1"), "{e}");
    // Nothing was launched: the buffers still work together afterwards (handle check below).
    let mut outs: Vec<Result<DispatchOutput, EpError>> = Vec::new();
    std::thread::scope(|sc| {
        let js: Vec<_> = a
            .iter_mut()
            .enumerate()
            .map(|(r, buf)| {
                let ctx = ctxs[r].clone();
                sc.spawn(move || {
                    let ids = Tensor::from_host(&ctx, &[0, 1, 2, 3], &[2, 2]).unwrap();
                    let layout = buf.get_dispatch_layout(&ids).unwrap();
                    let x = Tensor::from_host(&ctx, &[Bf16(0x3f80); 2 * 256], &[2, 256]).unwrap();
                    let out = buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &layout, 2));
                    buf.synchronize().map(|_| out)?
                })
            })
            .collect();
        outs = js.into_iter().map(|j| j.join().unwrap()).collect();
    });
    let out0 = outs.swap_remove(0).expect("dispatch after rejected calls");
    assert_eq!(out0.num_recv_tokens, Some(2));
    // A handle from another buffer.
    let y = Tensor::from_host(ctx, &[Bf16(0); 4 * 256], &[4, 256]).unwrap();
    let e = err(b[0].combine(&CombineArgs::new(&y, &out0.handle, 2)));
    assert!(
        matches!(e, EpError::ForeignHandle { what: "handle", .. }),
        "{e}"
    );
    // Combine rows not matching the handle.
    let y = Tensor::from_host(ctx, &[Bf16(0); 3 * 256], &[3, 256]).unwrap();
    assert!(matches!(
        err(a[0].combine(&CombineArgs::new(&y, &out0.handle, 2))),
        EpError::InvalidArgument { .. }
    ));
}
