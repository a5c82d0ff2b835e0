//! Random streams of valid and invalid WQEs, run by the emulator (host backend) and by a small,
//! straightforward interpreter over two byte vectors. Final memory, the CQE sequence and the QP's
//! error state must agree. A second property feeds arbitrary bytes to the decoder (the CI
//! stand-in for the cargo-fuzz target).

mod common;

use common::{Pair, ARENA};
use ibgda_device::wire::{
    cqe_opcode, opcode, syndrome, CompareSwap64, FetchAdd64, InlineWrite, LocalAddr,
    MaskedCompareSwap32, MaskedFetchAdd32, MaskedFetchAdd64, Nop, RdmaWrite, RemoteAddr, Sge,
    WqeBB,
};
use ibgda_emu::{vendor_syndrome as vs, Access, CqMode, QpState, StrictMode};
use proptest::prelude::*;

/// A reference to memory in an operation: which registration (2 = a key nobody registered) and
/// an offset from its start that may fall outside it.
#[derive(Clone, Copy, Debug)]
struct At {
    sel: u8,
    off: i32,
}

#[derive(Clone, Debug)]
enum Op {
    Nop {
        cqe: bool,
    },
    Write {
        sges: Vec<(At, u16)>,
        dst: At,
        imm: Option<u32>,
        cqe: bool,
    },
    Inline {
        data: Vec<u8>,
        dst: At,
        imm: Option<u32>,
        cqe: bool,
    },
    Atomic {
        kind: u8,
        dst: At,
        fetch: At,
        a: u64,
        b: u64,
        c: u32,
        d: u32,
        cqe: bool,
    },
    Bad {
        opcode: u8,
    },
}

fn at(max_off: i32) -> impl Strategy<Value = At> {
    (prop_oneof![8 => 0u8..2, 1 => Just(2u8)], -8..max_off).prop_map(|(sel, off)| At { sel, off })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => any::<bool>().prop_map(|cqe| Op::Nop { cqe }),
        4 => (
            proptest::collection::vec((at(1100), prop_oneof![20 => 1u16..200, 1 => Just(0u16)]), 1..=2),
            at(1100),
            proptest::option::of(any::<u32>()),
            any::<bool>()
        )
            .prop_map(|(sges, dst, imm, cqe)| Op::Write { sges, dst, imm, cqe }),
        3 => (proptest::collection::vec(any::<u8>(), 0..=28), at(1100), proptest::option::of(any::<u32>()), any::<bool>())
            .prop_map(|(data, dst, imm, cqe)| Op::Inline { data, dst, imm, cqe }),
        4 => (0u8..5, at(80), at(80), any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<bool>())
            .prop_map(|(kind, dst, fetch, a, b, c, d, cqe)| {
                // Mostly aligned targets, so atomics mostly run.
                let dst = if a % 4 == 0 { dst } else { At { off: dst.off & !7, ..dst } };
                Op::Atomic { kind, dst, fetch, a, b, c, d, cqe }
            }),
        1 => prop::sample::select(vec![0x01u8, 0x0a, 0x0b, 0x10, 0x25, 0x0e])
            .prop_map(|opcode| Op::Bad { opcode }),
    ]
}

/// A registration as the model keeps it.
#[derive(Clone, Copy, Debug)]
struct MrM {
    key: u32,
    addr: u64,
    arena_off: usize,
    len: usize,
    access: Access,
}

const BOGUS_KEY: u32 = 0x00ab_cdef;

#[derive(Debug, PartialEq, Eq)]
struct ExpCqe {
    err: bool,
    wqe_counter: u16,
    wqe_opcode: u8,
    syndrome: u8,
    vendor: u8,
    byte_cnt: u32,
}

struct Model {
    local: Vec<u8>,
    remote: Vec<u8>,
    lmrs: [MrM; 2],
    rmrs: [MrM; 2],
    error: bool,
    cqes: Vec<ExpCqe>,
}

enum Check {
    Key,
    Range,
    Right,
}

