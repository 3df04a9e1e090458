"""Re-express a global mask in the coordinates of local buffers made of concatenated ranges."""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

from .mask import AttnSlice, Band
from .ranges import AttnRange

SliceTuple = tuple[int, int, int, int, int]  # (q_start, q_end, k_start, k_end, mask_type)


def _buffer_layout(ranges: Sequence[AttnRange]) -> list[tuple[AttnRange, int]]:
    """(global range, offset in the buffer) sorted by global start."""
    out, pos = [], 0
    for r in ranges:
        out.append((r, pos))
        pos += r.seqlen
    return sorted(out, key=lambda x: x[0].start)


def slices_over(bands: Iterable[tuple[int, Band]], k_ranges: Sequence[AttnRange]) -> tuple[list[SliceTuple], int]:
    """Clip ``(q shift, band)`` pairs to the key rows ``k_ranges`` (global, in buffer order;
    they must not overlap) and shift into local coordinates. Returns slices and their area."""
    layout = _buffer_layout(k_ranges)
    starts = [r.start for r, _ in layout]
    out: list[SliceTuple] = []
    area = 0
    for dq, b in bands:
        ext = b.k_extent()
        if ext is None:
            continue
        j = max(bisect.bisect_right(starts, ext[0]) - 1, 0)
        while j < len(layout) and starts[j] < ext[1]:
            r, off = layout[j]
            clipped = b.clip_k(r.start, r.end)
            if clipped is not None:
                local = clipped.shift(dq, r.start - off)
                area += local.area()
                out.extend(s.to_tuple() for s in local.to_slices())
            j += 1
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
