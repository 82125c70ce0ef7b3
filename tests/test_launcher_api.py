"""The launcher as a user meets it (issue 12 items 2-4), on one real cpu-engine server started
through serve-qwen38-native.sh: boot progress and READY, the request limits, and, last, an
engine core killed after READY, which the launcher must report as a failure naming the error
(the engine core's own death, never the WARNING lines before it: issue 40 item 7).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from qpn.scripts.launcher.launched import LaunchedServer
from tests._server import free_port, worker_cpu_bind

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON")
MML = 2048
MAX_N = 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory, mixed_checkpoint):
    if not ENGINE_PYTHON:
        pytest.skip("QPN_ENGINE_PYTHON (the cpu engine's python) is not set")
    tmp = tmp_path_factory.mktemp("launcher-api")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOST", "PORT", "K", "MNS", "MML", "CAPTURE", "VLLM_API_KEY", "ENGINE",
                        "MAX_N")}
    env.update(QPN_ENGINE_PYTHON=ENGINE_PYTHON, K="1", MML=str(MML), MAX_N=str(MAX_N),
               RUN_DIR=str(tmp / "run"), VLLM_CACHE_ROOT=str(tmp / "vllm"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PORT=str(free_port()),  # not the default 8000: another file's server may be up
               **worker_cpu_bind())
    server = LaunchedServer(str(mixed_checkpoint), env=env)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_boot_progress_and_ready(launched):
    out = launched.output
    progress = re.findall(r"\[serve\] boot (\d+) s: ([^\n]+)", out)
    assert progress, out
    phases = " | ".join(p for _, p in progress)
    assert "warm request" in phases, phases
    # the phases come from the server log: at least one engine phase between start and warm-up
    assert re.search(r"engine core starting|loading weights|weights loaded|KV cache|API server",
                     phases), phases
    ready = re.search(r"READY url=(\S+) model=(\S+) pid=\d+ gates=(\S+) -- stop with Ctrl-C here, "
                      r"or kill -TERM (\d+)", out)
    assert ready, out
    assert int(ready.group(4)) == launched.proc.pid  # the pid it names is the launcher's
    assert os.path.isfile(ready.group(3))


@pytest.mark.parametrize("field,value", [("n", 50), ("n", 1000), ("best_of", 50),
                                         ("max_tokens", MML + 1),
                                         ("max_completion_tokens", 10 ** 6)])
def test_request_limits_refused_with_400(launched, field, value):
    request = {"model": launched.model, "max_tokens": 4,
               "messages": [{"role": "user", "content": "hi"}]}
    request[field] = value
    status, body = _post(launched.url, request)
    assert status == 400, body
    assert field in body["error"]["message"] and str(value) in body["error"]["message"], body


@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True},
     "max_tokens"),
    ("/completions", {"prompt": ["hi"] * 50, "n": 2}, "prompt"),
    ("/chat/completions/batch", {"messages": [[{"role": "user", "content": "hi"}]] * 40},
     "messages")])
def test_request_hygiene_refused_with_400_naming_the_field(launched, path, body, param):
    """Issue 40 items 5-6 on the real server: what vLLM served silently (an unknown role, a user
    message without content, max_tokens true, 50 prompts x n, 40 conversations) is a 400 naming
    the field."""
    req = urllib.request.Request(launched.url + path, data=json.dumps(
        {"model": launched.model, "max_tokens": 4, **body}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=300)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["param"] == param


def test_prompt_longer_than_the_model_refused_with_400(launched):
    status, body = _post(launched.url, {"model": launched.model, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "word " * 6000}]})
    assert status == 400, body
    assert "maximum context length" in json.dumps(body), body


def test_within_limits_served(launched):
    status, body = _post(launched.url, {"model": launched.model, "n": MAX_N, "max_tokens": 4,
                                        "temperature": 0.7,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert len(body["choices"]) == MAX_N


def _engine_core_pids(server_pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, pgid, args = line.strip().split(None, 2)
        if int(pgid) == server_pid and "EngineCore" in args:
            pids.append(int(pid))
    return pids


def test_engine_killed_after_ready_fails_the_launcher(launched):
    assert launched.server_pid is not None
    cores = _engine_core_pids(launched.server_pid)
    assert cores, "no VLLM::EngineCore process in the server's group"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    rc = launched.wait_exit(180)
    out = launched.output
    assert rc != 0, out
    assert "ENGINE FAILED after READY" in out, out
    assert re.search(r"engine core is dead|exited on its own", out), out
    # the root error is the failure, never a WARNING (vLLM's ulimit warning names an OSError):
    # the engine core, SIGKILLed, logged nothing, and the launcher says so, naming it
    root = re.search(r"^\[serve\] root error: (.*)$", out, re.M)
    assert root, out
    assert "WARNING" not in root.group(1) and "ulimit" not in root.group(1), root.group(1)
    assert re.fullmatch(rf"\(EngineCore pid=({'|'.join(map(str, cores))})\) logged no error before "
                        r"it died: killed by a signal .*", root.group(1)), root.group(1)
    assert "last error lines of" in out, out
    last = out.split("last error lines of", 1)[1].split("[serve] server stopped")[0]
    assert not re.search(r"\) WARNING \d\d-\d\d|ulimit", last), last  # the server log's warnings
    assert not launched.leftover(), out
