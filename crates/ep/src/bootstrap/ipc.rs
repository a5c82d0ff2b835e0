//! Seeing other ranks' GPU buffers: CUDA IPC between processes, peer access between threads.

use std::fmt;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use ibgda_device::cuda::{CudaContext, CudaError, DeviceBuffer, DriverError};

use super::{BootstrapError, Communicator, JobToken};

/// A CUDA IPC memory handle (`CUipcMemHandle`, 64 opaque bytes): sent to another process, it lets
/// that process map the exported allocation ([`PeerMapping::open`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle([u8; IpcHandle::LEN]);

impl IpcHandle {
    /// Size of a handle in bytes.
    pub const LEN: usize = 64;

    /// The handle in these bytes; `None` unless there are exactly [`LEN`](Self::LEN) of them.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The handle's bytes, to send to another process.
    pub fn as_bytes(&self) -> &[u8; IpcHandle::LEN] {
        &self.0
    }
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { call, source }
}

fn bind(ctx: &CudaContext) -> Result<(), CudaError> {
    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
}

/// Exports `buf` for other processes (`cuIpcGetMemHandle`). The buffer must stay alive while any
/// process has it mapped.
pub fn export(buf: &DeviceBuffer) -> Result<IpcHandle, CudaError> {
    bind(buf.context())?;
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; IpcHandle::LEN],
    };
    // SAFETY: `handle` is a valid out-pointer; `buf.ptr()` is the base of a live cuMemAlloc
    // allocation of the current context, which is what cuIpcGetMemHandle requires.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.ptr()) }
        .result()
        .map_err(driver("cuIpcGetMemHandle"))?;
    Ok(IpcHandle(handle.reserved.map(|c| c as u8)))
}

/// Another process's GPU allocation mapped into this process (`cuIpcOpenMemHandle`), unmapped on
/// drop (`cuIpcCloseMemHandle`). Holds the context it was opened in, so the context outlives it.
#[derive(Debug)]
pub struct PeerMapping {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
}

impl PeerMapping {
    /// Maps the allocation behind `handle` into `ctx`, with peer access enabled on first use
    /// (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). Fails if the allocation is smaller than `len`.
    /// A handle cannot be opened in the process that exported it.
    pub fn open(ctx: &Arc<CudaContext>, handle: &IpcHandle, len: usize) -> Result<Self, CudaError> {
        bind(ctx)?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer and the context is current; the driver validates
        // the handle's bytes and fails on a handle it does not recognise.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(driver("cuIpcOpenMemHandle"))?;
        // From here on, dropping `mapping` unmaps it, also on the error path below.
        let mapping = Self {
            ctx: ctx.clone(),
            ptr,
            len,
        };
        let (mut base, mut size) = (0, 0);
        // SAFETY: out-pointers are valid; `ptr` was just mapped in the current context.
        let range = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result();
        match range {
            Ok(()) => {
                let avail = size.saturating_sub((ptr - base) as usize);
                if len > avail {
                    return Err(CudaError::OutOfRange {
                        offset: 0,
                        len,
                        size: avail,
                    });
                }
            }
            // Only a check: the mapping itself worked.
            Err(e) => tracing::debug!("cuMemGetAddressRange on IPC mapping {ptr:#x}: {e}"),
        }
        Ok(mapping)
    }

    /// The mapping's device address, valid in the context it was opened in.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The length asked for when opening.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether that length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context the mapping lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        if let Err(e) = bind(&self.ctx) {
            tracing::warn!("leaking IPC mapping {:#x}: {e}", self.ptr);
            return;
        }
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed once, here.
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result();
        if let Err(e) = r {
            tracing::warn!("cuIpcCloseMemHandle({:#x}) failed: {e}", self.ptr);
        }
    }
}

/// How a rank's buffer is reached from this rank.
#[derive(Debug)]
enum Reach {
    /// This rank's own buffer.
    Own,
    /// A buffer of another thread of this process, through peer access.
    SameProcess,
    /// A buffer of another process, through CUDA IPC.
    Ipc(PeerMapping),
}

