// The emulated NIC's GPU agent: one block per (process, GPU), launched when the CUDA backend
// starts and again whenever the host publishes a command while it is not running, that ends
// after `idle_exit_ns` with no command (or when the host sets the stop flag), and executes the small operations of
// every emulated NIC on that GPU (copies up to a few KiB, inline data, 4- and 8-byte atomics,
// CQEs) with device loads, stores and atomics. The host engine keeps every check and decision;
// this kernel only moves the bytes it is told to (agent_cmd.cuh describes the ring).
//
// Warp 0 reads the ring 32 slots at a time (one PCIe round trip for a batch). The commands of
// different QPs (lanes) in a batch run side by side, while the commands of one lane run in ring
// order: round r runs each lane's r-th command of the batch, atomics and CQEs one per thread of
// warp 0, copies one after another by the whole block (a copy is bound by the bytes in flight,
// so every warp of the block takes part). A round ends with a system fence and a block barrier,
// so a CQE, always a later command of its lane than the data it reports, lands after that data.
//
// Idle exit (the host's side is in crates/ibgda-emu/src/agent.rs): cuMemFree and module loads
// wait for every kernel of the context, so a kernel that never ends would hang them. Idle for
// idle_exit_ns, the agent writes STOPPING into the state word, fences, and reads the ring once
// more; a host that publishes a command, fences and then reads the state word either is seen
// here (the agent goes back to RUNNING) or sees STOPPING or EXITED and relaunches it once it
// is EXITED. So no published command is ever left without an agent to run it.
//
// The agent never waits for anything but its ring (and the stop flag while idle): ordering with
// the copy engines is the host's business (it holds a lane's commands back until the lane's
// copy-engine work has landed, and copy-engine work waits on the lane's done word, which the
// agent stores after each command), so no cycle can run through the agent.

#include <stdint.h>

#include "agent_cmd.cuh"

