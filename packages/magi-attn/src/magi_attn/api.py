"""Top-level API: build a key for a mask, dispatch tokens, run attention, undispatch."""

from __future__ import annotations

import atexit
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from magi_comm import all_gather_rows, clear_shared_collectives
from magi_kernels import (
    apply_sink,
    check_qkv,
    check_scale_softcap,
    check_sink,
    clear_caches,
    common_head_dim,
    max_logits_of,
    new_row_max,
    on_device,
    pad_head_dim,
    resolve_backend,
)
from magi_solver import KV_PLACEMENTS, AttnMaskType, AttnRange, AttnSlice, DistAttnPlan, solve_dispatch, varlen_slices

from .agreement import Field, check_agreement, config_fields, digest, group_field, labelled
from .checks import check_group_alive, check_not_an_uninitialized_launch, cu_seqlens_list
from .config import DistAttnConfig
from .cp_mesh import CPGroup, NodeGroups, clear_resolved_meshes, resolve_cp_group
from .dist_attn import DistAttnFunction
from .runtime import DistAttnRuntime, RowPlacement

logger = logging.getLogger(__name__)

_CACHE_SIZE = 64
_RUNTIMES: "OrderedDict[tuple, DistAttnRuntime]" = OrderedDict()
_MOST_RECENT: dict[int, "DistAttnKey"] = {}

SliceTuple = tuple[int, int, int, int, int]
KV_SIDES = ("self", *KV_PLACEMENTS)  # where a key's K/V rows live: with the queries, or a cross key's placement


@dataclass(frozen=True)
class DistAttnKey:
    """Hashable handle of one mask's plan on one CP group (the runtime is cached behind it).

    ``placement``: the mask whose balance placed the tokens (``config.dispatch`` chunks it), when
    that is another key's (see :func:`magi_attn_flex_key_for_new_mask`); None when the tokens are
    placed for ``slices`` themselves. Keys of equal slices over different placements differ.
    ``node_groups``: the nodes of a 2-D ``cp_group`` mesh, for ``comm_backend="hier"``."""

    slices: tuple[SliceTuple, ...]
    total_seqlen: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    cp_size: int
    cp_rank: int
    config: DistAttnConfig
    group: Any = field(default=None, compare=False, hash=False, repr=False)
    placement: tuple[SliceTuple, ...] | None = None
    node_groups: NodeGroups | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def runtime(self) -> DistAttnRuntime:
        return _get_runtime(self)

    @property
    def shard_seqlen(self) -> int:
        """Tokens this rank holds after :func:`dispatch` (ranks may hold different counts)."""
        return self.runtime.shard_seqlen

    @property
    def placement_slices(self) -> tuple[SliceTuple, ...]:
        """The mask the token placement was balanced for (``placement``, else ``slices``)."""
        return self.slices if self.placement is None else self.placement

    @property
    def is_cross(self) -> bool:
        """Whether queries and keys come from different sequences (see ``magi_attn.cross``)."""
        return False

    def _new_runtime(self) -> DistAttnRuntime:
        return DistAttnRuntime(_plan(self), self.cp_rank, self.group, self.config, self.node_groups)

    def _kv_fields(self) -> list[Field]:
        """The K/V side's agreement fields; every key has them, so that a rank holding a
        cross-attention key and one holding a self-attention key compare field by field."""
        return [labelled("kv_placement", "self", KV_SIDES), Field("total_seqlen_k", self.total_seqlen)]


def _cache_id(key: DistAttnKey) -> tuple:
    return (key, id(key.group), id(key.node_groups))


def _get_runtime(key: DistAttnKey) -> DistAttnRuntime:
    cid = _cache_id(key)
    rt = _RUNTIMES.get(cid)
    if rt is None:
        rt = key._new_runtime()
        _RUNTIMES[cid] = rt
        while len(_RUNTIMES) > _CACHE_SIZE:
            _RUNTIMES.popitem(last=False)
    else:
        _RUNTIMES.move_to_end(cid)
    return rt


