//! `CREATE_QP` for an RC QP whose work queue and doorbell record live in umem, and the three
//! transitions that connect it: `RST2INIT_QP`, `INIT2RTR_QP`, `RTR2RTS_QP`.

use super::bits::{BitReader, BitWriter, PrmError};
use super::cmd_cq::UmemRef;
use super::cmd_hca::{AtomicMode, TsFormat};
use super::layout::{
    ads, cmd_in, cmd_out, create_qp_in, create_qp_out, modify_qp_in, opcode, qpc, query_qp,
};
use super::status::{check_output, CommandFailed};

/// `MLX5_QPC_ST_RC`.
const ST_RC: u64 = 0x0;
/// `MLX5_QPC_PM_STATE_MIGRATED`: no alternate path.
const PM_STATE_MIGRATED: u64 = 0x3;
/// `MLX5_NON_ZERO_RQ`.
const RQ_TYPE_REGULAR: u64 = 0x0;
/// `MLX5_ZERO_LEN_RQ`.
const RQ_TYPE_ZERO: u64 = 0x3;

/// The path MTU (`MLX5_QPC_MTU_*`, the same codes as `enum ibv_mtu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1 KiB.
    Mtu1024 = 3,
    /// 2 KiB.
    Mtu2048 = 4,
    /// 4 KiB.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the `enum ibv_mtu` code a port reports (1..=5).
    pub const fn from_code(code: u32) -> Option<Self> {
        match code {
            1 => Some(Mtu::Mtu256),
            2 => Some(Mtu::Mtu512),
            3 => Some(Mtu::Mtu1024),
            4 => Some(Mtu::Mtu2048),
            5 => Some(Mtu::Mtu4096),
            _ => None,
        }
    }

    /// The MTU in bytes.
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// The receive side of a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RqSpec {
    /// No receive queue (`MLX5_ZERO_LEN_RQ`): enough for RDMA writes, reads and atomics, which
    /// is all the IBGDA path posts. The send queue starts at the work queue's offset.
    None,
    /// A receive queue of 2^`log_wqe_count` entries of 2^`log_stride` bytes each, placed before
    /// the send queue in the work queue buffer (mlx5 layout: RQ first, SQ after it).
    Ring {
        /// log2 of the number of receive WQEs.
        log_wqe_count: u8,
        /// log2 of the receive WQE size in bytes (at least 4 = 16 bytes).
        log_stride: u8,
    },
}

impl RqSpec {
    /// Bytes the receive queue occupies ahead of the send queue.
    pub const fn bytes(self) -> u64 {
        match self {
            RqSpec::None => 0,
            RqSpec::Ring {
                log_wqe_count,
                log_stride,
            } => 1u64 << (log_wqe_count as u32 + log_stride as u32),
        }
    }
}

/// The `CREATE_QP` command (opcode 0x500) for an RC QP.
///
/// ```
/// use ibgda_verbs::prm::{CreateQp, RqSpec, UmemRef};
/// let image = CreateQp::new(0x10, 0x20, 0x30, 0x31, 8, UmemRef::new(1, 0), UmemRef::new(2, 8))
///     .rq(RqSpec::None)
///     .build()?;
/// assert_eq!(&image[0..2], &[0x05, 0x00]);
/// # Ok::<(), ibgda_verbs::prm::PrmError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreateQp {
    pdn: u32,
    uar_page: u32,
    send_cqn: u32,
    recv_cqn: u32,
    log_sq_size: u8,
    wq: UmemRef,
    dbr: UmemRef,
    rq: RqSpec,
    no_sq: bool,
    log_page_size: u8,
    ts_format: TsFormat,
    user_index: u32,
}

impl CreateQp {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = cmd_out::SIZE_BYTES;

    /// An RC QP in protection domain `pdn`, ringing through UAR page `uar_page`, completing to
    /// `send_cqn`/`recv_cqn`, with 2^`log_sq_size` send WQEBBs in the work queue at `wq` and its
    /// 8-byte doorbell record at `dbr`. No receive queue unless [`CreateQp::rq`] says otherwise.
    pub const fn new(
        pdn: u32,
        uar_page: u32,
        send_cqn: u32,
        recv_cqn: u32,
        log_sq_size: u8,
        wq: UmemRef,
        dbr: UmemRef,
    ) -> Self {
        Self {
            pdn,
            uar_page,
            send_cqn,
            recv_cqn,
            log_sq_size,
            wq,
            dbr,
            rq: RqSpec::None,
            no_sq: false,
            log_page_size: 0,
            ts_format: TsFormat::FreeRunning,
            user_index: 0,
        }
    }

    /// The receive queue (default: none).
    pub const fn rq(mut self, rq: RqSpec) -> Self {
        self.rq = rq;
        self
    }

