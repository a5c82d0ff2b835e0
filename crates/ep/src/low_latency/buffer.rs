//! [`LowLatencyBuffer`]: creation (peer windows, zeroed signals), dispatch, combine, hooks,
//! graph capture, bounded synchronisation and teardown.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaGraph, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use ep_kernels::low_latency as k;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::protocol::HANDLER_ENV;
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::firmware::EmuSubnet;

use super::mask::RankMask;
use super::plan::{msg_bytes, Dims, NetPlan, OutPlan};
use crate::bootstrap::{exchange_buffers, PeerBuffer};
use crate::dtype::{Bf16, Element, Fp8E4M3};
use crate::error::{invalid, EpError};
use crate::event::Event;
use crate::mapped::{ErrorReport, MappedHost};
use crate::rendezvous::Exchange;
use crate::residency::{gated, GpuShare, LaunchGate, EMULATED_NIC_SMS};
use crate::tensor::Tensor;
use crate::transport::{
    connect_mesh, decide_nic, open_transport, Mesh, NicChoice, NicDecision, NicKind, QpGroupConfig,
    RankTransport, Registration, TransportError, NIC_ENV,
};

/// Error word (`ep_kernels::intranode::ErrorWord`) at this offset of the mapped page.
const ERROR_OFFSET: usize = 0;
const MAPPED_BYTES: usize = 64;
/// Error code of a timed-out device wait (shared with the intranode kernels).
const ERR_TIMEOUT: u32 = ep_kernels::intranode::error_code::TIMEOUT;
/// QPs from each rank to each peer (transport mode). Traffic to one destination expert stays on
/// one QP (its signal must follow its rows), so more QPs spread experts over more emulator
/// streams; four keeps the per-peer QP count (and proxy work) small.
const QPS_PER_PEER: u32 = 4;
/// Send-ring size of each QP in WQEBBs: a dispatch of 128 tokens × top-8 over 4 QPs posts about
/// 256 puts plus the signals per QP; a full ring only makes the poster wait (bounded).
const QP_RING_WQEBBS: u32 = 1024;

/// Most experts a buffer holds: with the other bounds of [`check_options`] (tokens, hidden) every
/// region size stays far inside a `u64` and every row index inside the kernels' `i32`/`i64`.
const MAX_EXPERTS: usize = 1 << 14;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// What a [`LowLatencyBuffer`] must hold; fixed at creation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowLatencyOptions {
    /// Most tokens one rank dispatches at once (DeepEP's `num_max_dispatch_tokens_per_rank`).
    pub max_tokens_per_rank: usize,
    /// Largest hidden size: a multiple of 8, at most 8192.
    pub max_hidden: usize,
    /// Largest top-k width, at most 16.
    pub max_topk: usize,
    /// Experts over all ranks (a multiple of the rank count).
    pub num_experts: usize,
    /// Move data by NVLink stores between ranks whose GPUs can map each other. `false` sends every
    /// byte to another rank through the IBGDA transport (RDMA writes and remote adds on the
    /// emulated NIC, QPs to every peer, in the [`nic_handler`](Self::nic_handler) mode), with the
    /// ranks as threads ([`LowLatencyBuffer::create_group`]: one NIC per rank in one fabric) or
    /// as processes ([`LowLatencyBuffer::new`] over a
    /// [`TcpCommunicator`](crate::bootstrap::TcpCommunicator): one NIC per process, the peers'
    /// net buffers opened through CUDA IPC by the NIC, not the kernels). Threads of one process
    /// calling [`LowLatencyBuffer::new`] need `true`.
    pub allow_nvlink: bool,
    /// Who rings the NIC's doorbells when NVLink is disabled: `Gpu`, `CpuHostMemory`, `Cpu`
    /// (GDRCopy; creation fails cleanly without it) or `Auto`.
    pub nic_handler: HandlerChoice,
    /// Which NIC carries the transport when NVLink is disabled (`Auto`: a real mlx5 device when
    /// one is usable, else the emulated NIC; `EP_NIC` overrides).
    pub nic: NicChoice,
    /// Bound of every wait, on the GPU and on the host.
    pub timeout: Duration,
    /// Fill each output region with the byte 0xAB before every operation (tests).
    pub poison_outputs: bool,
    /// Rank masks (DeepEP's `enable_shrink`): ranks can be left out of the operations
    /// ([`LowLatencyBuffer::update_mask`]), and a receive wait that runs out of time masks the
    /// rank it waited for instead of failing the operation ([`LowLatencyBuffer::query_mask`]
    /// says who). Without it a timeout is an error.
    pub enable_shrink: bool,
}

impl LowLatencyOptions {
    /// Options for `max_tokens_per_rank` tokens of up to `max_hidden` channels, top-`max_topk`
    /// of `num_experts`; NVLink allowed, a 10 s bound, no poisoning.
    ///
    /// ```
    /// let o = ep::low_latency::LowLatencyOptions::new(128, 7168, 8, 288);
    /// assert!(o.allow_nvlink);
    /// ```
    pub fn new(
        max_tokens_per_rank: usize,
        max_hidden: usize,
        max_topk: usize,
        num_experts: usize,
    ) -> Self {
        Self {
            max_tokens_per_rank,
            max_hidden,
            max_topk,
            num_experts,
            allow_nvlink: true,
            nic_handler: HandlerChoice::Auto,
            nic: NicChoice::Auto,
            timeout: Duration::from_secs(10),
            poison_outputs: false,
            enable_shrink: false,
        }
    }

    /// Bytes of GPU memory a buffer of `ranks` ranks takes on each rank; `None` for options a
    /// buffer would refuse (their sizes are only computed once the options are in range, where
    /// none of them can overflow).
    ///
    /// ```
    /// let o = ep::low_latency::LowLatencyOptions::new(128, 7168, 8, 288);
    /// assert!(o.bytes_per_rank(4).is_some());
    /// assert!(ep::low_latency::LowLatencyOptions::new(128, 1 << 40, 8, 288)
    ///     .bytes_per_rank(4)
    ///     .is_none());
    /// ```
    pub fn bytes_per_rank(&self, ranks: usize) -> Option<usize> {
        check_options(0, ranks, self).ok()?;
        let d = self.dims(ranks);
        Some(
            NetPlan::new(&d).bytes
                + 2 * OutPlan::new(&d).bytes
                + 2 * self.max_tokens_per_rank * self.max_hidden * 2,
        )
    }

    fn dims(&self, ranks: usize) -> Dims {
        Dims {
            ranks,
            max_tokens: self.max_tokens_per_rank,
            max_hidden: self.max_hidden,
            num_experts: self.num_experts,
        }
    }
}

/// In-kernel FP8 cast of the dispatched rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp8Options {
    /// Round each scale up to a power of two.
    pub round_scale: bool,
    /// Return the scales as UE8M0 exponent bytes packed 4 per `i32` (implies `round_scale`;
    /// hidden must be a multiple of 512).
    pub ue8m0: bool,
}

/// The arguments of [`LowLatencyBuffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct LlDispatchArgs<'a> {
    /// BF16 `[tokens][hidden]`.
    pub x: &'a Tensor<Bf16>,
    /// Global expert ids `[tokens][k]`, -1 for none.
    pub topk_idx: &'a Tensor<i32>,
    /// Cast to FP8 in the kernel, or send BF16.
    pub fp8: Option<Fp8Options>,
    /// Send only and return a [`RecvHook`] that receives.
    pub return_recv_hook: bool,
    /// Thread blocks (at most one per SM); `None`: every SM.
    pub num_sms: Option<u32>,
    /// `i64 [ranks]`: the receive adds the GPU cycles it waited for each source rank (DeepEP's
    /// `dispatch_wait_recv_cost_stats`).
    pub wait_stats: Option<&'a Tensor<i64>>,
}

