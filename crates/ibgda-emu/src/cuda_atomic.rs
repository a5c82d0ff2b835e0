//! Atomics on GPU memory with no kernel: read the word (device to pinned host) on the QP's
//! stream, compute on the host, write it back on the same stream. No process-wide lock: an
//! atomic locks only its word's stripe (one of [`STRIPE_COUNT`], by address), and only the read
//! is waited for. The write-back is not: the next atomic on the stripe from another stream makes
//! its stream wait (on the GPU, `cuStreamWaitEvent`) for the event recorded after that
//! write-back, so it reads what was written; on the same stream, stream order does it.
//!
//! What this is atomic with respect to: every other emulator atomic on the same word in this
//! process (see the crate docs for what it is not atomic with).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext};

use crate::backend::AtomicOp;
use crate::error::{check, EmuError};
use crate::host::HostBuffer;

/// Stripes of the word locks: enough that unrelated words rarely share one.
pub(crate) const STRIPE_COUNT: usize = 256;

/// An event recorded after a write-back, shared by the lane that records it and the stripe that
/// remembers it (it outlives either).
#[derive(Debug)]
pub(crate) struct WriteBackEvent {
    pub(crate) raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent may be recorded, waited on and destroyed from any thread with a context of
// its device current; every use here binds `ctx` (or runs on a thread that has) first, and the
// handle is never freed twice (Drop only).
unsafe impl Send for WriteBackEvent {}
// SAFETY: as for Send; the driver synchronises concurrent uses of one event handle.
unsafe impl Sync for WriteBackEvent {}

impl WriteBackEvent {
    /// A timing-free event in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Arc<Self>, EmuError> {
        ctx.bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Arc::new(Self {
            raw,
            ctx: ctx.clone(),
        }))
    }
}