    /// A QP with no send queue (`qpc.no_sq`; default off).
    pub const fn no_sq(mut self, on: bool) -> Self {
        self.no_sq = on;
        self
    }

    /// log2 of the ring's page size in 4 KiB units (default 0 = 4 KiB).
    pub const fn log_page_size(mut self, log: u8) -> Self {
        self.log_page_size = log;
        self
    }

    /// The timestamp format (see [`GeneralCaps::qp_ts_format`](super::GeneralCaps::qp_ts_format)).
    pub const fn ts_format(mut self, ts: TsFormat) -> Self {
        self.ts_format = ts;
        self
    }

    /// The user index reported in version-1 CQEs (default 0).
    pub const fn user_index(mut self, index: u32) -> Self {
        self.user_index = index;
        self
    }

    /// The command image.
    pub fn build(&self) -> Result<Vec<u8>, PrmError> {
        let q = create_qp_in::QPC;
        let mut w = BitWriter::new(create_qp_in::SIZE_BYTES);
        w.put(cmd_in::OPCODE, u64::from(opcode::CREATE_QP))?
            .put(qpc::ST.at(q), ST_RC)?
            .put(qpc::PM_STATE.at(q), PM_STATE_MIGRATED)?
            .put(qpc::PD.at(q), u64::from(self.pdn))?
            .put(qpc::UAR_PAGE.at(q), u64::from(self.uar_page))?
            .put(qpc::USER_INDEX.at(q), u64::from(self.user_index))?
            .put(qpc::LOG_SQ_SIZE.at(q), u64::from(self.log_sq_size))?
            .flag(qpc::NO_SQ.at(q), self.no_sq)?
            .put(qpc::TS_FORMAT.at(q), self.ts_format as u64)?
            .put(qpc::LOG_PAGE_SIZE.at(q), u64::from(self.log_page_size))?
            .put(qpc::CQN_SND.at(q), u64::from(self.send_cqn))?
            .put(qpc::CQN_RCV.at(q), u64::from(self.recv_cqn))?
            .flag(qpc::DBR_UMEM_VALID.at(q), true)?
            .put(qpc::DBR_UMEM_ID.at(q), u64::from(self.dbr.umem_id))?
            .put(qpc::DBR_ADDR.at(q), self.dbr.offset)?
            .put(create_qp_in::WQ_UMEM_OFFSET, self.wq.offset)?
            .put(create_qp_in::WQ_UMEM_ID, u64::from(self.wq.umem_id))?
            .flag(create_qp_in::WQ_UMEM_VALID, true)?;
        match self.rq {
            RqSpec::None => {
                w.put(qpc::RQ_TYPE.at(q), RQ_TYPE_ZERO)?;
            }
            RqSpec::Ring {
                log_wqe_count,
                log_stride,
            } => {
                if log_stride < 4 {
                    return Err(PrmError::Overflow {
                        field: "qpc.log_rq_stride (receive WQEs are at least 16 bytes)",
                        value: u64::from(log_stride),
                        width: 3,
                    });
                }
                w.put(qpc::RQ_TYPE.at(q), RQ_TYPE_REGULAR)?
                    .put(qpc::LOG_RQ_SIZE.at(q), u64::from(log_wqe_count))?
                    .put(qpc::LOG_RQ_STRIDE.at(q), u64::from(log_stride - 4))?;
            }
        }
        Ok(w.finish())
    }
}

/// The QP number from a `CREATE_QP` output, or firmware's refusal.
pub fn parse_create_qp_out(out: &[u8]) -> Result<u32, CommandFailed> {
    check_output("CREATE_QP", out)?;
    Ok(BitReader::new(out).get(create_qp_out::QPN) as u32)
}

/// Global routing for a path: always used on RoCE, across subnets on InfiniBand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    /// The remote GID, network byte order.
    pub rgid: [u8; 16],
    /// The local GID index (`ads.src_addr_index`).
    pub sgid_index: u8,
    /// Hop limit (IPv6) / TTL (IPv4).
    pub hop_limit: u8,
    /// Traffic class (DSCP and ECN on RoCE).
    pub traffic_class: u8,
    /// IPv6 flow label (20 bits).
    pub flow_label: u32,
}

/// The primary address path of an RC QP (`struct mlx5_ifc_ads_bits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressPath {
    /// The local port, 1-based.
    pub port: u8,
    /// P_Key table index.
    pub pkey_index: u16,
    /// The remote LID (InfiniBand; 0 on RoCE).
    pub rlid: u16,
    /// Service level (InfiniBand).
    pub sl: u8,
    /// Global route header, if any.
    pub grh: Option<Grh>,
    /// The remote (next-hop) MAC on RoCE.
    pub rmac: Option<[u8; 6]>,
    /// RoCE v2 UDP source port (0 lets the firmware choose).
    pub udp_sport: u16,
}

