//! Intranode dispatch/combine with ranks as processes: the `Launcher` re-executes this test once
//! per rank (spread round robin over the visible GPUs, so several share one where there are fewer
//! GPUs than ranks: they time-slice it; rendezvous over TCP), the buffers' windows are shared through CUDA
//! IPC and combine pushes rows back into the sources' windows, then reduces locally. Checked
//! against the CPU reference on fresh random data, like the threads test (`gpu_intranode.rs`,
//! same cases and checks): every rank derives every rank's inputs from the seed the launcher
//! passes on (`EP_TEST_SEED`), so each process computes the group's reference itself.

mod gpu_intranode_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use ep::bootstrap::{Communicator, Launcher, TcpCommunicator};
use ep::{Bf16, Buffer, BufferOptions, DispatchArgs, DispatchX, EpError, Tensor};
use ep_kernels::testing::{rank_context, rank_gpus, seed};
use gpu_intranode_common::{case_options, rank_rngs, Case, Round, Routing};

/// The cases every rank runs, each on a fresh buffer.
fn cases() -> Vec<Case> {
    vec![
        Case {
            alignment: 4,
            biases: 2,
            ..Case::new("bf16_topk")
        },
        Case {
            fp8: true,
            biases: 1,
            ..Case::new("fp8_topk")
        },
        Case {
            cached: true,
            biases: 1,
            ..Case::new("bf16_cached")
        },
        Case {
            worst: true,
            fp8: true,
            cached: true,
            max_tokens: 128,
            hidden: 2048,
            ..Case::new("fp8_worst_cached")
        },
        Case {
            worst: true,
            max_tokens: 128,
            ..Case::new("bf16_worst")
        },
        Case {
            send_topk: false,
            biases: 1,
            hidden: 1024,
            ..Case::new("bf16_no_topk")
        },
        // Only rank 0 receives anything; the others get (and combine) zero rows.
        Case {
            routing: Routing::OnlyRank0,
            max_tokens: 64,
            hidden: 512,
            ..Case::new("only_rank0")
        },
        Case {
            routing: Routing::OnlyRank0,
            worst: true,
            max_tokens: 64,
            hidden: 512,
            ..Case::new("only_rank0_worst")
        },
        // Several rounds on one buffer: pooled regions reused, barrier epochs advancing.
        Case {
            async_chain: true,
            iterations: 3,
            max_tokens: 256,
            hidden: 4096,
            biases: 1,
            ..Case::new("async_chain")
        },
        Case {
            max_tokens: 37,
            hidden: 8,
            topk: 1,
            experts_per_rank: 1,
            biases: 2,
            ..Case::new("tiny_rows")
        },
    ]
}

type Res = Result<(), String>;

fn text(e: EpError) -> String {
    e.to_string()
}

/// Runs `body` as `ranks` processes (this test binary re-executed, running only `test`).
fn launch(ranks: usize, test: &str, body: fn(&TcpCommunicator, u64) -> Res) {
    let Some(ctxs) = rank_gpus(ranks) else { return };
    // The launcher itself needs no GPU; each rank opens its own.
    drop(ctxs);
    let s = seed();
    let r = Launcher::new(ranks)
        .libtest(test)
        .env("EP_TEST_SEED", s.to_string())
        .timeout(Duration::from_secs(220))
        .run(|comm| body(comm, s));
    if let Err(e) = r {
        panic!("seed {s}: {e}");
    }
}

