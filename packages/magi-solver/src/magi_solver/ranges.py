"""Half-open integer ranges ``[start, end)`` and ordered lists of them."""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence


def _as_int(x: object, name: str) -> int:
    """``x`` as an int (Python or NumPy ints; no bools, no floats: they would be truncated)."""
    if isinstance(x, bool):
        raise TypeError(f"{name}={x!r} is a bool; pass an int")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name}={x!r} is not an int; pass ints (int32/int64 for a tensor), "
                        "not floats or nested lists") from None


@dataclass(frozen=True, order=True)
class AttnRange:
    """A half-open range ``[start, end)`` of token indices; empty when ``start == end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.end, int)):
            raise TypeError(f"AttnRange bounds must be ints, got ({self.start!r}, {self.end!r})")
        if self.start < 0 or self.end < self.start:
            raise ValueError(
                f"AttnRange needs 0 <= start <= end, got [{self.start}, {self.end}); "
                "pass ranges as half-open [start, end) with start <= end"
            )

    @property
    def seqlen(self) -> int:
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.end == self.start

    def intersect(self, other: "AttnRange") -> "AttnRange | None":
        start, end = max(self.start, other.start), min(self.end, other.end)
        return AttnRange(start, end) if start < end else None

    def is_overlap_with(self, other: "AttnRange") -> bool:
        return max(self.start, other.start) < min(self.end, other.end)

    def is_subrange_of(self, other: "AttnRange") -> bool:
        return other.start <= self.start and self.end <= other.end

    def offset(self, delta: int) -> "AttnRange":
        return AttnRange(self.start + delta, self.end + delta)

    def to_tuple(self) -> tuple[int, int]:
        return (self.start, self.end)

    def __repr__(self) -> str:
        return f"[{self.start}, {self.end})"


class AttnRanges:
    """An ordered list of :class:`AttnRange` with set-like helpers.

    Most helpers that return new lists (``merge``, ``intersect``, ``subtract``) return them sorted
    and merged, which is the canonical form used by the planners.
    """

    __slots__ = ("_ranges",)

    def __init__(self, ranges: Iterable[AttnRange | tuple[int, int] | Sequence[int]] = ()):
        self._ranges: list[AttnRange] = [
            r if isinstance(r, AttnRange) else AttnRange(int(r[0]), int(r[1])) for r in ranges
        ]

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int], name: str = "cu_seqlens") -> "AttnRanges":
        """Documents ``[cu[i], cu[i+1])``; ``cu_seqlens`` must be ints starting at 0 and non-decreasing
        (errors name the argument as ``name``)."""
        cu = [_as_int(x, f"{name}[{i}]") for i, x in enumerate(cu_seqlens)]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(
                f"{name} must start at 0 and be non-decreasing, got {cu[:8]}{'...' if len(cu) > 8 else ''}"
            )
        return cls(AttnRange(a, b) for a, b in zip(cu, cu[1:]))

    def to_cu_seqlens(self) -> list[int]:
        if not self.is_cu_seqlens():
            raise ValueError("ranges are not contiguous from 0, cannot convert to cu_seqlens")
        return [0] + [r.end for r in self._ranges]

    # -- container protocol --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ranges)

    def __iter__(self) -> Iterator[AttnRange]:
        return iter(self._ranges)

    def __getitem__(self, idx: int) -> AttnRange:
        return self._ranges[idx]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttnRanges) and self._ranges == other._ranges

    def __hash__(self) -> int:
        return hash(tuple(self._ranges))

    def __repr__(self) -> str:
        return f"AttnRanges({self._ranges})"

    def append(self, r: AttnRange) -> None:
        self._ranges.append(r)

    def to_list(self) -> list[tuple[int, int]]:
        return [r.to_tuple() for r in self._ranges]

    # -- properties ----------------------------------------------------------------------------
    @property
    def total_seqlen(self) -> int:
        return sum(r.seqlen for r in self._ranges)

    @property
    def end(self) -> int:
        return max((r.end for r in self._ranges), default=0)

    def is_sorted(self) -> bool:
        return all(a.start <= b.start for a, b in zip(self._ranges, self._ranges[1:]))

    def is_non_overlap(self) -> bool:
        rs = sorted(self._ranges)
        return all(a.end <= b.start for a, b in zip(rs, rs[1:]))

    def is_merged(self) -> bool:
        return all(a.end < b.start for a, b in zip(self._ranges, self._ranges[1:])) and all(
            not r.is_empty() for r in self._ranges
        )

    def is_cu_seqlens(self) -> bool:
        pos = 0
        for r in self._ranges:
            if r.start != pos:
                return False
            pos = r.end
        return True

    # -- set algebra (all results sorted and merged) --------------------------------------------
    def merge(self) -> "AttnRanges":
        """Sorted union: overlapping or touching ranges are fused, empty ranges dropped."""
        out: list[AttnRange] = []
        for r in sorted(self._ranges):
            if r.is_empty():
                continue
            if out and r.start <= out[-1].end:
                if r.end > out[-1].end:
                    out[-1] = AttnRange(out[-1].start, r.end)
            else:
                out.append(r)
        return AttnRanges(out)

    def intersect(self, other: "AttnRanges") -> "AttnRanges":
        """Sorted, merged intersection of the two unions."""
        a, b = self.merge()._ranges, other.merge()._ranges
        out: list[AttnRange] = []
        i = j = 0
        while i < len(a) and j < len(b):
            s, e = max(a[i].start, b[j].start), min(a[i].end, b[j].end)
            if s < e:
                out.append(AttnRange(s, e))
            if a[i].end < b[j].end:
                i += 1
            else:
                j += 1
        return AttnRanges(out)

    def subtract(self, other: "AttnRanges") -> "AttnRanges":
        """Sorted, merged ``self - other`` (the "holes" of ``other`` inside ``self``)."""
        b = other.merge()._ranges
        out: list[AttnRange] = []
        j = 0
        for r in self.merge()._ranges:
            start = r.start
            while j < len(b) and b[j].end <= start:
                j += 1
            k = j
            while k < len(b) and b[k].start < r.end:
                if b[k].start > start:
                    out.append(AttnRange(start, b[k].start))
                start = max(start, b[k].end)
                k += 1
            if start < r.end:
                out.append(AttnRange(start, r.end))
        return AttnRanges(out)

    def chunk(self, chunk_size: int) -> "AttnRanges":
        """Cut every range into pieces of at most ``chunk_size`` tokens (order kept)."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        out: list[AttnRange] = []
        for r in self._ranges:
            for s in range(r.start, r.end, chunk_size):
                out.append(AttnRange(s, min(s + chunk_size, r.end)))
        return AttnRanges(out)

    def local_offsets(self) -> list[int]:
        """Prefix sums: where each range starts in the concatenation of all ranges."""
        offs, pos = [], 0
        for r in self._ranges:
            offs.append(pos)
            pos += r.seqlen
        return offs

    def make_range_local(self, r: AttnRange) -> AttnRange:
        """Map a global range lying inside one of ``self``'s (sorted, disjoint) ranges to
        coordinates of the concatenation of ``self``."""
        starts = [x.start for x in self._ranges]
        idx = bisect.bisect_right(starts, r.start) - 1
        if idx < 0 or not r.is_subrange_of(self._ranges[idx]):
            raise ValueError(f"{r} is not inside a single range of {self}")
        off = self.local_offsets()[idx] - self._ranges[idx].start
        return r.offset(off)
