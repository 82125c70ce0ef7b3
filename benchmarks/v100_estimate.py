"""Our V100 estimate under the V100 calibration (issue 27 item 2): every m8n8k4 (SM70) GEMM route,
per shape at TP4 and TP2, M = 1..16, beside seed 000's measured level and 1Cat-vLLM's published
TurboMind time on the same shape, with the ratio; the whole decode step per rank at TP4 and the
drafter's lm_head. Every figure of ours is an ESTIMATE from the model that
benchmarks/v100_calibration.py fits on published V100 measurements, never a measurement.

    python -m qpn.benchmarks.v100_estimate [--out-dir results] [--stamp YYYYMMDD]

writes results/perf_model_v100_estimate_<stamp>.{csv,md} (the files the bootstrap's sm70 step
prints, ``perf_model --v100-column``, and ``perf_model --check-m8n8k4`` compares a V100's own
times with). The model needs no GPU: the kernels are compiled for sm_70 on this host (NVRTC,
ptxas, cuobjdump) and their static figures fed to ``perf_model.predict_v100_calibrated``.

What the model sees and what it does not (benchmarks/v100_calibration.py says why per point):
within a band of M that one kernel serves (1-8: one token tile, 9-16: two) it has no term in M,
so the rows of a band agree; the seed's own M = 1 -> 8 drop comes from predicated activation
loads it does not describe. The MoE kernels are not estimated (``MOE_NOT_ESTIMATED``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

from qpn.kernels import formats, ops, routes

from . import perf_model as pm
from . import v100_calibration as vc

MS = tuple(range(1, 17))
# Per-rank shapes (N x K) of Qwen3.8-27B (Qwen3.5-27B geometry: hidden 5120, MLP 17408, 64 layers,
# 48 linear-attention (GDN) + 16 full-attention, vocab 248320), in the checkpoint's own formats:
# MLP and lm_head NVFP4, attention projections FP8. TP4 is seed 000's serving layout, TP2 1Cat's.
SHAPES = {
    "tp4": {"mlp_gate_up": ("nvfp4", 8704, 5120), "mlp_down": ("nvfp4", 5120, 4352),
            "lm_head": ("nvfp4", 62080, 5120), "gdn_in_proj_qkvz": ("fp8", 4096, 5120),
            "gdn_out_proj": ("fp8", 5120, 1536), "attn_qkv": ("fp8", 3584, 5120)},
    "tp2": {"mlp_gate_up": ("nvfp4", 17408, 5120), "mlp_down": ("nvfp4", 5120, 8704),
            "lm_head": ("nvfp4", 124160, 5120), "gdn_in_proj_qkvz": ("fp8", 8192, 5120),
            "gdn_out_proj": ("fp8", 5120, 3072), "attn_qkv": ("fp8", 7168, 5120)},
}
# 1Cat's TurboMind figures are for its own checkpoints: NVFP4 everywhere (its NVFP4 operator note)
# and AWQ INT4 (its AWQ notes). On the attention shapes, where our checkpoint is FP8, the NVFP4
# kernel is estimated too, so that each TurboMind time stands beside a QPN route of its own format.
LIKE_FOR_LIKE = {"nvfp4": ("nvfp4", "fp8"), "awq": ("int4",)}
# The seed's measured groups (v100_calibration.SEED_POINTS) each TP4 shape belongs to: the trunk
# aggregate holds the MLP shapes, lm_head its own, fp8 the attention projections.
SEED_GROUP = {"mlp_gate_up": "trunk", "mlp_down": "trunk", "lm_head": "lm_head", "gdn_in_proj_qkvz": "fp8",
              "gdn_out_proj": "fp8", "attn_qkv": "fp8"}
MOE_NOT_ESTIMATED = (
    "the MoE GEMM kernels (csrc/qpn_moe.cu) are not estimated: they launch one block row per (expert, "
    "8-row group) of the routed pairs, so their waves and bytes depend on the routing, which the dense "
    "model's occupancy term does not describe, and no published V100 time of a grouped NVFP4/FP8 MoE "
    "kernel exists to calibrate it on; scripts/v100-evidence.sh's moe step measures them on the owner's V100")


# The four V100 times issue 26 quotes as its INT4 yardstick (its table, "% of 879 GB/s" beside
# them). In 1Cat's note they are Nsight Compute durations of its exact-M5 FP16 GEMV prototype, not
# the accepted latency of the engine's TurboMind GEMM (the note: NCU "locks/replays the kernel, so
# its duration is used only for same-report attribution"); they are set beside our estimate as the
# issue's own figures, the engine's fastest accepted time (turbomind_times) as the real yardstick.
# (shape key -> (us, the doc line's substrings, checked against the archive by the tests))
ISSUE_26_AWQ_M5 = {
    "5x17408x5120": (85.056, ("gate/up `5x17408x5120`", "| 85.056 us |")),
    "5x5120x8704": (54.304, ("down `5x5120x8704`", "| 54.304 us |")),
    "5x8192x5120": (49.920, ("qkv/z `5x8192x5120`", "| 49.920 us |")),
    "5x5120x3072": (25.600, ("out `5x5120x3072`", "| 25.600 us |")),
}
ISSUE_26_WHAT = ("1Cat's exact-M5 FP16 GEMV prototype, Nsight Compute duration "
                 f"({vc.ONECAT_DOCS['awq_m5']}, its NCU table)")
INT4_GOAL = 1.3  # issue 26: at least 1.3x TurboMind AWQ at M <= 8 on every shape, estimated


def int4_goal_lines(rows: list[dict], t0_us: float) -> list[str]:
    """Issue 26's INT4 goal per shape at M = 5: the estimate against 1Cat's fastest accepted
    TurboMind AWQ time; the most any kernel could gain over that time on the model's V100 (the
    layer's bytes alone at the read ceiling; and with the model's fixed cost per call t0 on top,
    the floor no single launch per layer goes under); and the issue's own figures."""
    awq = [r for r in rows if r["speedup"] is not None and r["fmt"] == "int4"]
    if not awq:
        return []
    out, capped, floored = [], [], []
    for r in awq:
        floor_us = r["est_us"] * r["est_pct"] / 100.0  # the bytes at 879 GB/s
        if r["turbomind_us"] / floor_us < INT4_GOAL:
            capped.append(r["shape"])
        elif r["turbomind_us"] / (floor_us + t0_us) < INT4_GOAL:
            floored.append(r["shape"])
        issue = ISSUE_26_AWQ_M5.get(_shape_key(r["m"], r["n"], r["k"]))
        out.append(f"{r['shape']}: {r['speedup']:.2f}x the accepted {r['turbomind_us']:.1f} us (at most "
                   f"{r['turbomind_us'] / floor_us:.2f}x: the bytes alone take {floor_us:.1f} us at 879 GB/s; "
                   f"{r['turbomind_us'] / (floor_us + t0_us):.2f}x with t0)"
                   + (f", {issue[0] / r['est_us']:.2f}x the issue's {issue[0]:.1f} us" if issue else ""))
    met = [r for r in awq if r["speedup"] >= INT4_GOAL]
    vs_issue = [r for r in awq if (i := ISSUE_26_AWQ_M5.get(_shape_key(r["m"], r["n"], r["k"])))
                and i[0] / r["est_us"] >= INT4_GOAL]
    why = []
    if capped:
        why.append(f"on {', '.join(capped)} no kernel can reach it: the read ceiling caps the gain below {INT4_GOAL}x")
    if floored:
        why.append(f"on {', '.join(floored)} only a kernel under the model's fixed cost per call (t0 = {t0_us:.2f} us), "
                   "i.e. fused with its neighbours, could")
    return [
        "INT4 (its m8n8k4 kernels) against 1Cat's TurboMind AWQ at M = 5, estimated: " + "; ".join(out) + ".",
        f"Issue 26's goal ({INT4_GOAL}x on every shape) against the engine's fastest accepted time: "
        + ("met." if len(met) == len(awq) else
           f"MISSED on {len(awq) - len(met)} of {len(awq)} shapes" + "".join(f"; {w}" for w in why) + "."),
        f"Against the figures the issue quotes ({ISSUE_26_WHAT}): {len(vs_issue)} of {len(awq)} shapes at "
        f"{INT4_GOAL}x or more.",
    ]


