"""Cross-attention under CP (queries and keys from different sequences) and padded-batch helpers,
against a float64 dense reference (out, lse, dq, dk, dv) on 1, 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from dist_cases import HK, HQ, TOL, D, check_cross_case, cross_config, randn64
from dist_harness import run_distributed

# (name, slices (q_start, q_end, k_start, k_end, type: 0 full, 1 causal, 2 inv-causal, 3 bi-causal),
#  total_seqlen_q, total_seqlen_k, kv_placement, placement "auto" must pick on more than one rank)
CASES = [
    # video (long q) attends to a short text (kv): auto replicates K/V
    ("video_text_full", [(0, 24, 0, 5, 0)], 24, 5, "auto", "replicate"),
    ("video_text_full_sharded", [(0, 24, 0, 5, 0)], 24, 5, "shard", "shard"),
    # two clips, each with its own caption; the second attends causally (bottom-right aligned)
    ("clips_captions_block", [(0, 10, 0, 3, 0), (10, 24, 3, 7, 1)], 24, 7, "shard", "shard"),
    ("clips_captions_replicated", [(0, 10, 0, 3, 0), (10, 24, 3, 7, 1)], 24, 7, "replicate", "replicate"),
    # short q over a long memory (kv longer than q): auto shards K/V
    ("long_kv_causal_blocks", [(0, 3, 0, 12, 1), (3, 6, 12, 20, 0), (6, 8, 4, 16, 3)], 8, 20, "auto", "shard"),
    # equal lengths, still two sequences; inv-causal and rows without keys (q 12..16 attend to nothing)
    ("same_length_inv_causal", [(0, 6, 0, 16, 2), (6, 12, 3, 9, 0)], 16, 16, "shard", "shard"),
]


# query and K/V shards of different lengths (run with chunk_size=4: query shards of 8, 7, 4, 4 rows on 4 ranks)
UNEVEN_CASES = [
    ("uneven_shards_causal", [(0, 11, 0, 4, 0), (11, 23, 2, 9, 1)], 23, 9, "shard", "shard"),
    ("uneven_shards_replicated", [(0, 23, 0, 9, 0)], 23, 9, "replicate", "replicate"),
]


def check_round_trips(key, sq, sk, rank):
    """dispatch / undispatch on both sides give back the global tensor and, backward, its gradient."""
    from magi_attn import dispatch, dispatch_kv, undispatch, undispatch_kv

    gen = torch.Generator().manual_seed(7)
    for side, n, fwd, back in (("q", sq, dispatch, undispatch), ("kv", sk, dispatch_kv, undispatch_kv)):
        x, g = randn64(gen, n, 3), randn64(gen, n, 3)
        xd = x.clone().requires_grad_()
        y = back(fwd(xd, key), key)
        assert torch.equal(y, x), f"rank {rank}: {side} round trip differs"
        (y * g).sum().backward()
        torch.testing.assert_close(xd.grad, g, atol=TOL, rtol=0, msg=lambda m, s=side: f"rank {rank} {s} grad: {m}")


def check_batches(group, rank):
    """Padded batches (left and right padding, an empty row) packed by squash_batch: self-attention
    and cross-attention equal per-row dense attention over each row's tokens."""
    from magi_attn import (calc_attn, dispatch, dispatch_kv, magi_attn_varlen_cross_key, magi_attn_varlen_key,
                           squash_batch, undispatch, unsquash_batch)
    from magi_kernels.testing import dense_attention

    gen = torch.Generator().manual_seed(11)
    b, s, t = 3, 9, 5
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[0, :6] = True  # right padding
    mask[1, 2:] = True  # left padding
    mask[2] = True
    kv_mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]])  # int, as tokenizers give
    x_q, x_kv = randn64(gen, b, s, HQ, D), randn64(gen, b, t, HK, D)
    g = randn64(gen, b, s, HQ, D)
    for cross in (False, True):
        qb = x_q.clone().requires_grad_()
        kvb = (x_kv if cross else x_q[:, :, :HK]).clone().requires_grad_()
        kv_m = kv_mask if cross else mask
        q, pq = squash_batch(qb, mask)
        kv, pk = squash_batch(kvb, kv_m)
        if cross:
            key = magi_attn_varlen_cross_key(pq.cu_seqlens, pk.cu_seqlens, HQ, HK, D, group, dist_attn_config=cross_config())
        else:
            key = magi_attn_varlen_key(pq.cu_seqlens, pq.cu_seqlens, HQ, HK, D, group, causal=True,
                                       dist_attn_config=cross_config())
        kvd = dispatch_kv(kv, key)
        out, _ = calc_attn(dispatch(q, key), kvd, kvd, key)
        y = unsquash_batch(undispatch(out, key), pq)
        (y * g).sum().backward()
        for r in range(b):
            qi, ki = mask[r].nonzero().reshape(-1), kv_m[r].bool().nonzero().reshape(-1)
            qr = x_q[r, qi].clone().requires_grad_()
            kr = (x_kv if cross else x_q[:, :, :HK])[r, ki].clone().requires_grad_()
            m = torch.ones(len(qi), len(ki), dtype=torch.bool)
            if not cross:
                m = m.tril()
            ref, _ = dense_attention(qr, kr, kr, m)
            (ref * g[r, qi]).sum().backward()
            where = f"rank {rank} cross={cross} row {r}"
            torch.testing.assert_close(y[r, qi], ref, atol=TOL, rtol=0, msg=lambda e: f"{where} out: {e}")
            pad = ~mask[r]
            assert bool((y[r, pad] == 0).all()), f"{where}: padding rows are not zero"
            torch.testing.assert_close(qb.grad[r, qi], qr.grad, atol=TOL, rtol=0, msg=lambda e: f"{where} dq: {e}")
            torch.testing.assert_close(kvb.grad[r, ki], kr.grad, atol=TOL, rtol=0, msg=lambda e: f"{where} dkv: {e}")
            assert bool((qb.grad[r, pad] == 0).all()), f"{where}: padding got a gradient"


