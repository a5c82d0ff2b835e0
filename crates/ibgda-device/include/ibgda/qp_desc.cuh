// The device QP descriptor: everything a kernel needs to post to one RC queue pair and wait for
// its completions, plus the error record device code writes when a wait fails.
//
// Mirrors `ibgda_device::qp_desc` (Rust) field for field, checked against `layout.def` on both
// sides. Host values (little-endian), natural alignment, no implicit padding.
//
// Counters (all u64, monotonic, in WQEBB units; the ring slot of index i is (i & (nwqes-1)) * 64):
//   resv_head  next index to hand out: a submitter reserves n WQEBBs with atomicAdd(resv_head, n)
//   ready_head submitted frontier: every WQEBB below it is written, fenced and published, in order
//              (each submitter waits for ready_head == its base, then sets it to base + n)
//   prod_idx   the producer index last rung to the NIC (doorbell record + doorbell), by the GPU in
//              handler mode gpu, by the proxy in the CPU modes
//   cons_idx   completed frontier: every WQEBB below it has completed (from CQE wqe_counters)
//   cq_cons_idx CQEs consumed: the next CQE slot to read is cq_cons_idx & (ncqes-1)
// Invariant: cons_idx <= prod_idx <= ready_head <= resv_head, and resv_head - cons_idx <= nwqes
// once the reservation's wait is over. Quiet waits for cons_idx >= ready_head in every mode.
#pragma once

#include "common.cuh"

// Who rings the NIC's doorbell for this QP (the `handler_mode` field).
#define IBGDA_HANDLER_GPU 0u             // the GPU writes the doorbell record and stores to db_reg
#define IBGDA_HANDLER_CPU 1u             // the proxy polls producer_slot in GPU memory (GDRCopy)
#define IBGDA_HANDLER_CPU_HOST_MEMORY 2u // the proxy polls producer_slot in pinned host memory

// `flags` bits. Device code must behave the same whatever they say; they are for diagnostics.
#define IBGDA_QP_FLAG_EMULATED 0x1u // the NIC behind this QP is the software emulator

// What an error record reports (its `kind`).
#define IBGDA_ERROR_NONE 0u            // no error recorded (yet)
#define IBGDA_ERROR_CQE 1u             // an error CQE: syndrome, vendor_syndrome, wqe_counter are set
#define IBGDA_ERROR_TIMEOUT_RESERVE 2u // waited too long for ring space (completions)
#define IBGDA_ERROR_TIMEOUT_READY 3u   // waited too long for ready_head to reach this submitter's base
#define IBGDA_ERROR_TIMEOUT_QUIET 4u   // waited too long for completions to cover ready_head
#define IBGDA_ERROR_TIMEOUT_OTHER 5u   // any other bounded wait ran out
#define IBGDA_ERROR_INVALID_DESC 6u    // the descriptor breaks the protocol's assumptions

// The per-QP counters, one 64-byte line. Device code updates them with atomics (resv_head,
// ready_head) or under the CQ poller's ownership (cons_idx, cq_cons_idx).
struct alignas(64) ibgda_qp_counters {
    uint64_t resv_head;   // [0,8)
    uint64_t ready_head;  // [8,16)
    uint64_t prod_idx;    // [16,24)
    uint64_t cons_idx;    // [24,32)
    uint64_t cq_cons_idx; // [32,40)
    uint32_t poll_lock;   // [40,44) 0 free, 1 held: one thread at a time consumes CQEs
    uint32_t db_lock;     // [44,48) protocol.cuh: the doorbell lock of mode gpu (0 free, 1 held)
    uint64_t reserved1[2]; // [48,64)
};

