//! The emulator on the CUDA backend: RDMA writes of 8 B to 64 MiB and atomics checked byte for
//! byte, rings in host and in GPU memory, progress while spinning kernels fill the GPU, and the
//! same across two processes (CUDA IPC). Every test runs on one GPU: two emulated NICs on GPU 0
//! (loopback), or two processes sharing it; `gpu_writes_between_two_gpus` repeats the writes
//! between GPUs 0 and 1 (peer copies) and skips loudly with fewer than two. The NICs run in the
//! default strict mode (`IBGDA_EMU_STRICT`).

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use ep_kernels::testing::{gpus, seed, Rng};
use ibgda_device::cuda::{enable_peer_access, wait_legacy_stream, DeviceBuffer};
use ibgda_device::wire::{
    cqe_opcode, CompareSwap64, Cqe64, FenceMode, FetchAdd64, InlineWrite, LocalAddr,
    MaskedFetchAdd32, Nop, RdmaWrite, RemoteAddr, Sge, WqeBB,
};
use ibgda_emu::{
    Access, CqConfig, CqMode, DoorbellConfig, Fabric, HostQp, Loc, Mr, Nic, NicConfig, QpConfig,
    QpInfo, QpState, StrictMode,
};

const T: Duration = Duration::from_secs(60);
const GUARD: u8 = 0xa5;
const GUARD_BYTES: usize = 4096;
const MAX: usize = 64 << 20;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next_u64().to_ne_bytes());
    }
    v.truncate(len);
    v
}

fn wait_cqe(qp: &HostQp, cons: u64) -> Cqe64 {
    let t0 = Instant::now();
    loop {
        if let Some(c) = qp.poll_cqe(cons) {
            return c;
        }
        assert!(
            t0.elapsed() < T,
            "no CQE {cons} on QP {:#x} after {T:?}",
            qp.qpn()
        );
        std::thread::yield_now();
    }
}

/// Waits until everything the test enqueued on these GPUs has run. `cuMemsetD8` returns before
/// it runs and a pageable `cuMemcpyHtoD` before its last DMA, both on the legacy stream, while
/// the NIC works on streams of its own that do not wait for it. Only the legacy stream, bounded:
/// a context-wide synchronisation would also wait for the NIC's GPU agent (until its idle exit)
/// and for the NIC's own streams.
fn settle(ctxs: &[Arc<CudaContext>]) {
    for c in ctxs {
        wait_legacy_stream(c, T, "the test's memsets and uploads").expect("synchronizing a GPU");
    }
}

fn ra(m: &Mr, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: m.addr + off,
        rkey: m.rkey,
    }
}

/// Two CUDA NICs, `a` on `ctxs[0]` and `b` on `ctxs[1]` (the same GPU for a loopback), and a QP
/// from the first to the second (host-pinned rings).
struct Gpu2 {
    ctxs: Vec<Arc<CudaContext>>,
    _fabric: Fabric,
    a: Nic,
    b: Nic,
    qp: HostQp,
    _peer: HostQp,
    pi: u64,
    cons: u64,
}

impl Gpu2 {
    /// Both NICs on GPU 0.
    fn loopback(ctxs: Vec<Arc<CudaContext>>) -> Self {
        Self::new(vec![ctxs[0].clone(), ctxs[0].clone()])
    }

    fn new(ctxs: Vec<Arc<CudaContext>>) -> Self {
        Self::with(ctxs, NicConfig::named)
    }

