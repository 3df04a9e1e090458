"""Sweeps of simulated cases, the overlap-degree comparison, and their table and plot."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from magi_solver import OverlapConfig

from ..config import DistAttnConfig
from ..masks import make_mask
from .baselines import simulate_ring, simulate_ulysses, simulate_usp
from .cost_model import KernelCostModel
from .links import LinkModel
from .magi_sim import Result, Shape, build_plan, simulate_magi

logger = logging.getLogger(__name__)

METHODS = ("magi", "ring", "ulysses", "usp")
FIXED_DEGREES = tuple(range(1, 9))


@dataclass(frozen=True)
class Case:
    """One simulated layer: a named mask (``magi_attn.masks.make_mask``, seed 0) over
    ``tokens_per_gpu * cp`` tokens."""

    mask: str
    tokens_per_gpu: int
    cp: int

    @property
    def total(self) -> int:
        return self.tokens_per_gpu * self.cp


@dataclass
class Simulator:
    """The models a sweep shares: kernel cost, links, layer shape and magi's config."""

    cost: KernelCostModel
    links: LinkModel = field(default_factory=LinkModel)
    shape: Shape = field(default_factory=Shape)
    config: DistAttnConfig = field(default_factory=lambda: DistAttnConfig(overlap=OverlapConfig(degree=None)))

    def __post_init__(self) -> None:
        if self.shape.head_dim != self.cost.head_dim:
            raise ValueError(f"head_dim={self.shape.head_dim}: the kernel cost model was fitted at head_dim="
                             f"{self.cost.head_dim} only; simulate with head_dim={self.cost.head_dim}")
        if self.shape.heads_q % self.shape.heads_kv:
            raise ValueError(f"heads_q={self.shape.heads_q} must be a multiple of heads_kv={self.shape.heads_kv}")

    def slices(self, case: Case):
        return make_mask(case.mask, case.total)

    def run(self, case: Case, method: str) -> Result | None:
        """One method on one case (None where the method cannot split the heads that way)."""
        sl = self.slices(case)
        args = (sl, case.total, case.cp, self.shape, self.cost, self.links)
        if method == "magi":
            return simulate_magi(*args, config=self.config)
        if method == "ring":
            return simulate_ring(*args)
        if method == "ulysses":
            return simulate_ulysses(*args)
        if method == "usp":
            return simulate_usp(*args)
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")

    def degree_sweep(self, case: Case, degrees: Iterable[int | None] = (None, *FIXED_DEGREES)) -> dict:
        """fwd+bwd makespan (ms) of magi with each overlap degree (None = the planner's pick)."""
        sl = self.slices(case)
        out = {}
        for deg in degrees:
            cfg = replace(self.config, overlap=replace(self.config.overlap, degree=deg))
            plan = build_plan(sl, case.total, case.cp, self.shape, cfg)
            res = simulate_magi(sl, case.total, case.cp, self.shape, self.cost, self.links, cfg, plan=plan)
            key = "auto" if deg is None else str(deg)
            out[key] = {"ms": round((res.fwd.makespan + res.bwd.makespan) * 1e3, 4), "stages": plan.num_stages}
        return out


def row(case: Case, res: Result, per_rank: bool = False) -> dict:
    """One table row: per-GPU TFLOP/s and where the slowest rank's time went (ms); with
    ``per_rank``, every rank's end, compute, transfer, exposed transfer and idle time too."""
    out = {"mask": case.mask, "tokens_per_gpu": case.tokens_per_gpu, "cp": case.cp, "method": res.method,
           "fwd_tflops_per_gpu": round(res.tflops_per_gpu("fwd"), 1),
           "bwd_tflops_per_gpu": round(res.tflops_per_gpu("bwd"), 1)}
    for name, tl in (("fwd", res.fwd), ("bwd", res.bwd)):
        out[f"{name}_ms"] = round(tl.makespan * 1e3, 3)
        for f in ("compute", "transfer", "exposed", "idle"):
            out[f"{name}_{f}_ms_max"] = round(tl.worst(f) * 1e3, 3)
    out.update(res.detail)
    if per_rank:
        out["per_rank_ms"] = {name: [{k: round(v * 1e3, 4) for k, v in vars(r).items()} for r in tl.ranks]
                              for name, tl in (("fwd", res.fwd), ("bwd", res.bwd))}
    return out


