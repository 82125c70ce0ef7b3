"""A performance model of the QPN kernels, read off the compiled code, calibrated on a GPU we can
time (the H200) and applied to one we cannot (the V100). Its V100 figures are ESTIMATES from a
calibrated model, never measurements.

Per kernel, from the compiler's output (no GPU needed):
  * registers (ptxas -v) and shared memory per block -> resident warps per SM;
  * weight bytes in flight per warp (its load ring: register ring depth D, or S - 1 shared slots,
    or 1 + KBLOCKS_AHEAD(_MT2) k-blocks for the SM70 kernels);
  * issue slots per weight byte in the main loop: SASS instructions of the loop nest that holds the
    MMAs (inner loops weighted by their trip count), per weight byte that loop consumes.
Per GPU: SMs, SM clock, register file, shared memory, 4 issue slots per SM per clock, the measured
read ceiling.

Time of one call, bytes B of packed weights:
    t = t0 + B / min(read ceiling, latency-bound rate, issue-bound rate)
    latency-bound rate = SMs x active warps per SM x bytes in flight per warp / L
    issue-bound rate   = SMs x clock x IPC / issue slots per byte
with three constants fitted on the H200 run (L: loaded memory latency in us, IPC: achieved issue
slots per SM-clock, t0: fixed cost per call in us) against every m16n8k16 kernel and shape timed
in that run. That fit is the calibration of the sm_80+ kernels, and only of them.

    python -m qpn.benchmarks.perf_model --csv results/kernel_matched_sm80_cal_h200_20261201.csv \\
        --sweep results/kernel_sm80_cal_sweep_h200_20261201.csv --out-dir results

The V100's m8n8k4 kernels are estimated with constants fitted on published V100 measurements alone
(benchmarks/v100_calibration.py: seed 000's m8n8k4 kernels on a V100-SXM2), in the form those
were fitted in (``predict_v100_calibrated``); benchmarks/v100_estimate.py writes the V100 table.
Checked against a GPU that runs the m8n8k4 kernels natively (a V100; scripts/v100-evidence.sh
runs it on its kernel benchmark): each measured call predicted under the V100 calibration, the
error per route, and the constants that run fits by itself (the fixed cost per call t0 above all):

    python -m qpn.benchmarks.perf_model --check-m8n8k4 BUNDLE/kernel_matched.csv --out-dir BUNDLE
"""
from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from qpn.kernels import formats, jit, nvrtc, ops, routes, sm80_plan, sm80_tables

ESTIMATE_LABEL = ("estimate from the model calibrated on published V100 measurements "
                  "(benchmarks/v100_calibration.py), NOT a V100 measurement")


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    clock_ghz: float
    regs_per_sm: int
    smem_per_sm: int          # bytes usable by blocks
    max_warps_per_sm: int
    read_ceiling_gbps: float
    ceiling_source: str
    issue_per_clk: int = 4


def h200(read_ceiling_gbps: float) -> Gpu:
    # 1980 MHz: the SM clock nvidia-smi read under load on these machines (device KINDS.md).
    return Gpu("NVIDIA H200", 132, 1.98, 65536, 228 * 1024, 64, read_ceiling_gbps, "measured in the same run")


V100_SXM2 = Gpu("Tesla V100-SXM2", 80, 1.53, 65536, 96 * 1024, 64, 879.0,
                "seed 000's measured read ceiling (the seed's figure, not ours)")


@dataclass
class KernelStats:
    name: str
    atom: str
    fmt: str
    mt: int
    tiles: int               # 16-row (m16n8k16) or 32-row (m8n8k4) weight tiles per warp
    registers: int
    smem_block: int          # bytes per block of 256 threads
    inflight_warp: int       # weight (+ scale) bytes in flight per warp
    bytes_kblock: float      # weight (+ scale) bytes one warp consumes per k-block
    instr_kblock: float      # SASS issue slots per k-block of that warp in the main loop
    loop_kind: str = ""

    @property
    def issue_per_byte(self) -> float:
        return self.instr_kblock / self.bytes_kblock


def bytes_per_weight(fmt: str) -> float:
    return formats.weight_format(fmt, served_only=False).bytes_per_weight


