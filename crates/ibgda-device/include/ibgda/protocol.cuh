// The device side of the IBGDA submit/quiet protocol, the same for a real mlx5 NIC and the
// emulator: only the descriptor's pointers differ.
//
// Per QP (see qp_desc.cuh for the counters):
//   1. reserve  base = atomicAdd(resv_head, n), then wait (bounded) until the ring has room:
//               base + n - cons_idx <= nwqes. A WQE slot is never rewritten before the NIC has
//               completed the WQE that was in it. Then read ready_head (relaxed) into the
//               ticket: its round trip overlaps the WQE stores of step 2.
//   2. write    the WQEs into slots base .. base+n-1; the last one asks for a CQE (every
//               submission ends with a CQE-bearing WQEBB, so completions always land on a
//               submission boundary and quiet can wait for ready_head exactly).
//   3. publish  the turn: ready_head == base, as the ticket read it or else after a wait
//               (bounded, acquire); then a fence (acquire for that read, release for the WQEs)
//               and the store ready_head = base + n. Every submitter on a QP goes through this
//               queue: ours, a barrier's, anyone's.
//   4. doorbell by handler mode:
//               gpu             after step 3, under the QP's doorbell lock: read ready_head, write
//                               the doorbell record, store the 8-byte doorbell word to db_reg,
//                               advance prod_idx. The lock keeps doorbell values monotonic.
//               cpu, cpu_host_memory
//                               inside step 3, while holding the turn (ready_head == base): a
//                               system-scope fence and a store of base + n to the QP's 8-byte
//                               producer slot, then the ready_head store; the CPU proxy polls the
//                               slots and rings. Flushes of batched publishes (quiet, the waits,
//                               ibgda_ring_published) raise the slot with a system-scope release
//                               atomicMax instead, since they hold no turn. Why the slot never
//                               goes backwards: see ibgda_publish.
//   5. quiet    make sure the doorbell covers ready_head, then wait (bounded) until completions
//               cover it: cons_idx >= ready_head, in every mode (never a counter that only one
//               mode advances: that was the upstream drain bug).
//
// No wait is unbounded. When a wait runs past desc->timeout_ns (%globaltimer), or an error CQE
// arrives, the first failing thread fills the host-visible ibgda_error_record (rank, QP, the four
// indices, mode, syndrome) and every function returns a non-zero status up the call chain; any
// other waiter that sees a recorded error stops early with IBGDA_STATUS_ABORTED. After a failure
// the QP is unusable until the host rebuilds it (a reservation that was never published blocks
// every later submitter, by design: that is what the bounded wait reports).
//
// Doorbell batching: publish with ring = false to add WQEs without a doorbell; the next ringing
// submission on the QP covers them, as do ibgda_ring_published, ibgda_quiet and a reservation
// that finds the ring full.
#pragma once

#include "common.cuh"
#include "qp_desc.cuh"
#include "wire.cuh"

// ---------------------------------------------------------------------------------------------
// Status codes (host and device). Zero is success; a non-zero status is the IBGDA_ERROR_* kind of
// the failure that stopped the call, or IBGDA_STATUS_ABORTED.

#define IBGDA_STATUS_OK 0
// Stopped early because a failure was already recorded in this QP's error record (by another
// thread, possibly on another QP sharing the record). The record says what happened.
#define IBGDA_STATUS_ABORTED 0x100

// IBGDA_DEFAULT_TIMEOUT_NS, the bound of a wait whose timeout_ns is 0: see qp_desc.cuh.
// Largest ring: a CQE's 16-bit wqe_counter names a WQEBB exactly only while fewer than 65536 are
// outstanding, and half that keeps a margin.
#define IBGDA_MAX_NWQES 32768u
// Polls of a counter before a waiter starts to sleep between polls: short waits stay fast, long
// ones stop hammering the line other warps (maybe the ones being waited for) need.
#define IBGDA_SPIN_FAST 64u
// Sleep between polls once the fast polls are spent (__nanosleep hint, ns).
#define IBGDA_SPIN_SLEEP_NS 64u
// A waiter reads the (host-memory, PCIe-slow) error record once per this many polls.
#define IBGDA_ERROR_POLL_MASK 255u
// Payload bytes of one RDMA-write WQE in ibgda_put_warp: far below the 2 GiB a data segment can
// describe, and small enough that a large put spreads over the lanes of a warp.
#define IBGDA_PUT_CHUNK_BYTES (1u << 20)

