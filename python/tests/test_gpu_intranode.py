"""Intranode (normal-mode) dispatch/combine through ``ep_ibgda.Buffer`` against a reference
computed in torch on fresh random data; ranks are processes (torch.multiprocessing + gloo),
one per GPU or sharing the GPUs there are. Skipped, loudly, without torch or a GPU.

Covers: get_dispatch_layout; dispatch BF16 and FP8 (with scales) with top-k; dispatch without
top-k; cached dispatch; num_worst_tokens; async_finish / previous_event chains; combine with
weights and with two biases; argument errors on real tensors; get_local_buffer_tensor of the
window; destroy."""

import pytest

from gpu_ranks import expected_rows, gather, need_gpu, normal_routing, run_ranks, seed, world_sizes

H = 256
K = 4


def _body(rank, world, base_seed):
    import torch
    import torch.distributed as dist

    import ep_ibgda as deep_ep

    gen = torch.Generator().manual_seed(base_seed * 131 + rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = 4 * world
    local = experts // world
    tokens = 48 + 8 * rank  # ranks send different counts
    idx_cpu, w_cpu = normal_routing(torch, tokens, experts, K, gen)
    x_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)

    buf = deep_ep.Buffer(dist.group.WORLD, int(64e6), 0, explicitly_destroy=True)
    assert (buf.rank, buf.group_size) == (rank, world)
    topk_idx = idx_cpu.to(dev)
    topk_weights = w_cpu.to(dev)
    x = x_cpu.to(dev)

    # Bad arguments on real tensors: named, and no rank has launched anything.
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        buf.dispatch(x_cpu, num_tokens_per_rank=torch.zeros(world, dtype=torch.int32, device=dev))
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        buf.get_dispatch_layout(topk_idx.float(), experts)
    with pytest.raises(ValueError, match="x must be contiguous"):
        buf.dispatch(x.t(), is_token_in_rank=None)

    # Layout.
    ntpr, ntprr, ntpe, in_rank, ev = buf.get_dispatch_layout(topk_idx, experts)
    assert ntprr is None and isinstance(ev, deep_ep.EventOverlap)
    valid = idx_cpu >= 0
    ref_in_rank = torch.stack([((idx_cpu // local == r) & valid).any(dim=1) for r in range(world)], dim=1)
    assert torch.equal(in_rank.cpu(), ref_in_rank)
    assert torch.equal(ntpr.cpu(), ref_in_rank.sum(0).to(torch.int32))
    assert torch.equal(ntpe.cpu(), torch.bincount(idx_cpu[valid], minlength=experts).to(torch.int32))
    assert ntpr.dtype == torch.int32 and ntpe.dtype == torch.int32 and in_rank.dtype == torch.bool

    all_x, all_idx, all_w = [list(z) for z in zip(*gather((x_cpu, idx_cpu, w_cpu)))]
    rows = expected_rows(all_idx, rank, local)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)

    # BF16 dispatch with top-k.
    recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, config=deep_ep.Buffer.get_dispatch_config(world), **layout
    )
    ref_x = torch.stack([all_x[s][t] for s, t in rows]) if rows else torch.empty(0, H, dtype=torch.bfloat16)
    assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (len(rows), H)
    assert torch.equal(recv_x.cpu(), ref_x), "dispatched rows differ"
    src_idx = torch.stack([all_idx[s][t] for s, t in rows]) if rows else torch.empty(0, K, dtype=torch.int64)
    src_w = torch.stack([all_w[s][t] for s, t in rows]) if rows else torch.empty(0, K)
    mine = (src_idx >= 0) & (src_idx // local == rank)
    ref_idx = torch.where(mine, src_idx - rank * local, torch.full_like(src_idx, -1))
    assert recv_idx.dtype == torch.int64 and torch.equal(recv_idx.cpu(), ref_idx)
    assert torch.equal(recv_w.cpu(), torch.where(mine, src_w, torch.zeros_like(src_w)))
    assert counts == [int((ref_idx == l).any(dim=1).sum()) for l in range(local)], counts

    # get_local_buffer_tensor: views of this rank's window (built by the dispatch above); read
    # only here, since peers use it during every operation.
    nvl = buf.get_local_buffer_tensor(torch.bfloat16)
    assert nvl.dtype == torch.bfloat16 and nvl.dim() == 1 and nvl.device == dev and nvl.numel() > 0
    part = buf.get_local_buffer_tensor(torch.uint8, size=(2, 16), offset=64)
    assert part.shape == (2, 16) and part.data_ptr() == nvl.data_ptr() + 64
    with pytest.raises(ValueError, match="needs .* bytes from offset"):
        buf.get_local_buffer_tensor(torch.int8, size=(2 * nvl.numel() + 1,))
    with pytest.raises(RuntimeError, match="RDMA .* built at the first low_latency_dispatch"):
        buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    del nvl, part

    # Combine of the received rows: each token comes back once per rank it went to.
    n_copies = ref_in_rank.sum(1).float()
    combined, combined_w, ev = buf.combine(recv_x, handle, topk_weights=recv_w)
    ref = (x_cpu.float() * n_copies[:, None]).to(torch.bfloat16)
    torch.testing.assert_close(combined.cpu(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(combined_w.cpu(), torch.where(valid, w_cpu, torch.zeros_like(w_cpu)))

    # Combine with two biases, asynchronously after an event.
    b0 = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    b1 = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    before = deep_ep.Buffer.capture()
    combined, none_w, ev = buf.combine(recv_x, handle, bias=(b0.to(dev), b1.to(dev)), previous_event=before,
                                       async_finish=True)
    ev.current_stream_wait()
    assert none_w is None
    ref = (x_cpu.float() * n_copies[:, None] + b0.float() + b1.float()).to(torch.bfloat16)
    torch.testing.assert_close(combined.cpu(), ref, rtol=2e-2, atol=2e-2)

    # Cached dispatch of other rows along the same routes.
    x2_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    all_x2 = gather(x2_cpu)
    out = buf.dispatch(x2_cpu.to(dev), handle=handle)
    assert out[1:5] == (None, None, None, None)
    ref_x2 = torch.stack([all_x2[s][t] for s, t in rows]) if rows else torch.empty(0, H, dtype=torch.bfloat16)
    assert torch.equal(out[0].cpu(), ref_x2), "cached dispatch rows differ"
    del out, handle

    # FP8 with scales, asynchronously.
    x8_cpu = (torch.randn(tokens, H, generator=gen) * 4).to(torch.float8_e4m3fn)
    s_cpu = torch.rand(tokens, H // 128, generator=gen)
    all_x8 = gather((x8_cpu.view(torch.uint8), s_cpu))
    (rx8, rs), r_idx, r_w, counts8, h8, ev = buf.dispatch(
        (x8_cpu.to(dev), s_cpu.to(dev)), topk_idx=topk_idx, topk_weights=topk_weights, async_finish=True, **layout
    )
    ev.current_stream_wait()
    assert rx8.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    if rows:
        assert torch.equal(rx8.view(torch.uint8).cpu(), torch.stack([all_x8[s][0][t] for s, t in rows]))
        assert torch.equal(rs.cpu(), torch.stack([all_x8[s][1][t] for s, t in rows]))
    assert counts8 == counts
    del h8

    # num_worst_tokens: a fixed row count, no host wait, an empty per-expert list.
    worst = sum(gather(tokens))
    rx, ri, rw, counts_w, hw, ev = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst, **layout
    )
    assert counts_w == [] and rx.shape == (worst, H) and ri.shape == (worst, K)
    assert torch.equal(rx[: len(rows)].cpu(), ref_x)
    assert bool((ri[len(rows):] == -1).all())
    combined, _, ev = buf.combine(rx, hw)
    torch.testing.assert_close(combined.cpu(), (x_cpu.float() * n_copies[:, None]).to(torch.bfloat16),
                               rtol=1e-2, atol=1e-2)
    del hw

    # Without top-k: rows only.
    rx, ri, rw, counts_n, hn, ev = buf.dispatch(x, **layout)
    assert ri is None and rw is None
    assert torch.equal(rx.cpu(), ref_x)
    del hn

    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", world_sizes())
def test_intranode_dispatch_combine(world):
    need_gpu()
    run_ranks(_body, world, seed())
