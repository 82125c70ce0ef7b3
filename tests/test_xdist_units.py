"""scripts/test.sh runs the suite on two pytest-xdist workers, one file per worker at a time
(--dist loadfile); tests/conftest.py's scheduler makes the files of one SHARED_UNITS entry one
unit, so that the servers they share (tests/_mtp_servers.py) meet on one worker. Checked on
stand-in files named as the shared ones, under the real conftest and the real scheduler."""
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
