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
    from qpn.fork_patches.route_census.census import Census

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


# ---- the root error is the failing process's first error, never a WARNING (issue 40 item 7) ----

# What every cpu-engine server log holds before anything fails, where the open-files limit cannot
# be raised (vLLM's set_ulimit): a WARNING that names an OSError, and the engine's own warnings.
WARNINGS = """\
/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py:24: DeprecationWarning: `vllm.entrypoints.openai.api_server` is deprecated and will likely beunsupported in a future version.
  warnings.warn(
W1206 01:27:58.587000 6281 .venv-cpu/lib/python3.11/site-packages/torch/_library/triton.py:53] Triton not available, find_triton_kernels = []
(APIServer pid=6281) WARNING 12-06 01:27:58 [system_utils.py:255] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(APIServer pid=6281) WARNING 12-06 01:28:14 [vllm.py:725] Model Runner V2 requires Triton; using the V1 model runner instead.
(Worker pid=6770) WARNING 12-06 01:28:27 [cpu_worker.py:130] Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant performance loss.
(Worker pid=6770) WARNING 12-06 01:28:27 [utils.py:333] Attempted to load weight layers.3.self_attn.attn.k_scale with dtype torch.float32 into parameter with dtype torch.bfloat16
(EngineCore pid=6642) INFO 12-06 01:28:32 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/ckpt'
(EngineCore pid=6642) WARNING 12-06 01:28:33 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
INFO:     Started server process [6281]
INFO:     127.0.0.1:43530 - "POST /v1/chat/completions HTTP/1.1" 200 OK
INFO:     127.0.0.1:43544 - "GET /health HTTP/1.1" 200 OK
"""

# The API process's lines once the engine core is gone (vLLM 0.32.0, as a SIGKILLed core left them).
API_AFTER_DEATH = """\
(APIServer pid=6281) WARNING 12-06 01:28:35 [core_client.py:817] [shutdown] MPClient: engine core exited unexpectedly; starting cleanup
(APIServer pid=6281) INFO 12-06 01:28:35 [core_client.py:777] [shutdown] MPClient: complete
(APIServer pid=6281) ERROR 12-06 01:28:35 [async_llm.py:906] AsyncLLM output_handler failed.
(APIServer pid=6281) ERROR 12-06 01:28:35 [async_llm.py:906] Traceback (most recent call last):
(APIServer pid=6281) ERROR 12-06 01:28:35 [async_llm.py:906]   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/async_llm.py", line 849, in output_handler
(APIServer pid=6281) ERROR 12-06 01:28:35 [async_llm.py:906]     outputs = await engine_core.get_output_async()
(APIServer pid=6281) ERROR 12-06 01:28:35 [async_llm.py:906]     raise self._format_exception(outputs) from None
(APIServer pid=6281) ERROR 12-06 01:28:35 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
INFO:     127.0.0.1:45618 - "GET /health HTTP/1.1" 503 Service Unavailable
(APIServer pid=6281) INFO 12-06 01:28:37 [launcher.py:254] [shutdown] API server: shutdown triggered
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown
"""

FATAL = """\
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512] Traceback (most recent call last):
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512]   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1503, in run_engine_core
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512]     engine_core.run_busy_loop()
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512]   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1544, in run_busy_loop
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512]     self._process_engine_step()
(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512] RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate 17179869184 bytes.
"""

WORKER_KILLED = """\
(EngineCore pid=6642) ERROR 12-06 01:31:10 [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.
(EngineCore pid=6642) ERROR 12-06 01:31:10 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=6642) ERROR 12-06 01:31:10 [core.py:1512] Traceback (most recent call last):
(EngineCore pid=6642) ERROR 12-06 01:31:10 [core.py:1512]   File "/venv/lib/python3.11/site-packages/vllm/v1/executor/multiproc_executor.py", line 399, in collective_rpc
(EngineCore pid=6642) ERROR 12-06 01:31:10 [core.py:1512]     raise RuntimeError("Executor failed.")
(EngineCore pid=6642) ERROR 12-06 01:31:10 [core.py:1512] RuntimeError: Executor failed.
"""

# An engine core that died of an exception it printed itself (no log level), chained
PRINTED = """\
(EngineCore pid=6642) Process EngineCore:
(EngineCore pid=6642) Traceback (most recent call last):
(EngineCore pid=6642)   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1503, in run_engine_core
(EngineCore pid=6642)     engine_core.run_busy_loop()
(EngineCore pid=6642) torch.OutOfMemoryError: CPU out of memory while allocating the KV cache
(EngineCore pid=6642)
(EngineCore pid=6642) During handling of the above exception, another exception occurred:
(EngineCore pid=6642)
(EngineCore pid=6642) Traceback (most recent call last):
(EngineCore pid=6642)   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1520, in run_engine_core
(EngineCore pid=6642) RuntimeError: cleanup after the failure failed too
"""


def _no_warning(cause: str | None) -> None:
    assert cause is None or ("WARNING" not in cause and "ulimit" not in cause
                             and "Warning:" not in cause), cause


def test_a_killed_engine_core_is_named_not_the_ulimit_warning():
    cause, errors = serve.failure_summary(WARNINGS + API_AFTER_DEATH)
    _no_warning(cause)
    assert cause == ("(EngineCore pid=6642) logged no error before it died: killed by a signal "
                     "(SIGKILL from outside, or the kernel's out-of-memory killer: dmesg tells "
                     "which)"), cause
    assert "ulimit" not in errors and "EngineDeadError" in errors


@pytest.mark.parametrize("crash,root", [
    (FATAL, "(EngineCore pid=6642) ERROR 12-06 01:30:02 [core.py:1512] RuntimeError: [enforce fail "
            "at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
            "allocate 17179869184 bytes."),
    (WORKER_KILLED, "(EngineCore pid=6642) ERROR 12-06 01:31:10 [multiproc_executor.py:316] Worker "
                    "proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."),
    (PRINTED, "(EngineCore pid=6642) torch.OutOfMemoryError: CPU out of memory while allocating "
              "the KV cache"),
], ids=["fatal-error", "worker-killed", "printed-chained"])
def test_the_root_error_is_the_failing_engines_first_error(crash, root):
    cause, errors = serve.failure_summary(WARNINGS + crash + API_AFTER_DEATH)
    assert cause == root
    assert "ulimit" not in errors and "Model Runner V2" not in errors


def test_a_survived_engine_error_is_not_the_root_of_a_later_silent_death():
    cause, _ = serve.failure_summary(WARNINGS + SURVIVED + API_AFTER_DEATH)
    assert cause.startswith("(EngineCore pid=9371) logged no error before it died"), cause


def test_warnings_alone_name_no_root_error():
    cause, errors = serve.failure_summary(WARNINGS + "INFO:     Shutting down\n")
    assert cause is None and errors == "", (cause, errors)
