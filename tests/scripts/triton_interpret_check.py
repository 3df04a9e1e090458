"""Run the Triton backend's kernels in Triton's CPU interpreter against the float64 dense
reference (forward, backward, softcap, GQA, overlapping and empty slices, ragged sizes).

Launched by tests/kernels/test_triton_interpreter.py in a fresh process: TRITON_INTERPRET must be set
before triton and magi_kernels are imported. Small tiles keep the interpreter fast.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_orig_patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)


def _patch_tensor(tensor, scope):
    """numpy 2 refuses int() of a 1-element 1-d array, which triton 3.6's interpreter does for
    loop bounds loaded from memory; take the element explicitly."""
    _orig_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


if _orig_patch_tensor is not None:
    interpreter._patch_lang_tensor = _patch_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cases import mask_cases  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from magi_kernels import KernelConfig  # noqa: E402
from magi_kernels import triton_backend as tb  # noqa: E402
from magi_kernels.slice_bounds_jit import key_row_bounds, row_bounds  # noqa: E402
from magi_kernels.testing import dense_attention, dense_mask, dense_max_logits  # noqa: E402

CASES = {
    "mixed_overlapping": mask_cases()["mixed_overlapping"],
    "varlen_block_causal": mask_cases()["varlen_block_causal"],
    "ragged_inv_causal": ([(0, 45, 0, 20, 2), (0, 45, 20, 26, 1), (45, 45, 0, 3, 0), (20, 45, 26, 45, 3)], 45),
    # long enough for runs of full (unmasked) blocks between partial ones, on both axes
    "causal_q_longer": ([(0, 200, 0, 110, 1), (0, 200, 110, 200, 0)], 200),
    "inv_k_longer": ([(0, 90, 0, 200, 2), (90, 200, 0, 200, 3)], 200),
    "causal_one_launch": ([(0, 150, 0, 150, 1)], 150),  # one layer per axis: fused dK/dV + dQ launch
    # shared prefix: slices 1 and 2 share q tiles (one softmax over both); the tile at row 72
    # has rows past slice 2's end; slice 3 overlaps slice 1 at another phase (a second layer)
    "merged_tiles": ([(0, 40, 0, 40, 1), (40, 110, 0, 40, 0), (40, 95, 40, 95, 1), (95, 110, 95, 110, 1)], 110),
}
# (hq, hk, d, softcap, TMA descriptor loads of full blocks, dQ mode): both load paths and both
# dQ paths the interpreter can run (split dQ programs; dQ added by the dK/dV programs)
# d=40 runs zero-padded to 64 (triton_backend.kernel_head_dim)
SHAPES = [(4, 2, 64, 0.0, "0", "split"), (8, 1, 128, 2.0, "1", "atomic"), (2, 1, 64, 0.0, "0", "atomic"),
          (2, 1, 40, 1.5, "0", "split")]


@triton.jit
def _both_bounds(OUT_R, OUT_K, qs, qe, ks, ke, t, q_hi, R: tl.constexpr, K: tl.constexpr):
    """Visibility of rows [0, R) x keys [0, K) of one slice by ``row_bounds`` and by
    ``key_row_bounds`` (rows below q_hi)."""
    rows = tl.arange(0, R)
    keys = tl.arange(0, K)
    inv, cau = (t & 2) != 0, (t & 1) != 0
    lo, hi = row_bounds(rows, qs, qe, ks, ke, inv, cau)
    by_row = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])
    by_row = by_row & (rows[:, None] >= qs) & (rows[:, None] < q_hi)
    rlo, rhi = key_row_bounds(keys, qs, qe, ks, ke, inv, cau, q_hi)
    by_key = (rows[:, None] >= rlo[None, :]) & (rows[:, None] < rhi[None, :])
    idx = rows[:, None] * K + keys[None, :]
    tl.store(OUT_R + idx, by_row.to(tl.int32))
    tl.store(OUT_K + idx, by_key.to(tl.int32))


def check_key_row_bounds() -> bool:
    """``key_row_bounds`` (the Gluon backward's mask with keys as rows) is the transpose of
    ``row_bounds``: the same visible (row, key) pairs for every mask type, a key window that
    overhangs the slice and a row cap ``q_hi`` below the slice's end."""
    gen = torch.Generator().manual_seed(1)
    seen = 0
    for _ in range(60):
        qs, qe, ks, ke = (int(x) for x in torch.randint(0, 32, (4,), generator=gen))
        qs, qe, ks, ke = min(qs, qe), max(qs, qe) + 1, min(ks, ke), max(ks, ke) + 1
        for t in range(4):
            q_hi = int(torch.randint(qs, qe + 1, (1,), generator=gen))
            a, b = torch.zeros(32 * 64, dtype=torch.int32), torch.zeros(32 * 64, dtype=torch.int32)
            _both_bounds[(1,)](a, b, qs, qe, ks, ke, t, q_hi, R=32, K=64)
            if not torch.equal(a, b):
                print(f"FAIL key_row_bounds slice {(qs, qe, ks, ke, t)} q_hi={q_hi}")
                return False
            seen += int(a.sum())
    print(f"key_row_bounds == row_bounds^T on 240 slices ({seen} visible pairs)")
    return seen > 0


def main() -> int:
    assert tb.AVAILABLE, "triton is not importable"
    if not check_key_row_bounds():
        return 1
    worst = 0.0
    for name, (slices, S) in CASES.items():
        for hq, hk, d, cap, tma, dq_mode in SHAPES:
            config = KernelConfig(triton_fwd_tiles=(32, 16, 4, 1), triton_dkdv_tiles=(16, 32, 4, 1),
                                  triton_dq_tiles=(32, 16, 4, 1), triton_tma=tma == "1", dq_mode=dq_mode)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(S, h, d, generator=g) for h in (hq, hk, hk))
            qr = torch.tensor([s[:2] for s in slices], dtype=torch.int32)
            kr = torch.tensor([s[2:4] for s in slices], dtype=torch.int32)
            tm = torch.tensor([s[4] for s in slices], dtype=torch.int32)
            row_max = torch.full((S, hq), float("-inf"))  # max logits (QK-clip) ride along every case
            out, lse = tb.ffa_forward(q, k, v, qr, kr, tm, d ** -0.5, cap, True, config, None, row_max)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            ro, rl = dense_attention(q64, k64, v64, dense_mask(slices, S, S), softcap=cap)
            ref_max = dense_max_logits(q64.detach(), k64.detach(), dense_mask(slices, S, S), softcap=cap)
            got_max = row_max.amax(dim=0).double()
            if not torch.equal(torch.isfinite(got_max), torch.isfinite(ref_max)):
                print(f"FAIL {name}: heads without logits differ: {got_max} vs {ref_max}")
                return 1
            go = torch.randn(ro.shape, generator=g, dtype=torch.float64)
            gl = torch.randn(rl.shape, generator=g, dtype=torch.float64)
            fin = torch.isfinite(rl)
            ((ro * go).sum() + torch.where(fin, rl * gl, 0).sum()).backward()
            dq, dk, dv = tb.ffa_backward(go.float(), q, k, v, out, lse, torch.where(fin, gl, 0).float(),
                                         qr, kr, tm, d ** -0.5, cap, config)
            if not torch.equal(torch.isfinite(lse), fin):
                print(f"FAIL {name} {hq}/{hk}/{d}: rows without keys differ")
                return 1
            errs = {
                "out": (out.double() - ro).abs().max().item(),
                "lse": (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0,
                "dq": (dq.double() - q64.grad).abs().max().item(),
                "dk": (dk.double() - k64.grad).abs().max().item(),
                "dv": (dv.double() - v64.grad).abs().max().item(),
                "max_logits": (got_max - ref_max)[torch.isfinite(ref_max)].abs().max().item()
                if torch.isfinite(ref_max).any() else 0.0,
            }
            worst = max(worst, *errs.values())
            print(name, f"hq={hq} hk={hk} d={d} softcap={cap} tma={tma} dq={dq_mode}", {k_: f"{e:.1e}" for k_, e in errs.items()})
            if max(errs.values()) > 1e-4:  # fp32 inputs, fp32 accumulation: ~1e-6 expected
                print(f"FAIL {name}: {errs}")
                return 1
    if not check_held_plan():
        return 1
    print(f"OK worst abs error {worst:.2e}")
    return 0


def check_held_plan() -> bool:
    """A plan built once (``plan_attention``) and launched by several calls gives the bits of the
    memoised plan's launches; a plan of other slices is refused before any launch."""
    from magi_kernels import plan_attention

    slices, S = CASES["merged_tiles"]
    config = KernelConfig(triton_fwd_tiles=(32, 16, 4, 1), triton_dkdv_tiles=(16, 32, 4, 1),
                          triton_dq_tiles=(32, 16, 4, 1))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(S, h, 64, generator=g) for h in (4, 2, 2))
    ranges = [torch.tensor([s[i:j] for s in slices], dtype=torch.int32).squeeze(-1) for i, j in ((0, 2), (2, 4), (4, 5))]
    plan = plan_attention(*ranges, S, S, (4, 2), 64, torch.float32, config, "cpu")
    print(plan)
    go = torch.randn(S, 4, 64, generator=g)
    runs = []
    for p in (plan, plan, None):
        out, lse = tb.ffa_forward(q, k, v, *ranges, 0.125, 0.0, True, config, p)
        grads = tb.ffa_backward(go, q, k, v, out, lse, torch.zeros_like(lse), *ranges, 0.125, 0.0, config, p)
        runs.append((out, lse, *grads))
    if not all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run)):
        print("FAIL a held plan's launches differ from the memoised plan's")
        return False
    other = [r.clone() for r in ranges]
    other[2][0] = 0  # slice 0 full instead of causal
    try:
        tb.ffa_forward(q, k, v, *other, 0.125, 0.0, True, config, plan)
    except ValueError as e:
        if "plan= was built for other inputs: mask slices" not in str(e):
            print(f"FAIL wrong error for a plan of other slices: {e}")
            return False
    else:
        print("FAIL a plan of other slices was launched")
        return False
    print("held plan: reused launches identical, a plan of other slices refused")
    return True


if __name__ == "__main__":
    sys.exit(main())
