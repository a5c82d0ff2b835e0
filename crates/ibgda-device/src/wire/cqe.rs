//! The 64-byte CQE, its error form, and the parsing both host code (proxy, emulator) and device
//! code (`ibgda_cqe_parse_tail` in `wire.cuh`) do the same way.
//!
//! ```
//! use ibgda_device::wire::{Cqe64, CqeState, opcode, wqe_index_from_counter};
//!
//! // The NIC's first pass over a ring of 8 CQEs writes owner bit 0.
//! let cqe = Cqe64::requester(0, 0xffff, 0x1234, opcode::NOP, 0);
//! let st = cqe.status(0, 8);
//! assert_eq!(st.state(), Some(CqeState::Ok));
//! // The counter wrapped: index 0x1_ffff is the greatest below the frontier 0x2_0003 ending in 0xffff.
//! assert_eq!(wqe_index_from_counter(st.wqe_counter, 0x2_0003), 0x1_ffff);
//! // On the second pass the same bytes are stale.
//! assert_eq!(cqe.status(8, 8).state(), Some(CqeState::Empty));
//! ```

use bytemuck::{Pod, Zeroable};
use core::fmt;

use super::be::{Be16, Be32, Be64};
use super::opcode;

/// CQE opcodes (`op_own` bits 7..4).
pub mod cqe_opcode {
    /// Requester completion (a send WQE completed).
    pub const REQ: u8 = 0x0;
    /// Responder completion of an RDMA write with immediate.
    pub const RESP_WR_IMM: u8 = 0x1;
    /// Responder completion of a send.
    pub const RESP_SEND: u8 = 0x2;
    /// Requester error: the syndrome says why.
    pub const REQ_ERR: u8 = 0xd;
    /// Responder error.
    pub const RESP_ERR: u8 = 0xe;
    /// Never written by the NIC: what a CQ ring is initialised with.
    pub const INVALID: u8 = 0xf;

    /// The opcode's name, for diagnostics.
    pub const fn name(op: u8) -> &'static str {
        match op {
            REQ => "REQ",
            RESP_WR_IMM => "RESP_WR_IMM",
            RESP_SEND => "RESP_SEND",
            0x3 => "RESP_SEND_IMM",
            0x4 => "RESP_SEND_INV",
            0x5 => "RESIZE_CQ",
            0xc => "SIG_ERR",
            REQ_ERR => "REQ_ERR",
            RESP_ERR => "RESP_ERR",
            INVALID => "INVALID",
            _ => "?",
        }
    }
}

/// Error-CQE syndromes (byte 55), as the NIC (and the emulator) reports them.
pub mod syndrome {
    /// A local length error (a gather list longer than the message, say).
    pub const LOCAL_LENGTH_ERR: u8 = 0x01;
    /// A malformed WQE or an operation the QP cannot do.
    pub const LOCAL_QP_OP_ERR: u8 = 0x02;
    /// A local buffer outside its memory region or under a bad lkey.
    pub const LOCAL_PROT_ERR: u8 = 0x04;
    /// Flushed: the QP was already in error when this WQE came up.
    pub const WR_FLUSH_ERR: u8 = 0x05;
    /// Memory-window bind error.
    pub const MW_BIND_ERR: u8 = 0x06;
    /// Bad response from the responder.
    pub const BAD_RESP_ERR: u8 = 0x10;
    /// Local access error.
    pub const LOCAL_ACCESS_ERR: u8 = 0x11;
    /// The responder found the request invalid.
    pub const REMOTE_INVAL_REQ_ERR: u8 = 0x12;
    /// A remote buffer outside its memory region, or a bad rkey.
    pub const REMOTE_ACCESS_ERR: u8 = 0x13;
    /// The responder could not complete the operation.
    pub const REMOTE_OP_ERR: u8 = 0x14;
    /// Transport retries exhausted (the peer did not answer).
    pub const TRANSPORT_RETRY_EXC_ERR: u8 = 0x15;
    /// Receiver-not-ready retries exhausted.
    pub const RNR_RETRY_EXC_ERR: u8 = 0x16;
    /// The responder aborted.
    pub const REMOTE_ABORTED_ERR: u8 = 0x22;

