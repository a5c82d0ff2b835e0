//! The real verbs path on the emulated driver: `ibgda-verbs` opens an emulated device, allocates
//! a PD, registers memory and umems, creates CQs and QPs from PRM command images and brings two
//! QPs through RST→INIT→RTR→RTS to each other; the emulated firmware decodes every image and
//! the engine carries RDMA writes and atomics between the QPs it built from them. Host memory
//! backend: no GPU, no NIC.

use std::sync::Arc;
use std::time::Duration;

use ibgda_device::protocol::HostQp;
use ibgda_device::proxy::{Mlx5UarDoorbell, ProducerSlot, Proxy, ProxyConfig, ProxyQp};
use ibgda_device::qp_desc::{NicHandler, QpCounters, QpDesc, QP_FLAG_EMULATED};
use ibgda_device::wire::DoorbellRecord;
use ibgda_device::wire::{
    cqe_opcode, db_bytes, db_word, dbr_send_word, opcode, syndrome as cqe_syndrome, CompareSwap64,
    Cqe64, FetchAdd64, InlineWrite, LocalAddr, MaskedFetchAdd32, RdmaWrite, RemoteAddr, Sge, WqeBB,
};
use ibgda_emu::firmware::{syndrome, EmuDevice, EmuSubnet};
use ibgda_emu::{vendor_syndrome, HostBuffer};
use ibgda_verbs::prm::{AtomicMode, FirmwareQpState, Mtu, RemoteAccess};
use ibgda_verbs::{
    random_psn, Access, Context, Cq, CqBuilder, InitAttrs, MemoryRegion, ProtectionDomain, Qp,
    QpBuilder, Reset, RtrAttrs, Rts, RtsAttrs, Uar, Umem, VerbsError,
};

const T: Duration = Duration::from_secs(10);

/// Where everything of one QP lives in its queue umem.
const CQ_RING: u64 = 0;
const LOG_CQ: u8 = 6;
const SQ_RING: u64 = 4096;
const LOG_SQ: u8 = 6;
const CQ_DBR: u64 = 8192;
const QP_DBR: u64 = 8200;
const QUEUE_BYTES: usize = 12288;
const DATA_BYTES: usize = 8192;

/// One device and everything one QP needs on it. Fields drop in order: registrations and the
/// objects placed in them before the memory under them.
struct Side {
    dev: EmuDevice,
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    uar: Arc<Uar>,
    cq: Arc<Cq>,
    umem: Arc<Umem>,
    mr: MemoryRegion,
    queues: Arc<HostBuffer>,
    data: Arc<HostBuffer>,
    /// Next WQEBB index.
    pi: u64,
}

impl Side {
    fn open(subnet: &EmuSubnet, name: &str) -> Self {
        let dev = subnet.open_host(name).unwrap();
        let ctx = Context::with_driver(dev.clone());
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let uar = Uar::alloc(&ctx).unwrap();
        let queues = Arc::new(HostBuffer::new(QUEUE_BYTES));
        // Every CQE owned by hardware and invalid before the CQ exists.
        for i in 0..(1u64 << LOG_CQ) {
            queues.write((CQ_RING + i * 64 + 63) as usize, &[0xf1]);
        }
        // SAFETY: `queues` outlives the umem and the CQ and QPs placed in it (field order; the
        // tests' QPs are locals dropped first) and is only touched through HostBuffer's copies
        // and atomics.
        let umem = unsafe {
            Umem::register_host(
                &ctx,
                queues.addr() as *mut u8,
                QUEUE_BYTES,
                Access::LOCAL_WRITE,
            )
        }
        .unwrap();
        // The builder's defaults: a ring CQ, each completion in the entry after the last, which
        // is what the protocol polls (`HostQp::poll_cq`, `ibgda_poll_cq`).
        let cq = CqBuilder::new(&uar, umem.at(CQ_RING), umem.at(CQ_DBR), LOG_CQ)
            .create()
            .unwrap();
        assert!(!cq.is_collapsed(), "a CqBuilder's default CQ is a ring");
        let data = Arc::new(HostBuffer::new(DATA_BYTES));
        // SAFETY: as for `queues`: `data` outlives the registration.
        let mr = unsafe {
            MemoryRegion::register_host(&pd, data.addr() as *mut u8, DATA_BYTES, Access::rdma())
        }
        .unwrap();
        Self {
            dev,
            ctx,
            pd,
            uar,
            cq,
            umem,
            mr,
            queues,
            data,
            pi: 0,
        }
    }

