//! One QP's pending submission on the CUDA backend: the copies and word writes the engine asked
//! for since the last submission, handed to the driver in as few calls as possible.
//!
//! A driver call costs the NIC thread 1–3 µs, which at one call per WQE caps a NIC at a few
//! hundred thousand small operations per second. A [`Batch`] gathers device-to-device copies
//! (gather entries of RDMA writes) into one `cuMemcpyBatchAsync` and word stores (inline
//! data, device CQEs) into one `cuStreamBatchMemOp`, copies first, then the stores in the order
//! they were asked for. Within one batch the copies may land in any order among themselves, and
//! before the stores; a new operation that depends on one already in the batch (its destination
//! overlaps an earlier destination or source, or its source an earlier destination) closes the
//! batch first, so data dependencies and the final contents of overlapping writes keep WQE
//! order. See the crate docs for what this means for write ordering.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::error::{check, EmuError};

/// Copies gathered into one `cuMemcpyBatchAsync` at most.
pub(crate) const MAX_BATCH_COPIES: usize = 128;

/// Word stores in one `cuStreamBatchMemOp` call (the driver takes fewer than 256).
const MAX_MEMOPS_PER_CALL: usize = 248;

/// Word stores gathered before the batch is submitted (several calls of [`MAX_MEMOPS_PER_CALL`]).
pub(crate) const MAX_BATCH_WORDS: usize = 4 * MAX_MEMOPS_PER_CALL;

/// Environment variable: `1` gathers a QP's device copies of a round into one
/// `cuMemcpyBatchAsync`; anything else (the default) issues one `cuMemcpyAsync` per copy.
///
/// Off by default: on one H200 (2026-12-02) with batched copies the emulator made no progress
/// while waiting kernels filled every SM (`gpu_protocol::
/// gpu_emulator_progresses_while_waiting_kernels_fill_the_gpu`, which passed with one call per
/// copy on 2026-12-01): the batched call appears to run its copies as a kernel, which needs an
/// SM. Turn it on only where SMs are kept free for the NIC (`ep::residency::EMULATED_NIC_SMS`)
/// and measure.
pub const BATCH_COPIES_ENV: &str = "IBGDA_EMU_BATCH_COPIES";

/// Whether [`BATCH_COPIES_ENV`] asks for batched copies.
pub(crate) fn batch_copies_from_env() -> bool {
    std::env::var(BATCH_COPIES_ENV).is_ok_and(|v| v.trim() == "1")
}

/// One stream store of a 4- or 8-byte word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WordWrite {
    pub addr: u64,
    pub value: u64,
    /// 4 or 8.
    pub width: u8,
    /// Whether the store waits for every earlier write of the stream to be visible first (the
    /// driver's default memory barrier); off only inside a CQE, between its first and last word.
    pub barrier: bool,
}

/// A half-open byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range(u64, u64);

impl Range {
    fn new(at: u64, len: u64) -> Self {
        Range(at, at.saturating_add(len))
    }

    fn overlaps(self, o: Range) -> bool {
        self.0 < o.1 && o.0 < self.1
    }
}

/// Ranges with their envelope, so the common case (no overlap with the envelope) is one test.
#[derive(Debug, Default)]
struct RangeSet {
    all: Vec<Range>,
    lo: u64,
    hi: u64,
}

impl RangeSet {
    fn add(&mut self, r: Range) {
        if self.all.is_empty() {
            (self.lo, self.hi) = (r.0, r.1);
        } else {
            self.lo = self.lo.min(r.0);
            self.hi = self.hi.max(r.1);
        }
        self.all.push(r);
    }

    fn hits(&self, r: Range) -> bool {
        !self.all.is_empty()
            && r.overlaps(Range(self.lo, self.hi))
            && self.all.iter().any(|x| x.overlaps(r))
    }

    fn clear(&mut self) {
        self.all.clear();
    }
}