impl AddressPath {
    /// An InfiniBand path to `rlid` through local `port`.
    pub const fn infiniband(port: u8, rlid: u16) -> Self {
        Self {
            port,
            pkey_index: 0,
            rlid,
            sl: 0,
            grh: None,
            rmac: None,
            udp_sport: 0,
        }
    }

    /// A RoCE path: GRH to `grh.rgid` and Ethernet to `rmac`, through local `port`.
    pub const fn roce(port: u8, grh: Grh, rmac: [u8; 6], udp_sport: u16) -> Self {
        Self {
            port,
            pkey_index: 0,
            rlid: 0,
            sl: 0,
            grh: Some(grh),
            rmac: Some(rmac),
            udp_sport,
        }
    }

    fn write(&self, w: &mut BitWriter, base: u32) -> Result<(), PrmError> {
        w.put(ads::VHCA_PORT_NUM.at(base), u64::from(self.port))?
            .put(ads::PKEY_INDEX.at(base), u64::from(self.pkey_index))?
            .put(ads::RLID.at(base), u64::from(self.rlid))?
            .put(ads::SL.at(base), u64::from(self.sl))?
            .put(ads::UDP_SPORT.at(base), u64::from(self.udp_sport))?;
        if let Some(g) = self.grh {
            w.flag(ads::GRH.at(base), true)?
                .put_bytes(ads::RGID_RIP.at(base), &g.rgid)?
                .put(ads::SRC_ADDR_INDEX.at(base), u64::from(g.sgid_index))?
                .put(ads::HOP_LIMIT.at(base), u64::from(g.hop_limit))?
                .put(ads::TCLASS.at(base), u64::from(g.traffic_class))?
                .put(ads::FLOW_LABEL.at(base), u64::from(g.flow_label))?;
        }
        if let Some(m) = self.rmac {
            w.put(
                ads::RMAC_47_32.at(base),
                u64::from(u16::from_be_bytes([m[0], m[1]])),
            )?
            .put(
                ads::RMAC_31_0.at(base),
                u64::from(u32::from_be_bytes([m[2], m[3], m[4], m[5]])),
            )?;
        }
        Ok(())
    }
}

/// What the remote side may do to this QP's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteAccess {
    /// RDMA read (`qpc.rre`).
    pub read: bool,
    /// RDMA write (`qpc.rwe`).
    pub write: bool,
    /// Atomics (`qpc.rae`), in the mode given.
    pub atomic: Option<AtomicMode>,
}

fn modify_header(w: &mut BitWriter, op: u16, qpn: u32) -> Result<(), PrmError> {
    w.put(cmd_in::OPCODE, u64::from(op))?
        .put(modify_qp_in::QPN, u64::from(qpn))?;
    Ok(())
}

/// `RST2INIT_QP` (opcode 0x502): binds the QP to a port and sets what remote peers may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rst2Init {
    qpn: u32,
    port: u8,
    pkey_index: u16,
    access: RemoteAccess,
}

impl Rst2Init {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = cmd_out::SIZE_BYTES;

    /// Moves `qpn` to INIT on local `port` with the given remote access.
    pub const fn new(qpn: u32, port: u8, access: RemoteAccess) -> Self {
        Self {
            qpn,
            port,
            pkey_index: 0,
            access,
        }
    }

    /// P_Key index (default 0).
    pub const fn pkey_index(mut self, index: u16) -> Self {
        self.pkey_index = index;
        self
    }

    /// The command image.
    pub fn build(&self) -> Result<Vec<u8>, PrmError> {
        let q = modify_qp_in::QPC;
        let path = q + qpc::PRIMARY_ADDRESS_PATH;
        let mut w = BitWriter::new(modify_qp_in::SIZE_BYTES);
        modify_header(&mut w, opcode::RST2INIT_QP, self.qpn)?;
        w.put(ads::VHCA_PORT_NUM.at(path), u64::from(self.port))?
            .put(ads::PKEY_INDEX.at(path), u64::from(self.pkey_index))?
            .flag(qpc::RRE.at(q), self.access.read)?
            .flag(qpc::RWE.at(q), self.access.write)?
            .flag(qpc::RAE.at(q), self.access.atomic.is_some())?;
        if let Some(mode) = self.access.atomic {
            w.put(qpc::ATOMIC_MODE.at(q), mode as u64)?;
        }
        Ok(w.finish())
    }
}

/// `INIT2RTR_QP` (opcode 0x503): points the QP at its remote peer and readies the receive side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Init2Rtr {
    qpn: u32,
    remote_qpn: u32,
    next_rcv_psn: u32,
    mtu: Mtu,
    path: AddressPath,
    log_msg_max: u8,
    min_rnr_nak: u8,
    log_rra_max: u8,
}

