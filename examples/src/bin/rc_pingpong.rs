//! `rc_pingpong`: an RC ping-pong between two processes over a real ConnectX NIC, built only from
//! this project's DEVX resources (ibgda-verbs): the CQ ring, work queue and both doorbell records
//! live in host memory registered as umem, the CPU writes the WQEs (RDMA WRITE) and rings the
//! doorbell through the UAR, and completions are read from a collapsed CQ. It is the bring-up
//! check for `ibgda-verbs` on new hardware: if this runs, CQ/QP creation, the RST→INIT→RTR→RTS
//! commands and the UAR doorbell are right.
//!
//! **Never run**: the project's machines have no RDMA NIC. Expect it to be the first thing that
//! meets real firmware.
//!
//! ```text
//! server:  rc_pingpong [--device mlx5_0] [--ib-port 1] [--gid-index N] [--tcp-port 18515] [--iters 1000]
//! client:  rc_pingpong SERVER_HOST [same options]
//! ```
//!
//! Each iteration the client RDMA-writes the iteration number into the server's inbox, the server
//! sees it and writes it back into the client's inbox; the client reports the mean round trip.
//! Every wait has a time bound and reports what it was waiting for.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use ibgda_verbs::{
    list_devices, no_device_hint, preferred_roce_gid, random_psn, Access, ConnectInfo, Context,
    CqBuilder, InitAttrs, MemoryRegion, ProtectionDomain, QpBuilder, RtrAttrs, RtsAttrs, Uar, Umem,
};

const USAGE: &str = "usage: rc_pingpong [SERVER_HOST] [--device NAME] [--ib-port N] [--gid-index N] \
                     [--tcp-port N] [--iters N]\n  without SERVER_HOST: wait for a client; with it: connect";

/// mlx5 opcodes and flags used here (the wire format proper lives in ibgda-device).
const OPCODE_RDMA_WRITE: u32 = 0x08;
const CTRL_CQE_ALWAYS: u8 = 0x08;
const CQE_OPCODE_INVALID: u8 = 0xf;
const CQE_OPCODE_REQ_ERROR: u8 = 0xd;

/// Layout of the control pages (all host memory, one umem).
const CQ_RING: u64 = 0x0000; // one 64-byte CQE (collapsed CQ), 4 KiB aligned
const SQ_RING: u64 = 0x1000; // 64 WQEBBs
const LOG_SQ: u8 = 6;
const CQ_DBR: u64 = 0x2000;
const QP_DBR: u64 = 0x2040;
const CTRL_BYTES: usize = 0x3000;

/// Layout of the data page (registered as an MR for remote writes).
const INBOX: usize = 0;
const OUTBOX: usize = 64;
const DATA_BYTES: usize = 4096;

const WAIT: Duration = Duration::from_secs(5);

struct Options {
    server: Option<String>,
    device: Option<String>,
    ib_port: u8,
    gid_index: Option<u32>,
    tcp_port: u16,
    iters: u64,
}

fn parse_args() -> Result<Options> {
    let mut o = Options {
        server: None,
        device: None,
        ib_port: 1,
        gid_index: None,
        tcp_port: 18515,
        iters: 1000,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--device" => o.device = Some(value("--device")?),
            "--ib-port" => o.ib_port = value("--ib-port")?.parse()?,
            "--gid-index" => o.gid_index = Some(value("--gid-index")?.parse()?),
            "--tcp-port" => o.tcp_port = value("--tcp-port")?.parse()?,
            "--iters" => o.iters = value("--iters")?.parse()?,
            s if s.starts_with('-') => bail!("unknown option {s}\n{USAGE}"),
            s => o.server = Some(s.to_string()),
        }
    }
    ensure!(o.iters > 0, "--iters must be at least 1");
    Ok(o)
}

/// Zeroed, page-aligned host memory; outlives the registrations declared after it.
struct Pages {
    ptr: *mut u8,
    layout: Layout,
}

impl Pages {
    fn new(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len, 4096)?;
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        ensure!(!ptr.is_null(), "out of memory");
        Ok(Self { ptr, layout })
    }

    fn at(&self, off: u64) -> *mut u8 {
        assert!((off as usize) < self.layout.size());
        self.ptr.wrapping_add(off as usize)
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the umem/MR over it were dropped first.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn write_be32(p: *mut u8, v: u32) {
    // SAFETY: callers pass pointers inside our own pages; unaligned is fine for bytes.
    unsafe { std::ptr::copy_nonoverlapping(v.to_be_bytes().as_ptr(), p, 4) }
}

fn write_be64(p: *mut u8, v: u64) {
    // SAFETY: as `write_be32`.
    unsafe { std::ptr::copy_nonoverlapping(v.to_be_bytes().as_ptr(), p, 8) }
}

/// What each side sends the other over TCP: the QP's connect record and its inbox.
struct Peer {
    info: ConnectInfo,
    inbox_addr: u64,
    rkey: u32,
}

impl Peer {
    const LEN: usize = ConnectInfo::WIRE_LEN + 12;

    fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..32].copy_from_slice(&self.info.to_bytes());
        b[32..40].copy_from_slice(&self.inbox_addr.to_be_bytes());
        b[40..44].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    fn from_bytes(b: &[u8; Self::LEN]) -> Result<Self> {
        Ok(Self {
            info: ConnectInfo::from_bytes(&b[..32])?,
            inbox_addr: u64::from_be_bytes(b[32..40].try_into()?),
            rkey: u32::from_be_bytes(b[40..44].try_into()?),
        })
    }
}

