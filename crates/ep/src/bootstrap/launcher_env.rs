//! Who this rank is across hosts, read from the environment an existing launcher sets: `torchrun`,
//! `srun` (Slurm), `mpirun` (Open MPI) or MPICH's Hydra.
//!
//! Each launcher names the same five facts differently (this rank, the number of ranks, the rank's
//! index on its host, the ranks on its host, and for Slurm the host's index). [`LaunchEnv`] is
//! those facts, checked against each other, plus where rank 0 listens. The kernels of the
//! internode path number ranks in blocks per node (`rank = node × ranks_per_node + local`), so a
//! launcher that placed ranks otherwise (Slurm's cyclic distribution, Open MPI's `--map-by node`)
//! is refused here, by name, rather than found out by a hang.
//!
//! [`LaunchEnv::rank_config`] turns it into the [`RankConfig`] the TCP bootstrap reads; the job
//! token stays required exactly as [`RankConfig::from_env`] requires it (`EP_JOB_TOKEN`, or an
//! explicit `EP_INSECURE_NO_TOKEN=1`).

use std::fmt;

use super::config::{vars, DEFAULT_MASTER_ADDR, MAX_WORLD_SIZE};
use super::{BootstrapError, RankConfig, TcpCommunicator};

/// The environment variables each launcher sets, as read here.
pub mod launcher_vars {
    /// torchrun: ranks on this rank's host.
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    /// torchrun: this host's index (checked against the rank when set).
    pub const GROUP_RANK: &str = "GROUP_RANK";
    /// Slurm: this task's rank.
    pub const SLURM_PROCID: &str = "SLURM_PROCID";
    /// Slurm: the number of tasks.
    pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
    /// Slurm: this task's index on its node.
    pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
    /// Slurm: this node's index in the step.
    pub const SLURM_NODEID: &str = "SLURM_NODEID";
    /// Slurm: tasks per node of the step, e.g. `4(x2)` or `4,4`.
    pub const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
    /// Slurm: tasks per node, e.g. `4(x2)` or `4,4`.
    pub const SLURM_TASKS_PER_NODE: &str = "SLURM_TASKS_PER_NODE";
    /// Slurm: `--ntasks-per-node`.
    pub const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
    /// Open MPI: this process's rank.
    pub const OMPI_COMM_WORLD_RANK: &str = "OMPI_COMM_WORLD_RANK";
    /// Open MPI: the number of processes.
    pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
    /// Open MPI: this process's index on its node.
    pub const OMPI_COMM_WORLD_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
    /// Open MPI: processes on this node.
    pub const OMPI_COMM_WORLD_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";
    /// MPICH/Hydra: this process's rank.
    pub const PMI_RANK: &str = "PMI_RANK";
    /// MPICH/Hydra: the number of processes.
    pub const PMI_SIZE: &str = "PMI_SIZE";
    /// MPICH/Hydra: this process's index on its node.
    pub const MPI_LOCALRANKID: &str = "MPI_LOCALRANKID";
    /// MPICH/Hydra: processes on this node.
    pub const MPI_LOCALNRANKS: &str = "MPI_LOCALNRANKS";
}

use launcher_vars as lv;

/// The launcher whose variables described the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LauncherKind {
    /// `torchrun` (or anything setting `RANK`/`WORLD_SIZE`, such as [`Launcher`](super::Launcher)).
    Torchrun,
    /// `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH's `mpiexec` (Hydra).
    Hydra,
}

impl fmt::Display for LauncherKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Torchrun => "torchrun",
            Self::Slurm => "srun",
            Self::OpenMpi => "mpirun (Open MPI)",
            Self::Hydra => "mpiexec (MPICH/Hydra)",
        })
    }
}

/// Why the launcher's environment does not describe a usable rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchEnvError {
    /// None of the launchers' rank variables is set.
    #[error(
        "no launcher environment: none of RANK (torchrun), SLURM_PROCID (srun), \
         OMPI_COMM_WORLD_RANK (Open MPI) or PMI_RANK (MPICH/Hydra) is set"
    )]
    NoLauncher,
    /// A variable the launcher should have set is not set.
    #[error("{launcher}: environment variable {var} is not set ({hint})")]
    Missing {
        /// The launcher detected.
        launcher: LauncherKind,
        /// The variable.
        var: &'static str,
        /// What it should hold.
        hint: &'static str,
    },
    /// A variable holds a value that cannot be used.
    #[error("{launcher}: environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// The launcher detected.
        launcher: LauncherKind,
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Variables that are each valid contradict each other.
    #[error("{launcher}: inconsistent environment: {detail}")]
    Inconsistent {
        /// The launcher detected.
        launcher: LauncherKind,
        /// Which variables, their values, and what should hold between them.
        detail: String,
    },
}

/// Where rank 0 listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// Host name or IP address.
    pub addr: String,
    /// TCP port.
    pub port: u16,
}

