"""The magi_kernels native extension (when built): its tile tables match the pure-Python ones."""

import pytest
import torch


def test_kernel_tile_tables_match_python():
    from magi_kernels import tiles

    if tiles._native is None:
        pytest.skip("magi_kernels native extension not built")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        raw = torch.randint(0, 300, (15, 4), generator=g)
        slices = tuple((min(a, b), max(a, b), min(c, d), max(c, d), int(t))
                       for (a, b, c, d), t in zip(raw.tolist(), torch.randint(0, 4, (15,), generator=g).tolist()))
        for axis, block in ((0, 64), (2, 128), (0, 7)):
            nat = tiles._native.tiles(list(slices), axis, block)
            ref = tiles.slice_layers(slices, axis, block)
            assert len(nat) == len(ref)
            for (sid, start, n), layer in zip(nat, ref):
                want = [(i, b) for i in layer for b in range(slices[i][axis], slices[i][axis + 1], block)]
                got = list(zip(torch.frombuffer(bytearray(sid), dtype=torch.int32).tolist() if n else [],
                               torch.frombuffer(bytearray(start), dtype=torch.int32).tolist() if n else []))
                assert got == want
