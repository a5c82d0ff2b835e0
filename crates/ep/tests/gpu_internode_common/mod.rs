//! Shared by the internode GPU tests (ranks as threads in `gpu_internode.rs`, ranks as
//! processes in `gpu_internode_procs.rs`): cases, options, random inputs with the routing mix,
//! one rank's round (layout, dispatch, cached dispatch, combine) and its checks against the CPU
//! reference (`ep::internode::reference`). Every rank's inputs derive from one generator per
//! rank seeded from one seed, so a rank in its own process draws the whole group's inputs and
//! checks its own results itself.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::internode::reference::{self, InternodeDispatch};
use ep::internode::{
    InternodeBuffer, InternodeCombineArgs, InternodeDispatchArgs, InternodeDispatchOutput,
    InternodeOptions, Topology,
};
use ep::reference::{CombineInput, RankInput, Received};
use ep::transport::NicChoice;
use ep::{Bf16, BufferOptions, DispatchX, EpError, Fp8E4M3, RecvX, StreamOrder, Tensor, TopK};
use ep_kernels::testing::Rng;
pub use ep_kernels::testing::{check_eq, random_f32};

use ibgda_device::protocol::HandlerChoice;

#[path = "../gpu_shared/mod.rs"]
pub mod gpu_shared;
pub use gpu_shared::{random_bf16, random_rank_input, upload};

/// Device memory a rank's round allocated (its inputs, outputs and layouts), kept until every
/// rank of the round has finished ([`release_kept`]).
///
/// Freeing device memory (`cuMemFree`) waits until every kernel of the context has ended and
/// holds a driver lock meanwhile: a rank that finishes first and frees its inputs while another
/// rank's kernel still waits for the emulated NIC would block the NIC thread's next driver call
/// (a copy-engine copy, an agent relaunch) until that kernel times out. Seen on an H200 on
/// 2026-12-02 in `cpu_host_memory` at 2×2 (rank 3's quiet timed out with every CQE written
/// afterwards). The emulator's documented rule ("free memory when no kernel waits for the NIC",
/// `ibgda_emu::agent`) applies to tests as to users; a hardware NIC needs no such care.
static KEPT: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>> =
    std::sync::Mutex::new(Vec::new());

/// Keeps `x` alive until [`release_kept`].
pub fn keep<T: std::any::Any + Send>(x: T) {
    KEPT.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Box::new(x));
}

/// Frees what the rounds kept: call it once every rank's round has returned.
pub fn release_kept() {
    let kept = std::mem::take(&mut *KEPT.lock().unwrap_or_else(|p| p.into_inner()));
    drop(kept);
}

pub const TOPOLOGIES: [(usize, usize); 4] = [(2, 1), (2, 2), (2, 4), (4, 2)];

#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub max_tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts_per_rank: usize,
    pub fp8: bool,
    pub worst: bool,
    pub cached: bool,
    pub biases: usize,
    pub alignment: usize,
    pub handler: HandlerChoice,
    pub iterations: usize,
    /// Every CQE of every NIC delayed by this much (quiet must wait for the NIC all the same).
    pub delay_completions: Option<Duration>,
    /// Three tokens in four go to expert 0 alone (imbalanced routing).
    pub hot_expert: bool,
}

impl Case {
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            max_tokens: 96,
            hidden: 1024,
            topk: 6,
            experts_per_rank: 4,
            fp8: false,
            worst: false,
            cached: false,
            biases: 0,
            alignment: 1,
            handler: HandlerChoice::Gpu,
            iterations: 2,
            delay_completions: None,
            hot_expert: false,
        }
    }
}

pub fn topologies() -> Vec<(usize, usize)> {
    let worlds = ep_kernels::testing::rank_counts(&[2, 4, 8]);
    TOPOLOGIES
        .into_iter()
        .filter(|(n, r)| worlds.contains(&(n * r)))
        .collect()
}

pub fn options(c: &Case, timeout: Duration) -> InternodeOptions {
    let mut b = BufferOptions::new(c.max_tokens, c.hidden, c.topk, 1);
    // Mode cpu builds a copy-engine mirror of every QP's producer slots at creation: at 8 ranks
    // on one GPU (56 QPs) creation ran past 8 s on an H200 (2026-12-02), so it gets more time.
    b.timeout = if c.handler == HandlerChoice::Cpu {
        timeout.max(Duration::from_secs(30))
    } else {
        timeout
    };
    b.poison_outputs = true;
    b.max_live_outputs = 2;
    InternodeOptions {
        buffer: b,
        nic: NicChoice::Emulated,
        nic_handler: c.handler,
    }
}

