"""Dispatch solver: cut the sequence into chunks and balance mask area over CP ranks.

No padding: the last chunk may be shorter than the others, and when the number of chunks is not
a multiple of the CP size some ranks hold one chunk more than the rest (every rank holds
``floor(n / cp)`` or ``ceil(n / cp)`` of the ``n`` chunks), so ranks may hold different token
counts. The largest shard is the same as a padded dispatch would give every rank, so nothing is
slower or bigger; the other ranks just skip the padding rows. The min-heap greedy assigns the
largest remaining chunk to the least-loaded rank that still has room.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

from .mask import AttnSlice, Band
from .ranges import AttnRange, AttnRanges

logger = logging.getLogger(__name__)

DISPATCH_ALGS = ("min_heap", "sequential")


@dataclass(frozen=True)
class DispatchConfig:
    """How to chunk and balance.

    Args:
        chunk_size: tokens per chunk, at most: it is lowered to :func:`max_chunk_size` (about
            ``ceil(S / cp)``) when that is smaller, so that every rank gets work. ``None`` picks
            ``ceil(S / (min_chunks_per_rank * cp))``, rounded up to a multiple of 128 (or 16 for
            small sequences) for kernel tiles.
        min_chunks_per_rank: used by the automatic chunk size; more chunks balance better.
        alg: ``"min_heap"`` (balance mask area) or ``"sequential"`` (contiguous shards, no
            balancing; the baseline).
    """

    chunk_size: int | None = None
    min_chunks_per_rank: int = 8
    alg: str = "min_heap"

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(f"DispatchConfig.chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if not isinstance(self.min_chunks_per_rank, int) or self.min_chunks_per_rank <= 0:
            raise ValueError(
                f"DispatchConfig.min_chunks_per_rank must be a positive int, got {self.min_chunks_per_rank!r}"
            )
        if self.alg not in DISPATCH_ALGS:
            raise ValueError(f"DispatchConfig.alg must be one of {DISPATCH_ALGS}, got {self.alg!r}")


def auto_chunk_size(total_seqlen: int, cp_size: int, min_chunks_per_rank: int = 8) -> int:
    raw = max(1, math.ceil(total_seqlen / (min_chunks_per_rank * cp_size)))
    align = 128 if raw >= 512 else (16 if raw >= 64 else 1)
    return math.ceil(raw / align) * align


def max_chunk_size(total_seqlen: int, cp_size: int) -> int:
    """The largest chunk size that cuts ``total_seqlen`` tokens into at least ``cp_size`` chunks,
    so that every rank holds at least one: ``ceil(S / cp)`` (one chunk a rank), or less for short
    sequences (``S < cp**2``) where that would give fewer than ``cp`` chunks."""
    if total_seqlen < cp_size:
        raise ValueError(f"total_seqlen={total_seqlen} is smaller than cp_size={cp_size}: every CP rank must hold at "
                         f"least one token; use at most {total_seqlen} CP ranks for this sequence")
    if cp_size == 1:
        return total_seqlen
    # n = ceil(S / cs) >= cp  <=>  (cp - 1) * cs < S
    return min(math.ceil(total_seqlen / cp_size), (total_seqlen - 1) // (cp_size - 1))


@dataclass(frozen=True)
class DispatchPlan:
    """Result of the dispatch solver.

    ``partitions[r]`` are the chunk ids of rank r, ascending; rank r's local tensor is those
    chunks concatenated. Chunk c holds tokens ``[c * chunk_size, min((c + 1) * chunk_size, S))``:
    only the last chunk can be short, and it is the last of its rank's chunks, so every chunk of
    a rank starts at ``position * chunk_size`` in the rank's local tensor.
    """

    total_seqlen: int
    chunk_size: int
    cp_size: int
    chunk_areas: tuple[int, ...]
    partitions: tuple[tuple[int, ...], ...]
    chunk_bands: tuple[tuple[Band, ...], ...] = field(repr=False)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_areas)

    def chunk_range(self, chunk: int) -> AttnRange:
        """Global token range of ``chunk``."""
        cs = self.chunk_size
        return AttnRange(chunk * cs, min((chunk + 1) * cs, self.total_seqlen))

    @property
    def shard_seqlens(self) -> tuple[int, ...]:
        """Tokens held by each rank (they sum to ``total_seqlen``: there is no padding)."""
        return tuple(sum(self.chunk_range(c).seqlen for c in part) for part in self.partitions)

    def rank_areas(self) -> list[int]:
        return [sum(self.chunk_areas[c] for c in part) for part in self.partitions]

    def imbalance(self) -> float:
        """max / mean of per-rank area (1.0 is perfect)."""
        areas = self.rank_areas()
        mean = sum(areas) / len(areas)
        return max(areas) / mean if mean else 1.0

    def chunk_owner(self) -> list[tuple[int, int]]:
        """For each chunk: (rank, position of the chunk inside that rank's local tensor)."""
        owner = [(0, 0)] * self.num_chunks
        for r, part in enumerate(self.partitions):
            for i, c in enumerate(part):
                owner[c] = (r, i)
        return owner

    def token_imbalance(self) -> float:
        """max / mean of per-rank token counts (1.0 when every rank holds as many tokens)."""
        sizes = self.shard_seqlens
        return max(sizes) * len(sizes) / sum(sizes)

    def rank_ranges(self, rank: int) -> AttnRanges:
        return AttnRanges(self.chunk_range(c) for c in self.partitions[rank]).merge()

    def position_ids(self, rank: int) -> list[int]:
        """Global positions of rank's local tokens, in local order."""
        return [t for c in self.partitions[rank] for t in range(*self.chunk_range(c).to_tuple())]

    def for_slices(self, slices: Sequence[AttnSlice]) -> "DispatchPlan":
        """The same placement (chunk size and ``partitions``) with the chunk bands and
        areas of another mask, ``slices`` (validated against ``total_seqlen``), so that plan
        its communication and kernel slices without moving a token. Its ``rank_areas`` and
        ``imbalance`` tell how well this placement balances the other mask: nothing re-balances."""
        bands, areas = _chunk_bands_areas(slices, self.num_chunks, self.chunk_size)
        return dataclasses.replace(self, chunk_areas=areas, chunk_bands=bands)


def _chunk_bands(slices: Sequence[AttnSlice], num_chunks: int, chunk_size: int) -> list[list[Band]]:
    per_chunk: list[list[Band]] = [[] for _ in range(num_chunks)]
    for s in slices:
        if s.q_range.is_empty() or s.k_range.is_empty():
            continue
        band = s.band()
        for c in range(s.q_range.start // chunk_size, (s.q_range.end - 1) // chunk_size + 1):
            clipped = band.clip_q(c * chunk_size, (c + 1) * chunk_size)
            if clipped is not None and clipped.pieces():
                per_chunk[c].append(clipped)
    return per_chunk


def _chunk_bands_areas(
    slices: Sequence[AttnSlice], num_chunks: int, chunk_size: int
) -> tuple[tuple[tuple[Band, ...], ...], tuple[int, ...]]:
    """Per chunk: its bands of ``slices`` and their area."""
    bands = tuple(tuple(b) for b in _chunk_bands(slices, num_chunks, chunk_size))
    return bands, tuple(sum(b.area() for b in bs) for bs in bands)


def _min_heap_partition(areas: Sequence[int], cp_size: int) -> list[list[int]]:
    """Largest chunk first to the least-loaded rank with room; every rank ends with ``base`` or
    ``base + 1`` chunks, and only ``extra`` ranks get the ``base + 1``-th."""
    base, extra = divmod(len(areas), cp_size)
    order = sorted(range(len(areas)), key=lambda c: (-areas[c], c))
    heap = [(0, r) for r in range(cp_size)]
    parts: list[list[int]] = [[] for _ in range(cp_size)]
    for c in order:
        load, r = heapq.heappop(heap)
        while len(parts[r]) == base and not extra:  # at base, and the extra chunks are taken
            load, r = heapq.heappop(heap)
        if len(parts[r]) == base:
            extra -= 1
        parts[r].append(c)
        if len(parts[r]) < base or (len(parts[r]) == base and extra):
            heapq.heappush(heap, (load + areas[c], r))
    return [sorted(p) for p in parts]


def _sequential_partition(num_chunks: int, cp_size: int) -> list[list[int]]:
    """Contiguous shards; the first ``num_chunks % cp_size`` ranks hold one chunk more."""
    base, extra = divmod(num_chunks, cp_size)
    bounds = [r * base + min(r, extra) for r in range(cp_size + 1)]
    return [list(range(bounds[r], bounds[r + 1])) for r in range(cp_size)]


def solve_dispatch(
    slices: Sequence[AttnSlice],
    total_seqlen: int,
    cp_size: int,
    config: DispatchConfig = DispatchConfig(),
) -> DispatchPlan:
    """Chunk and balance (no padding). ``slices`` must already be validated."""
    if not isinstance(cp_size, int) or cp_size <= 0:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if total_seqlen <= 0:
        raise ValueError(f"total_seqlen must be positive, got {total_seqlen}")
    cap = max_chunk_size(total_seqlen, cp_size)
    if config.chunk_size:
        cs = min(config.chunk_size, cap)
        if cs < config.chunk_size:
            logger.info("chunk_size %d lowered to %d so that each of the %d ranks gets work (%d tokens)",
                        config.chunk_size, cs, cp_size, total_seqlen)
    elif cp_size == 1:
        cs = total_seqlen  # one rank: one chunk
    else:
        cs = min(auto_chunk_size(total_seqlen, cp_size, config.min_chunks_per_rank), cap)
    n = math.ceil(total_seqlen / cs)
    bands, areas = _chunk_bands_areas(slices, n, cs)
    if cp_size == 1:
        parts = [list(range(n))]
    elif config.alg == "sequential":
        parts = _sequential_partition(n, cp_size)
    else:
        parts = _min_heap_partition(areas, cp_size)
    return DispatchPlan(
        total_seqlen=total_seqlen,
        chunk_size=cs,
        cp_size=cp_size,
        chunk_areas=areas,
        partitions=tuple(tuple(p) for p in parts),
        chunk_bands=bands,
    )
