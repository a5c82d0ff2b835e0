//! Rank masks in normal mode (DeepEP's `enable_shrink`, which DeepEP offers in low-latency mode
//! only): [`Buffer::update_mask`], [`Buffer::query_mask`], [`Buffer::mask_status`],
//! [`Buffer::clean_mask`]. The mask itself is [`RankMask`](crate::mask::RankMask), shared with
//! the low-latency buffer.
//!
//! # What the masks must be
//!
//! Each rank *links* the ranks it does not mask, and itself (`ep_kernels::intranode::links_of`).
//! A dispatch lays out each destination's rows from the counts of every sender linked to it,
//! and each sender computes its own offset there from the counts of the senders before it; that
//! is right only when linked ranks link the same ranks. So the masks must be **symmetric and
//! transitive**: the ranks fall into groups, every rank links exactly its group (for instance:
//! every healthy rank masks the failed ones, and a failed rank that still runs masks everyone
//! else). The kernels check what they can: every notify and barrier publishes the rank's link
//! set with its release and compares each linked peer's after the wait, so masks that are not
//! transitive, or a pair where both sides still link each other but disagree on a third rank,
//! fail with [`EpError::MaskMismatch`] before any row moves. A rank that masks a peer which
//! does not mask it back neither signals nor waits for that peer; the peer, while it waits,
//! reads that rank's epoch and link set and fails with [`EpError::MaskMismatch`] as soon as
//! that rank has reached the same operation (or with [`EpError::PeerTimeout`] at its bound,
//! if that rank never does). The masking rank itself goes on, with its other links.
//!
//! Ranks that mask each other never wait on each other: every barrier releases to and waits for
//! linked ranks only, and every wait is bounded. Every rank still makes every call (they are
//! collectives of its group), so that the barrier epochs, counted per rank on the GPU, stay in
//! step; a rank unmasked again must have made the same calls as the others meanwhile. (Ranks of
//! one process sharing a GPU also meet on the host around every launch, masked or not:
//! [`LaunchGate`](crate::residency::LaunchGate), bounded like every wait.)
//!
//! What a mask does, with [`reference::masked_ids`](crate::reference::masked_ids) as its CPU
//! definition: a masked rank gets none of this rank's tokens (dispatch), rows it would have sent
//! are not received, and combine leaves its experts' outputs out of each token's sum (a rank
//! masked between a dispatch and its combine too; one unmasked in between adds nothing to that
//! combine, since the dispatch sent it nothing). A cached dispatch needs the links its handle
//! was made under ([`EpError::MaskMismatch`] otherwise).

use crate::error::{invalid, EpError};
use crate::tensor::Tensor;

use super::setup::Buffer;

impl Buffer {
    /// Masks (`true`) or unmasks `rank` on this rank, ordered on the
    /// [communication stream](Self::comm_stream): later operations send it nothing, receive
    /// nothing from it and leave its experts out of combine's sums. Not a collective, but the
    /// masks of all ranks must be symmetric and transitive when the next operation runs (see the
    /// module docs of `intranode::masks`; the kernels report what breaks it). A rank cannot mask
    /// itself.
    pub fn update_mask(&mut self, rank: usize, masked: bool) -> Result<(), EpError> {
        self.usable()?;
        if rank == self.rank && masked {
            return Err(invalid(
                self.rank,
                "update_mask: a rank cannot mask itself (mask the others instead)",
            ));
        }
        self.mask.update(&self.comm, rank, masked)
    }

    /// Copies who is masked on this rank (`i32 [ranks]`, 1 = masked) into `mask_status`,
    /// ordered on the [communication stream](Self::comm_stream).
    pub fn query_mask(&mut self, mask_status: &Tensor<i32>) -> Result<(), EpError> {
        self.usable()?;
        self.on_this_gpu(mask_status, "mask_status")?;
        self.shape_is(mask_status, &[self.ranks], "mask_status")?;
        self.mask.query_into(&self.comm, mask_status)
    }

    /// Who is masked on this rank, after everything queued so far (waits, bounded, for the
    /// communication stream).
    pub fn mask_status(&mut self) -> Result<Vec<i32>, EpError> {
        let t = Tensor::filled(&self.ctx, 0i32, &[self.ranks])?;
        self.query_mask(&t)?;
        self.synchronize()?;
        t.to_host()
    }

    /// Unmasks every rank on this rank, ordered on the [communication stream](Self::comm_stream).
    pub fn clean_mask(&mut self) -> Result<(), EpError> {
        self.usable()?;
        self.mask.clean(&self.comm)
    }

    /// What the kernels get as `mask`.
    pub(super) fn mask_addr(&self) -> u64 {
        self.mask.addr()
    }
}