def _shape_key(m: int, n: int, k: int) -> str:
    return f"{m}x{n}x{k}"


def turbomind_times() -> dict[tuple[str, str], tuple[float, str]]:
    """(1Cat family, 'MxNxK') -> (published V100 us, what) of every TurboMind row of the
    calibration's left-out table; where a family has two routes on a shape, the faster."""
    out: dict[tuple[str, str], tuple[float, str]] = {}
    for row in vc.ONECAT_LEFT_OUT:
        if row.why != vc.WHY_TURBOMIND:
            continue
        fam = "nvfp4" if row.doc == "nvfp4" else "awq"
        key = (fam, row.shape)
        if key not in out or row.us < out[key][0]:
            out[key] = (row.us, f"{row.what} ({vc.ONECAT_DOCS[row.doc]})")
    return out


def seed_levels() -> dict[tuple[str, int], float]:
    """(seed group, M) -> seed 000's measured % of its 879 GB/s read ceiling."""
    return {(p.group, p.m): p.measured_pct for p in vc.SEED_POINTS}


def kernel_for(fmt: str, m: int, form: str, n: int = 5120, k: int = 5120) -> str | None:
    """Our m8n8k4 kernel for ``fmt`` at M <= 16 (the route ops takes; INT4: its asymmetric member,
    the family's first; a staged family's too, formats.py); None where there is none."""
    try:
        route = routes.route_for(fmt, m, n, k, arch="sm70", served_only=False)
        return ops.route_kernel(route, m, form)[0] + "_m8n8k4"
    except (KeyError, ValueError, formats.FormatError):
        return None


