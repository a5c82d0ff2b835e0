//! The seam between the NIC engine and memory: [`MemoryBackend`] (synchronous reads of rings and
//! doorbell words, allocation of host pages the NIC polls) and [`Lane`] (one per QP: the ordered
//! stream of data movement that keeps reliable-connection order).
//!
//! The engine checks keys, bounds and access rights *before* it calls a backend, so backends
//! trust the ranges they are given; that is why their data-path methods are `unsafe`.

use std::fmt;
use std::time::Duration;

use crate::error::EmuError;
use crate::exec::{fetch_reply, FetchOrder};
use crate::host::HostBuffer;

/// Where a byte range lives, as the emulator's thread reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Loc {
    /// Host-addressable memory: the NIC thread reads and writes it with CPU loads and stores
    /// (host RAM, pinned host memory, a host mapping of anything).
    Host(u64),
    /// GPU memory, reached with copies (CUDA backend only). The address is a CUDA unified
    /// address valid in this process (own allocation, a peer GPU's, or an IPC mapping).
    Device(u64),
}

impl Loc {
    /// The address.
    pub const fn addr(self) -> u64 {
        match self {
            Loc::Host(a) | Loc::Device(a) => a,
        }
    }

    /// The same kind of location `by` bytes further.
    pub const fn offset(self, by: u64) -> Loc {
        match self {
            Loc::Host(a) => Loc::Host(a.wrapping_add(by)),
            Loc::Device(a) => Loc::Device(a.wrapping_add(by)),
        }
    }

    /// Whether the CPU can load and store it directly.
    pub const fn is_host(self) -> bool {
        matches!(self, Loc::Host(_))
    }
}

/// An atomic read-modify-write on a remote 4- or 8-byte word, values in host order.
///
/// The target word is read and written in the host's byte order (little-endian), as the GPU and
/// the receivers that poll it see it; the WQE carries the operands big-endian and the decoder
/// has already converted them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicOp {
    /// 64-bit fetch-add.
    FetchAdd64 {
        /// Addend.
        add: u64,
    },
    /// 64-bit compare-swap: writes `swap` when the word equals `compare`.
    CompareSwap64 {
        /// New value.
        swap: u64,
        /// Expected value.
        compare: u64,
    },
    /// 32-bit fetch-add whose carries stop at the set bits of `field_boundary`.
    MaskedFetchAdd32 {
        /// Addend.
        add: u32,
        /// A set bit ends a field: the carry out of it is dropped.
        field_boundary: u32,
    },
    /// 32-bit masked compare-swap.
    MaskedCompareSwap32 {
        /// New bits.
        swap: u32,
        /// Expected bits.
        compare: u32,
        /// Which bits of `swap` are written.
        swap_mask: u32,
        /// Which bits of `compare` are compared.
        compare_mask: u32,
    },
    /// 64-bit fetch-add whose carries stop at the set bits of `field_boundary`.
    MaskedFetchAdd64 {
        /// Addend.
        add: u64,
        /// A set bit ends a field: the carry out of it is dropped.
        field_boundary: u64,
    },
}

impl AtomicOp {
    /// Operand size in bytes (4 or 8).
    pub const fn width(&self) -> usize {
        match self {
            AtomicOp::MaskedFetchAdd32 { .. } | AtomicOp::MaskedCompareSwap32 { .. } => 4,
            _ => 8,
        }
    }

    /// The value the word holds after the operation, given the value `old` it held before
    /// (32-bit operations use and return the low 32 bits).
    pub fn apply(&self, old: u64) -> u64 {
        match *self {
            AtomicOp::FetchAdd64 { add } => old.wrapping_add(add),
            AtomicOp::CompareSwap64 { swap, compare } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            AtomicOp::MaskedFetchAdd32 {
                add,
                field_boundary,
            } => field_add(old & 0xffff_ffff, add as u64, field_boundary as u64, 32),
            AtomicOp::MaskedCompareSwap32 {
                swap,
                compare,
                swap_mask,
                compare_mask,
            } => {
                let old = old as u32;
                if (old ^ compare) & compare_mask == 0 {
                    ((old & !swap_mask) | (swap & swap_mask)) as u64
                } else {
                    old as u64
                }
            }
            AtomicOp::MaskedFetchAdd64 {
                add,
                field_boundary,
            } => field_add(old, add, field_boundary, 64),
        }
    }
}