namespace {

constexpr unsigned FULL = 0xffffffffu;

// Longest idle back-off between polls of the ring: short enough for the 5 µs latency target.
constexpr unsigned IDLE_SLEEP_MAX_NS = 256;

// Idle polls between two reads of the stop flag and the clock (about 16 us at the longest
// back-off: the idle exit is that much late at most).
constexpr unsigned STOP_CHECK_EVERY = 64;

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint64_t state_word(uint32_t generation, uint32_t phase) {
    return (static_cast<uint64_t>(generation) << 32) | phase;
}

__device__ __forceinline__ uint64_t ld_acquire_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_u32(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Volatile loads: never from a stale cached line.
__device__ __forceinline__ uint64_t ld_u64(const void* p) {
    return *reinterpret_cast<const volatile uint64_t*>(p);
}

__device__ __forceinline__ uint32_t ld_u32(const void* p) {
    return *reinterpret_cast<const volatile uint32_t*>(p);
}

__device__ __forceinline__ uint8_t ld_u8(const void* p) {
    return *reinterpret_cast<const volatile uint8_t*>(p);
}

// 16-byte loads in flight per thread in a copy: a copy's rate is bound by the bytes in flight
// (latency, not bandwidth); with the host's 8 warps, 8 x 16 B x 256 threads = 32 KiB, more than
// a 14 KiB low-latency token in one round trip.
constexpr int COPY_UNROLL = 8;

// The block copies n bytes src -> dst (thread `tid` of `nthreads`), the widest accesses the
// alignment allows. Loads use ld.global.cv (fetch again, never trust a cached line): sources are
// rewritten by other SMs, other GPUs and the host between two commands.
__device__ void block_copy(uint64_t dst, uint64_t src, uint32_t n, unsigned tid, unsigned nthreads) {
    const uint64_t all = dst | src | n;
    if ((all & 15) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint32_t words = n / 16;
        for (uint32_t base = 0; base < words; base += nthreads * COPY_UNROLL) {
            uint4 v[COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < COPY_UNROLL; ++u) {
                const uint32_t i = base + u * nthreads + tid;
                if (i < words) v[u] = __ldcv(s + i);
            }
#pragma unroll
            for (int u = 0; u < COPY_UNROLL; ++u) {
                const uint32_t i = base + u * nthreads + tid;
                if (i < words) d[i] = v[u];
            }
        }
    } else if ((all & 7) == 0) {
        const unsigned long long* s = reinterpret_cast<const unsigned long long*>(src);
        for (uint32_t i = tid; i < n / 8; i += nthreads) {
            reinterpret_cast<unsigned long long*>(dst)[i] = __ldcv(s + i);
        }
    } else if ((all & 3) == 0) {
        const unsigned* s = reinterpret_cast<const unsigned*>(src);
        for (uint32_t i = tid; i < n / 4; i += nthreads) reinterpret_cast<unsigned*>(dst)[i] = __ldcv(s + i);
    } else {
        for (uint32_t i = tid; i < n; i += nthreads) {
            reinterpret_cast<uint8_t*>(dst)[i] = ld_u8(reinterpret_cast<const uint8_t*>(src) + i);
        }
    }
}

// a + b over `bits` bits, the carry out of every bit set in `boundary` dropped.
__device__ uint64_t field_add(uint64_t a, uint64_t b, uint64_t boundary, int bits) {
    uint64_t out = 0, carry = 0;
    for (int i = 0; i < bits; ++i) {
        const uint64_t x = (a >> i) & 1, y = (b >> i) & 1;
        out |= (x ^ y ^ carry) << i;
        carry = (x & y) | (x & carry) | (y & carry);
        if ((boundary >> i) & 1) carry = 0;
    }
    return out;
}

__device__ uint64_t bswap64(uint64_t v) {
    const uint32_t lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
    return (static_cast<uint64_t>(__byte_perm(lo, 0, 0x0123)) << 32) | __byte_perm(hi, 0, 0x0123);
}

// Performs one atomic command and returns the old value (32-bit ones in the low half).
__device__ uint64_t do_atomic(const emu_agent_cmd& c) {
    if (c.op == EMU_AGENT_OP_FA64) {
        return atomicAdd_system(reinterpret_cast<unsigned long long*>(c.dst), c.a);
    }
    if (c.op == EMU_AGENT_OP_CS64) {
        return atomicCAS_system(reinterpret_cast<unsigned long long*>(c.dst), c.b, c.a);
    }
    if (c.op == EMU_AGENT_OP_MFA64) {
        unsigned long long* p = reinterpret_cast<unsigned long long*>(c.dst);
        unsigned long long old = ld_u64(p);
        for (;;) {
            const unsigned long long nv = field_add(old, c.a, c.b, 64);
            const unsigned long long seen = atomicCAS_system(p, old, nv);
            if (seen == old) return old;
            old = seen;
        }
    }
    unsigned* p = reinterpret_cast<unsigned*>(c.dst);
    unsigned old = ld_u32(p);
    for (;;) {
        unsigned nv;
        if (c.op == EMU_AGENT_OP_MFA32) {
            nv = static_cast<unsigned>(field_add(old, c.a & 0xffffffffu, c.b & 0xffffffffu, 32));
        } else {
            const unsigned swap = static_cast<unsigned>(c.a), cmp = static_cast<unsigned>(c.b);
            const unsigned swap_mask = static_cast<unsigned>(c.c);
            const unsigned cmp_mask = static_cast<unsigned>(c.c >> 32);
            if (((old ^ cmp) & cmp_mask) != 0) return old;
            nv = (old & ~swap_mask) | (swap & swap_mask);
            if (nv == old) return old;
        }
        const unsigned seen = atomicCAS_system(p, old, nv);
        if (seen == old) return old;
        old = seen;
    }
}

__device__ void write_reply(const emu_agent_cmd& c, uint64_t old) {
    if (c.src == 0) return;
    const bool be = (c.flags & EMU_AGENT_FLAG_REPLY_BE) != 0;
    if (c.len == 4) {
        uint32_t v = static_cast<uint32_t>(old);
        if (be) v = __byte_perm(v, 0, 0x0123);
        if ((c.src & 3) == 0) {
            *reinterpret_cast<volatile uint32_t*>(c.src) = v;
        } else {
            for (int i = 0; i < 4; ++i) reinterpret_cast<volatile uint8_t*>(c.src)[i] = v >> (8 * i);
        }
    } else {
        uint64_t v = be ? bswap64(old) : old;
        if ((c.src & 7) == 0) {
            *reinterpret_cast<volatile uint64_t*>(c.src) = v;
        } else {
            for (int i = 0; i < 8; ++i) reinterpret_cast<volatile uint8_t*>(c.src)[i] = v >> (8 * i);
        }
    }
}

// A command one thread executes alone (everything but COPY).
__device__ void do_scalar(const emu_agent_cmd& c) {
    if (c.op == EMU_AGENT_OP_CQE) {
        volatile uint64_t* d = reinterpret_cast<volatile uint64_t*>(c.dst);
        uint64_t w[8];
        // All eight loads in flight at once (the payload is in host memory).
        for (int i = 0; i < 8; ++i) w[i] = ld_u64(reinterpret_cast<const uint64_t*>(c.src) + i);
        for (int i = 0; i < 7; ++i) d[i] = w[i];
        // The owner byte (in the last word) is what a poller waits for: it lands last.
        __threadfence_system();
        d[7] = w[7];
        return;
    }
    write_reply(c, do_atomic(c));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(EMU_AGENT_MAX_THREADS, 1) emu_agent(emu_agent_params p) {
    const unsigned tid = threadIdx.x;
    const unsigned lane = tid % 32;
    const bool scheduler = tid < 32;  // warp 0
    const unsigned nthreads = blockDim.x;
    uint32_t* stop = reinterpret_cast<uint32_t*>(p.ctrl + EMU_AGENT_CTRL_STOP);
    uint64_t* done = reinterpret_cast<uint64_t*>(p.ctrl + EMU_AGENT_CTRL_DONE);
    uint64_t* state = reinterpret_cast<uint64_t*>(p.ctrl + EMU_AGENT_CTRL_STATE);
    uint32_t* lane_done = reinterpret_cast<uint32_t*>(p.ctrl + EMU_AGENT_CTRL_LANE_DONE);
    const uint64_t mask = p.nslots - 1;

    // The batch as the whole block needs it (copies); warp 0 keeps the rest in registers.
    __shared__ uint64_t sh_dst[32], sh_src[32];
    __shared__ uint32_t sh_len[32];
    __shared__ uint8_t sh_rank[32], sh_copy[32];
    __shared__ unsigned sh_count, sh_rounds;
    __shared__ int sh_stop;

    if (tid == 0) {
        st_release_u64(state, state_word(p.generation, EMU_AGENT_PHASE_RUNNING));
        // The ring is read only after RUNNING is visible to the host (the host publishes, fences,
        // then reads the state word: one of the two sees the other).
        __threadfence_system();
    }
    uint64_t next = ld_acquire_u64(done) + 1;
    for (;;) {
        emu_agent_cmd c{};
        bool mine = false, last_of_group = false;
        unsigned rank = 0;
        if (scheduler) {
            // Idle: one thread polls the next slot.
            const emu_agent_cmd* next_slot = reinterpret_cast<const emu_agent_cmd*>(
                p.ring + ((next - 1) & mask) * EMU_AGENT_SLOT_BYTES);
            unsigned idle = 0, sleep_ns = 32;
            int stopping = 0;
            uint64_t idle_since = 0;
            for (;;) {
                int ready = 0;
                if (lane == 0) ready = ld_acquire_u64(&next_slot->seq) == next;
                if (__shfl_sync(FULL, ready, 0)) break;
                if (++idle % STOP_CHECK_EVERY == 0) {
                    // 0: go on idling, 1: end, 2: a command came in while ending.
                    int verdict = 0;
                    if (lane == 0) {
                        const uint64_t now = globaltimer_ns();
                        if (idle_since == 0) idle_since = now;
                        if (ld_acquire_u32(stop)) {
                            verdict = 1;
                        } else if (now - idle_since >= p.idle_exit_ns) {
                            st_release_u64(state, state_word(p.generation, EMU_AGENT_PHASE_STOPPING));
                            __threadfence_system();
                            if (ld_acquire_u64(&next_slot->seq) == next) {
                                st_release_u64(state, state_word(p.generation, EMU_AGENT_PHASE_RUNNING));
                                __threadfence_system();
                                verdict = 2;
                            } else {
                                verdict = 1;
                            }
                        }
                    }
                    verdict = __shfl_sync(FULL, verdict, 0);
                    if (verdict == 2) break;
                    if (verdict == 1) {
                        stopping = 1;
                        break;
                    }
                }
                __nanosleep(sleep_ns);
                sleep_ns = min(sleep_ns * 2, IDLE_SLEEP_MAX_NS);
            }
            unsigned count = 0, rounds = 0;
            if (!stopping) {
                // A batch: the run of published slots from `next`, up to one per thread.
                const uint64_t want = next + lane;
                const emu_agent_cmd* slot = reinterpret_cast<const emu_agent_cmd*>(
                    p.ring + ((want - 1) & mask) * EMU_AGENT_SLOT_BYTES);
                const bool published = lane < p.nslots && ld_acquire_u64(&slot->seq) == want;
                const unsigned ballot = __ballot_sync(FULL, published);
                count = ballot == FULL ? 32 : __ffs(~ballot) - 1;
                mine = lane < count;
                if (mine) {
                    const volatile emu_agent_cmd* v = slot;
                    c.op = v->op;
                    c.flags = v->flags;
                    c.len = v->len;
                    c.dst = v->dst;
                    c.src = v->src;
                    c.a = v->a;
                    c.b = v->b;
                    c.c = v->c;
                    c.lane = v->lane;
                    c.lane_seq = v->lane_seq;
                }
                // Round r runs every lane's r-th group of commands of the batch: a command joins
                // the group of the lane's previous one when the host said it may (FLAG_JOIN:
                // copies with no order between them).
                const uint32_t key = mine ? c.lane : 0x80000000u + lane;
                const unsigned same = __match_any_sync(FULL, key);
                const unsigned starts =
                    __ballot_sync(FULL, !mine || (c.flags & EMU_AGENT_FLAG_JOIN) == 0);
                const unsigned upto = lane == 31 ? FULL : (2u << lane) - 1;
                const unsigned first = __ffs(same) - 1;
                // A batch that begins with a joining command: its group began in an earlier
                // batch (already landed), so the count of group starts is one short.
                rank = __popc(same & starts & upto) - 1 + ((starts >> first) & 1 ? 0 : 1);
                rounds = __reduce_max_sync(FULL, mine ? rank + 1 : 0);
                // The lane's done word is stored by the group's last command only (the stores of
                // one round would race).
                const unsigned long long group = (static_cast<unsigned long long>(key) << 8) | rank;
                const unsigned same_group = __match_any_sync(FULL, group);
                last_of_group = (same_group >> lane) == 1;
                sh_dst[lane] = c.dst;
                sh_src[lane] = c.src;
                sh_len[lane] = c.len;
                sh_rank[lane] = static_cast<uint8_t>(rank);
                sh_copy[lane] = mine && c.op == EMU_AGENT_OP_COPY;
            }
            if (lane == 0) {
                sh_stop = stopping;
                sh_count = count;
                sh_rounds = rounds;
            }
        }
        __syncthreads();
        if (sh_stop) break;
        const unsigned count = sh_count, rounds = sh_rounds;
        for (unsigned r = 0; r < rounds; ++r) {
            const bool act = scheduler && mine && rank == r;
            if (act && c.op != EMU_AGENT_OP_COPY) do_scalar(c);
            for (unsigned j = 0; j < count; ++j) {
                if (sh_copy[j] && sh_rank[j] == r) block_copy(sh_dst[j], sh_src[j], sh_len[j], tid, nthreads);
            }
            // Every thread's writes of the round are visible before any lane's done word moves
            // and before the next round (a CQE) writes.
            __threadfence_system();
            __syncthreads();
            if (act && last_of_group) st_release_u32(&lane_done[c.lane], c.lane_seq);
        }
        next += count;
        if (tid == 0 && count > 0) st_release_u64(done, next - 1);
        // The next batch's shared words are written only after every thread has left this one's
        // last round (its barrier above), and read only after the barrier at the top.
    }
    if (tid == 0) {
        // Everything this launch ran is visible before the host may relaunch.
        __threadfence_system();
        st_release_u64(state, state_word(p.generation, EMU_AGENT_PHASE_EXITED));
    }
}
