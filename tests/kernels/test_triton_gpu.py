"""Triton backend on a GPU against the float64 dense reference (skipped without a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases import mask_cases
from magi_kernels import KernelConfig, flex_flash_attn_func, plan_attention
from magi_kernels.testing import dense_attention, dense_mask
from magi_solver import slice_ranges

pytestmark = pytest.mark.gpu


def _ragged_cases():
    cases = dict(mask_cases())
    # sizes that are not multiples of the 64/128 tiles, empty slices, long overlap chains
    cases["ragged_big"] = ([(0, 300, 0, 300, 1), (300, 777, 0, 301, 0), (300, 777, 301, 777, 1),
                            (777, 1000, 700, 1000, 3), (500, 500, 0, 10, 0), (0, 0, 5, 9, 1)], 1000)
    cases["inv_causal_tall"] = ([(0, 513, 0, 200, 2), (0, 513, 200, 260, 1)], 513)
    return cases


@pytest.mark.parametrize("case", list(_ragged_cases()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (8, 1, 128), (2, 2, 128), (2, 1, 256), (2, 1, 192), (4, 2, 96)])
def test_triton_matches_dense(case, dtype, hq, hk, d):
    _check_against_dense(case, dtype, hq, hk, d)


@pytest.mark.parametrize("dq_mode", ["split", "atomic", "tma"])
@pytest.mark.parametrize("case", list(_ragged_cases()))
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (8, 1, 128)])
def test_triton_dq_mode_matches_dense(dq_mode, case, hq, hk, d):
    """Each way of computing dQ (own programs; added by the dK/dV programs through pointer
    atomics or TMA reduce-adds), whichever is the default."""
    if dq_mode == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm90+")
    _check_against_dense(case, torch.bfloat16, hq, hk, d, KernelConfig(dq_mode=dq_mode))


def _plan(q, k, ranges, config: KernelConfig | None = None):
    """The plan a call on these inputs runs (which kernels: Gluon on sm90 at d=128)."""
    return plan_attention(*ranges, q.shape[0], k.shape[0], (q.shape[1], k.shape[1]), q.shape[-1], q.dtype, config,
                          q.device)


def _check_against_dense(case, dtype, hq, hk, d, config: KernelConfig | None = None):
    slices, S = _ragged_cases()[case]
    torch.manual_seed(0)
    q, k, v = (torch.randn(S, h, d, device="cuda", dtype=dtype, requires_grad=True) for h in (hq, hk, hk))
    out, lse = flex_flash_attn_func(q, k, v, [s[:2] for s in slices], [s[2:4] for s in slices],
                                    [s[4] for s in slices], backend="triton", kernel_config=config)
    g = torch.randn_like(out, dtype=torch.float64)
    (out.double() * g).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = dense_attention(q64, k64, v64, dense_mask(slices, S, S, device="cuda"))
    (ro * g).sum().backward()
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    # bf16/fp16 products with fp32 accumulation: compare to fp64 of the same rounded inputs;
    # error is dominated by rounding P (and dS) to 16 bits before the second matmul
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[fin], rl[fin], atol=tol, rtol=tol)
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        scale = b.abs().max().clamp(min=1)
        assert ((a.double() - b).abs().max() / scale) < 4 * tol


def test_triton_softcap_and_dist_path_agree_with_torch_backend():
    slices, S = mask_cases()["mixed_overlapping"]
    torch.manual_seed(1)
    q, k, v = (torch.randn(S, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    args = ([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices])
    a, la = flex_flash_attn_func(q, k, v, *args, softcap=3.0, backend="triton")
    b, lb = flex_flash_attn_func(q, k, v, *args, softcap=3.0, backend="torch")
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(lb)
    torch.testing.assert_close(la[fin], lb[fin], atol=1e-2, rtol=1e-2)


def _documents(lengths: list[int], mask_type: int) -> list[tuple[int, int, int, int, int]]:
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    return [(a, b, a, b, mask_type) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("d", [64, 128])
def test_new_mask_runs_without_host_sync(d):
    """A mask the caches have not seen, with its ranges as CPU tensors: the tile tables are built
    on the host and uploaded without waiting for the device, forward and backward (torch's sync
    debug mode raises on any sync). Then the results of that run are checked against the dense
    reference, so a table read before its upload landed would fail too. d=128 runs the Gluon
    kernels on sm90, d=64 the Triton ones."""
    S, hq, hk = 1000, 8, 2
    torch.manual_seed(2)
    q, k, v = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk))
    g = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16)

    def run(slices):
        for t in (q, k, v):
            t.grad = None
        ranges = ([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices])
        out, lse = flex_flash_attn_func(q, k, v, *(torch.tensor(r, dtype=torch.int32) for r in ranges),
                                        backend="triton")
        out.backward(g)
        return out, lse

    run(_documents([137, 389, 474], 1))  # compiles the kernels (not what is under test)
    slices = _documents([211, 522, 158, 109], 1) + [(900, 1000, 0, 211, 0)]  # unseen: the caches miss
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = run(slices)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = dense_attention(q64, k64, v64, dense_mask(slices, S, S, device="cuda"))
    ro.backward(g.double())
    tol = 2e-2  # bf16 inputs, P and dS rounded to bf16 before the second matmul
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), rl, atol=tol, rtol=tol)
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert ((a.double() - b).abs().max() / b.abs().max().clamp(min=1)) < 4 * tol


def test_triton_token_offsets_beyond_int32():
    """q has more than 2**31 elements: rows near the end must address memory with 64-bit
    offsets. Sliding-window causal keeps it cheap; with the output gradient non-zero only on
    rows [a, b), every gradient equals that of the cropped problem (keys [a - w, b))."""
    hq, hk, d, w = 16, 2, 128, 64
    S = (1 << 31) // (hq * d) + 4096
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs ~40 GiB of GPU memory")
    torch.manual_seed(0)
    q, k, v = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk))
    from magi_solver import AttnRange
    from magi_solver.mask_builders import sliding_window_slices

    def window(n):
        return sliding_window_slices(AttnRange(0, n), AttnRange(0, n), (w - 1, 0))

    sl = window(S)
    qr, kr, tm = slice_ranges(sl)
    out, lse = flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton")
    a, b = S - 3000, S - 2000
    g = torch.zeros_like(out)
    g[a:b] = torch.randn(b - a, hq, d, device="cuda", dtype=out.dtype)
    out.backward(g)
    lo = a - w
    qc, kc, vc = (t.detach()[lo:b].clone().requires_grad_() for t in (q, k, v))
    slc = window(b - lo)
    oc, lc = flex_flash_attn_func(qc, kc, vc, *slice_ranges(slc), backend="torch")
    oc.backward(g[lo:b])
    torch.testing.assert_close(out[a:b].float(), oc[a - lo:].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[a:b], lc[a - lo:], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.grad[a:b].float(), qc.grad[a - lo:].float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(k.grad[lo:b].float(), kc.grad.float(), atol=5e-2, rtol=5e-2)
    assert q.grad[:lo].abs().max() == 0 and k.grad[b:].abs().max() == 0


# as if the GPU had more SMs than a launch has (tile, head) items: the persistent Gluon forward
# then runs one item per program (``program_order.list_queues``), the bitwise reference
ONE_ITEM_PER_PROGRAM = 1 << 30


@pytest.mark.parametrize("cfg", ["", "128,128,2,1,0", "128,128,2,2,1", "128,128,2,2,0", "128,64,3,2,1", "sms3",
                                 "sms3_parts1"])
@pytest.mark.parametrize("case", list(_ragged_cases()))
def test_gluon_forward_matches_dense(case, cfg, monkeypatch):
    """The warp-specialised Gluon forward (the default on sm90 at d=128; persistent: one program
    per SM over a queue of (tile, head) items) in each consumer layout and ring depth, and as if
    on 3 SMs (``sms3``: every program runs a queue of many tiles of different lengths), against
    the float64 reference; the Triton forward must agree, and the launch must give the same bits
    as one program per item (each item runs the same instructions wherever it is queued)."""
    from magi_kernels import gluon_common

    tiles = None
    if cfg.endswith("parts1"):
        tiles = (128, 128, 2, 1, 0)
    elif cfg and not cfg.startswith("sms"):
        tiles = tuple(int(x) for x in cfg.split(","))
    config = KernelConfig(gluon_fwd_tiles=tiles)
    if cfg.startswith("sms3"):
        monkeypatch.setattr(gluon_common, "sm_count", lambda device: 3)  # (plans are keyed by the SM count)
    slices, S = _ragged_cases()[case]
    torch.manual_seed(2)
    q, k, v = (torch.randn(S, h, 128, device="cuda", dtype=torch.bfloat16) for h in (6, 2, 2))
    args = ([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices])
    if _plan(q, k, args, config).forward.kernel != "gluon":
        pytest.skip("the Gluon forward needs sm90")
    out, lse = flex_flash_attn_func(q, k, v, *args, backend="triton", kernel_config=config)
    ro, rl = dense_attention(q.double(), k.double(), v.double(), dense_mask(slices, S, S, device="cuda"))
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(out.double(), ro, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double()[fin], rl[fin], atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(gluon_common, "sm_count", lambda device: ONE_ITEM_PER_PROGRAM)
    out_1, lse_1 = flex_flash_attn_func(q, k, v, *args, backend="triton", kernel_config=config)
    assert torch.equal(out, out_1) and torch.equal(lse, lse_1)
    out_t, lse_t = flex_flash_attn_func(q, k, v, *args, backend="triton", kernel_config=KernelConfig(gluon_fwd=False))
    torch.testing.assert_close(out.float(), out_t.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[fin], lse_t[fin], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("mask", ["causal", "sliding_window", "varlen_causal"])
def test_gluon_forward_persistent_is_bitwise_per_tile(mask, monkeypatch):
    """At the bench's shape (8k tokens, 48 / 8 heads: 3072 (tile, head) items, about 23 per
    SM) the persistent forward gives the same bits as one program per item, and both agree
    with the float64 reference on some rows."""
    from magi_attn.masks import make_mask

    from magi_kernels import gluon_common

    S, hq, hk = 8192, 48, 8
    ranges = slice_ranges(make_mask(mask, S, seed=0))
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in ranges)
    torch.manual_seed(3)
    q, k, v = (torch.randn(S, h, 128, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    if _plan(q, k, (qr, kr, tm)).forward.kernel != "gluon":
        pytest.skip("the Gluon forward needs sm90")
    out, lse = flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton")
    monkeypatch.setattr(gluon_common, "sm_count", lambda device: ONE_ITEM_PER_PROGRAM)
    out_1, lse_1 = flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton")
    assert torch.equal(out, out_1) and torch.equal(lse, lse_1)
    rows = slice(S - 512, S)  # the last rows, against the reference over all keys (first 4 heads)
    mask_rows = dense_mask([(*a, *b, t) for a, b, t in zip(*ranges)], S, S, device="cuda")[rows]
    ro, _ = dense_attention(q[rows, :4].double(), k[:, :1].double(), v[:, :1].double(), mask_rows)
    torch.testing.assert_close(out[rows, :4].double(), ro, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rotate,order", [("0", "head"), ("1", "auto"), ("1", "head"), ("1", "tile")])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("case", list(_ragged_cases()))
def test_gluon_backward_matches_dense(case, softcap, rotate, order):
    """The warp-specialised Gluon backward (dK, dV and dQ in one pass; the default on sm90 at
    d=128) against the float64 reference, GQA group of 3, with either query-block order and
    either program order; the Triton backward must agree."""
    config = KernelConfig(bwd_rotate=rotate == "1", bwd_order=order)
    _check_gluon_backward(*_ragged_cases()[case], 6, 2, softcap, config)


def _other_ring_depths() -> list[str]:
    """Gluon backward configs (BM,BN,STAGES) of the Q/dO ring depths other than the default."""
    bm, bn, stages = KernelConfig().gluon_bwd_for(128)
    return [f"{bm},{bn},{s}" for s in (2, 3) if s != stages]


@pytest.mark.parametrize("cfg", _other_ring_depths())
@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("case", list(_ragged_cases()))
def test_gluon_backward_ring_depth_matches_dense(case, softcap, cfg):
    """The Gluon backward with the Q/dO ring depth that is not the default (a ring slot is
    reused at a different block distance: a wrong phase or an early release shows here)."""
    config = KernelConfig(gluon_bwd_tiles=tuple(int(x) for x in cfg.split(",")))
    _check_gluon_backward(*_ragged_cases()[case], 6, 2, softcap, config)


@pytest.mark.parametrize("case", list(_ragged_cases()))
def test_gluon_backward_unsplit_matches_dense(case):
    """``bwd_split_tail=False`` and ``bwd_piece_heads=0``: every program over its whole
    GQA group, dK/dV stored (these small launches otherwise run as pieces with added dK/dV)."""
    config = KernelConfig(bwd_split_tail=False, bwd_piece_heads=0)
    _check_gluon_backward(*_ragged_cases()[case], 6, 2, 0.0, config)


@pytest.mark.parametrize("add", ["atomic", "tma"])
@pytest.mark.parametrize("case", list(_ragged_cases()))
def test_gluon_backward_head_pieces_match_dense(case, add):
    """``bwd_piece_heads=1``: every program as one-query-head pieces, each KV head's tiles
    over one query head before the next, dK/dV added by atomics or by TMA reduce-adds of whole
    [64, 64] boxes (rows past a tile's keys add zeros, ragged tiles end mid-box)."""
    config = KernelConfig(bwd_piece_heads=1, bwd_piece_add=add)
    _check_gluon_backward(*_ragged_cases()[case], 6, 2, 0.0, config)


@pytest.mark.parametrize("case", list(_ragged_cases()))
def test_gluon_backward_auto_pieces_of_several_heads_match_dense(case):
    """The default ``bwd_piece_heads=None`` (auto) with a GQA group of 6: mostly causal launches
    of unequal key tiles run as pieces of 3 query heads with TMA dK/dV adds
    (``program_order.auto_piece_heads``), the others as whole programs."""
    _check_gluon_backward(*_ragged_cases()[case], 12, 2, 0.0, KernelConfig())


PIECE_VARIANTS = {"tail": {"bwd_piece_heads": 0},
                  "tail_tma": {"bwd_piece_heads": 0, "bwd_piece_add": "tma"},
                  "all_tma": {"bwd_piece_heads": 1, "bwd_piece_add": "tma"},
                  "auto": {}}


@pytest.mark.parametrize("variant", list(PIECE_VARIANTS))
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_gluon_backward_mixed_pieces_match_whole_programs(mask, variant, monkeypatch):
    """A launch just over one wave (76 key tiles x 2 KV heads on the H200's 132 SMs): the full
    mask's plan runs the first programs whole and the rest as pieces, the causal one splits
    every program. The fp32 gradients (``ffa_backward`` itself: rounding them to bf16 would
    turn a last-bit difference of a causal mask's large early-key dK into a bf16 ulp) must
    match the unsplit launch's up to fp32 summation order (dQ and the pieces' dK/dV are
    atomic adds), relative to each gradient's largest entry."""
    from magi_kernels import triton_backend as tb

    S, d = 76 * 128, 128
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in ([[0, S]], [[0, S]], [0 if mask == "full" else 1]))
    torch.manual_seed(4)
    q, k, v = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16) for h in (6, 2, 2))
    do = torch.randn(S, 6, d, device="cuda", dtype=torch.bfloat16)
    if _plan(q, k, (qr, kr, tm)).backward.kernel != "gluon":
        pytest.skip("the Gluon backward needs sm90")
    out, lse = tb.ffa_forward(q, k, v, qr, kr, tm, d ** -0.5, 0.0)
    grads = {}
    for split in ("1", "0"):
        # the reference ("0"): whole programs everywhere (no per-launch pieces either)
        config = (KernelConfig(**PIECE_VARIANTS[variant]) if split == "1" else
                  KernelConfig(bwd_split_tail=False, bwd_piece_heads=0))
        plan = _plan(q, k, (qr, kr, tm), config)
        grads[split] = tb.ffa_backward(do, q, k, v, out, lse, torch.zeros_like(lse), qr, kr, tm, d ** -0.5, 0.0,
                                       config, plan)
        heads = plan.backward.orders[0][0][:, 1].cpu()  # the launch's pieces: (program, g_lo | g_hi << 16)
        n_heads = (heads >> 16) - (heads & 0xFFFF)
        if split == "0":
            assert (n_heads == 3).all()
        elif variant == "all_tma":
            assert (n_heads == 1).all()
        else:  # full: 152 equal programs, the first whole; causal: all split (program_order's plan)
            assert (n_heads < 3).any() and ((n_heads == 3).any() or mask == "causal"), "no split in the plan"
    for name, a, b in zip("qkv", grads["1"], grads["0"]):
        assert a.dtype == torch.float32
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-4, f"d{name}: split vs whole, relative max difference {err:.3g}"


