"""One interface for the staged KV exchange of distributed attention, whatever moves the rows.

A plan's remote KV arrives in stages; stage ``s`` is one GroupCast (rows of this rank's shard to
the ranks that need them), and its transpose is the GroupReduce that sums the dK/dV partials of
those rows back into their owners. :func:`make_group_collective` builds, once per plan, the
implementation of a transport kind:

* ``"a2a"``: :func:`magi_comm.group_cast` / :func:`magi_comm.group_reduce` over
  ``all_to_all_single`` (gloo or NCCL, any topology);
* ``"ipc"``: CUDA IPC peer writes inside one host (:class:`magi_comm.IpcGroupCollectives`);
* ``"hier"``: node-aware two hops (:class:`magi_comm.HierarchicalCollectives`).

Callers then run ``cast(x, stage)`` and ``reduce(partial, output, stage)``; both return a
:class:`magi_comm.PendingCollective` whose ``wait()`` finishes the transfer and raises
:class:`magi_comm.PeerFailureError` when a peer fails or misses ``timeout_s``.
"""

from __future__ import annotations

import abc
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from .group_collective import PendingCollective, group_cast, group_reduce
from .hierarchical import HierarchicalCollectives, shared_collectives
from .ipc import IpcGroupCollectives
from .two_hop_plan import TwoHopPlan
from .waiting import DEFAULT_TIMEOUT_S

COLLECTIVE_KINDS = ("a2a", "ipc", "hier")

NodeGroupPair = tuple[dist.ProcessGroup, dist.ProcessGroup]  # (intra-node group, inter-node group) of this rank


class CastStage(Protocol):
    """Split-level form of one stage's GroupCast on this rank (a ``magi_solver.GroupCastPlan``
    is one): input split ``i`` goes to every rank of ``dst_indices[i]``; output split ``j``
    comes from rank ``src_index[j]``."""

    @property
    def input_split_sizes(self) -> Sequence[int]: ...

    @property
    def dst_indices(self) -> Sequence[Sequence[int]]: ...

    @property
    def output_split_sizes(self) -> Sequence[int]: ...

    @property
    def src_index(self) -> Sequence[int]: ...


def _cast_args(p: CastStage) -> dict:
    return {"input_split_sizes": p.input_split_sizes, "output_split_sizes": p.output_split_sizes,
            "dst_indices": p.dst_indices, "src_index": p.src_index}


def _reduce_args(p: CastStage) -> dict:
    """The transpose of the cast: partials of the received rows go back to their sources."""
    return {"input_split_sizes": p.output_split_sizes, "output_split_sizes": p.input_split_sizes,
            "dst_index": p.src_index, "src_indices": p.dst_indices}


class GroupCollective(abc.ABC):
    """GroupCast / GroupReduce(sum) of a fixed list of stages over one process group.

    Built once per plan by :func:`make_group_collective`; every rank of ``group`` must call
    ``cast`` and ``reduce`` for the same stages in the same order.
    """

    kind: str

    def __init__(self, stages: Sequence[CastStage], group: dist.ProcessGroup | None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, ordered: bool = False):
        self.stages = tuple(stages)
        self.group = group
        self.timeout_s = timeout_s
        self.ordered = ordered  # reduce in a fixed order: bitwise reproducible (magi_comm.add_rows)

    @abc.abstractmethod
    def cast(self, input: torch.Tensor, stage: int) -> PendingCollective:
        """Start stage ``stage``'s GroupCast of ``input`` (this rank's rows); ``wait()`` returns
        the rows received, in the stage's output order."""

    @abc.abstractmethod
    def reduce(self, partial: torch.Tensor, output: torch.Tensor, stage: int) -> PendingCollective:
        """Start the transpose of stage ``stage``'s cast: ``partial`` (one row per row that cast
        received) is summed into ``output`` of the rows' owners, in place; ``wait()`` returns
        ``output``."""


class AllToAllCollective(GroupCollective):
    """Every stage is one ``all_to_all_single`` (gloo or NCCL), asynchronous."""

    kind = "a2a"

    def cast(self, input: torch.Tensor, stage: int) -> PendingCollective:
        return group_cast(input, group=self.group, async_op=True, timeout_s=self.timeout_s,
                          **_cast_args(self.stages[stage]))

    def reduce(self, partial: torch.Tensor, output: torch.Tensor, stage: int) -> PendingCollective:
        return group_reduce(partial, output, group=self.group, op="sum", async_op=True, timeout_s=self.timeout_s,
                            ordered=self.ordered, **_reduce_args(self.stages[stage]))


