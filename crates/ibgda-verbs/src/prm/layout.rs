//! Field tables of the firmware structures this crate builds or reads.
//!
//! Every offset is from `include/linux/mlx5/mlx5_ifc.h` in the Linux kernel (the public form of
//! the mlx5 Programmer's Reference Manual), computed by summing the `u8 name[width]` widths of
//! the named `struct mlx5_ifc_<struct>_bits`; each constant names its struct and field. Where
//! the kernel leaves a field `reserved` that rdma-core's and DPDK's copies of the same header
//! name (the DEVX doorbell-record umem ids), the comment says so.
//!
//! Structures are listed with their size in bits; the tests check that every field fits inside
//! its structure and obeys [`Field`]'s placement rules.

use super::bits::Field;

/// Command opcodes (`enum { MLX5_CMD_OP_* }` in mlx5_ifc.h).
pub mod opcode {
    /// `MLX5_CMD_OP_QUERY_HCA_CAP`.
    pub const QUERY_HCA_CAP: u16 = 0x100;
    /// `MLX5_CMD_OP_CREATE_CQ`.
    pub const CREATE_CQ: u16 = 0x400;
    /// `MLX5_CMD_OP_CREATE_QP`.
    pub const CREATE_QP: u16 = 0x500;
    /// `MLX5_CMD_OP_RST2INIT_QP`.
    pub const RST2INIT_QP: u16 = 0x502;
    /// `MLX5_CMD_OP_INIT2RTR_QP`.
    pub const INIT2RTR_QP: u16 = 0x503;
    /// `MLX5_CMD_OP_RTR2RTS_QP`.
    pub const RTR2RTS_QP: u16 = 0x504;
    /// `MLX5_CMD_OP_QUERY_QP`.
    pub const QUERY_QP: u16 = 0x50b;
}

/// The header every `*_in` command starts with (`opcode`, `uid`, `op_mod`).
pub mod cmd_in {
    use super::Field;
    /// `<cmd>_in.opcode`.
    pub const OPCODE: Field = Field::new("cmd_in.opcode", 0x00, 16);
    /// `<cmd>_in.uid` (the DEVX user context; the kernel fills it in).
    pub const UID: Field = Field::new("cmd_in.uid", 0x10, 16);
    /// `<cmd>_in.op_mod`.
    pub const OP_MOD: Field = Field::new("cmd_in.op_mod", 0x30, 16);
}

/// The header every `*_out` command output starts with.
pub mod cmd_out {
    use super::Field;
    /// `<cmd>_out.status` (0 = OK).
    pub const STATUS: Field = Field::new("cmd_out.status", 0x00, 8);
    /// `<cmd>_out.syndrome` (firmware's reason code when `status` is not OK).
    pub const SYNDROME: Field = Field::new("cmd_out.syndrome", 0x20, 32);
    /// Size of the outputs with no payload (`rst2init_qp_out` and friends): 0x80 bits.
    pub const SIZE_BYTES: usize = 0x80 / 8;
}

/// `struct mlx5_ifc_query_hca_cap_in_bits` (0x80 bits).
pub mod query_hca_cap_in {
    /// Size in bytes.
    pub const SIZE_BYTES: usize = 0x80 / 8;
    /// `op_mod` low bit: 1 = the current (negotiated) values, 0 = the maximum ones
    /// (`HCA_CAP_OPMOD_GET_CUR` / `_GET_MAX` in the kernel's device.h).
    pub const OP_MOD_CURRENT: u16 = 0x1;
    /// Capability types, shifted left by one in `op_mod` (`MLX5_SET_HCA_CAP_OP_MOD_*`).
    pub const CAP_GENERAL_DEVICE: u16 = 0x0;
    /// `MLX5_SET_HCA_CAP_OP_MOD_ATOMIC`.
    pub const CAP_ATOMIC: u16 = 0x3;
}

