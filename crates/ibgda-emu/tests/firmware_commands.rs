//! The emulated firmware against command images written byte by byte from the PRM layouts
//! (`mlx5_ifc.h`): its own golden images, built without `ibgda-verbs`' builders or the
//! emulator's field tables, sent through the driver seam as a ConnectX would receive them.
//!
//! Each image is a list of byte patches whose comments give the PRM bit offset they come from:
//! `create_qp_in.qpc` starts at bit 0xc0 (byte 0x18), `create_cq_in.cq_context` at bit 0x80
//! (byte 0x10), an address path (`ads`) at `qpc` bit 0xc0.

use std::sync::Arc;

use ibgda_emu::firmware::{status, syndrome, EmuSubnet};
use ibgda_emu::HostBuffer;
use ibgda_verbs::{
    Access, Context, Cq, CqBuilder, DriverObj, ProtectionDomain, Uar, Umem, VerbsError,
};

/// The objects an image names, made through verbs on the emulated device. Fields drop in
/// order: the CQ and the umem before the memory under them.
struct Fixture {
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    uar: Arc<Uar>,
    cq: Arc<Cq>,
    umem: Arc<Umem>,
    _mem: Arc<HostBuffer>,
}

fn fixture(subnet: &EmuSubnet, name: &str) -> Fixture {
    let dev = subnet.open_host(name).unwrap();
    let ctx = Context::with_driver(dev);
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let uar = Uar::alloc(&ctx).unwrap();
    let mem = Arc::new(HostBuffer::new(1 << 16));
    let base = mem.addr() as *mut u8;
    // SAFETY: the fixture keeps `mem` until after the umem and every object placed in it are
    // gone (field order; the tests' raw objects are locals dropped before the fixture), and
    // touches it only through HostBuffer's copies.
    let umem = unsafe { Umem::register_host(&ctx, base, 1 << 16, Access::LOCAL_WRITE) };
    let umem = umem.unwrap();
    let cq = CqBuilder::new(&uar, umem.at(0), umem.at(0x8000), 6)
        .collapsed(true)
        .create()
        .unwrap();
    Fixture {
        ctx,
        pd,
        uar,
        cq,
        umem,
        _mem: mem,
    }
}

fn be24(v: u32) -> [u8; 3] {
    let b = v.to_be_bytes();
    [b[1], b[2], b[3]]
}

fn patch(img: &mut [u8], at: usize, bytes: &[u8]) {
    img[at..at + bytes.len()].copy_from_slice(bytes);
}

/// `CREATE_QP` (272 bytes): RC, no receive queue, 2^6 send WQEBBs at offset 0x1000 of the
/// umem, doorbell record at 0x8010.
fn create_qp_image(f: &Fixture, send_cqn: u32) -> Vec<u8> {
    let mut img = vec![0u8; 272];
    patch(&mut img, 0x00, &[0x05, 0x00]); // opcode 0x500
    patch(&mut img, 0x1a, &[0x18]); // qpc.pm_state = 3 (bits 0x13..0x15)
    patch(&mut img, 0x1d, &be24(f.pd.pdn().unwrap())); // qpc.pd (bit 0x28)
    patch(&mut img, 0x22, &[6 << 3]); // qpc.log_sq_size = 6 (bits 0x51..0x55)
    patch(&mut img, 0x25, &be24(f.uar.page_id())); // qpc.uar_page (bit 0x68)
    patch(&mut img, 0x95, &be24(send_cqn)); // qpc.cqn_snd (bit 0x3e8)
    patch(&mut img, 0xb5, &be24(f.cq.cqn())); // qpc.cqn_rcv (bit 0x4e8)
    patch(&mut img, 0xb8, &0x8010u64.to_be_bytes()); // qpc.dbr_addr (bit 0x500)
    patch(&mut img, 0xc4, &[0x03]); // qpc.rq_type = zero-length (bits 0x565..0x568)
    patch(&mut img, 0xe8, &[0x10]); // qpc.dbr_umem_valid (bit 0x683)
    patch(&mut img, 0xfc, &f.umem.id().to_be_bytes()); // qpc.dbr_umem_id (bit 0x720)
    patch(&mut img, 0x100, &0x1000u64.to_be_bytes()); // wq_umem_offset (bit 0x800)
    patch(&mut img, 0x108, &f.umem.id().to_be_bytes()); // wq_umem_id (bit 0x840)
    patch(&mut img, 0x10c, &[0x80]); // wq_umem_valid (bit 0x860)
    img
}

