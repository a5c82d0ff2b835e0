//! The PRM structures the emulated firmware reads and writes, as field tables.
//!
//! Every offset comes from the public bit layouts of `mlx5_ifc.h` (Linux
//! `include/linux/mlx5/mlx5_ifc.h`; the DEVX umem fields the kernel leaves reserved,
//! `qpc.dbr_umem_id` and `cqc.dbr_umem_id`, from rdma-core's and DPDK's copies): the offset of a
//! field is the sum of the `u8 name[width]` widths before it, and the `reserved_at_<hex>` names
//! confirm the running sum at every reserved gap. The tests of this crate check images built
//! by hand against these tables; they share nothing with `ibgda-verbs::prm`.

use super::bits::Bits;

/// Command opcodes (`MLX5_CMD_OP_*`).
pub(crate) mod opcode {
    pub const QUERY_HCA_CAP: u16 = 0x100;
    pub const CREATE_CQ: u16 = 0x400;
    pub const DESTROY_CQ: u16 = 0x401;
    pub const QUERY_CQ: u16 = 0x402;
    pub const CREATE_QP: u16 = 0x500;
    pub const DESTROY_QP: u16 = 0x501;
    pub const RST2INIT_QP: u16 = 0x502;
    pub const INIT2RTR_QP: u16 = 0x503;
    pub const RTR2RTS_QP: u16 = 0x504;
    pub const QP_2ERR: u16 = 0x507;
    pub const QP_2RST: u16 = 0x50a;
    pub const QUERY_QP: u16 = 0x50b;

    /// The command's name, for messages.
    pub fn name(op: u16) -> &'static str {
        match op {
            QUERY_HCA_CAP => "QUERY_HCA_CAP",
            CREATE_CQ => "CREATE_CQ",
            DESTROY_CQ => "DESTROY_CQ",
            QUERY_CQ => "QUERY_CQ",
            CREATE_QP => "CREATE_QP",
            DESTROY_QP => "DESTROY_QP",
            RST2INIT_QP => "RST2INIT_QP",
            INIT2RTR_QP => "INIT2RTR_QP",
            RTR2RTS_QP => "RTR2RTS_QP",
            QP_2ERR => "2ERR_QP",
            QP_2RST => "2RST_QP",
            QUERY_QP => "QUERY_QP",
            _ => "unknown command",
        }
    }
}

/// The header of every `*_in` command.
pub(crate) mod cmd_in {
    use super::Bits;
    pub const OPCODE: Bits = Bits::new("opcode", 0x00, 16);
    pub const OP_MOD: Bits = Bits::new("op_mod", 0x30, 16);
    /// The object number that object commands (`QUERY_QP`, the QP transitions) start with.
    pub const OBJ_NUM: Bits = Bits::new("qpn/cqn", 0x48, 24);
    /// Bytes of a command with nothing past the header and the object number.
    pub const SHORT_BYTES: usize = 0x80 / 8;
}

/// The header of every `*_out` output.
pub(crate) mod cmd_out {
    use super::Bits;
    pub const STATUS: Bits = Bits::new("status", 0x00, 8);
    pub const SYNDROME: Bits = Bits::new("syndrome", 0x20, 32);
    /// The object number that create outputs carry (`create_cq_out.cqn`, `create_qp_out.qpn`).
    pub const OBJ_NUM: Bits = Bits::new("cqn/qpn", 0x48, 24);
    /// Bytes of an output that carries nothing else.
    pub const BYTES: usize = 0x80 / 8;
}