impl<'a> LlDispatchArgs<'a> {
    /// A BF16 dispatch of `x` by `topk_idx` on every SM, receiving in the same kernel.
    pub fn new(x: &'a Tensor<Bf16>, topk_idx: &'a Tensor<i32>) -> Self {
        Self {
            x,
            topk_idx,
            fp8: None,
            return_recv_hook: false,
            num_sms: None,
            wait_stats: None,
        }
    }
}

/// One scale per 128 channels of each received row.
#[derive(Debug, Clone)]
pub enum LlScales {
    /// f32 `[local][ranks × max tokens][hidden / 128]`.
    F32(Tensor<f32>),
    /// UE8M0 exponents, byte `j` of word `w` for channels `(4w + j) × 128 ..`:
    /// `[local][ranks × max tokens][hidden / 512]`.
    Ue8m0(Tensor<i32>),
}

/// The received rows, packed per local expert.
#[derive(Debug, Clone)]
pub enum LlRecvX {
    /// BF16 `[local][ranks × max tokens][hidden]`.
    Bf16(Tensor<Bf16>),
    /// FP8 `[local][ranks × max tokens][hidden]` with its scales.
    Fp8 {
        /// The values.
        x: Tensor<Fp8E4M3>,
        /// The scales (`x ≈ value × scale`).
        scales: LlScales,
    },
}

/// What combine needs to know about a dispatch. Opaque: its routing tensors are
/// [read-only](Tensor::is_read_only), and the kernels check every offset they take from them all
/// the same (a value out of range is reported as [`EpError::CorruptRouting`], never written by).
/// A hook-mode dispatch's handle is usable by combine only once its [`RecvHook`] has been called.
#[derive(Debug, Clone)]
pub struct LlHandle {
    buffer_id: u64,
    src_info: Tensor<i32>,
    layout_range: Tensor<i32>,
    /// The dispatch's output region (its top-k ids are there, read by the combine receive).
    region: Arc<DeviceBuffer>,
    /// The dispatch's top-k width.
    topk: usize,
    /// Whether the receive that fills the routing tensors has been queued.
    received: Arc<AtomicBool>,
    num_tokens: usize,
    hidden: usize,
}

impl LlHandle {
    /// Source token of each packed row, `[local][ranks × max tokens]` (read-only).
    pub fn src_info(&self) -> &Tensor<i32> {
        &self.src_info
    }
    /// (first row, rows) of each source rank in each local expert, `[local][ranks][2]`
    /// (read-only).
    pub fn layout_range(&self) -> &Tensor<i32> {
        &self.layout_range
    }
    /// Whether the dispatch's receive has been queued (always, without a hook; after
    /// [`RecvHook::call`] with one): combine refuses a handle whose receive never ran.
    pub fn is_received(&self) -> bool {
        self.received.load(Ordering::Acquire)
    }
    /// The dispatch's top-k width (combine's `topk_idx` must have it).
    pub fn topk(&self) -> usize {
        self.topk
    }
    /// Tokens this rank dispatched (rows of the combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// The dispatch's hidden size.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

/// What a dispatch returns. With a hook, nothing but the handle's shape is valid until the hook
/// has run (on the stream).
#[derive(Debug)]
pub struct LlDispatchOutput {
    /// Packed rows per local expert.
    pub x: LlRecvX,
    /// Rows received per local expert, `[local]`.
    pub recv_count: Tensor<i32>,
    /// For combine.
    pub handle: LlHandle,
    /// The receive, when `return_recv_hook` was set.
    pub hook: Option<RecvHook>,
}

/// The expert outputs to combine.
#[derive(Debug, Clone, Copy)]
pub enum LlCombineX<'a> {
    /// BF16 `[local][ranks × max tokens][hidden]`, rows as the dispatch packed them.
    Tensor(&'a Tensor<Bf16>),
    /// Already in [`LowLatencyBuffer::combine_input`] (zero-copy), with the dispatch's hidden.
    ZeroCopy,
}

/// The arguments of [`LowLatencyBuffer::combine`].
#[derive(Debug, Clone, Copy)]
pub struct LlCombineArgs<'a> {
    /// The expert outputs.
    pub x: LlCombineX<'a>,
    /// The dispatch's top-k ids `[tokens][k]`.
    pub topk_idx: &'a Tensor<i32>,
    /// Weights `[tokens][k]`.
    pub topk_weights: &'a Tensor<f32>,
    /// The dispatch's handle.
    pub handle: &'a LlHandle,
    /// Send only and return a [`RecvHook`] that receives and reduces.
    pub return_recv_hook: bool,
    /// Thread blocks; `None`: every SM.
    pub num_sms: Option<u32>,
    /// `i64 [ranks]`: the receive adds the GPU cycles it waited for each source rank (DeepEP's
    /// `combine_wait_recv_cost_stats`).
    pub wait_stats: Option<&'a Tensor<i64>>,
    /// Send the rows in LogFMT-10 (see [`logfmt`](super::logfmt)): groups of 128 channels whose
    /// magnitudes are below 1 travel as 10-bit log-domain codes (160 bytes instead of 256).
    /// Lossy (about 2^-8 relative per value); hidden a multiple of 128; not with zero-copy.
    pub use_logfmt: bool,
}

impl<'a> LlCombineArgs<'a> {
    /// Combine `x` over `handle` with the dispatch's routing, receiving in the same kernel.
    pub fn new(
        x: LlCombineX<'a>,
        topk_idx: &'a Tensor<i32>,
        topk_weights: &'a Tensor<f32>,
        handle: &'a LlHandle,
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights,
            handle,
            return_recv_hook: false,
            num_sms: None,
            wait_stats: None,
            use_logfmt: false,
        }
    }
}

/// What a combine returns.
#[derive(Debug)]
pub struct LlCombineOutput {
    /// `Σ_k weight × expert output` per token (f32 accumulation), BF16 `[tokens][hidden]`.
    pub x: Tensor<Bf16>,
    /// The receive, when `return_recv_hook` was set.
    pub hook: Option<RecvHook>,
}

#[derive(Debug, Clone, Copy)]
enum HookParams {
    Dispatch(k::LlDispatchParams),
    Combine(k::LlCombineParams),
}

/// The receive half of a hook-mode operation: [`call`](Self::call) queues it on the buffer's
/// stream. It keeps the memory it writes alive; call it before the buffer's next operation on
/// the same half, and before tearing the buffer down. A dispatch's handle is refused by combine
/// until its hook has been called.
#[must_use = "a dispatch or combine whose receive hook is never called receives nothing"]
pub struct RecvHook {
    params: HookParams,
    /// Set once the receive is queued (the dispatch handle's flag; unused for combine).
    received: Option<Arc<AtomicBool>>,
    func: CudaFunction,
    stream: Arc<CudaStream>,
    grid: u32,
    rank: usize,
    /// The launch gate of ranks sharing this GPU, and its bound (`None`: not shared).
    gate: Option<(Arc<LaunchGate>, Duration)>,
    _keep: Vec<Arc<DeviceBuffer>>,
    _keep_routing: Option<(Tensor<i32>, Tensor<f32>)>,
    _keep_stats: Option<Tensor<i64>>,
    _mapped: Arc<MappedHost>,
    _errors: Arc<ErrorReport>,
}

impl std::fmt::Debug for RecvHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvHook")
            .field("params", &self.params)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl RecvHook {
    /// Queues the receive on the buffer's stream (no host wait).
    pub fn call(self) -> Result<(), EpError> {
        let gate = self.gate.as_ref().map(|(g, t)| (&**g, *t));
        let queued = match &self.params {
            HookParams::Dispatch(p) => launch(
                gate,
                &self.stream,
                &self.func,
                self.grid,
                p,
                self.rank,
                "cuLaunchKernel(ep_ll_dispatch recv)",
            ),
            HookParams::Combine(p) => launch(
                gate,
                &self.stream,
                &self.func,
                self.grid,
                p,
                self.rank,
                "cuLaunchKernel(ep_ll_combine recv)",
            ),
        };
        if queued.is_ok() {
            if let Some(r) = &self.received {
                r.store(true, Ordering::Release);
            }
        }
        queued
    }
}