#if defined(__CUDACC__)

// ---------------------------------------------------------------------------------------------
// Memory-model primitives. Generic addresses throughout: counters live in GPU memory, the error
// record and (cpu_host_memory) the producer slot in pinned host memory mapped for the device.

__device__ __forceinline__ uint64_t ibgda_globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint64_t ibgda_ld_acquire_gpu(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ibgda_ld_relaxed_gpu(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ibgda_st_release_gpu(uint64_t* p, uint64_t v) {
    asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void ibgda_st_relaxed_gpu(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ibgda_ld_relaxed_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t ibgda_ld_acquire_sys_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t ibgda_ld_relaxed_sys_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ibgda_st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void ibgda_st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void ibgda_st_release_sys_u32(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Fences. With a relaxed load before it (that reads a release store) a fence.acq_rel acquires,
// with a relaxed store after it it releases: ibgda_publish uses one fence for both.
__device__ __forceinline__ void ibgda_fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ void ibgda_fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// The store to a doorbell register: exactly once, never merged or cached (st.mmio). On the
// emulator db_reg is a host page the emulator polls; the same instruction serves.
__device__ __forceinline__ void ibgda_st_mmio_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.mmio.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Monotonic publish to a producer slot the CPU reads: release at system scope, so every WQE store
// this thread has observed (its own and, through ready_head, its predecessors') is visible to the
// proxy and the NIC before the new value is.
__device__ __forceinline__ void ibgda_red_max_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("red.release.sys.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ bool ibgda_try_lock(uint32_t* lock) {
    uint32_t old;
    asm volatile("atom.acquire.gpu.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(lock) : "memory");
    return old == 0u;
}

__device__ __forceinline__ void ibgda_unlock(uint32_t* lock) {
    asm volatile("st.release.gpu.u32 [%0], 0;" ::"l"(lock) : "memory");
}

// The doorbell lock of mode gpu: the counters line's word at byte 44 (db_lock),
// owned by this header. Only the ringer that holds it writes the doorbell record and db_reg.
__device__ __forceinline__ uint32_t* ibgda_db_lock(ibgda_qp_desc* d) { return &d->counters.db_lock; }

// ---------------------------------------------------------------------------------------------
// Errors

// Whether some thread has already recorded a failure in this QP's error record.
__device__ __forceinline__ bool ibgda_error_seen(const ibgda_qp_desc* d) {
    const ibgda_error_record* r = (const ibgda_error_record*)d->error_record;
    return r != nullptr && ibgda_ld_relaxed_sys_u32(&r->kind) != IBGDA_ERROR_NONE;
}

// Fills the error record if no one has (the first failure wins): counters, mode, and for an
// error CQE its syndromes. `kind` is stored last, after a system fence, so the host never sees
// a half-written record.
__device__ __noinline__ void ibgda_record_error(ibgda_qp_desc* d, uint32_t kind, const ibgda_cqe_status* cqe) {
    ibgda_error_record* r = (ibgda_error_record*)d->error_record;
    if (r == nullptr) return;
    if (atomicCAS_system(&r->claim, 0u, 1u) != 0u) return;
    ibgda_qp_counters* c = &d->counters;
    uint64_t prod = ibgda_ld_relaxed_gpu(&c->prod_idx);
    // In the CPU modes the proxy rings and cannot write GPU memory: report what was handed to it.
    if (d->handler_mode != IBGDA_HANDLER_GPU && d->producer_slot != 0 && (d->producer_slot & 7u) == 0)
        prod = ibgda_ld_relaxed_sys((const uint64_t*)d->producer_slot);
    ibgda_st_relaxed_sys_u32(&r->rank, d->rank);
    ibgda_st_relaxed_sys_u32(&r->qp_index, d->qp_index);
    ibgda_st_relaxed_sys_u32(&r->qpn, d->qpn);
    ibgda_st_relaxed_sys_u64(&r->resv_head, ibgda_ld_relaxed_gpu(&c->resv_head));
    ibgda_st_relaxed_sys_u64(&r->ready_head, ibgda_ld_relaxed_gpu(&c->ready_head));
    ibgda_st_relaxed_sys_u64(&r->prod_idx, prod);
    ibgda_st_relaxed_sys_u64(&r->cons_idx, ibgda_ld_relaxed_gpu(&c->cons_idx));
    ibgda_st_relaxed_sys_u32(&r->handler_mode, d->handler_mode);
    // Bytes [52,56): syndrome, vendor syndrome, CQE opcode, WQE opcode; then [56,60) counter.
    uint32_t synd = 0, counter = 0;
    if (cqe != nullptr) {
        synd = (uint32_t)cqe->syndrome | ((uint32_t)cqe->vendor_syndrome << 8) | ((uint32_t)cqe->opcode << 16) |
               ((uint32_t)cqe->wqe_opcode << 24);
        counter = (uint32_t)cqe->wqe_counter;
    }
    ibgda_st_relaxed_sys_u32((uint32_t*)((uint8_t*)r + 52), synd);
    ibgda_st_relaxed_sys_u32((uint32_t*)((uint8_t*)r + 56), counter);
    __threadfence_system();
    ibgda_st_release_sys_u32(&r->kind, kind);
}

// A bounded wait: started from the descriptor's timeout, stepped once per poll. It keeps the start
// and the bound, not start + bound, so no timeout_ns (up to ~0) can wrap into a past deadline.
struct ibgda_waiter {
    uint64_t start;
    uint64_t bound;
    uint32_t polls;
};

__device__ __forceinline__ ibgda_waiter ibgda_wait_begin(const ibgda_qp_desc* d) {
    ibgda_waiter w;
    w.start = ibgda_globaltimer();
    w.bound = ibgda_wait_bound_ns(d->timeout_ns);
    w.polls = 0;
    return w;
}

// One more poll: IBGDA_STATUS_OK to keep waiting; on expiry records `kind` and returns it; when a
// failure is already recorded, IBGDA_STATUS_ABORTED.
__device__ __forceinline__ int ibgda_wait_step(ibgda_qp_desc* d, ibgda_waiter& w, uint32_t kind) {
    ++w.polls;
    if (w.polls > IBGDA_SPIN_FAST) __nanosleep(IBGDA_SPIN_SLEEP_NS);
    if ((w.polls & IBGDA_ERROR_POLL_MASK) == 0u && ibgda_error_seen(d)) return IBGDA_STATUS_ABORTED;
    if (ibgda_globaltimer() - w.start > w.bound) {
        ibgda_record_error(d, kind, nullptr);
        return (int)kind;
    }
    return IBGDA_STATUS_OK;
}

// Checks what the protocol assumes of a descriptor; records IBGDA_ERROR_INVALID_DESC when broken.
// The producer slot in particular must be an 8-byte-aligned u64: the proxy reads it with one
// 8-byte load, and a misaligned or narrower slot would tear or clobber its neighbour.
__device__ __noinline__ int ibgda_check_desc(ibgda_qp_desc* d) {
    bool ok = d->nwqes != 0u && (d->nwqes & (d->nwqes - 1u)) == 0u && d->nwqes <= IBGDA_MAX_NWQES &&
              d->ncqes != 0u && (d->ncqes & (d->ncqes - 1u)) == 0u && d->ncqes >= d->nwqes && d->wq_base != 0 &&
              (d->wq_base & 63u) == 0 && d->cq_base != 0 && (d->cq_base & 63u) == 0;
    if (d->handler_mode == IBGDA_HANDLER_GPU)
        ok = ok && d->dbr != 0 && (d->dbr & 7u) == 0 && d->db_reg != 0 && (d->db_reg & 7u) == 0 &&
             d->producer_slot == 0;
    else if (d->handler_mode == IBGDA_HANDLER_CPU || d->handler_mode == IBGDA_HANDLER_CPU_HOST_MEMORY)
        ok = ok && d->producer_slot != 0 && (d->producer_slot & 7u) == 0 && d->db_reg == 0;
    else
        ok = false;
    if (ok) return IBGDA_STATUS_OK;
    ibgda_record_error(d, IBGDA_ERROR_INVALID_DESC, nullptr);
    return (int)IBGDA_ERROR_INVALID_DESC;
}

// ---------------------------------------------------------------------------------------------
// Completions

// Consumes every CQE the NIC has written, if no other thread is doing it right now, advancing
// cons_idx past each completed WQEBB. An error CQE is left in place (so every later poller sees
// it too), recorded, and returned as IBGDA_ERROR_CQE.
__device__ __noinline__ int ibgda_poll_cq(ibgda_qp_desc* d) {
    ibgda_qp_counters* c = &d->counters;
    if (!ibgda_try_lock(&c->poll_lock)) return IBGDA_STATUS_OK;
    const ibgda_cqe64* cq = (const ibgda_cqe64*)d->cq_base;
    uint64_t ci = ibgda_ld_relaxed_gpu(&c->cq_cons_idx);
    uint64_t cons = ibgda_ld_relaxed_gpu(&c->cons_idx);
    uint64_t done = cons;
    int status = IBGDA_STATUS_OK;
    for (uint32_t k = 0; k < d->ncqes; ++k) {
        ibgda_cqe_status s = ibgda_cqe_poll(cq, ci, d->ncqes);
        if (s.state == IBGDA_CQE_STATE_EMPTY) break;
        if (s.state == IBGDA_CQE_STATE_ERROR) {
            ibgda_record_error(d, IBGDA_ERROR_CQE, &s);
            status = (int)IBGDA_ERROR_CQE;
            break;
        }
        // Every written WQEBB lies in [cons_idx, cons_idx + nwqes) (the reservation's wait), so
        // the 16-bit counter names one index in [done, done + 65536).
        done = ibgda_wqe_index_from_counter(s.wqe_counter, done + 65536u) + 1u;
        ++ci;
    }
    if (ci != ibgda_ld_relaxed_gpu(&c->cq_cons_idx)) {
        ibgda_st_relaxed_gpu(&c->cq_cons_idx, ci);
        // The CQ doorbell record tells the NIC these CQE slots are free again.
        if (d->cq_dbr != 0) ibgda_st_relaxed_sys_u32((uint32_t*)d->cq_dbr, ibgda_htobe32((uint32_t)ci & 0xffffffu));
    }
    if (done > cons) ibgda_st_release_gpu(&c->cons_idx, done);
    ibgda_unlock(&c->poll_lock);
    return status;
}

// ---------------------------------------------------------------------------------------------
// Doorbells

// Mode gpu: rings the NIC up to the current ready_head unless prod_idx already covers `target`
// (which the caller has published). Serialised by the QP's doorbell lock, so the doorbell record
// and the doorbell register only ever move forward. `wait` = false gives up when another thread
// holds the lock (that thread may ring for us; a caller who must be covered passes true).
__device__ __noinline__ int ibgda_ring_gpu(ibgda_qp_desc* d, uint64_t target, bool wait) {
    ibgda_qp_counters* c = &d->counters;
    uint32_t* lock = ibgda_db_lock(d);
    ibgda_waiter w = ibgda_wait_begin(d);
    for (;;) {
        if (ibgda_ld_acquire_gpu(&c->prod_idx) >= target) return IBGDA_STATUS_OK;
        if (ibgda_try_lock(lock)) {
            uint64_t v = ibgda_ld_acquire_gpu(&c->ready_head);
            uint64_t p = ibgda_ld_relaxed_gpu(&c->prod_idx);
            if (v > p) {
                // The WQEs below v (ours, and our predecessors' seen through ready_head) reach the
                // system before the NIC can learn of them.
                __threadfence_system();
                ibgda_st_relaxed_sys_u32((uint32_t*)(d->dbr + IBGDA_DBR_SEND_OFFSET), ibgda_dbr_send_word(v));
                // The record before the doorbell: the NIC may read it when the doorbell arrives.
                __threadfence_system();
                ibgda_st_mmio_u64((uint64_t*)d->db_reg, ibgda_db_word(d->qpn, v));
                // Our doorbell is performed before the next ringer's, which takes the lock after us.
                __threadfence_system();
                ibgda_st_release_gpu(&c->prod_idx, v);
            }
            ibgda_unlock(lock);
            return IBGDA_STATUS_OK;
        }
        if (!wait) return IBGDA_STATUS_OK;
        int st = ibgda_wait_step(d, w, IBGDA_ERROR_TIMEOUT_OTHER);
        if (st != IBGDA_STATUS_OK) return st;
    }
}

// Makes sure a doorbell covers `target` (<= ready_head, published by the caller or observed by
// it): in mode gpu by ringing (or seeing someone else ring), in the CPU modes by raising the
// producer slot, which the proxy turns into a doorbell.
__device__ __forceinline__ int ibgda_ring_to(ibgda_qp_desc* d, uint64_t target) {
    if (d->handler_mode == IBGDA_HANDLER_GPU) return ibgda_ring_gpu(d, target, true);
    if (d->producer_slot == 0 || (d->producer_slot & 7u) != 0) return ibgda_check_desc(d);
    ibgda_red_max_release_sys((uint64_t*)d->producer_slot, target);
    return IBGDA_STATUS_OK;
}

// Flushes batched publishes: rings up to the current ready_head.
__device__ __forceinline__ int ibgda_ring_published(ibgda_qp_desc* d) {
    return ibgda_ring_to(d, ibgda_ld_acquire_gpu(&d->counters.ready_head));
}

// ---------------------------------------------------------------------------------------------
// Waiting for completions

// Waits (bounded; `kind` on expiry) until cons_idx >= target, consuming CQEs as they come. While
// waiting it keeps the doorbell up to ready_head, so a batch published without a doorbell (by
// anyone) can never leave this wait stuck.
__device__ __noinline__ int ibgda_wait_cons(ibgda_qp_desc* d, uint64_t target, uint32_t kind) {
    ibgda_qp_counters* c = &d->counters;
    ibgda_waiter w = ibgda_wait_begin(d);
    uint64_t pushed = 0; // CPU modes: the highest value this wait has put in the producer slot
    for (;;) {
        if (ibgda_ld_acquire_gpu(&c->cons_idx) >= target) return IBGDA_STATUS_OK;
        int st = ibgda_poll_cq(d);
        if (st != IBGDA_STATUS_OK) return st;
        if (ibgda_ld_acquire_gpu(&c->cons_idx) >= target) return IBGDA_STATUS_OK;
        uint64_t ready = ibgda_ld_acquire_gpu(&c->ready_head);
        if (d->handler_mode == IBGDA_HANDLER_GPU) {
            // Cheap when prod_idx already covers ready_head; never blocks on the doorbell lock
            // (its holder rings whatever was published before it took the lock).
            st = ibgda_ring_gpu(d, ready, false);
            if (st != IBGDA_STATUS_OK) return st;
        } else if (ready > pushed) {
            ibgda_red_max_release_sys((uint64_t*)d->producer_slot, ready);
            pushed = ready;
        }
        st = ibgda_wait_step(d, w, kind);
        if (st != IBGDA_STATUS_OK) return st;
    }
}

// ---------------------------------------------------------------------------------------------
// Submit

// What a reservation hands to its publish: the first reserved index, ready_head as read (relaxed)
// alongside the reservation, and the producer slot's address. When that read already found the
// turn (head == base), publish needs no load of its own: ready_head reaches base only once every
// earlier submission has published, and stays there until this one does. Publish starts with no
// load at all: what it needs arrived while the WQEs were being written.
struct ibgda_ticket {
    uint64_t base;
    uint64_t head;
    uint64_t* slot;
};

// Step 1: reserves `n` WQEBBs (1 <= n <= nwqes) and waits until their slots are free. On success
// t->base is the index of the first; the caller must write and then publish exactly
// [base, base+n) with this ticket before it reserves again on this QP. The ready_head read is
// issued while the reservation's atomic is in flight (it does not need the atomic's result), so
// its round trip hides behind that one instead of following the caller's WQE stores; a ring-full
// wait reads it again after.
__device__ __forceinline__ int ibgda_reserve(ibgda_qp_desc* d, uint32_t n, ibgda_ticket* t) {
    const uint32_t nwqes = d->nwqes;
    t->slot = (uint64_t*)d->producer_slot;
    if (n == 0u || n > nwqes) {
        // No wait could ever make room: report it as the reservation failure it is, at once.
        ibgda_record_error(d, IBGDA_ERROR_TIMEOUT_RESERVE, nullptr);
        return (int)IBGDA_ERROR_TIMEOUT_RESERVE;
    }
    ibgda_qp_counters* c = &d->counters;
    uint64_t b = atomicAdd((unsigned long long*)&c->resv_head, (unsigned long long)n);
    t->head = ibgda_ld_relaxed_gpu(&c->ready_head);
    t->base = b;
    uint64_t end = b + n;
    if (end > (uint64_t)nwqes) {
        uint64_t need = end - nwqes;
        if (ibgda_ld_acquire_gpu(&c->cons_idx) < need) {
            int st = ibgda_wait_cons(d, need, IBGDA_ERROR_TIMEOUT_RESERVE);
            if (st != IBGDA_STATUS_OK) return st;
            t->head = ibgda_ld_relaxed_gpu(&c->ready_head);
        }
    }
    return IBGDA_STATUS_OK;
}

// The ring slot of WQEBB index `idx`.
__device__ __forceinline__ void* ibgda_slot(const ibgda_qp_desc* d, uint64_t idx) {
    return (void*)(d->wq_base + (idx & (uint64_t)(d->nwqes - 1u)) * IBGDA_WQEBB_BYTES);
}

// Step 3's wait (bounded): until ready_head == base, i.e. every earlier submission on the QP
// has published. Acquire loads, though publish's fence would do: the wait is the slow path.
__device__ __noinline__ int ibgda_wait_turn(ibgda_qp_desc* d, uint64_t base) {
    ibgda_waiter w = ibgda_wait_begin(d);
    while (ibgda_ld_acquire_gpu(&d->counters.ready_head) != base) {
        int st = ibgda_wait_step(d, w, IBGDA_ERROR_TIMEOUT_READY);
        if (st != IBGDA_STATUS_OK) return st;
    }
    return IBGDA_STATUS_OK;
}

// Steps 3 and 4: publishes [t.base, t.base+n) in order and, with `ring`, makes a doorbell cover
// it. Every WQE store of the submission (by this thread, or by lanes that synchronised with it
// since) must precede the call.
//
// Ordering. The turn is a read of ready_head == base: the ticket's relaxed read, or the wait's
// acquire. That read sees the predecessor's release of ready_head; the fence.acq_rel after it is
// the acquire half of the synchronisation, so every WQE store the predecessors made (or saw)
// happens before what this thread does next. The same fence is the release half for the stores
// after it: the producer slot (CPU modes) and ready_head (which the successor and quiet read),
// and it orders this submission's own WQE stores before both. In mode gpu, ibgda_ring_gpu fences
// at system scope again before the doorbell record.
//
// The CPU modes raise the producer slot while holding the turn: fence.acq_rel.sys, a relaxed
// system-scope store of the slot, then ready_head with a gpu-scope release. A plain store (a
// posted write) where an atomicMax would wait for an atomic's round trip over PCIe; bench_proxy's
// `proxy_publish_one_way` rows measure both.
// - Visibility: the fence orders every WQE below base + n (ours, and the predecessors' through
//   the acquire half) before the slot value the proxy loads with acquire.
// - Monotonic slot: the in-turn stores of successive submissions are ordered by the ready_head
//   chain (slot store, then the release of ready_head, then the successor's read and its fence,
//   then its slot store), so coherence keeps them in increasing order. The only other writers are
//   the flushes' atomicMax of a value v they read (acquire) from ready_head: every in-turn store
//   of a value <= v precedes that read, so no in-turn store after the flush in coherence order
//   writes less than v, and a max never lowers the slot. Hence the slot only grows, and the proxy
//   (which rings up to the latest value it reads) never misses a publish.
//
// Why the fence is .sys, although its scope is the part of the cost the GPU could cut: the proxy
// and the NIC are observers outside the GPU, and the PTX memory model orders a thread's stores
// for them only at system scope. bench_proxy measured (2x H200, 2026-11-30) the same sequence
// with a .gpu fence at 0.26-0.48 us less per publish (`gpu_scope_fence`), and DeepEP orders its
// doorbells at gpu scope; that rests on the hardware (WQEs acknowledged by L2, which serves the
// NIC's reads of GPU memory) rather than on the model, and no NIC here could test it, so it is
// not done.
__device__ __forceinline__ int ibgda_publish(ibgda_qp_desc* d, const ibgda_ticket& t, uint32_t n, bool ring) {
    ibgda_qp_counters* c = &d->counters;
    const uint64_t end = t.base + n;
    // A valid descriptor has a producer slot exactly in the CPU modes (ibgda_check_desc, and
    // QpDesc::validate on the host), so the slot alone tells the mode on this path; the mode
    // word is read only when there is no usable slot.
    uint64_t* const slot = t.slot;
    const bool raise = ring && slot != nullptr && ((uint64_t)slot & 7u) == 0;
    // The turn is usually free already: that path falls straight through to the stores, the
    // bounded wait lives out of line.
    if (__builtin_expect(t.head != t.base, 0)) {
        int st = ibgda_wait_turn(d, t.base);
        if (st != IBGDA_STATUS_OK) return st;
    }
    if (raise) {
        ibgda_fence_acq_rel_sys();
        ibgda_st_relaxed_sys_u64(slot, end);
        ibgda_st_release_gpu(&c->ready_head, end);
        return IBGDA_STATUS_OK;
    }
    ibgda_fence_acq_rel_gpu();
    ibgda_st_relaxed_gpu(&c->ready_head, end);
    if (!ring) return IBGDA_STATUS_OK;
    if (d->handler_mode == IBGDA_HANDLER_GPU) return ibgda_ring_gpu(d, end, true);
    // A CPU mode without a usable slot: the turn is passed on (successors are not blocked by a
    // bad descriptor of ours), and the error is recorded and returned.
    return ibgda_check_desc(d);
}

// Step 5: waits until every WQE published on this QP so far has completed.
__device__ __forceinline__ int ibgda_quiet(ibgda_qp_desc* d) {
    uint64_t target = ibgda_ld_acquire_gpu(&d->counters.ready_head);
    if (ibgda_ld_acquire_gpu(&d->counters.cons_idx) >= target) return IBGDA_STATUS_OK;
    int st = ibgda_ring_to(d, target);
    if (st != IBGDA_STATUS_OK) return st;
    return ibgda_wait_cons(d, target, IBGDA_ERROR_TIMEOUT_QUIET);
}

// ---------------------------------------------------------------------------------------------
// Operations (one thread unless the name says warp). Each is one submission whose last WQEBB asks
// for a CQE, posted with the descriptor's lkey for local buffers.

// RDMA write of `bytes` (<= 2 GiB) from local `laddr` to remote `raddr`.
__device__ __forceinline__ int ibgda_put(ibgda_qp_desc* d, uint64_t raddr, uint32_t rkey, uint64_t laddr,
                                         uint32_t bytes, bool ring) {
    ibgda_ticket t;
    int st = ibgda_reserve(d, 1u, &t);
    if (st != IBGDA_STATUS_OK) return st;
    const uint64_t base = t.base;
    ibgda_wqebb_store(ibgda_slot(d, base), ibgda_wqe_rdma_write(d->qpn, (uint16_t)base, ibgda_fm_ce_se(IBGDA_FENCE_NONE, true),
                                                                raddr, rkey, laddr, d->lkey, bytes));
    return ibgda_publish(d, t, 1u, ring);
}

// Inline RDMA write of a 4-byte value: the payload travels in the WQE, no local buffer.
__device__ __forceinline__ int ibgda_put_inline4(ibgda_qp_desc* d, uint64_t raddr, uint32_t rkey, uint32_t value,
                                                 bool ring) {
    ibgda_ticket t;
    int st = ibgda_reserve(d, 1u, &t);
    if (st != IBGDA_STATUS_OK) return st;
    const uint64_t base = t.base;
    ibgda_wqebb_store(ibgda_slot(d, base), ibgda_wqe_inline_write(d->qpn, (uint16_t)base,
                                                                  ibgda_fm_ce_se(IBGDA_FENCE_NONE, true), raddr, rkey,
                                                                  &value, 4u));
    return ibgda_publish(d, t, 1u, ring);
}

// Inline RDMA write of an 8-byte value.
__device__ __forceinline__ int ibgda_put_inline8(ibgda_qp_desc* d, uint64_t raddr, uint32_t rkey, uint64_t value,
                                                 bool ring) {
    ibgda_ticket t;
    int st = ibgda_reserve(d, 1u, &t);
    if (st != IBGDA_STATUS_OK) return st;
    const uint64_t base = t.base;
    ibgda_wqebb_store(ibgda_slot(d, base), ibgda_wqe_inline_write(d->qpn, (uint16_t)base,
                                                                  ibgda_fm_ce_se(IBGDA_FENCE_NONE, true), raddr, rkey,
                                                                  &value, 8u));
    return ibgda_publish(d, t, 1u, ring);
}

// Non-fetching 64-bit remote atomic add, for signals: the old value goes to the descriptor's
// scratch word, which nobody reads. With `fence` the add waits for this QP's earlier WQEs (the
// data a signal announces) to complete first.
__device__ __forceinline__ int ibgda_signal_add(ibgda_qp_desc* d, uint64_t raddr, uint32_t rkey, uint64_t add,
                                                bool fence, bool ring) {
    ibgda_ticket t;
    int st = ibgda_reserve(d, 1u, &t);
    if (st != IBGDA_STATUS_OK) return st;
    const uint64_t base = t.base;
    ibgda_wqebb_store(ibgda_slot(d, base),
                      ibgda_wqe_fetch_add64(d->qpn, (uint16_t)base,
                                            ibgda_fm_ce_se(fence ? IBGDA_FENCE_SMALL_AND_FENCE : IBGDA_FENCE_NONE, true),
                                            raddr, rkey, d->scratch, d->lkey, add));
    return ibgda_publish(d, t, 1u, ring);
}

// A NOP that asks for a CQE: a submission with no effect, for barriers and tests.
__device__ __forceinline__ int ibgda_nop(ibgda_qp_desc* d, bool ring) {
    ibgda_ticket t;
    int st = ibgda_reserve(d, 1u, &t);
    if (st != IBGDA_STATUS_OK) return st;
    const uint64_t base = t.base;
    ibgda_wqebb_store(ibgda_slot(d, base), ibgda_wqe_nop(d->qpn, (uint16_t)base, ibgda_fm_ce_se(IBGDA_FENCE_NONE, true)));
    return ibgda_publish(d, t, 1u, ring);
}

// Warp-cooperative RDMA write: all 32 lanes call it with the same arguments. The put is cut into
// chunks of `chunk` bytes (0: IBGDA_PUT_CHUNK_BYTES); up to 32 chunks go in one submission, lane i
// writing the WQE of chunk i, lane 0 reserving and publishing. Returns the same status on every lane.
__device__ __forceinline__ int ibgda_put_warp(ibgda_qp_desc* d, uint64_t raddr, uint32_t rkey, uint64_t laddr,
                                              uint64_t bytes, uint32_t chunk, bool ring) {
    const uint32_t lane = threadIdx.x & 31u;
    if (chunk == 0u) chunk = IBGDA_PUT_CHUNK_BYTES;
    const uint64_t nchunks = bytes == 0 ? 0 : (bytes + chunk - 1u) / chunk;
    const uint32_t per_sub = d->nwqes < 32u ? d->nwqes : 32u;
    for (uint64_t first = 0; first < nchunks; first += per_sub) {
        uint32_t n = (uint32_t)((nchunks - first) < per_sub ? (nchunks - first) : per_sub);
        ibgda_ticket t = {0, 0, nullptr};
        int st = IBGDA_STATUS_OK;
        if (lane == 0u) st = ibgda_reserve(d, n, &t);
        st = __shfl_sync(0xffffffffu, st, 0);
        if (st != IBGDA_STATUS_OK) return st;
        const uint64_t base = __shfl_sync(0xffffffffu, t.base, 0);
        if (lane < n) {
            uint64_t off = (first + lane) * (uint64_t)chunk;
            uint32_t len = (uint32_t)((bytes - off) < chunk ? (bytes - off) : chunk);
            bool last = lane == n - 1u;
            ibgda_wqebb_store(ibgda_slot(d, base + lane),
                              ibgda_wqe_rdma_write(d->qpn, (uint16_t)(base + lane), ibgda_fm_ce_se(IBGDA_FENCE_NONE, last),
                                                   raddr + off, rkey, laddr + off, d->lkey, len));
        }
        __syncwarp();
        // Lane 0 holds the ticket: it reserved.
        if (lane == 0u) st = ibgda_publish(d, t, n, ring);
        st = __shfl_sync(0xffffffffu, st, 0);
        if (st != IBGDA_STATUS_OK) return st;
    }
    return IBGDA_STATUS_OK;
}

#endif // __CUDACC__
