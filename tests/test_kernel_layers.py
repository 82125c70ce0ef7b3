"""kernels/ is layered (issue 26 item 1): each module imports only modules of lower layers (never
one of its own layer, so there is no cycle), and function-level imports count like top-level ones.
weight_format.py, the bottom, is pure data. A family package (kernels/families/<family>/) is layered
the same way inside (members < codec < checkpoint, layout < numerics), and no family imports
another family's modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast
KERNELS = Path(__file__).resolve().parents[1] / "kernels"
FAMILIES = KERNELS / "families"

# Bottom to top; see docs/architecture.md. "family.<stem>" stands for that module of every family
# package (kernels/families/<family>/<stem>.py); the family packages sit above the shared codec,
# prepack and reference layers they call, the registry (families/__init__.py) above the families it
# hands out (it imports their numerics by name, which the check cannot see: they are the layer
# under it by construction). formats.py loads the families' members modules by folder, likewise.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("weight_format",),                     # the WeightFormat type: data
    ("family.__init__", "family.members"),  # each family's members: data
    ("formats", "family.kernels_sm80"),     # the members gathered, lookups (no torch); each family's sm_80+ kernels (data)
    ("codecs", "families.contract"),        # bit-level minifloat codecs; the family contract
    ("atoms",),                             # geometry per MMA atom
    ("prepack",),                           # the packed-layout base, block reshapes, proofs' helpers
    ("reference", "routes"),                # shared CPU reference helpers, route table
    ("family.codec",                        # each family's source codec;
     "families.integer"),                   # what the integer families share: word values, g_idx, numerics, loader schema
    ("family.checkpoint", "family.layout"),  # checkpoint unpackers; fragment maps, packed layout
    ("family.numerics", "family.loader"),   # each family's CPU reference and numerics class; its loader schema
    ("families",),                          # the registry: format -> numerics
    ("nvrtc", "sm80_tables"),               # NVRTC; the sm_80+ route -> kernel tables (data)
    ("jit", "kernel_inputs"),               # JIT build, entry points, driver; what a dense launch reads
    ("sm80_plan",),                         # sm_80+ launch planning, PDL, eager launch cache
    ("ops", "moe_reference"),               # dense ops (SM70 path, custom op); the MoE reference and routing checks
    ("moe",),                               # grouped MoE
    ("sm70_check", "__main__"),             # tools over everything below
)
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def module_name(path: Path) -> str:
    """kernels/ops.py -> "ops"; kernels/families/__init__.py -> "families";
    kernels/families/int4/layout.py -> "families.int4.layout"."""
    rel = path.relative_to(KERNELS).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1 and len(parts) != 3:
        parts = parts[:-1]
    return ".".join(parts)


def layer_key(module: str) -> str:
    """The LAYERS entry of a module: a family module by its stem ("family.layout")."""
    parts = module.split(".")
    if parts[0] == "families" and len(parts) == 3:
        return f"family.{parts[2]}"
    if parts[0] == "families" and len(parts) == 2 and parts[1] != "contract" and (FAMILIES / parts[1]).is_dir():
        return "family.__init__"
    return module


def _is_module(dotted: str) -> bool:
    base = KERNELS.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path, own: str | None = None) -> list[tuple[int, str]]:
    """(line, kernels module) of every import of a kernels module, at any depth of the file
    (TYPE_CHECKING blocks excepted: they never run), relative imports resolved from ``own``, the
    file's module name (by default its place in kernels/)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    own = own if own is not None else module_name(path)
    # the package relative imports start from: a package's own name for its __init__.py
    package = own.split(".") if path.name == "__init__.py" and not own.endswith("__init__") else own.split(".")[:-1]
    if own.endswith(".__init__"):
        package = own.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *([mod] if mod else [])])
            elif mod.startswith("qpn.kernels"):
                target = mod[len("qpn.kernels"):].lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.append((node.lineno, sub if _is_module(sub) else target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name[len("qpn.kernels."):]) for a in node.names
                      if a.name.startswith("qpn.kernels.")]
    return [(line, t) for line, t in found if t]


