//! Intranode dispatch/combine, ranks as threads of one process, against the CPU reference
//! (`ep::reference`) on fresh random data: layout and dispatch bit-exact, combine within
//! f32-accumulation rounding. Outputs are poisoned (0xAB) before every operation. Each case runs
//! at every rank count in {2, 4, 8} that the machine has GPUs for.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::reference::{self, CombineInput, RankInput, Received};
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, Config, DispatchArgs, DispatchOutput, DispatchX,
    EpError, Fp8E4M3, RecvX, StreamOrder, Tensor, TopK,
};
use ep_kernels::testing::{gpus, seed, Rng};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Routing {
    /// Random distinct experts, some slots -1, some tokens routed nowhere.
    Random,
    /// Every token only to rank 0's experts: the other ranks receive nothing.
    OnlyRank0,
}

#[derive(Debug, Clone)]
struct Case {
    name: &'static str,
    max_tokens: usize,
    /// Tokens per rank: `None` draws 1..=max_tokens (different on each rank).
    tokens: Option<usize>,
    hidden: usize,
    topk: usize,
    experts_per_rank: usize,
    fp8: bool,
    send_topk: bool,
    worst: bool,
    cached: bool,
    async_chain: bool,
    alignment: usize,
    biases: usize,
    routing: Routing,
    iterations: usize,
}

impl Case {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            max_tokens: 512,
            tokens: None,
            hidden: 7168,
            topk: 8,
            experts_per_rank: 32,
            fp8: false,
            send_topk: true,
            worst: false,
            cached: false,
            async_chain: false,
            alignment: 1,
            biases: 0,
            routing: Routing::Random,
            iterations: 1,
        }
    }
}

fn rank_counts() -> Vec<usize> {
    let n = ibgda_device::cuda::device_count().unwrap_or(0);
    [2usize, 4, 8].into_iter().filter(|&r| r <= n).collect()
}

fn random_bf16(rng: &mut Rng, n: usize) -> Vec<Bf16> {
    (0..n)
        .map(|_| Bf16::from_f32((rng.below(1 << 20) as f32 / (1 << 19) as f32) - 1.0))
        .collect()
}

fn random_f32(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.below(1 << 24) as f32 / (1 << 24) as f32 + 0.01)
        .collect()
}

fn gen_input(c: &Case, rng: &mut Rng, ranks: usize) -> RankInput {
    let num_experts = ranks * c.experts_per_rank;
    let tokens = c
        .tokens
        .unwrap_or_else(|| 1 + rng.below(c.max_tokens as u64) as usize);
    let mut ids = Vec::with_capacity(tokens * c.topk);
    for _ in 0..tokens {
        let nowhere = c.routing == Routing::Random && rng.below(16) == 0;
        let mut row: Vec<i32> = Vec::new();
        while row.len() < c.topk {
            let e = match c.routing {
                Routing::Random => rng.below(num_experts as u64) as i32,
                Routing::OnlyRank0 => rng.below(c.experts_per_rank as u64) as i32,
            };
            let dup = row.contains(&e);
            if nowhere || rng.below(8) == 0 {
                row.push(-1);
            } else if !dup || c.experts_per_rank < c.topk {
                row.push(if dup { -1 } else { e });
            }
        }
        ids.extend(row);
    }
    let (row_bytes, x, scale_words, scales) = if c.fp8 {
        let x: Vec<u8> = (0..tokens * c.hidden)
            .map(|_| loop {
                let b = rng.below(256) as u8;
                if b & 0x7f != 0x7f {
                    break b;
                }
            })
            .collect();
        let sw = c.hidden / 128;
        (c.hidden, x, sw, random_f32(rng, tokens * sw))
    } else {
        let x = random_bf16(rng, tokens * c.hidden);
        (
            c.hidden * 2,
            bytemuck::cast_slice(&x).to_vec(),
            0,
            Vec::new(),
        )
    };
    RankInput {
        tokens,
        row_bytes,
        x,
        scale_words,
        scales,
        topk: c.topk,
        topk_idx: ids,
        weights: random_f32(rng, tokens * c.topk),
    }
}

fn replace_x(c: &Case, inp: &RankInput, rng: &mut Rng) -> RankInput {
    let mut fresh = gen_input(
        &Case {
            tokens: Some(inp.tokens),
            ..c.clone()
        },
        rng,
        1,
    );
    fresh.topk_idx = inp.topk_idx.clone();
    fresh.weights = inp.weights.clone();
    fresh
}

