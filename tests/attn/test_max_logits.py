"""Max logits (Muon QK-clip): per query head, the largest scaled (softcapped) logit over every
unmasked cell, from flex_flash_attn_func and from calc_attn (across stages and ranks), against
float64 dense. The Triton kernel's output is checked in tests/scripts/triton_interpret_check.py
(CPU, Triton interpreter) and tests/kernels/test_triton_gpu.py (GPU)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from cases import mask_cases
from dist_harness import run_distributed

HQ, HK, D = 4, 2, 8


def _slices_args(slices):
    return [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices]


@pytest.mark.parametrize("softcap", [0.0, 20.0])  # a cap below the logits would saturate them all
@pytest.mark.parametrize("name", list(mask_cases()))
def test_kernel_max_logits_match_dense(name, softcap):
    from magi_kernels import flex_flash_attn_func
    from magi_kernels.testing import dense_attention, dense_mask, dense_max_logits

    slices, S = mask_cases()[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, k = (torch.randn(S, h, D, generator=g, dtype=torch.float64) * 3 for h in (HQ, HK))
    v = torch.randn(S, HK, 6, generator=g, dtype=torch.float64)  # MLA-like: v head dim != D
    out, lse, mx = flex_flash_attn_func(q, k, v, *_slices_args(slices), softcap=softcap, backend="torch",
                                        return_max_logits=True)
    mask = dense_mask(slices, S, S)
    ref = dense_max_logits(q, k, mask, softcap=softcap)
    assert mx.shape == (HQ,) and mx.dtype == torch.float32
    assert torch.equal(torch.isfinite(mx), torch.isfinite(ref))
    torch.testing.assert_close(mx.double(), ref, atol=1e-5, rtol=1e-6)  # fp32 output of float64 logits
    ref_out, ref_lse = dense_attention(q, k, v, mask, softcap=softcap)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)  # the attention itself is unchanged


def test_kernel_max_logits_refuses_non_bool_and_no_keys_is_minus_inf():
    from magi_kernels import flex_flash_attn_func

    q = torch.randn(4, 2, 8)
    with pytest.raises(TypeError, match="return_max_logits"):
        flex_flash_attn_func(q, q, q, [[0, 4]], [[0, 4]], return_max_logits=1)
    _, _, mx = flex_flash_attn_func(q, q, q, [[0, 2]], [[0, 0]], return_max_logits=True)  # no keys at all
    assert torch.isneginf(mx).all()


def _dist_worker(rank, world):  # noqa: ARG001 - the harness passes world
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig, calc_attn, dispatch, magi_attn_flex_key
    from magi_kernels.testing import dense_mask, dense_max_logits

    cases = mask_cases()
    # softcaps well above the logits (a small one saturates every row at the cap: nothing to tell apart)
    for name, degree, softcap in (("varlen_block_causal", 3, 0.0), ("mixed_overlapping", 1, 30.0),
                                  ("varlen_block_causal", 0, 0.0)):
        slices, S = cases[name]
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q, k, v = (torch.randn(S, h, D, generator=g, dtype=torch.float64) * 3 for h in (HQ, HK, HK))
        cfg = DistAttnConfig(DispatchConfig(chunk_size=4), OverlapConfig(degree=degree, min_chunk_size=4),
                             kernel_backend="torch")
        key = magi_attn_flex_key(*_slices_args(slices), S, S, HQ, HK, D, dist.group.WORLD, cfg)
        out, lse, mx = calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key, softcap=softcap,
                                 return_max_logits=True)
        ref = dense_max_logits(q, k, dense_mask(slices, S, S), softcap=softcap)
        torch.testing.assert_close(mx.double(), ref, atol=1e-5, rtol=1e-6,
                                   msg=lambda m: f"rank {rank} {name} degree {degree}: {m}")


@pytest.mark.parametrize("world", [1, 3])
def test_calc_attn_max_logits_over_stages_and_ranks(world):
    run_distributed(_dist_worker, world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["varlen_block_causal", "mixed_overlapping"])
def test_gpu_max_logits_match_dense(name, d):
    """bf16 on the GPU kernel (at d=128 on sm90 the Triton forward stands in for the Gluon one):
    the max logits are those of the bf16 inputs' exact products (fp32 accumulation)."""
    from magi_kernels import flex_flash_attn_func
    from magi_kernels.testing import dense_attention, dense_mask, dense_max_logits

    slices, S = mask_cases()[name]
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(S, h, d, generator=g, device="cuda", dtype=torch.bfloat16) * 2 for h in (HQ, HK, HK))
    out, lse, mx = flex_flash_attn_func(q, k, v, *_slices_args(slices), softcap=30.0, backend="triton",
                                        return_max_logits=True)
    mask = dense_mask(slices, S, S, device="cuda")
    ref = dense_max_logits(q.double(), k.double(), mask, softcap=30.0)
    assert torch.equal(torch.isfinite(mx), torch.isfinite(ref))
    torch.testing.assert_close(mx.double(), ref, atol=2e-3, rtol=1e-3)
    ref_out, _ = dense_attention(q.double(), k.double(), v.double(), mask, softcap=30.0)
    # the output is rounded to bf16: half an ulp is 2^-9 of |out| (up to 0.016 at |out| ~ 8 here, with
    # inputs scaled by 2), on top of the fp32 kernel's error; rtol 2^-7 allows one ulp
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2 ** -7)
