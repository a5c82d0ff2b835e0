//! One QP's lane on the CUDA backend with the GPU agent ([`crate::agent`]): small device
//! operations become agent commands; large copies and copies to or from host memory go to the
//! copy engines on a pooled service stream, as without the agent.
//!
//! Order between the two paths (reliable-connection order within the QP), the simplest correct
//! scheme: after copy-engine work the stream stores a new value into the lane's word in the
//! agent's control block, and the lane's next agent command waits for that value
//! ([`FLAG_WAIT`](crate::agent_cmd::FLAG_WAIT)); before copy-engine work that follows agent
//! commands, the stream waits (`CU_STREAM_MEM_OP_WAIT_VALUE_32`, no SM) until the agent's done
//! counter covers the lane's last command. A mark is a pair (last agent command, copy-engine
//! value): landed when both are.
//!
//! The agent runs a lane's commands in order. Under strict mode's relaxed ordering
//! ([`Lane::set_relaxed`]) the lane holds its atomics back until the next barrier (a fenced
//! WQE), CQE, mark, fence or the end of the round, so that writes after an unfenced atomic
//! land before it, as hardware allows and as the copy-engine path does.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext};

use crate::agent::{Agent, AGENT_COPY_MAX};
use crate::agent_cmd::{reached, AgentCmd, FLAG_WAIT, PAYLOAD_BYTES};
use crate::backend::{AtomicOp, Lane, Loc, Mark};
use crate::cuda::Stream;
use crate::cuda_atomic::store_word;
use crate::error::EmuError;
use crate::exec::{fetch_reply, FetchOrder};
use crate::host::{host_atomic, store_cqe_host, HostBuffer};

fn check(call: &'static str, r: sys::CUresult) -> Result<(), EmuError> {
    r.result().map_err(EmuError::cuda(call))
}

/// A QP's lane through the agent (module docs).
#[derive(Debug)]
pub(crate) struct AgentLane {
    agent: Arc<Agent>,
    /// This lane's index: its commands' key and its copy-engine word.
    index: u32,
    stream: Stream,
    /// Pinned bytes the agent writes a synchronous atomic's old value into.
    scratch: HostBuffer,
    /// Number of this lane's last agent command (0: none).
    last_seq: u64,
    /// The value the lane's copy-engine word takes after its latest copy-engine work.
    ce_seq: u32,
    /// Copy-engine work since the last agent command that waited for it.
    ce_pending: bool,
    /// Agent commands since the last copy-engine work that waited for them.
    agent_pending: bool,
    /// Strict mode's relaxed ordering: atomics wait in `held` until a barrier.
    relaxed: bool,
    /// Atomic commands not yet published (relaxed ordering only).
    held: Vec<AgentCmd>,
    /// Marks handed out and not known to have landed: (mark, agent command, copy-engine value).
    marks: VecDeque<(u64, u64, u32)>,
    next_mark: u64,
    landed_upto: u64,
    timeout: Duration,
}

impl AgentLane {
    /// A lane of `agent`; `None` when every lane index is taken.
    pub fn new(
        agent: &Arc<Agent>,
        ctx: &Arc<CudaContext>,
        timeout: Duration,
    ) -> Result<Option<Self>, EmuError> {
        let Some(index) = agent.alloc_lane() else {
            return Ok(None);
        };
        let made = (|| Ok::<_, EmuError>((Stream::new(ctx)?, HostBuffer::pinned(ctx, 64)?)))();
        let (stream, scratch) = match made {
            Ok(x) => x,
            Err(e) => {
                agent.free_lane(index);
                return Err(e);
            }
        };
        Ok(Some(Self {
            agent: agent.clone(),
            index,
            stream,
            scratch,
            last_seq: 0,
            // The word keeps the last value a previous owner of the index stored.
            ce_seq: agent.ce_word(index),
            ce_pending: false,
            agent_pending: false,
            relaxed: false,
            held: Vec::new(),
            marks: VecDeque::new(),
            next_mark: 0,
            landed_upto: 0,
            timeout,
        }))
    }

