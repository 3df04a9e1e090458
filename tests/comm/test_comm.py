"""GroupCast / GroupReduce semantics on gloo, checked against a direct construction."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed


def _plan(world):
    """Rank r holds rows r*10..r*10+9 (value = global row); every rank r asks for a rank-specific
    set of rows from each other rank, overlapping between receivers."""
    cast = {}
    for r in range(world):
        wants = {p: [(1 + r, 4 + r)] if p != r else [] for p in range(world)}
        cast[r] = wants
    return cast


def comm_worker(rank, world):
    from magi_comm import group_cast, group_reduce
    from magi_solver.comm_plan import GroupCastPlan, segments_with_destinations

    wants = _plan(world)  # wants[receiver][sender] = local row ranges of sender
    pieces = [(s, e, dst) for dst in range(world) for (s, e) in wants[dst][rank]]
    in_sizes, dsts = segments_with_destinations(10, pieces)
    out_sizes, src = [], []
    for sender in range(world):
        for s, e in wants[rank][sender]:
            out_sizes.append(e - s)
            src.append(sender)
    plan = GroupCastPlan(tuple(in_sizes), tuple(dsts), tuple(out_sizes), tuple(src))
    x = (torch.arange(10, dtype=torch.float64) + 10 * rank)[:, None].repeat(1, 3)
    for dtype in (torch.float64, torch.bfloat16):
        out = group_cast(x.to(dtype), input_split_sizes=plan.input_split_sizes, output_split_sizes=plan.output_split_sizes,
                         dst_indices=plan.dst_indices, src_index=plan.src_index, group=dist.group.WORLD)
        expect = torch.cat([(torch.arange(s, e, dtype=torch.float64) + 10 * snd)[:, None].repeat(1, 3)
                            for snd in range(world) for s, e in wants[rank][snd]]) if out_sizes else out.double()
        assert torch.equal(out.double(), expect), (rank, dtype, out, expect)
    # reduce: everyone sends back 1.0 per received row -> each row gets the number of receivers
    red = plan.transpose()
    acc = torch.full((10, 3), 0.5, dtype=torch.float64)
    part = torch.ones(plan.output_rows, 3, dtype=torch.float64)
    group_reduce(part, acc, input_split_sizes=red.input_split_sizes, output_split_sizes=red.output_split_sizes,
                 dst_index=red.dst_index, src_indices=red.src_indices, group=dist.group.WORLD, op="sum")
    counts = torch.tensor(
        [sum(1 for dst in range(world) for s, e in wants[dst][rank] if s <= i < e) for i in range(10)],
        dtype=torch.float64,
    )
    assert torch.equal(acc, 0.5 + counts[:, None].repeat(1, 3)), (rank, acc, counts)
    # lse reduce: merging partials (o_i, l_i) equals the closed form
    gen = torch.Generator().manual_seed(7 + rank)
    part_o = torch.randn(plan.output_rows, 2, 4, generator=gen, dtype=torch.float64)
    part_l = torch.randn(plan.output_rows, 2, generator=gen, dtype=torch.float64)
    out_o = torch.zeros(10, 2, 4, dtype=torch.float64)
    out_l = torch.full((10, 2), float("-inf"), dtype=torch.float64)
    group_reduce(part_o, out_o, input_split_sizes=red.input_split_sizes, output_split_sizes=red.output_split_sizes,
                 dst_index=red.dst_index, src_indices=red.src_indices, group=dist.group.WORLD, op="lse",
                 input_lse=part_l, output_lse=out_l)
    ref_o, ref_l = _expected_lse(rank, world, wants)
    torch.testing.assert_close(out_l, ref_l, atol=1e-12, rtol=0)
    torch.testing.assert_close(out_o, ref_o, atol=1e-12, rtol=0)


def _expected_lse(rank, world, wants):
    """Recompute every receiver's random partials (same seeds) and merge by hand."""
    num = torch.zeros(10, 2, 4, dtype=torch.float64)
    den = torch.zeros(10, 2, dtype=torch.float64)
    for recv in range(world):
        rows = sum((e - s for snd in range(world) for s, e in wants[recv][snd]), 0)
        gen = torch.Generator().manual_seed(7 + recv)
        po = torch.randn(rows, 2, 4, generator=gen, dtype=torch.float64)
        pl = torch.randn(rows, 2, generator=gen, dtype=torch.float64)
        i = 0
        for snd in range(world):
            for s, e in wants[recv][snd]:
                if snd == rank:
                    w = torch.exp(pl[i:i + e - s])
                    num[s:e] += po[i:i + e - s] * w[..., None]
                    den[s:e] += w
                i += e - s
    lse = torch.where(den > 0, torch.log(torch.where(den > 0, den, 1)), float("-inf"))
    out = torch.where(den[..., None] > 0, num / torch.where(den > 0, den, 1)[..., None], 0)
    return out, lse