/// One rank's buffer as seen from this rank: a device address valid in this rank's context.
///
/// For this rank and for ranks that are threads of this process, the address is the owner's
/// own, so the owner must keep its buffer alive while others use it (end with a barrier before
/// freeing). For other processes it is an IPC mapping, unmapped when this is dropped.
#[derive(Debug)]
pub struct PeerBuffer {
    rank: usize,
    ptr: u64,
    len: usize,
    reach: Reach,
}

impl PeerBuffer {
    /// The rank that owns the buffer.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device address, valid in the context given to [`exchange_buffers`].
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this is the calling rank's own buffer.
    pub fn is_own(&self) -> bool {
        matches!(self.reach, Reach::Own)
    }

    /// Whether the buffer is reached through CUDA IPC (its owner is another process).
    pub fn is_ipc(&self) -> bool {
        matches!(self.reach, Reach::Ipc(_))
    }

    /// The IPC mapping behind the address, when the owner is another process.
    pub fn mapping(&self) -> Option<&PeerMapping> {
        match &self.reach {
            Reach::Ipc(m) => Some(m),
            _ => None,
        }
    }
}

/// Random bytes naming this process, so ranks can tell whether a peer shares their address space
/// (process ids repeat across hosts and containers).
fn process_nonce() -> [u8; 16] {
    static NONCE: OnceLock<[u8; 16]> = OnceLock::new();
    *NONCE.get_or_init(|| match JobToken::generate() {
        Ok(t) => *t.as_bytes(),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&std::process::id().to_le_bytes());
            b[4..].copy_from_slice(&t.to_le_bytes()[..12]);
            b
        }
    })
}

/// What each rank tells the others about its buffer.
#[derive(Debug)]
struct Record {
    nonce: [u8; 16],
    ordinal: u32,
    len: u64,
    ptr: u64,
    handle: Option<IpcHandle>,
}

const RECORD_OK: u8 = 1;
const RECORD_FAILED: u8 = 2;

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![RECORD_OK];
        v.extend_from_slice(&self.nonce);
        v.extend_from_slice(&self.ordinal.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&self.ptr.to_le_bytes());
        match &self.handle {
            Some(h) => {
                v.push(1);
                v.extend_from_slice(h.as_bytes());
            }
            None => v.push(0),
        }
        v
    }

    /// The record, or the failure the rank reported instead.
    fn decode(b: &[u8]) -> Result<Record, String> {
        match b.first() {
            Some(&RECORD_FAILED) => return Err(String::from_utf8_lossy(&b[1..]).into_owned()),
            Some(&RECORD_OK) => {}
            _ => return Err("malformed buffer record".into()),
        }
        let fixed = 1 + 16 + 4 + 8 + 8 + 1;
        if b.len() < fixed {
            return Err("truncated buffer record".into());
        }
        let handle = match (b[fixed - 1], b.len() - fixed) {
            (0, 0) => None,
            (1, IpcHandle::LEN) => IpcHandle::from_bytes(&b[fixed..]),
            _ => return Err("malformed IPC handle in buffer record".into()),
        };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Ok(Record {
            nonce: b[1..17].try_into().unwrap_or_default(),
            ordinal: u32::from_le_bytes(b[17..21].try_into().unwrap_or_default()),
            len: u64_at(21),
            ptr: u64_at(29),
            handle,
        })
    }
}

