//! Internode dispatch/combine with ranks as processes: the `Launcher` re-executes this test once
//! per rank (round robin over the visible GPUs, sharing them where there are fewer: processes
//! time-slice a GPU; TCP rendezvous). Each rank reads its place from the launcher's environment
//! (`LaunchEnv`, as under torchrun), splits the one host into virtual nodes
//! (`Topology::from_launch`) and builds its own `InternodeBuffer::new`: the NVLink hop over its
//! node's ranks only (a `SubGroup` of the job, windows shared through CUDA IPC), the RDMA hop
//! through this process's emulated NIC, QPs to every other rank connected through the job's
//! communicator.
//!
//! Checked against the CPU reference with the cases and checks of the threads test
//! (`gpu_internode.rs`, shared in `gpu_internode_common`): every rank draws every rank's inputs
//! from the seed the launcher passes on (`EP_TEST_SEED`), runs its own part and checks its own
//! results. Topologies (nodes × ranks per node) 2×1 and 2×2; NIC-handler mode `gpu` on BF16,
//! FP8, cached and worst-token cases, modes `cpu_host_memory` and `cpu` on one case each, and a
//! topology that does not match the job refused on every rank before any collective.

mod gpu_internode_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ep::bootstrap::{Communicator, LaunchEnv, Launcher, TcpCommunicator};
use ep::internode::{InternodeBuffer, Topology};
use ep::EpError;
use ep_kernels::testing::{aux, rank_context, rank_gpus, seed};
use gpu_internode_common::{options, rank_rngs, rank_round, Case, Round};
use ibgda_device::protocol::HandlerChoice;

/// Below the device suite's 300 s per test, so a stuck launch is reported by the launcher, with
/// every rank's state, rather than killed by the suite.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(270);

/// The bound of every wait of a case: operations take milliseconds (more when processes
/// time-slice one GPU), so a failing case ends in seconds.
const CASE_TIMEOUT: Duration = Duration::from_secs(10);

type Res = Result<(), String>;

/// One rank: its communicator, its GPU, the job's seed and the topology it read from the
/// launcher's environment.
struct Rank {
    comm: Arc<TcpCommunicator>,
    ctx: Arc<CudaContext>,
    seed: u64,
    topo: Topology,
}

impl Rank {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// "`what` rank r (NxR, processes)", for messages.
    fn name(&self, what: impl std::fmt::Display) -> String {
        format!(
            "{what} rank {} ({}x{}, processes)",
            self.rank(),
            self.topo.nodes(),
            self.topo.ranks_per_node()
        )
    }
}

