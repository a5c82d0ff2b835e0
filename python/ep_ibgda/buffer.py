"""``Buffer``: DeepEP's legacy (V1) ``deep_ep.Buffer`` over the Rust ``ep`` crate.

How it maps onto the Rust core (what differs from DeepEP is said here, once):

- **Bootstrap** goes through the caller's group: ``torch.distributed.all_gather_object`` on
  ``group`` (any backend; vLLM's CPU/gloo group works), or ``comm.allgather`` (mpi4py) when
  ``group`` is None. No port of our own is opened.
- **Nodes.** Normal mode is intranode (NVLink) while the group is one node, internode when it
  spans several (DeepEP: more than ``NUM_MAX_NVL_PEERS`` ranks): then ``get_dispatch_layout``
  returns ``num_tokens_per_rdma_rank`` and ``dispatch``/``combine`` run the Rust core's internode
  buffer (``ep::internode::InternodeBuffer``: a token crosses to another node once, through the
  NIC, to the rank of its own local index there, which forwards it over NVLink). The nodes are
  the group's hosts (each host a block of consecutive ranks of equal size), or, with the
  environment variable ``EP_IBGDA_RANKS_PER_NODE=N`` (equal on every rank), *virtual nodes*:
  one host split into nodes of ``N`` consecutive ranks, with every inter-node byte going
  through the NIC (the emulated NIC where there is no real one), so that 2 or 4 processes
  sharing one GPU run the internode path. Low-latency mode ignores the split. The core's
  internode buffer takes at most 8 ranks in all (``NotImplementedError`` beyond).
- **Sizes.** The Rust buffers are sized by shapes, DeepEP's by bytes. The native buffers are
  therefore built at the first call that needs them, a collective every rank makes: the intranode
  one at the first ``dispatch`` (its shapes, maximised over the ranks, and as many tokens per rank
  as ``num_nvl_bytes`` pays for), the internode one likewise (as many tokens per rank as both
  ``num_nvl_bytes``, for the NVLink hop over the node's ranks, and ``num_rdma_bytes``, for the
  buffer the NIC writes into, pay for; ``num_rdma_bytes`` must not be 0, as in DeepEP), the
  low-latency one at the first ``low_latency_dispatch`` (its
  ``num_max_dispatch_tokens_per_rank``, hidden and experts; ``num_rdma_bytes`` must be at least
  ``get_low_latency_rdma_size_hint`` of them). A later call that does not fit raises
  ``ValueError`` saying what would.
- **Outputs** are torch tensors the caller owns. Low-latency: the kernels write the received
  rows, counts and combined rows straight into tensors allocated with torch for the call (no
  copy; only FP8 scales are copied, into DeepEP's column-major layout). Normal mode: the
  kernels write into the buffer's own pooled memory, and each output is copied (device to
  device, on the communication stream) into a tensor allocated with torch before the call
  returns.
  Handles still reserve a pooled region each until they are dropped: at most
  ``EP_IBGDA_MAX_LIVE_HANDLES`` (default 4) normal-mode handles may be alive at once, and
  low-latency results are double-buffered (a dispatch's handle is good until the second next
  dispatch), as DeepEP's.
- **Handles** are opaque: pass them back, do not look inside. The intranode one is an object;
  the internode one is a 10-tuple, as DeepEP's, whose first item is the dispatch's
  ``is_token_in_rank`` and whose other nine are None (the routing lives in the native handle).
- **Internode specifics** (the Rust core's first, staged internode version): the layout and
  every dispatch without ``num_worst_tokens`` wait on the host (bounded); with it, dispatch
  makes no host wait and its outputs come from the core's pools; the NVLink hop's SMs are the
  core's choice (``Config`` is accepted and checked, its fields not used). A dispatch without
  top-k routes by one expert of each destination rank and returns an empty per-expert list.
  Device errors (a wait that ran out of ``EP_IBGDA_TIMEOUT_S``, a NIC failure) are recorded by
  the kernels, whose later work still runs on what arrived: every internode operation first
  raises any error recorded so far (``RuntimeError`` / ``TimeoutError`` naming rank, peer and
  what), so a failure surfaces at the next call instead of as incomplete sums.
- **Streams.** Each operation runs on the buffer's communication stream (``get_comm_stream``)
  after the caller's current stream (or after ``previous_event``), and the current stream waits
  for it unless ``async_finish``. As in DeepEP, outputs are allocated on the current stream
  (on the communication stream with ``allocate_on_comm_stream``), and the returned
  ``EventOverlap`` holds an event only with ``async_finish`` (``EventOverlap(None)``
  otherwise: the current stream already waits).
- **Rank masks** (``enable_shrink``, DeepEP's ``low_latency_*_mask_buffer`` methods): each
  rank's mask lives in the native buffers, which are built at their first call; masks set (or
  cleaned) before that are kept on the host and applied when they are built. They apply to
  low-latency operations and, unlike DeepEP, to normal-mode (intranode) ``dispatch`` /
  ``combine`` too: a masked rank gets none of this rank's tokens, its rows are not received and
  combine leaves its experts' outputs out of each token's sum. In low-latency mode a receive
  wait that runs out of time masks the rank it waited for instead of failing
  (``low_latency_query_mask_buffer`` reports it); ``clean_low_latency_buffer`` is a real reset
  (a collective of every rank: host barriers around zeroing the signals), which brings a rank
  that was masked and missed calls back in step. In normal mode the masks of all ranks must be
  symmetric and transitive (the ranks fall into groups that exchange only inside themselves; a
  rank is always in its own), every rank still makes every call, and no wait masks a rank:
  masks that break the rule fail with ``RuntimeError`` naming the ranks (the kernels check; where
  one rank masks another that does not mask it back, on the latter, or with ``TimeoutError`` if
  the masking rank never makes the call).
  A normal-mode ``query`` reports the caller's masks (on a ``low_latency_mode`` Buffer, the
  low-latency buffer's, which include timed-out ranks).
- **LogFMT** (``use_logfmt``): our own layout of DeepEP's LogFMT-10 (``ep::low_latency::logfmt``
  in the Rust crate spells it out); not with ``zero_copy``, hidden a multiple of 128.
- **Not implemented** (``NotImplementedError`` naming the feature): internode normal mode with
  more than 8 ranks or with hosts that are not blocks of consecutive ranks, rank masks in
  internode normal mode, and ``use_fabric``.
- ``get_local_buffer_tensor`` views the native buffers' own memory (the intranode window, or
  the internode buffer's NVLink-hop window; the low-latency network buffer), which exist from
  the first call that builds them.
- **Teardown.** A Buffer with an internode part should end with ``destroy()`` on every rank
  (``explicitly_destroy=True``): one dropped without it leaves its GPU memory and QPs to the
  process's exit rather than meet peers that may never come.
"""

import os
import socket
from typing import Any, Callable, List, Optional, Tuple, Union

from . import _checks as chk
from . import _ep
from .config import NUM_MAX_NVL_PEERS, Config, _COMBINE, _DISPATCH, _table_config, _align
from .utils import EventHandle, EventOverlap

_FP8_BLOCK = _ep.FP8_BLOCK
_TOPK_DTYPES = ("int64", "int32")


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _collectives(group: Any, comm: Any) -> Tuple[int, int, Callable, Callable]:
    """(rank, size, all_gather(obj) -> list, barrier()) over ``group`` or ``comm``."""
    if group is not None:
        if hasattr(group, "all_gather_object") and callable(group.all_gather_object):
            # An object group of our own protocol (tests, other launchers): rank(), size(),
            # all_gather_object(obj) -> list, barrier().
            return group.rank(), group.size(), group.all_gather_object, group.barrier
        import torch.distributed as dist

        size = dist.get_world_size(group)

        def all_gather(obj):
            out = [None] * size
            dist.all_gather_object(out, obj, group=group)
            return out

        return dist.get_rank(group), size, all_gather, lambda: dist.barrier(group=group)
    if comm is not None:
        return comm.Get_rank(), comm.Get_size(), comm.allgather, comm.Barrier
    raise ValueError("Buffer: give a torch.distributed group (group=) or an mpi4py communicator (comm=)")


