"""QPN2/QPN8 linear methods on real vLLM 0.32 layers (no server): the checkpoint's tensors go in
through vLLM's own parameter classes and weight loaders, come out prepacked with a proven
inverse and no float weight left behind, compute what an independent decoder says they should,
and every malformed checkpoint fails naming the module and the problem."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from qpn.scripts.checkpoints import tiny_hybrid  # noqa: E402
from qpn.scripts.checkpoints.checkpoint_reference import decode_fp8, decode_nvfp4  # noqa: E402
from qpn.scripts.checkpoints.make_checkpoint import MALFORMED, make_checkpoint  # noqa: E402

SPEC = tiny_hybrid.TinyHybridSpec()
HUB = "model.language_model."


@pytest.fixture(scope="module")
def engine_context(tmp_path_factory):
    """A single-process tensor-parallel group and a current vLLM config, as a worker has them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from qpn.fork_patches.engine import plugin

    with set_current_vllm_config(VllmConfig()):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('dist')}/init")
            initialize_model_parallel(1, 1)
        plugin.register()
        yield


_CKPTS: dict = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, mixed_checkpoint):
    _CKPTS.setdefault(None, mixed_checkpoint)  # the good one: the session's (tests/conftest.py)

    def get(malformed=None):
        if malformed not in _CKPTS:
            out = tmp_path_factory.mktemp("ckpt") / (malformed or "good")
            make_checkpoint(out, seed=0, malformed=malformed)
            _CKPTS[malformed] = out
        return _CKPTS[malformed]

    return get


def _tensors(ckpt):
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def _quant_config(ckpt):
    """The registered QPN config over the checkpoint's hf_quant_config.json, as the engine builds it."""
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM

    qc = get_quantization_config("qpn").from_config(json.loads((ckpt / "hf_quant_config.json").read_text()))
    qc.packed_modules_mapping = Qwen3_5ForCausalLM.packed_modules_mapping
    qc.apply_vllm_mapper(Qwen3_5ForCausalLM.hf_to_vllm_mapper)
    return qc


def _layer_plan(prefix: str, intermediate: int):
    """(vLLM layer factory, [(checkpoint module, shard id)]) for a vLLM module prefix."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    h = SPEC.hidden_size
    kd = SPEC.linear_num_key_heads * SPEC.linear_key_head_dim
    vd = SPEC.linear_num_value_heads * SPEC.linear_value_head_dim
    base = HUB + prefix[len("model."):].rsplit(".", 1)[0] if prefix.startswith("model.") else ""
    leaf = prefix.rsplit(".", 1)[-1]
    if leaf == "qkv_proj":
        return (lambda qc: QKVParallelLinear(h, SPEC.head_dim, 2 * SPEC.num_attention_heads,
                                             SPEC.num_key_value_heads, bias=False, quant_config=qc, prefix=prefix),
                [(f"{base}.q_proj", "q"), (f"{base}.k_proj", "k"), (f"{base}.v_proj", "v")])
    if leaf == "in_proj_qkvz":
        return (lambda qc: MergedColumnParallelLinear(h, [kd, kd, vd, vd], bias=False, quant_config=qc, prefix=prefix),
                [(f"{base}.in_proj_qkv", (0, 1, 2)), (f"{base}.in_proj_z", 3)])
    if leaf == "gate_up_proj":
        return (lambda qc: MergedColumnParallelLinear(h, [intermediate] * 2, bias=False, quant_config=qc, prefix=prefix),
                [(f"{base}.gate_proj", 0), (f"{base}.up_proj", 1)])
    if leaf in ("down_proj", "out_proj", "o_proj"):
        k_in = {"down_proj": intermediate, "out_proj": vd, "o_proj": SPEC.num_attention_heads * SPEC.head_dim}[leaf]
        return (lambda qc: RowParallelLinear(k_in, h, bias=False, input_is_parallel=True, quant_config=qc, prefix=prefix),
                [(f"{base}.{leaf}", None)])
    if prefix == "lm_head":
        return (lambda qc: ParallelLMHead(SPEC.vocab_size, h, quant_config=qc, prefix="lm_head"), [("lm_head", None)])
    raise ValueError(prefix)


def _load(layer, tensors, plan):
    """Feed the checkpoint tensors through the parameters' own weight loaders, as vLLM does."""
    params = dict(layer.named_parameters())
    for module, shard in plan:
        for pname in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            key = f"{module}.{pname}"
            if key not in tensors or pname not in params:
                continue
            p = params[pname]
            if shard is None:
                p.weight_loader(p, tensors[key])
            else:
                p.weight_loader(p, tensors[key], shard)


def _build_and_load(ckpt, prefix, tensors=None, intermediate=SPEC.intermediate_size):
    factory, plan = _layer_plan(prefix, intermediate)
    layer = factory(_quant_config(ckpt))
    _load(layer, _tensors(ckpt) if tensors is None else tensors, plan)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, plan


def _reference_weight(tensors, plan):
    rows = []
    for module, _ in plan:
        if f"{module}.weight_scale_2" in tensors:
            rows.append(decode_nvfp4(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"],
                                     tensors[f"{module}.weight_scale_2"]))
        else:
            rows.append(decode_fp8(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]))
    return torch.cat(rows)


