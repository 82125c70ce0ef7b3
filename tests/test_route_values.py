"""Routes as values (kernels/routes.py): a route name is parsed once into a Route, ``str(route)``
gives the name back byte for byte, and nothing outside routes.py takes route names apart."""
from __future__ import annotations

import pathlib
import re

import pytest

from qpn.kernels import families, formats, jit, ops, routes, sm80_plan, sm80_tables

pytestmark = pytest.mark.fast

# What each route name means, written out by hand from the route table in routes.py's docstring:
# (format, kernel, token tiles per weight pass, chunk rows, M band).
EXPECTED = {
    "qpn2": ("nvfp4", routes.TILED, 1, 0, 1, 8),
    "qpn2_mt2": ("nvfp4", routes.TILED, 2, 0, 9, 16),
    "qpn2_chunked": ("nvfp4", routes.TILED, 2, 16, 17, 96),
    "qpn2_reconstruct": ("nvfp4", routes.RECONSTRUCT, 0, 0, 97, None),
    "qpn2_moe": ("nvfp4", routes.MOE, 0, 0, 1, None),
    "qpn8": ("fp8", routes.TILED, 1, 0, 1, 8),
    "qpn8_mt2": ("fp8", routes.TILED, 2, 0, 9, 16),
    "qpn8_chunked": ("fp8", routes.TILED, 2, 16, 17, 96),
    "qpn8_reconstruct": ("fp8", routes.RECONSTRUCT, 0, 0, 97, None),
    "qpn8_moe": ("fp8", routes.MOE, 0, 0, 1, None),
    "qpn4": ("int4", routes.TILED, 1, 0, 1, 8),
    "qpn4_mt2": ("int4", routes.TILED, 2, 0, 9, 16),
    "qpn4_chunked": ("int4", routes.TILED, 2, 16, 17, 96),
    "qpn4_reconstruct": ("int4", routes.RECONSTRUCT, 0, 0, 97, None),
    # no qpn4_moe: INT4 has no grouped MoE kernels (formats.INT4.moe_atoms is empty)
    # INT8 W8A16: the same dense bands; no qpn8i_moe (no grouped MoE kernels)
    "qpn8i": ("int8", routes.TILED, 1, 0, 1, 8),
    "qpn8i_mt2": ("int8", routes.TILED, 2, 0, 9, 16),
    "qpn8i_chunked": ("int8", routes.TILED, 2, 16, 17, 96),
    "qpn8i_reconstruct": ("int8", routes.RECONSTRUCT, 0, 0, 97, None),
}
# The families registered before a loader serves them (formats.py, "Staging"): none today (INT8
# was, until the one linear method and the integer conventions served it).
STAGED: set[str] = set()


def test_every_route_name_parses_to_its_meaning_and_back():
    served = {n for n, e in EXPECTED.items() if e[0] not in STAGED}
    assert set(routes.ALL_ROUTES) == served
    assert routes.QPN_ROUTES | routes.QPN_MOE_ROUTES == served
    assert set(routes.UNSERVED_ROUTES) == set(EXPECTED) - served
    for name, (fmt, kernel, tiles, chunk_rows, lo, hi) in EXPECTED.items():
        if fmt in STAGED:   # known to as_route (ops runs it), never parsed as a served route
            r = routes.as_route(name)
            assert r is routes.UNSERVED_ROUTES[name] and name not in routes.QPN_ROUTES
            with pytest.raises(ValueError, match="unknown QPN route"):
                routes.parse_route(name)
        else:
            r = routes.parse_route(name)
            assert r == routes.ALL_ROUTES[name] and hash(r) == hash(routes.ALL_ROUTES[name])
            assert routes.as_route(name) is routes.ALL_ROUTES[name]
        assert (r.format, r.kernel, r.tiles_per_pass, r.chunk_rows, r.m_min, r.m_max) == (
            fmt, kernel, tiles, chunk_rows, lo, hi), name
        assert str(r) == name and f"{r}" == name and r.name == name
        assert routes.as_route(r) is r
        family = formats.KERNEL_FAMILIES[fmt]
        assert r.weight_format is family and r.prefix == family.route_prefix
        assert formats.format_for_route(name, served_only=False) is family
        assert r.band() == {"m_min": lo, "m_max": hi}
    # INT8's prefix (qpn8i) extends FP8's (qpn8) as a string, never as a route: each name has one owner
    for name in EXPECTED:
        owners = [f.family for f in formats.KERNEL_FAMILIES.values()
                  if name == f.route_prefix or name.startswith(f.route_prefix + "_")]
        assert owners == [EXPECTED[name][0]], (name, owners)
    # composed from the fields, not stored: a value built by hand names itself
    assert str(routes.Route("fp8", routes.TILED, 2, routes.CHUNK_ROWS, 17, 96)) == "qpn8_chunked"
    with pytest.raises(ValueError, match="no QPN route"):
        routes.Route("fp8", routes.TILED, 4, 0, 1, 32)