impl Model {
    /// (key, address) an `At` names.
    fn resolve(mrs: &[MrM; 2], a: At) -> (u32, u64) {
        let base = mrs[0].addr.min(mrs[1].addr);
        match a.sel {
            0 | 1 => {
                let m = mrs[a.sel as usize];
                (m.key, (m.addr as i64 + a.off as i64) as u64)
            }
            _ => (BOGUS_KEY, (base as i64 + a.off as i64) as u64),
        }
    }

    fn find(mrs: &[MrM; 2], key: u32, addr: u64, len: u64, need: Access) -> Result<usize, Check> {
        let m = mrs.iter().find(|m| m.key == key).ok_or(Check::Key)?;
        if addr < m.addr || addr + len > m.addr + m.len as u64 {
            return Err(Check::Range);
        }
        if !m.access.contains(need) {
            return Err(Check::Right);
        }
        Ok(m.arena_off + (addr - m.addr) as usize)
    }

    fn local_fail(c: Check) -> (u8, u8) {
        let v = match c {
            Check::Key => vs::BAD_LKEY,
            Check::Range => vs::LOCAL_RANGE,
            Check::Right => vs::LOCAL_ACCESS,
        };
        (syndrome::LOCAL_PROT_ERR, v)
    }

    fn remote_fail(c: Check) -> (u8, u8) {
        let v = match c {
            Check::Key => vs::BAD_RKEY,
            Check::Range => vs::REMOTE_RANGE,
            Check::Right => vs::REMOTE_ACCESS,
        };
        (syndrome::REMOTE_ACCESS_ERR, v)
    }

    /// Adds `b` to `a` field by field: a set bit of `boundary` is the top bit of a field.
    fn fields_add(a: u64, b: u64, boundary: u64, bits: u32) -> u64 {
        let mut out = 0;
        let mut lo = 0;
        for hi in 0..bits {
            if boundary >> hi & 1 == 1 || hi == bits - 1 {
                let width = hi - lo + 1;
                let mask = if width == 64 {
                    u64::MAX
                } else {
                    (1u64 << width) - 1
                };
                let s = ((a >> lo) & mask).wrapping_add((b >> lo) & mask) & mask;
                out |= s << lo;
                lo = hi + 1;
            }
        }
        out
    }