fn exchange(stream: &mut TcpStream, mine: &Peer) -> Result<Peer> {
    stream.write_all(&mine.to_bytes())?;
    let mut b = [0u8; Peer::LEN];
    stream
        .read_exact(&mut b)
        .context("reading the peer's connect record")?;
    Peer::from_bytes(&b)
}

fn barrier(stream: &mut TcpStream) -> Result<()> {
    stream.write_all(&[1])?;
    let mut b = [0u8; 1];
    stream
        .read_exact(&mut b)
        .context("waiting for the peer at a barrier")?;
    Ok(())
}

/// The send side: posts single-WQEBB RDMA WRITEs and waits for their CQEs.
struct Sender {
    ctrl: Rc<Pages>,
    uar: Arc<Uar>,
    qpn: u32,
    pi: u16,
    completions: u32,
}

impl Sender {
    fn post_write(&mut self, local: u64, lkey: u32, remote: u64, rkey: u32, len: u32) {
        let idx = self.pi;
        let slot = self
            .ctrl
            .at(SQ_RING + u64::from(idx & ((1 << LOG_SQ) - 1)) * 64);
        // SAFETY: one WQEBB inside our SQ page; the NIC reads it only after the doorbell.
        unsafe { std::ptr::write_bytes(slot, 0, 64) };
        // Control segment: opmod 0 | wqe index | opcode; qpn | ds = 3 (ctrl, raddr, data).
        write_be32(slot, (u32::from(idx) << 8) | OPCODE_RDMA_WRITE);
        write_be32(slot.wrapping_add(4), (self.qpn << 8) | 3);
        // SAFETY: byte 11 of the same WQEBB.
        unsafe { slot.add(11).write(CTRL_CQE_ALWAYS) };
        // Remote-address segment.
        write_be64(slot.wrapping_add(16), remote);
        write_be32(slot.wrapping_add(24), rkey);
        // Data segment.
        write_be32(slot.wrapping_add(32), len);
        write_be32(slot.wrapping_add(36), lkey);
        write_be64(slot.wrapping_add(40), local);
        self.pi = self.pi.wrapping_add(1);
        // WQE before doorbell record, record before doorbell.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        write_be32(self.ctrl.at(QP_DBR + 4), u32::from(self.pi));
        let mut first8 = [0u8; 8];
        // SAFETY: the first 8 bytes of the WQE just written.
        unsafe { std::ptr::copy_nonoverlapping(slot, first8.as_mut_ptr(), 8) };
        self.uar.ring_doorbell(first8);
    }

    /// Waits for the CQE of the last posted WQE.
    fn wait_completion(&mut self) -> Result<()> {
        let want = self.pi.wrapping_sub(1);
        let cqe = self.ctrl.at(CQ_RING);
        let start = Instant::now();
        loop {
            // SAFETY: the CQE lies in our CQ page; the NIC writes it, so read it volatile.
            let (op_own, counter, syndrome, vendor) = unsafe {
                let op_own = cqe.add(63).read_volatile();
                let counter =
                    u16::from_be_bytes([cqe.add(60).read_volatile(), cqe.add(61).read_volatile()]);
                (
                    op_own,
                    counter,
                    cqe.add(55).read_volatile(),
                    cqe.add(54).read_volatile(),
                )
            };
            let opcode = op_own >> 4;
            if opcode == CQE_OPCODE_REQ_ERROR {
                bail!("error CQE for WQE {counter}: syndrome {syndrome:#04x}, vendor syndrome {vendor:#04x}");
            }
            if opcode != CQE_OPCODE_INVALID && counter == want {
                self.completions += 1;
                write_be32(self.ctrl.at(CQ_DBR), self.completions & 0xff_ffff);
                return Ok(());
            }
            if start.elapsed() > WAIT {
                bail!(
                    "no completion for WQE {want} after {WAIT:?} (QP {:#x}, producer index {}, last CQE opcode {opcode:#x} counter {counter})",
                    self.qpn,
                    self.pi
                );
            }
            std::hint::spin_loop();
        }
    }
}

