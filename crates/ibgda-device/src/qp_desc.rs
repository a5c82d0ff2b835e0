//! The device QP descriptor kernels read, and the error record device code writes when a wait
//! fails. Twins of `include/ibgda/qp_desc.cuh` (`ibgda_qp_desc`, `ibgda_qp_counters`,
//! `ibgda_error_record`), checked against `include/ibgda/layout.def` on both sides.
//!
//! Counters (all `u64`, monotonic, in WQEBB units; the ring slot of index `i` is
//! `(i & (nwqes - 1)) * 64`):
//!
//! | counter | meaning | advanced by |
//! |---|---|---|
//! | `resv_head` | next index to hand out | every submitter, `atomicAdd(resv_head, n)` |
//! | `ready_head` | submitted frontier: all below are written, fenced, published in order | each submitter, from `base` to `base + n` once it equals `base` |
//! | `prod_idx` | producer index last rung to the NIC | the GPU (mode gpu) or the proxy (CPU modes) |
//! | `cons_idx` | completed frontier (from CQE `wqe_counter`s) | the CQ poller |
//! | `cq_cons_idx` | CQEs consumed | the CQ poller |
//!
//! `cons_idx <= prod_idx <= ready_head <= resv_head`. Quiet waits until `cons_idx >= ready_head`,
//! whatever the handler mode.
//!
//! ```
//! use ibgda_device::qp_desc::{NicHandler, QpDesc};
//!
//! let mut d: QpDesc = bytemuck::Zeroable::zeroed();
//! d.wq_base = 0x7f00_0000_0000;
//! d.nwqes = 1024;
//! d.qpn = 0x1234;
//! d.dbr = 0x7f10_0000_0000;
//! d.producer_slot = 0x7f20_0000_0040;
//! d.handler_mode = NicHandler::CpuHostMemory as u32;
//! d.cq_base = 0x7f30_0000_0000;
//! d.ncqes = 1024;
//! assert!(d.validate().is_ok());
//! ```

use bytemuck::{Pod, Zeroable};
use core::fmt;

/// Who rings the NIC's doorbell for a QP (the descriptor's `handler_mode`).
#[doc(alias = "handler mode")]
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NicHandler {
    /// The GPU writes the doorbell record and stores to the BlueFlame register (`db_reg`).
    Gpu = 0,
    /// A CPU proxy polls `producer_slot`, in GPU memory it maps through GDRCopy.
    Cpu = 1,
    /// A CPU proxy polls `producer_slot`, in pinned host memory.
    CpuHostMemory = 2,
}

impl NicHandler {
    /// The mode a descriptor's `handler_mode` holds, if a defined one.
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Gpu),
            1 => Some(Self::Cpu),
            2 => Some(Self::CpuHostMemory),
            _ => None,
        }
    }

    /// The mode's name as configuration spells it (`gpu`, `cpu`, `cpu_host_memory`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
            Self::CpuHostMemory => "cpu_host_memory",
        }
    }

    /// Whether a CPU proxy rings the doorbell in this mode.
    pub const fn uses_proxy(self) -> bool {
        !matches!(self, Self::Gpu)
    }
}

/// `flags` bit: the NIC behind this QP is the software emulator. For diagnostics only: device
/// code must behave the same either way.
pub const QP_FLAG_EMULATED: u32 = 0x1;

/// What an [`ErrorRecord`] reports (its `kind`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Nothing recorded (yet).
    None = 0,
    /// An error CQE: `syndrome`, `vendor_syndrome`, `wqe_counter`, `wqe_opcode` are set.
    Cqe = 1,
    /// Waited too long for ring space (completions did not come).
    TimeoutReserve = 2,
    /// Waited too long for `ready_head` to reach this submitter's base.
    TimeoutReady = 3,
    /// Waited too long for completions to cover `ready_head` (quiet).
    TimeoutQuiet = 4,
    /// Any other bounded wait ran out.
    TimeoutOther = 5,
    /// The descriptor breaks the protocol's assumptions (see [`QpDesc::validate`]).
    InvalidDesc = 6,
}