/// Top-k ids of one token: nowhere, only its own node, every node, or random (distinct ids).
pub fn route(rng: &mut Rng, c: &Case, topo: &Topology, rank: usize) -> Vec<i32> {
    let world = topo.world();
    let experts = world * c.experts_per_rank;
    let per_node = experts / topo.nodes();
    let my_node = rank / topo.ranks_per_node();
    let mut row: Vec<i32> = Vec::new();
    if c.hot_expert && rng.below(4) != 0 {
        row.push(0);
        row.resize(c.topk, -1);
        return row;
    }
    let kind = rng.below(4);
    let push = |row: &mut Vec<i32>, e: i32| {
        if !row.contains(&e) {
            row.push(e);
        }
    };
    match kind {
        0 => {}
        1 => {
            for _ in 0..c.topk {
                let e = (my_node * per_node) as i32 + rng.below(per_node as u64) as i32;
                push(&mut row, e);
            }
        }
        2 => {
            for n in 0..topo.nodes() {
                let e = (n * per_node) as i32 + rng.below(per_node as u64) as i32;
                push(&mut row, e);
            }
        }
        _ => {
            for _ in 0..c.topk {
                if rng.below(6) != 0 {
                    push(&mut row, rng.below(experts as u64) as i32);
                }
            }
        }
    }
    row.truncate(c.topk);
    // Shuffle the -1 slots in among the ids.
    while row.len() < c.topk {
        let at = rng.below(row.len() as u64 + 1) as usize;
        row.insert(at, -1);
    }
    row
}

pub fn gen_input(rng: &mut Rng, c: &Case, topo: &Topology, rank: usize) -> RankInput {
    let tokens = 1 + rng.below(c.max_tokens as u64) as usize;
    let ids: Vec<i32> = (0..tokens)
        .flat_map(|_| route(rng, c, topo, rank))
        .collect();
    random_rank_input(rng, tokens, c.hidden, c.topk, c.fp8, ids)
}

/// Fresh rows with the same routing (cached dispatch).
pub fn fresh_x(rng: &mut Rng, c: &Case, inp: &RankInput) -> RankInput {
    let mut out = inp.clone();
    if c.fp8 {
        out.x = (0..inp.x.len())
            .map(|_| (rng.below(126) + 1) as u8)
            .collect();
        out.scales = random_f32(rng, inp.scales.len());
    } else {
        out.x = bytemuck::cast_slice(&random_bf16(rng, inp.x.len() / 2)).to_vec();
    }
    out
}

/// Everything one round needs, computed on the host for every rank.
pub struct Round {
    topo: Topology,
    inputs: Vec<RankInput>,
    cached: Vec<RankInput>,
    want: InternodeDispatch,
    want_cached: Option<InternodeDispatch>,
    combine_in: Vec<CombineInput>,
    biases: Vec<[Option<Vec<Bf16>>; 2]>,
    want_combine: Vec<(Vec<Bf16>, Vec<f32>)>,
    /// The reference combine of |x|: how large the summed parts are (the tolerance's scale).
    abs_combine: Vec<(Vec<Bf16>, Vec<f32>)>,
}

impl Round {
    pub fn generate(c: &Case, topo: &Topology, rngs: &mut [Rng]) -> Round {
        let inputs: Vec<RankInput> = (0..topo.world())
            .map(|r| gen_input(&mut rngs[r], c, topo, r))
            .collect();
        Self::from_inputs(c, topo, inputs, rngs)
    }

    /// A round over the routing of `first` (its tokens and top-k ids: a captured graph's layout
    /// is computed once) with fresh rows, weights, combine inputs and biases.
    pub fn with_routing_of(c: &Case, topo: &Topology, first: &Round, rngs: &mut [Rng]) -> Round {
        let inputs: Vec<RankInput> = (0..topo.world())
            .map(|r| {
                let mut i = fresh_x(&mut rngs[r], c, &first.inputs[r]);
                i.weights = random_f32(&mut rngs[r], i.tokens * c.topk);
                i
            })
            .collect();
        Self::from_inputs(c, topo, inputs, rngs)
    }

