"""Ring attention (zigzag, P2P), Ulysses and USP on the same kernel and link models as magi.

* ring: zigzag shards (rank r holds chunks r and 2cp-1-r of 2cp, as ``magi_attn.baselines``);
  cp steps, each computes the local queries against one rank's KV while that KV moves on to the
  next rank (send/recv overlapped with the step's kernel); every step LSE-merges into the output.
  The backward sends KV forward and the accumulated fp32 dK/dV along with it. Each step's
  send/recv is one group-wide step (the slowest link, e.g. the one crossing nodes, paces it).
* ulysses: all-to-all from sequence- to head-sharding (q, k, v), one full-sequence kernel on
  ``heads_q / cp`` heads, all-to-all back; no overlap. Needs ``heads_q % cp == 0`` (KV heads are
  repeated when fewer than cp, as ``magi_attn.baselines.ulysses_attn`` does).
* usp: Ulysses inside each node (degree ``gcd(heads_q, ranks_per_node)``) and zigzag ring attention
  across the nodes (Fang & Zhao, USP 2024).

Each rank's kernel slices are the mask's slices in that rank's buffers (as ``magi_solver.local_slices``),
priced by the same :class:`~.cost_model.KernelCostModel`.
"""

from __future__ import annotations

import math
from typing import Sequence

from magi_solver import AttnRange, AttnSlice, Band, slices_over

from ..baselines import padded_length, zigzag_ranges
from .cost_model import KernelCostModel
from .links import LinkModel
from .magi_sim import DKV_BYTES, KV_BYTES, Result, Shape, dq_add_s, fwd_flops, merge_s
from .timeline import Compute, Issue, Op, Wait, simulate


def _ring_programs(steps: list[list[tuple[float, float]]], before: list[Op], after_fwd: list[Op],
                   after_bwd: list[Op], before_bwd: list[Op]) -> tuple[list[list[Op]], list[list[Op]]]:
    """Forward and backward programs of a ring of ``len(steps[0])`` steps; ``steps[r][i]``: (fwd, bwd)
    compute of rank r at step i. Step i's KV transfer (``kv``, i) runs during step i's kernel; in the
    backward the dK/dV of step i travels (``dkv``, i) during step i+1."""
    n_steps = len(steps[0])
    fwd_progs, bwd_progs = [], []
    for r, per_step in enumerate(steps):
        fwd: list[Op] = list(before)
        bwd: list[Op] = list(before_bwd)
        for i, (f, b) in enumerate(per_step):
            last = i == n_steps - 1
            if not last:
                fwd.append(Issue(("kv", i)))
                bwd.append(Issue(("kv", i)))
            fwd.append(Compute(f))
            bwd.append(Compute(b))
            if i:
                bwd.append(Wait(("dkv", i - 1)))
            bwd.append(Issue(("dkv", i)))
            if not last:
                fwd.append(Wait(("kv", i)))
                bwd.append(Wait(("kv", i)))
        bwd.append(Wait(("dkv", n_steps - 1)))
        fwd_progs.append(fwd + after_fwd)
        bwd_progs.append(bwd + after_bwd)
    return fwd_progs, bwd_progs


def _query_bands(slices: Sequence[AttnSlice], q_ranges: Sequence[AttnRange]) -> list[tuple[int, Band]]:
    """(q shift, band) of the mask's rows in ``q_ranges``, for a buffer that concatenates them (as
    ``magi_solver.local_slices`` clips them; built once per rank, then clipped to each step's keys)."""
    bands: list[tuple[int, Band]] = []
    pos = 0
    for qr in q_ranges:
        for s in slices:
            if s.q_range.end <= qr.start or s.q_range.start >= qr.end:
                continue
            b = s.band().clip_q(qr.start, qr.end)
            if b is not None:
                bands.append((qr.start - pos, b))
        pos += qr.seqlen
    return bands


def _ring_steps(slices: Sequence[AttnSlice], padded: int, ring: int, heads: int, cost: KernelCostModel,
                shape: Shape, rows: int) -> list[list[tuple[float, float]]]:
    """Per ring member and step: (fwd, bwd) seconds of that step's kernel and its merge / dQ add."""
    parts = [zigzag_ranges(padded, ring, j) for j in range(ring)]
    scaled = Shape(heads, shape.heads_kv, shape.head_dim)
    out = []
    for j in range(ring):
        bands = _query_bands(slices, parts[j])
        row = []
        for i in range(ring):
            sl, _ = slices_over(bands, parts[(j - i) % ring])
            if not sl:
                row.append((0.0, 0.0))
                continue
            merge = merge_s(cost, rows, scaled) if i else 0.0
            row.append((cost.forward_s(sl, heads) + merge, cost.backward_s(sl, heads) + dq_add_s(cost, rows, scaled)))
        out.append(row)
    return out


def _ring_durations(links: LinkModel, cp: int, peer_of: list[int], n_steps: int, kv_bytes: float,
                    dkv_bytes: float) -> dict:
    kv = links.collective_s([{peer_of[r]: kv_bytes} for r in range(cp)])
    dkv = links.collective_s([{peer_of[r]: dkv_bytes} for r in range(cp)])
    durations: dict = {("kv", i): kv for i in range(n_steps - 1)}
    durations.update({("dkv", i): dkv for i in range(n_steps)})
    return durations


