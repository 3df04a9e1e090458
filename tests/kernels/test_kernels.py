"""flex_flash_attn_func (torch backend) against the float64 dense reference, and its errors."""

from __future__ import annotations

import pytest
import torch

from cases import mask_cases
from magi_kernels import flex_flash_attn_func, merge_out_lse
from magi_kernels.testing import dense_attention, dense_mask

# fp64: summation order only. fp32: ~1e-6 relative on O(1) values; bf16 inputs are compared
# against the fp64 result of the *same rounded inputs*, so only the kernel's fp32 accumulation
# and the final bf16 rounding of out (2^-8 relative) remain.
TOLS = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _inputs(S, hq, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, h, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hk, hk)]


def _run(slices, S, dtype, hq=4, hk=2, d=16, softcap=0.0):
    q, k, v = (t.requires_grad_() for t in _inputs(S, hq, hk, d, dtype))
    out, lse = flex_flash_attn_func(q, k, v, [s[:2] for s in slices], [s[2:4] for s in slices],
                                    [s[4] for s in slices], softcap=softcap, backend="torch")
    g = torch.Generator().manual_seed(1)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    fin = torch.isfinite(lse)
    ((out.double() * g_out).sum() + torch.where(fin, lse.double() * g_lse, 0).sum()).backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = dense_attention(q64, k64, v64, dense_mask(slices, S, S), softcap=softcap)
    rfin = torch.isfinite(rl)
    ((ro * g_out).sum() + torch.where(rfin, rl * g_lse, 0).sum()).backward()
    tol = TOLS[dtype]
    assert torch.equal(fin, rfin)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[fin], rl[fin], atol=tol, rtol=tol)
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(a.double(), b, atol=tol * 4, rtol=tol * 4)
    assert (out[~fin.all(-1)] == 0).all()


@pytest.mark.parametrize("case", list(mask_cases()))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kernel_matches_dense(case, dtype):
    slices, S = mask_cases()[case]
    _run(slices, S, dtype)


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (3, 1)])
def test_gqa_and_softcap(hq, hk):
    slices, S = mask_cases()["mixed_overlapping"]
    _run(slices, S, torch.float64, hq=hq, hk=hk, softcap=1.5)


def test_empty_slices_and_no_slices():
    q, k, v = _inputs(10, 2, 2, 8, torch.float64)
    out, lse = flex_flash_attn_func(q, k, v, [(0, 0), (3, 5)], [(0, 0), (5, 5)], backend="torch")
    assert (out == 0).all() and torch.isinf(lse).all()


def test_accumulate_into_previous_result_equals_one_call():
    slices, S = mask_cases()["varlen_causal"]
    q, k, v = _inputs(S, 4, 2, 8, torch.float64)
    qr, kr, tm = [s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices]
    full_o, full_l = flex_flash_attn_func(q, k, v, qr, kr, tm, backend="torch")
    half = len(slices) // 2
    o1, l1 = flex_flash_attn_func(q, k, v, qr[:half], kr[:half], tm[:half], backend="torch")
    o1c, l1c = o1.clone(), l1.clone()
    o2, l2 = flex_flash_attn_func(q, k, v, qr[half:], kr[half:], tm[half:], out=o1, lse=l1, backend="torch")
    assert torch.equal(o1, o1c) and torch.equal(l1, l1c), "accumulators must not be mutated"
    torch.testing.assert_close(o2, full_o, atol=1e-12, rtol=0)
    torch.testing.assert_close(l2, full_l, atol=1e-12, rtol=0)


def test_merge_out_lse_handles_empty_rows():
    o = torch.randn(3, 1, 2, dtype=torch.float64)
    l = torch.tensor([[0.5], [float("-inf")], [float("-inf")]], dtype=torch.float64)
    o2 = torch.randn(3, 1, 2, dtype=torch.float64)
    l2 = torch.tensor([[float("-inf")], [1.0], [float("-inf")]], dtype=torch.float64)
    mo, ml = merge_out_lse(torch.where(torch.isinf(l)[..., None], 0, o), l, torch.where(torch.isinf(l2)[..., None], 0, o2), l2)
    torch.testing.assert_close(mo[0], o[0])
    torch.testing.assert_close(mo[1], o2[1])
    assert (mo[2] == 0).all() and torch.isinf(ml[2]).all() and not torch.isnan(mo).any()


