// Test and benchmark kernels of the submit/quiet protocol (ibgda/protocol.cuh), driven by
// crates/ep/tests/gpu_protocol.rs and examples/src/bin/bench_proxy.rs against the emulated NIC.
//
// Conventions: `descs` is the device array of the rank's QP descriptors; `status` receives the
// first non-zero protocol status any thread saw (0 = all succeeded); times are %globaltimer ns.
#include "ibgda/protocol.cuh"

// Keeps the first failure: later ones are consequences.
__device__ __forceinline__ void note_status(int* status, int st) {
    if (st != IBGDA_STATUS_OK) atomicCAS(status, 0, st);
}

// Test 4 (device side): every descriptor passes the protocol's checks, among them an 8-byte
// aligned producer slot in the CPU modes. One thread per QP; per-QP status in `status[qp]`.
extern "C" __global__ void protocol_check_descs(ibgda_qp_desc* descs, uint32_t nqps, int* status) {
    static_assert(sizeof(((ibgda_qp_desc*)0)->producer_slot) == 8, "producer_slot is a 64-bit pointer");
    static_assert(offsetof(ibgda_qp_desc, producer_slot) % 8 == 0, "producer_slot field is 8-byte aligned");
    uint32_t q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q < nqps) status[q] = ibgda_check_desc(&descs[q]);
}

// One RDMA write and a quiet on QP `qp`, by one thread: the first submission of a run (test 1),
// and the quiet-waits-for-delayed-completions check (test 3). times[0..3] = before the put, after
// the put (published and rung), after the quiet. With `verify` non-zero, after the quiet the
// kernel reads the `bytes` at `verify` (the destination, as this GPU sees it) and counts the bytes
// that differ from `expect` into mismatches[0]: a quiet that returned early shows up there.
extern "C" __global__ void protocol_put_quiet(ibgda_qp_desc* descs, uint32_t qp, uint64_t raddr, uint32_t rkey,
                                              uint64_t laddr, uint32_t bytes, uint64_t verify, uint64_t expect,
                                              int* status, uint64_t* times, uint32_t* mismatches) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    ibgda_qp_desc* d = &descs[qp];
    times[0] = ibgda_globaltimer();
    int st = ibgda_put(d, raddr, rkey, laddr, bytes, true);
    times[1] = ibgda_globaltimer();
    if (st == IBGDA_STATUS_OK) st = ibgda_quiet(d);
    times[2] = ibgda_globaltimer();
    note_status(status, st);
    if (st == IBGDA_STATUS_OK && verify != 0) {
        const volatile uint8_t* v = (const volatile uint8_t*)verify;
        const volatile uint8_t* e = (const volatile uint8_t*)expect;
        uint32_t bad = 0;
        for (uint32_t i = 0; i < bytes; ++i) bad += v[i] != e[i] ? 1u : 0u;
        mismatches[0] = bad;
    }
}

// Test 2, the workload: every warp of the grid does `iters` warp-cooperative puts of `bytes`
// each, round-robin over the `nqps` shared QPs, from its own slice of `src` to the same slice of
// the remote buffer at `raddr`; only every `batch`-th put rings (doorbell batching), and the warp
// quiets every QP at the end. Warp w's slice i starts at ((w * iters + i) * bytes).
extern "C" __global__ void protocol_heavy(ibgda_qp_desc* descs, uint32_t nqps, uint32_t iters, uint32_t batch,
                                          uint64_t raddr, uint32_t rkey, uint64_t src, uint32_t bytes, uint32_t chunk,
                                          int* status) {
    const uint32_t warps_per_block = blockDim.x / 32u;
    const uint64_t warp = (uint64_t)blockIdx.x * warps_per_block + threadIdx.x / 32u;
    int st = IBGDA_STATUS_OK;
    for (uint32_t i = 0; i < iters && st == IBGDA_STATUS_OK; ++i) {
        ibgda_qp_desc* d = &descs[(warp + i) % nqps];
        uint64_t off = (warp * iters + i) * (uint64_t)bytes;
        bool ring = batch <= 1u || (i % batch) == batch - 1u || i == iters - 1u;
        st = ibgda_put_warp(d, raddr + off, rkey, src + off, bytes, chunk, ring);
    }
    if ((threadIdx.x & 31u) == 0u) {
        for (uint32_t q = 0; q < nqps && st == IBGDA_STATUS_OK; ++q) st = ibgda_quiet(&descs[q]);
        note_status(status, st);
    }
}

