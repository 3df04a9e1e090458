"""Fused GPU backend (Triton). Importable without triton; ``AVAILABLE`` says if it can run."""

from __future__ import annotations

SUPPORTED_HEAD_DIMS = (64, 128)

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    AVAILABLE = False  # set True once the kernels below are defined
except ImportError:  # CPU-only installs
    AVAILABLE = False


def supports_head_dim(d: int) -> bool:
    return d in SUPPORTED_HEAD_DIMS
