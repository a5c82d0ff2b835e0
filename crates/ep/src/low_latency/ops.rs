//! The operations: dispatch, combine, the shrink masks, clean and synchronize.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use cudarc::driver::sys;
use ep_kernels::low_latency as k;
use ibgda_device::cuda::DeviceBuffer;

use super::args::{
    LlCombineArgs, LlCombineOutput, LlCombineX, LlDispatchArgs, LlDispatchOutput, LlHandle,
    LlRecvInto, LlRecvX, LlScales,
};
use super::hook::{HookParams, RecvHook};
use super::launch::launch;
use super::plan::msg_bytes;
use super::setup::LowLatencyBuffer;
use crate::dtype::Bf16;
use crate::error::{invalid, EpError};
use crate::event::Event;
use crate::mask::RankMask;
use crate::tensor::Tensor;

impl LowLatencyBuffer {
    fn transport_table(&self) -> u64 {
        self.transport.as_ref().map_or(0, |t| t.table.ptr())
    }

    fn mask_addr(&self) -> u64 {
        self.mask.as_ref().map_or(0, RankMask::addr)
    }

    /// What a hook keeps alive, the mask included (its kernel reads it).
    fn keep_with_mask(&self, mut keep: Vec<Arc<DeviceBuffer>>) -> Vec<Arc<DeviceBuffer>> {
        keep.extend(self.mask.as_ref().map(RankMask::keep));
        keep
    }

    fn shrink_mask(&self, what: &str) -> Result<&RankMask, EpError> {
        self.usable()?;
        self.mask.as_ref().ok_or_else(|| {
            invalid(
                self.rank,
                format!("{what} needs a buffer built with enable_shrink (rank masks)"),
            )
        })
    }

    /// Masks (`true`) or unmasks `rank` on this rank (DeepEP's
    /// `low_latency_update_mask_buffer`), ordered on [`stream`](Self::stream): later operations
    /// send nothing to it and treat what it sends as absent. Needs `enable_shrink`. Not a
    /// collective: each rank masks whom it likes.
    pub fn update_mask(&mut self, rank: usize, masked: bool) -> Result<(), EpError> {
        self.shrink_mask("update_mask")?
            .update(&self.stream, rank, masked)
    }

    /// Copies who is masked on this rank (`i32 [ranks]`, 1 = masked: by the caller, or because a
    /// wait on it ran out of time) into `mask_status`, ordered on [`stream`](Self::stream)
    /// (DeepEP's `low_latency_query_mask_buffer`). Needs `enable_shrink`.
    pub fn query_mask(&mut self, mask_status: &Tensor<i32>) -> Result<(), EpError> {
        self.shape_is(mask_status, &[self.ranks], "mask_status")?;
        self.shrink_mask("query_mask")?
            .query_into(&self.stream, mask_status)
    }

    /// Who is masked on this rank, after everything queued so far (waits, bounded, for the
    /// stream).
    pub fn mask_status(&mut self) -> Result<Vec<i32>, EpError> {
        let t = Tensor::filled(&self.ctx, 0i32, &[self.ranks])?;
        self.query_mask(&t)?;
        self.synchronize()?;
        t.to_host()
    }

    /// Unmasks every rank on this rank, ordered on [`stream`](Self::stream) (DeepEP's
    /// `low_latency_clean_mask_buffer`). Needs `enable_shrink`.
    pub fn clean_mask(&mut self) -> Result<(), EpError> {
        self.shrink_mask("clean_mask")?.clean(&self.stream)
    }

    /// Where zero-copy combine takes the expert outputs from: BF16
    /// `[local][ranks × max tokens][hidden]`, rows as the dispatch packed them. Write it (on the
    /// buffer's stream, or ordered before the combine), then combine with
    /// [`LlCombineX::ZeroCopy`].
    pub fn combine_input(&self, hidden: usize) -> Result<Tensor<Bf16>, EpError> {
        self.check_hidden(hidden, 8, "combine hidden")?;
        Ok(Tensor::view(
            self.net.clone(),
            self.net_plan.comb_send,
            vec![self.dims.local(), self.dims.cap(), hidden],
        ))
    }

