//! The emulated device's capabilities: what `QUERY_HCA_CAP` reports and what the command
//! decoders hold commands to.

use super::bits::put;
use super::layout::{atomic_caps, atomic_mode, cmd_hca_cap};

/// Bytes of a capability page (`union mlx5_ifc_hca_cap_union_bits`).
pub(crate) const PAGE_BYTES: usize = 0x8000 / 8;

/// What the emulated device can do. The limits follow what the engine implements, not a
/// particular ConnectX model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmuCaps {
    /// log2 of the largest send queue in WQEBBs (the engine's 16-bit WQE counters allow 2^15).
    pub log_max_qp_sz: u8,
    /// log2 of the largest CQ.
    pub log_max_cq_sz: u8,
    /// log2 of the largest message (2 GiB).
    pub log_max_msg: u8,
    /// log2 of outstanding reads/atomics as requester.
    pub log_max_ra_req_qp: u8,
    /// log2 of outstanding reads/atomics as responder.
    pub log_max_ra_res_qp: u8,
    /// Completion vectors (EQs `EQN_BASE..EQN_BASE + n`).
    pub comp_vectors: u32,
    /// Largest port MTU code (`enum ibv_mtu`: 5 = 4096).
    pub max_mtu: u8,
}

impl Default for EmuCaps {
    fn default() -> Self {
        Self {
            log_max_qp_sz: 15,
            log_max_cq_sz: 22,
            log_max_msg: 31,
            log_max_ra_req_qp: 4,
            log_max_ra_res_qp: 4,
            comp_vectors: 4,
            max_mtu: 5,
        }
    }
}

/// The first EQ number completion vectors map to.
pub(crate) const EQN_BASE: u32 = 0x10;

impl EmuCaps {
    /// The general capability page (`cmd_hca_cap`).
    pub(crate) fn general_page(&self) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_BYTES];
        let set = |p: &mut Vec<u8>, f, v: u64| put(p, f, v);
        set(
            &mut p,
            cmd_hca_cap::LOG_MAX_QP_SZ,
            u64::from(self.log_max_qp_sz),
        );
        set(&mut p, cmd_hca_cap::LOG_MAX_QP, 16);
        set(
            &mut p,
            cmd_hca_cap::LOG_MAX_CQ_SZ,
            u64::from(self.log_max_cq_sz),
        );
        set(&mut p, cmd_hca_cap::LOG_MAX_CQ, 16);
        set(
            &mut p,
            cmd_hca_cap::LOG_MAX_RA_REQ_QP,
            u64::from(self.log_max_ra_req_qp),
        );
        set(
            &mut p,
            cmd_hca_cap::LOG_MAX_RA_RES_QP,
            u64::from(self.log_max_ra_res_qp),
        );
        // InfiniBand: QPs are addressed by LID in the emulated subnet.
        set(&mut p, cmd_hca_cap::PORT_TYPE, 0);
        set(&mut p, cmd_hca_cap::NUM_PORTS, 1);
        set(
            &mut p,
            cmd_hca_cap::LOG_MAX_MSG,
            u64::from(self.log_max_msg),
        );
        set(&mut p, cmd_hca_cap::CQE_VERSION, 1);
        set(&mut p, cmd_hca_cap::ATOMIC, 1);
        set(&mut p, cmd_hca_cap::CQ_OI, 1);
        set(&mut p, cmd_hca_cap::RC, 1);
        set(&mut p, cmd_hca_cap::UAR_4K, 1);
        set(&mut p, cmd_hca_cap::UMEM_UID_0, 1);
        set(&mut p, cmd_hca_cap::LOG_PG_SZ, 12);
        set(&mut p, cmd_hca_cap::BF, 1);
        set(&mut p, cmd_hca_cap::LOG_BF_REG_SIZE, 9);
        set(&mut p, cmd_hca_cap::LOG_MAX_PD, 16);
        // Both timestamp formats: QPs may ask for either.
        set(&mut p, cmd_hca_cap::SQ_TS_FORMAT, 2);
        set(&mut p, cmd_hca_cap::RQ_TS_FORMAT, 2);
        set(&mut p, cmd_hca_cap::LOG_MAX_UMEM, 16);
        set(&mut p, cmd_hca_cap::LOG_UAR_PAGE_SZ, 0);
        p
    }

    /// The atomic capability page: 8-byte compare-swap and fetch-add, masked forms on 4- and
    /// 8-byte operands (what the engine executes), replies in host order
    /// (`atomic_req_8B_endianness_mode` 1).
    pub(crate) fn atomic_page(&self) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_BYTES];
        put(&mut p, atomic_caps::REQ_8B_ENDIANNESS_MODE, 1);
        put(
            &mut p,
            atomic_caps::OPERATIONS,
            atomic_caps::OPS_CMP_SWAP
                | atomic_caps::OPS_FETCH_ADD
                | atomic_caps::OPS_MASKED_CMP_SWAP
                | atomic_caps::OPS_MASKED_FETCH_ADD,
        );
        put(
            &mut p,
            atomic_caps::SIZE_QP,
            atomic_caps::SIZE_4_BYTES | atomic_caps::SIZE_8_BYTES,
        );
        p
    }

    /// Whether `qpc.atomic_mode` `mode` is one the device grants (operands of at most 8 bytes).
    pub(crate) fn grants_atomic_mode(&self, mode: u64) -> bool {
        matches!(
            mode,
            atomic_mode::IB_SPEC | atomic_mode::ONLY_8B | atomic_mode::UP_TO_8B
        )
    }
}
