"""Loader runtime hooks against the installed engine: anchors exist, the plugin is idempotent,
and each wrapper changes exactly what it claims (and nothing else)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from qpn.fork_patches.engine import kv_policy, plugin  # noqa: E402
from qpn.fork_patches.engine.hooks import REGISTRY, AnchorMissing, Hook  # noqa: E402

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast

RUNTIME = [h for h in REGISTRY if h.kind == "runtime"]
LOADER_HOOKS = {"modelopt-mixed-precision-file-form", "kv-cache-fp16-on-sm70"}


def test_loader_hooks_are_registered_and_the_quant_methods_are_not_hooks():
    """The loader keeps two hooks; the QPN methods come from the registered QPN config
    (tests/test_quant_config.py), so no hook wraps a quant config's get_quant_method,
    get_min_capability or an MoE method chooser any more."""
    assert LOADER_HOOKS <= {h.name for h in RUNTIME}
    anchors = [h.anchor_for(k) for h in REGISTRY for k in ("cpu", "sm70")]
    assert not [a for a in anchors if a.endswith((".get_quant_method", ".get_min_capability", "._get_quant_method",
                                                  ".get_moe_method"))], anchors


@pytest.mark.parametrize("hook", [h for h in RUNTIME if h.applies_to(plugin.engine_key())],
                         ids=lambda h: h.name)
def test_runtime_anchor_exists_in_the_installed_engine(hook):
    owner, name, original = plugin.resolve_anchor(hook)
    assert callable(getattr(original, "__func__", original))


def test_missing_anchor_fails_naming_hook_and_engine_version():
    import vllm

    bogus = Hook(name="bogus", kind="runtime", anchor="vllm.config:NoSuchThing.attr", what="x" * 11,
                 why="x" * 11, how="x" * 11, remove_when="x" * 11, apply="qpn.fork_patches.engine.plugin:register")
    with pytest.raises(AnchorMissing) as e:
        plugin.check_anchor(bogus)
    assert "bogus" in str(e.value) and vllm.__version__ in str(e.value)


def test_register_is_idempotent_and_wraps_once():
    plugin.register()
    plugin.REGISTERED = False  # a second plugin load in the same process
    plugin.register()
    for hook in plugin.hooks_for(plugin.engine_profile(), kind="runtime"):
        _, _, current = plugin.resolve_anchor(hook)
        func = getattr(current, "__func__", current)
        assert getattr(func, plugin.MARK) == hook.name
        inner = getattr(func, "__wrapped__")
        assert getattr(inner, plugin.MARK, None) is None, f"{hook.name} wrapped twice"


def _mixed_file_form(algo="MIXED_PRECISION"):
    return {"producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8",
                             "quantized_layers": {"lm_head": {"quant_algo": "NVFP4", "group_size": 16}}}}


def test_mixed_precision_in_hf_quant_config_is_accepted():
    plugin.register()
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase as Conv

    cfg = _mixed_file_form()
    raw = Conv._normalize_quantization_config.__wrapped__
    with pytest.raises(ValueError, match="Unknown ModelOpt quant algo: MIXED_PRECISION"):
        raw(None, SimpleNamespace(quantization_config=_mixed_file_form()))  # vLLM 0.32 as shipped
    out = Conv._normalize_quantization_config(None, SimpleNamespace(quantization_config=cfg))
    assert out["quant_method"] == "modelopt"
    assert ModelOptMixedPrecisionConfig.override_quantization_method(out, None) == "modelopt_mixed"
    # Everything else is still vLLM's business, errors included.
    with pytest.raises(ValueError, match="Unknown ModelOpt quant algo: NVFP3"):
        Conv._normalize_quantization_config(None, SimpleNamespace(quantization_config=_mixed_file_form("NVFP3")))


def test_qpn_serves_the_cpu_platform_with_the_reference():
    from qpn.fork_patches.engine.platform_gate import serving_target

    assert serving_target()["backend"] == "reference"


def _model_config(dtype="bfloat16"):
    import torch

    return SimpleNamespace(hf_config=SimpleNamespace(quantization_config={**_mixed_file_form(), "quant_method": "modelopt"}),
                           dtype=getattr(torch, dtype))


def test_kv_policy_fp16_on_sm70_and_explicit_choice_wins(monkeypatch):
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string as original

    wrapped = kv_policy.wrap_resolve_kv_cache_dtype_string(original)
    assert original("auto", _model_config()) == "fp8_e4m3"  # what the checkpoint asks for
    monkeypatch.setattr(kv_policy, "is_sm70", lambda: True)
    assert wrapped("auto", _model_config()) == "float16"
    assert wrapped("fp8_e4m3", _model_config()) == "fp8_e4m3"  # the user's explicit choice
    assert wrapped("bfloat16", _model_config()) == "bfloat16"


def test_kv_policy_on_this_cpu_follows_what_vllm_can_allocate(monkeypatch):
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string as original

    monkeypatch.setattr(kv_policy, "is_sm70", lambda: False)
    wrapped = kv_policy.wrap_resolve_kv_cache_dtype_string(original)
    expected = "bfloat16" if kv_policy.cpu_lacks_fp8_kv() else "fp8_e4m3"
    assert wrapped("auto", _model_config("bfloat16")) == expected
