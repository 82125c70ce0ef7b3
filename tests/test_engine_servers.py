"""The rule of issue 41 item 8, at most one idle engine server per test process, and its check
(tests/_engine_servers.py, run by tests/conftest.py after every test): stand-in servers (a
sleeping Python whose command line names vLLM's API server module, as the real one's does) are
counted idle or in use the way real ones are, and a test module that leaves two idle fails. Also
the sharing of the MTP servers (tests/_mtp_servers.py) on a stand-in server."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests._ci import REPO
from tests._engine_servers import check_one_idle_at_most, engine_servers, idle_engine_servers

pytestmark = pytest.mark.fast

# what the real command line holds: ... -m vllm.entrypoints.openai.api_server --model ...
STAND_IN = [sys.executable, "-c", "import time; time.sleep(120)", "-m", "vllm.entrypoints.openai.api_server"]


class StandIn:
    """A stand-in server: what VllmServer and LaunchedServer expose to the check (``proc``)."""

    def __init__(self, launcher: bool = False):
        # launcher=True: the server is a grandchild, below a shell, as the launcher starts it
        # (the shell's own command line must not name the module: $S holds its last word)
        cmd = ["bash", "-c", '"$0" -c "import time; time.sleep(120)" -m vllm.entrypoints.openai.api_$S & wait',
               sys.executable] if launcher else STAND_IN
        self.proc = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, S="server"))

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(timeout=30)


@pytest.fixture
def stand_ins():
    made: list[StandIn] = []

    def make(launcher: bool = False) -> StandIn:
        made.append(StandIn(launcher))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def _wait_servers(n: int) -> list[int]:
    import time

    deadline = time.monotonic() + 20
    while len(pids := engine_servers()) != n and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def test_two_idle_servers_fail_the_check_and_one_passes(stand_ins):
    assert engine_servers() == []  # the check itself ran after every test before this one
    a, b = stand_ins(), stand_ins()
    assert _wait_servers(2) == sorted([a.proc.pid, b.proc.pid])
    with pytest.raises(AssertionError, match="2 idle engine servers"):
        check_one_idle_at_most([], "here")
    # in use: a fixture value holds it, as itself, in a dict or in a tuple
    for used in (a, {"server": a, "ckpt": "x"}, (3, a)):
        assert idle_engine_servers([used]) == [b.proc.pid]
        check_one_idle_at_most([used, "other value"], "here")
    b.stop()
    assert _wait_servers(1) == [a.proc.pid]
    check_one_idle_at_most([], "here")  # one idle is allowed


def test_a_server_below_a_launcher_is_in_use_by_the_launchers_holder(stand_ins):
    launched, idle = stand_ins(launcher=True), stand_ins()
    pids = _wait_servers(2)
    server = next(p for p in pids if p != idle.proc.pid)
    assert server != launched.proc.pid  # the server is the shell's child, not the process held
    assert idle_engine_servers([launched]) == [idle.proc.pid]
    assert sorted(idle_engine_servers([])) == sorted(pids)
    other = stand_ins()
    _wait_servers(3)
    with pytest.raises(AssertionError, match="2 idle engine servers"):
        check_one_idle_at_most([launched], "here")
    check_one_idle_at_most([launched, other], "here")


def test_an_exited_server_is_not_counted(stand_ins):
    a, b = stand_ins(), stand_ins()
    _wait_servers(2)
    b.stop()
    a.stop()
    assert _wait_servers(0) == []
    check_one_idle_at_most([], "here")


def test_conftest_fails_a_test_that_leaves_two_servers_idle(tmp_path):
    """The check as tests/conftest.py runs it: a module whose fixtures keep two servers up fails at
    the teardown of a test that uses neither, and passes the tests that use one or both; with one
    server idle the module passes."""
    (tmp_path / "test_seeded.py").write_text(textwrap.dedent(f'''
        import os, subprocess, time, pytest
        from tests._engine_servers import engine_servers

        def _start(n):
            proc = subprocess.Popen({STAND_IN!r}, start_new_session=True)
            while len(engine_servers()) < n:
                time.sleep(0.05)
            return proc

        class Server:
            def __init__(self, n):
                self.proc = _start(n)

        @pytest.fixture(scope="module")
        def server_a():
            s = Server(1)
            yield s
            os.killpg(s.proc.pid, 9)
            s.proc.wait()

        @pytest.fixture(scope="module")
        def server_b(server_a):
            s = Server(2) if os.environ["N_SERVERS"] == "2" else None
            yield s
            if s:
                os.killpg(s.proc.pid, 9)
                s.proc.wait()

        def test_uses_both(server_a, server_b):
            pass

        def test_uses_a(server_a):
            pass

        def test_uses_none():
            pass
    '''))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    runs = {}
    for n in ("2", "1"):
        env["N_SERVERS"] = n
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                            "-p", "no:xdist", "-q", "-rA", "--rootdir", str(tmp_path), "test_seeded.py"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        runs[n] = r.stdout + r.stderr
    two, one = runs["2"], runs["1"]
    assert "3 passed, 1 error" in two, two
    assert "ERROR at teardown of test_uses_none" in two, two
    assert "2 idle engine servers alive in this test process after test_seeded.py::test_uses_none" in two, two
    assert "3 passed" in one and "error" not in one.lower(), one


def test_mtp_batteries_share_one_boot_per_depth_in_order_and_keep_their_errors(monkeypatch, tmp_path):
    """tests/_mtp_servers.py on a stand-in server: one boot per (checkpoint, K) runs every pending
    battery, the ``first`` one first; each battery's error reaches its own tests only; a file
    without selected tests gets no battery run; a failed boot is every pending battery's error."""
    from tests import _mtp_servers as mtp

    boots = []

    class StandInServer:
        def __init__(self, model_dir, extra_args, **kw):
            self.args, self.kw, self.seen, self.stopped = extra_args, kw, [], False
            boots.append(self)
            if "broken" in model_dir:
                raise RuntimeError("vLLM server exited during boot")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stopped = True

    for name, value in (("VllmServer", StandInServer), ("_BATTERIES", []), ("_DONE", {}), ("_SELECTED", None)):
        monkeypatch.setattr(mtp, name, value)

    def battery(tag, fail=False):
        def run(server, k):
            server.seen.append(tag)
            if fail:
                raise ValueError(f"{tag} broke")
            return tag, k
        return run

    a, b, c = (str(tmp_path / f"test_{x}.py") for x in "abc")
    mtp.register("second", battery("second"), b)
    mtp.register("first", battery("first"), a, first=True)
    mtp.register("broken", battery("broken", fail=True), c)
    mtp.register("first", battery("again"), a)  # a module imported twice registers once
    assert mtp.results("/ckpt", 3, "second") == ("second", 3)
    assert [s.seen for s in boots] == [["first", "second", "broken"]] and boots[0].stopped
    assert boots[0].kw["max_num_seqs"] == 1 and '"num_speculative_tokens": 3' in " ".join(boots[0].args)
    assert mtp.results("/ckpt", 3, "first") == ("first", 3) and len(boots) == 1  # no second boot
    with pytest.raises(ValueError, match="broken broke"):
        mtp.results("/ckpt", 3, "broken")
    mtp.select([b])  # only the second battery's file has selected tests
    assert mtp.results("/ckpt", 0, "second") == ("second", 0)
    assert boots[1].seen == ["second"] and "--speculative-config" not in boots[1].args
    mtp.select([a, b, c])
    with pytest.raises(RuntimeError, match="exited during boot"):
        mtp.results("/broken-ckpt", 1, "first")
    with pytest.raises(RuntimeError, match="exited during boot"):
        mtp.results("/broken-ckpt", 1, "second")
    assert len(boots) == 3  # the failed boot is not retried per battery
