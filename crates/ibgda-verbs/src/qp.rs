//! RC queue pairs with their work queue and doorbell record in caller-provided memory, and the
//! connection bring-up RST → INIT → RTR → RTS as a typestate.
//!
//! ```no_run
//! # use ibgda_verbs::*;
//! # fn connect(qp: Qp<Reset>, ctx: &Context, port: &PortInfo, remote: &ConnectInfo) -> Result<Qp<Rts>> {
//! let psn = random_psn();
//! let qp = qp.init(&InitAttrs::new(ctx, port.port))?;
//! let qp = qp.rtr(remote, &RtrAttrs::for_port(port, None)?)?;
//! let qp = qp.rts(&RtsAttrs::new(psn))?;
//! # Ok(qp)
//! # }
//! ```
//!
//! ```compile_fail
//! // A QP in RESET cannot be moved to RTS: only `init` exists on `Qp<Reset>`.
//! fn skip(qp: ibgda_verbs::Qp<ibgda_verbs::Reset>, a: &ibgda_verbs::RtsAttrs) {
//!     let _ = qp.rts(a);
//! }
//! ```

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::marker::PhantomData;
use std::sync::Arc;

use crate::cq::Cq;
use crate::device::{GidEntry, LinkLayer, PortInfo};
use crate::devx::DevxObj;
use crate::driver::AhRoute;
use crate::error::{Result, VerbsError};
use crate::pd::ProtectionDomain;
use crate::prm::{
    parse_create_qp_out, parse_modify_qp_out, parse_query_qp_out, AddressPath, CreateQp, Grh,
    Init2Rtr, Mtu, QpContext, QueryQp, RemoteAccess, RqSpec, Rst2Init, Rtr2Rts, TsFormat,
};
use crate::uar::Uar;
use crate::umem::UmemAt;

/// Bytes per send WQE basic block.
pub const WQEBB_SIZE: u64 = ibgda_device::wire::WQEBB_BYTES as u64;

/// Bytes of a QP doorbell record (receive counter at 0, send counter at 4; big-endian u32).
pub const QP_DBR_SIZE: u64 = 8;

mod sealed {
    pub trait Sealed {}
}

/// A QP state in the connection typestate.
pub trait QpState: sealed::Sealed {
    /// The state's name, for messages.
    const NAME: &'static str;
}

macro_rules! qp_state {
    ($(#[$doc:meta])* $name:ident, $text:literal) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl QpState for $name {
            const NAME: &'static str = $text;
        }
    };
}

qp_state!(
    /// Just created: no port, no peer.
    Reset,
    "RESET"
);
qp_state!(
    /// Bound to a port with its access rights.
    Init,
    "INIT"
);
qp_state!(
    /// Ready to receive from its peer.
    Rtr,
    "RTR"
);
qp_state!(
    /// Ready to send: connected.
    Rts,
    "RTS"
);

/// How to build a [`Qp`].
#[derive(Clone, Debug)]
pub struct QpBuilder {
    pd: Arc<ProtectionDomain>,
    uar: Arc<Uar>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    wq: UmemAt,
    dbr: UmemAt,
    log_sq_size: u8,
    rq: RqSpec,
    log_page_size: u8,
    ts_format: Option<TsFormat>,
}