    fn qp(&self) -> Qp<Reset> {
        QpBuilder::new(
            &self.pd,
            &self.uar,
            &self.cq,
            &self.cq,
            self.umem.at(SQ_RING),
            self.umem.at(QP_DBR),
            LOG_SQ,
        )
        .create()
        .unwrap()
    }

    fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.mr.addr() + offset,
            rkey: self.mr.rkey(),
        }
    }

    fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.mr.addr() + offset,
            len,
            lkey: self.mr.lkey(),
        }
    }

    fn local(&self, offset: u64) -> LocalAddr {
        LocalAddr {
            addr: self.mr.addr() + offset,
            lkey: self.mr.lkey(),
        }
    }

    /// Writes `wqe` into the next slot of the send ring; returns its index.
    fn post(&mut self, wqe: WqeBB) -> u16 {
        let i = self.pi;
        let slot = SQ_RING + (i & ((1 << LOG_SQ) - 1)) * 64;
        self.queues.write(slot as usize, wqe.as_bytes());
        self.pi += 1;
        i as u16
    }

    /// Doorbell record, then the UAR register: what the proxy (or the GPU) does.
    fn ring(&self, qpn: u32) {
        let word = u32::from_ne_bytes(dbr_send_word(self.pi).to_bytes());
        self.queues.store_u32((QP_DBR + 4) as usize, word);
        self.uar.ring_doorbell(db_bytes(qpn, self.pi));
    }

    /// Only the UAR register: the doorbell record is left stale.
    fn ring_uar_only(&self, qpn: u32) {
        self.uar.ring_doorbell(db_bytes(qpn, self.pi));
    }

    fn wait(&self, qpn: u32) {
        self.dev.nic().wait_idle(qpn, T).unwrap();
    }

    fn cqe(&self, i: u64) -> Cqe64 {
        let bytes = self
            .queues
            .read_vec((CQ_RING + (i & ((1 << LOG_CQ) - 1)) * 64) as usize, 64);
        Cqe64::from_bytes(&bytes.try_into().unwrap())
    }
}

/// RST→INIT→RTR→RTS on both QPs, each pointed at the other.
fn connect(
    a: &Side,
    qa: Qp<Reset>,
    access_a: RemoteAccess,
    b: &Side,
    qb: Qp<Reset>,
    access_b: RemoteAccess,
) -> (Qp<Rts>, Qp<Rts>, (u32, u32)) {
    let (port_a, port_b) = (a.ctx.port(1).unwrap(), b.ctx.port(1).unwrap());
    let (psn_a, psn_b) = (random_psn(), random_psn());
    let info_a = qa.connect_info(&port_a, None, psn_a);
    let info_b = qb.connect_info(&port_b, None, psn_b);
    let init = |access| InitAttrs {
        port: 1,
        pkey_index: 0,
        access,
    };
    let qa = qa.init(&init(access_a)).unwrap();
    let qb = qb.init(&init(access_b)).unwrap();
    let qa = qa
        .rtr(&info_b, &RtrAttrs::for_port(&port_a, None).unwrap())
        .unwrap();
    let qb = qb
        .rtr(&info_a, &RtrAttrs::for_port(&port_b, None).unwrap())
        .unwrap();
    let qa = qa.rts(&RtsAttrs::new(psn_a)).unwrap();
    let qb = qb.rts(&RtsAttrs::new(psn_b)).unwrap();
    (qa, qb, (psn_a, psn_b))
}

fn all_rights(ctx: &Context) -> RemoteAccess {
    InitAttrs::new(ctx, 1).access
}

