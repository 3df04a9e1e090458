"""What a forward (query tile, head) item costs besides its key blocks: a fit over a bench's rows.

Each row of ``bench_kernels.py``'s JSON gives the forward's time for one mask and length. With
one program per item on every SM, a row's time per item and SM (ms x SMs / items) is modelled
as ``a * key blocks + b * partial blocks + c``, averaged over the row's items, and fitted by
least squares over all rows. ``c`` is the item's fixed cost (launch and setup, pipeline fill,
output, the share of the tail), the part a persistent launch (``gluon_fwd``) can
hide; an H200 bench of one program per item fits a = 1.77 us, b = 0.08 us, c = 5.7 us.

Usage: python bench/fwd_item_fit.py bench_kernels_h200.json [--sms 132] [--key fwd_ms]
(``--key``: the timing column, e.g. magi_fwd_ms; blocks are of the Gluon forward's 128 x 128 tiles.)
"""

from __future__ import annotations

import argparse
import json
import sys


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def member_blocks(qs: int, qe: int, ks: int, ke: int, kind: int, m0: int, t_end: int, bm: int, bn: int):
    """(key blocks, partial blocks) that the forward walks for one member slice of the query
    tile [m0, m0 + bm) (the host mirror of ``gluon_fwd._member_keys``; ``kind``: bit 0 causal,
    bit 1 inverse causal)."""
    inv, cau = bool(kind & 2), bool(kind & 1)
    last = min(m0 + bm, qe) - 1
    k_lo = ks + m0 - qs if inv else ks
    k_hi = min(last + ke - qe + 1 if cau else ke, ke)
    full_lo = ks + last - qs if inv else ks
    full_hi = full_lo if qe < t_end else min(m0 + ke - qe + 1 if cau else ke, ke)
    n = _cdiv(max(k_hi - k_lo, 0), bn)
    j0 = min(_cdiv(max(full_lo - k_lo, 0), bn), n)
    j1 = max(j0, min(max(min(full_hi, k_hi) - k_lo, 0) // bn, n))
    return n, n - (j1 - j0)


def item_features(mask: str, seqlen: int, bm: int = 128, bn: int = 128) -> tuple[float, float, int]:
    """(mean key blocks, mean partial blocks, items per head) of the forward's tiles of a bench mask."""
    import torch

    from magi_attn import make_mask
    from magi_kernels import triton_backend as tb
    from magi_solver import slice_ranges

    ranges = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(make_mask(mask, seqlen, seed=0)))
    meta, layers, _ = tb._tiles(tb._host_tuple(*ranges), 0, bm, "cpu", seqlen)
    meta = meta.tolist()
    blocks = partial = items = 0
    for tiles, members, _n, _work in layers:
        members = members.tolist()
        for m0, t_end, first, count in tiles.tolist():
            items += 1
            for i in range(first, first + count):
                n, p = member_blocks(*meta[members[i]], m0, t_end, bm, bn)
                blocks, partial = blocks + n, partial + p
    return blocks / items, partial / items, items


def fit(rows: list[dict], key: str, sms: int, heads: int) -> tuple[list[float], list[tuple]]:
    """Least-squares (a, b, c) over ``rows`` and, per row, (seqlen, mask, blocks, partial, measured
    us per item, fitted)."""
    import numpy as np

    feats, times, labels = [], [], []
    for r in rows:
        if key not in r:
            continue
        blocks, partial, items = item_features(r["mask"], r["seqlen"])
        feats.append((blocks, partial, 1.0))
        times.append(r[key] * 1e3 * sms / (items * heads))
        labels.append((r["seqlen"], r["mask"], round(blocks, 1), round(partial, 2)))
    a = np.asarray(feats)
    coef = np.linalg.lstsq(a, np.asarray(times), rcond=None)[0]
    return coef.tolist(), [(*lab, round(t, 2), round(float(f @ coef), 2)) for lab, t, f in zip(labels, times, a)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("bench_json")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--heads", type=int, default=48, help="query heads of the bench (items = tiles x heads)")
    p.add_argument("--key", default="magi_fwd_ms")
    args = p.parse_args()
    with open(args.bench_json) as f:
        rows = json.load(f)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    coef, table = fit(rows, args.key, args.sms, args.heads)
    print(f"us per key block {coef[0]:.3f}, per partial block extra {coef[1]:.3f}, per item {coef[2]:.3f}")
    print("seqlen mask blocks partial measured_us fitted_us")
    for row in table:
        print(*row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
