"""Checkpoint conventions (qpn.fork_patches.quant.conventions) checked against the code that defines
them: compressed-tensors' own compressors, quantizer and ModelOpt converter, and vLLM 0.32's
compressed-tensors scheme classes and config matcher."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from qpn.fork_patches.quant import conventions as cv
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.fp8 import codec as fp8_codec

pytestmark = pytest.mark.fast

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is installed with the cpu engine "
                         "(run under .venv-cpu/bin/python, or pip install compressed-tensors)")

from _ct_library import ct_decompress_fp8, ct_decompress_nvfp4, ct_fp8, ct_nvfp4, whole_format_weight  # noqa: E402


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_tensor_names_are_the_libraries_names():
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8, NVFP4

    assert NVFP4PackedCompressor.compression_param_names(QuantizationScheme(targets=["Linear"], **NVFP4)) \
        == cv.COMPRESSED_TENSORS.param_names(cv.NVFP4)
    fp8 = cv.COMPRESSED_TENSORS.param_names(cv.FP8)
    assert FloatQuantizationCompressor.compression_param_names(QuantizationScheme(targets=["Linear"], **FP8)) \
        == fp8[:2]
    assert cv.MODELOPT.param_names(cv.NVFP4) == ("weight", "weight_scale", "weight_scale_2", "input_scale")
    assert cv.COMPRESSED_TENSORS.tensor_names("m.x", cv.NVFP4)["global_scale"] == "m.x.weight_global_scale"


def test_int4_tensor_names_are_the_librarys_names():
    """compressed-tensors' pack-quantized compressor writes exactly the INT4 names the convention
    gives its roles (weight_zero_point when asymmetric, weight_g_idx under actorder group), and the
    ModelOpt convention has no INT4 layout (tests/test_int4_conventions.py proves the rest)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def names(**w):
        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=128, **w)
        return set(PackedQuantizationCompressor.compression_param_names(QuantizationScheme(targets=["Linear"],
                                                                                          weights=args)))

    n = cv.COMPRESSED_TENSORS.names(cv.formats.INT4)
    assert names(symmetric=True) == {n.codes, n.group_scales, n.shape}
    assert names(symmetric=False) == {n.codes, n.group_scales, n.shape, n.zero_points}
    assert names(symmetric=False, actorder="group") == set(cv.COMPRESSED_TENSORS.param_names(cv.formats.INT4))
    assert cv.COMPRESSED_TENSORS.names(cv.formats.INT4) is n
    with pytest.raises(cv.ConventionError, match="modelopt convention stores no INT4"):
        cv.MODELOPT.names(cv.formats.INT4)


