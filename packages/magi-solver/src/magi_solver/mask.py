"""Attention slices, their exact unmasked sets, areas and clipping.

A slice ``(q_range, k_range, mask_type)`` with ``q in [qs, qe)``, ``k in [ks, ke)`` unmasks:

=========  ==================================  =============
type       condition                           alignment
=========  ==================================  =============
FULL       always                              -
CAUSAL     ``k <= q + (ke - qe)``              bottom-right
INVCAUSAL  ``k >= q + (ks - qs)``              top-left
BICAUSAL   both                                both
=========  ==================================  =============

Internally every slice is a :class:`Band`: for each row ``q`` in ``[q_start, q_end)`` the keys
``[max(k_lo, q + diag_lo), min(k_hi, q + diag_hi))``. Bands are closed under clipping to q or k
ranges, shifting to local coordinates and intersection, so all geometry of the planners is done
on bands and converted back to at most three canonical slices.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import gc
import heapq
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from .ranges import AttnRange

# Stand-ins for "no diagonal constraint"; any |value| beyond every token index works.
NO_LOWER_DIAG = -(1 << 62)
NO_UPPER_DIAG = 1 << 62


class AttnMaskType(enum.IntEnum):
    """Mask type of one slice. The integer value is the kernel's ``attn_type_map`` code:
    bit 0 = clipped by the bottom-right diagonal, bit 1 = clipped by the top-left diagonal."""

    FULL = 0
    CAUSAL = 1
    INVCAUSAL = 2
    BICAUSAL = 3

    @classmethod
    def parse(cls, value: "AttnMaskType | str | int") -> "AttnMaskType":
        if isinstance(value, AttnMaskType):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            aliases = {"full": 0, "causal": 1, "inv_causal": 2, "invcausal": 2, "bi_causal": 3, "bicausal": 3}
            if key not in aliases:
                raise ValueError(
                    f"unknown mask type {value!r}; use one of 'full', 'causal', 'inv_causal', 'bi_causal'"
                )
            return cls(aliases[key])
        if isinstance(value, int) and 0 <= value <= 3:
            return cls(value)
        raise ValueError(f"unknown mask type {value!r}; use an AttnMaskType, its name, or 0..3")

    @property
    def is_causal(self) -> bool:
        return bool(self.value & 1)

    @property
    def is_inv_causal(self) -> bool:
        return bool(self.value & 2)


def _series(first: int, last: int, n: int) -> int:
    """Sum of an arithmetic series of n terms from first to last."""
    return (first + last) * n // 2


@dataclass(frozen=True)
class Band:
    """Rows ``[q_start, q_end)``; row q sees keys ``[max(k_lo, q+diag_lo), min(k_hi, q+diag_hi))``."""

    q_start: int
    q_end: int
    k_lo: int
    k_hi: int
    diag_lo: int = NO_LOWER_DIAG
    diag_hi: int = NO_UPPER_DIAG

    # -- conversion ----------------------------------------------------------------------------
    @classmethod
    def from_slice(cls, s: "AttnSlice") -> "Band":
        qs, qe, ks, ke = s.q_range.start, s.q_range.end, s.k_range.start, s.k_range.end
        t = s.mask_type
        return cls(
            qs,
            qe,
            ks,
            ke,
            ks - qs if t.is_inv_causal else NO_LOWER_DIAG,
            ke - qe + 1 if t.is_causal else NO_UPPER_DIAG,
        )

    def row(self, q: int) -> tuple[int, int]:
        """Key interval of row q (may be empty: start >= end)."""
        return max(self.k_lo, q + self.diag_lo), min(self.k_hi, q + self.diag_hi)

    def pieces(self) -> list["Band"]:
        """Split into <= 3 row ranges where each bound is either constant or diagonal,
        with rows that see no key trimmed away. Each piece is exactly one canonical slice."""
        if self.q_start >= self.q_end or self.k_lo >= self.k_hi or self.diag_lo >= self.diag_hi:
            return []
        # lower bound is diagonal for q >= lo_switch, upper bound diagonal for q < hi_switch
        lo_switch = self.k_lo - self.diag_lo
        hi_switch = self.k_hi - self.diag_hi
        cuts = sorted({self.q_start, self.q_end} | {c for c in (lo_switch, hi_switch) if self.q_start < c < self.q_end})
        out: list[Band] = []
        for a, b in zip(cuts, cuts[1:]):
            lo_diag = a >= lo_switch
            hi_diag = a < hi_switch
            # trim empty rows: row q is non-empty iff lower(q) < upper(q)
            if lo_diag and hi_diag:
                pass  # width diag_hi - diag_lo > 0 on every row
            elif hi_diag:  # [k_lo, q + diag_hi): non-empty iff q > k_lo - diag_hi
                a = max(a, self.k_lo - self.diag_hi + 1)
            elif lo_diag:  # [q + diag_lo, k_hi): non-empty iff q < k_hi - diag_lo
                b = min(b, self.k_hi - self.diag_lo)
            if a < b:
                out.append(Band(a, b, self.k_lo, self.k_hi, self.diag_lo if lo_diag else NO_LOWER_DIAG,
                                self.diag_hi if hi_diag else NO_UPPER_DIAG))
        return out

    def to_slices(self) -> list["AttnSlice"]:
        """Canonical slices covering exactly the band's cells (no row without keys)."""
        out = []
        for p in self.pieces():
            a, b = p.q_start, p.q_end
            lo_diag, hi_diag = p.diag_lo != NO_LOWER_DIAG, p.diag_hi != NO_UPPER_DIAG
            ks = a + p.diag_lo if lo_diag else p.k_lo
            ke = b - 1 + p.diag_hi if hi_diag else p.k_hi
            t = AttnMaskType(int(hi_diag) | (int(lo_diag) << 1))
            out.append(AttnSlice(AttnRange(a, b), AttnRange(ks, ke), t))
        return out

    # -- geometry ------------------------------------------------------------------------------
    def area(self) -> int:
        total = 0
        for p in self.pieces():
            n = p.q_end - p.q_start
            lo_diag, hi_diag = p.diag_lo != NO_LOWER_DIAG, p.diag_hi != NO_UPPER_DIAG
            if lo_diag and hi_diag:
                total += n * (p.diag_hi - p.diag_lo)
            elif hi_diag:
                total += _series(p.q_start + p.diag_hi - p.k_lo, p.q_end - 1 + p.diag_hi - p.k_lo, n)
            elif lo_diag:
                total += _series(p.k_hi - p.q_start - p.diag_lo, p.k_hi - p.q_end + 1 - p.diag_lo, n)
            else:
                total += n * (p.k_hi - p.k_lo)
        return total

    def clip_q(self, start: int, end: int) -> "Band | None":
        a, b = max(self.q_start, start), min(self.q_end, end)
        return Band(a, b, self.k_lo, self.k_hi, self.diag_lo, self.diag_hi) if a < b else None

    def clip_k(self, start: int, end: int) -> "Band | None":
        lo, hi = max(self.k_lo, start), min(self.k_hi, end)
        if lo >= hi:
            return None
        return Band(self.q_start, self.q_end, lo, hi, self.diag_lo, self.diag_hi)

    def intersect(self, other: "Band") -> "Band | None":
        a, b = max(self.q_start, other.q_start), min(self.q_end, other.q_end)
        if a >= b:
            return None
        return Band(a, b, max(self.k_lo, other.k_lo), min(self.k_hi, other.k_hi),
                    max(self.diag_lo, other.diag_lo), min(self.diag_hi, other.diag_hi))

    def shift(self, dq: int, dk: int) -> "Band":
        """Move to coordinates ``q' = q - dq``, ``k' = k - dk``."""
        lo = self.diag_lo if self.diag_lo == NO_LOWER_DIAG else self.diag_lo + dq - dk
        hi = self.diag_hi if self.diag_hi == NO_UPPER_DIAG else self.diag_hi + dq - dk
        return Band(self.q_start - dq, self.q_end - dq, self.k_lo - dk, self.k_hi - dk, lo, hi)

    def k_extent(self) -> tuple[int, int] | None:
        """Smallest key range holding every unmasked cell, or None when the band is empty."""
        ps = self.pieces()
        if not ps:
            return None
        los = [p.row(p.q_start)[0] for p in ps]
        his = [p.row(p.q_end - 1)[1] for p in ps]
        return min(los), max(his)


