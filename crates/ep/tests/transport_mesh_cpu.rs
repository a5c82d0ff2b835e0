//! The transport interface end to end on the CPU (host backend, CI): ranks as threads open their
//! NICs behind `RankTransport`, register memory, connect QPs to every peer through the bootstrap
//! (`connect_mesh`: connection info as bytes, two all-gathers), and drive the QPs with the
//! protocol's host model (`HostQp`): an RDMA write and a fenced remote add to every peer, then
//! quiet. Every rank then finds each peer's bytes and counts in its own memory. Both
//! CPU-runnable handler modes; the same test for every implementation of the interface.

use std::time::Duration;

use ep::bootstrap::{Communicator, ThreadGroup};
use ep::transport::{
    connect_mesh, EmulatedTransport, QpGroupConfig, RankTransport, VerbsTransport,
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
    let comms = ThreadGroup::with_timeout(RANKS, T).expect("thread group");
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
                    for dst in 0..RANKS {
                        host.write(COUNTS + 512 + ROW * dst, &row(rank, dst));
                    }
                    let all = comm
                        .all_gather(&[reg.addr(), u64::from(reg.rkey())])
                        .expect("exchanging addresses");
                    let cfg = |r: usize| QpGroupConfig {
                        handler,
                        nqps: NQPS,
                        nwqes: 64,
                        timeout: T,
                        peer_rank: r as u32,
                        ..Default::default()
                    };
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
                    for src in (0..RANKS).filter(|&s| s != rank) {
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

#[test]
fn auto_on_the_host_backend_picks_mode_gpu_and_says_why() {
    let fabric = Fabric::new();
    let nic = EmulatedTransport::host(&fabric, 0).unwrap();
    let (mode, why) = nic.select(HandlerChoice::Auto).unwrap();
    assert_eq!(mode, NicHandler::Gpu);
    assert!(why.contains("auto"), "{why}");
    // Mode cpu needs GDRCopy, which the host backend never has: refused with the reason.
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