@pytest.mark.parametrize("bad", ["qpn2_", "qpn2_mt4", "qpn28", "qpn4_moe", "qpn9", "marlin", "QPN2",
                                 "qpn2_chunked_x", ""])
def test_unknown_names_are_refused_naming_the_known_routes(bad):
    with pytest.raises(ValueError, match="known routes: .*qpn2_chunked"):
        routes.parse_route(bad)
    with pytest.raises(ValueError, match="unknown QPN route"):
        routes.as_route(bad)


def test_every_family_with_kernels_is_served():
    """Every registered family with kernels is served (formats.py, "Staging": none waits): its
    dense routes are in the served lists and its kernels in the build's served entry points, and the
    staging tables are empty. A MoE route exists exactly for the families with MoE kernels. INT4's
    and INT8's two members each have their own kernels."""
    assert set(formats.FAMILIES) == set(routes.FORMATS) == {"nvfp4", "fp8", "int4", "int8"}
    assert set(formats.KERNEL_FAMILIES) == set(formats.FAMILIES) | STAGED
    assert {formats.INT4, formats.INT4_SYM, formats.INT8, formats.INT8_SYM} <= set(formats.WEIGHT_FORMATS)
    assert set(formats.KERNEL_FORMATS) == set(formats.WEIGHT_FORMATS)
    assert not routes.UNSERVED_ROUTES and not sm80_tables.SM80_UNSERVED_ROUTE_KERNELS
    assert {(f, mt) for f, mt in sm80_tables.SM80_ROUTE_KERNELS if f.family == "int8"} == {
        (f, mt) for f in (formats.INT8, formats.INT8_SYM) for mt in (1, 2)}
    for atom in formats.ATOMS:
        assert not jit.UNSERVED_ENTRY_POINTS[atom], atom
        for f in formats.WEIGHT_FORMATS:
            assert set(f.dense_entry_points(atom)) <= set(jit.ENTRY_POINTS[atom]), (f.key, atom)
    assert str(routes.route_for("int8", 1, 64, 128)) == "qpn8i"
    assert set(formats.MOE_FAMILIES) == {"nvfp4", "fp8"}
    assert {r.format for r in routes.ALL_ROUTES.values() if r.kernel == routes.MOE} == set(formats.MOE_FAMILIES)
    for fam in ("int4", "int8"):
        with pytest.raises(ValueError, match=f"{formats.FAMILIES[fam].title} has no QPN MoE kernels"):
            routes.moe_route_for(fam)


def _kernel_member(fmt: formats.WeightFormat) -> formats.WeightFormat:
    """The member whose kernels a weight of ``fmt`` runs, as ops asks it (kernel_member on a packed
    weight's operands): INT4's own member, FP8 per channel the family's kernels."""
    import torch

    num = families.numerics(fmt)
    w = torch.randn((16, 128), generator=torch.Generator().manual_seed(0))
    packed = num.prepack(*num.quantize(w, *([min(fmt.group_sizes)] if fmt.group_sizes else [])))
    return ops.kernel_member(ops.operands(packed))[0]