/// `RST2INIT_QP` (272 bytes) on `qpn`: port 1, the given rre/rwe/rae byte and atomic mode.
fn rst2init_image(qpn: u32, rights: u8, atomic_mode: u8) -> Vec<u8> {
    let mut img = vec![0u8; 272];
    patch(&mut img, 0x00, &[0x05, 0x02]); // opcode 0x502
    patch(&mut img, 0x09, &be24(qpn)); // qpn (bit 0x48)
    patch(&mut img, 0x55, &[1]); // qpc.primary_address_path.vhca_port_num (ads bit 0x128)
    patch(&mut img, 0xa9, &[atomic_mode]); // qpc.atomic_mode (bits 0x48c..0x490)
    patch(&mut img, 0xaa, &[rights]); // qpc.rre | rwe | rae (bits 0x490..0x493)
    img
}

/// `QUERY_QP` (16 bytes).
fn query_qp_image(qpn: u32) -> Vec<u8> {
    let mut img = vec![0u8; 16];
    patch(&mut img, 0x00, &[0x05, 0x0b]);
    patch(&mut img, 0x09, &be24(qpn));
    img
}

/// `CREATE_CQ` (272 bytes): 2^`log_size` 64-byte CQEs at offset 0x2000, doorbell record at
/// 0x8020, collapsed and ignoring overrun, events to EQ `eqn`.
fn create_cq_image(f: &Fixture, log_size: u8, eqn: u32) -> Vec<u8> {
    let mut img = vec![0u8; 272];
    patch(&mut img, 0x00, &[0x04, 0x00]); // opcode 0x400
    patch(&mut img, 0x10, &[0x02, 0x12]); // cqc.dbr_umem_valid (bit 6) | cc (0xb) | oi (0xe)
    patch(&mut img, 0x14, &f.umem.id().to_be_bytes()); // cqc.dbr_umem_id (bit 0x20)
    patch(&mut img, 0x1c, &[log_size]); // cqc.log_cq_size (bits 0x63..0x68)
    patch(&mut img, 0x1d, &be24(f.uar.page_id())); // cqc.uar_page (bit 0x68)
    patch(&mut img, 0x24, &eqn.to_be_bytes()); // cqc.c_eqn (dword at bit 0xa0)
    patch(&mut img, 0x48, &0x8020u64.to_be_bytes()); // cqc.dbr_addr (bit 0x1c0)
    patch(&mut img, 0x50, &0x2000u64.to_be_bytes()); // cq_umem_offset (bit 0x280)
    patch(&mut img, 0x58, &f.umem.id().to_be_bytes()); // cq_umem_id (bit 0x2c0)
    patch(&mut img, 0x5c, &[0x80]); // cq_umem_valid (bit 0x2e0)
    img
}

/// The status byte and syndrome of an output mailbox.
fn mailbox(out: &[u8]) -> (u8, u32) {
    (out[0], u32::from_be_bytes([out[4], out[5], out[6], out[7]]))
}

fn assert_refused(r: Result<(), VerbsError>, out: &[u8], want: (u8, u32)) {
    let e = r.expect_err("the firmware accepted the command");
    assert_eq!(e.errno(), Some(121), "EREMOTEIO with the mailbox: {e}");
    assert_eq!(
        mailbox(out),
        want,
        "status and syndrome in the output mailbox"
    );
}

fn create(f: &Fixture, img: &[u8]) -> (Result<Box<dyn DriverObj>, VerbsError>, Vec<u8>) {
    let mut out = vec![0xeeu8; 16];
    let r = f.ctx.driver().devx_obj_create(img, &mut out);
    (r, out)
}

#[test]
fn a_qp_naming_a_cq_that_does_not_exist_is_refused() {
    let subnet = EmuSubnet::new();
    let f = fixture(&subnet, "emu_0");
    let (r, out) = create(&f, &create_qp_image(&f, 0x00_7fff));
    assert_refused(
        r.map(|_| ()),
        &out,
        (status::BAD_RESOURCE, syndrome::NO_SUCH_SEND_CQ),
    );
    assert_eq!(out[0], 0x05, "BAD_RESOURCE");
    assert_eq!(&out[4..8], &[0xe0, 0x00, 0x02, 0x01]);
    // The same image naming the real CQ is accepted, and the QPN is in the mailbox.
    let (r, out) = create(&f, &create_qp_image(&f, f.cq.cqn()));
    let _qp = r.unwrap();
    assert_eq!(mailbox(&out), (0, 0));
    let qpn = u32::from_be_bytes([0, out[9], out[10], out[11]]);
    assert_ne!(qpn, 0, "create_qp_out.qpn (bit 0x48)");
}