    /// The syndrome's name, for diagnostics.
    pub const fn name(s: u8) -> &'static str {
        match s {
            LOCAL_LENGTH_ERR => "LOCAL_LENGTH_ERR",
            LOCAL_QP_OP_ERR => "LOCAL_QP_OP_ERR",
            LOCAL_PROT_ERR => "LOCAL_PROT_ERR",
            WR_FLUSH_ERR => "WR_FLUSH_ERR",
            MW_BIND_ERR => "MW_BIND_ERR",
            BAD_RESP_ERR => "BAD_RESP_ERR",
            LOCAL_ACCESS_ERR => "LOCAL_ACCESS_ERR",
            REMOTE_INVAL_REQ_ERR => "REMOTE_INVAL_REQ_ERR",
            REMOTE_ACCESS_ERR => "REMOTE_ACCESS_ERR",
            REMOTE_OP_ERR => "REMOTE_OP_ERR",
            TRANSPORT_RETRY_EXC_ERR => "TRANSPORT_RETRY_EXC_ERR",
            RNR_RETRY_EXC_ERR => "RNR_RETRY_EXC_ERR",
            REMOTE_ABORTED_ERR => "REMOTE_ABORTED_ERR",
            _ => "?",
        }
    }
}

/// Bytes per CQE (the 64-byte format; every CQ this project creates uses it).
pub const CQE_BYTES: usize = 64;

/// The 64-byte CQE as the NIC writes it (requester view; bytes 0..32 are responder-only).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct Cqe64 {
    /// `[0,32)` responder-only fields.
    pub rsvd0: [u8; 32],
    /// `[32,36)` SRQ number / user index.
    pub srqn_uidx: Be32,
    /// `[36,40)` immediate of a [`RESP_WR_IMM`](cqe_opcode::RESP_WR_IMM) completion.
    pub imm_inval_pkey: Be32,
    /// `[40]`
    pub app: u8,
    /// `[41]`
    pub app_op: u8,
    /// `[42,44)`
    pub app_info: Be16,
    /// `[44,48)` bytes transferred (responder; requester for reads and atomics).
    pub byte_cnt: Be32,
    /// `[48,56)` completion timestamp.
    pub timestamp: Be64,
    /// `[56,60)` send opcode of the completed WQE (8) | QP number (24).
    pub sop_drop_qpn: Be32,
    /// `[60,62)` index of the completed WQE's first WQEBB, low 16 bits.
    pub wqe_counter: Be16,
    /// `[62]`
    pub signature: u8,
    /// `[63]` opcode (7..4) | solicited (1) | owner (0).
    pub op_own: u8,
}

/// The same 64 bytes read as an error CQE (opcode [`REQ_ERR`](cqe_opcode::REQ_ERR) or
/// [`RESP_ERR`](cqe_opcode::RESP_ERR)).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct ErrCqe {
    /// `[0,32)`
    pub rsvd0: [u8; 32],
    /// `[32,36)`
    pub srqn: Be32,
    /// `[36,54)`
    pub rsvd1: [u8; 18],
    /// `[54]` vendor-specific syndrome.
    pub vendor_err_synd: u8,
    /// `[55]` syndrome ([`syndrome`]).
    pub syndrome: u8,
    /// `[56,60)` opcode of the failed WQE (8) | QP number (24).
    pub s_wqe_opcode_qpn: Be32,
    /// `[60,62)` index of the failed WQE, low 16 bits.
    pub wqe_counter: Be16,
    /// `[62]`
    pub signature: u8,
    /// `[63]` opcode (7..4) | owner (0).
    pub op_own: u8,
}

/// What a CQE slot holds, as [`CqeStatus::state`] says.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CqeState {
    /// Still owned by the NIC: nothing new in this slot.
    Empty = 0,
    /// A completion.
    Ok = 1,
    /// An error completion (requester or responder).
    Error = 2,
}

