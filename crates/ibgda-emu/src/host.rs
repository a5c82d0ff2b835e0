//! The host backend ([`HostMemory`]: rings, doorbells and data in host memory, driven by host
//! threads; what CI runs) and [`HostBuffer`], host memory the NIC may touch.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;

use crate::backend::{AtomicOp, Lane, Loc, Mark, MemoryBackend};
use crate::error::EmuError;

/// Zeroed host memory with a stable address, aligned to 4096 bytes, that the NIC may read and
/// write while the program runs (a ring, a CQ, a doorbell record, a data buffer, a UAR page).
///
/// Either plain heap memory ([`HostBuffer::new`]) or, on a GPU machine, pinned memory mapped
/// into every GPU's address space ([`HostBuffer::pinned`]), which GPU code can load from and
/// store to ([`device_addr`](HostBuffer::device_addr)).
///
/// Like a buffer under DMA, its bytes change behind the program's back while the NIC works on
/// them; the accessors copy bytes in and out and never hand out references.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    kind: HostKind,
}

#[derive(Debug)]
enum HostKind {
    Heap(Layout),
    Pinned {
        ctx: Arc<CudaContext>,
        device_ptr: u64,
    },
}

// SAFETY: the buffer owns its allocation; all access goes through raw-pointer copies and atomics
// (the same discipline as memory a NIC writes by DMA), and the pinned kind's context is Send.
unsafe impl Send for HostBuffer {}
// SAFETY: as for Send; `&self` methods only copy bytes or use atomics.
unsafe impl Sync for HostBuffer {}

const HOST_ALIGN: usize = 4096;

impl HostBuffer {
    /// `len` zeroed bytes (at least 1) of heap memory.
    pub fn new(len: usize) -> Self {
        let layout =
            Layout::from_size_align(len.max(1), HOST_ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr,
            len,
            kind: HostKind::Heap(layout),
        }
    }

    /// `len` zeroed bytes of pinned host memory mapped into the address space of every GPU
    /// (`cuMemHostAlloc(PORTABLE | DEVICEMAP)`), so that GPU code can store to it.
    pub fn pinned(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, EmuError> {
        use cudarc::driver::sys;
        ctx.bind_to_thread()
            .map_err(EmuError::cuda("cuCtxSetCurrent"))?;
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        let len1 = len.max(1);
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: `raw` is a valid out-pointer and the context is current.
        unsafe { sys::cuMemHostAlloc(&mut raw, len1, flags) }
            .result()
            .map_err(EmuError::cuda("cuMemHostAlloc"))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| EmuError::BadConfig("cuMemHostAlloc returned a null pointer".into()))?;
        let mut device_ptr = 0u64;
        // SAFETY: `raw` was just allocated with DEVICEMAP; `device_ptr` is a valid out-pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, raw, 0) }.result();
        if let Err(e) = r {
            // SAFETY: `raw` came from cuMemHostAlloc above and is freed once, here.
            let _ = unsafe { sys::cuMemFreeHost(raw) };
            return Err(EmuError::cuda("cuMemHostGetDevicePointer")(e));
        }
        // SAFETY: the allocation is `len1` bytes long and exclusively ours.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len1) };
        Ok(Self {
            ptr,
            len,
            kind: HostKind::Pinned {
                ctx: ctx.clone(),
                device_ptr,
            },
        })
    }

    /// The host address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The address GPU code uses for the same bytes (pinned buffers only; with unified
    /// addressing it equals [`addr`](Self::addr)).
    pub fn device_addr(&self) -> Option<u64> {
        match self.kind {
            HostKind::Heap(_) => None,
            HostKind::Pinned { device_ptr, .. } => Some(device_ptr),
        }
    }

    /// Whether the buffer is pinned and mapped for GPUs.
    pub fn is_pinned(&self) -> bool {
        matches!(self.kind, HostKind::Pinned { .. })
    }

