//! Decoding a WQE from its bytes: what the emulator executes and what diagnostics print.
//!
//! ```
//! use ibgda_device::wire::{parse_wqe, MaskedFetchAdd32, LocalAddr, RemoteAddr, WqeOp};
//!
//! let wqe = MaskedFetchAdd32::new(0x42, 9, RemoteAddr { addr: 0x1000, rkey: 7 },
//!                                 LocalAddr { addr: 0x2000, lkey: 8 }, 1).cqe(true).build();
//! let p = parse_wqe(wqe.as_bytes()).unwrap();
//! assert!(matches!(p.op, WqeOp::MaskedFetchAdd32 { add: 1, field_boundary: 0, .. }));
//! println!("{p}"); // WQE 0x0009 ATOMIC_MASKED_FA opmod=0x08 qpn=0x000042 ds=4 fence=none cqe ...
//! ```

use core::fmt;

use super::cqe::syndrome;
use super::opcode;
use super::seg::{
    AtomicSeg, CtrlFields, CtrlSeg, DataSeg, FenceMode, InlineSeg, MaskedCs32Seg, MaskedFa32Seg,
    MaskedFa64Seg, RaddrSeg, CTRL_CQ_UPDATE, CTRL_SOLICITED, DS_BYTES, INLINE_SEG,
};
use super::wqe::{RemoteAddr, Sge, WqeBB};

/// Why bytes are not a WQE this crate understands.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WqeParseError {
    /// Fewer bytes than a control segment.
    #[error("{have} bytes cannot hold a control segment (16)")]
    Truncated {
        /// Bytes given.
        have: usize,
    },
    /// The control segment's DS reaches past the bytes given.
    #[error("DS {ds} needs {need} bytes but only {have} were given")]
    ShortBuffer {
        /// The WQE's DS.
        ds: u8,
        /// Bytes DS covers.
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// DS does not fit the opcode's segments.
    #[error("{opcode} WQE with DS {ds}, expected {expected}")]
    BadDs {
        /// The opcode's name.
        opcode: &'static str,
        /// The WQE's DS.
        ds: u8,
        /// What DS the opcode takes.
        expected: &'static str,
    },
    /// An inline segment longer than its WQE.
    #[error("inline segment of {len} bytes does not fit DS {ds}")]
    InlineOverflow {
        /// The inline length.
        len: u32,
        /// The WQE's DS.
        ds: u8,
    },
}

impl WqeParseError {
    /// The CQE syndrome hardware reports for such a WQE.
    pub const fn syndrome(&self) -> u8 {
        syndrome::LOCAL_QP_OP_ERR
    }
}

/// The data segments of a gather list, read in place.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DataSegs<'a>(&'a [u8]);

impl<'a> DataSegs<'a> {
    /// Number of segments.
    pub fn len(&self) -> usize {
        self.0.len() / DS_BYTES
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The segments, in order.
    pub fn iter(&self) -> impl Iterator<Item = Sge> + 'a {
        self.0
            .chunks_exact(DS_BYTES)
            .map(|c| sge_of(bytemuck::pod_read_unaligned::<DataSeg>(c)))
    }

    /// Total bytes gathered (a zero byte count means 2 GiB to the NIC, and counts so here).
    pub fn total_len(&self) -> u64 {
        self.iter()
            .map(|s| if s.len == 0 { 1u64 << 31 } else { s.len as u64 })
            .sum()
    }
}

