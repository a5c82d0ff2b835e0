//! Faults at the EP level on the GPU (issue 16, item 11): low-latency dispatch/combine with
//! NVLink disabled (every byte to the other rank through the IBGDA transport on the emulated
//! NIC), EP2 as threads, in NIC-handler modes `gpu` and `cpu_host_memory`, under the emulated
//! NIC's `FaultPlan`: delayed completions, dropped doorbells, an error CQE on the n-th WQE, a lost
//! CQE, and peer death (a rank's NIC that stops executing mid-operation, a rank thread that
//! stops calling). Each case ends in either exact results on every rank against the CPU
//! reference (rows received, lost and duplicated counted from the routing and printed; outputs
//! poisoned first) or a named error (`Err` naming the rank and the QP, peer or the rank it waited
//! for) on every live rank within the bound; then the buffers are torn down (bounded) and a fresh
//! group is built and must match the reference.
//!
//! The CPU counterpart, run in CI: `faults_cpu.rs`. Intranode (no NIC): `gpu_intranode_faults.rs`.

mod gpu_low_latency_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ep::low_latency::{LowLatencyBuffer, LowLatencyOptions};
use ep::EpError;
use ep_kernels::testing::{rank_gpus, seed, Rng};
use gpu_low_latency_common::{
    check, experts_for, on_ranks, random_data, routing, run_case, Case, RankData, RankResult,
    MAX_TOKENS, TRANSPORT_MODES,
};
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;
use ibgda_device::wire::syndrome;
use ibgda_emu::FaultPlan;

/// Bound of every wait in these buffers: short, so that every error case ends quickly.
const BOUND: Duration = Duration::from_secs(2);
const HIDDEN: usize = 2048;
/// Tokens per rank: small, so each case is quick.
const TOKENS: usize = 16;

/// Longest a rank may take for a dispatch + combine that fails: the device bound of a wait, the
/// host bound of the stream wait after it (twice the device's plus 5 s) and a launch gate's.
fn rank_bound() -> Duration {
    BOUND * 6 + Duration::from_secs(6)
}

fn options(mode: HandlerChoice) -> LowLatencyOptions {
    // MAX_TOKENS as the common checks expect; hidden at most 2048 keeps the buffers small.
    let mut o = LowLatencyOptions::new(MAX_TOKENS, HIDDEN, 8, experts_for(2));
    o.poison_outputs = true;
    o.timeout = BOUND;
    o.allow_nvlink = false;
    o.nic_handler = mode;
    o
}

fn case() -> Case {
    Case {
        hidden: HIDDEN,
        topk: 4,
        fp8: None,
        hook: false,
        zero_copy: false,
    }
}

fn group(ctxs: &[Arc<CudaContext>], mode: (HandlerChoice, NicHandler)) -> Vec<LowLatencyBuffer> {
    let bufs = LowLatencyBuffer::create_group(ctxs, &options(mode.0))
        .unwrap_or_else(|e| panic!("mode {}: creating the buffers: {e}", mode.1.name()));
    for b in &bufs {
        assert_eq!(b.nic_handler(), Some(mode.1), "rank {}", b.rank());
    }
    bufs
}

/// What a rank does in a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    DelayCompletions,
    DropFirstDoorbell,
    ErrorCqeOnWqe(u64),
    LoseFirstCqe,
    /// Rank 1's NIC executes this many WQEs, then nothing ever again.
    NicDies(u64),
    /// Rank 1 dispatches, then never calls combine.
    ThreadStops,
}

/// What a case must end in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    Exact,
    Errors,
    /// Either, on every rank alike: a dropped doorbell is recovered by a later larger one, but
    /// not when it announced the QP's last WQE (the NIC then never learns of it; quiet's bound
    /// ends the wait).
    Either,
}

/// Arms `fault`: rank 0's NIC for faults on its QPs to rank 1, rank 1's NIC for its death.
fn arm(bufs: &[LowLatencyBuffer], fault: Fault) {
    let qps = bufs[0].transport_qps().expect("transport mode");
    let to1 = &qps.to[1];
    assert!(!to1.is_empty() && qps.to[0].is_empty(), "{qps:?}");
    let each = |f: &dyn Fn(FaultPlan, u32) -> FaultPlan| {
        to1.iter().fold(FaultPlan::default(), |p, &q| f(p, q))
    };
    let plan = match fault {
        Fault::DelayCompletions => {
            FaultPlan::default().delay_completions(Duration::from_micros(300))
        }
        Fault::DropFirstDoorbell => each(&|p, q| p.drop_doorbell(q, 1)),
        Fault::ErrorCqeOnWqe(n) => each(&|p, q| p.fail_wqe(q, n, syndrome::REMOTE_ACCESS_ERR)),
        Fault::LoseFirstCqe => each(&|p, q| p.lose_cqe(q, 1)),
        Fault::NicDies(n) => {
            bufs[1]
                .set_fault_plan(FaultPlan::default().die_after_wqes(n))
                .expect("a NIC to kill");
            return;
        }
        Fault::ThreadStops => return,
    };
    bufs[0].set_fault_plan(plan).expect("a NIC to arm");
}

