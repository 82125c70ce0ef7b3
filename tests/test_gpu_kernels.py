"""GPU numerics of every QPN route against the exact float64 reference (run on the H200 through
the device tool; CI has no GPU and skips).

Weights cover the whole of both formats (tests/_format_cases.py): every finite e4m3 byte for FP8
(both signs, subnormals, 448) and every e2m1 code with group scales from every e4m3 byte up to
0x7E for NVFP4 ("all_bytes"), and realistic Gaussian / heavy-tailed weights quantized with the
checkpoint generator's functions ("gauss", "heavy"). Every shape runs with and without outlier
channels in the activations.

Two bounds per output matrix, both required:
* norm-wise: ||y - fp16(y_ref)|| / ||fp16(y_ref)|| <= 2.75e-4 (BOUND), and no inf/NaN in y where
  fp16(y_ref) is finite. The kernels' FP32 result is within ~1e-6 of exact, so this error is
  almost all the FP16 output rounding: y and fp16(y_ref) differ by one FP16 ulp (2^-11 .. 2^-10
  relative) where the FP32 result and the exact one straddle a rounding boundary, and agree
  elsewhere; 2.75e-4 leaves room for that on every element and fails a wrong weight that moves
  the norm. It cannot see a wrong group under outlier channels (they own the norm): the per-group
  probe below and tests/test_kernels_per_group.py do.
* per element (derived, not tuned): |y - fp16(y_ref)| <= ulp16(y_ref) + (K + 2) 2^-23 S, S = sum_k
  |x_k w_k| (all scales included). The products of exact FP16 operands are exact; a chain of K
  FP32 additions errs by at most K u S with u = 2^-23 even if the tensor core truncates instead of
  rounding; the FP32 result scale adds 2^-24 |y|, and two FP16 roundings of values that far apart
  differ by at most that plus one ulp.
* per position: test_every_position_and_group_scale_exact_on_gpu feeds one-hot activations so
  that every output is one weight value, exact in FP16: every code position of every tile and
  every (row, group) scale must come out bit-exact, on every route and both atoms, and a
  corrupted scale byte must be named by its (row, group).

Every test runs once per tensor-core atom the GPU executes: m8n8k4 (the SM70 kernels; emulated on
sm_80+) and, on sm_80 and later, m16n8k16 (the native kernels there), on weights prepacked for
that atom.

Set QPN_NUMERICS_REPORT=<path> to write every measured case to a Markdown file whose header
(commit, dirty flag and diff hash, command, GPU, driver, CUDA, torch, date) is written by
benchmarks/provenance.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from qpn.kernels import atoms, codecs, formats, jit, ops, reference, routes, sm80_plan, sm80_tables
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.nvfp4 import numerics as nvfp4_numerics
from qpn.kernels.families.fp8 import layout as fp8_layout
from qpn.kernels.families.fp8 import numerics as fp8_numerics
from qpn.kernels import families
from tests import _format_cases as fc
from tests import _per_group as pg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (numerics run on an H200 via the device tool; CI has none)")

ATOMS = (["m8n8k4"] + (["m16n8k16"] if torch.cuda.get_device_capability() >= (8, 0) else [])
         if torch.cuda.is_available() else ["m8n8k4"])
# NVFP4 on the m8n8k4 atom runs in two operand forms (ops.nvfp4_form): "m8n8k4" is the restore form,
# "m8n8k4-s7" the S7 form; each NVFP4 test runs both.
NVFP4_ATOMS = ["m8n8k4", "m8n8k4-s7"] + ATOMS[1:]
needs_sm80 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                                reason="the m16n8k16 kernels need an sm_80+ GPU")

BOUND = 2.75e-4
M_LIST = list(range(1, 17)) + [17, 24, 32, 64, 96, 97, 128]
M_MAX = 128
EXPLICIT_M = {"": [1, 3, 8], "_mt2": [1, 9, 16], "_chunked": [1, 17, 33, 96, 128], "_reconstruct": [1, 16, 97, 128]}

NVFP4_SHAPES = [("odd_1x16", 1, 16), ("odd_33x48", 33, 48), ("odd_100x80", 100, 80),
                ("odd_257x1008", 257, 1008), ("odd_31x2064", 31, 2064),
                ("tp4_mlp_gate_up", 8704, 5120), ("tp4_mlp_down", 5120, 4352),
                ("tp4_lm_head", 62080, 5120)]
FP8_SHAPES = [("odd_1x1", 1, 1), ("odd_7x3", 7, 3), ("odd_33x50", 33, 50), ("odd_129x1001", 129, 1001),
              ("odd_64x96", 64, 96), ("tp4_gdn_in_proj_qkvz", 4096, 5120), ("tp4_gdn_out_proj", 5120, 1536)]
# weight kinds per shape: the whole format everywhere, realistic weights wherever K allows groups of
# real statistics (all but the lm_head, whose heavy-tailed case would only repeat the MLP's)
KINDS = {"all_bytes": None, "gauss": None, "heavy": {"tp4_lm_head"}}


def _kinds_for(shapes):
    return [(name, n, k, kind) for name, n, k in shapes for kind, skip in KINDS.items()
            if not (skip and name in skip)]


RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("QPN_NUMERICS_REPORT")
    if not path or not RESULTS:
        return
    write_report(path, RESULTS)


def write_report(path, results):
    """The Markdown numerics report; every line written here (provenance by benchmarks/provenance.py)."""
    from qpn.benchmarks import provenance
    worst = max(results, key=lambda r: r["rel"])
    rec = provenance.run_record(report="tests/test_gpu_kernels.py numerics", bound_norm=f"{BOUND:g}",
                                bound_element="ulp16(ref) + (K + 2) 2^-23 sum|x w| (ratio <= 1)")
    lines = [f"# QPN kernel numerics on {torch.cuda.get_device_name(0)}", ""] + provenance.markdown_block(rec) + [
             f"{len(results)} cases; norm bound {BOUND:g}; worst {worst['rel']:.3e} "
             f"({worst['shape']}, {worst['route']}, M={worst['m']}); worst per-element ratio "
             f"{max(r.get('elem', 0.0) for r in results):.3f}; failures: {sum(1 for r in results if not r['ok'])}", ""]
    for atom in sorted({r["atom"] for r in results}):
        mine = [r for r in results if r["atom"] == atom]
        w = max(mine, key=lambda r: r["rel"])
        lines.append(f"- {atom}: {len(mine)} cases, worst {w['rel']:.3e} ({w['shape']}, {w['route']}, M={w['m']}), "
                     f"failures {sum(1 for r in mine if not r['ok'])}")
    lines += ["", "Probe rows (weights 'probe'): the error column counts wrong (row, input) positions.", "",
              "| atom | shape | weights | activations | N | K | route | M | rel. error | per-element ratio | "
              "nonfinite where ref finite | ok |",
              "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['atom']} | {r['shape']} | {r.get('weights', '')} | {r.get('acts', '')} | {r['n']} | {r['k']} | "
                     f"{r['route']} | {r['m']} | {r['rel']:.3e} | {r.get('elem', 0.0):.3f} | {r['bad']} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _activations(m, k, dev, gen, outliers=True):
    """FP16 activations; with outliers, channels of 2000-6000 as real activations carry."""
    return fc.activations(m, k, gen, outliers=outliers)


def _nvfp4_weight(n, k, dev, gen, kind="all_bytes"):
    return fc.nvfp4_weight(n, k, kind, gen)


def _fp8_weight(n, k, dev, gen, per_channel, kind="all_bytes"):
    return fc.fp8_weight(n, k, kind, gen, per_channel)


def _magnitude(x, packed):
    """S = |x| @ |W|^T with every scale folded into W (float64), for the per-element bound."""
    if packed.fmt == "nvfp4":
        vals, scales = nvfp4_numerics.decode_packed(packed)
        w = (vals.double().view(packed.n, -1, 16) * scales.double().unsqueeze(-1)).view(packed.n, packed.k)
        return x.double().abs() @ w.abs().t()
    vals, scale = fp8_numerics.decode_packed(packed)
    return (x.double().abs() @ vals.double().abs().t()) * scale.double().abs().reshape(1, -1)


def _ulp16(v):
    """FP16 ulp at |v| (subnormal spacing 2^-24 below 2^-14)."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -14)))
    return torch.pow(2.0, e - 10)


