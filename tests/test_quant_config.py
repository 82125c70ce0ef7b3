"""QPN as a registered quantization method (qpn.fork_patches.quant.qpn_config), on the installed cpu
engine (vLLM 0.32) and, read from source, both 1Cat archives: the plugin registers "qpn" through
vLLM's register_quantization_config; vLLM's own _verify_quantization probes it before the
built-ins and settles on it for each convention QPN serves (INT4 only where the family serves and
QPN_INT4 is not 0); the engine's own config classes parse; real vLLM layers get the QPN linear and
MoE methods from the config, the engine's method elsewhere; the first call records the census's
quant_config; a config.json-embedded mixed config without quantized_layers is completed from the
folder's hf_quant_config.json through the engine's own VllmConfig._get_quantization_config. The
1Cat engines' real modules are exercised in tests/test_engine_source.py and tests/test_moe_1cat.py."""
from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from qpn.fork_patches.engine import engine_source  # noqa: E402
from qpn.fork_patches.quant import qpn_config  # noqa: E402
from qpn.fork_patches.quant.linear_method import (  # noqa: E402
    QPNCheckpointError, QPNLinearMethod)
from tests._ci import onecat_archive  # noqa: E402
from tests.test_loader_methods import engine_context  # noqa: E402,F401  (single-process TP group, plugin)

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("engine_context")]


def _served_as(method, family: str) -> bool:
    """Whether a layer got the QPN linear method, serving ``family``."""
    return type(method) is QPNLinearMethod and method.fmt == family

TARGET = {"backend": "reference", "arch": "sm70", "atom": "m8n8k4"}


def _installed_site():
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


@pytest.mark.parametrize("where", ["installed", "1.2.2", "1.3.0"])
def test_registration_path_is_in_the_engine_source(where):
    src = engine_source.open_source(_installed_site() if where == "installed" else onecat_archive(where))
    rows = engine_source.verify_registration(src)
    names = [r.hook for r in rows]
    assert len(rows) == len(engine_source.REGISTRATION_CHECKS) + len(engine_source.CONFIG_ASKED) + 1
    assert {"qpn-config-asked-for-linear", "qpn-config-asked-for-lm_head", "qpn-config-asked-for-experts",
            "qpn-config-model-folder"} <= set(names)
    assert [r.detail for r in rows if r.miss] == []


def test_the_plugin_registers_qpn_once_and_the_engine_returns_it():
    from vllm.model_executor.layers import quantization as q

    from qpn.fork_patches.engine import plugin

    plugin.register()
    cls = q.get_quantization_config("qpn")
    assert cls is qpn_config.config_class() and cls.__name__ == "QPNConfig"
    assert qpn_config.register() is cls and qpn_config.register() is cls
    assert q.QUANTIZATION_METHODS.count("qpn") == 1
    assert cls.get_min_capability() == 70


@pytest.fixture
def unregistered():
    """The engine as it is without our registration (restored after)."""
    from vllm.model_executor.layers import quantization as q

    before = list(q.QUANTIZATION_METHODS)
    q.QUANTIZATION_METHODS.remove("qpn")
    custom = q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.pop("qpn")
    yield
    q.QUANTIZATION_METHODS[:] = before
    q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG["qpn"] = custom


def _probe(quant_cfg, user=None):
    """vLLM's own _verify_quantization over a stand-in model config: the method it settles on."""
    from vllm.config.model import ModelConfig

    fake = SimpleNamespace(quantization=user, model_arch_config=SimpleNamespace(quantization_config=quant_cfg),
                           hf_config=None, allow_deprecated_quantization=False)
    ModelConfig._verify_quantization(fake)
    return fake.quantization


def _mixed_file_form():
    return {"producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt",
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
                             "quantized_layers": {"lm_head": {"quant_algo": "NVFP4", "group_size": 16}}}}


def _modelopt(algo):
    return {"quant_method": "modelopt", "quant_algo": algo, "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"], "group_size": 16}


def _ct():
    from qpn.scripts.checkpoints.make_ct_checkpoint import quantization_config

    return quantization_config()