impl Init2Rtr {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = cmd_out::SIZE_BYTES;

    /// Connects `qpn` to `remote_qpn` over `path`, expecting the peer's first PSN `next_rcv_psn`.
    pub const fn new(
        qpn: u32,
        remote_qpn: u32,
        next_rcv_psn: u32,
        mtu: Mtu,
        path: AddressPath,
    ) -> Self {
        Self {
            qpn,
            remote_qpn,
            next_rcv_psn,
            mtu,
            path,
            log_msg_max: 30,
            min_rnr_nak: 12,
            log_rra_max: 4,
        }
    }

    /// log2 of the largest message (default 30; at most `cmd_hca_cap.log_max_msg`).
    pub const fn log_msg_max(mut self, log: u8) -> Self {
        self.log_msg_max = log;
        self
    }

    /// The RNR NAK timer code (default 12 = 0.64 ms).
    pub const fn min_rnr_nak(mut self, code: u8) -> Self {
        self.min_rnr_nak = code;
        self
    }

    /// log2 of outstanding reads/atomics accepted as responder (default 4 = 16).
    pub const fn log_rra_max(mut self, log: u8) -> Self {
        self.log_rra_max = log;
        self
    }

    /// The command image.
    pub fn build(&self) -> Result<Vec<u8>, PrmError> {
        let q = modify_qp_in::QPC;
        let mut w = BitWriter::new(modify_qp_in::SIZE_BYTES);
        modify_header(&mut w, opcode::INIT2RTR_QP, self.qpn)?;
        w.put(qpc::MTU.at(q), self.mtu as u64)?
            .put(qpc::LOG_MSG_MAX.at(q), u64::from(self.log_msg_max))?
            .put(qpc::REMOTE_QPN.at(q), u64::from(self.remote_qpn))?
            .put(qpc::NEXT_RCV_PSN.at(q), u64::from(self.next_rcv_psn))?
            .put(qpc::MIN_RNR_NAK.at(q), u64::from(self.min_rnr_nak))?
            .put(qpc::LOG_RRA_MAX.at(q), u64::from(self.log_rra_max))?;
        self.path.write(&mut w, q + qpc::PRIMARY_ADDRESS_PATH)?;
        Ok(w.finish())
    }
}

/// `RTR2RTS_QP` (opcode 0x504): readies the send side: first PSN, timeouts, retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rtr2Rts {
    qpn: u32,
    next_send_psn: u32,
    ack_timeout: u8,
    retry_count: u8,
    rnr_retry: u8,
    log_sra_max: u8,
}

impl Rtr2Rts {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = cmd_out::SIZE_BYTES;

    /// Readies `qpn` to send from PSN `next_send_psn`, with defaults of ack timeout 14
    /// (≈ 67 ms), 7 retries, 7 RNR retries (= infinite) and 16 outstanding reads/atomics.
    pub const fn new(qpn: u32, next_send_psn: u32) -> Self {
        Self {
            qpn,
            next_send_psn,
            ack_timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            log_sra_max: 4,
        }
    }

    /// Local ACK timeout code: 4.096 µs × 2^code (`ads.ack_timeout`, 5 bits).
    pub const fn ack_timeout(mut self, code: u8) -> Self {
        self.ack_timeout = code;
        self
    }

    /// Transport retries before the QP errors (3 bits).
    pub const fn retry_count(mut self, n: u8) -> Self {
        self.retry_count = n;
        self
    }

    /// RNR retries (3 bits; 7 = retry forever).
    pub const fn rnr_retry(mut self, n: u8) -> Self {
        self.rnr_retry = n;
        self
    }

    /// log2 of outstanding reads/atomics as requester.
    pub const fn log_sra_max(mut self, log: u8) -> Self {
        self.log_sra_max = log;
        self
    }

    /// The command image.
    pub fn build(&self) -> Result<Vec<u8>, PrmError> {
        let q = modify_qp_in::QPC;
        let mut w = BitWriter::new(modify_qp_in::SIZE_BYTES);
        modify_header(&mut w, opcode::RTR2RTS_QP, self.qpn)?;
        w.put(qpc::NEXT_SEND_PSN.at(q), u64::from(self.next_send_psn))?
            .put(
                ads::ACK_TIMEOUT.at(q + qpc::PRIMARY_ADDRESS_PATH),
                u64::from(self.ack_timeout),
            )?
            .put(qpc::RETRY_COUNT.at(q), u64::from(self.retry_count))?
            .put(qpc::RNR_RETRY.at(q), u64::from(self.rnr_retry))?
            .put(qpc::LOG_SRA_MAX.at(q), u64::from(self.log_sra_max))?;
        Ok(w.finish())
    }
}

