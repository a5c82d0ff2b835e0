//! The intranode (NVLink) [`Buffer`]: ranks on one host whose GPUs map each other's memory.
//!
//! Ranks are processes (one per GPU, rendezvous over TCP, memory shared through CUDA IPC) or
//! threads of one process (peer access); both run the same kernels. Per rank the buffer holds
//! one *window*, a device allocation that every peer maps once, at creation, through
//! [`exchange_buffers`]: a signal region (flags, counts; peers write it), a pool of receive
//! regions (peers push tokens straight into their final rows there, so the returned tensors are
//! views with no copy) and, for ranks as processes, a combine staging region. Kernels get every
//! peer's window base and exchange offsets into it, never addresses, since a process maps a
//! peer's window wherever its driver chooses. Besides the window: pooled combine outputs and a
//! host-mapped word where kernels report errors.
//!
//! Combine pulls each token's copies straight from the ranks holding them and sums them in one
//! pass. Ranks as threads read each other's combine inputs wherever they are; a process can
//! read only its peers' windows, so with ranks as processes each rank's input must lie in its
//! window: a dispatch output of the buffer already does, and any other input is first copied
//! into the window's combine staging region (a copy-engine copy on the communication stream).
//! Operations run on the buffer's communication stream; every wait, on the GPU and on the host,
//! is bounded.
//!
//! Every rank of a group must call the same operations in the same order (they are collectives).
//! With `num_worst_tokens` the operations can be captured in a CUDA graph and replayed (see
//! [`Buffer::dispatch`]): barrier epochs are counted on the GPU, outputs are the tensors the
//! capture returned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use ep_kernels::intranode as k;
use ibgda_device::cuda::DeviceBuffer;

use crate::bootstrap::{exchange_buffers, Communicator, PeerBuffer};
use crate::config::{BufferOptions, Config};
use crate::dtype::{Bf16, Element, Fp8E4M3};
use crate::error::{invalid, EpError};
use crate::event::{backoff, Event};
use crate::rendezvous::Exchange;
use crate::residency::{gated, GpuShare, LaunchGate};
use crate::tensor::{Region, Tensor};

const ALIGN: usize = 256;
const ERROR_OFFSET: usize = 0;
const HOST_INFO_OFFSET: usize = 64;
/// FP8 scales cover this many channels each.
pub const FP8_BLOCK: usize = 128;

/// Largest `max_hidden`: rows of up to 2 MiB of BF16, so that every byte count the kernels take
/// as `i32` (`row_bytes`, `hidden`) stays far inside its range.
pub(crate) const MAX_HIDDEN: usize = 1 << 20;
/// Largest `max_topk` (the layout kernel's duplicate check is quadratic in it).
pub(crate) const MAX_TOPK: usize = 1024;
/// Largest `max_live_outputs` (each is a receive region of the window peers map).
pub(crate) const MAX_LIVE_OUTPUTS: usize = 1024;
/// Largest `expert_alignment`: per-expert counts (at most `ranks × max_tokens_per_rank`, below
/// `i32::MAX / 8`) rounded up to it stay inside `i32` on the GPU.
pub(crate) const MAX_EXPERT_ALIGNMENT: usize = 1 << 24;

fn align_up(x: usize) -> Option<usize> {
    x.checked_next_multiple_of(ALIGN)
}

/// `a × b × …` or `None` when it does not fit a `usize`.
fn product(factors: &[usize]) -> Option<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
}

/// Bump allocation of aligned sections with checked arithmetic.
struct Sections {
    at: usize,
}

impl Sections {
    fn new(start: usize) -> Option<Self> {
        Some(Self {
            at: align_up(start)?,
        })
    }
    /// `n` bytes (`None` when the product overflowed); returns the section's offset.
    fn take(&mut self, n: Option<usize>) -> Option<usize> {
        let here = self.at;
        self.at = align_up(here.checked_add(n?)?)?;
        Some(here)
    }
}

fn too_big(what: &str, o: &BufferOptions, ranks: usize) -> String {
    format!(
        "{what} of {ranks} ranks × max_tokens_per_rank {} × max_hidden {} × max_topk {} \
         (× max_live_outputs {}) does not fit a usize",
        o.max_tokens_per_rank, o.max_hidden, o.max_topk, o.max_live_outputs
    )
}

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Where the sections of a receive region lie, for given options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionPlan {
    pub(crate) layout: k::RegionLayout,
    pub(crate) bytes: usize,
    /// Rows it holds: `ranks × max_tokens_per_rank`.
    pub(crate) cap: usize,
}

