//! The mlx5 wire format on the GPU (`ibgda/wire.cuh`, compiled by nvcc into `tests/wire`) against
//! the Rust wire module of `ibgda_device`: every WQE builder for thousands of random inputs, byte
//! for byte; CQE parsing (owner parity over ring passes, 16-bit counter wrap, error opcodes and
//! syndromes) on crafted CQEs; doorbell values.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use ep_kernels::testing::{gpus, seed, Rng};
use ibgda_device::wire::*;

/// Random inputs per run: thousands, so every kind meets many QPNs, indices and keys.
const N: usize = 8192;
/// WQE kinds `wire_build` writes per input, in this order.
const KINDS: [&str; 9] = [
    "NOP",
    "RDMA write",
    "RDMA write, 2-entry gather",
    "inline write",
    "fetch-add 64",
    "compare-swap 64",
    "masked fetch-add 32",
    "masked compare-swap 32",
    "masked fetch-add 64",
];
/// What output buffers hold before a kernel writes them: a byte no builder writes everywhere.
const POISON: u8 = 0xA5;
const BLOCK: u32 = 128;

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `wire_input` of `cuda/tests/wire.cu` (144 bytes).
#[derive(Clone, Debug)]
struct WireInput {
    raddr: u64,
    laddr0: u64,
    laddr1: u64,
    fetch_addr: u64,
    a64: u64,
    b64: u64,
    counter: u64,
    qpn: u32,
    rkey: u32,
    lkey0: u32,
    len0: u32,
    lkey1: u32,
    len1: u32,
    fetch_lkey: u32,
    imm: u32,
    a32: u32,
    b32: u32,
    c32: u32,
    d32: u32,
    fence: u32,
    flags: u32,
    inline_len: u32,
    inline_data: [u8; INLINE_MAX_ONE_BB],
}

const INPUT_BYTES: usize = 144;

impl WireInput {
    /// Random fields, with edge values mixed in: the largest QPN, counters at the 16-bit wrap,
    /// gather lengths of 0 and 2^31 - 1, every inline length.
    fn random(rng: &mut Rng, i: usize) -> Self {
        let len = |rng: &mut Rng| match rng.below(8) {
            0 => 0,
            1 => 0x7fff_ffff,
            _ => rng.next_u64() as u32 & 0x7fff_ffff,
        };
        let mut inline_data = [0u8; INLINE_MAX_ONE_BB];
        inline_data
            .iter_mut()
            .for_each(|b| *b = rng.next_u64() as u8);
        Self {
            raddr: rng.next_u64(),
            laddr0: rng.next_u64(),
            laddr1: rng.next_u64(),
            fetch_addr: rng.next_u64(),
            a64: rng.next_u64(),
            b64: rng.next_u64(),
            counter: match i % 5 {
                0 => 0xffff + (rng.below(3) << 16),
                1 => 0x1_0000 * rng.below(1 << 20),
                _ => rng.next_u64(),
            },
            qpn: if i % 11 == 0 {
                0xff_ffff
            } else {
                rng.below(1 << 24) as u32
            },
            rkey: rng.next_u64() as u32,
            lkey0: rng.next_u64() as u32,
            len0: len(rng),
            lkey1: rng.next_u64() as u32,
            len1: len(rng),
            fetch_lkey: rng.next_u64() as u32,
            imm: rng.next_u64() as u32,
            a32: rng.next_u64() as u32,
            b32: rng.next_u64() as u32,
            c32: rng.next_u64() as u32,
            d32: rng.next_u64() as u32,
            fence: rng.below(5) as u32,
            flags: rng.below(4) as u32,
            inline_len: (i % (INLINE_MAX_ONE_BB + 1)) as u32,
            inline_data,
        }
    }