def _attn_slices(tuples: Sequence[SliceTuple]) -> list[AttnSlice]:
    return [AttnSlice(AttnRange(a, b), AttnRange(c, d), AttnMaskType(t)) for a, b, c, d, t in tuples]


def _plan(key: DistAttnKey) -> DistAttnPlan:
    """The plan of ``key``: its tokens placed for ``key.placement_slices``, its mask ``key.slices``."""
    sizes = {"num_heads_q": key.num_heads_q, "num_heads_kv": key.num_heads_kv, "head_dim": key.head_dim,
             "overlap_config": key.config.overlap}
    slices = _attn_slices(key.slices)
    if key.placement is None:
        return DistAttnPlan(slices, key.total_seqlen, key.cp_size, dispatch_config=key.config.dispatch, **sizes)
    placed = solve_dispatch(_attn_slices(key.placement), key.total_seqlen, key.cp_size, key.config.dispatch)
    return DistAttnPlan(slices, key.total_seqlen, key.cp_size, dispatch=placed, **sizes)


def clear_cache() -> None:
    """Drop every cached plan, runtime and collective, and the process groups they hold. Also
    runs at interpreter exit: a used gloo group kept alive past ``destroy_process_group`` by these
    caches can make the exit abort ("terminate called without an active exception")."""
    _RUNTIMES.clear()
    _MOST_RECENT.clear()
    clear_shared_collectives()
    clear_caches()  # the kernels' plans and tables
    clear_resolved_meshes()


atexit.register(clear_cache)


def _group_info(cp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, rank) of a resolved cp_group (see :func:`resolve_cp_group`)."""
    if cp_group is None:
        check_not_an_uninitialized_launch()
        return 1, 0
    if not dist.is_initialized():
        raise RuntimeError("cp_group was given but torch.distributed is not initialized; call init_process_group first")
    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def _as_slices(q_ranges: Any, k_ranges: Any, attn_mask_type: Any) -> list[AttnSlice]:
    def rng(r):
        return r if isinstance(r, AttnRange) else AttnRange(int(r[0]), int(r[1]))

    qs, ks = [rng(r) for r in q_ranges], [rng(r) for r in k_ranges]
    if len(qs) != len(ks):
        raise ValueError(f"q_ranges has {len(qs)} entries but k_ranges has {len(ks)}; they must match")
    if isinstance(attn_mask_type, (str, int, AttnMaskType)):
        types = [AttnMaskType.parse(attn_mask_type)] * len(qs)
    else:
        types = [AttnMaskType.parse(t) for t in attn_mask_type]
        if len(types) != len(qs):
            raise ValueError(f"attn_mask_type has {len(types)} entries but there are {len(qs)} slices")
    return [AttnSlice(q, k, t) for q, k, t in zip(qs, ks, types)]


def magi_attn_flex_key(
    q_ranges: Sequence,
    k_ranges: Sequence,
    attn_mask_type: Any,
    total_seqlen_q: int,
    total_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group: CPGroup = None,
    dist_attn_config: DistAttnConfig = DistAttnConfig(),
) -> DistAttnKey:
    """Plan distributed attention for an arbitrary mask given as slices in global coordinates.

    ``cp_group``: a process group, a ``DeviceMesh`` (1-D; or 2-D with dims named ``"inter"``
    and ``"intra"``: nodes and the ranks of a node, whose groups ``comm_backend="hier"`` then
    uses), or None for a single rank (no communication, no process group needed). The plan is
    built (and cached) on first use; every rank of the group builds the same plan.

    ``total_seqlen_q != total_seqlen_k`` is cross-attention: this returns
    :func:`magi_attn.magi_attn_cross_key` of the same arguments (``kv_placement="auto"``).
    """
    if total_seqlen_q != total_seqlen_k:
        from .cross import magi_attn_cross_key  # cross.py builds on this module

        return magi_attn_cross_key(q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k, num_heads_q,
                                   num_heads_kv, head_dim, cp_group, dist_attn_config=dist_attn_config)
    _check_key_args(num_heads_q, num_heads_kv, head_dim, dist_attn_config)
    slices = _as_slices(q_ranges, k_ranges, attn_mask_type)
    group, node_groups = resolve_cp_group(cp_group)
    cp_size, cp_rank = _group_info(group)
    return _make_key(DistAttnKey(
        tuple(s.to_tuple() for s in slices), int(total_seqlen_q), num_heads_q, num_heads_kv, head_dim,
        cp_size, cp_rank, dist_attn_config, group, node_groups=node_groups,
    ))


def _check_key_args(num_heads_q: int, num_heads_kv: int, head_dim: int, dist_attn_config: DistAttnConfig) -> None:
    for name, val in (("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q={num_heads_q} must be a multiple of num_heads_kv={num_heads_kv}")
    if not isinstance(dist_attn_config, DistAttnConfig):
        raise TypeError(f"dist_attn_config must be a DistAttnConfig, got {type(dist_attn_config).__name__}")


def _make_key(key: DistAttnKey, most_recent: bool = True) -> DistAttnKey:
    """Plan ``key`` now (validation errors surface here, not inside the model), check that every
    rank of its group holds the same key, and (``most_recent``) make it the group's most recent."""
    ng, rpn = key.node_groups, key.config.ranks_per_node
    if ng is not None and key.config.comm_backend == "hier" and rpn not in (None, ng.ranks_per_node):
        raise ValueError(f"dist_attn_config.ranks_per_node={rpn} disagrees with the cp_group mesh, whose 'intra' dim "
                         f"has {ng.ranks_per_node} ranks; leave ranks_per_node=None with a 2-D mesh (its dims say "
                         "where the nodes are)")
    _get_runtime(key)
    if key.cp_size > 1:
        check_agreement(_key_fields(key), key.group, key.config.comm_timeout_s, _KEY_CHECK)
    if most_recent:
        _MOST_RECENT[id(key.group)] = key
    return key