/// What a batch holds (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Batch {
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    words: Vec<WordWrite>,
    written: RangeSet,
    read: RangeSet,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty() && self.words.is_empty()
    }

    /// Whether a copy `src -> dst` of `len` bytes may join without closing the batch first.
    pub fn admits_copy(&self, dst: u64, src: u64, len: u64) -> bool {
        let (d, s) = (Range::new(dst, len), Range::new(src, len));
        self.sizes.len() < MAX_BATCH_COPIES
            && !self.written.hits(d)
            && !self.read.hits(d)
            && !self.written.hits(s)
    }

    /// Whether `n` word stores into `[dst, dst + len)` may join without closing the batch first.
    pub fn admits_words(&self, dst: u64, len: u64, n: usize) -> bool {
        // Stores land after every copy of the batch: a store over an earlier copy's destination
        // keeps WQE order; a store over an earlier copy's source would be read too early.
        self.words.len() + n <= MAX_BATCH_WORDS && !self.read.hits(Range::new(dst, len))
    }

    /// Adds a copy (the caller checked [`admits_copy`](Self::admits_copy)).
    pub fn push_copy(&mut self, dst: u64, src: u64, len: u64) {
        self.dsts.push(dst);
        self.srcs.push(src);
        self.sizes.push(len as usize);
        self.written.add(Range::new(dst, len));
        self.read.add(Range::new(src, len));
    }

    /// Adds word stores covering `[dst, dst + len)` (the caller checked
    /// [`admits_words`](Self::admits_words)).
    pub fn push_words(&mut self, dst: u64, len: u64, words: impl IntoIterator<Item = WordWrite>) {
        self.words.extend(words);
        self.written.add(Range::new(dst, len));
    }

    /// Enqueues everything on `stream` and empties the batch. `batch_copies`: whether
    /// `cuMemcpyBatchAsync` may be used (cleared after it fails once; the copies are then issued
    /// one by one); `memops`: whether stream stores may be used (cleared after they fail once;
    /// the words are then copied from pageable memory, which the driver stages at once).
    ///
    /// # Safety
    /// Every range in the batch must be valid device memory (or pinned, mapped host memory for a
    /// copy's source) until the stream has executed it; `stream` is a live stream of a context
    /// current on this thread.
    pub unsafe fn submit(
        &mut self,
        stream: sys::CUstream,
        device: i32,
        batch_copies: &mut bool,
        memops: &mut bool,
    ) -> Result<(), EmuError> {
        // SAFETY: forwarded from the caller.
        let r = unsafe { self.submit_inner(stream, device, batch_copies, memops) };
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        self.words.clear();
        self.written.clear();
        self.read.clear();
        r
    }

    unsafe fn submit_inner(
        &mut self,
        stream: sys::CUstream,
        device: i32,
        batch_copies: &mut bool,
        memops: &mut bool,
    ) -> Result<(), EmuError> {
        if !self.sizes.is_empty() {
            // SAFETY: the caller vouches for every range and the stream.
            unsafe {
                copy_many(
                    stream,
                    device,
                    &mut self.dsts,
                    &mut self.srcs,
                    &mut self.sizes,
                    batch_copies,
                    true,
                )?
            };
        }
        if !self.words.is_empty() {
            // SAFETY: as above.
            unsafe { store_words(stream, &self.words, memops)? };
        }
        Ok(())
    }
}

/// Enqueues the copies `srcs[i] -> dsts[i]` of `sizes[i]` bytes, in no particular order among
/// themselves, behind everything earlier on `stream`: one `cuMemcpyBatchAsync` when it works,
/// else one `cuMemcpyAsync` each. A single copy goes through `cuMemcpyAsync` when `plain_one`;
/// deferred atomics pass `false`: the batch call says explicitly that a pinned source is read
/// in stream order, which they rely on.
///
/// # Safety
/// As [`Batch::submit`].
pub(crate) unsafe fn copy_many(
    stream: sys::CUstream,
    device: i32,
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    batch_copies: &mut bool,
    plain_one: bool,
) -> Result<(), EmuError> {
    let n = sizes.len();
    if n > usize::from(plain_one) && *batch_copies {
        let loc = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        };
        // Sources are read in stream order: atomic write-backs and replies are computed into
        // pinned memory by the host while the copy waits in the stream.
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc,
            dstLocHint: loc,
            flags: 0,
        }];
        let mut idx = [0usize];
        // SAFETY: three arrays of `n` entries, one attribute entry applying from copy 0; the
        // caller vouches for the ranges and the stream.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                n,
                attrs.as_mut_ptr(),
                idx.as_mut_ptr(),
                1,
                stream,
            )
        };
        match check("cuMemcpyBatchAsync", r) {
            Ok(()) => return Ok(()),
            Err(e) => {
                // Copies the batch may have enqueued before failing are repeated below: the
                // same bytes again, in stream order, so nothing changes.
                tracing::warn!("batched copies unavailable, one call per copy from now on: {e}");
                *batch_copies = false;
            }
        }
    }
    for i in 0..n {
        // SAFETY: the caller vouches for the ranges; unified addressing routes peer and
        // host-to-device copies.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dsts[i], srcs[i], sizes[i], stream)
        })?;
    }
    Ok(())
}

