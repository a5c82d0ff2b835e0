//! The emulator on the host backend: each opcode, each error path (with guard bytes around every
//! registration), flushing, doorbell recovery, fault injection, shaping and the QP state machine.

mod common;

use std::time::{Duration, Instant};

use common::{assert_guarded, Pair, ARENA, GUARD, T};
use ibgda_device::wire::{
    cqe_opcode, opcode, syndrome, CompareSwap64, Cqe64, CtrlFields, CtrlSeg, DataSeg, FetchAdd64,
    InlineWrite, LocalAddr, MaskedCompareSwap32, MaskedFetchAdd32, MaskedFetchAdd64, Nop, RaddrSeg,
    RdmaWrite, RemoteAddr, Sge, CTRL_CQ_UPDATE,
};
use ibgda_emu::{
    vendor_syndrome, Access, CqConfig, CqMode, DoorbellConfig, EmuError, FaultPlan, HostBuffer,
    Loc, Mr, NicConfig, QpConfig, QpInfo, QpState, StrictMode,
};

fn ra(m: &Mr, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: m.addr + off,
        rkey: m.rkey,
    }
}

fn sge(m: &Mr, off: u64, len: u32) -> Sge {
    Sge {
        addr: m.addr + off,
        len,
        lkey: m.lkey,
    }
}

fn la(m: &Mr, off: u64) -> LocalAddr {
    LocalAddr {
        addr: m.addr + off,
        lkey: m.lkey,
    }
}

fn assert_ok(c: &Cqe64, index: u16, wqe_opcode: u8, bytes: u32) {
    assert_eq!(c.opcode(), cqe_opcode::REQ, "{c}");
    assert_eq!(c.wqe_counter.get(), index, "{c}");
    assert_eq!((c.sop_drop_qpn.get() >> 24) as u8, wqe_opcode, "{c}");
    assert_eq!(c.byte_cnt.get(), bytes, "{c}");
}

fn assert_err(c: &Cqe64, index: u16, syn: u8, vendor: u8) {
    assert_eq!(c.opcode(), cqe_opcode::REQ_ERR, "{c}");
    assert_eq!(c.wqe_counter.get(), index, "{c}");
    assert_eq!((c.syndrome(), c.vendor_syndrome()), (syn, vendor), "{c}");
}

#[test]
fn nop_completes_only_when_asked() {
    let mut p = Pair::manual();
    let q = p.qpn();
    p.post(Nop::new(q, 0).build());
    p.post(Nop::new(q, 1).cqe(true).build());
    let st = p.run();
    assert_eq!(
        (st.fetched, st.cqes_written, st.state),
        (2, 1, QpState::Rts)
    );
    let c = p.cqes();
    assert_eq!(c.len(), 1);
    assert_ok(&c[0], 1, opcode::NOP, 0);
    assert_eq!(c[0].qpn(), q);
}

#[test]
fn rdma_write_gathers_into_remote_memory() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let lm = p.local(1024, 1024, Access::NONE);
    let rm = p.remote(1024, 1024, Access::REMOTE_WRITE);
    let src: Vec<u8> = (0..1024u32).map(|i| (i * 31 + 7) as u8).collect();
    p.la.write(1024, &src);
    p.post(RdmaWrite::new(q, 0, ra(&rm, 0), sge(&lm, 0, 300)).build());
    p.post(
        RdmaWrite::new_gather(q, 1, ra(&rm, 300), [sge(&lm, 500, 10), sge(&lm, 0, 20)])
            .cqe(true)
            .build(),
    );
    p.run();
    let c = p.cqes();
    assert_eq!(c.len(), 1);
    assert_ok(&c[0], 1, opcode::RDMA_WRITE, 30);
    let got = p.ra.read_vec(1024, 330);
    assert_eq!(&got[..300], &src[..300]);
    assert_eq!(&got[300..310], &src[500..510]);
    assert_eq!(&got[310..330], &src[..20]);
    assert_guarded(&p.ra, 1024, 1024 + 330);
}

#[test]
fn inline_write_and_write_with_immediate() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(
        InlineWrite::new(q, 0, ra(&rm, 5), b"hello, nic")
            .cqe(true)
            .build(),
    );
    p.post(
        InlineWrite::new(q, 1, ra(&rm, 20), b"imm")
            .imm(0xdead_beef)
            .cqe(true)
            .build(),
    );
    p.post(InlineWrite::new(q, 2, ra(&rm, 63), b"").cqe(true).build());
    p.run();
    let c = p.cqes();
    assert_eq!(c.len(), 3);
    assert_ok(&c[0], 0, opcode::RDMA_WRITE, 10);
    assert_ok(&c[1], 1, opcode::RDMA_WRITE_IMM, 3);
    assert_ok(&c[2], 2, opcode::RDMA_WRITE, 0);
    assert_eq!(p.ra.read_vec(1029, 10), b"hello, nic");
    assert_eq!(p.ra.read_vec(1044, 3), b"imm");
}

