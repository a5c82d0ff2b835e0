//! Which ranks of a group share this rank's GPU, and the SM budget that keeps their kernels
//! co-resident.
//!
//! A kernel whose blocks wait for blocks of other ranks (low-latency dispatch and combine wait in
//! every block; intranode's last block waits for its peers) makes progress only if the blocks it
//! waits for are running too. Ranks that are threads of one process share the GPU's primary
//! context: their kernels run side by side, so together they must fit on the GPU's SMs (one
//! block per SM, which is what every waiting kernel of `ep-kernels` is launched for). A
//! configuration that does not fit is refused before launch with [`EpError::SmBudget`], naming
//! the numbers, never left to time out.
//!
//! Co-residency is not enough for ranks that share a context: many driver calls (a device or
//! pinned allocation, a free, a module load) wait for, or queue behind, the work already in the
//! context, so a rank that allocates while another rank's kernel spins waiting for it would
//! stall both until the bound runs out. The [`LaunchGate`] closes that gap: the ranks of this
//! process on one GPU meet on the host right before each launch of a waiting kernel (so every one
//! has finished its own preparation) and again right after (so every one has launched before any
//! goes on to free or allocate).
//!
//! Ranks in *other processes* on the same GPU are not co-resident with ours at all: without MPS
//! the GPU time-slices between processes, and a spinning kernel is preempted at the end of its
//! slice. That is correct but slow (about 4.6 ms per handshake round on an H200, measured
//! 2026-12-01), so it is logged once per buffer, and the time bounds are seconds, not
//! microseconds.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};

use crate::error::EpError;
use crate::rendezvous::Exchange;

/// SMs kept free of waiting kernels on every GPU an emulated NIC serves. The NIC moves bytes
/// with host threads, copies and stream memory operations, but a copy between two addresses of
/// one GPU (every write between ranks that share it) runs as a copy kernel, which needs an SM:
/// with the ranks' spinning grids taking all of them, the copy waits for a kernel that waits
/// for it. Seen on one H200 on 2026-12-02 (EP2 as threads, 66 SMs each): both NIC threads
/// waiting on their copies while both ranks' send kernels spun in quiet, until the bound; it
/// came and went with timing. Four leave room for several copies at once (DESIGN.md, "Testing
/// without a NIC": an SM left free); a real NIC needs none. The NIC's GPU agent
/// ([`ibgda_emu::AGENT_SMS`]: one block, running while the NIC has work and relaunched after
/// an idle exit, so it must find an SM free of waiting kernels) counts against them; at least
/// one more stays for copy kernels.
pub const EMULATED_NIC_SMS: u32 = 4;

const _: () = assert!(
    EMULATED_NIC_SMS > ibgda_emu::AGENT_SMS,
    "an SM for same-device copy kernels besides the emulated NIC's agent"
);

/// Streams a rank's operations use (communication and compute), for the hardware-queue check.
const STREAMS_PER_RANK: usize = 2;

/// How this rank's GPU is shared within its group, from one collective at buffer creation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuShare {
    /// This rank.
    pub rank: usize,
    /// The GPU's ordinal in this process.
    pub ordinal: usize,
    /// SMs of the GPU.
    pub sms: u32,
    /// Ranks on this GPU in this process, this one included, in rank order: their kernels run
    /// at the same time and must fit on the GPU together.
    pub threads: Vec<usize>,
    /// Ranks on this GPU in other processes: time-sliced with this process's kernels.
    pub processes: Vec<usize>,
    /// The key of this GPU's launch gate in this group (the same on every rank of `threads`).
    gate_key: u64,
}

/// What a rank publishes so the others can tell who shares its GPU: the GPU's UUID (two words),
/// the process (host name hash and process id: the same pid on two hosts is two processes, and
/// those never share a GPU anyway), and a random word that names the group's gate (the lowest
/// co-resident rank's word is the key every rank of that GPU picks).
fn identity(ctx: &CudaContext, rank: usize) -> Result<[u64; 4], EpError> {
    let uuid = ctx.uuid().map_err(|source| EpError::Cuda {
        rank,
        call: "cuDeviceGetUuid",
        source,
    })?;
    let b: Vec<u8> = uuid.bytes.iter().map(|&c| c as u8).collect();
    let lo = u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
    let hi = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
    Ok([lo, hi, process_key(), gate_nonce()])
}

/// A word no other gate of this process has: a counter mixed with the clock.
fn gate_nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (NEXT.fetch_add(1, Ordering::Relaxed) << 40) ^ t
}

fn process_key() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .hash(&mut h);
    (h.finish() & !0xffff_ffff) | u64::from(std::process::id())
}

