"""Quant-config step of the data path: accept the mixed ModelOpt checkpoint as ModelOpt writes
it, admit it on SM70 when the QPN kernels are built, and hand each quantized linear module to
the QPN method of its region. Three runtime hooks (registered in hooks.py):

* ``accept_mixed_precision_file_form``: vLLM 0.32 reads ``hf_quant_config.json`` into the HF
  config when config.json has no ``quantization_config``, then its config convertor raises
  ``Unknown ModelOpt quant algo: MIXED_PRECISION`` although vLLM has a config class for exactly
  that algo (``ModelOptMixedPrecisionConfig``, reached through ``quant_method: modelopt``). The
  wrapper sets ``quant_method`` to ``modelopt`` for that one algo and leaves every other input
  to vLLM. The plugin is loaded in ``EngineArgs.__post_init__``, before the model config is
  built, so this runs early enough in the API process (no file edit needed).
* ``admit_mixed_on_sm70``: ``ModelOptMixedPrecisionConfig.get_min_capability`` answers 70
  instead of 75 when the QPN kernels are present and built for sm_70; otherwise vLLM's value.
* ``qpn_linear_methods``: ``ModelOptMixedPrecisionConfig.get_quant_method`` gives every linear
  layer and ``ParallelLMHead`` listed in ``quantized_layers`` a QPN method (NVFP4 -> QPN2,
  FP8 -> QPN8) where the QPN path serves (CPU: reference; SM70: kernels); a declared algo the
  QPN path does not serve fails the load naming the module. Elsewhere vLLM's method stands.
"""
from __future__ import annotations

import logging

from qpn.fork_patches.linear_method import QPNCheckpointError, method_class
from qpn.kernels import formats

logger = logging.getLogger("vllm.qpn.quant_config")

SERVED_ALGOS = ", ".join(sorted(formats.MODELOPT_ALGOS))
MIN_CAPABILITY_SM70 = 70


# ------------------------------------------------------------------------ config parsing
def is_modelopt_mixed_file_form(quant_cfg) -> bool:
    """True for a ModelOpt ``hf_quant_config.json`` payload declaring MIXED_PRECISION."""
    if not isinstance(quant_cfg, dict):
        return False
    inner = quant_cfg.get("quantization")
    if not isinstance(inner, dict):
        return False
    producer = quant_cfg.get("producer", {})
    producer_name = producer.get("name") if isinstance(producer, dict) else None
    if producer_name != "modelopt" and "modelopt_quant_config" not in inner:
        return False
    return str(inner.get("quant_algo", "")).upper() == "MIXED_PRECISION"


def wrap_normalize_quantization_config(original):
    def _normalize_quantization_config(self, config):
        quant_cfg = getattr(config, "quantization_config", None)
        if is_modelopt_mixed_file_form(quant_cfg):
            # The same value vLLM sets for ModelOpt FP8 checkpoints; its override hook then
            # selects ModelOptMixedPrecisionConfig ("modelopt_mixed") from quant_algo.
            quant_cfg["quant_method"] = "modelopt"
            return quant_cfg
        return original(self, config)

    _normalize_quantization_config.__wrapped__ = original
    return _normalize_quantization_config


# ---------------------------------------------------------------------- capability gate
def wrap_get_min_capability(original):
    """``original`` is the classmethod object; the wrapper is returned as a classmethod."""
    func = original.__func__

    def get_min_capability(cls) -> int:
        from qpn.fork_patches.platform_gate import is_sm70_cuda, qpn_backend

        if is_sm70_cuda() and qpn_backend() == "cuda":
            return MIN_CAPABILITY_SM70
        return func(cls)

    get_min_capability.__wrapped__ = func
    return classmethod(get_min_capability)


# ----------------------------------------------------------------------- linear methods
_KV_RECORDED = False


def _record_kv_once(config=None) -> None:
    global _KV_RECORDED
    if _KV_RECORDED:
        return
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.cache_config is None:
        return
    from qpn.fork_patches.census import CENSUS
    from qpn.fork_patches.kv_policy import describe

    CENSUS.set_kv_cache(*describe(vllm_config))
    CENSUS.watch_engine(vllm_config)
    if config is not None and getattr(config, "quantized_layers", None) is not None:
        CENSUS.set_quantized_layers(config.quantized_layers)  # renamed by the model's mapper
    _KV_RECORDED = True


def _declared_entries(config, prefix: str, shard_names: list[str]) -> list[tuple[str, dict]]:
    """The quantized_layers entries behind a vLLM module (itself, or its fused shards)."""
    layers = config.quantized_layers
    base = prefix.rsplit(".", 1)[0]
    out = []
    for cand in config._quantized_layer_prefix_candidates(prefix):
        if cand in layers:
            out.append((cand, layers[cand]))
    if not out:
        for cand_base in config._quantized_layer_prefix_candidates(base):
            for s in shard_names:
                if f"{cand_base}.{s}" in layers:
                    out.append((f"{cand_base}.{s}", layers[f"{cand_base}.{s}"]))
    return out


def qpn_method_for(config, layer, prefix: str, target: dict):
    """The QPN method for a linear / lm_head layer, None if the layer is not quantized."""
    proj = prefix.rsplit(".", 1)[-1]
    shard_names = list((config.packed_modules_mapping or {}).get(proj, []))
    entries = _declared_entries(config, prefix, shard_names)
    for name, entry in entries:
        fmt = formats.MODELOPT_ALGOS.get(str(entry.get("quant_algo", "")).upper())
        if fmt is None:
            raise QPNCheckpointError(
                f"{prefix}: quantized_layers declares quant_algo {entry.get('quant_algo')!r} for "
                f"{name}; the QPN path serves {SERVED_ALGOS} (fix the checkpoint's "
                f"hf_quant_config.json or serve it on hardware vLLM supports natively)")
        if fmt.group_size is not None:
            group = int(entry.get("group_size", fmt.group_size))
            if group != fmt.group_size:
                raise QPNCheckpointError(
                    f"{prefix}: quantized_layers declares {fmt.title} group_size {group} for {name}; "
                    f"{fmt.title} has one e4m3 scale per {fmt.group_size} inputs")
    algo = config._resolve_quant_algo(prefix)  # raises on mixed algos inside a fused layer
    if algo is None:
        return None
    fmt = formats.MODELOPT_ALGOS.get(algo)
    if fmt is None:
        raise QPNCheckpointError(
            f"{prefix}: quant_algo {algo!r} is not served by the QPN path "
            f"(serves {SERVED_ALGOS})")
    return method_class(fmt)(prefix=prefix, algo=algo, backend=target["backend"], arch=target["arch"],
                             atom=target["atom"], shard_names=shard_names,
                             declared=[name for name, _ in entries])


def wrap_get_quant_method(original):
    def get_quant_method(self, layer, prefix: str):
        from qpn.fork_patches.platform_gate import serving_target

        target = serving_target()
        if target is None:
            return original(self, layer, prefix)
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        _record_kv_once(self)
        if isinstance(layer, (LinearBase, ParallelLMHead)) and not self.is_layer_excluded(prefix):
            method = qpn_method_for(self, layer, prefix, target)
            if method is not None:
                return method
        return original(self, layer, prefix)

    get_quant_method.__wrapped__ = original
    return get_quant_method
