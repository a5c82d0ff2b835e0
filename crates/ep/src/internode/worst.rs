//! The `num_worst_tokens` path of the internode buffer: dispatch, cached dispatch and combine
//! with no host wait (CUDA-graph capturable).
//!
//! Every size is fixed on the host and every count stays on the device:
//! - RDMA hop: the put is planned on the device from the layout's per-node counts
//!   (`ep_internode_plan_put`), the rows each node's rail peer announced land in device memory
//!   (the wait kernel), sequence numbers are counted on the device ([`k::Ctrl`]).
//! - NVLink hop: per source node, over the whole receive slot (`max_tokens_per_rank` rows; rows
//!   past the count get ids -1 first, `ep_internode_recv_prep`, so they go nowhere): a layout
//!   computed on the device into this dispatch's pooled region, then the intranode buffer's own
//!   `num_worst_tokens` dispatch (fixed rows per source node, no host wait).
//! - Output: `ep_internode_gather` concatenates the per-node blocks (counts read from the
//!   intranode regions' `Meta`) into the fixed rows; combine inputs go back the same way
//!   (`ep_internode_scatter`, into the intranode regions, which then are that hop's combine
//!   input), and the sums are staged by device counts (`ep_internode_stage`).
//!
//! Outputs come from pools (a `cuMemAlloc` cannot be captured), allocated on first use.

use std::sync::Arc;

use ep_kernels::internode as k;
use ep_kernels::intranode as ik;
use ibgda_device::cuda::DeviceBuffer;

use super::buffer::InternodeBuffer;
use super::ops::{
    bytes_of, intra_order, InternodeCombineArgs, InternodeDispatchArgs, InternodeDispatchOutput,
    InternodeHandle, Rows,
};
use super::phases::PhaseInfo;
use super::staged_plan::Words;
use crate::dtype::{Bf16, Fp8E4M3};
use crate::error::{invalid, EpError};
use crate::intranode::{CombineOutput, DispatchArgs, DispatchX, RecvX, StreamOrder, TopK};
use crate::region_pool::RegionPool;
use crate::tensor::{Region, Tensor};

/// Sections are aligned to this (every row of every section stays 16-byte aligned).
const ALIGN: usize = 256;

fn up(n: usize) -> Option<usize> {
    n.checked_add(ALIGN - 1).map(|v| v & !(ALIGN - 1))
}

/// Where everything lies in a pooled dispatch region and a pooled combine region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WorstPlan {
    /// Rows a dispatch output holds at most (`ranks * max_tokens_per_rank`).
    pub rows: usize,
    /// Dispatch region: rows (`max_hidden` BF16 each), scales, ids, weights, per-expert counts,
    /// received counts (i32 `[MAX_NODES]`), then the NVLink hop's layout of each source node.
    pub x: usize,
    pub scales: usize,
    pub ids: usize,
    pub w: usize,
    pub experts: usize,
    pub counts: usize,
    pub layouts: usize,
    pub layout_bytes: usize,
    pub bytes: usize,
    /// Combine region: BF16 rows `[max_tokens_per_rank][max_hidden]`, then weights.
    pub c_w: usize,
    pub c_bytes: usize,
}

