"""KernelConfig: validation that names the field and the fix, the environment read once as a
developer override, and the config carried through flex_flash_attn_func and DistAttnConfig."""

import dataclasses
import pathlib

import pytest
import torch

from magi_kernels import KernelConfig, TritonTiles, default_kernel_config, flex_flash_attn_func
from magi_kernels.kernel_config import ENV_VARS, REMOVED_SWITCHES, TUNED_TRITON_DKDV, TUNED_TRITON_FWD_TMA

KERNEL_SRC = pathlib.Path(__file__).parents[2] / "packages" / "magi-kernels" / "src" / "magi_kernels"


@pytest.fixture
def fresh_default(monkeypatch):
    """The process default re-read from a clean environment (and restored after)."""
    for var in (*ENV_VARS, *REMOVED_SWITCHES):
        monkeypatch.delenv(var, raising=False)
    default_kernel_config.cache_clear()
    yield
    default_kernel_config.cache_clear()


@pytest.mark.parametrize("kwargs,message", [
    ({"triton_fwd_tiles": (128, 64, 8)}, r"KernelConfig.triton_fwd_tiles must be None \(tuned per head dim\) or 4 ints"),
    ({"triton_dkdv_tiles": (64, 100, 8, 3)}, r"KernelConfig.triton_dkdv_tiles.block_n must be a power of two >= 16"),
    ({"triton_dq_tiles": (64, 64, 3, 3)}, r"KernelConfig.triton_dq_tiles.num_warps must be one of"),
    ({"triton_fwd_tiles": (64, 64, 4, 0)}, r"KernelConfig.triton_fwd_tiles.num_stages must be >= 1"),
    ({"gluon_fwd_tiles": (128, 128, 3, 3, 1)}, r"KernelConfig.gluon_fwd_tiles.parts must be 1 or 2"),
    ({"gluon_fwd_tiles": (128, 128, 3, 2, 2)}, r"KernelConfig.gluon_fwd_tiles.pingpong must be 0 or 1"),
    ({"gluon_bwd_tiles": (64, 128, 0)}, r"KernelConfig.gluon_bwd_tiles.stages must be >= 1"),
    ({"triton_tma": "yes"}, r"KernelConfig.triton_tma must be None \(the backend chooses\), True or False"),
    ({"gluon_fwd": 1}, r"KernelConfig.gluon_fwd must be None"),
    ({"dq_mode": "fast"}, r"KernelConfig.dq_mode must be one of \('auto', 'split', 'atomic', 'tma'\)"),
    ({"bwd_rotate": 1}, r"KernelConfig.bwd_rotate must be True or False"),
    ({"bwd_piece_heads": -1}, r"KernelConfig.bwd_piece_heads must be None \(auto\), 0"),
    ({"bwd_piece_add": "red"}, r"KernelConfig.bwd_piece_add must be one of"),
    ({"bwd_order": 0}, r"KernelConfig.bwd_order must be 'auto', 'head', 'tile' or a positive band"),
    ({"gluon_bwd": True, "dq_mode": "split"}, r"gluon_bwd=True conflicts with dq_mode='split'.*set dq_mode='auto'"),
    ({"bwd_piece_add": "tma", "gluon_bwd_tiles": (64, 64, 3)}, r"block_n = 2 \* block_m.*bwd_piece_add='atomic'"),
])
def test_invalid_fields_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**kwargs)


def test_defaults_are_the_tuned_settings():
    """The defaults leave every choice to the tuned tables (no number changes): the per-head-dim
    tiles resolve to the measured ones."""
    c = KernelConfig()
    assert c.describe() == "defaults"
    assert c.triton_fwd_for(128, tma=True) == TUNED_TRITON_FWD_TMA[128] == (128, 128, 8, 3)
    assert c.triton_fwd_for(64, tma=True) == (128, 64, 4, 3)  # no TMA table at 64: the plain one
    assert c.triton_dkdv_for(128) == TUNED_TRITON_DKDV[128] == (64, 128, 8, 3)
    assert c.triton_dq_for(256) == (64, 32, 8, 2)
    assert c.gluon_fwd_for(128) == (128, 128, 3, 2, 1) and c.gluon_bwd_for(128) == (64, 128, 3)
    assert (c.dq_mode, c.bwd_order, c.bwd_piece_add, c.bwd_piece_heads) == ("auto", "auto", "auto", None)
    assert c.bwd_rotate and c.bwd_split_tail and c.triton_tma is c.gluon_fwd is c.gluon_bwd is None
    over = KernelConfig(triton_fwd_tiles=[64, 32, 4, 2])  # any head dim, lists accepted
    assert over.triton_fwd_tiles == TritonTiles(64, 32, 4, 2) and over.triton_fwd_for(256, False) == (64, 32, 4, 2)
    assert over.describe() == "triton_fwd_tiles=TritonTiles(block_m=64, block_n=32, num_warps=4, num_stages=2)"


