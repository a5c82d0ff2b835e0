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
// Sequence numbers and the words last stored are counted on the device (InterCtrl), and every put
// is planned on the device from row counts in device memory (ep_internode_plan_put), so no kernel
// needs the host between it and the previous one: with num_worst_tokens the host never waits, the
// NVLink hop runs over whole receive slots (ep_internode_recv_prep) and its per-node blocks are
// concatenated (ep_internode_gather) and split back for combine (ep_internode_scatter,
// ep_internode_stage) by counts read on the device, and a sequence can be captured in a CUDA graph.
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
constexpr uint32_t kInterRoutingTopkId = 5;  // BAD_ROUTING `what`: a top-k id out of range

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
    uint64_t layout_invalid;             // the layout's LayoutInvalid when the host never read it, or 0
};
static_assert(sizeof(InterPackParams) == 184, "InterPackParams layout");
static_assert(offsetof(InterPackParams, num_tokens) == 144, "InterPackParams layout");
static_assert(offsetof(InterPackParams, layout_invalid) == 176, "InterPackParams layout");

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
    uint64_t table;                  // InterPutTable* replacing seg_* and delta, or 0
};
static_assert(sizeof(InterPutParams) == 1104, "InterPutParams layout");
static_assert(offsetof(InterPutParams, table) == 1096, "InterPutParams layout");
static_assert(offsetof(InterPutParams, signal_off) == 968, "InterPutParams layout");

struct InterWaitParams {
    uint64_t words;        // local u64 [nodes]
    uint64_t counts_out;   // i32 [nodes] in device memory (low 32 bits of each word, clamped to cap) or 0
    uint64_t counts_host;  // the same counts in host-mapped memory (the host reads them) or 0
    uint64_t own_count;    // i32*: rows of this rank's own node (copied to counts_out[my_node]) or 0
    uint64_t target_seq;   // u64*: the target, a device-counted sequence (InterCtrl); read at start
    uint64_t error;
    uint64_t timeout_ns;
    int32_t rank;
    int32_t nodes;
    int32_t my_node;
    int32_t shift;         // wait until (word >> shift) >= *target_seq
    int32_t what;
    int32_t cap;
    int32_t peer_rank[kInterMaxNodes];
};
static_assert(sizeof(InterWaitParams) == 112, "InterWaitParams layout");
static_assert(offsetof(InterWaitParams, rank) == 56, "InterWaitParams layout");

// The device-counted state of one buffer's operations (device memory, zeroed at creation): the
// sequence numbers every wait targets and the dispatch data words this rank last stored at each
// node's rail peer. Counted on the GPU so that CUDA-graph replays advance them like eager calls.
struct InterCtrl {
    uint64_t dispatch_seq;
    uint64_t combine_seq;
    uint64_t last_data[kInterMaxNodes];
};
static_assert(sizeof(InterCtrl) == 80, "InterCtrl layout");
static_assert(offsetof(InterCtrl, combine_seq) == 8, "InterCtrl layout");
static_assert(offsetof(InterCtrl, last_data) == 16, "InterCtrl layout");

// The writes of one put, computed on the device from device-resident row counts
// (ep_internode_plan_put) and read by ep_internode_put (its `table`).
struct InterPutTable {
    uint64_t seg_local[kInterMaxNodes][kInterMaxSegs];
    uint64_t seg_remote[kInterMaxNodes][kInterMaxSegs];
    uint64_t seg_bytes[kInterMaxNodes][kInterMaxSegs];
    uint64_t delta[kInterMaxNodes];
};
static_assert(sizeof(InterPutTable) == 832, "InterPutTable layout");
static_assert(offsetof(InterPutTable, delta) == 768, "InterPutTable layout");

struct InterPlanParams {
    uint64_t counts;      // i32 [nodes]: rows for each node
    uint64_t ctrl;        // InterCtrl*
    uint64_t table;       // InterPutTable* (written)
    uint64_t error;
    uint64_t src_base;    // offset of node 0's source slot; node n's at + n * slot_bytes
    uint64_t dst_base;    // offset, at every peer, of the receive slot of this rank's node
    uint64_t slot_bytes;
    uint64_t sec_off[kInterMaxSegs];   // a section's start inside a slot
    uint64_t sec_cap[kInterMaxSegs];   // its bytes
    uint64_t sec_row[kInterMaxSegs];   // bytes per row (0: section not sent)
    int32_t sec_min_rows[kInterMaxSegs];  // rows sent at least (ids and weights: one padding row)
    int32_t kind;         // kInterPlanDispatch or kInterPlanCombine
    int32_t nodes;
    int32_t my_node;
    int32_t cap;
    int32_t rank;
    int32_t peer_rank[kInterMaxNodes];
    int32_t pad;
};
static_assert(sizeof(InterPlanParams) == 224, "InterPlanParams layout");
static_assert(offsetof(InterPlanParams, sec_min_rows) == 152, "InterPlanParams layout");