def _awq(**kw):
    from qpn.scripts.checkpoints.make_int4_checkpoint import quantization_config

    return {**quantization_config("awq", 64, False), **kw}


def _gptq(**kw):
    return {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False, "desc_act": False,
            "checkpoint_format": "gptq_v2", **kw}


def _ct_int4():
    from qpn.scripts.checkpoints.make_int4_checkpoint import quantization_config

    return quantization_config("compressed-tensors", 64, False)


CLAIMED = {"modelopt-mixed": (_mixed_file_form, "modelopt_mixed", "ModelOptMixedPrecisionConfig"),
           "modelopt-nvfp4": (lambda: _modelopt("NVFP4"), "modelopt_fp4", "ModelOptNvFp4Config"),
           "modelopt-fp8": (lambda: _modelopt("FP8"), "modelopt", "ModelOptFp8Config"),
           "ct-nvfp4-fp8": (_ct, "compressed-tensors", "CompressedTensorsConfig")}
INT4_CLAIMED = {"awq": (_awq, "awq", "AutoAWQConfig"), "gptq": (_gptq, "gptq", "AutoGPTQConfig"),
                "ct-int4": (_ct_int4, "compressed-tensors", "CompressedTensorsConfig")}


@pytest.fixture
def int4_ready(monkeypatch):
    """Every family ready and its switch unset: QPN claims integer checkpoints (INT4 is served; a
    staged family such as INT8 before it served would otherwise be left to the engine)."""
    monkeypatch.setattr(qpn_config, "family_ready", lambda fmt: (True, ""))
    monkeypatch.delenv("QPN_INT4", raising=False)
    monkeypatch.delenv("QPN_INT8", raising=False)


def _engine_class_claiming(quant_cfg) -> str:
    from vllm.model_executor.layers.quantization import get_quantization_config

    return get_quantization_config(_probe(quant_cfg)).__name__


@pytest.mark.parametrize("case", sorted(CLAIMED) + sorted(INT4_CLAIMED))
def test_unregistered_the_engine_claims_its_own(unregistered, case):
    make, _, engine_cls = {**CLAIMED, **INT4_CLAIMED}[case]
    assert _engine_class_claiming(make()) == engine_cls  # the built-in QPN must come before


@pytest.mark.parametrize("case", sorted(CLAIMED))
def test_registered_qpn_claims_and_parses_through_the_engine_config(case):
    make, _, engine_cls = CLAIMED[case]
    assert _probe(make()) == "qpn"
    from vllm.model_executor.layers.quantization import get_quantization_config

    cfg = get_quantization_config("qpn").from_config(make())
    assert cfg.get_name() == "qpn" and type(cfg._inner).__name__ == engine_cls
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert cfg._inner.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    again = pickle.loads(pickle.dumps(cfg))  # how a VllmConfig reaches a spawned engine process
    assert type(again) is type(cfg) and type(again._inner).__name__ == engine_cls
    assert again.convention == cfg.convention and again.packed_modules_mapping == cfg.packed_modules_mapping


@pytest.mark.parametrize("case", sorted(INT4_CLAIMED))
def test_int4_checkpoints_are_claimed_only_where_the_family_serves_and_qpn_int4_is_on(case, int4_ready, monkeypatch):
    make, _, engine_cls = INT4_CLAIMED[case]
    assert _probe(make()) == "qpn"
    cfg = qpn_config.config_class().from_config(make())
    assert type(cfg._inner).__name__ == engine_cls
    monkeypatch.setenv("QPN_INT4", "0")
    assert _engine_class_claiming(make()) == engine_cls
    assert qpn_config.claim_verdict(make())[1] == ("QPN_INT4=0 leaves INT4 W4A16 checkpoints to the engine's own "
                                                   "kernels")
    monkeypatch.setenv("QPN_INT4", "1")
    monkeypatch.setattr(qpn_config, "family_ready", lambda fmt: (False, "INT4 W4A16 not served yet"))
    assert _engine_class_claiming(make()) == engine_cls


