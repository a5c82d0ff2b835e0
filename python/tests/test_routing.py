"""Which native buffer normal mode drives, with what: ``Buffer`` over a shape-only fake torch
(``fake_torch``) and fake native classes standing in for ``_ep.Intranode`` / ``_ep.Internode``
with their exact signatures, so the routing runs without torch and without a GPU. The native
side itself, and the values, are checked on the GPU (``test_gpu_internode.py``,
``test_gpu_intranode.py``)."""

import pytest

import fake_torch
from conftest import OneRankGroup

T, H, K, E, W = 20, 256, 4, 16, 4
ROWS = 37  # rows every fake dispatch receives


class View:
    def __init__(self, shape, typestr):
        self.shape, self.typestr = list(shape), typestr


class NativeHandle:
    def __init__(self, rows, tokens):
        self.num_rows, self.num_tokens = rows, tokens


class Out:
    pass


def _dispatched(fp8, rows, hidden, k, tokens, per_expert):
    o = Out()
    o.x = View((rows, hidden), "|u1" if fp8 else "<i2")
    o.scales = View((rows, hidden // 128), "<f4") if fp8 else None
    o.topk_idx = View((rows, k), "<i4") if k else None
    o.topk_weights = View((rows, k), "<f4") if k else None
    o.num_recv_tokens = rows
    o.num_recv_tokens_per_expert = per_expert if k else None
    o.handle = NativeHandle(rows, tokens)
    return o


def _combined(handle, hidden, k, with_weights):
    o = Out()
    o.x = View((handle.num_tokens, hidden), "<i2")
    o.topk_weights = View((handle.num_tokens, k), "<f4") if with_weights else None
    return o


class FakeInternode:
    """``_ep.Internode``'s signatures; records each call in ``calls`` (``check_errors`` apart, in
    ``checks``: the call before every operation). ``device_error``: what a kernel of an earlier
    operation recorded, raised by ``check_errors`` as the native one raises it."""

    calls = []
    checks = []
    device_error = None

    def __init__(self, device, rank, world, all_gather, barrier, nodes, ranks_per_node, virtual_nodes,
                 max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs, timeout_s):
        self.calls.append(("new", nodes, ranks_per_node, virtual_nodes, max_hidden, max_topk, num_experts))
        self.limits = [max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs, nodes, ranks_per_node]
        self.comm_stream = 99

    def layout(self, topk_idx_ptr, tokens, k):
        self.calls.append(("layout", tokens, k))
        return object()

    def dispatch(self, layout, x_ptr, fp8, tokens, hidden, scales_ptr, topk_idx_ptr, topk_weights_ptr, k,
                 num_worst_tokens, expert_alignment):
        assert topk_idx_ptr and topk_weights_ptr and (scales_ptr != 0) == fp8
        self.calls.append(("dispatch", fp8, tokens, hidden, k, num_worst_tokens, expert_alignment))
        return _dispatched(fp8, num_worst_tokens or ROWS, hidden, k, tokens, [3, 5])

    def dispatch_cached(self, handle, x_ptr, fp8, tokens, hidden, scales_ptr):
        self.calls.append(("cached", fp8, tokens, hidden))
        return _dispatched(fp8, handle.num_rows, hidden, 0, tokens, None)

    def combine(self, handle, x_ptr, rows, hidden, topk_weights_ptr, k, bias0_ptr, bias1_ptr):
        assert rows == handle.num_rows
        self.calls.append(("combine", rows, hidden, k, bool(bias0_ptr), bool(bias1_ptr)))
        return _combined(handle, hidden, k, topk_weights_ptr != 0)

    def comm_after(self, caller):
        fake_torch.handoff(caller, self.comm_stream)

    def caller_after(self, caller):
        fake_torch.handoff(self.comm_stream, caller)

    def local_buffer(self):
        return View((4096,), "|u1")

    def check_errors(self):
        self.checks.append(len(self.calls))
        if self.device_error is not None:
            raise RuntimeError(self.device_error)

    def shutdown(self):
        self.calls.append(("shutdown",))


class FakeIntranode(FakeInternode):
    """``_ep.Intranode``'s signatures."""

    def __init__(self, device, rank, world, all_gather, barrier, max_tokens_per_rank, max_hidden, max_topk,
                 num_experts, max_live_outputs, timeout_s):
        self.calls.append(("intra new", max_hidden, max_topk, num_experts))
        self.limits = [max_tokens_per_rank, max_hidden, max_topk, num_experts, max_live_outputs]
        self.comm_stream = 98

    def dispatch(self, layout, x_ptr, fp8, tokens, hidden, scales_ptr, topk_idx_ptr, topk_weights_ptr, k,
                 num_worst_tokens, expert_alignment, num_sms):
        self.calls.append(("intra dispatch", bool(topk_idx_ptr), k, num_sms))
        return _dispatched(fp8, num_worst_tokens or ROWS, hidden, k, tokens, [3, 5])

    def dispatch_cached(self, handle, x_ptr, fp8, tokens, hidden, scales_ptr, num_sms):
        self.calls.append(("intra cached", fp8, num_sms))
        return _dispatched(fp8, handle.num_rows, hidden, 0, tokens, None)

    def combine(self, handle, x_ptr, rows, hidden, topk_weights_ptr, k, bias0_ptr, bias1_ptr, num_sms):
        self.calls.append(("intra combine", rows, k, num_sms))
        return _combined(handle, hidden, k, topk_weights_ptr != 0)


@pytest.fixture
def env(monkeypatch):
    """(torch, calls): the fake torch and the natives' call log, for one test."""
    from ep_ibgda import buffer

    torch = fake_torch.install(monkeypatch)
    calls = []
    monkeypatch.setattr(FakeInternode, "calls", calls)
    monkeypatch.setattr(FakeInternode, "checks", [])
    monkeypatch.setattr(FakeInternode, "device_error", None)
    monkeypatch.setattr(buffer._ep, "Internode", FakeInternode, raising=False)
    monkeypatch.setattr(buffer._ep, "Intranode", FakeIntranode)
    return torch, calls


def _inputs(torch):
    idx = torch.Tensor((T, K), torch.int64)
    w = torch.Tensor((T, K), torch.float32)
    x = torch.Tensor((T, H), torch.bfloat16)
    return idx, w, x


def test_virtual_nodes_route_every_normal_call_to_the_internode_buffer(env, monkeypatch):
    import ep_ibgda as deep_ep
    from ep_ibgda.buffer import _InternodeHandle

    torch, calls = env
    monkeypatch.setenv("EP_IBGDA_RANKS_PER_NODE", "2")
    buf = deep_ep.Buffer(OneRankGroup(W), int(1e8), int(1e8), explicitly_destroy=True)
    idx, w, x = _inputs(torch)
    ntpr, ntprr, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert ntprr.shape == (2,) and ntprr.dtype is torch.int32 and in_rank.shape == (T, W)
    lay = dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=in_rank,
               num_tokens_per_expert=ntpe)

    rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=4, **lay)
    # Built at the first dispatch: 2 virtual nodes of 2, top-k at least 16.
    assert calls[0] == ("new", 2, 2, True, H, 16, E)
    assert calls[1:3] == [("layout", T, K), ("dispatch", False, T, H, K, 0, 4)]
    assert rx.shape == (ROWS, H) and rx.dtype is torch.bfloat16
    assert ri.shape == (ROWS, K) and ri.dtype is torch.int64 and rw.dtype is torch.float32
    assert counts == [3, 5]
    assert isinstance(handle, _InternodeHandle) and len(handle) == 10 and handle[0] is in_rank

    combined, cw, ev = buf.combine(rx, handle, topk_weights=rw)
    assert calls[-1] == ("combine", ROWS, H, K, False, False)
    assert combined.shape == (T, H) and cw.shape == (T, K)
    bias = (torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, H), torch.bfloat16))
    combined, cw, ev = buf.combine(rx, handle, bias=bias, previous_event=deep_ep.Buffer.capture(),
                                   async_finish=True, allocate_on_comm_stream=True)
    assert calls[-1] == ("combine", ROWS, H, 0, True, True) and cw is None
    # The internode outputs stay alive with the event (freeing them would wait for the device).
    assert any(isinstance(t, Out) for t in ev.extra_tensors)

    out = buf.dispatch(x, handle=handle)
    assert calls[-1] == ("cached", False, T, H) and out[0].shape == (ROWS, H) and out[1:5] == (None,) * 4

    x8 = (torch.Tensor((T, H), torch.float8_e4m3fn), torch.Tensor((T, H // 128), torch.float32))
    (r8, rs), _, _, _, h8, _ = buf.dispatch(x8, topk_idx=idx, topk_weights=w, async_finish=True, **lay)
    assert calls[-1] == ("dispatch", True, T, H, K, 0, 1)
    assert r8.dtype is torch.float8_e4m3fn and rs.shape == (ROWS, H // 128)
    buf.dispatch(x8, handle=h8)
    assert calls[-1] == ("cached", True, T, H)

    rx, ri, _, counts, hw, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=80, **lay)
    assert calls[-1] == ("dispatch", False, T, H, K, 80, 1) and rx.shape == (80, H) and counts == []

    # Without top-k the core still routes by ids: one expert per destination rank, weights 0.
    rx, ri, rw, counts, hn, _ = buf.dispatch(x, **lay)
    assert calls[-1] == ("dispatch", False, T, H, W, 0, 1)
    assert ri is None and rw is None and counts == []
    buf.combine(rx, hn)

    # A wider row than the buffer was built for says what budgets would hold it.
    with pytest.raises(ValueError, match=r"hidden 512.*num_nvl_bytes >= \d+ and num_rdma_bytes >= \d+"):
        buf.dispatch(torch.Tensor((T, 2 * H), torch.bfloat16), topk_idx=idx, topk_weights=w, **lay)
    assert buf.get_local_buffer_tensor(torch.uint8).shape == (4096,)
    assert buf.get_comm_stream().ptr == 99
    buf.destroy()
    assert calls[-1] == ("shutdown",)


def test_internode_device_errors_raise_before_the_next_operation(env, monkeypatch):
    """The internode combine (and anything with num_worst_tokens) makes no host wait after its
    kernels, and a failed kernel (a wait out of time, a NIC failure) leaves the later ones to
    run on what arrived: a combine then sums only some of each token's copies (seen on an H200
    as a combine off by whole copies, with no error). Every internode operation must first
    raise what the kernels recorded so far, and call nothing native after it."""
    import ep_ibgda as deep_ep

    torch, calls = env
    monkeypatch.setenv("EP_IBGDA_RANKS_PER_NODE", "2")
    buf = deep_ep.Buffer(OneRankGroup(W), int(1e8), int(1e8), explicitly_destroy=True)
    idx, w, x = _inputs(torch)
    ntpr, ntprr, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
    lay = dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=in_rank,
               num_tokens_per_expert=ntpe)
    native = FakeInternode.checks  # the call count at each check

    # Each operation checks before its first native call (the layout's, for a fresh dispatch).
    rx, ri, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    assert calls[native[-1]][0] == "layout" and calls[-1][0] == "dispatch"
    buf.combine(rx, handle, topk_weights=rw)
    assert len(native) == 2 and calls[native[-1]][0] == "combine"
    buf.dispatch(x, handle=handle)
    assert len(native) == 3 and calls[native[-1]][0] == "cached"
    rxw, _, _, _, hw, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=80, **lay)
    buf.combine(rxw, hw, previous_event=deep_ep.Buffer.capture(), async_finish=True)
    assert len(native) == 5 and calls[native[-1]][0] == "combine"

    # A device error recorded by then: each operation raises it and queues nothing.
    monkeypatch.setattr(FakeInternode, "device_error", "rank 0: internode quiet to node 1 failed")
    before = len(calls)
    for op in (
        lambda: buf.combine(rx, handle, topk_weights=rw),
        lambda: buf.combine(rxw, hw, async_finish=True, previous_event=deep_ep.Buffer.capture()),
        lambda: buf.dispatch(x, handle=handle),
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay),
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=80, **lay),
    ):
        with pytest.raises(RuntimeError, match="internode quiet to node 1 failed"):
            op()
    assert len(calls) == before, calls[before:]
    buf.destroy()


