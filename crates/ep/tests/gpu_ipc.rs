//! Buffers shared between ranks: CUDA IPC between processes (launched by `Launcher`, spread
//! round robin over the GPUs: same-device IPC where they share one) and peer access between
//! threads (plain pointers where they share a GPU), each rank copying every peer's buffer through
//! the address `exchange_buffers` gave it and checking every byte.

use std::error::Error;
use std::sync::Arc;

use ep::bootstrap::{
    exchange_buffers, Communicator, JobToken, Launcher, PeerBuffer, RankConfig, TcpCommunicator,
    ThreadGroup,
};
use ep_kernels::testing::{rank_context, rank_gpus, seed, Rng};
use ibgda_device::cuda::{CudaContext, DeviceBuffer};

type Res<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// 16 MiB and an odd tail: several times the L2, and no rounding to a nice size hides an
/// off-by-one.
const LEN: usize = (16 << 20) + 7;
const POISON: u8 = 0xA5;

fn pattern(rank: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut v = Vec::with_capacity(LEN + 8);
    while v.len() < LEN {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(LEN);
    v
}

/// This rank's buffer, filled with its pattern.
fn own_buffer(ctx: &Arc<CudaContext>, rank: usize, seed: u64) -> Res<DeviceBuffer> {
    let buf = DeviceBuffer::new(ctx, LEN)?;
    buf.upload(0, &pattern(rank, seed))?;
    // A copy from pageable memory may return before its DMA lands; peers read right after the
    // exchange, so wait for it (the legacy stream it ran on, bounded: a context-wide
    // synchronisation would wait forever for an emulated NIC's GPU agent).
    ibgda_device::cuda::wait_legacy_stream(ctx, std::time::Duration::from_secs(60), "an upload")?;
    Ok(buf)
}

/// Copies every other rank's buffer into a poisoned local one (copy engine, through the peer
/// address) and checks every byte against that rank's pattern.
fn check_peers(ctx: &Arc<CudaContext>, me: usize, peers: &[PeerBuffer], seed: u64) -> Res {
    for p in peers {
        assert_eq!(p.len(), LEN, "rank {me}: rank {}'s length", p.rank());
        if p.rank() == me {
            assert!(p.is_own());
            continue;
        }
        let dst = DeviceBuffer::new(ctx, LEN)?;
        dst.fill_bytes(POISON)?;
        ctx.bind_to_thread()?;
        // SAFETY: both ranges are LEN bytes of live allocations valid in the current context:
        // `dst` is ours, `p.ptr()` is the peer's buffer mapped here by exchange_buffers, and the
        // peer keeps it alive until the barrier after this check.
        unsafe { cudarc::driver::sys::cuMemcpyDtoD_v2(dst.ptr(), p.ptr(), LEN) }.result()?;
        let got = dst.download::<u8>(0, LEN)?;
        let want = pattern(p.rank(), seed);
        let wrong: Vec<usize> = (0..LEN).filter(|&i| got[i] != want[i]).collect();
        assert!(
            wrong.is_empty(),
            "rank {me}: {} of {LEN} bytes of rank {}'s buffer wrong, first at {:?}",
            wrong.len(),
            p.rank(),
            &wrong[..wrong.len().min(5)]
        );
        eprintln!(
            "rank {me}: read rank {}'s {LEN} bytes through {}: all correct",
            p.rank(),
            if p.is_ipc() {
                "CUDA IPC"
            } else {
                "peer access"
            }
        );
    }
    Ok(())
}

/// One rank's part, whatever kind of communicator it has.
fn rank_body(comm: &dyn Communicator, ctx: &Arc<CudaContext>, seed: u64, ipc: bool) -> Res {
    let buf = own_buffer(ctx, comm.rank(), seed)?;
    let peers = exchange_buffers(comm, ctx, &buf)?;
    assert_eq!(peers.len(), comm.world_size());
    for p in &peers {
        if p.rank() != comm.rank() {
            assert_eq!(
                p.is_ipc(),
                ipc,
                "rank {}: how rank {} is reached",
                comm.rank(),
                p.rank()
            );
        }
    }
    check_peers(ctx, comm.rank(), &peers, seed)?;
    // Nobody frees its buffer (or unmaps a peer's) while another rank may still be reading it.
    comm.barrier()?;
    drop(peers);
    comm.barrier()?;
    Ok(())
}

#[test]
fn ipc_between_processes() {
    let Some(ctxs) = rank_gpus(2) else { return };
    drop(ctxs);
    // The launcher passes the seed on, so every rank draws the same patterns.
    let seed = seed();
    let r = Launcher::new(2)
        .libtest("ipc_between_processes")
        .env("EP_TEST_SEED", seed.to_string())
        .timeout(std::time::Duration::from_secs(180))
        .run(|comm| -> Res {
            let ctx = rank_context(comm.local_rank())?;
            assert!(!comm.same_process());
            rank_body(comm, &ctx, seed, true)
        });
    if let Err(e) = r {
        panic!("{e}");
    }
}

#[test]
fn peer_access_between_threads() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let seed = seed();
    let comms = ThreadGroup::new(2).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(&ctxs)
            .map(|(comm, ctx)| s.spawn(move || rank_body(&comm, ctx, seed, false)))
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
}