fn wait_inbox(data: &Pages, want: u64) -> Result<()> {
    let start = Instant::now();
    loop {
        // SAFETY: the inbox is an aligned u64 in our data page, written by the remote NIC.
        let v = u64::from_le(unsafe { (data.at(INBOX as u64) as *const u64).read_volatile() });
        if v == want {
            return Ok(());
        }
        if start.elapsed() > WAIT {
            bail!(
                "inbox holds {v}, expected {want} after {WAIT:?}: the peer's write never arrived"
            );
        }
        std::hint::spin_loop();
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let o = parse_args()?;
    if list_devices()?.is_empty() {
        eprintln!("rc_pingpong needs a real RDMA NIC: {}", no_device_hint());
        std::process::exit(2);
    }
    let ctx = match &o.device {
        Some(name) => Context::open(name)?,
        None => Context::open_first()?,
    };
    ensure!(
        ctx.has_devx(),
        "{} has no DEVX: {}",
        ctx.name(),
        ctx.devx_unavailable_reason().unwrap_or("?")
    );
    let port = ctx.port(o.ib_port)?;
    let gids = ctx.gids(o.ib_port)?;
    let gid = match o.gid_index {
        Some(i) => Some(
            *gids
                .iter()
                .find(|g| g.index == i)
                .with_context(|| format!("no GID at index {i}"))?,
        ),
        None if port.link_layer.is_roce() => preferred_roce_gid(&gids).copied(),
        None => None,
    };
    println!(
        "{}: port {} {:?} {:?}, lid {}, gid {:?}",
        ctx.name(),
        o.ib_port,
        port.state,
        port.link_layer,
        port.lid,
        gid.map(|g| g.index)
    );

    // Memory first, so it is freed after every registration over it.
    let ctrl = Rc::new(Pages::new(CTRL_BYTES)?);
    let data = Pages::new(DATA_BYTES)?;
    // Every CQE starts owned by hardware and invalid.
    // SAFETY: byte 63 of the CQE in our CQ page, before the NIC knows the page.
    unsafe { ctrl.at(CQ_RING + 63).write(0xf1) };

    let pd = ProtectionDomain::new(&ctx)?;
    let uar = Uar::alloc(&ctx)?;
    // SAFETY: `ctrl` outlives the umem (declared earlier, dropped later) and is reached only
    // through raw pointers.
    let umem = unsafe { Umem::register_host(&ctx, ctrl.ptr, CTRL_BYTES, Access::LOCAL_WRITE)? };
    // SAFETY: as above, for `data`.
    let mr = unsafe { MemoryRegion::register_host(&pd, data.ptr, DATA_BYTES, Access::rdma())? };
    let cq = CqBuilder::new(&uar, umem.at(CQ_RING), umem.at(CQ_DBR), 0)
        .collapsed(true)
        .create()?;
    let qp = QpBuilder::new(
        &pd,
        &uar,
        &cq,
        &cq,
        umem.at(SQ_RING),
        umem.at(QP_DBR),
        LOG_SQ,
    )
    .create()?;
    println!(
        "CQ {:#x}, QP {:#x}, UAR {:?} page {}",
        cq.cqn(),
        qp.qpn(),
        uar.kind(),
        uar.page_id()
    );

    let psn = random_psn();
    let mine = Peer {
        info: qp.connect_info(&port, gid.as_ref(), psn),
        inbox_addr: data.ptr as u64 + INBOX as u64,
        rkey: mr.rkey(),
    };
    let mut stream = match &o.server {
        None => {
            let listener = TcpListener::bind(("0.0.0.0", o.tcp_port))?;
            println!("waiting for a client on TCP port {}", o.tcp_port);
            listener.accept()?.0
        }
        Some(host) => TcpStream::connect((host.as_str(), o.tcp_port))
            .with_context(|| format!("connecting to {host}:{}", o.tcp_port))?,
    };
    let peer = exchange(&mut stream, &mine)?;
    let qp = qp.init(&InitAttrs::new(&ctx, o.ib_port))?;
    let qp = qp.rtr(&peer.info, &RtrAttrs::for_port(&port, gid.as_ref())?)?;
    let qp = qp.rts(&RtsAttrs::new(psn))?;
    barrier(&mut stream)?;
    println!("connected to QP {:#x}", peer.info.qpn);

    let mut sender = Sender {
        ctrl: ctrl.clone(),
        uar: uar.clone(),
        qpn: qp.qpn(),
        pi: 0,
        completions: 0,
    };
    let outbox = data.ptr as u64 + OUTBOX as u64;
    let client = o.server.is_some();
    let start = Instant::now();
    for i in 1..=o.iters {
        if !client {
            wait_inbox(&data, i).with_context(|| format!("iteration {i}"))?;
        }
        // SAFETY: the outbox is an aligned u64 in our data page; the NIC reads it after the post.
        unsafe { (data.at(OUTBOX as u64) as *mut u64).write_volatile(i.to_le()) };
        sender.post_write(outbox, mr.lkey(), peer.inbox_addr, peer.rkey, 8);
        sender
            .wait_completion()
            .with_context(|| format!("iteration {i}"))?;
        if client {
            wait_inbox(&data, i).with_context(|| format!("iteration {i}"))?;
        }
    }
    let elapsed = start.elapsed();
    barrier(&mut stream)?;
    println!(
        "{} iterations, mean round trip {:.2} µs",
        o.iters,
        elapsed.as_secs_f64() * 1e6 / o.iters as f64
    );
    drop(qp);
    drop(cq);
    drop(mr);
    drop(umem);
    Ok(())
}