constexpr int32_t kInterPlanDispatch = 0;
constexpr int32_t kInterPlanCombine = 1;

struct InterPrepParams {
    uint64_t slot[kInterMaxNodes];  // dispatch receive slot of node n (local address)
    uint64_t counts;                // i32 [nodes]: valid rows in each
    uint64_t off_idx;
    uint64_t off_w;
    int32_t nodes;
    int32_t topk;
    int32_t cap;
    int32_t pad;
};
static_assert(sizeof(InterPrepParams) == 104, "InterPrepParams layout");
static_assert(offsetof(InterPrepParams, nodes) == 88, "InterPrepParams layout");

struct InterGatherParams {
    uint64_t meta[kInterMaxNodes];    // the NVLink hop's receive region of source node n (its Meta)
    uint64_t x[kInterMaxNodes];       // its rows
    uint64_t scales[kInterMaxNodes];  // its scales, or 0
    uint64_t ids[kInterMaxNodes];     // its local expert ids, or 0
    uint64_t w[kInterMaxNodes];       // its weights, or 0
    uint64_t out_x;                   // [rows][row_bytes]
    uint64_t out_scales;              // f32 [rows][scale_words] or 0
    uint64_t out_ids;                 // i32 [rows][topk] or 0
    uint64_t out_w;                   // f32 [rows][topk] or 0
    uint64_t out_experts;             // i32 [experts] or 0
    uint64_t error;
    uint64_t meta_num_recv;           // byte offset of Meta::num_recv
    uint64_t meta_experts;            // byte offset of the expert counts after Meta
    int32_t nodes;
    int32_t rows;                     // num_worst_tokens
    int32_t row_bytes;
    int32_t scale_words;
    int32_t topk;
    int32_t experts;                  // local experts
    int32_t alignment;
    int32_t region_cap;               // rows a region holds (counts are clamped to it)
    int32_t rank;
    int32_t pad;
};
static_assert(sizeof(InterGatherParams) == 424, "InterGatherParams layout");
static_assert(offsetof(InterGatherParams, nodes) == 384, "InterGatherParams layout");

struct InterScatterParams {
    uint64_t meta[kInterMaxNodes];  // the dispatch's NVLink-hop receive region of node n (its Meta)
    uint64_t x[kInterMaxNodes];     // where node n's rows go: bf16 [region rows][hidden]
    uint64_t w[kInterMaxNodes];     // f32 [region rows][topk], or 0
    uint64_t in_x;                  // bf16 [rows][hidden]
    uint64_t in_w;                  // f32 [rows][topk] or 0
    uint64_t meta_num_recv;
    int32_t nodes;
    int32_t rows;
    int32_t hidden;
    int32_t topk;
    int32_t region_cap;
    int32_t pad;
};
static_assert(sizeof(InterScatterParams) == 240, "InterScatterParams layout");
static_assert(offsetof(InterScatterParams, nodes) == 216, "InterScatterParams layout");

