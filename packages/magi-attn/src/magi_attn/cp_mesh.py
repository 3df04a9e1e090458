"""A CP group given as a process group or as a ``DeviceMesh``.

A 1-D mesh stands for its process group. A 2-D mesh with dims named ``"inter"`` (nodes) and
``"intra"`` (ranks of a node) stands for the flattened group of all its ranks, and tells the
node-aware ``comm_backend="hier"`` where the nodes are: it uses the mesh's two groups instead
of inferring nodes from ``ranks_per_node`` / ``LOCAL_WORLD_SIZE`` and creating its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

INTER, INTRA = "inter", "intra"

CPGroup = Union[dist.ProcessGroup, DeviceMesh, None]  # what every ``cp_group`` argument accepts


@dataclass(frozen=True)
class NodeGroups:
    """The two dims of a 2-D CP mesh, for the node-aware backend: ``intra`` holds this rank's
    node, ``inter`` the ranks with its local index on every node."""

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    ranks_per_node: int


# one resolution per mesh, so that keys made from the same mesh share its groups (and caches)
_RESOLVED: dict[DeviceMesh, tuple[dist.ProcessGroup, NodeGroups | None]] = {}


def clear_resolved_meshes() -> None:
    """Drop the groups resolved from meshes (they hold process groups)."""
    _RESOLVED.clear()


def resolve_cp_group(cp_group: Any) -> tuple[dist.ProcessGroup | None, NodeGroups | None]:
    """(process group, node groups of a 2-D mesh or None) of a ``cp_group`` argument. Collective
    for a 2-D mesh seen the first time (flattening it creates a group)."""
    if cp_group is None or isinstance(cp_group, dist.ProcessGroup):
        return cp_group, None
    if not isinstance(cp_group, DeviceMesh):
        raise TypeError(f"cp_group must be a torch.distributed ProcessGroup, a DeviceMesh (1-D, or 2-D with dims "
                        f"named {INTER!r} and {INTRA!r}) or None for one rank, got {type(cp_group).__name__}")
    if cp_group not in _RESOLVED:
        _RESOLVED[cp_group] = _resolve_mesh(cp_group)
    return _RESOLVED[cp_group]


def _resolve_mesh(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, NodeGroups | None]:
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the cp_group mesh {mesh.mesh.tolist()}; pass each "
                         "rank the mesh (or submesh) it belongs to")
    if mesh.ndim == 1:
        return mesh.get_group(), None
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None or sorted(names) != sorted((INTER, INTRA)):
        raise ValueError(f"a cp_group mesh must be 1-D, or 2-D with mesh_dim_names ({INTER!r}, {INTRA!r}) (nodes, "
                         f"ranks of a node); got a {mesh.ndim}-D mesh with mesh_dim_names={names}: slice the CP dims "
                         f"out of a larger mesh (mesh[{INTER!r}, {INTRA!r}]) or name them")
    # torch orders a group's ranks by global rank; the node-aware plans place group rank r on node
    # r // ranks_per_node, so the mesh must list its ranks node by node in that order
    grid = mesh.mesh if names == (INTER, INTRA) else mesh.mesh.transpose(0, 1)
    flat = grid.reshape(-1).tolist()
    if flat != sorted(flat):
        raise ValueError(f"the cp_group mesh {grid.tolist()} (rows: nodes along {INTER!r}, columns: {INTRA!r}) must "
                         "list its global ranks in ascending order, node after node, as init_device_mesh(device, "
                         f"(nodes, ranks_per_node), mesh_dim_names=({INTER!r}, {INTRA!r})) builds it; in another "
                         "order the nodes of the flattened CP group would not be the mesh's")
    # torch has no public flatten; ``_flatten`` is what MagiAttention and Megatron use, and it
    # caches the flattened mesh on the root mesh (one group per mesh)
    group = mesh._flatten().get_group()
    return group, NodeGroups(mesh.get_group(INTRA), mesh.get_group(INTER), mesh.size(names.index(INTRA)))