@pytest.mark.parametrize("order", ["2", "4", "tile"])
@pytest.mark.parametrize("case", ["ragged_big", "causal"])
def test_gluon_backward_banded_launch_orders_match_dense(case, order):
    """Launch orders that mix head-major and tile-major heads (``program_order``), with 8 KV
    heads so that bands of 2 and 4 are real mixtures."""
    config = KernelConfig(bwd_order=int(order) if order.isdigit() else order)
    _check_gluon_backward(*_ragged_cases()[case], 16, 8, 0.0, config)


def _check_gluon_backward(slices, S, hq, hk, softcap, config: KernelConfig):
    """The Gluon backward against the float64 reference and the Triton backward (d=128, bf16)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(S, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk))
    g = torch.randn(S, hq, 128, device="cuda", dtype=torch.bfloat16)
    args = ([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices])
    if _plan(q, k, args, config).backward.kernel != "gluon":
        pytest.skip("the Gluon backward needs sm90")
    out, _ = flex_flash_attn_func(q, k, v, *args, softcap=softcap, backend="triton", kernel_config=config)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = dense_mask(slices, S, S, device="cuda")
    ro, _ = dense_attention(q64, k64, v64, mask, softcap=softcap)
    ref = torch.autograd.grad(ro, (q64, k64, v64), g.double())
    for name, a, b in zip("qkv", grads, ref):
        err = ((a.double() - b).abs().max() / b.abs().max().clamp(min=1)).item()
        assert err < 8e-2, f"d{name}: relative max error {err:.3g}"  # bf16 P/dS rounding, as above
    triton_bwd = dataclasses.replace(config, gluon_bwd=False)
    out_t, _ = flex_flash_attn_func(q, k, v, *args, softcap=softcap, backend="triton", kernel_config=triton_bwd)
    for name, a, b in zip("qkv", grads, torch.autograd.grad(out_t, (q, k, v), g)):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2, msg=f"d{name} vs Triton")


@pytest.mark.parametrize("case", ["varlen_block_causal", "mixed_overlapping"])
@pytest.mark.parametrize("d,dv,sink_shape", [(128, 128, (8,)), (192, 128, None), (192, 128, (8,)), (64, 128, (2, 8))])
def test_triton_sinks_and_value_head_dim(case, d, dv, sink_shape):
    """GPT-OSS sinks and MLA's 192/128 head dims through the GPU kernels, fwd and bwd (the sink's
    gradient too), against float64 dense of the same rounded inputs."""
    slices, S = _ragged_cases()[case]
    torch.manual_seed(1)
    q, k = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2))
    v = torch.randn(S, 2, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = None if sink_shape is None else torch.randn(sink_shape, device="cuda", requires_grad=True)
    out, lse = flex_flash_attn_func(q, k, v, [s[:2] for s in slices], [s[2:4] for s in slices],
                                    [s[4] for s in slices], backend="triton", sink=sink)
    g = torch.randn_like(out, dtype=torch.float64)
    (out.double() * g).sum().backward()
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_sink = None if sink is None else sink.detach().double().requires_grad_()
    ro, rl = dense_attention(*ref_in, dense_mask(slices, S, S, device="cuda"), sink=ref_sink)
    (ro * g).sum().backward()
    tol = 2e-2
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    fin = torch.isfinite(rl)
    torch.testing.assert_close(lse.double()[fin], rl[fin], atol=tol, rtol=tol)
    grads = [(q.grad, ref_in[0].grad), (k.grad, ref_in[1].grad), (v.grad, ref_in[2].grad)]
    if sink is not None:  # a sum over every row of the sequence: compared relative to its size, as the others
        grads.append((sink.grad, ref_sink.grad))
    for a, b in grads:
        scale = b.abs().max().clamp(min=1)
        assert ((a.double() - b).abs().max() / scale) < 4 * tol
