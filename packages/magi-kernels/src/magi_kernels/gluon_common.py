"""What the warp-specialised Hopper kernels (``gluon_fwd``, ``gluon_bwd``) share: the Gluon
imports, the register split between the loader warp and the consumer warpgroups, the
support check, the slice loader and the TMA descriptor.

Importable without a GPU; ``AVAILABLE`` says whether Gluon is present."""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = True
except ImportError:  # no Triton, or a Triton without Gluon
    AVAILABLE = False

MAX_REGS = 168  # 168 x 384 threads: the loader's warpgroup at 24, the consumers get 240


@functools.lru_cache(maxsize=256)
def sm_count(device: torch.device) -> int:
    """The device's SMs (the list-schedule models of the launch orders run one program per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def hopper_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: Collection[int]) -> bool:
    """Whether a Gluon kernel tuned for ``head_dims`` can run on these inputs: Gluon present,
    an sm90 GPU, bf16/fp16 and 16-byte aligned rows (TMA)."""
    if not AVAILABLE or q.device.type != "cuda" or q.shape[-1] not in head_dims:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return all(t.data_ptr() % 16 == 0 and t.dtype in (torch.bfloat16, torch.float16) for t in (q, k, v))


if AVAILABLE:
    LOADER_REGS = gl.constexpr(24)
    CONSUMER_REGS = gl.constexpr(240)

    @gluon.jit
    def load_slice(META, MEMBERS, i):
        """(qs, qe, ks, ke, inv_causal, causal) of the slice that is member ``i`` of a tile."""
        sid = gl.load(MEMBERS + i)
        t = gl.load(META + sid * 5 + 4)
        return (gl.load(META + sid * 5 + 0), gl.load(META + sid * 5 + 1), gl.load(META + sid * 5 + 2),
                gl.load(META + sid * 5 + 3), (t & 2) != 0, (t & 1) != 0)

    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}

    @functools.lru_cache(maxsize=None)
    def shared_layout(rows: int, cols: int, dtype: torch.dtype) -> "gl.NVMMASharedLayout":
        """The default NVMMA shared layout of a rows x cols box (memoised: building it runs
        Triton's constexpr machinery, about half of a descriptor's host cost per launch)."""
        return gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPES[dtype])

    def descriptor(x: torch.Tensor, rows: int) -> "TensorDescriptor":
        """TMA descriptor over a [tokens, heads, d] tensor as [tokens, heads*d], box rows x d."""
        flat = x.view(x.shape[0], -1)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, x.shape[-1]],
                                shared_layout(rows, x.shape[-1], x.dtype))
