"""The QPN MoE method in process, against the installed vLLM 0.32 (no server): parameters as vLLM's
ModelOpt expert loader expects them, every tensor checked as it arrives, a missing or broken expert
tensor fails naming the layer, expert and problem, the inverse-verified prepack frees the source
tensors, apply() is the reference over the packed stacks, the census has both expert stacks. Which
layers get the method (the registered QPN config hands it out) is tested in
tests/test_quant_config.py on real vLLM routed experts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from qpn.fork_patches.quant import moe_method  # noqa: E402
from qpn.fork_patches.quant.linear_method import QPNCheckpointError  # noqa: E402
from qpn.kernels import moe, moe_reference  # noqa: E402
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from tests._moe_cases import activations, routing  # noqa: E402
from tests.test_loader_methods import engine_context  # noqa: E402,F401  (single-process TP group)

pytestmark = [pytest.mark.usefixtures("engine_context"), pytest.mark.fast]

E, H, I = 4, 64, 32
SHARD_ROWS = {"w1": slice(0, I), "w3": slice(I, 2 * I)}


def _moe_config(act="silu", gated=True):
    return SimpleNamespace(is_act_and_mul=gated, activation=SimpleNamespace(value=act))


def _copy_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
    """What RoutedExperts.weight_loader does for ModelOpt tensors at TP=1, in miniature."""
    data = param.data
    if data.dim() == 3:
        dst = data[expert_id][SHARD_ROWS[shard_id]] if shard_id in SHARD_ROWS else data[expert_id]
        dst.copy_(loaded_weight)
    elif data.dim() == 2:
        data[expert_id][0 if shard_id == "w1" else 1] = loaded_weight.reshape(())
    else:
        data[expert_id] = loaded_weight.reshape(())
    return True if return_success else None


def _checkpoint(gen):
    """Per-expert, per-shard ModelOpt NVFP4 tensors (gate and up share the global scale)."""
    out = []
    for e in range(E):
        for shard, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            q, s, s2 = nvfp4_codec.quantize(torch.randn((n, k), generator=gen) * 0.1)
            stem = "w2" if shard == "w2" else "w13"
            out += [(f"{stem}_weight", q, shard, e), (f"{stem}_weight_scale", s, shard, e),
                    (f"{stem}_weight_scale_2", s2, shard, e),
                    (f"{stem}_input_scale", torch.tensor(0.01), shard, e)]
    return out


def _load(method, layer, tensors, skip=None):
    for name, t, shard, e in tensors:
        if skip and skip(name, shard, e):
            continue
        getattr(layer, name).weight_loader(getattr(layer, name), t, weight_name=f"experts.{e}.{name}",
                                           shard_id=shard, expert_id=e, return_success=True)


def _method_and_layer():
    method = moe_method.QPNModelOptMoEMethod(_moe_config(), prefix="model.layers.0.mlp.experts", algo="NVFP4",
                                             backend="reference")
    layer = torch.nn.Module()
    method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=_copy_loader)
    return method, layer


def test_parameters_match_vllms_modelopt_nvfp4_expert_layout():
    method, layer = _method_and_layer()
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"w13_weight": (E, 2 * I, H // 2), "w2_weight": (E, H, I // 2),
                      "w13_weight_scale": (E, 2 * I, H // 16), "w2_weight_scale": (E, H, I // 16),
                      "w13_weight_scale_2": (E, 2), "w2_weight_scale_2": (E,),
                      "w13_input_scale": (E, 2), "w2_input_scale": (E,)}
    assert method.uses_weight_scale_2_pattern() and "ModelOpt" in type(method).__name__


def test_load_prepack_apply_and_census(tmp_path, monkeypatch):
    monkeypatch.setenv("QPN_CENSUS_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    method, layer = _method_and_layer()
    tensors = _checkpoint(gen)
    _load(method, layer, tensors)
    method.process_weights_after_loading(layer)
    assert not list(layer.parameters()), "source tensors must be freed after the verified prepack"
    packed = method.packed
    assert packed.num_experts == E and (packed.hidden, packed.intermediate) == (H, I)
    by = {(n, s, e): t for n, t, s, e in tensors}
    # expert 2's gate in the stack is the checkpoint's w1 of expert 2, byte for byte

    back, _ = nvfp4_layout.unprepack(packed.gate.expert(2))
    assert torch.equal(back, by[("w13_weight", "w1", 2)])
    back_up, _ = nvfp4_layout.unprepack(packed.up.expert(2))
    assert torch.equal(back_up, by[("w13_weight", "w3", 2)])
    assert float(packed.up.chscale[2]) == float(by[("w13_weight_scale_2", "w3", 2)])
    x = activations(5, H, gen).to(torch.bfloat16)
    ids, w = routing("repeat_in_token", 5, 2, E, gen)
    y = method.apply(layer, x, w, ids)
    assert y.dtype == torch.bfloat16 and y.shape == (5, H)
    assert torch.equal(y, moe_reference.moe_reference(x, ids, w, packed).to(torch.bfloat16))
    from qpn.fork_patches.route_census.census import CENSUS

    for name in ("model.layers.0.mlp.experts.w13", "model.layers.0.mlp.experts.w2"):
        assert name in method.census_names or any(n.startswith(name) for n in method.census_names)
    for name in method.census_names:
        assert CENSUS.modules[name]["routes"]["qpn2_moe"]["eager"] >= 1
        assert CENSUS.modules[name]["prepack_verified"]


def test_missing_expert_tensor_fails_naming_layer_and_expert():
    gen = torch.Generator().manual_seed(2)
    method, layer = _method_and_layer()
    _load(method, layer, _checkpoint(gen), skip=lambda n, s, e: n == "w13_weight_scale" and s == "w3" and e == 3)
    with pytest.raises(QPNCheckpointError, match=r"model\.layers\.0\.mlp\.experts .*missing tensor.*w13_weight_scale "
                                                 r"\(w3\) for expert 3"):
        method.process_weights_after_loading(layer)


def test_expert_absent_entirely_fails():
    gen = torch.Generator().manual_seed(3)
    method, layer = _method_and_layer()
    _load(method, layer, _checkpoint(gen), skip=lambda n, s, e: e == 1)
    with pytest.raises(QPNCheckpointError, match="loaded for 3 of the 4 experts"):
        method.process_weights_after_loading(layer)


@pytest.mark.parametrize("bad,what", [(float("nan"), "NaN"), (float("inf"), "inf"), (-1.0, "negative")])
def test_broken_scale_fails_as_it_arrives(bad, what):
    gen = torch.Generator().manual_seed(4)
    method, layer = _method_and_layer()
    tensors = [(n, torch.tensor(bad) if (n == "w2_weight_scale_2" and e == 2) else t, s, e)
               for n, t, s, e in _checkpoint(gen)]
    with pytest.raises(QPNCheckpointError, match=f"w2_weight_scale_2 of expert 2.*{what}"):
        _load(method, layer, tensors)


def test_wrong_dtype_names_the_declared_algo():
    method, layer = _method_and_layer()
    with pytest.raises(QPNCheckpointError, match="stored as torch.bfloat16, expected torch.uint8.*NVFP4"):
        layer.w2_weight.weight_loader(layer.w2_weight, torch.zeros((H, I // 2), dtype=torch.bfloat16),
                                      weight_name="experts.0.w2_weight", shard_id="w2", expert_id=0)


def test_non_swiglu_experts_and_unknown_algo_are_refused():
    with pytest.raises(QPNCheckpointError, match="SwiGLU"):
        moe_method.QPNModelOptMoEMethod(_moe_config(act="gelu"), "p.experts", "NVFP4", "reference")
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    cfg = ModelOptMixedPrecisionConfig.from_config({
        "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP3"},
            "model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
            "model.layers.2.mlp.experts.0.gate_proj": {"quant_algo": "FP8"}}}})
    with pytest.raises(QPNCheckpointError, match="NVFP3"):
        moe_method.qpn_moe_method_for(cfg, _moe_config(), "model.layers.0.mlp.experts", "reference")
    m1 = moe_method.qpn_moe_method_for(cfg, _moe_config(), "model.layers.1.mlp.experts", "reference")
    m2 = moe_method.qpn_moe_method_for(cfg, _moe_config(), "model.layers.2.mlp.experts", "reference")
    assert (m1.fmt, m2.fmt) == ("nvfp4", "fp8")
    assert moe_method.qpn_moe_method_for(cfg, _moe_config(), "model.layers.3.mlp.experts", "reference") is None
