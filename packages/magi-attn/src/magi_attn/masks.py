"""Named mask presets for the CLI, benchmarks and integrations (one vocabulary everywhere)."""

from __future__ import annotations

import random

from magi_solver import (
    AttnSlice,
    block_causal_slices,
    causal_slices,
    check_positive_int,
    full_slices,
    shared_prefix_slices,
    varlen_slices,
)

MASKS = (
    "full", "causal", "varlen_full", "varlen_causal", "sliding_window", "varlen_block_causal", "shared_prefix",
)

# Document lengths of packed pre-training data are heavy-tailed: many short documents and a
# few long ones. A small embedded histogram (length bucket upper bound, weight) stands in for a
# real length distribution; each document is capped at a quarter of the total, as in the
# MagiAttention benchmarks.
_DOC_LENGTH_HISTOGRAM = (
    (256, 0.22), (512, 0.18), (1024, 0.17), (2048, 0.15), (4096, 0.12), (8192, 0.08),
    (16384, 0.05), (32768, 0.03),
)


def sample_doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Document lengths summing to ``total`` drawn from the embedded histogram."""
    rng = random.Random(seed)
    bounds = [b for b, _ in _DOC_LENGTH_HISTOGRAM]
    weights = [w for _, w in _DOC_LENGTH_HISTOGRAM]
    cap = max(total // 4, 1)
    out: list[int] = []
    left = total
    while left > 0:
        hi = rng.choices(bounds, weights)[0]
        n = min(rng.randint(max(hi // 2, 1), hi), cap, left)
        out.append(n)
        left -= n
    return out


def cu_seqlens_of(lengths: list[int]) -> list[int]:
    """Cumulative boundaries ``[0, l0, l0 + l1, ...]`` of documents of ``lengths``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def make_mask(name: str, total: int, *, window: int = 1024, block: int = 1024, seed: int = 0) -> list[AttnSlice]:
    """Slices of a named mask over ``total`` tokens. ``window``: the keys each query of
    ``sliding_window`` sees, itself included (>= 1); ``block``: the block of ``varlen_block_causal``."""
    if name not in MASKS:
        raise ValueError(f"unknown mask {name!r}; choose one of {MASKS}")
    if name == "sliding_window":
        check_positive_int(window, "window", "the keys each query sees, itself included")
    if name == "varlen_block_causal":
        check_positive_int(block, "block", "tokens per block")
    if name == "full":
        return full_slices(total)
    if name == "causal":
        return causal_slices(total)
    if name == "sliding_window":
        return varlen_slices([0, total], window_size=(window - 1, 0))
    if name == "shared_prefix":
        prefix = total // 4
        rest = sample_doc_lengths(total - prefix, seed)
        return shared_prefix_slices(prefix, rest)
    cu = cu_seqlens_of(sample_doc_lengths(total, seed))
    if name == "varlen_full":
        return varlen_slices(cu)
    if name == "varlen_causal":
        return varlen_slices(cu, causal=True)
    return block_causal_slices(cu, block)
