"""GPU numerics of the INT4 W4A16 kernels (qpn4_* asymmetric, qpn4_sym_* symmetric) on both atoms:
m8n8k4 (which an sm_80+ GPU runs emulated) and, on sm_80+, m16n8k16 (Frag16INT4Form, Frag16INT4FoldForm in
kernels/families/int4/m16n8k16.cuh), against the INT4 family's reference. Run on the H200 through the device
tool; without a GPU every test skips (CI has none), and with a GPU but no NVRTC the build fixture
fails under CI=true (tests/_ci.py) and skips elsewhere.

Bound, and why it can be tight. The decoder hands the MMA fp16((code - zero) * scale), one
rounding, which is exactly the FP16 weight linear_int4 multiplies (w16 below); a product of two
FP16 values is exact in FP32, so the kernel and the reference differ only in the order of their
FP32 sums (split-K, the MMA's internal order, torch's). Per element:
  |y - fp16(y64)| <= ulp16(y64) + (K + 2) 2^-23 S,   S = sum_k |x_k w16_k|,
with y64 the float64 product of the FP16 operands: a chain of K FP32 additions errs by at most
K 2^-23 S even if the tensor core truncates, and two FP16 roundings of values that close differ
by at most one ulp plus their distance. The same bound holds for linear_int4's output, so the
two must agree within twice it. No norm-wise slack: a wrong code, zero point, group or row moves
an element by a whole weight (|x_k| * scale), far outside that bound for these activations.
The one-hot probe (tests/_per_group.py) then checks every (row, input) bit-exact, so no sum can
hide a wrong group, and a corrupted record must be named by its (row, group).

On m16n8k16 the tiled routes' kernels fold the group scales of 64- and 128-input groups into their
FP32 sums (Frag16INT4FoldForm): they multiply the exact (code - zero) * scale, not its FP16 rounding,
so the bound is taken with those weights in place of w16 (_multiplied). A one-hot row still gives
fp16((code - zero) * scale) exactly, one rounding of an exact FP32 product.
"""
from __future__ import annotations

import pytest
import torch

from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import layout as int4_layout
from qpn.kernels.families.int4 import numerics as int4_numerics
from qpn.kernels import formats, ops, routes
from qpn.kernels.atoms import geometry
from tests import _format_cases as fc
from tests import _per_group as pg
from tests._ci import unavailable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (numerics run on an H200 via the device tool; CI has none)")

# the atoms this GPU runs (m16n8k16 from sm_80 on); each test runs once per atom
ATOMS = ("m8n8k4", "m16n8k16")
MEMBERS = {"asym": formats.INT4, "sym": formats.INT4_SYM}
# M at and around every band edge of the route table (mt1 1-8, mt2 9-16, chunked 17-96, reconstruct)
M_LIST = [1, 2, 8, 9, 16, 17, 96, 97]
# (name, N, K, g): K a multiple of the group but not of 128 wherever the group allows (m16n8k16: nor
# of its 64-input k-block: 224, 2080); N not a multiple of either atom's tile (32 / 16 rows); the last two are a TP4 MLP-sized and an attention-sized layer
SHAPES = [("odd_72x224", 72, 224, 32), ("odd_1000x320", 1000, 320, 64), ("odd_257x2080", 257, 2080, 32),
          ("odd_130x384", 130, 384, 128), ("tp4_down_5120x4352", 5120, 4352, 128), ("attn_1024x1536", 1024, 1536, 64)]


_built_atoms: set = set()


