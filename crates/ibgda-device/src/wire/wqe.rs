//! Typed WQE builders, one per operation, each producing one 64-byte WQE basic block.
//!
//! Required fields go to `new()`, optional ones are `const fn` setters (fence mode, CQE request,
//! immediate, masks), and `build()` returns a [`WqeBB`]. Every WQE fits one WQEBB, so a CQE's
//! `wqe_counter` (the index of the completed WQE's first WQEBB) names it exactly.
//!
//! ```
//! use ibgda_device::wire::{FenceMode, RdmaWrite, RemoteAddr, Sge, opcode};
//!
//! let wqe = RdmaWrite::new(0x1234, 7, RemoteAddr { addr: 0x7f00_0000_1000, rkey: 0x42 },
//!                          Sge { addr: 0x7e00_0000_0000, len: 4096, lkey: 0x17 })
//!     .fence(FenceMode::InitiatorSmall)
//!     .cqe(true)
//!     .build();
//! let ctrl = wqe.ctrl().fields();
//! assert_eq!((ctrl.opcode, ctrl.wqe_index, ctrl.qpn, ctrl.ds), (opcode::RDMA_WRITE, 7, 0x1234, 3));
//! ```
//!
//! The same builders exist for device code in `include/ibgda/wire.cuh` (`ibgda_wqe_*`); tests
//! check that both produce identical bytes.

use bytemuck::{Pod, Zeroable};
use core::fmt;

use super::opcode;
use super::seg::{
    AtomicSeg, CtrlFields, CtrlSeg, DataSeg, FenceMode, InlineSeg, MaskedCs32Seg, MaskedFa32Seg,
    MaskedFa64Seg, RaddrSeg, CTRL_CQ_UPDATE, FENCE_SHIFT, INLINE_MAX_ONE_BB,
};

/// Bytes in a send WQE basic block: the unit of the ring, of WQE indices and of the counters.
pub const WQEBB_BYTES: usize = 64;

/// One send WQE basic block, as it lies in the ring (slot `(index & (nwqes - 1)) * 64`).
#[repr(C, align(64))]
#[derive(Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct WqeBB(pub [u8; WQEBB_BYTES]);

impl WqeBB {
    /// The bytes.
    pub const fn as_bytes(&self) -> &[u8; WQEBB_BYTES] {
        &self.0
    }

    /// The control segment (bytes 0..16).
    pub fn ctrl(&self) -> CtrlSeg {
        bytemuck::pod_read_unaligned(&self.0[..16])
    }

    /// Writes `seg` at byte `offset`.
    fn put<T: Pod>(&mut self, offset: usize, seg: &T) {
        let b = bytemuck::bytes_of(seg);
        self.0[offset..offset + b.len()].copy_from_slice(b);
    }
}

impl fmt::Debug for WqeBB {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A remote buffer: address and remote key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key of the memory region holding it.
    pub rkey: u32,
}

/// A local buffer without a length: an atomic's fetch target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LocalAddr {
    /// Local virtual address.
    pub addr: u64,
    /// Local key of the memory region holding it.
    pub lkey: u32,
}

/// A local buffer of a gather list: address, length and local key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sge {
    /// Local virtual address.
    pub addr: u64,
    /// Length in bytes, below 2^31 (bit 31 would mark an inline segment; 0 means 2 GiB to the
    /// NIC).
    pub len: u32,
    /// Local key of the memory region holding it.
    pub lkey: u32,
}

impl Sge {
    const fn seg(&self) -> DataSeg {
        DataSeg::new(self.len, self.lkey, self.addr)
    }
}

/// Where a WQE goes and how it is flagged: shared by every builder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Head {
    qpn: u32,
    index: u16,
    fm_ce_se: u8,
}

impl Head {
    const fn new(qpn: u32, index: u16) -> Self {
        Self {
            qpn,
            index,
            fm_ce_se: 0,
        }
    }

