"""GroupCast / GroupReduce plans: which rows of a rank's buffer go to whom, in what order.

GroupCast: input split ``i`` is copied to every rank in ``dst_indices[i]``; output split ``j``
comes from rank ``src_index[j]``; splits from one source arrive in the source's order.
GroupReduce is the exact transpose: split ``i`` goes to ``dst_index[i]``; output split ``j`` is
the sum (or LSE merge) of the partials sent by every rank in ``src_indices[j]``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupCastPlan:
    input_split_sizes: tuple[int, ...]
    dst_indices: tuple[tuple[int, ...], ...]
    output_split_sizes: tuple[int, ...]
    src_index: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_split_sizes) != len(self.dst_indices):
            raise ValueError("GroupCastPlan: input_split_sizes and dst_indices differ in length")
        if len(self.output_split_sizes) != len(self.src_index):
            raise ValueError("GroupCastPlan: output_split_sizes and src_index differ in length")

    @property
    def input_rows(self) -> int:
        return sum(self.input_split_sizes)

    @property
    def output_rows(self) -> int:
        return sum(self.output_split_sizes)

    def send_rows(self) -> int:
        """Rows this rank puts on the wire (each row once per destination)."""
        return sum(n * len(d) for n, d in zip(self.input_split_sizes, self.dst_indices))

    def transpose(self) -> "GroupReducePlan":
        return GroupReducePlan(
            input_split_sizes=self.output_split_sizes,
            dst_index=self.src_index,
            output_split_sizes=self.input_split_sizes,
            src_indices=self.dst_indices,
        )


@dataclass(frozen=True)
class GroupReducePlan:
    input_split_sizes: tuple[int, ...]
    dst_index: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    src_indices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.input_split_sizes) != len(self.dst_index):
            raise ValueError("GroupReducePlan: input_split_sizes and dst_index differ in length")
        if len(self.output_split_sizes) != len(self.src_indices):
            raise ValueError("GroupReducePlan: output_split_sizes and src_indices differ in length")

    def transpose(self) -> GroupCastPlan:
        return GroupCastPlan(
            input_split_sizes=self.output_split_sizes,
            dst_indices=self.src_indices,
            output_split_sizes=self.input_split_sizes,
            src_index=self.dst_index,
        )


def segments_with_destinations(length: int, pieces: list[tuple[int, int, int]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Cut ``[0, length)`` at every piece boundary; each segment lists the ranks whose pieces
    ``(start, end, rank)`` cover it (segments nobody wants get an empty tuple)."""
    events: dict[int, list[tuple[int, int]]] = {0: [], length: []}
    for s, e, r in pieces:
        if s < e:
            events.setdefault(s, []).append((r, 1))
            events.setdefault(e, []).append((r, -1))
    cover: dict[int, int] = {}
    sizes: list[int] = []
    dsts: list[tuple[int, ...]] = []
    points = sorted(events)
    for a, b in zip(points, points[1:]):
        for r, d in events[a]:
            cover[r] = cover.get(r, 0) + d
        sizes.append(b - a)
        dsts.append(tuple(sorted(r for r, c in cover.items() if c > 0)))
    return sizes, dsts