#[test]
fn standard_atomics_reply_in_host_order() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let lm = p.local(1024, 64, Access::LOCAL_WRITE);
    let rm = p.remote(2048, 64, Access::REMOTE_ATOMIC);
    p.ra.store_u64(2048, 40);
    p.ra.store_u64(2056, 7);
    p.post(FetchAdd64::new(q, 0, ra(&rm, 0), la(&lm, 0), 2).build());
    p.post(CompareSwap64::new(q, 1, ra(&rm, 8), la(&lm, 8), 99, 7).build());
    p.post(
        CompareSwap64::new(q, 2, ra(&rm, 8), la(&lm, 16), 5, 7)
            .cqe(true)
            .build(),
    );
    p.run();
    assert_eq!(p.ra.load_u64(2048), 42);
    assert_eq!(p.ra.load_u64(2056), 99);
    assert_eq!(p.la.load_u64(1024), 40);
    assert_eq!(p.la.load_u64(1032), 7);
    assert_eq!(
        p.la.load_u64(1040),
        99,
        "failed compare-swap still returns the old value"
    );
    assert_ok(&p.cqes()[0], 2, opcode::ATOMIC_CS, 8);
}

#[test]
fn masked_atomics_reply_big_endian() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let lm = p.local(1024, 64, Access::LOCAL_WRITE);
    let rm = p.remote(2048, 64, Access::REMOTE_ATOMIC);
    p.ra.store_u32(2048, 0x0001_ffff);
    p.ra.store_u32(2052, 0x1234_5678);
    p.ra.store_u64(2056, 10);
    p.post(
        MaskedFetchAdd32::new(q, 0, ra(&rm, 0), la(&lm, 0), 0x0001_0001)
            .field_boundary(0x8000_8000)
            .build(),
    );
    p.post(
        MaskedCompareSwap32::new(q, 1, ra(&rm, 4), la(&lm, 4), 0xaaaa_0000, 0x0000_0078)
            .masks(0xffff_0000, 0x0000_00ff)
            .build(),
    );
    p.post(
        MaskedFetchAdd64::new(q, 2, ra(&rm, 8), la(&lm, 8), u64::MAX)
            .cqe(true)
            .build(),
    );
    p.run();
    assert_eq!(
        p.ra.load_u32(2048),
        0x0002_0000,
        "carry stopped at the field boundary"
    );
    assert_eq!(p.ra.load_u32(2052), 0xaaaa_5678);
    assert_eq!(p.ra.load_u64(2056), 9);
    assert_eq!(p.la.read_vec(1024, 4), 0x0001_ffffu32.to_be_bytes());
    assert_eq!(p.la.read_vec(1028, 4), 0x1234_5678u32.to_be_bytes());
    assert_eq!(p.la.read_vec(1032, 8), 10u64.to_be_bytes());
    assert_ok(&p.cqes()[0], 2, opcode::ATOMIC_MASKED_FA, 8);
}

/// Posts `bad` then a good write, and checks: the bad one fails with `(syn, vendor)`, the good
/// one is flushed, nothing outside what `bad` may touch changed.
fn fails_and_flushes(
    bad: impl FnOnce(&mut Pair, &Mr, &Mr) -> ibgda_device::wire::WqeBB,
    syn: u8,
    vendor: u8,
) {
    let mut p = Pair::manual();
    let q = p.qpn();
    let lm = p.local(1024, 1024, Access::ALL);
    let rm = p.remote(1024, 1024, Access::ALL);
    p.la.write(1024, &[1u8; 1024]);
    let w = bad(&mut p, &lm, &rm);
    p.post(w);
    p.post(
        RdmaWrite::new(q, 1, ra(&rm, 0), sge(&lm, 0, 64))
            .cqe(true)
            .build(),
    );
    let st = p.run();
    assert_eq!(st.state, QpState::Error);
    let c = p.cqes();
    assert_eq!(c.len(), 2, "{c:?}");
    assert_err(&c[0], 0, syn, vendor);
    assert_err(&c[1], 1, syndrome::WR_FLUSH_ERR, vendor_syndrome::FLUSH);
    let e = st.first_error.unwrap();
    assert_eq!(
        (e.wqe_index, e.syndrome, e.vendor_syndrome),
        (0, syn, vendor)
    );
    assert_guarded(&p.ra, 0, 0);
    let l = p.la.to_vec();
    assert!(l[..1024].iter().chain(&l[2048..]).all(|&x| x == GUARD));
    assert!(
        l[1024..2048].iter().all(|&x| x == 1),
        "local memory untouched"
    );
}

#[test]
fn bad_lkey_is_a_local_protection_error() {
    fails_and_flushes(
        |p, lm, rm| {
            let mut s = sge(lm, 0, 8);
            s.lkey ^= 0x55;
            RdmaWrite::new(p.qpn(), 0, ra(rm, 0), s).build()
        },
        syndrome::LOCAL_PROT_ERR,
        vendor_syndrome::BAD_LKEY,
    );
}

#[test]
fn local_range_past_the_registration_is_a_protection_error() {
    fails_and_flushes(
        |p, lm, rm| RdmaWrite::new(p.qpn(), 0, ra(rm, 0), sge(lm, 1000, 25)).build(),
        syndrome::LOCAL_PROT_ERR,
        vendor_syndrome::LOCAL_RANGE,
    );
    fails_and_flushes(
        |p, lm, rm| RdmaWrite::new(p.qpn(), 0, ra(rm, 0), sge(lm, 0, 0)).build(),
        syndrome::LOCAL_PROT_ERR,
        vendor_syndrome::LOCAL_RANGE,
    );
}

#[test]
fn bad_rkey_and_remote_range_are_remote_access_errors() {
    fails_and_flushes(
        |p, lm, rm| {
            let mut r = ra(rm, 0);
            r.rkey += 1000;
            RdmaWrite::new(p.qpn(), 0, r, sge(lm, 0, 8)).build()
        },
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::BAD_RKEY,
    );
    fails_and_flushes(
        |p, lm, rm| RdmaWrite::new(p.qpn(), 0, ra(rm, 1017), sge(lm, 0, 8)).build(),
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::REMOTE_RANGE,
    );
    fails_and_flushes(
        |p, _, rm| {
            let r = RemoteAddr {
                addr: rm.addr - 1,
                rkey: rm.rkey,
            };
            InlineWrite::new(p.qpn(), 0, r, b"x").build()
        },
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::REMOTE_RANGE,
    );
}