def families() -> list[str]:
    """Weight families with m8n8k4 kernels (formats.KERNEL_FAMILIES), served or not, in registry order."""
    return [name for name, f in formats.KERNEL_FAMILIES.items() if "m8n8k4" in f.kernel_atoms]


def same_width_peers(fmt: str) -> list[str]:
    """The families with m8n8k4 kernels whose codes are as wide as ``fmt``'s but of the other kind
    (integer beside minifloat), in registry order."""
    own = formats.KERNEL_FAMILIES[fmt]
    return [f for f in families() if formats.KERNEL_FAMILIES[f].code_bits == own.code_bits
            and formats.KERNEL_FAMILIES[f].code_type != own.code_type]


def estimate_rows(stats=None, trips=None, c=None) -> tuple[list[dict], list[str]]:
    """One row per (table, shape, family, NVFP4 form, M): our estimate beside the seed's level and
    1Cat's TurboMind time; and the (family, reason) notes for what has no kernel to estimate."""
    stats = stats if stats is not None else pm.kernel_stats("m8n8k4", 70)
    trips = trips if trips is not None else vc.our_m8n8k4_round_trips()
    c = c or pm.v100_calibrated_constants()
    tm, seed = turbomind_times(), seed_levels()
    rows, notes = [], []
    for table, shapes in SHAPES.items():
        for shape, (own_fmt, n, k) in shapes.items():
            # the checkpoint's own format; beside it the families whose codes are as wide but of the
            # other kind (FP8's shapes: INT8; NVFP4's: INT4), the form other exports of the same
            # model take; at TP2 also each format a TurboMind time is of
            fmts = [own_fmt] + same_width_peers(own_fmt) + (
                [f for fam in LIKE_FOR_LIKE.values() for f in fam[:1] if f in families()] if table == "tp2" else [])
            for fmt in dict.fromkeys(fmts):
                for form in ops.NVFP4_FORMS if fmt == "nvfp4" else ("-",):
                    for m in MS:
                        kname = kernel_for(fmt, m, form if form != "-" else "restore", n, k)
                        if kname is None or kname not in stats:
                            note = f"{fmt}: no m8n8k4 tiled kernel to estimate"
                            if note not in notes:
                                notes.append(note)
                            continue
                        p = pm.predict_v100_calibrated(stats[kname], n, k, trips[kname], c)
                        lvl = seed.get((SEED_GROUP[shape], m)) if table == "tp4" and fmt == own_fmt else None
                        fam = next((f for f, v in LIKE_FOR_LIKE.items() if fmt in v), None)
                        tmt = tm.get((fam, _shape_key(m, n, k))) if table == "tp2" and fam else None
                        rows.append(dict(table=table, shape=shape, checkpoint_fmt=own_fmt, fmt=fmt, form=form, n=n,
                                         k=k, m=m, kernel=kname, est_us=p["us"], est_pct=p["pct"], bound=p["bound"],
                                         inflight_warp=p["inflight_warp"], seed_pct=lvl,
                                         seed_verdict=("" if lvl is None else "below" if p["pct"] < lvl else "at or above"),
                                         turbomind_us=tmt[0] if tmt else None, turbomind_what=tmt[1] if tmt else "",
                                         speedup=(tmt[0] / p["us"]) if tmt else None))
    for fam, fmts in LIKE_FOR_LIKE.items():
        if not any(r["fmt"] in fmts for r in rows):
            times = ", ".join(f"{shape} {us:.1f} us" for (f, shape), (us, _) in sorted(tm.items()) if f == fam)
            notes.append(f"1Cat TurboMind {fam.upper()} ({times}): no QPN route of its format ({', '.join(fmts)}) has an "
                         "m8n8k4 kernel yet, so there is no estimate to set beside it")
    return rows, notes


