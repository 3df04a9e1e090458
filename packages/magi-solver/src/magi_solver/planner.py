"""The distributed attention plan: dispatch + KV communication + overlap stages + kernel slices.

The plan is a pure function of (mask, sizes, configs), so every rank builds the same plan for all
ranks and no collective is needed to agree on transfer tables. Per-rank kernel slices are built
lazily, only for the rank that asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .comm_plan import GroupCastPlan, segments_with_destinations
from .dispatch import DispatchConfig, DispatchPlan, solve_dispatch
from .mask import AttnSlice, Band, validate_slices
from .overlap import BWD_STAGE_FIXED_S, OverlapConfig, RankCosts, best_degree, group_stages, split_remote
from .ranges import AttnRange, AttnRanges
from .remap import SliceTuple, areas_over, slices_over



@dataclass(frozen=True)
class RankCalcPlan:
    """Kernel arguments of one rank: q in local-shard coordinates, k in the coordinates of the
    buffer of that stage (host = local shard, stage s = that stage's receive buffer)."""

    host: tuple[SliceTuple, ...]
    stages: tuple[tuple[SliceTuple, ...], ...]
    host_area: int
    stage_areas: tuple[int, ...]
    stage_kv_seqlens: tuple[int, ...]

    def merged(self, shard_seqlen: int) -> tuple[SliceTuple, ...]:
        """All slices over ``cat([local KV] + stage receive buffers)`` (no-overlap mode)."""
        out = list(self.host)
        offset = shard_seqlen
        for stage, size in zip(self.stages, self.stage_kv_seqlens):
            out.extend((a, b, c + offset, d + offset, t) for a, b, c, d, t in stage)
            offset += size
        return tuple(out)


def _check_reused_dispatch(
    dispatch: object, total_seqlen: int, cp_size: int, dispatch_config: DispatchConfig | None
) -> None:
    """A dispatch given to :class:`DistAttnPlan` fits its sequence and CP size."""
    if not isinstance(dispatch, DispatchPlan):
        raise TypeError(f"dispatch must be a DispatchPlan (e.g. another plan's .dispatch) or None, "
                        f"got {type(dispatch).__name__}")
    if dispatch_config is not None:
        raise ValueError("pass dispatch_config or dispatch, not both: a given dispatch already fixed the chunk size "
                         "and the placement of every token")
    if dispatch.total_seqlen != total_seqlen:
        raise ValueError(f"dispatch places total_seqlen={dispatch.total_seqlen} tokens but the slices are over "
                         f"total_seqlen={total_seqlen}; a dispatch can be reused only for a mask over the same sequence")
    if dispatch.cp_size != cp_size:
        raise ValueError(f"dispatch places the tokens on cp_size={dispatch.cp_size} ranks but cp_size={cp_size}; "
                         f"reuse a dispatch only with the same number of CP ranks")


class DistAttnPlan:
    """Everything every rank needs to run distributed attention for one mask."""

    def __init__(
        self,
        slices: Sequence[AttnSlice],
        total_seqlen: int,
        cp_size: int,
        *,
        num_heads_q: int = 1,
        num_heads_kv: int = 1,
        head_dim: int = 128,
        dispatch_config: DispatchConfig | None = None,
        overlap_config: OverlapConfig = OverlapConfig(),
        validate: bool = True,
        dispatch: DispatchPlan | None = None,
    ):
        """Plan ``slices`` over ``cp_size`` ranks.

        Without ``dispatch`` the tokens are placed by :func:`solve_dispatch` with
        ``dispatch_config`` (default ``DispatchConfig()``), balanced for ``slices``. With an
        existing ``dispatch`` (e.g. another mask's ``plan.dispatch``) the tokens stay where it put
        them, and only the communication, overlap stages and kernel slices are planned for
        ``slices``: several masks then share one dispatch of the activations, at whatever
        balance that placement gives this mask (``summary()["imbalance"]``).
        """
        if validate:
            validate_slices(slices, total_seqlen, total_seqlen)
        self._set_sizes(slices, cp_size, num_heads_q, num_heads_kv, head_dim, overlap_config)
        if dispatch is None:
            config = dispatch_config or DispatchConfig()
            self.dispatch: DispatchPlan = solve_dispatch(slices, total_seqlen, cp_size, config)
        else:
            _check_reused_dispatch(dispatch, total_seqlen, cp_size, dispatch_config)
            self.dispatch = dispatch.for_slices(slices)
        # self-attention: K/V rows sit where their query rows do (CrossAttnPlan places them apart)
        self._plan_kv(self.dispatch, [self.dispatch.rank_ranges(r) for r in range(cp_size)])

    def _set_sizes(self, slices: Sequence[AttnSlice], cp_size: int, num_heads_q: int, num_heads_kv: int,
                   head_dim: int, overlap_config: OverlapConfig) -> None:
        """The mask, rank count, head sizes and overlap settings (shared with CrossAttnPlan)."""
        self.slices = tuple(slices)
        self.cp_size = cp_size
        self.num_heads_q, self.num_heads_kv, self.head_dim = num_heads_q, num_heads_kv, head_dim
        self.overlap_config = overlap_config

    def _plan_kv(self, kv_dispatch: DispatchPlan, host_ranges: list[AttnRanges]) -> None:
        """Plan the K/V side: ``kv_dispatch`` places the K/V rows (chunk size, owners, shard
        length), ``host_ranges[r]`` the global K/V rows rank r holds; the query side is
        ``self.dispatch``."""
        self.kv_dispatch = kv_dispatch
        self.chunk_owner = kv_dispatch.chunk_owner()
        self.host_ranges = host_ranges
        self.remote_ranges = [self._needed_k(r).subtract(self.host_ranges[r]) for r in range(self.cp_size)]
        self.stage_ranges = self._plan_stages()  # [stage][rank] -> merged global ranges
        self._cast_cache: dict[tuple[int, int], GroupCastPlan] = {}
        self._calc_cache: dict[int, RankCalcPlan] = {}

    @property
    def kv_shard_seqlens(self) -> tuple[int, ...]:
        """K/V rows of each rank's local shard (``dispatch.shard_seqlens`` in self-attention);
        like the query shards they may differ between ranks (no padding)."""
        return tuple(r.total_seqlen for r in self.host_ranges)

    # -- KV needs ------------------------------------------------------------------------------
    def _rank_bands(self, rank: int) -> list[tuple[int, Band]]:
        """(local q offset delta, global band) of every band of the rank's chunks (a chunk at
        position ``pos`` of its rank starts at local row ``pos * chunk_size``: see DispatchPlan)."""
        cs = self.dispatch.chunk_size
        out = []
        for pos, c in enumerate(self.dispatch.partitions[rank]):
            dq = (c - pos) * cs
            out.extend((dq, b) for b in self.dispatch.chunk_bands[c])
        return out

    def _needed_k(self, rank: int) -> AttnRanges:
        ext = [b.k_extent() for _, b in self._rank_bands(rank)]
        return AttnRanges(AttnRange(*e) for e in ext if e is not None).merge()

    # -- overlap stages ------------------------------------------------------------------------
    def _remote_rows_s(self, rank: int, ranges: AttnRanges, intra_s: float, inter_s: float) -> dict[int, float]:
        """Wire seconds of ``ranges`` to ``rank`` per source rank: rows held on its own node at the
        intra-node rate, the rest at the inter-node rate (split at the K/V chunks that own them)."""
        cs, per_node = self.kv_dispatch.chunk_size, self.overlap_config.ranks_per_node
        node = rank // per_node
        out: dict[int, float] = {}
        for r in ranges:
            t = r.start
            while t < r.end:
                e = min(r.end, (t // cs + 1) * cs)
                owner = self.chunk_owner[t // cs][0]
                out[owner] = out.get(owner, 0.0) + (e - t) * (intra_s if owner // per_node == node else inter_s)
                t = e
        return out

    def _chunk_costs(self, rank: int, chunks: list[AttnRanges]) -> RankCosts:
        cfg = self.overlap_config
        flop_per_cell = 4.0 * self.num_heads_q * self.head_dim
        byte_per_token = 2.0 * self.num_heads_kv * self.head_dim * 2  # K and V in 16-bit
        to_s_calc = flop_per_cell / (cfg.compute_tflops * 1e12)
        intra_s = byte_per_token / (cfg.intra_node_gbps * 1e9)
        inter_s = byte_per_token / (cfg.comm_gbps * 1e9)
        flat = [(r, i) for i, ch in enumerate(chunks) for r in ch]
        bands = self._rank_bands(rank)
        calc = [0.0] * len(chunks)
        for (_, i), area in zip(flat, areas_over(bands, [r for r, _ in flat])):
            calc[i] += area * to_s_calc
        host_area = sum(areas_over(bands, list(self.host_ranges[rank])))
        sources = tuple(self._remote_rows_s(rank, ch, intra_s, inter_s) for ch in chunks)
        comm = [sum(src.values()) for src in sources]
        # every stage passes over the whole shard: forward ~30 bytes per (row, head, dim) element (the
        # kernel's Q in and fp32 output, merge_out_lse's ~6 fp32 passes), backward ~28 (the kernel's Q,
        # dO, O in and fp32 dQ, then dq + dq_s); the backward also launches its preprocessing
        elements = self.dispatch.shard_seqlens[rank] * self.num_heads_q * self.head_dim / (cfg.memory_gbps * 1e9)
        return RankCosts(host_area * to_s_calc, tuple(calc), tuple(comm), 30 * elements,
                         28 * elements + BWD_STAGE_FIXED_S, sources)

    def _plan_stages(self) -> list[list[AttnRanges]]:
        if self.cp_size == 1:
            return []
        cfg = self.overlap_config
        if cfg.degree in (0, 1):
            return [[r for r in self.remote_ranges]]
        per_rank_chunks = [split_remote(rr, cfg.min_chunk_size, cfg.max_num_chunks) for rr in self.remote_ranges]
        costs = [self._chunk_costs(r, ch) for r, ch in enumerate(per_rank_chunks)]
        if cfg.degree is None:
            degree = best_degree(costs, cfg.dynamic_max_degree, cfg.stage_latency_us * 1e-6)
        else:
            degree = cfg.degree
        stages: list[list[AttnRanges]] = [[AttnRanges() for _ in range(self.cp_size)] for _ in range(degree)]
        for r, (chunks, c) in enumerate(zip(per_rank_chunks, costs)):
            for s, group in enumerate(group_stages(c.calc, c.comm, degree)):
                stages[s][r] = AttnRanges(x for i in group for x in chunks[i]).merge()
        return stages

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranges)

    def stage_cost_summary(self, rank: int) -> dict[str, object]:
        chunks = [self.stage_ranges[s][rank] for s in range(self.num_stages)]
        c = self._chunk_costs(rank, chunks)
        return {"host_calc_s": c.host, "stage_calc_s": list(c.calc), "stage_comm_s": list(c.comm)}

    # -- communication -------------------------------------------------------------------------
    def _to_local(self, rank: int, r: AttnRange) -> AttnRange:
        cs = self.kv_dispatch.chunk_size
        c = r.start // cs
        owner, pos = self.chunk_owner[c]
        if owner != rank:
            raise AssertionError(f"{r} is not held by rank {rank}")
        return r.offset((pos - c) * cs)

    def cast_plan(self, stage: int, rank: int) -> GroupCastPlan:
        """GroupCast of KV for ``stage`` as seen by ``rank`` (input: its local shard; output:
        its receive buffer of that stage). ``.transpose()`` is the dK/dV GroupReduce."""
        key = (stage, rank)
        if key not in self._cast_cache:
            self._cast_cache[key] = self._build_cast_plan(stage, rank)
        return self._cast_cache[key]

    def _build_cast_plan(self, stage: int, rank: int) -> GroupCastPlan:
        cs = self.kv_dispatch.chunk_size
        host = self.host_ranges[rank]
        pieces: list[tuple[int, int, int]] = []
        for dst in range(self.cp_size):
            if dst == rank:
                continue
            for g in self.stage_ranges[stage][dst].intersect(host):
                loc = self._to_local(rank, g)
                pieces.append((loc.start, loc.end, dst))
        in_sizes, dsts = segments_with_destinations(self.kv_shard_seqlens[rank], pieces)
        out_sizes: list[int] = []
        src: list[int] = []
        for r in self.stage_ranges[stage][rank]:
            t = r.start
            while t < r.end:
                e = min(r.end, (t // cs + 1) * cs)
                owner = self.chunk_owner[t // cs][0]
                if src and src[-1] == owner:
                    out_sizes[-1] += e - t
                else:
                    out_sizes.append(e - t)
                    src.append(owner)
                t = e
        return GroupCastPlan(tuple(in_sizes), tuple(dsts), tuple(out_sizes), tuple(src))

    def recv_seqlen(self, stage: int, rank: int) -> int:
        return self.stage_ranges[stage][rank].total_seqlen

    def comm_rows(self) -> list[int]:
        """Rows each rank receives over all stages (= KV tokens it is missing)."""
        return [rr.total_seqlen for rr in self.remote_ranges]

    # -- kernel slices -------------------------------------------------------------------------
    def calc_plan(self, rank: int) -> RankCalcPlan:
        """Kernel slices of ``rank`` for the host stage and every remote stage."""
        if rank not in self._calc_cache:
            self._calc_cache[rank] = self._build_calc_plan(rank)
        return self._calc_cache[rank]

    def _build_calc_plan(self, rank: int) -> RankCalcPlan:
        bands = self._rank_bands(rank)
        host, host_area = slices_over(bands, self.host_ranges[rank])
        stages, areas = [], []
        for s in range(self.num_stages):
            sl, a = slices_over(bands, self.stage_ranges[s][rank])
            stages.append(tuple(sl))
            areas.append(a)
        return RankCalcPlan(
            tuple(host), tuple(stages), host_area, tuple(areas),
            tuple(self.recv_seqlen(s, rank) for s in range(self.num_stages)),
        )

    def summary(self) -> dict[str, object]:
        d = self.dispatch
        return {
            "total_seqlen": d.total_seqlen,
            "chunk_size": d.chunk_size,
            "num_chunks": d.num_chunks,
            "cp_size": self.cp_size,
            "shard_seqlens": list(d.shard_seqlens),
            "max_shard_seqlen": max(d.shard_seqlens),
            "pad_tokens": sum(d.shard_seqlens) - d.total_seqlen,  # 0: ranks hold the sequence's tokens only
            "token_imbalance": round(d.token_imbalance(), 4),
            "rank_areas": d.rank_areas(),
            "imbalance": round(d.imbalance(), 4),
            "remote_kv_rows": self.comm_rows(),
            "num_stages": self.num_stages,
        }