def resident_warps(k: KernelStats, gpu: Gpu) -> int:
    regs = max(8, -(-k.registers // 8) * 8)
    by_regs = gpu.regs_per_sm // (regs * 256)
    by_smem = gpu.smem_per_sm // (k.smem_block + 1024) if k.smem_block else 32
    by_warps = gpu.max_warps_per_sm // 8
    return 8 * max(0, min(by_regs, by_smem, by_warps, 32))


# ------------------------------------------------------------------------ compiled code
def _sass_functions(text: str) -> dict[str, list[tuple[int, str]]]:
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def main_loop_instructions(insts: list[tuple[int, str]], hmma_per_kblock: float) -> tuple[float, str]:
    """Issue slots per k-block of the loop nest holding the MMAs: the loops are the backward
    branches; the innermost loop with MMAs runs hmma_per_kblock / (its MMAs) times per k-block
    when an outer loop holds it, else one iteration covers (its MMAs) / hmma_per_kblock k-blocks."""
    loops = []
    for addr, text in insts:
        m = re.search(r"\bBRA\b(?:\.\w+)*\s+(?:\S+,\s*)?0x([0-9a-f]+)", text)
        if m and "BRA.DIV" not in text:
            tgt = int(m.group(1), 16)
            if tgt < addr:
                body = [t for a, t in insts if tgt <= a <= addr]
                loops.append((tgt, addr, len(body), sum("HMMA" in t for t in body)))
    loops = [lp for lp in loops if lp[3] > 0]
    if not loops:
        raise ValueError("no loop with MMAs in the SASS")
    inner = min(loops, key=lambda lp: lp[2])
    if inner[3] >= hmma_per_kblock:
        # The loop covers whole k-blocks; code it skips on most iterations (the end of a group:
        # stores, the split-K fence, atomics and reduction) is not counted.
        lo, hi = inner[0], inner[1]
        rare = set()
        for addr, text in insts:
            m = re.search(r"\bBRA\b(?:\.\w+)*\s+(?:\S+,\s*)?0x([0-9a-f]+)", text)
            if m and lo <= addr < hi:
                tgt = int(m.group(1), 16)
                if addr < tgt <= hi:
                    region = [(a, t) for a, t in insts if addr < a < tgt]
                    if any(mark in t for _, t in region for mark in ("MEMBAR", "ATOM", "RED.", "STG")):
                        rare.update(a for a, _ in region)
        count = sum(1 for a, _ in insts if lo <= a <= hi and a not in rare)
        kblocks_per_iter = inner[3] / hmma_per_kblock
        return count / kblocks_per_iter, "loop over k-blocks (group-end code excluded)"
    outer = max((lp for lp in loops if lp[0] <= inner[0] and lp[1] >= inner[1]), key=lambda lp: lp[2])
    trips = hmma_per_kblock / inner[3]
    per_outer_iter = outer[2] - inner[2] + trips * inner[2]
    kblocks_per_outer = (outer[3] - inner[3] + trips * inner[3]) / hmma_per_kblock
    return per_outer_iter / kblocks_per_outer, f"nested loops (inner x{trips:g})"


def _ptxas_regs(ptx: str, arch: int) -> dict:
    from qpn.kernels import sm70_check
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run([sm70_check.find_ptxas(), f"-arch=sm_{arch}", "-v", p, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        return sm70_check.parse_ptxas(r.stdout + r.stderr)


def _sass(cubin: bytes) -> str:
    from qpn.kernels import sm70_check
    cuobjdump = sm70_check.find_disassembler(download=False)
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
        r = subprocess.run([cuobjdump, "-sass", p], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        return r.stdout


def _ptx_mma_counts(ptx: str) -> dict[str, int]:
    out, cur = {}, None
    for line in ptx.splitlines():
        m = re.search(r"\.entry (\w+)\(", line)
        if m:
            cur = m.group(1)
            out[cur] = 0
        elif cur and "mma.sync" in line:
            out[cur] += 1
    return out


def sm70_kblocks_in_flight(family_src: str, decoder: str, mt: int) -> int:
    """k-blocks of weights a warp of the SM70 kernels (csrc/qpn_kernels.cu) has in flight: the one
    it decodes and the decoder's KBLOCKS_AHEAD (KBLOCKS_AHEAD_MT2 at two token tiles) loaded after
    it, read from the family's decoder header (jit.decoder_source). ``decoder`` is a struct (DecFP8) or a ``using NAME = Template<b>;``
    of a decoder template with one bool parameter (DecNVFP4 / DecNVFP4S7), whose constant may be
    ``PARAM ? a : b``."""
    name = "KBLOCKS_AHEAD" if mt == 1 else "KBLOCKS_AHEAD_MT2"
    struct, env = decoder, {}
    alias = re.search(r"using " + decoder + r" = (\w+)<(true|false)>;", family_src)
    if alias:
        struct = alias.group(1)
        param = re.search(r"template <bool (\w+)>\s*struct " + struct + r" \{", family_src)
        env = {param.group(1): alias.group(2) == "true"} if param else {}
    body = re.search(r"struct " + struct + r" \{(.*?)\n\};", family_src, re.S)
    m = body and re.search(r"static constexpr int " + name + r" = ([^;]+);", body.group(1))
    if not m:
        raise ValueError(f"{decoder}::{name} not found in the m8n8k4 decoders (jit.decoder_source)")
    expr = m.group(1).strip()
    pick = re.fullmatch(r"(\w+) \? (\d+) : (\d+)", expr)
    if pick and pick.group(1) in env:
        return 1 + int(pick.group(2) if env[pick.group(1)] else pick.group(3))
    if not expr.isdigit():
        raise ValueError(f"{decoder}::{name} = {expr!r}: expected a number or {'/'.join(env) or 'PARAM'} ? a : b")
    return 1 + int(expr)


def sm70_linear_entries(kernels_src: str) -> dict[str, tuple[str, int]]:
    """Entry point -> (decoder, token tiles per weight pass) of every ``QPN_LINEAR_ENTRY(NAME,
    ATOM, DEC, MT)`` line of csrc/qpn_kernels.cu as NVRTC compiles it (jit.kernel_sources: the lines
    are written from the formats): what each SM70 GEMM kernel instantiates, read from the source
    rather than guessed from its name."""
    return {m.group(1): (m.group(2), int(m.group(3)))
            for m in re.finditer(r"^QPN_LINEAR_ENTRY\((\w+), \w+, (\w+), (\d+)\)", kernels_src, re.M)}


def kernel_stats(atom: str, arch: int) -> dict[str, KernelStats]:
    """Every GEMM kernel of ``atom``'s source compiled for sm_<arch> (NVRTC 12 + ptxas + cuobjdump)."""
    nv = nvrtc.load_nvrtc(12, arch)
    source, sources = jit.ATOM_SOURCES[atom], jit.kernel_sources()
    res = nv.compile(sources[source], source, arch, list(jit.COMPILE_FLAGS), want_cubin=True)
    regs = _ptxas_regs(res.ptx, arch)
    funcs = _sass_functions(_sass(res.cubin))
    mma_ptx = _ptx_mma_counts(res.ptx)
    out = {}
    if atom == "m16n8k16":
        for name, c in sm80_plan.sm80_kernels().items():
            if c.variant != 0 or name not in funcs:
                continue
            fmt = c.fmt   # served kernels and those of a staged family (formats.py), as on m8n8k4
            tile_kb = int(16 * 64 * bytes_per_weight(fmt))  # codes and scales of a 16 x 64 tile k-block
            depth = c.depth if not c.stages else c.stages - 1
            hmma = 4 * c.tiles * c.mt
            instr, kind = main_loop_instructions(funcs[name], hmma)
            out[name] = KernelStats(name, atom, fmt, c.mt, c.tiles, regs[name].registers, c.smem_bytes,
                                    depth * c.tiles * tile_kb, c.tiles * 16 * 64 * bytes_per_weight(fmt), instr, kind)
    else:
        family = jit.decoder_source("m8n8k4")
        entries = sm70_linear_entries(sources[source])
        # served kernels and those of a staged family (kernels, no served route yet: formats.py)
        for name in jit.ENTRY_POINTS["m8n8k4"] + jit.UNSERVED_ENTRY_POINTS["m8n8k4"]:
            if name not in entries or name not in funcs:   # the reconstruct kernels are not GEMMs
                continue
            fmt = formats.format_for_route(name, served_only=False).family
            decoder, mt = entries[name]
            hmma_total = sum("HMMA" in t for _, t in funcs[name])
            sass_per_mma = hmma_total / max(1, mma_ptx.get(name, 0))
            hmma = 8 * mt * sass_per_mma          # 8 mma.m8n8k4 per k-block of 32 per token tile
            instr, kind = main_loop_instructions(funcs[name], hmma)
            tile_kb = int(32 * 32 * bytes_per_weight(fmt))  # codes and scales of a 32 x 32 tile k-block
            depth = sm70_kblocks_in_flight(family, decoder, mt)
            out[name] = KernelStats(name, atom, fmt, mt, 1, regs[name].registers, 8 * 32 * 8 * mt * 4,
                                    depth * tile_kb, 32 * 32 * bytes_per_weight(fmt), instr, kind)
    return out


# ------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class Constants:
    latency_us: float
    ipc: float
    t0_us: float


def _active_warps(k: KernelStats, gpu: Gpu, n: int, kdim: int) -> tuple[float, float]:
    """(active warps per SM, wave factor >= 1) for one layer."""
    w = resident_warps(k, gpu)
    if k.atom == "m16n8k16":
        kblocks = -(-kdim // 64)
        _, nwarps, _ = sm80_plan.sm80_partition(n, kblocks, k.tiles, 1, gpu.sms * w,
                                                sm80_tables.SM80_MIN_ITEMS[formats.KERNEL_FAMILIES[k.fmt]])
        return min(w, nwarps / gpu.sms), 1.0
    n_tiles, kblocks = -(-n // 32), -(-kdim // 32)
    _, tpb = ops.sm70_split(n_tiles, kblocks, 1, gpu.sms)
    blocks = -(-n_tiles // tpb)
    per_wave = gpu.sms * (w // 8)
    waves = blocks / per_wave
    return min(w, blocks * 8 / gpu.sms), (math.ceil(waves) / waves if waves > 1 else 1.0)


def predict(k: KernelStats, gpu: Gpu, n: int, kdim: int, c: Constants) -> dict:
    nbytes = n * kdim * bytes_per_weight(k.fmt)
    act, wave = _active_warps(k, gpu, n, kdim)
    lat = gpu.sms * act * k.inflight_warp / c.latency_us / 1e3            # GB/s
    issue = gpu.sms * gpu.clock_ghz * c.ipc / k.issue_per_byte             # GB/s
    rates = {"read ceiling": gpu.read_ceiling_gbps, "latency": lat, "issue": issue}
    bound = min(rates, key=rates.get)
    t = c.t0_us + nbytes / rates[bound] / 1e3 * wave
    return dict(us=t, bound=bound, pct=100 * nbytes / (t * 1e3) / gpu.read_ceiling_gbps, active_warps=act,
                lat_gbps=lat, issue_gbps=issue)


def read_csv(path):
    head, body = {}, []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                if ":" in line:
                    kk, v = line[1:].split(":", 1)
                    head[kk.strip()] = v.strip()
            else:
                body.append(line)
    return head, list(csv.DictReader(body))


def observations(csv_path: str, sweep_path: str | None) -> tuple[float, list[dict]]:
    """(read ceiling, rows of kernel, n, k, m, measured us) from one run's CSV files."""
    head, rows = read_csv(csv_path)
    read = float(head["read_ceiling_gbps"])
    route_k = dict(re.findall(r"(\w+/mt\d)=(\w+)", head.get("qpn atom", "")))
    obs = []
    for r in rows:
        if r["arm"] != "qpn" or int(r["m"]) > 16:
            continue
        mt = 1 if int(r["m"]) <= 8 else 2
        kname = route_k.get(f"{r['fmt']}/mt{mt}")
        if kname:
            obs.append(dict(kernel=kname, shape=r["shape"], n=int(r["n"]), k=int(r["k"]), m=int(r["m"]),
                            route=r["route"], us=float(r["graph_us"]), src="bench"))
    if sweep_path:
        _, srows = read_csv(sweep_path)
        for r in srows:
            if int(r["variant"]) == 0 and int(r["min_items"]) == sm80_tables.SM80_MIN_ITEMS[formats.FAMILIES[r["fmt"]]]:
                mt = 1 if int(r["m"]) <= 8 else 2
                obs.append(dict(kernel=r["kernel"], shape=r["shape"], n=int(r["n"]), k=int(r["k"]), m=int(r["m"]),
                                route=str(routes.tiled_route(r["fmt"], mt)),
                                us=float(r["graph_us"]), src="sweep"))
    return read, obs


def fit_error(stats: dict[str, KernelStats], gpu: Gpu, obs: list[dict], c: Constants) -> float:
    """Mean |log(predicted / measured)| over the observations of kernels in stats."""
    use = [o for o in obs if o["kernel"] in stats]
    return sum(abs(math.log(predict(stats[o["kernel"]], gpu, o["n"], o["k"], c)["us"] / o["us"])) for o in use) / len(use)


def t0_bound(stats: dict[str, KernelStats], gpu: Gpu, obs: list[dict]) -> float:
    """The largest fixed cost per call the measurements allow: no call can take less than t0 plus
    its bytes at the read ceiling, so t0 is at most the smallest (measured time - that stream time)."""
    return min(o["us"] - o["n"] * o["k"] * bytes_per_weight(stats[o["kernel"]].fmt) / gpu.read_ceiling_gbps / 1e3
               for o in obs if o["kernel"] in stats)


def calibrate(stats: dict[str, KernelStats], gpu: Gpu, obs: list[dict], t0_max: float | None = None) -> Constants:
    """Grid search of (L, IPC, t0) minimising the mean |log(predicted / measured)| (t0 at most
    t0_max when given)."""
    best, best_c = float("inf"), None
    for lat in [0.1 + 0.1 * i for i in range(50)]:
        for ipc in [0.5 + 0.25 * i for i in range(15)]:
            for t0 in [0.5 * i for i in range(31)]:
                if t0_max is not None and t0 > t0_max:
                    continue
                c = Constants(lat, ipc, t0)
                err = fit_error(stats, gpu, obs, c)
                if err < best:
                    best, best_c = err, c
    return best_c


# The shapes the V100 table covers: TP4 per-rank (seed 000's deployment) and 1Cat's TP2 shapes.
TP4_SHAPES = {"tp4_mlp_gate_up": ("nvfp4", 8704, 5120), "tp4_mlp_down": ("nvfp4", 5120, 4352),
              "tp4_lm_head": ("nvfp4", 62080, 5120), "tp4_gdn_in_proj_qkvz": ("fp8", 4096, 5120),
              "tp4_gdn_out_proj": ("fp8", 5120, 1536)}
def kernel_for(fmt: str, m: int, form: str = "restore") -> str:
    """The m8n8k4 kernel of the tiled route for M <= 16 (ops names it)."""
    return ops.route_kernel(routes.tiled_route(formats.weight_format(fmt).family, 1 if m <= 8 else 2), m, form)[0] \
        + "_m8n8k4"


def _route_errors(rows: list[dict], key: str) -> tuple[float, float]:
    """(mean |error|, the error of largest magnitude, signed) of the rows' key, in %."""
    return sum(abs(r[key]) for r in rows) / len(rows), max(rows, key=lambda r: abs(r[key]))[key]


def _write_csv(path: str, prov: list[str], cols: list[str], rows: list[dict]) -> None:
    """Provenance lines, then the rows' cols (floats to 2 decimals, None empty)."""
    with open(path, "w", newline="") as f:
        f.write("\n".join(prov) + "\n")
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({kk: ("" if v is None else f"{v:.2f}" if isinstance(v, float) else v) for kk, v in r.items()})


def _provenance() -> list[str]:
    from . import provenance
    return [f"# commit: {provenance.git_commit()}", f"# command: {provenance.command_line()}",
            f"# date: {provenance.now_iso()}"]


def run(csv_path: str, sweep_path: str | None, out_dir: str, stamp: str) -> str:
    """The H200 calibration of the sm_80+ kernels: results/perf_model_h200_calibration_<stamp>.{csv,md}."""
    read, obs = observations(csv_path, sweep_path)
    gpu = h200(read)
    s80 = kernel_stats("m16n8k16", 90)
    c = calibrate(s80, gpu, obs)
    # The best fit may put t0 above what the fastest calls allow (it then stands in for something
    # else the model does not describe); the fit held to that bound is given beside it.
    cap = t0_bound(s80, gpu, obs)
    cb = c if c.t0_us <= cap else calibrate(s80, gpu, obs, t0_max=cap)
    prov = _provenance() + [f"# calibration data: {csv_path}" + (f" + {sweep_path}" if sweep_path else ""),
                            f"# fitted: loaded latency L = {c.latency_us:.2f} us, IPC = {c.ipc:.2f} issue slots "
                            f"per SM-clock, t0 = {c.t0_us:.1f} us per call (mean |log error| "
                            f"{fit_error(s80, gpu, obs, c):.3f})",
                            f"# t0-bounded fit (t0 <= {cap:.2f} us, the smallest measured time minus its bytes at the "
                            f"read ceiling): L = {cb.latency_us:.2f} us, IPC = {cb.ipc:.2f}, t0 = {cb.t0_us:.1f} us "
                            f"(mean |log error| {fit_error(s80, gpu, obs, cb):.3f})"]
    cal_rows = []
    for o in obs:
        if o["kernel"] not in s80:
            continue
        p = predict(s80[o["kernel"]], gpu, o["n"], o["k"], c)
        q = predict(s80[o["kernel"]], gpu, o["n"], o["k"], cb)
        cal_rows.append(dict(o, pred_us=p["us"], err_pct=100 * (p["us"] / o["us"] - 1), bound=p["bound"],
                             pred_us_t0b=q["us"], err_pct_t0b=100 * (q["us"] / o["us"] - 1)))
    _write_csv(os.path.join(out_dir, f"perf_model_h200_calibration_{stamp}.csv"), prov,
               ["src", "route", "kernel", "shape", "n", "k", "m", "us", "pred_us", "err_pct", "bound", "pred_us_t0b",
                "err_pct_t0b"], cal_rows)
    lines = [f"# Performance model: H200 calibration ({stamp})", ""] + [p[2:] for p in prov] + [
        "", f"GPU description: {gpu}", "", "Per kernel (sm_90 build): registers, shared memory per block, resident "
        "warps per SM, weight bytes in flight per warp, SASS issue slots per weight byte in the main loop", "",
        "| kernel | regs | smem/block | warps/SM | in flight/warp (B) | issue slots/B | loop |", "|---|---:|---:|---:|---:|---:|---|"]
    for kname, k in sorted(s80.items()):
        lines.append(f"| {kname} | {k.registers} | {k.smem_block} | {resident_warps(k, gpu)} | {k.inflight_warp} | "
                     f"{k.issue_per_byte:.3f} | {k.loop_kind} |")
    lines += ["", "Error per route (predicted vs measured graph-replay time, same run):", "",
              "| route | points | mean abs error | worst error | bound (most common) | mean abs error, t0-bounded fit | "
              "worst, t0-bounded fit |", "|---|---:|---:|---:|---|---:|---:|"]
    for route in sorted({r["route"] for r in cal_rows}):
        sub = [r for r in cal_rows if r["route"] == route]
        bounds = [r["bound"] for r in sub]
        (mean, worst), (mean_b, worst_b) = _route_errors(sub, "err_pct"), _route_errors(sub, "err_pct_t0b")
        lines.append(f"| {route} | {len(sub)} | {mean:.1f}% | {worst:+.1f}% | {max(set(bounds), key=bounds.count)} | "
                     f"{mean_b:.1f}% | {worst_b:+.1f}% |")
    cal_md = os.path.join(out_dir, f"perf_model_h200_calibration_{stamp}.md")
    with open(cal_md, "w") as f:
        f.write("\n".join(lines) + "\n")

    print("\n".join(lines))
    return cal_md


def v100_column_lines(results_dir: str | None = None) -> list[str]:
    """Lines the bootstrap prints after the sm70 kernel build (``python -m
    qpn.benchmarks.perf_model --v100-column``): the newest committed V100 estimate
    (results/perf_model_v100_estimate_*.csv, benchmarks/v100_estimate.py), one line per route and
    band of M in the checkpoint's own formats, labelled as an estimate."""
    newest = newest_estimate(results_dir)
    if not newest:
        return ["[kernels] V100 estimate: no results/perf_model_v100_estimate_*.csv here "
                "(run python -m qpn.benchmarks.v100_estimate)"]
    _, rows = read_csv(newest)
    out = [f"[kernels] V100 column ({ESTIMATE_LABEL}; {os.path.basename(newest)}):"]
    seen = set()
    for r in rows:
        key = (r["table"], r["shape"], r["fmt"], r["form"], r["kernel"])
        if r["fmt"] != r["checkpoint_fmt"] or (key in seen and not r["turbomind_us"]):
            continue
        seen.add(key)
        extra = (f", 1Cat TurboMind {float(r['turbomind_us']):.1f} us at M={r['m']} (engine's figure) = "
                 f"{float(r['speedup']):.2f}x" if r["turbomind_us"] else "")
        out.append(f"[kernels]   {r['table']} {r['shape']:17s} {r['kernel']:20s} from M={int(r['m']):2d}  est "
                   f"{float(r['est_us']):7.1f} us {float(r['est_pct']):4.0f}% of 879 GB/s (seed 000's ceiling), "
                   f"{r['bound']}-bound{extra}")
    return out


# ------------------------------------------------------------- the V100-calibrated constants
def v100_calibrated_constants() -> Constants:
    """L, IPC and t0 fitted on published V100 measurements alone (benchmarks/v100_calibration.py:
    the seed's m8n8k4 kernels on a V100-SXM2), instead of carried over from the H200 fit."""
    from .v100_calibration import v100_constants
    return Constants(*v100_constants())


def predict_v100_calibrated(k: KernelStats, n: int, kdim: int, round_trips_kblock: float,
                            c: Constants | None = None, gpu: Gpu = V100_SXM2) -> dict:
    """One m8n8k4 call on the V100 under the V100-calibrated constants, in the form they were fitted
    with: bytes in flight per warp are the kernel's weight bytes per k-block over the memory round
    trips per k-block its SASS replays to (v100_calibration.our_m8n8k4_round_trips()), occupancy and
    waves as v100_calibration.rates() counts them. An ESTIMATE, not a V100 measurement."""
    from . import v100_calibration as vc
    c = c or v100_calibrated_constants()
    n_tiles, kblocks = -(-n // 32), -(-kdim // 32)
    _, tpb = ops.sm70_split(n_tiles, kblocks, 1, gpu.sms)
    nbytes = n * kdim * bytes_per_weight(k.fmt)
    r = vc.rates(inflight_warp=k.bytes_kblock / round_trips_kblock, issue_per_byte=k.issue_per_byte,
                 registers=k.registers, threads=256, smem=k.smem_block, blocks=-(-n_tiles // tpb), gpu=gpu,
                 c=vc.Fit(c.latency_us, c.ipc, c.t0_us))
    bound = min(r, key=r.get)
    t = c.t0_us + nbytes / r[bound] / 1e3
    return dict(us=t, bound=bound, pct=100 * nbytes / (t * 1e3) / gpu.read_ceiling_gbps,
                inflight_warp=k.bytes_kblock / round_trips_kblock)


def fit_v100_form(stats: dict[str, KernelStats], trips: dict[str, float], gpu: Gpu, obs: list[dict]) -> Constants:
    """L, IPC and t0 of predict_v100_calibrated fitted on measured m8n8k4 calls (mean |log error|,
    a grid over v100_calibration.SEARCH refined three times around its best cell)."""
    from . import v100_calibration as vc

    def err(c: Constants) -> float:
        return sum(abs(math.log(predict_v100_calibrated(stats[o["kernel"]], o["n"], o["k"], trips[o["kernel"]],
                                                        c, gpu)["us"] / o["us"])) for o in obs) / len(obs)
    box = {key: vc.SEARCH[key] for key in ("latency_us", "ipc", "t0_us")}
    best = None
    for _ in range(4):
        axes = {key: [lo + (hi - lo) * i / 9 for i in range(10)] for key, (lo, hi) in box.items()}
        best = min((Constants(L, i, t) for L in axes["latency_us"] for i in axes["ipc"] for t in axes["t0_us"]), key=err)
        for key, v in zip(("latency_us", "ipc", "t0_us"), (best.latency_us, best.ipc, best.t0_us)):
            lo, hi = box[key]
            step = (hi - lo) / 9
            box[key] = (max(vc.SEARCH[key][0], v - step), min(vc.SEARCH[key][1], v + step))
    return best


# ------------------------------------------------------------------ checked against a V100
def m8n8k4_observations(csv_path: str) -> tuple[dict, Gpu, list[dict]]:
    """(its header, the GPU the run describes, rows of kernel, n, k, m, measured us) of a
    kernel_matched_bench CSV that ran the m8n8k4 kernels (a V100 run: scripts/v100-evidence.sh's
    kernels step)."""
    head, rows = read_csv(csv_path)
    atom = head.get("qpn atom", "")
    if not atom.startswith("m8n8k4"):
        raise ValueError(f"{csv_path}: its QPN arm ran '{atom.split(';')[0]}', not the m8n8k4 kernels this "
                         "check is about (run kernel_matched_bench on the V100)")
    sm = re.search(r"(\d+) SMs", head.get("gpu", ""))
    gpu = Gpu(head.get("gpu", "?"), int(sm.group(1)) if sm else V100_SXM2.sms, V100_SXM2.clock_ghz,
              V100_SXM2.regs_per_sm, V100_SXM2.smem_per_sm, V100_SXM2.max_warps_per_sm,
              float(head["read_ceiling_gbps"]), "measured in the same run")
    # the NVFP4 form the run's GPU chose (ops.nvfp4_form; a run from before the S7 form ran restore)
    form = re.search(r"NVFP4 form: (\w+)", atom)
    form = form.group(1) if form else "restore"
    obs = []
    for r in rows:
        route = routes.as_route(r["route"]) if r["arm"] == "qpn" else None
        if route is None or route.kernel != routes.TILED or route.chunk_rows:
            continue
        kernel = ops.route_kernel(route, int(r["m"]), form)[0] + "_m8n8k4"
        obs.append(dict(kernel=kernel, shape=r["shape"], n=int(r["n"]), k=int(r["k"]),
                        m=int(r["m"]), route=r["route"], us=float(r["graph_us"]), src="v100"))
    if not obs:
        raise ValueError(f"{csv_path}: no QPN rows on the single-pass tiled routes (qpn2, qpn8 and their _mt2)")
    return head, gpu, obs


def check_m8n8k4(csv_path: str, out_dir: str, stamp: str, stats: dict[str, KernelStats] | None = None,
                 trips: dict[str, float] | None = None) -> str:
    """The V100 estimate checked against a measured m8n8k4 run: each point predicted under the V100
    calibration (with the run's own SM count and read ceiling), its error per route, and the
    constants the run itself fits in the same form."""
    from . import v100_calibration as vc
    head, gpu, obs = m8n8k4_observations(csv_path)
    c = v100_calibrated_constants()
    stats = stats if stats is not None else kernel_stats("m8n8k4", 70)
    trips = trips if trips is not None else vc.our_m8n8k4_round_trips()
    own = fit_v100_form(stats, trips, gpu, obs)
    rows = []
    for o in obs:
        p = predict_v100_calibrated(stats[o["kernel"]], o["n"], o["k"], trips[o["kernel"]], c, gpu)
        q = predict_v100_calibrated(stats[o["kernel"]], o["n"], o["k"], trips[o["kernel"]], own, gpu)
        rows.append(dict(o, pred_us=p["us"], err_pct=100 * (p["us"] / o["us"] - 1), bound=p["bound"],
                         refit_us=q["us"], refit_err_pct=100 * (q["us"] / o["us"] - 1)))
    is_v100 = "V100" in gpu.name and gpu.sms == V100_SXM2.sms
    label = ("measured on a V100" if is_v100 else
             f"measured on {gpu.name}, NOT a V100 (m8n8k4 there is emulated): this checks the harness only")
    prov = _provenance() + [f"# measured run: {csv_path} ({label}; its commit: {head.get('commit', '?')}, "
                            f"date: {head.get('date', '?')})",
                            f"# estimate: the V100 calibration (benchmarks/v100_calibration.py FIT_BASE: "
                            f"L = {c.latency_us} us, IPC = {c.ipc}, t0 = {c.t0_us} us; {vc.LABEL})",
                            f"# this run's own fit: L = {own.latency_us:.2f} us, IPC = {own.ipc:.2f}, "
                            f"t0 = {own.t0_us:.1f} us"]
    _write_csv(os.path.join(out_dir, f"perf_model_v100_check_{stamp}.csv"), prov,
               ["route", "kernel", "shape", "n", "k", "m", "us", "pred_us", "err_pct", "bound", "refit_us",
                "refit_err_pct"], rows)
    lines = [f"# The m8n8k4 estimate checked against a measured run ({stamp}): {label}", ""] + [p[2:] for p in prov] + [
        "", f"GPU description: {gpu}", "",
        "| route | points | mean abs error (V100 calibration) | worst | mean abs error (this run's fit) |",
        "|---|---:|---:|---:|---:|"]
    for route in sorted({r["route"] for r in rows}):
        sub = [r for r in rows if r["route"] == route]
        mean, worst = _route_errors(sub, "err_pct")
        lines.append(f"| {route} | {len(sub)} | {mean:.1f}% | {worst:+.1f}% | {_route_errors(sub, 'refit_err_pct')[0]:.1f}% |")
    lines += ["", "| shape | M | kernel | measured us | estimate us | error | bound |", "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['m']} | {r['kernel']} | {r['us']:.1f} | {r['pred_us']:.1f} | "
                     f"{r['err_pct']:+.1f}% | {r['bound']} |")
    out_md = os.path.join(out_dir, f"perf_model_v100_check_{stamp}.md")
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out_md


def newest_estimate(results_dir: str | None = None) -> str | None:
    d = results_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    files = sorted(glob.glob(os.path.join(d, "perf_model_v100_estimate_*.csv")))
    return files[-1] if files else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qpn.benchmarks.perf_model", description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default="", help="kernel_matched_bench CSV of an sm_80+ run (calibrate the sm_80+ kernels)")
    ap.add_argument("--sweep", default="", help="its --sweep CSV (more kernels to calibrate on)")
    ap.add_argument("--check-m8n8k4", default="", metavar="CSV",
                    help="instead: check the V100 calibration's estimate against this kernel_matched_bench CSV of "
                         "an m8n8k4 run (scripts/v100-evidence.sh's kernel_matched.csv)")
    ap.add_argument("--v100-column", action="store_true",
                    help="instead: print the newest committed V100 estimate (the bootstrap's sm70 step)")
    ap.add_argument("--results", default="", help="with --v100-column: the results folder to read")
    ap.add_argument("--out-dir", default="results")
    ap.add_argument("--stamp", default="", help="file name stamp (default: the run's date)")
    args = ap.parse_args(argv)
    if args.v100_column:
        print("\n".join(v100_column_lines(args.results or None)))
        return 0
    if bool(args.csv) == bool(args.check_m8n8k4):
        ap.error("give --csv (calibrate on an sm_80+ run) or --check-m8n8k4 (check against an m8n8k4 run)")
    head, _ = read_csv(args.csv or args.check_m8n8k4)
    stamp = args.stamp or head.get("date", "undated")[:10].replace("-", "")
    if args.check_m8n8k4:
        check_m8n8k4(args.check_m8n8k4, args.out_dir, stamp)
        return 0
    run(args.csv, args.sweep or None, args.out_dir, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
