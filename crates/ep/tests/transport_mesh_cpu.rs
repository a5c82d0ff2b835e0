//! The transport interface end to end on the CPU (host backend, CI): ranks as threads open their
//! NICs behind `RankTransport`, register memory, connect QPs to every peer through the bootstrap
//! (`connect_mesh`: connection info as bytes, two all-gathers), and drive the QPs with the
//! protocol's host model (`HostQp`): an RDMA write and a fenced remote add to every peer, then
//! quiet. Every rank then finds each peer's bytes and counts in its own memory. Both
//! CPU-runnable handler modes; the same test for every implementation of the interface.

use std::time::Duration;

use ep::bootstrap::{Communicator, ThreadGroup};
use ep::transport::{
    connect_mesh, connect_mesh_among, EmulatedTransport, LinkKind, LocalAddress, QpGroupConfig,
    RankTransport, VerbsConnInfo, VerbsDriver, VerbsTransport,
};
use ep::Exchange;
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;
use ibgda_device::wire::RemoteAddr;
use ibgda_emu::firmware::EmuSubnet;
use ibgda_emu::Fabric;

const RANKS: usize = 3;
const NQPS: u32 = 2;
/// Per source rank: a 256-byte row at `256 * src`, and a u64 counter at `COUNTS + 8 * src`.
const ROW: usize = 256;
const COUNTS: usize = 2048;
const BYTES: usize = 4096;
const T: Duration = Duration::from_secs(20);

/// The QPs to rank `r` of the tests that use [`NQPS`] QPs of 64 WQEBBs, bounded by [`T`].
fn qp_config(handler: NicHandler, r: usize) -> QpGroupConfig {
    QpGroupConfig {
        handler,
        nqps: NQPS,
        nwqes: 64,
        timeout: T,
        peer_rank: r as u32,
        ..Default::default()
    }
}

fn row(src: usize, dst: usize) -> Vec<u8> {
    (0..ROW)
        .map(|i| (i as u8).wrapping_mul(7) ^ (src as u8 * 16 + dst as u8) | 1)
        .collect()
}

/// Runs the mesh over `RANKS` ranks as threads, each opening its NIC with `open(rank)`.
fn mesh_carries_writes_and_atomics(
    name: &str,
    mode: HandlerChoice,
    open: impl Fn(usize) -> Box<dyn RankTransport> + Sync,
) {
    mesh_of_carries_writes_and_atomics(RANKS, name, mode, open)
}