def test_int4_family_readiness_is_the_formats_registry():
    from qpn.kernels import formats

    for fmt in (formats.INT4, formats.INT8):
        ok, why = qpn_config.family_ready(fmt)
        assert ok == fmt.served
        assert ok or "served=False" in why


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("off", False), ("yes", True)])
def test_qpn_int4_switch(value, on):
    from qpn.kernels import formats

    assert qpn_config.family_switch(formats.INT4_SYM, {"QPN_INT4": value}) is on
    assert qpn_config.family_switch(formats.INT8, {"QPN_INT4": value}) is True  # each family its own switch
    assert qpn_config.family_switch(formats.INT4, {}) is True


def test_a_bad_qpn_int4_value_names_the_variable_and_the_fix(monkeypatch):
    from qpn.kernels import formats

    with pytest.raises(qpn_config.NotServed, match=r"QPN_INT4='maybe'.*QPN_INT4=1.*QPN_INT4=0"):
        qpn_config.family_switch(formats.INT4, {"QPN_INT4": "maybe"})
    monkeypatch.setattr(qpn_config, "family_ready", lambda fmt: (True, ""))
    with pytest.raises(qpn_config.NotServed, match="QPN_INT4"):
        qpn_config.claim(_awq(), {"QPN_INT4": "maybe"})


@pytest.mark.parametrize("cfg, why", [
    (_awq(bits=8), "AutoAWQ's GEMM packing is 4-bit"),
    (_gptq(bits=3), "3-bit integer weights; QPN's integer families are 4-bit and 8-bit"),
    (_awq(group_size=16), "group_size 16"),
    (_gptq(dynamic={r"+:.*down_proj": {"bits": 8}}), "dynamic rule"),
])
def test_int4_forms_qpn_does_not_serve_are_left_to_the_engine_saying_why(cfg, why, int4_ready, caplog):
    assert qpn_config.claim_verdict(cfg)[0] is None and why in qpn_config.claim_verdict(cfg)[1]
    with caplog.at_level("WARNING", logger="vllm.qpn.qpn_config"):
        assert _probe(cfg) != "qpn"
    assert why in caplog.text and "not claiming" in caplog.text


def test_a_ct_config_mixing_int4_with_nvfp4_is_not_claimed(int4_ready):
    q = _ct()
    q["config_groups"]["experts"] = {"targets": [r"re:.*experts.*"], **copy.deepcopy(_ct_int4()["config_groups"]["group_0"])}
    convention, why = qpn_config.claim_verdict(q)
    assert convention is None and "mixing integer weights with other formats" in why


def test_user_choice_and_unserved_checkpoints_are_not_claimed():
    cls = qpn_config.config_class()
    assert cls.override_quantization_method(_mixed_file_form(), "modelopt_mixed") is None
    assert cls.override_quantization_method({"quant_method": "fp8"}, None) is None
    assert cls.override_quantization_method(_modelopt("W4A8_AWQ"), None) is None
    with pytest.raises(qpn_config.NotServed, match=r"--quantization qpn: .*W4A8_AWQ.*fix: leave --quantization out"):
        cls.override_quantization_method(_modelopt("W4A8_AWQ"), "qpn")


def test_no_claim_where_qpn_does_not_serve(monkeypatch):
    from qpn.fork_patches.engine import platform_gate

    monkeypatch.setattr(platform_gate, "serving_target", lambda: None)
    cls = qpn_config.config_class()
    assert cls.override_quantization_method(_mixed_file_form(), None) is None
    with pytest.raises(qpn_config.NotServed, match="does not serve on this device.*fix:"):
        cls.override_quantization_method(_mixed_file_form(), "qpn")
    cfg = cls.from_config(_modelopt("NVFP4"))
    with pytest.raises(qpn_config.NotServed, match="x.down_proj: .*does not serve in this process.*fix:"):
        cfg.get_quant_method(object(), "x.down_proj")


