"""QPN as a registered quantization method (issue 26 item 3; qpn.fork_patches.qpn_config), NOT YET
WIRED into the plugin: the registration path it relies on is proven from the source of the cpu
engine and both 1Cat archives, and on the installed cpu engine the registered config is probed
before the built-ins and claims each served convention's checkpoint. Registration is undone after
each test (the old hooks still serve the boots)."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from qpn.fork_patches import engine_source, qpn_config  # noqa: E402

pytestmark = pytest.mark.fast

ENGINES = Path(os.environ.get("QPN_ENGINE_SOURCES", "/work/shared/engines"))
ARCHIVES = [ENGINES / f"1cat-vllm-{v}-src.tar.xz" for v in ("1.2.2", "1.3.0")]


def _installed_site():
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


@pytest.mark.parametrize("where", ["installed"] + [a.name for a in ARCHIVES])
def test_registration_path_is_in_the_engine_source(where):
    if where == "installed":
        src = engine_source.open_source(_installed_site())
    else:
        path = ENGINES / where
        if not path.exists():
            pytest.skip(f"{path} not present")
        src = engine_source.open_source(path)
    rows = engine_source.verify_registration(src)
    assert len(rows) == 6
    assert [r.detail for r in rows if r.miss] == []


@pytest.fixture
def registered():
    from vllm.model_executor.layers import quantization as q
    from vllm.platforms import current_platform

    before = list(q.QUANTIZATION_METHODS)
    sq = current_platform.supported_quantization
    sq_before = list(sq) if sq else None
    cls = qpn_config.register()
    yield cls
    q.QUANTIZATION_METHODS[:] = before
    q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.pop(qpn_config.QPN_NAME, None)
    if sq_before is not None:
        sq[:] = sq_before


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


CLAIMED = {"modelopt-mixed": (_mixed_file_form, "modelopt_mixed", "ModelOptMixedPrecisionConfig"),
           "modelopt-nvfp4": (lambda: _modelopt("NVFP4"), "modelopt_fp4", "ModelOptNvFp4Config"),
           "modelopt-fp8": (lambda: _modelopt("FP8"), "modelopt", "ModelOptFp8Config"),
           "ct-nvfp4-fp8": (_ct, "compressed-tensors", "CompressedTensorsConfig")}


@pytest.mark.parametrize("case", sorted(CLAIMED))
def test_unregistered_the_engine_claims_its_own(case):
    make, engine_name, engine_cls = CLAIMED[case]
    assert _probe(make()) == engine_name  # the built-in the registered QPN config must come before


@pytest.mark.parametrize("case", sorted(CLAIMED))
def test_registered_qpn_claims_and_parses_through_the_engine_config(registered, case):
    make, engine_name, engine_cls = CLAIMED[case]
    assert _probe(make()) == "qpn"
    from vllm.model_executor.layers.quantization import get_quantization_config

    cls = get_quantization_config("qpn")
    assert cls is registered and cls.get_min_capability() == 70
    cfg = cls.from_config(make())
    assert cfg.get_name() == "qpn" and type(cfg._inner).__name__ == engine_cls
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert cfg._inner.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def test_user_choice_and_unserved_checkpoints_are_not_claimed(registered):
    assert registered.override_quantization_method(_mixed_file_form(), "modelopt_mixed") is None
    assert registered.override_quantization_method({"quant_method": "fp8"}, None) is None
    assert registered.override_quantization_method(_modelopt("W4A8_AWQ"), None) is None
    ok, why = qpn_config.int4_ready()
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    for cfg in (awq, gptq):
        assert (registered.override_quantization_method(cfg, None) == "qpn") == ok, why


def test_no_claim_where_qpn_does_not_serve(registered, monkeypatch):
    from qpn.fork_patches import platform_gate

    monkeypatch.setattr(platform_gate, "serving_target", lambda: None)
    assert registered.override_quantization_method(_mixed_file_form(), None) is None


def test_config_filenames_are_those_of_the_claimed_conventions(registered):
    """weight_utils.get_quant_config reads quant_cls.get_config_filenames() for a checkpoint
    without an embedded quantization_config: "qpn" must read what the convention's class reads."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    union = set()
    for _, engine_name, _ in CLAIMED.values():
        union |= set(get_quantization_config(engine_name).get_config_filenames())
    assert set(registered.get_config_filenames()) == union == {"hf_quant_config.json"}


def test_file_form_loads_through_the_engine_loader(registered, tmp_path):
    """The ModelOpt file form (hf_quant_config.json, nothing in config.json) through vLLM's own
    get_quant_config under quantization "qpn": parsed by the engine's ModelOpt config."""
    import json

    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    (tmp_path / "hf_quant_config.json").write_text(json.dumps(_mixed_file_form()))
    mc = SimpleNamespace(quantization="qpn", model=str(tmp_path), revision=None, quantization_config=None,
                         hf_config=SimpleNamespace(), hf_overrides={})
    lc = SimpleNamespace(download_dir=None)
    cfg = get_quant_config(mc, lc)
    assert cfg.get_name() == "qpn" and type(cfg._inner).__name__ == "ModelOptMixedPrecisionConfig"


def test_mtp_fc_stays_unquantized_under_modelopt_nvfp4(registered):
    """vLLM's qwen3_5_mtp.py keys mtp.fc's workaround on get_name() == "modelopt_fp4"; the QPN
    config (named "qpn") takes the same decision in get_quant_method."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    cfg = registered.from_config(_modelopt("NVFP4"))
    assert qpn_config.is_mtp_fc("mtp.fc") and qpn_config.is_mtp_fc("model.mtp.fc")
    assert not qpn_config.is_mtp_fc("model.layers.0.mlp.fc")
    assert isinstance(cfg.get_quant_method(object(), "mtp.fc"), UnquantizedLinearMethod)
