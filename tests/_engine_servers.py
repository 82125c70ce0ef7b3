"""At most one idle engine server per test process (issue 41 item 8), enforced.

An *engine server* is a ``vllm.entrypoints.openai.api_server`` process descended from this test
process (pytest, or one xdist worker), whoever started it: tests/_server.py's VllmServer, the
launcher (qpn.scripts.launcher.launched.LaunchedServer), a script the test runs. A server is *in
use* by a test when one of the test's fixture values (``item.funcargs``, looked into dicts, lists
and tuples) holds the object that started it (anything with a ``proc`` that is a
``subprocess.Popen``: the server is that process or below it); every other live server is *idle*.
tests/conftest.py checks after every test, while its module's fixtures are still up, that at most
one server is idle, and fails the test otherwise (tests/test_engine_servers.py seeds both ways).
A module whose tests need several servers in turn gives each the scope of the tests that use it
(tests/test_e2e_loader.py); servers that two files boot alike are booted once for both
(tests/_mtp_servers.py).
"""
from __future__ import annotations

import os
import subprocess
from typing import Any, Iterable

ENGINE_SERVER = b"vllm.entrypoints.openai.api_server"


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, the last ')' ends it
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _descends(pid: int, root: int) -> bool:
    seen = 0
    while pid and pid > 1 and seen < 64:
        if pid == root:
            return True
        pid, seen = _parent(pid), seen + 1
        if pid is None:
            return False
    return False


def engine_servers(root: int | None = None) -> list[int]:
    """The engine-server processes alive below ``root`` (default: this process), oldest first."""
    root = os.getpid() if root is None else root
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        pid = int(entry)
        if ENGINE_SERVER in cmdline and pid != root and _descends(pid, root):
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state = f.read()
            except OSError:
                continue
            if state[state.rindex(b")") + 2:][:1] == b"Z":  # exited, not yet reaped: not alive
                continue
            found.append(pid)
    return sorted(found)


def server_roots(values: Iterable[Any], depth: int = 3) -> set[int]:
    """The pids of the processes that fixture ``values`` started servers with: every object with a
    ``proc`` that is a live-or-dead ``subprocess.Popen`` (VllmServer, LaunchedServer), looked for in
    dicts, lists and tuples ``depth`` levels down."""
    roots: set[int] = set()
    for value in values:
        proc = getattr(value, "proc", None) if not isinstance(value, (dict, list, tuple)) else None
        if isinstance(proc, subprocess.Popen):
            roots.add(proc.pid)
        elif depth and isinstance(value, dict):
            roots |= server_roots(value.values(), depth - 1)
        elif depth and isinstance(value, (list, tuple)):
            roots |= server_roots(value, depth - 1)
    return roots


def idle_engine_servers(used_values: Iterable[Any], root: int | None = None) -> list[int]:
    """The engine servers below ``root`` that no object in ``used_values`` started."""
    used = server_roots(used_values)
    return [pid for pid in engine_servers(root) if not any(_descends(pid, r) for r in used)]


def check_one_idle_at_most(used_values: Iterable[Any], where: str, root: int | None = None) -> None:
    """Fail (AssertionError naming them) when more than one engine server is idle."""
    idle = idle_engine_servers(used_values, root)
    if len(idle) > 1:
        lines = []
        for pid in idle:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    lines.append(f"  pid {pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:300])
            except OSError:
                lines.append(f"  pid {pid}: (gone)")
        raise AssertionError(f"{len(idle)} idle engine servers alive in this test process after {where} "
                             "(at most one may be: issue 41 item 8; give a server the scope of the tests "
                             "that use it):\n" + "\n".join(lines))
