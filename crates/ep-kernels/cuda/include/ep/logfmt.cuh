// LogFMT-10: the low-latency combine's optional wire format for BF16 expert outputs (DeepEP's
// `use_logfmt`, our own layout). Mirrored by `ep::low_latency::logfmt` (the CPU definition, with
// the byte layout spelled out); the sizes here and there are checked by the GPU test.
//
// A row of H channels (H a multiple of 128) travels as
//   meta  u32 [H / 128], padded to 16 bytes: per 128-channel group, the largest |x| (bf16 bits,
//         low half) and the smallest |x| (bf16 bits, high half)
//   then, group after group: 160 bytes of 10-bit codes when the group is cast, else its 256
//         bytes of BF16. Chunk i (channels 8i..8i+7) of a cast group is 10 bytes at 10i: an
//         80-bit little-endian field, channel 8i+j at bit 10j, bit 9 the sign, bits 0..8 the
//         magnitude code m: 0 is zero, m > 0 is 2^(lmin + (m - 1) * step).
// A group is cast when lmax = log2(amax) < 0 and lmin = max(log2(amin), lmax - 32) < lmax;
// step = (lmax - lmin) / 510 (codes 1..511 span [lmin, lmax]); a magnitude is rounded to the
// code whose value is nearest in the linear domain.
#pragma once
#include <cstdint>

#include "ep/device.cuh"