impl QpBuilder {
    /// An RC QP in `pd` ringing through `uar`, completing to `send_cq`/`recv_cq`, with
    /// 2^`log_sq_size` send WQEBBs in the work queue at `wq` (4 KiB aligned; a receive queue, if
    /// any, comes first) and its 8-byte doorbell record at `dbr`. No receive queue by default.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        uar: &Arc<Uar>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        wq: UmemAt,
        dbr: UmemAt,
        log_sq_size: u8,
    ) -> Self {
        Self {
            pd: pd.clone(),
            uar: uar.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            wq,
            dbr,
            log_sq_size,
            rq: RqSpec::None,
            log_page_size: 0,
            ts_format: None,
        }
    }

    /// The receive queue.
    pub fn rq(mut self, rq: RqSpec) -> Self {
        self.rq = rq;
        self
    }

    /// log2 of the ring's page size in 4 KiB units (default 0).
    pub fn log_page_size(mut self, log: u8) -> Self {
        self.log_page_size = log;
        self
    }

    /// The timestamp format (default: what the device's capabilities require).
    pub fn ts_format(mut self, ts: TsFormat) -> Self {
        self.ts_format = Some(ts);
        self
    }

    /// Bytes the work queue needs (receive queue, then send queue).
    pub fn wq_bytes(&self) -> u64 {
        self.rq.bytes() + (WQEBB_SIZE << self.log_sq_size)
    }

    fn validate(&self) -> Result<()> {
        let ctx = self.pd.context();
        if let Some(g) = ctx.general_caps() {
            if self.log_sq_size > g.log_max_qp_sz {
                return Err(VerbsError::Invalid(format!(
                    "log_sq_size {} exceeds the device's log_max_qp_sz {}",
                    self.log_sq_size, g.log_max_qp_sz
                )));
            }
            if !g.rc {
                return Err(VerbsError::Invalid(
                    "the device does not support RC (cmd_hca_cap.rc = 0)".into(),
                ));
            }
        }
        let page = 4096u64 << self.log_page_size;
        self.wq.check("work queue", self.wq_bytes(), page)?;
        self.dbr
            .check("QP doorbell record", QP_DBR_SIZE, QP_DBR_SIZE)?;
        Ok(())
    }

    /// Creates the QP in RESET (`CREATE_QP` through DEVX).
    pub fn create(self) -> Result<Qp<Reset>> {
        self.validate()?;
        let ctx = self.pd.context().clone();
        let ts = self.ts_format.unwrap_or_else(|| {
            ctx.general_caps()
                .map(|g| g.qp_ts_format())
                .unwrap_or_default()
        });
        let cmd = CreateQp::new(
            self.pd.pdn()?,
            self.uar.page_id(),
            self.send_cq.cqn(),
            self.recv_cq.cqn(),
            self.log_sq_size,
            self.wq.prm(),
            self.dbr.prm(),
        )
        .rq(self.rq)
        .log_page_size(self.log_page_size)
        .ts_format(ts)
        .build()?;
        let (obj, out) = DevxObj::create(&ctx, "CREATE_QP", &cmd, CreateQp::OUT_LEN)?;
        let qpn = parse_create_qp_out(&out).map_err(|f| VerbsError::firmware(f, 0))?;
        tracing::debug!(device = %ctx.name(), qpn, "created RC QP");
        Ok(Qp {
            inner: Box::new(QpInner {
                obj,
                qpn,
                port: 0,
                pd: self.pd,
                uar: self.uar,
                send_cq: self.send_cq,
                recv_cq: self.recv_cq,
                wq: self.wq,
                dbr: self.dbr,
                log_sq_size: self.log_sq_size,
                rq: self.rq,
            }),
            _state: PhantomData,
        })
    }
}

struct QpInner {
    // Declared first: destroyed before the CQs, UAR and umems it references.
    obj: DevxObj,
    qpn: u32,
    port: u8,
    pd: Arc<ProtectionDomain>,
    uar: Arc<Uar>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    wq: UmemAt,
    dbr: UmemAt,
    log_sq_size: u8,
    rq: RqSpec,
}

/// An RC queue pair in state `S`. Holds its PD, UAR, CQs and umems.
pub struct Qp<S: QpState> {
    // Boxed so moving the QP between states (and through errors) moves one pointer.
    inner: Box<QpInner>,
    _state: PhantomData<S>,
}

impl<S: QpState> fmt::Debug for Qp<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.inner.qpn)
            .field("state", &S::NAME)
            .finish()
    }
}

/// A transition that firmware refused. The QP is handed back in its previous state.
pub struct TransitionError<S: QpState> {
    /// Why.
    pub error: VerbsError,
    /// The QP, still in state `S`.
    pub qp: Qp<S>,
}

