"""Time one backward two ways in one process: through autograd (as bench_kernels.py does) and
by calling ``magi_kernels.run_backward`` directly (as sweep_tiles.py does), each with a short
and a long timing window, interleaved. Two such timings once disagreed by 18-23 % on the full mask (the cause was the
power cap's clock, not the way of timing); this says which way (or which window) accounts for a gap.

Usage: python bench/bwd_timing_check.py --seqlen 16384 --masks full causal
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from magi_attn import make_mask
from magi_solver import slice_ranges
from magi_kernels import flex_flash_attn_func, run_backward


def main() -> int:
    import triton.testing

    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--masks", nargs="+", default=["full", "causal"])
    p.add_argument("--windows-ms", type=int, nargs="+", default=[200, 1500])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    hq, hk, d, S = 48, 8, 128, args.seqlen
    for mask in args.masks:
        slices = make_mask(mask, S, seed=0)
        flops = 2.5 * 4 * sum(s.area for s in slices) * hq * d
        qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(slices))  # CPU: no sync
        torch.manual_seed(0)
        q = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(S, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        g = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16)
        o, lse = flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton", check_ranges=False)
        qd, kd, vd, od = (t.detach() for t in (q, k, v, o))
        dlse = torch.zeros_like(lse)
        ways = {
            "autograd": lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True),
            "direct": lambda: run_backward(g, qd, kd, vd, od, lse.detach(), dlse, qr, kr, tm, d ** -0.5, 0.0, "triton"),
        }
        for rnd in range(args.rounds):
            for window in args.windows_ms:
                for way, fn in ways.items():
                    ms = triton.testing.do_bench(fn, warmup=25, rep=window, return_mode="median")
                    print(json.dumps({"mask": mask, "seqlen": S, "round": rnd, "window_ms": window, "way": way,
                                      "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
