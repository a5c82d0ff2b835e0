//! One QP's lane on the CUDA backend with the GPU agent ([`crate::agent`]): small device
//! operations become agent commands; large copies and copies to or from host memory go to the
//! copy engines on a pooled service stream, as without the agent.
//!
//! Order between the two paths (reliable-connection order within the QP) without the agent ever
//! waiting, so that no cycle can run through it (the agent serves every QP on the GPU, and
//! pooled streams are shared between lanes):
//! - every command carries its number in the lane (`lane_seq`), which the agent stores in the
//!   lane's done word once the command has landed; copy-engine work that follows commands first
//!   makes the stream wait (`CU_STREAM_MEM_OP_WAIT_VALUE_32`, no SM) until that word covers the
//!   lane's last command;
//! - after copy-engine work the stream stores a new value into the lane's copy-engine word;
//!   commands that follow are held on the host until the word has it, and published by
//!   [`Lane::poll`] (the lane says it is [`busy`](Lane::busy) meanwhile);
//! - copy-engine work after held commands first waits on the host (bounded) until they are
//!   published, so a stream only ever waits on commands in the ring, which an agent is sure to
//!   run ([`crate::agent`], idle exit): never on this thread, which may be stuck in a driver
//!   call behind a `cuMemFree` that waits for the stream.
//!
//! A mark is a pair (last command number, copy-engine value), landed when both words have them.
//!
//! The agent runs a lane's commands in order. Under strict mode's relaxed ordering
//! ([`Lane::set_relaxed`]) the lane keeps its atomics back until the next barrier (a fenced
//! WQE), CQE, mark, fence or the end of the round, so that writes after an unfenced atomic land
//! before it, as hardware allows and as the copy-engine path does.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext};

use crate::agent::{Agent, AGENT_COPY_MAX};
use crate::agent_cmd::{reached, AgentCmd, FLAG_JOIN, PAYLOAD_BYTES};
use crate::backend::{atomic_then_put, AtomicOp, Lane, Loc, Mark};
use crate::cuda::Stream;
use crate::cuda_atomic::store_word;
use crate::error::{check, EmuError};
use crate::exec::FetchOrder;
use crate::host::{host_atomic, store_cqe_host, HostBuffer};
use crate::spin_wait::SpinWait;

/// A command held until the lane's copy-engine word reaches `ce`.
#[derive(Debug, PartialEq, Eq)]
struct Held {
    cmd: AgentCmd,
    payload: Vec<u8>,
    ce: u32,
}

/// Copies most in one group (the agent reads 32 commands at a time).
const MAX_JOIN: usize = 32;

/// The lane's copies since its last order point (the engine's [`Lane::order_point`], a barrier,
/// the end of a round, or any command that is not a copy): they may land in any order among
/// themselves, as long as none depends on another (overlapping destinations, or a source
/// another one writes), so the agent may run them in one round.
#[derive(Debug, Default)]
struct JoinGroup {
    open: bool,
    written: Vec<(u64, u64)>,
    read: Vec<(u64, u64)>,
}

fn overlaps(set: &[(u64, u64)], at: u64, len: u64) -> bool {
    let end = at.saturating_add(len);
    set.iter().any(|&(a, e)| a < end && at < e)
}

impl JoinGroup {
    /// Whether a copy `src -> dst` of `len` bytes may join the open group (`src` 0: a payload in
    /// the ring, which no copy writes); either way it is in the group afterwards.
    fn join(&mut self, dst: u64, src: u64, len: u64) -> bool {
        let joins = self.open
            && self.written.len() < MAX_JOIN
            && !overlaps(&self.written, dst, len)
            && !overlaps(&self.read, dst, len)
            && (src == 0 || !overlaps(&self.written, src, len));
        if !joins {
            self.close();
        }
        self.open = true;
        self.written.push((dst, dst.saturating_add(len)));
        if src != 0 {
            self.read.push((src, src.saturating_add(len)));
        }
        joins
    }

    fn close(&mut self) {
        self.open = false;
        self.written.clear();
        self.read.clear();
    }
}

