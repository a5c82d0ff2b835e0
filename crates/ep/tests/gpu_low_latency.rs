//! Low-latency dispatch/combine, ranks as threads of one process over NVLink, against the CPU
//! reference (`ep::low_latency::reference`) on fresh random data: dispatch bit-exact (rows,
//! FP8 values and scales, counts, layout, source tokens), combine within one BF16 unit (the
//! reference makes the same f32 fused multiply-adds in the same order). Outputs are poisoned
//! (0xAB) before every operation. Each case runs at EP2, EP4 and EP8 on however many GPUs are
//! visible, ranks sharing them round robin: every hidden size of the issue, top-k up to 11, BF16
//! / FP8 / power-of-two / UE8M0, hook mode, zero-copy combine, CUDA-graph capture and replay, a bounded-wait timeout
//! that names rank, peer and expert, and repeated create / use / teardown; outputs written into
//! the caller's tensors (`recv_into`, `recv_count_into`, `out_into`) and their argument checks.
//!
//! With NVLink disabled (every byte to another rank through the IBGDA transport on the emulated
//! NIC): a representative matrix (hidden 2048 and 7168, BF16 and FP8, top-1 and top-8, hook on
//! and off) in NIC-handler modes `gpu` and `cpu_host_memory`, mode `cpu` failing cleanly where
//! GDRCopy is missing, and create / dispatch / combine / teardown 20 times in a row per mode.
//!
//! Ranks as processes: `gpu_low_latency_procs.rs` (NVLink, same cases and checks, shared in
//! `gpu_low_latency_common`).

mod gpu_low_latency_common;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::low_latency::{
    Fp8Options, LlCombineArgs, LlCombineX, LlDispatchArgs, LlRecvInto, LowLatencyBuffer,
    LowLatencyOptions,
};
use ep::transport::RingPlacement;
use ep::{Bf16, EpError, Fp8E4M3, Tensor};
use ep_kernels::testing::{rank_gpus, seed, Rng};
use gpu_low_latency_common::{
    cases, check, graph_case, graph_rank, graph_rounds, on_ranks, options, random_data,
    read_dispatch, run_case, transport_options, two_in_flight, two_in_flight_case, Case, RankData,
    RankResult, MAX_TOKENS, TRANSPORT_MODES,
};
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;

/// Every matrix runs at each of these, on however many GPUs there are (ranks share them).
const RANK_COUNTS: [usize; 3] = [2, 4, 8];

fn group(ctxs: &[Arc<CudaContext>], opts: &LowLatencyOptions) -> Vec<LowLatencyBuffer> {
    LowLatencyBuffer::create_group(ctxs, opts).expect("creating the low-latency buffers")
}

#[test]
fn dispatch_combine_match_reference() {
    let mut rng = Rng::new(seed());
    for ranks in ep_kernels::testing::rank_counts(&RANK_COUNTS) {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        run_matrix(&ctxs, ranks, &mut rng);
    }
}

/// Tears every rank's buffer down at once (teardown is a collective), each must succeed.
fn shutdown_all(bufs: Vec<LowLatencyBuffer>) {
    std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        for (r, j) in joins.into_iter().enumerate() {
            j.join()
                .expect("teardown panicked")
                .unwrap_or_else(|e| panic!("rank {r}: teardown: {e}"));
        }
    });
}

