"""Cross-attention under context parallelism: queries and keys/values from different sequences.

Typical use (video tokens attending to text tokens)::

    key = magi_attn_cross_key([(0, Sq)], [(0, Sk)], "full", Sq, Sk, hq, hk, d, cp_group)
    q = dispatch(q_global, key)            # query side: this rank's balanced share of the Sq rows
    k, v = (dispatch_kv(t, key) for t in (k_global, v_global))   # K/V side
    out, lse = calc_attn(q, k, v, key)
    out = undispatch(out, key)             # [Sq, hq, d] in global order

Where the K/V rows live (``kv_placement``; the rule and its costs are in
:mod:`magi_solver.cross_plan`): ``"shard"`` splits them into contiguous shards and
:func:`calc_attn` fetches each rank's missing rows (GroupCast) and reduces their dK/dV to the
owners (GroupReduce); ``"replicate"`` gives every rank all of them and moves nothing; ``"auto"``
replicates K/V no longer than one query shard.

Gradients: ``dispatch``/``dispatch_kv`` take global tensors that are the same on every rank and
their backward returns the full gradient on every rank, as for self-attention. With replicated
K/V, the local dK/dV of :func:`calc_attn` is this rank's queries' share only (so that summing a
K/V projection's weight gradient over the CP ranks, as data parallelism does, counts every
query once); ``dispatch_kv``'s backward sums the shares over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from magi_comm import all_gather_rows
from magi_solver import KV_PLACEMENTS, CrossAttnPlan

from .agreement import Field, labelled
from .api import (
    KV_SIDES,
    DistAttnKey,
    _as_slices,
    _check_key,
    _check_key_args,
    _Dispatch,
    _group_info,
    _make_key,
    _Undispatch,
    _attn_slices,
    _varlen_mask,
    dispatch,
    undispatch,
)
from .config import DistAttnConfig
from .cp_mesh import CPGroup, NodeGroups, resolve_cp_group
from .runtime import DistAttnRuntime, RowPlacement

__all__ = ["CrossAttnKey", "dispatch_kv", "magi_attn_cross_key", "magi_attn_varlen_cross_key", "undispatch_kv"]


class CrossAttnRuntime(DistAttnRuntime):
    """:class:`DistAttnRuntime` of a :class:`magi_solver.CrossAttnPlan`: the inherited query
    fields (``shard_seqlen(s)``, ``rows``, ``position_ids``, ...) are the query side's;
    ``kv_shard_seqlens`` and ``kv_rows`` place the K/V side (``kv_rows`` is None when K/V is
    replicated). Like the query shards, the K/V shards may differ in length between ranks."""

    def __init__(self, plan: CrossAttnPlan, rank: int, group: dist.ProcessGroup | None, config: DistAttnConfig,
                 node_groups: NodeGroups | None = None):
        super().__init__(plan, rank, group, config, node_groups)
        self.total_seqlen_k = plan.total_seqlen_k
        self.kv_replicated = plan.kv_placement == "replicate"
        self.kv_shard_seqlens = plan.kv_shard_seqlens
        self.kv_rows: RowPlacement | None = None if self.kv_replicated else RowPlacement.of(plan.kv_dispatch)


@dataclass(frozen=True)
class CrossAttnKey(DistAttnKey):
    """Key of a cross-attention plan: ``total_seqlen`` is the query sequence's length,
    ``total_seqlen_k`` the key/value sequence's; ``kv_placement`` as requested (the resolved one
    is ``key.runtime.plan.kv_placement``)."""

    total_seqlen_k: int = 0
    kv_placement: str = "auto"

    @property
    def is_cross(self) -> bool:
        return True

    @property
    def runtime(self) -> CrossAttnRuntime:
        return super().runtime  # type: ignore[return-value]

    def _new_runtime(self) -> CrossAttnRuntime:
        plan = CrossAttnPlan(
            _attn_slices(self.slices), self.total_seqlen, self.total_seqlen_k, self.cp_size,
            num_heads_q=self.num_heads_q, num_heads_kv=self.num_heads_kv, head_dim=self.head_dim,
            dispatch_config=self.config.dispatch, overlap_config=self.config.overlap, kv_placement=self.kv_placement)
        return CrossAttnRuntime(plan, self.cp_rank, self.group, self.config, self.node_groups)

    def _kv_fields(self) -> list[Field]:
        return [labelled("kv_placement", self.kv_placement, KV_SIDES), Field("total_seqlen_k", self.total_seqlen_k)]

    @property
    def kv_shard_seqlen(self) -> int:
        """K/V rows of this rank's :func:`dispatch_kv` output (ranks may hold different counts:
        ``key.runtime.kv_shard_seqlens`` has every rank's)."""
        return self.runtime.kv_shard_seqlen