def simulate_ring(slices: Sequence[AttnSlice], total: int, cp: int, shape: Shape, cost: KernelCostModel,
                  links: LinkModel) -> Result:
    """Zigzag ring attention over ``cp`` ranks (P2P send/recv to the next rank)."""
    padded = padded_length(total, cp, 2)
    rows = padded // cp
    steps = _ring_steps(slices, padded, cp, shape.heads_q, cost, shape, rows)
    kv = rows * 2 * shape.heads_kv * shape.head_dim * KV_BYTES
    dkv = rows * 2 * shape.heads_kv * shape.head_dim * DKV_BYTES
    fwd, bwd = _ring_programs(steps, [], [], [], [])
    durations = _ring_durations(links, cp, [(r + 1) % cp for r in range(cp)], cp, kv, dkv)
    fwd_d = {k: v for k, v in durations.items() if k[0] == "kv"}
    return Result("ring", cp, simulate(fwd, fwd_d), simulate(bwd, durations), fwd_flops(slices, shape),
                  {"steps": cp})


def ulysses_degree(shape: Shape, cp: int, ranks_per_node: int) -> int:
    """USP's Ulysses degree: the head split inside one node."""
    return math.gcd(math.gcd(shape.heads_q, ranks_per_node), cp)


def simulate_usp(slices: Sequence[AttnSlice], total: int, cp: int, shape: Shape, cost: KernelCostModel,
                 links: LinkModel, ulysses: int | None = None) -> Result | None:
    """USP: Ulysses over ``ulysses`` ranks of a node, zigzag ring over the ``cp / ulysses`` groups.
    ``ulysses=cp`` is plain Ulysses. None when the heads do not split that way, or when the
    automatic degree covers all of cp (then it is plain Ulysses: see :func:`simulate_ulysses`)."""
    u = ulysses_degree(shape, cp, links.ranks_per_node) if ulysses is None else ulysses
    if cp % u or shape.heads_q % u or (ulysses is None and u == cp):
        return None  # heads do not split so, or (one node) USP would be plain Ulysses
    ring = cp // u
    heads = shape.heads_q // u
    kv_heads = math.ceil(shape.heads_kv / u)  # KV heads repeated up to the Ulysses degree when fewer
    padded = padded_length(total, cp, 2)
    rows = padded // cp  # tokens each rank holds before the all-to-all
    group_rows = rows * u  # tokens of one ring member after it
    steps = _ring_steps(slices, padded, ring, heads, cost, shape, group_rows) if ring > 1 else [
        [(cost.forward_s([s.to_tuple() for s in slices], heads),
          cost.backward_s([s.to_tuple() for s in slices], heads))]]
    d = shape.head_dim
    peers = [[g * u + j for j in range(u)] for g in range(ring)]

    def a2a(row_bytes: float) -> list[float]:
        """All-to-all inside each Ulysses group: rank r sends rows/u rows of its heads to each peer."""
        traffic = [{p: rows / u * row_bytes for p in peers[r // u] if p != r} for r in range(cp)]
        return links.collective_s(traffic)

    qkv_row = (shape.heads_q + 2 * kv_heads * u) * d * KV_BYTES  # q, k, v of one token, all heads
    out_row = shape.heads_q * d * KV_BYTES
    durations: dict = {"qkv": a2a(qkv_row), "out": a2a(out_row), "dout": a2a(out_row + shape.heads_q * 4),
                       "dqkv": a2a(qkv_row)}
    rep = [row for g in range(ring) for row in [steps[g]] * u]  # every rank of a group runs its member's steps
    fwd, bwd = _ring_programs(rep, [Issue("qkv"), Wait("qkv")], [Issue("out"), Wait("out")],
                              [Issue("dqkv"), Wait("dqkv")], [Issue("dout"), Wait("dout")])
    if ring > 1:
        kv = group_rows * 2 * kv_heads * d * KV_BYTES
        dkv = group_rows * 2 * kv_heads * d * DKV_BYTES
        durations.update(_ring_durations(links, cp, [(r + u) % cp for r in range(cp)], ring, kv, dkv))
    else:
        durations[("dkv", 0)] = [0.0] * cp
    fwd_d = {k: v for k, v in durations.items() if k in ("qkv", "out") or (isinstance(k, tuple) and k[0] == "kv")}
    name = "ulysses" if ring == 1 else "usp"
    return Result(name, cp, simulate(fwd, fwd_d), simulate(bwd, durations), fwd_flops(slices, shape),
                  {"ulysses_degree": u, "ring_degree": ring})


def simulate_ulysses(slices: Sequence[AttnSlice], total: int, cp: int, shape: Shape, cost: KernelCostModel,
                     links: LinkModel) -> Result | None:
    """DeepSpeed-Ulysses over all ``cp`` ranks; None when ``heads_q`` is not a multiple of cp."""
    if shape.heads_q % cp:
        return None
    return simulate_usp(slices, total, cp, shape, cost, links, ulysses=cp)

