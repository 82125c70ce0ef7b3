"""vLLM general plugin (entry point ``vllm.general_plugins: qpn_sm70``): registers the QPN
quantization method and applies the runtime hooks.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), possibly
more than once per process; it must be cheap and idempotent. It imports no kernel code: each hook
replaces one engine attribute with a thin wrapper whose work happens only when vLLM calls it, and
``qpn_config.register()`` adds ``QPNConfig`` under "qpn" through vLLM's own
``register_quantization_config`` (the registry vLLM has for quantization methods; the QPN linear
and MoE methods are handed out by that config, not by hooks). The registration runs in every
process because the API server's ModelConfig probes the registered methods and the engine
processes unpickle the QPNConfig the API server built.

A runtime hook's anchor is ``module:Attr.path`` (per engine: ``Hook.anchor_for(key)``) and its
wrapper ``wrap(original) -> replacement``. A replacement carries the hook's name in
``__qpn_hook__`` and the original in ``__wrapped__``; a hook counts as applied when its name is
anywhere on that chain, so a second ``register()`` changes nothing even where two hooks wrap the
same anchor (on 1Cat the linear and the MoE hooks both wrap the mixed config's get_quant_method).

Which engine: ``$QPN_ENGINE`` (profile) if set, else ``cpu`` on vLLM's CPU platform and ``sm70``
everywhere else; the build is the locked version the installed ``vllm.__version__`` is (local
suffix allowed; ``$QPN_ENGINE_VERSION`` overrides), giving an engine key such as ``sm70@1.3.0``.
An unlocked build gets the anchors of the profile's default version and is named in any failure.

Failure policy (vLLM calls plugins outside its error handling, in ``EngineArgs.__post_init__``,
so whatever ``register()`` raises stops the process before any model is read):
- a hook needed by every checkpoint (``needed_for="always"``) whose anchor is missing stops the
  engine with one message naming each such hook, its anchor, the engine version and the fix;
- a hook only some checkpoints need (``needed_for="moe"``) whose anchor is missing is skipped
  with a warning and recorded (``skipped_hooks()``, written into the census); the boot gate
  ``skipped_hooks`` fails when the served checkpoint needs it;
- an engine without vLLM's quantization registry (``register_quantization_config``) stops the
  engine with one message naming the engine version and the fix, as a missing required anchor does.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os

from qpn.fork_patches.engine.hooks import AnchorMissing, Hook, hooks_for

logger = logging.getLogger("vllm.qpn.plugin")

REGISTERED = False
MARK = "__qpn_hook__"
ENGINE_VERSION_ENV = "QPN_ENGINE_VERSION"
# Hooks skipped in this process: {"hook", "anchor", "engine", "needed_for", "reason"} per hook.
_SKIPPED: list[dict] = []


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


def engine_key() -> str:
    """``profile@version`` of the running engine (see the module docstring)."""
    from qpn.fork_patches.engine import engine_lock

    profile = engine_profile()
    found = os.environ.get(ENGINE_VERSION_ENV) or engine_version()
    try:
        return engine_lock.profile_for_installed(profile, found)["key"]
    except (engine_lock.LockError, KeyError):
        return f"{profile}@{engine_lock.default_version(profile)}"


def skipped_hooks() -> list[dict]:
    """The hooks this process skipped (anchor missing, not needed by every checkpoint)."""
    return [dict(s) for s in _SKIPPED]


def resolve_anchor(hook: Hook, engine: str | None = None):
    """(owner, attribute name, raw original) of a runtime hook's anchor on ``engine`` (key or
    profile; None: the running engine), or AnchorMissing naming hook, anchor and engine."""
    engine = engine or engine_key()
    anchor = hook.anchor_for(engine)
    module_name, sep, path = anchor.partition(":")
    if not sep or not path:
        raise AnchorMissing(f"hook {hook.name}: runtime anchor {anchor!r} is not 'module:attr'")

    def missing(detail: str) -> AnchorMissing:
        return AnchorMissing(
            f"hook {hook.name}: anchor {anchor} not found in the installed vLLM "
            f"{engine_version()} (engine {engine}; {detail})")

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


def hooks_on_chain(obj) -> list[str]:
    """The hook names marked on ``obj`` and every original it wraps (``__wrapped__``)."""
    names, seen = [], 0
    while obj is not None and seen < 32:
        func = getattr(obj, "__func__", obj)
        mark = getattr(func, MARK, None)
        if mark:
            names.append(mark)
        obj = getattr(func, "__wrapped__", None)
        seen += 1
    return names


def check_anchor(hook: Hook, engine: str | None = None) -> None:
    """Raise AnchorMissing unless the hook's anchor exists in the installed engine."""
    resolve_anchor(hook, engine)


