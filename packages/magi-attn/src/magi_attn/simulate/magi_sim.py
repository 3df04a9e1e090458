"""Replay magi's own plan for every rank: the plan calc_attn would run, stage by stage.

The plan is built by the code ``magi_attn_flex_key`` runs (``api._plan``: dispatch solver, comm
plan, overlap planner); each rank's kernel slices come from ``plan.calc_plan(rank)`` and its
transfers from ``plan.cast_plan(stage, rank)`` (the GroupReduce is its transpose), exactly the
tables :class:`~magi_attn.runtime.DistAttnRuntime` hands to the kernels and collectives. The op
order of each rank follows ``DistAttnFunction`` (dist_attn.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from magi_solver import AttnSlice, DistAttnPlan

from ..api import DistAttnKey, _plan
from ..config import DistAttnConfig
from .cost_model import KernelCostModel
from .links import LinkModel
from .timeline import Compute, Issue, Op, Timeline, Wait, simulate

KV_BYTES = 2  # K and V travel in bf16, as the kernels were measured
DKV_BYTES = 4  # the backward's partial dK/dV are fp32 (run_backward's accumulators)
ACC_BYTES = 4  # fp32 output / dQ accumulators


@dataclass(frozen=True)
class Shape:
    """Attention sizes of a simulated layer (default: MagiAttention's distributed benchmark, 64:8
    heads, d=128)."""

    heads_q: int = 64
    heads_kv: int = 8
    head_dim: int = 128


@dataclass(frozen=True)
class Result:
    """Forward and backward timelines of one method on one case, and the FLOPs they did."""

    method: str
    cp: int
    fwd: Timeline
    bwd: Timeline
    fwd_flops: float
    detail: dict

    def tflops_per_gpu(self, direction: str) -> float:
        """Useful TFLOP/s per GPU (unmasked area only; bwd counts 2.5x the forward's FLOPs)."""
        tl = self.fwd if direction == "fwd" else self.bwd
        flops = self.fwd_flops * (1.0 if direction == "fwd" else 2.5)
        return flops / tl.makespan / self.cp / 1e12 if tl.makespan > 0 else 0.0


def fwd_flops(slices: Sequence[AttnSlice], shape: Shape) -> float:
    return 4.0 * sum(s.area for s in slices) * shape.heads_q * shape.head_dim


def merge_s(cost: KernelCostModel, rows: int, shape: Shape) -> float:
    """The forward's LSE merge of one stage into the fp32 output (merge_out_lse): about six passes
    over ``rows x heads_q x head_dim`` fp32 (reads, weighted temporaries, write) in ~10 launches."""
    return cost.memory.seconds(6 * rows * shape.heads_q * shape.head_dim * ACC_BYTES, launches=10)


def dq_add_s(cost: KernelCostModel, rows: int, shape: Shape) -> float:
    """The backward's ``dq = dq + dq_s`` of one stage (three fp32 passes)."""
    return cost.memory.seconds(3 * rows * shape.heads_q * shape.head_dim * ACC_BYTES)


def build_plan(slices: Sequence[AttnSlice], total: int, cp: int, shape: Shape, config: DistAttnConfig) -> DistAttnPlan:
    """The plan ``magi_attn_flex_key`` builds for this mask on ``cp`` ranks (any rank's: all equal)."""
    key = DistAttnKey(tuple(s.to_tuple() for s in slices), total, shape.heads_q, shape.heads_kv, shape.head_dim,
                      cp, 0, config)
    return _plan(key)


def _traffic(plan: DistAttnPlan, stage: int, row_bytes: int, reduce: bool) -> list[dict[int, float]]:
    """traffic[r][p]: bytes rank r sends to p in stage's GroupCast (or its transposed GroupReduce)."""
    out: list[dict[int, float]] = []
    for r in range(plan.cp_size):
        p = plan.cast_plan(stage, r)
        row: dict[int, float] = {}
        if reduce:  # send back the partial dK/dV of the rows received from each source
            for n, src in zip(p.output_split_sizes, p.src_index):
                row[src] = row.get(src, 0.0) + n * row_bytes
        else:
            for n, dsts in zip(p.input_split_sizes, p.dst_indices):
                for d in dsts:
                    row[d] = row.get(d, 0.0) + n * row_bytes
        out.append(row)
    return out


def _transpose(traffic: list[dict[int, float]]) -> list[dict[int, float]]:
    out: list[dict[int, float]] = [{} for _ in traffic]
    for src, row in enumerate(traffic):
        for dst, nbytes in row.items():
            out[dst][src] = out[dst].get(src, 0.0) + nbytes
    return out


def _two_hop(plan: DistAttnPlan, stage: int, row_bytes: int, per_node: int) -> tuple[list[dict], list[dict]]:
    """The ``"hier"`` backend's two hops of a stage's cast (magi_comm.hierarchical): each split goes
    once to the proxy of every node holding a destination (the rank of that node with the
    sender's local index), which forwards it to the destinations on its node."""
    hop1: list[dict[int, float]] = [{} for _ in range(plan.cp_size)]
    hop2: list[dict[int, float]] = [{} for _ in range(plan.cp_size)]
    for r in range(plan.cp_size):
        p = plan.cast_plan(stage, r)
        for n, dsts in zip(p.input_split_sizes, p.dst_indices):
            for node in {d // per_node for d in dsts}:
                proxy = node * per_node + r % per_node
                if proxy != r:
                    hop1[r][proxy] = hop1[r].get(proxy, 0.0) + n * row_bytes
                for d in dsts:
                    if d // per_node == node and d != proxy:
                        hop2[proxy][d] = hop2[proxy].get(d, 0.0) + n * row_bytes
    return hop1, hop2


def _stage_durations(plan: DistAttnPlan, links: LinkModel, comm_backend: str, kv_row: int,
                     dkv_row: int) -> dict:
    """Per stage, every rank's seconds of its KV cast and of its dK/dV reduce."""
    out: dict = {}
    for s in range(plan.num_stages):
        if comm_backend == "hier":
            # two collectives one after the other; the reduce runs the transposed hops in reverse
            c1, c2 = _two_hop(plan, s, kv_row, links.ranks_per_node)
            r1, r2 = _two_hop(plan, s, dkv_row, links.ranks_per_node)
            out[("cast", s)] = [a + b for a, b in zip(links.collective_s(c1), links.collective_s(c2))]
            out[("reduce", s)] = [a + b for a, b in zip(links.collective_s(_transpose(r2)),
                                                        links.collective_s(_transpose(r1)))]
        else:
            out[("cast", s)] = links.collective_s(_traffic(plan, s, kv_row, reduce=False))
            out[("reduce", s)] = links.collective_s(_traffic(plan, s, dkv_row, reduce=True))
    return out


def simulate_magi(slices: Sequence[AttnSlice], total: int, cp: int, shape: Shape, cost: KernelCostModel,
                  links: LinkModel, config: DistAttnConfig = DistAttnConfig(),
                  plan: DistAttnPlan | None = None) -> Result:
    """Forward and backward of calc_attn on every rank of ``cp`` for one mask. ``config.comm_backend``
    ``"a2a"`` and ``"ipc"`` move every row straight to each destination; ``"hier"`` takes two hops
    (one inter-node copy per destination node); ranks per node are ``links.ranks_per_node``."""
    plan = plan or build_plan(slices, total, cp, shape, config)
    hq = shape.heads_q
    n = plan.num_stages
    kv_row = 2 * shape.heads_kv * shape.head_dim * KV_BYTES
    dkv_row = 2 * shape.heads_kv * shape.head_dim * DKV_BYTES
    if config.comm_backend == "ipc" and cp > links.ranks_per_node:
        raise ValueError(f"comm_backend='ipc' runs inside one node only, but cp={cp} > ranks_per_node="
                         f"{links.ranks_per_node}; simulate 'a2a' or 'hier'")
    if config.comm_backend == "hier" and cp % links.ranks_per_node:
        raise ValueError(f"comm_backend='hier' needs whole nodes: cp={cp} is not a multiple of ranks_per_node="
                         f"{links.ranks_per_node}")
    durations = _stage_durations(plan, links, config.comm_backend, kv_row, dkv_row)
    no_overlap = config.overlap.degree == 0
    fwd_progs: list[list[Op]] = []
    bwd_progs: list[list[Op]] = []
    for r in range(cp):
        calc = plan.calc_plan(r)
        shard = plan.dispatch.shard_seqlens[r]  # this rank's query rows (ranks may hold different counts)
        if no_overlap and n:
            merged = calc.merged(plan.kv_shard_seqlens[r])
            casts = [op for s in range(n) for op in (Issue(("cast", s)), Wait(("cast", s)))]
            fwd_progs.append([*casts, Compute(cost.forward_s(merged, hq))])
            reduces = [op for s in range(n) for op in (Issue(("reduce", s)), Wait(("reduce", s)))]
            bwd_progs.append([*casts, Compute(cost.backward_s(merged, hq)), *reduces])
            continue
        fwd: list[Op] = [Issue(("cast", 0))] if n else []
        bwd: list[Op] = [Issue(("cast", 0))] if n else []
        fwd.append(Compute(cost.forward_s(calc.host, hq)))
        bwd.append(Compute(cost.backward_s(calc.host, hq)))
        for s in range(n):
            for prog in (fwd, bwd):
                prog.append(Wait(("cast", s)))
                if s + 1 < n:
                    prog.append(Issue(("cast", s + 1)))
            if calc.stages[s]:
                fwd.append(Compute(cost.forward_s(calc.stages[s], hq) + merge_s(cost, shard, shape)))
                part = cost.memory.seconds(2 * calc.stage_kv_seqlens[s] * dkv_row)  # cat of dK, dV
                bwd.append(Compute(cost.backward_s(calc.stages[s], hq) + dq_add_s(cost, shard, shape) + part))
            bwd.append(Issue(("reduce", s)))
        bwd.extend(Wait(("reduce", s)) for s in range(n))
        fwd_progs.append(fwd)
        bwd_progs.append(bwd)
    fwd_durations = {k: v for k, v in durations.items() if k[0] == "cast"}
    detail = {"num_stages": n, "imbalance": round(plan.dispatch.imbalance(), 4), "chunk_size": plan.dispatch.chunk_size,
              "remote_kv_rows_max": max(plan.comm_rows(), default=0)}
    return Result("magi", cp, simulate(fwd_progs, fwd_durations), simulate(bwd_progs, durations),
                  fwd_flops(slices, shape), detail)
