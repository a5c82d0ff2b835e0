// Low-latency dispatch/combine (DeepEP's "LL" mode, our own design): few tokens per rank, every
// token goes straight from the sender's registers/shared memory into its final slot in the
// receiver's per-expert region, one signal per (expert, source rank) announces the count.
//
// Regions (byte offsets into every rank's net buffer, equal on all ranks; the host computes them):
//   dispatch signals  u64 [half][local experts][ranks]      (n << 32) | (count + 1) for the n-th
//                                                           dispatch on the half, written only by
//                                                           the source rank
//   combine flags     u64 [half][experts]                   monotonic: the n-th combine on a half
//                                                           stores n (device-side sequence number)
//   dispatch recv     msg [half][local experts][ranks][max tokens]   msg = 16-byte header
//                                                           {src token, 0, 0, 0} | row | f32 scales
//   combine recv      bf16 [half][experts][max tokens][hidden]
//   combine send      bf16 [local experts][ranks * max tokens][hidden]  (zero-copy input; the
//                                                           transport's combine send staging)
//   dispatch staging  msg [max tokens]                      transport only: what the NIC reads
//
// Kernels take a phase mask: SEND only (hook mode: the kernel returns once the data is out),
// RECV only (the hook), or both in one launch (every block first sends, then receives; the grid
// is at most one block per SM so all blocks are resident and a receiving block never waits on a
// block that cannot run).
//
// The send path goes through one small interface, `Net` below: `peer(dst)` is the NVLink window
// of rank dst (0 when dst is reachable only through the transport), `put_warp` moves bytes from
// local memory, `signal` publishes a u64 after every earlier put to that rank, `quiet` waits for
// the transport. With NVLink disabled (`LlTransport`), every byte to another rank is an IBGDA
// RDMA write (ibgda_put_warp from the registered send staging) and every signal a fenced remote
// add (ibgda_signal_add) on QP `key % nqps` of the destination's group, where the key (the
// destination's local expert in dispatch, the expert in combine) is the same for a word and for
// the data it announces, so one QP carries both, in order. A signal word has exactly one writer
// (its source rank), through the transport or, for this rank's own experts, by a local store;
// nobody else writes it (the emulator's atomics on GPU memory are atomic only among its own ops).
//
// Ordering on NVLink (as DeepEP's p2p path): a block's rows, then __syncthreads, then a release
// (dispatch: a GPU-scope release add on the expert's finish counter, which the expert's count
// warp acquires before its system-scope release store of the signal; combine: the system-scope
// release store of the flag itself); receivers acquire at system scope. No fence.sc.sys
// (__threadfence_system) on these paths: the transport kernels keep theirs (the NIC reads the
// staging).
//
// Dispatch count signals are monotonic: the n-th dispatch on a half stores (n << 32) | (count + 1)
// (the sender remembers what it stored last, so the transport adds the difference); combine flags
// count the combines on a half. No receiver ever writes a signal word.
//
// Every wait is bounded by %globaltimer; a timeout records the first error (claimed in the device
// ErrorSlot, reported in the host-mapped ErrorWord: rank, peer, what, expert in `epoch`, last value
// seen) and the kernel winds down. A
// transport call that fails records kErrTransport (the QP group's own error record says why) and
// the kernel winds down the same way.
#include <cstddef>
#include <cstdint>

#include "ep/device.cuh"
#include "ep/logfmt.cuh"
#include "ibgda/protocol.cuh"

using namespace ep;

