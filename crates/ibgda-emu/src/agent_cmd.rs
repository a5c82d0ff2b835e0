//! The command ring of the GPU agent ([`crate::agent`]): the layout shared with
//! `cuda/agent_cmd.cuh` (asserted on both sides), and the encoding of the engine's small
//! operations as commands.
//!
//! A ring slot is [`SLOT_BYTES`]: a 64-byte [`AgentCmd`], then [`PAYLOAD_BYTES`] of payload (inline
//! data, a CQE) that the command's `src` points at. The host writes the payload and every field,
//! then `seq` (release); the agent executes the slot once `seq` is the number it expects.

use crate::backend::AtomicOp;
use crate::exec::FetchOrder;

/// Bytes of one ring slot (command and payload).
pub(crate) const SLOT_BYTES: usize = 256;
/// Bytes of payload a slot carries after its command.
pub(crate) const PAYLOAD_BYTES: usize = 192;

/// Copy `len` bytes from `src` to `dst`.
pub(crate) const OP_COPY: u8 = 1;
/// 64-bit fetch-add.
pub(crate) const OP_FA64: u8 = 2;
/// 64-bit compare-swap.
pub(crate) const OP_CS64: u8 = 3;
/// 32-bit fetch-add with field boundaries.
pub(crate) const OP_MFA32: u8 = 4;
/// 32-bit masked compare-swap.
pub(crate) const OP_MCS32: u8 = 5;
/// 64-bit fetch-add with field boundaries.
pub(crate) const OP_MFA64: u8 = 6;
/// A 64-byte CQE from `src` to `dst`, its last 8 bytes (the owner byte) last.
pub(crate) const OP_CQE: u8 = 7;

/// Write the fetched value big-endian.
pub(crate) const FLAG_REPLY_BE: u8 = 2;
/// A copy that may run together with the lane's previous command (also a copy; no order
/// between them).
pub(crate) const FLAG_JOIN: u8 = 4;

/// Control block offsets (pinned host memory, mapped): the stop flag (host writes 1).
pub(crate) const CTRL_STOP: usize = 0;
/// Every command with `seq <= done` has landed (the agent writes it, u64).
pub(crate) const CTRL_DONE: usize = 64;
/// The agent's state (u64, the agent writes it): `generation << 32 | phase`, 0 before the first
/// launch starts.
pub(crate) const CTRL_STATE: usize = 128;
/// Phase: the agent reads the ring.
pub(crate) const PHASE_RUNNING: u32 = 1;
/// Phase: the agent has ended (idle, or told to stop).
pub(crate) const PHASE_EXITED: u32 = 2;
/// Phase: the agent has been idle long enough and re-reads the ring once before it ends.
pub(crate) const PHASE_STOPPING: u32 = 3;
/// Lanes (QPs) one agent serves at once.
pub(crate) const MAX_LANES: usize = 4096;
/// One u32 per lane: the `lane_seq` of the lane's last landed command (the agent writes it).
pub(crate) const CTRL_LANE_DONE: usize = 192;
/// One u32 per lane, written by the lane's copy-engine stream after its copies.
pub(crate) const CTRL_CE_WORDS: usize = CTRL_LANE_DONE + 4 * MAX_LANES;
/// Bytes of the control block.
pub(crate) const CTRL_BYTES: usize = CTRL_CE_WORDS + 4 * MAX_LANES;

/// One command, as `struct emu_agent_cmd` in `cuda/agent_cmd.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AgentCmd {
    /// Published last; 0 is an empty slot.
    pub seq: u64,
    pub op: u8,
    pub flags: u8,
    pub reserved: u16,
    /// COPY: bytes; atomics: width.
    pub len: u32,
    /// Destination, or the atomic's target word.
    pub dst: u64,
    /// COPY/CQE: the source; atomics: where the old value goes (0: nowhere).
    pub src: u64,
    /// Add / swap.
    pub a: u64,
    /// Compare / field boundary.
    pub b: u64,
    /// MCS32: `swap_mask | compare_mask << 32`.
    pub c: u64,
    /// The QP's lane: commands of one lane execute in ring order.
    pub lane: u32,
    /// The command's number in its lane (wrapping): the agent stores it in the lane's done word
    /// once the command has landed.
    pub lane_seq: u32,
}

/// `struct emu_agent_params`: the kernel's one argument.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AgentParams {
    pub ring: u64,
    pub ctrl: u64,
    pub nslots: u32,
    /// This launch's number (1, 2, ...), written into the state word.
    pub generation: u32,
    /// The kernel ends after this long with no command.
    pub idle_exit_ns: u64,
}

