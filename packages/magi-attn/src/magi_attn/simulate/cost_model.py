"""Kernel cost model: attention kernel time from a launch's slices, fitted to measured kernel times.

One launch of ``flex_flash_attn_func`` over slices ``(q_start, q_end, k_start, k_end, type)``
costs, per direction (forward / backward)::

    time = heads / fit_heads * (a * tile_cells + b * q_rows) + c,   c >= MIN_LAUNCH_S

``tile_cells`` are the cells of the 128x128 tiles the kernel visits (tiles start at each slice's
first row and first key, as the kernels cut them: partial tiles of a causal edge or a short
document cost a whole tile), ``q_rows`` the query rows of the slices (per-row work: loading Q,
writing O and LSE, the backward's preprocessing), ``c`` the fixed cost of a launch. The
coefficients are a non-negative least-squares fit, in relative error, to the single-GPU
measurements stored in ``kernel_times.json`` (hardware, software and sizes stated there);
:meth:`KernelCostModel.fit_error` says how well they reproduce them (H100: within 2.9 % forward,
3.3 % backward; H200: 5.0 % and 8.5 %). The fit's smallest launch takes 0.37 ms, so it cannot see the cost of a tiny
one: a launch costs at least ``MIN_LAUNCH_S`` (an assumption, which ``bench/calibrate_sim.py``
checks). Heads scale the work linearly (the fit's rows use ``fit_heads`` query heads); the model
knows only the fit's head dim.

Elementwise work around the kernels (the forward's LSE merge of each stage, the backward's dQ
accumulation) is priced as bytes over an effective HBM bandwidth (:class:`MemoryModel`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

SliceTuple = tuple[int, int, int, int, int]
MIN_LAUNCH_S = 10e-6  # kernel launch and the smallest grid's run time (assumed, not fitted)
TILE = 128  # rows and keys of the tile the cost model counts (the kernels' forward tile at head dim 128)
DEVICES = ("H100", "H200")


def _visible(qs: int, qe: int, ks: int, ke: int, t: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Key interval [lo, hi) of each row in ``rows`` for one slice (types as magi_solver.AttnMaskType:
    bit 0 causal, aligned bottom-right; bit 1 inverse causal, aligned top-left)."""
    lo = np.full(rows.shape, ks, dtype=np.int64)
    hi = np.full(rows.shape, ke, dtype=np.int64)
    if t & 1:
        hi = np.minimum(hi, rows + (ke - qe + 1))
    if t & 2:
        lo = np.maximum(lo, rows + (ks - qs))
    return lo, hi


def slice_features(slices: Iterable[Sequence[int]]) -> tuple[int, int, int]:
    """(unmasked area, cells of the visited 128x128 tiles, query rows) of one launch's slices."""
    area = tiles = rows = 0
    for qs, qe, ks, ke, t in slices:
        if qe <= qs or ke <= ks:
            continue
        rows += qe - qs
        starts = np.arange(qs, qe, TILE, dtype=np.int64)
        ends = np.minimum(starts + TILE, qe)
        # a tile's key extent: the union of its rows' intervals (both bounds are monotone in the row)
        lo_a, hi_a = _visible(qs, qe, ks, ke, t, starts)
        lo_b, hi_b = _visible(qs, qe, ks, ke, t, ends - 1)
        lo, hi = np.minimum(lo_a, lo_b), np.maximum(hi_a, hi_b)
        live = hi > lo
        first = (lo[live] - ks) // TILE
        last = (hi[live] - ks - 1) // TILE
        tiles += int((last - first + 1).sum())
        rlo, rhi = _visible(qs, qe, ks, ke, t, np.arange(qs, qe, dtype=np.int64))
        area += int(np.maximum(rhi - rlo, 0).sum())
    return area, tiles * TILE * TILE, rows


@dataclass(frozen=True)
class LaunchCost:
    """Fitted coefficients of one direction at ``fit_heads`` query heads: seconds per visited
    tile cell and per query row, and per launch."""

    per_tile_cell_s: float
    per_row_s: float
    per_launch_s: float
    fit_heads: int

    def seconds(self, tile_cells: int, rows: int, heads: int) -> float:
        """Time of one launch (0 for a launch with no work: calc_attn skips it)."""
        if tile_cells == 0:
            return 0.0
        work = self.per_tile_cell_s * tile_cells + self.per_row_s * rows
        return heads / self.fit_heads * work + self.per_launch_s


