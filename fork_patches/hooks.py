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


# Engine-quirk hooks (the bootstrap's) first, then the loader's. Keep one entry per hook.
REGISTRY: list[Hook] = []


def hooks_for(engine: str, kind: str | None = None) -> list[Hook]:
    return [h for h in REGISTRY if engine in h.engines and (kind is None or h.kind == kind)]


def by_name(name: str) -> Hook:
    for hook in REGISTRY:
        if hook.name == name:
            return hook
    raise KeyError(name)
