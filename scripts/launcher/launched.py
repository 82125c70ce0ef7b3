"""Drive ``serve-qwen38-native.sh`` from Python: start it, wait for its READY line (or its exit),
stop it, and prove nothing of the server is left. Used by the demonstration and the tests, so
both go through exactly the launcher a user runs.

The launcher runs in its own session (so that signalling it never reaches the caller's group);
the server it starts runs in a session of its own, whose id the launcher prints
("server pid N"). After ``stop()`` that process group must be empty.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_SH = os.path.join(REPO_ROOT, "scripts", "serve-qwen38-native.sh")
_READY = re.compile(r"READY url=(\S+) model=(\S+) pid=(\d+) gates=(\S+)")
_SERVER_PID = re.compile(r"server pid (\d+);")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class LaunchedServer:
    def __init__(self, ckpt: str, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, echo: bool = False):
        self.ckpt = ckpt
        self.env = dict(os.environ if env is None else env)
        self.extra_args = list(extra_args or [])
        self.echo = echo  # copy the launcher's output to our stdout as it comes
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.server_pid: int | None = None
        self.url = self.model = self.gates_json = None
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if self.server_pid is None and (m := _SERVER_PID.search(line)):
                self.server_pid = int(m.group(1))
            if m := _READY.search(line):
                self.url, self.model, _, self.gates_json = m.groups()
                self._ready.set()
        self._ready.set()  # the launcher exited: wake the waiter

    def start(self, timeout: float = 900) -> "LaunchedServer":
        """Run the launcher; return once it reports READY. Raises RuntimeError (with its
        output) when it exits instead, which is what a refusal or a failed gate does."""
        self.proc = subprocess.Popen(
            ["bash", SERVE_SH, self.ckpt, *self.extra_args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=self.env,
            start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.url is None:
            if self.proc.poll() is None:
                self.stop()
            self.wait_exit(60)
            raise RuntimeError(f"launcher did not report READY (exit {self.proc.returncode}):\n"
                               f"{self.output}")
        return self

    def wait_exit(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        if self._reader is not None:
            self._reader.join(timeout=10)
        return rc

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM the launcher, which stops its server; returns the launcher's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.wait_exit(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.wait_exit(30)
        return rc

    def leftover(self) -> bool:
        """True when a process of the server's group (API server, engine core, workers) or of
        the launcher's own group is still alive."""
        groups = [self.proc.pid] + ([self.server_pid] if self.server_pid else [])
        return any(group_alive(g) for g in groups)

    def __enter__(self) -> "LaunchedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.stop()