def cross_worker(rank, world):
    import torch.distributed as dist

    from magi_attn import dispatch_kv, get_kv_position_ids, magi_attn_cross_key

    group = dist.group.WORLD
    for case in CASES:
        check_cross_case(*case, group, rank)
    # the sharded K/V fetched in 3 overlap stages, and in one kernel call without overlap
    check_cross_case(*CASES[4], group, rank, cross_config(degree=3, min_chunk_size=1))
    check_cross_case(*CASES[2], group, rank, cross_config(degree=0))
    # queries in chunks of 4 over 23 rows: shards of different lengths (no padding) on both sides
    for case in UNEVEN_CASES:
        check_cross_case(*case, group, rank, cross_config(degree=2, min_chunk_size=1, chunk_size=4))
    for placement in ("shard", "replicate"):
        key = magi_attn_cross_key([(0, 24)], [(0, 7)], "full", 24, 7, HQ, HK, D, group, kv_placement=placement,
                                  dist_attn_config=cross_config())
        check_round_trips(key, 24, 7, rank)
        pos = get_kv_position_ids(key)  # this rank's K/V rows, no padding rows
        assert key.kv_shard_seqlen == key.runtime.kv_shard_seqlens[rank] == len(pos)
        assert torch.equal(pos, dispatch_kv(torch.arange(7), key))
    check_batches(group, rank)
    check_disagreement(group, rank)


def check_disagreement(group, rank):
    """Ranks that build different cross keys, or a cross key against a self-attention key, get
    one clear error on every rank (the fingerprints have the same fields for both kinds)."""
    from magi_attn import PlanMismatchError, magi_attn_cross_key, magi_attn_flex_key

    with pytest.raises(PlanMismatchError, match="kv_placement: rank 0: shard, rank 1: replicate"):
        magi_attn_cross_key([(0, 24)], [(0, 7)], "full", 24, 7, HQ, HK, D, group,
                            kv_placement="shard" if rank == 0 else "replicate", dist_attn_config=cross_config())
    sk = 24 if rank == 0 else 7
    with pytest.raises(PlanMismatchError, match="total_seqlen_k: rank 0: 24, rank 1: 7"):
        magi_attn_flex_key([(0, 24)], [(0, sk)], "full", 24, sk, HQ, HK, D, group, cross_config())


@pytest.mark.parametrize("world", [2, 4])
def test_cross_attention_matches_dense(world):
    run_distributed(cross_worker, world)


