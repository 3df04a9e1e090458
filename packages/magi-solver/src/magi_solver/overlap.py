"""Multi-stage overlap planner: cut a rank's remote KV into chunks and group them into stages.

Stage i's GroupCast is meant to run while stage i-1's attention computes. The timeline model is
``max(comm_0, host) + sum_i max(comm_i, calc_{i-1}) + calc_last`` in estimated seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .ranges import AttnRange, AttnRanges


@dataclass(frozen=True)
class OverlapConfig:
    """Overlap of GroupCast with attention.

    Args:
        degree: remote stages. ``0`` = no overlap (one blocking cast, then one kernel over
            local+remote KV, no LSE merge); ``1`` = host stage + one remote stage; ``None`` =
            pick per rank the degree with the cheapest timeline (1..dynamic_max_degree) and use
            the largest of all ranks.
        min_chunk_size: smallest remote KV chunk (tokens) that the stages are built from.
        max_num_chunks: at most this many remote chunks per rank (chunks grow to fit).
        dynamic_max_degree: upper bound of the dynamic search.
        compute_tflops, comm_gbps: the cost model's attention throughput and per-rank
            bandwidth (only ratios matter).
    """

    degree: int | None = 1
    min_chunk_size: int = 512
    max_num_chunks: int = 64
    dynamic_max_degree: int = 8
    compute_tflops: float = 400.0
    comm_gbps: float = 100.0

    def __post_init__(self) -> None:
        if self.degree is not None and (not isinstance(self.degree, int) or self.degree < 0):
            raise ValueError(f"OverlapConfig.degree must be None or an int >= 0, got {self.degree!r}")
        for name in ("min_chunk_size", "max_num_chunks", "dynamic_max_degree"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"OverlapConfig.{name} must be a positive int, got {v!r}")
        if self.degree is not None and self.degree > self.max_num_chunks:
            raise ValueError(
                f"OverlapConfig.degree={self.degree} exceeds max_num_chunks={self.max_num_chunks}; "
                "raise max_num_chunks or lower degree"
            )
        for name in ("compute_tflops", "comm_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OverlapConfig.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def num_stages(self) -> int | None:
        """Remote stages for a static degree (degree 0 still has one, blocking, stage)."""
        return None if self.degree is None else max(self.degree, 1)


def split_remote(remote: AttnRanges, min_chunk_size: int, max_num_chunks: int) -> list[AttnRanges]:
    """Cut the concatenation of ``remote`` into consecutive chunks of equal token count."""
    total = remote.total_seqlen
    if total == 0:
        return []
    size = max(min_chunk_size, math.ceil(total / max_num_chunks))
    chunks: list[AttnRanges] = []
    cur: list[AttnRange] = []
    room = size
    for r in remote:
        s = r.start
        while s < r.end:
            take = min(room, r.end - s)
            cur.append(AttnRange(s, s + take))
            s += take
            room -= take
            if room == 0:
                chunks.append(AttnRanges(cur))
                cur, room = [], size
    if cur:
        chunks.append(AttnRanges(cur))
    return chunks


def timeline_cost(host_calc: float, comm: Sequence[float], calc: Sequence[float]) -> float:
    if not comm:
        return host_calc
    t = max(comm[0], host_calc)
    for i in range(1, len(comm)):
        t += max(comm[i], calc[i - 1])
    return t + calc[-1]


def group_stages(calc: Sequence[float], comm: Sequence[float], degree: int) -> list[list[int]]:
    """Split chunk indices into ``degree`` consecutive groups of near-equal cost (calc+comm);
    groups may be empty when there are fewer chunks than stages."""
    n = len(calc)
    weights = [a + b for a, b in zip(calc, comm)]
    total = sum(weights)
    groups: list[list[int]] = [[] for _ in range(degree)]
    if n == 0:
        return groups
    if total <= 0:
        for i in range(n):
            groups[min(i * degree // n, degree - 1)].append(i)
        return groups
    acc, g = 0.0, 0
    for i, w in enumerate(weights):
        # move on once this group reached its share, keeping enough groups for the rest
        if g < degree - 1 and groups[g] and acc + w / 2 > total * (g + 1) / degree:
            g += 1
        groups[g].append(i)
        acc += w
    return groups


def stage_costs(groups: list[list[int]], calc: Sequence[float], comm: Sequence[float]) -> tuple[list[float], list[float]]:
    return [sum(comm[i] for i in g) for g in groups], [sum(calc[i] for i in g) for g in groups]


def best_degree(host_calc: float, calc: Sequence[float], comm: Sequence[float], max_degree: int) -> int:
    best, best_cost = 1, math.inf
    for d in range(1, max(1, min(max_degree, len(calc))) + 1):
        cm, cl = stage_costs(group_stages(calc, comm, d), calc, comm)
        cost = timeline_cost(host_calc, cm, cl)
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = d, cost
    return best
