//! The operations: dispatch layout, dispatch (fresh and cached) and combine.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ep_kernels::intranode as k;
use ibgda_device::cuda::DeviceBuffer;

use crate::config::Config;
use crate::dtype::Element;
use crate::error::{invalid, EpError};
use crate::event::backoff;
use crate::tensor::{Region, Tensor};

use super::args::{
    CombineArgs, CombineOutput, DispatchArgs, DispatchLayout, DispatchOutput, DispatchX, Handle,
    RecvX, StreamOrder, TopK,
};
use super::errors::{check_expert_alignment, clamp_count, layout_invalid_error};
use super::plan::{product, Sections, FP8_BLOCK, HOST_INFO_OFFSET};
use super::setup::Buffer;

/// The layout kernel's parameters over `topk_idx` (`[tokens][k]`) for `ranks` destinations and
/// `experts` experts, its outputs in the sections at `at` (offsets from `base`, a device
/// address): tokens per rank, tokens per expert, the invalid-id report, token-in-rank flags,
/// send positions.
pub(crate) fn layout_params(
    topk_idx: &Tensor<i32>,
    base: u64,
    at: [usize; 5],
    ranks: usize,
    experts: usize,
) -> k::LayoutParams {
    let [per_rank_at, per_expert_at, invalid_at, in_rank_at, send_pos_at] = at;
    k::LayoutParams {
        topk_idx: topk_idx.device_address(),
        tokens_per_rank: base + per_rank_at as u64,
        tokens_per_expert: base + per_expert_at as u64,
        is_token_in_rank: base + in_rank_at as u64,
        send_pos: base + send_pos_at as u64,
        invalid: base + invalid_at as u64,
        num_tokens: topk_idx.dim(0) as i32,
        topk: topk_idx.dim(1) as i32,
        ranks: ranks as i32,
        num_experts: experts as i32,
    }
}

impl Buffer {
    /// From top-k expert ids `[tokens][k]` (-1 for none), computes tokens per rank and per
    /// expert, `is_token_in_rank`, and the send order. Ids out of range are an `Err`. Waits
    /// (bounded) for the result.
    pub fn get_dispatch_layout(
        &mut self,
        topk_idx: &Tensor<i32>,
    ) -> Result<DispatchLayout, EpError> {
        self.usable()?;
        self.not_capturing("get_dispatch_layout")?;
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
        self.tokens_within_limit(t)?;
        if kk > self.opts.max_topk {
            return Err(invalid(
                self.rank,
                format!("top-{kk}, more than max_topk {}", self.opts.max_topk),
            ));
        }
        let (r, e) = (self.ranks, self.opts.num_experts);
        let [per_rank_at, per_expert_at, invalid_at, in_rank_at, send_pos_at, bytes] = self
            .layout_sections(t)
            .ok_or_else(|| invalid(self.rank, format!("layout of {t} tokens overflows")))?;
        let buf =
            Arc::new(
                DeviceBuffer::new(&self.ctx, bytes).map_err(|source| EpError::Device {
                    rank: self.rank,
                    source,
                })?,
            );
        self.start(&StreamOrder::default(), false)?;
        self.launch_layout(
            topk_idx,
            buf.ptr(),
            [
                per_rank_at,
                per_expert_at,
                invalid_at,
                in_rank_at,
                send_pos_at,
            ],
        )?;
        let done = self.finish(&StreamOrder::default(), false)?;
        done.wait_host(self.opts.timeout, "the dispatch layout")?;
        let bad: Vec<i32> = buf
            .download(invalid_at, 4)
            .map_err(|source| EpError::Device {
                rank: self.rank,
                source,
            })?;
        if let Some(err) = layout_invalid_error(self.rank, &bad, kk, e) {
            return Err(err);
        }
        Ok(DispatchLayout {
            tokens_per_rank: Tensor::view(buf.clone(), per_rank_at, vec![r]).read_only(),
            tokens_per_expert: Tensor::view(buf.clone(), per_expert_at, vec![e]).read_only(),
            is_token_in_rank: Tensor::view(buf.clone(), in_rank_at, vec![t, r]).read_only(),
            send_pos: Tensor::view(buf, send_pos_at, vec![t, r]),
            num_tokens: t,
            buffer_id: self.id,
        })
    }