impl Rendezvous {
    /// Parses `host:port` (`[v6addr]:port` for IPv6). `None` for anything else, or port 0.
    ///
    /// ```
    /// use ep::bootstrap::Rendezvous;
    /// let r = Rendezvous::parse("node17:29500").unwrap();
    /// assert_eq!((r.addr.as_str(), r.port), ("node17", 29500));
    /// assert_eq!(Rendezvous::parse("[fe80::1]:1").unwrap().addr, "fe80::1");
    /// assert!(Rendezvous::parse("node17").is_none());
    /// ```
    pub fn parse(s: &str) -> Option<Self> {
        let (host, port) = s.trim().rsplit_once(':')?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port = port.parse::<u16>().ok().filter(|&p| p != 0)?;
        (!host.is_empty() && !host.contains(char::is_whitespace)).then(|| Self {
            addr: host.to_string(),
            port,
        })
    }
}

/// Where [`LaunchEnv`] finds rank 0's address.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RendezvousSource {
    /// `MASTER_ADDR` and `MASTER_PORT` (torchrun sets both; under srun or mpirun the job script
    /// exports them).
    #[default]
    MasterVars,
    /// This variable holds `host:port`.
    Var(&'static str),
    /// Given by the caller.
    Given(Rendezvous),
}

/// One rank's place in a job started by an existing launcher: this rank, the ranks, the rank's
/// index on its host and the ranks there, the host's index, and where rank 0 listens.
///
/// Ranks are numbered in blocks per host: `rank == node × local_world + local_rank`, every host
/// runs `local_world` ranks (checked).
///
/// ```
/// use ep::bootstrap::{LaunchEnv, LauncherKind};
/// use std::collections::HashMap;
///
/// // Rank 5 of 8, started by srun on 2 nodes of 4 tasks.
/// let env: HashMap<&str, &str> = [
///     ("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1"),
///     ("SLURM_NODEID", "1"), ("SLURM_TASKS_PER_NODE", "4(x2)"),
///     ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"),
/// ].into_iter().collect();
/// let le = LaunchEnv::from_vars(|k| env.get(k).map(|v| v.to_string())).unwrap();
/// assert_eq!(le.launcher, LauncherKind::Slurm);
/// assert_eq!((le.rank, le.world, le.local_rank, le.local_world, le.node), (5, 8, 1, 4, 1));
/// assert_eq!(le.nodes(), 2);
///
/// // The job token rules are the bootstrap's: none set, none opted out of, refused.
/// assert!(le.rank_config(|k| env.get(k).map(|v| v.to_string())).is_err());
/// let cfg = le
///     .rank_config(|k| match k {
///         "EP_JOB_TOKEN" => Some("00112233445566778899aabbccddeeff".into()),
///         _ => env.get(k).map(|v| v.to_string()),
///     })
///     .unwrap();
/// assert_eq!((cfg.rank, cfg.world_size, cfg.local_rank), (5, 8, 1));
/// assert_eq!((cfg.master_addr.as_str(), cfg.master_port), ("node0", 29500));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher whose variables were read.
    pub launcher: LauncherKind,
    /// This rank, `0..world`.
    pub rank: usize,
    /// The number of ranks, `1..=MAX_WORLD_SIZE`.
    pub world: usize,
    /// This rank's index on its host, `0..local_world`: the GPU it uses.
    pub local_rank: usize,
    /// Ranks on each host; divides `world`.
    pub local_world: usize,
    /// This rank's host, `0..world / local_world`.
    pub node: usize,
    /// Where rank 0 listens (`127.0.0.1`, port 0 for a job of one rank that names none).
    pub rendezvous: Rendezvous,
}

