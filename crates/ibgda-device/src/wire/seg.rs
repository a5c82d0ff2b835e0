//! The send-WQE segments, byte for byte as the NIC reads them.
//!
//! Field names are the C names of `include/ibgda/wire.cuh` (and, where it has the segment,
//! rdma-core's `mlx5dv.h`); sizes and offsets are asserted against `layout.def`.

use bytemuck::{Pod, Zeroable};

use super::be::{Be32, Be64};

/// Bytes in a DS unit: WQE sizes count 16-byte units.
pub const DS_BYTES: usize = 16;
/// Shift of the fence mode in the `fm_ce_se` byte (bits 7..5).
pub const FENCE_SHIFT: u8 = 5;
/// `fm_ce_se` completion-mode bits asking for a CQE whatever the outcome.
pub const CTRL_CQ_UPDATE: u8 = 0x08;
/// `fm_ce_se` bit asking for a solicited event.
pub const CTRL_SOLICITED: u8 = 0x02;
/// Flag in an inline segment's byte count that tells it from a data segment.
pub const INLINE_SEG: u32 = 0x8000_0000;
/// Inline bytes that fit one WQEBB after the control (16), remote-address (16) and inline (4)
/// headers.
pub const INLINE_MAX_ONE_BB: usize = 28;

/// The fence mode of a WQE (`fm_ce_se` bits 7..5): what it waits for before it executes.
#[repr(u8)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FenceMode {
    /// No fence.
    #[default]
    None = 0,
    /// Wait for preceding RDMA reads and atomics of this QP to complete (initiator small fence).
    InitiatorSmall = 1,
    /// Wait for all preceding WQEs of this QP to complete.
    Fence = 2,
    /// Strong ordering.
    StrongOrdering = 3,
    /// Small fence and fence together (rdma-core's `IBV_SEND_FENCE`).
    SmallAndFence = 4,
}

impl FenceMode {
    /// The fence mode of an `fm_ce_se` byte, if it is a defined one.
    pub const fn from_fm_ce_se(fm_ce_se: u8) -> Option<Self> {
        match fm_ce_se >> FENCE_SHIFT {
            0 => Some(Self::None),
            1 => Some(Self::InitiatorSmall),
            2 => Some(Self::Fence),
            3 => Some(Self::StrongOrdering),
            4 => Some(Self::SmallAndFence),
            _ => None,
        }
    }
}

/// The `fm_ce_se` byte for a fence mode and whether to ask for a CQE.
pub const fn fm_ce_se(fence: FenceMode, cqe: bool) -> u8 {
    ((fence as u8) << FENCE_SHIFT) | if cqe { CTRL_CQ_UPDATE } else { 0 }
}

/// The values a control segment encodes, in host form.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtrlFields {
    /// The WQE opcode ([`super::opcode`]).
    pub opcode: u8,
    /// The opcode modifier (masked atomics: operand size).
    pub opmod: u8,
    /// Index of the WQE's first WQEBB, low 16 bits of the monotonic WQEBB counter.
    pub wqe_index: u16,
    /// QP number (24 bits).
    pub qpn: u32,
    /// WQE size in 16-byte units (6 bits).
    pub ds: u8,
    /// Fence mode, completion mode and solicited event ([`fm_ce_se`]).
    pub fm_ce_se: u8,
    /// WQE signature (unused: zero).
    pub signature: u8,
    /// Immediate data, in host order (RDMA write with immediate).
    pub imm: u32,
}

/// Control segment: the first 16 bytes of every WQE.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtrlSeg {
    /// `[0,4)` opmod(8) | wqe index(16) | opcode(8).
    pub opmod_idx_opcode: Be32,
    /// `[4,8)` qpn(24) | ds(6).
    pub qpn_ds: Be32,
    /// `[8]` WQE signature.
    pub signature: u8,
    /// `[9,11)` DCI stream channel (not used on RC QPs: zero).
    pub dci_stream_channel_id: [u8; 2],
    /// `[11]` fence mode (7..5), completion mode (3..2), solicited event (1).
    pub fm_ce_se: u8,
    /// `[12,16)` immediate data.
    pub imm: Be32,
}

impl CtrlSeg {
    /// The control segment encoding `f`: the same bytes rdma-core's `mlx5dv_set_ctrl_seg` writes
    /// (given `htobe32(f.imm)`), with `qpn` cut to 24 bits and `ds` to 6.
    pub const fn new(f: CtrlFields) -> Self {
        Self {
            opmod_idx_opcode: Be32::new(
                ((f.opmod as u32) << 24) | ((f.wqe_index as u32) << 8) | f.opcode as u32,
            ),
            qpn_ds: Be32::new(((f.qpn & 0xff_ffff) << 8) | (f.ds as u32 & 0x3f)),
            signature: f.signature,
            dci_stream_channel_id: [0; 2],
            fm_ce_se: f.fm_ce_se,
            imm: Be32::new(f.imm),
        }
    }