def test_every_member_runs_its_own_kernels_on_every_band():
    """Per served family and member, for every M: the route's m8n8k4 kernel (ops.route_kernel with
    the member, as ops.qpn_linear passes it) and its m16n8k16 kernel (sm80_plan.sm80_kernel_for) are
    entry points the build requires, named with the member's own prefix (INT4: qpn4_ / qpn4_sym_),
    and the reconstruct route runs the member's reconstruct pass."""
    for fam in formats.FAMILIES:
        members = {_kernel_member(f) for f in formats.WEIGHT_FORMATS if f.family == fam}
        assert len(members) == (2 if fam in ("int4", "int8") else 1), members
        seen = set()
        for m in range(1, 200):
            r = routes.route_for(fam, m, 64, 128)
            seen.add(str(r))
            for member in members:
                if r.kernel == routes.TILED:
                    names = {ops.route_kernel(r, m, form, member)[0] + "_m8n8k4" for form in ("restore", "s7")}
                    names.add(sm80_plan.sm80_kernel_for(r, m, 64, member)[0])
                else:
                    names = {f"{member.kernel_prefix}_reconstruct_ws_{atom}" for atom in formats.ATOMS}
                for name in names:
                    atom = "m8n8k4" if name.endswith("_m8n8k4") else "m16n8k16"
                    assert name in jit.ENTRY_POINTS[atom], (member.key, m, name)
                    assert name.startswith(member.kernel_prefix + "_"), (member.key, m, name)
                    others = [o for o in formats.WEIGHT_FORMATS if o.kernel_prefix != member.kernel_prefix
                              and o.kernel_prefix.startswith(member.kernel_prefix)]
                    assert not any(name.startswith(o.kernel_prefix + "_") for o in others), (member.key, m, name)
        assert seen == {n for n, r in routes.ALL_ROUTES.items() if r.format == fam and r.kernel != routes.MOE}


def test_route_for_returns_the_route_whose_band_holds_m():
    for fmt in routes.FORMATS:
        seen = set()
        for m in range(1, 400):
            r = routes.route_for(fmt, m, 64, 128)
            assert isinstance(r, routes.Route) and r.format == fmt and r.kernel != routes.MOE
            assert r.m_min <= m and (r.m_max is None or m <= r.m_max), (m, r)
            seen.add(str(r))
        assert seen == {n for n, r in routes.ALL_ROUTES.items() if r.format == fmt and r.kernel != routes.MOE}
        if fmt in formats.MOE_FAMILIES:
            assert str(routes.moe_route_for(fmt)) == formats.FAMILIES[fmt].moe_route
        else:
            with pytest.raises(ValueError, match="no QPN MoE kernels"):
                routes.moe_route_for(fmt)
        assert [str(routes.tiled_route(fmt, t)) for t in (1, 2)] == [str(routes.route_for(fmt, m, 64, 128))
                                                                    for m in (8, 16)]


def test_what_a_route_asks_of_its_kernel():
    r = routes.as_route
    assert r("qpn2").kernel_max_m == 8 and r("qpn8_mt2").kernel_max_m == 16
    assert r("qpn2_chunked").kernel_max_m is None and r("qpn8_reconstruct").kernel_max_m is None
    assert [r("qpn2_chunked").chunks(m) for m in (1, 16, 17, 40, 96, 500)] == [1, 1, 2, 3, 6, 32]
    assert r("qpn2_mt2").chunks(16) == 1
    r("qpn2").check_m(8)
    with pytest.raises(ValueError, match="serves M <= 8, got M=9"):
        r("qpn2").check_m(9)
    # the m8n8k4 launcher: entry point, token tiles, chunk planes
    assert ops.route_kernel(r("qpn8_chunked"), 40) == ("qpn8_mt2", 2, 3)
    assert ops.route_kernel(r("qpn2"), 5) == ("qpn2_mt1", 1, 1)
    assert ops.route_kernel(r("qpn2_chunked"), 40, "s7") == ("qpn2_mt2_s7", 2, 3)
    assert ops.route_kernel(r("qpn8"), 5, "s7") == ("qpn8_mt1", 1, 1)   # FP8 has one form
    with pytest.raises(ValueError, match="M <= 16"):
        ops.route_kernel(r("qpn8_mt2"), 17)


