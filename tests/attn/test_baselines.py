"""Ring-allgather (zigzag) and Ulysses baselines equal the float64 dense reference (fwd + bwd)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cases import mask_cases
from dist_harness import run_distributed

D = 8


def baseline_worker(rank, world, method):
    from magi_attn.baselines import contiguous_dispatch, ring_allgather_attn, ulysses_attn, zigzag_dispatch
    from magi_kernels.testing import dense_attention, dense_mask
    from magi_solver import AttnMaskType, AttnRange, AttnSlice

    hq, hk = (4, 2) if world == 2 else (8, 2)
    shard, attn = (zigzag_dispatch, ring_allgather_attn) if method == "ring" else (contiguous_dispatch, ulysses_attn)
    for name in ("varlen_causal", "mixed_overlapping", "sliding_window"):
        tuples, S = mask_cases()[name]
        slices = [AttnSlice(AttnRange(a, b), AttnRange(c, d), AttnMaskType(t)) for a, b, c, d, t in tuples]
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(S, h, D, generator=g, dtype=torch.float64) for h in (hq, hk, hk))
        go = torch.randn(S, hq, D, generator=g, dtype=torch.float64)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attn(*(shard(t, world, rank) for t in leaves), slices, S, dist.group.WORLD, backend="torch")
        gather = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gather, out.detach())
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ro, _ = dense_attention(*ref_leaves, dense_mask(tuples, S, S))
        (ro * go).sum().backward()
        (out * shard(go, world, rank)).sum().backward()
        full = torch.cat(gather)
        ref_sharded = torch.cat([shard(ro.detach(), world, p) for p in range(world)])
        torch.testing.assert_close(full, ref_sharded, atol=1e-10, rtol=0, msg=lambda m: f"{method} {name} out: {m}")
        for a, b, n in zip(leaves, ref_leaves, "qkv"):
            ga = a.grad.clone()
            dist.all_reduce(ga)  # inputs are replicated: each rank holds its shard's contribution
            torch.testing.assert_close(ga, b.grad, atol=1e-10, rtol=0, msg=lambda m, n=n: f"{method} {name} d{n}: {m}")


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("world", [2, 4])
def test_baselines_match_dense(method, world):
    run_distributed(baseline_worker, world, method)
