"""Public kernel API: ``flex_flash_attn_func`` and its torch.library ops.

Forward and backward are ``torch.library.custom_op`` s with fake (meta) implementations, so the
kernel works under ``torch.compile`` and autograd on every backend.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from . import reference
from .head_features import apply_sink, check_sink, common_head_dim, max_logits_of, new_row_max, pad_head_dim
from .kernel_config import KernelConfig, config_json, resolve_kernel_config
from .lse import merge_out_lse
from .plan import AttentionPlan, call_plan
from .validation import (
    SliceTensors,
    check_accumulators,
    check_qkv,
    check_scale_softcap,
    check_slice_tensors,
    normalize_slices,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
_GPU_DTYPES = (torch.float16, torch.bfloat16)


def _load_triton():
    try:
        from . import triton_backend
    except ImportError as e:  # triton missing or broken
        logger.debug("triton backend unavailable: %s", e)
        return None
    return triton_backend if triton_backend.AVAILABLE else None


_TRITON = _load_triton()  # resolved once at import: keeps the hot path (and torch.compile) free of imports


def _triton_module():
    return _TRITON


def triton_available() -> bool:
    """Whether the Triton GPU backend can run in this process (Triton importable and working)."""
    return _TRITON is not None


@functools.lru_cache(maxsize=None)
def _warn_slow_head_dim(d: int, supported: tuple[int, ...]) -> None:
    """Once per head dim: a GPU call that auto-selects the (slow) torch backend says why."""
    logger.warning("head_dim %d has no Triton kernel (supported: multiples of 8 up to %d): backend='auto' runs the "
                   "torch reference backend on the GPU, which is much slower; pad heads to a supported size",
                   d, max(supported))


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """Pick the backend for these inputs; ``auto`` = triton on CUDA fp16/bf16, else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    tri = _triton_module()
    fast_ok = tri is not None and q.is_cuda and q.dtype in _GPU_DTYPES and tri.supports_head_dim(q.shape[-1])
    if backend == "auto":
        if not fast_ok and tri is not None and q.is_cuda and q.dtype in _GPU_DTYPES and not torch.compiler.is_compiling():
            _warn_slow_head_dim(q.shape[-1], tri.SUPPORTED_HEAD_DIMS)
        return "triton" if fast_ok else "torch"
    if backend == "triton" and not fast_ok:
        why = (
            "triton is not installed" if tri is None else
            "inputs are not on a CUDA device" if not q.is_cuda else
            f"dtype {q.dtype} is not float16/bfloat16" if q.dtype not in _GPU_DTYPES else
            f"head_dim {q.shape[-1]} is not supported (use a multiple of 8 up to {max(tri.SUPPORTED_HEAD_DIMS)}; "
            f"{tri.SUPPORTED_HEAD_DIMS} run unpadded)"
        )
        raise ValueError(f"backend='triton' cannot run: {why}; use backend='torch' or 'auto'")
    return backend