impl RegionPlan {
    /// The plan, or why the sizes do not fit (every product checked).
    pub(crate) fn new(o: &BufferOptions, ranks: usize) -> Result<Self, String> {
        let plan = || -> Option<Self> {
            let cap = ranks.checked_mul(o.max_tokens_per_rank)?;
            let local = o.num_experts / ranks.max(1);
            let mut s =
                Sections::new(std::mem::size_of::<k::Meta>().checked_add(local.checked_mul(4)?)?)?;
            let x = s.take(product(&[cap, o.max_hidden, 2]))?;
            let scales = s.take(product(&[cap, o.max_hidden.div_ceil(FP8_BLOCK), 4]))?;
            let topk_idx = s.take(product(&[cap, o.max_topk, 4]))?;
            let topk_weights = s.take(product(&[cap, o.max_topk, 4]))?;
            Some(Self {
                layout: k::RegionLayout {
                    x: x as u64,
                    scales: scales as u64,
                    topk_idx: topk_idx as u64,
                    topk_weights: topk_weights as u64,
                },
                bytes: s.at,
                cap,
            })
        };
        plan().ok_or_else(|| too_big("a receive region", o, ranks))
    }
}

/// Where the sections of one pooled combine output lie: `[max_tokens][max_hidden]` BF16 rows,
/// then `[max_tokens][max_topk]` f32 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutputPlan {
    /// Offset of the weights.
    pub(crate) weights: usize,
    /// Bytes of one output.
    pub(crate) bytes: usize,
    /// Bytes of the pool (`max_live_outputs` outputs).
    pub(crate) pool_bytes: usize,
}

impl OutputPlan {
    /// The plan, or why the sizes do not fit (every product checked).
    pub(crate) fn new(o: &BufferOptions) -> Result<Self, String> {
        let plan = || -> Option<Self> {
            let mut s = Sections::new(0)?;
            s.take(product(&[o.max_tokens_per_rank, o.max_hidden, 2]))?;
            let weights = s.take(product(&[o.max_tokens_per_rank, o.max_topk, 4]))?;
            Some(Self {
                weights,
                bytes: s.at,
                pool_bytes: s.at.checked_mul(o.max_live_outputs)?,
            })
        };
        plan().ok_or_else(|| too_big("the combine output pool", o, 1))
    }
}

/// Where the sections of a rank's window lie: equal on every rank (checked at creation), so
/// an offset means the same in every peer's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowPlan {
    /// Bytes of the signal region, at offset 0.
    signal_bytes: usize,
    /// Combine staging rows: room for `ranks × max_tokens` rows of `max_hidden` BF16 (ranks as
    /// processes only: a combine input outside the window is copied here to be read by peers).
    comb_x: usize,
    /// Combine staging weights: `ranks × max_tokens × max_topk` f32 (as `comb_x`).
    comb_w: usize,
    /// The first receive region; the others follow every `recv_bytes`.
    recv_at: usize,
    recv_bytes: usize,
    recv_count: usize,
    /// Whole window.
    bytes: usize,
}

impl WindowPlan {
    /// The plan, or why the sizes do not fit (every product and sum checked).
    pub(crate) fn new(o: &BufferOptions, ranks: usize, staging: bool) -> Result<Self, String> {
        let recv_bytes = RegionPlan::new(o, ranks)?.bytes;
        let plan = || -> Option<Self> {
            let num_local_experts = o.num_experts / ranks.max(1);
            let signal_bytes =
                align_up(std::mem::size_of::<k::SignalHead>().checked_add(product(&[
                    4,
                    ranks,
                    num_local_experts,
                ])?)?)?;
            let comb_x = signal_bytes;
            let (x_bytes, w_bytes) = if staging {
                let rows = ranks.checked_mul(o.max_tokens_per_rank)?;
                (
                    align_up(product(&[rows, o.max_hidden, 2])?)?,
                    align_up(product(&[rows, o.max_topk, 4])?)?,
                )
            } else {
                (0, 0)
            };
            let comb_w = comb_x.checked_add(x_bytes)?;
            let recv_at = comb_w.checked_add(w_bytes)?;
            let recv_count = o.max_live_outputs;
            Some(Self {
                signal_bytes,
                comb_x,
                comb_w,
                recv_at,
                recv_bytes,
                recv_count,
                bytes: recv_at.checked_add(recv_bytes.checked_mul(recv_count)?)?,
            })
        };
        plan().ok_or_else(|| too_big("the window", o, ranks))
    }

    /// Bytes of the staging section at `offset` (`comb_x` or `comb_w`; 0 without staging).
    fn staging_bytes(&self, offset: usize) -> usize {
        if offset == self.comb_x {
            self.comb_w - self.comb_x
        } else if offset == self.comb_w {
            self.recv_at - self.comb_w
        } else {
            0
        }
    }

    /// The words every rank compares at creation: a rank whose window differs (other options,
    /// another kind of group) would read and write the wrong bytes of its peers' windows.
    fn words(&self) -> [u64; 7] {
        [
            self.signal_bytes,
            self.comb_x,
            self.comb_w,
            self.recv_at,
            self.recv_bytes,
            self.recv_count,
            self.bytes,
        ]
        .map(|w| w as u64)
    }
}

