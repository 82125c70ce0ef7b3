"""GPU numerics of the INT8 W8A16 kernels (qpn8i_* asymmetric, qpn8i_sym_* symmetric) on both atoms:
m8n8k4 (which an sm_80+ GPU runs emulated) and, on sm_80+, m16n8k16 (Frag16INT8Form, Frag16INT8FoldForm
in kernels/families/int8/m16n8k16.cuh), against an independent float64 reference of the checkpoint
integers, groups of 32 / 64 / 128 and per channel. Its routes are in routes.QPN_ROUTES and its
kernels in jit.ENTRY_POINTS; ops runs them all the
same. Without a GPU every test skips (CI has none); with a GPU but no NVRTC the build fixture fails
under CI=true (tests/_ci.py) and skips elsewhere.

Bound, and why it can be tight. The decoder hands the MMA fp16((code - zero) * scale), one
rounding, which is exactly the FP16 weight the family's reference linear multiplies (w16 below,
computed here from the integers, not by the family's code); a product of two FP16 values is exact
in FP32, so the kernel and the reference differ only in the order of their FP32 sums (split-K, the
MMA's internal order, torch's). Per element:
  |y - fp16(y64)| <= ulp16(y64) + (K + 2) 2^-23 S,   S = sum_k |x_k w16_k|,
with y64 the float64 product of the FP16 operands: a chain of K FP32 additions errs by at most
K 2^-23 S even if the tensor core truncates, and two FP16 roundings of values that close differ
by at most one ulp plus their distance. No norm-wise slack: a wrong code, zero point, byte order,
group or row moves an element by a whole weight (|x_k| * scale), far outside that bound. The
one-hot probe (tests/_per_group.py) then checks every (row, input) bit-exact, so no sum can hide a
wrong group, and a corrupted record must be named by its (row, group).

On m16n8k16 the tiled routes' kernels fold the scale of records of 64 inputs or more (groups of
64 and 128, and every per-channel row) into their FP32 sums (Frag16INT8FoldForm): they multiply the
exact (code - zero) * scale, not its FP16 rounding, so the bound is taken with those weights in
place of w16 (_multiplied). A one-hot row still gives fp16((code - zero) * scale) exactly, one
rounding of an exact FP32 product.
"""
from __future__ import annotations

import os

import pytest
import torch

from qpn.kernels.families.int8 import codec as int8_codec
from qpn.kernels.families.int8 import layout as int8_layout
from qpn.kernels.families.int8 import numerics as int8_numerics
from qpn.kernels import formats, ops, routes
from qpn.kernels.atoms import geometry
from tests import _format_cases as fc
from tests import _per_group as pg
from tests._ci import unavailable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (numerics run on an H100 / H200 via the device tool; CI has none)")

FAMILY = formats.INT8.family
CHANNEL = -1   # one scale (and zero point) per output row (members.CHANNEL)
# the atoms this GPU runs (m16n8k16 from sm_80 on); each test runs once per atom
ATOMS = ("m8n8k4", "m16n8k16")
MEMBERS = {"asym": formats.INT8, "sym": formats.INT8_SYM}
GROUPS = (32, 64, 128, CHANNEL)
# M at and around every band edge of the route table (mt1 1-8, mt2 9-16, chunked 17-96, reconstruct)
M_LIST = [1, 2, 8, 9, 16, 17, 96, 97]
# (name, N, K, g): K a multiple of 32 but not of 64 where the group allows (the m16n8k16 k-block:
# 288, 2080), an odd number of k-blocks (2080 = 65 x 32), N not a multiple of either atom's tile;
# a TP4 MLP-sized and an attention-sized layer; per channel with K neither a power of two nor a
# multiple of 64 (a record spanning 4096 inputs of 2080 / 2112) and with K = 1536 (span 2048).
SHAPES = [("odd_72x288", 72, 288, 32), ("odd_1000x320", 1000, 320, 64), ("odd_257x2080", 257, 2080, 32),
          ("odd_130x384", 130, 384, 128), ("tp4_down_5120x4352", 5120, 4352, 128), ("attn_1024x1536", 1024, 1536, 64),
          ("channel_300x2080", 300, 2080, CHANNEL), ("channel_512x1536", 512, 1536, CHANNEL)]
