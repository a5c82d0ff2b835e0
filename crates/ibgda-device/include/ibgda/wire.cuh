// The mlx5 wire format as the GPU writes and reads it: send-WQE segments, the builders that fill a
// 64-byte WQE basic block (WQEBB), the 64-byte CQE and its parsing, and the QP doorbell record.
//
// Mirrors `ibgda_device::wire` (Rust) field for field. Both sides are checked against one table,
// `layout.def`: here by the static_asserts at the end of this file, in Rust by assertions generated
// from the same table, and the byte output of every builder is compared with the Rust builders
// (on the host in CI, and on the GPU by `ep-kernels/tests/gpu_wire.rs`).
//
// Every multi-byte field is big-endian on the wire. Structs hold wire bytes; builders take host
// values and do the conversion, so a kernel never swaps bytes by hand.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Constants

// Send WQE basic block: the unit of the ring, of WQE indices and of the submit counters.
#define IBGDA_WQEBB_BYTES 64u
// WQE sizes (DS) count 16-byte units.
#define IBGDA_DS_BYTES 16u

// Control-segment opcodes (low byte of the first word).
#define IBGDA_OPCODE_NOP 0x00u
#define IBGDA_OPCODE_RDMA_WRITE 0x08u
#define IBGDA_OPCODE_RDMA_WRITE_IMM 0x09u
#define IBGDA_OPCODE_RDMA_READ 0x10u
#define IBGDA_OPCODE_ATOMIC_CS 0x11u
#define IBGDA_OPCODE_ATOMIC_FA 0x12u
#define IBGDA_OPCODE_ATOMIC_MASKED_CS 0x14u
#define IBGDA_OPCODE_ATOMIC_MASKED_FA 0x15u

// Opcode modifiers of the masked ("extended") atomics: 0x08 | log2(operand bytes) - 2.
#define IBGDA_OPMOD_EXT_ATOMIC_4B 0x08u
#define IBGDA_OPMOD_EXT_ATOMIC_8B 0x09u

// fm_ce_se (byte 11 of the control segment): fence mode in bits 7..5, completion mode in bits
// 3..2, solicited event in bit 1.
#define IBGDA_FENCE_NONE 0u
#define IBGDA_FENCE_INITIATOR_SMALL 1u
#define IBGDA_FENCE_FENCE 2u
#define IBGDA_FENCE_STRONG_ORDERING 3u
#define IBGDA_FENCE_SMALL_AND_FENCE 4u
#define IBGDA_FENCE_SHIFT 5u
#define IBGDA_CTRL_CQ_UPDATE 0x08u
#define IBGDA_CTRL_SOLICITED 0x02u

// Inline data segments start with a byte count that has this bit set.
#define IBGDA_INLINE_SEG 0x80000000u
// Inline bytes that fit one WQEBB after the control, remote-address and 4-byte inline headers.
#define IBGDA_INLINE_MAX_ONE_BB 28u

// CQE opcodes (op_own bits 7..4).
#define IBGDA_CQE_REQ 0x0u
#define IBGDA_CQE_RESP_WR_IMM 0x1u
#define IBGDA_CQE_REQ_ERR 0xdu
#define IBGDA_CQE_RESP_ERR 0xeu
#define IBGDA_CQE_INVALID 0xfu

// What `ibgda_cqe_parse_tail` concluded about a CQE slot.
#define IBGDA_CQE_STATE_EMPTY 0u  // still owned by the NIC: nothing new in this slot
#define IBGDA_CQE_STATE_OK 1u     // a completion
#define IBGDA_CQE_STATE_ERROR 2u  // a requester (13) or responder (14) error completion

// Doorbell record offsets, and the BlueFlame register's offset inside the UAR page.
#define IBGDA_DBR_RECV_OFFSET 0u
#define IBGDA_DBR_SEND_OFFSET 4u
#define IBGDA_UAR_BF_OFFSET 0x800u

// ---------------------------------------------------------------------------------------------
// Segments (wire bytes; comments give byte ranges)

