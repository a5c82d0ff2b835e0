//! Nodes and ranks: which rank sits where, which peers a rank reaches over NVLink and which only
//! through the NIC.

use std::ops::Range;

use crate::bootstrap::{LaunchEnv, MAX_WORLD_SIZE};

/// The most ranks one node may have: the GPUs of one NVLink domain on the hosts we target.
pub const MAX_RANKS_PER_NODE: usize = 8;

/// Why a topology, or a rank or node asked of it, is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// `ranks_per_node` is not in `1..=MAX_RANKS_PER_NODE`.
    #[error("ranks_per_node {ranks_per_node} is outside 1..={MAX_RANKS_PER_NODE}")]
    RanksPerNode {
        /// The value asked for.
        ranks_per_node: usize,
    },
    /// No nodes.
    #[error("a topology needs at least one node, got nodes = 0")]
    NoNodes,
    /// `nodes × ranks_per_node` is more than a job may have.
    #[error(
        "{nodes} nodes × {ranks_per_node} ranks per node is more than the {MAX_WORLD_SIZE} ranks \
         a job may have"
    )]
    TooManyRanks {
        /// Nodes asked for.
        nodes: usize,
        /// Ranks per node asked for.
        ranks_per_node: usize,
    },
    /// A rank outside `0..world`.
    #[error("rank {rank} is outside 0..{world}")]
    Rank {
        /// The rank asked about.
        rank: usize,
        /// Ranks in the topology.
        world: usize,
    },
    /// A node outside `0..nodes`.
    #[error("node {node} is outside 0..{nodes}")]
    Node {
        /// The node asked about.
        node: usize,
        /// Nodes in the topology.
        nodes: usize,
    },
    /// A local index outside `0..ranks_per_node`.
    #[error("local rank {local} is outside 0..{ranks_per_node}")]
    Local {
        /// The index asked about.
        local: usize,
        /// Ranks per node.
        ranks_per_node: usize,
    },
    /// Virtual nodes asked of a launch that does not fit them.
    #[error("virtual nodes of {ranks_per_node} ranks: {detail}")]
    VirtualNodes {
        /// Ranks per virtual node asked for.
        ranks_per_node: usize,
        /// What does not fit.
        detail: String,
    },
    /// A launcher placed a rank elsewhere than the topology's numbering says.
    #[error("rank {rank}: {detail}")]
    Placement {
        /// The rank.
        rank: usize,
        /// Where the launcher put it and where the topology expects it.
        detail: String,
    },
}

/// Where the nodes of a [`Topology`] are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeKind {
    /// Each node is a host: peers on other nodes are reachable only through the NIC.
    Hosts,
    /// One host split into nodes of `ranks_per_node` ranks. Every rank could reach every other
    /// over NVLink, but between nodes it must not: inter-node bytes go through the NIC, so one
    /// host exercises (and measures) the whole internode path.
    Virtual,
}

/// `nodes × ranks_per_node` ranks, numbered in blocks per node: rank `r` is local rank
/// `r % ranks_per_node` of node `r / ranks_per_node`.
///
/// A rank reaches the ranks of its own node over NVLink and every other rank only through the
/// NIC, whether the nodes are hosts or [virtual](NodeKind::Virtual): the later kernels read
/// [`nvlink_mask`](Self::nvlink_mask) rather than asking which host a peer is on.
///
/// ```
/// use ep::internode::{NodeKind, Topology};
///
/// let t = Topology::new(2, 4).unwrap();
/// assert_eq!(t.world(), 8);
/// assert_eq!(t.locate(6).unwrap(), (1, 2));
/// assert_eq!(t.rank(1, 2).unwrap(), 6);
/// // Rank 6 reaches node 0 through rank 2, its counterpart there.
/// assert_eq!(t.rdma_peer(6, 0).unwrap(), 2);
/// assert_eq!(t.nvlink_peers(6).unwrap(), 4..8);
/// assert!(!t.nvlink_between(1, 5).unwrap());
///
/// // One host of 8 GPUs as 4 nodes of 2: NVLink only inside each pair.
/// let v = Topology::virtual_nodes(4, 2).unwrap();
/// assert_eq!(v.kind(), NodeKind::Virtual);
/// assert_eq!(v.nvlink_mask(3).unwrap(), 0b1100);
/// assert!(v.same_host(0, 7).unwrap() && !v.nvlink_between(0, 7).unwrap());
///
/// assert!(Topology::new(2, 9).is_err());
/// assert!(Topology::new(0, 4).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    nodes: usize,
    ranks_per_node: usize,
    kind: NodeKind,
}

impl Topology {
    /// `nodes` hosts of `ranks_per_node` ranks each.
    pub fn new(nodes: usize, ranks_per_node: usize) -> Result<Self, TopologyError> {
        Self::with_kind(nodes, ranks_per_node, NodeKind::Hosts)
    }