/// `struct mlx5_ifc_query_hca_cap_out_bits` (0x80 header bits + the 0x8000-bit capability union).
pub mod query_hca_cap_out {
    /// `query_hca_cap_out.capability` starts at bit 0x80.
    pub const CAPABILITY_BIT: u32 = 0x80;
    /// Size in bytes of the capability union (`union mlx5_ifc_hca_cap_union_bits`, 0x8000 bits).
    pub const CAPABILITY_BYTES: usize = 0x8000 / 8;
    /// Size in bytes of the whole output.
    pub const SIZE_BYTES: usize = CAPABILITY_BIT as usize / 8 + CAPABILITY_BYTES;
}

/// `struct mlx5_ifc_cmd_hca_cap_bits`: the general device capabilities we depend on.
pub mod cmd_hca_cap {
    use super::Field;
    /// `cmd_hca_cap.log_max_qp_sz`: log2 of the largest work queue, in WQEBBs.
    pub const LOG_MAX_QP_SZ: Field = Field::new("cmd_hca_cap.log_max_qp_sz", 0x88, 8);
    /// `cmd_hca_cap.log_max_qp`.
    pub const LOG_MAX_QP: Field = Field::new("cmd_hca_cap.log_max_qp", 0x9b, 5);
    /// `cmd_hca_cap.log_max_cq_sz`: log2 of the largest CQ, in CQEs.
    pub const LOG_MAX_CQ_SZ: Field = Field::new("cmd_hca_cap.log_max_cq_sz", 0xc8, 8);
    /// `cmd_hca_cap.log_max_cq`.
    pub const LOG_MAX_CQ: Field = Field::new("cmd_hca_cap.log_max_cq", 0xdb, 5);
    /// `cmd_hca_cap.log_max_ra_req_qp`: log2 of outstanding RDMA reads/atomics as requester.
    pub const LOG_MAX_RA_REQ_QP: Field = Field::new("cmd_hca_cap.log_max_ra_req_qp", 0x14a, 6);
    /// `cmd_hca_cap.log_max_ra_res_qp`: the same as responder.
    pub const LOG_MAX_RA_RES_QP: Field = Field::new("cmd_hca_cap.log_max_ra_res_qp", 0x15a, 6);
    /// `cmd_hca_cap.port_type`: 0 = InfiniBand, 1 = Ethernet (`MLX5_CAP_PORT_TYPE_*`).
    pub const PORT_TYPE: Field = Field::new("cmd_hca_cap.port_type", 0x1b6, 2);
    /// `cmd_hca_cap.num_ports`.
    pub const NUM_PORTS: Field = Field::new("cmd_hca_cap.num_ports", 0x1b8, 8);
    /// `cmd_hca_cap.log_max_msg`: log2 of the largest message.
    pub const LOG_MAX_MSG: Field = Field::new("cmd_hca_cap.log_max_msg", 0x1c3, 5);
    /// `cmd_hca_cap.cqe_version`: 0 or 1 (CQE v1 carries a user index instead of the SRQ number).
    pub const CQE_VERSION: Field = Field::new("cmd_hca_cap.cqe_version", 0x1fc, 4);
    /// `cmd_hca_cap.roce`.
    pub const ROCE: Field = Field::new("cmd_hca_cap.roce", 0x21d, 1);
    /// `cmd_hca_cap.atomic`: the ATOMIC capability page is valid.
    pub const ATOMIC: Field = Field::new("cmd_hca_cap.atomic", 0x21e, 1);
    /// `cmd_hca_cap.cq_oi`: CQs may be created with overrun ignore.
    pub const CQ_OI: Field = Field::new("cmd_hca_cap.cq_oi", 0x220, 1);
    /// `cmd_hca_cap.rc`.
    pub const RC: Field = Field::new("cmd_hca_cap.rc", 0x23f, 1);
    /// `cmd_hca_cap.uar_4k`: UAR pages are 4 KiB.
    pub const UAR_4K: Field = Field::new("cmd_hca_cap.uar_4k", 0x240, 1);
    /// `cmd_hca_cap.umem_uid_0`: umem may be created with uid 0.
    pub const UMEM_UID_0: Field = Field::new("cmd_hca_cap.umem_uid_0", 0x252, 1);
    /// `cmd_hca_cap.log_pg_sz`: log2 of the smallest page the HCA supports.
    pub const LOG_PG_SZ: Field = Field::new("cmd_hca_cap.log_pg_sz", 0x258, 8);
    /// `cmd_hca_cap.bf`: BlueFlame is supported.
    pub const BF: Field = Field::new("cmd_hca_cap.bf", 0x260, 1);
    /// `cmd_hca_cap.log_bf_reg_size`: log2 of a BlueFlame register (the doorbell at UAR+0x800).
    pub const LOG_BF_REG_SIZE: Field = Field::new("cmd_hca_cap.log_bf_reg_size", 0x26b, 5);
    /// `cmd_hca_cap.log_max_pd`.
    pub const LOG_MAX_PD: Field = Field::new("cmd_hca_cap.log_max_pd", 0x32b, 5);
    /// `cmd_hca_cap.sq_ts_format`: 0 free-running only, 1 real-time only, 2 both.
    pub const SQ_TS_FORMAT: Field = Field::new("cmd_hca_cap.sq_ts_format", 0x440, 2);
    /// `cmd_hca_cap.rq_ts_format`: as `sq_ts_format`, for receive queues.
    pub const RQ_TS_FORMAT: Field = Field::new("cmd_hca_cap.rq_ts_format", 0x442, 2);
    /// `cmd_hca_cap.log_max_umem`.
    pub const LOG_MAX_UMEM: Field = Field::new("cmd_hca_cap.log_max_umem", 0x46b, 5);
    /// `cmd_hca_cap.log_uar_page_sz`.
    pub const LOG_UAR_PAGE_SZ: Field = Field::new("cmd_hca_cap.log_uar_page_sz", 0x490, 16);

