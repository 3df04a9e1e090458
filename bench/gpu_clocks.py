"""The SM clock and power during each timing of a device call, from its nvidia-smi log.

``bench/device_run.sh`` logs ``timestamp, clocks.sm, power.draw, temperature.gpu`` every 100 ms
into ``gpu_clocks.csv`` for the whole call. Under the 700 W cap the SM clock of a sustained
kernel falls well below its 1980 MHz boost (H100: medians 1470-1800 MHz per length)
and recovers in idle gaps, so the median of the whole call (idle included) says little about a
timing. This joins the log with the wall-clock windows the benchmarks record:

- ``bench_kernels.py`` JSON: every row's ``timing_windows`` (per implementation, one window per
  round) gain ``sm_mhz`` and ``power_w``: per implementation the median SM clock and the
  largest power draw inside its windows (so magi and a peer timed under different clocks show);
- ``sweep_tiles.py`` JSON lines: every row's ``t0``/``t1`` gain ``sm_mhz`` and ``power_w``.

Both files are rewritten in place. Usage:
  python bench/gpu_clocks.py gpu_clocks.csv [--bench bench.json] [--sweep sweep.jsonl]
prints the clock of the whole call, of its loaded part, and per annotated row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from bisect import bisect_left, bisect_right
from typing import NamedTuple

# a timing window shorter than the log's period holds no sample: widen by half a period
SAMPLE_PAD_S = 0.05
# samples drawing at least this share of the call's largest power count as "under load"
LOADED_POWER_SHARE = 0.6


class Sample(NamedTuple):
    t: float  # seconds since the epoch (the log's local time read as local time, as time.time())
    sm_mhz: int
    power_w: float


def parse_line(line: str) -> Sample | None:
    """One ``nvidia-smi --format=csv,noheader`` line, or None for a header, a partial or an
    ``[N/A]`` line (the log is cut wherever the call ended)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 3:
        return None
    try:
        stamp, frac = (parts[0].split(".") + ["0"])[:2]
        t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
        return Sample(t, int(parts[1].split()[0]), float(parts[2].split()[0]))
    except (ValueError, IndexError):
        return None


def load_samples(path: str) -> list[Sample]:
    """The log's samples in time order."""
    with open(path) as f:
        return sorted(s for s in map(parse_line, f) if s is not None)


def sample_time(s: Sample) -> float:
    """The sort key of the log: a sample's time."""
    return s.t


def window_stats(samples: list[Sample], windows: list[tuple[float, float]]) -> dict | None:
    """Median SM clock and largest power of the samples inside any of ``windows`` (each widened
    by ``SAMPLE_PAD_S``), or None when none falls inside."""
    inside = []
    for t0, t1 in windows:
        lo = bisect_left(samples, t0 - SAMPLE_PAD_S, key=sample_time)
        inside += samples[lo:bisect_right(samples, t1 + SAMPLE_PAD_S, lo=lo, key=sample_time)]
    if not inside:
        return None
    return {"sm_mhz": int(statistics.median(s.sm_mhz for s in inside)),
            "power_w": round(max(s.power_w for s in inside), 1), "samples": len(inside)}


def call_summary(samples: list[Sample]) -> dict:
    """SM clock (min/median/max) of the whole call and median of its loaded samples (power at
    least ``LOADED_POWER_SHARE`` of the largest), and the largest power."""
    clocks = [s.sm_mhz for s in samples]
    top = max(s.power_w for s in samples)
    loaded = [s.sm_mhz for s in samples if s.power_w >= LOADED_POWER_SHARE * top]
    return {"sm_mhz_min": min(clocks), "sm_mhz_median": int(statistics.median(clocks)), "sm_mhz_max": max(clocks),
            "sm_mhz_loaded_median": int(statistics.median(loaded)), "loaded_samples": len(loaded),
            "power_w_max": top}


def annotate_bench(data: dict, samples: list[Sample]) -> list[str]:
    """Adds ``sm_mhz``/``power_w`` per implementation to every row of a ``bench_kernels`` result
    that has ``timing_windows``; one printable line per row."""
    lines = []
    for row in data["rows"]:
        stats = {name: window_stats(samples, wins) for name, wins in row.get("timing_windows", {}).items()}
        stats = {name: st for name, st in stats.items() if st}
        if not stats:
            continue
        row["sm_mhz"] = {name: st["sm_mhz"] for name, st in stats.items()}
        row["power_w"] = {name: st["power_w"] for name, st in stats.items()}
        lines.append(f"{row['seqlen']:>6} {row['mask'][:20]:<20} "
                     + " ".join(f"{name}:{mhz}" for name, mhz in row["sm_mhz"].items()))
    return lines


def annotate_sweep(rows: list[dict], samples: list[Sample]) -> int:
    """Adds ``sm_mhz``/``power_w`` to every sweep row with a ``t0``/``t1`` window; how many."""
    done = 0
    for row in rows:
        if "t0" in row and "t1" in row:
            st = window_stats(samples, [(row["t0"], row["t1"])])
            if st:
                row["sm_mhz"], row["power_w"] = st["sm_mhz"], st["power_w"]
                done += 1
    return done


def read_or_warn(path: str) -> str | None:
    """The file's text, or None with a line on stderr when it is missing (a call that skipped
    the stage writing it)."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        print(f"no file {path}", file=sys.stderr)
        return None


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="the nvidia-smi log (timestamp, clocks.sm, power.draw, ...)")
    p.add_argument("--bench", default=None, help="a bench_kernels.py result JSON to annotate in place")
    p.add_argument("--sweep", default=None, help="a sweep_tiles.py JSON-lines file to annotate in place")
    args = p.parse_args()
    try:
        samples = load_samples(args.csv)
    except FileNotFoundError:
        print(f"no clock log: {args.csv}", file=sys.stderr)
        return 1
    if not samples:
        print(f"no samples in {args.csv}", file=sys.stderr)
        return 1
    s = call_summary(samples)
    print(f"sm clock MHz min/median/max {s['sm_mhz_min']}/{s['sm_mhz_median']}/{s['sm_mhz_max']}, "
          f"under load (>= {LOADED_POWER_SHARE:.0%} of max power, {s['loaded_samples']} samples) "
          f"median {s['sm_mhz_loaded_median']} | power W max {s['power_w_max']}")
    if args.bench and (text := read_or_warn(args.bench)) is not None:
        data = json.loads(text)
        print("SM MHz per implementation (median inside its timing windows)")
        print("\n".join(annotate_bench(data, samples)))
        write(args.bench, json.dumps(data, indent=1))
    if args.sweep and (text := read_or_warn(args.sweep)) is not None:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        print(f"sweep rows with a clock: {annotate_sweep(rows, samples)} of {len(rows)}")
        write(args.sweep, "".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
