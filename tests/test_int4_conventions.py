"""INT4 W4A16 checkpoint conventions (qpn.fork_patches.quant.conventions: AWQ, GPTQ, COMPRESSED_TENSORS),
proven against the engines' own loader code (vLLM 0.32 installed beside the cpu engine and both
1Cat-vLLM source archives, parsed by engine_source.verify_int4_conventions, and vLLM's config
parsers run on the same dicts); the INT4 checkpoint generator (make_int4_checkpoint) byte for byte
against vLLM's AutoAWQ and GPTQ packers and dequantization (and its exllama kernel's GPTQ v1 zero
points) and compressed-tensors' own compressor; and the
launcher's pre-boot refusal of a broken INT4 checkpoint (serve_preflight.check_checkpoint_tensors),
naming the module. No engine boots."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qpn.fork_patches.quant import conventions as cv
from qpn.fork_patches.engine import engine_source
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import checkpoint as int4_checkpoint

pytestmark = pytest.mark.fast

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from qpn.scripts.checkpoints import make_checkpoint, tiny_hybrid  # noqa: E402
from qpn.scripts.checkpoints import make_int4_checkpoint as mi  # noqa: E402
from qpn.scripts.launcher import serve_preflight  # noqa: E402

G = mi.DEFAULT_GROUP_SIZE


# ------------------------------------------------------------------------------- the engines
def _installed_source():
    vllm = pytest.importorskip("vllm", reason="vLLM is installed with the cpu engine (run under .venv-cpu)")
    return engine_source.open_source(Path(vllm.__file__).resolve().parent.parent)


def _source(where: str):
    if where == "installed":
        return _installed_source()
    from tests._ci import onecat_source

    return onecat_source(where)


@pytest.mark.parametrize("where", ["installed", "1.2.2", "1.3.0"])
def test_every_int4_convention_is_the_engines(where):
    """Each convention's tensor names, their dims / dtype / packed dim, its config keys and
    AutoAWQ's nibble order are what the engine's own create_weights / from_config / awq_pack
    hold: vLLM 0.32 (installed) and both 1Cat-vLLM archives."""
    src = _source(where)
    rows = engine_source.verify_int4_conventions(src)
    assert [r.hook for r in rows] == ["int4-awq-tensors", "int4-awq-config", "int4-awq-nibble-order",
                                      "int4-gptq-tensors", "int4-gptq-config",
                                      "int4-compressed-tensors-tensors", "int4-compressed-tensors-config"]
    assert [f"{r.hook}: {r.detail}" for r in rows if r.miss] == []
    by = {r.hook: r for r in rows}
    cpu = src.key.startswith("cpu@")
    # the AWQ method of each engine: vLLM 0.32 renamed it, 1Cat keeps the old one
    assert by["int4-awq-tensors"].anchor == ("AutoAWQMarlinLinearMethod" if cpu else "AWQLinearMethod")
    # act order: 1Cat loads g_idx / weight_g_idx, vLLM 0.32 loads neither (it refuses act order)
    for hook, name in (("int4-gptq-tensors", "'g_idx'"), ("int4-compressed-tensors-tensors", "'weight_g_idx'")):
        assert (f"no {name}" in by[hook].detail) == cpu, (hook, by[hook].detail)
    if cpu:
        text = src.text("model_executor/layers/quantization/utils/gptq_utils.py")
        assert "desc_act=True) is no longer" in text
        assert "activation ordering" in src.text("model_executor/layers/quantization/compressed_tensors/"
                                                 "compressed_tensors.py")


@pytest.mark.parametrize("mutate, hook, words", [
    # AutoAWQ's nibble order swapped for the standard one
    (lambda c: dataclasses.replace(c, layout=dataclasses.replace(c.layout, word_order=tuple(range(8)))),
     "int4-awq-nibble-order", "interleaves"),
    # qweight read as packed along K (the GPTQ layout)
    (lambda c: dataclasses.replace(c, layout=dataclasses.replace(c.layout, codes=("K/p", "N"))),
     "int4-awq-tensors", "has dims"),
    # a tensor name the engine does not register
    (lambda c: dataclasses.replace(c, names_by_family={cv.INTEGER: dataclasses.replace(c.names(cv.formats.INT4),
                                                                                    zero_points="qzero")}),
     "int4-awq-tensors", "registers no 'qzero'"),
    # a config key the engine does not read
    (lambda c: dataclasses.replace(c, config_keys=(("bits", ("bits",)),) + c.config_keys[1:]),
     "int4-awq-config", "reads no key list ['bits']"),
    # scales one per group along N instead of K
    (lambda c: dataclasses.replace(c, layout=dataclasses.replace(c.layout, group_scales=("N", "K/g"))),
     "int4-awq-tensors", "'scales' has dims"),
])
def test_the_engine_check_catches_a_wrong_convention(mutate, hook, words):
    src = _installed_source()
    rows = {r.hook: r for r in engine_source.verify_int4_conventions(src, [mutate(cv.AWQ)])}
    assert rows[hook].miss and words in rows[hook].detail, rows[hook].detail


def test_gptq_and_ct_mutations_are_caught_too():
    src = _installed_source()
    gptq = dataclasses.replace(cv.GPTQ, layout=dataclasses.replace(cv.GPTQ.layout, zero_points=("N/p", "K/g")))
    ct = dataclasses.replace(cv.COMPRESSED_TENSORS, config_keys=cv.COMPRESSED_TENSORS.config_keys + (("x", ("zp_bits",)),))
    rows = {r.hook: r for r in engine_source.verify_int4_conventions(src, [gptq, ct])}
    assert rows["int4-gptq-tensors"].miss and "'qzeros' has dims" in rows["int4-gptq-tensors"].detail
    assert rows["int4-compressed-tensors-config"].miss and "zp_bits" in rows["int4-compressed-tensors-config"].detail


# ------------------------------------------------------------------------------- config reading
def test_awq_config_reads_like_vllms():
    cfg = mi.quantization_config("awq", 64, False)
    s = cv.AWQ.scheme(cfg)
    assert (s.symmetric, s.group_size, s.zero_offset, s.format.key) == (False, 64, 0, "int4")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    theirs = AutoAWQConfig.from_config(cfg)
    assert (theirs.weight_bits, theirs.group_size, theirs.zero_point) == (4, s.group_size, not s.symmetric)
    assert theirs.modules_to_not_convert == mi.AWQ_NOT_CONVERTED
    # the older AutoAWQ keys read the same (w_bit, q_group_size: first key present wins, as vLLM)
    old = {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMM"}
    assert cv.AWQ.scheme(old).group_size == AutoAWQConfig.from_config(old).group_size == 128


@pytest.mark.parametrize("change, words", [
    ({"bits": 8}, "AutoAWQ's GEMM packing is 4-bit"),
    ({"group_size": -1}, "(per channel) is not a group size QPN packs for INT4"),
    ({"group_size": 256}, "is not a group size QPN packs for INT4"),
    ({"zero_point": False}, "zero_point = False"),
    ({"version": "gemv"}, "version 'gemv'"),
    ({"bits": None}, "none of w_bit, bits"),
])
def test_awq_configs_qpn_does_not_serve_are_named(change, words):
    cfg = {**mi.quantization_config("awq", 128, False), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(cv.ConventionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        cv.AWQ.scheme(cfg)


def _gptq_cfg(**over):
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
            "damp_percent": 0.01, "true_sequential": True, **over}


def test_gptq_config_reads_like_vllms():
    sym = cv.GPTQ.scheme(_gptq_cfg())
    assert (sym.symmetric, sym.zero_offset, sym.act_order) == (True, 0, False)
    v1 = cv.GPTQ.scheme(_gptq_cfg(sym=False))
    v2 = cv.GPTQ.scheme(_gptq_cfg(sym=False, checkpoint_format="gptq_v2"))
    assert (v1.zero_offset, v2.zero_offset) == (1, 0)   # GPTQ v1 stores zero - 1
    assert cv.GPTQ.scheme(_gptq_cfg(desc_act=True)).act_order
    # a negative dynamic rule only skips modules; a positive one changes the scheme: refused
    assert cv.GPTQ.scheme(_gptq_cfg(dynamic={r"-:.*\.mlp\..*": {}})).group_size == 128
    with pytest.raises(cv.ConventionError, match="dynamic rule"):
        cv.GPTQ.scheme(_gptq_cfg(dynamic={r"+:.*\.1[0-5]\..*": {"bits": 8}}))
    with pytest.raises(cv.ConventionError, match="checkpoint_format 'marlin'"):
        cv.GPTQ.scheme(_gptq_cfg(checkpoint_format="marlin"))
    with pytest.raises(cv.ConventionError, match="4-bit"):
        cv.GPTQ.scheme(_gptq_cfg(bits=3))
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    theirs = AutoGPTQConfig.from_config(_gptq_cfg())
    assert (theirs.weight_bits, theirs.group_size, theirs.is_sym, theirs.desc_act) == (4, 128, True, False)
    # vLLM 0.32 itself refuses act order and asymmetric GPTQ (QPN reads both, the latter by format)
    with pytest.raises(ValueError, match="desc_act"):
        AutoGPTQConfig.from_config(_gptq_cfg(desc_act=True))
    with pytest.raises(ValueError, match="sym=False"):
        AutoGPTQConfig.from_config(_gptq_cfg(sym=False))


@pytest.mark.parametrize("sym", [False, True])
def test_ct_int4_config_reads_like_vllms(sym):
    """The generator's compressed-tensors config: vLLM's own CompressedTensorsConfig parses it
    into the QuantizationArgs ct_scheme_of reads to the same scheme; the library's W4A16
    presets declare the same weights."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import W4A16, W4A16_ASYM

    cfg = mi.quantization_config("compressed-tensors", 64, sym)
    w = cfg["config_groups"]["group_0"]["weights"]
    preset = (W4A16 if sym else W4A16_ASYM)["weights"].model_dump()
    assert {k: QuantizationArgs.model_validate(w).model_dump()[k] for k in ("num_bits", "type", "strategy", "symmetric")} \
        == {k: preset[k] for k in ("num_bits", "type", "strategy", "symmetric")}
    ours = cv.ct_scheme_of(w, "pack-quantized", "group_0")
    assert (ours.symmetric, ours.group_size, ours.act_order) == (sym, 64, False)
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    entry = CompressedTensorsConfig.from_config(cfg).target_scheme_map["Linear"]
    assert cv.ct_scheme_of(entry["weights"], entry["format"], "Linear") == \
        dataclasses.replace(ours, source="Linear")