/// `QUERY_QP` (opcode 0x50b): the QP's context as firmware holds it.
///
/// ```
/// use ibgda_verbs::prm::QueryQp;
/// let image = QueryQp::new(0x12_3456).build();
/// assert_eq!(image, [0x05, 0x0b, 0, 0, 0, 0, 0, 0, 0, 0x12, 0x34, 0x56, 0, 0, 0, 0]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryQp {
    qpn: u32,
}

impl QueryQp {
    /// Length of the output buffer the command needs.
    pub const OUT_LEN: usize = query_qp::OUT_BYTES;

    /// Queries QP `qpn` (24 bits; higher bits are dropped).
    pub const fn new(qpn: u32) -> Self {
        Self {
            qpn: qpn & 0xff_ffff,
        }
    }

    /// The command image.
    pub fn build(&self) -> Vec<u8> {
        let mut w = BitWriter::new(query_qp::IN_BYTES);
        // Both values fit their fields by construction.
        w.put(cmd_in::OPCODE, u64::from(opcode::QUERY_QP))
            .and_then(|w| w.put(query_qp::QPN, u64::from(self.qpn)))
            .expect("QUERY_QP fields fit");
        w.finish()
    }
}

/// A QP's state as `QUERY_QP` reports it (`enum mlx5_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirmwareQpState {
    /// RESET (0).
    Reset,
    /// INIT (1).
    Init,
    /// RTR (2).
    Rtr,
    /// RTS (3).
    Rts,
    /// Send queue error (4).
    SqError,
    /// Send queue drained (5).
    SqDrained,
    /// ERROR (6).
    Error,
    /// Another code.
    Other(u8),
}

impl FirmwareQpState {
    const fn from_code(code: u8) -> Self {
        match code {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            4 => Self::SqError,
            5 => Self::SqDrained,
            6 => Self::Error,
            c => Self::Other(c),
        }
    }
}

/// The fields of a `QUERY_QP` output this crate reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpContext {
    /// `qpc.state`.
    pub state: FirmwareQpState,
    /// `qpc.remote_qpn`.
    pub remote_qpn: u32,
    /// `qpc.next_send_psn`.
    pub next_send_psn: u32,
    /// `qpc.next_rcv_psn`.
    pub next_rcv_psn: u32,
    /// `qpc.mtu`.
    pub mtu: Option<Mtu>,
    /// `qpc.cqn_snd`.
    pub send_cqn: u32,
    /// Remote read, write and atomic rights (`qpc.rre`, `rwe`, `rae`).
    pub remote_access: (bool, bool, bool),
    /// `qpc.hw_sq_wqebb_counter`: send WQEBBs the NIC has consumed, modulo 2^16.
    pub hw_sq_wqebb_counter: u16,
}

/// The context from a `QUERY_QP` output, or firmware's refusal.
pub fn parse_query_qp_out(out: &[u8]) -> Result<QpContext, CommandFailed> {
    check_output("QUERY_QP", out)?;
    let r = BitReader::new(out);
    let q = query_qp::QPC;
    let g = |f: super::bits::Field| r.get(f.at(q));
    Ok(QpContext {
        state: FirmwareQpState::from_code(g(qpc::STATE) as u8),
        remote_qpn: g(qpc::REMOTE_QPN) as u32,
        next_send_psn: g(qpc::NEXT_SEND_PSN) as u32,
        next_rcv_psn: g(qpc::NEXT_RCV_PSN) as u32,
        mtu: Mtu::from_code(g(qpc::MTU) as u32),
        send_cqn: g(qpc::CQN_SND) as u32,
        remote_access: (
            r.flag(qpc::RRE.at(q)),
            r.flag(qpc::RWE.at(q)),
            r.flag(qpc::RAE.at(q)),
        ),
        hw_sq_wqebb_counter: g(qpc::HW_SQ_WQEBB_COUNTER) as u16,
    })
}

