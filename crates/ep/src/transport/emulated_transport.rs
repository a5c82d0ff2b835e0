//! [`RankTransport`] on the emulated NIC: [`EmuRank`]'s QP groups behind the transport
//! interface. Connection info is the emulator's [`QpInfo`] as bytes; for ranks as processes it
//! carries the rank's registrations of GPU memory as CUDA IPC handles, which the peer's NIC
//! opens.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use ibgda_device::protocol::{HandlerProbe, HostQp};
use ibgda_device::proxy::ProxyReport;
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::{Fabric, QpInfo};

use super::backend::{ConnInfo, QpSet, RankTransport, Registration, Responder};
use super::emulated::{Arena, EmuRank, PassiveQps, QpGroup, QpGroupConfig};
use super::error::TransportError;
use super::nic::NicKind;

/// The fabric of this process's emulated NICs for ranks as processes. One per process, so NIC
/// ids stay unique when several ranks share a process over TCP (such peers are then found
/// through the fabric, those in other processes through the memory they export).
fn process_fabric() -> &'static Fabric {
    static FABRIC: OnceLock<Fabric> = OnceLock::new();
    FABRIC.get_or_init(Fabric::new)
}

/// One rank's emulated NIC behind the transport interface.
#[derive(Debug)]
pub struct EmulatedTransport {
    emu: EmuRank,
    /// Whether connection info exports this NIC's registrations (peers in other processes).
    export: bool,
    /// The fabric the NIC is on, kept for as long as the NIC.
    _fabric: Fabric,
}

impl EmulatedTransport {
    /// Rank `rank`'s NIC for ranks that are threads of this process, on `fabric` (every rank's
    /// on the same one), on the CUDA backend of `ctx`'s GPU.
    pub fn threads(
        fabric: &Fabric,
        ctx: &Arc<CudaContext>,
        rank: u32,
    ) -> Result<Self, TransportError> {
        Ok(Self {
            emu: EmuRank::cuda(fabric, ctx, rank)?,
            export: false,
            _fabric: fabric.clone(),
        })
    }

    /// This process's NIC for rank `rank`, whose peers are other processes (or ranks of this
    /// process that connect the same way): on this process's fabric, its registrations exported
    /// to the peers as CUDA IPC handles.
    pub fn process(ctx: &Arc<CudaContext>, rank: u32) -> Result<Self, TransportError> {
        let fabric = process_fabric();
        Ok(Self {
            emu: EmuRank::cuda(fabric, ctx, rank)?,
            export: true,
            _fabric: fabric.clone(),
        })
    }

    /// Rank `rank`'s NIC on the host backend (no GPU: host threads submit; CI), on `fabric`.
    pub fn host(fabric: &Fabric, rank: u32) -> Result<Self, TransportError> {
        Ok(Self {
            emu: EmuRank::host(fabric, rank)?,
            export: false,
            _fabric: fabric.clone(),
        })
    }

    /// The emulated NIC itself.
    pub fn emu(&self) -> &EmuRank {
        &self.emu
    }
}

fn to_infos(remote: &[ConnInfo]) -> Result<Vec<QpInfo>, TransportError> {
    remote
        .iter()
        .map(|c| QpInfo::from_bytes(&c.0).map_err(TransportError::from))
        .collect()
}

fn to_conn(infos: Vec<QpInfo>) -> Vec<ConnInfo> {
    infos.iter().map(|i| ConnInfo(i.to_bytes())).collect()
}

impl RankTransport for EmulatedTransport {
    fn nic(&self) -> NicKind {
        NicKind::Emulated
    }

    fn rank(&self) -> u32 {
        self.emu.rank()
    }

    fn probe(&self) -> HandlerProbe {
        self.emu.probe()
    }

    fn emulated_nic(&self) -> Option<&ibgda_emu::Nic> {
        Some(self.emu.nic())
    }

    fn register(&self, bytes: usize) -> Result<Box<dyn Registration>, TransportError> {
        Ok(Box::new(self.emu.arena(bytes)?))
    }

    fn respond(
        &self,
        peer_rank: u32,
        nqps: u32,
    ) -> Result<(Vec<ConnInfo>, Box<dyn Responder>), TransportError> {
        let passive = self.emu.passive(peer_rank, nqps)?;
        let infos = passive.infos(self.export)?;
        Ok((to_conn(infos), Box::new(passive)))
    }

    fn connect(
        &self,
        remote: &[ConnInfo],
        local: &dyn Registration,
        cfg: &QpGroupConfig,
    ) -> Result<Box<dyn QpSet>, TransportError> {
        let group = QpGroup::build(&self.emu, &to_infos(remote)?, local, cfg)?;
        Ok(Box::new(EmuQpSet {
            group,
            export: self.export,
        }))
    }
}

impl Registration for Arena {
    fn addr(&self) -> u64 {
        Arena::addr(self)
    }

    fn len(&self) -> usize {
        Arena::len(self)
    }

    fn lkey(&self) -> u32 {
        self.mr().lkey
    }

    fn rkey(&self) -> u32 {
        self.mr().rkey
    }

    fn scratch(&self) -> u64 {
        Arena::scratch(self)
    }

    fn device(&self) -> Option<&Arc<ibgda_device::cuda::DeviceBuffer>> {
        Arena::device(self)
    }

    fn host(&self) -> Option<&Arc<ibgda_emu::HostBuffer>> {
        Arena::host(self)
    }
}

/// A [`QpGroup`] and whether its connection info exports registrations.
#[derive(Debug)]
struct EmuQpSet {
    group: QpGroup,
    export: bool,
}

impl QpSet for EmuQpSet {
    fn mode(&self) -> NicHandler {
        self.group.mode()
    }

    fn len(&self) -> usize {
        self.group.len()
    }

    fn descs(&self) -> Option<u64> {
        self.group.descs()
    }

    fn host_qps(&self) -> &[HostQp] {
        self.group.host_qps()
    }

    fn conn_infos(&self) -> Result<Vec<ConnInfo>, TransportError> {
        Ok(to_conn(self.group.infos(self.export)?))
    }

    fn check(&self) -> Result<(), TransportError> {
        self.group.check()
    }

    fn qpns(&self) -> Vec<u32> {
        (0..self.group.len()).map(|i| self.group.qpn(i)).collect()
    }

    fn shutdown(self: Box<Self>) -> Result<Option<ProxyReport>, TransportError> {
        self.group.shutdown()
    }
}

impl Responder for PassiveQps {
    fn accept(&self, initiators: &[ConnInfo]) -> Result<(), TransportError> {
        PassiveQps::accept(self, &to_infos(initiators)?)
    }

    fn close(self: Box<Self>) -> Result<(), TransportError> {
        PassiveQps::close(*self)
    }
}