    /// Executes one WQE: `Ok(byte_cnt)` or `Err((syndrome, vendor))`.
    fn exec(&mut self, op: &Op) -> Result<u32, (u8, u8)> {
        match op {
            Op::Nop { .. } => Ok(0),
            Op::Bad { .. } => Err((syndrome::LOCAL_QP_OP_ERR, vs::BAD_WQE)),
            Op::Write { sges, dst, .. } => {
                let mut srcs = Vec::new();
                for (a, len) in sges {
                    let (key, addr) = Self::resolve(&self.lmrs, *a);
                    let len = if *len == 0 { 1u64 << 31 } else { *len as u64 };
                    let off = Self::find(&self.lmrs, key, addr, len, Access::NONE)
                        .map_err(Self::local_fail)?;
                    srcs.push((off, len as usize));
                }
                let total: usize = srcs.iter().map(|s| s.1).sum();
                let (rkey, raddr) = Self::resolve(&self.rmrs, *dst);
                let mut d = Self::find(&self.rmrs, rkey, raddr, total as u64, Access::REMOTE_WRITE)
                    .map_err(Self::remote_fail)?;
                for (s, len) in srcs {
                    let bytes = self.local[s..s + len].to_vec();
                    self.remote[d..d + len].copy_from_slice(&bytes);
                    d += len;
                }
                Ok(total as u32)
            }
            Op::Inline { data, dst, .. } => {
                if data.is_empty() {
                    return Ok(0);
                }
                let (rkey, raddr) = Self::resolve(&self.rmrs, *dst);
                let d = Self::find(
                    &self.rmrs,
                    rkey,
                    raddr,
                    data.len() as u64,
                    Access::REMOTE_WRITE,
                )
                .map_err(Self::remote_fail)?;
                self.remote[d..d + data.len()].copy_from_slice(data);
                Ok(data.len() as u32)
            }
            Op::Atomic {
                kind,
                dst,
                fetch,
                a,
                b,
                c,
                d,
                ..
            } => {
                let w: usize = if matches!(kind, 2 | 3) { 4 } else { 8 };
                let (lkey, laddr) = Self::resolve(&self.lmrs, *fetch);
                let lo = Self::find(&self.lmrs, lkey, laddr, w as u64, Access::LOCAL_WRITE)
                    .map_err(Self::local_fail)?;
                let (rkey, raddr) = Self::resolve(&self.rmrs, *dst);
                let ro = Self::find(&self.rmrs, rkey, raddr, w as u64, Access::REMOTE_ATOMIC)
                    .map_err(Self::remote_fail)?;
                if raddr % w as u64 != 0 {
                    return Err((syndrome::REMOTE_INVAL_REQ_ERR, vs::MISALIGNED));
                }
                let old = if w == 8 {
                    u64::from_le_bytes(self.remote[ro..ro + 8].try_into().unwrap())
                } else {
                    u32::from_le_bytes(self.remote[ro..ro + 4].try_into().unwrap()) as u64
                };
                let new = match kind {
                    0 => old.wrapping_add(*a),
                    1 => {
                        if old == *b {
                            *a
                        } else {
                            old
                        }
                    }
                    2 => Self::fields_add(old, *c as u64, *d as u64, 32),
                    3 => {
                        let (swap, cmp, smask, cmask) = (*c, *d, (*a >> 32) as u32, *a as u32);
                        let o = old as u32;
                        if o & cmask == cmp & cmask {
                            ((o & !smask) | (swap & smask)) as u64
                        } else {
                            old
                        }
                    }
                    _ => Self::fields_add(old, *a, *b, 64),
                };
                if w == 8 {
                    self.remote[ro..ro + 8].copy_from_slice(&new.to_le_bytes());
                } else {
                    self.remote[ro..ro + 4].copy_from_slice(&(new as u32).to_le_bytes());
                }
                // Standard atomics reply in host order, masked ones big-endian.
                let reply = match (kind, w) {
                    (0 | 1, _) => old.to_le_bytes().to_vec(),
                    (_, 4) => (old as u32).to_be_bytes().to_vec(),
                    _ => old.to_be_bytes().to_vec(),
                };
                self.local[lo..lo + w].copy_from_slice(&reply);
                Ok(w as u32)
            }
        }
    }

    fn run(&mut self, index: u16, op: &Op) {
        let (wqe_opcode, cqe) = match op {
            Op::Nop { cqe } => (opcode::NOP, *cqe),
            Op::Write { imm, cqe, .. } | Op::Inline { imm, cqe, .. } => (
                if imm.is_some() {
                    opcode::RDMA_WRITE_IMM
                } else {
                    opcode::RDMA_WRITE
                },
                *cqe,
            ),
            Op::Atomic { kind, cqe, .. } => (
                [
                    opcode::ATOMIC_FA,
                    opcode::ATOMIC_CS,
                    opcode::ATOMIC_MASKED_FA,
                    opcode::ATOMIC_MASKED_CS,
                    opcode::ATOMIC_MASKED_FA,
                ][*kind as usize],
                *cqe,
            ),
            Op::Bad { opcode } => (*opcode, false),
        };
        let fail = |syndrome, vendor| ExpCqe {
            err: true,
            wqe_counter: index,
            wqe_opcode,
            syndrome,
            vendor,
            byte_cnt: 0,
        };
        if self.error {
            self.cqes.push(fail(syndrome::WR_FLUSH_ERR, vs::FLUSH));
            return;
        }
        match self.exec(op) {
            Ok(n) if cqe => self.cqes.push(ExpCqe {
                err: false,
                wqe_counter: index,
                wqe_opcode,
                syndrome: 0,
                vendor: 0,
                byte_cnt: n,
            }),
            Ok(_) => {}
            Err((s, v)) => {
                self.error = true;
                self.cqes.push(fail(s, v));
            }
        }
    }
}