/// Checks the output of a QP state transition.
pub fn parse_modify_qp_out(command: &'static str, out: &[u8]) -> Result<(), CommandFailed> {
    check_output(command, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte `n` of the qpc inside a create/modify image (qpc starts at byte 0x18).
    fn qpc_byte(image: &[u8], n: usize) -> u8 {
        image[0x18 + n]
    }

    fn qpc_dword(image: &[u8], n: usize) -> [u8; 4] {
        let s = 0x18 + 4 * n;
        [image[s], image[s + 1], image[s + 2], image[s + 3]]
    }

    #[test]
    fn create_qp_image_matches_prm_offsets() {
        let img = CreateQp::new(
            0x00_1234,
            0x00_0abc,
            0x00_0101,
            0x00_0202,
            10,
            UmemRef::new(0xaaaa_0001, 0x1_0000),
            UmemRef::new(0xbbbb_0002, 0x80),
        )
        .ts_format(TsFormat::RealTime)
        .log_page_size(4)
        .build()
        .unwrap();
        assert_eq!(img.len(), 272);
        assert_eq!(&img[0..2], &[0x05, 0x00]);
        // opt_param_mask (byte 0x10) is 0.
        assert_eq!(&img[0x10..0x14], &[0; 4]);
        // qpc dword 0: st = RC (0) in byte 1, pm_state = 3 at bits 0x13..0x15 → byte 2 = 0b0001_1000.
        assert_eq!(qpc_dword(&img, 0), [0x00, 0x00, 0x18, 0x00]);
        // qpc dword 1: pd in the low 24 bits.
        assert_eq!(qpc_dword(&img, 1), [0x00, 0x00, 0x12, 0x34]);
        // qpc dword 2: log_sq_size 10 at bits 0x51..0x55, ts_format 2 at 0x58..0x5a.
        //   bit 0x51 is bit 1 (from MSB) of byte 10 → 10 << 3 = 0x50; ts_format → byte 11 = 0x80.
        assert_eq!(qpc_dword(&img, 2), [0x00, 0x00, 0x50, 0x80]);
        // qpc dword 3: uar_page.
        assert_eq!(qpc_dword(&img, 3), [0x00, 0x00, 0x0a, 0xbc]);
        // qpc dword 5: log_page_size 4 at 0xa3..0xa8 → byte 20 = 0x04; remote_qpn 0.
        assert_eq!(qpc_dword(&img, 5), [0x04, 0, 0, 0]);
        // cqn_snd at qpc bit 0x3e8 (dword 31), cqn_rcv at 0x4e8 (dword 39).
        assert_eq!(qpc_dword(&img, 31), [0x00, 0x00, 0x01, 0x01]);
        assert_eq!(qpc_dword(&img, 39), [0x00, 0x00, 0x02, 0x02]);
        // dbr_addr at qpc bit 0x500 (dwords 40-41).
        assert_eq!(&img[0x18 + 160..0x18 + 168], &0x80u64.to_be_bytes());
        // rq_type 3 at qpc bits 0x565..0x568 → byte 0xac low 3 bits of the top nibble: 0b0000_0011.
        assert_eq!(qpc_byte(&img, 0xac), 0x03);
        // dbr_umem_valid at qpc bit 0x683 → byte 0xd0 = 0b0001_0000.
        assert_eq!(qpc_byte(&img, 0xd0), 0x10);
        // dbr_umem_id at qpc bit 0x720 → bytes 0xe4..0xe8.
        assert_eq!(qpc_dword(&img, 0x720 / 32), 0xbbbb_0002u32.to_be_bytes());
        // After the qpc (0x18 + 0xe8 = 0x100): wq_umem_offset, wq_umem_id, wq_umem_valid.
        assert_eq!(&img[0x100..0x108], &0x1_0000u64.to_be_bytes());
        assert_eq!(&img[0x108..0x10c], &0xaaaa_0001u32.to_be_bytes());
        assert_eq!(img[0x10c], 0x80);
    }

    #[test]
    fn create_qp_with_receive_queue() {
        let img = CreateQp::new(1, 1, 1, 1, 6, UmemRef::new(1, 0), UmemRef::new(1, 0))
            .rq(RqSpec::Ring {
                log_wqe_count: 8,
                log_stride: 6,
            })
            .build()
            .unwrap();
        let r = BitReader::new(&img);
        let q = create_qp_in::QPC;
        assert_eq!(r.get(qpc::RQ_TYPE.at(q)), 0);
        assert_eq!(r.get(qpc::LOG_RQ_SIZE.at(q)), 8);
        assert_eq!(
            r.get(qpc::LOG_RQ_STRIDE.at(q)),
            2,
            "64-byte stride = 4 × 16 B → log 2"
        );
        assert_eq!(r.get(qpc::LOG_SQ_SIZE.at(q)), 6);
        assert_eq!(
            RqSpec::Ring {
                log_wqe_count: 8,
                log_stride: 6
            }
            .bytes(),
            1 << 14
        );
        let bad = CreateQp::new(1, 1, 1, 1, 6, UmemRef::new(1, 0), UmemRef::new(1, 0))
            .rq(RqSpec::Ring {
                log_wqe_count: 8,
                log_stride: 3,
            })
            .build();
        assert!(bad.is_err());
        // log_sq_size has 4 bits.
        assert!(
            CreateQp::new(1, 1, 1, 1, 16, UmemRef::new(1, 0), UmemRef::new(1, 0))
                .build()
                .is_err()
        );
    }

    #[test]
    fn rst2init_image() {
        let access = RemoteAccess {
            read: true,
            write: true,
            atomic: Some(AtomicMode::UpTo8Bytes),
        };
        let img = Rst2Init::new(0x00_4321, 1, access)
            .pkey_index(2)
            .build()
            .unwrap();
        assert_eq!(img.len(), 272);
        assert_eq!(&img[0..2], &[0x05, 0x02]);
        assert_eq!(&img[8..12], &[0x00, 0x00, 0x43, 0x21], "qpn at bit 0x48");
        // primary_address_path at qpc byte 0x18: pkey_index in its first dword, vhca_port_num at
        // ads bit 0x128 → ads byte 0x25.
        assert_eq!(qpc_dword(&img, 6), [0, 0, 0, 2]);
        assert_eq!(qpc_byte(&img, 0x18 + 0x25), 1);
        // qpc bit 0x488..0x4a0: log_rra_max 0 | atomic_mode 3 at 0x48c | rre rwe rae at 0x490..0x493.
        //   byte 0x91 = atomic_mode in its low nibble = 0x03; byte 0x92 = 0b1110_0000.
        assert_eq!(qpc_byte(&img, 0x91), 0x03);
        assert_eq!(qpc_byte(&img, 0x92), 0xe0);
        let r = BitReader::new(&img);
        let q = modify_qp_in::QPC;
        assert_eq!(r.get(qpc::ATOMIC_MODE.at(q)), AtomicMode::UpTo8Bytes as u64);
        assert!(r.flag(qpc::RRE.at(q)) && r.flag(qpc::RWE.at(q)) && r.flag(qpc::RAE.at(q)));

        let none = Rst2Init::new(1, 1, RemoteAccess::default())
            .build()
            .unwrap();
        assert_eq!(qpc_byte(&none, 0x91), 0);
        assert_eq!(qpc_byte(&none, 0x92), 0);
    }

    #[test]
    fn init2rtr_image_infiniband() {
        let path = AddressPath::infiniband(1, 0x00_2a);
        let img = Init2Rtr::new(0x10, 0x00_0777, 0x00_abcd, Mtu::Mtu4096, path)
            .build()
            .unwrap();
        assert_eq!(&img[0..2], &[0x05, 0x03]);
        // qpc dword 2: mtu 5 in the top 3 bits, log_msg_max 30 in the next 5: 0b101_11110.
        assert_eq!(qpc_byte(&img, 8), 0xbe);
        // remote_qpn in qpc dword 5.
        assert_eq!(&qpc_dword(&img, 5)[1..], &[0x00, 0x07, 0x77]);
        // min_rnr_nak 12 at qpc bit 0x4a3 → byte 0x94 low 5 bits; next_rcv_psn in bytes 0x95..0x98.
        assert_eq!(qpc_dword(&img, 0x4a0 / 32), [0x0c, 0x00, 0xab, 0xcd]);
        // log_rra_max 4 at qpc bit 0x488 → byte 0x91 top 3 bits: 0b100_0_0000.
        assert_eq!(qpc_byte(&img, 0x91), 0x80);
        // Path: rlid at ads bits 0x30..0x40, no GRH.
        let ads0 = 0x18;
        assert_eq!(
            &[qpc_byte(&img, ads0 + 6), qpc_byte(&img, ads0 + 7)],
            &[0x00, 0x2a]
        );
        assert_eq!(qpc_byte(&img, ads0 + 5), 0x00, "grh off");
        assert_eq!(qpc_byte(&img, ads0 + 0x25), 1, "port");
    }

    #[test]
    fn init2rtr_image_roce() {
        let rgid: [u8; 16] = core::array::from_fn(|i| 0xf0 + i as u8);
        let grh = Grh {
            rgid,
            sgid_index: 3,
            hop_limit: 64,
            traffic_class: 0x68,
            flow_label: 0,
        };
        let mac = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];
        let path = AddressPath::roce(1, grh, mac, 0xc001);
        let img = Init2Rtr::new(0x10, 0x20, 0, Mtu::Mtu1024, path)
            .build()
            .unwrap();
        let ads0 = 0x18;
        // grh bit 0x28 → ads byte 5 MSB.
        assert_eq!(qpc_byte(&img, ads0 + 5), 0x80);
        // src_addr_index at ads byte 9, hop_limit at byte 11.
        assert_eq!(qpc_byte(&img, ads0 + 9), 3);
        assert_eq!(qpc_byte(&img, ads0 + 11), 64);
        // tclass at ads bits 0x64..0x6c: 0x68 → bytes 12..14 = 0x06, 0x80.
        assert_eq!(
            &[qpc_byte(&img, ads0 + 12), qpc_byte(&img, ads0 + 13)],
            &[0x06, 0x80]
        );
        // rgid at ads bytes 16..32.
        let got: Vec<u8> = (16..32).map(|i| qpc_byte(&img, ads0 + i)).collect();
        assert_eq!(got, rgid);
        // udp_sport at ads bytes 34..36.
        assert_eq!(
            &[qpc_byte(&img, ads0 + 34), qpc_byte(&img, ads0 + 35)],
            &[0xc0, 0x01]
        );
        // rmac_47_32 at ads bytes 38..40, rmac_31_0 at 40..44.
        let m: Vec<u8> = (38..44).map(|i| qpc_byte(&img, ads0 + i)).collect();
        assert_eq!(m, mac);
        assert_eq!(qpc_byte(&img, 8) >> 5, Mtu::Mtu1024 as u8);
    }

    #[test]
    fn rtr2rts_image() {
        let img = Rtr2Rts::new(0x00_0042, 0x00_1357)
            .ack_timeout(18)
            .retry_count(6)
            .rnr_retry(7)
            .log_sra_max(3)
            .build()
            .unwrap();
        assert_eq!(&img[0..2], &[0x05, 0x04]);
        assert_eq!(&img[8..12], &[0, 0, 0, 0x42]);
        // ack_timeout 18 in the top 5 bits of ads byte 8: 0b10010_000.
        assert_eq!(qpc_byte(&img, 0x18 + 8), 0x90);
        // qpc dword 0x380/32 = 28: log_sra_max 3 at 0x388..0x38b → byte 0x71 = 0b011_00_110 with
        //   retry_count 6 at 0x38d..0x390; rnr_retry 7 at 0x390..0x393 → byte 0x72 = 0b111_00000.
        assert_eq!(qpc_byte(&img, 0x71), 0x66);
        assert_eq!(qpc_byte(&img, 0x72), 0xe0);
        // next_send_psn in qpc dword 0x3c0/32 = 30.
        assert_eq!(qpc_dword(&img, 30), [0x00, 0x00, 0x13, 0x57]);
        assert!(Rtr2Rts::new(1, 1).ack_timeout(32).build().is_err());
        assert!(
            Rtr2Rts::new(1, 1 << 24).build().is_err(),
            "PSNs are 24 bits"
        );
    }

    #[test]
    fn outputs() {
        let mut out = [0u8; 16];
        out[9..12].copy_from_slice(&[0x00, 0x12, 0x34]);
        assert_eq!(parse_create_qp_out(&out), Ok(0x1234));
        out[0] = 0x10;
        let e = parse_modify_qp_out("INIT2RTR_QP", &out).unwrap_err();
        assert!(e.to_string().contains("bad QP state"));
    }

    #[test]
    fn query_qp_image_and_output() {
        assert_eq!(
            QueryQp::new(0x0a_0b0c).build(),
            [0x05, 0x0b, 0, 0, 0, 0, 0, 0, 0, 0x0a, 0x0b, 0x0c, 0, 0, 0, 0]
        );
        // An output written byte by byte at the qpc offsets (qpc at byte 0x18).
        let mut out = vec![0u8; QueryQp::OUT_LEN];
        out[0x18] = 0x30; // state RTS in the top nibble
        out[0x18 + 8] = 5 << 5; // mtu 4096 in the top 3 bits of dword 2
        out[0x18 + 0x15..0x18 + 0x18].copy_from_slice(&[0x01, 0x02, 0x03]); // remote_qpn
        out[0x18 + 0x79..0x18 + 0x7c].copy_from_slice(&[0x00, 0x11, 0x22]); // next_send_psn
        out[0x18 + 0x7d..0x18 + 0x80].copy_from_slice(&[0x00, 0x04, 0x01]); // cqn_snd
        out[0x18 + 0x92] = 0x60; // rwe, rae
        out[0x18 + 0x95..0x18 + 0x98].copy_from_slice(&[0x00, 0x33, 0x44]); // next_rcv_psn
        out[0x18 + 0xb4..0x18 + 0xb6].copy_from_slice(&[0x01, 0x00]); // hw_sq_wqebb_counter
        let c = parse_query_qp_out(&out).unwrap();
        assert_eq!(
            c,
            QpContext {
                state: FirmwareQpState::Rts,
                remote_qpn: 0x01_0203,
                next_send_psn: 0x1122,
                next_rcv_psn: 0x3344,
                mtu: Some(Mtu::Mtu4096),
                send_cqn: 0x401,
                remote_access: (false, true, true),
                hw_sq_wqebb_counter: 0x100,
            }
        );
        out[0] = 0x10;
        assert_eq!(parse_query_qp_out(&out).unwrap_err().status, 0x10);
    }

    #[test]
    fn mtu_codes() {
        assert_eq!(Mtu::from_code(5), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::from_code(0), None);
    }
}
