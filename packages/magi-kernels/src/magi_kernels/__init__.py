"""magi-kernels: Flex-Flash-Attention over (q_range, k_range, mask_type) slices."""

from .head_features import apply_sink, check_sink, common_head_dim, max_logits_of, new_row_max, pad_head_dim
from .host_cache import on_device, per_tensor, upload
from .interface import (
    BACKENDS,
    ffa_bwd,
    ffa_fwd,
    flex_flash_attn_func,
    resolve_backend,
    run_backward,
    run_forward,
    triton_available,
)
from .kernel_config import GluonBwdTiles, GluonFwdTiles, KernelConfig, TritonTiles, default_kernel_config
from .lse import merge_out_lse
from .plan import AttentionPlan, clear_caches, plan_attention
from .validation import check_qkv, check_scale_softcap

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

__all__ = ["AttentionPlan", "BACKENDS", "GluonBwdTiles", "GluonFwdTiles", "KernelConfig", "TritonTiles", "apply_sink",
           "check_qkv", "check_scale_softcap", "check_sink", "clear_caches", "common_head_dim", "default_kernel_config",
           "ffa_bwd", "ffa_fwd", "flex_flash_attn_func", "max_logits_of", "merge_out_lse", "new_row_max", "on_device", "pad_head_dim", "per_tensor", "plan_attention",
           "resolve_backend", "run_backward", "run_forward", "triton_available", "upload"]
