"""Tile tables of the slices (pure host code): which rows each GPU program writes.

Tiles: every slice is cut into blocks of rows from its start (query rows for the forward and dQ,
key rows for dK/dV). Slices whose ranges start at the same phase of that grid have coinciding
tiles, so one tile serves all of them: its program loops over the member slices (one online
softmax across their keys, or one dK/dV accumulation across their queries). Only slices that
overlap at a different phase go to separate *layers* (interval colouring on the host); a later
layer LSE-merges (forward) or adds (backward) into the output of the previous ones, so no two
programs ever write the same rows. Packed documents, block-causal, sliding-window and
shared-prefix masks are all one layer. Tiles of a layer are ordered longest first.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from magi_solver import AttnMaskType, slice_area

from .host_cache import per_tensor, upload

__all__ = ["SliceTable", "TileLayer", "host_slices", "layer_pairs", "slice_layers", "staircase_share", "tile_tables",
           "tile_work"]


class SliceTable(tuple):
    """The slices as a tuple of ``(qs, qe, ks, ke, mask_type)`` tuples whose hash is computed once
    (plans and tile tables are cached by it; a long mask's tuple would be hashed on every call)."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h

    def __eq__(self, other) -> bool:
        return self is other or tuple.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other


class TileLayer(NamedTuple):
    """One layer of a launch: its tile table (int32 [n, 4]: first row, end row, first member,
    member count) and member slice ids on the device, the number of tiles and each tile's work
    (visible rows of the other axis, descending; host copy)."""

    tiles: torch.Tensor
    members: torch.Tensor
    n: int
    work: tuple[int, ...]


def slice_layers(slices: tuple[tuple[int, ...], ...], axis: int, block: int) -> list[list[int]]:
    """Colour slices into layers along ``axis`` (0 = q, 2 = k) so that no two tiles of a layer
    write the same rows. Tiles start every ``block`` rows from a slice's start, so slices whose
    starts agree modulo ``block`` (same *phase*) have coinciding tiles and may share a layer even
    when their ranges overlap: such a tile loops over all its slices. Slices of different phase
    share a layer only if their ranges are disjoint. Empty slices are dropped."""
    order = sorted(range(len(slices)), key=lambda i: (slices[i][axis], slices[i][axis + 1]))
    # per layer: {phase: largest end}; a slice starting at s conflicts with a layer if a slice
    # of another phase there ends after s (all earlier slices start at or before s)
    ends: list[dict[int, int]] = []
    layers: list[list[int]] = []
    for i in order:
        s, e = slices[i][axis], slices[i][axis + 1]
        if e <= s or slices[i][2] >= slices[i][3] or slices[i][0] >= slices[i][1]:
            continue
        phase = s % block
        for li, by_phase in enumerate(ends):
            if all(end <= s for ph, end in by_phase.items() if ph != phase):
                layers[li].append(i)
                by_phase[phase] = max(by_phase.get(phase, e), e)
                break
        else:
            layers.append([i])
            ends.append({phase: e})
    return layers


try:
    from . import _native  # C++ tile pairs (same layers and pairs as slice_layers / layer_pairs)
except ImportError:
    _native = None


def layer_pairs(slices: tuple[tuple[int, ...], ...], axis: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (slice index, tile start) of every slice's tiles, int32 CPU tensors, in slice order."""
    if _native is not None:
        def as_t(b: bytes) -> torch.Tensor:
            return torch.frombuffer(bytearray(b), dtype=torch.int32) if b else torch.empty(0, dtype=torch.int32)
        return [(as_t(a), as_t(b)) for a, b, _ in _native.tiles(list(slices), axis, block)]
    out = []
    for layer in slice_layers(slices, axis, block):
        pairs = [(i, b) for i in layer for b in range(slices[i][axis], slices[i][axis + 1], block)]
        out.append((torch.tensor([p[0] for p in pairs], dtype=torch.int32),
                    torch.tensor([p[1] for p in pairs], dtype=torch.int32)))
    return out


def tile_work(meta: torch.Tensor, sid: torch.Tensor, start: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Visible extent on the other axis of each (slice, tile) pair (keys of a q tile, queries of
    a k tile)."""
    s = meta[sid.long()].long()
    qs, qe, ks, ke, t = s.unbind(1)
    inv, cau = (t & 2) != 0, (t & 1) != 0
    b0 = start.long()
    if axis == 0:
        last = torch.minimum(b0 + block, qe) - 1
        lo = torch.where(inv, ks + b0 - qs, ks)
        hi = torch.minimum(torch.where(cau, last + ke - qe + 1, ke), ke)
    else:
        last = torch.minimum(b0 + block, ke) - 1
        lo = torch.maximum(torch.where(cau, b0 - ke + qe, qs), qs)
        hi = torch.minimum(torch.where(inv, last - ks + qs + 1, qe), qe)
    return (hi - lo).clamp(min=0)


def group_tiles(meta: torch.Tensor, sid: torch.Tensor, start: torch.Tensor, axis: int, block: int):
    """Merge a layer's (slice, tile start) pairs into tiles: a table of (start, end, first member,
    member count) per tile, ordered by descending work, the member slice ids and each tile's work
    (visible rows of the other axis, summed over members; descending). ``end`` is the last row
    any member covers (the tile writes [start, end))."""
    order = torch.sort(start.long() * len(meta) + sid.long(), stable=True).indices  # by start, then slice
    sid, start = sid[order], start[order]
    starts, counts = torch.unique_consecutive(start, return_counts=True)
    tile_of = torch.repeat_interleave(torch.arange(len(starts)), counts)
    pair_end = torch.minimum(start.long() + block, meta[sid.long(), axis + 1].long())
    end = torch.zeros(len(starts), dtype=torch.long).scatter_reduce(0, tile_of, pair_end, "amax", include_self=False)
    work = torch.zeros(len(starts), dtype=torch.long).index_add_(0, tile_of, tile_work(meta, sid, start, axis, block))
    first = torch.cumsum(counts, 0) - counts
    table = torch.stack([starts.long(), end, first, counts.long()], 1)
    by_work = torch.sort(work, descending=True, stable=True).indices
    return table[by_work].to(torch.int32).contiguous(), sid.contiguous(), tuple(work[by_work].tolist())


@functools.lru_cache(maxsize=256)
def tile_tables(slices: tuple[tuple[int, ...], ...], axis: int, block: int, device: str, n_rows: int = -1):
    """(slice table, [(tile table, member slice ids, n tiles, work per tile) per layer], layer 0
    covers all rows).

    Tiles run longest first (the work tuple is on the host, descending). The last flag says
    whether layer 0 writes every one of ``n_rows`` rows (then outputs need no zero fill).
    """
    meta_cpu = torch.tensor(slices, dtype=torch.int32).reshape(-1, 5)
    layers, covered = [], 0
    for li, (sid, start) in enumerate(layer_pairs(slices, axis, block)):
        table, members, work = group_tiles(meta_cpu, sid, start, axis, block)
        if li == 0:  # tiles of a layer are disjoint: the rows layer 0 writes
            covered = int((table[:, 1] - table[:, 0]).sum())
        layers.append(TileLayer(upload(table, device), upload(members, device), len(table), work))
    return upload(meta_cpu, device), layers, covered == n_rows and all(s[axis + 1] <= n_rows for s in slices)


def host_slices(q_ranges: torch.Tensor, k_ranges: torch.Tensor, types: torch.Tensor) -> SliceTable:
    """Slice table as a hashable tuple, memoised per range tensor (and its in-place version), so
    repeated calls with the same metadata cost a dictionary lookup."""
    def build():
        t = torch.cat([q_ranges.reshape(-1, 2), k_ranges.reshape(-1, 2), types.reshape(-1, 1)], dim=1).tolist()
        return SliceTable(tuple(r) for r in t)

    return per_tensor(q_ranges, "slice_table", build, k_ranges, types)


@functools.lru_cache(maxsize=256)
def staircase_share(slices: tuple[tuple[int, ...], ...]) -> float:
    """The share of the slices' area in causal / inv_causal slices (the Gluon backward runs such
    launches as pieces where their tiles differ in length, ``program_order.auto_piece_heads``)."""
    stairs = (AttnMaskType.CAUSAL, AttnMaskType.INVCAUSAL)
    areas = [(slice_area(qe - qs, ke - ks, t), t in stairs) for qs, qe, ks, ke, t in slices]
    total = sum(a for a, _ in areas)
    return sum(a for a, stair in areas if stair) / total if total else 0.0
