"""Mutation check: known-bad edits to the kernels, their layout description, the reference and the
route table must each make the fast tier fail.

Each mutation is applied to a scratch copy of the repository (the working tree's files, so an
uncommitted change is checked too); the fast tests of the files a kernel edit can reach
(KERNEL_FAST_FILES) then run there in a fresh interpreter, stopping at the first failure, which
there must be. A control run on the unmutated copy then runs every test that caught a mutation:
each must pass, so a failure meant the mutation, not the copy or the host. Two mutations run
at a time (the 2-core CI host). The time limit is on the CPU seconds the check's processes use,
divided by the 2 cores: what the check costs on an idle 2-core host, independent of how busy the
host is while it runs (the wall time is printed beside it).
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._ci import REPO  # noqa: E402
KERNEL_FAST_FILES = [  # the fast-tier files a kernel edit can reach, quickest first (each run stops at its first failure)
    "tests/test_formats.py", "tests/test_prepack.py", "tests/test_kernels_reference.py",
    "tests/test_kernels_sm70_replay.py", "tests/test_kernels_per_group.py", "tests/test_kernels_sm80.py",
    "tests/test_moe_reference.py",
]
TIME_LIMIT_S = 180


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    first: str = ""     # the fast file expected to catch it: run first, only to save time


MUTATIONS = [
    Mutation("nibble order (prepack packs the even element high)", "kernels/families/nvfp4/layout.py",
             "packed = blk[..., 0::2] | (blk[..., 1::2] << 4)", "packed = (blk[..., 0::2] << 4) | blk[..., 1::2]", first="tests/test_prepack.py"),
    Mutation("NVFP4 word order slot swap (m8n8k4)", "kernels/families/nvfp4/layout.py",
             "word_order = (6, 4, 2, 0, 7, 5, 3, 1)", "word_order = (4, 6, 2, 0, 7, 5, 3, 1)", first="tests/test_kernels_sm70_replay.py"),
    Mutation("NVFP4 word slot swap (m16n8k16)", "kernels/families/nvfp4/layout.py",
             "4 * t + (j >> 2) + 2 * ((j & 3) < 2)",
             "4 * t + (j >> 2) + 2 * ((j & 3) >= 2)", first="tests/test_kernels_sm80.py"),
    Mutation("FP8 word order slot swap (m8n8k4)", "kernels/families/fp8/layout.py",
             "word_order = (2, 0, 3, 1)", "word_order = (0, 2, 3, 1)", first="tests/test_kernels_sm70_replay.py"),
    Mutation("dropped global scale (kernel epilogue)", "kernels/csrc/qpn_kernels.cu",
             "v *= ldgf(a.chscale + (a.chscale_per_channel ? n : 0)) * Dec::OUT_MULT;", "",
             first="tests/test_kernels_sm70_replay.py"),
    Mutation("S7 form's scale times 2^14, not 2^15 (m8n8k4)", "kernels/families/nvfp4/m8n8k4.cuh",
             "S7 ? 0x78007800u : 0x5C005C00u", "S7 ? 0x74007400u : 0x5C005C00u", first="tests/test_kernels_sm70_replay.py"),
    Mutation("dropped global scale (CPU reference)", "kernels/families/nvfp4/numerics.py",
             "scales = codecs.decode_e4m3(group_scale_bytes(packed)) * packed.global_scale.reshape(()).to(torch.float32)",
             "scales = codecs.decode_e4m3(group_scale_bytes(packed))", first="tests/test_kernels_reference.py"),
    Mutation("second group's scale ignored (m8n8k4 main loop)", "kernels/csrc/qpn_kernels.cu",
             "(2 * p * Atom::K_STEP < 16) ? sc2[0] : sc2[1];", "(2 * p * Atom::K_STEP < 16) ? sc2[0] : sc2[0];", first="tests/test_kernels_sm70_replay.py"),
    Mutation("FP8 exponent bit 2 dropped (e4m3 decoder)", "kernels/csrc/qpn_family.cuh",
             "and_or(t >> 1, 0x3F803F80u, t & 0x80008000u)", "and_or(t >> 1, 0x2F802F80u, t & 0x80008000u)", first="tests/test_kernels_sm70_replay.py"),
    Mutation("FP8 exponent bit 2 dropped (format table)", "kernels/codecs.py",
             "exp = (b >> 3) & 0xF", "exp = (b >> 3) & 0xB", first="tests/test_formats.py"),
    Mutation("scale row offset (m16n8k16 scale map)", "kernels/families/nvfp4/layout.py",
             "flat = [(g + 8 * h) * gpb + grp", "flat = [((g + 1) % 8 + 8 * h) * gpb + grp", first="tests/test_kernels_sm80.py"),
    Mutation("scale row offset (m8n8k4 lane's scale pair)", "kernels/csrc/qpn_family.cuh",
             "QPN_DEV static int scale_pair_offset(int lane) { return 2 * lane; }",
             "QPN_DEV static int scale_pair_offset(int lane) { return 2 * (lane ^ 4); }", first="tests/test_kernels_sm70_replay.py"),
    Mutation("route threshold (mt1 above its 8-token tile)", "kernels/routes.py",
             "M_SINGLE_TILE_MAX = 8\n", "M_SINGLE_TILE_MAX = 16\n", first="tests/test_kernels_reference.py"),
    Mutation("MoE gate/up warp split off by one", "kernels/csrc/qpn_moe.cu",
             "const int which = (GATE_UP && tile_in_block >= half) ? 1 : 0;",
             "const int which = (GATE_UP && tile_in_block > half) ? 1 : 0;", first="tests/test_kernels_sm70_replay.py"),
]


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for f in files:
        src = REPO / f
        if not src.is_file():
            continue          # deleted in the working tree
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / f)


def _run_fast(root: Path, first: str = "", only: list | None = None) -> subprocess.CompletedProcess:
    """The fast kernel files in the copy at root, stopping at the first failure (``first`` runs
    first); or, with ``only``, just those test ids (the control run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    files = [f for f in [first] + KERNEL_FAST_FILES if f and (root / f).exists()]
    files = list(dict.fromkeys(files))
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "fast", "-p", "no:cacheprovider", "-p", "no:warnings",
           *(only if only is not None else ["-x", *files])]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=4 * TIME_LIMIT_S)


