//! The completion queue a QP reports to: a normal ring with an owner bit, or a collapsed CQ where
//! every CQE lands in entry 0 (what NVSHMEM's GPU path polls).

use ibgda_device::wire::{cqe_owner_bit, Cqe64};

use crate::backend::Loc;
use crate::error::EmuError;

/// Bytes per CQE (the wire format's, [`ibgda_device::wire::CQE_BYTES`]).
pub const CQE_BYTES: u64 = ibgda_device::wire::CQE_BYTES as u64;

/// How CQEs are laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CqMode {
    /// CQE `i` goes to entry `i & (ncqes - 1)` with owner bit `(i / ncqes) & 1`.
    #[default]
    Ring,
    /// Every CQE goes to entry 0, with owner bit `i & 1` (the `ncqes = 1` ring rule); readers
    /// of a collapsed CQ look at `wqe_counter` and the opcode, not the owner bit.
    Collapsed,
}

/// Where a QP's CQEs go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CqConfig {
    /// First entry; 64-byte aligned.
    pub loc: Loc,
    /// Entries; a power of two (1 for a collapsed CQ is usual).
    pub ncqes: u32,
    /// Ring or collapsed.
    pub mode: CqMode,
}

impl CqConfig {
    /// A ring of `ncqes` entries at `loc`.
    pub const fn ring(loc: Loc, ncqes: u32) -> Self {
        Self {
            loc,
            ncqes,
            mode: CqMode::Ring,
        }
    }

    /// A collapsed CQ: one entry at `loc`.
    pub const fn collapsed(loc: Loc) -> Self {
        Self {
            loc,
            ncqes: 1,
            mode: CqMode::Collapsed,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), EmuError> {
        if !self.ncqes.is_power_of_two() {
            return Err(EmuError::BadConfig(format!(
                "CQ size {} is not a power of two",
                self.ncqes
            )));
        }
        if self.loc.addr() % CQE_BYTES != 0 {
            return Err(EmuError::BadConfig(format!(
                "CQ at {:#x} is not 64-byte aligned",
                self.loc.addr()
            )));
        }
        Ok(())
    }

    /// Bytes the entries span.
    pub const fn bytes(&self) -> u64 {
        match self.mode {
            CqMode::Ring => self.ncqes as u64 * CQE_BYTES,
            CqMode::Collapsed => CQE_BYTES,
        }
    }
}

/// Assigns CQE slots and owner bits in order.
#[derive(Debug)]
pub(crate) struct CqWriter {
    pub cfg: CqConfig,
    /// CQEs produced so far (assigned a slot).
    pub produced: u64,
}

impl CqWriter {
    pub fn new(cfg: CqConfig) -> Self {
        Self { cfg, produced: 0 }
    }

    /// The slot and bytes of the next CQE; `make` builds it given its owner bit.
    pub fn next(&mut self, make: impl FnOnce(u8) -> Cqe64) -> (Loc, [u8; 64]) {
        let i = self.produced;
        self.produced += 1;
        let (slot, owner) = match self.cfg.mode {
            CqMode::Ring => (
                i & (self.cfg.ncqes as u64 - 1),
                cqe_owner_bit(i, self.cfg.ncqes),
            ),
            CqMode::Collapsed => (0, cqe_owner_bit(i, 1)),
        };
        let cqe = make(owner);
        let mut bytes = [0u8; 64];
        bytes.copy_from_slice(bytemuck::bytes_of(&cqe));
        (self.cfg.loc.offset(slot * CQE_BYTES), bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ibgda_device::wire::{Cqe64, CqeState};

    #[test]
    fn ring_slots_and_owner_bits_follow_the_consumer_rule() {
        let mut w = CqWriter::new(CqConfig::ring(Loc::Host(0x1000), 4));
        for i in 0..12u64 {
            let (loc, bytes) = w.next(|o| Cqe64::requester(o, i as u16, 5, 0, 0));
            assert_eq!(loc, Loc::Host(0x1000 + (i % 4) * 64));
            let cqe: Cqe64 = bytemuck::pod_read_unaligned(&bytes);
            assert_eq!(cqe.status(i, 4).state(), Some(CqeState::Ok), "CQE {i}");
        }
    }

    #[test]
    fn collapsed_cq_uses_entry_zero() {
        let mut w = CqWriter::new(CqConfig::collapsed(Loc::Host(0x40)));
        for i in 0..5u64 {
            let (loc, bytes) = w.next(|o| Cqe64::requester(o, i as u16, 5, 0, 0));
            assert_eq!(loc, Loc::Host(0x40));
            assert_eq!(bytes[63] & 1, (i & 1) as u8);
        }
    }
}
