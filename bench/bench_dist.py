"""Distributed attention benchmark: magi calc_attn vs ring-allgather (zigzag) vs Ulysses, all on
the same kernel, plus the single-GPU kernel at the per-GPU length as the ceiling.

TFLOP/s per GPU = area FLOPs / (max rank time * cp), fwd = 4*area*hq*d, bwd = 2.5x.
One process per GPU with NCCL when there are enough GPUs, else CPU processes with gloo
(a smoke test). It starts its own workers, or runs as one rank under torchrun. Usage:
    python bench/bench_dist.py --cp 8 --tokens-per-rank 8192 16384 --out dist.json
    torchrun --nproc-per-node 8 bench/bench_dist.py --cp 8 --out dist.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from magi_attn import WorkerEnv, init_worker, launched_env, run_workers

MASKS = ["full", "causal", "varlen_causal", "varlen_block_causal"]


def _timed(fn, iters, use_cuda, group):
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier(group)
        t = time.perf_counter()
        fn()
        if use_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = torch.tensor(sorted(times)[len(times) // 2], dtype=torch.float64)
    dist.all_reduce(med.to("cuda") if use_cuda else med, op=dist.ReduceOp.MAX, group=group)
    return float(med)


def worker(env: WorkerEnv, args, use_cuda: bool) -> list[dict] | None:
    """One rank: time every (tokens per rank, mask); rank 0 returns the rows."""
    os.environ.update(NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1")
    dev = init_worker(env, use_cuda)
    rank = env.rank
    from magi_attn import (
        DispatchConfig, DistAttnConfig, OverlapConfig, calc_attn, comm_rows_per_rank, contiguous_dispatch, dispatch,
        magi_attn_flex_key, make_mask, ring_allgather_attn, ulysses_attn, zigzag_dispatch,
    )
    from magi_comm import COMM_STATS
    from magi_kernels import flex_flash_attn_func
    from magi_solver import slice_ranges

    dtype = torch.bfloat16 if use_cuda else torch.float32
    backend = "auto" if use_cuda else "torch"
    g = dist.group.WORLD
    hq, hk, d, cp = args.heads_q, args.heads_kv, args.head_dim, args.cp
    rows = []
    for tpr in args.tokens_per_rank:
        S = tpr * cp
        for mask in args.masks:
            slices = make_mask(mask, S, seed=0)
            area = sum(s.area for s in slices)
            flops = 4 * area * hq * d
            torch.manual_seed(0)
            q, k, v = (torch.randn(S, h, d, dtype=dtype, device=dev) for h in (hq, hk, hk))
            res = {"cp": cp, "tokens_per_rank": tpr, "mask": mask}
            methods = {}
            key = magi_attn_flex_key([s.q_range for s in slices], [s.k_range for s in slices],
                                     [s.mask_type for s in slices], S, S, hq, hk, d, g,
                                     DistAttnConfig(DispatchConfig(chunk_size=args.chunk_size),
                                                    OverlapConfig(degree=args.degree), kernel_backend=backend,
                                                    comm_backend=args.comm, ranks_per_node=args.ranks_per_node))
            methods["magi"] = (lambda t: dispatch(t, key), lambda a, b, c: calc_attn(a, b, c, key))
            methods["ring_allgather"] = (lambda t: zigzag_dispatch(t, cp, rank),
                                         lambda a, b, c: ring_allgather_attn(a, b, c, slices, S, g, backend))
            if hq % cp == 0:
                methods["ulysses"] = (lambda t: contiguous_dispatch(t, cp, rank),
                                      lambda a, b, c: ulysses_attn(a, b, c, slices, S, g, backend))
            for name, (shard, attn) in methods.items():
                ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
                COMM_STATS.update(sent=0, received=0, inter_node_sent=0)
                out = attn(ql, kl, vl)[0]
                if name == "magi":  # group collectives count their bytes; the baselines use plain ones
                    res["magi_fwd_bytes_received"] = COMM_STATS["received"]
                    res["magi_fwd_inter_node_bytes_sent"] = COMM_STATS["inter_node_sent"]  # "hier" only
                go = torch.randn_like(out)
                t_f = _timed(lambda: attn(ql, kl, vl), args.iters, use_cuda, g)
                t_b = _timed(lambda: torch.autograd.grad(out, (ql, kl, vl), go, retain_graph=True), args.iters, use_cuda, g)
                res[f"{name}_fwd_tflops_per_gpu"] = flops / (t_f * cp) / 1e12
                res[f"{name}_bwd_tflops_per_gpu"] = 2.5 * flops / (t_b * cp) / 1e12
            plan = key.runtime.plan
            kv_row_bytes = 2 * hk * d * torch.finfo(dtype).bits // 8
            res["magi_fwd_bytes_plan"] = plan.comm_rows()[rank] * kv_row_bytes
            res["ring_allgather_fwd_bytes_plan"] = comm_rows_per_rank("ring_allgather", S, cp) * kv_row_bytes
            # single-GPU ceiling: the same mask type over the per-GPU length
            sl1 = make_mask(mask, tpr, seed=0)
            a1 = sum(s.area for s in sl1)
            q1, k1, v1 = (t[:tpr].detach().requires_grad_() for t in (q, k, v))
            args1 = slice_ranges(sl1)

            def single():
                return flex_flash_attn_func(q1, k1, v1, *args1, backend=backend)

            t1 = _timed(single, args.iters, use_cuda, g)
            o1 = single()[0]
            go1 = torch.randn_like(o1)
            t1b = _timed(lambda: torch.autograd.grad(o1, (q1, k1, v1), go1, retain_graph=True), args.iters, use_cuda, g)
            res["single_gpu_fwd_tflops"] = 4 * a1 * hq * d / t1 / 1e12
            res["single_gpu_bwd_tflops"] = 2.5 * 4 * a1 * hq * d / t1b / 1e12
            for name in methods:
                res[f"{name}_fwd_ratio_to_single"] = res[f"{name}_fwd_tflops_per_gpu"] / res["single_gpu_fwd_tflops"]
                res[f"{name}_bwd_ratio_to_single"] = res[f"{name}_bwd_tflops_per_gpu"] / res["single_gpu_bwd_tflops"]
            if rank == 0:
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
                rows.append(res)
    return rows if rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--masks", nargs="+", default=MASKS)
    p.add_argument("--heads-q", type=int, default=64)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--comm", choices=("a2a", "ipc", "hier"), default="a2a", help="magi's GroupCast/GroupReduce backend")
    p.add_argument("--ranks-per-node", type=int, default=None, help="for --comm hier (default LOCAL_WORLD_SIZE)")
    p.add_argument("--out", default="bench_dist.json")
    args = p.parse_args(argv)
    env = launched_env()
    if env is not None and env.world_size != args.cp:
        p.error(f"--cp {args.cp} but the launcher started {env.world_size} ranks; they must match")
    use_cuda = torch.cuda.device_count() >= (env.local_world_size if env else args.cp)
    rows = run_workers(worker, args.cp, args, use_cuda)
    if env is not None and not env.is_main:
        return None
    meta = {"device": torch.cuda.get_device_name() if use_cuda else "cpu (gloo)", "torch": torch.__version__,
            "config": vars(args)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    rows = main()
    env = launched_env()
    sys.exit(0 if rows or (env is not None and not env.is_main) else 1)