namespace {

// 32 warps: dispatch moves one token per block at a time, its top-k copies spread over the
// warps (32 / k warps per destination); the receive side gives each warp one row.
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopk = 16;
constexpr int kMaxHidden = 8192;
// Channels per FP8 scale.
constexpr int kFp8Block = 128;
// Largest message: header + BF16 row (the FP8 row with its scales is smaller).
constexpr int kMaxMsg16 = 1 + kMaxHidden * 2 / 16;
// 16-byte loads in flight per lane before the stores of a copy.
constexpr int kUnroll = 4;
// Most warps that share one row when an expert has fewer rows than the block has warps: a 14 KB
// row copied by one warp takes seven dependent load/store rounds; eight warps take one.
constexpr int kMaxWarpsPerRow = 8;
// Expert rows loaded at once per combine thread before they are summed (registers: 4 per row).
constexpr int kCombineBatch = 4;

// Warps per row for `rows` rows spread over a block's warps.
__device__ __forceinline__ int warps_per_row(int rows) {
    return rows <= 0 ? 1 : max(1, min(kMaxWarpsPerRow, kWarps / rows));
}

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// What a wait was for (ErrorWord::what), mirrored in ep_kernels::low_latency::wait_what.
constexpr uint32_t kWaitSendDone = 11;     // this rank's own warps finishing the sends to an expert
constexpr uint32_t kWaitDispatchRecv = 12; // a source rank's count signal for a local expert
constexpr uint32_t kWaitCombineRecv = 13;  // an expert's rank flagging its rows back
// Error code (beside ep's kErrTimeout): a top-k id outside [-1, experts); `epoch` holds the id.
constexpr uint32_t kErrBadExpert = 16;
// Error code: a transport (protocol.cuh) call returned a non-zero status; `peer` is the
// destination, `what` the call (kTransport*), `epoch` the status, `detail` the QP key.
constexpr uint32_t kErrTransport = 17;
// Error code: a routing value of the combine's handle out of range, not used: `what` a kRouting*
// value, `epoch` its flat index, `detail` the value, `peer` the largest value allowed.
constexpr uint32_t kErrBadRouting = 18;
// Error code: a combine top-k id >= 0 that is not the dispatch's there: `epoch` the token, `what`
// the slot, `detail` (dispatch id << 32) | combine id.
constexpr uint32_t kErrTopkMismatch = 19;
// Or-ed into `what` of kErrBadExpert when a combine found the id.
constexpr uint32_t kBadExpertInCombine = 0x100;
constexpr uint32_t kRoutingLayoutOffset = 31;
constexpr uint32_t kRoutingLayoutCount = 32;
constexpr uint32_t kRoutingSrcInfo = 33;
constexpr uint32_t kTransportPut = 21;
constexpr uint32_t kTransportSignal = 22;
constexpr uint32_t kTransportQuiet = 23;

struct LlDispatchParams {
    uint64_t peer_base[kMaxRanks];  // every rank's net buffer (NVLink window); 0: transport only
    uint64_t x;                     // bf16 [tokens][hidden]
    uint64_t topk_idx;              // int32 [tokens][topk], -1 = none
    uint64_t state;                 // LlState, local
    uint64_t out_x;                 // [local][ranks * max_tokens][hidden] bf16 or fp8
    uint64_t out_scales;            // f32 [..][hidden / 128] or u32 [..][hidden / 512] (UE8M0), or 0
    uint64_t out_src_info;          // int32 [local][ranks * max_tokens]
    uint64_t out_layout;            // int32 [local][ranks][2] = (offset, count)
    uint64_t out_count;             // int32 [local]
    uint64_t out_topk;              // int32 [tokens][topk]: a copy of topk_idx for combine's check
    uint64_t error;                 // ErrorSlot (device memory; points at the host-mapped ErrorWord)
    uint64_t timeout_ns;
    uint64_t signal_off;            // this half's dispatch signals
    uint64_t recv_off;              // this half's dispatch receive messages
    uint64_t transport;             // LlTransport (device memory), or 0: NVLink only
    int32_t rank;
    int32_t ranks;
    int32_t num_tokens;
    int32_t max_tokens;
    int32_t hidden;
    int32_t topk;
    int32_t num_experts;
    int32_t num_local;
    int32_t phases;
    int32_t fp8;                    // 0: BF16 rows; 1: FP8 e4m3 with per-128 scales
    int32_t round_scale;            // scales rounded up to powers of two
    int32_t ue8m0;                  // scales packed as UE8M0 exponent bytes, 4 per u32
    int32_t msg_bytes;
    int32_t half;                   // which half (0 or 1)
    uint64_t mask;                  // int32 [kMaxRanks] rank mask (enable_shrink), or 0
    uint64_t wait_stats;            // int64 [ranks]: wait cycles added per source rank, or 0
};
static_assert(sizeof(LlDispatchParams) == 248, "LlDispatchParams layout");
static_assert(offsetof(LlDispatchParams, mask) == 232, "LlDispatchParams layout");
static_assert(offsetof(LlDispatchParams, out_topk) == 128, "LlDispatchParams layout");
static_assert(offsetof(LlDispatchParams, rank) == 176, "LlDispatchParams layout");

struct LlCombineParams {
    uint64_t peer_base[kMaxRanks];
    uint64_t x;                     // bf16 [local][ranks * max_tokens][hidden]
    uint64_t src_info;              // int32 [local][ranks * max_tokens] (the dispatch's)
    uint64_t layout;                // int32 [local][ranks][2] (the dispatch's)
    uint64_t topk_idx;              // int32 [tokens][topk] of this rank's tokens
    uint64_t topk_weights;          // f32 [tokens][topk]
    uint64_t dispatch_topk;         // int32 [tokens][topk]: the dispatch's ids (its out_topk)
    uint64_t out;                   // bf16 [tokens][hidden]
    uint64_t state;
    uint64_t error;
    uint64_t timeout_ns;
    uint64_t flag_off;              // this half's combine flags
    uint64_t recv_off;              // this half's combine receive rows
    uint64_t transport;             // LlTransport (device memory), or 0: NVLink only
    int32_t rank;
    int32_t ranks;
    int32_t num_tokens;
    int32_t max_tokens;
    int32_t hidden;
    int32_t topk;
    int32_t num_experts;
    int32_t num_local;
    int32_t phases;
    int32_t half;
    uint64_t mask;                  // int32 [kMaxRanks] rank mask (enable_shrink), or 0
    uint64_t wait_stats;            // int64 [ranks]: wait cycles added per source rank, or 0
    uint64_t logfmt_stage;          // LogFMT: where rows are encoded before they go out
                                    // ([local][ranks * max_tokens][logfmt_slot_bytes]), or 0: BF16
};
static_assert(sizeof(LlCombineParams) == 232, "LlCombineParams layout");
static_assert(offsetof(LlCombineParams, mask) == 208, "LlCombineParams layout");
static_assert(offsetof(LlCombineParams, dispatch_topk) == 104, "LlCombineParams layout");
static_assert(offsetof(LlCombineParams, rank) == 168, "LlCombineParams layout");

struct LlSleepParams {
    uint64_t ns;
};

// The transport of a buffer with NVLink disabled (device memory, built at creation), mirrored in
// Rust.
struct LlTransport {
    uint64_t descs[kMaxRanks];  // ibgda_qp_desc[nqps] of this rank's QPs to rank r; 0 for itself
    uint64_t rbase[kMaxRanks];  // rank r's registered net buffer (RDMA address)
    uint64_t rkey[kMaxRanks];   // its rkey
    uint64_t nqps;              // QPs per peer
    uint64_t stage_off;         // dispatch send staging [max tokens][msg] in this rank's net buffer
    uint64_t comb_send_off;     // combine send rows (the zero-copy input) in this rank's net buffer
    uint64_t pad[5];
};
static_assert(sizeof(LlTransport) == 256, "LlTransport layout");

// Per-rank state in local device memory (zeroed at creation), mirrored in Rust.
struct LlState {
    uint64_t combine_seq[2];        // combines completed on each half
    uint64_t dispatch_seq[2];       // dispatches received on each half
    uint32_t combine_blocks_done;   // blocks of the current combine receive that have finished
    uint32_t dispatch_blocks_done;  // blocks of the current dispatch receive that have finished
    uint32_t pad[6];
    // Followed by uint64 last_signal[2][num_experts] (the dispatch signal this rank last stored
    // to each expert on each half), uint64 last_flag[2][num_experts] (the combine flag this rank
    // last stored for local expert le at rank r, index le * ranks + r, on each half: a flag skipped
    // for a masked rank is caught up by the next one), then int32 finish[num_experts]: (token,
    // expert) sends completed by this rank's warps in the current dispatch; the expert's count
    // warp resets it.
};
static_assert(sizeof(LlState) == 64, "LlState layout");
static_assert(offsetof(LlState, dispatch_seq) == 16 && offsetof(LlState, dispatch_blocks_done) == 36, "LlState layout");
static_assert(offsetof(LlTransport, nqps) == 192, "LlTransport layout");

__device__ __forceinline__ uint64_t* last_signal_of(uint64_t state) {
    return reinterpret_cast<uint64_t*>(state + sizeof(LlState));
}
__device__ __forceinline__ uint64_t* last_flag_of(uint64_t state, int num_experts) {
    return reinterpret_cast<uint64_t*>(state + sizeof(LlState) + 16ull * static_cast<uint64_t>(num_experts));
}
__device__ __forceinline__ int* finish_of(uint64_t state, int num_experts) {
    return reinterpret_cast<int*>(state + sizeof(LlState) + 32ull * static_cast<uint64_t>(num_experts));
}

// ---- The send interface ----------------------------------------------------------------------

// kTransport = false: NVLink only (ep_ll_dispatch / ep_ll_combine), no protocol code at all, so
// the NVLink kernels keep their registers; true: the transport kernels (ep_*_net).
template <bool kTransport>
struct Net {
    static constexpr bool kOn = kTransport;
    const uint64_t* base;
    const LlTransport* tp;  // nullptr: NVLink only
    uint64_t error;
    int rank;
    int ranks;