#[test]
fn missing_rights_are_refused() {
    fails_and_flushes(
        |p, lm, _| {
            let ro = p.remote(3000, 64, Access::REMOTE_READ | Access::REMOTE_ATOMIC);
            RdmaWrite::new(p.qpn(), 0, ra(&ro, 0), sge(lm, 0, 8)).build()
        },
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::REMOTE_ACCESS,
    );
    fails_and_flushes(
        |p, lm, _| {
            let wo = p.remote(3000, 64, Access::REMOTE_WRITE);
            FetchAdd64::new(p.qpn(), 0, ra(&wo, 0), la(lm, 0), 1).build()
        },
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::REMOTE_ACCESS,
    );
    fails_and_flushes(
        |p, _, rm| {
            let ro = p.local(3000, 64, Access::NONE);
            FetchAdd64::new(p.qpn(), 0, ra(rm, 0), la(&ro, 0), 1).build()
        },
        syndrome::LOCAL_PROT_ERR,
        vendor_syndrome::LOCAL_ACCESS,
    );
}

#[test]
fn misaligned_atomic_is_an_invalid_request() {
    fails_and_flushes(
        |p, lm, rm| FetchAdd64::new(p.qpn(), 0, ra(rm, 4), la(lm, 0), 1).build(),
        syndrome::REMOTE_INVAL_REQ_ERR,
        vendor_syndrome::MISALIGNED,
    );
    fails_and_flushes(
        |p, lm, rm| MaskedFetchAdd32::new(p.qpn(), 0, ra(rm, 2), la(lm, 0), 1).build(),
        syndrome::REMOTE_INVAL_REQ_ERR,
        vendor_syndrome::MISALIGNED,
    );
}

#[test]
fn undecodable_wqes_are_local_qp_operation_errors() {
    fails_and_flushes(
        |p, _, _| {
            let mut w = Nop::new(p.qpn(), 0).build();
            w.0[3] = 0x0a; // SEND: not an opcode this NIC executes
            w
        },
        syndrome::LOCAL_QP_OP_ERR,
        vendor_syndrome::BAD_WQE,
    );
    fails_and_flushes(
        |p, lm, rm| {
            let mut w = FetchAdd64::new(p.qpn(), 0, ra(rm, 0), la(lm, 0), 1).build();
            w.0[7] = 3; // DS 3 for an atomic
            w
        },
        syndrome::LOCAL_QP_OP_ERR,
        vendor_syndrome::BAD_WQE,
    );
    fails_and_flushes(
        |p, lm, rm| {
            let mut w = FetchAdd64::new(p.qpn(), 0, ra(rm, 0), la(lm, 0), 1).build();
            w.0[51] = 4; // result buffer of 4 bytes for an 8-byte atomic
            w
        },
        syndrome::LOCAL_LENGTH_ERR,
        vendor_syndrome::LENGTH,
    );
}

#[test]
fn wqes_posted_after_an_error_are_flushed_too() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(InlineWrite::new(q, 0, ra(&rm, 60), b"toolong").build());
    p.run();
    p.post(InlineWrite::new(q, 1, ra(&rm, 0), b"ok").cqe(true).build());
    p.post(Nop::new(q, 2).build());
    let st = p.run();
    assert_eq!((st.wqes_executed, st.wqes_flushed), (1, 2));
    let c = p.cqes();
    assert_eq!(c.len(), 3, "flushes complete every WQE, signalled or not");
    assert_err(
        &c[0],
        0,
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::REMOTE_RANGE,
    );
    assert_err(&c[1], 1, syndrome::WR_FLUSH_ERR, vendor_syndrome::FLUSH);
    assert_err(&c[2], 2, syndrome::WR_FLUSH_ERR, vendor_syndrome::FLUSH);
    assert_guarded(&p.ra, 0, 0);
}

#[test]
fn a_dropped_doorbell_is_recovered_by_the_next() {
    let mut p = Pair::manual();
    let q = p.qpn();
    p.a.set_fault_plan(FaultPlan::default().drop_doorbell(q, 1));
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(
        InlineWrite::new(q, 0, ra(&rm, 0), b"first")
            .cqe(true)
            .build(),
    );
    p.ring();
    for _ in 0..10 {
        p.a.progress().unwrap();
    }
    let st = p.a.qp_status(q).unwrap();
    assert_eq!(
        (st.fetched, st.doorbells),
        (0, 1),
        "the first doorbell was lost"
    );
    assert_eq!(p.ra.read_vec(1024, 5), vec![GUARD; 5]);
    p.post(
        InlineWrite::new(q, 1, ra(&rm, 8), b"second")
            .cqe(true)
            .build(),
    );
    p.qp.ring_uar(p.pi);
    let st = p.idle();
    assert_eq!(st.fetched, 2);
    assert_eq!(p.ra.read_vec(1024, 5), b"first");
    assert_eq!(p.ra.read_vec(1032, 6), b"second");
    assert_eq!(p.cqes().len(), 2);
}