// The descriptor of one QP, 192 bytes: two lines of configuration written once by the host, then
// the counters line.
struct alignas(64) ibgda_qp_desc {
    // Send queue.
    uint64_t wq_base;       // [0,8)    device pointer: ring of nwqes WQEBBs
    uint64_t dbr;           // [8,16)   pointer to the QP's ibgda_dbr (GPU memory in mode gpu, else host)
    uint64_t db_reg;        // [16,24)  BlueFlame register (UAR + 0x800) mapped for the GPU; mode gpu only, else 0
    uint64_t producer_slot; // [24,32)  8-byte aligned u64 the proxy polls (CPU modes), else 0
    uint32_t nwqes;         // [32,36)  ring size in WQEBBs, a power of two
    uint32_t qpn;           // [36,40)  24-bit QP number
    uint32_t handler_mode;  // [40,44)  IBGDA_HANDLER_*
    uint32_t lkey;          // [44,48)  lkey of the local buffers (gather sources, fetch targets)
    // Completion queue.
    uint64_t cq_base;       // [48,56)  pointer to ncqes ibgda_cqe64
    uint64_t cq_dbr;        // [56,64)  CQ doorbell record (be32 consumer index at +0), or 0
    uint32_t ncqes;         // [64,68)  a power of two
    uint32_t flags;         // [68,72)  IBGDA_QP_FLAG_*
    // Diagnostics and bounds.
    uint32_t rank;          // [72,76)  this rank
    uint32_t qp_index;      // [76,80)  index of this QP among the rank's QPs
    uint32_t peer_rank;     // [80,84)  the rank at the other end
    uint32_t reserved0;     // [84,88)
    uint64_t timeout_ns;    // [88,96)  bound of every wait on this QP (%globaltimer ns)
    uint64_t error_record;  // [96,104) host-visible ibgda_error_record to fill on failure, or 0
    uint64_t scratch;       // [104,112) 8 bytes under `lkey` for fetch results nobody reads
    uint64_t reserved1[2];  // [112,128)
    ibgda_qp_counters counters; // [128,192)
};

// Written by device code when a wait times out or a CQE reports an error, read by the host. The
// writer claims the record (`claim` 0 -> 1 with a CAS, so the first failure wins), fills every
// field, fences at system scope and stores `kind` last: the host sees a complete record once
// `kind` is non-zero.
struct alignas(64) ibgda_error_record {
    uint32_t kind;            // [0,4)   IBGDA_ERROR_*; written last
    uint32_t rank;            // [4,8)
    uint32_t qp_index;        // [8,12)
    uint32_t qpn;             // [12,16)
    uint64_t resv_head;       // [16,24) counters when the error was seen
    uint64_t ready_head;      // [24,32)
    uint64_t prod_idx;        // [32,40)
    uint64_t cons_idx;        // [40,48)
    uint32_t handler_mode;    // [48,52)
    uint8_t syndrome;         // [52]    error CQE byte 55
    uint8_t vendor_syndrome;  // [53]    error CQE byte 54
    uint8_t cqe_opcode;       // [54]    op_own >> 4
    uint8_t wqe_opcode;       // [55]    the failed WQE's opcode
    uint16_t wqe_counter;     // [56,58) the failed WQE's index (low 16 bits)
    uint16_t reserved0;       // [58,60)
    uint32_t claim;           // [60,64) 0 free, 1 taken
};

// Bound of every wait whose timeout_ns is 0, here and in every EP kernel: long enough for any
// sane completion (a real NIC retries a lost packet for well under a second), short enough that a
// test suite reports a broken protocol instead of stalling. 0 has this one meaning everywhere
// (ibgda_device::timeout, which also keeps host options from ever being 0).
#define IBGDA_DEFAULT_TIMEOUT_NS 10000000000ull

// What a wait with bound `timeout_ns` waits, in %globaltimer ns. Waits compare elapsed time
// (now - start > bound), which cannot wrap, rather than a deadline start + bound, which can.
IBGDA_HD uint64_t ibgda_wait_bound_ns(uint64_t timeout_ns) {
    return timeout_ns != 0 ? timeout_ns : IBGDA_DEFAULT_TIMEOUT_NS;
}

// ---------------------------------------------------------------------------------------------
// Layout checks against the shared table (layout.def).

#define IBGDA_LAYOUT_STRUCT(c_name, rust_path, size, align) \
    static_assert(sizeof(c_name) == (size), "size of " #c_name);  \
    static_assert(alignof(c_name) == (align), "alignment of " #c_name);
#define IBGDA_LAYOUT_FIELD(c_name, rust_path, field, offset, size)                  \
    static_assert(offsetof(c_name, field) == (offset), "offset of " #c_name "." #field); \
    static_assert(sizeof(((c_name*)0)->field) == (size), "size of " #c_name "." #field);
#define IBGDA_LAYOUT_CONST(c_name, rust_path, value) static_assert((c_name) == (value), "value of " #c_name);
#define IBGDA_LAYOUT_QP_DESC 1
#include "layout.def"
#undef IBGDA_LAYOUT_QP_DESC
#undef IBGDA_LAYOUT_STRUCT
#undef IBGDA_LAYOUT_FIELD
#undef IBGDA_LAYOUT_CONST