#[test]
fn an_atomic_mode_the_device_does_not_grant_is_refused() {
    let subnet = EmuSubnet::new();
    let f = fixture(&subnet, "emu_0");
    let (r, out) = create(&f, &create_qp_image(&f, f.cq.cqn()));
    let qp = r.unwrap();
    let qpn = u32::from_be_bytes([0, out[9], out[10], out[11]]);

    // rre | rwe | rae with atomic_mode 4 (operands up to 16 bytes): beyond the device's 8.
    let mut out = vec![0u8; 16];
    let r = qp.modify(&rst2init_image(qpn, 0xe0, 0x4), &mut out);
    assert_refused(r, &out, (status::BAD_PARAM, syndrome::ATOMIC_MODE));
    // Still in RESET: QUERY_QP says so (qpc.state, the top nibble of qpc byte 0).
    let mut q = vec![0u8; 272];
    qp.query(&query_qp_image(qpn), &mut q).unwrap();
    assert_eq!(q[0x18] >> 4, 0, "RST");

    // atomic_mode 3 (up to 8 bytes) is granted.
    qp.modify(&rst2init_image(qpn, 0xe0, 0x3), &mut out)
        .unwrap();
    assert_eq!(mailbox(&out), (0, 0));
    qp.query(&query_qp_image(qpn), &mut q).unwrap();
    assert_eq!(q[0x18] >> 4, 1, "INIT");
    assert_eq!(q[0x18 + 0x91] & 0x0f, 3, "qpc.atomic_mode");
    assert_eq!(q[0x18 + 0x92] & 0xe0, 0xe0, "rre rwe rae");
    assert_eq!(q[0x18 + 0x18 + 0x25], 1, "primary path port");
    assert_eq!(
        &q[0x18 + 0x7d..0x18 + 0x80],
        &be24(f.cq.cqn()),
        "qpc.cqn_snd"
    );

    // The transition leaves from RESET only.
    let r = qp.modify(&rst2init_image(qpn, 0xe0, 0x3), &mut out);
    assert_refused(r, &out, (status::BAD_QP_STATE, syndrome::QP_STATE));
    // And names the object it is sent to.
    let r = qp.modify(&rst2init_image(qpn + 1, 0xe0, 0x3), &mut out);
    assert_refused(r, &out, (status::BAD_PARAM, syndrome::WRONG_OBJECT));
}

#[test]
fn cq_images_are_decoded_from_the_prm_offsets() {
    let subnet = EmuSubnet::new();
    let f = fixture(&subnet, "emu_0");
    let eqn = f.ctx.eqn(0).unwrap();
    let (r, out) = create(&f, &create_cq_image(&f, 23, eqn));
    assert_refused(
        r.map(|_| ()),
        &out,
        (status::BAD_PARAM, syndrome::CQ_TOO_LARGE),
    );
    let (r, out) = create(&f, &create_cq_image(&f, 5, 0x99));
    assert_refused(
        r.map(|_| ()),
        &out,
        (status::BAD_RESOURCE, syndrome::NO_SUCH_EQ),
    );
    let mut bad_umem = create_cq_image(&f, 5, eqn);
    patch(&mut bad_umem, 0x58, &0x7777u32.to_be_bytes());
    let (r, out) = create(&f, &bad_umem);
    assert_refused(
        r.map(|_| ()),
        &out,
        (status::BAD_RESOURCE, syndrome::NO_SUCH_UMEM),
    );
    let mut too_far = create_cq_image(&f, 5, eqn);
    patch(&mut too_far, 0x50, &0xf800u64.to_be_bytes()); // 2 KiB ring past the 64 KiB umem
    let (r, out) = create(&f, &too_far);
    assert_refused(
        r.map(|_| ()),
        &out,
        (status::BAD_PARAM, syndrome::UMEM_RANGE),
    );

    let (r, out) = create(&f, &create_cq_image(&f, 5, eqn));
    let cq = r.unwrap();
    let cqn = u32::from_be_bytes([0, out[9], out[10], out[11]]);
    // QUERY_CQ gives the context back at the same offsets (cq_context at byte 0x10).
    let mut q = vec![0u8; 0x50];
    let mut query = vec![0u8; 16];
    patch(&mut query, 0, &[0x04, 0x02]);
    patch(&mut query, 9, &be24(cqn));
    cq.query(&query, &mut q).unwrap();
    assert_eq!(q[0x10] & 0x02, 0x02, "dbr_umem_valid");
    assert_eq!(q[0x11] & 0x12, 0x12, "cc and oi");
    assert_eq!(q[0x1c] & 0x1f, 5, "log_cq_size");
    assert_eq!(&q[0x1d..0x20], &be24(f.uar.page_id()), "uar_page");
    assert_eq!(&q[0x24..0x28], &eqn.to_be_bytes(), "c_eqn");
    assert_eq!(&q[0x48..0x50], &0x8020u64.to_be_bytes(), "dbr_addr");
}

