"""The tests' one harness for a real vLLM OpenAI server on the CPU engine, stopped without leftovers.

    server = VllmServer(model_dir, extra_args, served_model_name=..., census_dir=...)
    server.start()              # launch() + wait_ready(); or ``with VllmServer(...) as server:``
    server.post("/v1/completions", {...}); server.url("/v1/models"); server.log_text()
    server.stop()

The server runs ``$QPN_ENGINE_PYTHON -m vllm.entrypoints.openai.api_server`` (default: the python
running the tests) on a free loopback port, in its own session so that its engine-core children
can be signalled as one group. Every process it starts carries a unique environment tag
(``QPN_E2E_TAG``), so ``stop()`` can prove that nothing of this server is left, whatever its
parentage. Caches (vLLM, torch inductor, ZMQ sockets via TMPDIR) go to a temporary folder removed
on stop; the log is kept in memory so that ``log_text()`` still works after it.
``census_dir`` sets QPN_CENSUS_DIR for the route census; ``plugins`` sets VLLM_PLUGINS ("" loads
none: raw vLLM; None loads every installed plugin, ours included). Boot failures raise with the
log tail.

Two settings make every boot cheaper without changing what a test proves (measured on an idle
2-core host, the mixed checkpoint: 35 s to /v1/models before, 17 s after):

* The model in the engine-core process (``engine_worker_process=False``, the default). For one
  rank the cpu engine otherwise starts a third process, a worker, only to pin its OpenMP threads
  (vllm/platforms/cpu.py turns the "uni" executor into "mp" unless
  VLLM_ENABLE_V1_MULTIPROCESSING=0); that costs a full interpreter and vLLM import (~8 s idle)
  and pins every test server's worker to core 0, so two servers side by side share one core.
  With the variable at 0 the API server still runs the engine core as its own process (the
  OpenAI server always does), and the model runs there with the "uni" executor: the layout vLLM
  uses for one rank on a GPU, i.e. on the V100. The worker-process layout stays covered where
  it matters: tensor parallel (``--tensor-parallel-size`` > 1 always gets workers) and every
  server the launcher starts (tests/test_launcher_*.py), whose engine-core health watch and
  gates run on the layout users get.
* vLLM's model-class inspection cached across the servers of one test process. Resolving the
  architecture otherwise runs a subprocess that imports vLLM and the model module (~8 s idle);
  vLLM caches the answer under $VLLM_CACHE_ROOT/modelinfos keyed by the model file's hash. Each
  server keeps its own cache root; only that ``modelinfos`` folder is shared (a symlink to one
  folder per test process, removed at exit).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

from qpn.scripts.launcher.launched import group_alive

TAG_ENV = "QPN_E2E_TAG"


_MODELINFOS: str | None = None


def shared_modelinfos() -> str:
    """One folder per test process for vLLM's cached model-class inspection (see the module doc)."""
    global _MODELINFOS
    if _MODELINFOS is None:
        _MODELINFOS = tempfile.mkdtemp(prefix="qpn_vllm_modelinfos_")
        atexit.register(shutil.rmtree, _MODELINFOS, True)
    return _MODELINFOS


def engine_python() -> str:
    return os.environ.get("QPN_ENGINE_PYTHON", sys.executable)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_cpu_bind(tp: int = 1) -> dict[str, str]:
    """For a server the launcher starts from this pytest-xdist worker: the one core its engine's
    worker process binds its OpenMP threads to (``VLLM_CPU_OMP_THREADS_BIND``), worker N's the Nth
    core this process may use. The engine's own choice ("auto") is core 0 for every server on a
    2-core host, so two workers' launcher servers shared one core while the other waited: two
    tests/test_launcher_api.py runs side by side took 63 s each so, 46-52 s on cores 0 and 1. The
    launcher's layout is unchanged (it keeps a binding it is given, as it keeps a user's). Nothing
    outside a worker, at TP > 1 (the launcher gives each rank a core group) or where the variable
    is set already."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if tp > 1 or not worker.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[int(worker[2:]) % len(cpus)])}


def tagged_pids(tag: str) -> list[int]:
    """Processes (of any parentage) whose environment carries ``QPN_E2E_TAG=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


