"""CPU side of the grouped MoE path: packed expert stacks (prepack with verified inverse), the
FP32 reference a CPU engine serves against the float64 reference over the edge-case routings,
the routing semantics (unused experts never read, repeated experts kept, invalid ids dropped,
shared expert), the custom op and its fake implementation, and the clear errors."""
from __future__ import annotations

import pytest
import torch

from qpn.kernels import formats, moe, moe_reference, prepack, reference, routes
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.fp8 import codec as fp8_codec
from qpn.kernels.families.fp8 import layout as fp8_layout
from tests._moe_cases import ROUTINGS, activations, random_moe, routing

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast

BOUND = 2.75e-4
E, H, I = 8, 80, 48  # H, I not multiples of the 32-wide k-block: padding on both GEMMs


def _rel(y, y64):
    fin = torch.isfinite(y64.to(torch.float16))
    assert fin.all(), "reference overflowed FP16: the case would not test anything"
    assert torch.isfinite(y).all()
    return reference.relative_error(y, y64)


FORMATS = {"nvfp4": ("nvfp4", False, None), "fp8_pt": ("fp8", False, None),
           "fp8_pc": ("fp8", True, None), "nvfp4_fp8down": ("nvfp4", True, "fp8")}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", ROUTINGS)
def test_reference_within_bound_of_float64_over_edge_routings(case, fmt):
    f, pc, dfmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(100 * ROUTINGS.index(case) + list(FORMATS).index(fmt))  # fixed per case
    packed = random_moe(f, E, H, I, gen, per_channel=pc, down_fmt=dfmt)
    for tokens, top_k in ((1, 2), (5, 4), (16, 2)):
        ids, w = routing(case, tokens, top_k, E, gen)
        x = activations(tokens, H, gen)
        y = moe_reference.moe_reference(x, ids, w, packed)
        y64 = moe_reference.moe_reference_f64(x, ids, w, packed)
        assert y.shape == (tokens, H) and y.dtype == torch.float16
        rel = _rel(y, y64)
        assert rel <= BOUND, (case, fmt, tokens, top_k, rel)


@pytest.mark.parametrize("fmt,kind,outliers", [("nvfp4", "gauss", True), ("fp8_pc", "heavy", False),
                                               ("nvfp4_fp8down", "heavy", True), ("fp8_pt", "gauss", False)])
def test_reference_within_bound_on_quantized_realistic_weights(fmt, kind, outliers):
    """Experts quantized from Gaussian / heavy-tailed weights with the checkpoint generator's own
    functions (the edge-routing test above draws every code and byte of the formats)."""
    f, pc, dfmt = FORMATS[fmt]
    gen = torch.Generator().manual_seed(7 + list(FORMATS).index(fmt) + 10 * (kind == "heavy"))
    packed = random_moe(f, E, H, I, gen, per_channel=pc, down_fmt=dfmt, kind=kind)
    for tokens, top_k in ((1, 2), (16, 4)):
        ids, w = routing("random", tokens, top_k, E, gen)
        x = activations(tokens, H, gen, outliers=outliers)
        rel = _rel(moe_reference.moe_reference(x, ids, w, packed), moe_reference.moe_reference_f64(x, ids, w, packed))
        assert rel <= BOUND, (fmt, kind, tokens, top_k, rel)


def _poison_expert(packed: moe.PackedMoE, e: int) -> None:
    """Make expert e's weights NaN everywhere they could enter a result."""
    for st in (packed.gate, packed.up, packed.down):
        st.chscale[e] = float("nan")
        if st.scales is not None:
            st.scales[e] = 0x7F  # e4m3 NaN


def test_expert_chosen_by_no_token_is_never_read():
    gen = torch.Generator().manual_seed(11)
    packed = random_moe("nvfp4", E, H, I, gen)
    ids, w = routing("unused_experts", 6, 2, E, gen)
    used = set(ids.reshape(-1).tolist())
    unused = [e for e in range(E) if e not in used]
    assert unused
    x = activations(6, H, gen)
    before = moe_reference.moe_reference(x, ids, w, packed)
    for e in unused:
        _poison_expert(packed, e)
    after = moe_reference.moe_reference(x, ids, w, packed)
    assert torch.equal(before, after)
    ids[0, 0] = unused[0]  # the poison is effective once the expert is chosen
    assert torch.isnan(moe_reference.moe_reference(x, ids, w, packed)[0]).any()