/// Adds `a` and `b` over `bits` bits, dropping the carry out of every bit set in `boundary`.
fn field_add(a: u64, b: u64, boundary: u64, bits: u32) -> u64 {
    let mut out = 0u64;
    let mut carry = 0u64;
    for i in 0..bits {
        let (x, y) = ((a >> i) & 1, (b >> i) & 1);
        out |= (x ^ y ^ carry) << i;
        carry = (x & y) | (x & carry) | (y & carry);
        if (boundary >> i) & 1 == 1 {
            carry = 0;
        }
    }
    out
}

/// A point in a lane's order: everything enqueued before it has landed once
/// [`Lane::landed`] says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mark(pub u64);

/// What the engine needs from memory outside the data path.
pub trait MemoryBackend: Send + Sync + fmt::Debug {
    /// A short name for messages ("host", "cuda").
    fn name(&self) -> &'static str;

    /// A new ordered lane (one per QP).
    fn new_lane(&self) -> Result<Box<dyn Lane>, EmuError>;

    /// Copies `out.len()` bytes at `src` into `out`, as memory is now (ring slots, doorbell
    /// words). Synchronous.
    ///
    /// # Safety
    /// `src .. src + out.len()` must be readable memory of the kind `src` names for the whole
    /// call.
    unsafe fn read(&self, src: Loc, out: &mut [u8]) -> Result<(), EmuError>;

    /// Zeroed host memory that this backend's GPU code can also store to (pinned and mapped on
    /// CUDA): emulated UAR pages.
    fn alloc_host(&self, len: usize) -> Result<HostBuffer, EmuError>;

    /// Whether [`Loc::Device`] locations are supported.
    fn supports_device(&self) -> bool;

    /// Binds whatever the calling thread needs (the CUDA context) before other calls.
    fn bind_thread(&self) -> Result<(), EmuError>;
}

/// One QP's ordered data movement. Operations land in the order they were enqueued.
pub trait Lane: Send + fmt::Debug {
    /// Enqueues a copy of `len` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges must be valid memory of the kinds they name until the copy has landed.
    unsafe fn copy(&mut self, dst: Loc, src: Loc, len: u64) -> Result<(), EmuError>;

    /// Enqueues writing `bytes` (captured now) at `dst`.
    ///
    /// # Safety
    /// `dst .. dst + bytes.len()` must be writable memory of the kind it names until it lands.
    unsafe fn put(&mut self, dst: Loc, bytes: &[u8]) -> Result<(), EmuError>;

    /// Performs `op` on the word at `target` after everything enqueued before it has landed and
    /// returns the old value. Atomic with respect to every other emulator atomic in this process
    /// (see the crate docs for what holds on GPU memory).
    ///
    /// # Safety
    /// `target` must be valid, writable and aligned to `op.width()`.
    unsafe fn atomic(
        &mut self,
        target: Loc,
        op: AtomicOp,
        timeout: Duration,
    ) -> Result<u64, EmuError>;

    /// Performs `op` on the word at `target` after everything enqueued before it has landed,
    /// and writes its old value, as `order` formats it, to `result`; everything enqueued after
    /// lands after both. May return before either has happened (the CUDA lane defers atomics on
    /// GPU memory: [`poll`](Lane::poll) and [`fence`](Lane::fence) finish them).
    ///
    /// # Safety
    /// As [`atomic`](Lane::atomic) for `target`, and `result` must be valid and writable for
    /// `op.width()` bytes until the atomic has completed.
    unsafe fn atomic_into(
        &mut self,
        target: Loc,
        op: AtomicOp,
        result: Loc,
        order: FetchOrder,
        timeout: Duration,
    ) -> Result<(), EmuError> {
        // SAFETY: forwarded from the caller.
        unsafe { atomic_then_put(self, target, op, result, order, timeout) }
    }

    /// Hands everything gathered so far to the hardware (the engine calls it at the end of every
    /// round). Lanes that act at once have nothing to do.
    fn flush(&mut self) -> Result<(), EmuError> {
        Ok(())
    }

    /// A point between two WQEs whose writes must land in WQE order (the engine calls it after
    /// every WQE unless strict mode reorders): writes gathered before it land before any
    /// enqueued after it.
    fn order_point(&mut self) -> Result<(), EmuError> {
        Ok(())
    }

