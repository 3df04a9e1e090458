"""Cross-attention plan: queries and keys/values from two different sequences.

The query sequence (``total_seqlen_q`` rows, e.g. video tokens) is chunked and balanced over the
CP ranks by mask area, as in self-attention. The K/V sequence (``total_seqlen_k`` rows, e.g.
text tokens) is placed on its own, one of two ways:

- ``"shard"``: contiguous shards, no padding: ``ceil(total_seqlen_k / cp_size)`` rows a rank
  (the last ranks may hold fewer; fewer than ``cp_size**2`` rows are cut finer, see
  :func:`magi_solver.max_chunk_size`, so that every rank holds at least one row). Each rank
  fetches the K/V rows its queries need from their owners with GroupCast (in the forward and
  again in the backward) and sends their dK/dV partials back with GroupReduce.
- ``"replicate"``: every rank holds all ``total_seqlen_k`` rows. No attention communication;
  each rank's dK/dV holds only its own queries' share (summed over ranks by ``dispatch_kv``'s
  backward, or by the data-parallel gradient sum of the K/V projection's weights).

``"auto"`` replicates when K/V is no longer than the largest query shard (``total_seqlen_k <=
max(dispatch.shard_seqlens)``; query shards differ by at most one chunk, and the rule must give
every rank the same answer, so it reads the largest rather than a rank's own): holding all of
K/V then costs a rank at most the activation memory and per-token compute of the largest query
shard, and saves every per-layer K/V transfer (``3 x`` the missing rows: forward fetch, backward
fetch, dK/dV reduce). Longer K/V is sharded, so that no rank holds more than its share between
layers.
"""

from __future__ import annotations

import math
from typing import Sequence

from .dispatch import DispatchConfig, DispatchPlan, solve_dispatch
from .mask import AttnSlice, validate_slices
from .overlap import OverlapConfig
from .planner import DistAttnPlan
from .ranges import AttnRange, AttnRanges

KV_PLACEMENTS = ("auto", "shard", "replicate")


def choose_kv_placement(total_seqlen_k: int, q_shard_seqlen: int, cp_size: int) -> str:
    """The ``"auto"`` rule: ``"replicate"`` when K/V fits in one query shard (or one rank),
    else ``"shard"`` (see the module docstring for the costs behind it). ``q_shard_seqlen``: the
    largest query shard, ``max(dispatch.shard_seqlens)``, so that every rank chooses alike.
    K/V of fewer rows than ranks is replicated too: a shard would leave a rank without a row."""
    if cp_size == 1 or total_seqlen_k <= q_shard_seqlen or total_seqlen_k < cp_size:
        return "replicate"
    return "shard"


def _kv_shards(total_seqlen_k: int, cp_size: int) -> DispatchPlan:
    """Contiguous K/V shards, unpadded (no balancing: K/V rows carry no compute of their own;
    the query side's placement balances the attention). Ranks may hold different row counts."""
    if total_seqlen_k < cp_size:
        raise ValueError(f"kv_placement='shard' needs at least one K/V row per rank, but total_seqlen_k="
                         f"{total_seqlen_k} < cp_size={cp_size}; use kv_placement='replicate' (or 'auto')")
    return solve_dispatch([], total_seqlen_k, cp_size,
                          DispatchConfig(chunk_size=math.ceil(total_seqlen_k / cp_size), alg="sequential"))


def _whole(total_seqlen_k: int) -> DispatchPlan:
    """Every rank's local K/V is the whole sequence, in global order."""
    return DispatchPlan(total_seqlen=total_seqlen_k, chunk_size=total_seqlen_k,
                        cp_size=1, chunk_areas=(0,), partitions=((0,),), chunk_bands=((),))


class CrossAttnPlan(DistAttnPlan):
    """:class:`DistAttnPlan` for queries over ``total_seqlen_q`` rows attending to keys over
    ``total_seqlen_k`` rows of another sequence; ``slices`` are in (query row, key row)
    coordinates. ``dispatch`` places the queries, ``kv_dispatch`` the keys/values."""

    def __init__(
        self,
        slices: Sequence[AttnSlice],
        total_seqlen_q: int,
        total_seqlen_k: int,
        cp_size: int,
        *,
        num_heads_q: int = 1,
        num_heads_kv: int = 1,
        head_dim: int = 128,
        dispatch_config: DispatchConfig | None = None,
        overlap_config: OverlapConfig = OverlapConfig(),
        kv_placement: str = "auto",
        validate: bool = True,
    ):
        if kv_placement not in KV_PLACEMENTS:
            raise ValueError(f"kv_placement must be one of {KV_PLACEMENTS}, got {kv_placement!r}")
        for name, n in (("total_seqlen_q", total_seqlen_q), ("total_seqlen_k", total_seqlen_k)):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if validate:
            validate_slices(slices, total_seqlen_q, total_seqlen_k)
        self._set_sizes(slices, cp_size, num_heads_q, num_heads_kv, head_dim, overlap_config)
        self.total_seqlen_k = total_seqlen_k
        self.dispatch: DispatchPlan = solve_dispatch(slices, total_seqlen_q, cp_size, dispatch_config or DispatchConfig())
        if kv_placement == "auto":
            kv_placement = choose_kv_placement(total_seqlen_k, max(self.dispatch.shard_seqlens), cp_size)
        self.kv_placement = kv_placement
        if kv_placement == "replicate":
            whole = AttnRanges([AttnRange(0, total_seqlen_k)])
            self._plan_kv(_whole(total_seqlen_k), [whole] * cp_size)
            self.stage_ranges = []  # nothing to fetch: no collective at all
        else:
            kv = _kv_shards(total_seqlen_k, cp_size)
            self._plan_kv(kv, [kv.rank_ranges(r) for r in range(cp_size)])

    def kv_local_rows(self, rank: int) -> list[int]:
        """Global K/V row of each of ``rank``'s local K/V rows (all rows when replicated)."""
        return self.kv_dispatch.position_ids(0 if self.kv_placement == "replicate" else rank)

    def summary(self) -> dict[str, object]:
        out = super().summary()
        out.update(total_seqlen_k=self.total_seqlen_k, kv_placement=self.kv_placement,
                   kv_shard_seqlens=list(self.kv_shard_seqlens))
        return out
