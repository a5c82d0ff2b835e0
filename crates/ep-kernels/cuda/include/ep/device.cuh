// Device helpers shared by the EP kernels: memory-model primitives at system scope (peers and
// the host observe these words), streaming 16-byte copies, bounded waits and error reporting.
#pragma once
#include <cstdint>

#include "ep/intranode.cuh"
#include "ibgda/qp_desc.cuh"  // ibgda_wait_bound_ns: a timeout_ns of 0 is the default bound

namespace ep {

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// A read-once 16-byte load: not kept in L1 (the row is read once and sent on). Only for memory
// no thread writes during the kernel (not volatile: the compiler may batch these loads).
__device__ __forceinline__ int4 ld_stream_v4(const int4* p) {
    int4 v;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// A 16-byte load of peer memory (coherent path), not kept in L1.
__device__ __forceinline__ int4 ld_peer_v4(const int4* p) {
    int4 v;
    asm("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// A 16-byte store that is not kept in L1 (peer memory or a row nobody on this SM reads back).
__device__ __forceinline__ void st_stream_v4(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

// Records the first error of this rank: claimed in the device slot (first writer wins, later
// errors are dropped), then reported in the host-mapped ErrorWord, its code stored last.
__device__ __forceinline__ void record_error(uint64_t error_slot, uint32_t code, int rank, int peer,
                                             uint32_t what, uint64_t epoch, uint64_t detail) {
    ErrorSlot* s = reinterpret_cast<ErrorSlot*>(error_slot);
    if (atomicCAS(&s->code, 0u, code) == 0u) {
        ErrorWord* e = reinterpret_cast<ErrorWord*>(s->host);
        e->rank = static_cast<uint32_t>(rank);
        e->peer = static_cast<uint32_t>(peer);
        e->what = what;
        e->epoch = epoch;
        e->detail = detail;
        __threadfence_system();
        atomicExch_system(&e->code, code);
    }
}

// Whether this rank has recorded an error (any thread may call; one read of device memory, cheap
// enough for every block at kernel start and in every wait loop).
__device__ __forceinline__ bool error_recorded(uint64_t error_slot) {
    return ld_volatile_u32(&reinterpret_cast<const ErrorSlot*>(error_slot)->code) != 0u;
}

__device__ __forceinline__ SignalHead* signal_of(const uint64_t* signals, int r) {
    return reinterpret_cast<SignalHead*>(signals[r]);
}

// ---- Rank links (rank masks in normal mode) ----
// A link set is a bitmask over ranks: bit r set = this rank exchanges data with rank r. Barriers
// release to and wait for linked ranks only, so ranks that mask each other never wait on each
// other.
constexpr uint32_t kAllLinked = 0xffffffffu;

__device__ __forceinline__ bool linked(uint32_t links, int r) { return ((links >> r) & 1u) != 0u; }

// The ranks this rank links: every rank < ranks not masked in `mask` (int32 [kMaxRanks], 1 =
// masked; 0 = no mask), and always this rank itself.
__device__ __forceinline__ uint32_t links_of(uint64_t mask, int rank, int ranks) {
    uint32_t links = 0;
    for (int r = 0; r < ranks && r < kMaxRanks; ++r) {
        const bool masked =
            mask != 0 && r != rank && ld_volatile_u32(reinterpret_cast<const uint32_t*>(mask) + r) != 0u;
        if (!masked) links |= 1u << r;
    }
    return links;
}

// Thread r < ranks releases `epoch` to rank r's flag slot for this rank, if r is in `links`.
// Everything this block wrote before (ordered by the caller's __syncthreads) becomes visible to
// rank r first.
__device__ __forceinline__ void release_to_peers(const uint64_t* signals, int rank, int ranks, uint64_t epoch,
                                                 uint32_t links = kAllLinked) {
    const int r = threadIdx.x;
    if (r < ranks && linked(links, r)) {
        __threadfence_system();
        st_release_sys(&signal_of(signals, r)->flag[rank], epoch);
    }
}

// Polls of a flag between two reads of the error slot in a wait (keeps the wait loop tight).
constexpr uint32_t kErrorPollMask = 1023u;

// What a wait asks, now and then, about the peer it waits for: whether to stop waiting (having
// recorded why). This one never stops.
struct NoPeerCheck {
    __device__ __forceinline__ bool operator()(int) const { return false; }
};

// Thread r < ranks in `links` waits, bounded, until rank r has released `epoch` to this rank
// (an unlinked rank is not waited for); every kErrorPollMask + 1 polls it also asks
// `give_up(r)`, which may end the wait as an error would. Returns false
// on every thread of the block if any wait ran out (the error is recorded) or an error recorded
// by another wait of this rank was seen (that wait's record stands: the peer it names is the
// cause, this one would only time out later). `timeout_ns` 0 is the default bound.
template <typename GiveUp = NoPeerCheck>
__device__ __forceinline__ bool wait_for_peers(const uint64_t* signals, int rank, int ranks, uint64_t epoch,
                                               uint64_t timeout_ns, uint64_t error_addr, uint32_t what,
                                               uint32_t links = kAllLinked, const GiveUp& give_up = GiveUp()) {
    __shared__ int timed_out;
    if (threadIdx.x == 0) timed_out = 0;
    __syncthreads();
    const int r = threadIdx.x;
    if (r < ranks && linked(links, r)) {
        const uint64_t* f = &signal_of(signals, rank)->flag[r];
        const uint64_t start = globaltimer_ns();
        const uint64_t bound = ibgda_wait_bound_ns(timeout_ns);
        uint32_t polls = 0;
        uint64_t seen;
        while ((seen = ld_acquire_sys(f)) < epoch) {
            if ((++polls & kErrorPollMask) == 0u && (error_recorded(error_addr) || give_up(r))) {
                atomicExch(&timed_out, 1);
                break;
            }
            if (globaltimer_ns() - start > bound) {
                record_error(error_addr, kErrTimeout, rank, r, what, epoch, seen);
                atomicExch(&timed_out, 1);
                break;
            }
        }
    }
    __syncthreads();
    return timed_out == 0;
}

__device__ __forceinline__ uint16_t f32_to_bf16_rn(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

}  // namespace ep
