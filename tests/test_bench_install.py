"""One harness install (issue 12 item 5): ``pip install '.[bench]'`` into a clean venv gives every
documented benchmark command, ``--help`` included, and a suite run reaches the network layer
(no ModuleNotFoundError) and says where its results would go.

Builds a venv and installs from pip's cache (network on a cold cache): a minute or two.
"""
from __future__ import annotations

import os
import subprocess
import sys
import venv

import pytest

from tests._ci import REPO  # noqa: E402
COMMANDS = ["suite", "domain_cells", "reasoning_seeds", "context_sweep", "plot"]


@pytest.fixture(scope="module")
def bench_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-venv")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    # a copy of the source, so the build leaves nothing in the working tree
    src = root / "src"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           check=True, capture_output=True, text=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{src}[bench]"],
                          capture_output=True, text=True, timeout=1800,
                          # PIP_COMPILE=0: no .pyc written for every installed module (CPU time);
                          # the commands below compile what they import.
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                               "PIP_COMPILE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python, root


def _run(python, *args, env_extra=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def test_bench_extra_brings_every_dependency(bench_venv):
    python, root = bench_venv
    proc = _run(python, "-c", "import httpx, openai, matplotlib, llama_benchy, qpn.benchmarks.suite",
                cwd=root)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_every_documented_command_prints_help(bench_venv, command):
    python, root = bench_venv
    proc = _run(python, "-m", f"qpn.benchmarks.{command}", "--help", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and len(proc.stdout) > 200, proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_suite_reaches_the_network_and_defaults_to_a_user_folder(bench_venv, tmp_path):
    python, root = bench_venv
    proc = _run(python, "-m", "qpn.benchmarks.domain_cells", "--base-url",
                "http://127.0.0.1:9/v1", "--model", "none", "--cells", "json",
                env_extra={"XDG_DATA_HOME": str(tmp_path / "data")}, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ModuleNotFoundError" not in out and "Traceback" not in out, out
    assert not (tmp_path / "results").exists()  # never the current folder's results/
    help_text = _run(python, "-m", "qpn.benchmarks.suite", "--help",
                     env_extra={"XDG_DATA_HOME": str(tmp_path / "data")}).stdout
    assert str(tmp_path / "data" / "volta-qpn" / "results") in help_text