/// `mlx5_ifc_cqc_bits` (0x200 bits).
pub(crate) mod cqc {
    use super::Bits;
    pub const DBR_UMEM_VALID: Bits = Bits::new("cqc.dbr_umem_valid", 0x06, 1);
    pub const CQE_SZ: Bits = Bits::new("cqc.cqe_sz", 0x08, 3);
    pub const CC: Bits = Bits::new("cqc.cc", 0x0b, 1);
    pub const OI: Bits = Bits::new("cqc.oi", 0x0e, 1);
    pub const DBR_UMEM_ID: Bits = Bits::new("cqc.dbr_umem_id", 0x20, 32);
    pub const PAGE_OFFSET: Bits = Bits::new("cqc.page_offset", 0x54, 6);
    pub const LOG_CQ_SIZE: Bits = Bits::new("cqc.log_cq_size", 0x63, 5);
    pub const UAR_PAGE: Bits = Bits::new("cqc.uar_page", 0x68, 24);
    /// `c_eqn` in the low 8 bits; newer layouts widen it to the whole dword
    /// (`c_eqn_or_apu_element`), which reads the same for small EQ numbers.
    pub const C_EQN: Bits = Bits::new("cqc.c_eqn", 0xa0, 32);
    pub const LOG_PAGE_SIZE: Bits = Bits::new("cqc.log_page_size", 0xc3, 5);
    pub const DBR_ADDR: Bits = Bits::new("cqc.dbr_addr", 0x1c0, 64);
}

/// `mlx5_ifc_create_cq_in_bits` and `_out_bits`.
pub(crate) mod create_cq {
    use super::Bits;
    pub const CQ_CONTEXT: u32 = 0x80;
    pub const CQ_UMEM_OFFSET: Bits = Bits::new("create_cq_in.cq_umem_offset", 0x280, 64);
    pub const CQ_UMEM_ID: Bits = Bits::new("create_cq_in.cq_umem_id", 0x2c0, 32);
    pub const CQ_UMEM_VALID: Bits = Bits::new("create_cq_in.cq_umem_valid", 0x2e0, 1);
    /// The input up to and including `cq_umem_valid` (the PAS list after it is unused with a
    /// umem).
    pub const IN_MIN_BYTES: usize = 0x300 / 8;
}

/// `mlx5_ifc_query_cq_out_bits`.
pub(crate) mod query_cq {
    pub const CQ_CONTEXT: u32 = 0x80;
    pub const OUT_BYTES: usize = (0x80 + 0x200) / 8;
}

/// `mlx5_ifc_ads_bits` (an address path, 0x160 bits).
pub(crate) mod ads {
    use super::Bits;
    pub const PKEY_INDEX: Bits = Bits::new("ads.pkey_index", 0x10, 16);
    pub const GRH: Bits = Bits::new("ads.grh", 0x28, 1);
    pub const RLID: Bits = Bits::new("ads.rlid", 0x30, 16);
    pub const ACK_TIMEOUT: Bits = Bits::new("ads.ack_timeout", 0x40, 5);
    /// `rgid_rip[16][0x8]`: byte-aligned, read with `bits::bytes`.
    pub const RGID_RIP_AT: u32 = 0x80;
    pub const VHCA_PORT_NUM: Bits = Bits::new("ads.vhca_port_num", 0x128, 8);
}