PREFIXES = ["model.layers.3.self_attn.qkv_proj", "model.layers.3.self_attn.o_proj",
            "model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.out_proj",
            "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_module_loads_prepacks_frees_and_computes(engine_context, checkpoint, prefix):
    from qpn.fork_patches.route_census.census import CENSUS
    from qpn.fork_patches.quant.linear_method import QPNLinearMethod
    from qpn.kernels.routes import route_for

    ckpt = checkpoint()
    tensors = _tensors(ckpt)
    layer, plan = _build_and_load(ckpt, prefix)
    method = layer.quant_method
    assert isinstance(method, QPNLinearMethod)
    region = method.fmt
    assert region == ("nvfp4" if prefix == "lm_head" or ".mlp." in prefix else "fp8")
    # The source tensors are gone and no floating-point copy of the weight exists anywhere.
    assert not list(layer.parameters()) and not list(layer.buffers())
    for value in vars(layer).values():
        assert not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point())
    # The census admitted it with a proven prepack.
    entry = CENSUS.modules[method.census_name]
    assert entry["region"] == region and entry["prepack_verified"] and entry["eligible"]
    assert (entry["n"], entry["k"]) == (method.n, method.k)

    w_ref = _reference_weight(tensors, plan)
    assert w_ref.shape == (method.n, method.k)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 12, 40, 130):  # one M per route band
        x = torch.randn(m, method.k, generator=gen)
        before = dict(entry["routes"].get(str(route_for(region, m, method.n, method.k)), {"eager": 0}))
        y = method.apply(layer, x)
        assert y.dtype == x.dtype and y.shape == (m, method.n)
        ref = x @ w_ref.T
        torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))
        route = str(route_for(region, m, method.n, method.k))
        assert entry["routes"][route]["eager"] == before["eager"] + 1
    if prefix == "lm_head":
        assert CENSUS.lm_head["source"] == "checkpoint_codes" and CENSUS.lm_head["route_family"] == "qpn2"


def test_fused_fp8_shards_keep_their_own_scales_and_codes(engine_context, checkpoint):
    from qpn.kernels.families.fp8.layout import unprepack as unprepack_fp8

    ckpt = checkpoint()
    tensors = _tensors(ckpt)
    layer, plan = _build_and_load(ckpt, "model.layers.3.self_attn.qkv_proj")
    scales = [float(tensors[f"{m}.weight_scale"]) for m, _ in plan]
    assert len(set(scales)) == 3, "the generator must give q, k and v different scales"
    (_, _, packed), = layer.quant_method.pieces
    rows = [tensors[f"{m}.weight"].shape[0] for m, _ in plan]
    expected = torch.cat([torch.full((r,), s) for r, s in zip(rows, scales)])
    assert torch.equal(packed.scale, expected)  # each shard's scalar over its rows, unchanged
    codes, _ = unprepack_fp8(packed)
    source = torch.cat([tensors[f"{m}.weight"] for m, _ in plan])
    assert torch.equal(codes.view(torch.uint8), source.view(torch.uint8))  # codes untouched


def test_nvfp4_shards_with_different_global_scales_become_pieces(engine_context, checkpoint):
    """Re-express up_proj with a doubled global scale and halved group scales (the same values):
    the method must serve it as two pieces, not one with the wrong global scale."""
    ckpt = checkpoint()
    tensors = dict(_tensors(ckpt))
    up = f"{HUB}layers.0.mlp.up_proj"
    halved = (tensors[f"{up}.weight_scale"].float() / 2).to(torch.float8_e4m3fn)
    assert torch.equal(halved.float() * 2, tensors[f"{up}.weight_scale"].float()), "halving must be exact"
    tensors[f"{up}.weight_scale"] = halved
    tensors[f"{up}.weight_scale_2"] = tensors[f"{up}.weight_scale_2"] * 2
    layer, plan = _build_and_load(ckpt, "model.layers.0.mlp.gate_up_proj", tensors=tensors)
    assert len(layer.quant_method.pieces) == 2
    x = torch.randn(3, SPEC.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = x @ _reference_weight(_tensors(ckpt), plan).T
    torch.testing.assert_close(layer.quant_method.apply(layer, x), ref, rtol=2e-3,
                               atol=2e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_checkpoint_fails_naming_module_and_problem(engine_context, checkpoint, kind):
    from qpn.fork_patches.quant.linear_method import QPNCheckpointError

    bad = MALFORMED[kind]
    ckpt = checkpoint(kind)
    intermediate = 200 if kind == "k-not-multiple" else SPEC.intermediate_size
    with pytest.raises(QPNCheckpointError) as e:
        _build_and_load(ckpt, bad.module, intermediate=intermediate)
    msg = str(e.value)
    print(f"{kind}: {msg}")
    assert bad.module in msg, msg
    assert bad.problem.lower() in msg.lower(), msg


def test_apply_traces_under_torch_compile_and_still_routes_by_real_m(engine_context, checkpoint):
    """vLLM compiles the model unless --enforce-eager: the method must trace (fullgraph) and the
    route choice and census count must still see each call's real M."""
    from qpn.fork_patches.route_census.census import CENSUS

    ckpt = checkpoint()
    layer, plan = _build_and_load(ckpt, "model.layers.0.linear_attn.out_proj")
    method = layer.quant_method
    routes = CENSUS.modules[method.census_name]["routes"]
    compiled = torch.compile(lambda x: method.apply(layer, x), fullgraph=True, dynamic=True, backend="eager")
    w_ref = _reference_weight(_tensors(ckpt), plan)
    gen = torch.Generator().manual_seed(3)
    for m, route in ((3, "qpn8"), (20, "qpn8_chunked"), (5, "qpn8")):
        before = routes.get(route, {"eager": 0})["eager"]
        x = torch.randn(m, method.k, generator=gen).to(torch.bfloat16)
        y = compiled(x)
        torch.testing.assert_close(y.float(), (x.float() @ w_ref.T), rtol=2e-2, atol=2e-2)
        assert routes[route]["eager"] == before + 1, route
