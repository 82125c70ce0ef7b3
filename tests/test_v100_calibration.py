"""The V100 calibration of the performance model (issue 27 items 1 and 2; benchmarks/v100_calibration.py):
the committed fit comes back from the committed table, leave-one-out leaves the point out, the
third-party figures come back from their sources (the 1Cat archive always; the seed's source when
QPN_SEED_SOURCE names it), those sources are cited and not copied, and the whole-step estimate
counts 257 GEMMs and their bytes as an independent count does."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess

import pytest

from qpn.benchmarks import perf_model
from qpn.benchmarks import v100_calibration as vc
from tests._ci import onecat_archive

fast = pytest.mark.fast


@fast
def test_the_committed_fits_come_back_from_the_committed_table():
    points = list(vc.SEED_POINTS)
    assert vc.calibrate(points) == vc.FIT_BASE
    assert vc.calibrate(points, with_l2=True) == vc.FIT_ACTIVATION
    # perf_model's V100-calibrated option uses the base fit, not the H200 one
    c = perf_model.v100_calibrated_constants()
    assert (c.latency_us, c.ipc, c.t0_us) == (vc.FIT_BASE.latency_us, vc.FIT_BASE.ipc, vc.FIT_BASE.t0_us)


@fast
def test_the_committed_points_are_the_seed_rows_they_cite():
    assert len(vc.SEED_POINTS) == 15
    for p in vc.SEED_POINTS:
        group, m, route, gbps = p.where.split(",")
        assert (group, int(m), route, float(gbps)) == (p.group, p.m, p.route, p.measured_gbps)
        assert (p.repo, p.path, p.commit) == (vc.SEED_REPO, vc.SEED_RESULTS, vc.SEED_COMMIT)
        assert all(s.kernel in vc.SEED_FIGURES for s in p.shapes)


@fast
def test_leave_one_out_predicts_a_point_without_it():
    """A deliberately wrong measurement (x1.5 GB/s) must not move its own leave-one-out
    prediction, must move its error by log(1.5), and must move the other points' predictions
    (they are fitted with it). A leave-one-out that kept the point in its fit fails the first."""
    ids = ("seed/trunk/M1", "seed/trunk/M8", "seed/trunk/M16", "seed/lm_head/M1", "seed/fp8/M1", "seed/fp8/M16")
    clean = [p for p in vc.SEED_POINTS if p.id in ids]
    wrong = [dataclasses.replace(p, measured_gbps=1.5 * p.measured_gbps) if p.id == "seed/trunk/M8" else p
             for p in clean]
    search = dict(steps=10, rounds=3)
    a, b = vc.leave_one_out(clean, **search), vc.leave_one_out(wrong, **search)
    i = ids.index("seed/trunk/M8")
    assert b[i]["predicted_us"] == a[i]["predicted_us"]
    assert b[i]["log_err"] == pytest.approx(a[i]["log_err"] + math.log(1.5))
    assert any(x["predicted_us"] != y["predicted_us"] for j, (x, y) in enumerate(zip(a, b)) if j != i)
    mean = lambda rows: sum(abs(r["log_err"]) for r in rows) / len(rows)  # noqa: E731
    assert mean(b) > mean(a)


def _committed_results():
    """The newest results/perf_model_v100_calibration_<date>.csv: its header and rows."""
    results = os.path.join(os.path.dirname(__file__), "..", "results")
    names = sorted(n for n in os.listdir(results) if re.fullmatch(r"perf_model_v100_calibration_\d{8}\.csv", n))
    assert names, "no results/perf_model_v100_calibration_<date>.csv: run python -m qpn.benchmarks.v100_calibration"
    head, rows = perf_model.read_csv(os.path.join(results, names[-1]))
    return head, rows, open(os.path.join(results, names[-1])).read()


@fast
def test_the_results_file_reports_leave_one_out_per_point_and_the_goal_honestly():
    _, rows, text = _committed_results()
    assert [r["id"] for r in rows] == [p.id for p in vc.SEED_POINTS]
    loo = [math.log(1 + float(r["base_loo_err_pct"]) / 100) for r in rows]
    mean, worst = sum(map(abs, loo)) / len(loo), max(abs(float(r["base_loo_err_pct"])) for r in rows)
    met = mean <= vc.GOAL_MEAN_ABS_LOG and worst <= vc.GOAL_MAX_ABS_PCT
    assert f"leave-one-out {mean:.4f}" in text
    assert re.search(rf"goal .*: base {'MET' if met else 'MISSED'}", text)
    assert "commit:" in text.splitlines()[0] and vc.LABEL in text


@fast
def test_the_third_party_sources_are_cited_not_copied(repo_root):
    module = (repo_root / "benchmarks" / "v100_calibration.py").read_text()
    for repo, path in vc.THIRD_PARTY_FILES:
        assert repo in (vc.SEED_REPO, vc.FORK_REPO, vc.ONECAT_REPO)
        assert f'"{path}"' in module, f"{path}: in THIRD_PARTY_FILES but not a constant of the module"
    for commit in (vc.SEED_COMMIT, vc.FORK_COMMIT, vc.ONECAT_COMMIT):
        assert re.fullmatch(r"[0-9a-f]{40}", commit)
    # no third-party file at its path here, save our own harness that shares the seed's harness name
    present = {path for _, path in vc.THIRD_PARTY_FILES if (repo_root / path).exists()}
    assert present <= {vc.SEED_HARNESS}
    # and no third-party kernel's definition anywhere in the tree (tracked or not)
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=repo_root,
                           capture_output=True, text=True, check=True).stdout.split()
    definition = re.compile(r"__global__\s+void\s+(?:skinny_\w+|nvfp4_raw_gemv\w*)\s*\(")
    copied = [f for f in files if (repo_root / f).is_file() and (repo_root / f).suffix in {".cu", ".cuh", ".h", ".py"}
              and definition.search((repo_root / f).read_text(errors="replace"))]
    assert not copied, copied


@fast
def test_the_whole_step_counts_257_gemms_and_their_bytes():
    """Against an independent count: per layer qkvz 4096x5120 and out 5120x1536 in FP8 (1 byte a
    weight), gate_up 8704x5120 and down 5120x4352 in NVFP4 (codes + E4M3 group scales, 9/16 byte),
    64 layers, lm_head 62080x5120 in NVFP4 once."""
    per_layer = 4096 * 5120 + 5120 * 1536 + (8704 * 5120 + 5120 * 4352) * 9 / 16
    nbytes = 64 * per_layer + 62080 * 5120 * 9 / 16
    us = {"tp4_gdn_in_proj_qkvz": 3.0, "tp4_gdn_out_proj": 5.0, "tp4_mlp_gate_up": 7.0, "tp4_mlp_down": 11.0,
          "tp4_lm_head": 100.0}
    st = vc.whole_step(lambda shape, m: us[shape] * m)
    assert st["calls"] == 257
    assert st["weight_bytes"] == pytest.approx(nbytes)
    assert st["floor_us"] == pytest.approx(nbytes / 879e3)
    for m in (1, 8, 16):
        assert st["step_us"][m] == pytest.approx(m * (64 * (3 + 5 + 7 + 11) + 100))
    assert st["drafter_lm_head_us"] == 100.0
    k3 = st["rounds"][3]
    assert k3["verify_us"] == pytest.approx(4 * (64 * 26 + 100))
    assert k3["verify_share"] == pytest.approx(k3["verify_us"] / 20.4e3)
    assert st["rounds"][7]["drafter_share"] == pytest.approx(7 * 100 / 25.2e3)


@fast
def test_the_launch_geometry_is_read_from_host_launches():
    """seed_launches on two made-up launches in the two forms the seed's host code uses (a macro
    over SPv with line continuations, and a literal instance)."""
    text = ("kernel_a<SPv, NAv>  \\\n   <<<dim3((int)(n / 32)), dim3(32 * SPv), 0, stream>>>(args);\n"
            "kernel_b<2><<<dim3((int)(n / 32)), dim3(128), 0, stream>>>(args);\n"
            "kernel_b<1><<<dim3((int)(n / 32)), dim3(64), 0, stream>>>(args);\n")
    a = dataclasses.replace(vc.SEED_RECIPES["qpn2<16,2>"], function="kernel_a")
    b = dataclasses.replace(vc.SEED_RECIPES["qpn<2>"], function="kernel_b")
    assert vc.seed_launches(text, a) == {("(int)(n / 32)", 512)}
    assert vc.seed_launches(text, b) == {("(int)(n / 32)", 128)}     # kernel_b<1> is another instance
    assert vc.seed_launches(text, dataclasses.replace(a, args=(8, 2))) == {("(int)(n / 32)", 256)}


def test_the_seed_figures_come_back_from_the_seed_source():
    """Compiles the seed's kernels for sm_70 and compares with SEED_FIGURES and its results rows.
    CI has no copy of the seed's source (it is never copied into this repository)."""
    source = os.environ.get("QPN_SEED_SOURCE", "")
    if not source:
        pytest.skip(f"QPN_SEED_SOURCE not set: give a git directory of {vc.SEED_REPO} holding "
                    f"{vc.SEED_COMMIT[:12]}, or a folder with {vc.SEED_KERNELS} and {vc.SEED_RESULTS} of it")
    assert vc.check_seed(source) == []


def test_the_1cat_figures_come_back_from_the_archive():
    """The raw GEMV prototypes compiled from the archive, the TurboMind headers it lacks (why those
    points are left out), and every left-out time found in its design documents."""
    info, problems = vc.check_onecat_committed(str(onecat_archive("1.3.0")))
    assert problems == []
    assert all(info["doc_rows_found"]) and info["missing_turbomind_headers"]