/// TCP ranks that happen to be threads of one process are told apart from processes and use
/// peer access (a handle cannot be opened in the process that exported it).
#[test]
fn tcp_ranks_in_one_process_use_peer_access() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let seed = seed();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let token = JobToken::generate().unwrap();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let hs: Vec<_> = ctxs
            .iter()
            .enumerate()
            .map(|(rank, ctx)| {
                let cfg = RankConfig::new(rank, 2, port).unwrap().with_token(token);
                let l = listener.take().filter(|_| rank == 0);
                s.spawn(move || -> Res {
                    let comm = match l {
                        Some(l) => TcpCommunicator::with_listener(&cfg, l)?,
                        None => TcpCommunicator::connect(&cfg)?,
                    };
                    rank_body(&comm, ctx, seed, false)
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
}

/// A communicator in the middle (a forged rank 0 relays every record): passes everything through
/// but rewrites the address in rank 1's buffer record, keeping every other byte, so rank 0 would
/// see "rank 1's buffer, in your process, at this address".
struct Forger<'a> {
    inner: &'a dyn Communicator,
    ptr: u64,
}

impl Communicator for Forger<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn same_process(&self) -> bool {
        self.inner.same_process()
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, ep::bootstrap::BootstrapError> {
        let mut all = self.inner.all_gather_bytes(mine)?;
        // Record layout: kind, salt[16], tag[32], ordinal u32, len u64, ptr u64, handle flag.
        let at = 1 + 16 + 32 + 4 + 8;
        if self.rank() == 0 && all[1].len() >= at + 8 {
            all[1][at..at + 8].copy_from_slice(&self.ptr.to_le_bytes());
        }
        Ok(all)
    }
    fn barrier(&self) -> Result<(), ep::bootstrap::BootstrapError> {
        self.inner.barrier()
    }
}

#[test]
fn a_forged_record_cannot_pass_an_arbitrary_pointer_for_same_process_memory() {
    let Some(ctxs) = ep_kernels::testing::gpus(1) else {
        return;
    };
    let ctx = &ctxs[0];
    let comms = ThreadGroup::new(2).unwrap();
    // Rank 0's own other allocation: a pointer that is even valid in this process, which the
    // forger wants rank 0 to treat as rank 1's buffer (and write to).
    let victim = DeviceBuffer::new(ctx, LEN).unwrap();
    let results: Vec<Result<Vec<PeerBuffer>, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let victim = &victim;
                s.spawn(move || {
                    let buf = DeviceBuffer::new(ctx, LEN).map_err(|e| e.to_string())?;
                    let forger = Forger {
                        inner: c,
                        ptr: victim.ptr(),
                    };
                    let got = exchange_buffers(&forger, ctx, &buf).map_err(|e| e.to_string());
                    let _ = c.barrier();
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let msg = match &results[0] {
        Err(m) => m.clone(),
        Ok(peers) => panic!(
            "rank 0 accepted rank 1's forged record: {:?} at {:#x}",
            peers[1],
            peers[1].ptr()
        ),
    };
    assert!(msg.contains("rank 1"), "{msg}");
    // Rank 1's view was not tampered with.
    assert!(results[1].is_ok(), "{:?}", results[1].as_ref().err());
}
