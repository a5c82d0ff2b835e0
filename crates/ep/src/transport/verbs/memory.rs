//! Where a verbs QP set's memory lives: host or GPU blocks, the ring layout of one QP, the
//! initial CQ image.

use std::sync::Arc;

use ibgda_device::cuda::DeviceBuffer;
use ibgda_emu::HostBuffer;

use crate::transport::error::TransportError;

/// Send-ring and CQ size (WQEBBs, CQEs) of the responder QPs: they never post.
pub(super) const RESPONDER_LOG_RING: u8 = 6;
/// Rings, CQs and the umems under them are placed on 4 KiB pages.
pub(super) const PAGE: usize = 4096;
/// Byte 63 of a CQE that hardware still owns: invalid opcode (15), owner bit 1.
pub(super) const CQE_HW_OWNED: u8 = 0xf1;

pub(super) fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Memory a transport allocates: host memory (pinned and mapped for the GPU where the driver
/// provides it) or GPU memory.
#[derive(Debug, Clone)]
pub(super) enum Block {
    Host(Arc<HostBuffer>),
    Device(Arc<DeviceBuffer>),
}

impl Block {
    /// The address device code (or, on the host backend, host threads) use.
    pub(super) fn dev_addr(&self) -> u64 {
        match self {
            Block::Host(h) => h.device_addr().unwrap_or(h.addr()),
            Block::Device(d) => d.ptr(),
        }
    }
}

/// One QP's rings in a ring block: send ring, then CQ, then the CQ doorbell record and (when
/// it lives with the rings) the QP doorbell record, each on its own page.
#[derive(Clone, Copy, Debug)]
pub(super) struct RingLayout {
    pub(super) sq: usize,
    pub(super) cq: usize,
    pub(super) cq_dbr: usize,
    pub(super) qp_dbr: usize,
    pub(super) bytes: usize,
}

impl RingLayout {
    pub(super) fn new(nwqes: u32, ncqes: u32) -> Self {
        let sq = 0;
        let cq = round_up(nwqes as usize * 64, PAGE);
        let cq_dbr = cq + round_up(ncqes as usize * 64, PAGE);
        Self {
            sq,
            cq,
            cq_dbr,
            qp_dbr: cq_dbr + 64,
            bytes: cq_dbr + PAGE,
        }
    }
}

/// The CQ ring's initial bytes: every CQE owned by hardware and invalid.
pub(super) fn cq_image(ncqes: u32) -> Vec<u8> {
    let mut v = vec![0u8; ncqes as usize * 64];
    for c in v.chunks_exact_mut(64) {
        c[63] = CQE_HW_OWNED;
    }
    v
}

pub(super) fn write_block(
    block: &Block,
    offset: usize,
    bytes: &[u8],
) -> Result<(), TransportError> {
    match block {
        Block::Host(h) => h.write(offset, bytes),
        Block::Device(d) => d.upload(offset, bytes)?,
    }
    Ok(())
}
