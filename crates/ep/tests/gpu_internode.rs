//! Internode dispatch/combine (staged version), ranks as threads of one process on however many
//! GPUs are visible (sharing them round robin; the harness prints the mapping), split into
//! virtual nodes so every inter-node byte goes through the emulated NIC. Checked against the CPU
//! reference (`ep::internode::reference`) on fresh random inputs: layout and dispatch bit-exact,
//! combine within the rounding of the BF16 node sums. Outputs are poisoned (0xAB) first.
//!
//! Routing mixes tokens sent nowhere, tokens only to their own node, tokens to every node and
//! random tokens. Topologies (nodes × ranks per node): 2×1, 2×2, 2×4, 4×2 (`EP_TEST_RANKS`
//! narrows them to one world size); NIC-handler modes `gpu`, `cpu_host_memory` and `cpu`. Ranks
//! as processes: `gpu_internode_procs.rs` (cases and checks shared in `gpu_internode_common`).

mod gpu_internode_common;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::internode::{InternodeBuffer, Topology};
use ep_kernels::testing::{on_rank_threads, rank_gpus, seed, Rng};
use gpu_internode_common::{options, rank_rngs, rank_round, topologies, Case, Round};
use ibgda_device::protocol::HandlerChoice;

fn run_case(c: &Case) {
    for (nodes, rpn) in topologies() {
        let topo = Topology::virtual_nodes(nodes, rpn).expect("topology");
        let Some(ctxs) = rank_gpus(topo.world()) else {
            return;
        };
        run_on(c, &topo, &ctxs);
    }
}

fn run_on(c: &Case, topo: &Topology, ctxs: &[Arc<CudaContext>]) {
    let world = topo.world();
    let s = seed();
    eprintln!(
        "case {} on {} nodes × {} ranks: {c:?}",
        c.name,
        topo.nodes(),
        topo.ranks_per_node()
    );
    // Every operation here takes milliseconds: a bound of seconds keeps a failing case (and the
    // one GPU run) short.
    let mut o = options(c, Duration::from_secs(8));
    o.buffer.num_experts = world * c.experts_per_rank;
    let mut bufs = InternodeBuffer::create_group(ctxs, topo, &o).expect("create internode buffers");
    if let Some(d) = c.delay_completions {
        for b in &bufs {
            b.set_fault_plan(ibgda_emu::FaultPlan::default().delay_completions(d))
                .expect("fault plan");
        }
    }
    let mut rngs = rank_rngs(s, world);
    for it in 0..c.iterations {
        let round = Round::generate(c, topo, &mut rngs);
        let results = on_rank_threads(&mut bufs, |r, buf| {
            let what = format!(
                "{} it {it} rank {r} ({}x{})",
                c.name,
                topo.nodes(),
                topo.ranks_per_node()
            );
            rank_round(c, r, buf, &ctxs[r], &round, &what)
        });
        let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
    }
    drop_all(bufs);
    eprintln!(
        "case {} on {}x{}: {} iteration(s) match the reference",
        c.name,
        topo.nodes(),
        topo.ranks_per_node(),
        c.iterations
    );
}

/// Drops every rank's buffer at once (the teardown is a collective).
fn drop_all(bufs: Vec<InternodeBuffer>) {
    std::thread::scope(|sc| {
        for b in bufs {
            sc.spawn(move || drop(b));
        }
    });
}

#[test]
fn gpu_internode_bf16() {
    run_case(&Case {
        biases: 2,
        alignment: 4,
        ..Case::new("bf16")
    });
}

#[test]
fn gpu_internode_fp8() {
    run_case(&Case {
        fp8: true,
        hidden: 512,
        ..Case::new("fp8")
    });
}

#[test]
fn gpu_internode_cached_worst() {
    run_case(&Case {
        cached: true,
        worst: true,
        biases: 1,
        ..Case::new("cached_worst")
    });
}

#[test]
fn gpu_internode_fp8_cached() {
    run_case(&Case {
        fp8: true,
        hidden: 512,
        cached: true,
        ..Case::new("fp8_cached")
    });
}

#[test]
fn gpu_internode_cpu_host_memory() {
    run_case(&Case {
        handler: HandlerChoice::CpuHostMemory,
        biases: 1,
        ..Case::new("cpu_host_memory")
    });
}

/// Mode `cpu`: producer slots in GPU memory, read by the proxy through GDRCopy or, on the
/// emulated NIC without it, the emulated GDR view (`ibgda_gdr::CopyMirror`).
#[test]
fn gpu_internode_cpu() {
    run_case(&Case {
        handler: HandlerChoice::Cpu,
        biases: 1,
        cached: true,
        ..Case::new("cpu")
    });
}

/// Imbalanced routing: most tokens of every rank go to one expert on node 0.
#[test]
fn gpu_internode_imbalanced() {
    run_case(&Case {
        hot_expert: true,
        iterations: 1,
        ..Case::new("imbalanced")
    });
}