/// Runs the mesh over `ranks` ranks (at most 3: the rows and counters fit `BYTES`) as threads,
/// each opening its NIC with `open(rank)`.
fn mesh_of_carries_writes_and_atomics(
    ranks: usize,
    name: &str,
    mode: HandlerChoice,
    open: impl Fn(usize) -> Box<dyn RankTransport> + Sync,
) {
    assert!((2..=3).contains(&ranks));
    let comms = ThreadGroup::with_timeout(ranks, T).expect("thread group");
    let open = &open;
    std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    let nic = open(rank);
                    let (handler, why) = nic.select(mode).expect("handler mode");
                    assert!(!why.is_empty());
                    let reg = nic.register(BYTES).expect("registering memory");
                    let host = reg.host().expect("host backend").clone();
                    // Source rows for every peer, after the counters.
                    for dst in 0..ranks {
                        host.write(COUNTS + 512 + ROW * dst, &row(rank, dst));
                    }
                    let all = comm
                        .all_gather(&[reg.addr(), u64::from(reg.rkey())])
                        .expect("exchanging addresses");
                    let cfg = |r: usize| qp_config(handler, r);
                    let mesh = connect_mesh(&*nic, &comm, &*reg, NQPS, cfg, |doing, e| {
                        panic!("rank {rank}: {doing}: {e}")
                    })
                    .expect("connecting the mesh");
                    for (dst, set) in mesh.sets.iter().enumerate() {
                        let Some(set) = set else {
                            assert_eq!(dst, rank);
                            continue;
                        };
                        assert_eq!((set.len(), set.mode()), (NQPS as usize, handler));
                        assert!(set.descs().is_none(), "host backend: no device descriptors");
                        let qp = &set.host_qps()[dst % NQPS as usize];
                        let base = all[dst][0];
                        let rkey = all[dst][1] as u32;
                        let remote = |off: usize| RemoteAddr {
                            addr: base + off as u64,
                            rkey,
                        };
                        qp.put(
                            remote(ROW * rank),
                            reg.addr() + (COUNTS + 512 + ROW * dst) as u64,
                            ROW as u32,
                            false,
                        )
                        .expect("put");
                        qp.signal_add(remote(COUNTS + 8 * rank), rank as u64 + 1, true, true)
                            .expect("signal");
                        if let Err(e) = qp.quiet() {
                            panic!(
                                "{name}/{mode}: rank {rank} → {dst}: quiet: {e:?}: {:?}; {:?}",
                                set.check(),
                                qp.counters()
                            );
                        }
                        set.check().expect("no recorded failure");
                    }
                    // Every rank's writes have completed once every rank has quieted.
                    comm.all_gather(&[]).expect("barrier");
                    for src in (0..ranks).filter(|&s| s != rank) {
                        assert_eq!(
                            host.read_vec(ROW * src, ROW),
                            row(src, rank),
                            "{name}/{mode}: rank {rank}: row from rank {src}"
                        );
                        assert_eq!(
                            host.load_u64(COUNTS + 8 * src),
                            src as u64 + 1,
                            "{name}/{mode}: rank {rank}: count from rank {src}"
                        );
                    }
                    comm.all_gather(&[]).expect("barrier before teardown");
                    mesh.close().expect("closing the mesh");
                    handler
                })
            })
            .collect();
        for j in joins {
            j.join().expect("rank thread");
        }
    });
}

#[test]
fn the_emulated_transport_connects_every_peer_through_the_bootstrap() {
    for mode in [HandlerChoice::Gpu, HandlerChoice::CpuHostMemory] {
        let fabric = Fabric::new();
        mesh_carries_writes_and_atomics("emulated", mode, |r| {
            Box::new(EmulatedTransport::host(&fabric, r as u32).expect("host NIC"))
        });
    }
}

#[test]
fn the_verbs_transport_on_the_emulated_firmware_connects_every_peer_through_the_bootstrap() {
    // Every QP here is built by ibgda-verbs' PRM command images (CREATE_CQ, CREATE_QP,
    // RST2INIT, INIT2RTR, RTR2RTS) decoded by the emulated firmware.
    for mode in [HandlerChoice::Gpu, HandlerChoice::CpuHostMemory] {
        let subnet = EmuSubnet::new();
        mesh_carries_writes_and_atomics("verbs", mode, |r| {
            Box::new(VerbsTransport::emulated_host(&subnet, r as u32).expect("emulated device"))
        });
    }
}

/// The one constructor a real NIC goes through (`VerbsTransport::new` with a driver), here with
/// the emulated firmware's driver: 2 and 3 ranks connect through the bootstrap and carry RDMA
/// writes and fenced atomics, in both CPU-runnable modes.
#[test]
fn the_verbs_constructor_with_the_emulated_driver_connects_2_and_3_ranks() {
    for ranks in [2, 3] {
        for mode in [HandlerChoice::Gpu, HandlerChoice::CpuHostMemory] {
            let subnet = EmuSubnet::new();
            mesh_of_carries_writes_and_atomics(ranks, "verbs-driver", mode, |r| {
                let dev = subnet
                    .open_host(&format!("emu_driver_r{r}"))
                    .expect("emulated device");
                Box::new(
                    VerbsTransport::new(VerbsDriver::Emulated(dev), None, r as u32)
                        .expect("transport on the emulated driver"),
                )
            });
        }
    }
}

