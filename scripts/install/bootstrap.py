"""Install a pinned engine into a virtualenv, overlay volta-qpn onto it, build the kernels.

Behind scripts/bootstrap-sm70.sh; stdlib only, so it runs on the machine's own Python before any
virtualenv exists. Environment (see README):

  ENGINE            sm70 | cpu (default: sm70 when an SM70 GPU is visible; otherwise it stops)
  ENGINE_VERSION    sm70 only: 1.3.0 (default) | 1.2.2 (the engine the seed figures were measured on)
  ENV_PREFIX        the virtualenv to create or reuse (default: <repo>/.venv-<engine>)
  VLLM_WHEEL        path or URL of a wheel overriding the locked one; needs VLLM_WHEEL_SHA256
  VLLM_WHEEL_SHA256 digest of that wheel (no bypass: a wheel without a digest is refused)
  REQUIRE_GPUS      number of SM70 GPUs the sm70 engine needs (default from the lock: 4)
  PYTHON            interpreter to build the virtualenv with (default: pythonX.Y of the engine)

  --check    report the overlay's state; exit 0 only when it is complete and intact
  --restore  undo the overlay; every engine file is then verified against the wheel's RECORD
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from qpn.fork_patches.engine import engine_lock
from qpn.fork_patches.engine.overlay import load_lock, sha256_file

REPO = Path(__file__).resolve().parents[2]
STATE_FILE = ".volta-qpn-engine.json"  # in ENV_PREFIX: which wheel (by digest) is installed


class BootstrapError(RuntimeError):
    pass


class Steps:
    """Numbered progress lines, one per step, with the time each took."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.monotonic()

    def start(self, what: str) -> None:
        self.n += 1
        print(f"[bootstrap {self.n}/{self.total}] {what}", flush=True)

    def note(self, what: str) -> None:
        print(f"    {what}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    print("    $ " + " ".join(str(c) for c in cmd), flush=True)
    proc = subprocess.run([str(c) for c in cmd], **kw)
    if check and proc.returncode != 0:
        raise BootstrapError(f"command failed with exit code {proc.returncode}: {cmd[0]} ...")
    return proc


# ---------------------------------------------------------------- preflight


def visible_gpus() -> list[tuple[str, str]]:
    """(name, compute capability) for each GPU nvidia-smi lists; [] without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return []
    gpus = []
    for line in proc.stdout.strip().splitlines():
        name, _, cap = line.rpartition(",")
        gpus.append((name.strip(), cap.strip()))
    return gpus


def choose_engine(lock: dict) -> str:
    engine = os.environ.get("ENGINE", "").strip()
    if engine:
        if engine not in lock["engines"]:
            raise BootstrapError(
                f"ENGINE={engine} is not a known engine; choose one of: {', '.join(lock['engines'])}"
            )
        return engine
    gpus = visible_gpus()
    if any(cap == lock["engines"]["sm70"]["gpu_capability"] for _, cap in gpus):
        return "sm70"
    seen = ", ".join(f"{n} (sm {c})" for n, c in gpus) or "no NVIDIA GPU"
    raise BootstrapError(
        f"no SM70 GPU is visible ({seen}). The sm70 engine needs V100s. To install the CPU "
        "engine for the demonstration and the tests, run: ENGINE=cpu bash scripts/bootstrap-sm70.sh"
    )


def find_python(profile: dict) -> str:
    wanted = profile["python"]
    candidates = [os.environ["PYTHON"]] if os.environ.get("PYTHON") else [f"python{wanted}", "python3"]
    for cand in candidates:
        path = shutil.which(cand)
        if path is None:
            continue
        out = subprocess.run(
            [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if out == wanted:
            return path
    raise BootstrapError(
        f"the {profile['description']} wheel ({profile['python_tag']}) needs Python {wanted}; "
        f"none found (tried {', '.join(candidates)}). Install python{wanted} or set PYTHON=/path/to/it"
    )


def preflight_gpus(profile: dict, steps: Steps) -> None:
    if not profile["gpu_capability"]:
        steps.note("no GPU needed for this engine")
        return
    need = int(os.environ.get("REQUIRE_GPUS", profile["gpus_required"]))
    gpus = visible_gpus()
    good = [g for g in gpus if g[1] == profile["gpu_capability"]]
    for name, cap in gpus:
        steps.note(f"GPU: {name}, compute capability {cap}")
    if len(good) < need:
        raise BootstrapError(
            f"{need} GPU(s) of compute capability {profile['gpu_capability']} needed, "
            f"{len(good)} found. Set REQUIRE_GPUS to the number you have (tensor parallel size)"
        )
    cuda = driver_cuda_version()
    wanted = tuple(int(x) for x in profile["driver_cuda_min"].split("."))
    if cuda is None or cuda < wanted:
        shown = ".".join(map(str, cuda)) if cuda else "unknown"
        raise BootstrapError(
            f"the NVIDIA driver supports CUDA {shown}; the engine and the QPN kernels (NVRTC "
            f"12.9) need a driver for CUDA {profile['driver_cuda_min']} or newer. Update the driver"
        )
    steps.note(f"driver supports CUDA {'.'.join(map(str, cuda))}; kernels build with NVRTC "
               "from PyPI (no system CUDA toolkit needed)")


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, from nvidia-smi's banner."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    for token in out.split("CUDA Version:")[1:2]:
        major, _, minor = token.split()[0].partition(".")
        return int(major), int(minor or 0)
    return None


# ---------------------------------------------------------------- the wheel


def wheel_source(profile: dict) -> tuple[str, str]:
    """(source, expected sha256). Refuses an override without a digest, or an empty digest."""
    override = os.environ.get("VLLM_WHEEL", "").strip()
    digest = os.environ.get("VLLM_WHEEL_SHA256", "").strip().lower()
    if override:
        if not digest:
            raise BootstrapError(
                "VLLM_WHEEL is set but VLLM_WHEEL_SHA256 is not: an unverified wheel is never "
                "installed. Set VLLM_WHEEL_SHA256 to the wheel's sha256 (sha256sum WHEEL)"
            )
        source = override
    else:
        source, digest = profile["source"], profile["sha256"].lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise BootstrapError(f"no valid sha256 for the engine wheel (got {digest!r}); refusing")
    return source, digest


def fetch_wheel(profile: dict, source: str, staging: Path, steps: Steps) -> Path:
    """Copy or download the wheel into ``staging``: the bytes hashed are the bytes installed."""
    if source == "pypi":
        spec = f"{profile['distribution']}=={profile['version']}"
        run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", profile["python"], "-d", staging, spec]
        )
        wheels = sorted(staging.glob("*.whl"))
        if len(wheels) != 1:
            raise BootstrapError(f"pip download of {spec} gave {len(wheels)} wheels, expected 1")
        return wheels[0]
    name = source.rsplit("/", 1)[-1].split("?", 1)[0]
    dest = staging / name
    if source.startswith(("http://", "https://")):
        steps.note(f"downloading {source}")
        try:
            with urllib.request.urlopen(source, timeout=60) as resp, open(dest, "wb") as out:
                total = int(resp.headers.get("Content-Length") or 0)
                done, last = 0, 0.0
                for block in iter(lambda: resp.read(1 << 22), b""):
                    out.write(block)
                    done += len(block)
                    if time.monotonic() - last > 5:
                        last = time.monotonic()
                        pct = f" ({100 * done / total:.0f}%)" if total else ""
                        steps.note(f"  {done / 2**20:.0f} MiB{pct}")
        except OSError as exc:
            raise BootstrapError(
                f"could not download {source}: {exc}. Download it yourself and set "
                "VLLM_WHEEL=/path/to/wheel with VLLM_WHEEL_SHA256"
            ) from exc
        return dest
    path = Path(source).expanduser()
    if not path.is_file():
        raise BootstrapError(f"VLLM_WHEEL={source}: no such file")
    shutil.copyfile(path, dest)
    return dest


def verify_digest(wheel: Path, expected: str, size: int = 0) -> None:
    """The wheel's bytes are the pinned ones (``size``: the published byte count, 0 = unpublished)."""
    if size and wheel.stat().st_size != size:
        raise BootstrapError(
            f"{wheel.name} is {wheel.stat().st_size:,} bytes, the lock pins {size:,}. "
            "Nothing was installed. Fetch the wheel again, or check that it is the pinned release"
        )
    actual = sha256_file(wheel)
    if actual != expected:
        raise BootstrapError(
            f"sha256 mismatch for {wheel.name}: expected {expected}, got {actual}. "
            "Nothing was installed. Fetch the wheel again, or check that it is the pinned release"
        )


# ---------------------------------------------------------------- the virtualenv


def venv_python(prefix: Path) -> Path:
    return prefix / "bin" / "python"


def ensure_venv(prefix: Path, interpreter: str, profile: dict, steps: Steps) -> Path:
    py = venv_python(prefix)
    if py.exists():
        out = subprocess.run(
            [py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True,
        ).stdout.strip()
        if out != profile["python"]:
            raise BootstrapError(
                f"ENV_PREFIX={prefix} holds Python {out}, the engine needs {profile['python']}; "
                "choose another ENV_PREFIX or remove that one"
            )
        steps.note(f"reusing virtualenv {prefix} (Python {out})")
        return py
    run([interpreter, "-m", "venv", prefix])
    run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=False)
    return py


def installed_version(py: Path, distribution: str) -> str | None:
    proc = subprocess.run(
        [py, "-c", "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))", distribution],
        capture_output=True, text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def install_engine(py: Path, prefix: Path, profile: dict, wheel: Path, digest: str, steps: Steps) -> None:
    state_path = prefix / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    if state.get("sha256") == digest and engine_lock.version_matches(
            installed_version(py, profile["distribution"]), profile["version"]):
        steps.note(f"{profile['distribution']} {profile['version']} (sha256 {digest[:12]}...) already installed")
        return
    if profile["companions_conflict_expected"]:
        steps.note(
            "expected: pip prints a dependency conflict for "
            + " and ".join(profile["companions"])
            + " (the engine declares older pins; these are the versions that work on Volta)"
        )
    run([py, "-m", "pip", "install", wheel, *profile["companions"], *profile["kernel_toolchain"]])
    for name in profile["remove_after_install"]:
        if installed_version(py, name) is not None:
            run([py, "-m", "pip", "uninstall", "-y", "-q", name])
    got = installed_version(py, profile["distribution"])
    try:
        engine_lock.check_version(got, profile)
    except engine_lock.LockError as exc:
        raise BootstrapError(f"{exc}: this wheel is not the pinned engine. Refusing to overlay it") from None
    steps.note(f"installed {profile['distribution']} {got} (locked {profile['version']})")
    state_path.write_text(json.dumps({"engine": profile["distribution"], "version": got, "sha256": digest}) + "\n")


def import_checks(py: Path, profile: dict, steps: Steps) -> None:
    env = dict(os.environ, VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="qpn-vllm-cache-"))
    for module in profile["import_checks"]:
        proc = subprocess.run([py, "-c", f"import {module}"], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise BootstrapError(f"`import {module}` fails in the engine environment:\n{tail}")
        steps.note(f"import {module}: ok")


def install_ourselves(py: Path) -> None:
    build_isolation = []
    if subprocess.run([py, "-c", "import setuptools"], capture_output=True).returncode == 0:
        build_isolation = ["--no-build-isolation"]
    run([py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", *build_isolation, REPO])


def build_kernels(py: Path, profile: dict, steps: Steps) -> None:
    arch = profile["kernel_arch"]
    if not arch:
        steps.note("this engine runs the CPU reference route; no kernel to build")
        return
    proc = run([py, "-m", "qpn.kernels", "build", "--arch", arch], check=False)
    if proc.returncode != 0:
        raise BootstrapError(
            f"the QPN kernel build for {arch} failed (see above). The engine and overlay are "
            "installed; fix the toolchain (NVRTC 12.x) and run the bootstrap again"
        )
    if arch == "sm70":
        # What the performance model estimates for these kernels on a V100: an estimate, labelled
        # so; the model is an analysis tool and lives with the benchmarks, not in the runtime.
        run([py, "-m", "qpn.benchmarks.perf_model", "--v100-column", "--results",
             str(REPO / "results")], check=False)


# ---------------------------------------------------------------- main


def overlay(py: Path, action: str, engine: str) -> int:
    source = ["--source", REPO] if action == "check" else []
    cmd = [py, "-m", "qpn.fork_patches.engine.overlay", action, "--engine", engine, *source]
    return run(cmd, check=False).returncode


def default_prefix(engine: str) -> Path:
    return REPO / f".venv-{engine}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bootstrap-sm70.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--restore", action="store_true")
    args = parser.parse_args(argv)
    try:
        lock = load_lock()
        engine = choose_engine(lock)
        try:
            profile = engine_lock.profile(engine, lock=lock)
        except engine_lock.LockError as exc:
            raise BootstrapError(str(exc)) from None
        prefix = Path(os.environ.get("ENV_PREFIX") or default_prefix(engine)).expanduser().resolve()
        py = venv_python(prefix)
        if args.check or args.restore:
            if not py.exists():
                raise BootstrapError(f"no virtualenv at ENV_PREFIX={prefix}; nothing to {'check' if args.check else 'restore'}")
            if args.check:
                return overlay(py, "check", engine)
            code = overlay(py, "restore", engine)
            if code == 0:
                run([py, "-m", "pip", "uninstall", "-y", "-q", "volta-qpn"])
                print(f"[bootstrap] overlay removed from {prefix}; the engine is as its wheel installed it")
            return code
        return bootstrap(engine, profile, prefix)
    except BootstrapError as exc:
        print(f"[bootstrap] ERROR: {exc}", file=sys.stderr, flush=True)
        return 2


def bootstrap(engine: str, profile: dict, prefix: Path) -> int:
    steps = Steps(7)
    steps.start(f"preflight for engine {engine!r}: {profile['description']}")
    preflight_gpus(profile, steps)
    interpreter = find_python(profile)
    steps.note(f"Python {profile['python']}: {interpreter}")
    source, digest = wheel_source(profile)

    steps.start(f"fetch and verify the engine wheel (sha256 {digest})")
    cache = Path(os.environ.get("QPN_WHEEL_CACHE", Path.home() / ".cache" / "volta-qpn" / "wheels"))
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="staging-", dir=cache))
    try:
        wheel = fetch_wheel(profile, source, staging, steps)
        verify_digest(wheel, digest, 0 if os.environ.get("VLLM_WHEEL") else int(profile.get("size", 0)))
        steps.note(f"{wheel.name}: sha256 verified")

        steps.start(f"virtualenv at {prefix}")
        py = ensure_venv(prefix, interpreter, profile, steps)

        steps.start(f"install {profile['distribution']} {profile['version']} and its pinned companions")
        install_engine(py, prefix, profile, wheel, digest, steps)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    import_checks(py, profile, steps)

    steps.start("install volta-qpn into the engine environment (plugin entry point)")
    install_ourselves(py)

    steps.start("overlay the engine (hooks with backups and a manifest)")
    if overlay(py, "apply", engine) != 0:
        raise BootstrapError("the overlay step failed (see above); the engine was left pristine or fully patched")

    steps.start("QPN kernels (JIT build)")
    build_kernels(py, profile, steps)

    if overlay(py, "check", engine) != 0:
        raise BootstrapError("the overlay check failed right after applying it (see above)")
    print(
        f"[bootstrap] done in {steps.elapsed():.0f} s\n"
        f"    engine:     {profile['distribution']} {profile['version']} ({profile['key']})\n"
        f"    virtualenv: {prefix}\n"
        f"    python:     {py}\n"
        f"    check:      ENGINE={engine} ENV_PREFIX={prefix} bash scripts/bootstrap-sm70.sh --check\n"
        f"    undo:       ENGINE={engine} ENV_PREFIX={prefix} bash scripts/bootstrap-sm70.sh --restore",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