@pytest.fixture(params=ATOMS)
def atom(request):
    """The atom under test, its module built for this GPU with every INT4 entry point (ops.build
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
        int4 = [e for e in jit.ENTRY_POINTS[a] if e.startswith(formats.INT4.route_prefix + "_")]
        # mt1, mt2 and reconstruct per member (no large-layer kernel on either atom)
        assert len(int4) == 6, int4
        for name in int4:
            assert mod.function(name), name
        _built_atoms.add(a)
    return a


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def outlier_weight(n: int, k: int, gen) -> torch.Tensor:
    """Gaussian weights with a few input columns 20-60x larger (what AWQ / GPTQ checkpoints of real
    models carry: the groups holding them get large scales, the rest keep fine ones)."""
    w = torch.randn((n, k), generator=gen) * 0.02
    cols = torch.randperm(k, generator=gen)[: max(2, k // 256)]
    w[:, cols] *= torch.rand((1, cols.numel()), generator=gen) * 40 + 20
    return w


def all_values_source(n: int, k: int, g: int, sym: bool, gen) -> tuple:
    """Every code 0..15 in every row, every zero point 0..15 (asymmetric) cycling over the
    (row, group) records, FP16 scales over six binades: the whole of the format's codes."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)
    q[:, :16] = torch.arange(16)
    cols = k // g
    s = (torch.exp2(torch.randint(-12, -6, (n, cols), generator=gen).float())
         * (1 + torch.randint(0, 8, (n, cols), generator=gen).float() / 8)).half()
    codes = int4_codec.pack_codes(q)
    if sym:
        return codes, s
    return codes, s, (torch.arange(n * cols) % 16).reshape(n, cols).to(torch.uint8)


def _source(kind: str, n: int, k: int, g: int, sym: bool, gen) -> tuple:
    if kind == "all_values":
        return all_values_source(n, k, g, sym, gen)
    return int4_codec.quantize(outlier_weight(n, k, gen), g, symmetric=sym)


def _w16(src) -> torch.Tensor:
    """The FP16 operands the decoder makes (and linear_int4 multiplies), as float64."""
    return int4_codec.dequantize(*src).half().double()


def _multiplied(src, packed, route, m: int, atom: str) -> torch.Tensor:
    """The weights route multiplies at M = m on this atom, as float64: where the sm_80+ kernel folds
    the group scales into its FP32 sums (Frag16INT4FoldForm, groups of 64 and 128) the exact
    (code - zero) * scale, else (the m8n8k4 atom, groups of 32, the reconstruct route) their FP16
    roundings, _w16."""
    if atom == "m16n8k16" and route.tiles_per_pass and packed.group_size >= 64:
        from qpn.kernels import sm80_plan
        name = sm80_plan.sm80_kernel_for(route, m, packed.n, formats.format_of(packed))[0]
        if sm80_plan.sm80_config(name).frag.startswith("Frag16INT4Fold"):
            return int4_codec.dequantize_f64(*src)
    return _w16(src)


def _ulp16(v: torch.Tensor) -> torch.Tensor:
    a = v.abs().clamp(min=2.0 ** -14)
    return torch.exp2(torch.floor(torch.log2(a)) - 10)


def _check(y: torch.Tensor, x: torch.Tensor, w16: torch.Tensor, what: str) -> None:
    """y (the kernel's FP16 output) against the float64 product of the FP16 operands, within the
    FP32-order bound of the module docstring, and against linear_int4's formula within twice it."""
    xd = x.double()
    y64 = xd @ w16.t()
    mag = xd.abs() @ w16.abs().t()
    bound = _ulp16(y64) + (x.shape[1] + 2) * 2.0 ** -23 * mag
    yd = y.double().cpu()
    ref16 = y64.half().double()
    finite = torch.isfinite(ref16)
    assert bool(torch.isfinite(yd[finite]).all()), f"{what}: inf/NaN where the reference is finite"
    err = (yd - ref16).abs()
    worst = float((err / bound)[finite].max()) if bool(finite.any()) else 0.0
    assert bool((err[finite] <= bound[finite]).all()), f"{what}: beyond the FP32-order bound (worst {worst:.3f} of it)"
    ref = (x.float() @ w16.float().t()).half().double()      # linear_int4, without re-decoding per call
    assert bool(((yd - ref).abs()[finite] <= 2 * bound[finite]).all()), f"{what}: differs from linear_int4"