    /// Byte offsets of a layout's sections for `t` tokens (tokens per rank, per expert, the
    /// invalid-id report, `is_token_in_rank`, the send order) and its total bytes; `None` when
    /// a size overflows. Small: tokens, ranks and experts are bounded at creation.
    pub(crate) fn layout_sections(&self, t: usize) -> Option<[usize; 6]> {
        let (r, e) = (self.ranks, self.opts.num_experts);
        let mut s = Sections::new(0)?;
        let per_rank_at = s.take(product(&[4, r]))?;
        let per_expert_at = s.take(product(&[4, e]))?;
        let invalid_at = s.take(Some(std::mem::size_of::<k::LayoutInvalid>()))?;
        let in_rank_at = s.take(product(&[t, r]))?;
        let send_pos_at = s.take(product(&[4, t, r]))?;
        Some([
            per_rank_at,
            per_expert_at,
            invalid_at,
            in_rank_at,
            send_pos_at,
            s.at,
        ])
    }

    /// Queues the layout kernel over `topk_idx` into the sections at `at` (offsets from `base`,
    /// a device address) on the communication stream.
    fn launch_layout(
        &self,
        topk_idx: &Tensor<i32>,
        base: u64,
        at: [usize; 5],
    ) -> Result<(), EpError> {
        let (r, e) = (self.ranks, self.opts.num_experts);
        let p = layout_params(topk_idx, base, at, r, e);
        self.launch_local(
            &self.kernels.layout,
            r as u32 + 1,
            k::LAYOUT_THREADS,
            (4 * e) as u32,
            &p,
            "cuLaunchKernel(ep_dispatch_layout)",
        )
    }

    /// The layout of `topk_idx` computed on the device into `storage` from byte `at` (at least
    /// [`layout_sections`](Self::layout_sections)`(tokens)[5]` bytes), with no host wait: the
    /// internode buffer's NVLink hop with `num_worst_tokens` (CUDA-graph capturable). Ordered
    /// after `order.previous_event` (or the compute stream's work); ids out of range are not
    /// reported here (the caller produced them), and dispatch checks every count it reads.
    pub(crate) fn dispatch_layout_on_device(
        &mut self,
        topk_idx: &Tensor<i32>,
        storage: &Arc<Region>,
        at: usize,
        order: &StreamOrder<'_>,
    ) -> Result<DispatchLayout, EpError> {
        self.usable()?;
        self.on_this_gpu(topk_idx, "topk_idx")?;
        let (t, kk) = (topk_idx.dim(0), topk_idx.dim(1));
        self.tokens_within_limit(t)?;
        if kk == 0 || kk > self.opts.max_topk {
            return Err(invalid(
                self.rank,
                format!("top-{kk}: expected 1..={}", self.opts.max_topk),
            ));
        }
        let [per_rank_at, per_expert_at, invalid_at, in_rank_at, send_pos_at, bytes] = self
            .layout_sections(t)
            .ok_or_else(|| invalid(self.rank, format!("layout of {t} tokens overflows")))?;
        if at.checked_add(bytes).is_none_or(|end| end > storage.len()) {
            return Err(invalid(
                self.rank,
                format!("a layout of {bytes} bytes does not fit its storage"),
            ));
        }
        let capturing = self.is_capturing()?;
        self.start(order, capturing)?;
        let off = [
            per_rank_at,
            per_expert_at,
            invalid_at,
            in_rank_at,
            send_pos_at,
        ]
        .map(|o| o + at);
        self.launch_layout(topk_idx, storage.ptr(), off)?;
        let [per_rank_at, per_expert_at, _, in_rank_at, send_pos_at] = off;
        let (r, e) = (self.ranks, self.opts.num_experts);
        Ok(DispatchLayout {
            tokens_per_rank: Tensor::view(storage.clone(), per_rank_at, vec![r]).read_only(),
            tokens_per_expert: Tensor::view(storage.clone(), per_expert_at, vec![e]).read_only(),
            is_token_in_rank: Tensor::view(storage.clone(), in_rank_at, vec![t, r]).read_only(),
            send_pos: Tensor::view(storage.clone(), send_pos_at, vec![t, r]),
            num_tokens: t,
            buffer_id: self.id,
        })
    }

