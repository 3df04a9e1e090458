"""Re-express a global mask in the coordinates of local buffers made of concatenated ranges."""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator, Sequence

from .mask import AttnSlice, Band
from .ranges import AttnRange

SliceTuple = tuple[int, int, int, int, int]  # (q_start, q_end, k_start, k_end, mask_type)


def _buffer_layout(ranges: Sequence[AttnRange]) -> list[tuple[int, AttnRange, int]]:
    """(position in ``ranges``, global range, offset in the buffer) sorted by global start."""
    out, pos = [], 0
    for i, r in enumerate(ranges):
        out.append((i, r, pos))
        pos += r.seqlen
    return sorted(out, key=lambda x: x[1].start)


def clip_to_ranges(
    bands: Iterable[tuple[int, Band]], k_ranges: Sequence[AttnRange]
) -> Iterator[tuple[int, int, int, Band]]:
    """Every non-empty clip of ``(q shift, band)`` pairs to the key rows ``k_ranges`` (global, in
    buffer order; they must not overlap): yields (range position, q shift, key shift, clip),
    where ``clip.shift(q shift, key shift)`` is in local buffer coordinates."""
    layout = _buffer_layout(k_ranges)
    starts = [r.start for _, r, _ in layout]
    for dq, b in bands:
        ext = b.k_extent()
        if ext is None:
            continue
        j = max(bisect.bisect_right(starts, ext[0]) - 1, 0)
        while j < len(layout) and starts[j] < ext[1]:
            i, r, off = layout[j]
            clipped = b.clip_k(r.start, r.end)
            if clipped is not None:
                yield i, dq, r.start - off, clipped
            j += 1


def areas_over(bands: Iterable[tuple[int, Band]], k_ranges: Sequence[AttnRange]) -> list[int]:
    """Unmasked area of the bands inside each of ``k_ranges`` (same order)."""
    out = [0] * len(k_ranges)
    for i, _, _, clipped in clip_to_ranges(bands, k_ranges):
        out[i] += clipped.area()
    return out


def slices_over(bands: Iterable[tuple[int, Band]], k_ranges: Sequence[AttnRange]) -> tuple[list[SliceTuple], int]:
    """Slices (local coordinates) and area of the bands clipped to ``k_ranges``."""
    out: list[SliceTuple] = []
    area = 0
    for _, dq, dk, clipped in clip_to_ranges(bands, k_ranges):
        local = clipped.shift(dq, dk)
        area += local.area()
        out.extend(s.to_tuple() for s in local.to_slices())
    return out, area


def local_slices(
    slices: Sequence[AttnSlice], q_ranges: Sequence[AttnRange], k_ranges: Sequence[AttnRange]
) -> tuple[list[SliceTuple], int]:
    """The part of a global mask with queries in ``q_ranges`` and keys in ``k_ranges``, in the
    coordinates of buffers that concatenate those ranges in the given order (e.g. a zigzag
    shard and an all-gathered KV buffer)."""
    bands: list[tuple[int, Band]] = []
    pos = 0
    for qr in q_ranges:
        for s in slices:
            b = s.band().clip_q(qr.start, qr.end)
            if b is not None:
                bands.append((qr.start - pos, b))
        pos += qr.seqlen
    return slices_over(bands, k_ranges)