impl fmt::Debug for DataSegs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// What a WQE asks the NIC to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WqeOp<'a> {
    /// Nothing (possibly a completion carrier).
    Nop,
    /// RDMA write (with immediate when `imm` is set) of the gathered local buffers.
    RdmaWrite {
        /// Destination.
        remote: RemoteAddr,
        /// Sources, in order.
        sges: DataSegs<'a>,
        /// The immediate, host order.
        imm: Option<u32>,
    },
    /// RDMA write (with immediate when `imm` is set) of bytes carried in the WQE.
    InlineWrite {
        /// Destination.
        remote: RemoteAddr,
        /// The payload.
        data: &'a [u8],
        /// The immediate, host order.
        imm: Option<u32>,
    },
    /// 64-bit fetch-add.
    FetchAdd64 {
        /// Target.
        remote: RemoteAddr,
        /// Where the old value goes (its `len` should be 8).
        fetch: Sge,
        /// Addend.
        add: u64,
    },
    /// 64-bit compare-swap.
    CompareSwap64 {
        /// Target.
        remote: RemoteAddr,
        /// Where the old value goes (its `len` should be 8).
        fetch: Sge,
        /// Swap value.
        swap: u64,
        /// Compare value.
        compare: u64,
    },
    /// 32-bit masked fetch-add.
    MaskedFetchAdd32 {
        /// Target.
        remote: RemoteAddr,
        /// Where the old value goes (its `len` should be 4).
        fetch: Sge,
        /// Addend.
        add: u32,
        /// Field boundaries.
        field_boundary: u32,
    },
    /// 32-bit masked compare-swap.
    MaskedCompareSwap32 {
        /// Target.
        remote: RemoteAddr,
        /// Where the old value goes (its `len` should be 4).
        fetch: Sge,
        /// Swap value.
        swap: u32,
        /// Compare value.
        compare: u32,
        /// Bits of `swap` written.
        swap_mask: u32,
        /// Bits of `compare` compared.
        compare_mask: u32,
    },
    /// 64-bit masked fetch-add.
    MaskedFetchAdd64 {
        /// Target.
        remote: RemoteAddr,
        /// Where the old value goes (its `len` should be 8).
        fetch: Sge,
        /// Addend.
        add: u64,
        /// Field boundaries.
        field_boundary: u64,
    },
    /// An opcode (or masked-atomic size) this crate does not build; segments not decoded.
    Other,
}

/// A decoded WQE: its control fields and its operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParsedWqe<'a> {
    /// The control segment's values.
    pub ctrl: CtrlFields,
    /// The operation and its operands.
    pub op: WqeOp<'a>,
}

impl ParsedWqe<'_> {
    /// Whether the WQE asks for a CQE on success.
    pub const fn cqe_requested(&self) -> bool {
        self.ctrl.fm_ce_se & CTRL_CQ_UPDATE == CTRL_CQ_UPDATE
    }

    /// The fence mode, if a defined one.
    pub const fn fence(&self) -> Option<FenceMode> {
        FenceMode::from_fm_ce_se(self.ctrl.fm_ce_se)
    }

    /// WQEBBs this WQE occupies in the ring.
    pub const fn wqebbs(&self) -> usize {
        (self.ctrl.ds as usize * DS_BYTES).div_ceil(64)
    }
}

fn sge_of(d: DataSeg) -> Sge {
    Sge {
        addr: d.addr.get(),
        len: d.byte_count.get(),
        lkey: d.lkey.get(),
    }
}

fn remote_of(r: RaddrSeg) -> RemoteAddr {
    RemoteAddr {
        addr: r.raddr.get(),
        rkey: r.rkey.get(),
    }
}

