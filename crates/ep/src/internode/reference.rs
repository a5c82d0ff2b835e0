//! The CPU definition of internode layout, dispatch and combine, hop by hop: what the GPU path
//! must reproduce (bit for bit for layout and dispatch; combine within the rounding stated on
//! [`combine`]).
//!
//! Dispatch: a token of rank `s` (node `ns`, local index `l`) goes, for every node `n` holding
//! one of its top-k experts, to the rank `(n, l)` — through the NIC when `n ≠ ns`, to `s` itself
//! when `n = ns` — and that rank, the *forwarder*, hands it over NVLink to each rank of node `n`
//! whose experts it needs. So a token crosses to a node at most once. Each rank then holds its
//! rows ordered by source rank, then token: the same rows, in the same order, as the intranode
//! reference ([`crate::reference::dispatch`]) over all ranks gives.
//!
//! Combine runs the hops backwards: each forwarder sums in f32 the rows its node's ranks return
//! for a token, in ascending rank order, and sends the one sum back as BF16 (the format that
//! crosses the NIC); the token's rank adds the nodes' sums in ascending node order in f32, then
//! the biases, and rounds to BF16.

use crate::dtype::Bf16;
use crate::reference::{CombineInput, RankInput, Received};

use super::Topology;

/// Why the reference cannot run on these inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// One entry per rank of the topology is needed.
    #[error("{got} {what} for a topology of {world} ranks")]
    Ranks {
        /// What was counted.
        what: &'static str,
        /// Entries given.
        got: usize,
        /// Ranks in the topology.
        world: usize,
    },
    /// The experts do not split evenly over the ranks.
    #[error("num_experts {num_experts} is not a positive multiple of the {world} ranks")]
    Experts {
        /// Experts asked for.
        num_experts: usize,
        /// Ranks.
        world: usize,
    },
    /// A rank's arrays do not have the lengths its counts say.
    #[error("rank {rank}: {what} has {got} elements, {want} expected")]
    Shape {
        /// The rank whose input is wrong.
        rank: usize,
        /// Which array.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length its counts call for.
        want: usize,
    },
    /// An expert id outside `-1..num_experts`.
    #[error("rank {rank}, token {token}: expert id {id} is outside -1..{num_experts}")]
    ExpertId {
        /// The rank.
        rank: usize,
        /// The token.
        token: usize,
        /// The id.
        id: i32,
        /// Experts.
        num_experts: usize,
    },
}

/// The internode outputs of `get_dispatch_layout` for one rank: the intranode ones plus tokens
/// per node (DeepEP's `num_tokens_per_rdma_rank`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InternodeLayout {
    /// `[ranks]`: tokens that go to each rank.
    pub tokens_per_rank: Vec<i32>,
    /// `[nodes]`: tokens that go to at least one rank of each node.
    pub tokens_per_rdma_rank: Vec<i32>,
    /// `[experts]`: tokens per expert (an id repeated in one token counts once).
    pub tokens_per_expert: Vec<i32>,
    /// `[tokens][ranks]`, 0/1.
    pub is_token_in_rank: Vec<u8>,
}

/// The internode layout of top-k ids `[tokens][topk]` (ids in `-1..num_experts`).
///
/// ```
/// use ep::internode::{reference::layout, Topology};
/// // 2 nodes × 2 ranks, 8 experts (2 per rank), top-2.
/// let topo = Topology::new(2, 2).unwrap();
/// let l = layout(&[0, 1, 2, 7, -1, -1], 2, &topo, 8).unwrap();
/// assert_eq!(l.tokens_per_rank, vec![1, 1, 0, 1]);
/// assert_eq!(l.tokens_per_rdma_rank, vec![2, 1]);
/// assert_eq!(l.is_token_in_rank, vec![1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0]);
/// ```
pub fn layout(
    topk_idx: &[i32],
    topk: usize,
    topo: &Topology,
    num_experts: usize,
) -> Result<InternodeLayout, ReferenceError> {
    let world = topo.world();
    check_experts(num_experts, world)?;
    let tokens = topk_idx.len().checked_div(topk).unwrap_or(0);
    check_len(0, "topk_idx", topk_idx.len(), tokens * topk)?;
    check_ids(0, topk_idx, topk, num_experts)?;
    let flat = crate::reference::layout(topk_idx, topk, world, num_experts);
    let rpn = topo.ranks_per_node();
    let mut tokens_per_rdma_rank = vec![0; topo.nodes()];
    for row in flat.is_token_in_rank.chunks_exact(world.max(1)) {
        for (n, count) in tokens_per_rdma_rank.iter_mut().enumerate() {
            if row[n * rpn..(n + 1) * rpn].iter().any(|&b| b != 0) {
                *count += 1;
            }
        }
    }
    Ok(InternodeLayout {
        tokens_per_rank: flat.tokens_per_rank,
        tokens_per_rdma_rank,
        tokens_per_expert: flat.tokens_per_expert,
        is_token_in_rank: flat.is_token_in_rank,
    })
}

/// Where one token went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenRoute {
    /// Nodes it was sent to, ascending (its own node among them when a rank there needs it).
    pub nodes: Vec<usize>,
    /// Ranks that received it, ascending.
    pub ranks: Vec<usize>,
}