    const fn fence(mut self, fence: FenceMode) -> Self {
        self.fm_ce_se = (self.fm_ce_se & !(7 << FENCE_SHIFT)) | ((fence as u8) << FENCE_SHIFT);
        self
    }

    const fn cqe(mut self, cqe: bool) -> Self {
        self.fm_ce_se = if cqe {
            self.fm_ce_se | CTRL_CQ_UPDATE
        } else {
            self.fm_ce_se & !CTRL_CQ_UPDATE
        };
        self
    }

    /// A WQEBB holding just the control segment.
    fn start(&self, opcode: u8, opmod: u8, ds: u8, imm: u32) -> WqeBB {
        let mut b = WqeBB::zeroed();
        b.put(
            0,
            &CtrlSeg::new(CtrlFields {
                opcode,
                opmod,
                wqe_index: self.index,
                qpn: self.qpn,
                ds,
                fm_ce_se: self.fm_ce_se,
                signature: 0,
                imm,
            }),
        );
        b
    }
}

/// The setters every builder has.
macro_rules! common_setters {
    () => {
        /// Sets the fence mode (default [`FenceMode::None`]).
        pub const fn fence(mut self, fence: FenceMode) -> Self {
            self.head = self.head.fence(fence);
            self
        }

        /// Asks for a CQE when this WQE completes (default: no CQE unless it fails).
        pub const fn cqe(mut self, cqe: bool) -> Self {
            self.head = self.head.cqe(cqe);
            self
        }
    };
}

/// NOP (DS 1). With [`cqe`](Nop::cqe) it is the WQE that carries a completion for the WQEs
/// before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nop {
    head: Head,
}

impl Nop {
    /// A NOP for QP `qpn` at WQE index `index` (low 16 bits of the WQEBB counter).
    pub const fn new(qpn: u32, index: u16) -> Self {
        Self {
            head: Head::new(qpn, index),
        }
    }

    common_setters!();

    /// The WQE.
    pub fn build(self) -> WqeBB {
        self.head.start(opcode::NOP, 0, 1, 0)
    }
}

/// RDMA write gathering one or two local buffers (DS 3 or 4); with [`imm`](RdmaWrite::imm) an
/// RDMA write with immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaWrite {
    head: Head,
    remote: RemoteAddr,
    sges: [Sge; 2],
    nsge: u8,
    imm: Option<u32>,
}

impl RdmaWrite {
    /// A write of `local` to `remote`.
    pub const fn new(qpn: u32, index: u16, remote: RemoteAddr, local: Sge) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            sges: [
                local,
                Sge {
                    addr: 0,
                    len: 0,
                    lkey: 0,
                },
            ],
            nsge: 1,
            imm: None,
        }
    }

    /// A write of the concatenation of two local buffers to `remote`.
    pub const fn new_gather(qpn: u32, index: u16, remote: RemoteAddr, sges: [Sge; 2]) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            sges,
            nsge: 2,
            imm: None,
        }
    }

    common_setters!();

    /// Makes it an RDMA write with immediate `imm` (host order; the responder's CQE carries it).
    pub const fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let (op, imm) = match self.imm {
            Some(imm) => (opcode::RDMA_WRITE_IMM, imm),
            None => (opcode::RDMA_WRITE, 0),
        };
        let mut b = self.head.start(op, 0, 2 + self.nsge, imm);
        b.put(16, &RaddrSeg::new(self.remote.addr, self.remote.rkey));
        for (i, s) in self.sges[..self.nsge as usize].iter().enumerate() {
            debug_assert!(
                s.len < 1 << 31,
                "gather length {:#x} has the inline flag",
                s.len
            );
            b.put(32 + 16 * i, &s.seg());
        }
        b
    }
}

