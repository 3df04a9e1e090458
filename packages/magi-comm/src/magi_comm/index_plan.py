"""Row-level plans of group collectives, built on the host (no communication).

A GroupCast / GroupReduce is given at split level (sizes, destination and source ranks). Here it
becomes, for one rank, the row indices to gather before an all-to-all and the rows the received
data lands on after it (:class:`A2AIndexPlan`), cached per argument set. The execution modules
(:mod:`magi_comm.group_collective`, :mod:`magi_comm.hierarchical`, :mod:`magi_comm.ipc`) run them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from . import native


@dataclass(frozen=True)
class A2AIndexPlan:
    """Row-level form of a group collective for one rank.

    ``send_rows`` (grouped by destination rank, in rank order) are gathered from the input and
    sent with ``send_counts``; received rows (grouped by source) land at ``recv_rows`` of the
    output. ``recv_rows`` may repeat (reduce)."""

    send_rows: torch.Tensor
    send_counts: tuple[int, ...]
    recv_rows: torch.Tensor
    recv_counts: tuple[int, ...]

    def transposed(self) -> "A2AIndexPlan":
        """The plan that moves the same rows back (sender and receiver swap roles)."""
        return A2AIndexPlan(self.recv_rows, self.recv_counts, self.send_rows, self.send_counts)


def split_offsets(sizes: Sequence[int]) -> list[int]:
    """Start row of each split."""
    offs, pos = [], 0
    for s in sizes:
        offs.append(pos)
        pos += s
    return offs


def rows_of(pairs: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``(offset, count)`` runs, concatenated (int64)."""
    if not pairs:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(o, o + n, dtype=torch.long) for o, n in pairs])


def check_ranks(ranks: Sequence[int], world: int, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` when a rank is outside ``[0, world)``."""
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"{name} names rank {r}, but the group has {world} ranks")


@functools.lru_cache(maxsize=4096)
def cast_index_plan(
    input_split_sizes: tuple[int, ...],
    dst_indices: tuple[tuple[int, ...], ...],
    output_split_sizes: tuple[int, ...],
    src_index: tuple[int, ...],
    world: int,
) -> A2AIndexPlan:
    """Row plan of a GroupCast on one rank of ``world`` (arguments as :func:`magi_comm.group_cast`)."""
    if len(input_split_sizes) != len(dst_indices):
        raise ValueError("input_split_sizes and dst_indices must have the same length")
    if len(output_split_sizes) != len(src_index):
        raise ValueError("output_split_sizes and src_index must have the same length")
    for d in dst_indices:
        check_ranks(d, world, "dst_indices")
    check_ranks(src_index, world, "src_index")
    if native.AVAILABLE:  # same construction in C++: planning cost grows with rows
        return A2AIndexPlan(*native.cast_index_rows(input_split_sizes, dst_indices, output_split_sizes, src_index, world))
    return _cast_index_plan_py(input_split_sizes, dst_indices, output_split_sizes, src_index, world)


def _cast_index_plan_py(input_split_sizes, dst_indices, output_split_sizes, src_index, world) -> A2AIndexPlan:
    in_off, out_off = split_offsets(input_split_sizes), split_offsets(output_split_sizes)
    send, send_counts = [], []
    for dst in range(world):
        pairs = [(o, n) for o, n, d in zip(in_off, input_split_sizes, dst_indices) if dst in d and n]
        send.extend(pairs)
        send_counts.append(sum(n for _, n in pairs))
    recv, recv_counts = [], []
    for src in range(world):
        pairs = [(o, n) for o, n, s in zip(out_off, output_split_sizes, src_index) if s == src and n]
        recv.extend(pairs)
        recv_counts.append(sum(n for _, n in pairs))
    return A2AIndexPlan(rows_of(send), tuple(send_counts), rows_of(recv), tuple(recv_counts))


@functools.lru_cache(maxsize=4096)
def reduce_index_plan(
    input_split_sizes: tuple[int, ...],
    dst_index: tuple[int, ...],
    output_split_sizes: tuple[int, ...],
    src_indices: tuple[tuple[int, ...], ...],
    world: int,
) -> A2AIndexPlan:
    """Row plan of a GroupReduce on one rank (arguments as :func:`magi_comm.group_reduce`)."""
    # the exact transpose of a cast: reuse its construction with the roles swapped
    return cast_index_plan(output_split_sizes, src_indices, input_split_sizes, dst_index, world).transposed()
