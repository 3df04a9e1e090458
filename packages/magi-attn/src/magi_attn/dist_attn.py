"""Distributed attention: multi-stage GroupCast of remote KV overlapped with the kernel.

Forward: stage s+1's KV is in flight while stage s computes; every stage's result is LSE-merged
into fp32 accumulators. Backward: KV is fetched again stage by stage; dQ accumulates locally and
each stage's partial dK/dV goes back to its owners with GroupReduce (the transposed cast), which
runs while the next stage computes. Both go through the runtime's
:class:`magi_comm.GroupCollective` (chosen once per key by ``DistAttnConfig.comm_backend``).
"""

from __future__ import annotations

import torch

from magi_kernels import merge_out_lse, run_backward, run_forward

from .runtime import DistAttnRuntime, SliceArgs


def _fwd(q, k, v, args: SliceArgs, scale, softcap, backend):
    return run_forward(q, k, v, args.q_ranges, args.k_ranges, args.attn_type_map, scale, softcap, backend, True)


def _bwd(do, q, k, v, out, lse, dlse, args: SliceArgs, scale, softcap, backend):
    return run_backward(do, q, k, v, out, lse, dlse, args.q_ranges, args.k_ranges, args.attn_type_map,
                        scale, softcap, backend)


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
            remote = [rt.comm.cast(kv, s).wait() for s in range(n)]
            kv_all = torch.cat([kv, *remote], dim=0)
            out, lse = _fwd(q, *_split_kv(kv_all, hk), merged, scale, softcap, backend)
        else:
            pending = rt.comm.cast(kv, 0) if n else None
            out, lse = _fwd(q, k, v, host, scale, softcap, backend)
            for s in range(n):
                remote = pending.wait()
                pending = rt.comm.cast(kv, s + 1) if s + 1 < n else None
                if stages[s].empty:
                    continue
                o_s, l_s = _fwd(q, *_split_kv(remote, hk), stages[s], scale, softcap, backend)
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
            remote = [rt.comm.cast(kv, s).wait() for s in range(n)]
            kv_all = torch.cat([kv, *remote], dim=0)
            dq, dk_all, dv_all = _bwd(dout, q, *_split_kv(kv_all, hk), out, lse, dlse, merged, scale, softcap, backend)
            dkv_all = torch.cat([dk_all, dv_all], dim=1)
            dkv = dkv_all[: kv.shape[0]].clone()
            offset = kv.shape[0]
            for s, r in enumerate(remote):
                rt.comm.reduce(dkv_all[offset: offset + r.shape[0]], dkv, s).wait()
                offset += r.shape[0]
        else:
            pending = rt.comm.cast(kv, 0) if n else None
            dq, dk, dv = _bwd(dout, q, k, v, out, lse, dlse, host, scale, softcap, backend)
            dkv = torch.cat([dk, dv], dim=1)
            reduces = []
            for s in range(n):
                remote = pending.wait()
                pending = rt.comm.cast(kv, s + 1) if s + 1 < n else None
                if stages[s].empty:
                    part = remote.new_zeros(remote.shape, dtype=dkv.dtype)
                else:
                    dq_s, dk_s, dv_s = _bwd(dout, q, *_split_kv(remote, hk), out, lse, dlse, stages[s],
                                            scale, softcap, backend)
                    dq = dq + dq_s
                    part = torch.cat([dk_s, dv_s], dim=1)
                reduces.append(rt.comm.reduce(part, dkv, s))  # overlaps the next stage
            for r in reduces:
                r.wait()
        dk, dv = _split_kv(dkv, hk)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