_KEY_CHECK = ("key (mask, placement, sizes, heads, head dim, config); every rank of cp_group must create it, and "
              "a rank that passed cp_group=None or skipped the call leaves the others waiting")
_CALL_CHECK = "calc_attn call (dtype, device, softmax_scale, softcap, kernel backend, autograd, v head dim, sink)"
_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _key_fields(key: DistAttnKey) -> list[Field]:
    """What every rank of the group must agree on for one key (one all-gather of int64s)."""
    return [
        Field("cp size", key.cp_size), Field("total_seqlen", key.total_seqlen),
        Field("num_heads_q", key.num_heads_q), Field("num_heads_kv", key.num_heads_kv), Field("head_dim", key.head_dim),
        Field("number of mask slices", len(key.slices)), Field("mask slices", digest(key.slices), digest=True),
        Field("dispatch placement (the base key's mask, for a new-mask key)", digest(key.placement), digest=True),
        *key._kv_fields(), *config_fields("dist_attn_config", key.config), group_field(key.group),
    ]


def _check_call(rt: DistAttnRuntime, q: torch.Tensor, scale: float, softcap: float, backend: str,
                needs_grad: bool, value_head_dim: int, sink_shape: tuple[int, ...] | None,
                max_logits: bool = False) -> None:
    """Agree across ranks on what a calc_attn call runs with; checked on the first call and again
    whenever a value changes (in a correct program every rank changes it in the same call)."""
    call = (q.dtype, q.device.type, scale, softcap, backend, needs_grad, value_head_dim, sink_shape, max_logits)
    if rt.group is None or rt.plan.cp_size == 1 or rt.agreed_call == call:
        return
    fields = [
        labelled("dtype", str(q.dtype).removeprefix("torch."), _DTYPES), labelled("device", q.device.type, ("cpu", "cuda")),
        Field("softmax_scale", digest(scale), digest=True), Field("softcap", digest(softcap), digest=True),
        Field("kernel backend", digest(backend), digest=True),
        labelled("autograd (a backward will run)", str(needs_grad), ("False", "True")),
        Field("v head_dim", value_head_dim), Field("sink (shape, or none)", digest(sink_shape), digest=True),
        labelled("return_max_logits (an all-gather follows)", str(max_logits), ("False", "True")),
    ]
    check_agreement(fields, rt.group, rt.config.comm_timeout_s, _CALL_CHECK)
    rt.agreed_call = call