fn assert_done(c: &Cqe64, index: u16, wqe_opcode: u8, bytes: u32) {
    assert_eq!(c.opcode(), cqe_opcode::REQ, "{c}");
    assert_eq!(c.wqe_counter.get(), index, "{c}");
    assert_eq!((c.sop_drop_qpn.get() >> 24) as u8, wqe_opcode, "{c}");
    assert_eq!(c.byte_cnt.get(), bytes, "{c}");
}

#[test]
fn capabilities_come_from_the_emulated_firmware() {
    let subnet = EmuSubnet::new();
    let a = Side::open(&subnet, "emu_a");
    let caps = a.ctx.capabilities().unwrap();
    let g = caps.general.expect("QUERY_HCA_CAP(general) answered");
    assert!(g.rc && g.atomic && g.cq_oi && g.bf && g.uar_4k);
    assert_eq!(
        (g.log_max_qp_sz, g.log_max_cq_sz, g.log_max_msg),
        (15, 22, 31)
    );
    assert_eq!(g.port_type, 0, "InfiniBand");
    let atomic = caps.atomic.expect("QUERY_HCA_CAP(atomic) answered");
    assert!(atomic.standard() && atomic.extended());
    assert_eq!(atomic.qp_atomic_mode(), Some(AtomicMode::UpTo8Bytes));
    let port = a.ctx.port(1).unwrap();
    assert_eq!(port.lid, a.dev.lid());
    assert_eq!(a.ctx.gids(1).unwrap().len(), 1);
    assert!(a.ctx.has_devx());
    assert_eq!(a.ctx.driver().kind(), "ibgda-emu");
}

#[test]
fn verbs_bring_up_carries_writes_and_atomics() {
    let subnet = EmuSubnet::new();
    let mut a = Side::open(&subnet, "emu_a");
    let mut b = Side::open(&subnet, "emu_b");
    let (qa, qb) = (a.qp(), b.qp());
    let (qa, qb, psns) = connect(&a, qa, all_rights(&a.ctx), &b, qb, all_rights(&b.ctx));
    let (na, nb) = (qa.qpn(), qb.qpn());

    // A → B: a gathered RDMA write, an inline write, then atomics on B's words with their old
    // values fetched into A's memory.
    let src: Vec<u8> = (0..512u32).map(|i| (i * 7 + 3) as u8).collect();
    a.data.write(0, &src);
    b.data.store_u64(4096, 40);
    b.data.store_u64(4104, 7);
    b.data.store_u32(4112, 0x0001_ffff);
    let w0 = a.post(
        RdmaWrite::new_gather(na, 0, b.remote(1024), [a.sge(0, 300), a.sge(400, 112)]).build(),
    );
    let w1 = a.post(
        InlineWrite::new(na, 1, b.remote(2000), b"over the firmware path")
            .cqe(true)
            .build(),
    );
    let w2 = a.post(FetchAdd64::new(na, 2, b.remote(4096), a.local(6000), 2).build());
    let w3 = a.post(CompareSwap64::new(na, 3, b.remote(4104), a.local(6008), 99, 7).build());
    let w4 = a.post(
        MaskedFetchAdd32::new(na, 4, b.remote(4112), a.local(6016), 0x0001_0001)
            .field_boundary(0x8000_8000)
            .cqe(true)
            .build(),
    );
    assert_eq!((w0, w1, w2, w3, w4), (0, 1, 2, 3, 4));
    a.ring(na);
    a.wait(na);

    let got = b.data.read_vec(1024, 412);
    assert_eq!(&got[..300], &src[..300]);
    assert_eq!(&got[300..], &src[400..512]);
    assert_eq!(b.data.read_vec(2000, 22), b"over the firmware path");
    assert_eq!(b.data.load_u64(4096), 42);
    assert_eq!(b.data.load_u64(4104), 99);
    assert_eq!(
        b.data.load_u32(4112),
        0x0002_0000,
        "carry stopped at the field boundary"
    );
    assert_eq!(a.data.load_u64(6000), 40, "fetch-add returns the old value");
    assert_eq!(a.data.load_u64(6008), 7);
    assert_eq!(a.data.read_vec(6016, 4), 0x0001_ffffu32.to_be_bytes());
    // The CQEs land in the CQ ring the CREATE_CQ image placed, in order.
    assert_done(&a.cqe(0), 1, opcode::RDMA_WRITE, 22);
    assert_done(&a.cqe(1), 4, opcode::ATOMIC_MASKED_FA, 4);
    assert_eq!(
        a.cqe(2).opcode(),
        cqe_opcode::INVALID,
        "nothing else completed"
    );

    // B → A on the other QP of the pair.
    b.data.write(0, b"and back");
    b.post(
        RdmaWrite::new(nb, 0, a.remote(3000), b.sge(0, 8))
            .cqe(true)
            .build(),
    );
    b.ring(nb);
    b.wait(nb);
    assert_eq!(a.data.read_vec(3000, 8), b"and back");
    assert_done(&b.cqe(0), 0, opcode::RDMA_WRITE, 8);

    let st = a.dev.nic().qp_status(na).unwrap();
    assert_eq!(
        st.peer.map(|p| p.1),
        Some(nb),
        "A's engine QP points at B's QP"
    );
    assert!(st.first_error.is_none());

    // QUERY_QP, parsed by verbs' own table: what the firmware kept from the commands.
    let (ca, cb) = (qa.query().unwrap(), qb.query().unwrap());
    assert_eq!(ca.state, FirmwareQpState::Rts);
    assert_eq!((ca.remote_qpn, cb.remote_qpn), (nb, na));
    assert_eq!(ca.next_send_psn, psns.0, "A sends from the PSN it told B");
    assert_eq!(ca.next_rcv_psn, psns.1, "and expects B's");
    assert_eq!(cb.next_rcv_psn, psns.0);
    assert_eq!(ca.mtu, Some(Mtu::Mtu4096));
    assert_eq!(ca.send_cqn, a.cq.cqn());
    assert_eq!(ca.remote_access, (true, true, true));
    assert_eq!(ca.hw_sq_wqebb_counter, 5, "the NIC read five WQEBBs");
}