/// A captured sequence of low-latency operations, replayed on the buffer's stream.
pub struct LlGraph {
    graph: CudaGraph,
    rank: usize,
    /// The launch gate of ranks sharing this GPU, and its bound (`None`: not shared).
    gate: Option<(Arc<LaunchGate>, Duration)>,
}

impl std::fmt::Debug for LlGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlGraph")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl LlGraph {
    /// Queues one replay (no host wait). Every rank replays its graph the same number of times;
    /// ranks of this process sharing a GPU meet around each replay, as around every launch.
    pub fn replay(&self) -> Result<(), EpError> {
        let go = || {
            self.graph.launch().map_err(|source| EpError::Cuda {
                rank: self.rank,
                call: "cuGraphLaunch",
                source,
            })
        };
        let gate = self.gate.as_ref().map(|(g, t)| (&**g, *t));
        gated(gate, self.rank, "cuGraphLaunch (low-latency graph)", go)
    }
}

/// Where ranks of this process sharing a GPU meet around a launch, and for how long at most.
type Gate<'a> = Option<(&'a LaunchGate, Duration)>;

/// Launches a low-latency kernel (they all wait for other ranks), through `gate` where ranks of
/// this process share the GPU.
fn launch<P: DeviceRepr>(
    gate: Gate<'_>,
    stream: &CudaStream,
    f: &CudaFunction,
    grid: u32,
    p: &P,
    rank: usize,
    call: &'static str,
) -> Result<(), EpError> {
    gated(gate, rank, call, || {
        launch_now(stream, f, grid, p, rank, call)
    })
}