def magi_attn_varlen_key(
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group: CPGroup = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    dist_attn_config: DistAttnConfig = DistAttnConfig(),
) -> DistAttnKey:
    """Key for packed documents given by ``cu_seqlens`` (full, causal or sliding window)."""
    slices, total_q, total_k = _varlen_mask(cu_seqlens_q, cu_seqlens_k, causal, window_size)
    return magi_attn_flex_key(
        [s.q_range for s in slices], [s.k_range for s in slices], [s.mask_type for s in slices],
        total_q, total_k, num_heads_q, num_heads_kv, head_dim, cp_group, dist_attn_config,
    )


def _varlen_mask(cu_seqlens_q: Sequence[int], cu_seqlens_k: Sequence[int], causal: bool,
                 window_size: tuple[int, int]) -> tuple[list[AttnSlice], int, int]:
    """(slices, total_seqlen_q, total_seqlen_k) of packed documents; checks cu_seqlens and window_size."""
    cu_q, cu_k = cu_seqlens_list(cu_seqlens_q, "cu_seqlens_q"), cu_seqlens_list(cu_seqlens_k, "cu_seqlens_k")
    slices = varlen_slices(cu_q, cu_k, causal=causal, window_size=window_size)
    return slices, cu_q[-1], cu_k[-1]


def magi_attn_flex_key_for_new_mask(
    base_key: DistAttnKey,
    q_ranges: Sequence,
    k_ranges: Sequence,
    attn_mask_type: Any,
    dist_attn_config: DistAttnConfig | None = None,
) -> DistAttnKey:
    """A key for another mask over the tokens as ``base_key`` placed them: several masks (full,
    sliding window, chunked, ...) in one model share one :func:`dispatch` of the activations.

    ``dispatch``, ``undispatch`` and ``get_position_ids`` give the same rows for the new key as
    for ``base_key``; :func:`calc_attn` with it runs the new mask (slices as in
    :func:`magi_attn_flex_key`, within ``base_key``'s sequence) with its own KV communication and
    overlap stages. Nothing is re-balanced: the placement balances the base mask, and the new
    one gets whatever balance that gives it (``key.runtime.plan.summary()["imbalance"]``).

    The sequence length, heads, head dim and CP group are ``base_key``'s. ``dist_attn_config``
    (default: ``base_key.config``) may change overlap, kernel and communication settings, but its
    ``dispatch`` must equal ``base_key.config.dispatch``: the placement is the base's. A key made
    from a new-mask key keeps the original placement. Collective over the group, like
    :func:`magi_attn_flex_key`: every rank must pass the same base key and mask.
    """
    fn = "magi_attn_flex_key_for_new_mask"
    _check_key(base_key, fn, "base_key")
    _check_self_attention(base_key, fn)
    return _new_mask_key(base_key, _as_slices(q_ranges, k_ranges, attn_mask_type), dist_attn_config, fn)


