"""Argument checks shared by every backend: clear errors that name the argument and the fix."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from magi_solver import AttnRange, gc_paused

from .host_cache import per_tensor

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
        # no dtype given: float entries give a float tensor (rejected below), never truncated ints
        rows = [r.to_tuple() if isinstance(r, AttnRange) else tuple(r) for r in x]
        t = torch.tensor(rows) if rows else torch.empty(0, 2, dtype=torch.int32)
    _check_has_values(t, name)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"{name} must have shape [num_slices, 2] (half-open [start, end) rows), got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must hold integers (an int32 or int64 tensor, or a list of int pairs), got {t.dtype}")
    return t.to(dtype=torch.int32).contiguous()


def _check_has_values(t: torch.Tensor, name: str) -> None:
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values; pass it as a CPU tensor or a list "
                         "(or on q's device)")


def normalize_slices(q_ranges: Any, k_ranges: Any, attn_type_map: Any) -> SliceTensors:
    """int32 tensors of the slice metadata. Lists become CPU tensors and tensors keep their
    device: metadata on the CPU needs no device sync (the GPU backend uploads and caches it)."""
    qr = _as_range_tensor(q_ranges, "q_ranges")
    kr = _as_range_tensor(k_ranges, "k_ranges")
    if qr.device != kr.device:
        raise ValueError(f"q_ranges and k_ranges must be on one device, got {qr.device} and {kr.device}")
    if qr.shape[0] != kr.shape[0]:
        raise ValueError(f"q_ranges has {qr.shape[0]} slices but k_ranges has {kr.shape[0]}; they must match")
    n = qr.shape[0]
    if attn_type_map is None:
        tm = torch.zeros(n, dtype=torch.int32, device=qr.device)
    elif isinstance(attn_type_map, torch.Tensor):
        _check_has_values(attn_type_map, "attn_type_map")
        if attn_type_map.is_floating_point() or attn_type_map.is_complex() or attn_type_map.dtype == torch.bool:
            raise TypeError(f"attn_type_map must be an integer tensor of mask codes 0..3, got {attn_type_map.dtype}")
        tm = attn_type_map.to(device=qr.device, dtype=torch.int32).reshape(-1)
    else:
        from magi_solver import AttnMaskType

        items = [attn_type_map] * n if isinstance(attn_type_map, (str, int)) else list(attn_type_map)
        tm = torch.tensor([int(AttnMaskType.parse(t)) for t in items], dtype=torch.int32).to(qr.device)
    if tm.shape[0] != n:
        raise ValueError(f"attn_type_map has {tm.shape[0]} entries but there are {n} slices")
    return SliceTensors(qr, kr, tm.contiguous())


def check_slice_tensors(st: SliceTensors, tq: int, tk: int) -> None:
    """Every slice inside ``[0, tq) x [0, tk)`` with a known mask type, each (q, k) cell covered
    at most once (else a ``ValueError`` naming the argument and the slice). Cached per mask: the
    tensors' identity and in-place version (no device sync after the first call for GPU tensors),
    then a hash of their contents (masks rebuilt from lists on every call). Only the bounds
    against ``tq, tk`` are compared on every call."""
    q_end, k_end = per_tensor(st.q_ranges, "slices_checked", lambda: _checked_extent(st), st.k_ranges,
                              st.attn_type_map)
    if q_end > tq or k_end > tk:
        table = torch.cat([st.q_ranges, st.k_ranges, st.attn_type_map.reshape(-1, 1)], dim=1)
        _raise_out_of_bounds(table.tolist(), tq, tk)


_CHECKED: "OrderedDict[bytes, tuple[int, int]]" = OrderedDict()  # content digest -> (max q end, max k end)
_CHECKED_SIZE = 4096


def clear_checked() -> None:
    """Forget which slices were validated (the next call checks them again)."""
    _CHECKED.clear()


def _checked_extent(st: SliceTensors) -> tuple[int, int]:
    table = torch.cat([st.q_ranges, st.k_ranges, st.attn_type_map.reshape(-1, 1)], dim=1).cpu().contiguous()
    digest = hashlib.blake2b(table.numpy().tobytes(), digest_size=16).digest()
    hit = _CHECKED.get(digest)
    if hit is not None:
        _CHECKED.move_to_end(digest)
        return hit
    with gc_paused():
        extent = _check_rows(table.tolist())
    _CHECKED[digest] = extent
    while len(_CHECKED) > _CHECKED_SIZE:
        _CHECKED.popitem(last=False)
    return extent


def _check_rows(rows: Sequence[Sequence[int]]) -> tuple[int, int]:
    """Checks of ``(qs, qe, ks, ke, type)`` rows that need no sequence length; returns the
    largest q and k ends. Double coverage is the solver's check (``magi_solver.validate_slices``)."""
    from magi_solver import AttnMaskType, AttnRange, AttnSlice, validate_slices

    for i, (qs, qe, ks, ke, t) in enumerate(rows):
        if not 0 <= qs <= qe:
            raise ValueError(f"q_ranges[{i}]=[{qs}, {qe}) must satisfy 0 <= start <= end (half-open rows)")
        if not 0 <= ks <= ke:
            raise ValueError(f"k_ranges[{i}]=[{ks}, {ke}) must satisfy 0 <= start <= end (half-open rows)")
        if t not in (0, 1, 2, 3):
            raise ValueError(
                f"attn_type_map[{i}]={t} is not a mask type; use 0 full, 1 causal, 2 inv_causal, 3 bi_causal"
            )
    q_end = max((r[1] for r in rows), default=0)
    k_end = max((r[3] for r in rows), default=0)
    slices = [AttnSlice(AttnRange(qs, qe), AttnRange(ks, ke), AttnMaskType(t)) for qs, qe, ks, ke, t in rows]
    try:
        validate_slices(slices, q_end, k_end)
    except ValueError as e:
        raise ValueError(f"q_ranges, k_ranges, attn_type_map: {e}") from None
    return q_end, k_end


