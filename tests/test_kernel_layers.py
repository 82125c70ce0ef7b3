"""kernels/ is layered (issue 26 item 1): each module imports only modules of lower layers (never
one of its own layer, so there is no cycle), and function-level imports count like top-level ones. formats.py, the bottom, is pure data: it imports
nothing of the package, no torch, and resolves nothing by string (no importlib)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast
KERNELS = Path(__file__).resolve().parents[1] / "kernels"

# Bottom to top; see docs/architecture.md. Family numerics sit above the shared codec, prepack and
# reference layers they call; the registry (families.py) above the families it hands out (it
# imports them by name, which the check below cannot see: they are the layer under it by construction).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("formats",),                           # data
    ("codecs",),                            # bit-level codecs
    ("atoms",),                             # fragment maps per MMA atom
    ("prepack",),                           # packed layouts and their proven inverse
    ("reference", "routes"),                # CPU reference, route table
    tuple(sorted(p.stem for p in KERNELS.glob("family_*.py"))),   # one module per weight family's numerics
    ("families",),                          # format -> numerics
    ("nvrtc", "sm80_tables"),               # NVRTC; the sm_80+ route -> kernel tables (data)
    ("jit", "kernel_inputs"),               # JIT build, entry points, driver; what a dense launch reads
    ("sm80_plan",),                         # sm_80+ launch planning, PDL, eager launch cache
    ("ops", "moe_reference"),               # dense ops (SM70 path, custom op); the MoE reference and routing checks
    ("moe",),                               # grouped MoE
    ("sm70_check", "__main__"),             # tools over everything below
)
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, kernels module) of every import of a sibling module, at any depth of the file
    (TYPE_CHECKING blocks excepted: they never run)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                names = [base.split(".")[0]] if base else [a.name for a in node.names]
            elif base.startswith("qpn.kernels"):
                rest = base[len("qpn.kernels"):].lstrip(".")
                names = [rest.split(".")[0]] if rest else [a.name for a in node.names]
            else:
                continue
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[2]) for a in node.names
                      if a.name.startswith("qpn.kernels.")]
    return found


def test_every_kernels_module_has_a_layer():
    modules = {p.stem for p in KERNELS.glob("*.py")} - {"__init__"}
    assert modules == set(LAYER_OF), (sorted(modules - set(LAYER_OF)), sorted(set(LAYER_OF) - modules))


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_no_import_reaches_up_or_across(module):
    own = LAYER_OF[module]
    bad = [f"kernels/{module}.py:{line} imports {target} (layer {LAYER_OF.get(target)})"
           for line, target in _imports(KERNELS / f"{module}.py")
           if target in LAYER_OF and target != module and LAYER_OF[target] >= own]
    assert not bad, f"{module} is in layer {own} {LAYERS[own]}: " + "; ".join(bad)


def test_every_registered_family_has_its_module_and_no_module_is_unregistered():
    """families.py imports kernels/family_<family>.py by the family's registered name (no list of
    modules to extend): each family of formats.ALL_FAMILIES has its module, each family module is a
    registered family, and the numerics each module names serve that family's formats."""
    from qpn.kernels import families, formats

    assert {p.stem for p in KERNELS.glob("family_*.py")} == {f"family_{f}" for f in formats.ALL_FAMILIES}
    assert list(families.NUMERICS) == list(formats.ALL_FAMILIES)
    for f in formats.ALL_FORMATS:
        num = families.numerics(f)
        assert type(num).__module__ == f"qpn.kernels.family_{f.family}" and num.fmt is f, f.key


def test_formats_is_pure_data():
    text = (KERNELS / "formats.py").read_text()
    tree = ast.parse(text)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported
    assert "importlib" not in text and "__import__" not in text


def test_the_checker_sees_function_level_and_aliased_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from . import formats\n"
                     "def f():\n    from .moe import PackedMoE\n"
                     "def g():\n    import qpn.kernels.ops as o\n"
                     "def h():\n    from qpn.kernels import jit, nvrtc\n"
                     "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from .moe import PackedExpertStack\n")
    assert sorted(t for _, t in _imports(probe)) == ["formats", "jit", "moe", "nvrtc", "ops"]
