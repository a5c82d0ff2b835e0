//! `CREATE_CQ` for a CQ whose ring and doorbell record live in registered user memory (umem).

use super::bits::{BitReader, BitWriter, PrmError};
use super::layout::{cmd_in, cmd_out, cqc, create_cq_in, create_cq_out, opcode};
use super::status::{check_output, CommandFailed};

/// A location inside a DEVX umem: the umem's id and a byte offset into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UmemRef {
    /// `mlx5dv_devx_umem.umem_id`.
    pub umem_id: u32,
    /// Byte offset from the start of the umem.
    pub offset: u64,
}

impl UmemRef {
    /// `offset` bytes into umem `umem_id`.
    pub const fn new(umem_id: u32, offset: u64) -> Self {
        Self { umem_id, offset }
    }
}

/// The `CREATE_CQ` command (opcode 0x400): 64-byte CQEs, by default collapsed and ignoring
/// overrun, which is what a GPU poller that reads only the latest completion wants.
///
/// ```
/// use ibgda_verbs::prm::{CreateCq, UmemRef};
/// let image = CreateCq::new(0, 0x12, 5, UmemRef::new(7, 0), UmemRef::new(8, 64)).build()?;
/// assert_eq!(image.len(), 272);
/// assert_eq!(&image[0..2], &[0x04, 0x00]);
/// # Ok::<(), ibgda_verbs::prm::PrmError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreateCq {
    log_cq_size: u8,
    uar_page: u32,
    eqn: u32,
    ring: UmemRef,
    dbr: UmemRef,
    log_page_size: u8,
    collapsed: bool,
    overrun_ignore: bool,
}

impl CreateCq {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = cmd_out::SIZE_BYTES;

    /// A CQ of 2^`log_cq_size` CQEs whose doorbells go through UAR page `uar_page`, whose
    /// events go to EQ `eqn`, with its ring at `ring` and its 8-byte doorbell record at `dbr`.
    pub const fn new(
        log_cq_size: u8,
        uar_page: u32,
        eqn: u32,
        ring: UmemRef,
        dbr: UmemRef,
    ) -> Self {
        Self {
            log_cq_size,
            uar_page,
            eqn,
            ring,
            dbr,
            log_page_size: 0,
            collapsed: true,
            overrun_ignore: true,
        }
    }

    /// Whether every CQE goes to entry 0 (`cqc.cc`; default on).
    pub const fn collapsed(mut self, on: bool) -> Self {
        self.collapsed = on;
        self
    }

    /// Whether the CQ ignores overrun (`cqc.oi`; default on).
    pub const fn overrun_ignore(mut self, on: bool) -> Self {
        self.overrun_ignore = on;
        self
    }

    /// log2 of the ring's page size in 4 KiB units (`cqc.log_page_size`; default 0 = 4 KiB).
    pub const fn log_page_size(mut self, log: u8) -> Self {
        self.log_page_size = log;
        self
    }

    /// The command image.
    pub fn build(&self) -> Result<Vec<u8>, PrmError> {
        let base = create_cq_in::CQ_CONTEXT;
        let mut w = BitWriter::new(create_cq_in::SIZE_BYTES);
        w.put(cmd_in::OPCODE, u64::from(opcode::CREATE_CQ))?
            // 64-byte CQEs (MLX5_CQE_SIZE_64B = 0).
            .put(cqc::CQE_SZ.at(base), 0)?
            .flag(cqc::CC.at(base), self.collapsed)?
            .flag(cqc::OI.at(base), self.overrun_ignore)?
            .put(cqc::LOG_CQ_SIZE.at(base), u64::from(self.log_cq_size))?
            .put(cqc::UAR_PAGE.at(base), u64::from(self.uar_page))?
            .put(cqc::C_EQN.at(base), u64::from(self.eqn))?
            .put(cqc::LOG_PAGE_SIZE.at(base), u64::from(self.log_page_size))?
            .flag(cqc::DBR_UMEM_VALID.at(base), true)?
            .put(cqc::DBR_UMEM_ID.at(base), u64::from(self.dbr.umem_id))?
            .put(cqc::DBR_ADDR.at(base), self.dbr.offset)?
            .put(create_cq_in::CQ_UMEM_OFFSET, self.ring.offset)?
            .put(create_cq_in::CQ_UMEM_ID, u64::from(self.ring.umem_id))?
            .flag(create_cq_in::CQ_UMEM_VALID, true)?;
        Ok(w.finish())
    }
}

