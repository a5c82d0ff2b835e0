//! The buffer, its creation (allocation, rendezvous), accessors and teardown.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use ep_kernels::intranode as k;
use ibgda_device::cuda::DeviceBuffer;

use crate::bootstrap::{exchange_buffers, Communicator, PeerBuffer};
use crate::config::BufferOptions;
use crate::error::{invalid, EpError};
use crate::event::Event;
use crate::mask::RankMask;
use crate::region_pool::RegionPool;
use crate::rendezvous::Exchange;
use crate::residency::{GpuShare, LaunchGate};

use super::plan::{
    OutputPlan, RegionPlan, WindowPlan, ERROR_OFFSET, HOST_INFO_OFFSET, MAX_HIDDEN,
    MAX_LIVE_OUTPUTS, MAX_TOPK,
};

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

pub(super) struct Kernels {
    pub(super) layout: CudaFunction,
    pub(super) notify: CudaFunction,
    pub(super) dispatch: CudaFunction,
    pub(super) barrier: CudaFunction,
    pub(super) pull: CudaFunction,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, rank: usize) -> Result<Self, EpError> {
        let f = |module, name| {
            ep_kernels::load_function(ctx, module, name)
                .map_err(|source| EpError::Kernel { rank, source })
        };
        Ok(Self {
            layout: f(k::LAYOUT_MODULE, "ep_dispatch_layout")?,
            notify: f(k::INTRANODE_MODULE, "ep_intranode_notify")?,
            dispatch: f(k::INTRANODE_MODULE, "ep_intranode_dispatch")?,
            barrier: f(k::INTRANODE_MODULE, "ep_intranode_notify_barrier")?,
            pull: f(k::INTRANODE_MODULE, "ep_intranode_combine_pull")?,
        })
    }
}

/// One rank's intranode communication buffer.
///
/// Ranks as threads of this process: [`Buffer::create_group`]. Ranks as processes (or any other
/// [`Communicator`]): every rank calls [`Buffer::new`] with its communicator, and the group ends
/// with [`Buffer::shutdown`].
///
/// ```no_run
/// use ep::bootstrap::{launch, Communicator};
/// use ep::{Buffer, BufferOptions};
///
/// fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     // Re-executes this program once per rank; each rank runs the closure on its own GPU.
///     launch(2, |comm| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///         let ctx = ibgda_device::cuda::context(comm.local_rank())?;
///         let buf = Buffer::new(&ctx, comm, &BufferOptions::new(4096, 7168, 8, 256))?;
///         // get_dispatch_layout, dispatch, combine: every rank, in the same order.
///         buf.shutdown(comm)?;
///         Ok(())
///     })?;
///     Ok(())
/// }
/// ```
pub struct Buffer {
    /// The peers' windows as this rank reaches them. Declared first so that they are dropped
    /// (IPC mappings closed) before any memory of this rank is freed.
    peers: Vec<PeerBuffer>,
    pub(super) id: u64,
    pub(super) rank: usize,
    pub(super) ranks: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) comm: Arc<CudaStream>,
    pub(super) compute: Arc<CudaStream>,
    /// The hardware queues of `comm` (and of `compute` when it is a stream of its own), held
    /// while the buffer lives (see `ibgda_device::stream_pool`).
    _stream_leases: Vec<ibgda_device::stream_pool::StreamLease>,
    pub(super) opts: BufferOptions,
    pub(super) num_local_experts: usize,
    pub(super) kernels: Kernels,
    /// This rank's window: signal region, combine staging, receive regions.
    pub(super) window: Arc<DeviceBuffer>,
    pub(super) wplan: WindowPlan,
    /// Every rank's window base as mapped here. The signal region is at offset 0, so this is
    /// also every rank's signal region.
    pub(super) peer_window: [u64; k::MAX_RANKS],
    /// Every rank a thread of this process (one address space): combine inputs are published by
    /// address. Otherwise by offset in the publisher's window, staged there when needed.
    pub(super) same_space: bool,
    pub(super) plan: RegionPlan,
    pub(super) recv_pool: RegionPool,
    pub(super) out_pool: RegionPool,
    pub(super) out_w_offset: usize,
    pub(super) mapped: Arc<crate::mapped::MappedHost>,
    /// What the kernels get as `error` (points at the error word in `mapped`).
    pub(super) errors: Arc<crate::mapped::ErrorReport>,
    /// Whom this rank masks ([`Buffer::update_mask`]); every kernel that exchanges with peers
    /// reads it.
    pub(super) mask: RankMask,
    /// Every window of the group, when its ranks are threads built together
    /// ([`Buffer::create_group`]): each rank's window is freed only once no rank's buffer holds
    /// it, so a drop never frees memory a peer's kernels may still write. `None` otherwise.
    group_windows: Option<Vec<Arc<DeviceBuffer>>>,
    pub(super) epoch: u64,
    pub(super) poisoned: Option<String>,
    /// Who shares this GPU: ranks of this process on it must fit on it together.
    pub(super) share: GpuShare,
    /// Where the ranks of this process sharing this GPU meet around every launch of a kernel
    /// that waits for them (`None`: this rank has its GPU to itself).
    pub(super) gate: Option<Arc<LaunchGate>>,
    /// Set when a rank sharing the GPU never came to the gate: the peers' flags are then in an
    /// unknown state, as after a timeout.
    pub(super) gate_failure: std::sync::OnceLock<String>,
    /// Set by [`Buffer::shutdown`], which did the teardown; drop then only frees what it left.
    shut_down: bool,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .field("same_space", &self.same_space)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// Dropping a buffer without [`Buffer::shutdown`] waits (bounded) for its stream, and never frees
