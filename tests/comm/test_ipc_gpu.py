"""CUDA IPC group collectives: several processes sharing one GPU give exactly the results of
the torch.distributed (gloo, CPU) backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed

pytestmark = pytest.mark.gpu


def ipc_worker(rank, world):
    from magi_comm import IpcGroupCollectives, group_cast, group_reduce
    from magi_solver import DispatchConfig, DistAttnPlan, OverlapConfig, varlen_slices

    torch.cuda.set_device(0)
    plan = DistAttnPlan(varlen_slices([0, 70, 71, 150, 230], causal=True), 230, world,
                        dispatch_config=DispatchConfig(chunk_size=8), overlap_config=OverlapConfig(degree=2, min_chunk_size=8))
    ipc = IpcGroupCollectives(dist.group.WORLD, 1 << 22, torch.device("cuda", 0))
    g = torch.Generator().manual_seed(rank)
    for s in range(plan.num_stages):
        cp = plan.cast_plan(s, rank)
        x = torch.randn(plan.dispatch.shard_seqlens[rank], 4, 16, generator=g).to(torch.bfloat16)
        kw = dict(input_split_sizes=cp.input_split_sizes, output_split_sizes=cp.output_split_sizes,
                  dst_indices=cp.dst_indices, src_index=cp.src_index)
        ref = group_cast(x, group=dist.group.WORLD, **kw)
        got = ipc.group_cast(x.cuda(), **kw)
        assert torch.equal(got.cpu(), ref), f"cast stage {s} rank {rank}"
        rp = cp.transpose()
        part = torch.randn(cp.output_rows, 4, 16, generator=g)
        acc0 = torch.randn(plan.dispatch.shard_seqlens[rank], 4, 16, generator=g)
        kw = dict(input_split_sizes=rp.input_split_sizes, output_split_sizes=rp.output_split_sizes,
                  dst_index=rp.dst_index, src_indices=rp.src_indices)
        ref = group_reduce(part, acc0.clone(), group=dist.group.WORLD, **kw)
        got = ipc.group_reduce(part.cuda(), acc0.cuda(), **kw)
        torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)  # fp32 sums, other order


@pytest.mark.parametrize("world", [2, 3])
def test_ipc_matches_torch_distributed(world):
    run_distributed(ipc_worker, world)


def ipc_attn_worker(rank, world):
    """calc_attn with comm_backend="ipc" (GPU, processes sharing one GPU) equals the same run
    with the a2a backend on the CPU."""
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig, calc_attn, dispatch, magi_attn_varlen_key, undispatch

    torch.cuda.set_device(0)
    cu = [0, 100, 101, 260, 300]
    outs, grads = [], []
    for comm, dev in (("a2a", "cpu"), ("ipc", "cuda")):
        cfg = DistAttnConfig(DispatchConfig(chunk_size=16), OverlapConfig(degree=2, min_chunk_size=16),
                             kernel_backend="torch", comm_backend=comm)
        key = magi_attn_varlen_key(cu, cu, 4, 2, 32, dist.group.WORLD, causal=True, dist_attn_config=cfg)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(300, h, 32, generator=g).to(dev).requires_grad_() for h in (4, 2, 2))
        out = undispatch(calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)[0], key)
        out.square().sum().backward()
        outs.append(out.detach().cpu())
        grads.append([t.grad.cpu() for t in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_ipc_backend_in_calc_attn():
    run_distributed(ipc_attn_worker, 2)