impl ErrorKind {
    /// The kind a record's `kind` holds, if a defined one.
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::None),
            1 => Some(Self::Cqe),
            2 => Some(Self::TimeoutReserve),
            3 => Some(Self::TimeoutReady),
            4 => Some(Self::TimeoutQuiet),
            5 => Some(Self::TimeoutOther),
            6 => Some(Self::InvalidDesc),
            _ => None,
        }
    }

    /// What went wrong, in words.
    pub const fn describe(self) -> &'static str {
        match self {
            Self::None => "no error",
            Self::Cqe => "error completion",
            Self::TimeoutReserve => "timed out waiting for ring space",
            Self::TimeoutReady => "timed out waiting for ready_head to reach this submitter",
            Self::TimeoutQuiet => "timed out waiting for completions to cover ready_head",
            Self::TimeoutOther => "timed out",
            Self::InvalidDesc => "invalid QP descriptor",
        }
    }
}

/// The per-QP counters: one 64-byte line of the descriptor.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct QpCounters {
    /// `[0,8)` next WQEBB index to reserve.
    pub resv_head: u64,
    /// `[8,16)` submitted frontier.
    pub ready_head: u64,
    /// `[16,24)` producer index last rung to the NIC.
    pub prod_idx: u64,
    /// `[24,32)` completed frontier.
    pub cons_idx: u64,
    /// `[32,40)` CQEs consumed; the next CQE slot is `cq_cons_idx & (ncqes - 1)`.
    pub cq_cons_idx: u64,
    /// `[40,44)` 0 free, 1 held: one thread at a time consumes CQEs.
    pub poll_lock: u32,
    /// `[44,48)` the doorbell lock of mode gpu (`protocol.cuh`): 0 free, 1 held.
    pub db_lock: u32,
    /// `[48,64)` zero.
    pub reserved1: [u64; 2],
}

/// The descriptor of one QP (192 bytes): two lines written once by the host, then the counters.
/// Pointers are device-visible addresses (`u64`); host-endian values throughout.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct QpDesc {
    /// `[0,8)` the send ring: `nwqes` WQEBBs.
    pub wq_base: u64,
    /// `[8,16)` the QP's [`DoorbellRecord`](crate::wire::DoorbellRecord) (GPU memory in mode gpu,
    /// host memory in the CPU modes).
    pub dbr: u64,
    /// `[16,24)` the BlueFlame register (UAR + 0x800) mapped for the GPU; mode gpu only, else 0.
    pub db_reg: u64,
    /// `[24,32)` the 8-byte-aligned `u64` the proxy polls, raised by the GPU to `base + n` (a
    /// system-scope fence and store in publish order, or `atomicMax` when flushing); CPU modes
    /// only, else 0.
    pub producer_slot: u64,
    /// `[32,36)` ring size in WQEBBs, a power of two.
    pub nwqes: u32,
    /// `[36,40)` QP number (24 bits).
    pub qpn: u32,
    /// `[40,44)` [`NicHandler`] as a number.
    pub handler_mode: u32,
    /// `[44,48)` lkey of the local buffers (gather sources, fetch targets, `scratch`).
    pub lkey: u32,
    /// `[48,56)` the CQ: `ncqes` [`Cqe64`](crate::wire::Cqe64).
    pub cq_base: u64,
    /// `[56,64)` the CQ doorbell record (big-endian consumer index at +0), or 0.
    pub cq_dbr: u64,
    /// `[64,68)` CQ size, a power of two.
    pub ncqes: u32,
    /// `[68,72)` [`QP_FLAG_EMULATED`] and future flags.
    pub flags: u32,
    /// `[72,76)` this rank, for diagnostics.
    pub rank: u32,
    /// `[76,80)` this QP's index among the rank's QPs, for diagnostics.
    pub qp_index: u32,
    /// `[80,84)` the rank at the other end, for diagnostics.
    pub peer_rank: u32,
    /// `[84,88)` zero.
    pub reserved0: u32,
    /// `[88,96)` time bound of every wait on this QP, in `%globaltimer` nanoseconds.
    pub timeout_ns: u64,
    /// `[96,104)` host-visible [`ErrorRecord`] to fill when a wait fails, or 0.
    pub error_record: u64,
    /// `[104,112)` 8 bytes under `lkey` for fetched values nobody reads (the signal add's).
    pub scratch: u64,
    /// `[112,128)` zero.
    pub reserved1: [u64; 2],
    /// `[128,192)` the counters.
    pub counters: QpCounters,
}