/// Every rank's `local` buffer, indexed by rank, as device addresses valid in `ctx` (this rank's
/// context, which must be the one `local` lives in). A collective: every rank calls it.
///
/// Ranks in other processes are reached through CUDA IPC (each rank exports its buffer, the others
/// map it); ranks that are threads of this process (told apart per peer, so a group of
/// [`TcpCommunicator`](super::TcpCommunicator)s inside one process works too) through their own
/// addresses after [`enable_peer_access`](ibgda_device::cuda::enable_peer_access). When one rank
/// cannot export its buffer every rank fails, naming it.
///
/// Every rank must keep `local` alive while others use it: end with a barrier before freeing.
/// Peers may read `local` as soon as this returns, so finish writing it first (synchronize: a
/// copy from pageable host memory can return before its data has landed).
pub fn exchange_buffers<C: Communicator + ?Sized>(
    comm: &C,
    ctx: &Arc<CudaContext>,
    local: &DeviceBuffer,
) -> Result<Vec<PeerBuffer>, BootstrapError> {
    let rank = comm.rank();
    let cuda = |step: String| move |source: CudaError| BootstrapError::Cuda { rank, step, source };
    let mine = if local.context().cu_device() != ctx.cu_device() {
        Err(BootstrapError::Config(format!(
            "rank {rank}: exchange_buffers: the buffer lives on GPU {} but the context given is \
             GPU {}",
            local.context().ordinal(),
            ctx.ordinal()
        )))
    } else if comm.same_process() {
        Ok(None)
    } else {
        export(local).map(Some).map_err(cuda(
            "exchange_buffers: exporting this rank's buffer".into(),
        ))
    };
    let record = match &mine {
        Ok(handle) => Record {
            nonce: process_nonce(),
            ordinal: ctx.ordinal() as u32,
            len: local.len() as u64,
            ptr: local.ptr(),
            handle: *handle,
        }
        .encode(),
        Err(e) => [&[RECORD_FAILED][..], e.to_string().as_bytes()].concat(),
    };
    // Exchange even after a local failure, so every rank learns of it now, not at a timeout.
    let all = comm.all_gather_bytes(&record)?;
    mine?;
    let step = "exchange_buffers";
    let mut out = Vec::with_capacity(all.len());
    for (r, bytes) in all.iter().enumerate() {
        let rec = Record::decode(bytes).map_err(|why| BootstrapError::Protocol {
            rank,
            step: step.into(),
            peer: format!("rank {r}"),
            detail: why,
        })?;
        let len = rec.len as usize;
        if r == rank {
            out.push(PeerBuffer {
                rank: r,
                ptr: local.ptr(),
                len,
                reach: Reach::Own,
            });
        } else if rec.nonce == process_nonce() {
            let peer_ctx = ibgda_device::cuda::context(rec.ordinal as usize).map_err(cuda(
                format!("{step}: opening GPU {} of rank {r}", rec.ordinal),
            ))?;
            ibgda_device::cuda::enable_peer_access(ctx, &peer_ctx).map_err(cuda(format!(
                "{step}: enabling access to rank {r}'s GPU {}",
                rec.ordinal
            )))?;
            out.push(PeerBuffer {
                rank: r,
                ptr: rec.ptr,
                len,
                reach: Reach::SameProcess,
            });
        } else {
            let Some(handle) = rec.handle else {
                return Err(BootstrapError::Protocol {
                    rank,
                    step: step.into(),
                    peer: format!("rank {r}"),
                    detail: "rank is in another process but sent no IPC handle (does its \
                             communicator claim all ranks share one process?)"
                        .into(),
                });
            };
            let mapping = PeerMapping::open(ctx, &handle, len)
                .map_err(cuda(format!("{step}: mapping rank {r}'s buffer")))?;
            out.push(PeerBuffer {
                rank: r,
                ptr: mapping.ptr(),
                len,
                reach: Reach::Ipc(mapping),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip() {
        let h = IpcHandle::from_bytes(&[9; 64]).unwrap();
        for handle in [None, Some(h)] {
            let r = Record {
                nonce: [3; 16],
                ordinal: 2,
                len: 1 << 33,
                ptr: 0x7f00_0000_1000,
                handle,
            };
            let d = Record::decode(&r.encode()).unwrap();
            assert_eq!(
                (d.nonce, d.ordinal, d.len, d.ptr, d.handle),
                (r.nonce, r.ordinal, r.len, r.ptr, r.handle)
            );
        }
        let failed = [&[RECORD_FAILED][..], b"rank 3: no"].concat();
        assert_eq!(Record::decode(&failed).unwrap_err(), "rank 3: no");
        assert!(Record::decode(&[]).is_err());
        assert!(Record::decode(&[RECORD_OK, 1, 2]).is_err());
    }

    #[test]
    fn handle_bytes() {
        assert!(IpcHandle::from_bytes(&[0; 63]).is_none());
        let h = IpcHandle::from_bytes(&[0xab; 64]).unwrap();
        assert_eq!(h.as_bytes()[63], 0xab);
        assert_eq!(format!("{h:?}"), "IpcHandle(abababababababab…)");
    }

    #[test]
    fn nonce_is_stable_within_a_process() {
        assert_eq!(process_nonce(), process_nonce());
    }
}