ROUTE_NAMES = tuple(sorted(n for n, r in routes.ALL_ROUTES.items() if r.format == "int8"))  # qpn8i, _chunked, _mt2, _reconstruct


_built_atoms: set = set()


@pytest.fixture(params=ATOMS)
def atom(request):
    """The atom under test, its module built for this GPU with every INT8 entry point (ops.build
    checks them); m16n8k16 skips below sm_80."""
    from qpn.kernels import jit, nvrtc
    a = request.param
    major, minor = torch.cuda.get_device_capability()
    if a not in jit.atoms_for_arch(major * 10 + minor):
        pytest.skip(f"{a} needs sm_{jit.ATOM_MIN_ARCH[a]}+; this GPU is sm_{major}{minor}")
    if a not in _built_atoms:
        try:
            ops.build(f"sm{major}{minor}", atom=a)
        except nvrtc.NvrtcUnavailable as e:
            unavailable("NVRTC", str(e), "pip install nvidia-cuda-nvrtc-cu12 (the test extra)")
        mod = jit.module_for(torch.device("cuda", torch.cuda.current_device()), a)
        int8 = [e for e in jit.ENTRY_POINTS[a] if e.startswith(formats.INT8.route_prefix + "_")]
        # mt1, mt2 and reconstruct per member
        assert len(int8) == 6, int8
        for name in int8:
            assert mod.function(name), name
        _built_atoms.add(a)
    return a


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cols(k: int, g: int) -> int:
    return 1 if g == CHANNEL else k // g