    /// Every field above (for the placement test and for dumps).
    pub const ALL: &[Field] = &[
        LOG_MAX_QP_SZ,
        LOG_MAX_QP,
        LOG_MAX_CQ_SZ,
        LOG_MAX_CQ,
        LOG_MAX_RA_REQ_QP,
        LOG_MAX_RA_RES_QP,
        PORT_TYPE,
        NUM_PORTS,
        LOG_MAX_MSG,
        CQE_VERSION,
        ROCE,
        ATOMIC,
        CQ_OI,
        RC,
        UAR_4K,
        UMEM_UID_0,
        LOG_PG_SZ,
        BF,
        LOG_BF_REG_SIZE,
        LOG_MAX_PD,
        SQ_TS_FORMAT,
        RQ_TS_FORMAT,
        LOG_MAX_UMEM,
        LOG_UAR_PAGE_SZ,
    ];
}

/// `struct mlx5_ifc_atomic_caps_bits` (the ATOMIC capability page).
pub mod atomic_caps {
    use super::Field;
    /// `atomic_caps.atomic_req_8B_endianness_mode`: 0 = big-endian (IB spec), 1 = host order.
    pub const ATOMIC_REQ_8B_ENDIANNESS_MODE: Field =
        Field::new("atomic_caps.atomic_req_8B_endianness_mode", 0x40, 2);
    /// `atomic_caps.atomic_operations`: `MLX5_ATOMIC_OPS_*` bits.
    pub const ATOMIC_OPERATIONS: Field = Field::new("atomic_caps.atomic_operations", 0x90, 16);
    /// `atomic_caps.atomic_size_qp`: supported operand sizes on RC QPs, one bit per size.
    pub const ATOMIC_SIZE_QP: Field = Field::new("atomic_caps.atomic_size_qp", 0xb0, 16);

    /// `MLX5_ATOMIC_OPS_CMP_SWAP`.
    pub const OPS_CMP_SWAP: u16 = 1 << 0;
    /// `MLX5_ATOMIC_OPS_FETCH_ADD`.
    pub const OPS_FETCH_ADD: u16 = 1 << 1;
    /// `MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP` (masked compare-and-swap).
    pub const OPS_EXTENDED_CMP_SWAP: u16 = 1 << 2;
    /// `MLX5_ATOMIC_OPS_EXTENDED_FETCH_ADD` (masked fetch-and-add).
    pub const OPS_EXTENDED_FETCH_ADD: u16 = 1 << 3;
    /// `MLX5_ATOMIC_CAPS_ATOMIC_SIZE_QP_8_BYTES`.
    pub const SIZE_QP_8_BYTES: u16 = 0x8;