fn build(q: u32, i: u16, op: &Op, lmrs: &[MrM; 2], rmrs: &[MrM; 2]) -> WqeBB {
    let remote = |a: At| {
        let (rkey, addr) = Model::resolve(rmrs, a);
        RemoteAddr { addr, rkey }
    };
    let local = |a: At| {
        let (lkey, addr) = Model::resolve(lmrs, a);
        LocalAddr { addr, lkey }
    };
    match op {
        Op::Nop { cqe } => Nop::new(q, i).cqe(*cqe).build(),
        Op::Write {
            sges,
            dst,
            imm,
            cqe,
        } => {
            let s: Vec<Sge> = sges
                .iter()
                .map(|(a, len)| {
                    let l = local(*a);
                    Sge {
                        addr: l.addr,
                        len: *len as u32,
                        lkey: l.lkey,
                    }
                })
                .collect();
            let w = if s.len() == 1 {
                RdmaWrite::new(q, i, remote(*dst), s[0])
            } else {
                RdmaWrite::new_gather(q, i, remote(*dst), [s[0], s[1]])
            };
            let w = w.cqe(*cqe);
            match imm {
                Some(x) => w.imm(*x).build(),
                None => w.build(),
            }
        }
        Op::Inline {
            data,
            dst,
            imm,
            cqe,
        } => {
            let w = InlineWrite::new(q, i, remote(*dst), data).cqe(*cqe);
            match imm {
                Some(x) => w.imm(*x).build(),
                None => w.build(),
            }
        }
        Op::Atomic {
            kind,
            dst,
            fetch,
            a,
            b,
            c,
            d,
            cqe,
        } => {
            let (r, l) = (remote(*dst), local(*fetch));
            match kind {
                0 => FetchAdd64::new(q, i, r, l, *a).cqe(*cqe).build(),
                1 => CompareSwap64::new(q, i, r, l, *a, *b).cqe(*cqe).build(),
                2 => MaskedFetchAdd32::new(q, i, r, l, *c)
                    .field_boundary(*d)
                    .cqe(*cqe)
                    .build(),
                3 => MaskedCompareSwap32::new(q, i, r, l, *c, *d)
                    .masks((*a >> 32) as u32, *a as u32)
                    .cqe(*cqe)
                    .build(),
                _ => MaskedFetchAdd64::new(q, i, r, l, *a)
                    .field_boundary(*b)
                    .cqe(*cqe)
                    .build(),
            }
        }
        Op::Bad { opcode } => {
            let mut w = Nop::new(q, i).build();
            w.0[3] = *opcode;
            w
        }
    }
}

