"""The softmax epilogue shared by the Triton and the Gluon kernels: the LSE of an online softmax
and the weights of an LSE merge with earlier layers.

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