def test_same_expert_twice_keeps_both_slots():
    gen = torch.Generator().manual_seed(12)
    packed = random_moe("nvfp4", E, H, I, gen)
    x = activations(3, H, gen)
    ids = torch.tensor([[2, 2], [5, 5], [1, 1]], dtype=torch.int32)
    w = torch.tensor([[0.25, 0.5], [0.7, 0.3], [1.0, 1.0]])
    twice = moe_reference.moe_reference_f64(x, ids, w, packed)
    once = moe_reference.moe_reference_f64(x, ids[:, :1], w.sum(1, keepdim=True), packed)
    assert torch.allclose(twice, once, rtol=1e-12, atol=1e-12)
    # and not what keeping only one slot would give
    assert not torch.allclose(twice, moe_reference.moe_reference_f64(x, ids[:, :1], w[:, :1], packed))
    assert _rel(moe_reference.moe_reference(x, ids, w, packed), twice) <= BOUND


def test_invalid_expert_ids_contribute_nothing():
    gen = torch.Generator().manual_seed(13)
    packed = random_moe("nvfp4", E, H, I, gen)
    x = activations(4, H, gen)
    ids = torch.full((4, 2), -1, dtype=torch.int32)
    ids[1, 1] = E  # past the last expert: also not on this rank
    w = torch.ones((4, 2))
    assert torch.equal(moe_reference.moe_reference(x, ids, w, packed), torch.zeros((4, H), dtype=torch.float16))
    ids[2, 0] = 3
    y64 = moe_reference.moe_reference_f64(x, ids, w, packed)
    only = moe_reference.moe_reference_f64(x[2:3], ids[2:3, :1], w[2:3, :1], packed)
    assert torch.equal(y64[2:3], only) and not y64[[0, 1, 3]].any()


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_beside_routed_ones(gated):
    gen = torch.Generator().manual_seed(14)
    packed = random_moe("nvfp4", E, H, I, gen)
    shared = random_moe("nvfp4", 1, H, 64, gen)
    ids, w = routing("random", 7, 2, E, gen)
    x = activations(7, H, gen)
    sw = torch.sigmoid(torch.randn(7, generator=gen)) if gated else None
    y = moe_reference.moe_reference(x, ids, w, packed, shared, sw)
    y64 = moe_reference.moe_reference_f64(x, ids, w, packed, shared, sw)
    assert _rel(y, y64) <= BOUND
    routed = moe_reference.moe_reference_f64(x, ids, w, packed)
    alone = moe_reference.moe_reference_f64(x, torch.zeros((7, 1), dtype=torch.int32),
                                            (sw if gated else torch.ones(7)).reshape(7, 1), shared)
    assert torch.allclose(y64, routed + alone, rtol=1e-12, atol=1e-9)
    assert (y64 - routed).abs().max() > 1e-3  # the shared expert does contribute


def test_swiglu_rounding_point_is_the_documented_one():
    """The f64 reference rounds exactly the SwiGLU output to FP16 and nothing else."""
    gen = torch.Generator().manual_seed(15)
    packed = random_moe("nvfp4", E, H, I, gen)
    x = activations(4, H, gen)
    ids = torch.tensor([[3], [3], [6], [0]], dtype=torch.int32)
    _, h = moe_reference.moe_reference_f64(x, ids, torch.ones((4, 1)), packed, return_h=True)
    assert torch.equal(h[0:2], moe_reference.swiglu_f64(x[0:2], packed, 3).to(torch.float16))
    assert torch.equal(h[2:3], moe_reference.swiglu_f64(x[2:3], packed, 6).to(torch.float16))


def test_stack_prepack_is_per_expert_dense_prepack_with_verified_inverse():
    gen = torch.Generator().manual_seed(16)
    w = torch.randn((3, 40, 64), generator=gen) * 0.1
    q = [nvfp4_codec.quantize(w[e]) for e in range(3)]
    codes = torch.stack([a for a, _, _ in q])
    sc = torch.stack([b for _, b, _ in q])
    gs = torch.stack([c for _, _, c in q])
    st = moe.prepack_expert_stack("nvfp4", codes, sc, gs)
    assert st.codes.shape[0] == 3 and st.chscale.shape == (3, 1)
    for e in range(3):
        dense = nvfp4_layout.prepack(codes[e], sc[e], gs[e])
        assert torch.equal(st.codes[e], dense.codes) and torch.equal(st.scales[e], dense.scales)
        back_w, back_s = nvfp4_layout.unprepack(st.expert(e))
        assert torch.equal(back_w, codes[e]) and torch.equal(back_s.view(torch.uint8), sc[e].view(torch.uint8))
    # FP8, per channel and per tensor
    q8 = [fp8_codec.quantize(w[e], per_channel=True) for e in range(3)]
    st8 = moe.prepack_expert_stack("fp8", torch.stack([a for a, _ in q8]), torch.stack([b for _, b in q8]))
    assert st8.per_channel and st8.chscale.shape == (3, 40)
    assert torch.equal(fp8_layout.unprepack(st8.expert(1))[0].view(torch.uint8), q8[1][0].view(torch.uint8))
    st8t = moe.prepack_expert_stack("fp8", torch.stack([a for a, _ in q8]), torch.tensor([0.1, 0.2, 0.3]))
    assert not st8t.per_channel and st8t.chscale.reshape(-1).tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_fused_w13_layout_gate_rows_first():
    gen = torch.Generator().manual_seed(17)
    from tests._moe_cases import random_nvfp4_stack

    w13, s13, _ = random_nvfp4_stack(4, 2 * I, H, gen)
    w2, s2, g2 = random_nvfp4_stack(4, H, I, gen)
    g13 = torch.rand((4, 2), generator=gen) * 0.01 + 0.001
    p = moe.prepack_moe("nvfp4", w13, s13, g13, w2, s2, g2)
    assert (p.num_experts, p.hidden, p.intermediate) == (4, H, I)
    gate = moe.prepack_expert_stack("nvfp4", w13[:, :I], s13[:, :I], g13[:, 0])
    up = moe.prepack_expert_stack("nvfp4", w13[:, I:], s13[:, I:], g13[:, 1])
    assert torch.equal(p.gate.codes, gate.codes) and torch.equal(p.up.codes, up.codes)
    assert torch.equal(p.gate.chscale.reshape(-1), g13[:, 0]) and torch.equal(p.up.chscale.reshape(-1), g13[:, 1])