COLUMNS = ["table", "shape", "checkpoint_fmt", "fmt", "form", "n", "k", "m", "kernel", "est_us", "est_pct", "bound",
           "inflight_warp", "seed_pct", "seed_verdict", "turbomind_us", "speedup", "turbomind_what"]


def bands(rows: list[dict]) -> list[list[dict]]:
    """Rows of one route merged over consecutive M of equal estimate (the model's bands)."""
    out: list[list[dict]] = []
    for r in rows:
        last = out[-1][-1] if out else None
        if last and all(last[k] == r[k] for k in ("table", "shape", "fmt", "form", "kernel")) \
                and abs(last["est_us"] - r["est_us"]) < 1e-9 and last["m"] + 1 == r["m"]:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def m_text(band: list[dict]) -> str:
    return str(band[0]["m"]) if len(band) == 1 else f"{band[0]['m']}-{band[-1]['m']}"


def markdown(stamp: str, prov: list[str], rows: list[dict], notes: list[str], steps: dict, c) -> list[str]:
    md = [f"# V100 estimates of the m8n8k4 kernels ({stamp}): ESTIMATES, NOT V100 measurements", "",
          f"**{vc.LABEL}.** Every time of ours below is an estimate from that model; the seed's levels and 1Cat's "
          "TurboMind times are those projects' published V100 measurements, cited per row.", ""] + [p[2:] for p in prov]
    md += ["", f"Constants (benchmarks/v100_calibration.py FIT_BASE): L = {c.latency_us} us, IPC = {c.ipc}, "
           f"t0 = {c.t0_us} us per call. Within a band of M that one kernel serves the model has no term in M, so "
           "rows of equal estimate are merged over M (the CSV has every M).", ""]
    for table, title in (("tp4", "TP4 per rank (seed 000's layout): our estimate beside seed 000's measured level"),
                         ("tp2", "TP2 per rank (1Cat's layout): our estimate beside 1Cat's TurboMind time")):
        md += [f"## {title}", "",
               "| shape | checkpoint format | route format | NVFP4 form | M | kernel | est. us | est. % of 879 GB/s | bound "
               "| seed 000's level (measured) | 1Cat TurboMind (measured) = TurboMind / est. |",
               "|---|---|---|---|---|---|---:|---:|---|---|---|"]
        for band in bands([r for r in rows if r["table"] == table]):
            r = band[0]
            seed = ", ".join(f"M={b['m']}: {b['seed_pct']:.1f}%{' (est. below)' if b['seed_verdict'] == 'below' else ''}"
                             for b in band if b["seed_pct"] is not None)
            tmt = ", ".join(f"M={b['m']}: {b['turbomind_us']:.1f} us = {b['speedup']:.2f}x"
                            for b in band if b["turbomind_us"] is not None)
            md.append(f"| {r['shape']} | {r['checkpoint_fmt']} | {r['fmt']} | {r['form']} | {m_text(band)} | {r['kernel']} | "
                      f"{r['est_us']:.1f} | {r['est_pct']:.0f}% | {r['bound']} | {seed} | {tmt} |")
        md.append("")
    md += ["Where each TurboMind time comes from (1Cat-vLLM v1.3.0, "
           f"{vc.ONECAT_ARCHIVE}): " + "; ".join(sorted({f"{r['turbomind_what']}" for r in rows if r["turbomind_what"]}))
           + ". An NVFP4 TurboMind time beside an FP8 route compares different formats (our checkpoint's attention "
           "projections are FP8); the NVFP4 row on the same shape is the like-for-like one.", ""]
    sp = [r for r in rows if r["speedup"] is not None and r["fmt"] == "nvfp4" and r["form"] == "s7"]
    if sp:
        worst = min(sp, key=lambda r: r["speedup"])
        md.append(f"NVFP4 (S7 form) against TurboMind NVFP4 at M = 1: {min(r['speedup'] for r in sp):.2f}x to "
                  f"{max(r['speedup'] for r in sp):.2f}x (lowest: {worst['shape']}), estimated.")
    md += int4_goal_lines(rows, c.t0_us)
    below = [r for r in rows if r["seed_verdict"] == "below" and (r["form"] in ("s7", "-"))]
    md.append(f"Rows below seed 000's measured level (S7 form and FP8): {len(below)}"
              + (": " + ", ".join(f"{r['shape']} M={r['m']} ({r['est_pct']:.0f}% vs {r['seed_pct']:.0f}%)" for r in below)
                 if below else "") + ".")
    md += ["", "Not estimated:", ""] + [f"- {n}" for n in notes] + [f"- MoE: {MOE_NOT_ESTIMATED}.", ""]
    md += ["## Whole decode step per rank at TP4 (ESTIMATE)", ""] + vc.whole_step_lines(steps)
    md += ["", "How a V100 owner corrects this: `bash scripts/v100-evidence.sh` times these kernels on the owner's "
           "V100 and `python -m qpn.benchmarks.perf_model --check-m8n8k4` prints each route's error against this "
           "model."]
    return md


