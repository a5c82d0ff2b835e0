//! How the NIC learns the producer index: the doorbell record's send counter, an emulated UAR
//! page's BlueFlame register, a producer slot, or a direct call. Each carries an absolute index
//! (16 bits for the first two, recovered against the NIC's own position), so a dropped or stale
//! doorbell is made good by the next one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ibgda_device::wire::{parse_db_word, DBR_SEND_OFFSET, UAR_BF_OFFSET};

use crate::backend::{Loc, MemoryBackend};
use crate::error::EmuError;
use crate::host::{load_host_u32, load_host_u64, HostBuffer};

/// Size of an emulated UAR page.
pub const UAR_PAGE_BYTES: usize = ibgda_device::wire::UAR_PAGE_BYTES;

/// The doorbell sources the NIC polls for one QP. [`Nic::ring_doorbell`](crate::Nic::ring_doorbell)
/// works whatever is configured here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DoorbellConfig {
    /// The QP's doorbell record (8 bytes; the NIC reads the send counter at +4). Device-resident
    /// records are polled at most every [`NicConfig::device_poll_interval`](crate::NicConfig).
    pub dbr: Option<Loc>,
    /// Give the QP an emulated UAR page; device code (mode `gpu`) or the proxy stores the 8-byte
    /// doorbell word `{be32(pi << 8), be32(qpn << 8)}` to its BlueFlame register
    /// ([`QpHandle::uar`](crate::QpHandle::uar)).
    pub uar: bool,
    /// A 64-bit producer index in host order (what device code `atomicMax`es in the CPU handler
    /// modes). A real NIC never reads it; the emulator can, so device code can be run without a
    /// proxy. Not needed when a proxy rings.
    pub producer_slot: Option<Loc>,
}

/// The emulated UAR page of a QP: where to store doorbell words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UarInfo {
    /// Host address of the BlueFlame register (page + 0x800): the proxy stores here.
    pub bf_reg: u64,
    /// GPU address of the same register (CUDA NICs: pinned, mapped memory): `QpDesc::db_reg`.
    pub bf_reg_device: Option<u64>,
}

/// The 64-bit producer index a 16-bit counter means, given the NIC's position `fetched`: the
/// first index at or after `fetched` with those low 16 bits. `None` when that is more than a ring
/// ahead, which no producer can legally be (it never passes `cons_idx + nwqebbs`, and
/// `cons_idx <= fetched`): the value is stale or garbage.
pub fn recover_pi(fetched: u64, pi16: u16, nwqebbs: u32) -> Option<u64> {
    let delta = pi16.wrapping_sub(fetched as u16) as u64;
    (delta <= nwqebbs as u64).then_some(fetched + delta)
}

/// The polling side of one QP's doorbells.
#[derive(Debug)]
pub(crate) struct DoorbellState {
    pub cfg: DoorbellConfig,
    pub uar: Option<std::sync::Arc<HostBuffer>>,
    /// Other QPs ring through the same page (a firmware UAR object).
    shared_uar: bool,
    /// Producer index from direct calls (`ring_doorbell`), monotonic.
    pub direct: std::sync::Arc<AtomicU64>,
    /// Doorbells at or below this index are ignored (a dropped doorbell's index).
    pub ignore_upto: u64,
    /// Doorbell events seen (1-based numbering for fault plans).
    pub events: u64,
    next_device_poll: Instant,
}

/// What a poll found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Polled {
    /// A doorbell that would advance the producer index, if any.
    pub pi: Option<u64>,
}

impl DoorbellState {
    pub fn new(
        cfg: DoorbellConfig,
        uar: Option<std::sync::Arc<HostBuffer>>,
        shared_uar: bool,
    ) -> Self {
        Self {
            cfg,
            uar,
            shared_uar,
            direct: Default::default(),
            ignore_upto: 0,
            events: 0,
            next_device_poll: Instant::now(),
        }
    }

    pub fn uar_info(&self) -> Option<UarInfo> {
        self.uar.as_ref().map(|u| UarInfo {
            bf_reg: u.addr() + UAR_BF_OFFSET as u64,
            bf_reg_device: u.device_addr().map(|d| d + UAR_BF_OFFSET as u64),
        })
    }

    /// Forgets everything rung so far (QP reset): zeroes host-resident doorbell words.
    pub fn reset(&mut self) {
        // A shared page's last word may be another QP's doorbell; the doorbell record still
        // carries this QP's.
        if let Some(u) = self.uar.as_ref().filter(|_| !self.shared_uar) {
            u.store_u64(UAR_BF_OFFSET, 0);
        }
        if let Some(Loc::Host(a)) = self.cfg.dbr {
            // SAFETY: validated at QP creation: a live, 4-byte aligned host doorbell record.
            unsafe {
                std::sync::atomic::AtomicU32::from_ptr((a + DBR_SEND_OFFSET as u64) as *mut u32)
            }
            .store(0, Ordering::Release);
        }
        if let Some(Loc::Host(a)) = self.cfg.producer_slot {
            // SAFETY: validated at QP creation: a live, 8-byte aligned host slot.
            unsafe { AtomicU64::from_ptr(a as *mut u64) }.store(0, Ordering::Release);
        }
        self.direct.store(0, Ordering::Release);
        self.ignore_upto = 0;
    }

