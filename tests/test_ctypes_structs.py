"""The kernel argument structs: every ctypes.Structure the launchers fill (kernels/ops.py,
kernels/sm80_plan.py, kernels/moe.py) has the layout of its CUDA struct in kernels/csrc (same field names in the same
order, same offsets and sizes, same total size).

The CUDA side's layout is not computed here by C layout rules: the struct definitions are cut
verbatim out of the sources and compiled by NVRTC 12 (the compiler the kernels are built with)
inside a probe kernel that stores sizeof / the offset / the size of every field; the values are
read back from the probe's PTX. Field names come from the struct text, so a field added where
padding hides it (the total size unchanged) still fails.
"""
from __future__ import annotations

import ctypes
import re

import pytest

from qpn.kernels import moe, nvrtc, ops, sm80_plan

pytestmark = pytest.mark.fast

MODULES = (ops, moe, sm80_plan)


# The CUDA driver's own launch description (cuda.h), not a kernel argument block: checked below
# against the header's layout.
DRIVER_STRUCTS = {"LaunchConfig", "LaunchAttr"}


def ctypes_structs() -> dict[str, type]:
    """Every ctypes.Structure class defined in the launcher modules, by name (the driver API's
    launch structs aside)."""
    out = {}
    for mod in MODULES:
        for name, obj in vars(mod).items():
            if (isinstance(obj, type) and issubclass(obj, ctypes.Structure) and obj.__module__ == mod.__name__
                    and name not in DRIVER_STRUCTS):
                out[name] = obj
    return out


def test_driver_launch_structs_have_the_cuda_h_layout():
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute (cuda.h, CUDA 12.0-13.0; the
    attribute value is a 64-byte union): offsets and sizes on a 64-bit host. A wrong offset would
    hand the driver a garbage stream or attribute list on the first PDL launch."""
    cfg = {f: (getattr(sm80_plan.LaunchConfig, f).offset, getattr(sm80_plan.LaunchConfig, f).size)
           for f, _ in sm80_plan.LaunchConfig._fields_}
    assert list(cfg) == ["gx", "gy", "gz", "bx", "by", "bz", "smem", "stream", "attrs", "nattrs"]
    assert [cfg[f][0] for f in cfg] == [0, 4, 8, 12, 16, 20, 24, 32, 40, 48]
    assert ctypes.sizeof(sm80_plan.LaunchConfig) == 56
    attr = sm80_plan.LaunchAttr
    assert (attr.id.offset, attr.value.offset, ctypes.sizeof(attr)) == (0, 8, 72)
    assert ctypes.sizeof(sm80_plan.LaunchAttrValue) == 64
    c = sm80_plan.pdl_config(grid=7, block=256, smem=1024, stream=0x1234)
    assert (c.gx, c.gy, c.gz, c.bx, c.by, c.bz, c.smem, c.stream, c.nattrs) == (7, 1, 1, 256, 1, 1, 1024, 0x1234, 1)
    assert c.attrs[0].id == sm80_plan.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert c.attrs[0].value.i == 1


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def cuda_struct(name: str, sources: dict[str, str]) -> str:
    """The text ``struct <name> { ... };`` of the one csrc file that defines it."""
    found = []
    for fname, text in sources.items():
        for m in re.finditer(r"\bstruct\s+" + re.escape(name) + r"\s*\{", text):
            depth, i = 0, m.end() - 1
            while True:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    break
                i += 1
            end = text.index(";", i)
            found.append((fname, text[m.start():end + 1]))
    assert len(found) == 1, f"struct {name}: expected one definition in kernels/csrc, found {[f for f, _ in found]}"
    return found[0][1]


def cuda_struct_names(sources: dict[str, str]) -> set[str]:
    """Structs passed to kernels by value: every ``struct <Name>Args`` of the sources."""
    return {m.group(1) for text in sources.values() for m in re.finditer(r"\bstruct\s+(\w+Args)\s*\{", text)}


def cuda_field_names(struct_text: str) -> list[str]:
    """Field names in declaration order, from the struct's text (``int m, n;`` -> m, n)."""
    body = _strip_comments(struct_text)
    body = body[body.index("{") + 1:body.rindex("}")]
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        for j, declarator in enumerate(decl.split(",")):
            m = re.search(r"(\w+)\s*(\[[^\]]*\])?\s*$", declarator)
            assert m and (j > 0 or len(declarator.split()) >= 2), f"cannot read declaration {decl!r}"
            names.append(m.group(1))
    return names


def cuda_layouts(nv, structs: dict[str, str]) -> dict[str, dict]:
    """{name: {"size": sizeof, "fields": {field: (offset, size)}}} as NVRTC lays the structs out."""
    slots, lines = [], []
    for name, text in structs.items():
        slots.append((name, None, "size"))
        lines.append(f"sizeof({name})")
        for f in cuda_field_names(text):
            slots.append((name, f, "offset"))
            lines.append(f"(unsigned long long)&(((({name}*)0))->{f})")
            slots.append((name, f, "size"))
            lines.append(f"sizeof(((({name}*)0))->{f})")
    stores = "\n".join(f"  out[{i}] = {expr};" for i, expr in enumerate(lines))
    src = ('#include "qpn_ptx.cuh"\n' + "\n".join(structs.values())
           + '\nextern "C" __global__ void qpn_layout_probe(unsigned long long* out) {\n' + stores + "\n}\n")
    ptx = nv.compile(src, "qpn_layout_probe.cu", 70, ["--std=c++17"], want_cubin=False).ptx
    values = _stored_constants(ptx)
    assert sorted(values) == list(range(len(slots))), "the probe's PTX does not store every layout value"
    out: dict[str, dict] = {}
    for i, (name, field, what) in enumerate(slots):
        entry = out.setdefault(name, {"size": None, "fields": {}})
        if field is None:
            entry["size"] = values[i]
        else:
            off, size = entry["fields"].get(field, (None, None))
            entry["fields"][field] = (values[i], size) if what == "offset" else (off, values[i])
    return out