    // The NVLink window of rank `dst`'s net buffer, or 0 when only the transport reaches it.
    __device__ __forceinline__ uint64_t peer(int dst) const { return base[dst]; }

    // The QP that carries everything to `dst` under `key` (the data and the signal announcing it).
    __device__ __forceinline__ ibgda_qp_desc* qp(int dst, int key) const {
        return reinterpret_cast<ibgda_qp_desc*>(tp->descs[dst]) + (static_cast<uint32_t>(key) % tp->nqps);
    }

    __device__ __noinline__ void fail(int dst, uint32_t what, int status, int key) const {
        record_error(error, kErrTransport, rank, dst, what, static_cast<uint64_t>(static_cast<uint32_t>(status)),
                     static_cast<uint64_t>(key));
    }

    // Warp-collective: bytes (a multiple of 16) to `remote_off` in dst's net buffer. NVLink:
    // 16-byte stores from `src` (any local memory), kUnroll loads in flight per lane. Transport:
    // one RDMA write from `laddr`, which lies in this rank's registered net buffer and holds the
    // same bytes (visible to the NIC: the caller fenced them). False (error recorded) on failure.
    __device__ __forceinline__ bool put_warp(int dst, uint64_t remote_off, const int4* src, uint64_t laddr, int n16,
                                             int lane, int key) const {
        if constexpr (kTransport) {
            if (peer(dst) == 0) return put_net(dst, remote_off, laddr, n16, lane, key);
        }
        {
            int4* dst_p = reinterpret_cast<int4*>(peer(dst) + remote_off);
            for (int i = lane; i < n16; i += 32 * kUnroll) {
                int4 v[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i + u * 32 < n16) v[u] = src[i + u * 32];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i + u * 32 < n16) st_stream_v4(dst_p + i + u * 32, v[u]);
            }
            return true;
        }
    }

    __device__ __forceinline__ bool put_net(int dst, uint64_t remote_off, uint64_t laddr, int n16, int lane,
                                            int key) const {
        // No doorbell: the signal that follows on the same QP (or the quiet) rings for this put.
        const int st = ibgda_put_warp(qp(dst, key), tp->rbase[dst] + remote_off, static_cast<uint32_t>(tp->rkey[dst]),
                                      laddr, static_cast<uint64_t>(n16) * 16u, 0u, false);
        if (st != IBGDA_STATUS_OK) {
            if (lane == 0) fail(dst, kTransportPut, st, key);
            return false;
        }
        return true;
    }

    // One thread: makes `value` the word at `remote_off` in dst's net buffer once every put to dst
    // under `key` that happened-before this call is visible there. The word has one writer (this
    // rank); `delta` is value minus what this rank stored there last (the transport adds it with a
    // fenced atomic, after the puts on the same QP). False (error recorded) on failure.
    __device__ __forceinline__ bool signal(int dst, uint64_t remote_off, uint64_t value, uint64_t delta,
                                           int key) const {
        if constexpr (kTransport) {
            if (peer(dst) == 0) return signal_net(dst, remote_off, delta, key);
            __threadfence_system();
        }
        // NVLink: the release store alone (a fence.acq_rel.sys and the store) publishes every
        // write that happens-before it, this block's rows through the caller's __syncthreads and
        // other blocks' rows through an acquire of their release (dispatch's finish counters), as
        // DeepEP's p2p path does. No fence.sc.sys (__threadfence_system): an SC fence at system
        // scope is the costliest fence there is, and it sat on every signal's critical path.
        st_release_sys(reinterpret_cast<uint64_t*>(peer(dst) + remote_off), value);
        return true;
    }

    __device__ __forceinline__ bool signal_net(int dst, uint64_t remote_off, uint64_t delta, int key) const {
        const int st = ibgda_signal_add(qp(dst, key), tp->rbase[dst] + remote_off, static_cast<uint32_t>(tp->rkey[dst]),
                                        delta, true, true);
        if (st != IBGDA_STATUS_OK) {
            fail(dst, kTransportSignal, st, key);
            return false;
        }
        return true;
    }

    // Block-collective, once per kernel after the last put/signal: waits until the NIC has
    // completed everything posted to every peer (the send staging may be rewritten by the next
    // kernel). NVLink stores need nothing.
    __device__ __forceinline__ void quiet() const {
        if constexpr (kTransport) {
            if (tp == nullptr) return;
            __syncthreads();
            const int n = ranks * static_cast<int>(tp->nqps);
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int dst = i / static_cast<int>(tp->nqps);
                if (peer(dst) != 0 || tp->descs[dst] == 0) continue;
                ibgda_qp_desc* d = reinterpret_cast<ibgda_qp_desc*>(tp->descs[dst]) + i % static_cast<int>(tp->nqps);
                const int st = ibgda_quiet(d);
                if (st != IBGDA_STATUS_OK) fail(dst, kTransportQuiet, st, i);
            }
            __syncthreads();
        }
    }
};

// ---- Small helpers ---------------------------------------------------------------------------

// A 16-byte load that goes through L2 coherently (peer-written or same-kernel data) without
// allocating in L1.
__device__ __forceinline__ int4 ld_na_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Release add at GPU scope (the sender's warps to this GPU's count warps): every write that
// happens-before it (peer rows included) is visible to whoever acquires the counter.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ int ld_acquire_gpu_i32(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Warp-collective: how many of the first `tokens` tokens have expert `e` among their ids (a token
// that repeats an id counts once: each (token, expert) pair is sent once). The ids are scanned
// flat, not token by token with an early exit (a chain of dependent loads on the send's critical
// path), kCountUnroll loads per lane in flight before the first compare: 32 x kCountUnroll ids
// per round trip, so 128 tokens of top-8 take 4 L2 round trips, not 32.
constexpr int kCountUnroll = 8;
__device__ __forceinline__ int count_tokens_with(const int* idx, int tokens, int k, int e, int lane) {
    int n = 0;
    const int total = tokens * k;
    for (int base = lane; base < total; base += 32 * kCountUnroll) {
        int v[kCountUnroll];
#pragma unroll
        for (int u = 0; u < kCountUnroll; ++u) v[u] = base + 32 * u < total ? __ldg(idx + base + 32 * u) : -1;
#pragma unroll
        for (int u = 0; u < kCountUnroll; ++u) {
            if (v[u] != e) continue;
            // Count only the token's first occurrence of e.
            const int i = base + 32 * u;
            bool first = true;
            for (int j = i - i % k; j < i; ++j) first &= __ldg(idx + j) != e;
            n += first ? 1 : 0;
        }
    }
    return warp_sum(n);
}

