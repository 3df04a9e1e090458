"""Dense references for tests: a float64 mask built straight from the slice table and plain
softmax attention through autograd. Independent of the blockwise/fused backends on purpose."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


def dense_mask(
    slices: Iterable[Sequence[int]], total_q: int, total_k: int, *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Boolean ``[total_q, total_k]`` mask of ``(qs, qe, ks, ke, type)`` slices; raises if a
    cell is covered twice."""
    cover = torch.zeros(total_q, total_k, dtype=torch.int32, device=device)
    for qs, qe, ks, ke, t in slices:
        sq, sk = qe - qs, ke - ks
        if sq <= 0 or sk <= 0:
            continue
        i = torch.arange(sq, device=device)[:, None]
        j = torch.arange(sk, device=device)[None, :]
        m = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if t & 1:  # causal, bottom-right aligned
            m &= j <= i + (sk - sq)
        if t & 2:  # inverse causal, top-left aligned
            m &= j >= i
        cover[qs:qe, ks:ke] += m.int()
    if int(cover.max()) > 1:
        raise ValueError("a (q, k) cell is covered by two slices")
    return cover.bool()


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    softmax_scale: float | None = None, softcap: float = 0.0, sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with a dense mask, GQA by repeating KV heads; v may have its own head dim.
    ``sink`` (``[hq]`` or ``[n, hq]``): extra logit columns in every row's softmax with no value.
    Returns (out, lse); rows without keys (and no sink) give out 0 and lse -inf. Differentiable."""
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    kk = k.repeat_interleave(hq // hk, dim=1)
    vv = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask[None], float("-inf"))
    if sink is not None:  # the sink columns take part in the softmax, then are dropped
        cols = sink.reshape(-1, hq).to(s.dtype).t()[:, None, :].expand(hq, s.shape[1], -1)
        lse = torch.logsumexp(torch.cat([s, cols], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    p = torch.where(mask[None], p, torch.zeros_like(p))
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, lse.transpose(0, 1)


def dense_max_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, softmax_scale: float | None = None,
                     softcap: float = 0.0) -> torch.Tensor:
    """Per query head, the largest scaled (and softcapped) logit over the unmasked cells of
    ``mask`` (``[hq]``, -inf for a head without any), in q's dtype: the max-logits reference."""
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(hq // hk, dim=1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~mask[None], float("-inf")).flatten(1).amax(dim=1)