class VllmServer:
    def __init__(self, model_dir, extra_args: list[str] | tuple = (), served_model_name: str | None = None,
                 boot_timeout_s: float = 420.0, plugins: str | None = None, census_dir=None,
                 max_model_len: int = 2048, max_num_seqs: int | None = 1, env: dict[str, str] | None = None,
                 engine_worker_process: bool = False):
        self.model_dir = os.path.abspath(str(model_dir))
        self.extra_args = list(extra_args or [])
        self.served_model_name = served_model_name
        self.boot_timeout_s = boot_timeout_s
        self.plugins = plugins
        self.census_dir = None if census_dir is None else str(census_dir)
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.extra_env = dict(env or {})
        self.engine_worker_process = engine_worker_process
        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.mkdtemp(prefix="qpn_vllm_")
        self.log_path = os.path.join(self.tmp, "server.log")
        self._final_log: str | None = None

    # ---- addresses ------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def url(self, path: str = "") -> str:
        return self.root_url + path

    # ---- lifecycle ------------------------------------------------------------------------
    def launch(self) -> "VllmServer":
        """Start the process and return at once (``wait_ready()`` or ``wait_exit()`` next)."""
        env = dict(os.environ)
        cache_root = os.path.join(self.tmp, "vllm_cache")
        if not os.path.isdir(cache_root):  # launch() again (a restart) keeps the first link
            os.makedirs(cache_root)
            os.symlink(shared_modelinfos(), os.path.join(cache_root, "modelinfos"))
        if not self.engine_worker_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in the engine core: module doc
            # one OpenMP thread, as the worker process had (bound to one core): two servers side by
            # side on two cores never spin-wait on each other's threads
            env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            VLLM_CACHE_ROOT=cache_root,
            TORCHINDUCTOR_CACHE_DIR=os.path.join(self.tmp, "inductor"),
            TMPDIR=self.tmp,
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        )
        env[TAG_ENV] = self.tag
        if self.census_dir is not None:
            env["QPN_CENSUS_DIR"] = self.census_dir
        if self.plugins is not None:
            env["VLLM_PLUGINS"] = self.plugins
        env.update(self.extra_env)
        cmd = [engine_python(), "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model_dir, "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--max-model-len", str(self.max_model_len),
               *(["--max-num-seqs", str(self.max_num_seqs)] if self.max_num_seqs else []),
               *(["--served-model-name", self.served_model_name] if self.served_model_name else []),
               *self.extra_args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=self.tmp)
        return self

    def wait_ready(self) -> "VllmServer":
        """Until /v1/models answers; raises (server left running: call stop()) with the log tail."""
        deadline = time.monotonic() + self.boot_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited during boot (rc {self.proc.returncode}); "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server not ready after {self.boot_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def start(self) -> "VllmServer":
        """launch() + wait_ready(); on a failed boot the server is stopped before the error rises."""
        self.launch()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_exit(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=self.boot_timeout_s if timeout is None else timeout)

    def kill_hard(self) -> None:
        """SIGKILL the whole server group: simulates a crash mid-run."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def leftover(self) -> list[int]:
        """Processes of this server still alive (by tag, any parentage)."""
        return tagged_pids(self.tag)

    def stop(self) -> None:
        """SIGTERM the group, wait, SIGKILL only what is still alive; then nothing tagged remains."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=30)
            # children (engine core) may outlive the API process briefly, in the group or not
            deadline = time.monotonic() + 30
            while (group_alive(self.proc.pid) or tagged_pids(self.tag)) and time.monotonic() < deadline:
                time.sleep(0.3)
            if group_alive(self.proc.pid):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in tagged_pids(self.tag):  # stragglers of this server only
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._final_log is None and os.path.exists(self.log_path):
            self._final_log = self.log_text()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- talking to it --------------------------------------------------------------------
    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        """POST JSON to ``path`` ("/v1/completions"); an HTTP error fails with the server's answer."""
        req = urllib.request.Request(self.url(path), json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} -> HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e

    def log_text(self) -> str:
        if self._final_log is not None:
            return self._final_log
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return "(no log)"

    def log_tail(self, n: int = 60) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-n:])