/// RDMA write whose payload (at most [`INLINE_MAX_ONE_BB`] bytes) travels inside the WQE; DS 3
/// up to 12 bytes, 4 above. With [`imm`](InlineWrite::imm) an RDMA write with immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InlineWrite {
    head: Head,
    remote: RemoteAddr,
    data: [u8; INLINE_MAX_ONE_BB],
    len: u8,
    imm: Option<u32>,
}

impl InlineWrite {
    /// A write of `data` to `remote`.
    ///
    /// # Panics
    /// If `data` is longer than [`INLINE_MAX_ONE_BB`] bytes.
    pub const fn new(qpn: u32, index: u16, remote: RemoteAddr, data: &[u8]) -> Self {
        assert!(
            data.len() <= INLINE_MAX_ONE_BB,
            "inline data longer than one WQEBB holds"
        );
        let mut buf = [0u8; INLINE_MAX_ONE_BB];
        let mut i = 0;
        while i < data.len() {
            buf[i] = data[i];
            i += 1;
        }
        Self {
            head: Head::new(qpn, index),
            remote,
            data: buf,
            len: data.len() as u8,
            imm: None,
        }
    }

    common_setters!();

    /// Makes it an RDMA write with immediate `imm` (host order).
    pub const fn imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
        self
    }

    /// DS of an inline write of `len` bytes.
    pub const fn ds_for(len: usize) -> u8 {
        (2 + (4 + len).div_ceil(16)) as u8
    }

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let len = self.len as usize;
        let (op, imm) = match self.imm {
            Some(imm) => (opcode::RDMA_WRITE_IMM, imm),
            None => (opcode::RDMA_WRITE, 0),
        };
        let mut b = self.head.start(op, 0, Self::ds_for(len), imm);
        b.put(16, &RaddrSeg::new(self.remote.addr, self.remote.rkey));
        b.put(32, &InlineSeg::new(len as u32));
        b.0[36..36 + len].copy_from_slice(&self.data[..len]);
        b
    }
}

/// An atomic WQE: control, remote address, a 16-byte operand segment, the fetch target (DS 4).
fn atomic<T: Pod>(
    head: Head,
    op: u8,
    opmod: u8,
    remote: RemoteAddr,
    fetch: LocalAddr,
    len: u32,
    operand: &T,
) -> WqeBB {
    let mut b = head.start(op, opmod, 4, 0);
    b.put(16, &RaddrSeg::new(remote.addr, remote.rkey));
    b.put(32, operand);
    b.put(48, &DataSeg::new(len, fetch.lkey, fetch.addr));
    b
}

/// 64-bit fetch-add ([`ATOMIC_FA`](opcode::ATOMIC_FA)); the old value lands at `fetch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FetchAdd64 {
    head: Head,
    remote: RemoteAddr,
    fetch: LocalAddr,
    add: u64,
}

impl FetchAdd64 {
    /// Adds `add` to the 8 bytes at `remote`.
    pub const fn new(qpn: u32, index: u16, remote: RemoteAddr, fetch: LocalAddr, add: u64) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            fetch,
            add,
        }
    }

    common_setters!();

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let seg = AtomicSeg {
            swap_add: self.add.into(),
            compare: 0.into(),
        };
        atomic(
            self.head,
            opcode::ATOMIC_FA,
            0,
            self.remote,
            self.fetch,
            8,
            &seg,
        )
    }
}

/// 64-bit compare-swap ([`ATOMIC_CS`](opcode::ATOMIC_CS)); the old value lands at `fetch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompareSwap64 {
    head: Head,
    remote: RemoteAddr,
    fetch: LocalAddr,
    swap: u64,
    compare: u64,
}

impl CompareSwap64 {
    /// Writes `swap` to the 8 bytes at `remote` if they equal `compare`.
    pub const fn new(
        qpn: u32,
        index: u16,
        remote: RemoteAddr,
        fetch: LocalAddr,
        swap: u64,
        compare: u64,
    ) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            fetch,
            swap,
            compare,
        }
    }

    common_setters!();

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let seg = AtomicSeg {
            swap_add: self.swap.into(),
            compare: self.compare.into(),
        };
        atomic(
            self.head,
            opcode::ATOMIC_CS,
            0,
            self.remote,
            self.fetch,
            8,
            &seg,
        )
    }
}

