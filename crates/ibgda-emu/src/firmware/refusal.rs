//! What the emulated firmware answers when it refuses a command: the PRM `status`
//! (`MLX5_CMD_STAT_*`, whose meanings are public) and a `syndrome`.
//!
//! Hardware's syndromes are firmware-internal numbers; these are the emulator's own, one per
//! check, so a test (or a user reading a log) can tell which field was refused. They all start
//! with `0xE0` in the top byte so they cannot be mistaken for a ConnectX's.

/// `MLX5_CMD_STAT_*`: the command statuses the emulator uses.
pub mod status {
    /// The command completed.
    pub const OK: u8 = 0x00;
    /// Unknown or unsupported opcode (or opcode modifier).
    pub const BAD_OP: u8 = 0x02;
    /// A field holds a value the device does not accept.
    pub const BAD_PARAM: u8 = 0x03;
    /// A referenced object (CQ, PD, UAR page, umem, QP) does not exist.
    pub const BAD_RESOURCE: u8 = 0x05;
    /// The object is busy (a CQ still referenced by a QP).
    pub const RESOURCE_BUSY: u8 = 0x06;
    /// The QP is not in the state the transition leaves from.
    pub const BAD_QP_STATE: u8 = 0x10;
    /// The input mailbox is shorter than the command.
    pub const BAD_INPUT_LEN: u8 = 0x50;
    /// The output mailbox is shorter than the command's output.
    pub const BAD_OUTPUT_LEN: u8 = 0x51;
}

/// The emulator's syndromes: which check refused the command.
pub mod syndrome {
    /// The opcode is not one the emulated firmware implements.
    pub const UNKNOWN_OPCODE: u32 = 0xe000_0001;
    /// The input mailbox is too short.
    pub const SHORT_INPUT: u32 = 0xe000_0002;
    /// The output mailbox is too short.
    pub const SHORT_OUTPUT: u32 = 0xe000_0003;
    /// `QUERY_HCA_CAP` asked for a capability page the device does not have.
    pub const UNKNOWN_CAP_TYPE: u32 = 0xe000_0004;
    /// A modify or query named another object than the one it was sent to.
    pub const WRONG_OBJECT: u32 = 0xe000_0005;

    /// `cqc.log_cq_size` above `log_max_cq_sz`.
    pub const CQ_TOO_LARGE: u32 = 0xe000_0101;
    /// `cqc.cqe_sz` other than 64 bytes.
    pub const CQE_SIZE: u32 = 0xe000_0102;
    /// `cqc.c_eqn` names no EQ.
    pub const NO_SUCH_EQ: u32 = 0xe000_0103;
    /// `uar_page` names no allocated UAR.
    pub const NO_SUCH_UAR: u32 = 0xe000_0104;
    /// A umem id names no registered umem.
    pub const NO_SUCH_UMEM: u32 = 0xe000_0105;
    /// A `*_umem_valid` bit is clear: the emulator reaches memory through umems only.
    pub const NOT_UMEM: u32 = 0xe000_0106;
    /// A ring or doorbell record does not fit its umem, or is misaligned.
    pub const UMEM_RANGE: u32 = 0xe000_0107;
    /// A page offset other than 0.
    pub const PAGE_OFFSET: u32 = 0xe000_0109;

    /// `qpc.cqn_snd` names no CQ.
    pub const NO_SUCH_SEND_CQ: u32 = 0xe000_0201;
    /// `qpc.cqn_rcv` names no CQ.
    pub const NO_SUCH_RECV_CQ: u32 = 0xe000_0202;
    /// `qpc.pd` names no protection domain.
    pub const NO_SUCH_PD: u32 = 0xe000_0203;
    /// `qpc.st` other than RC.
    pub const NOT_RC: u32 = 0xe000_0204;
    /// `qpc.log_sq_size` above `log_max_qp_sz`, or a QP with no send queue.
    pub const SQ_SIZE: u32 = 0xe000_0205;
    /// `qpc.rq_type` the emulator does not implement (SRQ, RMP).
    pub const RQ_TYPE: u32 = 0xe000_0206;
    /// `qpc.ts_format` the device does not support.
    pub const TS_FORMAT: u32 = 0xe000_0207;
    /// The ring CQ already serves another QP's send queue (the emulator writes one QP's
    /// completions per ring CQ; collapsed CQs may be shared).
    pub const CQ_SHARED: u32 = 0xe000_0208;
    /// The engine refused the QP's placement (see the log).
    pub const ENGINE: u32 = 0xe000_0209;

    /// `ads.vhca_port_num` names no port.
    pub const NO_SUCH_PORT: u32 = 0xe000_0301;
    /// `ads.pkey_index` outside the P_Key table.
    pub const PKEY_INDEX: u32 = 0xe000_0302;
    /// `qpc.rae` with an `atomic_mode` the device does not grant.
    pub const ATOMIC_MODE: u32 = 0xe000_0303;
    /// `qpc.mtu` not a valid MTU or above the port's.
    pub const MTU: u32 = 0xe000_0304;
    /// `qpc.log_msg_max` above `log_max_msg`.
    pub const MSG_MAX: u32 = 0xe000_0305;
    /// `qpc.log_rra_max` / `log_sra_max` above the device's limit.
    pub const RDMA_ATOMIC_DEPTH: u32 = 0xe000_0306;
    /// `ads.rlid` names no port of the emulated subnet.
    pub const NO_SUCH_LID: u32 = 0xe000_0307;
    /// `qpc.remote_qpn` names no QP at that port.
    pub const NO_SUCH_REMOTE_QP: u32 = 0xe000_0308;
    /// The transition does not leave from the QP's state.
    pub const QP_STATE: u32 = 0xe000_0309;
    /// A PSN wider than 24 bits cannot happen in the layout; a remote QP number of 0 can.
    pub const REMOTE_QPN_ZERO: u32 = 0xe000_030a;
}

/// Why the emulated firmware refused a command.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{command} refused: status {status:#04x}, syndrome {syndrome:#010x}: {reason}")]
pub struct Refused {
    /// The command.
    pub command: &'static str,
    /// The PRM status.
    pub status: u8,
    /// The emulator's syndrome ([`syndrome`]).
    pub syndrome: u32,
    /// Why, in words (logged; the output mailbox carries only status and syndrome).
    pub reason: String,
}

impl Refused {
    pub(crate) fn new(
        command: &'static str,
        status: u8,
        syndrome: u32,
        reason: impl Into<String>,
    ) -> Self {
        Self {
            command,
            status,
            syndrome,
            reason: reason.into(),
        }
    }
}