/// Why a descriptor is unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QpDescError {
    /// A size that must be a power of two is not.
    #[error("{field} = {value} is not a power of two")]
    NotPowerOfTwo {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u32,
    },
    /// The QP number has more than 24 bits.
    #[error("qpn {0:#x} does not fit 24 bits")]
    QpnTooWide(u32),
    /// `handler_mode` holds no defined mode.
    #[error("handler_mode {0} is not a defined mode")]
    BadMode(u32),
    /// A pointer the mode needs is missing or misaligned.
    #[error("{field} = {value:#x} must be non-zero and {align}-byte aligned in mode {mode}")]
    BadPointer {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The alignment it needs.
        align: u64,
        /// The handler mode.
        mode: &'static str,
    },
    /// A pointer the mode must not use is set.
    #[error("{field} must be 0 in mode {mode}")]
    UnusedPointerSet {
        /// The field.
        field: &'static str,
        /// The handler mode.
        mode: &'static str,
    },
    /// The ring holds more WQEBBs than a 16-bit `wqe_counter` can tell apart.
    #[error("nwqes = {0} exceeds 32768: CQE wqe_counters would be ambiguous")]
    RingTooLarge(u32),
}

impl QpDesc {
    /// The handler mode, if `handler_mode` holds a defined one.
    pub const fn handler(&self) -> Option<NicHandler> {
        NicHandler::from_u32(self.handler_mode)
    }

    /// Checks what device code assumes: power-of-two ring sizes of at most 32768 WQEBBs, a 24-bit
    /// QPN, aligned ring, CQ and doorbell record, and the pointers of its handler mode (the
    /// doorbell register in mode gpu, an 8-byte-aligned producer slot in the CPU modes) and only
    /// those.
    pub fn validate(&self) -> Result<(), QpDescError> {
        for (field, value) in [("nwqes", self.nwqes), ("ncqes", self.ncqes)] {
            if !value.is_power_of_two() {
                return Err(QpDescError::NotPowerOfTwo { field, value });
            }
        }
        if self.nwqes > 32768 {
            return Err(QpDescError::RingTooLarge(self.nwqes));
        }
        if self.qpn >> 24 != 0 {
            return Err(QpDescError::QpnTooWide(self.qpn));
        }
        let mode = self
            .handler()
            .ok_or(QpDescError::BadMode(self.handler_mode))?;
        let need = |field: &'static str, value: u64, align: u64| {
            if value == 0 || value % align != 0 {
                Err(QpDescError::BadPointer {
                    field,
                    value,
                    align,
                    mode: mode.name(),
                })
            } else {
                Ok(())
            }
        };
        need("wq_base", self.wq_base, 64)?;
        need("cq_base", self.cq_base, 64)?;
        need("dbr", self.dbr, 8)?;
        if mode.uses_proxy() {
            need("producer_slot", self.producer_slot, 8)?;
            if self.db_reg != 0 {
                return Err(QpDescError::UnusedPointerSet {
                    field: "db_reg",
                    mode: mode.name(),
                });
            }
        } else {
            need("db_reg", self.db_reg, 8)?;
            if self.producer_slot != 0 {
                return Err(QpDescError::UnusedPointerSet {
                    field: "producer_slot",
                    mode: mode.name(),
                });
            }
        }
        Ok(())
    }
}

/// Written by device code when a wait times out or a CQE reports an error; read by the host.
///
/// The writer claims the record (`claim` 0 → 1 with a compare-and-swap, so the first failure
/// wins), fills every other field, fences at system scope, and stores `kind` last: the host sees a
/// complete record once `kind` is non-zero.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ErrorRecord {
    /// `[0,4)` [`ErrorKind`] as a number; written last.
    pub kind: u32,
    /// `[4,8)`
    pub rank: u32,
    /// `[8,12)`
    pub qp_index: u32,
    /// `[12,16)`
    pub qpn: u32,
    /// `[16,24)` the counters when the failure was seen.
    pub resv_head: u64,
    /// `[24,32)`
    pub ready_head: u64,
    /// `[32,40)`
    pub prod_idx: u64,
    /// `[40,48)`
    pub cons_idx: u64,
    /// `[48,52)` [`NicHandler`] as a number.
    pub handler_mode: u32,
    /// `[52]` error CQE syndrome (byte 55).
    pub syndrome: u8,
    /// `[53]` error CQE vendor syndrome (byte 54).
    pub vendor_syndrome: u8,
    /// `[54]` CQE opcode.
    pub cqe_opcode: u8,
    /// `[55]` opcode of the failed WQE.
    pub wqe_opcode: u8,
    /// `[56,58)` index of the failed WQE, low 16 bits.
    pub wqe_counter: u16,
    /// `[58,60)` zero.
    pub reserved0: u16,
    /// `[60,64)` 0 free, 1 taken.
    pub claim: u32,
}

