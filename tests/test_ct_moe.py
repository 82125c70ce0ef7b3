"""compressed-tensors MoE experts through the QPN MoE method, in process on vLLM 0.32 (no server):
a real routed-experts layer built by the engine's own factory under the registered QPN config
(qpn_config.QPNConfig over the engine's own CompressedTensorsConfig) gets
QPNCompressedTensorsMoEMethod where the engine asks the config (``resolve_quant_method``); per-expert,
per-shard tensors
made by compressed-tensors' own compressors load through the engine's own expert
``weight_loader``; the layer computes the SwiGLU MoE of the weights the library decompresses
(float64), for NVFP4 (gate and up with different global scales: each inverted per shard), FP8 per
tensor and FP8 per channel. Mistakes that must fail: a permuted routing, the global scale read as
a multiplier, gate and up sharing the larger global scale; schemes the kernels do not serve and
experts whose projections disagree are refused naming the layer; INT4 experts, which QPN has no
MoE kernels for, are never handed a QPN method."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("compressed_tensors")

from _ct_library import ct_decompress_fp8, ct_decompress_nvfp4, ct_fp8, ct_nvfp4  # noqa: E402

from qpn.fork_patches.quant import moe_method  # noqa: E402
from qpn.fork_patches.quant.linear_method import QPNCheckpointError  # noqa: E402
from qpn.scripts.checkpoints import make_ct_checkpoint as mct  # noqa: E402
from tests.test_loader_methods import engine_context  # noqa: E402,F401  (single-process TP group)

pytestmark = [pytest.mark.usefixtures("engine_context"), pytest.mark.fast]

E, H, I, TOP_K, T = 4, 64, 32, 2, 7
PREFIX = "model.layers.0.mlp.experts"
EXPERTS_TARGET = r"re:^model\.(language_model\.)?layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$"


def _config(expert_group: dict | None):
    """The registered QPN config over the dense generator's config, plus (when given) one config
    group for the experts."""
    from qpn.fork_patches.quant import qpn_config

    q = copy.deepcopy(mct.quantization_config())
    if expert_group is not None:
        q["config_groups"]["experts"] = {"targets": [EXPERTS_TARGET], "output_activations": None, **expert_group}
    return qpn_config.config_class().from_config(q)


def _group(kind: str) -> dict:
    groups = mct.quantization_config()["config_groups"]
    src = {"nvfp4": "group_0", "fp8-tensor": "group_1", "fp8-channel": "group_2"}[kind]
    return {k: copy.deepcopy(v) for k, v in groups[src].items() if k != "targets"}


def _layer(config):
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    # one layer name per model in the engine's forward context: free it for the next test's layer
    get_current_vllm_config().compilation_config.static_forward_context.pop(PREFIX, None)
    runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             params_dtype=torch.bfloat16, quant_config=config, prefix=PREFIX)
    return runner.routed_experts


def _weights(gen):
    """float32 weights per (expert, shard); gate 4x up in magnitude (different global scales)."""
    out = {}
    for e in range(E):
        out[(e, "w1")] = torch.randn((I, H), generator=gen) * 0.4
        out[(e, "w3")] = torch.randn((I, H), generator=gen) * 0.1
        out[(e, "w2")] = torch.randn((H, I), generator=gen) * 0.1
    return out


def _encode(kind: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if kind == "nvfp4":
        return ct_nvfp4(w)
    return ct_fp8(w, kind.split("-")[1])


def _decode(kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "nvfp4":
        return ct_decompress_nvfp4(t)
    return ct_decompress_fp8(t, kind.split("-")[1])


def _load(layer, encoded: dict, static_input: float | None):
    for (e, shard), tensors in encoded.items():
        stem = "w2" if shard == "w2" else "w13"
        items = dict(tensors)
        if static_input is not None:  # what llm-compressor writes for static activations
            name = "input_global_scale" if "weight_packed" in items else "input_scale"
            items[name] = torch.tensor([static_input], dtype=torch.float32)
        for suffix, t in items.items():
            param = getattr(layer, f"{stem}_{suffix}")
            # the engine's own RoutedExperts.weight_loader, reached through the parameter
            ok = param.weight_loader(param, t, weight_name=f"{PREFIX}.{stem}_{suffix}", shard_id=shard,
                                     expert_id=e, return_success=True)
            assert ok, (e, shard, suffix)


def _moe64(x, ids, w, deq):
    ref = torch.zeros((x.shape[0], H), dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xi = x[t].double()
            h = torch.nn.functional.silu(deq[(e, "w1")] @ xi) * (deq[(e, "w3")] @ xi)
            ref[t] += float(w[t, j]) * (deq[(e, "w2")] @ h)
    return ref


@pytest.mark.parametrize("kind", ["nvfp4", "fp8-tensor", "fp8-channel"])
def test_ct_experts_load_through_the_engine_and_compute_the_librarys_weights(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("QPN_CENSUS_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(11)
    layer = _layer(_config(_group(kind)))
    method = layer.quant_method
    assert type(method) is moe_method.QPNCompressedTensorsMoEMethod
    assert (method.fmt, method.convention.name) == (kind.split("-")[0], "compressed-tensors")
    if kind != "nvfp4":
        assert method.fp8_scale == kind.split("-")[1]
    assert len(method.declared) == 3 * E and f"{PREFIX}.3.down_proj" in method.declared
    weights = _weights(gen)
    encoded = {key: _encode(kind, w) for key, w in weights.items()}
    _load(layer, encoded, None if kind == "fp8-channel" else 0.02)
    layer.quant_method.process_weights_after_loading(layer)
    assert not [n for n, _ in layer.named_parameters() if n.startswith(("w13_", "w2_"))], "sources freed"
    packed = method.packed
    if kind == "nvfp4":  # each shard's own global scale, inverted (float32 reciprocal)
        for e in range(E):
            g1, g3 = (encoded[(e, s)]["weight_global_scale"].float() for s in ("w1", "w3"))
            assert float(g1) != float(g3)
            assert float(packed.gate.chscale[e]) == float(1.0 / g1)
            assert float(packed.up.chscale[e]) == float(1.0 / g3)
    x = (torch.randn((T, H), generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn((T, TOP_K), generator=gen), dim=1)
    y = method.apply(layer, x, w, ids).double()
    ref = _moe64(x, ids, w, {k: _decode(kind, v).double() for k, v in encoded.items()})
    tol = 0.01 * float(ref.abs().max())
    err = float((y - ref).abs().max())
    assert err <= tol, (kind, err, tol)
    # the comparison can fail: experts 0 and 1 exchanged in the routing
    swapped = ids.clone()
    swapped[ids == 0], swapped[ids == 1] = 1, 0
    assert float((method.apply(layer, x, w, swapped).double() - ref).abs().max()) > 10 * tol
    if kind == "nvfp4":
        # what the two scale mistakes compute, against what the layer computed
        for wrong in ("multiplier", "shared-max"):
            deq = {}
            for (e, s), t in encoded.items():
                t = dict(t)
                if wrong == "multiplier":
                    t["weight_global_scale"] = 1.0 / t["weight_global_scale"].float()
                elif s != "w2":
                    t["weight_global_scale"] = torch.maximum(encoded[(e, "w1")]["weight_global_scale"],
                                                             encoded[(e, "w3")]["weight_global_scale"])
                deq[(e, s)] = _decode(kind, t).double()
            assert float((_moe64(x, ids, w, deq) - y).abs().max()) > 10 * tol, wrong
    from qpn.fork_patches.route_census.census import CENSUS

    route = "qpn2_moe" if kind == "nvfp4" else "qpn8_moe"
    for name in method.census_names:
        assert CENSUS.modules[name]["routes"][route]["eager"] >= 1 and CENSUS.modules[name]["prepack_verified"]


def test_unquantized_experts_stay_with_the_engine():
    layer = _layer(_config(None))
    assert not isinstance(layer.quant_method, moe_method.QPNModelOptMoEMethod)
    assert type(layer.quant_method).__name__ == "UnquantizedFusedMoEMethod"


def test_missing_expert_shard_fails_naming_layer_and_expert():
    gen = torch.Generator().manual_seed(12)
    layer = _layer(_config(_group("nvfp4")))
    encoded = {key: _encode("nvfp4", w) for key, w in _weights(gen).items()}
    del encoded[(2, "w3")]
    _load(layer, encoded, None)
    with pytest.raises(QPNCheckpointError, match=r"model\.layers\.0\.mlp\.experts .*missing tensor.*"
                                                 r"w13_weight_packed \(w3\) for expert 2"):
        layer.quant_method.process_weights_after_loading(layer)


def test_expert_schemes_the_kernels_do_not_serve_are_not_claimed_and_fail_naming_the_layer():
    """MXFP4 experts: QPN does not claim the config (the engine's own method serves it, and QPN
    says why); asked anyway, the experts' scheme fails naming the layer."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from qpn.fork_patches.quant import qpn_config

    group = _group("nvfp4")
    group["weights"].update({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32})
    group["format"] = "mxfp4-pack-quantized"
    q = copy.deepcopy(mct.quantization_config())
    q["config_groups"]["experts"] = {"targets": [EXPERTS_TARGET], "output_activations": None, **group}
    convention, why = qpn_config.claim_verdict(q)
    assert convention is None and "not NVFP4" in why
    layer = type("Experts", (torch.nn.Module,), {})()
    with pytest.raises(QPNCheckpointError, match=rf"{PREFIX}: .*not NVFP4"):
        moe_method.ct_declared_expert_scheme(CompressedTensorsConfig.from_config(q), layer, PREFIX)