    /// As [`new`](Self::new), the NICs configured by `cfg` from their names.
    fn with(ctxs: Vec<Arc<CudaContext>>, cfg: impl Fn(&'static str) -> NicConfig) -> Self {
        enable_peer_access(&ctxs[0], &ctxs[1]).expect("peer access 0 -> 1");
        enable_peer_access(&ctxs[1], &ctxs[0]).expect("peer access 1 -> 0");
        let fabric = Fabric::new();
        let a = fabric.cuda_nic(&ctxs[0], cfg("nic-a")).unwrap();
        let b = fabric.cuda_nic(&ctxs[1], cfg("nic-b")).unwrap();
        let qp = a.create_host_qp(256, CqMode::Ring, 256).unwrap();
        let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
        a.connect(qp.qpn(), &b.qp_info(peer.qpn()).unwrap())
            .unwrap();
        Self {
            ctxs,
            _fabric: fabric,
            a,
            b,
            qp,
            _peer: peer,
            pi: 0,
            cons: 0,
        }
    }

    /// Posts one signalled WQE (built for its index), rings, and returns its CQE.
    fn run(&mut self, wqe: impl FnOnce(u32, u16) -> WqeBB) -> Cqe64 {
        let i = self.pi;
        self.qp.post(i, &wqe(self.qp.qpn(), i as u16));
        self.pi += 1;
        self.qp.ring_dbr(self.pi);
        let c = wait_cqe(&self.qp, self.cons);
        self.cons += 1;
        assert!(!c.is_error(), "{c}");
        assert_eq!(c.wqe_counter.get(), i as u16);
        c
    }

    /// Registers 4 KiB of `target` on `b` for remote atomics and 4 KiB of `fetch` on `a` for
    /// their replies: (remote, local).
    fn atomic_regs(&self, target: &Arc<DeviceBuffer>, fetch: &Arc<DeviceBuffer>) -> (Mr, Mr) {
        let rm = self
            .b
            .register_device(target, 0, 4096, Access::REMOTE_ATOMIC)
            .unwrap();
        let lm = self
            .a
            .register_device(fetch, 0, 4096, Access::LOCAL_WRITE)
            .unwrap();
        (rm, lm)
    }
}

#[test]
fn gpu_writes_8b_to_64mib_land_byte_for_byte() {
    let Some(ctxs) = gpus(1) else { return };
    writes_land_byte_for_byte(Gpu2::loopback(ctxs));
}

#[test]
fn gpu_writes_between_two_gpus() {
    let Some(ctxs) = gpus(2) else { return };
    writes_land_byte_for_byte(Gpu2::new(ctxs));
}

/// Writes of 8 B to 64 MiB from `g.a`'s GPU to `g.b`'s, with guard bytes around the target.
fn writes_land_byte_for_byte(mut g: Gpu2) {
    let s = seed();
    let src = Arc::new(DeviceBuffer::new(&g.ctxs[0], MAX + 64).unwrap());
    let dst = Arc::new(DeviceBuffer::new(&g.ctxs[1], MAX + 2 * GUARD_BYTES).unwrap());
    let lm =
        g.a.register_device(&src, 0, MAX + 64, Access::NONE)
            .unwrap();
    let rm =
        g.b.register_device(&dst, GUARD_BYTES, MAX, Access::REMOTE_WRITE)
            .unwrap();
    let cases: &[(usize, usize, usize)] = &[
        // (bytes, source offset, destination offset)
        (8, 0, 0),
        (64, 8, 64),
        (4096, 0, 0),
        (4097, 3, 5),
        (65536, 0, 4096),
        (1 << 20, 0, 0),
        ((1 << 20) + 12, 4, 1),
        (16 << 20, 0, 0),
        (MAX, 0, 0),
    ];
    for (k, &(len, so, dof)) in cases.iter().enumerate() {
        let data = pattern(s ^ k as u64, len);
        src.upload(so, &data).unwrap();
        dst.fill_bytes(GUARD).unwrap();
        settle(&g.ctxs);
        let c = g.run(|q, i| {
            RdmaWrite::new(
                q,
                i,
                ra(&rm, dof as u64),
                Sge {
                    addr: lm.addr + so as u64,
                    len: len as u32,
                    lkey: lm.lkey,
                },
            )
            .cqe(true)
            .build()
        });
        assert_eq!(c.byte_cnt.get(), len as u32);
        let got: Vec<u8> = dst.download(0, MAX + 2 * GUARD_BYTES).unwrap();
        let at = GUARD_BYTES + dof;
        if let Some(i) = (0..len).find(|&i| got[at + i] != data[i]) {
            panic!(
                "write of {len} B: byte {i} is {:#04x}, want {:#04x}",
                got[at + i],
                data[i]
            );
        }
        if let Some(i) = (0..got.len()).find(|&i| (i < at || i >= at + len) && got[i] != GUARD) {
            panic!("write of {len} B touched byte {i} outside its range");
        }
    }
    // Inline writes too.
    dst.fill_bytes(GUARD).unwrap();
    settle(&g.ctxs);
    g.run(|q, i| {
        InlineWrite::new(q, i, ra(&rm, 13), b"inline bytes")
            .cqe(true)
            .build()
    });
    assert_eq!(
        dst.download::<u8>(GUARD_BYTES + 13, 12).unwrap(),
        b"inline bytes"
    );
}

#[test]
fn gpu_atomics() {
    let Some(ctxs) = gpus(1) else { return };
    let mut g = Gpu2::loopback(ctxs);
    let target = Arc::new(DeviceBuffer::new(&g.ctxs[1], 4096).unwrap());
    let fetch = Arc::new(DeviceBuffer::new(&g.ctxs[0], 4096).unwrap());
    target.fill_bytes(0).unwrap();
    fetch.fill_bytes(0xee).unwrap();
    settle(&g.ctxs);
    let (rm, lm) = g.atomic_regs(&target, &fetch);
    let la = |off: u64| LocalAddr {
        addr: lm.addr + off,
        lkey: lm.lkey,
    };
    for k in 0..100u64 {
        g.run(|q, i| {
            FetchAdd64::new(q, i, ra(&rm, 0), la(8 * k), 3)
                .cqe(true)
                .build()
        });
    }
    let fetched: Vec<u64> = fetch.download(0, 100).unwrap();
    for (k, &v) in fetched.iter().enumerate() {
        assert_eq!(v, 3 * k as u64, "fetch-add {k} returned {v}");
    }
    assert_eq!(target.download::<u64>(0, 1).unwrap()[0], 300);
    g.run(|q, i| {
        CompareSwap64::new(q, i, ra(&rm, 0), la(1024), 7, 300)
            .cqe(true)
            .build()
    });
    g.run(|q, i| {
        CompareSwap64::new(q, i, ra(&rm, 0), la(1032), 9, 300)
            .cqe(true)
            .build()
    });
    assert_eq!(target.download::<u64>(0, 1).unwrap()[0], 7);
    assert_eq!(fetch.download::<u64>(1024, 2).unwrap(), vec![300, 7]);
    for _ in 0..10 {
        g.run(|q, i| {
            MaskedFetchAdd32::new(q, i, ra(&rm, 64), la(2048), 5)
                .cqe(true)
                .build()
        });
    }
    assert_eq!(target.download::<u32>(64, 1).unwrap()[0], 50);
    assert_eq!(
        fetch.download::<u8>(2048, 4).unwrap(),
        45u32.to_be_bytes(),
        "masked atomics reply big-endian"
    );

    // Four QPs hammering one word: atomics on one target stay atomic with respect to each other.
    let qps: Vec<HostQp> = (0..4)
        .map(|_| {
            let qp = g.a.create_host_qp(256, CqMode::Ring, 256).unwrap();
            let peer = g.b.create_host_qp(8, CqMode::Ring, 8).unwrap();
            g.a.connect(qp.qpn(), &g.b.qp_info(peer.qpn()).unwrap())
                .unwrap();
            qp
        })
        .collect();
    for qp in &qps {
        for i in 0..200u64 {
            let w = FetchAdd64::new(qp.qpn(), i as u16, ra(&rm, 128), la(3072), 1)
                .cqe(i == 199)
                .build();
            qp.post(i, &w);
        }
        qp.ring_dbr(200);
    }
    for qp in &qps {
        let c = wait_cqe(qp, 0);
        assert!(!c.is_error(), "{c}");
    }
    assert_eq!(target.download::<u64>(128, 1).unwrap()[0], 800);
}

/// Initiator NICs of several QPs each, every QP connected to one of its own on a target NIC whose
/// GPU buffer (zeroed) takes remote atomics; each initiator's GPU buffer (filled with 0xee) takes
/// the fetched values. Fields drop in the order the tests' locals did: lanes first, fabric last.
struct AtomicFanIn {
    /// (initiator QP, target QP, the initiator's fetch registration, `nic * qps + qp`).
    lanes: Vec<(HostQp, HostQp, Mr, usize)>,
    /// Each initiator NIC with its fetch buffer.
    nics: Vec<(Nic, Arc<DeviceBuffer>)>,
    /// The target buffer's registration.
    rm: Mr,
    target: Arc<DeviceBuffer>,
    _target_nic: Nic,
    _fabric: Fabric,
}

impl AtomicFanIn {
    fn new(
        ctx: &Arc<CudaContext>,
        nics: usize,
        qps: usize,
        target_bytes: usize,
        fetch_bytes: usize,
    ) -> Self {
        let fabric = Fabric::new();
        let b = fabric.cuda_nic(ctx, NicConfig::named("target")).unwrap();
        let target = Arc::new(DeviceBuffer::new(ctx, target_bytes).unwrap());
        target.fill_bytes(0).unwrap();
        let rm = b
            .register_device(&target, 0, target_bytes, Access::REMOTE_ATOMIC)
            .unwrap();
        let mut initiators = Vec::new();
        let mut lanes = Vec::new();
        for n in 0..nics {
            let a = fabric
                .cuda_nic(ctx, NicConfig::named(format!("init-{n}")))
                .unwrap();
            let fetch = Arc::new(DeviceBuffer::new(ctx, fetch_bytes).unwrap());
            fetch.fill_bytes(0xee).unwrap();
            let lm = a
                .register_device(&fetch, 0, fetch.len(), Access::LOCAL_WRITE)
                .unwrap();
            for k in 0..qps {
                let qp = a.create_host_qp(1024, CqMode::Ring, 1024).unwrap();
                let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
                a.connect(qp.qpn(), &b.qp_info(peer.qpn()).unwrap())
                    .unwrap();
                lanes.push((qp, peer, lm, n * qps + k));
            }
            initiators.push((a, fetch));
        }
        AtomicFanIn {
            lanes,
            nics: initiators,
            rm,
            target,
            _target_nic: b,
            _fabric: fabric,
        }
    }

