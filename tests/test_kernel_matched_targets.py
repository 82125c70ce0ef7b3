"""kernel_matched_bench's target table (issues 14 and 26), its gemlite arm's skip reason and its INT4
dequantize-then-matmul arm (no GPU needed)."""
import torch

from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import layout as int4_layout
from qpn.benchmarks import kernel_matched_bench as kb


def _row(shape, arm, m, pct, us):
    return dict(shape=shape, arm=arm, m=m, graph_pct_read=pct, eager_pct_read=pct, graph_us=us, eager_us=us)


def test_issue14_targets_use_the_issue14_goals():
    rows = [_row("tp1_lm_head", "qpn", 1, 91.0, 100.0), _row("tp1_lm_head", "qpn", 8, 89.0, 101.0),
            _row("tp1_lm_head", "torch_fp16", 1, 95.0, 310.0),
            _row("tp1_gdn_out_proj", "qpn", 1, 86.0, 8.0), _row("tp1_gdn_out_proj", "qpn", 16, 80.0, 9.0),
            _row("tp1_gdn_out_proj", "scaled_mm", 1, 70.0, 8.0), _row("tp1_gdn_out_proj", "scaled_mm", 16, 70.0, 8.9),
            _row("tp4_mlp_down", "qpn", 4, 76.0, 3.0), _row("tp4_mlp_down", "qpn", 16, 10.0, 30.0)]
    got = {(t["column"], t["shape"], t["target"]): t for t in kb.targets(rows)}
    lm = got[("graph", "tp1_lm_head", "% read ceiling, M 1-8 (min)")]
    assert lm["goal"] == 90.0 and lm["measured"] == 89.0 and not lm["met"]     # the minimum over M 1-8
    assert ("graph", "tp1_lm_head", "% read ceiling, M 9-16 (min)") not in got     # no M 9-16 goal for lm_head
    fp16 = got[("graph", "tp1_lm_head", "x faster than torch FP16 GEMM, M=1")]
    assert fp16["goal"] == 3.0 and fp16["measured"] == 3.1 and fp16["met"]
    sm = got[("graph", "tp1_gdn_out_proj", "x faster than torch._scaled_mm, M<=16 (min)")]
    assert sm["goal"] == 1.0 and abs(sm["measured"] - 8.9 / 9.0) < 1e-9 and not sm["met"]   # slower at M=16
    tp4 = got[("graph", "tp4_mlp_down", "% read ceiling, M 1-8 (min)")]
    assert tp4["goal"] == 75.0 and tp4["met"]                                    # M=16 is outside M 1-8
    md = kb.targets_markdown(kb.targets(rows), {"gpu": "X", "host_us_per_call (256x256)": "qpn=40.0, torch=15.0",
                                                "command": "python -m qpn.benchmarks.kernel_matched_bench --m 1"})
    assert "Kernel targets (issues 14 and 26) on X" in md and "Host time per eager call" in md and "qpn=40.0" in md
    assert "command: python -m qpn.benchmarks.kernel_matched_bench --m 1" in md   # provenance beside the figures


def test_targets_carry_the_same_runs_read_limit_and_flag_goals_above_it():
    rows = [_row("tp4_mlp_down", "qpn", 1, 24.0, 12.0), _row("tp4_mlp_down", "qpn", 8, 23.0, 12.5),
            _row("tp4_mlp_down", "read_limit", 1, 58.0, 5.0), _row("tp4_mlp_down", "read_limit", 8, 60.0, 4.9),
            _row("tp4_mlp_down", "read_limit", 16, 99.0, 3.0),   # outside M 1-8: not this target's limit
            _row("tp1_mlp_gate_up", "qpn", 1, 56.0, 40.0), _row("tp1_mlp_gate_up", "read_limit", 1, 94.0, 24.0),
            _row("tp1_mlp_gate_up", "torch_fp16", 1, 95.0, 90.0)]
    got = {(t["column"], t["shape"], t["target"]): t for t in kb.targets(rows)}
    down = got[("graph", "tp4_mlp_down", "% read ceiling, M 1-8 (min)")]
    assert down["read_limit"] == 60.0 and not down["met"]        # the best pure read over M 1-8
    assert got[("graph", "tp1_mlp_gate_up", "% read ceiling, M 1-8 (min)")]["read_limit"] == 94.0
    assert got[("graph", "tp1_mlp_gate_up", "x faster than torch FP16 GEMM, M=1")]["read_limit"] is None
    md = kb.targets_markdown(kb.targets(rows), {"gpu": "X"})
    assert "| 60.00 (below goal) |" in md       # 75 % goal, no single kernel reads that layer that fast
    assert "| 94.00 |" in md and "| 94.00 (below goal)" not in md
    assert kb.targets([r for r in rows if r["arm"] != "read_limit"])[0]["read_limit"] is None
    # eager rows carry none: there the probe's host launch path is timed too
    assert got[("eager", "tp4_mlp_down", "% read ceiling, M 1-8 (min)")]["read_limit"] is None