def _vllm_file(rel: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed on this interpreter (the cpu engine's venv has it)")
    return (Path(spec.origin).parent / rel).read_text()


def test_vllm_registers_the_same_names_and_inverts_the_global_scale():
    """vLLM 0.32's NVFP4 scheme registers exactly the convention's parameter names and serves
    1 / weight_global_scale (the reason the convention calls the stored value a divisor)."""
    src = _vllm_file("model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py")
    for name in cv.COMPRESSED_TENSORS.param_names(cv.NVFP4):
        assert f'register_parameter("{name}"' in src, name
    assert "1.0 / weight_global_scale" in src
    src8 = _vllm_file("model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a16_fp8.py")
    assert 'register_parameter("weight"' in src8 and 'register_parameter("weight_scale"' in src8
    assert 'register_parameter("input_scale"' in src8


def test_ct_nvfp4_inputs_decode_like_the_library():
    w = whole_format_weight()
    t = ct_nvfp4(w)
    codes, scales, global_scale = cv.COMPRESSED_TENSORS.inputs(t, "", "nvfp4")
    assert torch.equal(codes, t["weight_packed"]) and torch.equal(_u8(scales), _u8(t["weight_scale"]))
    assert global_scale.dtype == torch.float32 and global_scale.shape == ()
    ours = nvfp4_codec.dequantize_f64(codes, scales, global_scale)
    lib = ct_decompress_nvfp4(t).double()
    # multiply by float32(1/g) vs divide by g: at most a float32 rounding or two per value
    assert torch.allclose(ours, lib, rtol=3e-7, atol=0)
    # the same bytes read with the other convention's scale rule are wrong by a factor g^2
    wrong = nvfp4_codec.dequantize_f64(codes, scales, t["weight_global_scale"].reshape(()))
    nz = lib.abs() > 0
    ratio = (wrong[nz] / lib[nz]).median()
    assert float(ratio) == pytest.approx(float(t["weight_global_scale"]) ** 2, rel=1e-5)


def test_modelopt_and_ct_describe_the_same_bytes():
    """compressed-tensors' own ModelOpt converter (1 / weight_scale_2 -> weight_global_scale,
    weight -> weight_packed) turns a ModelOpt module into a CT one; both conventions then hand
    QPN the same codes, scales and (to a float32 rounding) global scale."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    w = whole_format_weight(seed=3)
    q, s, s2 = nvfp4_codec.quantize(w)
    mo = {"m.weight": q, "m.weight_scale": s, "m.weight_scale_2": s2.reshape(()), "m.input_scale": torch.tensor(0.01)}
    ctt = ModelOptNvfp4Converter(targets=["m"]).process(dict(mo))
    assert set(ctt) == {"m.weight_packed", "m.weight_scale", "m.weight_global_scale", "m.input_global_scale"}
    a = cv.MODELOPT.inputs(mo, "m", "nvfp4")
    b = cv.COMPRESSED_TENSORS.inputs(ctt, "m", "nvfp4")
    assert torch.equal(a[0], b[0]) and torch.equal(_u8(a[1]), _u8(b[1]))
    assert float(a[2]) == pytest.approx(float(b[2]), rel=2 ** -23)


@pytest.mark.parametrize("layout", ["tensor", "channel"])
def test_ct_fp8_inputs_decode_like_the_library(layout):
    w = whole_format_weight(seed=5)
    t = ct_fp8(w, layout)
    codes, scale = cv.COMPRESSED_TENSORS.inputs(t, "", cv.ModuleScheme("fp8", layout))
    assert scale.shape == ((1,) if layout == "tensor" else (w.shape[0],))
    ours = fp8_codec.dequantize_f64(codes, scale if layout == "channel" else scale.reshape(()))
    assert torch.allclose(ours, ct_decompress_fp8(t, layout).double(), rtol=1e-6, atol=0)


def test_modelopt_rejects_a_per_channel_fp8_scale():
    codes = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    with pytest.raises(cv.ConventionError, match="scales per channel are not a modelopt layout"):
        cv.MODELOPT.inputs({"weight": codes, "weight_scale": torch.ones(4, 1)}, "m", cv.ModuleScheme("fp8", "channel"))
    with pytest.raises(cv.ConventionError, match="weight_scale must hold one value, has 4"):
        cv.MODELOPT.inputs({"weight": codes, "weight_scale": torch.ones(4, 1)}, "m", "fp8")


@pytest.mark.parametrize("bad, match", [
    ({"weight_global_scale": torch.tensor([0.0])}, "positive finite"),
    ({"weight_global_scale": torch.tensor([float("nan")])}, "positive finite"),
    ({"weight_scale": torch.zeros(16, 2, dtype=torch.float8_e4m3fn)}, r"stores \[N, K/16\]"),
    ({"weight_packed": None}, "needs tensor 'weight_packed'"),
])
def test_nvfp4_inputs_name_the_problem(bad, match):
    t = ct_nvfp4(whole_format_weight())
    for k, v in bad.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    with pytest.raises(cv.ConventionError, match=match):
        cv.COMPRESSED_TENSORS.inputs(t, "model.layers.0.mlp.down_proj", "nvfp4")


def _tiny_modules():
    from qpn.scripts.checkpoints import make_checkpoint, tiny_hybrid

    weights = tiny_hybrid.float_weights(tiny_hybrid.TinyHybridSpec(), 0)
    quantized = tiny_hybrid.quantized_modules(weights)
    linear = sorted(k[: -len(".weight")] for k, v in weights.items() if k.endswith(".weight") and v.dim() == 2)
    hub = {make_checkpoint.hub_name(m): quantized.get(m) for m in linear}
    return hub


def test_ct_declaration_names_every_module_like_the_plan():
    from qpn.scripts.checkpoints.make_ct_checkpoint import fp8_layout, quantization_config

    hub = _tiny_modules()
    schemes = cv.COMPRESSED_TENSORS.module_schemes(quantization_config(), sorted(hub))
    for m, region in hub.items():
        got = schemes[m]
        if region is None:
            assert got is None, m  # embeddings, in_proj_b/a, the whole MTP head stay BF16
        else:
            assert got is not None and got.fmt == region, m
            if region == "fp8":
                assert got.fp8_scale == fp8_layout(m), m
    assert any(m.startswith("mtp.") for m in hub) and schemes["lm_head"].fmt == cv.NVFP4


def test_vllm_matches_the_ct_targets_on_its_own_module_names():
    """vLLM's own matcher (find_matched_target, with Qwen3.5's fused-module map) gives every
    vLLM module of the tiny model the group the convention reads from the checkpoint names."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import find_matched_target

    from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config

    cfg = CompressedTensorsConfig.from_config(quantization_config())
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
             "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}
    expect = {
        "model.layers.0.linear_attn.in_proj_qkvz": ("fp8", "channel"),
        "model.layers.0.linear_attn.out_proj": ("fp8", "channel"),
        "model.layers.0.linear_attn.in_proj_ba": None,
        "model.layers.3.self_attn.qkv_proj": ("fp8", "tensor"),
        "model.layers.3.self_attn.o_proj": ("fp8", "tensor"),
        "model.layers.3.mlp.gate_up_proj": ("nvfp4", None),
        "model.layers.3.mlp.down_proj": ("nvfp4", None),
        "lm_head": ("nvfp4", None),
        "mtp.layers.0.mlp.gate_up_proj": None,
        "mtp.layers.0.self_attn.qkv_proj": None,
    }
    for name, want in expect.items():
        target = find_matched_target(name, torch.nn.Module(), cfg.target_scheme_map.keys(), fused)
        if want is None:
            assert target is None, name
            continue
        got = cv.ct_scheme_of(cfg.target_scheme_map[target]["weights"], cfg.target_scheme_map[target]["format"], name)
        assert got.fmt == want[0] and (want[1] is None or got.fp8_scale == want[1]), (name, got)


@pytest.mark.parametrize("weights, fmt, match", [
    ({"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}, "pack-quantized",
     "num_bits 2; QPN's integer families are 4-bit and 8-bit"),
    ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}, "mxfp4-pack-quantized", "not NVFP4"),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}, "float-quantized",
     "per-tensor or per-channel"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "float-quantized",
     "expected nvfp4-pack-quantized"),
])
def test_ct_schemes_qpn_does_not_serve_are_named(weights, fmt, match):
    with pytest.raises(cv.ConventionError, match=match):
        cv.ct_scheme_of(weights, fmt, "config_groups['group_9'] target 're:.*'")