def test_nvfp4_form_setting_is_checked_and_kept_per_device(monkeypatch):
    """QPN_SM70_NVFP4_FORM chooses the m8n8k4 NVFP4 form without a probe (the probe itself needs a
    GPU: tests/test_gpu_kernels.py); a misspelt value is an error naming the setting and both forms;
    a device's form, once chosen, is kept and another device's is not touched."""
    import torch

    monkeypatch.setattr(ops, "nvfp4_forms", {})
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setenv(ops.NVFP4_FORM_ENV, "fast")
    with pytest.raises(ValueError, match=r"QPN_SM70_NVFP4_FORM='fast'.*s7.*restore"):
        ops.nvfp4_form(dev0)
    assert ops.nvfp4_forms == {}
    monkeypatch.setenv(ops.NVFP4_FORM_ENV, " Restore ")
    assert ops.nvfp4_form(dev0) == "restore"
    monkeypatch.setenv(ops.NVFP4_FORM_ENV, "s7")
    assert ops.nvfp4_form(dev0) == "restore" and ops.nvfp4_form(dev1) == "s7"
    assert ops.nvfp4_forms == {0: "restore", 1: "s7"}


def test_weight_operands_are_the_custom_ops_weight_arguments():
    """qpn::linear's schema lists x, then WeightOperands' fields in order, then route and bias:
    qpn_linear spreads the record into the op, so the two cannot drift apart unseen."""
    import torch

    schema = torch.ops.qpn.linear.default._schema
    assert [a.name for a in schema.arguments] == ["x", *ops.WeightOperands._fields, "route", "bias"]
    g = torch.Generator().manual_seed(4)
    for fmt in (formats.NVFP4, formats.FP8_TENSOR, formats.FP8_CHANNEL):
        packed = families.numerics(fmt).prepack(*families.numerics(fmt).quantize(torch.randn((40, 64), generator=g)))
        w = ops.operands(packed)
        assert w.fmt == packed.fmt and (w.n, w.k, w.atom) == (packed.n, packed.k, packed.atom)
        back = w.packed()
        assert type(back) is type(packed)
        for a, b in zip(ops.operands(back), w):  # the same buffers (views), the same scalars
            if isinstance(b, torch.Tensor):
                assert a.data_ptr() == b.data_ptr() and torch.equal(a.reshape(-1), b.reshape(-1))
            else:
                assert a == b
        x = torch.randn((3, 64), generator=g)
        assert torch.equal(ops.qpn_linear(x, back), ops.qpn_linear(x, packed))
    # INT4 and INT8: both members travel as the family; the records' dtype says which member, the
    # buffer size which group size, and kernel_member reads both back
    for f4 in (formats.INT4, formats.INT4_SYM, formats.INT8, formats.INT8_SYM):
        for gs in f4.group_sizes:
            num = families.numerics(f4)
            p4 = num.prepack(*num.quantize(torch.randn((40, 256), generator=g), gs))
            w = ops.operands(p4)
            assert w.fmt == f4.family and w.scales.data_ptr() == p4.scales.data_ptr()
            back = w.packed()
            assert formats.format_of(back) is f4 and back.group_size == gs and torch.equal(back.scales, p4.scales)
            assert ops.kernel_member(w) == (f4, {32: 0, 64: 1, 128: 2}[gs])
            x4 = torch.randn((3, 256), generator=g)
            assert torch.equal(ops.qpn_linear(x4, back), num.reference_linear(x4, p4))
            # m16n8k16: the group shift counts the lane's 16-input runs (AtomGeometry.lane_run)
            wide = ops.operands(num.prepack(*num.quantize(torch.randn((40, 256), generator=g), gs), atom="m16n8k16"))
            assert ops.kernel_member(wide) == (f4, {32: 1, 64: 2, 128: 3}[gs])
    with pytest.raises(TypeError, match=r"packed dense weight \(PackedNVFP4 or PackedFP8 or PackedINT4 or PackedINT8\), "
                                        r"got object"):
        ops.operands(object())
    # an expert stack names a format family too, but is no dense weight
    from qpn.kernels import moe

    stack = moe.PackedExpertStack("fp8", packed.codes[None], None, packed.scale.reshape(1, -1), packed.n,
                                  packed.k, packed.atom)
    with pytest.raises(TypeError, match="got PackedExpertStack"):
        ops.operands(stack)
    # a dense layer refuses a route of another format or of the MoE kernels
    for wrong in ("qpn2_moe", "qpn2"):
        with pytest.raises(ValueError, match="the weight is a dense fp8 layer"):
            ops.qpn_linear(x, packed, route=wrong)