def test_int4_experts_are_never_handed_a_qpn_moe_method():
    """QPN has no INT4 MoE kernels: INT4 experts are the engine's (and QPN does not claim a
    compressed-tensors config that mixes INT4 with NVFP4 / FP8 at all)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from qpn.fork_patches.quant import qpn_config

    group = _group("nvfp4")
    group["weights"] = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    group["format"], group["input_activations"] = "pack-quantized", None
    q = copy.deepcopy(mct.quantization_config())
    q["config_groups"]["experts"] = {"targets": [EXPERTS_TARGET], "output_activations": None, **group}
    engine_cfg = CompressedTensorsConfig.from_config(q)
    layer = type("Experts", (torch.nn.Module,), {})()
    assert moe_method.ct_declared_expert_scheme(engine_cfg, layer, PREFIX) is None
    assert qpn_config.claim(q) is None


def test_experts_with_quantized_output_activations_fail_naming_the_layer():
    group = _group("nvfp4")
    group["output_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                   "dynamic": False}
    with pytest.raises(QPNCheckpointError, match=rf"{PREFIX}: .*quantizes output activations"):
        _layer(_config(group))


def test_expert_projections_that_disagree_fail():
    from qpn.fork_patches.quant import qpn_config

    q = copy.deepcopy(mct.quantization_config())
    q["config_groups"]["experts_gate_up"] = {"targets": [EXPERTS_TARGET.replace("(gate|up|down)", "(gate|up)")],
                                             **_group("nvfp4")}
    q["config_groups"]["experts_down"] = {"targets": [EXPERTS_TARGET.replace("(gate|up|down)", "down")],
                                          **_group("fp8-tensor")}
    with pytest.raises(QPNCheckpointError, match="gate, up and down declare different schemes"):
        _layer(qpn_config.config_class().from_config(q))