@dataclass(frozen=True)
class AttnSlice:
    """One rectangle of the mask with a diagonal rule (see module docstring)."""

    q_range: AttnRange
    k_range: AttnRange
    mask_type: AttnMaskType = AttnMaskType.FULL

    @classmethod
    def make(cls, q: Sequence[int], k: Sequence[int], mask_type: "AttnMaskType | str | int" = "full") -> "AttnSlice":
        return cls(AttnRange(int(q[0]), int(q[1])), AttnRange(int(k[0]), int(k[1])), AttnMaskType.parse(mask_type))

    @property
    def area(self) -> int:
        return slice_area(self.q_range.seqlen, self.k_range.seqlen, self.mask_type)

    def band(self) -> Band:
        return Band.from_slice(self)

    def to_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.q_range.start, self.q_range.end, self.k_range.start, self.k_range.end, int(self.mask_type))


def slice_area(sq: int, sk: int, mask_type: AttnMaskType) -> int:
    """Number of unmasked cells of a slice of ``sq`` queries and ``sk`` keys (design §2.4)."""
    if sq <= 0 or sk <= 0:
        return 0
    t = AttnMaskType(mask_type)
    if t == AttnMaskType.FULL:
        return sq * sk
    if t == AttnMaskType.BICAUSAL:
        return max(sk - sq + 1, 0) * sq
    if sk > sq:
        return (2 * sk - sq + 1) * sq // 2
    return sk * (sk + 1) // 2