    /// Publishes `cmd` for this lane, behind the lane's earlier copy-engine work.
    fn push(&mut self, mut cmd: AgentCmd, payload: &[u8]) -> Result<(), EmuError> {
        cmd.lane = self.index;
        if self.ce_pending {
            cmd.flags |= FLAG_WAIT;
            cmd.wait_value = self.ce_seq;
            self.ce_pending = false;
        }
        self.last_seq = self.agent.push(cmd, payload, self.timeout)?;
        self.agent_pending = true;
        Ok(())
    }

    /// Publishes the held atomics.
    fn release_held(&mut self) -> Result<(), EmuError> {
        for cmd in std::mem::take(&mut self.held) {
            self.push(cmd, &[])?;
        }
        Ok(())
    }

    /// Makes the stream wait until the lane's agent commands so far have landed.
    fn ce_after_agent(&mut self) -> Result<(), EmuError> {
        if !self.agent_pending {
            return Ok(());
        }
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st as WaitValue;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 as WaitV;
        let mut op = sys::CUstreamBatchMemOpParams {
            waitValue: WaitValue {
                operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32,
                address: self.agent.done_dev(),
                // The low 32 bits of the done counter; GEQ compares wrapping.
                __bindgen_anon_1: WaitV {
                    value: self.last_seq as u32,
                },
                flags: sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                alias: 0,
            },
        };
        // SAFETY: a wait on a word of the agent's pinned control block, which outlives every
        // lane (lanes hold the agent); the stream is live and its context current.
        check("cuStreamBatchMemOp (wait for the agent)", unsafe {
            sys::cuStreamBatchMemOp_v2(self.stream.raw, 1, &mut op, 0)
        })?;
        self.agent_pending = false;
        Ok(())
    }

    /// After copy-engine work: the stream stores the lane's next copy-engine value.
    fn ce_done(&mut self) -> Result<(), EmuError> {
        self.ce_seq = self.ce_seq.wrapping_add(1);
        // SAFETY: a 4-aligned word of the agent's pinned control block; the stream is live and
        // its context current. The store's memory barrier orders it after the copies.
        unsafe {
            store_word(
                self.stream.raw,
                self.agent.ce_word_dev(self.index),
                &self.ce_seq.to_ne_bytes(),
            )?
        };
        self.ce_pending = true;
        Ok(())
    }

    /// Waits until the lane's agent commands have landed.
    fn agent_fence(&self, timeout: Duration) -> Result<(), EmuError> {
        self.agent.wait_done(
            self.last_seq,
            timeout,
            "the GPU agent to execute a QP's commands",
        )
    }
}

impl Drop for AgentLane {
    fn drop(&mut self) {
        if self.stream.ctx.bind_to_thread().is_ok() {
            let _ = self.fence(Duration::from_secs(5));
        }
        self.agent.free_lane(self.index);
    }
}

