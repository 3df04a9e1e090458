"""FlashAttention-4 (``flash-attn-4``, the CuTe-DSL kernels) as a peer of ``bench/bench_kernels.py``.

Two routes, each timed beside magi in the same process:

* ``fa4``: FA4's own API for the masks it expresses natively: full and causal
  (``flash_attn_func``), varlen full and varlen causal (``flash_attn_varlen_func`` over the
  mask's documents), sliding window (``window_size=(window - 1, 0)``).
* ``fa4flex``: FlexAttention with ``kernel_options={"BACKEND": "FLASH"}``: torch lowers the mask
  function and block mask to FA4's ``mask_mod`` plus block sparsity. This reaches every mask
  (varlen block-causal too) and shows what the ``mask_mod`` route costs on the masks FA4 also
  has natively.

FA4 is not a dependency of magi: when it is missing, ``fa4_missing()`` says why and the bench
records that instead of times.
"""

from __future__ import annotations

from typing import Callable

import torch


def fa4_missing() -> str | None:
    """None when ``flash_attn.cute`` imports, else the reason it does not."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no FA4 here"
        return f"flash-attn-4 is not importable: {e!r}"[:200]
    return None


def document_bounds(slices) -> list[int]:
    """cu_seqlens of a varlen mask (one slice per document, in order)."""
    ends = sorted({s.q_range.end for s in slices})
    return [0] + ends


def fa4_native(mask: str, slices, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
               softcap: float = 0.0, sink: torch.Tensor | None = None) -> Callable[[], torch.Tensor] | None:
    """A callable returning FA4's output ``[S, hq, d]`` for ``mask`` through its own API, or None
    when FA4 has no native form of the mask. ``q, k, v``: ``[S, h, d]`` leaf tensors; ``softcap``
    (tanh cap of the scaled logits) and ``sink`` (fp32 ``[hq]`` learnable sink logits) as magi's."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    common = {"softcap": softcap, "learnable_sink": sink}
    if mask in ("full", "causal", "sliding_window"):
        kw = {"causal": mask == "causal", **common}
        if mask == "sliding_window":  # make_mask: `window` keys per query, itself included
            kw["window_size"] = (window - 1, 0)
        return lambda: flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), **kw)[0][0]
    if mask in ("varlen_full", "varlen_causal"):
        cu_list = document_bounds(slices)
        cu = torch.tensor(cu_list, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(cu_list, cu_list[1:]))
        return lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                              max_seqlen_k=longest, causal=mask == "varlen_causal", **common)[0]
    return None


def fa4_through_flex(flex, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, block_mask,
                     score_mod=None) -> Callable:
    """FlexAttention's FLASH backend (FA4 kernels with mask_mod and block sparsity) on the same
    compiled flex_attention, block mask and score_mod (softcap) as the Triton Flex peer;
    ``qf, kf, vf`` ``[1, h, S, d]``."""
    return lambda: flex(qf, kf, vf, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                        kernel_options={"BACKEND": "FLASH"})
