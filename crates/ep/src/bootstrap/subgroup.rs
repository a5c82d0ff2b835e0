//! A group of some of a job's ranks (the ranks of one node, say) over the job's communicator.

use std::sync::Arc;

use super::{BootstrapError, Communicator};

/// Some ranks of a parent group, renumbered `0..members.len()` in the order given, seen as a
/// group of their own: what a buffer built over one node's ranks takes while the job spans
/// several nodes.
///
/// A collective of a sub-group is a collective of the parent: **every rank of the parent** calls
/// it, at the same point of its sequence, each through the sub-group it belongs to (the parent's
/// ranks split into disjoint sub-groups that all run the same steps, as the nodes of an
/// internode buffer do). That keeps the parent's order rule and its time bounds: a member that
/// never comes fails every rank's collective, naming it by its parent rank. The cost is one
/// parent collective per call, which set-up and teardown can afford.
///
/// ```
/// use std::sync::Arc;
/// use ep::bootstrap::{Communicator, SubGroup, ThreadGroup};
///
/// let comms = ThreadGroup::new(4).unwrap();
/// let all: Vec<_> = std::thread::scope(|s| {
///     let hs: Vec<_> = comms
///         .into_iter()
///         .map(|c| {
///             s.spawn(move || {
///                 // Two nodes of two: ranks {0, 1} and {2, 3}.
///                 let node = c.rank() / 2;
///                 let g = SubGroup::new(Arc::new(c), vec![2 * node, 2 * node + 1]).unwrap();
///                 (g.rank(), g.all_gather_bytes(&[g.parent_rank() as u8]).unwrap())
///             })
///         })
///         .collect();
///     hs.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(all[3], (1, vec![vec![2], vec![3]]));
/// ```
pub struct SubGroup {
    parent: Arc<dyn Communicator>,
    members: Vec<usize>,
    index: usize,
}

impl std::fmt::Debug for SubGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubGroup")
            .field("parent_rank", &self.parent.rank())
            .field("members", &self.members)
            .field("index", &self.index)
            .finish()
    }
}

impl SubGroup {
    /// The sub-group of `members` (parent ranks, distinct, in the sub-group's rank order), which
    /// must include the parent's own rank.
    pub fn new(parent: Arc<dyn Communicator>, members: Vec<usize>) -> Result<Self, BootstrapError> {
        let index = sub_rank(parent.rank(), parent.world_size(), &members)?;
        Ok(Self {
            parent,
            members,
            index,
        })
    }

    /// The index `members` gives parent rank `me` in a parent of `world` ranks, or `None` when
    /// they are not valid members including it: what [`new`](Self::new) would make its rank.
    pub fn sub_rank_of(me: usize, world: usize, members: &[usize]) -> Option<usize> {
        sub_rank(me, world, members).ok()
    }

    /// This rank in the parent.
    pub fn parent_rank(&self) -> usize {
        self.parent.rank()
    }

    /// The members, as parent ranks, in sub-group rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The parent group.
    pub fn parent(&self) -> &Arc<dyn Communicator> {
        &self.parent
    }
}

/// `me`'s index in `members`, once `members` are checked: non-empty, distinct, below `world`,
/// `me` among them.
pub(crate) fn sub_rank(
    me: usize,
    world: usize,
    members: &[usize],
) -> Result<usize, BootstrapError> {
    let bad = |why: String| {
        Err(BootstrapError::Config(format!(
            "rank {me}: sub-group {members:?} of {world} ranks: {why}"
        )))
    };
    if members.is_empty() {
        return bad("no members".into());
    }
    if let Some(r) = members.iter().find(|&&r| r >= world) {
        return bad(format!("rank {r} is not below {world}"));
    }
    for (i, r) in members.iter().enumerate() {
        if members[..i].contains(r) {
            return bad(format!("rank {r} appears twice"));
        }
    }
    match members.iter().position(|&r| r == me) {
        Some(i) => Ok(i),
        None => bad("this rank is not a member".into()),
    }
}

impl Communicator for SubGroup {
    fn rank(&self) -> usize {
        self.index
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn local_rank(&self) -> usize {
        self.parent.local_rank()
    }

    fn same_process(&self) -> bool {
        // The parent's answer holds for any subset of it (and `false` is always safe).
        self.parent.same_process()
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let mut all = self.parent.all_gather_bytes(mine)?;
        Ok(self
            .members
            .iter()
            .map(|&r| std::mem::take(&mut all[r]))
            .collect())
    }

    fn barrier(&self) -> Result<(), BootstrapError> {
        self.parent.barrier()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::ThreadGroup;

    #[test]
    fn members_are_checked() {
        assert_eq!(sub_rank(5, 8, &[4, 5, 6, 7]).unwrap(), 1);
        assert_eq!(sub_rank(0, 2, &[0]).unwrap(), 0);
        for (me, world, members, want) in [
            (0, 4, vec![], "no members"),
            (0, 4, vec![0, 4], "not below"),
            (0, 4, vec![0, 1, 0], "twice"),
            (2, 4, vec![0, 1], "not a member"),
        ] {
            let e = sub_rank(me, world, &members).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn every_collective_of_disjoint_groups_sees_its_own_members_only() {
        let comms = ThreadGroup::new(6).unwrap();
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        // Three nodes of two, the second listed backwards.
                        let node = c.rank() / 2;
                        let members = if node == 1 {
                            vec![3, 2]
                        } else {
                            vec![2 * node, 2 * node + 1]
                        };
                        let g = SubGroup::new(Arc::new(c), members).unwrap();
                        let a = g.all_gather_bytes(&[g.parent_rank() as u8]).unwrap();
                        g.barrier().unwrap();
                        let b = g
                            .broadcast_bytes(1, &[g.parent_rank() as u8 + 100])
                            .unwrap();
                        (g.rank(), g.world_size(), a, b)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got[0], (0, 2, vec![vec![0], vec![1]], vec![101]));
        assert_eq!(got[2], (1, 2, vec![vec![3], vec![2]], vec![102]));
        assert_eq!(got[3], (0, 2, vec![vec![3], vec![2]], vec![102]));
        assert_eq!(got[5], (1, 2, vec![vec![4], vec![5]], vec![105]));
    }
}
