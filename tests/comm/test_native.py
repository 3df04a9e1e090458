"""The magi_comm native extension (when built) matches the pure-Python paths."""

import pytest
import torch

from magi_comm import native
from magi_comm.index_plan import _cast_index_plan_py

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native extension not built: {native.REASON}")


@pytest.mark.parametrize("seed", range(5))
def test_index_plan_matches_python(seed):
    g = torch.Generator().manual_seed(seed)
    world = 4
    n = 12
    sizes = torch.randint(0, 6, (n,), generator=g).tolist()
    dsts = [tuple(r for r in range(world) if torch.rand(1, generator=g) < 0.4) for _ in range(n)]
    out_sizes = torch.randint(0, 6, (n,), generator=g).tolist()
    src = torch.randint(0, world, (n,), generator=g).tolist()
    py = _cast_index_plan_py(sizes, dsts, out_sizes, src, world)
    nat = native.cast_index_rows(sizes, dsts, out_sizes, src, world)
    assert torch.equal(py.send_rows, nat[0]) and py.send_counts == nat[1]
    assert torch.equal(py.recv_rows, nat[2]) and py.recv_counts == nat[3]


def test_native_rank_check():
    with pytest.raises(ValueError, match="names rank 5"):
        native.cast_index_rows([3], [[5]], [3], [0], 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_range_gather_cuda(dtype):
    assert native.WITH_CUDA
    x = torch.randn(100, 3, 8, device="cuda").to(dtype)
    idx = torch.randint(0, 100, (57,))
    assert torch.equal(native.range_gather(x, idx), x[idx.cuda()])