def _raise_out_of_bounds(rows: Sequence[Sequence[int]], tq: int, tk: int) -> None:
    for i, (qs, qe, ks, ke, _) in enumerate(rows):
        if qe > tq:
            raise ValueError(f"q_ranges[{i}]=[{qs}, {qe}) must satisfy 0 <= start <= end <= total_q={tq}")
        if ke > tk:
            raise ValueError(f"k_ranges[{i}]=[{ks}, {ke}) must satisfy 0 <= start <= end <= total_k={tk}")


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
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same [tokens, heads_kv], got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k head_dim {k.shape[2]}; q and k must share it "
                         "(v may have its own head dim, e.g. MLA's 192/128)")
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"num_heads_q={hq} must be a multiple of num_heads_kv={hk} (GQA/MQA)")


def check_accumulators(out: torch.Tensor | None, lse: torch.Tensor | None, q: torch.Tensor,
                       value_head_dim: int | None = None) -> None:
    """``out``/``lse`` of a previous partial result: shape ``[tokens, heads_q, value_head_dim]``
    (default q's head dim), q's dtype and device, and the lse shape and dtype this function returns."""
    if (out is None) != (lse is None):
        raise ValueError("pass both out and lse to accumulate into a previous result, or neither")
    if out is None:
        return
    assert lse is not None
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    expect = (*q.shape[:2], q.shape[2] if value_head_dim is None else value_head_dim)
    if tuple(out.shape) != expect:
        raise ValueError(f"out must have shape [tokens, heads_q, v head_dim]={expect}, got {tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype} (a previous result of this function), got {out.dtype}")
    if lse.shape != q.shape[:2]:
        raise ValueError(f"lse must have shape [tokens, heads_q]={tuple(q.shape[:2])}, got {tuple(lse.shape)}")
    if lse.dtype != lse_dtype:
        raise TypeError(
            f"lse must be {lse_dtype} for {q.dtype} inputs (the lse this function returns), got {lse.dtype}"
        )
    for name, t in (("out", out), ("lse", lse)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def check_scale_softcap(softmax_scale: float | None, softcap: float, head_dim: int) -> tuple[float, float]:
    """The softmax scale (default ``1/sqrt(head_dim)``) and softcap as floats, or a ``ValueError``
    naming the argument: the scale must be finite and > 0, the softcap finite and >= 0."""
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0 (None = 1/sqrt(head_dim)), got {softmax_scale}")
    cap = float(softcap)
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = no softcap), got {softcap}")
    return scale, cap
