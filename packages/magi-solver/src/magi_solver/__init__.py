"""magi-solver: pure-Python planning for distributed attention with arbitrary masks."""

from .comm_plan import GroupCastPlan, GroupReducePlan
from .cross_plan import KV_PLACEMENTS, CrossAttnPlan, choose_kv_placement
from .dispatch import DispatchConfig, DispatchPlan, auto_chunk_size, max_chunk_size, solve_dispatch
from .mask import AttnMaskType, AttnSlice, Band, gc_paused, slice_area, slice_ranges, total_area, validate_slices
from .mask_builders import (
    block_causal_slices,
    check_positive_int,
    causal_slices,
    full_slices,
    shared_prefix_slices,
    sliding_window_slices,
    varlen_slices,
)
from .overlap import OverlapConfig
from .planner import DistAttnPlan, RankCalcPlan
from .ranges import AttnRange, AttnRanges
from .remap import local_slices, slices_over

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here

__all__ = [
    "AttnMaskType", "AttnRange", "AttnRanges", "AttnSlice", "Band", "CrossAttnPlan", "DispatchConfig", "DispatchPlan",
    "DistAttnPlan", "GroupCastPlan", "GroupReducePlan", "OverlapConfig", "RankCalcPlan",
    "KV_PLACEMENTS", "auto_chunk_size", "block_causal_slices", "causal_slices", "check_positive_int",
    "choose_kv_placement", "full_slices", "gc_paused", "local_slices", "max_chunk_size", "slices_over",
    "shared_prefix_slices", "slice_area", "slice_ranges", "sliding_window_slices", "solve_dispatch", "total_area",
    "validate_slices", "varlen_slices",
]
