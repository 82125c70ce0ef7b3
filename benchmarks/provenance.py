"""What a result was measured on: endpoint, model, engine, hardware, K, MML, commit (with a dirty
flag and the diff's sha256), command, GPU, driver, CUDA, torch, date.

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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


SOURCE_STATE_FILE = ".qpn_source_state.json"


def machine_boot() -> str:
    """This machine and boot: host name plus the kernel's boot id (host names alone can repeat:
    the GPU host's container answered the same name as ours)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def export_source_state(root: str = REPO_ROOT) -> str:
    """Write this checkout's source_state to <root>/.qpn_source_state.json, for a copy of the
    tree that travels without .git (the GPU host): source_state() there reads it back."""
    import json
    st = source_state(root)
    if st["commit"] is None:
        raise RuntimeError(f"cannot export the source state: {st.get('error')}")
    st.update(exported_at=now_iso(), exported_from=machine_boot())
    path = os.path.join(root, SOURCE_STATE_FILE)
    with open(path, "w") as f:
        json.dump(st, f, indent=1)
    return path


def source_state(root: str = REPO_ROOT) -> dict:
    """The source a result came from, read from git: {'commit', 'dirty', 'diff_sha256', 'changed'}.

    dirty: tracked files differ from HEAD (staged or not) or untracked, non-ignored files exist.
    diff_sha256: sha256 over ``git diff HEAD --binary`` and, per untracked file, its path and
    content, so two runs with the same commit and the same hash ran the same source; None when
    clean. commit is None outside a git checkout (then 'error' says why)."""
    git = shutil.which("git")
    exported = os.path.join(root, SOURCE_STATE_FILE)
    has_git = bool(git) and os.path.exists(os.path.join(root, ".git"))
    if os.path.isfile(exported):
        import json
        with open(exported) as f:
            st = json.load(f)
        # A copy of a checkout sent to another machine (a GPU host) may carry no .git, or a .git
        # whose HEAD is not the checkout's (seen on the device copies: the session's first
        # commit with today's tree as a diff); the state exported on the source machine is the
        # truth there. On the machine that exported it, git itself is asked.
        if not has_git or st.get("exported_from") != machine_boot():
            st["changed"] = list(st.get("changed", [])) + [
                f"(state exported by provenance.py at {st.pop('exported_at', '?')} from "
                f"{st.pop('exported_from', '?')}; this copy's own git state is not used)"]
            return st
    if not has_git:
        return {"commit": None, "dirty": None, "diff_sha256": None, "changed": [],
                "error": "not a git checkout (or git not installed)"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([git, "-C", root, *args], capture_output=True, timeout=60)
    try:
        head = run("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None, "diff_sha256": None, "changed": [],
                    "error": head.stderr.decode(errors="replace").strip()}
        diff = run("diff", "HEAD", "--binary").stdout
        changed = run("diff", "HEAD", "--name-only").stdout.decode().split()
        untracked = run("ls-files", "--others", "--exclude-standard", "-z").stdout.decode().split("\0")
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"commit": None, "dirty": None, "diff_sha256": None, "changed": [], "error": str(e)}
    untracked = sorted(u for u in untracked if u and u != SOURCE_STATE_FILE)
    h = hashlib.sha256(diff)
    for u in untracked:
        h.update(b"\0untracked\0" + u.encode() + b"\0")
        try:
            with open(os.path.join(root, u), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:
            h.update(b"(unreadable)")
    dirty = bool(diff) or bool(untracked)
    return {"commit": head.stdout.decode().strip(), "dirty": dirty,
            "diff_sha256": h.hexdigest() if dirty else None,
            "changed": changed + [f"{u} (untracked)" for u in untracked]}


def git_commit() -> str:
    """One line: the commit, and when the tree is not clean, the dirty flag, the diff's sha256
    and the changed files."""
    st = source_state()
    if st["commit"]:
        if not st["dirty"]:
            return st["commit"]
        paths = st["changed"]
        shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
        return f"{st['commit']} (dirty: diff sha256 {st['diff_sha256']}; changed: {shown})"
    try:
        from importlib.metadata import version

        return f"volta-qpn {version('volta-qpn')} (installed, no git checkout)"
    except Exception:
        return "unknown (no git checkout, volta-qpn not installed)"


# ---- commands that name no machine path (issue 41 item 7)
# A results file records the command that regenerates it, to be run from the repository root of a
# checkout at the recorded commit, on any machine. What differs between machines is written as a
# placeholder: the interpreter of the engine's virtualenv as $VENV/bin/python, the folder a run
# writes into as $OUT, a path inside the checkout relative to its root, and the inputs below by
# name. benchmarks/results_index.py renders older records through the same function, and
# tests/test_doc_references.py fails on any absolute path that is left.
VENV_PYTHON = "$VENV/bin/python"
OUT_DIR = "$OUT"
# output folders of earlier runs (the GPU host's $OUT), read as $OUT in a recorded command
KNOWN_OUT_DIRS = ("/root/out",)
# options (and QPN_*_REPORT settings) whose value is a file or folder the run writes; an option a
# module reads elsewhere (perf_model's --sweep is its input) is listed for its own module only
OUTPUT_FILE_OPTIONS = {"--out", "--targets", "--plot"}
MODULE_OUTPUT_OPTIONS = {"qpn.benchmarks.kernel_matched_bench": {"--sweep"}}
OUTPUT_DIR_OPTIONS = {"--out-dir", "--results-dir"}
# inputs that live outside the checkout, by the option that names them
INPUT_PLACEHOLDERS = {"--checkpoint": "$CHECKPOINT", "--seed-source": "$SEED_SOURCE",
                      "--onecat-source": "$ONECAT_SOURCE", "QPN_ENGINE_SOURCES": "$ENGINE_SOURCES"}
_PYTHON = re.compile(r"(?:^|/)python[0-9.]*$")
_ENV = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_IN_DIR = re.compile(r"\s+\(in ([^()]+)\)\s*$")


def _output_options(words: list[str]) -> set[str]:
    module = next((b for a, b in zip(words, words[1:]) if a == "-m"), "")
    return OUTPUT_FILE_OPTIONS | MODULE_OUTPUT_OPTIONS.get(module, set())


def _is_output_setting(name: str) -> bool:
    return name.startswith("QPN_") and name.endswith(("_REPORT", "_OUT"))


def _split(recorded: str) -> tuple[list[str], str | None]:
    """A recorded command's words, and the folder it ran in (exact_command's ``  (in <cwd>)``)."""
    cwd = None
    if m := _IN_DIR.search(recorded):
        cwd, recorded = m.group(1).strip(), recorded[:m.start()]
    try:
        return shlex.split(recorded), cwd
    except ValueError:
        return recorded.split(), cwd


def command_outputs(recorded: str) -> set[str]:
    """The names of the files a recorded command writes: the values of its output options and of its
    QPN_*_REPORT settings (not the inputs it reads)."""
    words, _ = _split(recorded)
    outputs, out, option, head = _output_options(words), set(), "", True
    for word in words:
        if head and (m := _ENV.match(word)):
            if _is_output_setting(m.group(1)):
                out.add(os.path.basename(m.group(2)))
            continue
        head = False
        key, value = word.split("=", 1) if word.startswith("--") and "=" in word else (option, word)
        if key in outputs:
            out.add(os.path.basename(value))
        option = word if word.startswith("--") and "=" not in word else ""
    return out


def _portable_path(value: str, option: str, roots: list[str], outs: list[str],
                   outputs: frozenset[str] | set[str] = frozenset()) -> str:
    """One recorded value, with what names this machine replaced (see the block above)."""
    if not value.startswith(("/", "~")):
        return value
    path = value.rstrip("/") or "/"
    if _PYTHON.search(path) and "/bin/" in path:
        return VENV_PYTHON
    for root in roots:  # the checkout itself: repository-relative
        if path == root:
            return "."
        if path.startswith(root + "/"):
            return path[len(root) + 1:]
    for out in outs:
        if path == out:
            return OUT_DIR
        if path.startswith(out + "/"):
            return f"{OUT_DIR}/{path[len(out) + 1:]}"
    if option in OUTPUT_DIR_OPTIONS:
        return OUT_DIR
    if option in outputs or _is_output_setting(option):
        return f"{OUT_DIR}/{os.path.basename(path)}"
    if option in INPUT_PLACEHOLDERS:
        return INPUT_PLACEHOLDERS[option]
    return value  # unknown: left as it is, and the evidence index's test names it


def _quote(word: str) -> str:
    """shlex.quote, but a leading placeholder ($OUT/x.csv) stays bare so that the shell expands it."""
    m = re.match(r"\$[A-Z_]+", word)
    if m is None:
        return shlex.quote(word)
    rest = word[m.end():]
    return m.group(0) + (shlex.quote(rest) if rest else "")


def portable_words(words: list[str], cwd: str | None = None, out: str | None = None) -> str:
    """``words`` (``KEY=value`` settings, the interpreter, its arguments) as a command line that names
    no path of this machine. ``cwd``: the folder it ran in (a checkout root: paths inside it become
    relative); ``out``: the folder it wrote into (becomes $OUT; the device host's $OUT is read from the
    environment)."""
    roots = [os.path.normpath(r) for r in (cwd, REPO_ROOT) if r and os.path.isabs(r)]
    outs = [os.path.normpath(o) for o in (out, os.environ.get("OUT"), *KNOWN_OUT_DIRS) if o and os.path.isabs(o)]
    outputs = _output_options(words)
    result: list[str] = []
    head = True  # KEY=value settings, then the interpreter
    option = ""
    for word in words:
        if head and (m := _ENV.match(word)):
            result.append(f"{m.group(1)}={_quote(_portable_path(m.group(2), m.group(1), roots, outs, outputs))}")
            continue
        if head:
            head = False
            if _PYTHON.search(word):
                result.append(VENV_PYTHON)
                continue
        if word.startswith("--") and "=" in word:
            opt, value = word.split("=", 1)
            result.append(f"{shlex.quote(opt)}={_quote(_portable_path(value, opt, roots, outs, outputs))}")
        else:
            result.append(_quote(_portable_path(word, option, roots, outs, outputs)))
        option = word if word.startswith("--") and "=" not in word else ""
    return " ".join(result)


def portable_command(recorded: str) -> str:
    """A command as an earlier results file recorded it (``exact_command``'s ``  (in <cwd>)`` suffix,
    absolute interpreter and output paths included) in the form ``portable_words`` writes now."""
    words, cwd = _split(recorded)
    return portable_words(words, cwd=cwd)


def command_line(module: str | None = None) -> str:
    """This process's command, ``$VENV/bin/python -m <module> <arguments>``, naming no machine path."""
    return portable_words([sys.executable, "-m", module or _module_name(), *sys.argv[1:]], cwd=os.getcwd())


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name else (sys.argv[0] or "?")


def exact_command() -> str:
    """The command as it ran: module or script, every argument, and the QPN_* / CUDA_VISIBLE_DEVICES
    settings that change what runs; machine paths as placeholders (``portable_words``), a working
    directory below the checkout root as ``(in <folder>)``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = [sys.executable, "-m", spec.name] if spec is not None and spec.name else [sys.executable, sys.argv[0]]
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("QPN_") or k == "CUDA_VISIBLE_DEVICES"]
    cwd = os.getcwd()
    root = next((r for r in (_checkout_root(cwd), REPO_ROOT) if r and (cwd == r or cwd.startswith(r + "/"))), None)
    text = portable_words(env + head + sys.argv[1:], cwd=root or cwd)
    if root and cwd != root:
        text += f"  (in {os.path.relpath(cwd, root)})"
    return text


def _checkout_root(path: str) -> str | None:
    """The nearest folder at or above ``path`` that holds a checkout (.git, or the exported source state)."""
    path = os.path.abspath(path)
    while True:
        if os.path.exists(os.path.join(path, ".git")) or os.path.isfile(os.path.join(path, SOURCE_STATE_FILE)):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def gpu_environment() -> dict:
    """GPU(s) as torch sees them, the driver (nvidia-smi), the CUDA runtime torch was built for,
    and torch's version. Fields say 'none' / 'unknown' rather than being left out."""
    out = {"gpu": "none (torch sees no CUDA device)", "driver": "unknown", "cuda": "unknown", "torch": "unknown"}
    try:
        import torch
    except ImportError:
        out["torch"] = "not installed"
        return out
    out["torch"] = torch.__version__
    out["cuda"] = f"{torch.version.cuda} (torch build)" if torch.version.cuda else "none (CPU build of torch)"
    if torch.cuda.is_available():
        names = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            names.append(f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory // 2**20} MiB)")
        out["gpu"] = "; ".join(names)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode == 0 and r.stdout.strip():
                out["driver"] = ", ".join(sorted(set(r.stdout.split())))
        except (OSError, subprocess.TimeoutExpired):
            pass
    elif out["gpu"].startswith("none"):
        out["driver"] = "none (no nvidia-smi)"
    return out


def run_record(**extra) -> dict:
    """Everything a results file must say about how it was made, written by code: commit, dirty
    flag, diff sha256, changed files, exact command, GPU, driver, CUDA, torch, host CPU, date
    (UTC), plus ``extra`` fields the caller adds. Benchmarks and numerics reports call this."""
    st = source_state()
    rec = {"commit": st["commit"] or git_commit(), "dirty": st["dirty"], "diff_sha256": st["diff_sha256"],
           "changed": ", ".join(st["changed"]) if st["changed"] else "", "command": exact_command()}
    rec.update(gpu_environment())
    rec.update({"host_cpu": f"{cpu_model()}, {os.cpu_count()} logical cores", "date": now_iso()})
    rec.update(extra)
    return rec


def markdown_block(rec: dict) -> list[str]:
    """Provenance as Markdown list lines, for the top of a report."""
    return ["Provenance (written by benchmarks/provenance.py, not by hand):", ""] + \
        [f"- {k}: {'' if v is None else v}" for k, v in rec.items()] + [""]


def comment_lines(rec: dict, prefix: str = "# ") -> list[str]:
    """Provenance as 'key: value' comment lines (e.g. at the top of a CSV file)."""
    return [f"{prefix}{k}: {'' if v is None else v}" for k, v in rec.items()]


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


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Provenance of this checkout.")
    ap.add_argument("--export-source-state", action="store_true",
                    help=f"write {SOURCE_STATE_FILE} (commit, dirty flag, diff sha256) at the repository root, "
                         "for a copy of the tree that runs where there is no .git")
    args = ap.parse_args()
    if args.export_source_state:
        print(export_source_state())
    else:
        import json
        print(json.dumps(run_record(), indent=1))
