"""FSDP2 with context parallelism: a (dp, cp) DeviceMesh, sharding over all dp x cp ranks, and the
loss scale that makes FSDP's gradient average come out as a mean over data-parallel batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DpCpMesh:
    mesh: DeviceMesh  # 2-D (dp, cp)
    flat: DeviceMesh  # 1-D over every rank, for FSDP

    @property
    def dp(self) -> int:
        return self.mesh.size(0)

    @property
    def cp(self) -> int:
        return self.mesh.size(1)

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("cp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def loss_scale(self) -> float:
        """Every CP rank of a group computes the same full loss but only its tokens' gradient;
        FSDP averages over dp*cp ranks, so scaling the loss by cp yields the mean over dp."""
        return float(self.cp)


def build_dp_cp_mesh(dp: int, cp: int, device_type: str = "cpu") -> DpCpMesh:
    """Ranks are laid out ``rank = dp_rank * cp + cp_rank`` (CP groups are contiguous ranks,
    which keeps CP traffic inside a node on GPUs)."""
    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"dp * cp = {dp} * {cp} = {dp * cp} must equal the world size {world}")
    mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    flat = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_cp",))
    return DpCpMesh(mesh, flat)


def shard_model(model: torch.nn.Module, mesh: DpCpMesh, block_types: tuple[type, ...] = ()) -> torch.nn.Module:
    """``fully_shard`` every block of ``block_types`` and then the root, over all dp x cp ranks."""
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if block_types and isinstance(m, block_types):
            fully_shard(m, mesh=mesh.flat)
    fully_shard(model, mesh=mesh.flat)
    return model