@dataclass(frozen=True)
class MemoryModel:
    """Elementwise kernels as bytes over an effective HBM bandwidth plus a launch each.

    H100 SXM: 3.35 TB/s HBM3, H200: 4.8 TB/s HBM3e (NVIDIA datasheets), of which large
    elementwise kernels reach about 80 % (assumed)."""

    bytes_per_s: float
    per_launch_s: float = 5e-6

    def seconds(self, nbytes: float, launches: int = 1) -> float:
        return nbytes / self.bytes_per_s + launches * self.per_launch_s


_HBM = {"H100": MemoryModel(0.8 * 3.35e12), "H200": MemoryModel(0.8 * 4.8e12)}


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (every subset of the few columns)."""
    n = x.shape[1]
    best, best_err = np.zeros(n), math.inf
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(n)
        full[cols] = coef
        err = float(((x @ full - y) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    return best


@dataclass(frozen=True)
class FitRow:
    """One measured launch: its mask, sequence length, features and times."""

    mask: str
    seqlen: int
    area: int
    tile_cells: int
    rows: int
    fwd_s: float
    bwd_s: float


class KernelCostModel:
    """Forward and backward kernel time of one launch, fitted to one device's measurements."""

    def __init__(self, device: str = "H100"):
        if device not in DEVICES:
            raise ValueError(f"unknown device {device!r}; the cost model has measurements for {DEVICES}")
        data = _load_data()["devices"][device]
        self.device = device
        self.meta = {k: v for k, v in data.items() if k != "rows"}
        self.heads_q, self.heads_kv, self.head_dim = data["heads_q"], data["heads_kv"], data["head_dim"]
        self.rows = [FitRow(r["mask"], r["seqlen"], *slice_features(r["slices"]), r["fwd_ms"] * 1e-3,
                            r["bwd_ms"] * 1e-3) for r in data["rows"]]
        self.fwd = self._fit([r.fwd_s for r in self.rows])
        self.bwd = self._fit([r.bwd_s for r in self.rows])
        self.memory = _HBM[device]

    def _fit(self, times: list[float]) -> LaunchCost:
        y = np.array(times)
        x = np.array([[r.tile_cells, r.rows, 1.0] for r in self.rows], dtype=float)
        scale = x.max(axis=0)
        # relative error: each row weighted by 1/time, so short launches count as much as long ones;
        # the launch is at least MIN_LAUNCH_S, the fit adds what the data asks above it
        coef = _nnls(x / scale / y[:, None], 1 - MIN_LAUNCH_S / y) / scale
        return LaunchCost(float(coef[0]), float(coef[1]), MIN_LAUNCH_S + float(coef[2]), self.heads_q)

    def features(self, slices: Sequence[SliceTuple]) -> tuple[int, int, int]:
        """(area, tile cells, query rows) of one launch (memoised)."""
        return _cached_features(tuple(map(tuple, slices)))

    def forward_s(self, slices: Sequence[SliceTuple], heads: int) -> float:
        _, tiles, rows = self.features(slices)
        return self.fwd.seconds(tiles, rows, heads)

    def backward_s(self, slices: Sequence[SliceTuple], heads: int) -> float:
        _, tiles, rows = self.features(slices)
        return self.bwd.seconds(tiles, rows, heads)

    def fit_error(self) -> dict[str, float]:
        """Largest and mean relative error of the model on its own fit rows, per direction."""
        out = {}
        for name, cost in (("fwd", self.fwd), ("bwd", self.bwd)):
            errs = [abs(cost.seconds(r.tile_cells, r.rows, self.heads_q) / getattr(r, f"{name}_s") - 1)
                    for r in self.rows]
            out[f"{name}_max_rel_err"] = max(errs)
            out[f"{name}_mean_rel_err"] = sum(errs) / len(errs)
        return out

    def describe(self) -> dict[str, object]:
        """The fit's hardware, sizes, coefficients and error (for reports)."""
        return {"device": self.meta["device"], "fit_heads_q": self.heads_q, "fit_heads_kv": self.heads_kv,
                "fit_head_dim": self.head_dim, "dtype": self.meta["dtype"], "fit_rows": len(self.rows),
                "fwd": vars(self.fwd), "bwd": vars(self.bwd), "min_launch_s": MIN_LAUNCH_S,
                **{k: round(v, 4) for k, v in self.fit_error().items()}}


@lru_cache(maxsize=1)
def _load_data() -> dict:
    return json.loads(Path(__file__).with_name("kernel_times.json").read_text())


@lru_cache(maxsize=65536)
def _cached_features(slices: tuple[SliceTuple, ...]) -> tuple[int, int, int]:
    return slice_features(slices)
