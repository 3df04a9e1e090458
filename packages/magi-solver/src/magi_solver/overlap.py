"""Multi-stage overlap planner: cut a rank's remote KV into chunks and group them into stages.

Stage i's GroupCast is meant to run while stage i-1's attention computes. The timeline model is
``max(comm_0, host) + sum_i max(comm_i, calc_{i-1}) + calc_last`` in estimated seconds.

The dynamic degree (``degree=None``) prices a whole training step of the layer, forward plus
backward, for every candidate degree and takes the one whose slowest rank is fastest (the ranks
meet in every stage's collective, so the slowest sets the pace). Each stage costs more than its
share of kernel and wire time: a collective's latency, a kernel launch, the forward's LSE merge
and the backward's dQ accumulation over the rank's whole shard. These fixed costs are what keep
small, fast-linked cases at few stages; without them more stages always look better. The model
was checked against ``magi_attn.simulate`` (README "Simulated scaling").
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
            the degree (1..dynamic_max_degree) whose estimated forward+backward step, all ranks
            together, is cheapest (see the module docstring; the fields below price it).
        min_chunk_size: smallest remote KV chunk (tokens) that the stages are built from.
        max_num_chunks: at most this many remote chunks per rank (chunks grow to fit).
        dynamic_max_degree: upper bound of the dynamic search.
        compute_tflops: the cost model's attention kernel throughput (TFLOP/s).
        comm_gbps: the cost model's bandwidth of one rank to ranks on other nodes (GB/s, one
            direction; H100 nodes: one 400 Gb/s InfiniBand port per GPU, ~40 GB/s effective).
        intra_node_gbps: bandwidth to ranks of the same node (GB/s; NVLink 4: 450 per
            direction, ~360 effective).
        ranks_per_node: consecutive ranks that share a node (cost model only).
        stage_latency_us: fixed wire cost of each stage's collective (latency, microseconds).
        memory_gbps: HBM bandwidth for the per-stage elementwise work (the LSE merge of the
            output, the dQ accumulation), GB/s.
    """

    degree: int | None = 1
    min_chunk_size: int = 512
    max_num_chunks: int = 64
    dynamic_max_degree: int = 8
    compute_tflops: float = 500.0
    comm_gbps: float = 40.0
    intra_node_gbps: float = 360.0
    ranks_per_node: int = 8
    stage_latency_us: float = 25.0
    memory_gbps: float = 2700.0

    def __post_init__(self) -> None:
        if self.degree is not None and (not isinstance(self.degree, int) or self.degree < 0):
            raise ValueError(f"OverlapConfig.degree must be None or an int >= 0, got {self.degree!r}")
        for name in ("min_chunk_size", "max_num_chunks", "dynamic_max_degree", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"OverlapConfig.{name} must be a positive int, got {v!r}")
        if self.degree is not None and self.degree > self.max_num_chunks:
            raise ValueError(
                f"OverlapConfig.degree={self.degree} exceeds max_num_chunks={self.max_num_chunks}; "
                "raise max_num_chunks or lower degree"
            )
        for name in ("compute_tflops", "comm_gbps", "intra_node_gbps", "memory_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OverlapConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.stage_latency_us >= 0:
            raise ValueError(f"OverlapConfig.stage_latency_us must be >= 0, got {self.stage_latency_us!r}")

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


# the backward does 2.5x the forward's FLOPs and moves 3x its bytes per stage: the KV cast
# again (16-bit) and the fp32 dK/dV GroupReduce (twice the cast's bytes, BWD_COMM - 1)
BWD_CALC, BWD_COMM = 2.5, 3.0
# the backward's fixed cost per stage launch (preprocessing and kernel launches; H100 kernel fit: 83 us)
BWD_STAGE_FIXED_S = 80e-6


@dataclass(frozen=True)
class RankCosts:
    """One rank's estimated seconds: host stage, and per remote chunk its compute and transfer;
    ``merge_s`` / ``dq_add_s``: the per-stage elementwise work of forward / backward."""

    host: float
    calc: tuple[float, ...]
    comm: tuple[float, ...]
    merge_s: float = 0.0
    dq_add_s: float = 0.0
    sources: tuple[dict[int, float], ...] = ()  # per chunk: its transfer seconds from each source rank


def _collective(ready: list[float], free: list[float], wire: Sequence[float]) -> list[float]:
    """End of one group-wide collective on each rank: it starts once every rank issued it
    (``ready``) and its communication stream is free, then takes each rank its ``wire`` time."""
    start = max(max(a, b) for a, b in zip(ready, free))
    return [start + w for w in wire]


def _wire_times(sources: Sequence[tuple[dict[int, float], ...]], groups: Sequence[list[list[int]]],
                stage_comm: Sequence[Sequence[float]], stage: int) -> list[float]:
    """Each rank's wire time in ``stage``: the longest of what it receives, what it sends and what
    each of its sources sends (a source's link carries all its destinations' rows). Without
    per-source detail, a rank's receive time alone."""
    n = len(groups)
    if not all(sources):
        return [stage_comm[r][stage] for r in range(n)]
    recv: list[dict[int, float]] = []
    send = [0.0] * n
    for r in range(n):
        per_src: dict[int, float] = {}
        for i in groups[r][stage]:
            for p, sec in sources[r][i].items():
                per_src[p] = per_src.get(p, 0.0) + sec
        for p, sec in per_src.items():
            send[p] += sec
        recv.append(per_src)
    return [max(sum(recv[r].values()), send[r], max((send[p] for p in recv[r]), default=0.0)) for r in range(n)]


def step_cost(costs: Sequence[RankCosts], degree: int, latency_s: float) -> float:
    """Forward plus backward time of the slowest rank with every rank's chunks grouped into
    ``degree`` stages. As calc_attn runs them: stage s+1's cast is issued once stage s's data is
    in (so it overlaps stage s's kernel), the backward's reduce of stage s after its kernel, all
    collectives in issue order on one stream, each starting when every rank has issued it."""
    n = len(costs)
    groups = [group_stages(c.calc, c.comm, degree) for c in costs]
    cm, cl = zip(*(stage_costs(g, c.calc, c.comm) for g, c in zip(groups, costs)))
    wire = [[latency_s + t for t in _wire_times([c.sources for c in costs], groups, cm, s)] for s in range(degree)]
    fwd_calc = [[cl[r][s] + costs[r].merge_s if cl[r][s] > 0 else 0.0 for r in range(n)] for s in range(degree)]
    bwd_calc = [[BWD_CALC * cl[r][s] + costs[r].dq_add_s if cl[r][s] > 0 else 0.0 for r in range(n)]
                for s in range(degree)]
    # forward
    t = [c.host for c in costs]
    free = _collective([0.0] * n, [0.0] * n, wire[0])
    cast_end = free
    for s in range(degree):
        t = [max(a, b) for a, b in zip(t, cast_end)]
        if s + 1 < degree:
            cast_end = free = _collective(t, free, wire[s + 1])
        t = [a + b for a, b in zip(t, fwd_calc[s])]
    fwd = max(t)
    # backward: casts again, and each stage's fp32 dK/dV reduce (twice the cast's bytes)
    t = [BWD_CALC * c.host for c in costs]
    free = cast_end = _collective([0.0] * n, [0.0] * n, wire[0])
    for s in range(degree):
        t = [max(a, b) for a, b in zip(t, cast_end)]
        if s + 1 < degree:
            cast_end = free = _collective(t, free, wire[s + 1])
        t = [a + b for a, b in zip(t, bwd_calc[s])]
        free = _collective(t, free, [(BWD_COMM - 1) * (w - latency_s) + latency_s for w in wire[s]])
    bwd = max(max(a, b) for a, b in zip(t, free))
    return fwd + bwd


def best_degree(costs: Sequence[RankCosts], max_degree: int, latency_s: float) -> int:
    """The degree in ``1..max_degree`` with the cheapest step (ties: fewer stages)."""
    most = max(1, min(max_degree, max((len(c.calc) for c in costs), default=1)))
    best, best_cost = 1, math.inf
    for d in range(1, most + 1):
        cost = step_cost(costs, d, latency_s)
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = d, cost
    return best
