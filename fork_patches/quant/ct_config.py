"""Quant-config step of the data path for compressed-tensors checkpoints (llm-compressor's
layout): which QPN method each linear module, and ``lm_head`` when the config quantizes it, gets
under the engine's own ``CompressedTensorsConfig``, fed through the compressed-tensors convention
(qpn.fork_patches.quant.conventions.COMPRESSED_TENSORS). ``qpn_config.QPNConfig`` (the registered "qpn"
quantization method) asks ``qpn_method_for`` for every linear and ``ParallelLMHead`` layer of a
compressed-tensors checkpoint it claims:

* a config group declaring NVFP4 (``nvfp4-pack-quantized``: float, 4 bits, tensor_group, group
  16, symmetric) gives the QPN method on the qpn2 routes, FP8 (``float-quantized``: float, 8 bits, static symmetric,
  tensor or channel) on the qpn8 routes, integer weights (``pack-quantized``: int, 4 or 8 bits, group
  32 / 64 / 128, or channel where the family stores it; claimed only where the family serves,
  ``qpn_config.family_served``) the method of their integer family; each through
  ``linear_method.qpn_linear_method``;
* each shard of a fused module is matched on its own and must declare the same scheme; a scheme
  the QPN path does not serve (MXFP4, block FP8, output-activation quantization, transforms)
  fails the load naming the module and the config group;
* a module the config leaves unquantized gets the engine config's own method (None here).

Routed experts are chosen in moe_method (``qpn_ct_moe_method_for``). Once per rank, QPNConfig
records in the census every module the checkpoint declares quantized with the engine's name for
it (``qpn_config.record_checkpoint_modules``, as for AWQ and GPTQ), which the qpn_routes gate
pairs by name.

The engine config's ``get_min_capability`` is already 70 in all three engines, and the scheme's
own capability check (75 for NVFP4 and W8A16 FP8) runs inside ``get_scheme``, which QPN modules
skip.
"""
from __future__ import annotations

from qpn.fork_patches.quant.conventions import COMPRESSED_TENSORS, ConventionError, ct_scheme_of
from qpn.fork_patches.quant.linear_method import QPNCheckpointError, qpn_linear_method


def served_scheme(entry: dict, quant_format, prefix: str, src: str):
    """The ModuleScheme a compressed-tensors scheme dict (one config group, as the engine's
    ``target_scheme_map`` holds it) declares; None when it leaves the weights unquantized. A dict
    that quantizes output activations, or a scheme the QPN kernels do not serve, fails naming the
    layer ``prefix``; ``src`` says where the dict came from. Linear layers and routed experts
    alike are read through here (moe_method leaves integer experts to the engine: QPN has no
    integer MoE kernels)."""
    if entry.get("weights") is None:
        return None
    if entry.get("output_activations") is not None:
        raise QPNCheckpointError(
            f"{prefix}: {src} quantizes output activations; the QPN path computes W4A16 / W8A16 and "
            "applies no output fake-quant (serve it on hardware vLLM supports natively)")
    fmt = entry.get("format") or quant_format
    try:
        return ct_scheme_of(entry["weights"], fmt, src)
    except ConventionError as e:
        raise QPNCheckpointError(f"{prefix}: {e}; the QPN path serves NVFP4 (nvfp4-pack-quantized), "
                                 "FP8 (float-quantized, per tensor or per channel) and INT4 W4A16 "
                                 "(pack-quantized)") from e


def _shard_scheme(config, layer, name: str, prefix: str):
    """(ModuleScheme, target) a checkpoint (shard) module name resolves to; None if unmatched."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import find_matched_target

    target = find_matched_target(layer_name=name, module=layer, targets=config.target_scheme_map.keys())
    if target is None:
        return None
    scheme = served_scheme(config.target_scheme_map[target], config.quant_format, prefix,
                           f"{name}: config target {target!r}")
    return None if scheme is None else (scheme, target)


def qpn_method_for(config, layer, prefix: str, target: dict):
    """The QPN method for a linear / lm_head layer of a compressed-tensors config; None if the
    config leaves the layer unquantized."""
    if config.get_scheme_dict(layer, prefix) is None:  # ignored, or no target matches
        return None
    if getattr(config, "transform_config", None):
        raise QPNCheckpointError(f"{prefix}: the compressed-tensors config carries transforms "
                                 "(transform_config); the QPN path does not apply them")
    proj = prefix.rsplit(".", 1)[-1]
    shard_names = list((config.packed_modules_mapping or {}).get(proj, []))
    base = prefix.rsplit(".", 1)[0]
    names = [f"{base}.{s}" for s in shard_names] if shard_names else [prefix]
    found = {n: _shard_scheme(config, layer, n, prefix) for n in names}
    if len(names) > 1 and all(v is None for v in found.values()):
        # a target naming the fused module itself (vLLM's name) stands for all its shards
        whole = _shard_scheme(config, layer, prefix, prefix)
        found = {n: whole for n in names}
    missing = [n for n, v in found.items() if v is None]
    if missing:
        raise QPNCheckpointError(f"{prefix}: shard module(s) {', '.join(missing)} match no config group "
                                 "while the fused module is quantized; every shard of a fused module "
                                 "needs the same scheme")
    # an INT4 scheme's group size and ordering are part of what the shards must agree on
    schemes = {(s.format, getattr(s, "group_size", None), getattr(s, "act_order", None))
               for s, _ in found.values()}
    if len(schemes) != 1:
        detail = "; ".join(f"{n}: {s.fmt}{_group(s)} ({t})" for n, (s, t) in found.items())
        raise QPNCheckpointError(f"{prefix}: the shards of this fused module declare different schemes "
                                 f"({detail}); vLLM fuses them into one layer, so they must agree")
    scheme = next(iter(found.values()))[0]
    return qpn_linear_method(prefix, scheme, target, COMPRESSED_TENSORS, shard_names=shard_names, declared=names)


def _group(scheme) -> str:
    return f", group {scheme.group_size}" if scheme.format.group_sizes else ""
