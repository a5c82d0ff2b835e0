//! The mlx5 wire format, once: send-WQE segments and typed builders, the CQE and its parsing, the
//! doorbell record, and a decoder that prints any WQE or CQE.
//!
//! Every multi-byte field is big-endian on the wire; the conversion lives in [`be`] and nowhere
//! else. Every struct here has a twin in `include/ibgda/wire.cuh` with the same C field names;
//! both are checked against `include/ibgda/layout.def` at compile time (rustc here, the C++ and
//! CUDA compilers there), and the builders of both sides are tested to produce the same bytes as
//! each other and as rdma-core's `mlx5dv.h` setters.
//!
//! | builder | opcode | opmod | segments | DS |
//! |---|---|---|---|---|
//! | [`Nop`] | `NOP` | 0 | ctrl | 1 |
//! | [`RdmaWrite`] | `RDMA_WRITE` (`_IMM` with [`imm`](RdmaWrite::imm)) | 0 | ctrl, raddr, 1-2 data | 3-4 |
//! | [`InlineWrite`] | `RDMA_WRITE` (`_IMM`) | 0 | ctrl, raddr, inline ≤ 28 B | 3-4 |
//! | [`FetchAdd64`] | `ATOMIC_FA` | 0 | ctrl, raddr, atomic, data | 4 |
//! | [`CompareSwap64`] | `ATOMIC_CS` | 0 | ctrl, raddr, atomic, data | 4 |
//! | [`MaskedFetchAdd32`] | `ATOMIC_MASKED_FA` | 0x08 | ctrl, raddr, masked fa32, data | 4 |
//! | [`MaskedCompareSwap32`] | `ATOMIC_MASKED_CS` | 0x08 | ctrl, raddr, masked cs32, data | 4 |
//! | [`MaskedFetchAdd64`] | `ATOMIC_MASKED_FA` | 0x09 | ctrl, raddr, masked fa64, data | 4 |

pub mod be;
mod cqe;
mod doorbell;
mod layout_check;
pub mod opcode;
mod parse;
mod seg;
mod wqe;

pub use be::{Be16, Be32, Be64};
pub use cqe::{
    cqe_opcode, cqe_opcode_is_error, cqe_owner_bit, cqe_sw_owned, syndrome, wqe_index_from_counter,
    Cqe64, CqeState, CqeStatus, ErrCqe, CQE_BYTES,
};
pub use doorbell::{
    db_bytes, db_word, dbr_send_word, parse_db_word, DoorbellRecord, DBR_RECV_OFFSET,
    DBR_SEND_OFFSET, UAR_BF_OFFSET, UAR_PAGE_BYTES,
};
pub use parse::{parse_wqe, DataSegs, ParsedWqe, WqeOp, WqeParseError};
pub use seg::{
    fm_ce_se, AtomicSeg, CtrlFields, CtrlSeg, DataSeg, FenceMode, InlineSeg, MaskedCs32Seg,
    MaskedFa32Seg, MaskedFa64Seg, RaddrSeg, CTRL_CQ_UPDATE, CTRL_SOLICITED, DS_BYTES, FENCE_SHIFT,
    INLINE_MAX_ONE_BB, INLINE_SEG,
};
pub use wqe::{
    CompareSwap64, FetchAdd64, InlineWrite, LocalAddr, MaskedCompareSwap32, MaskedFetchAdd32,
    MaskedFetchAdd64, Nop, RdmaWrite, RemoteAddr, Sge, WqeBB, WQEBB_BYTES,
};
