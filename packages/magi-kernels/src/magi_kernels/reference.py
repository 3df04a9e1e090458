"""Pure-torch Flex-Flash-Attention: runs on CPU and GPU in any float dtype.

It is the correctness reference and the fallback backend. Each slice is processed in blocks of
query rows, keys are pruned to the block's unmasked extent, and results are merged into fp32
(fp64 for fp64 inputs) accumulators with the LSE rule, exactly like the fused kernels.
"""

from __future__ import annotations

import torch

from .lse import merge_out_lse

_BLOCK_ELEMS = 1 << 22  # score elements per block: bounds memory of one step


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_bounds(rows: torch.Tensor, qs: int, qe: int, ks: int, ke: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row key interval [lo, hi) of a slice (design table: CAUSAL bottom-right, INV top-left)."""
    lo = torch.full_like(rows, ks)
    hi = torch.full_like(rows, ke)
    if t & 2:
        lo = torch.maximum(lo, rows + (ks - qs))
    if t & 1:
        hi = torch.minimum(hi, rows + (ke - qe) + 1)
    return lo, hi


def _blocks(qs: int, qe: int, ks: int, ke: int, t: int, hq: int):
    """Yield (a, b, k0, k1, mask) row blocks of a slice, with keys pruned to [k0, k1)."""
    sk = max(ke - ks, 1)
    step = max(16, _BLOCK_ELEMS // (sk * max(hq, 1)))
    for a in range(qs, qe, step):
        b = min(a + step, qe)
        rows = torch.arange(a, b)
        lo, hi = _row_bounds(rows, qs, qe, ks, ke, t)
        k0, k1 = int(lo.min()), int(hi.max())
        if k1 <= k0:
            continue
        cols = torch.arange(k0, k1)
        mask = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        if not bool(mask.any()):
            continue
        yield a, b, k0, k1, mask


def _scores(qb: torch.Tensor, kb: torch.Tensor, scale: float, softcap: float):
    """Raw scores [hk, g, rows, keys] and tanh(raw/softcap) (None without softcap)."""
    rows, hq, d = qb.shape
    hk = kb.shape[1]
    qg = qb.view(rows, hk, hq // hk, d)
    s = torch.einsum("qhgd,khd->hgqk", qg, kb) * scale
    if softcap > 0:
        th = torch.tanh(s / softcap)
        return softcap * th, th
    return s, None


def ffa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slices: list[tuple[int, int, int, int, int]],
    softmax_scale: float,
    softcap: float = 0.0,
    acc_out: bool = False,
    row_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [tq, hq, d]`` (q.dtype, or the accumulator dtype with ``acc_out``) and
    ``lse [tq, hq]`` (fp32, fp64 for fp64 input). ``row_max`` (``[tq, hq]``): max-merged in
    place with each row's largest scaled (and softcapped) logit over its unmasked keys."""
    tq, hq, d = q.shape
    hk = k.shape[1]
    cd = acc_dtype(q.dtype)
    out = torch.zeros(tq, hq, d, dtype=cd, device=q.device)
    lse = torch.full((tq, hq), float("-inf"), dtype=cd, device=q.device)
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    for qs, qe, ks, ke, t in slices:
        for a, b, k0, k1, mask in _blocks(qs, qe, ks, ke, t, hq):
            s, _ = _scores(qc[a:b], kc[k0:k1], softmax_scale, softcap)
            s = s.masked_fill(~mask.to(q.device), float("-inf"))
            if row_max is not None:
                blk_max = s.amax(dim=-1).permute(2, 0, 1).reshape(b - a, hq)
                row_max[a:b] = torch.maximum(row_max[a:b], blk_max.to(row_max.dtype))
            blk_lse = torch.logsumexp(s, dim=-1)  # [hk, g, rows]
            p = torch.exp(s - torch.where(torch.isfinite(blk_lse), blk_lse, 0.0).unsqueeze(-1))
            o = torch.einsum("hgqk,khd->qhgd", p, vc[k0:k1]).reshape(b - a, hq, d)
            blk_lse = blk_lse.permute(2, 0, 1).reshape(b - a, hq)
            out[a:b], lse[a:b] = merge_out_lse(out[a:b], lse[a:b], o, blk_lse)
    return (out if acc_out else out.to(q.dtype)), lse


def ffa_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    slices: list[tuple[int, int, int, int, int]],
    softmax_scale: float,
    softcap: float = 0.0,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the slices' attention given the *final* ``out``/``lse`` of the rows.

    Because the probabilities use the final LSE, calling this once per stage (each with its own
    KV) and summing gives the exact gradient of the merged result. ``dlse`` is the gradient
    flowing into ``lse`` (it shifts the row term ``delta``). Returns fp32/fp64 accumulators.
    """
    tq, hq, d = q.shape
    hk = k.shape[1]
    cd = acc_dtype(q.dtype)
    qc, kc, vc, doc = q.to(cd), k.to(cd), v.to(cd), do.to(cd)
    delta = (doc * out.to(cd)).sum(-1)  # [tq, hq]
    if dlse is not None:
        delta = delta - dlse.to(cd)
    lse_c = lse.to(cd)
    dq = torch.zeros(tq, hq, d, dtype=cd, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    g = hq // hk
    for qs, qe, ks, ke, t in slices:
        for a, b, k0, k1, mask in _blocks(qs, qe, ks, ke, t, hq):
            rows = b - a
            s, th = _scores(qc[a:b], kc[k0:k1], softmax_scale, softcap)
            row_lse = lse_c[a:b].reshape(rows, hk, g).permute(1, 2, 0).unsqueeze(-1)
            valid = mask.to(q.device) & torch.isfinite(row_lse)
            p = torch.where(valid, torch.exp(s - torch.where(torch.isfinite(row_lse), row_lse, 0.0)), 0.0)
            do_g = doc[a:b].view(rows, hk, g, d)
            dv[k0:k1] += torch.einsum("hgqk,qhgd->khd", p, do_g)
            dp = torch.einsum("qhgd,khd->hgqk", do_g, vc[k0:k1])
            row_delta = delta[a:b].reshape(rows, hk, g).permute(1, 2, 0).unsqueeze(-1)
            ds = p * (dp - row_delta)
            if th is not None:
                ds = ds * (1 - th * th)
            ds = ds * softmax_scale
            dq[a:b] += torch.einsum("hgqk,khd->qhgd", ds, kc[k0:k1]).reshape(rows, hq, d)
            dk[k0:k1] += torch.einsum("hgqk,qhgd->khd", ds, qc[a:b].view(rows, hk, g, d))
    return dq, dk, dv