/// The error the layout kernel's [`k::LayoutInvalid`] report (`words`) describes, if any.
fn layout_invalid_error(
    rank: usize,
    words: &[i32],
    topk: usize,
    num_experts: usize,
) -> Option<EpError> {
    let (count, first, id) = (*words.first()?, *words.get(1)?, *words.get(2)?);
    if count == 0 {
        return None;
    }
    let first = first.max(0) as usize;
    Some(EpError::ExpertIdOutOfRange {
        rank,
        op: "dispatch layout",
        id: i64::from(id),
        token: first / topk.max(1),
        slot: Some(first % topk.max(1)),
        count: Some(count.max(0) as usize),
        num_experts,
    })
}

/// The error an intranode kernel recorded in `w` (see [`k::error_code`] for what each code puts
/// in which field), as this rank reports it.
fn device_error(rank: usize, w: &k::ErrorWord, timeout: std::time::Duration) -> EpError {
    match w.code {
        k::error_code::WORST_TOKENS_EXCEEDED => EpError::WorstTokensExceeded {
            rank,
            received: w.detail as usize,
            worst: w.what as usize,
        },
        k::error_code::BAD_ROUTING => EpError::CorruptRouting {
            rank,
            what: match w.what {
                k::routing_what::TOKENS_PER_RANK => "tokens_per_rank",
                k::routing_what::TOKENS_PER_EXPERT => "tokens_per_expert",
                k::routing_what::SEND_POSITION => "send position (token, rank)",
                _ => "routing value",
            },
            index: w.epoch,
            value: w.detail as i64,
            limit: u64::from(w.peer),
        },
        k::error_code::TIMEOUT => EpError::PeerTimeout {
            rank,
            peer: w.peer as usize,
            what: match w.what {
                k::wait_what::DISPATCH_COUNTS => "dispatch count exchange",
                k::wait_what::DISPATCH_DATA => "dispatch data",
                k::wait_what::COMBINE_START => "combine start",
                k::wait_what::COMBINE_DATA => "combine data",
                _ => "unknown wait",
            },
            expert: None,
            epoch: w.epoch,
            seen: w.detail,
            timeout,
        },
        other => EpError::Poisoned {
            rank,
            first: format!(
                "unknown device error code {other} (peer {}, what {}, epoch {}, detail {})",
                w.peer, w.what, w.epoch, w.detail
            ),
        },
    }
}

/// A row count the GPU reported, as rows of a region of `cap` rows: negatives are 0, and no
/// count exceeds the region.
fn clamp_count(n: i32, cap: usize) -> usize {
    (n.max(0) as usize).min(cap)
}

/// `expert_alignment` is cast to `i32` for the kernels: only after this check.
fn check_expert_alignment(rank: usize, a: usize) -> Result<(), EpError> {
    if a > MAX_EXPERT_ALIGNMENT {
        return Err(invalid(
            rank,
            format!("expert_alignment {a} above {MAX_EXPERT_ALIGNMENT}"),
        ));
    }
    Ok(())
}

/// Regions handed out as tensor storage: fixed slots of one allocation, made at creation (the
/// receive regions are part of the window peers map), reused once nothing refers to them.
#[derive(Debug)]
struct Pool {
    what: &'static str,
    slots: Vec<Arc<Region>>,
}

impl Pool {
    fn new(what: &'static str, buf: &Arc<DeviceBuffer>, at: usize, bytes: usize, n: usize) -> Self {
        Self {
            what,
            slots: (0..n)
                .map(|i| Arc::new(Region::part(buf, at + i * bytes, bytes)))
                .collect(),
        }
    }

    fn acquire(&self, rank: usize) -> Result<Arc<Region>, EpError> {
        self.slots
            .iter()
            .find(|r| Arc::strong_count(r) == 1)
            .cloned()
            .ok_or(EpError::RegionsInUse {
                rank,
                what: self.what,
                limit: self.slots.len(),
            })
    }
}

