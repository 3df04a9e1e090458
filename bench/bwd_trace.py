"""Where the Gluon backward's time goes, program by program: a per-program trace of one launch.

With ``MAGI_GLUON_BWD_TRACE=1`` each piece of the launch (a (key tile, KV head) program over
some of its GQA query heads, ``program_order.split_tail``) records its SM and its start and
end ``%globaltimer``. This script runs one backward per mask and splits the launch's
SM-time into the programs' own time, the gaps between programs on an SM, the SMs' idle time
before their first program and after their last one (the tail), and fits each program's
duration as ``overhead + steps * per_step`` (steps: GROUP x the tile's query blocks), which
says whether a mask is slower per step (memory) or loses its time around the programs.

Usage: python bench/bwd_trace.py --seqlen 16384 --masks full causal --out trace.json --plot trace.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from magi_kernels.gluon_bwd import decode_piece


def summarize(record: Sequence[Sequence[int]], steps: Sequence[float]) -> dict:
    """Split one launch's SM-time (rows of (piece, SM, start ns, end ns); ``steps[i]`` row i's
    step count) into busy / gap / head / tail fractions, and fit duration = a + b * steps."""
    import numpy as np

    rec = np.asarray(record, dtype=np.int64)
    if len(rec) == 0:
        raise ValueError("record is empty: was the launch traced (MAGI_GLUON_BWD_TRACE=1)?")
    t_lo, t_hi = rec[:, 2].min(), rec[:, 3].max()
    span = float(t_hi - t_lo)
    dur = (rec[:, 3] - rec[:, 2]).astype(float)
    sms = np.unique(rec[:, 1])
    head = tail = 0.0
    for sm in sms:
        mine = rec[rec[:, 1] == sm]
        head += mine[:, 2].min() - t_lo
        tail += t_hi - mine[:, 3].max()
    total = span * len(sms)
    busy = dur.sum()
    st = np.asarray(steps, dtype=float)
    b, a = np.polyfit(st, dur, 1) if np.ptp(st) > 0 else (dur.mean() / max(st.mean(), 1.0), 0.0)
    return {"programs": int(len(rec)), "sms": int(len(sms)), "span_us": round(span / 1e3, 1),
            "busy": round(busy / total, 4), "head_idle": round(head / total, 4), "tail_idle": round(tail / total, 4),
            "gaps": round(1 - (busy + head + tail) / total, 4), "per_step_us": round(b / 1e3, 4),
            "per_program_overhead_us": round(a / 1e3, 2), "mean_steps": round(float(st.mean()), 1)}


def steps_of(record: Sequence[Sequence[int]], work: Sequence[int], block_rows: int) -> list[int]:
    """Steps of each record row: its query heads x its tile's visible query rows in blocks."""
    out = []
    for row in record:
        prog, g_lo, g_hi = decode_piece(row[0])
        out.append((g_hi - g_lo) * -(-work[prog % len(work)] // block_rows))
    return out


def plot(traces: dict[str, list], path: str) -> None:
    """One Gantt panel per mask: a bar per program on its SM, shaded by KV head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 3.2 * len(traces)), squeeze=False)
    for ax, (name, tr) in zip(axes[:, 0], traces.items()):
        rec, n_tiles = tr["record"], tr["n_tiles"]
        t_lo = min(r[2] for r in rec)
        for piece, sm, t0, t1 in rec:
            ax.barh(sm, (t1 - t0) / 1e3, left=(t0 - t_lo) / 1e3, height=0.9,
                    color=plt.cm.tab10((decode_piece(piece)[0] // n_tiles) % 10), linewidth=0)
        ax.set_title(f"{name}: {tr['summary']['span_us']} us, busy {tr['summary']['busy']:.1%}, "
                     f"tail idle {tr['summary']['tail_idle']:.1%}", fontsize=9)
        ax.set_ylabel("SM")
    axes[-1, 0].set_xlabel("us since the first program started (colour: KV head)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    import torch

    from magi_attn.masks import make_mask
    from magi_kernels import gluon_bwd
    from magi_kernels import triton_backend as tb
    from magi_solver import slice_ranges

    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--masks", nargs="+", default=["full", "causal"])
    p.add_argument("--out", default=None, help="JSON with the summaries and the raw records")
    p.add_argument("--plot", default=None, help="Gantt chart of the launches (png)")
    p.add_argument("--variant", default="default", help="label of the run (e.g. the MAGI_* setting it ran under)")
    args = p.parse_args()
    os.environ["MAGI_GLUON_BWD_TRACE"] = "1"
    hq, hk, d, S = 48, 8, 128, args.seqlen
    traces = {}
    for mask in args.masks:
        qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(make_mask(mask, S, seed=0)))
        torch.manual_seed(0)
        q = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(S, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        out, lse = tb.ffa_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0)
        for _ in range(5):  # warm: compiled, clocks up; the last launch is the one kept
            tb.ffa_backward(do, q, k, v, out, lse, torch.zeros_like(lse), qr, kr, tm, d ** -0.5, 0.0)
        torch.cuda.synchronize()
        tr = gluon_bwd.last_trace
        if tr is None:
            raise RuntimeError("the backward did not run the Gluon kernel (sm90 and d=128 needed)")
        rec = tr["record"].cpu().tolist()
        steps = steps_of(rec, tr["work"], tr["block_rows"])
        split = sum(1 for _prog, lo, hi in (decode_piece(row[0]) for row in rec) if hi - lo < hq // hk)
        summary = {"mask": mask, "seqlen": S, "variant": args.variant, "split_pieces": split,
                   **summarize(rec, steps)}
        print(json.dumps(summary), flush=True)
        traces[mask] = {"summary": summary, "record": rec, "n_tiles": len(tr["work"])}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(traces, f)
    if args.plot:
        plot(traces, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