    /// Sends each token to the ranks of its top-k experts and (without a hook) receives the
    /// tokens sent to this rank's experts. All ranks call this together.
    pub fn dispatch(&mut self, args: &LlDispatchArgs<'_>) -> Result<LlDispatchOutput, EpError> {
        self.usable()?;
        let (t, h) = (args.x.dim(0), args.x.dim(1));
        if args.x.shape().len() != 2 {
            return Err(invalid(
                self.rank,
                format!(
                    "x has shape {:?}, expected [tokens, hidden]",
                    args.x.shape()
                ),
            ));
        }
        self.shape_is(args.x, &[t, h], "x")?;
        if t > self.opts.max_tokens_per_rank {
            return Err(invalid(
                self.rank,
                format!(
                    "{t} tokens, more than max_tokens_per_rank {}",
                    self.opts.max_tokens_per_rank
                ),
            ));
        }
        let kk = args.topk_idx.dim(1);
        if kk == 0 || kk > self.opts.max_topk {
            return Err(invalid(
                self.rank,
                format!("top-{kk}: expected 1..={}", self.opts.max_topk),
            ));
        }
        self.shape_is(args.topk_idx, &[t, kk], "topk_idx")?;
        let fp8 = args.fp8;
        let ue8m0 = fp8.is_some_and(|f| f.ue8m0);
        let multiple = match fp8 {
            None => 8,
            Some(_) if ue8m0 => 4 * k::FP8_BLOCK,
            Some(_) => k::FP8_BLOCK,
        };
        self.check_hidden(h, multiple, "hidden")?;
        if let Some(s) = args.wait_stats {
            self.shape_is(s, &[self.ranks], "dispatch_wait_recv_cost_stats")?;
        }
        let (l, cap) = (self.dims.local(), self.dims.cap());
        let x_into = self.check_recv_into(args.recv_into, fp8.is_some(), &[l, cap, h])?;
        if let Some(c) = args.recv_count_into {
            self.shape_is(c, &[l], "recv_count_into")?;
            self.writable(c.is_read_only(), "recv_count_into")?;
        }
        let grid = self.grid("low-latency dispatch", args.num_sms)?;

        let half = self.dispatch_half;
        self.free_half(
            &self.dispatch_out[half],
            "low-latency dispatch output (half)",
        )?;
        let region = self.dispatch_out[half].clone();
        self.poison(&region)?;
        let o = self.out_plan;
        let base = region.ptr();
        let p = k::LlDispatchParams {
            peer_base: self.peer_base,
            x: args.x.device_address(),
            topk_idx: args.topk_idx.device_address(),
            state: self.state.ptr(),
            out_x: x_into.unwrap_or(base + o.x as u64),
            out_scales: if fp8.is_some() {
                base + o.scales as u64
            } else {
                0
            },
            out_src_info: base + o.src_info as u64,
            out_layout: base + o.layout as u64,
            out_count: args
                .recv_count_into
                .map_or(base + o.count as u64, Tensor::device_address),
            out_topk: base + o.topk as u64,
            error: self.errors.kernel_addr(),
            timeout_ns: self.timeout_ns(),
            signal_off: self.net_plan.signal[half] as u64,
            recv_off: self.net_plan.recv[half] as u64,
            transport: self.transport_table(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            num_tokens: t as i32,
            max_tokens: self.opts.max_tokens_per_rank as i32,
            hidden: h as i32,
            topk: kk as i32,
            num_experts: self.opts.num_experts as i32,
            num_local: self.dims.local() as i32,
            phases: k::phase::SEND
                | if args.return_recv_hook {
                    0
                } else {
                    k::phase::RECV
                },
            fp8: i32::from(fp8.is_some()),
            round_scale: i32::from(fp8.is_some_and(|f| f.round_scale || f.ue8m0)),
            ue8m0: i32::from(ue8m0),
            msg_bytes: msg_bytes(h, fp8.is_some()) as i32,
            half: half as i32,
            mask: self.mask_addr(),
            wait_stats: args.wait_stats.map_or(0, Tensor::device_address),
        };
        let launched = launch(
            self.gate(),
            &self.stream,
            &self.dispatch_fn,
            grid,
            &p,
            self.rank,
            "cuLaunchKernel(ep_ll_dispatch)",
        );
        self.poison_on_gate_timeout(launched)?;
        self.dispatch_half ^= 1;
        self.calls += 1;

        let x = match (fp8, args.recv_into) {
            (None, Some(LlRecvInto::Bf16(t))) => LlRecvX::Bf16(t.clone()),
            (None, _) => LlRecvX::Bf16(Tensor::view(region.clone(), o.x, vec![l, cap, h])),
            (Some(_), into) => LlRecvX::Fp8 {
                x: match into {
                    Some(LlRecvInto::Fp8(t)) => t.clone(),
                    _ => Tensor::view(region.clone(), o.x, vec![l, cap, h]),
                },
                scales: if ue8m0 {
                    LlScales::Ue8m0(Tensor::view(
                        region.clone(),
                        o.scales,
                        vec![l, cap, h / (4 * k::FP8_BLOCK)],
                    ))
                } else {
                    LlScales::F32(Tensor::view(
                        region.clone(),
                        o.scales,
                        vec![l, cap, h / k::FP8_BLOCK],
                    ))
                },
            },
        };
        let mut recv = p;
        recv.phases = k::phase::RECV;
        let received = Arc::new(AtomicBool::new(!args.return_recv_hook));
        let hook = args.return_recv_hook.then(|| RecvHook {
            params: HookParams::Dispatch(recv),
            received: Some(received.clone()),
            func: self.dispatch_fn.clone(),
            stream: self.stream.clone(),
            grid,
            rank: self.rank,
            gate: self.gate_for_hook(),
            _keep: self.keep_with_mask(vec![region.clone(), self.net.clone(), self.state.clone()]),
            _keep_routing: None,
            _keep_stats: args.wait_stats.cloned(),
            _mapped: self.mapped.clone(),
            _errors: self.errors.clone(),
        });
        Ok(LlDispatchOutput {
            x,
            recv_count: args.recv_count_into.map_or_else(
                || Tensor::view(region.clone(), o.count, vec![l]),
                Tensor::clone,
            ),
            handle: LlHandle {
                buffer_id: self.id,
                src_info: Tensor::view(region.clone(), o.src_info, vec![l, cap]).read_only(),
                layout_range: Tensor::view(region.clone(), o.layout, vec![l, self.ranks, 2])
                    .read_only(),
                region,
                topk: kk,
                received,
                num_tokens: t,
                hidden: h,
            },
            hook,
        })
    }

    /// Sends every expert output back to the rank its token came from, which sums them weighted
    /// by its top-k weights. All ranks call this together.
    pub fn combine(&mut self, args: &LlCombineArgs<'_>) -> Result<LlCombineOutput, EpError> {
        self.usable()?;
        let hd = args.handle;
        if hd.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "handle",
            });
        }
        if !hd.is_received() {
            return Err(invalid(
                self.rank,
                "combine over a hook-mode dispatch whose receive hook was never called: its \
                 routing was never written (call the dispatch's RecvHook first)",
            ));
        }
        let (l, cap, t) = (self.dims.local(), self.dims.cap(), hd.num_tokens);
        let (x_addr, h) = match args.x {
            LlCombineX::Tensor(x) => {
                let h = x.dim(2);
                self.check_hidden(h, 8, "combine hidden")?;
                self.shape_is(x, &[l, cap, h], "x")?;
                (x.device_address(), h)
            }
            LlCombineX::ZeroCopy => {
                let h = hd.hidden;
                self.check_hidden(h, 8, "combine hidden")?;
                (self.net.ptr() + self.net_plan.comb_send as u64, h)
            }
        };
        let kk = args.topk_idx.dim(1);
        if kk != hd.topk {
            return Err(invalid(
                self.rank,
                format!(
                    "combine top-{kk}: the dispatch was top-{} (pass its topk_idx)",
                    hd.topk
                ),
            ));
        }
        self.shape_is(args.topk_idx, &[t, kk], "topk_idx")?;
        self.shape_is(args.topk_weights, &[t, kk], "topk_weights")?;
        if let Some(s) = args.wait_stats {
            self.shape_is(s, &[self.ranks], "combine_wait_recv_cost_stats")?;
        }
        if args.use_logfmt {
            if matches!(args.x, LlCombineX::ZeroCopy) {
                return Err(invalid(
                    self.rank,
                    "use_logfmt with zero-copy: the rows are encoded where zero-copy keeps its \
                     input (as in DeepEP, LogFMT needs x given)",
                ));
            }
            self.check_hidden(h, k::LOGFMT_GROUP, "LogFMT combine hidden")?;
        }
        if let Some(o) = args.out_into {
            self.shape_is(o, &[t, h], "out_into")?;
            self.writable(o.is_read_only(), "out_into")?;
            if o.device_address() % 16 != 0 {
                return Err(invalid(
                    self.rank,
                    format!(
                        "out_into at {:#x} is not 16-byte aligned",
                        o.device_address()
                    ),
                ));
            }
        }
        let grid = self.grid("low-latency combine", args.num_sms)?;

        let half = self.combine_half;
        self.free_half(&self.combine_out[half], "low-latency combine output (half)")?;
        let out = self.combine_out[half].clone();
        self.poison(&out)?;
        let p = k::LlCombineParams {
            peer_base: self.peer_base,
            x: x_addr,
            src_info: hd.src_info.device_address(),
            layout: hd.layout_range.device_address(),
            topk_idx: args.topk_idx.device_address(),
            topk_weights: args.topk_weights.device_address(),
            dispatch_topk: hd.region.ptr() + self.out_plan.topk as u64,
            out: args.out_into.map_or(out.ptr(), Tensor::device_address),
            state: self.state.ptr(),
            error: self.errors.kernel_addr(),
            timeout_ns: self.timeout_ns(),
            flag_off: self.net_plan.flag[half] as u64,
            recv_off: self.net_plan.comb_recv[half] as u64,
            transport: self.transport_table(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            num_tokens: t as i32,
            max_tokens: self.opts.max_tokens_per_rank as i32,
            hidden: h as i32,
            topk: kk as i32,
            num_experts: self.opts.num_experts as i32,
            num_local: l as i32,
            phases: k::phase::SEND
                | if args.return_recv_hook {
                    0
                } else {
                    k::phase::RECV
                },
            half: half as i32,
            mask: self.mask_addr(),
            wait_stats: args.wait_stats.map_or(0, Tensor::device_address),
            logfmt_stage: if args.use_logfmt {
                self.net.ptr() + self.net_plan.comb_send as u64
            } else {
                0
            },
        };
        let launched = launch(
            self.gate(),
            &self.stream,
            &self.combine_fn,
            grid,
            &p,
            self.rank,
            "cuLaunchKernel(ep_ll_combine)",
        );
        self.poison_on_gate_timeout(launched)?;
        self.combine_half ^= 1;
        self.calls += 1;
        let mut recv = p;
        recv.phases = k::phase::RECV;
        let hook = args.return_recv_hook.then(|| RecvHook {
            params: HookParams::Combine(recv),
            received: None,
            func: self.combine_fn.clone(),
            stream: self.stream.clone(),
            grid,
            rank: self.rank,
            gate: self.gate_for_hook(),
            // The dispatch's region too: the receive reads its top-k ids.
            _keep: self.keep_with_mask(vec![
                out.clone(),
                self.net.clone(),
                self.state.clone(),
                hd.region.clone(),
            ]),
            _keep_routing: Some((args.topk_idx.clone(), args.topk_weights.clone())),
            _keep_stats: args.wait_stats.cloned(),
            _mapped: self.mapped.clone(),
            _errors: self.errors.clone(),
        });
        Ok(LlCombineOutput {
            x: args
                .out_into
                .map_or_else(|| Tensor::view(out, 0, vec![t, h]), Tensor::clone),
            hook,
        })
    }

    /// Resets the signals, flags and sequence numbers of every rank (DeepEP's
    /// `clean_low_latency_buffer`): a collective of all ranks. Waits (bounded) for this rank's
    /// work, meets every rank, zeroes this rank's signal words and state, waits for that, and
    /// meets again, so no rank signals a peer before every peer has cleaned. Masks are kept.
    /// Afterwards the buffer is as new (outputs and handles of earlier operations stay valid
    /// for reading, but combine refuses nothing: do not combine across a clean). A rank masked
    /// and unmasked again while it missed operations is back in step after a clean.
    pub fn clean(&mut self) -> Result<(), EpError> {
        self.usable()?;
        self.synchronize()?;
        self.group.all_gather(&[])?;
        let rank = self.rank;
        let cuda = |call, source| EpError::Cuda { rank, call, source };
        // The dispatch signals and combine flags of both halves come first in the net buffer
        // (NetPlan takes them first), the receive rows after them.
        let signals = self.net_plan.recv[0];
        // SAFETY: the first `signals` bytes of this rank's live net buffer and the whole state
        // allocation, ordered on this buffer's stream; every rank's work has finished (synchronized
        // above, then met), so no kernel or NIC writes into them meanwhile.
        unsafe {
            sys::cuMemsetD8Async(self.net.ptr(), 0, signals, self.stream.cu_stream())
                .result()
                .map_err(|e| cuda("cuMemsetD8Async (clean signals)", e))?;
            sys::cuMemsetD8Async(
                self.state.ptr(),
                0,
                self.state.len(),
                self.stream.cu_stream(),
            )
            .result()
            .map_err(|e| cuda("cuMemsetD8Async (clean state)", e))?;
        }
        self.synchronize()?;
        self.group.all_gather(&[])?;
        Ok(())
    }

    /// Reports, without waiting, an error that kernels of earlier operations recorded (a wait
    /// that ran out of time without shrink, a transport failure, an id out of range): after
    /// one, the outputs of that operation and of those queued after it are incomplete, and the
    /// buffer is unusable. Dispatch and combine end without a host wait, so such errors wait
    /// for the caller: [`synchronize`](Self::synchronize) waits and reports them; this reads
    /// host memory only and may precede every operation (errors of work still queued are not
    /// seen yet).
    pub fn check_errors(&mut self) -> Result<(), EpError> {
        self.usable()?;
        self.check_device_error()
    }

    /// Waits (bounded) until everything queued on the buffer's stream has run, then reports any
    /// error the kernels recorded.
    pub fn synchronize(&mut self) -> Result<(), EpError> {
        let e = Event::record(&self.stream, self.rank)?;
        let r = e.wait_host(
            self.opts.timeout.saturating_mul(2),
            "the low-latency stream",
        );
        self.check_device_error()?;
        r
    }
}
