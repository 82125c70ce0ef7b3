"""fork_patches/ is split by concern (issue 41 item 5): every module sits in one concern folder,
the hook registry is the one place hooks are declared, and no module reaches back to itself through
any chain of imports, counting function-level imports and the module paths the registry and the
plugin resolve by string (``importlib``)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests._ci import REPO

pytestmark = pytest.mark.fast
FORK = REPO / "fork_patches"
CONCERNS = {"quant", "spec", "api", "route_census", "engine"}
_STRING_REF = re.compile(r"qpn\.fork_patches\.([\w.]+?)(?::[\w.]+)?")


def module_name(path: Path) -> str:
    if not path.is_relative_to(FORK):
        return ""
    rel = path.relative_to(FORK).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module a dotted name under qpn.fork_patches starts with."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def edges(path: Path, known: set[str]) -> set[str]:
    """Modules of fork_patches that ``path`` imports at any depth, or names by an importlib string
    (TYPE_CHECKING blocks excepted: they never run)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qpn.fork_patches"):
            base = node.module[len("qpn.fork_patches"):].lstrip(".")
            names = [f"{base}.{a.name}" if base else a.name for a in node.names] + ([base] if base else [])
        elif isinstance(node, ast.Import):
            names = [a.name[len("qpn.fork_patches."):] for a in node.names
                     if a.name.startswith("qpn.fork_patches.")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _STRING_REF.fullmatch(node.value)
            names = [m.group(1)] if m else []
        for name in names:
            target = _resolve(name, known)
            if target and target != module_name(path):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted(FORK.rglob("*.py"))
    known = {module_name(f) for f in files if module_name(f)}
    return {module_name(f): edges(f, known) for f in files if module_name(f)}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first walk (one per back edge)."""
    found, state, stack = [], {}, []

    def walk(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            walk(node)
    return found


def test_every_module_sits_in_a_concern_folder():
    top = sorted(p.name for p in FORK.glob("*.py") if p.name != "__init__.py")
    assert not top, f"modules outside the concern folders: {top}"
    folders = {p.name for p in FORK.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == CONCERNS
    for folder in folders:
        assert (FORK / folder / "__init__.py").is_file(), folder


def test_no_import_cycle_counting_function_level_imports_and_importlib_strings():
    g = graph()
    assert "engine.hooks" in g and "spec.spec_state" in g["engine.hooks"]  # strings are read
    assert not cycles(g), "import cycles in fork_patches/: " + "; ".join(
        " -> ".join(c) for c in cycles(g))


def test_the_cycle_check_sees_each_kind_of_edge(tmp_path):
    """A plausible violation fails the check: a hooks module that a hook's module imports back,
    once through a function-level import and once through an importlib string."""
    g = graph()
    g["engine.engine_quirks"] = g["engine.engine_quirks"] | {"engine.hooks"}  # hooks names quirks by string
    assert any("engine.hooks" in c and "engine.engine_quirks" in c for c in cycles(g))
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from qpn.fork_patches.engine import hooks\n"
                     "X = 'qpn.fork_patches.spec.spec_state:wrap_gdn_build'\n")
    known = set(graph())
    assert edges(probe, known) == {"engine", "engine.hooks", "spec.spec_state"}  # the package too


def test_hooks_are_declared_only_in_the_registry():
    """Only engine/hooks.py builds Hook entries; every other module carries a hook out."""
    builders = []
    for path in FORK.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Hook":
                builders.append(str(path.relative_to(FORK)))
    assert set(builders) == {"engine/hooks.py"}


def test_the_overlay_checks_every_concern_folder_for_staleness():
    """overlay check compares each source folder's modules with the installed copy; a folder
    missing from SOURCE_FOLDERS would never be found stale."""
    from qpn.fork_patches.engine.overlay import SOURCE_FOLDERS

    assert {f"fork_patches/{c}" for c in CONCERNS} <= set(SOURCE_FOLDERS.values())


def test_every_package_folder_is_installed_and_checked_for_staleness():
    """Each package folder of the checkout (the weight families under kernels/families/ too) is a
    package pyproject.toml installs, and one the overlay check compares with its installed copy."""
    import tomllib

    from qpn.fork_patches.engine.overlay import source_folders

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    # the families' CUDA decoders ship with their packages (kernels/families/<family>/<atom>.cuh)
    assert list(REPO.glob("kernels/families/*/*.cuh")) and "*.cuh" in setuptools["package-data"].get("*", [])
    checked = set(source_folders(REPO).values())
    for top in ("kernels", "fork_patches", "scripts", "benchmarks"):
        for init in (REPO / top).rglob("__init__.py"):
            folder = init.parent.relative_to(REPO).as_posix()
            assert "qpn." + folder.replace("/", ".") in packages, f"{folder}: not in pyproject.toml's packages"
            assert folder in checked, f"{folder}: the overlay check would not see it go stale"
