"""The performance model's pieces that need no GPU and no compiler: the SASS loop reader, the
occupancy arithmetic, the bound it reports, and the labelled V100 column the bootstrap prints after the sm70 build."""
import re

import pytest

from qpn.benchmarks import perf_model as pm
from qpn.kernels import routes


def _sass(lines):
    return [(0x10 * i, t) for i, t in enumerate(lines)]


def test_single_loop_counts_one_kblock_and_skips_the_group_end_code():
    # 0x00 setup; loop 0x10..0x90: 4 HMMA (one k-block of T=1, MT=1), a guarded group-end block
    # (STG + MEMBAR, skipped by a forward branch), backward branch.
    insts = _sass(["MOV R1, R2", "LDS.128 R4, [R0]", "HMMA.16816.F32 R8, R4, R6, R8", "HMMA.16816.F32 R8, R4, R6, R8",
                   "HMMA.16816.F32 R8, R4, R6, R8", "HMMA.16816.F32 R8, R4, R6, R8", "@P0 BRA 0x90",
                   "STG.E.U16 [R2], R3", "MEMBAR.GPU", "@P1 BRA 0x10"])
    instr, kind = pm.main_loop_instructions(insts, hmma_per_kblock=4)
    # loop body 0x10..0x90 = 9 instructions, minus the 2 of the skipped group-end region
    assert instr == 7 and "excluded" in kind


def test_nested_loop_weights_the_inner_loop_by_its_trip_count():
    # outer loop 0x00..0x60 holds an inner loop 0x20..0x40 with one HMMA; 4 HMMA per k-block.
    insts = _sass(["LDG.E.128 R4, [R2]", "IADD R1, R1, 1", "HMMA.884.F32 R8, R4, R6, R8", "IADD R5, R5, 1",
                   "@P0 BRA 0x20", "IADD R2, R2, 16", "@P1 BRA 0x0"])
    instr, kind = pm.main_loop_instructions(insts, hmma_per_kblock=4)
    # outer 7 instructions, inner 3 (0x20..0x40) run 4 times: 7 - 3 + 4 * 3 = 16 per k-block
    assert instr == 16 and "x4" in kind


def test_no_mma_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        pm.main_loop_instructions(_sass(["IADD R1, R1, 1", "@P0 BRA 0x0"]), 4)


def _k(regs, smem, inflight=4096, ipb=0.2, atom="m16n8k16", fmt="nvfp4"):
    return pm.KernelStats("k", atom, fmt, 1, 2, regs, smem, inflight, 2 * 16 * 64 * pm.bytes_per_weight(fmt),
                          ipb * 2 * 16 * 64 * pm.bytes_per_weight(fmt))


def test_resident_warps_from_registers_and_shared_memory():
    h = pm.h200(4400.0)
    assert pm.resident_warps(_k(128, 0), h) == 16          # 64K regs / (128 x 256)
    assert pm.resident_warps(_k(64, 0), h) == 32
    assert pm.resident_warps(_k(40, 0), h) == 48           # 40 regs: 6 blocks of 256 threads
    assert pm.resident_warps(_k(64, 106496), h) == 16      # 2 blocks of 104 KB fit 228 KB
    assert pm.resident_warps(_k(64, 106496), pm.V100_SXM2) == 0   # a 104 KB block does not fit 96 KB


def test_predict_names_the_binding_limit():
    h = pm.h200(4400.0)
    c = pm.Constants(latency_us=1.0, ipc=4.0, t0_us=0.0)
    n, k = 34816, 5120
    # tiny issue cost and a deep ring: the read ceiling binds and the share is 100%
    p = pm.predict(_k(64, 0, inflight=1 << 20, ipb=0.001), h, n, k, c)
    assert p["bound"] == "read ceiling" and p["pct"] == pytest.approx(100.0)
    # many issue slots per byte: issue-bound, slower than the ceiling
    p = pm.predict(_k(64, 0, inflight=1 << 20, ipb=2.0), h, n, k, c)
    assert p["bound"] == "issue" and p["pct"] < 100
    # a shallow ring: latency-bound
    p = pm.predict(_k(64, 0, inflight=256, ipb=0.001), h, n, k, c)
    assert p["bound"] == "latency"