    /// Rings every QP's doorbell up to `posted` WQEs in steps of `step` (QPs round robin), then
    /// waits for each QP's one CQE.
    fn ring_in_steps_and_wait(&self, posted: u64, step: u64) {
        let mut rung = 0;
        while rung < posted {
            rung = (rung + step).min(posted);
            for (qp, ..) in &self.lanes {
                qp.ring_dbr(rung);
            }
        }
        for (qp, ..) in &self.lanes {
            let c = wait_cqe(qp, 0);
            assert!(!c.is_error(), "{c}");
        }
    }
}

/// Two initiator NICs (two progress threads), four QPs each, every QP posting fetch-adds on one
/// shared word and a word of its own, each reply into a slot of its own, rung in pieces so that
/// groups of deferred atomics of different QPs and NICs interleave on the shared word. Atomic
/// means every old value of the shared word is fetched exactly once, and the totals add up.
#[test]
fn gpu_atomics_of_two_nics_fetch_every_value_once() {
    let Some(ctxs) = gpus(1) else { return };
    const QPS: usize = 4;
    const PER_QP: u64 = 300;
    let ctx = &ctxs[0];
    let rig = AtomicFanIn::new(ctx, 2, QPS, 4096, QPS * 2 * PER_QP as usize * 8);
    let (lanes, nics, rm, target) = (&rig.lanes, &rig.nics, &rig.rm, &rig.target);
    settle(&ctxs);
    // Post everything, then ring in pieces of 37 WQEs, QPs round robin.
    for (qp, _, lm, id) in lanes {
        for i in 0..2 * PER_QP {
            let (word, slot) = if i % 2 == 0 {
                (0, (*id % QPS) as u64 * 2 * PER_QP + i)
            } else {
                (64 * (1 + *id as u64), (*id % QPS) as u64 * 2 * PER_QP + i)
            };
            let w = FetchAdd64::new(
                qp.qpn(),
                i as u16,
                ra(rm, word),
                LocalAddr {
                    addr: lm.addr + 8 * slot,
                    lkey: lm.lkey,
                },
                1,
            )
            .cqe(i + 1 == 2 * PER_QP)
            .build();
            qp.post(i, &w);
        }
    }
    rig.ring_in_steps_and_wait(2 * PER_QP, 37);
    let total = lanes.len() as u64 * PER_QP;
    let words: Vec<u64> = target.download(0, 8 * (1 + lanes.len())).unwrap();
    assert_eq!(words[0], total, "the shared word");
    for id in 0..lanes.len() {
        assert_eq!(words[8 * (1 + id)], PER_QP, "the word of QP {id}");
    }
    let mut shared = Vec::new();
    for (n, (_, fetch)) in nics.iter().enumerate() {
        let got: Vec<u64> = fetch.download(0, QPS * 2 * PER_QP as usize).unwrap();
        for k in 0..QPS {
            for i in 0..2 * PER_QP as usize {
                let v = got[k * 2 * PER_QP as usize + i];
                if i % 2 == 0 {
                    shared.push(v);
                } else {
                    assert_eq!(v, i as u64 / 2, "NIC {n} QP {k}: its own word's fetch {i}");
                }
            }
        }
    }
    shared.sort_unstable();
    let want: Vec<u64> = (0..total).collect();
    assert!(
        shared == want,
        "the shared word's old values are not 0..{total} once each"
    );
    eprintln!(
        "{} fetch-adds from {} QPs on 2 NICs: atomic",
        2 * total,
        lanes.len()
    );
}

/// The fence test of `strict_emu.rs` on the CUDA backend, GPU memory on both sides: a fetch-add
/// takes a ticket into a local word, then an RDMA write publishes that word. Without a fence the
/// write may gather the word before the atomic's result is in it; strict mode (manual progress,
/// fixed seeds) makes it do so. Returns the rounds that published a stale ticket.
fn gpu_ticket_rounds(ctx: &Arc<CudaContext>, strict: StrictMode, fence: bool) -> Vec<u64> {
    const ROUNDS: u64 = 48;
    let fabric = Fabric::new();
    let cfg = |n: &str| NicConfig::named(n).manual().strict(strict);
    let a = fabric.cuda_nic(ctx, cfg("nic-a")).unwrap();
    let b = fabric.cuda_nic(ctx, cfg("nic-b")).unwrap();
    let local = Arc::new(DeviceBuffer::new(ctx, 64).unwrap());
    let remote = Arc::new(DeviceBuffer::new(ctx, 8 + 8 * ROUNDS as usize).unwrap());
    remote.fill_bytes(0).unwrap();
    settle(std::slice::from_ref(ctx));
    let lm = a
        .register_device(&local, 0, 64, Access::LOCAL_WRITE)
        .unwrap();
    let rm = b
        .register_device(&remote, 0, 8 + 8 * ROUNDS as usize, Access::ALL)
        .unwrap();
    let qp = a.create_host_qp(64, CqMode::Ring, 64).unwrap();
    let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
    a.connect(qp.qpn(), &b.qp_info(peer.qpn()).unwrap())
        .unwrap();
    let q = qp.qpn();
    let mut wrong = Vec::new();
    for r in 0..ROUNDS {
        // The stale ticket the write copies if it runs first.
        local.upload(0, &[u64::MAX]).unwrap();
        settle(std::slice::from_ref(ctx));
        let i = 2 * r;
        let take = FetchAdd64::new(
            q,
            i as u16,
            ra(&rm, 0),
            LocalAddr {
                addr: lm.addr,
                lkey: lm.lkey,
            },
            1,
        )
        .build();
        let publish = RdmaWrite::new(
            q,
            (i + 1) as u16,
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
        qp.post(i, &take);
        qp.post(i + 1, &publish.build());
        qp.ring_dbr(i + 2);
        let st = a.wait_idle(q, T).unwrap();
        assert_eq!(st.state, QpState::Rts, "{:?}", st.first_error);
        let c = wait_cqe(&qp, r);
        assert!(!c.is_error(), "{c}");
        if remote.download::<u64>(8 + 8 * r as usize, 1).unwrap()[0] != r {
            wrong.push(r);
        }
    }
    assert_eq!(
        remote.download::<u64>(0, 1).unwrap()[0],
        ROUNDS,
        "every fetch-add landed"
    );
    a.destroy_qp(q).unwrap();
    wrong
}

#[test]
fn gpu_strict_mode_catches_a_missing_fence() {
    let Some(ctxs) = gpus(1) else { return };
    let unfenced = gpu_ticket_rounds(&ctxs[0], StrictMode::full(1), false);
    assert!(
        !unfenced.is_empty(),
        "strict mode let no unfenced write overtake the atomic it depends on"
    );
    for seed in 0..4 {
        assert_eq!(
            gpu_ticket_rounds(&ctxs[0], StrictMode::full(seed), true),
            Vec::<u64>::new(),
            "fenced, seed {seed}"
        );
    }
    assert_eq!(
        gpu_ticket_rounds(&ctxs[0], StrictMode::off(), false),
        Vec::<u64>::new(),
        "in order, the missing fence goes unnoticed"
    );
    eprintln!(
        "unfenced: {} of 48 rounds published a stale ticket",
        unfenced.len()
    );
}

#[test]
fn gpu_rings_and_cq_in_gpu_memory() {
    let Some(ctxs) = gpus(1) else { return };
    let ctxs = vec![ctxs[0].clone(), ctxs[0].clone()];
    let fabric = Fabric::new();
    let a = fabric
        .cuda_nic(&ctxs[0], NicConfig::named("nic-a"))
        .unwrap();
    let b = fabric
        .cuda_nic(&ctxs[1], NicConfig::named("nic-b"))
        .unwrap();
    let ring = DeviceBuffer::new(&ctxs[0], 64 * 64).unwrap();
    let cq = DeviceBuffer::new(&ctxs[0], 64 * 64).unwrap();
    let dbr = DeviceBuffer::new(&ctxs[0], 8).unwrap();
    dbr.fill_bytes(0).unwrap();
    let dst = Arc::new(DeviceBuffer::new(&ctxs[1], 4096).unwrap());
    dst.fill_bytes(0).unwrap();
    settle(&ctxs);
    let rm = b.register_device(&dst, 0, 4096, Access::ALL).unwrap();
    let cfg = QpConfig {
        sq: Loc::Device(ring.ptr()),
        nwqebbs: 64,
        cq: CqConfig::ring(Loc::Device(cq.ptr()), 64),
        doorbell: DoorbellConfig {
            dbr: Some(Loc::Device(dbr.ptr())),
            uar: true,
            producer_slot: None,
        },
    };
    // SAFETY: the ring, CQ and doorbell record outlive the QP, destroyed at the end.
    let h = unsafe { a.create_qp(cfg) }.unwrap();
    let peer = b.create_host_qp(8, CqMode::Ring, 8).unwrap();
    a.connect(h.qpn, &b.qp_info(peer.qpn()).unwrap()).unwrap();
    let q = h.qpn;
    let w0 = InlineWrite::new(q, 0, ra(&rm, 0), b"via the DBR").build();
    let w1 = Nop::new(q, 1).cqe(true).build();
    ring.upload(0, w0.as_bytes()).unwrap();
    ring.upload(64, w1.as_bytes()).unwrap();
    dbr.upload(4, &[ibgda_device::wire::dbr_send_word(2)])
        .unwrap();
    let st = a.wait_idle(q, T).unwrap();
    assert_eq!((st.fetched, st.cqes_written), (2, 1));
    // The UAR page (pinned host memory) as device code in mode gpu would ring it.
    let w2 = InlineWrite::new(q, 2, ra(&rm, 16), b"via the UAR")
        .cqe(true)
        .build();
    ring.upload(128, w2.as_bytes()).unwrap();
    // The WQE must have landed before the doorbell below, which is a plain CPU store.
    settle(&ctxs);
    let uar = h.uar.unwrap();
    // SAFETY: the BlueFlame register of the QP's live UAR page; 8-byte aligned.
    unsafe { std::sync::atomic::AtomicU64::from_ptr(uar.bf_reg as *mut u64) }.store(
        ibgda_device::wire::db_word(q, 3),
        std::sync::atomic::Ordering::Release,
    );
    let st = a.wait_idle(q, T).unwrap();
    assert_eq!(
        (st.fetched, st.cqes_written, st.state),
        (3, 2, QpState::Rts)
    );
    let cqes: Vec<Cqe64> = cq.download(0, 2).unwrap();
    for (k, c) in cqes.iter().enumerate() {
        assert_eq!(
            c.status(k as u64, 64).state(),
            Some(ibgda_device::wire::CqeState::Ok),
            "{c}"
        );
        assert_eq!(c.wqe_counter.get(), [1u16, 2][k]);
    }
    assert_eq!(dst.download::<u8>(0, 11).unwrap(), b"via the DBR");
    assert_eq!(dst.download::<u8>(16, 11).unwrap(), b"via the UAR");
    a.destroy_qp(q).unwrap();
}

/// A kernel whose every thread spins (bounded by %globaltimer) until a flag becomes non-zero;
/// thread 0 of each block then stores the flag it saw to `out[block]`.
const SPIN_PTX: &str = r#"
.version 7.8
.target sm_80
.address_size 64

.visible .entry spin_until_flag(
    .param .u64 flag,
    .param .u64 out,
    .param .u64 max_ns
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [flag];
    ld.param.u64 %rd2, [out];
    ld.param.u64 %rd3, [max_ns];
    mov.u64 %rd4, %globaltimer;
    add.u64 %rd5, %rd4, %rd3;
LOOP:
    ld.volatile.global.u32 %r1, [%rd1];
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra DONE;
    mov.u64 %rd6, %globaltimer;
    setp.lt.u64 %p2, %rd6, %rd5;
    @%p2 bra LOOP;
DONE:
    mov.u32 %r2, %tid.x;
    setp.ne.u32 %p3, %r2, 0;
    @%p3 bra END;
    mov.u32 %r3, %ctaid.x;
    mul.wide.u32 %rd7, %r3, 4;
    add.u64 %rd8, %rd2, %rd7;
    st.global.u32 [%rd8], %r1;
END:
    ret;
}
"#;

#[test]
fn gpu_emulator_progresses_while_spinning_kernels_fill_the_gpu() {
    let Some(ctxs) = gpus(1) else { return };
    // Both NICs, the target and the spinning kernel on the one GPU.
    let mut g = Gpu2::loopback(ctxs);
    let ctx1 = g.ctxs[1].clone();
    let flag = Arc::new(DeviceBuffer::new(&ctx1, 4096).unwrap());
    flag.fill_bytes(0).unwrap();
    let rm = g.b.register_device(&flag, 0, 4096, Access::ALL).unwrap();
    let sms = {
        let mut n = 0i32;
        // SAFETY: valid out-pointer and a live device handle.
        unsafe {
            sys::cuDeviceGetAttribute(
                &mut n,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                ctx1.cu_device(),
            )
        }
        .result()
        .unwrap();
        n as u32
    };
    // Every SM's threads taken (two blocks of 1024 each), but for the GPU agent's share: the
    // agent ends when idle and is relaunched with the next command, so, as `ep::residency`
    // does, kernels that wait for the NIC leave it room (`AGENT_SMS`). By the time the NIC is
    // asked, the agent has been idle for 200 ms: it must relaunch beside the spinning blocks.
    let blocks = 2 * (sms - ibgda_emu::AGENT_SMS);
    let out = DeviceBuffer::new(&ctx1, blocks as usize * 4).unwrap();
    out.fill_bytes(0).unwrap();

    // Allocated before the launch: nothing after it may need the spinning GPU or a sync.
    let fetch = Arc::new(DeviceBuffer::new(&g.ctxs[0], 64).unwrap());
    let lm =
        g.a.register_device(&fetch, 0, 64, Access::LOCAL_WRITE)
            .unwrap();
    // The flag and `out` are zero before the kernel (on a non-blocking stream) reads them.
    settle(&g.ctxs);
    ctx1.bind_to_thread().unwrap();
    let ptx = std::ffi::CString::new(SPIN_PTX).unwrap();
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: a NUL-terminated PTX image; valid out-pointer; context current.
    unsafe { sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()) }
        .result()
        .expect("JIT-compiling the spin kernel");
    let mut func: sys::CUfunction = std::ptr::null_mut();
    let name = std::ffi::CString::new("spin_until_flag").unwrap();
    // SAFETY: live module; valid out-pointer and name.
    unsafe { sys::cuModuleGetFunction(&mut func, module, name.as_ptr()) }
        .result()
        .unwrap();
    // The spinning kernels wait for the NIC: a hardware queue of their own, so the NIC's copies
    // (on the pool's service queues) never queue behind them.
    let (waiting, _lease) =
        ibgda_device::stream_pool::waiting(&ctx1).expect("a waiting stream from the pool");
    let stream: sys::CUstream = waiting.cu_stream();
    let (mut pflag, mut pout, mut pmax) = (flag.ptr(), out.ptr(), 20_000_000_000u64);
    let mut args: [*mut std::ffi::c_void; 3] = [
        (&mut pflag as *mut u64).cast(),
        (&mut pout as *mut u64).cast(),
        (&mut pmax as *mut u64).cast(),
    ];
    // SAFETY: the kernel takes three u64 parameters, passed by pointer as the driver requires;
    // the buffers outlive the kernel (we wait for it below).
    unsafe {
        sys::cuLaunchKernel(
            func,
            blocks,
            1,
            1,
            1024,
            1,
            1,
            0,
            stream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: live stream.
    let busy = unsafe { sys::cuStreamQuery(stream) };
    assert_eq!(
        busy,
        sys::cudaError_enum::CUDA_ERROR_NOT_READY,
        "the spinning kernel should still be running"
    );
    // The NIC needs no more than its share: an atomic and a write both land while the rest spins.
    g.run(|q, i| {
        FetchAdd64::new(
            q,
            i,
            ra(&rm, 64),
            LocalAddr {
                addr: lm.addr,
                lkey: lm.lkey,
            },
            5,
        )
        .cqe(true)
        .build()
    });
    let t0 = Instant::now();
    g.run(|q, i| {
        InlineWrite::new(q, i, ra(&rm, 0), &1u32.to_ne_bytes())
            .cqe(true)
            .build()
    });
    let write_done = t0.elapsed();
    let t0 = Instant::now();
    loop {
        // SAFETY: live stream.
        match unsafe { sys::cuStreamQuery(stream) } {
            sys::cudaError_enum::CUDA_SUCCESS => break,
            sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
                assert!(t0.elapsed() < T, "spinning kernel never saw the flag");
                std::thread::sleep(Duration::from_millis(1));
            }
            e => panic!("kernel failed: {e:?}"),
        }
    }
    let seen: Vec<u32> = out.download(0, blocks as usize).unwrap();
    assert!(
        seen.iter().all(|&v| v == 1),
        "blocks that timed out instead of seeing the flag: {}",
        seen.iter().filter(|&&v| v != 1).count()
    );
    assert_eq!(flag.download::<u64>(64, 1).unwrap()[0], 5);
    eprintln!(
        "{blocks} blocks x 1024 threads on {sms} SMs; the flag write completed in {write_done:?}"
    );
    // The NICs first: with them goes the GPU agent, which a module unload might wait for.
    drop(g);
    // SAFETY: the module's kernel has finished (the pool keeps the stream).
    unsafe {
        let _ = sys::cuModuleUnload(module);
    }
}

// ---- the GPU agent -------------------------------------------------------------------------

/// The CUDA backend starts the GPU agent by default; allocations and frees (`cuMemFree` waits for
/// every kernel of the context) return within the agent's idle exit and a margin even right
/// after it ran a command; commands posted around the idle exit (while the agent ends, or after
/// it ended) still execute, the agent relaunched.
#[test]
fn gpu_agent_runs_and_allocations_still_return() {
    let Some(ctxs) = gpus(1) else { return };
    let mem = ibgda_emu::CudaMemory::new(&ctxs[0]).unwrap();
    if !ibgda_emu::agent_enabled_by_env() {
        eprintln!("{}=0: the agent is off", ibgda_emu::AGENT_ENV);
        assert!(!mem.uses_agent());
        return;
    }
    assert!(
        ibgda_emu::agent_built(),
        "the agent kernel is not embedded: run `cargo xtask build-kernels` before building"
    );
    assert!(
        mem.uses_agent(),
        "the GPU agent did not start: {}",
        ibgda_emu::agent_refusal(&ctxs[0]).unwrap_or_default()
    );
    let ctx = ctxs[0].clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..16 {
            let b = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
            drop(b);
        }
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("device allocations and frees hang while the GPU agent runs");
    // A second backend on the same GPU shares the agent.
    let again = ibgda_emu::CudaMemory::new(&ctxs[0]).unwrap();
    assert!(again.uses_agent());

    let bound = ibgda_emu::AGENT_IDLE_EXIT + Duration::from_millis(250);
    let mut g = Gpu2::loopback(ctxs.clone());
    let ctx = ctxs[0].clone();
    let dst = Arc::new(DeviceBuffer::new(&ctx, 4096).unwrap());
    let rm =
        g.b.register_device(&dst, 0, 4096, Access::REMOTE_WRITE)
            .unwrap();
    let launches0 = ibgda_emu::agent_launches(&ctx).expect("the agent lives");
    let mut rng = Rng::new(seed());
    let mut slowest_free = Duration::ZERO;
    const ROUNDS: u64 = 200;
    for round in 0..ROUNDS {
        let to_free = (round % 4 == 0).then(|| DeviceBuffer::new(&ctx, 1 << 20).unwrap());
        let at = 8 * (round % 64);
        let v = (round + 1).to_ne_bytes();
        g.run(|q, i| InlineWrite::new(q, i, ra(&rm, at), &v).cqe(true).build());
        assert_eq!(
            dst.download::<u64>(at as usize, 1).unwrap()[0],
            round + 1,
            "round {round}: the write after an idle period did not land"
        );
        if let Some(b) = to_free {
            // The agent has just run a command and is idling: the free waits for its exit.
            let t0 = Instant::now();
            drop(b);
            slowest_free = slowest_free.max(t0.elapsed());
        }
        // Around the idle exit: the next command finds the agent running, ending, or ended.
        let jitter = Duration::from_micros(rng.next_u64() % 800);
        std::thread::sleep(ibgda_emu::AGENT_IDLE_EXIT - Duration::from_micros(400) + jitter);
    }
    let launches = ibgda_emu::agent_launches(&ctx).expect("the agent lives") - launches0;
    eprintln!(
        "{ROUNDS} writes around the idle exit: {launches} relaunches; slowest free right after \
         a command {slowest_free:?} (bound {bound:?})"
    );
    assert!(
        slowest_free < bound,
        "a cuMemFree right after a command took {slowest_free:?}, more than the idle exit and a margin"
    );
    assert!(
        launches > 0,
        "the agent never ended and relaunched in {ROUNDS} idle periods"
    );
}

/// `cuMemFree` waits for every outstanding piece of work of the context and meanwhile holds a
/// driver lock that the NIC thread's next driver call waits on. Atomics must go on while another
/// thread frees memory in a loop: with the agent (the default: its idle exits and relaunches), and
/// without it (`IBGDA_EMU_AGENT=0`) (deferred atomics: a stream waits on a counter the host releases, which
/// a NIC thread stuck behind the free could never do; the release thread does). Batches are
/// spaced around the agent's idle exit.
#[test]
fn gpu_atomics_go_on_while_another_thread_frees_memory() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let Some(ctxs) = gpus(1) else { return };
    let mut g = Gpu2::loopback(ctxs);
    let ctx = g.ctxs[0].clone();
    let target = Arc::new(DeviceBuffer::new(&ctx, 4096).unwrap());
    let fetch = Arc::new(DeviceBuffer::new(&ctx, 4096).unwrap());
    target.fill_bytes(0).unwrap();
    settle(&g.ctxs);
    let (rm, lm) = g.atomic_regs(&target, &fetch);
    let stop = Arc::new(AtomicBool::new(false));
    let frees = Arc::new(AtomicU64::new(0));
    let (done_tx, done_rx) = mpsc::channel();
    {
        let (ctx, stop, frees) = (ctx.clone(), stop.clone(), frees.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let b = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
                drop(b);
                frees.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
            let _ = done_tx.send(());
        });
    }
    let mut rng = Rng::new(seed());
    const ROUNDS: u64 = 40;
    const BATCH: u64 = 64;
    let q = g.qp.qpn();
    let t0 = Instant::now();
    for _ in 0..ROUNDS {
        for k in 0..BATCH {
            let i = g.pi + k;
            let w = FetchAdd64::new(
                q,
                i as u16,
                ra(&rm, 0),
                LocalAddr {
                    addr: lm.addr + 8 * (i % 512),
                    lkey: lm.lkey,
                },
                1,
            )
            .cqe(k == BATCH - 1)
            .build();
            g.qp.post(i, &w);
        }
        g.pi += BATCH;
        g.qp.ring_dbr(g.pi);
        let c = wait_cqe(&g.qp, g.cons);
        g.cons += 1;
        assert!(!c.is_error(), "{c}");
        std::thread::sleep(Duration::from_micros(rng.next_u64() % 3000));
    }
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a cuMemFree did not return after the NIC went quiet");
    assert_eq!(target.download::<u64>(0, 1).unwrap()[0], ROUNDS * BATCH);
    eprintln!(
        "{} fetch-adds in {took:?} while another thread freed {} buffers",
        ROUNDS * BATCH,
        frees.load(Ordering::Relaxed)
    );
}