    /// The receive region sections (offsets inside a region) and rows one region holds.
    pub(crate) fn region_layout(&self) -> (k::RegionLayout, usize) {
        (self.plan.layout, self.plan.cap)
    }

    /// Checks the rows to send; returns (tokens, hidden, row bytes, scale words).
    fn check_x(
        &self,
        x: &DispatchX<'_>,
        tokens: Option<usize>,
    ) -> Result<(usize, usize, usize, usize), EpError> {
        let (shape, elem, scales) = match x {
            DispatchX::Bf16(t) => {
                self.on_this_gpu(*t, "x")?;
                (t.shape(), 2, None)
            }
            DispatchX::Fp8 { x, scales } => {
                self.on_this_gpu(*x, "x")?;
                (x.shape(), 1, Some(*scales))
            }
        };
        if shape.len() != 2 {
            return Err(invalid(
                self.rank,
                format!("x has shape {shape:?}, expected [tokens, hidden]"),
            ));
        }
        let (t, h) = (shape[0], shape[1]);
        if let Some(want) = tokens {
            if t != want {
                return Err(invalid(
                    self.rank,
                    format!("x has {t} tokens, the layout/handle {want}"),
                ));
            }
        }
        self.tokens_within_limit(t)?;
        if h > self.opts.max_hidden {
            return Err(invalid(
                self.rank,
                format!("hidden {h} above max_hidden {}", self.opts.max_hidden),
            ));
        }
        let row_bytes = h * elem;
        if h == 0 || row_bytes % 16 != 0 {
            return Err(invalid(
                self.rank,
                format!("hidden {h}: rows of {row_bytes} bytes are not a positive multiple of 16"),
            ));
        }
        let mut scale_words = 0;
        if let Some(s) = scales {
            if h % FP8_BLOCK != 0 {
                return Err(invalid(
                    self.rank,
                    format!("FP8 hidden {h} is not a multiple of {FP8_BLOCK}"),
                ));
            }
            scale_words = h / FP8_BLOCK;
            self.shape_is(s, &[t, scale_words], "scales")?;
        }
        Ok((t, h, row_bytes, scale_words))
    }

    fn recv_views(
        &self,
        region: &Arc<Region>,
        x: &DispatchX<'_>,
        rows: usize,
        hidden: usize,
        scale_words: usize,
    ) -> RecvX {
        let l = &self.plan.layout;
        match x {
            DispatchX::Bf16(_) => RecvX::Bf16(Tensor::view(
                region.clone(),
                l.x as usize,
                vec![rows, hidden],
            )),
            DispatchX::Fp8 { .. } => RecvX::Fp8 {
                x: Tensor::view(region.clone(), l.x as usize, vec![rows, hidden]),
                scales: Tensor::view(region.clone(), l.scales as usize, vec![rows, scale_words]),
            },
        }
    }

    /// The host's sequence numbers of an operation's two kernels: the first tags the dispatch's
    /// [`k::HostInfo`]. The barrier epochs themselves are counted on the GPU
    /// ([`k::SignalHead::epoch`]), so that captured graphs replay with fresh ones.
    fn next_epochs(&mut self) -> (u64, u64) {
        self.epoch += 2;
        (self.epoch - 1, self.epoch)
    }

    fn timeout_ns(&self) -> u64 {
        ibgda_device::timeout::device_ns(self.opts.timeout)
    }

