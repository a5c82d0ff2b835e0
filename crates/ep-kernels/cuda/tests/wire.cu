// Device-side tests of the mlx5 wire format (include/ibgda/wire.cuh): every WQE builder and the
// CQE parsing, run on the GPU for inputs the host generated. The host (tests/gpu_wire.rs) compares
// every output byte with the Rust builders and parser of ibgda_device::wire.
#include "ibgda/qp_desc.cuh"
#include "ibgda/wire.cuh"

// One random input for every WQE kind; mirrored byte for byte by `WireInput` in gpu_wire.rs.
struct wire_input {
    uint64_t raddr;      // [0,8)
    uint64_t laddr0;     // [8,16)
    uint64_t laddr1;     // [16,24)
    uint64_t fetch_addr; // [24,32)
    uint64_t a64;        // [32,40)
    uint64_t b64;        // [40,48)
    uint64_t counter;    // [48,56)  monotonic WQEBB counter; builders take its low 16 bits
    uint32_t qpn;        // [56,60)
    uint32_t rkey;       // [60,64)
    uint32_t lkey0;      // [64,68)
    uint32_t len0;       // [68,72)
    uint32_t lkey1;      // [72,76)
    uint32_t len1;       // [76,80)
    uint32_t fetch_lkey; // [80,84)
    uint32_t imm;        // [84,88)
    uint32_t a32;        // [88,92)
    uint32_t b32;        // [92,96)
    uint32_t c32;        // [96,100)
    uint32_t d32;        // [100,104)
    uint32_t fence;      // [104,108) IBGDA_FENCE_*
    uint32_t flags;      // [108,112) bit 0: ask for a CQE; bit 1: with immediate
    uint32_t inline_len; // [112,116) 0..=28
    uint8_t inline_data[28]; // [116,144)
};
static_assert(sizeof(wire_input) == 144, "wire_input layout is shared with gpu_wire.rs");
static_assert(offsetof(wire_input, inline_data) == 116, "wire_input layout is shared with gpu_wire.rs");

// WQE kinds, in the order gpu_wire.rs expects them.
#define WIRE_KINDS 9

// Builds every kind of WQE for input i into out[i * WIRE_KINDS + k], through the ring store.
extern "C" __global__ void wire_build(const wire_input* in, uint32_t n, ibgda_wqebb* out) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const wire_input& x = in[i];
        const uint16_t idx = (uint16_t)x.counter;
        const uint8_t fl = ibgda_fm_ce_se(x.fence, (x.flags & 1u) != 0);
        const bool with_imm = (x.flags & 2u) != 0;
        ibgda_wqebb* o = out + (uint64_t)i * WIRE_KINDS;
        const ibgda_sge sges[2] = {{x.laddr0, x.lkey0, x.len0}, {x.laddr1, x.lkey1, x.len1}};

        ibgda_wqebb_store(&o[0], ibgda_wqe_nop(x.qpn, idx, fl));
        ibgda_wqebb_store(&o[1], with_imm ? ibgda_wqe_rdma_write_imm(x.qpn, idx, fl, x.raddr, x.rkey, x.laddr0, x.lkey0,
                                                                     x.len0, x.imm)
                                          : ibgda_wqe_rdma_write(x.qpn, idx, fl, x.raddr, x.rkey, x.laddr0, x.lkey0,
                                                                 x.len0));
        ibgda_wqebb_store(&o[2],
                          ibgda_wqe_rdma_write_gather(x.qpn, idx, fl, x.raddr, x.rkey, sges, 2, with_imm, x.imm));
        ibgda_wqebb_store(&o[3], with_imm ? ibgda_wqe_inline_write_imm(x.qpn, idx, fl, x.raddr, x.rkey, x.inline_data,
                                                                       x.inline_len, x.imm)
                                          : ibgda_wqe_inline_write(x.qpn, idx, fl, x.raddr, x.rkey, x.inline_data,
                                                                   x.inline_len));
        ibgda_wqebb_store(&o[4], ibgda_wqe_fetch_add64(x.qpn, idx, fl, x.raddr, x.rkey, x.fetch_addr, x.fetch_lkey, x.a64));
        ibgda_wqebb_store(&o[5], ibgda_wqe_compare_swap64(x.qpn, idx, fl, x.raddr, x.rkey, x.fetch_addr, x.fetch_lkey,
                                                          x.a64, x.b64));
        ibgda_wqebb_store(&o[6], ibgda_wqe_masked_fetch_add32(x.qpn, idx, fl, x.raddr, x.rkey, x.fetch_addr,
                                                              x.fetch_lkey, x.a32, x.b32));
        ibgda_wqebb_store(&o[7], ibgda_wqe_masked_compare_swap32(x.qpn, idx, fl, x.raddr, x.rkey, x.fetch_addr,
                                                                 x.fetch_lkey, x.a32, x.b32, x.c32, x.d32));
        ibgda_wqebb_store(&o[8], ibgda_wqe_masked_fetch_add64(x.qpn, idx, fl, x.raddr, x.rkey, x.fetch_addr,
                                                              x.fetch_lkey, x.a64, x.b64));
    }
}

// Parses CQE i as read at consumer index cons_idx[i] of a ring of ncqes[i] CQEs.
extern "C" __global__ void wire_parse_cqes(const ibgda_cqe64* cqes, const uint64_t* cons_idx, const uint32_t* ncqes,
                                           uint32_t n, ibgda_cqe_status* out) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = ibgda_cqe_parse_tail(ibgda_cqe_load_tail(&cqes[i]), cons_idx[i], ncqes[i]);
}

// Polls a ring of ncqes CQEs at consumer index cons_idx[i] (any 64-bit index: the slot is
// cons_idx & (ncqes - 1), the expected owner its pass parity).
extern "C" __global__ void wire_poll_ring(const ibgda_cqe64* ring, uint32_t ncqes, const uint64_t* cons_idx, uint32_t n,
                                          ibgda_cqe_status* out) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = ibgda_cqe_poll(ring, cons_idx[i], ncqes);
}

// Counter wrap and doorbell values: out[3i] = the 64-bit index of counter (uint16_t)a[i] below
// frontier b[i]; out[3i+1] = the doorbell word of qpn a[i] & 0xffffff at producer index b[i];
// out[3i+2] = the doorbell record's send word for b[i].
extern "C" __global__ void wire_misc(const uint64_t* a, const uint64_t* b, uint32_t n, uint64_t* out) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[3 * (uint64_t)i] = ibgda_wqe_index_from_counter((uint16_t)a[i], b[i]);
        out[3 * (uint64_t)i + 1] = ibgda_db_word((uint32_t)a[i] & 0xffffffu, b[i]);
        out[3 * (uint64_t)i + 2] = ibgda_dbr_send_word(b[i]);
    }
}