def apply_runtime_hook(hook: Hook, engine: str | None = None) -> bool:
    """Patch one runtime hook in; False when it was already in place."""
    engine = engine or engine_key()
    owner, name, original = resolve_anchor(hook, engine)
    if hook.name in hooks_on_chain(original):
        return False
    replacement = hook.load(engine)(original)
    func = getattr(replacement, "__func__", replacement)
    setattr(func, MARK, hook.name)
    if getattr(func, "__wrapped__", None) is None:
        func.__wrapped__ = original
    setattr(owner, name, replacement)
    logger.debug("volta-qpn: hook %s applied at %s", hook.name, hook.anchor_for(engine))
    return True


class EngineMismatch(AnchorMissing):
    """Required hooks cannot apply: this engine is not a build the overlay was written for."""


def _fix(engine: str) -> str:
    from qpn.fork_patches.engine import engine_lock

    profile = engine.partition("@")[0]
    try:
        locked = ", ".join(engine_lock.versions(profile))
    except (engine_lock.LockError, KeyError):
        locked = "?"
    return (f"Fix: install a locked {profile} engine ({locked}; scripts/bootstrap-sm70.sh with "
            f"ENGINE={profile} [ENGINE_VERSION=...]), or port the hook in fork_patches/engine/hooks.py and "
            "prove it with `python -m qpn.fork_patches.engine.engine_source <engine source>`")


def register() -> None:
    """Entry point: apply every runtime hook of this engine, once per process (see the policy)."""
    global REGISTERED
    if REGISTERED:
        return
    engine = engine_key()
    missing: list[tuple[Hook, AnchorMissing]] = []
    for hook in hooks_for(engine, kind="runtime"):
        try:
            apply_runtime_hook(hook, engine)
        except AnchorMissing as exc:
            if hook.needed_for == "always":
                missing.append((hook, exc))
                continue
            details = {"anchor": hook.anchor_for(engine), "engine": engine,
                       "engine_version": engine_version(), "needed_for": hook.needed_for}
            if not any(s["hook"] == hook.name for s in _SKIPPED):
                _SKIPPED.append({"hook": hook.name, "reason": str(exc), **details})
            from qpn.fork_patches.route_census.census import CENSUS  # stdlib only: cheap

            CENSUS.skip_hook(hook.name, str(exc), **details)
            logger.warning("volta-qpn: hook %s skipped: %s. Checkpoints that need it (%s) will fail "
                           "the skipped_hooks boot gate", hook.name, exc, hook.needed_for)
    lines = []
    if missing:
        lines += [f"volta-qpn cannot run on vLLM {engine_version()} (engine {engine}): "
                  f"{len(missing)} required hook(s) have no anchor in it:"]
        lines += [f"  - {exc}" for _, exc in missing]
    try:
        from qpn.fork_patches.quant import qpn_config

        qpn_config.register()
    except (ImportError, AttributeError) as exc:
        lines += [f"volta-qpn cannot register its quantization method on vLLM {engine_version()} (engine "
                  f"{engine}): {type(exc).__name__}: {exc}"]
    if lines:
        lines.append(_fix(engine))
        raise EngineMismatch("\n".join(lines))
    REGISTERED = True