def test_json_round_trip_and_hashable():
    c = KernelConfig(gluon_fwd_tiles=(128, 64, 2, 1, 0), bwd_order=2, bwd_piece_heads=3, gluon_bwd=False,
                     dq_mode="atomic")
    assert KernelConfig.from_json(c.to_json()) == c and hash(c) == hash(KernelConfig.from_json(c.to_json()))
    assert KernelConfig.from_json("") is default_kernel_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dq_mode = "split"


@pytest.mark.parametrize("var,value,message", [
    ("MAGI_TRITON_BWD_CFG", "64,128,eight,3", "MAGI_TRITON_BWD_CFG must be 'BM,BN,num_warps,num_stages'"),
    ("MAGI_GLUON_FWD_CFG", "128,128,3", "MAGI_GLUON_FWD_CFG must be 'BM,BN,STAGES,PARTS,PING'"),
    ("MAGI_TRITON_TMA", "yes", "MAGI_TRITON_TMA must be one of 'auto', '0', '1'"),
    ("MAGI_GLUON_FWD", "on", "MAGI_GLUON_FWD must be one of 'auto', '0', '1'"),
    ("MAGI_TRITON_DQ", "fast", "MAGI_TRITON_DQ must be one of 'auto', 'split', 'atomic', 'tma'"),
    ("MAGI_GLUON_BWD_ORDER", "rows", "MAGI_GLUON_BWD_ORDER must be 'auto', 'head', 'tile' or a positive"),
    ("MAGI_GLUON_BWD_SPLIT", "yes", "MAGI_GLUON_BWD_SPLIT must be one of '0', '1'"),
    ("MAGI_GLUON_BWD_ROTATE", "on", "MAGI_GLUON_BWD_ROTATE must be one of '0', '1'"),
    ("MAGI_GLUON_BWD_PIECES", "two", "MAGI_GLUON_BWD_PIECES must be 'auto', 0 or a divisor of the GQA group"),
    ("MAGI_GLUON_BWD_PIECE_ADD", "red", "MAGI_GLUON_BWD_PIECE_ADD must be one of 'auto', 'atomic', 'tma'"),
    ("MAGI_GLUON_FWD_CFG", "128,128,3,4,1", "environment overrides are invalid: KernelConfig.gluon_fwd_tiles.parts"),
])
def test_env_override_rejects_bad_values_naming_the_variable(var, value, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig.from_env({var: value})


def test_env_override_values():
    env = {"MAGI_GLUON_BWD_ORDER": "3", "MAGI_GLUON_BWD_ROTATE": "0", "MAGI_GLUON_BWD_CFG": "64,128,2",
           "MAGI_GLUON_FWD": "0", "MAGI_TRITON_TMA": "1", "MAGI_TRITON_DQ": "tma", "MAGI_GLUON_BWD_PIECES": "0",
           "MAGI_GLUON_BWD_SPLIT": "0", "MAGI_TRITON_FWD_CFG": "32,16,4,1"}
    c = KernelConfig.from_env(env)
    assert (c.bwd_order, c.bwd_rotate, c.gluon_bwd_tiles, c.gluon_fwd, c.triton_tma, c.dq_mode) == (
        3, False, (64, 128, 2), False, True, "tma")
    assert c.bwd_piece_heads == 0 and not c.bwd_split_tail and c.triton_fwd_tiles == (32, 16, 4, 1)
    assert KernelConfig.from_env({}) == KernelConfig()
    assert KernelConfig.from_env({"MAGI_GLUON_BWD_ORDER": "tile", "MAGI_TRITON_DQ": ""}).bwd_order == "tile"


def test_env_read_once_then_never_again(fresh_default, monkeypatch):
    """The developer override is read at the first use only: changing the environment later
    changes neither the default nor what a call runs with."""
    from magi_kernels import interface

    monkeypatch.setenv("MAGI_TRITON_DQ", "atomic")
    first = default_kernel_config()
    assert first.dq_mode == "atomic"
    monkeypatch.setenv("MAGI_TRITON_DQ", "tma")
    monkeypatch.setenv("MAGI_GLUON_BWD_ORDER", "not a mode")  # would raise if anything re-read it
    assert default_kernel_config() is first
    seen = []
    monkeypatch.setattr(interface, "_forward_impl", lambda *a: seen.append(a[10]) or (a[0], a[0][..., 0]))
    q = torch.randn(4, 1, 8)
    flex_flash_attn_func(q, q, q, [(0, 4)], [(0, 4)], backend="torch")
    assert seen == [first]


def test_env_is_read_by_the_config_module_only():
    """No kernel module reads the environment (the hot path reads a config): only
    ``kernel_config`` does, once."""
    readers = [p.name for p in KERNEL_SRC.glob("*.py") if p.name != "kernel_config.py"
               and ("os.environ" in p.read_text() or "getenv" in p.read_text())]
    assert not readers, readers


def test_removed_switches_warn_once_when_read(fresh_default, monkeypatch):
    monkeypatch.setenv("MAGI_GLUON_FWD_PERSIST", "0")
    with pytest.warns(UserWarning, match="MAGI_GLUON_FWD_PERSIST .*persistent"):
        default_kernel_config()


def test_flex_flash_attn_func_takes_a_config_and_checks_its_type():
    q = torch.randn(6, 2, 8, dtype=torch.float64)
    ref, _ = flex_flash_attn_func(q, q, q, [(0, 6)], [(0, 6)], ["causal"], backend="torch")
    out, _ = flex_flash_attn_func(q, q, q, [(0, 6)], [(0, 6)], ["causal"], backend="torch",
                                  kernel_config=KernelConfig(dq_mode="split"))
    assert torch.equal(out, ref)
    with pytest.raises(TypeError, match="kernel_config must be a magi_kernels.KernelConfig or None, got dict"):
        flex_flash_attn_func(q, q, q, [(0, 6)], [(0, 6)], backend="torch", kernel_config={"dq_mode": "split"})


def test_dist_attn_config_carries_the_kernel_config_into_the_fingerprint():
    from magi_attn import DistAttnConfig
    from magi_attn.agreement import config_fields

    base = DistAttnConfig()
    assert base.kernel == default_kernel_config()
    other = DistAttnConfig(kernel=KernelConfig(bwd_order="head"))
    fields = {f.name: f.value for f in config_fields("dist_attn_config", base)}
    changed = {f.name for f in config_fields("dist_attn_config", other) if fields[f.name] != f.value}
    assert changed == {"dist_attn_config.kernel"}
    with pytest.raises(TypeError, match="DistAttnConfig.kernel must be a magi_kernels.KernelConfig"):
        DistAttnConfig(kernel="fast")


def test_other_packages_use_only_magi_kernels_public_api():
    """magi-attn, magi-comm and the integrations import magi_kernels' names from the package
    itself (its ``__init__`` is its whole public API), never from its modules or private names."""
    import ast
    import re

    import magi_kernels

    root = pathlib.Path(__file__).parents[2]
    sources = [*root.glob("packages/magi-attn/src/**/*.py"), *root.glob("packages/magi-comm/src/**/*.py"),
               *root.glob("integrations/src/**/*.py")]
    bad = []
    for path in sources:
        text = path.read_text()
        bad += [f"{path.name}: {m}" for m in re.findall(r"magi_kernels\._[a-z]\w*", text)]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("magi_kernels"):
                if node.module != "magi_kernels":
                    bad.append(f"{path.name}: from {node.module} import ...")
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name not in magi_kernels.__all__]
    assert not bad, bad