ROOT = pathlib.Path(__file__).resolve().parent.parent
# A route name taken apart or put together from a suffix literal, or matched by its prefix.
ROUTE_PARSING = re.compile(r"""["'](_mt2|_chunked|_reconstruct|_moe)["']|endswith\(["']_(mt2|chunked|reconstruct|moe)"""
                           r"""|startswith\([^)]*(route_prefix|ROUTE_PREFIX)""")


def test_no_route_name_parsing_outside_routes_py():
    offenders = []
    for folder in ("kernels", "fork_patches", "scripts", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            # weight_format.py owns each family's route prefix (and its MoE route name, checked
            # against routes.moe_route_for above), formats.py finds a member by it; both sit below
            # routes.py and cannot ask it
            if path in (ROOT / "kernels" / "routes.py", ROOT / "kernels" / "weight_format.py",
                        ROOT / "kernels" / "formats.py"):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if ROUTE_PARSING.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "route names parsed outside kernels/routes.py:\n" + "\n".join(offenders)
    assert ROUTE_PARSING.search('if route.endswith("_reconstruct"):')  # the pattern sees the old code


def _kernel_symbol(route: routes.Route, m: int, n: int, atom: str, ring_fits: bool,
                   member: formats.WeightFormat) -> tuple[str, int]:
    """(kernel symbol, chunk planes) the launchers of ops.py run for one call of a weight of format
    ``member``, from the same pieces: _launch_reconstruct, route_kernel (m8n8k4), sm80_kernel_for
    and the shared-memory fallback of _sm80_plan (m16n8k16)."""
    if route.kernel == routes.RECONSTRUCT:
        return f"{member.kernel_prefix}_reconstruct_ws_{atom}", 1
    if atom == "m8n8k4":
        name, _, chunks = ops.route_kernel(route, m, member=member)
        return f"{name}_{atom}", chunks

    name, chunks = sm80_plan.sm80_kernel_for(route, m, n, member)
    if not ring_fits and sm80_plan.sm80_kernels()[name].smem_bytes and not sm80_plan.sm80_kernels()[name].band:
        name = sm80_plan.sm80_no_smem_kernel(name)
    return name, chunks


def test_every_format_route_and_arch_runs_a_kernel_that_serves_the_call():
    """Per format, route, architecture, M, N and whether the GPU gives a block the ring's shared
    memory: the kernel the launchers pick is one the build compiles, of the route's family, the
    reconstruct kernel exactly for the reconstruct route, with token tiles (8 rows each) whose
    chunk planes cover M and no more planes than needed, and without shared memory where the
    block cannot have it. Which of the fitting kernels a route runs is tuning (kernels/sm80_tables.py's
    tables, chosen by the H200 sweeps) and is not copied here; every kernel those tables name
    must be reached by some call."""
    import re as _re

    from qpn.kernels import jit
    from qpn.kernels.atoms import atom_for_arch

    sm80 = sm80_plan.sm80_kernels()
    seen, checked = set(), 0
    for fmt in formats.WEIGHT_FORMATS:
        member = _kernel_member(fmt)
        for route in (routes.ALL_ROUTES[n] for n in sorted(routes.QPN_ROUTES)):
            if route.weight_format.family != fmt.family:
                continue
            for arch in routes.KNOWN_ARCHS:
                atom = atom_for_arch(jit.arch_number(arch))
                for m in (1, 8, 9, 16, 17, 32, 33, 96, 97, 4096):
                    for n in sorted({5120, 34816, *sm80_tables.SM80_LARGE_N.values()}):
                        for fits in (True, False):
                            if route.kernel_max_m is not None and m > route.kernel_max_m:
                                with pytest.raises(ValueError, match=f"serves M <= {route.kernel_max_m}"):
                                    _kernel_symbol(route, m, n, atom, fits, member)
                                continue
                            name, chunks = _kernel_symbol(route, m, n, atom, fits, member)
                            where = (fmt.key, str(route), arch, m, n, fits, name)
                            seen.add(name)
                            checked += 1
                            # the member's own kernels: of the prefixes it starts with, the longest is the member's
                            assert max((f.kernel_prefix for f in formats.WEIGHT_FORMATS
                                        if name.startswith(f.kernel_prefix + "_")), key=len) == fmt.kernel_prefix, where
                            assert ("_reconstruct_ws_" in name) == (route.kernel == routes.RECONSTRUCT), where
                            if route.kernel == routes.RECONSTRUCT:
                                assert name == f"{fmt.kernel_prefix}_reconstruct_ws_{atom}" and chunks == 1, where
                                assert name in jit.ENTRY_POINTS[atom], where
                                continue
                            if atom == "m8n8k4":
                                assert name in jit.ENTRY_POINTS["m8n8k4"], where
                                mt = int(_re.search(r"_mt(\d+)_", name).group(1))
                            else:
                                cfg = sm80[name]
                                mt = cfg.mt
                                assert cfg.weight_format.kernel_prefix == fmt.kernel_prefix, where  # its decoder
                                if not fits:
                                    assert cfg.smem_bytes == 0 or cfg.band, where
                            rows = 8 * mt  # token rows one plane of the kernel serves
                            assert chunks * rows >= m and (chunks - 1) * rows < m, where
                            if route.chunk_rows is None:
                                assert chunks == 1, where
    # 7 formats (NVFP4, FP8 per tensor / channel, INT4 and INT8 with zero points / symmetric) x 4 routes x 6
    # archs x 60 cases (10 M x 3 N: down, gate_up and NVFP4's large-N threshold x 2 fits), less the M a route
    # refuses
    assert checked == 6552
    named = {k for t in (sm80_tables.SM80_ROUTE_KERNELS, sm80_tables.SM80_LARGE_N_KERNELS,
                         sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM,
                         {k: v for k, v in enumerate(b for bs in sm80_tables.SM80_BAND_KERNELS.values() for b in bs)})
             for k in t.values()}
    assert named <= seen, sorted(named - seen)
    # the S7 form's m8n8k4 kernels: what ops launches for each tiled NVFP4 route is an entry point the
    # build requires (jit.ENTRY_POINTS, from formats), and every S7 entry point is launched by a route
    s7 = {ops.route_kernel(r, m, "s7")[0] + "_m8n8k4" for r in routes.ALL_ROUTES.values()
          if r.kernel == routes.TILED and r.format == "nvfp4" for m in (1, 8, 9, 16, 17, 96)
          if r.kernel_max_m is None or m <= r.kernel_max_m}
    assert s7 == {e for e in jit.ENTRY_POINTS["m8n8k4"] if "_s7_" in e} == {"qpn2_mt1_s7_m8n8k4", "qpn2_mt2_s7_m8n8k4"}