class _IntranodeHandle:
    """What ``dispatch`` returns as ``handle``: pass it to ``combine`` or a cached ``dispatch``."""

    __slots__ = ("native", "num_tokens", "hidden", "num_rows", "buffer_id")

    def __init__(self, native: Any, num_tokens: int, hidden: int, buffer_id: int) -> None:
        self.native = native
        self.num_tokens = num_tokens
        self.hidden = hidden
        self.num_rows = native.num_rows
        self.buffer_id = buffer_id


class _InternodeHandle(tuple):
    """What ``dispatch`` returns as ``handle`` when the group spans several nodes: pass it to
    ``combine`` or a cached ``dispatch``. A 10-tuple as DeepEP's internode handle (callers that
    unpack or count it keep working): item 0 is the dispatch's ``is_token_in_rank``, the other
    nine are None; the routing itself is the native handle (``native``)."""

    ARITY = 10

    def __new__(cls, native: Any, is_token_in_rank: Any, num_tokens: int, hidden: int, buffer_id: int):
        self = super().__new__(cls, (is_token_in_rank,) + (None,) * (cls.ARITY - 1))
        self.native = native
        self.num_tokens = num_tokens
        self.hidden = hidden
        self.num_rows = native.num_rows
        self.buffer_id = buffer_id
        return self


_RANKS_PER_NODE_ENV = "EP_IBGDA_RANKS_PER_NODE"
# The most ranks the Rust core's (staged) internode buffer takes, over all nodes.
_INTERNODE_MAX_RANKS = 8


def _node_split(hosts: List[str], per_node: List[Optional[str]]) -> Tuple[int, int, bool, Optional[str]]:
    """How the group's ranks form nodes: ``(nodes, ranks_per_node, virtual, refusal)``.

    ``hosts`` and ``per_node`` are every rank's host name and ``EP_IBGDA_RANKS_PER_NODE`` (None
    where unset). With the variable set, the one host splits into virtual nodes of that many
    consecutive ranks; else each host is a node (a block of consecutive ranks of equal size),
    and one host of more than ``NUM_MAX_NVL_PEERS`` ranks is nodes of that many, as DeepEP
    counts. ``ValueError`` for a variable that is malformed, differs between ranks or does not
    split the group; ``refusal`` says why normal mode cannot run on a split the core cannot
    take (None when it can), which low-latency mode does not care about."""
    ranks = len(hosts)
    if len(set(per_node)) != 1:
        raise ValueError(f"{_RANKS_PER_NODE_ENV} differs between the ranks (by rank: {per_node}): set it alike on every rank")
    raw = per_node[0]
    distinct = list(dict.fromkeys(hosts))
    if raw is not None:
        try:
            rpn = int(raw)
        except ValueError:
            raise ValueError(f"{_RANKS_PER_NODE_ENV}={raw!r} is not an integer") from None
        if not 1 <= rpn <= NUM_MAX_NVL_PEERS or ranks % rpn != 0:
            raise ValueError(
                f"{_RANKS_PER_NODE_ENV}={rpn}: virtual nodes need 1..{NUM_MAX_NVL_PEERS} ranks each, "
                f"dividing the group's {ranks} ranks"
            )
        if len(distinct) > 1:
            raise ValueError(
                f"{_RANKS_PER_NODE_ENV}={rpn} splits one host into virtual nodes, and the group spans "
                f"{len(distinct)} hosts ({', '.join(distinct)}): unset it there"
            )
        nodes, virtual = ranks // rpn, True
    elif len(distinct) > 1:
        nodes, virtual = len(distinct), False
        rpn = ranks // nodes
        blocks = [hosts[n * rpn : (n + 1) * rpn] for n in range(nodes)]
        if ranks % nodes != 0 or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != nodes:
            return nodes, max(rpn, 1), False, (
                f"internode normal mode over hosts that are not blocks of consecutive ranks of equal "
                f"size (by rank: {hosts})"
            )
    elif ranks > NUM_MAX_NVL_PEERS:
        rpn = NUM_MAX_NVL_PEERS
        nodes, virtual = (ranks + rpn - 1) // rpn, True
        if ranks % rpn != 0:
            return nodes, rpn, True, f"internode normal mode over {ranks} ranks, not a multiple of {rpn} per node"
    else:
        return 1, ranks, False, None
    if nodes > 1 and ranks > _INTERNODE_MAX_RANKS:
        return nodes, rpn, virtual, (
            f"internode normal mode over {ranks} ranks ({nodes} nodes of {rpn}): the core's internode "
            f"buffer takes at most {_INTERNODE_MAX_RANKS} ranks"
        )
    return nodes, rpn, virtual, None


def _most_tokens(fits: Callable[[int], bool]) -> int:
    """The most tokens per rank (up to 2^20) for which ``fits`` holds (it grows with tokens),
    0 when none does."""
    lo, hi = 0, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _LowLatencyHandle:
    """What ``low_latency_dispatch`` returns as ``handle``."""

    __slots__ = ("native", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "num_tokens", "buffer_id",
                 "routing")

    def __init__(self, native, n, hidden, num_experts, buffer_id) -> None:
        self.native = native
        self.num_max_dispatch_tokens_per_rank = n
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_tokens = native.num_tokens
        self.buffer_id = buffer_id
        # (the dispatch's int64 topk_idx, its int32 cast, the caller's raw stream it was made
        # on): what a combine given the same tensor on the same stream reuses, not casting again.
        self.routing = None


def _not_implemented(feature: str) -> NotImplementedError:
    return NotImplementedError(f"ep_ibgda does not implement {feature} yet")


class _OnStream:
    """Makes ``stream`` (a torch stream) torch's current stream for a ``with`` block, and the
    stream current before it current again after (``Buffer._on``). Through torch's own
    setter and getter by stream id, which ``torch.cuda.set_stream`` / ``current_stream`` wrap:
    no ``Stream`` object is made for the stream it goes back to."""

    __slots__ = ("torch", "to", "back")

    def __init__(self, torch: Any, stream: Any) -> None:
        self.torch = torch
        self.to = (stream.stream_id, stream.device_index, stream.device_type)
        self.back = None

    def __enter__(self) -> None:
        c = self.torch._C
        self.back = c._cuda_getCurrentStream(self.to[1])
        c._cuda_setStream(*self.to)

    def __exit__(self, *exc: Any) -> None:
        self.torch._C._cuda_setStream(*self.back)


