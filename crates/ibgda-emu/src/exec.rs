//! The WQE executor: checks every access against the registrations, then moves bytes through a
//! [`Lane`]. Backend-agnostic; nothing is touched unless every check of the WQE has passed.

use std::sync::Arc;
use std::time::Duration;

use ibgda_device::wire::{syndrome, Sge, WqeOp};

use crate::backend::{AtomicOp, Lane, Loc};
use crate::error::EmuError;
use crate::mr::{Access, Denied, Region, Registry};

/// Vendor syndromes (byte 54 of an error CQE) the emulator writes: its own codes, saying which
/// check failed. Hardware's vendor syndromes are undocumented; these are not them.
pub mod vendor_syndrome {
    /// Flushed because the QP was already in the error state.
    pub const FLUSH: u8 = 0x00;
    /// The WQE does not decode (bad DS, unknown opcode or opcode modifier).
    pub const BAD_WQE: u8 = 0xe0;
    /// A local key names no registration.
    pub const BAD_LKEY: u8 = 0xe1;
    /// A local range is outside its registration.
    pub const LOCAL_RANGE: u8 = 0xe2;
    /// The local registration lacks `LOCAL_WRITE` (atomic result buffer).
    pub const LOCAL_ACCESS: u8 = 0xe3;
    /// The remote key names no registration on the peer.
    pub const BAD_RKEY: u8 = 0xe4;
    /// The remote range is outside its registration.
    pub const REMOTE_RANGE: u8 = 0xe5;
    /// The remote registration lacks the right (`REMOTE_WRITE` / `REMOTE_ATOMIC`).
    pub const REMOTE_ACCESS: u8 = 0xe6;
    /// An atomic's remote address is not aligned to its operand size.
    pub const MISALIGNED: u8 = 0xe7;
    /// A length is wrong (message over 2 GiB, atomic result buffer not the operand size).
    pub const LENGTH: u8 = 0xe8;
    /// The WQE reaches past the producer index the doorbell announced.
    pub const PAST_PRODUCER: u8 = 0xe9;
    /// Injected by a [`FaultPlan`](crate::FaultPlan).
    pub const INJECTED: u8 = 0xea;
    /// The QP is connected to no peer.
    pub const NO_PEER: u8 = 0xeb;
    /// Strict mode: the control segment's QPN is not this QP's.
    pub const CTRL_QPN: u8 = 0xec;
    /// Strict mode: the control segment's WQE index is not the WQE's position in the ring.
    pub const CTRL_INDEX: u8 = 0xed;
    /// The responder QP was not granted the right (`qpc.rwe` / `rre` / `rae` off).
    pub const REMOTE_QP_ACCESS: u8 = 0xee;
    /// The backend failed (a CUDA call, a bounded wait).
    pub const BACKEND: u8 = 0xef;
}

/// Largest message a WQE may move (2 GiB, mlx5's `max_msg_sz`).
pub const MAX_MESSAGE: u64 = 1 << 31;

/// How the old value of a fetching atomic is written into the local result buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FetchOrder {
    /// As ConnectX configures it: standard 8-byte atomics (`ATOMIC_FA`, `ATOMIC_CS`) reply in
    /// host order (the driver's host-endianness requestor mode), masked atomics big-endian.
    #[default]
    Mlx5,
    /// Every reply big-endian.
    BigEndian,
    /// Every reply in host order.
    HostOrder,
}

impl FetchOrder {
    /// Whether the old value of `op` is written big-endian.
    pub(crate) fn reply_big_endian(self, op: &AtomicOp) -> bool {
        let masked = !matches!(
            op,
            AtomicOp::FetchAdd64 { .. } | AtomicOp::CompareSwap64 { .. }
        );
        match self {
            FetchOrder::Mlx5 => masked,
            FetchOrder::BigEndian => true,
            FetchOrder::HostOrder => false,
        }
    }
}

/// What executing a WQE came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It completed; `byte_count` is what a CQE reports.
    Done { byte_count: u32 },
    /// It failed: the CQE syndrome and the emulator's vendor syndrome.
    Failed { syndrome: u8, vendor: u8 },
}

impl Outcome {
    const fn failed(syndrome: u8, vendor: u8) -> Self {
        Outcome::Failed { syndrome, vendor }
    }
}

