//! Strict mode on the host backend: control-segment checks, fences, out-of-order chunks and
//! interleaved QPs, each shown failing device-style code that leans on what the hardware does
//! not promise, and passing the same code written as the hardware requires. Manual progress and
//! fixed seeds make every run the same.

mod common;

use std::sync::Arc;

use common::{Pair, GUARD, T};
use ibgda_device::wire::{
    cqe_opcode, opcode, syndrome, Cqe64, FenceMode, FetchAdd64, InlineWrite, LocalAddr, Nop,
    RdmaWrite, RemoteAddr, Sge,
};
use ibgda_emu::{
    vendor_syndrome, Access, CqMode, Fabric, HostBuffer, Mr, NicConfig, QpState, StrictMode,
};

fn ra(m: &Mr, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: m.addr + off,
        rkey: m.rkey,
    }
}

fn assert_err(c: &Cqe64, index: u16, syn: u8, vendor: u8) {
    assert_eq!(c.opcode(), cqe_opcode::REQ_ERR, "{c}");
    assert_eq!(c.wqe_counter.get(), index, "{c}");
    assert_eq!((c.syndrome(), c.vendor_syndrome()), (syn, vendor), "{c}");
}

fn strict_pair(strict: StrictMode) -> Pair {
    Pair::with_strict(true, 64, CqMode::Ring, 64, strict)
}

// ---- control-segment checks ------------------------------------------------------------------

#[test]
fn a_wrong_qpn_in_the_control_segment_is_a_local_qp_operation_error() {
    let mut p = strict_pair(StrictMode::checks_only());
    let q = p.qpn();
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(InlineWrite::new(q ^ 1, 0, ra(&rm, 0), b"bad").build());
    p.post(InlineWrite::new(q, 1, ra(&rm, 8), b"ok").cqe(true).build());
    let st = p.run();
    assert_eq!(st.state, QpState::Error);
    let c = p.cqes();
    assert_eq!(c.len(), 2, "{c:?}");
    assert_err(
        &c[0],
        0,
        syndrome::LOCAL_QP_OP_ERR,
        vendor_syndrome::CTRL_QPN,
    );
    assert_err(&c[1], 1, syndrome::WR_FLUSH_ERR, vendor_syndrome::FLUSH);
    assert_eq!(p.ra.read_vec(1024, 16), vec![GUARD; 16], "nothing ran");
    let e = st.first_error.unwrap();
    assert!(e.reason.contains("names QP"), "{}", e.reason);
}

#[test]
fn a_wrong_wqe_index_in_the_control_segment_is_a_local_qp_operation_error() {
    let mut p = strict_pair(StrictMode::checks_only());
    let q = p.qpn();
    p.post(Nop::new(q, 0).build());
    // The device code's classic slip: the index of the submission, not of this WQEBB.
    p.post(Nop::new(q, 0).cqe(true).build());
    let st = p.run();
    assert_eq!(st.state, QpState::Error);
    let c = p.cqes();
    assert_eq!(c.len(), 1, "{c:?}");
    assert_err(
        &c[0],
        1,
        syndrome::LOCAL_QP_OP_ERR,
        vendor_syndrome::CTRL_INDEX,
    );
    assert_eq!(
        st.first_error.unwrap().wqe_index,
        1,
        "the first WQE was fine"
    );
}

#[test]
fn the_index_check_follows_the_16_bit_counter_across_wraps() {
    let mut p = Pair::with_strict(true, 64, CqMode::Ring, 64, StrictMode::full(3));
    let q = p.qpn();
    while p.pi < (1 << 16) + 100 {
        for k in 0..32u64 {
            let i = p.pi;
            p.post(Nop::new(q, i as u16).cqe(k == 31).build());
        }
        let st = p.run();
        assert_eq!(st.state, QpState::Rts, "{:?}", st.first_error);
    }
}

