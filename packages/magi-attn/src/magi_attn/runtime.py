"""Per-rank runtime of one plan: index tensors, kernel slice tensors and collective plans."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from magi_solver import DispatchPlan, DistAttnPlan, GroupCastPlan, GroupReducePlan

from .config import DistAttnConfig
from .cp_mesh import NodeGroups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SliceArgs:
    """Kernel slice metadata (CPU int32 tensors)."""

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type_map: torch.Tensor
    area: int

    @classmethod
    def build(cls, slices, area: int) -> "SliceArgs":
        t = torch.tensor(list(slices), dtype=torch.int32).reshape(-1, 5)
        return cls(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous(), area)

    @property
    def empty(self) -> bool:
        return self.q_ranges.shape[0] == 0


def _rank_rows(d: DispatchPlan, rank: int) -> torch.Tensor:
    """Global rows of ``rank``'s local rows (``d.position_ids(rank)``, built with tensor ops)."""
    chunks = torch.tensor(d.partitions[rank], dtype=torch.long)
    rows = (chunks[:, None] * d.chunk_size + torch.arange(d.chunk_size, dtype=torch.long)).reshape(-1)
    return rows[rows < d.total_seqlen]  # the last chunk of the sequence may be short


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
        self.rank_rows = [_rank_rows(d, r) for r in range(d.cp_size)]  # global row of each local row, per rank
        self.local_index = self.rank_rows[rank]
        self.position_ids = self.local_index
        # dispatch's all-gather moves equal blocks of the largest shard's rows (gloo's all_gather
        # takes equal sizes only); gather_index[g] is global row g's place in that gathered buffer
        self.gather_rows = max(self.shard_seqlens)
        gather_index = torch.empty(d.total_seqlen, dtype=torch.long)
        for r, rows in enumerate(self.rank_rows):
            gather_index[rows] = torch.arange(rows.numel(), dtype=torch.long) + r * self.gather_rows
        self.gather_index = gather_index
        calc = plan.calc_plan(rank)
        self.calc = calc
        self.cast_plans: list[GroupCastPlan] = [plan.cast_plan(s, rank) for s in range(plan.num_stages)]
        self.reduce_plans: list[GroupReducePlan] = [p.transpose() for p in self.cast_plans]
        self._slice_args: tuple[SliceArgs, list[SliceArgs], SliceArgs] | None = None
        self._ipc = None
        self._hier = None
        # the (dtype, device, scale, softcap, backend, autograd) the ranks last agreed on (agreement.py)
        self.agreed_call: tuple | None = None
        logger.debug("rank %d runtime: %s", rank, plan.summary())

    def ipc(self, kv: torch.Tensor):
        """The CUDA IPC collectives of this runtime (built on first use, sized for the largest
        stage of this plan), or None with the a2a backend."""
        if self.config.comm_backend != "ipc":
            return None
        if self._ipc is None:
            from magi_comm.ipc import IpcGroupCollectives

            row = kv[0].numel()
            most = max([self.shard_seqlen] + [p.output_rows for p in self.cast_plans])
            nbytes = most * row * max(kv.element_size(), 4) + 256
            self._ipc = IpcGroupCollectives(self.group, nbytes, kv.device)
        return self._ipc

    def hier(self, kv: torch.Tensor):
        """(two-hop collectives, per-stage two-hop plans) with the "hier" backend, else None. A
        stage's plan serves its cast and, transposed, its dK/dV reduce. All stages are planned on
        first use (one collective metadata exchange per stage, every rank in the same order),
        before any data moves."""
        if self.config.comm_backend != "hier" or self.group is None:
            return None
        if self._hier is None:
            from magi_comm.hierarchical import shared_collectives

            ng = self.node_groups
            hc = (shared_collectives(self.group, self.config.ranks_per_node) if ng is None
                  else shared_collectives(self.group, ng.ranks_per_node, (ng.intra, ng.inter)))
            plans = [hc.cast_plan(p.input_split_sizes, p.dst_indices, p.output_split_sizes, p.src_index, kv.device)
                     for p in self.cast_plans]
            self._hier = (hc, plans)
        return self._hier

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
            merged = SliceArgs.build(c.merged(self.shard_seqlen), c.host_area + sum(c.stage_areas))
            self._slice_args = (host, stages, merged)
        return self._slice_args