def test_torch_compile():
    slices, S = mask_cases()["causal"]
    q, k, v = _inputs(S, 2, 1, 8, torch.float32)
    qr = torch.tensor([s[:2] for s in slices], dtype=torch.int32)
    kr = torch.tensor([s[2:4] for s in slices], dtype=torch.int32)
    tm = torch.tensor([s[4] for s in slices], dtype=torch.int32)

    def f(q, k, v):
        return flex_flash_attn_func(q, k, v, qr, kr, tm, backend="torch", check_ranges=False)[0].sum()

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    compiled = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(torch.autograd.grad(compiled, (q, k, v)), eager_grads):  # the op's autograd
        torch.testing.assert_close(got, want)


def test_eager_calls_skip_the_dispatcher():
    """Eager calls run through ``_EagerFFA`` (no custom-op dispatch: host time per call), graphs
    record the op; gradients of the eager path are checked against dense in test_kernel_matches_dense."""
    slices, S = mask_cases()["causal"]
    q, k, v = (t.requires_grad_() for t in _inputs(S, 2, 1, 8, torch.float32))
    out, lse = flex_flash_attn_func(q, k, v, [s[:2] for s in slices], [s[2:4] for s in slices],
                                    [s[4] for s in slices], backend="torch")
    assert "_EagerFFA" in out.grad_fn.name() and lse.grad_fn is out.grad_fn


