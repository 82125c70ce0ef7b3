"""GPU numerics of every QPN route against the exact float64 reference (run on the H200 through
the device tool; CI has no GPU and skips). Bound per output matrix:
||y - fp16(y_ref)|| / ||fp16(y_ref)|| <= 2.75e-4, and no inf/NaN in y where fp16(y_ref) is finite.

Every test runs once per tensor-core atom the GPU executes: m8n8k4 (the SM70 kernels; emulated on
sm_80+) and, on sm_80 and later, m16n8k16 (the native kernels there), on weights prepacked for
that atom.

Set QPN_NUMERICS_REPORT=<path> to write every measured (shape, route, M, error) to a Markdown file.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from qpn.kernels import formats, jit, ops, prepack, reference, routes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (numerics run on an H200 via the device tool; CI has none)")

ATOMS = (["m8n8k4"] + (["m16n8k16"] if torch.cuda.get_device_capability() >= (8, 0) else [])
         if torch.cuda.is_available() else ["m8n8k4"])
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

RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("QPN_NUMERICS_REPORT")
    if not path or not RESULTS:
        return
    worst = max(RESULTS, key=lambda r: r["rel"])
    lines = [f"# QPN kernel numerics on {torch.cuda.get_device_name(0)}", "",
             f"{len(RESULTS)} (shape, route, M) cases; bound {BOUND:g}; worst {worst['rel']:.3e} "
             f"({worst['shape']}, {worst['route']}, M={worst['m']}); failures: "
             f"{sum(1 for r in RESULTS if not r['ok'])}", "",
             "| atom | shape | N | K | route | M | rel. error | nonfinite where ref finite | ok |",
             "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for atom in sorted({r["atom"] for r in RESULTS}):
        mine = [r for r in RESULTS if r["atom"] == atom]
        w = max(mine, key=lambda r: r["rel"])
        lines.insert(3, f"- {atom}: {len(mine)} cases, worst {w['rel']:.3e} ({w['shape']}, {w['route']}, M={w['m']}), "
                        f"failures {sum(1 for r in mine if not r['ok'])}")
    for r in RESULTS:
        lines.append(f"| {r['atom']} | {r['shape']} | {r['n']} | {r['k']} | {r['route']} | {r['m']} | {r['rel']:.3e} | "
                     f"{r['bad']} | {'yes' if r['ok'] else 'NO'} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _activations(m, k, dev, gen):
    x = torch.randn((m, k), generator=gen, device=dev)
    # outlier channels of several thousand, as real activations carry
    n_out = max(1, k // 512)
    ch = torch.randperm(k, generator=gen, device=dev)[:n_out]
    x[:, ch] = (torch.rand((m, n_out), generator=gen, device=dev) * 4000 + 2000) * \
        torch.where(torch.rand((m, n_out), generator=gen, device=dev) < 0.5, -1.0, 1.0)
    return x.to(torch.float16)


def _nvfp4_weight(n, k, dev, gen):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    # positive scales over a wide range, with some e4m3 subnormals
    sc = torch.randint(0x28, 0x58, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev)
    sub = torch.rand((n, k // 16), generator=gen, device=dev) < 0.05
    sc = torch.where(sub, torch.randint(1, 8, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev), sc)
    gs = torch.tensor(0.25 / (k ** 0.5) / 8, dtype=torch.float32)
    return codes, sc.view(torch.float8_e4m3fn), gs


def _fp8_weight(n, k, dev, gen, per_channel):
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen, device=dev)
    b = b & 0xDF  # exponent bit 2 cleared: |e4m3| <= 30 and no NaN encoding (0x7F / 0xFF)
    scale = (torch.rand(n, generator=gen, device=dev) + 0.5) * 0.02 / (k ** 0.5) if per_channel else \
        torch.tensor(0.03 / (k ** 0.5), device=dev)
    return b.view(torch.float8_e4m3fn), scale


def _poison(shape):
    t = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    del t


def _check(shape_name, packed, x, y64, route, m, bias=None):
    _poison((m, packed.n))
    y = ops.qpn_linear(x[:m], packed, route=route, bias=bias)
    torch.cuda.synchronize()
    ref = y64[:m]
    ref16 = ref.to(torch.float16)
    fin = torch.isfinite(ref16)
    bad = int((~torch.isfinite(y) & fin).sum())
    rel = reference.relative_error(y, ref)
    ok = rel <= BOUND and bad == 0 and y.shape == (m, packed.n) and y.dtype == torch.float16
    RESULTS.append(dict(atom=packed.atom, shape=shape_name, n=packed.n, k=packed.k, route=route or "table", m=m,
                        rel=rel, bad=bad, ok=ok))
    return ok, rel, bad


def _run_shape(name, packed, fmt, dev, gen, bias=None):
    k = packed.k
    x = _activations(M_MAX, k, dev, gen)
    y64 = reference.linear_f64(x, packed, bias)
    fails = []
    for m in M_LIST:
        route = routes.route_for(fmt, m, packed.n, k, arch=ops.arch_for_atom(packed.atom))
        ok, rel, bad = _check(name, packed, x, y64, route, m, bias)
        if not ok:
            fails.append((route, m, rel, bad))
    prefix = routes.ROUTE_PREFIX[fmt]
    for suffix, ms in EXPLICIT_M.items():
        for m in ms:
            ok, rel, bad = _check(name, packed, x, y64, prefix + suffix, m, bias)
            if not ok:
                fails.append((prefix + suffix, m, rel, bad))
    assert not fails, f"{name}: (route, M, rel, nonfinite) failing: {fails}"


@pytest.mark.gpu
@pytest.mark.parametrize("atom", ATOMS)
@pytest.mark.parametrize("name,n,k", NVFP4_SHAPES, ids=[s[0] for s in NVFP4_SHAPES])
def test_nvfp4_routes_vs_float64(name, n, k, atom):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 7 + k)
    w, s, gs = _nvfp4_weight(n, k, dev, gen)
    packed = prepack.prepack_nvfp4(w, s, gs, atom=atom)
    prepack.verify_nvfp4_roundtrip(packed, w, s)
    bias = (torch.randn(n, generator=gen, device=dev) * 0.5).half() if n % 2 else None
    _run_shape(name, packed, "nvfp4", dev, gen, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("atom", ATOMS)
@pytest.mark.parametrize("name,n,k", FP8_SHAPES, ids=[s[0] for s in FP8_SHAPES])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_fp8_routes_vs_float64(name, n, k, per_channel, atom):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 13 + k)
    w, scale = _fp8_weight(n, k, dev, gen, per_channel)
    packed = prepack.prepack_fp8(w, scale.to(dev), atom=atom)
    prepack.verify_fp8_roundtrip(packed, w, scale.to(dev))
    bias = (torch.randn(n, generator=gen, device=dev) * 0.5).half() if n % 2 else None
    _run_shape(f"{name}_{'pc' if per_channel else 'pt'}", packed, "fp8", dev, gen, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("atom", ATOMS)
def test_fp16_accumulator_overflow_trap(atom):
    """Outlier terms whose running FP16 sum overflows (>65504) before they cancel: a kernel that
    accumulated in FP16 returns inf/NaN here; ours must match the exact result. On m16n8k16 it also
    checks the NVFP4 layout's one-group-per-MMA rule: the +-1e5 products that cancel share a
    tensor-core sum only with products of their own group (cuBLAS's FP16 GEMM is recorded beside)."""
    dev = torch.device("cuda")
    n, k = 64, 256
    gen = torch.Generator(device=dev).manual_seed(99)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen, device=dev)
    codes[:, 0:4] = 7    # +6
    codes[:, 4:8] = 15   # -6
    w = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    sc = torch.full((n, k // 16), 0x38, dtype=torch.uint8, device=dev)
    sc[:, 0] = 0x7E      # 448
    packed = prepack.prepack_nvfp4(w, sc.view(torch.float8_e4m3fn), torch.tensor(0.02), atom=atom)
    x = torch.randn((16, k), generator=gen, device=dev).half()
    x[:, 0:8] = 5000.0   # 4 x 5000 x 6 x 448 x 0.02 = 1.08e6 before cancelling
    y64 = reference.linear_f64(x, packed)
    assert torch.isfinite(y64.half()).all()
    if atom == "m16n8k16":   # cuBLAS FP16 GEMM (FP32 accumulate and out) on the same exact values
        e2m1 = formats.decode_e2m1(formats.unpack_nvfp4_codes(w)).view(n, -1, 16)
        w16 = (e2m1 * formats.decode_e4m3(sc).unsqueeze(-1)).view(n, k).half()   # exact in FP16
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
@pytest.mark.parametrize("atom", ATOMS)
def test_cuda_graph_capture_and_stream_order(atom):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    w, s, gs = _nvfp4_weight(512, 1024, dev, gen)
    packed = prepack.prepack_nvfp4(w, s, gs, atom=atom)
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
    a = prepack.prepack_nvfp4(w, s, 1.0, atom=atom)
    b = prepack.prepack_nvfp4(w.cuda(), s.cuda(), 1.0, atom=atom)
    assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scales, b.scales.cpu())
    major, minor = torch.cuda.get_device_capability()
    t0 = time.time()
    path = ops.build(f"sm{major}{minor}")
    assert os.path.exists(path) and time.time() - t0 < 60


# ------------------------------------------------------------------- sm_80+ (m16n8k16) only
@pytest.mark.gpu
@needs_sm80
def test_sm80_subnormal_operand_products_are_exact():
    """Frag16NVFP4 hands the tensor cores e2m1 * e4m3 * 2^-7, an FP16 subnormal whenever
    e2m1 * e4m3 < 2^-7. With every group scale an e4m3 subnormal almost all operands are FP16
    subnormals: a tensor core that flushed them would return ~0 here, not the exact product."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(17)
    n, k = 300, 1024
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    sc = torch.randint(1, 8, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev)  # 2^-9 .. 7*2^-9
    packed = prepack.prepack_nvfp4(w, sc.view(torch.float8_e4m3fn), torch.tensor(64.0), atom="m16n8k16")
    x = _activations(32, k, dev, gen)
    y64 = reference.linear_f64(x, packed)
    for route, m in (("qpn2", 1), ("qpn2", 8), ("qpn2_mt2", 16), ("qpn2_chunked", 32), ("qpn2_reconstruct", 16)):
        ok, rel, bad = _check("subnormal_products_300x1024", packed, x, y64, route, m)
        assert ok, (route, m, rel, bad)


@pytest.mark.gpu
@needs_sm80
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_sm80_every_configuration_is_correct_and_every_variant_runs(fmt):
    """Each configured kernel of qpn_kernels_sm80.cu (any of them may serve a route after a sweep)
    meets the bound; the measured variants that drop a stage launch without a fault."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(23)
    n, k = 1000, 4160
    if fmt == "nvfp4":
        w, s, gs = _nvfp4_weight(n, k, dev, gen)
        packed = prepack.prepack_nvfp4(w, s, gs, atom="m16n8k16")
    else:
        w, scale = _fp8_weight(n, k, dev, gen, True)
        packed = prepack.prepack_fp8(w, scale, atom="m16n8k16")
    x = _activations(48, k, dev, gen)
    y64 = reference.linear_f64(x, packed)
    prefix = routes.ROUTE_PREFIX[fmt]
    for name, cfg in jit.sm80_kernels().items():
        if not name.startswith(prefix):
            continue
        for m in ((1, 8) if cfg.mt == 1 else (9, 16, 48)):
            route = prefix if cfg.mt == 1 else (prefix + "_mt2" if m <= 16 else prefix + "_chunked")
            y = ops.run_sm80_kernel(x[:m], packed, name, route)
            torch.cuda.synchronize()
            if cfg.variant != 0:
                continue
            rel = reference.relative_error(y, y64[:m])
            RESULTS.append(dict(atom="m16n8k16", shape=f"config_{name}", n=n, k=k, route=route, m=m, rel=rel,
                                bad=0, ok=rel <= BOUND))
            assert rel <= BOUND, (name, m, rel)