fn access() -> impl Strategy<Value = Access> {
    prop_oneof![3 => Just(Access::ALL), 1 => (0u32..16).prop_map(Access::from_bits)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn emulator_matches_the_reference_model(
        ops in proptest::collection::vec(op(), 1..40),
        acc in proptest::collection::vec(access(), 4),
        seed in any::<u64>(),
        chunks in proptest::collection::vec(1usize..8, 1..8),
        source in 0u8..3,
        order in 0u8..3,
        strict_seed in any::<u64>(),
    ) {
        // 0: strict checks, in order: the model holds exactly. 1: full strict mode (reordered,
        // chunked, interleaved) with every WQE fenced: the fences restore the model's order.
        // 2: full strict mode, no fences: CQEs and the error state still agree, memory may not.
        let (strict, fenced, exact) = match order {
            0 => (StrictMode::checks_only(), false, true),
            1 => (StrictMode::full(strict_seed), true, true),
            _ => (StrictMode::full(strict_seed), false, false),
        };
        let mut p = Pair::with_strict(true, 64, CqMode::Ring, 64, strict);
        let q = p.qpn();
        // Random initial bytes on both sides.
        let mut x = seed | 1;
        let mut rnd = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 };
        let init_l: Vec<u8> = (0..ARENA).map(|_| rnd()).collect();
        let init_r: Vec<u8> = (0..ARENA).map(|_| rnd()).collect();
        p.la.write(0, &init_l);
        p.ra.write(0, &init_r);
        let layout = [(1024usize, 1024usize), (3000, 96)];
        let mk = |m: ibgda_emu::Mr, off: usize, len: usize| MrM { key: m.lkey, addr: m.addr, arena_off: off, len, access: m.access };
        let lmrs = [0, 1].map(|k| { let (o, l) = layout[k]; mk(p.local(o, l, acc[k]), o, l) });
        let rmrs = [0, 1].map(|k| { let (o, l) = layout[k]; mk(p.remote(o, l, acc[2 + k]), o, l) });
        let mut model = Model { local: init_l, remote: init_r, lmrs, rmrs, error: false, cqes: vec![] };

        let mut next = 0usize;
        let mut ci = chunks.iter().cycle();
        while next < ops.len() {
            let n = (*ci.next().unwrap()).min(ops.len() - next);
            for op in &ops[next..next + n] {
                let i = p.pi as u16;
                let mut w = build(q, i, op, &lmrs, &rmrs);
                if fenced {
                    // fm_ce_se bits 7..5: SMALL_AND_FENCE, what rdma-core's IBV_SEND_FENCE sets.
                    w.0[11] = (w.0[11] & 0x1f) | (4 << 5);
                }
                p.post(w);
                model.run(i, op);
            }
            next += n;
            match source {
                0 => p.qp.ring_dbr(p.pi),
                1 => p.qp.ring_uar(p.pi),
                _ => p.a.ring_doorbell(q, p.pi).unwrap(),
            }
            p.idle();
        }
        let st = p.a.qp_status(q).unwrap();
        prop_assert_eq!(st.fetched, ops.len() as u64);
        prop_assert_eq!(st.state == QpState::Error, model.error);
        let got: Vec<ExpCqe> = p.cqes().iter().map(|c| ExpCqe {
            err: c.opcode() == cqe_opcode::REQ_ERR,
            wqe_counter: c.wqe_counter.get(),
            wqe_opcode: (c.sop_drop_qpn.get() >> 24) as u8,
            syndrome: if c.is_error() { c.syndrome() } else { 0 },
            vendor: if c.is_error() { c.vendor_syndrome() } else { 0 },
            byte_cnt: if c.is_error() { 0 } else { c.byte_cnt.get() },
        }).collect();
        prop_assert_eq!(&got, &model.cqes);
        if exact {
            prop_assert!(p.la.to_vec() == model.local, "local memory differs");
            prop_assert!(p.ra.to_vec() == model.remote, "remote memory differs");
        }
    }

    /// Arbitrary bytes as ring contents never crash the NIC, never touch memory outside a
    /// registration, and are always consumed (the CI stand-in for the cargo-fuzz target).
    #[test]
    fn arbitrary_ring_bytes_are_safe(data in proptest::collection::vec(any::<u8>(), 0..1100)) {
        if let Err(e) = ibgda_emu::fuzzing::run_ring_bytes(&data) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// The same harness on structured-looking inputs: every opcode byte, with keys steered.
#[test]
fn every_opcode_byte_through_the_fuzz_harness() {
    let mut errors = 0;
    for opc in 0..=255u8 {
        for ds in [0u8, 1, 2, 3, 4, 5, 8, 63] {
            let mut data = vec![16u8];
            for k in 0..16u8 {
                let mut bb = [0u8; 64];
                bb[3] = opc;
                bb[7] = ds;
                bb[8] = 1; // steer keys and addresses
                bb[9] = k.wrapping_mul(37);
                bb[10] = k;
                bb[11] = 0x08;
                bb[20] = k.wrapping_mul(13);
                bb[32] = if k % 3 == 0 { 0x80 } else { 0 };
                bb[35] = k * 3;
                bb[51] = if k % 2 == 0 { 8 } else { 4 };
                data.extend_from_slice(&bb);
            }
            let s = ibgda_emu::fuzzing::run_ring_bytes(&data)
                .unwrap_or_else(|e| panic!("opcode {opc:#x} ds {ds}: {e}"));
            errors += s.error as u32;
        }
    }
    assert!(errors > 0);
}