def test_errors_name_the_problem():
    gen = torch.Generator().manual_seed(18)
    packed = random_moe("nvfp4", E, H, I, gen)
    x = activations(2, H, gen)
    ids, w = routing("random", 2, 2, E, gen)
    with pytest.raises(moe.MoeShapeError, match="hidden=80"):
        moe.qpn_moe(x[:, :64], ids, w, packed)
    with pytest.raises(moe.MoeShapeError, match="topk_weights"):
        moe.qpn_moe(x, ids, w[:, :1], packed)
    with pytest.raises(moe.MoeShapeError, match="integer"):
        moe.qpn_moe(x, ids.float(), w, packed)
    with pytest.raises(moe.MoeShapeError, match="shared expert must be one expert"):
        moe.qpn_moe(x, ids, w, packed, shared=packed)
    with pytest.raises(moe.MoeShapeError, match="down projection"):
        moe.PackedMoE(packed.gate, packed.up, packed.gate)
    with pytest.raises(moe.MoeShapeError, match="per expert"):
        moe.prepack_expert_stack("nvfp4", torch.zeros((2, 32, 16), dtype=torch.uint8),
                                 torch.zeros((2, 32, 2), dtype=torch.uint8).view(torch.float8_e4m3fn),
                                 torch.ones(3))
    with pytest.raises(formats.FormatError, match="expert 0: NVFP4 weight_scale must be"):
        moe.prepack_expert_stack("nvfp4", torch.zeros((2, 32, 16), dtype=torch.uint8),
                                 torch.zeros((2, 32, 3), dtype=torch.uint8).view(torch.float8_e4m3fn), torch.ones(2))
    with pytest.raises(moe.MoeShapeError, match="FP8 expert weight_scale"):
        moe.prepack_expert_stack("fp8", torch.zeros((2, 4, 8), dtype=torch.uint8).view(torch.float8_e4m3fn),
                                 torch.ones((2, 5)))
    with pytest.raises(moe.MoeShapeError, match="expert weight format 'int4' has no QPN MoE kernels"):
        moe.prepack_expert_stack("int4", torch.zeros((1, 4, 8), dtype=torch.uint8), None)
    with pytest.raises(moe.MoeShapeError, match="expert weight format 'int8' has no QPN MoE kernels"):
        moe.prepack_expert_stack("int8", torch.zeros((1, 4, 8), dtype=torch.uint8), None)


def test_prepack_mismatch_names_the_expert(monkeypatch):
    gen = torch.Generator().manual_seed(19)
    from tests._moe_cases import random_nvfp4_stack

    w, s, g = random_nvfp4_stack(3, 32, 64, gen)
    real = nvfp4_layout.verify_roundtrip
    calls = []

    def flaky(p, wt, st, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise prepack.PrepackMismatch("NVFP4 weight byte differs")
        return real(p, wt, st, *a, **k)

    monkeypatch.setattr(nvfp4_layout, "verify_roundtrip", flaky)
    with pytest.raises(prepack.PrepackMismatch, match="expert 1: NVFP4 weight byte differs"):
        moe.prepack_expert_stack("nvfp4", w, s, g)


def test_custom_op_on_cpu_is_the_reference_and_traces():
    gen = torch.Generator().manual_seed(20)
    packed = random_moe("nvfp4", E, H, I, gen)
    shared = random_moe("nvfp4", 1, H, I, gen)
    ids, w = routing("random", 5, 2, E, gen)
    x = activations(5, H, gen)
    y = moe.qpn_moe(x, ids, w, packed, shared)
    assert torch.equal(y, moe_reference.moe_reference(x, ids, w, packed, shared))
    compiled = torch.compile(lambda a, i, ww: moe.qpn_moe(a, i, ww, packed), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, ids, w), moe.qpn_moe(x, ids, w, packed))
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = packed.tensors()
    with FakeTensorMode() as mode:
        out = torch.ops.qpn.moe_experts(mode.from_tensor(x), mode.from_tensor(ids), mode.from_tensor(w),
                                        [mode.from_tensor(t) for t in real], [], None,
                                        packed.fmts, "", H, I, 0, "m8n8k4")
        assert out.shape == (5, H) and out.dtype == torch.float16


