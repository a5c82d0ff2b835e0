// Intranode (NVLink) dispatch and combine between ranks whose memory is mapped into each other's
// address space (peer access or CUDA IPC).
//
// Every rank's signal region, receive regions and combine staging lie in one device allocation,
// its window, that every peer maps once at creation; kernels get each peer's window base and
// exchange offsets into it, so ranks as processes (each mapping a peer at its own address) and
// as threads run the same code.
//
// Dispatch: `ep_intranode_notify` (one block) exchanges token counts and receive-region
// offsets, runs the start barrier and computes where this rank's tokens go in every
// destination; `ep_intranode_dispatch` pushes each token straight into its final row in every
// destination's receive region (16-byte streaming loads, stores to peer memory), then its last
// block releases the data and waits for every peer's. Combine: `ep_intranode_notify_barrier` publishes
// this rank's combine input (its address with ranks as threads; with ranks as processes its
// offset in this rank's window, where the host staged it unless it already lay there), then
// `ep_intranode_combine_pull` reads every copy of each token straight from the ranks holding
// them and sums them in one pass.
// Every wait is bounded and reports through the device error slot and the host-mapped word.
//
// Rank masks: each rank reads its mask (NotifyParams/BarrierParams/CombinePullParams::mask) as a
// link set (links_of in device.cuh) and exchanges counts, flags and rows with linked ranks only,
// so ranks that mask each other never wait on each other. The row layout at each destination is
// computed by every sender from the counts of the senders before it, which is only right when
// linked ranks link the same set (masks symmetric and transitive: the ranks fall into groups).
// Each notify and barrier publishes this rank's link set with its release and checks every
// linked peer's after the wait (links_agree): a disagreement is kErrMaskMismatch, never a
// silently wrong layout. A rank that masks a peer which does not mask it back never releases to
// it: the peer, waiting, sees that rank's epoch reach the operation with a link set leaving it
// out (OneSidedMask) and fails with kErrMaskMismatch too; if that rank never reaches the
// operation, the wait runs to its bound (kErrTimeout).
#include <cstdint>

#include "ep/device.cuh"

using namespace ep;

// The push kernels run one 1024-thread block per SM: 32 warps, each moving one token at a time,
// is enough memory parallelism to saturate an SM's share of NVLink with kUnroll loads in flight.
constexpr int kPushThreads = 1024;
// 16-byte loads each lane issues before its first store: 4 x 32 lanes x 16 B = 2 KiB per warp in
// flight, 64 KiB per SM; more costs registers under the 64-per-thread cap of 1024 threads.
constexpr int kUnroll = 4;
constexpr int kNotifyThreads = 256;

__device__ __forceinline__ int* experts_of(SignalHead* s) { return reinterpret_cast<int*>(s + 1); }
__device__ __forceinline__ int* expert_counts_of(Meta* m) { return reinterpret_cast<int*>(m + 1); }

__device__ __forceinline__ int ld_volatile_i32(const int* p) {
    return static_cast<int>(ld_volatile_u32(reinterpret_cast<const uint32_t*>(p)));
}