    /// Every field above.
    pub const ALL: &[Field] = &[
        ATOMIC_REQ_8B_ENDIANNESS_MODE,
        ATOMIC_OPERATIONS,
        ATOMIC_SIZE_QP,
    ];
}

/// `struct mlx5_ifc_cqc_bits`, the CQ context (0x200 bits).
pub mod cqc {
    use super::Field;
    /// Size in bits.
    pub const SIZE_BITS: u32 = 0x200;
    /// `cqc.dbr_umem_valid`: `dbr_addr` is an offset into the umem `dbr_umem_id`.
    pub const DBR_UMEM_VALID: Field = Field::new("cqc.dbr_umem_valid", 0x06, 1);
    /// `cqc.cqe_sz`: 0 = 64-byte CQEs, 1 = 128-byte (`MLX5_CQE_SIZE_*`).
    pub const CQE_SZ: Field = Field::new("cqc.cqe_sz", 0x08, 3);
    /// `cqc.cc`: collapsed CQ, every CQE is written to entry 0.
    pub const CC: Field = Field::new("cqc.cc", 0x0b, 1);
    /// `cqc.oi`: overrun ignore, the CQ never enters error for lack of free entries.
    pub const OI: Field = Field::new("cqc.oi", 0x0e, 1);
    /// `cqc.cqe_comp_en`: CQE compression (left off: the GPU parses plain CQEs).
    pub const CQE_COMP_EN: Field = Field::new("cqc.cqe_comp_en", 0x11, 1);
    /// `cqc.dbr_umem_id`: bits 0x20..0x40, reserved in the kernel's copy, named `dbr_umem_id` in
    /// rdma-core's and DPDK's `mlx5_ifc_cqc_bits` (DEVX only).
    pub const DBR_UMEM_ID: Field = Field::new("cqc.dbr_umem_id", 0x20, 32);
    /// `cqc.page_offset`.
    pub const PAGE_OFFSET: Field = Field::new("cqc.page_offset", 0x54, 6);
    /// `cqc.log_cq_size`: log2 of the number of CQEs.
    pub const LOG_CQ_SIZE: Field = Field::new("cqc.log_cq_size", 0x63, 5);
    /// `cqc.uar_page`: the UAR page whose doorbells arm this CQ.
    pub const UAR_PAGE: Field = Field::new("cqc.uar_page", 0x68, 24);
    /// `cqc.cq_period` (moderation, unused).
    pub const CQ_PERIOD: Field = Field::new("cqc.cq_period", 0x84, 12);
    /// `cqc.cq_max_count` (moderation, unused).
    pub const CQ_MAX_COUNT: Field = Field::new("cqc.cq_max_count", 0x90, 16);
    /// `cqc.c_eqn_or_apu_element` (older headers: `c_eqn`, the low 8 bits of this dword).
    pub const C_EQN: Field = Field::new("cqc.c_eqn_or_apu_element", 0xa0, 32);
    /// `cqc.log_page_size`: log2 of the ring's page size in 4 KiB units.
    pub const LOG_PAGE_SIZE: Field = Field::new("cqc.log_page_size", 0xc3, 5);
    /// `cqc.dbr_addr`: with `dbr_umem_valid`, the offset of the doorbell record in its umem.
    pub const DBR_ADDR: Field = Field::new("cqc.dbr_addr", 0x1c0, 64);

    /// Every field above.
    pub const ALL: &[Field] = &[
        DBR_UMEM_VALID,
        CQE_SZ,
        CC,
        OI,
        CQE_COMP_EN,
        DBR_UMEM_ID,
        PAGE_OFFSET,
        LOG_CQ_SIZE,
        UAR_PAGE,
        CQ_PERIOD,
        CQ_MAX_COUNT,
        C_EQN,
        LOG_PAGE_SIZE,
        DBR_ADDR,
    ];
}