def sweep(sim: Simulator, cases: Sequence[Case], methods: Sequence[str],
          progress: Callable[[Iterable], Iterable] = iter, per_rank: bool = False) -> list[dict]:
    """A table row per (case, method) that can run it."""
    rows = []
    for case, method in progress([(c, m) for c in cases for m in methods]):
        res = sim.run(case, method)
        if res is None:
            logger.info("%s cannot run %s at cp=%d (heads do not split)", method, case.mask, case.cp)
            continue
        rows.append(row(case, res, per_rank))
    return rows


def degree_check(sim: Simulator, cases: Sequence[Case], progress: Callable[[Iterable], Iterable] = iter) -> list[dict]:
    """Per case: the planner's pick against every fixed degree 1..8 (fwd+bwd time)."""
    out = []
    for case in progress(cases):
        times = sim.degree_sweep(case)
        fixed = {k: v["ms"] for k, v in times.items() if k != "auto"}
        best = min(fixed, key=lambda k: fixed[k])
        out.append({"mask": case.mask, "tokens_per_gpu": case.tokens_per_gpu, "cp": case.cp,
                    "auto_ms": times["auto"]["ms"], "auto_stages": times["auto"]["stages"],
                    "best_fixed_degree": int(best), "best_fixed_ms": fixed[best],
                    "auto_over_best": round(times["auto"]["ms"] / fixed[best], 4), "fixed_ms": fixed})
    return out


def format_table(rows: Sequence[dict]) -> str:
    """A fixed-width text table of sweep rows (for stderr and the README)."""
    head = ("mask", "tok/GPU", "cp", "method", "fwd TF/s", "bwd TF/s", "fwd ms", "compute", "exposed", "idle")
    lines = ["SIMULATED (kernel cost model + link model; not measured)", " ".join(f"{h:>9}" for h in head)]
    for r in rows:
        vals = (r["mask"][:9], r["tokens_per_gpu"], r["cp"], r["method"], r["fwd_tflops_per_gpu"],
                r["bwd_tflops_per_gpu"], r["fwd_ms"], r["fwd_compute_ms_max"], r["fwd_exposed_ms_max"],
                r["fwd_idle_ms_max"])
        lines.append(" ".join(f"{v:>9}" for v in vals))
    return "\n".join(lines)


# MagiAttention's published H100 numbers (varlen causal, 8k tokens per GPU, heads 64:8, d 128, bf16;
# read from its docs' charts, approximate): TFLOP/s per GPU at cp 8/16/32/64.
PUBLISHED_H100 = {
    "MagiAttention fwd": {8: 459, 16: 426, 32: 315, 64: 237},
    "MagiAttention bwd": {8: 360, 16: 371, 32: 333, 64: 264},
}


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """Per-GPU TFLOP/s against cp, one panel per direction, a line per (mask, tokens, method);
    MagiAttention's published H100 varlen-causal figures dashed for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault((r["mask"], r["tokens_per_gpu"], r["method"]), []).append(r)
    for ax, d in zip(axes, ("fwd", "bwd")):
        for (mask, tok, method), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["cp"])
            ax.plot([r["cp"] for r in rs], [r[f"{d}_tflops_per_gpu"] for r in rs], marker="o",
                    label=f"{method} {mask} {tok // 1024}k (simulated)")
        pub = PUBLISHED_H100[f"MagiAttention {d}"]
        ax.plot(list(pub), list(pub.values()), "k--", marker="x", label="MagiAttention H100 varlen causal 8k (published)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cp (GPUs)")
        ax.set_title(f"{d}: SIMULATED TFLOP/s per GPU")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s per GPU")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"SIMULATED - {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