/// What the lane knows about its order between the agent and the copy engines, apart from the
/// hardware (module docs): the words it is given are the agent's and the stream's as read now.
#[derive(Debug, Default)]
struct LaneOrder {
    /// The number of the lane's last command (published or held).
    issued: u32,
    /// The value the lane's copy-engine word takes after its latest copy-engine work.
    ce_seq: u32,
    /// Commands behind copy-engine work that has not landed, in order.
    held: VecDeque<Held>,
    /// Marks handed out and not known to have landed: (mark, command number, copy-engine value).
    marks: VecDeque<(u64, u32, u32)>,
    next_mark: u64,
    landed_upto: u64,
}

impl LaneOrder {
    /// Starting from the words a previous owner of the lane index left.
    fn new(lane_done: u32, ce_word: u32) -> Self {
        Self {
            issued: lane_done,
            ce_seq: ce_word,
            ..Self::default()
        }
    }

    /// Numbers `cmd`; returns it when it may be published now (`ce_word`: the lane's copy-engine
    /// word), else holds it.
    fn submit(&mut self, mut cmd: AgentCmd, payload: &[u8], ce_word: u32) -> Option<AgentCmd> {
        self.issued = self.issued.wrapping_add(1);
        cmd.lane_seq = self.issued;
        if self.held.is_empty() && reached(ce_word, self.ce_seq) {
            Some(cmd)
        } else {
            self.held.push_back(Held {
                cmd,
                payload: payload.to_vec(),
                ce: self.ce_seq,
            });
            None
        }
    }

    /// The held commands that may be published now, in order.
    fn ready(&mut self, ce_word: u32) -> Vec<Held> {
        let mut out = Vec::new();
        while self.held.front().is_some_and(|h| reached(ce_word, h.ce)) {
            out.extend(self.held.pop_front());
        }
        out
    }

    /// Before copy-engine work: the value the lane's done word must reach first, if it has not
    /// (`lane_done`: the word now).
    fn ce_must_wait_for(&self, lane_done: u32) -> Option<u32> {
        (!self.held.is_empty() || !reached(lane_done, self.issued)).then_some(self.issued)
    }

    /// After copy-engine work: the value the stream stores into the copy-engine word.
    fn ce_enqueued(&mut self) -> u32 {
        self.ce_seq = self.ce_seq.wrapping_add(1);
        self.ce_seq
    }

    /// Whether every command submitted so far has landed.
    fn commands_landed(&self, lane_done: u32) -> bool {
        self.held.is_empty() && reached(lane_done, self.issued)
    }

    fn mark(&mut self) -> Mark {
        self.next_mark += 1;
        self.marks
            .push_back((self.next_mark, self.issued, self.ce_seq));
        Mark(self.next_mark)
    }

    fn landed(&mut self, mark: Mark, lane_done: u32, ce_word: u32) -> bool {
        while let Some(&(m, seq, want)) = self.marks.front() {
            if m > mark.0 || !reached(lane_done, seq) || !reached(ce_word, want) {
                break;
            }
            self.landed_upto = m;
            self.marks.pop_front();
        }
        mark.0 <= self.landed_upto
    }

    /// Everything has landed (after a fence).
    fn all_landed(&mut self) {
        if let Some(&(m, _, _)) = self.marks.back() {
            self.landed_upto = m;
        }
        self.marks.clear();
    }
}