// Control segment, the first 16 bytes of every WQE.
struct ibgda_ctrl_seg {
    uint32_t opmod_idx_opcode;        // [0,4)  be: opmod(8) | wqe index(16) | opcode(8)
    uint32_t qpn_ds;                  // [4,8)  be: qpn(24) | ds(6, low bits)
    uint8_t signature;                // [8]
    uint8_t dci_stream_channel_id[2]; // [9,11) unused on RC: zero
    uint8_t fm_ce_se;                 // [11]
    uint32_t imm;                     // [12,16) be: immediate data
};

// Remote-address segment: where an RDMA write or atomic lands.
struct ibgda_raddr_seg {
    uint64_t raddr;    // [0,8)   be
    uint32_t rkey;     // [8,12)  be
    uint32_t reserved; // [12,16)
};

// Data (gather) segment: a local buffer the NIC reads from, or an atomic's fetch target.
struct ibgda_data_seg {
    uint32_t byte_count; // [0,4)  be: 0 means 2 GiB
    uint32_t lkey;       // [4,8)  be
    uint64_t addr;       // [8,16) be
};

// Inline data segment header; the bytes follow it, padded to 16.
struct ibgda_inline_seg {
    uint32_t byte_count; // [0,4) be: length | IBGDA_INLINE_SEG
};

// Atomic segment of the standard 8-byte atomics (ATOMIC_FA, ATOMIC_CS).
struct ibgda_atomic_seg {
    uint64_t swap_add; // [0,8)  be: the addend (FA) or the swap value (CS)
    uint64_t compare;  // [8,16) be: the compare value (CS); zero for FA
};

// Masked fetch-add, 4-byte operands (ATOMIC_MASKED_FA, opmod 0x08).
struct ibgda_masked_fa32_seg {
    uint32_t add;            // [0,4)  be
    uint32_t field_boundary; // [4,8)  be: a set bit ends a field (carry stops there); 0 = plain add
    uint32_t reserved[2];    // [8,16)
};

// Masked compare-swap, 4-byte operands (ATOMIC_MASKED_CS, opmod 0x08).
struct ibgda_masked_cs32_seg {
    uint32_t swap;         // [0,4)   be
    uint32_t compare;      // [4,8)   be
    uint32_t swap_mask;    // [8,12)  be: bits of `swap` written
    uint32_t compare_mask; // [12,16) be: bits of `compare` compared
};

// Masked fetch-add, 8-byte operands (ATOMIC_MASKED_FA, opmod 0x09).
struct ibgda_masked_fa64_seg {
    uint64_t add;            // [0,8)  be
    uint64_t field_boundary; // [8,16) be
};

// One WQE basic block, as words in memory order (each word already holds wire bytes).
struct alignas(64) ibgda_wqebb {
    uint32_t w[16];
};

// A local buffer in a gather list.
struct ibgda_sge {
    uint64_t addr;
    uint32_t lkey;
    uint32_t len;
};

// ---------------------------------------------------------------------------------------------
// CQE

// The 64-byte CQE as written by the NIC (requester view; bytes 0..32 are responder-only).
struct ibgda_cqe64 {
    uint8_t rsvd0[32];       // [0,32)
    uint32_t srqn_uidx;      // [32,36)  be
    uint32_t imm_inval_pkey; // [36,40)  be: immediate of a RESP_WR_IMM completion
    uint8_t app;             // [40]
    uint8_t app_op;          // [41]
    uint16_t app_info;       // [42,44)  be
    uint32_t byte_cnt;       // [44,48)  be
    uint64_t timestamp;      // [48,56)  be
    uint32_t sop_drop_qpn;   // [56,60)  be: qpn in the low 24 bits
    uint16_t wqe_counter;    // [60,62)  be: index of the completed WQE's first WQEBB
    uint8_t signature;       // [62]
    uint8_t op_own;          // [63]     opcode(4) | .. | owner(1)
};

// The same 64 bytes read as an error CQE (opcode 13 or 14).
struct ibgda_err_cqe {
    uint8_t rsvd0[32];         // [0,32)
    uint32_t srqn;             // [32,36)  be
    uint8_t rsvd1[18];         // [36,54)
    uint8_t vendor_err_synd;   // [54]
    uint8_t syndrome;          // [55]
    uint32_t s_wqe_opcode_qpn; // [56,60)  be: failed WQE's opcode(8) | qpn(24)
    uint16_t wqe_counter;      // [60,62)  be
    uint8_t signature;         // [62]
    uint8_t op_own;            // [63]
};

