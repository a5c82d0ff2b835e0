//! What the kernels report, as [`EpError`]s, and the range checks on values handed to them.

use ep_kernels::intranode as k;

use crate::error::{invalid, EpError};

use super::plan::MAX_EXPERT_ALIGNMENT;

/// The error the layout kernel's [`k::LayoutInvalid`] report (`words`) describes, if any.
pub(crate) fn layout_invalid_error(
    rank: usize,
    words: &[i32],
    topk: usize,
    num_experts: usize,
) -> Option<EpError> {
    let (count, first, id) = (*words.first()?, *words.get(1)?, *words.get(2)?);
    if count == 0 {
        return None;
    }
    let first = first.max(0) as usize;
    Some(EpError::ExpertIdOutOfRange {
        rank,
        op: "dispatch layout",
        id: i64::from(id),
        token: first / topk.max(1),
        slot: Some(first % topk.max(1)),
        count: Some(count.max(0) as usize),
        num_experts,
    })
}

/// The error an intranode kernel recorded in `w` (see [`k::error_code`] for what each code puts
/// in which field), as this rank reports it.
pub(super) fn device_error(rank: usize, w: &k::ErrorWord, timeout: std::time::Duration) -> EpError {
    match w.code {
        k::error_code::WORST_TOKENS_EXCEEDED => EpError::WorstTokensExceeded {
            rank,
            received: w.detail as usize,
            worst: w.what as usize,
        },
        k::error_code::BAD_ROUTING => EpError::CorruptRouting {
            rank,
            what: match w.what {
                k::routing_what::TOKENS_PER_RANK => "tokens_per_rank",
                k::routing_what::TOKENS_PER_EXPERT => "tokens_per_expert",
                k::routing_what::SEND_POSITION => "send position (token, rank)",
                _ => "routing value",
            },
            index: w.epoch,
            value: w.detail as i64,
            limit: u64::from(w.peer),
        },
        k::error_code::MASK_MISMATCH => EpError::MaskMismatch {
            rank,
            peer: w.peer as usize,
            what: mask_mismatch_what(w.what, w.detail),
        },
        k::error_code::TIMEOUT => EpError::PeerTimeout {
            rank,
            peer: w.peer as usize,
            what: match w.what {
                k::wait_what::DISPATCH_COUNTS => "dispatch count exchange",
                k::wait_what::DISPATCH_DATA => "dispatch data",
                k::wait_what::COMBINE_START => "combine start",
                k::wait_what::COMBINE_DATA => "combine data",
                _ => "unknown wait",
            },
            expert: None,
            epoch: w.epoch,
            seen: w.detail,
            timeout,
        },
        other => EpError::Poisoned {
            rank,
            first: format!(
                "unknown device error code {other} (peer {}, what {}, epoch {}, detail {})",
                w.peer, w.what, w.epoch, w.detail
            ),
        },
    }
}

/// What a [`k::error_code::MASK_MISMATCH`] report says, in words: `detail` holds the other
/// link set in its high half and this rank's in its low half.
fn mask_mismatch_what(what: u32, detail: u64) -> String {
    let ranks = |set: u32| -> Vec<usize> { (0..32).filter(|r| set >> r & 1 == 1).collect() };
    let (theirs, mine) = (ranks((detail >> 32) as u32), ranks(detail as u32));
    match what {
        k::mask_what::PEER_LINKS => format!(
            "it links ranks {theirs:?}, this rank links {mine:?}: masks must be symmetric and \
             transitive (linked ranks link the same ranks)"
        ),
        k::mask_what::CACHED_HANDLE => format!(
            "the cached dispatch's handle was made linking ranks {theirs:?}, the masks now link \
             {mine:?}: dispatch afresh after changing masks"
        ),
        k::mask_what::ONE_SIDED => format!(
            "it masks this rank (it links ranks {theirs:?}) while this rank does not mask it \
             (this rank links {mine:?}): masks must be symmetric"
        ),
        _ => format!("mask disagreement {what} (links {theirs:?} vs {mine:?})"),
    }
}

/// A row count the GPU reported, as rows of a region of `cap` rows: negatives are 0, and no
/// count exceeds the region.
pub(super) fn clamp_count(n: i32, cap: usize) -> usize {
    (n.max(0) as usize).min(cap)
}

