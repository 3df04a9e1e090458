"""Per-rank runtime of one plan: index tensors, kernel slice tensors and collective plans."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from magi_comm import GroupCollective, make_group_collective
from magi_kernels import AttentionPlan, KernelConfig, plan_attention
from magi_solver import DispatchPlan, DistAttnPlan, GroupCastPlan

from .config import DistAttnConfig
from .cp_mesh import NodeGroups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SliceArgs:
    """Kernel slice metadata (CPU int32 tensors) and the kernel plans of this stage, one per
    (shapes, dtype, device, kernel config) it ran with (``magi_kernels.plan_attention``)."""

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type_map: torch.Tensor
    area: int
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, slices, area: int) -> "SliceArgs":
        t = torch.tensor(list(slices), dtype=torch.int32).reshape(-1, 5)
        return cls(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous(), area)

    @property
    def empty(self) -> bool:
        return self.q_ranges.shape[0] == 0

    def plan(self, q: torch.Tensor, k: torch.Tensor, config: KernelConfig) -> AttentionPlan:
        """The kernel plan of this stage for q and k (its remote K) like these, built once."""
        key = (q.shape, k.shape, q.dtype, q.device, config, torch.are_deterministic_algorithms_enabled())
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = plan_attention(self.q_ranges, self.k_ranges, self.attn_type_map, q.shape[0],
                                                    k.shape[0], (q.shape[1], k.shape[1]), q.shape[-1], q.dtype,
                                                    config, q.device)
        return plan


def _rank_rows(d: DispatchPlan, rank: int) -> torch.Tensor:
    """Global rows of ``rank``'s local rows (``d.position_ids(rank)``, built with tensor ops)."""
    chunks = torch.tensor(d.partitions[rank], dtype=torch.long)
    rows = (chunks[:, None] * d.chunk_size + torch.arange(d.chunk_size, dtype=torch.long)).reshape(-1)
    return rows[rows < d.total_seqlen]  # the last chunk of the sequence may be short


@dataclass(frozen=True)
class RowPlacement:
    """Where the rows of one dispatched sequence live, as index tensors: the query side of every
    key, and the K/V side of a cross-attention key with sharded K/V."""

    rank_rows: tuple[torch.Tensor, ...]  # per rank: global row of each local row (lengths may differ)
    # undispatch's all-gather moves equal blocks of the largest shard's rows (gloo's all_gather
    # takes equal sizes only); gather_index[g] is global row g's place in that gathered buffer
    gather_rows: int
    gather_index: torch.Tensor

    @classmethod
    def of(cls, d: DispatchPlan) -> "RowPlacement":
        rank_rows = tuple(_rank_rows(d, r) for r in range(d.cp_size))
        gather_rows = max(rows.numel() for rows in rank_rows)
        gather_index = torch.empty(d.total_seqlen, dtype=torch.long)
        for r, rows in enumerate(rank_rows):
            gather_index[rows] = torch.arange(rows.numel(), dtype=torch.long) + r * gather_rows
        return cls(rank_rows, gather_rows, gather_index)


class DistAttnRuntime:
    """What one rank needs at run time; built once per key and cached."""

    def __init__(self, plan: DistAttnPlan, rank: int, group: dist.ProcessGroup | None, config: DistAttnConfig,
                 node_groups: NodeGroups | None = None):
        self.plan, self.rank, self.group, self.config = plan, rank, group, config
        self.node_groups = node_groups  # nodes of a 2-D cp_group mesh, for the "hier" backend
        d = plan.dispatch
        self.shard_seqlens = d.shard_seqlens  # ranks may hold different token counts (no padding)
        self.shard_seqlen = self.shard_seqlens[rank]
        self.total_seqlen = d.total_seqlen
        self.cp_size = d.cp_size
        self.rows = RowPlacement.of(d)
        self.local_index = self.rows.rank_rows[rank]  # global row of each local row
        self.position_ids = self.local_index
        self.kv_shard_seqlen = plan.kv_shard_seqlens[rank]  # local K/V rows (shard_seqlen unless cross-attention)
        calc = plan.calc_plan(rank)
        self.calc = calc
        self.cast_plans: list[GroupCastPlan] = [plan.cast_plan(s, rank) for s in range(plan.num_stages)]
        # stage s: cast_plans[s] brings remote KV here; its transpose sums dK/dV back
        ng = node_groups
        self.comm: GroupCollective = make_group_collective(
            config.comm_backend, self.cast_plans, group,
            timeout_s=config.comm_timeout_s,
            ranks_per_node=config.ranks_per_node if ng is None else ng.ranks_per_node,
            ordered=config.deterministic or torch.are_deterministic_algorithms_enabled(),
            node_groups=None if ng is None or config.comm_backend != "hier" else (ng.intra, ng.inter))
        self._slice_args: tuple[SliceArgs, list[SliceArgs], SliceArgs] | None = None
        # the (dtype, device, scale, softcap, backend, autograd) the ranks last agreed on (agreement.py)
        self.agreed_call: tuple | None = None
        logger.debug("rank %d runtime: %s", rank, plan.summary())

    @property
    def no_overlap(self) -> bool:
        return self.config.overlap.degree == 0

    def slice_args(self) -> tuple[SliceArgs, list[SliceArgs], SliceArgs]:
        """(host args, per-stage args, merged args over cat(local, remote KV)). The metadata
        stays on the CPU: the kernels read it without a device sync (the GPU backend uploads
        its tile tables once and caches them)."""
        if self._slice_args is None:
            c = self.calc
            host = SliceArgs.build(c.host, c.host_area)
            stages = [SliceArgs.build(s, a) for s, a in zip(c.stages, c.stage_areas)]
            merged = SliceArgs.build(c.merged(self.kv_shard_seqlen), c.host_area + sum(c.stage_areas))
            self._slice_args = (host, stages, merged)
        return self._slice_args
