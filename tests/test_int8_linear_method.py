"""INT8 W8A16 through the one QPN linear method on real vLLM 0.32 layers (no server): GPTQ 8-bit
(v1 and v2 zero points, symmetric) and compressed-tensors pack-quantized num_bits 8 (group and
channel strategies), each fused layer kind (QKV, gate/up, GDN qkvz with a tuple shard id, the
row-parallel down projection), every group size (32, 64, 128, per channel). The tensors go in
through vLLM's own parameter classes and weight loaders, come out prepacked with a proven inverse
and no checkpoint tensor left, and compute what an independent byte decoder written here says
they should: with identity activations every weight must come back as fp16((code - zero) * scale)
exactly. Two tensor-parallel ranks together give the whole layer, and a broken module is refused
naming it.

The INT8 family (kernels/families/int8/) and the integer conventions' entries are all that serve
these: the method, the conventions' types and the layer plans are INT4's, shared."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from qpn.fork_patches.quant import conventions as cv  # noqa: E402
from qpn.scripts.checkpoints import make_int4_checkpoint as mi  # noqa: E402
from tests.test_int4_linear_method import (  # noqa: E402,F401  (engine_context, tp_rank: fixtures)
    TARGET, _Config, engine_context, layer_plan, load, tp_rank)

pytestmark = pytest.mark.engine

# name -> (convention, symmetric, GPTQ checkpoint_format: v1 stores zero - 1)
KINDS = {
    "gptq-sym": (cv.GPTQ, True, "gptq"),
    "gptq-v1": (cv.GPTQ, False, "gptq"),
    "gptq-v2": (cv.GPTQ, False, "gptq_v2"),
    "ct-sym": (cv.COMPRESSED_TENSORS, True, None),
    "ct-asym": (cv.COMPRESSED_TENSORS, False, None),
}
GROUPS = [32, 64, 128, -1]


def canonical(n: int, k: int, g: int, sym: bool, seed: int, zero_min: int = 0):
    """(codes uint8 [N, K], float16 scales [N, groups], zeros or None) holding every code 0..255 in
    the first rows and every zero point zero_min..255, with distinct scales per (row, group)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    q.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    groups = 1 if g == -1 else k // g
    s = (torch.rand(n, groups, generator=gen) * 0.004 + 0.0002).to(torch.float16)
    if sym:
        return q, s, None
    span = 256 - zero_min
    z = zero_min + (torch.arange(n).view(-1, 1) * 37 + torch.arange(groups).view(1, -1) * 11 + seed) % span
    return q, s, z.to(torch.uint8)


def write(kind: str, codes, scales, zeros, g: int) -> dict[str, torch.Tensor]:
    conv, sym, fmt = KINDS[kind]
    if conv is cv.GPTQ:
        return mi.to_gptq(codes, scales, zeros, g, fmt, bits=8)
    return mi.to_pack_quantized(codes, scales, zeros, bits=8)


def _bytes(words: torch.Tensor, j: int) -> torch.Tensor:
    return ((words.to(torch.int64) >> (8 * j)) & 0xFF).float()