#[test]
fn stale_doorbells_are_ignored() {
    let mut p = Pair::manual();
    let q = p.qpn();
    for i in 0..4 {
        p.post(Nop::new(q, i).cqe(true).build());
    }
    p.run();
    // An old index on every source: behind the NIC, so nothing runs again.
    p.qp.ring_uar(2);
    p.qp.ring_dbr(1);
    p.a.ring_doorbell(q, 3).unwrap();
    for _ in 0..5 {
        p.a.progress().unwrap();
    }
    let st = p.a.qp_status(q).unwrap();
    assert_eq!((st.fetched, st.cqes_written), (4, 4));
}

#[test]
fn every_doorbell_source_works() {
    let mut p = Pair::manual();
    let q = p.qpn();
    p.post(Nop::new(q, 0).cqe(true).build());
    p.qp.ring_uar(p.pi);
    assert_eq!(p.idle().fetched, 1);
    p.post(Nop::new(q, 1).cqe(true).build());
    p.a.ring_doorbell(q, p.pi).unwrap();
    assert_eq!(p.idle().fetched, 2);
    p.post(Nop::new(q, 2).cqe(true).build());
    p.qp.ring_dbr(p.pi);
    assert_eq!(p.idle().fetched, 3);

    // A producer slot (64-bit, host order), polled without any proxy. The buffers are declared
    // before the NIC so that they outlive it.
    let ring = HostBuffer::new(64 * 8);
    let cq = HostBuffer::new(64 * 8);
    let slot = HostBuffer::new(8);
    let fabric = ibgda_emu::Fabric::new();
    let nic = fabric.host_nic(NicConfig::named("slot").manual()).unwrap();
    let cfg = QpConfig {
        sq: ring.loc(0),
        nwqebbs: 8,
        cq: CqConfig::ring(cq.loc(0), 8),
        doorbell: DoorbellConfig {
            dbr: None,
            uar: false,
            producer_slot: Some(slot.loc(0)),
        },
    };
    // SAFETY: the ring, CQ and slot outlive the NIC (declared before it).
    let h = unsafe { nic.create_qp(cfg) }.unwrap();
    nic.connect(h.qpn, &nic.qp_info(h.qpn).unwrap()).unwrap();
    ring.write(0, Nop::new(h.qpn, 0).cqe(true).build().as_bytes());
    slot.store_u64(0, 1);
    let st = nic.wait_idle(h.qpn, T).unwrap();
    assert_eq!((st.fetched, st.cqes_written), (1, 1));
    nic.destroy_qp(h.qpn).unwrap();
}

#[test]
fn sixteen_bit_counters_wrap() {
    let mut p = Pair::new(true, 64, CqMode::Ring, 64);
    let q = p.qpn();
    let batch = 48u64;
    let mut seen = 0u64;
    while p.pi < 70_000 {
        for k in 0..batch {
            let i = p.pi;
            p.post(Nop::new(q, i as u16).cqe(k == batch - 1).build());
        }
        p.run();
        let c = p.qp.poll_cqe(seen).expect("CQE for the batch");
        assert_eq!(c.wqe_counter.get(), (p.pi - 1) as u16);
        seen += 1;
    }
    let st = p.a.qp_status(q).unwrap();
    assert_eq!(st.fetched, p.pi);
    assert!(st.fetched > 1 << 16);
}

/// A write with four gather entries (DS 6, two WQEBBs), placed so that it wraps the ring.
#[test]
fn multi_wqebb_wqes_wrap_the_ring() {
    let mut p = Pair::new(true, 8, CqMode::Ring, 8);
    let q = p.qpn();
    let lm = p.local(1024, 256, Access::NONE);
    let rm = p.remote(1024, 256, Access::REMOTE_WRITE);
    let src: Vec<u8> = (0..256).map(|i| i as u8).collect();
    p.la.write(1024, &src);
    for i in 0..7 {
        p.post(Nop::new(q, i).build());
    }
    p.run(); // the ring's slots are free again once consumed
    let mut w = vec![0u8; 128];
    let ctrl = CtrlSeg::new(CtrlFields {
        opcode: opcode::RDMA_WRITE,
        wqe_index: 7,
        qpn: q,
        ds: 6,
        fm_ce_se: CTRL_CQ_UPDATE,
        ..Default::default()
    });
    w[..16].copy_from_slice(bytemuck::bytes_of(&ctrl));
    w[16..32].copy_from_slice(bytemuck::bytes_of(&RaddrSeg::new(rm.addr, rm.rkey)));
    for k in 0..4u64 {
        let d = DataSeg::new(16, lm.lkey, lm.addr + 64 * k);
        let o = 32 + 16 * k as usize;
        w[o..o + 16].copy_from_slice(bytemuck::bytes_of(&d));
    }
    let at = p.post_raw(&w);
    assert_eq!(at, 7);
    p.run();
    let c = p.cqes();
    assert_eq!(c.len(), 1);
    assert_ok(&c[0], 7, opcode::RDMA_WRITE, 64);
    let got = p.ra.read_vec(1024, 64);
    for k in 0..4 {
        assert_eq!(&got[16 * k..16 * k + 16], &src[64 * k..64 * k + 16]);
    }
    assert_eq!(p.a.qp_status(q).unwrap().fetched, 9);
}

#[test]
fn a_wqe_past_the_producer_index_fails() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let mut w = vec![0u8; 128];
    let ctrl = CtrlSeg::new(CtrlFields {
        opcode: opcode::NOP,
        qpn: q,
        ds: 8,
        ..Default::default()
    });
    w[..16].copy_from_slice(bytemuck::bytes_of(&ctrl));
    p.post_raw(&w);
    p.qp.ring_dbr(1); // announces only the first of its two WQEBBs
    let st = p.idle();
    assert_eq!(st.state, QpState::Error);
    assert_err(
        &p.cqes()[0],
        0,
        syndrome::LOCAL_QP_OP_ERR,
        vendor_syndrome::PAST_PRODUCER,
    );
}