__device__ __forceinline__ uint16_t fp8x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// The smallest power of two >= s (s positive, finite).
__device__ __forceinline__ float pow2_ceil(float s) {
    uint32_t b = __float_as_uint(s);
    if (b & 0x007fffffu) b = (b & 0xff800000u) + 0x00800000u;
    return __uint_as_float(b);
}

// ---- Rank masks (enable_shrink) and wait costs -------------------------------------------------

// Whether rank `r` is masked on this rank: its tokens are not sent to it, and what it sends is
// treated as absent. `mask` is 0 when shrink is off; `r` outside [0, kMaxRanks) is never masked.
__device__ __forceinline__ bool rank_masked(uint64_t mask, int r) {
    if (mask == 0 || r < 0 || r >= kMaxRanks) return false;
    return ld_volatile_u32(reinterpret_cast<const uint32_t*>(mask) + r) != 0u;
}

// Masks rank `r` (a wait on it timed out with shrink on); the host's query reports it.
__device__ __forceinline__ void mask_rank(uint64_t mask, int r) {
    if (mask == 0 || r < 0 || r >= kMaxRanks) return;
    atomicExch(reinterpret_cast<unsigned*>(mask) + r, 1u);
    __threadfence_system();
}

// Adds `cycles` waited on source rank `r` to the caller's int64 [ranks] statistics, if any.
__device__ __forceinline__ void add_wait_cost(uint64_t stats, int r, int ranks, long long cycles) {
    if (stats == 0 || r < 0 || r >= ranks || cycles <= 0) return;
    atomicAdd(reinterpret_cast<unsigned long long*>(stats) + r, static_cast<unsigned long long>(cycles));
}

// Bounded wait until *p satisfies `ok`, on source rank `peer`; false when the value is not to be
// used: an error was recorded (here or elsewhere), or the peer is masked (before or during the
// wait). With a mask (shrink on), running out of time masks the peer instead of failing the
// operation. The cycles spent are added to `stats[peer]`.
template <class Ok>
__device__ __forceinline__ bool wait_sys(const uint64_t* p, Ok ok, uint64_t* seen, const uint64_t error,
                                         uint64_t timeout_ns, int rank, int peer, uint32_t what, uint64_t expert,
                                         uint64_t mask, uint64_t stats, int ranks) {
    if (rank_masked(mask, peer)) return false;
    const uint64_t start = globaltimer_ns();
    const long long c0 = clock64();
    uint32_t polls = 0;
    bool got = true;
    while (!ok(*seen = ld_acquire_sys(p))) {
        if ((++polls & 1023u) == 0u) {
            if (error_recorded(error) || rank_masked(mask, peer)) {
                got = false;
                break;
            }
            if (globaltimer_ns() - start > ibgda_wait_bound_ns(timeout_ns)) {
                if (mask != 0)
                    mask_rank(mask, peer);
                else
                    record_error(error, kErrTimeout, rank, peer, what, expert, *seen);
                got = false;
                break;
            }
        }
    }
    add_wait_cost(stats, peer, ranks, clock64() - c0);
    return got;
}

// ---- Dispatch ----------------------------------------------------------------------------------