#[test]
fn the_uar_page_the_qp_names_rings_it() {
    let subnet = EmuSubnet::new();
    let mut a = Side::open(&subnet, "emu_a");
    let b = Side::open(&subnet, "emu_b");
    let (qa, qb) = (a.qp(), b.qp());
    let (qa, _qb, _) = connect(&a, qa, all_rights(&a.ctx), &b, qb, all_rights(&b.ctx));
    let na = qa.qpn();
    a.post(
        InlineWrite::new(na, 0, b.remote(64), b"uar")
            .cqe(true)
            .build(),
    );
    a.ring_uar_only(na);
    a.wait(na);
    assert_eq!(b.data.read_vec(64, 3), b"uar");
    assert_done(&a.cqe(0), 0, opcode::RDMA_WRITE, 3);
}

#[test]
fn rights_the_responder_qp_was_not_granted_fail_like_hardware() {
    let subnet = EmuSubnet::new();
    let mut a = Side::open(&subnet, "emu_a");
    let b = Side::open(&subnet, "emu_b");
    let (qa, qb) = (a.qp(), b.qp());
    // B's MR grants everything, but B's QP lets peers read only.
    let read_only = RemoteAccess {
        read: true,
        write: false,
        atomic: None,
    };
    let (qa, _qb, _) = connect(&a, qa, all_rights(&a.ctx), &b, qb, read_only);
    let na = qa.qpn();
    b.data.store_u64(0, 5);
    a.post(
        InlineWrite::new(na, 0, b.remote(8), b"refused")
            .cqe(true)
            .build(),
    );
    a.post(
        FetchAdd64::new(na, 1, b.remote(0), a.local(0), 1)
            .cqe(true)
            .build(),
    );
    a.ring(na);
    a.wait(na);
    let c = a.cqe(0);
    assert_eq!(c.opcode(), cqe_opcode::REQ_ERR, "{c}");
    assert_eq!(
        (c.syndrome(), c.vendor_syndrome()),
        (
            cqe_syndrome::REMOTE_INVAL_REQ_ERR,
            vendor_syndrome::REMOTE_QP_ACCESS
        ),
        "{c}"
    );
    assert_eq!(b.data.read_vec(8, 7), vec![0u8; 7], "nothing written");
    assert_eq!(b.data.load_u64(0), 5, "nothing added");
    let st = a.dev.nic().qp_status(na).unwrap();
    assert!(st.first_error.is_some(), "{st:?}");
    assert_eq!(qa.query().unwrap().state, FirmwareQpState::Error);
}

