"""GB/s of the CUDA IPC GroupCast with N processes sharing one GPU, against all_to_all_single
over gloo on the same plan (the only all-to-all that runs with several processes per GPU).

Usage: python bench/bench_ipc.py --world 2 --rows 65536 --out ipc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from magi_attn import WorkerEnv, init_worker, run_workers


def worker(env: WorkerEnv, args) -> dict | None:
    """One of the processes sharing GPU 0 (gloo: NCCL cannot run two processes on one GPU)."""
    init_worker(env, use_cuda=False)
    torch.cuda.set_device(0)
    rank = env.rank
    from magi_comm import IpcGroupCollectives, group_cast

    W, n = args.world, args.rows
    # every rank sends every row to every other rank: a dense all-to-all-like cast
    kw = dict(input_split_sizes=[n], dst_indices=[[r for r in range(W) if r != rank]],
              output_split_sizes=[n] * (W - 1), src_index=[r for r in range(W) if r != rank])
    x = torch.randn(n, args.row_elems // 2, dtype=torch.bfloat16, device="cuda")
    row_bytes = x[0].numel() * 2
    ipc = IpcGroupCollectives(dist.group.WORLD, n * W * row_bytes + 1024, torch.device("cuda", 0))
    for _ in range(3):
        ipc.group_cast(x, **kw)
    t = time.perf_counter()
    for _ in range(args.iters):
        ipc.group_cast(x, **kw)
    torch.cuda.synchronize()
    t_ipc = (time.perf_counter() - t) / args.iters
    xc = x.cpu()
    group_cast(xc, group=dist.group.WORLD, **kw)
    t = time.perf_counter()
    for _ in range(max(1, args.iters // 4)):
        group_cast(xc, group=dist.group.WORLD, **kw)
    t_a2a = (time.perf_counter() - t) / max(1, args.iters // 4)
    sent = n * (W - 1) * row_bytes
    if rank == 0:
        return {"world": W, "rows": n, "row_bytes": row_bytes, "bytes_sent_per_rank": sent,
               "ipc_GBps_per_rank": sent / t_ipc / 1e9, "gloo_a2a_GBps_per_rank": sent / t_a2a / 1e9,
               "ipc_ms": t_ipc * 1e3, "gloo_a2a_ms": t_a2a * 1e3,
               "note": "all ranks share one GPU: the IPC number is bounded by that GPU's copy bandwidth"}
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--row-elems", type=int, default=2048, help="bf16 elements per row x2 (K and V of 8 heads x 128)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="bench_ipc.json")
    args = p.parse_args()
    res = run_workers(worker, args.world, args)
    if res is None:  # a rank other than 0 under torchrun
        return
    print(json.dumps(res))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