impl GpuShare {
    /// Learns, with one all-gather over `group`, which ranks share this rank's GPU (`ctx`).
    /// Every rank of the group calls it at the same time.
    pub fn gather<C: Exchange + ?Sized>(
        ctx: &Arc<CudaContext>,
        group: &C,
    ) -> Result<GpuShare, EpError> {
        let rank = group.rank();
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|source| EpError::Cuda {
                rank,
                call: "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
                source,
            })?
            .max(1) as u32;
        let mine = identity(ctx, rank)?;
        let all = group.all_gather(&mine)?;
        Self::from_identities(rank, ctx.ordinal(), sms, &all)
    }

    fn from_identities(
        rank: usize,
        ordinal: usize,
        sms: u32,
        all: &[Vec<u64>],
    ) -> Result<GpuShare, EpError> {
        let mine = all.get(rank).ok_or_else(|| EpError::Rendezvous {
            rank,
            what: format!("the GPU identities have {} entries", all.len()),
        })?;
        let (mut threads, mut processes) = (Vec::new(), Vec::new());
        for (r, id) in all.iter().enumerate() {
            if id.len() != 4 {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!("rank {r} sent a GPU identity of {} words, not 4", id.len()),
                });
            }
            if id[..2] != mine[..2] {
                continue;
            }
            if id[2] == mine[2] {
                threads.push(r);
            } else {
                processes.push(r);
            }
        }
        let gate_key = all[threads[0]][3];
        let share = GpuShare {
            rank,
            ordinal,
            sms,
            threads,
            processes,
            gate_key,
        };
        let queues = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(8);
        if share.threads.len() > 1 && share.threads.len() * STREAMS_PER_RANK > queues {
            tracing::warn!(
                target: "ep",
                "rank {rank}: {} ranks of this process share GPU {ordinal} with {queues} hardware \
                 queues (CUDA_DEVICE_MAX_CONNECTIONS): streams of different ranks may share a \
                 queue, and a kernel can wait there behind another rank's; set \
                 CUDA_DEVICE_MAX_CONNECTIONS=32 before the first CUDA call",
                share.threads.len()
            );
        }
        if !share.processes.is_empty() {
            tracing::warn!(
                target: "ep",
                "rank {rank}: ranks {:?} in other processes share GPU {ordinal}: the GPU \
                 time-slices between processes (no MPS), which is correct but slow (milliseconds \
                 per handshake)",
                share.processes
            );
        }
        Ok(share)
    }

    /// The launch gate of the ranks of this process on this GPU, or `None` when this rank has
    /// it to itself (then nothing is gated).
    pub fn gate(&self) -> Option<Arc<LaunchGate>> {
        if self.threads.len() < 2 {
            return None;
        }
        Some(LaunchGate::shared(
            self.gate_key,
            &self.threads,
            self.ordinal,
        ))
    }

    /// Ranks of this process on this GPU (at least 1: this one).
    pub fn co_resident(&self) -> u32 {
        self.threads.len().max(1) as u32
    }

    /// SMs left for the kernels of this process's ranks once `reserved` are kept (for the
    /// emulated NIC).
    fn usable(&self, reserved: u32) -> u32 {
        self.sms.saturating_sub(reserved)
    }

    /// The largest per-rank block count that keeps this process's ranks on this GPU
    /// co-resident with `reserved` SMs kept free: the default grid of waiting kernels.
    pub fn default_budget(&self, what: &str, reserved: u32) -> Result<u32, EpError> {
        let b = self.usable(reserved) / self.co_resident();
        if b == 0 {
            return Err(self.refuse(what, 1, reserved));
        }
        Ok(b)
    }

    /// Checks that `budget` blocks per rank (one per SM), for every rank of this process on this
    /// GPU, fit on it with `reserved` SMs kept free.
    pub fn check(&self, what: &str, budget: u32, reserved: u32) -> Result<(), EpError> {
        let need = u64::from(budget) * u64::from(self.co_resident());
        if budget == 0 || need > u64::from(self.usable(reserved)) {
            return Err(self.refuse(what, budget, reserved));
        }
        Ok(())
    }

    fn refuse(&self, what: &str, budget: u32, reserved: u32) -> EpError {
        EpError::SmBudget {
            rank: self.rank,
            what: what.to_string(),
            budget,
            ranks_on_gpu: self.co_resident(),
            gpu: self.ordinal,
            sms: self.sms,
            reserved,
            fits: self.usable(reserved) / self.co_resident(),
        }
    }
}

/// The host rendezvous of the ranks of one process that share a GPU (module docs: why), one per
/// GPU and group. Every rank of the group on that GPU holds the same gate.
#[derive(Debug)]
pub struct LaunchGate {
    /// The ranks that meet here, in rank order.
    ranks: Vec<usize>,
    gpu: usize,
    state: Mutex<Round>,
    turned: Condvar,
}

