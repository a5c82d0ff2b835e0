//! A two-NIC host setup for the CPU tests: guarded arenas on both sides, one QP from `a` to `b`.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use ibgda_device::wire::{Cqe64, WqeBB};
use ibgda_emu::{
    Access, CqMode, Fabric, HostBuffer, HostQp, Mr, Nic, NicConfig, QpStatus, StrictMode,
};

/// Arena size on each side; registrations sit in the middle, guard bytes around them.
pub const ARENA: usize = 8192;
/// Byte every arena starts filled with.
pub const GUARD: u8 = 0xa5;
pub const T: Duration = Duration::from_secs(10);

pub struct Pair {
    pub fabric: Fabric,
    pub a: Nic,
    pub b: Nic,
    /// Local arena (on `a`).
    pub la: Arc<HostBuffer>,
    /// Remote arena (on `b`).
    pub ra: Arc<HostBuffer>,
    pub qp: HostQp,
    pub peer: HostQp,
    /// Next WQEBB index to post.
    pub pi: u64,
}

impl Pair {
    pub fn new(manual: bool, nwqebbs: u32, mode: CqMode, ncqes: u32) -> Self {
        Self::with_strict(manual, nwqebbs, mode, ncqes, StrictMode::from_env())
    }

    /// [`Pair::new`] with both NICs in strict mode `strict`.
    pub fn with_strict(
        manual: bool,
        nwqebbs: u32,
        mode: CqMode,
        ncqes: u32,
        strict: StrictMode,
    ) -> Self {
        let fabric = Fabric::new();
        let cfg = |n: &str| {
            let c = NicConfig::named(n).strict(strict);
            if manual {
                c.manual()
            } else {
                c
            }
        };
        let a = fabric.host_nic(cfg("a")).unwrap();
        let b = fabric.host_nic(cfg("b")).unwrap();
        let la = Arc::new(HostBuffer::new(ARENA));
        let ra = Arc::new(HostBuffer::new(ARENA));
        la.fill(GUARD);
        ra.fill(GUARD);
        let qp = a.create_host_qp(nwqebbs, mode, ncqes).unwrap();
        let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
        a.connect(qp.qpn(), &b.qp_info(peer.qpn()).unwrap())
            .unwrap();
        Self {
            fabric,
            a,
            b,
            la,
            ra,
            qp,
            peer,
            pi: 0,
        }
    }

    pub fn manual() -> Self {
        Self::new(true, 64, CqMode::Ring, 64)
    }

    /// Registers `len` bytes at `off` of the local arena.
    pub fn local(&self, off: usize, len: usize, access: Access) -> Mr {
        self.a.register_host(&self.la, off, len, access).unwrap()
    }

    /// Registers `len` bytes at `off` of the remote arena.
    pub fn remote(&self, off: usize, len: usize, access: Access) -> Mr {
        self.b.register_host(&self.ra, off, len, access).unwrap()
    }

    /// Writes a one-WQEBB WQE at the next index; returns that index.
    pub fn post(&mut self, wqe: WqeBB) -> u64 {
        let i = self.pi;
        self.qp.post(i, &wqe);
        self.pi += 1;
        i
    }

    /// Writes raw WQE bytes (whole WQEBBs) from the next index, wrapping around the ring.
    pub fn post_raw(&mut self, bytes: &[u8]) -> u64 {
        let i = self.pi;
        for (k, bb) in bytes.chunks(64).enumerate() {
            let mut b = [0u8; 64];
            b[..bb.len()].copy_from_slice(bb);
            self.qp.post(i + k as u64, &WqeBB(b));
        }
        self.pi += bytes.len().div_ceil(64) as u64;
        i
    }

    pub fn ring(&self) {
        self.qp.ring_dbr(self.pi);
    }

    pub fn idle(&self) -> QpStatus {
        self.a.wait_idle(self.qp.qpn(), T).unwrap()
    }

    /// Rings and waits.
    pub fn run(&self) -> QpStatus {
        self.ring();
        self.idle()
    }

    /// The CQEs a consumer reads from index 0, as many as are there.
    pub fn cqes(&self) -> Vec<Cqe64> {
        (0..).map_while(|i| self.qp.poll_cqe(i)).collect()
    }

    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
}

/// Asserts that every byte of `buf` outside `[from, to)` still holds the guard byte.
pub fn assert_guarded(buf: &HostBuffer, from: usize, to: usize) {
    let v = buf.to_vec();
    for (i, &x) in v.iter().enumerate() {
        if i < from || i >= to {
            assert_eq!(x, GUARD, "guard byte {i} changed");
        }
    }
}