@pytest.mark.parametrize("world", [2, 3])
def test_group_cast_and_reduce(world):
    run_distributed(comm_worker, world)


def test_single_process_and_errors():
    from magi_comm import group_cast, group_reduce

    x = torch.arange(6.0)[:, None]
    # one process: rows 2..5 cast to "rank 0" itself
    out = group_cast(x, input_split_sizes=[2, 4], output_split_sizes=[4], dst_indices=[[], [0]], src_index=[0])
    assert torch.equal(out[:, 0], torch.tensor([2.0, 3, 4, 5]))
    acc = torch.ones(6, 1)
    group_reduce(out, acc, input_split_sizes=[4], output_split_sizes=[2, 4], dst_index=[0], src_indices=[[], [0]])
    assert torch.equal(acc[:, 0], torch.tensor([1.0, 1, 3, 4, 5, 6]))
    with pytest.raises(ValueError, match="sum to"):
        group_cast(x, input_split_sizes=[2], output_split_sizes=[2], dst_indices=[[0]], src_index=[0])
    with pytest.raises(ValueError, match="names rank 3"):
        group_cast(x, input_split_sizes=[6], output_split_sizes=[6], dst_indices=[[3]], src_index=[0])
    with pytest.raises(ValueError, match="op must be"):
        group_reduce(x, x.clone(), input_split_sizes=[6], output_split_sizes=[6], dst_index=[0], src_indices=[[0]], op="max")


def test_ipc_backend_reports_why_it_cannot_run():
    import torch

    from magi_comm import ipc_supported
    from magi_comm.ipc import IpcArena

    ok, why = ipc_supported()
    if torch.cuda.is_available() and ok:
        pytest.skip("CUDA present: covered by tests/comm/test_ipc_gpu.py")
    assert not ok and why
    with pytest.raises(RuntimeError, match="CUDA IPC group collectives are unavailable"):
        IpcArena(None, 1024, torch.device("cpu"))


def test_on_device_returns_cpu_tensors_unchanged():
    from magi_kernels import on_device

    rows = torch.arange(7)
    assert on_device(rows, "cpu") is rows  # the gloo path: no copy at all


@pytest.mark.gpu
def test_on_device_copies_once_without_a_host_sync():
    """Plan rows go to the GPU once, from pinned memory, with no sync (torch's sync debug mode
    raises on one); an in-place change of the CPU rows makes a fresh copy; the values match."""
    from magi_comm import native
    from magi_kernels import on_device

    torch.manual_seed(0)
    rows = torch.randint(0, 100, (57,))
    x = torch.randn(100, 3, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = on_device(rows, x.device)
        assert on_device(rows, "cuda") is first
        gathered = native.range_gather(x, rows)
        rows[0] = 99 - rows[0]
        second = on_device(rows, x.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert second is not first
    assert torch.equal(second.cpu(), rows) and torch.equal(gathered, x[first])
