//! Seeing other ranks' GPU buffers: CUDA IPC between processes, peer access between threads.

use std::fmt;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use ibgda_device::cuda::{bind, CudaContext, CudaError, DeviceBuffer, DriverError};

use super::{BootstrapError, Communicator};

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

/// A secret of this process: 32 random bytes that never leave it. A rank proves "my buffer
/// lives in your address space" to a peer by a tag under this key, which only a thread of the
/// same process can make or check; a stranger (a forged rank 0 relaying the records, a rank of
/// another process) can neither forge such a tag nor reuse one it has seen, since the tag covers
/// the rank, the device, the address and the length (and a fresh salt). Process ids would not do:
/// they repeat across hosts and containers, and are public.
fn process_secret() -> Result<&'static [u8; 32], BootstrapError> {
    static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
    if let Some(s) = SECRET.get() {
        return Ok(s);
    }
    let fresh = super::token::random_bytes("this process's same-process secret")?;
    // Two threads may race here: the first value set wins and both use it.
    let _ = SECRET.set(fresh);
    Ok(SECRET
        .get()
        .unwrap_or_else(|| unreachable!("set just above")))
}

/// Label of same-process tags (nothing else is tagged under the process secret, but say so).
const SAME_PROCESS_LABEL: &[u8] = b"ep ipc v1: this buffer lives in your process";

/// What each rank tells the others about its buffer.
#[derive(Debug, Clone)]
struct Record {
    /// Fresh random bytes per record, covered by the tag.
    salt: [u8; 16],
    /// `HMAC(process secret, label | salt | rank | ordinal | len | ptr)`: checks out only in the
    /// process that made it (see [`process_secret`]).
    tag: super::token::Tag,
    ordinal: u32,
    len: u64,
    ptr: u64,
    handle: Option<IpcHandle>,
}

const RECORD_OK: u8 = 1;
const RECORD_FAILED: u8 = 2;

impl Record {
    /// The fields the tag covers, for rank `rank`'s record.
    fn tagged(
        salt: &[u8; 16],
        rank: usize,
        ordinal: u32,
        len: u64,
        ptr: u64,
    ) -> [u8; 16 + 8 + 4 + 8 + 8] {
        let mut b = [0u8; 44];
        b[..16].copy_from_slice(salt);
        b[16..24].copy_from_slice(&(rank as u64).to_le_bytes());
        b[24..28].copy_from_slice(&ordinal.to_le_bytes());
        b[28..36].copy_from_slice(&len.to_le_bytes());
        b[36..44].copy_from_slice(&ptr.to_le_bytes());
        b
    }

    /// Rank `rank`'s record of a buffer, tagged under `secret`.
    fn new(
        secret: &[u8; 32],
        rank: usize,
        ordinal: u32,
        len: u64,
        ptr: u64,
        handle: Option<IpcHandle>,
    ) -> Result<Self, BootstrapError> {
        let salt = super::token::random_bytes("a buffer record's salt")?;
        let fields = Self::tagged(&salt, rank, ordinal, len, ptr);
        let tag = super::token::tag(secret, &[SAME_PROCESS_LABEL, &fields]);
        Ok(Self {
            salt,
            tag,
            ordinal,
            len,
            ptr,
            handle,
        })
    }

    /// Whether this record, received as rank `rank`'s, was made in the process holding `secret`:
    /// only then may its address be used as it is.
    fn made_in_process_of(&self, secret: &[u8; 32], rank: usize) -> bool {
        let fields = Self::tagged(&self.salt, rank, self.ordinal, self.len, self.ptr);
        super::token::tag_matches(secret, &[SAME_PROCESS_LABEL, &fields], &self.tag)
    }

    fn encode(&self) -> Vec<u8> {
        let mut v = vec![RECORD_OK];
        v.extend_from_slice(&self.salt);
        v.extend_from_slice(&self.tag);
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
        let fixed = 1 + 16 + 32 + 4 + 8 + 8 + 1;
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
            salt: b[1..17].try_into().unwrap_or_default(),
            tag: b[17..49].try_into().unwrap_or_default(),
            ordinal: u32::from_le_bytes(b[49..53].try_into().unwrap_or_default()),
            len: u64_at(53),
            ptr: u64_at(61),
            handle,
        })
    }
}

