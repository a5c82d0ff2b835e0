//! The staged internode buffer: creation (the node's intranode buffer, the NIC, QPs to every
//! peer), accessors and teardown.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use ep_kernels::internode as k;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::protocol::HandlerChoice;
use ibgda_emu::firmware::EmuSubnet;

use super::staged_plan::StagedPlan;
use super::Topology;
use crate::bootstrap::{BootstrapError, Communicator, SubGroup};
use crate::config::BufferOptions;
use crate::error::{invalid, EpError};
use crate::intranode::Buffer;
use crate::mapped::{ErrorReport, MappedHost};
use crate::rendezvous::Exchange;
use crate::residency::{GpuShare, LaunchGate, EMULATED_NIC_SMS};
use crate::transport::{
    connect_mesh_among, decide_nic, open_transport, Mesh, NicChoice, NicKind, QpGroupConfig,
    RankTransport, Registration, TransportError,
};
use crate::transport::{handler_for, HandlerRefusal};

/// Error word at this offset of the mapped page; the received counts after it.
pub(super) const ERROR_OFFSET: usize = 0;
/// `i32 [MAX_NODES]`: rows each node's rail peer announced (dispatch).
pub(super) const COUNTS_OFFSET: usize = 64;
const MAPPED_BYTES: usize = 128;

/// QPs from each rank to each peer: one, so that a node's data and the signal announcing it
/// share a QP (RC order; the signal is fenced behind the data).
const QPS_PER_PEER: u32 = 1;
/// Send-ring size of each QP in WQEBBs: a put is split into chunks of
/// `IBGDA_PUT_CHUNK_BYTES`; a full ring only makes the poster wait (bounded).
const QP_RING_WQEBBS: u32 = 1024;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// What an [`InternodeBuffer`] is built for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InternodeOptions {
    /// Sizes and bounds: `num_experts` counts the experts of every rank of every node.
    pub buffer: BufferOptions,
    /// The NIC (`EP_NIC` overrides it).
    pub nic: NicChoice,
    /// The NIC handler mode (`IBGDA_NIC_HANDLER` overrides it).
    pub nic_handler: HandlerChoice,
}

impl InternodeOptions {
    /// Options for `buffer`, the NIC and its handler mode chosen automatically.
    pub fn new(buffer: BufferOptions) -> Self {
        Self {
            buffer,
            nic: NicChoice::Auto,
            nic_handler: HandlerChoice::Auto,
        }
    }

    /// The options of the NVLink hop's intranode [`Buffer`] that each rank of `topo` builds over
    /// its node's ranks for these options (what sizes its GPU memory).
    pub fn nvlink_options(&self, topo: &Topology) -> BufferOptions {
        intra_options(topo, &self.buffer)
    }

    /// Bytes of the registered net buffer (the RDMA hop's slots and signal words) that each
    /// rank of `topo` allocates for these options; `None` when the size overflows.
    pub fn net_bytes(&self, topo: &Topology) -> Option<usize> {
        let b = &self.buffer;
        StagedPlan::new(
            b.max_tokens_per_rank,
            b.max_hidden,
            b.max_topk,
            topo.nodes(),
        )
        .map(|p| p.bytes)
    }
}

pub(super) struct Kernels {
    pub(super) layout: CudaFunction,
    pub(super) pack: CudaFunction,
    pub(super) put: CudaFunction,
    pub(super) wait: CudaFunction,
    pub(super) reduce: CudaFunction,
    pub(super) plan_put: CudaFunction,
    pub(super) recv_prep: CudaFunction,
    pub(super) gather: CudaFunction,
    pub(super) scatter: CudaFunction,
    pub(super) stage: CudaFunction,
}

/// Where the device-counted state ([`k::Ctrl`]) and the put table ([`k::PutTable`]) lie in
/// [`InternodeBuffer::state`].
pub(super) const STATE_CTRL: usize = 0;
pub(super) const STATE_TABLE: usize = 128;
const STATE_BYTES: usize = STATE_TABLE + std::mem::size_of::<k::PutTable>();
const _: () = assert!(std::mem::size_of::<k::Ctrl>() <= STATE_TABLE);

/// This rank's QPs and registered net buffer. Fields drop in order: the NIC last.
pub(super) struct Net {
    pub(super) mesh: Option<Mesh>,
    pub(super) registration: Box<dyn Registration>,
    /// Kept until the QPs are gone (dropped last).
    pub(super) _nic: Arc<dyn RankTransport>,
}

