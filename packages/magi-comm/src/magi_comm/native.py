"""The optional native extension ``magi_comm._native`` (scikit-build-core + CMake + pybind11).

``AVAILABLE`` / ``WITH_CUDA`` say what was built; ``REASON`` says why not, and the fallback is
logged once at import. Every entry point has a pure-torch equivalent used when it is missing.

``CUDA_ARCHS`` lists what the CUDA kernels were compiled for (CMake ``CUDA_ARCHITECTURES``
entries such as ``80``, ``90a-real``, ``100``). Before the first launch on a GPU,
:func:`cuda_usable` checks its compute capability against that list (:func:`arch_covers`); a GPU
the build does not cover gets the PyTorch path, with a warning that says why.
"""

from __future__ import annotations

import functools
import logging
import re

import torch

from magi_kernels import on_device

logger = logging.getLogger(__name__)

try:
    from . import _native  # type: ignore[attr-defined]

    AVAILABLE, WITH_CUDA, REASON = True, bool(_native.WITH_CUDA), ""
except ImportError as e:  # not built (MAGI_SKIP_NATIVE, no compiler) or failed build
    _native = None
    AVAILABLE, WITH_CUDA, REASON = False, False, f"magi_comm._native not importable ({e})"
    logger.info("magi-comm: native extension unavailable, using the pure-Python path: %s", REASON)

# empty for a build without CUDA, or one made before the list was exported (then unchecked)
CUDA_ARCHS: tuple[str, ...] = tuple(a for a in str(getattr(_native, "CUDA_ARCHS", "")).split(",") if a)

_ARCH = re.compile(r"^(\d+)([af]?)(-real|-virtual)?$")


def arch_covers(archs: tuple[str, ...] | list[str], capability: tuple[int, int]) -> tuple[bool, str]:
    """Whether kernels built for ``archs`` (CMake ``CUDA_ARCHITECTURES`` entries) run on a GPU of
    compute ``capability`` (major, minor); returns ``(ok, why)``.

    CUDA's rules: sm_XY code runs on X.Z for Z >= Y (same major); sm_XYa code only on X.Y;
    sm_XYf code on X.Z for Z >= Y; compute_XY PTX is JIT-compiled on any capability >= X.Y
    (compute_XYa only on X.Y, compute_XYf within major X). ``NN`` carries both code and PTX,
    ``NN-real`` code only, ``NN-virtual`` PTX only. Entries this cannot read (``native``, ``all``)
    are trusted, and ``why`` says so.
    """
    major, minor = capability
    unknown = []
    for entry in archs:
        m = _ARCH.match(entry)
        if m is None:
            unknown.append(entry)
            continue
        num, suffix, kind = int(m.group(1)), m.group(2), m.group(3)
        a_major, a_minor = divmod(num, 10)
        has_code, has_ptx = kind != "-virtual", kind != "-real"
        if suffix == "a":  # arch-specific: code and PTX run on exactly that capability
            fits = (major, minor) == (a_major, a_minor)
        elif suffix == "f":  # family: same major, same or newer minor
            fits = major == a_major and minor >= a_minor
        else:
            fits = (has_code and major == a_major and minor >= a_minor) or (has_ptx and (major, minor) >= (a_major, a_minor))
        if fits:
            return True, f"sm_{major}{minor} is covered by {entry!r}"
    if unknown:
        return True, f"cannot check sm_{major}{minor} against {unknown} (trusted; a missing kernel image fails at launch)"
    return False, f"the CUDA kernels were built for {list(archs)}, which do not cover sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def cuda_usable(device_index: int) -> tuple[bool, str]:
    """``(ok, why)``: can the native CUDA kernels run on ``cuda:device_index``? Checked once per
    device (the first call initialises CUDA, so it is not done at import); a ``False`` is logged."""
    if not WITH_CUDA:
        return False, REASON or "magi_comm._native was built without CUDA"
    if not CUDA_ARCHS:
        return True, "this build does not list its CUDA architectures (built before the check existed); not checked"
    cap = tuple(torch.cuda.get_device_capability(device_index))
    ok, why = arch_covers(CUDA_ARCHS, cap)
    if not ok:
        logger.warning("magi-comm: native CUDA kernels disabled on cuda:%d: %s; using the PyTorch path "
                       "(rebuild magi-comm with MAGI_CUDA_ARCHS including %d%d to get them)", device_index, why, *cap)
    return ok, why


def native_build_info(device_index: int | None = None) -> dict:
    """What magi-comm's native extension was built with: ``available``, ``with_cuda``,
    ``cuda_archs``, ``reason`` (why it is missing), and with ``device_index`` given (a CUDA
    device; initialises CUDA) ``this_gpu``: whether its kernels run there and why."""
    info = {"available": AVAILABLE, "with_cuda": WITH_CUDA, "cuda_archs": list(CUDA_ARCHS), "reason": REASON}
    if device_index is not None:
        info["this_gpu"] = cuda_usable(device_index)[1]
    return info


def _require_cuda(device: torch.device) -> None:
    ok, why = cuda_usable(device.index if device.index is not None else torch.cuda.current_device())
    if not ok:
        raise RuntimeError(f"magi_comm native CUDA kernels cannot run on {device}: {why}")


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
    _require_cuda(src.device)
    n = (src_index if src_index is not None else dst_index if dst_index is not None else src).shape[0]
    row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
    _native.copy_rows(src.data_ptr(), dst.data_ptr(), _ptr(src_index), _ptr(dst_index), n, row_bytes,
                      torch.cuda.current_stream(src.device).cuda_stream)


def add_rows_f32(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None, dst_index: torch.Tensor | None) -> None:
    """``dst[dst_index] += src[src_index]`` for fp32 rows with atomics (repeated rows allowed)."""
    if src.dtype != torch.float32 or dst.dtype != torch.float32:
        raise TypeError(f"add_rows_f32 needs float32 tensors, got {src.dtype} and {dst.dtype}")
    _require_cuda(src.device)
    n = (src_index if src_index is not None else dst_index if dst_index is not None else src).shape[0]
    _native.add_rows_f32(src.data_ptr(), dst.data_ptr(), _ptr(src_index), _ptr(dst_index), n,
                         src[0].numel() if src.shape[0] else 0, torch.cuda.current_stream(src.device).cuda_stream)


def range_gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0 with the fused CUDA kernel (CUDA tensors, native build with CUDA),
    else ``index_select``."""
    if not (WITH_CUDA and x.is_cuda and x.is_contiguous() and cuda_usable(x.get_device())[0]):
        return x.index_select(0, on_device(index, x.device))
    idx = on_device(index, x.device).to(torch.int64).contiguous()
    out = x.new_empty((idx.numel(), *x.shape[1:]))
    copy_rows(x, out, idx, None)
    return out
