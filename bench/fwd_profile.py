"""One forward launch of magi's kernel and one of cuDNN SDPA on the same inputs, for a
profiler (``ncu -k regex:'fwd_ws|fprop'``): b=1, hq=48, hk=8, d=128, bf16, full or causal.

Usage: ncu ... python bench/fwd_profile.py --seqlen 16384 --mask full
Each kernel runs ``--warmup`` times before the profiled call (compile and autotune stay outside
the capture when ncu skips the first launches with ``-s``).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from magi_attn import make_mask
from magi_kernels import run_forward
from magi_solver import slice_ranges


def main() -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--mask", choices=["full", "causal"], default="full")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    hq, hk, d, S = 48, 8, 128, args.seqlen
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(make_mask(args.mask, S, seed=0)))
    torch.manual_seed(0)
    q = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(S, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qf = q.transpose(0, 1)[None]
    kf, vf = (t.transpose(0, 1)[None].repeat_interleave(hq // hk, dim=1) for t in (k, v))
    for _ in range(args.warmup + 1):
        run_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0, "triton")
    for _ in range(args.warmup + 1):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qf, kf, vf, is_causal=args.mask == "causal")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