def magi_attn_varlen_key_for_new_mask(
    base_key: DistAttnKey,
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    dist_attn_config: DistAttnConfig | None = None,
) -> DistAttnKey:
    """:func:`magi_attn_flex_key_for_new_mask` for packed documents (full, causal or sliding
    window, as in :func:`magi_attn_varlen_key`); the documents must cover ``base_key``'s sequence."""
    fn = "magi_attn_varlen_key_for_new_mask"
    _check_key(base_key, fn, "base_key")
    _check_self_attention(base_key, fn)
    slices, total_q, total_k = _varlen_mask(cu_seqlens_q, cu_seqlens_k, causal, window_size)
    for name, total in (("cu_seqlens_q", total_q), ("cu_seqlens_k", total_k)):
        if total != base_key.total_seqlen:
            raise ValueError(f"{fn}: {name} ends at {total} but base_key's sequence has total_seqlen="
                             f"{base_key.total_seqlen} tokens; a new mask covers the base key's sequence, so "
                             f"{name}[-1] must be {base_key.total_seqlen}")
    return _new_mask_key(base_key, slices, dist_attn_config, fn)


def make_flex_key_for_new_mask_after_dispatch(
    q_ranges: Sequence,
    k_ranges: Sequence,
    attn_mask_type: Any,
    key_for_dispatch: DistAttnKey,
    dist_attn_config: DistAttnConfig | None = None,
) -> DistAttnKey:
    """MagiAttention's name and argument order for :func:`magi_attn_flex_key_for_new_mask`."""
    return magi_attn_flex_key_for_new_mask(key_for_dispatch, q_ranges, k_ranges, attn_mask_type, dist_attn_config)


def make_varlen_key_for_new_mask_after_dispatch(
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    key_for_dispatch: DistAttnKey,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    dist_attn_config: DistAttnConfig | None = None,
) -> DistAttnKey:
    """MagiAttention's name and argument order for :func:`magi_attn_varlen_key_for_new_mask`."""
    return magi_attn_varlen_key_for_new_mask(key_for_dispatch, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                             window_size=window_size, dist_attn_config=dist_attn_config)


def _new_mask_config(base_key: DistAttnKey, config: DistAttnConfig | None, fn: str) -> DistAttnConfig:
    if config is None:
        return base_key.config
    if not isinstance(config, DistAttnConfig):
        raise TypeError(f"{fn}: dist_attn_config must be a DistAttnConfig or None, got {type(config).__name__}")
    if config.dispatch != base_key.config.dispatch:
        raise ValueError(
            f"{fn}: dist_attn_config.dispatch={config.dispatch} differs from base_key's {base_key.config.dispatch}; "
            "a new-mask key keeps the base key's placement, so pass "
            "dataclasses.replace(base_key.config, overlap=...) (or dist_attn_config=None for the base's config)")
    return config


def _new_mask_key(base_key: DistAttnKey, slices: list[AttnSlice], config: DistAttnConfig | None,
                  fn: str) -> DistAttnKey:
    config = _new_mask_config(base_key, config, fn)
    total = base_key.total_seqlen
    for i, s in enumerate(slices):
        for name, r in (("q_ranges", s.q_range), ("k_ranges", s.k_range)):
            if r.end > total:
                raise ValueError(f"{fn}: {name}[{i}]={r} ends past base_key's total_seqlen={total}; "
                                 "a new mask must lie within the base key's sequence")
    tuples = tuple(s.to_tuple() for s in slices)
    placement = base_key.placement_slices
    return _make_key(DistAttnKey(
        tuples, total, base_key.num_heads_q, base_key.num_heads_kv, base_key.head_dim,
        base_key.cp_size, base_key.cp_rank, config, base_key.group,
        None if tuples == placement else placement,  # the base's own mask: a plain key of the same plan
        node_groups=base_key.node_groups,
    ))


def get_most_recent_key(cp_group: CPGroup = None) -> DistAttnKey:
    """The last key made for ``cp_group`` (a process group, a DeviceMesh or None)."""
    group, _ = resolve_cp_group(cp_group)
    if id(group) not in _MOST_RECENT:
        raise KeyError("no key was made for this cp_group yet; call magi_attn_flex_key / magi_attn_varlen_key first")
    return _MOST_RECENT[id(group)]