/// Decodes the WQE starting at `bytes[0]`. `bytes` must hold its `ds * 16` bytes contiguously
/// (a WQE that wraps past the end of the ring must be copied out first; ours never span slots).
pub fn parse_wqe(bytes: &[u8]) -> Result<ParsedWqe<'_>, WqeParseError> {
    if bytes.len() < 16 {
        return Err(WqeParseError::Truncated { have: bytes.len() });
    }
    let ctrl: CtrlSeg = bytemuck::pod_read_unaligned(&bytes[..16]);
    let c = ctrl.fields();
    let need = c.ds as usize * DS_BYTES;
    if need > bytes.len() {
        return Err(WqeParseError::ShortBuffer {
            ds: c.ds,
            need,
            have: bytes.len(),
        });
    }
    let body = &bytes[..need];
    let bad = |expected| WqeParseError::BadDs {
        opcode: opcode::name(c.opcode),
        ds: c.ds,
        expected,
    };
    let seg = |i: usize| &body[16 * i..16 * i + 16];
    let remote = || remote_of(bytemuck::pod_read_unaligned(seg(1)));
    let fetch = || sge_of(bytemuck::pod_read_unaligned(seg(3)));
    let imm = (c.opcode == opcode::RDMA_WRITE_IMM).then_some(c.imm);

    let op = match (c.opcode, c.opmod) {
        (opcode::NOP, _) => {
            if c.ds == 0 {
                return Err(bad("at least 1"));
            }
            WqeOp::Nop
        }
        (opcode::RDMA_WRITE | opcode::RDMA_WRITE_IMM, _) => {
            if c.ds < 3 {
                return Err(bad("at least 3"));
            }
            let first = u32::from_be_bytes(body[32..36].try_into().expect("4 bytes"));
            if first & INLINE_SEG != 0 {
                let len = bytemuck::pod_read_unaligned::<InlineSeg>(&body[32..36]).len();
                let end = 36usize.saturating_add(len as usize);
                if end > need {
                    return Err(WqeParseError::InlineOverflow { len, ds: c.ds });
                }
                WqeOp::InlineWrite {
                    remote: remote(),
                    data: &body[36..end],
                    imm,
                }
            } else {
                WqeOp::RdmaWrite {
                    remote: remote(),
                    sges: DataSegs(&body[32..]),
                    imm,
                }
            }
        }
        (opcode::ATOMIC_FA | opcode::ATOMIC_CS, _)
        | (opcode::ATOMIC_MASKED_FA, opcode::OPMOD_EXT_ATOMIC_4B | opcode::OPMOD_EXT_ATOMIC_8B)
        | (opcode::ATOMIC_MASKED_CS, opcode::OPMOD_EXT_ATOMIC_4B) => {
            if c.ds != 4 {
                return Err(bad("4"));
            }
            let (remote, fetch, operand) = (remote(), fetch(), seg(2));
            match (c.opcode, c.opmod) {
                (opcode::ATOMIC_FA, _) => {
                    let a: AtomicSeg = bytemuck::pod_read_unaligned(operand);
                    WqeOp::FetchAdd64 {
                        remote,
                        fetch,
                        add: a.swap_add.get(),
                    }
                }
                (opcode::ATOMIC_CS, _) => {
                    let a: AtomicSeg = bytemuck::pod_read_unaligned(operand);
                    WqeOp::CompareSwap64 {
                        remote,
                        fetch,
                        swap: a.swap_add.get(),
                        compare: a.compare.get(),
                    }
                }
                (opcode::ATOMIC_MASKED_FA, opcode::OPMOD_EXT_ATOMIC_4B) => {
                    let a: MaskedFa32Seg = bytemuck::pod_read_unaligned(operand);
                    WqeOp::MaskedFetchAdd32 {
                        remote,
                        fetch,
                        add: a.add.get(),
                        field_boundary: a.field_boundary.get(),
                    }
                }
                (opcode::ATOMIC_MASKED_FA, _) => {
                    let a: MaskedFa64Seg = bytemuck::pod_read_unaligned(operand);
                    WqeOp::MaskedFetchAdd64 {
                        remote,
                        fetch,
                        add: a.add.get(),
                        field_boundary: a.field_boundary.get(),
                    }
                }
                _ => {
                    let a: MaskedCs32Seg = bytemuck::pod_read_unaligned(operand);
                    WqeOp::MaskedCompareSwap32 {
                        remote,
                        fetch,
                        swap: a.swap.get(),
                        compare: a.compare.get(),
                        swap_mask: a.swap_mask.get(),
                        compare_mask: a.compare_mask.get(),
                    }
                }
            }
        }
        _ => WqeOp::Other,
    };
    Ok(ParsedWqe { ctrl: c, op })
}

impl WqeBB {
    /// Decodes this WQEBB as a (single-WQEBB) WQE.
    pub fn parse(&self) -> Result<ParsedWqe<'_>, WqeParseError> {
        parse_wqe(&self.0)
    }
}

fn fence_name(fm_ce_se: u8) -> &'static str {
    match FenceMode::from_fm_ce_se(fm_ce_se) {
        Some(FenceMode::None) => "none",
        Some(FenceMode::InitiatorSmall) => "initiator_small",
        Some(FenceMode::Fence) => "fence",
        Some(FenceMode::StrongOrdering) => "strong_ordering",
        Some(FenceMode::SmallAndFence) => "small_and_fence",
        None => "?",
    }
}

