"""The package's API surface against DeepEP's legacy (V1) API (shared/reference/deepep-api.md):
names, signatures, defaults, static helpers and Config. Needs neither torch nor a GPU."""

import inspect
import sys

import pytest

import ep_ibgda
import ep_ibgda as deep_ep
from ep_ibgda import Buffer, Config


def _torch_missing():
    try:
        import torch  # noqa: F401

        return False
    except ImportError:
        return True


def test_module_exports():
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert name in deep_ep.__all__
    from ep_ibgda.utils import EventHandle, EventOverlap

    assert deep_ep.EventOverlap is EventOverlap
    assert EventHandle is deep_ep.EventHandle


def test_import_needs_no_torch():
    # The package is imported above; torch must not have been pulled in by it.
    if _torch_missing():
        assert "torch" not in sys.modules
        with pytest.raises(ImportError):
            deep_ep.topk_idx_t
    else:
        import torch

        assert deep_ep.topk_idx_t is torch.int64


def _params(f):
    return [(p.name, p.default) for p in inspect.signature(f).parameters.values() if p.name != "self"]


E = inspect.Parameter.empty

SIGNATURES = {
    "__init__": [("group", None), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "get_dispatch_layout": [("topk_idx", E), ("num_experts", E), ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": [("x", E), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", E), ("handle", E), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "low_latency_dispatch": [("x", E), ("topk_idx", E), ("num_max_dispatch_tokens_per_rank", E), ("num_experts", E),
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": [("x", E), ("topk_idx", E), ("topk_weights", E), ("handle", E), ("use_logfmt", False),
                            ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", E)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", E), ("hidden", E), ("num_experts", E)],
    "low_latency_update_mask_buffer": [("rank_to_mask", E), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", E)],
    "low_latency_clean_mask_buffer": [],
    "get_local_buffer_tensor": [("dtype", E), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_comm_stream": [],
    "destroy": [],
    "set_num_sms": [("new_num_sms", E)],
    "capture": [],
    "get_dispatch_config": [("num_ranks", E)],
    "get_combine_config": [("num_ranks", E)],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", E), ("hidden", E), ("num_ranks", E),
                                       ("num_experts", E)],
    "is_sm90_compiled": [],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_buffer_signature(name):
    assert _params(getattr(Buffer, name)) == SIGNATURES[name]


@pytest.mark.parametrize("name", ["set_num_sms", "capture", "get_dispatch_config", "get_combine_config",
                                  "get_low_latency_rdma_size_hint", "is_sm90_compiled"])
def test_static_methods(name):
    assert isinstance(inspect.getattr_static(Buffer, name), staticmethod)


def test_class_attribute_and_set_num_sms():
    assert Buffer.num_sms == 20
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24
        assert Buffer.get_dispatch_config(8).num_sms == 24
        with pytest.raises(ValueError, match="new_num_sms"):
            Buffer.set_num_sms(23)
    finally:
        Buffer.set_num_sms(20)


def test_config_defaults_and_fields():
    assert _params(Config.__init__) == [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                                        ("num_max_nvl_chunked_recv_tokens", 256),
                                        ("num_max_rdma_chunked_send_tokens", 6),
                                        ("num_max_rdma_chunked_recv_tokens", 256)]
    c = Config(24, 6, 256, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (24, 6, 256)
    # SGLang builds configs from JSON keyword arguments.
    c = Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 16, "num_max_nvl_chunked_recv_tokens": 512,
                  "num_max_rdma_chunked_send_tokens": 8, "num_max_rdma_chunked_recv_tokens": 32})
    assert c.num_max_rdma_chunked_recv_tokens == 32
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        Config(20, 256, 256)


DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
            24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 64: (32, 288, 8, 128), 96: (20, 480, 12, 128),
            128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
           24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 8, 128), 96: (1, 480, 8, 128),
           128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _aligned(t):
    # DeepEP's Config rounds the RDMA receive ring up to whole send chunks (128 -> 132 for 6).
    ns, nr, rs, rr = t
    return ns, nr, rs, (rr + rs - 1) // rs * rs


def _fields(c):
    return (c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


@pytest.mark.parametrize("ranks", sorted(DISPATCH))
def test_config_tables(ranks):
    assert _fields(Buffer.get_dispatch_config(ranks)) == _aligned(DISPATCH[ranks])
    assert _fields(Buffer.get_combine_config(ranks)) == _aligned(COMBINE[ranks])
    assert Buffer.get_dispatch_config(ranks).num_sms == Buffer.num_sms


def test_config_table_unknown_rank_count():
    with pytest.raises(ValueError, match="unsupported number of EP ranks: 3"):
        Buffer.get_dispatch_config(3)


def test_size_hints():
    c = Buffer.get_dispatch_config(8)
    # DeepEP's formula, spelled out for hidden 7168 BF16 on 8 ranks: 10 channels x 8 ranks x
    # 256 slots of (row + source meta + 128 topk ids + 128 weights + 128 scales), plus the
    # channel counters, rounded up to 128.
    slots = 10 * 8 * 256
    expect = 10 * 8 * 5 * 4 + slots * (7168 * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    expect = (expect + 127) // 128 * 128
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) == expect
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    # Low latency: 2 x (send + receive + signals), the send side the larger of dispatch (N
    # messages) and combine (E x N messages).
    n, h, r, e = 128, 7168, 8, 256
    disp = 16 + max(h * 2, h + h // 128 * 4)
    comb = h // 128 * 4 + h * 2
    total = 2 * (max(n * disp, e * n * comb) + e * n * max(disp, comb) + (e * 4 + 127) // 128 * 128)
    assert Buffer.get_low_latency_rdma_size_hint(n, h, r, e) == (total + 128) // 128 * 128


def test_native_module():
    assert ep_ibgda._ep.FP8_BLOCK == 128
    assert isinstance(ep_ibgda._ep.cuda_driver_present(), bool)
    # More tokens per rank never needs fewer bytes.
    a = ep_ibgda._ep.intranode_bytes(8, 128, 7168, 8, 256, 4)
    b = ep_ibgda._ep.intranode_bytes(8, 256, 7168, 8, 256, 4)
    assert 0 < a < b
    assert ep_ibgda._ep.low_latency_bytes(8, 128, 7168, 8, 256) > 0


def test_is_sm90_compiled():
    assert Buffer.is_sm90_compiled() is True


def test_device_view_is_importable_by_the_array_interface():
    # Built on the native side only; its class and the interface's keys are checked here.
    cls = ep_ibgda._ep.DeviceView
    assert "__cuda_array_interface__" in dir(cls)
    with pytest.raises(TypeError):
        cls()  # not constructible from Python: views come from the buffers