/// `mlx5_ifc_qpc_bits` (0x740 bits).
pub(crate) mod qpc {
    use super::Bits;
    pub const STATE: Bits = Bits::new("qpc.state", 0x00, 4);
    pub const ST: Bits = Bits::new("qpc.st", 0x08, 8);
    pub const PD: Bits = Bits::new("qpc.pd", 0x28, 24);
    pub const MTU: Bits = Bits::new("qpc.mtu", 0x40, 3);
    pub const LOG_MSG_MAX: Bits = Bits::new("qpc.log_msg_max", 0x43, 5);
    pub const LOG_RQ_SIZE: Bits = Bits::new("qpc.log_rq_size", 0x49, 4);
    pub const LOG_RQ_STRIDE: Bits = Bits::new("qpc.log_rq_stride", 0x4d, 3);
    pub const NO_SQ: Bits = Bits::new("qpc.no_sq", 0x50, 1);
    pub const LOG_SQ_SIZE: Bits = Bits::new("qpc.log_sq_size", 0x51, 4);
    pub const TS_FORMAT: Bits = Bits::new("qpc.ts_format", 0x58, 2);
    pub const UAR_PAGE: Bits = Bits::new("qpc.uar_page", 0x68, 24);
    pub const USER_INDEX: Bits = Bits::new("qpc.user_index", 0x88, 24);
    pub const LOG_PAGE_SIZE: Bits = Bits::new("qpc.log_page_size", 0xa3, 5);
    pub const REMOTE_QPN: Bits = Bits::new("qpc.remote_qpn", 0xa8, 24);
    pub const PRIMARY_ADDRESS_PATH: u32 = 0xc0;
    pub const LOG_SRA_MAX: Bits = Bits::new("qpc.log_sra_max", 0x388, 3);
    pub const RETRY_COUNT: Bits = Bits::new("qpc.retry_count", 0x38d, 3);
    pub const RNR_RETRY: Bits = Bits::new("qpc.rnr_retry", 0x390, 3);
    pub const NEXT_SEND_PSN: Bits = Bits::new("qpc.next_send_psn", 0x3c8, 24);
    pub const CQN_SND: Bits = Bits::new("qpc.cqn_snd", 0x3e8, 24);
    pub const LOG_RRA_MAX: Bits = Bits::new("qpc.log_rra_max", 0x488, 3);
    pub const ATOMIC_MODE: Bits = Bits::new("qpc.atomic_mode", 0x48c, 4);
    pub const RRE: Bits = Bits::new("qpc.rre", 0x490, 1);
    pub const RWE: Bits = Bits::new("qpc.rwe", 0x491, 1);
    pub const RAE: Bits = Bits::new("qpc.rae", 0x492, 1);
    pub const PAGE_OFFSET: Bits = Bits::new("qpc.page_offset", 0x494, 6);
    pub const MIN_RNR_NAK: Bits = Bits::new("qpc.min_rnr_nak", 0x4a3, 5);
    pub const NEXT_RCV_PSN: Bits = Bits::new("qpc.next_rcv_psn", 0x4a8, 24);
    pub const CQN_RCV: Bits = Bits::new("qpc.cqn_rcv", 0x4e8, 24);
    pub const DBR_ADDR: Bits = Bits::new("qpc.dbr_addr", 0x500, 64);
    pub const RQ_TYPE: Bits = Bits::new("qpc.rq_type", 0x565, 3);
    pub const HW_SQ_WQEBB_COUNTER: Bits = Bits::new("qpc.hw_sq_wqebb_counter", 0x5a0, 16);
    pub const DBR_UMEM_VALID: Bits = Bits::new("qpc.dbr_umem_valid", 0x683, 1);
    pub const DBR_UMEM_ID: Bits = Bits::new("qpc.dbr_umem_id", 0x720, 32);

    /// `qpc.st`: reliable connection.
    pub const ST_RC: u64 = 0x0;
    /// `qpc.rq_type`: a receive queue of its own.
    pub const RQ_REGULAR: u64 = 0x0;
    /// `qpc.rq_type`: no receive queue.
    pub const RQ_ZERO_LEN: u64 = 0x3;
}

/// `mlx5_ifc_create_qp_in_bits`; the QP transitions (`rst2init_qp_in` and friends) and
/// `query_qp_out` put their `qpc` at the same offset.
pub(crate) mod qp_cmd {
    use super::Bits;
    pub const QPC: u32 = 0xc0;
    pub const WQ_UMEM_OFFSET: Bits = Bits::new("create_qp_in.wq_umem_offset", 0x800, 64);
    pub const WQ_UMEM_ID: Bits = Bits::new("create_qp_in.wq_umem_id", 0x840, 32);
    pub const WQ_UMEM_VALID: Bits = Bits::new("create_qp_in.wq_umem_valid", 0x860, 1);
    /// `create_qp_in` through `wq_umem_valid`'s dword.
    pub const CREATE_IN_MIN_BYTES: usize = 0x880 / 8;
    /// A transition's input through its `qpc`.
    pub const MODIFY_IN_MIN_BYTES: usize = 0x800 / 8;
    /// `query_qp_out` through its `qpc`.
    pub const QUERY_OUT_BYTES: usize = 0x800 / 8;
}

/// `enum mlx5_qp_state`: `qpc.state` as `QUERY_QP` reports it.
pub(crate) mod qp_state {
    pub const RST: u64 = 0;
    pub const INIT: u64 = 1;
    pub const RTR: u64 = 2;
    pub const RTS: u64 = 3;
    pub const ERR: u64 = 6;
}

/// `mlx5_ifc_query_hca_cap_in_bits` / `_out_bits`.
pub(crate) mod query_hca_cap {
    /// `op_mod` = capability type << 1 | 1 for the current values.
    pub const TYPE_GENERAL: u16 = 0x0;
    pub const TYPE_ATOMIC: u16 = 0x3;
    pub const CAPABILITY: u32 = 0x80;
    pub const OUT_BYTES: usize = (0x80 + 0x8000) / 8;
}