struct Kernels {
    layout: CudaFunction,
    notify: CudaFunction,
    dispatch: CudaFunction,
    barrier: CudaFunction,
    pull: CudaFunction,
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

/// Where each token goes: the result of [`Buffer::get_dispatch_layout`]. Its tensors are
/// [read-only](Tensor::is_read_only): dispatch reads them, and they must agree with the send
/// order the layout keeps privately (the kernels check them all the same, and report a value
/// edited out of range as [`EpError::CorruptRouting`] instead of writing by it).
#[derive(Debug, Clone)]
pub struct DispatchLayout {
    tokens_per_rank: Tensor<i32>,
    tokens_per_expert: Tensor<i32>,
    is_token_in_rank: Tensor<u8>,
    /// Each token's position among those sent to each rank, or -1, `[tokens][ranks]`.
    send_pos: Tensor<i32>,
    num_tokens: usize,
    buffer_id: u64,
}

impl DispatchLayout {
    /// Tokens this rank sends to each rank, `[ranks]`.
    pub fn tokens_per_rank(&self) -> &Tensor<i32> {
        &self.tokens_per_rank
    }
    /// Tokens this rank sends to each expert, `[num_experts]`.
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

/// The token rows to dispatch.
#[derive(Debug, Clone, Copy)]
pub enum DispatchX<'a> {
    /// BF16 `[tokens][hidden]`; `hidden` a multiple of 8 (16-byte rows).
    Bf16(&'a Tensor<Bf16>),
    /// FP8 e4m3 `[tokens][hidden]` with f32 scales `[tokens][hidden / 128]`; `hidden` a multiple
    /// of 128.
    Fp8 {
        /// The values.
        x: &'a Tensor<Fp8E4M3>,
        /// One scale per 128 channels.
        scales: &'a Tensor<f32>,
    },
}

/// Top-k routing sent along with the tokens.
#[derive(Debug, Clone, Copy)]
pub struct TopK<'a> {
    /// Global expert ids `[tokens][k]`, -1 for none.
    pub idx: &'a Tensor<i32>,
    /// Weights `[tokens][k]`.
    pub weights: &'a Tensor<f32>,
}

/// Ordering of an operation against the caller's work.
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamOrder<'a> {
    /// Start after this event instead of after the compute stream's current work.
    pub previous_event: Option<&'a Event>,
    /// Do not make the compute stream wait for the operation: the caller waits on the returned
    /// event when it needs the outputs.
    pub async_finish: bool,
}

/// The arguments of [`Buffer::dispatch`].
#[derive(Debug, Clone, Copy)]
pub struct DispatchArgs<'a> {
    /// The tokens.
    pub x: DispatchX<'a>,
    /// Where they go.
    pub layout: &'a DispatchLayout,
    /// Top-k ids and weights to send along (returned as local expert ids), or none.
    pub topk: Option<TopK<'a>>,
    /// Return exactly this many rows with no host wait (CUDA-graph capturable: see
    /// [`Buffer::dispatch`]); rows past the received ones have top-k id -1. `None`: as many rows
    /// as received, after a bounded host wait.
    pub num_worst_tokens: Option<usize>,
    /// Per-expert counts are rounded up to a multiple of this (at least 1).
    pub expert_alignment: usize,
    /// Kernel tuning.
    pub config: Config,
    /// Stream ordering.
    pub order: StreamOrder<'a>,
}

impl<'a> DispatchArgs<'a> {
    /// Dispatch `x` by `layout`, no top-k, default config for `ranks`.
    pub fn new(x: DispatchX<'a>, layout: &'a DispatchLayout, ranks: usize) -> Self {
        Self {
            x,
            layout,
            topk: None,
            num_worst_tokens: None,
            expert_alignment: 1,
            config: Config::default_for(ranks),
            order: StreamOrder::default(),
        }
    }
}

/// Received token rows.
#[derive(Debug, Clone)]
pub enum RecvX {
    /// BF16 `[rows][hidden]`.
    Bf16(Tensor<Bf16>),
    /// FP8 `[rows][hidden]` and scales `[rows][hidden / 128]`.
    Fp8 {
        /// The values.
        x: Tensor<Fp8E4M3>,
        /// The scales.
        scales: Tensor<f32>,
    },
}

/// What a dispatch returns. Rows are ordered by source rank, then by token index at the source.
#[derive(Debug)]
pub struct DispatchOutput {
    /// The received rows.
    pub x: RecvX,
    /// Local expert ids `[rows][k]` (-1 where the expert is not on this rank), with top-k.
    pub topk_idx: Option<Tensor<i32>>,
    /// Weights `[rows][k]` (0 where the id is -1), with top-k.
    pub topk_weights: Option<Tensor<f32>>,
    /// Rows received; `None` with `num_worst_tokens` (the count stays on the GPU).
    pub num_recv_tokens: Option<usize>,
    /// Tokens per local expert, rounded up to the alignment; `None` with `num_worst_tokens`.
    pub num_recv_tokens_per_expert: Option<Vec<usize>>,
    /// The same per-expert counts on the GPU, `[num_local_experts]`.
    pub recv_tokens_per_expert: Tensor<i32>,
    /// What combine and cached dispatch need.
    pub handle: Handle,
    /// Recorded after the dispatch on the communication stream.
    pub event: Event,
}

/// How a dispatch routed tokens: the input of [`Buffer::combine`] and cached dispatch.
#[derive(Debug, Clone)]
pub struct Handle {
    buffer_id: u64,
    region: Arc<Region>,
    send_pos: Tensor<i32>,
    num_tokens: usize,
    rows: usize,
    num_recv: Option<usize>,
    worst: bool,
}