impl<S: QpState> fmt::Debug for TransitionError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionError")
            .field("error", &self.error)
            .field("qp", &self.qp)
            .finish()
    }
}

impl<S: QpState> fmt::Display for TransitionError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "QP {:#x} could not leave {}: {}",
            self.qp.inner.qpn,
            S::NAME,
            self.error
        )
    }
}

impl<S: QpState> std::error::Error for TransitionError<S> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<S: QpState> From<TransitionError<S>> for VerbsError {
    fn from(e: TransitionError<S>) -> Self {
        e.error
    }
}

impl<S: QpState> Qp<S> {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// The state's name.
    pub fn state(&self) -> &'static str {
        S::NAME
    }

    /// The local port (0 before INIT).
    pub fn port(&self) -> u8 {
        self.inner.port
    }

    /// Number of send WQEBBs (a power of two).
    pub fn sq_wqebbs(&self) -> u32 {
        1 << self.inner.log_sq_size
    }

    /// Where the send queue starts (after the receive queue, if any).
    pub fn sq(&self) -> UmemAt {
        UmemAt {
            umem: self.inner.wq.umem.clone(),
            offset: self.inner.wq.offset + self.inner.rq.bytes(),
        }
    }

    /// Where the work queue (receive queue, then send queue) starts.
    pub fn wq(&self) -> &UmemAt {
        &self.inner.wq
    }

    /// Where the doorbell record is.
    pub fn doorbell_record(&self) -> &UmemAt {
        &self.inner.dbr
    }

    /// The UAR the QP rings through.
    pub fn uar(&self) -> &Arc<Uar> {
        &self.inner.uar
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<Cq> {
        &self.inner.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<Cq> {
        &self.inner.recv_cq
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.inner.pd
    }

    /// The QP's context as firmware holds it (`QUERY_QP`): state, peer, PSNs, MTU, rights, and
    /// how far the NIC has read the send queue.
    pub fn query(&self) -> Result<QpContext> {
        let out = self.inner.obj.query(
            "QUERY_QP",
            &QueryQp::new(self.inner.qpn).build(),
            QueryQp::OUT_LEN,
        )?;
        parse_query_qp_out(&out).map_err(|f| VerbsError::firmware(f, 0))
    }

    /// What to tell the peer so it can connect to this QP.
    pub fn connect_info(&self, port: &PortInfo, gid: Option<&GidEntry>, psn: u32) -> ConnectInfo {
        ConnectInfo {
            qpn: self.inner.qpn,
            psn: psn & 0xff_ffff,
            lid: port.lid,
            gid: gid.map(|g| g.gid).unwrap_or([0; 16]),
        }
    }

    fn step<N: QpState>(
        self,
        command: &'static str,
        image: Result<Vec<u8>>,
    ) -> Result<Qp<N>, TransitionError<S>> {
        let result = image
            .and_then(|img| self.inner.obj.modify(command, &img, Rst2Init::OUT_LEN))
            .and_then(|out| {
                parse_modify_qp_out(command, &out).map_err(|f| VerbsError::firmware(f, 0))
            });
        match result {
            Ok(()) => {
                tracing::debug!(qpn = self.inner.qpn, "{} -> {}", S::NAME, N::NAME);
                Ok(Qp {
                    inner: self.inner,
                    _state: PhantomData,
                })
            }
            Err(error) => Err(TransitionError { error, qp: self }),
        }
    }
}

/// Attributes of RST → INIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitAttrs {
    /// Local port, 1-based.
    pub port: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// What the peer may do.
    pub access: RemoteAccess,
}

impl InitAttrs {
    /// Port `port`, P_Key index 0, remote read and write, and atomics in the best mode the
    /// device reports (none if it reports none or its caps cannot be read).
    pub fn new(ctx: &crate::Context, port: u8) -> Self {
        let atomic = ctx.atomic_caps().ok().and_then(|a| a.qp_atomic_mode());
        Self {
            port,
            pkey_index: 0,
            access: RemoteAccess {
                read: true,
                write: true,
                atomic,
            },
        }
    }
}