def test_run_forward_backward_skip_the_op_in_eager_and_record_it_in_graphs(monkeypatch):
    """``run_forward`` / ``run_backward`` (the context-parallel stages' calls) run the op's body
    in eager mode and the op itself under torch.compile, with the same results."""
    from magi_kernels import interface, run_backward, run_forward

    slices, S = mask_cases()["causal"]
    q, k, v = _inputs(S, 2, 1, 8, torch.float32)
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in ([s[:2] for s in slices], [s[2:4] for s in slices],
                                                                [s[4] for s in slices]))
    out, lse = interface.ffa_fwd(q, k, v, qr, kr, tm, 0.5, 0.0, "torch", True)
    do, dlse = torch.randn_like(out), torch.zeros_like(lse)
    grads = interface.ffa_bwd(do, q, k, v, out, lse, dlse, qr, kr, tm, 0.5, 0.0, "torch")

    def compiled_fwd(q, k, v):
        return run_forward(q, k, v, qr, kr, tm, 0.5, 0.0, "torch", True)

    got = torch.compile(compiled_fwd, backend="eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, (out, lse))

    def no_dispatch(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(interface, "ffa_fwd", no_dispatch)
    monkeypatch.setattr(interface, "ffa_bwd", no_dispatch)
    torch.testing.assert_close(run_forward(q, k, v, qr, kr, tm, 0.5, 0.0, "torch", True), (out, lse))
    for got, want in zip(run_backward(do, q, k, v, out, lse, dlse, qr, kr, tm, 0.5, 0.0, "torch"), grads):
        torch.testing.assert_close(got, want)


class TestErrors:
    def test_messages(self):
        q, k, v = _inputs(8, 4, 2, 8, torch.float32)
        with pytest.raises(ValueError, match="multiple of num_heads_kv"):
            flex_flash_attn_func(q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), [(0, 8)], [(0, 8)])
        with pytest.raises(TypeError, match="share a dtype"):
            flex_flash_attn_func(q, k.double(), v, [(0, 8)], [(0, 8)])
        with pytest.raises(ValueError, match=r"k_ranges\[0\]"):
            flex_flash_attn_func(q, k, v, [(0, 8)], [(0, 9)])
        with pytest.raises(ValueError, match="slices but k_ranges"):
            flex_flash_attn_func(q, k, v, [(0, 8)], [(0, 8), (0, 1)])
        with pytest.raises(ValueError, match="unknown mask type 7"):
            flex_flash_attn_func(q, k, v, [(0, 8)], [(0, 8)], [7])
        with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
            flex_flash_attn_func(q[0], k, v, [(0, 8)], [(0, 8)])
        with pytest.raises(TypeError, match="dtype torch.int32"):
            flex_flash_attn_func(q.int(), k.int(), v.int(), [(0, 8)], [(0, 8)])
        with pytest.raises(ValueError, match="backend='triton' cannot run"):
            flex_flash_attn_func(q, k, v, [(0, 8)], [(0, 8)], backend="triton")
        with pytest.raises(ValueError, match="both out and lse"):
            flex_flash_attn_func(q, k, v, [(0, 8)], [(0, 8)], out=torch.zeros_like(q))


def test_gpu_backend_metadata_memo_tracks_in_place_changes():
    from magi_kernels import tiles

    qr = torch.tensor([[0, 4], [4, 8]], dtype=torch.int32)
    kr, tm = qr.clone(), torch.tensor([1, 0], dtype=torch.int32)
    first = tiles.host_slices(qr, kr, tm)
    assert tiles.host_slices(qr, kr, tm) is first
    kr[1, 1] = 6  # in place: must not serve the stale table
    assert tiles.host_slices(qr, kr, tm) == ((0, 4, 0, 4, 1), (4, 8, 4, 6, 0))


def test_host_cache_reads_a_tensor_once_per_object_and_version():
    from magi_kernels.host_cache import per_tensor

    calls = []
    t = torch.tensor([0, 3, 7])

    def read():
        calls.append(1)
        return t.tolist()

    assert per_tensor(t, "cu", read) == [0, 3, 7]
    assert per_tensor(t, "cu", read) == [0, 3, 7] and len(calls) == 1
    t[1] = 4  # in-place change: a new version is read again
    assert per_tensor(t, "cu", read) == [0, 4, 7] and len(calls) == 2
    u = t.clone()  # another object with equal values is another entry
    assert per_tensor(u, "cu", lambda: "other") == "other"


def test_triton_tile_tables_longest_first_and_row_coverage():
    """Host side of the Triton backend (runs without a GPU): tiles of a layer are ordered by
    descending work, and the 'layer 0 writes every row' flag that lets outputs skip their zero
    fill is exact (a wrong True would leave uninitialised rows)."""
    from magi_kernels import tiles

    meta, layers, covered = tiles.tile_tables(((0, 300, 0, 300, 1),), 0, 64, "cpu", 300)
    table, members, n, host_work = layers[0]
    assert n == 5 and covered and members.tolist() == [0] * 5
    start, end, first, count = table.long().unbind(1)
    work = tiles.tile_work(meta, members[first], start, 0, 64)
    assert work.tolist() == sorted(work.tolist(), reverse=True) and start.tolist()[0] == 256  # causal: last rows first
    assert list(host_work) == work.tolist() == [300, 256, 192, 128, 64]  # the host copy the launch order uses
    assert end.tolist()[0] == 300 and count.tolist() == [1] * 5
    assert not tiles.tile_tables(((0, 300, 0, 300, 1),), 0, 64, "cpu", 301)[2]  # one row never written
    assert tiles.tile_tables(((0, 50, 0, 100, 0), (50, 100, 0, 10, 2)), 0, 64, "cpu", 100)[2]
    assert not tiles.tile_tables(((0, 50, 0, 100, 0), (60, 100, 0, 10, 0)), 0, 64, "cpu", 100)[2]  # gap 50..60
    assert not tiles.tile_tables(((0, 50, 0, 100, 0), (50, 100, 5, 5, 0)), 0, 64, "cpu", 100)[2]  # empty k range: no tile
    # dK/dV tiles: under inv_causal (row r sees keys >= r) the last keys have the most queries
    meta, layers, _ = tiles.tile_tables(((0, 256, 0, 256, 2),), 2, 64, "cpu", 256)
    assert layers[0][0][:, 0].tolist() == [192, 128, 64, 0]


def test_triton_tiles_merge_slices_of_one_phase():
    """Slices whose ranges start at the same phase of the tile grid share tiles (one layer, one
    online softmax / one dK-dV accumulation over all members); other overlaps need layers."""
    from magi_kernels import tiles

    # shared prefix: both slices of the document rows [100, 228) start at row 100
    shared = ((0, 100, 0, 100, 1), (100, 228, 0, 100, 0), (100, 200, 100, 200, 1))
    meta, layers, covered = tiles.tile_tables(shared, 0, 64, "cpu", 228)
    assert len(layers) == 1 and covered
    table, members, _, _ = layers[0]
    rows = {int(t[0]): (int(t[1]), sorted(members[int(t[2]):int(t[2]) + int(t[3])].tolist())) for t in table}
    assert rows[100] == (164, [1, 2]) and rows[164] == (228, [1, 2]) and rows[0] == (64, [0])
    # block-causal keys: every block's k range starts at the document start -> one k layer
    blocks = tuple((b, b + 64, 0, b + 64, 0) for b in range(0, 256, 64))
    assert len(tiles.tile_tables(blocks, 2, 64, "cpu", 256)[1]) == 1
    assert len(tiles.slice_layers(blocks, 2, 64)) == 1
    # overlapping ranges of different phase conflict
    assert len(tiles.slice_layers(((0, 100, 0, 10, 0), (50, 150, 10, 20, 0)), 0, 64)) == 2
    assert len(tiles.slice_layers(((0, 100, 0, 10, 0), (64, 150, 10, 20, 0)), 0, 64)) == 1


def test_triton_dq_mode_selection():
    """dQ mode: split off the GPU (and under torch's deterministic mode); the config's choice
    otherwise."""
    from magi_kernels import KernelConfig, plan_attention

    def mode(config):
        return plan_attention([(0, 8)], [(0, 8)], None, 8, 8, 1, 64, torch.float32, config, "cpu").backward.dq_mode

    assert mode(KernelConfig()) == "split"
    assert mode(KernelConfig(dq_mode="atomic")) == "atomic"


def test_triton_head_dims():
    """Head dims the Triton backend runs (compiled ones as they are, other multiples of 8 up to
    256 zero-padded to the next one, the rest refused)."""
    from magi_kernels import triton_backend as tb

    assert [tb.kernel_head_dim(d) for d in (8, 40, 64, 80, 96, 128, 160, 192, 256)] == [
        64, 64, 64, 128, 128, 128, 256, 256, 256]
    assert [tb.kernel_head_dim(d) for d in (0, 100, 264)] == [None, None, None]
    q = torch.randn(5, 2, 40)
    assert all(p.shape[-1] == 64 and torch.equal(p[..., :40], q) and not p[..., 40:].any()
               for p in tb._pad_head_dim(q, q))


OVERLAPPING = ([(0, 8), (4, 8)], [(0, 8), (2, 4)], [1, 0])  # rows 4..7 see keys 2, 3 twice


def test_double_coverage_checked_by_default_and_valid_mask_matches_dense():
    q, k, v = _inputs(8, 2, 1, 8, torch.float64)
    with pytest.raises(ValueError, match=r"q_ranges, k_ranges, attn_type_map: slices 0 .* and 1 .* both cover cell"):
        flex_flash_attn_func(q, k, v, *OVERLAPPING, backend="torch")
    flex_flash_attn_func(q, k, v, *OVERLAPPING, backend="torch", check_ranges=False)  # the caller's promise
    valid = [(0, 8, 0, 8, 1), (4, 8, 8, 8, 0)]  # second slice empty: covers nothing twice
    out, lse = flex_flash_attn_func(q, k, v, [s[:2] for s in valid], [s[2:4] for s in valid], [s[4] for s in valid],
                                    backend="torch")
    ro, rl = dense_attention(q, k, v, dense_mask(valid, 8, 8))
    torch.testing.assert_close(out, ro, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, rl, atol=1e-12, rtol=0)


def test_slice_check_runs_once_per_mask(monkeypatch):
    """Cached by tensor identity + in-place version, and by content for masks rebuilt from lists."""
    from magi_kernels import validation

    calls = []
    real = validation._check_rows
    monkeypatch.setattr(validation, "_check_rows", lambda rows: calls.append(len(rows)) or real(rows))
    validation._CHECKED.clear()
    q, k, v = _inputs(12, 2, 1, 8, torch.float64)
    qr = torch.tensor([[0, 6], [6, 12]], dtype=torch.int32)
    kr, tm = qr.clone(), torch.tensor([1, 1], dtype=torch.int32)
    for _ in range(3):
        flex_flash_attn_func(q, k, v, qr, kr, tm, backend="torch")
    assert len(calls) == 1
    for _ in range(2):  # new tensors each call, same contents: the content digest hits
        flex_flash_attn_func(q, k, v, qr.tolist(), kr.tolist(), tm.tolist(), backend="torch")
    assert len(calls) == 1
    kr[1, 0] = 0  # in place: both slices now cover (q=6, k=0)
    qr[0, 1] = 12
    with pytest.raises(ValueError, match="both cover cell"):
        flex_flash_attn_func(q, k, v, qr, kr, tm, backend="torch")
    assert len(calls) == 2
    with pytest.raises(ValueError, match=r"q_ranges\[1\]=\[6, 12\) .* total_q=10"):  # bounds: every call
        flex_flash_attn_func(q[:10], k, v, [[0, 6], [6, 12]], [[0, 6], [6, 12]], backend="torch")


def test_torch_compile_fullgraph_with_default_checks():
    slices, S = mask_cases()["varlen_causal"]
    q, k, v = (t.requires_grad_() for t in _inputs(S, 2, 1, 8, torch.float32))
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in ([s[:2] for s in slices], [s[2:4] for s in slices],
                                                                [s[4] for s in slices]))

    def f(q, k, v, qr, kr, tm):
        return flex_flash_attn_func(q, k, v, qr, kr, tm, backend="torch")[0].sum()

    eager = f(q, k, v, qr, kr, tm)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    for compiler in ("eager", "aot_eager"):
        g = torch.compile(f, backend=compiler, fullgraph=True)
        compiled = g(q, k, v, qr, kr, tm)
        torch.testing.assert_close(compiled, eager)
        for got, want in zip(torch.autograd.grad(compiled, (q, k, v)), eager_grads):
            torch.testing.assert_close(got, want)
        bad = [torch.tensor(x, dtype=torch.int32) for x in OVERLAPPING]  # same shapes as a valid mask
        with pytest.raises(ValueError, match="both cover cell"):
            torch.compile(f, backend=compiler, fullgraph=True)(q, k, v, *bad)


