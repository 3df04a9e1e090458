"""Which rows and keys of a slice a tile sees, shared by the Triton and the Gluon kernels: per-row
key bounds, per-key row bounds and the query rows a key tile meets.

Plain ``triton.jit`` functions (Gluon kernels call them as they are). Importable without triton
(then it defines nothing).
"""

from __future__ import annotations

from .epilogue_jit import AVAILABLE  # whether triton imports

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def row_bounds(rows, qs, qe, ks, ke, inv, cau):
        """Per-row visible keys [lo, hi): INVCAUSAL top-left, CAUSAL bottom-right."""
        lo = tl.where(inv, ks + rows - qs, ks)
        hi = tl.minimum(tl.where(cau, rows + ke - qe + 1, ke), ke)
        return lo, hi

    @triton.jit
    def key_row_bounds(keys, qs, qe, ks, ke, inv, cau, q_hi):
        """Per-key visible query rows [lo, hi), below ``q_hi``: the transpose of ``row_bounds``
        (key c is visible to row r iff row_bounds(r) holds c); empty for keys outside [ks, ke)."""
        lo = tl.maximum(tl.where(cau, keys - ke + qe, qs), qs)
        hi = tl.minimum(tl.minimum(tl.where(inv, keys - ks + qs + 1, qe), qe), q_hi)
        return lo, tl.where((keys >= ks) & (keys < ke), hi, lo)

    @triton.jit
    def key_tile_rows(n0, qs, qe, ks, ke, inv, cau, BN: tl.constexpr):
        """Query rows of a slice that a key tile [n0, n0+BN) meets:
        [q_lo, q_hi) see at least one of its keys, [f_lo, f_hi) see all of them (empty when the
        tile overhangs the slice's keys)."""
        n_last = tl.minimum(n0 + BN, ke) - 1
        q_lo = tl.maximum(tl.where(cau, n0 - ke + qe, qs), qs)
        q_hi = tl.minimum(tl.where(inv, n_last - ks + qs + 1, qe), qe)
        f_lo = tl.maximum(tl.where(cau, n0 + BN - 1 - ke + qe, qs), qs)
        f_hi = tl.minimum(tl.where(inv, n0 - ks + qs + 1, qe), qe)
        f_hi = tl.where(n0 + BN <= ke, f_hi, f_lo)  # a tile overhanging ke is never full
        return q_lo, q_hi, f_lo, f_hi
