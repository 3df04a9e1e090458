"""Argument checks of the top-level API: errors that name the argument and the fix."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

_NEW_KEY = "build a new key (magi_attn_flex_key / magi_attn_varlen_key) with the current group"


def check_not_an_uninitialized_launch() -> None:
    """``cp_group=None`` plans for one rank. In a process launched as one of several
    (``WORLD_SIZE`` > 1) with no process group yet, that is almost surely ``dist.group.WORLD``
    read before ``init_process_group`` (it is None until then): refuse instead of planning for one rank."""
    world = os.environ.get("WORLD_SIZE", "1")
    if dist.is_available() and not dist.is_initialized() and world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"cp_group is None (one rank), but WORLD_SIZE={world} says this process is one of {world} and "
            "torch.distributed is not initialized; dist.group.WORLD is None until init_process_group, so the "
            "key would silently plan for one rank: call dist.init_process_group(...) before building the key"
        )


def check_group_alive(group: Any, cp_size: int, cp_rank: int) -> None:
    """The process group a key was built with is still registered, with the key's size and rank
    (a few microseconds: a registry lookup, no communication)."""
    if group is None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"the process group this key was built with was destroyed (torch.distributed is not "
                           f"initialized); {_NEW_KEY}")
    try:
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
    except (ValueError, RuntimeError):
        raise RuntimeError(f"the process group this key was built with was destroyed or replaced (it is no longer "
                           f"registered with torch.distributed); {_NEW_KEY}") from None
    if (size, rank) != (cp_size, cp_rank):
        raise RuntimeError(f"the process group this key was built with now has {size} ranks and this is rank {rank}, "
                           f"but the key was planned for rank {cp_rank} of {cp_size}; {_NEW_KEY}")


def cu_seqlens_list(cu: Any, name: str) -> list:
    """``cu`` as a Python list: a 1-D int32/int64 tensor (read on the host) or a sequence, whose
    entries the solver checks (ints, starting at 0, non-decreasing)."""
    if isinstance(cu, torch.Tensor):
        if cu.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no values; pass it as a CPU tensor or a list")
        if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor (or a list of ints), got a {cu.dim()}-D "
                            f"{cu.dtype} tensor of shape {tuple(cu.shape)}")
        return cu.tolist()
    if hasattr(cu, "tolist"):  # a NumPy array: float or nested entries are rejected by the solver
        return cu.tolist()
    if not isinstance(cu, Sequence) or isinstance(cu, (str, bytes)):
        raise TypeError(f"{name} must be a list of ints or a 1-D int32/int64 tensor, got {type(cu).__name__}")
    return list(cu)
