//! Low-latency dispatch/combine with ranks as processes: the `Launcher` re-executes this test
//! once per rank (round robin over the visible GPUs, sharing them where there are fewer; TCP).
//! Over NVLink every rank maps the others' net buffers through CUDA IPC and the kernels store into them; with NVLink disabled every
//! process runs its own emulated NIC, the ranks connect QPs to each other through the group (the
//! NICs open each other's registered buffers through CUDA IPC) and every byte to another rank
//! goes through the IBGDA transport. Checked against the CPU reference on fresh random data
//! (outputs poisoned before every operation) with the cases and checks of the threads test
//! (`gpu_low_latency.rs`, shared in `gpu_low_latency_common`): every rank draws every rank's
//! inputs from the seed the launcher passes on (`EP_TEST_SEED`), runs its own part and checks its
//! own results.
//!
//! Each test is one launch, at EP2 and (where the machine has 4 GPUs) EP4: the NVLink matrix
//! (every hidden size, BF16 / FP8 / power-of-two / UE8M0, top-k up to 11, hook mode, zero-copy
//! combine) with two results in flight, a transport buffer built and torn down, mismatched
//! options refused, CUDA-graph capture and replay, create / use / teardown 20 times, and (EP2) a
//! rank that never dispatches: a bounded, named timeout, then a clean teardown everywhere. With
//! NVLink disabled, in NIC-handler modes `gpu` and `cpu_host_memory`: a handful of cases (hidden
//! 2048 and 7168, BF16 and FP8, top-8, hook mode, zero-copy combine), create / use / teardown
//! 20 times per mode; and mode `cpu` failing at once, the same way on every rank, where GDRCopy
//! is missing.

mod gpu_low_latency_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use ep::bootstrap::{Communicator, Launcher, TcpCommunicator};
use ep::low_latency::{Fp8Options, LlDispatchArgs, LowLatencyBuffer, LowLatencyOptions};
use ep::{EpError, Tensor};
use ep_kernels::testing::{rank_context, rank_gpus, seed, Rng};
use gpu_low_latency_common::{
    cases, check_rank, graph_case, graph_rank, graph_rounds, options, random_data, run_case,
    transport_options, two_in_flight, two_in_flight_case, Case, RankResult, TRANSPORT_MODES,
};
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;

/// Below the device suite's 300 s per test, so a stuck launch is reported by the launcher, with
/// every rank's state, rather than killed by the suite.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(270);

type Res = Result<(), String>;

fn text(e: EpError) -> String {
    e.to_string()
}

/// One rank: its communicator (which its buffers keep for their teardown barrier), its GPU and
/// the job's seed.
struct Rank {
    comm: Arc<TcpCommunicator>,
    ctx: Arc<CudaContext>,
    seed: u64,
}

impl Rank {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn ranks(&self) -> usize {
        self.comm.world_size()
    }

    fn buffer(&self, opts: &LowLatencyOptions) -> Result<LowLatencyBuffer, EpError> {
        LowLatencyBuffer::new(&self.ctx, self.comm.clone(), opts)
    }

    /// The same generator on every rank, one per `part` of a test.
    fn rng(&self, part: u64) -> Rng {
        Rng::new(self.seed ^ ((part + 1) << 40))
    }

    /// "`what` rank r/n (processes)", for messages.
    fn name(&self, what: impl std::fmt::Display) -> String {
        format!("EP{} {what} rank {} (processes)", self.ranks(), self.rank())
    }
}

