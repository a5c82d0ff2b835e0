//! Shared by the integration tests: the C entry points of the test shims (`golden/`), random
//! inputs for every WQE kind, and the three ways to build a WQE from one (our Rust builders,
//! rdma-core's setters, our CUDA headers compiled for the host).

#![allow(dead_code)]

use ibgda_device::wire::*;
use proptest::prelude::*;

/// A gather entry as `ibgda_sge` lays it out.
#[repr(C)]
pub struct HdrSge {
    pub addr: u64,
    pub lkey: u32,
    pub len: u32,
}

/// `ibgda_layout_entry` of `golden/host_headers.cpp`.
#[repr(C)]
pub struct LayoutEntry {
    pub kind: *const std::ffi::c_char,
    pub c_name: *const std::ffi::c_char,
    pub field: *const std::ffi::c_char,
    pub a: u64,
    pub b: u64,
}

/// `golden_entry` of `golden/mlx5_golden.c`.
#[repr(C)]
pub struct GoldenEntry {
    pub name: *const std::ffi::c_char,
    pub value: u64,
}

extern "C" {
    // golden/mlx5_golden.c: rdma-core's setters and structs.
    pub fn golden_ctrl_seg(
        out: *mut u8,
        pi: u16,
        opcode: u8,
        opmod: u8,
        qpn: u32,
        fm_ce_se: u8,
        ds: u8,
        signature: u8,
        imm: u32,
    );
    pub fn golden_ctrl_seg_x86(
        out: *mut u8,
        pi: u16,
        opcode: u8,
        opmod: u8,
        qpn: u32,
        fm_ce_se: u8,
        ds: u8,
        signature: u8,
        imm: u32,
    ) -> i32;
    pub fn golden_data_seg(out: *mut u8, len: u32, lkey: u32, addr: u64);
    pub fn golden_data_seg_x86(out: *mut u8, len: u32, lkey: u32, addr: u64) -> i32;
    pub fn golden_raddr_seg(out: *mut u8, raddr: u64, rkey: u32);
    pub fn golden_atomic_seg(out: *mut u8, swap_add: u64, compare: u64);
    pub fn golden_inline_seg(out: *mut u8, len: u32);
    pub fn golden_wqe_nop(out: *mut u8, qpn: u32, idx: u16, fm_ce_se: u8);
    pub fn golden_wqe_rdma_write(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        nsge: u32,
        addrs: *const u64,
        lkeys: *const u32,
        lens: *const u32,
        with_imm: i32,
        imm: u32,
    );
    pub fn golden_wqe_inline_write(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        data: *const u8,
        len: u32,
        with_imm: i32,
        imm: u32,
    );
    pub fn golden_wqe_fetch_add64(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        add: u64,
    );
    pub fn golden_wqe_compare_swap64(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        swap: u64,
        compare: u64,
    );
    pub fn golden_wqe_masked_fetch_add32(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        add: u32,
        boundary: u32,
    );
    pub fn golden_wqe_masked_compare_swap32(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        swap: u32,
        compare: u32,
        swap_mask: u32,
        compare_mask: u32,
    );
    pub fn golden_wqe_masked_fetch_add64(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        add: u64,
        boundary: u64,
    );
    pub fn golden_cqe_requester(
        out: *mut u8,
        owner: u8,
        wqe_counter: u16,
        qpn: u32,
        wqe_opcode: u8,
        byte_cnt: u32,
    );
    pub fn golden_cqe_requester_error(
        out: *mut u8,
        owner: u8,
        wqe_counter: u16,
        qpn: u32,
        wqe_opcode: u8,
        syndrome: u8,
        vendor_syndrome: u8,
    );
    pub fn golden_cqe_read(
        cqe: *const u8,
        owner: *mut u8,
        opcode: *mut u8,
        wqe_counter: *mut u16,
        syndrome: *mut u8,
        vendor_syndrome: *mut u8,
        qpn: *mut u32,
    );
    pub static golden_table: [GoldenEntry; 0];
    pub static golden_table_len: usize;

    // golden/host_headers.cpp: our CUDA headers on the host.
    pub fn hdr_fm_ce_se(fence_mode: u32, cqe: bool) -> u8;
    pub fn hdr_wqe_nop(out: *mut u8, qpn: u32, idx: u16, fm_ce_se: u8);
    pub fn hdr_wqe_rdma_write(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        len: u32,
    );
    pub fn hdr_wqe_rdma_write_imm(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        len: u32,
        imm: u32,
    );
    pub fn hdr_wqe_rdma_write_gather(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        sges: *const HdrSge,
        nsge: u32,
        with_imm: bool,
        imm: u32,
    );
    pub fn hdr_wqe_inline_write(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        data: *const u8,
        len: u32,
        with_imm: bool,
        imm: u32,
    );
    pub fn hdr_wqe_fetch_add64(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        add: u64,
    );
    pub fn hdr_wqe_compare_swap64(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        swap: u64,
        compare: u64,
    );
    pub fn hdr_wqe_masked_fetch_add32(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        add: u32,
        boundary: u32,
    );
    pub fn hdr_wqe_masked_compare_swap32(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        swap: u32,
        compare: u32,
        swap_mask: u32,
        compare_mask: u32,
    );
    pub fn hdr_wqe_masked_fetch_add64(
        out: *mut u8,
        qpn: u32,
        idx: u16,
        fm_ce_se: u8,
        raddr: u64,
        rkey: u32,
        laddr: u64,
        lkey: u32,
        add: u64,
        boundary: u64,
    );
    pub fn hdr_cqe_poll(cqe: *const u8, cons_idx: u64, ncqes: u32, out: *mut CqeStatus);
    pub fn hdr_wqe_index_from_counter(counter: u16, frontier: u64) -> u64;
    pub fn hdr_db_word(qpn: u32, pi: u64) -> u64;
    pub fn hdr_wait_bound_ns(timeout_ns: u64) -> u64;
    pub fn hdr_dbr_send_word(pi: u64) -> u32;
    pub static ibgda_layout_table: [LayoutEntry; 0];
    pub static ibgda_layout_table_len: usize;
}

