"""Matplotlib pictures of a plan: the mask coloured by the rank that computes each query chunk,
and per-rank mask area."""

from __future__ import annotations

from magi_solver import DistAttnPlan


def plot_dispatch(plan: DistAttnPlan, path: str, *, title: str = "", resolution: int = 256) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    d = plan.dispatch
    S = d.total_seqlen
    res = min(resolution, S)
    cell = S / res
    grid = np.full((res, res), -1.0)
    owner = [o for o, _ in plan.chunk_owner]
    for s in plan.slices:
        band = s.band()
        for i in range(res):
            q = int((i + 0.5) * cell)
            if not band.q_start <= q < band.q_end:
                continue
            lo, hi = band.row(q)
            if lo < hi:
                grid[i, int(lo / cell): max(int(hi / cell), int(lo / cell) + 1)] = owner[q // d.chunk_size]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
    cmap = plt.get_cmap("tab20", plan.cp_size)
    masked = np.ma.masked_less(grid, 0)
    ax0.imshow(masked, cmap=cmap, vmin=-0.5, vmax=plan.cp_size - 0.5, interpolation="nearest",
               extent=(0, S, S, 0))
    ax0.set_xlabel("key")
    ax0.set_ylabel("query")
    ax0.set_title("mask, coloured by computing rank")
    areas = d.rank_areas()
    ax1.bar(range(plan.cp_size), areas, color=[cmap(r) for r in range(plan.cp_size)])
    ax1.axhline(sum(areas) / len(areas), color="k", ls="--", lw=1, label="mean")
    ax1.set_xlabel("cp rank")
    ax1.set_ylabel("mask area (cells)")
    ax1.set_title(f"area per rank (max/mean {d.imbalance():.3f})")
    ax1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