def test_v100_column_is_labelled_an_estimate(tmp_path):
    head = ("# commit: x\ntable,shape,checkpoint_fmt,fmt,form,n,k,m,kernel,est_us,est_pct,bound,inflight_warp,seed_pct,"
            "seed_verdict,turbomind_us,speedup,turbomind_what\n")
    rows = ["tp4,mlp_down,nvfp4,nvfp4,s7,5120,4352,1,qpn2_mt1_s7_m8n8k4,20.00,70.00,latency,1700,77.30,below,,,",
            "tp4,mlp_down,nvfp4,nvfp4,s7,5120,4352,2,qpn2_mt1_s7_m8n8k4,20.00,70.00,latency,1700,77.30,below,,,",
            "tp2,mlp_gate_up,nvfp4,nvfp4,s7,17408,5120,1,qpn2_mt1_s7_m8n8k4,60.00,90.00,issue,1700,,,90.60,1.51,x",
            "tp2,attn_qkv,fp8,nvfp4,s7,7168,5120,1,qpn2_mt1_s7_m8n8k4,27.00,86.00,issue,1700,,,47.60,1.76,x"]
    (tmp_path / "perf_model_v100_estimate_20990101.csv").write_text(head + "\n".join(rows) + "\n")
    lines = pm.v100_column_lines(str(tmp_path))
    assert "NOT a V100 measurement" in lines[0] and "published V100 measurements" in lines[0]
    # one line per route and band (M=2 repeats M=1's estimate), the checkpoint's own formats only
    assert len(lines) == 3, lines
    assert "seed 000" in lines[1] and "est    20.0 us" in lines[1] and "from M= 1" in lines[1]
    assert "1Cat TurboMind 90.6 us at M=1 (engine's figure) = 1.51x" in lines[2]
    assert "no results" in pm.v100_column_lines(str(tmp_path / "empty"))[0]


@pytest.mark.parametrize("sms", [80, 132])
def test_sm70_split_keeps_the_grid_in_one_resident_wave(sms):
    from qpn.kernels import ops
    wave = ops.SM70_RESIDENT_WARPS * sms
    for n_tiles in list(range(1, 400)) + [1940, 2559, 2560, 2561, 7760]:
        for kblocks in (1, 2, 3, 48, 160):
            for m_chunks in (1, 3):
                ks, tpb = ops.sm70_split(n_tiles, kblocks, m_chunks, sms)
                assert ks * tpb == 8 and ks in (1, 2, 4, 8) and ks <= max(1, kblocks)
                warps = n_tiles * m_chunks * ks
                assert ks == 1 or warps <= wave          # never split into a second wave
                # and split as far as that allows (doubling would break a limit)
                assert ks == 8 or 2 * ks > kblocks or 2 * warps > wave
    # the V100's TP4 shapes: lm_head (1,940 tiles) unsplit in one wave; gate_up / down split 8 ways
    assert ops.sm70_split(1940, 160, 1, 80) == (1, 8)
    assert ops.sm70_split(272, 160, 1, 80) == (8, 1) and ops.sm70_split(160, 136, 1, 80) == (8, 1)