/// One copy of a token through the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaCopy {
    /// The token's rank.
    pub src: usize,
    /// Its index there.
    pub token: usize,
    /// The node on the far side.
    pub node: usize,
    /// The rank on that node that sends or receives it: the one with `src`'s local index.
    pub forwarder: usize,
}

/// Internode dispatch, with what each hop carried.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InternodeDispatch {
    /// What each rank receives, as [`crate::reference::dispatch`] defines it.
    pub received: Vec<Received>,
    /// `[rank][token]`: where each token went.
    pub routes: Vec<Vec<TokenRoute>>,
    /// Copies that crossed the NIC, ordered by (source rank, token, node).
    pub rdma_copies: Vec<RdmaCopy>,
    /// `[rank][node]`: tokens of `rank` sent to each node, its own included (equals the
    /// layout's `tokens_per_rdma_rank`).
    pub tokens_to_node: Vec<Vec<usize>>,
    /// `[forwarder rank][local rank]`: tokens each rank forwarded over NVLink to each rank of
    /// its node (itself included).
    pub nvl_forwarded: Vec<Vec<usize>>,
}

/// A token in flight: where it came from and what it carries.
#[derive(Debug, Clone)]
struct Parcel<'a> {
    src: usize,
    token: usize,
    x: &'a [u8],
    scales: &'a [f32],
    /// Global expert ids.
    ids: &'a [i32],
    weights: &'a [f32],
}

/// Internode dispatch over every rank's inputs (`inputs[r]` is rank `r`'s), hop by hop.
///
/// ```
/// use ep::internode::{reference, Topology};
/// use ep::reference::RankInput;
///
/// // 2 nodes × 1 rank, 2 experts; rank 0's one token goes to both experts.
/// let topo = Topology::new(2, 1).unwrap();
/// let one = |x: u8, ids: Vec<i32>| RankInput {
///     tokens: 1, row_bytes: 1, x: vec![x], topk: 2, topk_idx: ids,
///     weights: vec![0.5, 0.5], ..Default::default()
/// };
/// let d = reference::dispatch(&topo, &[one(7, vec![0, 1]), one(9, vec![1, -1])], 2, 1).unwrap();
/// assert_eq!(d.received[1].sources, vec![(0, 0), (1, 0)]);
/// assert_eq!(d.received[1].x, vec![7, 9]);
/// assert_eq!(d.routes[0][0].ranks, vec![0, 1]);
/// assert_eq!(d.rdma_copies.len(), 1); // rank 0's token to node 1; rank 1's stays home
/// ```
pub fn dispatch(
    topo: &Topology,
    inputs: &[RankInput],
    num_experts: usize,
    alignment: usize,
) -> Result<InternodeDispatch, ReferenceError> {
    let world = topo.world();
    let rpn = topo.ranks_per_node();
    check_inputs(topo, inputs, num_experts)?;
    let per_rank = num_experts / world;
    let rank_of_expert = |e: i32| (e >= 0).then(|| e as usize / per_rank);

    let mut out = InternodeDispatch {
        routes: inputs
            .iter()
            .map(|i| vec![TokenRoute::default(); i.tokens])
            .collect(),
        tokens_to_node: vec![vec![0; topo.nodes()]; world],
        nvl_forwarded: vec![vec![0; rpn]; world],
        ..Default::default()
    };

    // Hop 1: each token to its counterpart on every node that needs it.
    let mut rdma_inbox: Vec<Vec<Parcel>> = vec![Vec::new(); world];
    for (s, inp) in inputs.iter().enumerate() {
        let (src_node, local) = (s / rpn, s % rpn);
        for t in 0..inp.tokens {
            let ids = &inp.topk_idx[t * inp.topk..(t + 1) * inp.topk];
            let mut nodes: Vec<usize> = ids.iter().filter_map(|&e| rank_of_expert(e)).collect();
            nodes.iter_mut().for_each(|r| *r /= rpn);
            nodes.sort_unstable();
            nodes.dedup();
            for &n in &nodes {
                let forwarder = n * rpn + local;
                out.tokens_to_node[s][n] += 1;
                if n != src_node {
                    out.rdma_copies.push(RdmaCopy {
                        src: s,
                        token: t,
                        node: n,
                        forwarder,
                    });
                }
                rdma_inbox[forwarder].push(Parcel {
                    src: s,
                    token: t,
                    x: &inp.x[t * inp.row_bytes..(t + 1) * inp.row_bytes],
                    scales: &inp.scales[t * inp.scale_words..(t + 1) * inp.scale_words],
                    ids,
                    weights: &inp.weights[t * inp.topk..(t + 1) * inp.topk],
                });
            }
            out.routes[s][t].nodes = nodes;
        }
    }

    // Hop 2: each forwarder hands what it got to the ranks of its node that need it, reading
    // only the token's own expert ids.
    let mut nvl_inbox: Vec<Vec<Parcel>> = vec![Vec::new(); world];
    for (f, inbox) in rdma_inbox.into_iter().enumerate() {
        let node = f / rpn;
        for p in inbox {
            for j in 0..rpn {
                let d = node * rpn + j;
                if p.ids.iter().any(|&e| rank_of_expert(e) == Some(d)) {
                    out.nvl_forwarded[f][j] += 1;
                    out.routes[p.src][p.token].ranks.push(d);
                    nvl_inbox[d].push(p.clone());
                }
            }
        }
    }
    for route in out.routes.iter_mut().flatten() {
        route.ranks.sort_unstable();
    }

    // Arrival: rows by source rank, then token; expert ids made local.
    out.received = nvl_inbox
        .into_iter()
        .enumerate()
        .map(|(d, mut inbox)| {
            inbox.sort_by_key(|p| (p.src, p.token));
            receive(d, per_rank, &inbox, alignment)
        })
        .collect();
    Ok(out)
}