    /// A round with the token counts of `first` (a captured graph's tensor shapes) and fresh
    /// routing, rows, weights, combine inputs and biases.
    pub fn with_tokens_of(c: &Case, topo: &Topology, first: &Round, rngs: &mut [Rng]) -> Round {
        let inputs: Vec<RankInput> = (0..topo.world())
            .map(|r| {
                let tokens = first.inputs[r].tokens;
                let ids: Vec<i32> = (0..tokens)
                    .flat_map(|_| route(&mut rngs[r], c, topo, r))
                    .collect();
                random_rank_input(&mut rngs[r], tokens, c.hidden, c.topk, c.fp8, ids)
            })
            .collect();
        Self::from_inputs(c, topo, inputs, rngs)
    }

    /// Rank `r`'s input.
    pub fn input(&self, r: usize) -> &RankInput {
        &self.inputs[r]
    }

    /// Rank `r`'s cached-dispatch input (with `Case::cached`).
    pub fn cached_input(&self, r: usize) -> &RankInput {
        &self.cached[r]
    }

    /// Rank `r`'s combine input rows (one per received row) and biases.
    pub fn combine_input(&self, r: usize) -> (&CombineInput, &[Option<Vec<Bf16>>; 2]) {
        (&self.combine_in[r], &self.biases[r])
    }

    /// Checks rank `r`'s dispatch (with top-k) and, when given, its cached dispatch.
    pub fn check_dispatches(
        &self,
        c: &Case,
        r: usize,
        out: &InternodeDispatchOutput,
        cached: Option<&InternodeDispatchOutput>,
        worst: Option<usize>,
        what: &str,
    ) -> Result<(), String> {
        let row_bytes = self.inputs[r].row_bytes;
        check_dispatch(
            out,
            &self.want.received[r],
            row_bytes,
            Some(c.topk),
            worst,
            &format!("{what} dispatch"),
        )?;
        if let (Some(o), Some(w)) = (cached, &self.want_cached) {
            check_dispatch(
                o,
                &w.received[r],
                row_bytes,
                None,
                worst,
                &format!("{what} cached dispatch"),
            )?;
        }
        Ok(())
    }

    /// Checks rank `r`'s outputs of a round: dispatch (with top-k), cached dispatch (when
    /// given), combine (rows and summed weights).
    #[allow(clippy::too_many_arguments)]
    pub fn check_rank(
        &self,
        c: &Case,
        r: usize,
        out: &InternodeDispatchOutput,
        cached: Option<&InternodeDispatchOutput>,
        combined: (&[Bf16], &[f32]),
        worst: Option<usize>,
        what: &str,
    ) -> Result<(), String> {
        self.check_dispatches(c, r, out, cached, worst, what)?;
        check_combine(
            (combined.0, Some(combined.1)),
            &self.want_combine[r],
            &self.abs_combine[r].0,
            &format!("{what} combine"),
        )
    }

    fn from_inputs(c: &Case, topo: &Topology, inputs: Vec<RankInput>, rngs: &mut [Rng]) -> Round {
        let world = topo.world();
        let experts = world * c.experts_per_rank;
        let want =
            reference::dispatch(topo, &inputs, experts, c.alignment).expect("reference dispatch");
        let (cached, want_cached) = if c.cached {
            let cached: Vec<RankInput> = (0..world)
                .map(|r| fresh_x(&mut rngs[r], c, &inputs[r]))
                .collect();
            let w = reference::dispatch(topo, &cached, experts, c.alignment)
                .expect("reference dispatch");
            (cached, Some(w))
        } else {
            (Vec::new(), None)
        };
        let combine_in: Vec<CombineInput> = (0..world)
            .map(|d| {
                let rows = want.received[d].sources.len();
                CombineInput {
                    x: random_bf16(&mut rngs[d], rows * c.hidden),
                    weights: want.received[d].weights.clone(),
                }
            })
            .collect();
        let tokens: Vec<usize> = inputs.iter().map(|i| i.tokens).collect();
        let biases: Vec<[Option<Vec<Bf16>>; 2]> = (0..world)
            .map(|r| {
                let mut b = [None, None];
                for slot in b.iter_mut().take(c.biases) {
                    *slot = Some(random_bf16(&mut rngs[r], tokens[r] * c.hidden));
                }
                b
            })
            .collect();
        let want_combine =
            reference::combine(topo, &want, &combine_in, &tokens, c.hidden, c.topk, &biases)
                .expect("reference combine")
                .out;
        let abs_in: Vec<CombineInput> = combine_in
            .iter()
            .map(|i| CombineInput {
                x: i.x
                    .iter()
                    .map(|v| Bf16::from_f32(v.to_f32().abs()))
                    .collect(),
                weights: i.weights.clone(),
            })
            .collect();
        let abs_bias: Vec<[Option<Vec<Bf16>>; 2]> = biases
            .iter()
            .map(|b| {
                b.clone().map(|o| {
                    o.map(|v| v.iter().map(|x| Bf16::from_f32(x.to_f32().abs())).collect())
                })
            })
            .collect();
        let abs_combine =
            reference::combine(topo, &want, &abs_in, &tokens, c.hidden, c.topk, &abs_bias)
                .expect("reference combine")
                .out;
        Round {
            topo: *topo,
            inputs,
            cached,
            want,
            want_cached,
            combine_in,
            biases,
            want_combine,
            abs_combine,
        }
    }
}

