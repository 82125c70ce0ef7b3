"""Depth by context (issue 28 items 3 and 5): the fit of the auto policy's step-cost constants
from fixed-depth context sweeps, the side-by-side table, the command-line refusals (fast); then
the whole sweep on the cpu engine: fixed arms and auto served in turn through the launcher, the
constants fitted and auto served with them (engine)."""
from __future__ import annotations

import json
import math
import os

import pytest

from qpn.benchmarks import depth_sweep as DS
from qpn.benchmarks.client import BenchError
from qpn.benchmarks.results import read_results
from qpn.fork_patches.spec import depth_policy as DP


def _points(costs: DP.CostConstants, ks=(3, 7), contexts=(512, 65_536), tau=1.5):
    """Sweep rows a server with exactly these costs would give: tok/s = (1 + tau) / round."""
    return [DS.SweepPoint(k, c, 1000.0 * (1 + (tau if k else 0)) / costs.round_ms(k, c), tau if k else 0.0)
            for k in ks for c in contexts]


@pytest.mark.fast
def test_the_fit_recovers_the_constants_that_made_the_sweeps():
    truth = DP.CostConstants(a_ms=1.1, b_ms_per_token=2e-5, c_ms=DP.DEFAULT_COSTS.c_ms, fixed_ms=9.0,
                             fixed_ms_per_token=7e-5, wide_verify_ms=1.7, off_ms=6.0, off_ms_per_token=4e-5)
    fit = DS.fit_depth_constants(_points(truth, ks=(0, 1, 3, 7, 15), contexts=(0, 4096, 32_768)))
    for name, want in truth.as_dict().items():
        got = getattr(fit.constants, name)
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (name, got, want)
    assert set(fit.fitted) == set(truth.as_dict()) - {"c_ms"} and fit.kept == ("c_ms",)
    assert all(abs(r["error_pct"]) < 1e-6 for r in fit.residuals)
    assert any("a + c" in n for n in fit.notes)  # why c is not fitted is said


@pytest.mark.fast
def test_the_seed_figures_fit_back_to_the_default_constants():
    # the defaults were fitted to seed 000; sweeping a server that follows them gives them back
    fit = DS.fit_depth_constants(_points(DP.DEFAULT_COSTS, ks=(3, 7)))
    for name in ("a_ms", "b_ms_per_token", "fixed_ms", "fixed_ms_per_token"):
        assert math.isclose(getattr(fit.constants, name), getattr(DP.DEFAULT_COSTS, name), rel_tol=1e-9)
    # what no arm reached keeps its default, and the notes say so
    assert {"wide_verify_ms", "off_ms", "off_ms_per_token", "c_ms"} <= set(fit.kept)
    assert any("no K=0 arm" in n for n in fit.notes) and any("K >= 8" in n for n in fit.notes)


@pytest.mark.fast
def test_tau_enters_the_round_time():
    # the same tok/s with more accepted tokens per round means a slower round
    slow, fast = DS.SweepPoint(3, 0, 100.0, 2.0), DS.SweepPoint(3, 0, 100.0, 1.0)
    assert slow.round_ms == pytest.approx(30.0) and fast.round_ms == pytest.approx(20.0)
    assert DS.SweepPoint(0, 0, 100.0, 5.0).round_ms == pytest.approx(10.0)  # off: tau is ignored


@pytest.mark.fast
def test_one_context_keeps_the_default_slopes_and_says_so():
    fit = DS.fit_depth_constants(_points(DP.DEFAULT_COSTS, ks=(3, 7), contexts=(2048,)))
    assert fit.constants.b_ms_per_token == DP.DEFAULT_COSTS.b_ms_per_token
    assert "b_ms_per_token" in fit.kept and "fixed_ms_per_token" in fit.kept
    assert any("one context only (2048)" in n for n in fit.notes)
    # the intercepts still make the measured context right
    assert all(abs(r["error_pct"]) < 1e-6 for r in fit.residuals)


