"""Builders for the common masks, as lists of :class:`AttnSlice` in global coordinates."""

from __future__ import annotations

from typing import Sequence

from .mask import NO_LOWER_DIAG, NO_UPPER_DIAG, AttnMaskType, AttnSlice, Band
from .ranges import AttnRange, AttnRanges


def _check_cu(cu: Sequence[int], name: str) -> list[int]:
    return AttnRanges.from_cu_seqlens(cu, name).to_cu_seqlens()


def check_positive_int(value: object, name: str, meaning: str) -> int:
    """``value`` if it is an int >= 1, else a ``ValueError`` naming ``name`` and what it means."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({meaning}), got {value!r}")
    return value


def check_window_size(window_size: object) -> tuple[int, int]:
    """``window_size`` as ``(left, right)``: two ints >= -1, ``-1`` = unbounded on that side."""
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size))
    if not ok:
        raise ValueError(
            f"window_size must be (left, right) with ints >= -1 (-1 = unbounded on that side, 0 = none), "
            f"got {window_size!r}"
        )
    return int(window_size[0]), int(window_size[1])


def sliding_window_slices(
    q_range: AttnRange, k_range: AttnRange, window_size: tuple[int, int]
) -> list[AttnSlice]:
    """Slices of one (q, k) block under a sliding window ``(left, right)``, bottom-right aligned
    like CAUSAL: query i sees keys ``j`` with ``i' - left <= j <= i' + right`` where
    ``i' = i + (sk - sq)``; ``-1`` means unbounded on that side. Returns at most 3 slices."""
    left, right = check_window_size(window_size)
    shift = k_range.end - q_range.end  # global k of the diagonal at row q is q + shift
    band = Band(
        q_range.start,
        q_range.end,
        k_range.start,
        k_range.end,
        NO_LOWER_DIAG if left < 0 else shift - left,
        NO_UPPER_DIAG if right < 0 else shift + right + 1,
    )
    return band.to_slices()


def varlen_slices(
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int] | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> list[AttnSlice]:
    """One slice per document (FULL or CAUSAL), or the sliding-window decomposition when
    ``window_size`` is not ``(-1, -1)``. ``causal=True`` with a window means ``right = 0``."""
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else _check_cu(cu_seqlens_k, "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q has {len(cu_q) - 1} documents but cu_seqlens_k has {len(cu_k) - 1}; they must match"
        )
    left, right = check_window_size(window_size)
    if causal and right > 0:
        raise ValueError(f"causal=True allows no right window, got window_size={window_size}")
    if causal:
        right = 0
    out: list[AttnSlice] = []
    for qs, qe, ks, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if qs == qe or ks == ke:
            continue
        q, k = AttnRange(qs, qe), AttnRange(ks, ke)
        if left < 0 and right < 0:
            out.append(AttnSlice(q, k, AttnMaskType.FULL))
        elif left < 0 and right == 0 and causal:
            out.append(AttnSlice(q, k, AttnMaskType.CAUSAL))
        else:
            out.extend(sliding_window_slices(q, k, (left, right)))
    return out


def block_causal_slices(cu_seqlens: Sequence[int], block_size: int) -> list[AttnSlice]:
    """Block-causal inside each document (as in video models): block i of a document sees the
    document's keys up to the end of block i. ``cu_seqlens=[0, S]`` gives the single-sequence form."""
    check_positive_int(block_size, "block_size", "tokens per block")
    cu = _check_cu(cu_seqlens, "cu_seqlens")
    out = []
    for ds, de in zip(cu, cu[1:]):
        for bs in range(ds, de, block_size):
            be = min(bs + block_size, de)
            out.append(AttnSlice(AttnRange(bs, be), AttnRange(ds, be), AttnMaskType.FULL))
    return out


def shared_prefix_slices(prefix_len: int, branch_lens: Sequence[int], *, causal: bool = True) -> list[AttnSlice]:
    """A shared prefix (e.g. a question) followed by branches (answers) that each see the whole
    prefix and themselves, never each other. Total length ``prefix_len + sum(branch_lens)``."""
    if prefix_len < 0 or any(b < 0 for b in branch_lens):
        raise ValueError(f"prefix_len and branch_lens must be >= 0, got {prefix_len}, {list(branch_lens)}")
    inner = AttnMaskType.CAUSAL if causal else AttnMaskType.FULL
    out = []
    if prefix_len:
        out.append(AttnSlice(AttnRange(0, prefix_len), AttnRange(0, prefix_len), inner))
    pos = prefix_len
    for b in branch_lens:
        if b == 0:
            continue
        q = AttnRange(pos, pos + b)
        if prefix_len:
            out.append(AttnSlice(q, AttnRange(0, prefix_len), AttnMaskType.FULL))
        out.append(AttnSlice(q, q, inner))
        pos += b
    return out


def full_slices(total_seqlen: int) -> list[AttnSlice]:
    return [AttnSlice(AttnRange(0, total_seqlen), AttnRange(0, total_seqlen), AttnMaskType.FULL)]


def causal_slices(total_seqlen: int) -> list[AttnSlice]:
    return [AttnSlice(AttnRange(0, total_seqlen), AttnRange(0, total_seqlen), AttnMaskType.CAUSAL)]