// A strong (relaxed, system-scope) 64-bit store: after a system fence of the same thread it is a
// release (the PTX memory model's release pattern: a fence followed by a strong write).
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// This kernel's barrier epoch: one past the last one this rank used, kept in its own signal
// region and advanced here, on the GPU. Kernel parameters carry no epoch the barriers rely on, so
// a replayed CUDA graph takes fresh epochs; every rank runs the same epoch-taking kernels in the
// same order (notify, dispatch; barrier, combine or pull), so the ranks' counters agree. Only this
// rank's kernels, ordered on its one stream, write the counter.
//
// Every thread of the block calls this; it also releases the epoch to the linked peers (as
// release_to_peers in device.cuh: thread r < ranks in `links` fences and stores rank r's flag
// slot for this rank). Thread 0 advances the counter after the same system fence, so the
// counter's store is a release as well: what the block wrote before (its link set among it,
// ordered by the __syncthreads here) is visible to a peer that reads the new epoch with acquire
// (OneSidedMask). One system fence per releasing thread, as the release alone takes: a fence of
// the counter's own would put a second one on thread 0's path, ahead of every peer's release.
__device__ __forceinline__ uint64_t next_epoch_released(const uint64_t* signals, int rank, int ranks,
                                                        uint32_t links) {
    __shared__ uint64_t epoch;
    SignalHead* mine = signal_of(signals, rank);
    if (threadIdx.x == 0) epoch = mine->epoch + 1;
    __syncthreads();
    const uint64_t e = epoch;
    const int r = threadIdx.x;
    const bool to_peer = r < ranks && linked(links, r);
    if (to_peer || r == 0) __threadfence_system();
    if (r == 0) st_relaxed_sys(&mine->epoch, e);
    if (to_peer) st_release_sys(&signal_of(signals, r)->flag[rank], e);
    return e;
}

// `v`, a count read from a layout tensor, clamped to [0, limit]; one out of range is reported
// (when `report`: each value is read by several threads) as kErrBadRouting.
__device__ __forceinline__ int checked_count(int v, int limit, bool report, uint32_t what, int index,
                                             const NotifyParams& p) {
    if (v >= 0 && v <= limit) return v;
    if (report)
        record_error(p.error, kErrBadRouting, p.rank, limit, what, static_cast<uint64_t>(index),
                     static_cast<uint64_t>(static_cast<int64_t>(v)));
    return v < 0 ? 0 : limit;
}

// After a barrier: every linked peer published the link set this rank has (thread r checks peer r,
// whose release it acquired). This rank's own entry is not read back: this block wrote it, with
// `links`, before its release (a rank alone on its GPU has no other to check). Returns false on
// every thread of the block after recording kErrMaskMismatch for the first that differs.
__device__ __forceinline__ bool links_agree(const uint64_t* signals, int rank, int ranks, uint32_t links,
                                            uint64_t epoch, uint64_t error) {
    __shared__ int differ;
    if (threadIdx.x == 0) differ = 0;
    __syncthreads();
    const int r = threadIdx.x;
    if (r < ranks && r != rank && linked(links, r)) {
        const uint32_t theirs = ld_volatile_u32(&signal_of(signals, rank)->links[r]);
        if (theirs != links) {
            record_error(error, kErrMaskMismatch, rank, r, kMaskPeerLinks, epoch,
                         (static_cast<uint64_t>(theirs) << 32) | links);
            atomicExch(&differ, 1);
        }
    }
    __syncthreads();
    return differ == 0;
}

// Asked now and then while this rank waits for linked peer r at `epoch` (a notify's or a
// barrier's): whether r has reached this operation (its epoch is at or past ours: every rank
// takes the same epochs) with a link set that leaves this rank out, i.e. r masks this rank,
// which does not mask r back. Then r will never release to this rank: kErrMaskMismatch now,
// rather than a timeout. r's link set is read after its epoch (acquire), so it is this
// operation's or a later one's; a later one's may already link this rank again, and the wait
// then runs to its bound as before.
struct OneSidedMask {
    const uint64_t* signals;
    int rank;
    uint32_t links;
    uint64_t epoch;
    uint64_t error;
    __device__ __forceinline__ bool operator()(int r) const {
        SignalHead* theirs = signal_of(signals, r);
        if (ld_acquire_sys(&theirs->epoch) < epoch) return false;
        const uint32_t their_links = ld_volatile_u32(&theirs->links[r]);
        if (linked(their_links, rank)) return false;
        record_error(error, kErrMaskMismatch, rank, r, kMaskOneSided, epoch,
                     (static_cast<uint64_t>(their_links) << 32) | links);
        return true;
    }
};