#[test]
fn without_strict_checks_a_wrong_index_goes_unnoticed() {
    // What the emulator did before strict mode: the same slip passes.
    let mut p = strict_pair(StrictMode::off());
    let q = p.qpn();
    p.post(Nop::new(q, 0).build());
    p.post(Nop::new(q ^ 1, 0).cqe(true).build());
    let st = p.run();
    assert_eq!(st.state, QpState::Rts);
    assert_eq!(p.cqes()[0].opcode(), cqe_opcode::REQ);
}

// ---- fences ----------------------------------------------------------------------------------

/// Device-style code: take a ticket with a fetch-add on the peer's counter (the old value lands
/// in the local `ticket` word), then publish it with an RDMA write *from that word* to the
/// peer's slot for this round. The write reads what the atomic fetched, so it needs a fence:
/// without one the NIC may gather the word before the atomic's result is there. Returns the
/// rounds whose published ticket was wrong.
fn ticket_rounds(strict: StrictMode, fence: bool, rounds: u64) -> Vec<(u64, u64)> {
    let mut p = strict_pair(strict);
    let q = p.qpn();
    let lm = p.local(1024, 64, Access::LOCAL_WRITE);
    let rm = p.remote(1024, 8 + 8 * rounds as usize, Access::ALL);
    p.ra.store_u64(1024, 0);
    let mut wrong = Vec::new();
    for r in 0..rounds {
        // A stale ticket the write would copy if it ran first.
        p.la.store_u64(1024, u64::MAX);
        let i = p.pi as u16;
        p.post(
            FetchAdd64::new(
                q,
                i,
                ra(&rm, 0),
                LocalAddr {
                    addr: lm.addr,
                    lkey: lm.lkey,
                },
                1,
            )
            .build(),
        );
        let publish = RdmaWrite::new(
            q,
            i + 1,
            ra(&rm, 8 + 8 * r),
            Sge {
                addr: lm.addr,
                len: 8,
                lkey: lm.lkey,
            },
        )
        .cqe(true);
        let publish = if fence {
            publish.fence(FenceMode::SmallAndFence)
        } else {
            publish
        };
        p.post(publish.build());
        let st = p.run();
        assert_eq!(st.state, QpState::Rts, "{:?}", st.first_error);
        let got = p.ra.load_u64(1024 + 8 + 8 * r as usize);
        if got != r {
            wrong.push((r, got));
        }
    }
    assert_eq!(p.ra.load_u64(1024), rounds, "every fetch-add landed");
    wrong
}

#[test]
fn a_missing_fence_after_an_atomic_fails_under_strict_mode() {
    let wrong = ticket_rounds(StrictMode::full(1), false, 64);
    assert!(
        !wrong.is_empty(),
        "strict mode let an unfenced write overtake the atomic it depends on in none of 64 rounds"
    );
    eprintln!(
        "unfenced: {} of 64 rounds published a stale ticket, e.g. {:?}",
        wrong.len(),
        wrong[0]
    );
}

#[test]
fn the_same_code_with_the_fence_passes_under_strict_mode() {
    for seed in 0..8 {
        assert_eq!(
            ticket_rounds(StrictMode::full(seed), true, 64),
            vec![],
            "seed {seed}"
        );
    }
}

#[test]
fn without_strict_mode_the_missing_fence_goes_unnoticed() {
    // What the emulator did before strict mode: every WQE in order, the bug invisible.
    assert_eq!(ticket_rounds(StrictMode::off(), false, 64), vec![]);
    assert_eq!(ticket_rounds(StrictMode::checks_only(), false, 64), vec![]);
}