impl Handle {
    /// Tokens the source side sent (rows of the combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// Rows of the dispatch output (and of the combine input).
    pub fn num_rows(&self) -> usize {
        self.rows
    }
    /// Rows actually received, when known on the host.
    pub fn num_recv_tokens(&self) -> Option<usize> {
        self.num_recv
    }
}

/// The arguments of [`Buffer::combine`].
#[derive(Debug, Clone, Copy)]
pub struct CombineArgs<'a> {
    /// Expert outputs, one row per dispatch output row, BF16 `[rows][hidden]`.
    pub x: &'a Tensor<Bf16>,
    /// The dispatch's handle.
    pub handle: &'a Handle,
    /// Weights `[rows][k]` to sum per token, or none.
    pub topk_weights: Option<&'a Tensor<f32>>,
    /// Up to two BF16 `[tokens][hidden]` tensors added to the sum.
    pub bias: [Option<&'a Tensor<Bf16>>; 2],
    /// Kernel tuning.
    pub config: Config,
    /// Stream ordering.
    pub order: StreamOrder<'a>,
}

impl<'a> CombineArgs<'a> {
    /// Combine `x` over `handle`, no weights or bias, default config for `ranks`.
    pub fn new(x: &'a Tensor<Bf16>, handle: &'a Handle, ranks: usize) -> Self {
        Self {
            x,
            handle,
            topk_weights: None,
            bias: [None, None],
            config: Config::default_for(ranks),
            order: StreamOrder::default(),
        }
    }
}

