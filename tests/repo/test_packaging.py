"""Packaging: the license ships in every wheel, each version is defined once, py.typed markers,
the uv workspace's sources, and requirements.txt's torch/triton ranges."""

import importlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]

# distribution name -> (directory, import name, build backend)
PACKAGES = {
    "magi-solver": ("packages/magi-solver", "magi_solver", "setuptools"),
    "magi-kernels": ("packages/magi-kernels", "magi_kernels", "scikit-build-core"),
    "magi-comm": ("packages/magi-comm", "magi_comm", "scikit-build-core"),
    "magi-attn": ("packages/magi-attn", "magi_attn", "setuptools"),
    "magi-integrations": ("integrations", "magi_integrations", "setuptools"),
}
params = pytest.mark.parametrize("dist", PACKAGES)


def _pyproject(path) -> dict:
    with open(ROOT / path / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _source_version(mod: str, directory: str) -> str:
    """__version__ as written in the source (no import needed)."""
    text = (ROOT / directory / "src" / mod / "__init__.py").read_text()
    found = re.findall(r'^__version__ = "([^"]+)"', text, re.M)
    assert len(found) == 1, f"{mod}/__init__.py should set __version__ once, found {found}"
    return found[0]


def test_root_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 the magi authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@params
def test_package_license_is_the_root_license(dist):
    directory = PACKAGES[dist][0]
    assert (ROOT / directory / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), (
        f"{directory}/LICENSE differs from the root LICENSE: copy it (cp LICENSE {directory}/)")
    project = _pyproject(directory)["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


@params
def test_version_is_defined_once(dist):
    directory, mod, backend = PACKAGES[dist]
    pyproject = _pyproject(directory)
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"], (
        f"{directory}/pyproject.toml must take the version from {mod}.__version__, not set its own")
    if backend == "setuptools":
        assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"{mod}.__version__"}
    else:
        meta = pyproject["tool"]["scikit-build"]["metadata"]["version"]
        assert meta == {"provider": "scikit_build_core.metadata.regex", "input": f"src/{mod}/__init__.py"}
    _source_version(mod, directory)


@params
def test_installed_version_matches_source(dist):
    """The installed metadata (built from pyproject) and the module agree; a mismatch means the
    package was changed without reinstalling (pip install -r requirements.txt)."""
    directory, mod, _ = PACKAGES[dist]
    try:
        installed = md.version(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")
    assert importlib.import_module(mod).__version__ == installed == _source_version(mod, directory)


@params
def test_installed_metadata_carries_the_license(dist):
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")
    assert d.metadata["License-Expression"] == "Apache-2.0"
    assert d.metadata.get_all("License-File") == ["LICENSE"]
    lic = [f for f in d.files or [] if f.name == "LICENSE"]
    assert lic and Path(d.locate_file(lic[0])).read_bytes() == (ROOT / "LICENSE").read_bytes()


@params
def test_py_typed_marker(dist):
    directory, mod, _ = PACKAGES[dist]
    assert (ROOT / directory / "src" / mod / "py.typed").is_file()


def _build_wheel(dist: str, tmp_path: Path) -> zipfile.ZipFile:
    """Build ``dist``'s wheel without build isolation (no index needed) from a copy of its source."""
    directory, _, backend = PACKAGES[dist]
    module = {"setuptools": "setuptools.build_meta", "scikit-build-core": "scikit_build_core.build"}[backend]
    if backend == "scikit-build-core":
        pytest.importorskip("scikit_build_core", reason="scikit-build-core not installed (build isolation normally brings it)")
    src = tmp_path / "src"
    shutil.copytree(ROOT / directory, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "MAGI_SKIP_NATIVE": "1"}  # the license/version/marker checks need no compiler
    r = subprocess.run([sys.executable, "-c", f"import {module} as b; print(b.build_wheel({str(out)!r}))"],
                       cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return zipfile.ZipFile(out / r.stdout.strip().splitlines()[-1])


@params
def test_wheel_contents(dist, tmp_path):
    directory, mod, _ = PACKAGES[dist]
    whl = _build_wheel(dist, tmp_path)
    names = whl.namelist()
    version = _source_version(mod, directory)
    info = f"{mod}-{version}.dist-info"
    assert f"{mod}/py.typed" in names
    assert whl.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    meta = whl.read(f"{info}/METADATA").decode()
    assert f"\nVersion: {version}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta


def test_uv_workspace_sources():
    """uv resolves a member's dependency on a sibling from PyPI unless the root names it a
    workspace source (uv lock then fails)."""
    root = _pyproject(".")
    assert root["tool"]["uv"]["workspace"]["members"] == ["packages/*", "integrations"]
    sources = root["tool"]["uv"]["sources"]
    assert set(sources) == set(PACKAGES) and all(s == {"workspace": True} for s in sources.values())


def _requirement(name: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if re.match(rf"{name}\b", line):
            return line
    raise AssertionError(f"{name} missing from requirements.txt")


def test_requirements_keep_an_installed_gpu_stack():
    """Ranges, not pins: the device machine's torch 2.11 + triton 3.6.0 (and 2.9 + 3.5.1) satisfy
    them, while the newest torch in range is the 2.13.0 CPU build this workplace ships."""
    from packaging.requirements import Requirement

    torch_req, triton_req = Requirement(_requirement("torch")), Requirement(_requirement("triton"))
    assert "==" not in str(torch_req.specifier) and "==" not in str(triton_req.specifier)
    for v in ("2.4.0", "2.9.1", "2.11.0", "2.11.0+cu130", "2.13.0+cpu"):
        assert torch_req.specifier.contains(v), v
    assert not torch_req.specifier.contains("2.14.1")  # else a fresh install takes that CUDA build
    for v in ("3.0.0", "3.5.1", "3.6.0"):
        assert triton_req.specifier.contains(v), v
    assert not triton_req.specifier.contains("3.7.1")  # CI's Gluon compile tests need 3.6.0