def test_sm70_in_flight_is_read_from_the_decoders():
    from qpn.kernels import jit
    fam = jit.decoder_source("m8n8k4")
    decs = ("DecNVFP4", "DecNVFP4S7", "DecFP8")
    got = {(d, mt): pm.sm70_kblocks_in_flight(fam, d, mt) for d in decs for mt in (1, 2)}
    assert got == {("DecNVFP4", 1): 3, ("DecNVFP4", 2): 3, ("DecNVFP4S7", 1): 4, ("DecNVFP4S7", 2): 3,
                   ("DecFP8", 1): 3, ("DecFP8", 2): 2}
    # each count comes from its own constant of its own decoder (and, in the template, its own form)
    edited = fam.replace("static constexpr int KBLOCKS_AHEAD_MT2 = 1;", "static constexpr int KBLOCKS_AHEAD_MT2 = 5;")
    assert pm.sm70_kblocks_in_flight(edited, "DecFP8", 2) == 6 and pm.sm70_kblocks_in_flight(edited, "DecFP8", 1) == 3
    assert pm.sm70_kblocks_in_flight(edited, "DecNVFP4", 2) == 3
    edited = fam.replace("static constexpr int KBLOCKS_AHEAD = S7 ? 3 : 2;\n  static constexpr int KBLOCKS_AHEAD_MT2 = 2;",
                         "static constexpr int KBLOCKS_AHEAD = S7 ? 2 : 5;\n  static constexpr int KBLOCKS_AHEAD_MT2 = 2;")
    assert edited != fam
    assert pm.sm70_kblocks_in_flight(edited, "DecNVFP4", 1) == 6 and pm.sm70_kblocks_in_flight(edited, "DecNVFP4S7", 1) == 3
    assert pm.sm70_kblocks_in_flight(edited, "DecFP8", 1) == 3
    with pytest.raises(ValueError, match="KBLOCKS_AHEAD"):
        pm.sm70_kblocks_in_flight(fam.replace("KBLOCKS_AHEAD", "AHEAD"), "DecFP8", 1)


def test_sm70_entries_are_read_from_the_entry_macros():
    from qpn.kernels import jit
    entries = pm.sm70_linear_entries(jit.kernel_sources()[jit.ATOM_SOURCES["m8n8k4"]])
    # every GEMM entry point the build requires, and nothing else (not the macro's own #define)
    # (INT4's included: the V100 estimate covers it)
    assert set(entries) == {e for e in jit.ENTRY_POINTS["m8n8k4"] + jit.UNSERVED_ENTRY_POINTS["m8n8k4"]
                            if "reconstruct" not in e}
    assert entries["qpn4_sym_mt2_m8n8k4"] == ("DecINT4Sym", 2)
    assert entries["qpn2_mt1_s7_m8n8k4"] == ("DecNVFP4S7", 1) and entries["qpn2_mt2_s7_m8n8k4"] == ("DecNVFP4S7", 2)
    assert entries["qpn2_mt1_m8n8k4"] == ("DecNVFP4", 1) and entries["qpn8_mt2_m8n8k4"] == ("DecFP8", 2)
    # the decoder is the macro's argument, whatever the name says
    edited = pm.sm70_linear_entries("QPN_LINEAR_ENTRY(qpn2_mt1_s7_m8n8k4, AtomM8N8K4, DecNVFP4, 2)\n")
    assert edited == {"qpn2_mt1_s7_m8n8k4": ("DecNVFP4", 2)}


