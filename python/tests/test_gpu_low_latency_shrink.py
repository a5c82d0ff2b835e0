"""``enable_shrink`` rank masks, the wait-cost statistics and LogFMT combine through
``ep_ibgda.Buffer(low_latency_mode=True)`` against a torch reference on fresh random data; ranks
are processes (torch.multiprocessing + gloo), one per GPU or sharing the GPUs there are. Skipped,
loudly, without torch or a GPU.

Covers: masks set before the first call (kept on the host, applied when the native buffer is
built) and after it; the last rank masked by the others and masking everyone itself; dispatch
counts and rows, combine sums without the masked rank's experts; the query; the wait costs
(int64 per source rank, zero for a masked rank); clean of the masks and
``clean_low_latency_buffer``, after which the full reference holds again; LogFMT combine within
the format's tolerance."""

import pytest

from gpu_ranks import gather, low_latency_buffer, low_latency_rank, need_gpu, run_ranks, seed, world_sizes

N = 32  # num_max_dispatch_tokens_per_rank
H = 1024
K = 4


def _body(rank, world, base_seed):
    import torch
    import torch.distributed as dist

    tokens = 12 + 3 * rank
    gen, dev, experts, local, idx_cpu, w_cpu = low_latency_rank(rank, world, base_seed, 104729, tokens, K)
    idx_cpu[0, 2:] = -1
    # Magnitudes below 1, so LogFMT casts most groups; one channel group of token 1 kept large.
    x_cpu = (torch.randn(tokens, H, generator=gen) * 0.2).to(torch.bfloat16)
    x_cpu[1, :128] *= 40
    all_x, all_idx = [list(z) for z in zip(*gather((x_cpu, idx_cpu)))]
    m = world - 1
    # masked[r][s]: rank r masks rank s. The others mask m; m masks everyone.
    masked = [[r == m or s == m for s in range(world)] for r in range(world)]

    def linked(a, b):
        return not masked[a][b] and not masked[b][a]

    def expected_rows(mask_on):
        rows = []
        for l in range(local):
            e = rank * local + l
            rows.append([(s, t) for s in range(world) for t in range(all_idx[s].shape[0])
                         if (not mask_on or linked(rank, s)) and bool((all_idx[s][t] == e).any())])
        return rows

    def check_dispatch(recv_x, recv_count, rows):
        assert torch.equal(recv_count.cpu(), torch.tensor([len(r) for r in rows], dtype=torch.int32))
        got = recv_x.cpu()
        for l, rr in enumerate(rows):
            if rr:
                assert torch.equal(got[l, : len(rr)], torch.stack([all_x[s][t] for s, t in rr])), f"expert {l}"

    def combine_ref(mask_on):
        # The experts return their input: Σ_k w_k × x over the present copies.
        present = idx_cpu >= 0
        if mask_on:
            owner = torch.where(present, idx_cpu // local, torch.zeros_like(idx_cpu))
            present &= torch.tensor([[linked(rank, int(d)) for d in row] for row in owner])
        return (x_cpu.float() * (w_cpu * present.float()).sum(1, keepdim=True)).to(torch.bfloat16)

    buf = low_latency_buffer(N, H, world, experts, enable_shrink=True)
    x, topk_idx, topk_weights = x_cpu.to(dev), idx_cpu.to(dev), w_cpu.to(dev)

    # Masks before the first call: kept on the host, applied when the native buffer is built.
    for s in range(world):
        if masked[rank][s]:
            buf.low_latency_update_mask_buffer(s, True)
    status = torch.full((world,), -1, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(status)
    assert status.cpu().tolist() == [int(v) for v in masked[rank]]

    dwait = torch.zeros(world, dtype=torch.int64, device=dev)
    cwait = torch.zeros(world, dtype=torch.int64, device=dev)
    recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
        x, topk_idx, N, experts, dispatch_wait_recv_cost_stats=dwait, use_fp8=False)
    check_dispatch(recv_x, recv_count, expected_rows(True))
    combined, ev, hook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle,
                                                 combine_wait_recv_cost_stats=cwait)
    torch.testing.assert_close(combined.cpu(), combine_ref(True), rtol=2e-2, atol=2e-2)
    buf.low_latency_query_mask_buffer(status)
    assert status.cpu().tolist() == [int(v) for v in masked[rank]], "no wait timed out"
    for s in range(world):
        if not linked(rank, s):
            assert int(dwait[s]) == 0 and int(cwait[s]) == 0, f"waited on masked rank {s}"
    if rank != m:
        assert int(dwait.sum()) > 0 and int(cwait.sum()) > 0, "wait costs were counted"
    del handle

    # Hook mode with the masks set after the native buffer exists: masks cleaned, the group
    # reset, then the full reference.
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    assert status.cpu().tolist() == [0] * world
    buf.clean_low_latency_buffer(N, H, experts)
    recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
        x, topk_idx, N, experts, use_fp8=False, return_recv_hook=True)
    hook()
    check_dispatch(recv_x, recv_count, expected_rows(False))
    combined, ev, hook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    torch.testing.assert_close(combined.cpu(), combine_ref(False), rtol=2e-2, atol=2e-2)

    # LogFMT: lossy, within its tolerance (about 1 % of each term here), both with and without
    # a hook.
    for use_hook in (False, True):
        combined, ev, hook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, use_logfmt=True,
                                                     return_recv_hook=use_hook)
        if use_hook:
            hook()
        torch.testing.assert_close(combined.cpu().float(), combine_ref(False).float(), rtol=3e-2, atol=3e-2)
    del handle

    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", world_sizes())
def test_low_latency_masks_wait_costs_logfmt(world):
    need_gpu()
    run_ranks(_body, world, seed())