    /// Waits (bounded) for the count exchange of dispatch `epoch`; returns (rows, per-expert).
    fn wait_counts(&mut self, epoch: u64) -> Result<(usize, Vec<usize>), EpError> {
        let start = Instant::now();
        let bound = self.opts.timeout.saturating_mul(2);
        let mut spins = 0;
        while self.mapped.read_u64(HOST_INFO_OFFSET) != epoch {
            self.check_device_error()?;
            if start.elapsed() > bound {
                let e = EpError::HostTimeout {
                    rank: self.rank,
                    what: "the dispatch's received-token count",
                    timeout: bound,
                };
                self.poisoned = Some(e.to_string());
                return Err(e);
            }
            backoff(&mut spins);
        }
        std::sync::atomic::fence(Ordering::Acquire);
        self.check_device_error()?;
        // The kernels keep the count inside the receive region (each rank checks the counts it
        // publishes); clamped here too, since the output views are shaped by it.
        let cap = self.plan.cap;
        let n = clamp_count(self.mapped.read_i32(HOST_INFO_OFFSET + 8), cap);
        let counts = (0..self.num_local_experts)
            .map(|l| self.mapped.read_i32(HOST_INFO_OFFSET + 16 + 4 * l).max(0) as usize)
            .collect();
        Ok((n, counts))
    }

