"""Attention features that are exact as a prologue or epilogue of the slice kernels, so every
backend (torch reference, Triton, Gluon) and the distributed path get them with no kernel change.

* Learnable attention sinks (GPT-OSS ``s_aux``, MagiAttention's ``sink``): one logit per query
  head (or several sink tokens per head) joins every row's softmax denominator and carries no
  value. On a finished result ``(out, lse)`` that is an LSE merge with an empty partial of LSE
  ``sink``: ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. Autograd through these
  two lines gives the sink's gradient and the ``dlse`` the kernels' backward already takes. Applied
  once, after every stage is merged, a sink counts exactly once per row.
* A value head dim other than the query/key head dim (MLA: 192 / 128): the narrower side is
  zero-padded to the wider one. Zero columns of q and k leave every score unchanged, zero columns
  of v give zero output columns, which are cut off; gradients flow through the pad and the cut.
  Cost: the kernel runs at the wider head dim (for 192/128: V moves and multiplies 1.5x the
  columns, about +20 % of the flops of QK^T + PV), plus one copy of the padded tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_sink(sink: torch.Tensor | None, q: torch.Tensor) -> None:
    """``sink``: None, or a float tensor ``[heads_q]`` (one logit per query head) or
    ``[sink_tokens, heads_q]``, finite, on q's device."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"sink must be a torch.Tensor of shape [heads_q] (one logit per query head), got "
                        f"{type(sink).__name__}")
    hq = q.shape[1]
    if sink.dim() not in (1, 2) or sink.shape[-1] != hq:
        raise ValueError(f"sink must be [heads_q]={hq} or [sink_tokens, heads_q], got shape {tuple(sink.shape)}")
    if not sink.dtype.is_floating_point:
        raise TypeError(f"sink must be a float tensor (fp32 recommended), got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"sink must be on q's device {q.device}, got {sink.device}")
    if sink.device.type == "meta":
        return
    # the finiteness test reads the values back, a host sync on a GPU: it runs once per content
    # of the tensor (its version counter moves on every in-place write: an optimizer step), not
    # on every layer call, recompute and distributed stage
    stamp = (sink._version, sink.data_ptr())
    if getattr(sink, "_magi_checked_finite", None) == stamp:
        return
    if not bool(torch.isfinite(sink).all()):
        raise ValueError("sink holds a NaN or an infinite logit; every sink logit must be finite")
    sink._magi_checked_finite = stamp


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the sink logits to every row's softmax denominator of a finished result.

    ``out [t, hq, dv]`` (any float dtype), ``lse [t, hq]`` (fp32/fp64); returns new tensors in
    the same dtypes. Rows that saw no key stay ``out = 0`` and get ``lse = sink``.
    Differentiable w.r.t. ``out``, ``lse`` and ``sink``.
    """
    sink = sink.to(lse.dtype)  # fp32 logits, combined at the lse's precision
    per_head = sink if sink.dim() == 1 else torch.logsumexp(sink, dim=0)
    new_lse = torch.logaddexp(lse, per_head)  # finite: the sink is
    keep = torch.exp(lse - new_lse)  # 0 where lse = -inf
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (out.to(acc) * keep.unsqueeze(-1).to(acc)).to(out.dtype), new_lse


def common_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head dim the kernel runs at: the wider of the query/key and the value head dim."""
    return max(q.shape[-1], v.shape[-1])


def pad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``t [..., d]`` zero-padded to ``head_dim`` columns (``t`` itself when it has them)."""
    return t if t.shape[-1] == head_dim else F.pad(t, (0, head_dim - t.shape[-1]))


def new_row_max(q: torch.Tensor) -> torch.Tensor:
    """The buffer the forward calls max-merge each row's largest scaled logit into (their
    ``row_max`` argument): fp32 ``[rows, heads_q]`` of -inf, for ``q [rows, heads_q, d]``."""
    return torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)


def max_logits_of(row_max: torch.Tensor) -> torch.Tensor:
    """Per query head, the max over the rows of a :func:`new_row_max` buffer (``[heads_q]``;
    -inf for a head without a logit, also when there are no rows)."""
    if row_max.shape[0] == 0:
        return row_max.new_full(row_max.shape[1:], float("-inf"))
    return row_max.amax(dim=0)
