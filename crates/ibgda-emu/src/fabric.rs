//! The fabric: the NICs of several ranks in one process, and how a QP finds its peer's
//! registrations. Peers in other processes are described by the registrations they export.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::CudaContext;

use crate::backend::MemoryBackend;
use crate::cuda::CudaMemory;
use crate::error::EmuError;
use crate::host::HostMemory;
use crate::ipc::MrExport;
use crate::nic::{Nic, NicConfig, NicShared};

/// A NIC's address on the fabric (like a GID): the process id in the high 32 bits, the NIC's
/// index in that process in the low 32, so ids differ across the processes of a host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

/// What one side of a connection tells the other: its node, its QP number and, for a peer in
/// another process, the registrations it exports (CUDA IPC handles). Sent as bytes with
/// [`to_bytes`](QpInfo::to_bytes) / [`from_bytes`](QpInfo::from_bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// The peer NIC.
    pub node: NodeId,
    /// The peer QP.
    pub qpn: u32,
    /// Exported registrations (empty within a process).
    pub exports: Vec<MrExport>,
}

const QPINFO_MAGIC: &[u8; 8] = b"IBEMUQP1";

impl QpInfo {
    /// The wire form (little-endian, versioned by a magic).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(24 + self.exports.len() * MrExport::BYTES);
        v.extend_from_slice(QPINFO_MAGIC);
        v.extend_from_slice(&self.node.0.to_le_bytes());
        v.extend_from_slice(&self.qpn.to_le_bytes());
        v.extend_from_slice(&(self.exports.len() as u32).to_le_bytes());
        for e in &self.exports {
            e.write(&mut v);
        }
        v
    }

    /// Parses [`to_bytes`](QpInfo::to_bytes)' output.
    pub fn from_bytes(b: &[u8]) -> Result<Self, EmuError> {
        let bad = |why: &str| EmuError::BadPeerInfo(why.to_string());
        if b.len() < 24 || &b[..8] != QPINFO_MAGIC {
            return Err(bad("no QpInfo header"));
        }
        let node = NodeId(u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")));
        let qpn = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes"));
        let n = u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")) as usize;
        let rest = &b[24..];
        if rest.len() != n * MrExport::BYTES {
            return Err(bad("registration list length does not match its count"));
        }
        let exports = rest
            .chunks_exact(MrExport::BYTES)
            .map(MrExport::read)
            .collect::<Result<_, _>>()?;
        Ok(Self { node, qpn, exports })
    }

    /// The wire form as lowercase hex (for text channels).
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`to_hex`](QpInfo::to_hex)' output.
    pub fn from_hex(s: &str) -> Result<Self, EmuError> {
        let s = s.trim();
        if s.len() % 2 != 0 {
            return Err(EmuError::BadPeerInfo("odd number of hex digits".into()));
        }
        let bytes = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|e| EmuError::BadPeerInfo(format!("bad hex: {e}")))?;
        Self::from_bytes(&bytes)
    }
}

#[derive(Default)]
pub(crate) struct FabricInner {
    nics: Mutex<HashMap<NodeId, Weak<NicShared>>>,
    next_index: AtomicU32,
}

impl FabricInner {
    pub fn lookup(this: &Arc<Self>, node: NodeId) -> Option<Arc<NicShared>> {
        this.nics
            .lock()
            .expect("fabric lock")
            .get(&node)
            .and_then(Weak::upgrade)
    }

    pub fn remove(&self, node: NodeId) {
        self.nics.lock().expect("fabric lock").remove(&node);
    }
}

/// The NICs of one process (one per rank, or several per GPU), wired together: a QP connected
/// to a NIC of the same fabric reaches its registrations directly.
///
/// ```
/// let fabric = ibgda_emu::Fabric::new();
/// let nics: Vec<_> = (0..4)
///     .map(|r| fabric.host_nic(ibgda_emu::NicConfig::named(format!("rank{r}"))))
///     .collect::<Result<_, _>>()?;
/// assert_ne!(nics[0].node(), nics[1].node());
/// # Ok::<(), ibgda_emu::EmuError>(())
/// ```
#[derive(Clone, Default)]
pub struct Fabric {
    inner: Arc<FabricInner>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.inner.nics.lock().map(|m| m.len()).unwrap_or(0);
        write!(f, "Fabric({n} NICs)")
    }
}

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// A NIC over any backend.
    pub fn nic_with_backend(
        &self,
        backend: Arc<dyn MemoryBackend>,
        ctx: Option<Arc<CudaContext>>,
        cfg: NicConfig,
    ) -> Result<Nic, EmuError> {
        let index = self.inner.next_index.fetch_add(1, Ordering::Relaxed);
        let node = NodeId(((std::process::id() as u64) << 32) | index as u64);
        let nic = Nic::start(node, index, cfg, backend, ctx, Arc::downgrade(&self.inner))?;
        self.inner
            .nics
            .lock()
            .expect("fabric lock")
            .insert(node, Arc::downgrade(&nic.shared));
        Ok(nic)
    }

    /// A NIC on the host backend (CI).
    pub fn host_nic(&self, cfg: NicConfig) -> Result<Nic, EmuError> {
        self.nic_with_backend(Arc::new(HostMemory), None, cfg)
    }

    /// A NIC on the CUDA backend, moving data with `ctx`'s GPU's copy engines.
    pub fn cuda_nic(&self, ctx: &Arc<CudaContext>, cfg: NicConfig) -> Result<Nic, EmuError> {
        let backend = Arc::new(CudaMemory::new(ctx)?);
        self.nic_with_backend(backend, Some(ctx.clone()), cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr::{Access, Mr, Place};

    #[test]
    fn qp_info_round_trips() {
        let info = QpInfo {
            node: NodeId(0x1234_0000_0002),
            qpn: 0x20005,
            exports: vec![MrExport {
                mr: Mr {
                    lkey: 5,
                    rkey: 5,
                    addr: 0x7f00_0000_1000,
                    len: 4096,
                    access: Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
                    place: Place::Device,
                },
                alloc_base: 0x7f00_0000_0000,
                handle: [7; 64],
            }],
        };
        assert_eq!(QpInfo::from_bytes(&info.to_bytes()).unwrap(), info);
        assert_eq!(QpInfo::from_hex(&info.to_hex()).unwrap(), info);
        assert!(QpInfo::from_bytes(b"garbage").is_err());
        let mut b = info.to_bytes();
        b.pop();
        assert!(QpInfo::from_bytes(&b).is_err());
    }
}