template <class Net>
__device__ __forceinline__ void dispatch_send(const LlDispatchParams& p, const Net& net, uint64_t seq) {
    __shared__ int4 s_msg[kMaxMsg16];
    __shared__ int s_expert[kMaxTopk];
    __shared__ int s_slot[kMaxTopk];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int K = p.topk, T = p.num_tokens, H = p.hidden, L = p.num_local, R = p.ranks;
    const int* idx = reinterpret_cast<const int*>(p.topk_idx);
    int* finish = finish_of(p.state, p.num_experts);
    uint64_t* last_signal = last_signal_of(p.state) + static_cast<int64_t>(p.half) * p.num_experts;
    const uint64_t mine = p.peer_base[p.rank];
    const int n_chunks = H / 8;  // 8 BF16 channels per 16-byte chunk
    const int msg16 = p.msg_bytes / 16;
    const int parts = K > 0 ? (kWarps / K > 0 ? kWarps / K : 1) : 1;

    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        // 1. The message, in shared memory: header, then the row (BF16 copied, or cast to FP8 with
        //    one scale per 128 channels = per 16 lanes).
        if (threadIdx.x == 0) s_msg[0] = make_int4(t, 0, 0, 0);
        const int4* xrow = reinterpret_cast<const int4*>(p.x + static_cast<uint64_t>(t) * H * 2);
        for (int base = warp * 32; base < n_chunks; base += kThreads) {
            const int c = base + lane;
            const bool in = c < n_chunks;
            int4 v = in ? ld_stream_v4(xrow + c) : make_int4(0, 0, 0, 0);
            if (!p.fp8) {
                if (in) s_msg[1 + c] = v;
                continue;
            }
            const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                                   static_cast<uint32_t>(v.w)};
            float f[8];
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                f[2 * j] = bf16_to_f32(static_cast<uint16_t>(w[j] & 0xffffu));
                f[2 * j + 1] = bf16_to_f32(static_cast<uint16_t>(w[j] >> 16));
                amax = fmaxf(amax, fmaxf(fabsf(f[2 * j]), fabsf(f[2 * j + 1])));
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            amax = fmaxf(amax, 1e-4f);
            float scale = amax / 448.0f;
            if (p.round_scale) scale = pow2_ceil(scale);
            const float inv = 1.0f / scale;
            uint32_t q[2];
#pragma unroll
            for (int j = 0; j < 2; ++j)
                q[j] = static_cast<uint32_t>(fp8x2(f[4 * j] * inv, f[4 * j + 1] * inv)) |
                       (static_cast<uint32_t>(fp8x2(f[4 * j + 2] * inv, f[4 * j + 3] * inv)) << 16);
            if (in) {
                reinterpret_cast<uint2*>(s_msg + 1)[c] = make_uint2(q[0], q[1]);
                if ((lane & 15) == 0) reinterpret_cast<float*>(reinterpret_cast<char*>(s_msg + 1) + H)[c / 16] = scale;
            }
        }
        // 2. Where the token goes: warp k takes top-k slot k. Its slot in the destination is the
        //    number of earlier tokens of this rank that also chose that expert, so rows arrive in
        //    token order without any atomics.
        if (warp < K) {
            int e = idx[t * K + warp];
            // Combine checks its top-k ids against this copy (kept with the handle).
            if (lane == 0) reinterpret_cast<int*>(p.out_topk)[t * K + warp] = e;
            if (e >= p.num_experts || e < -1) {
                if (lane == 0)
                    record_error(p.error, kErrBadExpert, p.rank, p.rank, static_cast<uint32_t>(warp),
                                 static_cast<uint64_t>(static_cast<int64_t>(e)), static_cast<uint64_t>(t));
                e = -1;
            }
            bool dup = false;
            for (int j = 0; j < warp; ++j) dup |= idx[t * K + j] == e;
            int slot = -1;
            if (e >= 0 && !dup) {
                slot = count_tokens_with(idx, t, K, e, lane);
            }
            if (lane == 0) {
                s_expert[warp] = slot >= 0 ? e : -1;
                s_slot[warp] = slot;
            }
        }
        __syncthreads();
        // Transport: the message also goes to this token's row of the registered send staging,
        // where the NIC reads it (fenced to system scope: the NIC is not an SM).
        uint64_t stage = 0;
        if (Net::kOn && net.tp != nullptr) {
            stage = mine + net.tp->stage_off + static_cast<uint64_t>(t) * p.msg_bytes;
            for (int c = threadIdx.x; c < msg16; c += kThreads) reinterpret_cast<int4*>(stage)[c] = s_msg[c];
            __threadfence_system();
            __syncthreads();
        }
        // 3. Copies: (top-k slot, part of the message) jobs over the warps; a transport
        //    destination gets the whole message as one RDMA write (part 0's job).
        const int per = (msg16 + parts - 1) / parts;
        for (int job = warp; job < K * parts; job += kWarps) {
            const int k = job % K, part = job / K;
            const int e = s_expert[k];
            if (e < 0) continue;
            const int dst = e / L, le = e % L;
            if (rank_masked(p.mask, dst)) continue;  // counted as sent below; nothing goes out
            int lo = part * per;
            int n = min(per, msg16 - lo);
            if (Net::kOn && net.peer(dst) == 0) {
                if (part != 0) continue;
                lo = 0;
                n = msg16;
            }
            if (n <= 0) continue;
            const uint64_t off = p.recv_off +
                                 ((static_cast<uint64_t>(le) * R + p.rank) * p.max_tokens + s_slot[k]) * p.msg_bytes +
                                 static_cast<uint64_t>(lo) * 16;
            net.put_warp(dst, off, s_msg + lo, stage + static_cast<uint64_t>(lo) * 16, n, lane, le);
        }
        __syncthreads();
        // 4. Count the sends done. NVLink: a release add at GPU scope after the barrier (the
        //    count warp acquires it, then releases its signal at system scope: the rows are in
        //    that chain, as in DeepEP's p2p path). Transport: a system fence first, as before.
        if (threadIdx.x < K && s_expert[threadIdx.x] >= 0) {
            if constexpr (Net::kOn) {
                __threadfence_system();
                atomicAdd(&finish[s_expert[threadIdx.x]], 1);
            } else {
                red_release_gpu_add(&finish[s_expert[threadIdx.x]], 1);
            }
        }
        __syncthreads();
    }

    // 5. One warp per expert: once every token for it has been sent, signal
    //    (seq + 1) << 32 | (count + 1) (see the top of the file). Experts go round the blocks
    //    first (expert e to block e % grid), so each block carries two or three count warps, not
    //    32 on a few blocks whose signals then queued behind one another.
    for (int e = warp * gridDim.x + blockIdx.x; e < p.num_experts; e += gridDim.x * kWarps) {
        const int n = count_tokens_with(idx, T, K, e, lane);
        if (lane == 0) {
            const uint64_t start = globaltimer_ns();
            uint32_t polls = 0;
            bool ok = true;
            int seen;
            while ((seen = ld_acquire_gpu_i32(&finish[e])) != n) {
                if ((++polls & 1023u) == 0u &&
                    (error_recorded(p.error) || globaltimer_ns() - start > ibgda_wait_bound_ns(p.timeout_ns))) {
                    if (!error_recorded(p.error))
                        record_error(p.error, kErrTimeout, p.rank, p.rank, kWaitSendDone, static_cast<uint64_t>(e),
                                     static_cast<uint64_t>(seen));
                    ok = false;
                    break;
                }
            }
            if (ok) {
                finish[e] = 0;  // the next dispatch is a later kernel on this stream
                const int dst = e / L, le = e % L;
                const uint64_t off = p.signal_off + (static_cast<uint64_t>(le) * R + p.rank) * 8;
                const uint64_t value = ((seq + 1) << 32) | (static_cast<uint64_t>(n) + 1);
                // A masked destination gets no signal; last_signal keeps what it last got, so the
                // transport's next add (once unmasked) brings the word to the right value.
                if (!rank_masked(p.mask, dst)) {
                    const uint64_t last = last_signal[e];
                    last_signal[e] = value;  // only this thread touches it in this kernel
                    net.signal(dst, off, value, value - last, le);
                }
            }
        }
    }
    net.quiet();
}

__device__ __forceinline__ void dispatch_recv(const LlDispatchParams& p, uint64_t seq) {
    __shared__ int s_cnt[kMaxRanks];
    __shared__ int s_off[kMaxRanks + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int H = p.hidden, L = p.num_local, R = p.ranks;
    const uint64_t mine = p.peer_base[p.rank];
    const int cap = R * p.max_tokens;
    const int data_bytes = p.fp8 ? H : 2 * H;
    const int data16 = data_bytes / 16;
    const int scale_words = H / kFp8Block;

    for (int le = blockIdx.x; le < L; le += gridDim.x) {
        if (threadIdx.x < R) {
            const int r = threadIdx.x;
            const uint64_t* sig = reinterpret_cast<const uint64_t*>(mine + p.signal_off) + le * R + r;
            const uint64_t want = (seq + 1) & 0xffffffffull;
            uint64_t seen = 0;
            const bool ok = wait_sys(sig, [want](uint64_t v) { return (v >> 32) == want; }, &seen, p.error,
                                     p.timeout_ns, p.rank, r, kWaitDispatchRecv, static_cast<uint64_t>(le), p.mask,
                                     p.wait_stats, R);
            s_cnt[r] = ok ? static_cast<int>(seen & 0xffffffffull) - 1 : 0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int off = 0;
            int* layout = reinterpret_cast<int*>(p.out_layout) + static_cast<int64_t>(le) * R * 2;
            for (int r = 0; r < R; ++r) {
                const int c = min(max(s_cnt[r], 0), p.max_tokens);
                s_off[r] = off;
                layout[2 * r] = off;
                layout[2 * r + 1] = c;
                off += c;
            }
            s_off[R] = off;
            reinterpret_cast<int*>(p.out_count)[le] = off;
        }
        __syncthreads();
        const int total = s_off[R];
        // (row, slice) jobs: with few rows, several warps share each row.
        const int wpr = warps_per_row(total);
        const int slice = (data16 + wpr - 1) / wpr;
        for (int job = warp; job < total * wpr; job += kWarps) {
            const int j = job / wpr, part = job % wpr;
            int r = 0;
            while (r + 1 < R && s_off[r + 1] <= j) ++r;
            const int i = j - s_off[r];
            const char* m = reinterpret_cast<const char*>(
                mine + p.recv_off + ((static_cast<uint64_t>(le) * R + r) * p.max_tokens + i) * p.msg_bytes);
            const int64_t row = static_cast<int64_t>(le) * cap + j;
            const int4* src = reinterpret_cast<const int4*>(m) + 1;
            int4* dst = reinterpret_cast<int4*>(p.out_x + row * data_bytes);
            const int hi = min(data16, (part + 1) * slice);
            for (int c = part * slice + lane; c < hi; c += 32 * kUnroll) {
                int4 v[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * 32 < hi) v[u] = ld_na_v4(src + c + u * 32);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * 32 < hi) dst[c + u * 32] = v[u];
            }
            if (part != 0) continue;
            if (lane == 0) reinterpret_cast<int*>(p.out_src_info)[row] = reinterpret_cast<const volatile int*>(m)[0];
            if (p.fp8) {
                const float* sc = reinterpret_cast<const float*>(m + 16 + H);
                if (p.ue8m0) {
                    uint32_t* out = reinterpret_cast<uint32_t*>(p.out_scales) + row * (scale_words / 4);
                    for (int w = lane; w < scale_words / 4; w += 32) {
                        uint32_t packed = 0;
#pragma unroll
                        for (int b = 0; b < 4; ++b)
                            packed |= ((__float_as_uint(sc[4 * w + b]) >> 23) & 0xffu) << (8 * b);
                        out[w] = packed;
                    }
                } else {
                    float* out = reinterpret_cast<float*>(p.out_scales) + row * scale_words;
                    for (int w = lane; w < scale_words; w += 32) out[w] = sc[w];
                }
            }
        }
        __syncthreads();
    }
}