/// What a verbs responder tells its peer: its QPN and PSN, the port's address as the link layer
/// needs it (a LID: the emulated port is InfiniBand), the port's MTU, and the memory the peer may
/// write (the registration made before it).
#[test]
fn verbs_connection_info_carries_address_mtu_and_the_registered_window() {
    let subnet = EmuSubnet::new();
    let dev = subnet.open_host("emu_info_r0").unwrap();
    let nic = VerbsTransport::new(VerbsDriver::Emulated(dev), None, 0).unwrap();
    let addr = *nic.address();
    assert!(
        matches!(addr, LocalAddress::InfiniBand { lid } if lid != 0),
        "{addr:?}"
    );
    let reg = nic.register(4096).unwrap();
    let (infos, responder) = nic.respond(1, 2).unwrap();
    let mut qpns = Vec::new();
    for c in &infos {
        let v = VerbsConnInfo::from_bytes(&c.0).expect("a verbs connection record");
        assert_eq!(v.link, LinkKind::InfiniBand);
        assert!(v.qp.lid != 0 && v.qp.psn <= 0xff_ffff);
        assert!(v.reachable_from(&addr).is_ok());
        let w = v.window.expect("the registration travels with the info");
        assert_eq!((w.addr, w.len, w.rkey), (reg.addr(), 4096, reg.rkey()));
        qpns.push(v.qp.qpn);
    }
    qpns.dedup();
    assert_eq!(qpns.len(), 2, "one QPN per responder QP");
    // A peer on RoCE cannot reach an InfiniBand port: refused by name, nothing connected.
    let mut roce = VerbsConnInfo::from_bytes(&infos[0].0).unwrap();
    roce.link = LinkKind::Roce;
    roce.qp.gid = [1; 16];
    let e = responder
        .accept(&[
            ep::transport::ConnInfo(roce.to_bytes().to_vec()),
            infos[1].clone(),
        ])
        .unwrap_err()
        .to_string();
    assert!(e.contains("link layer"), "{e}");
    responder.close().unwrap();
}

#[test]
fn auto_on_the_host_backend_picks_mode_gpu_and_says_why() {
    let fabric = Fabric::new();
    let nic = EmulatedTransport::host(&fabric, 0).unwrap();
    let (mode, why) = nic.select(HandlerChoice::Auto).unwrap();
    assert_eq!(mode, NicHandler::Gpu);
    assert!(why.contains("auto"), "{why}");
    // Mode cpu keeps its producer slots in GPU memory, which the host backend does not have:
    // refused with the reason.
    let e = nic.select(HandlerChoice::Cpu).unwrap_err().to_string();
    assert!(e.contains("cpu"), "{e}");
}

#[test]
fn malformed_connection_info_and_counts_are_refused_by_name() {
    let subnet = EmuSubnet::new();
    let fabric = Fabric::new();
    let nics: [Box<dyn RankTransport>; 2] = [
        Box::new(VerbsTransport::emulated_host(&subnet, 0).unwrap()),
        Box::new(EmulatedTransport::host(&fabric, 0).unwrap()),
    ];
    for nic in &nics {
        let reg = nic.register(4096).unwrap();
        let cfg = QpGroupConfig {
            nqps: 1,
            nwqes: 64,
            peer_rank: 1,
            ..Default::default()
        };
        let garbage = [ep::transport::ConnInfo(b"not a QP".to_vec())];
        let e = nic.connect(&garbage, &*reg, &cfg).unwrap_err().to_string();
        assert!(e.contains("info") || e.contains("QpInfo"), "{nic:?}: {e}");
        let e = nic.connect(&[], &*reg, &cfg).unwrap_err().to_string();
        assert!(e.contains("0 peer QP infos"), "{nic:?}: {e}");
        let (infos, responder) = nic.respond(1, 2).unwrap();
        assert_eq!(infos.len(), 2);
        let e = responder.accept(&infos[..1]).unwrap_err().to_string();
        assert!(e.contains("1 QP infos from rank 1 for 2"), "{nic:?}: {e}");
        responder.close().unwrap();
    }
}