def test_moe_routes_and_group_bound():
    assert str(routes.moe_route_for("nvfp4")) == "qpn2_moe" and str(routes.moe_route_for("fp8")) == "qpn8_moe"
    assert routes.QPN_MOE_ROUTES == frozenset({"qpn2_moe", "qpn8_moe"})
    assert not routes.QPN_MOE_ROUTES & routes.QPN_ROUTES
    with pytest.raises(ValueError, match="INT4 W4A16 has no QPN MoE kernels"):
        routes.moe_route_for("int4")
    with pytest.raises(ValueError, match="INT8 W8A16 has no QPN MoE kernels"):
        routes.moe_route_for("int8")
    # the grid bound covers the worst groupings: every pair alone, or all pairs on one expert
    for pairs in range(1, 300):
        for experts in (1, 3, 8, 128, 256):
            bound = moe.max_groups(pairs, experts, 8)
            for counts in ([pairs] + [0] * (experts - 1),
                           [pairs // experts + (1 if e < pairs % experts else 0) for e in range(experts)]):
                assert sum(-(-c // 8) for c in counts) <= bound <= pairs


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_reference_reads_stacks_of_the_sm80_atom(fmt):
    """The same reference serves experts prepacked for the m16n8k16 atom (other fragment order,
    16-row tiles, 64-input k-blocks): same values, within the bound of float64."""
    gen = torch.Generator().manual_seed(21)
    a = random_moe(fmt, E, H, I, gen, per_channel=(fmt == "fp8"), atom="m16n8k16")
    assert a.atom == "m16n8k16" and a.gate.k_pad == 128 and a.down.k_pad == 64
    ids, w = routing("repeat_in_token", 9, 2, E, gen)
    x = activations(9, H, gen)
    y = moe_reference.moe_reference(x, ids, w, a)
    assert _rel(y, moe_reference.moe_reference_f64(x, ids, w, a)) <= BOUND
    # the checkpoint bytes recovered through the m16n8k16 inverse, repacked for m8n8k4, give
    # the identical float64 result

    def restack(st):
        if fmt == "nvfp4":
            ws = [nvfp4_layout.unprepack(st.expert(e)) for e in range(E)]
            return moe.prepack_expert_stack("nvfp4", torch.stack([q for q, _ in ws]),
                                            torch.stack([sc for _, sc in ws]), st.chscale.reshape(-1))
        ws = [fp8_layout.unprepack(st.expert(e)) for e in range(E)]
        return moe.prepack_expert_stack("fp8", torch.stack([q for q, _ in ws]), st.chscale)

    b = moe.PackedMoE(restack(a.gate), restack(a.up), restack(a.down))
    assert b.atom == "m8n8k4" and not torch.equal(b.gate.codes, a.gate.codes)
    assert torch.equal(moe_reference.moe_reference_f64(x, ids, w, a), moe_reference.moe_reference_f64(x, ids, w, b))


def test_down_from_h_reproduces_the_float64_chain():
    """down_f64_from_h fed the reference's own FP16 h gives back the float64 layer output exactly
    (the GPU test feeds it the kernel's h to check the down GEMM on its real input); a wrong
    expert or pair order would not."""
    import torch

    from qpn.kernels import moe_reference

    gen = torch.Generator().manual_seed(11)
    packed = random_moe("nvfp4", 4, 64, 32, gen)
    x = (torch.randn(5, 64, generator=gen) * 0.5).half()
    ids = torch.tensor([[0, 3], [1, 1], [2, -1], [3, 0], [1, 2]])
    w = torch.rand(5, 2, generator=gen)
    y64, h64 = moe_reference.moe_reference_f64(x, ids, w, packed, return_h=True)
    got = moe_reference.down_f64_from_h(h64.nan_to_num(), ids, w, packed)
    assert torch.equal(got, y64)
    swapped = moe_reference.down_f64_from_h(h64.nan_to_num().flip(0), ids, w, packed)
    assert not torch.allclose(swapped, y64)