struct InterStageParams {
    uint64_t src_x[kInterMaxNodes];  // the NVLink hop's sums for node n: bf16 [rows][hidden]
    uint64_t src_w[kInterMaxNodes];  // f32 [rows][topk] or 0
    uint64_t dst[kInterMaxNodes];    // node n's combine stage slot (this rank's node: its receive slot)
    uint64_t off_w;
    uint64_t counts;                 // i32 [nodes]: rows for node n
    int32_t nodes;
    int32_t hidden;
    int32_t topk;
    int32_t cap;
};
static_assert(sizeof(InterStageParams) == 224, "InterStageParams layout");
static_assert(offsetof(InterStageParams, nodes) == 208, "InterStageParams layout");

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
    // A layout computed under CUDA-graph capture was never read by the host: its report of top-k
    // ids out of range is turned into this rank's error here (token, id; peer = experts).
    if (p.layout_invalid != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        const int* inv = reinterpret_cast<const int*>(p.layout_invalid);
        if (inv[0] > 0)
            record_error(p.error, kInterErrRouting, p.rank, p.experts_per_node * p.nodes, kInterRoutingTopkId,
                         static_cast<uint64_t>(p.topk > 0 ? inv[1] / p.topk : inv[1]),
                         static_cast<uint64_t>(static_cast<int64_t>(inv[2])));
    }
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
    // With a table, the writes and signals were computed on the device (ep_internode_plan_put).
    const InterPutTable* t = reinterpret_cast<const InterPutTable*>(p.table);
    for (int n = warp; n < nodes; n += blockDim.x >> 5) {
        if (n == p.my_node || p.descs[n] == 0) continue;
        ibgda_qp_desc* d = reinterpret_cast<ibgda_qp_desc*>(p.descs[n]);
        bool ok = true;
        for (int s = 0; s < kInterMaxSegs && ok; ++s) {
            const uint64_t bytes = t != nullptr ? t->seg_bytes[n][s] : p.seg_bytes[n][s];
            if (bytes == 0) continue;
            const uint64_t local = t != nullptr ? t->seg_local[n][s] : p.seg_local[n][s];
            const uint64_t remote = t != nullptr ? t->seg_remote[n][s] : p.seg_remote[n][s];
            const int st = ibgda_put_warp(d, p.rbase[n] + remote, static_cast<uint32_t>(p.rkey[n]),
                                          p.local_base + local, bytes, 0u, false);
            if (st != IBGDA_STATUS_OK) {
                if (lane == 0)
                    record_error(p.error, kInterErrTransport, p.rank, p.peer_rank[n], 21u,
                                 static_cast<uint64_t>(static_cast<uint32_t>(st)), static_cast<uint64_t>(n));
                ok = false;
            }
        }
        const uint64_t delta = t != nullptr ? t->delta[n] : p.delta[n];
        if (ok && lane == 0 && delta != 0) {
            const int st = ibgda_signal_add(d, p.rbase[n] + p.signal_off, static_cast<uint32_t>(p.rkey[n]), delta,
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

// A row count as a peer or a kernel wrote it, clamped to [0, cap]: a count past the region's
// capacity must not send a copy out of bounds.
__device__ __forceinline__ int inter_clamp_rows(int v, int cap) { return v < 0 ? 0 : (v > cap ? cap : v); }

// Wait: one thread per other node, until its word reaches the target (bounded). The target is a
// sequence number counted on the device (InterCtrl), read here, so that graph replays wait for
// their own operation's signals.
extern "C" __global__ void __launch_bounds__(32) ep_internode_wait(const InterWaitParams p) {
    const int n = threadIdx.x;
    const int nodes = min(p.nodes, kInterMaxNodes);
    if (n == p.my_node && p.own_count != 0) {
        const int c = *reinterpret_cast<const int*>(p.own_count);
        const int v = inter_clamp_rows(c, p.cap);
        if (p.counts_out != 0) reinterpret_cast<int*>(p.counts_out)[n] = v;
        if (p.counts_host != 0) reinterpret_cast<volatile int*>(p.counts_host)[n] = v;
    }
    if (n >= nodes || n == p.my_node) return;
    const uint64_t target = ld_volatile_u64(reinterpret_cast<const uint64_t*>(p.target_seq));
    const uint64_t* w = reinterpret_cast<const uint64_t*>(p.words) + n;
    const uint64_t start = globaltimer_ns();
    uint64_t seen = 0;
    uint32_t polls = 0;
    while (((seen = ld_acquire_sys(w)) >> p.shift) < target) {
        if ((++polls & 1023u) == 0u) {
            if (error_recorded(p.error)) return;
            if (globaltimer_ns() - start > ibgda_wait_bound_ns(p.timeout_ns)) {
                record_error(p.error, kErrTimeout, p.rank, p.peer_rank[n], static_cast<uint32_t>(p.what), target,
                             seen);
                return;
            }
        }
    }
    const int64_t c = static_cast<int64_t>(seen & 0xffffffffull);
    const int v = static_cast<int>(c > p.cap ? p.cap : c);
    if (p.counts_out != 0) reinterpret_cast<int*>(p.counts_out)[n] = v;
    if (p.counts_host != 0) reinterpret_cast<volatile int*>(p.counts_host)[n] = v;
}

// Plan a put from device-resident row counts (no host wait): the sequence number of this
// operation (counted here, once per operation), then for every other node the writes of its rows,
// each rounded up to 16 bytes and kept inside its section, and the signal: a dispatch stores
// (seq << 32) | rows into the node's data word (the difference from what it stored last is
// added), a combine adds one. Mirrors StagedPlan::{dispatch,combine}_segments on the host.
extern "C" __global__ void __launch_bounds__(32) ep_internode_plan_put(const InterPlanParams p) {
    if (threadIdx.x != 0) return;
    InterCtrl* c = reinterpret_cast<InterCtrl*>(p.ctrl);
    InterPutTable* t = reinterpret_cast<InterPutTable*>(p.table);
    const uint64_t seq = p.kind == kInterPlanCombine ? ++c->combine_seq : ++c->dispatch_seq;
    const int* counts = reinterpret_cast<const int*>(p.counts);
    const int nodes = min(p.nodes, kInterMaxNodes);
    for (int n = 0; n < kInterMaxNodes; ++n) {
        t->delta[n] = 0;
        for (int s = 0; s < kInterMaxSegs; ++s) {
            t->seg_local[n][s] = 0;
            t->seg_remote[n][s] = 0;
            t->seg_bytes[n][s] = 0;
        }
        if (n >= nodes || n == p.my_node) continue;
        const int raw = counts[n];
        const int rows = inter_clamp_rows(raw, p.cap);
        for (int s = 0; s < kInterMaxSegs; ++s) {
            if (p.sec_row[s] == 0) continue;
            const uint64_t r = static_cast<uint64_t>(rows > p.sec_min_rows[s] ? rows : p.sec_min_rows[s]);
            const uint64_t bytes = (r * p.sec_row[s] + 15u) & ~static_cast<uint64_t>(15u);
            if (bytes > p.sec_cap[s]) {
                record_error(p.error, kInterErrRouting, p.rank, p.cap, 4u, static_cast<uint64_t>(n),
                             static_cast<uint64_t>(rows));
                continue;
            }
            t->seg_local[n][s] = p.src_base + static_cast<uint64_t>(n) * p.slot_bytes + p.sec_off[s];
            t->seg_remote[n][s] = p.dst_base + p.sec_off[s];
            t->seg_bytes[n][s] = bytes;
        }
        if (p.kind == kInterPlanDispatch) {
            const uint64_t value = (seq << 32) | static_cast<uint64_t>(rows);
            t->delta[n] = value - c->last_data[n];
            c->last_data[n] = value;
        } else {
            t->delta[n] = 1;
        }
    }
}

// Rows past each node's count in its dispatch receive slot carry no expert (ids -1, weights 0):
// the NVLink hop then runs over whole slots (`cap` rows, a size the host knows) and forwards
// exactly the received rows. One block per node.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_recv_prep(const InterPrepParams p) {
    const int n = blockIdx.x;
    if (n >= min(p.nodes, kInterMaxNodes) || p.topk <= 0) return;
    const int raw = reinterpret_cast<const int*>(p.counts)[n];
    const int c = inter_clamp_rows(raw, p.cap);
    int* ids = reinterpret_cast<int*>(p.slot[n] + p.off_idx);
    float* w = reinterpret_cast<float*>(p.slot[n] + p.off_w);
    const int64_t end = static_cast<int64_t>(p.cap) * p.topk;
    for (int64_t i = static_cast<int64_t>(c) * p.topk + threadIdx.x; i < end; i += blockDim.x) {
        ids[i] = -1;
        w[i] = 0.f;
    }
}

// Clamped row count of a NVLink-hop receive region, from its Meta.
__device__ __forceinline__ int inter_region_rows(uint64_t meta, uint64_t off, int cap) {
    if (meta == 0) return 0;
    const int v = *reinterpret_cast<const int*>(meta + off);
    return inter_clamp_rows(v, cap);
}

// The first row of each node's block in the concatenation of the NVLink hop's receive regions
// (pre has nodes + 1 entries; pre[nodes] is the total, also returned). One thread.
__device__ __forceinline__ int inter_region_prefix(int* pre, const uint64_t* meta, int nodes, uint64_t off,
                                                   int cap) {
    int acc = 0;
    for (int n = 0; n < nodes; ++n) {
        pre[n] = acc;
        acc += inter_region_rows(meta[n], off, cap);
    }
    pre[nodes] = acc;
    return acc;
}

// Where row i of the concatenation lies: the node whose block holds it (pre has nodes + 1 entries).
__device__ __forceinline__ int inter_block_of(const int* pre, int nodes, int i) {
    int n = 0;
    while (n + 1 < nodes && pre[n + 1] <= i) ++n;
    return n;
}

// Gather: the NVLink hop's outputs of every source node, concatenated in node order into the
// fixed `rows` (num_worst_tokens) rows of the dispatch output; rows past the received ones get ids
// -1 and weights 0; per-expert counts summed and aligned. More rows than `rows` is reported
// (WORST_TOKENS_EXCEEDED) and the output keeps the first `rows`. One warp per row.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_gather(const InterGatherParams p) {
    __shared__ int pre[kInterMaxNodes + 1];
    const int nodes = min(p.nodes, kInterMaxNodes);
    if (threadIdx.x == 0) {
        const int acc = inter_region_prefix(pre, p.meta, nodes, p.meta_num_recv, p.region_cap);
        if (blockIdx.x == 0 && acc > p.rows)
            record_error(p.error, kErrWorstTokensExceeded, p.rank, p.rank, static_cast<uint32_t>(p.rows), 0u,
                         static_cast<uint64_t>(acc));
    }
    __syncthreads();
    const int total = pre[nodes];
    if (blockIdx.x == 0 && p.out_experts != 0) {
        const int align = p.alignment > 0 ? p.alignment : 1;
        for (int l = threadIdx.x; l < p.experts; l += blockDim.x) {
            int c = 0;
            for (int n = 0; n < nodes; ++n)
                if (p.meta[n] != 0) c += reinterpret_cast<const int*>(p.meta[n] + p.meta_experts)[l];
            reinterpret_cast<int*>(p.out_experts)[l] = (c + align - 1) / align * align;
        }
    }
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int n16 = p.row_bytes / 16;
    for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < p.rows; i += gridDim.x * warps) {
        if (i >= total) {
            for (int k = lane; k < p.topk; k += 32) {
                if (p.out_ids != 0) reinterpret_cast<int*>(p.out_ids)[static_cast<int64_t>(i) * p.topk + k] = -1;
                if (p.out_w != 0) reinterpret_cast<float*>(p.out_w)[static_cast<int64_t>(i) * p.topk + k] = 0.f;
            }
            continue;
        }
        const int n = inter_block_of(pre, nodes, i);
        const int64_t j = i - pre[n];
        const int4* src = reinterpret_cast<const int4*>(p.x[n] + j * p.row_bytes);
        int4* dst = reinterpret_cast<int4*>(p.out_x + static_cast<int64_t>(i) * p.row_bytes);
        for (int v = lane; v < n16; v += 32) dst[v] = ld_stream_v4(src + v);
        if (p.out_scales != 0 && p.scales[n] != 0)
            for (int v = lane; v < p.scale_words; v += 32)
                reinterpret_cast<float*>(p.out_scales)[static_cast<int64_t>(i) * p.scale_words + v] =
                    reinterpret_cast<const float*>(p.scales[n])[j * p.scale_words + v];
        for (int k = lane; k < p.topk; k += 32) {
            if (p.out_ids != 0 && p.ids[n] != 0)
                reinterpret_cast<int*>(p.out_ids)[static_cast<int64_t>(i) * p.topk + k] =
                    reinterpret_cast<const int*>(p.ids[n])[j * p.topk + k];
            if (p.out_w != 0 && p.w[n] != 0)
                reinterpret_cast<float*>(p.out_w)[static_cast<int64_t>(i) * p.topk + k] =
                    reinterpret_cast<const float*>(p.w[n])[j * p.topk + k];
        }
    }
}

