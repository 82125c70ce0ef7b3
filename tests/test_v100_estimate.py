"""Our V100 estimate under the V100 calibration (issue 27 item 2; benchmarks/v100_estimate.py):
every m8n8k4 route, TP4 and TP2, M = 1..16; the seed's measured level only where the seed
measured that group and M; 1Cat's TurboMind time only on its own shape and M, with the ratio;
what has no kernel named; the files labelled as estimates, with provenance."""
from __future__ import annotations

import csv

import pytest

from qpn.benchmarks import perf_model as pm
from qpn.benchmarks import v100_calibration as vc
from qpn.benchmarks import v100_estimate as ve

fast = pytest.mark.fast


@pytest.fixture(scope="module")
def estimate(sm70_toolchain):
    stats, trips = pm.kernel_stats("m8n8k4", 70), vc.our_m8n8k4_round_trips()
    rows, notes = ve.estimate_rows(stats, trips)
    return stats, trips, rows, notes


@fast
def test_every_shape_route_and_m_is_estimated(estimate):
    _, _, rows, _ = estimate
    for table, shapes in ve.SHAPES.items():
        for shape, (fmt, n, k) in shapes.items():
            own = [r for r in rows if r["table"] == table and r["shape"] == shape and r["fmt"] == fmt]
            forms = ("s7", "restore") if fmt == "nvfp4" else ("-",)
            assert {(r["form"], r["m"]) for r in own} == {(f, m) for f in forms for m in range(1, 17)}, (table, shape)
            for r in own:
                # one token tile up to M = 8, two from 9 (the route bands of kernels/routes.py)
                assert ("_mt1" in r["kernel"]) == (r["m"] <= 8) and ("_s7" in r["kernel"]) == (r["form"] == "s7")
                assert (r["n"], r["k"]) == (n, k) and r["est_us"] > vc.FIT_BASE.t0_us
                # never faster than the weight bytes at the read ceiling
                floor = n * k * pm.bytes_per_weight(fmt) / pm.V100_SXM2.read_ceiling_gbps / 1e3
                assert r["est_us"] >= floor + vc.FIT_BASE.t0_us - 1e-9 and 0 < r["est_pct"] <= 100


@fast
def test_an_int8_row_stands_beside_every_fp8_shape(estimate):
    """INT8 W8A16 (one byte a code, as FP8) on every shape whose checkpoint format is FP8, every M:
    its own m8n8k4 kernel, never faster than its bytes (codes, float16 scales and zero points) at
    the read ceiling, and no seed level or TurboMind time (neither project measured it)."""
    _, _, rows, _ = estimate
    assert ve.same_width_peers("fp8") == ["int8"] and ve.same_width_peers("nvfp4") == ["int4"]
    for table, shapes in ve.SHAPES.items():
        for shape, (fmt, n, k) in shapes.items():
            if fmt != "fp8":
                continue
            int8 = [r for r in rows if r["table"] == table and r["shape"] == shape and r["fmt"] == "int8"]
            assert {r["m"] for r in int8} == set(range(1, 17)), (table, shape)
            for r in int8:
                assert r["kernel"].startswith("qpn8i_mt") and r["seed_pct"] is None and r["turbomind_us"] is None
                floor = n * k * pm.bytes_per_weight("int8") / pm.V100_SXM2.read_ceiling_gbps / 1e3
                assert r["est_us"] >= floor + vc.FIT_BASE.t0_us - 1e-9
                fp8 = next(x for x in rows if (x["table"], x["shape"], x["fmt"], x["m"]) == (table, shape, "fp8", r["m"]))
                assert r["checkpoint_fmt"] == "fp8" and r["est_us"] >= fp8["est_us"] * 0.5


@fast
def test_seed_levels_stand_only_where_the_seed_measured(estimate):
    _, _, rows, _ = estimate
    levels = ve.seed_levels()
    with_level = [r for r in rows if r["seed_pct"] is not None]
    assert with_level and all(r["table"] == "tp4" and r["fmt"] == r["checkpoint_fmt"] for r in with_level)
    assert {r["m"] for r in with_level} == {1, 2, 4, 8, 16}
    for r in with_level:
        assert r["seed_pct"] == levels[(ve.SEED_GROUP[r["shape"]], r["m"])]
        assert r["seed_verdict"] == ("below" if r["est_pct"] < r["seed_pct"] else "at or above")
    # lm_head has its own level: not the trunk's
    lm = next(r for r in with_level if r["shape"] == "lm_head" and r["m"] == 1)
    assert lm["seed_pct"] == pytest.approx(100 * 842.9 / 879.0)


@fast
def test_turbomind_times_stand_beside_their_own_shape_and_m(estimate):
    _, _, rows, notes = estimate
    tm = ve.turbomind_times()
    # where 1Cat publishes two AWQ routes on a shape, the faster one is the engine's time
    assert tm[("awq", "5x17408x5120")][0] == 63.960 and tm[("awq", "5x5120x3072")][0] == 19.094
    beside = [r for r in rows if r["turbomind_us"] is not None]
    assert beside and all(r["table"] == "tp2" for r in beside)
    for r in beside:
        fam = "nvfp4" if r["fmt"] in ("nvfp4", "fp8") else "awq"
        assert r["turbomind_us"] == tm[(fam, f"{r['m']}x{r['n']}x{r['k']}")][0]
        assert r["speedup"] == pytest.approx(r["turbomind_us"] / r["est_us"])
    # all five NVFP4 shapes at M = 1 in both forms, on the NVFP4 route (like for like)
    nvfp4 = {(r["shape"], r["form"]) for r in beside if r["fmt"] == "nvfp4"}
    assert nvfp4 == {(s, f) for s in ("mlp_gate_up", "mlp_down", "gdn_in_proj_qkvz", "gdn_out_proj", "attn_qkv")
                     for f in ("s7", "restore")}
    assert all(r["m"] == 1 for r in beside if r["fmt"] == "nvfp4")
    if not any(r["fmt"] == "int4" for r in rows):
        assert any("AWQ" in n and "no QPN route" in n for n in notes)