class TestInputErrors:
    """Each wrong input gets an error that names the argument."""

    def setup_method(self):
        self.q, self.k, self.v = _inputs(8, 2, 1, 8, torch.float32)

    def call(self, qr=None, kr=None, tm=None, **kw):
        qr, kr = ([(0, 8)] if r is None else r for r in (qr, kr))
        return flex_flash_attn_func(self.q, self.k, self.v, qr, kr, tm, backend="torch", **kw)

    @pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5])
    def test_softmax_scale(self, scale):
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            self.call(softmax_scale=scale)

    @pytest.mark.parametrize("cap", [float("nan"), float("inf"), -1.0])
    def test_softcap(self, cap):
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            self.call(softcap=cap)

    def test_float_ranges_are_not_truncated(self):
        with pytest.raises(TypeError, match="q_ranges must hold integers"):
            self.call(qr=[(0, 7.5)])
        with pytest.raises(TypeError, match="k_ranges must hold integers"):
            self.call(kr=torch.tensor([[0.0, 8.0]]))
        with pytest.raises(TypeError, match="attn_type_map must be an integer tensor"):
            self.call(tm=torch.tensor([1.0]))

    def test_solver_ranges_and_mask_types_are_accepted(self):
        """Lists of magi_solver.AttnRange / AttnMaskType mean the same as int pairs and codes."""
        from magi_solver import AttnMaskType, AttnRange

        o_obj, _ = self.call(qr=[AttnRange(0, 4), AttnRange(4, 8)], kr=[AttnRange(0, 4), AttnRange(0, 8)],
                             tm=[AttnMaskType.CAUSAL, AttnMaskType.FULL])
        o_int, _ = self.call(qr=[(0, 4), (4, 8)], kr=[(0, 4), (0, 8)], tm=[1, 0])
        assert torch.equal(o_obj, o_int)

    def test_ranges_on_meta_device(self):
        with pytest.raises(ValueError, match="q_ranges is on the meta device"):
            self.call(qr=torch.tensor([[0, 8]], dtype=torch.int32, device="meta"))

    def test_accumulator_dtype_and_device(self):
        o, lse = self.call()
        with pytest.raises(TypeError, match="out must have q's dtype torch.float32"):
            self.call(out=o.double(), lse=lse)
        with pytest.raises(TypeError, match="lse must be torch.float32 for torch.float32 inputs"):
            self.call(out=o, lse=lse.double())
        with pytest.raises(ValueError, match="out must be on q's device"):
            self.call(out=o.to("meta"), lse=lse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink_shape,dv", [((4,), 16), ((2, 4), 16), (None, 8), (None, 24), ((4,), 12)])
def test_sinks_and_value_head_dim_match_dense(sink_shape, dv, dtype):
    """Learnable sinks ([hq] or several sink tokens) join every row's softmax with no value, and
    a value head dim other than q/k's (MLA) is exact; out, lse and every gradient (the sink's
    included) against float64 dense."""
    slices, S = mask_cases()["mixed_overlapping"]
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(S, h, 16, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for h in (4, 2))
    v = torch.randn(S, 2, dv, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    sink = None if sink_shape is None else torch.randn(sink_shape, generator=g).requires_grad_()
    out, lse = flex_flash_attn_func(q, k, v, [s[:2] for s in slices], [s[2:4] for s in slices],
                                    [s[4] for s in slices], softcap=1.5, backend="torch", sink=sink)
    assert out.shape == (S, 4, dv) and out.dtype == dtype
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    fin = torch.isfinite(lse)
    ((out.double() * g_out).sum() + torch.where(fin, lse.double() * g_lse, 0).sum()).backward()
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_sink = None if sink is None else sink.detach().double().requires_grad_()
    ro, rl = dense_attention(*ref_in, dense_mask(slices, S, S), softcap=1.5, sink=ref_sink)
    rfin = torch.isfinite(rl)
    ((ro * g_out).sum() + torch.where(rfin, rl * g_lse, 0).sum()).backward()
    tol = TOLS[dtype]
    assert torch.equal(fin, rfin)
    if sink is not None:
        assert fin.all()  # rows that see no key still have the sink in their denominator
    torch.testing.assert_close(out.double(), ro, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[fin], rl[fin], atol=tol, rtol=tol)
    for name, a, b in zip("qkv", (q, k, v), ref_in):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=tol * 4, rtol=tol * 4, msg=lambda m, n=name: f"d{n}: {m}")
    if sink is not None:
        assert sink.grad.dtype == torch.float32  # the parameter's dtype: fp32 rounding at least
        stol = max(tol, TOLS[torch.float32])
        torch.testing.assert_close(sink.grad.double(), ref_sink.grad, atol=stol * 4, rtol=stol * 4)


def test_sink_and_value_head_dim_errors():
    q, k, v = _inputs(8, 4, 2, 16, torch.float32)
    r = [(0, 8)]
    with pytest.raises(ValueError, match=r"sink must be \[heads_q\]=4"):
        flex_flash_attn_func(q, k, v, r, r, backend="torch", sink=torch.zeros(3))
    with pytest.raises(ValueError, match="sink holds a NaN"):
        flex_flash_attn_func(q, k, v, r, r, backend="torch", sink=torch.full((4,), float("nan")))
    with pytest.raises(TypeError, match="sink must be a float tensor"):
        flex_flash_attn_func(q, k, v, r, r, backend="torch", sink=torch.zeros(4, dtype=torch.int64))
    # the finiteness check runs once per content of the sink: a NaN written in place after a
    # passing call (an optimizer step that diverged) is still refused
    sink = torch.nn.Parameter(torch.zeros(4))
    flex_flash_attn_func(q, k, v, r, r, backend="torch", sink=sink)
    with torch.no_grad():
        sink[2] = float("inf")
    with pytest.raises(ValueError, match="sink holds a NaN or an infinite"):
        flex_flash_attn_func(q, k, v, r, r, backend="torch", sink=sink)
    with pytest.raises(ValueError, match="q and k must share it"):
        flex_flash_attn_func(q, k[..., :8], v, r, r, backend="torch")
    with pytest.raises(ValueError, match=r"k and v must have the same \[tokens, heads_kv\]"):
        flex_flash_attn_func(q, k, v[:4], r, r, backend="torch")


def test_removed_kernel_switches_warn_and_are_read_nowhere():
    """The switches of removed kernel variants (issue 41): setting one gives one warning that
    names it (it changes nothing any more), none set gives none, and no source file of the
    packages reads it (only ``kernel_config`` lists it)."""
    import pathlib
    import warnings

    from magi_kernels.kernel_config import REMOVED_SWITCHES, warn_removed_switches

    with pytest.warns(UserWarning, match="MAGI_GLUON_FWD_PERSIST .*persistent.*MAGI_TRITON_BWD_FUSE") as caught:
        found = warn_removed_switches({"MAGI_GLUON_FWD_PERSIST": "0", "MAGI_TRITON_BWD_FUSE": "0", "MAGI_LOG_LEVEL": "x",
                                       "MAGI_GLUON_BWD_PIECES": "0"})
    assert found == ["MAGI_GLUON_FWD_PERSIST", "MAGI_TRITON_BWD_FUSE"] and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_removed_switches({"MAGI_GLUON_BWD_PIECES": "0", "MAGI_GLUON_FWD_ORDER": ""}) == []
    root = pathlib.Path(__file__).parents[2] / "packages"
    readers = {(path.name, var) for path in root.glob("*/src/**/*.py") if path.name != "kernel_config.py"
               for var in REMOVED_SWITCHES if f'"{var}"' in path.read_text()}
    assert not readers, f"removed switches still read: {sorted(readers)}"
