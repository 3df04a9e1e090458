"""Ranks that disagree fail together with a message that names what differs; a rank that fails,
exits or hangs makes the others raise within DistAttnConfig.comm_timeout_s instead of hanging."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from magi_attn import (
    DistAttnConfig,
    OverlapConfig,
    PeerFailureError,
    PlanMismatchError,
    calc_attn,
    dispatch,
    magi_attn_flex_key,
    magi_attn_varlen_key,
)

SEQ, HQ, HK, D = 64, 4, 2, 8


def _same_on_every_rank(message: str) -> None:
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert all(m == messages[0] for m in messages), messages


def _key(rank: int, case: str, config: DistAttnConfig = DistAttnConfig(), group="world"):
    group = dist.group.WORLD if group == "world" else group
    hq, d, causal, cu = HQ, D, True, [0, SEQ]
    if case == "seqlen" and rank == 1:
        cu = [0, SEQ + 16]
    if case == "heads" and rank == 1:
        hq = 2 * HQ
    if case == "head_dim" and rank == 1:
        d = 2 * D
    if case == "mask" and rank == 1:  # same sizes, so the transfers would agree: silently wrong before
        causal = False
    if case == "documents" and rank == 1:
        cu = [0, SEQ // 2, SEQ]
    if case == "config" and rank == 1:
        config = DistAttnConfig(overlap=OverlapConfig(degree=2))
    return magi_attn_varlen_key(cu, cu, hq, HK, d, group, causal=causal, dist_attn_config=config)


def _key_mismatch(rank: int, world: int, case: str, field: str) -> None:
    with pytest.raises(PlanMismatchError, match=field) as err:
        _key(rank, case)
    assert "every rank must pass the same values" in str(err.value)
    _same_on_every_rank(str(err.value))


@pytest.mark.parametrize("case,field", [
    ("seqlen", "total_seqlen: rank 0: 64, rank 1: 80"),
    ("heads", "num_heads_q: rank 0: 4, rank 1: 8"),
    ("head_dim", "head_dim: rank 0: 8, rank 1: 16"),
    ("mask", "mask slices: differs"),
    ("documents", "number of mask slices: rank 0: 1, rank 1: 2"),
    ("config", "dist_attn_config.overlap: differs"),
])
def test_keys_that_differ_fail_on_every_rank_naming_the_field(case, field):
    run_distributed(_key_mismatch, 2, case, field)


def _three_ranks_one_differs(rank: int, world: int) -> None:
    with pytest.raises(PlanMismatchError, match=r"mask slices: differs \(ranks \[0, 2\] / rank 1 hold"):
        _key(rank, "mask")


def test_the_message_groups_the_ranks_that_agree():
    run_distributed(_three_ranks_one_differs, 3)


def _qkv(key, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(SEQ, h, D, generator=g, dtype=dtype) for h in (HQ, HK, HK))
    return [dispatch(t, key).requires_grad_() for t in (q, k, v)]


def _call_mismatch(rank: int, world: int, case: str, field: str) -> None:
    key = _key(rank, "")
    dtype = torch.float32 if case == "dtype" and rank == 1 else torch.float64
    scale = 0.5 if case == "scale" and rank == 1 else None
    q, k, v = _qkv(key, dtype)
    with pytest.raises(PlanMismatchError, match=field) as err:
        calc_attn(q, k, v, key, softmax_scale=scale)
    _same_on_every_rank(str(err.value))


@pytest.mark.parametrize("case,field", [
    ("dtype", "dtype: rank 0: float64, rank 1: float32"),
    ("scale", "softmax_scale: differs"),
])
def test_calls_that_differ_fail_on_every_rank(case, field):
    run_distributed(_call_mismatch, 2, case, field)


TIMEOUT_S = 3.0


def _one_rank_without_group(rank: int, world: int) -> None:
    config = DistAttnConfig(comm_timeout_s=TIMEOUT_S)
    if rank == 1:
        _key(rank, "", config, group=None)  # plans for one rank and never joins the check
        time.sleep(2 * TIMEOUT_S)
        return
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError, match="cp_group=None"):
        _key(rank, "", config)
    assert TIMEOUT_S * 0.9 <= time.monotonic() - t0 < TIMEOUT_S + 10


def test_a_rank_that_passes_no_group_makes_the_others_time_out():
    run_distributed(_one_rank_without_group, 2)


def _peer_leaves(rank: int, world: int, where: str, how: str) -> None:
    """Rank 1 exits (or hangs) at ``where``; rank 0 must raise PeerFailureError in time."""
    config = DistAttnConfig(comm_timeout_s=TIMEOUT_S)

    def leave():
        if how == "exit":
            os._exit(0)  # a crashed process: its sockets close
        time.sleep(3 * TIMEOUT_S)  # a hung process
        os._exit(0)

    key = _key(rank, "", config)
    q, k, v = _qkv(key)
    out, _ = calc_attn(q, k, v, key)  # the first call also agrees on the call's arguments
    if rank == 1 and where == "forward":
        leave()
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError, match="a peer rank failed, exited, or did not reach") as err:
        if where == "forward":
            calc_attn(q, k, v, key)
        else:
            if rank == 1:
                leave()
            out.sum().backward()
    assert time.monotonic() - t0 < TIMEOUT_S + 10, err.value
    assert ("GroupCast" in str(err.value)) or ("GroupReduce" in str(err.value)), err.value


def _peer_leaves_at_key(rank: int, world: int, how: str) -> None:
    config = DistAttnConfig(comm_timeout_s=TIMEOUT_S)
    if rank == 1:
        if how == "exit":
            os._exit(0)
        time.sleep(3 * TIMEOUT_S)
        os._exit(0)
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError, match="check of the key"):
        _key(rank, "", config)
    assert time.monotonic() - t0 < TIMEOUT_S + 10


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_peer_that_leaves_at_key_creation(how):
    run_distributed(_peer_leaves_at_key, 2, how)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_peer_that_leaves_in_forward_or_backward(where, how):
    run_distributed(_peer_leaves, 2, where, how)


def test_comm_timeout_is_validated():
    for bad in (0, -1.0, float("nan"), float("inf"), "10", True):
        with pytest.raises(ValueError, match="DistAttnConfig.comm_timeout_s"):
            DistAttnConfig(comm_timeout_s=bad)
    assert DistAttnConfig(comm_timeout_s=None).comm_timeout_s is None


def _agreement_is_free_once_agreed(rank: int, world: int) -> None:
    """The call check runs on the first call and again only when a value changes."""
    from magi_attn import agreement

    calls = []
    real = agreement.check_agreement

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    import magi_attn.api as api

    api.check_agreement = counting
    try:
        key = _key(rank, "")
        q, k, v = _qkv(key)
        for _ in range(3):
            calc_attn(q, k, v, key)
        with torch.no_grad():
            calc_attn(q, k, v, key)
    finally:
        api.check_agreement = real
    assert len(calls) == 3, calls  # the key, the first call, the no-grad call


def test_call_check_runs_only_when_the_call_changes():
    run_distributed(_agreement_is_free_once_agreed, 2)


def _flex_key_with_other_mask_and_same_sizes(rank: int, world: int) -> None:
    # two masks of equal area and slice count: only the fingerprint can tell them apart
    qr = [(0, SEQ // 2), (SEQ // 2, SEQ)]
    kr = [(0, SEQ // 2), (SEQ // 2, SEQ)] if rank == 0 else [(SEQ // 2, SEQ), (0, SEQ // 2)]
    with pytest.raises(PlanMismatchError, match="mask slices: differs"):
        magi_attn_flex_key(qr, kr, "full", SEQ, SEQ, HQ, HK, D, dist.group.WORLD)


def test_flex_keys_with_equal_sizes_but_other_masks_fail():
    run_distributed(_flex_key_with_other_mask_and_same_sizes, 2)


def _new_mask_key_over_other_bases(rank: int, world: int) -> None:
    # both bases agree across ranks; only the base each rank picks for the new mask differs
    from magi_attn import magi_attn_varlen_key_for_new_mask

    cu = [0, 24, SEQ]
    causal = magi_attn_varlen_key(cu, cu, HQ, HK, D, dist.group.WORLD, causal=True)
    full = magi_attn_varlen_key(cu, cu, HQ, HK, D, dist.group.WORLD)
    base = causal if rank == 0 else full
    with pytest.raises(PlanMismatchError, match=r"dispatch placement \(the base key's mask, for a new-mask key\): "
                                                r"differs \(rank 0 / rank 1 hold different values\)") as err:
        magi_attn_varlen_key_for_new_mask(base, cu, cu, causal=True, window_size=(5, 0))
    assert "mask slices" not in str(err.value)  # the new mask itself agrees
    _same_on_every_rank(str(err.value))


def test_new_mask_keys_over_different_bases_fail_naming_the_placement():
    run_distributed(_new_mask_key_over_other_bases, 2)