#[test]
fn injected_error_on_the_nth_wqe() {
    let mut p = Pair::manual();
    let q = p.qpn();
    p.a.set_fault_plan(FaultPlan::default().fail_wqe(q, 2, syndrome::REMOTE_OP_ERR));
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(InlineWrite::new(q, 0, ra(&rm, 0), b"one").cqe(true).build());
    p.post(InlineWrite::new(q, 1, ra(&rm, 8), b"two").cqe(true).build());
    p.post(
        InlineWrite::new(q, 2, ra(&rm, 16), b"three")
            .cqe(true)
            .build(),
    );
    p.run();
    let c = p.cqes();
    assert_eq!(c.len(), 3);
    assert_ok(&c[0], 0, opcode::RDMA_WRITE, 3);
    assert_err(&c[1], 1, syndrome::REMOTE_OP_ERR, vendor_syndrome::INJECTED);
    assert_err(&c[2], 2, syndrome::WR_FLUSH_ERR, vendor_syndrome::FLUSH);
    assert_eq!(p.ra.read_vec(1024, 3), b"one");
    assert_eq!(
        p.ra.read_vec(1032, 3),
        vec![GUARD; 3],
        "the failed WQE did not run"
    );
}

#[test]
fn a_lost_cqe_leaves_its_slot_invalid_and_later_cqes_behind_it() {
    let mut p = Pair::manual();
    let q = p.qpn();
    p.a.set_fault_plan(FaultPlan::default().lose_cqe(q, 1));
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(InlineWrite::new(q, 0, ra(&rm, 0), b"one").cqe(true).build());
    p.post(InlineWrite::new(q, 1, ra(&rm, 8), b"two").cqe(true).build());
    let st = p.run();
    assert_eq!(st.cqes_written, 1, "{st:?}");
    assert_eq!(p.ra.read_vec(1024, 3), b"one", "the data still landed");
    assert_eq!(p.ra.read_vec(1032, 3), b"two");
    assert!(
        p.qp.poll_cqe(0).is_none(),
        "the lost CQE's slot stays invalid"
    );
    let second =
        p.qp.poll_cqe(1)
            .expect("the second CQE is written behind it");
    assert_ok(&second, 1, opcode::RDMA_WRITE, 3);
}

/// Peer death: the NIC executes the WQEs it has left under the plan, then nothing ever again (no
/// doorbell read, no WQE run, no CQE written), while a live NIC beside it keeps working; waiting
/// on the dead one runs into its bound with the indices where it stopped.
#[test]
fn a_dead_nic_stops_after_its_last_wqe_and_never_runs_another() {
    let mut p = Pair::manual();
    let q = p.qpn();
    p.a.set_fault_plan(FaultPlan::default().die_after_wqes(2));
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    for (i, w) in [b"aaa", b"bbb", b"ccc", b"ddd"].iter().enumerate() {
        p.post(
            InlineWrite::new(q, i as u16, ra(&rm, 8 * i as u64), *w)
                .cqe(true)
                .build(),
        );
    }
    p.ring();
    let e =
        p.a.wait_idle(q, Duration::from_millis(100))
            .expect_err("a dead NIC never goes idle");
    let msg = e.to_string();
    assert!(msg.contains("idle"), "{msg}");
    let st = p.a.qp_status(q).unwrap();
    assert_eq!((st.wqes_executed, st.fetched), (2, 2), "{st:?}");
    assert_eq!(p.ra.read_vec(1024, 3), b"aaa");
    assert_eq!(p.ra.read_vec(1032, 3), b"bbb");
    assert_eq!(p.ra.read_vec(1040, 3), [GUARD; 3], "WQE 3 never ran");
    // A later doorbell is not even read.
    p.post(
        InlineWrite::new(q, 4, ra(&rm, 32), b"eee")
            .cqe(true)
            .build(),
    );
    p.ring();
    for _ in 0..10 {
        assert!(!p.a.progress().unwrap(), "a dead NIC made progress");
    }
    let st2 = p.a.qp_status(q).unwrap();
    assert_eq!(
        (st2.announced, st2.wqes_executed, st2.cqes_written),
        (st.announced, 2, 2),
        "{st2:?}"
    );
    assert_eq!(p.cqes().len(), 2);
    // A new plan brings it back (a test's reset, not a node coming back to life).
    p.a.set_fault_plan(FaultPlan::default());
    let st3 = p.idle();
    assert_eq!(st3.wqes_executed, 5, "{st3:?}");
    assert_eq!(p.ra.read_vec(1040, 3), b"ccc");
}

#[test]
fn completions_can_be_delayed() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let delay = Duration::from_millis(30);
    p.a.set_fault_plan(FaultPlan::default().delay_completions(delay));
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(InlineWrite::new(q, 0, ra(&rm, 0), b"x").cqe(true).build());
    let t0 = Instant::now();
    p.ring();
    p.a.progress().unwrap();
    assert_eq!(p.ra.read_vec(1024, 1), b"x", "the data lands at once");
    assert!(p.qp.poll_cqe(0).is_none(), "the CQE waits");
    assert_eq!(p.a.qp_status(q).unwrap().pending_cqes, 1);
    p.idle();
    assert!(t0.elapsed() >= delay);
    assert!(p.qp.poll_cqe(0).is_some());
}