impl Qp<Reset> {
    /// RST → INIT.
    pub fn init(self, attrs: &InitAttrs) -> Result<Qp<Init>, TransitionError<Reset>> {
        let img = Rst2Init::new(self.inner.qpn, attrs.port, attrs.access)
            .pkey_index(attrs.pkey_index)
            .build();
        self.step("RST2INIT_QP", img.map_err(VerbsError::from))
            .map(|mut qp: Qp<Init>| {
                qp.inner.port = attrs.port;
                qp
            })
    }
}

/// How the peer is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    /// InfiniBand: by the peer's LID.
    InfiniBand {
        /// Service level.
        sl: u8,
    },
    /// RoCE: by the peer's GID, through an Ethernet next hop.
    Roce {
        /// Local GID index.
        sgid_index: u8,
        /// Hop limit / TTL.
        hop_limit: u8,
        /// Traffic class (DSCP << 2 | ECN).
        traffic_class: u8,
        /// The next hop's MAC; `None` resolves it through an address handle.
        rmac: Option<[u8; 6]>,
    },
}

/// Attributes of INIT → RTR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttrs {
    /// Path MTU.
    pub mtu: Mtu,
    /// How the peer is reached.
    pub path: PathKind,
    /// P_Key index.
    pub pkey_index: u16,
    /// log2 of the largest message (clamped to the device's `log_max_msg`).
    pub log_msg_max: u8,
    /// RNR NAK timer code.
    pub min_rnr_nak: u8,
    /// log2 of outstanding reads/atomics accepted as responder (clamped to the device's limit).
    pub log_rra_max: u8,
}

impl RtrAttrs {
    /// Attributes for `port`: its active MTU, and LID or GID addressing by its link layer
    /// (`gid` is required on RoCE; see [`preferred_roce_gid`](crate::preferred_roce_gid)).
    pub fn for_port(port: &PortInfo, gid: Option<&GidEntry>) -> Result<Self> {
        let mtu = Mtu::from_code(port.active_mtu).unwrap_or(Mtu::Mtu1024);
        let path = match port.link_layer {
            LinkLayer::Ethernet => {
                let gid = gid.ok_or_else(|| {
                    VerbsError::Invalid(format!(
                        "port {} is RoCE: a local GID index is required",
                        port.port
                    ))
                })?;
                let sgid_index = u8::try_from(gid.index).map_err(|_| {
                    VerbsError::Invalid(format!("GID index {} does not fit 8 bits", gid.index))
                })?;
                PathKind::Roce {
                    sgid_index,
                    hop_limit: 64,
                    traffic_class: 0,
                    rmac: None,
                }
            }
            _ => PathKind::InfiniBand { sl: 0 },
        };
        Ok(Self {
            mtu,
            path,
            pkey_index: 0,
            log_msg_max: 30,
            min_rnr_nak: 12,
            log_rra_max: 4,
        })
    }
}

/// A RoCE v2 UDP source port for the pair (`0xC000..=0xFFFF`), spreading pairs across ECMP paths.
pub fn roce_udp_sport(local_qpn: u32, remote_qpn: u32) -> u16 {
    let h = (local_qpn ^ remote_qpn.rotate_left(7)) & 0xff_ffff;
    0xc000 | ((h ^ (h >> 14)) & 0x3fff) as u16
}

/// A random 24-bit packet sequence number.
pub fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    (h.finish() & 0xff_ffff) as u32
}