    /// Everything gathered so far, atomics included, lands before anything enqueued after (the
    /// engine calls it before a fenced WQE).
    fn barrier(&mut self) -> Result<(), EmuError> {
        Ok(())
    }

    /// Whether writes may land before an earlier atomic of the QP that has not been performed
    /// yet (strict mode's relaxed ordering; the engine sets it once, at QP creation).
    fn set_relaxed(&mut self, _relaxed: bool) {}

    /// Host-side work the lane owes (deferred atomics to compute); returns whether it did some
    /// or still owes some, so that the progress thread keeps coming back.
    fn poll(&mut self) -> Result<bool, EmuError> {
        Ok(false)
    }

    /// Whether the lane still owes host-side work ([`poll`](Lane::poll)).
    fn busy(&self) -> bool {
        false
    }

    /// The lane's ordering state in one line, for a stuck QP's status (empty when it has none
    /// worth telling).
    fn describe(&self) -> String {
        String::new()
    }

    /// Enqueues writing a 64-byte CQE at `dst` (a device CQ), ordered after everything enqueued
    /// before, with its last 8 bytes (the owner byte) landing last.
    ///
    /// # Safety
    /// `dst` must be a valid, 8-byte aligned CQE slot.
    unsafe fn put_cqe(&mut self, dst: Loc, cqe: &[u8; 64]) -> Result<(), EmuError>;

    /// Whether [`put_cqe`](Lane::put_cqe) to `dst` is ordered behind this lane's earlier data
    /// without the engine waiting (true for the host lane, and for device CQs on CUDA). When it
    /// is not, the engine holds the CQE until a [`mark`](Lane::mark) has landed.
    fn cqe_in_order(&self, dst: Loc) -> bool;

    /// A mark after everything enqueued so far.
    fn mark(&mut self) -> Result<Mark, EmuError>;

    /// Whether everything before `mark` has landed.
    fn landed(&mut self, mark: Mark) -> Result<bool, EmuError>;

    /// Waits until everything enqueued has landed, at most `timeout`.
    fn fence(&mut self, timeout: Duration) -> Result<(), EmuError>;
}

/// [`Lane::atomic_into`] done at once: [`Lane::atomic`], then [`Lane::put`] of the old value as
/// `order` formats it. The default, and what a lane that defers some atomics does with the rest.
///
/// # Safety
/// As [`Lane::atomic_into`].
pub(crate) unsafe fn atomic_then_put<L: Lane + ?Sized>(
    lane: &mut L,
    target: Loc,
    op: AtomicOp,
    result: Loc,
    order: FetchOrder,
    timeout: Duration,
) -> Result<(), EmuError> {
    // SAFETY: forwarded from the caller.
    let old = unsafe { lane.atomic(target, op, timeout)? };
    let reply = fetch_reply(&op, old, order);
    // SAFETY: forwarded from the caller.
    unsafe { lane.put(result, &reply) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_add_without_boundaries_is_plain_add() {
        for (a, b) in [(1u64, 2u64), (u64::MAX, 1), (0x8000_0000, 0x8000_0000)] {
            assert_eq!(field_add(a, b, 0, 64), a.wrapping_add(b));
            assert_eq!(
                field_add(a & 0xffff_ffff, b & 0xffff_ffff, 0, 32),
                (a as u32).wrapping_add(b as u32) as u64
            );
        }
    }

    #[test]
    fn field_boundaries_stop_carries() {
        // Two 16-bit fields in a 32-bit word: the low field overflows without touching the high.
        let op = AtomicOp::MaskedFetchAdd32 {
            add: 0x0001_0001,
            field_boundary: 0x8000_8000,
        };
        assert_eq!(op.apply(0x0005_ffff), 0x0006_0000);
        let op = AtomicOp::MaskedFetchAdd64 {
            add: 1,
            field_boundary: 1 << 7,
        };
        assert_eq!(op.apply(0xff), 0x00);
    }

    #[test]
    fn masked_compare_swap() {
        let op = AtomicOp::MaskedCompareSwap32 {
            swap: 0xaaaa_aaaa,
            compare: 0x0000_00ff,
            swap_mask: 0xffff_0000,
            compare_mask: 0x0000_00ff,
        };
        assert_eq!(op.apply(0x1234_56ff), 0xaaaa_56ff);
        assert_eq!(op.apply(0x1234_5600), 0x1234_5600);
    }
}
