// Internode normal-mode kernels, staged (first correct version): the RDMA hop and the final
// cross-node reduction. The NVLink hop inside a node is the intranode buffer's dispatch/combine,
// driven by the host (`ep::internode`).
//
// Every rank owns one registered net buffer (offsets equal on all ranks; the host computes them):
//   words        u64 [4][max nodes]   dispatch data, dispatch ack, combine data, combine ack; entry
//                                     n is written only by the rail peer on node n (the rank with
//                                     this rank's local index), through a fenced RDMA add on the
//                                     QP that carried its data, so the word lands after the data.
//   dispatch recv  slot [nodes]       what each node's rail peer sent (this rank's own node: the
//                                     pack kernel writes it locally)
//   dispatch stage slot [nodes]       what this rank sends to each node (the NIC reads it)
//   combine recv   slot [nodes]       each node's partial sums of this rank's tokens
//   combine stage  slot [nodes]       this rank's partial sums for each node's tokens
// A dispatch slot is x [cap][row bytes] | scales f32 [cap][scale words] | ids i32 [cap][k] |
// weights f32 [cap][k]; a combine slot is x bf16 [cap][hidden] | weights f32 [cap][k].
//
// Signals are monotonic: the n-th dispatch on a rail stores (n << 32) | rows (the sender adds the
// difference from what it stored last), acks and combine words count operations. A sender waits
// for the receiver's ack of the previous operation before it rewrites the receiver's slot, and
// quiets its QPs before the kernel ends (the stage slots are rewritten by the next operation).
// Every wait is bounded by %globaltimer and reports rank, peer, what and the values seen.
#include <cstddef>
#include <cstdint>

#include "ep/device.cuh"
#include "ibgda/protocol.cuh"

using namespace ep;

constexpr int kInterMaxNodes = 8;  // world ≤ 8 ranks (MAX_RANKS), so at most 8 nodes
constexpr int kInterMaxSegs = 4;   // x, scales, ids, weights
constexpr int kInterThreads = 256;
constexpr uint32_t kInterErrTransport = 17;  // as the low-latency kernels' TRANSPORT code
constexpr uint32_t kInterErrRouting = 3;     // as intranode BAD_ROUTING

struct InterPackParams {
    uint64_t x;                          // [T][row_bytes]
    uint64_t scales;                     // f32 [T][scale_words] or 0
    uint64_t topk_idx;                   // i32 [T][topk] global ids
    uint64_t weights;                    // f32 [T][topk] or 0
    uint64_t node_pos;                   // i32 [T][nodes]: position among tokens to node n, or -1
    uint64_t tokens_per_node;            // i32 [nodes]
    uint64_t slot[kInterMaxNodes];       // where node n's slot starts (local address)
    uint64_t off_scales;                 // byte offsets inside a slot
    uint64_t off_idx;
    uint64_t off_w;
    uint64_t error;
    int32_t num_tokens;
    int32_t row_bytes;
    int32_t scale_words;
    int32_t topk;
    int32_t nodes;
    int32_t experts_per_node;
    int32_t cap;
    int32_t rank;
};
static_assert(sizeof(InterPackParams) == 176, "InterPackParams layout");
static_assert(offsetof(InterPackParams, num_tokens) == 144, "InterPackParams layout");

struct InterPutParams {
    uint64_t descs[kInterMaxNodes];  // ibgda_qp_desc* to node n's rail peer; 0 for none/self
    uint64_t rbase[kInterMaxNodes];  // its registered net buffer
    uint64_t rkey[kInterMaxNodes];
    uint64_t local_base;             // this rank's registered net buffer
    uint64_t seg_local[kInterMaxNodes][kInterMaxSegs];   // offsets into local_base
    uint64_t seg_remote[kInterMaxNodes][kInterMaxSegs];  // offsets into rbase[n]
    uint64_t seg_bytes[kInterMaxNodes][kInterMaxSegs];   // multiples of 16 (0: none)
    uint64_t signal_off;             // offset of the word (indexed by this rank's node) remotely
    uint64_t delta[kInterMaxNodes];  // what to add to node n's word (0: no signal)
    uint64_t error;
    int32_t rank;
    int32_t nodes;
    int32_t my_node;
    int32_t peer_rank[kInterMaxNodes];
    int32_t pad;
};
static_assert(sizeof(InterPutParams) == 1096, "InterPutParams layout");
static_assert(offsetof(InterPutParams, signal_off) == 968, "InterPutParams layout");

struct InterWaitParams {
    uint64_t words;       // local u64 [nodes]
    uint64_t counts_out;  // i32 [nodes] (low 32 bits of each word, clamped to cap) or 0
    uint64_t error;
    uint64_t timeout_ns;
    uint64_t target;      // wait until (word >> shift) >= target
    int32_t rank;
    int32_t nodes;
    int32_t my_node;
    int32_t shift;
    int32_t what;
    int32_t cap;
    int32_t peer_rank[kInterMaxNodes];
};
static_assert(sizeof(InterWaitParams) == 96, "InterWaitParams layout");

