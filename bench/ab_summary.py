"""Summarise an A/B sweep (``bench/sweep_tiles.py`` JSON lines): per (seqlen, mask, pass) the
mean TFLOP/s of each setting over its repeats, and its ratio to the baseline setting.

The baseline of a pass is ``--base`` if given and present, else the first setting timed on that
pass (``default`` for the backward sets of a ``MAGI_SWEEP_SETS`` run, e.g.
``MAGI_GLUON_FWD_PERSIST=0`` for a forward set list that starts with it).
Usage: python bench/ab_summary.py sweep.jsonl [--base default]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def load_rows(paths: list[str]) -> list[dict]:
    """The timed rows of the given JSON-lines files (rows with an error are skipped)."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [r for r in map(json.loads, filter(str.strip, f)) if "tflops" in r]
    return rows


def summarise(rows: list[dict], base: str | None = None) -> list[dict]:
    """One record per (seqlen, mask, pass, setting): mean and spread of its TFLOP/s and the ratio
    of the mean to the baseline setting's mean."""
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(dict)
    for r in rows:
        groups[(r["seqlen"], r["mask"], r["pass"])].setdefault(r["cfg"], []).append(r["tflops"])
    out = []
    for (seqlen, mask, which), by_cfg in sorted(groups.items()):
        ref_cfg = base if base in by_cfg else next(iter(by_cfg))
        ref = statistics.fmean(by_cfg[ref_cfg])
        for cfg, values in by_cfg.items():
            mean = statistics.fmean(values)
            out.append({"seqlen": seqlen, "mask": mask, "pass": which, "cfg": cfg, "n": len(values),
                        "tflops": round(mean, 1), "spread": round(max(values) - min(values), 1),
                        "ratio": round(mean / ref, 4), "base": ref_cfg})
    return out


def short(cfg: str) -> str:
    """A setting without the common ``MAGI_GLUON_`` prefixes, for the table."""
    return cfg.replace("MAGI_GLUON_BWD_", "").replace("MAGI_GLUON_FWD_", "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsonl", nargs="+")
    p.add_argument("--base", default=None, help="baseline setting (default: the first timed per pass)")
    args = p.parse_args()
    for rec in summarise(load_rows(args.jsonl), args.base):
        print(f"{rec['seqlen']:>6} {rec['mask'][:14]:<14} {rec['pass']} {short(rec['cfg'])[:44]:<44} "
              f"{rec['tflops']:7.1f} +-{rec['spread']:<5} x{rec['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