impl Qp<Init> {
    /// INIT → RTR: points the QP at `remote`. On RoCE without a given MAC, the next hop's MAC is
    /// resolved through an address handle ([`resolve_roce_mac`]).
    pub fn rtr(
        self,
        remote: &ConnectInfo,
        attrs: &RtrAttrs,
    ) -> Result<Qp<Rtr>, TransitionError<Init>> {
        let port = self.inner.port;
        let path = match attrs.path {
            PathKind::InfiniBand { sl } => Ok(AddressPath {
                sl,
                pkey_index: attrs.pkey_index,
                ..AddressPath::infiniband(port, remote.lid)
            }),
            PathKind::Roce {
                sgid_index,
                hop_limit,
                traffic_class,
                rmac,
            } => {
                let mac = match rmac {
                    Some(m) => Ok(m),
                    None => {
                        resolve_roce_mac(&self.inner.pd, port, sgid_index, &remote.gid, hop_limit)
                    }
                };
                mac.map(|mac| {
                    let grh = Grh {
                        rgid: remote.gid,
                        sgid_index,
                        hop_limit,
                        traffic_class,
                        flow_label: 0,
                    };
                    AddressPath {
                        pkey_index: attrs.pkey_index,
                        ..AddressPath::roce(
                            port,
                            grh,
                            mac,
                            roce_udp_sport(self.inner.qpn, remote.qpn),
                        )
                    }
                })
            }
        };
        // Never ask for more than the device allows.
        let caps = self.inner.pd.context().general_caps();
        let log_msg_max = caps.map_or(attrs.log_msg_max, |g| attrs.log_msg_max.min(g.log_max_msg));
        let log_rra_max = caps.map_or(attrs.log_rra_max, |g| {
            attrs.log_rra_max.min(g.log_max_ra_res_qp)
        });
        let img = path.and_then(|path| {
            Init2Rtr::new(self.inner.qpn, remote.qpn, remote.psn, attrs.mtu, path)
                .log_msg_max(log_msg_max)
                .min_rnr_nak(attrs.min_rnr_nak)
                .log_rra_max(log_rra_max)
                .build()
                .map_err(VerbsError::from)
        });
        self.step("INIT2RTR_QP", img)
    }
}

/// Attributes of RTR → RTS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttrs {
    /// First PSN this side sends (the `psn` given to the peer in [`ConnectInfo`]).
    pub psn: u32,
    /// ACK timeout code: 4.096 µs × 2^code.
    pub ack_timeout: u8,
    /// Transport retries.
    pub retry_count: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// log2 of outstanding reads/atomics as requester (clamped to the device's limit).
    pub log_sra_max: u8,
}

impl RtsAttrs {
    /// Send from `psn` with ack timeout 14 (≈ 67 ms), 7 retries, RNR retry forever, 16
    /// outstanding reads/atomics.
    pub fn new(psn: u32) -> Self {
        Self {
            psn,
            ack_timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            log_sra_max: 4,
        }
    }
}

impl Qp<Rtr> {
    /// RTR → RTS: the QP is connected and may send.
    pub fn rts(self, attrs: &RtsAttrs) -> Result<Qp<Rts>, TransitionError<Rtr>> {
        let caps = self.inner.pd.context().general_caps();
        let log_sra_max = caps.map_or(attrs.log_sra_max, |g| {
            attrs.log_sra_max.min(g.log_max_ra_req_qp)
        });
        let img = Rtr2Rts::new(self.inner.qpn, attrs.psn)
            .ack_timeout(attrs.ack_timeout)
            .retry_count(attrs.retry_count)
            .rnr_retry(attrs.rnr_retry)
            .log_sra_max(log_sra_max)
            .build()
            .map_err(VerbsError::from);
        self.step("RTR2RTS_QP", img)
    }
}

/// What one side of an RC connection tells the other (exchanged out of band, e.g. over TCP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectInfo {
    /// The QP number.
    pub qpn: u32,
    /// The first PSN that side sends.
    pub psn: u32,
    /// Its port's LID (InfiniBand).
    pub lid: u16,
    /// Its GID (RoCE), network order.
    pub gid: [u8; 16],
}

