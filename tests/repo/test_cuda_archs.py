"""Which CUDA architectures the native kernels are built for (cmake/MagiCudaArchs.cmake, run
against fake nvcc's), and the run-time check of a GPU against them (magi_comm.native)."""

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from magi_comm import ipc, native
from magi_comm.native import arch_covers

ROOT = Path(__file__).resolve().parents[2]

# the default list: sm_80 code + PTX, sm_90a code, sm_100 code + PTX
DEFAULT = ("80", "90a-real", "100")


@pytest.mark.parametrize("cap, ok", [
    ((8, 0), True), ((8, 6), True), ((8, 9), True),  # sm_80 code runs on 8.x
    ((9, 0), True),  # sm_90a code
    ((10, 0), True), ((10, 3), True),  # sm_100 code runs on 10.x
    ((12, 0), True), ((11, 0), True),  # compute_100 (and compute_80) PTX, JIT-compiled
    ((7, 5), False), ((7, 0), False),  # older than every entry
])
def test_default_archs(cap, ok):
    got, why = arch_covers(DEFAULT, cap)
    assert got is ok, why
    assert f"sm_{cap[0]}{cap[1]}" in why


@pytest.mark.parametrize("archs, cap, ok", [
    (("90a-real",), (9, 0), True),
    (("90a-real",), (8, 0), False),
    (("90a-real",), (10, 0), False),  # arch-specific code never runs elsewhere
    (("90a",), (10, 0), False),  # nor does compute_90a PTX
    (("80-real",), (8, 6), True),
    (("80-real",), (9, 0), False),  # code only, other major: no
    (("80-virtual",), (9, 0), True),  # PTX only: JIT upward
    (("80-virtual",), (7, 5), False),
    (("86-real",), (8, 0), False),  # code for a newer minor does not run on an older one
    (("100f-real",), (10, 3), True),  # family code
    (("100f-real",), (12, 0), False),
    ((), (9, 0), False),
])
def test_arch_rules(archs, cap, ok):
    got, why = arch_covers(archs, cap)
    assert got is ok, why
    if not ok:
        assert "do not cover" in why


def test_unreadable_entries_are_trusted_and_say_so():
    ok, why = arch_covers(("native",), (9, 0))
    assert ok and "cannot check" in why and "native" in why
    # a readable entry that covers wins without the caveat
    ok, why = arch_covers(("native", "90a-real"), (9, 0))
    assert ok and "90a-real" in why


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA build of magi_comm._native for sm_90a only, on a machine whose GPU 0 is sm_80."""
    monkeypatch.setattr(native, "WITH_CUDA", True)
    monkeypatch.setattr(native, "CUDA_ARCHS", ("90a-real",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    native.cuda_usable.cache_clear()
    yield
    native.cuda_usable.cache_clear()


def test_uncovered_gpu_falls_back_with_a_warning(fake_gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="magi_comm.native"):
        ok, why = native.cuda_usable(0)
        native.cuda_usable(0)  # cached: checked and logged once
    assert not ok and "sm_80" in why and "90a-real" in why
    warnings = [r for r in caplog.records if "native CUDA kernels disabled on cuda:0" in r.getMessage()]
    assert len(warnings) == 1 and "PyTorch path" in warnings[0].getMessage()
    # the IPC backend refuses with the same reason, and the raw launches raise instead of failing in CUDA
    assert ipc.ipc_supported() == (False, why)
    with pytest.raises(RuntimeError, match="cannot run on cuda:0.*sm_80"):
        native._require_cuda(torch.device("cuda", 0))


def test_covered_gpu_is_used(fake_gpu, monkeypatch):
    monkeypatch.setattr(native, "CUDA_ARCHS", DEFAULT)
    assert native.cuda_usable(0)[0]


# ---- cmake/MagiCudaArchs.cmake against fake compilers ------------------------------------------

ALL_13 = "sm_75 sm_80 sm_86 sm_87 sm_88 sm_89 sm_90 sm_100 sm_110 sm_103 sm_120 sm_121"  # nvcc 13.0's list
ALL_12_4 = "sm_50 sm_52 sm_53 sm_60 sm_61 sm_62 sm_70 sm_72 sm_75 sm_80 sm_86 sm_87 sm_89 sm_90"
ALL_11_8 = "sm_35 sm_37 sm_50 sm_52 sm_53 sm_60 sm_61 sm_62 sm_70 sm_72 sm_75 sm_80 sm_86 sm_87 sm_89 sm_90"


def _select(tmp_path, release, codes, wanted=None, list_rc=0):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not on PATH")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n  --version) echo "Cuda compilation tools, release {release}, V{release}.1";;\n'
        f'  --list-gpu-code) echo "{codes}" | tr " " "\\n"; exit {list_rc};;\n  *) exit 1;;\nesac\n'
    )
    nvcc.chmod(0o755)
    script = tmp_path / "select.cmake"
    args = f' WANTED {" ".join(wanted)}' if wanted else ""
    script.write_text(
        f'list(APPEND CMAKE_MODULE_PATH "{ROOT / "cmake"}")\ninclude(MagiCudaArchs)\n'
        f'magi_select_cuda_archs("{nvcc}" out{args})\nmessage(STATUS "RESULT=[${{out}}]")\n'
    )
    r = subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout + r.stderr
    result = text.split("RESULT=[", 1)[1].split("]", 1)[0]
    return [a for a in result.split(";") if a], text


@pytest.mark.parametrize("release, codes, want", [
    ("13.0", ALL_13, ["80", "90a-real", "100"]),
    ("12.8", ALL_12_4 + " sm_100 sm_101 sm_120", ["80", "90a-real", "100"]),
    ("12.4", ALL_12_4, ["80", "90a-real"]),  # no Blackwell yet
    ("11.8", ALL_11_8, ["80"]),  # sm_90 listed, but no arch-specific 90a before CUDA 12.0
    ("14.0", "sm_90 sm_100 sm_120", ["90a-real", "100"]),  # a future nvcc without Ampere
])
def test_auto_selection_follows_the_compiler(tmp_path, release, codes, want):
    got, text = _select(tmp_path, release, codes)
    assert got == want, text
    if len(want) < 3:
        assert f"CUDA {release} cannot build for" in text  # a dropped arch is said


def test_explicit_list_and_failures(tmp_path):
    assert _select(tmp_path, "13.0", ALL_13, wanted=["75", "90a-real"])[0] == ["75", "90a-real"]
    got, text = _select(tmp_path, "11.8", ALL_11_8, wanted=["100"])
    assert got == [] and "supports none of" in text
    got, text = _select(tmp_path, "13.0", ALL_13, list_rc=1)
    assert got == [] and "--list-gpu-code' failed" in text
    got, text = _select(tmp_path, "13.0", ALL_13, wanted=["sm90"])
    assert got == [] and "not of the form" in text