    /// One host split into `nodes` virtual nodes of `ranks_per_node` ranks, NVLink between them
    /// disabled.
    pub fn virtual_nodes(nodes: usize, ranks_per_node: usize) -> Result<Self, TopologyError> {
        Self::with_kind(nodes, ranks_per_node, NodeKind::Virtual)
    }

    /// The topology of a job started by a launcher: its hosts as nodes, or, with
    /// `virtual_ranks_per_node` set below the ranks of its one host, that host split into
    /// virtual nodes of that many ranks (it must divide them). Splitting several hosts is
    /// refused: a node would then not know whether its neighbour shares its host.
    pub fn from_launch(
        env: &LaunchEnv,
        virtual_ranks_per_node: Option<usize>,
    ) -> Result<Self, TopologyError> {
        match virtual_ranks_per_node {
            None => Self::new(env.nodes(), env.local_world),
            Some(rpn) if rpn == env.local_world => Self::new(env.nodes(), rpn),
            Some(rpn) => {
                let refuse = |detail: String| {
                    Err(TopologyError::VirtualNodes {
                        ranks_per_node: rpn,
                        detail,
                    })
                };
                if env.nodes() != 1 {
                    return refuse(format!(
                        "the job spans {} hosts; virtual nodes split a single host",
                        env.nodes()
                    ));
                }
                if rpn == 0 || env.local_world % rpn != 0 {
                    return refuse(format!(
                        "they do not divide the host's {} ranks",
                        env.local_world
                    ));
                }
                Self::virtual_nodes(env.local_world / rpn, rpn)
            }
        }
        .and_then(|t| t.check_placement(env).map(|()| t))
    }

    /// Whether the launch in `env` put its rank where this topology's numbering says: the same
    /// number of ranks, and rank `r` at local index `r % ranks_per_node` of host
    /// `r / ranks_per_node` (hosts as nodes; what a launcher that numbers ranks host by host
    /// gives: torchrun, srun's default block distribution, mpirun's default `--map-by slot`),
    /// or at local index `r` of the one host (virtual nodes). A cyclic placement (`srun
    /// --distribution=cyclic`, `mpirun --map-by node`) is refused: its node's ranks would not
    /// be the ones this topology groups.
    pub fn check_placement(&self, env: &LaunchEnv) -> Result<(), TopologyError> {
        let rank = env.rank;
        let refuse = |detail: String| Err(TopologyError::Placement { rank, detail });
        if env.world != self.world() {
            return refuse(format!(
                "the launch has {} ranks, the topology {}",
                env.world,
                self.world()
            ));
        }
        let (node, local) = match self.kind {
            NodeKind::Hosts => self.locate(rank)?,
            NodeKind::Virtual => (0, rank),
        };
        if (env.node, env.local_rank) != (node, local) {
            return refuse(format!(
                "the launcher put it at local index {} of host {}; numbering ranks host by host \
                 ({} nodes × {} ranks, {:?}) puts it at local index {local} of host {node}",
                env.local_rank, env.node, self.nodes, self.ranks_per_node, self.kind
            ));
        }
        Ok(())
    }

    fn with_kind(
        nodes: usize,
        ranks_per_node: usize,
        kind: NodeKind,
    ) -> Result<Self, TopologyError> {
        if !(1..=MAX_RANKS_PER_NODE).contains(&ranks_per_node) {
            return Err(TopologyError::RanksPerNode { ranks_per_node });
        }
        if nodes == 0 {
            return Err(TopologyError::NoNodes);
        }
        match nodes.checked_mul(ranks_per_node) {
            Some(w) if w <= MAX_WORLD_SIZE => Ok(Self {
                nodes,
                ranks_per_node,
                kind,
            }),
            _ => Err(TopologyError::TooManyRanks {
                nodes,
                ranks_per_node,
            }),
        }
    }

    /// Nodes, `≥ 1`.
    pub const fn nodes(&self) -> usize {
        self.nodes
    }

    /// Ranks per node, `1..=MAX_RANKS_PER_NODE`.
    pub const fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// Whether the nodes are hosts or virtual.
    pub const fn kind(&self) -> NodeKind {
        self.kind
    }

    /// All ranks: `nodes × ranks_per_node`, at most `MAX_WORLD_SIZE`.
    pub const fn world(&self) -> usize {
        self.nodes * self.ranks_per_node
    }

    /// `(node, local rank)` of `rank`.
    pub fn locate(&self, rank: usize) -> Result<(usize, usize), TopologyError> {
        self.check_rank(rank)?;
        Ok((rank / self.ranks_per_node, rank % self.ranks_per_node))
    }