@pytest.mark.parametrize("member", list(MEMBERS))
@pytest.mark.parametrize("kind", ["all_values", "outliers"])
@pytest.mark.parametrize("name,n,k,g", SHAPES, ids=[s[0] for s in SHAPES])
def test_int4_routes_vs_reference(name, n, k, g, kind, member, atom):
    sym = member == "sym"
    gen = _gen(n + k + g + sym)
    src = _source(kind, n, k, g, sym, gen)
    if kind == "all_values":
        assert set(int4_codec.unpack_codes(src[0]).unique().tolist()) == set(range(16))
        if not sym:
            assert set(src[2].unique().tolist()) == set(range(16)) or n * (k // g) < 16
    dev = torch.device("cuda")
    packed = int4_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    assert formats.format_of(packed) is MEMBERS[member] and packed.group_size == g
    w16 = _w16(src)
    x0 = fc.activations(3, k, gen, outliers=True)   # the formula _check uses is linear_int4's, read from the packed bytes
    assert torch.equal(int4_numerics.linear(x0, packed.to("cpu")), (x0.float() @ w16.float().t()).half())
    bias = (torch.randn(n, generator=gen) * 0.1).half()
    for m in M_LIST:
        x = fc.activations(m, k, gen, outliers=True)
        route = routes.route_for(formats.INT4.family, m, n, k)
        y = ops.qpn_linear(x.to(dev), packed)
        torch.cuda.synchronize()
        _check(y, x, _multiplied(src, packed, route, m, atom), f"{name} {kind} {member} g={g} M={m} ({route}, {atom})")
        yb = ops.qpn_linear(x.to(dev), packed, bias=bias.to(dev)).double().cpu()
        assert torch.allclose(yb, (y.double().cpu() + bias.double()).half().double(), rtol=2e-3, atol=2e-3), \
            f"{name} {member} M={m}: bias"
    # every tiled route also serves any M below its band's top when asked for by name
    for route in ("qpn4", "qpn4_mt2", "qpn4_chunked", "qpn4_reconstruct"):
        r = routes.as_route(route)
        m = min(5, r.kernel_max_m or 5)
        x = fc.activations(m, k, gen, outliers=False)
        _check(ops.qpn_linear(x.to(dev), packed, route=r), x, _multiplied(src, packed, r, m, atom),
               f"{name} {member} {route} M={m} ({atom})")


@pytest.mark.parametrize("member", list(MEMBERS))
@pytest.mark.parametrize("g", formats.INT4.group_sizes)
def test_int4_every_position_and_record_exact_on_gpu(g, member, atom):
    """One-hot activations: every (row, input) is one FP16 weight, bit-exact on every route; a
    corrupted record (its zero point, or its scale's low byte) is named by its (row, group)."""
    sym = member == "sym"
    n, k = 40, 2 * 128 + (g if g < 128 else 128)   # K = 288 / 320 / 384: several groups, one partial tile
    src = all_values_source(n, k, g, sym, _gen(g))
    dev = torch.device("cuda")
    packed = int4_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    w64 = _w16(src)

    def run(route, p):
        return lambda x: ops.qpn_linear(x.to(dev), p, route=route).cpu()

    for route, tokens in (("qpn4", 8), ("qpn4_mt2", 16), ("qpn4_chunked", 96), ("qpn4_reconstruct", 128)):
        bad = pg.probe(run(route, packed), w64, tokens)
        assert not bad, f"{member} g={g} {route} ({atom}): {len(bad)} wrong (row, input), first {bad[:4]}"
    # corrupt one record: row 33 (second tile on m8n8k4, third on m16n8k16), group 1
    row, grp = 33, 1
    rec, tile = packed.record_bytes, geometry(atom).tile_n
    slot = int(torch.argsort(int4_layout.record_rows(atom))[row % tile])
    off = (((row // tile) * packed.groups_pad + grp) * tile + slot) * rec
    broken = int4_layout.PackedINT4(packed.codes, packed.scales.clone(), packed.out_scale, n, k, g, sym, atom)
    broken.scales[off + (0 if sym else 2)] ^= 0x01 if sym else 0x03
    bad = pg.probe(run("qpn4", broken), w64, 8)
    assert {(r, kk // g) for r, kk in bad} == {(row, grp)}, \
        f"{member} g={g} ({atom}): corruption reported as {sorted(set(bad))[:6]}"


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int4_subnormal_operands(member, atom):
    """Group scales small enough that (code - zero) * scale is an FP16 subnormal (down to 2^-24):
    the decoder's hmul2 keeps them (no .ftz) and so does the reference; whether the tensor cores
    take them as they are is a property of the GPU (on a V100 unmeasured), settled here by the
    one-hot probe on mt1 and the reconstruct route."""
    sym = member == "sym"
    n, k, g = 32, 128, 32
    q = torch.randint(0, 16, (n, k), generator=_gen(5), dtype=torch.int64)
    q[:, :16] = torch.arange(16)
    s = torch.full((n, k // g), 2.0 ** -24, dtype=torch.float16) * torch.randint(1, 64, (n, k // g), generator=_gen(6))
    src = (int4_codec.pack_codes(q), s.half()) if sym else (int4_codec.pack_codes(q), s.half(),
                                                     (torch.arange(n * k // g) % 16).reshape(n, k // g).to(torch.uint8))
    w64 = _w16(src)
    assert bool(((w64 != 0) & (w64.abs() < 2.0 ** -14)).any()), "the case must hold subnormal operands"
    dev = torch.device("cuda")
    packed = int4_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    for route, tokens in (("qpn4", 8), ("qpn4_reconstruct", 128)):
        bad = pg.probe(lambda x, r=route: ops.qpn_linear(x.to(dev), packed, route=r).cpu(), w64, tokens)
        assert not bad, f"{member} {route} ({atom}): {len(bad)} subnormal operands changed, first {bad[:4]}"


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int4_m16n8k16_runs_its_own_kernels(member, atom):
    """On m16n8k16 each band runs the member's own configured kernel (sm80_tables.SM80_ROUTE_KERNELS,
    never another family's or member's) with the weight's group shift, and a chunked M (40: three
    16-row chunks of the MT = 2 kernel) agrees with the reference too."""
    if atom != "m16n8k16":
        pytest.skip("the m16n8k16 kernel table")
    from qpn.kernels import sm80_plan, sm80_tables
    sym = member == "sym"
    fmt = MEMBERS[member]
    gen = _gen(11 + sym)
    for g in formats.INT4.group_sizes:
        n, k = 48, 4 * g + 64 if g < 128 else 384
        src = int4_codec.quantize(outlier_weight(n, k, gen), g, symmetric=sym)
        packed = int4_layout.prepack(*(t.cuda() for t in src), atom=atom)
        w = ops.operands(packed)
        assert ops.kernel_member(w) == (fmt, {32: 1, 64: 2, 128: 3}[g])
        for m, mt in ((1, 1), (8, 1), (9, 2), (16, 2), (40, 2)):
            route = routes.route_for(formats.INT4.family, m, n, k)
            name, chunks = sm80_plan.sm80_kernel_for(route, m, n, fmt)
            assert name == sm80_tables.SM80_ROUTE_KERNELS[(fmt, mt)]
            assert name.startswith(fmt.kernel_prefix + "_")
            assert chunks == (-(-m // 16) if route.chunk_rows else 1)
            x = fc.activations(m, k, gen, outliers=True)
            _check(ops.qpn_linear(x.cuda(), packed), x, _multiplied(src, packed, route, m, atom),
                   f"{member} g={g} M={m} ({route}, {name})")


def _configured_int4_kernels(fmt) -> dict:
    """Every INT4 GEMM kernel of the sm_80+ source for member fmt (route kernels and candidates,
    variant 0), parsed from its entry lines."""
    from qpn.kernels import sm80_plan
    return {kn: c for kn, c in sm80_plan.sm80_kernels().items() if c.weight_format is fmt and c.variant == 0}


@pytest.mark.parametrize("member", list(MEMBERS))
def test_int4_every_configured_m16n8k16_kernel(member, atom):
    """Each configured INT4 kernel, route kernel or not, at every group size: a folded decoder
    (Frag16INT4FoldForm: the group scale applied to FP32 sums, groups of 64 and 128) within the
    FP32-order bound of the EXACT weights (code - zero) * scale, which it multiplies without
    rounding them to FP16; the plain decoder (and a folded one on groups of 32, which runs its plain
    form) within that bound of the FP16 weights. K = 1152 over 18 k-blocks, N = 200: the split-K runs
    start inside 128-groups, so a fold at a segment's end is exercised. One-hot: every (row, input)
    bit-exact, fp16((code - zero) * scale) for both forms."""
    if atom != "m16n8k16":
        pytest.skip("the m16n8k16 kernels")
    from qpn.kernels import sm80_plan
    sym = member == "sym"
    kernels = _configured_int4_kernels(MEMBERS[member])
    assert any(c.frag.startswith("Frag16INT4Fold") for c in kernels.values()), sorted(kernels)
    dev = torch.device("cuda")
    n, k = 200, 1152
    for g in formats.INT4.group_sizes:
        for kind in ("all_values", "outliers"):
            gen = _gen(g + 7 * sym + (kind == "outliers"))
            src = _source(kind, n, k, g, sym, gen)
            packed = int4_layout.prepack(*(t.to(dev) for t in src), atom=atom)
            w16, exact = _w16(src), int4_codec.dequantize_f64(*src)
            for kn, c in sorted(kernels.items()):
                folds = c.frag.startswith("Frag16INT4Fold") and g >= 64
                for m in ((1, 8) if c.mt == 1 else (9, 16)):
                    x = fc.activations(m, k, gen, outliers=True)
                    y = sm80_plan.run_sm80_kernel(x.to(dev), packed, kn)
                    torch.cuda.synchronize()
                    _check(y, x, exact if folds else w16, f"{kn} {kind} g={g} M={m}")
                if kind == "all_values":
                    bad = pg.probe(lambda x, kn=kn: sm80_plan.run_sm80_kernel(x.to(dev), packed, kn).cpu(), w16,
                                   8 * c.mt)
                    assert not bad, f"{kn} g={g}: {len(bad)} wrong (row, input), first {bad[:4]}"


@pytest.mark.parametrize("name,n,k,g", [s for s in SHAPES if s[1] >= 257], ids=[s[0] for s in SHAPES if s[1] >= 257])
def test_int4_thin_finish_and_refill_order_are_bit_for_bit_their_variants(name, n, k, g, atom):
    """The split-K finish that parks only the real tokens' sums (Qpn80::thin_finish: taken at few
    tokens, M = 1 up to 4 as the group's contributors allow) gives the same bits as the one that
    parks whole partials (the *_wide variant), and the refill loads issued before the group fold
    the same bits as after it (*_foldfirst), at every M of the band: same sums in the same order,
    the same rows and tokens. Outlier activations and weights, so a sum landing in the wrong row,
    token or slot, or a fold reading a refilled record, shows."""
    if atom != "m16n8k16":
        pytest.skip("the m16n8k16 kernels")
    from qpn.kernels import sm80_plan
    dev = torch.device("cuda")
    gen = _gen(n + k + g)
    src = _source("outliers", n, k, g, False, gen)
    packed = int4_layout.prepack(*(t.to(dev) for t in src), atom=atom)
    for m in range(1, 9):
        x = fc.activations(m, k, gen, outliers=True).to(dev)
        thin = sm80_plan.run_sm80_kernel(x, packed, "qpn4_mt1_m16n8k16_t2d2p0_fold")
        for variant in ("wide", "foldfirst"):
            other = sm80_plan.run_sm80_kernel(x, packed, f"qpn4_mt1_m16n8k16_t2d2p0_fold_{variant}")
            torch.cuda.synchronize()
            assert torch.isfinite(other).all(), f"{name} M={m} {variant}"
            same = thin.view(torch.int16) == other.view(torch.int16)
            assert same.all(), f"{name} M={m}: {int((~same).sum())} of {same.numel()} outputs differ from {variant}"
