"""The bootstrap's kernel step: ``python -m qpn.kernels build --arch sm70`` builds and checks."""
from __future__ import annotations

import os
import subprocess
import sys


def test_build_cli_compiles_sm70_and_caches(tmp_path, nvrtc12):
    env = dict(os.environ, QPN_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "qpn.kernels", "build", "--arch", "sm70"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "built and checked QPN kernels for sm70" in first.stdout
    cubins = list(tmp_path.glob("qpn_sm70_*.cubin"))
    assert len(cubins) == 1 and cubins[0].stat().st_size > 10_000
    mtime = cubins[0].stat().st_mtime_ns
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0
    assert cubins[0].stat().st_mtime_ns == mtime  # served from the cache, not rebuilt


def test_build_cli_rejects_an_unknown_architecture(tmp_path):
    env = dict(os.environ, QPN_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "qpn.kernels", "build", "--arch", "sm_7x"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "sm_7x" in result.stderr and "Traceback" not in result.stderr