def _host_slices(qr: torch.Tensor, kr: torch.Tensor, tm: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    return [(a, b, c, d, t) for (a, b), (c, d), t in zip(qr.tolist(), kr.tolist(), tm.tolist())]


@torch.library.custom_op("magi_kernels::ffa_fwd", mutates_args=())
def ffa_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type_map: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str, acc_out: bool = False, check_ranges: bool = False,
    kernel_config: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (q's dtype, or the fp32/fp64 accumulator dtype with ``acc_out``) and lse.
    ``check_ranges`` validates the slices first (cached per mask): a ``torch.compile`` graph
    cannot read the ranges, so ``flex_flash_attn_func`` checks them here, when the op runs.
    ``kernel_config``: ``KernelConfig.to_json()`` ("" = the process default)."""
    if check_ranges:
        check_slice_tensors(SliceTensors(q_ranges, k_ranges, attn_type_map), q.shape[0], k.shape[0])
    return _forward_impl(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend, acc_out,
                         KernelConfig.from_json(kernel_config))


def _forward_impl(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend, acc_out=False,
                  config: KernelConfig | None = None, plan: AttentionPlan | None = None,
                  row_max: torch.Tensor | None = None):
    """The forward on ``backend`` (the custom op's body; the eager autograd path calls it directly).
    ``row_max``: fp32 ``[tq, hq]``, max-merged in place with each row's largest scaled logit."""
    if backend == "triton":
        tri = _triton_module()
        return tri.ffa_forward(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, acc_out, config,
                               plan, row_max)
    return reference.ffa_forward(
        q, k, v, _host_slices(q_ranges, k_ranges, attn_type_map), softmax_scale, softcap, acc_out, row_max
    )


@ffa_fwd.register_fake
def _(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend, acc_out=False, check_ranges=False,
      kernel_config=""):
    out_dtype = reference.acc_dtype(q.dtype) if acc_out else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:2], dtype=reference.acc_dtype(q.dtype))


@torch.library.custom_op("magi_kernels::ffa_bwd", mutates_args=())
def ffa_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor,
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, attn_type_map: torch.Tensor,
    softmax_scale: float, softcap: float, backend: str, kernel_config: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns fp32 (fp64 for fp64 inputs) dq, dk, dv. ``kernel_config`` as in ``ffa_fwd``."""
    return _backward_impl(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap,
                          backend, KernelConfig.from_json(kernel_config))


def _backward_impl(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend,
                   config: KernelConfig | None = None, plan: AttentionPlan | None = None):
    """The backward on ``backend`` (the custom op's body; the eager autograd path calls it directly)."""
    if backend == "triton":
        tri = _triton_module()
        return tri.ffa_backward(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap,
                                config, plan)
    return reference.ffa_backward(
        do, q, k, v, out, lse, _host_slices(q_ranges, k_ranges, attn_type_map), softmax_scale, softcap, dlse
    )


@ffa_bwd.register_fake
def _(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend, kernel_config=""):
    cd = reference.acc_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=cd), k.new_empty(k.shape, dtype=cd), v.new_empty(v.shape, dtype=cd)


def run_forward(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale: float, softcap: float, backend: str,
                acc_out: bool = False, kernel_config: KernelConfig | None = None,
                plan: AttentionPlan | None = None, row_max: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ffa_fwd`` without autograd for callers that build their own (context-parallel stages):
    the custom op where a ``torch.compile`` graph records it, its body directly in eager mode
    (the dispatcher costs tens of microseconds of host time per call). ``kernel_config``: None
    for the process default (``default_kernel_config``) or the plan's; ``plan``: a plan of these
    inputs (``plan_attention``; the GPU backend runs it, a ``torch.compile`` graph re-plans).
    ``row_max``: fp32 ``[tq, hq]``, max-merged in place with each row's largest scaled logit
    (eager mode only)."""
    if torch.compiler.is_compiling():
        _no_max_logits_under_compile(row_max)
        cfg = plan.key.config if plan is not None and kernel_config is None else kernel_config
        return ffa_fwd(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend, acc_out, False,
                       config_json(cfg))
    return _forward_impl(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend, acc_out,
                         kernel_config, plan, row_max)


def _no_max_logits_under_compile(row_max: torch.Tensor | None) -> None:
    if row_max is not None:
        raise NotImplementedError("return_max_logits=True is not supported inside torch.compile yet (the kernel op "
                                  "has no max-logits output); call it eagerly (torch.compiler.disable) or drop it")



def run_backward(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale: float,
                 softcap: float, backend: str, kernel_config: KernelConfig | None = None,
                 plan: AttentionPlan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ffa_bwd`` as ``run_forward`` runs ``ffa_fwd``: fp32 (fp64 for fp64 inputs) dq, dk, dv."""
    if torch.compiler.is_compiling():
        cfg = plan.key.config if plan is not None and kernel_config is None else kernel_config
        return ffa_bwd(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, backend,
                       config_json(cfg))
    return _backward_impl(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap,
                          backend, kernel_config, plan)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, qr, kr, tm, scale, softcap, backend, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, qr, kr, tm)
    ctx.scale, ctx.softcap, ctx.backend = scale, softcap, backend
    # the op's inputs end with (acc_out, check_ranges, the config's JSON), the eager path's with
    # (the config, the plan)
    if rest and isinstance(rest[0], KernelConfig):
        ctx.kernel_config, ctx.plan = rest[0], rest[1]
    else:
        last = rest[-1] if rest else None
        ctx.kernel_config, ctx.plan = (last if isinstance(last, str) else ""), None


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
    q, k, v, out, lse, qr, kr, tm = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    config = ctx.kernel_config
    dq, dk, dv = run_backward(dout, q, k, v, out, lse, dlse, qr, kr, tm, ctx.scale, ctx.softcap, ctx.backend,
                              KernelConfig.from_json(config) if isinstance(config, str) else config, ctx.plan)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None, None


ffa_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerFFA(torch.autograd.Function):
    """The eager path: the same forward, context and backward as the custom op, without the
    dispatcher and its autograd wrapper (about 100 us of host time per call on a desktop CPU,
    about a quarter of a forward call's host cost measured on the H200 host: a call whose
    kernels are shorter than its host cost is launch-bound). ``torch.compile`` uses the op."""

    @staticmethod
    def forward(ctx: Any, q, k, v, qr, kr, tm, scale: float, softcap: float, backend: str, config: KernelConfig,
                plan: AttentionPlan | None, row_max: torch.Tensor | None = None):
        out, lse = _forward_impl(q, k, v, qr, kr, tm, scale, softcap, backend, False, config, plan, row_max)
        _setup_context(ctx, (q, k, v, qr, kr, tm, scale, softcap, backend, config, plan), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        return (*_backward(ctx, dout, dlse)[:11], None)


def flex_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: Any,
    k_ranges: Any,
    attn_type_map: Any = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
    check_ranges: bool = True,
    sink: torch.Tensor | None = None,
    kernel_config: KernelConfig | None = None,
    plan: AttentionPlan | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention over a list of slices ``(q_range, k_range, mask_type)``.

    Args:
        q: ``[total_q, heads_q, head_dim]``; k: ``[total_k, heads_kv, head_dim]``; v:
            ``[total_k, heads_kv, v_head_dim]`` with ``heads_q % heads_kv == 0`` (GQA). A
            ``v_head_dim`` other than ``head_dim`` (MLA) runs zero-padded to the wider one (exact;
            costs the padded flops, see ``magi_kernels.head_features``). Any float dtype on CPU;
            fp16/bf16 for the GPU kernel.
        q_ranges, k_ranges: ``[N, 2]`` int32 tensors (or lists / ``AttnRanges``) of half-open
            ranges in the tensors' own row coordinates. q ranges may overlap; a (q, k) cell must be
            covered by at most one slice.
        attn_type_map: ``[N]`` ints (0 full, 1 causal, 2 inv_causal, 3 bi_causal), a list of names,
            one name for all, or None (all full).
        softmax_scale: defaults to ``1/sqrt(head_dim)``. softcap: ``> 0`` applies
            ``softcap * tanh(score / softcap)`` before masking.
        out, lse: a previous partial result for the same rows over *other* keys; the new result
            is LSE-merged with it (stages chain this way). They are not modified.
        backend: ``"auto"``, ``"torch"`` (reference, CPU/GPU) or ``"triton"`` (GPU). On sm90 at
            head_dim 128 its forward may read up to 127 rows of k/v past the end of a slice's
            k_range (with weight 0): those rows must be finite (NaN/inf there gives NaN rows);
            ``kernel_config=KernelConfig(gluon_fwd=False)`` selects a forward that never reads them.
        check_ranges: validate the slices: inside the tensors, known mask types, and no (q, k)
            cell covered twice (the solver's check, ``magi_solver.validate_slices``). Cached per
            mask, by the range tensors' identity and in-place version and else by a hash of their
            contents, so repeated calls cost a lookup; the first call with GPU range tensors
            syncs the device once. Under ``torch.compile`` the check runs when the op runs.
            Ranges given as lists or CPU tensors cost no device sync at all: the GPU backend
            uploads the tile tables once and caches them.
        sink: learnable attention sinks, ``[heads_q]`` (or ``[sink_tokens, heads_q]``) logits that
            join every row's softmax denominator with no value (GPT-OSS); fp32 recommended.
            Applied to the final result, after merging with ``out``/``lse``: when chaining
            partial results, pass it to the last call only.
        kernel_config: the GPU kernels' tiles and pipeline choices (``KernelConfig``); None for
            the process default (``default_kernel_config``: the measured defaults, or the
            ``MAGI_TRITON_*`` / ``MAGI_GLUON_*`` developer overrides read once). The torch
            backend ignores it.
        plan: a plan of exactly these inputs (``plan_attention``: slices, shapes, dtype, device,
            config); the GPU backend launches it without planning, a call with other inputs is
            refused with an error naming what differs. None: the plan is found in a memo keyed
            on the same values (built at the first call of a mask). With a plan and no
            ``kernel_config``, the plan's config runs.
        return_max_logits: also return, per query head, the largest scaled logit
            (``softmax_scale * q.k``, softcapped with ``softcap``) over every unmasked (q, k) cell
            of this call (Muon QK-clip): fp32 ``[heads_q]``, ``-inf`` for a head that sees no key;
            sinks and ``out``/``lse`` of earlier calls are not included. Not differentiable.
            On sm90 at head dim 128 it runs the Triton forward instead of the Gluon one (the
            Gluon forward has no such output; the README gives the cost). Eager mode only.

    Returns:
        ``(out, lse)``: out ``[total_q, heads_q, v_head_dim]`` in q's dtype; lse ``[total_q, heads_q]``
        in fp32 (fp64 for fp64 inputs), natural log, scale (and sink) included. Rows that see no
        key have ``out = 0`` and ``lse = -inf`` (``lse = sink`` with a sink). Differentiable
        w.r.t. q, k, v, sink (and out/lse if given). With ``return_max_logits``:
        ``(out, lse, max_logits)``.
    """
    check_qkv(q, k, v)
    check_accumulators(out, lse, q, v.shape[-1])
    check_sink(sink, q)
    st = normalize_slices(q_ranges, k_ranges, attn_type_map)
    scale, cap = check_scale_softcap(softmax_scale, softcap, q.shape[-1])
    be = resolve_backend(backend, q)
    dv, d = v.shape[-1], common_head_dim(q, v)
    q, k, v = (pad_head_dim(t, d) for t in (q, k, v))
    if plan is not None:
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be a magi_kernels.AttentionPlan (plan_attention) or None, got "
                            f"{type(plan).__name__}")
        if kernel_config is None:
            kernel_config = plan.key.config
    if not isinstance(return_max_logits, bool):
        raise TypeError(f"return_max_logits must be a bool, got {return_max_logits!r}")
    row_max = new_row_max(q) if return_max_logits else None
    if torch.compiler.is_compiling():  # a graph cannot read the ranges: the op checks them when it runs
        # (nor hold a plan: the op finds the memoised plan of its inputs)
        _no_max_logits_under_compile(row_max)
        o, lse_new = ffa_fwd(q, k, v, st.q_ranges, st.k_ranges, st.attn_type_map, scale, cap, be, False, check_ranges,
                             config_json(kernel_config))
    else:
        if check_ranges:
            check_slice_tensors(st, q.shape[0], k.shape[0])
        config = resolve_kernel_config(kernel_config)
        if plan is not None and be != "triton":  # the torch backend has no launches to plan: check the inputs
            call_plan(q, k, st.q_ranges, st.k_ranges, st.attn_type_map, config, plan)
        o, lse_new = _EagerFFA.apply(q, k, v, st.q_ranges, st.k_ranges, st.attn_type_map, scale, cap, be, config,
                                     plan, row_max)
    if dv != d:
        o = o[..., :dv]
    if out is not None:
        assert lse is not None
        o, lse_new = merge_out_lse(out, lse, o, lse_new)
    if sink is not None:
        o, lse_new = apply_sink(o, lse_new, sink)
    if row_max is not None:
        return o, lse_new, max_logits_of(row_max)
    return o, lse_new