def test_cross_attention_single_rank():
    from magi_attn import magi_attn_cross_key

    for case in CASES:
        check_cross_case(*case, None, 0)
    check_round_trips(magi_attn_cross_key([(0, 6)], [(0, 4)], "causal", 6, 4, HQ, HK, D), 6, 4, 0)
    check_batches(None, 0)


def test_kv_placement_rule():
    from magi_solver import AttnSlice, CrossAttnPlan, DispatchConfig, choose_kv_placement

    full = [AttnSlice.make((0, 64), (0, 16))]
    assert choose_kv_placement(16, 16, 4) == "replicate" and choose_kv_placement(17, 16, 4) == "shard"
    rep = CrossAttnPlan(full, 64, 16, 4, kv_placement="auto")
    assert rep.kv_placement == "replicate" and rep.num_stages == 0 and rep.kv_shard_seqlens == (16, 16, 16, 16)
    assert rep.comm_rows() == [0, 0, 0, 0]  # nothing moves in the attention
    shard = CrossAttnPlan(full, 64, 16, 4, kv_placement="shard")
    assert shard.kv_shard_seqlens == (4, 4, 4, 4) and shard.comm_rows() == [12, 12, 12, 12]  # the other 3 shards
    assert CrossAttnPlan([AttnSlice.make((0, 8), (0, 40))], 8, 40, 4).kv_placement == "shard"
    # uneven, unpadded shards on both sides: query shards of 8, 7, 4, 4 rows (chunks of 4), K/V
    # shards of 3, 3, 3, 1; auto compares total_seqlen_k with the largest query shard (8)
    cfg = DispatchConfig(chunk_size=4)
    uneven = CrossAttnPlan([AttnSlice.make((0, 23), (0, 10))], 23, 10, 4, dispatch_config=cfg, kv_placement="shard")
    assert sorted(uneven.dispatch.shard_seqlens) == [4, 4, 7, 8] and uneven.kv_shard_seqlens == (3, 3, 3, 1)
    assert uneven.comm_rows() == [10 - n for n in uneven.kv_shard_seqlens]  # every rank fetches all it lacks
    assert [len(uneven.kv_local_rows(r)) for r in range(4)] == [3, 3, 3, 1]
    for r in range(4):  # each cast plan reads exactly this rank's own K/V rows
        assert sum(uneven.cast_plan(0, r).input_split_sizes) == uneven.kv_shard_seqlens[r]
    assert CrossAttnPlan([AttnSlice.make((0, 23), (0, 8))], 23, 8, 4, dispatch_config=cfg).kv_placement == "replicate"
    assert CrossAttnPlan([AttnSlice.make((0, 23), (0, 9))], 23, 9, 4, dispatch_config=cfg).kv_placement == "shard"
    assert CrossAttnPlan([AttnSlice.make((0, 8), (0, 3))], 8, 3, 4).kv_placement == "replicate"  # fewer rows than ranks
    with pytest.raises(ValueError, match="kv_placement='replicate'"):
        CrossAttnPlan([AttnSlice.make((0, 8), (0, 3))], 8, 3, 4, kv_placement="shard")


def test_self_attention_keys_unchanged():
    from magi_attn import DistAttnKey, dispatch, dispatch_kv, magi_attn_flex_key, magi_attn_varlen_key

    key = magi_attn_varlen_key([0, 6, 10], [0, 6, 10], HQ, HK, D, causal=True)
    assert type(key) is DistAttnKey and not key.is_cross
    x = torch.randn(10, 3)
    assert torch.equal(dispatch_kv(x, key), dispatch(x, key))  # one placement for both sides
    cross = magi_attn_flex_key([(0, 6)], [(0, 4)], "full", 6, 4, HQ, HK, D)
    assert cross.is_cross and cross.total_seqlen_k == 4


