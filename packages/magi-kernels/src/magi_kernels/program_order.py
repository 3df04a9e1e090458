"""Launch order of the backward's (key tile, KV head) programs: L2 locality against the tail.

The GPU starts programs in launch order as SMs free up. Two orders pull in opposite directions:

* head-major (the key tiles of one KV head, then the next head): the resident programs share
  one query head's Q/dO/dQ rows, which stay in L2 (+11 % at 16k full, +31 % at 32k full);
* longest first over all heads (tile-major; the tile tables are sorted by descending work): the
  list schedule with the shortest tail. Under head-major, the last head's longest key tile (a
  causal mask's first tile sees every query) starts only when 7/8 of the work is done and runs
  alone at the end: at 8k causal the list schedule finishes 23 % after longest-first's.

``band_order`` keeps head-major order for the first heads and runs the last ``band`` heads
tile-major, and ``choose_band`` picks the smallest band whose list-schedule finish (the GPU's
in-order dispatch replayed on the host, ``simulated_finish``) is within ``tolerance`` of the
longest-first order's: equal tiles (a full mask) keep head-major, a causal mask at 8k runs
tile-major, at 16k and longer head-major again (its tail is then under 2 %), packed documents
get bands of 2-4 heads at 8k-16k. Measured on the H200: 8k causal 385 -> 400-417 TFLOP/s,
8k varlen causal 278 -> 318, 16k varlen causal 350 -> 363.

``split_tail`` then fills a part-empty last wave: the last programs of the order run as pieces
over fewer of their GQA group's query heads (their dK/dV added with atomics), chosen on the same
list-schedule model (16k/32k full and sliding window split their last wave). Plain Python on
host-side work counts (no device reads); the caller (``plan.bwd_order_table``) caches the table per work
tuple (0.2-3 ms to build at 8k-128k tokens).

``list_queues`` replays the same list schedule for a persistent launch (one program per SM that
walks a queue of work items, ``gluon_fwd``): each SM's queue holds
the items it would have started, in order, so the persistent launch keeps the order's locality
and its tail.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

# splitting the tail's programs into pieces of fewer query heads (``split_tail``) must shorten the
# simulated finish by at least this much: the pieces add their dK/dV with atomics
SPLIT_GAIN = 0.01
# a program's fixed cost in query blocks: its K/V load and dK/dV write-out (``tile_costs``)
TILE_OVERHEAD_BLOCKS = 1.0
# a piece's fixed cost in query blocks: the K/V load, the pipeline fill, the dK/dV atomics
PIECE_OVERHEAD_BLOCKS = 1.5
# a launch runs as pieces of a query-head chunk (``auto_piece_heads``) when its tile costs vary
# more than this (coefficient of variation: causal 0.57, packed documents 0.41-0.76, sliding
# window 0.06-0.20, full 0 at 8k-32k, bench masks) ...
PIECES_MIN_CV = 0.3
# ... and at least this share of its area lies in staircase slices (causal / inv_causal), whose
# neighbouring key tiles see different numbers of query rows ...
PIECES_MIN_STAIRCASE = 0.5
# ... or, whatever its slice types, its tile costs vary more than this: a few tiles far longer
# than the rest (a prefix every document attends to: cv 1.2-1.3 on the bench's shared_prefix,
# 8k-32k; packed full or block-causal documents stay at 0.4-0.7). H100, 16k shared_prefix
# backward: 315 TFLOP/s as whole programs, 437 / 454 / 477 as pieces of 3 / 2 / 1 query heads
# (bench/sweep_tiles.py), so these run as pieces of one query head
PIECES_MIN_CV_ANY_SLICES = 1.0
# a simulated tail this close to longest-first's is not worth giving up L2 locality for (H200:
# at 8k varlen causal a band of 4, 4 % behind in the model, measured 318 TFLOP/s, tile-major 297)
TOLERANCE = 0.05


def band_order(n_tiles: int, n_heads: int, band: int) -> list[int]:
    """Program ids (``head * n_tiles + tile``) in launch order: heads ``[0, n_heads - band)``
    head-major, then the last ``band`` heads tile-major (each tile for every band head)."""
    if not 1 <= band <= n_heads:
        raise ValueError(f"band must be in [1, n_heads={n_heads}], got {band}")
    split = n_heads - band
    order = [h * n_tiles + t for h in range(split) for t in range(n_tiles)]
    order += [h * n_tiles + t for t in range(n_tiles) for h in range(split, n_heads)]
    return order


def list_schedule(costs: Iterable[float], free: list[float]) -> list[float]:
    """SM free times after running programs of ``costs`` in order on SMs free at ``free`` (a
    heap, updated in place and returned): each program starts on the SM that frees first."""
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return free


def list_queues(costs: Sequence[float], n_sms: int) -> list[list[int]]:
    """The list schedule of items ``0..len(costs)-1`` (in that order, item i costing ``costs[i]``)
    on ``n_sms`` SMs as one queue per SM: the items each SM starts, in start order. An item
    goes to the SM that frees first, the lowest-numbered of those free together; SMs left
    without an item get no queue (fewer items than SMs)."""
    if n_sms < 1:
        raise ValueError(f"n_sms must be positive, got {n_sms}")
    free = [(0.0, sm) for sm in range(min(n_sms, len(costs)))]
    queues: list[list[int]] = [[] for _ in free]
    for item, cost in enumerate(costs):
        t, sm = free[0]
        queues[sm].append(item)
        heapq.heapreplace(free, (t + cost, sm))
    return queues


def simulated_finish(order: Sequence[int], cost: Sequence[float], n_tiles: int, n_sms: int) -> float:
    """Finish time of launching programs ``order`` (ids ``head * n_tiles + tile``, each costing
    ``cost[tile]``) on ``n_sms`` SMs that each run one program at a time and take the next
    program when they free up (one resident backward program per SM: its shared memory)."""
    return max(list_schedule((cost[p % n_tiles] for p in order), [0.0] * n_sms))


def _candidate_bands(n_heads: int) -> list[int]:
    """Powers of two below ``n_heads``, then ``n_heads``. With 8 KV heads on the H200, bands of
    5, 6 and 7 heads measured 10-20 % below their neighbours at 8k/16k causal (not
    explained, not in the list-schedule model), bands of 1, 2, 4 and 8 never did."""
    bands, b = [], 1
    while b < n_heads:
        bands.append(b)
        b *= 2
    return bands + [n_heads]


def choose_band(costs: Sequence[float], n_heads: int, n_sms: int, tolerance: float = TOLERANCE) -> int:
    """The smallest band (1 = head-major) whose simulated finish is within ``tolerance`` of the
    longest-first order's (``band = n_heads``), for key tiles of ``costs`` (descending, the
    same for every head). Bands tried: 1, 2, 4, ... and ``n_heads``."""
    if n_sms < 1 or n_heads < 1:
        raise ValueError(f"n_sms and n_heads must be positive, got {n_sms}, {n_heads}")
    n_tiles = len(costs)
    if n_tiles == 0 or min(costs) == max(costs):  # equal tiles: every order finishes together
        return 1
    # no order finishes before the balanced load or the longest tile: a band this close to that
    # bound needs no longest-first simulation (long sequences: one simulation instead of two)
    bound = max(n_heads * sum(costs) / n_sms, max(costs))
    head_major = simulated_finish(band_order(n_tiles, n_heads, 1), costs, n_tiles, n_sms)
    if head_major <= (1 + tolerance) * bound:
        return 1
    longest_first = simulated_finish(band_order(n_tiles, n_heads, n_heads), costs, n_tiles, n_sms)
    for band in _candidate_bands(n_heads)[:-1]:
        finish = head_major if band == 1 else simulated_finish(band_order(n_tiles, n_heads, band), costs, n_tiles,
                                                                 n_sms)
        if finish <= (1 + tolerance) * longest_first:
            return band
    return n_heads


def tile_costs(work: Sequence[int], block_rows: int, overhead_blocks: float = TILE_OVERHEAD_BLOCKS) -> list[float]:
    """Per-tile cost in query blocks: each tile's visible query rows over ``block_rows``, plus a
    fixed ``overhead_blocks`` for its K/V load and dK/dV write-out."""
    return [w / block_rows + overhead_blocks for w in work]


Piece = tuple[int, int, int]  # (program id, first query head of the GQA group, end head)


def piece_cost(cost: float, heads: int, group: int) -> float:
    """Cost of a piece over ``heads`` of the ``group`` query heads of a program costing
    ``cost`` (``tile_costs``): its share of the program's blocks plus its own fixed cost."""
    return (cost - TILE_OVERHEAD_BLOCKS) * heads / group + PIECE_OVERHEAD_BLOCKS