// Scatter: a combine input of the dispatch's fixed rows, split back into each source node's block
// (the rows the gather took from it) inside the NVLink hop's receive regions, which then are that
// hop's combine input. One warp per row.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_scatter(const InterScatterParams p) {
    __shared__ int pre[kInterMaxNodes + 1];
    const int nodes = min(p.nodes, kInterMaxNodes);
    if (threadIdx.x == 0) inter_region_prefix(pre, p.meta, nodes, p.meta_num_recv, p.region_cap);
    __syncthreads();
    const int total = min(pre[nodes], p.rows);
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int n16 = p.hidden * 2 / 16;
    for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < total; i += gridDim.x * warps) {
        const int n = inter_block_of(pre, nodes, i);
        const int64_t j = i - pre[n];
        const int4* src = reinterpret_cast<const int4*>(p.in_x + static_cast<int64_t>(i) * p.hidden * 2);
        int4* dst = reinterpret_cast<int4*>(p.x[n] + j * p.hidden * 2);
        for (int v = lane; v < n16; v += 32) dst[v] = ld_stream_v4(src + v);
        if (p.in_w != 0 && p.w[n] != 0)
            for (int k = lane; k < p.topk; k += 32)
                reinterpret_cast<float*>(p.w[n])[j * p.topk + k] =
                    reinterpret_cast<const float*>(p.in_w)[static_cast<int64_t>(i) * p.topk + k];
    }
}