/// memory a kernel may still write: when the stream did not finish, everything its kernels write
/// is leaked (logged); ranks as threads of [`Buffer::create_group`] keep each other's windows
/// alive, so a window is freed only when the last buffer of the group has gone; any other
/// multi-rank buffer leaks its window (logged: peers may still map or write it; end such groups
/// with [`Buffer::shutdown`]).
impl Drop for Buffer {
    fn drop(&mut self) {
        if self.shut_down {
            return;
        }
        if let Err(e) = self.wait_stream() {
            self.leak_own(&format!("buffer dropped while its stream was busy ({e})"));
            return;
        }
        if let Err(e) = self.check_device_error() {
            tracing::warn!(rank = self.rank, "buffer dropped after an error: {e}");
        }
        if self.ranks > 1 && self.group_windows.is_none() {
            self.leak_window("buffer dropped without shutdown: the peers may still map its window");
        }
    }
}

/// What a rank allocates before it meets the others.
struct Parts {
    kernels: Kernels,
    comm: Arc<CudaStream>,
    comm_lease: ibgda_device::stream_pool::StreamLease,
    window: Arc<DeviceBuffer>,
    out: Arc<DeviceBuffer>,
    mapped: crate::mapped::MappedHost,
    errors: crate::mapped::ErrorReport,
    mask: RankMask,
}

impl Parts {
    fn allocate(
        ctx: &Arc<CudaContext>,
        (rank, ranks): (usize, usize),
        opts: &BufferOptions,
        wplan: &WindowPlan,
        out_pool_bytes: usize,
    ) -> Result<Self, EpError> {
        let dev = |source| EpError::Device { rank, source };
        let cuda = |call, source| EpError::Cuda { rank, call, source };
        let kernels = Kernels::load(ctx, rank)?;
        // Its kernels spin for the peers: a hardware queue of its own.
        let (comm, comm_lease) = ibgda_device::stream_pool::waiting(ctx).map_err(dev)?;
        let window = DeviceBuffer::new(ctx, wplan.bytes).map_err(dev)?;
        ctx.bind_to_thread()
            .map_err(|e| cuda("cuCtxSetCurrent", e))?;
        // SAFETY: the signal region is the first `signal_bytes` of the live window allocation,
        // and the window's context is current.
        unsafe { cudarc::driver::sys::cuMemsetD8_v2(window.ptr(), 0, wplan.signal_bytes) }
            .result()
            .map_err(|e| cuda("cuMemsetD8", e))?;
        // Peers write the signal region as soon as the exchange returns: it must be zero by then
        // (a memset is asynchronous to the host).
        ibgda_device::cuda::wait_legacy_stream(
            ctx,
            ibgda_device::cuda::LEGACY_STREAM_BOUND,
            "zeroing the signal region",
        )
        .map_err(dev)?;
        let out = DeviceBuffer::new(ctx, out_pool_bytes).map_err(dev)?;
        let num_local_experts = opts.num_experts / ranks;
        let mapped = crate::mapped::MappedHost::new(
            ctx,
            HOST_INFO_OFFSET + std::mem::size_of::<k::HostInfo>() + 4 * num_local_experts,
            rank,
        )?;
        let errors = crate::mapped::ErrorReport::new(ctx, &mapped, ERROR_OFFSET, rank)?;
        // Nobody masked: zeroed (and waited for) before any kernel reads it.
        let mask = RankMask::new(ctx, rank, ranks)?;
        Ok(Self {
            kernels,
            comm,
            comm_lease,
            window: Arc::new(window),
            out: Arc::new(out),
            mapped,
            errors,
            mask,
        })
    }
}