def _finish_below(costs: Iterable[float], free: list[float], limit: float) -> float:
    """The list schedule's finish (as ``list_schedule``), or ``inf`` as soon as one program
    would end at or after ``limit`` (a candidate plan that cannot win)."""
    end = max(free)
    for c in costs:
        t = free[0] + c
        if t >= limit:
            return float("inf")
        heapq.heapreplace(free, t)
        end = max(end, t)
    return end


def split_tail(order: Sequence[int], cost: Sequence[float], n_tiles: int, n_sms: int, group: int,
               gain: float = SPLIT_GAIN) -> list[Piece]:
    """The launch as pieces ``(program, g_lo, g_hi)``: each program of ``order`` over its GQA
    group's query heads [0, group), except that the last K programs may run as pieces of s
    heads each, K half a wave, one or two waves (or all programs) and s a divisor of
    ``group``, whichever simulated finish is shortest, if it beats the unsplit launch's by
    ``gain``. A launch of fewer programs than SMs (a short context-parallel shard) splits
    them all.

    Equal programs leave the last wave part-empty: at 16k full, 1024 programs on 132 SMs are
    7.76 waves, and 24 % of the SMs idle through the eighth (3 % of the launch, in per-program traces).
    A piece of s heads costs ``piece_cost(cost, s, group)``."""
    whole = [(p, 0, group) for p in order]
    n = len(order)
    if group < 2 or n == 0:
        return whole
    costs = [cost[p % n_tiles] for p in order]
    k_max = min(n, 2 * n_sms)
    prefix = list_schedule(costs[: n - k_max], [0.0] * n_sms)  # the same for every candidate
    base = max(list_schedule(costs[n - k_max:], list(prefix)))
    # no plan finishes before the work spread evenly (a piece costs at least its share): when
    # that is within ``gain`` of the unsplit finish, nothing is worth simulating
    if sum(costs) / n_sms >= (1 - gain) * base:
        return whole
    best, best_plan = base * (1 - gain), None
    for k in sorted({max(1, n_sms // 2), n_sms, 2 * n_sms, n}):
        if k > n:
            continue
        free_k = list_schedule(costs[n - k_max: n - k], list(prefix))
        busy, tail = sum(free_k), sum(costs[n - k:]) - k * TILE_OVERHEAD_BLOCKS
        for s in (d for d in range(1, group) if group % d == 0):
            # bounds first: the SMs still busy, and the work spread evenly
            if max(max(free_k), (busy + tail + k * group // s * PIECE_OVERHEAD_BLOCKS) / n_sms) >= best:
                continue
            piece = (piece_cost(c, s, group) for c in costs[n - k:] for _ in range(group // s))
            finish = _finish_below(piece, list(free_k), best)
            if finish < best:
                best, best_plan = finish, (k, s)
    if best_plan is None:
        return whole
    k, s = best_plan
    return whole[: n - k] + [(p, g, g + s) for p in order[n - k:] for g in range(0, group, s)]


def head_chunk_pieces(n_tiles: int, n_heads: int, group: int, heads: int, band: int) -> list[Piece]:
    """The launch as pieces of ``heads`` query heads each (``heads`` dividing ``group``), ordered
    as ``band_order`` orders programs but over *virtual heads*, one per (KV head, chunk of
    ``heads`` query heads), KV-head-major: all tiles of KV head 0 over query heads
    [0, heads), then over [heads, 2 heads), ..., then KV head 1; the last ``band`` virtual
    heads tile-major. So the resident pieces share one query head's Q/dO/dQ rows even where
    the tiles differ in length (a causal mask's tiles drift apart across the GQA group's heads
    otherwise), at the price of every piece adding its dK/dV with atomics. ``band`` is
    chosen on the pieces' costs (``choose_band`` over ``n_heads * group // heads`` virtual
    heads): a piece is ``group // heads`` times shorter than a whole program, so head-major
    pieces finish with a short tail where whole programs needed tile-major order (8k causal)."""
    if heads < 1 or group % heads:
        raise ValueError(f"pieces of {heads} query heads must divide the GQA group of {group}")
    chunks = group // heads
    pieces: list[Piece] = []
    for v in band_order(n_tiles, n_heads * chunks, band):
        virtual_head, tile = divmod(v, n_tiles)
        kv_head, chunk = divmod(virtual_head, chunks)
        pieces.append((kv_head * n_tiles + tile, chunk * heads, (chunk + 1) * heads))
    return pieces


def auto_piece_heads(costs: Sequence[float], group: int, staircase_share: float, min_cv: float = PIECES_MIN_CV,
                     min_staircase: float = PIECES_MIN_STAIRCASE,
                     min_cv_any: float = PIECES_MIN_CV_ANY_SLICES) -> int:
    """Query heads per piece for a launch whose key tiles cost ``costs`` (0: whole programs),
    ``staircase_share`` of whose mask area is in causal / inv_causal slices.

    Key tiles of one staircase slice see different numbers of query rows, so whole programs of
    neighbouring tiles drift apart over the GQA group's query heads and the resident programs
    read many heads' Q/dO/dQ rows: 16k causal moves 29.5 KB of DRAM per step against 2-3 KB on
    the full mask. Pieces over a chunk of the group, each KV head's tiles over one chunk
    before the next, keep them on one chunk. The chunk is the group split in its smallest
    factor (6 -> 2 chunks of 3). Measured on an H100, against whole programs:
    * causal: x1.38 / 1.09 / 1.06 at 8k / 16k / 32k;
    * packed causal documents: x1.08 / 1.02 / 1.09;
    * packed full documents and block-causal documents (full slices: every tile of a document
      walks its heads in step; the tiles differ only between documents, whose rows are few and
      disjoint): x0.94-1.00, so they stay whole programs, as do equal tiles (full, sliding
      window), which pay a piece's fixed cost for nothing;
    * a shared prefix (full slices onto the prefix, causal documents; cv above ``min_cv_any``:
      the prefix's tiles see every row, the documents' tiles a few): x1.39 / 1.44 / 1.51 at 16k
      with pieces of 3 / 2 / 1 query heads, so such launches run as pieces of one head."""
    if group < 2 or len(costs) < 2:
        return 0
    mean = sum(costs) / len(costs)
    cv = (sum((c - mean) ** 2 for c in costs) / len(costs)) ** 0.5 / mean if mean > 0 else 0.0
    if cv > min_cv_any:  # one query head per piece: measured fastest there (above)
        return 1
    if staircase_share < min_staircase or cv <= min_cv:
        return 0
    factor = next(f for f in range(2, group + 1) if group % f == 0)
    return group // factor