// Stage: each node's sums (the NVLink hop's combine output) into its combine stage slot, as many
// rows as the node's rail peer sent at dispatch (a device count). One warp per row.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_stage(const InterStageParams p) {
    const int nodes = min(p.nodes, kInterMaxNodes);
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int n16 = p.hidden * 2 / 16;
    for (int n = 0; n < nodes; ++n) {
        if (p.dst[n] == 0) continue;
        const int raw = reinterpret_cast<const int*>(p.counts)[n];
        const int c = inter_clamp_rows(raw, p.cap);
        for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < c; i += gridDim.x * warps) {
            const int4* src = reinterpret_cast<const int4*>(p.src_x[n] + static_cast<int64_t>(i) * p.hidden * 2);
            int4* dst = reinterpret_cast<int4*>(p.dst[n] + static_cast<int64_t>(i) * p.hidden * 2);
            for (int v = lane; v < n16; v += 32) dst[v] = ld_stream_v4(src + v);
            if (p.src_w[n] != 0)
                for (int k = lane; k < p.topk; k += 32)
                    reinterpret_cast<float*>(p.dst[n] + p.off_w)[static_cast<int64_t>(i) * p.topk + k] =
                        reinterpret_cast<const float*>(p.src_w[n])[static_cast<int64_t>(i) * p.topk + k];
        }
    }
}

