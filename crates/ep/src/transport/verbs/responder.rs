//! The responder QPs a peer's verbs QPs connect to: created at RST, brought to RTS once the
//! peer's connection info arrives.

use std::sync::{Arc, Mutex};

use ibgda_verbs::{Context, InitAttrs, PortInfo, Qp, Reset, Rts, RtsAttrs, VerbsError};

use crate::transport::backend::{ConnInfo, Responder};
use crate::transport::error::TransportError;

use super::address::{LocalAddress, VerbsConnInfo};
use super::memory::Block;
use super::transport::rtr_attrs;

/// What a responder needs of its transport to go to RTS.
pub(super) struct ResponderCtx {
    pub(super) ctx: Arc<Context>,
    pub(super) port_num: u8,
    pub(super) port: PortInfo,
    pub(super) address: LocalAddress,
}

pub(super) enum Stage {
    Reset(Qp<Reset>, u32),
    Rts(Qp<Rts>),
    Gone,
}

/// Responder QPs of a [`VerbsTransport`].
pub(super) struct VerbsResponder {
    pub(super) rank: u32,
    pub(super) peer_rank: u32,
    pub(super) qps: Mutex<Vec<Stage>>,
    pub(super) transport: ResponderCtx,
    /// Rings, CQs and doorbell records of the QPs (dropped after them).
    pub(super) _block: Block,
}

impl std::fmt::Debug for VerbsResponder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        let qpns: Vec<String> = qps
            .iter()
            .map(|s| match s {
                Stage::Reset(qp, _) => format!("{:#x} (reset)", qp.qpn()),
                Stage::Rts(qp) => format!("{:#x}", qp.qpn()),
                Stage::Gone => "gone".into(),
            })
            .collect();
        f.debug_struct("VerbsResponder")
            .field("rank", &self.rank)
            .field("peer_rank", &self.peer_rank)
            .field("qpns", &qpns)
            .finish_non_exhaustive()
    }
}

pub(super) fn parse_infos(remote: &[ConnInfo]) -> Result<Vec<VerbsConnInfo>, TransportError> {
    remote
        .iter()
        .enumerate()
        .map(|(i, c)| {
            VerbsConnInfo::from_bytes(&c.0).map_err(|why| {
                TransportError::Config(format!("reading a peer's connection info {i}: {why}"))
            })
        })
        .collect()
}

impl Responder for VerbsResponder {
    fn accept(&self, initiators: &[ConnInfo]) -> Result<(), TransportError> {
        let infos = parse_infos(initiators)?;
        let t = &self.transport;
        let mut qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        if infos.len() != qps.len() {
            return Err(TransportError::Config(format!(
                "rank {}: {} QP infos from rank {} for {} responder QPs",
                self.rank,
                infos.len(),
                self.peer_rank,
                qps.len()
            )));
        }
        for (stage, peer) in qps.iter_mut().zip(&infos) {
            let Stage::Reset(qp, psn) = std::mem::replace(stage, Stage::Gone) else {
                return Err(TransportError::Config(
                    "a responder QP was accepted twice".into(),
                ));
            };
            let step = |doing: &'static str| {
                move |e: VerbsError| TransportError::Verbs { doing, source: e }
            };
            let qp = qp
                .init(&InitAttrs::new(&t.ctx, t.port_num))
                .map_err(|e| step("responder RST→INIT")(e.into()))?;
            let attrs = rtr_attrs(&t.port, &t.address, peer)?;
            let qp = qp
                .rtr(&peer.qp, &attrs)
                .map_err(|e| step("responder INIT→RTR")(e.into()))?;
            let qp = qp
                .rts(&RtsAttrs::new(psn))
                .map_err(|e| step("responder RTR→RTS")(e.into()))?;
            *stage = Stage::Rts(qp);
        }
        Ok(())
    }

    fn close(self: Box<Self>) -> Result<(), TransportError> {
        // The QPs' firmware objects are destroyed as they drop, before their rings.
        let mut qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        qps.clear();
        Ok(())
    }
}