@fast
def test_bands_merge_equal_estimates_only(estimate):
    _, _, rows, _ = estimate
    sub = [r for r in rows if r["table"] == "tp4" and r["shape"] == "mlp_down" and r["form"] == "s7"]
    bands = ve.bands(sub)
    assert [ve.m_text(b) for b in bands] == ["1-8", "9-16"]
    changed = [dict(r) for r in sub]
    changed[3]["est_us"] += 1.0
    assert [ve.m_text(b) for b in ve.bands(changed)] == ["1-3", "4", "5-8", "9-16"]


@fast
def test_the_files_are_labelled_estimates_with_provenance(tmp_path, estimate, monkeypatch):
    stats, trips, _, _ = estimate
    monkeypatch.setattr(pm, "kernel_stats", lambda atom, arch: stats)
    monkeypatch.setattr(vc, "our_m8n8k4_round_trips", lambda: trips)
    csv_path, md_path = ve.write(str(tmp_path), "20990101")
    text = open(md_path).read()
    assert "ESTIMATES, NOT V100 measurements" in text.splitlines()[0]
    for needed in ("commit:", "command:", "date:", "hardware:", vc.SEED_COMMIT, vc.ONECAT_COMMIT,
                   "Whole decode step per rank at TP4 (ESTIMATE)", "MoE:", "--check-m8n8k4"):
        assert needed in text, needed
    head = [l for l in open(csv_path) if l.startswith("#")]
    assert any(l.startswith("# label:") and "NOT a V100 measurement" in l for l in head)
    body = list(csv.DictReader(l for l in open(csv_path) if not l.startswith("#")))
    assert list(body[0]) == ve.COLUMNS and len(body) == len(ve.estimate_rows(stats, trips)[0])
    # the bootstrap's column reads this file
    lines = pm.v100_column_lines(str(tmp_path))
    assert "20990101" in lines[0] and len(lines) > 1 and all("est" in l for l in lines[1:])


@fast
def test_the_issues_awq_figures_are_the_archives_own():
    from tests._ci import onecat_archive

    doc = vc.read_onecat_file(str(onecat_archive("1.3.0")), vc.ONECAT_DOCS["awq_m5"]).splitlines()
    for shape, (us, match) in ve.ISSUE_26_AWQ_M5.items():
        line = next((ln for ln in doc if all(s in ln for s in match)), None)
        assert line is not None, (shape, match)
        assert f"{us:.3f} us" in line and shape in line


@fast
def test_int4_goal_lines_bound_each_shape_by_its_bytes_at_the_ceiling(estimate):
    _, _, rows, _ = estimate
    t0 = pm.v100_calibrated_constants().t0_us
    awq = [r for r in rows if r["speedup"] is not None and r["fmt"] == "int4"]
    lines = ve.int4_goal_lines(rows, t0)
    if not awq:
        assert lines == []
        return
    per_shape, verdict, issue = lines
    capped, floored = [], []
    for r in awq:
        # the ceiling time is the weight bytes (codes + records) at 879 GB/s, recomputed here
        # from the format, not from the estimate's own percentage
        floor_us = r["n"] * r["k"] * pm.bytes_per_weight("int4") / pm.V100_SXM2.read_ceiling_gbps / 1e3
        assert floor_us + t0 <= r["est_us"] + 1e-6  # no estimate beats the model's own floor
        assert f"the bytes alone take {floor_us:.1f} us" in per_shape, (r["shape"], per_shape)
        assert f"at most {r['turbomind_us'] / floor_us:.2f}x" in per_shape
        assert f"{r['turbomind_us'] / (floor_us + t0):.2f}x with t0" in per_shape
        issue_us = ve.ISSUE_26_AWQ_M5[f"{r['m']}x{r['n']}x{r['k']}"][0]
        assert f"{issue_us / r['est_us']:.2f}x the issue's" in per_shape
        if r["turbomind_us"] / floor_us < ve.INT4_GOAL:
            capped.append(r["shape"])
        elif r["turbomind_us"] / (floor_us + t0) < ve.INT4_GOAL:
            floored.append(r["shape"])
    missed = [r for r in awq if r["speedup"] < ve.INT4_GOAL]
    assert ("met." in verdict) == (not missed)
    if capped:
        assert f"on {', '.join(capped)} no kernel can reach it" in verdict
    if floored:
        assert f"on {', '.join(floored)} only a kernel under" in verdict
    assert ("no kernel can reach it" in verdict) == bool(capped)
    n_issue = sum(1 for r in awq if ve.ISSUE_26_AWQ_M5[f"{r['m']}x{r['n']}x{r['k']}"][0] / r["est_us"] >= ve.INT4_GOAL)
    assert f": {n_issue} of {len(awq)} shapes" in issue