/// Writes the control segment's line.
fn fmt_ctrl(c: &CtrlFields, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let ce = match (c.fm_ce_se >> 2) & 3 {
        0 => "cqe-on-error",
        2 => "cqe",
        3 => "cqe+event",
        _ => "ce=1",
    };
    write!(
        f,
        "WQE {:#06x} {} ({:#04x}) opmod={:#04x} qpn={:#08x} ds={} fence={} {ce}{}",
        c.wqe_index,
        opcode::name(c.opcode),
        c.opcode,
        c.opmod,
        c.qpn,
        c.ds,
        fence_name(c.fm_ce_se),
        if c.fm_ce_se & CTRL_SOLICITED != 0 {
            " solicited"
        } else {
            ""
        },
    )?;
    if c.opcode == opcode::RDMA_WRITE_IMM {
        write!(f, " imm={:#010x}", c.imm)?;
    }
    Ok(())
}

fn fmt_remote(r: &RemoteAddr, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    write!(f, "\n  raddr {:#018x} rkey {:#010x}", r.addr, r.rkey)
}

fn fmt_sge(s: &Sge, what: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    write!(
        f,
        "\n  {what} {:#018x} lkey {:#010x} len {}",
        s.addr, s.lkey, s.len
    )
}

impl fmt::Display for ParsedWqe<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_ctrl(&self.ctrl, f)?;
        match &self.op {
            WqeOp::Nop | WqeOp::Other => Ok(()),
            WqeOp::RdmaWrite { remote, sges, .. } => {
                fmt_remote(remote, f)?;
                sges.iter().try_for_each(|s| fmt_sge(&s, "data ", f))
            }
            WqeOp::InlineWrite { remote, data, .. } => {
                fmt_remote(remote, f)?;
                write!(f, "\n  inline {} bytes:", data.len())?;
                data.iter().try_for_each(|b| write!(f, " {b:02x}"))
            }
            WqeOp::FetchAdd64 { remote, fetch, add } => {
                fmt_remote(remote, f)?;
                write!(f, "\n  add {add:#x}")?;
                fmt_sge(fetch, "fetch", f)
            }
            WqeOp::CompareSwap64 {
                remote,
                fetch,
                swap,
                compare,
            } => {
                fmt_remote(remote, f)?;
                write!(f, "\n  swap {swap:#x} compare {compare:#x}")?;
                fmt_sge(fetch, "fetch", f)
            }
            WqeOp::MaskedFetchAdd32 {
                remote,
                fetch,
                add,
                field_boundary,
            } => {
                fmt_remote(remote, f)?;
                write!(f, "\n  add32 {add:#x} field_boundary {field_boundary:#x}")?;
                fmt_sge(fetch, "fetch", f)
            }
            WqeOp::MaskedCompareSwap32 {
                remote,
                fetch,
                swap,
                compare,
                swap_mask,
                compare_mask,
            } => {
                fmt_remote(remote, f)?;
                write!(
                    f,
                    "\n  swap32 {swap:#x} compare {compare:#x} swap_mask {swap_mask:#x} compare_mask {compare_mask:#x}"
                )?;
                fmt_sge(fetch, "fetch", f)
            }
            WqeOp::MaskedFetchAdd64 {
                remote,
                fetch,
                add,
                field_boundary,
            } => {
                fmt_remote(remote, f)?;
                write!(f, "\n  add64 {add:#x} field_boundary {field_boundary:#x}")?;
                fmt_sge(fetch, "fetch", f)
            }
        }
    }
}

