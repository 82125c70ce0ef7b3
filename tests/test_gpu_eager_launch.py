"""The eager launch cache of qpn_linear on sm_80+ (sm80_plan.eager_tiled): a call that takes the cached
path gives the same bits as the general path on every route band, bias kind and format, and a
weight whose tensors are replaced is planned again instead of launching on stale pointers.
Runs on the H200 through the device tool; CI has no GPU and skips."""
from __future__ import annotations

import pytest
import torch

from qpn.kernels import ops, routes, sm80_plan
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.fp8 import layout as fp8_layout
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import layout as int4_layout
from tests import _format_cases as fc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                       reason="the eager launch cache serves the m16n8k16 kernels: needs an sm_80+ GPU "
                              "(run on an H200 via the device tool; CI has none)"),
]

M_LIST = [1, 2, 7, 8, 9, 16, 17, 40, 96]


def _packed(fmt, n, k, gen, per_channel=False):
    if fmt in ("int4", "int4_sym"):   # quantized Gaussian weights, group 128 (32 where K needs it)
        w = torch.randn((n, k), generator=torch.Generator().manual_seed(n * k)) * 0.02
        src = int4_codec.quantize(w, 128 if k % 128 == 0 else 32, symmetric=fmt == "int4_sym")
        return int4_layout.prepack(*(t.cuda() if t is not None else None for t in src), atom="m16n8k16")
    if fmt == "nvfp4":
        return nvfp4_layout.prepack(*fc.nvfp4_weight(n, k, "gauss", gen), atom="m16n8k16")
    return fp8_layout.prepack(*fc.fp8_weight(n, k, "gauss", gen, per_channel), atom="m16n8k16")


def _general(x, packed, route, bias):
    """The general (uncached) path on the same call."""
    w = ops.operands(packed)
    r = routes.as_route(route) if route is not None else routes.route_for(
        w.fmt, x.shape[0], w.n, w.k, arch="sm80")
    return ops.linear_operands(x, w, r, bias)


@pytest.mark.parametrize("fmt,per_channel", [("nvfp4", False), ("fp8", False), ("fp8", True),
                                             ("int4", False), ("int4_sym", False)])