/// One QP, strict mode off (writes land in WQE order): writes that go to the copy engines
/// (larger than `AGENT_COPY_MAX`) and small and inline writes that go to the agent, each
/// overlapping or reading what the one before wrote, posted under one doorbell. Every byte must
/// be what WQE order says.
#[test]
fn gpu_agent_keeps_qp_order_across_small_and_large_writes() {
    let Some(ctxs) = gpus(1) else { return };
    let mut g = Gpu2::with(vec![ctxs[0].clone(), ctxs[0].clone()], |n| {
        NicConfig::named(n).strict(StrictMode::off())
    });
    const BIG: usize = 4 * ibgda_emu::AGENT_COPY_MAX as usize;
    const SMALL: usize = 4096;
    let ctx = g.ctxs[0].clone();
    let src = Arc::new(DeviceBuffer::new(&ctx, BIG + SMALL).unwrap());
    let mid = Arc::new(DeviceBuffer::new(&ctx, BIG).unwrap());
    let dst = Arc::new(DeviceBuffer::new(&ctx, BIG + SMALL).unwrap());
    let ls =
        g.a.register_device(&src, 0, BIG + SMALL, Access::NONE)
            .unwrap();
    let lmid = g.a.register_device(&mid, 0, BIG, Access::NONE).unwrap();
    let rmid =
        g.b.register_device(&mid, 0, BIG, Access::REMOTE_WRITE)
            .unwrap();
    let rdst =
        g.b.register_device(&dst, 0, BIG + SMALL, Access::REMOTE_WRITE)
            .unwrap();
    let s = seed();
    for round in 0..8u64 {
        let data = pattern(s ^ round, BIG + SMALL);
        src.upload(0, &data).unwrap();
        mid.fill_bytes(0).unwrap();
        dst.fill_bytes(0).unwrap();
        settle(&g.ctxs);
        let q = g.qp.qpn();
        let base = g.pi;
        let sge = |m: &Mr, off: usize, len: usize| Sge {
            addr: m.addr + off as u64,
            len: len as u32,
            lkey: m.lkey,
        };
        let inline = round.to_ne_bytes();
        let wqes = [
            // Copy engines: all of `src`'s first BIG bytes into `mid`.
            RdmaWrite::new(q, base as u16, ra(&rmid, 0), sge(&ls, 0, BIG)).build(),
            // The agent: over part of it.
            RdmaWrite::new(q, (base + 1) as u16, ra(&rmid, 1000), sge(&ls, BIG, SMALL)).build(),
            InlineWrite::new(q, (base + 2) as u16, ra(&rmid, 8), &inline).build(),
            // Copy engines, reading what the three above wrote.
            RdmaWrite::new(q, (base + 3) as u16, ra(&rdst, 0), sge(&lmid, 0, BIG)).build(),
            // The agent, reading what the copy engines wrote into `mid`.
            RdmaWrite::new(
                q,
                (base + 4) as u16,
                ra(&rdst, BIG as u64),
                sge(&lmid, 2000, SMALL),
            )
            .cqe(true)
            .build(),
        ];
        for (k, w) in wqes.iter().enumerate() {
            g.qp.post(base + k as u64, w);
        }
        g.pi += wqes.len() as u64;
        g.qp.ring_dbr(g.pi);
        let c = wait_cqe(&g.qp, g.cons);
        g.cons += 1;
        assert!(!c.is_error(), "{c}");
        let mut want_mid = data[..BIG].to_vec();
        want_mid[1000..1000 + SMALL].copy_from_slice(&data[BIG..]);
        want_mid[8..16].copy_from_slice(&inline);
        let mut want_dst = want_mid.clone();
        want_dst.extend_from_slice(&want_mid[2000..2000 + SMALL]);
        let got_mid: Vec<u8> = mid.download(0, BIG).unwrap();
        let got_dst: Vec<u8> = dst.download(0, BIG + SMALL).unwrap();
        if let Some(i) = (0..BIG).find(|&i| got_mid[i] != want_mid[i]) {
            panic!(
                "round {round}: mid byte {i} is {:#04x}, want {:#04x}",
                got_mid[i], want_mid[i]
            );
        }
        if let Some(i) = (0..BIG + SMALL).find(|&i| got_dst[i] != want_dst[i]) {
            panic!(
                "round {round}: dst byte {i} is {:#04x}, want {:#04x}",
                got_dst[i], want_dst[i]
            );
        }
    }
}

