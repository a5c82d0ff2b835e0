//! `QUERY_HCA_CAP`: the device capabilities that the IBGDA path depends on.

use super::bits::{BitReader, BitWriter};
use super::layout::{
    atomic_caps, cmd_hca_cap, cmd_in, opcode, query_hca_cap_in, query_hca_cap_out,
};

/// Which capability page to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HcaCap {
    /// `cmd_hca_cap`: the general device capabilities.
    General,
    /// `atomic_caps`: atomic operations, operand sizes and reply endianness.
    Atomic,
}

impl HcaCap {
    const fn type_code(self) -> u16 {
        match self {
            HcaCap::General => query_hca_cap_in::CAP_GENERAL_DEVICE,
            HcaCap::Atomic => query_hca_cap_in::CAP_ATOMIC,
        }
    }
}

/// The `QUERY_HCA_CAP` command (opcode 0x100).
///
/// ```
/// use ibgda_verbs::prm::{HcaCap, QueryHcaCap};
/// let image = QueryHcaCap::new(HcaCap::Atomic).build();
/// assert_eq!(image.len(), 16);
/// assert_eq!(&image[0..2], &[0x01, 0x00]); // opcode
/// assert_eq!(&image[6..8], &[0x00, 0x07]); // op_mod = ATOMIC << 1 | current
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryHcaCap {
    cap: HcaCap,
    current: bool,
}

impl QueryHcaCap {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = query_hca_cap_out::SIZE_BYTES;

    /// Reads the current (in-use) values of `cap`.
    pub const fn new(cap: HcaCap) -> Self {
        Self { cap, current: true }
    }

    /// Reads the maximum values the device could be configured to instead of the current ones.
    pub const fn maximum(mut self) -> Self {
        self.current = false;
        self
    }

    /// The command image.
    pub fn build(&self) -> Vec<u8> {
        let current = if self.current {
            query_hca_cap_in::OP_MOD_CURRENT
        } else {
            0
        };
        let op_mod = (self.cap.type_code() << 1) | current;
        let mut w = BitWriter::new(query_hca_cap_in::SIZE_BYTES);
        // The fields are constants that fit by construction; a failure here is a table bug.
        w.put(cmd_in::OPCODE, u64::from(opcode::QUERY_HCA_CAP))
            .and_then(|w| w.put(cmd_in::OP_MOD, u64::from(op_mod)))
            .expect("QUERY_HCA_CAP header fields fit");
        w.finish()
    }
}

/// The capability page inside a `QUERY_HCA_CAP` output.
///
/// # Panics
/// If `out` is shorter than [`QueryHcaCap::OUT_LEN`].
pub fn capability_page(out: &[u8]) -> &[u8] {
    let start = query_hca_cap_out::CAPABILITY_BIT as usize / 8;
    &out[start..start + query_hca_cap_out::CAPABILITY_BYTES]
}

/// The general capabilities this crate reads (`struct mlx5_ifc_cmd_hca_cap_bits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GeneralCaps {
    /// log2 of the largest send queue, in WQEBBs.
    pub log_max_qp_sz: u8,
    /// log2 of the largest CQ, in CQEs.
    pub log_max_cq_sz: u8,
    /// log2 of the largest message.
    pub log_max_msg: u8,
    /// log2 of outstanding reads/atomics per QP as requester.
    pub log_max_ra_req_qp: u8,
    /// log2 of outstanding reads/atomics per QP as responder.
    pub log_max_ra_res_qp: u8,
    /// CQE format version in use: 0 or 1.
    pub cqe_version: u8,
    /// 0 = InfiniBand, 1 = Ethernet.
    pub port_type: u8,
    /// Number of ports.
    pub num_ports: u8,
    /// BlueFlame is supported.
    pub bf: bool,
    /// log2 of a BlueFlame register's size.
    pub log_bf_reg_size: u8,
    /// UAR pages are 4 KiB.
    pub uar_4k: bool,
    /// log2 of a UAR page in 4 KiB units (as the PRM reports it).
    pub log_uar_page_sz: u16,
    /// RoCE is supported.
    pub roce: bool,
    /// Atomic operations are supported (and the ATOMIC page is valid).
    pub atomic: bool,
    /// CQs may ignore overrun.
    pub cq_oi: bool,
    /// RC transport is supported.
    pub rc: bool,
    /// umem objects may be created with uid 0.
    pub umem_uid_0: bool,
    /// log2 of the number of umem objects.
    pub log_max_umem: u8,
    /// log2 of the smallest page size.
    pub log_pg_sz: u8,
    /// Send-queue timestamp formats: 0 free-running only, 1 real-time only, 2 both.
    pub sq_ts_format: u8,
    /// Receive-queue timestamp formats, as `sq_ts_format`.
    pub rq_ts_format: u8,
}

