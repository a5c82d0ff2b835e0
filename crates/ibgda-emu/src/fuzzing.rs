//! The harness shared by the `decode_ring` cargo-fuzz target and the CI test that stands in for
//! it: arbitrary bytes become a send ring, a host NIC executes them against guarded memory, and
//! the harness checks that nothing outside a registration changed, that the NIC consumed every
//! announced WQEBB, and that the QP state agrees with the CQEs. Not part of the API.

use std::sync::Arc;
use std::time::Duration;

use ibgda_device::wire::{cqe_opcode, WQEBB_BYTES};

use crate::{Access, CqMode, Fabric, HostBuffer, Mr, NicConfig, QpState, Reorder, StrictMode};

/// Send-ring size the harness uses.
pub const RING_WQEBBS: u32 = 16;
const ARENA: usize = 4096;

/// What one run came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSummary {
    /// WQEBBs announced.
    pub announced: u64,
    /// CQEs written.
    pub cqes: u64,
    /// Whether the QP ended in the error state.
    pub error: bool,
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// Rewrites the address and key fields of WQEBB `bb` so they often hit (or just miss) a real
/// registration: arbitrary bytes alone almost never name a valid key.
fn steer(bb: &mut [u8], local: &[Mr], remote: &[Mr]) {
    let sel = bb[9];
    let pick = |mrs: &[Mr], k: u8| mrs[k as usize % mrs.len()];
    let r = pick(remote, sel);
    let l = pick(local, sel >> 4);
    let roff = (u16::from_le_bytes([bb[20], bb[21]]) as u64) % (r.len + 64);
    let loff = (u16::from_le_bytes([bb[40], bb[41]]) as u64) % (l.len + 64);
    // Remote-address segment at 16..32.
    bb[16..24].copy_from_slice(&(r.addr + roff).saturating_sub(32).to_be_bytes());
    bb[24..28].copy_from_slice(&r.rkey.to_be_bytes());
    // A data segment at 32..48 (or an atomic operand; harmless either way) and at 48..64.
    if bb[10] & 1 == 0 {
        bb[32] &= 0x0f;
        bb[36..40].copy_from_slice(&l.lkey.to_be_bytes());
        bb[40..48].copy_from_slice(&(l.addr + loff).saturating_sub(16).to_be_bytes());
    }
    bb[48] = 0;
    bb[49] = 0;
    bb[52..56].copy_from_slice(&l.lkey.to_be_bytes());
    bb[56..64].copy_from_slice(&(l.addr + loff).to_be_bytes());
}

/// Runs `data` as ring contents. Layout of `data`: byte 0 = WQEBBs announced (mod 17), then
/// the ring bytes (zero-padded). A WQEBB whose byte 8 (the signature, ignored by the NIC) is odd
/// gets its keys and addresses steered toward the registrations.
pub fn run_ring_bytes(data: &[u8]) -> Result<RunSummary, String> {
    let fabric = Fabric::new();
    let err = |e: crate::EmuError| e.to_string();
    // Strict reordering on (its pipeline is fuzzed too), control-segment checks off: arbitrary
    // bytes would almost all stop there, before the decoder.
    let strict = StrictMode {
        check_ctrl: false,
        reorder: Some(Reorder::new(crate::DEFAULT_SEED)),
    };
    let a = fabric
        .host_nic(NicConfig::named("fuzz-a").manual().strict(strict))
        .map_err(err)?;
    let b = fabric
        .host_nic(NicConfig::named("fuzz-b").manual().strict(strict))
        .map_err(err)?;
    let la = Arc::new(HostBuffer::new(ARENA));
    let ra = Arc::new(HostBuffer::new(ARENA));
    la.write(0, &pattern(ARENA, 3));
    ra.write(0, &pattern(ARENA, 11));
    let local = [
        a.register_host(&la, 512, 1024, Access::ALL).map_err(err)?,
        a.register_host(&la, 2048, 512, Access::NONE).map_err(err)?,
    ];
    let remote = [
        b.register_host(&ra, 512, 1024, Access::ALL).map_err(err)?,
        b.register_host(&ra, 2048, 256, Access::REMOTE_WRITE)
            .map_err(err)?,
        b.register_host(&ra, 2560, 64, Access::REMOTE_ATOMIC)
            .map_err(err)?,
    ];
    let qp = a
        .create_host_qp(RING_WQEBBS, CqMode::Ring, 32)
        .map_err(err)?;
    let peer = b.create_host_qp(4, CqMode::Ring, 4).map_err(err)?;
    a.connect(qp.qpn(), &b.qp_info(peer.qpn()).map_err(err)?)
        .map_err(err)?;

    let announced = data
        .first()
        .map_or(0, |&n| n as u64 % (RING_WQEBBS as u64 + 1));
    let mut ring = vec![0u8; RING_WQEBBS as usize * WQEBB_BYTES];
    let body = data.get(1..).unwrap_or(&[]);
    let n = body.len().min(ring.len());
    ring[..n].copy_from_slice(&body[..n]);
    for bb in ring.chunks_exact_mut(WQEBB_BYTES) {
        if bb[8] & 1 == 1 {
            steer(bb, &local, &remote);
        }
    }
    qp.sq.write(0, &ring);
    let before_l = la.to_vec();
    let before_r = ra.to_vec();
    qp.ring_dbr(announced);
    let st = a
        .wait_idle(qp.qpn(), Duration::from_secs(10))
        .map_err(err)?;
    if st.fetched != announced {
        return Err(format!(
            "NIC consumed {} WQEBBs of {announced} announced",
            st.fetched
        ));
    }
    let inside = |mrs: &[Mr], buf: &HostBuffer, i: usize| {
        let addr = buf.addr() + i as u64;
        mrs.iter().any(|m| addr >= m.addr && addr < m.addr + m.len)
    };
    for (name, buf, before, mrs) in [
        ("local", &la, &before_l, &local[..]),
        ("remote", &ra, &before_r, &remote[..]),
    ] {
        let after = buf.to_vec();
        if let Some(i) = (0..ARENA).find(|&i| after[i] != before[i] && !inside(mrs, buf, i)) {
            return Err(format!(
                "{name} byte {i} outside every registration changed: {:#04x} -> {:#04x}",
                before[i], after[i]
            ));
        }
    }
    let mut saw_error = false;
    for i in 0..st.cqes_written {
        let c = qp
            .poll_cqe(i)
            .ok_or_else(|| format!("CQE {i} of {} not visible", st.cqes_written))?;
        if c.opcode() == cqe_opcode::REQ_ERR {
            saw_error = true;
        } else if c.opcode() != cqe_opcode::REQ {
            return Err(format!("CQE {i} has opcode {:#x}", c.opcode()));
        }
    }
    let error = st.state == QpState::Error;
    if saw_error != error {
        return Err(format!(
            "error CQEs seen: {saw_error}, but the QP is in state {:?}",
            st.state
        ));
    }
    Ok(RunSummary {
        announced,
        cqes: st.cqes_written,
        error,
    })
}