#[test]
fn a_refused_transition_hands_the_qp_back_with_status_and_syndrome() {
    let subnet = EmuSubnet::new();
    let a = Side::open(&subnet, "emu_a");
    let qp = a.qp();
    let bad_port = InitAttrs {
        port: 2,
        pkey_index: 0,
        access: all_rights(&a.ctx),
    };
    let e = qp.init(&bad_port).unwrap_err();
    match &e.error {
        VerbsError::Firmware { source, errno, .. } => {
            assert_eq!(source.command, "RST2INIT_QP");
            assert_eq!(source.status, 0x03, "BAD_PARAM");
            assert_eq!(source.syndrome, syndrome::NO_SUCH_PORT);
            assert_eq!(*errno, 121, "EREMOTEIO, as the kernel returns it");
        }
        other => panic!("not a firmware refusal: {other}"),
    }
    // Still in RESET: the same QP goes to INIT with a valid port.
    let qp = e.qp.init(&InitAttrs::new(&a.ctx, 1)).unwrap();
    assert_eq!(qp.state(), "INIT");

    // RTR naming a LID no port of the subnet has.
    let port = a.ctx.port(1).unwrap();
    let mut nowhere = qp.connect_info(&port, None, 1);
    nowhere.lid = 0x7777;
    let e = qp
        .rtr(&nowhere, &RtrAttrs::for_port(&port, None).unwrap())
        .unwrap_err();
    match &e.error {
        VerbsError::Firmware { source, .. } => {
            assert_eq!(
                (source.status, source.syndrome),
                (0x03, syndrome::NO_SUCH_LID)
            );
        }
        other => panic!("not a firmware refusal: {other}"),
    }
    assert_eq!(e.qp.state(), "INIT");
}

#[test]
fn teardown_releases_the_firmware_objects() {
    let subnet = EmuSubnet::new();
    let a = Side::open(&subnet, "emu_a");
    let qp = a.qp();
    let qpn = qp.qpn();
    assert!(a.dev.nic().qp_status(qpn).is_ok());
    drop(qp);
    assert!(
        a.dev.nic().qp_status(qpn).is_err(),
        "destroying the QP object destroys the engine QP"
    );
    // The CQ serves no QP any more, so a new QP may use it as its send CQ again.
    let again = a.qp();
    assert_ne!(again.qpn(), qpn);
}

/// The descriptor device code reads, filled from the verbs objects alone: in mode `gpu` it
/// names the UAR register, in the CPU modes the producer slot at `slot`.
fn descriptor(a: &Side, qa: &Qp<Rts>, mode: NicHandler, slot: u64) -> QpDesc {
    QpDesc {
        wq_base: qa.sq().addr(),
        dbr: qa.doorbell_record().addr(),
        db_reg: if mode.uses_proxy() {
            0
        } else {
            qa.uar().register_ptr() as u64
        },
        producer_slot: if mode.uses_proxy() { slot } else { 0 },
        nwqes: qa.sq_wqebbs(),
        qpn: qa.qpn(),
        handler_mode: mode as u32,
        lkey: a.mr.lkey(),
        cq_base: qa.send_cq().ring().addr(),
        cq_dbr: 0,
        ncqes: 1 << qa.send_cq().log_cq_size(),
        flags: QP_FLAG_EMULATED,
        rank: 0,
        qp_index: 0,
        peer_rank: 1,
        reserved0: 0,
        timeout_ns: T.as_nanos() as u64,
        error_record: 0,
        scratch: a.mr.addr() + (DATA_BYTES - 64) as u64,
        reserved1: [0; 2],
        counters: QpCounters::default(),
    }
}