/// `struct mlx5_ifc_create_cq_in_bits` (0x880 bits before the physical-address list, which a
/// umem-backed CQ does not use).
pub mod create_cq_in {
    use super::Field;
    /// Size in bytes.
    pub const SIZE_BYTES: usize = 0x880 / 8;
    /// `create_cq_in.cq_context` starts here.
    pub const CQ_CONTEXT: u32 = 0x80;
    /// `create_cq_in.cq_umem_offset`: offset of the CQE ring in its umem.
    pub const CQ_UMEM_OFFSET: Field = Field::new("create_cq_in.cq_umem_offset", 0x280, 64);
    /// `create_cq_in.cq_umem_id`.
    pub const CQ_UMEM_ID: Field = Field::new("create_cq_in.cq_umem_id", 0x2c0, 32);
    /// `create_cq_in.cq_umem_valid`.
    pub const CQ_UMEM_VALID: Field = Field::new("create_cq_in.cq_umem_valid", 0x2e0, 1);
}

/// `struct mlx5_ifc_create_cq_out_bits` (0x80 bits).
pub mod create_cq_out {
    use super::Field;
    /// `create_cq_out.cqn`.
    pub const CQN: Field = Field::new("create_cq_out.cqn", 0x48, 24);
}

/// `struct mlx5_ifc_ads_bits`, an address path (0x160 bits).
pub mod ads {
    use super::Field;
    /// Size in bits.
    pub const SIZE_BITS: u32 = 0x160;
    /// `ads.pkey_index`.
    pub const PKEY_INDEX: Field = Field::new("ads.pkey_index", 0x10, 16);
    /// `ads.grh`: a global route header is sent (always on RoCE).
    pub const GRH: Field = Field::new("ads.grh", 0x28, 1);
    /// `ads.mlid` (source path bits).
    pub const MLID: Field = Field::new("ads.mlid", 0x29, 7);
    /// `ads.rlid`: the remote LID (InfiniBand).
    pub const RLID: Field = Field::new("ads.rlid", 0x30, 16);
    /// `ads.ack_timeout`: 4.096 µs × 2^ack_timeout.
    pub const ACK_TIMEOUT: Field = Field::new("ads.ack_timeout", 0x40, 5);
    /// `ads.src_addr_index`: the local GID index.
    pub const SRC_ADDR_INDEX: Field = Field::new("ads.src_addr_index", 0x48, 8);
    /// `ads.stat_rate`.
    pub const STAT_RATE: Field = Field::new("ads.stat_rate", 0x54, 4);
    /// `ads.hop_limit`.
    pub const HOP_LIMIT: Field = Field::new("ads.hop_limit", 0x58, 8);
    /// `ads.tclass`.
    pub const TCLASS: Field = Field::new("ads.tclass", 0x64, 8);
    /// `ads.flow_label`.
    pub const FLOW_LABEL: Field = Field::new("ads.flow_label", 0x6c, 20);
    /// `ads.rgid_rip`: the remote GID (16 bytes, network order).
    pub const RGID_RIP: Field = Field::new("ads.rgid_rip", 0x80, 128);
    /// `ads.udp_sport`: RoCE v2 UDP source port (ECMP entropy).
    pub const UDP_SPORT: Field = Field::new("ads.udp_sport", 0x110, 16);
    /// `ads.sl`: service level (InfiniBand).
    pub const SL: Field = Field::new("ads.sl", 0x124, 4);
    /// `ads.vhca_port_num`: the local port, 1-based.
    pub const VHCA_PORT_NUM: Field = Field::new("ads.vhca_port_num", 0x128, 8);
    /// `ads.rmac_47_32`: the remote MAC's first two bytes (RoCE).
    pub const RMAC_47_32: Field = Field::new("ads.rmac_47_32", 0x130, 16);
    /// `ads.rmac_31_0`: the remote MAC's last four bytes.
    pub const RMAC_31_0: Field = Field::new("ads.rmac_31_0", 0x140, 32);

    /// Every field above.
    pub const ALL: &[Field] = &[
        PKEY_INDEX,
        GRH,
        MLID,
        RLID,
        ACK_TIMEOUT,
        SRC_ADDR_INDEX,
        STAT_RATE,
        HOP_LIMIT,
        TCLASS,
        FLOW_LABEL,
        RGID_RIP,
        UDP_SPORT,
        SL,
        VHCA_PORT_NUM,
        RMAC_47_32,
        RMAC_31_0,
    ];
}

