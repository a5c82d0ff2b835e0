//! What a protocol call returns when it stops, and what the host makes of an error record.
//!
//! Device functions of `protocol.cuh` return an `int`: 0, or the [`ErrorKind`] number of the
//! failure that stopped them, or [`STATUS_ABORTED`] when another thread had already recorded a
//! failure. The host model returns the same codes as [`Stopped`]. Whatever stopped, the first
//! failure is in the QP's [`ErrorRecord`]; [`check_record`] turns it into a [`DeviceFailure`]
//! whose message names rank, QP, the four indices, the mode and the syndrome.

use core::fmt;

use crate::qp_desc::{ErrorKind, ErrorRecord, NicHandler};
use crate::wire::{cqe_opcode, opcode, syndrome};

/// Device status: success (`IBGDA_STATUS_OK`).
pub const STATUS_OK: u32 = 0;
/// Device status: stopped early because a failure was already recorded (`IBGDA_STATUS_ABORTED`).
pub const STATUS_ABORTED: u32 = 0x100;
/// Error kind of a descriptor that breaks the protocol's assumptions (`IBGDA_ERROR_INVALID_DESC`):
/// ring sizes, a misaligned producer slot, a missing doorbell pointer.
pub const ERROR_INVALID_DESC: u32 = 6;
/// Bound of every wait when a descriptor's `timeout_ns` is 0 (`IBGDA_DEFAULT_TIMEOUT_NS`).
pub const DEFAULT_TIMEOUT_NS: u64 = 10_000_000_000;
/// Largest ring the protocol accepts (`IBGDA_MAX_NWQES`): a 16-bit CQE `wqe_counter` must name
/// one outstanding WQEBB.
pub const MAX_NWQES: u32 = 32768;
/// Payload bytes of one RDMA-write WQE that `ibgda_put_warp` posts (`IBGDA_PUT_CHUNK_BYTES`): a
/// put of `b` bytes is `b.div_ceil(PUT_CHUNK_BYTES)` WQEs.
pub const PUT_CHUNK_BYTES: u32 = 1 << 20;

/// A protocol call that did not complete: the non-zero status device code returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stopped(pub u32);

impl Stopped {
    /// Stopped because another failure was recorded first.
    pub const ABORTED: Self = Self(STATUS_ABORTED);

    /// The error kind that stopped the call, if it was a failure of its own (not an abort).
    pub const fn kind(self) -> Option<ErrorKind> {
        ErrorKind::from_u32(self.0)
    }

    /// Whether the call stopped because of someone else's recorded failure.
    pub const fn is_abort(self) -> bool {
        self.0 == STATUS_ABORTED
    }

    /// The status a device function returns for this stop.
    pub const fn code(self) -> u32 {
        self.0
    }

    /// A device status as a result: `Ok` for 0.
    pub const fn from_code(code: u32) -> Result<(), Self> {
        if code == STATUS_OK {
            Ok(())
        } else {
            Err(Self(code))
        }
    }
}

impl fmt::Display for Stopped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_abort() {
            f.write_str("aborted: a failure was already recorded")
        } else {
            write!(f, "{} (status {})", describe_kind(self.0), self.0)
        }
    }
}

impl std::error::Error for Stopped {}

/// The words for an error kind, including the ones this module adds.
pub const fn describe_kind(kind: u32) -> &'static str {
    match ErrorKind::from_u32(kind) {
        Some(k) => k.describe(),
        None if kind == ERROR_INVALID_DESC => "invalid QP descriptor",
        None if kind == STATUS_ABORTED => "aborted after an earlier failure",
        None => "unknown error kind",
    }
}

/// A failure the device (or the host model) recorded: the error record, plus what the host knows
/// that the device could not (the doorbell the proxy last rang).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct DeviceFailure {
    /// The record as the device left it (boxed: it is a 64-byte line).
    pub record: Box<ErrorRecord>,
    /// In the CPU modes: the producer index the proxy last rang on this QP, if known.
    pub proxy_rung: Option<u64>,
    /// The send WQEBBs the NIC says it has consumed on this QP, modulo 2^16
    /// (`qpc.hw_sq_wqebb_counter` from `QUERY_QP`), where the transport could ask. Against
    /// `ready_head` and `cons_idx` it tells a doorbell the NIC never acted on (counter short of
    /// `ready_head`) from a completion that never came (counter at `ready_head`).
    pub nic_consumed: Option<u16>,
    /// On an emulated NIC: the engine's own account of the QP (doorbells seen, producer index
    /// announced, WQEBBs fetched, CQEs written and pending), or that its progress thread was
    /// busy inside the QP's round and could not answer.
    pub nic_state: Option<String>,
}

impl DeviceFailure {
    /// The failure's kind, as a number (an [`ErrorKind`] or [`ERROR_INVALID_DESC`]).
    pub fn kind(&self) -> u32 {
        self.record.kind
    }
}