#[test]
fn bandwidth_cap_and_latency_shape_completions() {
    let mut p = Pair::manual();
    let q = p.qpn();
    // 1 MB/s: 8 writes of 2 KiB take >= 16 ms.
    p.a.set_fault_plan(FaultPlan::default().shape(0.001, Duration::from_millis(2)));
    let lm = p.local(1024, 2048, Access::NONE);
    let rm = p.remote(1024, 2048, Access::REMOTE_WRITE);
    for i in 0..8 {
        p.post(
            RdmaWrite::new(q, i, ra(&rm, 0), sge(&lm, 0, 2048))
                .cqe(i == 7)
                .build(),
        );
    }
    let t0 = Instant::now();
    p.run();
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(18), "took {took:?}");
    assert_eq!(p.cqes().len(), 1);
}

#[test]
fn collapsed_cq_overwrites_entry_zero() {
    let mut p = Pair::new(true, 64, CqMode::Collapsed, 1);
    let q = p.qpn();
    for i in 0..5 {
        p.post(Nop::new(q, i).cqe(i % 2 == 0).build());
    }
    let st = p.run();
    assert_eq!(st.cqes_written, 3);
    let c = p.qp.cqe(0);
    assert_ok(&c, 4, opcode::NOP, 0);
    assert_eq!(c.owner(), 0, "third CQE: owner bit 2 & 1");
}

#[test]
fn reset_and_reconnect_after_an_error() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.post(InlineWrite::new(q, 0, ra(&rm, 62), b"xyz").build());
    assert_eq!(p.run().state, QpState::Error);
    let info = p.b.qp_info(p.peer.qpn()).unwrap();
    assert!(matches!(
        p.a.connect(q, &info),
        Err(EmuError::BadState { .. })
    ));
    p.a.reset_qp(q).unwrap();
    assert_eq!(p.a.qp_status(q).unwrap().state, QpState::Reset);
    p.qp.cq.write(0, &vec![0xffu8; 64 * 64]);
    p.a.connect(q, &info).unwrap();
    p.pi = 0;
    p.post(
        InlineWrite::new(q, 0, ra(&rm, 0), b"again")
            .cqe(true)
            .build(),
    );
    let st = p.run();
    assert_eq!(
        (st.state, st.fetched, st.cqes_written),
        (QpState::Rts, 1, 1)
    );
    assert_eq!(p.ra.read_vec(1024, 5), b"again");
    assert_eq!(p.qp.cqe(0).wqe_counter.get(), 0);
}

#[test]
fn the_progress_thread_runs_by_itself() {
    let mut p = Pair::new(false, 64, CqMode::Ring, 64);
    let q = p.qpn();
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
    let lm = p.local(1024, 64, Access::LOCAL_WRITE);
    for i in 0..10u16 {
        p.post(FetchAdd64::new(q, i, ra(&rm, 0), la(&lm, 0), 1).build());
    }
    p.post(Nop::new(q, 10).cqe(true).build());
    p.ring();
    let t0 = Instant::now();
    while p.qp.poll_cqe(0).is_none() {
        assert!(t0.elapsed() < T, "no CQE from the progress thread");
        std::thread::yield_now();
    }
    assert_eq!(
        p.ra.load_u64(1024),
        u64::from_ne_bytes([GUARD; 8]).wrapping_add(10)
    );
}

#[test]
fn deregistered_memory_is_refused() {
    let mut p = Pair::manual();
    let q = p.qpn();
    let rm = p.remote(1024, 64, Access::REMOTE_WRITE);
    p.b.deregister(&rm).unwrap();
    p.post(InlineWrite::new(q, 0, ra(&rm, 0), b"x").build());
    p.run();
    assert_err(
        &p.cqes()[0],
        0,
        syndrome::REMOTE_ACCESS_ERR,
        vendor_syndrome::BAD_RKEY,
    );
    assert_guarded(&p.ra, 0, 0);
    assert!(p.b.deregister(&rm).is_err());
}

#[test]
fn api_misuse_is_an_error_not_a_panic() {
    let fabric = ibgda_emu::Fabric::new();
    let nic = fabric.host_nic(NicConfig::named("x").manual()).unwrap();
    let qp = nic.create_host_qp(8, CqMode::Ring, 8).unwrap();
    let ghost = QpInfo {
        node: ibgda_emu::NodeId(1),
        qpn: 5,
        exports: vec![],
    };
    assert!(matches!(
        nic.connect(qp.qpn(), &ghost),
        Err(EmuError::UnknownPeer { .. })
    ));
    assert!(matches!(
        nic.wait_idle(qp.qpn(), T),
        Err(EmuError::BadState { .. })
    ));
    assert!(matches!(
        nic.qp_status(0xbad),
        Err(EmuError::NoSuchQp { .. })
    ));
    assert!(
        nic.create_host_qp(12, CqMode::Ring, 8).is_err(),
        "ring not a power of two"
    );
    let buf = std::sync::Arc::new(HostBuffer::new(64));
    assert!(nic.register_host(&buf, 32, 64, Access::ALL).is_err());
    let cfg = QpConfig {
        sq: Loc::Device(0x1000),
        nwqebbs: 8,
        cq: CqConfig::ring(Loc::Host(buf.addr()), 1),
        doorbell: DoorbellConfig::default(),
    };
    // SAFETY: rejected before any memory is touched.
    let r = unsafe { nic.create_qp(cfg) };
    assert!(matches!(r, Err(EmuError::Unsupported { .. })));
    let _ = ARENA;
}