    /// The location of byte `offset`, for QP configuration.
    pub fn loc(&self, offset: usize) -> Loc {
        Loc::Host(self.addr() + offset as u64)
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "range {offset}+{len} outside a host buffer of {} bytes",
            self.len
        );
    }

    /// Copies bytes out, starting at `offset`. Panics outside the buffer.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: the range is inside the live allocation; `out` is a distinct Rust buffer.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) }
    }

    /// Copies `bytes` in at `offset`. Panics outside the buffer.
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        self.check(offset, bytes.len());
        // SAFETY: the range is inside the live allocation; `bytes` is a distinct Rust buffer.
        unsafe { std::ptr::copy(bytes.as_ptr(), self.ptr.as_ptr().add(offset), bytes.len()) }
    }

    /// All bytes, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v);
        v
    }

    /// `len` bytes from `offset`, copied.
    pub fn read_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.read(offset, &mut v);
        v
    }

    /// Sets every byte to `value`.
    pub fn fill(&self, value: u8) {
        // SAFETY: the whole live allocation is written.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), value, self.len) }
    }

    fn atomic64(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8);
        assert!(offset % 8 == 0, "unaligned 8-byte access at {offset}");
        // SAFETY: in bounds, 8-byte aligned (the base is 4096-aligned), and the memory lives as
        // long as `self`; all concurrent access to it is atomic or a DMA-like copy.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(offset).cast()) }
    }

    fn atomic32(&self, offset: usize) -> &AtomicU32 {
        self.check(offset, 4);
        assert!(offset % 4 == 0, "unaligned 4-byte access at {offset}");
        // SAFETY: as for `atomic64`, with 4-byte alignment.
        unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast()) }
    }

    /// Atomic (acquire) load of the native-endian `u64` at `offset` (8-byte aligned).
    pub fn load_u64(&self, offset: usize) -> u64 {
        self.atomic64(offset).load(Ordering::Acquire)
    }

    /// Atomic (release) store of a native-endian `u64` at `offset` (8-byte aligned): how a
    /// doorbell word or a producer slot is written.
    pub fn store_u64(&self, offset: usize, value: u64) {
        self.atomic64(offset).store(value, Ordering::Release)
    }

    /// Atomic (acquire) load of the native-endian `u32` at `offset` (4-byte aligned).
    pub fn load_u32(&self, offset: usize) -> u32 {
        self.atomic32(offset).load(Ordering::Acquire)
    }

    /// Atomic (release) store of a native-endian `u32` at `offset` (4-byte aligned): how a
    /// doorbell record's send counter is written.
    pub fn store_u32(&self, offset: usize, value: u32) {
        self.atomic32(offset).store(value, Ordering::Release)
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match &self.kind {
            // SAFETY: allocated in `new` with this layout, freed once, here.
            HostKind::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            HostKind::Pinned { ctx, .. } => {
                if ctx.bind_to_thread().is_ok() {
                    // SAFETY: allocated by cuMemHostAlloc in `pinned`, freed once, here.
                    let _ = unsafe { cudarc::driver::sys::cuMemFreeHost(self.ptr.as_ptr().cast()) };
                }
            }
        }
    }
}

/// Writes a 64-byte CQE into host memory the way hardware makes it visible: bytes 0..56 first,
/// then the last 8 (wqe_counter, signature, op_own) with one release store, so a poller that
/// sees the new owner bit also sees the rest.
///
/// # Safety
/// `addr` must be an 8-byte aligned, writable 64-byte slot.
pub(crate) unsafe fn store_cqe_host(addr: u64, cqe: &[u8; 64]) {
    let p = addr as *mut u8;
    // SAFETY: the caller guarantees the slot; the source is a distinct local array.
    unsafe { std::ptr::copy_nonoverlapping(cqe.as_ptr(), p, 56) };
    let tail = u64::from_ne_bytes(cqe[56..].try_into().expect("8 bytes"));
    // SAFETY: `p + 56` is 8-byte aligned (the slot is) and inside the slot.
    unsafe { AtomicU64::from_ptr(p.add(56).cast()) }.store(tail, Ordering::Release);
}

/// Reads a host word with an acquire load (doorbell records, UAR slots, producer slots).
///
/// # Safety
/// `addr` must be valid and aligned for `T`'s size (4 or 8).
pub(crate) unsafe fn load_host_u32(addr: u64) -> u32 {
    // SAFETY: guaranteed by the caller.
    unsafe { AtomicU32::from_ptr(addr as *mut u32) }.load(Ordering::Acquire)
}

/// See [`load_host_u32`].
///
/// # Safety
/// `addr` must be valid and 8-byte aligned.
pub(crate) unsafe fn load_host_u64(addr: u64) -> u64 {
    // SAFETY: guaranteed by the caller.
    unsafe { AtomicU64::from_ptr(addr as *mut u64) }.load(Ordering::Acquire)
}

/// A CPU atomic read-modify-write on host memory; returns the old value.
///
/// # Safety
/// `addr` must be valid, writable and aligned to `op.width()`.
pub(crate) unsafe fn host_atomic(addr: u64, op: AtomicOp) -> u64 {
    if op.width() == 8 {
        // SAFETY: guaranteed by the caller.
        let a = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        match a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
            Some(op.apply(old))
        }) {
            Ok(old) | Err(old) => old,
        }
    } else {
        // SAFETY: guaranteed by the caller.
        let a = unsafe { AtomicU32::from_ptr(addr as *mut u32) };
        let r = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
            Some(op.apply(old as u64) as u32)
        });
        match r {
            Ok(old) | Err(old) => old as u64,
        }
    }
}

/// The host backend: every address is a host address and every operation happens at once, on
/// the NIC's thread. Atomics are CPU atomics, so they are atomic against other host threads too.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMemory;