/// A CQE slot decoded: the same struct device code fills (`ibgda_cqe_status`).
///
/// Every field is taken from the slot's bytes whatever the state; `syndrome`, `vendor_syndrome`
/// mean something only for [`CqeState::Error`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CqeStatus {
    /// [`CqeState`] as a number.
    pub state: u32,
    /// CQE opcode (`op_own >> 4`).
    pub opcode: u8,
    /// Owner bit (`op_own & 1`).
    pub owner: u8,
    /// Error syndrome (byte 55).
    pub syndrome: u8,
    /// Vendor syndrome (byte 54).
    pub vendor_syndrome: u8,
    /// Index of the completed (or failed) WQE's first WQEBB, low 16 bits.
    pub wqe_counter: u16,
    /// Opcode of the completed (or failed) WQE (byte 56).
    pub wqe_opcode: u8,
    /// Zero.
    pub reserved: u8,
    /// QP number (low 24 bits of bytes 56..60).
    pub qpn: u32,
}

impl CqeStatus {
    /// The state, if `state` holds a defined one.
    pub const fn state(&self) -> Option<CqeState> {
        match self.state {
            0 => Some(CqeState::Empty),
            1 => Some(CqeState::Ok),
            2 => Some(CqeState::Error),
            _ => None,
        }
    }

    /// The 16 bytes device code writes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        bytemuck::cast_ref(self)
    }

    /// The status from the 16 bytes device code wrote.
    pub fn from_bytes(bytes: &[u8; 16]) -> Self {
        bytemuck::pod_read_unaligned(bytes)
    }

    /// Decodes the CQE slot read at consumer index `cons_idx` of a ring of `ncqes` (a power of two).
    pub fn parse(cqe: &Cqe64, cons_idx: u64, ncqes: u32) -> Self {
        let word = cqe.sop_drop_qpn.get();
        let opcode = cqe.opcode();
        let state = if !cqe_sw_owned(cqe.op_own, cons_idx, ncqes) {
            CqeState::Empty
        } else if cqe_opcode_is_error(opcode) {
            CqeState::Error
        } else {
            CqeState::Ok
        };
        Self {
            state: state as u32,
            opcode,
            owner: cqe.owner(),
            syndrome: cqe.syndrome(),
            vendor_syndrome: cqe.vendor_syndrome(),
            wqe_counter: cqe.wqe_counter.get(),
            wqe_opcode: (word >> 24) as u8,
            reserved: 0,
            qpn: word & 0xff_ffff,
        }
    }
}

impl fmt::Display for CqeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state() {
            Some(CqeState::Empty) => "empty",
            Some(CqeState::Ok) => "ok",
            Some(CqeState::Error) => "error",
            None => "?",
        };
        write!(
            f,
            "{state}: {} owner={} wqe_counter={:#06x} qpn={:#08x} wqe={}",
            cqe_opcode::name(self.opcode),
            self.owner,
            self.wqe_counter,
            self.qpn,
            opcode::name(self.wqe_opcode)
        )?;
        if self.state() == Some(CqeState::Error) {
            write!(
                f,
                " syndrome={:#04x} ({}) vendor_syndrome={:#04x}",
                self.syndrome,
                syndrome::name(self.syndrome),
                self.vendor_syndrome
            )?;
        }
        Ok(())
    }
}

/// Whether a CQE slot read at consumer index `cons_idx` holds a new completion: its owner bit
/// equals the parity of the pass over the ring, `(cons_idx / ncqes) & 1`, and it is not the
/// [`INVALID`](cqe_opcode::INVALID) opcode rings start with. `ncqes` is a power of two.
pub const fn cqe_sw_owned(op_own: u8, cons_idx: u64, ncqes: u32) -> bool {
    op_own >> 4 != cqe_opcode::INVALID && (op_own & 1) == cqe_owner_bit(cons_idx, ncqes)
}