/// Every completion arrives late: each quiet must still wait for the NIC before a slot is
/// rewritten (three rounds back to back reuse every slot).
#[test]
fn gpu_internode_delayed_completions() {
    run_case(&Case {
        iterations: 3,
        cached: true,
        delay_completions: Some(Duration::from_millis(2)),
        ..Case::new("delayed_completions")
    });
}

/// One rank never dispatches: its rail peers on the other nodes time out naming it, and every
/// rank that called returns an `Err` within the bound (none hangs).
#[test]
fn gpu_internode_missing_rank_times_out() {
    let topo = Topology::virtual_nodes(2, 2).expect("topology");
    let Some(ctxs) = rank_gpus(topo.world()) else {
        return;
    };
    let c = Case::new("missing_rank");
    let mut o = options(&c, Duration::from_secs(2));
    o.buffer.num_experts = topo.world() * c.experts_per_rank;
    let mut bufs =
        InternodeBuffer::create_group(&ctxs, &topo, &o).expect("create internode buffers");
    let s = seed();
    let mut rngs: Vec<Rng> = (0..topo.world())
        .map(|r| Rng::new(s ^ (r as u64 + 7)))
        .collect();
    let round = Round::generate(&c, &topo, &mut rngs);
    let missing = topo.world() - 1;
    let started = std::time::Instant::now();
    let results: Vec<Option<Result<(), String>>> = std::thread::scope(|sc| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, buf)| {
                let (round, ctx, c) = (&round, ctxs[r].clone(), &c);
                sc.spawn(move || {
                    (r != missing).then(|| rank_round(c, r, buf, &ctx, round, &format!("rank {r}")))
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap_or(Some(Err("panicked".into()))))
            .collect()
    });
    let elapsed = started.elapsed();
    eprintln!("missing rank {missing}: the others returned after {elapsed:?}");
    for (r, res) in results.iter().enumerate() {
        match res {
            None => assert_eq!(r, missing),
            Some(Ok(())) => panic!("rank {r} completed although rank {missing} never dispatched"),
            Some(Err(e)) => {
                eprintln!("rank {r}: {e}");
                // The rail peer on the other node waited for the missing rank's rows; where
                // ranks share a GPU they meet before every waiting launch, and the gate names
                // the rank that never came.
                if topo.rdma_peer(missing, 0).ok() == Some(r) {
                    assert!(
                        e.contains(&format!("waiting for rank {missing}"))
                            || e.contains(&format!("rank {missing} sharing GPU")),
                        "rank {r}: {e}"
                    );
                }
            }
        }
    }
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    drop_all(bufs);
}

/// An error completion on rank 0's QP to its rail peer: rank 0's dispatch is an `Err` that
/// carries the syndrome; every other rank returns an `Err` within the bound.
#[test]
fn gpu_internode_error_cqe_is_an_err_with_its_syndrome() {
    let topo = Topology::virtual_nodes(2, 1).expect("topology");
    let Some(ctxs) = rank_gpus(topo.world()) else {
        return;
    };
    let c = Case::new("error_cqe");
    let mut o = options(&c, Duration::from_secs(2));
    o.buffer.num_experts = topo.world() * c.experts_per_rank;
    let mut bufs =
        InternodeBuffer::create_group(&ctxs, &topo, &o).expect("create internode buffers");
    let peer = topo.rdma_peer(0, 1).expect("rail peer");
    let qpns = bufs[0].transport_qps();
    assert!(!qpns[peer].is_empty(), "{qpns:?}");
    let plan = qpns[peer]
        .iter()
        .fold(ibgda_emu::FaultPlan::default(), |p, &q| {
            p.fail_wqe(q, 1, ibgda_device::wire::syndrome::REMOTE_ACCESS_ERR)
        });
    bufs[0].set_fault_plan(plan).expect("fault plan");
    let s = seed();
    let mut rngs: Vec<Rng> = (0..topo.world())
        .map(|r| Rng::new(s ^ (r as u64 + 3)))
        .collect();
    let round = Round::generate(&c, &topo, &mut rngs);
    let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
        let joins: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, buf)| {
                let (round, ctx, c) = (&round, ctxs[r].clone(), &c);
                sc.spawn(move || rank_round(c, r, buf, &ctx, round, &format!("rank {r}")))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap_or_else(|_| Err("panicked".into())))
            .collect()
    });
    for (r, res) in results.iter().enumerate() {
        let e = res.as_ref().expect_err("an error CQE must fail every rank");
        eprintln!("rank {r}: {e}");
    }
    let e0 = results[0].as_ref().unwrap_err();
    assert!(
        e0.contains("REMOTE_ACCESS_ERR") || e0.contains("syndrome 0x13"),
        "rank 0: {e0}"
    );
    drop_all(bufs);
}
