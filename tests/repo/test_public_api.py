"""Each package's ``__init__`` is its whole public API, and packages depend downward only.

The sources of packages/*/src, integrations/src and bench/ are read with ``ast`` (nothing is
imported). Across a package boundary an import may only name what the other package's
``__init__`` lists in ``__all__``: ``from magi_comm.hierarchical import X``, ``import
magi_solver.mask``, ``from magi_kernels import _private`` and ``magi_comm.not_exported`` all
fail. Imports must also follow the layering (solver <- kernels <- comm <- attn <- integrations;
see each package's pyproject dependencies).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# import name -> source folder of the package
PACKAGES = {
    "magi_solver": ROOT / "packages/magi-solver/src/magi_solver",
    "magi_kernels": ROOT / "packages/magi-kernels/src/magi_kernels",
    "magi_comm": ROOT / "packages/magi-comm/src/magi_comm",
    "magi_attn": ROOT / "packages/magi-attn/src/magi_attn",
    "magi_integrations": ROOT / "integrations/src/magi_integrations",
}

# What each package may import (its pyproject dependencies). magi-comm uses magi-kernels' host
# and device cache (magi_kernels.on_device). bench/ may use everything.
MAY_IMPORT = {
    "magi_solver": set(),
    "magi_kernels": {"magi_solver"},
    "magi_comm": {"magi_solver", "magi_kernels"},
    "magi_attn": {"magi_solver", "magi_kernels", "magi_comm"},
    "magi_integrations": {"magi_solver", "magi_kernels", "magi_comm", "magi_attn"},
    "bench": set(PACKAGES),
}

# magi_integrations is the top of the stack: its modules (hf, fsdp, train, ...) are its API and
# are imported by module; its __init__ stays light (importing it must not import transformers).
API_BY_MODULE = {"magi_integrations"}

# Subpackages with an ``__init__`` of their own whose ``__all__`` is a public API too (the
# simulator's vocabulary is large and optional: importing magi_attn does not load it).
PUBLIC_SUBPACKAGES = {"magi_attn.simulate": ROOT / "packages/magi-attn/src/magi_attn/simulate"}

# (file, imported name) pairs allowed to break the rule, each with its reason.
ALLOWED: set[tuple[str, str]] = {
    # a developer tool, not a benchmark: it compiles the package's own JIT kernels to read their
    # register and shared-memory use (tests/kernels/test_kernel_spills.py), so it reaches them by design
    ("bench/kernel_regs.py", "magi_kernels.triton_backend"),
    ("bench/kernel_regs.py", "magi_kernels.gluon_common.shared_layout"),
    ("bench/kernel_regs.py", "magi_kernels.gluon_fwd"),
    ("bench/kernel_regs.py", "magi_kernels.gluon_bwd"),
    # times the kernel package's slice check itself (first call and cached), below the public call
    ("bench/slice_check_cost.py", "magi_kernels.validation.SliceTensors"),
    ("bench/slice_check_cost.py", "magi_kernels.validation.check_slice_tensors"),
}
# packages whose imports bench/ may take from their modules: none.
BENCH_UNCHECKED: set[str] = set()


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    imported: str  # dotted: package[.module].name
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.imported}: {self.why}"


def exported_names(package: str) -> set[str]:
    """The literal ``__all__`` of a package's (or public subpackage's) ``__init__.py``."""
    src = PACKAGES[package] if package in PACKAGES else PUBLIC_SUBPACKAGES[package]
    tree = ast.parse((src / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    return set()


def source_files() -> list[tuple[str, Path]]:
    """(owning package, file) for every Python file checked."""
    files = [(pkg, f) for pkg, src in PACKAGES.items() for f in sorted(src.rglob("*.py"))]
    files += [("bench", f) for f in sorted((ROOT / "bench").rglob("*.py"))]
    return files


def violations_in(owner: str, source: str, rel: str, exports: dict[str, set[str]]) -> list[Violation]:
    """Cross-package imports of ``source`` (owned by ``owner``) that break the public-API or
    layering rules."""
    tree = ast.parse(source)
    found: list[Violation] = []

    def check(line: int, package: str, module: str, names: list[str]) -> None:
        if package == owner or package not in PACKAGES:
            return
        if owner == "bench" and package in BENCH_UNCHECKED:
            return
        if package not in MAY_IMPORT[owner]:
            found.append(Violation(rel, line, package, f"{owner} may not depend on {package} (layering)"))
            return
        if package in API_BY_MODULE:
            return
        sub = f"{package}.{module}"
        if sub in PUBLIC_SUBPACKAGES:
            package, module = sub, ""
        for name in names:
            dotted = ".".join(p for p in (package, module, name) if p)
            if module:
                found.append(Violation(rel, line, dotted, f"import from a module of {package}; import it from "
                                       f"{package} (export it in its __init__ if it is public API)"))
            elif name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                found.append(Violation(rel, line, dotted, "private name of another package"))
            elif name not in exports[package] and name != "__version__":
                found.append(Violation(rel, line, dotted, f"not in {package}.__all__"))

    module_aliases: dict[str, str] = {}  # local name -> package, for `import magi_x`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package, _, module = node.module.partition(".")
            check(node.lineno, package, module, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                package, _, module = a.name.partition(".")
                if module:
                    check(node.lineno, package, module, [""])
                else:
                    module_aliases[a.asname or a.name] = package
                    check(node.lineno, package, "", [])
    for node in ast.walk(tree):  # magi_x.name after `import magi_x`
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
            check(node.lineno, module_aliases[node.value.id], "", [node.attr])
    return found


def all_violations() -> list[Violation]:
    exports = {pkg: exported_names(pkg) for pkg in (*PACKAGES, *PUBLIC_SUBPACKAGES)}
    found = []
    for owner, f in source_files():
        rel = f.relative_to(ROOT).as_posix()
        found += violations_in(owner, f.read_text(), rel, exports)
    return found


def test_no_private_or_module_imports_across_packages():
    found = all_violations()
    bad = [v for v in found if (v.file, v.imported) not in ALLOWED]
    assert not bad, "imports across package boundaries that bypass the package's __init__:\n" + "\n".join(map(str, bad))
    stale = ALLOWED - {(v.file, v.imported) for v in found}
    assert not stale, f"allowlisted imports that are gone: remove them from ALLOWED: {sorted(stale)}"


def test_every_exported_name_is_bound_in_the_init():
    """``__all__`` lists only names the ``__init__`` binds (a typo there would let anything pass)."""
    for package, src in PACKAGES.items():
        if package in API_BY_MODULE:
            continue
        tree = ast.parse((src / "__init__.py").read_text())
        bound = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        bound |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        missing = exported_names(package) - bound
        assert not missing, f"{package}.__all__ names what its __init__ does not bind: {sorted(missing)}"


def test_the_checker_catches_each_kind_of_bypass():
    exports = {pkg: exported_names(pkg) for pkg in (*PACKAGES, *PUBLIC_SUBPACKAGES)}
    cases = {
        "from magi_comm.hierarchical import shared_collectives": "import from a module",
        "import magi_solver.mask": "import from a module",
        "from magi_comm import _world_and_rank": "private name",
        "from magi_comm import exchange_rows": "not in magi_comm.__all__",
        "import magi_comm\nmagi_comm.native.AVAILABLE": "not in magi_comm.__all__",
        "from magi_attn import calc_attn": "layering",
        "from magi_attn.simulate.magi_sim import merge_s": "import from a module",
        "from magi_attn.simulate import _two_hop": "private name",
    }
    for source, why in cases.items():
        owner = "magi_kernels" if why == "layering" else "bench" if "magi_attn" in source else "magi_attn"
        found = violations_in(owner, source, "x.py", exports)
        assert len(found) == 1 and why in found[0].why, (source, found)
    for source in ("from magi_solver import AttnRange", "import magi_comm\nmagi_comm.__version__", "from . import x"):
        assert not violations_in("magi_comm", source, "x.py", exports), source
    assert not violations_in("bench", "from magi_attn.simulate import merge_s", "x.py", exports)