// Adds the 8 BF16 values of a 16-byte vector to acc[0..8).
__device__ __forceinline__ void inter_add_bf16x8(float* acc, const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += bf16_to_f32(static_cast<uint16_t>(w[i] & 0xffffu));
        acc[2 * i + 1] += bf16_to_f32(static_cast<uint16_t>(w[i] >> 16));
    }
}

__device__ __forceinline__ bool inter_aligned16(uint64_t a) { return (a & 15u) == 0u; }

// Reduce: each token's node sums (BF16 as they crossed), added in ascending node order in f32,
// then the biases; rounded to BF16. Summed weights alike. Rows are read 8 elements per 16-byte
// load where every row and bias address allows it (hidden a multiple of 8, 16-byte aligned
// bases; the slots always are), element by element otherwise: the same additions in the same
// order either way, so the results are identical.
extern "C" __global__ void __launch_bounds__(kInterThreads) ep_internode_reduce(const InterReduceParams p) {
    const int nodes = min(p.nodes, kInterMaxNodes);
    const int* pos = reinterpret_cast<const int*>(p.node_pos);
    bool vec = (p.hidden & 7) == 0 && inter_aligned16(p.out_x) && (p.bias0 == 0 || inter_aligned16(p.bias0)) &&
               (p.bias1 == 0 || inter_aligned16(p.bias1));
    for (int n = 0; n < nodes; ++n) vec = vec && inter_aligned16(p.slot[n]);
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        int at[kInterMaxNodes];
        for (int n = 0; n < nodes; ++n) {
            const int v = pos[static_cast<int64_t>(t) * p.nodes + n];
            at[n] = (v >= 0 && v < p.rows[n]) ? v : -1;
        }
        if (vec) {
            const int n16 = p.hidden / 8;
            const int64_t row16 = static_cast<int64_t>(t) * n16;
            for (int h = threadIdx.x; h < n16; h += blockDim.x) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (int n = 0; n < nodes; ++n) {
                    if (at[n] < 0) continue;
                    const int4* row = reinterpret_cast<const int4*>(p.slot[n]) + static_cast<int64_t>(at[n]) * n16;
                    inter_add_bf16x8(acc, ld_stream_v4(row + h));
                }
                if (p.bias0 != 0) inter_add_bf16x8(acc, ld_stream_v4(reinterpret_cast<const int4*>(p.bias0) + row16 + h));
                if (p.bias1 != 0) inter_add_bf16x8(acc, ld_stream_v4(reinterpret_cast<const int4*>(p.bias1) + row16 + h));
                uint32_t w[4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    w[i] = static_cast<uint32_t>(f32_to_bf16_rn(acc[2 * i])) |
                           (static_cast<uint32_t>(f32_to_bf16_rn(acc[2 * i + 1])) << 16);
                reinterpret_cast<int4*>(p.out_x)[row16 + h] =
                    make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                              static_cast<int>(w[3]));
            }
        } else {
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