/// A QP's lane through the agent (module docs).
#[derive(Debug)]
pub(crate) struct AgentLane {
    agent: Arc<Agent>,
    /// This lane's index: its commands' key, its done word and its copy-engine word.
    index: u32,
    stream: Stream,
    /// Pinned bytes the agent writes a synchronous atomic's old value into.
    scratch: HostBuffer,
    order: LaneOrder,
    group: JoinGroup,
    /// Strict mode's relaxed ordering: atomics wait in `relaxed_atomics` until a barrier.
    relaxed: bool,
    relaxed_atomics: Vec<AgentCmd>,
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
            // The words keep the last values a previous owner of the index left; go on from
            // there (its work has landed: lanes fence when dropped).
            order: LaneOrder::new(agent.lane_done(index), agent.ce_word(index)),
            group: JoinGroup::default(),
            relaxed: false,
            relaxed_atomics: Vec::new(),
            timeout,
        }))
    }

    /// Numbers `cmd` and publishes it, or holds it while earlier copy-engine work (or an earlier
    /// held command) has not landed.
    fn submit(&mut self, mut cmd: AgentCmd, payload: &[u8]) -> Result<(), EmuError> {
        cmd.lane = self.index;
        if let Some(cmd) = self
            .order
            .submit(cmd, payload, self.agent.ce_word(self.index))
        {
            self.agent.push(cmd, payload, self.timeout)?;
        }
        Ok(())
    }

    /// Submits a copy, joining the lane's open group of copies when it may.
    fn submit_copy(
        &mut self,
        dst: u64,
        src: u64,
        len: u32,
        payload: &[u8],
    ) -> Result<(), EmuError> {
        let mut cmd = AgentCmd::copy(0, dst, src, len);
        if self.group.join(dst, src, u64::from(len)) {
            cmd.flags |= FLAG_JOIN;
        }
        self.submit(cmd, payload)
    }

    /// Submits a command that is not a copy: it closes the group of copies before it.
    fn submit_other(&mut self, cmd: AgentCmd, payload: &[u8]) -> Result<(), EmuError> {
        self.group.close();
        self.submit(cmd, payload)
    }

    /// Publishes the held commands whose copy-engine work has landed. Returns whether some are
    /// still held.
    fn publish_ready(&mut self) -> Result<bool, EmuError> {
        if self.order.held.is_empty() {
            return Ok(false);
        }
        for h in self.order.ready(self.agent.ce_word(self.index)) {
            self.agent.push(h.cmd, &h.payload, self.timeout)?;
        }
        Ok(!self.order.held.is_empty())
    }

    /// Submits the atomics strict mode's relaxed ordering kept back.
    fn release_relaxed(&mut self) -> Result<(), EmuError> {
        for cmd in std::mem::take(&mut self.relaxed_atomics) {
            self.submit_other(cmd, &[])?;
        }
        Ok(())
    }

    /// Waits, at most `timeout`, until every command the lane submitted has landed (publishing
    /// held ones as the copy engines catch up).
    fn commands_landed(&mut self, timeout: Duration) -> Result<(), EmuError> {
        let mut wait = SpinWait::new(timeout, 4000, "the GPU agent to execute a QP's commands");
        loop {
            self.publish_ready()?;
            if self.order.commands_landed(self.agent.lane_done(self.index)) {
                return Ok(());
            }
            wait.pause()?;
        }
    }

    /// Before copy-engine work: the stream waits until the lane's commands so far have landed.
    ///
    /// Held commands are published first (a bounded host wait for the lane's earlier
    /// copy-engine work, which needs nothing from the host): the stream then waits only on
    /// commands in the ring, which an agent is sure to run. A wait on a held command would need
    /// this thread to publish it, and a `cuMemFree` elsewhere, waiting for the stream while it
    /// holds the driver lock, would block this thread's next driver call: a deadlock.
    fn ce_after_commands(&mut self) -> Result<(), EmuError> {
        let mut wait = SpinWait::new(
            self.timeout,
            4000,
            "a QP's copy-engine work, to publish the commands behind it",
        );
        while self.publish_ready()? {
            wait.pause()?;
        }
        let Some(want) = self
            .order
            .ce_must_wait_for(self.agent.lane_done(self.index))
        else {
            return Ok(());
        };
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st as WaitValue;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 as WaitV;
        let mut op = sys::CUstreamBatchMemOpParams {
            waitValue: WaitValue {
                operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32,
                address: self.agent.lane_done_dev(self.index),
                // GEQ compares wrapping.
                __bindgen_anon_1: WaitV { value: want },
                flags: sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                alias: 0,
            },
        };
        // SAFETY: a wait on a word of the agent's pinned control block, which outlives every
        // lane (lanes hold the agent); the stream is live and its context current.
        check("cuStreamBatchMemOp (wait for the agent)", unsafe {
            sys::cuStreamBatchMemOp_v2(self.stream.raw, 1, &mut op, 0)
        })
    }

    /// After copy-engine work: the stream stores the lane's next copy-engine value.
    fn ce_done(&mut self) -> Result<(), EmuError> {
        let value = self.order.ce_enqueued();
        // SAFETY: a 4-aligned word of the agent's pinned control block; the stream is live and
        // its context current. The store's memory barrier orders it after the copies.
        unsafe {
            store_word(
                self.stream.raw,
                self.agent.ce_word_dev(self.index),
                &value.to_ne_bytes(),
            )
        }
    }
}

