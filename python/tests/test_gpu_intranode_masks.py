"""``enable_shrink`` rank masks in normal (intranode) mode through ``ep_ibgda.Buffer`` (DeepEP
offers them in low-latency mode only; the ``low_latency_*_mask_buffer`` methods set them here
too) against a torch reference on fresh random data; ranks are processes (torch.multiprocessing
+ gloo), one per GPU or sharing the GPUs there are. Skipped, loudly, without torch or a GPU.

Covers: masks set before the first dispatch (kept on the host, applied when the intranode buffer
is built) and after it; the last rank cut off (the others mask it, it masks them); two halves;
dispatch rows, top-k ids, weights and per-expert counts from linked ranks only; cached dispatch
under the same masks; combine sums without the masked ranks' copies; the query; clean, after
which the full reference holds again."""

import pytest

from gpu_ranks import gather, need_gpu, run_ranks, seed, world_sizes

H = 256
K = 4


def _groups(world, group_of):
    """masked[r][s]: ranks of different groups mask each other."""
    return [[group_of(r) != group_of(s) for s in range(world)] for r in range(world)]


def _body(rank, world, base_seed):
    import torch
    import torch.distributed as dist

    import ep_ibgda as deep_ep

    gen = torch.Generator().manual_seed(base_seed * 7919 + rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = 4 * world
    local = experts // world
    buf = deep_ep.Buffer(dist.group.WORLD, int(64e6), 0, explicitly_destroy=True, enable_shrink=True)

    def set_masks(masked):
        buf.low_latency_clean_mask_buffer()
        for s in range(world):
            if masked[rank][s]:
                buf.low_latency_update_mask_buffer(s, True)
        status = torch.full((world,), -1, dtype=torch.int32, device=dev)
        buf.low_latency_query_mask_buffer(status)
        assert status.cpu().tolist() == [int(v) for v in masked[rank]]

    def check_round(masked, name):
        tokens = 40 + 4 * rank
        idx_cpu = torch.rand(tokens, experts, generator=gen).topk(K, dim=1).indices
        idx_cpu = torch.where(torch.rand(tokens, K, generator=gen) < 0.1, torch.full_like(idx_cpu, -1), idx_cpu)
        w_cpu = torch.rand(tokens, K, generator=gen)
        x_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        all_x, all_idx, all_w = [list(z) for z in zip(*gather((x_cpu, idx_cpu, w_cpu)))]

        def linked(a, b):
            return not masked[a][b] and not masked[b][a]

        # Rows this rank receives: from linked ranks, by source rank, then token.
        rows = [(s, t) for s in range(world) if linked(rank, s) for t in range(all_idx[s].shape[0])
                if bool(((all_idx[s][t] >= 0) & (all_idx[s][t] // local == rank)).any())]
        x, topk_idx, topk_weights = x_cpu.to(dev), idx_cpu.to(dev), w_cpu.to(dev)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
        assert recv_x.shape == (len(rows), H), f"{name}: {recv_x.shape[0]} rows, expected {len(rows)}"
        if rows:
            assert torch.equal(recv_x.cpu(), torch.stack([all_x[s][t] for s, t in rows])), f"{name}: rows"
            src_idx = torch.stack([all_idx[s][t] for s, t in rows])
            src_w = torch.stack([all_w[s][t] for s, t in rows])
            mine = (src_idx >= 0) & (src_idx // local == rank)
            assert torch.equal(recv_idx.cpu(), torch.where(mine, src_idx - rank * local, torch.full_like(src_idx, -1)))
            assert torch.equal(recv_w.cpu(), torch.where(mine, src_w, torch.zeros_like(src_w)))
            assert counts == [int((src_idx == rank * local + l).any(dim=1).sum()) for l in range(local)], name
        else:
            assert counts == [0] * local, name

        # Cached dispatch of other rows along the same routes, under the same masks.
        x2_cpu = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        all_x2 = gather(x2_cpu)
        out = buf.dispatch(x2_cpu.to(dev), handle=handle)
        if rows:
            assert torch.equal(out[0].cpu(), torch.stack([all_x2[s][t] for s, t in rows])), f"{name}: cached"
        del out

        # Combine: each token comes back once per linked rank it went to; weights of experts on
        # masked ranks are absent.
        valid = idx_cpu >= 0
        owner = torch.where(valid, idx_cpu // local, torch.zeros_like(idx_cpu))
        on_linked = valid & torch.tensor([[linked(rank, int(d)) for d in row] for row in owner], dtype=torch.bool)
        copies = sum(((idx_cpu // local == d) & valid).any(dim=1).float() for d in range(world) if linked(rank, d))
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        ref = (x_cpu.float() * copies[:, None]).to(torch.bfloat16)
        torch.testing.assert_close(combined.cpu(), ref, rtol=1e-2, atol=1e-2, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(combined_w.cpu(), torch.where(on_linked, w_cpu, torch.zeros_like(w_cpu)))
        del handle

    m = world - 1
    cut_off = _groups(world, lambda r: int(r == m))
    # Before the first dispatch: kept on the host, applied when the intranode buffer is built.
    set_masks(cut_off)
    check_round(cut_off, "last rank cut off")
    if world >= 4:
        halves = _groups(world, lambda r: r * 2 // world)
        set_masks(halves)
        check_round(halves, "halves")
    none = _groups(world, lambda r: 0)
    set_masks(none)
    check_round(none, "masks cleaned")
    set_masks(cut_off)
    check_round(cut_off, "last rank cut off again")

    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("world", world_sizes())
def test_intranode_rank_masks(world):
    need_gpu()
    run_ranks(_body, world, seed())