#[test]
fn a_wait_that_runs_out_names_the_qp_and_indices() {
    let mut p = Pair::new(true, 64, CqMode::Ring, 64);
    let q = p.qpn();
    p.a.set_fault_plan(FaultPlan::default().delay_completions(Duration::from_secs(60)));
    p.post(Nop::new(q, 0).cqe(true).build());
    p.ring();
    let e = p.a.wait_idle(q, Duration::from_millis(50)).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains(&format!("{q:#x}")) && s.contains("announced 1") && s.contains("pending 1"),
        "{s}"
    );
}

/// Several QPs and producer threads at once against one word, with the progress thread running:
/// host atomics are CPU atomics, so no update is lost.
#[test]
fn concurrent_producers_and_atomics() {
    let fabric = ibgda_emu::Fabric::new();
    let a = fabric.host_nic(NicConfig::named("a")).unwrap();
    let b = fabric.host_nic(NicConfig::named("b")).unwrap();
    let target = std::sync::Arc::new(HostBuffer::new(64));
    let scratch = std::sync::Arc::new(HostBuffer::new(64));
    let rm = b
        .register_host(&target, 0, 64, Access::REMOTE_ATOMIC)
        .unwrap();
    let lm = a
        .register_host(&scratch, 0, 64, Access::LOCAL_WRITE)
        .unwrap();
    let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
    let info = b.qp_info(peer.qpn()).unwrap();
    let qps: Vec<_> = (0..4)
        .map(|_| {
            let qp = a.create_host_qp(64, CqMode::Ring, 64).unwrap();
            a.connect(qp.qpn(), &info).unwrap();
            qp
        })
        .collect();
    std::thread::scope(|s| {
        for (k, qp) in qps.iter().enumerate() {
            let a = &a;
            s.spawn(move || {
                let q = qp.qpn();
                for batch in 0..50u64 {
                    for j in 0..20u64 {
                        let i = batch * 20 + j;
                        let w = FetchAdd64::new(q, i as u16, ra(&rm, 0), la(&lm, 8 * k as u64), 1)
                            .cqe(j == 19)
                            .build();
                        qp.post(i, &w);
                    }
                    match batch % 3 {
                        0 => qp.ring_dbr((batch + 1) * 20),
                        1 => qp.ring_uar((batch + 1) * 20),
                        _ => a.ring_doorbell(q, (batch + 1) * 20).unwrap(),
                    }
                    let t0 = Instant::now();
                    while qp.poll_cqe(batch).is_none() {
                        assert!(t0.elapsed() < T, "QP {q:#x} batch {batch}: no CQE");
                        std::thread::yield_now();
                    }
                }
            });
        }
    });
    assert_eq!(target.load_u64(0), 4 * 1000);
}

/// Once `destroy_qp` returns, the progress thread never touches the QP's memory again, even a
/// round over a list of QPs taken before the destroy: here a doorbell written into a destroyed
/// QP's record must never execute the WQE waiting in its ring (its owner may free it at once).
#[test]
fn a_destroyed_qp_is_never_touched_again() {
    let fabric = ibgda_emu::Fabric::new();
    let a = fabric.host_nic(NicConfig::named("a")).unwrap();
    let b = fabric.host_nic(NicConfig::named("b")).unwrap();
    let target = std::sync::Arc::new(HostBuffer::new(64));
    target.fill(GUARD);
    let rm = b
        .register_host(&target, 0, 64, Access::REMOTE_WRITE)
        .unwrap();
    let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
    let info = b.qp_info(peer.qpn()).unwrap();
    // Idle QPs that make every round longer.
    let _busy: Vec<_> = (0..16)
        .map(|_| {
            let qp = a.create_host_qp(8, CqMode::Ring, 8).unwrap();
            a.connect(qp.qpn(), &info).unwrap();
            qp
        })
        .collect();
    const N: u32 = 16;
    for iter in 0..300 {
        let mem = HostBuffer::new(2 * N as usize * 64 + 64);
        let cfg = QpConfig {
            sq: mem.loc(0),
            nwqebbs: N,
            cq: CqConfig::ring(mem.loc(N as usize * 64), N),
            doorbell: DoorbellConfig {
                dbr: Some(mem.loc(2 * N as usize * 64)),
                uar: false,
                producer_slot: None,
            },
        };
        // SAFETY: `mem` outlives the QP: it is dropped after destroy_qp below.
        let h = unsafe { a.create_qp(cfg) }.unwrap();
        a.connect(h.qpn, &info).unwrap();
        let w = InlineWrite::new(h.qpn, 0, ra(&rm, 0), b"zombie!!").build();
        mem.write(0, w.as_bytes());
        a.destroy_qp(h.qpn).unwrap();
        mem.store_u32(
            2 * N as usize * 64 + 4,
            u32::from_ne_bytes(ibgda_device::wire::dbr_send_word(1).to_bytes()),
        );
        // Give a stale round the time to act on the doorbell, then free the memory.
        for _ in 0..20 {
            std::thread::yield_now();
        }
        drop(mem);
        assert_eq!(
            target.read_vec(0, 8),
            vec![GUARD; 8],
            "iteration {iter}: a destroyed QP executed a WQE"
        );
    }
}

