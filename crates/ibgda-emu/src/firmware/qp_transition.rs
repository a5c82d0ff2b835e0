//! The QP state transitions: `RST2INIT_QP` (port, P_Key, what peers may do), `INIT2RTR_QP`
//! (the peer: LID, QP number, receive PSN, MTU), `RTR2RTS_QP` (send PSN, retries), `2ERR_QP`
//! and `2RST_QP`. RTS connects the engine QP to the peer the path names, with the peer QP's
//! granted rights checked at every WQE.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::bits::{bytes, flag, get, Bits};
use super::layout::{ads, cmd_in, cmd_out, opcode, qp_cmd, qpc};
use super::objects::{need_len, Firmware, FwQpState};
use super::qp_command::q;
use super::refusal::{status, syndrome, Refused};
use crate::fabric::QpInfo;
use crate::mr::Access;

/// A field of the primary address path inside a QP command.
fn path(f: Bits) -> Bits {
    q(f).within(qpc::PRIMARY_ADDRESS_PATH)
}

/// The states a transition leaves from.
fn from_state(op: u16) -> Option<FwQpState> {
    match op {
        opcode::RST2INIT_QP => Some(FwQpState::Rst),
        opcode::INIT2RTR_QP => Some(FwQpState::Init),
        opcode::RTR2RTS_QP => Some(FwQpState::Rtr),
        _ => None,
    }
}

/// `RST2INIT_QP`'s fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rst2InitImage {
    pub port: u8,
    pub pkey_index: u16,
    pub rre: bool,
    pub rwe: bool,
    pub rae: bool,
    pub atomic_mode: u8,
}

impl Rst2InitImage {
    pub(crate) fn decode(input: &[u8]) -> Self {
        Self {
            port: get(input, path(ads::VHCA_PORT_NUM)) as u8,
            pkey_index: get(input, path(ads::PKEY_INDEX)) as u16,
            rre: flag(input, q(qpc::RRE)),
            rwe: flag(input, q(qpc::RWE)),
            rae: flag(input, q(qpc::RAE)),
            atomic_mode: get(input, q(qpc::ATOMIC_MODE)) as u8,
        }
    }

    /// The rights peers get, as `mr::Access` bits.
    fn access(&self) -> Access {
        let mut a = Access::NONE;
        if self.rre {
            a = a | Access::REMOTE_READ;
        }
        if self.rwe {
            a = a | Access::REMOTE_WRITE;
        }
        if self.rae {
            a = a | Access::REMOTE_ATOMIC;
        }
        a
    }
}

/// `INIT2RTR_QP`'s fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Init2RtrImage {
    pub mtu: u8,
    pub log_msg_max: u8,
    pub remote_qpn: u32,
    pub next_rcv_psn: u32,
    pub min_rnr_nak: u8,
    pub log_rra_max: u8,
    pub port: u8,
    pub pkey_index: u16,
    pub rlid: u16,
    pub grh: bool,
    pub rgid: [u8; 16],
}

impl Init2RtrImage {
    pub(crate) fn decode(input: &[u8]) -> Self {
        let mut rgid = [0u8; 16];
        rgid.copy_from_slice(&bytes(
            input,
            qp_cmd::QPC + qpc::PRIMARY_ADDRESS_PATH + ads::RGID_RIP_AT,
            16,
        ));
        Self {
            mtu: get(input, q(qpc::MTU)) as u8,
            log_msg_max: get(input, q(qpc::LOG_MSG_MAX)) as u8,
            remote_qpn: get(input, q(qpc::REMOTE_QPN)) as u32,
            next_rcv_psn: get(input, q(qpc::NEXT_RCV_PSN)) as u32,
            min_rnr_nak: get(input, q(qpc::MIN_RNR_NAK)) as u8,
            log_rra_max: get(input, q(qpc::LOG_RRA_MAX)) as u8,
            port: get(input, path(ads::VHCA_PORT_NUM)) as u8,
            pkey_index: get(input, path(ads::PKEY_INDEX)) as u16,
            rlid: get(input, path(ads::RLID)) as u16,
            grh: flag(input, path(ads::GRH)),
            rgid,
        }
    }
}

/// `RTR2RTS_QP`'s fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rtr2RtsImage {
    pub next_send_psn: u32,
    pub log_sra_max: u8,
    pub retry_count: u8,
    pub rnr_retry: u8,
    pub ack_timeout: u8,
}

impl Rtr2RtsImage {
    pub(crate) fn decode(input: &[u8]) -> Self {
        Self {
            next_send_psn: get(input, q(qpc::NEXT_SEND_PSN)) as u32,
            log_sra_max: get(input, q(qpc::LOG_SRA_MAX)) as u8,
            retry_count: get(input, q(qpc::RETRY_COUNT)) as u8,
            rnr_retry: get(input, q(qpc::RNR_RETRY)) as u8,
            ack_timeout: get(input, path(ads::ACK_TIMEOUT)) as u8,
        }
    }
}

