"""Provenance written by code (benchmarks/provenance.py): the dirty flag and diff hash follow the
working tree exactly, and a run record carries every field a results file must state."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from qpn.benchmarks import provenance as P

pytestmark = pytest.mark.fast


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    if not shutil.which("git"):
        pytest.fail("git is needed for provenance (it is part of the CI image)")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.invalid")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    _git(tmp_path, "add", "a.py", ".gitignore")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_clean_tree_has_commit_and_no_diff(repo):
    st = P.source_state(str(repo))
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert st == {"commit": head, "dirty": False, "diff_sha256": None, "changed": []}
    (repo / "ignored").mkdir()
    (repo / "ignored" / "junk").write_text("build output")
    assert P.source_state(str(repo))["dirty"] is False        # ignored files are not source


def test_dirty_flag_and_diff_hash_follow_the_tree(repo):
    (repo / "a.py").write_text("x = 2\n")
    s1 = P.source_state(str(repo))
    assert s1["dirty"] is True and len(s1["diff_sha256"]) == 64 and s1["changed"] == ["a.py"]
    assert P.source_state(str(repo))["diff_sha256"] == s1["diff_sha256"]   # same tree, same hash
    (repo / "a.py").write_text("x = 3\n")
    s2 = P.source_state(str(repo))
    assert s2["diff_sha256"] != s1["diff_sha256"]
    _git(repo, "add", "a.py")                                  # staged changes count too
    assert P.source_state(str(repo))["diff_sha256"] == s2["diff_sha256"]
    _git(repo, "checkout", "-q", "HEAD", "--", "a.py")
    assert P.source_state(str(repo))["dirty"] is False
    (repo / "new.py").write_text("y = 1\n")                    # an untracked source file
    u1 = P.source_state(str(repo))
    assert u1["dirty"] is True and u1["changed"] == ["new.py (untracked)"]
    (repo / "new.py").write_text("y = 2\n")
    assert P.source_state(str(repo))["diff_sha256"] != u1["diff_sha256"]


def test_outside_a_checkout_says_so(tmp_path):
    st = P.source_state(str(tmp_path))
    assert st["commit"] is None and "git" in st["error"]


def test_run_record_states_every_field(monkeypatch):
    monkeypatch.setenv("QPN_NUMERICS_REPORT", "/tmp/x.md")
    monkeypatch.setattr(sys, "argv", ["prog", "--flag", "a b"])
    rec = P.run_record(suite="unit")
    for key in ("commit", "dirty", "diff_sha256", "changed", "command", "gpu", "driver", "cuda", "torch",
                "host_cpu", "date", "suite"):
        assert key in rec, key
    assert rec["commit"] and rec["date"].endswith("+00:00")
    # the command names no path of this machine (issue 41 item 7): the report as $OUT, the interpreter as $VENV
    assert "QPN_NUMERICS_REPORT=$OUT/x.md" in rec["command"] and "--flag 'a b'" in rec["command"]
    assert " $VENV/bin/python " in rec["command"]
    assert sys.executable not in rec["command"] and "(in /" not in rec["command"]
    if rec["dirty"]:
        assert len(rec["diff_sha256"]) == 64
    else:
        assert rec["diff_sha256"] is None
    md = "\n".join(P.markdown_block(rec))
    csv = P.comment_lines(rec)
    for key in rec:
        assert f"- {key}: " in md and any(line.startswith(f"# {key}: ") for line in csv)


def test_exported_state_is_read_back_in_a_copy_without_git(repo, tmp_path_factory, monkeypatch):
    (repo / "a.py").write_text("x = 5\n")
    live = P.source_state(str(repo))
    path = P.export_source_state(str(repo))
    assert P.source_state(str(repo)) == live                     # the export file itself is not source
    copy = tmp_path_factory.mktemp("copy")
    shutil.copy(path, copy / P.SOURCE_STATE_FILE)
    got = P.source_state(str(copy))
    assert (got["commit"], got["dirty"], got["diff_sha256"]) == (live["commit"], True, live["diff_sha256"])
    assert "own git state is not used" in got["changed"][-1]


def test_state_exported_elsewhere_wins_over_a_copied_git(repo):
    """A copy sent to a GPU host can carry a .git whose HEAD is not the checkout's; the state
    exported on the source machine must be reported there, not that stale HEAD."""
    import json

    live = P.source_state(str(repo))
    exported = dict(live, commit="f" * 40, exported_at="then", exported_from="the-source-machine")
    (repo / P.SOURCE_STATE_FILE).write_text(json.dumps(exported))
    try:
        got = P.source_state(str(repo))
        assert got["commit"] == "f" * 40 and "the-source-machine" in got["changed"][-1]
        # Exported on this very machine: git itself is asked.
        exported["exported_from"] = P.machine_boot()
        (repo / P.SOURCE_STATE_FILE).write_text(json.dumps(exported))
        assert P.source_state(str(repo))["commit"] == live["commit"]
    finally:
        (repo / P.SOURCE_STATE_FILE).unlink()


def test_recorded_commands_name_no_machine_path(monkeypatch, tmp_path):
    """Results files record repository-relative commands with placeholders (issue 41 item 7): paths in
    the checkout relative, the interpreter $VENV/bin/python, outputs under $OUT, known outside inputs
    by name; an unknown absolute path stays (the evidence index's test then names it)."""
    root = P.REPO_ROOT
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["prog", "--out", str(tmp_path / "a.csv"), "--targets", "/elsewhere/t.md",
                                      f"{root}/tests/test_provenance.py", "--checkpoint", "/data/ckpt", "--label", "x y"])
    assert P.command_line("qpn.benchmarks.kernel_matched_bench") == (
        "$VENV/bin/python -m qpn.benchmarks.kernel_matched_bench --out $OUT/a.csv --targets $OUT/t.md "
        "tests/test_provenance.py --checkpoint $CHECKPOINT --label 'x y'")
    # an earlier record, as results_index renders it
    assert P.portable_command(
        "QPN_ENGINE_PYTHON=/opt/torch/.venv/bin/python3 QPN_NUMERICS_REPORT=/root/out/k.md "
        "/opt/torch/.venv/bin/python3 -m pytest.__main__ -q /tmp/head/tests/test_gpu_int4.py --seed-source /tmp/s "
        "--out-dir /tmp/r --model /root/m  (in /tmp/head)") == (
        "QPN_ENGINE_PYTHON=$VENV/bin/python QPN_NUMERICS_REPORT=$OUT/k.md $VENV/bin/python -m pytest.__main__ -q "
        "tests/test_gpu_int4.py --seed-source $SEED_SOURCE --out-dir $OUT --model /root/m")
    # perf_model reads its --sweep; kernel_matched_bench writes it
    assert P.command_outputs("python -m qpn.benchmarks.perf_model --csv a.csv --sweep b.csv --out-dir results") == set()
    assert P.command_outputs("QPN_NUMERICS_REPORT=/root/out/k.md python3 -m qpn.benchmarks.kernel_matched_bench "
                             "--sweep /root/out/s.csv --targets=/x/t.md --m 1") == {"k.md", "s.csv", "t.md"}