// Test 2, the other submitter: a barrier over the same QPs, as a teardown would run it. One
// thread per QP adds 1 to the remote 64-bit counter `raddr + 8 * qp` (fenced after everything
// before it on the QP), then quiets.
extern "C" __global__ void protocol_barrier(ibgda_qp_desc* descs, uint32_t nqps, uint64_t raddr, uint32_t rkey,
                                            int* status) {
    uint32_t q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nqps) return;
    ibgda_qp_desc* d = &descs[q];
    int st = ibgda_signal_add(d, raddr + 8u * q, rkey, 1u, true, true);
    if (st == IBGDA_STATUS_OK) st = ibgda_quiet(d);
    note_status(status, st);
}

// Test 2, the broken ordering: a submitter that reserves `n` WQEBBs and never publishes them (a
// lost reservation). Every later submitter on the QP must end in IBGDA_ERROR_TIMEOUT_READY.
extern "C" __global__ void protocol_lose_reservation(ibgda_qp_desc* descs, uint32_t qp, uint32_t n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd((unsigned long long*)&descs[qp].counters.resv_head, n);
}

// The emulator must progress while waiting kernels fill the GPU: every block (launch as many as
// fit at once) has its thread 0 do a put and a quiet on QP (block % nqps), to its own 8-byte slot
// of the remote buffer from the same slot of `src`, while the block's other threads wait at the
// barrier. status as above; done[block] = 1 afterwards.
extern "C" __global__ void protocol_fill_gpu(ibgda_qp_desc* descs, uint32_t nqps, uint64_t raddr, uint32_t rkey,
                                             uint64_t src, int* status, uint32_t* done) {
    if (threadIdx.x == 0) {
        ibgda_qp_desc* d = &descs[blockIdx.x % nqps];
        uint64_t off = 8ull * blockIdx.x;
        int st = ibgda_put(d, raddr + off, rkey, src + off, 8u, true);
        if (st == IBGDA_STATUS_OK) st = ibgda_quiet(d);
        note_status(status, st);
        done[blockIdx.x] = 1u;
    }
    __syncthreads();
}

// Inline 4- and 8-byte writes and a signal add on QP `qp`, then a quiet: values land at
// raddr (u32), raddr + 8 (u64), raddr + 16 (u64 counter, += add).
extern "C" __global__ void protocol_small_ops(ibgda_qp_desc* descs, uint32_t qp, uint64_t raddr, uint32_t rkey,
                                              uint32_t v4, uint64_t v8, uint64_t add, int* status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    ibgda_qp_desc* d = &descs[qp];
    int st = ibgda_put_inline4(d, raddr, rkey, v4, false);
    if (st == IBGDA_STATUS_OK) st = ibgda_put_inline8(d, raddr + 8u, rkey, v8, false);
    if (st == IBGDA_STATUS_OK) st = ibgda_signal_add(d, raddr + 16u, rkey, add, true, false);
    // Nothing rang so far: the quiet must flush the batch itself.
    if (st == IBGDA_STATUS_OK) st = ibgda_quiet(d);
    note_status(status, st);
}

