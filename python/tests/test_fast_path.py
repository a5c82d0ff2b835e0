"""The hot paths' shortcuts keep their contract: the checks still name a bad argument before
anything is queued, the stream hand-off follows the caller's current stream at every call (the
per-Buffer events and torch streams are re-recorded, never a stale stream), an int32
``topk_idx`` is not cast, and events exist only for ``async_finish`` (DeepEP's
``EventOverlap(None)`` otherwise). Over the shape-only ``fake_torch`` and a fake native
low-latency buffer."""

import pytest

import fake_torch
from conftest import FakeTensor, OneRankGroup

T, H, K, E, W, N = 20, 256, 4, 16, 4, 32
LL_STREAM = 55


class _View:
    def __init__(self, shape, typestr):
        self.shape, self.typestr = list(shape), typestr


class _Handle:
    def __init__(self, tokens):
        self.num_tokens = tokens


class _Out:
    hook = None


class FakeLowLatency:
    """``_ep.LowLatency``'s signatures; records each call in ``calls``."""

    calls = []

    def __init__(self, device, rank, world, all_gather, barrier, n, hidden, topk, num_experts, allow_nvlink,
                 timeout_s, enable_shrink=False):
        self.limits = [n, hidden, topk, num_experts]
        self.stream = LL_STREAM

    def check_errors(self):
        pass

    def comm_after(self, caller):
        fake_torch.handoff(caller, self.stream)

    def caller_after(self, caller):
        fake_torch.handoff(self.stream, caller)

    def dispatch(self, x_ptr, tokens, hidden, topk_idx_ptr, k, use_fp8, round_scale, use_ue8m0, return_recv_hook,
                 wait_stats_ptr=0, recv_x_ptr=0, recv_count_ptr=0):
        self.calls.append(("dispatch", topk_idx_ptr, use_fp8))
        o = _Out()
        local = self.limits[3] // W
        o.scales = _View((local, W * self.limits[0], hidden // 128), "<f4") if use_fp8 else None
        o.handle = _Handle(tokens)
        return o

    def combine(self, handle, x_ptr, x_shape, topk_idx_ptr, topk_weights_ptr, tokens, k, return_recv_hook,
                use_logfmt=False, wait_stats_ptr=0, out_ptr=0):
        self.calls.append(("combine", topk_idx_ptr))
        return _Out()


@pytest.fixture
def ll(monkeypatch):
    """(torch, buffer, calls) with the fake torch and native low-latency buffer."""
    import ep_ibgda as deep_ep
    from ep_ibgda import buffer

    torch = fake_torch.install(monkeypatch)
    calls = []
    monkeypatch.setattr(FakeLowLatency, "calls", calls)
    monkeypatch.setattr(buffer._ep, "LowLatency", FakeLowLatency)
    buf = deep_ep.Buffer(OneRankGroup(W), 0, int(1e10), low_latency_mode=True, explicitly_destroy=True)
    return torch, buf, calls


def _handoffs(log):
    """(stream waited for, stream that waits) for each hand-off: the native buffer's, or a torch
    event recorded on one stream and waited for by another."""
    recorded = {}
    out = []
    for e in log:
        if e[0] == "handoff":
            out.append((e[1], e[2]))
        elif e[0] == "record":
            recorded[id(e[1])] = e[2]
        elif e[0] == "wait":
            out.append((recorded.get(id(e[2])).ptr, e[1].ptr))
    return out


def test_handoff_follows_the_current_stream_at_every_call(ll):
    torch, buf, calls = ll
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    w = torch.Tensor((T, K), torch.float32)
    for cur in (7, 8, 7):
        torch.cuda.set_stream(torch.cuda.Stream(cur))
        fake_torch.LOG.clear()
        (rx, rs), count, handle, ev, hook = buf.low_latency_dispatch(x, idx, N, E)
        # The buffer's stream after the current one, the current one after the buffer's.
        assert _handoffs(fake_torch.LOG) == [(cur, LL_STREAM), (LL_STREAM, cur)]
        # The scales are copied on the buffer's stream, and the caller's stream is current again.
        assert [e[1].ptr for e in fake_torch.LOG if e[0] == "set"] == [LL_STREAM, cur]
        assert torch.cuda.current_stream().ptr == cur
        assert ev.event is None and hook is None, "no event without async_finish, as DeepEP"
        fake_torch.LOG.clear()
        combined, ev, hook = buf.low_latency_combine(rx.view(torch.bfloat16), idx, w, handle)
        assert _handoffs(fake_torch.LOG) == [(cur, LL_STREAM), (LL_STREAM, cur)]
        assert ev.event is None and combined.shape == (T, H)


def test_async_finish_makes_an_event_that_keeps_the_inputs(ll):
    torch, buf, _ = ll
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    rx, count, handle, ev, hook = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False, async_finish=True)
    kept = [id(t) for t in ev.extra_tensors]
    assert ev.event is not None and id(x) in kept and id(rx) in kept
    # The caller's stream does not wait for the buffer's.
    assert all(e[1].ptr != 7 for e in fake_torch.LOG if e[0] == "wait")


def test_int32_topk_idx_is_not_cast(ll):
    torch, buf, calls = ll
    x = torch.Tensor((T, H), torch.bfloat16)
    idx32 = torch.Tensor((T, K), torch.int32)
    buf.low_latency_dispatch(x, idx32, N, E, use_fp8=False)
    assert calls[-1] == ("dispatch", idx32.data_ptr(), False)
    idx64 = torch.Tensor((T, K), torch.int64)
    buf.low_latency_dispatch(x, idx64, N, E, use_fp8=False)
    assert calls[-1][1] != idx64.data_ptr(), "an int64 topk_idx goes to the kernels as an i32 copy"


def test_bad_inputs_are_named_before_anything_is_queued(ll):
    torch, buf, calls = ll
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    rx, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    del calls[:]
    fake_torch.LOG.clear()
    with pytest.raises(TypeError, match="x must have dtype bfloat16, got float32"):
        buf.low_latency_dispatch(torch.Tensor((T, H), torch.float32), idx, N, E)
    with pytest.raises(TypeError, match="topk_idx must have dtype int64 or int32, got float32"):
        buf.low_latency_dispatch(x, torch.Tensor((T, K), torch.float32), N, E)
    with pytest.raises(ValueError, match=r"topk_idx has shape \[21, 4\]"):
        buf.low_latency_dispatch(x, torch.Tensor((T + 1, K), torch.int64), N, E)
    with pytest.raises(TypeError, match="use_fp8 must be a bool"):
        buf.low_latency_dispatch(x, idx, N, E, use_fp8=1)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be an int >= 1"):
        buf.low_latency_dispatch(x, idx, 0, E)
    with pytest.raises(TypeError, match="topk_weights must have dtype float32, got bfloat16"):
        buf.low_latency_combine(rx, idx, torch.Tensor((T, K), torch.bfloat16), handle)
    with pytest.raises(ValueError, match="out is on cuda:1"):
        buf.low_latency_combine(rx, idx, torch.Tensor((T, K), torch.float32), handle,
                                out=torch.Tensor((T, H), torch.bfloat16, torch.device("cuda", 1)))
    assert calls == [] and fake_torch.LOG == [], "nothing was queued"


def test_fast_tensor_check_falls_back_to_the_full_one():
    from ep_ibgda import _checks as chk

    good = FakeTensor((T, H))
    assert chk.tensor("x", good, ("bfloat16",), 2, 0, (T, None)) == (T, H)
    with pytest.raises(ValueError, match="x must be contiguous"):
        chk.tensor("x", FakeTensor((T, H), strides=(1, T)), ("bfloat16",), 2, 0)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        chk.tensor("x", FakeTensor((T, H), device="cpu"), ("bfloat16",), 2, 0)
    with pytest.raises(ValueError, match="x is on cuda:1, this buffer uses cuda:0"):
        chk.tensor("x", FakeTensor((T, H), index=1), ("bfloat16",), 2, 0)
    with pytest.raises(ValueError, match=r"dimension 1 is 256, expected 8"):
        chk.tensor("x", good, ("bfloat16",), 2, 0, (T, 8))
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        chk.tensor("x", good, ("bfloat16",), 3, 0)
    with pytest.raises(TypeError, match="x must be a torch tensor, got list"):
        chk.tensor("x", [1, 2], ("bfloat16",), 2, 0)


def test_combine_reuses_the_dispatch_cast_only_on_its_stream(ll):
    torch, buf, calls = ll
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    w = torch.Tensor((T, K), torch.float32)
    rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    cast = calls[-1][1]
    buf.low_latency_combine(rx, idx, w, handle)
    assert calls[-1] == ("combine", cast), "the same int64 topk_idx on the same stream: no second cast"
    buf.low_latency_combine(rx, torch.Tensor((T, K), torch.int64), w, handle)
    assert calls[-1][1] != cast, "another tensor is cast"
    torch.cuda.set_stream(torch.cuda.Stream(8))
    buf.low_latency_combine(rx, idx, w, handle)
    assert calls[-1][1] != cast, "on another stream the cast is made again (its memory is the first stream's)"
