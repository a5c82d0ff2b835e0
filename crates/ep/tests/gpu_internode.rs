//! Internode dispatch/combine (staged version), ranks as threads of one process on however many
//! GPUs are visible (sharing them round robin; the harness prints the mapping), split into
//! virtual nodes so every inter-node byte goes through the emulated NIC. Checked against the CPU
//! reference (`ep::internode::reference`) on fresh random inputs: layout and dispatch bit-exact,
//! combine within the rounding of the BF16 node sums. Outputs are poisoned (0xAB) first.
//!
//! Routing mixes tokens sent nowhere, tokens only to their own node, tokens to every node and
//! random tokens. Topologies (nodes × ranks per node): 2×1, 2×2, 2×4, 4×2 (`EP_TEST_RANKS`
//! narrows them to one world size); NIC-handler modes `gpu`, `cpu_host_memory` and `cpu`. With
//! `num_worst_tokens` nothing waits on the host: `gpu_internode_graph_capture_worst_tokens`
//! captures dispatch, cached dispatch and combine in a CUDA graph and replays it (2×1, 2×2). Ranks
//! as processes: `gpu_internode_procs.rs` (cases and checks shared in `gpu_internode_common`).

mod gpu_internode_common;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::internode::{InternodeBuffer, Topology};
use ep_kernels::testing::{on_rank_threads, rank_gpus, seed, Rng};
use gpu_internode_common::gpu_shared::poison_host;
use gpu_internode_common::{options, rank_rngs, rank_round, release_kept, topologies, Case, Round};
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
    let mut o = options(c, op_bound());
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
        // Every rank's round has returned: what the rounds allocated may go now.
        release_kept();
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
/// Every operation's bound: 8 s (operations here take milliseconds: a failing case, and the
/// one GPU run, stay short), or `EP_TEST_OP_BOUND_S` seconds, for a run that should still be
/// waiting when `run.sh` dumps the threads' stacks (after 25 s).
fn op_bound() -> Duration {
    std::env::var("EP_TEST_OP_BOUND_S")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(8), Duration::from_secs)
}