impl GeneralCaps {
    /// Reads the fields from a general capability page ([`capability_page`]).
    pub fn parse(page: &[u8]) -> Self {
        let r = BitReader::new(page);
        let g = |f| r.get(f) as u8;
        Self {
            log_max_qp_sz: g(cmd_hca_cap::LOG_MAX_QP_SZ),
            log_max_cq_sz: g(cmd_hca_cap::LOG_MAX_CQ_SZ),
            log_max_msg: g(cmd_hca_cap::LOG_MAX_MSG),
            log_max_ra_req_qp: g(cmd_hca_cap::LOG_MAX_RA_REQ_QP),
            log_max_ra_res_qp: g(cmd_hca_cap::LOG_MAX_RA_RES_QP),
            cqe_version: g(cmd_hca_cap::CQE_VERSION),
            port_type: g(cmd_hca_cap::PORT_TYPE),
            num_ports: g(cmd_hca_cap::NUM_PORTS),
            bf: r.flag(cmd_hca_cap::BF),
            log_bf_reg_size: g(cmd_hca_cap::LOG_BF_REG_SIZE),
            uar_4k: r.flag(cmd_hca_cap::UAR_4K),
            log_uar_page_sz: r.get(cmd_hca_cap::LOG_UAR_PAGE_SZ) as u16,
            roce: r.flag(cmd_hca_cap::ROCE),
            atomic: r.flag(cmd_hca_cap::ATOMIC),
            cq_oi: r.flag(cmd_hca_cap::CQ_OI),
            rc: r.flag(cmd_hca_cap::RC),
            umem_uid_0: r.flag(cmd_hca_cap::UMEM_UID_0),
            log_max_umem: g(cmd_hca_cap::LOG_MAX_UMEM),
            log_pg_sz: g(cmd_hca_cap::LOG_PG_SZ),
            sq_ts_format: g(cmd_hca_cap::SQ_TS_FORMAT),
            rq_ts_format: g(cmd_hca_cap::RQ_TS_FORMAT),
        }
    }

    /// The QP timestamp format to request at creation, given what the device supports: newer
    /// firmware rejects a QP whose `ts_format` it cannot provide.
    pub fn qp_ts_format(&self) -> TsFormat {
        TsFormat::for_capability(self.sq_ts_format)
    }
}

/// A QP's CQE timestamp format (`MLX5_TIMESTAMP_FORMAT_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TsFormat {
    /// Free-running counter (what every device supports unless it reports real-time only).
    #[default]
    FreeRunning = 0,
    /// The device's default.
    Default = 1,
    /// Real-time clock.
    RealTime = 2,
}

impl TsFormat {
    /// The format to request given `cmd_hca_cap.sq_ts_format` (0 free-running only, 1 real-time
    /// only, 2 both).
    pub const fn for_capability(cap: u8) -> Self {
        match cap {
            1 => TsFormat::RealTime,
            2 => TsFormat::Default,
            _ => TsFormat::FreeRunning,
        }
    }
}

/// The atomic capabilities (`struct mlx5_ifc_atomic_caps_bits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AtomicCaps {
    /// `MLX5_ATOMIC_OPS_*` bits.
    pub operations: u16,
    /// Supported operand sizes on RC QPs, one bit per power-of-two size.
    pub size_qp: u16,
    /// 0: 8-byte atomic replies are big-endian (IB spec); 1: host order.
    pub req_8b_endianness_mode: u8,
}

impl AtomicCaps {
    /// Reads the fields from an ATOMIC capability page ([`capability_page`]).
    pub fn parse(page: &[u8]) -> Self {
        let r = BitReader::new(page);
        Self {
            operations: r.get(atomic_caps::ATOMIC_OPERATIONS) as u16,
            size_qp: r.get(atomic_caps::ATOMIC_SIZE_QP) as u16,
            req_8b_endianness_mode: r.get(atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE) as u8,
        }
    }

    /// 8-byte compare-and-swap and fetch-and-add.
    pub fn standard(&self) -> bool {
        let both = atomic_caps::OPS_CMP_SWAP | atomic_caps::OPS_FETCH_ADD;
        self.operations & both == both
    }

    /// Masked (extended) compare-and-swap and fetch-and-add on 8-byte operands, which the
    /// device code uses for `MASKED_CS`/`MASKED_FA`.
    pub fn extended(&self) -> bool {
        let both = atomic_caps::OPS_EXTENDED_CMP_SWAP | atomic_caps::OPS_EXTENDED_FETCH_ADD;
        self.operations & both == both && self.size_qp & atomic_caps::SIZE_QP_8_BYTES != 0
    }

