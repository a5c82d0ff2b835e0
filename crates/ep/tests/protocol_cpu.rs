//! The CPU model of the submit/quiet protocol, in CI: host threads run the algorithm of
//! `ibgda/protocol.cuh` (`ibgda_device::protocol::HostQp`) on QPs built by `ep::transport` over
//! the emulated NIC's host backend, with the CPU proxy ringing in mode `cpu_host_memory` and the
//! submitters ringing the emulated UAR page themselves in mode `gpu`.
//!
//! The upstream CPU-assisted bugs (shared/reference/deepep-pr-677.txt) as regression tests:
//! 1. the first submission in a CPU mode is seen by the proxy and completes;
//! 2. after a heavy multi-threaded workload on shared QPs, another submitter (a barrier) completes
//!    and `ready_head == resv_head`; a lost reservation ends in the bounded ready-wait error;
//! 3. with completions delayed by the emulator, quiet does not return before they arrive;
//! 4. the producer slot is an 8-byte-aligned u64.

use std::time::{Duration, Instant};

use ep::transport::{Arena, EmuRank, ProxyDoorbell, QpGroup, QpGroupConfig, TransportError};
use ibgda_device::protocol::{HandlerChoice, HostQp};
use ibgda_device::proxy::{check_alignment, ProducerSlot, ProxyConfig, SlotError};
use ibgda_device::qp_desc::{ErrorKind, NicHandler};
use ibgda_device::wire::{syndrome, RemoteAddr};
use ibgda_emu::{Fabric, FaultPlan};

const MODES: [NicHandler; 2] = [NicHandler::Gpu, NicHandler::CpuHostMemory];

struct Pair {
    _fabric: Fabric,
    me: EmuRank,
    src: Arena,
    dst: Arena,
}

fn group(
    p: &Pair,
    peer: &EmuRank,
    mode: NicHandler,
    nqps: u32,
    nwqes: u32,
    timeout: Duration,
) -> QpGroup {
    let cfg = QpGroupConfig {
        handler: mode,
        nqps,
        nwqes,
        timeout,
        proxy: ProxyConfig {
            spins_before_yield: 256,
            ..Default::default()
        },
        peer_rank: 1,
        ..Default::default()
    };
    p.me.connect(peer, &p.src, &cfg)
        .expect("building the QP group")
}

/// A fabric with two host NICs, the source arena on rank 0 and the destination on rank 1.
fn setup(bytes: usize) -> (Pair, EmuRank) {
    let fabric = Fabric::new();
    let me = EmuRank::host(&fabric, 0).expect("host NIC 0");
    let peer = EmuRank::host(&fabric, 1).expect("host NIC 1");
    let src = me.arena(bytes).expect("source arena");
    let dst = peer.arena(bytes).expect("destination arena");
    (
        Pair {
            _fabric: fabric,
            me,
            src,
            dst,
        },
        peer,
    )
}

fn fill_src(p: &Pair, seed: u8) -> Vec<u8> {
    let v: Vec<u8> = (0..p.src.len())
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) | 1)
        .collect();
    p.src.host().unwrap().write(0, &v);
    v
}

fn remote(p: &Pair, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: p.dst.addr() + off,
        rkey: p.dst.mr().rkey,
    }
}

#[test]
fn first_submission_in_every_mode_is_seen_and_completes() {
    for (mode, how) in [
        (NicHandler::CpuHostMemory, ProxyDoorbell::Direct),
        (NicHandler::CpuHostMemory, ProxyDoorbell::UarPage),
        (NicHandler::Gpu, ProxyDoorbell::Direct),
    ] {
        let (p, peer) = setup(4096);
        let src = fill_src(&p, 5);
        let cfg = QpGroupConfig {
            handler: mode,
            nqps: 2,
            nwqes: 64,
            proxy_doorbell: how,
            peer_rank: 1,
            ..Default::default()
        };
        let g = p.me.connect(&peer, &p.src, &cfg).expect("group");
        let qp = &g.host_qps()[1];
        qp.put(remote(&p, 512), p.src.addr() + 512, 1000, true)
            .expect("first put");
        qp.quiet().expect("first quiet");
        assert_eq!(
            p.dst.host().unwrap().read_vec(512, 1000),
            src[512..1512],
            "{mode:?}/{how:?}: data"
        );
        let c = g.counters(1).unwrap();
        assert_eq!(
            (c.resv_head, c.ready_head, c.cons_idx),
            (1, 1, 1),
            "{mode:?}: {c:?}"
        );
        let st = g.emu_status(1).unwrap();
        assert!(
            st.doorbells >= 1 && st.cqes_written == 1,
            "{mode:?}: {st:?}"
        );
        if mode.uses_proxy() {
            let proxy = g.proxy().expect("CPU modes run a proxy");
            // The proxy stores its count after ringing, so the completion can be seen first
            // (a descheduled proxy thread on a loaded machine): wait for it, bounded.
            let deadline = Instant::now() + Duration::from_secs(10);
            while proxy.last_rung(1) != Some(1) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                proxy.last_rung(1),
                Some(1),
                "{mode:?}: the proxy never rang the first publish"
            );
            assert_eq!(proxy.last_rung(0), Some(0));
        } else {
            assert!(g.proxy().is_none());
            assert_eq!(c.prod_idx, 1, "mode gpu: the submitter rang");
        }
        g.check().expect("no failure recorded");
        let report = g.shutdown().expect("clean shutdown");
        if mode.uses_proxy() {
            assert_eq!(report.unwrap().rung, vec![0, 1]);
        }
    }
}