/// Every WQE kind the builders make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Nop,
    Write,
    WriteGather,
    Inline,
    FetchAdd64,
    CompareSwap64,
    MaskedFetchAdd32,
    MaskedCompareSwap32,
    MaskedFetchAdd64,
}

pub const KINDS: [Kind; 9] = [
    Kind::Nop,
    Kind::Write,
    Kind::WriteGather,
    Kind::Inline,
    Kind::FetchAdd64,
    Kind::CompareSwap64,
    Kind::MaskedFetchAdd32,
    Kind::MaskedCompareSwap32,
    Kind::MaskedFetchAdd64,
];

/// The inputs of one WQE of any kind.
#[derive(Clone, Debug)]
pub struct Input {
    pub qpn: u32,
    /// The monotonic 64-bit WQEBB counter: builders take its low 16 bits.
    pub counter: u64,
    pub fence: FenceMode,
    pub cqe: bool,
    pub imm: Option<u32>,
    pub remote: RemoteAddr,
    pub sges: [Sge; 2],
    pub fetch: LocalAddr,
    pub inline: Vec<u8>,
    pub a64: u64,
    pub b64: u64,
    pub a32: u32,
    pub b32: u32,
    pub c32: u32,
    pub d32: u32,
}

impl Input {
    pub fn index(&self) -> u16 {
        self.counter as u16
    }

    pub fn flags(&self) -> u8 {
        fm_ce_se(self.fence, self.cqe)
    }
}

fn fence() -> impl Strategy<Value = FenceMode> {
    prop_oneof![
        Just(FenceMode::None),
        Just(FenceMode::InitiatorSmall),
        Just(FenceMode::Fence),
        Just(FenceMode::StrongOrdering),
        Just(FenceMode::SmallAndFence),
    ]
}

/// A gather entry: lengths below 2^31 (bit 31 of a byte count marks an inline segment).
fn sge() -> impl Strategy<Value = Sge> {
    (any::<u64>(), 0u32..1 << 31, any::<u32>()).prop_map(|(addr, len, lkey)| Sge {
        addr,
        len,
        lkey,
    })
}