/// 32-bit masked fetch-add ([`ATOMIC_MASKED_FA`](opcode::ATOMIC_MASKED_FA), opmod 0x08).
///
/// With the default field boundary 0 it is a plain 32-bit add: the signal add of the
/// dispatch/combine protocols, whose fetched value goes to a scratch word nobody reads.
#[doc(alias = "signal add")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskedFetchAdd32 {
    head: Head,
    remote: RemoteAddr,
    fetch: LocalAddr,
    add: u32,
    field_boundary: u32,
}

impl MaskedFetchAdd32 {
    /// Adds `add` to the 4 bytes at `remote`.
    pub const fn new(qpn: u32, index: u16, remote: RemoteAddr, fetch: LocalAddr, add: u32) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            fetch,
            add,
            field_boundary: 0,
        }
    }

    common_setters!();

    /// Splits the operand into fields: a set bit ends a field, and the carry out of it is dropped.
    pub const fn field_boundary(mut self, field_boundary: u32) -> Self {
        self.field_boundary = field_boundary;
        self
    }

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let seg = MaskedFa32Seg {
            add: self.add.into(),
            field_boundary: self.field_boundary.into(),
            reserved: [0.into(); 2],
        };
        atomic(
            self.head,
            opcode::ATOMIC_MASKED_FA,
            opcode::OPMOD_EXT_ATOMIC_4B,
            self.remote,
            self.fetch,
            4,
            &seg,
        )
    }
}

/// 32-bit masked compare-swap ([`ATOMIC_MASKED_CS`](opcode::ATOMIC_MASKED_CS), opmod 0x08);
/// with the default all-ones masks a plain 32-bit compare-swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskedCompareSwap32 {
    head: Head,
    remote: RemoteAddr,
    fetch: LocalAddr,
    swap: u32,
    compare: u32,
    swap_mask: u32,
    compare_mask: u32,
}

impl MaskedCompareSwap32 {
    /// Writes `swap` to the 4 bytes at `remote` if they equal `compare`.
    pub const fn new(
        qpn: u32,
        index: u16,
        remote: RemoteAddr,
        fetch: LocalAddr,
        swap: u32,
        compare: u32,
    ) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            fetch,
            swap,
            compare,
            swap_mask: !0,
            compare_mask: !0,
        }
    }

    common_setters!();

    /// Compares only the bits of `compare_mask` and writes only the bits of `swap_mask`.
    pub const fn masks(mut self, swap_mask: u32, compare_mask: u32) -> Self {
        self.swap_mask = swap_mask;
        self.compare_mask = compare_mask;
        self
    }

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let seg = MaskedCs32Seg {
            swap: self.swap.into(),
            compare: self.compare.into(),
            swap_mask: self.swap_mask.into(),
            compare_mask: self.compare_mask.into(),
        };
        atomic(
            self.head,
            opcode::ATOMIC_MASKED_CS,
            opcode::OPMOD_EXT_ATOMIC_4B,
            self.remote,
            self.fetch,
            4,
            &seg,
        )
    }
}

/// 64-bit masked fetch-add ([`ATOMIC_MASKED_FA`](opcode::ATOMIC_MASKED_FA), opmod 0x09).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskedFetchAdd64 {
    head: Head,
    remote: RemoteAddr,
    fetch: LocalAddr,
    add: u64,
    field_boundary: u64,
}

impl MaskedFetchAdd64 {
    /// Adds `add` to the 8 bytes at `remote`.
    pub const fn new(qpn: u32, index: u16, remote: RemoteAddr, fetch: LocalAddr, add: u64) -> Self {
        Self {
            head: Head::new(qpn, index),
            remote,
            fetch,
            add,
            field_boundary: 0,
        }
    }

