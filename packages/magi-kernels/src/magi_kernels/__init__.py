"""magi-kernels: Flex-Flash-Attention over (q_range, k_range, mask_type) slices."""

from .head_features import apply_sink, check_sink, common_head_dim, pad_head_dim
from .host_cache import on_device, per_tensor, upload
from .interface import BACKENDS, ffa_bwd, ffa_fwd, flex_flash_attn_func, resolve_backend, run_backward, run_forward
from .lse import merge_out_lse

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

__all__ = ["BACKENDS", "apply_sink", "check_sink", "common_head_dim", "pad_head_dim", "ffa_bwd", "ffa_fwd", "flex_flash_attn_func", "merge_out_lse", "on_device", "per_tensor", "resolve_backend", "run_backward",
           "run_forward", "upload"]