/// `expert_alignment` is cast to `i32` for the kernels: only after this check.
pub(super) fn check_expert_alignment(rank: usize, a: usize) -> Result<(), EpError> {
    if a > MAX_EXPERT_ALIGNMENT {
        return Err(invalid(
            rank,
            format!("expert_alignment {a} above {MAX_EXPERT_ALIGNMENT}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intranode::plan::tests::opts;
    use crate::intranode::plan::{RegionPlan, MAX_HIDDEN};
    use crate::intranode::setup::Buffer;

    #[test]
    fn kernel_i32_arguments_are_range_checked() {
        assert!(check_expert_alignment(0, 0).is_ok());
        assert!(check_expert_alignment(0, MAX_EXPERT_ALIGNMENT).is_ok());
        assert!(check_expert_alignment(0, MAX_EXPERT_ALIGNMENT + 1).is_err());
        // A usize that would wrap to a negative i32.
        assert!(check_expert_alignment(0, 1usize << 31).is_err());
        // Every row of a region is below i32::MAX, and so is a row's byte count.
        let o = opts(i32::MAX as usize / k::MAX_RANKS, MAX_HIDDEN, 8, 8);
        assert!(Buffer::check_options(0, 8, &o).is_ok());
        assert!(RegionPlan::new(&o, 8).unwrap().cap <= i32::MAX as usize);
        assert!(MAX_HIDDEN * 2 <= i32::MAX as usize);
    }

    #[test]
    fn received_counts_are_clamped_to_the_region() {
        assert_eq!(clamp_count(-7, 512), 0);
        assert_eq!(clamp_count(300, 512), 300);
        assert_eq!(clamp_count(i32::MAX, 512), 512);
    }

    fn word(code: u32, peer: u32, what: u32, epoch: u64, detail: u64) -> k::ErrorWord {
        k::ErrorWord {
            code,
            rank: 2,
            peer,
            what,
            epoch,
            detail,
        }
    }

    #[test]
    fn device_errors_keep_their_values() {
        let t = std::time::Duration::from_secs(1);
        match device_error(
            2,
            &word(k::error_code::WORST_TOKENS_EXCEEDED, 2, 64, 9, 70),
            t,
        ) {
            EpError::WorstTokensExceeded {
                rank: 2,
                received: 70,
                worst: 64,
            } => {}
            other => panic!("{other:?}"),
        }
        let e = device_error(
            2,
            &word(
                k::error_code::BAD_ROUTING,
                16,
                k::routing_what::SEND_POSITION,
                13,
                (-3i64) as u64,
            ),
            t,
        );
        match &e {
            EpError::CorruptRouting {
                rank: 2,
                what,
                index: 13,
                value: -3,
                limit: 16,
            } => assert!(what.starts_with("send position"), "{what}"),
            other => panic!("{other:?}"),
        }
        match device_error(
            2,
            &word(k::error_code::TIMEOUT, 1, k::wait_what::COMBINE_DATA, 5, 4),
            t,
        ) {
            EpError::PeerTimeout {
                rank: 2,
                peer: 1,
                what: "combine data",
                expert: None,
                epoch: 5,
                seen: 4,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        // Rank 2 links {0, 2}; its peer 0 links {0, 1, 2}.
        match device_error(
            2,
            &word(
                k::error_code::MASK_MISMATCH,
                0,
                k::mask_what::PEER_LINKS,
                7,
                (0b111u64 << 32) | 0b101,
            ),
            t,
        ) {
            EpError::MaskMismatch {
                rank: 2,
                peer: 0,
                what,
            } => assert!(
                what.contains("[0, 1, 2]") && what.contains("[0, 2]") && what.contains("symmetric"),
                "{what}"
            ),
            other => panic!("{other:?}"),
        }
        match device_error(
            2,
            &word(
                k::error_code::MASK_MISMATCH,
                3,
                k::mask_what::ONE_SIDED,
                7,
                (0b1000u64 << 32) | 0b1100,
            ),
            t,
        ) {
            EpError::MaskMismatch { peer: 3, what, .. } => {
                assert!(what.contains("masks this rank"), "{what}")
            }
            other => panic!("{other:?}"),
        }
        // An unknown code is not an argument error.
        assert!(matches!(
            device_error(2, &word(99, 0, 0, 0, 0), t),
            EpError::Poisoned { .. }
        ));
    }

    #[test]
    fn a_bad_expert_id_is_named_with_its_token_slot_and_value() {
        assert!(layout_invalid_error(0, &[0, i32::MAX, 0, 0], 4, 16).is_none());
        match layout_invalid_error(1, &[3, 9, 77, 0], 4, 16) {
            Some(EpError::ExpertIdOutOfRange {
                rank: 1,
                id: 77,
                token: 2,
                slot: Some(1),
                count: Some(3),
                num_experts: 16,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