/// Four initiator NICs (four progress threads) of four QPs each, 1000 fetch-adds per QP on one
/// shared word, each reply into a slot of its own: the word ends at the exact sum and every old
/// value is fetched exactly once (atomic across QPs and NICs, no process-wide lock).
#[test]
fn gpu_agent_atomics_from_many_qps_and_nics_sum_exactly() {
    let Some(ctxs) = gpus(1) else { return };
    const NICS: usize = 4;
    const QPS: usize = 4;
    const PER_QP: u64 = 1000;
    let ctx = &ctxs[0];
    let rig = AtomicFanIn::new(ctx, NICS, QPS, 64, QPS * PER_QP as usize * 8);
    let (lanes, nics, rm, target) = (&rig.lanes, &rig.nics, &rig.rm, &rig.target);
    settle(&ctxs);
    for (qp, _, lm, id) in lanes {
        let k = id % QPS;
        for i in 0..PER_QP {
            let w = FetchAdd64::new(
                qp.qpn(),
                i as u16,
                ra(rm, 0),
                LocalAddr {
                    addr: lm.addr + 8 * (k as u64 * PER_QP + i),
                    lkey: lm.lkey,
                },
                1,
            )
            .cqe(i + 1 == PER_QP)
            .build();
            qp.post(i, &w);
        }
    }
    let t0 = Instant::now();
    rig.ring_in_steps_and_wait(PER_QP, 100);
    let took = t0.elapsed();
    let total = lanes.len() as u64 * PER_QP;
    assert_eq!(target.download::<u64>(0, 1).unwrap()[0], total, "the word");
    let mut seen = Vec::new();
    for (_, fetch) in nics {
        seen.extend(fetch.download::<u64>(0, QPS * PER_QP as usize).unwrap());
    }
    seen.sort_unstable();
    let want: Vec<u64> = (0..total).collect();
    assert!(seen == want, "old values are not 0..{total} once each");
    eprintln!(
        "{total} fetch-adds from {} QPs on {NICS} NICs on one word: exact, {:.2} M/s",
        lanes.len(),
        total as f64 / took.as_secs_f64() / 1e6
    );
}

