"""The compressed-tensors checkpoint generator (qpn.scripts.checkpoints.make_ct_checkpoint) against
compressed-tensors' own quantizer and compressors: every code and scale byte-identical, on a
whole-format weight and on every quantized module of the written checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is installed with the cpu engine "
                    "(run under .venv-cpu/bin/python, or pip install compressed-tensors)")

from _ct_library import ct_fp8, ct_nvfp4, whole_format_weight  # noqa: E402

from qpn.fork_patches.quant import conventions as cv  # noqa: E402
from qpn.scripts.checkpoints import make_checkpoint, make_ct_checkpoint as mct, tiny_hybrid  # noqa: E402


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(view(a), view(b))


@pytest.mark.fast
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_format_encoding_is_the_librarys(seed):
    w = whole_format_weight(seed=seed)
    ours, lib = mct.encode_nvfp4(w), ct_nvfp4(w)
    assert set(ours) == set(lib)
    for k in lib:
        assert _same(ours[k], lib[k]), k
    codes = torch.stack([ours["weight_packed"] & 0xF, ours["weight_packed"] >> 4], -1)
    assert set(codes.unique().tolist()) == set(range(16))  # every e2m1 code of both signs
    assert float(ours["weight_scale"][2, 0].float()) == mct.E4M3_EPS  # the all-zero group
    # a shared (fused) global scale
    ours, lib = mct.encode_nvfp4(w, global_amax=100.0), ct_nvfp4(w, global_amax=100.0)
    assert all(_same(ours[k], lib[k]) for k in lib)
    for layout in ("tensor", "channel"):
        ours, lib = mct.encode_fp8(w, layout), ct_fp8(w, layout)
        assert set(ours) == set(lib) and all(_same(ours[k], lib[k]) for k in lib), layout


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "ckpt"
    mct.make_ct_checkpoint(out, seed=0)
    return out


def test_every_quantized_module_is_byte_identical_to_the_library(ckpt):
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    weights = tiny_hybrid.float_weights(tiny_hybrid.TinyHybridSpec(), 0)
    quantized = tiny_hybrid.quantized_modules(weights)
    shared = make_checkpoint.shared_global_amax(weights)
    counts = {"nvfp4": 0, "fp8-tensor": 0, "fp8-channel": 0}
    for module, region in quantized.items():
        m = make_checkpoint.hub_name(module)
        if region == "nvfp4":
            lib = ct_nvfp4(weights[f"{module}.weight"], shared.get(module))
            counts["nvfp4"] += 1
        else:
            layout = mct.fp8_layout(module)
            lib = ct_fp8(weights[f"{module}.weight"], layout)
            counts[f"fp8-{layout}"] += 1
        for k, v in lib.items():
            assert _same(tensors[f"{m}.{k}"], v), f"{m}.{k}"
        assert f"{m}.weight_scale_2" not in tensors and (region == "fp8" or f"{m}.weight" not in tensors)
    n = tiny_hybrid.TinyHybridSpec()
    layers = n.layer_types()
    assert counts == {"nvfp4": 3 * n.num_hidden_layers + 1,
                      "fp8-tensor": 4 * layers.count("full_attention"),
                      "fp8-channel": 3 * layers.count("linear_attention")}
    # gate and up share one global scale per layer, as llm-compressor makes them
    g = tensors["model.language_model.layers.0.mlp.gate_proj.weight_global_scale"]
    assert torch.equal(g, tensors["model.language_model.layers.0.mlp.up_proj.weight_global_scale"])
    # KV scales on the attention module; no ModelOpt names anywhere
    assert "model.language_model.layers.3.self_attn.k_scale" in tensors
    assert not any(k.endswith(("weight_scale_2", "k_proj.k_scale")) for k in tensors)


MIXED_EXPERTS = {5: "channel", 6: "tensor"}  # --fp8-experts 5,6:tensor (tests/test_e2e_ct_moe.py serves it)


@pytest.fixture(scope="module", params=[{}, MIXED_EXPERTS], ids=["nvfp4-experts", "fp8-experts-5-6"])
def moe_ckpt(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("ct_moe") / "ckpt"
    mct.make_ct_checkpoint(out, seed=0, moe=True, fp8_experts=request.param)
    return out, request.param


def test_every_expert_is_byte_identical_to_the_library(moe_ckpt):
    """The MoE checkpoint (make_ct_checkpoint --moe, and with --fp8-experts 5,6:tensor): every
    routed expert's gate, up and down (NVFP4, or FP8 per channel / per tensor in the FP8 layers),
    the shared expert, attention and lm_head, byte for byte what the library makes from the same
    float32 weights; gate and up of each NVFP4 expert share one global scale, down has its own;
    the config declares each expert in the format and FP8 layout it is stored in."""
    from safetensors.torch import load_file

    from qpn.scripts.checkpoints import make_moe_checkpoint as mmc

    moe_ckpt, fp8_experts = moe_ckpt
    tensors = load_file(str(moe_ckpt / "model.safetensors"))
    spec = mmc.TinyMoeSpec()
    weights = mmc.float_weights(spec, 0)
    quantized = mmc.quantized_modules(weights, "nvfp4")
    quantized.update({m: "fp8" for m in quantized if mct.expert_layer(m) in fp8_experts})
    shared = mmc.shared_global_amax(weights, quantized)
    counts: dict[str, int] = {}
    for module, region in quantized.items():
        m = make_checkpoint.hub_name(module)
        if region == "nvfp4":
            lib = ct_nvfp4(weights[f"{module}.weight"], shared.get(module))
        else:
            lib = ct_fp8(weights[f"{module}.weight"], mct.fp8_layout(module, fp8_experts))
        if mct.expert_layer(module) in fp8_experts:
            layout = fp8_experts[mct.expert_layer(module)]
            assert lib["weight_scale"].numel() == (1 if layout == "tensor" else lib["weight"].shape[0])
            # static activations per tensor; FP8_DYNAMIC (per channel) has no input scale
            assert (f"{m}.input_scale" in tensors) == (layout == "tensor"), m
        kind = "routed" if ".experts." in module else "shared" if ".shared_expert." in module else region
        counts[kind] = counts.get(kind, 0) + 1
        for k, v in lib.items():
            assert _same(tensors[f"{m}.{k}"], v), f"{m}.{k}"
    layers = spec.num_hidden_layers
    assert counts == {"routed": 3 * spec.num_experts * layers, "shared": 3 * layers, "nvfp4": 1,
                      "fp8": 4 * spec.layer_types().count("full_attention")
                      + 3 * spec.layer_types().count("linear_attention")}
    e = "model.language_model.layers.4.mlp.experts.6"
    g, u, d = (tensors[f"{e}.{p}.weight_global_scale"] for p in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(g, u) and not torch.equal(g, d)
    # the router and the shared-expert gate stay BF16; no ModelOpt names
    assert tensors["model.language_model.layers.5.mlp.gate.weight"].dtype == torch.bfloat16
    assert not any(k.endswith(("weight_scale_2", "k_proj.k_scale")) for k in tensors)
    # the config declares exactly the modules that carry codes
    conv, qcfg = cv.detect(moe_ckpt)
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight", ".weight_packed"))})
    for m, scheme in conv.module_schemes(qcfg, modules).items():
        assert (scheme is not None) == (f"{m}.weight_packed" in tensors or tensors[f"{m}.weight"].dtype
                                        == torch.float8_e4m3fn), m
        layer = mct.expert_layer(m)
        if layer is not None:
            want = ("fp8", fp8_experts[layer]) if layer in fp8_experts else ("nvfp4", "tensor")
            assert (scheme.fmt, scheme.fp8_scale) == want, m


def test_declaration_and_convention_cover_every_tensor(ckpt):
    """Every quantized tensor the checkpoint holds is one the convention names for a module the
    config declares; every BF16 tensor belongs to an undeclared module."""
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    conv, qcfg = cv.detect(ckpt)
    assert conv is cv.COMPRESSED_TENSORS
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight", ".weight_packed"))})
    schemes = conv.module_schemes(qcfg, modules)
    for m, s in schemes.items():
        if s is None:
            assert tensors[f"{m}.weight"].dtype == torch.bfloat16, m
            continue
        names = conv.tensor_names(m, s.fmt)
        source = conv.inputs(tensors, m, s)
        if s.fmt == cv.NVFP4:
            assert source[2].dtype == torch.float32
            assert names["input_scale"] in tensors
        else:
            assert source[1].numel() == (1 if s.fp8_scale == "tensor" else source[0].shape[0])
            assert (names["input_scale"] in tensors) == (s.fp8_scale == "tensor")