impl Drop for AgentLane {
    fn drop(&mut self) {
        let drained = self.stream.ctx.bind_to_thread().is_ok()
            && match self.fence(Duration::from_secs(5)) {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!("a QP's agent lane did not drain at teardown: {e}");
                    false
                }
            };
        // An index whose commands may still land is never handed out again: its words would
        // move under the next owner.
        if drained {
            self.agent.free_lane(self.index);
        }
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
                    self.submit_copy(d, s, len as u32, &[])?;
                }
                Ok(())
            }
            _ => {
                self.group.close();
                self.ce_after_commands()?;
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
                    self.submit_copy(at, 0, chunk.len() as u32, chunk)?;
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
                self.release_relaxed()?;
                let scratch = self
                    .scratch
                    .device_addr()
                    .ok_or_else(|| EmuError::BadConfig("unmapped scratch".into()))?;
                self.submit_other(
                    AgentCmd::atomic(0, a, op, scratch, FetchOrder::HostOrder),
                    &[],
                )?;
                self.commands_landed(timeout)?;
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
                let cmd = AgentCmd::atomic(0, a, op, r, order);
                if self.relaxed {
                    self.relaxed_atomics.push(cmd);
                } else {
                    self.submit_other(cmd, &[])?;
                }
                Ok(())
            }
            _ => {
                // SAFETY: forwarded from the caller.
                unsafe { atomic_then_put(self, target, op, result, order, timeout) }
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
                self.release_relaxed()?;
                self.submit_other(AgentCmd::cqe(0, a, 0), cqe)
            }
        }
    }

    fn cqe_in_order(&self, dst: Loc) -> bool {
        !dst.is_host()
    }

    fn mark(&mut self) -> Result<Mark, EmuError> {
        self.release_relaxed()?;
        self.group.close();
        Ok(self.order.mark())
    }

    fn landed(&mut self, mark: Mark) -> Result<bool, EmuError> {
        self.publish_ready()?;
        let done = self.agent.lane_done(self.index);
        let ce = self.agent.ce_word(self.index);
        Ok(self.order.landed(mark, done, ce))
    }

    fn fence(&mut self, timeout: Duration) -> Result<(), EmuError> {
        self.release_relaxed()?;
        self.group.close();
        self.commands_landed(timeout)?;
        self.stream
            .wait(timeout, "a QP's copy-engine stream to drain")?;
        self.order.all_landed();
        Ok(())
    }

    fn flush(&mut self) -> Result<(), EmuError> {
        self.release_relaxed()?;
        self.group.close();
        self.publish_ready().map(|_| ())
    }

    fn barrier(&mut self) -> Result<(), EmuError> {
        self.release_relaxed()?;
        self.group.close();
        Ok(())
    }

    fn order_point(&mut self) -> Result<(), EmuError> {
        self.group.close();
        Ok(())
    }

    fn set_relaxed(&mut self, relaxed: bool) {
        self.relaxed = relaxed;
    }

    fn poll(&mut self) -> Result<bool, EmuError> {
        self.publish_ready()
    }

    fn busy(&self) -> bool {
        !self.order.held.is_empty()
    }

    fn describe(&self) -> String {
        let st = self.agent.state();
        format!(
            "agent lane {}: issued {}, done word {}, copy-engine value {} (word {}), held {}, \
             marks {} (landed up to {} of {}), agent generation {} phase {}, commands done {}",
            self.index,
            self.order.issued,
            self.agent.lane_done(self.index),
            self.order.ce_seq,
            self.agent.ce_word(self.index),
            self.order.held.len(),
            self.order.marks.len(),
            self.order.landed_upto,
            self.order.next_mark,
            st.generation,
            st.phase,
            self.agent.done(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(dst: u64) -> AgentCmd {
        AgentCmd::copy(0, dst, 0x9000, 8)
    }

    #[test]
    fn commands_go_at_once_until_copy_engine_work_and_then_wait_for_it() {
        let mut o = LaneOrder::new(0, 0);
        let c = o.submit(cmd(1), &[], 0).expect("nothing to wait for");
        assert_eq!(c.lane_seq, 1);
        // Copy-engine work after command 1 waits for it, and the next command for the copy.
        assert_eq!(o.ce_must_wait_for(0), Some(1));
        assert_eq!(
            o.ce_must_wait_for(1),
            None,
            "already landed: no stream wait"
        );
        assert_eq!(o.ce_enqueued(), 1);
        assert!(
            o.submit(cmd(2), b"abc", 0).is_none(),
            "held behind the copy"
        );
        assert!(
            o.submit(cmd(3), &[], 1).is_none(),
            "held behind the held one"
        );
        assert!(o.ready(0).is_empty());
        let out = o.ready(1);
        assert_eq!(out.len(), 2);
        assert_eq!(
            (out[0].cmd.lane_seq, out[0].payload.as_slice()),
            (2, &b"abc"[..])
        );
        assert_eq!(out[1].cmd.lane_seq, 3);
        assert!(o.held.is_empty());
        assert!(!o.commands_landed(2) && o.commands_landed(3));
    }

    #[test]
    fn copy_engine_work_waits_for_held_commands_too() {
        let mut o = LaneOrder::new(0, 0);
        o.ce_enqueued();
        assert!(o.submit(cmd(1), &[], 0).is_none());
        // The lane's done word may already cover older numbers; the held command is newer.
        assert_eq!(o.ce_must_wait_for(0), Some(1));
        assert!(!o.commands_landed(1), "held, so not landed");
    }

    #[test]
    fn marks_land_when_both_words_cover_them() {
        let mut o = LaneOrder::new(0, 0);
        o.submit(cmd(1), &[], 0);
        let m1 = o.mark();
        o.ce_enqueued();
        let m2 = o.mark();
        assert!(!o.landed(m1, 0, 0));
        assert!(o.landed(m1, 1, 0));
        assert!(!o.landed(m2, 1, 0), "the copy has not landed");
        assert!(o.landed(m2, 1, 1));
        assert!(o.landed(m1, 0, 0), "landed once, landed for good");
        let m3 = o.mark();
        o.all_landed();
        assert!(o.landed(m3, 0, 0));
    }

    #[test]
    fn independent_copies_join_dependent_ones_start_a_group() {
        let fresh = || {
            let mut g = JoinGroup::default();
            assert!(!g.join(0x1000, 0x9000, 64), "the first of a group");
            g
        };
        let mut g = fresh();
        assert!(
            g.join(0x1040, 0x9000, 64),
            "disjoint destination, same source"
        );
        assert!(g.join(0x2000, 0, 8), "a payload copy");
        assert!(!fresh().join(0x1020, 0x8000, 8), "write after write");
        assert!(!fresh().join(0x9010, 0x3000, 8), "write after read");
        assert!(!fresh().join(0x4000, 0x1008, 8), "read after write");
        let mut g = fresh();
        assert!(!g.join(0x1020, 0x8000, 8));
        assert!(
            g.join(0x1000, 0x7000, 8),
            "the dependent copy started a new group"
        );
        g.close();
        assert!(
            !g.join(0x5000, 0x6000, 8),
            "nothing joins across an order point"
        );
        for k in 1..MAX_JOIN as u64 {
            assert!(g.join(0x5000 + 64 * k, 0x6000, 8));
        }
        assert!(
            !g.join(0x7000_0000, 0x6000, 8),
            "a group is at most one batch"
        );
    }

    #[test]
    fn numbers_wrap_and_a_reused_index_goes_on_from_its_words() {
        let mut o = LaneOrder::new(u32::MAX, u32::MAX - 1);
        assert!(
            o.submit(cmd(1), &[], u32::MAX - 1).is_some(),
            "the previous owner's copies have landed"
        );
        assert_eq!(o.issued, 0, "wrapped");
        assert!(o.commands_landed(0) && !o.commands_landed(u32::MAX));
        assert_eq!(o.ce_enqueued(), u32::MAX);
        assert_eq!(o.ce_enqueued(), 0);
        assert!(o.submit(cmd(2), &[], u32::MAX).is_none());
        assert_eq!(o.ready(0).len(), 1);
    }
}
