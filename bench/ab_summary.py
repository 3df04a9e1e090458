"""Summarise an A/B sweep (``bench/sweep_tiles.py`` JSON lines): per (seqlen, mask, pass) the
mean TFLOP/s of each setting over its repeats, and its ratio to the baseline setting.

The baseline of a pass is ``--base`` if given and present, else the first setting timed on that
pass (``default`` for the backward sets of a ``MAGI_SWEEP_SETS`` run, e.g.
``MAGI_GLUON_FWD=0`` for a forward set list that starts with it).
After the table, one verdict per (pass, setting) by the adoption rule (docs/tuning.md): a
variant becomes the default only if it is at least ``--gain`` faster on the target masks
(``--target``, mean ratio over lengths) and no mask loses more than ``--loss``; one that wins on
the targets but loses elsewhere is a candidate for a per-launch choice.
Usage: python bench/ab_summary.py sweep.jsonl [--base default] [--target causal,varlen_causal]
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
    of the mean to the baseline setting's mean; ``sm_mhz`` the mean SM clock of its repeats where
    ``bench/gpu_clocks.py`` annotated them (else None)."""
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(dict)
    clocks: dict[tuple, list[int]] = defaultdict(list)
    for r in rows:
        groups[(r["seqlen"], r["mask"], r["pass"])].setdefault(r["cfg"], []).append(r["tflops"])
        if "sm_mhz" in r:
            clocks[(r["seqlen"], r["mask"], r["pass"], r["cfg"])].append(r["sm_mhz"])
    mean_mhz = {key: statistics.fmean(values) for key, values in clocks.items()}
    out = []
    for (seqlen, mask, which), by_cfg in sorted(groups.items()):
        ref_cfg = base if base in by_cfg else next(iter(by_cfg))
        ref = statistics.fmean(by_cfg[ref_cfg])
        ref_mhz = mean_mhz.get((seqlen, mask, which, ref_cfg))
        for cfg, values in by_cfg.items():
            mean = statistics.fmean(values)
            mhz = mean_mhz.get((seqlen, mask, which, cfg))
            rec = {"seqlen": seqlen, "mask": mask, "pass": which, "cfg": cfg, "n": len(values),
                   "tflops": round(mean, 1), "spread": round(max(values) - min(values), 1),
                   "ratio": round(mean / ref, 4), "base": ref_cfg, "sm_mhz": round(mhz) if mhz else None}
            if mhz and ref_mhz:  # the ratio per clock cycle: what is left once the clocks differ
                rec["ratio_per_mhz"] = round(mean / mhz / (ref / ref_mhz), 4)
            out.append(rec)
    return out


def verdicts(summary: list[dict], targets: tuple[str, ...], gain: float = 0.01,
             loss: float = 0.005, key: str = "ratio") -> list[dict]:
    """Per (pass, setting other than its baseline): the mean ratio of each mask over its lengths,
    and ``adopt`` (targets' mean >= 1 + gain, every mask >= 1 - loss), ``per-launch`` (targets
    win, some other mask loses), ``keep off`` (the targets do not win) or ``no target rows``.
    ``key="ratio_per_mhz"`` judges the clock-normalised ratios (records without one are skipped)."""
    ratios: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(dict)
    for rec in summary:
        if rec["cfg"] != rec["base"] and key in rec:
            ratios[(rec["pass"], rec["cfg"])].setdefault(rec["mask"], []).append(rec[key])
    out = []
    for (which, cfg), by_mask in sorted(ratios.items()):
        per_mask = {m: statistics.fmean(v) for m, v in by_mask.items()}
        hit = [per_mask[m] for m in targets if m in per_mask]
        worst = min(per_mask.values())
        if not hit:
            verdict = "no target rows"
        elif statistics.fmean(hit) < 1 + gain:
            verdict = "keep off"
        else:
            verdict = "adopt" if worst >= 1 - loss else "per-launch"
        out.append({"pass": which, "cfg": cfg, "per_mask": {m: round(r, 4) for m, r in per_mask.items()},
                    "verdict": verdict})
    return out


def short(cfg: str) -> str:
    """A setting without the common ``MAGI_GLUON_`` prefixes, for the table."""
    return cfg.replace("MAGI_GLUON_BWD_", "").replace("MAGI_GLUON_FWD_", "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsonl", nargs="+")
    p.add_argument("--base", default=None, help="baseline setting (default: the first timed per pass)")
    p.add_argument("--target", default="causal,varlen_causal",
                   help="comma-separated masks a variant must win on (mean ratio over lengths)")
    p.add_argument("--gain", type=float, default=0.01, help="least win on the targets to adopt (0.01 = 1 %%)")
    p.add_argument("--loss", type=float, default=0.005, help="largest loss allowed on any mask to adopt")
    args = p.parse_args()
    try:
        summary = summarise(load_rows(args.jsonl), args.base)
    except FileNotFoundError as e:
        print(f"no sweep file: {e.filename}", file=sys.stderr)
        return 1
    if not summary:
        print("no timed rows", file=sys.stderr)
        return 1
    for rec in summary:
        print(f"{rec['seqlen']:>6} {rec['mask'][:14]:<14} {rec['pass']} {short(rec['cfg'])[:44]:<44} "
              f"{rec['tflops']:7.1f} +-{rec['spread']:<5} x{rec['ratio']:.3f}"
              + (f" @{rec['sm_mhz']} MHz" if rec["sm_mhz"] else ""))
    targets = tuple(m for m in args.target.split(",") if m)
    for key, what in (("ratio", ""), ("ratio_per_mhz", ", per MHz of SM clock (bench/gpu_clocks.py)")):
        found = verdicts(summary, targets, args.gain, args.loss, key)
        if not found:
            continue
        print(f"\nverdicts{what} (targets {','.join(targets)}: win >= {args.gain:.1%}, "
              f"any mask loses <= {args.loss:.1%})")
        for v in found:
            masks = " ".join(f"{m}:x{r:.3f}" for m, r in v["per_mask"].items())
            print(f"{v['pass']} {short(v['cfg'])[:44]:<44} {v['verdict']:<14} {masks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