@pytest.mark.fast
def test_a_negative_slope_is_clamped_and_said():
    pts = _points(DP.DEFAULT_COSTS, ks=(3, 7), contexts=(100, 200))
    # the longer context measured faster than the shorter: noise, not a cost that falls
    pts = [DS.SweepPoint(p.k, p.context, p.tok_s * (1.2 if p.context == 200 else 1.0), p.tau) for p in pts]
    fit = DS.fit_depth_constants(pts)
    assert fit.constants.fixed_ms_per_token == 0.0 and fit.constants.b_ms_per_token == 0.0
    assert any("negative" in n for n in fit.notes)
    assert any(abs(r["error_pct"]) > 1 for r in fit.residuals)  # the misfit is reported, not hidden


@pytest.mark.fast
def test_the_fit_refuses_sweeps_that_cannot_separate_the_costs():
    with pytest.raises(BenchError, match="two depths k <= 7"):
        DS.fit_depth_constants(_points(DP.DEFAULT_COSTS, ks=(7,)))
    with pytest.raises(BenchError, match="two depths k <= 7"):
        # two depths, but never at one same context
        DS.fit_depth_constants([DS.SweepPoint(3, 0, 50.0, 1.0), DS.SweepPoint(7, 512, 50.0, 1.0)])
    with pytest.raises(BenchError, match="two depths k <= 7"):
        DS.fit_depth_constants(_points(DP.DEFAULT_COSTS, ks=(0, 15)))


@pytest.mark.fast
def test_a_speculative_row_without_tau_is_refused_and_rows_without_tg_are_skipped():
    rows = [{"live_context": "64", "tg_tok_s": "10.0", "tau": "1.2"},
            {"live_context": "320", "tg_tok_s": "", "tau": ""}]
    assert DS.sweep_points(3, rows) == [DS.SweepPoint(3, 64, 10.0, 1.2)]
    with pytest.raises(BenchError, match="no tau"):
        DS.sweep_points(3, [{"live_context": "64", "tg_tok_s": "10.0", "tau": ""}])
    assert DS.sweep_points(0, [{"live_context": "64", "tg_tok_s": "10.0", "tau": ""}])[0].tau == 0.0


@pytest.mark.fast
@pytest.mark.parametrize("text,want", [("3", 3), ("0", 0), (" AUTO ", "auto"), ("15", 15)])
def test_arms_parse(text, want):
    assert DS.parse_arm(text) == want


@pytest.mark.fast
@pytest.mark.parametrize("text", ["16", "-1", "deep", ""])
def test_bad_arms_are_named(text):
    with pytest.raises(ValueError, match="arm"):
        DS.parse_arm(text)


@pytest.mark.fast
def test_the_side_by_side_table_compares_auto_with_the_best_fixed_arm():
    results = {3: [{"live_context": "100", "tg_tok_s": "20", "tau": "1.0"},
                   {"live_context": "900", "tg_tok_s": "15", "tau": "1.0"}],
               7: [{"live_context": "100", "tg_tok_s": "30", "tau": "2.0"},
                   {"live_context": "900", "tg_tok_s": "10", "tau": "1.1"}],
               "auto": [{"live_context": "100", "tg_tok_s": "29", "tau": "2.0", "drafted": "7.0",
                         "rounds_per_depth": "7:40"},
                        {"live_context": "900", "tg_tok_s": "15", "tau": "1.0", "drafted": "3.0",
                         "rounds_per_depth": "3:50"}]}
    cols, rows = DS.side_by_side([3, 7, "auto"], results)
    assert [c.key for c in cols][:3] == ["live_context", "k3_tok_s", "k3_tau"]
    assert [r["live_context"] for r in rows] == [100, 900]
    assert rows[0]["auto_vs_best_fixed"] == pytest.approx(29 / 30)  # best fixed is K=7 here
    assert rows[1]["auto_vs_best_fixed"] == pytest.approx(1.0)      # and K=3 here
    assert rows[1]["auto_depths"] == "3:50" and rows[0]["auto_drafted"] == 7.0