impl Lane for AgentLane {
    unsafe fn copy(&mut self, dst: Loc, src: Loc, len: u64) -> Result<(), EmuError> {
        let n = len as usize;
        match (dst, src) {
            (Loc::Host(d), Loc::Host(s)) => {
                self.fence(self.timeout)?;
                // SAFETY: the caller guarantees both ranges; earlier work has landed.
                unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n) };
                Ok(())
            }
            (Loc::Device(d), Loc::Device(s)) if len <= AGENT_COPY_MAX => {
                if len > 0 {
                    self.push(AgentCmd::copy(0, d, s, len as u32), &[])?;
                }
                Ok(())
            }
            _ => {
                self.ce_after_agent()?;
                let raw = self.stream.raw;
                // SAFETY: the caller guarantees both ranges until the copy lands; unified
                // addressing routes device, peer and pinned host memory; pageable host memory
                // goes through the explicit calls, which stage it.
                let r = unsafe {
                    match (dst, src) {
                        (Loc::Device(d), Loc::Host(s)) => {
                            sys::cuMemcpyHtoDAsync_v2(d, s as *const std::ffi::c_void, n, raw)
                        }
                        (Loc::Host(d), Loc::Device(s)) => {
                            sys::cuMemcpyDtoHAsync_v2(d as *mut std::ffi::c_void, s, n, raw)
                        }
                        _ => sys::cuMemcpyAsync(dst.addr(), src.addr(), n, raw),
                    }
                };
                check("cuMemcpyAsync", r)?;
                self.ce_done()
            }
        }
    }

    unsafe fn put(&mut self, dst: Loc, bytes: &[u8]) -> Result<(), EmuError> {
        match dst {
            Loc::Host(d) => {
                self.fence(self.timeout)?;
                // SAFETY: the caller guarantees the range; earlier work has landed.
                unsafe { std::ptr::copy(bytes.as_ptr(), d as *mut u8, bytes.len()) };
                Ok(())
            }
            Loc::Device(d) => {
                for (k, chunk) in bytes.chunks(PAYLOAD_BYTES).enumerate() {
                    let at = d + (k * PAYLOAD_BYTES) as u64;
                    // The source is the slot's payload (`Agent::push` fills it in).
                    self.push(AgentCmd::copy(0, at, 0, chunk.len() as u32), chunk)?;
                }
                Ok(())
            }
        }
    }

    unsafe fn atomic(
        &mut self,
        target: Loc,
        op: AtomicOp,
        timeout: Duration,
    ) -> Result<u64, EmuError> {
        match target {
            Loc::Host(a) => {
                self.fence(timeout)?;
                // SAFETY: the caller guarantees an aligned, writable word; earlier work landed.
                Ok(unsafe { host_atomic(a, op) })
            }
            Loc::Device(a) => {
                self.release_held()?;
                let scratch = self
                    .scratch
                    .device_addr()
                    .ok_or_else(|| EmuError::BadConfig("unmapped scratch".into()))?;
                self.push(
                    AgentCmd::atomic(0, a, op, scratch, FetchOrder::HostOrder),
                    &[],
                )?;
                self.agent_fence(timeout)?;
                Ok(if op.width() == 8 {
                    self.scratch.load_u64(0)
                } else {
                    self.scratch.load_u32(0) as u64
                })
            }
        }
    }

    unsafe fn atomic_into(
        &mut self,
        target: Loc,
        op: AtomicOp,
        result: Loc,
        order: FetchOrder,
        timeout: Duration,
    ) -> Result<(), EmuError> {
        match (target, result) {
            (Loc::Device(a), Loc::Device(r)) => {
                self.push(AgentCmd::atomic(0, a, op, r, order), &[])
            }
            _ => {
                // SAFETY: forwarded from the caller.
                let old = unsafe { self.atomic(target, op, timeout)? };
                let reply = fetch_reply(&op, old, order);
                // SAFETY: forwarded from the caller.
                unsafe { self.put(result, &reply) }
            }
        }
    }

    unsafe fn put_cqe(&mut self, dst: Loc, cqe: &[u8; 64]) -> Result<(), EmuError> {
        match dst {
            Loc::Host(a) => {
                self.fence(self.timeout)?;
                // SAFETY: the caller guarantees an aligned slot; the data before it landed.
                unsafe { store_cqe_host(a, cqe) };
                Ok(())
            }
            Loc::Device(a) => {
                self.release_held()?;
                self.push(AgentCmd::cqe(0, a, 0), cqe)
            }
        }
    }

    fn cqe_in_order(&self, dst: Loc) -> bool {
        !dst.is_host()
    }

    fn mark(&mut self) -> Result<Mark, EmuError> {
        self.release_held()?;
        self.next_mark += 1;
        self.marks
            .push_back((self.next_mark, self.last_seq, self.ce_seq));
        Ok(Mark(self.next_mark))
    }

    fn landed(&mut self, mark: Mark) -> Result<bool, EmuError> {
        let done = self.agent.done();
        let ce = self.agent.ce_word(self.index);
        while let Some(&(m, seq, want)) = self.marks.front() {
            if m > mark.0 || done < seq || !reached(ce, want) {
                break;
            }
            self.landed_upto = m;
            self.marks.pop_front();
        }
        Ok(mark.0 <= self.landed_upto)
    }

    fn fence(&mut self, timeout: Duration) -> Result<(), EmuError> {
        self.release_held()?;
        self.agent_fence(timeout)?;
        self.stream
            .wait(timeout, "a QP's copy-engine stream to drain")?;
        if let Some(&(m, _, _)) = self.marks.back() {
            self.landed_upto = m;
        }
        self.marks.clear();
        Ok(())
    }

    fn flush(&mut self) -> Result<(), EmuError> {
        self.release_held()
    }

    fn barrier(&mut self) -> Result<(), EmuError> {
        self.release_held()
    }

    fn set_relaxed(&mut self, relaxed: bool) {
        self.relaxed = relaxed;
    }
}