fn run_matrix(ctxs: &[Arc<CudaContext>], ranks: usize, rng: &mut Rng) {
    let t_group = std::time::Instant::now();
    let mut bufs = group(ctxs, &options(ranks));
    eprintln!("EP{ranks}: group created in {:.2?}", t_group.elapsed());
    for (i, c) in cases().into_iter().enumerate() {
        let t_case = std::time::Instant::now();
        let data = random_data(rng, ranks, c.hidden, c.topk, None);
        let t_ranks = std::time::Instant::now();
        let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        let ranks_time = t_ranks.elapsed();
        let t_check = std::time::Instant::now();
        check(ranks, &c, &data, &res, &format!("EP{ranks} {c:?}"));
        eprintln!(
            "EP{ranks} case {i} passed in {:.2?} (ranks {ranks_time:.2?}, check {:.2?}): {c:?}",
            t_case.elapsed(),
            t_check.elapsed()
        );
    }
    // Back-to-back dispatches in hook mode: both sends first, then both receives (two results
    // held at once, one per half), then both combines.
    let c = two_in_flight_case();
    let d1 = random_data(rng, ranks, c.hidden, c.topk, None);
    let d2 = random_data(rng, ranks, c.hidden, c.topk, None);
    let res: Vec<(RankResult, RankResult)> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        two_in_flight(b, &d1[r], &d2[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    let (r1, r2): (Vec<_>, Vec<_>) = res.into_iter().unzip();
    check(
        ranks,
        &c,
        &d1,
        &r1,
        &format!("EP{ranks} two in flight, first"),
    );
    check(
        ranks,
        &c,
        &d2,
        &r2,
        &format!("EP{ranks} two in flight, second"),
    );
    shutdown_all(bufs);
    eprintln!("EP{ranks}: {} cases passed", cases().len() + 1);
}

/// Dispatch + combine captured into one graph per rank (one plain, one in hook mode), replayed
/// with fresh data written into the captured inputs before each replay.
#[test]
fn cuda_graph_replays_match_reference() {
    let mut rng = Rng::new(seed());
    for ranks in ep_kernels::testing::rank_counts(&RANK_COUNTS) {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        let mut bufs = group(&ctxs, &options(ranks));
        for hook in [false, true] {
            let c = graph_case(hook);
            // Fixed token counts per rank (captured), fresh contents per replay.
            let rounds: Vec<Vec<RankData>> = graph_rounds(&mut rng, ranks, &c);
            let res: Vec<Vec<RankResult>> = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                let mine: Vec<RankData> = rounds.iter().map(|v| v[r].clone()).collect();
                graph_rank(b, &mine, &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
            });
            let mut res = res;
            for (i, data) in rounds.iter().enumerate() {
                let per_rank: Vec<RankResult> =
                    res.iter_mut().map(|v| std::mem::take(&mut v[i])).collect();
                check(
                    ranks,
                    &c,
                    data,
                    &per_rank,
                    &format!("EP{ranks} graph hook={hook} replay {i}"),
                );
            }
        }
        shutdown_all(bufs);
    }
}

/// A rank that never joins: the others' receive wait runs out and the `Err` names the rank, the
/// peer and the expert; teardown still succeeds everywhere after.
#[test]
fn a_missing_rank_times_out_with_a_named_error() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut rng = Rng::new(seed());
    let mut o = options(2);
    o.timeout = Duration::from_secs(2);
    let mut bufs = group(&ctxs, &o);
    let data = random_data(&mut rng, 2, 2048, 4, Some(16));
    let errs: Vec<Option<String>> = on_ranks(&mut bufs, |b| {
        if b.rank() == 1 {
            return None;
        }
        let ctx = b.context().clone();
        let d = &data[0];
        let x = Tensor::from_host(&ctx, &d.x, &[16, 2048]).unwrap();
        let idx = Tensor::from_host(&ctx, &d.idx, &[16, 4]).unwrap();
        // Ranks sharing a GPU meet on the host before every launch: there rank 0 is stopped,
        // naming rank 1, before it launches anything. On their own GPUs the kernel's wait runs
        // out instead.
        let shared = b.gpu_share().threads.len() > 1;
        let e = match b.dispatch(&LlDispatchArgs::new(&x, &idx)) {
            Err(e @ EpError::SharedGpuTimeout { .. }) if shared => e,
            Err(e) => panic!("dispatch failed: {e}"),
            Ok(_) if shared => panic!("a dispatch on a shared GPU without its peer launched"),
            Ok(out) => {
                let e = b
                    .synchronize()
                    .expect_err("rank 1 never sent: the wait must run out");
                drop(out);
                e
            }
        };
        // The buffer stays poisoned: no more work is queued on it.
        assert!(matches!(
            b.dispatch(&LlDispatchArgs::new(&x, &idx)),
            Err(EpError::Poisoned { .. })
        ));
        Some(e.to_string())
    });
    let shared_gpu = ctxs[0].cu_device() == ctxs[1].cu_device();
    let msg = errs[0].clone().expect("rank 0 reports");
    eprintln!("rank 0: {msg}");
    assert!(msg.contains("rank 0") && msg.contains("rank 1"), "{msg}");
    assert!(
        msg.contains("local expert") || msg.contains("sharing GPU"),
        "{msg}"
    );
    // Teardown: rank 0 reports its recorded error again, rank 1 is clean; both free and return.
    std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        let r: Vec<_> = joins
            .into_iter()
            .map(|j| j.join().expect("no panic"))
            .collect();
        // (Stopped at the launch gate, rank 0 recorded nothing on the device to report.)
        assert!(
            r[0].is_err() || shared_gpu,
            "rank 0's teardown forgot its error"
        );
        r[1].as_ref().expect("rank 1 tears down cleanly");
    });
}

