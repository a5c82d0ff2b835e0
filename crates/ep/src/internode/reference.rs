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
/// assert_eq!(l.tokens_per_rank, vec![2, 1, 0, 1]);
/// assert_eq!(l.tokens_per_rdma_rank, vec![2, 1]);
/// assert_eq!(l.is_token_in_rank, vec![1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0]);
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
        if let Some(&(s, t)) = recv.sources.iter().find(|&&(s, t)| tokens.get(s) <= Some(&t)) {
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

fn check_len(rank: usize, what: &'static str, got: usize, want: usize) -> Result<(), ReferenceError> {
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
        check_len(r, "scales", i.scales.len(), len("scales", i.tokens, i.scale_words)?)?;
        check_len(r, "topk_idx", i.topk_idx.len(), len("topk_idx", i.tokens, i.topk)?)?;
        check_len(r, "weights", i.weights.len(), len("weights", i.tokens, i.topk)?)?;
        check_ids(r, &i.topk_idx, i.topk, num_experts)?;
    }
    Ok(())
}
