"""Quant-config step of the data path for ModelOpt checkpoints: accept the mixed checkpoint as
ModelOpt writes it, and say which QPN method each quantized linear module of a mixed config gets.

* ``wrap_normalize_quantization_config`` (runtime hook ``modelopt-mixed-precision-file-form``,
  hooks.py): vLLM 0.32 reads ``hf_quant_config.json`` into the HF config when config.json has no
  ``quantization_config``, then its config convertor raises ``Unknown ModelOpt quant algo:
  MIXED_PRECISION`` although vLLM has a config class for exactly that algo
  (``ModelOptMixedPrecisionConfig``, reached through ``quant_method: modelopt``). The wrapper sets
  ``quant_method`` to ``modelopt`` for that one algo and leaves every other input to vLLM. The
  plugin is loaded in ``EngineArgs.__post_init__``, before the model config is built, so this runs
  early enough in the API process (no file edit needed); the registered QPN config
  (qpn_config.py) then claims the normalized config.
* ``qpn_method_for``: the QPN method (NVFP4 on the qpn2 routes, FP8 on qpn8) of a linear layer or
  ``ParallelLMHead`` listed in the mixed config's ``quantized_layers``; a declared algo the QPN
  path does not serve fails the load naming the module. ``qpn_config.QPNConfig.get_quant_method``
  asks it for every such layer of a mixed checkpoint it claimed.
"""
from __future__ import annotations

from qpn.fork_patches.quant.conventions import ModuleScheme
from qpn.fork_patches.quant.linear_method import QPNCheckpointError, qpn_linear_method
from qpn.kernels import formats

SERVED_ALGOS = ", ".join(sorted(formats.MODELOPT_ALGOS))


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


# ----------------------------------------------------------------------- linear methods
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
    return qpn_linear_method(prefix, ModuleScheme(fmt.family, source=f"quant_algo {algo}"), target,
                             shard_names=shard_names, declared=[name for name, _ in entries])
