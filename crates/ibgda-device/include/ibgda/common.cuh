// Portability layer shared by the ibgda headers: the same source compiles under nvcc (host and
// device passes) and as plain C++11 on the host, so the CPU-only tests can check every layout and
// builder without a GPU.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
// Callable from host and device code; inlined because builders sit on the submit fast path.
#define IBGDA_HD __host__ __device__ __forceinline__
#else
#define IBGDA_HD inline
#endif

// Full unrolling in device code (constant indices keep a WQEBB in registers); nothing on the host.
#if defined(__CUDA_ARCH__)
#define IBGDA_UNROLL _Pragma("unroll")
#else
#define IBGDA_UNROLL
#endif

#if !defined(__CUDA_ARCH__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ibgda headers assume a little-endian host (the GPU is little-endian too)"
#endif

// Byte swaps. The mlx5 wire format is big-endian; these are the only conversions the headers use.
IBGDA_HD uint16_t ibgda_bswap16(uint16_t x) {
#if defined(__CUDA_ARCH__)
    return (uint16_t)__byte_perm((uint32_t)x, 0u, 0x3201u);
#else
    return __builtin_bswap16(x);
#endif
}

IBGDA_HD uint32_t ibgda_bswap32(uint32_t x) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(x, 0u, 0x0123u);
#else
    return __builtin_bswap32(x);
#endif
}

IBGDA_HD uint64_t ibgda_bswap64(uint64_t x) {
    return ((uint64_t)ibgda_bswap32((uint32_t)x) << 32) | (uint64_t)ibgda_bswap32((uint32_t)(x >> 32));
}

// Host order to wire (big-endian) order and back: the same swap both ways on a little-endian machine.
IBGDA_HD uint16_t ibgda_htobe16(uint16_t x) { return ibgda_bswap16(x); }
IBGDA_HD uint32_t ibgda_htobe32(uint32_t x) { return ibgda_bswap32(x); }
IBGDA_HD uint64_t ibgda_htobe64(uint64_t x) { return ibgda_bswap64(x); }
IBGDA_HD uint16_t ibgda_be16toh(uint16_t x) { return ibgda_bswap16(x); }
IBGDA_HD uint32_t ibgda_be32toh(uint32_t x) { return ibgda_bswap32(x); }
IBGDA_HD uint64_t ibgda_be64toh(uint64_t x) { return ibgda_bswap64(x); }