impl ConnectInfo {
    /// Size of the wire form.
    pub const WIRE_LEN: usize = 32;
    const MAGIC: [u8; 4] = *b"IBGD";

    /// The wire form: `"IBGD"`, qpn, psn (big-endian u32), lid (u16), 2 zero bytes, gid.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&Self::MAGIC);
        b[4..8].copy_from_slice(&self.qpn.to_be_bytes());
        b[8..12].copy_from_slice(&self.psn.to_be_bytes());
        b[12..14].copy_from_slice(&self.lid.to_be_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    /// Parses the wire form.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != Self::WIRE_LEN || b[0..4] != Self::MAGIC {
            return Err(VerbsError::Invalid(format!(
                "not a {}-byte IBGD connect record",
                Self::WIRE_LEN
            )));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Ok(Self {
            qpn: u32_at(4),
            psn: u32_at(8),
            lid: u16::from_be_bytes([b[12], b[13]]),
            gid,
        })
    }
}

/// Resolves the Ethernet MAC of the next hop towards `dgid` (RoCE) by creating an address handle
/// and reading its mlx5 address vector.
pub fn resolve_roce_mac(
    pd: &Arc<ProtectionDomain>,
    port: u8,
    sgid_index: u8,
    dgid: &[u8; 16],
    hop_limit: u8,
) -> Result<[u8; 6]> {
    let route = AhRoute {
        port,
        sgid_index,
        dgid: *dgid,
        hop_limit,
    };
    pd.context().driver().roce_next_hop_mac(pd.handle(), &route)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{GidType, PortState};

    #[test]
    fn connect_info_round_trips() {
        let c = ConnectInfo {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: core::array::from_fn(|i| i as u8),
        };
        let b = c.to_bytes();
        assert_eq!(&b[0..4], b"IBGD");
        assert_eq!(&b[4..8], &[0x00, 0x12, 0x34, 0x56]);
        assert_eq!(ConnectInfo::from_bytes(&b).unwrap(), c);
        assert!(ConnectInfo::from_bytes(&b[..31]).is_err());
        let mut bad = b;
        bad[0] = b'X';
        assert!(ConnectInfo::from_bytes(&bad).is_err());
    }

    #[test]
    fn udp_sport_stays_in_the_roce_range() {
        for (l, r) in [(0, 0), (0xff_ffff, 1), (0x1234, 0x5678), (7, 0xff_fffe)] {
            let p = roce_udp_sport(l, r);
            assert!(p >= 0xc000, "{p:#x}");
        }
        assert_ne!(roce_udp_sport(1, 2), roce_udp_sport(3, 2));
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..16 {
            assert!(random_psn() <= 0xff_ffff);
        }
    }

    fn port(link_layer: LinkLayer) -> PortInfo {
        PortInfo {
            port: 1,
            state: PortState::Active,
            link_layer,
            lid: 3,
            sm_lid: 1,
            active_mtu: 5,
            max_mtu: 5,
            gid_tbl_len: 16,
            pkey_tbl_len: 128,
            active_width: 0,
            active_speed: 0,
            phys_state: 5,
        }
    }

    #[test]
    fn rtr_attrs_follow_the_link_layer() {
        let ib = RtrAttrs::for_port(&port(LinkLayer::InfiniBand), None).unwrap();
        assert_eq!(ib.path, PathKind::InfiniBand { sl: 0 });
        assert_eq!(ib.mtu, Mtu::Mtu4096);
        let gid = GidEntry {
            index: 3,
            gid: [0; 16],
            kind: GidType::RoceV2,
        };
        let roce = RtrAttrs::for_port(&port(LinkLayer::Ethernet), Some(&gid)).unwrap();
        assert!(matches!(
            roce.path,
            PathKind::Roce {
                sgid_index: 3,
                rmac: None,
                ..
            }
        ));
        assert!(
            RtrAttrs::for_port(&port(LinkLayer::Ethernet), None).is_err(),
            "RoCE needs a GID"
        );
    }
}