@pytest.mark.parametrize("n,k", [(300, 1024), (33, 128), (5120, 1536)])
def test_cached_path_is_bit_identical_to_the_general_path(fmt, per_channel, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    packed = _packed(fmt, n, k, gen, per_channel)
    biases = {"none": None,
              "fp16": (torch.randn(n, generator=gen, device="cuda") * 0.5).half(),
              "fp32": torch.randn(n, generator=gen, device="cuda") * 0.5}
    x_all = fc.activations(max(M_LIST), k, gen, outliers=True)
    assert x_all.dtype == torch.float16
    for m in M_LIST:
        x = x_all[:m].contiguous()
        for bname, bias in biases.items():
            for route in (None, str(routes.route_for(ops.operands(packed).fmt, m, n, k, arch="sm80"))):
                y = ops.qpn_linear(x, packed, route=route, bias=bias)
                ent = sm80_plan.eager_weights.get(id(packed))
                assert ent is not None and ent.ref() is packed, "the cached path was not taken"
                plan = ent.plans.get((m, route, torch.cuda.current_stream().cuda_stream))
                assert isinstance(plan, sm80_plan.Launch), (m, route, plan)
                ref = _general(x, packed, route, bias)
                assert torch.equal(y, ref), (fmt, n, k, m, bname, route)
    # 3-D activations and FP32 activations take the general path and agree too
    x3 = x_all[:8].reshape(2, 4, k)
    assert torch.equal(ops.qpn_linear(x3, packed), _general(x_all[:8], packed, None, None).reshape(2, 4, n))
    assert torch.equal(ops.qpn_linear(x_all[:8].float(), packed), _general(x_all[:8], packed, None, None))


def test_replaced_weight_tensors_are_planned_again():
    gen = torch.Generator(device="cuda").manual_seed(11)
    a = _packed("nvfp4", 256, 512, gen)
    b = _packed("nvfp4", 256, 512, gen)
    x = fc.activations(4, 512, gen, outliers=False)
    ya = ops.qpn_linear(x, a)
    yb = ops.qpn_linear(x, b)
    assert not torch.equal(ya, yb)
    a.codes, a.scales, a.global_scale = b.codes, b.scales, b.global_scale
    assert torch.equal(ops.qpn_linear(x, a), yb)   # a stale plan would give ya
    assert torch.equal(ops.qpn_linear(x, a), yb)


def test_wrong_route_still_raises_on_the_cached_path():
    gen = torch.Generator(device="cuda").manual_seed(12)
    packed = _packed("nvfp4", 64, 256, gen)
    x = fc.activations(12, 256, gen, outliers=False)
    with pytest.raises(ValueError, match="serves M <= 8"):
        ops.qpn_linear(x, packed, route="qpn2")
    with pytest.raises(ValueError, match="fp8"):
        ops.qpn_linear(x, packed, route="qpn8_mt2")
    # the reconstruct route is not cached and still serves
    y = ops.qpn_linear(x, packed, route="qpn2_reconstruct")
    assert torch.equal(y.isfinite(), torch.ones_like(y, dtype=torch.bool))


def test_cached_path_follows_the_current_stream():
    gen = torch.Generator(device="cuda").manual_seed(13)
    packed = _packed("fp8", 512, 1024, gen)
    x = fc.activations(8, 1024, gen, outliers=True)
    ref = ops.qpn_linear(x, packed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = ops.qpn_linear(x, packed)
        key = (8, None, side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert key in sm80_plan.eager_weights[id(packed)].plans
    assert torch.equal(y, ref)


def _chain(layers, x):
    """x through the layers in turn, each call's input written by the kernel just before it (a QPN
    kernel, or a torch op between two): what a *_pdl kernel must wait for before it reads x."""
    y = x
    for i, packed in enumerate(layers):
        y = ops.qpn_linear(y, packed)
        if i % 2:
            y = y * 0.03125
    return y


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch: sm_90+ (H200 via the device tool)")
@pytest.mark.parametrize("fmt,dims", [("nvfp4", (512, 1024, 768, 512)), ("fp8", (1536, 512, 1024, 1536)),
                                      ("nvfp4", (256, 100_352))])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_pdl_launches_give_the_plain_launches_bits_eager_and_in_a_graph(monkeypatch, fmt, dims, m):
    """On sm_90+ the route plans of sm80_tables.SM80_PDL_KERNELS (M <= 8; FP8 also M 9-16) launch the *_pdl
    kernels with the PDL attribute (lm_head-sized layers: the shared-memory ring's form). A chain in which every call's activations come from
    the kernel right before it, QPN after QPN on the same split-K scratch, gives bit for bit the
    plain launches' result (QPN_PDL=0), eagerly and replayed from a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(sum(dims) + m)
    layers = [_packed(fmt, n, k, gen) for k, n in zip(dims, dims[1:])]
    x = fc.activations(m, dims[0], gen, outliers=True)
    monkeypatch.setenv(sm80_plan.PDL_ENV, "0")
    sm80_plan.eager_weights.clear()
    plain = _chain(layers, x)
    assert all(p.pdl is None for l in layers for p in sm80_plan.eager_weights[id(l)].plans.values())
    monkeypatch.delenv(sm80_plan.PDL_ENV)
    sm80_plan.eager_weights.clear()
    eager = _chain(layers, x)
    plans = [p for l in layers for p in sm80_plan.eager_weights[id(l)].plans.values()]
    want_pdl = m <= 8 or fmt == "fp8"
    assert plans and all((p.pdl is not None) is want_pdl for p in plans), (fmt, m, want_pdl)
    assert torch.equal(eager, plain)
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    static_x = x.clone()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up: the capture stream's plans built before capture
        _chain(layers, static_x)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, stream=side):
        static_y = _chain(layers, static_x)
    for _ in range(3):
        static_y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, plain)
    sm80_plan.eager_weights.clear()
