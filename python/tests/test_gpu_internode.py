"""Internode (normal-mode) dispatch/combine through ``ep_ibgda.Buffer`` against a reference
computed in torch on fresh random data. Ranks are processes (torch.multiprocessing + gloo)
sharing the GPUs there are; ``EP_IBGDA_RANKS_PER_NODE`` splits the one host into two virtual
nodes (2 ranks: 2 nodes x 1, 4 ranks: 2 x 2), so every inter-node byte goes through the NIC
(the emulated NIC here). Skipped, loudly, without torch or a GPU.

Covers: get_dispatch_layout with num_tokens_per_rdma_rank; dispatch BF16 with top-k and expert
alignment; FP8 with scales and its cached dispatch; cached BF16 dispatch; num_worst_tokens;
dispatch without top-k; async_finish / previous_event chains; combine with weights and with two
biases; the DeepEP-sized handle; a shape the buffer was not built for; get_local_buffer_tensor
of the NVLink hop's window; destroy."""

import os

import pytest

from gpu_ranks import expected_rows, gather, need_gpu, normal_routing, run_ranks, seed, world_sizes

H = 256
K = 4
ALIGN = 4


def _stack(torch, items, empty):
    return torch.stack(items) if items else empty


def _settled(buf):
    """Waits for the internode buffer's queued work and raises any error its kernels recorded.
    A failed kernel (a wait out of time, a NIC failure) leaves the later ones to run on what
    arrived, and combine makes no host wait that would report it: values are compared only
    after this, so such a failure reads as itself, not as sums missing whole copies."""
    buf._internode_native.synchronize()


