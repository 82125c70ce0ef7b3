"""Every weight family implements the one contract (kernels/families/contract.py), and the registry
refuses a family package that does not, by name.

The behaviour behind each member (every byte value through the prepack inverse, the references
against float64 decodes, the kernels) is tested per family in tests/test_weight_formats.py,
tests/test_prepack.py, tests/test_family_int4.py and the GPU files; here: the shape of a family
package, what the contract promises for every member of every family on both atoms, and that a
broken package fails loudly."""
from __future__ import annotations

import importlib
import shutil
import sys

import pytest
import torch

from qpn.kernels import families, formats, prepack
from qpn.kernels.atoms import KNOWN_ATOMS
from qpn.kernels.families import contract
from tests._ci import REPO

pytestmark = pytest.mark.fast
FAMILIES_DIR = REPO / "kernels" / "families"


def test_each_family_folder_is_a_package_with_members_and_numerics():
    folders = sorted(p.name for p in FAMILIES_DIR.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(formats.ALL_FAMILIES)
    ranks = []
    for name in folders:
        members = importlib.import_module(f"qpn.kernels.families.{name}.members")
        assert members.MEMBERS and all(m.family == name for m in members.MEMBERS), name
        assert formats.ALL_FAMILIES[name] is members.MEMBERS[0]
        ranks.append(members.RANK)
        assert not contract.missing(families.numerics_class(name)), name
    assert len(set(ranks)) == len(ranks)
    assert list(formats.ALL_FAMILIES) == [f for _, f in sorted(zip(ranks, folders))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in element order (a fresh buffer: an expanded one-element scale has stride 0)."""
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8)


def _source(fmt, n=48, k=128, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    return families.numerics(fmt).quantize(w)


@pytest.mark.parametrize("atom", KNOWN_ATOMS)
@pytest.mark.parametrize("fmt", formats.ALL_FORMATS, ids=lambda f: f.key)
def test_what_the_contract_promises_for_every_member(fmt, atom):
    num = families.numerics(fmt)
    assert isinstance(num, contract.FamilyNumerics) and num.fmt is fmt
    src = _source(fmt)
    packed = num.prepack(*src, atom=atom)
    assert isinstance(packed, num.packed_type) and isinstance(packed, prepack.PackedLayout)
    assert families.numerics(packed) is num and packed.format is fmt
    num.verify_roundtrip(packed, *src)
    back = num.unprepack(packed)
    assert len(back) == len(src)
    for a, b in zip(back, src):
        b = torch.as_tensor(b)
        assert torch.equal(_bytes(a), _bytes(b))
    # the kernel tensors give the same packed weight back
    codes, scales, out_scale = num.packed_tensors(packed)
    again = num.packed_from_tensors(codes, scales, out_scale.float(), packed.n, packed.k, atom)
    num.verify_roundtrip(again, *src)
    # the references: exact float64 of x @ W^T, float32 within FP16 rounding of it
    x = torch.randn(3, packed.k, generator=torch.Generator().manual_seed(1))
    w64 = num.decode_f64(*src)
    y64 = num.reference_linear_f64(x, packed)
    assert torch.allclose(y64, x.double() @ w64.t(), rtol=1e-12, atol=1e-12)
    assert torch.equal(families.reference_linear_f64(x, packed), y64)
    y16 = families.reference_linear(x, packed)
    assert y16.dtype == torch.float16
    assert float((y16.double() - y64).abs().max()) <= 2e-3 * float(y64.abs().max()) + 1e-6
    # decode_packed: the weights before the output scale and that scale per row, read from the
    # packed buffers, give the source's float32 decode back
    vals, row_scale = num.decode_packed(packed)
    assert row_scale.shape == (packed.n,)
    assert torch.equal(vals * row_scale.reshape(-1, 1), num.decode_f32(*src))


def test_a_wrong_source_byte_is_named_by_every_family():
    for fmt in formats.ALL_FORMATS:
        num = families.numerics(fmt)
        src = list(_source(fmt))
        packed = num.prepack(*src)
        codes = src[0].clone()
        flat = codes.view(torch.uint8).reshape(-1)
        flat[5] ^= 0x01
        with pytest.raises(prepack.PrepackMismatch, match="differ"):
            num.verify_roundtrip(packed, codes, *src[1:])


def test_the_registry_refuses_a_family_that_breaks_the_contract(tmp_path, monkeypatch):
    """A copy of the FP8 family whose numerics class lost ``unprepack``: the registry names the
    package and the missing member instead of failing later inside a load."""
    copy = tmp_path / "broken"
    shutil.copytree(FAMILIES_DIR / "fp8", copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / "numerics.py").read_text()
    assert text.count("    def unprepack(") == 1
    (copy / "numerics.py").write_text(text.replace("    def unprepack(", "    def _unprepack_gone("))
    name = "qpn.kernels.families.broken"
    spec = importlib.util.spec_from_file_location(name, copy / "__init__.py", submodule_search_locations=[str(copy)])
    pkg = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, pkg)
    spec.loader.exec_module(pkg)
    try:
        with pytest.raises(families.ContractError, match=r"kernels/families/broken/numerics\.py .*lacks unprepack"):
            families.numerics_class("broken")
        assert families.numerics_class("fp8")         # control: the real package passes
    finally:
        families.numerics_class.cache_clear()
        for key in [k for k in sys.modules if k.startswith(name + ".")]:
            del sys.modules[key]


def test_every_served_family_has_a_loader_schema_the_linear_method_reads():
    """The one QPN linear method reads a family only through its loader schema: every served family
    has one implementing contract.FamilyLoader, each stored tensor's symbols give shapes, and a
    schema that lost a member is refused naming the package and the member."""
    for family in formats.FAMILIES:
        obj = families.loader_of(family)
        assert isinstance(obj, contract.FamilyLoader), family
    spec = contract.StoredTensor("codes", "qweight", ("K/8", "N"), torch.int32, (torch.int32,), packed_factor=8)
    assert spec.shape(n=24, k=256) == (32, 24)
    assert contract.StoredTensor("z", "qzeros", ("K/g", "N/8"), torch.int32, ()).shape(n=20, k=256, g=64) == (4, 3)
    assert contract.StoredTensor("s", "s", ("P",), torch.float32, ()).shape(n=8, k=8, parts=3) == (3,)


def test_the_registry_refuses_a_loader_schema_that_breaks_the_contract(monkeypatch):
    import types

    broken = types.ModuleType("qpn.kernels.families.fp8.loader")
    broken.LOADER = types.SimpleNamespace(stored=None, geometry_problem=None, value_problem=None)  # no sources
    monkeypatch.setitem(sys.modules, "qpn.kernels.families.fp8.loader", broken)
    families.loader_of.cache_clear()
    try:
        with pytest.raises(families.ContractError, match=r"kernels/families/fp8/loader\.py .*lacks sources"):
            families.loader_of("fp8")
    finally:
        families.loader_of.cache_clear()
