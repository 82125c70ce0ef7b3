"""A weight family is one package (issue 41), and two checks keep it so.

Structural: no source file outside kernels/families/<name>/ and tests/ names that family in code,
read by a plain reader (``family_mentions``): an identifier containing the family's name (its
members', classes' and decoders' names contain it: PackedNVFP4, FP8_TENSOR, DecINT4Sym), or a
string literal (docstrings aside) holding the family's or a member's name as a word. The byte
dtypes every family's buffers are stored in (torch.uint8, torch.int8, and uint8 inside a name) are
not the INT8 family, whose name they contain (BYTE_DTYPES). The files that
still do are the work left of issue 41 (the conventions, the linear methods, the sm_80+ tables, the
CUDA sources, the checkpoint generators, the benchmarks): NAMED_OUTSIDE_THEIR_FAMILY holds each
with its count today, a count may only fall (and the table with it), and no other file may start.

Branches: runtime code outside a family's own package never branches on that family's name. What differs between
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
import re
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
    """The family whose package ``path`` lies in (kernels/families/<name>/...), else None."""
    rel = path.relative_to(REPO).parts if path.is_relative_to(REPO) else ()
    return rel[2] if rel[:2] == ("kernels", "families") and len(rel) > 3 else None


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


# ------------------------------------------------------------------------------ structural
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".sh")
SOURCE_TOPS = ("kernels", "fork_patches", "scripts", "benchmarks", "qpn")

# File -> how many times it names a family in code today (family_mentions). The work left of
# issue 41 items 1-3: each entry goes when its file reads the families through the contract and
# the registry only. A count may fall, never rise, and a file not listed may name no family.
NAMED_OUTSIDE_THEIR_FAMILY = {
    "benchmarks/engine_arms.py": 9,
    "benchmarks/kernel_matched_bench.py": 59,
    "benchmarks/moe_bench.py": 8,
    "benchmarks/perf_model.py": 6,
    "benchmarks/read_probe.py": 3,
    "benchmarks/spec_identity_cost.py": 17,
    "benchmarks/v100_calibration.py": 76,
    "benchmarks/v100_estimate.py": 47,
    "benchmarks/v100_evidence.py": 1,
    "fork_patches/engine/engine_source.py": 8,
    "fork_patches/engine/hooks.py": 4,
    "fork_patches/engine/kv_policy.py": 15,
    "fork_patches/engine/platform_gate.py": 2,
    "fork_patches/quant/conventions.py": 30,
    "fork_patches/quant/ct_config.py": 4,
    "fork_patches/quant/moe_method.py": 24,
    "fork_patches/quant/qpn_config.py": 2,
    "fork_patches/route_census/attention_routes.py": 8,
    "kernels/csrc/qpn_kernels_sm80.cu": 3,
    "kernels/ops.py": 19,
    "scripts/checkpoints/checkpoint_reference.py": 23,
    "scripts/checkpoints/ct_reference.py": 20,
    "scripts/checkpoints/int4_reference.py": 8,
    "scripts/checkpoints/make_checkpoint.py": 14,
    "scripts/checkpoints/make_ct_checkpoint.py": 84,
    "scripts/checkpoints/make_int4_checkpoint.py": 15,
    "scripts/checkpoints/make_moe_checkpoint.py": 17,
    "scripts/checkpoints/modelopt_export.py": 8,
    "scripts/checkpoints/tiny_hybrid.py": 9,
    "scripts/launcher/demo.py": 4,
    "scripts/launcher/serve_preflight.py": 2,
}


def family_words() -> dict[str, str]:
    """Every family's name and its members' keys (lower case) -> the family."""
    return {**{f.key: f.family for f in formats.ALL_FORMATS}, **{name: name for name in formats.ALL_FAMILIES}}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


# The byte containers: every family stores its codes and records as torch.uint8 (torch.int8 for
# signed bytes), and code that moves bytes says so (unpack_fp4_from_uint8), so neither names the
# family named after its code width (INT8). Only these two and only as the dtype: torch.<dtype>, and
# "uint8" inside an identifier; INT8_SYM, DecINT8, families.int8 still name the family.
BYTE_DTYPES = ("uint8", "int8")
_BYTE_DTYPE_IN_NAME = re.compile("uint8", re.I)


def _python_names(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append(node.id)
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in BYTE_DTYPES:
                continue
            out.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, ast.arg):
            out.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.append(node.arg)
        elif isinstance(node, ast.alias):
            out += [part for part in (node.asname or node.name).split(".")] + node.name.split(".")
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += node.module.split(".")
    return out


def family_mentions(text: str, suffix: str) -> list[tuple[str, str]]:
    """(family, what) for each place a source file names a family in code: an identifier holding a
    family's name (any case), or a string literal with a family's or member's name as a word;
    docstrings and comments are prose and do not count. Python is read with ``ast``; CUDA and shell
    with their comments removed, every identifier and quoted word counted."""
    words = family_words()
    pattern = re.compile("|".join(sorted(map(re.escape, set(words.values())), key=len, reverse=True)), re.I)
    found = []
    if suffix == ".py":
        tree = ast.parse(text)
        for name in _python_names(tree):
            if (m := pattern.search(_BYTE_DTYPE_IN_NAME.sub(" ", name))):
                found.append((m.group(0).lower(), name))
        skip = _docstrings(tree)
        strings = [n.value for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]
    else:
        code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S) if suffix != ".sh" else \
            re.sub(r"(^|\s)#[^\n]*", " ", text)
        for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code):
            if (m := pattern.search(_BYTE_DTYPE_IN_NAME.sub(" ", name))):
                found.append((m.group(0).lower(), name))
        strings = []
    for value in strings:
        for word in re.findall(r"[A-Za-z0-9_]+", value):
            if word.lower() in words:
                found.append((words[word.lower()], repr(value)))
    return found


def outside_mentions() -> dict[str, int]:
    """Source file (repository-relative) -> how many times it names a family it is not part of."""
    out = {}
    for top in SOURCE_TOPS:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            own = _own_family(path)
            hits = [fam for fam, _ in family_mentions(path.read_text(), path.suffix) if fam != own]
            if hits:
                out[str(path.relative_to(REPO))] = len(hits)
    return out


def test_no_file_outside_a_family_names_it():
    """The structural isolation check (issue 41 item 3), and its ratchet."""
    counts = outside_mentions()
    new = {p: n for p, n in counts.items() if p not in NAMED_OUTSIDE_THEIR_FAMILY}
    assert not new, ("these files name a weight family outside its package kernels/families/<name>/; reach "
                     f"the family through families.numerics(fmt) and its WeightFormat instead: {new}")
    grew = {p: (NAMED_OUTSIDE_THEIR_FAMILY[p], n) for p, n in counts.items() if n > NAMED_OUTSIDE_THEIR_FAMILY[p]}
    assert not grew, f"more family names than before (was, now): {grew}"
    fell = {p: (n, counts.get(p, 0)) for p, n in NAMED_OUTSIDE_THEIR_FAMILY.items() if counts.get(p, 0) < n}
    assert not fell, f"fewer family names than the table says: lower NAMED_OUTSIDE_THEIR_FAMILY (was, now): {fell}"


@pytest.mark.parametrize("where, code, suffix, count", [
    ("kernels/ops.py", "x = PackedNVFP4\n", ".py", 1),                               # a family's class
    ("kernels/ops.py", "from .families.int4 import codec\n", ".py", 1),              # its module
    ("kernels/ops.py", 'f = formats.weight_format("fp8_channel")\n', ".py", 1),       # a member by key
    ("kernels/ops.py", "def f(fmt):\n    return fmt.decoder\n", ".py", 0),           # through the data
    ("kernels/ops.py", '"""NVFP4 in prose"""\n# int4 in a comment\n', ".py", 0),      # prose
    ("kernels/csrc/qpn_kernels.cu", "// DecFP8 in a comment\nQPN_ENTRY(k, Frag16NVFP4)\n", ".cu", 1),
    ("kernels/families/fp8/layout.py", "x = PackedFP8\n", ".py", 0),                  # its own package
    ("kernels/families/fp8/layout.py", "x = PackedNVFP4\n", ".py", 1),                # another family's
    ("kernels/ops.py", "a = torch.uint8\nb = torch.int8\nc = t.view(torch.uint8)\n", ".py", 0),  # byte dtypes
    ("kernels/ops.py", "def unpack_fp4_from_uint8(t):\n    pass\n", ".py", 0),        # uint8 in a name
    ("kernels/csrc/qpn_kernels.cu", "typedef uint8_t u8;\n", ".cu", 0),
    ("kernels/ops.py", "x = formats.INT8_SYM\ny = DecINT8\n", ".py", 2),               # the INT8 family
    ("kernels/ops.py", "from .families.int8 import codec\n", ".py", 1),
    ("kernels/ops.py", "x = np.int8\n", ".py", 1),                                    # int8 not torch's dtype
])
def test_the_structural_check_catches_a_seeded_violation(where, code, suffix, count):
    own = _own_family(REPO / where)
    assert len([f for f, _ in family_mentions(code, suffix) if f != own]) == count


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


@pytest.mark.parametrize("source", ["qpn_kernels_sm80.cu", "qpn_moe.cu", "qpn_moe_sm80.cu"])
def test_the_other_kernel_sources_list_no_kernel(source):
    """The m16n8k16 dense source and both MoE sources hold templates and entry macros only; their
    entry lines are written from data as NVRTC compiles them: the families' configured kernels
    (kernels/families/<family>/kernels_sm80.py, jit.sm80_entry_lines) and MoE kernels
    (jit.moe_entry_lines: m8n8k4 from the formats' data, m16n8k16 the families' MOE_ENTRIES)."""
    from qpn.kernels import jit, moe, nvrtc, sm80_tables

    on_disk, compiled = nvrtc.read_sources()[source], jit.kernel_sources()[source]
    assert not re.search(r"^\w+_ENTRY\(", on_disk, re.M)
    if source == jit.ATOM_SOURCES["m16n8k16"]:
        names, lines = jit.ENTRY_POINTS["m16n8k16"], [e.line for e in sm80_tables.SM80_ENTRIES]
        assert len(lines) > 40 and set(names) <= {e.name for e in sm80_tables.SM80_ENTRIES}
    else:
        atom = next(a for a, s in jit.MOE_SOURCES.items() if s == source)
        names, lines = moe.MOE_ENTRY_POINTS[atom], jit.moe_entry_lines(atom).splitlines()[2:]
    assert lines and all(f"\n{line}\n" in compiled for line in lines)
    assert all(re.search(rf"^\w+_ENTRY\({name},", compiled, re.M) for name in names)


def test_a_family_module_may_name_its_own_family_only():
    own = REPO / "kernels" / "families" / "fp8" / "layout.py"
    assert not branches_on_family('if fmt == "fp8_channel":\n    pass\n', own, {})
    assert branches_on_family('if fmt == "nvfp4":\n    pass\n', own, {})