/// Low-latency's pattern on every QP of a 4-rank mesh, many rounds: a chunked put of a varying
/// number of WQEs (only the last asks for a CQE), then a fenced remote add that rings (one
/// WQEBB, the last WQE of the batch), then quiet on every QP. The producer index crosses every
/// residue of the ring, the ring's wrap included, with the batch's last WQE at each.
fn mesh_survives_many_rounds(
    name: &str,
    mode: HandlerChoice,
    ranks: usize,
    rounds: usize,
    quiet_each: bool,
    open: impl Fn(usize) -> Box<dyn RankTransport> + Sync,
) {
    const NQ: u32 = 4;
    const NW: u32 = 64;
    const CHUNK: u32 = 16;
    const WORKERS: usize = 3;
    let comms = ThreadGroup::with_timeout(ranks, T).expect("thread group");
    let open = &open;
    std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    let nic = open(rank);
                    let (handler, _) = nic.select(mode).expect("handler mode");
                    let reg = nic.register(BYTES).expect("registering memory");
                    let host = reg.host().expect("host backend").clone();
                    for i in 0..ROW {
                        host.write(COUNTS + 512 + i, &[(i as u8) | 1]);
                    }
                    let all = comm
                        .all_gather(&[reg.addr(), u64::from(reg.rkey())])
                        .expect("exchanging addresses");
                    let cfg = |r: usize| QpGroupConfig {
                        handler,
                        nqps: NQ,
                        nwqes: NW,
                        timeout: T,
                        peer_rank: r as u32,
                        ..Default::default()
                    };
                    let mesh = connect_mesh(&*nic, &comm, &*reg, NQ, cfg, |doing, e| {
                        panic!("rank {rank}: {doing}: {e}")
                    })
                    .expect("connecting the mesh");
                    for round in 0..rounds {
                        // WORKERS threads post to every QP at once, as a kernel's warps do.
                        let mesh = &mesh;
                        let all = &all;
                        let reg = &*reg;
                        std::thread::scope(|w| {
                            for worker in 0..WORKERS {
                                w.spawn(move || {
                                    for (dst, set) in mesh.sets.iter().enumerate() {
                                        let Some(set) = set else { continue };
                                        let base = all[dst][0];
                                        let rkey = all[dst][1] as u32;
                                        let remote = |off: usize| RemoteAddr {
                                            addr: base + off as u64,
                                            rkey,
                                        };
                                        for (q, qp) in set.host_qps().iter().enumerate() {
                                            // 1..=7 WQEs of data, then the signal.
                                            let n =
                                                1 + (round * 5 + q * 3 + dst + rank + worker) % 7;
                                            let len = n as u64 * CHUNK as u64
                                                - (round % CHUNK as usize) as u64;
                                            qp.put_chunked(
                                                remote(ROW * rank),
                                                reg.addr() + (COUNTS + 512) as u64,
                                                len,
                                                CHUNK,
                                                false,
                                            )
                                            .expect("put");
                                            qp.signal_add(remote(COUNTS + 8 * rank), 1, true, true)
                                                .expect("signal");
                                            if quiet_each {
                                                // As a kernel's block quiets at its end while
                                                // other blocks still post on the same QP.
                                                if let Err(e) = qp.quiet() {
                                                    panic!(
                                                        "{name}/{mode}: round {round}: rank {rank} \
                                                         → {dst} QP {q}: quiet while others post: \
                                                         {e:?}: {:?}; {:?}",
                                                        set.check(),
                                                        qp.counters()
                                                    );
                                                }
                                            }
                                        }
                                    }
                                });
                            }
                        });
                        for (dst, set) in mesh.sets.iter().enumerate() {
                            let Some(set) = set else { continue };
                            for (q, qp) in set.host_qps().iter().enumerate() {
                                if let Err(e) = qp.quiet() {
                                    panic!(
                                        "{name}/{mode}: round {round}: rank {rank} → {dst} QP {q} \
                                         (qpn {:#x}): quiet: {e:?}: {:?}; {:?}",
                                        set.qpns()[q],
                                        set.check(),
                                        qp.counters()
                                    );
                                }
                            }
                            set.check().expect("no recorded failure");
                        }
                    }
                    comm.all_gather(&[]).expect("barrier");
                    for src in (0..ranks).filter(|&s| s != rank) {
                        assert_eq!(
                            host.load_u64(COUNTS + 8 * src),
                            (rounds * WORKERS) as u64 * u64::from(NQ),
                            "{name}/{mode}: rank {rank}: signals from rank {src}"
                        );
                    }
                    comm.all_gather(&[]).expect("barrier before teardown");
                    mesh.close().expect("closing the mesh");
                })
            })
            .collect();
        for j in joins {
            j.join().expect("rank thread");
        }
    });
}