def test_cross_errors():
    from magi_attn import (calc_attn, dispatch, dispatch_kv, magi_attn_cross_key, magi_attn_flex_key_for_new_mask,
                           magi_attn_varlen_key_for_new_mask, undispatch_kv)

    key = magi_attn_cross_key([(0, 12)], [(0, 5)], "full", 12, 5, HQ, HK, D, dist_attn_config=cross_config())
    q, kv = torch.randn(12, HQ, D), torch.randn(5, HK, D)
    with pytest.raises(ValueError, match="dispatch_kv"):  # a K/V tensor through the query side
        dispatch(kv, key)
    with pytest.raises(ValueError, match="total_seqlen_k"):  # a query tensor through the K/V side
        dispatch_kv(q, key)
    with pytest.raises(ValueError, match="kv_shard_seqlen"):  # k dispatched with the query side
        calc_attn(dispatch(q, key), dispatch(torch.randn(12, HK, D), key), dispatch(torch.randn(12, HK, D), key), key)
    with pytest.raises(ValueError, match="undispatch_kv expects 5"):
        undispatch_kv(torch.randn(12, HK, D), key)
    with pytest.raises(ValueError, match="kv_placement must be one of"):
        magi_attn_cross_key([(0, 12)], [(0, 5)], "full", 12, 5, HQ, HK, D, kv_placement="all")
    with pytest.raises(ValueError, match="exceeds total_seqlen_k=5"):
        magi_attn_cross_key([(0, 12)], [(0, 6)], "full", 12, 5, HQ, HK, D)
    with pytest.raises(ValueError, match="total_seqlen_k must be a positive int"):
        magi_attn_cross_key([(0, 12)], [(0, 0)], "full", 12, 0, HQ, HK, D)
    with pytest.raises(NotImplementedError, match="cross-attention key"):
        magi_attn_flex_key_for_new_mask(key, [(0, 12)], [(0, 3)], "full")
    with pytest.raises(NotImplementedError, match="cross-attention key"):
        magi_attn_varlen_key_for_new_mask(key, [0, 12], [0, 12])


def test_batch_helpers():
    from magi_attn import (BatchPacking, infer_varlen_mask_from_batch, squash_batch, squash_batch_dim,
                           unsquash_batch)

    x = torch.randn(3, 4, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    packed, p = squash_batch(x, mask)
    assert p.cu_seqlens == (0, 2, 2, 5) and torch.equal(packed, x[mask])
    back = unsquash_batch(packed, p, pad_value=-1.0)
    assert torch.equal(back[mask], x[mask]) and bool((back[~mask] == -1).all())
    full, pf = squash_batch(x)
    assert pf.rows is None and pf.cu_seqlens == (0, 4, 8, 12) and torch.equal(unsquash_batch(full, pf), x)
    assert torch.equal(squash_batch_dim(x), x.reshape(12, 2))
    cu_q, cu_k = infer_varlen_mask_from_batch(3, 4)
    assert cu_q.tolist() == cu_k.tolist() == [0, 4, 8, 12] and cu_q.dtype == torch.int32
    assert isinstance(p, BatchPacking) and p.total_seqlen == 5
    with pytest.raises(ValueError, match="padding between its tokens"):
        squash_batch(x, torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        squash_batch(x, torch.zeros(3, 4) - 1e9)  # an additive bias is not a padding mask
    with pytest.raises(ValueError, match="attention_mask has shape"):
        squash_batch(x, mask[:, :3])
    with pytest.raises(ValueError, match="expects 5 packed rows"):
        unsquash_batch(packed[:4], p)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_cross_attention_gpu_bf16(case):
    """One rank on a GPU, the default kernel backend, bf16: sq != sk through calc_attn against
    float64 dense of the same rounded inputs (tolerance as in test_triton_gpu.py: bf16 P and dS)."""
    from magi_attn import DistAttnConfig, calc_attn, dispatch, dispatch_kv, magi_attn_cross_key, undispatch
    from magi_kernels.testing import dense_attention, dense_mask

    name, slices, sq, sk, placement, _ = next(c for c in CASES if c[0] == case)
    hq, hk, d = 4, 2, 64
    key = magi_attn_cross_key([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], sq, sk,
                              hq, hk, d, kv_placement=placement, dist_attn_config=DistAttnConfig())
    torch.manual_seed(0)
    q = torch.randn(sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out_l, _ = calc_attn(dispatch(q, key), dispatch_kv(k, key), dispatch_kv(v, key), key)
    out = undispatch(out_l, key)
    g = torch.randn_like(out, dtype=torch.float64)
    (out.double() * g).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, _ = dense_attention(q64, k64, v64, dense_mask(slices, sq, sk, device="cuda"))
    (ro * g).sum().backward()
    tol = 2e-2
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert ((a.double() - b).abs().max() / b.abs().max().clamp(min=1)) < 4 * tol