struct InterReduceParams {
    uint64_t slot[kInterMaxNodes];  // combine recv slot of node n (local address)
    uint64_t off_w;                 // weights offset inside a slot
    uint64_t node_pos;              // i32 [T][nodes]
    uint64_t bias0;                 // bf16 [T][hidden] or 0
    uint64_t bias1;
    uint64_t out_x;                 // bf16 [T][hidden]
    uint64_t out_w;                 // f32 [T][topk] or 0
    uint64_t error;
    int32_t num_tokens;
    int32_t hidden;
    int32_t topk;
    int32_t nodes;
    int32_t rank;
    int32_t pad;
    int32_t rows[kInterMaxNodes];   // valid rows in node n's slot
};
static_assert(sizeof(InterReduceParams) == 176, "InterReduceParams layout");

// Pack: each token, for each node that needs it, into that node's slot at its position (ids made
// node-local: -1 for experts of other nodes). A node that gets no token gets one padding row whose
// ids are all -1, so the forwarder always has at least one row to hand to the NVLink hop.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_pack(const InterPackParams p) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int nodes = min(p.nodes, kInterMaxNodes);
    const int* pos = reinterpret_cast<const int*>(p.node_pos);
    const int* ids = reinterpret_cast<const int*>(p.topk_idx);
    const int* tpn = reinterpret_cast<const int*>(p.tokens_per_node);
    if (blockIdx.x == 0 && threadIdx.x < nodes && tpn[threadIdx.x] <= 0) {
        int* slot_ids = reinterpret_cast<int*>(p.slot[threadIdx.x] + p.off_idx);
        float* slot_w = reinterpret_cast<float*>(p.slot[threadIdx.x] + p.off_w);
        for (int k = 0; k < p.topk; ++k) {
            slot_ids[k] = -1;
            slot_w[k] = 0.f;
        }
    }
    const int n16 = p.row_bytes / 16;
    for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < p.num_tokens; t += gridDim.x * warps) {
        for (int n = 0; n < nodes; ++n) {
            const int at = pos[static_cast<int64_t>(t) * p.nodes + n];
            if (at < 0) continue;
            if (at >= p.cap) {
                if (lane == 0)
                    record_error(p.error, kInterErrRouting, p.rank, p.cap, 3u,
                                 static_cast<uint64_t>(t) * p.nodes + n, static_cast<uint64_t>(at));
                continue;
            }
            const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<uint64_t>(t) * p.row_bytes);
            int4* dst = reinterpret_cast<int4*>(p.slot[n] + static_cast<uint64_t>(at) * p.row_bytes);
            for (int i = lane; i < n16; i += 32) dst[i] = ld_stream_v4(src + i);
            if (p.scales != 0) {
                const float* s = reinterpret_cast<const float*>(p.scales) + static_cast<int64_t>(t) * p.scale_words;
                float* d = reinterpret_cast<float*>(p.slot[n] + p.off_scales) + static_cast<int64_t>(at) * p.scale_words;
                for (int i = lane; i < p.scale_words; i += 32) d[i] = s[i];
            }
            if (p.topk_idx == 0) continue;  // cached dispatch: rows (and scales) only
            const int lo = n * p.experts_per_node, hi = lo + p.experts_per_node;
            int* di = reinterpret_cast<int*>(p.slot[n] + p.off_idx) + static_cast<int64_t>(at) * p.topk;
            float* dw = reinterpret_cast<float*>(p.slot[n] + p.off_w) + static_cast<int64_t>(at) * p.topk;
            for (int k = lane; k < p.topk; k += 32) {
                const int e = ids[static_cast<int64_t>(t) * p.topk + k];
                const bool mine = e >= lo && e < hi;
                di[k] = mine ? e - lo : -1;
                dw[k] = p.weights != 0 ? reinterpret_cast<const float*>(p.weights)[static_cast<int64_t>(t) * p.topk + k]
                                       : 0.f;
            }
        }
    }
}

