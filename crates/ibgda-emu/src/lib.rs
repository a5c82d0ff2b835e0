//! `ibgda-emu`: a software mlx5 NIC.
//!
//! Owns: reading send rings at the indices the doorbells announce, executing the WQEs against
//! registered memory with the checks a NIC makes, writing CQEs (collapsed or ring), fault
//! injection and bandwidth/latency shaping, and the "fabric" that wires several ranks' NICs.
//!
//! Must not know about: who wrote the WQEs (device code must not tell a real NIC from this one),
//! experts or tokens.
//!
//! # What it does
//!
//! Per QP and in order, the NIC's progress thread:
//! 1. learns the producer index from the QP's doorbell sources ([`DoorbellConfig`]): the doorbell
//!    record's send counter (`be32(pi & 0xffff)` at +4), the emulated UAR page's BlueFlame
//!    register (`{be32(pi << 8), be32(qpn << 8)}`), an optional 64-bit producer slot, and
//!    [`Nic::ring_doorbell`]. 16-bit counters are recovered against the NIC's own position
//!    ([`recover_pi`]); a value more than a ring ahead is stale and ignored, so a dropped or stale
//!    doorbell is made good by the next one;
//! 2. reads the WQEs from the ring (`slot = (index & (nwqebbs - 1)) * 64`) and decodes them with
//!    [`ibgda_device::wire::parse_wqe`];
//! 3. executes NOP, RDMA write (gather list or inline), write with immediate, 64-bit fetch-add and
//!    compare-swap, 32/64-bit masked fetch-add and 32-bit masked compare-swap, after checking every
//!    key, range and right against the registrations ([`Mr`]). Nothing outside a registration is
//!    ever touched;
//! 4. writes a CQE ([`ibgda_device::wire::Cqe64`]) for each WQE that asks (`fm_ce_se` CQ_UPDATE),
//!    and always for a failure, into a ring (owner bit `(i / n) & 1`) or a collapsed CQ
//!    ([`CqMode`]), only once the data it reports has landed.
//!
//! A failed WQE gets an error CQE (opcode 13) with the real syndrome at byte 55 —
//! `LOCAL_PROT_ERR` for a bad lkey, range or local right, `REMOTE_ACCESS_ERR` for a bad rkey,
//! range or remote right, `REMOTE_INVAL_REQ_ERR` for a misaligned atomic or an operation the
//! responder QP was not enabled for, `LOCAL_LENGTH_ERR` for a bad length, `LOCAL_QP_OP_ERR` for
//! a WQE that does not decode — and an emulator vendor syndrome at byte 54 ([`vendor_syndrome`])
//! saying which check failed. The QP moves to [`QpState::Error`]; every later WQE, already
//! posted or posted later, completes with `WR_FLUSH_ERR`. [`QpStatus::first_error`] keeps the
//! first error in words.
//!
//! Choices where hardware is unspecified or unknowable here: the control segment's QPN and WQE
//! index fields are checked only in [strict mode](#strict-mode) (the NIC uses its own counter
//! for `wqe_counter` either way); a WQE whose DS
//! reaches past the announced producer index fails with `LOCAL_QP_OP_ERR` (vendor
//! [`vendor_syndrome::PAST_PRODUCER`]) instead of executing what lies beyond; the responder side
//! of write-with-immediate (a receive WQE and a responder CQE at the peer) is not emulated; one
//! protection domain per NIC; no CQ overrun detection; RDMA read is not executed (it fails as an
//! unsupported opcode, like every opcode `parse_wqe` does not decode).
//!
//! Atomic operands are host order in the target word (little-endian, as GPU kernels read it);
//! the fetched old value is written to the local buffer per [`FetchOrder`] (by default as
//! ConnectX does with the kernel's host-endianness mode: standard 8-byte atomics in host order,
//! masked atomics big-endian).
//!
//! # Backends
//!
//! [`MemoryBackend`] / [`Lane`] separate the engine from memory. [`HostMemory`] (CI): everything
//! is host memory, every operation happens at once on the NIC's thread, atomics are CPU atomics.
//! [`CudaMemory`]: one non-blocking stream per QP keeps reliable-connection order; what a QP
//! asks for in one progress round is gathered and submitted once (device-to-device copies in one
//! `cuMemcpyBatchAsync`, aligned 4- and 8-byte words — inline data, atomic replies — and CQEs in
//! GPU memory as `cuStreamBatchMemOp` stores behind the data, owner word last); CQEs in host
//! memory are written by the NIC thread once an event recorded after the data has completed.
//! The per-operation cost model is in the `cuda` module's source docs.
//!
//! **The GPU agent** (on by default where it can start; [`AGENT_ENV`]`=0` turns it off): one
//! block (eight warps) per GPU and process, shared by every NIC there, executes the small
//! operations (device copies up to [`AGENT_COPY_MAX`], inline data, atomics, device CQEs) from
//! a command ring in pinned host memory, with GPU loads, stores and system-scope atomics; large
//! copies and host memory keep the copy-engine path, ordered with the agent per QP. It runs
//! while there are commands and ends after [`AGENT_IDLE_EXIT`] without any; the NIC thread
//! relaunches it with the next command. **What a user sees:** `cuMemFree`, `cuMemFreeHost`,
//! module loads and context synchronisations wait for every kernel of the context, so they wait
//! at most about [`AGENT_IDLE_EXIT`] behind the emulator (after its last command). Its SM is
//! one that `ep::residency` keeps free of waiting kernels, so it progresses (and relaunches)
//! when spinning kernels fill the rest of the GPU; atomics through it are GPU atomics, atomic
//! with respect to every other atomic on the word. Its creation checks that allocations, frees
//! and module loads return within the idle exit and a margin, and falls back if they do not.
//! Without the agent the emulator launches no kernel at all.
//!
//! Writes of one QP submitted together may land in any order among themselves, except that a
//! write that depends on another (overlapping destination, or a source another one writes)
//! goes in a later submission, and word stores (inline data) land after the copies of their
//! submission. The InfiniBand spec promises no more: RDMA-write data is guaranteed placed only
//! once a later atomic, send or completion of the QP is seen. With strict mode off or at
//! `checks` (below), every WQE's writes are a submission of their own and land in WQE order.
//!
//! **Atomicity on GPU memory.** With the GPU agent an atomic on GPU memory is a system-scope GPU
//! atomic: atomic with respect to every other atomic on the word, the emulator's from any NIC or
//! process and GPU kernels' alike. Without it (what follows), CUDA 13.0 having no atomic stream
//! memory operation, an atomic on GPU memory is read into pinned host memory on the QP's stream (after the QP's earlier
//! writes), computed by the NIC thread, and written back on the same stream, which waits on a
//! host-released counter in between; consecutive atomics of a QP share one read and one release
//! (`cuda_deferred` module). The word's stripe (one of 256, by address) orders it after the last
//! emulator write-back of the same word from any stream, on the GPU (`cuStreamWaitEvent`), so it
//! is atomic with respect to every other emulator atomic on the same word *in this process*,
//! atomics on other words run in parallel, and no thread waits. It is **not** atomic with
//! respect to GPU kernels that update the same word, nor to emulator atomics issued by another
//! process: give each such word a single remote writer process (counters indexed by source rank
//! do) or keep it in host memory, where atomics are CPU atomics and atomic against everything.
//!
//! # Strict mode
//!
//! [`StrictMode`] (on by default; `IBGDA_EMU_STRICT=0` turns it off, `IBGDA_EMU_SEED` picks the
//! seed) holds device code to what the hardware promises: each control segment's QPN and WQE
//! index are checked against the ring (`LOCAL_QP_OP_ERR`, vendor
//! [`vendor_syndrome::CTRL_QPN`] / [`vendor_syndrome::CTRL_INDEX`]); a WQE without a fence may
//! execute before an earlier atomic has been performed and its result written; the data of one
//! write lands in shuffled chunks spread over progress rounds, interleaved with other QPs'.
//! Decisions are seeded per QP, so a failure replays. See [`StrictMode`] for the table.
//!
//! # Wiring a QP (what device code and a proxy see)
//!
//! A QP is created with [`Nic::create_qp`] over a [`QpConfig`]: the send ring, the CQ, and the
//! doorbell sources, each a [`Loc`] (host-addressable or GPU memory). For the protocol's
//! "emulated NIC" mode, put the send ring and the doorbell record in pinned host memory
//! ([`HostBuffer::pinned`]: device code writes them through `device_addr()`, the NIC reads them
//! with no copy), the CQ in GPU memory (device code polls it locally), and either ring through
//! the emulated UAR page (`QpHandle::uar.bf_reg_device` is the descriptor's `db_reg`) in mode
//! `gpu`, or let the proxy write the doorbell record and store to `bf_reg` (or call
//! [`Nic::ring_doorbell`], or ring a [`DirectDoorbell`] handle: no lookup, no lock) in the CPU
//! modes. Rings in GPU memory work too; the NIC then reads them with copies (one per batch of
//! up to 256 WQEBBs), which costs a few microseconds each.
//! [`Nic::create_host_qp`] does all of this for host-driven QPs.
//!
//! Connecting mirrors a real NIC: create the QP, exchange [`QpInfo`] (node, QPN and — across
//! processes — CUDA IPC exports of GPU registrations), [`Nic::connect`]. Keys and addresses go in
//! the WQEs as with hardware.
//!
//! # The firmware path
//!
//! [`firmware::EmuSubnet`] opens emulated devices that implement `ibgda-verbs`' driver seam, so
//! the real verbs code (PD, MR, umem, UAR, `CREATE_CQ`, `CREATE_QP`, RST→INIT→RTR→RTS) runs on
//! the emulator unchanged. The firmware decodes each PRM command image by the `mlx5_ifc.h`
//! layout, refuses a bad field with the PRM status and its own syndrome, and builds the engine
//! QP from what the commands say: the send ring at the work queue umem's offset, the doorbell
//! record and CQ from their umems, the UAR page named in the QP context (shared by every QP
//! on it), the peer from the path's LID and remote QPN. The responder QP's `rre`/`rwe`/`rae`
//! are checked at every WQE before the registration's rights (`REMOTE_INVAL_REQ_ERR`, vendor
//! syndrome [`vendor_syndrome::REMOTE_QP_ACCESS`]).
//!
//! # Faults and shaping
//!
//! [`FaultPlan`]: an error CQE on the n-th WQE of a QP, completions delayed, the n-th doorbell
//! dropped, the n-th CQE lost, the NIC dead after n more WQEs (peer death:
//! [`FaultPlan::die_after_wqes`]), and a bandwidth cap with per-operation latency
//! ([`FaultPlan::nic_400g`]).