    /// Sends each token to every rank that holds one of its experts. Rows arrive ordered by
    /// source rank, then by token. All ranks call this together.
    ///
    /// # CUDA graphs
    ///
    /// With [`num_worst_tokens`](DispatchArgs::num_worst_tokens), dispatch, [`combine`](Self::combine)
    /// and [`dispatch_cached`](Self::dispatch_cached) make no host wait, so they can be captured
    /// on the [communication stream](Self::comm_stream) (`begin_capture` .. `end_capture`, in
    /// thread-local mode when ranks are threads of one process). Under capture:
    ///
    /// - *Fixed outputs.* The receive region and the combine output are picked from their pools
    ///   at capture, so every replay writes the very tensors the captured calls returned. Read
    ///   (or copy) a replay's outputs before the next replay, and keep the returned outputs (or
    ///   their handle) alive while the graph is replayed: they reserve those regions, which the
    ///   pools would otherwise hand to other calls. Inputs are read at replay time from the
    ///   tensors given at capture: write fresh inputs into those same tensors between replays.
    /// - *Fresh barriers.* Barrier epochs are counted on the GPU, so replays and eager calls may
    ///   interleave, as long as every rank runs the same operations (replays included) in the same
    ///   order.
    /// - *Ordering.* The communication stream neither waits for the compute stream nor makes it
    ///   wait (the compute stream is not in the graph): the replay is ordered on the stream it is
    ///   launched on. `previous_event` must be an event recorded in the same capture. The returned
    ///   events belong to the capture: waiting on them or querying them outside it is a CUDA
    ///   error.
    /// - Dispatch without `num_worst_tokens`, [`get_dispatch_layout`](Self::get_dispatch_layout)
    ///   and [`synchronize`](Self::synchronize) are refused (they wait on the host): compute the
    ///   layout before capturing (the graph's routing is the layout's tensors' contents at replay
    ///   time), and call [`synchronize`](Self::synchronize) after a replay to wait for it and
    ///   report device errors.
    pub fn dispatch(&mut self, args: &DispatchArgs<'_>) -> Result<DispatchOutput, EpError> {
        self.usable()?;
        let layout = args.layout;
        if layout.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "layout",
            });
        }
        let (t, hidden, row_bytes, scale_words) = self.check_x(&args.x, Some(layout.num_tokens))?;
        self.check_config(&args.config)?;
        let mut topk = 0;
        if let Some(tk) = &args.topk {
            self.on_this_gpu(tk.idx, "topk_idx")?;
            topk = tk.idx.dim(1);
            if topk > self.opts.max_topk || topk == 0 {
                return Err(invalid(
                    self.rank,
                    format!("top-{topk}: expected 1..={}", self.opts.max_topk),
                ));
            }
            self.shape_is(tk.idx, &[t, topk], "topk_idx")?;
            self.shape_is(tk.weights, &[t, topk], "topk_weights")?;
        }
        let cap = self.ranks * self.opts.max_tokens_per_rank;
        if let Some(w) = args.num_worst_tokens {
            if w == 0 || w > cap {
                return Err(invalid(
                    self.rank,
                    format!("num_worst_tokens {w} out of 1..={cap}"),
                ));
            }
        }
        check_expert_alignment(self.rank, args.expert_alignment)?;
        let capturing = self.is_capturing()?;
        if capturing && args.num_worst_tokens.is_none() {
            return Err(invalid(
                self.rank,
                "dispatch under CUDA-graph capture needs num_worst_tokens (without it the host \
                 waits for the received-token count)",
            ));
        }
        let region = self.recv_pool.acquire(self.rank)?;
        let (e1, e2) = self.next_epochs();
        self.start(&args.order, capturing)?;
        self.poison(&region)?;
        let worst = args.num_worst_tokens.unwrap_or(0);
        let notify = k::NotifyParams {
            signal: self.peer_window,
            recv_base: region.ptr(),
            recv_offset: region.offset() as u64,
            cached_meta: 0,
            tokens_per_rank: layout.tokens_per_rank.device_address(),
            tokens_per_expert: if args.topk.is_some() {
                layout.tokens_per_expert.device_address()
            } else {
                0
            },
            host_info: if worst == 0 {
                self.mapped.device_addr(HOST_INFO_OFFSET)
            } else {
                0
            },
            error: self.errors.kernel_addr(),
            epoch: e1,
            timeout_ns: self.timeout_ns(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            num_local_experts: self.num_local_experts as i32,
            expert_alignment: args.expert_alignment.max(1) as i32,
            num_worst_tokens: worst as i32,
            num_tokens: t as i32,
            mask: self.mask_addr(),
        };
        self.launch(
            &self.kernels.notify,
            1,
            k::NOTIFY_THREADS,
            0,
            &notify,
            "cuLaunchKernel(ep_intranode_notify)",
        )?;
        self.push(
            &args.x,
            args.topk.as_ref(),
            &layout.send_pos,
            &region,
            t,
            row_bytes,
            scale_words,
            topk,
            worst,
            e2,
            &args.config,
        )?;
        let event = self.finish(&args.order, capturing)?;

        let (rows, num_recv, per_expert) = if worst == 0 {
            let (n, c) = self.wait_counts(e1)?;
            (n, Some(n), Some(c))
        } else {
            (worst, None, None)
        };
        let l = &self.plan.layout;
        Ok(DispatchOutput {
            x: self.recv_views(&region, &args.x, rows, hidden, scale_words),
            topk_idx: args
                .topk
                .map(|_| Tensor::view(region.clone(), l.topk_idx as usize, vec![rows, topk])),
            topk_weights: args
                .topk
                .map(|_| Tensor::view(region.clone(), l.topk_weights as usize, vec![rows, topk])),
            num_recv_tokens: num_recv,
            num_recv_tokens_per_expert: per_expert,
            recv_tokens_per_expert: Tensor::view(
                region.clone(),
                std::mem::size_of::<k::Meta>(),
                vec![self.num_local_experts],
            ),
            handle: Handle {
                buffer_id: self.id,
                region,
                send_pos: layout.send_pos.clone(),
                num_tokens: t,
                rows,
                num_recv,
                worst: worst != 0,
            },
            event,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        x: &DispatchX<'_>,
        topk: Option<&TopK<'_>>,
        send_pos: &Tensor<i32>,
        region: &Region,
        tokens: usize,
        row_bytes: usize,
        scale_words: usize,
        topk_n: usize,
        worst: usize,
        epoch: u64,
        config: &Config,
    ) -> Result<(), EpError> {
        let (xa, sa) = match x {
            DispatchX::Bf16(t) => (t.device_address(), 0),
            DispatchX::Fp8 { x, scales } => (x.device_address(), scales.device_address()),
        };
        let p = k::DispatchParams {
            signal: self.peer_window,
            window: self.peer_window,
            region: self.plan.layout,
            meta: region.ptr(),
            x: xa,
            scales: sa,
            topk_idx: topk.map_or(0, |t| t.idx.device_address()),
            topk_weights: topk.map_or(0, |t| t.weights.device_address()),
            send_pos: send_pos.device_address(),
            error: self.errors.kernel_addr(),
            epoch,
            timeout_ns: self.timeout_ns(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            num_tokens: tokens as i32,
            row_bytes: row_bytes as i32,
            scale_words: scale_words as i32,
            topk: topk_n as i32,
            num_local_experts: self.num_local_experts as i32,
            num_worst_tokens: worst as i32,
            cap: self.plan.cap as i32,
            pad: 0,
        };
        self.launch(
            &self.kernels.dispatch,
            config.num_sms,
            config.block_threads,
            0,
            &p,
            "cuLaunchKernel(ep_intranode_dispatch)",
        )
    }

    /// Sends `x` along the routes of an earlier dispatch (no layout, no top-k, no count exchange
    /// on the host). All ranks call this together.
    pub fn dispatch_cached(
        &mut self,
        x: DispatchX<'_>,
        handle: &Handle,
        config: &Config,
        order: &StreamOrder<'_>,
    ) -> Result<DispatchOutput, EpError> {
        self.usable()?;
        if handle.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "handle",
            });
        }
        let (t, hidden, row_bytes, scale_words) = self.check_x(&x, Some(handle.num_tokens))?;
        self.check_config(config)?;
        let capturing = self.is_capturing()?;
        let region = self.recv_pool.acquire(self.rank)?;
        let (e1, e2) = self.next_epochs();
        self.start(order, capturing)?;
        self.poison(&region)?;
        let worst = if handle.worst { handle.rows } else { 0 };
        let notify = k::NotifyParams {
            signal: self.peer_window,
            recv_base: region.ptr(),
            recv_offset: region.offset() as u64,
            cached_meta: handle.region.ptr(),
            tokens_per_rank: 0,
            tokens_per_expert: 0,
            host_info: 0,
            error: self.errors.kernel_addr(),
            epoch: e1,
            timeout_ns: self.timeout_ns(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            num_local_experts: self.num_local_experts as i32,
            expert_alignment: 1,
            num_worst_tokens: worst as i32,
            num_tokens: t as i32,
            mask: self.mask_addr(),
        };
        self.launch(
            &self.kernels.notify,
            1,
            k::NOTIFY_THREADS,
            0,
            &notify,
            "cuLaunchKernel(ep_intranode_notify)",
        )?;
        self.push(
            &x,
            None,
            &handle.send_pos,
            &region,
            t,
            row_bytes,
            scale_words,
            0,
            worst,
            e2,
            config,
        )?;
        let event = self.finish(order, capturing)?;
        Ok(DispatchOutput {
            x: self.recv_views(&region, &x, handle.rows, hidden, scale_words),
            topk_idx: None,
            topk_weights: None,
            num_recv_tokens: handle.num_recv,
            num_recv_tokens_per_expert: None,
            recv_tokens_per_expert: Tensor::view(
                region.clone(),
                std::mem::size_of::<k::Meta>(),
                vec![self.num_local_experts],
            ),
            handle: Handle {
                region,
                ..handle.clone()
            },
            event,
        })
    }

    /// Sums every copy of each token back on the rank that sent it: the inverse of the dispatch
    /// that made `args.handle`. All ranks call this together.
    pub fn combine(&mut self, args: &CombineArgs<'_>) -> Result<CombineOutput, EpError> {
        self.usable()?;
        let h = args.handle;
        if h.buffer_id != self.id {
            return Err(EpError::ForeignHandle {
                rank: self.rank,
                what: "handle",
            });
        }
        self.check_config(&args.config)?;
        self.on_this_gpu(args.x, "x")?;
        let hidden = args.x.dim(1);
        self.shape_is(args.x, &[h.rows, hidden], "x")?;
        if hidden == 0 || hidden % 8 != 0 || hidden > self.opts.max_hidden {
            return Err(invalid(
                self.rank,
                format!(
                    "combine hidden {hidden}: expected a multiple of 8 in 8..={}",
                    self.opts.max_hidden
                ),
            ));
        }
        let mut topk = 0;
        if let Some(w) = args.topk_weights {
            topk = w.dim(1);
            if topk == 0 || topk > self.opts.max_topk {
                return Err(invalid(
                    self.rank,
                    format!("combine top-{topk}: expected 1..={}", self.opts.max_topk),
                ));
            }
            self.shape_is(w, &[h.rows, topk], "topk_weights")?;
        }
        for (i, b) in args.bias.iter().enumerate() {
            if let Some(b) = b {
                self.shape_is(
                    *b,
                    &[h.num_tokens, hidden],
                    if i == 0 { "bias[0]" } else { "bias[1]" },
                )?;
            }
        }
        let capturing = self.is_capturing()?;
        let out = self.out_pool.acquire(self.rank)?;
        let (e1, e2) = self.next_epochs();
        self.start(&args.order, capturing)?;
        self.poison(&out)?;
        let error = self.errors.kernel_addr();
        // The start barrier publishes this rank's input; then each rank reads and sums its
        // tokens' copies straight from the ranks holding them, in one pass.
        let publish_x = self.publish_combine_input(args.x, self.wplan.comb_x)?;
        let publish_w = match args.topk_weights {
            Some(w) => self.publish_combine_input(w, self.wplan.comb_w)?,
            None => 0,
        };
        let barrier = k::BarrierParams {
            signal: self.peer_window,
            publish_x,
            publish_w,
            error,
            epoch: e1,
            timeout_ns: self.timeout_ns(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            what: k::wait_what::COMBINE_START as i32,
            pad: 0,
            mask: self.mask_addr(),
        };
        self.launch(
            &self.kernels.barrier,
            1,
            k::NOTIFY_THREADS,
            0,
            &barrier,
            "cuLaunchKernel(ep_intranode_notify_barrier)",
        )?;
        let out_weights = if topk > 0 {
            out.ptr() + self.out_w_offset as u64
        } else {
            0
        };
        let p = k::CombinePullParams {
            signal: self.peer_window,
            meta: h.region.ptr(),
            send_pos: h.send_pos.device_address(),
            bias0: args.bias[0].map_or(0, |b| b.device_address()),
            bias1: args.bias[1].map_or(0, |b| b.device_address()),
            out: out.ptr(),
            out_weights,
            error,
            epoch: e2,
            timeout_ns: self.timeout_ns(),
            rank: self.rank as i32,
            ranks: self.ranks as i32,
            num_tokens: h.num_tokens as i32,
            hidden: hidden as i32,
            topk: topk as i32,
            pad: 0,
            mask: self.mask_addr(),
        };
        self.launch(
            &self.kernels.pull,
            args.config.num_sms,
            args.config.block_threads,
            0,
            &p,
            "cuLaunchKernel(ep_intranode_combine_pull)",
        )?;
        let event = self.finish(&args.order, capturing)?;
        Ok(CombineOutput {
            x: Tensor::view(out.clone(), 0, vec![h.num_tokens, hidden]),
            topk_weights: (topk > 0)
                .then(|| Tensor::view(out, self.out_w_offset, vec![h.num_tokens, topk])),
            event,
        })
    }

    /// What the combine start barrier publishes for `t`, a combine input (rows or weights): its
    /// address when every rank shares this address space; otherwise [`k::IN_WINDOW`] | its
    /// offset in this rank's window, after copying it to `staging` (a window offset) on the
    /// communication stream unless it already lies in the window (a dispatch output does).
    fn publish_combine_input<T: Element>(
        &self,
        t: &Tensor<T>,
        staging: usize,
    ) -> Result<u64, EpError> {
        let addr = t.device_address();
        if self.same_space {
            return Ok(addr);
        }
        let bytes = (t.numel() * std::mem::size_of::<T>()) as u64;
        let base = self.window.ptr();
        let end = base + self.wplan.bytes as u64;
        if addr >= base && addr + bytes <= end {
            return Ok(k::IN_WINDOW | (addr - base));
        }
        if bytes > self.wplan.staging_bytes(staging) as u64 {
            return Err(invalid(
                self.rank,
                format!("combine input of {bytes} bytes exceeds the staging region"),
            ));
        }
        if bytes > 0 {
            // The copy is ordered on the communication stream before the barrier that publishes
            // it, and no other operation of this buffer runs meanwhile.
            // SAFETY: the destination is this rank's live window's staging section (checked to
            // hold `bytes`), the source a live tensor of `bytes` bytes on this device.
            unsafe {
                cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                    base + staging as u64,
                    addr,
                    bytes as usize,
                    self.comm.cu_stream(),
                )
            }
            .result()
            .map_err(self.cuda("cuMemcpyDtoDAsync"))?;
        }
        Ok(k::IN_WINDOW | staging as u64)
    }
}