def _check_key(key: object, fn: str, name: str = "key") -> None:
    """``key`` is a :class:`DistAttnKey` whose process group is still the one it was planned for."""
    if not isinstance(key, DistAttnKey):
        raise TypeError(f"{fn}: {name} must be a DistAttnKey from magi_attn_flex_key / magi_attn_varlen_key, "
                        f"got {type(key).__name__}")
    check_group_alive(key.group, key.cp_size, key.cp_rank)


def _check_self_attention(base_key: DistAttnKey, fn: str) -> None:
    if base_key.is_cross:
        raise NotImplementedError(f"{fn}: base_key is a cross-attention key; a new mask over its dispatch is not "
                                  "supported: build another magi_attn_cross_key for the other mask")


def get_position_ids(key: DistAttnKey) -> torch.Tensor:
    """Global positions of this rank's dispatched tokens (for RoPE)."""
    return key.runtime.position_ids.clone()


class _Dispatch(torch.autograd.Function):
    """This rank's rows of a global tensor, placed by ``rows`` (the query side, ``rt.rows``, or a
    cross key's K/V side); ``rt`` gives the rank and group."""

    @staticmethod
    def forward(ctx, x, rows: RowPlacement, rt: DistAttnRuntime):
        ctx.rows, ctx.rt = rows, rt
        return x.index_select(0, on_device(rows.rank_rows[rt.rank], x.device))

    @staticmethod
    def backward(ctx, grad):
        return _gather_unpermute(grad.contiguous(), ctx.rows, ctx.rt), None, None


def _gather_unpermute(x_local: torch.Tensor, rows: RowPlacement, rt: DistAttnRuntime) -> torch.Tensor:
    """Every rank's shard, in global order. Shards may differ in length: each is sent padded to
    the largest one (at most one chunk more) and the padding rows are dropped on arrival."""
    pad = rows.gather_rows - x_local.shape[0]
    if pad and rt.cp_size > 1:
        x_local = torch.cat([x_local, x_local.new_zeros((pad, *x_local.shape[1:]))])
    gathered = all_gather_rows(x_local, rt.group, rt.config.comm_timeout_s, "all-gather of dispatched rows")
    return gathered.index_select(0, on_device(rows.gather_index, x_local.device))


class _Undispatch(torch.autograd.Function):
    """Inverse of :class:`_Dispatch`."""

    @staticmethod
    def forward(ctx, x_local, rows: RowPlacement, rt: DistAttnRuntime):
        ctx.rows, ctx.rt = rows, rt
        return _gather_unpermute(x_local.contiguous(), rows, rt)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, on_device(ctx.rows.rank_rows[ctx.rt.rank], grad.device)), None, None


def dispatch(x: torch.Tensor, key: DistAttnKey) -> torch.Tensor:
    """This rank's tokens of a global sequence-major tensor ``[total_seqlen, ...]`` (the same on
    every rank), permuted as planned: ``[key.shard_seqlen, ...]``, where ranks may hold different
    token counts (no padding). Backward all-gathers the gradient."""
    _check_key(key, "dispatch")
    if x.shape[0] != key.total_seqlen:
        hint = (" (the query side of a cross-attention key; K/V-side tensors go through dispatch_kv)"
                if key.is_cross else "")
        raise ValueError(f"dispatch expects {key.total_seqlen} rows (total_seqlen){hint}, got {x.shape[0]}")
    rt = key.runtime
    return _Dispatch.apply(x, rt.rows, rt)


def undispatch(x_local: torch.Tensor, key: DistAttnKey) -> torch.Tensor:
    """Inverse of :func:`dispatch`: gather every rank's shard and restore global order."""
    _check_key(key, "undispatch")
    rt = key.runtime
    if x_local.shape[0] != rt.shard_seqlen:
        raise ValueError(f"undispatch expects {rt.shard_seqlen} local rows (this rank's shard_seqlen), "
                         f"got {x_local.shape[0]}")
    return _Undispatch.apply(x_local, rt.rows, rt)


