"""Unit tests of the pure-Python solver with hand-checked cases, plus property tests."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import (
    AttnMaskType,
    AttnRange,
    AttnRanges,
    AttnSlice,
    Band,
    DispatchConfig,
    DistAttnPlan,
    OverlapConfig,
    block_causal_slices,
    max_chunk_size,
    shared_prefix_slices,
    slice_area,
    solve_dispatch,
    validate_slices,
    varlen_slices,
)
from magi_solver.comm_plan import segments_with_destinations
from magi_solver.mask import first_double_cover
from magi_solver.overlap import group_stages, split_remote, timeline_cost


def brute_cells(slices):
    cells = set()
    for s in slices:
        qs, qe, ks, ke, t = s.to_tuple() if isinstance(s, AttnSlice) else s
        sq, sk = qe - qs, ke - ks
        for i in range(sq):
            for j in range(sk):
                ok = True
                if t & 1:
                    ok &= j <= i + sk - sq
                if t & 2:
                    ok &= j >= i
                if ok:
                    cells.add((qs + i, ks + j))
    return cells


def test_solver_does_not_import_torch():
    code = "import sys, magi_solver; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


class TestRanges:
    def test_merge_intersect_subtract(self):
        a = AttnRanges([(5, 9), (0, 3), (2, 4), (9, 10), (12, 12)])
        assert a.merge().to_list() == [(0, 4), (5, 10)]
        b = AttnRanges([(1, 6), (8, 20)])
        assert a.intersect(b).to_list() == [(1, 4), (5, 6), (8, 10)]
        assert a.subtract(b).to_list() == [(0, 1), (6, 8)]
        assert b.subtract(a).to_list() == [(4, 5), (10, 20)]

    def test_local_mapping_and_cu_seqlens(self):
        r = AttnRanges([(10, 20), (30, 35)])
        assert r.make_range_local(AttnRange(32, 34)) == AttnRange(12, 14)
        with pytest.raises(ValueError, match="not inside"):
            r.make_range_local(AttnRange(18, 31))
        assert AttnRanges.from_cu_seqlens([0, 3, 7]).to_list() == [(0, 3), (3, 7)]
        with pytest.raises(ValueError, match="non-decreasing"):
            AttnRanges.from_cu_seqlens([0, 5, 3])

    def test_bad_range(self):
        with pytest.raises(ValueError, match="start <= end"):
            AttnRange(5, 3)


class TestMaskSemantics:
    @pytest.mark.parametrize(
        "sq,sk,t,area",
        [(4, 4, 0, 16), (4, 4, 1, 10), (3, 5, 1, 12), (5, 3, 1, 6), (3, 5, 2, 12), (5, 3, 2, 6),
         (3, 5, 3, 9), (5, 3, 3, 0), (4, 4, 3, 4)],
    )
    def test_area_formulas_hand_checked(self, sq, sk, t, area):
        s = AttnSlice.make((0, sq), (0, sk), t)
        assert slice_area(sq, sk, AttnMaskType(t)) == area
        assert s.band().area() == area == len(brute_cells([s]))

    def test_causal_is_bottom_right_inv_causal_top_left(self):
        # sq > sk: CAUSAL masks the first sq - sk rows entirely
        cells = brute_cells([AttnSlice.make((0, 5), (0, 3), "causal")])
        assert {q for q, _ in cells} == {2, 3, 4}
        assert (2, 0) in cells and (2, 1) not in cells
        # INVCAUSAL: row 0 sees everything, the band starts at the top-left
        cells = brute_cells([AttnSlice.make((0, 3), (0, 5), "inv_causal")])
        assert {k for q, k in cells if q == 0} == {0, 1, 2, 3, 4}
        assert {k for q, k in cells if q == 2} == {2, 3, 4}

    def test_parse_mask_type(self):
        assert AttnMaskType.parse("bi_causal") is AttnMaskType.BICAUSAL
        with pytest.raises(ValueError, match="unknown mask type"):
            AttnMaskType.parse("diagonal")

    def test_double_coverage_rejected(self):
        slices = [AttnSlice.make((0, 10), (0, 10), "causal"), AttnSlice.make((5, 8), (2, 4), "full")]
        with pytest.raises(ValueError, match=r"slices 0 .* and 1 .* both cover cell"):
            validate_slices(slices, 10, 10)
        # touching but disjoint: the causal slice leaves row 0's keys 1..3 free
        validate_slices([AttnSlice.make((0, 4), (0, 4), "causal"), AttnSlice.make((0, 1), (1, 4), "full")], 4, 4)

    def test_out_of_bounds_rejected(self):
        with pytest.raises(ValueError, match="exceeds total_seqlen_k"):
            validate_slices([AttnSlice.make((0, 4), (0, 9))], 4, 8)


slice_st = st.tuples(
    st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), st.integers(0, 3)
).map(lambda t: AttnSlice.make(sorted(t[:2]), sorted(t[2:4]), t[4]))


class TestBandProperties:
    @given(slice_st)
    @settings(max_examples=300, deadline=None)
    def test_band_roundtrip_and_area(self, s):
        band = s.band()
        cells = brute_cells([s])
        assert band.area() == s.area == len(cells)
        assert brute_cells(band.to_slices()) == cells

    @given(slice_st, st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), st.integers(0, 12))
    @settings(max_examples=300, deadline=None)
    def test_clipping_keeps_exact_cells(self, s, a, b, c, d):
        a, b = sorted((a, b))
        c, d = sorted((c, d))
        want = {(q, k) for q, k in brute_cells([s]) if a <= q < b and c <= k < d}
        band = s.band().clip_q(a, b)
        band = band.clip_k(c, d) if band else None
        got = brute_cells(band.to_slices()) if band else set()
        assert got == want

    @given(slice_st, st.integers(-5, 5), st.integers(-5, 5))
    @settings(max_examples=200, deadline=None)
    def test_shift(self, s, dq, dk):
        dq, dk = min(dq, s.q_range.start), min(dk, s.k_range.start)
        got = brute_cells(s.band().shift(dq, dk).to_slices())
        assert got == {(q - dq, k - dk) for q, k in brute_cells([s])}

    @given(st.lists(slice_st, min_size=1, max_size=5))
    @settings(max_examples=200, deadline=None)
    def test_validation_iff_overlap(self, slices):
        total = sum(len(brute_cells([s])) for s in slices)
        disjoint = len(brute_cells(slices)) == total
        try:
            validate_slices(slices, 12, 12)
            ok = True
        except ValueError:
            ok = False
        assert ok == disjoint

    @given(st.lists(st.tuples(st.integers(0, 24), st.integers(1, 6), st.integers(0, 24), st.integers(1, 6),
                              st.integers(0, 3)), min_size=2, max_size=30))
    @settings(max_examples=200, deadline=None)
    def test_double_cover_sweep_matches_brute_force(self, raw):
        """Many short slices (the sweep's pruning by key extent) plus one wide one in half the runs."""
        slices = [AttnSlice.make((q, q + n), (k, k + m), t) for q, n, k, m, t in raw]
        if raw[0][4] % 2:
            slices.append(AttnSlice.make((raw[0][0], raw[0][0] + 2), (0, 30), "full"))
        cells: dict[tuple[int, int], int] = {}
        pairs = set()
        for i, s in enumerate(slices):
            for c in brute_cells([s]):
                if c in cells:
                    pairs.add((cells[c], i))
                cells[c] = i
        hit = first_double_cover(slices)
        assert (hit is None) == (not pairs)
        if hit is not None:
            a, b, shared = hit
            assert a < b and shared.area() == len(brute_cells([slices[a]]) & brute_cells([slices[b]])) > 0


class TestBuilders:
    def test_varlen_and_window(self):
        assert [s.to_tuple() for s in varlen_slices([0, 3, 5], causal=True)] == [(0, 3, 0, 3, 1), (3, 5, 3, 5, 1)]
        sw = varlen_slices([0, 10], window_size=(3, 0))
        cells = brute_cells(sw)
        assert cells == {(q, k) for q in range(10) for k in range(10) if q - 3 <= k <= q}
        with pytest.raises(ValueError, match="must match"):
            varlen_slices([0, 3], [0, 2, 3])

    def test_block_causal_and_shared_prefix(self):
        bc = block_causal_slices([0, 6, 10], 4)
        assert [s.to_tuple() for s in bc] == [(0, 4, 0, 4, 0), (4, 6, 0, 6, 0), (6, 10, 6, 10, 0)]
        sp = shared_prefix_slices(2, [2, 1])
        cells = brute_cells(sp)
        assert (3, 0) in cells and (4, 2) not in cells and (4, 4) in cells and (3, 3) in cells and (2, 3) not in cells


class TestDispatch:
    def test_uneven_chunks_without_padding(self):
        plan = solve_dispatch(varlen_slices([0, 10], causal=True), 10, 2, DispatchConfig(chunk_size=2))
        assert plan.num_chunks == 5 and plan.shard_seqlens == (6, 4) and sum(plan.shard_seqlens) == 10
        # causal chunk areas: rows [2c, 2c+2) of a 10-token triangle
        assert plan.chunk_areas == (3, 7, 11, 15, 19)
        # min-heap by hand (chunk:area), 5 chunks on 2 ranks: 2 each and one rank a third:
        # 4:19->r0, 3:15->r1, 2:11->r1 (26), 1:7->r0 (26), 0:3->r0 (tie, lower rank: the extra chunk)
        assert plan.partitions == ((0, 1, 4), (2, 3)) and plan.rank_areas() == [29, 26]
        assert plan.position_ids(0) == [0, 1, 2, 3, 8, 9] and plan.position_ids(1) == [4, 5, 6, 7]

    def test_short_last_chunk(self):
        plan = solve_dispatch(varlen_slices([0, 11], causal=True), 11, 2, DispatchConfig(chunk_size=4))
        assert plan.num_chunks == 3 and plan.chunk_range(2) == AttnRange(8, 11)
        # areas 10, 26, 30: chunk 2 -> r0, chunk 1 -> r1, chunk 0 -> r1 (lighter, takes the extra chunk)
        assert plan.partitions == ((2,), (0, 1)) and plan.shard_seqlens == (3, 8)
        assert sorted(t for r in range(2) for t in plan.position_ids(r)) == list(range(11))

    @pytest.mark.parametrize("alg", ["min_heap", "sequential"])
    @pytest.mark.parametrize("S,cp,chunk", [(1050, 4, 568), (1050, 4, None), (1031, 3, 100), (7, 4, None),
                                             (13, 4, 1), (10, 4, 64), (4, 4, None), (97, 8, 5)])
    def test_every_rank_gets_work_and_chunk_counts_differ_by_at_most_one(self, S, cp, chunk, alg):
        plan = solve_dispatch(varlen_slices([0, S], causal=True), S, cp, DispatchConfig(chunk_size=chunk, alg=alg))
        counts = [len(p) for p in plan.partitions]
        assert min(counts) >= 1 and max(counts) - min(counts) <= 1
        assert min(plan.shard_seqlens) >= 1 and sum(plan.shard_seqlens) == S  # every rank works, no padding
        assert sorted(c for p in plan.partitions for c in p) == list(range(plan.num_chunks))
        assert plan.chunk_size <= max_chunk_size(S, cp) and (chunk is None or plan.chunk_size <= chunk)

    def test_chunk_cap_reproduces_the_issue_case(self):
        # chunk_size 568 on 1,050 tokens at cp 4 used to pad to 2,272 tokens with two ranks of padding only
        plan = solve_dispatch(varlen_slices([0, 1050], causal=True), 1050, 4, DispatchConfig(chunk_size=568))
        assert plan.chunk_size == 263 and plan.shard_seqlens == (261, 263, 263, 263)
        assert max_chunk_size(5, 4) == 1 and max_chunk_size(10, 4) == 3 and max_chunk_size(8, 1) == 8
        with pytest.raises(ValueError, match="total_seqlen=3 is smaller than cp_size=4"):
            solve_dispatch(varlen_slices([0, 3]), 3, 4)

    def test_min_heap_beats_sequential(self):
        sl = varlen_slices([0, 4096], causal=True)
        mh = solve_dispatch(sl, 4096, 4, DispatchConfig(chunk_size=128))
        seq = solve_dispatch(sl, 4096, 4, DispatchConfig(chunk_size=128, alg="sequential"))
        assert mh.imbalance() < 1.01 < 1.5 < seq.imbalance()

    def test_bad_config(self):
        with pytest.raises(ValueError, match="chunk_size"):
            DispatchConfig(chunk_size=0)
        with pytest.raises(ValueError, match="alg"):
            DispatchConfig(alg="magic")
        with pytest.raises(ValueError, match="degree"):
            OverlapConfig(degree=-1)


class TestCommPlan:
    def test_segments(self):
        sizes, dsts = segments_with_destinations(10, [(2, 6, 1), (4, 8, 2)])
        assert sizes == [2, 2, 2, 2, 2] and dsts == [(), (1,), (1, 2), (2,), ()]

    @pytest.mark.parametrize("degree", [1, 3, None])
    def test_plans_are_consistent_and_zero_redundancy(self, degree):
        sl = varlen_slices([0, 50, 51, 130, 200], causal=True) + [AttnSlice.make((150, 200), (0, 20))]
        plan = DistAttnPlan(sl, 200, 4, dispatch_config=DispatchConfig(chunk_size=10),
                            overlap_config=OverlapConfig(degree=degree, min_chunk_size=8))
        W = plan.cp_size
        for s in range(plan.num_stages):
            sent = [[0] * W for _ in range(W)]
            for r in range(W):
                cp = plan.cast_plan(s, r)
                assert cp.input_rows == plan.dispatch.shard_seqlens[r]
                for n, d in zip(cp.input_split_sizes, cp.dst_indices):
                    assert r not in d
                    for dst in d:
                        sent[r][dst] += n
            for r in range(W):
                cp = plan.cast_plan(s, r)
                got = [0] * W
                for n, src in zip(cp.output_split_sizes, cp.src_index):
                    got[src] += n
                assert got == [sent[src][r] for src in range(W)]
                # transpose round trip
                assert cp.transpose().transpose() == cp
        for r in range(W):
            # remote = exactly the keys needed minus the keys held: nothing sent twice
            recv = AttnRanges([x for s in range(plan.num_stages) for x in plan.stage_ranges[s][r]])
            assert recv.total_seqlen == recv.merge().total_seqlen == plan.remote_ranges[r].total_seqlen
            assert not recv.intersect(plan.host_ranges[r])

    def test_calc_plan_covers_exact_area(self):
        sl = block_causal_slices([0, 37, 90], 8)
        plan = DistAttnPlan(sl, 90, 3, dispatch_config=DispatchConfig(chunk_size=6),
                            overlap_config=OverlapConfig(degree=2, min_chunk_size=4))
        total = sum(s.area for s in sl)
        got = sum(plan.calc_plan(r).host_area + sum(plan.calc_plan(r).stage_areas) for r in range(3))
        assert got == total


def plan_cells(plan):
    """Every global (q, k) cell the plan's kernel slices compute, over all ranks and stages, as a
    list (a cell computed twice appears twice)."""
    d = plan.dispatch
    cells = []
    for r in range(plan.cp_size):
        local_q = [t for c in d.partitions[r] for t in range(c * d.chunk_size, (c + 1) * d.chunk_size)]
        calc = plan.calc_plan(r)
        buffers = [local_q] + [[t for x in plan.stage_ranges[s][r] for t in range(x.start, x.end)]
                               for s in range(plan.num_stages)]
        for buf, slices in zip(buffers, (calc.host, *calc.stages)):
            cells.extend((local_q[q], buf[k]) for q, k in brute_cells(slices))
    return cells


MASKS_OVER_ONE_DISPATCH = {
    "full_docs": varlen_slices([0, 13, 40, 41, 77, 101]),
    "window_7_0": varlen_slices([0, 13, 40, 41, 77, 101], causal=True, window_size=(7, 0)),
    "window_3_3": varlen_slices([0, 13, 40, 41, 77, 101], window_size=(3, 3)),
    "whole_sequence_causal": varlen_slices([0, 101], causal=True),
    "flex": [AttnSlice.make((0, 30), (60, 101)), AttnSlice.make((50, 101), (0, 50), "inv_causal")],
}


class TestReusedDispatch:
    """A plan over another mask's dispatch keeps every token where it was and still computes
    exactly the new mask's cells, each once."""

    BASE = varlen_slices([0, 13, 40, 41, 77, 101], causal=True)

    @pytest.mark.parametrize("name", list(MASKS_OVER_ONE_DISPATCH))
    @pytest.mark.parametrize("cp,degree", [(1, 1), (2, 1), (3, 2), (4, 3), (4, 0)])
    def test_new_mask_over_base_placement(self, name, cp, degree):
        slices = MASKS_OVER_ONE_DISPATCH[name]
        base = DistAttnPlan(self.BASE, 101, cp, dispatch_config=DispatchConfig(chunk_size=4))
        overlap = OverlapConfig(degree=degree, min_chunk_size=3)
        plan = DistAttnPlan(slices, 101, cp, overlap_config=overlap, dispatch=base.dispatch)
        d, b = plan.dispatch, base.dispatch
        assert (d.partitions, d.chunk_size, d.shard_seqlens) == (b.partitions, b.chunk_size, b.shard_seqlens)
        assert [d.position_ids(r) for r in range(cp)] == [b.position_ids(r) for r in range(cp)]
        assert sum(d.chunk_areas) == sum(s.area for s in slices)  # the new mask's areas, not the base's
        cells = plan_cells(plan)
        assert len(cells) == len(set(cells)) and set(cells) == brute_cells(slices)

    def test_placement_is_not_rebalanced(self):
        """Over a placement balanced for the base, an unrelated mask keeps its imbalance."""
        base = DistAttnPlan(varlen_slices([0, 256], causal=True), 256, 4, dispatch_config=DispatchConfig(chunk_size=16))
        fresh = DistAttnPlan(varlen_slices([0, 256], causal=True, window_size=(15, 0)), 256, 4,
                             dispatch_config=DispatchConfig(chunk_size=16, alg="sequential"))
        reused = DistAttnPlan(fresh.slices, 256, 4, dispatch=base.dispatch)
        assert reused.dispatch.partitions == base.dispatch.partitions != fresh.dispatch.partitions
        assert reused.summary()["imbalance"] == round(reused.dispatch.imbalance(), 4)

    def test_errors_name_the_mismatch(self):
        base = DistAttnPlan(self.BASE, 101, 2)
        with pytest.raises(ValueError, match=r"dispatch places total_seqlen=101 tokens but the slices are over "
                                             r"total_seqlen=90"):
            DistAttnPlan(varlen_slices([0, 90]), 90, 2, dispatch=base.dispatch)
        with pytest.raises(ValueError, match=r"dispatch places the tokens on cp_size=2 ranks but cp_size=4"):
            DistAttnPlan(self.BASE, 101, 4, dispatch=base.dispatch)
        with pytest.raises(ValueError, match="pass dispatch_config or dispatch, not both"):
            DistAttnPlan(self.BASE, 101, 2, dispatch=base.dispatch, dispatch_config=DispatchConfig(chunk_size=4))
        with pytest.raises(TypeError, match="dispatch must be a DispatchPlan"):
            DistAttnPlan(self.BASE, 101, 2, dispatch=base)
        with pytest.raises(ValueError, match="exceeds|out of|beyond|outside"):
            DistAttnPlan([AttnSlice.make((0, 120), (0, 120))], 101, 2, dispatch=base.dispatch)


class TestOverlap:
    def test_split_and_group(self):
        chunks = split_remote(AttnRanges([(0, 5), (10, 17)]), 4, 64)
        assert [c.to_list() for c in chunks] == [[(0, 4)], [(4, 5), (10, 13)], [(13, 17)]]
        groups = group_stages([1, 1, 1, 1], [0, 0, 0, 0], 2)
        assert groups == [[0, 1], [2, 3]]
        assert group_stages([1], [1], 3) == [[0], [], []]
        assert timeline_cost(2.0, [1.0, 1.0], [3.0, 1.0]) == 2.0 + 3.0 + 1.0


def test_plan_1m_tokens_64_ranks_is_fast():
    import random

    rng = random.Random(0)
    cu = [0]
    while cu[-1] < (1 << 20):
        cu.append(min(cu[-1] + rng.choice([rng.randint(128, 2048), rng.randint(2048, 65536)]), 1 << 20))
    sl = varlen_slices(cu, causal=True)
    t0 = time.perf_counter()
    plan = DistAttnPlan(sl, 1 << 20, 64, num_heads_q=48, num_heads_kv=8, head_dim=128,
                        overlap_config=OverlapConfig(degree=4))
    for s in range(plan.num_stages):
        plan.cast_plan(s, 0)
    plan.calc_plan(0)
    elapsed = time.perf_counter() - t0
    assert plan.dispatch.imbalance() < 1.05
    assert elapsed < 2.0, f"planning took {elapsed:.2f}s"


def test_slice_ranges_are_the_kernel_arguments():
    """slice_ranges gives (q_ranges, k_ranges, mask types) in slice order, as the kernel takes them."""
    from magi_solver import AttnMaskType, AttnRange, AttnSlice, slice_ranges

    sl = [AttnSlice(AttnRange(0, 5), AttnRange(0, 5), AttnMaskType.CAUSAL),
          AttnSlice(AttnRange(5, 9), AttnRange(2, 7), AttnMaskType.BICAUSAL)]
    assert slice_ranges(sl) == ([(0, 5), (5, 9)], [(0, 5), (2, 7)], [int(AttnMaskType.CAUSAL), int(AttnMaskType.BICAUSAL)])
    assert slice_ranges(iter(sl)) == slice_ranges(sl) and slice_ranges([]) == ([], [], [])