impl WorstPlan {
    /// The plan for `world` ranks of `cap` tokens at most, rows of up to `max_hidden` BF16,
    /// top-`max_topk`, `local` experts per rank, `nodes` nodes whose NVLink-hop layouts take
    /// `layout_bytes` each; `None` when a size overflows.
    pub(super) fn new(
        world: usize,
        cap: usize,
        max_hidden: usize,
        max_topk: usize,
        local: usize,
        nodes: usize,
        layout_bytes: usize,
    ) -> Option<Self> {
        let rows = world.checked_mul(cap)?;
        let sec = |per_row: usize| rows.checked_mul(per_row).and_then(up);
        let x = 0;
        let scales = sec(max_hidden.checked_mul(2)?)?;
        let ids = scales.checked_add(sec(max_hidden
            .div_ceil(crate::FP8_BLOCK)
            .checked_mul(4)?)?)?;
        let w = ids.checked_add(sec(max_topk.checked_mul(4)?)?)?;
        let experts = w.checked_add(sec(max_topk.checked_mul(4)?)?)?;
        let counts = experts.checked_add(up(local.checked_mul(4)?)?)?;
        let layouts = counts.checked_add(up(4 * k::MAX_NODES)?)?;
        let layout_bytes = up(layout_bytes)?;
        let bytes = layouts.checked_add(layout_bytes.checked_mul(nodes)?)?;
        let c_w = up(cap.checked_mul(max_hidden)?.checked_mul(2)?)?;
        let c_bytes = c_w.checked_add(up(cap.checked_mul(max_topk)?.checked_mul(4)?)?)?;
        Some(Self {
            rows,
            x,
            scales,
            ids,
            w,
            experts,
            counts,
            layouts,
            layout_bytes,
            bytes,
            c_w,
            c_bytes,
        })
    }

    /// Where source node `n`'s NVLink-hop layout lies in a dispatch region.
    pub(super) fn layout_at(&self, n: usize) -> usize {
        self.layouts + n * self.layout_bytes
    }
}

/// The pools of the `num_worst_tokens` path: `max_live_outputs` dispatch regions and as many
/// combine outputs.
pub(crate) struct WorstPools {
    plan: WorstPlan,
    dispatch: RegionPool,
    combine: RegionPool,
}

/// What marks a `num_worst_tokens` dispatch's handle: the NVLink hop's fixed rows per source
/// node. (Its pooled region, with the NVLink hop's layouts and the received counts, is held by
/// the handle's `recv_dev` view.)
#[derive(Debug, Clone)]
pub(crate) struct WorstHandle {
    /// Rows of each source node's block in the NVLink hop.
    block: usize,
}

/// Allocates with the calling thread's capture mode relaxed: a `cuMemAlloc` is not part of a
/// stream, so under a thread-local capture it is refused (and ends the capture). Allocated once,
/// outside the graph, the pools are what the captured work then reads and writes.
pub(super) fn alloc_relaxed(
    ctx: &Arc<cudarc::driver::CudaContext>,
    bytes: usize,
    rank: usize,
) -> Result<DeviceBuffer, EpError> {
    use cudarc::driver::sys;
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid in/out pointer; the previous mode is restored below.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
        .result()
        .map_err(|source| EpError::Cuda {
            rank,
            call: "cuThreadExchangeStreamCaptureMode",
            source,
        })?;
    let b = DeviceBuffer::new(ctx, bytes).map_err(|source| EpError::Device { rank, source });
    // SAFETY: as above; `mode` now holds the thread's previous mode.
    let restored = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result();
    restored.map_err(|source| EpError::Cuda {
        rank,
        call: "cuThreadExchangeStreamCaptureMode",
        source,
    })?;
    b
}

impl InternodeBuffer {
    /// The pools, allocated on first use.
    fn worst_pools(&mut self) -> Result<&WorstPools, EpError> {
        if self.worst.is_none() {
            let o = &self.opts.buffer;
            let cap = o.max_tokens_per_rank;
            let layout_bytes = self
                .intra
                .layout_sections(cap)
                .ok_or_else(|| invalid(self.rank, "the NVLink hop's layout size overflows"))?[5];
            let plan = WorstPlan::new(
                self.topo.world(),
                cap,
                o.max_hidden,
                o.max_topk,
                self.num_local_experts(),
                self.topo.nodes(),
                layout_bytes,
            )
            .ok_or_else(|| invalid(self.rank, "the num_worst_tokens outputs' size overflows"))?;
            let n = o.max_live_outputs.max(1);
            let total = |b: usize| {
                b.checked_mul(n)
                    .ok_or_else(|| invalid(self.rank, "the num_worst_tokens pools overflow"))
            };
            let d = Arc::new(alloc_relaxed(&self.ctx, total(plan.bytes)?, self.rank)?);
            let c = Arc::new(alloc_relaxed(&self.ctx, total(plan.c_bytes)?, self.rank)?);
            self.worst = Some(WorstPools {
                dispatch: RegionPool::new("internode dispatch output", &d, 0, plan.bytes, n),
                combine: RegionPool::new("internode combine output", &c, 0, plan.c_bytes, n),
                plan,
            });
        }
        Ok(self.worst.as_ref().expect("just set"))
    }

