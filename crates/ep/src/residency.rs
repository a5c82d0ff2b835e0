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
//! Ranks in *other processes* on the same GPU are not co-resident with ours at all: without MPS
//! the GPU time-slices between processes, and a spinning kernel is preempted at the end of its
//! slice. That is correct but slow (about 4.6 ms per handshake round on an H200, measured
//! 2026-12-01), so it is logged once per buffer, and the time bounds are seconds, not
//! microseconds.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::error::EpError;
use crate::rendezvous::Exchange;

/// SMs the emulated NIC keeps for itself on every GPU it serves. It moves bytes with copy
/// engines and host threads, so it needs none: a kernel that spins while it waits for the
/// emulator cannot starve it (DESIGN.md, "Testing without a NIC").
pub const EMULATED_NIC_SMS: u32 = 0;

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
}

/// What a rank publishes so the others can tell who shares its GPU: the GPU's UUID (two words)
/// and the process (host name hash and process id: the same pid on two hosts is two processes,
/// and those never share a GPU anyway).
fn identity(ctx: &CudaContext, rank: usize) -> Result<[u64; 3], EpError> {
    let uuid = ctx.uuid().map_err(|source| EpError::Cuda {
        rank,
        call: "cuDeviceGetUuid",
        source,
    })?;
    let b: Vec<u8> = uuid.bytes.iter().map(|&c| c as u8).collect();
    let lo = u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
    let hi = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
    Ok([lo, hi, process_key()])
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
            if id.len() != 3 {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!("rank {r} sent a GPU identity of {} words, not 3", id.len()),
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
        let share = GpuShare {
            rank,
            ordinal,
            sms,
            threads,
            processes,
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn share(rank: usize, ids: &[[u64; 3]]) -> GpuShare {
        let all: Vec<Vec<u64>> = ids.iter().map(|i| i.to_vec()).collect();
        GpuShare::from_identities(rank, 0, 132, &all).unwrap()
    }

    #[test]
    fn ranks_are_grouped_by_gpu_and_process() {
        // Ranks 0, 1, 3 on GPU A in process 7; rank 2 on GPU A in process 8; rank 4 on GPU B.
        let ids = [[1, 1, 7], [1, 1, 7], [1, 1, 8], [1, 1, 7], [2, 2, 7]];
        let s = share(1, &ids);
        assert_eq!(s.threads, vec![0, 1, 3]);
        assert_eq!(s.processes, vec![2]);
        assert_eq!(s.co_resident(), 3);
        assert_eq!(share(4, &ids).threads, vec![4]);
        assert!(share(4, &ids).processes.is_empty());
    }

    #[test]
    fn the_budget_fits_every_co_resident_rank() {
        let ids = [[1, 1, 7]; 8];
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
    fn more_ranks_than_sms_is_refused_by_name() {
        let ids = [[1, 1, 7]; 3];
        let all: Vec<Vec<u64>> = ids.iter().map(|i| i.to_vec()).collect();
        let s = GpuShare::from_identities(0, 0, 2, &all).unwrap();
        assert!(matches!(
            s.default_budget("intranode dispatch", 0),
            Err(EpError::SmBudget { fits: 0, .. })
        ));
    }

    #[test]
    fn ranks_in_other_processes_do_not_count_against_the_budget() {
        let ids = [[1, 1, 7], [1, 1, 8], [1, 1, 9]];
        let s = share(0, &ids);
        assert_eq!(s.co_resident(), 1);
        assert_eq!(s.default_budget("x", 0).unwrap(), 132);
    }

    #[test]
    fn a_malformed_identity_is_a_rendezvous_error() {
        let all = vec![vec![1, 1, 7], vec![1, 1]];
        assert!(matches!(
            GpuShare::from_identities(0, 0, 132, &all),
            Err(EpError::Rendezvous { .. })
        ));
    }
}