/// Create, use, tear down, several times in a row: nothing leaks into the next buffer.
#[test]
fn repeated_create_use_teardown() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for round in 0..3 {
        let mut bufs = group(&ctxs, &options(2));
        let c = Case {
            hidden: 4096,
            topk: 8,
            fp8: Some(Fp8Options::default()),
            hook: round % 2 == 1,
            zero_copy: round == 2,
        };
        let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
        let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        check(2, &c, &data, &res, &format!("round {round}"));
        shutdown_all(bufs);
    }
}

// ---- NVLink disabled: every byte through the transport ------------------------------------------

/// Hidden 2048 and 7168 × BF16 and FP8 × top-1 and top-8 × hook off and on; zero-copy combine
/// on every other case.
fn transport_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for hidden in [2048, 7168] {
        for fp8 in [None, Some(Fp8Options::default())] {
            for topk in [1, 8] {
                for hook in [false, true] {
                    v.push(Case {
                        hidden,
                        topk,
                        fp8,
                        hook,
                        zero_copy: v.len() % 2 == 1,
                    });
                }
            }
        }
    }
    v
}

fn transport_group(
    ctxs: &[Arc<CudaContext>],
    mode: (HandlerChoice, NicHandler),
) -> Vec<LowLatencyBuffer> {
    let bufs = LowLatencyBuffer::create_group(ctxs, &transport_options(ctxs.len(), mode.0))
        .unwrap_or_else(|e| {
            panic!(
                "creating the buffers with NVLink disabled, mode {}: {e}",
                mode.1.name()
            )
        });
    for b in &bufs {
        assert_eq!(
            b.nic_handler(),
            Some(mode.1),
            "rank {}: handler mode",
            b.rank()
        );
    }
    bufs
}

#[test]
fn transport_matrix_matches_reference_in_every_mode() {
    let mut rng = Rng::new(seed());
    for ranks in ep_kernels::testing::rank_counts(&RANK_COUNTS) {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        for mode in TRANSPORT_MODES {
            let mut bufs = transport_group(&ctxs, mode);
            for (i, c) in transport_cases().into_iter().enumerate() {
                let t_case = std::time::Instant::now();
                let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
                let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                    let r = b.rank();
                    run_case(b, &data[r], &c)
                        .unwrap_or_else(|e| panic!("rank {r}, mode {}: {e}", mode.1.name()))
                });
                check(
                    ranks,
                    &c,
                    &data,
                    &res,
                    &format!("EP{ranks} transport mode {} {c:?}", mode.1.name()),
                );
                eprintln!(
                    "EP{ranks} transport mode {} case {i} passed in {:.2?}",
                    mode.1.name(),
                    t_case.elapsed()
                );
            }
            shutdown_all(bufs);
            eprintln!(
                "EP{ranks} transport mode {}: {} cases passed",
                mode.1.name(),
                transport_cases().len()
            );
        }
    }
}

