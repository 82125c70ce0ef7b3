"""The sm70 bootstrap itself, run on this CPU machine against a stand-in 1Cat-vLLM wheel.

The real 1Cat wheels cannot be fetched here, so the test builds one from a 1Cat source archive's
Python files: distribution ``1cat-vllm``, the archive's version, its own RECORD (the bytes pip
verifies and ``--restore`` checks against). Then: install (digest verified, version read back and
checked against the lock), overlay for engine ``sm70@<version>`` (its runtime anchors checked on
the imported 1Cat modules), ``--check``, ``--restore`` to RECORD, and a re-run.

What is stubbed, and why: the GPU preflight (a fake nvidia-smi with four V100s, as
tests/test_bootstrap.py does); the interpreter (the lock's sm70 Python 3.12 is replaced by the cpu
engine's 3.11, whose torch and dependencies the stand-in environment reuses through a .pth file
instead of reinstalling them); the Volta-only companions (tilelang, apache-tvm-ffi: no CPU build)
and the kernel build (proven by tests/test_kernel_build_cli.py). These come from a copy of the lock
(``QPN_ENGINES_LOCK``); everything else is the shipped sm70 profile.
"""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from qpn.fork_patches.engine import engine_lock
from qpn.fork_patches.engine.hooks import hooks_for
from qpn.fork_patches.engine.overlay import sha256_file
from tests.test_bootstrap import _fake_nvidia_smi
from tests.test_engine_source import _archive, _engine_site_packages

from tests._ci import REPO  # noqa: E402
BOOTSTRAP = REPO / "scripts" / "bootstrap-sm70.sh"
VERSION = engine_lock.default_version("sm70")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_standin_wheel(archive: Path, version: str, dest: Path) -> Path:
    """``1cat_vllm-<version>-py3-none-any.whl``: the archive's vllm/**/*.py, a _version.py as a
    built wheel carries, METADATA, WHEEL and RECORD (sha256 and size of every file)."""
    files: dict[str, bytes] = {}
    with tarfile.open(archive) as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and "vllm" in parts[:2] and m.name.endswith(".py"):
                files["/".join(parts[parts.index("vllm"):])] = tar.extractfile(m).read()
    files["vllm/_version.py"] = (f"__version__ = version = {version!r}\n__version_tuple__ = version_tuple = "
                                 f"{tuple(int(x) for x in version.split('.'))!r}\n").encode()
    info = f"1cat_vllm-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: 1cat-vllm\nVersion: {version}\n"
                                 "Summary: stand-in built by volta-qpn's tests from the 1Cat-vLLM source archive\n"
                                 "Requires-Python: >=3.10\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: volta-qpn-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{name},sha256={_b64(data)},{len(data)}\n" for name, data in sorted(files.items()))
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = dest / f"1cat_vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def _test_lock(dest: Path) -> Path:
    lock = tomllib.loads((REPO / "scripts" / "install" / "engines.lock.toml").read_text())
    sm70 = lock["engines"]["sm70"]
    sm70.update(python=f"{sys.version_info.major}.{sys.version_info.minor}", kernel_arch="",
                kernel_toolchain=[], import_checks=["vllm"])
    for table in sm70["versions"].values():
        table.update(companions=[], companions_conflict_expected=False)

    def toml(value) -> str:
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, list):
            return "[" + ", ".join(toml(v) for v in value) + "]"
        return str(value)

    lines = []
    for name, table in lock["engines"].items():
        lines.append(f"[engines.{name}]")
        lines += [f"{k} = {toml(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for ver, vt in table.get("versions", {}).items():
            lines.append(f'[engines.{name}.versions."{ver}"]')
            lines += [f"{k} = {toml(v)}" for k, v in vt.items()]
    path = dest / "engines.lock.toml"
    path.write_text("\n".join(lines) + "\n")
    assert engine_lock.profile("sm70", VERSION, tomllib.loads(path.read_text()))["sha256"] == \
        engine_lock.profile("sm70", VERSION)["sha256"]
    return path


@pytest.mark.engine
def test_sm70_bootstrap_on_a_standin_1cat_wheel(tmp_path):
    t0 = time.monotonic()
    deps = _engine_site_packages()
    if not (deps / "torch").is_dir():
        pytest.skip("the cpu engine (torch) is needed to import the stand-in")
    wheel = build_standin_wheel(_archive(VERSION), VERSION, tmp_path)
    digest = sha256_file(wheel)
    prefix = tmp_path / "venv-sm70"
    # No pip or setuptools of its own: those of the cpu engine come through the .pth below (the
    # bundled setuptools of a fresh venv is too old to build volta-qpn without isolation).
    subprocess.run([os.environ.get("QPN_ENGINE_PYTHON", sys.executable), "-m", "venv", "--without-pip",
                    str(prefix)], check=True)
    site = Path(subprocess.run([str(prefix / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_cpu_engine_dependencies.pth").write_text(str(deps) + "\n")  # torch & co., not reinstalled
    env = dict(os.environ, ENGINE="sm70", ENGINE_VERSION=VERSION, ENV_PREFIX=str(prefix),
               VLLM_WHEEL=str(wheel), VLLM_WHEEL_SHA256=digest, QPN_ENGINES_LOCK=str(_test_lock(tmp_path)),
               PYTHON=str(prefix / "bin" / "python"), QPN_WHEEL_CACHE=str(tmp_path / "cache"),
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), PIP_COMPILE="0",  # no .pyc for the whole tree
               # (pip reads PIP_NO_COMPILE inverted: "1" compiles)
               **_fake_nvidia_smi(tmp_path / "bin", 4, "12.8"))
    env.pop("QPN_ENGINE", None)

    def boot(*args):
        return subprocess.run(["bash", str(BOOTSTRAP), *args], env=env, capture_output=True, text=True,
                              timeout=1500)

    first = boot()
    assert first.returncode == 0, first.stdout[-5000:] + first.stderr[-3000:]
    out = first.stdout
    assert "[bootstrap 7/7]" in out and "overlay state: GOOD" in out
    assert f"sha256 verified" in out and f"installed 1cat-vllm {VERSION} (locked {VERSION})" in out
    key = f"sm70@{VERSION}"
    for hook in hooks_for(key, kind="runtime"):
        assert f"ok  runtime hook {hook.name}: anchor {hook.anchor_for(key)}" in out, hook.name
    assert f"({key})" in out

    check = boot("--check")
    assert check.returncode == 0 and "overlay state: GOOD" in check.stdout, check.stdout[-3000:]

    restored = boot("--restore")
    assert restored.returncode == 0, restored.stdout[-3000:] + restored.stderr[-2000:]
    assert "match the wheel's RECORD" in restored.stdout and f"1cat-vllm {VERSION}" in restored.stdout
    verify = subprocess.run(
        [str(prefix / "bin" / "python"), "-c",
         "import base64, hashlib, importlib.metadata as m\n"
         "d = m.distribution('1cat-vllm'); bad = n = 0\n"
         "for f in d.files:\n"
         "    if f.hash is None: continue\n"
         "    n += 1\n"
         "    h = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b'=').decode()\n"
         "    bad += h != f.hash.value\n"
         "print(n, bad)"], capture_output=True, text=True, check=True)
    checked, bad = map(int, verify.stdout.split())
    assert checked > 1500 and bad == 0
    assert boot("--check").returncode == 1  # restored: no overlay any more

    again = boot()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "already installed" in again.stdout and "overlay state: GOOD" in again.stdout
    print(f"stand-in sm70 bootstrap: install, check, restore, re-run in {time.monotonic() - t0:.0f} s")