    fn to_bytes(&self) -> [u8; INPUT_BYTES] {
        let mut b = Vec::with_capacity(INPUT_BYTES);
        for v in [
            self.raddr,
            self.laddr0,
            self.laddr1,
            self.fetch_addr,
            self.a64,
            self.b64,
            self.counter,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [
            self.qpn,
            self.rkey,
            self.lkey0,
            self.len0,
            self.lkey1,
            self.len1,
            self.fetch_lkey,
            self.imm,
            self.a32,
            self.b32,
            self.c32,
            self.d32,
            self.fence,
            self.flags,
            self.inline_len,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.inline_data);
        b.try_into().expect("wire_input is 144 bytes")
    }

    fn fence(&self) -> FenceMode {
        match self.fence {
            0 => FenceMode::None,
            1 => FenceMode::InitiatorSmall,
            2 => FenceMode::Fence,
            3 => FenceMode::StrongOrdering,
            _ => FenceMode::SmallAndFence,
        }
    }

    /// WQE `kind` from the Rust builders.
    fn expected(&self, kind: usize) -> WqeBB {
        let (q, x) = (self.qpn, self.counter as u16);
        let (fence, cqe, imm) = (
            self.fence(),
            self.flags & 1 != 0,
            (self.flags & 2 != 0).then_some(self.imm),
        );
        let r = RemoteAddr {
            addr: self.raddr,
            rkey: self.rkey,
        };
        let f = LocalAddr {
            addr: self.fetch_addr,
            lkey: self.fetch_lkey,
        };
        let s0 = Sge {
            addr: self.laddr0,
            len: self.len0,
            lkey: self.lkey0,
        };
        let s1 = Sge {
            addr: self.laddr1,
            len: self.len1,
            lkey: self.lkey1,
        };
        let data = &self.inline_data[..self.inline_len as usize];
        match kind {
            0 => Nop::new(q, x).fence(fence).cqe(cqe).build(),
            1 | 2 => {
                let w = if kind == 1 {
                    RdmaWrite::new(q, x, r, s0)
                } else {
                    RdmaWrite::new_gather(q, x, r, [s0, s1])
                };
                let w = w.fence(fence).cqe(cqe);
                imm.map_or(w, |v| w.imm(v)).build()
            }
            3 => {
                let w = InlineWrite::new(q, x, r, data).fence(fence).cqe(cqe);
                imm.map_or(w, |v| w.imm(v)).build()
            }
            4 => FetchAdd64::new(q, x, r, f, self.a64)
                .fence(fence)
                .cqe(cqe)
                .build(),
            5 => CompareSwap64::new(q, x, r, f, self.a64, self.b64)
                .fence(fence)
                .cqe(cqe)
                .build(),
            6 => MaskedFetchAdd32::new(q, x, r, f, self.a32)
                .field_boundary(self.b32)
                .fence(fence)
                .cqe(cqe)
                .build(),
            7 => MaskedCompareSwap32::new(q, x, r, f, self.a32, self.b32)
                .masks(self.c32, self.d32)
                .fence(fence)
                .cqe(cqe)
                .build(),
            _ => MaskedFetchAdd64::new(q, x, r, f, self.a64)
                .field_boundary(self.b64)
                .fence(fence)
                .cqe(cqe)
                .build(),
        }
    }
}

fn poisoned(stream: &Arc<CudaStream>, bytes: usize) -> CudaSlice<u8> {
    stream
        .clone_htod(&vec![POISON; bytes])
        .expect("upload poison")
}

/// Every WQE kind, built by the device builders for N random inputs, equals the Rust builders'.
#[test]
fn gpu_wqe_builders_match_rust() {
    let Some(ctxs) = gpus(1) else { return };
    let stream = ctxs[0].default_stream();
    let mut rng = Rng::new(seed());
    let inputs: Vec<WireInput> = (0..N).map(|i| WireInput::random(&mut rng, i)).collect();
    let bytes: Vec<u8> = inputs.iter().flat_map(|x| x.to_bytes()).collect();
    let d_in = stream.clone_htod(&bytes).expect("upload inputs");
    let mut d_out = poisoned(&stream, N * KINDS.len() * WQEBB_BYTES);
    let f = ep_kernels::load_function(stream.context(), "tests/wire", "wire_build")
        .expect("load wire_build");
    let n = N as u32;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&d_in).arg(&n).arg(&mut d_out);
    // SAFETY: wire_build(const wire_input*, uint32_t, ibgda_wqebb*) matches the arguments; `d_in`
    // holds N 144-byte inputs and `d_out` N * 9 WQEBBs.
    unsafe { launch.launch(cfg(N)) }.expect("launch wire_build");
    let out = stream.clone_dtoh(&d_out).expect("download WQEs");

