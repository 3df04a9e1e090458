"""Padded batches: turn ``[b, s, ...]`` inputs with a padding mask into one packed sequence of
documents (what every magi key takes) and back.

Typical use (self-attention over a padded batch)::

    packed, packing = squash_batch(x, attention_mask)        # [tokens, ...], padding dropped
    key = magi_attn_varlen_key(packing.cu_seqlens, packing.cu_seqlens, hq, hk, d, cp_group, causal=True)
    ...                                                       # dispatch / calc_attn / undispatch
    y = unsquash_batch(out, packing)                          # [b, s, ...], zeros at padding

Each row of the batch becomes one document; the packed order keeps each row's tokens in order,
so a causal mask over a document is the row's causal mask. For cross-attention, squash the query
batch and the key/value batch separately and pair their ``cu_seqlens`` in the key
(:func:`magi_attn_varlen_cross_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BatchPacking", "batch_packing", "infer_varlen_mask_from_batch", "squash_batch", "squash_batch_dim",
           "unsquash_batch"]


@dataclass(frozen=True)
class BatchPacking:
    """How a ``[batch_size, seqlen]`` batch maps to one packed sequence.

    ``rows``: the flat ``b * s`` index of each packed token (None when every token is kept, in
    row-major order); ``cu_seqlens``: ``batch_size + 1`` document boundaries in the packed
    sequence (a fully padded row is an empty document)."""

    batch_size: int
    seqlen: int
    rows: torch.Tensor | None
    cu_seqlens: tuple[int, ...]

    @property
    def total_seqlen(self) -> int:
        """Tokens of the packed sequence."""
        return self.cu_seqlens[-1]


def _check_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The padding mask as a CPU bool ``[b, s]`` tensor (bool, or integer 0/1 as tokenizers give)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError("attention_mask must be a 2-D [batch, seq] padding mask (True / 1 = token, False / 0 = "
                         f"padding), got {type(attention_mask).__name__} of shape "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    m = attention_mask.detach().cpu()
    if m.dtype != torch.bool:
        if m.dtype.is_floating_point or m.dtype.is_complex or not bool(((m == 0) | (m == 1)).all()):
            raise ValueError(f"attention_mask must be bool or hold only 0 and 1, got a {m.dtype} tensor with other "
                             "values; a padding mask marks tokens, not an additive bias")
        m = m.bool()
    return m


def batch_packing(attention_mask: torch.Tensor) -> BatchPacking:
    """The packing of a padded batch: each row's tokens (one contiguous run: left or right
    padding) become one document. Reads the mask on the host (one device sync)."""
    m = _check_mask(attention_mask)
    b, s = m.shape
    lengths = m.sum(1).tolist()
    firsts = m.int().argmax(1).tolist()
    for r, (n, first) in enumerate(zip(lengths, firsts)):
        if n and not bool(m[r, first:first + n].all()):
            raise ValueError(f"row {r} of attention_mask has padding between its tokens; squash_batch takes left or "
                             "right padding (one run of tokens per row)")
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    rows = None if cu[-1] == b * s else torch.nonzero(m.reshape(-1)).reshape(-1).to(attention_mask.device)
    return BatchPacking(b, s, rows, tuple(cu))


def squash_batch(x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, BatchPacking]:
    """``x [b, s, ...]`` -> (``packed [tokens, ...]``, its :class:`BatchPacking`): the rows'
    tokens concatenated, padding (``attention_mask`` False / 0) dropped. Without a mask every
    token is kept (MagiAttention's ``squash_batch_dim`` plus the documents). Differentiable."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"squash_batch takes x of shape [batch, seq, ...], got {tuple(getattr(x, 'shape', ()))}")
    b, s = x.shape[:2]
    if attention_mask is None:
        packing = BatchPacking(b, s, None, tuple(range(0, b * s + 1, s)) if s else (0,) * (b + 1))
    else:
        if tuple(attention_mask.shape) != (b, s):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but x is [batch, seq]={(b, s)}")
        packing = batch_packing(attention_mask)
    return pack(x, packing), packing


def pack(x: torch.Tensor, packing: BatchPacking) -> torch.Tensor:
    """Another ``[b, s, ...]`` tensor of the same batch packed as ``packing`` says."""
    if tuple(x.shape[:2]) != (packing.batch_size, packing.seqlen):
        raise ValueError(f"x is [batch, seq]={tuple(x.shape[:2])} but the packing is of a "
                         f"{(packing.batch_size, packing.seqlen)} batch")
    flat = x.reshape(packing.batch_size * packing.seqlen, *x.shape[2:])
    return flat if packing.rows is None else flat.index_select(0, packing.rows.to(x.device))


def unsquash_batch(packed: torch.Tensor, packing: BatchPacking, pad_value: float = 0.0) -> torch.Tensor:
    """Inverse of :func:`squash_batch`: ``packed [tokens, ...]`` -> ``[b, s, ...]`` with
    ``pad_value`` at the padding. Differentiable (padding gets no gradient)."""
    if not isinstance(packing, BatchPacking):
        raise TypeError(f"packing must be the BatchPacking squash_batch returned, got {type(packing).__name__}")
    if packed.shape[0] != packing.total_seqlen:
        raise ValueError(f"unsquash_batch expects {packing.total_seqlen} packed rows (the packing's tokens), "
                         f"got {packed.shape[0]}")
    b, s = packing.batch_size, packing.seqlen
    if packing.rows is None:
        return packed.reshape(b, s, *packed.shape[1:])
    full = packed.new_full((b * s, *packed.shape[1:]), pad_value)
    return full.index_copy(0, packing.rows.to(packed.device), packed).reshape(b, s, *packed.shape[1:])


def squash_batch_dim(x: torch.Tensor) -> torch.Tensor:
    """MagiAttention's name: ``[b, s, ...]`` -> ``[b * s, ...]`` (no padding; see :func:`squash_batch`)."""
    return squash_batch(x)[0]


def infer_varlen_mask_from_batch(batch_size: int, seq_len: int,
                                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """MagiAttention's name: ``(cu_seqlens_q, cu_seqlens_k)`` (int32) of ``batch_size`` unpadded
    rows of ``seq_len`` tokens, each its own document."""
    for name, n in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    cu = torch.arange(batch_size + 1, dtype=torch.int32, device=device) * seq_len
    return cu, cu.clone()
