"""``roll`` on dispatched tensors: the global sequence rolled along its tokens, without undispatching.

Multi-token prediction trains on labels shifted by k tokens. On dispatched tensors each rank
holds scattered chunks of the sequence, so the shifted token of a local row usually lives on
another rank. ``roll`` moves exactly those rows: every rank derives the same plan from the key
(which rank holds each global token, at which local row), sends each of its rows to the one
rank that needs it (a GroupCast), and the backward sends the gradient rows back the same way.
Ranks may hold different token counts (the dispatch does not pad).
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from functools import lru_cache

import torch

from magi_comm import group_cast

from .runtime import DistAttnRuntime


@dataclass(frozen=True)
class _RollPlan:
    """One rank's side of a roll: rows it sends to each rank, and the local rows its receipts fill."""

    send_rows: torch.Tensor  # local rows to send, grouped by destination rank (in rank order)
    send_counts: tuple[int, ...]
    recv_rows: torch.Tensor  # local rows the received rows land at, grouped by source rank
    recv_counts: tuple[int, ...]


@lru_cache(maxsize=64)
def _plan(rt: DistAttnRuntime, shifts: int) -> _RollPlan:
    world, total = rt.plan.dispatch.cp_size, rt.total_seqlen
    rank_rows = [rows.tolist() for rows in rt.rows.rank_rows]  # local row -> global row, per rank
    where = {g: (r, i) for r, rows in enumerate(rank_rows) for i, g in enumerate(rows)}  # global -> (rank, row)
    me = rt.rank
    sends: list[list[int]] = [[] for _ in range(world)]
    recvs: list[list[int]] = [[] for _ in range(world)]
    for dst, rows in enumerate(rank_rows):  # every rank walks the same order, so both sides agree on it
        for dst_row, g in enumerate(rows):
            src, src_row = where[(g - shifts) % total]
            if src == me:
                sends[dst].append(src_row)
            if dst == me:
                recvs[src].append(dst_row)
    flat = lambda rows: torch.tensor([r for part in rows for r in part], dtype=torch.long)  # noqa: E731
    return _RollPlan(flat(sends), tuple(map(len, sends)), flat(recvs), tuple(map(len, recvs)))


atexit.register(_plan.cache_clear)  # plans hold runtimes and their groups: drop them before the teardown


def _move(x: torch.Tensor, rt: DistAttnRuntime, rows_out: torch.Tensor, counts_out: tuple[int, ...],
          rows_in: torch.Tensor, counts_in: tuple[int, ...]) -> torch.Tensor:
    """Send ``x[rows_out]`` (``counts_out[d]`` rows to rank d) and place what arrives at ``rows_in``."""
    world = len(counts_out)
    sent = x.index_select(0, rows_out.to(x.device))
    got = group_cast(sent, input_split_sizes=counts_out, output_split_sizes=counts_in,
                     dst_indices=[[d] for d in range(world)], src_index=list(range(world)), group=rt.group,
                     timeout_s=rt.config.comm_timeout_s)
    return torch.zeros_like(x).index_copy_(0, rows_in.to(x.device), got)


class _Roll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rt: DistAttnRuntime, shifts: int) -> torch.Tensor:
        ctx.rt, ctx.plan = rt, _plan(rt, shifts)
        p = ctx.plan
        return _move(x, rt, p.send_rows, p.send_counts, p.recv_rows, p.recv_counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p = ctx.plan  # the transpose: each gradient row goes back to the row it came from
        return _move(grad.contiguous(), ctx.rt, p.recv_rows, p.recv_counts, p.send_rows, p.send_counts), None, None


def roll(x: torch.Tensor, shifts: int, key) -> torch.Tensor:
    """``dispatch(torch.roll(global_x, shifts, dims=0), key)`` computed from this rank's
    dispatched ``x [shard_seqlen, ...]`` alone (every rank of the key's group calls it).

    The roll wraps around the sequence of ``total_seqlen`` tokens. Differentiable. For multi-token
    prediction, ``roll(labels, -k, key)`` gives each local token the label k tokens ahead (mask the
    wrapped-around ones, as with torch.roll).
    """
    from .api import _check_key  # the key checks every API entry point runs

    _check_key(key, "roll")
    rt = key.runtime
    if not isinstance(shifts, int) or isinstance(shifts, bool):
        raise TypeError(f"roll: shifts must be an int (tokens along the sequence), got {shifts!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != rt.shard_seqlen:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"roll: x must be a dispatched tensor [shard_seqlen={rt.shard_seqlen} (this rank's), ...], "
                         f"got {shape}")
    return _Roll.apply(x.contiguous(), rt, shifts % max(rt.total_seqlen, 1))
