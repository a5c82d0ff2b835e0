//! Intranode dispatch/combine, ranks as threads of one process, against the CPU reference
//! (`ep::reference`) on fresh random data: layout and dispatch bit-exact, combine within
//! f32-accumulation rounding. Outputs are poisoned (0xAB) before every operation. Each case runs
//! at EP2, EP4 and EP8 on however many GPUs are visible, ranks sharing them round robin (the
//! harness prints the mapping). (Ranks as processes: `gpu_intranode_procs.rs`, same cases and
//! checks.)

mod gpu_intranode_common;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, DispatchArgs, DispatchOutput, DispatchX, EpError,
    Fp8E4M3, Tensor,
};
use ep_kernels::testing::{on_rank_counts, on_rank_threads, rank_gpus, seed, Rng};
use gpu_intranode_common::gpu_shared::poison_host;
use gpu_intranode_common::{case_options, random_bf16, rank_rngs, Case, Round, Routing};

/// Every case runs at each of these, on however many GPUs there are (ranks share them).
const RANK_COUNTS: [usize; 3] = [2, 4, 8];

fn run_case(c: &Case) {
    on_rank_counts(&RANK_COUNTS, |ctxs| run_case_on(c, ctxs));
}

fn run_case_on(c: &Case, ctxs: &[Arc<CudaContext>]) {
    let ranks = ctxs.len();
    let s = seed();
    eprintln!("case {} on {ranks} ranks: {c:?}", c.name);
    let mut bufs = Buffer::create_group(ctxs, &case_options(c, ranks)).expect("create buffers");
    let mut rngs = rank_rngs(s, ranks);
    for it in 0..c.iterations {
        let round = Round::generate(c, ranks, &mut rngs);
        let results = on_rank_threads(&mut bufs, |r, buf| {
            let what = format!("{} it {it} rank {r}/{ranks}", c.name);
            round.check_rank(c, r, buf, &ctxs[r], &what)
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
    let Some(ctxs) = rank_gpus(2) else { return };
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
    // On one GPU the two ranks share its context and meet on the host before every waiting
    // launch: rank 0 is stopped there, naming rank 1, before it launches anything.
    match &err {
        EpError::PeerTimeout {
            rank: 0,
            peer: 1,
            what,
            ..
        } if ctxs[0].cu_device() != ctxs[1].cu_device() => {
            assert_eq!(*what, "dispatch count exchange")
        }
        EpError::SharedGpuTimeout {
            rank: 0, missing, ..
        } if ctxs[0].cu_device() == ctxs[1].cu_device() => assert_eq!(missing, &vec![1]),
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
    let Some(ctxs) = rank_gpus(2) else { return };
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
        matches!(
            e,
            EpError::ExpertIdOutOfRange {
                count: Some(1),
                id: 4,
                token: 0,
                slot: Some(1),
                ..
            }
        ),
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
    // A tensor on the wrong GPU (where there is another one).
    if ctxs[1].cu_device() != ctx.cu_device() {
        let x1 = Tensor::from_host(&ctxs[1], &[Bf16(0); 2 * 256], &[2, 256]).unwrap();
        let e = err(buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x1), &layout, 2)));
        assert!(e.to_string().contains("GPU 1"), "{e}");
    }
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

/// One replay's inputs for every rank and what each must get back.
struct Replay {
    inputs: Vec<ep::reference::RankInput>,
    expected: Vec<ep::reference::Received>,
    combine_x: Vec<Vec<Bf16>>,
    bias: Vec<Vec<Bf16>>,
    want: Vec<(Vec<Bf16>, Vec<f32>)>,
}

impl Replay {
    /// Fresh rows, weights, combine inputs and biases over the routing of `first` (the graph's
    /// layout is computed once, before the capture).
    fn generate(c: &Case, first: Option<&Replay>, rngs: &mut [Rng]) -> Self {
        use ep::reference::{self, CombineInput};
        use ep_kernels::testing::random_f32;
        use gpu_intranode_common::{gen_input, replace_x};
        let ranks = rngs.len();
        let num_experts = ranks * c.experts_per_rank;
        let inputs: Vec<_> = (0..ranks)
            .map(|r| match first {
                None => gen_input(c, &mut rngs[r], ranks),
                Some(f) => {
                    let mut i = replace_x(c, &f.inputs[r], &mut rngs[r]);
                    i.weights = random_f32(&mut rngs[r], i.tokens * c.topk);
                    i
                }
            })
            .collect();
        let expected = reference::dispatch(&inputs, num_experts, 1);
        let worst_rows = ranks * c.max_tokens;
        let combine_x: Vec<Vec<Bf16>> = (0..ranks)
            .map(|r| random_bf16(&mut rngs[r], worst_rows * c.hidden))
            .collect();
        let bias: Vec<Vec<Bf16>> = (0..ranks)
            .map(|r| random_bf16(&mut rngs[r], inputs[r].tokens * c.hidden))
            .collect();
        let combine_in: Vec<CombineInput> = (0..ranks)
            .map(|r| CombineInput {
                x: combine_x[r][..expected[r].sources.len() * c.hidden].to_vec(),
                weights: expected[r].weights.clone(),
            })
            .collect();
        let bias_ref: Vec<[Option<Vec<Bf16>>; 2]> =
            (0..ranks).map(|r| [Some(bias[r].clone()), None]).collect();
        let tokens: Vec<usize> = inputs.iter().map(|i| i.tokens).collect();
        let want = reference::combine(&expected, &combine_in, &tokens, c.hidden, c.topk, &bias_ref);
        Self {
            inputs,
            expected,
            combine_x,
            bias,
            want,
        }
    }
}

/// Rank `r` of the graph test: layout before the capture, dispatch (worst tokens, top-k) and
/// combine (recv weights, one bias) captured on the buffer's stream, then every replay in
/// `replays` with its inputs written into the captured input tensors and the outputs poisoned
/// from the host first; `eager` runs as ordinary calls after replay `eager_after`.
#[allow(clippy::too_many_arguments)]
fn graph_rank(
    c: &Case,
    r: usize,
    buf: &mut Buffer,
    ctx: &Arc<CudaContext>,
    replays: &[Replay],
    eager: &Round,
    eager_after: usize,
) -> Result<(), String> {
    use cudarc::driver::sys;
    use ep::{CombineArgs as CArgs, TopK};
    use gpu_intranode_common::{check_combine, check_dispatch, upload};
    let e = |e: EpError| e.to_string();
    let ranks = buf.ranks();
    let first = &replays[0].inputs[r];
    let t = first.tokens;
    let worst = ranks * c.max_tokens;
    let ids = upload(ctx, &first.topk_idx, &[t, c.topk])?;
    let layout = buf.get_dispatch_layout(&ids).map_err(e)?;
    let zero = Bf16::from_f32(0.0);
    let x = Tensor::filled(ctx, zero, &[t, c.hidden]).map_err(e)?;
    let w = Tensor::filled(ctx, 0f32, &[t, c.topk]).map_err(e)?;
    let y = Tensor::filled(ctx, zero, &[worst, c.hidden]).map_err(e)?;
    let bias = Tensor::filled(ctx, zero, &[t, c.hidden]).map_err(e)?;

    // Host waits are refused under capture (checked before anything is captured).
    let stream = buf.comm_stream().clone();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| format!("cuStreamBeginCapture: {e:?}"))?;
    let captured = (|| -> Result<_, EpError> {
        if !buf.is_capturing()? {
            return Err(EpError::InvalidArgument {
                rank: r,
                what: "the buffer does not see its stream capturing".into(),
            });
        }
        let refused = buf.get_dispatch_layout(&ids).is_err() && buf.synchronize().is_err();
        let mut args = DispatchArgs::new(DispatchX::Bf16(&x), &layout, ranks);
        args.topk = Some(TopK {
            idx: &ids,
            weights: &w,
        });
        let no_worst = buf.dispatch(&args).is_err();
        args.num_worst_tokens = Some(worst);
        args.config = gpu_intranode_common::config_for(buf);
        let d = buf.dispatch(&args)?;
        let recv_w = d.topk_weights.clone();
        let mut cargs = CArgs::new(&y, &d.handle, ranks);
        cargs.topk_weights = recv_w.as_ref();
        cargs.bias = [Some(&bias), None];
        cargs.config = gpu_intranode_common::config_for(buf);
        let comb = buf.combine(&cargs)?;
        Ok((d, comb, refused && no_worst))
    })();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let (dout, cout, refused) = captured.map_err(|e| format!("capture: {e}"))?;
    let graph = graph
        .map_err(|e| format!("cuStreamEndCapture: {e:?}"))?
        .ok_or("the capture recorded no work")?;
    if !refused {
        return Err(
            "layout, synchronize or dispatch without worst tokens accepted under capture".into(),
        );
    }
    let ep::RecvX::Bf16(recv_x) = &dout.x else {
        return Err("BF16 dispatch returned FP8 rows".into());
    };
    let (recv_idx, recv_w) = (
        dout.topk_idx.as_ref().ok_or("no topk_idx")?,
        dout.topk_weights.as_ref().ok_or("no topk_weights")?,
    );
    let out_w = cout.topk_weights.as_ref().ok_or("no combined weights")?;

    for (k, rp) in replays.iter().enumerate() {
        let what = format!("graph replay {k} rank {r}/{ranks}");
        let inp = &rp.inputs[r];
        x.copy_from_host(bytemuck::cast_slice(&inp.x)).map_err(e)?;
        w.copy_from_host(&inp.weights).map_err(e)?;
        y.copy_from_host(&rp.combine_x[r]).map_err(e)?;
        bias.copy_from_host(&rp.bias[r]).map_err(e)?;
        poison_host(recv_x)?;
        poison_host(recv_idx)?;
        poison_host(recv_w)?;
        poison_host(&dout.recv_tokens_per_expert)?;
        poison_host(&cout.x)?;
        poison_host(out_w)?;
        // The uploads ran on the legacy stream; the graph runs on the buffer's stream. Only the
        // legacy stream is waited for: a whole-context synchronize would also wait for the
        // graphs of ranks sharing this GPU, which wait for this rank's.
        ctx.default_stream()
            .synchronize()
            .map_err(|e| format!("cuStreamSynchronize(legacy): {e:?}"))?;
        // Ranks of this process sharing the GPU meet around the replay, as the buffer does
        // around its own launches.
        let replay = || {
            graph.launch().map_err(|source| EpError::Cuda {
                rank: r,
                call: "cuGraphLaunch",
                source,
            })
        };
        let gate = buf.launch_gate().map(|g| (&**g, Duration::from_secs(20)));
        ep::residency::gated(gate, r, "cuGraphLaunch", replay)
            .map_err(|e| format!("{what}: {e}"))?;
        buf.synchronize().map_err(|e| format!("{what}: {e}"))?;
        check_dispatch(
            &dout,
            &rp.expected[r],
            inp.row_bytes,
            Some(c.topk),
            &format!("{what} dispatch"),
        )?;
        let gx = cout.x.to_host().map_err(e)?;
        let gw = out_w.to_host().map_err(e)?;
        check_combine(
            &gx,
            &rp.want[r].0,
            Some(&gw),
            &rp.want[r].1,
            &format!("{what} combine"),
        )?;
        if k == eager_after {
            // Eager calls between replays: the GPU-side epochs keep every rank's barriers paired.
            eager.check_rank(
                c,
                r,
                buf,
                ctx,
                &format!("eager after replay {k} rank {r}/{ranks}"),
            )?;
        }
    }
    drop(graph);
    Ok(())
}

/// Dispatch (num_worst_tokens) + combine captured in a CUDA graph on each rank's communication
/// stream, replayed with fresh inputs written into the captured tensors between replays, outputs
/// poisoned before each; every replay checked against the CPU reference, and an eager round
/// between replays (epochs are counted on the GPU, so both kinds interleave). EP2, on two GPUs
/// or sharing one.
#[test]
fn gpu_intranode_graph_capture_worst_tokens() {
    let ranks = 2;
    let Some(ctxs) = rank_gpus(ranks) else { return };
    let c = Case {
        worst: true,
        max_tokens: 128,
        tokens: Some(100),
        hidden: 2048,
        ..Case::new("graph_worst")
    };
    let s = seed();
    let mut rngs = rank_rngs(s, ranks);
    let mut replays = vec![Replay::generate(&c, None, &mut rngs)];
    for _ in 1..5 {
        let next = Replay::generate(&c, Some(&replays[0]), &mut rngs);
        replays.push(next);
    }
    let eager = Round::generate(&c, ranks, &mut rngs);
    let mut bufs = Buffer::create_group(&ctxs, &case_options(&c, ranks)).expect("create buffers");
    let results = on_rank_threads(&mut bufs, |r, buf| {
        graph_rank(&c, r, buf, &ctxs[r], &replays, &eager, 1)
    });
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
    eprintln!(
        "graph_worst on {ranks} rank(s): {} replays and an eager round match the reference",
        replays.len()
    );
}

/// Ranks as threads of this process that meet over TCP (`TcpCommunicator`, as processes would):
/// the communicator does not claim one process, so the buffer publishes combine inputs as window
/// offsets (staging the ones outside the window, as processes must), while
/// the bootstrap tells per peer that the others are threads here and maps their windows through
/// peer access instead of CUDA IPC. Each case on a fresh buffer per rank (ended with
/// `Buffer::shutdown`), every rank deriving the group's inputs and reference from the seed.
#[test]
fn gpu_intranode_tcp_threads() {
    use ep::bootstrap::{Communicator, JobToken, RankConfig, TcpCommunicator};
    let ranks = 2;
    let Some(ctxs) = rank_gpus(ranks) else { return };
    let s = seed();
    let cases = [
        Case {
            alignment: 4,
            biases: 2,
            ..Case::new("tcp_bf16_topk")
        },
        Case {
            worst: true,
            fp8: true,
            cached: true,
            max_tokens: 128,
            hidden: 2048,
            ..Case::new("tcp_fp8_worst_cached")
        },
        Case {
            routing: Routing::OnlyRank0,
            max_tokens: 64,
            hidden: 512,
            ..Case::new("tcp_only_rank0")
        },
        Case {
            async_chain: true,
            iterations: 3,
            max_tokens: 256,
            hidden: 4096,
            biases: 1,
            ..Case::new("tcp_async_chain")
        },
    ];
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a local port");
    let port = listener.local_addr().expect("local address").port();
    let token = JobToken::generate().expect("job token");
    // Rank 0 accepts on the listener; rank 1 connects.
    let mut ranks_io: Vec<_> = ctxs.iter().zip([Some(listener), None]).collect();
    let results = on_rank_threads(&mut ranks_io, |r, (ctx, l)| -> Result<(), String> {
        let l = l.take();
        let cases = &cases;
        let cfg = RankConfig::new(r, ranks, port)
            .map_err(|e| e.to_string())?
            .with_token(token)
            .with_timeout(Duration::from_secs(60));
        let comm = match l {
            Some(l) => TcpCommunicator::with_listener(&cfg, l),
            None => TcpCommunicator::connect(&cfg),
        }
        .map_err(|e| format!("rank {r}: rendezvous: {e}"))?;
        if comm.same_process() {
            return Err("a TCP group of 2 claims to be one process".into());
        }
        for c in cases {
            let mut buf = Buffer::new(ctx, &comm, &case_options(c, ranks))
                .map_err(|e| format!("{} rank {r}: create: {e}", c.name))?;
            let debug = format!("{buf:?}");
            if !debug.contains("same_space: false") {
                return Err(format!("rank {r}: expected window-offset combine: {debug}"));
            }
            let mut rngs = rank_rngs(s, ranks);
            let mut res = Ok(());
            for it in 0..c.iterations {
                let round = Round::generate(c, ranks, &mut rngs);
                res = round.check_rank(
                    c,
                    r,
                    &mut buf,
                    ctx,
                    &format!("{} it {it} rank {r}/{ranks} (tcp threads)", c.name),
                );
                if res.is_err() {
                    break;
                }
            }
            let shut = buf.shutdown(&comm).map_err(|e| e.to_string());
            res.and(shut)?;
            eprintln!("{} rank {r}: matches the reference", c.name);
        }
        Ok(())
    });
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
}

/// Two ranks of this process on one GPU: a `Config::num_sms` that would not fit beside the other
/// rank is refused before launch with [`EpError::SmBudget`] naming the numbers (never a timeout),
/// and a case on the same buffers still matches the reference afterwards.
#[test]
fn gpu_intranode_oversubscribed_sm_budget_is_refused_before_launch() {
    let Some(one) = rank_gpus(1) else { return };
    let ctxs = vec![one[0].clone(), one[0].clone()];
    let s = seed();
    let c = Case::new("after_refusal");
    let mut bufs = Buffer::create_group(&ctxs, &case_options(&c, 2)).expect("create buffers");
    let budget = bufs[0].sm_budget();
    assert_eq!(bufs[0].gpu_share().threads, vec![0, 1]);
    let ctx = &ctxs[0];
    let ids = Tensor::from_host(ctx, &[0, 1, 2, 3], &[2, 2]).unwrap();
    let x = Tensor::from_host(ctx, &vec![Bf16(0); 2 * c.hidden], &[2, c.hidden]).unwrap();
    let b0 = &mut bufs[0];
    let layout = b0.get_dispatch_layout(&ids).unwrap();
    let mut args = DispatchArgs::new(DispatchX::Bf16(&x), &layout, 2);
    args.config.num_sms = budget + 1;
    let e = err(b0.dispatch(&args));
    eprintln!("refused: {e}");
    assert!(
        matches!(e, EpError::SmBudget { ranks_on_gpu: 2, fits, .. } if fits == budget),
        "{e}"
    );
    // Nothing was launched: a whole round on the same buffers still matches the reference.
    let mut rngs = rank_rngs(s, 2);
    let round = Round::generate(&c, 2, &mut rngs);
    let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, buf)| {
                let (round, c, ctx) = (&round, &c, ctxs[r].clone());
                sc.spawn(move || round.check_rank(c, r, buf, &ctx, "after a refused config"))
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
}
