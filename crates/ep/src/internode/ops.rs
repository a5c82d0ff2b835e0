//! The staged internode operations: layout, dispatch (fresh and cached) and combine.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, DeviceRepr};
use ep_kernels::internode as k;
use ep_kernels::intranode as ik;
use ibgda_device::cuda::DeviceBuffer;

use super::buffer::{InternodeBuffer, COUNTS_OFFSET, ERROR_OFFSET, STATE_CTRL, STATE_TABLE};
use super::phases::{put_count, PhaseInfo, PutCount};
use super::staged_plan::{up16, Words};
use crate::config::Config;
use crate::dtype::{Bf16, Element, Fp8E4M3};
use crate::error::{invalid, EpError};
use crate::event::Event;
use crate::intranode::layout_params;
use crate::intranode::{
    CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, DispatchX, Handle, RecvX,
    StreamOrder, TopK, FP8_BLOCK,
};
use crate::kernel_launch::launch_with_params;
use crate::tensor::Tensor;

/// Where each token goes, across nodes: [`InternodeBuffer::get_dispatch_layout`]'s result.
#[derive(Debug, Clone)]
pub struct InternodeLayout {
    pub(super) tokens_per_rank: Tensor<i32>,
    pub(super) tokens_per_node: Tensor<i32>,
    pub(super) tokens_per_expert: Tensor<i32>,
    pub(super) is_token_in_rank: Tensor<u8>,
    /// `[tokens][nodes]`: position among the tokens sent to each node, or -1.
    pub(super) node_pos: Tensor<i32>,
    /// Tokens to each node, when the host read them (empty for a layout computed under capture).
    pub(super) node_counts: Vec<usize>,
    /// The layout's `LayoutInvalid` report when the host never read it (under capture), or 0.
    pub(super) invalid: u64,
    pub(super) num_tokens: usize,
    pub(super) buffer_id: u64,
}

impl InternodeLayout {
    /// Tokens this rank sends to each rank, `[ranks]`.
    pub fn tokens_per_rank(&self) -> &Tensor<i32> {
        &self.tokens_per_rank
    }
    /// Tokens this rank sends to each node (DeepEP's `num_tokens_per_rdma_rank`), `[nodes]`.
    pub fn tokens_per_rdma_rank(&self) -> &Tensor<i32> {
        &self.tokens_per_node
    }
    /// Tokens per expert, `[num_experts]`.
    pub fn tokens_per_expert(&self) -> &Tensor<i32> {
        &self.tokens_per_expert
    }
    /// Whether each token goes to each rank (0/1), `[tokens][ranks]`.
    pub fn is_token_in_rank(&self) -> &Tensor<u8> {
        &self.is_token_in_rank
    }
    /// Tokens the layout was computed for.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

/// The arguments of [`InternodeBuffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct InternodeDispatchArgs<'a> {
    /// The tokens.
    pub x: DispatchX<'a>,
    /// Where they go.
    pub layout: &'a InternodeLayout,
    /// Top-k ids (global) and weights: required (the forwarders route by them).
    pub topk: TopK<'a>,
    /// Return exactly this many rows (rows past the received ones have top-k id -1 and weight
    /// 0) with no host wait: CUDA-graph capturable (see [`InternodeBuffer`], "`num_worst_tokens`").
    /// More received rows is [`EpError::WorstTokensExceeded`], reported by the next
    /// [`synchronize`](InternodeBuffer::synchronize). `None`: as many rows as received, after
    /// bounded host waits.
    pub num_worst_tokens: Option<usize>,
    /// Per-expert counts are rounded up to a multiple of this (at least 1).
    pub expert_alignment: usize,
    /// Stream ordering.
    pub order: StreamOrder<'a>,
}

/// What [`InternodeBuffer::dispatch`] returns. Rows are ordered by source rank, then token.
#[derive(Debug)]
pub struct InternodeDispatchOutput {
    /// The received rows.
    pub x: RecvX,
    /// Local expert ids `[rows][k]` (-1 where the expert is not on this rank); `None` cached.
    pub topk_idx: Option<Tensor<i32>>,
    /// Weights `[rows][k]` (0 where the id is -1); `None` cached.
    pub topk_weights: Option<Tensor<f32>>,
    /// Rows received; with `num_worst_tokens` the count stays on the GPU and this is the
    /// output's row count (`num_worst_tokens`).
    pub num_recv_tokens: usize,
    /// Tokens per local expert, rounded up to the alignment; `None` cached or with
    /// `num_worst_tokens` (no host wait: read `recv_tokens_per_expert`).
    pub num_recv_tokens_per_expert: Option<Vec<usize>>,
    /// The same per-expert counts on the GPU, `[num_local_experts]`; `None` cached.
    pub recv_tokens_per_expert: Option<Tensor<i32>>,
    /// What combine and cached dispatch need.
    pub handle: InternodeHandle,
    /// Recorded after the dispatch on the communication stream.
    pub event: Event,
}

/// How a dispatch routed tokens: the input of [`InternodeBuffer::combine`] and cached dispatch.
#[derive(Debug, Clone)]
pub struct InternodeHandle {
    pub(super) buffer_id: u64,
    pub(super) node_pos: Tensor<i32>,
    /// Tokens this rank sent to each node.
    pub(super) node_counts: Vec<usize>,
    /// Tokens each node's rail peer sent this rank (the forwarder inputs, before padding).
    pub(super) recv_counts: Vec<usize>,
    /// The NVLink hop of each source node.
    pub(super) sub: Vec<Handle>,
    /// Rows of this rank's output that came through each source node (empty with
    /// `num_worst_tokens`: the counts stay on the GPU).
    pub(super) block_rows: Vec<usize>,
    pub(super) num_tokens: usize,
    pub(super) rows: usize,
    /// The layout's tokens per node (what the pack kernel and a cached dispatch's put read).
    pub(super) tokens_per_node: Tensor<i32>,
    /// i32 `[MAX_NODES]`: rows each node's rail peer sent this rank, on the GPU (what the combine's
    /// put is planned from).
    pub(super) recv_dev: Tensor<i32>,
    /// With `num_worst_tokens`: the NVLink hop's fixed rows per source node.
    pub(super) worst: Option<super::worst::WorstHandle>,
    /// A cached dispatch's own NVLink-hop regions (with `num_worst_tokens`): held while its
    /// output is, so that a captured graph's replays rewrite only regions nobody else was given.
    pub(super) _held: Vec<Handle>,
}

impl InternodeHandle {
    /// Tokens the source side sent (rows of the combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// Rows of the dispatch output (and of the combine input).
    pub fn num_rows(&self) -> usize {
        self.rows
    }
    /// Rows actually received (`num_rows` less any worst-token padding); with
    /// `num_worst_tokens` the count stays on the GPU and this is `num_rows`.
    pub fn num_recv_tokens(&self) -> usize {
        if self.worst.is_some() {
            return self.rows;
        }
        self.block_rows.iter().sum()
    }
}

/// The arguments of [`InternodeBuffer::combine`].
#[derive(Debug, Clone, Copy)]
pub struct InternodeCombineArgs<'a> {
    /// Expert outputs, BF16 `[rows][hidden]`, one row per dispatch output row.
    pub x: &'a Tensor<Bf16>,
    /// The dispatch's handle.
    pub handle: &'a InternodeHandle,
    /// Weights `[rows][k]` to sum per token, or none.
    pub topk_weights: Option<&'a Tensor<f32>>,
    /// Up to two BF16 `[tokens][hidden]` tensors added to the sum.
    pub bias: [Option<&'a Tensor<Bf16>>; 2],
    /// Stream ordering.
    pub order: StreamOrder<'a>,
}

/// The dispatch input's geometry.
pub(super) struct Rows {
    pub(super) tokens: usize,
    pub(super) hidden: usize,
    pub(super) row_bytes: usize,
    pub(super) scale_words: usize,
}