def total_area(slices: Iterable[AttnSlice]) -> int:
    return sum(s.area for s in slices)


def slice_ranges(slices: Iterable[AttnSlice]) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """(q_ranges, k_ranges, mask types) of ``slices``: the three slice arguments of the kernel
    (``flex_flash_attn_func(q, k, v, *slice_ranges(slices))``)."""
    sl = list(slices)
    return [s.q_range.to_tuple() for s in sl], [s.k_range.to_tuple() for s in sl], [int(s.mask_type) for s in sl]


def validate_slices(
    slices: Sequence[AttnSlice],
    total_seqlen_q: int,
    total_seqlen_k: int,
    *,
    check_overlap: bool = True,
) -> None:
    """Raise ``ValueError`` naming the offending slices when a slice lies outside the sequence or
    when a (q, k) cell is covered by two slices (that key would count twice in the softmax)."""
    for i, s in enumerate(slices):
        if s.q_range.end > total_seqlen_q:
            raise ValueError(f"slice {i}: q_range {s.q_range} exceeds total_seqlen_q={total_seqlen_q}")
        if s.k_range.end > total_seqlen_k:
            raise ValueError(f"slice {i}: k_range {s.k_range} exceeds total_seqlen_k={total_seqlen_k}")
    if not check_overlap:
        return
    with gc_paused():
        hit = first_double_cover(slices)
    if hit is not None:
        a, b, inter = hit
        first = inter.pieces()[0]
        q = first.q_start
        k = first.row(q)[0]
        raise ValueError(
            f"slices {a} ({_fmt(slices[a])}) and {b} ({_fmt(slices[b])}) both cover cell "
            f"(q={q}, k={k}) and {inter.area()} cells in all; every (q, k) cell may be covered "
            "by at most one slice: split or trim one of them"
        )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: code that allocates a few objects per slice and keeps
    them (bands, sweep entries; no reference cycles) would otherwise set off full collections of
    the whole heap (measured 130 of 200 ms for 10k slices in a process that imported torch)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def first_double_cover(slices: Sequence[AttnSlice]) -> tuple[int, int, Band] | None:
    """``(a, b, shared)`` for two slices ``a < b`` that cover a common (q, k) cell, ``shared``
    being the band of the cells both cover; None when every cell is covered at most once.

    A sweep over q: the slices still open at a slice's first row are kept sorted by their first
    key, and only those whose key extent reaches the new slice's are intersected with it
    (O(N log N) for masks whose open slices have short key extents, at worst O(N^2))."""
    bands = [s.band() for s in slices]
    order = sorted((b.q_start, i) for i, b in enumerate(bands) if b.q_start < b.q_end and b.k_lo < b.k_hi)
    open_by_k: list[tuple[int, int]] = []  # (k_lo, index) of open slices, sorted
    closing: list[tuple[int, int]] = []  # heap of (q_end, index) of open slices
    widths: list[tuple[int, int]] = []  # heap of (-key extent, index); closed entries are skipped lazily
    is_open = [False] * len(bands)
    for q_start, i in order:
        band = bands[i]
        while closing and closing[0][0] <= q_start:
            _, j = heapq.heappop(closing)
            del open_by_k[bisect.bisect_left(open_by_k, (bands[j].k_lo, j))]
            is_open[j] = False
        while widths and not is_open[widths[0][1]]:
            heapq.heappop(widths)
        widest = -widths[0][0] if widths else 0
        for pos in range(bisect.bisect_left(open_by_k, (band.k_hi, -1)) - 1, -1, -1):
            k_lo, j = open_by_k[pos]
            if k_lo + widest <= band.k_lo:
                break  # this and every open slice before it ends at or before band's first key
            other = bands[j]
            if other.k_hi <= band.k_lo:
                continue
            shared = band.intersect(other)
            if shared is not None and shared.area() > 0:
                a, b = sorted((i, j))
                return a, b, shared
        bisect.insort(open_by_k, (band.k_lo, i))
        heapq.heappush(closing, (band.q_end, i))
        heapq.heappush(widths, (band.k_lo - band.k_hi, i))
        is_open[i] = True
    return None


def _fmt(s: AttnSlice) -> str:
    return f"q={s.q_range}, k={s.k_range}, {s.mask_type.name}"