def test_config_filenames_are_those_of_the_claimed_conventions():
    """weight_utils.get_quant_config reads quant_cls.get_config_filenames() for a checkpoint
    without an embedded quantization_config: "qpn" must read what the convention's class reads."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    union = set()
    for _, engine_name, _ in CLAIMED.values():
        union |= set(get_quantization_config(engine_name).get_config_filenames())
    assert set(qpn_config.config_class().get_config_filenames()) == union == {"hf_quant_config.json"}
    # AWQ / GPTQ are claimed from config.json only: their older file forms are not read as QPN's
    int4_files = set()
    for _, engine_name, _ in INT4_CLAIMED.values():
        int4_files |= set(get_quantization_config(engine_name).get_config_filenames())
    assert int4_files and not int4_files & set(qpn_config.CONFIG_FILENAMES)


def _model_config(folder, hf_quant_cfg):
    """What VllmConfig._get_quantization_config reads of a ModelConfig whose quantization is "qpn"."""
    return SimpleNamespace(quantization="qpn", model=str(folder), revision=None, quantization_config=None,
                           hf_config=SimpleNamespace(quantization_config=hf_quant_cfg), hf_overrides={},
                           dtype=torch.bfloat16)


def test_file_form_loads_through_the_engine_loader(tmp_path):
    """The ModelOpt file form (hf_quant_config.json, nothing in config.json) through vLLM's own
    get_quant_config under quantization "qpn": parsed by the engine's ModelOpt config."""
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    (tmp_path / "hf_quant_config.json").write_text(json.dumps(_mixed_file_form()))
    mc = _model_config(tmp_path, None)
    cfg = get_quant_config(mc, SimpleNamespace(download_dir=None))
    assert cfg.get_name() == "qpn" and type(cfg._inner).__name__ == "ModelOptMixedPrecisionConfig"


def test_embedded_mixed_config_without_quantized_layers_reads_the_folders_file(tmp_path):
    """config.json embedding MIXED_PRECISION without its quantized_layers (vLLM falls back to the
    file for this form only under the name modelopt_mixed): under "qpn" the engine's own
    _get_quantization_config builds the config and hands it the folder, and the map is the file's."""
    from vllm.config import VllmConfig

    from qpn.scripts.checkpoints.make_checkpoint import make_checkpoint

    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=0, embed_config=True, embed_layers=False)
    embedded = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert "quantized_layers" not in embedded and _probe(embedded) == "qpn"
    cfg = VllmConfig._get_quantization_config(_model_config(ckpt, embedded), SimpleNamespace(download_dir=None))
    layers = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert cfg.get_name() == "qpn" and type(cfg._inner).__name__ == "ModelOptMixedPrecisionConfig"
    assert cfg._inner.quantized_layers == layers and len(layers) > 10
    (ckpt / "hf_quant_config.json").unlink()
    with pytest.raises(qpn_config.NotServed, match=r"without its quantized_layers map.*hf_quant_config.json does "
                                                   r"not exist; fix: put ModelOpt's hf_quant_config.json back"):
        VllmConfig._get_quantization_config(_model_config(ckpt, embedded), SimpleNamespace(download_dir=None))
    with pytest.raises(qpn_config.NotServed, match="not a local folder.*fix: download"):
        qpn_config.mixed_config_from_folder("org/some-hub-id")


