"""Matched kernel benchmark: QPN routes against the GPU's own paths over ONE set of weights per
shape, in one process, with the read-only and copy ceilings measured in the same run. Writes a
CSV with a provenance header (and, optionally, a PNG of GB/s against M and a targets table).

    python -m qpn.benchmarks.kernel_matched_bench --out results/kernel_matched_<gpu>_<date>.csv \\
        [--plot results/....png] [--targets results/....md] [--sweep results/kernel_sm80_sweep_....csv]

Arms (all on the same weight values; each timed twice, the same way for every arm):
  qpn            ops.qpn_linear on the prepacked weight, route from routes.route_for; the atom is
                 the GPU's own (m16n8k16 on sm_80+, m8n8k4 on sm_70/75) unless --atom says otherwise
  torch_fp16     x @ W16^T on a resident FP16 copy of the weight values (cuBLAS through torch)
  scaled_mm      FP8 shapes only: torch._scaled_mm on the e4m3 weight with per-tensor scales, the
                 activations already quantized to e4m3 and padded to a multiple of 16 rows (their
                 quantization is NOT timed: the most favourable timing for this peer)
  dequant_matmul dequantize the checkpoint tensors with torch ops (a byte -> two-value FP16 lookup
                 for NVFP4, a cast for FP8, nibbles minus zero times scale for INT4), then x @ W^T: the
                 naive path
  gemlite        NVFP4 shapes: gemlite's A16W4 NVFP layer where it compiles, else its int4 group-64
                 layer on random codes; INT4 shapes (int4_*): its A16W4 int4 layer on the arm's own codes,
                 scales and zero points, checked against the dequantized weights before it is timed
  read_limit     no weights, no compute: the fastest of a few pure-read kernels (benchmarks/read_probe.py,
                 LIMIT_CONFIGS; chosen per shape in the same run) over as many bytes as the qpn arm
                 streams: how close to the read ceiling ANY single kernel of this layer's size gets
  qpn_plain      sm_90+ only, where the qpn arm launches its route kernel's *_pdl form
                 (sm80_tables.SM80_PDL_KERNELS): the route's kernel without the programmatic-dependent-launch
                 hooks, launched with plain cuLaunchKernel, as the library did before; the qpn arm
                 minus this one is what PDL buys
Columns: eager_* = CUDA events around a loop of calls (host launch cost included, as an engine
without graphs sees it); graph_* = the same loop captured once as a CUDA graph and replayed
(launch gaps removed; what a decode step under CUDA graphs sees). Weights are rotated over
enough copies that every call streams from DRAM, not L2. GB/s counts the arm's own weight bytes
(packed NVFP4 / FP8 with scales for qpn and dequant_matmul, e4m3 for scaled_mm, FP16 for
torch_fp16). Read ceiling: torch.sum over a 2 GiB buffer (bytes read / s); copy ceiling: a 1 GiB
device-to-device copy ((read + written) / s).

The m8n8k4 atom of the SM70 kernels is emulated on sm_80 and later (docs/architecture.md, "What can be proven without a V100"): with
--atom m8n8k4 on such a GPU the qpn rows prove the harness, not V100 speed; the header says so.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import os
import statistics
import subprocess
import sys

import torch

from qpn.kernels import atoms, codecs, families, formats, kernel_inputs, ops, routes, sm80_plan, sm80_tables

SHAPES = {
    # name: (format, N, K) -- Qwen3.8-27B's per-rank shapes (tests/test_tp_sharding.py)
    "tp1_mlp_gate_up": ("nvfp4", 34816, 5120),
    "tp1_mlp_down": ("nvfp4", 5120, 17408),
    "tp1_lm_head": ("nvfp4", 248320, 5120),
    "tp1_gdn_in_proj_qkvz": ("fp8", 16384, 5120),
    "tp1_gdn_out_proj": ("fp8", 5120, 6144),
    "tp4_mlp_gate_up": ("nvfp4", 8704, 5120),
    "tp4_mlp_down": ("nvfp4", 5120, 4352),
    "tp4_lm_head": ("nvfp4", 62080, 5120),
    "tp4_gdn_in_proj_qkvz": ("fp8", 4096, 5120),
    "tp4_gdn_out_proj": ("fp8", 5120, 1536),
    # INT4 W4A16 (group 128 with zero points, AutoAWQ's default): the MLP at TP1 (the issue 26
    # goal against torch FP16), and the four per-rank shapes of 1Cat's TurboMind AWQ notes at TP2 and
    # TP4 (gate/up, down, attention qkv/z, attention out)
    "int4_tp1_mlp_gate_up": ("int4", 34816, 5120),
    "int4_tp1_mlp_down": ("int4", 5120, 17408),
    "int4_tp2_mlp_gate_up": ("int4", 17408, 5120),
    "int4_tp2_mlp_down": ("int4", 5120, 8704),
    "int4_tp2_attn_qkvz": ("int4", 8192, 5120),
    "int4_tp2_attn_out": ("int4", 5120, 3072),
    "int4_tp4_mlp_gate_up": ("int4", 8704, 5120),
    "int4_tp4_mlp_down": ("int4", 5120, 4352),
    "int4_tp4_attn_qkvz": ("int4", 4096, 5120),
    "int4_tp4_attn_out": ("int4", 5120, 1536),
}
INT4_GROUP = 128
DEFAULT_M = (1, 2, 4, 8, 12, 16, 32, 64)
EMULATION_NOTE = ("m8n8k4 (the SM70 atom) is emulated on sm_80 and later GPUs: qpn figures measured there "
                  "prove the harness and the routes, NOT V100 speed")
COLS = ["shape", "fmt", "n", "k", "m", "arm", "route", "weight_bytes", "eager_us", "graph_us", "eager_gbps",
        "graph_gbps", "eager_pct_read", "graph_pct_read", "eager_pct_copy", "graph_pct_copy"]
SWEEP_COLS = ["shape", "fmt", "n", "k", "m", "kernel", "tiles", "depth", "prefetch", "stages", "variant", "min_items",
              "graph_us", "gbps", "pct_read"]


# ------------------------------------------------------------------------------- timing
def _one_call_ms(fn) -> float:
    fn(0)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn(1)
    e.record()
    torch.cuda.synchronize()
    return max(s.elapsed_time(e), 1e-3)


def time_eager(fn, target_ms: float = 20.0, repeats: int = 3, max_iters: int = 200) -> float:
    """Median per-call ms: CUDA events around a loop of eager calls."""
    one = _one_call_ms(fn)
    iters = int(min(max_iters, max(3, target_ms / one)))
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        s.record()
        for i in range(iters):
            fn(i)
        e.record()
        torch.cuda.synchronize()
        samples.append(s.elapsed_time(e) / iters)
    return statistics.median(samples)


def time_graph(fn, target_ms: float = 20.0, repeats: int = 3, max_iters: int = 200) -> float:
    """Median per-call ms: the same loop of calls captured once as a CUDA graph, replayed."""
    one = _one_call_ms(fn)
    iters = int(min(max_iters, max(2, target_ms / one)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        samples.append(s.elapsed_time(e) / iters)
    del g
    return statistics.median(samples)


def ceilings() -> tuple[float, float]:
    """(read-only GB/s, copy GB/s counting read + write)."""
    buf = torch.ones(512 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 2 GiB
    t = time_eager(lambda i: buf.sum(), target_ms=100, repeats=5)
    read = buf.numel() * 4 / (t * 1e-3) / 1e9
    del buf
    src = torch.ones(256 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    t = time_eager(lambda i: dst.copy_(src), target_ms=100, repeats=5)
    copy = 2 * src.numel() * 4 / (t * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return read, copy


def _copies(nbytes: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20) or (64 << 20)
    return int(min(32, max(1, math.ceil(4 * l2 / max(1, nbytes)))))


# ------------------------------------------------------------------------------ weights
def _weights(fmt: str, n: int, k: int, gen):
    dev = "cuda"
    if fmt == "nvfp4":
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
        s = torch.randint(0x28, 0x58, (n, k // 16), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
        gs = torch.tensor(0.25 / (k ** 0.5) / 8, dtype=torch.float32, device=dev)
        return (w, s, gs)
    if fmt == "int4":
        # every byte value of the codes, every zero point, scales in the range AWQ checkpoints hold
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
        groups = k // INT4_GROUP
        sc = (torch.rand((n, groups), device=dev, generator=gen) * 0.03 + 0.002).to(torch.float16)
        zr = torch.randint(0, 16, (n, groups), dtype=torch.uint8, device=dev, generator=gen)
        return (codes, sc, zr)
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev, generator=gen) & 0xDF
    return (b.view(torch.float8_e4m3fn), torch.tensor(0.03 / k ** 0.5, device=dev))


class NaiveDequant:
    """The naive arm: dequantize with torch ops on the device (no host copies: capturable)."""

    def __init__(self, device):
        from qpn.kernels import codecs
        e2m1 = codecs.e2m1_table(torch.float32)
        byte = torch.arange(256)
        self.lut = torch.stack([e2m1[byte & 0xF], e2m1[byte >> 4]], dim=1).to(torch.float16).to(device)  # [256, 2]

    def nvfp4(self, w, s, gs) -> torch.Tensor:
        n, kh = w.shape
        vals = torch.nn.functional.embedding(w.int(), self.lut).view(n, kh * 2 // 16, 16)
        sc = (s.to(torch.float32) * gs).to(torch.float16)
        return (vals * sc.unsqueeze(-1)).view(n, kh * 2)

    @staticmethod
    def fp8(w, scale) -> torch.Tensor:
        return w.to(torch.float16) * scale.to(torch.float16)

    @staticmethod
    def int4(codes, scales, zeros) -> torch.Tensor:
        n, kh = codes.shape
        q = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(n, scales.shape[1], -1).to(torch.float16)
        return ((q - zeros.to(torch.float16).unsqueeze(-1)) * scales.unsqueeze(-1)).view(n, kh * 2)


def _fp16_copy(fmt, src, naive: NaiveDequant) -> torch.Tensor:
    return families.numerics(fmt).decode_f32(*src).to(torch.float16)


def _pack(fmt, src, atom):
    return families.numerics(fmt).prepack(*src, atom=atom)


# ------------------------------------------------------------------------- gemlite arm
GEMLITE_STATE: dict = {"reason": None, "mode": None}


def gemlite_layer(src, n: int, k: int, gen):
    """A gemlite 4-bit layer over this shape, or (None, reason). A16W4_NVFP on the NVFP4 tensors
    themselves where its kernel compiles on this GPU; otherwise A16W4 int4 with group 64 on random
    codes (the same 4 bits per weight; scales and zeros FP16). Returns (layer, weight bytes, mode)."""
    if GEMLITE_STATE["reason"]:
        return None, 0, GEMLITE_STATE["reason"]
    try:
        import gemlite
        from gemlite.helper import A16W4_HQQ_INT, A16W4_NVFP
    except Exception as e:  # noqa: BLE001 - any import failure means the arm is skipped, with the reason
        GEMLITE_STATE["reason"] = f"gemlite not importable: {type(e).__name__}: {e}"
        return None, 0, GEMLITE_STATE["reason"]
    if GEMLITE_STATE["mode"] is None:
        name = torch.cuda.get_device_name(0).lower()
        cfg = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
        if ("h100" in name or "h200" in name) and os.path.exists(cfg):
            try:
                gemlite.core.GemLiteLinear.load_config(cfg)
            except Exception as e:  # noqa: BLE001
                print(f"gemlite: could not load {cfg}: {e}", flush=True)
    x = torch.randn((1, k), device="cuda", generator=gen).to(torch.float16)
    if GEMLITE_STATE["mode"] in (None, "A16W4_NVFP"):
        try:
            w, s, gs = src
            layer = A16W4_NVFP(device="cuda", dtype=torch.float16).from_packed_weights(
                w, scales=s, meta_scale=(1.0 / gs).reshape(()))
            layer(x)
            torch.cuda.synchronize()
            GEMLITE_STATE["mode"] = "A16W4_NVFP"
        except Exception as e:  # noqa: BLE001 - the NVFP kernel may not compile on this GPU / triton
            if GEMLITE_STATE["mode"] is None:
                print(f"gemlite A16W4_NVFP failed here ({type(e).__name__}: {str(e)[:200]}); "
                      "using A16W4 int4 group 64", flush=True)
            GEMLITE_STATE["mode"] = "A16W4_int4_g64"
    if GEMLITE_STATE["mode"] == "A16W4_int4_g64":
        wq = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
        sc = (torch.rand((n, k // 64), device="cuda", generator=gen) * 0.02 + 0.01).to(torch.float16)
        zr = torch.full((n, k // 64), 8.0, device="cuda", dtype=torch.float16)
        try:
            layer = A16W4_HQQ_INT(device="cuda", dtype=torch.float16).from_weights(wq, sc, zr)
            layer(x)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            GEMLITE_STATE["reason"] = f"gemlite A16W4 int4 g64 failed: {type(e).__name__}: {str(e)[:200]}"
            return None, 0, GEMLITE_STATE["reason"]
    nbytes = sum(t.numel() * t.element_size() for t in layer.parameters() if t.dim() >= 1)
    nbytes += sum(b.numel() * b.element_size() for b in layer.buffers() if b.dim() >= 1)
    return layer, nbytes, GEMLITE_STATE["mode"]


def gemlite_int4_layer(src, x):
    """gemlite's A16W4 int4 layer over the INT4 arm's own codes, scales and zero points (group 128;
    gemlite dequantizes (W_q - zero) * scale, the same values), or (None, 0, reason). Its output is
    checked against the dequantized weights here: a peer with a wrong result is not timed."""
    try:
        from gemlite.helper import A16W4_HQQ_INT
    except Exception as e:  # noqa: BLE001 - any import failure means the arm is skipped, with the reason
        return None, 0, f"gemlite not importable: {type(e).__name__}: {e}"
    codes, sc, zr = src
    n, k = codes.shape[0], codes.shape[1] * 2
    wq = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(n, k)
    try:
        layer = A16W4_HQQ_INT(device="cuda", dtype=torch.float16).from_weights(wq, sc, zr.to(torch.float16))
        y = layer(x)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return None, 0, f"gemlite A16W4 int4 g{INT4_GROUP} failed: {type(e).__name__}: {str(e)[:200]}"
    ref = x.float() @ NaiveDequant.int4(codes, sc, zr).float().t()
    err = float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    if not err < 2e-2:
        return None, 0, f"gemlite A16W4 int4 g{INT4_GROUP} result differs from the dequantized weights (rel {err:.3g})"
    nbytes = sum(t.numel() * t.element_size() for t in layer.parameters() if t.dim() >= 1)
    nbytes += sum(b.numel() * b.element_size() for b in layer.buffers() if b.dim() >= 1)
    return layer, nbytes, f"A16W4_int4_g{INT4_GROUP}"


def _row(name, fmt, n, k, m, arm, route, wbytes, eager_ms, graph_ms, read, copy) -> dict:
    r = dict(shape=name, fmt=fmt, n=n, k=k, m=m, arm=arm, route=route, weight_bytes=wbytes,
             eager_us=eager_ms * 1e3, graph_us=graph_ms * 1e3)
    for col, t in (("eager", eager_ms), ("graph", graph_ms)):
        gbps = wbytes / (t * 1e-3) / 1e9
        r[f"{col}_gbps"] = gbps
        r[f"{col}_pct_read"] = 100 * gbps / read
        r[f"{col}_pct_copy"] = 100 * gbps / copy
    return r


def bench_shape(name, fmt, n, k, ms, read, copy, gen, atom, naive, out_rows, writer=None):
    if atom not in formats.weight_format(fmt, served_only=False).kernel_atoms:
        print(f"{name}: skipped, {fmt} has no {atom} kernels (formats.{fmt.upper()}.kernel_atoms); "
              "try --atom with one it has", flush=True)
        return
    src0 = _weights(fmt, n, k, gen)
    packed0 = _pack(fmt, src0, atom)
    qbytes = packed0.nbytes
    n_q = _copies(qbytes)
    srcs = [src0] + [_weights(fmt, n, k, gen) for _ in range(n_q - 1)]
    packs = [packed0] + [_pack(fmt, s, atom) for s in srcs[1:]]
    fp16_bytes = n * k * 2
    n_h = _copies(fp16_bytes)
    w16 = [_fp16_copy(fmt, srcs[i % n_q], naive) for i in range(n_h)]
    if fmt == "fp8":
        sa = torch.tensor(1.0 / 64, device="cuda")
    x_all = torch.randn((max(ms), k), device="cuda", generator=gen).to(torch.float16)
    arch = atoms.arch_for_atom(atom)
    gl = []
    if fmt in ("nvfp4", "int4") and GEMLITE:
        for i in range(n_q):
            layer, gbytes, gmode = (gemlite_layer(srcs[i], n, k, gen) if fmt == "nvfp4"
                                    else gemlite_int4_layer(srcs[i], x_all[:1]))
            if layer is None:
                print(f"{name}: gemlite arm skipped: {gmode}", flush=True)
                gl = []
                break
            gl.append(layer)
    limit = None
    if READ_LIMIT:
        # the read_limit arm: the fastest pure-read kernel over as many bytes as the qpn arm streams
        from qpn.benchmarks import read_probe
        global _READ_LIMIT
        if _READ_LIMIT is None:
            _READ_LIMIT = read_probe.ReadProbe()
        rbufs = [torch.empty(-(-qbytes // 8192) * 8192, dtype=torch.uint8, device="cuda").random_(0, 256)
                 for _ in range(n_q)]
        limit = _READ_LIMIT.best(rbufs, lambda fn: time_graph(fn, target_ms=10, repeats=2))
    for m in ms:
        x = x_all[:m]
        route = str(routes.route_for(fmt, m, n, k, arch=arch, served_only=False))
        arms = [("qpn", route, qbytes, lambda i: ops.qpn_linear(x, packs[i % n_q])),
                ("torch_fp16", "torch.matmul", fp16_bytes, lambda i: x @ w16[i % n_h].t())]
        plain_fn, plain_name = qpn_plain_call(fmt, m, n, k, packs, x)
        if plain_fn is not None:
            y_ref, y_plain = ops.qpn_linear(x, packs[0]), plain_fn(0)
            torch.cuda.synchronize()
            if torch.equal(y_ref, y_plain):   # the PDL hooks must not change a bit
                arms.insert(1, ("qpn_plain", plain_name, qbytes, plain_fn))
            else:   # loud, and not timed: a wrong result has no speed
                print(f"ERROR {name} M={m}: {plain_name} differs from the qpn arm's result; qpn_plain arm not "
                      "timed", flush=True)
        if packs[0].atom == "m16n8k16" and routes.as_route(route).chunk_rows \
                and formats.KERNEL_FAMILIES[fmt] in sm80_tables.SM80_BAND_KERNELS:
            # the chunked route as it ran before the M-band kernels: the MT = 2 route kernel once per
            # 16-row chunk, each chunk streaming the weights again (FP8 still runs it: no such arm)
            k16 = sm80_tables.SM80_ROUTE_KERNELS[(formats.KERNEL_FAMILIES[fmt], 2)]
            arms.insert(1, ("qpn_chunk16", k16, qbytes,
                            lambda i: sm80_plan.run_sm80_kernel(x, packs[i % n_q], k16, route)))
        if fmt == "fp8":
            mp = -(-m // 16) * 16
            xq = torch.zeros((mp, k), device="cuda", dtype=torch.float16)
            xq[:m] = x
            xq = (xq * 64).to(torch.float8_e4m3fn)
            arms.append(("scaled_mm", "torch._scaled_mm", n * k,
                         lambda i: torch._scaled_mm(xq, srcs[i % n_q][0].t(), scale_a=sa,
                                                    scale_b=srcs[i % n_q][1].reshape(()),
                                                    out_dtype=torch.float16)))
            arms.append(("dequant_matmul", "torch", qbytes, lambda i: x @ naive.fp8(*srcs[i % n_q]).t()))
        elif fmt == "int4":
            arms.append(("dequant_matmul", "torch", qbytes, lambda i: x @ naive.int4(*srcs[i % n_q]).t()))
            if gl:
                arms.append(("gemlite", f"gemlite {gmode}", gbytes, lambda i: gl[i % len(gl)](x)))
        else:
            arms.append(("dequant_matmul", "torch", qbytes, lambda i: x @ naive.nvfp4(*srcs[i % n_q]).t()))
            if gl:
                arms.append(("gemlite", f"gemlite {gmode}", gbytes, lambda i: gl[i % len(gl)](x)))
        if limit is not None:
            arms.append(("read_limit", f"pure read: {limit[0]}", qbytes, limit[1]))
        for arm, rname, wbytes, fn in arms:
            slow = arm == "dequant_matmul"
            te = time_eager(fn, target_ms=8 if slow else 20, repeats=2 if slow else 3, max_iters=50 if slow else 200)
            tg = time_graph(fn, target_ms=8 if slow else 20, repeats=2 if slow else 3, max_iters=8 if slow else 200)
            r = _row(name, fmt, n, k, m, arm, rname, wbytes, te, tg, read, copy)
            out_rows.append(r)
            if writer:
                writer(r)
            print(f"{name:22s} M={m:3d} {arm:14s} {rname:17s} eager {r['eager_us']:9.1f} us "
                  f"{r['eager_pct_read']:5.1f}%  graph {r['graph_us']:9.1f} us {r['graph_gbps']:7.1f} GB/s "
                  f"{r['graph_pct_read']:5.1f}% read", flush=True)
    del srcs, packs, w16, gl
    if limit is not None:
        del rbufs, limit
    torch.cuda.empty_cache()


GEMLITE = True
READ_LIMIT = True
_READ_LIMIT = None


def qpn_plain_call(fmt, m, n, k, packs, x):
    """The qpn_plain arm's call for this shape and M, or None where the qpn arm launches without PDL
    anyway: fn(i) runs the route's kernel on packs[i % len(packs)] with a plain launch, from plans
    built here once (so the eager column times the launch, not the planning)."""
    if packs[0].atom != "m16n8k16":
        return None, ""
    route = routes.route_for(fmt, m, n, k, arch="sm80", served_only=False)
    if route.kernel != routes.TILED:
        return None, ""
    kname = sm80_plan.sm80_kernel_for(route, m, n)[0]
    dev = x.device
    if sm80_plan.pdl_form(kname, dev.index if dev.index is not None else torch.cuda.current_device()) is None:
        return None, ""
    ws = [kernel_inputs.fp32_scale(ops.operands(p)) for p in packs]
    plans = {}   # (weight, stream): graph capture runs on a stream of its own
    xc = x.contiguous()

    def fn(i):
        stream = torch.cuda.current_stream().cuda_stream
        plan = plans.get((i % len(ws), stream))
        if plan is None:
            plan = plans[i % len(ws), stream] = sm80_plan._sm80_launch(route, m, ws[i % len(ws)], dev, stream)
            assert plan.pdl is None
        y = torch.empty((m, n), dtype=torch.float16, device=dev)
        plan.run(xc.data_ptr(), y.data_ptr(), 0)
        return y
    return fn, kname


def host_time_per_call(n: int = 256, k: int = 256, calls: int = 2000) -> dict:
    """Host time per eager call (microseconds) of qpn_linear and of torch's own x @ w.t() on one
    small layer (M = 1), measured with the host clock over many calls: the device work of such a
    layer is far shorter than the launch path, so the loop's wall time is the host's."""
    import time
    gen = torch.Generator(device="cuda").manual_seed(5)
    out = {}
    for fmt in ("nvfp4", "fp8"):
        src = _weights(fmt, n, k, gen)
        packed = _pack(fmt, src, ops.atom_for_device(0))
        x = torch.randn((1, k), device="cuda", generator=gen).to(torch.float16)
        w = torch.randn((n, k), device="cuda", generator=gen).to(torch.float16)
        wop = ops.operands(packed)
        route = routes.route_for(fmt, 1, n, k, arch=atoms.arch_for_atom(packed.atom))
        arms = ((f"qpn_linear_{fmt}", lambda: ops.qpn_linear(x, packed)),
                # the same call through the general (uncached) launch path, for comparison
                (f"qpn_general_path_{fmt}", lambda: ops.linear_operands(x, wop, route, None)),
                (f"torch_matmul_{fmt}", lambda: x @ w.t()))
        for label, fn in arms:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                best = min(best, (t1 - t0) / calls * 1e6)
            out[label] = best
    return out


# ------------------------------------------------------------------------------- sweep
def sweep(names, ms, read, gen, path, provenance, only=(), min_items=()):
    """sm_80+ only: every configured kernel and every measured variant of the m16n8k16 source,
    graph-timed on the same weights, plus the split-K minimum-items knob: the route's own kernel
    again with each of ``min_items`` items per warp at least (the format's default is
    SM80_MIN_ITEMS; main() passes --sweep-min-items or its default)."""
    rows = []
    kernels = sm80_plan.sm80_kernels()
    saved = {f.family: v for f, v in sm80_tables.SM80_MIN_ITEMS.items()}
    for name in names:
        fmt, n, k = SHAPES[name]
        src0 = _weights(fmt, n, k, gen)
        p0 = _pack(fmt, src0, "m16n8k16")
        n_q = _copies(p0.nbytes)
        packs = [p0] + [_pack(fmt, _weights(fmt, n, k, gen), "m16n8k16") for _ in range(n_q - 1)]
        x_all = torch.randn((max(ms), k), device="cuda", generator=gen).to(torch.float16)
        for m in ms:
            x = x_all[:m]
            route = str(routes.route_for(fmt, m, n, k, arch="sm80"))
            for kn, mi in sweep_trials(kernels, p0, route, m, only, min_items, saved[fmt]):
                sm80_tables.SM80_MIN_ITEMS[formats.FAMILIES[fmt]] = mi
                sm80_plan._sm80_plans.clear()
                t = time_graph(lambda i: sm80_plan.run_sm80_kernel(x, packs[i % n_q], kn, route), target_ms=15)
                gbps = p0.nbytes / (t * 1e-3) / 1e9
                c = kernels[kn]
                rows.append(dict(shape=name, fmt=fmt, n=n, k=k, m=m, kernel=kn, tiles=c.tiles, depth=c.depth,
                                 prefetch=c.prefetch, stages=c.stages, variant=c.variant, min_items=mi, graph_us=t * 1e3,
                                 gbps=gbps, pct_read=100 * gbps / read))
                print(f"sweep {name:22s} M={m:3d} {kn:34s} min_items={mi} {t * 1e3:8.1f} us "
                      f"{100 * gbps / read:5.1f}% read", flush=True)
            sm80_tables.SM80_MIN_ITEMS.update({formats.FAMILIES[f]: v for f, v in saved.items()})
            sm80_plan._sm80_plans.clear()
        del packs
        torch.cuda.empty_cache()
    with open(path, "w", newline="") as f:
        for line in provenance:
            f.write(line + "\n")
        w = csv.DictWriter(f, fieldnames=SWEEP_COLS)
        w.writeheader()
        for r in rows:
            w.writerow({c: (f"{r[c]:.3f}" if isinstance(r[c], float) else r[c]) for c in SWEEP_COLS})
    # summary: mean share of the read ceiling per kernel over the swept shapes, per (fmt, mt)
    print("\nsweep summary (mean % of read ceiling over shapes and M, default min_items):")
    for key in sorted({(r["fmt"], str(_sweep_key(r["m"]))) for r in rows}):
        sub = [r for r in rows if (r["fmt"], str(_sweep_key(r["m"]))) == key and r["min_items"] == saved[r["fmt"]]]
        for kn in sorted({r["kernel"] for r in sub}):
            v = [r["pct_read"] for r in sub if r["kernel"] == kn]
            print(f"  {key[0]:5s} {key[1]:5s} {kn:36s} {statistics.mean(v):6.1f}%")
    return rows


BAND = "band"


def sweep_trials(kernels, packed, route: str, m: int, only=(), min_items=(), default_items: int = 4) -> list:
    """(kernel, split-K minimum items) pairs one sweep point times: the kernels that can run this
    packed weight at M (its own member's: INT4's two members have kernels of their own, which
    run_sm80_kernel refuses on the other's weights; the route's token tiling, or above M = 16 the
    M-band kernels beside the MT = 2 route kernel once per 16-row chunk), narrowed to names holding
    one of ``only``; always the kernel the route itself runs on this layer (a large-layer kernel
    where sm80_tables names one), and that kernel again at each of ``min_items``."""
    member = kernel_inputs.kernel_member(kernel_inputs.operands(packed))[0]
    key = _sweep_key(m)
    default = sm80_plan.sm80_kernel_for(routes.as_route(route), m, packed.n, member)[0]
    if key == BAND:
        old = sm80_tables.SM80_ROUTE_KERNELS[(member, 2)]
        fits = lambda kn, c: c.band or kn == old  # noqa: E731
    else:
        fits = lambda kn, c: c.mt == key and not c.band  # noqa: E731
    trials = [(kn, default_items) for kn, c in kernels.items()
              if c.weight_format == member and fits(kn, c) and (kn == default or not only or any(o in kn for o in only))]
    if key != BAND:   # fewer, longer warp runs (the split-K minimum-items knob), on the route's kernel
        trials += [(default, mi) for mi in min_items]
    return trials


def _sweep_key(m: int):
    """Which kernels a sweep compares at M: the route table's tiles per pass (1, 2), or BAND above
    M = 16 (the chunked route: the M-band kernels)."""
    return 1 if m <= routes.M_SINGLE_TILE_MAX else 2 if m <= routes.M_MT2_MAX else BAND


def sweep_winners(rows) -> dict:
    """(format family's WeightFormat, mt), the keys of sm80_tables.SM80_ROUTE_KERNELS -> the route-capable
    kernel (variant 0) with the best mean share of the read ceiling over the swept shapes and M, at
    the default split-K setting."""
    kernels = sm80_plan.sm80_kernels()
    best = {}
    for key in {(r["fmt"], _sweep_key(r["m"])) for r in rows if _sweep_key(r["m"]) != BAND}:
        scores = {}
        for r in rows:
            if (r["fmt"], _sweep_key(r["m"])) == key and kernels[r["kernel"]].variant == 0 \
                    and r["min_items"] == sm80_tables.SM80_MIN_ITEMS[formats.FAMILIES[r["fmt"]]]:
                scores.setdefault(r["kernel"], []).append(r["pct_read"])
        if scores:
            best[(formats.FAMILIES[key[0]], key[1])] = max(scores, key=lambda kn: statistics.mean(scores[kn]))
    return best


# -------------------------------------------------------------------------- provenance
def _command(module: str) -> str:
    """This run's command as its provenance records it: repository-relative, the interpreter as
    $VENV/bin/python and the output folder as $OUT (benchmarks/provenance.py, portable_words)."""
    from qpn.benchmarks import provenance as source_provenance
    return source_provenance.command_line(module)


def provenance(args, atom) -> list[str]:
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001 - provenance must not kill the run
        drv = f"unknown ({type(e).__name__})"
    commit = args.commit
    if not commit:
        # commit + dirty flag + diff hash, from git or from the state exported before the tree
        # travelled to the GPU host without .git (provenance.export_source_state)
        from qpn.benchmarks import provenance as source_provenance
        try:
            commit = source_provenance.git_commit()
        except Exception as e:  # noqa: BLE001 - provenance must not kill the run
            commit = f"unknown ({type(e).__name__}: {e})"
    cap = torch.cuda.get_device_capability(0)
    lines = [
        f"# gpu: {torch.cuda.get_device_name(0)} (sm_{cap[0]}{cap[1]}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        f"# driver: {drv}",
        f"# torch: {torch.__version__} (CUDA {torch.version.cuda})",
        f"# commit: {commit}",
        f"# command: {_command('qpn.benchmarks.kernel_matched_bench')}",
        f"# date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        f"# qpn atom: {atom}"
        + (f"; m8n8k4 NVFP4 form: {ops.nvfp4_form(torch.device('cuda', 0))}" if atom == "m8n8k4" else "")
        + "; sm_80+ route kernels: "
        + ", ".join(f"{f.family}/mt{mt}={k}" for (f, mt), k in sm80_tables.SM80_ROUTE_KERNELS.items())
        + "".join(f"; {f.family}/mt{mt} with N >= {sm80_tables.SM80_LARGE_N[f]}={k}"
                  for (f, mt), k in sm80_tables.SM80_LARGE_N_KERNELS.items())
        + "".join(f"; {f.family}/chunked (M band)={'/'.join(k)}" for f, k in sm80_tables.SM80_BAND_KERNELS.items())
        + f"; split-K min items { {f.family: v for f, v in sm80_tables.SM80_MIN_ITEMS.items()} }",
    ]
    if cap >= (8, 0) and atom == "m8n8k4":
        lines.append(f"# NOTE: {EMULATION_NOTE}")
    lines.append("# *_gbps = the arm's weight bytes / time; *_pct_read / *_pct_copy = share of the ceilings "
                 "measured in this run; eager = event-timed loop of calls, graph = the same loop as one CUDA graph")
    return lines


def read_csv(path):
    header, body = {}, []
    with open(path) as f:
        for line in f:
            if line.startswith("# ") and ":" in line:
                k, v = line[2:].split(":", 1)
                header[k.strip()] = v.strip()
            elif not line.startswith("#"):
                body.append(line)
    rows = list(csv.DictReader(body))
    for r in rows:
        for c in r:
            if c not in ("shape", "fmt", "arm", "route", "kernel"):
                r[c] = float(r[c])
    return header, rows


# ----------------------------------------------------------------------------- targets
def targets(rows) -> list[dict]:
    """Issue 14 item 2: TP1 shapes for both timing columns, TP4 per-rank NVFP4 shapes."""
    out = []

    def pct(shape, m_lo, m_hi, col):
        v = [r[f"{col}_pct_read"] for r in rows
             if r["shape"] == shape and r["arm"] == "qpn" and m_lo <= r["m"] <= m_hi]
        return min(v) if v else None

    def limit(shape, m_lo, m_hi, col):
        # graph column only: eager, the probe's own ctypes launch path is timed too, not a read
        v = [r["graph_pct_read"] for r in rows
             if r["shape"] == shape and r["arm"] == "read_limit" and m_lo <= r["m"] <= m_hi]
        return max(v) if v and col == "graph" else None

    def ratio(shape, peer, m_lo, m_hi, col):
        v = []
        for r in rows:
            if r["shape"] == shape and r["arm"] == "qpn" and m_lo <= r["m"] <= m_hi:
                p = [q for q in rows if q["shape"] == shape and q["arm"] == peer and q["m"] == r["m"]]
                if p:
                    v.append(p[0][f"{col}_us"] / r[f"{col}_us"])
        return min(v) if v else None

    for col in ("graph", "eager"):
        for shape, fmt in (("tp1_mlp_gate_up", "nvfp4"), ("tp1_mlp_down", "nvfp4"), ("tp1_lm_head", "nvfp4"),
                           ("tp1_gdn_in_proj_qkvz", "fp8"), ("tp1_gdn_out_proj", "fp8")):
            lo_target = 90.0 if shape == "tp1_lm_head" else 85.0
            checks = [(f"% read ceiling, M 1-8 (min)", pct(shape, 1, 8, col), lo_target, limit(shape, 1, 8, col))]
            if shape != "tp1_lm_head":
                checks.append((f"% read ceiling, M 9-16 (min)", pct(shape, 9, 16, col), 75.0, limit(shape, 9, 16, col)))
            if fmt == "nvfp4":
                checks.append(("x faster than torch FP16 GEMM, M=1", ratio(shape, "torch_fp16", 1, 1, col), 3.0, None))
            else:
                checks.append(("x faster than torch._scaled_mm, M<=16 (min)", ratio(shape, "scaled_mm", 1, 16, col),
                               1.0, None))
            for what, val, goal, lim in checks:
                if val is None:
                    continue
                out.append(dict(column=col, shape=shape, target=what, goal=goal, measured=val, met=val >= goal,
                                read_limit=lim))
        # issue 26 item 6: INT4 W4A16 at TP1, against torch FP16 at M = 1
        for shape in ("int4_tp1_mlp_gate_up", "int4_tp1_mlp_down"):
            val = ratio(shape, "torch_fp16", 1, 1, col)
            if val is not None:
                out.append(dict(column=col, shape=shape, target="x faster than torch FP16 GEMM, M=1", goal=2.5,
                                measured=val, met=val >= 2.5, read_limit=None))
        for shape in ("tp4_mlp_gate_up", "tp4_mlp_down", "tp4_lm_head"):
            val = pct(shape, 1, 8, col)
            if val is not None:
                out.append(dict(column=col, shape=shape, target="% read ceiling, M 1-8 (min)", goal=75.0,
                                measured=val, met=val >= 75.0, read_limit=limit(shape, 1, 8, col)))
    return out


def band_table(rows) -> list[str]:
    """Issue 14 item 1, the M band (the *_chunked route, M 17-96): graph microseconds per TP1 shape
    and M of the qpn arm (NVFP4: one weight pass per 32 or 64 rows, the M-band kernels; FP8: its
    16-row chunks), of qpn_chunk16 (an NVFP4 route as it ran before: the MT = 2 kernel once per 16-row
    chunk) and of the torch peers, with qpn's share of the read ceiling and its speed-up over the
    other arms. A qpn_chunk16 row of a format without band kernels (FP8 runs the same kernel in both
    arms) is left out. Empty without such rows."""
    arms = ("qpn", "qpn_chunk16", "torch_fp16", "scaled_mm")
    banded = {f.family for f in sm80_tables.SM80_BAND_KERNELS}
    cells = {(r["shape"], int(r["m"]), r["arm"]): r for r in rows
             if r["m"] > routes.M_MT2_MAX and r["arm"] in arms and r["shape"].startswith("tp1_")
             and (r["arm"] != "qpn_chunk16" or SHAPES[r["shape"]][0] in banded)}
    keys = sorted({(s, m) for s, m, _ in cells}, key=lambda sm: (list(SHAPES).index(sm[0]), sm[1]))
    if not keys:
        return []
    lines = ["", "## M band (the *_chunked route), graph replay", "",
             "qpn: the route (NVFP4: one weight pass per 32 or 64 rows, the M-band kernels; FP8: the MT = 2 kernel "
             "once per 16-row chunk); qpn_chunk16: an NVFP4 route as it ran before, the MT = 2 kernel once per "
             "16-row chunk, each chunk streaming the weights again", "",
             "| shape | M | qpn us | qpn % read | qpn_chunk16 us | torch_fp16 us | scaled_mm us | "
             "x vs qpn_chunk16 | x vs torch |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape, m in keys:
        q = cells.get((shape, m, "qpn"))
        if q is None:
            continue
        us = {a: cells[(shape, m, a)]["graph_us"] for a in arms if (shape, m, a) in cells}
        fmt_us = lambda a: f"{us[a]:.1f}" if a in us else "-"  # noqa: E731
        best_torch = min((us[a] for a in ("torch_fp16", "scaled_mm") if a in us), default=None)
        lines.append(f"| {shape} | {m} | {us['qpn']:.1f} | {q['graph_pct_read']:.1f} | {fmt_us('qpn_chunk16')} | "
                     f"{fmt_us('torch_fp16')} | {fmt_us('scaled_mm')} | "
                     + (f"{us['qpn_chunk16'] / us['qpn']:.2f}" if "qpn_chunk16" in us else "-") + " | "
                     + (f"{best_torch / us['qpn']:.2f}" if best_torch else "-") + " |")
    return lines


def targets_markdown(tg, header, rows=()) -> str:
    lines = [f"# Kernel targets (issues 14 and 26) on {header.get('gpu', '?')}", "",
             f"commit {header.get('commit', '?')}, {header.get('date', '?')}; read ceiling "
             f"{header.get('read_ceiling_gbps', '?')} GB/s measured in the same run", "",
             f"command: {header.get('command', '?')}", "",
             "read limit (graph rows): the read_limit arm of the same run (the fastest kernel that only reads "
             "this layer's bytes, nothing computed), best over the M range; a goal above it is out of reach for "
             "any single kernel per layer under this timing", "",
             "| timing | shape | target | goal | measured | met | read limit |",
             "|---|---|---|---:|---:|---|---:|"]
    if not tg:   # a run without M 1-16 rows (the M-band run): no target of item 2 to state
        lines[-2:] = ["No row of this run falls in the M ranges of the targets (M 1-16)."]
    for t in tg:
        lim = t.get("read_limit")
        lim_s = "-" if lim is None else f"{lim:.2f}" + (" (below goal)" if lim < t["goal"] else "")
        lines.append(f"| {t['column']} | {t['shape']} | {t['target']} | {t['goal']:g} | {t['measured']:.2f} | "
                     f"{'met' if t['met'] else 'MISSED'} | {lim_s} |")
    for key, val in header.items():
        if key.startswith("host_us_per_call"):
            lines += ["", f"Host time per eager call, {key[len('host_us_per_call'):].strip()}: {val} "
                      "(target: qpn_linear no more than torch's own matmul in the same run)"]
    lines += band_table(rows)
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------- plot
def plot(csv_path: str, png_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, rows = read_csv(csv_path)
    read = float(header.get("read_ceiling_gbps", "nan"))
    copy = float(header.get("copy_ceiling_gbps", "nan"))
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in rows)]
    cols = 5
    nrows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.6 * nrows), squeeze=False)
    style = {"qpn": ("tab:red", "o"), "torch_fp16": ("tab:blue", "s"), "scaled_mm": ("tab:green", "^"),
             "dequant_matmul": ("tab:gray", "x"), "gemlite": ("tab:purple", "D"), "qpn_plain": ("tab:orange", "v"),
             "read_limit": ("tab:brown", "*"), "qpn_chunk16": ("tab:pink", "P")}
    for ax, shape in zip(axes.flat, shapes):
        sub = [r for r in rows if r["shape"] == shape]
        for arm, (color, marker) in style.items():
            pts = sorted((r["m"], r["graph_gbps"], r["eager_gbps"]) for r in sub if r["arm"] == arm)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=f"{arm} (graph)")
            if arm != "read_limit":   # eager, the probe's host launch path is timed too: not a read figure
                ax.plot([p[0] for p in pts], [p[2] for p in pts], color=color, marker=marker, ls=":", alpha=0.5,
                        label=f"{arm} (eager)")
        ax.axhline(read, color="black", ls="--", lw=1, label="read ceiling")
        ax.axhline(copy, color="black", ls=":", lw=1, label="copy ceiling")
        fmt, n, k = SHAPES[shape]
        ax.set_title(f"{shape} ({fmt}, {n}x{k})", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows per call)")
        ax.set_ylabel("weight GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:
        h, l = ax.get_legend_handles_labels()
        for hh, ll in zip(h, l):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8)
    fig.suptitle(f"QPN ({header.get('qpn atom', '?').split(';')[0]}) vs torch on {header.get('gpu', '?')}: "
                 f"weight bytes per second against M (commit {header.get('commit', '?')[:10]}, {header.get('date', '?')})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(png_path, dpi=110)


# -------------------------------------------------------------------------------- main
MLP_BLOCK_ROUNDS = 4


def mlp_block_time(ms=(1, 8), read: float = 0.0) -> dict:
    """Graph-replay microseconds (median of MLP_BLOCK_ROUNDS alternating rounds) of one MLP block as
    a model runs it -- an RMS norm in torch, gate_up on QPN, SiLU-and-mul in torch, down on QPN --
    for TP1 and TP4: with the library's launches (programmatic dependent launch where
    sm80_tables.SM80_PDL_KERNELS says), with plain launches (the library's own switch, QPN_PDL=0, while
    that arm plans its launches on its own copies of the weights), and with FP16 weights through
    torch. Unlike the per-shape arms, where each QPN call follows another, here the kernel before
    each QPN call is torch's: what PDL buys in a model."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    atom = ops.atom_for_device(0)
    out = {}
    for tp in ("tp1", "tp4"):
        fmt, n_gu, hidden = SHAPES[f"{tp}_mlp_gate_up"]
        inter = n_gu // 2
        gu_src = _weights(fmt, n_gu, hidden, gen)
        dn_src = _weights(fmt, hidden, inter, gen)
        nbytes = _pack(fmt, gu_src, atom).nbytes + _pack(fmt, dn_src, atom).nbytes
        layers = {arm: [(_pack(fmt, gu_src, atom), _pack(fmt, dn_src, atom)) for _ in range(_copies(nbytes))]
                  for arm in ("qpn", "qpn_plain")}
        w16 = [(_fp16_copy(fmt, gu_src, None), _fp16_copy(fmt, dn_src, None))
               for _ in range(_copies(2 * (n_gu * hidden + hidden * inter)))]
        norm_w = torch.ones(hidden, device="cuda", dtype=torch.float16)
        for m in ms:
            x = torch.randn((m, hidden), device="cuda", generator=gen).to(torch.float16)

            def block(gate_up, down):
                h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).half() * norm_w
                g = gate_up(h)
                return down(torch.nn.functional.silu(g[:, :inter]) * g[:, inter:])

            arms = {arm: (lambda i, ls=ls: block(lambda h: ops.qpn_linear(h, ls[i % len(ls)][0]),
                                                 lambda a: ops.qpn_linear(a, ls[i % len(ls)][1])))
                    for arm, ls in layers.items()}
            arms["torch_fp16"] = lambda i: block(lambda h: h @ w16[i % len(w16)][0].t(),
                                                 lambda a: a @ w16[i % len(w16)][1].t())
            y, times = {}, {arm: [] for arm in arms}
            for rnd in range(MLP_BLOCK_ROUNDS):   # the arms alternate, in turned order every other round
                for arm in (list(arms) if rnd % 2 == 0 else list(arms)[::-1]):
                    saved = os.environ.get(sm80_plan.PDL_ENV)
                    if arm == "qpn_plain":
                        os.environ[sm80_plan.PDL_ENV] = "0"
                    try:
                        y[arm] = arms[arm](0)
                        times[arm].append(time_graph(arms[arm]) * 1e3)
                    finally:
                        if saved is None:
                            os.environ.pop(sm80_plan.PDL_ENV, None)
                        else:
                            os.environ[sm80_plan.PDL_ENV] = saved
            for arm, ts in times.items():
                out[f"{tp}_M{m}_{arm}"] = statistics.median(ts)
            if not torch.equal(y["qpn"], y["qpn_plain"]):
                raise RuntimeError(f"MLP block {tp} M={m}: PDL and plain launches differ")
            if read:
                out[f"{tp}_M{m}_qpn_pct_read"] = 100 * nbytes / (out[f"{tp}_M{m}_qpn"] * 1e-6) / 1e9 / read
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="CSV path (results/kernel_matched_<gpu>_<date>.csv)")
    ap.add_argument("--shapes", default="tp1,tp4", help="comma list of shape names or the prefixes tp4 / tp1")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="comma list of M (rows per call)")
    ap.add_argument("--atom", default="", help="qpn arm's MMA atom (default: the GPU's own)")
    ap.add_argument("--commit", default="", help="commit hash to record when the tree has no .git")
    ap.add_argument("--plot", default="", help="also write a PNG of GB/s against M per shape")
    ap.add_argument("--targets", default="", help="also write the target table of issues 14 and 26 (Markdown)")
    ap.add_argument("--no-gemlite", action="store_true", help="leave the gemlite arm out")
    ap.add_argument("--no-read-limit", action="store_true", help="leave the read_limit arm out")
    ap.add_argument("--host-time", action="store_true",
                    help="measure host time per eager call (qpn_linear vs x @ w.t(), 256 x 256, M=1) into the header")
    ap.add_argument("--mlp-block", action="store_true",
                    help="time one MLP block (norm, gate_up, activation, down) at TP1 and TP4, M 1 and 8, with and "
                         "without programmatic dependent launch, into the header")
    ap.add_argument("--sweep", default="", help="sm_80+: first time every configured kernel and variant of the "
                                               "m16n8k16 source on --sweep-shapes / --sweep-m, into this CSV")
    ap.add_argument("--adopt-sweep", action="store_true",
                    help="serve the routes with the sweep's best kernel per (format, token tiles) for the rest of "
                         "the run (recorded in the CSV header)")
    ap.add_argument("--sweep-shapes", default="tp1")
    ap.add_argument("--sweep-m", default="1,8,16")
    ap.add_argument("--sweep-min-items", default="",
                    help="comma list: also time the route's kernel with these split-K minimum items per warp "
                         "(default: 16, and none when --sweep-kernels narrows the sweep)")
    ap.add_argument("--sweep-kernels", default="",
                    help="comma list of name fragments: sweep only the kernels whose names contain one (and the "
                         "routes' own kernels, for the same-run comparison)")
    ap.add_argument("--plot-only", default="", help="only draw --plot from this existing CSV (no GPU needed)")
    ap.add_argument("--profile", default="", help="for Nsight Compute: one qpn call per 'shape:M' (or 'shape:M:kernel', a named "
                                                 "sm_80+ kernel) in this comma list (after one warm-up call each), "
                                                 "nothing timed")
    args = ap.parse_args(argv)
    global GEMLITE
    GEMLITE = not args.no_gemlite
    global READ_LIMIT
    READ_LIMIT = not args.no_read_limit
    if args.plot_only:
        if not args.plot:
            ap.error("--plot-only needs --plot PNG")
        plot(args.plot_only, args.plot)
        if args.targets:
            header, rows = read_csv(args.plot_only)
            with open(args.targets, "w") as f:
                f.write(targets_markdown(targets(rows), header, rows))
        return 0
    if not args.out and not args.sweep and not args.profile:
        ap.error("give --out CSV (and/or --sweep CSV, --profile)")
    if not torch.cuda.is_available():
        print("kernel_matched_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        gen = torch.Generator(device="cuda").manual_seed(0)
        calls = []
        for spec in args.profile.split(","):
            name, m, *kernel = spec.split(":")   # shape:M, or shape:M:kernel for a named sm_80+ kernel
            fmt, n, k = SHAPES[name]
            packed = _pack(fmt, _weights(fmt, n, k, gen), args.atom or ops.atom_for_device(0))
            x = torch.randn((int(m), k), device="cuda", generator=gen).to(torch.float16)
            calls.append((lambda x=x, packed=packed, kn=kernel[0] if kernel else None:
                          sm80_plan.run_sm80_kernel(x, packed, kn) if kn else ops.qpn_linear(x, packed)))
        for call in calls:   # warm-up: module load, workspace
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for call in calls:
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return 0

    def pick(spec):
        want = [s.strip() for s in spec.split(",") if s.strip()]
        names = [n for n in SHAPES if n in want or any(n.startswith(p + "_") for p in want)]
        if not names:
            ap.error(f"no shape matches {spec!r}; known: {', '.join(SHAPES)}")
        return names

    cap = torch.cuda.get_device_capability(0)
    atom = args.atom or ops.atom_for_device(0)
    ops.build(f"sm{cap[0]}{cap[1]}")
    read, copy = ceilings()
    print(f"read ceiling {read:.1f} GB/s, copy ceiling {copy:.1f} GB/s", flush=True)
    extra = [f"# read_ceiling_gbps: {read:.1f}", f"# copy_ceiling_gbps: {copy:.1f}"]
    if args.host_time:
        ht = host_time_per_call()
        print("host time per eager call (us): " + ", ".join(f"{k}={v:.1f}" for k, v in ht.items()), flush=True)
        extra.append("# host_us_per_call (256x256, M=1, host clock over 2000 calls, best of 3): "
                     + ", ".join(f"{k}={v:.1f}" for k, v in ht.items()))
    if args.mlp_block:
        mb = mlp_block_time(read=read)
        print("MLP block, graph us: " + ", ".join(f"{k}={v:.1f}" for k, v in mb.items()), flush=True)
        extra.append("# mlp_block_graph_us (RMS norm, gate_up, SiLU-and-mul, down; qpn = the library's launches, "
                     "qpn_plain = no PDL, torch_fp16 = FP16 weights; pct_read = both layers' packed bytes against "
                     "the read ceiling): " + ", ".join(f"{k}={v:.1f}" for k, v in mb.items()))
    prov = provenance(args, atom) + extra
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.sweep:
        if cap < (8, 0):
            ap.error("--sweep times the m16n8k16 kernels: needs an sm_80+ GPU")
        only = tuple(s for s in args.sweep_kernels.split(",") if s)
        srows = sweep(pick(args.sweep_shapes), [int(v) for v in args.sweep_m.split(",")], read, gen, args.sweep, prov,
                      only=only, min_items=tuple(int(v) for v in args.sweep_min_items.split(",") if v)
                      or (() if only else (16,)))
        if args.adopt_sweep:
            win = sweep_winners(srows)
            sm80_tables.SM80_ROUTE_KERNELS.update(win)
            sm80_tables.SM80_LARGE_N_KERNELS.clear()   # the sweep's winners serve every layer size
            sm80_plan._sm80_plans.clear()
            print("adopted from the sweep: " + ", ".join(f"{f.family}/mt{mt}={k}" for (f, mt), k in
                                                     sorted(win.items(), key=lambda it: (it[0][0].family, it[0][1]))))
            prov = provenance(args, atom) + extra
    if not args.out:
        return 0
    names = pick(args.shapes)
    ms = [int(v) for v in args.m.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows: list[dict] = []
    naive = NaiveDequant("cuda")
    with open(args.out, "w", newline="") as f:  # rows are written as they come: a cut-short run keeps them
        for line in prov:
            f.write(line + "\n")
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()

        def write(r):
            w.writerow({c: (f"{r[c]:.3f}" if isinstance(r[c], float) else r[c]) for c in COLS})
            f.flush()

        for name in names:
            fmt, n, k = SHAPES[name]
            bench_shape(name, fmt, n, k, ms, read, copy, gen, atom, naive, rows, write)
    print(f"wrote {args.out} ({len(rows)} rows)")
    header, rows_back = read_csv(args.out)
    tg = targets(rows_back)
    md = targets_markdown(tg, header, rows_back)
    print(md)
    if args.targets:
        with open(args.targets, "w") as f:
            f.write(md)
    if args.plot:
        try:
            plot(args.out, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"no plot: {e} (run again with --plot-only on a machine with matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
