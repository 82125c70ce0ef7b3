"""Start a real vLLM OpenAI server on the CPU engine for tests, and stop it without leftovers.

The server runs ``$QPN_ENGINE_PYTHON -m vllm.entrypoints.openai.api_server`` (default: the
python running the tests) on a random free loopback port, in its own session so that its
engine-core children can be signalled as one group. Caches (vLLM, torch inductor, ZMQ
sockets via TMPDIR) go to a temporary folder removed on stop. ``stop()`` sends SIGTERM to
the group, waits, and escalates to SIGKILL only if something is still alive.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def engine_python() -> str:
    return os.environ.get("QPN_ENGINE_PYTHON", sys.executable)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model_dir: str, extra_args: list[str] | None = None,
                 served_model_name: str | None = None, boot_timeout_s: float = 240.0,
                 plugins: str | None = None):
        """``plugins``: None loads every installed vLLM plugin (ours included); a string sets
        VLLM_PLUGINS to that comma-separated list ("" loads none: raw vLLM)."""
        self.model_dir = model_dir
        self.extra_args = list(extra_args or [])
        self.served_model_name = served_model_name
        self.boot_timeout_s = boot_timeout_s
        self.plugins = plugins
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.mkdtemp(prefix="qpn_vllm_")
        self.log_path = os.path.join(self.tmp, "server.log")

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def start(self) -> "VllmServer":
        env = dict(os.environ)
        env.update(
            VLLM_CACHE_ROOT=os.path.join(self.tmp, "vllm_cache"),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(self.tmp, "inductor"),
            TMPDIR=self.tmp,
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        if self.plugins is not None:
            env["VLLM_PLUGINS"] = self.plugins
        cmd = [
            engine_python(), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "1",
            *(["--served-model-name", self.served_model_name] if self.served_model_name else []),
            *self.extra_args,
        ]
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.tmp)
        log.close()
        deadline = time.monotonic() + self.boot_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"vLLM server exited during boot (rc {self.proc.returncode});"
                                   f" log tail:\n{tail}")
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"vLLM server not ready after {self.boot_timeout_s:.0f} s; log tail:\n{tail}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def kill_hard(self) -> None:
        """SIGKILL the whole server group: simulates a crash mid-run."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=30)
            # children of the group (engine core) may outlive the API process briefly
            deadline = time.monotonic() + 15
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if self._group_alive():
                os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