const _: () = {
    assert!(std::mem::size_of::<AgentCmd>() == 64);
    assert!(std::mem::offset_of!(AgentCmd, op) == 8);
    assert!(std::mem::offset_of!(AgentCmd, flags) == 9);
    assert!(std::mem::offset_of!(AgentCmd, len) == 12);
    assert!(std::mem::offset_of!(AgentCmd, dst) == 16);
    assert!(std::mem::offset_of!(AgentCmd, src) == 24);
    assert!(std::mem::offset_of!(AgentCmd, a) == 32);
    assert!(std::mem::offset_of!(AgentCmd, b) == 40);
    assert!(std::mem::offset_of!(AgentCmd, c) == 48);
    assert!(std::mem::offset_of!(AgentCmd, lane) == 56);
    assert!(std::mem::offset_of!(AgentCmd, lane_seq) == 60);
    assert!(std::mem::size_of::<AgentParams>() == 32);
    assert!(std::mem::offset_of!(AgentParams, generation) == 20);
    assert!(std::mem::offset_of!(AgentParams, idle_exit_ns) == 24);
    assert!(SLOT_BYTES == 64 + PAYLOAD_BYTES);
    assert!(CTRL_LANE_DONE % 64 == 0 && CTRL_DONE % 64 == 0 && CTRL_STATE % 64 == 0);
    assert!(CTRL_CE_WORDS % 64 == 0);
};

impl AgentCmd {
    /// A copy of `len` bytes (the caller keeps `len` within what the agent is given).
    pub fn copy(lane: u32, dst: u64, src: u64, len: u32) -> Self {
        Self {
            op: OP_COPY,
            len,
            dst,
            src,
            lane,
            ..Self::default()
        }
    }

    /// A CQE whose 64 bytes are at `src`.
    pub fn cqe(lane: u32, dst: u64, src: u64) -> Self {
        Self {
            op: OP_CQE,
            len: 64,
            dst,
            src,
            lane,
            ..Self::default()
        }
    }

    /// `op` on the word at `target`, its old value (formatted as [`FetchOrder`] says, as
    /// [`crate::exec::fetch_reply`] does) written at `result` unless it is 0.
    pub fn atomic(lane: u32, target: u64, op: AtomicOp, result: u64, order: FetchOrder) -> Self {
        let (code, a, b, c) = match op {
            AtomicOp::FetchAdd64 { add } => (OP_FA64, add, 0, 0),
            AtomicOp::CompareSwap64 { swap, compare } => (OP_CS64, swap, compare, 0),
            AtomicOp::MaskedFetchAdd32 {
                add,
                field_boundary,
            } => (OP_MFA32, add as u64, field_boundary as u64, 0),
            AtomicOp::MaskedCompareSwap32 {
                swap,
                compare,
                swap_mask,
                compare_mask,
            } => (
                OP_MCS32,
                swap as u64,
                compare as u64,
                swap_mask as u64 | (compare_mask as u64) << 32,
            ),
            AtomicOp::MaskedFetchAdd64 {
                add,
                field_boundary,
            } => (OP_MFA64, add, field_boundary, 0),
        };
        let big = order.reply_big_endian(&op);
        Self {
            op: code,
            flags: if big { FLAG_REPLY_BE } else { 0 },
            len: op.width() as u32,
            dst: target,
            src: result,
            a,
            b,
            c,
            lane,
            ..Self::default()
        }
    }