fn check_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let wrong = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        return Err(format!(
            "{what}: {wrong} of {} differ, first at {i}: got {:?}, expected {:?}",
            got.len(),
            got[i],
            want[i]
        ));
    }
    Ok(())
}

/// Checks a dispatch output against the reference (first `n` rows; padding rows when worst).
fn check_dispatch(
    out: &DispatchOutput,
    want: &Received,
    inp_row_bytes: usize,
    topk: Option<usize>,
    what: &str,
) -> Result<(), String> {
    let n = want.sources.len();
    if let Some(got) = out.num_recv_tokens {
        if got != n {
            return Err(format!("{what}: received {got} rows, expected {n}"));
        }
    }
    let e = |e: EpError| format!("{what}: {e}");
    let x_bytes: Vec<u8> = match &out.x {
        RecvX::Bf16(t) => bytemuck::cast_slice(&t.to_host().map_err(e)?).to_vec(),
        RecvX::Fp8 { x, scales } => {
            let s = scales.to_host().map_err(e)?;
            let sw = scales.dim(1);
            check_eq(&format!("{what} scales"), &s[..n * sw], &want.scales)?;
            bytemuck::cast_slice(&x.to_host().map_err(e)?).to_vec()
        }
    };
    check_eq(&format!("{what} x"), &x_bytes[..n * inp_row_bytes], &want.x)?;
    if let Some(k) = topk {
        let idx = out
            .topk_idx
            .as_ref()
            .ok_or("no topk_idx")?
            .to_host()
            .map_err(e)?;
        let w = out
            .topk_weights
            .as_ref()
            .ok_or("no topk_weights")?
            .to_host()
            .map_err(e)?;
        check_eq(&format!("{what} topk_idx"), &idx[..n * k], &want.topk_idx)?;
        check_eq(&format!("{what} topk_weights"), &w[..n * k], &want.weights)?;
        // Fixed-size output: the rows past the received ones carry no expert.
        if idx.len() > n * k && idx[n * k..].iter().any(|&i| i != -1) {
            return Err(format!("{what}: padding rows have top-k ids other than -1"));
        }
        if let Some(c) = &out.num_recv_tokens_per_expert {
            check_eq(&format!("{what} per-expert counts"), c, &want.per_expert)?;
        }
        let dev: Vec<usize> = out
            .recv_tokens_per_expert
            .to_host()
            .map_err(e)?
            .into_iter()
            .map(|v| v as usize)
            .collect();
        check_eq(
            &format!("{what} per-expert counts (device)"),
            &dev,
            &want.per_expert,
        )?;
    }
    Ok(())
}

fn check_combine(
    got_x: &[Bf16],
    want_x: &[Bf16],
    got_w: Option<&[f32]>,
    want_w: &[f32],
    what: &str,
) -> Result<(), String> {
    if got_x.len() != want_x.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got_x.len(),
            want_x.len()
        ));
    }
    let mut worst = 0f32;
    for (i, (g, w)) in got_x.iter().zip(want_x).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        let err = (g - w).abs();
        // Both round the same f32 sum; allow one BF16 step for a different summation order.
        if err.is_nan() || err > w.abs() / 128.0 + 1e-6 {
            return Err(format!("{what}: element {i}: got {g}, expected {w}"));
        }
        worst = worst.max(err);
    }
    if let Some(gw) = got_w {
        for (i, (g, w)) in gw.iter().zip(want_w).enumerate() {
            if (g - w).abs() > 1e-6 * w.abs().max(1.0) {
                return Err(format!("{what}: weight {i}: got {g}, expected {w}"));
            }
        }
    }
    eprintln!("{what}: combine max abs error {worst:e}");
    Ok(())
}

fn upload<T: ep::Element>(
    ctx: &Arc<CudaContext>,
    data: &[T],
    shape: &[usize],
) -> Result<Tensor<T>, String> {
    Tensor::from_host(ctx, data, shape).map_err(|e| e.to_string())
}

struct RankPlan {
    inputs: Vec<RankInput>,
    cached_inputs: Vec<Vec<RankInput>>,
    combine_x: Vec<Vec<Bf16>>,
    biases: Vec<Vec<Vec<Bf16>>>,
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
    let num_experts = ranks * c.experts_per_rank;
    let mut opts = BufferOptions::new(c.max_tokens, c.hidden, c.topk, num_experts);
    opts.poison_outputs = true;
    opts.timeout = Duration::from_secs(20);
    let mut bufs = Buffer::create_group(ctxs, &opts).expect("create buffers");
    let config = Config {
        num_sms: 20,
        block_threads: 512,
    };