def test_one_node_stays_intranode(env, monkeypatch):
    import ep_ibgda as deep_ep
    from ep_ibgda.buffer import _IntranodeHandle

    torch, calls = env
    monkeypatch.setenv("EP_IBGDA_RANKS_PER_NODE", str(W))
    buf = deep_ep.Buffer(OneRankGroup(W), int(1e8), 0, explicitly_destroy=True)
    idx, w, x = _inputs(torch)
    ntpr, ntprr, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert ntprr is None
    lay = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
    rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    assert calls[0] == ("intra new", H, 16, E) and calls[-1] == ("intra dispatch", True, K, 20)
    assert isinstance(handle, _IntranodeHandle) and counts == [3, 5]
    buf.combine(rx, handle, topk_weights=rw)
    assert calls[-1] == ("intra combine", ROWS, K, 20)
    buf.dispatch(x, handle=handle)
    assert calls[-1] == ("intra cached", False, 20)
    buf.dispatch(x, **lay)
    assert calls[-1] == ("intra dispatch", False, 0, 20)
    buf.destroy()
    assert not any(c[0] in ("new", "dispatch", "combine", "cached") for c in calls)


def test_intranode_device_errors_raise_before_the_next_operation(env, monkeypatch):
    """As internode: the intranode combine makes no host wait after its kernels either, so a
    device error recorded by an earlier operation must raise before the next one queues
    anything, not come back as incomplete sums."""
    import ep_ibgda as deep_ep

    torch, calls = env
    monkeypatch.setenv("EP_IBGDA_RANKS_PER_NODE", str(W))
    buf = deep_ep.Buffer(OneRankGroup(W), int(1e8), 0, explicitly_destroy=True)
    idx, w, x = _inputs(torch)
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
    lay = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
    checks = FakeInternode.checks
    rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    buf.combine(rx, handle, topk_weights=rw)
    buf.dispatch(x, handle=handle)
    assert len(checks) == 3, checks
    monkeypatch.setattr(FakeInternode, "device_error", "rank 0: timed out waiting for rank 1")
    before = len(calls)
    for op in (
        lambda: buf.combine(rx, handle, topk_weights=rw),
        lambda: buf.dispatch(x, handle=handle),
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay),
    ):
        with pytest.raises(RuntimeError, match="timed out waiting for rank 1"):
            op()
    assert len(calls) == before, calls[before:]
    monkeypatch.setattr(FakeInternode, "device_error", None)
    buf.destroy()