// Benchmark: publish -> doorbell seen, as a round trip. For i in 1..=iters the thread publishes a
// NOP (ring: the producer slot in the CPU modes), then spins until the host's doorbell observer
// writes `ack` >= the new producer index; rtt[i-1] = the time between, and (when t_pub is not
// null) t_pub[i-1] = %globaltimer just before ibgda_publish and t_res[i-1] (when not null) just
// before ibgda_reserve, for the one-way measurements against the host clock. `pingpong` mode (qp
// ignored) writes i to `ping` instead and waits for the same ack, the plain PCIe round trip to
// subtract.
extern "C" __global__ void protocol_bench_rtt(ibgda_qp_desc* descs, uint32_t qp, uint32_t iters, uint32_t pingpong,
                                              uint64_t* ping, const uint64_t* ack, uint64_t* rtt, uint64_t* t_pub,
                                              uint64_t* t_res, int* status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    ibgda_qp_desc* d = &descs[qp];
    const uint64_t limit = ibgda_wait_bound_ns(d->timeout_ns);
    for (uint32_t i = 1; i <= iters; ++i) {
        uint64_t want, t0 = ibgda_globaltimer();
        const uint64_t tr = t0;
        if (pingpong) {
            want = i;
            ibgda_st_relaxed_sys_u64(ping, want);
        } else {
            ibgda_ticket t;
            int st = ibgda_reserve(d, 1u, &t);
            if (st == IBGDA_STATUS_OK) {
                ibgda_wqebb_store(ibgda_slot(d, t.base),
                                  ibgda_wqe_nop(d->qpn, (uint16_t)t.base, ibgda_fm_ce_se(IBGDA_FENCE_NONE, true)));
                t0 = ibgda_globaltimer();
                st = ibgda_publish(d, t, 1u, true);
            }
            if (st != IBGDA_STATUS_OK) {
                note_status(status, st);
                return;
            }
            want = t.base + 1u;
        }
        while (ibgda_ld_relaxed_sys(ack) < want) {
            if (ibgda_globaltimer() - t0 > limit) {
                note_status(status, (int)IBGDA_ERROR_TIMEOUT_OTHER);
                return;
            }
        }
        rtt[i - 1] = ibgda_globaltimer() - t0;
        if (t_pub != nullptr) t_pub[i - 1] = t0;
        if (t_res != nullptr) t_res[i - 1] = tr;
        // Keep the ring drained so reservations never wait in the measured section.
        if (!pingpong && (i & 63u) == 0u) {
            int st = ibgda_quiet(d);
            if (st != IBGDA_STATUS_OK) {
                note_status(status, st);
                return;
            }
        }
    }
}

// Benchmark: doorbell rate. Thread q (< nqps) publishes `iters` NOPs on QP q as fast as the
// protocol allows, ringing each (the proxy coalesces what it finds), and quiets at the end.
extern "C" __global__ void protocol_bench_publish(ibgda_qp_desc* descs, uint32_t nqps, uint32_t iters, int* status) {
    uint32_t q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nqps) return;
    ibgda_qp_desc* d = &descs[q];
    int st = IBGDA_STATUS_OK;
    for (uint32_t i = 0; i < iters && st == IBGDA_STATUS_OK; ++i) st = ibgda_nop(d, true);
    if (st == IBGDA_STATUS_OK) st = ibgda_quiet(d);
    note_status(status, st);
}

// Benchmark: the proxy alone. Thread q (< nqps) raises producer slot q (pinned host memory) with
// the system-scope release max the protocol's flushes use (its publishes store in turn instead; the
// stream-rate rows of bench_proxy measure that), as fast as it can, until the host sets
// *stop (read every 64 raises) or `limit_ns` passes. raised[q] = the last value written.
extern "C" __global__ void protocol_bench_slots(uint64_t* slots, uint32_t nqps, const uint32_t* stop,
                                                uint64_t limit_ns, uint64_t* raised) {
    uint32_t q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nqps) return;
    const uint64_t t0 = ibgda_globaltimer();
    uint64_t v = 0;
    for (;;) {
        for (int k = 0; k < 64; ++k) ibgda_red_max_release_sys(&slots[q], ++v);
        if (ibgda_ld_relaxed_sys_u32(stop) != 0u || ibgda_globaltimer() - t0 > limit_ns) break;
    }
    raised[q] = v;
}