/// The owner bit a CQE written at producer index `idx` of a ring of `ncqes` carries (what the
/// NIC, or the emulator, writes).
pub const fn cqe_owner_bit(idx: u64, ncqes: u32) -> u8 {
    (idx & ncqes as u64 != 0) as u8
}

/// Whether a CQE opcode reports an error.
pub const fn cqe_opcode_is_error(op: u8) -> bool {
    op == cqe_opcode::REQ_ERR || op == cqe_opcode::RESP_ERR
}

/// The 64-bit WQEBB index a CQE's 16-bit `wqe_counter` names: the greatest index below `frontier`
/// (exclusive, e.g. `ready_head`: no completion passes it) whose low 16 bits equal `counter`.
/// Exact while fewer than 65536 WQEBBs are outstanding, which a ring of at most 32768 guarantees.
/// `frontier` must be at least 1.
pub const fn wqe_index_from_counter(counter: u16, frontier: u64) -> u64 {
    let last = frontier.wrapping_sub(1);
    last.wrapping_sub((last as u16).wrapping_sub(counter) as u64)
}

impl Cqe64 {
    /// A slot as a fresh ring holds it: opcode [`INVALID`](cqe_opcode::INVALID), owner 0 (what
    /// rdma-core initialises CQ buffers with).
    pub fn invalid() -> Self {
        Self {
            op_own: cqe_opcode::INVALID << 4,
            ..Self::zeroed()
        }
    }

    /// A requester completion of the WQE at `wqe_counter` (opcode `wqe_opcode`) on QP `qpn`.
    pub fn requester(owner: u8, wqe_counter: u16, qpn: u32, wqe_opcode: u8, byte_cnt: u32) -> Self {
        Self {
            byte_cnt: Be32::new(byte_cnt),
            sop_drop_qpn: Be32::new(((wqe_opcode as u32) << 24) | (qpn & 0xff_ffff)),
            wqe_counter: Be16::new(wqe_counter),
            op_own: (cqe_opcode::REQ << 4) | (owner & 1),
            ..Self::zeroed()
        }
    }

    /// A requester error completion of the WQE at `wqe_counter` (opcode `wqe_opcode`).
    pub fn requester_error(
        owner: u8,
        wqe_counter: u16,
        qpn: u32,
        wqe_opcode: u8,
        syndrome: u8,
        vendor_syndrome: u8,
    ) -> Self {
        let e = ErrCqe {
            vendor_err_synd: vendor_syndrome,
            syndrome,
            s_wqe_opcode_qpn: Be32::new(((wqe_opcode as u32) << 24) | (qpn & 0xff_ffff)),
            wqe_counter: Be16::new(wqe_counter),
            op_own: (cqe_opcode::REQ_ERR << 4) | (owner & 1),
            ..ErrCqe::zeroed()
        };
        bytemuck::cast(e)
    }

    /// The 64 bytes, as they lie in the CQ ring.
    pub fn as_bytes(&self) -> &[u8; 64] {
        bytemuck::cast_ref(self)
    }

    /// The CQE in the 64 bytes of a CQ slot.
    pub fn from_bytes(bytes: &[u8; 64]) -> Self {
        bytemuck::pod_read_unaligned(bytes)
    }

    /// The CQE opcode (`op_own >> 4`).
    pub const fn opcode(&self) -> u8 {
        self.op_own >> 4
    }

    /// The owner bit.
    pub const fn owner(&self) -> u8 {
        self.op_own & 1
    }

    /// Whether this is an error CQE.
    pub const fn is_error(&self) -> bool {
        cqe_opcode_is_error(self.opcode())
    }

    /// The QP number.
    pub const fn qpn(&self) -> u32 {
        self.sop_drop_qpn.get() & 0xff_ffff
    }

    /// The error syndrome (byte 55; meaningful in error CQEs).
    pub const fn syndrome(&self) -> u8 {
        // Bytes 48..56 are `timestamp` in this view; byte 55 is its last.
        self.timestamp.to_bytes()[7]
    }