    /// The `qpc.atomic_mode` to enable on RC QPs: up-to-8-byte extended atomics when present,
    /// else the IB-spec ones, else none.
    pub fn qp_atomic_mode(&self) -> Option<AtomicMode> {
        if self.extended() {
            Some(AtomicMode::UpTo8Bytes)
        } else if self.standard() {
            Some(AtomicMode::IbSpec)
        } else {
            None
        }
    }
}

/// `qpc.atomic_mode` (`MLX5_QPC_ATOMIC_MODE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicMode {
    /// IB-spec 8-byte compare-and-swap and fetch-and-add only.
    IbSpec = 1,
    /// 8-byte operands only (including masked).
    Only8Bytes = 2,
    /// Operands up to 8 bytes (including masked).
    UpTo8Bytes = 3,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prm::bits::BitWriter;

    #[test]
    fn query_images() {
        let g = QueryHcaCap::new(HcaCap::General).build();
        assert_eq!(
            g,
            [0x01, 0x00, 0, 0, 0, 0, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        let a = QueryHcaCap::new(HcaCap::Atomic).build();
        assert_eq!(&a[6..8], &[0x00, 0x07]);
        let m = QueryHcaCap::new(HcaCap::Atomic).maximum().build();
        assert_eq!(&m[6..8], &[0x00, 0x06]);
        assert_eq!(QueryHcaCap::OUT_LEN, 16 + 4096);
    }

    #[test]
    fn general_caps_read_from_prm_offsets() {
        // Build a page by hand, byte by byte, from the PRM offsets.
        let mut page = vec![0u8; 4096];
        page[0x88 / 8] = 15; // log_max_qp_sz at bit 0x88
        page[0xc8 / 8] = 22; // log_max_cq_sz at bit 0xc8
        page[0x1c0 / 8] = 0x1e; // log_max_msg: bits 0x1c3..0x1c8 = low 5 bits of byte 0x38
        page[0x1f8 / 8] = 0x01; // cqe_version: bits 0x1fc..0x200 = low nibble of byte 0x3f
        page[0x1b0 / 8] = 0x01; // port_type: bits 0x1b6..0x1b8 = low 2 bits of byte 0x36
        page[0x260 / 8] = 0x80; // bf at bit 0x260
        page[0x268 / 8] = 0x09; // log_bf_reg_size: bits 0x26b..0x270 = low 5 bits of byte 0x4d
        page[0x218 / 8] = 0x06; // roce 0x21d, atomic 0x21e: bits 2 and 1 of byte 0x43
        page[0x220 / 8] = 0x80; // cq_oi at 0x220
        page[0x238 / 8] = 0x01; // rc at 0x23f
        page[0x440 / 8] = 0x80; // sq_ts_format = 2 (bits 0x440..0x442)
        let c = GeneralCaps::parse(&page);
        assert_eq!(c.log_max_qp_sz, 15);
        assert_eq!(c.log_max_cq_sz, 22);
        assert_eq!(c.log_max_msg, 30);
        assert_eq!(c.cqe_version, 1);
        assert_eq!(c.port_type, 1);
        assert!(c.bf);
        assert_eq!(c.log_bf_reg_size, 9);
        assert!(c.roce && c.atomic && c.cq_oi && c.rc);
        assert_eq!(c.sq_ts_format, 2);
        assert_eq!(c.qp_ts_format(), TsFormat::Default);
    }

    #[test]
    fn ts_format_choice() {
        assert_eq!(TsFormat::for_capability(0), TsFormat::FreeRunning);
        assert_eq!(TsFormat::for_capability(1), TsFormat::RealTime);
        assert_eq!(TsFormat::for_capability(2), TsFormat::Default);
    }

    #[test]
    fn atomic_caps_and_mode() {
        let mut w = BitWriter::new(4096);
        w.put(atomic_caps::ATOMIC_OPERATIONS, 0xf).unwrap();
        w.put(atomic_caps::ATOMIC_SIZE_QP, 0x8 | 0x4).unwrap();
        w.put(atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE, 1)
            .unwrap();
        let page = w.finish();
        // atomic_operations at bits 0x90..0xa0 = bytes 0x12..0x14.
        assert_eq!(&page[0x12..0x14], &[0x00, 0x0f]);
        assert_eq!(&page[0x16..0x18], &[0x00, 0x0c]);
        assert_eq!(page[8], 0x40);
        let a = AtomicCaps::parse(&page);
        assert!(a.standard() && a.extended());
        assert_eq!(a.qp_atomic_mode(), Some(AtomicMode::UpTo8Bytes));
        let basic = AtomicCaps {
            operations: 0x3,
            size_qp: 0x8,
            req_8b_endianness_mode: 0,
        };
        assert!(!basic.extended());
        assert_eq!(basic.qp_atomic_mode(), Some(AtomicMode::IbSpec));
        assert_eq!(AtomicCaps::default().qp_atomic_mode(), None);
    }
}