// ---- two processes ------------------------------------------------------------------------

const CHILD_ENV: &str = "IBGDA_EMU_GPU_CHILD";
/// The GPU the child opens (the parent's: the two processes share one GPU).
const CHILD_GPU_ENV: &str = "IBGDA_EMU_GPU_CHILD_DEVICE";
/// Marks the child's protocol lines on its stdout. libtest shares that stream: with
/// `--test-threads=1` it prints `test gpu_two_process_child ... ` with no newline before the test
/// runs, so the child's first line arrives glued to it. The parent looks for the tag anywhere in
/// a line, and the child starts its lines on a fresh one.
const TAG: &str = "IBEMU> ";

/// Last lines kept of each of the child's streams for the parent's failure messages.
const CHILD_TAIL_LINES: usize = 200;

/// The protocol reply in one line of the child's stdout, if the line carries one.
fn tagged(line: &str) -> Option<&str> {
    line.find(TAG).map(|at| &line[at + TAG.len()..])
}

#[test]
fn protocol_lines_are_found_after_libtest_prefix() {
    ep_kernels::testing::aux("a CPU check of the parent's parser of the child's lines");
    assert_eq!(
        tagged("test gpu_two_process_child ... IBEMU> info 00ff"),
        Some("info 00ff")
    );
    assert_eq!(tagged("IBEMU> ok"), Some("ok"));
    assert_eq!(tagged("running 1 test"), None);
}

