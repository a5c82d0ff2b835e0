"""Low-latency dispatch + combine captured from Python into a ``torch.cuda.CUDAGraph`` and
replayed with fresh inputs, against a torch reference (what ``bench/host_overhead.py`` times);
ranks are processes (torch.multiprocessing + gloo), one per GPU or sharing the GPUs there are.
Skipped, loudly, without torch or a GPU.

Two dispatch + combine pairs are captured (an even count, so the buffer's double-buffered
halves alternate across replays as they did at capture); before each replay new tokens are
written into the captured input, and after it the outputs the capture returned hold the
counts, rows and combined sums of those tokens."""

import pytest

from gpu_ranks import gather, low_latency_buffer, low_latency_rank, need_gpu, run_ranks, seed, world_sizes

N = 32  # num_max_dispatch_tokens_per_rank
H = 1024
K = 4
REPLAYS = 3


def _body(rank, world, base_seed):
    import torch
    import torch.distributed as dist

    tokens = 10 + 2 * rank
    gen, dev, experts, local, idx_cpu, w_cpu = low_latency_rank(rank, world, base_seed, 15485863, tokens, K)
    idx_cpu[0, 1:] = -1
    all_idx = gather(idx_cpu)
    counts = torch.tensor(
        [sum(int((all_idx[s] == rank * local + l).any(dim=1).sum()) for s in range(world)) for l in range(local)],
        dtype=torch.int32,
    )

    buf = low_latency_buffer(N, H, world, experts)
    x = torch.zeros(tokens, H, dtype=torch.bfloat16, device=dev)
    topk_idx, topk_weights = idx_cpu.to(dev), w_cpu.to(dev)

    # One eager pair builds the native buffer (a collective) outside the capture.
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, N, experts, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    del recv_x, recv_count, handle, combined
    torch.cuda.synchronize()
    dist.barrier()

    g = torch.cuda.CUDAGraph()
    outs = []
    # Thread-local, as the Rust core captures: CUDA calls of other threads of the process
    # (gloo's, the driver's) must not invalidate the capture.
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(2):
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, N, experts, use_fp8=False)
            combined, _, _ = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
            outs.append((recv_x, recv_count, combined))
            del handle
    dist.barrier()

    valid = (idx_cpu >= 0).float()
    for i in range(REPLAYS):
        x_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        x.copy_(x_cpu.to(dev))
        g.replay()
        torch.cuda.synchronize()
        all_x = gather(x_cpu)
        ref = (x_cpu.float() * (w_cpu * valid).sum(1, keepdim=True)).to(torch.bfloat16)
        for j, (rx, rc, comb) in enumerate(outs):
            assert torch.equal(rc.cpu(), counts), f"replay {i} pair {j}: counts"
            got = rx.cpu()
            for l in range(local):
                e = rank * local + l
                rows = [all_x[s][t] for s in range(world) for t in range(all_idx[s].shape[0])
                        if bool((all_idx[s][t] == e).any())]
                if rows:
                    assert torch.equal(got[l, : len(rows)], torch.stack(rows)), f"replay {i} pair {j} expert {l}"
            torch.testing.assert_close(comb.cpu(), ref, rtol=2e-2, atol=2e-2)
        dist.barrier()

    del g, outs
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", world_sizes())
def test_low_latency_cuda_graph_from_python(world):
    need_gpu()
    run_ranks(_body, world, seed())