extern "C" __global__ void __launch_bounds__(kNotifyThreads) ep_intranode_notify(const NotifyParams p) {
    __shared__ int abort;
    if (threadIdx.x == 0) abort = error_recorded(p.error);
    __syncthreads();
    if (abort) return;
    const int L = p.num_local_experts;
    const bool cached = p.cached_meta != 0;
    const uint32_t links = links_of(p.mask, p.rank, p.ranks);
    // 1. Publish: where this rank's receive region lies in its window, its link set, its count
    // row and per-expert counts, to every linked rank (counts to unlinked ranks published as 0).
    for (int d = threadIdx.x; d < p.ranks; d += blockDim.x) {
        if (!linked(links, d)) continue;
        signal_of(p.signal, d)->recv_offset[p.rank] = p.recv_offset;
        signal_of(p.signal, d)->links[p.rank] = links;
    }
    if (!cached) {
        // The layout's tensors are the caller's: a count outside [0, tokens] is reported and
        // published clamped, so every rank's offsets stay inside its receive region (each rank
        // receives at most ranks x max_tokens rows); the push then sends nothing past a count.
        const int* per_rank = reinterpret_cast<const int*>(p.tokens_per_rank);
        for (int i = threadIdx.x; i < p.ranks * p.ranks; i += blockDim.x) {
            const int d = i / p.ranks, j = i % p.ranks;
            if (!linked(links, d)) continue;
            signal_of(p.signal, d)->tokens[p.rank][j] =
                linked(links, j) ? checked_count(per_rank[j], p.num_tokens, d == p.rank, kRoutingTokensPerRank, j, p)
                                 : 0;
        }
        const int* per_expert = reinterpret_cast<const int*>(p.tokens_per_expert);
        for (int i = threadIdx.x; i < p.ranks * L; i += blockDim.x) {
            const int d = i / L, l = i % L;
            if (!linked(links, d)) continue;
            experts_of(signal_of(p.signal, d))[p.rank * L + l] =
                per_expert != nullptr
                    ? checked_count(per_expert[d * L + l], p.num_tokens, true, kRoutingTokensPerExpert, d * L + l, p)
                    : 0;
        }
    }
    const uint64_t epoch = next_epoch_released(p.signal, p.rank, p.ranks, links);  // synchronizes the block
    const OneSidedMask one_sided{p.signal, p.rank, links, epoch, p.error};
    if (!wait_for_peers(p.signal, p.rank, p.ranks, epoch, p.timeout_ns, p.error, kWaitDispatchCounts, links, one_sided))
        return;
    if (!links_agree(p.signal, p.rank, p.ranks, links, epoch, p.error)) return;

    // 2. This dispatch's Meta, at the start of the receive region.
    SignalHead* mine = signal_of(p.signal, p.rank);
    Meta* meta = reinterpret_cast<Meta*>(p.recv_base);
    if (cached) {
        const int* from = reinterpret_cast<const int*>(p.cached_meta);
        int* to = reinterpret_cast<int*>(meta);
        for (int i = threadIdx.x; i < static_cast<int>(sizeof(Meta) / 4) + L; i += blockDim.x) to[i] = from[i];
        // The handle's rows were laid out for its links: sent again under others, they would
        // land where the receivers do not expect them.
        const uint32_t was = reinterpret_cast<const Meta*>(p.cached_meta)->links;
        if (was != links) {
            if (threadIdx.x == 0)
                record_error(p.error, kErrMaskMismatch, p.rank, p.rank, kMaskCachedHandle, epoch,
                             (static_cast<uint64_t>(was) << 32) | links);
            return;
        }
    } else {
        // Only linked ranks wrote this epoch's counts here: an unlinked rank's are stale, and
        // count as 0.
        const auto count = [&](int r, int d) { return linked(links, r) ? ld_volatile_i32(&mine->tokens[r][d]) : 0; };
        if (threadIdx.x == 0) {
            int off = 0;
            for (int r = 0; r < p.ranks; ++r) {
                meta->recv_offset[r] = off;
                off += count(r, p.rank);
            }
            meta->recv_offset[p.ranks] = off;
            meta->num_recv = off;
            meta->links = links;
        }
        if (threadIdx.x < p.ranks) {
            const int d = threadIdx.x;
            int off = 0;
            for (int r = 0; r < p.rank; ++r) off += count(r, d);
            meta->send_offset[d] = off;
            meta->send_count[d] = count(p.rank, d);
        }
        const int align = p.expert_alignment > 0 ? p.expert_alignment : 1;
        for (int l = threadIdx.x; l < L; l += blockDim.x) {
            int c = 0;
            for (int r = 0; r < p.ranks; ++r)
                if (linked(links, r)) c += ld_volatile_i32(&experts_of(mine)[r * L + l]);
            expert_counts_of(meta)[l] = (c + align - 1) / align * align;
        }
    }
    __syncthreads();
    const int num_recv = meta->num_recv;
    if (p.num_worst_tokens > 0 && num_recv > p.num_worst_tokens && threadIdx.x == 0)
        record_error(p.error, kErrWorstTokensExceeded, p.rank, p.rank, static_cast<uint32_t>(p.num_worst_tokens),
                     p.epoch, static_cast<uint64_t>(num_recv));

    // 3. What the host waits for (skipped with num_worst_tokens: no host wait).
    if (p.host_info != 0) {
        HostInfo* h = reinterpret_cast<HostInfo*>(p.host_info);
        int* counts = reinterpret_cast<int*>(h + 1);
        for (int l = threadIdx.x; l < L; l += blockDim.x) counts[l] = expert_counts_of(meta)[l];
        if (threadIdx.x == 0) h->num_recv = num_recv;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            *reinterpret_cast<volatile uint64_t*>(&h->tag) = p.epoch;
        }
    }
}

