"""Host (CPU) cost of one ``flex_flash_attn_func`` call against the GPU time of its kernels.

A call whose host cost exceeds its kernels' time is launch-bound: a timing with an L2 flush
between calls (``triton.testing.do_bench``) then measures the host, not the kernels. Per
(seqlen, mask) and pass this prints one JSON line: ``host_ms`` (CPU time per call, calls issued
back to back without a sync), ``gpu_ms`` (kernel time per call from torch.profiler),
``do_bench_ms``, ``padded_ms`` (the same events with the host ahead of the GPU), the host
cost of the backend's forward alone and, with ``--cprofile``, the host functions that take the most time.

Usage: python bench/host_overhead.py --seqlen 8192 --masks varlen_causal full [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
from bench_kernels import bench  # the bench's timer (do_bench, L2 flushed before each call)

from magi_attn import make_mask
from magi_kernels import flex_flash_attn_func, run_forward
from magi_solver import slice_ranges


def host_ms(fn, calls: int = 200) -> float:
    """CPU time per call of ``fn`` issued ``calls`` times without a sync (the GPU queue absorbs them)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return t


def padded_ms(fn, reps: int = 50) -> float:
    """Median ms between CUDA events around ``fn`` as in ``do_bench`` (L2 flushed before each
    call), with a ~1 ms GPU sleep queued before the start event so that the host has issued the
    call before the GPU reaches it: kernel time with a cold L2 and no host gap."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(2_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gpu_ms(fn, calls: int = 10) -> float:
    """Kernel time per call of ``fn`` (sum over its CUDA kernels, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in p.key_averages() if e.device_type.name == "CUDA") / calls / 1e3


def top_host_functions(fn, calls: int = 100, n: int = 12) -> str:
    """cProfile of ``calls`` calls: the ``n`` functions with the most cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--masks", nargs="+", default=["varlen_causal", "full"])
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    hq, hk, d, S = 48, 8, 128, args.seqlen
    for mask in args.masks:
        slices = make_mask(mask, S, seed=0)
        qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(slices))
        torch.manual_seed(0)
        q = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(S, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        g = torch.randn_like(q)

        def fwd():
            return flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton", check_ranges=False)[0]

        o = fwd()
        passes = {"fwd": fwd, "bwd": lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)}
        for gluon in ("1", "0"):
            os.environ["MAGI_GLUON_FWD"] = os.environ["MAGI_GLUON_BWD"] = gluon
            for name, fn in passes.items():
                fn()
                row = {"seqlen": S, "mask": mask, "pass": name, "gluon": gluon, "host_ms": round(host_ms(fn), 4),
                       "gpu_ms": round(gpu_ms(fn), 4),
                       "do_bench_ms": round(bench(fn, 200), 4),
                       "padded_ms": round(padded_ms(fn), 4)}
                if name == "fwd":  # the backend alone, without the autograd layer
                    fwd_only = lambda: run_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0, "triton")  # noqa: E731
                    row["backend_host_ms"] = round(host_ms(fwd_only), 4)
                print(json.dumps(row), flush=True)
                if args.cprofile and gluon == "1":
                    print(top_host_functions(fn), file=sys.stderr)
        os.environ.pop("MAGI_GLUON_FWD")
        os.environ.pop("MAGI_GLUON_BWD")
    return 0


if __name__ == "__main__":
    sys.exit(main())
