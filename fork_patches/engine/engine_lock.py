"""The engine lock (scripts/install/engines.lock.toml): which engines volta-qpn supports, at which versions.

An engine *profile* (``cpu``, ``sm70``) names a family of builds with one set of hooks and one
serving profile; a profile pins one version (``cpu``) or several (``sm70``: 1Cat-vLLM 1.3.0, the
default, and 1.2.2, the engine the seed figures were measured on). ``profile(name, version)``
gives the flat dict the bootstrap and the overlay read: the profile's common keys with the chosen
version's keys (wheel, digest, size, companions) laid over them.

An *engine key* ``<profile>@<version>`` (``sm70@1.3.0``) names one locked build; the hook registry
keys per-engine anchors by it.

Version check: a wheel built from the engine's source reads back the locked version with a local
suffix (``1.2.2+cu128``, ``1.2.2+precompiled``); the release wheel reads back the bare version.
Both are the locked engine; anything else is not.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path

VERSION_ENV = "ENGINE_VERSION"


class LockError(RuntimeError):
    pass


LOCK_ENV = "QPN_ENGINES_LOCK"  # a lock file read instead of the shipped one (tests: stand-in engines)


def load_lock() -> dict:
    if os.environ.get(LOCK_ENV):
        return tomllib.loads(Path(os.environ[LOCK_ENV]).read_text())
    lock_path = Path(__file__).resolve().parent.parent / "scripts" / "install" / "engines.lock.toml"
    if not lock_path.exists():  # installed wheel: the lock travels as package data
        from importlib.resources import files

        return tomllib.loads(files("qpn.scripts.install").joinpath("engines.lock.toml").read_text())
    return tomllib.loads(lock_path.read_text())


def versions(name: str, lock: dict | None = None) -> list[str]:
    """The versions the lock pins for profile ``name``, default first."""
    table = _table(name, lock or load_lock())
    if "versions" not in table:
        return [table["version"]]
    default = table["default_version"]
    return [default] + sorted(v for v in table["versions"] if v != default)


def default_version(name: str, lock: dict | None = None) -> str:
    return versions(name, lock)[0]


def engine_keys(lock: dict | None = None) -> list[str]:
    """Every locked build as ``profile@version``."""
    lock = lock or load_lock()
    return [f"{name}@{v}" for name in lock["engines"] for v in sorted(versions(name, lock))]


def split_key(key: str) -> tuple[str, str]:
    name, sep, version = key.partition("@")
    if not sep:
        raise LockError(f"engine key {key!r} is not 'profile@version'")
    return name, version


def _table(name: str, lock: dict) -> dict:
    table = lock["engines"].get(name)
    if table is None:
        raise LockError(f"unknown engine {name!r}; known: {', '.join(lock['engines'])}")
    return table


def profile(name: str, version: str | None = None, lock: dict | None = None) -> dict:
    """The flat profile of engine ``name`` at ``version`` (None: ``$ENGINE_VERSION`` if set for a
    profile with several versions, else the lock's default). Raises LockError naming the choices."""
    lock = lock or load_lock()
    table = _table(name, lock)
    if "versions" not in table:
        if version not in (None, "", table["version"]):
            raise LockError(f"engine {name} is locked at {table['version']} only (asked for {version})")
        return dict(table, name=name, key=f"{name}@{table['version']}")
    if not version:
        version = os.environ.get(VERSION_ENV, "").strip() or table["default_version"]
    if version not in table["versions"]:
        raise LockError(
            f"{VERSION_ENV}={version} is not locked for engine {name}; choose one of: "
            f"{', '.join(versions(name, lock))} (default {table['default_version']})")
    flat = {k: v for k, v in table.items() if k not in ("versions", "default_version")}
    flat.update(table["versions"][version])
    flat.update(version=version, name=name, key=f"{name}@{version}")
    return flat


def base_version(found: str) -> str:
    """``1.2.2+cu128`` -> ``1.2.2``: the public part of a version (PEP 440 local label dropped)."""
    return found.split("+", 1)[0]


def version_matches(found: str | None, locked: str) -> bool:
    """True for exactly the locked version, with or without a local build suffix."""
    if not found:
        return False
    public, sep, local = found.partition("+")
    return public == locked and (not sep or bool(local))


def check_version(found: str | None, prof: dict) -> str:
    """The installed engine's version if it is the locked one; LockError naming both otherwise."""
    if version_matches(found, prof["version"]):
        return found
    others = [v for v in versions(prof["name"]) if v != prof["version"]]
    hint = ""
    if found and base_version(found) in others:
        hint = f" ({prof['name']} {base_version(found)} is locked too: set {VERSION_ENV}={base_version(found)})"
    raise LockError(
        f"the installed engine reports {prof['distribution']} {found or 'nothing'}, the lock pins "
        f"{prof['version']} (a local build suffix such as +cu128 is accepted){hint}")


def profile_for_installed(name: str, found: str | None, lock: dict | None = None) -> dict:
    """The locked version of ``name`` that the installed ``found`` version is; LockError if none."""
    lock = lock or load_lock()
    for v in versions(name, lock):
        if version_matches(found, v):
            return profile(name, v, lock)
    raise LockError(
        f"engine {name} is locked at {', '.join(versions(name, lock))}; the installed one reports "
        f"{found or 'nothing'}")