def magi_attn_cross_key(
    q_ranges: Sequence,
    k_ranges: Sequence,
    attn_mask_type: Any,
    total_seqlen_q: int,
    total_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group: CPGroup = None,
    *,
    kv_placement: str = "auto",
    dist_attn_config: DistAttnConfig = DistAttnConfig(),
) -> CrossAttnKey:
    """Plan cross-attention: queries over ``total_seqlen_q`` rows of one sequence attend to keys
    over ``total_seqlen_k`` rows of another; slices as in :func:`magi_attn_flex_key`, q ranges in
    query rows and k ranges in key rows (either sequence may be the longer; equal lengths are
    fine too: the two are still separate sequences, dispatched separately).

    ``kv_placement``: ``"shard"``, ``"replicate"`` or ``"auto"`` (replicate when
    ``total_seqlen_k`` is at most the largest query shard, ``max(key.runtime.shard_seqlens)``, or
    smaller than ``cp_size``). Query placement follows ``dist_attn_config.dispatch``; the K/V
    side is contiguous shards, unpadded (``key.kv_shard_seqlen`` rows on this rank). ``cp_group``
    as in :func:`magi_attn_flex_key` (a process group, a DeviceMesh or None). Collective
    over ``cp_group`` like :func:`magi_attn_flex_key`; new-mask keys over a cross key are refused.
    A cross key does not become the group's :func:`get_most_recent_key`: that stays the
    self-attention key the model's other layers dispatch with.
    """
    _check_key_args(num_heads_q, num_heads_kv, head_dim, dist_attn_config)
    if kv_placement not in KV_PLACEMENTS:
        raise ValueError(f"kv_placement must be one of {KV_PLACEMENTS}, got {kv_placement!r}")
    for name, n in (("total_seqlen_q", total_seqlen_q), ("total_seqlen_k", total_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    slices = _as_slices(q_ranges, k_ranges, attn_mask_type)
    group, node_groups = resolve_cp_group(cp_group)
    cp_size, cp_rank = _group_info(group)
    return _make_key(CrossAttnKey(  # type: ignore[return-value]
        tuple(s.to_tuple() for s in slices), total_seqlen_q, num_heads_q, num_heads_kv, head_dim,
        cp_size, cp_rank, dist_attn_config, group,
        node_groups=node_groups, total_seqlen_k=total_seqlen_k, kv_placement=kv_placement,
    ), most_recent=False)


def magi_attn_varlen_cross_key(
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group: CPGroup = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    kv_placement: str = "auto",
    dist_attn_config: DistAttnConfig = DistAttnConfig(),
) -> CrossAttnKey:
    """:func:`magi_attn_cross_key` for pairs of documents: query document i (``cu_seqlens_q``)
    attends to key document i (``cu_seqlens_k``); ``causal`` and ``window_size`` as in
    :func:`magi_attn_varlen_key`."""
    slices, total_q, total_k = _varlen_mask(cu_seqlens_q, cu_seqlens_k, causal, window_size)
    return magi_attn_cross_key(
        [s.q_range for s in slices], [s.k_range for s in slices], [s.mask_type for s in slices], total_q, total_k,
        num_heads_q, num_heads_kv, head_dim, cp_group, kv_placement=kv_placement, dist_attn_config=dist_attn_config)


class _ReplicatedDispatch(torch.autograd.Function):
    """Every rank keeps all K/V rows; the backward sums the ranks' gradients (each holds its
    queries' share), so the global tensor gets the full gradient on every rank."""

    @staticmethod
    def forward(ctx, x, rt: CrossAttnRuntime):
        ctx.rt = rt
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        rt = ctx.rt
        if rt.plan.cp_size == 1:
            return grad, None
        parts = all_gather_rows(grad.contiguous(), rt.group, rt.config.comm_timeout_s, "all-gather of replicated dK/dV")
        return parts.view(rt.plan.cp_size, *grad.shape).sum(0), None


class _ReplicatedUndispatch(torch.autograd.Function):
    """Inverse of :class:`_ReplicatedDispatch`: the rows are the same on every rank; the
    backward gives each rank ``1 / cp_size`` of the gradient, so that the dispatch's sum over
    ranks restores it once."""

    @staticmethod
    def forward(ctx, x_local, rt: CrossAttnRuntime):
        ctx.cp_size = rt.plan.cp_size
        return x_local.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.cp_size, None


def _cross_runtime(key: DistAttnKey, fn: str) -> CrossAttnRuntime | None:
    _check_key(key, fn)
    return key.runtime if key.is_cross else None  # type: ignore[return-value]


def dispatch_kv(x: torch.Tensor, key: DistAttnKey) -> torch.Tensor:
    """This rank's K/V-side rows of a global ``[total_seqlen_k, ...]`` tensor (the same on every
    rank): its contiguous shard, ``[key.kv_shard_seqlen, ...]`` with no padding (ranks may hold
    different counts), or all of it when K/V is replicated. Use it for the key/value sequence's
    tensors (or the activations they are projected from) of a cross key; the query side goes
    through :func:`dispatch`. For a self-attention key this is :func:`dispatch`. Backward: the
    full gradient of ``x`` on every rank."""
    rt = _cross_runtime(key, "dispatch_kv")
    if rt is None:
        return dispatch(x, key)
    if x.shape[0] != rt.total_seqlen_k:
        raise ValueError(f"dispatch_kv expects {rt.total_seqlen_k} rows (total_seqlen_k, the key/value sequence), "
                         f"got {x.shape[0]}; query-side tensors ({key.total_seqlen} rows) go through dispatch")
    if rt.kv_rows is None:
        return _ReplicatedDispatch.apply(x, rt)
    return _Dispatch.apply(x, rt.kv_rows, rt)


def undispatch_kv(x_local: torch.Tensor, key: DistAttnKey) -> torch.Tensor:
    """Inverse of :func:`dispatch_kv`: the global ``[total_seqlen_k, ...]`` tensor (unpadded).
    For a self-attention key this is :func:`undispatch`."""
    rt = _cross_runtime(key, "undispatch_kv")
    if rt is None:
        return undispatch(x_local, key)
    if x_local.shape[0] != rt.kv_shard_seqlen:
        raise ValueError(f"undispatch_kv expects {rt.kv_shard_seqlen} local rows (this rank's kv_shard_seqlen), got "
                         f"{x_local.shape[0]}; query-side tensors ({rt.shard_seqlen} rows) go through undispatch")
    if rt.kv_rows is None:
        return _ReplicatedUndispatch.apply(x_local, rt)
    return _Undispatch.apply(x_local, rt.kv_rows, rt)


def get_kv_position_ids(key: DistAttnKey) -> torch.Tensor:
    """Global positions of this rank's K/V rows (for RoPE on the key sequence). For a
    self-attention key these are the query positions."""
    rt = _cross_runtime(key, "get_kv_position_ids")
    if rt is None:
        return key.runtime.position_ids.clone()
    return torch.arange(rt.total_seqlen_k) if rt.kv_rows is None else rt.kv_rows.rank_rows[rt.rank].clone()