/// 60 rounds of a 4-rank verbs mesh on the emulated firmware in both CPU-runnable modes
/// (`racing`: quiets race the posts).
fn verbs_mesh_rounds(racing: bool) {
    for mode in [HandlerChoice::CpuHostMemory, HandlerChoice::Gpu] {
        let subnet = EmuSubnet::new();
        mesh_survives_many_rounds("verbs", mode, 4, 60, racing, |r| {
            Box::new(VerbsTransport::emulated_host(&subnet, r as u32).expect("emulated device"))
        });
    }
}

#[test]
fn the_verbs_transport_survives_many_rounds_at_4_ranks() {
    verbs_mesh_rounds(false);
}

#[test]
fn the_emulated_transport_survives_many_rounds_at_4_ranks() {
    for mode in [HandlerChoice::CpuHostMemory, HandlerChoice::Gpu] {
        let fabric = Fabric::new();
        mesh_survives_many_rounds("emulated", mode, 4, 60, false, |r| {
            Box::new(EmulatedTransport::host(&fabric, r as u32).expect("host NIC"))
        });
    }
}

#[test]
fn the_verbs_transport_survives_quiets_racing_posts_at_4_ranks() {
    verbs_mesh_rounds(true);
}

/// A quiet that times out on a verbs QP says how far the NIC has read the send queue
/// (`QUERY_QP`'s `hw_sq_wqebb_counter`), which tells a lost completion (the NIC consumed
/// everything published) from a doorbell it never acted on (it stopped short).
#[test]
fn a_verbs_quiet_timeout_reports_how_far_the_nic_read() {
    use ibgda_emu::FaultPlan;
    for (mode, lose_cqe) in [
        (HandlerChoice::CpuHostMemory, true),
        (HandlerChoice::CpuHostMemory, false),
        (HandlerChoice::Gpu, true),
        (HandlerChoice::Gpu, false),
    ] {
        let subnet = EmuSubnet::new();
        let comms = ThreadGroup::with_timeout(2, T).expect("thread group");
        std::thread::scope(|s| {
            for comm in comms {
                let subnet = &subnet;
                s.spawn(move || {
                    let rank = comm.rank();
                    let nic = VerbsTransport::emulated_host(subnet, rank as u32).unwrap();
                    let (handler, _) = nic.select(mode).unwrap();
                    let reg = nic.register(BYTES).unwrap();
                    let all = comm
                        .all_gather(&[reg.addr(), u64::from(reg.rkey())])
                        .unwrap();
                    let cfg = |r: usize| QpGroupConfig {
                        handler,
                        nqps: 1,
                        nwqes: 64,
                        timeout: Duration::from_millis(300),
                        peer_rank: r as u32,
                        ..Default::default()
                    };
                    let mesh = connect_mesh(&nic, &comm, &*reg, 1, cfg, |doing, e| {
                        panic!("rank {rank}: {doing}: {e}")
                    })
                    .unwrap();
                    if rank == 0 {
                        let set = mesh.sets[1].as_ref().unwrap();
                        let qpn = set.qpns()[0];
                        let emu = nic.emulated_nic().expect("emulated firmware");
                        // The second WQE's CQE, or the second doorbell, is lost.
                        emu.set_fault_plan(if lose_cqe {
                            FaultPlan::default().lose_cqe(qpn, 2)
                        } else {
                            FaultPlan::default().drop_doorbell(qpn, 2)
                        });
                        let qp = &set.host_qps()[0];
                        let remote = RemoteAddr {
                            addr: all[1][0],
                            rkey: all[1][1] as u32,
                        };
                        qp.put(remote, reg.addr(), 64, true).unwrap();
                        qp.quiet().unwrap();
                        qp.signal_add(
                            RemoteAddr {
                                addr: all[1][0] + COUNTS as u64,
                                ..remote
                            },
                            1,
                            true,
                            true,
                        )
                        .unwrap();
                        assert!(qp.quiet().is_err(), "{mode}: the lost WQE was quieted");
                        let e = set.check().expect_err("a recorded timeout").to_string();
                        let want = if lose_cqe { 2 } else { 1 };
                        assert!(
                            e.contains("ready_head=2")
                                && e.contains("cons_idx=1")
                                && e.contains(&format!("the NIC has consumed {want} WQEBBs")),
                            "{mode}, lose_cqe {lose_cqe}: {e}"
                        );
                        // The engine's own account: how far the doorbells announced, how far it
                        // fetched, how many CQEs it wrote.
                        assert!(
                            e.contains("emulated NIC: qpn")
                                && e.contains(&format!("announced {want}, fetched {want}"))
                                && e.contains("CQEs written 1,"),
                            "{mode}, lose_cqe {lose_cqe}: {e}"
                        );
                    }
                    comm.all_gather(&[]).unwrap();
                    let _ = mesh.close();
                });
            }
        });
    }
}

