"""The MTP servers tests/test_spec_tool_calls.py and tests/test_sampled_serving.py both ask (issue 41
item 8): one cpu-engine server per depth K (0 = no speculation; 1, 3, 7) on the session's mixed
checkpoint (tests/conftest.py ``mixed_checkpoint``), with the launcher's speculative settings
(greedy drafter, the qwen3 reasoning parser, auto tool choice with the checkpoint's tool parser),
one sequence at a time. Both files used to boot the same eight servers, four each; now each K is
booted once per test process and every *battery* registered for it (a function that sends a file's
requests to the server and returns what its tests check) runs on that one boot, in order: the
tool-call battery first, since its failing request must be the first request a fresh server sees.
The server is stopped before ``results`` returns, so no server is left idle.

A battery's error (and a failed boot) is kept and raised to the tests of the file that registered
the battery, not to the other file's. A battery whose file has no selected test (``-k``, ``-m``:
tests/conftest.py tells ``select``) is not run. tests/conftest.py (SHARED_UNITS) keeps both files
on one pytest-xdist worker, so the batteries meet on one server. tests/test_engine_servers.py
checks these rules on a stand-in server.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from tests._server import VllmServer

SERVED_NAME = "ckpt"

# (rank, name, battery, test file): batteries run in rank order, then registration order
_BATTERIES: list[tuple[int, str, Callable[[VllmServer, int], Any], str]] = []
# the test files with selected tests (None: every registered battery runs)
_SELECTED: set[str] | None = None
# (checkpoint, K) -> battery name -> (ok, results or the exception)
_DONE: dict[tuple[str, int], dict[str, tuple[bool, Any]]] = {}


def server_args(ckpt: str, k: int) -> list[str]:
    from qpn.scripts.launcher.serve import tool_parser_for

    args = ["--no-enable-prefix-caching", "--reasoning-parser", "qwen3",
            "--enable-auto-tool-choice", "--tool-call-parser", tool_parser_for(ckpt) or "hermes"]
    if k:
        args += ["--speculative-config", json.dumps(
            {"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": "greedy"})]
    return args


def register(name: str, battery: Callable[[VllmServer, int], Any], path: str, first: bool = False) -> None:
    """Run ``battery(server, k)`` on every MTP server booted from now on, for the tests of the file
    ``path`` (a test module registers its battery when it is imported, at collection); ``first``:
    before every other battery."""
    if all(n != name for _, n, _, _ in _BATTERIES):
        _BATTERIES.append((0 if first else 1, name, battery, os.path.abspath(path)))


def select(paths) -> None:
    """The test files with selected tests (tests/conftest.py, once collection is done)."""
    global _SELECTED
    _SELECTED = {os.path.abspath(str(p)) for p in paths}


def results(ckpt, k: int, name: str) -> Any:
    """What battery ``name`` returned on the K=``k`` server of ``ckpt``; the server is booted (and
    every registered battery run on it) on the first call for that K."""
    done = _DONE.setdefault((str(ckpt), k), {})
    if name not in done:
        pending = [(n, b) for _, n, b, path in sorted(_BATTERIES, key=lambda e: e[0])
                   if n not in done and (n == name or _SELECTED is None or path in _SELECTED)]
        assert any(n == name for n, _ in pending), f"no battery {name!r} registered"
        try:
            with VllmServer(str(ckpt), extra_args=server_args(str(ckpt), k), served_model_name=SERVED_NAME,
                            boot_timeout_s=900, max_num_seqs=1) as server:
                for n, battery in pending:
                    try:
                        done[n] = (True, battery(server, k))
                    except Exception as exc:  # kept for that battery's own tests
                        done[n] = (False, exc)
        except Exception as exc:  # the boot (or the stop) failed: every battery not run says so
            for n, _ in pending:
                done.setdefault(n, (False, exc))
    ok, value = done[name]
    if not ok:
        raise value
    return value
