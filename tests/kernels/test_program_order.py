"""Launch order of the Gluon backward's programs (``magi_kernels.program_order``): pure Python."""

from __future__ import annotations

import pytest

from magi_kernels import program_order as po


def costs_of(kind: str, n_tiles: int) -> list[float]:
    """Per-tile costs of 128-key tiles over 64-row query blocks: full or causal (longest first)."""
    if kind == "full":
        return po.tile_costs([n_tiles * 128] * n_tiles, 64)
    return po.tile_costs([128 * (n_tiles - t) for t in range(n_tiles)], 64)


@pytest.mark.parametrize("n_tiles,n_heads,band", [(64, 8, 1), (64, 8, 3), (5, 2, 2), (1, 4, 4), (7, 1, 1)])
def test_band_order_is_a_permutation_head_major_then_tile_major(n_tiles, n_heads, band):
    order = po.band_order(n_tiles, n_heads, band)
    assert sorted(order) == list(range(n_tiles * n_heads))
    split = (n_heads - band) * n_tiles
    heads = [p // n_tiles for p in order]
    assert heads[:split] == sorted(heads[:split])  # head-major part
    tiles = [p % n_tiles for p in order[split:]]
    assert tiles == sorted(tiles)  # band: each tile for every band head, longest first
    with pytest.raises(ValueError, match="band must be in"):
        po.band_order(n_tiles, n_heads, n_heads + 1)


def test_simulated_finish_is_the_in_order_list_schedule():
    """Three SMs, tiles costing 4, 1, 1 of two heads: head-major starts head 1's long tile at 1
    (after a short one) and finishes at 5; longest first runs both long tiles from 0 and the
    four short ones on the third SM: 4."""
    cost, n_tiles = [4.0, 1.0, 1.0], 3
    assert po.simulated_finish(po.band_order(n_tiles, 2, 1), cost, n_tiles, 3) == 5.0
    assert po.simulated_finish(po.band_order(n_tiles, 2, 2), cost, n_tiles, 3) == 4.0
    assert po.choose_band(cost, 2, 3) == 2
    assert po.simulated_finish([0, 1, 2], cost, n_tiles, 1) == 6.0  # one SM: the sum


@pytest.mark.parametrize("n_tiles", [64, 128, 256])
def test_full_mask_stays_head_major(n_tiles):
    """Equal tiles: no tail to fix, so L2 locality wins (head order)."""
    assert po.choose_band(costs_of("full", n_tiles), 8, 132) == 1


@pytest.mark.parametrize("n_tiles,expected", [(64, 8), (128, 1), (256, 1)])
def test_causal_band_by_length(n_tiles, expected):
    """Causal 8k/16k/32k, 8 KV heads, 132 SMs: at 8k head-major finishes 23 % after longest-first
    (the last head's first tile runs the whole length, started late); from 16k its tail is
    under 2 %."""
    costs = costs_of("causal", n_tiles)
    band = po.choose_band(costs, 8, 132)
    assert band == expected
    head = po.simulated_finish(po.band_order(n_tiles, 8, 1), costs, n_tiles, 132)
    lpt = po.simulated_finish(po.band_order(n_tiles, 8, 8), costs, n_tiles, 132)
    chosen = po.simulated_finish(po.band_order(n_tiles, 8, band), costs, n_tiles, 132)
    assert chosen <= (1 + po.TOLERANCE) * lpt
    if n_tiles == 64:
        assert head > 1.2 * lpt


def test_choose_band_checks_its_arguments():
    with pytest.raises(ValueError, match="n_sms and n_heads must be positive"):
        po.choose_band([1.0], 8, 0)
    assert po.choose_band([], 8, 132) == 1  # no tiles: nothing to order


def _finish(pieces, costs, n_tiles, n_sms, group):
    """Simulated finish of a piece list, pieces costing as ``split_tail`` models them."""
    c = [costs[p % n_tiles] if hi - lo == group else po.piece_cost(costs[p % n_tiles], hi - lo, group)
         for p, lo, hi in pieces]
    return max(po.list_schedule(c, [0.0] * n_sms))


def _covers_each_head_once(pieces, order, group):
    seen = sorted((p, g) for p, lo, hi in pieces for g in range(lo, hi))
    return seen == sorted((p, g) for p in order for g in range(group))


@pytest.mark.parametrize("n_tiles,n_heads,n_sms", [(128, 8, 132), (256, 8, 132), (17, 2, 132), (60, 3, 16)])
def test_split_tail_fills_the_last_wave_of_equal_programs(n_tiles, n_heads, n_sms):
    """Equal programs whose count is not a multiple of the SMs: the last programs run as pieces
    of fewer query heads; every (program, head) is in exactly one piece, the unsplit programs
    keep their launch order in front, and the simulated finish drops by at least SPLIT_GAIN
    (16k full: 1024 programs on 132 SMs, 7.76 waves)."""
    costs = costs_of("full", n_tiles)
    order = po.band_order(n_tiles, n_heads, 1)
    pieces = po.split_tail(order, costs, n_tiles, n_sms, 6)
    assert _covers_each_head_once(pieces, order, 6)
    whole = [p for p, lo, hi in pieces if hi - lo == 6]
    assert whole == order[:len(whole)] and len(whole) < len(order)
    base = po.simulated_finish(order, costs, n_tiles, n_sms)
    assert _finish(pieces, costs, n_tiles, n_sms, 6) <= (1 - po.SPLIT_GAIN) * base


def test_split_tail_leaves_launches_it_cannot_shorten():
    """Whole waves of equal programs, a single query head per KV head (nothing to split) and
    an empty launch stay as they are."""
    costs = costs_of("full", 66)
    order = po.band_order(66, 4, 1)  # 264 programs: two whole waves on 132 SMs
    assert po.split_tail(order, costs, 66, 132, 6) == [(p, 0, 6) for p in order]
    assert po.split_tail(order[:100], costs, 66, 132, 1) == [(p, 0, 1) for p in order[:100]]
    assert po.split_tail([], costs, 66, 132, 6) == []


def test_list_schedule_starts_each_program_on_the_first_free_sm():
    assert sorted(po.list_schedule([3.0, 1.0, 1.0, 2.0], [0.0, 0.0])) == [3.0, 4.0]


@pytest.mark.parametrize("seed", range(6))
def test_split_tail_bounds_do_not_change_the_plan(seed):
    """split_tail skips candidates by lower bounds and stops simulating a candidate once it
    cannot win; on random tile costs its plan must equal the exhaustive search's over the
    same candidates (the first strictly shortest finish below (1 - SPLIT_GAIN) x unsplit)."""
    import random

    rnd = random.Random(seed)
    n_tiles, n_heads, n_sms, group = rnd.randint(5, 90), rnd.choice([1, 2, 4, 8]), rnd.choice([16, 132]), 6
    work = sorted((rnd.randint(1, 64) * 64 for _ in range(n_tiles)), reverse=True)
    if seed % 2:
        work = [work[0]] * n_tiles  # equal programs: the case the split is for
    costs = po.tile_costs(work, 64)
    order = po.band_order(n_tiles, n_heads, n_heads if seed % 3 == 0 else 1)
    n = len(order)
    seq = [costs[p % n_tiles] for p in order]
    best = max(po.list_schedule(seq, [0.0] * n_sms)) * (1 - po.SPLIT_GAIN)
    plan = None
    for k in sorted({max(1, n_sms // 2), n_sms, 2 * n_sms, n}):
        if k > n:
            continue
        for s in (d for d in range(1, group) if group % d == 0):
            tail = [po.piece_cost(c, s, group) for c in seq[n - k:] for _ in range(group // s)]
            finish = max(po.list_schedule(seq[: n - k] + tail, [0.0] * n_sms))
            if finish < best:
                best, plan = finish, (k, s)
    expected = [(p, 0, group) for p in order]
    if plan:
        k, s = plan
        expected = expected[: n - k] + [(p, g, g + s) for p in order[n - k:] for g in range(0, group, s)]
    assert po.split_tail(order, costs, n_tiles, n_sms, group) == expected


@pytest.mark.parametrize("band", [1, 2, 4, 8])
@pytest.mark.parametrize("heads", [1, 2, 3, 6])
def test_head_chunk_pieces_cover_every_program_and_head_once_in_head_chunk_order(band, heads):
    """Every (program, query head) is in exactly one piece of ``heads`` heads; the first virtual
    heads (KV head, chunk of query heads) run head-major: all tiles of KV head 0 over the first
    chunk, then over the next; the last ``band`` virtual heads run tile-major."""
    n_tiles, n_heads, group = 5, 4, 6
    band = min(band, n_heads * group // heads)  # (8: every virtual head tile-major for 6-head pieces)
    pieces = po.head_chunk_pieces(n_tiles, n_heads, group, heads, band)
    covered = sorted((p, g) for p, lo, hi in pieces for g in range(lo, hi))
    assert covered == sorted((p, g) for p in range(n_tiles * n_heads) for g in range(group))
    assert all(hi - lo == heads for _, lo, hi in pieces)
    chunks = group // heads
    n_virtual = n_heads * chunks
    head_major = n_virtual - band
    first = pieces[: head_major * n_tiles]
    assert first == [(v // chunks * n_tiles + t, v % chunks * heads, (v % chunks + 1) * heads)
                     for v in range(head_major) for t in range(n_tiles)]
    last = pieces[head_major * n_tiles:]  # tile-major: each tile over every band head in turn
    assert [p % n_tiles for p, _, _ in last] == [t for t in range(n_tiles) for _ in range(band)]


def test_pieces_choose_their_band_on_piece_costs():
    """8k causal (64 key tiles of 128 keys, 8 KV heads, GQA group 6, 132 SMs): whole programs
    need tile-major order for their tail, one-head pieces are short enough to stay head-major
    (so every resident piece reads one query head's rows)."""
    costs = po.tile_costs([8192 - 128 * j for j in range(64)], 64)
    assert po.choose_band(costs, 8, 132) == 8
    piece_costs = [po.piece_cost(c, 1, 6) for c in costs]
    assert po.choose_band(piece_costs, 8 * 6, 132) == 1


def test_head_chunk_pieces_reject_a_size_that_does_not_divide_the_group():
    with pytest.raises(ValueError, match="divide the GQA group"):
        po.head_chunk_pieces(2, 1, 6, 4, 1)


def test_list_queues_hand_example():
    """Two SMs, items costing 3, 1, 1, 1, 2: SM 0 takes 0 (busy to 3), SM 1 takes 1, 2, 3 (free
    at 1, 2, 3), then item 4 goes to SM 0, free at 3 like SM 1 and lower-numbered."""
    assert po.list_queues([3.0, 1.0, 1.0, 1.0, 2.0], 2) == [[0, 4], [1, 2, 3]]
    assert po.list_queues([1.0, 1.0], 5) == [[0], [1]]  # fewer items than SMs: no empty queues
    assert po.list_queues([], 4) == []
    with pytest.raises(ValueError, match="n_sms must be positive"):
        po.list_queues([1.0], 0)


@pytest.mark.parametrize("seed", range(4))
def test_list_queues_replay_the_list_schedule(seed):
    """Every item once, each queue in launch order, and the queues' busiest SM finishes when the
    in-order list schedule does (the persistent launch keeps the order's tail)."""
    import random

    rng = random.Random(seed)
    costs = [rng.choice([1.0, 2.5, 7.0, 40.0]) for _ in range(rng.randint(1, 400))]
    n_sms = rng.randint(1, 40)
    queues = po.list_queues(costs, n_sms)
    assert sorted(i for q in queues for i in q) == list(range(len(costs)))
    assert all(q == sorted(q) for q in queues) and len(queues) == min(n_sms, len(costs))
    finish = max(sum(costs[i] for i in q) for q in queues)
    assert finish == pytest.approx(max(po.list_schedule(costs, [0.0] * n_sms)))


def test_persistent_forward_queue_table():
    """``plan.fwd_queue_table``: programs + 1 offsets, then every (tile, head) item of the
    KV-major order once, each program's items in order; no more programs than SMs or items."""

    from magi_kernels import plan as gf

    work = (1000, 700, 300, 129, 0)  # visible keys per tile, descending (the tile tables' order)
    hq, group = 6, 3
    tiles = gf.item_tiles(len(work), hq, group)
    assert sorted(tiles) == sorted(list(range(len(work))) * hq)
    # the tiles x group heads of the first KV head, then the second
    assert tiles[: len(work) * group] == [t for t in range(len(work)) for _ in range(group)]
    assert tiles[len(work) * group:] == tiles[: len(work) * group]
    for n_sms in (1, 4, 132):
        table, programs = gf.fwd_queue_table(work, hq, group, 128, n_sms, "cpu")
        table = table.tolist()
        assert programs == min(n_sms, len(work) * hq)
        offsets, items = table[: programs + 1], table[programs + 1:]
        assert offsets[0] == 0 and offsets[-1] == len(items) == len(work) * hq
        queues = [items[a:b] for a, b in zip(offsets, offsets[1:])]
        assert all(q and q == sorted(q) for q in queues)
        assert sorted(items) == list(range(len(work) * hq))


def test_backward_launch_table_of_pieces_is_head_major_at_8k_causal():
    """``plan.bwd_order_table`` with ``bwd_piece_heads=1`` at 8k causal: the pieces run
    KV head 0's tiles over query head 0 first (longest tile first), every piece one head wide,
    and the table says the launch has pieces (atomic dK/dV); whole programs run tile-major."""

    from magi_kernels import plan as gluon_bwd

    work = tuple(8192 - 128 * j for j in range(64))
    table, partial, heads_per_piece = gluon_bwd.bwd_order_table(work, 8, 132, "auto", 64, 6, True, 1,
                                                             "cpu", 1.0)
    prog, heads = table[:, 0].tolist(), table[:, 1].tolist()
    assert partial and heads_per_piece == 1 and len(prog) == 64 * 8 * 6
    assert prog[:64] == list(range(64)) and all(h == (0 | 1 << 16) for h in heads[:64])
    assert prog[64:128] == list(range(64)) and all(h == (1 | 2 << 16) for h in heads[64:128])
    whole, partial_whole, _ = gluon_bwd.bwd_order_table(work, 8, 132, "auto", 64, 6, False, 0, "cpu", 1.0)
    assert not partial_whole and whole[:8, 0].tolist() == [h * 64 for h in range(8)]  # tile-major


def test_auto_pieces_split_staircase_launches_of_unequal_tiles():
    """``auto_piece_heads``: unequal tiles of a mostly causal launch run as pieces of the GQA
    group split in its smallest factor, as do tiles of any slices whose costs vary very much (a
    shared prefix); unequal tiles of full slices (packed documents), equal
    tiles (full, sliding window), MHA and a single tile stay whole programs; the backend's
    staircase share counts causal / inv_causal area; ``_order_table("auto")`` follows it."""

    from magi_kernels import plan as gluon_bwd
    from magi_kernels import tiles as tb

    causal = po.tile_costs([8192 - 128 * j for j in range(64)], 64)
    window = po.tile_costs([1088] * 60 + [1024, 768, 512, 256], 64)
    full = po.tile_costs([8192] * 64, 64)
    assert [po.auto_piece_heads(causal, g, 1.0) for g in (6, 8, 4, 9, 7, 2, 1)] == [3, 4, 2, 3, 1, 1, 0]
    assert po.auto_piece_heads(causal, 6, 0.4) == 0  # unequal, but mostly full slices
    assert po.auto_piece_heads(window, 6, 1.0) == 0 and po.auto_piece_heads(full, 6, 1.0) == 0
    assert po.auto_piece_heads(causal[:1], 6, 1.0) == 0
    # a shared prefix: 32 tiles of the prefix seen by every row, 96 short document tiles (cv 1.3);
    # mostly full slices, yet pieces
    prefix = po.tile_costs([16384 - 64 * j for j in range(32)] + [400 + 30 * (j % 9) for j in range(96)], 64)
    assert po.auto_piece_heads(prefix, 6, 0.3) == 1  # one query head per piece
    docs = po.tile_costs([4096, 2048, 1024, 512] * 16, 64)  # packed full documents: cv 0.7, whole programs
    assert po.auto_piece_heads(docs, 6, 0.0) == 0
    assert tb.staircase_share(((0, 100, 0, 100, 1), (100, 200, 100, 200, 0))) == pytest.approx(5050 / 15050)
    assert tb.staircase_share(((0, 100, 0, 100, 2), (0, 100, 0, 100, 3))) == pytest.approx(5050 / 5150)
    assert tb.staircase_share(()) == 0.0
    work = tuple(8192 - 128 * j for j in range(64))
    cpu = "cpu"
    table, partial, heads = gluon_bwd.bwd_order_table(work, 8, 132, "auto", 64, 6, True, "auto", cpu, 1.0)
    assert heads == 3 and partial and len(table) == 64 * 8 * 2
    assert set(table[:64, 1].tolist()) == {0 | 3 << 16}  # KV head 0's tiles over heads [0, 3) first
    assert gluon_bwd.bwd_order_table(work, 8, 132, "auto", 64, 6, True, "auto", cpu, 0.0)[2] == 0
    assert gluon_bwd.bwd_order_table((8192,) * 64, 8, 132, "auto", 64, 6, True, "auto", cpu, 1.0)[2] == 0
    _, partial_mha, heads_mha = gluon_bwd.bwd_order_table(work, 8, 132, "auto", 64, 1, True, "auto", cpu, 1.0)
    assert heads_mha == 0 and not partial_mha