/// The second process of `gpu_two_process_writes_and_atomics`: owns memory on the GPU the parent
/// names (its own), exports it, and checks what the first process wrote. Does nothing when run
/// on its own.
#[test]
fn gpu_two_process_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        ep_kernels::testing::aux("runs only as the child of gpu_two_process_writes_and_atomics");
        return;
    }
    let say = |s: &str| {
        // A fresh line: libtest may have left `test ... ` unterminated on stdout.
        let mut out = std::io::stdout().lock();
        writeln!(out, "\n{TAG}{s}").expect("child stdout");
        out.flush().expect("child stdout");
    };
    let step = |what: &str| eprintln!("child: {what}");
    let gpu: usize = std::env::var(CHILD_GPU_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    step(&format!("opening GPU {gpu}"));
    let ctx = ibgda_device::cuda::context(gpu).expect("the GPU in the child");
    let fabric = Fabric::new();
    let nic = fabric.cuda_nic(&ctx, NicConfig::named("child")).unwrap();
    step("allocating and registering the target");
    let dst = Arc::new(DeviceBuffer::new(&ctx, MAX + GUARD_BYTES).unwrap());
    let reset = || {
        dst.fill_bytes(GUARD).unwrap();
        dst.upload(MAX, &[0u64; 8]).unwrap();
        // cuMemsetD8 returns before it has run: the parent writes as soon as it hears back.
        settle(std::slice::from_ref(&ctx));
    };
    reset();
    nic.register_device(&dst, 0, MAX + GUARD_BYTES, Access::ALL)
        .unwrap();
    let qp = nic.create_host_qp(8, CqMode::Ring, 8).unwrap();
    step("exporting the registration (cuIpcGetMemHandle)");
    let info = nic.qp_info_for_ipc(qp.qpn()).unwrap();
    say(&format!("info {}", info.to_hex()));
    step("waiting for commands");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("child stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["check", len, seed] => {
                let (len, seed): (usize, u64) = (len.parse().unwrap(), seed.parse().unwrap());
                let want = pattern(seed, len);
                let got: Vec<u8> = dst.download(0, MAX).unwrap();
                let bad = (0..MAX).find(|&i| got[i] != if i < len { want[i] } else { GUARD });
                reset();
                match bad {
                    None => "ok".to_string(),
                    Some(i) => format!("bad byte {i}"),
                }
            }
            ["counter", want] => {
                let v = dst.download::<u64>(MAX, 1).unwrap()[0];
                if v.to_string() == *want {
                    "ok".into()
                } else {
                    format!("bad counter {v}")
                }
            }
            ["quit"] => break,
            _ => format!("bad command {line}"),
        };
        say(&reply);
    }
    step("done");
}

