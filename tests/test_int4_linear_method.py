"""QPN4 (INT4 W4A16) linear method on real vLLM 0.32 layers (no server): AutoAWQ, GPTQ (v1 and
v2 zero points, symmetric and not) and compressed-tensors pack-quantized tensors, written by
make_int4_checkpoint's writers (GPTQ by its pack_nibbles), go in through vLLM's own fused, column-
and row-parallel weight loaders, come out prepacked with the inverse proven and no source tensor
left; apply() computes what a float32 decoder written here from the checkpoint tensors alone says,
for every code value and zero point and groups of 32 / 64 / 128; a broken module fails naming it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from qpn.fork_patches.quant import conventions as cv
from qpn.kernels import formats  # noqa: E402
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import checkpoint as int4_checkpoint
from qpn.scripts.checkpoints import make_int4_checkpoint as mi  # noqa: E402

TARGET = {"backend": "reference", "arch": "sm70", "atom": "m8n8k4"}
AWQ_NIBBLES = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble j of a word holds column 8c + this[j]
HEADS, KV_HEADS, HEAD = 4, 2, 64


@pytest.fixture(scope="module")
def engine_context(tmp_path_factory):
    """A single-process tensor-parallel group and a current vLLM config, as a worker has them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    with set_current_vllm_config(VllmConfig()):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('dist')}/init")
            initialize_model_parallel(1, 1)
        yield


@pytest.fixture
def tp_rank(monkeypatch):
    """The tensor-parallel rank and size vLLM's layers and parameters read at construction."""
    import vllm.model_executor.layers.linear as linear_mod
    import vllm.model_executor.parameter as param_mod

    def set_rank(rank: int, size: int):
        for mod in (linear_mod, param_mod):
            monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: size)
    return set_rank


# ------------------------------------------------------------------------------ checkpoints
# (name, Convention, symmetric, stored zero = zero - offset)
KINDS = {
    "awq": (cv.AWQ, False, 0),
    "gptq-sym": (cv.GPTQ, True, 1),
    "gptq-v1": (cv.GPTQ, False, 1),
    "gptq-v2": (cv.GPTQ, False, 0),
    "ct-sym": (cv.COMPRESSED_TENSORS, True, 0),
    "ct-asym": (cv.COMPRESSED_TENSORS, False, 0),
}