/// `struct mlx5_ifc_qpc_bits`, the QP context (0x740 bits).
pub mod qpc {
    use super::Field;
    /// Size in bits.
    pub const SIZE_BITS: u32 = 0x740;
    /// `qpc.st`: service type (`MLX5_QPC_ST_RC` = 0).
    pub const ST: Field = Field::new("qpc.st", 0x08, 8);
    /// `qpc.state` (`enum mlx5_qp_state`; what `QUERY_QP` reports).
    pub const STATE: Field = Field::new("qpc.state", 0x00, 4);
    /// `qpc.pm_state`: path migration state (`MLX5_QPC_PM_STATE_MIGRATED` = 3).
    pub const PM_STATE: Field = Field::new("qpc.pm_state", 0x13, 2);
    /// `qpc.pd`: the protection domain number.
    pub const PD: Field = Field::new("qpc.pd", 0x28, 24);
    /// `qpc.mtu` (`MLX5_QPC_MTU_*`: 1 = 256 B … 5 = 4 KiB).
    pub const MTU: Field = Field::new("qpc.mtu", 0x40, 3);
    /// `qpc.log_msg_max`.
    pub const LOG_MSG_MAX: Field = Field::new("qpc.log_msg_max", 0x43, 5);
    /// `qpc.log_rq_size`: log2 of receive WQEs.
    pub const LOG_RQ_SIZE: Field = Field::new("qpc.log_rq_size", 0x49, 4);
    /// `qpc.log_rq_stride`: log2 of the receive WQE size in 16-byte units.
    pub const LOG_RQ_STRIDE: Field = Field::new("qpc.log_rq_stride", 0x4d, 3);
    /// `qpc.no_sq`: the QP has no send queue.
    pub const NO_SQ: Field = Field::new("qpc.no_sq", 0x50, 1);
    /// `qpc.log_sq_size`: log2 of the send queue in WQEBBs.
    pub const LOG_SQ_SIZE: Field = Field::new("qpc.log_sq_size", 0x51, 4);
    /// `qpc.ts_format` (`MLX5_TIMESTAMP_FORMAT_*`: 0 free-running, 1 default, 2 real-time).
    pub const TS_FORMAT: Field = Field::new("qpc.ts_format", 0x58, 2);
    /// `qpc.uar_page`: the UAR page of this QP's doorbell.
    pub const UAR_PAGE: Field = Field::new("qpc.uar_page", 0x68, 24);
    /// `qpc.user_index` (reported in CQE v1).
    pub const USER_INDEX: Field = Field::new("qpc.user_index", 0x88, 24);
    /// `qpc.log_page_size`: log2 of the ring's page size in 4 KiB units.
    pub const LOG_PAGE_SIZE: Field = Field::new("qpc.log_page_size", 0xa3, 5);
    /// `qpc.remote_qpn`.
    pub const REMOTE_QPN: Field = Field::new("qpc.remote_qpn", 0xa8, 24);
    /// `qpc.primary_address_path` starts here (a `struct mlx5_ifc_ads_bits`).
    pub const PRIMARY_ADDRESS_PATH: u32 = 0xc0;
    /// `qpc.log_sra_max`: log2 of outstanding RDMA reads/atomics as requester.
    pub const LOG_SRA_MAX: Field = Field::new("qpc.log_sra_max", 0x388, 3);
    /// `qpc.retry_count`.
    pub const RETRY_COUNT: Field = Field::new("qpc.retry_count", 0x38d, 3);
    /// `qpc.rnr_retry`.
    pub const RNR_RETRY: Field = Field::new("qpc.rnr_retry", 0x390, 3);
    /// `qpc.next_send_psn`.
    pub const NEXT_SEND_PSN: Field = Field::new("qpc.next_send_psn", 0x3c8, 24);
    /// `qpc.cqn_snd`: the send CQ.
    pub const CQN_SND: Field = Field::new("qpc.cqn_snd", 0x3e8, 24);
    /// `qpc.log_rra_max`: log2 of outstanding RDMA reads/atomics as responder.
    pub const LOG_RRA_MAX: Field = Field::new("qpc.log_rra_max", 0x488, 3);
    /// `qpc.atomic_mode` (`MLX5_QPC_ATOMIC_MODE_*`).
    pub const ATOMIC_MODE: Field = Field::new("qpc.atomic_mode", 0x48c, 4);
    /// `qpc.rre`: remote read enable.
    pub const RRE: Field = Field::new("qpc.rre", 0x490, 1);
    /// `qpc.rwe`: remote write enable.
    pub const RWE: Field = Field::new("qpc.rwe", 0x491, 1);
    /// `qpc.rae`: remote atomic enable.
    pub const RAE: Field = Field::new("qpc.rae", 0x492, 1);
    /// `qpc.page_offset`.
    pub const PAGE_OFFSET: Field = Field::new("qpc.page_offset", 0x494, 6);
    /// `qpc.min_rnr_nak`.
    pub const MIN_RNR_NAK: Field = Field::new("qpc.min_rnr_nak", 0x4a3, 5);
    /// `qpc.next_rcv_psn`.
    pub const NEXT_RCV_PSN: Field = Field::new("qpc.next_rcv_psn", 0x4a8, 24);
    /// `qpc.cqn_rcv`: the receive CQ.
    pub const CQN_RCV: Field = Field::new("qpc.cqn_rcv", 0x4e8, 24);
    /// `qpc.dbr_addr`: with `dbr_umem_valid`, the doorbell record's offset in its umem.
    pub const DBR_ADDR: Field = Field::new("qpc.dbr_addr", 0x500, 64);
    /// `qpc.rq_type` (0 regular, 3 = `MLX5_ZERO_LEN_RQ`).
    pub const RQ_TYPE: Field = Field::new("qpc.rq_type", 0x565, 3);
    /// `qpc.hw_sq_wqebb_counter`: the send WQEBBs the NIC has consumed (16 bits).
    pub const HW_SQ_WQEBB_COUNTER: Field = Field::new("qpc.hw_sq_wqebb_counter", 0x5a0, 16);
    /// `qpc.dbr_umem_valid`.
    pub const DBR_UMEM_VALID: Field = Field::new("qpc.dbr_umem_valid", 0x683, 1);
    /// `qpc.dbr_umem_id`: bits 0x720..0x740, inside the kernel's `reserved_at_684`, named
    /// `dbr_umem_id` in rdma-core's and DPDK's `mlx5_ifc_qpc_bits` (DEVX only).
    pub const DBR_UMEM_ID: Field = Field::new("qpc.dbr_umem_id", 0x720, 32);

