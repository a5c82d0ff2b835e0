//! The proxy's doorbell on the emulated NIC: the doorbell record in host memory, then the
//! emulator's doorbell, either its direct doorbell (one atomic on the QP's doorbell word, waking
//! the progress thread only if it sleeps) or a store to the QP's emulated UAR page (the same code
//! path as a real UAR, [`Mlx5UarDoorbell`]).
//!
//! The direct path is what the proxy's latency rests on, so it does no more than hardware needs:
//! a release store of the record's send counter, then the doorbell word. No lock, no lookup, no
//! allocation.

use std::any::Any;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use ibgda_device::proxy::{Doorbell, Mlx5UarDoorbell};
use ibgda_device::wire::{dbr_send_word, DoorbellRecord, DBR_SEND_OFFSET};
use ibgda_emu::DirectDoorbell;

/// How the proxy rings an emulated QP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ProxyDoorbell {
    /// `Nic::ring_doorbell`, the emulator's direct doorbell (wakes an idle progress thread).
    #[default]
    Direct,
    /// An 8-byte store to the QP's emulated UAR page, as the proxy does on real hardware.
    UarPage,
}

/// Called by the proxy right after it rings a QP: (QP index in its group, producer index).
/// Instrumentation for benchmarks and tests; it runs on the proxy thread, so it must be quick.
#[derive(Clone)]
pub struct DoorbellHook(pub Arc<dyn Fn(u32, u64) + Send + Sync>);

impl std::fmt::Debug for DoorbellHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DoorbellHook(..)")
    }
}

/// One emulated QP's doorbell as the proxy rings it.
pub struct EmuDoorbell {
    how: How,
    hook: Option<(DoorbellHook, u32)>,
    /// Keeps the memory behind the raw pointers alive as long as the proxy thread holds this.
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

enum How {
    Direct {
        db: DirectDoorbell,
        /// The send counter of the QP's doorbell record.
        send_counter: *mut u32,
        /// Keeps the NIC (and its progress thread) alive as long as the proxy can ring it.
        _nic: Arc<ibgda_emu::Nic>,
    },
    Uar(Mlx5UarDoorbell),
}

// SAFETY: `send_counter` points into host memory kept alive by `_keep`; one proxy thread at a
// time rings through this value (the `Doorbell` contract), and `Nic` and `DirectDoorbell` are
// Send + Sync.
unsafe impl Send for EmuDoorbell {}

impl EmuDoorbell {
    /// The doorbell of emulated QP `qpn`, with its doorbell record at host address `dbr`.
    /// `None` when `dbr` is null or misaligned, the QP does not exist on `nic`, or
    /// [`ProxyDoorbell::UarPage`] is asked for without a UAR page.
    ///
    /// # Safety
    ///
    /// `dbr` is the QP's doorbell record (8 bytes, 8-byte aligned) in memory that `keep` keeps
    /// alive; with [`ProxyDoorbell::UarPage`], `uar_bf` is the host address of the QP's emulated
    /// BlueFlame register, alive as long as the QP exists on `nic`, which must outlive this value.
    pub unsafe fn new(
        nic: Arc<ibgda_emu::Nic>,
        qpn: u32,
        dbr: u64,
        how: ProxyDoorbell,
        uar_bf: Option<u64>,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Option<Self> {
        if dbr == 0 || dbr % 8 != 0 {
            return None;
        }
        let dbr_ptr = dbr as *mut DoorbellRecord;
        let how = match how {
            ProxyDoorbell::Direct => How::Direct {
                db: nic.direct_doorbell(qpn).ok()?,
                send_counter: (dbr as usize + DBR_SEND_OFFSET) as *mut u32,
                _nic: nic,
            },
            ProxyDoorbell::UarPage => {
                let bf = uar_bf? as *mut u64;
                // SAFETY: the caller vouches for both pointers (see above).
                let db = unsafe { Mlx5UarDoorbell::new(dbr_ptr, bf, qpn) }?;
                How::Uar(db)
            }
        };
        Some(Self {
            how,
            hook: None,
            _keep: keep,
        })
    }

    /// Calls `hook` with `qp_index` after every ring.
    pub fn with_hook(mut self, hook: Option<DoorbellHook>, qp_index: u32) -> Self {
        self.hook = hook.map(|h| (h, qp_index));
        self
    }
}

impl Doorbell for EmuDoorbell {
    fn ring(&mut self, pi: u64) {
        match &mut self.how {
            How::Direct {
                db, send_counter, ..
            } => {
                let word = u32::from_ne_bytes(dbr_send_word(pi).to_bytes());
                // SAFETY: the send counter of the live, 8-byte aligned record (`new`'s contract),
                // which the emulator reads with atomic loads. Release: the WQEs this proxy saw
                // published (its acquire load of the slot) are visible before the record is.
                unsafe { AtomicU32::from_ptr(*send_counter) }.store(word, Ordering::Release);
                // An atomic RMW, ordered after the record: the NIC never sees the doorbell
                // before the record. A QP destroyed under a late publish ignores it.
                db.ring(pi);
            }
            How::Uar(db) => db.ring(pi),
        }
        if let Some((hook, qp)) = &self.hook {
            (hook.0)(*qp, pi);
        }
    }
}
