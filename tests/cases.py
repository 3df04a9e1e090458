"""Mask cases shared by the kernel and distributed tests (global slices, total length)."""

from __future__ import annotations

from magi_solver import (
    block_causal_slices,
    causal_slices,
    full_slices,
    shared_prefix_slices,
    varlen_slices,
)


def _tuples(slices):
    return [s.to_tuple() for s in slices]


def mask_cases() -> dict[str, tuple[list[tuple[int, int, int, int, int]], int]]:
    cu = [0, 13, 40, 41, 77, 101]
    S = cu[-1]
    return {
        "full": (_tuples(full_slices(67)), 67),
        "causal": (_tuples(causal_slices(83)), 83),
        "varlen_full": (_tuples(varlen_slices(cu)), S),
        "varlen_causal": (_tuples(varlen_slices(cu, causal=True)), S),
        "sliding_window": (_tuples(varlen_slices([0, 90], window_size=(17, 0))), 90),
        "varlen_sliding_window_2sided": (_tuples(varlen_slices(cu, window_size=(9, 4))), S),
        "varlen_block_causal": (_tuples(block_causal_slices(cu, 8)), S),
        "shared_prefix": (_tuples(shared_prefix_slices(19, [23, 7, 30])), 79),
        # overlapping q ranges and every mask type; rows 60..69 see no key at all
        "mixed_overlapping": (
            [(0, 30, 0, 30, 1), (10, 30, 30, 45, 0), (30, 60, 0, 25, 2), (30, 60, 25, 60, 3),
             (40, 60, 60, 80, 1), (70, 80, 0, 80, 0)],
            80,
        ),
    }
