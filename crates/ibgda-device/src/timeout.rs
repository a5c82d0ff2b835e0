//! Time bounds: the one range every timeout option must lie in, the one meaning of a zero bound
//! on the device, and deadlines that cannot overflow.
//!
//! - **Options and environment values** (a `Duration` in an options struct, `EP_*_TIMEOUT_S`)
//!   must lie in `(0, MAX_TIMEOUT]`: a zero bound is refused with an error, never read as "fail at
//!   once" nor as "wait forever", and nothing waits without a bound.
//! - **Device descriptors and kernel parameters** carry the bound as `timeout_ns: u64`, where 0
//!   means the default bound, [`DEFAULT_TIMEOUT_NS`](crate::protocol::DEFAULT_TIMEOUT_NS)
//!   (10 s), in every kernel: the protocol's waits (`ibgda_wait_bound_ns` in `qp_desc.cuh`), the
//!   EP kernels' waits, and the host model ([`wait_bound_ns`]). Hosts that validated their option
//!   never send 0; a descriptor left zeroed still waits a sane time.
//! - **Deadlines** are computed with [`deadline_after`], which saturates instead of panicking, and
//!   device waits compare elapsed time (`now - start > bound`), which cannot wrap.
//!
//! ```
//! use std::time::Duration;
//! use ibgda_device::timeout::{check, parse_secs, wait_bound_ns, MAX_TIMEOUT};
//!
//! assert_eq!(parse_secs("2.5").unwrap(), Duration::from_millis(2500));
//! assert!(parse_secs("0").is_err() && parse_secs("inf").is_err() && parse_secs("1e30").is_err());
//! assert!(check(Duration::ZERO).is_err() && check(MAX_TIMEOUT).is_ok());
//! assert_eq!(wait_bound_ns(0), 10_000_000_000);
//! ```

use std::time::{Duration, Instant};

use crate::protocol::DEFAULT_TIMEOUT_NS;

/// The longest time bound any option may ask for: a day. Longer means "never" in practice, and
/// the cap keeps every deadline and every nanosecond count far from overflowing.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// Why a time bound cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value} is not a usable time bound: {reason} (a bound must lie in (0, 86400] seconds)")]
pub struct InvalidTimeout {
    /// The value as given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// `bound` itself when it lies in `(0, MAX_TIMEOUT]`.
pub fn check(bound: Duration) -> Result<Duration, InvalidTimeout> {
    let bad = |reason| InvalidTimeout {
        value: format!("{bound:?}"),
        reason,
    };
    if bound.is_zero() {
        return Err(bad("zero (a zero bound would fail every wait at once)"));
    }
    if bound > MAX_TIMEOUT {
        return Err(bad("longer than a day"));
    }
    Ok(bound)
}

/// Parses a number of seconds (`"60"`, `"2.5"`) into a bound in `(0, MAX_TIMEOUT]`. NaN,
/// infinities, negative numbers, zero and values too large for a `Duration` are errors, never
/// panics.
pub fn parse_secs(text: &str) -> Result<Duration, InvalidTimeout> {
    let bad = |reason| InvalidTimeout {
        value: format!("{text:?} s"),
        reason,
    };
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| bad("not a number of seconds"))?;
    if !secs.is_finite() {
        return Err(bad("not finite"));
    }
    let d = Duration::try_from_secs_f64(secs).map_err(|_| bad("negative or too large"))?;
    check(d).map_err(|e| bad(e.reason))
}

/// `bound` in nanoseconds for a device descriptor or kernel parameter: never 0 for a non-zero
/// bound, at most [`MAX_TIMEOUT`] (larger bounds are capped rather than wrapped).
pub fn device_ns(bound: Duration) -> u64 {
    let ns = bound.min(MAX_TIMEOUT).as_nanos() as u64;
    if bound.is_zero() {
        DEFAULT_TIMEOUT_NS
    } else {
        ns.max(1)
    }
}

/// What a device wait with descriptor value `timeout_ns` waits: the value, or
/// [`DEFAULT_TIMEOUT_NS`] for 0. The host twin of `ibgda_wait_bound_ns` (`qp_desc.cuh`).
pub const fn wait_bound_ns(timeout_ns: u64) -> u64 {
    if timeout_ns == 0 {
        DEFAULT_TIMEOUT_NS
    } else {
        timeout_ns
    }
}

/// `start + bound`, or the latest instant this platform can represent near it when that sum
/// overflows (then the wait is, in practice, bounded only by [`MAX_TIMEOUT`] checks elsewhere).
pub fn deadline_after(start: Instant, bound: Duration) -> Instant {
    start
        .checked_add(bound)
        .or_else(|| start.checked_add(MAX_TIMEOUT))
        .unwrap_or(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_is_enforced() {
        assert!(check(Duration::ZERO).is_err());
        assert!(check(Duration::from_nanos(1)).is_ok());
        assert!(check(MAX_TIMEOUT).is_ok());
        assert!(check(MAX_TIMEOUT + Duration::from_nanos(1)).is_err());
        assert!(check(Duration::MAX).is_err());
    }

    #[test]
    fn parsing_never_panics() {
        for bad in [
            "", "x", "0", "-0", "-1", "NaN", "inf", "-inf", "1e300", "86401", "1e20",
        ] {
            let e = parse_secs(bad).unwrap_err();
            assert!(
                e.to_string().contains("not a usable time bound"),
                "{bad}: {e}"
            );
        }
        assert_eq!(parse_secs(" 60 ").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_secs("86400").unwrap(), MAX_TIMEOUT);
        assert_eq!(parse_secs("0.001").unwrap(), Duration::from_millis(1));
    }

    #[test]
    fn device_values_are_never_zero_and_never_wrap() {
        assert_eq!(device_ns(Duration::ZERO), DEFAULT_TIMEOUT_NS);
        assert_eq!(device_ns(Duration::from_nanos(1)), 1);
        assert_eq!(device_ns(Duration::MAX), MAX_TIMEOUT.as_nanos() as u64);
        assert_eq!(wait_bound_ns(0), DEFAULT_TIMEOUT_NS);
        assert_eq!(wait_bound_ns(5), 5);
    }

    #[test]
    fn deadlines_saturate() {
        let now = Instant::now();
        assert_eq!(
            deadline_after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        // Instant + Duration::MAX panics; this does not.
        let far = deadline_after(now, Duration::MAX);
        assert!(far >= now);
    }
}
