"""A DeviceMesh wherever a CP group is accepted, on 4 gloo ranks (CPU meshes): a 1-D mesh (also
a dim sliced out of a (dp, cp) mesh) stands for its group; a 2-D ("inter", "intra") mesh gives
the node-aware backend its nodes (self- and cross-attention); wrong meshes are refused with errors that say why."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_cases import HK, HQ, check_case, check_cross_case
from dist_harness import run_distributed

CU = [0, 13, 40, 41, 77]


def _slices():
    from magi_solver import varlen_slices

    return [s.to_tuple() for s in varlen_slices(CU, CU, causal=True)]


def _key(cp_group, **config):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig, magi_attn_varlen_key

    cfg = DistAttnConfig(DispatchConfig(chunk_size=4), OverlapConfig(degree=2, min_chunk_size=3),
                         kernel_backend="torch", **config)
    return magi_attn_varlen_key(CU, CU, HQ, HK, 8, cp_group, causal=True, dist_attn_config=cfg)


def mesh_worker(rank, world):
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from magi_attn import (DispatchConfig, DistAttnConfig, OverlapConfig, dispatch, get_most_recent_key,
                           magi_attn_varlen_key_for_new_mask)

    # 1-D: the mesh's group, the same plan as the process group's
    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    key = _key(mesh1)
    assert key.group is mesh1.get_group() and key.node_groups is None
    assert get_most_recent_key(mesh1) is key and get_most_recent_key(mesh1.get_group()) is key
    assert key.runtime.plan.dispatch.partitions == _key(dist.group.WORLD).runtime.plan.dispatch.partitions
    check_case("mesh_1d", _slices(), CU[-1], None, key.group, rank, key=key)

    # a CP dim sliced out of a (dp, cp) mesh: two CP groups of 2
    dp_cp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    sub = _key(dp_cp["cp"])
    assert sub.cp_size == world // 2 and sub.cp_rank == dp_cp.get_local_rank("cp")
    x = torch.arange(CU[-1] * 2, dtype=torch.float64).reshape(CU[-1], 2)
    assert torch.equal(dispatch(x, sub), x[sub.runtime.local_index])

    # 2-D (inter, intra): the node-aware backend runs over the mesh's own groups
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("inter", "intra"))
    hier = _key(mesh2, comm_backend="hier")
    assert dist.get_process_group_ranks(hier.group) == list(range(world)) and hier.node_groups.ranks_per_node == 2
    check_case("mesh_2d_hier", _slices(), CU[-1], None, hier.group, rank, key=hier)
    hc = hier.runtime.comm.two_hop  # the "hier" GroupCollective, built by make_group_collective
    assert hier.runtime.comm.kind == "hier" and hier.runtime.comm.ordered is False
    assert hc.intra is mesh2.get_group("intra") and hc.inter is mesh2.get_group("inter")
    # cross-attention over the same mesh (uneven query and K/V shards), deterministic reduce
    cross_cfg = DistAttnConfig(DispatchConfig(chunk_size=4), OverlapConfig(degree=2, min_chunk_size=1),
                               kernel_backend="torch", comm_backend="hier", deterministic=True)
    cross = check_cross_case("mesh_2d_cross", [(0, 11, 0, 4, 0), (11, 23, 2, 9, 1)], 23, 9, "shard", "shard",
                             mesh2, rank, cross_cfg)
    assert cross.node_groups is hier.node_groups and cross.runtime.comm.ordered
    assert cross.runtime.comm.two_hop.intra is mesh2.get_group("intra")
    # node groups that do not match ranks_per_node are refused on the first call, on every rank
    from magi_comm import make_group_collective
    from magi_solver import GroupCastPlan

    swapped = make_group_collective("hier", [GroupCastPlan((1,), ((),), (), ())], dist.group.WORLD, ranks_per_node=2,
                                    node_groups=(mesh2.get_group("inter"), mesh2.get_group("intra")))
    with pytest.raises(ValueError, match=r"node_groups: the intra-node group holds global ranks"):
        swapped.cast(torch.zeros(1, 1), 0)
    swa = magi_attn_varlen_key_for_new_mask(hier, CU, CU, causal=True, window_size=(5, 0))
    assert swa.node_groups is hier.node_groups
    # the dims may come in the other order: rows are then the ranks of one local index
    reversed_dims = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("intra", "inter"))
    rkey = _key(reversed_dims, comm_backend="hier")
    assert dist.get_process_group_ranks(rkey.node_groups.intra) == [rank // 2 * 2, rank // 2 * 2 + 1]
    check_case("mesh_2d_reversed_dims", _slices(), CU[-1], None, rkey.group, rank, key=rkey)

    # wrong meshes
    with pytest.raises(ValueError, match=r"mesh_dim_names \('inter', 'intra'\).*got a 2-D mesh with mesh_dim_names=None"):
        _key(DeviceMesh("cpu", [[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match=r"got a 2-D mesh with mesh_dim_names=\('dp', 'cp'\)"):
        _key(dp_cp)
    with pytest.raises(ValueError, match="got a 3-D mesh"):
        _key(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "inter", "intra")))
    with pytest.raises(ValueError, match="must list its global ranks in ascending order, node after node"):
        _key(DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("inter", "intra")))
    with pytest.raises(ValueError, match=r"ranks_per_node=4 disagrees with the cp_group mesh, whose 'intra' dim has 2"):
        _key(mesh2, comm_backend="hier", ranks_per_node=4)
    if rank < 2:  # a mesh this rank is not in
        with pytest.raises(ValueError, match=r"is not in the cp_group mesh \[2, 3\]"):
            _key(DeviceMesh("cpu", [2, 3], _init_backend=False))


@pytest.mark.parametrize("world", [4])
def test_device_mesh_as_cp_group(world):
    run_distributed(mesh_worker, world)