// ---- Combine -----------------------------------------------------------------------------------

// One thread: flags local expert `le`'s rows at rank `r` (the n-th combine on a half stores n).
// A masked rank gets no flag; last_flag keeps what it last got, so the transport's next add
// (once unmasked) brings the word to the right value.
template <class Net>
__device__ __forceinline__ void combine_flag(const LlCombineParams& p, const Net& net, int r, int le, uint64_t seq) {
    if (rank_masked(p.mask, r)) return;
    const int e = p.rank * p.num_local + le;
    uint64_t* last = last_flag_of(p.state, p.num_experts) + static_cast<int64_t>(p.half) * p.num_experts +
                     static_cast<int64_t>(le) * p.ranks + r;
    const uint64_t value = seq + 1;
    const uint64_t delta = value - *last;
    *last = value;  // only this thread touches it in this kernel
    net.signal(r, p.flag_off + static_cast<uint64_t>(e) * 8, value, delta, e);
}

template <class Net>
__device__ __forceinline__ void combine_send(const LlCombineParams& p, const Net& net, uint64_t seq) {
    __shared__ int s_off[kMaxRanks], s_cnt[kMaxRanks], s_pre[kMaxRanks + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int H = p.hidden, L = p.num_local, R = p.ranks;
    const int cap = R * p.max_tokens;
    const int row16 = H * 2 / 16;
    // Transport: rows go out from the registered zero-copy input; rows given elsewhere are
    // copied there first.
    const uint64_t mine = p.peer_base[p.rank];
    const uint64_t stage = Net::kOn && net.tp != nullptr ? mine + net.tp->comb_send_off : 0;
    const bool logfmt = p.logfmt_stage != 0;
    const uint64_t slot = combine_slot_bytes(H, logfmt);
    for (int le = blockIdx.x; le < L; le += gridDim.x) {
        const int e = p.rank * L + le;
        if (threadIdx.x < R) {
            // The handle's tensors are checked, not trusted: a source's rows must lie inside
            // the expert's [0, cap) and number at most max_tokens, or none of them is sent.
            const int64_t at = static_cast<int64_t>(le) * R + threadIdx.x;
            const int* layout = reinterpret_cast<const int*>(p.layout) + at * 2;
            const int off = layout[0], cnt = layout[1];
            int ok_cnt = cnt;
            if (off < 0 || off > cap) {
                record_error(p.error, kErrBadRouting, p.rank, cap, kRoutingLayoutOffset, static_cast<uint64_t>(at * 2),
                             static_cast<uint64_t>(static_cast<int64_t>(off)));
                ok_cnt = 0;
            } else if (cnt < 0 || cnt > p.max_tokens || cnt > cap - off) {
                record_error(p.error, kErrBadRouting, p.rank, min(p.max_tokens, cap - off), kRoutingLayoutCount,
                             static_cast<uint64_t>(at * 2 + 1), static_cast<uint64_t>(static_cast<int64_t>(cnt)));
                ok_cnt = 0;
            }
            s_off[threadIdx.x] = ok_cnt > 0 ? off : 0;
            s_cnt[threadIdx.x] = ok_cnt;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int n = 0;
            for (int r = 0; r < R; ++r) {
                s_pre[r] = n;
                n += s_cnt[r];
            }
            s_pre[R] = n;
        }
        __syncthreads();
        // All the expert's rows (every source rank's, contiguous per rank) as (row, slice) jobs
        // over the block's warps, several warps per row when there are few rows. A transport
        // destination gets each row as one RDMA write (slice 0's job).
        const int total = s_pre[R];
        // LogFMT: one warp per row (it encodes the row, then sends what the encoding left).
        const int wpr = logfmt ? 1 : warps_per_row(total);
        const int slice = (row16 + wpr - 1) / wpr;
        for (int job = warp; job < total * wpr; job += kWarps) {
            const int j = job / wpr, part = job % wpr;
            int r = 0;
            while (r + 1 < R && s_pre[r + 1] <= j) ++r;
            if (rank_masked(p.mask, r)) continue;  // a masked rank gets none of its rows back
            const int64_t row = static_cast<int64_t>(le) * cap + s_off[r] + (j - s_pre[r]);
            const int src_token = reinterpret_cast<const int*>(p.src_info)[row];
            if (src_token < 0 || src_token >= p.max_tokens) {
                // A remote write offset: checked, and the row not sent.
                if (lane == 0 && part == 0)
                    record_error(p.error, kErrBadRouting, p.rank, p.max_tokens - 1, kRoutingSrcInfo,
                                 static_cast<uint64_t>(row), static_cast<uint64_t>(static_cast<int64_t>(src_token)));
                continue;
            }
            const int4* src = reinterpret_cast<const int4*>(p.x + row * H * 2);
            const uint64_t off = p.recv_off + (static_cast<uint64_t>(e) * p.max_tokens + src_token) * slot;
            if (logfmt) {
                // Encoded into this rank's staging (registered: the NIC reads it), then sent.
                const uint64_t st = p.logfmt_stage + static_cast<uint64_t>(row) * slot;
                const int bytes = logfmt_encode_row(src, reinterpret_cast<char*>(st), H, lane);
                if (Net::kOn && net.peer(r) == 0) __threadfence_system();
                __syncwarp();
                net.put_warp(r, off, reinterpret_cast<const int4*>(st), st, bytes / 16, lane, e);
                continue;
            }
            if (!Net::kOn || net.peer(r) != 0) {
                const int lo = part * slice;
                const int n = min(slice, row16 - lo);
                if (n > 0) net.put_warp(r, off + static_cast<uint64_t>(lo) * 16, src + lo, 0, n, lane, e);
                continue;
            }
            if (part != 0) continue;
            const uint64_t laddr = stage + static_cast<uint64_t>(row) * H * 2;
            if (laddr != reinterpret_cast<uint64_t>(src)) {
                int4* st = reinterpret_cast<int4*>(laddr);
                for (int c = lane; c < row16; c += 32) st[c] = ld_stream_v4(src + c);
                __threadfence_system();
            }
            __syncwarp();
            net.put_warp(r, off, src, laddr, row16, lane, e);
        }
        __syncthreads();
        if constexpr (Net::kOn) {
            // Transport: each expert's flags right after its rows, one QP post per thread.
            if (threadIdx.x < R) combine_flag(p, net, static_cast<int>(threadIdx.x), le, seq);
            __syncthreads();
        }
    }
    if constexpr (!Net::kOn) {
        // NVLink: the flags of all this block's experts after the barrier that ends the last
        // one's rows, one thread per (expert, rank), so a block with two experts (more local
        // experts than blocks) pays one system-scope release on its critical path, not two.
        const int b = static_cast<int>(blockIdx.x), G = static_cast<int>(gridDim.x);
        const int mine_experts = b < L ? (L - b + G - 1) / G : 0;
        for (int i = threadIdx.x; i < mine_experts * R; i += blockDim.x)
            combine_flag(p, net, i % R, b + (i / R) * G, seq);
    }
    net.quiet();
}

// Block-collective, LogFMT: token t's sum over its present top-k rows (`s_e[k]` >= 0), decoded
// from the slots, in the reference's order (k ascending, one fused multiply-add per value).
__device__ __forceinline__ void logfmt_recv_token(const LlCombineParams& p, int t, uint64_t slot, const int* s_e) {
    __shared__ int s_goff[kMaxTopk][kLogfmtMaxGroups];
    __shared__ LogfmtGroup s_g[kMaxTopk][kLogfmtMaxGroups];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int H = p.hidden, K = p.topk, G = min(H / kLogfmtGroup, kLogfmtMaxGroups);
    const int meta = logfmt_meta_bytes(H);
    const char* recv = reinterpret_cast<const char*>(p.peer_base[p.rank] + p.recv_off);
    const float* wts = reinterpret_cast<const float*>(p.topk_weights);
    // Warp k reads row k's meta: the groups' parameters and where each starts.
    if (warp < K && s_e[warp] >= 0) {
        const char* row = recv + (static_cast<uint64_t>(s_e[warp]) * p.max_tokens + t) * slot;
        int size[2] = {0, 0};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int g = lane + 32 * h;
            if (g >= G) continue;
            const uint32_t m = ld_volatile_u32(reinterpret_cast<const uint32_t*>(row) + g);
            const LogfmtGroup q = logfmt_group(m & 0xffffu, m >> 16);
            s_g[warp][g] = q;
            size[h] = q.step > 0.0f ? kLogfmtCastBytes : kLogfmtRawBytes;
        }
        int incl[2] = {size[0], size[1]};
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int v = __shfl_up_sync(0xffffffffu, incl[h], o);
                if (lane >= o) incl[h] += v;
            }
        }
        const int total0 = __shfl_sync(0xffffffffu, incl[0], 31);
        if (lane < G) s_goff[warp][lane] = meta + incl[0] - size[0];
        if (lane + 32 < G) s_goff[warp][lane + 32] = meta + total0 + incl[1] - size[1];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        const int g = c / (kLogfmtGroup / 8), i = c % (kLogfmtGroup / 8);
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        for (int k = 0; k < K; ++k) {
            const int e = s_e[k];
            if (e < 0) continue;
            const char* group = recv + (static_cast<uint64_t>(e) * p.max_tokens + t) * slot + s_goff[k][g];
            const LogfmtGroup q = s_g[k][g];
            float v[8];
            if (q.step > 0.0f) {
                logfmt_decode8(group, i, q, v);
            } else {
                const int4 raw = ld_na_v4(reinterpret_cast<const int4*>(group) + i);
                const uint32_t u[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y),
                                       static_cast<uint32_t>(raw.z), static_cast<uint32_t>(raw.w)};
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = bf16_to_f32(static_cast<uint16_t>(u[j / 2] >> (16 * (j % 2))));
            }
            const float w = wts[t * K + k];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = fmaf(w, v[j], acc[j]);
        }
        int4 o;
        o.x = static_cast<int>(f32_to_bf16_rn(acc[0]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[1])) << 16));
        o.y = static_cast<int>(f32_to_bf16_rn(acc[2]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[3])) << 16));
        o.z = static_cast<int>(f32_to_bf16_rn(acc[4]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[5])) << 16));
        o.w = static_cast<int>(f32_to_bf16_rn(acc[6]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[7])) << 16));
        reinterpret_cast<int4*>(p.out + static_cast<uint64_t>(t) * H * 2)[c] = o;
    }
    __syncthreads();
}

