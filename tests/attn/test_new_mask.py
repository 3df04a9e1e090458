"""Several masks over one dispatch (issue 38 item 2): keys for new masks reuse a base key's token
placement; each runs its own communication and overlap plan, exact against float64 dense on 1-4
gloo ranks, and a model whose layers use different masks dispatches its tensors once."""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import pytest
import torch
import torch.distributed as dist
from dist_cases import HK, HQ, TOL, D, check_case
from dist_harness import run_distributed

CU = [0, 13, 40, 41, 77, 101]
S = CU[-1]


def chunked_causal(cu: list[int], chunk: int) -> list[tuple[int, int, int, int, int]]:
    """Causal inside chunks of ``chunk`` tokens, chunks counted from each document's start (as in
    Llama 4's chunked attention)."""
    return [(cs, min(cs + chunk, de), cs, min(cs + chunk, de), 1)
            for ds, de in itertools.pairwise(cu) for cs in range(ds, de, chunk)]


FLEX = [(0, 30, 60, 101, 0), (50, 101, 0, 50, 2), (30, 60, 30, 60, 3), (70, 101, 70, 101, 1)]


def base_config():
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig

    return DistAttnConfig(dispatch=DispatchConfig(chunk_size=4), overlap=OverlapConfig(degree=2, min_chunk_size=4),
                          kernel_backend="torch")


def with_overlap(**overlap):
    """The base config with other overlap settings (allowed for a new mask; the dispatch is the base's)."""
    from magi_attn import OverlapConfig

    return dataclasses.replace(base_config(), overlap=OverlapConfig(**overlap))


def tuples(slices) -> list[tuple[int, int, int, int, int]]:
    return [s.to_tuple() for s in slices]


def new_mask_keys(base):
    """{name: (slices, key over base's placement)}: full, sliding window, bidirectional window,
    chunked causal and a flex mask, each with its own overlap settings."""
    from magi_attn import magi_attn_flex_key_for_new_mask, magi_attn_varlen_key_for_new_mask
    from magi_solver import varlen_slices

    def varlen(cfg, **kw):
        key = magi_attn_varlen_key_for_new_mask(base, CU, CU, dist_attn_config=cfg, **kw)
        return tuples(varlen_slices(CU, **kw)), key

    def flex(slices, cfg):
        qr, kr, types = [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices]
        return slices, magi_attn_flex_key_for_new_mask(base, qr, kr, types, cfg)

    return {
        "full_docs": varlen(None),
        "sliding_window_7_0": varlen(with_overlap(degree=3, min_chunk_size=3), causal=True, window_size=(7, 0)),
        "bidirectional_window_3_3": varlen(with_overlap(degree=0), window_size=(3, 3)),
        "chunked_causal_8": flex(chunked_causal(CU, 8), with_overlap(degree=None, min_chunk_size=4)),
        "flex": flex(FLEX, with_overlap(degree=1)),
    }


