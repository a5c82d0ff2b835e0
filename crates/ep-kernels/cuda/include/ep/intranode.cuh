// Intranode (NVLink) dispatch/combine: the structs that cross the host/device boundary, and the
// layout of the per-rank regions that peers write into. Mirrored by `ep_kernels::intranode` in
// Rust; sizes and offsets are asserted on both sides.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ep {

// Ranks of one host reachable by NVLink loads/stores. Arrays of per-rank pointers are kernel
// parameters of this length, so a launch needs no extra device allocation.
constexpr int kMaxRanks = 8;

// Error codes in the host-mapped error word (`ErrorWord::code`).
enum ErrorCode : uint32_t {
    kErrNone = 0,
    // A bounded wait on peer flags ran out; `what` says which wait.
    kErrTimeout = 1,
    // More tokens arrived than `num_worst_tokens` rows; `what` = num_worst_tokens, `detail` =
    // rows received.
    kErrWorstTokensExceeded = 2,
    // A routing value read from a layout tensor is out of range and was not used: `what` is a
    // RoutingWhat, `epoch` the value's flat index, `detail` the value (i64 bits), `peer` the
    // largest value allowed.
    kErrBadRouting = 3,
    // Rank masks that the kernels cannot honour: `what` is a MaskWhat, `peer` the rank that
    // disagrees (or this rank), `detail` = (the other link set << 32) | this rank's link set.
    kErrMaskMismatch = 4,
};

// Which mask disagreement (`ErrorWord::what` with kErrMaskMismatch).
enum MaskWhat : uint32_t {
    kMaskPeerLinks = 1,     // a linked peer links a different set of ranks (masks not symmetric/transitive)
    kMaskCachedHandle = 2,  // a cached dispatch's handle was made under other links than now
    kMaskOneSided = 3,      // a peer this rank links masks this rank (seen while waiting for it)
};

// Which routing value was out of range (`ErrorWord::what` with kErrBadRouting).
enum RoutingWhat : uint32_t {
    kRoutingTokensPerRank = 1,    // tokens_per_rank[dst] outside [0, tokens] (published clamped)
    kRoutingTokensPerExpert = 2,  // tokens_per_expert[e] outside [0, tokens] (published clamped)
    kRoutingSendPosition = 3,     // send_pos[t][dst] at or past the count published to dst (not sent)
};

// The layout kernel's report of top-k ids outside [-1, experts).
struct LayoutInvalid {
    int32_t count;  // how many
    int32_t first;  // flat index token * topk + slot of the first, or INT32_MAX
    int32_t id;     // the id there
    int32_t pad;
};
static_assert(sizeof(LayoutInvalid) == 16, "LayoutInvalid layout");

// What a wait was waiting for (`ErrorWord::what`).
enum WaitWhat : uint32_t {
    kWaitDispatchCounts = 1,  // the count exchange that starts a dispatch
    kWaitDispatchData = 2,    // every peer's tokens having landed
    kWaitCombineStart = 3,    // every peer being ready for a combine
    kWaitCombineData = 4,     // every peer's combine rows having landed
};

// One rank's error report, in host-mapped pinned memory. The first writer wins (code is set by
// atomicCAS from 0); the host turns it into an `EpError` naming the rank, the peer and the wait.
struct ErrorWord {
    uint32_t code;
    uint32_t rank;
    uint32_t peer;
    uint32_t what;
    uint64_t epoch;
    uint64_t detail;
};
static_assert(sizeof(ErrorWord) == 32, "ErrorWord layout");

// Where kernels report errors: a slot in device memory holding the first error's code (the cheap
// "has this rank failed?" every block may read: an L2 hit, where a read of the host-mapped word is
// an uncached PCIe round trip, and those serialise across blocks) and the device address of the
// host-mapped ErrorWord the host reads. The `error` field of every params struct points here.
struct ErrorSlot {
    uint32_t code;  // 0 until the first error; set by atomicCAS, never cleared
    uint32_t pad;
    uint64_t host;  // ErrorWord in host-mapped memory
};
static_assert(sizeof(ErrorSlot) == 16, "ErrorSlot layout");
static_assert(offsetof(ErrorSlot, host) == 8, "ErrorSlot layout");

// Tag of a published combine input that lies in the publisher's window: the rest of the word is
// the byte offset there (mirrored as ep_kernels::intranode::IN_WINDOW).
constexpr uint64_t kInWindow = 1ull << 63;