// The last 16 bytes of a CQE ([48,64)): everything a requester needs, in one 16-byte load.
struct ibgda_cqe_tail {
    uint32_t w[4];
};

// What a CQE slot says, decoded (the same struct as Rust's `CqeStatus`). Fields are filled from
// the slot's bytes whatever the state; syndrome, vendor_syndrome and wqe_opcode mean something only
// for IBGDA_CQE_STATE_ERROR.
struct ibgda_cqe_status {
    uint32_t state;          // IBGDA_CQE_STATE_*
    uint8_t opcode;          // op_own >> 4
    uint8_t owner;           // op_own & 1
    uint8_t syndrome;        // byte 55
    uint8_t vendor_syndrome; // byte 54
    uint16_t wqe_counter;    // host order
    uint8_t wqe_opcode;      // byte 56: the failed WQE's opcode (error CQEs)
    uint8_t reserved;
    uint32_t qpn; // low 24 bits of bytes [56,60)
};

// ---------------------------------------------------------------------------------------------
// Doorbell record

// The QP doorbell record the NIC reads: 16-bit receive and send producer counters.
struct ibgda_dbr {
    uint32_t recv_counter; // [0,4) be
    uint32_t send_counter; // [4,8) be: producer index & 0xffff
};

// The send-counter word to store at `dbr + IBGDA_DBR_SEND_OFFSET` for producer index `pi`.
IBGDA_HD uint32_t ibgda_dbr_send_word(uint64_t pi) { return ibgda_htobe32((uint32_t)(pi & 0xffffu)); }

// The 8-byte value to store to the BlueFlame register: the first 8 bytes of a control segment
// reduced to what the NIC reads, {be32(pi << 8), be32(qpn << 8)}, as a little-endian word.
IBGDA_HD uint64_t ibgda_db_word(uint32_t qpn, uint64_t pi) {
    uint32_t lo = ibgda_htobe32((uint32_t)(pi & 0xffffu) << 8);
    uint32_t hi = ibgda_htobe32((qpn & 0xffffffu) << 8);
    return ((uint64_t)hi << 32) | (uint64_t)lo;
}

// ---------------------------------------------------------------------------------------------
// Builders. Each returns one WQEBB; the WQE index is the low 16 bits of the monotonic WQEBB
// counter, the qpn 24 bits. `fm_ce_se` comes from `ibgda_fm_ce_se`.

// The fm_ce_se byte for a fence mode (IBGDA_FENCE_*) and whether to ask for a CQE.
IBGDA_HD uint8_t ibgda_fm_ce_se(uint32_t fence_mode, bool cqe) {
    return (uint8_t)(((fence_mode & 7u) << IBGDA_FENCE_SHIFT) | (cqe ? IBGDA_CTRL_CQ_UPDATE : 0u));
}

IBGDA_HD ibgda_wqebb ibgda_wqebb_zero() {
    ibgda_wqebb b;
    IBGDA_UNROLL
    for (int i = 0; i < 16; ++i) b.w[i] = 0;
    return b;
}

// Fills the control segment (words 0..3) exactly as rdma-core's mlx5dv_set_ctrl_seg does, with
// `imm` given in host order.
IBGDA_HD void ibgda_put_ctrl(ibgda_wqebb& b, uint8_t opcode, uint8_t opmod, uint16_t idx, uint32_t qpn, uint8_t ds,
                             uint8_t fm_ce_se, uint8_t signature, uint32_t imm) {
    b.w[0] = ibgda_htobe32(((uint32_t)opmod << 24) | ((uint32_t)idx << 8) | (uint32_t)opcode);
    b.w[1] = ibgda_htobe32(((qpn & 0xffffffu) << 8) | ((uint32_t)ds & 0x3fu));
    b.w[2] = (uint32_t)signature | ((uint32_t)fm_ce_se << 24);
    b.w[3] = ibgda_htobe32(imm);
}

