"""Kernel plans (``magi_kernels.plan_attention``): built once per (slices, shapes, config), printed,
reused, and refused for other inputs. The Triton launches of a held plan run in the interpreter
check (tests/scripts/triton_interpret_check.py); here the host side and the torch backend."""

import pytest
import torch

from magi_kernels import AttentionPlan, KernelConfig, flex_flash_attn_func, plan_attention

SLICES = ([(0, 300), (300, 500)], [(0, 300), (0, 500)], ["causal", "full"])


def _plan(**kw) -> AttentionPlan:
    args = dict(seqlen_q=500, seqlen_k=500, num_heads=(8, 2), head_dim=128, dtype=torch.bfloat16, device="cpu")
    args.update(kw)
    return plan_attention(*SLICES, **args)


def test_plan_prints_what_runs():
    text = str(_plan(config=KernelConfig(dq_mode="atomic", triton_fwd_tiles=(64, 32, 4, 2))))
    assert text.startswith("AttentionPlan: 2 slices, seqlen_q=500, seqlen_k=500, heads=8/2, head_dim=128, bfloat16")
    assert "config: triton_fwd_tiles=TritonTiles(block_m=64, block_n=32, num_warps=4, num_stages=2), dq_mode='atomic'" \
        in text
    assert "forward: triton (block_m=64, block_n=32, num_warps=4, num_stages=2); 1 layer of 9 query tiles x 8 heads" \
        in text
    assert "backward: triton dK/dV (block_m=64, block_n=128, num_warps=8, num_stages=3) over 1 layer of 4 key tiles" \
        in text and "dQ added by the dK/dV programs (atomic)" in text
    plan = _plan()
    assert plan.forward.kernel == "triton" and not plan.forward.tma  # CPU: no TMA, no Gluon
    assert plan.backward.dq_mode == "split" and plan.backward.fused
    assert repr(plan).startswith("AttentionPlan(2 slices")


def test_plans_are_memoised_on_explicit_values():
    assert _plan() is _plan()  # same slices (any form), shapes, dtype, config: one plan
    assert _plan(config=KernelConfig(triton_fwd_tiles=(64, 32, 4, 2))) is not _plan()
    assert _plan(dtype=torch.float16) is not _plan()
    same = plan_attention(torch.tensor(SLICES[0], dtype=torch.int32), torch.tensor(SLICES[1], dtype=torch.int32),
                          torch.tensor([1, 0], dtype=torch.int32), 500, 500, (8, 2), 128, torch.bfloat16, device="cpu")
    assert same is _plan()
    # head dims the kernels run padded share the padded plan
    assert _plan(head_dim=96).key.head_dim == 128


def test_plan_reused_across_calls_gives_identical_results():
    torch.manual_seed(0)
    q = torch.randn(500, 8, 64, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(500, 2, 64, dtype=torch.float64, requires_grad=True) for _ in range(2))
    plan = _plan(head_dim=64, dtype=torch.float64)
    runs = []
    for p in (plan, plan, None):
        out, lse = flex_flash_attn_func(q, k, v, *SLICES, backend="torch", plan=p)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        runs.append((out, lse, *grads))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[2]):
        assert torch.equal(a, b)


def test_wrong_plan_is_refused_naming_what_differs():
    q = torch.randn(500, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(500, 2, 128, dtype=torch.bfloat16)
    plan = _plan()
    flex_flash_attn_func(q, k, k, *SLICES, backend="torch", plan=plan)  # its own inputs: accepted
    with pytest.raises(ValueError, match=r"plan= was built for other inputs: mask slices \(plan: 2 slices, call: 2; "
                                         r"first difference at slice 1: plan \(300, 500, 0, 500, 0\), call "
                                         r"\(300, 500, 0, 500, 1\).*plan_attention"):
        flex_flash_attn_func(q, k, k, SLICES[0], SLICES[1], ["causal", "causal"], backend="torch", plan=plan)
    with pytest.raises(ValueError, match=r"seqlen_q \(plan: 500, call: 400\)"):
        flex_flash_attn_func(q[:400], k, k, [(0, 300), (300, 400)], SLICES[1], SLICES[2], backend="torch", plan=plan)
    with pytest.raises(ValueError, match=r"heads_q \(plan: 8, call: 4\)"):
        flex_flash_attn_func(q[:, :4], k, k, *SLICES, backend="torch", plan=plan)
    with pytest.raises(ValueError, match=r"dtype \(plan: torch.bfloat16, call: torch.float32\)"):
        flex_flash_attn_func(q.float(), k.float(), k.float(), *SLICES, backend="torch", plan=plan)
    with pytest.raises(ValueError, match=r"kernel config \(plan: defaults; call: dq_mode='atomic'\)"):
        flex_flash_attn_func(q, k, k, *SLICES, backend="torch", plan=plan, kernel_config=KernelConfig(dq_mode="atomic"))
    with pytest.raises(TypeError, match="plan must be a magi_kernels.AttentionPlan"):
        flex_flash_attn_func(q, k, k, *SLICES, backend="torch", plan="fast")


@pytest.mark.parametrize("kw,message", [
    ({"seqlen_q": -1}, "plan_attention: seqlen_q must be a non-negative int"),
    ({"num_heads": (6, 4)}, r"heads_q \(6\) must be a multiple of heads_kv \(4\)"),
    ({"head_dim": 0}, "plan_attention: head_dim must be a positive int"),
    ({"dtype": "bf16"}, "plan_attention: dtype must be a torch.dtype"),
    ({"config": {"dq_mode": "split"}}, "kernel_config must be a magi_kernels.KernelConfig or None"),
])
def test_plan_attention_rejects_bad_arguments(kw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _plan(**kw)


def test_planning_modules_import_no_triton():
    """Planning is pure host code: its modules import neither Triton/Gluon nor the launching
    modules (which only launch a plan)."""
    import ast
    import pathlib

    src = pathlib.Path(__file__).parents[2] / "packages" / "magi-kernels" / "src" / "magi_kernels"
    launching = {"triton_backend", "gluon_fwd", "gluon_bwd", "gluon_common", "epilogue_jit", "slice_bounds_jit",
                 "bwd_walk_jit"}
    for name in ("plan", "tiles", "program_order", "kernel_config"):
        for node in ast.walk(ast.parse((src / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [a.name for a in node.names]
            else:
                continue
            bad = [m for m in mods if m.split(".")[0] == "triton" or m.lstrip(".") in launching]
            assert not bad, f"{name}.py imports {bad}"


def test_dist_attn_stage_holds_its_plans():
    """magi_attn's per-stage slice arguments (held by the key's runtime) build their kernel plan
    once per shape and config and hand the same one to every later call."""
    from magi_attn.runtime import SliceArgs

    args = SliceArgs.build([(0, 300, 0, 300, 1), (300, 500, 0, 500, 0)], 0)
    q, k = torch.empty(500, 8, 64), torch.empty(500, 2, 64)
    plan = args.plan(q, k, KernelConfig())
    assert args.plan(q, k, KernelConfig()) is plan and plan.key.slices == ((0, 300, 0, 300, 1), (300, 500, 0, 500, 0))
    assert args.plan(q, k, KernelConfig(dq_mode="atomic")) is not plan and len(args.plans) == 2
