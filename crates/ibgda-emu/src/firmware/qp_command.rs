//! `CREATE_QP`, `QUERY_QP` and the QP's destruction: the QP context decoded from its PRM image,
//! checked against the device and its tables, and turned into an engine QP whose send ring,
//! doorbell record, CQ and UAR page are the ones the command names.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::bits::{flag, get, put, Bits};
use super::cq_command::umem_range;
use super::layout::{ads, cmd_in, cmd_out, qp_cmd, qp_state, qpc};
use super::objects::{need_len, Firmware, FwQpState, QpRec, Tables};
use super::refusal::{status, syndrome, Refused};
use crate::doorbell::DoorbellConfig;
use crate::qp::{QpConfig, QpState};

const CMD: &str = "CREATE_QP";
/// How long `QUERY_QP` waits for the QP's engine before answering that the QP is busy.
const QUERY_ENGINE_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// A `CREATE_QP` image, field by field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CreateQpImage {
    pub st: u8,
    pub pd: u32,
    pub log_rq_size: u8,
    pub log_rq_stride: u8,
    pub no_sq: bool,
    pub log_sq_size: u8,
    pub ts_format: u8,
    pub uar_page: u32,
    pub user_index: u32,
    pub log_page_size: u8,
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    pub page_offset: u8,
    pub rq_type: u8,
    pub dbr_umem_valid: bool,
    pub dbr_umem_id: u32,
    pub dbr_offset: u64,
    pub wq_umem_valid: bool,
    pub wq_umem_id: u32,
    pub wq_offset: u64,
}

/// A `qpc` field of a QP command image.
pub(crate) fn q(f: Bits) -> Bits {
    f.within(qp_cmd::QPC)
}

impl CreateQpImage {
    /// Reads the fields (the length was checked by the caller).
    pub(crate) fn decode(input: &[u8]) -> Self {
        Self {
            st: get(input, q(qpc::ST)) as u8,
            pd: get(input, q(qpc::PD)) as u32,
            log_rq_size: get(input, q(qpc::LOG_RQ_SIZE)) as u8,
            log_rq_stride: get(input, q(qpc::LOG_RQ_STRIDE)) as u8,
            no_sq: flag(input, q(qpc::NO_SQ)),
            log_sq_size: get(input, q(qpc::LOG_SQ_SIZE)) as u8,
            ts_format: get(input, q(qpc::TS_FORMAT)) as u8,
            uar_page: get(input, q(qpc::UAR_PAGE)) as u32,
            user_index: get(input, q(qpc::USER_INDEX)) as u32,
            log_page_size: get(input, q(qpc::LOG_PAGE_SIZE)) as u8,
            cqn_snd: get(input, q(qpc::CQN_SND)) as u32,
            cqn_rcv: get(input, q(qpc::CQN_RCV)) as u32,
            page_offset: get(input, q(qpc::PAGE_OFFSET)) as u8,
            rq_type: get(input, q(qpc::RQ_TYPE)) as u8,
            dbr_umem_valid: flag(input, q(qpc::DBR_UMEM_VALID)),
            dbr_umem_id: get(input, q(qpc::DBR_UMEM_ID)) as u32,
            dbr_offset: get(input, q(qpc::DBR_ADDR)),
            wq_umem_valid: flag(input, qp_cmd::WQ_UMEM_VALID),
            wq_umem_id: get(input, qp_cmd::WQ_UMEM_ID) as u32,
            wq_offset: get(input, qp_cmd::WQ_UMEM_OFFSET),
        }
    }

    /// Bytes of receive queue ahead of the send queue in the work queue.
    fn rq_bytes(&self) -> u64 {
        if u64::from(self.rq_type) == qpc::RQ_ZERO_LEN {
            0
        } else {
            // log_rq_stride counts 16-byte units.
            1u64 << (u32::from(self.log_rq_size) + u32::from(self.log_rq_stride) + 4)
        }
    }
}

fn bad(status: u8, syndrome: u32, reason: String) -> Refused {
    Refused::new(CMD, status, syndrome, reason)
}

/// What a checked `CREATE_QP` leads to.
struct Placed {
    cfg: QpConfig,
    uar: Arc<crate::host::HostBuffer>,
}