def _stored_constants(ptx: str) -> dict[int, int]:
    """{out index: value} from the probe's PTX: each ``st.global.u64 [%rdB+8i], v`` with v an
    immediate or a register loaded by ``mov.u64 %rdX, v``."""
    regs, base, values = {}, None, {}
    for line in ptx.splitlines():
        m = re.match(r"\s*mov\.u64\s+(%rd\d+),\s*(\d+);", line)
        if m:
            regs[m.group(1)] = int(m.group(2))
            continue
        m = re.match(r"\s*st\.global\.u64\s+\[(%rd\d+)(?:\+(\d+))?\],\s*(%rd\d+|\d+);", line)
        if m:
            assert base in (None, m.group(1)), "probe stores through more than one base register"
            base = m.group(1)
            off, v = int(m.group(2) or 0), m.group(3)
            assert off % 8 == 0
            values[off // 8] = regs[v] if v.startswith("%") else int(v)
    return values


def mismatches(cls: type, layout: dict, names: list[str]) -> list[str]:
    """What differs between a ctypes struct and its CUDA layout (empty: identical)."""
    py_names = [f[0] for f in cls._fields_]
    problems = []
    if py_names != names:
        problems.append(f"fields differ: ctypes {py_names} vs CUDA {names}")
    if ctypes.sizeof(cls) != layout["size"]:
        problems.append(f"size differs: ctypes {ctypes.sizeof(cls)} vs CUDA {layout['size']}")
    for f in py_names:
        if f in layout["fields"]:
            py = (getattr(cls, f).offset, getattr(cls, f).size)
            if py != layout["fields"][f]:
                problems.append(f"{f}: ctypes (offset, size) {py} vs CUDA {layout['fields'][f]}")
    return problems


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return nvrtc.read_sources()


def test_every_kernel_argument_struct_has_a_ctypes_twin(sources):
    py = ctypes_structs()
    assert set(py) == cuda_struct_names(sources), (sorted(py), sorted(cuda_struct_names(sources)))
    assert {"QpnArgs", "Qpn80Args", "MoeAlignArgs", "MoeGemmArgs", "MoeCombineArgs"} <= set(py)


def test_ctypes_structs_have_the_cuda_layout(nvrtc12, sources):
    py = ctypes_structs()
    texts = {name: cuda_struct(name, sources) for name in py}
    layouts = cuda_layouts(nvrtc12, texts)
    for name, cls in py.items():
        assert mismatches(cls, layouts[name], cuda_field_names(texts[name])) == [], name
        # the probe saw real layouts: pointers are 8 bytes, every struct holds one
        assert 8 in {size for _, size in layouts[name]["fields"].values()}, name


def _ctypes_variant(cls: type, fields: list) -> type:
    return type(cls.__name__, (ctypes.Structure,), {"_fields_": fields})


CUDA_MUTATIONS = {
    # (struct, old text, new text): one-sided changes of the CUDA struct the check must see
    "reorder": ("QpnArgs", "int m, n, kblocks, ldx;", "int n, m, kblocks, ldx;"),
    "widen": ("QpnArgs", "int chscale_per_channel;", "long long chscale_per_channel;"),
    "add_in_padding": ("MoeAlignArgs", "int pairs, num_experts, rows_per_group;",
                       "int pairs, num_experts, rows_per_group, spare;"),
    "array_length": ("MoeGemmArgs", "const u8* codes[2];", "const u8* codes[3];"),
}


@pytest.mark.parametrize("mutation", sorted(CUDA_MUTATIONS))
def test_check_fails_on_a_cuda_side_change(nvrtc12, sources, mutation):
    name, old, new = CUDA_MUTATIONS[mutation]
    text = cuda_struct(name, sources)
    assert text.count(old) == 1, f"mutation {mutation} no longer matches struct {name}: update it"
    mutated = text.replace(old, new)
    layout = cuda_layouts(nvrtc12, {name: mutated})[name]
    found = mismatches(ctypes_structs()[name], layout, cuda_field_names(mutated))
    assert found, f"CUDA-side mutation '{mutation}' of {name} passed the layout check"
    if mutation == "add_in_padding":
        assert layout["size"] == ctypes.sizeof(moe.MoeAlignArgs)  # only the field names show it


def test_check_fails_on_a_ctypes_side_change(nvrtc12, sources):
    cls = sm80_plan.Qpn80Args
    text = cuda_struct("Qpn80Args", sources)
    layout = cuda_layouts(nvrtc12, {"Qpn80Args": text})["Qpn80Args"]
    names = cuda_field_names(text)
    fields = list(cls._fields_)
    swapped = fields[:]
    swapped[8], swapped[9] = swapped[9], swapped[8]                      # m <-> n
    widened = [(f, ctypes.c_longlong if f == "chunks" else t) for f, t in fields]
    added = fields + [("spare", ctypes.c_int)]
    dropped = fields[:-1]
    for label, variant in (("swapped", swapped), ("widened", widened), ("added", added), ("dropped", dropped)):
        assert mismatches(_ctypes_variant(cls, variant), layout, names), label