// Per-rank signal region, at the start of the rank's window (the one device allocation every
// peer maps, through peer access or CUDA IPC). Peers write flags, counts and where their
// receive region lies in their own window here; only the owner reads it.
struct SignalHead {
    // Barrier flags: flag[src] = the last epoch rank src released to this rank. Monotonic, so
    // never reset; waits are `>= epoch`.
    uint64_t flag[kMaxRanks];
    // recv_offset[src] = byte offset of rank src's receive region for the dispatch in flight
    // within src's window. An offset, not an address: each rank maps a peer's window at its own
    // address (CUDA IPC), so only the window base is per-viewer.
    uint64_t recv_offset[kMaxRanks];
    // comb_src[src] / comb_w_src[src] = rank src's combine input rows / weights: src's own
    // address (ranks as threads), or kInWindow | the byte offset in src's window (ranks as
    // processes, which map only each other's windows).
    uint64_t comb_src[kMaxRanks];
    uint64_t comb_w_src[kMaxRanks];
    // tokens[src][dst]: how many tokens src sends to dst (each src writes its whole row to all).
    int32_t tokens[kMaxRanks][kMaxRanks];
    // Blocks of the owner's current push kernel that have finished (the last one resets it).
    uint32_t blocks_done;
    uint32_t pad0;
    // The last barrier epoch the owner used. Only the owner's kernels write it, each advancing it
    // by one (see next_epoch_released in intranode.cu): epochs come from the GPU, not from kernel
    // parameters, so a replayed CUDA graph takes fresh epochs, and replays and eager calls
    // interleave as long as every rank runs the same operations in the same order. Peers read
    // it (acquire) only to tell a one-sided mask (OneSidedMask in intranode.cu).
    uint64_t epoch;
    // links[src] = the ranks src linked (bit r: src exchanges data with rank r) when it last
    // released to this rank from a notify or a barrier: linked ranks must agree on it. The
    // owner's own entry is written before its epoch advances (release), so a peer that reads
    // the epoch can trust it.
    uint32_t links[kMaxRanks];
    uint32_t pad[4];
    // Followed by int32 experts[kMaxRanks][num_local_experts]: tokens src sends to each of this
    // rank's local experts.
};
static_assert(sizeof(SignalHead) == 576, "SignalHead layout");
static_assert(offsetof(SignalHead, recv_offset) == 64, "SignalHead layout");
static_assert(offsetof(SignalHead, epoch) == 520, "SignalHead layout");
static_assert(offsetof(SignalHead, links) == 528, "SignalHead layout");

// Per-dispatch facts a rank computed, stored at the start of its receive region (so a handle
// that keeps the region keeps them too).
struct Meta {
    // Where this rank's tokens start in each destination's receive rows.
    int32_t send_offset[kMaxRanks];
    // recv_offset[src]: where tokens from src start in this rank's rows; [ranks] = total.
    int32_t recv_offset[kMaxRanks + 1];
    int32_t num_recv;
    // How many tokens this rank sends to each destination (what it published, clamped): its rows
    // there are [send_offset, send_offset + send_count); the push sends none past them.
    int32_t send_count[kMaxRanks];
    // The ranks this rank was linked with for this dispatch (bit r; see links_of in device.cuh):
    // combine pulls nothing from a rank outside them, a cached dispatch needs the same links.
    uint32_t links;
    int32_t pad[5];
    // Followed by int32 expert_counts[num_local_experts] (rounded up to the alignment).
};
static_assert(sizeof(Meta) == 128, "Meta layout");
static_assert(offsetof(Meta, send_count) == 72, "Meta layout");
static_assert(offsetof(Meta, links) == 104, "Meta layout");

// What the host waits for after the count exchange, in host-mapped pinned memory.
struct HostInfo {
    uint64_t tag;  // the epoch of the dispatch these numbers belong to (written last)
    int32_t num_recv;
    int32_t pad;
    // Followed by int32 expert_counts[num_local_experts].
};
static_assert(sizeof(HostInfo) == 16, "HostInfo layout");

// ---- Launch parameters (passed by value) ----

// get_dispatch_layout.
struct LayoutParams {
    uint64_t topk_idx;            // const int32 [tokens][topk]
    uint64_t tokens_per_rank;     // int32 [ranks]
    uint64_t tokens_per_expert;   // int32 [experts]
    uint64_t is_token_in_rank;    // uint8 [tokens][ranks]
    uint64_t send_pos;            // int32 [tokens][ranks]: position among tokens to that rank, or -1
    uint64_t invalid;             // LayoutInvalid: ids outside [-1, num_experts)
    int32_t num_tokens;
    int32_t topk;
    int32_t ranks;
    int32_t num_experts;
};
static_assert(sizeof(LayoutParams) == 64, "LayoutParams layout");