    /// The command's 64 bytes (little-endian, as both sides lay it out), `seq` included.
    pub fn to_bytes(self) -> [u8; 64] {
        let mut out = [0u8; 64];
        out[0..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8] = self.op;
        out[9] = self.flags;
        out[10..12].copy_from_slice(&self.reserved.to_le_bytes());
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.dst.to_le_bytes());
        out[24..32].copy_from_slice(&self.src.to_le_bytes());
        out[32..40].copy_from_slice(&self.a.to_le_bytes());
        out[40..48].copy_from_slice(&self.b.to_le_bytes());
        out[48..56].copy_from_slice(&self.c.to_le_bytes());
        out[56..60].copy_from_slice(&self.lane.to_le_bytes());
        out[60..64].copy_from_slice(&self.lane_seq.to_le_bytes());
        out
    }

    /// What the agent computes for an atomic command, given the word's old value: the new
    /// value and the reply bytes (the host model of `cuda/agent.cu`, for tests).
    #[cfg(test)]
    pub fn model(&self, old: u64) -> (u64, Vec<u8>) {
        let op = match self.op {
            OP_FA64 => AtomicOp::FetchAdd64 { add: self.a },
            OP_CS64 => AtomicOp::CompareSwap64 {
                swap: self.a,
                compare: self.b,
            },
            OP_MFA32 => AtomicOp::MaskedFetchAdd32 {
                add: self.a as u32,
                field_boundary: self.b as u32,
            },
            OP_MCS32 => AtomicOp::MaskedCompareSwap32 {
                swap: self.a as u32,
                compare: self.b as u32,
                swap_mask: self.c as u32,
                compare_mask: (self.c >> 32) as u32,
            },
            OP_MFA64 => AtomicOp::MaskedFetchAdd64 {
                add: self.a,
                field_boundary: self.b,
            },
            other => panic!("not an atomic: {other}"),
        };
        let w = self.len as usize;
        let old = if w == 4 { old & 0xffff_ffff } else { old };
        let reply = if self.flags & FLAG_REPLY_BE != 0 {
            old.to_be_bytes()[8 - w..].to_vec()
        } else {
            old.to_le_bytes()[..w].to_vec()
        };
        (op.apply(old), reply)
    }
}

/// The ring slot of command number `seq` (numbers start at 1) in a ring of `nslots`.
pub(crate) fn slot_of(seq: u64, nslots: usize) -> usize {
    ((seq - 1) as usize) & (nslots - 1)
}

/// Whether a lane's done or copy-engine word value `have` has reached `want` (wrapping, as the
/// stream wait compares).
pub(crate) fn reached(have: u32, want: u32) -> bool {
    (have.wrapping_sub(want) as i32) >= 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::fetch_reply;

    #[test]
    fn bytes_follow_the_cuda_layout() {
        let c = AgentCmd {
            seq: 0x0102_0304_0506_0708,
            op: OP_CS64,
            flags: FLAG_REPLY_BE,
            reserved: 0,
            len: 8,
            dst: 0x1111,
            src: 0x2222,
            a: 3,
            b: 4,
            c: 5,
            lane: 6,
            lane_seq: 7,
        };
        let b = c.to_bytes();
        // SAFETY: AgentCmd is repr(C), 64 bytes, no padding (asserted above), all fields plain
        // integers.
        let raw: [u8; 64] = unsafe { std::mem::transmute(c) };
        assert_eq!(b, raw, "little-endian host: the bytes are the struct");
        assert_eq!(b[8], OP_CS64);
        assert_eq!(&b[56..60], &6u32.to_le_bytes());
    }

    #[test]
    fn atomic_commands_reply_as_the_engine_would() {
        let ops = [
            AtomicOp::FetchAdd64 { add: 5 },
            AtomicOp::CompareSwap64 {
                swap: 9,
                compare: 0x1234,
            },
            AtomicOp::MaskedFetchAdd32 {
                add: 0x0001_0001,
                field_boundary: 0x8000_8000,
            },
            AtomicOp::MaskedCompareSwap32 {
                swap: 0xaaaa_aaaa,
                compare: 0xff,
                swap_mask: 0xffff_0000,
                compare_mask: 0xff,
            },
            AtomicOp::MaskedFetchAdd64 {
                add: 1,
                field_boundary: 1 << 7,
            },
        ];
        for op in ops {
            for order in [
                FetchOrder::Mlx5,
                FetchOrder::BigEndian,
                FetchOrder::HostOrder,
            ] {
                for old in [0u64, 0x1234, 0x1234_56ff, 0x0005_ffff, u64::MAX] {
                    let cmd = AgentCmd::atomic(3, 0x1000, op, 0x2000, order);
                    assert_eq!(cmd.len as usize, op.width());
                    let (new, reply) = cmd.model(old);
                    let old_w = if op.width() == 4 {
                        old & 0xffff_ffff
                    } else {
                        old
                    };
                    assert_eq!(new, op.apply(old_w), "{op:?} {old:#x}");
                    assert_eq!(reply, fetch_reply(&op, old_w, order), "{op:?} {order:?}");
                }
            }
        }
    }

    #[test]
    fn slots_wrap_and_counters_compare_across_the_wrap() {
        assert_eq!(slot_of(1, 64), 0);
        assert_eq!(slot_of(64, 64), 63);
        assert_eq!(slot_of(65, 64), 0);
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u32::MAX) && !reached(u32::MAX, 2));
    }
}