// Put: one warp per destination node writes its segments, then its signal on the same QP (a
// fenced add: it lands after the data); then every QP used is quieted, so the stage slots may be
// rewritten once the kernel has ended.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_put(const InterPutParams p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nodes = min(p.nodes, kInterMaxNodes);
    // The stage slots were written by earlier kernels (or copies) of this stream; the NIC reads
    // them at system scope.
    __threadfence_system();
    for (int n = warp; n < nodes; n += blockDim.x >> 5) {
        if (n == p.my_node || p.descs[n] == 0) continue;
        ibgda_qp_desc* d = reinterpret_cast<ibgda_qp_desc*>(p.descs[n]);
        bool ok = true;
        for (int s = 0; s < kInterMaxSegs && ok; ++s) {
            const uint64_t bytes = p.seg_bytes[n][s];
            if (bytes == 0) continue;
            const int st = ibgda_put_warp(d, p.rbase[n] + p.seg_remote[n][s], static_cast<uint32_t>(p.rkey[n]),
                                          p.local_base + p.seg_local[n][s], bytes, 0u, false);
            if (st != IBGDA_STATUS_OK) {
                if (lane == 0)
                    record_error(p.error, kInterErrTransport, p.rank, p.peer_rank[n], 21u,
                                 static_cast<uint64_t>(static_cast<uint32_t>(st)), static_cast<uint64_t>(n));
                ok = false;
            }
        }
        if (ok && lane == 0 && p.delta[n] != 0) {
            const int st = ibgda_signal_add(d, p.rbase[n] + p.signal_off, static_cast<uint32_t>(p.rkey[n]), p.delta[n],
                                            true, true);
            if (st != IBGDA_STATUS_OK)
                record_error(p.error, kInterErrTransport, p.rank, p.peer_rank[n], 22u,
                             static_cast<uint64_t>(static_cast<uint32_t>(st)), static_cast<uint64_t>(n));
        }
        __syncwarp();
    }
    __syncthreads();
    if (threadIdx.x < nodes && threadIdx.x != p.my_node && p.descs[threadIdx.x] != 0) {
        const int st = ibgda_quiet(reinterpret_cast<ibgda_qp_desc*>(p.descs[threadIdx.x]));
        if (st != IBGDA_STATUS_OK)
            record_error(p.error, kInterErrTransport, p.rank, p.peer_rank[threadIdx.x], 23u,
                         static_cast<uint64_t>(static_cast<uint32_t>(st)), static_cast<uint64_t>(threadIdx.x));
    }
}

// Wait: one thread per other node, until its word reaches the target (bounded).
extern "C" __global__ void __launch_bounds__(32) ep_internode_wait(const InterWaitParams p) {
    const int n = threadIdx.x;
    const int nodes = min(p.nodes, kInterMaxNodes);
    if (n >= nodes || n == p.my_node) return;
    const uint64_t* w = reinterpret_cast<const uint64_t*>(p.words) + n;
    const uint64_t start = globaltimer_ns();
    uint64_t seen = 0;
    uint32_t polls = 0;
    while (((seen = ld_acquire_sys(w)) >> p.shift) < p.target) {
        if ((++polls & 1023u) == 0u) {
            if (error_recorded(p.error)) return;
            if (globaltimer_ns() - start > ibgda_wait_bound_ns(p.timeout_ns)) {
                record_error(p.error, kErrTimeout, p.rank, p.peer_rank[n], static_cast<uint32_t>(p.what), p.target,
                             seen);
                return;
            }
        }
    }
    if (p.counts_out != 0) {
        const int64_t c = static_cast<int64_t>(seen & 0xffffffffull);
        reinterpret_cast<volatile int*>(p.counts_out)[n] = static_cast<int>(c > p.cap ? p.cap : c);
    }
}

// Reduce: each token's node sums (BF16 as they crossed), added in ascending node order in f32,
// then the biases; rounded to BF16. Summed weights alike.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_reduce(const InterReduceParams p) {
    const int nodes = min(p.nodes, kInterMaxNodes);
    const int* pos = reinterpret_cast<const int*>(p.node_pos);
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        int at[kInterMaxNodes];
        for (int n = 0; n < nodes; ++n) {
            const int v = pos[static_cast<int64_t>(t) * p.nodes + n];
            at[n] = (v >= 0 && v < p.rows[n]) ? v : -1;
        }
        for (int h = threadIdx.x; h < p.hidden; h += blockDim.x) {
            float acc = 0.f;
            for (int n = 0; n < nodes; ++n) {
                if (at[n] < 0) continue;
                const uint16_t* row =
                    reinterpret_cast<const uint16_t*>(p.slot[n]) + static_cast<int64_t>(at[n]) * p.hidden;
                acc += bf16_to_f32(row[h]);
            }
            const int64_t i = static_cast<int64_t>(t) * p.hidden + h;
            if (p.bias0 != 0) acc += bf16_to_f32(reinterpret_cast<const uint16_t*>(p.bias0)[i]);
            if (p.bias1 != 0) acc += bf16_to_f32(reinterpret_cast<const uint16_t*>(p.bias1)[i]);
            reinterpret_cast<uint16_t*>(p.out_x)[i] = f32_to_bf16_rn(acc);
        }
        if (p.out_w != 0) {
            for (int k = threadIdx.x; k < p.topk; k += blockDim.x) {
                float acc = 0.f;
                for (int n = 0; n < nodes; ++n) {
                    if (at[n] < 0) continue;
                    acc += reinterpret_cast<const float*>(p.slot[n] + p.off_w)[static_cast<int64_t>(at[n]) * p.topk + k];
                }
                reinterpret_cast<float*>(p.out_w)[static_cast<int64_t>(t) * p.topk + k] = acc;
            }
        }
    }
}