// A 16-byte remote-address segment at word `at`.
IBGDA_HD void ibgda_put_raddr(ibgda_wqebb& b, int at, uint64_t raddr, uint32_t rkey) {
    b.w[at + 0] = ibgda_htobe32((uint32_t)(raddr >> 32));
    b.w[at + 1] = ibgda_htobe32((uint32_t)raddr);
    b.w[at + 2] = ibgda_htobe32(rkey);
    b.w[at + 3] = 0;
}

// A 16-byte data segment at word `at`.
IBGDA_HD void ibgda_put_data(ibgda_wqebb& b, int at, uint64_t addr, uint32_t lkey, uint32_t len) {
    b.w[at + 0] = ibgda_htobe32(len);
    b.w[at + 1] = ibgda_htobe32(lkey);
    b.w[at + 2] = ibgda_htobe32((uint32_t)(addr >> 32));
    b.w[at + 3] = ibgda_htobe32((uint32_t)addr);
}

// Two big-endian 64-bit values at words `at`, `at + 2`.
IBGDA_HD void ibgda_put_be64x2(ibgda_wqebb& b, int at, uint64_t x, uint64_t y) {
    b.w[at + 0] = ibgda_htobe32((uint32_t)(x >> 32));
    b.w[at + 1] = ibgda_htobe32((uint32_t)x);
    b.w[at + 2] = ibgda_htobe32((uint32_t)(y >> 32));
    b.w[at + 3] = ibgda_htobe32((uint32_t)y);
}

// NOP: one control segment (DS 1). With a CQE requested it is the WQE that carries a completion.
IBGDA_HD ibgda_wqebb ibgda_wqe_nop(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se) {
    ibgda_wqebb b = ibgda_wqebb_zero();
    ibgda_put_ctrl(b, IBGDA_OPCODE_NOP, 0, idx, qpn, 1, fm_ce_se, 0, 0);
    return b;
}

// RDMA write gathering `nsge` (1 or 2) local buffers; with `with_imm` an RDMA write with
// immediate carrying `imm` (host order). DS 2 + nsge.
IBGDA_HD ibgda_wqebb ibgda_wqe_rdma_write_gather(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                                 uint32_t rkey, const ibgda_sge* sges, uint32_t nsge, bool with_imm,
                                                 uint32_t imm) {
    ibgda_wqebb b = ibgda_wqebb_zero();
    uint32_t n = nsge < 1u ? 1u : (nsge > 2u ? 2u : nsge);
    ibgda_put_ctrl(b, with_imm ? IBGDA_OPCODE_RDMA_WRITE_IMM : IBGDA_OPCODE_RDMA_WRITE, 0, idx, qpn, (uint8_t)(2u + n),
                   fm_ce_se, 0, with_imm ? imm : 0u);
    ibgda_put_raddr(b, 4, raddr, rkey);
    ibgda_put_data(b, 8, sges[0].addr, sges[0].lkey, sges[0].len);
    if (n == 2u) ibgda_put_data(b, 12, sges[1].addr, sges[1].lkey, sges[1].len);
    return b;
}

// RDMA write of one local buffer (DS 3).
IBGDA_HD ibgda_wqebb ibgda_wqe_rdma_write(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                                          uint64_t laddr, uint32_t lkey, uint32_t len) {
    ibgda_sge s = {laddr, lkey, len};
    return ibgda_wqe_rdma_write_gather(qpn, idx, fm_ce_se, raddr, rkey, &s, 1, false, 0);
}

// RDMA write with immediate of one local buffer (DS 3); `imm` in host order.
IBGDA_HD ibgda_wqebb ibgda_wqe_rdma_write_imm(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                              uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t len,
                                              uint32_t imm) {
    ibgda_sge s = {laddr, lkey, len};
    return ibgda_wqe_rdma_write_gather(qpn, idx, fm_ce_se, raddr, rkey, &s, 1, true, imm);
}

// DS of an inline write of `len` bytes: control + remote address + the padded inline segment.
IBGDA_HD uint8_t ibgda_inline_ds(uint32_t len) { return (uint8_t)(2u + (4u + len + 15u) / 16u); }

