"""Two-hop (node-aware, RDMA-dedup) GroupCast / GroupReduce: the planner simulated for every
rank in one process, and the collectives on gloo ranks emulating several nodes, both against
the flat all-to-all semantics."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from magi_comm.two_hop_plan import NodeTopology, inter_node_rows, outgoing_meta, two_hop_cast_plan


def random_pattern(world: int, seed: int):
    """Per rank: (input_split_sizes, dst_indices, output_split_sizes, src_index) of one cast,
    consistent across ranks; receivers interleave their sources in a random order."""
    rng = random.Random(seed)
    sends = {}
    for r in range(world):
        sizes = [rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randint(0, 5))]
        dsts = [sorted(rng.sample(range(world), rng.randint(0, world))) for _ in sizes]
        sends[r] = (sizes, dsts)
    pattern = {}
    for me in range(world):
        queues = {s: [sz for sz, d in zip(*sends[s]) if me in d] for s in range(world)}
        order = [s for s in range(world) for _ in queues[s]]
        rng.shuffle(order)  # per-source order stays stable: pop from the front
        out_sizes, src = [], []
        for s in order:
            out_sizes.append(queues[s].pop(0))
            src.append(s)
        pattern[me] = (sends[me][0], sends[me][1], out_sizes, src)
    return pattern


def flat_expected(pattern, inputs, me):
    """What the flat group_cast delivers to ``me``."""
    per_src = {}
    for s, (sizes, dsts, _, _) in pattern.items():
        off, rows = 0, []
        for sz, d in zip(sizes, dsts):
            if me in d:
                rows.append(inputs[s][off:off + sz])
            off += sz
        per_src[s] = rows
    _, _, out_sizes, src = pattern[me]
    parts = [per_src[s].pop(0) for s in src]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)


def simulate_two_hop(topo: NodeTopology, pattern, inputs):
    """Run both hops of every rank's plan with in-process 'all-to-alls'."""
    world, L = topo.world, topo.ranks_per_node
    metas = {r: outgoing_meta(topo, r, pattern[r][0], pattern[r][1]) for r in range(world)}
    plans = {}
    for me in range(world):
        incoming = [metas[topo.rank(n, topo.local(me))][topo.node(me)] for n in range(topo.nodes)]
        plans[me] = two_hop_cast_plan(topo, me, *pattern[me], incoming)

    def a2a(bufs, peers_of, index_of):
        recv = {}
        for me in range(world):
            parts = []
            for peer in peers_of(me):
                buf, counts = bufs[peer]
                off = sum(counts[:index_of(me)])
                parts.append(buf[off:off + counts[index_of(me)]])
            recv[me] = torch.cat(parts)
        return recv

    hop1 = a2a({r: (inputs[r][plans[r].inter.send_rows], plans[r].inter.send_counts) for r in range(world)},
               lambda me: [topo.rank(n, topo.local(me)) for n in range(topo.nodes)], topo.node)
    for me in range(world):
        assert hop1[me].shape[0] == sum(plans[me].inter.recv_counts)
    cats = {r: torch.cat([inputs[r], hop1[r]]) for r in range(world)}
    hop2 = a2a({r: (cats[r][plans[r].intra.send_rows], plans[r].intra.send_counts) for r in range(world)},
               lambda me: [topo.rank(topo.node(me), l) for l in range(L)], topo.local)
    outs = {}
    for me in range(world):
        out = torch.full((sum(pattern[me][2]),), -1.0, dtype=torch.float64)
        out[plans[me].intra.recv_rows] = hop2[me]
        outs[me] = out
    return outs, plans