#[test]
fn cqes_stay_in_wqe_order_while_a_write_passes_an_atomic() {
    // Whatever executes first, the CQEs of a signalled atomic and the signalled write after it
    // come in WQE order, and only once both have completed.
    for seed in 0..16 {
        let mut p = strict_pair(StrictMode::full(seed));
        let q = p.qpn();
        let lm = p.local(1024, 64, Access::LOCAL_WRITE);
        let rm = p.remote(1024, 64, Access::ALL);
        let fa = FetchAdd64::new(
            q,
            0,
            ra(&rm, 0),
            LocalAddr {
                addr: lm.addr,
                lkey: lm.lkey,
            },
            5,
        );
        p.post(fa.cqe(true).build());
        p.post(
            InlineWrite::new(q, 1, ra(&rm, 8), b"after")
                .cqe(true)
                .build(),
        );
        p.ring();
        loop {
            p.a.progress().unwrap();
            let c = p.cqes();
            if !c.is_empty() {
                assert_eq!(c[0].wqe_counter.get(), 0, "seed {seed}: {c:?}");
                assert_eq!(c[0].opcode(), cqe_opcode::REQ);
                assert_ne!(
                    p.ra.load_u64(1024),
                    u64::from_ne_bytes([GUARD; 8]),
                    "seed {seed}: CQE 0 before its atomic ran"
                );
            }
            if c.len() == 2 {
                assert_eq!(c[1].wqe_counter.get(), 1);
                assert_eq!(p.ra.read_vec(1032, 5), b"after");
                break;
            }
        }
        p.idle();
    }
}

// ---- chunks and interleaving -----------------------------------------------------------------

/// Device-style code on the receiving side: a message whose last 8 bytes are its "ready" flag,
/// polled by the receiver between NIC progress rounds. Returns the first round where the flag
/// was visible while some of the payload was not (a receiver that trusted the flag would have
/// read garbage), if any.
fn flag_in_the_tail(strict: StrictMode, signal: bool) -> Option<usize> {
    const LEN: usize = 4096;
    let mut p = strict_pair(strict);
    let q = p.qpn();
    let lm = p.local(0, LEN, Access::NONE);
    let rm = p.remote(0, LEN + 8, Access::ALL);
    let payload: Vec<u8> = (0..LEN).map(|i| (i as u8) ^ 0x5c).collect();
    p.la.write(0, &payload);
    p.ra.fill(0);
    let data_len = if signal { LEN } else { LEN - 8 };
    let flag_at = if signal { LEN } else { LEN - 8 };
    p.post(
        RdmaWrite::new(
            q,
            0,
            ra(&rm, 0),
            Sge {
                addr: lm.addr,
                len: LEN as u32,
                lkey: lm.lkey,
            },
        )
        .build(),
    );
    if signal {
        // The pattern the project's kernels use: the flag as a separate, fenced atomic on the
        // same QP after the data (see ibgda_signal_add).
        let la = p.local(LEN, 64, Access::LOCAL_WRITE);
        p.post(
            FetchAdd64::new(
                q,
                1,
                ra(&rm, LEN as u64),
                LocalAddr {
                    addr: la.addr,
                    lkey: la.lkey,
                },
                1,
            )
            .fence(FenceMode::SmallAndFence)
            .cqe(true)
            .build(),
        );
    } else {
        p.post(Nop::new(q, 1).cqe(true).build());
    }
    p.ring();
    for round in 0..10_000 {
        p.a.progress().unwrap();
        let flag = p.ra.read_vec(flag_at, 8);
        if flag.iter().any(|&b| b != 0) && p.ra.read_vec(0, data_len) != payload[..data_len] {
            return Some(round);
        }
        if p.qp.poll_cqe(0).is_some() {
            return None;
        }
    }
    panic!("no CQE after 10000 rounds");
}

#[test]
fn a_flag_inside_the_message_can_land_before_the_payload_under_strict_mode() {
    let caught = (0..8).filter_map(|s| flag_in_the_tail(StrictMode::full(s), false));
    assert!(
        caught.count() > 0,
        "no seed of 8 landed the tail chunk before the rest"
    );
    // In order, the tail always lands last: the old emulator never showed the bug.
    assert_eq!(flag_in_the_tail(StrictMode::off(), false), None);
}