    let mut rngs: Vec<Rng> = (0..ranks)
        .map(|r| Rng::new(s ^ (0x1000 + r as u64)))
        .collect();
    for it in 0..c.iterations {
        let inputs: Vec<RankInput> = (0..ranks)
            .map(|r| gen_input(c, &mut rngs[r], ranks))
            .collect();
        let expected = reference::dispatch(&inputs, num_experts, c.alignment);
        let cached_inputs: Vec<Vec<RankInput>> = if c.cached {
            (0..ranks)
                .map(|r| vec![replace_x(c, &inputs[r], &mut rngs[r])])
                .collect()
        } else {
            vec![Vec::new(); ranks]
        };
        let expected_cached = c.cached.then(|| {
            reference::dispatch(
                &cached_inputs
                    .iter()
                    .map(|v| v[0].clone())
                    .collect::<Vec<_>>(),
                num_experts,
                1,
            )
        });
        let worst_rows = ranks * c.max_tokens;
        let combine_x: Vec<Vec<Bf16>> = (0..ranks)
            .map(|r| {
                let rows = if c.worst {
                    worst_rows
                } else {
                    expected[r].sources.len()
                };
                random_bf16(&mut rngs[r], rows * c.hidden)
            })
            .collect();
        let biases: Vec<Vec<Vec<Bf16>>> = (0..ranks)
            .map(|r| {
                (0..c.biases)
                    .map(|_| random_bf16(&mut rngs[r], inputs[r].tokens * c.hidden))
                    .collect()
            })
            .collect();
        let plan = RankPlan {
            inputs,
            cached_inputs,
            combine_x,
            biases,
        };

        let combine_in: Vec<CombineInput> = (0..ranks)
            .map(|r| CombineInput {
                x: plan.combine_x[r][..expected[r].sources.len() * c.hidden].to_vec(),
                weights: if c.send_topk && !c.cached {
                    expected[r].weights.clone()
                } else {
                    Vec::new()
                },
            })
            .collect();
        let bias_ref: Vec<[Option<Vec<Bf16>>; 2]> = (0..ranks)
            .map(|r| {
                [
                    plan.biases[r].first().cloned(),
                    plan.biases[r].get(1).cloned(),
                ]
            })
            .collect();
        let tokens: Vec<usize> = plan.inputs.iter().map(|i| i.tokens).collect();
        let want_topk = if c.send_topk && !c.cached { c.topk } else { 0 };
        let expected_combine = reference::combine(
            &expected,
            &combine_in,
            &tokens,
            c.hidden,
            want_topk,
            &bias_ref,
        );

        let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
            let joins: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(r, buf)| {
                    let (plan, expected, expected_cached, expected_combine) =
                        (&plan, &expected, &expected_cached, &expected_combine);
                    let ctx = ctxs[r].clone();
                    sc.spawn(move || -> Result<(), String> {
                        let what = format!("{} it {it} rank {r}/{ranks}", c.name);
                        let want_cached = expected_cached.as_ref().map(|e| &e[r]);
                        rank_body(
                            c,
                            r,
                            buf,
                            &ctx,
                            plan,
                            &expected[r],
                            want_cached,
                            &expected_combine[r],
                            config,
                            &what,
                        )
                        .map_err(|e| format!("{what}: {e}"))
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

#[allow(clippy::too_many_arguments)]
fn rank_body(
    c: &Case,
    r: usize,
    buf: &mut Buffer,
    ctx: &Arc<CudaContext>,
    plan: &RankPlan,
    want: &Received,
    want_cached: Option<&Received>,
    want_combine: &(Vec<Bf16>, Vec<f32>),
    config: Config,
    what: &str,
) -> Result<(), String> {
    let e = |e: EpError| e.to_string();
    let inp = &plan.inputs[r];
    let t = inp.tokens;
    let ids = upload(ctx, &inp.topk_idx, &[t, c.topk])?;
    let weights = upload(ctx, &inp.weights, &[t, c.topk])?;
    let layout = buf.get_dispatch_layout(&ids).map_err(e)?;
    let ranks = buf.ranks();
    let want_layout = reference::layout(&inp.topk_idx, c.topk, ranks, ranks * c.experts_per_rank);
    check_eq(
        "tokens_per_rank",
        &layout.tokens_per_rank.to_host().map_err(e)?,
        &want_layout.tokens_per_rank,
    )?;
    check_eq(
        "tokens_per_expert",
        &layout.tokens_per_expert.to_host().map_err(e)?,
        &want_layout.tokens_per_expert,
    )?;
    check_eq(
        "is_token_in_rank",
        &layout.is_token_in_rank.to_host().map_err(e)?,
        &want_layout.is_token_in_rank,
    )?;

    let (xb, xf, sf);
    let x = if c.fp8 {
        xf = upload(
            ctx,
            bytemuck::cast_slice::<u8, Fp8E4M3>(&inp.x),
            &[t, c.hidden],
        )?;
        sf = upload(ctx, &inp.scales, &[t, inp.scale_words])?;
        DispatchX::Fp8 {
            x: &xf,
            scales: &sf,
        }
    } else {
        xb = upload(
            ctx,
            bytemuck::cast_slice::<u8, Bf16>(&inp.x),
            &[t, c.hidden],
        )?;
        DispatchX::Bf16(&xb)
    };
    let mut args = DispatchArgs::new(x, &layout, ranks);
    args.config = config;
    args.expert_alignment = c.alignment;
    if c.send_topk {
        args.topk = Some(TopK {
            idx: &ids,
            weights: &weights,
        });
    }
    if c.worst {
        args.num_worst_tokens = Some(ranks * c.max_tokens);
    }
    args.order.async_finish = c.async_chain;
    let out = buf.dispatch(&args).map_err(e)?;
    if c.async_chain {
        out.event
            .wait_host(Duration::from_secs(20), "dispatch event")
            .map_err(e)?;
    }
    buf.synchronize().map_err(e)?;
    check_dispatch(
        &out,
        want,
        inp.row_bytes,
        c.send_topk.then_some(c.topk),
        &format!("{what} dispatch"),
    )?;

    let mut handle = out.handle.clone();
    let mut last_event = out.event.clone();
    let mut keep = Some(out);
    if let (true, Some(wc)) = (c.cached, want_cached) {
        let ci = &plan.cached_inputs[r][0];
        let (xb2, xf2, sf2);
        let x2 = if c.fp8 {
            xf2 = upload(
                ctx,
                bytemuck::cast_slice::<u8, Fp8E4M3>(&ci.x),
                &[t, c.hidden],
            )?;
            sf2 = upload(ctx, &ci.scales, &[t, ci.scale_words])?;
            DispatchX::Fp8 {
                x: &xf2,
                scales: &sf2,
            }
        } else {
            xb2 = upload(ctx, bytemuck::cast_slice::<u8, Bf16>(&ci.x), &[t, c.hidden])?;
            DispatchX::Bf16(&xb2)
        };
        // The first output may go; the handle keeps the routing (and its region) alive.
        drop(keep.take());
        let out2 = buf
            .dispatch_cached(x2, &handle, &config, &StreamOrder::default())
            .map_err(e)?;
        buf.synchronize().map_err(e)?;
        check_dispatch(
            &out2,
            wc,
            ci.row_bytes,
            None,
            &format!("{what} cached dispatch"),
        )?;
        handle = out2.handle.clone();
        last_event = out2.event.clone();
        keep = Some(out2);
    }

    let rows = handle.num_rows();
    let y = upload(ctx, &plan.combine_x[r], &[rows, c.hidden])?;
    let recv_w = keep.as_ref().and_then(|o| o.topk_weights.clone());
    let biases: Vec<Tensor<Bf16>> = plan.biases[r]
        .iter()
        .map(|b| upload(ctx, b, &[t, c.hidden]))
        .collect::<Result<_, _>>()?;
    let mut cargs = CombineArgs::new(&y, &handle, ranks);
    cargs.config = config;
    cargs.topk_weights = recv_w.as_ref();
    cargs.bias = [biases.first(), biases.get(1)];
    if c.async_chain {
        cargs.order = StreamOrder {
            previous_event: Some(&last_event),
            async_finish: true,
        };
    }
    let comb = buf.combine(&cargs).map_err(e)?;
    buf.synchronize().map_err(e)?;
    let gx = comb.x.to_host().map_err(e)?;
    let gw = comb
        .topk_weights
        .as_ref()
        .map(|w| w.to_host())
        .transpose()
        .map_err(e)?;
    check_combine(
        &gx,
        &want_combine.0,
        gw.as_deref(),
        &want_combine.1,
        &format!("{what} combine"),
    )?;
    drop(keep);
    Ok(())
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
