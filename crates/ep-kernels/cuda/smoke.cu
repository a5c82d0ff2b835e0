// Kernels that prove the build-embed-load-launch loop and peer (NVLink) access work.
#include <cstdint>

// The value word `i` of a pattern must hold: a cheap hash, so a misplaced or stale word shows.
__device__ __forceinline__ uint32_t pattern_word(uint64_t i, uint32_t seed) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return static_cast<uint32_t>(x);
}

// Writes the pattern over `n` words.
extern "C" __global__ void smoke_fill(uint32_t* dst, uint64_t n, uint32_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = pattern_word(i, seed);
}

// Copies `n` words from `src` (possibly another GPU's memory, read over NVLink) to `dst` with
// 16-byte loads; `n` is a multiple of 4 and both pointers are 16-byte aligned.
extern "C" __global__ void smoke_copy(const uint4* src, uint4* dst, uint64_t n_vec) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n_vec; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