impl ErrorRecord {
    /// The kind, if `kind` holds a defined one.
    pub const fn kind(&self) -> Option<ErrorKind> {
        ErrorKind::from_u32(self.kind)
    }
}

impl fmt::Display for ErrorRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = self
            .kind()
            .map_or("unknown error kind", ErrorKind::describe);
        let mode = NicHandler::from_u32(self.handler_mode).map_or("?", NicHandler::name);
        write!(
            f,
            "rank {} QP {} (qpn {:#x}, mode {mode}): {what} ({}); resv_head={} ready_head={} prod_idx={} cons_idx={}",
            self.rank, self.qp_index, self.qpn, self.kind, self.resv_head, self.ready_head, self.prod_idx, self.cons_idx
        )?;
        if self.kind() == Some(ErrorKind::Cqe) {
            write!(
                f,
                "; CQE {} on WQE {:#06x} ({}): syndrome {:#04x} ({}), vendor syndrome {:#04x}",
                crate::wire::cqe_opcode::name(self.cqe_opcode),
                self.wqe_counter,
                crate::wire::opcode::name(self.wqe_opcode),
                self.syndrome,
                crate::wire::syndrome::name(self.syndrome),
                self.vendor_syndrome
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> QpDesc {
        QpDesc {
            wq_base: 0x1000,
            dbr: 0x2000,
            db_reg: 0x3800,
            nwqes: 256,
            qpn: 0xab_cdef,
            handler_mode: NicHandler::Gpu as u32,
            cq_base: 0x4000,
            ncqes: 256,
            ..Zeroable::zeroed()
        }
    }

    #[test]
    fn validation() {
        assert_eq!(good().validate(), Ok(()));
        assert!(matches!(
            QpDesc {
                nwqes: 100,
                ..good()
            }
            .validate(),
            Err(QpDescError::NotPowerOfTwo { .. })
        ));
        assert!(matches!(
            QpDesc {
                nwqes: 65536,
                ..good()
            }
            .validate(),
            Err(QpDescError::RingTooLarge(_))
        ));
        assert!(matches!(
            QpDesc {
                qpn: 1 << 24,
                ..good()
            }
            .validate(),
            Err(QpDescError::QpnTooWide(_))
        ));
        assert!(matches!(
            QpDesc {
                handler_mode: 9,
                ..good()
            }
            .validate(),
            Err(QpDescError::BadMode(9))
        ));
        assert!(matches!(
            QpDesc {
                producer_slot: 0x5000,
                ..good()
            }
            .validate(),
            Err(QpDescError::UnusedPointerSet {
                field: "producer_slot",
                ..
            })
        ));
        let cpu = QpDesc {
            handler_mode: NicHandler::Cpu as u32,
            db_reg: 0,
            producer_slot: 0x5004,
            ..good()
        };
        assert!(matches!(
            cpu.validate(),
            Err(QpDescError::BadPointer {
                field: "producer_slot",
                align: 8,
                ..
            })
        ));
        assert_eq!(
            QpDesc {
                producer_slot: 0x5008,
                ..cpu
            }
            .validate(),
            Ok(())
        );
    }

    #[test]
    fn error_record_reads_well() {
        let r = ErrorRecord {
            kind: ErrorKind::Cqe as u32,
            rank: 3,
            qp_index: 5,
            qpn: 0x99,
            ready_head: 10,
            handler_mode: NicHandler::CpuHostMemory as u32,
            syndrome: 0x13,
            cqe_opcode: 0xd,
            wqe_opcode: 0x08,
            wqe_counter: 7,
            ..Zeroable::zeroed()
        };
        let s = r.to_string();
        for want in [
            "rank 3 QP 5",
            "cpu_host_memory",
            "ready_head=10",
            "REMOTE_ACCESS_ERR",
            "RDMA_WRITE",
        ] {
            assert!(s.contains(want), "{want} missing from {s}");
        }
    }
}