/// The child process as the parent drives it: its tagged replies, the rest of its output kept
/// for failure messages, and a kill on drop so a failing parent never leaves it behind.
struct ChildPeer {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    replies: mpsc::Receiver<String>,
    stdout_tail: Arc<std::sync::Mutex<Vec<String>>>,
    stderr_tail: Arc<std::sync::Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

fn keep_tail(tail: &std::sync::Mutex<Vec<String>>, line: String) {
    let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
    if t.len() == CHILD_TAIL_LINES {
        t.remove(0);
    }
    t.push(line);
}

impl ChildPeer {
    fn spawn() -> Self {
        let exe = std::env::current_exe().expect("path of this test binary");
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "gpu_two_process_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .env(CHILD_GPU_ENV, "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting the child {}: {e}", exe.display()));
        let (tx, replies) = mpsc::channel::<String>();
        let stdout_tail = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr_tail = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let out_tail = stdout_tail.clone();
        let err_tail = stderr_tail.clone();
        let readers = vec![
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some(rest) = tagged(&line) {
                        let _ = tx.send(rest.to_string());
                    } else if !line.trim().is_empty() {
                        keep_tail(&out_tail, line);
                    }
                }
            }),
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    // Passed on as it comes, so a hang shows how far the child got.
                    eprintln!("[child] {line}");
                    keep_tail(&err_tail, line);
                }
            }),
        ];
        let stdin = child.stdin.take();
        Self {
            child,
            stdin,
            replies,
            stdout_tail,
            stderr_tail,
            readers,
        }
    }

    /// Everything known about the child, for a panic message.
    fn report(&mut self, what: &str) -> String {
        // A child that just closed its pipes is usually exiting: give it a moment.
        let t0 = Instant::now();
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(st)) => break format!("exited with {st}"),
                Ok(None) if t0.elapsed() < Duration::from_secs(2) => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => break "still running (killed now)".to_string(),
                Err(e) => break format!("status unknown: {e}"),
            }
        };
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The pipes close with the child: the readers finish and the tails are complete.
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let lock = |t: &std::sync::Mutex<Vec<String>>| {
            t.lock().unwrap_or_else(|p| p.into_inner()).join("\n  ")
        };
        format!(
            "{what}; the child {status}\nchild stderr:\n  {}\nchild stdout (untagged):\n  {}",
            lock(&self.stderr_tail),
            lock(&self.stdout_tail)
        )
    }

    /// The child's next reply; panics with its status and output if it exits or stays silent
    /// for `T`.
    fn recv(&mut self, waiting_for: &str) -> String {
        let t0 = Instant::now();
        loop {
            match self.replies.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => return r,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let m = self.report(&format!(
                        "the child closed its stdout while the parent waited for {waiting_for}"
                    ));
                    panic!("{m}");
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                // A last reply may still be in the pipe.
                if let Ok(r) = self.replies.recv_timeout(Duration::from_millis(200)) {
                    return r;
                }
                let m = self.report(&format!(
                    "the child exited while the parent waited for {waiting_for}"
                ));
                panic!("{m}");
            }
            if t0.elapsed() > T {
                let m = self.report(&format!(
                    "the child did not answer within {T:?} while the parent waited for {waiting_for}"
                ));
                panic!("{m}");
            }
        }
    }

    fn say(&mut self, s: &str) {
        let ok = self
            .stdin
            .as_mut()
            .is_some_and(|i| writeln!(i, "{s}").and_then(|()| i.flush()).is_ok());
        if !ok {
            let m = self.report(&format!("sending {s:?} to the child failed"));
            panic!("{m}");
        }
    }

    /// Sends `quit` and waits (bounded) for a successful exit.
    fn finish(mut self) {
        self.say("quit");
        drop(self.stdin.take());
        let t0 = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return,
                Ok(Some(_)) => {
                    let m = self.report("the child failed");
                    panic!("{m}");
                }
                Ok(None) if t0.elapsed() < T => std::thread::sleep(Duration::from_millis(10)),
                _ => {
                    let m = self.report("the child did not exit after quit");
                    panic!("{m}");
                }
            }
        }
    }
}

impl Drop for ChildPeer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
fn gpu_two_process_writes_and_atomics() {
    // Both processes on GPU 0: CUDA IPC between processes of one GPU.
    let Some(ctxs) = gpus(1) else { return };
    let mut child = ChildPeer::spawn();
    let first = child.recv("the child's QpInfo");
    let info = QpInfo::from_hex(first.strip_prefix("info ").unwrap_or_else(|| {
        let m = child.report(&format!("expected an info line, got {first:?}"));
        panic!("{m}")
    }))
    .unwrap();
    let remote = info.exports[0].mr;
    let fabric = Fabric::new();
    let nic = fabric
        .cuda_nic(&ctxs[0], NicConfig::named("parent"))
        .unwrap();
    let src = Arc::new(DeviceBuffer::new(&ctxs[0], MAX).unwrap());
    let lm = nic
        .register_device(&src, 0, MAX, Access::LOCAL_WRITE)
        .unwrap();
    let qp = nic.create_host_qp(256, CqMode::Ring, 256).unwrap();
    nic.connect(qp.qpn(), &info).unwrap();
    let s = seed();
    let (mut pi, mut cons) = (0u64, 0u64);
    for (k, &len) in [8usize, 4096, 65536 + 7, 1 << 20, 16 << 20, MAX]
        .iter()
        .enumerate()
    {
        let sd = s ^ (k as u64 + 1);
        src.upload(0, &pattern(sd, len)).unwrap();
        // A pageable upload may return before its last DMA; the NIC's copy runs on its own stream.
        settle(&ctxs[..1]);
        let w = RdmaWrite::new(
            qp.qpn(),
            pi as u16,
            ra(&remote, 0),
            Sge {
                addr: lm.addr,
                len: len as u32,
                lkey: lm.lkey,
            },
        )
        .cqe(true)
        .build();
        qp.post(pi, &w);
        pi += 1;
        qp.ring_dbr(pi);
        let c = wait_cqe(&qp, cons);
        cons += 1;
        assert_eq!(c.opcode(), cqe_opcode::REQ, "{c}");
        child.say(&format!("check {len} {sd}"));
        assert_eq!(
            child.recv("a check"),
            "ok",
            "write of {len} bytes across processes"
        );
    }
    for k in 0..50u64 {
        let w = FetchAdd64::new(
            qp.qpn(),
            pi as u16,
            ra(&remote, MAX as u64),
            LocalAddr {
                addr: lm.addr + 8 * k,
                lkey: lm.lkey,
            },
            2,
        )
        .cqe(k == 49)
        .build();
        qp.post(pi, &w);
        pi += 1;
    }
    qp.ring_dbr(pi);
    let c = wait_cqe(&qp, cons);
    assert!(!c.is_error(), "{c}");
    let fetched: Vec<u64> = src.download(0, 50).unwrap();
    assert_eq!(fetched, (0..50).map(|k| 2 * k).collect::<Vec<u64>>());
    child.say("counter 100");
    assert_eq!(child.recv("the counter check"), "ok");
    // The parent's NIC holds the child's memory open (CUDA IPC): close it before the child
    // frees it.
    nic.destroy_qp(qp.qpn()).unwrap();
    drop(nic);
    child.finish();
}