/// Enqueues the word stores, in order, behind everything earlier on `stream`.
///
/// # Safety
/// As [`Batch::submit`].
pub(crate) unsafe fn store_words(
    stream: sys::CUstream,
    words: &[WordWrite],
    memops: &mut bool,
) -> Result<(), EmuError> {
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st as WriteValue;
    use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as Value;
    let mut done = 0;
    if *memops {
        // Built from literals: `mem::zeroed` is not valid for these parameter blocks (their
        // `operation` enum has no zero variant).
        let mut params = Vec::with_capacity(words.len().min(MAX_MEMOPS_PER_CALL));
        while done < words.len() {
            let chunk = &words[done..(done + MAX_MEMOPS_PER_CALL).min(words.len())];
            params.clear();
            params.extend(chunk.iter().map(|w| {
                let (operation, value) = if w.width == 4 {
                    (
                        sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32,
                        Value {
                            value: w.value as u32,
                        },
                    )
                } else {
                    (
                        sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64,
                        Value { value64: w.value },
                    )
                };
                let flags = if w.barrier {
                    0
                } else {
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER as u32
                };
                sys::CUstreamBatchMemOpParams {
                    writeValue: WriteValue {
                        operation,
                        address: w.addr,
                        __bindgen_anon_1: value,
                        flags,
                        alias: 0,
                    },
                }
            }));
            // SAFETY: `params` describes aligned stores the caller vouched for, on a live stream.
            let r = unsafe {
                sys::cuStreamBatchMemOp_v2(stream, params.len() as u32, params.as_mut_ptr(), 0)
            };
            if let Err(e) = check("cuStreamBatchMemOp", r) {
                tracing::warn!("stream stores unavailable, words are copied from now on: {e}");
                *memops = false;
                break;
            }
            done += chunk.len();
        }
    }
    for w in &words[done..] {
        let bytes = w.value.to_ne_bytes();
        // SAFETY: the caller vouches for the word; from pageable memory the driver stages the
        // bytes before it returns, so the local may go.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                w.addr,
                bytes.as_ptr() as *const c_void,
                w.width as usize,
                stream,
            )
        })?;
    }
    Ok(())
}

/// The stream stores that write `bytes` at `dst` (a 4-byte aligned destination and a length
/// that is a multiple of 4), 8 bytes at a time where aligned; `None` when it cannot be done
/// with word stores. The first store carries the memory barrier (every earlier write of the
/// stream visible first); the others need none, the bytes of one write land in any order.
pub(crate) fn words_of(dst: u64, bytes: &[u8]) -> Option<Vec<WordWrite>> {
    if dst % 4 != 0 || bytes.len() % 4 != 0 || bytes.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4);
    let mut off = 0usize;
    while off < bytes.len() {
        let at = dst + off as u64;
        if at % 8 == 0 && bytes.len() - off >= 8 {
            let v = u64::from_ne_bytes(bytes[off..off + 8].try_into().expect("8 bytes"));
            out.push(WordWrite {
                addr: at,
                value: v,
                width: 8,
                barrier: off == 0,
            });
            off += 8;
        } else {
            let v = u32::from_ne_bytes(bytes[off..off + 4].try_into().expect("4 bytes"));
            out.push(WordWrite {
                addr: at,
                value: v as u64,
                width: 4,
                barrier: off == 0,
            });
            off += 4;
        }
    }
    Some(out)
}

/// The stores of a 64-byte CQE at `dst` (8-byte aligned): the first waits for every earlier
/// write of the stream (the data it reports), the owner word (the last) for the other seven.
pub(crate) fn cqe_words(dst: u64, cqe: &[u8; 64]) -> [WordWrite; 8] {
    std::array::from_fn(|i| WordWrite {
        addr: dst + 8 * i as u64,
        value: u64::from_ne_bytes(cqe[8 * i..8 * i + 8].try_into().expect("8 bytes")),
        width: 8,
        barrier: i == 0 || i == 7,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn independent_copies_share_a_batch_dependent_ones_do_not() {
        let mut b = Batch::default();
        assert!(b.admits_copy(0x1000, 0x9000, 64));
        b.push_copy(0x1000, 0x9000, 64);
        // Same source, disjoint destination: independent.
        assert!(b.admits_copy(0x1040, 0x9000, 64));
        // Write after write, write after read, read after write.
        assert!(!b.admits_copy(0x1020, 0x9800, 8));
        assert!(!b.admits_copy(0x9010, 0x2000, 8));
        assert!(!b.admits_copy(0x3000, 0x1008, 8));
        // Stores land after the copies: over a destination is fine, over a source is not.
        assert!(b.admits_words(0x1000, 8, 1));
        assert!(!b.admits_words(0x9000, 8, 1));
        assert!(!b.is_empty());
    }

    #[test]
    fn inline_bytes_become_aligned_words() {
        let bytes: Vec<u8> = (0..28).collect();
        let w = words_of(0x1004, &bytes).unwrap();
        let widths: Vec<u8> = w.iter().map(|w| w.width).collect();
        assert_eq!(widths, [4, 8, 8, 8]);
        assert_eq!(w[0].value, u32::from_ne_bytes([0, 1, 2, 3]) as u64);
        assert_eq!(w[1].addr, 0x1008);
        assert!(w[0].barrier && !w[1].barrier);
        assert!(words_of(0x1002, &bytes).is_none());
        assert!(words_of(0x1000, &bytes[..6]).is_none());
        let c = cqe_words(0x2000, &[7; 64]);
        let barriers: Vec<bool> = c.iter().map(|w| w.barrier).collect();
        assert_eq!(
            barriers,
            [true, false, false, false, false, false, false, true]
        );
    }
}