/// Rows received, lost and duplicated on every rank, from the dispatch's source tokens and layout
/// against the reference routing.
fn tally(c: &Case, data: &[RankData], res: &[RankResult]) -> (usize, usize, usize, usize) {
    let ranks = data.len();
    let route = routing(ranks, c, data);
    let local = experts_for(ranks) / ranks;
    let cap = ranks * MAX_TOKENS;
    let (mut expected, mut received, mut lost, mut dup) = (0, 0, 0, 0);
    for (r, got) in res.iter().enumerate() {
        for l in 0..local {
            let want = &route.rows[r][l];
            expected += want.len();
            let mut seen = std::collections::HashMap::new();
            for s in 0..ranks {
                let first = got.layout[(l * ranks + s) * 2].max(0) as usize;
                let n = got.layout[(l * ranks + s) * 2 + 1].max(0) as usize;
                for j in first..(first + n).min(cap) {
                    *seen
                        .entry((s, got.src_info[l * cap + j] as usize))
                        .or_insert(0) += 1;
                    received += 1;
                }
            }
            lost += want.iter().filter(|k| !seen.contains_key(*k)).count();
            dup += seen
                .values()
                .filter(|&&v| v > 1)
                .map(|v| v - 1)
                .sum::<usize>();
        }
    }
    (expected, received, lost, dup)
}

/// One rank's case: the whole dispatch + combine, or with `stops` the dispatch only (peer death
/// by the thread). `None`: the rank stopped calling.
fn rank_case(
    b: &mut LowLatencyBuffer,
    d: &RankData,
    c: &Case,
    stops: bool,
) -> (Option<Result<RankResult, EpError>>, Duration) {
    let t0 = Instant::now();
    if stops {
        let ctx = b.context().clone();
        let x = ep::Tensor::from_host(&ctx, &d.x, &[d.tokens, c.hidden]).unwrap();
        let idx = ep::Tensor::from_host(&ctx, &d.idx, &[d.tokens, c.topk]).unwrap();
        let out = b.dispatch(&ep::low_latency::LlDispatchArgs::new(&x, &idx));
        let synced = out.as_ref().map(|_| b.synchronize());
        eprintln!(
            "rank 1: dispatched ({:?}), now stops calling",
            synced.map(|s| s.is_ok())
        );
        return (None, t0.elapsed());
    }
    let r = run_case(b, d, c);
    (Some(r), t0.elapsed())
}

/// Judges one round; returns "exact" or "errors".
fn judge(
    what: &str,
    c: &Case,
    data: &[RankData],
    outs: Vec<(Option<Result<RankResult, EpError>>, Duration)>,
    expect: Expect,
) -> &'static str {
    let mut ok = Vec::new();
    let mut errors = 0;
    for (r, (o, took)) in outs.into_iter().enumerate() {
        assert!(
            took < rank_bound(),
            "{what}: rank {r} took {took:?} (bound {:?})",
            rank_bound()
        );
        match o {
            None => eprintln!("{what}: rank {r} stopped calling after {took:?} (peer death)"),
            Some(Ok(res)) => ok.push(res),
            Some(Err(e)) => {
                let m = e.to_string();
                eprintln!("{what}: rank {r}: error after {took:?}: {m}");
                assert!(m.contains(&format!("rank {r}")), "{what}: unnamed: {m}");
                let other = format!("rank {}", 1 - r);
                assert!(
                    m.contains("QP") || m.contains(&other) || m.contains("peer"),
                    "{what}: the error names neither QP nor the other rank: {m}"
                );
                errors += 1;
            }
        }
    }
    let got = match (ok.len(), errors) {
        (n, 0) if n == data.len() => Expect::Exact,
        (0, e) if e > 0 => Expect::Errors,
        (n, e) => panic!("{what}: {n} ranks finished, {e} failed: not every rank alike"),
    };
    assert!(
        expect == Expect::Either || got == expect,
        "{what}: expected {expect:?}, got {got:?}"
    );
    if got == Expect::Exact {
        let (expected, received, lost, dup) = tally(c, data, &ok);
        eprintln!(
            "{what}: {expected} rows expected, {received} received, {lost} lost, {dup} duplicated"
        );
        assert_eq!((lost, dup, received), (0, 0, expected), "{what}");
        check(data.len(), c, data, &ok, what);
        "exact"
    } else {
        "errors"
    }
}

