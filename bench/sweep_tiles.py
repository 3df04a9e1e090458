"""Tile-config sweep of the Triton backend in one process (magi only, no peers).

Each kernel family (forward, dK/dV, dQ) is swept on its own while the others keep their
defaults; one JSON line per (config, mask) with the median ms and TFLOP/s of that kernel alone.
Usage: python bench/sweep_tiles.py --seqlen 16384 --masks full varlen_causal
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from magi_attn import make_mask
from magi_solver import slice_ranges
from magi_kernels import run_backward, run_forward

# the variables each pass reads, with the values swept (a variable of MAGI_SWEEP found in neither
# is timed on the backward)
SWEEP_FWD = {
    "MAGI_TRITON_FWD_CFG": ["128,64,8,3", "128,128,8,3", "128,64,8,4", "128,128,8,2", "64,64,4,3", "128,32,8,3"],
    "MAGI_TRITON_TMA": ["0", "1"],  # TMA descriptor loads of full blocks (forward)
    # the warp-specialised Gluon forward (sm90): BM,BN,STAGES,PARTS,PING; and off (Triton forward)
    "MAGI_GLUON_FWD_CFG": ["128,128,2,2,1", "128,128,2,2,0", "128,128,3,2,1", "128,128,2,1,0", "128,64,3,2,1"],
    "MAGI_GLUON_FWD": ["1", "0"],
}
SWEEP_BWD = {
    "MAGI_TRITON_BWD_CFG": ["64,128,8,3", "64,128,8,2", "32,128,8,3", "64,64,4,3", "32,128,4,3", "64,64,8,3"],
    "MAGI_TRITON_DQ_CFG": ["128,64,8,3", "128,64,8,2", "64,64,4,3", "128,128,8,2", "64,128,8,3", "128,32,8,3"],
    "MAGI_TRITON_DQ": ["split", "atomic", "tma"],  # dQ programs, or dQ added by the dK/dV programs
    # the Gluon backward's per-launch choices, forced
    "MAGI_GLUON_BWD_PIECES": ["0", "1", "2", "3"],  # every program as pieces of that many query heads
    "MAGI_GLUON_BWD_PIECE_ADD": ["atomic", "tma"],  # how pieces add their dK/dV
}
SWEEP = SWEEP_FWD | SWEEP_BWD
SWEEP_FROM_ENV = os.environ.get("MAGI_SWEEP")  # "VAR=a;b VAR2=c" replaces the sweep
# "default;VAR=a,VAR2=b;VAR=c": settings of several variables at once, timed in this order
# (after MAGI_SWEEP's), e.g. an A/B of combinations alternated twice
SETS_FROM_ENV = os.environ.get("MAGI_SWEEP_SETS")


def parse_sets(text: str) -> list[dict[str, str]]:
    """``MAGI_SWEEP_SETS`` as a list of {variable: value} ("default": none set)."""
    sets = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        if item == "default":
            sets.append({})
            continue
        pairs = [kv.split("=", 1) for kv in item.split(",")]
        if any(len(kv) != 2 or not kv[0] for kv in pairs):
            raise ValueError(f"MAGI_SWEEP_SETS: {item!r} is not 'default' or VAR=value[,VAR=value...]")
        sets.append(dict(pairs))
    return sets


def balanced_order(runs: list[tuple]) -> list[tuple]:
    """``runs`` (label, value, settings) reordered for an A/B: a setting listed several times
    (``MAGI_SWEEP_SETS="A;B;C;A;B;C"``) is timed in rounds, the k-th round holding each one's
    k-th repeat in first-listed order, every other round reversed (A B C C B A ...). Under the
    power cap the SM clock sinks through a mask's timings (1850 to 1700 MHz over 16k
    sliding window), so a fixed order gave the first setting the highest clock in every round;
    reversed rounds give each setting the same mean position. A list without repeats is kept."""
    rounds: list[list[tuple]] = []
    seen: dict[str, int] = {}
    for run in runs:
        key = f"{run[0]}={run[1]}"
        k = seen.get(key, 0)
        seen[key] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(run)
    return [run for k, rnd in enumerate(rounds) for run in (reversed(rnd) if k % 2 else rnd)]


def set_pass(settings: dict[str, str]) -> str:
    """The pass a setting (one swept variable or a set) times: the forward when every variable
    is a forward one, else the backward (also for "default" and variables in neither table)."""
    return "fwd" if settings and all(v in SWEEP_FWD for v in settings) else "bwd"


def profile(mask: str, fwd, bwd) -> None:
    """Mean CUDA time per kernel over a few calls of each pass (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for name, fn in (("fwd", fwd), ("bwd", bwd)):
        fn()
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        for e in p.key_averages():
            if e.device_type.name == "CUDA" and e.count:
                print(json.dumps({"profile": name, "mask": mask, "kernel": e.key[:60], "calls": e.count,
                                  "ms": round(e.device_time_total / e.count / 1e3, 3)}), flush=True)


def main() -> int:
    import triton.testing

    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--masks", nargs="+", default=["full", "varlen_causal"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernels", nargs="+", default=list(SWEEP))
    p.add_argument("--profile", action="store_true", help="print per-kernel CUDA times at the defaults")
    p.add_argument("--rep-ms", type=int, default=150, help="timing window per config (longer: less noise)")
    args = p.parse_args()
    sweep = dict(SWEEP)
    if SWEEP_FROM_ENV or SETS_FROM_ENV:  # either replaces the default sweep
        sweep = {kv.split("=")[0]: kv.split("=")[1].split(";") for kv in (SWEEP_FROM_ENV or "").split()}
    # (label, value, settings) per timed setting: one variable at a time, then the sets
    runs = [(var, cfg, {var: cfg}) for var in [v_ for v_ in args.kernels if v_ in sweep] +
            [v_ for v_ in sweep if v_ not in SWEEP] for cfg in sweep[var]]
    runs += [("set", ",".join(f"{k}={v}" for k, v in st.items()) or "default", st)
             for st in parse_sets(SETS_FROM_ENV or "")]
    runs = balanced_order(runs)
    hq, hk, d, S = 48, 8, args.head_dim, args.seqlen
    dev = "cuda"
    for mask in args.masks:
        slices = make_mask(mask, S, seed=0)
        area = sum(s.area for s in slices)
        qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(slices))  # CPU: no sync
        torch.manual_seed(0)
        q = torch.randn(S, hq, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(S, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        out, lse = run_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0, "triton")
        dlse = torch.zeros_like(lse)
        flops = 4 * area * hq * d
        if args.profile:
            profile(mask, lambda: run_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0, "triton"),
                    lambda: run_backward(do, q, k, v, out, lse, dlse, qr, kr, tm, d ** -0.5, 0.0, "triton"))
        for n_run, (label, cfg, settings) in enumerate(runs):
            os.environ.update(settings)
            which = set_pass(settings)
            if which == "fwd":
                fn = lambda: run_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0, "triton")  # noqa: E731
                mult = 1.0
            else:
                fn = lambda: run_backward(  # noqa: E731
                    do, q, k, v, out, lse, dlse, qr, kr, tm, d ** -0.5, 0.0, "triton")
                mult = 2.5
            row = {"mask": mask, "seqlen": S, "var": label, "cfg": cfg, "pass": which}
            try:
                if n_run == 0:  # heat: the mask's setup left the card idle, its first timing would
                    # run at the idle-recovered clock (up to 1980 MHz) and the rest at the cap's
                    triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms)
                t0 = time.time()  # wall-clock span: joins the row with a clock/power log
                ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median")
                row.update(ms=round(ms, 3), tflops=round(mult * flops / ms / 1e9, 1),
                           t0=round(t0, 2), t1=round(time.time(), 2))
            except Exception as e:  # noqa: BLE001 - an unbuildable config is a result too
                row["error"] = repr(e)[:160]
            print(json.dumps(row), flush=True)
            for var in settings:
                os.environ.pop(var)
    return 0


if __name__ == "__main__":
    sys.exit(main())
