"""scripts/test.sh runs the suite on two pytest-xdist workers, one file per worker at a time
(--dist loadfile); tests/conftest.py's scheduler makes the files of one SHARED_UNITS entry one
unit, so that the servers they share (tests/_mtp_servers.py) meet on one worker (checked on
stand-in files named as the shared ones, under the real conftest and the real scheduler). Each
worker's launcher servers bind a core of their own (tests/_server.py worker_cpu_bind)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._ci import REPO
from tests.conftest import SHARED_UNITS

pytestmark = pytest.mark.fast

pytest.importorskip("xdist")


def test_shared_files_run_on_one_worker_and_others_spread(tmp_path):
    files = sorted({*SHARED_UNITS, *SHARED_UNITS.values()}) + [f"tests/test_other_{i}.py" for i in range(4)]
    (tmp_path / "tests").mkdir()
    for name in files:
        # each test records the worker it ran on; a short sleep keeps both workers asking for work
        (tmp_path / name).write_text(
            "import os, time\n"
            + "".join(f"def test_{i}():\n    time.sleep(0.2)\n"
                      f"    with open(os.environ['OUT'], 'a') as f:\n"
                      f"        f.write(f\"{name} {{os.environ['PYTEST_XDIST_WORKER']}}\\n\")\n"
                      for i in range(3)))
    out = tmp_path / "ran.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OUT=str(out))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "-q", "-n", "2", "--dist", "loadfile", "--rootdir", str(tmp_path), "tests"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ran: dict[str, set[str]] = {}
    for line in out.read_text().splitlines():
        name, worker = line.split()
        ran.setdefault(name, set()).add(worker)
    assert sorted(ran) == sorted(files) and all(len(w) == 1 for w in ran.values()), ran  # a file on one worker
    for member, unit in SHARED_UNITS.items():
        assert ran[member] == ran[unit], (member, unit, ran)
    assert len(set().union(*ran.values())) == 2, ran  # the other files still spread over both
    assert Path(REPO / unit).is_file() and Path(REPO / member).is_file()


def test_each_workers_launcher_servers_bind_a_core_of_their_own(monkeypatch):
    """tests/_server.py worker_cpu_bind: worker N's launcher servers bind the Nth core this process
    may use; nothing outside a worker, at TP > 1 or where the variable is set; and the launcher
    keeps the binding it is given (at TP = 2 it sets its own per-rank groups)."""
    from qpn.scripts.launcher.engine_profiles import CPU
    from qpn.scripts.launcher.serve import server_env
    from tests._server import worker_cpu_bind
    from tests.test_launcher_units import _launch

    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert worker_cpu_bind() == {}
    for n in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        assert worker_cpu_bind() == {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[n % len(cpus)])}
        assert worker_cpu_bind(tp=2) == {}
    bound = worker_cpu_bind()
    assert server_env(_launch(CPU, tp=1, environ=bound))["VLLM_CPU_OMP_THREADS_BIND"] == bound["VLLM_CPU_OMP_THREADS_BIND"]
    if len(cpus) >= 2:
        assert server_env(_launch(CPU, tp=2, environ={}))["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the user's choice stays theirs
    assert worker_cpu_bind() == {}