def test_band_table_compares_the_band_kernel_with_the_16_row_chunks_and_torch():
    rows = [_row("tp1_mlp_gate_up", "qpn", 64, 70.0, 40.0), _row("tp1_mlp_gate_up", "qpn_chunk16", 64, 20.0, 160.0),
            _row("tp1_mlp_gate_up", "torch_fp16", 64, 90.0, 90.0),
            _row("tp1_mlp_gate_up", "qpn", 16, 40.0, 50.0),            # M 9-16: not the band
            _row("tp4_mlp_down", "qpn", 32, 30.0, 20.0),               # TP4: not in the table
            _row("tp1_gdn_out_proj", "qpn", 32, 50.0, 10.0), _row("tp1_gdn_out_proj", "scaled_mm", 32, 60.0, 12.5)]
    lines = kb.band_table(rows)
    body = [ln for ln in lines if ln.startswith("| tp")]
    assert body == ["| tp1_mlp_gate_up | 64 | 40.0 | 70.0 | 160.0 | 90.0 | - | 4.00 | 2.25 |",
                    "| tp1_gdn_out_proj | 32 | 10.0 | 50.0 | - | - | 12.5 | - | 1.25 |"]
    assert kb.band_table([r for r in rows if r["m"] <= 16]) == []
    md = kb.targets_markdown([], {"gpu": "X"}, rows)
    assert "## M band" in md and "| timing | shape |" not in md and "No row of this run" in md


def test_gemlite_arm_is_skipped_with_the_reason_when_not_importable(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_gemlite(name, *a, **k):
        if name.startswith("gemlite"):
            raise ImportError("No module named 'gemlite'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gemlite)
    monkeypatch.setattr(kb, "GEMLITE_STATE", {"reason": None, "mode": None})
    layer, nbytes, why = kb.gemlite_layer(None, 16, 64, None)
    assert layer is None and nbytes == 0 and why.startswith("gemlite not importable") and "gemlite" in why


def test_int4_goal_is_2p5x_torch_fp16_at_m1_on_the_tp1_shapes():
    rows = [_row("int4_tp1_mlp_gate_up", "qpn", 1, 70.0, 36.0), _row("int4_tp1_mlp_gate_up", "torch_fp16", 1, 95.0, 90.0),
            _row("int4_tp1_mlp_down", "qpn", 1, 60.0, 20.0), _row("int4_tp1_mlp_down", "torch_fp16", 1, 95.0, 49.0),
            _row("int4_tp1_mlp_down", "qpn", 8, 60.0, 5.0), _row("int4_tp1_mlp_down", "torch_fp16", 8, 95.0, 49.0),
            _row("int4_tp2_mlp_down", "qpn", 1, 60.0, 1.0), _row("int4_tp2_mlp_down", "torch_fp16", 1, 95.0, 49.0)]
    got = {(t["column"], t["shape"], t["target"]): t for t in kb.targets(rows)}
    gu = got[("graph", "int4_tp1_mlp_gate_up", "x faster than torch FP16 GEMM, M=1")]
    assert gu["goal"] == 2.5 and gu["measured"] == 2.5 and gu["met"]
    dn = got[("graph", "int4_tp1_mlp_down", "x faster than torch FP16 GEMM, M=1")]
    assert abs(dn["measured"] - 2.45) < 1e-9 and not dn["met"]       # M = 8's 9.8x does not count
    assert not any(shape == "int4_tp2_mlp_down" for _, shape, _ in got)   # the goal is at TP1


def test_int4_naive_dequant_matches_the_family_reference_over_every_byte_and_zero():
    gen = torch.Generator().manual_seed(3)
    n, k, g = 16, 512, kb.INT4_GROUP
    codes = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, k // 2)
    codes = codes[:, torch.randperm(k // 2, generator=gen)]                # every byte value, shuffled
    sc = (torch.rand((n, k // g), generator=gen) * 0.03 + 0.002).to(torch.float16)
    zr = torch.arange(n * k // g).remainder(16).to(torch.uint8).view(n, k // g)   # every zero point
    got = kb.NaiveDequant.int4(codes, sc, zr)
    want = int4_codec.dequantize(codes, sc, zr).to(torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_sweep_trials_are_the_weights_own_members_kernels_and_the_routes_own_kernel():
    """A sweep point times only kernels that can run the packed weight (INT4's symmetric kernels
    never on asymmetric weights, which run_sm80_kernel refuses mid-sweep), always the kernel the
    route runs on that layer (sm80_plan's choice for that many rows), and that kernel at each extra
    split-K setting."""
    from qpn.kernels import formats, routes, sm80_plan, sm80_tables
    kernels = sm80_plan.sm80_kernels()
    gen = torch.Generator().manual_seed(3)
    for sym, member in ((False, formats.INT4), (True, formats.INT4_SYM)):
        for n in (5120, 34816):
            src = int4_codec.quantize(torch.randn((n, 128), generator=gen), 128, symmetric=sym)
            p = int4_layout.prepack(*src, atom="m16n8k16")
            trials = kb.sweep_trials(kernels, p, "qpn4", 1, min_items=(24,), default_items=4)
            names = [kn for kn, _ in trials]
            want = sm80_plan.sm80_kernel_for(routes.as_route("qpn4"), 1, n, member)[0]
            assert want == sm80_tables.SM80_ROUTE_KERNELS[(member, 1)]
            assert want in names and trials[-1] == (want, 24)
            assert all(kernels[kn].weight_format is member and kernels[kn].mt == 1 for kn in names), names
            assert any(kn.startswith("qpn4_sym_") for kn in names) == sym
            narrowed = kb.sweep_trials(kernels, p, "qpn4", 1, only=("loadonly",))
            assert {kn for kn, _ in narrowed} == {want} | {kn for kn in names if "loadonly" in kn}
            mt2 = kb.sweep_trials(kernels, p, "qpn4_mt2", 16)
            assert sm80_tables.SM80_ROUTE_KERNELS[(member, 2)] in {kn for kn, _ in mt2}
            assert all(kernels[kn].mt == 2 for kn, _ in mt2)