/// The CQ number from a `CREATE_CQ` output, or firmware's refusal.
pub fn parse_create_cq_out(out: &[u8]) -> Result<u32, CommandFailed> {
    check_output("CREATE_CQ", out)?;
    Ok(BitReader::new(out).get(create_cq_out::CQN) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        CreateCq::new(
            9,
            0x00ab_cdef,
            0x21,
            UmemRef::new(0x1111_2222, 0x3000),
            UmemRef::new(0x3333_4444, 0x40),
        )
        .log_page_size(4)
        .build()
        .unwrap()
    }

    /// The image byte by byte at the PRM offsets (cq_context starts at byte 0x10).
    #[test]
    fn create_cq_image_matches_prm_offsets() {
        let b = sample();
        assert_eq!(b.len(), 272);
        assert_eq!(&b[0..4], &[0x04, 0x00, 0x00, 0x00], "opcode 0x400, uid 0");
        assert_eq!(&b[4..8], &[0, 0, 0, 0], "op_mod 0");
        let c = &b[0x10..0x50];
        // cqc dword 0: dbr_umem_valid (bit 6) | cqe_sz 0 (bits 8..11) | cc (bit 11) | oi (bit 14).
        assert_eq!(&c[0..4], &[0x02, 0x12, 0x00, 0x00]);
        // cqc dword 1: dbr_umem_id.
        assert_eq!(&c[4..8], &0x3333_4444u32.to_be_bytes());
        // cqc dword 3: log_cq_size (bits 0x63..0x68) | uar_page (0x68..0x80).
        assert_eq!(&c[12..16], &[0x09, 0xab, 0xcd, 0xef]);
        // cqc dword 5: c_eqn.
        assert_eq!(&c[20..24], &[0, 0, 0, 0x21]);
        // cqc dword 6: log_page_size (bits 0xc3..0xc8).
        assert_eq!(c[24], 0x04);
        // cqc.dbr_addr at bits 0x1c0..0x200 = context bytes 56..64.
        assert_eq!(&c[56..64], &0x40u64.to_be_bytes());
        // cq_umem_offset at byte 0x50, cq_umem_id at 0x58, cq_umem_valid = MSB of byte 0x5c.
        assert_eq!(&b[0x50..0x58], &0x3000u64.to_be_bytes());
        assert_eq!(&b[0x58..0x5c], &0x1111_2222u32.to_be_bytes());
        assert_eq!(b[0x5c], 0x80);
        // Nothing else is set.
        let set: usize = b.iter().map(|x| x.count_ones() as usize).sum();
        let expected: usize = [0x02u8, 0x12].iter().map(|x| x.count_ones() as usize).sum::<usize>()
            + 0x3333_4444u32.count_ones() as usize
            + [0x09u8, 0xab, 0xcd, 0xef].iter().map(|x| x.count_ones() as usize).sum::<usize>()
            + 0x21u32.count_ones() as usize
            + 1 // log_page_size 4
            + 1 // dbr_addr 0x40
            + 2 // cq_umem_offset 0x3000
            + 0x1111_2222u32.count_ones() as usize
            + 1 // opcode 0x400
            + 1; // cq_umem_valid
        assert_eq!(set, expected, "no stray bits");
    }

    #[test]
    fn create_cq_round_trip() {
        let b = sample();
        let r = BitReader::new(&b);
        let at = create_cq_in::CQ_CONTEXT;
        assert_eq!(r.get(cmd_in::OPCODE), 0x400);
        assert_eq!(r.get(cqc::LOG_CQ_SIZE.at(at)), 9);
        assert_eq!(r.get(cqc::UAR_PAGE.at(at)), 0xab_cdef);
        assert_eq!(r.get(cqc::C_EQN.at(at)), 0x21);
        assert!(
            r.flag(cqc::CC.at(at)) && r.flag(cqc::OI.at(at)) && r.flag(cqc::DBR_UMEM_VALID.at(at))
        );
        assert_eq!(r.get(cqc::CQE_SZ.at(at)), 0);
        assert_eq!(r.get(cqc::DBR_UMEM_ID.at(at)), 0x3333_4444);
        assert_eq!(r.get(cqc::DBR_ADDR.at(at)), 0x40);
        assert_eq!(r.get(create_cq_in::CQ_UMEM_ID), 0x1111_2222);
        assert_eq!(r.get(create_cq_in::CQ_UMEM_OFFSET), 0x3000);
    }

    #[test]
    fn options_turn_bits_off_and_bad_values_are_refused() {
        let b = CreateCq::new(0, 0, 0, UmemRef::new(1, 0), UmemRef::new(1, 0))
            .collapsed(false)
            .overrun_ignore(false)
            .build()
            .unwrap();
        assert_eq!(
            &b[0x10..0x14],
            &[0x02, 0x00, 0x00, 0x00],
            "only dbr_umem_valid"
        );
        let e = CreateCq::new(32, 0, 0, UmemRef::new(1, 0), UmemRef::new(1, 0))
            .build()
            .unwrap_err();
        assert!(matches!(
            e,
            PrmError::Overflow {
                field: "cqc.log_cq_size",
                ..
            }
        ));
        let e = CreateCq::new(1, 1 << 24, 0, UmemRef::new(1, 0), UmemRef::new(1, 0))
            .build()
            .unwrap_err();
        assert!(matches!(
            e,
            PrmError::Overflow {
                field: "cqc.uar_page",
                ..
            }
        ));
    }

    #[test]
    fn cqn_from_output() {
        let mut out = [0u8; 16];
        out[9..12].copy_from_slice(&[0x01, 0x02, 0x03]);
        assert_eq!(parse_create_cq_out(&out), Ok(0x010203));
        out[0] = 0x0f;
        assert_eq!(parse_create_cq_out(&out).unwrap_err().status, 0x0f);
    }
}
