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
    """Equal tiles: no tail to fix, so L2 locality wins (v10's head order)."""
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
