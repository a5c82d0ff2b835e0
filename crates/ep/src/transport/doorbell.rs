//! The proxy's doorbell on the emulated NIC: the doorbell record in host memory, then the
//! emulator's doorbell, either its direct call (which also wakes its progress thread) or a store
//! to the QP's emulated UAR page (the same code path as a real UAR, [`Mlx5UarDoorbell`]).

use std::any::Any;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use ibgda_device::proxy::{Doorbell, Mlx5UarDoorbell};
use ibgda_device::wire::{dbr_send_word, DoorbellRecord, DBR_SEND_OFFSET};

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
        nic: Arc<ibgda_emu::Nic>,
        qpn: u32,
        dbr: *mut DoorbellRecord,
    },
    Uar(Mlx5UarDoorbell),
}

// SAFETY: `dbr` points into host memory kept alive by `_keep`; one proxy thread at a time rings
// through this value (the `Doorbell` contract), and `Nic` is Send + Sync.
unsafe impl Send for EmuDoorbell {}

impl EmuDoorbell {
    /// The doorbell of emulated QP `qpn`, with its doorbell record at host address `dbr`.
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
        let dbr_ptr = dbr as *mut DoorbellRecord;
        let how = match how {
            ProxyDoorbell::Direct => How::Direct {
                nic,
                qpn,
                dbr: dbr_ptr,
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
            How::Direct { nic, qpn, dbr } => {
                // SAFETY: the live record (`new`'s contract); the emulator reads it, hence volatile.
                unsafe {
                    ((*dbr as *mut u8).add(DBR_SEND_OFFSET) as *mut ibgda_device::wire::Be32)
                        .write_volatile(dbr_send_word(pi))
                };
                fence(Ordering::SeqCst);
                if let Err(e) = nic.ring_doorbell(*qpn, pi) {
                    // The QP is gone (torn down under a late publish): nothing left to ring.
                    tracing::warn!(target: "ep", "proxy doorbell on QP {qpn:#x}: {e}");
                }
            }
            How::Uar(db) => db.ring(pi),
        }
        if let Some((hook, qp)) = &self.hook {
            (hook.0)(*qp, pi);
        }
    }
}
