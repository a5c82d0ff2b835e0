//! What the kernels report, as [`EpError`]s.

use std::time::Duration;

use ep_kernels::low_latency as k;

use crate::error::EpError;
use crate::transport::TransportError;

/// Error code of a timed-out device wait (shared with the intranode kernels).
const ERR_TIMEOUT: u32 = ep_kernels::intranode::error_code::TIMEOUT;

/// What [`device_error`] needs to know about the buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceErrorContext {
    pub(super) rank: usize,
    pub(super) num_experts: usize,
    /// Operations queued so far (the "epoch" of a timeout).
    pub(super) calls: u64,
    pub(super) timeout: Duration,
    /// The NIC-handler mode, with the transport.
    pub(super) mode: Option<&'static str>,
}

/// The error a low-latency kernel recorded in `w` (see [`k::error_code`] for what each code puts
/// in which field); `record` is the QP group's own record of a transport failure, if it kept one.
pub(super) fn device_error(
    c: &DeviceErrorContext,
    w: &ep_kernels::intranode::ErrorWord,
    record: Option<(usize, TransportError)>,
) -> EpError {
    let rank = c.rank;
    let peer = w.peer as usize;
    match w.code {
        k::error_code::BAD_EXPERT => EpError::ExpertIdOutOfRange {
            rank,
            op: if w.what & k::BAD_EXPERT_IN_COMBINE != 0 {
                "low-latency combine"
            } else {
                "low-latency dispatch"
            },
            id: w.epoch as i64,
            token: w.detail as usize,
            slot: Some((w.what & !k::BAD_EXPERT_IN_COMBINE) as usize),
            count: None,
            num_experts: c.num_experts,
        },
        k::error_code::TOPK_MISMATCH => EpError::TopkMismatch {
            rank,
            token: w.epoch as usize,
            slot: w.what as usize,
            dispatched: i64::from((w.detail >> 32) as u32 as i32),
            combined: i64::from(w.detail as u32 as i32),
        },
        k::error_code::BAD_ROUTING => EpError::CorruptRouting {
            rank,
            what: match w.what {
                k::routing_what::LAYOUT_OFFSET => "layout_range offset",
                k::routing_what::LAYOUT_COUNT => "layout_range count",
                k::routing_what::SRC_INFO => "src_info",
                _ => "routing value",
            },
            index: w.epoch,
            value: w.detail as i64,
            limit: u64::from(w.peer),
        },
        k::error_code::TRANSPORT => {
            let call = match w.what {
                k::transport_what::PUT => "ibgda_put_warp (rows)",
                k::transport_what::SIGNAL => "ibgda_signal_add (count or flag)",
                k::transport_what::QUIET => "ibgda_quiet",
                _ => "a transport call",
            };
            let (peer, source) = match record {
                Some((r, e)) => (r, Some(Box::new(e))),
                None => (peer, None),
            };
            EpError::Transport {
                rank,
                peer: Some(peer),
                what: format!(
                    "mode {}: {call} returned status {:#x} on QP key {}",
                    c.mode.unwrap_or("?"),
                    w.epoch,
                    w.detail
                ),
                source,
            }
        }
        ERR_TIMEOUT => EpError::PeerTimeout {
            rank,
            peer,
            what: match w.what {
                k::wait_what::SEND_DONE => {
                    "low-latency dispatch send: this rank's warps finishing the tokens for an expert"
                }
                k::wait_what::DISPATCH_RECV => {
                    "low-latency dispatch receive: the count signal for a local expert"
                }
                k::wait_what::COMBINE_RECV => "low-latency combine receive: an expert's rows",
                _ => "low-latency wait",
            },
            expert: Some(w.epoch),
            epoch: c.calls,
            seen: w.detail,
            timeout: c.timeout,
        },
        other => EpError::Poisoned {
            rank,
            first: format!(
                "unknown device error code {other} (peer {peer}, what {}, epoch {}, detail {})",
                w.what, w.epoch, w.detail
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ep_kernels::intranode::ErrorWord;

    const CTX: DeviceErrorContext = DeviceErrorContext {
        rank: 1,
        num_experts: 64,
        calls: 7,
        timeout: Duration::from_secs(2),
        mode: Some("cpu_host_memory"),
    };

    fn word(code: u32, peer: u32, what: u32, epoch: u64, detail: u64) -> ErrorWord {
        ErrorWord {
            code,
            rank: 1,
            peer,
            what,
            epoch,
            detail,
        }
    }

    #[test]
    fn a_transport_failure_is_not_a_timeout() {
        let w = word(
            k::error_code::TRANSPORT,
            3,
            k::transport_what::QUIET,
            0x5,
            2,
        );
        match device_error(&CTX, &w, None) {
            EpError::Transport {
                rank: 1,
                peer: Some(3),
                what,
                source: None,
            } => {
                assert!(what.contains("ibgda_quiet"), "{what}");
                assert!(what.contains("status 0x5"), "{what}");
                assert!(what.contains("QP key 2"), "{what}");
                assert!(what.contains("cpu_host_memory"), "{what}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_bad_expert_id_is_named_with_its_token_slot_and_value() {
        let w = word(
            k::error_code::BAD_EXPERT,
            1,
            3 | k::BAD_EXPERT_IN_COMBINE,
            (-9i64) as u64,
            40,
        );
        match device_error(&CTX, &w, None) {
            EpError::ExpertIdOutOfRange {
                rank: 1,
                op: "low-latency combine",
                id: -9,
                token: 40,
                slot: Some(3),
                count: None,
                num_experts: 64,
            } => {}
            other => panic!("{other:?}"),
        }
        let w = word(k::error_code::BAD_EXPERT, 1, 0, 64, 2);
        assert!(matches!(
            device_error(&CTX, &w, None),
            EpError::ExpertIdOutOfRange {
                op: "low-latency dispatch",
                id: 64,
                token: 2,
                slot: Some(0),
                ..
            }
        ));
    }

    #[test]
    fn timeouts_name_the_expert_without_leaking_a_string() {
        let w = word(ERR_TIMEOUT, 2, k::wait_what::COMBINE_RECV, 17, 3);
        match device_error(&CTX, &w, None) {
            EpError::PeerTimeout {
                rank: 1,
                peer: 2,
                what: "low-latency combine receive: an expert's rows",
                expert: Some(17),
                epoch: 7,
                seen: 3,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn corrupt_handles_and_mismatched_ids_are_named() {
        let w = word(
            k::error_code::BAD_ROUTING,
            127,
            k::routing_what::SRC_INFO,
            300,
            1_000_000,
        );
        assert!(matches!(
            device_error(&CTX, &w, None),
            EpError::CorruptRouting {
                what: "src_info",
                index: 300,
                value: 1_000_000,
                limit: 127,
                ..
            }
        ));
        let w = word(k::error_code::TOPK_MISMATCH, 1, 5, 12, (33u64 << 32) | 34);
        assert!(matches!(
            device_error(&CTX, &w, None),
            EpError::TopkMismatch {
                token: 12,
                slot: 5,
                dispatched: 33,
                combined: 34,
                ..
            }
        ));
    }
}
