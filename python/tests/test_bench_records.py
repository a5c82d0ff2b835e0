"""The benchmark's records (python/bench/host_overhead.py) from synthetic per-rank figures: every
record names its ranks and GPUs, the overhead is the Python time less the core's, and the graph
figures meet the Rust benchmark's records of the same operation. Needs neither torch nor a GPU."""

import importlib.util
import os
import types

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "host_overhead.py")


@pytest.fixture(scope="module")
def bench():
    if not os.path.exists(_PATH):
        pytest.skip("python/bench/host_overhead.py is not beside the tests (a bundle)")
    spec = importlib.util.spec_from_file_location("host_overhead", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rank(bench, py_ns, core_ns, graph):
    s = bench._summary([(py_ns, core_ns)] * 5)
    return {
        "device": "NVIDIA H200",
        "ll": {"dispatch_bf16": s, "dispatch_fp8": s, "combine_bf16": s},
        "ll_rows": 1024,
        "graph": graph,
        "intranode": {"dispatch": s, "dispatch_worst": s, "combine": s, "layout": s},
    }


def test_records(bench):
    args = types.SimpleNamespace(graph_ops=4, replays=5)
    graph = {"dispatch_bf16": {"us": 50.0}, "dispatch_fp8": {"us": 40.0}, "pair_bf16": {"us": 90.0}}
    per_rank = [_rank(bench, 30_000, 22_000, graph), _rank(bench, 40_000, 22_000, graph)]
    rust = [{"bench": "ll_dispatch", "dtype": "bf16", "ranks": 2, "gpus": 1, "mode": "procs", "nvlink": True,
             "us": 48.6}]
    recs = bench._records(2, 1, per_rank, args, rust)
    assert all(r["ranks"] == 2 and r["gpus"] == 1 for r in recs)
    host = {(r["op"], r["dtype"]): r for r in recs if r["bench"] == "py_host_overhead"}
    d = host[("low_latency_dispatch", "bf16")]
    assert d["overhead_us"] == 13.0 and d["overhead_us_max_rank"] == 18.0 and not d["meets_target"]
    g = {(r["op"], r["dtype"]): r for r in recs if r["bench"] == "py_ll_graph"}
    assert g[("ll_combine", "bf16")]["us"] == 40.0
    assert g[("ll_dispatch", "bf16")]["rust_us"] == 48.6 and "rust_us" not in g[("ll_dispatch", "fp8")]
    assert g[("ll_dispatch", "bf16")]["gbps"] == round(1024 * 7168 * 2 / 50e3, 1)


def test_failed_capture_is_recorded(bench):
    args = types.SimpleNamespace(graph_ops=4, replays=5)
    graph = {k: {"error": "RuntimeError: capture"} for k in ("dispatch_bf16", "dispatch_fp8", "pair_bf16")}
    recs = bench._records(2, 2, [_rank(bench, 1, 0, graph)] * 2, args, [])
    assert [r["error"] for r in recs if r["bench"] == "py_ll_graph"] == ["RuntimeError: capture"] * 3
