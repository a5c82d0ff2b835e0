//! Peers in another process: registrations of GPU memory are exported as CUDA IPC handles and
//! opened by the importing NIC at connect, so its copies reach the peer's memory directly.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::error::EmuError;
use crate::fabric::QpInfo;
use crate::mr::{Access, Mr, Place, Region, Registry};
use crate::nic::{Nic, NicShared};

/// A registration of GPU memory as another process needs it: the registration itself (its
/// addresses are the exporter's), the base of the `cuMemAlloc` allocation holding it and that
/// allocation's IPC handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MrExport {
    /// The registration (exporter's addresses).
    pub mr: Mr,
    /// Base address, in the exporter, of the allocation the handle opens.
    pub alloc_base: u64,
    /// `cuIpcGetMemHandle` of that allocation.
    pub handle: [u8; 64],
}

impl MrExport {
    /// Bytes of the wire form.
    pub const BYTES: usize = 4 + 4 + 8 + 8 + 8 + 64;

    pub(crate) fn write(&self, v: &mut Vec<u8>) {
        v.extend_from_slice(&self.mr.rkey.to_le_bytes());
        v.extend_from_slice(&self.mr.access.bits().to_le_bytes());
        v.extend_from_slice(&self.mr.addr.to_le_bytes());
        v.extend_from_slice(&self.mr.len.to_le_bytes());
        v.extend_from_slice(&self.alloc_base.to_le_bytes());
        v.extend_from_slice(&self.handle);
    }

    pub(crate) fn read(b: &[u8]) -> Result<Self, EmuError> {
        if b.len() != Self::BYTES {
            return Err(EmuError::BadPeerInfo("short registration record".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let rkey = u32_at(0);
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[32..96]);
        Ok(Self {
            mr: Mr {
                lkey: rkey,
                rkey,
                addr: u64_at(8),
                len: u64_at(16),
                access: Access::from_bits(u32_at(4)),
                place: Place::Device,
            },
            alloc_base: u64_at(24),
            handle,
        })
    }
}

/// An opened IPC handle, closed on drop.
#[derive(Debug)]
pub(crate) struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: u64,
    /// Bytes mapped from `ptr` (the whole exported allocation).
    len: u64,
}

/// Where registration `e` starts in the mapping of its allocation (`map_len` bytes from
/// `e.alloc_base`): the registration must lie wholly inside it, or the emulator would read and
/// write memory that is not the peer's (a forged or corrupt export).
pub(crate) fn import_offset(e: &MrExport, map_len: u64) -> Result<u64, EmuError> {
    let bad = |why: String| {
        EmuError::BadPeerInfo(format!(
            "registration rkey {:#x} at {:#x} (+{} bytes) {why} (allocation base {:#x}, {map_len} \
             bytes mapped)",
            e.mr.rkey, e.mr.addr, e.mr.len, e.alloc_base
        ))
    };
    let offset =
        e.mr.addr
            .checked_sub(e.alloc_base)
            .ok_or_else(|| bad("starts below its allocation".into()))?;
    let end = offset
        .checked_add(e.mr.len)
        .ok_or_else(|| bad("wraps the address space".into()))?;
    if end > map_len {
        return Err(bad(format!(
            "ends {} bytes past the mapping",
            end - map_len
        )));
    }
    Ok(offset)
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed once, here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// What one NIC imported from one remote node.
#[derive(Debug, Default)]
pub(crate) struct Imported {
    pub registry: Arc<Registry>,
    maps: HashMap<u64, Arc<IpcMapping>>,
}

fn export(ctx: &Arc<CudaContext>, mr: &Mr) -> Result<MrExport, EmuError> {
    ctx.bind_to_thread()
        .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers; `mr.addr` is a registered device address.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, mr.addr) }
        .result()
        .map_err(EmuError::cuda("cuMemGetAddressRange"))?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `base` is the start of a live cuMemAlloc allocation; `h` is a valid out-pointer.
    unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
        .result()
        .map_err(EmuError::cuda("cuIpcGetMemHandle"))?;
    Ok(MrExport {
        mr: *mr,
        alloc_base: base,
        handle: h.reserved.map(|c| c as u8),
    })
}