    /// Every field above.
    pub const ALL: &[Field] = &[
        STATE,
        ST,
        PM_STATE,
        PD,
        MTU,
        LOG_MSG_MAX,
        LOG_RQ_SIZE,
        LOG_RQ_STRIDE,
        NO_SQ,
        LOG_SQ_SIZE,
        TS_FORMAT,
        UAR_PAGE,
        USER_INDEX,
        LOG_PAGE_SIZE,
        REMOTE_QPN,
        LOG_SRA_MAX,
        RETRY_COUNT,
        RNR_RETRY,
        NEXT_SEND_PSN,
        CQN_SND,
        LOG_RRA_MAX,
        ATOMIC_MODE,
        RRE,
        RWE,
        RAE,
        PAGE_OFFSET,
        MIN_RNR_NAK,
        NEXT_RCV_PSN,
        CQN_RCV,
        DBR_ADDR,
        RQ_TYPE,
        HW_SQ_WQEBB_COUNTER,
        DBR_UMEM_VALID,
        DBR_UMEM_ID,
    ];
}

/// `struct mlx5_ifc_create_qp_in_bits` (0x880 bits before the physical-address list).
pub mod create_qp_in {
    use super::Field;
    /// Size in bytes.
    pub const SIZE_BYTES: usize = 0x880 / 8;
    /// `create_qp_in.opt_param_mask`.
    pub const OPT_PARAM_MASK: Field = Field::new("create_qp_in.opt_param_mask", 0x80, 32);
    /// `create_qp_in.qpc` starts here.
    pub const QPC: u32 = 0xc0;
    /// `create_qp_in.wq_umem_offset`: offset of the work queue (RQ then SQ) in its umem.
    pub const WQ_UMEM_OFFSET: Field = Field::new("create_qp_in.wq_umem_offset", 0x800, 64);
    /// `create_qp_in.wq_umem_id`.
    pub const WQ_UMEM_ID: Field = Field::new("create_qp_in.wq_umem_id", 0x840, 32);
    /// `create_qp_in.wq_umem_valid`.
    pub const WQ_UMEM_VALID: Field = Field::new("create_qp_in.wq_umem_valid", 0x860, 1);
}