def outlier_weight(n: int, k: int, gen) -> torch.Tensor:
    """Gaussian weights with a few input columns 20-60x larger (what GPTQ checkpoints of real models
    carry: the groups holding them get large scales, the rest keep fine ones; per channel, every
    row's scale is set by them)."""
    w = torch.randn((n, k), generator=gen) * 0.02
    cols = torch.randperm(k, generator=gen)[: max(2, k // 256)]
    w[:, cols] *= torch.rand((1, cols.numel()), generator=gen) * 40 + 20
    return w


def all_values_source(n: int, k: int, g: int, sym: bool, gen) -> tuple:
    """Every code 0..255 in every row, every zero point 0..255 (asymmetric) cycling over the
    (row, group) records, FP16 scales over six binades small enough that |code - zero| <= 255
    times them keeps every output finite against 6000-sized outlier activations."""
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int64)
    q[:, :256] = torch.arange(256)
    cols = _cols(k, g)
    s = (torch.exp2(torch.randint(-17, -11, (n, cols), generator=gen).float())
         * (1 + torch.randint(0, 8, (n, cols), generator=gen).float() / 8)).half()
    codes = q.to(torch.uint8)
    if sym:
        return codes, s
    return codes, s, (torch.arange(n * cols) % 256).reshape(n, cols).to(torch.uint8)


def _source(kind: str, n: int, k: int, g: int, sym: bool, gen) -> tuple:
    if kind == "all_values":
        return all_values_source(n, k, g, sym, gen)
    return int8_codec.quantize(outlier_weight(n, k, gen), g, symmetric=sym)


def _exact(src) -> torch.Tensor:
    """(code - zero) * scale in float64 from the source's integers and torch's float16 -> float64
    cast: the independent reference (no code of the family)."""
    codes, s = src[0], src[1]
    z = src[2] if len(src) == 3 else torch.full(s.shape, 128, dtype=torch.uint8)
    per = codes.shape[1] // s.shape[1]
    return (codes.double() - z.double().repeat_interleave(per, 1)) * s.double().repeat_interleave(per, 1)


def _w16(src) -> torch.Tensor:
    """The FP16 operands the decoder makes (and the family's reference linear multiplies), as float64."""
    return _exact(src).half().double()


def _multiplied(src, packed, route, m: int, atom: str) -> torch.Tensor:
    """The weights ``route`` multiplies at M = m on this atom, as float64: where the sm_80+ kernel folds
    the record's scale into its FP32 sums (Frag16INT8FoldForm, records of 64 inputs or more) the exact
    (code - zero) * scale, else (the m8n8k4 atom, groups of 32, the reconstruct route) their FP16
    roundings, _w16."""
    if atom == "m16n8k16" and route.tiles_per_pass and packed.group_size >= 64:
        from qpn.kernels import sm80_plan
        name = sm80_plan.sm80_kernel_for(route, m, packed.n, formats.format_of(packed))[0]
        if sm80_plan.sm80_config(name).frag.startswith("Frag16INT8Fold"):
            return _exact(src)
    return _w16(src)


def _ulp16(v: torch.Tensor) -> torch.Tensor:
    a = v.abs().clamp(min=2.0 ** -14)
    return torch.exp2(torch.floor(torch.log2(a)) - 10)


# Every case _check measured, written as a Markdown report (with provenance) where
# QPN_INT8_NUMERICS_REPORT names a file: the H200 / H100 evidence of results/.
RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("QPN_INT8_NUMERICS_REPORT")
    if path and RESULTS:
        write_report(path, RESULTS)


def write_report(path, results):
    """The Markdown numerics report; every line written here (provenance by benchmarks/provenance.py)."""
    from qpn.benchmarks import provenance

    worst = max(results, key=lambda r: r["ratio"])
    rec = provenance.run_record(report="tests/test_gpu_int8.py numerics",
                                bound_element="ulp16(y64) + (K + 2) 2^-23 sum|x w| (ratio <= 1)")
    lines = [f"# INT8 W8A16 kernel numerics on {torch.cuda.get_device_name(0)}", ""] + provenance.markdown_block(rec) + [
             f"{len(results)} cases against an independent float64 reference of the checkpoint integers; worst "
             f"per-element ratio to the bound {worst['ratio']:.3f} ({worst['what']}); worst relative error "
             f"{max(r['rel'] for r in results):.3e}; failures: {sum(1 for r in results if not r['ok'])}", "",
             "| case | N | K | M | rel. error vs float64 | per-element ratio | ok |", "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['what']} | {r['n']} | {r['k']} | {r['m']} | {r['rel']:.3e} | {r['ratio']:.3f} | "
              f"{'yes' if r['ok'] else 'NO'} |" for r in results]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """y (the kernel's FP16 output) against the float64 product of the weights it multiplies, within
    the FP32-order bound of the module docstring, and against the reference formula (FP32 sums of
    those weights, FP16 output) within twice it."""
    xd = x.double()
    y64 = xd @ w.t()
    mag = xd.abs() @ w.abs().t()
    bound = _ulp16(y64) + (x.shape[1] + 2) * 2.0 ** -23 * mag
    yd = y.double().cpu()
    ref16 = y64.half().double()
    finite = torch.isfinite(ref16)
    err = (yd - ref16).abs()
    worst = float((err / bound)[finite].max()) if bool(finite.any()) else 0.0
    rel = float((yd - y64)[finite].norm() / y64[finite].norm().clamp_min(1e-300))
    RESULTS.append({"what": what, "n": w.shape[0], "k": x.shape[1], "m": x.shape[0], "rel": rel, "ratio": worst,
                    "ok": bool(finite.float().mean() > 0.99) and bool(torch.isfinite(yd[finite]).all())
                    and worst <= 1.0})
    assert bool(finite.float().mean() > 0.99), f"{what}: the case overflows FP16; its scales are too large"
    assert bool(torch.isfinite(yd[finite]).all()), f"{what}: inf/NaN where the reference is finite"
    assert bool((err[finite] <= bound[finite]).all()), f"{what}: beyond the FP32-order bound (worst {worst:.3f} of it)"
    ref = (x.float() @ w.float().t()).half().double()
    assert bool(((yd - ref).abs()[finite] <= 2 * bound[finite]).all()), f"{what}: differs from the reference formula"


@pytest.mark.parametrize("member", list(MEMBERS))
@pytest.mark.parametrize("kind", ["all_values", "outliers"])
@pytest.mark.parametrize("name,n,k,g", SHAPES, ids=[s[0] for s in SHAPES])
def test_int8_routes_vs_reference(name, n, k, g, kind, member, atom):
    sym = member == "sym"
    gen = _gen(n + k + abs(g) + sym)
    src = _source(kind, n, k, g, sym, gen)
    if kind == "all_values":
        assert set(src[0].unique().tolist()) == set(range(256))
        if not sym:
            assert set(src[2].unique().tolist()) == set(range(256)) or n * _cols(k, g) < 256
    dev = torch.device("cuda")
    packed = int8_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    span = int8_layout.record_span(packed.k_pad) if g == CHANNEL else g
    assert formats.format_of(packed) is MEMBERS[member] and packed.group_size == span
    w16 = _w16(src)
    x0 = fc.activations(3, k, gen, outliers=True)   # _check's formula is the family's reference, read from the packed bytes
    assert torch.equal(int8_numerics.linear(x0, packed.to("cpu")), (x0.float() @ w16.float().t()).half())
    bias = (torch.randn(n, generator=gen) * 0.1).half()
    for m in M_LIST:
        x = fc.activations(m, k, gen, outliers=True)
        route = routes.route_for(FAMILY, m, n, k)
        y = ops.qpn_linear(x.to(dev), packed)
        torch.cuda.synchronize()
        _check(y, x, _multiplied(src, packed, route, m, atom), f"{name} {kind} {member} g={g} M={m} ({route}, {atom})")
        yb = ops.qpn_linear(x.to(dev), packed, bias=bias.to(dev)).double().cpu()
        assert torch.allclose(yb, (y.double().cpu() + bias.double()).half().double(), rtol=2e-3, atol=2e-3), \
            f"{name} {member} M={m}: bias"
    # every tiled route also serves any M below its band's top when asked for by name
    for route_name in ROUTE_NAMES:
        r = routes.as_route(route_name)
        m = min(5, r.kernel_max_m or 5)
        x = fc.activations(m, k, gen, outliers=False)
        _check(ops.qpn_linear(x.to(dev), packed, route=r), x, _multiplied(src, packed, r, m, atom),
               f"{name} {member} {route_name} M={m} ({atom})")


@pytest.mark.parametrize("member", list(MEMBERS))
@pytest.mark.parametrize("g", GROUPS, ids=["g32", "g64", "g128", "channel"])
def test_int8_every_position_and_record_exact_on_gpu(g, member, atom):
    """One-hot activations: every (row, input) is one FP16 weight, bit-exact on every route; a
    corrupted record (its zero point, or its scale's low byte) is named by its (row, group)."""
    sym = member == "sym"
    n, k = 40, 288 if g in (32, CHANNEL) else (320 if g == 64 else 384)   # several groups, a partial k-block
    src = all_values_source(n, k, g, sym, _gen(abs(g)))
    dev = torch.device("cuda")
    packed = int8_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    w64 = _w16(src)

    def run(route, p):
        return lambda x: ops.qpn_linear(x.to(dev), p, route=route).cpu()

    for route, tokens in (("qpn8i", 8), ("qpn8i_mt2", 16), ("qpn8i_chunked", 96), ("qpn8i_reconstruct", 128)):
        bad = pg.probe(run(route, packed), w64, tokens)
        assert not bad, f"{member} g={g} {route} ({atom}): {len(bad)} wrong (row, input), first {bad[:4]}"
    # corrupt one record: row 33 (second tile on m8n8k4, third on m16n8k16), group 1 (per channel: 0)
    row, grp = 33, (0 if g == CHANNEL else 1)
    rec, tile = packed.record_bytes, geometry(atom).tile_n
    slot = int(torch.argsort(int8_layout.record_rows(atom))[row % tile])
    off = (((row // tile) * packed.groups_pad + grp) * tile + slot) * rec
    broken = int8_layout.PackedINT8(packed.codes, packed.scales.clone(), packed.out_scale, n, k, packed.group_size,
                                    sym, atom)
    broken.scales[off + (0 if sym else 2)] ^= 0x01 if sym else 0x03
    for route in ("qpn8i", "qpn8i_reconstruct"):
        bad = pg.probe(run(route, broken), w64, 8 if route == "qpn8i" else 128)
        group_of = (lambda kk: 0) if g == CHANNEL else (lambda kk: kk // g)
        assert {(r, group_of(kk)) for r, kk in bad} == {(row, grp)}, \
            f"{member} g={g} {route} ({atom}): corruption reported as {sorted(set(bad))[:6]}"


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int8_subnormal_operands(member, atom):
    """Scales small enough that (code - zero) * scale is an FP16 subnormal (down to 2^-24): the
    decoder's hmul2 keeps them (no .ftz) and so does the reference; whether the tensor cores take
    them as they are is a property of the GPU (on a V100 unmeasured), settled here by the one-hot
    probe on mt1 and the reconstruct route."""
    sym = member == "sym"
    n, k, g = 32, 256, 32
    q = torch.randint(0, 256, (n, k), generator=_gen(5), dtype=torch.int64)
    q[:, :256] = torch.arange(256)
    s = (torch.full((n, k // g), 2.0 ** -24) * torch.randint(1, 4, (n, k // g), generator=_gen(6))).half()
    z = (torch.arange(n * k // g) % 256).reshape(n, k // g).to(torch.uint8)
    src = (q.to(torch.uint8), s) if sym else (q.to(torch.uint8), s, z)
    w64 = _w16(src)
    assert bool(((w64 != 0) & (w64.abs() < 2.0 ** -14)).any()), "the case must hold subnormal operands"
    dev = torch.device("cuda")
    packed = int8_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    for route, tokens in (("qpn8i", 8), ("qpn8i_reconstruct", 128)):
        bad = pg.probe(lambda x, r=route: ops.qpn_linear(x.to(dev), packed, route=r).cpu(), w64, tokens)
        assert not bad, f"{member} {route} ({atom}): {len(bad)} subnormal operands changed, first {bad[:4]}"


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int8_m16n8k16_runs_its_own_kernels(member, atom):
    """On m16n8k16 each band runs the member's own configured kernel (sm80_tables'
    SM80_ROUTE_KERNELS, never another family's or member's) with the weight's group shift
    (per channel: one record over the whole padded K), and a chunked M (40: three 16-row chunks of
    the MT = 2 kernel) agrees with the reference too."""
    if atom != "m16n8k16":
        pytest.skip("the m16n8k16 kernel table")
    from qpn.kernels import sm80_plan, sm80_tables
    sym = member == "sym"
    fmt = MEMBERS[member]
    gen = _gen(11 + sym)
    for g in GROUPS:
        n, k = 48, (384 if g in (128, CHANNEL) else 4 * g + 64)
        src = int8_codec.quantize(outlier_weight(n, k, gen), g, symmetric=sym)
        packed = int8_layout.prepack(*(t.cuda() for t in src), atom=atom)
        w = ops.operands(packed)
        span = int8_layout.record_span(packed.k_pad) if g == CHANNEL else g
        assert ops.kernel_member(w) == (fmt, (span // 16).bit_length() - 1)
        for m, mt in ((1, 1), (8, 1), (9, 2), (16, 2), (40, 2)):
            route = routes.route_for(FAMILY, m, n, k)
            name, chunks = sm80_plan.sm80_kernel_for(route, m, n, fmt)
            assert name == sm80_tables.SM80_ROUTE_KERNELS[(fmt, mt)]
            assert name.startswith(fmt.kernel_prefix + "_")
            assert chunks == (-(-m // 16) if route.chunk_rows else 1)
            x = fc.activations(m, k, gen, outliers=True)
            _check(ops.qpn_linear(x.cuda(), packed), x, _multiplied(src, packed, route, m, atom),
                   f"{member} g={g} M={m} ({route}, {name})")


def _configured_int8_kernels(fmt) -> dict:
    """Every INT8 GEMM kernel of the sm_80+ source for member fmt (route kernels and candidates,
    variant 0), parsed from its entry lines."""
    from qpn.kernels import sm80_plan
    return {kn: c for kn, c in sm80_plan.sm80_kernels().items() if c.weight_format is fmt and c.variant == 0}


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int8_every_configured_m16n8k16_kernel(member, atom):
    """Each configured INT8 kernel, route kernel or not, at every group size and per channel: a folded
    decoder (Frag16INT8FoldForm: the scale applied to FP32 sums, records of 64 inputs or more) within
    the FP32-order bound of the EXACT weights (code - zero) * scale, which it multiplies without
    rounding them to FP16; the plain decoder (and a folded one on groups of 32, which runs its plain
    form) within that bound of the FP16 weights. K = 1152 over 18 k-blocks, N = 200: the split-K runs
    start inside 128-groups and inside the per-channel record, so a fold at a segment's end is
    exercised. One-hot: every (row, input) bit-exact, fp16((code - zero) * scale) for both forms."""
    if atom != "m16n8k16":
        pytest.skip("the m16n8k16 kernels")
    from qpn.kernels import sm80_plan
    sym = member == "sym"
    kernels = _configured_int8_kernels(MEMBERS[member])
    assert any(c.frag.startswith("Frag16INT8Fold") for c in kernels.values()), sorted(kernels)
    assert any(not c.frag.startswith("Frag16INT8Fold") for c in kernels.values()), sorted(kernels)
    dev = torch.device("cuda")
    n, k = 200, 1152
    for g in GROUPS:
        for kind in ("all_values", "outliers"):
            gen = _gen(abs(g) + 7 * sym + (kind == "outliers"))
            src = _source(kind, n, k, g, sym, gen)
            packed = int8_layout.prepack(*(t.to(dev) for t in src), atom=atom)
            w16, exact = _w16(src), _exact(src)
            for kn, c in sorted(kernels.items()):
                folds = c.frag.startswith("Frag16INT8Fold") and packed.group_size >= 64
                route = routes.as_route("qpn8i" if c.mt == 1 else "qpn8i_mt2")
                for m in ((1, 8) if c.mt == 1 else (9, 16)):
                    x = fc.activations(m, k, gen, outliers=True)
                    y = sm80_plan.run_sm80_kernel(x.to(dev), packed, kn, route=route)
                    torch.cuda.synchronize()
                    _check(y, x, exact if folds else w16, f"{kn} {kind} g={g} M={m}")
                if kind == "all_values":
                    bad = pg.probe(lambda x, kn=kn, r=route: sm80_plan.run_sm80_kernel(x.to(dev), packed, kn, route=r).cpu(),
                                   w16, 8 * c.mt)
                    assert not bad, f"{kn} g={g}: {len(bad)} wrong (row, input), first {bad[:4]}"


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int8_split_k_runs_are_deterministic(member, atom):
    """The split-K finish adds the contributors' partial sums in a fixed order: the same call twice
    gives the same bits, at every M of the one-tile band (the thin finish at M = 1-4 included) and on
    a layer whose runs split the per-channel record and the 128-groups across many warps."""
    sym = member == "sym"
    dev = torch.device("cuda")
    for g in (128, CHANNEL):
        gen = _gen(31 + abs(g) + sym)
        src = _source("outliers", 5120, 4352, g, sym, gen)
        packed = int8_layout.prepack(*(t.to(dev) for t in src), atom=atom)
        for m in range(1, 9):
            x = fc.activations(m, 4352, gen, outliers=True).to(dev)
            a, b = ops.qpn_linear(x, packed), ops.qpn_linear(x, packed)
            torch.cuda.synchronize()
            assert torch.isfinite(a).all() and torch.equal(a.view(torch.int16), b.view(torch.int16)), (g, m)
