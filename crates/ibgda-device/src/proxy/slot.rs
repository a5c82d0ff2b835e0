//! The producer slot: the one 8-byte word per QP through which device code hands its new
//! producer index to the CPU proxy in the CPU handler modes.
//!
//! The GPU raises it with a system-scope fence and a plain store (`fence.acq_rel.sys`, then
//! `st.relaxed.sys.u64`) while it holds the QP's publish turn, and with a system-scope release `atomicMax` (`red.release.sys.max.u64`) when
//! it flushes batched publishes; the value only grows (`protocol.cuh`, `ibgda_publish`, has the
//! argument). The proxy reads it with one aligned 8-byte load. Both sides rely on it being a
//! naturally aligned `u64`: a misaligned or narrower slot could be read torn, or the GPU's 64-bit
//! store or atomic would clobber a neighbour. This type refuses any other pointer, and the layout is asserted here and in
//! `protocol.cuh` (`ibgda_check_desc`).

use core::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Bytes of one producer slot.
pub const PRODUCER_SLOT_BYTES: usize = 8;
/// Alignment a producer slot must have.
pub const PRODUCER_SLOT_ALIGN: usize = 8;

static_assertions::const_assert_eq!(core::mem::size_of::<u64>(), PRODUCER_SLOT_BYTES);
static_assertions::const_assert_eq!(core::mem::size_of::<AtomicU64>(), PRODUCER_SLOT_BYTES);
static_assertions::const_assert_eq!(core::mem::align_of::<AtomicU64>(), PRODUCER_SLOT_ALIGN);
static_assertions::const_assert_eq!(
    core::mem::offset_of!(crate::qp_desc::QpDesc, producer_slot) % PRODUCER_SLOT_ALIGN,
    0
);

/// Why a pointer cannot be a producer slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// A null pointer.
    #[error("producer slot pointer is null")]
    Null,
    /// Not 8-byte aligned.
    #[error("producer slot at {0:#x} is not 8-byte aligned")]
    Misaligned(usize),
}

/// A CPU view of one QP's producer slot: pinned host memory (mode `cpu_host_memory`) or GPU
/// memory mapped for the CPU through GDRCopy (mode `cpu`).
#[derive(Debug)]
pub struct ProducerSlot {
    ptr: NonNull<u64>,
}

// SAFETY: the slot is a word of memory another agent (the GPU) writes; this type only ever reads
// it with volatile 8-byte loads, which is sound from any thread while the memory lives (`new`).
unsafe impl Send for ProducerSlot {}
// SAFETY: as for Send: `&self` only performs reads.
unsafe impl Sync for ProducerSlot {}

impl ProducerSlot {
    /// A view of the slot at CPU address `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` is readable for 8 bytes for as long as the `ProducerSlot` (and any proxy it is
    /// given to) lives, and is written only as a whole 8-byte word (the GPU's atomic, or host
    /// code's 8-byte stores).
    pub unsafe fn new(ptr: *const u64) -> Result<Self, SlotError> {
        let ptr = NonNull::new(ptr as *mut u64).ok_or(SlotError::Null)?;
        check_alignment(ptr.as_ptr() as usize)?;
        Ok(Self { ptr })
    }

    /// The value now: the highest producer index published so far (acquire: the WQEs below it
    /// are visible once it is seen).
    #[inline]
    pub fn load(&self) -> u64 {
        // SAFETY: aligned and readable (`new`'s contract); volatile because another agent writes
        // it, and one aligned 8-byte load is never torn.
        let v = unsafe { core::ptr::read_volatile(self.ptr.as_ptr()) };
        fence(Ordering::Acquire);
        v
    }

    /// The CPU address.
    pub fn as_ptr(&self) -> *const u64 {
        self.ptr.as_ptr()
    }
}

/// `Ok` if `addr` can hold a producer slot (non-zero, 8-byte aligned).
pub fn check_alignment(addr: usize) -> Result<(), SlotError> {
    if addr == 0 {
        Err(SlotError::Null)
    } else if addr % PRODUCER_SLOT_ALIGN != 0 {
        Err(SlotError::Misaligned(addr))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_aligned_u64_slots() {
        let words = [AtomicU64::new(7), AtomicU64::new(9)];
        // SAFETY: `words` outlives the views; it is only written as whole words.
        let s = unsafe { ProducerSlot::new(words[1].as_ptr()) }.unwrap();
        assert_eq!(s.load(), 9);
        words[1].fetch_max(12, Ordering::Release);
        assert_eq!(s.load(), 12);
        let odd = (words[0].as_ptr() as usize + 4) as *const u64;
        // SAFETY: never dereferenced: construction fails.
        let misaligned = unsafe { ProducerSlot::new(odd) };
        assert_eq!(misaligned.unwrap_err(), SlotError::Misaligned(odd as usize));
        // SAFETY: as above.
        let null = unsafe { ProducerSlot::new(core::ptr::null()) };
        assert_eq!(null.unwrap_err(), SlotError::Null);
    }
}