/// The rows to dispatch, uploaded.
pub enum Up {
    Bf16(Tensor<Bf16>),
    Fp8(Tensor<Fp8E4M3>, Tensor<f32>),
}

impl Up {
    pub fn new(ctx: &Arc<CudaContext>, c: &Case, inp: &RankInput) -> Result<Self, String> {
        let t = inp.tokens;
        Ok(if c.fp8 {
            Up::Fp8(
                upload(
                    ctx,
                    bytemuck::cast_slice::<u8, Fp8E4M3>(&inp.x),
                    &[t, c.hidden],
                )?,
                upload(ctx, &inp.scales, &[t, c.hidden / 128])?,
            )
        } else {
            Up::Bf16(upload(
                ctx,
                bytemuck::cast_slice::<u8, Bf16>(&inp.x),
                &[t, c.hidden],
            )?)
        })
    }
    pub fn x(&self) -> DispatchX<'_> {
        match self {
            Up::Bf16(t) => DispatchX::Bf16(t),
            Up::Fp8(x, scales) => DispatchX::Fp8 { x, scales },
        }
    }
}

pub fn check_dispatch(
    out: &InternodeDispatchOutput,
    want: &Received,
    row_bytes: usize,
    topk: Option<usize>,
    worst: Option<usize>,
    what: &str,
) -> Result<(), String> {
    let n = want.sources.len();
    // With num_worst_tokens the count stays on the GPU: the output's rows are reported.
    let rows = worst.unwrap_or(n);
    if out.num_recv_tokens != rows {
        return Err(format!(
            "{what}: num_recv_tokens {}, expected {rows} ({n} received)",
            out.num_recv_tokens
        ));
    }
    if n > rows {
        return Err(format!(
            "{what}: {n} rows expected, more than num_worst_tokens {rows}"
        ));
    }
    let e = |e: EpError| format!("{what}: {e}");
    let x: Vec<u8> = match &out.x {
        RecvX::Bf16(t) => {
            if t.dim(0) != rows {
                return Err(format!("{what}: {} output rows, expected {rows}", t.dim(0)));
            }
            bytemuck::cast_slice(&t.to_host().map_err(e)?).to_vec()
        }
        RecvX::Fp8 { x, scales } => {
            let s = scales.to_host().map_err(e)?;
            check_eq(
                &format!("{what} scales"),
                &s[..n * scales.dim(1)],
                &want.scales,
            )?;
            bytemuck::cast_slice(&x.to_host().map_err(e)?).to_vec()
        }
    };
    check_eq(&format!("{what} x"), &x[..n * row_bytes], &want.x)?;
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
        if idx[n * k..].iter().any(|&i| i != -1) || w[n * k..].iter().any(|&v| v != 0.0) {
            return Err(format!("{what}: padding rows carry an expert or a weight"));
        }
        match (&out.num_recv_tokens_per_expert, worst) {
            (Some(c), None) => check_eq(&format!("{what} per-expert counts"), c, &want.per_expert)?,
            (None, Some(_)) => {}
            (c, _) => {
                return Err(format!(
                    "{what}: host per-expert counts {c:?} (expected them without \
                     num_worst_tokens only)"
                ))
            }
        }
        let dev: Vec<usize> = out
            .recv_tokens_per_expert
            .as_ref()
            .ok_or("no device per-expert counts")?
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
    got: (&[Bf16], Option<&[f32]>),
    want: &(Vec<Bf16>, Vec<f32>),
    scale: &[Bf16],
    what: &str,
) -> Result<(), String> {
    check_eq(&format!("{what} length"), &[got.0.len()], &[want.0.len()])?;
    let mut worst = 0f32;
    for (i, ((g, w), s)) in got.0.iter().zip(&want.0).zip(scale).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        let err = (g - w).abs();
        // The node sums are rounded to BF16 (as the reference does); a different summation order
        // inside a node moves a sum by at most a step of the parts' magnitude.
        if err.is_nan() || err > s.to_f32() / 64.0 + 1e-5 {
            return Err(format!(
                "{what}: element {i}: got {g}, expected {w} (parts' magnitude {})",
                s.to_f32()
            ));
        }
        worst = worst.max(err);
    }
    if let Some(gw) = got.1 {
        for (i, (g, w)) in gw.iter().zip(&want.1).enumerate() {
            if (g - w).abs() > 1e-5 * w.abs().max(1.0) {
                return Err(format!("{what}: weight {i}: got {g}, expected {w}"));
            }
        }
    }
    eprintln!("{what}: combine max abs error {worst:e}");
    Ok(())
}

