"""What a result was measured on: endpoint, model, engine, hardware, K, MML, commit, command, date.

Each field says where it came from (the server, this host, or the command line), so that a
reader can tell a measured fact from a declared one. Hardware is only read from this host
when the endpoint is local; a remote endpoint's hardware must be given (``--hardware``).
A server on this host with no NVIDIA GPU is a CPU server, and its figures are labelled so.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import ipaddress
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
from urllib.parse import urlparse

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_local_endpoint(base_url: str) -> bool:
    host = urlparse(base_url).hostname or ""
    if host in ("localhost", "0.0.0.0", "::", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host) in {"127.0.0.1"} | set(_own_addresses())
    except OSError:
        return False


def _own_addresses() -> list[str]:
    try:
        return socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return []


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def local_gpus() -> list[str]:
    """NVIDIA GPUs of this host as 'name, memory' strings; [] when none or no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def listening_pid(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port`` (Linux /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, state, inode = parts[1], parts[3], parts[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return int(pid)
        except OSError:
            continue
    return None


def process_has_cuda_torch(pid: int) -> bool | None:
    """Whether the process has a CUDA build of torch loaded (libtorch_cuda in its memory
    map); None when the map cannot be read."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch_cuda" in line for line in f)
    except OSError:
        return None


def _cpu_text(extra: str = "") -> str:
    return (f"cpu: {cpu_model()}, {os.cpu_count()} logical cores ({extra}these are CPU "
            f"figures, not GPU performance)")


def hardware(base_url: str, given: str | None = None) -> tuple[str, str]:
    """(device class 'gpu'|'cpu'|'unknown', description)."""
    if given:
        device = "cpu" if given.lower().startswith("cpu") else "gpu"
        return device, f"{given} (given on the command line)"
    if not is_local_endpoint(base_url):
        return "unknown", "remote endpoint: hardware not read (pass --hardware)"
    gpus = local_gpus()
    if not gpus:
        return "cpu", _cpu_text("no NVIDIA GPU on the server host; ")
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g] = counts.get(g, 0) + 1
    desc = "; ".join(f"{n}x {g}" for g, n in counts.items())
    # GPUs on the host do not prove the server uses them: a CPU engine may serve beside them.
    port = urlparse(base_url).port or (443 if base_url.startswith("https") else 80)
    pid = listening_pid(port)
    cuda = process_has_cuda_torch(pid) if pid is not None else None
    if cuda is False:
        return "cpu", _cpu_text(f"the server process {pid} has no CUDA torch loaded although "
                                f"the host has {desc}; ")
    how = ("server process has CUDA torch loaded" if cuda else
           "server process not inspected; pass --hardware to state it")
    return "gpu", f"{desc} (nvidia-smi on the server host; {how})"


def checkpoint_revision(model_entry: dict, given: str | None = None) -> str:
    if given:
        return f"{given} (given on the command line)"
    root = model_entry.get("root") or model_entry.get("id") or ""
    m = re.search(r"snapshots/([0-9a-f]{40})", root)
    if m:
        return f"{m.group(1)} (hub snapshot folder)"
    cfg = os.path.join(root, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        return f"local folder {root}, config.json sha256 {digest}"
    return f"unknown for {root!r} (pass --revision)"


def git_commit() -> str:
    git = shutil.which("git")
    if git and os.path.isdir(os.path.join(_REPO_ROOT, ".git")):
        try:
            head = subprocess.run([git, "-C", _REPO_ROOT, "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
            dirty = subprocess.run([git, "-C", _REPO_ROOT, "status", "--porcelain", "-uno"],
                                   capture_output=True, text=True, timeout=10).stdout
            if head:
                if not dirty.strip():
                    return head
                paths = [line[3:] for line in dirty.splitlines() if line.strip()]
                shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
                return f"{head} (+ uncommitted changes to tracked files: {shown})"
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        from importlib.metadata import version

        return f"volta-qpn {version('volta-qpn')} (installed, no git checkout)"
    except Exception:
        return "unknown (no git checkout, volta-qpn not installed)"


def command_line() -> str:
    return shlex.join([os.path.basename(sys.executable), "-m",
                       _module_name(), *sys.argv[1:]])


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name else (sys.argv[0] or "?")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def depth_label(counters, metrics_known: bool, given: int | None) -> str:
    if counters is not None:
        k = counters.depth
        text = f"{k} (from /metrics position labels)"
        if given is not None and given != k:
            text += f"; --k {given} was given and DISAGREES"
        return text
    if metrics_known:
        return "0: speculation off (the server exposes no spec-decode counters)"
    return f"{given} (given; /metrics not read)" if given is not None else "unknown (/metrics not read)"