// RDMA write (with immediate when `with_imm`) whose payload travels in the WQE. `len` must be at
// most IBGDA_INLINE_MAX_ONE_BB; longer payloads are cut to it.
IBGDA_HD ibgda_wqebb ibgda_wqe_inline_write_ex(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                               uint32_t rkey, const void* data, uint32_t len, bool with_imm,
                                               uint32_t imm) {
    ibgda_wqebb b = ibgda_wqebb_zero();
    if (len > IBGDA_INLINE_MAX_ONE_BB) len = IBGDA_INLINE_MAX_ONE_BB;
    ibgda_put_ctrl(b, with_imm ? IBGDA_OPCODE_RDMA_WRITE_IMM : IBGDA_OPCODE_RDMA_WRITE, 0, idx, qpn,
                   ibgda_inline_ds(len), fm_ce_se, 0, with_imm ? imm : 0u);
    ibgda_put_raddr(b, 4, raddr, rkey);
    b.w[8] = ibgda_htobe32(len | IBGDA_INLINE_SEG);
    // Bytes in memory order, packed into little-endian words 9..15; constant indices only, so the
    // block stays in registers.
    const uint8_t* src = (const uint8_t*)data;
    IBGDA_UNROLL
    for (uint32_t wi = 0; wi < 7u; ++wi) {
        uint32_t word = 0;
        IBGDA_UNROLL
        for (uint32_t bi = 0; bi < 4u; ++bi) {
            uint32_t k = 4u * wi + bi;
            if (k < len) word |= (uint32_t)src[k] << (8u * bi);
        }
        b.w[9 + wi] = word;
    }
    return b;
}

// Inline RDMA write (see ibgda_wqe_inline_write_ex).
IBGDA_HD ibgda_wqebb ibgda_wqe_inline_write(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                            uint32_t rkey, const void* data, uint32_t len) {
    return ibgda_wqe_inline_write_ex(qpn, idx, fm_ce_se, raddr, rkey, data, len, false, 0);
}

// Inline RDMA write with immediate (see ibgda_wqe_inline_write_ex).
IBGDA_HD ibgda_wqebb ibgda_wqe_inline_write_imm(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                                uint32_t rkey, const void* data, uint32_t len, uint32_t imm) {
    return ibgda_wqe_inline_write_ex(qpn, idx, fm_ce_se, raddr, rkey, data, len, true, imm);
}

// The common shape of every atomic: control, remote address, a 16-byte operand segment (words
// 8..11, filled by the caller), and the fetch target (DS 4).
IBGDA_HD ibgda_wqebb ibgda_wqe_atomic_frame(uint8_t opcode, uint8_t opmod, uint32_t qpn, uint16_t idx,
                                            uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey, uint64_t laddr,
                                            uint32_t lkey, uint32_t fetch_bytes) {
    ibgda_wqebb b = ibgda_wqebb_zero();
    ibgda_put_ctrl(b, opcode, opmod, idx, qpn, 4, fm_ce_se, 0, 0);
    ibgda_put_raddr(b, 4, raddr, rkey);
    ibgda_put_data(b, 12, laddr, lkey, fetch_bytes);
    return b;
}

// 64-bit fetch-add (ATOMIC_FA): the old value lands at `laddr`.
IBGDA_HD ibgda_wqebb ibgda_wqe_fetch_add64(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                                           uint64_t laddr, uint32_t lkey, uint64_t add) {
    ibgda_wqebb b =
        ibgda_wqe_atomic_frame(IBGDA_OPCODE_ATOMIC_FA, 0, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 8);
    ibgda_put_be64x2(b, 8, add, 0);
    return b;
}

// 64-bit compare-swap (ATOMIC_CS): the old value lands at `laddr`.
IBGDA_HD ibgda_wqebb ibgda_wqe_compare_swap64(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                              uint32_t rkey, uint64_t laddr, uint32_t lkey, uint64_t swap,
                                              uint64_t compare) {
    ibgda_wqebb b =
        ibgda_wqe_atomic_frame(IBGDA_OPCODE_ATOMIC_CS, 0, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 8);
    ibgda_put_be64x2(b, 8, swap, compare);
    return b;
}