impl Nic {
    /// Like [`qp_info`](Nic::qp_info), plus an IPC export of every registration of GPU memory
    /// on this NIC, for a peer in another process. CUDA NICs only.
    pub fn qp_info_for_ipc(&self, qpn: u32) -> Result<QpInfo, EmuError> {
        let mut info = self.qp_info(qpn)?;
        let ctx = self.shared.ctx.as_ref().ok_or(EmuError::Unsupported {
            backend: "host",
            what: "export registrations to another process",
        })?;
        for r in self.shared.registry.all() {
            if r.mr.place == Place::Device {
                info.exports.push(export(ctx, &r.mr)?);
            }
        }
        Ok(info)
    }
}

/// Opens the peer's exported registrations (once per allocation) and returns the registry QPs
/// connected to that peer check against.
pub(crate) fn import(nic: &NicShared, remote: &QpInfo) -> Result<Arc<Registry>, EmuError> {
    let ctx = nic.ctx.as_ref().ok_or(EmuError::Unsupported {
        backend: "host",
        what: "import registrations from another process",
    })?;
    ctx.bind_to_thread()
        .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
    let mut all = nic.imported.lock().expect("imported lock");
    let imp = all.entry(remote.node.0).or_default();
    for e in &remote.exports {
        let map = match imp.maps.get(&e.alloc_base) {
            Some(m) => m.clone(),
            None => {
                let mut ptr = 0u64;
                let h = sys::CUipcMemHandle {
                    reserved: e.handle.map(|b| b as _),
                };
                // SAFETY: valid out-pointer; the handle came from the peer's cuIpcGetMemHandle.
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                }
                .result()
                .map_err(EmuError::cuda("cuIpcOpenMemHandle"))?;
                let mut m = IpcMapping {
                    ctx: ctx.clone(),
                    ptr,
                    len: 0,
                };
                let (mut base, mut size) = (0u64, 0usize);
                // SAFETY: valid out-pointers; `ptr` was just mapped in the current context.
                unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
                    .result()
                    .map_err(EmuError::cuda("cuMemGetAddressRange"))?;
                // The mapping starts at the allocation's base; what lies past its end is not the
                // peer's memory.
                m.len = size.saturating_sub((ptr - base) as usize) as u64;
                let m = Arc::new(m);
                imp.maps.insert(e.alloc_base, m.clone());
                m
            }
        };
        let offset = import_offset(e, map.len)?;
        let keep: Arc<dyn std::any::Any + Send + Sync> = map.clone();
        imp.registry.insert(Region {
            mr: e.mr,
            base: map.ptr + offset,
            _keep: Some(keep),
        });
    }
    Ok(imp.registry.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(addr: u64, len: u64, alloc_base: u64) -> MrExport {
        MrExport {
            mr: Mr {
                lkey: 7,
                rkey: 7,
                addr,
                len,
                access: Access::from_bits(0),
                place: Place::Device,
            },
            alloc_base,
            handle: [0; 64],
        }
    }

    #[test]
    fn an_import_must_lie_inside_the_mapping() {
        let base = 0x7f00_0000_0000;
        assert_eq!(import_offset(&export(base, 4096, base), 4096).unwrap(), 0);
        assert_eq!(
            import_offset(&export(base + 64, 64, base), 4096).unwrap(),
            64
        );
        for (e, why) in [
            (export(base, 4097, base), "ends 1 bytes past"),
            (export(base + 4000, 200, base), "ends 104 bytes past"),
            (export(base - 8, 8, base), "below its allocation"),
            (export(base + 8, u64::MAX, base), "wraps"),
        ] {
            let msg = import_offset(&e, 4096).unwrap_err().to_string();
            assert!(msg.contains(why), "{msg}");
        }
    }
}