fn heavy_then_barrier(mode: NicHandler) {
    let (threads, iters, len, nqps) = (6usize, 150u64, 200u64, 4u32);
    let (p, peer) = setup(threads * iters as usize * len as usize + 4096);
    let src = fill_src(&p, 9);
    // A small ring: reservations wait for completions all the time.
    let g = group(&p, &peer, mode, nqps, 32, Duration::from_secs(30));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads as u64 {
            let (g, p) = (&g, &p);
            s.spawn(move || {
                for i in 0..iters {
                    let qp = &g.host_qps()[((t + i) % u64::from(nqps)) as usize];
                    let off = (t * iters + i) * len;
                    // Doorbell batching: only every third put rings; chunks make multi-WQE
                    // submissions, as a warp posts them.
                    qp.put_chunked(remote(p, off), p.src.addr() + off, len, 64, i % 3 == 2)
                        .unwrap_or_else(|e| panic!("{mode:?} thread {t} put {i}: {e}"));
                }
                for qp in g.host_qps() {
                    qp.quiet()
                        .unwrap_or_else(|e| panic!("{mode:?} thread {t} quiet: {e}"));
                }
            });
        }
    });
    // The barrier: another submitter on the same QPs, after all of that.
    let counters_off = (threads as u64 * iters * len).div_ceil(64) * 64;
    for (k, qp) in g.host_qps().iter().enumerate() {
        qp.signal_add(remote(&p, counters_off + 8 * k as u64), 1, true, true)
            .expect("barrier signal");
        qp.quiet().expect("barrier quiet");
    }
    eprintln!("{mode:?}: workload + barrier in {:?}", t0.elapsed());
    for k in 0..nqps as usize {
        let c = g.counters(k).unwrap();
        assert_eq!(c.ready_head, c.resv_head, "{mode:?} QP {k}: {c:?}");
        assert_eq!(c.cons_idx, c.ready_head, "{mode:?} QP {k}: {c:?}");
        let v = p
            .dst
            .host()
            .unwrap()
            .load_u64(counters_off as usize + 8 * k);
        assert_eq!(v, 1, "{mode:?} QP {k}: barrier counter");
    }
    let n = threads * iters as usize * len as usize;
    assert!(
        p.dst.host().unwrap().read_vec(0, n) == src[..n],
        "{mode:?}: data differs"
    );
    g.check().expect("no failure recorded");
    g.shutdown().expect("clean shutdown");
}

#[test]
fn barrier_after_heavy_workload_completes_gpu_mode() {
    heavy_then_barrier(NicHandler::Gpu);
}

#[test]
fn barrier_after_heavy_workload_completes_cpu_host_memory_mode() {
    heavy_then_barrier(NicHandler::CpuHostMemory);
}

