//! What the proxy rings through: the [`Doorbell`] of one QP.
//!
//! For a real mlx5 NIC that is [`Mlx5UarDoorbell`]: the doorbell record in host memory, then the
//! 8-byte doorbell word stored to the BlueFlame register of the QP's UAR page mapped for the CPU.
//! For the emulated NIC the transport layer (`ep::transport`) implements it over the emulator's
//! doorbell.

use core::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};

use crate::wire::{db_word, dbr_send_word, DoorbellRecord};

/// Rings one QP's NIC doorbell. Owned by the proxy thread that serves the QP, so never called
/// concurrently for the same QP.
pub trait Doorbell: Send {
    /// Tells the NIC that the QP's send ring is valid below producer index `pi` (monotonic: each
    /// call passes a larger value than the last): the doorbell record's send counter first, then
    /// the doorbell itself, ordered.
    fn ring(&mut self, pi: u64);
}

impl<F: FnMut(u64) + Send> Doorbell for F {
    fn ring(&mut self, pi: u64) {
        self(pi)
    }
}

/// A real mlx5 QP's doorbell as the CPU rings it: the doorbell record (host memory in the CPU
/// modes) and the BlueFlame register at `UAR + 0x800` mapped into this process.
///
/// Never run on a real NIC on this project's machines (they have none); CI runs it against the
/// emulated NIC's UAR page through the verbs driver seam (`ibgda-emu`'s `verbs_on_emu` test).
/// Built from the same wire helpers as the GPU path.
#[derive(Debug)]
pub struct Mlx5UarDoorbell {
    dbr: NonNull<DoorbellRecord>,
    bf: NonNull<u64>,
    qpn: u32,
}

// SAFETY: the pointers name memory (the doorbell record, the UAR page) that `new`'s caller keeps
// mapped for the doorbell's life; one proxy thread at a time rings through it.
unsafe impl Send for Mlx5UarDoorbell {}

impl Mlx5UarDoorbell {
    /// The doorbell of QP `qpn`, whose doorbell record is at `dbr` and whose UAR BlueFlame
    /// register (UAR page + `UAR_BF_OFFSET`) is mapped at `bf`.
    ///
    /// # Safety
    ///
    /// `dbr` is the QP's live doorbell record (8 bytes, 4-byte aligned) and `bf` its BlueFlame
    /// register mapped write-combining or uncached (8-byte aligned), both valid for the
    /// doorbell's lifetime; nothing else rings this QP meanwhile.
    pub unsafe fn new(dbr: *mut DoorbellRecord, bf: *mut u64, qpn: u32) -> Option<Self> {
        if (bf as usize) % 8 != 0 {
            return None;
        }
        Some(Self {
            dbr: NonNull::new(dbr)?,
            bf: NonNull::new(bf)?,
            qpn,
        })
    }
}

impl Doorbell for Mlx5UarDoorbell {
    fn ring(&mut self, pi: u64) {
        // The WQEs were made visible by the GPU before it raised the producer slot, and the
        // proxy's acquire load of the slot orders this after it.
        // SAFETY: the live doorbell record (`new`'s contract); the NIC reads it, hence volatile.
        unsafe {
            core::ptr::addr_of_mut!((*self.dbr.as_ptr()).send_counter)
                .write_volatile(dbr_send_word(pi))
        };
        // The record reaches memory before the NIC can be told to look (x86: a full fence, which
        // also drains write-combining buffers).
        fence(Ordering::SeqCst);
        // SAFETY: the mapped BlueFlame register, 8-byte aligned (`new`); one 8-byte store.
        unsafe { self.bf.as_ptr().write_volatile(db_word(self.qpn, pi)) };
        // Flush the write-combining buffer so the doorbell leaves now, not with a later store.
        fence(Ordering::SeqCst);
    }
}
