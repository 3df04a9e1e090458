"""Distributed attention: multi-stage GroupCast of remote KV overlapped with the kernel.

Forward: stage s+1's KV is in flight while stage s computes; every stage's result is LSE-merged
into fp32 accumulators. Backward: KV is fetched again stage by stage; dQ accumulates locally and
each stage's partial dK/dV goes back to its owners with GroupReduce (the transposed cast), which
runs while the next stage computes.
"""

from __future__ import annotations

import torch

from magi_comm import PendingCollective, group_cast, group_reduce
from magi_kernels import merge_out_lse, run_backward, run_forward

from .runtime import DistAttnRuntime, SliceArgs


def _cast_kv(kv: torch.Tensor, rt: DistAttnRuntime, stage: int):
    p = rt.cast_plans[stage]
    kw = dict(input_split_sizes=p.input_split_sizes, output_split_sizes=p.output_split_sizes,
              dst_indices=p.dst_indices, src_index=p.src_index)
    ipc = rt.ipc(kv)
    if ipc is not None:  # synchronous peer writes: hand back a finished handle
        out = ipc.group_cast(kv, **kw)
        return PendingCollective([], lambda: out)
    hier = rt.hier(kv)
    if hier is not None:
        return hier[0].group_cast(kv, async_op=True, plan=hier[1][stage], timeout_s=rt.config.comm_timeout_s, **kw)
    return group_cast(kv, group=rt.group, async_op=True, timeout_s=rt.config.comm_timeout_s, **kw)


def _reduce_dkv(part: torch.Tensor, dkv: torch.Tensor, rt: DistAttnRuntime, stage: int):
    p = rt.reduce_plans[stage]
    kw = dict(input_split_sizes=p.input_split_sizes, output_split_sizes=p.output_split_sizes,
              dst_index=p.dst_index, src_indices=p.src_indices)
    ipc = rt.ipc(part)
    if ipc is not None and dkv.dtype == torch.float32:
        ipc.group_reduce(part, dkv, **kw)
        return PendingCollective([], lambda: dkv)
    hier = rt.hier(part)
    if hier is not None:
        return hier[0].group_reduce(part, dkv, op="sum", async_op=True, plan=hier[1][stage],
                                    timeout_s=rt.config.comm_timeout_s, **kw)
    return group_reduce(part, dkv, group=rt.group, op="sum", async_op=True, timeout_s=rt.config.comm_timeout_s, **kw)


def _plan(q, k, args: SliceArgs, backend: str, rt: DistAttnRuntime):
    """The stage's kernel plan, held by its slice arguments (the key's runtime): the GPU backend's
    (a ``torch.compile`` graph re-plans inside the kernel op instead)."""
    if backend != "triton" or torch.compiler.is_compiling():
        return None
    return args.plan(q, k, rt.config.kernel)


def _fwd(q, k, v, args: SliceArgs, scale, softcap, backend, rt: DistAttnRuntime):
    return run_forward(q, k, v, args.q_ranges, args.k_ranges, args.attn_type_map, scale, softcap, backend, True,
                       rt.config.kernel, _plan(q, k, args, backend, rt))


def _bwd(do, q, k, v, out, lse, dlse, args: SliceArgs, scale, softcap, backend, rt: DistAttnRuntime):
    return run_backward(do, q, k, v, out, lse, dlse, args.q_ranges, args.k_ranges, args.attn_type_map,
                        scale, softcap, backend, rt.config.kernel, _plan(q, k, args, backend, rt))


def _split_kv(kv: torch.Tensor, hk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[:, :hk], kv[:, hk:]


class DistAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: DistAttnRuntime, scale: float, softcap: float, backend: str):
        hk = k.shape[1]
        host, stages, merged = rt.slice_args()
        kv = torch.cat([k, v], dim=1)  # one collective for K and V
        n = len(stages)
        if rt.no_overlap and n:
            remote = [_cast_kv(kv, rt, s).wait() for s in range(n)]
            kv_all = torch.cat([kv, *remote], dim=0)
            out, lse = _fwd(q, *_split_kv(kv_all, hk), merged, scale, softcap, backend, rt)
        else:
            pending = _cast_kv(kv, rt, 0) if n else None
            out, lse = _fwd(q, k, v, host, scale, softcap, backend, rt)
            for s in range(n):
                remote = pending.wait()
                pending = _cast_kv(kv, rt, s + 1) if s + 1 < n else None
                if stages[s].empty:
                    continue
                o_s, l_s = _fwd(q, *_split_kv(remote, hk), stages[s], scale, softcap, backend, rt)
                out, lse = merge_out_lse(out, lse, o_s, l_s)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rt, ctx.scale, ctx.softcap, ctx.backend = rt, scale, softcap, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        rt: DistAttnRuntime = ctx.rt
        scale, softcap, backend = ctx.scale, ctx.softcap, ctx.backend
        hk = k.shape[1]
        host, stages, merged = rt.slice_args()
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
        kv = torch.cat([k, v], dim=1)
        n = len(stages)
        if rt.no_overlap and n:
            remote = [_cast_kv(kv, rt, s).wait() for s in range(n)]
            kv_all = torch.cat([kv, *remote], dim=0)
            dq, dk_all, dv_all = _bwd(dout, q, *_split_kv(kv_all, hk), out, lse, dlse, merged, scale, softcap, backend,
                                      rt)
            dkv_all = torch.cat([dk_all, dv_all], dim=1)
            dkv = dkv_all[: kv.shape[0]].clone()
            offset = kv.shape[0]
            for s, r in enumerate(remote):
                _reduce_dkv(dkv_all[offset: offset + r.shape[0]], dkv, rt, s).wait()
                offset += r.shape[0]
        else:
            pending = _cast_kv(kv, rt, 0) if n else None
            dq, dk, dv = _bwd(dout, q, k, v, out, lse, dlse, host, scale, softcap, backend, rt)
            dkv = torch.cat([dk, dv], dim=1)
            reduces = []
            for s in range(n):
                remote = pending.wait()
                pending = _cast_kv(kv, rt, s + 1) if s + 1 < n else None
                if stages[s].empty:
                    part = remote.new_zeros(remote.shape, dtype=dkv.dtype)
                else:
                    dq_s, dk_s, dv_s = _bwd(dout, q, *_split_kv(remote, hk), out, lse, dlse, stages[s],
                                            scale, softcap, backend, rt)
                    dq = dq + dq_s
                    part = torch.cat([dk_s, dv_s], dim=1)
                reduces.append(_reduce_dkv(part, dkv, rt, s))  # overlaps the next stage
            for r in reduces:
                r.wait()
        dk, dv = _split_kv(dkv, hk)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