/// A variable's name and its trimmed, non-empty value.
type Var = (&'static str, String);

struct Reader<L> {
    lookup: L,
    launcher: LauncherKind,
}

impl<L: Fn(&str) -> Option<String>> Reader<L> {
    fn get(&self, var: &'static str) -> Option<Var> {
        (self.lookup)(var)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .map(|v| (var, v))
    }

    fn require(&self, var: &'static str, hint: &'static str) -> Result<Var, LaunchEnvError> {
        self.get(var).ok_or(LaunchEnvError::Missing {
            launcher: self.launcher,
            var,
            hint,
        })
    }

    fn invalid(&self, (var, value): &Var, reason: impl Into<String>) -> LaunchEnvError {
        LaunchEnvError::Invalid {
            launcher: self.launcher,
            var,
            value: value.clone(),
            reason: reason.into(),
        }
    }

    fn int(&self, v: &Var) -> Result<usize, LaunchEnvError> {
        v.1.parse::<usize>()
            .map_err(|_| self.invalid(v, "not a non-negative integer"))
    }

    fn inconsistent(&self, detail: String) -> LaunchEnvError {
        LaunchEnvError::Inconsistent {
            launcher: self.launcher,
            detail,
        }
    }
}

/// The four numbers every launcher gives, with the variables they came from.
struct Counts {
    rank: Var,
    world: Var,
    local_rank: Var,
    local_world: Var,
}

impl LaunchEnv {
    /// Reads the process environment ([`from_vars`](Self::from_vars)).
    pub fn from_env() -> Result<Self, LaunchEnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the launcher's variables through `lookup`, rank 0's address from `MASTER_ADDR` and
    /// `MASTER_PORT`.
    ///
    /// The launcher is the first whose rank variable is set, in this order: `RANK` (torchrun,
    /// which also wins when it runs inside a Slurm step), `OMPI_COMM_WORLD_RANK`, `PMI_RANK`,
    /// `SLURM_PROCID` (an `mpirun` inside a Slurm allocation sets both, and its own is the one
    /// that holds for this process).
    ///
    /// - torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (or `EP_LOCAL_RANK`, which wins; default
    ///   `RANK`), `LOCAL_WORLD_SIZE` (default `WORLD_SIZE`: one host, as the project's own
    ///   [`Launcher`](super::Launcher) runs), `GROUP_RANK` (checked when set).
    /// - srun: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, and the tasks per
    ///   node from the first of `SLURM_STEP_TASKS_PER_NODE`, `SLURM_TASKS_PER_NODE`,
    ///   `SLURM_NTASKS_PER_NODE` (`4`, `4(x2)`, `4,4`, `2(x3),2`; every node must run as many).
    /// - Open MPI: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`.
    /// - MPICH/Hydra: `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, LaunchEnvError> {
        Self::from_vars_with(lookup, &RendezvousSource::MasterVars)
    }

    /// As [`from_vars`](Self::from_vars), with rank 0's address from `source`.
    pub fn from_vars_with(
        lookup: impl Fn(&str) -> Option<String>,
        source: &RendezvousSource,
    ) -> Result<Self, LaunchEnvError> {
        let present = |v: &str| lookup(v).is_some_and(|s| !s.trim().is_empty());
        let launcher = [
            (vars::RANK, LauncherKind::Torchrun),
            (lv::OMPI_COMM_WORLD_RANK, LauncherKind::OpenMpi),
            (lv::PMI_RANK, LauncherKind::Hydra),
            (lv::SLURM_PROCID, LauncherKind::Slurm),
        ]
        .into_iter()
        .find(|(v, _)| present(v))
        .map(|(_, k)| k)
        .ok_or(LaunchEnvError::NoLauncher)?;
        let r = Reader { lookup, launcher };
        let (counts, node) = match launcher {
            LauncherKind::Torchrun => torchrun_counts(&r)?,
            LauncherKind::Slurm => slurm_counts(&r)?,
            LauncherKind::OpenMpi => (
                Counts {
                    rank: r.require(lv::OMPI_COMM_WORLD_RANK, "this process's rank")?,
                    world: r.require(lv::OMPI_COMM_WORLD_SIZE, "the number of processes")?,
                    local_rank: r.require(
                        lv::OMPI_COMM_WORLD_LOCAL_RANK,
                        "this process's index on its node",
                    )?,
                    local_world: r
                        .require(lv::OMPI_COMM_WORLD_LOCAL_SIZE, "processes on this node")?,
                },
                None,
            ),
            LauncherKind::Hydra => (
                Counts {
                    rank: r.require(lv::PMI_RANK, "this process's rank")?,
                    world: r.require(lv::PMI_SIZE, "the number of processes")?,
                    local_rank: r
                        .require(lv::MPI_LOCALRANKID, "this process's index on its node")?,
                    local_world: r.require(lv::MPI_LOCALNRANKS, "processes on this node")?,
                },
                None,
            ),
        };
        let mut env = check_counts(&r, &counts, node)?;
        env.rendezvous = rendezvous(&r, source, env.world)?;
        Ok(env)
    }

    /// The number of hosts: `world / local_world`.
    pub fn nodes(&self) -> usize {
        // The fields are public: a hand-built value with no local ranks has no nodes.
        self.world.checked_div(self.local_world).unwrap_or(0)
    }

    /// The bootstrap configuration of this rank: its rank, world, local rank and rendezvous from
    /// here; the job token, the opt-out and the time bound read through `lookup` under exactly
    /// [`RankConfig::from_vars`]'s rules (`EP_JOB_TOKEN` required for several ranks unless
    /// `EP_INSECURE_NO_TOKEN=1`; `EP_BOOTSTRAP_TIMEOUT_S`).
    pub fn rank_config(
        &self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<RankConfig, BootstrapError> {
        let port = (self.rendezvous.port != 0).then(|| self.rendezvous.port.to_string());
        RankConfig::from_vars(|k| match k {
            vars::RANK => Some(self.rank.to_string()),
            vars::WORLD_SIZE => Some(self.world.to_string()),
            vars::EP_LOCAL_RANK => Some(self.local_rank.to_string()),
            vars::LOCAL_RANK => None,
            vars::MASTER_ADDR => Some(self.rendezvous.addr.clone()),
            vars::MASTER_PORT => port.clone(),
            other => lookup(other),
        })
    }

    /// Joins the job over TCP ([`TcpCommunicator::connect`]), the token and time bound read from
    /// the process environment ([`rank_config`](Self::rank_config)).
    pub fn connect(&self) -> Result<TcpCommunicator, BootstrapError> {
        TcpCommunicator::connect(&self.rank_config(|k| std::env::var(k).ok())?)
    }
}

impl TcpCommunicator {
    /// Joins the job that an existing launcher (torchrun, srun, mpirun) started this process in:
    /// [`LaunchEnv::from_env`], then [`LaunchEnv::connect`].
    pub fn from_launcher_env() -> Result<Self, BootstrapError> {
        LaunchEnv::from_env()?.connect()
    }
}

fn torchrun_counts<L: Fn(&str) -> Option<String>>(
    r: &Reader<L>,
) -> Result<(Counts, Option<Var>), LaunchEnvError> {
    let rank = r.require(vars::RANK, "this process's rank")?;
    let world = r.require(vars::WORLD_SIZE, "the number of ranks in the job")?;
    let local_rank = r
        .get(vars::EP_LOCAL_RANK)
        .or_else(|| r.get(vars::LOCAL_RANK))
        .unwrap_or_else(|| (vars::RANK, rank.1.clone()));
    let local_world = r
        .get(lv::LOCAL_WORLD_SIZE)
        .unwrap_or_else(|| (vars::WORLD_SIZE, world.1.clone()));
    let counts = Counts {
        rank,
        world,
        local_rank,
        local_world,
    };
    Ok((counts, r.get(lv::GROUP_RANK)))
}

fn slurm_counts<L: Fn(&str) -> Option<String>>(
    r: &Reader<L>,
) -> Result<(Counts, Option<Var>), LaunchEnvError> {
    let rank = r.require(lv::SLURM_PROCID, "this task's rank")?;
    let world = r.require(lv::SLURM_NTASKS, "the number of tasks")?;
    let local_rank = r.require(lv::SLURM_LOCALID, "this task's index on its node")?;
    let node = r.require(lv::SLURM_NODEID, "this node's index")?;
    let per_node = [
        lv::SLURM_STEP_TASKS_PER_NODE,
        lv::SLURM_TASKS_PER_NODE,
        lv::SLURM_NTASKS_PER_NODE,
    ]
    .into_iter()
    .find_map(|v| r.get(v))
    .ok_or(LaunchEnvError::Missing {
        launcher: r.launcher,
        var: lv::SLURM_TASKS_PER_NODE,
        hint: "tasks per node, such as 4(x2)",
    })?;
    let groups = parse_tasks_per_node(&per_node.1).map_err(|why| r.invalid(&per_node, why))?;
    let first = groups[0].0;
    if let Some(&(other, _)) = groups.iter().find(|g| g.0 != first) {
        return Err(r.invalid(
            &per_node,
            format!(
                "nodes run different numbers of tasks ({first} and {other}); every node must run \
                 as many ranks"
            ),
        ));
    }
    // `--ntasks-per-node` is one node's count; the other two list every node.
    if per_node.0 == lv::SLURM_NTASKS_PER_NODE && groups.len() == 1 && groups[0].1 == 1 {
        let counts = Counts {
            rank,
            world,
            local_rank,
            local_world: per_node,
        };
        return Ok((counts, Some(node)));
    }
    let listed = groups
        .iter()
        .try_fold(0usize, |acc, &(n, times)| {
            acc.checked_add(n.checked_mul(times)?)
        })
        .ok_or_else(|| r.invalid(&per_node, "the total does not fit a usize"))?;
    let world_n = r.int(&world)?;
    if listed != world_n {
        return Err(r.inconsistent(format!(
            "{}={:?} lists {listed} tasks but {}={world_n}",
            per_node.0,
            per_node.1,
            lv::SLURM_NTASKS
        )));
    }
    let counts = Counts {
        rank,
        world,
        local_rank,
        local_world: (per_node.0, first.to_string()),
    };
    Ok((counts, Some(node)))
}

/// Parses Slurm's tasks-per-node form: comma-separated `N` or `N(xM)`, into `(N, M)` pairs with
/// `N ≥ 1`, `M ≥ 1`.
fn parse_tasks_per_node(s: &str) -> Result<Vec<(usize, usize)>, String> {
    let bad = |item: &str| format!("{item:?} is not N or N(xM) with N, M ≥ 1");
    s.split(',')
        .map(|item| {
            let item = item.trim();
            let (n, times) = match item.split_once('(') {
                None => (item, "1"),
                Some((n, rest)) => (
                    n,
                    rest.strip_prefix('x')
                        .and_then(|r| r.strip_suffix(')'))
                        .ok_or_else(|| bad(item))?,
                ),
            };
            match (n.parse::<usize>(), times.parse::<usize>()) {
                (Ok(n), Ok(m)) if n >= 1 && m >= 1 => Ok((n, m)),
                _ => Err(bad(item)),
            }
        })
        .collect()
}

fn check_counts<L: Fn(&str) -> Option<String>>(
    r: &Reader<L>,
    c: &Counts,
    node_var: Option<Var>,
) -> Result<LaunchEnv, LaunchEnvError> {
    let world = r.int(&c.world)?;
    if !(1..=MAX_WORLD_SIZE).contains(&world) {
        return Err(r.invalid(&c.world, format!("must be in 1..={MAX_WORLD_SIZE}")));
    }
    let rank = r.int(&c.rank)?;
    if rank >= world {
        return Err(r.invalid(&c.rank, format!("must be below {}={world}", c.world.0)));
    }
    let local_world = r.int(&c.local_world)?;
    if !(1..=world).contains(&local_world) {
        return Err(r.invalid(
            &c.local_world,
            format!("must be in 1..={}={world}", c.world.0),
        ));
    }
    if world % local_world != 0 {
        return Err(r.inconsistent(format!(
            "{}={world} is not divisible into nodes of {}={local_world} ranks",
            c.world.0, c.local_world.0
        )));
    }
    let local_rank = r.int(&c.local_rank)?;
    if local_rank >= local_world {
        return Err(r.invalid(
            &c.local_rank,
            format!("must be below {}={local_world}", c.local_world.0),
        ));
    }
    let node = rank / local_world;
    if rank % local_world != local_rank {
        return Err(r.inconsistent(format!(
            "{}={rank} with {}={local_rank} and {}={local_world}: ranks must be numbered in \
             blocks per node (rank = node × {local_world} + local rank), as torchrun does, srun \
             with --distribution=block and mpirun with --map-by slot",
            c.rank.0, c.local_rank.0, c.local_world.0
        )));
    }
    if let Some(nv) = &node_var {
        let n = r.int(nv)?;
        if n != node {
            return Err(r.inconsistent(format!(
                "{}={n} but {}={rank} with {local_world} ranks per node is on node {node}: ranks \
                 must be numbered in blocks per node",
                nv.0, c.rank.0
            )));
        }
    }
    Ok(LaunchEnv {
        launcher: r.launcher,
        rank,
        world,
        local_rank,
        local_world,
        node,
        rendezvous: Rendezvous {
            addr: String::new(),
            port: 0,
        },
    })
}

fn rendezvous<L: Fn(&str) -> Option<String>>(
    r: &Reader<L>,
    source: &RendezvousSource,
    world: usize,
) -> Result<Rendezvous, LaunchEnvError> {
    match source {
        RendezvousSource::Given(given) => {
            if given.addr.trim().is_empty() || given.port == 0 {
                return Err(r.inconsistent(format!(
                    "the rendezvous given, {}:{}, needs a host and a port other than 0",
                    given.addr, given.port
                )));
            }
            Ok(given.clone())
        }
        RendezvousSource::Var(var) => match r.get(var) {
            Some(v) => Rendezvous::parse(&v.1)
                .ok_or_else(|| r.invalid(&v, "not host:port with a port in 1..=65535")),
            None if world == 1 => Ok(alone()),
            None => Err(LaunchEnvError::Missing {
                launcher: r.launcher,
                var,
                hint: "host:port where rank 0 listens",
            }),
        },
        RendezvousSource::MasterVars => {
            let addr = r.get(vars::MASTER_ADDR);
            let port = r.get(vars::MASTER_PORT);
            if world == 1 && addr.is_none() && port.is_none() {
                return Ok(alone());
            }
            let addr = addr.ok_or(LaunchEnvError::Missing {
                launcher: r.launcher,
                var: vars::MASTER_ADDR,
                hint: "the host rank 0 runs on, reachable from every node",
            })?;
            let port = port.ok_or(LaunchEnvError::Missing {
                launcher: r.launcher,
                var: vars::MASTER_PORT,
                hint: "the TCP port rank 0 listens on",
            })?;
            let p = port
                .1
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| r.invalid(&port, "not a TCP port (1..=65535)"))?;
            Ok(Rendezvous {
                addr: addr.1,
                port: p,
            })
        }
    }
}