// 32-bit masked fetch-add (ATOMIC_MASKED_FA, opmod 0x08). With field_boundary 0 it is a plain
// 32-bit add: the signal add, whose fetched value goes to a scratch `laddr` nobody reads.
IBGDA_HD ibgda_wqebb ibgda_wqe_masked_fetch_add32(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                                  uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t add,
                                                  uint32_t field_boundary) {
    ibgda_wqebb b = ibgda_wqe_atomic_frame(IBGDA_OPCODE_ATOMIC_MASKED_FA, IBGDA_OPMOD_EXT_ATOMIC_4B, qpn, idx,
                                           fm_ce_se, raddr, rkey, laddr, lkey, 4);
    b.w[8] = ibgda_htobe32(add);
    b.w[9] = ibgda_htobe32(field_boundary);
    return b;
}

// 32-bit masked compare-swap (ATOMIC_MASKED_CS, opmod 0x08); all-ones masks make a plain 32-bit CAS.
IBGDA_HD ibgda_wqebb ibgda_wqe_masked_compare_swap32(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                                     uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t swap,
                                                     uint32_t compare, uint32_t swap_mask, uint32_t compare_mask) {
    ibgda_wqebb b = ibgda_wqe_atomic_frame(IBGDA_OPCODE_ATOMIC_MASKED_CS, IBGDA_OPMOD_EXT_ATOMIC_4B, qpn, idx,
                                           fm_ce_se, raddr, rkey, laddr, lkey, 4);
    b.w[8] = ibgda_htobe32(swap);
    b.w[9] = ibgda_htobe32(compare);
    b.w[10] = ibgda_htobe32(swap_mask);
    b.w[11] = ibgda_htobe32(compare_mask);
    return b;
}

// 64-bit masked fetch-add (ATOMIC_MASKED_FA, opmod 0x09).
IBGDA_HD ibgda_wqebb ibgda_wqe_masked_fetch_add64(uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                                  uint32_t rkey, uint64_t laddr, uint32_t lkey, uint64_t add,
                                                  uint64_t field_boundary) {
    ibgda_wqebb b = ibgda_wqe_atomic_frame(IBGDA_OPCODE_ATOMIC_MASKED_FA, IBGDA_OPMOD_EXT_ATOMIC_8B, qpn, idx,
                                           fm_ce_se, raddr, rkey, laddr, lkey, 8);
    ibgda_put_be64x2(b, 8, add, field_boundary);
    return b;
}

// ---------------------------------------------------------------------------------------------
// CQE parsing

// Whether the CQE slot read at consumer index `cons_idx` holds a new completion: software owns it
// when its owner bit equals the parity of the pass over the ring, `(cons_idx / ncqes) & 1`, and it
// is not the INVALID opcode the ring is initialised with. `ncqes` is a power of two.
IBGDA_HD bool ibgda_cqe_sw_owned(uint8_t op_own, uint64_t cons_idx, uint32_t ncqes) {
    uint32_t expected = (cons_idx & (uint64_t)ncqes) != 0 ? 1u : 0u;
    return ((uint32_t)op_own >> 4) != IBGDA_CQE_INVALID && ((uint32_t)op_own & 1u) == expected;
}

// Whether a CQE opcode is an error completion.
IBGDA_HD bool ibgda_cqe_opcode_is_error(uint8_t opcode) {
    return opcode == IBGDA_CQE_REQ_ERR || opcode == IBGDA_CQE_RESP_ERR;
}

// The 64-bit WQEBB index a CQE's 16-bit wqe_counter names: the greatest index below `frontier`
// (exclusive: e.g. ready_head, which no completion can pass) whose low 16 bits equal `counter`.
// Exact while fewer than 65536 WQEBBs are outstanding, which a ring of at most 32768 guarantees.
IBGDA_HD uint64_t ibgda_wqe_index_from_counter(uint16_t counter, uint64_t frontier) {
    uint64_t last = frontier - 1u;
    return last - (uint64_t)(uint16_t)((uint16_t)last - counter);
}