#[test]
fn broken_ordering_ends_in_the_bounded_ready_wait_error() {
    for mode in MODES {
        let (p, peer) = setup(4096);
        let bound = Duration::from_millis(200);
        let g = group(&p, &peer, mode, 2, 64, bound);
        let qp = &g.host_qps()[1];
        qp.nop(true).unwrap();
        qp.quiet().unwrap();
        // The broken submitter: reserves, never publishes (upstream's skipped ready_head queue).
        assert_eq!(qp.reserve(3).unwrap().base, 1);
        let t0 = Instant::now();
        let stop = qp.nop(true).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(stop.kind(), Some(ErrorKind::TimeoutReady), "{mode:?}");
        assert!(took >= bound && took < bound * 10, "{mode:?}: {took:?}");
        let e = g.check().unwrap_err();
        let msg = e.to_string();
        for want in [
            "rank 0",
            "QP 1",
            "resv_head=5",
            "ready_head=1",
            "cons_idx=1",
            mode.name(),
            "ready_head to reach",
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        assert!(matches!(e, TransportError::Device { .. }));
        // Everyone else stops too, within the bound, instead of hanging.
        let t0 = Instant::now();
        assert!(g.host_qps()[1].nop(true).is_err());
        assert!(t0.elapsed() < bound * 10);
    }
}

#[test]
fn quiet_waits_for_delayed_completions_in_every_mode() {
    for mode in MODES {
        let (p, peer) = setup(4096);
        let src = fill_src(&p, 3);
        let g = group(&p, &peer, mode, 1, 64, Duration::from_secs(10));
        let delay = Duration::from_millis(200);
        g.nic()
            .set_fault_plan(FaultPlan::default().delay_completions(delay));
        let qp = &g.host_qps()[0];
        let t0 = Instant::now();
        for k in 0..4u64 {
            // Unrung (batched): quiet itself must get the doorbell out.
            qp.put(remote(&p, 256 * k), p.src.addr() + 256 * k, 256, false)
                .unwrap();
        }
        qp.quiet().expect("quiet");
        let took = t0.elapsed();
        assert!(
            took >= delay,
            "{mode:?}: quiet returned after {took:?}, before the delayed completions"
        );
        let c = g.counters(0).unwrap();
        assert_eq!(c.cons_idx, 4, "{mode:?}: {c:?}");
        assert_eq!(g.emu_status(0).unwrap().cqes_written, 4);
        assert_eq!(p.dst.host().unwrap().read_vec(0, 1024), src[..1024]);
        g.check().unwrap();
    }
}

/// A CQE lost on the way (the emulator's fault plan): quiet never sees the completion, so it
/// runs into its bound and says so, naming rank, QP and the four indices, in every mode; the data
/// itself landed.
#[test]
fn a_lost_completion_ends_quiet_in_a_bounded_named_timeout() {
    for mode in MODES {
        let (p, peer) = setup(4096);
        let src = fill_src(&p, 5);
        let bound = Duration::from_millis(300);
        let g = group(&p, &peer, mode, 1, 64, bound);
        let qpn = g.qpn(0);
        g.nic()
            .set_fault_plan(FaultPlan::default().lose_cqe(qpn, 1));
        let qp = &g.host_qps()[0];
        qp.put(remote(&p, 0), p.src.addr(), 512, true).unwrap();
        let t0 = Instant::now();
        let e = qp.quiet().expect_err("the only completion was lost");
        let took = t0.elapsed();
        assert!(
            took >= bound && took < bound * 20,
            "{mode:?}: quiet took {took:?}"
        );
        assert_eq!(e.kind(), Some(ErrorKind::TimeoutQuiet), "{mode:?}: {e}");
        let msg = g.check().unwrap_err().to_string();
        for want in ["rank 0", "QP 0", "ready_head=", "cons_idx=0", mode.name()] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        assert_eq!(p.dst.host().unwrap().read_vec(0, 512), src[..512]);
    }
}

#[test]
fn producer_slots_are_aligned_u64s() {
    assert_eq!(
        std::mem::size_of::<u64>(),
        ibgda_device::proxy::PRODUCER_SLOT_BYTES
    );
    assert_eq!(check_alignment(0x1004), Err(SlotError::Misaligned(0x1004)));
    let words = [0u64; 2];
    let odd = (words.as_ptr() as usize + 4) as *const u64;
    // SAFETY: construction fails before anything is read.
    let refused = unsafe { ProducerSlot::new(odd) };
    assert!(refused.is_err());
    let (p, peer) = setup(4096);
    let g = group(
        &p,
        &peer,
        NicHandler::CpuHostMemory,
        16,
        64,
        Duration::from_secs(5),
    );
    for i in 0..16 {
        let slot = g.producer_slot_cpu(i).unwrap();
        assert_eq!(slot % 8, 0, "QP {i}");
        let d = g.host_qps()[i].config();
        assert_eq!(d.producer_slot % 8, 0);
        assert_eq!(
            d.producer_slot, slot,
            "host backend: one address for both sides"
        );
        g.host_qps()[i]
            .check_desc()
            .expect("descriptor passes the device checks");
    }
}

#[test]
fn error_completion_is_reported_with_rank_qp_and_syndrome() {
    for mode in MODES {
        let (p, peer) = setup(4096);
        let g = group(&p, &peer, mode, 1, 64, Duration::from_secs(10));
        let qp = &g.host_qps()[0];
        let bad = RemoteAddr {
            addr: p.dst.addr(),
            rkey: p.dst.mr().rkey ^ 0x5a5a,
        };
        qp.nop(true).unwrap();
        qp.put(bad, p.src.addr(), 64, true).unwrap();
        let stop = qp.quiet().unwrap_err();
        assert_eq!(stop.kind(), Some(ErrorKind::Cqe), "{mode:?}");
        let msg = g.check().unwrap_err().to_string();
        for want in [
            "rank 0",
            "QP 0",
            "REMOTE_ACCESS_ERR",
            "RDMA_WRITE",
            mode.name(),
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        assert_eq!(g.error_record().syndrome, syndrome::REMOTE_ACCESS_ERR);
        // Sticky: the next quiet fails at once too.
        assert!(qp.quiet().is_err());
    }
}

#[test]
fn handler_selection_on_the_emulated_nic() {
    let (p, _peer) = setup(64);
    assert_eq!(p.me.select(HandlerChoice::Auto).unwrap(), NicHandler::Gpu);
    assert_eq!(
        p.me.select(HandlerChoice::CpuHostMemory).unwrap(),
        NicHandler::CpuHostMemory
    );
    let e = p.me.select(HandlerChoice::Cpu).unwrap_err().to_string();
    assert!(e.contains("cpu") && e.contains("not available"), "{e}");
}

#[test]
fn many_submitters_on_one_qp_keep_order_with_a_tiny_ring() {
    // Ring of 4 WQEBBs, 8 threads: every reservation waits for ring space, every publish waits
    // its turn; nothing may be overwritten before it completed (the emulator would execute a
    // rewritten slot's WQE under the wrong index, and the data check would fail).
    for mode in MODES {
        let (p, peer) = setup(8 * 64 * 64);
        let src = fill_src(&p, 1);
        let g = group(&p, &peer, mode, 1, 4, Duration::from_secs(30));
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (g, p) = (&g, &p);
                s.spawn(move || {
                    let qp: &HostQp = &g.host_qps()[0];
                    for i in 0..64u64 {
                        let off = (t * 64 + i) * 64;
                        qp.put(remote(p, off), p.src.addr() + off, 64, i % 2 == 1)
                            .unwrap();
                    }
                    qp.quiet().unwrap();
                });
            }
        });
        let c = g.counters(0).unwrap();
        assert_eq!(
            (c.resv_head, c.ready_head, c.cons_idx),
            (512, 512, 512),
            "{mode:?}"
        );
        assert!(
            p.dst.host().unwrap().read_vec(0, 512 * 64) == src[..512 * 64],
            "{mode:?}"
        );
    }
}

