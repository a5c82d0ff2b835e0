"""Normal-mode dispatch and combine with ``ep_ibgda`` used as DeepEP, checked against torch.

Run one process per rank with torchrun (ranks share the GPUs when there are fewer GPUs than
ranks)::

    torchrun --standalone --nproc-per-node 2 python/examples/dispatch_combine.py
    torchrun --standalone --nproc-per-node 2 python/examples/dispatch_combine.py --tokens 4096 --hidden 7168

Intranode on one host; internode when the ranks span several hosts, or with
``EP_IBGDA_RANKS_PER_NODE`` splitting the one host into virtual nodes (every inter-node byte
through the NIC, emulated where there is none)::

    EP_IBGDA_RANKS_PER_NODE=1 torchrun --standalone --nproc-per-node 2 python/examples/dispatch_combine.py

Each rank routes random tokens to random top-k experts, dispatches them, sends the received rows
straight back through combine, and checks both results against a reference computed in torch
from every rank's inputs; then times a few rounds. Exits non-zero on a mismatch.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import ep_ibgda as deep_ep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10, help="timed dispatch+combine rounds")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # gloo: the bootstrap's object all-gathers run on the CPU (as vLLM's CPU group does).
    dist.init_process_group("gloo")
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = args.experts_per_rank * world
    t, h, k = args.tokens, args.hidden, args.topk

    gen = torch.Generator().manual_seed(1234 + rank)
    x_cpu = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    idx_cpu = torch.rand(t, experts, generator=gen).topk(k, dim=1).indices
    w_cpu = torch.rand(t, k, generator=gen)
    x, topk_idx, topk_weights = x_cpu.to(dev), idx_cpu.to(dev), w_cpu.to(dev)

    cfg = deep_ep.Buffer.get_dispatch_config(world) if world in (2, 4, 8) else deep_ep.Config()
    nvl_bytes = max(cfg.get_nvl_buffer_size_hint(h * 2, world), int(1e9))
    # The RDMA budget pays for the internode buffer's NIC side (used when the ranks span nodes).
    rdma_bytes = max(cfg.get_rdma_buffer_size_hint(h * 2, world), int(1e9))
    buf = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, explicitly_destroy=True)

    def round_trip():
        ntpr, ntprr, ntpe, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=in_rank,
            num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_weights, config=cfg)
        combined, _, _ = buf.combine(recv_x, handle)
        return in_rank, recv_x, counts, combined, ntprr is not None

    in_rank, recv_x, counts, combined, internode = round_trip()

    # Reference: every rank's inputs; rows arrive by source rank, then token.
    everyone = [None] * world
    dist.all_gather_object(everyone, (x_cpu, idx_cpu))
    local = experts // world
    rows = [everyone[s][0][i] for s in range(world) for i in range(t)
            if bool((everyone[s][1][i] // local == rank).any())]
    ref_x = torch.stack(rows) if rows else torch.empty(0, h, dtype=torch.bfloat16)
    ok = torch.equal(recv_x.cpu(), ref_x)
    copies = in_rank.sum(1).float().cpu()
    ref_c = (x_cpu.float() * copies[:, None]).to(torch.bfloat16)
    ok = ok and torch.allclose(combined.cpu().float(), ref_c.float(), rtol=1e-2, atol=1e-2)

    torch.cuda.current_stream().synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        round_trip()
    torch.cuda.current_stream().synchronize()
    dt = (time.perf_counter() - t0) / max(args.rounds, 1)
    print(
        f"[rank {rank}/{world} cuda:{dev.index}, {'internode' if internode else 'intranode'}] received {recv_x.shape[0]} rows "
        f"(per local expert {counts}); dispatch+combine {'OK' if ok else 'MISMATCH'}; "
        f"{dt * 1e3:.2f} ms per round (layout + dispatch + combine, host-synchronised)",
        flush=True,
    )
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
