"""Context-parallel baselines on the same kernel, for benchmarks and cross-checks.

* ``ring_allgather_attn``: zigzag sharding (rank r holds chunks r and 2cp-1-r of 2cp), KV
  all-gathered (the Llama-3 / TE "all_gather" CP variant); every rank receives all KV.
* ``ulysses_attn``: contiguous sharding, all-to-all from sequence- to head-sharded, full-sequence
  attention on hq/cp heads, all-to-all back (DeepSpeed-Ulysses).

Both accept any mask as global slices and are differentiable.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from magi_comm import all_gather_rows
from magi_kernels import flex_flash_attn_func
from magi_solver import AttnRange, AttnSlice, local_slices, slice_ranges


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def padded_length(total: int, cp: int, parts_per_rank: int) -> int:
    unit = cp * parts_per_rank
    return math.ceil(total / unit) * unit


def zigzag_ranges(padded: int, cp: int, rank: int) -> list[AttnRange]:
    c = padded // (2 * cp)
    return [AttnRange(rank * c, (rank + 1) * c), AttnRange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def zigzag_dispatch(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rows of ``x`` that ``rank`` holds under zigzag sharding (chunks ``rank`` and ``2cp-1-rank`` of ``2cp``, zero-padded)."""
    xp = _pad_rows(x, padded_length(x.shape[0], cp, 2))
    return torch.cat([xp[r.start:r.end] for r in zigzag_ranges(xp.shape[0], cp, rank)])


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradient over ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        world, rank = _world(ctx.group)
        g = g.contiguous()
        n = g.shape[0] // world
        if dist.get_backend(ctx.group) == "nccl":
            out = g.new_empty((n, *g.shape[1:]))
            dist.reduce_scatter_tensor(out, g, group=ctx.group)
            return out, None
        dist.all_reduce(g, group=ctx.group)  # gloo has no reduce_scatter
        return g[rank * n:(rank + 1) * n], None


def ring_allgather_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slices: Sequence[AttnSlice], total: int,
    group: dist.ProcessGroup, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are zigzag shards (:func:`zigzag_dispatch`); returns this rank's (out, lse)."""
    world, rank = _world(group)
    padded = padded_length(total, world, 2)
    kv = _GatherRows.apply(torch.cat([k, v], dim=1), group)
    hk = k.shape[1]
    k_order = [r for p in range(world) for r in zigzag_ranges(padded, world, p)]
    sl, _ = local_slices(slices, zigzag_ranges(padded, world, rank), k_order)
    return flex_flash_attn_func(q, kv[:, :hk], kv[:, hk:], [s[:2] for s in sl], [s[2:4] for s in sl],
                                [s[4] for s in sl], backend=backend, check_ranges=False)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its transpose (the backward) is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g.contiguous(), group=ctx.group)
        return out, None


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    return _AllToAll.apply(x, group)


def _seq_to_heads(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """[s/cp, h, d] -> [s, h/cp, d]: chunk heads, exchange, stack sequence shards in rank order."""
    s, h, d = x.shape
    send = x.reshape(s, world, h // world, d).transpose(0, 1).reshape(world * s, h // world, d)
    return _a2a(send, group)


def _heads_to_seq(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    S, hl, d = x.shape
    recv = _a2a(x, group)  # [world * s, hl, d], block p = my rows of head group p
    s = S // world
    return recv.reshape(world, s, hl, d).transpose(0, 1).reshape(s, world * hl, d)


def ulysses_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slices: Sequence[AttnSlice], total: int,
    group: dist.ProcessGroup, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are contiguous shards of the padded sequence; needs ``heads_q % cp == 0``. KV
    heads are repeated up to a multiple of cp when there are fewer than cp."""
    world, _ = _world(group)
    hq, hk = q.shape[1], k.shape[1]
    if hq % world:
        raise ValueError(f"Ulysses needs num_heads_q={hq} divisible by cp={world}")
    if hk % world:
        rep = world // math.gcd(hk, world)
        if (hq // hk) % rep:
            raise ValueError(f"Ulysses cannot spread num_heads_kv={hk} over cp={world} with num_heads_q={hq}")
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = (_seq_to_heads(t, world, group) for t in (q, k, v))
    # full sequence per rank: the global slices apply as they are
    out, lse = flex_flash_attn_func(qh, kh, vh, *slice_ranges(slices), backend=backend, check_ranges=False)
    lse_seq = _heads_to_seq(lse.unsqueeze(-1).contiguous(), world, group).squeeze(-1)
    return _heads_to_seq(out, world, group), lse_seq


def contiguous_dispatch(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rows of ``x`` that ``rank`` holds under contiguous sharding (chunk ``rank`` of ``cp``, zero-padded)."""
    xp = _pad_rows(x, padded_length(x.shape[0], cp, 1))
    n = xp.shape[0] // cp
    return xp[rank * n:(rank + 1) * n]


def comm_rows_per_rank(method: str, total: int, cp: int) -> int:
    """KV (or Q/O) rows each rank receives in forward, for the byte accounting of benchmarks."""
    if method == "ring_allgather":
        return padded_length(total, cp, 2) * (cp - 1) // cp  # all KV rows of the others
    if method == "ulysses":
        return padded_length(total, cp, 1) * (cp - 1) // cp  # q, k, v, out: head slices of all rows
    raise ValueError(f"unknown method {method!r}")