/// What the executor reads besides the WQE.
pub(crate) struct ExecCtx<'a> {
    pub local: &'a Registry,
    pub remote: Option<&'a Registry>,
    /// What the responder QP grants its peers (`None`: the QP was connected directly, without
    /// firmware access flags, and only registrations are checked).
    pub remote_qp_access: Option<Access>,
    pub fetch_order: FetchOrder,
    pub timeout: Duration,
}

fn local_denied(d: Denied) -> Outcome {
    let vendor = match d {
        Denied::Key => vendor_syndrome::BAD_LKEY,
        Denied::Range => vendor_syndrome::LOCAL_RANGE,
        Denied::Access => vendor_syndrome::LOCAL_ACCESS,
    };
    Outcome::failed(syndrome::LOCAL_PROT_ERR, vendor)
}

/// Checks the right against what the responder QP grants, then the remote range against the
/// peer's registrations. A QP not enabled for the operation rejects the request itself before
/// any key is looked at: Remote Invalid Request, as `ibv_poll_cq(3)` describes for
/// `qp_access_flags` that do not allow the operation.
fn remote_check(
    cx: &ExecCtx<'_>,
    peer: &Registry,
    rkey: u32,
    addr: u64,
    len: u64,
    need: Access,
) -> Result<(Loc, Arc<Region>), Outcome> {
    if cx
        .remote_qp_access
        .is_some_and(|granted| !granted.contains(need))
    {
        return Err(Outcome::failed(
            syndrome::REMOTE_INVAL_REQ_ERR,
            vendor_syndrome::REMOTE_QP_ACCESS,
        ));
    }
    peer.check_held(rkey, addr, len, need)
        .map_err(remote_denied)
}

fn remote_denied(d: Denied) -> Outcome {
    let vendor = match d {
        Denied::Key => vendor_syndrome::BAD_RKEY,
        Denied::Range => vendor_syndrome::REMOTE_RANGE,
        Denied::Access => vendor_syndrome::REMOTE_ACCESS,
    };
    Outcome::failed(syndrome::REMOTE_ACCESS_ERR, vendor)
}

/// The length a data segment's byte count means (0 is 2 GiB).
pub(crate) const fn sge_len(s: &Sge) -> u64 {
    if s.len == 0 {
        MAX_MESSAGE
    } else {
        s.len as u64
    }
}

/// Bytes a WQE moves over the wire, for bandwidth shaping (0 when it does not decode).
pub(crate) fn wire_bytes(op: &WqeOp<'_>) -> u64 {
    match op {
        WqeOp::RdmaWrite { sges, .. } => sges.iter().map(|s| sge_len(&s)).sum(),
        WqeOp::InlineWrite { data, .. } => data.len() as u64,
        WqeOp::FetchAdd64 { .. } | WqeOp::CompareSwap64 { .. } | WqeOp::MaskedFetchAdd64 { .. } => {
            8
        }
        WqeOp::MaskedFetchAdd32 { .. } | WqeOp::MaskedCompareSwap32 { .. } => 4,
        WqeOp::Nop | WqeOp::Other => 0,
    }
}

/// One change to memory a WQE makes once every check has passed: what [`plan`] produces and
/// [`apply`] performs. Strict mode holds effects back, cuts writes into chunks and reorders them
/// ([`crate::strict`]); otherwise they are applied at once, in order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Effect {
    /// Copy `len` bytes from `src` to `dst` (a gather entry of an RDMA write, or a chunk of one).
    Copy { dst: Loc, src: Loc, len: u64 },
    /// Write these bytes at `dst` (inline data, or a chunk of it).
    Put { dst: Loc, bytes: Vec<u8> },
    /// The atomic on `target`, its old value then written to `result`.
    Atomic {
        target: Loc,
        op: AtomicOp,
        result: Loc,
    },
}

impl Effect {
    /// Bytes a write effect places (0 for an atomic).
    pub fn len(&self) -> u64 {
        match self {
            Effect::Copy { len, .. } => *len,
            Effect::Put { bytes, .. } => bytes.len() as u64,
            Effect::Atomic { .. } => 0,
        }
    }

