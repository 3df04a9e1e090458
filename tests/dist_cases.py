"""Shared checks of the distributed-attention tests (tests/attn): one self-attention case
(``check_case``) and one cross-attention case (``check_cross_case``) against a float64 dense
reference (out, lse, dq, dk, dv), run on every rank of a group (or on one process without one)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

HQ, HK, D = 4, 2, 8
TOL = 1e-10  # float64 end to end: only summation-order rounding differs

CONFIGS = {
    "degree1": dict(overlap=dict(degree=1)),
    "degree3": dict(overlap=dict(degree=3, min_chunk_size=4)),
    "no_overlap": dict(overlap=dict(degree=0)),
    "dynamic": dict(overlap=dict(degree=None, min_chunk_size=4)),
    "sequential_chunk5": dict(dispatch=dict(chunk_size=5, alg="sequential"), overlap=dict(degree=2, min_chunk_size=3)),
    # two-hop node-aware collectives: 2 ranks per node (4 ranks = 2 nodes, 2 ranks = 1 node)
    "hier_2_per_node": dict(overlap=dict(degree=2, min_chunk_size=4), comm=dict(comm_backend="hier", ranks_per_node=2)),
}


def dist_config(spec):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig

    return DistAttnConfig(dispatch=DispatchConfig(**spec.get("dispatch", {})), overlap=OverlapConfig(**spec.get("overlap", {})),
                          kernel_backend="torch", **spec.get("comm", {}))


def check_case(name, slices, S, cfg_name, group, rank, softcap=0.0, sink_shape=None, dv=D, key=None):
    """``sink_shape``: learnable sinks of that shape (their gradient summed over the ranks);
    ``dv``: the value head dim (MLA-like when it differs from D); ``key``: a key of ``slices``
    made elsewhere (e.g. over another key's placement), else one is made from ``cfg_name``."""
    from magi_attn import calc_attn, dispatch, magi_attn_flex_key, undispatch
    from magi_kernels.testing import dense_attention, dense_mask

    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{cfg_name}".encode()))
    q, k = (torch.randn(S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HK))
    v = torch.randn(S, HK, dv, generator=gen, dtype=torch.float64)
    sink = None if sink_shape is None else torch.randn(sink_shape, generator=gen, dtype=torch.float32)
    g_out = torch.randn(S, HQ, dv, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(S, HQ, generator=gen, dtype=torch.float64)
    if key is None:
        key = magi_attn_flex_key(
            [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], S, S, HQ, HK, D,
            group, dist_config(CONFIGS[cfg_name]),
        )
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    sd = None if sink is None else sink.clone().requires_grad_()
    out_l, lse_l = calc_attn(dispatch(qd, key), dispatch(kd, key), dispatch(vd, key), key, softcap=softcap, sink=sd)
    out, lse = undispatch(out_l, key), undispatch(lse_l, key)
    finite = torch.isfinite(lse)
    loss = (out * g_out).sum() + torch.where(finite, lse * g_lse, 0).sum()
    loss.backward()

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = None if sink is None else sink.double().requires_grad_()
    ref_out, ref_lse = dense_attention(qr, kr, vr, dense_mask(slices, S, S), softcap=softcap, sink=sr)
    ref_finite = torch.isfinite(ref_lse)
    ref_loss = (ref_out * g_out).sum() + torch.where(ref_finite, ref_lse * g_lse, 0).sum()
    ref_loss.backward()

    where = f"case={name} cfg={cfg_name} rank={rank}"
    assert torch.equal(finite, ref_finite), f"{where}: rows without keys differ"
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=lambda m: f"{where} out: {m}")
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=TOL, rtol=0, msg=lambda m: f"{where} lse: {m}")
    for n, a, b in (("dq", qd.grad, qr.grad), ("dk", kd.grad, kr.grad), ("dv", vd.grad, vr.grad)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, n=n: f"{where} {n}: {m}")
    if sink is not None:  # each rank holds its rows' share of the (replicated) sink's gradient
        dsink = sd.grad.double()
        if group is not None:
            dist.all_reduce(dsink, group=group)
        assert sd.grad.dtype == torch.float32
        torch.testing.assert_close(dsink, sr.grad, atol=1e-5, rtol=1e-6, msg=lambda m: f"{where} dsink: {m}")


def cross_config(chunk_size=None, **overlap):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig

    return DistAttnConfig(overlap=OverlapConfig(**(overlap or dict(degree=1))), kernel_backend="torch",
                          dispatch=DispatchConfig(chunk_size=chunk_size))


def randn64(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def out_lse_loss(out, lse, g_out, g_lse):
    finite = torch.isfinite(lse)
    return (out * g_out).sum() + torch.where(finite, lse * g_lse, 0).sum()


def check_cross_case(name, slices, sq, sk, placement, expect, group, rank, config=None):
    from magi_attn import calc_attn, dispatch, dispatch_kv, magi_attn_cross_key, undispatch
    from magi_kernels.testing import dense_attention, dense_mask

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, k, v = randn64(gen, sq, HQ, D), randn64(gen, sk, HK, D), randn64(gen, sk, HK, D)
    g_out, g_lse = randn64(gen, sq, HQ, D), randn64(gen, sq, HQ)
    key = magi_attn_cross_key([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], sq, sk,
                              HQ, HK, D, group, kv_placement=placement, dist_attn_config=config or cross_config())
    resolved = key.runtime.plan.kv_placement
    assert resolved == (expect if key.cp_size > 1 else resolved), f"{name}: auto chose {resolved}, not {expect}"
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    out_l, lse_l = calc_attn(dispatch(qd, key), dispatch_kv(kd, key), dispatch_kv(vd, key), key)
    out, lse = undispatch(out_l, key), undispatch(lse_l, key)
    out_lse_loss(out, lse, g_out, g_lse).backward()

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense_attention(qr, kr, vr, dense_mask(slices, sq, sk))
    out_lse_loss(ref_out, ref_lse, g_out, g_lse).backward()
    where = f"case={name} rank={rank}/{key.cp_size} kv={resolved}"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), f"{where}: rows without keys differ"
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=lambda m: f"{where} out: {m}")
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=TOL, rtol=0, msg=lambda m: f"{where} lse: {m}")
    for n, a, b in (("dq", qd.grad, qr.grad), ("dk", kd.grad, kr.grad), ("dv", vd.grad, vr.grad)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, n=n: f"{where} {n}: {m}")
    return key