/// `struct mlx5_ifc_create_qp_out_bits` (0x80 bits).
pub mod create_qp_out {
    use super::Field;
    /// `create_qp_out.qpn`.
    pub const QPN: Field = Field::new("create_qp_out.qpn", 0x48, 24);
}

/// `struct mlx5_ifc_rst2init_qp_in_bits`; `init2rtr_qp_in` and `rtr2rts_qp_in` share the layout
/// (0x880 bits).
pub mod modify_qp_in {
    use super::Field;
    /// Size in bytes.
    pub const SIZE_BYTES: usize = 0x880 / 8;
    /// `<transition>_qp_in.qpn`.
    pub const QPN: Field = Field::new("modify_qp_in.qpn", 0x48, 24);
    /// `<transition>_qp_in.opt_param_mask`.
    pub const OPT_PARAM_MASK: Field = Field::new("modify_qp_in.opt_param_mask", 0x80, 32);
    /// `<transition>_qp_in.ece`.
    pub const ECE: Field = Field::new("modify_qp_in.ece", 0xa0, 32);
    /// `<transition>_qp_in.qpc` starts here.
    pub const QPC: u32 = 0xc0;
}

/// `struct mlx5_ifc_query_qp_in_bits` (0x80 bits) and `query_qp_out_bits`.
pub mod query_qp {
    use super::Field;
    /// Size of the input in bytes.
    pub const IN_BYTES: usize = 0x80 / 8;
    /// `query_qp_in.qpn`.
    pub const QPN: Field = Field::new("query_qp_in.qpn", 0x48, 24);
    /// `query_qp_out.qpc` starts here.
    pub const QPC: u32 = 0xc0;
    /// Size of the output in bytes (through the reserved dwords after the `qpc`; no
    /// physical-address list with a umem).
    pub const OUT_BYTES: usize = 0x880 / 8;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(table: &[Field], size_bits: u32) {
        for f in table {
            assert!(f.is_well_placed(), "{} badly placed", f.name);
            assert!(
                f.end() <= size_bits,
                "{} past the end of its structure",
                f.name
            );
        }
        // No two fields overlap.
        for (i, a) in table.iter().enumerate() {
            for b in &table[i + 1..] {
                assert!(
                    a.end() <= b.bit || b.end() <= a.bit,
                    "{} overlaps {}",
                    a.name,
                    b.name
                );
            }
        }
    }

    #[test]
    fn every_table_fits_its_structure() {
        check(cmd_hca_cap::ALL, 0x8000);
        check(atomic_caps::ALL, 0x8000);
        check(cqc::ALL, cqc::SIZE_BITS);
        check(ads::ALL, ads::SIZE_BITS);
        check(qpc::ALL, qpc::SIZE_BITS);
        // The two address paths end where log_ack_req_freq (bit 0x380) begins.
        assert_eq!(qpc::PRIMARY_ADDRESS_PATH + 2 * ads::SIZE_BITS, 0x380);
        // The contexts end where the commands' trailing fields begin.
        assert_eq!(
            create_cq_in::CQ_CONTEXT + cqc::SIZE_BITS,
            create_cq_in::CQ_UMEM_OFFSET.bit
        );
        assert_eq!(
            create_qp_in::QPC + qpc::SIZE_BITS,
            create_qp_in::WQ_UMEM_OFFSET.bit
        );
        assert_eq!(modify_qp_in::QPC + qpc::SIZE_BITS, 0x800);
        assert!(create_qp_in::WQ_UMEM_VALID.end() as usize <= create_qp_in::SIZE_BYTES * 8);
        assert!(create_cq_in::CQ_UMEM_VALID.end() as usize <= create_cq_in::SIZE_BYTES * 8);
    }
}
