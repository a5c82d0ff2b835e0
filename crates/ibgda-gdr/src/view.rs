//! The interface the CPU proxy uses to read and write GPU-visible memory, whatever backs it.

use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};

/// A range of memory that both the CPU (through [`CpuView::cpu_ptr`]) and the GPU (through
/// [`CpuView::device_ptr`]) can reach: a GDRCopy mapping of GPU memory, or pinned host memory
/// mapped into the GPU.
///
/// Rust code reaches the memory only through the methods below, which use atomic accesses: the
/// GPU (or the NIC) writes it concurrently, so plain references to it would be unsound.
///
/// # Safety
/// Implementors guarantee that `cpu_ptr()` is 8-byte aligned and valid for reads and writes of
/// `len()` bytes for as long as the value lives, and that the range is not handed out as a Rust
/// reference anywhere.
pub unsafe trait CpuView: Send + Sync {
    /// CPU address of the first byte.
    fn cpu_ptr(&self) -> *mut u8;

    /// GPU address of the first byte (what kernels are given).
    fn device_ptr(&self) -> u64;

    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads the u64 at `offset` with acquire ordering (a GPU-raised producer slot, say).
    ///
    /// # Panics
    /// If `offset` is not 8-byte aligned or the u64 lies past the end.
    fn read_u64(&self, offset: usize) -> u64 {
        let p = checked_u64(self, offset);
        // SAFETY: `p` is aligned and inside the range (checked), valid per the trait contract, and
        // only ever accessed atomically by Rust code.
        unsafe { AtomicU64::from_ptr(p) }.load(Ordering::Acquire)
    }

    /// Writes the u64 at `offset` with release ordering.
    ///
    /// # Panics
    /// As [`CpuView::read_u64`].
    fn write_u64(&self, offset: usize, value: u64) {
        let p = checked_u64(self, offset);
        // SAFETY: as in `read_u64`.
        unsafe { AtomicU64::from_ptr(p) }.store(value, Ordering::Release);
    }

    /// Copies `dst.len()` bytes from `offset` (byte-wise relaxed loads, then an acquire fence).
    ///
    /// # Panics
    /// If the bytes lie past the end.
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        let base = checked_range(self, offset, dst.len());
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: inside the checked range; byte atomics need no alignment.
            *d = unsafe { AtomicU8::from_ptr(base.add(i)) }.load(Ordering::Relaxed);
        }
        fence(Ordering::Acquire);
    }

    /// Copies `src` to `offset` (a release fence, then byte-wise relaxed stores).
    ///
    /// # Panics
    /// If the bytes lie past the end.
    fn write_bytes(&self, offset: usize, src: &[u8]) {
        let base = checked_range(self, offset, src.len());
        fence(Ordering::Release);
        for (i, s) in src.iter().enumerate() {
            // SAFETY: as in `read_bytes`.
            unsafe { AtomicU8::from_ptr(base.add(i)) }.store(*s, Ordering::Relaxed);
        }
    }
}

fn checked_range<V: CpuView + ?Sized>(v: &V, offset: usize, len: usize) -> *mut u8 {
    let end = offset.checked_add(len).expect("offset + length overflows");
    assert!(
        end <= v.len(),
        "bytes {offset}..{end} lie past the end of a {}-byte view",
        v.len()
    );
    // In bounds (checked just above), so the offset pointer stays inside the allocation.
    v.cpu_ptr().wrapping_add(offset)
}

fn checked_u64<V: CpuView + ?Sized>(v: &V, offset: usize) -> *mut u64 {
    assert!(
        offset % 8 == 0,
        "u64 at offset {offset} is not 8-byte aligned"
    );
    checked_range(v, offset, 8).cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A view over a heap buffer, to test the default methods without a GPU.
    struct Heap(Box<[AtomicU64]>);

    // SAFETY: the boxed slice is 8-byte aligned, lives as long as the value, and is only
    // accessed through atomics.
    unsafe impl CpuView for Heap {
        fn cpu_ptr(&self) -> *mut u8 {
            self.0.as_ptr() as *mut u8
        }
        fn device_ptr(&self) -> u64 {
            0
        }
        fn len(&self) -> usize {
            self.0.len() * 8
        }
    }

    fn heap(words: usize) -> Heap {
        Heap((0..words).map(|_| AtomicU64::new(0)).collect())
    }

    #[test]
    fn u64_and_byte_access() {
        let v = heap(4);
        v.write_u64(8, 0x0102_0304_0506_0708);
        assert_eq!(v.read_u64(8), 0x0102_0304_0506_0708);
        v.write_bytes(17, &[9, 8, 7]);
        let mut b = [0u8; 3];
        v.read_bytes(17, &mut b);
        assert_eq!(b, [9, 8, 7]);
        let mut all = [0u8; 32];
        v.read_bytes(0, &mut all);
        assert_eq!(&all[8..16], &0x0102_0304_0506_0708u64.to_ne_bytes());
        assert!(!v.is_empty());
    }

    #[test]
    #[should_panic(expected = "not 8-byte aligned")]
    fn misaligned_u64_panics() {
        heap(2).read_u64(4);
    }

    #[test]
    #[should_panic(expected = "past the end")]
    fn out_of_range_panics() {
        heap(2).write_bytes(12, &[0; 8]);
    }
}