/// Runs `connect_mesh_among` on 4 ranks as threads with `peers(me, r)`; returns per rank the
/// connection result: `Ok(the ranks it has QPs to)` or the error text.
fn mesh_among(peers: fn(usize, usize) -> bool) -> Vec<Result<Vec<usize>, String>> {
    const N: usize = 4;
    let fabric = Fabric::new();
    let comms = ThreadGroup::with_timeout(N, T).expect("thread group");
    let fabric = &fabric;
    std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    let nic = EmulatedTransport::host(fabric, rank as u32).expect("host NIC");
                    let (handler, _) = nic.select(HandlerChoice::Gpu).expect("handler mode");
                    let reg = nic.register(BYTES).expect("registering memory");
                    let cfg = |r: usize| qp_config(handler, r);
                    let mesh = connect_mesh_among(
                        &nic,
                        &comm,
                        &*reg,
                        NQPS,
                        &|r| peers(rank, r),
                        cfg,
                        |doing, e| ep::EpError::Rendezvous {
                            rank,
                            what: format!("{doing}: {e}"),
                        },
                    )
                    .map_err(|e| e.to_string())?;
                    let with: Vec<usize> = (0..N).filter(|&r| mesh.sets[r].is_some()).collect();
                    mesh.close()
                        .map_err(|(r, e)| format!("closing the QPs to rank {r}: {e}"))?;
                    Ok(with)
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("rank thread"))
            .collect()
    })
}

/// Internode connects each rank to its rail peers only: a symmetric choice of peers gets QPs to
/// exactly those, and one that is not symmetric fails every rank (never a hang), the ranks
/// whose counts disagree saying so.
#[test]
fn a_mesh_among_chosen_peers_connects_only_those() {
    // Two virtual nodes of two ranks: rank r's rail peer is r ^ 2.
    let got = mesh_among(|me, r| r == me ^ 2);
    for (rank, with) in got.iter().enumerate() {
        assert_eq!(with.as_deref(), Ok(&[rank ^ 2][..]), "rank {rank}");
    }
    // Rank 0 names rank 1, which does not name it back.
    // Ranks 0 and 1 see the counts disagree; the others see the group end.
    let got = mesh_among(|me, r| r == me ^ 2 || (me == 0 && r == 1));
    let errs: Vec<&String> = got
        .iter()
        .map(|r| r.as_ref().expect_err("an asymmetric choice of peers fails"))
        .collect();
    for rank in [0, 1] {
        assert!(
            errs[rank].contains("QP infos"),
            "rank {rank}: {}",
            errs[rank]
        );
    }
}
