"""CUDA IPC group collectives: several processes sharing one GPU give exactly the results of
the torch.distributed (gloo, CPU) backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed

pytestmark = pytest.mark.gpu


def ipc_worker(rank, world):
    from magi_comm import group_cast, group_reduce
    from magi_comm.ipc import IpcGroupCollectives
    from magi_solver import DispatchConfig, DistAttnPlan, OverlapConfig, varlen_slices

    torch.cuda.set_device(0)
    plan = DistAttnPlan(varlen_slices([0, 70, 71, 150, 230], causal=True), 230, world,
                        dispatch_config=DispatchConfig(chunk_size=8), overlap_config=OverlapConfig(degree=2, min_chunk_size=8))
    ipc = IpcGroupCollectives(dist.group.WORLD, 1 << 22, torch.device("cuda", 0))
    g = torch.Generator().manual_seed(rank)
    for s in range(plan.num_stages):
        cp = plan.cast_plan(s, rank)
        x = torch.randn(plan.dispatch.shard_seqlen, 4, 16, generator=g).to(torch.bfloat16)
        kw = dict(input_split_sizes=cp.input_split_sizes, output_split_sizes=cp.output_split_sizes,
                  dst_indices=cp.dst_indices, src_index=cp.src_index)
        ref = group_cast(x, group=dist.group.WORLD, **kw)
        got = ipc.group_cast(x.cuda(), **kw)
        assert torch.equal(got.cpu(), ref), f"cast stage {s} rank {rank}"
        rp = cp.transpose()
        part = torch.randn(cp.output_rows, 4, 16, generator=g)
        acc0 = torch.randn(plan.dispatch.shard_seqlen, 4, 16, generator=g)
        kw = dict(input_split_sizes=rp.input_split_sizes, output_split_sizes=rp.output_split_sizes,
                  dst_index=rp.dst_index, src_indices=rp.src_indices)
        ref = group_reduce(part, acc0.clone(), group=dist.group.WORLD, **kw)
        got = ipc.group_reduce(part.cuda(), acc0.cuda(), **kw)
        torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)  # fp32 sums, other order


@pytest.mark.parametrize("world", [2, 3])
def test_ipc_matches_torch_distributed(world):
    run_distributed(ipc_worker, world)