impl fmt::Display for DeviceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.record;
        let mode = NicHandler::from_u32(r.handler_mode).map_or("?", NicHandler::name);
        write!(
            f,
            "rank {} QP {} (qpn {:#x}, mode {mode}): {} (kind {}); resv_head={} ready_head={} prod_idx={} cons_idx={}",
            r.rank,
            r.qp_index,
            r.qpn,
            describe_kind(r.kind),
            r.kind,
            r.resv_head,
            r.ready_head,
            r.prod_idx,
            r.cons_idx
        )?;
        if let Some(p) = self.proxy_rung {
            write!(f, " (proxy rang up to {p})")?;
        }
        if let Some(c) = self.nic_consumed {
            write!(f, "; the NIC has consumed {c} WQEBBs (mod 2^16)")?;
        }
        if let Some(n) = &self.nic_state {
            write!(f, "; emulated NIC: {n}")?;
        }
        if r.kind == ErrorKind::Cqe as u32 {
            write!(
                f,
                "; CQE {} on WQE {:#06x} ({}): syndrome {:#04x} ({}), vendor syndrome {:#04x}",
                cqe_opcode::name(r.cqe_opcode),
                r.wqe_counter,
                opcode::name(r.wqe_opcode),
                r.syndrome,
                syndrome::name(r.syndrome),
                r.vendor_syndrome
            )?;
        }
        Ok(())
    }
}

/// `Err` with the record when it holds a failure (`kind != 0`).
pub fn check_record(record: &ErrorRecord, proxy_rung: Option<u64>) -> Result<(), DeviceFailure> {
    if record.kind == ErrorKind::None as u32 {
        Ok(())
    } else {
        Err(DeviceFailure {
            record: Box::new(*record),
            proxy_rung,
            nic_consumed: None,
            nic_state: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::Zeroable;

    /// The header's `#define NAME value` as written (the host constants mirror it).
    fn header_define(name: &str) -> String {
        let h = include_str!("../../include/ibgda/protocol.cuh");
        let line = h
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} is not defined in protocol.cuh"));
        line[format!("#define {name} ").len()..].trim().to_string()
    }

    #[test]
    fn constants_match_the_device_header() {
        assert_eq!(header_define("IBGDA_PUT_CHUNK_BYTES"), "(1u << 20)");
        assert_eq!(PUT_CHUNK_BYTES, 1 << 20);
        assert_eq!(header_define("IBGDA_MAX_NWQES"), format!("{MAX_NWQES}u"));
        assert_eq!(
            header_define("IBGDA_STATUS_ABORTED"),
            format!("{STATUS_ABORTED:#x}")
        );
    }

    #[test]
    fn failure_names_everything() {
        let rec = ErrorRecord {
            kind: ErrorKind::TimeoutReady as u32,
            rank: 2,
            qp_index: 7,
            qpn: 0x42,
            resv_head: 11,
            ready_head: 10,
            prod_idx: 9,
            cons_idx: 8,
            handler_mode: NicHandler::CpuHostMemory as u32,
            ..ErrorRecord::zeroed()
        };
        let e = check_record(&rec, Some(9)).unwrap_err();
        let s = e.to_string();
        for want in [
            "rank 2",
            "QP 7",
            "cpu_host_memory",
            "ready_head",
            "resv_head=11",
            "ready_head=10",
            "prod_idx=9",
            "cons_idx=8",
            "proxy rang up to 9",
        ] {
            assert!(s.contains(want), "{want:?} missing from {s}");
        }
        assert!(check_record(&ErrorRecord::zeroed(), None).is_ok());
        let cqe = ErrorRecord {
            kind: ErrorKind::Cqe as u32,
            syndrome: syndrome::REMOTE_ACCESS_ERR,
            wqe_opcode: opcode::RDMA_WRITE,
            cqe_opcode: cqe_opcode::REQ_ERR,
            ..rec
        };
        let s = check_record(&cqe, None).unwrap_err().to_string();
        assert!(
            s.contains("REMOTE_ACCESS_ERR") && s.contains("RDMA_WRITE"),
            "{s}"
        );
        let bad = ErrorRecord {
            kind: ERROR_INVALID_DESC,
            ..rec
        };
        assert!(check_record(&bad, None)
            .unwrap_err()
            .to_string()
            .contains("invalid QP descriptor"));
    }

    #[test]
    fn status_codes() {
        assert_eq!(Stopped::from_code(0), Ok(()));
        let s = Stopped::from_code(ErrorKind::TimeoutQuiet as u32).unwrap_err();
        assert_eq!(s.kind(), Some(ErrorKind::TimeoutQuiet));
        assert!(Stopped::ABORTED.is_abort());
        assert!(Stopped::ABORTED.to_string().contains("aborted"));
    }
}