    /// The encoded values.
    pub const fn fields(&self) -> CtrlFields {
        let w0 = self.opmod_idx_opcode.get();
        let w1 = self.qpn_ds.get();
        CtrlFields {
            opcode: w0 as u8,
            opmod: (w0 >> 24) as u8,
            wqe_index: (w0 >> 8) as u16,
            qpn: w1 >> 8,
            ds: (w1 & 0x3f) as u8,
            fm_ce_se: self.fm_ce_se,
            signature: self.signature,
            imm: self.imm.get(),
        }
    }
}

/// Remote-address segment: where an RDMA write or an atomic lands.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct RaddrSeg {
    /// `[0,8)` remote virtual address.
    pub raddr: Be64,
    /// `[8,12)` remote key.
    pub rkey: Be32,
    /// `[12,16)` zero.
    pub reserved: Be32,
}

impl RaddrSeg {
    /// The segment for remote address `raddr` under `rkey`.
    pub const fn new(raddr: u64, rkey: u32) -> Self {
        Self {
            raddr: Be64::new(raddr),
            rkey: Be32::new(rkey),
            reserved: Be32::ZERO,
        }
    }
}

/// Data (gather) segment: a local buffer the NIC reads, or an atomic's fetch target.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DataSeg {
    /// `[0,4)` length in bytes; 0 means 2 GiB. Bit 31 clear (set marks an inline segment).
    pub byte_count: Be32,
    /// `[4,8)` local key.
    pub lkey: Be32,
    /// `[8,16)` local virtual address.
    pub addr: Be64,
}

impl DataSeg {
    /// The segment for `len` bytes at `addr` under `lkey`: the same bytes as rdma-core's
    /// `mlx5dv_set_data_seg`.
    pub const fn new(len: u32, lkey: u32, addr: u64) -> Self {
        Self {
            byte_count: Be32::new(len),
            lkey: Be32::new(lkey),
            addr: Be64::new(addr),
        }
    }
}

/// Inline data segment header; the data follows it, the whole padded to 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct InlineSeg {
    /// `[0,4)` length | [`INLINE_SEG`].
    pub byte_count: Be32,
}

impl InlineSeg {
    /// The header of `len` inline bytes.
    pub const fn new(len: u32) -> Self {
        Self {
            byte_count: Be32::new(len | INLINE_SEG),
        }
    }

    /// The inline length, without the flag.
    pub const fn len(&self) -> u32 {
        self.byte_count.get() & !INLINE_SEG
    }

    /// Whether the inline payload is empty.
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Operand segment of the standard 8-byte atomics ([`ATOMIC_FA`](super::opcode::ATOMIC_FA),
/// [`ATOMIC_CS`](super::opcode::ATOMIC_CS)).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AtomicSeg {
    /// `[0,8)` the addend (fetch-add) or the swap value (compare-swap).
    pub swap_add: Be64,
    /// `[8,16)` the compare value (compare-swap); zero for fetch-add.
    pub compare: Be64,
}

/// Operand segment of a masked fetch-add on 4-byte operands (opmod 0x08).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MaskedFa32Seg {
    /// `[0,4)` the addend.
    pub add: Be32,
    /// `[4,8)` a set bit ends a field: the carry out of it is dropped. 0 = one 32-bit add.
    pub field_boundary: Be32,
    /// `[8,16)` zero.
    pub reserved: [Be32; 2],
}

/// Operand segment of a masked compare-swap on 4-byte operands (opmod 0x08).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MaskedCs32Seg {
    /// `[0,4)` the swap value.
    pub swap: Be32,
    /// `[4,8)` the compare value.
    pub compare: Be32,
    /// `[8,12)` the bits of `swap` that are written.
    pub swap_mask: Be32,
    /// `[12,16)` the bits of `compare` that are compared.
    pub compare_mask: Be32,
}

/// Operand segment of a masked fetch-add on 8-byte operands (opmod 0x09).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MaskedFa64Seg {
    /// `[0,8)` the addend.
    pub add: Be64,
    /// `[8,16)` field boundaries (see [`MaskedFa32Seg::field_boundary`]).
    pub field_boundary: Be64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_round_trips() {
        let f = CtrlFields {
            opcode: 0x15,
            opmod: 0x08,
            wqe_index: 0xbeef,
            qpn: 0xab_cdef,
            ds: 4,
            fm_ce_se: fm_ce_se(FenceMode::Fence, true),
            signature: 0x5a,
            imm: 0x0102_0304,
        };
        let seg = CtrlSeg::new(f);
        assert_eq!(seg.fields(), f);
        let b = bytemuck::bytes_of(&seg);
        assert_eq!(&b[..4], &[0x08, 0xbe, 0xef, 0x15]);
        assert_eq!(&b[4..8], &[0xab, 0xcd, 0xef, 0x04]);
        assert_eq!(b[11], 0x48);
        assert_eq!(&b[12..], &[1, 2, 3, 4]);
    }

    #[test]
    fn fence_modes_decode() {
        for m in [
            FenceMode::None,
            FenceMode::InitiatorSmall,
            FenceMode::Fence,
            FenceMode::StrongOrdering,
            FenceMode::SmallAndFence,
        ] {
            assert_eq!(FenceMode::from_fm_ce_se(fm_ce_se(m, true)), Some(m));
        }
        assert_eq!(FenceMode::from_fm_ce_se(0xe0), None);
    }
}
