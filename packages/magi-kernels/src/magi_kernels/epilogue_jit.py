"""Row-wise math shared by the Triton and the Gluon kernels: softmax/LSE epilogue, slice row bounds.

Plain ``triton.jit`` functions of elementwise math: Gluon kernels call them as they are, so
both forwards finish the online softmax and merge with earlier layers through one piece of
code. Importable without triton (then it defines nothing).
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
    def softmax_lse(l_i, m_i):
        """(row sum safe to divide by, natural-log LSE) of an online softmax in base 2; rows
        that saw no key get a sum of 1 (their accumulator is 0) and LSE -inf."""
        ok = l_i > 0
        l_safe = tl.where(ok, l_i, 1.0)
        return l_safe, tl.where(ok, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    @triton.jit
    def lse_merge_weights(old_l, lse):
        """Weights of an LSE merge of two partial results over disjoint keys: (weight of the
        old output, weight of the new one, their sum safe to divide by, merged LSE); rows where
        both LSEs are -inf keep LSE -inf."""
        new_l = tl.maximum(old_l, lse)
        ref = tl.where(new_l == float("-inf"), 0.0, new_l)
        wa = tl.exp(old_l - ref)
        wb = tl.exp(lse - ref)
        den = wa + wb
        den_safe = tl.where(den > 0, den, 1.0)
        return wa, wb, den_safe, tl.where(den > 0, ref + tl.log(den_safe), float("-inf"))

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

    @triton.jit
    def walk_start(n0, q_lo, q_hi, BM: tl.constexpr, ROTATE: tl.constexpr):
        """(number of query blocks of [q_lo, q_hi), the block a key tile at n0 starts its walk
        at; see walk_step).

        ROTATE staggers the starts so that the resident programs add into different dQ rows at a
        time while their Q/dO reads stay close (L2): the block holding row n0 (the tile's
        diagonal), which keeps neighbouring tiles 2 blocks apart."""
        n_blocks = tl.cdiv(q_hi - q_lo, BM)
        if ROTATE:
            return n_blocks, tl.maximum(n0 - q_lo, 0) // BM
        else:
            return n_blocks, n0 * 0  # (a tensor of n0's type in both branches)

    @triton.jit
    def walk_step(u, n_blocks, first, q_lo, BM: tl.constexpr):
        """First query row of step ``u`` of a key tile's walk over its ``n_blocks`` query blocks
        of one head, from block ``first`` and wrapping (every block of one query head of the GQA
        group, then the next head: the loops are ``for g in range(g_lo, g_hi): for u in
        range(n_blocks)``)."""
        return q_lo + ((u + first) % n_blocks) * BM
