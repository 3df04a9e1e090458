"""Log-sum-exp merge of partial attention results (the online-softmax combine)."""

from __future__ import annotations

import torch


def merge_out_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets of the same rows.

    ``out_*``: ``[t, h, d]``, ``lse_*``: ``[t, h]``. Rows where both LSEs are ``-inf`` (no key
    seen yet) stay ``out = 0, lse = -inf``. Differentiable; returns new tensors in the dtype of
    ``out_a`` / ``lse_a``.
    """
    lse = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    wb = torch.where(finite, torch.exp(lse_b.to(lse_a.dtype) - safe), torch.zeros_like(lse))
    acc = out_a.dtype if out_a.dtype == torch.float64 else torch.float32
    out = out_a.to(acc) * wa.unsqueeze(-1).to(acc) + out_b.to(acc) * wb.unsqueeze(-1).to(acc)
    return out.to(out_a.dtype), lse