@pytest.mark.parametrize("change, words", [
    ({"num_bits": 2}, "num_bits 2"),
    ({"strategy": "channel", "group_size": None}, "strategy 'channel'"),  # INT4 stores no per-channel groups
    ({"group_size": 16}, "group_size 16"),
    ({"actorder": "dynamic"}, "actorder 'dynamic'"),
    ({"type": "float"}, "are not NVFP4"),  # the float reader's refusal, named
])
def test_ct_int4_schemes_qpn_does_not_serve_are_named(change, words):
    w = {**mi.quantization_config("compressed-tensors", 128, False)["config_groups"]["group_0"]["weights"], **change}
    with pytest.raises(cv.ConventionError, match=words):
        cv.ct_scheme_of(w, "pack-quantized", "config_groups['group_0'] target 'Linear'")


def test_one_reader_for_every_family():
    """One convention type and one reader per question: ct_scheme_of reads integer and float
    schemes alike, a width no family has is refused naming the widths there are, ``detect`` returns
    AWQ and GPTQ as it does ModelOpt and compressed-tensors, and compressed-tensors names every
    integer family's tensors alike."""
    w = mi.quantization_config("compressed-tensors", 128, True)["config_groups"]["group_0"]["weights"]
    assert cv.ct_scheme_of(w, "pack-quantized", "group_0").format is cv.formats.INT4_SYM
    with pytest.raises(cv.ConventionError, match="num_bits 2; QPN's integer families are 4-bit and 8-bit"):
        cv.ct_scheme_of({**w, "num_bits": 2}, "pack-quantized", "group_0")
    assert {"awq", "gptq", "modelopt", "compressed-tensors"} == set(cv.CONVENTIONS)
    assert all(type(c) is cv.Convention for c in cv.CONVENTIONS.values())
    assert cv.COMPRESSED_TENSORS.names(cv.formats.INT4) is cv.COMPRESSED_TENSORS.names(cv.formats.INT8)
    assert cv.COMPRESSED_TENSORS.param_names(cv.formats.INT4) == (
        "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


# ------------------------------------------------------------------------------ the tensors
def _canonical(n=48, k=256, g=G, sym=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return int4_codec.quantize(torch.randn(n, k, generator=gen) * 0.05, g, symmetric=sym)


def test_awq_inputs_are_the_canonical_source():
    src = _canonical()
    t = {f"m.{k}": v for k, v in mi.to_awq(*src).items()}
    got = cv.AWQ.inputs(t, "m", cv.AWQ.scheme(mi.quantization_config("awq", G, False)))
    assert all(torch.equal(a, b) for a, b in zip(got, src)) and len(got) == 3


def test_an_off_by_one_group_is_refused_naming_the_module():
    src = _canonical(g=32)
    t = mi.to_awq(*src)
    headers = {f"m.{k}": {"dtype": "I32" if v.dtype == torch.int32 else "F16", "shape": list(v.shape)}
               for k, v in t.items()}
    assert cv.AWQ.header_problems("m", headers, cv.int_scheme(4, False, 32)) == []
    problems = cv.AWQ.header_problems("m", headers, cv.int_scheme(4, False, 64))
    assert problems and all(p.startswith("m: tensor 'm.") for p in problems)
    assert any("'m.scales' (group_scales) has shape [8, 48]" in p and "[4, 48]" in p for p in problems)
    with pytest.raises(cv.ConventionError, match="^m: awq INT4 W4A16: AWQ scales must be"):
        cv.AWQ.inputs(t, "m", cv.int_scheme(4, False, 64))


def _gptq_tensors(src, stored_zero_offset: int):
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    codes, s, z = src
    q = int4_codec.unpack_codes(codes).t().to(torch.int32)          # [K, N]
    k, n = q.shape
    return {"qweight": qu.pack_rows(q, 4, k, n),                          # vLLM's GPTQ packer
            "qzeros": qu.pack_cols(z.t().to(torch.int32) - stored_zero_offset, 4, k // G, n),
            "scales": s.t().contiguous(), "g_idx": (torch.arange(k) // G).to(torch.int32)}


def test_gptq_v1_and_v2_zero_points():
    src = _canonical(n=40)
    src = (src[0], src[1], src[2].clamp(1, 14))  # v1 cannot store zero 0 (nor v2-read-as-v1 a 15)
    v1, v2 = (cv.GPTQ.scheme(_gptq_cfg(sym=False, group_size=G, **f))
              for f in ({}, {"checkpoint_format": "gptq_v2"}))
    for scheme, offset in ((v1, 1), (v2, 0)):
        got = cv.GPTQ.inputs(_gptq_tensors(src, offset), "m", scheme)
        assert torch.equal(got[0], src[0]) and torch.equal(got[2], src[2]), scheme
    # read with the other format's offset, every zero point is one off
    wrong = cv.GPTQ.inputs(_gptq_tensors(src, 0), "m", v1)
    assert torch.equal(wrong[2].to(torch.int16), src[2].to(torch.int16) + 1)
    sym = _canonical(n=40, sym=True)
    got = cv.GPTQ.inputs({**_gptq_tensors((*sym, torch.full_like(sym[1], 8, dtype=torch.uint8)), 1)},
                              "m", cv.GPTQ.scheme(_gptq_cfg(group_size=G)))
    assert len(got) == 2 and torch.equal(got[0], sym[0]) and torch.equal(got[1], sym[1])


@pytest.mark.parametrize("conv, role", [(cv.AWQ, "zero_points"), (cv.AWQ, "group_scales"),
                                        (cv.COMPRESSED_TENSORS, "zero_points"), (cv.GPTQ, "codes")])
def test_a_missing_tensor_is_named(conv, role):
    src = _canonical()
    t = mi.to_awq(*src) if conv is cv.AWQ else mi.to_pack_quantized(*src) if conv is cv.COMPRESSED_TENSORS \
        else {"scales": src[1].t()}
    name = getattr(conv.names(cv.formats.INT4), role)
    t.pop(name, None)
    with pytest.raises(cv.ConventionError, match=f"^layers.0.mlp: {conv.name} INT4 W4A16 needs tensor '{name}' \\({role}\\)"):
        conv.inputs(t, "layers.0.mlp", cv.int_scheme(4, False, G))


def test_act_order_is_refused_naming_the_module():
    src = _canonical(k=256)
    t = mi.to_pack_quantized(*src)
    scheme = cv.int_scheme(4, False, G, act_order=True)
    with pytest.raises(cv.ConventionError, match="needs tensor 'weight_g_idx'"):
        cv.COMPRESSED_TENSORS.inputs(t, "layers.7.mlp.down_proj", scheme)
    whole = (torch.arange(256) // G).to(torch.int32)
    assert torch.equal(cv.COMPRESSED_TENSORS.inputs({**t, "weight_g_idx": whole}, "d", scheme)[0], src[0])
    scattered = (torch.arange(256) % (256 // G)).to(torch.int32)
    with pytest.raises(cv.ActOrderRefused, match="^layers.7.mlp.down_proj: activation-ordered") as err:
        cv.COMPRESSED_TENSORS.inputs({**t, "weight_g_idx": scattered}, "layers.7.mlp.down_proj", scheme)
    assert isinstance(err.value.__cause__, int4_checkpoint.ActOrderError)
    with pytest.raises(cv.ActOrderRefused, match="^x: activation-ordered"):
        cv.GPTQ.check_g_idx("x", scattered, 256, scheme)


# ------------------------------------------------------------------------------ the generator
@pytest.fixture(scope="module")
def awq_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("awq") / "ckpt"
    mi.make_int4_checkpoint(out, "awq", seed=0)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["asym", "sym"])
def ct_ckpt(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("ct_int4") / "ckpt"
    mi.make_int4_checkpoint(out, "compressed-tensors", seed=0, symmetric=request.param)
    return out, request.param


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _modules():
    weights = tiny_hybrid.float_weights(tiny_hybrid.TinyHybridSpec(), 0)
    return weights, {make_checkpoint.hub_name(m): m for m in mi.int4_modules(weights)}


@pytest.fixture(scope="module")
def vllm_awq():
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    from vllm.model_executor.layers.quantization import auto_awq
    from vllm.scalar_type import scalar_types
    int_wna16 = pytest.importorskip("vllm.model_executor.layers.fused_moe.oracle.int_wna16")
    return SimpleNamespace(qu=qu, auto_awq=auto_awq, types=scalar_types,
                           dequant=int_wna16._unpack_and_dequant_int4_awq,
                           dequant_gptq=int_wna16._unpack_and_dequant_int4_gptq)


def test_awq_checkpoint_is_vllms_awq_byte_for_byte(awq_ckpt, vllm_awq, monkeypatch):
    """Every INT4 module: qweight and qzeros are vLLM's own AutoAWQ packer's words (quant_utils.
    awq_pack) for the codes and zero points int4_codec.quantize makes; vLLM's torch AWQ
    dequantization (fused_moe.oracle.int_wna16._unpack_and_dequant_int4_awq, the triton-free
    reference of its emulation path) gives the INT4 family's weights in float16, bit for bit; vLLM's
    AWQ -> standard repack (auto_awq._convert_awq_to_standard_format) gives our codes."""
    import torch.nn as nn
    import vllm.model_executor.parameter as vparam

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    t = _load(awq_ckpt)
    weights, modules = _modules()
    assert len(modules) == 50  # the mixed plan's 51 FP8 / NVFP4 linears less lm_head
    E = vllm_awq
    for hub, module in modules.items():
        codes, s, z = int4_codec.quantize(weights[f"{module}.weight"], G)
        q = int4_codec.unpack_codes(codes).t().to(torch.int32)   # [K, N]
        k, n = q.shape
        qw, qz, sc = t[f"{hub}.qweight"], t[f"{hub}.qzeros"], t[f"{hub}.scales"]
        assert torch.equal(qw, E.qu.awq_pack(q, 4, k, n)), hub
        assert torch.equal(qz, E.qu.awq_pack(z.t().to(torch.int32), 4, k // G, n)), hub
        assert sc.dtype == torch.float16 and torch.equal(sc, s.t()), hub
        theirs = E.dequant(qw[None], sc[None], qz[None], transpose_output=True, output_dtype=torch.float16)[0]
        assert torch.equal(theirs, int4_codec.dequantize(codes, s, z).half()), hub
        mod = nn.Module()
        mod.qweight = nn.Parameter(qw.clone(), requires_grad=False)
        mod.qzeros = nn.Parameter(qz.clone(), requires_grad=False)
        E.auto_awq._convert_awq_to_standard_format(mod, "qweight", "qzeros", 4)
        assert torch.equal(E.qu.unpack_quantized_values_into_int32(mod.qweight.data, E.types.uint4, 0), q), hub
        assert f"{hub}.weight" not in t
    assert t["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.qweight" not in t


def test_a_swapped_awq_nibble_order_would_not_be_vllms(vllm_awq, monkeypatch):
    """The byte-identity check above fails if the generator packed in the standard order."""
    src = _canonical(n=64, k=64)
    q = int4_codec.unpack_codes(src[0]).t().to(torch.int32)
    assert torch.equal(mi.to_awq(*src)["qweight"], vllm_awq.qu.awq_pack(q, 4, 64, 64))
    monkeypatch.setattr(mi, "AWQ", dataclasses.replace(
        cv.AWQ, layout=dataclasses.replace(cv.AWQ.layout, word_order=tuple(range(8)))))
    assert not torch.equal(mi.to_awq(*src)["qweight"], vllm_awq.qu.awq_pack(q, 4, 64, 64))


# GPTQ: one checkpoint per member and format (v1 stores zero - 1, v2 the zero itself)
GPTQ_VARIANTS = [(False, "gptq"), (False, "gptq_v2"), (True, "gptq"), (True, "gptq_v2")]


@pytest.fixture(scope="module", params=GPTQ_VARIANTS, ids=[f"{'sym' if s else 'asym'}-{f}" for s, f in GPTQ_VARIANTS])
def gptq_ckpt(tmp_path_factory, request):
    sym, fmt = request.param
    out = tmp_path_factory.mktemp("gptq") / "ckpt"
    mi.make_int4_checkpoint(out, "gptq", seed=0, symmetric=sym, checkpoint_format=fmt)
    return out, sym, fmt


def _exllama_v1_zeros(vllm_awq, k: int, n: int, g: int, monkeypatch) -> torch.Tensor:
    """The qzeros vLLM's exllama kernel makes for a symmetric GPTQ layer (kernels/linear/mixed_precision/
    exllama.py, process_weights_after_loading): the v1 format's stored zero point, uint4b8's bias
    less 1. Run on the CPU with its CUDA-only weight shuffle stood down (it moves qweight, not qzeros)."""
    import torch.nn as nn
    from vllm.model_executor.kernels.linear.mixed_precision import exllama
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

    monkeypatch.setattr(exllama.ops, "gptq_shuffle", lambda *a, **kw: None)
    cfg = MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                              weight_type=vllm_awq.types.uint4b8, act_type=torch.float16, group_size=g,
                              zero_points=False)
    kernel = exllama.ExllamaLinearKernel(cfg, w_q_param_name="qweight", w_s_param_name="scales",
                                         w_zp_param_name="qzeros")
    layer = nn.Module()
    layer.qweight = PackedvLLMParameter(data=torch.zeros(k // 8, n, dtype=torch.int32), input_dim=0, output_dim=1,
                                        packed_dim=0, packed_factor=8, weight_loader=lambda *a: None)
    layer.scales = GroupQuantScaleParameter(data=torch.ones(k // g, n, dtype=torch.float16), input_dim=0,
                                            output_dim=1, weight_loader=lambda *a: None)
    kernel.process_weights_after_loading(layer)
    return layer.qzeros.data


def test_gptq_checkpoint_is_vllms_gptq_byte_for_byte(gptq_ckpt, vllm_awq, monkeypatch):
    """Every INT4 module of a GPTQ checkpoint (each member, v1 and v2): qweight is vLLM's GPTQ packer's
    words (quant_utils.pack_rows) for int4_codec.quantize's codes, qzeros its column packer's
    (pack_cols) for the stored zero points; a symmetric v1 checkpoint's qzeros are the very words
    vLLM's exllama kernel makes for uint4b8 (its v1 convention, zero - 1); the v1 words are the v2
    words less one per nibble; vLLM's GPTQ dequantization (fused_moe.oracle.int_wna16.
    _unpack_and_dequant_int4_gptq, which reads the v2 form) gives the INT4 family's weights in float16,
    bit for bit; g_idx is k // g; and QPN's reader gives the canonical source back."""
    import vllm.model_executor.parameter as vparam
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    ckpt, sym, fmt = gptq_ckpt
    t = _load(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["sym"], cfg["checkpoint_format"], cfg["desc_act"]) == ("gptq", sym, fmt, False)
    scheme = cv.GPTQ.scheme(cfg)
    assert (scheme.symmetric, scheme.zero_offset) == (sym, 1 if fmt == "gptq" and not sym else 0)
    weights, modules = _modules()
    assert len(modules) == 50
    qu = vllm_awq.qu
    for hub, module in modules.items():
        src = int4_codec.quantize(weights[f"{module}.weight"], G, symmetric=sym)
        q = int4_codec.unpack_codes(src[0]).t().to(torch.int32)     # [K, N]
        k, n = q.shape
        zero = torch.full((k // G, n), 8, dtype=torch.int32) if sym else src[2].t().to(torch.int32)
        offset = 1 if fmt == "gptq" else 0
        qw, qz, sc, gi = (t[f"{hub}.{r}"] for r in ("qweight", "qzeros", "scales", "g_idx"))
        assert torch.equal(qw, qu.pack_rows(q, 4, k, n)), hub
        assert torch.equal(qz, qu.pack_cols(zero - offset, 4, k // G, n)), hub
        assert torch.equal(qu.unpack_quantized_values_into_int32(qz, vllm_awq.types.uint4, 1) + offset, zero), hub
        assert sc.dtype == torch.float16 and torch.equal(sc, src[1].t()), hub
        assert gi.dtype == torch.int32 and torch.equal(gi, torch.arange(k, dtype=torch.int32) // G), hub
        v2_words = qu.pack_cols(zero, 4, k // G, n)
        theirs = int_wna16._unpack_and_dequant_int4_gptq(qw[None], sc[None], None if sym else v2_words[None],
                                                          transpose_output=True, output_dtype=torch.float16)[0]
        assert torch.equal(theirs, int4_codec.dequantize(*src).half()), hub
        got = cv.GPTQ.inputs({k_: t[f"{hub}.{k_}"] for k_ in ("qweight", "qzeros", "scales", "g_idx")}, hub, scheme)
        assert len(got) == len(src) and all(torch.equal(a, b) for a, b in zip(got, src)), hub
        assert f"{hub}.weight" not in t
        if sym and fmt == "gptq":   # the exllama kernel's own v1 zero points for uint4b8, at this layer's shape
            assert torch.equal(qz, _exllama_v1_zeros(vllm_awq, k, n, G, monkeypatch)), hub
    assert t["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.qweight" not in t
    # what stays BF16 is what GPTQModel's negative dynamic rules name, by vLLM's own matcher
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.utils.gptq_utils import get_dynamic_override

    theirs = AutoGPTQConfig.from_config({**cfg, "sym": True})   # vLLM 0.32 parses symmetric GPTQ only
    for name in ("model.layers.0.linear_attn.in_proj_ba", "model.language_model.layers.0.linear_attn.in_proj_b",
                 "mtp.layers.0.mlp.gate_up_proj", "mtp.fc"):
        assert get_dynamic_override(theirs, layer_name=name) is False, name
        assert cv.GPTQ.excluded(name, dynamic=cfg["dynamic"]), name
    for name in ("model.layers.0.linear_attn.in_proj_qkvz", "model.layers.3.self_attn.qkv_proj"):
        assert get_dynamic_override(theirs, layer_name=name) is None, name
        assert not cv.GPTQ.excluded(name, dynamic=cfg["dynamic"]), name


def test_gptq_writer_over_every_code_and_zero_point(vllm_awq):
    """The GPTQ writer on a source holding every code in every group and every zero point the
    format can store (v2: 0..15; v1: 1..15, zero 0 having no v1 word, refused naming the module):
    vLLM's packers give the same words, its dequantization the same weights, QPN's reader the
    same source."""
    qu = vllm_awq.qu
    n, k, g = 32, 256, 32
    codes = torch.stack([torch.roll(torch.arange(16).repeat(k // 16), r) for r in range(n)]).to(torch.uint8)
    zeros = ((torch.arange(n).view(n, 1) + torch.arange(k // g).view(1, -1)) % 16).to(torch.uint8)
    scales = (torch.rand(n, k // g, generator=torch.Generator().manual_seed(5)) * 0.02 + 1e-3).half()
    src = (int4_codec.pack_codes(codes), scales, zeros)
    assert set(zeros.unique().tolist()) == set(range(16))
    with pytest.raises(ValueError, match="^layers.0.mlp.down_proj: zero point 0 cannot be stored in GPTQ's v1"):
        mi.to_gptq(*src, g, "gptq", module="layers.0.mlp.down_proj")
    for fmt, z in (("gptq_v2", zeros), ("gptq", zeros.clamp(min=1))):
        t = mi.to_gptq(src[0], scales, z, g, fmt)
        offset = 1 if fmt == "gptq" else 0
        q = codes.t().to(torch.int32)
        assert torch.equal(t["qweight"], qu.pack_rows(q, 4, k, n))
        assert torch.equal(t["qzeros"], qu.pack_cols(z.t().to(torch.int32) - offset, 4, k // g, n))
        theirs = vllm_awq.dequant_gptq(t["qweight"][None], t["scales"][None],
                                       qu.pack_cols(z.t().to(torch.int32), 4, k // g, n)[None],
                                       transpose_output=True, output_dtype=torch.float32)[0]
        assert torch.equal(theirs, int4_codec.dequantize(src[0], scales, z)), fmt
        scheme = cv.GPTQ.scheme(mi.quantization_config("gptq", g, False, checkpoint_format=fmt))
        got = cv.GPTQ.inputs(t, "m", scheme)
        assert torch.equal(got[0], src[0]) and torch.equal(got[1], scales) and torch.equal(got[2], z), fmt


def test_ct_checkpoint_is_the_librarys_byte_for_byte(ct_ckpt):
    """Every INT4 module: weight_packed / weight_zero_point are compressed-tensors' pack_to_int32
    of the signed codes and zero points; PackedQuantizationCompressor.compress, given the weights
    these tensors decode to and the same scale and zero point, writes exactly our tensors
    (weight_shape included), and its decompress gives the INT4 family's weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationScheme

    ckpt, sym = ct_ckpt
    t = _load(ckpt)
    weights, modules = _modules()
    qcfg = json.loads((ckpt / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=qcfg["weights"])
    for hub, module in modules.items():
        src = int4_codec.quantize(weights[f"{module}.weight"], G, symmetric=sym)
        codes, s = src[0], src[1]
        q_signed = (int4_codec.unpack_codes(codes).to(torch.int16) - 8).to(torch.int8)
        ours = {k[len(hub) + 1:]: v for k, v in t.items() if k.startswith(hub + ".")}
        assert torch.equal(ours["weight_packed"], pack_to_int32(q_signed, 4)), hub
        sd = {"weight": int4_codec.dequantize(*src), "weight_scale": s}
        if not sym:
            z_signed = (src[2].to(torch.int16) - 8).to(torch.int8)
            assert torch.equal(ours["weight_zero_point"], pack_to_int32(z_signed, 4, packed_dim=0)), hub
            sd["weight_zero_point"] = z_signed
        lib = PQC.compress(sd, scheme)
        assert set(lib) == set(ours) == set(PQC.compression_param_names(scheme)), hub
        for key, v in lib.items():
            assert v.dtype == ours[key].dtype and torch.equal(v, ours[key]), f"{hub}.{key}"
        theirs = PQC.decompress(ours, scheme)["weight"]
        assert torch.equal(theirs, int4_codec.dequantize(*src).half()), hub
        got = cv.COMPRESSED_TENSORS.inputs(ours, hub, cv.ct_scheme_of(qcfg["weights"], "pack-quantized", ""))
        assert len(got) == len(src) and all(torch.equal(a, b) for a, b in zip(got, src)), hub


def test_the_generated_checkpoints_declare_their_modules(awq_ckpt, ct_ckpt, gptq_ckpt):
    _, modules = _modules()
    symmetric = {"awq": False, "compressed-tensors": ct_ckpt[1], "gptq": gptq_ckpt[1]}
    for ckpt in (awq_ckpt, ct_ckpt[0], gptq_ckpt[0]):
        conv, quant_cfg = cv.detect(ckpt)
        got_conv, schemes = cv.declared_modules(ckpt)
        assert got_conv is conv and sorted(schemes) == sorted(modules), conv.name
        assert {(s.group_size, s.symmetric) for s in schemes.values()} == {(G, symmetric[conv.name])}
        assert cv.integer_checkpoint_problems(ckpt) == []
        assert serve_preflight.check_checkpoint_tensors(str(ckpt)).startswith(f"{conv.name} INT4 W4A16")
    assert cv.detect(awq_ckpt)[0] is cv.AWQ and cv.detect(ct_ckpt[0])[0] is cv.COMPRESSED_TENSORS
    assert cv.detect(gptq_ckpt[0])[0] is cv.GPTQ


def test_generator_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="--symmetric is for GPTQ and compressed-tensors"):
        mi.make_int4_checkpoint(tmp_path / "a", "awq", symmetric=True)
    with pytest.raises(ValueError, match="--checkpoint-format is GPTQ's"):
        mi.make_int4_checkpoint(tmp_path / "a", "awq", checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        mi.make_int4_checkpoint(tmp_path / "a", "gptq", checkpoint_format="marlin")
    with pytest.raises(ValueError, match="group size 16"):
        mi.make_int4_checkpoint(tmp_path / "a", "awq", group_size=16)
    with pytest.raises(ValueError, match="choose from"):
        mi.make_int4_checkpoint(tmp_path / "a", "awq", malformed="act-order")  # AWQ has no g_idx
    (tmp_path / "exists").mkdir()
    assert mi.main([str(tmp_path / "exists")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


# ------------------------------------------------------------------------ refused before boot
_KINDS = [(c, k) for k, m in sorted(mi.MALFORMED.items()) for c in m.conventions]


@pytest.fixture
def qpn_serves_int4():
    """What the launcher refuses when QPN claims INT4 checkpoints (qpn_config.family_ready: the
    family is served, its module imports and it has its loader schema)."""
    from qpn.fork_patches.quant import qpn_config

    assert qpn_config.family_ready(cv.formats.INT4) == (True, "")


@pytest.mark.parametrize("convention, kind", _KINDS, ids=[f"{c}-{k}" for c, k in _KINDS])
def test_where_qpn_leaves_int4_to_the_engine_only_damage_is_refused(tmp_path, convention, kind, monkeypatch):
    """Where QPN does not claim INT4 checkpoints (its family not ready), the engine's own INT4
    kernels serve them: a damaged file is refused, a form QPN's family would not serve is left to
    the engine, and the launcher says so."""
    from qpn.fork_patches.quant import qpn_config

    assert qpn_config.family_ready(cv.formats.INT4) == (True, "")   # served: the family, its module, its schema
    monkeypatch.setattr(qpn_config, "family_ready", lambda fmt: (False, "the INT4 family is not ready"))
    out = tmp_path / "ckpt"
    mi.make_int4_checkpoint(out, convention, malformed=kind)
    if kind == "truncated":
        with pytest.raises(serve_preflight.Refusal, match="Re-download"):
            serve_preflight.check_tp_split(str(out), None)
    else:
        assert "left to the engine's kernels" in serve_preflight.check_checkpoint_tensors(str(out))


@pytest.mark.parametrize("convention, kind", _KINDS, ids=[f"{c}-{k}" for c, k in _KINDS])
def test_a_broken_int4_checkpoint_is_refused_before_boot_naming_the_module(tmp_path, convention, kind,
                                                                          qpn_serves_int4):
    out = tmp_path / "ckpt"
    summary = mi.make_int4_checkpoint(out, convention, malformed=kind)
    bad = mi.MALFORMED[kind]
    module = bad.module
    if kind == "truncated":  # the tensor at the end of the file loses its tail
        headers = json.loads(_raw_header(out / "model.safetensors"))
        last = max((k for k in headers if k != "__metadata__"), key=lambda k: headers[k]["data_offsets"][1])
        module = last.rsplit(".", 1)[0]
    else:
        assert summary["broken_tensor"].startswith(module)
    with pytest.raises(serve_preflight.Refusal) as err:
        serve_preflight.check_tp_split(str(out), None)  # what serve.prepare calls, at any TP
    msg = str(err.value)
    assert f"{module}:" in msg and bad.problem in msg, msg
    assert msg.count("\n  ") >= 1 and "Re-download" in msg


def _raw_header(path: Path) -> bytes:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def test_a_config_qpn_does_not_serve_is_refused_before_boot(tmp_path, awq_ckpt, qpn_serves_int4):
    import shutil

    out = tmp_path / "ckpt"
    shutil.copytree(awq_ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(serve_preflight.Refusal, match="bits = 8; AutoAWQ's GEMM packing is 4-bit"):
        serve_preflight.check_checkpoint_tensors(str(out))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x.qweight": "model-00002.safetensors"}}))
    cfg["quantization_config"]["bits"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(serve_preflight.Refusal, match="names shard model-00002.safetensors"):
        serve_preflight.check_checkpoint_tensors(str(out))


def test_other_checkpoints_pass_the_int4_check_untouched(tmp_path):
    assert serve_preflight.check_checkpoint_tensors(str(tmp_path)) == "no integer checkpoint"  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt"}}))
    assert serve_preflight.check_checkpoint_tensors(str(tmp_path)) == "no integer checkpoint"
    (tmp_path / "model.safetensors").write_bytes(b"\x01")  # not looked at: not an INT4 checkpoint
    assert serve_preflight.check_tp_split(str(tmp_path), 1) == "single rank"