@pytest.mark.parametrize("world,per_node", [(4, 2), (6, 3), (6, 2), (8, 4), (3, 1), (4, 4), (1, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_two_hop_plan_delivers_the_flat_result(world, per_node, seed):
    topo = NodeTopology(world, per_node)
    pattern = random_pattern(world, seed)
    inputs = {r: torch.arange(sum(pattern[r][0]), dtype=torch.float64) + 1000 * r for r in range(world)}
    outs, plans = simulate_two_hop(topo, pattern, inputs)
    for me in range(world):
        assert torch.equal(outs[me], flat_expected(pattern, inputs, me)), me
        # dedup: hop 1 carries each split once per remote node holding a destination
        assert sum(plans[me].inter.send_counts) == inter_node_rows(topo, me, pattern[me][0], pattern[me][1], dedup=True)


def test_topology_errors_name_the_fix():
    with pytest.raises(ValueError, match="not a multiple of ranks_per_node"):
        NodeTopology(6, 4)
    with pytest.raises(ValueError, match="ranks_per_node must be"):
        NodeTopology(4, 0)


def hier_worker(rank, world, per_node):
    from magi_comm import COMM_STATS, group_cast, group_reduce
    from magi_comm import HierarchicalCollectives

    hc = HierarchicalCollectives(dist.group.WORLD, ranks_per_node=per_node)
    topo = hc.topo
    for seed in range(3):
        pattern = random_pattern(world, 100 + seed)
        in_sizes, dsts, out_sizes, src = pattern[rank]
        kw = dict(input_split_sizes=in_sizes, output_split_sizes=out_sizes, dst_indices=dsts, src_index=src)
        g = torch.Generator().manual_seed(rank + 10 * seed)
        x = torch.randn(sum(in_sizes), 2, 3, generator=g, dtype=torch.float64)
        for dtype in (torch.float64, torch.bfloat16):
            flat = group_cast(x.to(dtype), group=dist.group.WORLD, **kw)
            COMM_STATS["inter_node_sent"] = 0
            got = hc.group_cast(x.to(dtype), async_op=True, plan_key=("cast", seed), **kw).wait()
            assert torch.equal(got, flat), (rank, seed, dtype)
        row_bytes = 2 * 3 * 2  # the bf16 run
        assert COMM_STATS["inter_node_sent"] == inter_node_rows(topo, rank, in_sizes, dsts, dedup=True) * row_bytes
        # reduce (the transpose): sum and lse against the flat reduce
        rkw = dict(input_split_sizes=out_sizes, output_split_sizes=in_sizes, dst_index=src, src_indices=dsts)
        part = torch.randn(sum(out_sizes), 2, 3, generator=g, dtype=torch.float64)
        base = torch.randn(sum(in_sizes), 2, 3, generator=g, dtype=torch.float64)
        a, b = base.clone(), base.clone()
        group_reduce(part, a, group=dist.group.WORLD, op="sum", **rkw)
        hc.group_reduce(part, b, op="sum", plan_key=("reduce", seed), **rkw)
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
        plse = torch.randn(sum(out_sizes), 2, generator=g, dtype=torch.float64)
        o1, o2 = base.clone(), base.clone()
        l0 = torch.randn(sum(in_sizes), 2, generator=g, dtype=torch.float64)
        l1, l2 = l0.clone(), l0.clone()
        group_reduce(part, o1, group=dist.group.WORLD, op="lse", input_lse=plse, output_lse=l1, **rkw)
        hc.group_reduce(part, o2, op="lse", input_lse=plse, output_lse=l2, async_op=True, **rkw).wait()
        torch.testing.assert_close(l2, l1, atol=1e-12, rtol=0)
        torch.testing.assert_close(o2, o1, atol=1e-12, rtol=0)
    # a cached plan key reused with other splits is an error, not a hang or a wrong result
    in_sizes, dsts, out_sizes, src = random_pattern(world, 100)[rank]
    x = torch.randn(sum(in_sizes) + 1, 2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="plan_key"):
        hc.group_cast(x, input_split_sizes=list(in_sizes) + [1], output_split_sizes=out_sizes,
                      dst_indices=list(dsts) + [[]], src_index=src, plan_key=("cast", 0))


@pytest.mark.parametrize("world,per_node", [(4, 2), (6, 3), (3, 1)])
def test_hierarchical_collectives_equal_flat_on_gloo(world, per_node):
    run_distributed(hier_worker, world, per_node)


def interface_worker(rank, world, per_node):
    """make_group_collective's "a2a" and "hier" collectives run a list of stages exactly as the
    split-level group_cast / group_reduce do (cast bit-equal, dK/dV-style sum reduce to 1e-12)."""
    from magi_comm import group_cast, group_reduce, make_group_collective
    from magi_solver import GroupCastPlan

    patterns = [random_pattern(world, 200 + s)[rank] for s in range(3)]
    stages = [GroupCastPlan(tuple(a), tuple(tuple(d) for d in b), tuple(c), tuple(e)) for a, b, c, e in patterns]
    rows = 20
    # every stage casts from the same shard of ``rows`` rows (as distributed attention does)
    stages = [GroupCastPlan(p.input_split_sizes + (rows - p.input_rows,), p.dst_indices + ((),),
                            p.output_split_sizes, p.src_index) for p in stages]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, 2, 3, generator=g, dtype=torch.float64)
    for kind in ("a2a", "hier"):
        comm = make_group_collective(kind, stages, dist.group.WORLD, timeout_s=60.0, ranks_per_node=per_node)
        assert comm.kind == kind
        pending = [comm.cast(x, s) for s in range(len(stages))]  # several in flight, as in forward
        for s, (p, h) in enumerate(zip(stages, pending)):
            flat = group_cast(x, input_split_sizes=p.input_split_sizes, output_split_sizes=p.output_split_sizes,
                              dst_indices=p.dst_indices, src_index=p.src_index, group=dist.group.WORLD)
            assert torch.equal(h.wait(), flat), (kind, rank, s)
        for s, p in enumerate(stages):
            part = torch.randn(p.output_rows, 2, 3, generator=torch.Generator().manual_seed(10 * rank + s),
                               dtype=torch.float64)
            r = p.transpose()
            want = group_reduce(part, x.clone(), input_split_sizes=r.input_split_sizes,
                                output_split_sizes=r.output_split_sizes, dst_index=r.dst_index,
                                src_indices=r.src_indices, group=dist.group.WORLD)
            out = x.clone()
            assert comm.reduce(part, out, s).wait() is out
            torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_group_collective_interface_equals_the_split_level_calls():
    run_distributed(interface_worker, 4, 2)  # two nodes of two ranks


def test_make_group_collective_kinds_and_errors():
    from magi_comm import COLLECTIVE_KINDS, make_group_collective
    from magi_solver import GroupCastPlan

    stages = [GroupCastPlan((4,), ((0,),), (4,), (0,))]
    with pytest.raises(ValueError, match="unknown group collective kind 'nccl'"):
        make_group_collective("nccl", stages, None)
    assert set(COLLECTIVE_KINDS) == {"a2a", "ipc", "hier"}
    # without a process group there is nothing to route over nodes: the all-to-all path, a local copy
    comm = make_group_collective("hier", stages, None)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert comm.kind == "a2a" and torch.equal(comm.cast(x, 0).wait(), x)
    # existing node groups (a 2-D DeviceMesh's) are for "hier" only, and need the node size
    pair = (object(), object())
    with pytest.raises(ValueError, match="node_groups are for the node-aware kind 'hier'"):
        make_group_collective("a2a", stages, None, node_groups=pair)
    with pytest.raises(ValueError, match="node_groups need ranks_per_node"):
        make_group_collective("hier", stages, None, node_groups=pair)
    ipc = make_group_collective("ipc", stages, None)  # builds nothing until the first call
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA IPC group collectives are unavailable"):
            ipc.cast(x, 0)