impl Buffer {
    /// Builds one buffer per context, ranks as threads of this process (rank `i` on `ctxs[i]`),
    /// with peer access enabled between every pair.
    pub fn create_group(
        ctxs: &[Arc<CudaContext>],
        opts: &BufferOptions,
    ) -> Result<Vec<Buffer>, EpError> {
        let mut bufs = crate::rendezvous::build_as_threads(ctxs, opts.timeout, |ctx, comm| {
            Buffer::new(ctx, &comm, opts)
        })?;
        let windows: Vec<_> = bufs.iter().map(|b| b.window.clone()).collect();
        for b in &mut bufs {
            b.group_windows = Some(windows.clone());
        }
        Ok(bufs)
    }

    /// Builds this rank's buffer on `ctx` (this rank's GPU); every rank of `group` calls this at
    /// the same time, with the same options.
    ///
    /// Every rank allocates its window (all `max_live_outputs` receive regions included: see
    /// [`BufferOptions::recv_region_bytes`]), then the ranks check they agree on its layout and
    /// map each other's windows once ([`exchange_buffers`]: CUDA IPC between processes, peer
    /// access between threads). A rank that fails makes every rank fail, naming it. With ranks
    /// as processes, end with [`shutdown`](Self::shutdown).
    pub fn new(
        ctx: &Arc<CudaContext>,
        group: &dyn Communicator,
        opts: &BufferOptions,
    ) -> Result<Buffer, EpError> {
        let rank = group.rank();
        let ranks = group.world_size();
        Self::check_options(rank, ranks, opts)?;
        // Combine reads the peers' inputs at the addresses they publish, which only mean the same
        // to every rank when all are threads of one process; processes stage inputs in their
        // windows.
        let same_space = group.same_process();
        let (plan, wplan, oplan) = Self::plans(rank, ranks, opts, same_space)?;
        let parts = Parts::allocate(ctx, (rank, ranks), opts, &wplan, oplan.pool_bytes);

        // Every rank learns whether all could allocate, and that all agree on the window, before
        // anyone maps anything.
        let mut mine = vec![
            u64::from(parts.is_err()),
            u64::from(same_space),
            opts.max_tokens_per_rank as u64,
            opts.max_hidden as u64,
            opts.max_topk as u64,
            opts.num_experts as u64,
            opts.max_live_outputs as u64,
        ];
        mine.extend(wplan.words());
        let all = group.all_gather(&mine)?;
        let parts = parts?;
        for (r, theirs) in all.iter().enumerate() {
            if theirs.first() != Some(&0) {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!("rank {r} could not set up its buffer (its own error says why)"),
                });
            }
            if theirs[1..] != mine[1..] {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!(
                        "rank {r} builds a different buffer ([same_space, max_tokens, max_hidden, \
                         max_topk, experts, live outputs, window plan..] {:?}, this rank {:?}): \
                         every rank must pass the same BufferOptions and the same kind of group",
                        &theirs[1..],
                        &mine[1..]
                    ),
                });
            }
        }
        // One collective: every rank zeroed its signal region before it, so it is also the
        // barrier after which peers may write there.
        let peers = exchange_buffers(group, ctx, &parts.window)
            .map_err(|source| EpError::Bootstrap { rank, source })?;
        // Who shares this GPU: every kernel that waits for peers keeps a block resident while it
        // waits, so the ranks of this process on one GPU must fit on it together.
        let share = GpuShare::gather(ctx, group)?;
        share.default_budget("an intranode buffer", 0)?;
        let gate = share.gate();
        // Ranks of this process on one GPU each get their own compute stream: the context's
        // legacy stream is shared by all of them, and ordering one rank's operation after it
        // would chain it behind another rank's, whose kernels wait for this one.
        let mut stream_leases = Vec::new();
        let compute = if gate.is_some() {
            let (s, lease) = ibgda_device::stream_pool::waiting(ctx)
                .map_err(|source| EpError::Device { rank, source })?;
            stream_leases.push(lease);
            s
        } else {
            ctx.default_stream()
        };
        let mut peer_window = [0u64; k::MAX_RANKS];
        for p in &peers {
            if p.len() != wplan.bytes || p.rank() >= ranks {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!(
                        "rank {}'s window is {} bytes, expected {}",
                        p.rank(),
                        p.len(),
                        wplan.bytes
                    ),
                });
            }
            peer_window[p.rank()] = p.ptr();
        }

        let limit = opts.max_live_outputs;
        Ok(Buffer {
            peers,
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            rank,
            ranks,
            ctx: ctx.clone(),
            comm: parts.comm,
            compute,
            _stream_leases: {
                stream_leases.push(parts.comm_lease);
                stream_leases
            },
            opts: opts.clone(),
            num_local_experts: opts.num_experts / ranks,
            kernels: parts.kernels,
            recv_pool: RegionPool::new(
                "receive",
                &parts.window,
                wplan.recv_at,
                wplan.recv_bytes,
                limit,
            ),
            out_pool: RegionPool::new("combine output", &parts.out, 0, oplan.bytes, limit),
            window: parts.window,
            wplan,
            peer_window,
            same_space,
            plan,
            out_w_offset: oplan.weights,
            mapped: Arc::new(parts.mapped),
            errors: Arc::new(parts.errors),
            mask: parts.mask,
            group_windows: None,
            epoch: 0,
            poisoned: None,
            share,
            gate,
            gate_failure: std::sync::OnceLock::new(),
            shut_down: false,
        })
    }

    /// Tears the buffer down together with the other ranks of `group` (the communicator it was
    /// built with): waits (bounded) for this rank's work, unmaps the peers' windows, meets every
    /// rank, then frees this rank's memory (what live outputs still view is freed when they go).
    /// Ranks as processes must end this way, since a process must not free memory that a peer
    /// still maps. Returns the first error.
    ///
    /// Memory a kernel may still write is never freed: when this rank's stream did not finish
    /// within the bound, its memory and its mappings of the peers are leaked (its kernels may
    /// still write through them), and when any rank's did not (or the ranks could not meet),
    /// every rank leaks its window, which that rank's kernels may still write into. Each leak
    /// is logged.
    pub fn shutdown(mut self, group: &dyn Communicator) -> Result<(), EpError> {
        let r = self.shutdown_in_place(group);
        drop(self);
        r
    }

    /// [`shutdown`](Self::shutdown) for a buffer another one owns (the internode buffer's
    /// NVLink hop): the same waits, unmapping and meeting; this rank's own memory is freed when
    /// the buffer is dropped, which may be later (never sooner). Call it once; the drop then
    /// does nothing more.
    pub(crate) fn shutdown_in_place(&mut self, group: &dyn Communicator) -> Result<(), EpError> {
        self.shut_down = true;
        let drained = self.wait_stream();
        let finished = drained.is_ok();
        let device = self.check_device_error();
        if finished {
            self.peers.clear();
        } else {
            self.leak_own("shutdown: this rank's stream did not finish");
        }
        let met = group.all_gather(&[u64::from(!finished)]).and_then(|all| {
            match all.iter().position(|v| v.first() != Some(&0)) {
                Some(r) => Err(EpError::HostTimeout {
                    rank: self.rank,
                    what: if r == self.rank {
                        "this rank's stream at shutdown"
                    } else {
                        "a peer's stream at shutdown (its error names it)"
                    },
                    timeout: self.opts.timeout.saturating_mul(2),
                }),
                None => Ok(()),
            }
        });
        if met.is_err() {
            self.leak_window(
                "shutdown: a rank's stream did not finish, or the ranks could not meet",
            );
        }
        drained.and(device).and(met)
    }

    /// Waits (bounded) for everything queued on the communication stream; `Ok` once it ran.
    fn wait_stream(&self) -> Result<(), EpError> {
        self.not_capturing("teardown")?;
        Event::record(&self.comm, self.rank)?.wait_host(
            self.opts.timeout.saturating_mul(2),
            "the communication stream",
        )
    }

    /// This rank's kernels may still run: leaks every allocation they touch (its window, the
    /// combine outputs, the error and host-info words, the rank mask) and its mappings of the
    /// peers' windows.
    fn leak_own(&mut self, why: &str) {
        tracing::error!(
            rank = self.rank,
            "{why}: leaking this rank's window ({} bytes), combine outputs and error words, and \
             its mask and its mappings of the peers' windows, which its kernels may still touch",
            self.wplan.bytes
        );
        std::mem::forget(std::mem::take(&mut self.peers));
        std::mem::forget(self.window.clone());
        std::mem::forget(self.out_pool.slots().first().cloned());
        std::mem::forget(self.mapped.clone());
        std::mem::forget(self.errors.clone());
        std::mem::forget(self.mask.keep());
        if let Some(w) = self.group_windows.take() {
            std::mem::forget(w);
        }
    }

    /// A peer's kernels may still write into this rank's window: leaks it.
    fn leak_window(&mut self, why: &str) {
        tracing::error!(
            rank = self.rank,
            "{why}: leaking this rank's window ({} bytes), which a peer's kernels may still write",
            self.wplan.bytes
        );
        std::mem::forget(self.window.clone());
    }

    /// The receive-region, window and combine-output plans of valid options, or why their sizes
    /// do not fit (checked arithmetic: nothing wraps).
    fn plans(
        rank: usize,
        ranks: usize,
        opts: &BufferOptions,
        same_space: bool,
    ) -> Result<(RegionPlan, WindowPlan, OutputPlan), EpError> {
        let plan = RegionPlan::new(opts, ranks).map_err(|w| invalid(rank, w))?;
        let wplan = WindowPlan::new(opts, ranks, !same_space).map_err(|w| invalid(rank, w))?;
        let oplan = OutputPlan::new(opts).map_err(|w| invalid(rank, w))?;
        Ok((plan, wplan, oplan))
    }

    pub(crate) fn check_options(
        rank: usize,
        ranks: usize,
        o: &BufferOptions,
    ) -> Result<(), EpError> {
        if ranks == 0 || ranks > k::MAX_RANKS {
            return Err(invalid(
                rank,
                format!(
                    "{ranks} ranks: the intranode buffer supports 1..={}",
                    k::MAX_RANKS
                ),
            ));
        }
        if o.num_experts == 0 || o.num_experts % ranks != 0 {
            return Err(invalid(
                rank,
                format!(
                    "num_experts {} is not a positive multiple of {ranks} ranks",
                    o.num_experts
                ),
            ));
        }
        if o.num_experts > 48 * 1024 / 4 {
            return Err(invalid(
                rank,
                format!("num_experts {} above 12288", o.num_experts),
            ));
        }
        if o.max_tokens_per_rank == 0 || o.max_tokens_per_rank > i32::MAX as usize / k::MAX_RANKS {
            return Err(invalid(
                rank,
                format!("max_tokens_per_rank {} out of range", o.max_tokens_per_rank),
            ));
        }
        if o.max_hidden == 0 || o.max_hidden % 8 != 0 || o.max_hidden > MAX_HIDDEN {
            return Err(invalid(
                rank,
                format!(
                    "max_hidden {} is not a multiple of 8 in 8..={MAX_HIDDEN}",
                    o.max_hidden
                ),
            ));
        }
        if o.max_topk > MAX_TOPK {
            return Err(invalid(
                rank,
                format!("max_topk {} above {MAX_TOPK}", o.max_topk),
            ));
        }
        if o.max_live_outputs == 0 || o.max_live_outputs > MAX_LIVE_OUTPUTS {
            return Err(invalid(
                rank,
                format!(
                    "max_live_outputs {} out of 1..={MAX_LIVE_OUTPUTS}",
                    o.max_live_outputs
                ),
            ));
        }
        if let Err(e) = ibgda_device::timeout::check(o.timeout) {
            return Err(invalid(rank, format!("timeout: {e}")));
        }
        // Every size the buffer will compute, checked once here (before any allocation).
        Self::plans(rank, ranks, o, false)?;
        Ok(())
    }

    /// Gives this rank a compute stream of its own where it had the context's default stream:
    /// for a buffer whose operations another layer orders (the internode path), so that ranks
    /// of other groups on this GPU, which share the default stream, never chain behind it.
    pub(crate) fn private_compute_stream(&mut self) -> Result<(), EpError> {
        if self.gate.is_none() {
            let (s, lease) = ibgda_device::stream_pool::waiting(&self.ctx).map_err(|source| {
                EpError::Device {
                    rank: self.rank,
                    source,
                }
            })?;
            self._stream_leases.push(lease);
            self.compute = s;
        }
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
    /// Experts on each rank.
    pub fn num_local_experts(&self) -> usize {
        self.num_local_experts
    }
    /// The options the buffer was built with.
    pub fn options(&self) -> &BufferOptions {
        &self.opts
    }
    /// The GPU context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Where the ranks of this process sharing this GPU meet around every launch of a kernel
    /// that waits for them (`None` when this rank has its GPU to itself). Launch a CUDA graph
    /// captured from this buffer's operations through it ([`LaunchGate::around`]).
    pub fn launch_gate(&self) -> Option<&Arc<LaunchGate>> {
        self.gate.as_ref()
    }

    /// Which ranks of the group share this rank's GPU.
    pub fn gpu_share(&self) -> &GpuShare {
        &self.share
    }

    /// The largest `Config::num_sms` that keeps the ranks of this process on this GPU
    /// co-resident (every SM when this rank has its GPU to itself).
    pub fn sm_budget(&self) -> u32 {
        self.share.default_budget("", 0).unwrap_or(1)
    }

    /// The stream every operation runs on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm
    }
    /// The stream operations order against by default: the context's default stream, or, where
    /// ranks of this process share the GPU, a stream of this rank's own (the default stream is
    /// shared by all of them). Queue work that feeds an operation here, or pass an event.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// This rank's window as raw bytes (DeepEP's `get_local_buffer_tensor` of the NVLink
    /// buffer): the signal region at offset 0, then the combine staging and the receive regions,
    /// laid out as this crate plans them (not as DeepEP's). Peers read and write it during every
    /// operation: writing it while one is in flight corrupts that operation, and writing the
    /// signal region leaves the group out of step. The view keeps the window alive.
    pub fn local_window(&self) -> crate::Tensor<u8> {
        crate::Tensor::view(self.window.clone(), 0, vec![self.window.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intranode::plan::tests::opts;

    #[test]
    fn options_are_bounded_before_any_allocation() {
        let ok = opts(4096, 7168, 8, 256);
        assert!(Buffer::check_options(0, 8, &ok).is_ok());
        for (o, what) in [
            (opts(4096, MAX_HIDDEN + 8, 8, 256), "max_hidden"),
            (opts(4096, (usize::MAX / 4) & !7, 8, 256), "max_hidden"),
            (opts(4096, 7168, MAX_TOPK + 1, 256), "max_topk"),
            (opts(4096, 7168, 8, 1 << 40), "num_experts"),
            (
                BufferOptions {
                    max_live_outputs: MAX_LIVE_OUTPUTS + 1,
                    ..ok.clone()
                },
                "max_live_outputs",
            ),
        ] {
            match Buffer::check_options(3, 8, &o) {
                Err(EpError::InvalidArgument { rank: 3, what: w }) => {
                    assert!(w.contains(what), "{w}")
                }
                other => panic!("{what}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
}