// Count exchange and start barrier of a dispatch (one block).
struct NotifyParams {
    uint64_t signal[kMaxRanks];   // every rank's signal region
    uint64_t recv_base;           // this rank's receive region for this dispatch
    uint64_t recv_offset;         // the same region as an offset in this rank's window
    uint64_t cached_meta;         // a previous dispatch's Meta to reuse, or 0
    uint64_t tokens_per_rank;     // int32 [ranks] (unused when cached)
    uint64_t tokens_per_expert;   // int32 [experts], or 0 without top-k
    uint64_t host_info;           // HostInfo in mapped memory, or 0 (no host wait)
    uint64_t error;               // ErrorSlot (device memory; points at the host-mapped ErrorWord)
    uint64_t epoch;
    uint64_t timeout_ns;
    int32_t rank;
    int32_t ranks;
    int32_t num_local_experts;
    int32_t expert_alignment;
    int32_t num_worst_tokens;     // 0: none
    int32_t num_tokens;           // tokens this rank sends: published counts lie in [0, this]
    uint64_t mask;                // int32 [kMaxRanks] rank mask of this rank (1 = masked), or 0: none
};
static_assert(sizeof(NotifyParams) == 168, "NotifyParams layout");
static_assert(offsetof(NotifyParams, mask) == 160, "NotifyParams layout");
static_assert(offsetof(NotifyParams, num_tokens) == 156, "NotifyParams layout");
static_assert(offsetof(NotifyParams, recv_offset) == 72, "NotifyParams layout");
static_assert(offsetof(NotifyParams, rank) == 136, "NotifyParams layout");

// Receive-region section offsets (bytes from the region's base), equal on every rank. The region
// starts with a Meta and its expert counts; these sections follow.
struct RegionLayout {
    uint64_t x;
    uint64_t scales;
    uint64_t topk_idx;
    uint64_t topk_weights;
};
static_assert(sizeof(RegionLayout) == 32, "RegionLayout layout");

// The push of a dispatch (`num_sms` blocks).
struct DispatchParams {
    uint64_t signal[kMaxRanks];   // every rank's signal region (this rank's holds peers' recv_offset)
    uint64_t window[kMaxRanks];   // every rank's window, as mapped here (a destination's rows are
                                  // at window[d] + its published recv_offset)
    RegionLayout region;
    uint64_t meta;                // this rank's Meta for this dispatch
    uint64_t x;                   // [tokens][row_bytes]
    uint64_t scales;              // f32 [tokens][scale_words], or 0
    uint64_t topk_idx;            // int32 [tokens][topk], or 0
    uint64_t topk_weights;        // f32 [tokens][topk], or 0
    uint64_t send_pos;            // int32 [tokens][ranks]
    uint64_t error;
    uint64_t epoch;
    uint64_t timeout_ns;
    int32_t rank;
    int32_t ranks;
    int32_t num_tokens;
    int32_t row_bytes;            // multiple of 16
    int32_t scale_words;
    int32_t topk;
    int32_t num_local_experts;
    int32_t num_worst_tokens;     // 0: none; else pad rows [num_recv, this) of top-k
    int32_t cap;                  // rows of every receive region: none at or past it is written
    int32_t pad;
};
static_assert(sizeof(DispatchParams) == 272, "DispatchParams layout");
static_assert(offsetof(DispatchParams, cap) == 264, "DispatchParams layout");
static_assert(offsetof(DispatchParams, region) == 128, "DispatchParams layout");
static_assert(offsetof(DispatchParams, rank) == 232, "DispatchParams layout");

// A bare barrier (one block), e.g. before a combine.
struct BarrierParams {
    uint64_t signal[kMaxRanks];
    uint64_t publish_x;           // combine input rows to publish as comb_src, or 0
    uint64_t publish_w;           // combine input weights to publish as comb_w_src, or 0
    uint64_t error;
    uint64_t epoch;
    uint64_t timeout_ns;
    int32_t rank;
    int32_t ranks;
    int32_t what;
    int32_t pad;
    uint64_t mask;                // int32 [kMaxRanks] rank mask of this rank (1 = masked), or 0: none
};
static_assert(sizeof(BarrierParams) == 128, "BarrierParams layout");
static_assert(offsetof(BarrierParams, mask) == 120, "BarrierParams layout");

// The pull combine (`num_sms` blocks): each token's copies are read straight from the ranks
// that hold them (their combine inputs, published by the start barrier), summed in f32, biased
// and written as BF16; the last block then tells every peer it is done reading.
struct CombinePullParams {
    uint64_t signal[kMaxRanks];
    uint64_t meta;                // the handle's Meta (send_offset = where our rows sit at each peer)
    uint64_t send_pos;            // int32 [tokens][ranks]
    uint64_t bias0;               // bf16 [tokens][hidden], or 0
    uint64_t bias1;
    uint64_t out;                 // bf16 [tokens][hidden]
    uint64_t out_weights;         // f32 [tokens][topk], or 0
    uint64_t error;
    uint64_t epoch;
    uint64_t timeout_ns;
    int32_t rank;
    int32_t ranks;
    int32_t num_tokens;
    int32_t hidden;
    int32_t topk;
    int32_t pad;
    uint64_t mask;                // int32 [kMaxRanks] rank mask of this rank (1 = masked), or 0: none
};
static_assert(sizeof(CombinePullParams) == 168, "CombinePullParams layout");
static_assert(offsetof(CombinePullParams, mask) == 160, "CombinePullParams layout");

}  // namespace ep