/// One rank: every case against the reference, then mismatched options and a missing peer.
fn rank_main(comm: &TcpCommunicator, seed: u64) -> Res {
    let (r, ranks) = (comm.rank(), comm.world_size());
    if comm.same_process() {
        return Err("a TCP rank claims to share the process with its peers".into());
    }
    let ctx = rank_context(comm.local_rank()).map_err(|e| e.to_string())?;
    for (i, c) in cases().iter().enumerate() {
        let t0 = Instant::now();
        let mut buf = Buffer::new(&ctx, comm, &case_options(c, ranks)).map_err(text)?;
        let mut rngs = rank_rngs(seed ^ ((i as u64 + 1) << 40), ranks);
        for it in 0..c.iterations {
            let round = Round::generate(c, ranks, &mut rngs);
            let what = format!("{} it {it} rank {r}/{ranks} (processes)", c.name);
            round.check_rank(c, r, &mut buf, &ctx, &what)?;
        }
        buf.shutdown(comm).map_err(text)?;
        eprintln!(
            "case {} on {ranks} processes: {} iteration(s) match the reference ({:.0} ms)",
            c.name,
            c.iterations,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    options_must_agree(comm, &ctx)?;
    missing_peer_is_a_bounded_error(comm, &ctx)
}

/// A rank built with other options makes every rank's `Buffer::new` fail at once, naming it.
fn options_must_agree(comm: &TcpCommunicator, ctx: &Arc<CudaContext>) -> Res {
    let ranks = comm.world_size();
    let last = ranks - 1;
    let tokens = if comm.rank() == last { 32 } else { 16 };
    let t0 = Instant::now();
    let e = match Buffer::new(ctx, comm, &BufferOptions::new(tokens, 128, 2, 2 * ranks)) {
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
    let names = if comm.rank() == last {
        "rank 0"
    } else {
        &format!("rank {last}")
    };
    if !msg.contains(names) {
        return Err(format!("mismatched options: {msg} does not name {names}"));
    }
    eprintln!("mismatched options: {msg}");
    Ok(())
}

/// Rank 0 dispatches while the others do not: its dispatch comes back, within the bound, with
/// an error naming a peer and the wait; the buffer is unusable afterwards; every rank still
/// tears down together.
fn missing_peer_is_a_bounded_error(comm: &TcpCommunicator, ctx: &Arc<CudaContext>) -> Res {
    let ranks = comm.world_size();
    let mut opts = BufferOptions::new(16, 128, 2, 2 * ranks);
    opts.timeout = Duration::from_millis(300);
    let mut buf = Buffer::new(ctx, comm, &opts).map_err(text)?;
    if comm.rank() == 0 {
        let ids: Vec<i32> = (0..16).map(|i| (i % (2 * ranks)) as i32).collect();
        let ids = Tensor::from_host(ctx, &ids, &[8, 2]).map_err(text)?;
        let x = Tensor::from_host(ctx, &[Bf16(0x3f80); 8 * 128], &[8, 128]).map_err(text)?;
        let layout = buf.get_dispatch_layout(&ids).map_err(text)?;
        let t0 = Instant::now();
        let err = match buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &layout, ranks)) {
            Ok(_) => return Err("a dispatch without its peers succeeded".into()),
            Err(e) => e,
        };
        eprintln!("missing peers, after {:?}: {err}", t0.elapsed());
        if t0.elapsed() > Duration::from_secs(5) {
            return Err(format!("not bounded: {:?}", t0.elapsed()));
        }
        match &err {
            EpError::PeerTimeout {
                rank: 0,
                peer,
                what: "dispatch count exchange",
                ..
            } if *peer != 0 && *peer < ranks => {}
            other => return Err(format!("unexpected error: {other}")),
        }
        match buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &layout, ranks)) {
            Err(EpError::Poisoned { .. }) => {}
            other => return Err(format!("after a timeout: {other:?}")),
        }
        // The shutdown reports the recorded error again; it still meets the other ranks.
        let _ = buf.shutdown(comm);
        return Ok(());
    }
    buf.shutdown(comm).map_err(text)
}

#[test]
fn gpu_intranode_procs_ep2() {
    launch(2, "gpu_intranode_procs_ep2", rank_main);
}

#[test]
fn gpu_intranode_procs_ep4() {
    launch(4, "gpu_intranode_procs_ep4", rank_main);
}
