"""Host cost of ``flex_flash_attn_func``'s default slice check (bounds, mask types, double coverage).

Per slice count and mask, one JSON line with the median milliseconds of:
``first`` (a mask never seen: device->host read, per-slice checks, the solver's double-coverage
sweep), ``same_tensors`` (the same range tensors again: identity + in-place version lookup),
``equal_contents`` (new tensors with the same values, as when ranges are rebuilt from lists each
call: concatenation, host copy and a content digest) and ``bounds_only`` (the check before it was
cached, without double coverage: read + a Python loop on every call), for comparison.

Usage: python bench/slice_check_cost.py [--device cuda] [--counts 1 100 10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from magi_kernels import validation
from magi_kernels.validation import SliceTensors, check_slice_tensors


def masks(n: int) -> dict[str, list[tuple[int, int, int, int, int]]]:
    """``n`` causal documents of 64 tokens, and ``n`` full slices of one q range over disjoint keys."""
    docs = [(i * 64, i * 64 + 64, i * 64, i * 64 + 64, 1) for i in range(n)]
    one_row = [(0, 64, i * 4, i * 4 + 4, 0) for i in range(n)]
    return {"varlen_causal": docs, "one_q_range": one_row}


def tensors(rows: list[tuple[int, ...]], device: str) -> SliceTensors:
    t = torch.tensor(rows, dtype=torch.int32, device=device)
    return SliceTensors(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous())


def median_ms(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bounds_only(st: SliceTensors, tq: int, tk: int) -> None:
    """The uncached pre-change check: read the ranges, loop over them."""
    for (qs, qe), (ks, ke), t in zip(st.q_ranges.tolist(), st.k_ranges.tolist(), st.attn_type_map.tolist()):
        if not (0 <= qs <= qe <= tq and 0 <= ks <= ke <= tk and t in (0, 1, 2, 3)):
            raise ValueError("bad slice")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 100, 10000])
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for n in args.counts:
        for name, rows in masks(n).items():
            tq = max(r[1] for r in rows)
            tk = max(r[3] for r in rows)
            reps = 5 if n >= 10000 else 20

            def first() -> None:
                validation._CHECKED.clear()  # per-tensor memo entries died with the previous tensors
                check_slice_tensors(tensors(rows, args.device), tq, tk)

            fresh = [tensors(rows, args.device) for _ in range(reps)]
            sync()
            cold = median_ms(first, reps, sync) - median_ms(lambda: tensors(rows, args.device), reps, sync)
            st = tensors(rows, args.device)
            check_slice_tensors(st, tq, tk)
            same = median_ms(lambda: check_slice_tensors(st, tq, tk), reps * 10, sync)
            it = iter(fresh)
            equal = median_ms(lambda: check_slice_tensors(next(it), tq, tk), reps, sync)
            old = median_ms(lambda: bounds_only(st, tq, tk), reps, sync)
            print(json.dumps(dict(device=args.device, mask=name, slices=n, first_ms=round(cold, 4),
                                  same_tensors_ms=round(same, 4), equal_contents_ms=round(equal, 4),
                                  bounds_only_ms=round(old, 4))), flush=True)


if __name__ == "__main__":
    main()
