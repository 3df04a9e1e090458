"""Row-index tensors of cached plans on the device they index, copied there once.

Plans keep their row indices as CPU tensors (built on the host, cached per argument set). A
plain ``rows.to("cuda")`` at every call would copy from pageable memory and then synchronise
the stream, each time: the host would wait for all queued kernels once per collective per
layer, and the launch queue would drain. Here each CPU tensor is copied once per device, from
pinned memory without blocking the host (queued on the current stream), and the copy lives as
long as the CPU tensor does.
"""

from __future__ import annotations

import weakref

import torch

_COPIES: dict[tuple[int, torch.device], tuple[weakref.ref, int, torch.Tensor]] = {}


def on_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: itself where it already lives there, else a cached copy (made again
    if ``t`` was changed in place). Treat the result as read-only: it is shared by every caller."""
    device = torch.device(device)
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(t), device)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    copy = t.pin_memory().to(device, non_blocking=True)
    _COPIES[key] = (weakref.ref(t, lambda _, k=key: _COPIES.pop(k, None)), t._version, copy)
    return copy
