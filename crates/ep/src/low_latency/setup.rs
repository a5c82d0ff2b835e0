//! The buffer, its creation (windows, transport, rendezvous), accessors and teardown.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream};
use ep_kernels::low_latency as k;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::qp_desc::NicHandler;
use ibgda_emu::firmware::EmuSubnet;

use super::options::{check_options, LowLatencyOptions};
use super::plan::{Dims, NetPlan, OutPlan};
use crate::bootstrap::{exchange_buffers, PeerBuffer};
use crate::error::{invalid, EpError};
#[cfg(doc)]
use crate::event::Event;
use crate::mapped::{ErrorReport, MappedHost};
use crate::mask::RankMask;
use crate::rendezvous::Exchange;
use crate::residency::{GpuShare, LaunchGate, EMULATED_NIC_SMS};
use crate::transport::{
    connect_mesh, decide_nic, open_transport, Mesh, NicChoice, NicDecision, NicKind, QpGroupConfig,
    RankTransport, Registration, TransportError, NIC_ENV,
};
use crate::transport::{handler_for, HandlerRefusal};

/// Error word (`ep_kernels::intranode::ErrorWord`) at this offset of the mapped page.
pub(super) const ERROR_OFFSET: usize = 0;
const MAPPED_BYTES: usize = 64;

/// QPs from each rank to each peer (transport mode). Traffic to one destination expert stays on
/// one QP (its signal must follow its rows), so more QPs spread experts over more emulator
/// streams; four keeps the per-peer QP count (and proxy work) small.
const QPS_PER_PEER: u32 = 4;

/// Send-ring size of each QP in WQEBBs: a dispatch of 128 tokens × top-8 over 4 QPs posts about
/// 256 puts plus the signals per QP; a full ring only makes the poster wait (bounded).
const QP_RING_WQEBBS: u32 = 1024;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One rank's low-latency buffer.
pub struct LowLatencyBuffer {
    pub(super) id: u64,
    pub(super) rank: usize,
    pub(super) ranks: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    /// `stream`'s hardware queue, held while the buffer lives (see `ibgda_device::stream_pool`).
    _stream_lease: ibgda_device::stream_pool::StreamLease,
    pub(super) opts: LowLatencyOptions,
    pub(super) dims: Dims,
    pub(super) dispatch_fn: CudaFunction,
    pub(super) combine_fn: CudaFunction,
    pub(super) sleep_fn: CudaFunction,
    pub(super) net: Arc<DeviceBuffer>,
    pub(super) net_plan: NetPlan,
    pub(super) out_plan: OutPlan,
    pub(super) peer_base: [u64; k::MAX_RANKS],
    pub(super) state: Arc<DeviceBuffer>,
    /// The rank mask, with `enable_shrink`.
    pub(super) mask: Option<RankMask>,
    pub(super) dispatch_out: [Arc<DeviceBuffer>; 2],
    pub(super) combine_out: [Arc<DeviceBuffer>; 2],
    pub(super) dispatch_half: usize,
    pub(super) combine_half: usize,
    pub(super) mapped: Arc<MappedHost>,
    /// What the kernels get as `error` (points at the error word in `mapped`).
    pub(super) errors: Arc<ErrorReport>,
    pub(super) group: Arc<dyn Exchange>,
    pub(super) sms: u32,
    /// Who shares this GPU; the default grid that keeps them co-resident.
    pub(super) share: GpuShare,
    /// Where the ranks of this process sharing this GPU meet around every launch
    /// ([`crate::residency`]); `None` when this rank has its GPU to itself.
    pub(super) launch_gate: Option<Arc<LaunchGate>>,
    /// Inside [`capture`](Self::capture): nothing is launched, so nothing is gated (replays are).
    pub(super) capturing: bool,
    pub(super) budget: u32,
    pub(super) calls: u64,
    pub(super) poisoned: Option<String>,
    shut_down: bool,
    pub(super) transport: Option<LlNet>,
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
pub(super) struct LlNet {
    /// Per rank: this rank's QPs to it and the responders its QPs write through.
    mesh: Mesh,
    /// [`k::LlTransport`] in device memory.
    pub(super) table: DeviceBuffer,
    handler: NicHandler,
    _registration: Box<dyn Registration>,
    /// Kept until the QPs are gone (dropped last).
    _nic: Arc<dyn RankTransport>,
}

impl LlNet {
    /// The first failure any of this rank's QP sets recorded.
    pub(super) fn first_failure(&self, prefer: Option<usize>) -> Option<(usize, TransportError)> {
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
                let (mode, why) = handler_for(&**t, opts.nic_handler).map_err(|r| match r {
                    HandlerRefusal::Env(m) => invalid(rank, m),
                    HandlerRefusal::Select(doing, e) => transport_err(rank, &doing, e),
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
                    placement: opts.emulated_rings,
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
    /// This rank's network buffer as raw bytes (DeepEP's `get_local_buffer_tensor` of the RDMA
    /// buffer): the dispatch signals and combine flags of both halves first, then the send and
    /// receive rows, laid out as this crate plans them (not as DeepEP's). Peers (or their NICs)
    /// write it during every operation: writing it while one is in flight corrupts that
    /// operation; zeroing the signals between operations leaves the group out of step until
    /// [`clean`](Self::clean) resets every rank. The view keeps the buffer alive.
    pub fn local_net_buffer(&self) -> crate::Tensor<u8> {
        crate::Tensor::view(self.net.clone(), 0, vec![self.net.len()])
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
}
