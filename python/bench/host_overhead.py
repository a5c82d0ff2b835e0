"""Host time the Python layer adds over the Rust core, and CUDA-graph replay of low-latency
dispatch/combine from Python.

Ranks are processes (``torch.multiprocessing`` + a gloo group), one per GPU or sharing the GPUs
there are. Each rank measures, for every operation, the wall time of the Python call
(``time.perf_counter_ns`` around it, no synchronisation) and the host time spent inside the
Rust core during it (the native buffer's ``core_ns`` counter, ``Instant`` around each ``ep``
call): the difference is what the Python layer adds (argument checks, the stream hand-off, the
torch allocations and copies of the outputs). Issue 20's target is at most 10 µs per operation.
Operations: low-latency dispatch (BF16, FP8) and combine, intranode dispatch (host-synchronous,
and with ``num_worst_tokens``: no host wait) and combine.

Then low-latency dispatch (BF16, FP8) and dispatch + combine are each captured ``--graph-ops``
times into one ``torch.cuda.CUDAGraph`` and replayed ``--replays`` times between two events;
time per operation = elapsed ÷ operations (combine = pair − dispatch), as the Rust benchmark
(``bench_low_latency``) times its own graphs. With ``--rust-json`` (records of
``bench_low_latency --procs --json``) each graph record carries the Rust figure of the same
operation, ranks and GPU count (``rust_us``) and the ratio.

Ranks that share one GPU as processes time-slice it (no MPS): every handshake then costs
milliseconds, so graph figures at more ranks than GPUs are not NVLink figures; the host
overhead does not depend on it.

Rank 0 also writes a cProfile of 20 low-latency dispatch + combine pairs
(``--profile PREFIX``, ``PREFIX_<R>ranks.txt``) and of 20 intranode layout + dispatch + combine
rounds (``PREFIX_<R>ranks_normal.txt``): where the Python layer's time goes, per torch call
(sorted by own time; torch's C methods appear as ``{method 'copy_' ...}`` rows).

Writes a JSON array of records (each with ``ranks`` and ``gpus``)::

    python3 host_overhead.py [--ranks 2,4] [--json PATH] [--iters N] [--rust-json PATH]

On the device machine: ``bash bundle/python/run.sh --bench`` (JSON under ``$OUT``).
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

# DeepEP's low-latency benchmark sizes (the Rust benchmark's defaults).
LL_TOKENS, LL_HIDDEN, LL_TOPK, LL_EXPERTS = 128, 7168, 8, 288
# Intranode: sizes whose host cost is the layer's, not the copies'.
NT_TOKENS, NT_HIDDEN, NT_TOPK, NT_EXPERTS_PER_RANK = 1024, 7168, 8, 8
# Operations queued between two synchronisations of the timed loops (the host never runs far
# ahead of the GPU, and every rank stays within one window of the others).
SYNC_EVERY = 10
# Untimed rounds first: one window of SYNC_EVERY, so torch's caching allocator holds a window's
# worth of output blocks before any call is timed (no cudaMalloc in the timed calls).
WARMUP = SYNC_EVERY
TARGET_US = 10.0


def _percentile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def _timed(samples, native, call):
    """Runs ``call()``, appending (python ns, core ns) to ``samples``; returns its result."""
    c0 = native.core_ns
    t0 = time.perf_counter_ns()
    r = call()
    t1 = time.perf_counter_ns()
    samples.append((t1 - t0, native.core_ns - c0))
    return r


def _summary(samples):
    py = [p / 1e3 for p, _ in samples]
    core = [c / 1e3 for _, c in samples]
    over = [(p - c) / 1e3 for p, c in samples]
    return {
        "py_us": round(statistics.median(py), 2),
        "core_us": round(statistics.median(core), 2),
        "overhead_us": round(statistics.median(over), 2),
        "overhead_p90_us": round(_percentile(over, 0.9), 2),
        "samples": len(samples),
    }


def _ll_host(torch, dist, deep_ep, rank, world, iters, gen, dev):
    experts, local = LL_EXPERTS, LL_EXPERTS // world
    x = torch.randn(LL_TOKENS, LL_HIDDEN, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.rand(LL_TOKENS, experts, generator=gen).topk(LL_TOPK, dim=1).indices.to(dev)
    w = torch.rand(LL_TOKENS, LL_TOPK, generator=gen).to(dev)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, LL_HIDDEN, world, experts)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=local,
                         explicitly_destroy=True)
    samples = {"dispatch_bf16": [], "dispatch_fp8": [], "combine_bf16": []}
    rows = None
    for i in range(iters + WARMUP):
        rec = i >= WARMUP
        # FP8 first, so the combine follows the dispatch whose handle it takes.
        for fp8 in (True, False):
            key = "dispatch_fp8" if fp8 else "dispatch_bf16"
            s = samples[key] if rec else []
            out = _timed(s, buf._ll if buf._ll is not None else _Zero(),
                         lambda: buf.low_latency_dispatch(x, idx, LL_TOKENS, experts, use_fp8=fp8))
            if not fp8:
                recv_x, recv_count, handle = out[0], out[1], out[2]
            del out
        if rows is None:
            rows = int(recv_count.sum())
        s = samples["combine_bf16"] if rec else []
        _timed(s, buf._ll, lambda: buf.low_latency_combine(recv_x, idx, w, handle))
        del recv_x, recv_count, handle
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return buf, (x, idx, w), samples, rows


def _profile_ll(torch, buf, inputs, iters, path):
    """Where the Python layer's host time goes: cProfile over ``iters`` BF16 dispatch + combine
    pairs (every rank runs them; the caller passes ``path`` on rank 0 only)."""
    import cProfile

    x, idx, w = inputs
    prof = cProfile.Profile() if path else None
    for i in range(iters):
        if prof:
            prof.enable()
        r = buf.low_latency_dispatch(x, idx, LL_TOKENS, LL_EXPERTS, use_fp8=False)
        c = buf.low_latency_combine(r[0], idx, w, r[2])
        if prof:
            prof.disable()
        del r, c
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    _write_profile(prof, path, f"{iters} low_latency_dispatch (BF16) + low_latency_combine pairs on rank 0")


def _write_profile(prof, path, what):
    """Writes ``prof``'s 30 costliest functions by own time to ``path`` under a header naming
    ``what`` was profiled (nothing when profiling is off)."""
    import io
    import pstats

    if not prof:
        return
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with open(path, "w") as f:
        f.write(f"cProfile of {what} (cProfile's own cost inflates every figure; read the proportions)\n")
        f.write(text.getvalue())


def _profile_normal(torch, buf, inputs, experts, iters, path):
    """As ``_profile_ll``, over ``iters`` rounds of intranode ``get_dispatch_layout``, dispatch
    (host-synchronous) and combine (every rank runs them; ``path`` on rank 0 only)."""
    import cProfile

    x, idx, w = inputs
    prof = cProfile.Profile() if path else None
    for i in range(iters):
        if prof:
            prof.enable()
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        rx, ri, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntpr,
                                                 is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
        c = buf.combine(rx, handle, topk_weights=rw)
        if prof:
            prof.disable()
        del rx, ri, rw, handle, c
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    _write_profile(prof, path, f"{iters} get_dispatch_layout + dispatch (host-synchronous) + combine rounds "
                   "(intranode) on rank 0")


class _Zero:
    """Stands in for the native buffer before the first call builds it (its time is set-up)."""

    core_ns = 0


def _ll_graphs(torch, dist, deep_ep, buf, inputs, ops, replays):
    """Per graph: µs per operation on this rank, or the error that stopped its capture."""
    x, idx, w = inputs
    experts = LL_EXPERTS

    def dispatch_only(fp8):
        def run():
            for _ in range(ops):
                r = buf.low_latency_dispatch(x, idx, LL_TOKENS, experts, use_fp8=fp8)
                del r
        return run

    def pair():
        for _ in range(ops):
            r = buf.low_latency_dispatch(x, idx, LL_TOKENS, experts, use_fp8=False)
            c = buf.low_latency_combine(r[0], idx, w, r[2])
            del r, c

    out = {}
    for name, body in (("dispatch_bf16", dispatch_only(False)), ("dispatch_fp8", dispatch_only(True)),
                       ("pair_bf16", pair)):
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        err = None
        try:
            # Thread-local, as the Rust core captures: CUDA calls of other threads of the process
            # (gloo's, the driver's) must not invalidate the capture.
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                body()
        except Exception as e:  # reported in the record; every rank then skips the replays
            err = f"{type(e).__name__}: {e}"
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        if any(errs):
            # The ranks' buffers may now be out of step (a capture advances the host's halves):
            # no further graph on this buffer.
            first = next(e for e in errs if e)
            for rest in ("dispatch_bf16", "dispatch_fp8", "pair_bf16"):
                out.setdefault(rest, {"error": first})
            break
        g.replay()  # warm-up
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        out[name] = {"us": start.elapsed_time(end) * 1e3 / (replays * ops)}
        del g
    return out


def _intranode_host(torch, dist, deep_ep, rank, world, iters, gen, dev):
    experts = NT_EXPERTS_PER_RANK * world
    x = torch.randn(NT_TOKENS, NT_HIDDEN, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.rand(NT_TOKENS, experts, generator=gen).topk(NT_TOPK, dim=1).indices.to(dev)
    w = torch.rand(NT_TOKENS, NT_TOPK, generator=gen).to(dev)
    hidden_bytes = NT_HIDDEN * 2
    nvl = max(deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden_bytes, world),
              deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden_bytes, world))
    buf = deep_ep.Buffer(dist.group.WORLD, nvl, 0, explicitly_destroy=True)
    samples = {"dispatch": [], "dispatch_worst": [], "combine": [], "layout": []}
    worst = NT_TOKENS * world
    for i in range(iters + WARMUP):
        rec = i >= WARMUP
        pick = (lambda k: samples[k]) if rec else (lambda k: [])
        t0 = time.perf_counter_ns()
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        # core 0 by construction, not a broken counter: get_dispatch_layout makes no native call
        # (torch operations on the current stream), so all of its time shows as overhead.
        pick("layout").append((time.perf_counter_ns() - t0, 0))
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
        native = buf._intranode if buf._intranode is not None else _Zero()
        rx, ri, rw, _, handle, _ = _timed(pick("dispatch"), native, lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, **layout))
        _timed(pick("combine"), buf._intranode, lambda: buf.combine(rx, handle, topk_weights=rw))
        del rx, ri, rw, handle
        out = _timed(pick("dispatch_worst"), buf._intranode, lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst, **layout))
        del out
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return buf, (x, idx, w), experts, samples


def _rank(rank, world, port, iters, ops, replays, profile, results):
    import torch
    import torch.distributed as dist

    import ep_ibgda as deep_ep

    gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % gpus)
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    gen = torch.Generator().manual_seed(1234 + rank)
    mine = {}
    try:
        buf, inputs, ll, rows = _ll_host(torch, dist, deep_ep, rank, world, iters, gen, dev)
        mine["ll"] = {k: _summary(v) for k, v in ll.items()}
        mine["ll_rows"] = rows
        if profile:
            _profile_ll(torch, buf, inputs, 20, f"{profile}_{world}ranks.txt" if rank == 0 else None)
        mine["graph"] = _ll_graphs(torch, dist, deep_ep, buf, inputs, ops, replays)
        dist.barrier()
        buf.destroy()
        del buf, inputs
        nbuf, ninputs, nexperts, nt = _intranode_host(torch, dist, deep_ep, rank, world, iters, gen, dev)
        mine["intranode"] = {k: _summary(v) for k, v in nt.items()}
        if profile:
            _profile_normal(torch, nbuf, ninputs, nexperts, 20,
                            f"{profile}_{world}ranks_normal.txt" if rank == 0 else None)
        dist.barrier()
        nbuf.destroy()
        mine["device"] = torch.cuda.get_device_name(dev)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            results.put(everyone)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world, args):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    pc = mp.start_processes(_rank, args=(world, _free_port(), args.iters, args.graph_ops, args.replays, args.profile, q),
                            nprocs=world, join=False, start_method="spawn")
    deadline = time.time() + args.timeout
    result = None
    while not pc.join(timeout=2):
        # Drained while the ranks run, so rank 0 never blocks on a full pipe.
        if result is None and not q.empty():
            result = q.get()
        if time.time() > deadline:
            for p in pc.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world} ranks still running after {args.timeout} s (killed)")
    return result if result is not None else q.get()


def _rust_figure(rust, op, dtype, ranks, gpus):
    for r in rust:
        if (r.get("bench") == op and r.get("dtype") == dtype and r.get("ranks") == ranks
                and r.get("gpus", gpus) == gpus and r.get("nvlink", True) and r.get("mode") == "procs"):
            return r.get("us")
    return None


def _records(world, gpus, per_rank, args, rust):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    common = {"ranks": world, "gpus": gpus, "mode": "procs", "date": date,
              "machine": f"{gpus}x {per_rank[0]['device']}",
              # What ran: bundle/python/run.sh --bench starts this script with these arguments.
              "command": " ".join(["python3", os.path.basename(sys.argv[0])] + sys.argv[1:])}
    recs = []

    def host(op, dtype, key, section, sizes):
        rs = [p[section][key] for p in per_rank]
        over = [r["overhead_us"] for r in rs]
        rec = {"bench": "py_host_overhead", "op": op, "dtype": dtype, **common,
               "overhead_us": round(statistics.mean(over), 2), "overhead_us_max_rank": max(over),
               "overhead_p90_us_max_rank": max(r["overhead_p90_us"] for r in rs),
               "py_us": round(statistics.mean(r["py_us"] for r in rs), 2),
               "core_us": round(statistics.mean(r["core_us"] for r in rs), 2),
               "target_us": TARGET_US, "meets_target": max(over) <= TARGET_US,
               "samples_per_rank": rs[0]["samples"], **sizes,
               "timing": "perf_counter_ns around the Python call, less the growth of the native buffer's "
                         "core_ns (host time inside the ep core's calls); medians per rank, mean and max over "
                         "ranks; no synchronisation inside the timed calls"}
        recs.append(rec)

    ll_sizes = {"tokens": LL_TOKENS, "hidden": LL_HIDDEN, "topk": LL_TOPK, "experts": LL_EXPERTS}
    host("low_latency_dispatch", "bf16", "dispatch_bf16", "ll", ll_sizes)
    host("low_latency_dispatch", "fp8", "dispatch_fp8", "ll", ll_sizes)
    host("low_latency_combine", "bf16", "combine_bf16", "ll", ll_sizes)
    nt_sizes = {"tokens": NT_TOKENS, "hidden": NT_HIDDEN, "topk": NT_TOPK,
                "experts": NT_EXPERTS_PER_RANK * world}
    host("dispatch", "bf16", "dispatch", "intranode", {**nt_sizes, "host_sync": True})
    host("dispatch", "bf16", "dispatch_worst", "intranode", {**nt_sizes, "num_worst_tokens": NT_TOKENS * world})
    host("combine", "bf16", "combine", "intranode", nt_sizes)
    host("get_dispatch_layout", "-", "layout", "intranode", {**nt_sizes, "note": "torch ops only, no core call"})

    # Graph replay, mean over ranks; combine = pair - dispatch.
    def graph_us(name):
        vals = [p["graph"][name].get("us") for p in per_rank]
        errs = [p["graph"][name].get("error") for p in per_rank if "error" in p["graph"][name]]
        return (None, errs[0]) if errs else (statistics.mean(vals), None)

    rows = statistics.mean(p["ll_rows"] for p in per_rank)
    d16, e1 = graph_us("dispatch_bf16")
    d8, e2 = graph_us("dispatch_fp8")
    pair, e3 = graph_us("pair_bf16")
    comb = None if pair is None or d16 is None else pair - d16
    for op, dtype, us, err, bpe in (("ll_dispatch", "bf16", d16, e1, 2.0), ("ll_dispatch", "fp8", d8, e2, 1 + 4 / 128),
                                    ("ll_combine", "bf16", comb, e3 or e1, 2.0)):
        rec = {"bench": "py_ll_graph", "op": op, "dtype": dtype, **common, **ll_sizes,
               "timing": f"torch.cuda.CUDAGraph replay, {args.graph_ops} ops x {args.replays} replays, mean over ranks"
                         + ("; combine = (dispatch + combine) - dispatch" if op == "ll_combine" else ""),
               "rows_per_rank": rows}
        if us is None:
            rec["error"] = err
        else:
            rec["us"] = round(us, 1)
            rec["gbps"] = round(rows * LL_HIDDEN * bpe / (us * 1e3), 1)
            ref = _rust_figure(rust, op, dtype, world, gpus)
            if ref is not None:
                rec["rust_us"] = ref
                rec["vs_rust"] = round(us / ref, 3)
        recs.append(rec)
    return recs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default=os.environ.get("EP_IBGDA_BENCH_RANKS", "2"),
                   help="comma-separated rank counts (default 2; EP_IBGDA_BENCH_RANKS)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per operation and rank")
    p.add_argument("--graph-ops", type=int, default=4, help="operations per CUDA graph (even)")
    p.add_argument("--replays", type=int, default=5, help="timed replays of each graph")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "python_bench.json"))
    p.add_argument("--rust-json", action="append", default=[],
                   help="bench_low_latency --procs --json output to compare the graph figures with")
    p.add_argument("--profile", default=os.path.join(os.environ.get("OUT", "."), "python_bench_profile"),
                   help="path prefix of rank 0's cProfile of the low-latency calls ('' for none)")
    p.add_argument("--timeout", type=int, default=120, help="seconds per rank count before the ranks are killed")
    args = p.parse_args()
    if args.graph_ops < 2 or args.graph_ops % 2:
        p.error("--graph-ops must be even (the double-buffered halves alternate)")
    import torch

    gpus_visible = torch.cuda.device_count()
    if gpus_visible == 0:
        print("host_overhead: no CUDA GPU visible", file=sys.stderr)
        sys.exit(2)
    rust = []
    for path in args.rust_json:
        try:
            with open(path) as f:
                rust += json.load(f)
        except (OSError, ValueError) as e:
            print(f"host_overhead: no Rust figures from {path}: {e}", file=sys.stderr)
    records = []
    for world in [int(w) for w in args.ranks.split(",") if w.strip()]:
        t0 = time.time()
        per_rank = _run(world, args)
        gpus = min(world, gpus_visible)
        recs = _records(world, gpus, per_rank, args, rust)
        records += recs
        print(f"== {world} ranks on {gpus} GPU(s), {time.time() - t0:.1f} s")
        for r in recs:
            if r["bench"] == "py_host_overhead":
                print(f"  host  {r['op']:<22} {r['dtype']:<5} python {r['py_us']:>9.1f} us  core {r['core_us']:>9.1f} us"
                      f"  overhead {r['overhead_us']:>6.1f} us (max rank {r['overhead_us_max_rank']:.1f}, "
                      f"target {TARGET_US:.0f}: {'met' if r['meets_target'] else 'NOT met'})")
            elif "us" in r:
                ref = f"  rust {r['rust_us']} us (x{r['vs_rust']})" if "rust_us" in r else ""
                print(f"  graph {r['op']:<22} {r['dtype']:<5} {r['us']:>9.1f} us  {r['gbps']:>7.1f} GB/s{ref}")
            else:
                print(f"  graph {r['op']:<22} {r['dtype']:<5} failed: {r['error']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in records) + "\n]\n")
    print(f"records: {args.json}")


if __name__ == "__main__":
    main()