#[test]
fn a_fenced_signal_after_the_payload_is_never_early() {
    for seed in 0..16 {
        assert_eq!(
            flag_in_the_tail(StrictMode::full(seed), true),
            None,
            "seed {seed}"
        );
    }
}

#[test]
fn writes_of_two_qps_to_one_range_interleave_under_strict_mode() {
    const LEN: usize = 2048;
    let mixed = |strict: StrictMode| {
        let fabric = Fabric::new();
        let a = fabric
            .host_nic(NicConfig::named("a").manual().strict(strict))
            .unwrap();
        let b = fabric
            .host_nic(NicConfig::named("b").manual().strict(strict))
            .unwrap();
        let src = Arc::new(HostBuffer::new(2 * LEN));
        src.write(0, &[b'A'; LEN]);
        src.write(LEN, &[b'B'; LEN]);
        let dst = Arc::new(HostBuffer::new(LEN));
        let lm = a.register_host(&src, 0, 2 * LEN, Access::NONE).unwrap();
        let rm = b.register_host(&dst, 0, LEN, Access::REMOTE_WRITE).unwrap();
        let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
        let qps: Vec<_> = (0..2)
            .map(|k| {
                let qp = a.create_host_qp(8, CqMode::Ring, 8).unwrap();
                a.connect(qp.qpn(), &b.qp_info(peer.qpn()).unwrap())
                    .unwrap();
                let w = RdmaWrite::new(
                    qp.qpn(),
                    0,
                    ra(&rm, 0),
                    Sge {
                        addr: lm.addr + (k * LEN) as u64,
                        len: LEN as u32,
                        lkey: lm.lkey,
                    },
                )
                .cqe(true)
                .build();
                qp.post(0, &w);
                qp
            })
            .collect();
        for qp in &qps {
            qp.ring_dbr(1);
        }
        for qp in &qps {
            a.wait_idle(qp.qpn(), T).unwrap();
        }
        let v = dst.to_vec();
        assert!(v.iter().all(|&x| x == b'A' || x == b'B'));
        v.contains(&b'A') && v.contains(&b'B')
    };
    assert!(
        (0..8).any(|s| mixed(StrictMode::full(s))),
        "no seed of 8 interleaved the two QPs' chunks"
    );
    assert!(
        !mixed(StrictMode::off()),
        "in order, one write lands whole after the other"
    );
}

#[test]
fn every_write_lands_whole_in_the_end() {
    // Chunking never loses or duplicates a byte, gathers included, on any seed.
    for seed in 0..16 {
        let mut p = strict_pair(StrictMode::full(seed));
        let q = p.qpn();
        let lm = p.local(0, 4096, Access::NONE);
        let rm = p.remote(0, 4096, Access::REMOTE_WRITE);
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + seed as u32) as u8).collect();
        p.la.write(0, &src);
        let s = |off: u64, len: u32| Sge {
            addr: lm.addr + off,
            len,
            lkey: lm.lkey,
        };
        p.post(
            RdmaWrite::new_gather(q, 0, ra(&rm, 0), [s(1000, 1500), s(0, 333)])
                .cqe(true)
                .build(),
        );
        p.post(
            InlineWrite::new(q, 1, ra(&rm, 2000), b"inline tail")
                .cqe(true)
                .build(),
        );
        let st = p.run();
        assert_eq!((st.state, st.cqes_written), (QpState::Rts, 2));
        let got = p.ra.read_vec(0, 2011);
        assert_eq!(&got[..1500], &src[1000..2500], "seed {seed}");
        assert_eq!(&got[1500..1833], &src[..333], "seed {seed}");
        assert_eq!(&got[2000..], b"inline tail");
        assert_eq!(
            p.cqes()[0].opcode(),
            cqe_opcode::REQ,
            "{}",
            opcode::RDMA_WRITE
        );
    }
}