def _atom_and_form(atom_id: str, monkeypatch) -> str:
    """The atom of an NVFP4_ATOMS id; for m8n8k4 the device's NVFP4 form is set to the id's."""
    atom, _, form = atom_id.partition("-")
    if atom == "m8n8k4":
        monkeypatch.setitem(ops.nvfp4_forms, torch.cuda.current_device(), form or "restore")
    return atom


def _atom_label(packed, route=None, m: int = 1) -> str:
    """The report's atom column: the atom, and for NVFP4 on m8n8k4's tiled routes (the reconstruct
    route has one form) the form that ran."""
    r = routes.as_route(route) if route else routes.route_for(packed.fmt, m, packed.n, packed.k,
                                                              arch=atoms.arch_for_atom(packed.atom))
    if (packed.fmt == "nvfp4" and packed.atom == "m8n8k4" and r.kernel == routes.TILED
            and ops.nvfp4_form(torch.device("cuda")) == "s7"):
        return "m8n8k4-s7"
    return packed.atom


def _poison(shape):
    t = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    del t


def _check(shape_name, packed, x, y64, route, m, bias=None, mag=None, weights="", acts=""):
    _poison((m, packed.n))
    y = ops.qpn_linear(x[:m], packed, route=route, bias=bias)
    torch.cuda.synchronize()
    ref = y64[:m]
    ref16 = ref.to(torch.float16)
    fin = torch.isfinite(ref16)
    bad = int((~torch.isfinite(y) & fin).sum())
    rel = reference.relative_error(y, ref)
    elem = 0.0
    if mag is not None and bool(fin.any()):
        r16 = ref16.double()
        tol = _ulp16(torch.maximum(r16.abs(), y.double().abs())) + (packed.k + 2) * 2.0 ** -23 * mag[:m]
        ratio = ((y.double() - r16).abs() / tol)[fin & torch.isfinite(y)]
        elem = float(ratio.max()) if ratio.numel() else 0.0
    ok = rel <= BOUND and elem <= 1.0 and bad == 0 and y.shape == (m, packed.n) and y.dtype == torch.float16
    RESULTS.append(dict(atom=_atom_label(packed, route, m), shape=shape_name, n=packed.n, k=packed.k, route=route or "table", m=m,
                        rel=rel, elem=elem, bad=bad, ok=ok, weights=weights, acts=acts))
    return ok, rel, bad