class _NoSwitch:
    """A ``with`` block that changes no stream."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


_NO_SWITCH = _NoSwitch()


class Buffer:
    """One rank's communication buffer (DeepEP's ``deep_ep.Buffer``, legacy V1 API).

    Every rank of ``group`` creates it with the same arguments and makes the same calls in the
    same order. See the module docstring for how it maps onto the Rust core.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Any = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        chk.positive_int("num_nvl_bytes", num_nvl_bytes, 0)
        chk.positive_int("num_rdma_bytes", num_rdma_bytes, 0)
        chk.positive_int("num_qps_per_rank", num_qps_per_rank, 1)
        for name, v in (
            ("low_latency_mode", low_latency_mode),
            ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
            ("allow_mnnvl", allow_mnnvl),
            ("use_fabric", use_fabric),
            ("explicitly_destroy", explicitly_destroy),
            ("enable_shrink", enable_shrink),
        ):
            chk.flag(name, v)
        if use_fabric:
            raise _not_implemented("use_fabric (fabric memory handles)")
        self.rank, self.group_size, self._all_gather, self._barrier = _collectives(group, comm)
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._device = self._current_device()
        # Which host every rank is on decides intranode vs internode, as the group spans.
        peers = self._all_gather((socket.gethostname(), self._device, os.environ.get(_RANKS_PER_NODE_ENV)))
        self._hosts = [p[0] for p in peers]
        # Normal mode's nodes: hosts, or virtual nodes of one host (EP_IBGDA_RANKS_PER_NODE).
        self._nodes, self._ranks_per_node, self._virtual_nodes, self._split_refusal = _node_split(
            self._hosts, [p[2] for p in peers]
        )
        self._timeout_s = float(os.environ.get("EP_IBGDA_TIMEOUT_S", "30"))
        self._max_live = _env_int("EP_IBGDA_MAX_LIVE_HANDLES", 4)
        self._intranode = None
        self._internode_native = None
        self._ll = None
        self._torch_streams = {}
        # Per native buffer: its communication stream as a torch stream (see `_comm_of`).
        self._comm_streams = {}
        # torch's raw current-stream getter (`_caller`) and torch's device (`_torch_device`).
        self._raw_stream = None
        self._tdev = None
        self._rank_ids_t = None
        # The low-latency buffer's limits, read once when it is built.
        self._ll_limits = None
        # The caller's masks (enable_shrink), applied to each native buffer when it is built.
        self._pending_mask = [0] * self.group_size
        self._destroyed = False
        self._id = id(self)

    # ----- set-up ---------------------------------------------------------------------------

    @staticmethod
    def _current_device() -> Optional[int]:
        try:
            import torch
        except ImportError:
            return None
        return torch.cuda.current_device() if torch.cuda.is_available() else None

    def _gather_bytes(self, data: bytes) -> List[bytes]:
        return [bytes(b) for b in self._all_gather(bytes(data))]

    def _live(self) -> None:
        if self._destroyed:
            raise RuntimeError("Buffer: used after destroy()")

    def _need_device(self) -> int:
        if self._device is None:
            self._device = self._current_device()
        if self._device is None:
            raise RuntimeError("Buffer: this operation needs torch with a CUDA GPU, and none is available")
        return self._device

    def _agreed_shapes(self, tokens: int, hidden: int, topk: int, num_experts: int) -> Tuple[int, int, int]:
        """Every rank's first-dispatch shapes, maximised (a collective): ``(tokens, hidden,
        top-k)``, top-k at least 16; ``ValueError`` on every rank when they disagree on the
        experts."""
        need = self._all_gather((tokens, hidden, topk, num_experts))
        experts = {n[3] for n in need}
        if len(experts) != 1:
            raise ValueError(f"dispatch: ranks disagree on num_experts: {sorted(experts)}")
        return max(n[0] for n in need), max(n[1] for n in need), max(max(n[2] for n in need), 16)

    def _check_fits(self, lim: List[int], tokens: int, hidden: int, topk: int, num_experts: int,
                    budget: str, would_fit: Callable[[int, int, int], str]) -> None:
        """``ValueError`` when these shapes exceed the limits ``lim`` (``[tokens, hidden, top-k,
        experts, ...]``) the native buffer was built with; ``would_fit(tokens, hidden, top-k)``
        names the byte budgets that would hold them."""
        if tokens > lim[0] or hidden > lim[1] or topk > lim[2] or num_experts != lim[3]:
            raise ValueError(
                f"dispatch: {tokens} tokens of hidden {hidden}, top-{topk} of {num_experts} experts "
                f"does not fit this Buffer, built at its first dispatch for at most {lim[0]} "
                f"tokens per rank, hidden {lim[1]}, top-{lim[2]} of {lim[3]} experts "
                f"({budget}); a Buffer with {would_fit(max(tokens, lim[0]), max(hidden, lim[1]), max(topk, lim[2]))} "
                "whose first dispatch has these shapes would fit"
            )

    def _normal_buffer(self, internode: bool, tokens: int, hidden: int, topk: int, num_experts: int):
        """The native normal-mode buffer (intranode or internode), built at the first dispatch."""
        if internode:
            return self._internode_buffer(tokens, hidden, topk, num_experts)
        return self._intranode_buffer(tokens, hidden, topk, num_experts)

    def _intranode_buffer(self, tokens: int, hidden: int, topk: int, num_experts: int):
        """The native intranode buffer, built at the first dispatch (a collective)."""

        def per(m: int, h: int, k: int) -> float:
            n = _ep.intranode_bytes(self.group_size, m, h, k, num_experts, self._max_live)
            return float("inf") if n is None else n

        if self._intranode is None:
            device = self._need_device()
            tokens_max, hidden_max, topk_max = self._agreed_shapes(tokens, hidden, topk, num_experts)
            # As many tokens per rank as num_nvl_bytes pays for, and at least this call's.
            paid = _most_tokens(lambda m: per(m, hidden_max, topk_max) <= self.num_nvl_bytes)
            self._intranode = _ep.Intranode(
                device,
                self.rank,
                self.group_size,
                self._gather_bytes,
                self._barrier,
                max(tokens_max, paid, 1),
                hidden_max,
                topk_max,
                num_experts,
                self._max_live,
                self._timeout_s,
            )
            if self.enable_shrink:
                for r, m in enumerate(self._pending_mask):
                    if m and r != self.rank:
                        self._intranode.update_mask(r, True)
        self._check_fits(
            self._intranode.limits, tokens, hidden, topk, num_experts, f"{self.num_nvl_bytes} num_nvl_bytes",
            lambda m, h, k: f"num_nvl_bytes >= {per(m, h, k)}",
        )
        return self._intranode

    def _internode_bytes(self, m: int, h: int, k: int, num_experts: int) -> Tuple[float, float]:
        """(num_nvl_bytes, num_rdma_bytes) the internode buffer takes for these limits."""
        b = _ep.internode_bytes(self._nodes, self._ranks_per_node, m, h, k, num_experts, self._max_live)
        return (float("inf"), float("inf")) if b is None else b

    def _internode_buffer(self, tokens: int, hidden: int, topk: int, num_experts: int):
        """The native internode buffer, built at the first dispatch (a collective)."""

        def would_fit(m: int, h: int, k: int) -> str:
            nvl, rdma = self._internode_bytes(m, h, k, num_experts)
            return f"num_nvl_bytes >= {nvl} and num_rdma_bytes >= {rdma}"

        if self._internode_native is None:
            if self.num_rdma_bytes == 0:
                raise ValueError(
                    f"dispatch: the group spans {self._nodes} nodes ({self._nodes} x {self._ranks_per_node} "
                    f"ranks), and internode dispatch needs num_rdma_bytes > 0 (as in DeepEP): a Buffer with "
                    f"{would_fit(max(tokens, 1), hidden, max(topk, 16))} would fit this call"
                )
            device = self._need_device()
            tokens_max, hidden_max, topk_max = self._agreed_shapes(tokens, hidden, topk, num_experts)

            def fits(m: int) -> bool:
                nvl, rdma = self._internode_bytes(m, hidden_max, topk_max, num_experts)
                return nvl <= self.num_nvl_bytes and rdma <= self.num_rdma_bytes

            # As many tokens per rank as both budgets pay for, and at least this call's.
            self._internode_native = _ep.Internode(
                device,
                self.rank,
                self.group_size,
                self._gather_bytes,
                self._barrier,
                self._nodes,
                self._ranks_per_node,
                self._virtual_nodes,
                max(tokens_max, _most_tokens(fits), 1),
                hidden_max,
                topk_max,
                num_experts,
                self._max_live,
                self._timeout_s,
            )
        self._check_fits(
            self._internode_native.limits, tokens, hidden, topk, num_experts,
            f"{self.num_nvl_bytes} num_nvl_bytes, {self.num_rdma_bytes} num_rdma_bytes", would_fit,
        )
        return self._internode_native

    def _ll_buffer(self, n: int, hidden: int, topk: int, num_experts: int):
        """The native low-latency buffer, built at the first low-latency call (a collective)."""
        if self._ll is None:
            device = self._need_device()
            hint = Buffer.get_low_latency_rdma_size_hint(n, hidden, self.group_size, num_experts)
            if self.num_rdma_bytes < hint:
                raise ValueError(
                    f"low_latency_dispatch: num_rdma_bytes {self.num_rdma_bytes} is below "
                    f"get_low_latency_rdma_size_hint({n}, {hidden}, {self.group_size}, "
                    f"{num_experts}) = {hint}: create the Buffer with num_rdma_bytes >= {hint}"
                )
            self._ll = _ep.LowLatency(
                device,
                self.rank,
                self.group_size,
                self._gather_bytes,
                self._barrier,
                n,
                hidden,
                min(max(topk, 11), 16),
                num_experts,
                self.allow_nvlink_for_low_latency_mode,
                self._timeout_s,
                self.enable_shrink,
            )
            if self.enable_shrink:
                for r, m in enumerate(self._pending_mask):
                    if m:
                        self._ll.update_mask(r, True)
        lim = self._ll_limits
        if lim is None:
            lim = self._ll_limits = tuple(self._ll.limits)
        if n != lim[0] or hidden > lim[1] or topk > lim[2] or num_experts != lim[3]:
            raise ValueError(
                f"low_latency: num_max_dispatch_tokens_per_rank {n}, hidden {hidden}, top-{topk}, "
                f"{num_experts} experts: this Buffer's low-latency buffer was built for "
                f"num_max_dispatch_tokens_per_rank {lim[0]}, hidden up to {lim[1]}, top-k up to "
                f"{lim[2]}, {lim[3]} experts; use a new Buffer for other sizes"
            )
        return self._ll

    # ----- static ----------------------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs the normal kernels use (even, as DeepEP requires)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"set_num_sms: new_num_sms must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` of an event recorded on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Our kernels are built for sm_90a (with compute_90 PTX)."""
        return True

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's tuned dispatch config for ``num_ranks`` ranks (``Buffer.num_sms`` SMs)."""
        return _table_config(_DISPATCH, "get_dispatch_config", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's tuned combine config for ``num_ranks`` ranks (``Buffer.num_sms`` SMs)."""
        return _table_config(_COMBINE, "get_combine_config", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """DeepEP's ``num_rdma_bytes`` for low-latency mode with these sizes (its formula)."""
        n, e = num_max_dispatch_tokens_per_rank, num_experts
        scales = hidden // 128
        dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
        combine_msg = scales * 4 + hidden * 2
        send = max(n * dispatch_msg, e * n * combine_msg)
        recv = max(e * n * dispatch_msg, e * n * combine_msg)
        signal = _align(e * 4, 128)
        total = 2 * (send + recv + signal)
        return (total + 128) // 128 * 128

    # ----- helpers ---------------------------------------------------------------------------

    # The hot paths (dispatch, combine, their low-latency kinds) keep to a few torch calls each:
    # the caller's current stream read once, as a raw handle (``_caller``); the hand-off
    # between it and the communication stream done by the native buffer (``comm_after``,
    # ``caller_after``: two events per native buffer, re-recorded with driver calls, where torch
    # events cost microseconds of Python each); outputs allocated on the current stream, as
    # DeepEP's, so that without ``async_finish`` no ``record_stream`` is needed (the current
    # stream waits for the communication stream before anything later on it can reuse their
    # memory); a torch event only for ``async_finish`` (and a torch stream only for it,
    # ``previous_event``, and the copies made on the communication stream), as DeepEP.

    def _caller(self) -> int:
        """The caller's current stream on this Buffer's GPU, as a raw ``CUstream`` handle."""
        get = self._raw_stream
        if get is None:
            import torch

            get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if get is None:  # older torch: the slower public way
                get = lambda d: torch.cuda.current_stream(d).cuda_stream  # noqa: E731
            self._raw_stream = get
        return get(self._device)

    def _comm_of(self, native: Any):
        """The communication stream of ``native`` (a native buffer) as a torch stream, made
        once per native buffer."""
        s = self._comm_streams.get(id(native))
        if s is None:
            s = self._external_stream(native.stream if native is self._ll else native.comm_stream)
            self._comm_streams[id(native)] = s
        return s

    def _begin(self, native: Any, previous_event: Optional[EventOverlap]) -> int:
        """The caller's current stream (raw), with ``native``'s communication stream ordered
        after its work so far, or after ``previous_event`` (checked by ``_check_previous``)."""
        caller = self._caller()
        if previous_event is not None:
            self._comm_of(native).wait_event(previous_event.event.event)
        else:
            native.comm_after(caller)
        return caller

    def _external_stream(self, ptr: int):
        """The native stream ``ptr`` as a ``torch.cuda.ExternalStream``, made once per stream
        (the native streams live as long as the process: ``kept_streams`` in the extension)."""
        s = self._torch_streams.get(ptr)
        if s is None:
            import torch

            s = torch.cuda.ExternalStream(ptr, device=torch.device("cuda", self._device))
            self._torch_streams[ptr] = s
        return s

    def _torch_device(self):
        """``torch.device("cuda", <this Buffer's GPU>)``, made once."""
        d = self._tdev
        if d is None:
            import torch

            d = self._tdev = torch.device("cuda", self._device)
        return d

    def _view(self, view: Any, dtype: Any):
        """A torch tensor over a native view (no copy), re-typed to ``dtype``."""
        import torch

        t = torch.as_tensor(view, device=self._torch_device())
        return t.view(dtype) if t.dtype != dtype else t

    def _finish(self, native: Any, caller: int, async_finish: bool, keep: Tuple[Any, ...],
                outputs: Tuple[Any, ...], on_comm: bool = False) -> EventOverlap:
        """Ends an operation queued on ``native``'s communication stream: with ``async_finish``
        an event there (keeping ``keep`` and ``outputs`` alive, and their memory from reuse
        before it, as DeepEP), else the caller's stream ``caller`` waits for it and no event is
        made (DeepEP's ``EventOverlap(None)``). ``on_comm``: the outputs were allocated on the
        communication stream (``allocate_on_comm_stream``), so the current stream, which frees
        them, is recorded."""
        if on_comm:
            import torch

            compute = torch.cuda.current_stream(self._device)
            for t in outputs:
                if t is not None:
                    t.record_stream(compute)
        if async_finish:
            comm = self._comm_of(native)
            for t in keep + outputs:
                if t is not None and hasattr(t, "record_stream"):
                    t.record_stream(comm)
            return EventOverlap(EventHandle._recorded_on(comm), extra_tensors=tuple(keep) + tuple(outputs))
        native.caller_after(caller)
        return EventOverlap(None)

    def _check_previous(self, previous_event, allocate_on_comm_stream, async_finish) -> None:
        if async_finish.__class__ is not bool:
            chk.flag("async_finish", async_finish)
        if allocate_on_comm_stream.__class__ is not bool:
            chk.flag("allocate_on_comm_stream", allocate_on_comm_stream)
        if previous_event is None:
            if allocate_on_comm_stream:
                raise ValueError("allocate_on_comm_stream=True needs previous_event (as in DeepEP)")
            return
        if not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        if previous_event.event is None:
            raise TypeError(f"previous_event must be an EventOverlap with an event, got {previous_event!r}")

    def _normal_mode(self, what: str) -> bool:
        """Whether normal mode runs internode here (the group spans several nodes); raises for
        what normal mode cannot do: a split the core's internode buffer cannot take, or masked
        ranks on the internode path (the intranode kernels honour masks, the internode buffer
        has none)."""
        if self._split_refusal is not None:
            raise _not_implemented(f"{self._split_refusal} ({what})")
        internode = self._nodes > 1
        if internode and any(self._pending_mask):
            masked = [r for r, m in enumerate(self._pending_mask) if m]
            raise _not_implemented(
                f"rank masks in internode normal mode ({what} while ranks {masked} are masked: "
                "the internode buffer has no rank masks; call low_latency_clean_mask_buffer first)"
            )
        return internode

    # ----- normal mode -----------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: Any,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Tokens per rank / expert and ``is_token_in_rank`` from ``topk_idx`` ``[T, K]``.

        Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 (None
        within one node), num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool,
        EventOverlap)``; computed with torch operations on the current stream (after
        ``previous_event``), with no host synchronisation.
        """
        self._live()
        if self._split_refusal is not None:
            raise _not_implemented(f"{self._split_refusal} (get_dispatch_layout)")
        self._check_previous(previous_event, allocate_on_comm_stream, async_finish)
        chk.tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, self._device)
        chk.positive_int("num_experts", num_experts)
        if num_experts % self.group_size != 0:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the {self.group_size} ranks")
        import torch

        if previous_event is not None:
            previous_event.current_stream_wait()
        ranks = self.group_size
        local = num_experts // ranks
        idx = topk_idx
        valid = (idx >= 0) & (idx < num_experts)
        rank_of = torch.where(valid, idx // local, -1)
        is_token_in_rank = (rank_of.unsqueeze(-1) == self._rank_ids(ranks)).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
        # scatter_add, not bincount or boolean indexing: no host synchronisation.
        slot = torch.where(valid, idx, num_experts).flatten()
        if slot.dtype != torch.int64:
            slot = slot.long()
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=idx.device)
        counts.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
        num_tokens_per_expert = counts[:num_experts]
        num_tokens_per_rdma_rank = None
        if self._nodes > 1:
            # Tokens per node: a token counts once for a node however many of its ranks it goes to.
            per_node = is_token_in_rank.view(idx.shape[0], self._nodes, self._ranks_per_node).any(dim=2)
            num_tokens_per_rdma_rank = per_node.sum(dim=0, dtype=torch.int32)
        # As DeepEP: an event only for async_finish (the work is on the current stream already).
        event = EventOverlap(EventHandle._recorded_on(torch.cuda.current_stream()) if async_finish else None)
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event

    def _rank_ids(self, ranks: int):
        """``torch.arange(ranks)`` on this Buffer's GPU, made once."""
        ids = self._rank_ids_t
        if ids is None:
            import torch

            ids = self._rank_ids_t = torch.arange(ranks, device=self._torch_device())
        return ids

    def _check_x(self, x: Any) -> Tuple[bool, int, int, Any, Any]:
        """(fp8, tokens, hidden, values, scales) of a dispatch ``x``."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"x as a tuple must be (fp8 values, scales), got {len(x)} items")
            values, scales = x
            t, h = chk.tensor("x[0]", values, ("float8_e4m3fn",), 2, self._device)
            if h % _FP8_BLOCK != 0:
                raise ValueError(f"x[0]: FP8 hidden {h} is not a multiple of {_FP8_BLOCK}")
            chk.tensor("x[1]", scales, ("float32",), 2, self._device, (t, h // _FP8_BLOCK))
            return True, t, h, values, scales
        t, h = chk.tensor("x", x, ("bfloat16",), 2, self._device)
        if (h * 2) % 16 != 0:
            raise ValueError(f"x: hidden {h} gives rows of {h * 2} bytes, not a multiple of 16")
        return False, t, h, x, None

    def dispatch(
        self,
        x: Union[Any, Tuple[Any, Any]],
        handle: Optional[Union[_IntranodeHandle, _InternodeHandle]] = None,
        num_tokens_per_rank: Optional[Any] = None,
        num_tokens_per_rdma_rank: Optional[Any] = None,
        is_token_in_rank: Optional[Any] = None,
        num_tokens_per_expert: Optional[Any] = None,
        topk_idx: Optional[Any] = None,
        topk_weights: Optional[Any] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Sends each token to the ranks holding its experts: over NVLink within one node,
        through the NIC and then NVLink when the group spans several (see the module docs).

        Returns ``(recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, EventOverlap)``; a cached call (``handle``
        given) returns ``(recv_x, None, None, None, None, EventOverlap)``.
        ``num_tokens_per_rdma_rank`` (from ``get_dispatch_layout``) is checked when the group
        spans several nodes and must be None within one.
        """
        self._live()
        internode = self._normal_mode("dispatch")
        self._check_previous(previous_event, allocate_on_comm_stream, async_finish)
        fp8, t, h, values, scales = self._check_x(x)
        chk.positive_int("expert_alignment", expert_alignment)
        chk.positive_int("num_worst_tokens", num_worst_tokens, 0)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a Config, got {type(config).__name__}")
        # Only the SMs are ours to use; DeepEP's table configs all take Buffer.num_sms.
        num_sms = config.num_sms if config is not None else Buffer.num_sms
        ranks = self.group_size
        if handle is not None:
            self._check_handle(handle, internode)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=) takes no topk_idx / topk_weights")
            if t != handle.num_tokens:
                raise ValueError(f"x has {t} tokens, the handle's dispatch sent {handle.num_tokens}")
            return self._dispatch_cached(handle, fp8, t, h, values, scales, num_sms, previous_event, async_finish,
                                         allocate_on_comm_stream)
        if is_token_in_rank is None:
            raise ValueError("dispatch without handle= needs is_token_in_rank (from get_dispatch_layout)")
        dev = self._device
        chk.tensor("is_token_in_rank", is_token_in_rank, ("bool",), 2, dev, (t, ranks))
        if num_tokens_per_rank is None:
            raise ValueError("dispatch without handle= needs num_tokens_per_rank (from get_dispatch_layout)")
        chk.tensor("num_tokens_per_rank", num_tokens_per_rank, ("int32",), 1, dev, (ranks,))
        if num_tokens_per_rdma_rank is not None:
            if not internode:
                raise ValueError(
                    f"num_tokens_per_rdma_rank is for a group that spans several nodes; this one is one "
                    f"node of {ranks} ranks (get_dispatch_layout returned None for it): pass None"
                )
            chk.tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, ("int32",), 1, dev, (self._nodes,))
        if num_tokens_per_expert is None:
            raise ValueError("dispatch without handle= needs num_tokens_per_expert (from get_dispatch_layout)")
        (num_experts,) = chk.tensor("num_tokens_per_expert", num_tokens_per_expert, ("int32",), 1, dev)
        if num_experts == 0 or num_experts % ranks != 0:
            raise ValueError(f"num_tokens_per_expert has {num_experts} experts, not a positive multiple of {ranks} ranks")
        k = 0
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx and topk_weights go together: give both or neither")
        if topk_idx is not None:
            _, k = chk.tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, dev, (t, None))
            chk.tensor("topk_weights", topk_weights, ("float32",), 2, dev, (t, k))
        if num_worst_tokens > 0 and topk_idx is None:
            raise ValueError("num_worst_tokens > 0 needs topk_idx and topk_weights (as in DeepEP)")
        # Without top-k the route stands in for it: one expert of each destination rank.
        route_k = k if topk_idx is not None else ranks
        buf = self._normal_buffer(internode, t, h, route_k, num_experts)
        buf.check_errors()
        import torch

        # The routing in the kernels' i32, made on the current stream before the hand-off.
        if topk_idx is not None:
            idx32 = topk_idx if topk_idx.dtype == torch.int32 else topk_idx.to(torch.int32)
            route_w = topk_weights
        else:
            local = num_experts // ranks
            first = (torch.arange(ranks, device=is_token_in_rank.device, dtype=torch.int32) * local).expand(t, ranks)
            idx32 = torch.where(is_token_in_rank, first, torch.full_like(first, -1)).contiguous()
            route_w = None
            if internode:
                route_w = torch.zeros((t, ranks), dtype=torch.float32, device=is_token_in_rank.device)
        caller = self._begin(buf, previous_event)
        layout = buf.layout(idx32.data_ptr(), t, route_k)
        scales_ptr = scales.data_ptr() if fp8 else 0
        if internode:
            # The internode core always routes by top-k: the stand-in when none was given.
            out = buf.dispatch(layout, values.data_ptr(), fp8, t, h, scales_ptr, idx32.data_ptr(),
                               route_w.data_ptr(), route_k, num_worst_tokens, expert_alignment)
        else:
            out = buf.dispatch(layout, values.data_ptr(), fp8, t, h, scales_ptr,
                               idx32.data_ptr() if topk_idx is not None else 0,
                               topk_weights.data_ptr() if topk_idx is not None else 0,
                               k, num_worst_tokens, expert_alignment, num_sms)
        recv_topk_idx = recv_topk_weights = None
        with self._allocating(buf, allocate_on_comm_stream):
            recv_x, recv_scales = self._empty_x(out, fp8, h)
            if topk_idx is not None:
                tdev = self._torch_device()
                recv_topk_idx = torch.empty(tuple(out.topk_idx.shape), dtype=topk_idx.dtype, device=tdev)
                recv_topk_weights = torch.empty(tuple(out.topk_weights.shape), dtype=torch.float32, device=tdev)
        # The copies out of the native buffer's pooled memory run on its stream: its next
        # operation may reuse that memory after them, whatever the caller's stream does.
        with self._on(buf):
            self._copy_x(out, fp8, recv_x, recv_scales)
            if topk_idx is not None:
                recv_topk_idx.copy_(self._view(out.topk_idx, torch.int32))
                recv_topk_weights.copy_(self._view(out.topk_weights, torch.float32))
        if num_worst_tokens > 0 or (internode and topk_idx is None):
            counts = []
        else:
            counts = list(out.num_recv_tokens_per_expert or [])
        if internode:
            new_handle = _InternodeHandle(out.handle, is_token_in_rank, t, h, self._id)
        else:
            new_handle = _IntranodeHandle(out.handle, t, h, self._id)
        keep = (values, scales, topk_idx, topk_weights, is_token_in_rank, idx32, route_w) + self._native_outputs(internode, out)
        event = self._finish(buf, caller, async_finish, keep, (recv_x, recv_scales, recv_topk_idx, recv_topk_weights),
                             allocate_on_comm_stream)
        rx = (recv_x, recv_scales) if fp8 else recv_x
        return rx, recv_topk_idx, recv_topk_weights, counts, new_handle, event

    @staticmethod
    def _native_outputs(internode: bool, out: Any) -> Tuple[Any, ...]:
        """What an operation's event keeps alive besides tensors: the internode core's outputs
        are allocations of their own (not pooled regions), freed when the last view of them
        goes, which would wait for the device; kept with an ``async_finish`` event, they go
        after the copies from them instead."""
        return (out,) if internode else ()

    def _check_handle(self, handle: Any, internode: bool) -> None:
        """``TypeError`` unless ``handle`` is what a dispatch of this Buffer returned (in the
        mode this group runs: intranode or internode)."""
        kind = _InternodeHandle if internode else _IntranodeHandle
        if not isinstance(handle, kind) or handle.buffer_id != self._id:
            raise TypeError(
                f"handle must be the handle a dispatch of this Buffer returned (an "
                f"{'internode' if internode else 'intranode'} one here), got {type(handle).__name__}"
            )

    def _empty_x(self, out: Any, fp8: bool, h: int):
        """Tensors for a dispatch's received rows (and scales), on the current stream."""
        import torch

        dev = self._torch_device()
        recv_x = torch.empty((out.x.shape[0], h), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
        recv_scales = torch.empty(tuple(out.scales.shape), dtype=torch.float32, device=dev) if fp8 else None
        return recv_x, recv_scales

    def _copy_x(self, out: Any, fp8: bool, recv_x: Any, recv_scales: Any) -> None:
        """Copies a dispatch's received rows (and scales) into ``recv_x`` (and ``recv_scales``),
        on the current stream."""
        recv_x.copy_(self._view(out.x, recv_x.dtype))
        if fp8:
            recv_scales.copy_(self._view(out.scales, recv_scales.dtype))

    def _on(self, native: Any) -> _OnStream:
        """``with self._on(native):`` makes ``native``'s communication stream torch's current
        stream, and the one current before current again after."""
        import torch

        return _OnStream(torch, self._comm_of(native))

    def _allocating(self, native: Any, on_comm: bool):
        """Where outputs are allocated: the current stream, or ``native``'s communication
        stream with ``allocate_on_comm_stream`` (as DeepEP)."""
        return self._on(native) if on_comm else _NO_SWITCH

    def _dispatch_cached(self, handle, fp8, t, h, values, scales, num_sms, previous_event, async_finish,
                         allocate_on_comm_stream=False):
        import torch

        internode = isinstance(handle, _InternodeHandle)
        buf = self._internode_native if internode else self._intranode
        if h > buf.limits[1]:
            raise ValueError(f"cached dispatch: hidden {h} above this Buffer's {buf.limits[1]}")
        buf.check_errors()
        caller = self._begin(buf, previous_event)
        scales_ptr = scales.data_ptr() if fp8 else 0
        if internode:
            out = buf.dispatch_cached(handle.native, values.data_ptr(), fp8, t, h, scales_ptr)
        else:
            out = buf.dispatch_cached(handle.native, values.data_ptr(), fp8, t, h, scales_ptr, num_sms)
        with self._allocating(buf, allocate_on_comm_stream):
            recv_x, recv_scales = self._empty_x(out, fp8, h)
        with self._on(buf):
            self._copy_x(out, fp8, recv_x, recv_scales)
        keep = (values, scales) + self._native_outputs(internode, out)
        event = self._finish(buf, caller, async_finish, keep, (recv_x, recv_scales), allocate_on_comm_stream)
        rx = (recv_x, recv_scales) if fp8 else recv_x
        return rx, None, None, None, None, event

    def combine(
        self,
        x: Any,
        handle: Union[_IntranodeHandle, _InternodeHandle],
        topk_weights: Optional[Any] = None,
        bias: Union[Any, Tuple[Any, Any], None] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Sums each token's expert outputs back on the rank that sent it (f32 accumulation).

        Returns ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None,
        EventOverlap)``.
        """
        self._live()
        internode = self._normal_mode("combine")
        self._check_previous(previous_event, allocate_on_comm_stream, async_finish)
        self._check_handle(handle, internode)
        rows, h = chk.tensor("x", x, ("bfloat16",), 2, self._device, (handle.num_rows, None))
        if (h * 2) % 16 != 0:
            raise ValueError(f"x: hidden {h} gives rows of {h * 2} bytes, not a multiple of 16")
        k = 0
        if topk_weights is not None:
            _, k = chk.tensor("topk_weights", topk_weights, ("float32",), 2, self._device, (rows, None))
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a Config, got {type(config).__name__}")
        biases: Tuple[Any, ...] = ()
        if bias is not None:
            biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
            if len(biases) > 2:
                raise ValueError(f"bias: at most two tensors, got {len(biases)}")
            for i, b in enumerate(biases):
                if b is not None:
                    chk.tensor(f"bias[{i}]", b, ("bfloat16",), 2, self._device, (handle.num_tokens, h))
        biases = tuple(biases) + (None,) * (2 - len(biases))
        num_sms = config.num_sms if config is not None else Buffer.num_sms
        import torch

        buf = self._internode_native if internode else self._intranode
        # The combine's kernels run on whatever arrived: a device error an earlier operation
        # recorded (none of them waited for it on the host) raises here, not as wrong sums.
        buf.check_errors()
        caller = self._begin(buf, previous_event)
        ptrs = (
            handle.native,
            x.data_ptr(),
            rows,
            h,
            topk_weights.data_ptr() if topk_weights is not None else 0,
            k,
            biases[0].data_ptr() if biases[0] is not None else 0,
            biases[1].data_ptr() if biases[1] is not None else 0,
        )
        # The internode core picks the NVLink hop's SMs itself.
        out = buf.combine(*ptrs) if internode else buf.combine(*ptrs, num_sms)
        dev = self._torch_device()
        combined_w = None
        with self._allocating(buf, allocate_on_comm_stream):
            combined_x = torch.empty((handle.num_tokens, h), dtype=torch.bfloat16, device=dev)
            if topk_weights is not None:
                combined_w = torch.empty((handle.num_tokens, k), dtype=torch.float32, device=dev)
        with self._on(buf):
            combined_x.copy_(self._view(out.x, torch.bfloat16))
            if topk_weights is not None:
                combined_w.copy_(self._view(out.topk_weights, torch.float32))
        keep = (x, topk_weights) + biases + self._native_outputs(internode, out)
        event = self._finish(buf, caller, async_finish, keep, (combined_x, combined_w), allocate_on_comm_stream)
        return combined_x, combined_w, event

    # ----- low-latency mode ------------------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[Any] = None,
        dispatch_wait_recv_cost_stats: Optional[Any] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Sends each token straight into its slot at the ranks of its experts (decode path).

        Returns ``(recv_x or (recv_x_fp8, recv_scales), recv_count [L] int32, handle,
        EventOverlap, hook)`` (``hook`` is None without ``return_recv_hook``, as in DeepEP); ``recv_x`` is ``[L, R*N, H]``, FP8 scales ``[L, R*N, H/128]``
        float32 (or ``[L, R*N, H/512]`` int32 packed UE8M0), a column-major view as DeepEP's.
        """
        if self._destroyed:
            self._live()
        if not self.low_latency_mode:
            raise RuntimeError("low_latency_dispatch needs a Buffer created with low_latency_mode=True")
        if not (use_fp8.__class__ is bool and round_scale.__class__ is bool and use_ue8m0.__class__ is bool
                and async_finish.__class__ is bool and return_recv_hook.__class__ is bool):
            for name, v in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0),
                            ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                chk.flag(name, v)
        n = num_max_dispatch_tokens_per_rank
        if n.__class__ is not int or n < 1:
            n = chk.positive_int("num_max_dispatch_tokens_per_rank", n)
        if num_experts.__class__ is not int or num_experts < 1:
            chk.positive_int("num_experts", num_experts)
        ranks = self.group_size
        if num_experts % ranks != 0:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the {ranks} ranks")
        dev = self._device
        t, h = chk.tensor("x", x, ("bfloat16",), 2, dev)
        if t > n:
            raise ValueError(f"x has {t} tokens, more than num_max_dispatch_tokens_per_rank {n}")
        _, k = chk.tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, dev, (t, None))
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (as in DeepEP)")
        if use_ue8m0 and not use_fp8:
            raise ValueError("use_ue8m0=True needs use_fp8=True")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook exclude each other (as in DeepEP)")
        local = num_experts // ranks
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            chk.tensor("cumulative_local_expert_recv_stats", stats, ("int32",), 1, dev, (local,))
        wait_stats = dispatch_wait_recv_cost_stats
        if wait_stats is not None:
            chk.tensor("dispatch_wait_recv_cost_stats", wait_stats, ("int64",), 1, dev, (ranks,))
        import torch

        lim = self._ll_limits
        if lim is None or n != lim[0] or h > lim[1] or k > lim[2] or num_experts != lim[3]:
            buf = self._ll_buffer(n, h, k, num_experts)  # built here, or ValueError
        else:
            buf = self._ll
        # An error an earlier operation's kernels recorded raises here, before anything is queued.
        buf.check_errors()
        caller = self._caller()
        # On the current stream, before the hand-off: the kernels' i32 routing, and the tensors
        # the kernel writes the rows and counts straight into (no copy; only the FP8 scales are
        # copied, to DeepEP's column-major layout).
        idx32 = topk_idx if topk_idx.dtype is torch.int32 else topk_idx.to(torch.int32)
        tdev = self._torch_device()
        recv_x = torch.empty((local, ranks * n, h), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                             device=tdev)
        recv_count = torch.empty((local,), dtype=torch.int32, device=tdev)
        buf.comm_after(caller)
        out = buf.dispatch(x.data_ptr(), t, h, idx32.data_ptr(), k, use_fp8, round_scale, use_ue8m0, return_recv_hook,
                           wait_stats.data_ptr() if wait_stats is not None else 0, recv_x.data_ptr(),
                           recv_count.data_ptr())
        recv_scales = None
        if use_fp8:
            sl, rows, words = out.scales.shape
            # Column-major per expert, as DeepEP returns them.
            recv_scales = torch.empty((sl, words, rows), dtype=torch.int32 if use_ue8m0 else torch.float32,
                                      device=tdev).transpose(1, 2)

        def copy_out():
            # On the buffer's stream, after the receive: the next dispatches there may reuse the
            # scales' memory after this, whatever the caller's stream does.
            if recv_scales is None and stats is None:
                return
            with self._on(buf):
                if recv_scales is not None:
                    recv_scales.copy_(self._view(out.scales, recv_scales.dtype))
                if stats is not None:
                    stats.add_(recv_count)

        handle = _LowLatencyHandle(out.handle, n, h, num_experts, self._id)
        if idx32 is not topk_idx:
            handle.routing = (topk_idx, idx32, caller)
        outputs = (recv_x, recv_scales, recv_count)
        rx = (recv_x, recv_scales) if use_fp8 else recv_x
        if return_recv_hook:
            native_hook = out.hook
            # The inputs, and the outputs the receive writes, stay alive until it is queued.
            keep = (x, topk_idx, idx32, stats, wait_stats, out, recv_x, recv_count)

            def hook():
                _ = keep  # the inputs stay alive until the receive is queued
                cur = self._caller()
                buf.comm_after(cur)
                native_hook.call()
                copy_out()
                buf.caller_after(cur)

            # The receive writes them on the buffer's stream when the hook runs, which the
            # stream current then (not necessarily this one) waits for.
            stream = self._comm_of(buf)
            for tt in outputs:
                if tt is not None:
                    tt.record_stream(stream)
            return rx, recv_count, handle, EventOverlap(None), hook
        copy_out()
        event = self._finish(buf, caller, async_finish, (x, topk_idx, idx32, stats, wait_stats), outputs)
        return rx, recv_count, handle, event, None

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: _LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[Any] = None,
        combine_wait_recv_cost_stats: Optional[Any] = None,
    ):
        """Sums each token's top-k weighted expert outputs back (BF16, f32 accumulation).

        Returns ``(combined_x [T, H] bf16, EventOverlap, hook)`` (``hook`` None without
        ``return_recv_hook``).
        """
        if self._destroyed:
            self._live()
        if not self.low_latency_mode:
            raise RuntimeError("low_latency_combine needs a Buffer created with low_latency_mode=True")
        if not (use_logfmt.__class__ is bool and zero_copy.__class__ is bool and async_finish.__class__ is bool
                and return_recv_hook.__class__ is bool):
            for name, v in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy),
                            ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                chk.flag(name, v)
        if use_logfmt and zero_copy:
            raise ValueError("use_logfmt and zero_copy exclude each other (as in DeepEP: the rows are encoded on the way)")
        if handle.__class__ is not _LowLatencyHandle or handle.buffer_id != self._id:
            raise TypeError("handle must be the handle a low_latency_dispatch of this Buffer returned")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook exclude each other (as in DeepEP)")
        ranks = self.group_size
        local = handle.num_experts // ranks
        n, h, t = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_tokens
        dev = self._device
        xs = chk.tensor("x", x, ("bfloat16",), 3, dev, (local, ranks * n, h))
        _, k = chk.tensor("topk_idx", topk_idx, _TOPK_DTYPES, 2, dev, (t, None))
        chk.tensor("topk_weights", topk_weights, ("float32",), 2, dev, (t, k))
        if out is not None:
            chk.tensor("out", out, ("bfloat16",), 2, dev, (t, h))
        if use_logfmt and h % 128 != 0:
            raise ValueError(f"use_logfmt needs hidden a multiple of 128, got {h}")
        wait_stats = combine_wait_recv_cost_stats
        if wait_stats is not None:
            chk.tensor("combine_wait_recv_cost_stats", wait_stats, ("int64",), 1, dev, (ranks,))
        import torch

        buf = self._ll
        buf.check_errors()
        caller = self._caller()
        # On the current stream, before the hand-off: the kernels' i32 routing (the dispatch's
        # cast, when this is the tensor it cast and the caller's stream is the one it was made
        # on, which alone may reuse its memory), and the tensor the kernel writes the combined
        # rows straight into (no copy).
        idx32 = topk_idx
        if topk_idx.dtype is not torch.int32:
            r = handle.routing
            if r is not None and r[0] is topk_idx and r[2] == caller:
                idx32 = r[1]
            else:
                idx32 = topk_idx.to(torch.int32)
        combined = out if out is not None else torch.empty((t, h), dtype=torch.bfloat16, device=self._torch_device())
        buf.comm_after(caller)
        res = buf.combine(
            handle.native,
            0 if zero_copy else x.data_ptr(),
            list(xs),
            idx32.data_ptr(),
            topk_weights.data_ptr(),
            t,
            k,
            return_recv_hook,
            use_logfmt,
            wait_stats.data_ptr() if wait_stats is not None else 0,
            combined.data_ptr(),
        )

        if return_recv_hook:
            native_hook = res.hook
            # The inputs, and the output the receive writes, stay alive until it is queued.
            keep = (x, topk_idx, topk_weights, idx32, wait_stats, res, combined)

            def hook():
                _ = keep
                cur = self._caller()
                buf.comm_after(cur)
                native_hook.call()
                buf.caller_after(cur)

            # The receive writes it on the buffer's stream when the hook runs (see dispatch).
            if out is None:
                combined.record_stream(self._comm_of(buf))
            return combined, EventOverlap(None), hook
        event = self._finish(buf, caller, async_finish, (x, topk_idx, topk_weights, idx32, out, wait_stats),
                             (combined,) if out is None else ())
        return combined, event, None

    def get_next_low_latency_combine_buffer(self, handle: _LowLatencyHandle):
        """The BF16 ``[L, R*N, H]`` buffer that a ``zero_copy`` combine reads (a view of the
        buffer's own memory: write the expert outputs there)."""
        self._live()
        if not isinstance(handle, _LowLatencyHandle) or handle.buffer_id != self._id:
            raise TypeError("handle must be the handle a low_latency_dispatch of this Buffer returned")
        import torch

        return self._view(self._ll.combine_input(handle.hidden), torch.bfloat16)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Resets the low-latency signals of every rank (a collective: every rank calls it;
        host-synchronous, with barriers before and after). Masks are kept. Checks the sizes
        against the buffer's; nothing to reset before the first ``low_latency_dispatch``."""
        self._live()
        chk.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        chk.positive_int("hidden", hidden)
        chk.positive_int("num_experts", num_experts)
        if self._ll is not None:
            lim = self._ll.limits
            if num_max_dispatch_tokens_per_rank != lim[0] or hidden > lim[1] or num_experts != lim[3]:
                raise ValueError(
                    f"clean_low_latency_buffer({num_max_dispatch_tokens_per_rank}, {hidden}, {num_experts}): "
                    f"the low-latency buffer is for ({lim[0]}, up to {lim[1]}, {lim[3]})"
                )
            import torch

            # The caller's earlier work first (its stream may still write what it passed us).
            torch.cuda.current_stream().synchronize()
            self._ll.clean()

    def _need_shrink(self, what: str) -> None:
        self._live()
        if not self.enable_shrink:
            raise RuntimeError(f"{what} needs a Buffer created with enable_shrink=True (as in DeepEP)")

    def _ll_stream_after_current(self):
        """The low-latency stream, made to wait for the caller's current stream."""
        import torch

        stream = self._external_stream(self._ll.stream)
        stream.wait_stream(torch.cuda.current_stream())
        return stream

    def _intranode_stream_after_current(self):
        """The intranode communication stream, made to wait for the caller's current stream."""
        import torch

        stream = self._external_stream(self._intranode.comm_stream)
        stream.wait_stream(torch.cuda.current_stream())
        return stream

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks ``rank_to_mask`` on this rank: later low-latency
        and normal-mode operations send nothing to it and treat what it sends as absent (needs
        ``enable_shrink``; normal mode: see the module docstring for what the masks of all ranks
        must be). Ordered after the caller's current stream."""
        self._need_shrink("low_latency_update_mask_buffer")
        if not isinstance(rank_to_mask, int) or isinstance(rank_to_mask, bool) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.group_size}), got {rank_to_mask!r}")
        chk.flag("mask", mask)
        if mask and rank_to_mask == self.rank and not self.low_latency_mode:
            raise ValueError(f"rank_to_mask {rank_to_mask}: in normal mode a rank cannot mask itself")
        # The host's copy of the caller's masks: applied when a native buffer is built.
        self._pending_mask[rank_to_mask] = int(mask)
        if self._ll is not None:
            self._ll_stream_after_current()
            self._ll.update_mask(rank_to_mask, mask)
        # A rank always links itself in normal mode (only low-latency masks can name it).
        if self._intranode is not None and rank_to_mask != self.rank:
            self._intranode_stream_after_current()
            self._intranode.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Fills ``mask_status`` (int32 ``[num_ranks]``) with who is masked on this rank (1:
        masked by the caller, or, in low-latency mode, because a wait on it timed out). Ordered
        on the caller's current stream (needs ``enable_shrink``). A ``low_latency_mode`` Buffer
        reports its low-latency buffer's masks, any other its intranode buffer's."""
        self._need_shrink("low_latency_query_mask_buffer")
        chk.tensor("mask_status", mask_status, ("int32",), 1, self._device, (self.group_size,))
        import torch

        if self._ll is not None and (self.low_latency_mode or self._intranode is None):
            stream = self._ll_stream_after_current()
            self._ll.query_mask(mask_status.data_ptr())
        elif self._intranode is not None:
            stream = self._intranode_stream_after_current()
            self._intranode.query_mask(mask_status.data_ptr())
        else:
            mask_status.copy_(torch.tensor(self._pending_mask, dtype=torch.int32), non_blocking=False)
            return
        cur = torch.cuda.current_stream()
        cur.wait_stream(stream)
        mask_status.record_stream(stream)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank on this rank (needs ``enable_shrink``)."""
        self._need_shrink("low_latency_clean_mask_buffer")
        self._pending_mask = [0] * self.group_size
        if self._ll is not None:
            self._ll_stream_after_current()
            self._ll.clean_mask()
        if self._intranode is not None:
            self._intranode_stream_after_current()
            self._intranode.clean_mask()

    # ----- misc ------------------------------------------------------------------------------

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0, use_rdma_buffer: bool = False):
        """A tensor over this rank's own buffer memory, as DeepEP's: ``dtype`` elements from byte
        ``offset`` of the RDMA buffer (``use_rdma_buffer=True``: the low-latency network buffer)
        or of the NVLink buffer (the intranode window); all that fit (1-D), or the first
        ``size`` (a ``torch.Size``, a tuple of ints or an int) of them in that shape. No copy:
        writes go to the buffer itself.

        The memory is the native buffer's, laid out as the Rust core plans it (signals first,
        then rows), not as DeepEP's, and peers write it during every operation: use it as
        scratch only between operations, and after overwriting the low-latency signals (vLLM
        zeroes the RDMA buffer) call ``clean_low_latency_buffer`` on every rank before the next
        low-latency call. The native buffers are built at the first call that needs them, so
        the RDMA buffer exists after the first ``low_latency_dispatch`` and the NVLink buffer
        after the first ``dispatch``; before that this raises ``RuntimeError``. When the group
        spans several nodes the NVLink buffer is the internode buffer's NVLink-hop window (its
        node's intranode buffer); the RDMA buffer is always the low-latency one.
        """
        self._live()
        elem = chk.dtype_bytes("dtype", dtype)
        chk.flag("use_rdma_buffer", use_rdma_buffer)
        chk.positive_int("offset", offset, 0)
        shape = None
        if size is not None:
            shape = chk.shape("size", size)
        if offset % elem != 0:
            raise ValueError(f"offset {offset} is not a multiple of {chk.dtype_name_of(dtype)}'s {elem} bytes")
        native, which, first = (
            (self._ll, "RDMA (low-latency network)", "low_latency_dispatch")
            if use_rdma_buffer
            else (self._intranode or self._internode_native, "NVLink (intranode)", "dispatch")
        )
        if native is None:
            raise RuntimeError(
                f"get_local_buffer_tensor: this Buffer's {which} buffer does not exist yet: it is built "
                f"at the first {first} (its sizes come from that call's shapes); call this after it"
            )
        import torch

        raw = self._view(native.local_buffer(), torch.uint8)
        total = int(raw.numel())
        avail = (total - offset) // elem if offset <= total else -1
        if avail < 0:
            raise ValueError(f"offset {offset} is past the end of the {which} buffer ({total} bytes)")
        n = avail
        if shape is not None:
            n = 1
            for d in shape:
                n *= d
            if n > avail:
                raise ValueError(
                    f"size {list(shape)} of {chk.dtype_name_of(dtype)} needs {n * elem} bytes from offset "
                    f"{offset}; the {which} buffer has {total} bytes ({avail * elem} from there)"
                )
        t = raw[offset : offset + n * elem].view(dtype)
        return t if shape is None else t.view(shape)

    def get_comm_stream(self):
        """The communication stream (``torch.cuda.Stream``) of the normal-mode operations."""
        self._live()
        native = self._intranode or self._internode_native
        if native is None:
            raise RuntimeError("get_comm_stream: the communication stream is created at the first dispatch of this Buffer")
        return self._external_stream(native.comm_stream)

    def destroy(self) -> None:
        """Frees the buffer with every rank (a collective; needs ``explicitly_destroy=True``)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a Buffer created with explicitly_destroy=True (as in DeepEP)")
        if self._destroyed:
            return
        self._destroyed = True
        errors = []
        for native in (self._ll, self._intranode, self._internode_native):
            if native is not None:
                try:
                    native.shutdown()
                except Exception as e:  # every part is released; report the first failure
                    errors.append(e)
        self._ll = self._intranode = self._internode_native = None
        if errors:
            raise errors[0]