fn launch_now<P: DeviceRepr>(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: u32,
    p: &P,
    rank: usize,
    call: &'static str,
) -> Result<(), EpError> {
    let mut b = stream.launch_builder(f);
    b.arg(p);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (k::THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // Every address in `P` is a live allocation of this rank (kept alive by the buffer or the
    // hook) or a peer's window, which stays mapped until the group's teardown barrier.
    // SAFETY: every low-latency kernel takes exactly one by-value parameter struct and `P` is the
    // #[repr(C)] mirror of that kernel's struct (the callers pair them); addresses as above.
    unsafe { b.launch(cfg) }.map_err(|source| EpError::Cuda { rank, call, source })?;
    Ok(())
}

/// One rank's low-latency buffer.
pub struct LowLatencyBuffer {
    id: u64,
    rank: usize,
    ranks: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `stream`'s hardware queue, held while the buffer lives (see `ibgda_device::stream_pool`).
    _stream_lease: ibgda_device::stream_pool::StreamLease,
    opts: LowLatencyOptions,
    dims: Dims,
    dispatch_fn: CudaFunction,
    combine_fn: CudaFunction,
    sleep_fn: CudaFunction,
    net: Arc<DeviceBuffer>,
    net_plan: NetPlan,
    out_plan: OutPlan,
    peer_base: [u64; k::MAX_RANKS],
    state: Arc<DeviceBuffer>,
    /// The rank mask, with `enable_shrink`.
    mask: Option<RankMask>,
    dispatch_out: [Arc<DeviceBuffer>; 2],
    combine_out: [Arc<DeviceBuffer>; 2],
    dispatch_half: usize,
    combine_half: usize,
    mapped: Arc<MappedHost>,
    /// What the kernels get as `error` (points at the error word in `mapped`).
    errors: Arc<ErrorReport>,
    group: Arc<dyn Exchange>,
    sms: u32,
    /// Who shares this GPU; the default grid that keeps them co-resident.
    share: GpuShare,
    /// Where the ranks of this process sharing this GPU meet around every launch
    /// ([`crate::residency`]); `None` when this rank has its GPU to itself.
    launch_gate: Option<Arc<LaunchGate>>,
    /// Inside [`capture`](Self::capture): nothing is launched, so nothing is gated (replays are).
    capturing: bool,
    budget: u32,
    calls: u64,
    poisoned: Option<String>,
    shut_down: bool,
    transport: Option<LlNet>,
    /// Ranks as processes: the peers' net buffers mapped here (CUDA IPC), this rank's own entry
    /// included; empty for ranks as threads. Released after the teardown barrier (or leaked
    /// when this rank's stream did not finish, since a kernel may still write through them).
    windows: Vec<PeerBuffer>,
}

/// The NICs of a group whose ranks are threads of this process (NVLink disabled), opened
/// together so that emulated NICs share one fabric.
#[derive(Debug)]
struct SharedNics {
    ranks: Vec<Arc<dyn RankTransport>>,
    decision: NicDecision,
}

/// This rank's transport (NVLink disabled): QPs to every peer, the table the kernels read, and
/// the registered net buffer. Fields drop in order: the NIC last, after every QP.
struct LlNet {
    /// Per rank: this rank's QPs to it and the responders its QPs write through.
    mesh: Mesh,
    /// [`k::LlTransport`] in device memory.
    table: DeviceBuffer,
    handler: NicHandler,
    _registration: Box<dyn Registration>,
    /// Kept until the QPs are gone (dropped last).
    _nic: Arc<dyn RankTransport>,
}

impl LlNet {
    /// The first failure any of this rank's QP sets recorded.
    fn first_failure(&self, prefer: Option<usize>) -> Option<(usize, TransportError)> {
        self.mesh.first_failure(prefer)
    }

    /// Stops the proxies and destroys the QPs (this rank's, then the responders); then drops
    /// the NIC, whose progress thread stops before the peers' memory it opened is closed. The
    /// first error.
    fn close(self) -> Result<(), (usize, TransportError)> {
        let LlNet {
            mesh,
            table,
            handler: _,
            _registration,
            _nic,
        } = self;
        let closed = mesh.close();
        drop(table);
        drop(_registration);
        drop(_nic);
        closed
    }
}

/// The NIC the transport runs on: `asked` (the options'), unless `EP_NIC` overrides it.
fn transport_nic(rank: usize, asked: NicChoice) -> Result<NicDecision, EpError> {
    let choice = NicChoice::from_env_or(asked)
        .map_err(|e| transport_err(rank, &format!("choosing the NIC ({NIC_ENV})"), e))?;
    transport_nic_for(rank, choice)
}

fn transport_nic_for(rank: usize, choice: NicChoice) -> Result<NicDecision, EpError> {
    decide_nic(choice)
        .map_err(|e| transport_err(rank, &format!("choosing the NIC ({NIC_ENV}={choice})"), e))
}

impl std::fmt::Debug for LowLatencyBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LowLatencyBuffer")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl LowLatencyBuffer {
    /// Builds one buffer per context, ranks as threads of this process (rank `i` on `ctxs[i]`).
    pub fn create_group(
        ctxs: &[Arc<CudaContext>],
        opts: &LowLatencyOptions,
    ) -> Result<Vec<LowLatencyBuffer>, EpError> {
        // NVLink disabled: one NIC per rank, opened together (emulated NICs on one fabric), so
        // every rank can connect QPs to every other.
        let nics = if opts.allow_nvlink {
            None
        } else {
            let decision = transport_nic(0, opts.nic)?;
            let subnet = EmuSubnet::new();
            let ranks = ctxs
                .iter()
                .enumerate()
                .map(|(r, ctx)| {
                    open_transport(&decision.kind, ctx, r as u32, Some(&subnet)).map_err(|e| {
                        transport_err(r, &format!("opening the NIC ({})", decision.kind), e)
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Some(Arc::new(SharedNics { ranks, decision }))
        };
        crate::rendezvous::build_as_threads(ctxs, opts.timeout, |ctx, comm| {
            let m: Arc<dyn Exchange> = Arc::new(comm);
            LowLatencyBuffer::build(ctx, m, opts, nics.clone())
        })
    }

    /// Builds this rank's buffer on `ctx` (this rank's GPU); every rank of `group` calls this at
    /// the same time, with the same options. The group is kept for the teardown barrier
    /// ([`shutdown`](Self::shutdown), or drop).
    ///
    /// The ranks may be threads of this process or processes (a
    /// [`TcpCommunicator`](crate::bootstrap::TcpCommunicator), for example from
    /// [`Launcher::run_shared`](crate::bootstrap::Launcher::run_shared)), one GPU each, the GPUs
    /// able to access each other. Processes share their buffers through CUDA IPC
    /// ([`exchange_buffers`]: each rank maps every peer's buffer once) and the kernels store
    /// into the mapped buffers over NVLink, as threads do.
    ///
    /// With `allow_nvlink = false` and ranks as processes, each process starts its own emulated
    /// NIC (on a fabric shared by the process), registers its net buffer, and the ranks connect
    /// QPs to every peer through `group` (QP infos carrying the buffers as CUDA IPC handles, which
    /// each NIC opens); the kernels then reach peers only through the transport, as with
    /// [`create_group`](Self::create_group). Ranks as threads of one process need
    /// [`create_group`](Self::create_group) for that: here they fail at once, before any
    /// collective. A handler mode this machine cannot run (mode `cpu` without GDRCopy) fails on
    /// every rank alike, before any collective. A rank whose options differ from the others'
    /// makes every rank fail with [`EpError::Rendezvous`] naming it.
    pub fn new(
        ctx: &Arc<CudaContext>,
        group: Arc<dyn Exchange>,
        opts: &LowLatencyOptions,
    ) -> Result<LowLatencyBuffer, EpError> {
        Self::build(ctx, group, opts, None)
    }

    fn build(
        ctx: &Arc<CudaContext>,
        group: Arc<dyn Exchange>,
        opts: &LowLatencyOptions,
        nics: Option<Arc<SharedNics>>,
    ) -> Result<LowLatencyBuffer, EpError> {
        let rank = group.rank();
        let ranks = group.ranks();
        check_options(rank, ranks, opts)?;
        // Ranks as processes reach each other's net buffers through CUDA IPC mappings.
        let procs = !group.same_process();
        // The NIC (`EP_NIC`) and the handler mode (`IBGDA_NIC_HANDLER` overrides the options),
        // before any collective, so every rank refuses the same way at once (no mlx5 device for
        // `EP_NIC=real`; mode cpu without GDRCopy).
        let nic: Option<(Arc<dyn RankTransport>, NicDecision)> = match (opts.allow_nvlink, nics) {
            (true, _) => None,
            (false, Some(n)) if n.ranks.len() == ranks => {
                Some((n.ranks[rank].clone(), n.decision.clone()))
            }
            // Ranks as processes: this process's own NIC for this rank.
            (false, _) if procs => {
                let decision = transport_nic(rank, opts.nic)?;
                let t = open_transport(&decision.kind, ctx, rank as u32, None).map_err(|e| {
                    transport_err(rank, &format!("opening the NIC ({})", decision.kind), e)
                })?;
                Some((t, decision))
            }
            (false, _) => {
                return Err(invalid(
                    rank,
                    "allow_nvlink = false (every byte through the transport) with ranks as \
                     threads of one process needs their NICs built together: build the buffers \
                     with LowLatencyBuffer::create_group (ranks as processes build their own)",
                ));
            }
        };
        let handler = match &nic {
            Some((t, decision)) => {
                let asked = HandlerChoice::from_env_or(opts.nic_handler)
                    .map_err(|e| invalid(rank, format!("{HANDLER_ENV}: {e}")))?;
                let (mode, why) = t.select(asked).map_err(|e| {
                    let need = if asked == HandlerChoice::Cpu {
                        " (mode cpu needs GDRCopy: libgdrapi and the gdrdrv driver)"
                    } else {
                        ""
                    };
                    transport_err(rank, &format!("NIC handler {}{need}", asked.name()), e)
                })?;
                tracing::info!(
                    target: "ep",
                    "rank {rank}: NIC {} ({}); handler mode {} ({why})",
                    decision.kind,
                    decision.why,
                    mode.name()
                );
                Some(mode)
            }
            None => None,
        };
        let nics = nic.map(|(t, _)| t);
        let dev = |source| EpError::Device { rank, source };
        let cuda = |call, source| EpError::Cuda { rank, call, source };
        let f = |name| {
            ep_kernels::load_function(ctx, k::MODULE, name)
                .map_err(|source| EpError::Kernel { rank, source })
        };
        // The transport kernels carry the protocol code; the NVLink ones have none of it.
        let (dispatch_fn, combine_fn) = if nics.is_some() {
            (f("ep_ll_dispatch_net")?, f("ep_ll_combine_net")?)
        } else {
            (f("ep_ll_dispatch")?, f("ep_ll_combine")?)
        };
        let sleep_fn = f("ep_ll_sleep")?;
        // Its kernels spin for the peers (and the NIC): a hardware queue of its own.
        let (stream, stream_lease) = ibgda_device::stream_pool::waiting(ctx)
            .map_err(|source| EpError::Device { rank, source })?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda("cuDeviceGetAttribute", e))?
            .max(1) as u32;

        let dims = opts.dims(ranks);
        let net_plan = NetPlan::new(&dims);
        let out_plan = OutPlan::new(&dims);
        // Signals and flags start at zero (an arena is zeroed); the rest is written before it is
        // read.
        let (net, arena) = match &nics {
            None => {
                let net = DeviceBuffer::new(ctx, net_plan.bytes).map_err(dev)?;
                net.fill_bytes(0).map_err(dev)?;
                (Arc::new(net), None)
            }
            Some(n) => {
                let a = n
                    .register(net_plan.bytes)
                    .map_err(|e| transport_err(rank, "registering the net buffer", e))?;
                let net = a.device().cloned().ok_or_else(|| {
                    transport_setup(rank, "the NIC registered host memory on a GPU rank")
                })?;
                (net, Some(a))
            }
        };
        let state = DeviceBuffer::new(ctx, k::state_bytes(opts.num_experts)).map_err(dev)?;
        state.fill_bytes(0).map_err(dev)?;
        let mask = if opts.enable_shrink {
            Some(RankMask::new(ctx, rank, ranks)?)
        } else {
            None
        };
        let region = |bytes| -> Result<Arc<DeviceBuffer>, EpError> {
            Ok(Arc::new(DeviceBuffer::new(ctx, bytes).map_err(dev)?))
        };
        let comb_bytes = opts.max_tokens_per_rank * opts.max_hidden * 2;
        let dispatch_out = [region(out_plan.bytes)?, region(out_plan.bytes)?];
        let combine_out = [region(comb_bytes)?, region(comb_bytes)?];
        let mapped = Arc::new(MappedHost::new(ctx, MAPPED_BYTES, rank)?);
        let errors = Arc::new(ErrorReport::new(ctx, &mapped, ERROR_OFFSET, rank)?);

        let rkey = arena.as_ref().map_or(0, |a| u64::from(a.rkey()));
        // What every rank must agree on: the net buffer's layout follows from the options, and
        // peers write into it at offsets computed from their own.
        let agree = [
            u64::from(procs),
            u64::from(opts.allow_nvlink),
            opts.max_tokens_per_rank as u64,
            opts.max_hidden as u64,
            opts.max_topk as u64,
            opts.num_experts as u64,
            net_plan.bytes as u64,
        ];
        let mine: Vec<u64> = [ctx.ordinal() as u64, net.ptr(), rkey]
            .into_iter()
            .chain(agree)
            .collect();
        // Who shares this GPU, so that ranks of this process on it are given grids that fit on
        // it together (the kernels wait in every block).
        let share = GpuShare::gather(ctx, &*group)?;
        // The emulated NIC's copies need SMs left free; a real NIC needs none.
        let reserved = match &nics {
            Some(n) if matches!(n.nic(), NicKind::Emulated | NicKind::EmulatedVerbs) => {
                EMULATED_NIC_SMS
            }
            _ => 0,
        };
        let budget = share.default_budget("a low-latency buffer", reserved)?;
        let all = group.all_gather(&mine)?;
        for (r, v) in all.iter().enumerate() {
            if v.len() != mine.len() {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!("rank {r} sent {} words, expected {}", v.len(), mine.len()),
                });
            }
            if v[3..] != agree {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!(
                        "rank {r} builds a different low-latency buffer ([processes, \
                         allow_nvlink, max_tokens, max_hidden, max_topk, experts, net bytes] \
                         {:?}, this rank {agree:?}): every rank must pass the same options",
                        &v[3..]
                    ),
                });
            }
        }
        let mut peer_base = [0u64; k::MAX_RANKS];
        let mut table = k::LlTransport::default();
        // Ranks as processes over NVLink: every rank exports its net buffer and maps the others'
        // (CUDA IPC; ranks of this process are reached by peer access there). A collective, after
        // which peers may write into `net` only once the final barrier below has passed.
        let windows = if procs && nics.is_none() {
            let windows = exchange_buffers(&*group, ctx, &net)
                .map_err(|source| EpError::Bootstrap { rank, source })?;
            for w in &windows {
                if w.rank() >= ranks || w.len() != net_plan.bytes {
                    return Err(EpError::Rendezvous {
                        rank,
                        what: format!(
                            "rank {}'s net buffer is {} bytes, expected {}",
                            w.rank(),
                            w.len(),
                            net_plan.bytes
                        ),
                    });
                }
                peer_base[w.rank()] = w.ptr();
            }
            windows
        } else if procs {
            // Ranks as processes over the transport: the kernels store only into this rank's
            // buffer; the peers' NICs write into it at its own addresses (what its registration
            // names), and this rank's NIC into theirs (opened when the QPs connect, below).
            peer_base[rank] = net.ptr();
            for (r, v) in all.iter().enumerate() {
                table.rbase[r] = v[1];
                table.rkey[r] = v[2];
            }
            Vec::new()
        } else {
            // Ranks as threads: the peers' own addresses, once this context may access theirs.
            // (A GPU ordinal means nothing in another process, so only here.)
            for (r, v) in all.iter().enumerate() {
                // Also with NVLink disabled: the emulated NIC's copies between GPUs go peer to
                // peer.
                let peer_ctx = ibgda_device::cuda::context(v[0] as usize).map_err(dev)?;
                ibgda_device::cuda::enable_peer_access(ctx, &peer_ctx).map_err(dev)?;
                // Transport: the kernels reach only their own buffer by stores.
                peer_base[r] = if nics.is_none() || r == rank { v[1] } else { 0 };
                table.rbase[r] = v[1];
                table.rkey[r] = v[2];
            }
            Vec::new()
        };
        let transport = match (nics, handler, arena) {
            (Some(nics), Some(handler), Some(arena)) => {
                let cfg = |r: usize| QpGroupConfig {
                    handler,
                    nqps: QPS_PER_PEER,
                    nwqes: QP_RING_WQEBBS,
                    timeout: opts.timeout,
                    peer_rank: r as u32,
                    ..Default::default()
                };
                // Three collectives; a rank that fails makes every rank fail at once.
                let mesh =
                    connect_mesh(&*nics, &*group, &*arena, QPS_PER_PEER, cfg, |doing, e| {
                        transport_err(rank, doing, e)
                    })?;
                for (r, g) in mesh.sets.iter().enumerate() {
                    if let Some(g) = g {
                        table.descs[r] = g.descs().ok_or_else(|| {
                            transport_setup(rank, "the NIC gave host descriptors on a GPU rank")
                        })?;
                    }
                }
                table.nqps = u64::from(QPS_PER_PEER);
                table.stage_off = net_plan.stage as u64;
                table.comb_send_off = net_plan.comb_send as u64;
                let table = DeviceBuffer::from_slice(ctx, &table.to_words()).map_err(dev)?;
                tracing::info!(
                    target: "ep",
                    "rank {rank}: low-latency buffer over the {} NIC, NVLink disabled, mode {}, {QPS_PER_PEER} QPs per peer, ranks as {}",
                    nics.nic(),
                    handler.name(),
                    if procs { "processes" } else { "threads" }
                );
                Some(LlNet {
                    mesh,
                    table,
                    handler,
                    _registration: arena,
                    _nic: nics,
                })
            }
            _ => None,
        };
        // The memsets and uploads above ran on the legacy stream (cuMemsetD8 and pageable
        // uploads may return before the device has finished them); the kernels run on a
        // non-blocking stream and peers (or their NICs) write here: all of it must have landed.
        ibgda_device::cuda::wait_legacy_stream(
            ctx,
            ibgda_device::cuda::LEGACY_STREAM_BOUND,
            "the memsets and uploads of buffer creation",
        )
        .map_err(|source| EpError::Device { rank, source })?;
        // Nobody signals a peer before every rank has zeroed its own signals and connected its
        // QPs.
        group.all_gather(&[])?;
        Ok(LowLatencyBuffer {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            rank,
            ranks,
            ctx: ctx.clone(),
            stream,
            _stream_lease: stream_lease,
            opts: opts.clone(),
            dims,
            dispatch_fn,
            combine_fn,
            sleep_fn,
            net,
            net_plan,
            out_plan,
            peer_base,
            state: Arc::new(state),
            mask,
            dispatch_out,
            combine_out,
            dispatch_half: 0,
            combine_half: 0,
            mapped,
            errors,
            group,
            sms,
            launch_gate: share.gate(),
            share,
            capturing: false,
            budget,
            calls: 0,
            poisoned: None,
            shut_down: false,
            transport,
            windows,
        })
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
        self.dims.local()
    }
    /// The options the buffer was built with.
    pub fn options(&self) -> &LowLatencyOptions {
        &self.opts
    }
    /// The GPU context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every operation (and hook, and graph replay) runs on. Order other work against
    /// it with [`Event`]s.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// SMs of this GPU.
    pub fn num_sms(&self) -> u32 {
        self.sms
    }
    /// The default grid (blocks, one per SM): every SM when this rank has its GPU to itself,
    /// else the GPU's SMs split evenly among the ranks of this process that share it (their
    /// kernels wait for each other and must all be resident: see [`crate::residency`]).
    pub fn sm_budget(&self) -> u32 {
        self.budget
    }
    /// Which ranks of the group share this rank's GPU.
    pub fn gpu_share(&self) -> &GpuShare {
        &self.share
    }
    /// The NIC-handler mode of the transport, or `None` when the data moves by NVLink.
    pub fn nic_handler(&self) -> Option<NicHandler> {
        self.transport.as_ref().map(|t| t.handler)
    }

    /// Transport mode: this rank's NIC and, per rank, the QP numbers of this rank's QPs to it
    /// (empty for itself); what fault injection ([`super::faults`]) needs, and nothing more.
    pub(super) fn emulated_qps(&self) -> Option<(&ibgda_emu::Nic, Vec<Vec<u32>>)> {
        let t = self.transport.as_ref()?;
        let qpns = t
            .mesh
            .sets
            .iter()
            .map(|g| g.as_ref().map_or(Vec::new(), |g| g.qpns()))
            .collect();
        Some((t._nic.emulated_nic()?, qpns))
    }

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

    fn usable(&self) -> Result<(), EpError> {
        match &self.poisoned {
            Some(first) => Err(EpError::Poisoned {
                rank: self.rank,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    fn check_hidden(&self, h: usize, multiple: usize, what: &str) -> Result<(), EpError> {
        if h == 0 || h % multiple != 0 || h > self.opts.max_hidden {
            return Err(invalid(
                self.rank,
                format!(
                    "{what} {h}: expected a multiple of {multiple} in {multiple}..={}",
                    self.opts.max_hidden
                ),
            ));
        }
        Ok(())
    }

    fn shape_is<T: Element>(
        &self,
        t: &Tensor<T>,
        want: &[usize],
        name: &str,
    ) -> Result<(), EpError> {
        if t.device_ordinal() != self.ctx.ordinal() {
            return Err(invalid(
                self.rank,
                format!(
                    "{name} is on GPU {}, this rank uses GPU {}",
                    t.device_ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        if t.shape() != want {
            return Err(invalid(
                self.rank,
                format!(
                    "{name} ({}) has shape {:?}, expected {want:?}",
                    T::NAME,
                    t.shape()
                ),
            ));
        }
        Ok(())
    }

    /// The grid of a waiting kernel: `num_sms`, or the default budget; refused before launch
    /// when it is out of range or the ranks of this process on this GPU would not fit together.
    fn grid(&self, what: &str, num_sms: Option<u32>) -> Result<u32, EpError> {
        let n = match num_sms {
            None => return Ok(self.budget),
            Some(n) if n >= 1 && n <= self.sms => n,
            Some(n) => {
                return Err(invalid(
                    self.rank,
                    format!("num_sms {n} out of 1..={} (one block per SM)", self.sms),
                ))
            }
        };
        let reserved = if self.transport.is_some() {
            EMULATED_NIC_SMS
        } else {
            0
        };
        self.share.check(what, n, reserved)?;
        Ok(n)
    }

    fn free_half(&self, region: &Arc<DeviceBuffer>, what: &'static str) -> Result<(), EpError> {
        // The buffer holds one reference; any other is a live output, handle or hook.
        if Arc::strong_count(region) > 1 {
            return Err(EpError::RegionsInUse {
                rank: self.rank,
                what,
                limit: 2,
            });
        }
        Ok(())
    }

    fn poison(&self, region: &DeviceBuffer) -> Result<(), EpError> {
        if self.opts.poison_outputs {
            // SAFETY: the whole live allocation is written, ordered on this buffer's stream.
            unsafe {
                sys::cuMemsetD8Async(region.ptr(), 0xAB, region.len(), self.stream.cu_stream())
            }
            .result()
            .map_err(|source| EpError::Cuda {
                rank: self.rank,
                call: "cuMemsetD8Async",
                source,
            })?;
        }
        Ok(())
    }

    fn timeout_ns(&self) -> u64 {
        ibgda_device::timeout::device_ns(self.opts.timeout)
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
            out_x: base + o.x as u64,
            out_scales: if fp8.is_some() {
                base + o.scales as u64
            } else {
                0
            },
            out_src_info: base + o.src_info as u64,
            out_layout: base + o.layout as u64,
            out_count: base + o.count as u64,
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

        let (l, cap) = (self.dims.local(), self.dims.cap());
        let x = match fp8 {
            None => LlRecvX::Bf16(Tensor::view(region.clone(), o.x, vec![l, cap, h])),
            Some(_) => LlRecvX::Fp8 {
                x: Tensor::view(region.clone(), o.x, vec![l, cap, h]),
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
            recv_count: Tensor::view(region.clone(), o.count, vec![l]),
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
            out: out.ptr(),
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
            x: Tensor::view(out, 0, vec![t, h]),
            hook,
        })
    }

    /// Captures what `f` queues on the buffer's stream into a graph (no host waits are allowed
    /// inside; the low-latency operations make none). The buffer's halves alternate at capture
    /// time, so a graph's replays reuse the halves and outputs that capture returned.
    pub fn capture<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, EpError>,
    ) -> Result<(LlGraph, R), EpError> {
        let rank = self.rank;
        let cuda = move |call, source| EpError::Cuda { rank, call, source };
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda("cuStreamBeginCapture", e))?;
        self.capturing = true;
        let r = f(self);
        self.capturing = false;
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| cuda("cuStreamEndCapture", e));
        let r = r?;
        let graph = g?.ok_or_else(|| invalid(self.rank, "the capture recorded no work"))?;
        Ok((
            LlGraph {
                graph,
                rank: self.rank,
                gate: self.gate_for_hook(),
            },
            r,
        ))
    }

    /// The launch gate for a launch now (none while capturing or when the GPU is not shared).
    fn gate(&self) -> Gate<'_> {
        match (&self.launch_gate, self.capturing) {
            (Some(g), false) => Some((&**g, self.opts.timeout)),
            _ => None,
        }
    }

    /// The launch gate for a launch later (a hook, a graph replay).
    fn gate_for_hook(&self) -> Option<(Arc<LaunchGate>, Duration)> {
        self.launch_gate
            .as_ref()
            .map(|g| (g.clone(), self.opts.timeout))
    }

    /// Marks the buffer unusable when the launch gate ran out (the peers' flags are then in an
    /// unknown state, as after a timeout in a kernel).
    fn poison_on_gate_timeout(&mut self, r: Result<(), EpError>) -> Result<(), EpError> {
        if let Err(e @ EpError::SharedGpuTimeout { .. }) = &r {
            self.poisoned = Some(e.to_string());
        }
        r
    }

    /// Queues a kernel that keeps the stream busy for `duration` (benchmarks queue timed work
    /// behind it so the host's launch rate does not show).
    pub fn sleep_on_stream(&self, duration: Duration) -> Result<(), EpError> {
        let p = k::LlSleepParams {
            ns: duration.as_nanos().min(u64::MAX as u128) as u64,
        };
        let mut b = self.stream.launch_builder(&self.sleep_fn);
        b.arg(&p);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ep_ll_sleep takes one by-value LlSleepParams (its #[repr(C)] mirror) and
        // touches no memory.
        unsafe { b.launch(cfg) }.map_err(|source| EpError::Cuda {
            rank: self.rank,
            call: "cuLaunchKernel(ep_ll_sleep)",
            source,
        })?;
        Ok(())
    }

    /// Turns a recorded device error into an `Err` (and marks the buffer unusable).
    fn check_device_error(&mut self) -> Result<(), EpError> {
        let Some(word) = self.mapped.read_error(ERROR_OFFSET) else {
            // Every protocol status is checked in the kernels, so a QP failure comes with a code;
            // the records are read anyway (host memory, cheap).
            if let Some((peer, e)) = self.transport.as_ref().and_then(|t| t.first_failure(None)) {
                let err = EpError::Transport {
                    rank: self.rank,
                    peer: Some(peer),
                    what: format!(
                        "mode {}: the QP group recorded a failure",
                        self.nic_handler().map_or("?", NicHandler::name)
                    ),
                    source: Some(Box::new(e)),
                };
                self.poisoned = Some(err.to_string());
                return Err(err);
            }
            return Ok(());
        };
        let record = (word.code == k::error_code::TRANSPORT)
            .then(|| {
                self.transport
                    .as_ref()
                    .and_then(|t| t.first_failure(Some(word.peer as usize)))
            })
            .flatten();
        let err = device_error(
            &DeviceErrorContext {
                rank: self.rank,
                num_experts: self.opts.num_experts,
                calls: self.calls,
                timeout: self.opts.timeout,
                mode: self.nic_handler().map(NicHandler::name),
            },
            &word,
            record,
        );
        self.poisoned = Some(err.to_string());
        Err(err)
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

    /// Tears the buffer down in order: waits (bounded) for this rank's work, meets every other
    /// rank (so nobody frees memory a peer may still write), then unmaps the peers' buffers
    /// (ranks as processes) and frees. Returns the first error; the memory is freed either way.
    /// Every rank of the group calls this (or drops its buffer) together.
    pub fn shutdown(mut self) -> Result<(), EpError> {
        self.shut_down = true;
        self.teardown()
    }

    /// The teardown of [`shutdown`](Self::shutdown) and drop: this rank's stream (bounded), the
    /// barrier, the transport closed, then (ranks as processes over the transport) a second
    /// barrier, after which no rank's NIC has any peer's memory open, so every rank may free its
    /// own; the peers' NVLink windows unmapped. The first error.
    fn teardown(&mut self) -> Result<(), EpError> {
        let synced = self.synchronize();
        let met = self.group.all_gather(&[]);
        // Ranks as processes: peers hold this rank's net buffer open (CUDA IPC, for their
        // kernels or their NIC) until they have closed their side.
        let shared = !self.group.same_process();
        let leaked = matches!(synced, Err(EpError::HostTimeout { .. }));
        let closed = self.close_transport(&synced);
        self.release_windows(&synced);
        let released = if shared {
            self.release_net(leaked)
        } else {
            Ok(())
        };
        synced?;
        met?;
        closed?;
        released
    }

    /// Ranks as processes, after this rank closed its transport and its mappings of the peers:
    /// meets every rank again, so no net buffer is freed while a peer (its NIC or its mappings)
    /// still has it open. When any rank's stream did not finish (its kernels or its NIC may
    /// still write into the peers' buffers), every rank leaks its net buffer.
    fn release_net(&mut self, leaked: bool) -> Result<(), EpError> {
        let all = self.group.all_gather(&[u64::from(leaked)])?;
        if let Some(r) = all.iter().position(|v| v.first().is_some_and(|&w| w != 0)) {
            tracing::error!(
                rank = self.rank,
                "rank {r}'s stream did not finish at teardown: leaking this rank's net buffer, \
                 which rank {r}'s kernels or NIC may still write into"
            );
            std::mem::forget(self.net.clone());
        }
        Ok(())
    }

    /// After the teardown barrier: unmaps the peers' net buffers (ranks as processes). When this
    /// rank's stream did not finish, a kernel may still store through the mappings, so they are
    /// leaked rather than closed under it.
    fn release_windows(&mut self, synced: &Result<(), EpError>) {
        let windows = std::mem::take(&mut self.windows);
        if matches!(synced, Err(EpError::HostTimeout { .. })) && !windows.is_empty() {
            tracing::error!(
                rank = self.rank,
                "low-latency stream still busy at teardown: leaking its IPC mappings of the peers"
            );
            std::mem::forget(windows);
        }
    }

    /// After the teardown barrier: stops the proxies and destroys the QPs. When this rank's
    /// stream did not finish, a kernel may still post to the rings, so the transport is leaked
    /// rather than freed under it.
    fn close_transport(&mut self, synced: &Result<(), EpError>) -> Result<(), EpError> {
        let Some(t) = self.transport.take() else {
            return Ok(());
        };
        if matches!(synced, Err(EpError::HostTimeout { .. })) {
            tracing::error!(
                rank = self.rank,
                "low-latency stream still busy at teardown: leaking its QPs"
            );
            std::mem::forget(t);
            return Ok(());
        }
        t.close()
            .map_err(|(r, e)| transport_err(self.rank, &format!("closing the QPs to rank {r}"), e))
    }
}

impl Drop for LowLatencyBuffer {
    fn drop(&mut self) {
        if self.shut_down {
            return;
        }
        // Best effort, as in shutdown: never free memory a peer may still be writing.
        if let Err(e) = self.teardown() {
            tracing::warn!(
                rank = self.rank,
                "low-latency buffer dropped without a clean teardown: {e}"
            );
        }
    }
}

/// A transport failure at creation or teardown, as an error that names what was being done.
pub(super) fn transport_err(rank: usize, doing: &str, e: TransportError) -> EpError {
    EpError::Transport {
        rank,
        peer: None,
        what: format!("low-latency transport: {doing}"),
        source: Some(Box::new(e)),
    }
}

/// A transport set-up failure with no error of its own (a NIC that answered unexpectedly).
fn transport_setup(rank: usize, what: &str) -> EpError {
    EpError::Transport {
        rank,
        peer: None,
        what: format!("low-latency transport: {what}"),
        source: None,
    }
}

/// What [`device_error`] needs to know about the buffer.
#[derive(Debug, Clone, Copy)]
struct DeviceErrorContext {
    rank: usize,
    num_experts: usize,
    /// Operations queued so far (the "epoch" of a timeout).
    calls: u64,
    timeout: Duration,
    /// The NIC-handler mode, with the transport.
    mode: Option<&'static str>,
}

/// The error a low-latency kernel recorded in `w` (see [`k::error_code`] for what each code puts
/// in which field); `record` is the QP group's own record of a transport failure, if it kept one.
fn device_error(
    c: &DeviceErrorContext,
    w: &ep_kernels::intranode::ErrorWord,
    record: Option<(usize, TransportError)>,
) -> EpError {
    let rank = c.rank;
    let peer = w.peer as usize;
    match w.code {
        k::error_code::BAD_EXPERT => EpError::ExpertIdOutOfRange {
            rank,
            op: if w.what & k::BAD_EXPERT_IN_COMBINE != 0 {
                "low-latency combine"
            } else {
                "low-latency dispatch"
            },
            id: w.epoch as i64,
            token: w.detail as usize,
            slot: Some((w.what & !k::BAD_EXPERT_IN_COMBINE) as usize),
            count: None,
            num_experts: c.num_experts,
        },
        k::error_code::TOPK_MISMATCH => EpError::TopkMismatch {
            rank,
            token: w.epoch as usize,
            slot: w.what as usize,
            dispatched: i64::from((w.detail >> 32) as u32 as i32),
            combined: i64::from(w.detail as u32 as i32),
        },
        k::error_code::BAD_ROUTING => EpError::CorruptRouting {
            rank,
            what: match w.what {
                k::routing_what::LAYOUT_OFFSET => "layout_range offset",
                k::routing_what::LAYOUT_COUNT => "layout_range count",
                k::routing_what::SRC_INFO => "src_info",
                _ => "routing value",
            },
            index: w.epoch,
            value: w.detail as i64,
            limit: u64::from(w.peer),
        },
        k::error_code::TRANSPORT => {
            let call = match w.what {
                k::transport_what::PUT => "ibgda_put_warp (rows)",
                k::transport_what::SIGNAL => "ibgda_signal_add (count or flag)",
                k::transport_what::QUIET => "ibgda_quiet",
                _ => "a transport call",
            };
            let (peer, source) = match record {
                Some((r, e)) => (r, Some(Box::new(e))),
                None => (peer, None),
            };
            EpError::Transport {
                rank,
                peer: Some(peer),
                what: format!(
                    "mode {}: {call} returned status {:#x} on QP key {}",
                    c.mode.unwrap_or("?"),
                    w.epoch,
                    w.detail
                ),
                source,
            }
        }
        ERR_TIMEOUT => EpError::PeerTimeout {
            rank,
            peer,
            what: match w.what {
                k::wait_what::SEND_DONE => {
                    "low-latency dispatch send: this rank's warps finishing the tokens for an expert"
                }
                k::wait_what::DISPATCH_RECV => {
                    "low-latency dispatch receive: the count signal for a local expert"
                }
                k::wait_what::COMBINE_RECV => "low-latency combine receive: an expert's rows",
                _ => "low-latency wait",
            },
            expert: Some(w.epoch),
            epoch: c.calls,
            seen: w.detail,
            timeout: c.timeout,
        },
        other => EpError::Poisoned {
            rank,
            first: format!(
                "unknown device error code {other} (peer {peer}, what {}, epoch {}, detail {})",
                w.what, w.epoch, w.detail
            ),
        },
    }
}

pub(crate) fn check_options(
    rank: usize,
    ranks: usize,
    o: &LowLatencyOptions,
) -> Result<(), EpError> {
    let bad = |what: String| Err(invalid(rank, what));
    if ranks == 0 || ranks > k::MAX_RANKS {
        return bad(format!(
            "{ranks} ranks: the low-latency buffer supports 1..={}",
            k::MAX_RANKS
        ));
    }
    if o.num_experts == 0 || o.num_experts % ranks != 0 || o.num_experts > MAX_EXPERTS {
        return bad(format!(
            "num_experts {} is not a positive multiple of {ranks} ranks in 1..={MAX_EXPERTS}",
            o.num_experts
        ));
    }
    if o.max_tokens_per_rank == 0
        || o.max_tokens_per_rank
            .checked_mul(ranks)
            .is_none_or(|rows| rows > i32::MAX as usize / 64)
    {
        return bad(format!(
            "max_tokens_per_rank {} out of range",
            o.max_tokens_per_rank
        ));
    }
    if o.max_hidden == 0 || o.max_hidden % 8 != 0 || o.max_hidden > k::MAX_HIDDEN {
        return bad(format!(
            "max_hidden {}: expected a multiple of 8 in 8..={}",
            o.max_hidden,
            k::MAX_HIDDEN
        ));
    }
    if o.max_topk == 0 || o.max_topk > k::MAX_TOPK {
        return bad(format!(
            "max_topk {}: expected 1..={}",
            o.max_topk,
            k::MAX_TOPK
        ));
    }
    if let Err(e) = ibgda_device::timeout::check(o.timeout) {
        return bad(format!("timeout: {e}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transport_takes_the_nic_asked_for_and_real_without_a_device_names_why() {
        let d = transport_nic_for(0, NicChoice::Emulated).unwrap();
        assert_eq!(d.kind, NicKind::Emulated);
        if crate::transport::find_real_nic().is_err() {
            let e = transport_nic_for(3, NicChoice::Real).unwrap_err();
            let text = format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
            assert!(
                matches!(e, EpError::Transport { rank: 3, .. })
                    && text.contains("EP_NIC=real")
                    && text.contains("no usable mlx5 NIC"),
                "{text}"
            );
            let auto = transport_nic_for(0, NicChoice::Auto).unwrap();
            assert_eq!(auto.kind, NicKind::Emulated);
            assert!(
                auto.why.starts_with("auto: no usable mlx5 device"),
                "{}",
                auto.why
            );
        }
    }
    use ep_kernels::intranode::ErrorWord;

    const CTX: DeviceErrorContext = DeviceErrorContext {
        rank: 1,
        num_experts: 64,
        calls: 7,
        timeout: Duration::from_secs(2),
        mode: Some("cpu_host_memory"),
    };

    fn word(code: u32, peer: u32, what: u32, epoch: u64, detail: u64) -> ErrorWord {
        ErrorWord {
            code,
            rank: 1,
            peer,
            what,
            epoch,
            detail,
        }
    }

    #[test]
    fn a_transport_failure_is_not_a_timeout() {
        let w = word(
            k::error_code::TRANSPORT,
            3,
            k::transport_what::QUIET,
            0x5,
            2,
        );
        match device_error(&CTX, &w, None) {
            EpError::Transport {
                rank: 1,
                peer: Some(3),
                what,
                source: None,
            } => {
                assert!(what.contains("ibgda_quiet"), "{what}");
                assert!(what.contains("status 0x5"), "{what}");
                assert!(what.contains("QP key 2"), "{what}");
                assert!(what.contains("cpu_host_memory"), "{what}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn setup_failures_are_transport_errors_with_their_cause() {
        let e = transport_err(
            2,
            "connecting QPs to rank 1",
            TransportError::Emu(ibgda_emu::EmuError::NoSuchQp {
                nic: "emu0".into(),
                qpn: 0x12,
            }),
        );
        match &e {
            EpError::Transport {
                rank: 2,
                peer: None,
                what,
                source: Some(_),
            } => assert!(what.contains("connecting QPs to rank 1"), "{what}"),
            other => panic!("{other:?}"),
        }
        assert!(std::error::Error::source(&e).is_some());
        assert!(e.to_string().contains("no QP 0x12"), "{e}");
    }

    #[test]
    fn a_bad_expert_id_is_named_with_its_token_slot_and_value() {
        let w = word(
            k::error_code::BAD_EXPERT,
            1,
            3 | k::BAD_EXPERT_IN_COMBINE,
            (-9i64) as u64,
            40,
        );
        match device_error(&CTX, &w, None) {
            EpError::ExpertIdOutOfRange {
                rank: 1,
                op: "low-latency combine",
                id: -9,
                token: 40,
                slot: Some(3),
                count: None,
                num_experts: 64,
            } => {}
            other => panic!("{other:?}"),
        }
        let w = word(k::error_code::BAD_EXPERT, 1, 0, 64, 2);
        assert!(matches!(
            device_error(&CTX, &w, None),
            EpError::ExpertIdOutOfRange {
                op: "low-latency dispatch",
                id: 64,
                token: 2,
                slot: Some(0),
                ..
            }
        ));
    }

    #[test]
    fn timeouts_name_the_expert_without_leaking_a_string() {
        let w = word(ERR_TIMEOUT, 2, k::wait_what::COMBINE_RECV, 17, 3);
        match device_error(&CTX, &w, None) {
            EpError::PeerTimeout {
                rank: 1,
                peer: 2,
                what: "low-latency combine receive: an expert's rows",
                expert: Some(17),
                epoch: 7,
                seen: 3,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn corrupt_handles_and_mismatched_ids_are_named() {
        let w = word(
            k::error_code::BAD_ROUTING,
            127,
            k::routing_what::SRC_INFO,
            300,
            1_000_000,
        );
        assert!(matches!(
            device_error(&CTX, &w, None),
            EpError::CorruptRouting {
                what: "src_info",
                index: 300,
                value: 1_000_000,
                limit: 127,
                ..
            }
        ));
        let w = word(k::error_code::TOPK_MISMATCH, 1, 5, 12, (33u64 << 32) | 34);
        assert!(matches!(
            device_error(&CTX, &w, None),
            EpError::TopkMismatch {
                token: 12,
                slot: 5,
                dispatched: 33,
                combined: 34,
                ..
            }
        ));
    }

    #[test]
    fn expert_counts_are_bounded() {
        let ok = LowLatencyOptions::new(128, 7168, 8, 288);
        assert!(check_options(0, 4, &ok).is_ok());
        let many = LowLatencyOptions::new(128, 7168, 8, 1 << 40);
        assert!(matches!(
            check_options(0, 8, &many),
            Err(EpError::InvalidArgument { .. })
        ));
        // A token count whose product with the ranks overflows is refused, not a panic.
        let huge = LowLatencyOptions::new(usize::MAX / 2, 7168, 8, 288);
        assert!(check_options(0, 4, &huge).is_err());
        assert_eq!(huge.bytes_per_rank(4), None);
    }
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    #[test]
    fn low_latency_timeouts_are_validated() {
        let ok = LowLatencyOptions::new(128, 7168, 8, 288);
        check_options(0, 2, &ok).unwrap();
        for bad in [Duration::ZERO, Duration::MAX, Duration::from_secs(86_401)] {
            let o = LowLatencyOptions {
                timeout: bad,
                ..ok.clone()
            };
            let e = check_options(0, 2, &o).unwrap_err();
            assert!(e.to_string().contains("timeout"), "{bad:?}: {e}");
        }
    }
}
