"""magi-attn: context-parallel attention with arbitrary masks.

Typical use::

    key = magi_attn_varlen_key(cu_seqlens, cu_seqlens, hq, hk, d, cp_group, causal=True)
    q, k, v = (dispatch(t, key) for t in (q, k, v))  # this rank's tokens
    out, lse = calc_attn(q, k, v, key)
    out = undispatch(out, key)                         # back to global order

Cross-attention (queries and keys from two sequences, e.g. video attending to text): see
:mod:`magi_attn.cross` (``magi_attn_cross_key``, ``dispatch_kv``). Padded ``[b, s]`` batches:
:mod:`magi_attn.batch` (``squash_batch`` / ``unsquash_batch``).

Another mask over the same dispatched tokens (e.g. a sliding-window layer)::

    swa = magi_attn_varlen_key_for_new_mask(key, cu_seqlens, cu_seqlens, causal=True, window_size=(512, 0))
    out2, lse2 = calc_attn(q, k, v, swa)
"""

import logging
import os

from magi_kernels import KernelConfig, flex_flash_attn_func
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
from .baselines import comm_rows_per_rank, contiguous_dispatch, ring_allgather_attn, ulysses_attn, zigzag_dispatch
from .batch import (
    BatchPacking, batch_packing, infer_varlen_mask_from_batch, squash_batch, squash_batch_dim, unsquash_batch,
)
from .config import COMM_BACKENDS, DistAttnConfig
from .cross import (
    CrossAttnKey, dispatch_kv, get_kv_position_ids, magi_attn_cross_key, magi_attn_varlen_cross_key, undispatch_kv,
)
from .launch import WorkerEnv, exit_worker, free_port, init_worker, launched_env, run_workers
from .masks import MASKS, cu_seqlens_of, make_mask, sample_doc_lengths
from .roll import roll
from magi_comm import PeerFailureError

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

_level = os.environ.get("MAGI_LOG_LEVEL")
if _level:
    logging.getLogger("magi_attn").setLevel(_level.upper())

__all__ = [
    "AttnMaskType", "AttnRange", "AttnRanges", "AttnSlice", "BatchPacking", "batch_packing", "CrossAttnKey", "DispatchConfig",
    "DistAttnConfig", "DistAttnKey", "KernelConfig", "dispatch_kv", "get_kv_position_ids", "infer_varlen_mask_from_batch",
    "magi_attn_cross_key", "magi_attn_varlen_cross_key", "squash_batch", "squash_batch_dim", "undispatch_kv",
    "unsquash_batch",
    "OverlapConfig", "calc_attn", "clear_cache", "dispatch", "flex_flash_attn_func",
    "get_most_recent_key", "get_position_ids", "magi_attn_flex_key", "magi_attn_flex_key_for_new_mask",
    "magi_attn_varlen_key", "magi_attn_varlen_key_for_new_mask", "make_flex_key_for_new_mask_after_dispatch",
    "make_varlen_key_for_new_mask_after_dispatch", "undispatch",
    "PeerFailureError", "PlanMismatchError", "roll", "WorkerEnv", "exit_worker", "init_worker", "launched_env", "run_workers",
    # configuration vocabulary, launch and benchmark helpers (named masks, context-parallel baselines)
    "COMM_BACKENDS", "MASKS", "comm_rows_per_rank", "contiguous_dispatch", "cu_seqlens_of", "free_port", "make_mask",
    "ring_allgather_attn", "sample_doc_lengths", "ulysses_attn", "zigzag_dispatch",
]
