// Test-only shim: our CUDA headers compiled as plain host C++. Including them runs their
// static_asserts against layout.def; the functions below expose the device builders and CQE
// parsing to the Rust tests (tests/headers.rs), and the layout table as the C++ compiler measured
// it (tests/layout.rs). Linked into the integration tests of ibgda-device only.
#include "ibgda/qp_desc.cuh"
#include "ibgda/wire.cuh"

#include <string.h>

namespace {
void out_bb(uint8_t* out, const ibgda_wqebb& b) { memcpy(out, b.w, sizeof(b.w)); }
}  // namespace

extern "C" {

// ---- builders -------------------------------------------------------------------------------

uint8_t hdr_fm_ce_se(uint32_t fence_mode, bool cqe) { return ibgda_fm_ce_se(fence_mode, cqe); }

// ---- bounds ---------------------------------------------------------------------------------

uint64_t hdr_wait_bound_ns(uint64_t timeout_ns) { return ibgda_wait_bound_ns(timeout_ns); }

void hdr_wqe_nop(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se) {
    out_bb(out, ibgda_wqe_nop(qpn, idx, fm_ce_se));
}

void hdr_wqe_rdma_write(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                        uint64_t laddr, uint32_t lkey, uint32_t len) {
    out_bb(out, ibgda_wqe_rdma_write(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, len));
}

void hdr_wqe_rdma_write_imm(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                            uint64_t laddr, uint32_t lkey, uint32_t len, uint32_t imm) {
    out_bb(out, ibgda_wqe_rdma_write_imm(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, len, imm));
}

void hdr_wqe_rdma_write_gather(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                               uint32_t rkey, const ibgda_sge* sges, uint32_t nsge, bool with_imm, uint32_t imm) {
    out_bb(out, ibgda_wqe_rdma_write_gather(qpn, idx, fm_ce_se, raddr, rkey, sges, nsge, with_imm, imm));
}

void hdr_wqe_inline_write(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                          const uint8_t* data, uint32_t len, bool with_imm, uint32_t imm) {
    out_bb(out, ibgda_wqe_inline_write_ex(qpn, idx, fm_ce_se, raddr, rkey, data, len, with_imm, imm));
}

void hdr_wqe_fetch_add64(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                         uint64_t laddr, uint32_t lkey, uint64_t add) {
    out_bb(out, ibgda_wqe_fetch_add64(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, add));
}

void hdr_wqe_compare_swap64(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                            uint64_t laddr, uint32_t lkey, uint64_t swap, uint64_t compare) {
    out_bb(out, ibgda_wqe_compare_swap64(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, swap, compare));
}

void hdr_wqe_masked_fetch_add32(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t add, uint32_t boundary) {
    out_bb(out, ibgda_wqe_masked_fetch_add32(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, add, boundary));
}

void hdr_wqe_masked_compare_swap32(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                   uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t swap, uint32_t compare,
                                   uint32_t swap_mask, uint32_t compare_mask) {
    out_bb(out, ibgda_wqe_masked_compare_swap32(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, swap, compare,
                                                swap_mask, compare_mask));
}

void hdr_wqe_masked_fetch_add64(uint8_t* out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                uint32_t rkey, uint64_t laddr, uint32_t lkey, uint64_t add, uint64_t boundary) {
    out_bb(out, ibgda_wqe_masked_fetch_add64(qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, add, boundary));
}

// ---- CQE, doorbell --------------------------------------------------------------------------

void hdr_cqe_poll(const uint8_t* cqe, uint64_t cons_idx, uint32_t ncqes, ibgda_cqe_status* out) {
    *out = ibgda_cqe_parse_tail(ibgda_cqe_load_tail(cqe), cons_idx, ncqes);
}

uint64_t hdr_wqe_index_from_counter(uint16_t counter, uint64_t frontier) {
    return ibgda_wqe_index_from_counter(counter, frontier);
}

uint64_t hdr_db_word(uint32_t qpn, uint64_t pi) { return ibgda_db_word(qpn, pi); }

uint32_t hdr_dbr_send_word(uint64_t pi) { return ibgda_dbr_send_word(pi); }

// ---- the layout table, measured by the C++ compiler ----------------------------------------

struct ibgda_layout_entry {
    const char* kind;   // "struct", "field" or "const"
    const char* c_name; // the struct or constant
    const char* field;  // the field ("" otherwise)
    uint64_t a;         // struct: size; field: offset; const: value
    uint64_t b;         // struct: alignment; field: size; const: 0
};

#define IBGDA_LAYOUT_STRUCT(c, r, s, al) {"struct", #c, "", sizeof(c), alignof(c)},
#define IBGDA_LAYOUT_FIELD(c, r, f, o, s) {"field", #c, #f, offsetof(c, f), sizeof(((c*)0)->f)},
#define IBGDA_LAYOUT_CONST(c, r, v) {"const", #c, "", (uint64_t)(c), 0},
#define IBGDA_LAYOUT_WIRE 1
#define IBGDA_LAYOUT_QP_DESC 1
extern const ibgda_layout_entry ibgda_layout_table[] = {
#include "ibgda/layout.def"
};
extern const size_t ibgda_layout_table_len = sizeof(ibgda_layout_table) / sizeof(ibgda_layout_table[0]);

}  // extern "C"