fn drop_all(bufs: Vec<InternodeBuffer>) {
    release_kept();
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

/// Phase timing (`record_phases`) changes nothing the operations compute (the round is checked
/// against the reference as every case is), and it names every phase of the eager dispatch,
/// cached dispatch and combine, with the puts the host planned. 2×1 and 2×2, two rounds.
#[test]
fn gpu_internode_phases() {
    let c = Case {
        cached: true,
        biases: 1,
        ..Case::new("phases")
    };
    for (nodes, rpn) in [(2, 1), (2, 2)] {
        let topo = Topology::virtual_nodes(nodes, rpn).expect("topology");
        let Some(ctxs) = rank_gpus(topo.world()) else {
            return;
        };
        let mut o = options(&c, Duration::from_secs(8));
        o.buffer.num_experts = topo.world() * c.experts_per_rank;
        let mut bufs =
            InternodeBuffer::create_group(&ctxs, &topo, &o).expect("create internode buffers");
        let s = seed();
        let mut rngs = rank_rngs(s, topo.world());
        for it in 0..c.iterations {
            let round = Round::generate(&c, &topo, &mut rngs);
            let results = on_rank_threads(&mut bufs, |r, buf| {
                let what = format!("phases it {it} rank {r} ({nodes}x{rpn})");
                buf.record_phases(true);
                rank_round(&c, r, buf, &ctxs[r], &round, &what)?;
                let phases = buf.take_phases().map_err(|e| format!("{what}: {e}"))?;
                buf.record_phases(false);
                check_phases(&phases, &what)
            });
            let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
        }
        drop_all(bufs);
    }
}

/// Every operation of an eager round has its phases, each timed, and its put to the other nodes.
fn check_phases(phases: &[ep::internode::PhaseTiming], what: &str) -> Result<(), String> {
    for op in ["dispatch", "cached dispatch", "combine"] {
        let mine: Vec<_> = phases.iter().filter(|p| p.op == op).collect();
        let names: Vec<String> = mine.iter().map(|p| p.label()).collect();
        for want in [
            "ack wait (previous op)",
            "put + quiet",
            "wait data",
            "finish",
        ] {
            if !names.iter().any(|n| n == want) {
                return Err(format!("{what}: {op} has no phase {want:?}: {names:?}"));
            }
        }
        for p in &mine {
            if !(p.gpu_us.is_finite()
                && p.gpu_us >= 0.0
                && p.host_us.is_finite()
                && p.host_us >= 0.0)
            {
                return Err(format!("{what}: {op} phase {p:?} has no time"));
            }
        }
        let put = mine
            .iter()
            .find(|p| p.name == "put + quiet")
            .expect("checked above");
        // A dispatch's ids and weights go even with no row (a padding row); a combine sends
        // nothing but its signal to a node that sent it no row.
        let bad = |c: &ep::internode::PutCount| {
            c.signal_wqes != 1 || (c.write_wqes == 0 && (op != "combine" || c.bytes != 0))
        };
        if put.puts.is_empty() || put.puts.iter().any(bad) {
            return Err(format!("{what}: {op} put {:?}", put.puts));
        }
        if put.bytes != put.puts.iter().map(|c| c.bytes).sum::<u64>() {
            return Err(format!(
                "{what}: {op} put bytes {} vs {:?}",
                put.bytes, put.puts
            ));
        }
    }
    Ok(())
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

/// Rank `r` of the graph test: the layout before the capture (fixed routing) or, with
/// `layout_in_graph`, inside it (every replay recomputes it from the ids written into the
/// captured ids tensor); dispatch (num_worst_tokens, top-k), cached dispatch and combine
/// (received weights, one bias) captured with `InternodeBuffer::capture`; then every replay in
/// `replays` with its inputs written into the captured input tensors and every output poisoned
/// from the host first, checked against the CPU reference; an eager round (`eager`, worst
/// tokens) after replay `eager_after`.
#[allow(clippy::too_many_arguments)]
fn graph_rank(
    c: &Case,
    topo: &Topology,
    r: usize,
    buf: &mut InternodeBuffer,
    ctx: &Arc<CudaContext>,
    replays: &[Round],
    eager: &Round,
    eager_after: usize,
    layout_in_graph: bool,
) -> Result<(), String> {
    use ep::internode::{InternodeCombineArgs, InternodeDispatchArgs};
    use ep::{Bf16, EpError, StreamOrder, Tensor, TopK};
    use gpu_internode_common::{rank_round, upload, Up};
    let e = |e: EpError| e.to_string();
    let first = replays[0].input(r);
    let t = first.tokens;
    let worst = topo.world() * c.max_tokens;
    let ids = upload(ctx, &first.topk_idx, &[t, c.topk])?;
    let eager_layout = if layout_in_graph {
        None
    } else {
        Some(buf.get_dispatch_layout(&ids).map_err(e)?)
    };
    let x = Up::new(ctx, c, first)?;
    let x2 = Up::new(ctx, c, replays[0].cached_input(r))?;
    let zero = Bf16::from_f32(0.0);
    let w = Tensor::filled(ctx, 0f32, &[t, c.topk]).map_err(e)?;
    let y = Tensor::filled(ctx, zero, &[worst, c.hidden]).map_err(e)?;
    let yw = Tensor::filled(ctx, 0f32, &[worst, c.topk]).map_err(e)?;
    let bias = Tensor::filled(ctx, zero, &[t, c.hidden]).map_err(e)?;

    let (graph, (dout, cached, comb, refused, _layout)) = buf
        .capture(|b| {
            if !b.is_capturing()? {
                return Err(EpError::InvalidArgument {
                    rank: r,
                    what: "the buffer does not see its stream capturing".into(),
                });
            }
            let layout = match &eager_layout {
                Some(l) => l.clone(),
                None => b.get_dispatch_layout(&ids)?,
            };
            // Host waits are refused under capture (checked before anything is queued).
            let mut args = InternodeDispatchArgs {
                x: x.x(),
                layout: &layout,
                topk: TopK {
                    idx: &ids,
                    weights: &w,
                },
                num_worst_tokens: None,
                expert_alignment: c.alignment,
                order: StreamOrder::default(),
            };
            let refused = b.synchronize().is_err() && b.dispatch(&args).is_err();
            args.num_worst_tokens = Some(worst);
            let d = b.dispatch(&args)?;
            let cd = b.dispatch_cached(x2.x(), &d.handle, &StreamOrder::default())?;
            let comb = b.combine(&InternodeCombineArgs {
                x: &y,
                handle: &d.handle,
                topk_weights: Some(&yw),
                bias: [Some(&bias), None],
                order: StreamOrder::default(),
            })?;
            Ok((d, cd, comb, refused, layout))
        })
        .map_err(|e| format!("rank {r}: capture: {e}"))?;
    if !refused {
        return Err(
            "synchronize or dispatch without num_worst_tokens accepted under capture".into(),
        );
    }
    // Every output tensor, poisoned before each replay.
    let poison_recv = |x: &ep::RecvX| -> Result<(), String> {
        match x {
            ep::RecvX::Bf16(t) => poison_host(t),
            ep::RecvX::Fp8 { x, scales } => {
                poison_host(x)?;
                poison_host(scales)
            }
        }
    };
    let recv_idx = dout.topk_idx.as_ref().ok_or("no topk_idx")?;
    let recv_w = dout.topk_weights.as_ref().ok_or("no topk_weights")?;
    let per_expert = dout
        .recv_tokens_per_expert
        .as_ref()
        .ok_or("no device per-expert counts")?;
    let out_w = comb.topk_weights.as_ref().ok_or("no combined weights")?;

    for (k, rp) in replays.iter().enumerate() {
        let what = format!(
            "graph replay {k} rank {r} ({}x{})",
            topo.nodes(),
            topo.ranks_per_node()
        );
        let inp = rp.input(r);
        for (up, i) in [(&x, inp), (&x2, rp.cached_input(r))] {
            match up {
                Up::Bf16(a) => a.copy_from_host(bytemuck::cast_slice(&i.x)).map_err(e)?,
                Up::Fp8(a, sc) => {
                    a.copy_from_host(bytemuck::cast_slice(&i.x)).map_err(e)?;
                    sc.copy_from_host(&i.scales).map_err(e)?;
                }
            }
        }
        w.copy_from_host(&inp.weights).map_err(e)?;
        if layout_in_graph {
            ids.copy_from_host(&inp.topk_idx).map_err(e)?;
        }
        let (cin, biases) = rp.combine_input(r);
        let mut cx = cin.x.clone();
        let mut cw = cin.weights.clone();
        // Worst-token padding rows: anything (they are not summed).
        cx.resize(worst * c.hidden, Bf16::from_f32(7.0));
        cw.resize(worst * c.topk, 3.0);
        y.copy_from_host(&cx).map_err(e)?;
        yw.copy_from_host(&cw).map_err(e)?;
        bias.copy_from_host(biases[0].as_ref().ok_or("the graph case has one bias")?)
            .map_err(e)?;
        poison_recv(&dout.x)?;
        poison_recv(&cached.x)?;
        poison_host(&comb.x)?;
        poison_host(recv_idx)?;
        poison_host(per_expert)?;
        poison_host(recv_w)?;
        poison_host(out_w)?;
        // The uploads ran on the legacy stream; the graph runs on the buffer's stream. Only the
        // legacy stream is waited for: a whole-context synchronize would also wait for the
        // graphs of ranks sharing this GPU, which wait for this rank's.
        ctx.default_stream()
            .synchronize()
            .map_err(|e| format!("cuStreamSynchronize(legacy): {e:?}"))?;
        graph.replay().map_err(|e| format!("{what}: {e}"))?;
        buf.synchronize().map_err(|e| format!("{what}: {e}"))?;
        let gx = comb.x.to_host().map_err(e)?;
        let gw = out_w.to_host().map_err(e)?;
        rp.check_rank(c, r, &dout, Some(&cached), (&gx, &gw), Some(worst), &what)?;
        if k == eager_after {
            // Eager calls between replays: the sequence numbers are counted on the GPU, so
            // both kinds keep every rank's signals paired.
            rank_round(
                c,
                r,
                buf,
                ctx,
                eager,
                &format!("eager after replay {k} rank {r}"),
            )?;
        }
    }
    drop(graph);
    Ok(())
}

/// The graph test on 2×1 and 2×2 (`EP_TEST_RANKS` narrows them): five replays, an eager round
/// after the second. With `layout_in_graph`, the layout is captured too and every replay routes
/// anew (same token counts); otherwise the routing is the first round's.
fn graph_case(name: &'static str, layout_in_graph: bool, fp8: bool) {
    let graph_topos: Vec<(usize, usize)> = topologies()
        .into_iter()
        .filter(|t| matches!(t, (2, 1) | (2, 2)))
        .collect();
    if graph_topos.is_empty() {
        eprintln!("SKIPPED (EP_TEST_RANKS keeps neither 2x1 nor 2x2): {name}");
        return;
    }
    let c = Case {
        worst: true,
        cached: true,
        biases: 1,
        alignment: 4,
        fp8,
        hidden: if fp8 { 512 } else { 1024 },
        ..Case::new(name)
    };
    for (nodes, rpn) in graph_topos {
        let topo = Topology::virtual_nodes(nodes, rpn).expect("topology");
        let Some(ctxs) = rank_gpus(topo.world()) else {
            return;
        };
        let world = topo.world();
        let s = seed();
        let mut rngs = rank_rngs(s, world);
        let mut replays = vec![Round::generate(&c, &topo, &mut rngs)];
        for _ in 1..5 {
            let next = if layout_in_graph {
                Round::with_tokens_of(&c, &topo, &replays[0], &mut rngs)
            } else {
                Round::with_routing_of(&c, &topo, &replays[0], &mut rngs)
            };
            replays.push(next);
        }
        let eager = Round::generate(&c, &topo, &mut rngs);
        let mut o = options(&c, Duration::from_secs(8));
        o.buffer.num_experts = world * c.experts_per_rank;
        // The graph's dispatch and cached dispatch outputs stay alive, beside the eager round's.
        o.buffer.max_live_outputs = 4;
        let mut bufs =
            InternodeBuffer::create_group(&ctxs, &topo, &o).expect("create internode buffers");
        let results = on_rank_threads(&mut bufs, |r, buf| {
            graph_rank(
                &c,
                &topo,
                r,
                buf,
                &ctxs[r],
                &replays,
                &eager,
                1,
                layout_in_graph,
            )
        });
        let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        assert!(failures.is_empty(), "seed {s}: {}", failures.join("\n"));
        drop_all(bufs);
        eprintln!(
            "{name} on {nodes}x{rpn}: {} replays and an eager round match the reference",
            replays.len()
        );
    }
}

/// Dispatch (num_worst_tokens) + cached dispatch + combine captured in a CUDA graph on each
/// rank's communication stream, with no host synchronisation inside; replayed five times with
/// fresh rows, weights, combine inputs and biases written into the captured tensors (the routing
/// is the layout's, computed before the capture), every output poisoned before each replay and
/// checked against the CPU reference; an eager worst-token round between replays. Topologies
/// 2×1 and 2×2, ranks as threads sharing the visible GPUs.
#[test]
fn gpu_internode_graph_capture_worst_tokens() {
    graph_case("gpu_internode_graph_capture_worst_tokens", false, false);
}

/// As `gpu_internode_graph_capture_worst_tokens` with FP8 rows and their scales.
#[test]
fn gpu_internode_graph_capture_worst_tokens_fp8() {
    graph_case("gpu_internode_graph_capture_worst_tokens_fp8", false, true);
}

/// As `gpu_internode_graph_capture_worst_tokens`, with the layout captured too: every replay
/// recomputes it from fresh top-k ids written into the captured ids tensor (routing changes
/// from replay to replay, as a model's does from step to step).
#[test]
fn gpu_internode_graph_capture_layout_fresh_routing() {
    graph_case(
        "gpu_internode_graph_capture_layout_fresh_routing",
        true,
        false,
    );
}

/// With `num_worst_tokens` below what arrives, nothing waits on the host: every rank's dispatch
/// returns at once, and the overflow (or, on the ranks it stalls, a peer's bounded wait) is
/// reported by `synchronize` within the bound, naming what ran out. 2×1.
#[test]
fn gpu_internode_worst_tokens_exceeded_is_reported_by_synchronize() {
    use ep::internode::InternodeDispatchArgs;
    use ep::{EpError, StreamOrder, TopK};
    use gpu_internode_common::{upload, Up};
    let topo = Topology::virtual_nodes(2, 1).expect("topology");
    let Some(ctxs) = rank_gpus(topo.world()) else {
        return;
    };
    let c = Case::new("worst_exceeded");
    let mut o = options(&c, Duration::from_secs(2));
    o.buffer.num_experts = topo.world() * c.experts_per_rank;
    let mut bufs =
        InternodeBuffer::create_group(&ctxs, &topo, &o).expect("create internode buffers");
    let world = topo.world();
    let started = std::time::Instant::now();
    let results = on_rank_threads(&mut bufs, |r, buf| {
        let ctx = &ctxs[r];
        // Every token to an expert of every rank: each rank receives 16 rows, 1 fits.
        let t = 16;
        let ids: Vec<i32> = (0..t)
            .flat_map(|_| {
                let mut row: Vec<i32> = (0..world)
                    .map(|d| (d * c.experts_per_rank) as i32)
                    .collect();
                row.resize(c.topk, -1);
                row
            })
            .collect();
        let inp = ep::reference::RankInput {
            tokens: t,
            row_bytes: c.hidden * 2,
            x: vec![0u8; t * c.hidden * 2],
            scale_words: 0,
            scales: Vec::new(),
            topk: c.topk,
            topk_idx: ids,
            weights: vec![0.5; t * c.topk],
        };
        let idx = upload(ctx, &inp.topk_idx, &[t, c.topk])?;
        let w = upload(ctx, &inp.weights, &[t, c.topk])?;
        let layout = buf.get_dispatch_layout(&idx).map_err(|e| e.to_string())?;
        let x = Up::new(ctx, &c, &inp)?;
        let out = buf
            .dispatch(&InternodeDispatchArgs {
                x: x.x(),
                layout: &layout,
                topk: TopK {
                    idx: &idx,
                    weights: &w,
                },
                num_worst_tokens: Some(1),
                expert_alignment: 1,
                order: StreamOrder::default(),
            })
            .map_err(|e| format!("rank {r}: the dispatch itself must not fail: {e}"))?;
        drop(out);
        match buf.synchronize() {
            Ok(()) => Err(format!("rank {r}: 16 rows into 1 reported nothing")),
            Err(e) => Ok(e),
        }
    });
    let elapsed = started.elapsed();
    let errs: Vec<EpError> = results
        .into_iter()
        .map(|r| r.expect("every rank reports an error"))
        .collect();
    for (r, e) in errs.iter().enumerate() {
        eprintln!("rank {r}: {e}");
        assert!(
            matches!(
                e,
                EpError::WorstTokensExceeded { .. } | EpError::PeerTimeout { .. }
            ),
            "rank {r}: {e}"
        );
    }
    assert!(
        errs.iter()
            .any(|e| matches!(e, EpError::WorstTokensExceeded { worst: 1, .. })),
        "nobody reported the overflow"
    );
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    drop_all(bufs);
}