#[test]
fn malformed_commands_get_the_matching_status() {
    let subnet = EmuSubnet::new();
    let f = fixture(&subnet, "emu_0");
    // An opcode the firmware does not implement.
    let mut img = vec![0u8; 16];
    patch(&mut img, 0, &[0x09, 0x99]);
    let mut out = vec![0u8; 16];
    let r = f.ctx.driver().devx_general_cmd(&img, &mut out);
    assert_refused(r, &out, (status::BAD_OP, syndrome::UNKNOWN_OPCODE));
    // A CREATE_QP cut short.
    let (r, out) = create(&f, &create_qp_image(&f, f.cq.cqn())[..100]);
    assert_refused(
        r.map(|_| ()),
        &out,
        (status::BAD_INPUT_LEN, syndrome::SHORT_INPUT),
    );
    // QUERY_HCA_CAP of a capability page the device lacks (type 5, current).
    let mut img = vec![0u8; 16];
    patch(&mut img, 0, &[0x01, 0x00]);
    patch(&mut img, 6, &[0x00, 0x0b]);
    let mut out = vec![0u8; 16 + 4096];
    let r = f.ctx.driver().devx_general_cmd(&img, &mut out);
    assert_refused(r, &out, (status::BAD_PARAM, syndrome::UNKNOWN_CAP_TYPE));
}

#[test]
fn capability_pages_sit_at_their_prm_offsets() {
    let subnet = EmuSubnet::new();
    let f = fixture(&subnet, "emu_0");
    let query = |op_mod: u8| {
        let mut img = vec![0u8; 16];
        patch(&mut img, 0, &[0x01, 0x00]);
        patch(&mut img, 7, &[op_mod]);
        let mut out = vec![0u8; 16 + 4096];
        f.ctx.driver().devx_general_cmd(&img, &mut out).unwrap();
        out
    };
    let g = query(0x01);
    let page = &g[0x10..];
    assert_eq!(page[0x88 / 8], 15, "log_max_qp_sz (bit 0x88)");
    assert_eq!(page[0xc8 / 8], 22, "log_max_cq_sz (bit 0xc8)");
    assert_eq!(
        page[0x1c0 / 8] & 0x1f,
        31,
        "log_max_msg (bits 0x1c3..0x1c8)"
    );
    assert_eq!(page[0x218 / 8] & 0x02, 0x02, "atomic (bit 0x21e)");
    assert_eq!(page[0x220 / 8] & 0x80, 0x80, "cq_oi (bit 0x220)");
    assert_eq!(page[0x238 / 8] & 0x01, 0x01, "rc (bit 0x23f)");
    let a = query(0x07);
    let page = &a[0x10..];
    assert_eq!(
        &page[0x12..0x14],
        &[0x00, 0x0f],
        "atomic_operations (bit 0x90)"
    );
    assert_eq!(
        &page[0x16..0x18],
        &[0x00, 0x0c],
        "atomic_size_qp: 4 and 8 bytes (bit 0xb0)"
    );
}

#[test]
fn error_and_reset_transitions_move_the_qp_from_any_state() {
    let subnet = EmuSubnet::new();
    let f = fixture(&subnet, "emu_0");
    let (r, out) = create(&f, &create_qp_image(&f, f.cq.cqn()));
    let qp = r.unwrap();
    let qpn = u32::from_be_bytes([0, out[9], out[10], out[11]]);
    let state = |qp: &dyn DriverObj| {
        let mut q = vec![0u8; 272];
        qp.query(&query_qp_image(qpn), &mut q).unwrap();
        q[0x18] >> 4
    };
    let short = |op: [u8; 2]| {
        let mut img = vec![0u8; 16];
        patch(&mut img, 0, &op);
        patch(&mut img, 9, &be24(qpn));
        img
    };
    let mut out = vec![0u8; 16];
    qp.modify(&rst2init_image(qpn, 0x40, 0), &mut out).unwrap();
    assert_eq!(state(&*qp), 1, "INIT");
    qp.modify(&short([0x05, 0x07]), &mut out).unwrap(); // 2ERR_QP (0x507)
    assert_eq!(state(&*qp), 6, "ERR");
    qp.modify(&short([0x05, 0x0a]), &mut out).unwrap(); // 2RST_QP (0x50a)
    assert_eq!(state(&*qp), 0, "RST");
    // From RESET the QP starts over.
    qp.modify(&rst2init_image(qpn, 0x40, 0), &mut out).unwrap();
    assert_eq!(state(&*qp), 1, "INIT again");
}
