"""Uneven shards (no padding) and the chunk-size cap, on 1, 3 and 4 gloo ranks: dispatch /
undispatch round trips and calc_attn forward and backward against float64 dense, for lengths
that no CP size divides (1,050 tokens with the issue's chunk_size 568, primes, fewer tokens than
cp * chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_cases import HK, HQ, check_case
from dist_harness import run_distributed

CAUSAL_DOCS = [0, 400, 1050]


def _slices(cu, causal=True, window=(-1, -1)):
    from magi_solver import varlen_slices

    return [s.to_tuple() for s in varlen_slices(cu, cu, causal=causal, window_size=window)]


# name: (slices, S, dispatch config, overlap degree, comm backend)
CASES = {
    "issue_1050_chunk568": (_slices(CAUSAL_DOCS), 1050, dict(chunk_size=568), 1, "a2a"),
    "prime_101_chunk7_overlap": (_slices([0, 30, 101]), 101, dict(chunk_size=7), 2, "a2a"),
    "prime_89_window_auto": (_slices([0, 89], causal=False, window=(9, 3)), 89, {}, 1, "a2a"),
    "prime_53_sequential_hier": (_slices([0, 20, 53]), 53, dict(chunk_size=6, alg="sequential"), 2, "hier"),
    "seven_tokens_full": (_slices([0, 7], causal=False), 7, {}, 1, "a2a"),
    "five_tokens_chunk3": (_slices([0, 5]), 5, dict(chunk_size=3), 0, "a2a"),
}


def _key(name, group, world):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig, magi_attn_flex_key

    slices, S, disp, degree, comm = CASES[name]
    hier = dict(comm_backend="hier", ranks_per_node=2 if world % 2 == 0 else 1) if comm == "hier" else {}
    config = DistAttnConfig(DispatchConfig(**disp), OverlapConfig(degree=degree, min_chunk_size=3),
                            kernel_backend="torch", **hier)
    return magi_attn_flex_key([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], S, S,
                              HQ, HK, 8, group, config)


def _check_round_trip(key, S, rank):
    from magi_attn import dispatch, get_position_ids, undispatch

    x = torch.randn(S, 3, generator=torch.Generator().manual_seed(S), dtype=torch.float64)
    local = dispatch(x, key)
    rt = key.runtime
    assert local.shape[0] == key.shard_seqlen == rt.shard_seqlens[rank] >= 1  # every rank holds a real token
    assert sum(rt.shard_seqlens) == S  # and no padding
    assert torch.equal(local, x[get_position_ids(key)])
    assert torch.equal(undispatch(local, key), x)


def uneven_worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    for name, (slices, S, *_rest) in CASES.items():
        key = _key(name, group, world)
        _check_round_trip(key, S, rank)
        if S < 1000 or world == 4:  # the 1,050-token dense reference costs seconds: run it at the cp 4
            check_case(name, slices, S, None, group, rank, key=key)
    key = _key("issue_1050_chunk568", group, world)
    if world == 4:  # the issue: 568-token chunks padded 1,050 tokens to 2,272, two ranks held padding only
        assert key.runtime.plan.dispatch.chunk_size == 263 and key.runtime.shard_seqlens == (261, 263, 263, 263)
    if world > 1:
        assert len(set(_key("prime_101_chunk7_overlap", group, world).runtime.shard_seqlens)) > 1


@pytest.mark.parametrize("world", [3, 4])
def test_uneven_shards_match_dense(world):
    run_distributed(uneven_worker, world)


def test_uneven_single_rank():
    uneven_worker(0, 1)


def test_plan_cli_reports_balance_and_padding(capsys):
    import json

    from magi_attn.cli import main

    assert main(["plan", "--mask", "causal", "--seqlen", "1050", "--cp", "4", "--chunk-size", "568"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chunk_size"] == 263 and report["pad_tokens"] == 0
    assert report["max_shard_seqlen"] == 263 and report["token_imbalance"] == pytest.approx(1.0019, abs=1e-4)
    assert report["imbalance"] > 1.0  # max/mean mask area: one 263-token chunk a rank cannot balance a causal mask
