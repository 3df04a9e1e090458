"""Two-stream timeline of every rank: a compute stream and a communication stream (NCCL's).

Each rank runs a program of ops, in the order the host issues them:

* ``Compute(seconds)``: runs on the compute stream after everything before it there.
* ``Issue(name)``: a group-wide collective (every rank issues the same names in the same order).
  As with ProcessGroupNCCL, the communication stream first waits for the compute stream up to
  this point, and collectives run one after another (FIFO); the collective starts when every
  rank has reached it (it is one NCCL call over the group) and takes each rank its own time.
* ``Wait(name)``: the compute stream waits until the collective has finished on this rank.

This is how calc_attn's stages overlap: stage s+1's GroupCast is issued right after the wait for
stage s, so it runs during stage s's kernel; the backward's GroupReduce of stage s is issued
after stage s's kernel and runs during the next one.

Per rank the result splits the makespan (the slowest rank's end) into ``compute``, ``exposed``
transfer (compute stream stalled while a transfer of this rank is running) and ``idle`` (the
rest: waiting for peers to reach a collective, or for the slowest rank to finish).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence, Union


@dataclass(frozen=True)
class Compute:
    seconds: float


@dataclass(frozen=True)
class Issue:
    name: Hashable


@dataclass(frozen=True)
class Wait:
    name: Hashable


Op = Union[Compute, Issue, Wait]


@dataclass(frozen=True)
class RankTimes:
    """One rank's share of a timeline (seconds)."""

    end: float
    compute: float
    transfer: float
    exposed: float
    idle: float


@dataclass(frozen=True)
class Timeline:
    """Every rank's times; ``makespan`` is the slowest rank's end."""

    ranks: tuple[RankTimes, ...]

    @property
    def makespan(self) -> float:
        return max((r.end for r in self.ranks), default=0.0)

    def worst(self, field: str) -> float:
        return max(getattr(r, field) for r in self.ranks)

    def mean(self, field: str) -> float:
        return sum(getattr(r, field) for r in self.ranks) / len(self.ranks)


def _overlap(a: float, b: float, intervals: list[tuple[float, float]]) -> float:
    """Length of [a, b] covered by ``intervals`` (which do not overlap each other)."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in intervals)


def simulate(programs: Sequence[Sequence[Op]], durations: dict[Hashable, Sequence[float]]) -> Timeline:
    """Run every rank's program; ``durations[name][rank]``: that collective's time on that rank.

    Raises ValueError when the programs do not issue the same collectives in the same order (a
    real run would hang) or wait for a collective they never issued."""
    n = len(programs)
    orders = [[op.name for op in prog if isinstance(op, Issue)] for prog in programs]
    if any(o != orders[0] for o in orders):
        raise ValueError("ranks issue different collectives or in different orders; a real run would hang")
    for name in orders[0]:
        if name not in durations or len(durations[name]) != n:
            raise ValueError(f"collective {name!r} needs one duration per rank ({n})")
    pos = [0] * n  # next op of each rank
    t = [0.0] * n  # compute stream time
    comm_free = [0.0] * n
    issued: dict[Hashable, list[float]] = {}
    done: dict[Hashable, list[float]] = {}
    busy: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    compute = [0.0] * n
    exposed = [0.0] * n
    next_coll = 0  # collectives start in issue order
    while True:
        progressed = False
        for r in range(n):
            prog = programs[r]
            while pos[r] < len(prog):
                op = prog[pos[r]]
                if isinstance(op, Compute):
                    t[r] += op.seconds
                    compute[r] += op.seconds
                elif isinstance(op, Issue):
                    issued.setdefault(op.name, [None] * n)[r] = t[r]  # type: ignore[list-item]
                else:
                    if op.name not in done:
                        if op.name not in issued or issued[op.name][r] is None:
                            raise ValueError(f"rank {r} waits for {op.name!r} before issuing it")
                        break
                    end = done[op.name][r]
                    if end > t[r]:
                        exposed[r] += _overlap(t[r], end, busy[r])
                        t[r] = end
                pos[r] += 1
                progressed = True
        # start every collective that all ranks have issued, in order
        while next_coll < len(orders[0]):
            name = orders[0][next_coll]
            times = issued.get(name)
            if times is None or any(x is None for x in times):
                break
            start = max(max(times[r], comm_free[r]) for r in range(n))
            ends = [start + durations[name][r] for r in range(n)]
            for r in range(n):
                busy[r].append((start, ends[r]))
                comm_free[r] = ends[r]
            done[name] = ends
            next_coll += 1
            progressed = True
        if all(pos[r] == len(programs[r]) for r in range(n)):
            break
        if not progressed:
            raise ValueError("the programs deadlock: a rank waits for a collective that cannot start")
    end = [max(t[r], comm_free[r]) for r in range(n)]
    makespan = max(end, default=0.0)
    transfer = [sum(e - s for s, e in busy[r]) for r in range(n)]
    return Timeline(tuple(RankTimes(end[r], compute[r], transfer[r], exposed[r],
                                    max(0.0, makespan - compute[r] - exposed[r]))
                          for r in range(n)))