/// Runs `body` as `ranks` processes (this test binary re-executed, running only `test`).
fn launch(ranks: usize, test: &str, body: fn(&Rank) -> Res) {
    // The launcher checks the machine; a rank opens only its own GPU.
    if !Launcher::is_rank_process() && rank_gpus(ranks).is_none() {
        return;
    }
    let s = seed();
    let r = Launcher::new(ranks)
        .libtest(test)
        .env("EP_TEST_SEED", s.to_string())
        .timeout(LAUNCH_TIMEOUT)
        .run_shared(|comm| -> Res {
            if comm.same_process() {
                return Err("a TCP rank claims to share the process with its peers".into());
            }
            let ctx = rank_context(comm.local_rank()).map_err(|e| e.to_string())?;
            let t0 = Instant::now();
            let rank = Rank { comm, ctx, seed: s };
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

/// The refusals, then every case of the matrix on one buffer, then two results in flight.
fn matrix_rank(me: &Rank) -> Res {
    transport_is_built(me)?;
    options_must_agree(me)?;
    let (r, ranks) = (me.rank(), me.ranks());
    let mut rng = me.rng(0);
    let mut buf = me.buffer(&options(ranks)).map_err(text)?;
    for c in cases() {
        let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
        let what = me.name(format_args!("{c:?}"));
        let res = run_case(&mut buf, &data[r], &c).map_err(|e| format!("{what}: {e}"))?;
        check_rank(ranks, &c, &data, r, &res, &what);
    }
    let c = two_in_flight_case();
    let d1 = random_data(&mut rng, ranks, c.hidden, c.topk, None);
    let d2 = random_data(&mut rng, ranks, c.hidden, c.topk, None);
    let (r1, r2) = two_in_flight(&mut buf, &d1[r], &d2[r], &c).map_err(text)?;
    check_rank(ranks, &c, &d1, r, &r1, &me.name("two in flight, first"));
    check_rank(ranks, &c, &d2, r, &r2, &me.name("two in flight, second"));
    buf.shutdown().map_err(text)?;
    eprintln!("{}: {} cases passed", me.name("matrix"), cases().len() + 1);
    Ok(())
}

/// NVLink disabled across processes is built (each process its own NIC, QPs connected through
/// the group), reports its mode and tears down cleanly; a group whose ranks disagree on
/// `allow_nvlink` fails on every rank at once with [`EpError::Rendezvous`], naming a rank.
fn transport_is_built(me: &Rank) -> Res {
    let t0 = Instant::now();
    let buf = me
        .buffer(&transport_options(me.ranks(), HandlerChoice::Gpu))
        .map_err(|e| format!("NVLink disabled across processes: {e}"))?;
    if buf.nic_handler() != Some(NicHandler::Gpu) {
        return Err(format!(
            "NVLink disabled, mode gpu: the buffer reports {:?}",
            buf.nic_handler()
        ));
    }
    buf.shutdown()
        .map_err(|e| format!("NVLink disabled across processes: teardown: {e}"))?;
    eprintln!(
        "{}: built and torn down in {:?}",
        me.name("NVLink disabled"),
        t0.elapsed()
    );
    let mut o = options(me.ranks());
    o.allow_nvlink = me.rank() != 0;
    let t0 = Instant::now();
    let e = match me.buffer(&o) {
        Ok(_) => return Err("buffers disagreeing on allow_nvlink were built".into()),
        Err(e) => e,
    };
    let msg = e.to_string();
    if !matches!(e, EpError::Rendezvous { .. })
        || !msg.contains("allow_nvlink")
        || t0.elapsed() > Duration::from_secs(10)
    {
        return Err(format!(
            "ranks disagreeing on allow_nvlink: {msg} after {:?}",
            t0.elapsed()
        ));
    }
    eprintln!("allow_nvlink mismatch refused: {msg}");
    Ok(())
}

/// A rank built with other options makes every rank's creation fail at once, naming it.
fn options_must_agree(me: &Rank) -> Res {
    let last = me.ranks() - 1;
    let tokens = if me.rank() == last { 32 } else { 16 };
    let t0 = Instant::now();
    let o = LowLatencyOptions::new(tokens, 512, 2, 2 * me.ranks());
    let e = match me.buffer(&o) {
        Ok(_) => return Err("buffers with different options were built".into()),
        Err(e) => e,
    };
    let msg = e.to_string();
    if !matches!(e, EpError::Rendezvous { .. }) || t0.elapsed() > Duration::from_secs(10) {
        return Err(format!(
            "mismatched options: {msg} after {:?}",
            t0.elapsed()
        ));
    }
    let names = if me.rank() == last {
        "rank 0".to_string()
    } else {
        format!("rank {last}")
    };
    if !msg.contains(&names) {
        return Err(format!("mismatched options: {msg} does not name {names}"));
    }
    eprintln!("mismatched options: {msg}");
    Ok(())
}

/// Dispatch + combine captured into one graph per rank (one plain, one in hook mode), replayed
/// with fresh data written into the captured inputs before each replay.
fn graph_rank_main(me: &Rank) -> Res {
    let (r, ranks) = (me.rank(), me.ranks());
    let mut rng = me.rng(1);
    let mut buf = me.buffer(&options(ranks)).map_err(text)?;
    for hook in [false, true] {
        let c = graph_case(hook);
        let rounds = graph_rounds(&mut rng, ranks, &c);
        let mine: Vec<_> = rounds.iter().map(|v| v[r].clone()).collect();
        let res = graph_rank(&mut buf, &mine, &c).map_err(text)?;
        for (i, (data, got)) in rounds.iter().zip(&res).enumerate() {
            let what = me.name(format_args!("graph hook={hook} replay {i}"));
            check_rank(ranks, &c, data, r, got, &what);
        }
    }
    buf.shutdown().map_err(text)
}

/// Create, dispatch, combine, tear down 20 times in a row; every teardown must succeed (one in
/// four by dropping the buffer, which meets the other ranks the same way).
fn repeat_rank(me: &Rank) -> Res {
    let (r, ranks) = (me.rank(), me.ranks());
    let mut rng = me.rng(2);
    for round in 0..20 {
        let what = me.name(format_args!("round {round}"));
        let mut buf = me
            .buffer(&options(ranks))
            .map_err(|e| format!("{what}: {e}"))?;
        let c = Case {
            hidden: 2048,
            topk: 8,
            fp8: (round % 2 == 1).then(Fp8Options::default),
            hook: round % 3 == 2,
            zero_copy: round % 4 == 1,
        };
        let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
        let res: RankResult =
            run_case(&mut buf, &data[r], &c).map_err(|e| format!("{what}: {e}"))?;
        check_rank(ranks, &c, &data, r, &res, &what);
        if round % 4 == 3 {
            drop(buf);
        } else {
            buf.shutdown()
                .map_err(|e| format!("{what}: teardown: {e}"))?;
        }
    }
    eprintln!("{}: 20 rounds passed", me.name("create/use/teardown"));
    Ok(())
}

/// Only rank 0 dispatches: its receive wait runs out within the bound and the `Err` names the
/// rank, a peer and the expert; the buffer is unusable after; every rank still tears down
/// together (rank 0 reporting its recorded error again).
fn missing_rank_main(me: &Rank) -> Res {
    let mut o = options(me.ranks());
    o.timeout = Duration::from_secs(2);
    let mut buf = me.buffer(&o).map_err(text)?;
    if me.rank() != 0 {
        return buf
            .shutdown()
            .map_err(|e| format!("a rank that sent nothing: {e}"));
    }
    let mut rng = me.rng(3);
    let data = random_data(&mut rng, me.ranks(), 2048, 4, Some(16));
    let d = &data[0];
    let x = Tensor::from_host(&me.ctx, &d.x, &[16, 2048]).map_err(text)?;
    let idx = Tensor::from_host(&me.ctx, &d.idx, &[16, 4]).map_err(text)?;
    let t0 = Instant::now();
    let out = buf.dispatch(&LlDispatchArgs::new(&x, &idx)).map_err(text)?;
    let msg = match buf.synchronize() {
        Ok(()) => return Err("the other ranks never sent, yet the receive finished".into()),
        Err(e) => e.to_string(),
    };
    drop(out);
    eprintln!("rank 0 after {:?}: {msg}", t0.elapsed());
    if t0.elapsed() > Duration::from_secs(10) {
        return Err(format!("not bounded: {:?}", t0.elapsed()));
    }
    let names_peer = (1..me.ranks()).any(|p| msg.contains(&format!("rank {p}")));
    if !(msg.contains("rank 0") && names_peer && msg.contains("local expert")) {
        return Err(format!(
            "the timeout should name rank, peer and expert: {msg}"
        ));
    }
    match buf.dispatch(&LlDispatchArgs::new(&x, &idx)) {
        Err(EpError::Poisoned { .. }) => {}
        other => return Err(format!("after a timeout: {other:?}")),
    }
    match buf.shutdown() {
        Err(_) => Ok(()),
        Ok(()) => Err("the teardown after a timeout reported nothing".into()),
    }
}

// ---- NVLink disabled: every byte through the transport -----------------------------------------

/// Hidden 2048 and 7168 × BF16 and FP8, top-8; hook mode and zero-copy combine each on half the
/// cases, both on one.
fn transport_cases() -> Vec<Case> {
    let fp8 = Some(Fp8Options::default());
    let case = |hidden, fp8, hook, zero_copy| Case {
        hidden,
        topk: 8,
        fp8,
        hook,
        zero_copy,
    };
    vec![
        case(2048, None, false, false),
        case(2048, fp8, true, true),
        case(7168, None, true, false),
        case(7168, fp8, false, true),
    ]
}

/// This rank's buffer with NVLink disabled in `mode`, checked to report the mode.
fn transport_buffer(
    me: &Rank,
    mode: (HandlerChoice, NicHandler),
) -> Result<LowLatencyBuffer, String> {
    let buf = me
        .buffer(&transport_options(me.ranks(), mode.0))
        .map_err(|e| {
            format!(
                "{}: {e}",
                me.name(format_args!("transport mode {}", mode.1.name()))
            )
        })?;
    if buf.nic_handler() != Some(mode.1) {
        return Err(format!(
            "{}: the buffer reports mode {:?}",
            me.name(format_args!("transport mode {}", mode.1.name())),
            buf.nic_handler()
        ));
    }
    Ok(buf)
}

/// Every transport case on one buffer per mode, against the reference.
fn transport_matrix_rank(me: &Rank) -> Res {
    let (r, ranks) = (me.rank(), me.ranks());
    let mut rng = me.rng(4);
    for mode in TRANSPORT_MODES {
        let t0 = Instant::now();
        let mut buf = transport_buffer(me, mode)?;
        for c in transport_cases() {
            let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
            let what = me.name(format_args!("transport mode {} {c:?}", mode.1.name()));
            let res = run_case(&mut buf, &data[r], &c).map_err(|e| format!("{what}: {e}"))?;
            check_rank(ranks, &c, &data, r, &res, &what);
        }
        buf.shutdown().map_err(|e| {
            format!(
                "{}: teardown: {e}",
                me.name(format_args!("transport mode {}", mode.1.name()))
            )
        })?;
        eprintln!(
            "{}: {} cases passed in {:.1} s",
            me.name(format_args!("transport mode {}", mode.1.name())),
            transport_cases().len(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Mode `cpu` on the emulated NIC, ranks as processes: every rank builds (producer slots in GPU
/// memory, read through GDRCopy where it works, else through the emulated GDR view; the outcomes
/// are gathered and compared, so no rank is left waiting on a collective) and runs one case
/// against the reference.
fn transport_cpu_rank(me: &Rank) -> Res {
    let outcome = me.buffer(&transport_options(me.ranks(), HandlerChoice::Cpu));
    let mine = match &outcome {
        Ok(_) => "built".to_string(),
        Err(e) => format!("refused: {e}"),
    };
    let all = me
        .comm
        .all_gather_bytes(mine.as_bytes())
        .map_err(|e| e.to_string())?;
    let all: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    if all.iter().any(|o| o.as_str() != "built") {
        return Err(format!(
            "mode cpu on the emulated NIC: not every rank built: {all:?}"
        ));
    }
    let mut buf = outcome.map_err(|e| e.to_string())?;
    let (r, ranks) = (me.rank(), me.ranks());
    let c = transport_cases()[1];
    let data = random_data(&mut me.rng(5), ranks, c.hidden, c.topk, None);
    let what = me.name("transport mode cpu");
    let res = run_case(&mut buf, &data[r], &c).map_err(|e| format!("{what}: {e}"))?;
    check_rank(ranks, &c, &data, r, &res, &what);
    buf.shutdown().map_err(|e| format!("{what}: teardown: {e}"))
}

/// Create, dispatch, combine, tear down 20 times in a row per mode with NVLink disabled; every
/// teardown must succeed (one in four by dropping the buffer).
fn transport_repeat_rank(me: &Rank) -> Res {
    let (r, ranks) = (me.rank(), me.ranks());
    let mut rng = me.rng(6);
    for mode in TRANSPORT_MODES {
        let t0 = Instant::now();
        for round in 0..20 {
            let what = me.name(format_args!(
                "transport mode {} round {round}",
                mode.1.name()
            ));
            let mut buf = transport_buffer(me, mode).map_err(|e| format!("round {round}: {e}"))?;
            let c = Case {
                hidden: 2048,
                topk: 8,
                fp8: (round % 2 == 1).then(Fp8Options::default),
                hook: round % 3 == 2,
                zero_copy: round % 4 == 1,
            };
            let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
            let res = run_case(&mut buf, &data[r], &c).map_err(|e| format!("{what}: {e}"))?;
            check_rank(ranks, &c, &data, r, &res, &what);
            if round % 4 == 3 {
                drop(buf);
            } else {
                buf.shutdown()
                    .map_err(|e| format!("{what}: teardown: {e}"))?;
            }
        }
        eprintln!(
            "{}: 20 rounds passed in {:.1} s",
            me.name(format_args!("transport mode {}", mode.1.name())),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

#[test]
fn nvlink_matrix_ep2() {
    launch(2, "nvlink_matrix_ep2", matrix_rank);
}

#[test]
fn nvlink_matrix_ep4() {
    launch(4, "nvlink_matrix_ep4", matrix_rank);
}

#[test]
fn cuda_graph_replays_ep2() {
    launch(2, "cuda_graph_replays_ep2", graph_rank_main);
}

#[test]
fn cuda_graph_replays_ep4() {
    launch(4, "cuda_graph_replays_ep4", graph_rank_main);
}

#[test]
fn create_use_teardown_20_times_ep2() {
    launch(2, "create_use_teardown_20_times_ep2", repeat_rank);
}

#[test]
fn create_use_teardown_20_times_ep4() {
    launch(4, "create_use_teardown_20_times_ep4", repeat_rank);
}

#[test]
fn a_missing_rank_times_out_ep2() {
    launch(2, "a_missing_rank_times_out_ep2", missing_rank_main);
}

#[test]
fn transport_matrix_ep2() {
    launch(2, "transport_matrix_ep2", transport_matrix_rank);
}

#[test]
fn transport_matrix_ep4() {
    launch(4, "transport_matrix_ep4", transport_matrix_rank);
}

#[test]
fn transport_mode_cpu_runs_on_the_emulated_nic_ep2() {
    launch(
        2,
        "transport_mode_cpu_runs_on_the_emulated_nic_ep2",
        transport_cpu_rank,
    );
}

#[test]
fn transport_mode_cpu_runs_on_the_emulated_nic_ep4() {
    launch(
        4,
        "transport_mode_cpu_runs_on_the_emulated_nic_ep4",
        transport_cpu_rank,
    );
}

#[test]
fn transport_create_use_teardown_20_times_ep2() {
    launch(
        2,
        "transport_create_use_teardown_20_times_ep2",
        transport_repeat_rank,
    );
}

#[test]
fn transport_create_use_teardown_20_times_ep4() {
    launch(
        4,
        "transport_create_use_teardown_20_times_ep4",
        transport_repeat_rank,
    );
}
