"""Matched kernel benchmark: QPN routes against dequantize-then-matmul and against a torch FP16
weight GEMM, over ONE set of weights per shape, in one process, with the read-only and copy
ceilings measured in the same run. Writes a CSV with a provenance header.

    python -m qpn.benchmarks.kernel_matched_bench --out results/kernel_matched_<gpu>_<date>.csv

Arms (each timed the same way: CUDA events around a loop of calls, median of repeats, weights
rotated over enough copies that every call streams from DRAM, not L2):
  qpn            ops.qpn_linear on the prepacked weight, route from routes.route_for
  dequant_matmul dequantize the checkpoint tensors in torch (float32), cast to FP16, x @ W^T
  torch_fp16     x @ W16^T on a resident FP16 copy of the same weight values
GB/s counts the arm's own weight bytes (packed NVFP4 / FP8 for qpn and dequant_matmul, FP16 for
torch_fp16). Read ceiling: torch.sum over a 2 GiB buffer (bytes read / s). Copy ceiling: a 1 GiB
device-to-device copy (bytes read + bytes written / s).

On sm_80 and later GPUs the m8n8k4 tensor-core atom of the SM70 kernels is EMULATED (DESIGN.md
section 5: 18.4 against 614.8 TFLOP/s for m16n8k16 on the H200), so on such a GPU the qpn rows
prove the harness and the routes, not V100 speed. The CSV header says so.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import shlex
import statistics
import subprocess
import sys

import torch

from qpn.kernels import formats, ops, prepack, routes

SHAPES = {
    # name: (format, N, K) -- DESIGN.md section 7
    "tp4_mlp_gate_up": ("nvfp4", 8704, 5120),
    "tp4_mlp_down": ("nvfp4", 5120, 4352),
    "tp4_lm_head": ("nvfp4", 62080, 5120),
    "tp4_gdn_in_proj_qkvz": ("fp8", 4096, 5120),
    "tp4_gdn_out_proj": ("fp8", 5120, 1536),
    "tp1_mlp_gate_up": ("nvfp4", 34816, 5120),
    "tp1_mlp_down": ("nvfp4", 5120, 17408),
    "tp1_lm_head": ("nvfp4", 248320, 5120),
    "tp1_gdn_in_proj_qkvz": ("fp8", 16384, 5120),
    "tp1_gdn_out_proj": ("fp8", 5120, 6144),
}
DEFAULT_M = (1, 2, 4, 8, 12, 16, 32, 64, 96, 128)
EMULATION_NOTE = ("m8n8k4 (the SM70 atom) is emulated on sm_80 and later GPUs: qpn figures measured there "
                  "prove the harness and the routes, NOT V100 speed")


def _time_ms(fn, target_ms: float = 40.0, repeats: int = 5) -> float:
    """Median per-call milliseconds, CUDA events around a loop of calls."""
    fn(0)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fn(1); e.record(); torch.cuda.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    iters = int(min(200, max(3, target_ms / one)))
    samples = []
    for _ in range(repeats):
        s.record()
        for i in range(iters):
            fn(i)
        e.record()
        torch.cuda.synchronize()
        samples.append(s.elapsed_time(e) / iters)
    return statistics.median(samples)


def ceilings() -> tuple[float, float]:
    """(read-only GB/s, copy GB/s counting read + write)."""
    buf = torch.ones(512 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 2 GiB
    t = _time_ms(lambda i: buf.sum(), target_ms=100)
    read = buf.numel() * 4 / (t * 1e-3) / 1e9
    del buf
    src = torch.ones(256 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    t = _time_ms(lambda i: dst.copy_(src), target_ms=100)
    copy = 2 * src.numel() * 4 / (t * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return read, copy


def _copies(nbytes: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20) or (64 << 20)
    return int(min(8, max(1, math.ceil(4 * l2 / max(1, nbytes)))))


def _weights(fmt: str, n: int, k: int, gen):
    dev = "cuda"
    if fmt == "nvfp4":
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
        s = torch.randint(0x28, 0x58, (n, k // 16), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
        gs = torch.tensor(0.25 / (k ** 0.5) / 8, dtype=torch.float32, device=dev)
        return (w, s, gs)
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev, generator=gen) & 0xDF
    return (b.view(torch.float8_e4m3fn), torch.tensor(0.03 / k ** 0.5, device=dev))


def _dequant(fmt, src):
    if fmt == "nvfp4":
        return formats.dequantize_nvfp4(*src)
    return formats.dequantize_fp8(*src)


def bench_shape(name, fmt, n, k, ms, read_ceiling, copy_ceiling, rows, gen):
    src0 = _weights(fmt, n, k, gen)
    packed0 = prepack.prepack_nvfp4(*src0) if fmt == "nvfp4" else prepack.prepack_fp8(*src0)
    qbytes = packed0.nbytes
    n_q = _copies(qbytes)
    srcs = [src0] + [_weights(fmt, n, k, gen) for _ in range(n_q - 1)]
    packs = [packed0] + [(prepack.prepack_nvfp4(*s) if fmt == "nvfp4" else prepack.prepack_fp8(*s)) for s in srcs[1:]]
    fp16_bytes = n * k * 2
    n_h = _copies(fp16_bytes)
    w16 = [_dequant(fmt, srcs[i % n_q]).to(torch.float16) for i in range(n_h)]
    x_all = torch.randn((max(ms), k), device="cuda", generator=gen).to(torch.float16)
    for m in ms:
        x = x_all[:m]
        route = routes.route_for(fmt, m, n, k)
        arms = [
            ("qpn", route, qbytes, lambda i: ops.qpn_linear(x, packs[i % n_q])),
            ("dequant_matmul", "torch", qbytes, lambda i: x @ _dequant(fmt, srcs[i % n_q]).to(torch.float16).t()),
            ("torch_fp16", "torch.matmul", fp16_bytes, lambda i: x @ w16[i % n_h].t()),
        ]
        for arm, rname, wbytes, fn in arms:
            t = _time_ms(fn, target_ms=30 if arm != "dequant_matmul" else 15, repeats=5 if arm != "dequant_matmul" else 3)
            gbps = wbytes / (t * 1e-3) / 1e9
            rows.append(dict(shape=name, fmt=fmt, n=n, k=k, m=m, arm=arm, route=rname, time_us=t * 1e3,
                             weight_bytes=wbytes, gbps=gbps, pct_read=100 * gbps / read_ceiling,
                             pct_copy=100 * gbps / copy_ceiling))
            print(f"{name:22s} M={m:4d} {arm:15s} {rname:18s} {t * 1e3:10.1f} us {gbps:8.1f} GB/s "
                  f"{100 * gbps / read_ceiling:6.1f}% read", flush=True)
    del srcs, packs, w16
    torch.cuda.empty_cache()


def _provenance(args) -> list[str]:
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001 - provenance must not kill the run
        drv = f"unknown ({type(e).__name__})"
    commit = args.commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        except Exception:  # noqa: BLE001
            commit = "unknown"
    cap = torch.cuda.get_device_capability(0)
    lines = [
        f"# gpu: {torch.cuda.get_device_name(0)} (sm_{cap[0]}{cap[1]}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        f"# driver: {drv}",
        f"# torch: {torch.__version__} (CUDA {torch.version.cuda})",
        f"# commit: {commit}",
        f"# command: {' '.join(shlex.quote(a) for a in [os.path.basename(sys.executable), '-m', 'qpn.benchmarks.kernel_matched_bench'] + sys.argv[1:])}",
        f"# date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
    ]
    if cap >= (8, 0):
        lines.append(f"# NOTE: {EMULATION_NOTE}")
    lines.append("# gbps = the arm's weight bytes / time; pct_read / pct_copy = share of the ceilings measured in this run")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="CSV path (results/kernel_matched_<gpu>_<date>.csv)")
    ap.add_argument("--shapes", default="tp4,tp1", help="comma list of shape names or the prefixes tp4 / tp1")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="comma list of M (rows per call)")
    ap.add_argument("--commit", default="", help="commit hash to record when the tree has no .git")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_matched_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    want = [s.strip() for s in args.shapes.split(",") if s.strip()]
    names = [n for n in SHAPES if n in want or any(n.startswith(p + "_") for p in want)]
    if not names:
        ap.error(f"no shape matches {args.shapes!r}; known: {', '.join(SHAPES)}")
    ms = [int(v) for v in args.m.split(",")]
    ops.build(f"sm{''.join(map(str, torch.cuda.get_device_capability(0)))}")
    read, copy = ceilings()
    print(f"read ceiling {read:.1f} GB/s, copy ceiling {copy:.1f} GB/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cols = ["shape", "fmt", "n", "k", "m", "arm", "route", "time_us", "weight_bytes", "gbps", "pct_read", "pct_copy"]
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    with open(args.out, "w") as f:  # rows are written as they come: a cut-short run keeps what it measured
        for line in _provenance(args):
            f.write(line + "\n")
        f.write(f"# read_ceiling_gbps: {read:.1f}\n# copy_ceiling_gbps: {copy:.1f}\n")
        f.write(",".join(cols) + "\n")
        for name in names:
            fmt, n, k = SHAPES[name]
            start = len(rows)
            bench_shape(name, fmt, n, k, ms, read, copy, rows, gen)
            for r in rows[start:]:
                f.write(",".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + "\n")
            f.flush()
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