def check_same_placement(base, key) -> None:
    """dispatch / undispatch / get_position_ids of ``key`` are ``base``'s."""
    from magi_attn import dispatch, get_position_ids, undispatch

    x = torch.randn(S, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    local = dispatch(x, base)
    assert torch.equal(dispatch(x, key), local)
    assert torch.equal(get_position_ids(key), get_position_ids(base))
    assert torch.equal(undispatch(local, key), undispatch(local, base)) and torch.equal(undispatch(local, key), x)


def check_chain(rank, base, slices_a, key_a, slices_b, key_b) -> None:
    """Layer 1 (mask A) and layer 2 (mask B) on tensors dispatched once with the base key;
    out, dq, dk, dv through both layers against float64 dense."""
    from magi_attn import calc_attn, dispatch, undispatch
    from magi_kernels.testing import dense_attention, dense_mask

    gen = torch.Generator().manual_seed(zlib.crc32(b"chain"))
    q, k, v = (torch.randn(S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HK, HK))
    g = torch.randn(S, HQ, D, generator=gen, dtype=torch.float64)

    def two_layers(q, k, v, attn_a, attn_b):
        out1 = attn_a(q, k, v)
        return attn_b(q + 0.5 * out1, k + out1[:, :HK], v * out1[:, HK:2 * HK])  # token-wise, like a model

    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    local = two_layers(*(dispatch(t, base) for t in (qd, kd, vd)),
                       lambda *t: calc_attn(*t, key_a)[0], lambda *t: calc_attn(*t, key_b)[0])
    out = undispatch(local, base)
    (out * g).sum().backward()

    mask_a, mask_b = dense_mask(slices_a, S, S), dense_mask(slices_b, S, S)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = two_layers(qr, kr, vr, lambda *t: dense_attention(*t, mask_a)[0], lambda *t: dense_attention(*t, mask_b)[0])
    (ref * g).sum().backward()
    for n, a, b in (("out", out, ref), ("dq", qd.grad, qr.grad), ("dk", kd.grad, kr.grad), ("dv", vd.grad, vr.grad)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m, n=n: f"chain rank={rank} {n}: {m}")


def check_keys(base, keys, group) -> None:
    """Keys name their placement: equal slices over another placement are another key and runtime;
    a key made from a new-mask key keeps the first placement; the base's own mask is the base key."""
    from magi_attn import (
        magi_attn_flex_key,
        magi_attn_flex_key_for_new_mask,
        magi_attn_varlen_key_for_new_mask,
        make_flex_key_for_new_mask_after_dispatch,
        make_varlen_key_for_new_mask_after_dispatch,
    )

    slices, chunked = keys["chunked_causal_8"]
    cfg = chunked.config
    plain = magi_attn_flex_key([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices],
                               S, S, HQ, HK, D, group, cfg)
    assert plain.slices == chunked.slices and plain.placement is None and chunked.placement == base.slices
    assert plain != chunked and plain.runtime is not chunked.runtime
    if base.cp_size > 1:  # balanced for itself, the chunked mask places its tokens elsewhere
        assert plain.runtime.plan.dispatch.partitions != chunked.runtime.plan.dispatch.partitions
    assert chunked.runtime.plan.dispatch.partitions == base.runtime.plan.dispatch.partitions

    swa = keys["sliding_window_7_0"][1]
    again = magi_attn_flex_key_for_new_mask(swa, [s[:2] for s in slices], [s[2:4] for s in slices],
                                            [s[4] for s in slices], cfg)
    assert again == chunked and again.placement == base.slices  # the first placement, not swa's mask
    assert magi_attn_varlen_key_for_new_mask(swa, CU, CU, causal=True) == dataclasses.replace(base, config=swa.config)
    assert make_varlen_key_for_new_mask_after_dispatch(CU, CU, base, causal=True, window_size=(7, 0),
                                                       dist_attn_config=swa.config) == swa
    assert make_flex_key_for_new_mask_after_dispatch([s[:2] for s in slices], [s[2:4] for s in slices],
                                                     [s[4] for s in slices], base, cfg) == chunked


def run_new_masks(rank: int, world: int, use_group: bool = True) -> None:
    from magi_attn import magi_attn_varlen_key

    group = dist.group.WORLD if use_group else None
    base = magi_attn_varlen_key(CU, CU, HQ, HK, D, group, causal=True, dist_attn_config=base_config())
    check_case("base_varlen_causal", list(base.slices), S, "base", group, rank, key=base)
    keys = new_mask_keys(base)
    for name, (slices, key) in keys.items():
        assert key.placement == base.slices, name
        check_same_placement(base, key)
        check_case(name, slices, S, "over_base", group, rank, key=key)
    check_chain(rank, base, *keys["sliding_window_7_0"], *keys["chunked_causal_8"])
    check_chain(rank, base, *keys["flex"], *keys["bidirectional_window_3_3"])
    check_keys(base, keys, group)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_new_masks_over_one_dispatch_match_dense(world):
    run_distributed(run_new_masks, world)


def test_new_masks_single_rank_without_process_group():
    run_new_masks(0, 1, use_group=False)


class TestNewMaskErrors:
    """Each wrong argument of the new-mask keys names itself and the fix."""

    @staticmethod
    def _base():
        from magi_attn import magi_attn_varlen_key

        return magi_attn_varlen_key(CU, CU, HQ, HK, D, causal=True, dist_attn_config=base_config())

    def test_base_key_must_be_a_key(self):
        from magi_attn import magi_attn_flex_key_for_new_mask, magi_attn_varlen_key_for_new_mask

        with pytest.raises(TypeError, match="magi_attn_flex_key_for_new_mask: base_key must be a DistAttnKey"):
            magi_attn_flex_key_for_new_mask(None, [(0, 4)], [(0, 4)], "full")
        with pytest.raises(TypeError, match="magi_attn_varlen_key_for_new_mask: base_key must be a DistAttnKey"):
            magi_attn_varlen_key_for_new_mask("key", CU, CU)

    def test_dispatch_config_is_the_base_keys(self):
        from magi_attn import DispatchConfig, magi_attn_varlen_key_for_new_mask

        other = dataclasses.replace(base_config(), dispatch=DispatchConfig(chunk_size=8))
        with pytest.raises(ValueError, match=r"dist_attn_config.dispatch=.*chunk_size=8.* differs from base_key's.*"
                                             r"dataclasses.replace\(base_key.config, overlap=...\)"):
            magi_attn_varlen_key_for_new_mask(self._base(), CU, CU, dist_attn_config=other)
        with pytest.raises(TypeError, match="dist_attn_config must be a DistAttnConfig or None"):
            magi_attn_varlen_key_for_new_mask(self._base(), CU, CU, dist_attn_config={"overlap": 2})

    def test_mask_must_lie_in_the_base_sequence(self):
        from magi_attn import magi_attn_flex_key_for_new_mask, magi_attn_varlen_key_for_new_mask

        with pytest.raises(ValueError, match=r"cu_seqlens_q ends at 90 but base_key's sequence has total_seqlen=101.*"
                                             r"cu_seqlens_q\[-1\] must be 101"):
            magi_attn_varlen_key_for_new_mask(self._base(), [0, 90], [0, 90])
        with pytest.raises(ValueError, match=r"cu_seqlens_k ends at 90"):
            magi_attn_varlen_key_for_new_mask(self._base(), CU, [0, 10, 20, 30, 40, 90])
        with pytest.raises(ValueError, match=r"k_ranges\[1\]=\[0, 120\) ends past base_key's total_seqlen=101"):
            magi_attn_flex_key_for_new_mask(self._base(), [(0, 10), (10, 20)], [(0, 10), (0, 120)], "full")
        with pytest.raises(ValueError, match="both cover cell"):
            magi_attn_flex_key_for_new_mask(self._base(), [(0, 10), (5, 10)], [(0, 10), (0, 10)], "full")