    /// The NVLink hop's fixed rows per source node: the output's rows, at most what one of its
    /// regions holds.
    fn block_rows(&self, w: usize) -> usize {
        w.min(self.intra.region_layout().1)
    }

    /// A free dispatch region of the `num_worst_tokens` pool, and the plan it is laid out by.
    fn worst_dispatch_region(&mut self) -> Result<(Arc<Region>, WorstPlan), EpError> {
        let rank = self.rank;
        let pools = self.worst_pools()?;
        Ok((pools.dispatch.acquire(rank)?, pools.plan.clone()))
    }

    /// Dispatch with `num_worst_tokens = w` (checked by the caller): no host wait.
    pub(super) fn dispatch_worst(
        &mut self,
        args: &InternodeDispatchArgs<'_>,
        rows: &Rows,
        kk: usize,
        w: usize,
    ) -> Result<InternodeDispatchOutput, EpError> {
        let capturing = self.is_capturing()?;
        let (region, plan) = self.worst_dispatch_region()?;
        let block = self.block_rows(w);
        let r = self.dispatch_worst_queued(args, rows, kk, w, region, plan, block, capturing);
        self.poison_on_err(r)
    }

    /// The part of [`dispatch_worst`](Self::dispatch_worst) that queues work.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_worst_queued(
        &mut self,
        args: &InternodeDispatchArgs<'_>,
        rows: &Rows,
        kk: usize,
        w: usize,
        region: Arc<Region>,
        plan: WorstPlan,
        block: usize,
        capturing: bool,
    ) -> Result<InternodeDispatchOutput, EpError> {
        let layout = args.layout;
        self.phase_begin("dispatch")?;
        self.start(&args.order, capturing)?;
        self.poison_dispatch(&region, &plan, w, rows, kk)?;
        self.phase("start", PhaseInfo::default())?;
        let recv = region.ptr() + plan.counts as u64;
        self.queue_rdma_dispatch(
            &args.x,
            rows,
            Some(&args.topk),
            &layout.node_pos,
            layout.tokens_per_node.device_address(),
            &layout.node_counts,
            layout.invalid,
            recv,
            false,
        )?;
        self.launch_recv_prep(recv, kk)?;
        let fp8 = matches!(args.x, DispatchX::Fp8 { .. });
        let cfg = self.intra_config();
        let cap = self.plan.cap;
        let mut parts = Vec::with_capacity(self.nodes());
        for n in 0..self.nodes() {
            let (input, topk) = self.forwarder_input(n, cap, rows, fp8, kk);
            let (idx, wts) = topk.expect("top-k is given");
            let ev = self.fork()?;
            let l = self.intra.dispatch_layout_on_device(
                &idx,
                &region,
                plan.layout_at(n),
                &intra_order(&ev),
            )?;
            let out = self.intra.dispatch(&DispatchArgs {
                x: input.as_x(),
                layout: &l,
                topk: Some(TopK {
                    idx: &idx,
                    weights: &wts,
                }),
                num_worst_tokens: Some(block),
                expert_alignment: 1,
                config: cfg,
                order: intra_order(&ev),
            })?;
            self.join(&out.event)?;
            self.phase("nvl dispatch", PhaseInfo::node(n, 0))?;
            parts.push(out.handle);
        }
        self.launch_gather(
            &parts,
            &region,
            &plan,
            w,
            rows,
            kk,
            args.expert_alignment,
            block,
        )?;
        self.phase("gather", PhaseInfo::default())?;
        self.ack(Words::DispatchAck)?;
        self.phase("ack", PhaseInfo::default())?;
        let event = self.finish(&args.order, capturing)?;
        self.phase("finish", PhaseInfo::default())?;
        let local = self.num_local_experts();
        let (x, topk_idx, topk_weights) = outputs(&region, &plan, w, rows, fp8, kk);
        Ok(InternodeDispatchOutput {
            x,
            topk_idx,
            topk_weights,
            num_recv_tokens: w,
            num_recv_tokens_per_expert: None,
            recv_tokens_per_expert: Some(Tensor::view(region.clone(), plan.experts, vec![local])),
            handle: InternodeHandle {
                buffer_id: self.id,
                node_pos: layout.node_pos.clone(),
                node_counts: layout.node_counts.clone(),
                recv_counts: Vec::new(),
                sub: parts,
                block_rows: Vec::new(),
                num_tokens: rows.tokens,
                rows: w,
                tokens_per_node: layout.tokens_per_node.clone(),
                recv_dev: Tensor::view(region.clone(), plan.counts, vec![k::MAX_NODES]),
                worst: Some(WorstHandle { block }),
                _held: Vec::new(),
            },
            event,
        })
    }

    /// Cached dispatch over a `num_worst_tokens` handle: no host wait.
    pub(super) fn dispatch_cached_worst(
        &mut self,
        x: DispatchX<'_>,
        handle: &InternodeHandle,
        rows: &Rows,
        order: &StreamOrder<'_>,
    ) -> Result<InternodeDispatchOutput, EpError> {
        let capturing = self.is_capturing()?;
        let (region, plan) = self.worst_dispatch_region()?;
        let r = self.dispatch_cached_worst_queued(x, handle, rows, order, region, plan, capturing);
        self.poison_on_err(r)
    }

    /// The part of [`dispatch_cached_worst`](Self::dispatch_cached_worst) that queues work.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_cached_worst_queued(
        &mut self,
        x: DispatchX<'_>,
        handle: &InternodeHandle,
        rows: &Rows,
        order: &StreamOrder<'_>,
        region: Arc<Region>,
        plan: WorstPlan,
        capturing: bool,
    ) -> Result<InternodeDispatchOutput, EpError> {
        let wh = handle.worst.as_ref().expect("a num_worst_tokens handle");
        let w = handle.rows;
        self.phase_begin("cached dispatch")?;
        self.start(order, capturing)?;
        self.poison_dispatch(&region, &plan, w, rows, 0)?;
        self.phase("start", PhaseInfo::default())?;
        let recv = region.ptr() + plan.counts as u64;
        self.queue_rdma_dispatch(
            &x,
            rows,
            None,
            &handle.node_pos,
            handle.tokens_per_node.device_address(),
            &handle.node_counts,
            0,
            recv,
            false,
        )?;
        let fp8 = matches!(x, DispatchX::Fp8 { .. });
        let cfg = self.intra_config();
        let cap = self.plan.cap;
        let mut parts = Vec::with_capacity(self.nodes());
        for n in 0..self.nodes() {
            let (input, _) = self.forwarder_input(n, cap, rows, fp8, 0);
            let out = self.intra_dispatch_cached_forked(input.as_x(), &handle.sub[n], &cfg)?;
            self.phase("nvl dispatch", PhaseInfo::node(n, 0))?;
            parts.push(out.handle);
        }
        self.launch_gather(&parts, &region, &plan, w, rows, 0, 1, wh.block)?;
        self.phase("gather", PhaseInfo::default())?;
        self.ack(Words::DispatchAck)?;
        self.phase("ack", PhaseInfo::default())?;
        let event = self.finish(order, capturing)?;
        self.phase("finish", PhaseInfo::default())?;
        let (x, _, _) = outputs(&region, &plan, w, rows, fp8, 0);
        Ok(InternodeDispatchOutput {
            x,
            topk_idx: None,
            topk_weights: None,
            num_recv_tokens: w,
            num_recv_tokens_per_expert: None,
            recv_tokens_per_expert: None,
            // The NVLink hop's regions of this call stay with the output: a graph that captured
            // it rewrites them at every replay.
            handle: InternodeHandle {
                _held: parts,
                ..handle.clone()
            },
            event,
        })
    }

    /// Poisons the output sections a dispatch of `w` rows writes.
    fn poison_dispatch(
        &self,
        region: &Region,
        plan: &WorstPlan,
        w: usize,
        rows: &Rows,
        kk: usize,
    ) -> Result<(), EpError> {
        if !self.opts.buffer.poison_outputs {
            return Ok(());
        }
        let b = region.ptr();
        self.memset(b + plan.x as u64, 0xAB, w * rows.row_bytes)?;
        self.memset(
            b + plan.scales as u64,
            0xAB,
            bytes_of::<f32>(w * rows.scale_words),
        )?;
        self.memset(b + plan.ids as u64, 0xAB, bytes_of::<i32>(w * kk))?;
        self.memset(b + plan.w as u64, 0xAB, bytes_of::<f32>(w * kk))?;
        self.memset(
            b + plan.experts as u64,
            0xAB,
            bytes_of::<i32>(self.num_local_experts()),
        )
    }

    /// Ids -1 past each node's received count in its dispatch receive slot.
    fn launch_recv_prep(&self, counts: u64, kk: usize) -> Result<(), EpError> {
        let mut slot = [0u64; k::MAX_NODES];
        for (n, s) in slot.iter_mut().enumerate().take(self.nodes()) {
            *s = self.base + self.plan.d_recv_slot(n) as u64;
        }
        let p = k::PrepParams {
            slot,
            counts,
            off_idx: self.plan.d_idx as u64,
            off_w: self.plan.d_w as u64,
            nodes: self.nodes() as i32,
            topk: kk as i32,
            cap: self.plan.cap as i32,
            pad: 0,
        };
        self.launch(
            &self.kernels.recv_prep,
            self.nodes() as u32,
            k::THREADS,
            0,
            &p,
            "cuLaunchKernel(ep_internode_recv_prep)",
        )
    }

    /// Concatenates the NVLink hop's per-node blocks (`parts`' regions) into the output.
    #[allow(clippy::too_many_arguments)]
    fn launch_gather(
        &self,
        parts: &[crate::intranode::Handle],
        region: &Region,
        plan: &WorstPlan,
        w: usize,
        rows: &Rows,
        kk: usize,
        alignment: usize,
        block: usize,
    ) -> Result<(), EpError> {
        let (l, _) = self.intra.region_layout();
        let mut p = k::GatherParams {
            out_x: region.ptr() + plan.x as u64,
            out_scales: if rows.scale_words > 0 {
                region.ptr() + plan.scales as u64
            } else {
                0
            },
            out_ids: if kk > 0 {
                region.ptr() + plan.ids as u64
            } else {
                0
            },
            out_w: if kk > 0 {
                region.ptr() + plan.w as u64
            } else {
                0
            },
            out_experts: if kk > 0 {
                region.ptr() + plan.experts as u64
            } else {
                0
            },
            error: self.errors.kernel_addr(),
            meta_num_recv: std::mem::offset_of!(ik::Meta, num_recv) as u64,
            meta_experts: std::mem::size_of::<ik::Meta>() as u64,
            nodes: self.nodes() as i32,
            rows: w as i32,
            row_bytes: rows.row_bytes as i32,
            scale_words: rows.scale_words as i32,
            topk: kk as i32,
            experts: self.num_local_experts() as i32,
            alignment: alignment as i32,
            region_cap: block as i32,
            rank: self.rank as i32,
            ..Default::default()
        };
        for (n, h) in parts.iter().enumerate() {
            let b = h.region().ptr();
            p.meta[n] = b;
            p.x[n] = b + l.x;
            if rows.scale_words > 0 {
                p.scales[n] = b + l.scales;
            }
            if kk > 0 {
                p.ids[n] = b + l.topk_idx;
                p.w[n] = b + l.topk_weights;
            }
        }
        let warps = (k::THREADS / 32) as usize;
        self.launch(
            &self.kernels.gather,
            w.div_ceil(warps).clamp(1, 264) as u32,
            k::THREADS,
            0,
            &p,
            "cuLaunchKernel(ep_internode_gather)",
        )
    }

    /// A pooled combine output of `t` rows.
    pub(super) fn worst_combine_outputs(
        &mut self,
        t: usize,
        hidden: usize,
        kk: usize,
    ) -> Result<(Tensor<Bf16>, Option<Tensor<f32>>), EpError> {
        let rank = self.rank;
        let pools = self.worst_pools()?;
        let region = pools.combine.acquire(rank)?;
        let c_w = pools.plan.c_w;
        let w = (kk > 0).then(|| Tensor::view(region.clone(), c_w, vec![t, kk]));
        Ok((Tensor::view(region, 0, vec![t, hidden]), w))
    }

    /// The NVLink hop of a `num_worst_tokens` combine: the input split back into the dispatch's
    /// per-node blocks, then the intranode combine of each; returns each node's sums.
    pub(super) fn worst_nvlink_combine(
        &mut self,
        args: &InternodeCombineArgs<'_>,
        wh: &WorstHandle,
        hidden: usize,
        kk: usize,
    ) -> Result<Vec<CombineOutput>, EpError> {
        let h = args.handle;
        let (l, _) = self.intra.region_layout();
        let mut p = k::ScatterParams {
            in_x: args.x.device_address(),
            in_w: args.topk_weights.map_or(0, |t| t.device_address()),
            meta_num_recv: std::mem::offset_of!(ik::Meta, num_recv) as u64,
            nodes: self.nodes() as i32,
            rows: h.rows as i32,
            hidden: hidden as i32,
            topk: kk as i32,
            region_cap: wh.block as i32,
            ..Default::default()
        };
        for (n, s) in h.sub.iter().enumerate() {
            let b = s.region().ptr();
            p.meta[n] = b;
            p.x[n] = b + l.x;
            if kk > 0 {
                p.w[n] = b + l.topk_weights;
            }
        }
        let warps = (k::THREADS / 32) as usize;
        self.launch(
            &self.kernels.scatter,
            h.rows.div_ceil(warps).clamp(1, 264) as u32,
            k::THREADS,
            0,
            &p,
            "cuLaunchKernel(ep_internode_scatter)",
        )?;
        let cfg = self.intra_config();
        let mut sums = Vec::with_capacity(h.sub.len());
        for s in &h.sub {
            let x = Tensor::<Bf16>::view(s.region().clone(), l.x as usize, vec![wh.block, hidden]);
            let w = (kk > 0).then(|| {
                Tensor::<f32>::view(
                    s.region().clone(),
                    l.topk_weights as usize,
                    vec![wh.block, kk],
                )
            });
            sums.push(self.intra_combine_forked(&x, s, w.as_ref(), cfg)?);
        }
        Ok(sums)
    }

    /// Each node's sums into its combine stage slot (this rank's node: its receive slot), as
    /// many rows as that node's rail peer sent at dispatch (a device count).
    pub(super) fn launch_stage(
        &self,
        sums: &[CombineOutput],
        h: &InternodeHandle,
        hidden: usize,
        kk: usize,
    ) -> Result<(), EpError> {
        let me = self.my_node();
        let mut p = k::StageParams {
            off_w: self.plan.c_w as u64,
            counts: h.recv_dev.device_address(),
            nodes: self.nodes() as i32,
            hidden: hidden as i32,
            topk: kk as i32,
            cap: self.plan.cap as i32,
            ..Default::default()
        };
        for (n, s) in sums.iter().enumerate() {
            p.src_x[n] = s.x.device_address();
            p.src_w[n] = s.topk_weights.as_ref().map_or(0, |w| w.device_address());
            p.dst[n] = self.base
                + if n == me {
                    self.plan.c_recv_slot(n)
                } else {
                    self.plan.c_stage_slot(n)
                } as u64;
        }
        let warps = (k::THREADS / 32) as usize;
        let blocks = self.plan.cap.div_ceil(warps).clamp(1, 132) as u32;
        // The NVLink hop's outputs are held in `sums` until the caller has queued its put.
        self.launch(
            &self.kernels.stage,
            blocks,
            k::THREADS,
            0,
            &p,
            "cuLaunchKernel(ep_internode_stage)",
        )
    }
}

