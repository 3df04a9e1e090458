"""Host-side values derived from a tensor, computed once per tensor object.

Reading a GPU tensor on the host (``.tolist()``) synchronises the device. Metadata tensors
(slice ranges, packed position ids, ``cu_seqlens``) are passed unchanged to every layer of a
forward, so their host form is memoised per tensor object and in-place version: the first
call pays the read, later calls a dictionary lookup. Entries die with their tensor.
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