def test_kv_directives():
    from qpn.scripts.checkpoints import make_checkpoint
    from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config

    assert cv.COMPRESSED_TENSORS.kv_request(quantization_config()) == "fp8"
    hf = make_checkpoint.hf_quant_config({"model.layers.0.mlp.down_proj": "nvfp4"})
    assert cv.MODELOPT.kv_request(hf) == "fp8"
    assert cv.MODELOPT.module_schemes(hf, ["model.language_model.layers.0.mlp.down_proj", "lm_head"]) == {
        "model.language_model.layers.0.mlp.down_proj": cv.ModuleScheme(
            "nvfp4", source="quantized_layers['model.language_model.layers.0.mlp.down_proj']"),
        "lm_head": None}
    if importlib.util.find_spec("vllm") is not None:
        # vLLM 0.32 reads KV directives of ModelOpt configs only: a CT checkpoint resolves 'auto'
        from vllm.utils.torch_utils import get_kv_cache_quant_algo_string

        assert get_kv_cache_quant_algo_string(quantization_config()) is None
        assert get_kv_cache_quant_algo_string({**hf, "quant_method": "modelopt"}) == "fp8_e4m3"


def test_detect(tmp_path):
    import json

    from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config()}))
    assert cv.detect(tmp_path)[0] is cv.COMPRESSED_TENSORS
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(cv.ConventionError, match="hf_quant_config.json"):
        cv.detect(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "MIXED_PRECISION"}}))
    assert cv.detect(tmp_path)[0] is cv.MODELOPT