/// Proptest settings of these tests: many cases, no regression files written into the tree.
pub fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Random inputs: 24-bit QPNs, 64-bit counters (so indices wrap at 16 bits), any keys,
/// addresses, lengths (below 2^31) and operands, inline payloads of 0..=28 bytes.
pub fn input() -> impl Strategy<Value = Input> {
    let head = (
        0u32..1 << 24,
        any::<u64>(),
        fence(),
        any::<bool>(),
        proptest::option::of(any::<u32>()),
    );
    let bufs = (
        any::<u64>(),
        any::<u32>(),
        sge(),
        sge(),
        any::<u64>(),
        any::<u32>(),
        proptest::collection::vec(any::<u8>(), 0..=INLINE_MAX_ONE_BB),
    );
    let ops = (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
    );
    (head, bufs, ops).prop_map(
        |(
            (qpn, counter, fence, cqe, imm),
            (raddr, rkey, s0, s1, laddr, lkey, inline),
            (a64, b64, a32, b32, c32, d32),
        )| {
            Input {
                qpn,
                counter,
                fence,
                cqe,
                imm,
                remote: RemoteAddr { addr: raddr, rkey },
                sges: [s0, s1],
                fetch: LocalAddr { addr: laddr, lkey },
                inline,
                a64,
                b64,
                a32,
                b32,
                c32,
                d32,
            }
        },
    )
}

/// The WQE from our Rust builders.
pub fn rust_wqe(kind: Kind, i: &Input) -> WqeBB {
    let (q, x, r, f) = (i.qpn, i.index(), i.remote, i.fetch);
    macro_rules! flags {
        ($b:expr) => {
            $b.fence(i.fence).cqe(i.cqe)
        };
    }
    match kind {
        Kind::Nop => flags!(Nop::new(q, x)).build(),
        Kind::Write | Kind::WriteGather => {
            let w = if kind == Kind::Write {
                RdmaWrite::new(q, x, r, i.sges[0])
            } else {
                RdmaWrite::new_gather(q, x, r, i.sges)
            };
            let w = flags!(w);
            match i.imm {
                Some(imm) => w.imm(imm).build(),
                None => w.build(),
            }
        }
        Kind::Inline => {
            let w = flags!(InlineWrite::new(q, x, r, &i.inline));
            match i.imm {
                Some(imm) => w.imm(imm).build(),
                None => w.build(),
            }
        }
        Kind::FetchAdd64 => flags!(FetchAdd64::new(q, x, r, f, i.a64)).build(),
        Kind::CompareSwap64 => flags!(CompareSwap64::new(q, x, r, f, i.a64, i.b64)).build(),
        Kind::MaskedFetchAdd32 => flags!(MaskedFetchAdd32::new(q, x, r, f, i.a32))
            .field_boundary(i.b32)
            .build(),
        Kind::MaskedCompareSwap32 => flags!(MaskedCompareSwap32::new(q, x, r, f, i.a32, i.b32))
            .masks(i.c32, i.d32)
            .build(),
        Kind::MaskedFetchAdd64 => flags!(MaskedFetchAdd64::new(q, x, r, f, i.a64))
            .field_boundary(i.b64)
            .build(),
    }
}

/// The WQE composed with rdma-core's setters and structs.
pub fn golden_wqe(kind: Kind, i: &Input) -> [u8; 64] {
    let mut out = [0x5au8; 64];
    let o = out.as_mut_ptr();
    let (q, x, fl, ra, rk, la, lk) = (
        i.qpn,
        i.index(),
        i.flags(),
        i.remote.addr,
        i.remote.rkey,
        i.fetch.addr,
        i.fetch.lkey,
    );
    let addrs = [i.sges[0].addr, i.sges[1].addr];
    let lkeys = [i.sges[0].lkey, i.sges[1].lkey];
    let lens = [i.sges[0].len, i.sges[1].len];
    let (with_imm, imm) = (i.imm.is_some() as i32, i.imm.unwrap_or(0));
    // SAFETY: every shim function writes exactly 64 bytes to `out`, and reads only the arrays
    // passed with their lengths (2 gather entries; `i.inline.len()` inline bytes).
    unsafe {
        match kind {
            Kind::Nop => golden_wqe_nop(o, q, x, fl),
            Kind::Write | Kind::WriteGather => {
                let n = if kind == Kind::Write { 1 } else { 2 };
                golden_wqe_rdma_write(
                    o,
                    q,
                    x,
                    fl,
                    ra,
                    rk,
                    n,
                    addrs.as_ptr(),
                    lkeys.as_ptr(),
                    lens.as_ptr(),
                    with_imm,
                    imm,
                )
            }
            Kind::Inline => golden_wqe_inline_write(
                o,
                q,
                x,
                fl,
                ra,
                rk,
                i.inline.as_ptr(),
                i.inline.len() as u32,
                with_imm,
                imm,
            ),
            Kind::FetchAdd64 => golden_wqe_fetch_add64(o, q, x, fl, ra, rk, la, lk, i.a64),
            Kind::CompareSwap64 => {
                golden_wqe_compare_swap64(o, q, x, fl, ra, rk, la, lk, i.a64, i.b64)
            }
            Kind::MaskedFetchAdd32 => {
                golden_wqe_masked_fetch_add32(o, q, x, fl, ra, rk, la, lk, i.a32, i.b32)
            }
            Kind::MaskedCompareSwap32 => golden_wqe_masked_compare_swap32(
                o, q, x, fl, ra, rk, la, lk, i.a32, i.b32, i.c32, i.d32,
            ),
            Kind::MaskedFetchAdd64 => {
                golden_wqe_masked_fetch_add64(o, q, x, fl, ra, rk, la, lk, i.a64, i.b64)
            }
        }
    }
    out
}