/// One rank's internode normal-mode buffer (first version: staged).
///
/// A dispatch runs in two hops. RDMA: each rank packs, for every node that needs some of its
/// tokens, those tokens (ids made local to that node) into a slot of its registered buffer and
/// writes it, with one fenced signal behind it on the same QP, into the receive slot of its *rail
/// peer* there (the rank with its local index); its own node's slot it fills locally. NVLink:
/// each rank hands what it received from every node, node by node in ascending order, to its
/// node's intranode [`Buffer`], whose dispatch delivers each token to the ranks of the node
/// holding its experts, rows ordered by source rank then token; concatenated in node order this
/// is the order of [`reference::dispatch`](super::reference::dispatch). Combine runs backwards:
/// the intranode combine sums inside the node at the rail peer, one BF16 copy per token crosses
/// back, and the token's rank adds the nodes' sums in ascending node order, then the biases.
///
/// Every rank of the world calls the same operations in the same order. A receive slot is
/// rewritten only after its reader acknowledged the previous operation, a send slot only after
/// the QPs carrying it were quieted; every wait is bounded and a timeout names rank, peer, what
/// and the sequence number. Ranks are threads of one process, built together by
/// [`create_group`](Self::create_group), or processes, each building its own with
/// [`new`](Self::new) over a bootstrap communicator. Ranks of one process sharing a GPU meet on
/// the host around every launch of a kernel that spins (puts with their quiet, signal waits), as
/// the intranode and low-latency buffers do ([`crate::residency::LaunchGate`]), so every rank
/// must make the same calls in the same order. While capturing, nothing runs and nothing is gated
/// here; each replay is ([`InternodeGraph::replay`](super::InternodeGraph::replay), as the
/// low-latency buffer's graphs are). The NVLink hop's operations are ordered on the intranode
/// buffer's stream by events (forked from this buffer's stream, joined back), not through the
/// compute stream, which an operation touches only at its start and end.
///
/// # `num_worst_tokens`: no host synchronisation, CUDA-graph capturable
///
/// With [`num_worst_tokens`](super::InternodeDispatchArgs::num_worst_tokens), dispatch, cached
/// dispatch over its handle and combine make no host wait: every size is fixed on the host (the
/// output's `num_worst_tokens` rows, each node's receive slot of `max_tokens_per_rank` rows, the
/// NVLink hop's fixed rows per source node), and every count is read on the device: the rows each
/// node's rail peer announced land in device memory, the put of the combine (and of the
/// dispatch) is planned on the device from counts it never shows the host, the NVLink hop runs
/// over whole receive slots (rows past the count carry no expert) through the intranode buffer's
/// own `num_worst_tokens` path, and a gather kernel concatenates its per-node blocks into the
/// output (a scatter splits combine inputs back). Sequence numbers are counted on the device, so
/// graph replays and eager calls interleave. Such a sequence can be captured on the
/// [communication stream](Self::comm_stream) ([`capture`](Self::capture)), under the same
/// rules as the intranode buffer's ([`Buffer::dispatch`], "CUDA graphs"): outputs are picked from
/// pools at capture and rewritten by every replay; inputs are read from the captured tensors; the
/// layout may be computed before the capture (the graph then keeps its routing) or inside it
/// (every replay routes by the ids its input tensor holds then). Device errors (a timed-out wait names rank, peer, what and
/// sequence; more rows than `num_worst_tokens`) surface at the next
/// [`synchronize`](Self::synchronize). The outputs come from pools of `max_live_outputs` entries
/// each (dispatch, cached dispatch, combine), allocated on the first such call: holding more
/// outputs is [`EpError::RegionsInUse`](crate::EpError::RegionsInUse). A dispatch output reports
/// `num_recv_tokens = num_worst_tokens` and no host per-expert counts (the counts stay on the
/// GPU: `recv_tokens_per_expert`).
///
/// Limits of this first version: without `num_worst_tokens` every dispatch waits on the host
/// (for the rows each node sent, and inside the NVLink hop); the NVLink hop runs once per source
/// node; at most 8 ranks.
pub struct InternodeBuffer {
    pub(super) id: u64,
    pub(super) rank: usize,
    pub(super) topo: Topology,
    pub(super) ctx: Arc<CudaContext>,
    /// Its own queue: its kernels wait for the NIC.
    pub(super) stream: Arc<CudaStream>,
    pub(super) compute: Arc<CudaStream>,
    _leases: Vec<ibgda_device::stream_pool::StreamLease>,
    pub(super) opts: InternodeOptions,
    pub(super) intra: Buffer,
    pub(super) intra_sms: u32,
    pub(super) kernels: Kernels,
    pub(super) plan: StagedPlan,
    /// The registered net buffer's base address (this rank's own, local).
    pub(super) base: u64,
    /// Per node: its rail peer's QP descriptors, buffer and rkey (0 for this rank's node).
    pub(super) descs: [u64; k::MAX_NODES],
    pub(super) rbase: [u64; k::MAX_NODES],
    pub(super) rkey: [u64; k::MAX_NODES],
    pub(super) mapped: Arc<MappedHost>,
    pub(super) errors: Arc<ErrorReport>,
    /// The device-counted operation state ([`k::Ctrl`] at [`STATE_CTRL`]: sequence numbers and
    /// the dispatch data words last stored) and the put table the device plans
    /// ([`k::PutTable`] at [`STATE_TABLE`]): counted on the GPU, so that CUDA-graph replays and
    /// eager calls advance them alike.
    pub(super) state: DeviceBuffer,
    /// The output pools of the `num_worst_tokens` path (allocated on its first use).
    pub(super) worst: Option<super::worst::WorstPools>,
    pub(super) poisoned: Option<String>,
    /// The host rendezvous of the world's ranks of this process on this GPU: every kernel that
    /// spins (waits for peers or for the NIC) launches through it, so no rank allocates or frees
    /// (calls that queue behind the context's work) while another rank's kernel waits for work
    /// it has not queued yet. `None` when this rank has the GPU to itself.
    pub(super) gate: Option<Arc<LaunchGate>>,
    /// Set when a rank sharing the GPU never came to the gate.
    pub(super) gate_failure: std::sync::OnceLock<String>,
    group: Arc<dyn Exchange>,
    /// Ranks as processes: the node's ranks, over which the NVLink hop's buffer was built (its
    /// teardown is a collective of theirs). Taken by the teardown.
    node_group: Option<SubGroup>,
    pub(super) net: Option<Net>,
    /// Phase timing ([`record_phases`](Self::record_phases)): `None` (off) costs each phase
    /// boundary one test.
    pub(super) phases: Option<Box<super::phases::PhaseRecorder>>,
}