def calc_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: DistAttnKey,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distributed attention on dispatched ``q [shard, hq, d]``, ``k [shard, hk, d]`` and
    ``v [shard, hk, dv]`` (``dv != d``, as in MLA, runs zero-padded to the wider head dim: exact,
    at the padded cost; see ``magi_kernels.head_features``).

    ``sink``: learnable attention sinks, ``[hq]`` (or ``[sink_tokens, hq]``) fp32 logits that join
    every row's softmax denominator with no value (GPT-OSS); applied once per row after all
    stages are merged. Replicated parameter: its gradient here covers this rank's rows.

    ``return_max_logits``: also return, per query head, the largest scaled (and softcapped) logit
    over the whole global attention matrix (every rank's rows, every stage), fp32 ``[hq]``, the
    same on every rank (one all-gather of ``hq`` floats per call); for Muon QK-clip. Not
    differentiable; sinks are not logits of q.k and are not included. Eager mode only.

    Returns local ``out [shard, hq, dv]`` (q's dtype) and ``lse`` (fp32; fp64 for fp64 inputs),
    and with ``return_max_logits`` the max logits as a third element.
    Differentiable w.r.t. q, k, v and sink; the backward runs the same multi-stage pipeline with
    GroupReduce of dK/dV.
    """
    _check_key(key, "calc_attn")
    check_qkv(q, k, v)
    check_sink(sink, q)
    rt = key.runtime
    expect_q = (rt.shard_seqlen, key.num_heads_q, key.head_dim)
    expect_k = (rt.kv_shard_seqlen, key.num_heads_kv, key.head_dim)
    if tuple(q.shape) != expect_q:
        raise ValueError(f"q must be [shard_seqlen, num_heads_q, head_dim]={expect_q} for this key, got {tuple(q.shape)}")
    if tuple(k.shape) != expect_k:
        side = "kv_shard_seqlen (dispatch_kv's rows)" if key.is_cross else "shard_seqlen"
        raise ValueError(f"k must be [{side}, num_heads_kv, head_dim]={expect_k} for this key, got {tuple(k.shape)}")
    scale, cap = check_scale_softcap(softmax_scale, softcap, key.head_dim)
    backend = resolve_backend(key.config.kernel_backend, q)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink))
    if not isinstance(return_max_logits, bool):
        raise TypeError(f"return_max_logits must be a bool, got {return_max_logits!r}")
    if return_max_logits and torch.compiler.is_compiling():
        raise NotImplementedError("calc_attn(return_max_logits=True) is not supported inside torch.compile yet; call "
                                  "it eagerly (torch.compiler.disable) or drop it")
    _check_call(rt, q, scale, cap, backend, needs_grad, v.shape[-1], None if sink is None else tuple(sink.shape),
                return_max_logits)
    dv, d = v.shape[-1], common_head_dim(q, v)
    row_max = new_row_max(q) if return_max_logits else None
    out, lse = DistAttnFunction.apply(*(pad_head_dim(t, d) for t in (q, k, v)), rt, scale, cap, backend, row_max)
    if dv != d:
        out = out[..., :dv]
    if sink is not None:
        out, lse = apply_sink(out, lse, sink)
    if row_max is None:
        return out, lse
    return out, lse, _global_max_logits(row_max, rt)


def _global_max_logits(row_max: torch.Tensor, rt: DistAttnRuntime) -> torch.Tensor:
    """Per head, the max over this rank's rows, then over the group's ranks (an all-gather of
    ``hq`` floats: gloo and NCCL both take it, and it fails with magi's timeout)."""
    local = max_logits_of(row_max)
    if rt.group is None or rt.plan.cp_size == 1:
        return local
    return all_gather_rows(local[None], rt.group, rt.config.comm_timeout_s, "max-logits all-gather").amax(dim=0)