def test_internode_budget_covers_the_first_dispatch(env, monkeypatch):
    import ep_ibgda as deep_ep

    torch, calls = env
    monkeypatch.setenv("EP_IBGDA_RANKS_PER_NODE", "1")
    idx, w, x = _inputs(torch)
    small = deep_ep.Buffer(OneRankGroup(2), 1, 1)
    ntpr, ntprr, ntpe, in_rank, _ = small.get_dispatch_layout(idx, E)
    # Budgets too small for any token still build for this call's tokens (as intranode does).
    small.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                   num_tokens_per_expert=ntpe)
    assert small._internode_native.limits[0] == T
    big = deep_ep.Buffer(OneRankGroup(2), int(1e8), int(1e8))
    big.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                 num_tokens_per_expert=ntpe)
    assert big._internode_native.limits[0] > 1000


class FakeLowLatency:
    """``_ep.LowLatency``'s constructor; its ``check_errors`` raises what a kernel of an earlier
    operation recorded, and any other native call after it fails the test."""

    def __init__(self, device, rank, world, all_gather, barrier, n, hidden, topk, num_experts, nvlink,
                 timeout_s, shrink):
        self.limits = [n, hidden, topk, num_experts]
        self.stream = 97

    def check_errors(self):
        raise RuntimeError("rank 0: timed out after 20s waiting for rank 1 (low-latency dispatch receive)")

    def __getattr__(self, name):
        raise AssertionError(f"native LowLatency.{name} used after a recorded device error")


def test_low_latency_device_errors_raise_before_anything_is_queued(env, monkeypatch):
    """Low-latency dispatch and combine end without a host wait too: an error their kernels
    recorded raises at the next call, before it queues anything."""
    import ep_ibgda as deep_ep
    from ep_ibgda import buffer

    torch, _ = env
    monkeypatch.setattr(buffer._ep, "LowLatency", FakeLowLatency)
    buf = deep_ep.Buffer(OneRankGroup(W), 0, int(1e10), low_latency_mode=True, explicitly_destroy=True)
    idx = torch.Tensor((T, K), torch.int64)
    x = torch.Tensor((T, H), torch.bfloat16)
    with pytest.raises(RuntimeError, match="timed out after 20s waiting for rank 1"):
        buf.low_latency_dispatch(x, idx, 32, E)