impl Firmware {
    fn check_create_qp(&self, t: &Tables, img: &CreateQpImage) -> Result<Placed, Refused> {
        if u64::from(img.st) != qpc::ST_RC {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::NOT_RC,
                format!("st {:#x}: the emulator implements RC QPs only", img.st),
            ));
        }
        if !t.pds.contains_key(&img.pd) {
            return Err(bad(
                status::BAD_RESOURCE,
                syndrome::NO_SUCH_PD,
                format!("pd {:#x} is not allocated", img.pd),
            ));
        }
        let uar = t.uars.get(&img.uar_page).cloned().ok_or_else(|| {
            bad(
                status::BAD_RESOURCE,
                syndrome::NO_SUCH_UAR,
                format!("uar_page {:#x} is not allocated", img.uar_page),
            )
        })?;
        let send_cq = t.cqs.get(&img.cqn_snd).ok_or_else(|| {
            bad(
                status::BAD_RESOURCE,
                syndrome::NO_SUCH_SEND_CQ,
                format!("cqn_snd {:#x} names no CQ", img.cqn_snd),
            )
        })?;
        if !t.cqs.contains_key(&img.cqn_rcv) {
            return Err(bad(
                status::BAD_RESOURCE,
                syndrome::NO_SUCH_RECV_CQ,
                format!("cqn_rcv {:#x} names no CQ", img.cqn_rcv),
            ));
        }
        if send_cq.send_users > 0 && send_cq.cfg.mode == crate::cq::CqMode::Ring {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::CQ_SHARED,
                format!(
                    "ring CQ {:#x} already serves another QP's send queue (emulator limit)",
                    img.cqn_snd
                ),
            ));
        }
        if img.no_sq || img.log_sq_size > self.caps.log_max_qp_sz {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::SQ_SIZE,
                format!(
                    "log_sq_size {} (no_sq {}), log_max_qp_sz {}",
                    img.log_sq_size, img.no_sq, self.caps.log_max_qp_sz
                ),
            ));
        }
        let rq = u64::from(img.rq_type);
        if rq != qpc::RQ_ZERO_LEN && rq != qpc::RQ_REGULAR {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::RQ_TYPE,
                format!("rq_type {rq}: shared receive queues are not emulated"),
            ));
        }
        // sq_ts_format = 2: free-running (0), default (1) and real-time (2) are all accepted.
        if img.ts_format > 2 {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::TS_FORMAT,
                format!("ts_format {}", img.ts_format),
            ));
        }
        if !img.wq_umem_valid || !img.dbr_umem_valid {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::NOT_UMEM,
                "the work queue and the doorbell record must be in umems (wq_umem_valid, \
                 dbr_umem_valid)"
                    .into(),
            ));
        }
        if img.page_offset != 0 {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::PAGE_OFFSET,
                format!("page_offset {}", img.page_offset),
            ));
        }
        let sq_bytes = 64u64 << img.log_sq_size;
        let wq = umem_range(
            t,
            CMD,
            "work queue",
            img.wq_umem_id,
            img.wq_offset,
            img.rq_bytes() + sq_bytes,
            4096 << img.log_page_size,
        )?;
        let dbr = umem_range(
            t,
            CMD,
            "QP doorbell record",
            img.dbr_umem_id,
            img.dbr_offset,
            8,
            8,
        )?;
        Ok(Placed {
            cfg: QpConfig {
                sq: wq.offset(img.rq_bytes()),
                nwqebbs: 1 << img.log_sq_size,
                cq: send_cq.cfg,
                doorbell: DoorbellConfig {
                    dbr: Some(dbr),
                    uar: true,
                    producer_slot: None,
                },
            },
            uar,
        })
    }

    pub(super) fn create_qp(&self, input: &[u8], out: &mut [u8]) -> Result<u32, Refused> {
        need_len(CMD, input, qp_cmd::CREATE_IN_MIN_BYTES, out, cmd_out::BYTES)?;
        let img = CreateQpImage::decode(input);
        let mut t = self.tables();
        let placed = self.check_create_qp(&t, &img)?;
        // SAFETY: the ring, CQ and doorbell record lie inside registered umems, whose memory
        // the driver's caller keeps valid until the objects placed in them are destroyed (the
        // verbs objects hold their umems); the QP is destroyed with its firmware object.
        let handle = unsafe {
            self.nic
                .create_qp_on_page(placed.cfg, placed.uar, Vec::new())
        }
        .map_err(|e| {
            bad(
                status::BAD_PARAM,
                syndrome::ENGINE,
                format!("the engine refused the QP: {e}"),
            )
        })?;
        let qpn = handle.qpn;
        if let Some(cq) = t.cqs.get_mut(&img.cqn_snd) {
            cq.send_users += 1;
        }
        if let Some(cq) = t.cqs.get_mut(&img.cqn_rcv) {
            cq.recv_users += 1;
        }
        t.qps.insert(
            qpn,
            QpRec {
                state: FwQpState::Rst,
                pd: img.pd,
                uar_page: img.uar_page,
                cqn_snd: img.cqn_snd,
                cqn_rcv: img.cqn_rcv,
                log_sq_size: img.log_sq_size,
                rq_type: img.rq_type,
                log_rq_size: img.log_rq_size,
                log_rq_stride: img.log_rq_stride,
                ts_format: img.ts_format,
                user_index: img.user_index,
                dbr_umem_id: img.dbr_umem_id,
                dbr_offset: img.dbr_offset,
                access: Arc::new(AtomicU32::new(0)),
                atomic_mode: 0,
                port: 0,
                pkey_index: 0,
                mtu: 0,
                log_msg_max: 0,
                remote_qpn: 0,
                remote_lid: 0,
                next_rcv_psn: 0,
                next_send_psn: 0,
                min_rnr_nak: 0,
                log_rra_max: 0,
                log_sra_max: 0,
                retry_count: 0,
                rnr_retry: 0,
                ack_timeout: 0,
            },
        );
        out.fill(0);
        put(out, cmd_out::OBJ_NUM, u64::from(qpn));
        tracing::debug!(nic = %self.name, qpn, cfg = ?placed.cfg, "firmware: CREATE_QP");
        Ok(qpn)
    }

    pub(super) fn query_qp(&self, qpn: u32, input: &[u8], out: &mut [u8]) -> Result<(), Refused> {
        const Q: &str = "QUERY_QP";
        need_len(Q, input, cmd_in::SHORT_BYTES, out, qp_cmd::QUERY_OUT_BYTES)?;
        Firmware::check_object(Q, input, qpn)?;
        // The engine moves a QP to error on a failed WQE without a command. Asked with a bound:
        // a progress thread stuck inside this QP's round (a backend wait) must not stall the
        // firmware, and the caller is told the QP is busy instead of being given stale counters.
        let engine = match self.nic.qp_status_within(qpn, QUERY_ENGINE_WAIT) {
            Ok(Some(st)) => Some(st),
            Ok(None) => {
                return Err(Refused::new(
                    Q,
                    status::RESOURCE_BUSY,
                    syndrome::ENGINE,
                    format!(
                        "the progress thread held QP {qpn:#x}'s engine for {QUERY_ENGINE_WAIT:?}"
                    ),
                ))
            }
            Err(_) => None,
        };
        let t = self.tables();
        let r = t.qps.get(&qpn).ok_or_else(|| {
            Refused::new(
                Q,
                status::BAD_RESOURCE,
                syndrome::WRONG_OBJECT,
                "no such QP",
            )
        })?;
        let state = match (r.state, engine.as_ref().map(|e| e.state)) {
            (_, Some(QpState::Error)) | (FwQpState::Err, _) => qp_state::ERR,
            (FwQpState::Rst, _) => qp_state::RST,
            (FwQpState::Init, _) => qp_state::INIT,
            (FwQpState::Rtr, _) => qp_state::RTR,
            (FwQpState::Rts, _) => qp_state::RTS,
        };
        let access = r.access.load(Ordering::Acquire);
        let path = |f: Bits| q(f).within(qpc::PRIMARY_ADDRESS_PATH);
        out.fill(0);
        let fields: [(Bits, u64); 31] = [
            (q(qpc::STATE), state),
            (q(qpc::ST), qpc::ST_RC),
            (q(qpc::PD), u64::from(r.pd)),
            (q(qpc::MTU), u64::from(r.mtu)),
            (q(qpc::LOG_MSG_MAX), u64::from(r.log_msg_max)),
            (q(qpc::LOG_RQ_SIZE), u64::from(r.log_rq_size)),
            (q(qpc::LOG_RQ_STRIDE), u64::from(r.log_rq_stride)),
            (q(qpc::LOG_SQ_SIZE), u64::from(r.log_sq_size)),
            (q(qpc::TS_FORMAT), u64::from(r.ts_format)),
            (q(qpc::UAR_PAGE), u64::from(r.uar_page)),
            (q(qpc::USER_INDEX), u64::from(r.user_index)),
            (q(qpc::REMOTE_QPN), u64::from(r.remote_qpn)),
            (path(ads::PKEY_INDEX), u64::from(r.pkey_index)),
            (path(ads::RLID), u64::from(r.remote_lid)),
            (path(ads::ACK_TIMEOUT), u64::from(r.ack_timeout)),
            (path(ads::VHCA_PORT_NUM), u64::from(r.port)),
            (q(qpc::LOG_SRA_MAX), u64::from(r.log_sra_max)),
            (q(qpc::RETRY_COUNT), u64::from(r.retry_count)),
            (q(qpc::RNR_RETRY), u64::from(r.rnr_retry)),
            (q(qpc::NEXT_SEND_PSN), u64::from(r.next_send_psn)),
            (q(qpc::CQN_SND), u64::from(r.cqn_snd)),
            (q(qpc::LOG_RRA_MAX), u64::from(r.log_rra_max)),
            (q(qpc::ATOMIC_MODE), u64::from(r.atomic_mode)),
            (
                q(qpc::RRE),
                u64::from(access & crate::mr::Access::REMOTE_READ.bits() != 0),
            ),
            (
                q(qpc::RWE),
                u64::from(access & crate::mr::Access::REMOTE_WRITE.bits() != 0),
            ),
            (
                q(qpc::RAE),
                u64::from(access & crate::mr::Access::REMOTE_ATOMIC.bits() != 0),
            ),
            (q(qpc::MIN_RNR_NAK), u64::from(r.min_rnr_nak)),
            (q(qpc::NEXT_RCV_PSN), u64::from(r.next_rcv_psn)),
            (q(qpc::CQN_RCV), u64::from(r.cqn_rcv)),
            (q(qpc::DBR_ADDR), r.dbr_offset),
            (q(qpc::RQ_TYPE), u64::from(r.rq_type)),
        ];
        for (f, v) in fields {
            put(out, f, v);
        }
        put(out, q(qpc::DBR_UMEM_VALID), 1);
        put(out, q(qpc::DBR_UMEM_ID), u64::from(r.dbr_umem_id));
        // The NIC's send position: the WQEBBs it has read, as a 16-bit counter.
        let fetched = engine.map_or(0, |e| e.fetched);
        put(out, q(qpc::HW_SQ_WQEBB_COUNTER), fetched & 0xffff);
        Ok(())
    }

    pub(super) fn destroy_qp(&self, qpn: u32) -> Result<(), Refused> {
        let rec = self.tables().qps.remove(&qpn).ok_or_else(|| {
            Refused::new(
                "DESTROY_QP",
                status::BAD_RESOURCE,
                syndrome::WRONG_OBJECT,
                format!("no QP {qpn:#x}"),
            )
        })?;
        if let Err(e) = self.nic.destroy_qp(qpn) {
            tracing::error!(nic = %self.name, qpn, "destroying the engine QP: {e}");
        }
        let mut t = self.tables();
        if let Some(cq) = t.cqs.get_mut(&rec.cqn_snd) {
            cq.send_users = cq.send_users.saturating_sub(1);
        }
        if let Some(cq) = t.cqs.get_mut(&rec.cqn_rcv) {
            cq.recv_users = cq.recv_users.saturating_sub(1);
        }
        Ok(())
    }
}