impl HostMemory {
    fn host(loc: Loc) -> Result<u64, EmuError> {
        match loc {
            Loc::Host(a) => Ok(a),
            Loc::Device(_) => Err(EmuError::Unsupported {
                backend: "host",
                what: "reach GPU memory",
            }),
        }
    }
}

impl MemoryBackend for HostMemory {
    fn name(&self) -> &'static str {
        "host"
    }

    fn new_lane(&self) -> Result<Box<dyn Lane>, EmuError> {
        Ok(Box::new(HostLane { marks: 0 }))
    }

    unsafe fn read(&self, src: Loc, out: &mut [u8]) -> Result<(), EmuError> {
        let a = Self::host(src)?;
        // SAFETY: the caller guarantees the source range.
        unsafe { std::ptr::copy(a as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuffer, EmuError> {
        Ok(HostBuffer::new(len))
    }

    fn supports_device(&self) -> bool {
        false
    }

    fn bind_thread(&self) -> Result<(), EmuError> {
        Ok(())
    }
}

/// The host backend's lane: operations land before the call returns.
#[derive(Debug)]
struct HostLane {
    marks: u64,
}

impl Lane for HostLane {
    unsafe fn copy(&mut self, dst: Loc, src: Loc, len: u64) -> Result<(), EmuError> {
        let (d, s) = (HostMemory::host(dst)?, HostMemory::host(src)?);
        // SAFETY: the caller guarantees both ranges; `copy` allows them to overlap.
        unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len as usize) };
        Ok(())
    }

    unsafe fn put(&mut self, dst: Loc, bytes: &[u8]) -> Result<(), EmuError> {
        let d = HostMemory::host(dst)?;
        // SAFETY: the caller guarantees the destination; `bytes` is a distinct Rust buffer.
        unsafe { std::ptr::copy(bytes.as_ptr(), d as *mut u8, bytes.len()) };
        Ok(())
    }

    unsafe fn atomic(&mut self, target: Loc, op: AtomicOp, _: Duration) -> Result<u64, EmuError> {
        let a = HostMemory::host(target)?;
        // SAFETY: the caller guarantees a valid, aligned word.
        Ok(unsafe { host_atomic(a, op) })
    }

    unsafe fn put_cqe(&mut self, dst: Loc, cqe: &[u8; 64]) -> Result<(), EmuError> {
        let d = HostMemory::host(dst)?;
        // SAFETY: the caller guarantees an aligned slot.
        unsafe { store_cqe_host(d, cqe) };
        Ok(())
    }

    fn cqe_in_order(&self, _: Loc) -> bool {
        true
    }

    fn mark(&mut self) -> Result<Mark, EmuError> {
        self.marks += 1;
        Ok(Mark(self.marks))
    }

    fn landed(&mut self, _: Mark) -> Result<bool, EmuError> {
        Ok(true)
    }

    fn fence(&mut self, _: Duration) -> Result<(), EmuError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_round_trips_and_is_aligned() {
        let b = HostBuffer::new(100);
        assert_eq!(b.addr() % 4096, 0);
        assert!(b.to_vec().iter().all(|&x| x == 0));
        b.write(3, b"abc");
        assert_eq!(b.read_vec(3, 3), b"abc");
        b.store_u64(8, 0x1122_3344_5566_7788);
        assert_eq!(b.load_u64(8), 0x1122_3344_5566_7788);
        b.store_u32(16, 7);
        assert_eq!(b.load_u32(16), 7);
        assert!(b.device_addr().is_none());
    }

    #[test]
    #[should_panic(expected = "outside a host buffer")]
    fn out_of_range_panics() {
        HostBuffer::new(8).write(6, b"abc");
    }

    #[test]
    fn cqe_tail_lands_last_and_whole() {
        let b = HostBuffer::new(64);
        let mut cqe = [0u8; 64];
        for (i, x) in cqe.iter_mut().enumerate() {
            *x = i as u8;
        }
        // SAFETY: the slot is the buffer's first 64 bytes, 4096-aligned.
        unsafe { store_cqe_host(b.addr(), &cqe) };
        assert_eq!(b.to_vec(), cqe);
    }

    #[test]
    fn host_atomics() {
        let b = HostBuffer::new(16);
        b.store_u64(0, 5);
        // SAFETY: aligned words inside the buffer.
        unsafe {
            assert_eq!(host_atomic(b.addr(), AtomicOp::FetchAdd64 { add: 3 }), 5);
            assert_eq!(
                host_atomic(
                    b.addr() + 8,
                    AtomicOp::MaskedFetchAdd32 {
                        add: 2,
                        field_boundary: 0
                    }
                ),
                0
            );
        }
        assert_eq!(b.load_u64(0), 8);
        assert_eq!(b.load_u32(8), 2);
    }
}