#[test]
fn the_submit_protocol_drives_a_verbs_qp_in_mode_gpu() {
    let subnet = EmuSubnet::new();
    let a = Side::open(&subnet, "emu_a");
    let b = Side::open(&subnet, "emu_b");
    let (qa, qb) = (a.qp(), b.qp());
    let (qa, _qb, _) = connect(&a, qa, all_rights(&a.ctx), &b, qb, all_rights(&b.ctx));
    let desc = descriptor(&a, &qa, NicHandler::Gpu, 0);
    let store = HostBuffer::new(std::mem::size_of::<QpDesc>());
    store.write(0, bytemuck::bytes_of(&desc));
    // SAFETY: `store` is 4096-aligned and outlives `hq`; every address in the descriptor is
    // live memory of `a` (ring, CQ, doorbell record, UAR register, MR), which outlives `hq` too;
    // the counters are touched only through `hq`.
    let hq = unsafe { HostQp::new(store.addr() as *mut QpDesc) }.unwrap();
    hq.check_desc().unwrap();

    let src: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    a.data.write(0, &src);
    // 8 WQEs of up to 128 bytes, then a fenced signal: doorbell record, then the UAR register
    // the QP context named, by the protocol's own mode-gpu path.
    hq.put_chunked(b.remote(0), a.mr.addr(), 1000, 128, true)
        .unwrap();
    hq.signal_add(b.remote(4096), 3, true, true).unwrap();
    hq.quiet().unwrap();
    assert_eq!(b.data.read_vec(0, 1000), src);
    assert_eq!(b.data.load_u64(4096), 3);
    let c = hq.counters();
    assert_eq!((c.ready_head, c.cons_idx), (9, 9), "{c:?}");
    assert_eq!(qa.query().unwrap().hw_sq_wqebb_counter, 9);
}

#[test]
fn the_proxy_rings_a_verbs_qp_through_the_mlx5_uar_doorbell() {
    let subnet = EmuSubnet::new();
    let a = Side::open(&subnet, "emu_a");
    let b = Side::open(&subnet, "emu_b");
    let (qa, qb) = (a.qp(), b.qp());
    let (qa, _qb, _) = connect(&a, qa, all_rights(&a.ctx), &b, qb, all_rights(&b.ctx));
    // Mode cpu_host_memory: the submitter raises a producer slot in host memory; the proxy
    // rings with the real-NIC doorbell (doorbell record, then the UAR's BlueFlame register).
    let slot = HostBuffer::new(64);
    let desc = descriptor(&a, &qa, NicHandler::CpuHostMemory, slot.addr());
    let store = HostBuffer::new(std::mem::size_of::<QpDesc>());
    store.write(0, bytemuck::bytes_of(&desc));
    // SAFETY: as in the mode-gpu test; the slot buffer outlives `hq` and the proxy too.
    let hq = unsafe { HostQp::new(store.addr() as *mut QpDesc) }.unwrap();
    // SAFETY: the QP's doorbell record (in `a`'s queue umem) and the UAR register stay mapped
    // until the proxy is stopped below; only the proxy rings this QP.
    let doorbell = unsafe {
        Mlx5UarDoorbell::new(
            qa.doorbell_record().addr() as *mut DoorbellRecord,
            qa.uar().register_ptr().cast::<u64>(),
            qa.qpn(),
        )
    }
    .unwrap();
    // SAFETY: `slot` is live and 8-byte aligned until the proxy stops; `hq` writes it whole.
    let producer = unsafe { ProducerSlot::new(slot.addr() as *const u64) }.unwrap();
    let proxy = Proxy::start(
        vec![ProxyQp {
            slot: producer,
            doorbell: Box::new(doorbell),
            rung_from: 0,
            rank: 0,
            qp_index: 0,
        }],
        ProxyConfig::default(),
    )
    .unwrap();
    a.data.write(0, b"rung by the proxy");
    hq.put(b.remote(100), a.mr.addr(), 17, true).unwrap();
    hq.signal_add(b.remote(4096), 5, true, true).unwrap();
    hq.quiet().unwrap();
    let report = proxy.stop().unwrap();
    assert_eq!(b.data.read_vec(100, 17), b"rung by the proxy");
    assert_eq!(b.data.load_u64(4096), 5);
    assert!(report.doorbells >= 1, "{report:?}");
    assert_eq!(hq.counters().cons_idx, 2);
    // The last doorbell went to the register of the UAR page the QP context named.
    // SAFETY: the UAR's live, 8-byte aligned register; the proxy that wrote it has stopped.
    let word = unsafe { (qa.uar().register_ptr() as *const u64).read_volatile() };
    assert_eq!(word, db_word(qa.qpn(), 2));
}