def write(out_dir: str, stamp: str) -> tuple[str, str]:
    c = pm.v100_calibrated_constants()
    stats, trips = pm.kernel_stats("m8n8k4", 70), vc.our_m8n8k4_round_trips()
    rows, notes = estimate_rows(stats, trips, c)
    steps = {form: vc.whole_step_m8n8k4(form, stats, trips) for form in ops.NVFP4_FORMS}
    prov = pm._provenance() + [
        "# hardware: no GPU used; our kernels compiled for sm_70 on this host, figures fed to the V100-calibrated model",
        f"# label: every est_* figure is an ESTIMATE ({vc.LABEL}), NOT a V100 measurement",
        f"# constants (V100 calibration, FIT_BASE): L = {c.latency_us} us, IPC = {c.ipc}, t0 = {c.t0_us} us",
        f"# V100 description: {pm.V100_SXM2}",
        f"# seed_pct: seed 000's measured V100 level (% of 879 GB/s), {vc.SEED_REPO}@{vc.SEED_COMMIT} {vc.SEED_RESULTS}",
        f"# turbomind_us: 1Cat-vLLM v1.3.0's published TurboMind V100 time ({vc.ONECAT_ARCHIVE}, "
        f"{vc.ONECAT_REPO}@{vc.ONECAT_COMMIT}); speedup = turbomind_us / est_us",
    ]
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, f"perf_model_v100_estimate_{stamp}.csv")
    pm._write_csv(csv_path, prov, COLUMNS, rows)
    md_path = os.path.join(out_dir, f"perf_model_v100_estimate_{stamp}.md")
    with open(md_path, "w") as f:
        f.write("\n".join(markdown(stamp, prov, rows, notes, steps, c)) + "\n")
    return csv_path, md_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qpn.benchmarks.v100_estimate", description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="results")
    ap.add_argument("--stamp", default="", help="file name stamp (default: today, YYYYMMDD)")
    args = ap.parse_args(argv)
    paths = write(args.out_dir, args.stamp or datetime.date.today().strftime("%Y%m%d"))
    with open(paths[1]) as f:
        print(f.read())
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