/// Runs `body` as `nodes × rpn` processes (this test binary re-executed, running only `test`),
/// the host split into virtual nodes of `rpn` ranks.
fn launch(nodes: usize, rpn: usize, test: &str, body: fn(&Rank) -> Res) {
    let world = nodes * rpn;
    if Launcher::is_rank_process() {
        aux(&format!(
            "a rank process of {test}: its parent runs the case"
        ));
    } else if rank_gpus(world).is_none() {
        // The launcher checks the machine; a rank opens only its own GPU.
        return;
    }
    let s = seed();
    let r = Launcher::new(world)
        .libtest(test)
        .env("EP_TEST_SEED", s.to_string())
        .timeout(LAUNCH_TIMEOUT)
        .run_shared(|comm| -> Res {
            if comm.same_process() {
                return Err("a TCP rank claims to share the process with its peers".into());
            }
            // Where this rank is, as a launcher says it (the project's Launcher sets torchrun's
            // variables: one host), split into virtual nodes of `rpn`.
            let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
            if (env.rank, env.world) != (comm.rank(), comm.world_size()) {
                return Err(format!(
                    "the launcher's environment says rank {} of {}, the group {} of {}",
                    env.rank,
                    env.world,
                    comm.rank(),
                    comm.world_size()
                ));
            }
            let topo = Topology::from_launch(&env, Some(rpn)).map_err(|e| e.to_string())?;
            if (topo.nodes(), topo.ranks_per_node()) != (nodes, rpn) {
                return Err(format!("topology {topo:?} from the environment {env:?}"));
            }
            let ctx = rank_context(comm.local_rank()).map_err(|e| e.to_string())?;
            let t0 = Instant::now();
            let rank = Rank {
                comm,
                ctx,
                seed: s,
                topo,
            };
            body(&rank)?;
            eprintln!(
                "{}: passed in {:.1} s",
                rank.name(test),
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        });
    if let Err(e) = r {
        panic!("seed {s}: {e}");
    }
}

/// One case on a fresh buffer: every iteration runs on every rank whatever an earlier one gave
/// (the ranks stay in step), then the buffer is shut down together; the first error.
fn run_case(me: &Rank, c: &Case, part: u64) -> Res {
    let t0 = Instant::now();
    let topo = me.topo;
    let world = topo.world();
    let mut o = options(c, CASE_TIMEOUT);
    o.buffer.num_experts = world * c.experts_per_rank;
    let mut buf = InternodeBuffer::new(&me.ctx, me.comm.clone(), &topo, &o)
        .map_err(|e| format!("{}: {e}", me.name(format_args!("{} create", c.name))))?;
    let mut rngs = rank_rngs(me.seed ^ ((part + 1) << 40), world);
    let mut first: Res = Ok(());
    for it in 0..c.iterations {
        let round = Round::generate(c, &topo, &mut rngs);
        let what = me.name(format_args!("{} it {it}", c.name));
        if let Err(e) = rank_round(c, me.rank(), &mut buf, &me.ctx, &round, &what) {
            eprintln!("{e}");
            first = first.and(Err(e));
        }
    }
    let down = buf
        .shutdown()
        .map_err(|e| format!("{}: {e}", me.name(format_args!("{} shutdown", c.name))));
    first.and(down)?;
    eprintln!(
        "{}: {} iteration(s) match the reference ({:.0} ms)",
        me.name(c.name),
        c.iterations,
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// Mode `gpu`: BF16 with biases and expert alignment, FP8 with a cached dispatch, worst-token
/// padding with a cached dispatch.
fn gpu_cases() -> Vec<Case> {
    vec![
        Case {
            biases: 2,
            alignment: 4,
            ..Case::new("bf16")
        },
        Case {
            fp8: true,
            hidden: 512,
            cached: true,
            ..Case::new("fp8_cached")
        },
        Case {
            cached: true,
            worst: true,
            biases: 1,
            ..Case::new("cached_worst")
        },
    ]
}

fn gpu_mode_rank(me: &Rank) -> Res {
    gpu_cases()
        .iter()
        .enumerate()
        .try_for_each(|(i, c)| run_case(me, c, i as u64))
}

/// Modes `cpu_host_memory` and `cpu` (producer slots in GPU memory, read through the emulated
/// GDR view where GDRCopy is missing), one case each; then a topology that does not match the
/// job, refused on every rank alike before any collective.
fn other_modes_rank(me: &Rank) -> Res {
    for (i, handler) in [HandlerChoice::CpuHostMemory, HandlerChoice::Cpu]
        .into_iter()
        .enumerate()
    {
        let c = Case {
            handler,
            biases: 1,
            cached: true,
            ..Case::new(match handler {
                HandlerChoice::Cpu => "cpu",
                _ => "cpu_host_memory",
            })
        };
        run_case(me, &c, 10 + i as u64)?;
    }
    let wrong = Topology::virtual_nodes(me.topo.nodes() + 1, me.topo.ranks_per_node())
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut o = options(&Case::new("wrong topology"), CASE_TIMEOUT);
    o.buffer.num_experts = wrong.world() * 4;
    match InternodeBuffer::new(&me.ctx, me.comm.clone(), &wrong, &o) {
        Err(EpError::InvalidArgument { what, .. })
            if what.contains("group members") && t0.elapsed() < Duration::from_secs(2) =>
        {
            eprintln!("{}: {what}", me.name("a topology the job does not match"));
            Ok(())
        }
        Err(e) => Err(format!("wrong topology: unexpected error {e}")),
        Ok(_) => Err("a topology the job does not match was built".into()),
    }
}

#[test]
fn gpu_internode_procs_2x1() {
    launch(2, 1, "gpu_internode_procs_2x1", gpu_mode_rank);
}

#[test]
fn gpu_internode_procs_2x2() {
    launch(2, 2, "gpu_internode_procs_2x2", gpu_mode_rank);
}

#[test]
fn gpu_internode_procs_modes_2x1() {
    launch(2, 1, "gpu_internode_procs_modes_2x1", other_modes_rank);
}

#[test]
fn gpu_internode_procs_modes_2x2() {
    launch(2, 2, "gpu_internode_procs_modes_2x2", other_modes_rank);
}