def kernels_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(KERNELS.rglob("*.py")) if "__pycache__" not in p.parts}


def test_every_kernels_module_has_a_layer():
    missing = sorted(m for m in kernels_modules() if layer_key(m) not in LAYER_OF and m != "__init__")
    assert not missing, missing


@pytest.mark.parametrize("module", sorted(m for m in kernels_modules() if m != "__init__"))
def test_no_import_reaches_up_or_across(module):
    own = LAYER_OF[layer_key(module)]
    bad = [f"{module} line {line} imports {target} (layer {LAYER_OF.get(layer_key(target))})"
           for line, target in _imports(kernels_modules()[module])
           if layer_key(target) in LAYER_OF and target != module and LAYER_OF[layer_key(target)] >= own]
    assert not bad, f"{module} is in layer {own} {LAYERS[own]}: " + "; ".join(bad)


@pytest.mark.parametrize("module", sorted(m for m in kernels_modules() if m.count(".") == 2))
def test_a_family_imports_no_other_family(module):
    family = module.split(".")[1]
    # the modules of kernels/families/ itself (contract, integer) are shared; the folders are families
    other = [t for _, t in _imports(kernels_modules()[module])
             if t.startswith("families.") and t.split(".")[1] != family and (FAMILIES / t.split(".")[1]).is_dir()]
    assert not other, f"{module} imports {other}: what families share lives below them (codecs, prepack, ...)"


def test_every_registered_family_has_its_package_and_no_package_is_unregistered():
    """The registry imports kernels/families/<family>/numerics.py by the family's registered name
    (no list of modules to extend): each family of formats.ALL_FAMILIES has its package, each
    package is a registered family, and the numerics each names serve that family's formats."""
    from qpn.kernels import families, formats

    assert {p.name for p in FAMILIES.iterdir() if (p / "members.py").is_file()} == set(formats.ALL_FAMILIES)
    for f in formats.ALL_FORMATS:
        num = families.numerics(f)
        assert type(num).__module__ == f"qpn.kernels.families.{f.family}.numerics" and num.fmt is f, f.key


def _imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return imported | {"." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_the_data_layers_import_no_torch():
    """weight_format.py and each family's members.py are pure data; formats.py adds only the
    folder walk that finds the members (the launcher's gates use it on configs alone)."""
    assert _imported(KERNELS / "weight_format.py") <= {"__future__", "dataclasses", "typing"}
    for members in FAMILIES.glob("*/members.py"):
        assert _imported(members) <= {"__future__", "...weight_format"}, members
    for table in FAMILIES.glob("*/kernels_sm80.py"):
        assert _imported(table) <= {"__future__", "...weight_format", ".members"}, table
    assert _imported(KERNELS / "formats.py") <= {"__future__", "importlib", "pathlib", "typing", ".weight_format"}
    assert _imported(FAMILIES / "__init__.py") <= {"__future__", "importlib", "functools", "typing", "..", "."}


def test_the_checker_sees_function_level_and_aliased_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from . import formats\n"
                     "def f():\n    from .moe import PackedMoE\n"
                     "def g():\n    import qpn.kernels.ops as o\n"
                     "def h():\n    from qpn.kernels import jit, nvrtc\n"
                     "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from .moe import PackedExpertStack\n")
    assert sorted(t for _, t in _imports(probe, "ops")) == ["formats", "jit", "moe", "nvrtc", "ops"]
    # inside a family package: up to kernels/, the sibling modules, the other family
    probe.write_text("from ...prepack import chunk_rows\nfrom . import codec, layout\nfrom .members import NVFP4\n"
                     "def f():\n    from ..int4 import codec\n")
    assert sorted(t for _, t in _imports(probe, "families.nvfp4.numerics")) == [
        "families.int4.codec", "families.nvfp4.codec", "families.nvfp4.layout", "families.nvfp4.members", "prepack"]