/// `mlx5_ifc_cmd_hca_cap_bits`: the general capabilities the emulated device reports.
pub(crate) mod cmd_hca_cap {
    use super::Bits;
    pub const LOG_MAX_QP_SZ: Bits = Bits::new("log_max_qp_sz", 0x88, 8);
    pub const LOG_MAX_QP: Bits = Bits::new("log_max_qp", 0x9b, 5);
    pub const LOG_MAX_CQ_SZ: Bits = Bits::new("log_max_cq_sz", 0xc8, 8);
    pub const LOG_MAX_CQ: Bits = Bits::new("log_max_cq", 0xdb, 5);
    pub const LOG_MAX_RA_REQ_QP: Bits = Bits::new("log_max_ra_req_qp", 0x14a, 6);
    pub const LOG_MAX_RA_RES_QP: Bits = Bits::new("log_max_ra_res_qp", 0x15a, 6);
    pub const PORT_TYPE: Bits = Bits::new("port_type", 0x1b6, 2);
    pub const NUM_PORTS: Bits = Bits::new("num_ports", 0x1b8, 8);
    pub const LOG_MAX_MSG: Bits = Bits::new("log_max_msg", 0x1c3, 5);
    pub const CQE_VERSION: Bits = Bits::new("cqe_version", 0x1fc, 4);
    pub const ATOMIC: Bits = Bits::new("atomic", 0x21e, 1);
    pub const CQ_OI: Bits = Bits::new("cq_oi", 0x220, 1);
    pub const RC: Bits = Bits::new("rc", 0x23f, 1);
    pub const UAR_4K: Bits = Bits::new("uar_4k", 0x240, 1);
    pub const UMEM_UID_0: Bits = Bits::new("umem_uid_0", 0x252, 1);
    pub const LOG_PG_SZ: Bits = Bits::new("log_pg_sz", 0x258, 8);
    pub const BF: Bits = Bits::new("bf", 0x260, 1);
    pub const LOG_BF_REG_SIZE: Bits = Bits::new("log_bf_reg_size", 0x26b, 5);
    pub const LOG_MAX_PD: Bits = Bits::new("log_max_pd", 0x32b, 5);
    pub const SQ_TS_FORMAT: Bits = Bits::new("sq_ts_format", 0x440, 2);
    pub const RQ_TS_FORMAT: Bits = Bits::new("rq_ts_format", 0x442, 2);
    pub const LOG_MAX_UMEM: Bits = Bits::new("log_max_umem", 0x46b, 5);
    pub const LOG_UAR_PAGE_SZ: Bits = Bits::new("log_uar_page_sz", 0x490, 16);
}

/// `mlx5_ifc_atomic_caps_bits`.
pub(crate) mod atomic_caps {
    use super::Bits;
    pub const REQ_8B_ENDIANNESS_MODE: Bits = Bits::new("atomic_req_8B_endianness_mode", 0x40, 2);
    pub const OPERATIONS: Bits = Bits::new("atomic_operations", 0x90, 16);
    pub const SIZE_QP: Bits = Bits::new("atomic_size_qp", 0xb0, 16);

    /// `MLX5_ATOMIC_OPS_*`.
    pub const OPS_CMP_SWAP: u64 = 1 << 0;
    pub const OPS_FETCH_ADD: u64 = 1 << 1;
    pub const OPS_MASKED_CMP_SWAP: u64 = 1 << 2;
    pub const OPS_MASKED_FETCH_ADD: u64 = 1 << 3;
    /// `atomic_size_qp`: one bit per operand size in bytes.
    pub const SIZE_4_BYTES: u64 = 0x4;
    pub const SIZE_8_BYTES: u64 = 0x8;
}

/// `qpc.atomic_mode` (`MLX5_QPC_ATOMIC_MODE_*`).
pub(crate) mod atomic_mode {
    pub const IB_SPEC: u64 = 0x1;
    pub const ONLY_8B: u64 = 0x2;
    pub const UP_TO_8B: u64 = 0x3;
}