fn alone() -> Rendezvous {
    Rendezvous {
        addr: DEFAULT_MASTER_ADDR.to_string(),
        port: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    type Vars<'a> = &'a [(&'a str, &'a str)];

    fn lookup(pairs: Vars<'_>) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn parse(pairs: Vars<'_>) -> Result<LaunchEnv, LaunchEnvError> {
        LaunchEnv::from_vars(lookup(pairs))
    }

    const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")];
    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    fn with_master<'a>(v: Vars<'a>) -> Vec<(&'a str, &'a str)> {
        let mut all = v.to_vec();
        all.extend_from_slice(&MASTER);
        all
    }

    /// (launcher, variables, expected (rank, world, local_rank, local_world, node)).
    #[test]
    fn every_launcher_is_read() {
        type Case<'a> = (LauncherKind, Vars<'a>, (usize, usize, usize, usize, usize));
        let cases: &[Case] = &[
            (
                LauncherKind::Torchrun,
                &[
                    ("RANK", "5"),
                    ("WORLD_SIZE", "8"),
                    ("LOCAL_RANK", "1"),
                    ("LOCAL_WORLD_SIZE", "4"),
                    ("GROUP_RANK", "1"),
                ],
                (5, 8, 1, 4, 1),
            ),
            // The project's own Launcher: one host, EP_LOCAL_RANK.
            (
                LauncherKind::Torchrun,
                &[("RANK", "2"), ("WORLD_SIZE", "4"), ("EP_LOCAL_RANK", "2")],
                (2, 4, 2, 4, 0),
            ),
            (
                LauncherKind::Torchrun,
                &[("RANK", "3"), ("WORLD_SIZE", "4")],
                (3, 4, 3, 4, 0),
            ),
            (
                LauncherKind::Slurm,
                &[
                    ("SLURM_PROCID", "6"),
                    ("SLURM_NTASKS", "8"),
                    ("SLURM_LOCALID", "2"),
                    ("SLURM_NODEID", "1"),
                    ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ],
                (6, 8, 2, 4, 1),
            ),
            (
                LauncherKind::Slurm,
                &[
                    ("SLURM_PROCID", "7"),
                    ("SLURM_NTASKS", "8"),
                    ("SLURM_LOCALID", "1"),
                    ("SLURM_NODEID", "3"),
                    ("SLURM_TASKS_PER_NODE", "2,2(x2),2"),
                ],
                (7, 8, 1, 2, 3),
            ),
            (
                LauncherKind::Slurm,
                &[
                    ("SLURM_PROCID", "1"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NODEID", "1"),
                    ("SLURM_NTASKS_PER_NODE", "1"),
                ],
                (1, 2, 0, 1, 1),
            ),
            // The step's form wins over the job's.
            (
                LauncherKind::Slurm,
                &[
                    ("SLURM_PROCID", "3"),
                    ("SLURM_NTASKS", "4"),
                    ("SLURM_LOCALID", "1"),
                    ("SLURM_NODEID", "1"),
                    ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
                    ("SLURM_TASKS_PER_NODE", "8"),
                ],
                (3, 4, 1, 2, 1),
            ),
            (
                LauncherKind::OpenMpi,
                &[
                    ("OMPI_COMM_WORLD_RANK", "9"),
                    ("OMPI_COMM_WORLD_SIZE", "16"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
                    // mpirun inside a Slurm allocation: its own variables hold.
                    ("SLURM_PROCID", "0"),
                ],
                (9, 16, 1, 8, 1),
            ),
            (
                LauncherKind::Hydra,
                &[
                    ("PMI_RANK", "3"),
                    ("PMI_SIZE", "4"),
                    ("MPI_LOCALRANKID", "1"),
                    ("MPI_LOCALNRANKS", "2"),
                ],
                (3, 4, 1, 2, 1),
            ),
            // torchrun inside a Slurm step.
            (
                LauncherKind::Torchrun,
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "1"),
                    ("SLURM_PROCID", "0"),
                ],
                (1, 2, 0, 1, 1),
            ),
        ];
        for (kind, vars, want) in cases {
            let env = parse(&with_master(vars)).unwrap_or_else(|e| panic!("{vars:?}: {e}"));
            assert_eq!(env.launcher, *kind, "{vars:?}");
            let got = (
                env.rank,
                env.world,
                env.local_rank,
                env.local_world,
                env.node,
            );
            assert_eq!(got, *want, "{vars:?}");
            assert_eq!(env.nodes(), want.1 / want.3);
            assert_eq!(
                env.rendezvous,
                Rendezvous {
                    addr: "node0".into(),
                    port: 29500
                }
            );
        }
    }

    /// (variables, text the error must contain).
    #[test]
    fn every_error_names_its_variable() {
        let t = [
            ("RANK", "1"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        let s = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ];
        let o = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        let h = [
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ];
        // `base` with `set` replacing or adding, `drop` removed.
        let edit = |base: Vars<'_>, set: Vars<'_>, drop: &[&str]| -> String {
            let mut v: Vec<(&str, &str)> = with_master(base)
                .into_iter()
                .filter(|(k, _)| !drop.contains(k) && !set.iter().any(|(s, _)| s == k))
                .collect();
            v.extend_from_slice(set);
            match parse(&v) {
                Ok(env) => panic!("{v:?} parsed: {env:?}"),
                Err(e) => e.to_string(),
            }
        };
        type Case<'a> = (String, &'a [&'a str]);
        let cases: Vec<Case> = vec![
            (edit(&[], &[], &["MASTER_ADDR"]), &["no launcher"]),
            (
                edit(&t, &[], &["WORLD_SIZE"]),
                &["torchrun", "WORLD_SIZE is not set"],
            ),
            (
                edit(&t, &[("WORLD_SIZE", "x")], &[]),
                &["WORLD_SIZE=\"x\"", "integer"],
            ),
            (
                edit(&t, &[("WORLD_SIZE", "0")], &[]),
                &["WORLD_SIZE=\"0\"", "1..=64"],
            ),
            (
                edit(&t, &[("WORLD_SIZE", "128"), ("RANK", "1")], &[]),
                &["WORLD_SIZE=\"128\"", "1..=64"],
            ),
            (
                edit(&t, &[("RANK", "8")], &[]),
                &["RANK=\"8\"", "below WORLD_SIZE=8"],
            ),
            (
                edit(&t, &[("WORLD_SIZE", "6")], &[]),
                &["WORLD_SIZE=6", "not divisible", "LOCAL_WORLD_SIZE=4"],
            ),
            (
                edit(&t, &[("LOCAL_WORLD_SIZE", "16")], &[]),
                &["LOCAL_WORLD_SIZE=\"16\"", "1..=WORLD_SIZE=8"],
            ),
            (
                edit(&t, &[("LOCAL_WORLD_SIZE", "0")], &[]),
                &["LOCAL_WORLD_SIZE=\"0\""],
            ),
            (
                edit(&t, &[("LOCAL_RANK", "4")], &[]),
                &["LOCAL_RANK=\"4\"", "below LOCAL_WORLD_SIZE=4"],
            ),
            (
                edit(&t, &[("LOCAL_RANK", "2")], &[]),
                &["RANK=1", "LOCAL_RANK=2", "blocks per node"],
            ),
            (
                edit(&t, &[("GROUP_RANK", "1")], &[]),
                &["GROUP_RANK=1", "node 0"],
            ),
            (edit(&t, &[], &["MASTER_ADDR"]), &["MASTER_ADDR is not set"]),
            (edit(&t, &[], &["MASTER_PORT"]), &["MASTER_PORT is not set"]),
            (
                edit(&t, &[("MASTER_PORT", "0")], &[]),
                &["MASTER_PORT=\"0\"", "TCP port"],
            ),
            (
                edit(&t, &[("MASTER_PORT", "70000")], &[]),
                &["MASTER_PORT=\"70000\""],
            ),
            (
                edit(&s, &[], &["SLURM_NODEID"]),
                &["srun", "SLURM_NODEID is not set"],
            ),
            (
                edit(&s, &[], &["SLURM_LOCALID"]),
                &["SLURM_LOCALID is not set"],
            ),
            (
                edit(&s, &[], &["SLURM_TASKS_PER_NODE"]),
                &["SLURM_TASKS_PER_NODE is not set"],
            ),
            (
                edit(&s, &[("SLURM_TASKS_PER_NODE", "4(x2")], &[]),
                &["SLURM_TASKS_PER_NODE=\"4(x2\"", "N(xM)"],
            ),
            (
                edit(&s, &[("SLURM_TASKS_PER_NODE", "0(x2)")], &[]),
                &["SLURM_TASKS_PER_NODE=\"0(x2)\""],
            ),
            (
                edit(&s, &[("SLURM_TASKS_PER_NODE", "4,2,2")], &[]),
                &["different numbers of tasks (4 and 2)"],
            ),
            (
                edit(&s, &[("SLURM_TASKS_PER_NODE", "4(x3)")], &[]),
                &["lists 12 tasks", "SLURM_NTASKS=8"],
            ),
            (
                edit(&s, &[("SLURM_NODEID", "0")], &[]),
                &["SLURM_NODEID=0", "SLURM_PROCID=5", "node 1"],
            ),
            (
                edit(&s, &[("SLURM_LOCALID", "4")], &[]),
                &["SLURM_LOCALID=\"4\"", "below SLURM_TASKS_PER_NODE=4"],
            ),
            (
                edit(&o, &[("OMPI_COMM_WORLD_LOCAL_SIZE", "3")], &[]),
                &["mpirun", "OMPI_COMM_WORLD_SIZE=4", "not divisible"],
            ),
            (
                edit(&o, &[("OMPI_COMM_WORLD_LOCAL_RANK", "0")], &[]),
                &["OMPI_COMM_WORLD_RANK=1", "blocks per node", "--map-by slot"],
            ),
            (
                edit(&o, &[], &["OMPI_COMM_WORLD_LOCAL_SIZE"]),
                &["OMPI_COMM_WORLD_LOCAL_SIZE is not set"],
            ),
            (
                edit(&h, &[], &["MPI_LOCALNRANKS"]),
                &["MPICH", "MPI_LOCALNRANKS is not set"],
            ),
            (
                edit(&h, &[("PMI_SIZE", "1")], &[]),
                &["PMI_RANK=\"1\"", "below PMI_SIZE=1"],
            ),
        ];
        for (msg, needles) in &cases {
            for n in *needles {
                assert!(msg.contains(n), "{msg:?} lacks {n:?}");
            }
        }
    }

    #[test]
    fn the_rendezvous_can_come_from_a_named_variable_or_the_caller() {
        let s = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
            ("MY_RDZV", "[fd00::7]:4000"),
        ];
        let src = RendezvousSource::Var("MY_RDZV");
        let env = LaunchEnv::from_vars_with(lookup(&s), &src).unwrap();
        assert_eq!(env.rendezvous.addr, "fd00::7");
        assert_eq!(env.rendezvous.port, 4000);
        let e = LaunchEnv::from_vars_with(lookup(&s[..5]), &src).unwrap_err();
        assert!(e.to_string().contains("MY_RDZV is not set"), "{e}");
        let mut bad = s.to_vec();
        bad[5] = ("MY_RDZV", "node0");
        let e = LaunchEnv::from_vars_with(lookup(&bad), &src).unwrap_err();
        assert!(e.to_string().contains("MY_RDZV=\"node0\""), "{e}");
        let given = Rendezvous {
            addr: "10.0.0.1".into(),
            port: 1234,
        };
        let env =
            LaunchEnv::from_vars_with(lookup(&s), &RendezvousSource::Given(given.clone())).unwrap();
        assert_eq!(env.rendezvous, given);
        let zero = RendezvousSource::Given(Rendezvous {
            addr: "10.0.0.1".into(),
            port: 0,
        });
        assert!(LaunchEnv::from_vars_with(lookup(&s), &zero).is_err());
        // One rank needs no rendezvous.
        let env = parse(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(env.rendezvous, alone());
    }

    #[test]
    fn rank_config_keeps_the_token_rules() {
        let vars = with_master(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            // Stale values of torchrun's names must not leak into the configuration.
            ("LOCAL_RANK", "7"),
        ]);
        let env = parse(&vars).unwrap();
        let e = env.rank_config(lookup(&vars)).unwrap_err();
        assert!(e.to_string().contains("EP_JOB_TOKEN"), "{e}");
        let mut with_token = vars.clone();
        with_token.push(("EP_JOB_TOKEN", TOKEN));
        with_token.push(("EP_BOOTSTRAP_TIMEOUT_S", "3"));
        let cfg = env.rank_config(lookup(&with_token)).unwrap();
        assert_eq!(
            (cfg.rank, cfg.world_size, cfg.local_rank),
            (1, 4, 1),
            "{cfg:?}"
        );
        assert_eq!(
            (cfg.master_addr.as_str(), cfg.master_port),
            ("node0", 29500)
        );
        assert_eq!(cfg.timeout, std::time::Duration::from_secs(3));
        cfg.validate().unwrap();
        let mut bad_token = vars.clone();
        bad_token.push(("EP_JOB_TOKEN", "hunter2"));
        let e = env.rank_config(lookup(&bad_token)).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let mut opt_out = vars;
        opt_out.push(("EP_INSECURE_NO_TOKEN", "1"));
        let cfg = env.rank_config(lookup(&opt_out)).unwrap();
        assert!(cfg.insecure_no_token);
        // Through BootstrapError.
        let e: BootstrapError = LaunchEnvError::NoLauncher.into();
        assert!(e.to_string().contains("no launcher"), "{e}");
    }

    /// Two ranks as srun would start them on two nodes, over loopback, join through the launcher
    /// path.
    #[test]
    fn two_ranks_join_through_the_launcher_environment() {
        use crate::bootstrap::Communicator as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port().to_string();
        let vars = |rank: &'static str, port: String| {
            let v = vec![
                ("SLURM_PROCID", rank.to_string()),
                ("SLURM_NTASKS", "2".into()),
                ("SLURM_LOCALID", "0".into()),
                ("SLURM_NODEID", rank.to_string()),
                ("SLURM_TASKS_PER_NODE", "1(x2)".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port),
                ("EP_JOB_TOKEN", TOKEN.into()),
                ("EP_BOOTSTRAP_TIMEOUT_S", "20".into()),
            ];
            move |k: &str| v.iter().find(|(n, _)| *n == k).map(|(_, x)| x.clone())
        };
        let p1 = port.clone();
        let member = std::thread::spawn(move || {
            let l = vars("1", p1);
            let env = LaunchEnv::from_vars(&l).unwrap();
            let comm = TcpCommunicator::connect(&env.rank_config(&l).unwrap()).unwrap();
            comm.all_gather_bytes(&[1]).unwrap()
        });
        let l = vars("0", port);
        let env = LaunchEnv::from_vars(&l).unwrap();
        let comm = TcpCommunicator::with_listener(&env.rank_config(&l).unwrap(), listener).unwrap();
        let all = comm.all_gather_bytes(&[0]).unwrap();
        assert_eq!(all, vec![vec![0], vec![1]]);
        assert_eq!(member.join().unwrap(), all);
    }
}
