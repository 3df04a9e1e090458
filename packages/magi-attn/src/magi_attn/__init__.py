"""magi-attn: context-parallel attention with arbitrary masks.

Typical use::

    key = magi_attn_varlen_key(cu_seqlens, cu_seqlens, hq, hk, d, cp_group, causal=True)
    q, k, v = (dispatch(t, key) for t in (q, k, v))  # this rank's tokens
    out, lse = calc_attn(q, k, v, key)
    out = undispatch(out, key)                         # back to global order

Another mask over the same dispatched tokens (e.g. a sliding-window layer)::

    swa = magi_attn_varlen_key_for_new_mask(key, cu_seqlens, cu_seqlens, causal=True, window_size=(512, 0))
    out2, lse2 = calc_attn(q, k, v, swa)
"""

import logging
import os

from magi_kernels import flex_flash_attn_func
from magi_solver import AttnMaskType, AttnRange, AttnRanges, AttnSlice, DispatchConfig, OverlapConfig

from .api import (
    DistAttnKey,
    calc_attn,
    clear_cache,
    dispatch,
    get_most_recent_key,
    get_position_ids,
    magi_attn_flex_key,
    magi_attn_flex_key_for_new_mask,
    magi_attn_varlen_key,
    magi_attn_varlen_key_for_new_mask,
    make_flex_key_for_new_mask_after_dispatch,
    make_varlen_key_for_new_mask_after_dispatch,
    undispatch,
)
from .agreement import PlanMismatchError
from .config import DistAttnConfig
from .launch import WorkerEnv, exit_worker, init_worker, launched_env, run_workers
from .roll import roll
from magi_comm import PeerFailureError

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

_level = os.environ.get("MAGI_LOG_LEVEL")
if _level:
    logging.getLogger("magi_attn").setLevel(_level.upper())

__all__ = [
    "AttnMaskType", "AttnRange", "AttnRanges", "AttnSlice", "DispatchConfig", "DistAttnConfig", "DistAttnKey",
    "OverlapConfig", "calc_attn", "clear_cache", "dispatch", "flex_flash_attn_func",
    "get_most_recent_key", "get_position_ids", "magi_attn_flex_key", "magi_attn_flex_key_for_new_mask",
    "magi_attn_varlen_key", "magi_attn_varlen_key_for_new_mask", "make_flex_key_for_new_mask_after_dispatch",
    "make_varlen_key_for_new_mask_after_dispatch", "undispatch",
    "PeerFailureError", "PlanMismatchError", "roll", "WorkerEnv", "exit_worker", "init_worker", "launched_env", "run_workers",
]