/// A shared communicator seen as one of its own (the world group of [`InternodeBuffer::new`],
/// which the node's [`SubGroup`] also holds).
struct World(Arc<dyn Communicator>);

impl Communicator for World {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn local_rank(&self) -> usize {
        self.0.local_rank()
    }
    fn same_process(&self) -> bool {
        self.0.same_process()
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        self.0.all_gather_bytes(mine)
    }
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.0.barrier()
    }
}

/// The parent ranks of `rank`'s node, in local-rank order: the members of the sub-group its
/// NVLink hop is built over.
pub(super) fn node_members(topo: &Topology, rank: usize) -> Result<Vec<usize>, EpError> {
    topo.nvlink_peers(rank)
        .map(Iterator::collect)
        .map_err(|e| invalid(rank, e.to_string()))
}

/// The options of a node's intranode buffer: the node's share of the experts; a live output of
/// the NVLink hop per source node.
pub(super) fn intra_options(topo: &Topology, o: &BufferOptions) -> BufferOptions {
    BufferOptions {
        num_experts: o.num_experts / topo.nodes(),
        max_live_outputs: o
            .max_live_outputs
            .saturating_mul(topo.nodes())
            .clamp(1, 1024),
        ..o.clone()
    }
}

impl std::fmt::Debug for InternodeBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InternodeBuffer")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .field("topology", &self.topo)
            .finish_non_exhaustive()
    }
}

fn transport_err(rank: usize, doing: &str, e: TransportError) -> EpError {
    EpError::Transport {
        rank,
        peer: None,
        what: format!("internode transport: {doing}"),
        source: Some(Box::new(e)),
    }
}

