"""The optional native extension ``magi_comm._native`` (scikit-build-core + CMake + pybind11).

``AVAILABLE`` / ``WITH_CUDA`` say what was built; ``REASON`` says why not, and the fallback is
logged once at import. Every entry point has a pure-torch equivalent used when it is missing.
"""

from __future__ import annotations

import logging

import torch

from .device_index import on_device

logger = logging.getLogger(__name__)

try:
    from . import _native  # type: ignore[attr-defined]

    AVAILABLE, WITH_CUDA, REASON = True, bool(_native.WITH_CUDA), ""
except ImportError as e:  # not built (MAGI_SKIP_NATIVE, no compiler) or failed build
    _native = None
    AVAILABLE, WITH_CUDA, REASON = False, False, f"magi_comm._native not importable ({e})"
    logger.info("magi-comm: native extension unavailable, using the pure-Python path: %s", REASON)


def cast_index_rows(input_split_sizes, dst_indices, output_split_sizes, src_index, world):
    """C++ twin of the row-index construction (same result as the Python one)."""
    send, send_counts, recv, recv_counts = _native.cast_index_plan(
        list(input_split_sizes), [list(d) for d in dst_indices], list(output_split_sizes), list(src_index), world
    )
    as_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.int64) if b else torch.empty(0, dtype=torch.long)  # noqa: E731
    return as_t(send), tuple(send_counts), as_t(recv), tuple(recv_counts)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None, dst_index: torch.Tensor | None) -> None:
    """``dst[dst_index] = src[src_index]`` along dim 0 in one CUDA launch (indices: int64 on the
    device, ``None`` = identity). ``dst`` may be a CUDA IPC mapping of another process's memory."""
    n = (src_index if src_index is not None else dst_index if dst_index is not None else src).shape[0]
    row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
    _native.copy_rows(src.data_ptr(), dst.data_ptr(), _ptr(src_index), _ptr(dst_index), n, row_bytes,
                      torch.cuda.current_stream(src.device).cuda_stream)


def add_rows_f32(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None, dst_index: torch.Tensor | None) -> None:
    """``dst[dst_index] += src[src_index]`` for fp32 rows with atomics (repeated rows allowed)."""
    if src.dtype != torch.float32 or dst.dtype != torch.float32:
        raise TypeError(f"add_rows_f32 needs float32 tensors, got {src.dtype} and {dst.dtype}")
    n = (src_index if src_index is not None else dst_index if dst_index is not None else src).shape[0]
    _native.add_rows_f32(src.data_ptr(), dst.data_ptr(), _ptr(src_index), _ptr(dst_index), n,
                         src[0].numel() if src.shape[0] else 0, torch.cuda.current_stream(src.device).cuda_stream)


def range_gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0 with the fused CUDA kernel (CUDA tensors, native build with CUDA),
    else ``index_select``."""
    if not (WITH_CUDA and x.is_cuda and x.is_contiguous()):
        return x.index_select(0, on_device(index, x.device))
    idx = on_device(index, x.device).to(torch.int64).contiguous()
    out = x.new_empty((idx.numel(), *x.shape[1:]))
    copy_rows(x, out, idx, None)
    return out