def _first_failure(out: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    return m.group(1) if m else "(no FAILED line)"


def test_every_known_bad_edit_fails_the_fast_tier(tmp_path, capsys):
    t0 = time.time()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    base = tmp_path / "clean"
    _copy_tree(base)
    probe = subprocess.run([sys.executable, "-c", "import qpn.kernels.atoms as a; print(a.__file__)"], cwd=base,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                           capture_output=True, text=True)
    assert probe.stdout.strip().startswith(str(base)), f"the scratch copy imports another tree: {probe.stdout}{probe.stderr}"

    def run(mut: Mutation):
        root = tmp_path / re.sub(r"\W+", "_", mut.name)
        shutil.copytree(base, root)
        target = root / mut.path
        text = target.read_text()
        assert text.count(mut.old) == 1, f"mutation '{mut.name}' no longer matches {mut.path}: update it"
        target.write_text(text.replace(mut.old, mut.new))
        try:
            res = _run_fast(root, first=mut.first)
        except subprocess.TimeoutExpired as e:
            res = subprocess.CompletedProcess(e.cmd, 0, f"(timed out after {e.timeout} s: not caught)", "")
        shutil.rmtree(root, ignore_errors=True)
        return mut, res

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, MUTATIONS))
    survived, lines, catchers = [], [], []
    for mut, res in results:
        caught = res.returncode != 0
        lines.append(f"  {'caught ' if caught else 'SURVIVED'} {mut.name:55s} {_first_failure(res.stdout) if caught else ''}")
        if not caught:
            survived.append(mut.name)
        elif "::" in _first_failure(res.stdout):
            catchers.append(_first_failure(res.stdout))
    # control: every test that caught a mutation passes on the unmutated copy (so it failed
    # because of the mutation, not because of the copy or the host)
    control = _run_fast(base, only=sorted(set(catchers)))
    assert control.returncode == 0, "a catching test fails on the unmutated copy too:\n" + control.stdout[-3000:]
    elapsed = time.time() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    two_core_s = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / 2
    with capsys.disabled():
        print(f"\nmutation check ({len(MUTATIONS)} edits): {two_core_s:.0f} s of 2-core CPU time, "
              f"{elapsed:.0f} s wall:\n" + "\n".join(lines))
    assert not survived, f"known-bad edits the fast tier lets through: {survived}"
    assert two_core_s < TIME_LIMIT_S, f"the mutation check needs {two_core_s:.0f} s on 2 cores (limit {TIME_LIMIT_S} s)"
