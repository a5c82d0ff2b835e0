"""Low-latency dispatch/combine through ``ep_ibgda.Buffer(low_latency_mode=True)`` against a
torch reference on fresh random data; ranks are processes (torch.multiprocessing + gloo), one
per GPU or sharing the GPUs there are. Skipped, loudly, without torch or a GPU.

Covers: BF16 and FP8 dispatch (scales checked by dequantising), UE8M0 scales' shape, the
per-expert counts and cumulative statistics, combine (plain, ``out=``, zero-copy), hook mode for
both, async_finish; get_local_buffer_tensor of the network buffer (views, bounds, zeroed and
cleaned as vLLM does)."""

import pytest

from gpu_ranks import gather, low_latency_buffer, low_latency_rank, need_gpu, run_ranks, seed, world_sizes

N = 32  # num_max_dispatch_tokens_per_rank
H = 512
K = 4


def _body(rank, world, base_seed):
    import torch
    import torch.distributed as dist

    tokens = 16 + 4 * rank
    gen, dev, experts, local, idx_cpu, w_cpu = low_latency_rank(rank, world, base_seed, 7919, tokens, K)
    idx_cpu[1, 1:] = -1
    x_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    all_x, all_idx = [list(z) for z in zip(*gather((x_cpu, idx_cpu)))]

    buf = low_latency_buffer(N, H, world, experts)
    x, topk_idx, topk_weights = x_cpu.to(dev), idx_cpu.to(dev), w_cpu.to(dev)

    # Expected rows of each local expert: by source rank, then token.
    expect = []
    for l in range(local):
        e = rank * local + l
        expect.append([(s, t) for s in range(world) for t in range(all_idx[s].shape[0])
                       if bool((all_idx[s][t] == e).any())])
    counts = torch.tensor([len(r) for r in expect], dtype=torch.int32)

    def check_bf16(recv_x, recv_count):
        assert recv_x.shape == (local, world * N, H) and recv_x.dtype == torch.bfloat16
        assert torch.equal(recv_count.cpu(), counts)
        got = recv_x.cpu()
        for l, rows in enumerate(expect):
            if rows:
                assert torch.equal(got[l, : len(rows)], torch.stack([all_x[s][t] for s, t in rows])), f"expert {l}"

    def combine_ref(expert_out):
        # Σ_k w_k × (expert k's output for this token); the experts here return their input.
        mask = (idx_cpu >= 0).float()
        return (x_cpu.float() * (w_cpu * mask).sum(1, keepdim=True)).to(torch.bfloat16)

    stats = torch.zeros(local, dtype=torch.int32, device=dev)

    # BF16, receiving in the kernel.
    recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
        x, topk_idx, N, experts, cumulative_local_expert_recv_stats=stats, use_fp8=False)
    assert hook is None  # as DeepEP: a hook only with return_recv_hook
    check_bf16(recv_x, recv_count)
    assert torch.equal(stats.cpu(), counts)
    combined, ev, hook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    torch.testing.assert_close(combined.cpu(), combine_ref(recv_x), rtol=2e-2, atol=2e-2)
    del handle

    # get_local_buffer_tensor: views of this rank's network buffer (built by the dispatch
    # above). Zeroing it all, as vLLM does, then a collective clean, leaves the group working
    # (the hook-mode checks below run after it).
    with pytest.raises(RuntimeError, match="NVLink .* built at the first dispatch"):
        buf.get_local_buffer_tensor(torch.int8)
    raw = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    total = raw.numel()
    assert raw.dtype == torch.int8 and raw.dim() == 1 and raw.device == dev and total >= 1024
    off = (total - 256) // 16 * 16
    words = buf.get_local_buffer_tensor(torch.int32, size=torch.Size([4, 8]), offset=off, use_rdma_buffer=True)
    assert words.shape == (4, 8) and words.dtype == torch.int32
    assert words.data_ptr() == raw.data_ptr() + off
    words.copy_(torch.arange(32, dtype=torch.int32, device=dev).view(4, 8))
    tail = buf.get_local_buffer_tensor(torch.int32, offset=off, use_rdma_buffer=True)
    assert tail.shape == ((total - off) // 4,) and tail[:32].cpu().tolist() == list(range(32))
    with pytest.raises(ValueError, match="needs .* bytes from offset"):
        buf.get_local_buffer_tensor(torch.int8, size=(total + 1,), use_rdma_buffer=True)
    with pytest.raises(ValueError, match="past the end"):
        buf.get_local_buffer_tensor(torch.int8, offset=total + 16, use_rdma_buffer=True)
    buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    assert int(raw.abs().sum()) == 0
    del raw, words, tail
    buf.clean_low_latency_buffer(N, H, experts)

    # Hook mode for both, and combine into out=.
    recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
        x, topk_idx, N, experts, cumulative_local_expert_recv_stats=stats, use_fp8=False, return_recv_hook=True)
    hook()
    check_bf16(recv_x, recv_count)
    assert torch.equal(stats.cpu(), 2 * counts)
    out = torch.empty(tokens, H, dtype=torch.bfloat16, device=dev)
    combined, ev, hook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, return_recv_hook=True,
                                                 out=out)
    hook()
    assert combined is out
    torch.testing.assert_close(out.cpu(), combine_ref(recv_x), rtol=2e-2, atol=2e-2)
    del handle, hook

    # FP8 with f32 scales (asynchronously), then a zero-copy combine.
    (rx8, rs), recv_count, handle, ev, hook = buf.low_latency_dispatch(x, topk_idx, N, experts, async_finish=True)
    ev.current_stream_wait()
    assert rx8.dtype == torch.float8_e4m3fn and rs.shape == (local, world * N, H // 128)
    assert rs.dtype == torch.float32 and rs.stride(1) == 1, "scales are a column-major view, as DeepEP's"
    assert torch.equal(recv_count.cpu(), counts)
    deq = (rx8.float() * rs.repeat_interleave(128, dim=2)).cpu()
    for l, rows in enumerate(expect):
        if rows:
            ref = torch.stack([all_x[s][t] for s, t in rows]).float()
            torch.testing.assert_close(deq[l, : len(rows)], ref, rtol=0.07, atol=0.02)
    zc = buf.get_next_low_latency_combine_buffer(handle)
    assert zc.shape == (local, world * N, H) and zc.dtype == torch.bfloat16
    bf = torch.zeros(local, world * N, H, dtype=torch.bfloat16)
    for l, rows in enumerate(expect):
        if rows:
            bf[l, : len(rows)] = torch.stack([all_x[s][t] for s, t in rows])
    zc.copy_(bf.to(dev))
    combined, ev, hook = buf.low_latency_combine(zc, topk_idx, topk_weights, handle, zero_copy=True)
    torch.testing.assert_close(combined.cpu(), combine_ref(None), rtol=2e-2, atol=2e-2)
    del handle, zc

    # UE8M0 scales: packed int32, hidden / 512 words.
    (rx8, rs), recv_count, handle, ev, hook = buf.low_latency_dispatch(
        x, topk_idx, N, experts, round_scale=True, use_ue8m0=True)
    assert rs.dtype == torch.int32 and rs.shape == (local, world * N, H // 512)
    combined, ev, hook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    torch.testing.assert_close(combined.cpu(), combine_ref(recv_x), rtol=2e-2, atol=2e-2)
    del handle

    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", world_sizes())
def test_low_latency_dispatch_combine(world):
    need_gpu()
    run_ranks(_body, world, seed())
