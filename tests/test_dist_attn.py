"""Distributed attention equals a float64 dense reference (out, lse, dq, dk, dv) on 1-4 gloo ranks."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from cases import mask_cases
from dist_harness import run_distributed

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


def _config(spec):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig

    return DistAttnConfig(dispatch=DispatchConfig(**spec.get("dispatch", {})), overlap=OverlapConfig(**spec.get("overlap", {})),
                          kernel_backend="torch", **spec.get("comm", {}))


def check_case(name, slices, S, cfg_name, group, rank, softcap=0.0):
    from magi_attn import calc_attn, dispatch, magi_attn_flex_key, undispatch
    from magi_kernels.testing import dense_attention, dense_mask

    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{cfg_name}".encode()))
    q, k, v = (torch.randn(S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HK, HK))
    g_out = torch.randn(S, HQ, D, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(S, HQ, generator=gen, dtype=torch.float64)
    key = magi_attn_flex_key(
        [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], S, S, HQ, HK, D,
        group, _config(CONFIGS[cfg_name]),
    )
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    out_l, lse_l = calc_attn(dispatch(qd, key), dispatch(kd, key), dispatch(vd, key), key, softcap=softcap)
    out, lse = undispatch(out_l, key), undispatch(lse_l, key)
    finite = torch.isfinite(lse)
    loss = (out * g_out).sum() + torch.where(finite, lse * g_lse, 0).sum()
    loss.backward()

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = dense_attention(qr, kr, vr, dense_mask(slices, S, S), softcap=softcap)
    ref_finite = torch.isfinite(ref_lse)
    ref_loss = (ref_out * g_out).sum() + torch.where(ref_finite, ref_lse * g_lse, 0).sum()
    ref_loss.backward()

    where = f"case={name} cfg={cfg_name} rank={rank}"
    assert torch.equal(finite, ref_finite), f"{where}: rows without keys differ"
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0, msg=lambda m: f"{where} out: {m}")
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=TOL, rtol=0, msg=lambda m: f"{where} lse: {m}")
    for n, a, b in (("dq", qd.grad, qr.grad), ("dk", kd.grad, kr.grad), ("dv", vd.grad, vr.grad)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, n=n: f"{where} {n}: {m}")


def run_all_cases(rank, world, cfg_names):
    group = dist.group.WORLD
    for cfg_name in cfg_names:
        for name, (slices, S) in mask_cases().items():
            check_case(name, slices, S, cfg_name, group, rank)
    check_case("mixed_overlapping_softcap", *mask_cases()["mixed_overlapping"], "degree1", group, rank, softcap=2.0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_matches_dense_reference(world):
    cfgs = list(CONFIGS) if world != 3 else ["degree1", "degree3", "sequential_chunk5"]
    run_distributed(run_all_cases, world, cfgs)


def test_single_rank_without_process_group():
    for name, (slices, S) in mask_cases().items():
        check_case(name, slices, S, "degree1", None, 0)


def bf16_worker(rank, world):
    """bf16 through the whole pipeline (bf16 on the wire via gloo) against the fp64 reference of
    the same rounded inputs: fp32 accumulation leaves only bf16 output rounding (~2^-8)."""
    from magi_attn import DistAttnConfig, calc_attn, dispatch, magi_attn_flex_key, undispatch
    from magi_kernels.testing import dense_attention, dense_mask

    slices, S = mask_cases()["varlen_block_causal"]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, h, D, generator=gen).bfloat16() for h in (HQ, HK, HK))
    key = magi_attn_flex_key([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], S, S,
                             HQ, HK, D, dist.group.WORLD, DistAttnConfig(kernel_backend="torch"))
    out = undispatch(calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)[0], key)
    ref, _ = dense_attention(q.double(), k.double(), v.double(), dense_mask(slices, S, S))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_bf16_pipeline_two_ranks():
    run_distributed(bf16_worker, 2)


def test_api_errors():
    from magi_attn import DistAttnConfig, OverlapConfig, calc_attn, magi_attn_flex_key, magi_attn_varlen_key

    with pytest.raises(NotImplementedError, match="self-attention"):
        magi_attn_flex_key([(0, 4)], [(0, 6)], "full", 4, 6, 2, 1, 8)
    with pytest.raises(ValueError, match="multiple of num_heads_kv"):
        magi_attn_flex_key([(0, 4)], [(0, 4)], "full", 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="both cover cell"):
        magi_attn_flex_key([(0, 4), (2, 4)], [(0, 4), (0, 2)], "full", 4, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="kernel_backend"):
        DistAttnConfig(kernel_backend="cuda")
    with pytest.raises(ValueError, match="exceeds max_num_chunks"):
        OverlapConfig(degree=9, max_num_chunks=4)
    with pytest.raises(RuntimeError, match="not initialized"):
        magi_attn_varlen_key([0, 4], [0, 4], 2, 1, 8, cp_group=object())
    key = magi_attn_varlen_key([0, 10], [0, 10], 2, 1, 8, causal=True)
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match=r"k, v must be \[shard_seqlen, num_heads_kv, head_dim\]"):
        calc_attn(q, q, q, key)