#[test]
fn qps_share_a_collapsed_cq_and_a_uar_page() {
    let subnet = EmuSubnet::new();
    let a = Side::open(&subnet, "emu_a");
    let b = Side::open(&subnet, "emu_b");
    let responder = b.qp().init(&InitAttrs::new(&b.ctx, 1)).unwrap();
    let port_b = b.ctx.port(1).unwrap();
    let to_b = responder.connect_info(&port_b, None, 0x42);

    // One collapsed CQ (a single entry, initialised by its owner) for two QPs on one UAR.
    let mem = Arc::new(HostBuffer::new(16384));
    mem.write(63, &[0xf1]);
    // SAFETY: `mem` outlives the umem and the CQ and QPs placed in it (locals declared after it
    // drop first); only HostBuffer's copies touch it.
    let umem =
        unsafe { Umem::register_host(&a.ctx, mem.addr() as *mut u8, 16384, Access::LOCAL_WRITE) }
            .unwrap();
    let cq = CqBuilder::new(&a.uar, umem.at(0), umem.at(12288), 0)
        .collapsed(true)
        .create()
        .unwrap();
    assert!(cq.is_collapsed());
    let port_a = a.ctx.port(1).unwrap();
    let bring_up = |sq: u64, dbr: u64| {
        let qp = QpBuilder::new(&a.pd, &a.uar, &cq, &cq, umem.at(sq), umem.at(dbr), 4)
            .create()
            .unwrap();
        qp.init(&InitAttrs::new(&a.ctx, 1))
            .unwrap()
            .rtr(&to_b, &RtrAttrs::for_port(&port_a, None).unwrap())
            .unwrap()
            .rts(&RtsAttrs::new(7))
            .unwrap()
    };
    let entry0 = || Cqe64::from_bytes(&mem.read_vec(0, 64).try_into().unwrap());
    let write = |qp: &Qp<Rts>, sq: u64, off: u64, bytes: &[u8]| {
        let wqe = InlineWrite::new(qp.qpn(), 0, b.remote(off), bytes)
            .cqe(true)
            .build();
        mem.write(sq as usize, wqe.as_bytes());
        a.uar.ring_doorbell(db_bytes(qp.qpn(), 1));
        a.dev.nic().wait_idle(qp.qpn(), T).unwrap();
    };

    let q1 = bring_up(4096, 12296);
    write(&q1, 4096, 0, b"first");
    assert_eq!(entry0().qpn(), q1.qpn());
    // A second QP on the same CQ leaves its contents alone: the first CQE is still there.
    let q2 = bring_up(8192, 12304);
    assert_eq!(entry0().qpn(), q1.qpn());
    assert_done(&entry0(), 0, opcode::RDMA_WRITE, 5);
    // The page's register last named q1; q2's doorbell on the same page reaches q2.
    write(&q2, 8192, 8, b"second");
    assert_eq!(entry0().qpn(), q2.qpn());
    assert_done(&entry0(), 0, opcode::RDMA_WRITE, 6);
    assert_eq!(b.data.read_vec(0, 5), b"first");
    assert_eq!(b.data.read_vec(8, 6), b"second");
}
