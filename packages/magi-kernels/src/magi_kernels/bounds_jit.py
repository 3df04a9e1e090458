"""Row-bound math of a slice's mask, shared by the Triton and the Gluon kernels.

Plain elementwise ``triton.jit`` functions (Gluon kernels call them as they are). Importable
without triton (then it defines nothing).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs
    AVAILABLE = False

if AVAILABLE:

    @triton.jit
    def row_bounds(rows, qs, qe, ks, ke, inv, cau):
        """Per-row visible keys [lo, hi): INVCAUSAL top-left, CAUSAL bottom-right."""
        lo = tl.where(inv, ks + rows - qs, ks)
        hi = tl.minimum(tl.where(cau, rows + ke - qe + 1, ke), ke)
        return lo, hi

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
