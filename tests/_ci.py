"""CI=true turns a missing tool or environment from a skip into a failure: CI promises that these
tests ran, so a skip there would be a silent pass. Elsewhere the test skips and names the fix."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest


def in_ci() -> bool:
    """CI=true (what GitHub Actions and most runners export; 1/yes accepted too)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(what: str, why: str, fix: str):
    """A tool or environment a test needs is not here: fail under CI=true, else skip; both name the fix."""
    message = f"{what} unavailable: {why}. Fix: {fix}"
    if in_ci():
        pytest.fail(f"CI=true, and {message}", pytrace=False)
    pytest.skip(message)


# The repository root (tests/conftest.py computes the same before tests/ is importable).
REPO = Path(__file__).resolve().parent.parent
# The 1Cat-vLLM source archives (shared/engines beside the checkout, as CI lays it out).
ENGINE_SOURCES = Path(os.environ.get("QPN_ENGINE_SOURCES", REPO.parent / "shared" / "engines"))


def onecat_archive(version: str) -> Path:
    """The source archive the lock names for 1Cat-vLLM ``version``; its absence fails under CI=true
    (CI promises every hook and flag was proven against both archives) and skips elsewhere."""
    from qpn.fork_patches.engine import engine_lock

    path = ENGINE_SOURCES / engine_lock.profile("sm70", version)["source_archive"]
    if not path.is_file():
        unavailable(f"the 1Cat {version} source archive", f"{path} does not exist",
                    "put the archives in shared/engines beside the checkout or set QPN_ENGINE_SOURCES")
    return path


@functools.lru_cache(maxsize=None)
def onecat_source(version: str):
    """The 1Cat ``version`` archive's ``vllm`` Python files (qpn.fork_patches.engine.engine_source, the
    reader the hooks are proven with), read once per test process; ``.text(relpath)`` gives one."""
    from qpn.fork_patches.engine import engine_source

    return engine_source.open_source(onecat_archive(version), version=version, profile="sm70")


def onecat_text(version: str, relpath: str) -> str:
    """The text of ``vllm/<relpath>`` in the 1Cat ``version`` archive."""
    text = onecat_source(version).text(relpath)
    assert text is not None, f"{relpath} not in the 1Cat {version} archive"
    return text
