//! The QP doorbell record and the doorbell (BlueFlame register) word.
//!
//! Ringing a QP takes two stores: the send counter into the doorbell record (so the NIC knows how
//! far the ring is valid), then, after a fence, 8 bytes to the BlueFlame register in the UAR page
//! (so it looks). In the CPU handler modes the proxy does both; in mode gpu the GPU does.
//!
//! ```
//! use ibgda_device::wire::{db_word, parse_db_word, DoorbellRecord};
//!
//! let dbr = DoorbellRecord::with_send(0x1_0005);
//! assert_eq!(bytemuck::bytes_of(&dbr), &[0, 0, 0, 0, 0x00, 0x00, 0x00, 0x05]);
//! assert_eq!(parse_db_word(db_word(0xab_cdef, 0x1_0005)), (0xab_cdef, 0x0005));
//! ```

use bytemuck::{Pod, Zeroable};

use super::be::Be32;

/// Byte offset of the receive counter in the doorbell record.
pub const DBR_RECV_OFFSET: usize = 0;
/// Byte offset of the send counter in the doorbell record.
pub const DBR_SEND_OFFSET: usize = 4;
/// Byte offset of the BlueFlame register in the UAR page (rdma-core alternates with the other
/// half at `+0x100`; one half is enough for a single writer).
pub const UAR_BF_OFFSET: usize = 0x800;

/// Bytes of a UAR page (the unit the NIC maps its doorbell registers in).
pub const UAR_PAGE_BYTES: usize = 4096;

/// The QP doorbell record the NIC reads (8 bytes, big-endian 16-bit counters in 32-bit words).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DoorbellRecord {
    /// `[0,4)` receive producer counter (unused: our QPs post no receives).
    pub recv_counter: Be32,
    /// `[4,8)` send producer counter: producer index & 0xffff.
    pub send_counter: Be32,
}

impl DoorbellRecord {
    /// A record whose send counter says the ring is valid below producer index `pi`.
    pub const fn with_send(pi: u64) -> Self {
        Self {
            recv_counter: Be32::ZERO,
            send_counter: dbr_send_word(pi),
        }
    }

    /// The 16-bit send counter.
    pub const fn send_pi16(&self) -> u16 {
        self.send_counter.get() as u16
    }
}

/// The send-counter word for producer index `pi`.
pub const fn dbr_send_word(pi: u64) -> Be32 {
    Be32::new((pi & 0xffff) as u32)
}

/// The 8 bytes stored to the BlueFlame register for QP `qpn` at producer index `pi`: a control
/// segment's first 8 bytes reduced to what the NIC reads, `{be32(pi << 8), be32(qpn << 8)}`.
pub const fn db_bytes(qpn: u32, pi: u64) -> [u8; 8] {
    let lo = Be32::new(((pi & 0xffff) as u32) << 8).to_bytes();
    let hi = Be32::new((qpn & 0xff_ffff) << 8).to_bytes();
    [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
}

/// [`db_bytes`] as the native-endian `u64` one 8-byte store writes (`ibgda_db_word` on the GPU).
pub const fn db_word(qpn: u32, pi: u64) -> u64 {
    u64::from_ne_bytes(db_bytes(qpn, pi))
}

/// The (qpn, 16-bit producer index) a doorbell word rings: what the emulator reads from its
/// stand-in for the BlueFlame register.
pub const fn parse_db_word(word: u64) -> (u32, u16) {
    let b = word.to_ne_bytes();
    let lo = Be32::from_bytes([b[0], b[1], b[2], b[3]]).get();
    let hi = Be32::from_bytes([b[4], b[5], b[6], b[7]]).get();
    (hi >> 8, (lo >> 8) as u16)
}