/// The direct emulated transport with its rings and CQs in GPU memory (as the verbs path always
/// places them; the default is pinned host memory), at EP2 and EP4 in every mode: the cases the
/// verbs test runs. Tells a fault of the emulator's device-ring code (ring reads by copy, CQEs
/// by stream stores) from one of the verbs/firmware path: the verbs path failed at EP4 in
/// `cpu_host_memory` on 2026-12-02 while this transport, with host rings, passed.
#[test]
fn transport_with_rings_in_gpu_memory_matches_reference_in_every_mode() {
    let mut rng = Rng::new(seed());
    let cases = [
        transport_cases()[0],
        transport_cases()[5],
        transport_cases()[10],
    ];
    for ranks in ep_kernels::testing::rank_counts(&[2, 4]) {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        for mode in TRANSPORT_MODES {
            let mut o = transport_options(ranks, mode.0);
            o.emulated_rings = RingPlacement::Device;
            let mut bufs = LowLatencyBuffer::create_group(&ctxs, &o).unwrap_or_else(|e| {
                panic!(
                    "EP{ranks}, rings in GPU memory, mode {}: {e}",
                    mode.1.name()
                )
            });
            for c in cases {
                let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
                let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                    let r = b.rank();
                    run_case(b, &data[r], &c).unwrap_or_else(|e| {
                        panic!("rank {r}, rings in GPU memory, mode {}: {e}", mode.1.name())
                    })
                });
                let what = format!("EP{ranks} device rings mode {} {c:?}", mode.1.name());
                check(ranks, &c, &data, &res, &what);
            }
            shutdown_all(bufs);
            eprintln!(
                "EP{ranks} transport with rings in GPU memory, mode {}: {} cases passed",
                mode.1.name(),
                cases.len()
            );
        }
    }
}

/// Mode `cpu` on the emulated NIC: producer slots in GPU memory, read by the proxy through
/// GDRCopy where it works and through the emulated GDR view where it does not (this project's
/// machines); one case against the reference either way.
#[test]
fn transport_mode_cpu_runs_on_the_emulated_nic() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut bufs = LowLatencyBuffer::create_group(&ctxs, &transport_options(2, HandlerChoice::Cpu))
        .unwrap_or_else(|e| panic!("mode cpu on the emulated NIC: {e}"));
    for b in &bufs {
        assert_eq!(b.nic_handler(), Some(NicHandler::Cpu), "rank {}", b.rank());
    }
    let c = transport_cases()[5];
    let mut rng = Rng::new(seed());
    let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
    let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}, mode cpu: {e}"))
    });
    check(2, &c, &data, &res, "transport mode cpu");
    shutdown_all(bufs);
}

/// Create, dispatch, combine, tear down (barrier, free, QP shutdown) 20 times in a row in each
/// mode; every teardown must succeed.
#[test]
fn transport_create_use_teardown_20_times_per_mode() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut rng = Rng::new(seed());
    for mode in TRANSPORT_MODES {
        for round in 0..20 {
            let mut bufs = transport_group(&ctxs, mode);
            let c = Case {
                hidden: 2048,
                topk: 8,
                fp8: (round % 2 == 1).then(Fp8Options::default),
                hook: round % 3 == 2,
                zero_copy: round % 4 == 3,
            };
            let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
            let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                run_case(b, &data[r], &c).unwrap_or_else(|e| {
                    panic!("round {round}, rank {r}, mode {}: {e}", mode.1.name())
                })
            });
            check(
                2,
                &c,
                &data,
                &res,
                &format!("mode {} round {round}", mode.1.name()),
            );
            shutdown_all(bufs);
        }
        eprintln!("transport mode {}: 20 rounds passed", mode.1.name());
    }
}