mod agent;
mod agent_cmd;
mod backend;
mod cq;
mod cuda;
mod cuda_agent;
mod cuda_atomic;
mod cuda_batch;
mod cuda_deferred;
mod doorbell;
mod error;
mod exec;
mod fabric;
mod fault;
pub mod firmware;
#[doc(hidden)]
pub mod fuzzing;
mod host;
mod ipc;
mod mr;
mod nic;
mod qp;
mod spin_wait;
mod strict;

pub use agent::{
    agent_built, agent_enabled_by_env, agent_launches, agent_refusal, AGENT_COPY_MAX, AGENT_ENV,
    AGENT_IDLE_EXIT, AGENT_SMS,
};
pub use backend::{AtomicOp, Lane, Loc, Mark, MemoryBackend};
pub use cq::{CqConfig, CqMode, CQE_BYTES};
pub use cuda::CudaMemory;
pub use cuda_batch::BATCH_COPIES_ENV;
pub use doorbell::{recover_pi, DoorbellConfig, UarInfo, UAR_PAGE_BYTES};
pub use error::{DriverError, EmuError};
pub use exec::{vendor_syndrome, FetchOrder, MAX_MESSAGE};
pub use fabric::{Fabric, NodeId, QpInfo};
pub use fault::{CqeLoss, DoorbellDrop, FaultPlan, WqeFault, INJECTED_SYNDROME};
pub use host::{HostBuffer, HostMemory};
pub use ipc::MrExport;
pub use mr::{Access, Mr, Place};
pub use nic::{DirectDoorbell, HostQp, Nic, NicConfig, ProgressMode};
pub use qp::{QpConfig, QpError, QpHandle, QpState, QpStatus, MAX_WQEBBS};
pub use strict::{Reorder, StrictMode, DEFAULT_SEED, SEED_ENV, STRICT_ENV};