    /// The piece `[from, from + len)` of a write effect (`None` for an atomic).
    pub fn piece(&self, from: u64, len: u64) -> Option<Effect> {
        match self {
            Effect::Copy { dst, src, .. } => Some(Effect::Copy {
                dst: dst.offset(from),
                src: src.offset(from),
                len,
            }),
            Effect::Put { dst, bytes } => Some(Effect::Put {
                dst: dst.offset(from),
                bytes: bytes[from as usize..(from + len) as usize].to_vec(),
            }),
            Effect::Atomic { .. } => None,
        }
    }
}

/// What [`plan`] hands back for a WQE whose checks passed: its effects, and the registrations
/// they touch (held so that memory a registration owns outlives effects applied later).
#[derive(Debug, Default)]
pub(crate) struct Planned {
    pub effects: Vec<Effect>,
    pub held: Vec<Arc<Region>>,
}

/// Performs one effect through `lane`.
///
/// # Safety
/// The effect must come from [`plan`] (every range checked against a registration) and those
/// registrations must still be live.
pub(crate) unsafe fn apply(
    effect: &Effect,
    lane: &mut dyn Lane,
    fetch_order: FetchOrder,
    timeout: Duration,
) -> Result<(), EmuError> {
    match effect {
        // SAFETY: both ranges were checked against live registrations (the caller's promise).
        Effect::Copy { dst, src, len } => unsafe { lane.copy(*dst, *src, *len) },
        // SAFETY: as above.
        Effect::Put { dst, bytes } => unsafe { lane.put(*dst, bytes) },
        // SAFETY: the word was checked against a live registration and is aligned, the result
        // range against one with LOCAL_WRITE; registrations stay valid while a QP that could name
        // them has work in flight (`Nic::register_raw`'s contract), as for copies.
        Effect::Atomic { target, op, result } => unsafe {
            lane.atomic_into(*target, *op, *result, fetch_order, timeout)
        },
    }
}

/// Executes one decoded WQE at once: [`plan`], then [`apply`] of every effect in order. Returns
/// `Err` only when the backend itself failed.
pub(crate) fn execute(
    op: &WqeOp<'_>,
    cx: &ExecCtx<'_>,
    lane: &mut dyn Lane,
) -> Result<Outcome, EmuError> {
    let mut planned = Planned::default();
    let outcome = plan(op, cx, &mut planned);
    for e in &planned.effects {
        // SAFETY: `plan` checked every range against the registrations, which live while the
        // round that called this runs.
        unsafe { apply(e, lane, cx.fetch_order, cx.timeout)? };
    }
    Ok(outcome)
}

