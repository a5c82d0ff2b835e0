// get_dispatch_layout: top-k expert ids -> tokens per rank, tokens per expert, is_token_in_rank,
// and each token's position among the tokens sent to each rank (the dispatch's send order).
#include <cstdint>

#include "ep/device.cuh"

using namespace ep;

// One block per destination rank runs an ordered scan over the tokens; one more block counts
// tokens per expert. 1024 threads: the scan walks 1024 tokens per step.
constexpr int kLayoutThreads = 1024;

extern "C" __global__ void __launch_bounds__(kLayoutThreads) ep_dispatch_layout(const LayoutParams p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int* ids = reinterpret_cast<const int*>(p.topk_idx);
    const int experts_per_rank = p.num_experts / p.ranks;

    if (blockIdx.x == static_cast<unsigned>(p.ranks)) {
        // Tokens per expert (a token counts once per distinct expert) and invalid ids.
        extern __shared__ int hist[];
        for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) hist[e] = 0;
        __shared__ int invalid, first;
        if (threadIdx.x == 0) {
            invalid = 0;
            first = INT32_MAX;
        }
        __syncthreads();
        for (int t = threadIdx.x; t < p.num_tokens; t += blockDim.x) {
            for (int k = 0; k < p.topk; ++k) {
                const int e = ids[t * p.topk + k];
                if (e < -1 || e >= p.num_experts) {
                    atomicAdd(&invalid, 1);
                    atomicMin(&first, t * p.topk + k);
                    continue;
                }
                if (e < 0) continue;
                bool dup = false;
                for (int j = 0; j < k; ++j) dup |= ids[t * p.topk + j] == e;
                if (!dup) atomicAdd(&hist[e], 1);
            }
        }
        __syncthreads();
        int* out = reinterpret_cast<int*>(p.tokens_per_expert);
        for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) out[e] = hist[e];
        if (threadIdx.x == 0) {
            LayoutInvalid* r = reinterpret_cast<LayoutInvalid*>(p.invalid);
            r->count = invalid;
            r->first = first;
            r->id = invalid > 0 ? ids[first] : 0;
            r->pad = 0;
        }
        return;
    }

    // Ordered scan for destination rank d.
    const int d = blockIdx.x;
    const int lo = d * experts_per_rank, hi = lo + experts_per_rank;
    __shared__ int warp_sums[kLayoutThreads / 32];
    __shared__ int base;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    uint8_t* in_rank = reinterpret_cast<uint8_t*>(p.is_token_in_rank);
    int* send_pos = reinterpret_cast<int*>(p.send_pos);
    for (int start = 0; start < p.num_tokens; start += blockDim.x) {
        const int t = start + threadIdx.x;
        bool in = false;
        if (t < p.num_tokens) {
            for (int k = 0; k < p.topk; ++k) {
                const int e = ids[t * p.topk + k];
                in |= e >= lo && e < hi;
            }
        }
        const unsigned mask = __ballot_sync(0xffffffffu, in);
        const int in_warp = __popc(mask & ((1u << lane) - 1u));
        if (lane == 0) warp_sums[warp] = __popc(mask);
        __syncthreads();
        if (warp == 0) {
            const int n = blockDim.x / 32;
            int v = lane < n ? warp_sums[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(0xffffffffu, v, o);
                if (lane >= o) v += u;
            }
            if (lane < n) warp_sums[lane] = v;  // inclusive
        }
        __syncthreads();
        const int before = base + (warp > 0 ? warp_sums[warp - 1] : 0) + in_warp;
        if (t < p.num_tokens) {
            in_rank[static_cast<int64_t>(t) * p.ranks + d] = in ? 1 : 0;
            send_pos[static_cast<int64_t>(t) * p.ranks + d] = in ? before : -1;
        }
        __syncthreads();
        if (threadIdx.x == 0) base += warp_sums[blockDim.x / 32 - 1];
        __syncthreads();
    }
    if (threadIdx.x == 0) reinterpret_cast<int*>(p.tokens_per_rank)[d] = base;
}