def _run_shape(name, packed, fmt, dev, gen, bias=None, weights=""):
    k = packed.k
    fails = []
    for outliers in (True, False):
        acts = "outliers" if outliers else "plain"
        x = _activations(M_MAX, k, dev, gen, outliers=outliers)
        y64 = families.reference_linear_f64(x, packed, bias)
        mag = _magnitude(x, packed)
        for m in M_LIST:
            route = str(routes.route_for(fmt, m, packed.n, k, arch=atoms.arch_for_atom(packed.atom)))
            ok, rel, bad = _check(name, packed, x, y64, route, m, bias, mag, weights, acts)
            if not ok:
                fails.append((acts, route, m, rel, bad))
        prefix = routes.ROUTE_PREFIX[fmt]
        for suffix, ms in EXPLICIT_M.items():
            for m in ms:
                ok, rel, bad = _check(name, packed, x, y64, prefix + suffix, m, bias, mag, weights, acts)
                if not ok:
                    fails.append((acts, prefix + suffix, m, rel, bad))
        del y64, mag
    assert not fails, f"{name} ({weights}): (activations, route, M, rel, nonfinite) failing: {fails}"


@pytest.mark.gpu
@pytest.mark.parametrize("atom", NVFP4_ATOMS)
@pytest.mark.parametrize("name,n,k,kind", _kinds_for(NVFP4_SHAPES), ids=[f"{s[0]}-{s[3]}" for s in _kinds_for(NVFP4_SHAPES)])
def test_nvfp4_routes_vs_float64(name, n, k, kind, atom, monkeypatch):
    atom = _atom_and_form(atom, monkeypatch)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 7 + k + len(kind))
    w, s, gs = _nvfp4_weight(n, k, dev, gen, kind)
    packed = nvfp4_layout.prepack(w, s, gs, atom=atom)
    nvfp4_layout.verify_roundtrip(packed, w, s)
    bias = (torch.randn(n, generator=gen, device=dev) * 0.5).half() if n % 2 else None
    _run_shape(name, packed, "nvfp4", dev, gen, bias, weights=kind)


