"""A weight family is one module (issue 26, "Done means"): runtime code outside a family's own
module (kernels/family_<name>.py) never branches on that family's name. What differs between
families is an attribute of the family's registered data (kernels/formats.py) or a function of its
module, so a fourth family (MXFP4: docs/architecture.md, "Adding a weight family") touches only the
files listed there.

The check reads the runtime sources (kernels/, fork_patches/, scripts/launcher/) with ``ast`` and
flags every comparison (==, !=, in, not in, is, is not) one of whose sides is a family's name: a
string literal that names a family or a format key ("nvfp4", "fp8", "fp8_channel", "int4", ...),
a module constant bound to one (``FP8 = formats.FP8_TENSOR.family``), or a registered format
object (``formats.FP8_TENSOR``, ``NVFP4`` imported from formats)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from qpn.kernels import formats

pytestmark = pytest.mark.fast

from tests._ci import REPO  # noqa: E402
RUNTIME = ("kernels", "fork_patches", "scripts/launcher")
# Not runtime names: the NVFP4 kernels' operand forms and the checkpoint-side algo strings are
# compared as what they are (ops.nvfp4_form, ModelOpt quant_algo), not as a family.
FUTURE = ("mxfp4",)  # named by docs/architecture.md; no module may special-case it either


def family_names() -> dict[str, str]:
    """Every name that denotes a family or one of its formats -> the family."""
    out = {f.key: f.family for f in formats.ALL_FORMATS}
    out.update({name: name for name in formats.ALL_FAMILIES})
    out.update({name: name for name in FUTURE})
    return out


def format_objects() -> dict[str, str]:
    """Attribute names of kernels/formats.py bound to a registered format -> its family."""
    return {name: v.family for name, v in vars(formats).items()
            if isinstance(v, formats.WeightFormat)}


def runtime_modules() -> list[tuple[str, Path]]:
    out = []
    for top in RUNTIME:
        for path in sorted((REPO / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO).with_suffix("")
            out.append(("qpn." + ".".join(rel.parts), path))
    return out


def _own_family(path: Path) -> str | None:
    stem = path.stem
    return stem[len("family_"):] if path.parent.name == "kernels" and stem.startswith("family_") else None


def _module_constants(modname: str, names: dict[str, str]) -> dict[str, str]:
    """Module-level names bound to a family name (``FP8 = formats.FP8_TENSOR.family``)."""
    try:
        mod = importlib.import_module(modname)
    except Exception:           # a module that needs the engine to import: its literals still count
        return {}
    return {k: names[v] for k, v in vars(mod).items() if isinstance(v, str) and v in names and not k.startswith("__")}


def _side_family(node: ast.AST, names, constants, objects) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return names.get(node.value)
    if isinstance(node, ast.Name):
        return constants.get(node.id) or objects.get(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "formats":
        return objects.get(node.attr)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for elt in node.elts:
            fam = _side_family(elt, names, constants, objects)
            if fam:
                return fam
    return None


def branches_on_family(source: str, path: Path, constants: dict[str, str]) -> list[str]:
    """'path:line: family' for every comparison against a family's name outside its own module."""
    names, objects = family_names(), format_objects()
    own = _own_family(path)
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            fam = _side_family(side, names, constants, objects)
            if fam and fam != own:
                out.append(f"{path.relative_to(REPO)}:{node.lineno}: {fam}")
                break
    return out


def test_no_runtime_module_branches_on_a_family_name():
    names = family_names()
    bad = []
    for modname, path in runtime_modules():
        bad += branches_on_family(path.read_text(), path, _module_constants(modname, names))
    assert not bad, ("runtime code branches on a weight family's name; make the difference a field of the "
                     "family's registered data (kernels/formats.py) or a function of its family module:\n  "
                     + "\n  ".join(bad))


@pytest.mark.parametrize("code, caught", [
    ('if fmt == "nvfp4":\n    pass\n', True),
    ('if "fp8" != f.family:\n    pass\n', True),
    ('ok = f.key in ("int4_sym", "x")\n', True),
    ('if fmt is formats.FP8_TENSOR:\n    pass\n', True),
    ('if fam == FP8:\n    pass\n', True),             # FP8 bound to "fp8" in the module
    ('if fmt == "mxfp4":\n    pass\n', True),
    ('if f.has_group_scales:\n    pass\n', False),      # a registered attribute: the right way
    ('if form == "s7":\n    pass\n', False),
    ('x = {"nvfp4": 1}\n', False),                       # data, not a branch
])
def test_the_check_catches_each_way_of_naming_a_family(code, caught):
    path = REPO / "kernels" / "ops.py"
    assert bool(branches_on_family(code, path, {"FP8": "fp8"})) == caught


def test_the_sm70_kernel_source_names_no_family():
    """csrc/qpn_kernels.cu (the m8n8k4 kernels) holds the kernel templates and their entry macros
    only: no entry point and no decoder of any registered format. Its entry lines are written from
    each format's data (jit.sm70_entry_lines), so a new family adds a decoder to qpn_family.cuh and
    a WeightFormat, and edits no kernel source."""
    import re

    from qpn.kernels import jit, nvrtc

    on_disk = nvrtc.read_sources()[jit.MAIN_SOURCE]
    compiled = jit.kernel_sources()[jit.MAIN_SOURCE]
    names = {n for f in formats.KERNEL_FORMATS for k in f.m8n8k4_kernels() for n in (k.name, k.decoder)}
    assert names and all(re.search(rf"\b{n}\b", compiled) for n in names)   # the check can see them
    assert not {n for n in names if re.search(rf"\b{n}\b", on_disk)}
    assert not re.search(r"^\w+_ENTRY\(", on_disk, re.M)


def test_a_family_module_may_name_its_own_family_only():
    own = REPO / "kernels" / "family_fp8.py"
    assert not branches_on_family('if fmt == "fp8_channel":\n    pass\n', own, {})
    assert branches_on_family('if fmt == "nvfp4":\n    pass\n', own, {})