// Decodes the last 16 bytes of the CQE slot read at consumer index `cons_idx`.
IBGDA_HD ibgda_cqe_status ibgda_cqe_parse_tail(ibgda_cqe_tail t, uint64_t cons_idx, uint32_t ncqes) {
    ibgda_cqe_status s;
    uint8_t op_own = (uint8_t)(t.w[3] >> 24);
    uint32_t qpn_word = ibgda_be32toh(t.w[2]);
    s.opcode = (uint8_t)(op_own >> 4);
    s.owner = (uint8_t)(op_own & 1u);
    s.vendor_syndrome = (uint8_t)(t.w[1] >> 16);
    s.syndrome = (uint8_t)(t.w[1] >> 24);
    s.wqe_counter = ibgda_be16toh((uint16_t)(t.w[3] & 0xffffu));
    s.wqe_opcode = (uint8_t)(qpn_word >> 24);
    s.reserved = 0;
    s.qpn = qpn_word & 0xffffffu;
    if (!ibgda_cqe_sw_owned(op_own, cons_idx, ncqes))
        s.state = IBGDA_CQE_STATE_EMPTY;
    else if (ibgda_cqe_opcode_is_error(s.opcode))
        s.state = IBGDA_CQE_STATE_ERROR;
    else
        s.state = IBGDA_CQE_STATE_OK;
    return s;
}

// Reads the last 16 bytes of a CQE in one load (the owner bit and the fields a requester needs
// arrive together) without caching: the NIC, not this GPU, writes the slot.
IBGDA_HD ibgda_cqe_tail ibgda_cqe_load_tail(const void* cqe) {
    ibgda_cqe_tail t;
    const uint8_t* p = (const uint8_t*)cqe + 48;
#if defined(__CUDA_ARCH__)
    asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(t.w[0]), "=r"(t.w[1]), "=r"(t.w[2]), "=r"(t.w[3])
                 : "l"(p)
                 : "memory");
#else
    const volatile uint32_t* v = (const volatile uint32_t*)p;
    for (int i = 0; i < 4; ++i) t.w[i] = v[i];
#endif
    return t;
}

// Reads and decodes the CQE slot at consumer index `cons_idx` of a ring of `ncqes` CQEs.
IBGDA_HD ibgda_cqe_status ibgda_cqe_poll(const ibgda_cqe64* cq, uint64_t cons_idx, uint32_t ncqes) {
    return ibgda_cqe_parse_tail(ibgda_cqe_load_tail(&cq[cons_idx & (uint64_t)(ncqes - 1u)]), cons_idx, ncqes);
}

#if defined(__CUDACC__)
// Stores one WQEBB into its ring slot with four 16-byte stores. Ordering against the doorbell is
// the submitter's job (a fence before publishing).
__device__ __forceinline__ void ibgda_wqebb_store(void* slot, const ibgda_wqebb& b) {
    uint4* dst = (uint4*)slot;
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = make_uint4(b.w[4 * i], b.w[4 * i + 1], b.w[4 * i + 2], b.w[4 * i + 3]);
}
#endif

// ---------------------------------------------------------------------------------------------
// Layout checks against the shared table (layout.def).

#define IBGDA_LAYOUT_STRUCT(c_name, rust_path, size, align) \
    static_assert(sizeof(c_name) == (size), "size of " #c_name);  \
    static_assert(alignof(c_name) == (align), "alignment of " #c_name);
#define IBGDA_LAYOUT_FIELD(c_name, rust_path, field, offset, size)                  \
    static_assert(offsetof(c_name, field) == (offset), "offset of " #c_name "." #field); \
    static_assert(sizeof(((c_name*)0)->field) == (size), "size of " #c_name "." #field);
#define IBGDA_LAYOUT_CONST(c_name, rust_path, value) static_assert((c_name) == (value), "value of " #c_name);
#define IBGDA_LAYOUT_WIRE 1
#include "layout.def"
#undef IBGDA_LAYOUT_WIRE
#undef IBGDA_LAYOUT_STRUCT
#undef IBGDA_LAYOUT_FIELD
#undef IBGDA_LAYOUT_CONST
