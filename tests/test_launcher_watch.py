"""The launcher after READY and during the boot (issue 12 items 2 and 4), without an engine: the
health watch against a stand-in HTTP server, the failure summary of a real crash log's shape, and
the boot phases read from a server log. The same code against a real server:
tests/test_launcher_api.py."""
from __future__ import annotations

import http.server
import os
import threading
import types

import pytest

from qpn.scripts.launcher import serve

pytestmark = pytest.mark.fast

# The shape of the server log the GDN crash left (issue 12): a tool parser's harmless error first,
# then the worker's exception, the engine core's, and the API process's EngineDeadError.
CRASH_LOG = """\
(APIServer pid=9023) ERROR 11-30 15:35:32 [hermes_tool_parser.py:117] Error in extracting tool call from response.
(APIServer pid=9023) ERROR 11-30 15:35:32 [hermes_tool_parser.py:117] json.decoder.JSONDecodeError: Unterminated string starting at: line 2 column 25 (char 25)
(Worker pid=9516) ERROR 11-30 15:35:53 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=9516) ERROR 11-30 15:35:53 [multiproc_executor.py:1063] RuntimeError: The size of tensor a (6) must match the size of tensor b (5) at non-singleton dimension 1
(EngineCore pid=9371) ERROR 11-30 15:35:53 [core.py:1512] RuntimeError: Worker failed with error 'The size of tensor a (6) must match the size of tensor b (5) at non-singleton dimension 1', please check the stack trace above for the root cause
(APIServer pid=9023) ERROR 11-30 15:35:53 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
(APIServer pid=9023) INFO:     127.0.0.1:41054 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error
"""


def test_failure_summary_names_the_engine_error_not_the_parser_or_the_api():
    cause, errors = serve.failure_summary(CRASH_LOG)
    assert cause.endswith("RuntimeError: The size of tensor a (6) must match the size of tensor b "
                          "(5) at non-singleton dimension 1")
    assert cause.startswith("(Worker")
    assert "EngineDeadError" in errors and "Traceback" in errors
    assert len(errors.splitlines()) <= 12


def test_failure_summary_without_engine_lines():
    cause, errors = serve.failure_summary("INFO fine\nValueError: bad config\nINFO more\n")
    assert cause == "ValueError: bad config" and "bad config" in errors
    assert serve.failure_summary("") == (None, "")


class _Health(http.server.BaseHTTPRequestHandler):
    statuses: list[int] = []

    def do_GET(self):  # noqa: N802
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        self.send_response(status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def _fake_server(port: int, alive=lambda: True, rc=0):
    launch = types.SimpleNamespace(root_url=f"http://127.0.0.1:{port}", api_key=None)
    return types.SimpleNamespace(launch=launch, alive=alive, proc=types.SimpleNamespace(returncode=rc))


def test_watch_returns_when_health_says_the_engine_is_dead(health_server):
    _Health.statuses = [200, 200, 503]
    reason = serve.watch_engine(_fake_server(health_server.server_port), period_s=0.01)
    assert reason == "the engine core is dead: /health answered 503"


def test_watch_reports_a_server_that_exits_on_its_own(health_server):
    _Health.statuses = [200]
    calls = iter([True, True, False])
    reason = serve.watch_engine(_fake_server(health_server.server_port, alive=lambda: next(calls)),
                                period_s=0.01)
    assert "exited on its own (exit 0)" in reason and "nobody asked it to stop" in reason


def test_watch_gives_up_on_a_silent_server():
    reason = serve.watch_engine(_fake_server(1), period_s=0.01, silence_s=0.05)
    assert reason.startswith("/health has not answered for")


def test_boot_progress_phases_from_the_log(tmp_path):
    log = tmp_path / "server.log"
    launch = types.SimpleNamespace(server_log=str(log), census_dir=str(tmp_path / "census"))
    progress = serve.BootProgress(launch, period_s=0.0)
    assert progress.line().endswith("starting the server process")
    log.write_text("(EngineCore pid=1) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0)\n"
                   "(Worker pid=2) INFO [cpu_model_runner.py:68] Starting to load model /x...\n")
    assert progress.line().endswith("loading weights")
    with open(log, "a") as f:
        f.write("(Worker pid=2) INFO [default_loader.py:501] Loading weights took 0.09 seconds\n"
                "(Worker pid=2) INFO partial line without newline: Starting vLLM server on")
    assert "weights loaded; prepacking" in progress.line()  # a partial line waits for its end
    with open(log, "a") as f:
        f.write(" http://127.0.0.1:1\n")
    assert progress.line().endswith("API server starting")


def test_boot_progress_launcher_phase_is_not_overwritten_by_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO [entry.py:140] Starting vLLM server on http://x\n")
    launch = types.SimpleNamespace(server_log=str(log), census_dir=str(tmp_path / "census"))
    progress = serve.BootProgress(launch, period_s=0.0)
    assert progress.line("warm request (one greedy chat, 8 tokens)").endswith("warm request (one greedy chat, 8 tokens)")
    assert progress.line().endswith("API server starting")


def test_boot_progress_counts_prepacked_modules_from_the_census(tmp_path):
    """The progress line's prepack count comes from the census files the overlay writes (read with
    the census reader, so a schema change shows up here), and only proven modules count as verified."""
    from qpn.fork_patches.census import Census

    census_dir = tmp_path / "census"
    launch = types.SimpleNamespace(server_log=str(tmp_path / "server.log"), census_dir=str(census_dir))
    progress = serve.BootProgress(launch, period_s=0.0)
    assert progress.prepack() is None  # nothing written yet
    c = Census()
    c.rank, c.directory = 0, str(census_dir)
    layers = [object(), object(), object()]
    for i, layer in enumerate(layers):
        c.register_module(layer, f"model.layers.{i}.mlp.down_proj", "nvfp4", 64, 128,
                          prepack_verified=(i != 1))
    c.flush()
    assert progress.prepack() == "prepack: 3 modules over 1 rank(s), 2 verified by the inverse check"


# An error the engine core survived, earlier in the same log: a request's failure, then the engine's
# ordinary lines, then the crash.
SURVIVED = """\
(EngineCore pid=9371) ERROR 11-30 15:30:01 [core.py:900] Traceback (most recent call last):
(EngineCore pid=9371) ERROR 11-30 15:30:01 [core.py:900] RecursionError: maximum recursion depth exceeded
(EngineCore pid=9371) INFO 11-30 15:30:11 [loggers.py:259] Engine 000: Avg prompt throughput: 2.0 tokens/s
"""


@pytest.mark.parametrize("before", ["", SURVIVED, SURVIVED + SURVIVED])
def test_the_root_error_is_the_crash_not_an_error_the_engine_survived(before):
    cause, _ = serve.failure_summary(before + CRASH_LOG)
    assert cause.startswith("(Worker") and cause.endswith("at non-singleton dimension 1"), cause


def test_an_engine_error_without_a_later_crash_is_still_named():
    cause, _ = serve.failure_summary(SURVIVED)
    assert cause.endswith("RecursionError: maximum recursion depth exceeded"), cause