def _body(rank, world, base_seed, ranks_per_node):
    import torch
    import torch.distributed as dist

    import ep_ibgda as deep_ep

    # Before the Buffer reads it: the one host as virtual nodes of `ranks_per_node` ranks.
    os.environ["EP_IBGDA_RANKS_PER_NODE"] = str(ranks_per_node)
    nodes = world // ranks_per_node
    gen = torch.Generator().manual_seed(base_seed * 173 + rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = 4 * world
    local = experts // world
    tokens = 40 + 8 * rank  # ranks send different counts
    idx_cpu, w_cpu = normal_routing(torch, tokens, experts, K, gen)
    x_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)

    buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), int(1e8), explicitly_destroy=True)
    assert (buf.rank, buf.group_size) == (rank, world)
    assert (buf._nodes, buf._ranks_per_node, buf._virtual_nodes) == (nodes, ranks_per_node, True)
    topk_idx = idx_cpu.to(dev)
    topk_weights = w_cpu.to(dev)
    x = x_cpu.to(dev)

    # Layout, with the tokens per node.
    ntpr, ntprr, ntpe, in_rank, ev = buf.get_dispatch_layout(topk_idx, experts)
    valid = idx_cpu >= 0
    ref_in_rank = torch.stack([((idx_cpu // local == r) & valid).any(dim=1) for r in range(world)], dim=1)
    assert torch.equal(in_rank.cpu(), ref_in_rank)
    assert torch.equal(ntpr.cpu(), ref_in_rank.sum(0).to(torch.int32))
    ref_in_node = ref_in_rank.view(tokens, nodes, ranks_per_node).any(dim=2)
    assert ntprr is not None and ntprr.dtype == torch.int32 and ntprr.shape == (nodes,)
    assert torch.equal(ntprr.cpu(), ref_in_node.sum(0).to(torch.int32))
    assert torch.equal(ntpe.cpu(), torch.bincount(idx_cpu[valid], minlength=experts).to(torch.int32))

    all_x, all_idx, all_w = [list(z) for z in zip(*gather((x_cpu, idx_cpu, w_cpu)))]
    rows = expected_rows(all_idx, rank, local)
    lay = dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=in_rank,
               num_tokens_per_expert=ntpe)

    # Bad arguments on real tensors: named, and no rank has launched anything.
    with pytest.raises(ValueError, match=r"num_tokens_per_rdma_rank has shape"):
        buf.dispatch(x, **dict(lay, num_tokens_per_rdma_rank=ntprr[:1].contiguous()), topk_idx=topk_idx,
                     topk_weights=topk_weights)

    # BF16 dispatch with top-k and an expert alignment.
    recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=ALIGN,
        config=deep_ep.Buffer.get_dispatch_config(world), **lay
    )
    _settled(buf)
    empty_x = torch.empty(0, H, dtype=torch.bfloat16)
    ref_x = _stack(torch, [all_x[s][t] for s, t in rows], empty_x)
    assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (len(rows), H)
    assert torch.equal(recv_x.cpu(), ref_x), "dispatched rows differ"
    src_idx = _stack(torch, [all_idx[s][t] for s, t in rows], torch.empty(0, K, dtype=torch.int64))
    src_w = _stack(torch, [all_w[s][t] for s, t in rows], torch.empty(0, K))
    mine = (src_idx >= 0) & (src_idx // local == rank)
    ref_idx = torch.where(mine, src_idx - rank * local, torch.full_like(src_idx, -1))
    assert recv_idx.dtype == torch.int64 and torch.equal(recv_idx.cpu(), ref_idx)
    assert torch.equal(recv_w.cpu(), torch.where(mine, src_w, torch.zeros_like(src_w)))
    raw_counts = [int((ref_idx == e).any(dim=1).sum()) for e in range(local)]
    assert counts == [(c + ALIGN - 1) // ALIGN * ALIGN for c in raw_counts], (counts, raw_counts)
    # The handle: opaque, a 10-tuple as DeepEP's internode one.
    assert isinstance(handle, tuple) and len(handle) == 10 and handle[0] is in_rank

    # The NVLink hop's window (built by the dispatch above); read only here.
    nvl = buf.get_local_buffer_tensor(torch.uint8)
    assert nvl.dim() == 1 and nvl.device == dev and nvl.numel() > 0
    del nvl
    assert isinstance(buf.get_comm_stream(), torch.cuda.Stream)

    # A hidden size the buffer was not built for: refused on every rank before any launch.
    with pytest.raises(ValueError, match=r"does not fit this Buffer.*num_rdma_bytes >= \d+"):
        buf.dispatch(torch.zeros(tokens, 2 * H, dtype=torch.bfloat16, device=dev), topk_idx=topk_idx,
                     topk_weights=topk_weights, **lay)

    # Combine of the received rows: each token comes back once per rank it went to.
    n_copies = ref_in_rank.sum(1).float()
    combined, combined_w, ev = buf.combine(recv_x, handle, topk_weights=recv_w)
    _settled(buf)
    ref = (x_cpu.float() * n_copies[:, None]).to(torch.bfloat16)
    torch.testing.assert_close(combined.cpu(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(combined_w.cpu(), torch.where(valid, w_cpu, torch.zeros_like(w_cpu)))

    # Combine with two biases, asynchronously after an event.
    b0 = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    b1 = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    before = deep_ep.Buffer.capture()
    combined, none_w, ev = buf.combine(recv_x, handle, bias=(b0.to(dev), b1.to(dev)), previous_event=before,
                                       async_finish=True, allocate_on_comm_stream=True)
    ev.current_stream_wait()
    _settled(buf)
    assert none_w is None
    ref = (x_cpu.float() * n_copies[:, None] + b0.float() + b1.float()).to(torch.bfloat16)
    torch.testing.assert_close(combined.cpu(), ref, rtol=3e-2, atol=3e-2)

    # Cached dispatch of other rows along the same routes.
    x2_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    all_x2 = gather(x2_cpu)
    out = buf.dispatch(x2_cpu.to(dev), handle=handle)
    _settled(buf)
    assert out[1:5] == (None, None, None, None)
    ref_x2 = _stack(torch, [all_x2[s][t] for s, t in rows], empty_x)
    assert torch.equal(out[0].cpu(), ref_x2), "cached dispatch rows differ"
    del out, handle

    # FP8 with scales, asynchronously; then a cached FP8 dispatch on its handle.
    x8_cpu = (torch.randn(tokens, H, generator=gen) * 4).to(torch.float8_e4m3fn)
    s_cpu = torch.rand(tokens, H // 128, generator=gen)
    all_x8 = gather((x8_cpu.view(torch.uint8), s_cpu))
    (rx8, rs), r_idx, r_w, counts8, h8, ev = buf.dispatch(
        (x8_cpu.to(dev), s_cpu.to(dev)), topk_idx=topk_idx, topk_weights=topk_weights, async_finish=True, **lay
    )
    ev.current_stream_wait()
    _settled(buf)
    assert rx8.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32 and rs.shape == (len(rows), H // 128)
    if rows:
        assert torch.equal(rx8.view(torch.uint8).cpu(), torch.stack([all_x8[s][0][t] for s, t in rows]))
        assert torch.equal(rs.cpu(), torch.stack([all_x8[s][1][t] for s, t in rows]))
    assert counts8 == raw_counts
    y8_cpu = (torch.randn(tokens, H, generator=gen) * 4).to(torch.float8_e4m3fn)
    t_cpu = torch.rand(tokens, H // 128, generator=gen)
    all_y8 = gather((y8_cpu.view(torch.uint8), t_cpu))
    prev = deep_ep.Buffer.capture()
    (ry8, rt), *nones, ev = buf.dispatch((y8_cpu.to(dev), t_cpu.to(dev)), handle=h8, previous_event=prev)
    _settled(buf)
    assert nones == [None, None, None, None]
    if rows:
        assert torch.equal(ry8.view(torch.uint8).cpu(), torch.stack([all_y8[s][0][t] for s, t in rows]))
        assert torch.equal(rt.cpu(), torch.stack([all_y8[s][1][t] for s, t in rows]))
    del h8

    # num_worst_tokens: a fixed row count, an empty per-expert list.
    worst = sum(gather(tokens))
    rx, ri, rw, counts_w, hw, ev = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst, **lay
    )
    _settled(buf)
    assert counts_w == [] and rx.shape == (worst, H) and ri.shape == (worst, K)
    assert torch.equal(rx[: len(rows)].cpu(), ref_x)
    assert bool((ri[len(rows):] == -1).all()) and bool((rw[len(rows):] == 0).all())
    combined, _, ev = buf.combine(rx, hw)
    _settled(buf)
    torch.testing.assert_close(combined.cpu(), (x_cpu.float() * n_copies[:, None]).to(torch.bfloat16),
                               rtol=2e-2, atol=2e-2)
    del hw

    # Without top-k: rows only (routed by is_token_in_rank).
    rx, ri, rw, counts_n, hn, ev = buf.dispatch(x, **lay)
    _settled(buf)
    assert ri is None and rw is None and counts_n == []
    assert torch.equal(rx.cpu(), ref_x)
    combined, _, ev = buf.combine(rx, hn)
    _settled(buf)
    torch.testing.assert_close(combined.cpu(), (x_cpu.float() * n_copies[:, None]).to(torch.bfloat16),
                               rtol=2e-2, atol=2e-2)
    del hn

    dist.barrier()
    buf.destroy()


def _ranks_per_node(world):
    """Two virtual nodes where the ranks split evenly, else nodes of one rank."""
    return world // 2 if world % 2 == 0 else 1


@pytest.mark.parametrize("world", world_sizes())
def test_internode_dispatch_combine(world):
    need_gpu()
    run_ranks(_body, world, seed(), _ranks_per_node(world))