    /// The rank at `local` on `node`.
    pub fn rank(&self, node: usize, local: usize) -> Result<usize, TopologyError> {
        if node >= self.nodes {
            return Err(TopologyError::Node {
                node,
                nodes: self.nodes,
            });
        }
        if local >= self.ranks_per_node {
            return Err(TopologyError::Local {
                local,
                ranks_per_node: self.ranks_per_node,
            });
        }
        Ok(node * self.ranks_per_node + local)
    }

    /// The rank on `node` with `rank`'s local index: where `rank`'s tokens for `node` cross to,
    /// and the one copy of their combine comes back from (`rank` itself on its own node).
    pub fn rdma_peer(&self, rank: usize, node: usize) -> Result<usize, TopologyError> {
        let (_, local) = self.locate(rank)?;
        self.rank(node, local)
    }

    /// The ranks `rank` reaches over NVLink: its node's, itself included.
    pub fn nvlink_peers(&self, rank: usize) -> Result<Range<usize>, TopologyError> {
        let (node, _) = self.locate(rank)?;
        let first = node * self.ranks_per_node;
        Ok(first..first + self.ranks_per_node)
    }

    /// Whether `a` and `b` may move bytes over NVLink: only inside a node.
    pub fn nvlink_between(&self, a: usize, b: usize) -> Result<bool, TopologyError> {
        Ok(self.locate(a)?.0 == self.locate(b)?.0)
    }

    /// Whether `a` and `b` run on one host (every pair does with virtual nodes). Says nothing
    /// about NVLink: see [`nvlink_between`](Self::nvlink_between).
    pub fn same_host(&self, a: usize, b: usize) -> Result<bool, TopologyError> {
        let same_node = self.nvlink_between(a, b)?;
        Ok(same_node || self.kind == NodeKind::Virtual)
    }

    /// Bit `r` set for every rank `r` that `rank` reaches over NVLink (a world fits 64 bits):
    /// the form the kernels read.
    pub fn nvlink_mask(&self, rank: usize) -> Result<u64, TopologyError> {
        let peers = self.nvlink_peers(rank)?;
        Ok(peers.fold(0u64, |m, r| m | 1 << r))
    }