impl Drop for WriteBackEvent {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created in `new`, destroyed once, here; the driver defers the release of an
            // event still pending on a stream.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

/// The last write-back to a stripe: its event and the stream it was enqueued on.
pub(crate) struct LastWrite {
    pub(crate) event: Arc<WriteBackEvent>,
    pub(crate) stream: usize,
}

pub(crate) static STRIPES: [Mutex<Option<LastWrite>>; STRIPE_COUNT] =
    [const { Mutex::new(None) }; STRIPE_COUNT];

/// The index in [`STRIPES`] of the GPU word at `addr` (see [`stripe`]).
pub(crate) fn stripe_index(addr: u64) -> usize {
    let h = (addr >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56;
    h as usize % STRIPE_COUNT
}

/// The stripe of the GPU word at `addr`. 4- and 8-byte words of one aligned 8 bytes share it (a
/// 4-byte masked atomic and an 8-byte atomic may overlap); Fibonacci hashing spreads
/// neighbouring words (counters indexed by rank) over different stripes.
fn stripe(addr: u64) -> &'static Mutex<Option<LastWrite>> {
    &STRIPES[stripe_index(addr)]
}

/// Enqueues on `stream` the store of `bytes` (4 bytes, 4-aligned, or 8 bytes, 8-aligned) at
/// device address `addr` as a stream memory operation: one driver call, no staging, no SM, and
/// one store of the whole word, after every earlier write of the stream (the default memory
/// barrier). `Err` when the driver refuses it (no stream memory operations, an address they
/// cannot reach); the caller then falls back to a copy.
///
/// # Safety
/// `addr .. addr + bytes.len()` must be valid, writable device memory; `stream` a live stream of a
/// context current on this thread.
pub(crate) unsafe fn store_word(
    stream: sys::CUstream,
    addr: u64,
    bytes: &[u8],
) -> Result<(), EmuError> {
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st as WriteValue;
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as Value;
    // One batch of one write, as the CQE path writes CQEs (cuStreamBatchMemOp: the entry point
    // that path already relies on). Flags 0: the write keeps its memory barrier.
    let (operation, value) = match *bytes {
        [a, b, c, d] => (
            sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32,
            Value {
                value: u32::from_ne_bytes([a, b, c, d]),
            },
        ),
        [..] if bytes.len() == 8 => (
            sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64,
            Value {
                value64: u64::from_ne_bytes(bytes.try_into().expect("8 bytes")),
            },
        ),
        _ => {
            return Err(EmuError::BadConfig(format!(
                "a stream store of {} bytes",
                bytes.len()
            )))
        }
    };
    let mut op = sys::CUstreamBatchMemOpParams {
        writeValue: WriteValue {
            operation,
            address: addr,
            __bindgen_anon_1: value,
            flags: 0,
            alias: 0,
        },
    };
    // SAFETY: one write of an aligned word the caller vouched for, on a live stream.
    check("cuStreamBatchMemOp", unsafe {
        sys::cuStreamBatchMemOp_v2(stream, 1, &mut op, 0)
    })
}

/// Performs `op` on the GPU word at `target` from `stream`, after everything enqueued on
/// `stream` before, and returns the old value. `drain` waits (bounded) until `stream` is idle;
/// `scratch` is pinned host memory of at least 8 bytes that only this stream uses; `event` is
/// the stream's write-back event; `memops` says whether the write-back may be a stream store
/// (cleared, and a copy used, when the driver refuses one).
///
/// # Safety
/// `target` must be a valid, writable device word aligned to `op.width()`; `stream` a live
/// stream of a context current on this thread.
pub(crate) unsafe fn atomic_on_device(
    stream: sys::CUstream,
    drain: &mut dyn FnMut() -> Result<(), EmuError>,
    scratch: &HostBuffer,
    event: &Arc<WriteBackEvent>,
    memops: &mut bool,
    target: u64,
    op: AtomicOp,
) -> Result<u64, EmuError> {
    let w = op.width();
    let mut last = stripe(target).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = last.as_ref() {
        if l.stream != stream as usize {
            // SAFETY: a live event (held by the stripe) and a live stream.
            check("cuStreamWaitEvent", unsafe {
                sys::cuStreamWaitEvent(stream, l.event.raw, 0)
            })?;
        }
    }
    // SAFETY: the caller guarantees the device word; the scratch is pinned and this stream's.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(scratch.addr() as *mut c_void, target, w, stream)
    })?;
    drain()?;
    let old = if w == 8 {
        scratch.load_u64(0)
    } else {
        scratch.load_u32(0) as u64
    };
    let new = op.apply(old);
    if new != old {
        // Little-endian: the low `w` bytes are the word.
        let bytes = new.to_ne_bytes();
        let mut stored = false;
        if *memops {
            // SAFETY: the caller guarantees the word (aligned to `w`) and the stream.
            match unsafe { store_word(stream, target, &bytes[..w]) } {
                Ok(()) => stored = true,
                Err(e) => {
                    tracing::warn!("atomic write-backs fall back to copies: {e}");
                    *memops = false;
                }
            }
        }
        if !stored {
            // From pageable memory: the driver stages the bytes before it returns, so the local
            // may go; the copy itself lands later, in stream order.
            // SAFETY: as above.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(target, bytes.as_ptr() as *const c_void, w, stream)
            })?;
        }
        // SAFETY: a live event of this device and a live stream.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.raw, stream)
        })?;
        *last = Some(LastWrite {
            event: event.clone(),
            stream: stream as usize,
        });
    }
    Ok(old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_words_spread_and_halves_share() {
        let base = 0x7f00_0000_1000u64;
        let same = |a: u64, b: u64| std::ptr::eq(stripe(a), stripe(b));
        assert!(same(base, base + 4), "the two halves of one 8-byte word");
        let distinct: std::collections::HashSet<usize> = (0..64u64)
            .map(|k| stripe(base + 8 * k) as *const _ as usize)
            .collect();
        assert!(
            distinct.len() > 48,
            "64 neighbouring words on {} stripes",
            distinct.len()
        );
    }
}
