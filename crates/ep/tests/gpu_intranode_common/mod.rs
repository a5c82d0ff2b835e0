//! Shared by the intranode GPU tests (ranks as threads in `gpu_intranode.rs`, ranks as
//! processes in `gpu_intranode_procs.rs`): random inputs, the CPU reference for a whole group,
//! one rank's dispatch/combine checks. Every rank's inputs derive from the seed alone, so a rank
//! in its own process computes the group's reference itself.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::reference::{self, CombineInput, RankInput, Received};
use ep::{
    Bf16, Buffer, BufferOptions, CombineArgs, Config, DispatchArgs, DispatchOutput, DispatchX,
    EpError, Fp8E4M3, RecvX, StreamOrder, Tensor, TopK,
};
pub use ep_kernels::testing::check_eq;
use ep_kernels::testing::Rng;

#[path = "../gpu_shared/mod.rs"]
pub mod gpu_shared;
pub use gpu_shared::{random_bf16, random_rank_input, upload};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Random distinct experts, some slots -1, some tokens routed nowhere.
    Random,
    /// Every token only to rank 0's experts: the other ranks receive nothing.
    OnlyRank0,
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub max_tokens: usize,
    /// Tokens per rank: `None` draws 1..=max_tokens (different on each rank).
    pub tokens: Option<usize>,
    pub hidden: usize,
    pub topk: usize,
    pub experts_per_rank: usize,
    pub fp8: bool,
    pub send_topk: bool,
    pub worst: bool,
    pub cached: bool,
    pub async_chain: bool,
    pub alignment: usize,
    pub biases: usize,
    pub routing: Routing,
    pub iterations: usize,
}

impl Case {
    pub fn new(name: &'static str) -> Self {
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

pub fn gen_input(c: &Case, rng: &mut Rng, ranks: usize) -> RankInput {
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
    random_rank_input(rng, tokens, c.hidden, c.topk, c.fp8, ids)
}

pub fn replace_x(c: &Case, inp: &RankInput, rng: &mut Rng) -> RankInput {
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

/// Checks a dispatch output against the reference (first `n` rows; padding rows when worst).
pub fn check_dispatch(
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

pub fn check_combine(
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

/// Every rank's inputs for one round.
pub struct RankPlan {
    pub inputs: Vec<RankInput>,
    pub cached_inputs: Vec<Vec<RankInput>>,
    pub combine_x: Vec<Vec<Bf16>>,
    pub biases: Vec<Vec<Vec<Bf16>>>,
}

#[allow(clippy::too_many_arguments)]
pub fn rank_body(
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
        &layout.tokens_per_rank().to_host().map_err(e)?,
        &want_layout.tokens_per_rank,
    )?;
    check_eq(
        "tokens_per_expert",
        &layout.tokens_per_expert().to_host().map_err(e)?,
        &want_layout.tokens_per_expert,
    )?;
    check_eq(
        "is_token_in_rank",
        &layout.is_token_in_rank().to_host().map_err(e)?,
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

/// The options every case's buffer is built with: outputs poisoned, a 20 s bound.
pub fn case_options(c: &Case, ranks: usize) -> BufferOptions {
    let mut opts = BufferOptions::new(c.max_tokens, c.hidden, c.topk, ranks * c.experts_per_rank);
    opts.poison_outputs = true;
    opts.timeout = Duration::from_secs(20);
    opts
}

/// The launch configuration of every case (not the defaults, so other SM and block counts run).
pub const CONFIG: Config = Config {
    num_sms: 20,
    block_threads: 512,
};

/// [`CONFIG`], with no more SMs per rank than the ranks of this process sharing the buffer's
/// GPU can have together.
pub fn config_for(buf: &Buffer) -> Config {
    Config {
        num_sms: CONFIG.num_sms.min(buf.sm_budget()),
        ..CONFIG
    }
}

/// Each rank's input generator for a run with `seed` (every rank of every process derives the
/// same ones).
pub fn rank_rngs(seed: u64, ranks: usize) -> Vec<Rng> {
    (0..ranks)
        .map(|r| Rng::new(seed ^ (0x1000 + r as u64)))
        .collect()
}

/// One round of a case for a whole group: every rank's inputs, and what each must get back.
pub struct Round {
    pub plan: RankPlan,
    pub expected: Vec<Received>,
    pub expected_cached: Option<Vec<Received>>,
    pub expected_combine: Vec<(Vec<Bf16>, Vec<f32>)>,
}

impl Round {
    /// The next round from the ranks' generators (see [`rank_rngs`]).
    pub fn generate(c: &Case, ranks: usize, rngs: &mut [Rng]) -> Self {
        Self::generate_masked(c, ranks, rngs, None)
    }

    /// [`generate`](Self::generate) for ranks that mask each other (`masked[r][s]`: rank `r`
    /// masks rank `s`): the ranks send their own routing, the reference routes it under the
    /// masks ([`reference::masked_inputs`]).
    pub fn generate_masked(
        c: &Case,
        ranks: usize,
        rngs: &mut [Rng],
        masked: Option<&[Vec<bool>]>,
    ) -> Self {
        let num_experts = ranks * c.experts_per_rank;
        let inputs: Vec<RankInput> = (0..ranks)
            .map(|r| gen_input(c, &mut rngs[r], ranks))
            .collect();
        let under_masks = |inputs: &[RankInput]| match masked {
            Some(m) => reference::masked_inputs(inputs, num_experts, m),
            None => inputs.to_vec(),
        };
        let expected = reference::dispatch(&under_masks(&inputs), num_experts, c.alignment);
        let cached_inputs: Vec<Vec<RankInput>> = if c.cached {
            (0..ranks)
                .map(|r| vec![replace_x(c, &inputs[r], &mut rngs[r])])
                .collect()
        } else {
            vec![Vec::new(); ranks]
        };
        let expected_cached = c.cached.then(|| {
            reference::dispatch(
                &under_masks(
                    &cached_inputs
                        .iter()
                        .map(|v| v[0].clone())
                        .collect::<Vec<_>>(),
                ),
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
        Round {
            plan,
            expected,
            expected_cached,
            expected_combine,
        }
    }

    /// Rank `r`'s part of the round on its buffer: layout, dispatch, (cached dispatch), combine,
    /// each checked against the reference.
    pub fn check_rank(
        &self,
        c: &Case,
        r: usize,
        buf: &mut Buffer,
        ctx: &Arc<CudaContext>,
        what: &str,
    ) -> Result<(), String> {
        rank_body(
            c,
            r,
            buf,
            ctx,
            &self.plan,
            &self.expected[r],
            self.expected_cached.as_ref().map(|e| &e[r]),
            &self.expected_combine[r],
            config_for(buf),
            what,
        )
        .map_err(|e| format!("{what}: {e}"))
    }
}
