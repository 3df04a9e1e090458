"""Host-side values derived from a tensor, computed once per tensor object.

Reading a GPU tensor on the host (``.tolist()``) synchronises the device. Metadata tensors
(slice ranges, packed position ids, ``cu_seqlens``) are passed unchanged to every layer of a
forward, so their host form is memoised per tensor object and in-place version: the first
call pays the read, later calls a dictionary lookup. Entries die with their tensor.

The other way, tables built on the host go to the GPU with ``upload``, which does not wait for
the device either; ``on_device`` does that once per host tensor (plan row indices that every
layer and collective reads), memoised the same way.

This is the one such cache of the magi packages: magi-comm and magi-attn use it too.
"""

from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_MEMO: dict[tuple[int, str], tuple] = {}


def per_tensor(t: torch.Tensor, tag: str, compute: Callable[[], T], *others: torch.Tensor) -> T:
    """``compute()`` once per (``t``, its in-place version, ``tag``, identity and version of
    ``others``); ``tag`` separates different values derived from the same tensor."""
    key = (id(t), tag)
    stamp = (t._version, *(id(o) for o in others), *(o._version for o in others))
    hit = _MEMO.get(key)
    if hit is not None and hit[0]() is t and hit[1] == stamp:
        return hit[2]
    value = compute()
    _MEMO[key] = (weakref.ref(t, lambda _, k=key: _MEMO.pop(k, None)), stamp, value)
    return value


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, without a host sync.

    A plain ``.to("cuda")`` of pageable memory copies and then synchronises the stream, so the
    host would wait for every kernel already queued (a new mask in a training step stalls the
    launch queue). From pinned memory the copy is queued on the current stream instead, behind
    those kernels and ahead of the ones that read it; torch's pinned-memory cache keeps the
    buffer until the copy has run. The tables are read on the stream that uploaded them (the
    launch that built them); another stream may use them once that launch has been ordered
    before it, as any tensor made on one stream and read on another must be.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def on_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: itself where it already lives there, else one cached copy per
    (``t``, its in-place version, device), uploaded without a host sync (:func:`upload`).

    Plans keep their row indices as CPU tensors; a plain ``.to("cuda")`` at every collective
    of every layer would make the host wait for all queued kernels each time. Treat the result
    as read-only: every caller shares it. Entries die with ``t``.
    """
    device = torch.device(device)
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return per_tensor(t, f"on_device {device}", lambda: upload(t, device))