pub(super) fn bytes_of<T>(n: usize) -> usize {
    n * std::mem::size_of::<T>()
}

impl InternodeBuffer {
    pub(super) fn cuda(
        &self,
        call: &'static str,
    ) -> impl Fn(cudarc::driver::DriverError) -> EpError + '_ {
        move |source| EpError::Cuda {
            rank: self.rank,
            call,
            source,
        }
    }

    pub(super) fn usable(&self) -> Result<(), EpError> {
        match self.poisoned.as_ref().or(self.gate_failure.get()) {
            Some(first) => Err(EpError::Poisoned {
                rank: self.rank,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn nodes(&self) -> usize {
        self.topo.nodes()
    }

    pub(super) fn my_node(&self) -> usize {
        self.rank / self.topo.ranks_per_node()
    }

    fn timeout_ns(&self) -> u64 {
        ibgda_device::timeout::device_ns(self.opts.buffer.timeout)
    }

    fn peer_ranks(&self) -> [i32; k::MAX_NODES] {
        let mut p = [-1; k::MAX_NODES];
        for (n, v) in p.iter_mut().enumerate().take(self.nodes()) {
            *v = self.topo.rdma_peer(self.rank, n).map_or(-1, |r| r as i32);
        }
        p
    }

    pub(super) fn launch<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        smem: u32,
        p: &P,
        call: &'static str,
    ) -> Result<(), EpError> {
        // Each internode kernel takes one by-value parameter struct, `P` is its asserted
        // #[repr(C)] mirror (the caller pairs them), and every address in it is a live
        // allocation of this rank, its registered buffer, or a QP descriptor of its live mesh.
        // SAFETY: launch_with_params' contract holds, as said above.
        unsafe { launch_with_params(&self.stream, f, grid, block, smem, p) }
            .map_err(self.cuda(call))
    }

    /// Launches the signal-wait kernel over this rank's `which` words (one per node): every
    /// word must reach the device-counted sequence at `seq` (a byte offset into `state`),
    /// compared after `>> shift`. With `counts` (device and host-mapped i32 `[nodes]`, either 0
    /// for none), the low 32 bits of each word are written there (rows per node), this rank's
    /// own node's from `own_count`. Bounded; `what` names the wait in errors.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_wait(
        &self,
        which: Words,
        seq: usize,
        shift: i32,
        counts_out: u64,
        counts_host: u64,
        own_count: u64,
        what: u32,
    ) -> Result<(), EpError> {
        let p = k::WaitParams {
            words: self.base + self.plan.word(which, 0) as u64,
            counts_out,
            counts_host,
            own_count,
            target_seq: self.state.ptr() + seq as u64,
            error: self.errors.kernel_addr(),
            timeout_ns: self.timeout_ns(),
            rank: self.rank as i32,
            nodes: self.nodes() as i32,
            my_node: self.my_node() as i32,
            shift,
            what: what as i32,
            cap: self.plan.cap as i32,
            peer_rank: self.peer_ranks(),
        };
        self.launch_waiting(
            &self.kernels.wait,
            1,
            k::WAIT_THREADS,
            &p,
            "cuLaunchKernel(ep_internode_wait)",
        )
    }

    /// Plans a put on the device from the i32 row counts at `counts` (device memory) into the
    /// put table, counting the operation's sequence number (`kind`: [`k::PLAN_DISPATCH`] or
    /// [`k::PLAN_COMBINE`]).
    pub(super) fn launch_plan_put(
        &self,
        shape: &super::staged_plan::PutShape,
        kind: i32,
        counts: u64,
    ) -> Result<(), EpError> {
        let p = k::PlanParams {
            counts,
            ctrl: self.state.ptr() + STATE_CTRL as u64,
            table: self.state.ptr() + STATE_TABLE as u64,
            error: self.errors.kernel_addr(),
            nodes: self.nodes() as i32,
            my_node: self.my_node() as i32,
            rank: self.rank as i32,
            peer_rank: self.peer_ranks(),
            ..shape.params(kind)
        };
        self.launch(
            &self.kernels.plan_put,
            1,
            k::WAIT_THREADS,
            0,
            &p,
            "cuLaunchKernel(ep_internode_plan_put)",
        )
    }

    /// Byte offset in `state` of the dispatch (or combine) sequence number.
    pub(super) fn seq_at(dispatch: bool) -> usize {
        STATE_CTRL
            + if dispatch {
                std::mem::offset_of!(k::Ctrl, dispatch_seq)
            } else {
                std::mem::offset_of!(k::Ctrl, combine_seq)
            }
    }

    /// Launches a kernel that spins (for peers' signals or the NIC's completions): through the
    /// launch gate where ranks of this process share the GPU ([`crate::residency`]), as the
    /// intranode and low-latency buffers do. Every rank launches the same sequence of these.
    fn launch_waiting<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        p: &P,
        call: &'static str,
    ) -> Result<(), EpError> {
        // Under capture nothing runs: the replays are gated instead ([`InternodeGraph`]).
        let gate = match self.is_capturing()? {
            true => None,
            false => self.gate.as_deref().map(|g| (g, self.opts.buffer.timeout)),
        };
        let r = crate::residency::gated(gate, self.rank, call, || {
            self.launch(f, grid, block, 0, p, call)
        });
        if let Err(e @ EpError::SharedGpuTimeout { .. }) = &r {
            let _ = self.gate_failure.set(e.to_string());
        }
        r
    }

    /// An asynchronous device-to-device copy on the internode stream.
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), EpError> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(self.cuda("cuCtxSetCurrent"))?;
        // SAFETY: callers pass ranges inside live allocations of this context (sizes checked
        // against the tensors' shapes and the plan), ordered on this rank's stream.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.cu_stream())
        }
        .result()
        .map_err(self.cuda("cuMemcpyDtoDAsync"))
    }

    pub(super) fn memset(&self, dst: u64, value: u8, bytes: usize) -> Result<(), EpError> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(self.cuda("cuCtxSetCurrent"))?;
        // SAFETY: as in `copy`: a range inside a live allocation of this context.
        unsafe { cudarc::driver::sys::cuMemsetD8Async(dst, value, bytes, self.stream.cu_stream()) }
            .result()
            .map_err(self.cuda("cuMemsetD8Async"))
    }

    /// Whether the communication stream is being captured into a CUDA graph (see
    /// [`InternodeBuffer`], "`num_worst_tokens`").
    pub fn is_capturing(&self) -> Result<bool, EpError> {
        crate::graph::is_capturing(&self.stream, self.rank)
    }

    /// Refuses an operation that waits on the host while the communication stream is captured.
    pub(super) fn not_capturing(&self, what: &str) -> Result<(), EpError> {
        let hint = " (dispatch: set num_worst_tokens)";
        crate::graph::refuse_host_wait(&self.stream, self.rank, what, hint)
    }

    /// Makes this stream wait for `order.previous_event`, or for the compute stream's work so
    /// far; under capture only for `previous_event` (the compute stream is not in the graph).
    pub(super) fn start(&self, order: &StreamOrder<'_>, capturing: bool) -> Result<(), EpError> {
        match order.previous_event {
            Some(e) => e.wait_on(&self.stream),
            None if capturing => Ok(()),
            None => Event::record(&self.compute, self.rank)?.wait_on(&self.stream),
        }
    }

    /// Records the end of the operation; makes the compute stream wait for it unless
    /// `async_finish` or under capture.
    pub(super) fn finish(
        &self,
        order: &StreamOrder<'_>,
        capturing: bool,
    ) -> Result<Event, EpError> {
        let e = Event::record(&self.stream, self.rank)?;
        if !order.async_finish && !capturing {
            e.wait_on(&self.compute)?;
        }
        Ok(e)
    }

    /// An event at this stream's current end: the NVLink hop's next operation is ordered after
    /// it (passed as its `previous_event`, with `async_finish`), and this stream then waits for
    /// that operation's event ([`Self::join`]). Under capture this forks the intranode buffer's
    /// stream into the graph and joins it back; eagerly it orders the two streams alike.
    pub(super) fn fork(&self) -> Result<Event, EpError> {
        Event::record(&self.stream, self.rank)
    }

    /// Makes this stream wait for an operation of the NVLink hop (its returned event).
    pub(super) fn join(&self, e: &Event) -> Result<(), EpError> {
        e.wait_on(&self.stream)
    }

    /// Combines `x` (and `topk_weights`) over `handle` on the NVLink hop, forked from this
    /// stream and joined back to it.
    pub(super) fn intra_combine_forked(
        &mut self,
        x: &Tensor<Bf16>,
        handle: &Handle,
        topk_weights: Option<&Tensor<f32>>,
        config: Config,
    ) -> Result<CombineOutput, EpError> {
        let ev = self.fork()?;
        let out = self.intra.combine(&CombineArgs {
            x,
            handle,
            topk_weights,
            bias: [None, None],
            config,
            order: intra_order(&ev),
        })?;
        self.join(&out.event)?;
        Ok(out)
    }

    /// Cached dispatch of `x` over `handle` on the NVLink hop, forked from this stream and
    /// joined back to it.
    pub(super) fn intra_dispatch_cached_forked(
        &mut self,
        x: DispatchX<'_>,
        handle: &Handle,
        config: &Config,
    ) -> Result<DispatchOutput, EpError> {
        let ev = self.fork()?;
        let out = self
            .intra
            .dispatch_cached(x, handle, config, &intra_order(&ev))?;
        self.join(&out.event)?;
        Ok(out)
    }

    /// Waits (bounded) for this stream on the host, then reports any device error.
    fn sync(&mut self, what: &'static str) -> Result<(), EpError> {
        let e = Event::record(&self.stream, self.rank)?;
        let r = e.wait_host(self.opts.buffer.timeout.saturating_mul(2), what);
        self.check_device_error()?;
        if let Err(e) = &r {
            self.poisoned = Some(e.to_string());
        }
        r
    }

    /// Turns a recorded device error into an `Err` (and marks the buffer unusable).
    pub(super) fn check_device_error(&mut self) -> Result<(), EpError> {
        let Some(w) = self.mapped.read_error(ERROR_OFFSET) else {
            return Ok(());
        };
        let timeout = self.opts.buffer.timeout;
        let err = match w.code {
            ik::error_code::TIMEOUT => EpError::PeerTimeout {
                rank: self.rank,
                peer: w.peer as usize,
                what: match w.what {
                    k::wait_what::DISPATCH_DATA => {
                        "internode dispatch rows from the peer's node (RDMA)"
                    }
                    k::wait_what::DISPATCH_ACK => {
                        "internode dispatch ack: the peer freeing its receive slot"
                    }
                    k::wait_what::COMBINE_DATA => {
                        "internode combine sums from the peer's node (RDMA)"
                    }
                    k::wait_what::COMBINE_ACK => {
                        "internode combine ack: the peer freeing its receive slot"
                    }
                    _ => "internode wait",
                },
                expert: None,
                epoch: w.epoch,
                seen: w.detail,
                timeout,
            },
            k::error_code::TRANSPORT => {
                let source = self
                    .net
                    .as_ref()
                    .and_then(|n| n.mesh.as_ref())
                    .and_then(|m| m.first_failure(Some(w.peer as usize)))
                    .map(|(_, e)| Box::new(e));
                EpError::Transport {
                    rank: self.rank,
                    peer: Some(w.peer as usize),
                    what: format!(
                        "internode {} to node {} failed with status {}",
                        match w.what {
                            21 => "put",
                            22 => "signal",
                            _ => "quiet",
                        },
                        w.detail,
                        w.epoch as i64
                    ),
                    source,
                }
            }
            ik::error_code::WORST_TOKENS_EXCEEDED => EpError::WorstTokensExceeded {
                rank: self.rank,
                received: w.detail as usize,
                worst: w.what as usize,
            },
            ik::error_code::BAD_ROUTING if w.what == k::ROUTING_TOPK_ID => {
                EpError::ExpertIdOutOfRange {
                    rank: self.rank,
                    op: "dispatch layout (computed under capture)",
                    id: w.detail as i64,
                    token: w.epoch as usize,
                    slot: None,
                    count: None,
                    num_experts: w.peer as usize,
                }
            }
            ik::error_code::BAD_ROUTING => EpError::CorruptRouting {
                rank: self.rank,
                what: "node send position (token, node)",
                index: w.epoch,
                value: w.detail as i64,
                limit: u64::from(w.peer),
            },
            other => EpError::Poisoned {
                rank: self.rank,
                first: format!(
                    "internode device error code {other} (peer {}, what {})",
                    w.peer, w.what
                ),
            },
        };
        self.poisoned = Some(err.to_string());
        Err(err)
    }

    fn on_this_gpu<T: Element>(&self, t: &Tensor<T>, name: &str) -> Result<(), EpError> {
        crate::checks::on_gpu(self.rank, self.ctx.ordinal(), t, name)
    }

    fn shape_is<T: Element>(
        &self,
        t: &Tensor<T>,
        want: &[usize],
        name: &str,
    ) -> Result<(), EpError> {
        crate::checks::shape_is(self.rank, self.ctx.ordinal(), t, want, name)
    }

    /// From top-k expert ids `[tokens][k]` (global, -1 for none): tokens per rank, per node and
    /// per expert, `is_token_in_rank`, and the send order to each node. Waits (bounded).
    ///
    /// Under CUDA-graph capture it makes no host wait (every replay recomputes the layout from
    /// the ids `topk_idx` holds then): such a layout serves dispatch with `num_worst_tokens` only,
    /// and ids out of range are reported by that dispatch's kernels (at
    /// [`synchronize`](Self::synchronize)) instead of here.
    pub fn get_dispatch_layout(
        &mut self,
        topk_idx: &Tensor<i32>,
    ) -> Result<InternodeLayout, EpError> {
        self.usable()?;
        let capturing = self.is_capturing()?;
        self.on_this_gpu(topk_idx, "topk_idx")?;
        if topk_idx.shape().len() != 2 {
            return Err(invalid(
                self.rank,
                format!(
                    "topk_idx has shape {:?}, expected [tokens, k]",
                    topk_idx.shape()
                ),
            ));
        }
        let (t, kk) = (topk_idx.dim(0), topk_idx.dim(1));
        let o = &self.opts.buffer;
        if t > o.max_tokens_per_rank || kk > o.max_topk || kk == 0 {
            return Err(invalid(
                self.rank,
                format!(
                    "{t} tokens, top-{kk}: limits are {} tokens, top-1..={}",
                    o.max_tokens_per_rank, o.max_topk
                ),
            ));
        }
        let (r, n, e) = (self.topo.world(), self.nodes(), o.num_experts);
        // Sections, each 16-byte aligned: small (bounded by the options), sized exactly.
        let sizes = [
            4 * r,
            4 * n,
            4 * e,
            4 * e,
            16,
            16,
            t * r,
            t * n,
            4 * t * r,
            4 * t * n,
        ];
        let mut at = [0usize; 10];
        let mut total = 0usize;
        for (a, s) in at.iter_mut().zip(sizes) {
            *a = total;
            total += up16(s).ok_or_else(|| invalid(self.rank, "layout size overflows"))?;
        }
        let [per_rank, per_node, per_expert, scratch_expert, invalid_r, invalid_n, in_rank, in_node, send_pos, node_pos] =
            at;
        let buf = Arc::new(if capturing {
            super::worst::alloc_relaxed(&self.ctx, total, self.rank)?
        } else {
            DeviceBuffer::new(&self.ctx, total).map_err(|source| EpError::Device {
                rank: self.rank,
                source,
            })?
        });
        self.start(&StreamOrder::default(), capturing)?;
        let b = buf.ptr();
        for (ranks, tpr, tpe, inr, pos, inv) in [
            (r, per_rank, per_expert, in_rank, send_pos, invalid_r),
            (n, per_node, scratch_expert, in_node, node_pos, invalid_n),
        ] {
            let p = layout_params(topk_idx, b, [tpr, tpe, inv, inr, pos], ranks, e);
            self.launch(
                &self.kernels.layout,
                ranks as u32 + 1,
                ik::LAYOUT_THREADS,
                (4 * e) as u32,
                &p,
                "cuLaunchKernel(ep_dispatch_layout)",
            )?;
        }
        let buffer_id = self.id;
        let views = |node_counts: Vec<usize>, invalid: u64| InternodeLayout {
            tokens_per_rank: Tensor::view(buf.clone(), per_rank, vec![r]).read_only(),
            tokens_per_node: Tensor::view(buf.clone(), per_node, vec![n]).read_only(),
            tokens_per_expert: Tensor::view(buf.clone(), per_expert, vec![e]).read_only(),
            is_token_in_rank: Tensor::view(buf.clone(), in_rank, vec![t, r]).read_only(),
            node_pos: Tensor::view(buf.clone(), node_pos, vec![t, n]).read_only(),
            node_counts,
            invalid,
            num_tokens: t,
            buffer_id,
        };
        if capturing {
            // The counts stay on the GPU; the pack kernel reports ids out of range.
            return Ok(views(Vec::new(), b + invalid_r as u64));
        }
        self.sync("the internode dispatch layout")?;
        let dev = |source| EpError::Device {
            rank: self.rank,
            source,
        };
        let bad: Vec<i32> = buf.download(invalid_r, 4).map_err(dev)?;
        if let Some(err) = crate::intranode::errors::layout_invalid_error(self.rank, &bad, kk, e) {
            return Err(err);
        }
        let counts: Vec<i32> = buf.download(per_node, n).map_err(dev)?;
        Ok(views(
            counts
                .into_iter()
                .map(|c| c.clamp(0, t as i32) as usize)
                .collect(),
            0,
        ))
    }

    fn check_x(&self, x: &DispatchX<'_>, tokens: usize) -> Result<Rows, EpError> {
        let (shape, elem, scales) = match x {
            DispatchX::Bf16(t) => {
                self.on_this_gpu(*t, "x")?;
                (t.shape().to_vec(), 2, None)
            }
            DispatchX::Fp8 { x, scales } => {
                self.on_this_gpu(*x, "x")?;
                self.on_this_gpu(*scales, "scales")?;
                (x.shape().to_vec(), 1, Some(*scales))
            }
        };
        if shape.len() != 2 || shape[0] != tokens {
            return Err(invalid(
                self.rank,
                format!("x has shape {shape:?}, expected [{tokens}, hidden]"),
            ));
        }
        let hidden = shape[1];
        let row_bytes = hidden * elem;
        if hidden == 0 || hidden > self.opts.buffer.max_hidden || row_bytes % 16 != 0 {
            return Err(invalid(
                self.rank,
                format!("hidden {hidden}: rows must be a positive multiple of 16 bytes, hidden at most {}", self.opts.buffer.max_hidden),
            ));
        }
        let mut scale_words = 0;
        if let Some(s) = scales {
            if hidden % FP8_BLOCK != 0 {
                return Err(invalid(
                    self.rank,
                    format!("FP8 hidden {hidden} is not a multiple of {FP8_BLOCK}"),
                ));
            }
            scale_words = hidden / FP8_BLOCK;
            self.shape_is(s, &[tokens, scale_words], "scales")?;
        }
        Ok(Rows {
            tokens,
            hidden,
            row_bytes,
            scale_words,
        })
    }

    pub(super) fn intra_config(&self) -> Config {
        Config {
            num_sms: self.intra_sms,
            ..Config::default_for(self.topo.ranks_per_node())
        }
    }

    /// Queues the RDMA hop of a dispatch, with no host wait: waits for the receivers' acks of
    /// the previous dispatch, packs, plans the put on the device from the i32 counts at
    /// `tokens_per_node` (the layout's, on the GPU), writes and signals, waits for every node's
    /// rows. The rows each node's rail peer sent (this rank's own node: `tokens_per_node[my
    /// node]`) land at `recv_dev` (device i32 `[nodes]`) and, with `recv_host`, in the mapped
    /// page for the host. `layout_invalid`: the layout's report of ids out of range when the host
    /// never read it (the pack kernel turns it into this rank's error), or 0. `host_counts`: the
    /// same counts as `tokens_per_node` where the host read them (empty: it did not), only for
    /// the bytes that phase timing reports.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue_rdma_dispatch(
        &mut self,
        x: &DispatchX<'_>,
        rows: &Rows,
        topk: Option<&TopK<'_>>,
        node_pos: &Tensor<i32>,
        tokens_per_node: u64,
        host_counts: &[usize],
        layout_invalid: u64,
        recv_dev: u64,
        recv_host: bool,
    ) -> Result<(), EpError> {
        let (nodes, me) = (self.nodes(), self.my_node());
        let plan = self.plan.clone();
        let error = self.errors.kernel_addr();
        let seq = Self::seq_at(true);
        // Before this dispatch's sequence number is counted: the previous dispatch's acks.
        self.launch_wait(
            Words::DispatchAck,
            seq,
            0,
            0,
            0,
            0,
            k::wait_what::DISPATCH_ACK,
        )?;
        self.phase("ack wait (previous op)", PhaseInfo::default())?;
        let kk = topk.map_or(0, |t| t.idx.dim(1));
        let (xa, sa) = match x {
            DispatchX::Bf16(t) => (t.device_address(), 0),
            DispatchX::Fp8 { x, scales } => (x.device_address(), scales.device_address()),
        };
        let mut slot = [0u64; k::MAX_NODES];
        for (n, s) in slot.iter_mut().enumerate().take(nodes) {
            *s = self.base
                + if n == me {
                    plan.d_recv_slot(n)
                } else {
                    plan.d_stage_slot(n)
                } as u64;
        }
        let pack = k::PackParams {
            x: xa,
            scales: sa,
            topk_idx: topk.map_or(0, |t| t.idx.device_address()),
            weights: topk.map_or(0, |t| t.weights.device_address()),
            node_pos: node_pos.device_address(),
            tokens_per_node,
            slot,
            off_scales: plan.d_scales as u64,
            off_idx: plan.d_idx as u64,
            off_w: plan.d_w as u64,
            error,
            num_tokens: rows.tokens as i32,
            row_bytes: rows.row_bytes as i32,
            scale_words: rows.scale_words as i32,
            topk: kk as i32,
            nodes: nodes as i32,
            experts_per_node: (self.opts.buffer.num_experts / nodes) as i32,
            cap: plan.cap as i32,
            rank: self.rank as i32,
            layout_invalid,
        };
        let warps = (k::THREADS / 32) as usize;
        let grid = rows.tokens.div_ceil(warps).clamp(1, 264) as u32;
        self.launch(
            &self.kernels.pack,
            grid,
            k::THREADS,
            0,
            &pack,
            "cuLaunchKernel(ep_internode_pack)",
        )?;
        let timing = self.timing_phases();
        let puts = if timing {
            self.dispatch_put_counts(host_counts, rows, kk)
        } else {
            Vec::new()
        };
        if timing {
            let per_row = rows.row_bytes + 4 * rows.scale_words + 8 * kk;
            let packed: usize = host_counts.iter().sum::<usize>() * per_row;
            self.phase("pack", PhaseInfo::bytes(packed as u64))?;
        }
        let shape = plan.dispatch_shape(me, rows.row_bytes, rows.scale_words, kk);
        self.launch_plan_put(&shape, k::PLAN_DISPATCH, tokens_per_node)?;
        self.phase("plan put", PhaseInfo::default())?;
        let put = k::PutParams {
            table: self.state.ptr() + STATE_TABLE as u64,
            ..self.put_params(Words::DispatchData)
        };
        self.launch_waiting(
            &self.kernels.put,
            1,
            k::THREADS,
            &put,
            "cuLaunchKernel(ep_internode_put)",
        )?;
        self.put_phase(puts)?;
        self.launch_wait(
            Words::DispatchData,
            seq,
            32,
            recv_dev,
            if recv_host {
                self.mapped.device_addr(COUNTS_OFFSET)
            } else {
                0
            },
            tokens_per_node + 4 * me as u64,
            k::wait_what::DISPATCH_DATA,
        )?;
        self.phase("wait data", PhaseInfo::default())
    }

    /// Ends a put phase: its bytes and WQEs as the host plans them (`puts`, empty where the
    /// counts stay on the GPU).
    pub(super) fn put_phase(&mut self, puts: Vec<PutCount>) -> Result<(), EpError> {
        if !self.timing_phases() {
            return Ok(());
        }
        let info = PhaseInfo {
            node: None,
            bytes: puts.iter().map(|p| p.bytes).sum(),
            puts,
        };
        self.phase("put + quiet", info)
    }

    /// The writes of a dispatch's put to every other node, from the rows this rank sends each
    /// (`counts`, as the host read them; empty: unknown), as [`StagedPlan::dispatch_segments`]
    /// plans them.
    fn dispatch_put_counts(&self, counts: &[usize], rows: &Rows, kk: usize) -> Vec<PutCount> {
        self.put_counts(counts, |n, me, c| {
            let segs =
                self.plan
                    .dispatch_segments(n, me, c, rows.row_bytes, rows.scale_words, kk)?;
            Some(segs.map(|s| s.2).to_vec())
        })
    }

    /// The writes of a combine's put to every other node, `counts[n]` rows back to node `n`
    /// (the rows its rail peer sent at dispatch).
    fn combine_put_counts(&self, counts: &[usize], hidden: usize, kk: usize) -> Vec<PutCount> {
        self.put_counts(counts, |n, me, c| {
            let segs = self.plan.combine_segments(n, me, c, hidden, kk)?;
            Some(segs.map(|s| s.2).to_vec())
        })
    }

    /// One [`PutCount`] per other node `n` with a count, its segment sizes from
    /// `segments(n, this node, rows clamped to the slot)`.
    fn put_counts(
        &self,
        counts: &[usize],
        segments: impl Fn(usize, usize, usize) -> Option<Vec<usize>>,
    ) -> Vec<PutCount> {
        let me = self.my_node();
        (0..self.nodes().min(counts.len()))
            .filter(|&n| n != me)
            .filter_map(|n| {
                Some(put_count(
                    n,
                    &segments(n, me, counts[n].min(self.plan.cap))?,
                    1,
                ))
            })
            .collect()
    }

    /// The RDMA hop of a dispatch, then a bounded host wait for it: returns the rows each node's
    /// rail peer sent (this rank's own node: `node_counts[my node]`).
    #[allow(clippy::too_many_arguments)]
    fn rdma_dispatch(
        &mut self,
        x: &DispatchX<'_>,
        rows: &Rows,
        topk: Option<&TopK<'_>>,
        node_pos: &Tensor<i32>,
        node_counts: &[usize],
        tokens_per_node: u64,
        recv_dev: u64,
    ) -> Result<Vec<usize>, EpError> {
        let (nodes, me) = (self.nodes(), self.my_node());
        self.queue_rdma_dispatch(
            x,
            rows,
            topk,
            node_pos,
            tokens_per_node,
            node_counts,
            0,
            recv_dev,
            true,
        )?;
        self.sync("the internode dispatch's RDMA hop")?;
        self.phase("host wait (rows received)", PhaseInfo::default())?;
        Ok((0..nodes)
            .map(|n| {
                if n == me {
                    node_counts[n]
                } else {
                    self.mapped
                        .read_i32(COUNTS_OFFSET + 4 * n)
                        .clamp(0, self.plan.cap as i32) as usize
                }
            })
            .collect())
    }

    /// Put parameters with no segments and no signals, the word array `w` as the target.
    pub(super) fn put_params(&self, w: Words) -> k::PutParams {
        let me = self.my_node();
        k::PutParams {
            descs: self.descs,
            rbase: self.rbase,
            rkey: self.rkey,
            local_base: self.base,
            signal_off: self.plan.word(w, me) as u64,
            error: self.errors.kernel_addr(),
            rank: self.rank as i32,
            nodes: self.nodes() as i32,
            my_node: me as i32,
            peer_rank: self.peer_ranks(),
            ..Default::default()
        }
    }

    /// [`ack`](Self::ack), then a bounded host wait for it, on the eager paths (which wait on
    /// the host anyway) before they free or allocate their temporaries: `cuMemFree` waits for
    /// every kernel of the context while holding a driver lock the emulated NIC's driver calls
    /// need, so a free while the ack kernel waits for the NIC stalls both until the kernel's
    /// bound runs out (ranks as processes on one H200, 2026-12-02). The `num_worst_tokens` paths
    /// free nothing (pooled regions) and make no host wait.
    pub(super) fn ack_and_wait(&mut self, w: Words, what: &'static str) -> Result<(), EpError> {
        self.ack(w)?;
        self.sync(what)
    }

    /// Tells every other node's rail peer that this rank is done with what it sent (`w`).
    pub(super) fn ack(&self, w: Words) -> Result<(), EpError> {
        let mut put = self.put_params(w);
        for n in (0..self.nodes()).filter(|&n| n != self.my_node()) {
            put.delta[n] = 1;
        }
        self.launch_waiting(
            &self.kernels.put,
            1,
            k::THREADS,
            &put,
            "cuLaunchKernel(ep_internode_put)",
        )
    }

    /// Views of node `n`'s dispatch receive slot as the NVLink hop's input: `rows` rows.
    pub(super) fn forwarder_input(
        &self,
        n: usize,
        rows: usize,
        r: &Rows,
        fp8: bool,
        kk: usize,
    ) -> (ForwarderInput, Option<ForwarderTopK>) {
        let reg = self
            .net
            .as_ref()
            .and_then(|n| n.registration.device().cloned());
        let reg = reg.expect("a live buffer keeps its registration");
        let slot = self.plan.d_recv_slot(n);
        let x = if fp8 {
            ForwarderInput::Fp8(
                Tensor::view(reg.clone(), slot, vec![rows, r.hidden]),
                Tensor::view(
                    reg.clone(),
                    slot + self.plan.d_scales,
                    vec![rows, r.scale_words],
                ),
            )
        } else {
            ForwarderInput::Bf16(Tensor::view(reg.clone(), slot, vec![rows, r.hidden]))
        };
        let topk = (kk > 0).then(|| {
            (
                Tensor::view(reg.clone(), slot + self.plan.d_idx, vec![rows, kk]),
                Tensor::view(reg.clone(), slot + self.plan.d_w, vec![rows, kk]),
            )
        });
        (x, topk)
    }

    /// Sends each token to every rank holding one of its experts, through its rail peer on each
    /// node. Rows arrive ordered by source rank, then token. Every rank calls this together.
    pub fn dispatch(
        &mut self,
        args: &InternodeDispatchArgs<'_>,
    ) -> Result<InternodeDispatchOutput, EpError> {
        self.usable()?;
        let layout = args.layout;
        if layout.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "layout",
            });
        }
        let rows = self.check_x(&args.x, layout.num_tokens)?;
        let kk = args.topk.idx.dim(1);
        self.on_this_gpu(args.topk.idx, "topk_idx")?;
        self.on_this_gpu(args.topk.weights, "topk_weights")?;
        self.shape_is(args.topk.idx, &[rows.tokens, kk], "topk_idx")?;
        self.shape_is(args.topk.weights, &[rows.tokens, kk], "topk_weights")?;
        if kk == 0 || kk > self.opts.buffer.max_topk {
            return Err(invalid(
                self.rank,
                format!("top-{kk}: expected 1..={}", self.opts.buffer.max_topk),
            ));
        }
        if args.expert_alignment == 0 || args.expert_alignment > 1 << 20 {
            return Err(invalid(
                self.rank,
                format!("expert_alignment {} out of 1..=2^20", args.expert_alignment),
            ));
        }
        let cap_rows = self.topo.world() * self.opts.buffer.max_tokens_per_rank;
        if let Some(w) = args.num_worst_tokens {
            if w == 0 || w > cap_rows {
                return Err(invalid(
                    self.rank,
                    format!("num_worst_tokens {w} out of 1..={cap_rows}"),
                ));
            }
        }
        if let Some(w) = args.num_worst_tokens {
            return self.dispatch_worst(args, &rows, kk, w);
        }
        self.not_capturing("dispatch without num_worst_tokens")?;
        if layout.node_counts.is_empty() {
            return Err(invalid(
                self.rank,
                "a layout computed under CUDA-graph capture has no host counts: dispatch over it \
                 with num_worst_tokens",
            ));
        }
        self.phase_begin("dispatch")?;
        self.start(&args.order, false)?;
        let recv_dev = self.small_counts()?;
        self.phase("start", PhaseInfo::default())?;
        let recv_counts = self.rdma_dispatch(
            &args.x,
            &rows,
            Some(&args.topk),
            &layout.node_pos,
            &layout.node_counts,
            layout.tokens_per_node.device_address(),
            recv_dev.device_address(),
        )?;
        let fp8 = matches!(args.x, DispatchX::Fp8 { .. });
        let cfg = self.intra_config();
        let mut parts = Vec::with_capacity(self.nodes());
        for (n, &c) in recv_counts.iter().enumerate() {
            let (input, topk) = self.forwarder_input(n, c.max(1), &rows, fp8, kk);
            let (idx, w) = topk.expect("top-k is given");
            let l = self.intra.get_dispatch_layout(&idx)?;
            self.phase("nvl layout", PhaseInfo::node(n, 0))?;
            let ev = self.fork()?;
            let out = self.intra.dispatch(&DispatchArgs {
                x: input.as_x(),
                layout: &l,
                topk: Some(TopK {
                    idx: &idx,
                    weights: &w,
                }),
                num_worst_tokens: None,
                expert_alignment: 1,
                config: cfg,
                order: intra_order(&ev),
            })?;
            self.join(&out.event)?;
            let moved = out.num_recv_tokens.unwrap_or(0) * rows.row_bytes;
            self.phase("nvl dispatch", PhaseInfo::node(n, moved as u64))?;
            parts.push(out);
        }
        self.ack_and_wait(Words::DispatchAck, "the internode dispatch ack")?;
        self.phase("ack + host wait", PhaseInfo::default())?;
        let block_rows: Vec<usize> = parts
            .iter()
            .map(|p| p.num_recv_tokens.unwrap_or(0))
            .collect();
        let received: usize = block_rows.iter().sum();
        let local = self.num_local_experts();
        let mut per_expert = vec![0usize; local];
        for p in &parts {
            for (a, c) in per_expert
                .iter_mut()
                .zip(p.num_recv_tokens_per_expert.iter().flatten())
            {
                *a += c;
            }
        }
        let a = args.expert_alignment;
        per_expert.iter_mut().for_each(|c| *c = c.div_ceil(a) * a);
        let outs = self.gather_outputs(&parts, received, received, &rows, fp8, kk)?;
        self.phase(
            "gather",
            PhaseInfo::bytes((received * rows.row_bytes) as u64),
        )?;
        let counts: Vec<i32> = per_expert
            .iter()
            .map(|&c| c.min(i32::MAX as usize) as i32)
            .collect();
        let dev_counts =
            DeviceBuffer::from_slice(&self.ctx, &counts).map_err(|source| EpError::Device {
                rank: self.rank,
                source,
            })?;
        let event = self.finish(&args.order, false)?;
        self.phase("finish", PhaseInfo::default())?;
        Ok(InternodeDispatchOutput {
            x: outs.0,
            topk_idx: outs.1,
            topk_weights: outs.2,
            num_recv_tokens: received,
            num_recv_tokens_per_expert: Some(per_expert),
            recv_tokens_per_expert: Some(Tensor::view(Arc::new(dev_counts), 0, vec![local])),
            handle: InternodeHandle {
                buffer_id: self.id,
                node_pos: layout.node_pos.clone(),
                node_counts: layout.node_counts.clone(),
                recv_counts,
                sub: parts.into_iter().map(|p| p.handle).collect(),
                block_rows,
                num_tokens: rows.tokens,
                rows: received,
                tokens_per_node: layout.tokens_per_node.clone(),
                recv_dev,
                worst: None,
                _held: Vec::new(),
            },
            event,
        })
    }

    /// A fresh device i32 `[MAX_NODES]` for a dispatch's received counts (eager paths).
    fn small_counts(&self) -> Result<Tensor<i32>, EpError> {
        let b =
            DeviceBuffer::new(&self.ctx, 4 * k::MAX_NODES).map_err(|source| EpError::Device {
                rank: self.rank,
                source,
            })?;
        Ok(Tensor::view(Arc::new(b), 0, vec![k::MAX_NODES]))
    }

    /// Concatenates the NVLink hop's outputs (node by node) into fresh tensors of `out_rows`
    /// rows; rows past `received` get top-k id -1 and weight 0.
    fn gather_outputs(
        &self,
        parts: &[crate::intranode::DispatchOutput],
        out_rows: usize,
        received: usize,
        rows: &Rows,
        fp8: bool,
        kk: usize,
    ) -> Result<Gathered, EpError> {
        let dev = |source| EpError::Device {
            rank: self.rank,
            source,
        };
        let alloc = |bytes: usize| -> Result<Arc<DeviceBuffer>, EpError> {
            let b = Arc::new(DeviceBuffer::new(&self.ctx, bytes).map_err(dev)?);
            if self.opts.buffer.poison_outputs {
                self.memset(b.ptr(), 0xAB, bytes)?;
            }
            Ok(b)
        };
        let xb = alloc(out_rows * rows.row_bytes)?;
        let sb = alloc(bytes_of::<f32>(out_rows * rows.scale_words))?;
        let want_topk = kk > 0 && parts.iter().all(|p| p.topk_idx.is_some());
        let ib = alloc(bytes_of::<i32>(out_rows * kk))?;
        let wb = alloc(bytes_of::<f32>(out_rows * kk))?;
        let mut at = 0usize;
        for p in parts {
            let r = p.num_recv_tokens.unwrap_or(0);
            let (xs, ss) = match &p.x {
                RecvX::Bf16(t) => (t.device_address(), 0),
                RecvX::Fp8 { x, scales } => (x.device_address(), scales.device_address()),
            };
            self.copy(
                xb.ptr() + (at * rows.row_bytes) as u64,
                xs,
                r * rows.row_bytes,
            )?;
            if fp8 {
                self.copy(
                    sb.ptr() + bytes_of::<f32>(at * rows.scale_words) as u64,
                    ss,
                    bytes_of::<f32>(r * rows.scale_words),
                )?;
            }
            if want_topk {
                if let (Some(i), Some(w)) = (&p.topk_idx, &p.topk_weights) {
                    self.copy(
                        ib.ptr() + bytes_of::<i32>(at * kk) as u64,
                        i.device_address(),
                        bytes_of::<i32>(r * kk),
                    )?;
                    self.copy(
                        wb.ptr() + bytes_of::<f32>(at * kk) as u64,
                        w.device_address(),
                        bytes_of::<f32>(r * kk),
                    )?;
                }
            }
            at += r;
        }
        if want_topk && out_rows > received {
            self.memset(
                ib.ptr() + bytes_of::<i32>(received * kk) as u64,
                0xFF,
                bytes_of::<i32>((out_rows - received) * kk),
            )?;
            self.memset(
                wb.ptr() + bytes_of::<f32>(received * kk) as u64,
                0,
                bytes_of::<f32>((out_rows - received) * kk),
            )?;
        }
        let x = if fp8 {
            RecvX::Fp8 {
                x: Tensor::<Fp8E4M3>::view(xb, 0, vec![out_rows, rows.hidden]),
                scales: Tensor::view(sb, 0, vec![out_rows, rows.scale_words]),
            }
        } else {
            RecvX::Bf16(Tensor::<Bf16>::view(xb, 0, vec![out_rows, rows.hidden]))
        };
        Ok((
            x,
            want_topk.then(|| Tensor::view(ib, 0, vec![out_rows, kk])),
            want_topk.then(|| Tensor::view(wb, 0, vec![out_rows, kk])),
        ))
    }

    /// Sends `x` along the routes of an earlier dispatch (no layout, no top-k). Every rank calls
    /// this together.
    pub fn dispatch_cached(
        &mut self,
        x: DispatchX<'_>,
        handle: &InternodeHandle,
        order: &StreamOrder<'_>,
    ) -> Result<InternodeDispatchOutput, EpError> {
        self.usable()?;
        if handle.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "handle",
            });
        }
        let rows = self.check_x(&x, handle.num_tokens)?;
        if handle.worst.is_some() {
            return self.dispatch_cached_worst(x, handle, &rows, order);
        }
        self.not_capturing("cached dispatch over a handle without num_worst_tokens")?;
        self.phase_begin("cached dispatch")?;
        self.start(order, false)?;
        let recv_dev = self.small_counts()?;
        self.phase("start", PhaseInfo::default())?;
        let recv = self.rdma_dispatch(
            &x,
            &rows,
            None,
            &handle.node_pos,
            &handle.node_counts,
            handle.tokens_per_node.device_address(),
            recv_dev.device_address(),
        )?;
        if recv != handle.recv_counts {
            let e = invalid(
                self.rank,
                format!(
                    "cached dispatch: the nodes sent {recv:?} rows, the handle's dispatch {:?}",
                    handle.recv_counts
                ),
            );
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        let fp8 = matches!(x, DispatchX::Fp8 { .. });
        let cfg = self.intra_config();
        let mut parts = Vec::with_capacity(self.nodes());
        for (n, &c) in recv.iter().enumerate() {
            let (input, _) = self.forwarder_input(n, c.max(1), &rows, fp8, 0);
            let mut out = self.intra_dispatch_cached_forked(input.as_x(), &handle.sub[n], &cfg)?;
            out.num_recv_tokens = Some(handle.block_rows[n]);
            let moved = handle.block_rows[n] * rows.row_bytes;
            self.phase("nvl dispatch", PhaseInfo::node(n, moved as u64))?;
            parts.push(out);
        }
        self.ack_and_wait(Words::DispatchAck, "the internode cached dispatch ack")?;
        self.phase("ack + host wait", PhaseInfo::default())?;
        let received = handle.num_recv_tokens();
        let outs = self.gather_outputs(&parts, handle.rows, received, &rows, fp8, 0)?;
        self.phase(
            "gather",
            PhaseInfo::bytes((received * rows.row_bytes) as u64),
        )?;
        let event = self.finish(order, false)?;
        self.phase("finish", PhaseInfo::default())?;
        Ok(InternodeDispatchOutput {
            x: outs.0,
            topk_idx: None,
            topk_weights: None,
            num_recv_tokens: received,
            num_recv_tokens_per_expert: None,
            recv_tokens_per_expert: None,
            handle: handle.clone(),
            event,
        })
    }

    /// Reduces each token's copies back to its rank: inside each node at the rail peer (f32,
    /// ascending rank, rounded to BF16), then across nodes here (f32, ascending node), then the
    /// biases. Every rank calls this together.
    pub fn combine(&mut self, args: &InternodeCombineArgs<'_>) -> Result<CombineOutput, EpError> {
        self.usable()?;
        let h = args.handle;
        if h.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "handle",
            });
        }
        self.on_this_gpu(args.x, "x")?;
        if args.x.shape().len() != 2 || args.x.dim(0) != h.rows {
            return Err(invalid(
                self.rank,
                format!(
                    "combine x has shape {:?}, expected [{}, hidden]",
                    args.x.shape(),
                    h.rows
                ),
            ));
        }
        let hidden = args.x.dim(1);
        if hidden == 0 || hidden > self.opts.buffer.max_hidden || hidden % 8 != 0 {
            return Err(invalid(
                self.rank,
                format!("combine hidden {hidden}: a multiple of 8 up to max_hidden"),
            ));
        }
        let kk = match args.topk_weights {
            Some(w) => {
                self.on_this_gpu(w, "topk_weights")?;
                let kk = if w.shape().len() == 2 { w.dim(1) } else { 0 };
                if kk == 0 || kk > self.opts.buffer.max_topk {
                    return Err(invalid(
                        self.rank,
                        format!("combine topk_weights shape {:?}", w.shape()),
                    ));
                }
                self.shape_is(w, &[h.rows, kk], "topk_weights")?;
                kk
            }
            None => 0,
        };
        for b in args.bias.iter().flatten() {
            self.on_this_gpu(*b, "bias")?;
            self.shape_is(*b, &[h.num_tokens, hidden], "bias")?;
        }
        let capturing = self.is_capturing()?;
        if h.worst.is_none() {
            self.not_capturing("combine over a dispatch without num_worst_tokens")?;
        }
        let t = h.num_tokens;
        self.phase_begin("combine")?;
        // The outputs: pooled with num_worst_tokens (no allocation under capture), else fresh.
        let (out_x, out_w) = match &h.worst {
            Some(_) => self.worst_combine_outputs(t, hidden, kk)?,
            None => {
                let dev = |source| EpError::Device {
                    rank: self.rank,
                    source,
                };
                let x = Arc::new(DeviceBuffer::new(&self.ctx, t * hidden * 2).map_err(dev)?);
                let w = match kk {
                    0 => None,
                    _ => Some(Arc::new(
                        DeviceBuffer::new(&self.ctx, bytes_of::<f32>(t * kk)).map_err(dev)?,
                    )),
                };
                (
                    Tensor::view(x, 0, vec![t, hidden]),
                    w.map(|b| Tensor::view(b, 0, vec![t, kk])),
                )
            }
        };
        self.phase("alloc outputs", PhaseInfo::default())?;
        let r = self.combine_queued(args, out_x, out_w, hidden, kk, capturing);
        self.poison_on_err(r)
    }

    /// The part of a combine that queues work (after the checks): an error here leaves the
    /// peers' signals unpaired, so it makes the buffer unusable.
    fn combine_queued(
        &mut self,
        args: &InternodeCombineArgs<'_>,
        out_x: Tensor<Bf16>,
        out_w: Option<Tensor<f32>>,
        hidden: usize,
        kk: usize,
        capturing: bool,
    ) -> Result<CombineOutput, EpError> {
        let h = args.handle;
        let (nodes, me) = (self.nodes(), self.my_node());
        let plan = self.plan.clone();
        let error = self.errors.kernel_addr();
        let t = h.num_tokens;
        self.start(&args.order, capturing)?;
        if self.opts.buffer.poison_outputs {
            self.memset(out_x.device_address(), 0xAB, t * hidden * 2)?;
            if let Some(w) = &out_w {
                self.memset(w.device_address(), 0xAB, bytes_of::<f32>(t * kk))?;
            }
        }
        // Before this combine's sequence number is counted: the previous combine's acks.
        self.launch_wait(
            Words::CombineAck,
            Self::seq_at(false),
            0,
            0,
            0,
            0,
            k::wait_what::COMBINE_ACK,
        )?;
        self.phase("ack wait (previous op)", PhaseInfo::default())?;
        // NVLink hop, node by node: the rail peer's sums of this node's rows; staged (this rank's
        // own node: straight into its receive slot) for one put per node.
        let sums = match &h.worst {
            Some(wh) => {
                let sums = self.worst_nvlink_combine(args, wh, hidden, kk)?;
                self.phase("nvl combine", PhaseInfo::default())?;
                self.launch_stage(&sums, h, hidden, kk)?;
                self.phase("stage", PhaseInfo::default())?;
                sums
            }
            None => {
                let cfg = self.intra_config();
                let mut sums = Vec::with_capacity(nodes);
                let mut at = 0usize;
                for n in 0..nodes {
                    let r = h.block_rows[n];
                    let x = args.x.rows(at, r);
                    let w = args.topk_weights.map(|w| w.rows(at, r));
                    at += r;
                    sums.push(self.intra_combine_forked(&x, &h.sub[n], w.as_ref(), cfg)?);
                    self.phase("nvl combine", PhaseInfo::node(n, (r * hidden * 2) as u64))?;
                }
                let staged: usize = (0..nodes).map(|n| h.recv_counts[n].min(plan.cap)).sum();
                for (n, s) in sums.iter().enumerate() {
                    let c = h.recv_counts[n].min(plan.cap);
                    let dst = self.base
                        + if n == me {
                            plan.c_recv_slot(n)
                        } else {
                            plan.c_stage_slot(n)
                        } as u64;
                    self.copy(dst, s.x.device_address(), c * hidden * 2)?;
                    if let Some(w) = &s.topk_weights {
                        self.copy(
                            dst + plan.c_w as u64,
                            w.device_address(),
                            bytes_of::<f32>(c * kk),
                        )?;
                    }
                }
                self.phase(
                    "stage",
                    PhaseInfo::bytes((staged * (hidden * 2 + 4 * kk)) as u64),
                )?;
                sums
            }
        };
        // The put is planned on the device from the rows each node sent at dispatch.
        let shape = plan.combine_shape(me, hidden, kk);
        self.launch_plan_put(&shape, k::PLAN_COMBINE, h.recv_dev.device_address())?;
        self.phase("plan put", PhaseInfo::default())?;
        let puts = if self.timing_phases() {
            self.combine_put_counts(&h.recv_counts, hidden, kk)
        } else {
            Vec::new()
        };
        let put = k::PutParams {
            table: self.state.ptr() + STATE_TABLE as u64,
            ..self.put_params(Words::CombineData)
        };
        self.launch_waiting(
            &self.kernels.put,
            1,
            k::THREADS,
            &put,
            "cuLaunchKernel(ep_internode_put)",
        )?;
        self.put_phase(puts)?;
        self.launch_wait(
            Words::CombineData,
            Self::seq_at(false),
            0,
            0,
            0,
            0,
            k::wait_what::COMBINE_DATA,
        )?;
        self.phase("wait data", PhaseInfo::default())?;
        let mut slot = [0u64; k::MAX_NODES];
        let mut rows = [0i32; k::MAX_NODES];
        for n in 0..nodes {
            slot[n] = self.base + plan.c_recv_slot(n) as u64;
            // A layout computed under capture left its counts on the GPU: positions are bounded
            // by the slot.
            rows[n] = h.node_counts.get(n).map_or(plan.cap, |&c| c.min(plan.cap)) as i32;
        }
        let p = k::ReduceParams {
            slot,
            off_w: plan.c_w as u64,
            node_pos: h.node_pos.device_address(),
            bias0: args.bias[0].map_or(0, |b| b.device_address()),
            bias1: args.bias[1].map_or(0, |b| b.device_address()),
            out_x: out_x.device_address(),
            out_w: out_w.as_ref().map_or(0, |b| b.device_address()),
            error,
            num_tokens: t as i32,
            hidden: hidden as i32,
            topk: kk as i32,
            nodes: nodes as i32,
            rank: self.rank as i32,
            pad: 0,
            rows,
        };
        if t > 0 {
            self.launch(
                &self.kernels.reduce,
                t.min(1024) as u32,
                k::THREADS,
                0,
                &p,
                "cuLaunchKernel(ep_internode_reduce)",
            )?;
        }
        let summed: usize = rows.iter().map(|&r| r as usize).sum();
        self.phase(
            "reduce",
            PhaseInfo::bytes((summed * hidden * 2 + t * hidden * 2) as u64),
        )?;
        if h.worst.is_none() {
            // The per-node sums below are freed.
            self.ack_and_wait(Words::CombineAck, "the internode combine ack")?;
            self.phase("ack + host wait", PhaseInfo::default())?;
        } else {
            self.ack(Words::CombineAck)?;
            self.phase("ack", PhaseInfo::default())?;
        }
        let event = self.finish(&args.order, capturing)?;
        self.phase("finish", PhaseInfo::default())?;
        drop(sums);
        Ok(CombineOutput {
            x: out_x,
            topk_weights: out_w,
            event,
        })
    }

    /// Marks the buffer unusable on an error after work was queued (the peers' signals and the
    /// device-counted sequence numbers are then out of step).
    pub(super) fn poison_on_err<T>(&mut self, r: Result<T, EpError>) -> Result<T, EpError> {
        if let Err(e) = &r {
            if self.poisoned.is_none() {
                self.poisoned = Some(e.to_string());
            }
        }
        r
    }

    /// Waits (bounded) for everything queued (the NVLink hop's too), then reports any device
    /// error: this buffer's, then the NVLink hop's. Refused under capture.
    pub fn synchronize(&mut self) -> Result<(), EpError> {
        self.not_capturing("synchronize")?;
        self.sync("the internode stream")?;
        self.intra.synchronize()
    }

    /// Reports, without waiting, a device error that kernels of earlier operations recorded so
    /// far (this buffer's, then the NVLink hop's), and makes the buffer unusable; a buffer that
    /// is unusable already returns its first error.
    ///
    /// A kernel that fails (a wait that ran out of time, a put or quiet the NIC refused) records
    /// its error and ends; the kernels queued after it still run, and waits that see a recorded
    /// error give up at once, so the outputs of that operation and of the ones after it are
    /// incomplete (a combine sums only the parts that arrived). Operations that make no host
    /// wait after their kernels (combine, everything with `num_worst_tokens`, the acks that end
    /// a dispatch) leave such errors for the caller: [`synchronize`](Self::synchronize) waits
    /// and reports them; this reads host-mapped words only, so it costs no wait and may precede
    /// every operation (errors of work still queued are not seen yet). Allowed under capture.
    pub fn check_errors(&mut self) -> Result<(), EpError> {
        self.usable()?;
        self.check_device_error()?;
        if let Err(e) = self.intra.check_device_error() {
            self.poisoned.get_or_insert_with(|| e.to_string());
            return Err(e);
        }
        Ok(())
    }
}

/// The NVLink hop's input ids and weights (views of a dispatch receive slot).
pub(super) type ForwarderTopK = (Tensor<i32>, Tensor<f32>);

/// A dispatch's concatenated outputs: rows, ids, weights.
type Gathered = (RecvX, Option<Tensor<i32>>, Option<Tensor<f32>>);

/// The NVLink hop's input rows (views of a dispatch receive slot).
pub(super) enum ForwarderInput {
    Bf16(Tensor<Bf16>),
    Fp8(Tensor<Fp8E4M3>, Tensor<f32>),
}

impl ForwarderInput {
    pub(super) fn as_x(&self) -> DispatchX<'_> {
        match self {
            ForwarderInput::Bf16(t) => DispatchX::Bf16(t),
            ForwarderInput::Fp8(x, scales) => DispatchX::Fp8 { x, scales },
        }
    }
}

/// The ordering of an NVLink-hop operation inside an internode one: after `ev` (this stream's
/// end, [`InternodeBuffer::fork`]); the caller joins its event back.
pub(super) fn intra_order(ev: &Event) -> StreamOrder<'_> {
    StreamOrder {
        previous_event: Some(ev),
        async_finish: true,
    }
}