def canonical(n: int, k: int, g: int, sym: bool, seed: int, zero_min: int = 0):
    """(codes uint8 [N, K/2], float16 scales, zeros) holding every code 0..15 and every zero point
    zero_min..15, with distinct scales per (row, group)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q[0, :16] = torch.arange(16, dtype=torch.uint8)
    s = (torch.rand(n, k // g, generator=gen) * 0.05 + 0.002).to(torch.float16)
    if sym:
        return int4_codec.pack_codes(q), s, None
    span = 16 - zero_min
    z = (zero_min + (torch.arange(n).view(-1, 1) * 7 + torch.arange(k // g).view(1, -1) + seed) % span)
    return int4_codec.pack_codes(q), s, z.to(torch.uint8)


def to_gptq(codes, scales, zeros, g: int, offset: int) -> dict[str, torch.Tensor]:
    """Canonical -> GPTQ {qweight [K/8, N] (eight inputs per word), qzeros [K/g, N/8], scales
    [K/g, N], g_idx [K]} (AutoGPTQ's layout; qzeros of a symmetric module hold 8 - offset)."""
    q = int4_codec.unpack_codes(codes)
    n, k = q.shape
    z = zeros if zeros is not None else torch.full(scales.shape, 8, dtype=torch.uint8)
    names = cv.GPTQ.names(formats.INT4)
    return {names.codes: mi.pack_nibbles(q.t(), 0),
            names.zero_points: mi.pack_nibbles((z.to(torch.int64) - offset).t(), 1),
            names.group_scales: scales.t().contiguous(), names.g_idx: (torch.arange(k, dtype=torch.int32) // g)}


def write(kind: str, codes, scales, zeros, g: int) -> dict[str, torch.Tensor]:
    conv, sym, offset = KINDS[kind]
    if conv is cv.AWQ:
        return mi.to_awq(codes, scales, zeros)
    if conv is cv.GPTQ:
        return to_gptq(codes, scales, zeros, g, offset)
    return mi.to_pack_quantized(codes, scales, zeros)


def _nib(words: torch.Tensor, j: int) -> torch.Tensor:
    return (words.to(torch.int64) >> (4 * j)) & 0xF


def decode_checkpoint(kind: str, t: dict[str, torch.Tensor], g: int) -> torch.Tensor:
    """float32 [N, K] from one module's checkpoint tensors, written from the formats' descriptions
    (not through the int4 family's or conventions' unpackers)."""
    conv, sym, offset = KINDS[kind]
    if conv is cv.AWQ:
        qw, qz, s = t["qweight"], t["qzeros"], t["scales"].float()
        k, n = qw.shape[0], qw.shape[1] * 8
        q, z = torch.empty(k, n), torch.empty(k // g, n)
        for j in range(8):
            q[:, AWQ_NIBBLES[j]::8] = _nib(qw, j).float()
            z[:, AWQ_NIBBLES[j]::8] = _nib(qz, j).float()
        return ((q - z.repeat_interleave(g, 0)) * s.repeat_interleave(g, 0)).t()
    if conv is cv.GPTQ:
        qw, s, gi = t["qweight"], t["scales"].float(), t["g_idx"].long()
        k, n = qw.shape[0] * 8, qw.shape[1]
        q = torch.empty(k, n)
        for j in range(8):
            q[j::8, :] = _nib(qw, j).float()
        if sym:
            z = torch.full((k // g, n), 8.0)
        else:
            z = torch.empty(k // g, n)
            for j in range(8):
                z[:, j::8] = _nib(t["qzeros"], j).float() + offset
        return ((q - z[gi]) * s[gi]).t()
    wp, s = t["weight_packed"], t["weight_scale"].float()
    n, k = wp.shape[0], wp.shape[1] * 8
    q = torch.empty(n, k)
    for j in range(8):
        q[:, j::8] = _nib(wp, j).float()
    if sym:
        z = torch.full((n, k // g), 8.0)
    else:
        z = torch.empty(n, k // g)
        for j in range(8):
            z[j::8, :] = _nib(t["weight_zero_point"], j).float()
    return (q - z.repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)


# ---------------------------------------------------------------------------------- layers
class _Config:
    """The least of a quantization config vLLM's layers ask: the method for a prefix."""

    online_quantization_config = None

    def __init__(self, make):
        self.make = make

    def get_quant_method(self, layer, prefix):
        return self.make(layer, prefix)


def _config(kind: str, g: int, **kw):
    from qpn.fork_patches.quant.linear_method import qpn_linear_method

    conv, sym, offset = KINDS[kind]
    scheme = cv.int_scheme(4, sym, g, zero_offset=0 if sym else offset, **kw)
    return _Config(lambda layer, prefix: qpn_linear_method(prefix, scheme, TARGET, conv))


def layer_plan(which: str):
    """(layer factory, [(checkpoint module, shard id, rows)], K)."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)

    if which == "qkv":
        k = 256
        return (lambda qc: QKVParallelLinear(k, HEAD, HEADS, KV_HEADS, bias=False, quant_config=qc,
                                             prefix="layers.3.self_attn.qkv_proj"),
                [("q_proj", "q", HEADS * HEAD), ("k_proj", "k", KV_HEADS * HEAD), ("v_proj", "v", KV_HEADS * HEAD)], k)
    if which == "gate_up":
        k = 256
        return (lambda qc: MergedColumnParallelLinear(k, [256, 256], bias=False, quant_config=qc,
                                                      prefix="layers.0.mlp.gate_up_proj"),
                [("gate_proj", 0, 256), ("up_proj", 1, 256)], k)
    if which == "qkvz":  # GDN: in_proj_qkv covers three fused partitions at once (a tuple shard id)
        k = 128
        return (lambda qc: MergedColumnParallelLinear(k, [128, 128, 256, 256], bias=False, quant_config=qc,
                                                      prefix="layers.0.linear_attn.in_proj_qkvz"),
                [("in_proj_qkv", (0, 1, 2), 512), ("in_proj_z", 3, 256)], k)
    if which == "down":
        k = 512
        return (lambda qc: RowParallelLinear(k, 128, bias=False, input_is_parallel=True, quant_config=qc,
                                             prefix="layers.0.mlp.down_proj"),
                [("down_proj", None, 128)], k)
    raise ValueError(which)


def make_tensors(kind: str, plan, k: int, g: int, seed: int = 0):
    """{checkpoint module: its tensors} for a plan."""
    conv, sym, offset = KINDS[kind]
    out = {}
    for i, (module, _, rows) in enumerate(plan):
        src = canonical(rows, k, g, sym, seed + 17 * i, zero_min=offset if not sym else 0)
        out[module] = write(kind, *src, g)
    return out


def load(layer, tensors, plan):
    """Every tensor through the parameter's own weight loader, as vLLM's model loader does."""
    params = dict(layer.named_parameters())
    for module, shard, _ in plan:
        for name, t in tensors[module].items():
            p = params[name]
            p.weight_loader(p, t) if shard is None else p.weight_loader(p, t, shard)


def build(kind, which, g, tensors=None, seed=0, **kw):
    factory, plan, k = layer_plan(which)
    tensors = tensors if tensors is not None else make_tensors(kind, plan, k, g, seed)
    layer = factory(_config(kind, g, **kw))
    load(layer, tensors, plan)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, tensors, plan


def reference(kind, tensors, plan, g):
    return torch.cat([decode_checkpoint(kind, tensors[m], g) for m, _, _ in plan])


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("which", ["qkv", "gate_up", "qkvz", "down"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_convention_loads_prepacks_frees_and_computes(engine_context, kind, which, g):
    from qpn.fork_patches.route_census.census import CENSUS
    from qpn.fork_patches.quant.linear_method import QPNLinearMethod

    layer, tensors, plan = build(kind, which, g)
    method = layer.quant_method
    assert isinstance(method, QPNLinearMethod) and method.fmt == "int4"
    assert not list(layer.parameters()), "the checkpoint tensors must be freed after the proven prepack"
    entry = CENSUS.modules[method.census_name]
    assert entry["region"] == "int4" and entry["prepack_verified"]
    assert method.weight_source() == "checkpoint_codes"
    w = reference(kind, tensors, plan, g)
    assert w.shape == (method.n, method.k)
    # identity activations read every weight back: each must be fp16((code - zero) * scale) exactly
    eye = torch.eye(method.k)
    got = method.apply(layer, eye)
    assert torch.equal(got, w.to(torch.float16).float().t()), "a weight differs from the checkpoint's"
    gen = torch.Generator().manual_seed(1)
    for m in (1, 9, 40):
        x = torch.randn(m, method.k, generator=gen)
        y = method.apply(layer, x)
        ref = x @ w.t()
        torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["awq", "gptq-v2", "ct-asym"])
def test_every_code_and_zero_point_is_exercised(kind):
    """The canonical sources the layers are built from hold all 16 codes and all 16 zero points."""
    _, plan, k = layer_plan("gate_up")
    conv, sym, offset = KINDS[kind]
    codes, s, z = canonical(plan[0][2], k, 32, sym, 0, zero_min=offset)
    assert set(int4_codec.unpack_codes(codes).unique().tolist()) == set(range(16))
    assert set(z.unique().tolist()) == set(range(16))


def test_a_real_generated_checkpoint_module_computes(engine_context, tmp_path):
    """make_int4_checkpoint's own AWQ output for the tiny model's gate/up: through the method."""
    from safetensors.torch import load_file

    mi.make_int4_checkpoint(tmp_path / "awq", "awq", group_size=64)
    full = load_file(str(tmp_path / "awq" / "model.safetensors"))
    base = "model.language_model.layers.0.mlp."
    tensors = {m: {n: full[f"{base}{m}.{n}"] for n in ("qweight", "qzeros", "scales")}
               for m in ("gate_proj", "up_proj")}
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    h, inter = mi.tiny_hybrid.TinyHybridSpec().hidden_size, mi.tiny_hybrid.TinyHybridSpec().intermediate_size
    plan = [("gate_proj", 0, inter), ("up_proj", 1, inter)]
    layer = MergedColumnParallelLinear(h, [inter, inter], bias=False, quant_config=_config("awq", 64),
                                       prefix="layers.0.mlp.gate_up_proj")
    load(layer, tensors, plan)
    layer.quant_method.process_weights_after_loading(layer)
    w = reference("awq", tensors, plan, 64)
    assert torch.equal(layer.quant_method.apply(layer, torch.eye(h)), w.to(torch.float16).float().t())


@pytest.mark.parametrize("which", ["down", "gate_up"])
@pytest.mark.parametrize("kind", ["awq", "gptq-v1", "ct-asym", "ct-sym"])
def test_tp2_ranks_together_give_the_whole_layer(engine_context, tp_rank, kind, which):
    factory, plan, k = layer_plan(which)
    g = 128
    tensors = make_tensors(kind, plan, k, g, seed=5)
    w = reference(kind, tensors, plan, g)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    outs = []
    for rank in range(2):
        tp_rank(rank, 2)
        layer = factory(_config(kind, g))
        load(layer, tensors, plan)
        layer.quant_method.process_weights_after_loading(layer)
        m = layer.quant_method
        if which == "down":
            assert (m.n, m.k) == (128, k // 2)
            outs.append(m.apply(layer, x[:, rank * m.k:(rank + 1) * m.k]).double())
        else:
            outs.append(m.apply(layer, x).double())
    if which == "down":
        y = outs[0] + outs[1]   # the all-reduce of the ranks
        ref = x.double() @ w.double().t()
    else:  # each rank holds half of gate and half of up
        halves = [o.split(128, dim=1) for o in outs]
        y = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim=1)
        ref = x.double() @ w.double().t()
    torch.testing.assert_close(y, ref, rtol=4e-3, atol=4e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["awq", "gptq-v2", "ct-asym"])
def test_row_parallel_split_inside_a_group_is_refused(engine_context, tp_rank, kind):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from qpn.fork_patches.quant.linear_method import QPNCheckpointError

    tp_rank(0, 2)
    with pytest.raises(QPNCheckpointError) as e:
        RowParallelLinear(128, 64, bias=False, quant_config=_config(kind, 128), prefix="layers.1.mlp.down_proj")
    msg = str(e.value)
    assert "layers.1.mlp.down_proj" in msg and "breaks the INT4 W4A16 groups of 128" in msg and "fix:" in msg
    assert "TP in [1]" in msg


def _fail(kind, which, g, mutate, needle, **kw):
    from qpn.fork_patches.quant.linear_method import QPNCheckpointError

    _, plan, k = layer_plan(which)
    tensors = make_tensors(kind, plan, k, g)
    mutate(tensors)
    with pytest.raises(QPNCheckpointError) as e:
        build(kind, which, g, tensors=tensors, **kw)
    msg = str(e.value)
    assert needle in msg, msg
    return msg


def _set(module, name, fn):
    def mutate(t):
        t[module][name] = fn(t[module][name])
    return mutate


@pytest.mark.parametrize("kind, which, mutate, needle", [
    ("awq", "gate_up", lambda t: t["up_proj"].pop("qzeros"), "missing tensor: the checkpoint has no qzeros"),
    ("ct-asym", "qkv", lambda t: t["k_proj"].pop("weight_scale"), "no weight_scale for output shard 1"),
    ("gptq-v2", "down", _set("down_proj", "qweight", lambda w: w.to(torch.int64)), "stored as torch.int64"),
    ("awq", "down", _set("down_proj", "scales", lambda s: s[: s.shape[0] // 2]), "has shape"),
    ("ct-asym", "gate_up",
     _set("gate_proj", "weight_scale", lambda s: s.clone().index_fill_(1, torch.tensor([1]), float("nan"))),
     "not finite"),
    ("ct-asym", "gate_up", _set("gate_proj", "weight_scale", lambda s: s.float() + 1e-5), "float16 cannot represent"),
    ("ct-sym", "gate_up", _set("up_proj", "weight_shape", lambda s: torch.tensor([256, 128])), "says the module is"),
    ("gptq-v2", "gate_up", _set("up_proj", "g_idx", lambda gi: (torch.arange(gi.numel()) % 8).to(torch.int32)),
     "activation-ordered"),
])
def test_broken_module_fails_naming_it(engine_context, kind, which, mutate, needle):
    g = 32
    msg = _fail(kind, which, g, mutate, needle)
    prefix = {"gate_up": "layers.0.mlp.gate_up_proj", "qkv": "layers.3.self_attn.qkv_proj",
              "down": "layers.0.mlp.down_proj"}[which]
    assert prefix in msg, msg


def test_gptq_v1_zero_16_is_refused(engine_context):
    """A v1 nibble 15 (zero 16, AutoGPTQ's wrap of 0) is ambiguous: refused naming the module."""
    def mutate(t):
        t["down_proj"]["qzeros"] = torch.full_like(t["down_proj"]["qzeros"], -1)  # every nibble 15
    _fail("gptq-v1", "down", 32, mutate, "layers.0.mlp.down_proj")


def test_whole_groups_out_of_order_move_scale_columns_per_shard(engine_context):
    """A g_idx that only permutes whole groups is exact (scale / zero columns move); each fused
    shard keeps its own map."""
    _, plan, k = layer_plan("gate_up")
    g = 32
    tensors = make_tensors("gptq-v2", plan, k, g, seed=3)
    groups = k // g
    perm = torch.tensor([3, 0, 7, 1, 2, 6, 4, 5])[:groups]
    tensors["up_proj"]["g_idx"] = perm.repeat_interleave(g).to(torch.int32)
    layer, _, _ = build("gptq-v2", "gate_up", g, tensors=tensors)
    w = reference("gptq-v2", tensors, plan, g)
    assert torch.equal(layer.quant_method.apply(layer, torch.eye(k)), w.to(torch.float16).float().t())


@pytest.mark.parametrize("bug, needle", [
    ("nibble-order", "does not give the loaded tensor back"),
    ("zero-swap", "does not give the loaded tensor back"),
])
def test_an_unpacker_bug_is_caught_before_serving(engine_context, monkeypatch, bug, needle):
    """The loaded words are re-derived from the unpacked source, so an unpacker that misreads
    the convention (AWQ's nibble order taken as the standard one; zero points read from the wrong
    shard of a word) refuses the module instead of serving wrong weights."""
    if bug == "nibble-order":
        monkeypatch.setattr(int4_checkpoint, "AWQ_ORDER", tuple(range(8)))
        kind = "awq"
    else:
        real = int4_checkpoint.from_pack_quantized

        def swapped(*a, **kw):
            codes, s, z = real(*a, **kw)
            return codes, s, z.flip(0).contiguous()
        monkeypatch.setattr(int4_checkpoint, "from_pack_quantized", swapped)
        kind = "ct-asym"
    _fail(kind, "gate_up", 32, lambda t: None, needle)


def test_one_method_for_every_member_and_its_constructor(engine_context):
    from qpn.fork_patches.quant.linear_method import QPNCheckpointError, QPNLinearMethod, qpn_linear_method
    from qpn.kernels import formats

    m = qpn_linear_method("x.down_proj", cv.int_scheme(4, False, 64, zero_offset=1), TARGET, cv.GPTQ)
    assert type(m) is QPNLinearMethod
    assert m.format is formats.INT4 and m.scheme.zero_offset == 1 and m.convention is cv.GPTQ
    assert qpn_linear_method("x", cv.int_scheme(4, True, 32), TARGET, cv.COMPRESSED_TENSORS).format is formats.INT4_SYM
    assert [s.name for s in m.stored.values()] == ["qweight", "scales", "qzeros", "g_idx"]
    assert m.required() == ("qweight", "scales", "qzeros")  # g_idx only where act order is declared
    with pytest.raises(QPNCheckpointError, match="x.o_proj.*group size 16"):
        qpn_linear_method("x.o_proj", cv.ModuleScheme("int4", symmetric=False, groups=16), TARGET, cv.AWQ)
    # the same class serves the other families, by their scheme
    assert type(qpn_linear_method("x", "NVFP4", TARGET)) is QPNLinearMethod