// The last block of a push kernel to finish: every block fences its peer stores and counts
// itself done; the last one then takes the kernel's epoch (as next_epoch_released does, inline
// here: a separate barrier for it costs the pull kernel registers), releases it to every peer
// (cumulatively covering all blocks' stores) and waits for every peer's release. Returns true on
// that block only, after a successful wait.
__device__ __forceinline__ bool finish_push(const uint64_t* signals, int rank, int ranks, uint64_t timeout_ns,
                                            uint64_t error, uint32_t what, uint32_t links) {
    __shared__ int last;
    __shared__ uint64_t epoch;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        SignalHead* mine = signal_of(signals, rank);
        const unsigned prev = atomicAdd(&mine->blocks_done, 1u);
        last = prev == gridDim.x - 1;
        if (last) {
            mine->blocks_done = 0;  // every block has counted itself: nobody else touches it now
            epoch = mine->epoch + 1;  // this kernel's epoch (see next_epoch_released)
            mine->epoch = epoch;
            __threadfence();
        }
    }
    __syncthreads();
    if (!last) return false;
    release_to_peers(signals, rank, ranks, epoch, links);
    return wait_for_peers(signals, rank, ranks, epoch, timeout_ns, error, what, links);
}

extern "C" __global__ void __launch_bounds__(kPushThreads, 1) ep_intranode_dispatch(const DispatchParams p) {
    __shared__ uint64_t dst_base[kMaxRanks];
    __shared__ int send_offset[kMaxRanks];
    __shared__ int send_count[kMaxRanks];
    __shared__ int abort;
    __shared__ uint32_t links;
    SignalHead* mine = signal_of(p.signal, p.rank);
    const Meta* meta = reinterpret_cast<const Meta*>(p.meta);
    if (threadIdx.x == 0) {
        abort = error_recorded(p.error);
        links = meta->links;  // what notify linked (a cached dispatch: checked equal to the handle's)
    }
    if (threadIdx.x < p.ranks) {
        const int d = threadIdx.x;
        dst_base[d] = p.window[d] + ld_volatile_u64(&mine->recv_offset[d]);
        send_offset[d] = meta->send_offset[d];
        // What this rank published to d (clamped by notify; a cached dispatch's Meta keeps the
        // original's): its rows there are [send_offset, send_offset + count), inside d's region.
        send_count[d] = meta->send_count[d];
    }
    __syncthreads();
    if (abort) return;

    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int n16 = p.row_bytes / 16;
    const int L = p.num_local_experts;
    const int* send_pos = reinterpret_cast<const int*>(p.send_pos);
    // Lane d < ranks reads destination d's send positions. An unlinked (masked) destination gets
    // none of this rank's tokens; a position is sent only below `pos_limit`: under the count
    // published to d and inside d's receive region (send_offset + pos < cap). Read once here:
    // the loop's stores would make the compiler read the shared copies again every token.
    const bool lane_sends = lane < p.ranks && linked(links, lane);
    const int pos_limit =
        lane_sends ? static_cast<int>(min(static_cast<int64_t>(send_count[lane]),
                                          static_cast<int64_t>(p.cap) - static_cast<int64_t>(send_offset[lane])))
                   : 0;
    for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < p.num_tokens; t += gridDim.x * warps) {
        int pos = lane_sends ? send_pos[static_cast<int64_t>(t) * p.ranks + lane] : -1;
        if (pos >= 0 && pos >= pos_limit) {
            // Out of agreement with the published count (tokens_per_rank edited): not sent.
            record_error(p.error, kErrBadRouting, p.rank, send_count[lane] > 0 ? send_count[lane] - 1 : 0,
                         kRoutingSendPosition, static_cast<uint64_t>(t) * p.ranks + lane,
                         static_cast<uint64_t>(static_cast<int64_t>(pos)));
            pos = -1;
        }
        const unsigned mask = __ballot_sync(0xffffffffu, pos >= 0);
        if (mask == 0) continue;
        int64_t row[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            const int pd = __shfl_sync(0xffffffffu, pos, d);
            row[d] = static_cast<int64_t>(send_offset[d < p.ranks ? d : 0]) + pd;
        }

        const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<uint64_t>(t) * p.row_bytes);
        for (int i = lane; i < n16; i += 32 * kUnroll) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * 32 < n16) v[u] = ld_stream_v4(src + i + u * 32);
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                if (!((mask >> d) & 1u)) continue;
                int4* dst = reinterpret_cast<int4*>(dst_base[d] + p.region.x + static_cast<uint64_t>(row[d]) * p.row_bytes);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i + u * 32 < n16) st_stream_v4(dst + i + u * 32, v[u]);
            }
        }
        if (p.scale_words > 0) {
            const float* s = reinterpret_cast<const float*>(p.scales) + static_cast<int64_t>(t) * p.scale_words;
            for (int w = lane; w < p.scale_words; w += 32) {
                const float v = s[w];
#pragma unroll
                for (int d = 0; d < kMaxRanks; ++d)
                    if ((mask >> d) & 1u)
                        reinterpret_cast<float*>(dst_base[d] + p.region.scales)[row[d] * p.scale_words + w] = v;
            }
        }
        if (p.topk > 0) {
            for (int k = lane; k < p.topk; k += 32) {
                const int e = reinterpret_cast<const int*>(p.topk_idx)[static_cast<int64_t>(t) * p.topk + k];
                const float w = reinterpret_cast<const float*>(p.topk_weights)[static_cast<int64_t>(t) * p.topk + k];
#pragma unroll
                for (int d = 0; d < kMaxRanks; ++d) {
                    if (!((mask >> d) & 1u)) continue;
                    const int local = (e >= d * L && e < (d + 1) * L) ? e - d * L : -1;
                    reinterpret_cast<int*>(dst_base[d] + p.region.topk_idx)[row[d] * p.topk + k] = local;
                    reinterpret_cast<float*>(dst_base[d] + p.region.topk_weights)[row[d] * p.topk + k] =
                        local >= 0 ? w : 0.0f;
                }
            }
        }
    }

    if (!finish_push(p.signal, p.rank, p.ranks, p.timeout_ns, p.error, kWaitDispatchData, links)) return;
    // Fixed-size output: rows past the received ones carry no expert.
    if (p.num_worst_tokens > 0 && p.topk > 0) {
        const Meta* my_meta = reinterpret_cast<const Meta*>(dst_base[p.rank]);
        const int n = my_meta->num_recv;
        int* idx = reinterpret_cast<int*>(dst_base[p.rank] + p.region.topk_idx);
        float* wts = reinterpret_cast<float*>(dst_base[p.rank] + p.region.topk_weights);
        for (int64_t i = static_cast<int64_t>(n) * p.topk + threadIdx.x;
             i < static_cast<int64_t>(p.num_worst_tokens) * p.topk; i += blockDim.x) {
            idx[i] = -1;
            wts[i] = 0.0f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kNotifyThreads) ep_intranode_notify_barrier(const BarrierParams p) {
    __shared__ int abort;
    if (threadIdx.x == 0) abort = error_recorded(p.error);
    __syncthreads();
    if (abort) return;
    const uint32_t links = links_of(p.mask, p.rank, p.ranks);
    if (threadIdx.x < p.ranks && linked(links, threadIdx.x)) {
        SignalHead* peer = signal_of(p.signal, threadIdx.x);
        if (p.publish_x != 0) {
            peer->comb_src[p.rank] = p.publish_x;
            peer->comb_w_src[p.rank] = p.publish_w;
        }
        peer->links[p.rank] = links;
    }
    const uint64_t epoch = next_epoch_released(p.signal, p.rank, p.ranks, links);  // synchronizes the block
    const OneSidedMask one_sided{p.signal, p.rank, links, epoch, p.error};
    if (!wait_for_peers(p.signal, p.rank, p.ranks, epoch, p.timeout_ns, p.error, static_cast<uint32_t>(p.what), links,
                        one_sided))
        return;
    links_agree(p.signal, p.rank, p.ranks, links, epoch, p.error);
}

// 4 x 8 f32 accumulators and 4 loads per lane: the most that fits 64 registers unspilled.
constexpr int kReduceUnroll = 4;

__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc[2 * j] += bf16_to_f32(static_cast<uint16_t>(w[j] & 0xffffu));
        acc[2 * j + 1] += bf16_to_f32(static_cast<uint16_t>(w[j] >> 16));
    }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    return static_cast<uint32_t>(f32_to_bf16_rn(lo)) | (static_cast<uint32_t>(f32_to_bf16_rn(hi)) << 16);
}