@pytest.mark.gpu
@pytest.mark.parametrize("atom", ATOMS)
@pytest.mark.parametrize("name,n,k,kind", _kinds_for(FP8_SHAPES), ids=[f"{s[0]}-{s[3]}" for s in _kinds_for(FP8_SHAPES)])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_fp8_routes_vs_float64(name, n, k, kind, per_channel, atom):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 13 + k + len(kind))
    w, scale = _fp8_weight(n, k, dev, gen, per_channel, kind)
    if kind == "all_bytes" and n * k >= fc.FP8_FINITE_BYTES.numel():
        assert fc.covers_every_fp8_byte(w)
    packed = fp8_layout.prepack(w, scale.to(dev), atom=atom)
    fp8_layout.verify_roundtrip(packed, w, scale.to(dev))
    bias = (torch.randn(n, generator=gen, device=dev) * 0.5).half() if n % 2 else None
    _run_shape(f"{name}_{'pc' if per_channel else 'pt'}", packed, "fp8", dev, gen, bias, weights=kind)


PROBE_SHAPES = [("odd_100x80", 100, 80), ("odd_257x1008", 257, 1008), ("tp4_mlp_down", 5120, 4352)]
PROBE_ROUTES = (("", 8), ("_mt2", 16), ("_chunked", 96), ("_reconstruct", 128))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,atom", [("nvfp4", a) for a in NVFP4_ATOMS] + [("fp8", a) for a in ATOMS])
@pytest.mark.parametrize("name,n,k", PROBE_SHAPES, ids=[s[0] for s in PROBE_SHAPES])
def test_every_position_and_group_scale_exact_on_gpu(name, n, k, fmt, atom, monkeypatch):
    """One-hot activations (tests/_per_group.py): every output is one weight value, exact in FP16,
    so every code position and every (row, group) scale must come out bit-exact on every route;
    then one corrupted packed scale byte (NVFP4) / channel scale (FP8) must be named exactly."""
    atom = _atom_and_form(atom, monkeypatch)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(n + k)
    wt = pg.nvfp4_probe_weight(n, k, gen) if fmt == "nvfp4" else pg.fp8_probe_weight(n, k, gen, per_channel=True)
    packed = (nvfp4_layout.prepack(*wt, atom=atom) if fmt == "nvfp4" else fp8_layout.prepack(*wt, atom=atom)).to(dev)
    w64 = pg.exact_weight(fmt, wt)
    prefix = routes.ROUTE_PREFIX[fmt]
    for suffix, per_call in PROBE_ROUTES:
        run = lambda x, r=prefix + suffix: ops.qpn_linear(x.to(dev), packed, route=r)  # noqa: E731
        bad = pg.probe(run, w64, per_call)
        RESULTS.append(dict(atom=_atom_label(packed, prefix + suffix), shape=f"probe_{name}_{fmt}", n=n, k=k, route=prefix + suffix, m=per_call,
                            rel=float(len(bad)), elem=0.0, bad=0, ok=not bad, weights="probe", acts="one-hot"))
        assert not bad, f"{atom} {prefix + suffix}: wrong at (row, input) {bad[:8]} ({len(bad)} in all)"
    # negative control: the probe names what was corrupted, through the chunked route
    run = lambda x: ops.qpn_linear(x.to(dev), packed, route=prefix + "_chunked")  # noqa: E731
    if fmt == "nvfp4":
        found_any = False
        for i in torch.randint(0, packed.scales.numel(), (4,), generator=gen).tolist():
            packed.scales[i] ^= 0x08
            want = pg.groups_of(pg.probe(lambda x: families.reference_linear_f64(x.to(dev), packed), w64, k))
            got = pg.groups_of(pg.probe(run, w64, 96))
            packed.scales[i] ^= 0x08
            assert got == want and len(want) <= 1, (i, sorted(got), sorted(want))
            found_any |= bool(want)
        assert found_any, "no corrupted byte belonged to a real row: the control tested nothing"
    else:
        packed.scale[n // 2] *= 2.0
        bad = pg.probe(run, w64, 96, positions=range(0, k, max(1, k // 64)))
        assert bad and {r for r, _ in bad} == {n // 2}, sorted({r for r, _ in bad})[:8]


@pytest.mark.gpu
@pytest.mark.parametrize("atom", NVFP4_ATOMS)
def test_fp16_accumulator_overflow_trap(atom, monkeypatch):
    """Outlier terms whose running FP16 sum overflows (>65504) before they cancel: a kernel that
    accumulated in FP16 returns inf/NaN here; ours must match the exact result. On m16n8k16 it also
    checks the NVFP4 layout's one-group-per-MMA rule: the +-1e5 products that cancel share a
    tensor-core sum only with products of their own group (cuBLAS's FP16 GEMM is recorded beside)."""
    atom = _atom_and_form(atom, monkeypatch)
    dev = torch.device("cuda")
    n, k = 64, 256
    gen = torch.Generator(device=dev).manual_seed(99)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen, device=dev)
    codes[:, 0:4] = 7    # +6
    codes[:, 4:8] = 15   # -6
    w = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    sc = torch.full((n, k // 16), 0x38, dtype=torch.uint8, device=dev)
    sc[:, 0] = 0x7E      # 448
    packed = nvfp4_layout.prepack(w, sc.view(torch.float8_e4m3fn), torch.tensor(0.02), atom=atom)
    x = torch.randn((16, k), generator=gen, device=dev).half()
    x[:, 0:8] = 5000.0   # 4 x 5000 x 6 x 448 x 0.02 = 1.08e6 before cancelling
    y64 = families.reference_linear_f64(x, packed)
    assert torch.isfinite(y64.half()).all()
    if atom == "m16n8k16":   # cuBLAS FP16 GEMM (FP32 accumulate and out) on the same exact values
        e2m1 = codecs.decode_e2m1(nvfp4_codec.unpack_codes(w)).view(n, -1, 16)
        w16 = (e2m1 * codecs.decode_e4m3(sc).unsqueeze(-1)).view(n, k).half()   # exact in FP16
        for m in (1, 8, 16):
            y = (torch.mm(x[:m], w16.t(), out_dtype=torch.float32) * 0.02).half()
            rel = reference.relative_error(y, y64[:m])
            RESULTS.append(dict(atom="cublas", shape="overflow_trap_64x256", n=n, k=k, route="torch_fp16_matmul",
                                m=m, rel=rel, bad=0, ok=rel <= BOUND))
    fails = []
    for route in ("qpn2", "qpn2_mt2", "qpn2_chunked", "qpn2_reconstruct"):
        for m in (1, 8, 16):
            if route == "qpn2" and m > 8:
                continue
            ok, rel, bad = _check("overflow_trap_64x256", packed, x, y64, route, m)
            assert bad == 0, (route, m, "inf/NaN where the exact result is finite")
            if not ok:
                fails.append((route, m, rel))
    assert not fails, fails


@pytest.mark.gpu
@pytest.mark.parametrize("atom", NVFP4_ATOMS)
def test_cuda_graph_capture_and_stream_order(atom, monkeypatch):
    atom = _atom_and_form(atom, monkeypatch)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    w, s, gs = _nvfp4_weight(512, 1024, dev, gen)
    packed = nvfp4_layout.prepack(w, s, gs, atom=atom)
    x = _activations(8, 1024, dev, gen)
    eager = ops.qpn_linear(x, packed)
    assert torch.equal(eager, ops.qpn_linear(x, packed))  # deterministic (split-K sums in fixed order)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.qpn_linear(static_x, packed)  # warm-up (module load) outside capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.qpn_linear(static_x, packed)
    static_x.copy_(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x2 = _activations(8, 1024, dev, gen)
    static_x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.qpn_linear(x2, packed))


@pytest.mark.gpu
@pytest.mark.parametrize("atom", ATOMS)
def test_cpu_and_gpu_prepack_agree_and_build_checks_entry_points(atom):
    gen = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (300, 80), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 0x7E, (300, 10), dtype=torch.uint8, generator=gen)
    a = nvfp4_layout.prepack(w, s, 1.0, atom=atom)
    b = nvfp4_layout.prepack(w.cuda(), s.cuda(), 1.0, atom=atom)
    assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scales, b.scales.cpu())
    major, minor = torch.cuda.get_device_capability()
    t0 = time.time()
    path = ops.build(f"sm{major}{minor}")
    assert os.path.exists(path) and time.time() - t0 < 60


@pytest.mark.gpu
def test_m8n8k4_nvfp4_forms_probe_and_entry_points(monkeypatch):
    """ops.nvfp4_form on this GPU. The probe's verdict is recorded in the report. Whatever it is:
    the restore form is exact on a weight whose every group scale is an e4m3 subnormal (the S7
    form's FP16-subnormal operand case) and the S7 form equals it bit for bit exactly when the
    probe passes; with the probe passed, the S7 form also equals the restore form bit for bit on
    a whole-format weight at every M of the tiled routes (the forms differ by a power of two,
    exactly restored). Each form launches its own entry points, and under CUDA-graph capture a
    device not yet probed runs the restore form without deciding."""
    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    monkeypatch.delenv(ops.NVFP4_FORM_ENV, raising=False)
    monkeypatch.setitem(ops.nvfp4_forms, idx, None)
    names = []
    real_launch = jit.launch
    monkeypatch.setattr(jit, "launch", lambda mod, name, *a: (names.append(name), real_launch(mod, name, *a))[1])
    gen = torch.Generator(device=dev).manual_seed(21)
    n, k = 300, 1024
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    sc = torch.randint(1, 8, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev)    # 2^-9 .. 7 * 2^-9
    sc |= torch.randint(0, 2, sc.shape, dtype=torch.uint8, generator=gen, device=dev) << 7  # either sign
    packed = nvfp4_layout.prepack(w, sc.view(torch.float8_e4m3fn), torch.tensor(64.0), atom="m8n8k4")
    x = _activations(32, k, dev, gen)

    # capture first, on a device not yet probed: the restore form, and still undecided afterwards
    static_x = x[:8].clone()
    ops.qpn_linear(static_x, packed, route="qpn2")   # warm-up (module load), outside capture
    monkeypatch.setitem(ops.nvfp4_forms, idx, None)
    names.clear()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = ops.qpn_linear(static_x, packed, route="qpn2")
    assert names == ["qpn2_mt1_m8n8k4"] and ops.nvfp4_forms.get(idx) is None
    g.replay()

    probe = ops.probe_nvfp4_s7(dev)
    form = ops.nvfp4_form(dev)
    assert form == ("s7" if probe else "restore") and ops.nvfp4_forms[idx] == form
    RESULTS.append(dict(atom="m8n8k4", shape="nvfp4_form_probe", n=64, k=256, route="probe_nvfp4_s7", m=16,
                        rel=0.0, elem=0.0, bad=0, ok=True, weights="subnormal scales",
                        acts=f"probe {'passes: s7' if probe else 'fails: restore'}"))
    y64 = families.reference_linear_f64(x, packed)
    outs = {}
    for f in ("restore", "s7"):
        monkeypatch.setitem(ops.nvfp4_forms, idx, f)
        for route, m in (("qpn2", 1), ("qpn2", 8), ("qpn2_mt2", 16), ("qpn2_chunked", 32)):
            names.clear()
            ok, rel, bad = _check("subnormal_scales_300x1024", packed, x, y64, route, m)
            assert names and all(nm.endswith("_s7_m8n8k4") == (f == "s7") for nm in names), (f, names)
            assert ok or f == "s7", (route, m, rel, bad)
            outs[(f, route, m)] = ops.qpn_linear(x[:m], packed, route=route)
    torch.cuda.synchronize()
    assert torch.equal(captured, outs[("restore", "qpn2", 8)])
    same = all(torch.equal(outs[("s7",) + key[1:]], y) for key, y in outs.items() if key[0] == "restore")
    assert same == probe, f"the probe says {probe}, the subnormal-scale layer says {same}"

    if probe:   # the whole format, every M of the tiled routes: bit-identical forms
        w2, s2, gs2 = _nvfp4_weight(2048, 5120, dev, gen, "all_bytes")
        p2 = nvfp4_layout.prepack(w2, s2, gs2, atom="m8n8k4")
        x2 = _activations(32, 5120, dev, gen)
        for m in list(range(1, 17)) + [32]:
            got = {}
            for f in ("restore", "s7"):
                monkeypatch.setitem(ops.nvfp4_forms, idx, f)
                got[f] = ops.qpn_linear(x2[:m], p2)
            assert torch.equal(got["restore"], got["s7"]), m


# ------------------------------------------------------------------- sm_80+ (m16n8k16) only
@pytest.mark.gpu
@needs_sm80
def test_sm80_subnormal_operand_products_are_exact():
    """Frag16NVFP4 hands the tensor cores e2m1 * e4m3 * 2^-14, an FP16 subnormal whenever
    e2m1 * e4m3 < 1. With every group scale an e4m3 subnormal every operand is an FP16 subnormal,
    down to 0.5 * 2^-9 * 2^-14 = 2^-24, the smallest: a tensor core that flushed or rounded them
    would return ~0 here, not the exact product."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(17)
    n, k = 300, 1024
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    sc = torch.randint(1, 8, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev)  # 2^-9 .. 7*2^-9
    packed = nvfp4_layout.prepack(w, sc.view(torch.float8_e4m3fn), torch.tensor(64.0), atom="m16n8k16")
    x = _activations(32, k, dev, gen)
    y64 = families.reference_linear_f64(x, packed)
    for route, m in (("qpn2", 1), ("qpn2", 8), ("qpn2_mt2", 16), ("qpn2_chunked", 32), ("qpn2_reconstruct", 16)):
        ok, rel, bad = _check("subnormal_products_300x1024", packed, x, y64, route, m)
        assert ok, (route, m, rel, bad)


def _packed_m16n8k16(fmt, n, k, dev, gen):
    """A random weight of the format (FP8: per-channel scales), prepacked for the sm_80+ atom."""
    if fmt == "nvfp4":
        w, s, gs = _nvfp4_weight(n, k, dev, gen)
        return nvfp4_layout.prepack(w, s, gs, atom="m16n8k16")
    w, scale = _fp8_weight(n, k, dev, gen, True)
    return fp8_layout.prepack(w, scale, atom="m16n8k16")


@pytest.mark.gpu
@needs_sm80
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_sm80_every_configuration_is_correct_and_every_variant_runs(fmt):
    """Each configured kernel of qpn_kernels_sm80.cu (any of them may serve a route after a sweep)
    meets the bound; the measured variants that drop a stage launch without a fault."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(23)
    n, k = 1000, 4160
    packed = _packed_m16n8k16(fmt, n, k, dev, gen)
    x = _activations(48, k, dev, gen)
    y64 = families.reference_linear_f64(x, packed)
    prefix = routes.ROUTE_PREFIX[fmt]
    for name, cfg in sm80_plan.sm80_kernels().items():
        if cfg.fmt != fmt:  # by the family, not the name: INT8's qpn8i_ starts with FP8's qpn8
            continue
        for m in ((1, 8) if cfg.mt == 1 else (9, 16, 48)):
            route = prefix if cfg.mt == 1 else (prefix + "_mt2" if m <= 16 and not cfg.band else prefix + "_chunked")
            y = sm80_plan.run_sm80_kernel(x[:m], packed, name, route)
            torch.cuda.synchronize()
            if cfg.variant != 0:
                continue
            rel = reference.relative_error(y, y64[:m])
            RESULTS.append(dict(atom="m16n8k16", shape=f"config_{name}", n=n, k=k, route=route, m=m, rel=rel,
                                bad=0, ok=rel <= BOUND))
            assert rel <= BOUND, (name, m, rel)


@pytest.mark.gpu
@needs_sm80
@pytest.mark.parametrize("fmt", ["fp8"])   # the block-cooperative kernels are FP8 only (QPN80C_ENTRY)
@pytest.mark.parametrize("n,k", [(48, 64), (1040, 192), (16, 8192), (4000, 5120)])
def test_sm80_block_cooperative_kernels_on_edge_partitions(fmt, n, k):
    """Qpn80Coop: one k-block per group (every warp flushes groups it has no item in), a single
    tile row split over many blocks, rows past N in the last group; bound met, and the same bits
    on a second run (the in-block and the cross-block sums both go in a fixed order)."""
    packed, x, y64, prefix = _edge_case(fmt, n, k, 31, 40)
    coop = [name for name, cfg in sm80_plan.sm80_kernels().items()
            if cfg.coop and cfg.variant == 0 and name.startswith(prefix)]
    assert coop
    for name in coop:
        cfg = sm80_plan.sm80_kernels()[name]
        for m in ((1, 8) if cfg.mt == 1 else (9, 16, 40)):
            route = prefix if cfg.mt == 1 else (prefix + "_mt2" if m <= 16 else prefix + "_chunked")
            _twice_within_bound(x[:m], packed, name, route, y64[:m])


def _edge_case(fmt, n, k, seed, rows):
    """(packed weight, activations of ``rows`` rows, their float64 product, route prefix) of one
    edge-partition case."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    packed = _packed_m16n8k16(fmt, n, k, dev, gen)
    x = _activations(rows, k, dev, gen)
    return packed, x, families.reference_linear_f64(x, packed), routes.ROUTE_PREFIX[fmt]


def _twice_within_bound(x, packed, name, route, y64):
    """Runs kernel ``name`` twice: the bound is met and the second run gives the same bits."""
    y = sm80_plan.run_sm80_kernel(x, packed, name, route)
    y2 = sm80_plan.run_sm80_kernel(x, packed, name, route)
    torch.cuda.synchronize()
    rel = reference.relative_error(y, y64)
    assert rel <= BOUND, (name, packed.n, packed.k, x.shape[0], rel)
    assert torch.equal(y, y2), (name, packed.n, packed.k, x.shape[0])
    return y, rel


@pytest.mark.gpu
@needs_sm80
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("n,k", [(48, 64), (1040, 192), (16, 8192), (4000, 5120)])
def test_sm80_band_kernels_on_edge_partitions(fmt, n, k):
    """Qpn80Band (the *_chunked route, one weight pass per 32 or 64 rows): one k-block per group, a
    single 16-row tile (7 of the block's 8 warps past N), groups split over many blocks, rows past
    N in the last group; M from one row to two chunks with a partial token tile. Bound met, the same
    bits on a second run, and the route itself (qpn_linear) gives the route kernel's bits."""
    packed, x, y64, prefix = _edge_case(fmt, n, k, 37, 100)
    bands = [name for name, cfg in sm80_plan.sm80_kernels().items()
             if cfg.band and cfg.variant == 0 and name.startswith(prefix)]
    assert set(sm80_tables.SM80_BAND_KERNELS.get(formats.FAMILIES[fmt], ())) <= set(bands) and bands
    chunked = routes.as_route(prefix + "_chunked")
    for name in bands:
        for m in (1, 17, 40, 64, 65, 100):
            y, rel = _twice_within_bound(x[:m], packed, name, prefix + "_chunked", y64[:m])
            RESULTS.append(dict(atom="m16n8k16", shape=f"band_{name}", n=n, k=k, route=prefix + "_chunked", m=m,
                                rel=rel, bad=0, ok=True))
            if name == sm80_plan.sm80_kernel_for(chunked, m, n)[0] and 17 <= m <= routes.M_CHUNKED_MAX:
                assert torch.equal(ops.qpn_linear(x[:m], packed), y), (name, n, k, m)