namespace ep {

constexpr int kLogfmtGroup = 128;              // channels per group
constexpr int kLogfmtCastBytes = 160;          // 128 × 10 bits
constexpr int kLogfmtRawBytes = 256;           // 128 × BF16
constexpr int kLogfmtMaxGroups = 8192 / 128;   // hidden ≤ 8192
constexpr float kLogfmtMinClip = 32.0f;        // lmin ≥ lmax - 32
constexpr float kLogfmtSteps = 510.0f;         // codes 1..511
constexpr uint32_t kLogfmtMaxCode = 511u;

__host__ __device__ constexpr int logfmt_meta_bytes(int hidden) {
    return ((hidden / kLogfmtGroup) * 4 + 15) / 16 * 16;
}
// Bytes of one combine receive slot: a BF16 row, or (LogFMT) the meta and, at worst, no group
// cast.
__host__ __device__ constexpr uint64_t combine_slot_bytes(int hidden, bool logfmt) {
    return static_cast<uint64_t>(hidden) * 2 + (logfmt ? static_cast<uint64_t>(logfmt_meta_bytes(hidden)) : 0);
}
static_assert(logfmt_meta_bytes(7168) == 224 && combine_slot_bytes(7168, true) == 14560, "LogFMT slot layout");

struct LogfmtGroup {
    float lmin;
    float step;      // 0: the group travels as BF16
    float step_inv;
    float fused;     // rounding offset - lmin / step
};

// The cast decision and the code parameters of a group from its |x| extremes (bf16 bits); the
// sender and the receiver compute them from the same bits.
__device__ __forceinline__ LogfmtGroup logfmt_group(uint32_t amax_bits, uint32_t amin_bits) {
    LogfmtGroup g{0.0f, 0.0f, 0.0f, 0.0f};
    const float lmax = log2f(bf16_to_f32(static_cast<uint16_t>(amax_bits)));
    const float lmin = fmaxf(log2f(bf16_to_f32(static_cast<uint16_t>(amin_bits))), lmax - kLogfmtMinClip);
    if (!(lmax < 0.0f && lmin < lmax)) return g;  // NaN and inf stay BF16 too
    g.lmin = lmin;
    g.step = (lmax - lmin) / kLogfmtSteps;
    g.step_inv = 1.0f / g.step;
    // Between codes c and c + 1 the linear midpoint decides: log2((1 + 2^step) / 2) above code c.
    const float rounding = 2.0f - log2f((1.0f + exp2f(g.step)) * 0.5f) * g.step_inv;
    g.fused = rounding - lmin * g.step_inv;
    return g;
}

__device__ __forceinline__ uint32_t logfmt_code(uint16_t bits, const LogfmtGroup& g) {
    const uint32_t mag_bits = bits & 0x7fffu;
    uint32_t m = 0;
    if (mag_bits != 0) {
        const float v = floorf(fmaxf(log2f(bf16_to_f32(static_cast<uint16_t>(mag_bits))) * g.step_inv + g.fused, 0.0f));
        m = v >= static_cast<float>(kLogfmtMaxCode) ? kLogfmtMaxCode : static_cast<uint32_t>(v);
    }
    return m | ((bits & 0x8000u) ? 0x200u : 0u);
}

__device__ __forceinline__ float logfmt_value(uint32_t code, const LogfmtGroup& g) {
    const uint32_t m = code & 0x1ffu;
    const float mag = m == 0 ? 0.0f : exp2f(static_cast<float>(m - 1) * g.step + g.lmin);
    return (code & 0x200u) ? -mag : mag;
}

// Warp-collective: encodes the BF16 row `src` (H channels, H / 128 ≤ 64 groups) into `dst`
// (16-byte aligned, at least combine_slot_bytes(H, true) bytes); returns the bytes written (a
// multiple of 16). Visible to the warp after a __syncwarp.
__device__ __forceinline__ int logfmt_encode_row(const int4* src, char* dst, int hidden, int lane) {
    const int G = min(hidden / kLogfmtGroup, kLogfmtMaxGroups);
    const int meta = logfmt_meta_bytes(hidden);
    uint32_t* meta_words = reinterpret_cast<uint32_t*>(dst);
    // Pass 1: lane takes groups lane and lane + 32: extremes, decision, size.
    int size[2] = {0, 0};
    LogfmtGroup gi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int g = lane + 32 * h;
        gi[h] = LogfmtGroup{0.0f, 0.0f, 0.0f, 0.0f};
        if (g < G) {
            // Magnitudes compared as bf16 bits: ordered like the values for non-negative numbers.
            uint32_t amax = 0, amin = 0x7fffu;
            for (int c = 0; c < kLogfmtGroup / 8; ++c) {
                const int4 v = src[g * (kLogfmtGroup / 8) + c];
                const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                                       static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t lo = w[j] & 0x7fffu, hi = (w[j] >> 16) & 0x7fffu;
                    amax = max(amax, max(lo, hi));
                    amin = min(amin, min(lo, hi));
                }
            }
            meta_words[g] = amax | (amin << 16);
            gi[h] = logfmt_group(amax, amin);
            size[h] = gi[h].step > 0.0f ? kLogfmtCastBytes : kLogfmtRawBytes;
        } else if (g < meta / 4) {
            meta_words[g] = 0;  // padding of the meta
        }
    }
    // Offsets: an inclusive scan of the sizes over the lanes, groups 0..31 before 32..63.
    int incl[2] = {size[0], size[1]};
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = __shfl_up_sync(0xffffffffu, incl[h], o);
            if (lane >= o) incl[h] += t;
        }
    }
    const int total0 = __shfl_sync(0xffffffffu, incl[0], 31);
    const int total = meta + total0 + __shfl_sync(0xffffffffu, incl[1], 31);
    const int off[2] = {meta + incl[0] - size[0], meta + total0 + incl[1] - size[1]};
    // Pass 2: each half-warp one group, each lane 8 channels.
    const int half = lane >> 4, i = lane & 15;
    for (int g0 = 0; g0 < G; g0 += 2) {
        const int g = g0 + half;
        const int from = g & 31;
        const bool high = g >= 32;  // the same for both halves (g0 is even)
        LogfmtGroup q;
        q.lmin = __shfl_sync(0xffffffffu, high ? gi[1].lmin : gi[0].lmin, from);
        q.step = __shfl_sync(0xffffffffu, high ? gi[1].step : gi[0].step, from);
        q.step_inv = __shfl_sync(0xffffffffu, high ? gi[1].step_inv : gi[0].step_inv, from);
        q.fused = __shfl_sync(0xffffffffu, high ? gi[1].fused : gi[0].fused, from);
        const int goff = __shfl_sync(0xffffffffu, high ? off[1] : off[0], from);
        if (g >= G) continue;
        const int4 v = src[g * (kLogfmtGroup / 8) + i];
        if (q.step > 0.0f) {
            const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                                   static_cast<uint32_t>(v.w)};
            uint64_t lo = 0;
            uint32_t hi = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint64_t code = logfmt_code(static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2))), q);
                const int bit = 10 * j;
                if (bit < 64) lo |= code << bit;
                if (bit >= 64)
                    hi |= static_cast<uint32_t>(code << (bit - 64));
                else if (bit + 10 > 64)
                    hi |= static_cast<uint32_t>(code >> (64 - bit));
            }
            uint16_t* o = reinterpret_cast<uint16_t*>(dst + goff + i * 10);
            o[0] = static_cast<uint16_t>(lo);
            o[1] = static_cast<uint16_t>(lo >> 16);
            o[2] = static_cast<uint16_t>(lo >> 32);
            o[3] = static_cast<uint16_t>(lo >> 48);
            o[4] = static_cast<uint16_t>(hi);
        } else {
            reinterpret_cast<int4*>(dst + goff)[i] = v;
        }
    }
    return total;
}

// The 8 values of chunk i of a cast group at `group` (received memory: volatile loads).
__device__ __forceinline__ void logfmt_decode8(const char* group, int i, const LogfmtGroup& q, float* out) {
    const volatile uint16_t* in = reinterpret_cast<const volatile uint16_t*>(group + i * 10);
    const uint64_t lo = static_cast<uint64_t>(in[0]) | (static_cast<uint64_t>(in[1]) << 16) |
                        (static_cast<uint64_t>(in[2]) << 32) | (static_cast<uint64_t>(in[3]) << 48);
    const uint32_t hi = in[4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int bit = 10 * j;
        uint32_t code;
        if (bit >= 64)
            code = hi >> (bit - 64);
        else if (bit + 10 > 64)
            code = static_cast<uint32_t>(lo >> bit) | (hi << (64 - bit));
        else
            code = static_cast<uint32_t>(lo >> bit);
        out[j] = logfmt_value(code & 0x3ffu, q);
    }
}

}  // namespace ep
