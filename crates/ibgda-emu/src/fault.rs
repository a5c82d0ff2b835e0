//! Fault injection and shaping for tests: error CQEs on chosen WQEs, late completions, lost
//! doorbells, lost CQEs, a NIC that dies (its host stopped mid-operation), and a bandwidth cap
//! with per-operation latency to look like a real NIC.

use std::time::{Duration, Instant};

use ibgda_device::wire::syndrome;

/// Fail the `nth` WQE (1-based, counting every WQE the QP executes) of QP `qpn` with
/// `syndrome`, without executing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WqeFault {
    /// The QP.
    pub qpn: u32,
    /// Which WQE, 1-based.
    pub nth: u64,
    /// The CQE syndrome to report.
    pub syndrome: u8,
}

/// Ignore the `nth` doorbell (1-based) of QP `qpn`: the NIC does not learn that producer index
/// from it; the next doorbell with a larger index recovers every WQE up to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DoorbellDrop {
    /// The QP.
    pub qpn: u32,
    /// Which doorbell, 1-based. A doorbell is a poll that found a larger producer index, from
    /// any source.
    pub nth: u64,
}

/// Never write the `nth` CQE (1-based, every CQE the QP produces) of QP `qpn`: its slot is used
/// up and stays invalid, so a consumer that waits for it (quiet) must run into its time bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CqeLoss {
    /// The QP.
    pub qpn: u32,
    /// Which CQE, 1-based.
    pub nth: u64,
}

/// What to break or slow down. The default breaks nothing.
///
/// ```
/// use std::time::Duration;
/// use ibgda_emu::FaultPlan;
/// let plan = FaultPlan::default()
///     .fail_wqe(0x100, 3, ibgda_device::wire::syndrome::REMOTE_ACCESS_ERR)
///     .drop_doorbell(0x100, 1)
///     .delay_completions(Duration::from_micros(50));
/// assert_eq!(plan.wqe_errors.len(), 1);
/// // Peer death: this NIC runs 10 more WQEs, then nothing ever again.
/// let dead = FaultPlan::default().die_after_wqes(10);
/// assert_eq!(dead.die_after_wqes, Some(10));
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// WQEs to fail.
    pub wqe_errors: Vec<WqeFault>,
    /// Every CQE is written no earlier than this long after its WQE executed (and after its
    /// data landed).
    pub delay_completions: Duration,
    /// Doorbells to lose.
    pub dropped_doorbells: Vec<DoorbellDrop>,
    /// CQEs to lose.
    pub lost_cqes: Vec<CqeLoss>,
    /// Cap on the bytes per second the NIC moves, all QPs together, in GB/s (1e9 bytes).
    pub bandwidth_gbps: Option<f64>,
    /// Time from a doorbell to the start of each WQE it announced.
    pub per_op_latency: Duration,
    /// Peer death: the NIC executes this many more WQEs (all its QPs together, counted from when
    /// the plan was set) and then stops for good: no doorbell is read, no WQE executed and no
    /// CQE written after that, as when the node it sits in has died. `Some(0)`: dead at once.
    pub die_after_wqes: Option<u64>,
}

impl FaultPlan {
    /// Fails the `nth` WQE (1-based) of `qpn` with `syndrome`.
    pub fn fail_wqe(mut self, qpn: u32, nth: u64, syndrome: u8) -> Self {
        self.wqe_errors.push(WqeFault { qpn, nth, syndrome });
        self
    }

    /// Loses the `nth` doorbell (1-based) of `qpn`.
    pub fn drop_doorbell(mut self, qpn: u32, nth: u64) -> Self {
        self.dropped_doorbells.push(DoorbellDrop { qpn, nth });
        self
    }

    /// Loses the `nth` CQE (1-based) of `qpn`.
    pub fn lose_cqe(mut self, qpn: u32, nth: u64) -> Self {
        self.lost_cqes.push(CqeLoss { qpn, nth });
        self
    }

    /// Kills the NIC after `n` more WQEs (all QPs together): see
    /// [`die_after_wqes`](Self::die_after_wqes).
    pub fn die_after_wqes(mut self, n: u64) -> Self {
        self.die_after_wqes = Some(n);
        self
    }

    /// Whether a NIC that has executed `executed` WQEs under this plan is dead.
    pub(crate) fn dead(&self, executed: u64) -> bool {
        self.die_after_wqes.is_some_and(|n| executed >= n)
    }

    /// Delays every completion by `d`.
    pub fn delay_completions(mut self, d: Duration) -> Self {
        self.delay_completions = d;
        self
    }

    /// Caps bandwidth at `gbps` GB/s and adds `latency` to every operation.
    pub fn shape(mut self, gbps: f64, latency: Duration) -> Self {
        self.bandwidth_gbps = Some(gbps);
        self.per_op_latency = latency;
        self
    }