// One warp: output row t = the sum (f32) of the BF16 rows row_of(d) of every copy d in `mask`,
// plus the biases, written as BF16; `load` reads 16 bytes of a copy's row (staging or a peer's
// input). kReduceUnroll chunks per lane per step, so each copy's row has kReduceUnroll 16-byte
// loads in flight per lane (the reduce is bound by loads in flight, not arithmetic).
template <typename RowOf, typename Load>
__device__ __forceinline__ void reduce_token(int t, unsigned mask, int lane, int n16, int64_t row_bytes, uint64_t bias0,
                                             uint64_t bias1, uint64_t out, const RowOf& row_of, const Load& load) {
    for (int c0 = lane; c0 < n16; c0 += 32 * kReduceUnroll) {
        float acc[kReduceUnroll][8];
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (!((mask >> d) & 1u)) continue;
            const int4* row = row_of(d);
            int4 v[kReduceUnroll];
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u)
                if (c0 + u * 32 < n16) v[u] = load(row + c0 + u * 32);
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) add_bf16x8(acc[u], v[u]);
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const uint64_t bias = b == 0 ? bias0 : bias1;
            if (bias == 0) continue;
            const int4* row = reinterpret_cast<const int4*>(bias + t * row_bytes);
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u)
                if (c0 + u * 32 < n16) add_bf16x8(acc[u], ld_stream_v4(row + c0 + u * 32));
        }
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
            if (c0 + u * 32 >= n16) continue;
            int4 o;
            o.x = static_cast<int>(pack_bf16x2(acc[u][0], acc[u][1]));
            o.y = static_cast<int>(pack_bf16x2(acc[u][2], acc[u][3]));
            o.z = static_cast<int>(pack_bf16x2(acc[u][4], acc[u][5]));
            o.w = static_cast<int>(pack_bf16x2(acc[u][6], acc[u][7]));
            reinterpret_cast<int4*>(out + t * row_bytes)[c0 + u * 32] = o;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kPushThreads, 1) ep_intranode_combine_pull(const CombinePullParams p) {
    __shared__ int abort;
    __shared__ uint64_t src_x[kMaxRanks], src_w[kMaxRanks];
    __shared__ int send_offset[kMaxRanks];
    __shared__ int warp_pos[kPushThreads / 32][kMaxRanks];
    // links: this combine's (the start barrier's); pull: those also linked at the dispatch, the
    // ranks a token's copies may come from (a rank masked since adds nothing to the sum).
    __shared__ uint32_t links, pull;
    SignalHead* mine = signal_of(p.signal, p.rank);
    const Meta* meta = reinterpret_cast<const Meta*>(p.meta);
    if (threadIdx.x == 0) {
        abort = error_recorded(p.error);
        links = links_of(p.mask, p.rank, p.ranks);
        pull = links & meta->links;
    }
    if (threadIdx.x < p.ranks) {
        // A window offset (ranks as processes) becomes an address through the peer's window
        // as mapped here.
        const auto resolve = [&](uint64_t v) { return (v & kInWindow) ? p.signal[threadIdx.x] + (v & ~kInWindow) : v; };
        src_x[threadIdx.x] = resolve(ld_volatile_u64(&mine->comb_src[threadIdx.x]));
        src_w[threadIdx.x] = resolve(ld_volatile_u64(&mine->comb_w_src[threadIdx.x]));
        send_offset[threadIdx.x] = meta->send_offset[threadIdx.x];
    }
    __syncthreads();
    if (abort) return;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int n16 = p.hidden / 8;
    const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
    const int* send_pos = reinterpret_cast<const int*>(p.send_pos);
    int* my_pos = warp_pos[threadIdx.x >> 5];
    for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < p.num_tokens; t += gridDim.x * warps) {
        const int pos = lane < p.ranks && linked(pull, lane) ? send_pos[static_cast<int64_t>(t) * p.ranks + lane] : -1;
        const unsigned mask = __ballot_sync(0xffffffffu, pos >= 0);
        __syncwarp();
        if (lane < kMaxRanks) my_pos[lane] = lane < p.ranks ? send_offset[lane] + pos : -1;
        __syncwarp();
        reduce_token(
            t, mask, lane, n16, row_bytes, p.bias0, p.bias1, p.out,
            [&](int d) { return reinterpret_cast<const int4*>(src_x[d] + my_pos[d] * row_bytes); },
            [](const int4* q) { return ld_peer_v4(q); });
        if (p.out_weights != 0) {
            for (int k = lane; k < p.topk; k += 32) {
                float sum = 0.0f;
#pragma unroll
                for (int d = 0; d < kMaxRanks; ++d)
                    if ((mask >> d) & 1u) sum += reinterpret_cast<const float*>(src_w[d])[static_cast<int64_t>(my_pos[d]) * p.topk + k];
                reinterpret_cast<float*>(p.out_weights)[static_cast<int64_t>(t) * p.topk + k] = sum;
            }
        }
    }
    // Peers may reuse their inputs once every rank has finished reading them.
    finish_push(p.signal, p.rank, p.ranks, p.timeout_ns, p.error, kWaitCombineData, links);
}