__device__ __forceinline__ void combine_recv(const LlCombineParams& p, uint64_t seq) {
    __shared__ int s_e[kMaxTopk];
    __shared__ float s_w[kMaxTopk];
    const int H = p.hidden, K = p.topk, L = p.num_local;
    const uint64_t mine = p.peer_base[p.rank];
    const int* idx = reinterpret_cast<const int*>(p.topk_idx);
    const float* wts = reinterpret_cast<const float*>(p.topk_weights);
    const int n16 = H / 8;
    const bool logfmt = p.logfmt_stage != 0;
    const uint64_t slot = combine_slot_bytes(H, logfmt);
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        if (threadIdx.x < K) {
            const int k = threadIdx.x;
            const int e = idx[t * K + k];
            bool ok = e >= 0;
            if (e >= p.num_experts || e < -1) {
                record_error(p.error, kErrBadExpert, p.rank, p.rank, static_cast<uint32_t>(k) | kBadExpertInCombine,
                             static_cast<uint64_t>(static_cast<int64_t>(e)), static_cast<uint64_t>(t));
                ok = false;
            } else if (ok) {
                // The row for (e, t) was written by this dispatch only if the dispatch sent t to e.
                const int d = reinterpret_cast<const int*>(p.dispatch_topk)[t * K + k];
                if (d != e) {
                    record_error(p.error, kErrTopkMismatch, p.rank, p.rank, static_cast<uint32_t>(k),
                                 static_cast<uint64_t>(t),
                                 (static_cast<uint64_t>(static_cast<uint32_t>(d)) << 32) | static_cast<uint32_t>(e));
                    ok = false;
                }
            }
            if (ok) {
                const uint64_t* flag = reinterpret_cast<const uint64_t*>(mine + p.flag_off) + e;
                uint64_t seen = 0;
                ok = wait_sys(flag, [seq](uint64_t v) { return v > seq; }, &seen, p.error, p.timeout_ns, p.rank, e / L,
                              kWaitCombineRecv, static_cast<uint64_t>(e), p.mask, p.wait_stats, p.ranks);
            }
            s_e[k] = ok ? e : -1;
            s_w[k] = wts[t * K + k];
        }
        __syncthreads();
        if (logfmt) {
            logfmt_recv_token(p, t, slot, s_e);
            continue;
        }
        for (int c = threadIdx.x; c < n16; c += blockDim.x) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
            // kCombineBatch rows' loads in flight before the sums, which keep the reference's
            // order (k ascending, one fused multiply-add per value).
            const int4* rows = reinterpret_cast<const int4*>(mine + p.recv_off) + c;
            for (int k0 = 0; k0 < K; k0 += kCombineBatch) {
                int4 v[kCombineBatch];
#pragma unroll
                for (int b = 0; b < kCombineBatch; ++b) {
                    const int e = k0 + b < K ? s_e[k0 + b] : -1;
                    v[b] = e >= 0 ? ld_na_v4(rows + (static_cast<uint64_t>(e) * p.max_tokens + t) * (H / 8))
                                  : make_int4(0, 0, 0, 0);
                }
#pragma unroll
                for (int b = 0; b < kCombineBatch; ++b) {
                    const int e = k0 + b < K ? s_e[k0 + b] : -1;
                    if (e < 0) continue;
                    const float w = s_w[k0 + b];
                    const uint32_t u[4] = {static_cast<uint32_t>(v[b].x), static_cast<uint32_t>(v[b].y),
                                           static_cast<uint32_t>(v[b].z), static_cast<uint32_t>(v[b].w)};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        acc[2 * j] = fmaf(w, bf16_to_f32(static_cast<uint16_t>(u[j] & 0xffffu)), acc[2 * j]);
                        acc[2 * j + 1] = fmaf(w, bf16_to_f32(static_cast<uint16_t>(u[j] >> 16)), acc[2 * j + 1]);
                    }
                }
            }
            int4 o;
            o.x = static_cast<int>(f32_to_bf16_rn(acc[0]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[1])) << 16));
            o.y = static_cast<int>(f32_to_bf16_rn(acc[2]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[3])) << 16));
            o.z = static_cast<int>(f32_to_bf16_rn(acc[4]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[5])) << 16));
            o.w = static_cast<int>(f32_to_bf16_rn(acc[6]) | (static_cast<uint32_t>(f32_to_bf16_rn(acc[7])) << 16));
            reinterpret_cast<int4*>(p.out + static_cast<uint64_t>(t) * H * 2)[c] = o;
        }
        __syncthreads();
    }
}

}  // namespace

