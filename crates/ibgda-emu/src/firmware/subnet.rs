//! The emulated subnet: the ports of every emulated device, by LID and GID, so that an
//! `INIT2RTR_QP` path naming a peer's LID reaches that peer's firmware.

use std::sync::{Arc, Mutex, Weak};

use super::caps::EmuCaps;
use super::driver::EmuDevice;
use super::objects::Firmware;
use crate::error::EmuError;
use crate::fabric::Fabric;
use crate::nic::{Nic, NicConfig};

/// The subnet prefix of the emulated ports' GIDs (link-local).
const GID_PREFIX: [u8; 8] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0];

/// A port of the subnet.
#[derive(Debug)]
struct Port {
    lid: u16,
    gid: [u8; 16],
    firmware: Weak<Firmware>,
}

#[derive(Debug, Default)]
pub(crate) struct SubnetInner {
    fabric: Fabric,
    ports: Mutex<Vec<Port>>,
}

impl SubnetInner {
    pub(crate) fn by_lid(&self, lid: u16) -> Option<Arc<Firmware>> {
        let ports = self.ports.lock().expect("subnet lock");
        ports
            .iter()
            .find(|p| p.lid == lid)
            .and_then(|p| p.firmware.upgrade())
    }

    pub(crate) fn by_gid(&self, gid: &[u8; 16]) -> Option<Arc<Firmware>> {
        let ports = self.ports.lock().expect("subnet lock");
        ports
            .iter()
            .find(|p| &p.gid == gid)
            .and_then(|p| p.firmware.upgrade())
    }
}

/// The GID of the port with node GUID `guid`.
pub(crate) fn port_gid(guid: u64) -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[..8].copy_from_slice(&GID_PREFIX);
    gid[8..].copy_from_slice(&guid.to_be_bytes());
    gid
}

/// A set of emulated mlx5 devices on one InfiniBand subnet, each answering the PRM firmware
/// commands of `ibgda-verbs` through the [`Driver`](ibgda_verbs::Driver) seam.
///
/// ```
/// use ibgda_emu::firmware::EmuSubnet;
/// let subnet = EmuSubnet::new();
/// let dev = subnet.open_host("emu_0")?;
/// let ctx = ibgda_verbs::Context::with_driver(dev.clone());
/// assert_eq!(ctx.port(1)?.lid, dev.lid());
/// assert!(ctx.general_caps().is_some_and(|g| g.rc));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct EmuSubnet {
    inner: Arc<SubnetInner>,
}

impl EmuSubnet {
    /// An empty subnet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The fabric whose NICs carry the devices' traffic.
    pub fn fabric(&self) -> &Fabric {
        &self.inner.fabric
    }

    /// A device named `name` on the host backend (CI), with a progress thread.
    pub fn open_host(&self, name: &str) -> Result<EmuDevice, EmuError> {
        self.open_with(name, NicConfig::named(name), EmuCaps::default())
    }

    /// A device on the host backend with the given NIC configuration and capabilities.
    pub fn open_with(
        &self,
        name: &str,
        cfg: NicConfig,
        caps: EmuCaps,
    ) -> Result<EmuDevice, EmuError> {
        let nic = self.inner.fabric.host_nic(cfg)?;
        Ok(self.attach(name, nic, caps))
    }

    /// A device on the CUDA backend of `ctx`'s GPU: rings, CQs and registrations may be GPU
    /// memory, UAR pages are pinned host memory mapped for every GPU.
    pub fn open_cuda(
        &self,
        name: &str,
        ctx: &Arc<cudarc::driver::CudaContext>,
        caps: EmuCaps,
    ) -> Result<EmuDevice, EmuError> {
        let nic = self.inner.fabric.cuda_nic(ctx, NicConfig::named(name))?;
        Ok(self.attach(name, nic, caps))
    }

    /// A device over an existing NIC of this subnet's [`fabric`](EmuSubnet::fabric) (a CUDA
    /// NIC, for example).
    pub fn attach(&self, name: &str, nic: Nic, caps: EmuCaps) -> EmuDevice {
        let mut ports = self.inner.ports.lock().expect("subnet lock");
        ports.retain(|p| p.firmware.strong_count() > 0);
        let lid = (1..=u16::MAX)
            .find(|l| ports.iter().all(|p| p.lid != *l))
            .expect("fewer than 65535 emulated ports");
        let guid = 0x02c9_ee00_0000_0000 | u64::from(lid);
        let fw = Arc::new(Firmware::new(
            name.to_string(),
            nic,
            caps,
            lid,
            guid,
            self.inner.clone(),
        ));
        ports.push(Port {
            lid,
            gid: port_gid(guid),
            firmware: Arc::downgrade(&fw),
        });
        EmuDevice::new(fw)
    }
}