    common_setters!();

    /// Splits the operand into fields (see [`MaskedFetchAdd32::field_boundary`]).
    pub const fn field_boundary(mut self, field_boundary: u64) -> Self {
        self.field_boundary = field_boundary;
        self
    }

    /// The WQE.
    pub fn build(self) -> WqeBB {
        let seg = MaskedFa64Seg {
            add: self.add.into(),
            field_boundary: self.field_boundary.into(),
        };
        atomic(
            self.head,
            opcode::ATOMIC_MASKED_FA,
            opcode::OPMOD_EXT_ATOMIC_8B,
            self.remote,
            self.fetch,
            8,
            &seg,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: RemoteAddr = RemoteAddr {
        addr: 0x1122_3344_5566_7788,
        rkey: 0xaabb_ccdd,
    };
    const L: LocalAddr = LocalAddr {
        addr: 0x0102_0304_0506_0708,
        lkey: 0x1357_9bdf,
    };

    #[test]
    fn nop_with_cqe() {
        let w = Nop::new(0x12_3456, 0xfffe)
            .cqe(true)
            .fence(FenceMode::Fence)
            .build();
        assert_eq!(
            &w.0[..12],
            &[0x00, 0xff, 0xfe, 0x00, 0x12, 0x34, 0x56, 0x01, 0, 0, 0, 0x48]
        );
        assert!(w.0[12..].iter().all(|&b| b == 0));
    }

    #[test]
    fn write_layout() {
        let w = RdmaWrite::new(
            1,
            2,
            R,
            Sge {
                addr: L.addr,
                len: 0x100,
                lkey: L.lkey,
            },
        )
        .imm(0xcafe_f00d)
        .build();
        let c = w.ctrl().fields();
        assert_eq!(
            (c.opcode, c.ds, c.imm),
            (opcode::RDMA_WRITE_IMM, 3, 0xcafe_f00d)
        );
        assert_eq!(&w.0[16..24], &R.addr.to_be_bytes());
        assert_eq!(&w.0[24..28], &R.rkey.to_be_bytes());
        assert_eq!(&w.0[32..36], &0x100u32.to_be_bytes());
        assert_eq!(&w.0[40..48], &L.addr.to_be_bytes());
        assert!(w.0[48..].iter().all(|&b| b == 0));
    }

    #[test]
    fn inline_ds() {
        assert_eq!(InlineWrite::ds_for(0), 3);
        assert_eq!(InlineWrite::ds_for(12), 3);
        assert_eq!(InlineWrite::ds_for(13), 4);
        assert_eq!(InlineWrite::ds_for(28), 4);
        let w = InlineWrite::new(1, 2, R, &[9; 28]).build();
        assert_eq!(&w.0[32..36], &[0x80, 0, 0, 28]);
        assert_eq!(&w.0[36..], &[9; 28]);
    }

    #[test]
    #[should_panic(expected = "inline data longer")]
    fn inline_too_long_panics() {
        let _ = InlineWrite::new(1, 2, R, &[0; 29]);
    }

    #[test]
    fn atomics_layout() {
        let w = MaskedFetchAdd32::new(7, 8, R, L, 0xdead_beef).build();
        let c = w.ctrl().fields();
        assert_eq!(
            (c.opcode, c.opmod, c.ds),
            (opcode::ATOMIC_MASKED_FA, 0x08, 4)
        );
        assert_eq!(&w.0[32..40], &[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0]);
        assert_eq!(&w.0[48..52], &4u32.to_be_bytes());
        let w = CompareSwap64::new(7, 8, R, L, 1, 2).build();
        assert_eq!(
            &w.0[32..48],
            &[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2]
        );
        assert_eq!(&w.0[48..52], &8u32.to_be_bytes());
    }
}
