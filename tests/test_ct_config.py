"""The compressed-tensors side of the registered QPN config (qpn.fork_patches.quant.ct_config) on vLLM
0.32's own CompressedTensorsConfig (no server): which QPN method each module of the tiny hybrid
gets, with which tensor names and FP8 scale layout; pack-quantized INT4 groups get the QPN4 method;
fused shards that disagree, and schemes QPN does not serve, fail naming the module and the config
group."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("compressed_tensors")

from qpn.fork_patches.quant import conventions as cv  # noqa: E402
from qpn.fork_patches.quant.ct_config import qpn_method_for  # noqa: E402
from qpn.fork_patches.quant.linear_method import (  # noqa: E402
    QPNCheckpointError, QPNLinearMethod)
from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config  # noqa: E402

TARGET = {"backend": "reference", "arch": "sm70", "atom": "m8n8k4"}
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
         "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}


class ColumnParallelLinearStub(torch.nn.Module):
    """Stands for a vLLM linear layer: the matcher reads only its class name."""


def _config(qcfg=None):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    cfg = CompressedTensorsConfig.from_config(copy.deepcopy(qcfg or quantization_config()))
    cfg.packed_modules_mapping = dict(FUSED)
    return cfg


@pytest.mark.parametrize("prefix, family, fp8_scale, names", [
    ("model.layers.0.mlp.gate_up_proj", "nvfp4", None, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]),
    ("model.layers.3.mlp.down_proj", "nvfp4", None, ["model.layers.3.mlp.down_proj"]),
    ("lm_head", "nvfp4", None, ["lm_head"]),
    ("model.layers.3.self_attn.qkv_proj", "fp8", "tensor", None),
    ("model.layers.3.self_attn.o_proj", "fp8", "tensor", None),
    ("model.layers.0.linear_attn.in_proj_qkvz", "fp8", "channel", None),
    ("model.layers.0.linear_attn.out_proj", "fp8", "channel", None),
])
def test_every_quantized_module_gets_its_qpn_method(prefix, family, fp8_scale, names):
    m = qpn_method_for(_config(), ColumnParallelLinearStub(), prefix, TARGET)
    assert type(m) is QPNLinearMethod and m.convention is cv.COMPRESSED_TENSORS and m.fmt == family
    if family == "fp8":
        assert m.scheme.fp8_scale == fp8_scale
        assert m.required() == ("weight", "weight_scale")
        assert m.stored["weight_scale"].symbols == (("N", "1") if fp8_scale == "channel" else ("P",))
    else:
        assert m.required() == ("weight_packed", "weight_scale", "weight_global_scale")
    if names is not None:
        assert m.declared == names


@pytest.mark.parametrize("prefix", ["model.layers.0.linear_attn.in_proj_ba", "mtp.layers.0.mlp.gate_up_proj",
                                    "mtp.layers.0.self_attn.qkv_proj", "mtp.fc"])
def test_unquantized_modules_stay_with_vllm(prefix):
    assert qpn_method_for(_config(), ColumnParallelLinearStub(), prefix, TARGET) is None


def test_ct_global_scale_is_inverted_per_shard_by_the_method():
    m = qpn_method_for(_config(), ColumnParallelLinearStub(), "model.layers.0.mlp.gate_up_proj", TARGET)
    stored = torch.tensor([2688.0 / 3.0, 2688.0 / 5.0])
    assert torch.allclose(m.convention.global_scale_f32(stored), torch.tensor([3.0, 5.0]) / 2688.0, rtol=1e-7)


def test_fused_shards_with_different_schemes_fail_naming_them():
    q = quantization_config()
    # k_proj moves to the NVFP4 group: q and v stay FP8
    q["config_groups"]["group_0"]["targets"].append(r"re:.*self_attn\.k_proj$")
    q["config_groups"]["group_1"]["targets"] = [r"re:.*self_attn\.(q|v|o)_proj$"]
    with pytest.raises(QPNCheckpointError, match=r"qkv_proj: the shards .* declare different schemes.*k_proj: nvfp4"):
        qpn_method_for(_config(q), ColumnParallelLinearStub(), "model.layers.3.self_attn.qkv_proj", TARGET)


@pytest.mark.parametrize("weights, fmt, match", [
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": True}, "pack-quantized",
     "group_size 16"),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True},
     "float-quantized", "per-tensor or per-channel"),
])
def test_a_scheme_qpn_does_not_serve_fails_naming_module_and_group(weights, fmt, match):
    q = quantization_config()
    q["config_groups"]["group_2"].update(weights=weights, format=fmt, input_activations=None)
    with pytest.raises(QPNCheckpointError, match=rf"model.layers.0.linear_attn.out_proj: .*group_2|{match}") as e:
        qpn_method_for(_config(q), ColumnParallelLinearStub(), "model.layers.0.linear_attn.out_proj", TARGET)
    assert match in str(e.value) and "model.layers.0.linear_attn.out_proj" in str(e.value)


@pytest.mark.parametrize("symmetric, act_order", [(True, None), (False, "static")])
def test_a_pack_quantized_int4_group_gets_the_qpn4_method(symmetric, act_order):
    """QPNConfig claims such a config only where the INT4 family serves (qpn_config.family_served);
    asked, every module of the group gets QPN4 with the group's scheme, fused shards together."""
    from qpn.kernels import formats

    q = quantization_config()
    q["config_groups"]["group_0"].update(
        weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": symmetric,
                 "actorder": act_order}, format="pack-quantized", input_activations=None)
    m = qpn_method_for(_config(q), ColumnParallelLinearStub(), "model.layers.0.mlp.gate_up_proj", TARGET)
    assert type(m) is QPNLinearMethod and m.convention is cv.COMPRESSED_TENSORS
    assert m.format is (formats.INT4_SYM if symmetric else formats.INT4)
    assert (m.scheme.group_size, m.scheme.act_order) == (64, act_order == "group")
    assert m.declared == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert qpn_method_for(_config(q), ColumnParallelLinearStub(), "model.layers.3.self_attn.o_proj",
                          TARGET).fmt == "fp8"  # the other groups keep theirs


def test_output_activation_quantization_is_refused():
    q = quantization_config()
    q["config_groups"]["group_1"]["output_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                           "symmetric": True, "dynamic": False}
    with pytest.raises(QPNCheckpointError, match="output activations"):
        qpn_method_for(_config(q), ColumnParallelLinearStub(), "model.layers.3.self_attn.o_proj", TARGET)


def test_the_launcher_reads_the_regions_a_ct_checkpoint_declares():
    """The qpn_routes gate checks every declared region has modules on QPN: for a compressed-tensors
    checkpoint the regions come from its config groups (there is no quantized_layers map)."""
    from qpn.scripts.launcher import boot_gates

    q = quantization_config()
    assert boot_gates.declared_regions(q) == {"nvfp4", "fp8"}
    del q["config_groups"]["group_0"]
    assert boot_gates.declared_regions(q) == {"fp8"}
    assert boot_gates.declared_layers(q) == {}  # no quantized_layers map: coverage pairs by name (declared_modules)