/// Checks one decoded WQE against the registrations and, when every check passes, pushes the
/// effects it has onto `out` (nothing is pushed for a failure).
pub(crate) fn plan(op: &WqeOp<'_>, cx: &ExecCtx<'_>, out: &mut Planned) -> Outcome {
    match op {
        WqeOp::Nop => Outcome::Done { byte_count: 0 },
        WqeOp::Other => Outcome::failed(syndrome::LOCAL_QP_OP_ERR, vendor_syndrome::BAD_WQE),
        WqeOp::RdmaWrite { remote, sges, .. } => {
            // Every local entry first (the NIC gathers before it sends), then the remote range.
            let mut srcs: Vec<(Loc, u64)> = Vec::with_capacity(sges.len());
            let mut total = 0u64;
            for s in sges.iter() {
                let len = sge_len(&s);
                match cx.local.check_held(s.lkey, s.addr, len, Access::NONE) {
                    Ok((loc, r)) => {
                        srcs.push((loc, len));
                        out.held.push(r);
                    }
                    Err(d) => {
                        out.held.clear();
                        return local_denied(d);
                    }
                }
                total += len;
            }
            if total > MAX_MESSAGE {
                out.held.clear();
                return Outcome::failed(syndrome::LOCAL_LENGTH_ERR, vendor_syndrome::LENGTH);
            }
            let Some(peer) = cx.remote else {
                out.held.clear();
                return no_peer();
            };
            let dst = match remote_check(
                cx,
                peer,
                remote.rkey,
                remote.addr,
                total,
                Access::REMOTE_WRITE,
            ) {
                Ok((loc, r)) => {
                    out.held.push(r);
                    loc
                }
                Err(denied) => {
                    out.held.clear();
                    return denied;
                }
            };
            let mut off = 0;
            for (src, len) in srcs {
                out.effects.push(Effect::Copy {
                    dst: dst.offset(off),
                    src,
                    len,
                });
                off += len;
            }
            Outcome::Done {
                byte_count: total as u32,
            }
        }
        WqeOp::InlineWrite { remote, data, .. } => {
            if data.is_empty() {
                // A zero-length write carries no key check on IB and touches nothing.
                return Outcome::Done { byte_count: 0 };
            }
            let Some(peer) = cx.remote else {
                return no_peer();
            };
            let len = data.len() as u64;
            match remote_check(
                cx,
                peer,
                remote.rkey,
                remote.addr,
                len,
                Access::REMOTE_WRITE,
            ) {
                Ok((dst, r)) => {
                    out.held.push(r);
                    out.effects.push(Effect::Put {
                        dst,
                        bytes: data.to_vec(),
                    });
                    Outcome::Done {
                        byte_count: len as u32,
                    }
                }
                Err(denied) => denied,
            }
        }
        WqeOp::FetchAdd64 { remote, fetch, add } => {
            atomic(cx, out, remote, fetch, AtomicOp::FetchAdd64 { add: *add })
        }
        WqeOp::CompareSwap64 {
            remote,
            fetch,
            swap,
            compare,
        } => atomic(
            cx,
            out,
            remote,
            fetch,
            AtomicOp::CompareSwap64 {
                swap: *swap,
                compare: *compare,
            },
        ),
        WqeOp::MaskedFetchAdd32 {
            remote,
            fetch,
            add,
            field_boundary,
        } => atomic(
            cx,
            out,
            remote,
            fetch,
            AtomicOp::MaskedFetchAdd32 {
                add: *add,
                field_boundary: *field_boundary,
            },
        ),
        WqeOp::MaskedCompareSwap32 {
            remote,
            fetch,
            swap,
            compare,
            swap_mask,
            compare_mask,
        } => atomic(
            cx,
            out,
            remote,
            fetch,
            AtomicOp::MaskedCompareSwap32 {
                swap: *swap,
                compare: *compare,
                swap_mask: *swap_mask,
                compare_mask: *compare_mask,
            },
        ),
        WqeOp::MaskedFetchAdd64 {
            remote,
            fetch,
            add,
            field_boundary,
        } => atomic(
            cx,
            out,
            remote,
            fetch,
            AtomicOp::MaskedFetchAdd64 {
                add: *add,
                field_boundary: *field_boundary,
            },
        ),
    }
}

fn no_peer() -> Outcome {
    Outcome::failed(syndrome::REMOTE_OP_ERR, vendor_syndrome::NO_PEER)
}

/// The bytes of an atomic's old value as the local result buffer receives them.
pub(crate) fn fetch_reply(op: &AtomicOp, old: u64, order: FetchOrder) -> Vec<u8> {
    let big = order.reply_big_endian(op);
    match (op.width(), big) {
        (4, true) => (old as u32).to_be_bytes().to_vec(),
        (4, false) => (old as u32).to_ne_bytes().to_vec(),
        (_, true) => old.to_be_bytes().to_vec(),
        (_, false) => old.to_ne_bytes().to_vec(),
    }
}

fn atomic(
    cx: &ExecCtx<'_>,
    out: &mut Planned,
    remote: &ibgda_device::wire::RemoteAddr,
    fetch: &Sge,
    op: AtomicOp,
) -> Outcome {
    let w = op.width() as u64;
    if fetch.len as u64 != w {
        return Outcome::failed(syndrome::LOCAL_LENGTH_ERR, vendor_syndrome::LENGTH);
    }
    let (result, held_result) =
        match cx
            .local
            .check_held(fetch.lkey, fetch.addr, w, Access::LOCAL_WRITE)
        {
            Ok(x) => x,
            Err(d) => return local_denied(d),
        };
    let Some(peer) = cx.remote else {
        return no_peer();
    };
    let (target, held_target) =
        match remote_check(cx, peer, remote.rkey, remote.addr, w, Access::REMOTE_ATOMIC) {
            Ok(x) => x,
            Err(denied) => return denied,
        };
    // The registered address, and the backing address (an odd IPC mapping could disagree).
    if remote.addr % w != 0 || target.addr() % w != 0 {
        return Outcome::failed(syndrome::REMOTE_INVAL_REQ_ERR, vendor_syndrome::MISALIGNED);
    }
    out.effects.push(Effect::Atomic { target, op, result });
    out.held.extend([held_result, held_target]);
    Outcome::Done {
        byte_count: w as u32,
    }
}
