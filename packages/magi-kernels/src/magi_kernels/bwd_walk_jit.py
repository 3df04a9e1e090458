"""The order in which a backward key tile walks its query blocks (the Gluon backward): from the
tile's diagonal block, wrapping, so that the resident programs add into different dQ rows.

Plain ``triton.jit`` functions (Gluon kernels call them as they are). Importable without triton
(then it defines nothing).
"""

from __future__ import annotations

from .epilogue_jit import AVAILABLE  # whether triton imports

if AVAILABLE:
    import triton
    import triton.language as tl

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