/// What a combine returns.
#[derive(Debug)]
pub struct CombineOutput {
    /// The sum of every copy of each token (f32 accumulation) plus the biases, BF16 `[tokens][hidden]`.
    pub x: Tensor<Bf16>,
    /// The summed weights `[tokens][k]`, when weights were given.
    pub topk_weights: Option<Tensor<f32>>,
    /// Recorded after the combine on the communication stream.
    pub event: Event,
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
    id: u64,
    rank: usize,
    ranks: usize,
    ctx: Arc<CudaContext>,
    comm: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    /// The hardware queues of `comm` (and of `compute` when it is a stream of its own), held
    /// while the buffer lives (see `ibgda_device::stream_pool`).
    _stream_leases: Vec<ibgda_device::stream_pool::StreamLease>,
    opts: BufferOptions,
    num_local_experts: usize,
    kernels: Kernels,
    /// This rank's window: signal region, combine staging, receive regions.
    window: Arc<DeviceBuffer>,
    wplan: WindowPlan,
    /// Every rank's window base as mapped here. The signal region is at offset 0, so this is
    /// also every rank's signal region.
    peer_window: [u64; k::MAX_RANKS],
    /// Every rank a thread of this process (one address space): combine inputs are published by
    /// address. Otherwise by offset in the publisher's window, staged there when needed.
    same_space: bool,
    plan: RegionPlan,
    recv_pool: Pool,
    out_pool: Pool,
    out_w_offset: usize,
    mapped: Arc<crate::mapped::MappedHost>,
    /// What the kernels get as `error` (points at the error word in `mapped`).
    errors: Arc<crate::mapped::ErrorReport>,
    /// Every window of the group, when its ranks are threads built together
    /// ([`Buffer::create_group`]): each rank's window is freed only once no rank's buffer holds
    /// it, so a drop never frees memory a peer's kernels may still write. `None` otherwise.
    group_windows: Option<Vec<Arc<DeviceBuffer>>>,
    epoch: u64,
    poisoned: Option<String>,
    /// Who shares this GPU: ranks of this process on it must fit on it together.
    share: GpuShare,
    /// Where the ranks of this process sharing this GPU meet around every launch of a kernel
    /// that waits for them (`None`: this rank has its GPU to itself).
    gate: Option<Arc<LaunchGate>>,
    /// Set when a rank sharing the GPU never came to the gate: the peers' flags are then in an
    /// unknown state, as after a timeout.
    gate_failure: std::sync::OnceLock<String>,
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
        Ok(Self {
            kernels,
            comm,
            comm_lease,
            window: Arc::new(window),
            out: Arc::new(out),
            mapped,
            errors,
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
            recv_pool: Pool::new(
                "receive",
                &parts.window,
                wplan.recv_at,
                wplan.recv_bytes,
                limit,
            ),
            out_pool: Pool::new("combine output", &parts.out, 0, oplan.bytes, limit),
            window: parts.window,
            wplan,
            peer_window,
            same_space,
            plan,
            out_w_offset: oplan.weights,
            mapped: Arc::new(parts.mapped),
            errors: Arc::new(parts.errors),
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
        drop(self);
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

    /// This rank's kernels may still run: leaks every allocation they write (its window, the
    /// combine outputs, the error and host-info words) and its mappings of the peers' windows.
    fn leak_own(&mut self, why: &str) {
        tracing::error!(
            rank = self.rank,
            "{why}: leaking this rank's window ({} bytes), combine outputs and error words, and \
             its mappings of the peers' windows, which its kernels may still write",
            self.wplan.bytes
        );
        std::mem::forget(std::mem::take(&mut self.peers));
        std::mem::forget(self.window.clone());
        std::mem::forget(self.out_pool.slots.first().cloned());
        std::mem::forget(self.mapped.clone());
        std::mem::forget(self.errors.clone());
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

    fn cuda(&self, call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> EpError + '_ {
        move |source| EpError::Cuda {
            rank: self.rank,
            call,
            source,
        }
    }

    fn usable(&self) -> Result<(), EpError> {
        match self.poisoned.as_ref().or(self.gate_failure.get()) {
            Some(first) => Err(EpError::Poisoned {
                rank: self.rank,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    fn on_this_gpu<T: Element>(&self, t: &Tensor<T>, name: &str) -> Result<(), EpError> {
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
        Ok(())
    }

    fn shape_is<T: Element>(
        &self,
        t: &Tensor<T>,
        want: &[usize],
        name: &str,
    ) -> Result<(), EpError> {
        self.on_this_gpu(t, name)?;
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

    /// Launches a kernel that waits for the other ranks: through the launch gate where ranks of
    /// this process share the GPU ([`crate::residency`]).
    fn launch<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        smem: u32,
        p: &P,
        call: &'static str,
    ) -> Result<(), EpError> {
        let gate = self.gate.as_deref().map(|g| (g, self.opts.timeout));
        let r = gated(gate, self.rank, call, || {
            self.launch_local(f, grid, block, smem, p, call)
        });
        if let Err(e @ EpError::SharedGpuTimeout { .. }) = &r {
            let _ = self.gate_failure.set(e.to_string());
        }
        r
    }

    /// Launches a kernel that waits for no other rank.
    fn launch_local<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        smem: u32,
        p: &P,
        call: &'static str,
    ) -> Result<(), EpError> {
        let mut b = self.comm.launch_builder(f);
        b.arg(p);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: every kernel of ep-kernels takes exactly one by-value parameter struct, and `P`
        // is the #[repr(C)] mirror of that kernel's struct (the caller pairs them); every address
        // in it is a live allocation of this rank or a peer-mapped one.
        unsafe { b.launch(cfg) }.map_err(self.cuda(call))?;
        Ok(())
    }

    /// Whether the communication stream is being captured into a CUDA graph (see
    /// [`dispatch`](Self::dispatch), "CUDA graphs").
    pub fn is_capturing(&self) -> Result<bool, EpError> {
        let status = self
            .comm
            .capture_status()
            .map_err(self.cuda("cuStreamIsCapturing"))?;
        Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Refuses an operation that waits on the host while the communication stream is captured.
    fn not_capturing(&self, what: &str) -> Result<(), EpError> {
        if self.is_capturing()? {
            return Err(invalid(
                self.rank,
                format!(
                    "{what} waits on the host, which a CUDA-graph capture of the communication \
                     stream cannot hold: call it before or after the capture"
                ),
            ));
        }
        Ok(())
    }

    /// Makes the communication stream wait for `order.previous_event`, or for the compute
    /// stream's work so far. Under capture only for `previous_event` (an event recorded in the
    /// same capture): the graph's work is ordered by the stream it is launched on.
    fn start(&self, order: &StreamOrder<'_>, capturing: bool) -> Result<(), EpError> {
        match order.previous_event {
            Some(e) => e.wait_on(&self.comm),
            None if capturing => Ok(()),
            None => Event::record(&self.compute, self.rank)?.wait_on(&self.comm),
        }
    }

    /// Records the end of the operation; makes the compute stream wait for it unless
    /// `async_finish` or under capture (the compute stream is not part of the graph).
    fn finish(&self, order: &StreamOrder<'_>, capturing: bool) -> Result<Event, EpError> {
        let e = Event::record(&self.comm, self.rank)?;
        if !order.async_finish && !capturing {
            e.wait_on(&self.compute)?;
        }
        Ok(e)
    }

    fn check_config(&self, c: &Config) -> Result<(), EpError> {
        if c.num_sms == 0 || c.num_sms > 1024 {
            return Err(invalid(
                self.rank,
                format!("config.num_sms {} out of 1..=1024", c.num_sms),
            ));
        }
        // Blocks past the GPU's SMs would only queue behind the others; ranks of this process
        // sharing the GPU must fit on it together.
        self.share.check("intranode config.num_sms", c.num_sms, 0)?;
        if c.block_threads < 32 || c.block_threads > k::PUSH_THREADS || c.block_threads % 32 != 0 {
            return Err(invalid(
                self.rank,
                format!(
                    "config.block_threads {} is not a multiple of 32 in 32..=1024",
                    c.block_threads
                ),
            ));
        }
        Ok(())
    }

    fn poison(&self, region: &Region) -> Result<(), EpError> {
        if self.opts.poison_outputs {
            // SAFETY: the whole region, part of a live allocation of this rank, is written,
            // ordered on the communication stream.
            unsafe {
                cudarc::driver::sys::cuMemsetD8Async(
                    region.ptr(),
                    0xAB,
                    region.len(),
                    self.comm.cu_stream(),
                )
            }
            .result()
            .map_err(self.cuda("cuMemsetD8Async"))?;
        }
        Ok(())
    }

    /// Turns a recorded device error into an `Err` (and marks the buffer unusable).
    fn check_device_error(&mut self) -> Result<(), EpError> {
        let Some(word) = self.mapped.read_error(ERROR_OFFSET) else {
            return Ok(());
        };
        let err = device_error(self.rank, &word, self.opts.timeout);
        self.poisoned = Some(err.to_string());
        Err(err)
    }

    /// Waits (bounded) until everything queued on the communication stream has run, then reports
    /// any error the kernels recorded.
    pub fn synchronize(&mut self) -> Result<(), EpError> {
        self.not_capturing("synchronize")?;
        let e = Event::record(&self.comm, self.rank)?;
        let r = e.wait_host(
            self.opts.timeout.saturating_mul(2),
            "the communication stream",
        );
        self.check_device_error()?;
        r
    }

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
        if t > self.opts.max_tokens_per_rank {
            return Err(invalid(
                self.rank,
                format!(
                    "{t} tokens, more than max_tokens_per_rank {}",
                    self.opts.max_tokens_per_rank
                ),
            ));
        }
        if kk > self.opts.max_topk {
            return Err(invalid(
                self.rank,
                format!("top-{kk}, more than max_topk {}", self.opts.max_topk),
            ));
        }
        let (r, e) = (self.ranks, self.opts.num_experts);
        // Small (tokens, ranks and experts are bounded at creation), checked all the same.
        let sections = || -> Option<[usize; 6]> {
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
        };
        let [per_rank_at, per_expert_at, invalid_at, in_rank_at, send_pos_at, bytes] =
            sections()
                .ok_or_else(|| invalid(self.rank, format!("layout of {t} tokens overflows")))?;
        let buf =
            Arc::new(
                DeviceBuffer::new(&self.ctx, bytes).map_err(|source| EpError::Device {
                    rank: self.rank,
                    source,
                })?,
            );
        self.start(&StreamOrder::default(), false)?;
        let p = k::LayoutParams {
            topk_idx: topk_idx.device_address(),
            tokens_per_rank: buf.ptr() + per_rank_at as u64,
            tokens_per_expert: buf.ptr() + per_expert_at as u64,
            is_token_in_rank: buf.ptr() + in_rank_at as u64,
            send_pos: buf.ptr() + send_pos_at as u64,
            invalid: buf.ptr() + invalid_at as u64,
            num_tokens: t as i32,
            topk: kk as i32,
            ranks: r as i32,
            num_experts: e as i32,
        };
        self.launch_local(
            &self.kernels.layout,
            r as u32 + 1,
            k::LAYOUT_THREADS,
            (4 * e) as u32,
            &p,
            "cuLaunchKernel(ep_dispatch_layout)",
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
        if t > self.opts.max_tokens_per_rank {
            return Err(invalid(
                self.rank,
                format!(
                    "{t} tokens, more than max_tokens_per_rank {}",
                    self.opts.max_tokens_per_rank
                ),
            ));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(max_tokens: usize, hidden: usize, topk: usize, experts: usize) -> BufferOptions {
        BufferOptions::new(max_tokens, hidden, topk, experts)
    }

    #[test]
    fn plans_keep_their_sizes_for_ordinary_options() {
        let o = opts(128, 7168, 8, 64);
        let p = RegionPlan::new(&o, 4).unwrap();
        assert_eq!(p.cap, 512);
        // Meta + 16 local expert counts, then the sections, each 256-aligned.
        assert_eq!(p.layout.x, 256);
        assert_eq!(p.layout.scales, 256 + 512 * 7168 * 2);
        assert_eq!(p.layout.topk_idx, p.layout.scales + 512 * 56 * 4);
        assert_eq!(p.layout.topk_weights, p.layout.topk_idx + 512 * 8 * 4);
        assert_eq!(p.bytes, p.layout.topk_weights as usize + 512 * 8 * 4);
        let w = WindowPlan::new(&o, 4, true).unwrap();
        assert_eq!(w.recv_bytes, p.bytes);
        assert!(w.comb_x >= std::mem::size_of::<k::SignalHead>() + 4 * 4 * 16);
        assert_eq!(w.staging_bytes(w.comb_x), 512 * 7168 * 2);
        assert_eq!(w.bytes, w.recv_at + 4 * p.bytes);
        let out = OutputPlan::new(&o).unwrap();
        assert_eq!(out.weights, 128 * 7168 * 2);
        assert_eq!(out.pool_bytes, 4 * out.bytes);
        assert_eq!(o.recv_region_bytes(4), Some(p.bytes));
    }

    #[test]
    fn plans_refuse_sizes_that_would_wrap() {
        // Each product below overflows a usize: the plans must say so, not wrap (release) or
        // panic (debug).
        let huge_hidden = opts(1 << 20, (usize::MAX / 8) & !7, 8, 8);
        assert!(RegionPlan::new(&huge_hidden, 8).is_err());
        assert!(WindowPlan::new(&huge_hidden, 8, false).is_err());
        assert!(OutputPlan::new(&huge_hidden).is_err());
        assert_eq!(huge_hidden.recv_region_bytes(8), None);
        assert_eq!(huge_hidden.combine_region_bytes(8), None);
        let huge_topk = opts(1 << 20, 8, usize::MAX / 16, 8);
        assert!(RegionPlan::new(&huge_topk, 8).is_err());
        let mut many_regions = opts(1 << 20, MAX_HIDDEN, 8, 8);
        many_regions.max_live_outputs = usize::MAX / 2;
        let e = WindowPlan::new(&many_regions, 8, true).unwrap_err();
        assert!(e.contains("does not fit"), "{e}");
    }

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

    #[test]
    fn kernel_i32_arguments_are_range_checked() {
        assert!(check_expert_alignment(0, 0).is_ok());
        assert!(check_expert_alignment(0, MAX_EXPERT_ALIGNMENT).is_ok());
        assert!(check_expert_alignment(0, MAX_EXPERT_ALIGNMENT + 1).is_err());
        // A usize that would wrap to a negative i32.
        assert!(check_expert_alignment(0, 1usize << 31).is_err());
        // Every row of a region is below i32::MAX, and so is a row's byte count.
        let o = opts(i32::MAX as usize / k::MAX_RANKS, MAX_HIDDEN, 8, 8);
        assert!(Buffer::check_options(0, 8, &o).is_ok());
        assert!(RegionPlan::new(&o, 8).unwrap().cap <= i32::MAX as usize);
        assert!(MAX_HIDDEN * 2 <= i32::MAX as usize);
    }

    #[test]
    fn received_counts_are_clamped_to_the_region() {
        assert_eq!(clamp_count(-7, 512), 0);
        assert_eq!(clamp_count(300, 512), 300);
        assert_eq!(clamp_count(i32::MAX, 512), 512);
    }

    fn word(code: u32, peer: u32, what: u32, epoch: u64, detail: u64) -> k::ErrorWord {
        k::ErrorWord {
            code,
            rank: 2,
            peer,
            what,
            epoch,
            detail,
        }
    }

    #[test]
    fn device_errors_keep_their_values() {
        let t = std::time::Duration::from_secs(1);
        match device_error(
            2,
            &word(k::error_code::WORST_TOKENS_EXCEEDED, 2, 64, 9, 70),
            t,
        ) {
            EpError::WorstTokensExceeded {
                rank: 2,
                received: 70,
                worst: 64,
            } => {}
            other => panic!("{other:?}"),
        }
        let e = device_error(
            2,
            &word(
                k::error_code::BAD_ROUTING,
                16,
                k::routing_what::SEND_POSITION,
                13,
                (-3i64) as u64,
            ),
            t,
        );
        match &e {
            EpError::CorruptRouting {
                rank: 2,
                what,
                index: 13,
                value: -3,
                limit: 16,
            } => assert!(what.starts_with("send position"), "{what}"),
            other => panic!("{other:?}"),
        }
        match device_error(
            2,
            &word(k::error_code::TIMEOUT, 1, k::wait_what::COMBINE_DATA, 5, 4),
            t,
        ) {
            EpError::PeerTimeout {
                rank: 2,
                peer: 1,
                what: "combine data",
                expert: None,
                epoch: 5,
                seen: 4,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        // An unknown code is not an argument error.
        assert!(matches!(
            device_error(2, &word(99, 0, 0, 0, 0), t),
            EpError::Poisoned { .. }
        ));
    }

    #[test]
    fn a_bad_expert_id_is_named_with_its_token_slot_and_value() {
        assert!(layout_invalid_error(0, &[0, i32::MAX, 0, 0], 4, 16).is_none());
        match layout_invalid_error(1, &[3, 9, 77, 0], 4, 16) {
            Some(EpError::ExpertIdOutOfRange {
                rank: 1,
                id: 77,
                token: 2,
                slot: Some(1),
                count: Some(3),
                num_experts: 16,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