# ------------------------------------------------------------------ methods on real vLLM layers
def _qpn(quant_cfg, mapping=None):
    cfg = qpn_config.config_class().from_config(copy.deepcopy(quant_cfg))
    cfg.packed_modules_mapping = dict(mapping or {"gate_up_proj": ["gate_proj", "up_proj"],
                                                  "qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    return cfg


def _mixed(layers):
    return {"producer": {"name": "modelopt"}, "quant_method": "modelopt",
            "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}


def _linear(cfg, prefix, k=256, n=(256, 256)):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    if prefix.endswith("gate_up_proj"):
        return MergedColumnParallelLinear(k, list(n), bias=False, quant_config=cfg, prefix=prefix)
    return RowParallelLinear(k, n[0], bias=False, input_is_parallel=True, quant_config=cfg, prefix=prefix)


def test_modelopt_layers_get_the_qpn_methods_and_the_rest_the_engines():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    cfg = _qpn(_mixed({"model.layers.0.mlp.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
                       "model.layers.0.mlp.up_proj": {"quant_algo": "NVFP4", "group_size": 16},
                       "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"}}))
    assert _served_as(_linear(cfg, "model.layers.0.mlp.gate_up_proj").quant_method, "nvfp4")
    assert _served_as(_linear(cfg, "model.layers.0.mlp.down_proj").quant_method, "fp8")
    assert type(_linear(cfg, "model.layers.1.mlp.down_proj").quant_method) is UnquantizedLinearMethod
    single = _qpn(_modelopt("NVFP4"))
    assert _served_as(_linear(single, "model.layers.1.mlp.down_proj").quant_method, "nvfp4")
    fp8 = _qpn(_modelopt("FP8"))
    assert _served_as(_linear(fp8, "model.layers.1.mlp.down_proj").quant_method, "fp8")


def test_mtp_fc_stays_unquantized_under_modelopt_nvfp4():
    """vLLM's qwen3_5_mtp.py keys mtp.fc's workaround on get_name() == "modelopt_fp4"; the QPN
    config (named "qpn") takes the same decision in get_quant_method."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    cfg = qpn_config.config_class().from_config(_modelopt("NVFP4"))
    assert qpn_config.is_mtp_fc("mtp.fc") and qpn_config.is_mtp_fc("model.mtp.fc")
    assert not qpn_config.is_mtp_fc("model.layers.0.mlp.fc")
    assert isinstance(cfg.get_quant_method(object(), "mtp.fc"), UnquantizedLinearMethod)
    assert type(_linear(cfg, "model.mtp.fc").quant_method) is UnquantizedLinearMethod
    assert _served_as(_linear(cfg, "model.mtp.down_proj").quant_method, "nvfp4")  # only fc


def _experts(cfg, prefix="model.layers.0.mlp.experts"):
    """A real routed-experts layer of vLLM 0.32, built by the engine's own factory."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    get_current_vllm_config().compilation_config.static_forward_context.pop(prefix, None)
    return FusedMoEFactory(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32,
                           params_dtype=torch.bfloat16, quant_config=cfg, prefix=prefix).routed_experts


def test_routed_experts_get_the_qpn_moe_method_through_the_engines_own_choice():
    from qpn.fork_patches.quant import moe_method

    experts = {f"model.layers.0.mlp.experts.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
               for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    layer = _experts(_qpn(_mixed(experts)))
    assert type(layer.quant_method) is moe_method.QPNModelOptMoEMethod and layer.quant_method.algo == "NVFP4"
    assert len(layer.quant_method.declared) == 12
    fp8 = _experts(_qpn(_modelopt("FP8")))
    assert type(fp8.quant_method) is moe_method.QPNModelOptMoEMethod and fp8.quant_method.algo == "FP8"
    unlisted = _experts(_qpn(_mixed(experts)), prefix="model.layers.1.mlp.experts")
    assert type(unlisted.quant_method).__name__ == "UnquantizedFusedMoEMethod"  # the engine's


def test_the_first_call_records_the_claiming_config_in_the_census(monkeypatch):
    from qpn.fork_patches.route_census import census

    monkeypatch.setattr(census, "CENSUS", census.Census())
    monkeypatch.setattr(census.CENSUS, "_mark_dirty", lambda: None)  # no file, no flusher thread
    monkeypatch.setattr(qpn_config, "RANK_RECORDED", False)
    layers = {"model.layers.0.mlp.down_proj": {"quant_algo": "FP8"}}
    _linear(_qpn(_mixed(layers)), "model.layers.0.mlp.down_proj")
    assert census.CENSUS.quant_config == "qpn"
    assert census.CENSUS.engine_quantized_layers == list(layers)
    assert census.CENSUS.snapshot()["quant_config"] == "qpn"


@pytest.mark.parametrize("case, records", [("ct-nvfp4-fp8", True), ("ct-int4", True), ("awq", True), ("gptq", True),
                                           ("modelopt-mixed", False), ("modelopt-nvfp4", False)])
def test_every_convention_but_modelopt_records_its_checkpoint_names(case, records, monkeypatch, int4_ready):
    """The first call on a rank records the checkpoint's module names for every convention the
    qpn_routes gate pairs by name (compressed-tensors, AWQ, GPTQ); ModelOpt pairs by position with
    the engine's quantized_layers instead."""
    from qpn.fork_patches.route_census import census

    monkeypatch.setattr(census, "CENSUS", census.Census())
    monkeypatch.setattr(census.CENSUS, "_mark_dirty", lambda: None)  # no file, no flusher thread
    monkeypatch.setattr(qpn_config, "RANK_RECORDED", False)
    recorded = []
    monkeypatch.setattr(qpn_config, "record_checkpoint_modules", recorded.append)
    qpn_config.record_rank(_qpn({**CLAIMED, **INT4_CLAIMED}[case][0]()))
    assert len(recorded) == int(records), case


def _named_checkpoint(kind: str, out: Path) -> Path:
    """The tiny model as a compressed-tensors NVFP4 / FP8 (``ct``), AWQ or GPTQ checkpoint."""
    from qpn.scripts.checkpoints import make_ct_checkpoint, make_int4_checkpoint

    if kind == "ct":
        make_ct_checkpoint.make_ct_checkpoint(out, seed=0)
    else:
        make_int4_checkpoint.make_int4_checkpoint(out, kind)
    return out


@pytest.mark.parametrize("kind, count", [("ct", 51), ("awq", 50), ("gptq", 50)])
def test_the_config_records_every_declared_module_with_the_engines_name(kind, count, tmp_path, monkeypatch,
                                                                         int4_ready):
    """record_checkpoint_modules (run once per rank by record_rank) puts in the census each module
    the served folder declares quantized (compressed-tensors: config_groups; AWQ / GPTQ: the modules
    holding codes), exactly the names the launcher pairs through it (boot_gates.declared_modules),
    renamed by the model class's own hf_to_vllm_mapper (Qwen3.5 drops model.language_model.). The
    quant config's own mappers, which vLLM 0.32's weight loader composes with the model's, keep
    every module's tensor names: the model's mapper alone renames the modules the engine loads
    into. A served model that is not a local folder records nothing (the gate then reports the gap)."""
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM

    from qpn.fork_patches.quant import conventions
    from qpn.fork_patches.route_census import census
    from qpn.scripts.launcher import boot_gates

    ckpt = _named_checkpoint(kind, tmp_path / kind)
    monkeypatch.setattr(census, "CENSUS", census.Census())
    monkeypatch.setattr(census.CENSUS, "_mark_dirty", lambda: None)  # no file, no flusher thread
    seen = []
    monkeypatch.setattr(loader_utils, "get_model_architecture",
                        lambda mc: seen.append(mc) or (Qwen3_5ForCausalLM, "Qwen3_5ForCausalLM"))
    model_config = SimpleNamespace(model=str(ckpt))
    names = qpn_config.record_checkpoint_modules(SimpleNamespace(model_config=model_config))
    _, declared = boot_gates.declared_modules(str(ckpt))
    assert seen == [model_config] and census.CENSUS.checkpoint_modules == names
    assert list(names) == list(declared) and len(names) == count
    assert names["model.language_model.layers.3.self_attn.q_proj"] == "model.layers.3.self_attn.q_proj"
    assert names.get("lm_head") == ("lm_head" if kind == "ct" else None)  # the INT4 exports leave it BF16
    assert all(e == c.replace("model.language_model.", "model.", 1) for c, e in names.items())
    cfg = _qpn(json.loads((ckpt / "config.json").read_text())["quantization_config"])
    loaded = [(n, None) for n in conventions.tensor_headers(ckpt) if n.rsplit(".", 1)[0] in declared]
    kept = [n for n, _ in (cfg.get_cache_scale_mapper() | cfg.get_checkpoint_weight_mapper()).apply(loaded)]
    assert kept == [n for n, _ in loaded], kind
    missing = SimpleNamespace(model_config=SimpleNamespace(model="org/some-hub-id"))
    assert qpn_config.record_checkpoint_modules(missing) is None


def _registered_config(resolver, name: str):
    """(file, ClassDef) of the class the engine's get_quantization_config returns for ``name``: its
    method_to_config entry, bound through the function's own lazy imports."""
    import ast

    fn = resolver.find("vllm.model_executor.layers.quantization:get_quantization_config").node
    cls = next(v.id for d in ast.walk(fn) if isinstance(d, ast.Dict)
               for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and k.value == name)
    imp = next(i for i in ast.walk(fn) if isinstance(i, ast.ImportFrom)
               and any((a.asname or a.name) == cls for a in i.names))
    relfile = resolver.module_file("vllm.model_executor.layers.quantization")
    return resolver.binding(resolver.module_file(resolver._absolute(relfile, imp)), cls)


@pytest.mark.parametrize("where", ["installed", "1.2.2", "1.3.0"])
def test_the_name_record_renames_as_the_engine_does_for_every_convention(where):
    """record_checkpoint_modules asks the engine for the model class (model_loader.utils.
    get_model_architecture(model_config)) and renames with its WeightsMapper's _map_name, as the
    engine renames a quant config's names (configure_quant_config -> apply_vllm_mapper); vLLM 0.32
    passes the rename-only get_rename_mapper, 1Cat-vLLM the mapper itself (both handled). The same
    holds for AWQ and GPTQ: the model class does not depend on the quantization method
    (get_model_architecture reads no ``quantization``); the engine's AWQ and GPTQ config classes
    (those its registry names "awq" and "gptq") rename their module lists through the mapper they
    are handed (apply_vllm_mapper -> apply_list); and the weight loader takes from a quant config
    only its cache-scale and checkpoint-weight mappers (vLLM 0.32; 1Cat none), which the AWQ and
    GPTQ classes inherit from QuantizationConfig (the test above: they keep every module's tensor
    names)."""
    import ast

    src = engine_source.open_source(_installed_site() if where == "installed" else onecat_archive(where))
    resolver = engine_source.Resolver(src)
    arch = resolver.find("vllm.model_executor.model_loader.utils:get_model_architecture")
    assert [a.arg for a in arch.node.args.args] == ["model_config"], src.key
    for fn in ("get_model_architecture", "_get_model_architecture"):
        node = resolver.find(f"vllm.model_executor.model_loader.utils:{fn}").node
        assert "quantization" not in {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}, (src.key, fn)
    resolver.find("vllm.model_executor.models.utils:WeightsMapper._map_name")
    assert resolver.calls("vllm.model_executor.model_loader.utils:configure_quant_config",
                          "apply_vllm_mapper"), src.key
    text = src.text("model_executor/models/utils.py")
    assert ("def get_rename_mapper" in text) == src.key.startswith("cpu@"), src.key
    loader = resolver.find("vllm.model_executor.models.utils:AutoWeightsLoader.load_weights").node
    asked = {n.func.attr for n in ast.walk(loader) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and ast.unparse(n.func.value) == "quant_config"}
    assert asked == ({"get_cache_scale_mapper", "get_checkpoint_weight_mapper"} if where == "installed" else set())
    for method in qpn_config.INTEGER_METHODS:
        relfile, cls = _registered_config(resolver, qpn_config.ENGINE_NAMES[method])
        assert (relfile, cls.name) in engine_source.INT4_ENGINE_SITES[method]["config"], (src.key, relfile, cls.name)
        _, owner, fn = resolver.method(relfile, cls, "apply_vllm_mapper")
        mapper = fn.args.args[1].arg
        assert owner is cls and any(
            isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "apply_list"
            and ast.unparse(n.func.value) == mapper for n in ast.walk(fn)), (src.key, cls.name)
        for getter in asked:
            assert resolver.method(relfile, cls, getter)[1].name == "QuantizationConfig", (src.key, cls.name, getter)


# ------------------------------------------------------------------ INT4 on real vLLM layers
def _int4_case(kind):
    from tests import test_int4_linear_method as t4

    conv, sym, offset = t4.KINDS[kind]
    cfg = {"awq": _awq(group_size=64), "gptq-v1": _gptq(checkpoint_format="gptq"),
           "gptq-v2": _gptq(), "ct-asym": _ct_int4()}[kind]
    cfg.pop("modules_to_not_convert", None)
    return t4, cfg


@pytest.mark.parametrize("kind", ["awq", "gptq-v1", "gptq-v2", "ct-asym"])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_int4_layers_get_qpn4_from_the_config_and_compute_the_checkpoint(kind, which, int4_ready):
    t4, quant_cfg = _int4_case(kind)
    cfg = _qpn(quant_cfg)
    factory, plan, k = t4.layer_plan(which)
    layer = factory(cfg)
    method = layer.quant_method
    assert type(method) is QPNLinearMethod and method.convention.name == t4.KINDS[kind][0].name
    assert method.scheme.group_size == 64 and method.scheme.zero_offset == t4.KINDS[kind][2]
    tensors = t4.make_tensors(kind, plan, k, 64, seed=9)
    t4.load(layer, tensors, plan)
    method.process_weights_after_loading(layer)
    w = t4.reference(kind, tensors, plan, 64)
    assert torch.equal(method.apply(layer, torch.eye(k)), w.to(torch.float16).float().t())


def test_int4_modules_the_config_leaves_unquantized_get_the_engines_unquantized_method(int4_ready):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    awq = _qpn(_awq(modules_to_not_convert=["layers.1.mlp"]))
    assert type(_linear(awq, "model.layers.1.mlp.gate_up_proj").quant_method) is UnquantizedLinearMethod
    assert _served_as(_linear(awq, "model.layers.0.mlp.gate_up_proj").quant_method, "int4")
    gptq = _qpn(_gptq(dynamic={r"-:.*layers\.2\..*": {}}))
    assert type(_linear(gptq, "model.layers.2.mlp.down_proj").quant_method) is UnquantizedLinearMethod
    assert _served_as(_linear(gptq, "model.layers.3.mlp.down_proj").quant_method, "int4")
    split = _qpn(_awq(modules_to_not_convert=["mlp.up_proj"]))
    with pytest.raises(QPNCheckpointError, match=r"model.layers.0.mlp.gate_up_proj: .*up_proj.*must agree"):
        _linear(split, "model.layers.0.mlp.gate_up_proj")


def test_gptq_keeps_g_idx_for_qpn4_and_the_others_drop_it_as_the_engine_does(int4_ready):
    names = [("model.layers.0.mlp.down_proj.g_idx", torch.zeros(1)), ("model.layers.0.mlp.down_proj.qweight", torch.zeros(1))]
    gptq = [n for n, _ in _qpn(_gptq()).get_checkpoint_weight_mapper().apply(names)]
    awq = [n for n, _ in _qpn(_awq()).get_checkpoint_weight_mapper().apply(names)]
    assert gptq == [n for n, _ in names] and awq == ["model.layers.0.mlp.down_proj.qweight"]


def test_int4_experts_stay_with_the_engine(int4_ready):
    """QPN has no INT4 MoE kernels: an AWQ config hands routed experts the engine's choice."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    layer = RoutedExperts.__new__(RoutedExperts)
    assert qpn_config.qpn_method(_qpn(_awq()), layer, "model.layers.0.mlp.experts", TARGET) is None
    assert qpn_config.qpn_method(_qpn(_gptq(sym=True)), layer, "model.layers.0.mlp.experts", TARGET) is None
    # asymmetric GPTQ: the engine parsed the symmetric twin, so its MoE method would read no zero points
    with pytest.raises(qpn_config.NotServed, match=r"model.layers.0.mlp.experts: asymmetric GPTQ experts.*fix:"):
        qpn_config.qpn_method(_qpn(_gptq()), layer, "model.layers.0.mlp.experts", TARGET)
