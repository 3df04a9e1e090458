"""What the warp-specialised Hopper kernels (``gluon_fwd``, ``gluon_bwd``) share: the Gluon
imports, the register split between the loader warp and the consumer warpgroups, the SM
count, the slice loader, the TMA descriptor and the TMA reduce-add (the one piece built on
Triton internals).

Importable without a GPU; ``AVAILABLE`` says whether Gluon is present."""

from __future__ import annotations

import functools

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

REDUCE_ADD_AVAILABLE = False
if AVAILABLE:
    try:  # Triton internals for the TMA reduce-add (no public Gluon wrapper in 3.6)
        from triton._C.libtriton import ir
        from triton.experimental.gluon.language._core import builtin

        REDUCE_ADD_AVAILABLE = True
    except ImportError:
        pass

MAX_REGS = 168  # 168 x 384 threads: the loader's warpgroup at 24, the consumers get 240


@functools.lru_cache(maxsize=256)
def sm_count(device: torch.device) -> int:
    """The device's SMs (the list-schedule models of the launch orders run one program per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


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


if REDUCE_ADD_AVAILABLE:

    @builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA bulk reduce-add of shared memory ``src`` into the descriptor's tensor at ``coord``
        (asynchronous; ``tma.store_wait`` waits for it). Triton 3.6's Gluon builds the op but has
        no Python wrapper for it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