    /// The vendor syndrome (byte 54; meaningful in error CQEs).
    pub const fn vendor_syndrome(&self) -> u8 {
        self.timestamp.to_bytes()[6]
    }

    /// The error view of these bytes.
    pub fn as_err(&self) -> &ErrCqe {
        bytemuck::cast_ref(self)
    }

    /// Decodes this slot, read at consumer index `cons_idx` of a ring of `ncqes`.
    pub fn status(&self, cons_idx: u64, ncqes: u32) -> CqeStatus {
        CqeStatus::parse(self, cons_idx, ncqes)
    }
}

impl fmt::Display for Cqe64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = self.sop_drop_qpn.get();
        write!(
            f,
            "CQE {} ({:#x}) owner={} wqe_counter={:#06x} qpn={:#08x} wqe={} ({:#04x})",
            cqe_opcode::name(self.opcode()),
            self.opcode(),
            self.owner(),
            self.wqe_counter.get(),
            word & 0xff_ffff,
            opcode::name((word >> 24) as u8),
            word >> 24
        )?;
        if self.is_error() {
            write!(
                f,
                " syndrome={:#04x} ({}) vendor_syndrome={:#04x}",
                self.syndrome(),
                syndrome::name(self.syndrome()),
                self.vendor_syndrome()
            )
        } else {
            write!(
                f,
                " byte_cnt={} imm={:#010x}",
                self.byte_cnt.get(),
                self.imm_inval_pkey.get()
            )
        }
    }
}

impl fmt::Debug for Cqe64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bytes_sit_where_the_prm_says() {
        let c = Cqe64::requester_error(1, 0x1234, 0xab_cdef, opcode::RDMA_WRITE, 0x13, 0x88);
        let b = bytemuck::bytes_of(&c);
        assert_eq!(b[55], 0x13);
        assert_eq!(b[54], 0x88);
        assert_eq!(&b[56..60], &[0x08, 0xab, 0xcd, 0xef]);
        assert_eq!(&b[60..62], &[0x12, 0x34]);
        assert_eq!(b[63], 0xd1);
        assert_eq!((c.syndrome(), c.vendor_syndrome()), (0x13, 0x88));
        let st = c.status(8, 8);
        assert_eq!(st.state(), Some(CqeState::Error));
        assert_eq!(
            (st.syndrome, st.vendor_syndrome, st.wqe_opcode, st.qpn),
            (0x13, 0x88, 0x08, 0xab_cdef)
        );
        assert!(c.to_string().contains("REMOTE_ACCESS_ERR"));
    }

    #[test]
    fn ownership_follows_pass_parity() {
        let n = 16;
        assert_eq!(Cqe64::invalid().status(0, n).state(), Some(CqeState::Empty));
        for pass in 0..4u64 {
            for slot in [0u64, 5, 15] {
                let idx = pass * n as u64 + slot;
                let owner = cqe_owner_bit(idx, n);
                let c = Cqe64::requester(owner, 1, 2, opcode::NOP, 0);
                assert_eq!(c.status(idx, n).state(), Some(CqeState::Ok));
                assert_eq!(c.status(idx + n as u64, n).state(), Some(CqeState::Empty));
            }
        }
    }

    #[test]
    fn counter_wraps() {
        assert_eq!(wqe_index_from_counter(5, 6), 5);
        assert_eq!(wqe_index_from_counter(0xffff, 0x1_0001), 0xffff);
        assert_eq!(wqe_index_from_counter(0xfff0, 0x1_0005), 0xfff0);
        assert_eq!(wqe_index_from_counter(3, 0x1_0005), 0x1_0003);
        assert_eq!(wqe_index_from_counter(4, 0x1_0005), 0x1_0004);
        assert_eq!(wqe_index_from_counter(5, 0x1_0005), 0x0_0005);
    }
}

static_assertions::const_assert_eq!(std::mem::size_of::<Cqe64>(), CQE_BYTES);