def decode_checkpoint(kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 [N, K] from one module's checkpoint tensors, read byte by byte from the layouts'
    descriptions here (not through the family's or the conventions' unpackers)."""
    conv, sym, fmt = KINDS[kind]
    if conv is cv.GPTQ:
        qw, s, gi = t["qweight"], t["scales"].float(), t["g_idx"].long()
        k, n = qw.shape[0] * 4, qw.shape[1]
        q = torch.empty(k, n)
        for j in range(4):
            q[j::4, :] = _bytes(qw, j)
        if sym:
            z = torch.full(s.shape, 128.0)
        else:
            z = torch.empty(s.shape[0], qw.shape[1])
            for j in range(4):
                z[:, j::4] = _bytes(t["qzeros"], j)
            z += 1 if fmt == "gptq" else 0
        return ((q - z[gi]) * s[gi]).t()
    wp, s = t["weight_packed"], t["weight_scale"].float()
    n, k = wp.shape[0], wp.shape[1] * 4
    q = torch.empty(n, k)
    for j in range(4):
        q[:, j::4] = _bytes(wp, j)
    g = k // s.shape[1]
    if sym:
        z = torch.full(s.shape, 128.0)
    else:
        zw = t["weight_zero_point"]
        z = torch.empty(zw.shape[0] * 4, s.shape[1])
        for j in range(4):
            z[j::4, :] = _bytes(zw, j)
        z = z[:n]
    return (q - z.repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)


def _config(kind: str, g: int):
    from qpn.fork_patches.quant.linear_method import qpn_linear_method

    conv, sym, fmt = KINDS[kind]
    scheme = cv.int_scheme(8, sym, g, zero_offset=1 if fmt == "gptq" and not sym else 0)
    return _Config(lambda layer, prefix: qpn_linear_method(prefix, scheme, TARGET, conv))


def make_tensors(kind: str, plan, k: int, g: int, seed: int = 0):
    conv, sym, fmt = KINDS[kind]
    zero_min = 1 if fmt == "gptq" else 0  # v1 cannot store zero point 0
    return {module: write(kind, *canonical(rows, k, g, sym, seed + 17 * i, zero_min), g)
            for i, (module, _, rows) in enumerate(plan)}


def build(kind, which, g, tensors=None, seed=0):
    factory, plan, k = layer_plan(which)
    tensors = tensors if tensors is not None else make_tensors(kind, plan, k, g, seed)
    layer = factory(_config(kind, g))
    load(layer, tensors, plan)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, tensors, plan


def reference(kind, tensors, plan):
    return torch.cat([decode_checkpoint(kind, tensors[m]) for m, _, _ in plan])


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("which", ["qkv", "gate_up", "qkvz", "down"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_convention_loads_prepacks_frees_and_computes(engine_context, kind, which, g):
    from qpn.fork_patches.quant.linear_method import QPNLinearMethod
    from qpn.fork_patches.route_census.census import CENSUS

    layer, tensors, plan = build(kind, which, g)
    method = layer.quant_method
    assert isinstance(method, QPNLinearMethod) and method.fmt == "int8"
    assert method.format.has_zero_points != KINDS[kind][1]
    assert not list(layer.parameters()), "the checkpoint tensors must be freed after the proven prepack"
    entry = CENSUS.modules[method.census_name]
    assert entry["region"] == "int8" and entry["prepack_verified"]
    assert method.weight_source() == "checkpoint_codes"
    w = reference(kind, tensors, plan)
    assert w.shape == (method.n, method.k)
    got = method.apply(layer, torch.eye(method.k))
    assert torch.equal(got, w.to(torch.float16).float().t()), "a weight differs from the checkpoint's"
    gen = torch.Generator().manual_seed(1)
    for m in (1, 9, 40):
        x = torch.randn(m, method.k, generator=gen)
        ref = x @ w.t()
        torch.testing.assert_close(method.apply(layer, x), ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["gptq-v1", "gptq-v2", "ct-asym"])
def test_every_code_and_zero_point_is_exercised(kind):
    _, plan, k = layer_plan("gate_up")
    conv, sym, fmt = KINDS[kind]
    zero_min = 1 if fmt == "gptq" else 0
    codes, s, z = canonical(plan[0][2], k, 32, sym, 0, zero_min)
    assert set(codes.unique().tolist()) == set(range(256))
    assert set(z.unique().tolist()) == set(range(zero_min, 256))


@pytest.mark.parametrize("g", [64, -1])
@pytest.mark.parametrize("which", ["down", "gate_up"])
@pytest.mark.parametrize("kind", ["gptq-v1", "ct-asym", "ct-sym"])
def test_tp2_ranks_together_give_the_whole_layer(engine_context, tp_rank, kind, which, g):
    """Row-parallel ranks split the inputs at whole groups (per channel: every rank reads every
    row's one scale and zero point); column-parallel ranks split the rows."""
    factory, plan, k = layer_plan(which)
    tensors = make_tensors(kind, plan, k, g, seed=5)
    w = reference(kind, tensors, plan)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    outs = []
    for rank in range(2):
        tp_rank(rank, 2)
        layer = factory(_config(kind, g))
        load(layer, tensors, plan)
        layer.quant_method.process_weights_after_loading(layer)
        m = layer.quant_method
        part = x[:, rank * m.k:(rank + 1) * m.k] if which == "down" else x
        outs.append(m.apply(layer, part).double())
    if which == "down":
        y = outs[0] + outs[1]   # the all-reduce of the ranks
    else:  # each rank holds half of gate and half of up
        halves = [o.split(128, dim=1) for o in outs]
        y = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim=1)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(y, ref, rtol=4e-3, atol=4e-3 * float(ref.abs().max()))


def _set(module, name, fn):
    def mutate(t):
        t[module][name] = fn(t[module][name])
    return mutate


@pytest.mark.parametrize("kind, mutate, needle", [
    ("gptq-v1", _set("down_proj", "scales", lambda s: s.to(torch.float32) * (1 + 2 ** -20)),
     "float16 cannot represent exactly"),
    ("ct-asym", _set("down_proj", "weight_scale", lambda s: s[:, :-1].contiguous()), "has shape"),
    ("gptq-v2", _set("down_proj", "qweight", lambda w: w.to(torch.int64)), "is stored as torch.int64"),
    ("ct-asym", lambda t: t["down_proj"].pop("weight_zero_point"), "missing tensor"),
    # desc_act: input i in group i mod 8, so every block of 64 inputs mixes all eight groups
    ("gptq-v2", _set("down_proj", "g_idx", lambda gi: (torch.arange(gi.numel(), dtype=torch.int32) % 8)),
     "activation-ordered"),
    # whole groups stored in reverse order only move scale columns: served (the control above's twin)
    pytest.param("gptq-v2", _set("down_proj", "g_idx", lambda gi: gi.flip(0).contiguous()), None, id="groups-reordered"),
])
def test_broken_module_fails_naming_it(engine_context, kind, mutate, needle):
    from qpn.fork_patches.quant.linear_method import QPNCheckpointError

    _, plan, k = layer_plan("down")
    tensors = make_tensors(kind, plan, k, 64)
    mutate(tensors)
    if needle is None:
        layer, _, plan = build(kind, "down", 64, tensors=tensors)
        w = reference(kind, tensors, plan)
        assert torch.equal(layer.quant_method.apply(layer, torch.eye(k)), w.to(torch.float16).float().t())
        return
    with pytest.raises(QPNCheckpointError) as e:
        build(kind, "down", 64, tensors=tensors)
    msg = str(e.value)
    assert "layers.0.mlp.down_proj" in msg and "INT8 W8A16" in msg and needle in msg, msg


def test_a_generated_gptq_8bit_module_computes(engine_context, tmp_path):
    """make_int4_checkpoint --bits 8's own GPTQ output for the tiny model's gate/up, through the method."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    mi.make_int4_checkpoint(tmp_path / "gptq8", "gptq", group_size=64, bits=8)
    full = load_file(str(tmp_path / "gptq8" / "model.safetensors"))
    base = "model.language_model.layers.0.mlp."
    tensors = {m: {n: full[f"{base}{m}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx")}
               for m in ("gate_proj", "up_proj")}
    spec = mi.tiny_hybrid.TinyHybridSpec()
    plan = [("gate_proj", 0, spec.intermediate_size), ("up_proj", 1, spec.intermediate_size)]
    layer = MergedColumnParallelLinear(spec.hidden_size, [spec.intermediate_size] * 2, bias=False,
                                       quant_config=_config("gptq-v1", 64), prefix="layers.0.mlp.gate_up_proj")
    load(layer, tensors, plan)
    layer.quant_method.process_weights_after_loading(layer)
    w = reference("gptq-v1", tensors, plan)
    assert torch.equal(layer.quant_method.apply(layer, torch.eye(spec.hidden_size)), w.to(torch.float16).float().t())
