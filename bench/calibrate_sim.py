"""Check the simulator's compute against the real kernels, rank by rank, on one GPU.

For a cp-rank magi plan (the plan calc_attn would run: ``magi_attn.simulate.build_plan``), each
rank's kernel work is run as ``DistAttnFunction`` runs it — the host stage, then every remote
stage's kernel on a buffer of that stage's received KV (random data stands in for the transfer)
with the forward's LSE merge and the backward's dQ accumulation — and timed; the simulator's
compute of the same rank (``simulate_magi``) is set beside it. Target: within 10 % per rank.
Every launch's features (area, visited tile cells, query rows) and measured time are written too,
so the cost model can be refitted from them.

    python bench/calibrate_sim.py --out calib.json                 # H100/H200: cp 8, 8k tokens per GPU
    python bench/calibrate_sim.py --out calib.json --smoke         # CPU, tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from magi_attn import MASKS, DistAttnConfig, OverlapConfig, make_mask
from magi_attn.simulate import KernelCostModel, LinkModel, Shape, build_plan, dq_add_s, merge_s, simulate_magi
from magi_kernels import merge_out_lse, run_backward, run_forward


def slice_args(slices):
    t = torch.tensor([list(s) for s in slices], dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def timer(device: str, reps: int):
    """Median seconds of ``fn`` over ``reps`` runs (CUDA events on a GPU)."""
    def run(fn) -> float:
        fn()  # warm-up: compiles, caches tile tables
        times = []
        for _ in range(reps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    return run


def rank_work(plan, rank: int, shape: Shape, dtype, device: str, backend: str):
    """(forward, backward, launches) of one rank: closures that run its kernels as calc_attn does."""
    calc = plan.calc_plan(rank)
    shard = plan.dispatch.shard_seqlens[rank]  # this rank's rows (ranks may hold different counts)
    g = torch.Generator(device="cpu").manual_seed(rank)

    def rnd(rows, heads):
        return torch.randn(rows, heads, shape.head_dim, generator=g).to(device, dtype)

    kv_rows = plan.kv_shard_seqlens[rank]
    q, k, v = rnd(shard, shape.heads_q), rnd(kv_rows, shape.heads_kv), rnd(kv_rows, shape.heads_kv)
    stage_kv = [(rnd(n, shape.heads_kv), rnd(n, shape.heads_kv)) for n in calc.stage_kv_seqlens]
    host = slice_args(calc.host)
    stages = [slice_args(s) if s else None for s in calc.stages]
    scale = shape.head_dim ** -0.5
    launches = [("host", calc.host, q, k, v, host)] + [
        (f"stage{i}", calc.stages[i], q, *stage_kv[i], stages[i]) for i in range(len(stages)) if stages[i] is not None]

    def fwd():
        out, lse = run_forward(q, k, v, *host, scale, 0.0, backend, True)
        for (ks, vs), args in zip(stage_kv, stages):
            if args is not None:
                o, l = run_forward(q, ks, vs, *args, scale, 0.0, backend, True)
                out, lse = merge_out_lse(out, lse, o, l)
        return out, lse

    out, lse = fwd()
    out = out.to(dtype)
    dout, dlse = torch.randn_like(out), torch.zeros_like(lse)

    def bwd():
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, dlse, *host, scale, 0.0, backend)
        for (ks, vs), args in zip(stage_kv, stages):
            if args is not None:
                dq_s, dk_s, dv_s = run_backward(dout, q, ks, vs, out, lse, dlse, *args, scale, 0.0, backend)
                dq = dq + dq_s
                torch.cat([dk_s, dv_s], dim=1)
        return dq

    def launch_fns(name, slices, qq, kk, vv, args):
        return (lambda: run_forward(qq, kk, vv, *args, scale, 0.0, backend, True),
                lambda: run_backward(dout, qq, kk, vv, out, lse, dlse, *args, scale, 0.0, backend))

    return fwd, bwd, [(name, slices, *launch_fns(name, slices, qq, kk, vv, args))
                      for name, slices, qq, kk, vv, args in launches]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--smoke", action="store_true", help="CPU and tiny sizes: checks that the script runs")
    p.add_argument("--mask", choices=MASKS, default="varlen_causal")
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--tokens-per-gpu", type=int, default=8192)
    p.add_argument("--heads-q", type=int, default=64)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--degree", default="auto", help="overlap degree: auto or an int")
    p.add_argument("--model", choices=("H100", "H200"), default=None,
                   help="whose kernel fit the simulator uses (default: from the GPU's name, else H100)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if args.smoke:
        args.cp, args.tokens_per_gpu, args.heads_q, args.heads_kv, args.reps = 2, 128, 1, 1, 1
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        print("calibrate_sim: no GPU; timing CPU kernels says nothing about the model (use --smoke to check "
              "that the script runs)", file=sys.stderr)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = "triton" if device == "cuda" else "torch"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    model = args.model or ("H200" if "H200" in name else "H100")
    shape = Shape(args.heads_q, args.heads_kv, 128)
    total = args.cp * args.tokens_per_gpu
    slices = make_mask(args.mask, total)
    cfg = DistAttnConfig(overlap=OverlapConfig(degree=None if args.degree == "auto" else int(args.degree)))
    plan = build_plan(slices, total, args.cp, shape, cfg)
    cost = KernelCostModel(model)
    sim = simulate_magi(slices, total, args.cp, shape, cost, LinkModel(), cfg, plan=plan)
    time_it = timer(device, args.reps)
    ranks, launches = [], []
    for r in range(args.cp):
        fwd, bwd, per_launch = rank_work(plan, r, shape, dtype, device, backend)
        f_s, b_s = time_it(fwd), time_it(bwd)
        sim_f, sim_b = sim.fwd.ranks[r].compute, sim.bwd.ranks[r].compute
        ranks.append({"rank": r, "measured_fwd_ms": f_s * 1e3, "simulated_fwd_ms": sim_f * 1e3,
                      "fwd_rel_err": sim_f / f_s - 1, "measured_bwd_ms": b_s * 1e3, "simulated_bwd_ms": sim_b * 1e3,
                      "bwd_rel_err": sim_b / b_s - 1})
        for lname, sl, lf, lb in per_launch:
            area, tiles, rows = cost.features(sl)
            launches.append({"rank": r, "launch": lname, "slices": len(sl), "area": area, "tile_cells": tiles,
                             "q_rows": rows, "measured_fwd_ms": time_it(lf) * 1e3,
                             "model_fwd_ms": cost.forward_s(sl, shape.heads_q) * 1e3,
                             "measured_bwd_ms": time_it(lb) * 1e3,
                             "model_bwd_ms": cost.backward_s(sl, shape.heads_q) * 1e3})
        print(f"rank {r}: fwd {f_s * 1e3:.3f} ms (sim {sim_f * 1e3:.3f}), bwd {b_s * 1e3:.3f} ms (sim {sim_b * 1e3:.3f})",
              file=sys.stderr)
    worst = max(abs(x[k]) for x in ranks for k in ("fwd_rel_err", "bwd_rel_err"))
    shard = max(plan.dispatch.shard_seqlens)  # the per-stage costs below are the largest shard's
    report = {
        "device": name, "smoke": args.smoke, "model": cost.describe(), "dtype": str(dtype), "backend": backend,
        "mask": args.mask, "cp": args.cp, "tokens_per_gpu": args.tokens_per_gpu, "heads_q": args.heads_q,
        "heads_kv": args.heads_kv, "head_dim": 128, "num_stages": plan.num_stages,
        "simulated_merge_ms_per_stage": merge_s(cost, shard, shape) * 1e3,
        "simulated_dq_add_ms_per_stage": dq_add_s(cost, shard, shape) * 1e3,
        "worst_rank_rel_err": worst, "within_10_percent": worst <= 0.10, "ranks": ranks, "launches": launches,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"worst per-rank error {worst:.1%} ({'within' if worst <= 0.10 else 'outside'} 10 %); wrote {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