    /// Reads every source and returns the largest valid producer index beyond `announced`.
    pub fn poll(
        &mut self,
        backend: &dyn MemoryBackend,
        qpn: u32,
        fetched: u64,
        announced: u64,
        nwqebbs: u32,
        device_poll_interval: Duration,
    ) -> Result<Polled, EmuError> {
        let mut best: Option<u64> = None;
        let mut offer = |pi: Option<u64>| {
            if let Some(pi) = pi {
                if pi > announced && best.is_none_or(|b| pi > b) {
                    best = Some(pi);
                }
            }
        };
        let direct = self.direct.load(Ordering::Acquire);
        if direct > fetched && direct - fetched <= nwqebbs as u64 {
            offer(Some(direct));
        }
        if let Some(u) = &self.uar {
            let word = u.load_u64(UAR_BF_OFFSET);
            if word != 0 {
                let (q, pi16) = parse_db_word(word);
                if q == qpn & 0xff_ffff {
                    offer(recover_pi(fetched, pi16, nwqebbs));
                } else if !self.shared_uar {
                    tracing::warn!(
                        qpn,
                        rung = q,
                        "doorbell word for another QP in this QP's UAR page: ignored"
                    );
                }
            }
        }
        // The clock only matters for sources in GPU memory (and may be a system call in a VM).
        let on_device = matches!(self.cfg.dbr, Some(Loc::Device(_)))
            || matches!(self.cfg.producer_slot, Some(Loc::Device(_)));
        let now = on_device.then(Instant::now);
        let device_due = now.is_some_and(|n| n >= self.next_device_poll);
        let mut polled_device = false;
        if let Some(loc) = self.cfg.dbr {
            let word_loc = loc.offset(DBR_SEND_OFFSET as u64);
            let raw = match word_loc {
                // SAFETY: validated at QP creation: a live, aligned host doorbell record.
                Loc::Host(a) => Some(unsafe { load_host_u32(a) }),
                Loc::Device(_) if device_due => {
                    polled_device = true;
                    let mut b = [0u8; 4];
                    // SAFETY: the QP's configuration names a live device doorbell record.
                    unsafe { backend.read(word_loc, &mut b)? };
                    Some(u32::from_ne_bytes(b))
                }
                Loc::Device(_) => None,
            };
            if let Some(raw) = raw {
                offer(recover_pi(fetched, u32::from_be(raw) as u16, nwqebbs));
            }
        }
        if let Some(loc) = self.cfg.producer_slot {
            let v = match loc {
                // SAFETY: validated at QP creation: a live, 8-byte aligned host slot.
                Loc::Host(a) => Some(unsafe { load_host_u64(a) }),
                Loc::Device(_) if device_due => {
                    polled_device = true;
                    let mut b = [0u8; 8];
                    // SAFETY: the QP's configuration names a live device producer slot.
                    unsafe { backend.read(loc, &mut b)? };
                    Some(u64::from_ne_bytes(b))
                }
                Loc::Device(_) => None,
            };
            if let Some(v) = v {
                if v > fetched && v - fetched <= nwqebbs as u64 {
                    offer(Some(v));
                }
            }
        }
        if let (true, Some(now)) = (polled_device, now) {
            self.next_device_poll = now + device_poll_interval;
        }
        Ok(Polled {
            pi: best.filter(|&pi| pi > self.ignore_upto),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UAR page several QPs ring through (firmware UAR objects): the page's word is whichever
    /// QP rang last, so another QP's word must neither be taken for ours nor hide our index,
    /// which the doorbell record still carries, across 16-bit wraps of both.
    #[test]
    fn a_shared_page_never_loses_a_doorbell_the_record_carries() {
        use ibgda_device::wire::{db_word, dbr_send_word};
        let page = std::sync::Arc::new(HostBuffer::new(UAR_PAGE_BYTES));
        let dbr = HostBuffer::new(8);
        let (us, them, n) = (0x01_0005u32, 0x01_0006u32, 1024u32);
        let mut st = DoorbellState::new(
            DoorbellConfig {
                dbr: Some(Loc::Host(dbr.addr())),
                uar: true,
                producer_slot: None,
            },
            Some(page.clone()),
            true,
        );
        let mut fetched = 0u64;
        let poll = |st: &mut DoorbellState, fetched: u64, announced: u64| {
            st.poll(
                &crate::host::HostMemory,
                us,
                fetched,
                announced,
                n,
                Duration::ZERO,
            )
            .unwrap()
            .pi
        };
        for round in 0..200u64 {
            // Our proxy rings: record, then the page.
            let pi = fetched + 1 + (round * 7919) % u64::from(n);
            let word = dbr_send_word(pi);
            dbr.write(DBR_SEND_OFFSET, &word.to_bytes());
            page.store_u64(UAR_BF_OFFSET, db_word(us, pi));
            // Another QP on the page rings right after, with an index that would look valid.
            page.store_u64(UAR_BF_OFFSET, db_word(them, pi + 3));
            assert_eq!(poll(&mut st, fetched, fetched), Some(pi), "round {round}");
            // The NIC runs everything announced, then sees nothing new.
            fetched = pi;
            assert_eq!(poll(&mut st, fetched, fetched), None, "round {round}");
        }
        assert!(fetched > 1 << 16, "the indices crossed a 16-bit wrap");
    }

    #[test]
    fn recovers_across_16_bit_wraps() {
        assert_eq!(recover_pi(0, 5, 64), Some(5));
        assert_eq!(recover_pi(0xfff0, 0x0004, 64), Some(0x1_0004));
        assert_eq!(recover_pi(0x1_0004, 0x0004, 64), Some(0x1_0004));
        // Behind the NIC, or more than a ring ahead: stale.
        assert_eq!(recover_pi(100, 90, 64), None);
        assert_eq!(recover_pi(100, 165, 64), None);
        assert_eq!(recover_pi(100, 164, 64), Some(164));
    }
}