/// Decodes and prints the WQE in this block; bytes that do not decode are shown as the control
/// fields, the reason and a hex dump.
impl fmt::Display for WqeBB {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.parse() {
            Ok(p) => fmt::Display::fmt(&p, f),
            Err(e) => {
                fmt_ctrl(&self.ctrl().fields(), f)?;
                write!(f, "\n  undecodable: {e}")?;
                for (i, row) in self.0.chunks(16).enumerate() {
                    write!(f, "\n  {:02x}:", i * 16)?;
                    row.iter().try_for_each(|b| write!(f, " {b:02x}"))?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::wqe::*;

    const R: RemoteAddr = RemoteAddr {
        addr: 0xdead_0000,
        rkey: 0x11,
    };
    const L: LocalAddr = LocalAddr {
        addr: 0xbeef_0000,
        lkey: 0x22,
    };

    #[test]
    fn every_builder_round_trips() {
        let s1 = Sge {
            addr: 1,
            len: 2,
            lkey: 3,
        };
        let s2 = Sge {
            addr: 4,
            len: 5,
            lkey: 6,
        };
        let w = RdmaWrite::new_gather(9, 1, R, [s1, s2]).imm(77).build();
        match w.parse().unwrap().op {
            WqeOp::RdmaWrite { remote, sges, imm } => {
                assert_eq!((remote, imm), (R, Some(77)));
                assert_eq!(sges.iter().collect::<Vec<_>>(), vec![s1, s2]);
            }
            other => panic!("{other:?}"),
        }
        let w = InlineWrite::new(9, 1, R, b"hello").build();
        assert_eq!(
            w.parse().unwrap().op,
            WqeOp::InlineWrite {
                remote: R,
                data: b"hello",
                imm: None
            }
        );
        let f8 = Sge {
            addr: L.addr,
            len: 8,
            lkey: L.lkey,
        };
        let f4 = Sge { len: 4, ..f8 };
        assert_eq!(
            FetchAdd64::new(9, 1, R, L, 5).build().parse().unwrap().op,
            WqeOp::FetchAdd64 {
                remote: R,
                fetch: f8,
                add: 5
            }
        );
        assert_eq!(
            CompareSwap64::new(9, 1, R, L, 5, 6)
                .build()
                .parse()
                .unwrap()
                .op,
            WqeOp::CompareSwap64 {
                remote: R,
                fetch: f8,
                swap: 5,
                compare: 6
            }
        );
        assert_eq!(
            MaskedFetchAdd32::new(9, 1, R, L, 5)
                .field_boundary(0x80)
                .build()
                .parse()
                .unwrap()
                .op,
            WqeOp::MaskedFetchAdd32 {
                remote: R,
                fetch: f4,
                add: 5,
                field_boundary: 0x80
            }
        );
        assert_eq!(
            MaskedCompareSwap32::new(9, 1, R, L, 5, 6)
                .masks(7, 8)
                .build()
                .parse()
                .unwrap()
                .op,
            WqeOp::MaskedCompareSwap32 {
                remote: R,
                fetch: f4,
                swap: 5,
                compare: 6,
                swap_mask: 7,
                compare_mask: 8
            }
        );
        assert_eq!(
            MaskedFetchAdd64::new(9, 1, R, L, 5)
                .field_boundary(3)
                .build()
                .parse()
                .unwrap()
                .op,
            WqeOp::MaskedFetchAdd64 {
                remote: R,
                fetch: f8,
                add: 5,
                field_boundary: 3
            }
        );
        assert_eq!(Nop::new(9, 1).build().parse().unwrap().op, WqeOp::Nop);
    }

    #[test]
    fn display_names_everything() {
        let w = MaskedFetchAdd32::new(0x42, 9, R, L, 1)
            .cqe(true)
            .fence(FenceMode::InitiatorSmall)
            .build();
        let s = w.to_string();
        for want in [
            "0x0009",
            "ATOMIC_MASKED_FA",
            "opmod=0x08",
            "qpn=0x000042",
            "ds=4",
            "initiator_small",
            "cqe",
            "rkey",
        ] {
            assert!(s.contains(want), "{want} missing from {s}");
        }
        let mut bad = Nop::new(1, 1).build();
        bad.0[7] = 0x3f; // DS 63 in one WQEBB
        assert!(bad.to_string().contains("undecodable"));
    }

    #[test]
    fn malformed_wqes_are_errors() {
        let mut w = FetchAdd64::new(1, 1, R, L, 1).build();
        w.0[7] = 3;
        assert!(matches!(w.parse(), Err(WqeParseError::BadDs { .. })));
        let mut w = InlineWrite::new(1, 1, R, &[1; 12]).build();
        w.0[35] = 20; // 20 inline bytes claimed in DS 3
        assert!(matches!(
            w.parse(),
            Err(WqeParseError::InlineOverflow { .. })
        ));
        assert!(matches!(
            parse_wqe(&[0; 8]),
            Err(WqeParseError::Truncated { have: 8 })
        ));
    }
}