/// The WQE from our CUDA headers' builders, compiled for the host.
pub fn header_wqe(kind: Kind, i: &Input) -> [u8; 64] {
    let mut out = [0xa5u8; 64];
    let o = out.as_mut_ptr();
    let (q, x, fl, ra, rk, la, lk) = (
        i.qpn,
        i.index(),
        i.flags(),
        i.remote.addr,
        i.remote.rkey,
        i.fetch.addr,
        i.fetch.lkey,
    );
    let s = &i.sges;
    let sges = [
        HdrSge {
            addr: s[0].addr,
            lkey: s[0].lkey,
            len: s[0].len,
        },
        HdrSge {
            addr: s[1].addr,
            lkey: s[1].lkey,
            len: s[1].len,
        },
    ];
    let (with_imm, imm) = (i.imm.is_some(), i.imm.unwrap_or(0));
    // SAFETY: every shim function writes exactly 64 bytes to `out`, and reads only the arrays
    // passed with their lengths (`nsge` gather entries; `i.inline.len()` inline bytes).
    unsafe {
        match kind {
            Kind::Nop => hdr_wqe_nop(o, q, x, fl),
            Kind::Write => match i.imm {
                Some(imm) => {
                    hdr_wqe_rdma_write_imm(o, q, x, fl, ra, rk, s[0].addr, s[0].lkey, s[0].len, imm)
                }
                None => hdr_wqe_rdma_write(o, q, x, fl, ra, rk, s[0].addr, s[0].lkey, s[0].len),
            },
            Kind::WriteGather => {
                hdr_wqe_rdma_write_gather(o, q, x, fl, ra, rk, sges.as_ptr(), 2, with_imm, imm)
            }
            Kind::Inline => hdr_wqe_inline_write(
                o,
                q,
                x,
                fl,
                ra,
                rk,
                i.inline.as_ptr(),
                i.inline.len() as u32,
                with_imm,
                imm,
            ),
            Kind::FetchAdd64 => hdr_wqe_fetch_add64(o, q, x, fl, ra, rk, la, lk, i.a64),
            Kind::CompareSwap64 => {
                hdr_wqe_compare_swap64(o, q, x, fl, ra, rk, la, lk, i.a64, i.b64)
            }
            Kind::MaskedFetchAdd32 => {
                hdr_wqe_masked_fetch_add32(o, q, x, fl, ra, rk, la, lk, i.a32, i.b32)
            }
            Kind::MaskedCompareSwap32 => hdr_wqe_masked_compare_swap32(
                o, q, x, fl, ra, rk, la, lk, i.a32, i.b32, i.c32, i.d32,
            ),
            Kind::MaskedFetchAdd64 => {
                hdr_wqe_masked_fetch_add64(o, q, x, fl, ra, rk, la, lk, i.a64, i.b64)
            }
        }
    }
    out
}

/// A readable account of where two WQEs differ.
pub fn diff(kind: Kind, i: &Input, ours: &WqeBB, theirs: &[u8; 64]) -> String {
    let bytes: Vec<String> = (0..64)
        .filter(|&k| ours.0[k] != theirs[k])
        .map(|k| format!("[{k}] {:#04x} vs {:#04x}", ours.0[k], theirs[k]))
        .collect();
    format!(
        "{kind:?} differs at {}\ninput: {i:?}\nours:\n{ours}",
        bytes.join(", ")
    )
}
