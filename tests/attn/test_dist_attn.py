"""Distributed attention equals a float64 dense reference (out, lse, dq, dk, dv) on 1-4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import mask_cases
from dist_cases import CONFIGS, HK, HQ, D, check_case
from dist_harness import run_distributed


def run_all_cases(rank, world, cfg_names):
    group = dist.group.WORLD
    for cfg_name in cfg_names:
        for name, (slices, S) in mask_cases().items():
            check_case(name, slices, S, cfg_name, group, rank)
    check_case("mixed_overlapping_softcap", *mask_cases()["mixed_overlapping"], "degree1", group, rank, softcap=2.0)
    check_features(rank, group)


def check_features(rank, group):
    """Sinks (per head, and several sink tokens) over multi-stage merges, and a value head dim
    wider and narrower than the query/key head dim (MLA), against float64 dense."""
    cases = mask_cases()
    check_case("sink_per_head", *cases["varlen_block_causal"], "degree3", group, rank, sink_shape=(HQ,))
    check_case("sink_tokens", *cases["mixed_overlapping"], "degree1", group, rank, sink_shape=(3, HQ), softcap=2.0)
    check_case("wide_v", *cases["varlen_block_causal"], "degree3", group, rank, dv=12)
    check_case("narrow_v_sink", *cases["mixed_overlapping"], "no_overlap", group, rank, dv=4, sink_shape=(HQ,))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_matches_dense_reference(world):
    cfgs = list(CONFIGS) if world != 3 else ["degree1", "degree3", "sequential_chunk5"]
    run_distributed(run_all_cases, world, cfgs)


def test_single_rank_without_process_group():
    for name, (slices, S) in mask_cases().items():
        check_case(name, slices, S, "degree1", None, 0)
    check_features(0, None)


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

    assert magi_attn_flex_key([(0, 4)], [(0, 6)], "full", 4, 6, 2, 1, 8).is_cross  # test_cross.py
    assert not magi_attn_flex_key([(0, 4)], [(0, 4)], "full", 4, 4, 2, 1, 8).is_cross
    with pytest.raises(ValueError, match="multiple of num_heads_kv"):
        magi_attn_flex_key([(0, 4)], [(0, 4)], "full", 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="both cover cell"):
        magi_attn_flex_key([(0, 4), (2, 4)], [(0, 4), (0, 2)], "full", 4, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="kernel_backend"):
        DistAttnConfig(kernel_backend="cuda")
    with pytest.raises(ValueError, match="exceeds max_num_chunks"):
        OverlapConfig(degree=9, max_num_chunks=4)
    with pytest.raises(RuntimeError, match="not initialized"):
        magi_attn_varlen_key([0, 4], [0, 4], 2, 1, 8, cp_group=dist.ProcessGroup(dist.HashStore(), 0, 1))
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed ProcessGroup, a DeviceMesh"):
        magi_attn_varlen_key([0, 4], [0, 4], 2, 1, 8, cp_group=object())
    key = magi_attn_varlen_key([0, 10], [0, 10], 2, 1, 8, causal=True)
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match=r"k must be \[shard_seqlen, num_heads_kv, head_dim\]"):
        calc_attn(q, q, q, key)


class TestInputErrors:
    """Each wrong input of the top-level API gets an error that names the argument."""

    def test_key_must_be_a_key(self):
        from magi_attn import calc_attn, dispatch, undispatch

        x = torch.zeros(4, 2, 8)
        with pytest.raises(TypeError, match="calc_attn: key must be a DistAttnKey"):
            calc_attn(x, x, x, None)
        with pytest.raises(TypeError, match="dispatch: key must be a DistAttnKey"):
            dispatch(x, None)
        with pytest.raises(TypeError, match="undispatch: key must be a DistAttnKey"):
            undispatch(x, "key")

    @pytest.mark.parametrize("ws", [5, (2.5, 0), (-2, 0), (1, 2, 3), (True, 0)])
    def test_window_size(self, ws):
        from magi_attn import magi_attn_varlen_key

        with pytest.raises(ValueError, match=r"window_size must be \(left, right\) with ints >= -1"):
            magi_attn_varlen_key([0, 8], [0, 8], 2, 1, 8, window_size=ws)

    @pytest.mark.parametrize("cu,err,match", [
        (torch.tensor([0.0, 4.0, 8.0]), TypeError, r"cu_seqlens_q must be a 1-D int32/int64 tensor.*float32"),
        (torch.tensor([[0, 4, 8]]), TypeError, r"cu_seqlens_q must be a 1-D int32/int64 tensor.*shape \(1, 3\)"),
        ([0, 2.5, 8], TypeError, r"cu_seqlens_q\[1\]=2.5 is not an int"),
        ([[0, 4, 8]], TypeError, r"cu_seqlens_q\[0\]=\[0, 4, 8\] is not an int"),
        ([0, 5, 3], ValueError, "cu_seqlens_q must start at 0 and be non-decreasing"),
        ([2, 5, 8], ValueError, "cu_seqlens_q must start at 0 and be non-decreasing"),
        (torch.tensor([0, 4, 8], device="meta"), ValueError, "cu_seqlens_q is on the meta device"),
    ])
    def test_cu_seqlens(self, cu, err, match):
        from magi_attn import magi_attn_varlen_key

        with pytest.raises(err, match=match):
            magi_attn_varlen_key(cu, [0, 4, 8], 2, 1, 8)

    def test_scale_and_softcap(self):
        from magi_attn import calc_attn, magi_attn_varlen_key

        key = magi_attn_varlen_key([0, 8], [0, 8], 2, 1, 8, causal=True)
        q = torch.randn(key.shard_seqlen, 2, 8)
        k = torch.randn(key.shard_seqlen, 1, 8)
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            calc_attn(q, k, k, key, softmax_scale=float("nan"))
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            calc_attn(q, k, k, key, softcap=float("nan"))

    def test_world_group_before_init_process_group(self, monkeypatch):
        """dist.group.WORLD is None before init_process_group: in a launched rank that must not plan for one rank."""
        from magi_attn import magi_attn_varlen_key

        assert not dist.is_initialized() and dist.group.WORLD is None
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(RuntimeError, match=r"call dist.init_process_group\(...\) before building the key"):
            magi_attn_varlen_key([0, 8], [0, 8], 2, 1, 8, cp_group=dist.group.WORLD)
        monkeypatch.setenv("WORLD_SIZE", "1")  # a single process: cp_group=None is one rank
        magi_attn_varlen_key([0, 8], [0, 8], 2, 1, 8, cp_group=None)


def stale_group_worker(rank, world, store_path):
    """A key used after its process group was destroyed, or destroyed and replaced by a new one."""
    from magi_attn import calc_attn, dispatch, magi_attn_varlen_key

    x = torch.randn(16, 2, 8)
    sub = dist.new_group(list(range(world)))
    sub_key = magi_attn_varlen_key([0, 16], [0, 16], 2, 2, 8, cp_group=sub, causal=True)
    dist.destroy_process_group(sub)
    with pytest.raises(RuntimeError, match="was destroyed or replaced .* build a new key"):
        dispatch(x, sub_key)
    key = magi_attn_varlen_key([0, 16], [0, 16], 2, 2, 8, cp_group=dist.group.WORLD, causal=True)
    q = dispatch(x, key)
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="was destroyed .torch.distributed is not initialized.; build a new key"):
        calc_attn(q, q, q, key)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    with pytest.raises(RuntimeError, match="was destroyed or replaced .* build a new key"):
        calc_attn(q, q, q, key)
    new_key = magi_attn_varlen_key([0, 16], [0, 16], 2, 2, 8, cp_group=dist.group.WORLD, causal=True)
    calc_attn(q, q, q, new_key)  # the new key works


def test_key_of_a_destroyed_or_replaced_group(tmp_path):
    run_distributed(stale_group_worker, 2, str(tmp_path / "store"))


def test_make_mask_window_and_block(capsys):
    from magi_attn.cli import main
    from magi_attn.masks import make_mask
    from magi_solver import total_area

    for w in (0, -1, 2.5):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            make_mask("sliding_window", 64, window=w)
    with pytest.raises(ValueError, match="block must be an int >= 1"):
        make_mask("varlen_block_causal", 64, block=0)
    with pytest.raises(SystemExit) as exit_:  # the CLI refuses it before planning
        main(["plan", "--mask", "sliding_window", "--window", "0", "--seqlen", "64", "--cp", "2"])
    assert exit_.value.code == 2 and "--window: must be a positive integer" in capsys.readouterr().err
    assert total_area(make_mask("sliding_window", 8, window=1)) == 8  # each query sees itself only