impl Firmware {
    pub(super) fn transition(
        &self,
        qpn: u32,
        op: u16,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), Refused> {
        let cmd = opcode::name(op);
        let min_in = if from_state(op).is_some() {
            qp_cmd::MODIFY_IN_MIN_BYTES
        } else {
            cmd_in::SHORT_BYTES
        };
        need_len(cmd, input, min_in, out, cmd_out::BYTES)?;
        Firmware::check_object(cmd, input, qpn)?;
        let state = self
            .tables()
            .qps
            .get(&qpn)
            .map(|r| r.state)
            .ok_or_else(|| {
                Refused::new(
                    cmd,
                    status::BAD_RESOURCE,
                    syndrome::WRONG_OBJECT,
                    "no such QP",
                )
            })?;
        if let Some(from) = from_state(op) {
            if state != from {
                return Err(Refused::new(
                    cmd,
                    status::BAD_QP_STATE,
                    syndrome::QP_STATE,
                    format!("QP {qpn:#x} is in {state:?}, {cmd} leaves from {from:?}"),
                ));
            }
        }
        match op {
            opcode::RST2INIT_QP => self.rst2init(qpn, &Rst2InitImage::decode(input))?,
            opcode::INIT2RTR_QP => self.init2rtr(qpn, &Init2RtrImage::decode(input))?,
            opcode::RTR2RTS_QP => self.rtr2rts(qpn, &Rtr2RtsImage::decode(input))?,
            opcode::QP_2ERR => {
                self.nic.set_error(qpn).map_err(|e| engine(cmd, e))?;
                self.set_state(qpn, FwQpState::Err);
            }
            _ => {
                self.nic.reset_qp(qpn).map_err(|e| engine(cmd, e))?;
                if let Some(r) = self.tables().qps.get_mut(&qpn) {
                    r.state = FwQpState::Rst;
                    r.access.store(0, Ordering::Release);
                    r.remote_qpn = 0;
                    r.remote_lid = 0;
                }
            }
        }
        out.fill(0);
        tracing::debug!(nic = %self.name, qpn, "firmware: {cmd}");
        Ok(())
    }

    fn set_state(&self, qpn: u32, state: FwQpState) {
        if let Some(r) = self.tables().qps.get_mut(&qpn) {
            r.state = state;
        }
    }

    fn check_port(&self, cmd: &'static str, port: u8, pkey_index: u16) -> Result<(), Refused> {
        if port != 1 {
            return Err(Refused::new(
                cmd,
                status::BAD_PARAM,
                syndrome::NO_SUCH_PORT,
                format!("vhca_port_num {port}: the device has port 1 only"),
            ));
        }
        if pkey_index != 0 {
            return Err(Refused::new(
                cmd,
                status::BAD_PARAM,
                syndrome::PKEY_INDEX,
                format!("pkey_index {pkey_index}: the P_Key table has one entry"),
            ));
        }
        Ok(())
    }

    fn rst2init(&self, qpn: u32, img: &Rst2InitImage) -> Result<(), Refused> {
        const CMD: &str = "RST2INIT_QP";
        self.check_port(CMD, img.port, img.pkey_index)?;
        if img.rae && !self.caps.grants_atomic_mode(u64::from(img.atomic_mode)) {
            return Err(Refused::new(
                CMD,
                status::BAD_PARAM,
                syndrome::ATOMIC_MODE,
                format!(
                    "rae with atomic_mode {}: the device grants operands of up to 8 bytes \
                     (modes 1-3)",
                    img.atomic_mode
                ),
            ));
        }
        let mut t = self.tables();
        let r = t.qps.get_mut(&qpn).expect("checked by the caller");
        r.port = img.port;
        r.pkey_index = img.pkey_index;
        r.atomic_mode = if img.rae { img.atomic_mode } else { 0 };
        r.access.store(img.access().bits(), Ordering::Release);
        r.state = FwQpState::Init;
        Ok(())
    }

    /// The firmware of the port a path names (by LID, or by GID when the path has a GRH and no
    /// LID).
    fn route(&self, rlid: u16, grh: bool, rgid: &[u8; 16]) -> Option<Arc<Firmware>> {
        if rlid != 0 {
            self.subnet.by_lid(rlid)
        } else if grh {
            self.subnet.by_gid(rgid)
        } else {
            None
        }
    }