/// Checks that `[ptr, ptr + len)` lies inside one live allocation of this process (the driver's
/// own registry of allocations, `cuMemGetAddressRange`, asked with `owner`, the context of the GPU
/// the peer names, current; `ours` is made current again after): the last line of defence before
/// a same-process address is handed to kernels as a peer's buffer.
fn check_local_allocation(
    owner: &Arc<CudaContext>,
    ours: &Arc<CudaContext>,
    ptr: u64,
    len: usize,
) -> Result<(), CudaError> {
    bind(owner)?;
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid out-pointers; the driver only looks `ptr` up in its allocation table, and
    // fails for an address that is not in a live allocation of this process.
    let found = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result();
    bind(ours)?;
    found.map_err(driver("cuMemGetAddressRange"))?;
    let offset = (ptr - base) as usize;
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(CudaError::OutOfRange { offset, len, size });
    }
    Ok(())
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
    let secret = process_secret();
    let mine = mine.and_then(|handle| {
        let secret = secret
            .as_ref()
            .map_err(|e| BootstrapError::Config(e.to_string()))?;
        Record::new(
            secret,
            rank,
            ctx.ordinal() as u32,
            local.len() as u64,
            local.ptr(),
            handle,
        )
    });
    let record = match &mine {
        Ok(rec) => rec.encode(),
        Err(e) => [&[RECORD_FAILED][..], e.to_string().as_bytes()].concat(),
    };
    // Exchange even after a local failure, so every rank learns of it now, not at a timeout.
    let all = comm.all_gather_bytes(&record)?;
    // The secret's own error first: `mine` then only says that it failed.
    let secret = secret?;
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
        } else if rec.made_in_process_of(secret, r) {
            let peer_ctx = ibgda_device::cuda::context(rec.ordinal as usize).map_err(cuda(
                format!("{step}: opening GPU {} of rank {r}", rec.ordinal),
            ))?;
            check_local_allocation(&peer_ctx, ctx, rec.ptr, len).map_err(cuda(format!(
                "{step}: rank {r}'s buffer {:#x} (+{len} bytes) is not a live allocation of this \
                 process on GPU {}",
                rec.ptr, rec.ordinal
            )))?;
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
            let r = Record::new(&[3; 32], 1, 2, 1 << 33, 0x7f00_0000_1000, handle).unwrap();
            let d = Record::decode(&r.encode()).unwrap();
            assert_eq!(
                (d.salt, d.tag, d.ordinal, d.len, d.ptr, d.handle),
                (r.salt, r.tag, r.ordinal, r.len, r.ptr, r.handle)
            );
        }
        let failed = [&[RECORD_FAILED][..], b"rank 3: no"].concat();
        assert_eq!(Record::decode(&failed).unwrap_err(), "rank 3: no");
        assert!(Record::decode(&[]).is_err());
        assert!(Record::decode(&[RECORD_OK, 1, 2]).is_err());
    }

    #[test]
    fn a_forged_record_is_never_taken_for_same_process_memory() {
        let secret = process_secret().unwrap();
        // What every rank sees of rank 1's record: all its bytes (rank 0 relays them).
        let honest = Record::new(secret, 1, 0, 4096, 0x7f00_0000_0000, None).unwrap();
        assert!(honest.made_in_process_of(secret, 1));
        let seen = Record::decode(&honest.encode()).unwrap();
        assert!(seen.made_in_process_of(secret, 1));

        // A forger replays it with another address, length or device, or as another rank's.
        let mut forged = seen.clone();
        forged.ptr = 0xdead_0000;
        assert!(!forged.made_in_process_of(secret, 1), "another address");
        let mut forged = seen.clone();
        forged.len = 1 << 40;
        assert!(!forged.made_in_process_of(secret, 1), "another length");
        let mut forged = seen.clone();
        forged.ordinal = 1;
        assert!(!forged.made_in_process_of(secret, 1), "another GPU");
        assert!(!seen.made_in_process_of(secret, 2), "as rank 2's record");
        // Made up from scratch, or tagged under a secret of another process.
        let mut made_up = seen.clone();
        made_up.tag = [0; 32];
        assert!(!made_up.made_in_process_of(secret, 1));
        let other = Record::new(&[7; 32], 1, 0, 4096, 0x7f00_0000_0000, None).unwrap();
        assert!(!other.made_in_process_of(secret, 1), "another process");
    }

    #[test]
    fn handle_bytes() {
        assert!(IpcHandle::from_bytes(&[0; 63]).is_none());
        let h = IpcHandle::from_bytes(&[0xab; 64]).unwrap();
        assert_eq!(h.as_bytes()[63], 0xab);
        assert_eq!(format!("{h:?}"), "IpcHandle(abababababababab…)");
    }

    #[test]
    fn the_secret_is_stable_within_a_process() {
        assert_eq!(process_secret().unwrap(), process_secret().unwrap());
    }
}
