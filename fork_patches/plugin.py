"""vLLM general plugin (entry point ``vllm.general_plugins: qpn_sm70``): applies the runtime hooks.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), possibly
more than once per process; it must be cheap and idempotent. It imports no kernel code: each hook
replaces one engine attribute with a thin wrapper whose work happens only when vLLM calls it.

A runtime hook's ``anchor`` is ``module:Attr.path`` and its ``apply`` names a function
``wrap(original) -> replacement``. Before patching, the anchor must exist; if it does not, the
engine is not the one the hook was written for and ``register()`` raises ``AnchorMissing``
naming the hook, the anchor and the installed vLLM version. A replacement carries the hook's
name in ``__qpn_hook__``, so a second ``register()`` (or a second plugin load) changes nothing.

Which hooks apply: ``hooks_for(profile, "runtime")`` with profile ``$QPN_ENGINE`` if set, else
``cpu`` on vLLM's CPU platform and ``sm70`` everywhere else (each hook then decides for itself,
at call time, whether the device is one it serves; on other hardware it defers to vLLM).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os

from qpn.fork_patches.hooks import AnchorMissing, Hook, hooks_for

logger = logging.getLogger("vllm.qpn.plugin")

_REGISTERED = False
MARK = "__qpn_hook__"


def engine_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "not importable"


def engine_profile() -> str:
    profile = os.environ.get("QPN_ENGINE")
    if profile:
        return profile
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "sm70"


def resolve_anchor(hook: Hook):
    """(owner, attribute name, raw original) of a runtime hook's anchor, or AnchorMissing."""
    module_name, sep, path = hook.anchor.partition(":")
    if not sep or not path:
        raise AnchorMissing(f"hook {hook.name}: runtime anchor {hook.anchor!r} is not 'module:attr'")

    def missing(detail: str) -> AnchorMissing:
        return AnchorMissing(
            f"hook {hook.name}: anchor {hook.anchor} not found in the installed vLLM "
            f"{engine_version()} ({detail}); this overlay was written against vLLM 0.32.0. "
            "Install the pinned engine (scripts/bootstrap-sm70.sh) or port the hook.")

    try:
        # The engine's own import order: vllm.config first. Its model module imports the config
        # convertor; importing the convertor on its own would hit vLLM's circular import.
        importlib.import_module("vllm.config")
        owner = importlib.import_module(module_name)
    except ImportError as e:
        raise missing(f"module {module_name} does not import: {e}") from e
    parts = path.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise missing(f"{owner.__name__ if hasattr(owner, '__name__') else owner} has no {part}")
        owner = getattr(owner, part)
    name = parts[-1]
    if inspect.isclass(owner):
        # Look through the MRO's __dict__s so classmethods come back as classmethod objects.
        for klass in owner.__mro__:
            if name in vars(klass):
                return owner, name, vars(klass)[name]
        raise missing(f"class {owner.__name__} has no attribute {name}")
    if not hasattr(owner, name):
        raise missing(f"module {module_name} has no attribute {name}")
    return owner, name, getattr(owner, name)


def _hook_mark(obj):
    return getattr(getattr(obj, "__func__", obj), MARK, None)


def check_anchor(hook: Hook) -> None:
    """Raise AnchorMissing unless the hook's anchor exists in the installed engine."""
    resolve_anchor(hook)


def apply_runtime_hook(hook: Hook) -> bool:
    """Patch one runtime hook in; False when it was already in place."""
    owner, name, original = resolve_anchor(hook)
    if _hook_mark(original) == hook.name:
        return False
    replacement = hook.load()(original)
    setattr(getattr(replacement, "__func__", replacement), MARK, hook.name)
    setattr(owner, name, replacement)
    logger.debug("volta-qpn: hook %s applied at %s", hook.name, hook.anchor)
    return True


def register() -> None:
    """Entry point: apply every runtime hook of this engine profile, once per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    for hook in hooks_for(engine_profile(), kind="runtime"):
        apply_runtime_hook(hook)
    _REGISTERED = True