/// The two sides of a group built apart, as ranks in two processes build them, with every
/// `QpInfo` passed as bytes (host NICs of one fabric: nothing is exported, the peer is found
/// through the fabric): passive QPs for the peer, the group connected to them, the passive QPs
/// accepting the group. Data and a remote add land, both sides name each other, and the group
/// and the passive QPs close cleanly, in every mode.
#[test]
fn group_built_from_passive_infos_as_across_processes() {
    let wire = |infos: Vec<ibgda_emu::QpInfo>| -> Vec<ibgda_emu::QpInfo> {
        infos
            .iter()
            .map(|i| ibgda_emu::QpInfo::from_bytes(&i.to_bytes()).expect("info round trip"))
            .collect()
    };
    for mode in MODES {
        let (p, peer) = setup(4096);
        let src = fill_src(&p, 9);
        let (infos, passive) = peer.passive_for(0, 3).expect("passive QPs");
        assert_eq!((passive.len(), passive.peer_rank()), (3, 0));
        let cfg = QpGroupConfig {
            handler: mode,
            nqps: 3,
            nwqes: 64,
            peer_rank: 1,
            ..Default::default()
        };
        // One info short: refused before anything is built.
        match p.me.connect_remote(&wire(infos.clone())[..2], &p.src, &cfg) {
            Err(TransportError::Config(m)) => assert!(m.contains("2 peer QP infos"), "{m}"),
            other => panic!("{mode:?}: a short info list: {other:?}"),
        }
        let g =
            p.me.connect_remote(&wire(infos), &p.src, &cfg)
                .expect("the group");
        let back = wire(g.infos_for_ipc().expect("the group's infos"));
        assert!(passive.accept(&back[..1]).is_err(), "a short accept");
        passive.accept(&back).expect("accepting the group");
        for i in 0..3 {
            let mine = g.emu_status(i).unwrap().peer;
            let theirs = peer.nic().qp_status(passive.qpn(i)).unwrap().peer;
            assert_eq!(mine, Some((peer.nic().node(), passive.qpn(i))), "{mode:?}");
            assert_eq!(theirs, Some((p.me.nic().node(), g.qpn(i))), "{mode:?}");
        }
        let qp = &g.host_qps()[2];
        qp.put(remote(&p, 64), p.src.addr() + 64, 700, false)
            .expect("put");
        qp.signal_add(remote(&p, 2048), 5, true, true)
            .expect("remote add");
        qp.quiet().expect("quiet");
        let dst = p.dst.host().unwrap();
        assert_eq!(dst.read_vec(64, 700), src[64..764], "{mode:?}: data");
        assert_eq!(dst.load_u64(2048), 5, "{mode:?}: remote add");
        g.check().expect("no failure recorded");
        g.shutdown().expect("the group closes");
        passive.close().expect("the passive QPs close");
    }
}