    let mut wrong = Vec::new();
    for (i, x) in inputs.iter().enumerate() {
        for (k, name) in KINDS.iter().enumerate() {
            let at = (i * KINDS.len() + k) * WQEBB_BYTES;
            let got = WqeBB(out[at..at + WQEBB_BYTES].try_into().expect("64 bytes"));
            let want = x.expected(k);
            if got != want {
                wrong.push(format!(
                    "input {i}, {name}:\n GPU:  {got}\n Rust: {want}\n input: {x:?}"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} WQEs differ; first:\n{}",
        wrong.len(),
        N * KINDS.len(),
        wrong[..wrong.len().min(3)].join("\n")
    );
    eprintln!(
        "{} WQEs ({} kinds x {N} inputs) byte-equal on GPU and in Rust",
        N * KINDS.len(),
        KINDS.len()
    );
}

/// Crafted CQEs (completions, error completions, fresh-ring slots, random bytes) read at random
/// consumer indices: the device parser agrees with the Rust one on every field.
#[test]
fn gpu_cqe_parsing_matches_rust() {
    let Some(ctxs) = gpus(1) else { return };
    let stream = ctxs[0].default_stream();
    let mut rng = Rng::new(seed());
    let mut cqes = Vec::with_capacity(N);
    let mut cons = Vec::with_capacity(N);
    let mut ncqes = Vec::with_capacity(N);
    for i in 0..N {
        let n = 1u32 << rng.below(16);
        let c = match i % 3 {
            0 => rng.next_u64(),
            1 => rng.below(4 * n as u64),
            _ => u64::MAX - rng.below(4 * n as u64),
        };
        // Half the time the owner bit this read expects, so every state shows up.
        let owner = if rng.below(2) == 0 {
            cqe_owner_bit(c, n)
        } else {
            rng.below(2) as u8
        };
        let counter = if i % 7 == 0 {
            0xffff
        } else {
            rng.next_u64() as u16
        };
        let (qpn, op) = (rng.below(1 << 24) as u32, rng.next_u64() as u8);
        let cqe = match i % 4 {
            0 => Cqe64::requester(owner, counter, qpn, op, rng.next_u64() as u32),
            1 => Cqe64::requester_error(
                owner,
                counter,
                qpn,
                op,
                rng.next_u64() as u8,
                rng.next_u64() as u8,
            ),
            2 => {
                let mut c = Cqe64::invalid();
                c.op_own |= owner;
                c
            }
            _ => {
                let mut b = [0u8; 64];
                b.iter_mut().for_each(|x| *x = rng.next_u64() as u8);
                Cqe64::from_bytes(&b)
            }
        };
        cqes.push(cqe);
        cons.push(c);
        ncqes.push(n);
    }
    let bytes: Vec<u8> = cqes.iter().flat_map(|c| *c.as_bytes()).collect();
    let d_cqes = stream.clone_htod(&bytes).expect("upload CQEs");
    let d_cons = stream.clone_htod(&cons).expect("upload consumer indices");
    let d_n = stream.clone_htod(&ncqes).expect("upload ring sizes");
    let mut d_out = poisoned(&stream, N * 16);
    let f = ep_kernels::load_function(stream.context(), "tests/wire", "wire_parse_cqes")
        .expect("load wire_parse_cqes");
    let n = N as u32;
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&d_cqes)
        .arg(&d_cons)
        .arg(&d_n)
        .arg(&n)
        .arg(&mut d_out);
    // SAFETY: wire_parse_cqes(const ibgda_cqe64*, const uint64_t*, const uint32_t*, uint32_t,
    // ibgda_cqe_status*) matches; every buffer holds N entries.
    unsafe { launch.launch(cfg(N)) }.expect("launch wire_parse_cqes");
    let out = stream.clone_dtoh(&d_out).expect("download statuses");

    let mut states = [0usize; 3];
    let mut wrong = Vec::new();
    for i in 0..N {
        let got = CqeStatus::from_bytes(out[16 * i..16 * i + 16].try_into().expect("16 bytes"));
        let want = CqeStatus::parse(&cqes[i], cons[i], ncqes[i]);
        if got != want {
            wrong.push(format!(
                "CQE {i} ({}) at cons {:#x} of {}:\n GPU:  {got}\n Rust: {want}",
                cqes[i], cons[i], ncqes[i]
            ));
        }
        if let Some(s) = want.state() {
            states[s as usize] += 1;
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {N} CQEs parsed differently; first:\n{}",
        wrong.len(),
        wrong[..wrong.len().min(3)].join("\n")
    );
    assert!(
        states.iter().all(|&s| s > N / 20),
        "too few of some state (empty, ok, error): {states:?}"
    );
    eprintln!("{N} crafted CQEs parsed alike on GPU and in Rust (empty/ok/error: {states:?})");
}

/// A ring the "NIC" has lapped twice and a bit, polled at every consumer index of four passes: GPU
/// and Rust agree everywhere, and a consumer within one pass of the producer finds exactly the
/// CQEs written and not yet consumed ready, wqe_counters wrapping at 16 bits, the error
/// completion where it was written.
#[test]
fn gpu_cqe_ring_polling_matches_rust() {
    let Some(ctxs) = gpus(1) else { return };
    let stream = ctxs[0].default_stream();
    const NCQES: u32 = 64;
    const WRITTEN: u64 = 2 * NCQES as u64 + 17;
    const ERR_AT: u64 = 2 * NCQES as u64 + 5;
    // CQE `idx` completes the WQE at index FIRST_WQE + 3 * idx (whose 16-bit counter wraps during
    // the third pass); FRONTIER is past all of them, by less than 65536.
    const FIRST_WQE: u64 = 0xffc0;
    const FRONTIER: u64 = FIRST_WQE + 3 * WRITTEN;
    let mut ring = vec![Cqe64::invalid(); NCQES as usize];
    for idx in 0..WRITTEN {
        let owner = cqe_owner_bit(idx, NCQES);
        let counter = (FIRST_WQE + 3 * idx) as u16;
        ring[(idx % NCQES as u64) as usize] = if idx == ERR_AT {
            Cqe64::requester_error(
                owner,
                counter,
                0x12_3456,
                opcode::RDMA_WRITE,
                syndrome::REMOTE_ACCESS_ERR,
                0x88,
            )
        } else {
            Cqe64::requester(owner, counter, 0x12_3456, opcode::NOP, 0)
        };
    }
    let cons: Vec<u64> = (0..4 * NCQES as u64).collect();
    let bytes: Vec<u8> = ring.iter().flat_map(|c| *c.as_bytes()).collect();
    let d_ring = stream.clone_htod(&bytes).expect("upload ring");
    let d_cons = stream.clone_htod(&cons).expect("upload consumer indices");
    let mut d_out = poisoned(&stream, cons.len() * 16);
    let f = ep_kernels::load_function(stream.context(), "tests/wire", "wire_poll_ring")
        .expect("load wire_poll_ring");
    let (ncqes, n) = (NCQES, cons.len() as u32);
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&d_ring)
        .arg(&ncqes)
        .arg(&d_cons)
        .arg(&n)
        .arg(&mut d_out);
    // SAFETY: wire_poll_ring(const ibgda_cqe64*, uint32_t, const uint64_t*, uint32_t,
    // ibgda_cqe_status*) matches; the ring holds NCQES CQEs, `d_cons` and `d_out` n entries.
    unsafe { launch.launch(cfg(cons.len())) }.expect("launch wire_poll_ring");
    let out = stream.clone_dtoh(&d_out).expect("download statuses");

    for (i, &c) in cons.iter().enumerate() {
        let got = CqeStatus::from_bytes(out[16 * i..16 * i + 16].try_into().expect("16 bytes"));
        let want = ring[(c % NCQES as u64) as usize].status(c, NCQES);
        assert_eq!(got, want, "cons {c}: GPU {got} vs Rust {want}");
        // A consumer at most one pass behind the producer (an overrun beyond that is what the
        // owner bit cannot tell) sees exactly the CQEs written and not yet lapped as ready.
        if c + (NCQES as u64) < WRITTEN || c >= WRITTEN + NCQES as u64 {
            continue;
        }
        let ready = c < WRITTEN;
        let state = got.state().expect("defined state");
        assert_eq!(state != CqeState::Empty, ready, "cons {c}: {got}");
        if ready {
            assert_eq!(
                wqe_index_from_counter(got.wqe_counter, FRONTIER),
                FIRST_WQE + 3 * c
            );
            assert_eq!(state == CqeState::Error, c == ERR_AT, "cons {c}: {got}");
        }
    }
    eprintln!(
        "ring of {NCQES} polled at {} consumer indices alike on GPU and in Rust",
        cons.len()
    );
}

/// Counter reconstruction and doorbell values for random inputs.
#[test]
fn gpu_counter_and_doorbell_values_match_rust() {
    let Some(ctxs) = gpus(1) else { return };
    let stream = ctxs[0].default_stream();
    let mut rng = Rng::new(seed());
    let a: Vec<u64> = (0..N).map(|_| rng.next_u64()).collect();
    let b: Vec<u64> = (0..N)
        .map(|i| {
            if i % 2 == 0 {
                rng.next_u64()
            } else {
                rng.below(1 << 20)
            }
        })
        .collect();
    let d_a = stream.clone_htod(&a).expect("upload a");
    let d_b = stream.clone_htod(&b).expect("upload b");
    let mut d_out = stream
        .clone_htod(&vec![u64::from_ne_bytes([POISON; 8]); 3 * N])
        .expect("upload poison");
    let f = ep_kernels::load_function(stream.context(), "tests/wire", "wire_misc")
        .expect("load wire_misc");
    let n = N as u32;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&d_a).arg(&d_b).arg(&n).arg(&mut d_out);
    // SAFETY: wire_misc(const uint64_t*, const uint64_t*, uint32_t, uint64_t*) matches; `d_a` and
    // `d_b` hold N values, `d_out` 3N.
    unsafe { launch.launch(cfg(N)) }.expect("launch wire_misc");
    let out = stream.clone_dtoh(&d_out).expect("download");
    for i in 0..N {
        let want = [
            wqe_index_from_counter(a[i] as u16, b[i]),
            db_word(a[i] as u32 & 0xff_ffff, b[i]),
            u32::from_ne_bytes(dbr_send_word(b[i]).to_bytes()) as u64,
        ];
        assert_eq!(
            out[3 * i..3 * i + 3],
            want,
            "input {i}: a={:#x} b={:#x}",
            a[i],
            b[i]
        );
    }
    eprintln!("{N} counter/doorbell values alike on GPU and in Rust");
}
