"""roll on dispatched tensors equals rolling the global tensor and dispatching it, forward and
backward, on 1-4 gloo ranks (whose shards hold different token counts)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed

CU = [0, 13, 40, 41, 77]  # 77 tokens in chunks of 4: uneven shards at every CP size


def _check(rank: int, world: int) -> None:
    from magi_attn import DispatchConfig, DistAttnConfig, dispatch, magi_attn_varlen_key, roll

    group = dist.group.WORLD if world > 1 else None
    key = magi_attn_varlen_key(CU, CU, 2, 1, 8, group, causal=True,
                               dist_attn_config=DistAttnConfig(dispatch=DispatchConfig(chunk_size=4)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CU[-1], 3, generator=g, dtype=torch.float64)
    w = torch.randn(CU[-1], 3, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 100, (CU[-1],), generator=g)
    if world > 1:
        assert len(set(key.runtime.shard_seqlens)) > 1 and sum(key.runtime.shard_seqlens) == CU[-1]
    for shifts in (1, -1, -3, 5, 0, 77, -80):
        xd = x.clone().requires_grad_()
        xr = x.clone().requires_grad_()
        got = roll(dispatch(xd, key), shifts, key)
        want = dispatch(torch.roll(xr, shifts, dims=0), key)
        assert torch.equal(got, want), (rank, shifts)
        wd = dispatch(w, key)
        (got * wd).sum().backward()
        (want * wd).sum().backward()
        torch.testing.assert_close(xd.grad, xr.grad, atol=0, rtol=0, msg=lambda m, s=shifts: f"rank {rank} shifts {s}: {m}")
        got_labels = roll(dispatch(labels, key), -shifts, key)
        assert torch.equal(got_labels, dispatch(torch.roll(labels, -shifts), key))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_roll_matches_global_roll(world):
    run_distributed(_check, world)


def test_roll_single_rank_and_errors():
    from magi_attn import dispatch, magi_attn_varlen_key, roll

    _check(0, 1)
    key = magi_attn_varlen_key(CU, CU, 2, 1, 8, None, causal=True)
    x = dispatch(torch.randn(CU[-1], 3), key)
    with pytest.raises(TypeError, match="shifts must be an int"):
        roll(x, 1.5, key)
    with pytest.raises(ValueError, match=r"x must be a dispatched tensor \[shard_seqlen=77 \(this rank's\)"):
        roll(x[:5], 1, key)
    with pytest.raises(TypeError, match="roll: key must be a DistAttnKey"):
        roll(x, 1, None)


def _check_cross(rank: int, world: int) -> None:
    """roll on the query side of a cross-attention key (labels of the query sequence)."""
    from magi_attn import DispatchConfig, DistAttnConfig, dispatch, magi_attn_cross_key, roll

    cfg = DistAttnConfig(dispatch=DispatchConfig(chunk_size=4))
    key = magi_attn_cross_key([[0, 40], [40, 77]], [[0, 9], [9, 20]], "full", 77, 20, 2, 1, 8,
                              dist.group.WORLD if world > 1 else None, dist_attn_config=cfg)
    x = torch.randn(CU[-1], 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for shifts in (1, -3, 40):
        assert torch.equal(roll(dispatch(x, key), shifts, key), dispatch(torch.roll(x, shifts, dims=0), key)), \
            (rank, shifts)


@pytest.mark.parametrize("world", [1, 3])
def test_roll_on_the_query_side_of_a_cross_key(world):
    if world == 1:
        _check_cross(0, 1)
    else:
        run_distributed(_check_cross, world)