/// Two ranks of this process on one GPU: each gets half its SMs as the default grid, a dispatch
/// or combine asking for more than fits beside the other rank is refused before launch with
/// [`EpError::SmBudget`] naming the numbers (never a timeout), and the buffers still work after.
#[test]
fn an_oversubscribed_sm_budget_is_refused_before_launch() {
    let Some(one) = rank_gpus(1) else { return };
    let ctxs = vec![one[0].clone(), one[0].clone()];
    let mut rng = Rng::new(seed());
    let mut bufs = group(&ctxs, &options(2));
    let sms = bufs[0].num_sms();
    assert_eq!(bufs[0].gpu_share().threads, vec![0, 1]);
    assert_eq!(bufs[0].sm_budget(), sms / 2);
    let c = cases()[0];
    let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
    let refusals: Vec<String> = on_ranks(&mut bufs, |b| {
        let d = &data[b.rank()];
        let ctx = b.context().clone();
        let x = Tensor::from_host(&ctx, &d.x, &[d.tokens, c.hidden]).unwrap();
        let idx = Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk]).unwrap();
        let mut args = LlDispatchArgs::new(&x, &idx);
        args.num_sms = Some(sms / 2 + 1);
        let t0 = std::time::Instant::now();
        let e = match b.dispatch(&args) {
            Ok(_) => panic!("an oversubscribed grid must be refused"),
            Err(e) => e,
        };
        assert!(t0.elapsed() < Duration::from_secs(1), "refused late: {e}");
        match &e {
            EpError::SmBudget {
                budget,
                ranks_on_gpu: 2,
                fits,
                ..
            } => {
                assert_eq!(*budget, sms / 2 + 1, "{e}");
                assert_eq!(*fits, sms / 2, "{e}");
            }
            other => panic!("expected SmBudget, got {other}"),
        }
        e.to_string()
    });
    eprintln!("refused: {}", refusals[0]);
    // Nothing was launched: a whole case still matches the reference on the default grid.
    let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    check(2, &c, &data, &res, "EP2 on one GPU after a refused grid");
    shutdown_all(bufs);
}

/// One dispatch + combine whose outputs the kernels write into tensors of the caller
/// (`recv_into`, `recv_count_into`, `out_into`), poisoned first; the results are read from those
/// tensors, and the returned outputs must be them.
fn run_case_into(b: &mut LowLatencyBuffer, d: &RankData, c: &Case) -> Result<RankResult, EpError> {
    let ctx = b.context().clone();
    let (local, cap, h) = (b.num_local_experts(), b.ranks() * MAX_TOKENS, c.hidden);
    let x = Tensor::from_host(&ctx, &d.x, &[d.tokens, h])?;
    let idx = Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk])?;
    let w = Tensor::from_host(&ctx, &d.weights, &[d.tokens, c.topk])?;
    let rx16 = Tensor::filled(&ctx, Bf16(0xABAB), &[local, cap, h])?;
    let rx8 = Tensor::filled(&ctx, Fp8E4M3(0xAB), &[local, cap, h])?;
    let count = Tensor::filled(&ctx, -7i32, &[local])?;
    let mut args = LlDispatchArgs::new(&x, &idx);
    args.fp8 = c.fp8;
    args.return_recv_hook = c.hook;
    args.recv_into = Some(match c.fp8 {
        None => LlRecvInto::Bf16(&rx16),
        Some(_) => LlRecvInto::Fp8(&rx8),
    });
    args.recv_count_into = Some(&count);
    let mut out = b.dispatch(&args)?;
    if let Some(hk) = out.hook.take() {
        hk.call()?;
    }
    b.synchronize()?;
    let mut res = RankResult::default();
    read_dispatch(&out, &mut res)?;
    let into_addr = if c.fp8.is_some() {
        rx8.device_address()
    } else {
        rx16.device_address()
    };
    let got_addr = match &out.x {
        ep::low_latency::LlRecvX::Bf16(t) => t.device_address(),
        ep::low_latency::LlRecvX::Fp8 { x, .. } => x.device_address(),
    };
    assert_eq!(
        got_addr, into_addr,
        "the returned rows are the caller's tensor"
    );
    assert_eq!(out.recv_count.device_address(), count.device_address());

    let comb_in = Tensor::from_host(&ctx, &d.comb_in, &[local, cap, h])?;
    let combined = Tensor::filled(&ctx, Bf16(0xABAB), &[d.tokens, h])?;
    let mut cargs = LlCombineArgs::new(LlCombineX::Tensor(&comb_in), &idx, &w, &out.handle);
    cargs.return_recv_hook = c.hook;
    cargs.out_into = Some(&combined);
    let mut co = b.combine(&cargs)?;
    if let Some(hk) = co.hook.take() {
        hk.call()?;
    }
    b.synchronize()?;
    assert_eq!(co.x.device_address(), combined.device_address());
    res.out = combined.to_host()?;
    Ok(res)
}