#[derive(Debug, Default)]
struct Round {
    /// Completed rounds: a waiter is released when it moves past the one it joined.
    generation: u64,
    /// Ranks waiting in the current round.
    present: Vec<usize>,
}

/// The gates of this process, by key; dropped with the last buffer that holds one.
fn registry() -> &'static Mutex<HashMap<u64, Weak<LaunchGate>>> {
    static GATES: std::sync::OnceLock<Mutex<HashMap<u64, Weak<LaunchGate>>>> =
        std::sync::OnceLock::new();
    GATES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl LaunchGate {
    fn shared(key: u64, ranks: &[usize], gpu: usize) -> Arc<LaunchGate> {
        let mut map = registry().lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(g) = map.get(&key).and_then(Weak::upgrade) {
            return g;
        }
        let g = Arc::new(LaunchGate::new(ranks.to_vec(), gpu));
        map.insert(key, Arc::downgrade(&g));
        g
    }

    /// A gate for `ranks` (the ranks of one process on GPU `gpu`).
    pub fn new(ranks: Vec<usize>, gpu: usize) -> LaunchGate {
        LaunchGate {
            ranks,
            gpu,
            state: Mutex::new(Round::default()),
            turned: Condvar::new(),
        }
    }

    /// Waits, at most `timeout`, until every rank of the gate has called `meet` for this round.
    /// On timeout this rank leaves the round and the error names the ranks that never came.
    pub fn meet(&self, rank: usize, what: &'static str, timeout: Duration) -> Result<(), EpError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let joined = st.generation;
        st.present.push(rank);
        if st.present.len() >= self.ranks.len() {
            st.present.clear();
            st.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        let deadline = Instant::now().checked_add(timeout);
        while st.generation == joined {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                st.present.retain(|&r| r != rank);
                let missing = self
                    .ranks
                    .iter()
                    .copied()
                    .filter(|r| *r != rank && !st.present.contains(r))
                    .collect();
                return Err(EpError::SharedGpuTimeout {
                    rank,
                    what,
                    missing,
                    gpu: self.gpu,
                    timeout,
                });
            }
            st = self
                .turned
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// Runs `launch` between two rounds of the gate: after every rank has arrived (all have
    /// finished their preparation) and before any goes on (all have launched).
    pub fn around<T>(
        &self,
        rank: usize,
        what: &'static str,
        timeout: Duration,
        launch: impl FnOnce() -> Result<T, EpError>,
    ) -> Result<T, EpError> {
        self.meet(rank, what, timeout)?;
        let out = launch();
        // Also after a failed launch: the others are already on their way to this round.
        self.meet(rank, what, timeout)?;
        out
    }
}

/// `launch` through `gate` (the gate and its bound) when there is one (ranks of this process
/// share the GPU), else directly. Buffers launch their waiting kernels this way; so should a
/// caller replaying a CUDA graph captured from their operations.
pub fn gated<T>(
    gate: Option<(&LaunchGate, Duration)>,
    rank: usize,
    what: &'static str,
    launch: impl FnOnce() -> Result<T, EpError>,
) -> Result<T, EpError> {
    match gate {
        Some((g, timeout)) => g.around(rank, what, timeout, launch),
        None => launch(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(rank: usize, ids: &[[u64; 4]]) -> GpuShare {
        let all: Vec<Vec<u64>> = ids.iter().map(|i| i.to_vec()).collect();
        GpuShare::from_identities(rank, 0, 132, &all).unwrap()
    }

    #[test]
    fn ranks_are_grouped_by_gpu_and_process() {
        // Ranks 0, 1, 3 on GPU A in process 7; rank 2 on GPU A in process 8; rank 4 on GPU B.
        let ids = [
            [1, 1, 7, 10],
            [1, 1, 7, 11],
            [1, 1, 8, 12],
            [1, 1, 7, 13],
            [2, 2, 7, 14],
        ];
        let s = share(1, &ids);
        assert_eq!(s.threads, vec![0, 1, 3]);
        assert_eq!(s.processes, vec![2]);
        assert_eq!(s.co_resident(), 3);
        assert_eq!(share(4, &ids).threads, vec![4]);
        assert!(share(4, &ids).processes.is_empty());
    }

    #[test]
    fn the_budget_fits_every_co_resident_rank() {
        let ids = [[1, 1, 7, 3]; 8];
        let s = share(0, &ids);
        assert_eq!(s.default_budget("x", 0).unwrap(), 16);
        assert_eq!(s.default_budget("x", 4).unwrap(), 16);
        assert_eq!(s.default_budget("x", 5).unwrap(), 15);
        s.check("x", 16, 0).unwrap();
        let e = s.check("low-latency dispatch", 24, 0).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                EpError::SmBudget {
                    budget: 24,
                    ranks_on_gpu: 8,
                    sms: 132,
                    fits: 16,
                    ..
                }
            ),
            "{text}"
        );
        for want in ["24", "8 ranks", "132 SMs", "at most 16"] {
            assert!(text.contains(want), "{want:?} missing from: {text}");
        }
        assert!(s.check("x", 0, 0).is_err());
    }

    #[test]
    fn the_emulated_nic_keeps_sms_free_of_waiting_grids() {
        // Two ranks as threads on one 132-SM GPU: their default grids leave the NIC's copy
        // kernels room, and a grid that would take those SMs is refused.
        let ids = [[1, 1, 7, 3]; 2];
        let s = share(0, &ids);
        let b = s.default_budget("x", EMULATED_NIC_SMS).unwrap();
        const { assert!(EMULATED_NIC_SMS > 0) };
        assert_eq!(b, (132 - EMULATED_NIC_SMS) / 2);
        assert!(b * 2 + EMULATED_NIC_SMS <= 132);
        assert!(s.check("x", 66, EMULATED_NIC_SMS).is_err());
        s.check("x", 66, 0).unwrap();
    }

    #[test]
    fn more_ranks_than_sms_is_refused_by_name() {
        let ids = [[1, 1, 7, 3]; 3];
        let all: Vec<Vec<u64>> = ids.iter().map(|i| i.to_vec()).collect();
        let s = GpuShare::from_identities(0, 0, 2, &all).unwrap();
        assert!(matches!(
            s.default_budget("intranode dispatch", 0),
            Err(EpError::SmBudget { fits: 0, .. })
        ));
    }

    #[test]
    fn ranks_in_other_processes_do_not_count_against_the_budget() {
        let ids = [[1, 1, 7, 1], [1, 1, 8, 2], [1, 1, 9, 3]];
        let s = share(0, &ids);
        assert_eq!(s.co_resident(), 1);
        assert_eq!(s.default_budget("x", 0).unwrap(), 132);
    }

    #[test]
    fn a_malformed_identity_is_a_rendezvous_error() {
        let all = vec![vec![1, 1, 7, 1], vec![1, 1, 7]];
        assert!(matches!(
            GpuShare::from_identities(0, 0, 132, &all),
            Err(EpError::Rendezvous { .. })
        ));
    }

    #[test]
    fn co_resident_ranks_share_one_gate_keyed_by_the_lowest_rank() {
        let ids = [[1, 1, 7, 10], [1, 1, 7, 11], [2, 2, 7, 12]];
        let (a, b) = (share(0, &ids), share(1, &ids));
        assert_eq!(a.gate_key, 10);
        let (ga, gb) = (a.gate().unwrap(), b.gate().unwrap());
        assert!(Arc::ptr_eq(&ga, &gb));
        assert!(share(2, &ids).gate().is_none(), "alone on its GPU: no gate");
    }

    #[test]
    fn the_gate_releases_every_rank_together_round_after_round() {
        let gate = Arc::new(LaunchGate::new(vec![0, 1, 2], 0));
        let launched = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for r in 0..3 {
                let (gate, launched) = (gate.clone(), &launched);
                s.spawn(move || {
                    for round in 0..100usize {
                        gate.around(r, "x", Duration::from_secs(10), || {
                            launched.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            Ok(())
                        })
                        .unwrap();
                        // After the second meeting, all three launched this round.
                        let n = launched.load(std::sync::atomic::Ordering::SeqCst);
                        assert!(n >= 3 * (round + 1), "round {round}: {n}");
                    }
                });
            }
        });
    }

    #[test]
    fn a_rank_that_never_comes_is_named_within_the_bound() {
        let gate = LaunchGate::new(vec![0, 1, 2], 3);
        let t0 = Instant::now();
        let e = gate
            .meet(1, "low-latency dispatch", Duration::from_millis(50))
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(2));
        match &e {
            EpError::SharedGpuTimeout {
                rank: 1,
                missing,
                gpu: 3,
                ..
            } => assert_eq!(missing, &vec![0, 2]),
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains("low-latency dispatch"), "{e}");
        // The round is left clean: a later complete round still passes.
        let gate = Arc::new(gate);
        std::thread::scope(|s| {
            for r in 0..3 {
                let gate = gate.clone();
                s.spawn(move || gate.meet(r, "y", Duration::from_secs(10)).unwrap());
            }
        });
    }
}
