"""magi-comm: GroupCast / GroupReduce collectives for distributed attention."""

from .group_collective import (
    COMM_STATS,
    REDUCE_OPS,
    A2AIndexPlan,
    PendingCollective,
    all_gather_rows,
    cast_index_plan,
    group_cast,
    group_reduce,
    lse_scatter_merge,
    reduce_index_plan,
)
from .hierarchical import clear_shared_collectives
from .waiting import DEFAULT_TIMEOUT_S, PeerFailureError

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

__all__ = [
    "COMM_STATS", "DEFAULT_TIMEOUT_S", "PeerFailureError", "clear_shared_collectives",
    "A2AIndexPlan", "PendingCollective", "all_gather_rows", "REDUCE_OPS", "cast_index_plan", "group_cast", "group_reduce",
    "lse_scatter_merge", "reduce_index_plan",
]