impl InternodeBuffer {
    /// Builds one buffer per context, ranks as threads of this process (rank `i` on `ctxs[i]`,
    /// node `i / ranks_per_node`): per node an intranode [`Buffer`] over its ranks (experts
    /// `num_experts / nodes` per node), one NIC per rank on one fabric, QPs from every rank to
    /// every other. The world is at most 8 ranks.
    pub fn create_group(
        ctxs: &[Arc<CudaContext>],
        topo: &Topology,
        opts: &InternodeOptions,
    ) -> Result<Vec<InternodeBuffer>, EpError> {
        let world = topo.world();
        Self::check_options(0, topo, ctxs.len(), opts)?;
        let rpn = topo.ranks_per_node();
        let o = &opts.buffer;
        let intra_opts = intra_options(topo, o);
        let mut intra: Vec<Option<Buffer>> = Vec::with_capacity(world);
        for node in 0..topo.nodes() {
            for b in Buffer::create_group(&ctxs[node * rpn..(node + 1) * rpn], &intra_opts)? {
                intra.push(Some(b));
            }
        }
        let intra = Mutex::new(intra);
        let choice = NicChoice::from_env_or(opts.nic)
            .map_err(|e| transport_err(0, "choosing the NIC (EP_NIC)", e))?;
        let decision = decide_nic(choice).map_err(|e| transport_err(0, "choosing the NIC", e))?;
        let subnet = EmuSubnet::new();
        let nics = ctxs
            .iter()
            .enumerate()
            .map(|(r, ctx)| {
                open_transport(&decision.kind, ctx, r as u32, Some(&subnet)).map_err(|e| {
                    transport_err(r, &format!("opening the NIC ({})", decision.kind), e)
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        crate::rendezvous::build_as_threads(ctxs, o.timeout, |ctx, comm| {
            let rank = crate::bootstrap::Communicator::rank(&comm);
            let mine = intra
                .lock()
                .map_err(|_| invalid(rank, "an intranode buffer's owner panicked"))?
                .get_mut(rank)
                .and_then(Option::take)
                .ok_or_else(|| invalid(rank, "no intranode buffer for this rank"))?;
            let group: Arc<dyn Exchange> = Arc::new(comm);
            Self::build(ctx, group, topo, opts, mine, nics[rank].clone())
        })
    }

    /// Builds this rank's buffer on `ctx` (this rank's GPU), ranks as processes: every rank of
    /// `group` (the world: rank `r` is local rank `r % ranks_per_node` of node
    /// `r / ranks_per_node`) calls this at the same time, with the same topology and options.
    ///
    /// The group may come from [`Launcher::run_shared`](crate::bootstrap::Launcher::run_shared)
    /// (one host: pass [`Topology::virtual_nodes`]) or from an existing launcher
    /// ([`TcpCommunicator::from_launcher_env`](crate::bootstrap::TcpCommunicator::from_launcher_env),
    /// with [`Topology::from_launch`] over the same [`LaunchEnv`](crate::bootstrap::LaunchEnv)).
    /// The NVLink hop is an intranode [`Buffer`] over the node's ranks only (a [`SubGroup`] of
    /// `group`: its windows shared through CUDA IPC); the RDMA hop runs on this process's own
    /// NIC (the emulated NIC: one fabric per process, the peers' buffers opened through CUDA IPC
    /// when the QPs connect), QPs to every other rank connected through `group`.
    ///
    /// Every rank must end with [`shutdown`](Self::shutdown) (or drop), all at once: the
    /// teardown meets the world, then the node.
    pub fn new(
        ctx: &Arc<CudaContext>,
        group: Arc<dyn Communicator>,
        topo: &Topology,
        opts: &InternodeOptions,
    ) -> Result<InternodeBuffer, EpError> {
        let rank = group.rank();
        Self::check_options(rank, topo, group.world_size(), opts)?;
        let members = node_members(topo, rank)?;
        let node_group = SubGroup::new(group.clone(), members)
            .map_err(|source| EpError::Bootstrap { rank, source })?;
        let choice = NicChoice::from_env_or(opts.nic)
            .map_err(|e| transport_err(rank, "choosing the NIC (EP_NIC)", e))?;
        let decision =
            decide_nic(choice).map_err(|e| transport_err(rank, "choosing the NIC", e))?;
        // Ranks as processes: this process's own NIC (on the process's fabric) for this rank.
        let nic = open_transport(&decision.kind, ctx, rank as u32, None)
            .map_err(|e| transport_err(rank, &format!("opening the NIC ({})", decision.kind), e))?;
        let intra = Buffer::new(ctx, &node_group, &intra_options(topo, &opts.buffer))?;
        let world: Arc<dyn Exchange> = Arc::new(World(group));
        let mut b = Self::build(ctx, world, topo, opts, intra, nic)?;
        b.node_group = Some(node_group);
        Ok(b)
    }

    fn check_options(
        rank: usize,
        topo: &Topology,
        ctxs: usize,
        opts: &InternodeOptions,
    ) -> Result<(), EpError> {
        let world = topo.world();
        if ctxs != world {
            return Err(invalid(
                rank,
                format!("{ctxs} ranks (contexts or group members) for a topology of {world} ranks"),
            ));
        }
        if topo.nodes() < 2 || world > k::MAX_NODES {
            return Err(invalid(
                rank,
                format!(
                    "{} nodes × {} ranks: the internode buffer needs 2 or more nodes and at most {} ranks",
                    topo.nodes(),
                    topo.ranks_per_node(),
                    k::MAX_NODES
                ),
            ));
        }
        let e = opts.buffer.num_experts;
        if e == 0 || e % world != 0 {
            return Err(invalid(
                rank,
                format!("num_experts {e} is not a positive multiple of {world} ranks"),
            ));
        }
        if e > 48 * 1024 / 4 {
            // The layout kernel keeps a histogram of every expert in shared memory.
            return Err(invalid(rank, format!("num_experts {e} above 12288")));
        }
        if opts.buffer.max_tokens_per_rank > i32::MAX as usize / 2 {
            return Err(invalid(rank, "max_tokens_per_rank out of range"));
        }
        if StagedPlan::new(
            opts.buffer.max_tokens_per_rank,
            opts.buffer.max_hidden,
            opts.buffer.max_topk,
            topo.nodes(),
        )
        .is_none()
        {
            return Err(invalid(rank, "the net buffer's size overflows"));
        }
        Ok(())
    }

    fn build(
        ctx: &Arc<CudaContext>,
        group: Arc<dyn Exchange>,
        topo: &Topology,
        opts: &InternodeOptions,
        mut intra: Buffer,
        nic: Arc<dyn RankTransport>,
    ) -> Result<InternodeBuffer, EpError> {
        let rank = group.rank();
        // Ranks as processes: GPU ordinals mean nothing across processes, and the NICs open the
        // peers' buffers through CUDA IPC when the QPs connect.
        let procs = !group.same_process();
        // The NVLink hop is ordered by this buffer through the intranode buffer's compute
        // stream: it must be this rank's alone (ranks of other nodes may share the GPU).
        intra.private_compute_stream()?;
        let world = topo.world();
        let (my_node, _) = topo
            .locate(rank)
            .map_err(|e| invalid(rank, e.to_string()))?;
        let o = &opts.buffer;
        let dev = |source| EpError::Device { rank, source };
        let plan = StagedPlan::new(
            o.max_tokens_per_rank,
            o.max_hidden,
            o.max_topk,
            topo.nodes(),
        )
        .ok_or_else(|| invalid(rank, "the net buffer's size overflows"))?;
        let (handler, why) = handler_for(&*nic, opts.nic_handler).map_err(|r| match r {
            HandlerRefusal::Env(m) => invalid(rank, m),
            HandlerRefusal::Select(doing, e) => transport_err(rank, &doing, e),
        })?;
        tracing::info!(target: "ep", "rank {rank}: internode NIC {}; handler mode {} ({why})", nic.nic(), handler.name());
        let f = |module, name| {
            ep_kernels::load_function(ctx, module, name)
                .map_err(|source| EpError::Kernel { rank, source })
        };
        let kernels = Kernels {
            layout: f(ep_kernels::intranode::LAYOUT_MODULE, "ep_dispatch_layout")?,
            pack: f(k::MODULE, "ep_internode_pack")?,
            put: f(k::MODULE, "ep_internode_put")?,
            wait: f(k::MODULE, "ep_internode_wait")?,
            reduce: f(k::MODULE, "ep_internode_reduce")?,
            plan_put: f(k::MODULE, "ep_internode_plan_put")?,
            recv_prep: f(k::MODULE, "ep_internode_recv_prep")?,
            gather: f(k::MODULE, "ep_internode_gather")?,
            scatter: f(k::MODULE, "ep_internode_scatter")?,
            stage: f(k::MODULE, "ep_internode_stage")?,
        };
        // Sequence numbers and last data words start at zero, as the peers' signal words do.
        let state = DeviceBuffer::new(ctx, STATE_BYTES).map_err(dev)?;
        state.fill_bytes(0).map_err(dev)?;
        let registration = nic
            .register(plan.bytes)
            .map_err(|e| transport_err(rank, "registering the net buffer", e))?;
        let net_buf = registration
            .device()
            .cloned()
            .ok_or_else(|| invalid(rank, "the NIC registered host memory for a GPU rank"))?;
        // Signal words start at zero; slots are written before they are read.
        net_buf.fill_bytes(0).map_err(dev)?;
        let (stream, lease) = ibgda_device::stream_pool::waiting(ctx).map_err(dev)?;
        let leases = vec![lease];
        let share = GpuShare::gather(ctx, &*group)?;
        let reserved = match nic.nic() {
            NicKind::Emulated | NicKind::EmulatedVerbs => EMULATED_NIC_SMS,
            _ => 0,
        };
        // Every rank of the world sharing this GPU runs the node's intranode kernels at once,
        // beside a one-block internode kernel each: they must all fit.
        let budget = share.default_budget("an internode buffer", reserved)?;
        let gate = share.gate();
        let intra_sms = budget.saturating_sub(1).clamp(1, 24);
        // The NVLink hop's compute stream (this rank's own) is this buffer's too: one hardware
        // queue fewer per rank (eight ranks sharing a GPU lease 24 waiting queues of 32: each
        // one's intranode communication and compute streams and this buffer's stream).
        let compute = intra.compute_stream().clone();
        let mapped = Arc::new(MappedHost::new(ctx, MAPPED_BYTES, rank)?);
        let errors = Arc::new(ErrorReport::new(ctx, &mapped, ERROR_OFFSET, rank)?);

        let agree = [
            world as u64,
            plan.bytes as u64,
            o.max_tokens_per_rank as u64,
            o.max_hidden as u64,
            o.max_topk as u64,
            o.num_experts as u64,
        ];
        let mine: Vec<u64> = [
            ctx.ordinal() as u64,
            net_buf.ptr(),
            u64::from(registration.rkey()),
        ]
        .into_iter()
        .chain(agree)
        .collect();
        let all = group.all_gather(&mine)?;
        for (r, v) in all.iter().enumerate() {
            if v.len() != mine.len() || v[3..] != agree {
                return Err(EpError::Rendezvous {
                    rank,
                    what: format!(
                        "rank {r} builds a different internode buffer ({v:?}, this rank {mine:?})"
                    ),
                });
            }
            if procs {
                continue;
            }
            // The emulated NIC's copies between GPUs go peer to peer.
            let peer_ctx = ibgda_device::cuda::context(v[0] as usize).map_err(dev)?;
            ibgda_device::cuda::enable_peer_access(ctx, &peer_ctx).map_err(dev)?;
        }
        let cfg = |r: usize| QpGroupConfig {
            handler,
            nqps: QPS_PER_PEER,
            nwqes: QP_RING_WQEBBS,
            timeout: o.timeout,
            peer_rank: r as u32,
            ..Default::default()
        };
        // QPs to the rail peers only (the same local index on every other node): the ranks of
        // this node are reached over NVLink, and a QP group to them would cost a proxy thread
        // (CPU modes) and a GDR mirror (mode `cpu` without GDRCopy) for nothing.
        let rail_peer = |r: usize| {
            (0..topo.nodes()).any(|n| n != my_node && topo.rdma_peer(rank, n).ok() == Some(r))
        };
        let mesh = connect_mesh_among(
            &*nic,
            &*group,
            &*registration,
            QPS_PER_PEER,
            &rail_peer,
            cfg,
            |doing, e| transport_err(rank, doing, e),
        )?;
        let (mut descs, mut rbase, mut rkey) = (
            [0u64; k::MAX_NODES],
            [0u64; k::MAX_NODES],
            [0u64; k::MAX_NODES],
        );
        for n in 0..topo.nodes() {
            if n == my_node {
                continue;
            }
            let peer = topo
                .rdma_peer(rank, n)
                .map_err(|e| invalid(rank, e.to_string()))?;
            descs[n] = mesh.sets[peer]
                .as_ref()
                .and_then(|g| g.descs())
                .ok_or_else(|| invalid(rank, format!("no device QPs to rank {peer}")))?;
            rbase[n] = all[peer][1];
            rkey[n] = all[peer][2];
        }
        ibgda_device::cuda::wait_legacy_stream(
            ctx,
            ibgda_device::cuda::LEGACY_STREAM_BOUND,
            "the memsets of internode buffer creation",
        )
        .map_err(dev)?;
        // Nobody signals a peer before every rank has zeroed its words and connected its QPs.
        group.all_gather(&[])?;
        Ok(InternodeBuffer {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            rank,
            topo: *topo,
            ctx: ctx.clone(),
            stream,
            compute,
            _leases: leases,
            opts: opts.clone(),
            intra,
            intra_sms,
            kernels,
            base: net_buf.ptr(),
            plan,
            descs,
            rbase,
            rkey,
            mapped,
            errors,
            state,
            worst: None,
            poisoned: None,
            gate,
            gate_failure: std::sync::OnceLock::new(),
            group,
            node_group: None,
            phases: None,
            net: Some(Net {
                mesh: Some(mesh),
                registration,
                _nic: nic,
            }),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }
    /// Experts on each rank.
    pub fn num_local_experts(&self) -> usize {
        self.opts.buffer.num_experts / self.topo.world()
    }
    /// The options.
    pub fn options(&self) -> &InternodeOptions {
        &self.opts
    }
    /// The stream the internode kernels run on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The stream operations order against by default: a stream of this rank's own (the node's
    /// intranode buffer's compute stream). Queue work that feeds an operation here, or pass an
    /// event.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }
    /// SMs the NVLink hop uses per rank (what keeps every rank sharing this GPU co-resident).
    pub fn nvl_sms(&self) -> u32 {
        self.intra_sms
    }
    /// The node's intranode buffer (the NVLink hop).
    pub fn intranode(&self) -> &Buffer {
        &self.intra
    }

    /// QP numbers of this rank's QPs to each rank (empty for itself and for the ranks of its own
    /// node: QPs go to rail peers only), for fault plans that name
    /// QPs ([`ibgda_emu::FaultPlan::fail_wqe`]).
    pub fn transport_qps(&self) -> Vec<Vec<u32>> {
        self.net
            .as_ref()
            .and_then(|n| n.mesh.as_ref())
            .map(|m| {
                m.sets
                    .iter()
                    .map(|g| g.as_ref().map_or(Vec::new(), |g| g.qpns()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Replaces the fault plan of this rank's emulated NIC (from its next round): delayed
    /// completions, error CQEs, shaping to a line rate ([`ibgda_emu::FaultPlan::nic_400g`]).
    /// Each rank has its own NIC (threads and processes alike), so the plan touches only the
    /// WQEs this rank posts. `Err` on a real NIC.
    pub fn set_fault_plan(&self, plan: ibgda_emu::FaultPlan) -> Result<(), EpError> {
        let nic = self.net.as_ref().and_then(|n| n._nic.emulated_nic());
        match nic {
            Some(nic) => {
                nic.set_fault_plan(plan);
                Ok(())
            }
            None => Err(invalid(self.rank, "a fault plan needs the emulated NIC")),
        }
    }

    /// Waits (bounded) for the stream, meets every rank (bounded), then closes the QPs: no peer's
    /// NIC writes into this rank's buffer any more (ranks as processes meet once more, so that
    /// no peer's NIC still has it open when it is freed). On a failure the net buffer is leaked.
    /// Ranks as processes then shut the NVLink hop's buffer down with the node's ranks (always, so
    /// that every rank makes the same collectives).
    fn teardown(&mut self) -> Result<(), EpError> {
        let net = self.teardown_net();
        let node = match self.node_group.take() {
            Some(g) => self.intra.shutdown_in_place(&g),
            None => Ok(()),
        };
        net.and(node)
    }

    fn teardown_net(&mut self) -> Result<(), EpError> {
        let Some(mut net) = self.net.take() else {
            return Ok(());
        };
        let drained = crate::event::Event::record(&self.stream, self.rank).and_then(|e| {
            e.wait_host(
                self.opts.buffer.timeout.saturating_mul(2),
                "the internode stream",
            )
        });
        let met = self.group.all_gather(&[]);
        if drained.is_err() || met.is_err() {
            tracing::error!(
                rank = self.rank,
                "internode teardown: leaking the net buffer and QPs"
            );
            std::mem::forget(net);
            if met.is_ok() && !self.group.same_process() {
                // The peers that closed their QPs meet a second time (below): so does this rank,
                // so that the node's teardown after this one pairs with theirs.
                let _ = self.group.all_gather(&[]);
            }
            return drained.and(met.map(|_| ()));
        }
        let closed = net.mesh.take().map(Mesh::close).unwrap_or(Ok(()));
        // Ranks as processes: a peer's NIC holds this rank's net buffer open (CUDA IPC) until
        // it has closed its QPs; meet again before the buffer is freed.
        if !self.group.same_process() {
            if let Err(e) = self.group.all_gather(&[]) {
                tracing::error!(
                    rank = self.rank,
                    "internode teardown: the ranks did not meet after closing their QPs: \
                     leaking the net buffer"
                );
                std::mem::forget(net);
                return Err(e);
            }
        }
        drop(net);
        closed.map_err(|(peer, e)| EpError::Transport {
            rank: self.rank,
            peer: Some(peer),
            what: "internode transport: closing the QPs".into(),
            source: Some(Box::new(e)),
        })
    }

    /// Ends this rank's part of the group: every rank calls it (bounded).
    pub fn shutdown(mut self) -> Result<(), EpError> {
        self.teardown()
    }
}

impl Drop for InternodeBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!(
                rank = self.rank,
                "internode buffer dropped without a clean teardown: {e}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(tokens: usize, experts: usize) -> InternodeOptions {
        InternodeOptions::new(BufferOptions::new(tokens, 1024, 8, experts))
    }

    #[test]
    fn a_rank_builds_its_nvlink_hop_over_its_own_node() {
        let t = Topology::virtual_nodes(4, 2).unwrap();
        assert_eq!(node_members(&t, 0).unwrap(), vec![0, 1]);
        assert_eq!(node_members(&t, 5).unwrap(), vec![4, 5]);
        assert_eq!(node_members(&t, 7).unwrap(), vec![6, 7]);
        let t21 = Topology::virtual_nodes(2, 1).unwrap();
        assert_eq!(node_members(&t21, 1).unwrap(), vec![1]);
        assert!(matches!(
            node_members(&t21, 2),
            Err(EpError::InvalidArgument { rank: 2, .. })
        ));
        // The node's sub-group numbers its members by local index, as the node's buffer does.
        for r in 0..8 {
            let (_, local) = t.locate(r).unwrap();
            let members = node_members(&t, r).unwrap();
            assert_eq!(
                crate::bootstrap::SubGroup::sub_rank_of(r, 8, &members),
                Some(local)
            );
        }
        // A node holds its share of the experts; one live NVLink output per source node.
        let mut o = BufferOptions::new(128, 1024, 8, 32);
        o.max_live_outputs = 2;
        let i = intra_options(&t, &o);
        assert_eq!((i.num_experts, i.max_live_outputs), (8, 8));
        assert_eq!(i.max_tokens_per_rank, 128);
    }

    #[test]
    fn options_are_checked_before_anything_is_built() {
        let t22 = Topology::virtual_nodes(2, 2).unwrap();
        assert!(InternodeBuffer::check_options(0, &t22, 4, &opts(128, 16)).is_ok());
        let bad = [
            (t22, 3, opts(128, 16), "group members"),
            (
                Topology::virtual_nodes(1, 4).unwrap(),
                4,
                opts(128, 16),
                "2 or more nodes",
            ),
            (
                Topology::virtual_nodes(4, 4).unwrap(),
                16,
                opts(128, 16),
                "at most 8",
            ),
            (t22, 4, opts(128, 6), "multiple"),
            (t22, 4, opts(128, 16 * 1024), "12288"),
            (t22, 4, opts(usize::MAX / 4, 16), "max_tokens_per_rank"),
        ];
        for (topo, ctxs, o, want) in bad {
            match InternodeBuffer::check_options(0, &topo, ctxs, &o) {
                Err(EpError::InvalidArgument { what, .. }) => {
                    assert!(what.contains(want), "{what}")
                }
                other => panic!("{want}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
}