#[test]
fn outputs_written_into_caller_tensors_match_reference() {
    let mut rng = Rng::new(seed());
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut bufs = group(&ctxs, &options(2));
    let fp8 = Some(Fp8Options {
        round_scale: false,
        ue8m0: false,
    });
    for (fp8, hook) in [(None, false), (None, true), (fp8, false), (fp8, true)] {
        let c = Case {
            hidden: 7168,
            topk: 8,
            fp8,
            hook,
            zero_copy: false,
        };
        let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
        let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
            let r = b.rank();
            run_case_into(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        });
        check(
            2,
            &c,
            &data,
            &res,
            &format!("EP2 into caller tensors {c:?}"),
        );
    }
    // Wrong caller tensors are refused before launch, by name, on every rank alike.
    let msgs = on_ranks(&mut bufs, |b| {
        let ctx = b.context().clone();
        let (local, cap) = (b.num_local_experts(), b.ranks() * MAX_TOKENS);
        let x = Tensor::filled(&ctx, Bf16(0), &[4, 2048]).expect("x");
        let idx = Tensor::filled(&ctx, 0i32, &[4, 2]).expect("idx");
        let short = Tensor::filled(&ctx, Bf16(0), &[local, cap, 1024]).expect("short");
        let fp8_rows = Tensor::filled(&ctx, Fp8E4M3(0), &[local, cap, 2048]).expect("fp8");
        let mut args = LlDispatchArgs::new(&x, &idx);
        args.recv_into = Some(LlRecvInto::Bf16(&short));
        let a = match b.dispatch(&args) {
            Ok(_) => panic!("a short recv_into must be refused"),
            Err(e) => e,
        };
        args.recv_into = Some(LlRecvInto::Fp8(&fp8_rows));
        let e = match b.dispatch(&args) {
            Ok(_) => panic!("an FP8 recv_into of a BF16 dispatch must be refused"),
            Err(e) => e,
        };
        (a.to_string(), e.to_string())
    });
    for (a, e) in msgs {
        assert!(a.contains("recv_into") && a.contains("shape"), "{a}");
        assert!(e.contains("recv_into has the wrong element type"), "{e}");
    }
    // Nothing was launched: a plain case still matches.
    let c = two_in_flight_case();
    let data = random_data(&mut rng, 2, c.hidden, c.topk, None);
    let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
        let r = b.rank();
        run_case(b, &data[r], &c).unwrap_or_else(|e| panic!("rank {r}: {e}"))
    });
    check(2, &c, &data, &res, "EP2 after refused caller tensors");
    shutdown_all(bufs);
}