/// One rank's round: every operation first (all ranks make the same calls whatever they get),
/// then the checks.
pub fn rank_round(
    c: &Case,
    r: usize,
    buf: &mut InternodeBuffer,
    ctx: &Arc<CudaContext>,
    round: &Round,
    what: &str,
) -> Result<(), String> {
    let e = |e: EpError| format!("{what}: {e}");
    let inp = &round.inputs[r];
    let t = inp.tokens;
    let ids = upload(ctx, &inp.topk_idx, &[t, c.topk])?;
    let weights = upload(ctx, &inp.weights, &[t, c.topk])?;
    let layout = buf.get_dispatch_layout(&ids).map_err(e)?;
    let experts = round.topo.world() * c.experts_per_rank;
    let want_layout = reference::layout(&inp.topk_idx, c.topk, &round.topo, experts)
        .map_err(|x| x.to_string())?;
    check_eq(
        "tokens_per_rank",
        &layout.tokens_per_rank().to_host().map_err(e)?,
        &want_layout.tokens_per_rank,
    )?;
    check_eq(
        "tokens_per_rdma_rank",
        &layout.tokens_per_rdma_rank().to_host().map_err(e)?,
        &want_layout.tokens_per_rdma_rank,
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

    let up = Up::new(ctx, c, inp)?;
    let worst = c.worst.then(|| round.topo.world() * c.max_tokens);
    let out = buf
        .dispatch(&InternodeDispatchArgs {
            x: up.x(),
            layout: &layout,
            topk: TopK {
                idx: &ids,
                weights: &weights,
            },
            num_worst_tokens: worst,
            expert_alignment: c.alignment,
            order: StreamOrder::default(),
        })
        .map_err(e)?;
    let cached = if c.cached {
        let up2 = Up::new(ctx, c, &round.cached[r])?;
        Some(
            buf.dispatch_cached(up2.x(), &out.handle, &StreamOrder::default())
                .map_err(e)?,
        )
    } else {
        None
    };
    let rows = out.handle.num_rows();
    let mut cx = round.combine_in[r].x.clone();
    let mut cw = round.combine_in[r].weights.clone();
    // Worst-token padding rows: anything (they are not summed).
    cx.resize(rows * c.hidden, Bf16::from_f32(7.0));
    cw.resize(rows * c.topk, 3.0);
    let cx = upload(ctx, &cx, &[rows, c.hidden])?;
    let cw = upload(ctx, &cw, &[rows, c.topk])?;
    let bias: Vec<Tensor<Bf16>> = round.biases[r]
        .iter()
        .flatten()
        .map(|b| upload(ctx, b, &[t, c.hidden]))
        .collect::<Result<_, _>>()?;
    let comb = buf
        .combine(&InternodeCombineArgs {
            x: &cx,
            handle: &out.handle,
            topk_weights: Some(&cw),
            bias: [bias.first(), bias.get(1)],
            order: StreamOrder::default(),
        })
        .map_err(e)?;
    buf.synchronize().map_err(e)?;

    round.check_dispatches(c, r, &out, cached.as_ref(), worst, what)?;
    let gx = comb.x.to_host().map_err(e)?;
    let gw = comb
        .topk_weights
        .as_ref()
        .ok_or("no combined weights")?
        .to_host()
        .map_err(e)?;
    let checked = check_combine(
        (&gx, Some(&gw)),
        &round.want_combine[r],
        &round.abs_combine[r].0,
        &format!("{what} combine"),
    );
    keep((ids, weights, layout, up, out, cached, cx, cw, bias, comb));
    checked
}

/// One generator per rank, all from `seed`: every process of a group draws every rank's inputs
/// (so each can compute the reference) from the seed the launcher passes on.
pub fn rank_rngs(seed: u64, world: usize) -> Vec<Rng> {
    (0..world)
        .map(|r| Rng::new(seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect()
}
