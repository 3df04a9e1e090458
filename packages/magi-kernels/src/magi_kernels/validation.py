"""Argument checks shared by every backend: clear errors that name the argument and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class SliceTensors:
    """Slice metadata as int32 tensors."""

    q_ranges: torch.Tensor  # [N, 2]
    k_ranges: torch.Tensor  # [N, 2], same device as q_ranges
    attn_type_map: torch.Tensor  # [N]


def _as_range_tensor(x: Any, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    else:
        if hasattr(x, "to_list"):  # magi_solver.AttnRanges
            x = x.to_list()
        t = torch.tensor([tuple(r) for r in x] if len(x) else [], dtype=torch.int32).reshape(-1, 2)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"{name} must have shape [num_slices, 2] (half-open [start, end) rows), got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an integer tensor (int32), got {t.dtype}")
    return t.to(dtype=torch.int32).contiguous()


def normalize_slices(q_ranges: Any, k_ranges: Any, attn_type_map: Any) -> SliceTensors:
    """int32 tensors of the slice metadata. Lists become CPU tensors and tensors keep their
    device: metadata on the CPU needs no device sync (the GPU backend uploads and caches it)."""
    qr = _as_range_tensor(q_ranges, "q_ranges")
    kr = _as_range_tensor(k_ranges, "k_ranges")
    if qr.shape[0] != kr.shape[0]:
        raise ValueError(f"q_ranges has {qr.shape[0]} slices but k_ranges has {kr.shape[0]}; they must match")
    n = qr.shape[0]
    if attn_type_map is None:
        tm = torch.zeros(n, dtype=torch.int32, device=qr.device)
    elif isinstance(attn_type_map, torch.Tensor):
        tm = attn_type_map.to(device=qr.device, dtype=torch.int32).reshape(-1)
    else:
        from magi_solver import AttnMaskType

        items = [attn_type_map] * n if isinstance(attn_type_map, (str, int)) else list(attn_type_map)
        tm = torch.tensor([int(AttnMaskType.parse(t)) for t in items], dtype=torch.int32).to(qr.device)
    if tm.shape[0] != n:
        raise ValueError(f"attn_type_map has {tm.shape[0]} entries but there are {n} slices")
    return SliceTensors(qr, kr, tm.contiguous())


def check_slices_host(
    q_ranges: Sequence[Sequence[int]], k_ranges: Sequence[Sequence[int]], types: Sequence[int], tq: int, tk: int
) -> None:
    for i, ((qs, qe), (ks, ke), t) in enumerate(zip(q_ranges, k_ranges, types)):
        if not (0 <= qs <= qe <= tq):
            raise ValueError(f"q_ranges[{i}]=[{qs}, {qe}) must satisfy 0 <= start <= end <= total_q={tq}")
        if not (0 <= ks <= ke <= tk):
            raise ValueError(f"k_ranges[{i}]=[{ks}, {ke}) must satisfy 0 <= start <= end <= total_k={tk}")
        if t not in (0, 1, 2, 3):
            raise ValueError(f"attn_type_map[{i}]={t} is not a mask type; use 0 full, 1 causal, 2 inv_causal, 3 bi_causal")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k head_dim {k.shape[2]}")
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"num_heads_q={hq} must be a multiple of num_heads_kv={hk} (GQA/MQA)")


def check_accumulators(out: torch.Tensor | None, lse: torch.Tensor | None, q: torch.Tensor) -> None:
    if (out is None) != (lse is None):
        raise ValueError("pass both out and lse to accumulate into a previous result, or neither")
    if out is None:
        return
    assert lse is not None
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if lse.shape != q.shape[:2]:
        raise ValueError(f"lse must have shape [tokens, heads_q]={tuple(q.shape[:2])}, got {tuple(lse.shape)}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"lse must be float32 (or float64), got {lse.dtype}")
