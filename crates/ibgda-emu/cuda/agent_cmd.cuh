// The command ring shared by the emulated NIC's host engine and its GPU agent
// (crates/ibgda-emu/src/agent_cmd.rs holds the same layout; both sides assert it).
//
// The ring lives in pinned host memory mapped into the GPU. Slot i (i = (seq - 1) & (nslots - 1))
// is EMU_AGENT_SLOT_BYTES long: a 64-byte command, then up to EMU_AGENT_PAYLOAD_BYTES of payload
// (inline data, a CQE) that a command's `src` may point at. The host writes every field and the
// payload first and `seq` last (release); the agent executes slot i once `seq` equals the number
// it expects, and publishes in the control block how far it has executed.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define EMU_AGENT_SLOT_BYTES 256
#define EMU_AGENT_PAYLOAD_BYTES 192

// Opcodes.
#define EMU_AGENT_OP_COPY 1        // len bytes src -> dst (device-addressable both)
#define EMU_AGENT_OP_FA64 2        // 64-bit fetch-add of a
#define EMU_AGENT_OP_CS64 3        // 64-bit compare (b) and swap (a)
#define EMU_AGENT_OP_MFA32 4       // 32-bit fetch-add of a, carries stop at bits of b
#define EMU_AGENT_OP_MCS32 5       // 32-bit masked compare-swap: swap a, compare b, masks in c
#define EMU_AGENT_OP_MFA64 6       // 64-bit fetch-add of a, carries stop at bits of b
#define EMU_AGENT_OP_CQE 7         // 64-byte CQE from src to dst, last 8 bytes last

// Flags.
#define EMU_AGENT_FLAG_REPLY_BE 2  // write the fetched value big-endian
#define EMU_AGENT_FLAG_JOIN 4      // COPY: may run with the lane's previous command (no order between)

struct emu_agent_cmd {
    uint64_t seq;         // published last; 0 = empty
    uint8_t op;
    uint8_t flags;
    uint16_t reserved;
    uint32_t len;         // COPY: bytes; atomics: width (4 or 8)
    uint64_t dst;         // destination, or the atomic's target word
    uint64_t src;         // COPY/CQE: source; atomics: where the old value goes (0: nowhere)
    uint64_t a;           // add / swap
    uint64_t b;           // compare / field boundary
    uint64_t c;           // MCS32: swap_mask | compare_mask << 32
    uint32_t lane;        // the QP's lane: commands of one lane execute in ring order
    uint32_t lane_seq;    // the command's number in its lane: stored in the lane's done word
};

// The control block (pinned host memory, mapped), one cache line per writer.
#define EMU_AGENT_CTRL_STOP 0        // u32, host: 1 = exit
#define EMU_AGENT_CTRL_DONE 64       // u64, agent: every command with seq <= done has landed
#define EMU_AGENT_CTRL_STATE 128     // u64, agent: generation << 32 | phase (below)
#define EMU_AGENT_PHASE_RUNNING 1    // reading the ring
#define EMU_AGENT_PHASE_EXITED 2     // ended (idle, or told to stop): the host relaunches it
#define EMU_AGENT_PHASE_STOPPING 3   // idle for long enough, re-reading the ring once before it ends
#define EMU_AGENT_MAX_LANES 4096
#define EMU_AGENT_CTRL_LANE_DONE 192  // u32 per lane, agent: lane_seq of its last landed command
#define EMU_AGENT_CTRL_CE_WORDS (EMU_AGENT_CTRL_LANE_DONE + 4 * EMU_AGENT_MAX_LANES)  // u32 per lane, the lane's stream
#define EMU_AGENT_CTRL_BYTES (EMU_AGENT_CTRL_CE_WORDS + 4 * EMU_AGENT_MAX_LANES)

// Threads of the agent's block at most (the host launches EMU_AGENT_MAX_THREADS, a multiple of
// 32; warp 0 schedules).
#define EMU_AGENT_MAX_THREADS 256

struct emu_agent_params {
    uint64_t ring;          // device address of slot 0
    uint64_t ctrl;          // device address of the control block
    uint32_t nslots;        // a power of two
    uint32_t generation;    // this launch's number (1, 2, ...): written into the state word
    uint64_t idle_exit_ns;  // the kernel ends after this long (globaltimer) with no command
};

static_assert(sizeof(emu_agent_cmd) == 64, "size of emu_agent_cmd");
static_assert(offsetof(emu_agent_cmd, op) == 8, "offset of op");
static_assert(offsetof(emu_agent_cmd, flags) == 9, "offset of flags");
static_assert(offsetof(emu_agent_cmd, len) == 12, "offset of len");
static_assert(offsetof(emu_agent_cmd, dst) == 16, "offset of dst");
static_assert(offsetof(emu_agent_cmd, src) == 24, "offset of src");
static_assert(offsetof(emu_agent_cmd, a) == 32, "offset of a");
static_assert(offsetof(emu_agent_cmd, b) == 40, "offset of b");
static_assert(offsetof(emu_agent_cmd, c) == 48, "offset of c");
static_assert(offsetof(emu_agent_cmd, lane) == 56, "offset of lane");
static_assert(offsetof(emu_agent_cmd, lane_seq) == 60, "offset of lane_seq");
static_assert(sizeof(emu_agent_params) == 32, "size of emu_agent_params");
static_assert(offsetof(emu_agent_params, generation) == 20, "offset of generation");
static_assert(offsetof(emu_agent_params, idle_exit_ns) == 24, "offset of idle_exit_ns");
static_assert(EMU_AGENT_SLOT_BYTES == 64 + EMU_AGENT_PAYLOAD_BYTES, "slot = command + payload");