fn receive(rank: usize, per_rank: usize, inbox: &[Parcel], alignment: usize) -> Received {
    let lo = (rank * per_rank) as i32;
    let hi = lo + per_rank as i32;
    let mut recv = Received::default();
    let mut counts = vec![0usize; per_rank];
    for p in inbox {
        recv.sources.push((p.src, p.token));
        recv.x.extend_from_slice(p.x);
        recv.scales.extend_from_slice(p.scales);
        for (k, &e) in p.ids.iter().enumerate() {
            let mine = e >= lo && e < hi;
            recv.topk_idx.push(if mine { e - lo } else { -1 });
            recv.weights.push(if mine { p.weights[k] } else { 0.0 });
            if mine && !p.ids[..k].contains(&e) {
                counts[(e - lo) as usize] += 1;
            }
        }
    }
    let a = alignment.max(1);
    recv.per_expert = counts.iter().map(|c| c.div_ceil(a) * a).collect();
    recv
}

/// Internode combine, with the copies that crossed the NIC back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InternodeCombine {
    /// `[rank]`: the combined rows `[tokens][hidden]` and summed weights `[tokens][topk]`.
    pub out: Vec<(Vec<Bf16>, Vec<f32>)>,
    /// Node sums that crossed the NIC back, ordered by (source rank, token, node); `forwarder` is
    /// the rank that sent it.
    pub rdma_copies: Vec<RdmaCopy>,
}

/// Internode combine of `inputs[d]` (rank `d`'s expert outputs, one row per row it received in
/// `dispatched`). `tokens[r]` are rank `r`'s token counts, `bias[r]` its biases `[tokens][hidden]`.
///
/// For each token: every node `n` it went to sums its ranks' rows in f32 (ascending rank) at the
/// forwarder and rounds the sum to BF16, the format it crosses the NIC in; weights stay f32.
/// The token's rank adds the node sums in ascending node order in f32, then `bias[r][0]`, then
/// `bias[r][1]`, and rounds to BF16. With one node and no biases this is bit for bit
/// [`crate::reference::combine`]; otherwise it differs from it by the BF16 rounding of the node
/// sums.
pub fn combine(
    topo: &Topology,
    dispatched: &InternodeDispatch,
    inputs: &[CombineInput],
    tokens: &[usize],
    hidden: usize,
    topk: usize,
    bias: &[[Option<Vec<Bf16>>; 2]],
) -> Result<InternodeCombine, ReferenceError> {
    let world = topo.world();
    let rpn = topo.ranks_per_node();
    for (what, got) in [
        ("combine inputs", inputs.len()),
        ("received", dispatched.received.len()),
        ("token counts", tokens.len()),
        ("route lists", dispatched.routes.len()),
    ] {
        if got != world {
            return Err(ReferenceError::Ranks { what, got, world });
        }
    }
    for (s, routes) in dispatched.routes.iter().enumerate() {
        check_len(s, "routes", routes.len(), tokens[s])?;
        if let Some(&d) = routes.iter().flat_map(|r| &r.ranks).find(|&&d| d >= world) {
            return Err(ReferenceError::Shape {
                rank: s,
                what: "a route's destination rank",
                got: d,
                want: world,
            });
        }
    }
    for (d, (inp, recv)) in inputs.iter().zip(&dispatched.received).enumerate() {
        let rows = recv.sources.len();
        check_len(d, "combine x", inp.x.len(), rows * hidden)?;
        if !inp.weights.is_empty() {
            check_len(d, "combine weights", inp.weights.len(), rows * topk)?;
        }
        if let Some(&(s, t)) = recv
            .sources
            .iter()
            .find(|&&(s, t)| tokens.get(s) <= Some(&t))
        {
            return Err(ReferenceError::Shape {
                rank: d,
                what: "a received row's source token",
                got: t,
                want: tokens.get(s).copied().unwrap_or(0),
            });
        }
    }
    for (r, b) in bias.iter().enumerate().take(world) {
        for x in b.iter().flatten() {
            check_len(r, "bias", x.len(), tokens[r] * hidden)?;
        }
    }

    // Hop 1 (backwards): each node's rows for a token, summed at the forwarder.
    // node_sums[s][t] = [(node, forwarder, sum as it crosses, weights)], ascending node.
    type NodeSum = (usize, usize, Vec<Bf16>, Vec<f32>);
    let mut node_sums: Vec<Vec<Vec<NodeSum>>> =
        tokens.iter().map(|&t| vec![Vec::new(); t]).collect();
    for (s, routes) in dispatched.routes.iter().enumerate() {
        let local = s % rpn;
        for (t, route) in routes.iter().enumerate() {
            for &n in &route.nodes {
                let mut x = vec![0f32; hidden];
                let mut w = vec![0f32; topk];
                for &d in route.ranks.iter().filter(|&&d| d / rpn == n) {
                    let Ok(row) = dispatched.received[d].sources.binary_search(&(s, t)) else {
                        continue;
                    };
                    for (a, v) in x.iter_mut().zip(&inputs[d].x[row * hidden..]) {
                        *a += v.to_f32();
                    }
                    if topk > 0 && !inputs[d].weights.is_empty() {
                        for (a, v) in w.iter_mut().zip(&inputs[d].weights[row * topk..]) {
                            *a += v;
                        }
                    }
                }
                let wire = x.into_iter().map(Bf16::from_f32).collect();
                node_sums[s][t].push((n, n * rpn + local, wire, w));
            }
        }
    }

    // Hop 2: at the token's rank, across nodes, then biases.
    let mut out = InternodeCombine::default();
    for (s, sums) in node_sums.into_iter().enumerate() {
        let mut x = vec![0f32; tokens[s] * hidden];
        let mut w = vec![0f32; tokens[s] * topk];
        for (t, per_node) in sums.into_iter().enumerate() {
            for (n, forwarder, part, pw) in per_node {
                if n != s / rpn {
                    out.rdma_copies.push(RdmaCopy {
                        src: s,
                        token: t,
                        node: n,
                        forwarder,
                    });
                }
                for (a, v) in x[t * hidden..(t + 1) * hidden].iter_mut().zip(&part) {
                    *a += v.to_f32();
                }
                for (a, v) in w[t * topk..(t + 1) * topk].iter_mut().zip(&pw) {
                    *a += v;
                }
            }
        }
        for b in bias.get(s).into_iter().flatten().flatten() {
            for (a, v) in x.iter_mut().zip(b) {
                *a += v.to_f32();
            }
        }
        out.out
            .push((x.into_iter().map(Bf16::from_f32).collect(), w));
    }
    Ok(out)
}