    /// A 400 Gb/s NIC: 50 GB/s and 2 µs per operation.
    pub fn nic_400g() -> Self {
        Self::default().shape(50.0, Duration::from_micros(2))
    }

    pub(crate) fn wqe_fault(&self, qpn: u32, nth: u64) -> Option<u8> {
        self.wqe_errors
            .iter()
            .find(|f| f.qpn == qpn && f.nth == nth)
            .map(|f| f.syndrome)
    }

    pub(crate) fn lost_cqes_of(&self, qpn: u32) -> Vec<u64> {
        self.lost_cqes
            .iter()
            .filter(|l| l.qpn == qpn)
            .map(|l| l.nth)
            .collect()
    }

    pub(crate) fn drops_doorbell(&self, qpn: u32, nth: u64) -> bool {
        self.dropped_doorbells
            .iter()
            .any(|d| d.qpn == qpn && d.nth == nth)
    }

    pub(crate) fn shaped(&self) -> bool {
        self.bandwidth_gbps.is_some() || !self.per_op_latency.is_zero()
    }

    /// How long `bytes` occupy the wire.
    pub(crate) fn wire_time(&self, bytes: u64) -> Duration {
        match self.bandwidth_gbps {
            // A tiny bandwidth gives a time too large for a Duration: cap it (at a day) instead
            // of panicking.
            Some(g) if g > 0.0 => Duration::try_from_secs_f64(bytes as f64 / (g * 1e9))
                .unwrap_or(ibgda_device::timeout::MAX_TIMEOUT)
                .min(ibgda_device::timeout::MAX_TIMEOUT),
            _ => Duration::ZERO,
        }
    }
}

/// The NIC's wire: when it is free again (shaping).
#[derive(Debug, Default)]
pub(crate) struct Wire {
    pub free_at: Option<Instant>,
}

impl Wire {
    /// Whether a WQE of `bytes` announced at `announced_at` may start now, and if so when its
    /// completion is due, or `None` if it may not start yet.
    ///
    /// The wire carries one WQE at a time at the plan's bandwidth, so a WQE starts once the
    /// wire is free (and not before it was announced); the latency is the time of flight, which
    /// overlaps the next WQE's transfer, so it delays the completion, not the wire. The
    /// emulator's own time from doorbell to landed data runs inside that latency instead of
    /// adding to it: a shaped NIC completes an operation `latency + bytes / bandwidth` after its
    /// doorbell, or when its data has landed if that is later.
    pub fn schedule(
        &mut self,
        plan: &FaultPlan,
        announced_at: Instant,
        bytes: u64,
        now: Instant,
    ) -> Option<Instant> {
        let start = match self.free_at {
            Some(f) => announced_at.max(f),
            None => announced_at,
        };
        if now < start {
            return None;
        }
        let through = ibgda_device::timeout::deadline_after(start, plan.wire_time(bytes));
        self.free_at = Some(through);
        Some(ibgda_device::timeout::deadline_after(
            through,
            plan.per_op_latency,
        ))
    }
}

/// The default syndrome of an injected WQE error.
pub const INJECTED_SYNDROME: u8 = syndrome::REMOTE_OP_ERR;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_serialises_transfers_and_latency_overlaps() {
        let plan = FaultPlan::default().shape(1.0, Duration::from_micros(10));
        let mut w = Wire::default();
        let t0 = Instant::now();
        // 1000 B at 1 GB/s: 1 µs on the wire, due 10 µs later.
        let due = w.schedule(&plan, t0, 1000, t0).unwrap();
        assert_eq!(due, t0 + Duration::from_micros(11));
        // The next one waits for the wire, not for the first one's latency.
        assert_eq!(w.schedule(&plan, t0, 1000, t0), None);
        let t1 = t0 + Duration::from_micros(1);
        assert_eq!(
            w.schedule(&plan, t0, 1000, t1),
            Some(t1 + Duration::from_micros(11))
        );
        // Announced later than the wire frees up: starts when announced.
        let t2 = t0 + Duration::from_micros(100);
        assert_eq!(w.schedule(&plan, t2, 1000, t1), None);
        assert!(w.schedule(&plan, t2, 1000, t2).is_some());
    }

    #[test]
    fn extreme_shapes_do_not_panic() {
        let plan = FaultPlan::default().shape(1e-30, Duration::MAX);
        assert_eq!(plan.wire_time(1 << 40), ibgda_device::timeout::MAX_TIMEOUT);
        let t0 = Instant::now();
        let mut wire = Wire::default();
        // Duration::MAX of latency: never due (no panic on `Instant + Duration`).
        let due = wire.schedule(&plan, t0, 64, t0).unwrap();
        assert!(due > t0 + Duration::from_secs(3600));
    }
}