    fn init2rtr(&self, qpn: u32, img: &Init2RtrImage) -> Result<(), Refused> {
        const CMD: &str = "INIT2RTR_QP";
        let bad = |syn, why: String| Refused::new(CMD, status::BAD_PARAM, syn, why);
        if img.port != 0 {
            self.check_port(CMD, img.port, img.pkey_index)?;
        }
        if img.mtu == 0 || img.mtu > self.caps.max_mtu {
            return Err(bad(
                syndrome::MTU,
                format!(
                    "mtu code {} (the port's largest is {})",
                    img.mtu, self.caps.max_mtu
                ),
            ));
        }
        if img.log_msg_max > self.caps.log_max_msg {
            return Err(bad(
                syndrome::MSG_MAX,
                format!(
                    "log_msg_max {} above log_max_msg {}",
                    img.log_msg_max, self.caps.log_max_msg
                ),
            ));
        }
        if img.log_rra_max > self.caps.log_max_ra_res_qp {
            return Err(bad(
                syndrome::RDMA_ATOMIC_DEPTH,
                format!(
                    "log_rra_max {} above log_max_ra_res_qp {}",
                    img.log_rra_max, self.caps.log_max_ra_res_qp
                ),
            ));
        }
        if img.remote_qpn == 0 {
            return Err(bad(syndrome::REMOTE_QPN_ZERO, "remote_qpn 0".into()));
        }
        // Hardware would accept any path and time out later; the emulator refuses a peer it
        // cannot reach, so a wrong LID or QP number is a clean error, not a hang.
        let peer = self.route(img.rlid, img.grh, &img.rgid).ok_or_else(|| {
            bad(
                syndrome::NO_SUCH_LID,
                format!("rlid {:#x} names no port of the emulated subnet", img.rlid),
            )
        })?;
        if !peer.tables().qps.contains_key(&img.remote_qpn) {
            return Err(bad(
                syndrome::NO_SUCH_REMOTE_QP,
                format!("{} has no QP {:#x}", peer.name, img.remote_qpn),
            ));
        }
        let mut t = self.tables();
        let r = t.qps.get_mut(&qpn).expect("checked by the caller");
        r.mtu = img.mtu;
        r.log_msg_max = img.log_msg_max;
        r.remote_qpn = img.remote_qpn;
        r.remote_lid = peer.lid;
        r.next_rcv_psn = img.next_rcv_psn;
        r.min_rnr_nak = img.min_rnr_nak;
        r.log_rra_max = img.log_rra_max;
        r.state = FwQpState::Rtr;
        Ok(())
    }

    fn rtr2rts(&self, qpn: u32, img: &Rtr2RtsImage) -> Result<(), Refused> {
        const CMD: &str = "RTR2RTS_QP";
        if img.log_sra_max > self.caps.log_max_ra_req_qp {
            return Err(Refused::new(
                CMD,
                status::BAD_PARAM,
                syndrome::RDMA_ATOMIC_DEPTH,
                format!(
                    "log_sra_max {} above log_max_ra_req_qp {}",
                    img.log_sra_max, self.caps.log_max_ra_req_qp
                ),
            ));
        }
        let (remote_lid, remote_qpn) = {
            let t = self.tables();
            let r = t.qps.get(&qpn).expect("checked by the caller");
            (r.remote_lid, r.remote_qpn)
        };
        let gone =
            |why: String| Refused::new(CMD, status::BAD_PARAM, syndrome::NO_SUCH_REMOTE_QP, why);
        let peer = self
            .subnet
            .by_lid(remote_lid)
            .ok_or_else(|| gone(format!("the port of LID {remote_lid:#x} is gone")))?;
        let responder = peer
            .tables()
            .qps
            .get(&remote_qpn)
            .map(|r| r.access.clone())
            .ok_or_else(|| gone(format!("{} has no QP {remote_qpn:#x} any more", peer.name)))?;
        let info = QpInfo {
            node: peer.nic.node(),
            qpn: remote_qpn,
            exports: Vec::new(),
        };
        self.nic
            .connect_with_access(qpn, &info, Some(responder))
            .map_err(|e| engine(CMD, e))?;
        let mut t = self.tables();
        let r = t.qps.get_mut(&qpn).expect("checked by the caller");
        r.next_send_psn = img.next_send_psn;
        r.log_sra_max = img.log_sra_max;
        r.retry_count = img.retry_count;
        r.rnr_retry = img.rnr_retry;
        r.ack_timeout = img.ack_timeout;
        r.state = FwQpState::Rts;
        Ok(())
    }
}

fn engine(cmd: &'static str, e: crate::error::EmuError) -> Refused {
    Refused::new(
        cmd,
        status::BAD_PARAM,
        syndrome::ENGINE,
        format!("the engine refused: {e}"),
    )
}
