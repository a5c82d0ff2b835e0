//! Send-WQE opcodes and opcode modifiers (the low byte and the high byte of a control segment's
//! first word).

/// No operation; with a CQE requested, the WQE that carries a completion.
pub const NOP: u8 = 0x00;
/// RDMA write.
pub const RDMA_WRITE: u8 = 0x08;
/// RDMA write with immediate data.
pub const RDMA_WRITE_IMM: u8 = 0x09;
/// RDMA read (decoded for diagnostics; no builder).
pub const RDMA_READ: u8 = 0x10;
/// 8-byte compare-and-swap.
pub const ATOMIC_CS: u8 = 0x11;
/// 8-byte fetch-and-add.
pub const ATOMIC_FA: u8 = 0x12;
/// Masked (extended) compare-and-swap; the operand size is in the opcode modifier.
pub const ATOMIC_MASKED_CS: u8 = 0x14;
/// Masked (extended) fetch-and-add; the operand size is in the opcode modifier.
pub const ATOMIC_MASKED_FA: u8 = 0x15;

/// Opcode modifier of a masked atomic on 4-byte operands (`0x08 | log2(4) - 2`).
pub const OPMOD_EXT_ATOMIC_4B: u8 = 0x08;
/// Opcode modifier of a masked atomic on 8-byte operands (`0x08 | log2(8) - 2`).
pub const OPMOD_EXT_ATOMIC_8B: u8 = 0x09;

/// The opcode's name, for diagnostics (`"?"` for opcodes this crate does not use).
pub const fn name(opcode: u8) -> &'static str {
    match opcode {
        NOP => "NOP",
        RDMA_WRITE => "RDMA_WRITE",
        RDMA_WRITE_IMM => "RDMA_WRITE_IMM",
        RDMA_READ => "RDMA_READ",
        ATOMIC_CS => "ATOMIC_CS",
        ATOMIC_FA => "ATOMIC_FA",
        ATOMIC_MASKED_CS => "ATOMIC_MASKED_CS",
        ATOMIC_MASKED_FA => "ATOMIC_MASKED_FA",
        0x01 => "SEND_INVAL",
        0x0a => "SEND",
        0x0b => "SEND_IMM",
        0x25 => "UMR",
        _ => "?",
    }
}
