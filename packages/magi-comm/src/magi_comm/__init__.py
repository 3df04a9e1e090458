"""magi-comm: GroupCast / GroupReduce collectives for distributed attention.

Split-level collectives: :func:`group_cast`, :func:`group_reduce` (all-to-all over gloo or
NCCL), :class:`IpcGroupCollectives` (CUDA IPC inside one host), :class:`HierarchicalCollectives`
(node-aware two hops). The staged KV exchange of a distributed-attention plan goes through one
interface, :class:`GroupCollective`, built once per plan with :func:`make_group_collective`.
"""

from .collective import COLLECTIVE_KINDS, CastStage, GroupCollective, make_group_collective
from .group_collective import (
    COMM_STATS,
    REDUCE_OPS,
    PendingCollective,
    all_gather_rows,
    group_cast,
    group_reduce,
    lse_scatter_merge,
)
from .hierarchical import HierarchicalCollectives, clear_shared_collectives
from .index_plan import A2AIndexPlan, cast_index_plan, reduce_index_plan
from .ipc import IpcGroupCollectives, ipc_supported
from .native import native_build_info
from .ordered_add import add_rows, row_layers
from .two_hop_plan import NodeTopology, TwoHopPlan, inter_node_rows
from .waiting import DEFAULT_TIMEOUT_S, PeerFailureError

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

__all__ = [
    "add_rows", "row_layers",
    "COLLECTIVE_KINDS", "COMM_STATS", "DEFAULT_TIMEOUT_S", "REDUCE_OPS",
    "A2AIndexPlan", "CastStage", "GroupCollective", "HierarchicalCollectives", "IpcGroupCollectives", "NodeTopology",
    "PeerFailureError", "PendingCollective", "TwoHopPlan",
    "all_gather_rows", "cast_index_plan", "clear_shared_collectives", "group_cast", "group_reduce", "inter_node_rows",
    "ipc_supported", "lse_scatter_merge", "make_group_collective", "native_build_info", "reduce_index_plan",
]