fn check_experts(num_experts: usize, world: usize) -> Result<(), ReferenceError> {
    if num_experts == 0 || num_experts % world != 0 {
        return Err(ReferenceError::Experts { num_experts, world });
    }
    Ok(())
}

fn check_len(
    rank: usize,
    what: &'static str,
    got: usize,
    want: usize,
) -> Result<(), ReferenceError> {
    if got != want {
        return Err(ReferenceError::Shape {
            rank,
            what,
            got,
            want,
        });
    }
    Ok(())
}

fn check_ids(
    rank: usize,
    ids: &[i32],
    topk: usize,
    num_experts: usize,
) -> Result<(), ReferenceError> {
    match ids
        .iter()
        .position(|&e| e < -1 || e >= 0 && e as usize >= num_experts)
    {
        Some(i) => Err(ReferenceError::ExpertId {
            rank,
            token: i / topk.max(1),
            id: ids[i],
            num_experts,
        }),
        None => Ok(()),
    }
}

fn check_inputs(
    topo: &Topology,
    inputs: &[RankInput],
    num_experts: usize,
) -> Result<(), ReferenceError> {
    let world = topo.world();
    if inputs.len() != world {
        return Err(ReferenceError::Ranks {
            what: "rank inputs",
            got: inputs.len(),
            world,
        });
    }
    check_experts(num_experts, world)?;
    for (r, i) in inputs.iter().enumerate() {
        let len = |what, n: usize, m: usize| -> Result<usize, ReferenceError> {
            n.checked_mul(m).ok_or(ReferenceError::Shape {
                rank: r,
                what,
                got: usize::MAX,
                want: n,
            })
        };
        check_len(r, "x", i.x.len(), len("x", i.tokens, i.row_bytes)?)?;
        check_len(
            r,
            "scales",
            i.scales.len(),
            len("scales", i.tokens, i.scale_words)?,
        )?;
        check_len(
            r,
            "topk_idx",
            i.topk_idx.len(),
            len("topk_idx", i.tokens, i.topk)?,
        )?;
        check_len(
            r,
            "weights",
            i.weights.len(),
            len("weights", i.tokens, i.topk)?,
        )?;
        check_ids(r, &i.topk_idx, i.topk, num_experts)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// splitmix64: routing drawn from one seed, so a failing case is one number to replay.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }

        fn value(&mut self) -> f32 {
            (self.below(1 << 12) as f32 - 2048.0) / 512.0
        }
    }

    /// How tokens pick their experts.
    #[derive(Debug, Clone, Copy)]
    enum Routing {
        /// Any expert, with `-1` and repeated ids now and then.
        Uniform,
        /// Each token either stays on its own node, reaches every node, or picks at random.
        HomeOrEverywhere,
        /// Most picks are expert 0.
        Imbalanced,
    }

    struct Case {
        topo: Topology,
        inputs: Vec<RankInput>,
        num_experts: usize,
        hidden: usize,
    }

    fn case(
        topo: Topology,
        routing: Routing,
        seed: u64,
        tokens: usize,
        topk: usize,
        per_rank: usize,
    ) -> Case {
        let mut rng = Rng(seed);
        let world = topo.world();
        let rpn = topo.ranks_per_node();
        let num_experts = world * per_rank;
        let hidden = 3;
        let topk = match routing {
            Routing::HomeOrEverywhere => topk.max(topo.nodes()),
            _ => topk,
        }
        .min(num_experts);
        let inputs = (0..world)
            .map(|s| {
                let n_tok = (tokens + s) % (tokens + 1);
                let mut ids = Vec::with_capacity(n_tok * topk);
                for _ in 0..n_tok {
                    let kind = rng.below(3);
                    for k in 0..topk {
                        let id = match routing {
                            Routing::Uniform if rng.below(8) == 0 => -1,
                            Routing::Uniform => rng.below(num_experts) as i32,
                            Routing::HomeOrEverywhere if kind == 0 => {
                                let node = s / rpn;
                                (node * rpn * per_rank + rng.below(rpn * per_rank)) as i32
                            }
                            Routing::HomeOrEverywhere if kind == 1 && k < topo.nodes() => {
                                (k * rpn * per_rank + rng.below(rpn * per_rank)) as i32
                            }
                            Routing::HomeOrEverywhere => rng.below(num_experts) as i32,
                            Routing::Imbalanced if rng.below(5) != 0 => 0,
                            Routing::Imbalanced => rng.below(num_experts) as i32,
                        };
                        ids.push(id);
                    }
                }
                let values: Vec<Bf16> = (0..n_tok * hidden)
                    .map(|_| Bf16::from_f32(rng.value()))
                    .collect();
                RankInput {
                    tokens: n_tok,
                    row_bytes: hidden * 2,
                    x: bytemuck::cast_slice(&values).to_vec(),
                    scale_words: 1,
                    scales: (0..n_tok).map(|t| (s * 1000 + t) as f32).collect(),
                    topk,
                    weights: (0..n_tok * topk).map(|i| 1.0 / (1 + i) as f32).collect(),
                    topk_idx: ids,
                }
            })
            .collect();
        Case {
            topo,
            inputs,
            num_experts,
            hidden,
        }
    }

    /// Each rank returns its rows scaled by its own factor, and the weights it received.
    fn expert_outputs(c: &Case, d: &InternodeDispatch) -> Vec<CombineInput> {
        d.received
            .iter()
            .enumerate()
            .map(|(r, recv)| {
                let rows = bf16s(&recv.x);
                CombineInput {
                    x: rows
                        .iter()
                        .map(|v| Bf16::from_f32(v.to_f32() * factor(r)))
                        .collect(),
                    weights: recv.weights.clone(),
                }
            })
            .collect::<Vec<_>>()
            .into_iter()
            .inspect(|i| assert_eq!(i.x.len() % c.hidden.max(1), 0))
            .collect()
    }

    /// BF16 values of a byte row (a `Vec<u8>` need not be 2-aligned).
    fn bf16s(bytes: &[u8]) -> Vec<Bf16> {
        bytes
            .chunks_exact(2)
            .map(bytemuck::pod_read_unaligned)
            .collect()
    }

    fn factor(rank: usize) -> f32 {
        1.0 + rank as f32 / 8.0
    }

    fn biases(c: &Case, on: bool) -> Vec<[Option<Vec<Bf16>>; 2]> {
        c.inputs
            .iter()
            .enumerate()
            .map(|(r, i)| {
                let b = |k: f32| {
                    on.then(|| {
                        (0..i.tokens * c.hidden)
                            .map(|j| Bf16::from_f32((j as f32 - k) / 4.0 + r as f32))
                            .collect()
                    })
                };
                [b(1.0), b(3.0)]
            })
            .collect()
    }

    /// Every property the brief of the internode path names, on one case.
    fn check(c: &Case, alignment: usize, with_bias: bool) {
        let topo = &c.topo;
        let rpn = topo.ranks_per_node();
        let world = topo.world();
        let per_rank = c.num_experts / world;
        let d = dispatch(topo, &c.inputs, c.num_experts, alignment).unwrap();

        // The same rows, in the same order, as the one-hop definition.
        let flat = crate::reference::dispatch(&c.inputs, c.num_experts, alignment);
        assert_eq!(d.received, flat);

        let mut rows_into = vec![0usize; world];
        for (s, inp) in c.inputs.iter().enumerate() {
            let l = layout(&inp.topk_idx, inp.topk, topo, c.num_experts).unwrap();
            assert_eq!(
                d.tokens_to_node[s],
                l.tokens_per_rdma_rank
                    .iter()
                    .map(|&v| v as usize)
                    .collect::<Vec<_>>()
            );
            for t in 0..inp.tokens {
                let ids = &inp.topk_idx[t * inp.topk..(t + 1) * inp.topk];
                // Exactly the ranks of its experts.
                let mut want: Vec<usize> = ids
                    .iter()
                    .filter(|&&e| e >= 0)
                    .map(|&e| e as usize / per_rank)
                    .collect();
                want.sort_unstable();
                want.dedup();
                let route = &d.routes[s][t];
                assert_eq!(route.ranks, want, "rank {s} token {t} ids {ids:?}");
                for r in 0..world {
                    assert_eq!(l.is_token_in_rank[t * world + r] == 1, want.contains(&r));
                }
                let mut nodes: Vec<usize> = want.iter().map(|r| r / rpn).collect();
                nodes.dedup();
                assert_eq!(route.nodes, nodes);
                // At most one copy through the NIC per (token, node), to the counterpart.
                let copies: Vec<&RdmaCopy> = d
                    .rdma_copies
                    .iter()
                    .filter(|x| (x.src, x.token) == (s, t))
                    .collect();
                let away: Vec<usize> = nodes.iter().copied().filter(|&n| n != s / rpn).collect();
                assert_eq!(copies.iter().map(|x| x.node).collect::<Vec<_>>(), away);
                for x in copies {
                    assert_eq!(topo.locate(x.forwarder).unwrap(), (x.node, s % rpn));
                }
                for &r in &want {
                    rows_into[r] += 1;
                }
            }
        }
        // NVLink forwards: each row arrived exactly once, from its node's forwarders.
        for (n, into) in rows_into.chunks(rpn).enumerate() {
            for (j, &rows) in into.iter().enumerate() {
                let forwarded: usize = (0..rpn).map(|f| d.nvl_forwarded[n * rpn + f][j]).sum();
                assert_eq!(forwarded, rows);
                assert_eq!(d.received[n * rpn + j].sources.len(), rows);
            }
        }

        let outputs = expert_outputs(c, &d);
        let tokens: Vec<usize> = c.inputs.iter().map(|i| i.tokens).collect();
        let bias = biases(c, with_bias);
        let comb = combine(
            topo,
            &d,
            &outputs,
            &tokens,
            c.hidden,
            c.inputs.first().map_or(0, |i| i.topk),
            &bias,
        )
        .unwrap();
        // The copies back mirror the copies out.
        assert_eq!(comb.rdma_copies, d.rdma_copies);
        for (s, inp) in c.inputs.iter().enumerate() {
            let (x, w) = &comb.out[s];
            let values = bf16s(&inp.x);
            for t in 0..inp.tokens {
                let ranks = &d.routes[s][t].ranks;
                for h in 0..c.hidden {
                    let i = t * c.hidden + h;
                    let terms: Vec<f64> = ranks
                        .iter()
                        .map(|&r| Bf16::from_f32(values[i].to_f32() * factor(r)).to_f32() as f64)
                        .collect();
                    let b: f64 = bias[s].iter().flatten().map(|b| b[i].to_f32() as f64).sum();
                    let want: f64 = terms.iter().sum::<f64>() + b;
                    let scale: f64 = terms.iter().map(|v| v.abs()).sum::<f64>()
                        + bias[s]
                            .iter()
                            .flatten()
                            .map(|b| b[i].to_f32().abs() as f64)
                            .sum::<f64>();
                    let got = x[i].to_f32() as f64;
                    assert!(
                        (got - want).abs() <= scale / 128.0 + 1e-30,
                        "rank {s} token {t} h {h}: got {got}, want {want} (terms {terms:?}, bias {b})"
                    );
                }
                for k in 0..inp.topk {
                    let e = inp.topk_idx[t * inp.topk + k];
                    let want = if e >= 0 {
                        inp.weights[t * inp.topk + k]
                    } else {
                        0.0
                    };
                    assert_eq!(w[t * inp.topk + k], want, "rank {s} token {t} k {k}");
                }
            }
        }
        // One node: bit for bit the intranode combine when there are no biases.
        if topo.nodes() == 1 && !with_bias {
            let topk = c.inputs.first().map_or(0, |i| i.topk);
            let intra =
                crate::reference::combine(&d.received, &outputs, &tokens, c.hidden, topk, &bias);
            assert_eq!(comb.out, intra);
        }
    }

    const TOPOLOGIES: [(usize, usize); 4] = [(2, 1), (2, 2), (2, 4), (4, 2)];
    const ROUTINGS: [Routing; 3] = [
        Routing::Uniform,
        Routing::HomeOrEverywhere,
        Routing::Imbalanced,
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn random_routing_on_the_issue_topologies(
            topo in 0usize..TOPOLOGIES.len(),
            routing in 0usize..ROUTINGS.len(),
            seed in any::<u64>(),
            tokens in 0usize..24,
            topk in 1usize..9,
            per_rank in 1usize..4,
            alignment in 1usize..5,
            with_bias in any::<bool>(),
            virtual_nodes in any::<bool>(),
        ) {
            let (n, r) = TOPOLOGIES[topo];
            let topo = if virtual_nodes {
                Topology::virtual_nodes(n, r)
            } else {
                Topology::new(n, r)
            }
            .unwrap();
            let c = case(topo, ROUTINGS[routing], seed, tokens, topk, per_rank);
            check(&c, alignment, with_bias);
        }

        #[test]
        fn one_node_is_the_intranode_reference(
            ranks in 1usize..=8,
            routing in 0usize..ROUTINGS.len(),
            seed in any::<u64>(),
            tokens in 0usize..16,
            topk in 1usize..9,
            with_bias in any::<bool>(),
        ) {
            let c = case(Topology::new(1, ranks).unwrap(), ROUTINGS[routing], seed, tokens, topk, 2);
            check(&c, 1, with_bias);
            let d = dispatch(&c.topo, &c.inputs, c.num_experts, 1).unwrap();
            prop_assert!(d.rdma_copies.is_empty());
        }
    }

    #[test]
    fn every_routing_kind_is_exercised_on_every_topology() {
        for &(n, r) in &TOPOLOGIES {
            for routing in ROUTINGS {
                for seed in 0..4 {
                    let c = case(Topology::new(n, r).unwrap(), routing, seed, 20, 4, 2);
                    check(&c, 2, seed % 2 == 0);
                }
            }
        }
        // HomeOrEverywhere really makes both kinds of token.
        let c = case(
            Topology::new(4, 2).unwrap(),
            Routing::HomeOrEverywhere,
            7,
            24,
            4,
            2,
        );
        let d = dispatch(&c.topo, &c.inputs, c.num_experts, 1).unwrap();
        let spans: Vec<usize> = d.routes.iter().flatten().map(|r| r.nodes.len()).collect();
        assert!(spans.contains(&4), "{spans:?}");
        let home_only = d
            .routes
            .iter()
            .enumerate()
            .any(|(s, rs)| rs.iter().any(|r| r.nodes == [s / 2]));
        assert!(home_only);
    }

    #[test]
    fn by_hand_two_nodes_of_two() {
        // 8 experts, 2 per rank. Rank 1 (node 0, local 1) has one token for experts 1 (rank 0),
        // 5 (rank 2) and 7 (rank 3): one copy to node 1, through rank 3, which forwards it to
        // ranks 2 and 3; on node 0 it forwards to rank 0 itself.
        let topo = Topology::new(2, 2).unwrap();
        let empty = RankInput {
            topk: 3,
            row_bytes: 2,
            ..Default::default()
        };
        let token = RankInput {
            tokens: 1,
            row_bytes: 2,
            x: bytemuck::cast_slice(&[Bf16::from_f32(2.0)]).to_vec(),
            topk: 3,
            topk_idx: vec![1, 5, 7],
            weights: vec![0.5, 0.25, 0.125],
            ..Default::default()
        };
        let inputs = vec![empty.clone(), token, empty.clone(), empty];
        let d = dispatch(&topo, &inputs, 8, 1).unwrap();
        assert_eq!(
            d.routes[1][0],
            TokenRoute {
                nodes: vec![0, 1],
                ranks: vec![0, 2, 3]
            }
        );
        assert_eq!(
            d.rdma_copies,
            vec![RdmaCopy {
                src: 1,
                token: 0,
                node: 1,
                forwarder: 3
            }]
        );
        assert_eq!(d.tokens_to_node[1], vec![1, 1]);
        assert_eq!(d.nvl_forwarded[1], vec![1, 0]);
        assert_eq!(d.nvl_forwarded[3], vec![1, 1]);
        assert_eq!(d.received[2].topk_idx, vec![-1, 1, -1]);
        assert_eq!(d.received[2].weights, vec![0.0, 0.25, 0.0]);
        assert_eq!(d.received[3].topk_idx, vec![-1, -1, 1]);
        // Combine: ranks 0, 2, 3 return 1, 2, 4 (weights as received); node 1 sums 2 + 4 at
        // rank 3, which sends 6 back; rank 1 adds node 0's 1 and the bias 0.5.
        let back = |v: f32, w: &[f32]| CombineInput {
            x: vec![Bf16::from_f32(v)],
            weights: w.to_vec(),
        };
        let outputs = vec![
            back(1.0, &d.received[0].weights),
            CombineInput::default(),
            back(2.0, &d.received[2].weights),
            back(4.0, &d.received[3].weights),
        ];
        let bias = vec![
            [None, None],
            [Some(vec![Bf16::from_f32(0.5)]), None],
            [None, None],
            [None, None],
        ];
        let c = combine(&topo, &d, &outputs, &[0, 1, 0, 0], 1, 3, &bias).unwrap();
        assert_eq!(c.out[1].0, vec![Bf16::from_f32(7.5)]);
        assert_eq!(c.out[1].1, vec![0.5, 0.25, 0.125]);
        assert_eq!(c.rdma_copies, d.rdma_copies);
        let l = layout(&inputs[1].topk_idx, 3, &topo, 8).unwrap();
        assert_eq!(l.tokens_per_rdma_rank, vec![1, 1]);
        assert_eq!(l.tokens_per_rank, vec![1, 0, 1, 1]);
        assert_eq!(l.tokens_per_expert, vec![0, 1, 0, 0, 0, 1, 0, 1]);
    }

    #[test]
    fn node_sums_cross_as_bf16() {
        // Rank 0's token reaches ranks 2 and 3 (node 1), which return 1 and 2^-8. Node 1's sum,
        // 1 + 2^-8, is a tie that rounds to 1 in BF16 before it crosses; with a bias of 2^-8
        // the result is again a tie, 1. The one-hop sum keeps 1 + 2^-7, exact in BF16.
        let topo = Topology::new(2, 2).unwrap();
        let empty = RankInput {
            topk: 2,
            row_bytes: 2,
            ..Default::default()
        };
        let token = RankInput {
            tokens: 1,
            row_bytes: 2,
            x: vec![0, 0],
            topk: 2,
            topk_idx: vec![4, 6],
            weights: vec![1.0, 1.0],
            ..Default::default()
        };
        let inputs = vec![token, empty.clone(), empty.clone(), empty];
        let d = dispatch(&topo, &inputs, 8, 1).unwrap();
        let row = |v: f32| CombineInput {
            x: vec![Bf16::from_f32(v)],
            weights: vec![],
        };
        let outputs = vec![
            CombineInput::default(),
            CombineInput::default(),
            row(1.0),
            row(1.0 / 256.0),
        ];
        let eps = Bf16::from_f32(1.0 / 256.0);
        let bias = vec![
            [Some(vec![eps]), None],
            [None, None],
            [None, None],
            [None, None],
        ];
        let tokens = [1, 0, 0, 0];
        let two_hop = combine(&topo, &d, &outputs, &tokens, 1, 2, &bias).unwrap();
        let one_hop = crate::reference::combine(&d.received, &outputs, &tokens, 1, 2, &bias);
        assert_eq!(two_hop.out[0].0, vec![Bf16::from_f32(1.0)]);
        assert_eq!(one_hop[0].0, vec![Bf16::from_f32(1.0 + 1.0 / 128.0)]);
    }

    #[test]
    fn bad_inputs_are_errors_that_name_the_value() {
        let topo = Topology::new(2, 2).unwrap();
        let ok = |tokens: usize| RankInput {
            tokens,
            row_bytes: 1,
            x: vec![0; tokens],
            topk: 1,
            topk_idx: vec![0; tokens],
            weights: vec![1.0; tokens],
            ..Default::default()
        };
        let four = vec![ok(1), ok(1), ok(1), ok(1)];
        let msg = |r: Result<InternodeDispatch, ReferenceError>| r.unwrap_err().to_string();
        assert!(
            msg(dispatch(&topo, &four[..3], 4, 1)).contains("3 rank inputs for a topology of 4")
        );
        assert!(msg(dispatch(&topo, &four, 6, 1)).contains("num_experts 6"));
        assert!(msg(dispatch(&topo, &four, 0, 1)).contains("num_experts 0"));
        let mut bad = four.clone();
        bad[2].topk_idx = vec![4];
        assert!(msg(dispatch(&topo, &bad, 4, 1)).contains("rank 2, token 0: expert id 4"));
        bad[2].topk_idx = vec![-2];
        assert!(msg(dispatch(&topo, &bad, 4, 1)).contains("expert id -2"));
        let mut bad = four.clone();
        bad[1].x = vec![];
        assert!(msg(dispatch(&topo, &bad, 4, 1)).contains("rank 1: x has 0 elements, 1 expected"));
        let mut bad = four.clone();
        bad[3].weights = vec![];
        assert!(msg(dispatch(&topo, &bad, 4, 1)).contains("rank 3: weights"));
        let mut bad = four.clone();
        bad[0].tokens = usize::MAX;
        assert!(dispatch(&topo, &bad, 4, 1).is_err());
        assert!(layout(&[0, 9], 1, &topo, 4)
            .unwrap_err()
            .to_string()
            .contains("token 1: expert id 9"));
        assert!(layout(&[0, 1, 2], 2, &topo, 4)
            .unwrap_err()
            .to_string()
            .contains("topk_idx has 3"));

        let d = dispatch(&topo, &four, 4, 1).unwrap();
        let back = |rows: usize| CombineInput {
            x: vec![Bf16::default(); rows],
            weights: vec![],
        };
        let outputs: Vec<CombineInput> = d.received.iter().map(|r| back(r.sources.len())).collect();
        let nob = vec![[None, None], [None, None], [None, None], [None, None]];
        let cmsg = |o: &[CombineInput], t: &[usize], b: &[[Option<Vec<Bf16>>; 2]]| {
            combine(&topo, &d, o, t, 1, 1, b).unwrap_err().to_string()
        };
        combine(&topo, &d, &outputs, &[1, 1, 1, 1], 1, 1, &nob).unwrap();
        assert!(cmsg(&outputs[..2], &[1, 1, 1, 1], &nob).contains("2 combine inputs"));
        assert!(cmsg(&outputs, &[1, 1, 1], &nob).contains("3 token counts"));
        assert!(cmsg(&outputs, &[1, 0, 1, 1], &nob)
            .contains("rank 1: routes has 1 elements, 0 expected"));
        let mut short = outputs.clone();
        short[0].x.clear();
        assert!(cmsg(&short, &[1, 1, 1, 1], &nob).contains("rank 0: combine x has 0"));
        let mut bias = nob.clone();
        bias[2][1] = Some(vec![]);
        assert!(cmsg(&outputs, &[1, 1, 1, 1], &bias).contains("rank 2: bias has 0"));
    }
}