def _m8n8k4_run(path, stats, trips, c, gpu_line, atom="m8n8k4", read=879.0, form=None):
    """A kernel_matched_bench CSV as a V100 run would write it, its times those of the V100-form
    model under constants c (so a fit on it must find c again); ``form``: the NVFP4 form its header
    names (None: a header from before the forms, which ran the restore form)."""
    gpu = pm.Gpu("v", 80, pm.V100_SXM2.clock_ghz, 65536, 96 * 1024, 64, read, "run")
    named = f"; m8n8k4 NVFP4 form: {form}" if form else ""
    lines = [f"# gpu: {gpu_line}", "# commit: abc", "# date: 2099-01-01T00:00:00Z",
             f"# qpn atom: {atom}{named}; sm_80+ route kernels: ...", f"# read_ceiling_gbps: {read}",
             "shape,fmt,n,k,m,arm,route,graph_us"]
    for shape, (fmt, n, k) in pm.TP4_SHAPES.items():
        for m in (1, 8, 16):
            kname = pm.kernel_for(fmt, m, form or "restore")
            route = str(routes.tiled_route(fmt, 1 if m <= 8 else 2))
            us = pm.predict_v100_calibrated(stats[kname], n, k, trips[kname], c, gpu)["us"]
            lines.append(f"{shape},{fmt},{n},{k},{m},qpn,{route},{us:.4f}")
            lines.append(f"{shape},{fmt},{n},{k},{m},torch_fp16,fp16,{2 * us:.4f}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_estimate_is_checked_against_a_measured_m8n8k4_run(tmp_path, sm70_toolchain):
    from qpn.benchmarks import v100_calibration as vc
    stats, trips = pm.kernel_stats("m8n8k4", 70), vc.our_m8n8k4_round_trips()
    cal = pm.v100_calibrated_constants()
    v100 = pm.Constants(cal.latency_us, cal.ipc, cal.t0_us - 2.0)   # a V100 whose fixed cost per call is 2 us less
    run = _m8n8k4_run(tmp_path / "kernel_matched.csv", stats, trips, v100, "Tesla V100-SXM2-32GB (sm_70, 80 SMs)")
    md = pm.check_m8n8k4(run, str(tmp_path), "20990101", stats=stats, trips=trips)
    text = open(md).read()
    assert "measured on a V100" in text and "NOT a V100" not in text
    assert f"t0 = {cal.t0_us} us" in text
    rows = list(__import__("csv").DictReader(l for l in open(md.replace(".md", ".csv")) if not l.startswith("#")))
    assert len(rows) == 15 and {r["route"] for r in rows} == {"qpn2", "qpn2_mt2", "qpn8", "qpn8_mt2"}
    for r in rows:   # the calibration over-predicts every call by the 2 us of t0; the run's own fit nearly not
        assert abs(float(r["pred_us"]) - float(r["us"]) - 2.0) < 0.01
        assert abs(float(r["refit_err_pct"])) < 1.0
    own = re.search(r"this run's own fit: L = [\d.]+ us, IPC = [\d.]+, t0 = ([\d.]+) us", text)
    assert own and abs(float(own.group(1)) - v100.t0_us) < 0.3
    other = _m8n8k4_run(tmp_path / "h200.csv", stats, trips, v100, "NVIDIA H200 (sm_90, 132 SMs)")
    assert "NOT a V100" in open(pm.check_m8n8k4(other, str(tmp_path), "x", stats=stats, trips=trips)).read()
    sm80 = _m8n8k4_run(tmp_path / "sm80.csv", stats, trips, v100, "NVIDIA H200 (sm_90, 132 SMs)", atom="m16n8k16")
    with pytest.raises(ValueError, match="m16n8k16"):
        pm.m8n8k4_observations(sm80)
    # a run whose header names the S7 form is checked against the S7 kernels (FP8 has one form)
    for form, nvfp4 in (("s7", {"qpn2_mt1_s7_m8n8k4", "qpn2_mt2_s7_m8n8k4"}),
                        ("restore", {"qpn2_mt1_m8n8k4", "qpn2_mt2_m8n8k4"})):
        run = _m8n8k4_run(tmp_path / f"{form}.csv", stats, trips, v100, "Tesla V100-SXM2-32GB (sm_70, 80 SMs)",
                          form=form)
        assert {o["kernel"] for o in pm.m8n8k4_observations(run)[2]} == nvfp4 | {"qpn8_mt1_m8n8k4", "qpn8_mt2_m8n8k4"}


def test_t0_is_bounded_by_the_fastest_call():
    h = pm.h200(4000.0)
    k = _k(64, 0, inflight=1 << 20, ipb=0.001)          # never issue- or latency-bound: t = t0 + B / 4000 GB/s
    stats = {"k": k}
    nbytes = lambda n, kd: n * kd * pm.bytes_per_weight("nvfp4") / 4000.0 / 1e3
    obs = [dict(kernel="k", n=n, k=5120, us=nbytes(n, 5120) + extra) for n, extra in ((65536, 3.0), (4096, 9.0), (8192, 9.0))]
    assert pm.t0_bound(stats, h, obs) == pytest.approx(3.0)
    best = pm.calibrate(stats, h, obs)
    assert best.t0_us > 3.0                              # the unbounded fit follows the two small, slow calls
    bounded = pm.calibrate(stats, h, obs, t0_max=pm.t0_bound(stats, h, obs))
    assert bounded.t0_us <= 3.0 and pm.fit_error(stats, h, obs, bounded) >= pm.fit_error(stats, h, obs, best)