@pytest.mark.fast
def test_the_serve_command_carries_constants_the_launcher_accepts():
    from qpn.scripts.launcher.serve import auto_depth_policy
    import shlex

    cmd = DS.serve_command(DP.DEFAULT_COSTS, "/models/q 38", "3,7")
    words = shlex.split(cmd)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("/"))
    assert words[-1] == "/models/q 38" and env["K"] == "auto" and env["DEPTH_LADDER"] == "3,7"
    policy = auto_depth_policy(env)
    assert policy.costs.as_dict() == pytest.approx(DP.DEFAULT_COSTS.as_dict())


@pytest.mark.fast
def test_fit_only_from_sweep_files(tmp_path, capsys):
    from qpn.benchmarks.results import Column, ResultsWriter

    files = []
    for k in (3, 7):
        w = ResultsWriter(str(tmp_path / f"k{k}"), "t", {"figures": "CPU figures"},
                          [Column("live_context", "c"), Column("tg_tok_s", "t", 4), Column("tau", "tau", 4)])
        for p in _points(DP.DEFAULT_COSTS, ks=(k,)):
            w.add_row({"live_context": p.context, "tg_tok_s": p.tok_s, "tau": p.tau})
        files.append(f"{k}={w.csv_path}")
    out = tmp_path / "c.json"
    assert DS.main(["--fit", files[0], "--fit", files[1], "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["constants"]["a_ms"] == pytest.approx(DP.DEFAULT_COSTS.a_ms, rel=1e-3)
    assert doc["provenance"]["commit"] and doc["serve"].startswith("K=auto DEPTH_CONSTANTS=")
    assert DS.main(["--fit", "auto=" + files[0].split("=")[1]]) == 2
    assert "auto has no fixed depth" in capsys.readouterr().err
    assert DS.main([]) == 2 and "--checkpoint" in capsys.readouterr().err


@pytest.mark.fast
def test_auto_needs_two_fixed_arms_to_fit_its_constants(tmp_path, capsys):
    assert DS.main(["--checkpoint", str(tmp_path), "--arms", "7,auto"]) == 2
    assert "at least two fixed depths" in capsys.readouterr().err
    assert DS.main(["--checkpoint", str(tmp_path), "--arms", "3,3"]) == 2
    assert "twice" in capsys.readouterr().err


# ---- the whole sweep on the cpu engine (engine) ----------------------------------------------

@pytest.mark.engine
@pytest.mark.slow
def test_fixed_arms_then_auto_with_the_fitted_constants(mixed_checkpoint, tmp_path):
    from tests.test_launcher_server import _env

    env = _env(str(tmp_path / "env"), DEPTH_LADDER="1,3", DEPTH_WARM_WORDS="400", TOOL_PARSER="hermes")
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        rc = DS.main(["--checkpoint", str(mixed_checkpoint), "--arms", "1,3,auto", "--depths", "0,192",
                      "--pp", "32", "--tg", "24", "--runs", "1", "--results-dir", str(tmp_path),
                      "--name", "ds"])
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert rc == 0
    header, rows, _ = read_results(str(tmp_path / "ds.csv"))
    assert header["figures"].startswith("CPU figures") and "auto" in header["K (speculation depth)"]
    assert [r["live_context"] for r in rows] == ["32", "224"]
    for r in rows:
        for arm in ("k1", "k3", "auto"):
            assert float(r[f"{arm}_tok_s"]) > 0, r
        assert 1.0 <= float(r["auto_drafted"]) <= 3.0
    doc = json.loads((tmp_path / "ds_depth_constants.json").read_text())
    assert set(doc["constants"]) == {f for f in DP.DEFAULT_COSTS.as_dict()}
    assert {"a_ms", "fixed_ms"} <= set(doc["fitted"]) and len(doc["residuals"]) == 4
    assert (tmp_path / "ds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    auto_header, _, _ = read_results(str(tmp_path / "ds_kauto.csv"))
    assert auto_header["endpoint"].startswith("http://127.0.0.1:")