/// A progress thread that has gone to sleep (idle past its spin and yield phases) executes what a
/// direct doorbell announces; the handle keeps working after the NIC stops.
#[test]
fn a_direct_doorbell_wakes_a_sleeping_progress_thread() {
    let mut p = Pair::new(false, 64, CqMode::Ring, 64);
    let q = p.qpn();
    let db = p.a.direct_doorbell(q).unwrap();
    assert_eq!(db.qpn(), q);
    for round in 0..3u64 {
        // Past the progress thread's spin (200 µs) and yield (5 ms) phases.
        std::thread::sleep(Duration::from_millis(20));
        p.post(Nop::new(q, round as u16).cqe(true).build());
        db.ring(round + 1);
        let t0 = Instant::now();
        while p.qp.poll_cqe(round).is_none() {
            assert!(t0.elapsed() < T, "round {round}: no CQE");
            std::thread::yield_now();
        }
    }
    assert!(p.a.direct_doorbell(0xbad).is_err());
    let Pair { a, .. } = p;
    drop(a);
    db.ring(10); // the NIC is gone: nothing happens, nothing breaks
}

/// The engine's own cost per WQE (decode, checks, strict pipeline, CQE), with the host backend's
/// memory operations (a `memcpy`): what is left for the driver calls of a CUDA NIC. Run it in
/// release: `cargo test --release -p ibgda-emu --test host_emu -- --ignored --nocapture
/// engine_cost`.
#[test]
#[ignore = "a measurement: run it in release"]
fn engine_cost_per_wqe() {
    for strict in [StrictMode::off(), StrictMode::full(1)] {
        let mut p = Pair::with_strict(true, 1024, CqMode::Ring, 1024, strict);
        let q = p.qpn();
        let lm = p.local(0, 4096, Access::ALL);
        let rm = p.remote(0, 4096, Access::ALL);
        for (name, n) in [
            ("rdma write 64 B", 512u64),
            ("inline 8 B", 512),
            ("fetch-add", 512),
        ] {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let base = p.pi;
                for k in 0..n {
                    let i = (base + k) as u16;
                    let last = k + 1 == n;
                    let w = match name {
                        "rdma write 64 B" => {
                            RdmaWrite::new(q, i, ra(&rm, 64 * (k % 32)), sge(&lm, 2048, 64))
                                .cqe(last)
                                .build()
                        }
                        "inline 8 B" => InlineWrite::new(q, i, ra(&rm, 8 * (k % 256)), &[1u8; 8])
                            .cqe(last)
                            .build(),
                        _ => FetchAdd64::new(
                            q,
                            i,
                            ra(&rm, 8 * (k % 64)),
                            LocalAddr {
                                addr: lm.addr + 8 * (k % 64),
                                lkey: lm.lkey,
                            },
                            1,
                        )
                        .cqe(last)
                        .build(),
                    };
                    p.post(w);
                }
                let t0 = Instant::now();
                p.run();
                best = best.min(t0.elapsed().as_secs_f64() / n as f64);
            }
            eprintln!(
                "engine, strict {}: {name}: {:.0} ns per WQE",
                strict.reorder.is_some(),
                best * 1e9
            );
        }
    }
}

/// A NIC with three progress threads serves six QPs (two each): every QP's WQEs run in order on
/// its thread, atomics on a shared word from all of them stay atomic, and every CQE arrives.
#[test]
fn several_progress_threads_share_the_qps() {
    let fabric = ibgda_emu::Fabric::new();
    let a = fabric
        .host_nic(NicConfig::named("a").progress_threads(3))
        .unwrap();
    let b = fabric.host_nic(NicConfig::named("b")).unwrap();
    let target = std::sync::Arc::new(HostBuffer::new(4096));
    let fetch = std::sync::Arc::new(HostBuffer::new(8 * 6 * 200));
    let rm = b.register_host(&target, 0, 4096, Access::ALL).unwrap();
    let lm = a
        .register_host(&fetch, 0, fetch.len(), Access::ALL)
        .unwrap();
    let qps: Vec<_> = (0..6)
        .map(|_| {
            let qp = a.create_host_qp(256, CqMode::Ring, 256).unwrap();
            let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
            a.connect(qp.qpn(), &b.qp_info(peer.qpn()).unwrap())
                .unwrap();
            (qp, peer)
        })
        .collect();
    for (k, (qp, _)) in qps.iter().enumerate() {
        for i in 0..200u64 {
            let w = if i % 2 == 0 {
                FetchAdd64::new(
                    qp.qpn(),
                    i as u16,
                    ra(&rm, 0),
                    LocalAddr {
                        addr: lm.addr + 8 * (200 * k as u64 + i),
                        lkey: lm.lkey,
                    },
                    1,
                )
                .cqe(i == 198)
                .build()
            } else {
                // The QP's own slot, rewritten in order: the last write wins.
                InlineWrite::new(
                    qp.qpn(),
                    i as u16,
                    ra(&rm, 64 + 8 * k as u64),
                    &i.to_ne_bytes(),
                )
                .cqe(i == 199)
                .build()
            };
            qp.post(i, &w);
        }
        qp.ring_dbr(200);
    }
    for (qp, _) in &qps {
        a.wait_idle(qp.qpn(), T).unwrap();
        for c in 0..2 {
            let cqe = qp.poll_cqe(c).expect("both CQEs");
            assert!(!cqe.is_error(), "{cqe}");
        }
    }
    assert_eq!(target.load_u64(0), 600);
    for k in 0..6 {
        assert_eq!(target.load_u64(64 + 8 * k), 199, "QP {k}'s slot");
    }
    let mut old: Vec<u64> = (0..6)
        .flat_map(|k| (0..100).map(move |j| (k, 2 * j)))
        .map(|(k, i)| fetch.load_u64(8 * (200 * k + i) as usize))
        .collect();
    old.sort_unstable();
    assert_eq!(old, (0..600).collect::<Vec<u64>>());
}