class IpcCollective(GroupCollective):
    """CUDA IPC peer writes inside one host. The transfers are synchronous (the handles come
    back finished), and the arena is created on the first call, sized for this plan's largest
    buffer at that call's row width. The IPC reduce adds in float32: a reduce into an output of
    another dtype goes over the all-to-all path instead."""

    kind = "ipc"

    def __init__(self, stages: Sequence[CastStage], group: dist.ProcessGroup | None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, ordered: bool = False):
        super().__init__(stages, group, timeout_s, ordered)
        self._ipc: IpcGroupCollectives | None = None
        self._all_to_all = AllToAllCollective(stages, group, timeout_s, ordered)

    def _collectives(self, x: torch.Tensor) -> IpcGroupCollectives:
        if self._ipc is None:
            # a cast reads this rank's whole shard (x, on the first call) and writes its output; a reduce the reverse
            most = max([x.shape[0]] + [max(sum(p.input_split_sizes), sum(p.output_split_sizes)) for p in self.stages])
            nbytes = most * x[0].numel() * max(x.element_size(), 4) + 256
            self._ipc = IpcGroupCollectives(self.group, nbytes, x.device)
        return self._ipc

    def cast(self, input: torch.Tensor, stage: int) -> PendingCollective:
        out = self._collectives(input).group_cast(input, **_cast_args(self.stages[stage]))
        return PendingCollective.finished(out)

    def reduce(self, partial: torch.Tensor, output: torch.Tensor, stage: int) -> PendingCollective:
        if output.dtype != torch.float32 or self.ordered:  # the IPC reduce adds with atomics, in no fixed order
            return self._all_to_all.reduce(partial, output, stage)
        self._collectives(partial).group_reduce(partial, output, **_reduce_args(self.stages[stage]))
        return PendingCollective.finished(output)


class NodeAwareCollective(GroupCollective):
    """Two hops, inter-node then intra-node (:class:`HierarchicalCollectives`). On the first
    call the node groups are created (or reused) and every stage is planned, one metadata
    exchange per stage on every rank in the same order, before any data moves; a stage's plan
    serves its cast and, transposed, its reduce. The second hop runs inside ``wait()``."""

    kind = "hier"

    def __init__(self, stages: Sequence[CastStage], group: dist.ProcessGroup, ranks_per_node: int | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, ordered: bool = False,
                 node_groups: NodeGroupPair | None = None):
        super().__init__(stages, group, timeout_s, ordered)
        self.ranks_per_node = ranks_per_node
        self.node_groups = node_groups
        self._planned: tuple[HierarchicalCollectives, list[TwoHopPlan]] | None = None

    def _plans(self, x: torch.Tensor) -> tuple[HierarchicalCollectives, list[TwoHopPlan]]:
        if self._planned is None:
            hc = shared_collectives(self.group, self.ranks_per_node, self.node_groups)
            plans = [hc.cast_plan(p.input_split_sizes, p.dst_indices, p.output_split_sizes, p.src_index, x.device)
                     for p in self.stages]
            self._planned = (hc, plans)
        return self._planned

    @property
    def two_hop(self) -> HierarchicalCollectives | None:
        """The two-hop collectives (with their ``intra`` / ``inter`` node groups) once the first
        call has built them, else None."""
        return None if self._planned is None else self._planned[0]

    def cast(self, input: torch.Tensor, stage: int) -> PendingCollective:
        hc, plans = self._plans(input)
        return hc.group_cast(input, async_op=True, plan=plans[stage], timeout_s=self.timeout_s,
                             **_cast_args(self.stages[stage]))

    def reduce(self, partial: torch.Tensor, output: torch.Tensor, stage: int) -> PendingCollective:
        hc, plans = self._plans(partial)
        return hc.group_reduce(partial, output, op="sum", async_op=True, plan=plans[stage],
                               timeout_s=self.timeout_s, ordered=self.ordered, **_reduce_args(self.stages[stage]))


def make_group_collective(
    kind: str,
    stages: Sequence[CastStage],
    group: dist.ProcessGroup | None,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ranks_per_node: int | None = None,
    ordered: bool = False,
    node_groups: NodeGroupPair | None = None,
) -> GroupCollective:
    """The :class:`GroupCollective` of transport ``kind`` (one of :data:`COLLECTIVE_KINDS`) for
    ``stages`` over ``group``. Nothing is communicated here: the IPC arena, the node groups and
    the two-hop plans are made on the first call (collectively). ``ranks_per_node``: node size
    for ``"hier"`` (None: ``LOCAL_WORLD_SIZE`` when set by torchrun, else one node). With no
    process group (``group=None``) there is nothing to route across nodes, so ``"hier"`` runs
    the all-to-all path. ``timeout_s``: see :class:`magi_comm.PendingCollective`. ``ordered``:
    every reduce sums in a fixed order, bitwise reproducible (:func:`magi_comm.add_rows`; with
    ``"ipc"`` the reduce then runs over all-to-all). ``node_groups``: ``(intra, inter)`` process
    groups that already exist (e.g. the two dims of a 2-D ``DeviceMesh``) for ``"hier"`` to use
    instead of creating its own; they must match ``ranks_per_node`` (checked on the first call,
    see :class:`magi_comm.HierarchicalCollectives`). Other kinds do not take them."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown group collective kind {kind!r}; choose one of {COLLECTIVE_KINDS}")
    if node_groups is not None and kind != "hier":
        raise ValueError(f"node_groups are for the node-aware kind 'hier'; kind {kind!r} does not use them (pass "
                         "node_groups=None, or kind='hier')")
    if node_groups is not None and ranks_per_node is None:
        raise ValueError("node_groups need ranks_per_node (the size of the intra-node group) to place group ranks "
                         "on nodes")
    if kind == "ipc":
        return IpcCollective(stages, group, timeout_s, ordered)
    if kind == "hier" and group is not None:
        return NodeAwareCollective(stages, group, ranks_per_node, timeout_s, ordered, node_groups)
    return AllToAllCollective(stages, group, timeout_s, ordered)