/// Tears every rank's buffer down at once (a collective); errors are allowed after a fault (a
/// rank reports its recorded failure again), but each must come back within the bound.
fn teardown(bufs: Vec<LowLatencyBuffer>, what: &str, must_be_clean: bool) {
    let t0 = Instant::now();
    let rs: Vec<Result<(), EpError>> = std::thread::scope(|s| {
        let joins: Vec<_> = bufs
            .into_iter()
            .map(|b| s.spawn(move || b.shutdown()))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("teardown panicked"))
            .collect()
    });
    let took = t0.elapsed();
    for (r, e) in rs.iter().enumerate() {
        if let Err(e) = e {
            assert!(!must_be_clean, "{what}: rank {r}: teardown: {e}");
            eprintln!("{what}: rank {r}: teardown reported: {e}");
        }
    }
    assert!(took < rank_bound(), "{what}: teardown took {took:?}");
}

fn run_faults(cases: &[(&str, Fault, Expect)], modes: &[(HandlerChoice, NicHandler)]) {
    let Some(ctxs) = rank_gpus(2) else { return };
    let mut rng = Rng::new(seed());
    let c = case();
    for &mode in modes {
        for &(name, fault, expect) in cases {
            let what = format!("mode {} EP2 {name}", mode.1.name());
            let mut bufs = group(&ctxs, mode);
            arm(&bufs, fault);
            let data = random_data(&mut rng, 2, c.hidden, c.topk, Some(TOKENS));
            let outs = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                rank_case(b, &data[r], &c, fault == Fault::ThreadStops && r == 1)
            });
            let how = judge(&what, &c, &data, outs, expect);
            teardown(bufs, &what, how == "exact");
            // Afterwards a fresh group works and matches the reference.
            let mut bufs = group(&ctxs, mode);
            let data = random_data(&mut rng, 2, c.hidden, c.topk, Some(TOKENS));
            let outs = on_ranks(&mut bufs, |b| {
                let r = b.rank();
                rank_case(b, &data[r], &c, false)
            });
            judge(&format!("{what}, rebuilt"), &c, &data, outs, Expect::Exact);
            teardown(bufs, &format!("{what}, rebuilt"), true);
            eprintln!("{what}: {how}; rebuilt and exact");
        }
    }
}

const TRANSPORT_FAULTS: [(&str, Fault, Expect); 4] = [
    (
        "completions delayed 300 us",
        Fault::DelayCompletions,
        Expect::Exact,
    ),
    (
        "first doorbell of each QP to rank 1 dropped",
        Fault::DropFirstDoorbell,
        Expect::Either,
    ),
    (
        "error CQE on WQE 3 of each QP to rank 1",
        Fault::ErrorCqeOnWqe(3),
        Expect::Errors,
    ),
    (
        "first CQE of each QP to rank 1 lost",
        Fault::LoseFirstCqe,
        Expect::Errors,
    ),
];

#[test]
fn transport_faults_end_exact_or_in_named_errors_gpu_mode() {
    run_faults(&TRANSPORT_FAULTS, &TRANSPORT_MODES[..1]);
}

#[test]
fn transport_faults_end_exact_or_in_named_errors_cpu_host_memory_mode() {
    run_faults(&TRANSPORT_FAULTS, &TRANSPORT_MODES[1..2]);
}

#[test]
fn transport_faults_end_exact_or_in_named_errors_cpu_mode() {
    run_faults(&TRANSPORT_FAULTS, &TRANSPORT_MODES[2..3]);
}

/// Peer death in every mode: rank 1's NIC stops executing after a few WQEs (mid-dispatch), and
/// rank 1's thread stops calling after its dispatch; the other rank gets a bounded named error.
#[test]
fn transport_peer_death_is_a_bounded_named_error() {
    run_faults(
        &[
            (
                "rank 1's NIC dies after 2 WQEs",
                Fault::NicDies(2),
                Expect::Errors,
            ),
            (
                "rank 1 stops calling after its dispatch",
                Fault::ThreadStops,
                Expect::Errors,
            ),
        ],
        &TRANSPORT_MODES,
    );
}