// Start of a dispatch or combine kernel, every block: the half's sequence number (`seq_word`,
// read once per block) and whether this rank already failed. A kernel queued behind a failed one
// stops at once (false). error_recorded reads the device ErrorSlot (an L2 hit); reading the
// host-mapped word here cost about a microsecond per block, serialised over PCIe (132 blocks:
// 170 us against 44 us without it, 2x H200).
__device__ __forceinline__ bool op_begin(uint64_t error, const uint64_t* seq_word, uint64_t* seq_out) {
    __shared__ uint64_t seq;
    __shared__ int abort;
    if (threadIdx.x == 0) {
        abort = error_recorded(error);
        seq = *seq_word;
    }
    __syncthreads();
    *seq_out = seq;
    return abort == 0;
}

// End of the receive phase, every block: the last block to finish advances the half's sequence
// number (every block has read it by then).
__device__ __forceinline__ void op_finish(unsigned* blocks_done, uint64_t* seq_word, uint64_t seq) {
    __syncthreads();
    if (threadIdx.x == 0) {
        // acq_rel: this block's read of the sequence number is ordered before the count, and the
        // last block's update after every block's count.
        const unsigned prev = atom_add_acq_rel_gpu(blocks_done, 1u);
        if (prev == gridDim.x - 1) {
            *blocks_done = 0;
            *seq_word = seq + 1;
            __threadfence();
        }
    }
}

template <bool kTransport>
__device__ __forceinline__ void dispatch_kernel(const LlDispatchParams& p) {
    LlState* state = reinterpret_cast<LlState*>(p.state);
    uint64_t seq;
    if (!op_begin(p.error, &state->dispatch_seq[p.half], &seq)) return;
    const Net<kTransport> net{p.peer_base, reinterpret_cast<const LlTransport*>(p.transport), p.error, p.rank, p.ranks};
    if (p.phases & kPhaseSend) dispatch_send(p, net, seq);
    if (p.phases & kPhaseRecv) {
        dispatch_recv(p, seq);
        op_finish(&state->dispatch_blocks_done, &state->dispatch_seq[p.half], seq);
    }
}

template <bool kTransport>
__device__ __forceinline__ void combine_kernel(const LlCombineParams& p) {
    LlState* state = reinterpret_cast<LlState*>(p.state);
    uint64_t seq;
    if (!op_begin(p.error, &state->combine_seq[p.half], &seq)) return;
    const Net<kTransport> net{p.peer_base, reinterpret_cast<const LlTransport*>(p.transport), p.error, p.rank, p.ranks};
    if (p.phases & kPhaseSend) combine_send(p, net, seq);
    if (p.phases & kPhaseRecv) {
        combine_recv(p, seq);
        op_finish(&state->combine_blocks_done, &state->combine_seq[p.half], seq);
    }
}

// NVLink only (every peer mapped).
extern "C" __global__ void __launch_bounds__(kThreads, 1) ep_ll_dispatch(const LlDispatchParams p) {
    dispatch_kernel<false>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) ep_ll_combine(const LlCombineParams p) {
    combine_kernel<false>(p);
}
// NVLink disabled: peers through the transport (`p.transport`).
extern "C" __global__ void __launch_bounds__(kThreads, 1) ep_ll_dispatch_net(const LlDispatchParams p) {
    dispatch_kernel<true>(p);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) ep_ll_combine_net(const LlCombineParams p) {
    combine_kernel<true>(p);
}

// Keeps the stream busy for `ns` nanoseconds: benchmarks queue their timed work behind it so
// the host's launch rate does not show in the timings.
extern "C" __global__ void ep_ll_sleep(const LlSleepParams p) {
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < p.ns) __nanosleep(1000);
}