/// The dispatch output views of a pooled region: `w` rows.
fn outputs(
    region: &Arc<Region>,
    plan: &WorstPlan,
    w: usize,
    rows: &Rows,
    fp8: bool,
    kk: usize,
) -> (RecvX, Option<Tensor<i32>>, Option<Tensor<f32>>) {
    let x = if fp8 {
        RecvX::Fp8 {
            x: Tensor::<Fp8E4M3>::view(region.clone(), plan.x, vec![w, rows.hidden]),
            scales: Tensor::view(region.clone(), plan.scales, vec![w, rows.scale_words]),
        }
    } else {
        RecvX::Bf16(Tensor::<Bf16>::view(
            region.clone(),
            plan.x,
            vec![w, rows.hidden],
        ))
    };
    let ids = (kk > 0).then(|| Tensor::view(region.clone(), plan.ids, vec![w, kk]));
    let wts = (kk > 0).then(|| Tensor::view(region.clone(), plan.w, vec![w, kk]));
    (x, ids, wts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_regions_hold_every_section_aligned_and_apart() {
        for (world, cap, h, kk, local, nodes, lb) in [
            (2, 96, 1024, 6, 4, 2, 1000),
            (8, 4096, 7168, 8, 32, 4, 12345),
            (4, 1, 8, 1, 1, 2, 1),
        ] {
            let p = WorstPlan::new(world, cap, h, kk, local, nodes, lb).unwrap();
            let rows = world * cap;
            let starts = [p.x, p.scales, p.ids, p.w, p.experts, p.counts, p.layouts];
            assert!(starts.iter().all(|s| s % ALIGN == 0), "{p:?}");
            assert!(starts.windows(2).all(|w| w[0] <= w[1]));
            assert!(p.scales - p.x >= rows * h * 2, "BF16 rows of max_hidden");
            assert!(p.ids - p.scales >= rows * h.div_ceil(128) * 4);
            assert!(p.w - p.ids >= rows * kk * 4 && p.experts - p.w >= rows * kk * 4);
            assert!(p.counts - p.experts >= local * 4);
            assert!(p.layouts - p.counts >= 4 * k::MAX_NODES);
            assert!(p.layout_bytes >= lb && p.layout_bytes % ALIGN == 0);
            assert_eq!(p.layout_at(nodes - 1) + p.layout_bytes, p.bytes);
            assert!(p.c_w >= cap * h * 2 && p.c_bytes - p.c_w >= cap * kk * 4);
            assert_eq!(p.c_bytes % ALIGN, 0);
            assert_eq!(p.bytes % ALIGN, 0, "pool slots stay aligned");
        }
        assert!(WorstPlan::new(usize::MAX / 2, 4, 8, 1, 1, 2, 1).is_none());
        assert!(WorstPlan::new(2, 4, usize::MAX / 4, 1, 1, 2, 1).is_none());
    }
}
