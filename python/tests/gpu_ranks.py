"""Runs a test body as ranks in processes (``torch.multiprocessing``, spawn) joined by a
``torch.distributed`` gloo group, one GPU per rank or sharing the GPUs there are; and the checks
that tell, loudly, why a GPU test was skipped."""

import datetime
import os
import socket
import sys
import time

import pytest


def need_gpu():
    """Skips the calling test (and says so on stderr) without torch or a CUDA GPU."""
    try:
        import torch
    except ImportError:
        reason = "torch is not installed"
    else:
        reason = None if torch.cuda.is_available() else "no CUDA GPU visible"
    if reason is not None:
        # On the GPU machine (the bundle's run.sh sets this) a skip would be a test that ran no
        # case: fail instead.
        if os.environ.get("EP_IBGDA_REQUIRE_GPU") == "1":
            pytest.fail(f"EP_IBGDA_REQUIRE_GPU=1 but the test cannot run: {reason}")
        sys.stderr.write(f"SKIPPED (needs torch and a CUDA GPU: {reason})\n")
        pytest.skip(f"needs torch and a CUDA GPU: {reason}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, body, world, port, args):
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % gpus)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        t0 = time.time()
        body(rank, world, *args)
        torch.cuda.current_stream().synchronize()
        sys.stderr.write(
            f"[rank {rank}/{world} on cuda:{rank % gpus} of {gpus}] {body.__name__} passed in "
            f"{time.time() - t0:.1f} s\n"
        )
    finally:
        dist.destroy_process_group()


def run_ranks(body, world, *args, timeout=None):
    """Runs ``body(rank, world, *args)`` in ``world`` processes; fails on the first rank that
    raises (with its traceback) or when ``timeout`` seconds (``EP_IBGDA_TEST_TIMEOUT_S``, 200)
    pass (the ranks are killed)."""
    import torch
    import torch.multiprocessing as mp

    # Under the device machine's 10-minute command limit, so a stuck case reports itself.
    timeout = timeout or int(os.environ.get("EP_IBGDA_TEST_TIMEOUT_S", "200"))
    gpus = torch.cuda.device_count()
    sys.stderr.write(f"{body.__name__}: {world} ranks on {min(world, gpus)} of {gpus} GPUs\n")
    ctx = mp.start_processes(
        _entry, args=(body, world, _free_port(), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.time() + timeout
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{body.__name__}: {world} ranks still running after {timeout} s (killed)")


def seed():
    """The random seed: ``EP_TEST_SEED`` if set, else fresh; printed so a failure replays."""
    s = int(os.environ.get("EP_TEST_SEED", str(int(time.time() * 1000) % (1 << 31))))
    sys.stderr.write(f"seed {s} (replay with EP_TEST_SEED={s})\n")
    return s


def world_sizes():
    """Rank counts to test: ``EP_IBGDA_TEST_RANKS`` (comma-separated, each 2..8) or 2 and 4.

    A value that names no count, or a count out of range, is an error at collection (a test
    that would run no case must fail, not pass quietly)."""
    raw = os.environ.get("EP_IBGDA_TEST_RANKS", "2,4")
    try:
        sizes = [int(w) for w in raw.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"EP_IBGDA_TEST_RANKS={raw!r}: expected comma-separated rank counts, e.g. 2,4") from None
    if not sizes or any(not 2 <= w <= 8 for w in sizes):
        raise ValueError(f"EP_IBGDA_TEST_RANKS={raw!r}: expected one or more rank counts in 2..8")
    return sizes


def gather(obj):
    """Every rank's ``obj`` (CPU tensors, lists), by rank, over the default group."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def low_latency_rank(rank, world, base_seed, salt, tokens, k):
    """What a low-latency test's rank starts from: its generator (``base_seed * salt + rank``),
    its device, 4 experts per rank, and random routing of ``tokens`` tokens to ``k`` distinct
    experts with weights (CPU tensors). Returns ``(gen, dev, experts, local, idx, w)``."""
    import torch

    gen = torch.Generator().manual_seed(base_seed * salt + rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = 4 * world
    local = experts // world
    idx = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
    w = torch.rand(tokens, k, generator=gen)
    return gen, dev, experts, local, idx, w


def low_latency_buffer(n, hidden, world, experts, **options):
    """An ``ep_ibgda.Buffer`` in low-latency mode over the default group, sized by the RDMA size
    hint, with one QP per local expert and explicit destruction; ``options`` go to the buffer."""
    import torch.distributed as dist

    import ep_ibgda as deep_ep

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(n, hidden, world, experts)
    return deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=experts // world,
                          explicitly_destroy=True, **options)


def normal_routing(torch, tokens, experts, k, gen):
    """Normal-mode routing: random top-``k`` ids, distinct per token, about 10% of entries -1 and
    token 0 sent nowhere, with random weights (CPU tensors). Returns ``(idx, w)``."""
    idx = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
    drop = torch.rand(tokens, k, generator=gen) < 0.1
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    idx[0] = -1
    w = torch.rand(tokens, k, generator=gen)
    return idx, w


def expected_rows(all_idx, rank, local):
    """(src, token) of every row normal-mode rank ``rank`` receives (``local`` experts a rank):
    by source rank, then token."""
    rows = []
    for src, idx in enumerate(all_idx):
        on = ((idx >= 0) & (idx // local == rank)).any(dim=1)
        rows += [(src, t) for t in range(idx.shape[0]) if bool(on[t])]
    return rows