    fn check_rank(&self, rank: usize) -> Result<(), TopologyError> {
        if rank < self.world() {
            Ok(())
        } else {
            Err(TopologyError::Rank {
                rank,
                world: self.world(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{LauncherKind, Rendezvous};

    #[test]
    fn validation_names_the_value() {
        let cases: &[((usize, usize), &str)] = &[
            ((2, 0), "ranks_per_node 0 is outside 1..=8"),
            ((2, 9), "ranks_per_node 9 is outside 1..=8"),
            ((0, 4), "nodes = 0"),
            ((9, 8), "9 nodes × 8 ranks per node"),
            ((usize::MAX, 8), "nodes × 8 ranks"),
        ];
        for &((n, r), needle) in cases {
            for t in [Topology::new(n, r), Topology::virtual_nodes(n, r)] {
                let e = t.unwrap_err().to_string();
                assert!(e.contains(needle), "{n}×{r}: {e}");
            }
        }
        for rpn in 1..=MAX_RANKS_PER_NODE {
            let t = Topology::new(MAX_WORLD_SIZE / rpn, rpn).unwrap();
            assert!(t.world() <= MAX_WORLD_SIZE);
        }
    }

    #[test]
    fn ranks_map_to_nodes_and_back() {
        for (n, r) in [(1, 1), (2, 1), (2, 2), (2, 4), (4, 2), (1, 8), (8, 8)] {
            let t = Topology::new(n, r).unwrap();
            let mut seen = vec![false; t.world()];
            for node in 0..n {
                for local in 0..r {
                    let rank = t.rank(node, local).unwrap();
                    assert!(!seen[rank]);
                    seen[rank] = true;
                    assert_eq!(t.locate(rank).unwrap(), (node, local));
                    for other in 0..n {
                        let p = t.rdma_peer(rank, other).unwrap();
                        assert_eq!(t.locate(p).unwrap(), (other, local));
                    }
                    let mask = t.nvlink_mask(rank).unwrap();
                    for peer in 0..t.world() {
                        let nv = t.nvlink_between(rank, peer).unwrap();
                        assert_eq!(nv, mask >> peer & 1 == 1);
                        assert_eq!(nv, t.nvlink_peers(rank).unwrap().contains(&peer));
                        assert_eq!(nv, t.same_host(rank, peer).unwrap());
                    }
                }
            }
            assert!(seen.iter().all(|&s| s));
            let w = t.world();
            assert_eq!(t.locate(w), Err(TopologyError::Rank { rank: w, world: w }));
            assert!(t.rank(n, 0).unwrap_err().to_string().contains("node"));
            assert!(t.rank(0, r).unwrap_err().to_string().contains("local rank"));
            assert!(t.nvlink_between(0, w).is_err());
            assert!(t.rdma_peer(0, n).is_err());
        }
    }

    #[test]
    fn virtual_nodes_share_a_host_but_not_nvlink() {
        let v = Topology::virtual_nodes(2, 2).unwrap();
        assert_eq!(v.kind(), NodeKind::Virtual);
        for a in 0..4 {
            for b in 0..4 {
                assert!(v.same_host(a, b).unwrap());
                assert_eq!(v.nvlink_between(a, b).unwrap(), a / 2 == b / 2);
            }
        }
        assert_eq!(v.nvlink_mask(0).unwrap(), 0b0011);
        assert_eq!(v.nvlink_mask(2).unwrap(), 0b1100);
    }

    fn launched(world: usize, local_world: usize) -> LaunchEnv {
        LaunchEnv {
            launcher: LauncherKind::Torchrun,
            rank: 0,
            world,
            local_rank: 0,
            local_world,
            node: 0,
            rendezvous: Rendezvous {
                addr: "h".into(),
                port: 1,
            },
        }
    }

    #[test]
    fn from_a_launch() {
        let t = Topology::from_launch(&launched(16, 8), None).unwrap();
        assert_eq!(
            (t.nodes(), t.ranks_per_node(), t.kind()),
            (2, 8, NodeKind::Hosts)
        );
        let t = Topology::from_launch(&launched(16, 8), Some(8)).unwrap();
        assert_eq!(t.kind(), NodeKind::Hosts);
        let t = Topology::from_launch(&launched(8, 8), Some(2)).unwrap();
        assert_eq!(
            (t.nodes(), t.ranks_per_node(), t.kind()),
            (4, 2, NodeKind::Virtual)
        );
        let t = Topology::from_launch(&launched(4, 4), Some(1)).unwrap();
        assert_eq!((t.nodes(), t.ranks_per_node()), (4, 1));
        let e = Topology::from_launch(&launched(16, 8), Some(4)).unwrap_err();
        assert!(e.to_string().contains("spans 2 hosts"), "{e}");
        let e = Topology::from_launch(&launched(8, 8), Some(3)).unwrap_err();
        assert!(e.to_string().contains("do not divide the host's 8"), "{e}");
        let e = Topology::from_launch(&launched(8, 8), Some(0)).unwrap_err();
        assert!(e.to_string().contains("virtual nodes of 0"), "{e}");
        // A launch of 16 ranks on one host: more than a node may hold.
        // A hand-built launch with no local ranks: an error, no division by zero.
        assert!(Topology::from_launch(&launched(4, 0), None).is_err());
        assert!(Topology::from_launch(&launched(4, 0), Some(2)).is_err());
        let e = Topology::from_launch(&launched(16, 16), None).unwrap_err();
        assert!(e.to_string().contains("ranks_per_node 16"), "{e}");
    }

    fn placed(
        rank: usize,
        world: usize,
        local_world: usize,
        node: usize,
        local: usize,
    ) -> LaunchEnv {
        LaunchEnv {
            rank,
            node,
            local_rank: local,
            ..launched(world, local_world)
        }
    }

    #[test]
    fn a_launch_must_number_ranks_host_by_host() {
        // Two hosts of four, block placement: rank 5 is local 1 of host 1.
        let t = Topology::from_launch(&placed(5, 8, 4, 1, 1), None).unwrap();
        assert_eq!((t.nodes(), t.ranks_per_node()), (2, 4));
        for r in 0..8 {
            assert!(t.check_placement(&placed(r, 8, 4, r / 4, r % 4)).is_ok());
        }
        // Cyclic placement: rank 5 on host 1 at local index 2.
        let e = Topology::from_launch(&placed(5, 8, 4, 1, 2), None).unwrap_err();
        assert!(
            matches!(e, TopologyError::Placement { rank: 5, .. })
                && e.to_string().contains("local index 2 of host 1")
                && e.to_string().contains("local index 1 of host 1"),
            "{e}"
        );
        let e = t.check_placement(&placed(5, 8, 4, 0, 1)).unwrap_err();
        assert!(e.to_string().contains("of host 0"), "{e}");
        // Virtual nodes of one host: the local index is the rank.
        let v = Topology::from_launch(&placed(3, 4, 4, 0, 3), Some(2)).unwrap();
        assert_eq!((v.nodes(), v.kind()), (2, NodeKind::Virtual));
        assert!(Topology::from_launch(&placed(3, 4, 4, 0, 1), Some(2)).is_err());
        // A launch of another size.
        let e = v.check_placement(&placed(1, 8, 8, 0, 1)).unwrap_err();
        assert!(e.to_string().contains("8 ranks, the topology 4"), "{e}");
    }
}
