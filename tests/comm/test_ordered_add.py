"""Ordered row adds (magi_comm.row_layers / add_rows), which the deterministic GroupReduce of dK/dV
uses: the layers partition the positions, the sum equals index_add, and on a GPU repeated runs
are bitwise equal (CPU adds are ordered anyway)."""

from __future__ import annotations

import pytest
import torch


def _rows(n: int, out_rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, out_rows, (n,), generator=g)


def test_row_layers_partition_positions_into_distinct_rows():
    from magi_comm import row_layers

    rows = _rows(200, 17, 0)
    layers = row_layers(rows)
    seen = torch.cat([pos for pos, _ in layers])
    assert sorted(seen.tolist()) == list(range(200)), "every position in exactly one layer"
    for j, (pos, r) in enumerate(layers):
        assert torch.equal(r, rows[pos])
        assert r.unique().numel() == r.numel(), f"layer {j} repeats a row"
        assert pos.tolist() == sorted(pos.tolist()), "buffer order inside a layer"
    # layer j holds each row's j-th occurrence in buffer order
    for row in rows.unique().tolist():
        where = torch.nonzero(rows == row).flatten().tolist()
        for j, p in enumerate(where):
            assert p in layers[j][0].tolist()
    assert row_layers(torch.empty(0, dtype=torch.long)) == []


def test_ordered_add_equals_index_add():
    from magi_comm import add_rows

    rows = _rows(300, 23, 1)
    src = torch.randn(300, 3, 5, dtype=torch.float64)
    base = torch.randn(23, 3, 5, dtype=torch.float64)
    ref = base.clone().index_add_(0, rows, src)
    got = add_rows(base.clone(), rows, src, ordered=True, rows_host=rows)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="rows_host"):
        add_rows(base.clone(), rows, src, ordered=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ordered_add_is_bitwise_reproducible_on_gpu():
    from magi_comm import add_rows

    rows = _rows(1 << 16, 512, 2)  # ~128 contributions per row: atomics race
    src = torch.randn(1 << 16, 8, 128, device="cuda")
    rows_d = rows.cuda()
    outs = [add_rows(torch.zeros(512, 8, 128, device="cuda"), rows_d, src, ordered=True, rows_host=rows)
            for _ in range(5)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "ordered adds differ between runs"
    ref = torch.zeros(512, 8, 128, dtype=torch.float64, device="cuda").index_add_(0, rows_d, src.double())
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-3, rtol=1e-5)
