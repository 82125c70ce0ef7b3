"""MoE expert benchmark: the grouped QPN MoE kernels against a per-expert loop of the dense QPN
kernels and against dequantize-then-GEMM, on the expert shapes of 35B-A3B models, over one set
of expert weights per shape, in one process. Writes a CSV with a provenance header.

    python -m qpn.benchmarks.moe_bench --out results/moe_bench_<gpu>_<date>.csv

One call = one MoE layer's routed experts for T tokens with top-k routing: gate/up projection,
SwiGLU, down projection, weighted sum over the slots. Arms:
  grouped          qpn.kernels.moe.qpn_moe: 4 launches, routing read on the device, no host sync
  grouped_graph    the same, captured once per input set in a CUDA graph and replayed
  (both, and per_expert_loop, run with the m8n8k4 atom and, on sm_80+, also with m16n8k16)
  per_expert_loop  host loop over the experts in use (needs the routing on the host: a sync),
                   per expert the dense QPN route (ops.qpn_linear, routes.route_for) for gate,
                   up and down, SwiGLU and the weighted scatter-add in torch
  dequant_gemm     host loop over the experts in use: dequantize the checkpoint tensors in torch
                   (float32 -> FP16), then torch matmuls; SwiGLU and scatter-add in torch
Timing: CUDA events around a loop of calls, median of repeats. Each call takes the next of 8
input sets (activations, random top-k routing, weights) and the next of 4 copies of the layer,
so that the selected experts' bytes mostly stream from DRAM rather than L2.
GB/s counts the packed bytes (codes + scales) of the experts the call selects (every arm reads at
least those); pct_read / pct_copy: share of the read-only and copy ceilings measured in the run.

Shapes (public config.json values: hidden_size, moe_intermediate_size, num_experts,
num_experts_per_tok; not read on the benchmark machine):
  Qwen3.5/3.6-35B-A3B (Qwen3_5MoeForConditionalGeneration): 2048, 512, 256, 8 -> TP1 per rank
  I = 512, TP2 per rank I = 256 (the seed's serving layout of that model is TP2);
  Qwen3-30B-A3B (Qwen3MoeForCausalLM): 2048, 768, 128, 8.

On sm_80 and later GPUs the m8n8k4 tensor-core atom of the SM70 kernels is EMULATED
(docs/architecture.md, "What can be proven without a V100"), so figures measured there show the harness and the relative structure of the arms
(launch counts, host synchronisation, bytes read), NOT V100 speed. The CSV header says so.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import subprocess
import sys

import torch

from qpn.benchmarks.kernel_matched_bench import _command, ceilings
from qpn.kernels import moe, ops
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec

SHAPES = {
    # name: (num_experts, hidden, intermediate per rank, top_k, source)
    "qwen35_35b_a3b_tp1": (256, 2048, 512, 8, "Qwen3.5/3.6-35B-A3B config.json, TP1"),
    "qwen35_35b_a3b_tp2": (256, 2048, 256, 8, "Qwen3.5/3.6-35B-A3B config.json, TP2 per rank"),
    "qwen3_30b_a3b_tp1": (128, 2048, 768, 8, "Qwen3-30B-A3B config.json, TP1"),
}
DEFAULT_T = (1, 2, 4, 8, 16, 32, 64)
POOL = 8
COPIES = 4
ARMS = ("grouped", "grouped_graph", "per_expert_loop", "dequant_gemm")
NATIVE_ATOM = "m16n8k16"  # the sm_80+ atom: on such GPUs the QPN arms also run with it
EMULATION_NOTE = ("m8n8k4 (the SM70 atom) is emulated on sm_80 and later GPUs: qpn figures measured there show "
                  "the harness and the relative structure of the arms, NOT V100 speed")


def _time_ms(fn, target_ms: float, repeats: int) -> float:
    """Median per-call milliseconds; CUDA events around a loop of calls fn(0), fn(1), ..."""
    fn(0)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn(1)
    e.record()
    torch.cuda.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    iters = int(min(400, max(POOL, target_ms / one)))
    samples = []
    for _ in range(repeats):
        s.record()
        for i in range(iters):
            fn(i)
        e.record()
        torch.cuda.synchronize()
        samples.append(s.elapsed_time(e) / iters)
    return statistics.median(samples)


def _random_sources(experts, n, k, gen):
    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    sc = torch.randint(0x28, 0x58, (experts, n, k // 16), dtype=torch.uint8, device="cuda", generator=gen)
    gs = (0.25 / (k ** 0.5) / 8) * torch.ones(experts, device="cuda")
    return codes, sc.view(torch.float8_e4m3fn), gs


def _clone_stack(st: moe.PackedExpertStack) -> moe.PackedExpertStack:
    return moe.PackedExpertStack(st.fmt, st.codes.clone(), st.scales.clone(), st.chscale.clone(), st.n, st.k, st.atom)


def per_expert_loop(x, ids, w, packed: moe.PackedMoE) -> torch.Tensor:
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    tok = torch.arange(flat.numel(), device=x.device) // top_k
    y = torch.zeros((tokens, packed.hidden), dtype=torch.float32, device=x.device)
    wf = w.reshape(-1)
    for e in torch.unique(flat).tolist():  # the host needs the routing: a synchronisation
        sel = torch.nonzero(flat == e).reshape(-1)
        xe = x.index_select(0, tok[sel])
        g = ops.qpn_linear(xe, packed.gate.expert(e)).float()
        u = ops.qpn_linear(xe, packed.up.expert(e)).float()
        h = (torch.nn.functional.silu(g) * u).half()
        d = ops.qpn_linear(h, packed.down.expert(e)).float()
        y.index_add_(0, tok[sel], d * wf[sel].unsqueeze(1))
    return y.half()


def dequant_gemm(x, ids, w, src) -> torch.Tensor:
    (gw, gsc, ggs), (uw, usc, ugs), (dw, dsc, dgs) = src
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    tok = torch.arange(flat.numel(), device=x.device) // top_k
    y = torch.zeros((tokens, dw.shape[1]), dtype=torch.float32, device=x.device)
    wf = w.reshape(-1)
    for e in torch.unique(flat).tolist():
        sel = torch.nonzero(flat == e).reshape(-1)
        xe = x.index_select(0, tok[sel])
        g = (xe @ nvfp4_codec.dequantize(gw[e], gsc[e], ggs[e]).half().t()).float()
        u = (xe @ nvfp4_codec.dequantize(uw[e], usc[e], ugs[e]).half().t()).float()
        h = (torch.nn.functional.silu(g) * u).half()
        d = (h @ nvfp4_codec.dequantize(dw[e], dsc[e], dgs[e]).half().t()).float()
        y.index_add_(0, tok[sel], d * wf[sel].unsqueeze(1))
    return y.half()


def bench_shape(name, ts, read_ceiling, copy_ceiling, rows, gen, check: bool):
    experts, hidden, inter, top_k, _ = SHAPES[name]
    srcs = [_random_sources(experts, inter, hidden, gen), _random_sources(experts, inter, hidden, gen),
            _random_sources(experts, hidden, inter, gen)]
    atoms = ["m8n8k4"] + ([NATIVE_ATOM] if torch.cuda.get_device_capability() >= (8, 0) else [])
    layers_by_atom = {}
    for atom in atoms:
        base = moe.PackedMoE(*[moe.prepack_expert_stack("nvfp4", *s, atom=atom) for s in srcs])  # inverse verified
        layers_by_atom[atom] = [base] + [moe.PackedMoE(*[_clone_stack(s) for s in (base.gate, base.up, base.down)])
                                         for _ in range(COPIES - 1)]
    layers = layers_by_atom["m8n8k4"]
    base = layers[0]
    src_copies = [srcs] + [[tuple(t.clone() for t in s) for s in srcs] for _ in range(COPIES - 1)]
    per_expert_bytes = base.gate.nbytes_per_expert + base.up.nbytes_per_expert + base.down.nbytes_per_expert
    for t in ts:
        pool = []
        for _ in range(POOL):
            scores = torch.rand((t, experts), device="cuda", generator=gen)
            ids = torch.topk(scores, top_k, dim=1).indices.to(torch.int32)
            w = torch.softmax(torch.randn((t, top_k), device="cuda", generator=gen), dim=1)
            x = torch.randn((t, hidden), device="cuda", generator=gen).half()
            pool.append((x, ids, w))
        used = statistics.mean(len(set(ids.reshape(-1).tolist())) for _, ids, _ in pool)
        wbytes = used * per_expert_bytes
        if check:  # the arms compute the same layer (loose: they round differently)
            x, ids, w = pool[0]
            ref = moe.qpn_moe(x, ids, w, layers[0]).float()
            for alt in (per_expert_loop(x, ids, w, layers[0]), dequant_gemm(x, ids, w, src_copies[0])):
                rel = float((alt.float() - ref).norm() / ref.norm())
                if rel > 5e-3:
                    raise RuntimeError(f"{name} T={t}: arms disagree (rel {rel:.2e}); benchmark aborted")
        fns = {}
        graphs = {}
        for atom in atoms:
            lay = layers_by_atom[atom]
            if check and atom != "m8n8k4":
                x, ids, w = pool[0]
                ref = moe.qpn_moe(x, ids, w, layers[0]).float()
                rel = float((moe.qpn_moe(x, ids, w, lay[0]).float() - ref).norm() / ref.norm())
                if rel > 5e-3:
                    raise RuntimeError(f"{name} T={t}: {atom} and m8n8k4 disagree (rel {rel:.2e}); aborted")
            graphs[atom] = []
            for i in range(POOL):
                x, ids, w = pool[i]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    moe.qpn_moe(x, ids, w, lay[i % COPIES])
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    moe.qpn_moe(x, ids, w, lay[i % COPIES])
                graphs[atom].append(g)
            fns[("grouped", atom)] = lambda i, lay=lay: moe.qpn_moe(*pool[i % POOL], lay[i % COPIES])
            fns[("grouped_graph", atom)] = lambda i, atom=atom: graphs[atom][i % POOL].replay()
            fns[("per_expert_loop", atom)] = lambda i, lay=lay: per_expert_loop(*pool[i % POOL], lay[i % COPIES])
        fns[("dequant_gemm", "-")] = lambda i: dequant_gemm(*pool[i % POOL], src_copies[i % COPIES])
        for (arm, atom), fn in fns.items():
            slow = arm in ("per_expert_loop", "dequant_gemm")
            ms = _time_ms(fn, target_ms=60 if slow else 30, repeats=3 if slow else 5)
            gbps = wbytes / (ms * 1e-3) / 1e9
            rows.append(dict(shape=name, fmt="nvfp4", e=experts, h=hidden, i=inter, top_k=top_k, tokens=t,
                             experts_used=used, arm=arm, atom=atom, time_us=ms * 1e3, weight_bytes=int(wbytes),
                             gbps=gbps, pct_read=100 * gbps / read_ceiling, pct_copy=100 * gbps / copy_ceiling))
            print(f"{name:20s} T={t:3d} experts={used:6.1f} {arm:16s} {atom:9s} {ms * 1e3:10.1f} us "
                  f"{gbps:8.1f} GB/s {100 * gbps / read_ceiling:6.2f}% read", flush=True)
        del graphs
    del layers, layers_by_atom, src_copies
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
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"# gpu: {torch.cuda.get_device_name(0)} (sm_{cap[0]}{cap[1]}, {props.multi_processor_count} SMs)",
        f"# driver: {drv}",
        f"# torch: {torch.__version__} (CUDA {torch.version.cuda})",
        f"# commit: {commit}",
        f"# command: {_command('qpn.benchmarks.moe_bench')}",
        f"# date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
    ]
    if cap >= (8, 0):
        lines.append(f"# NOTE: {EMULATION_NOTE}")
        lines.append(f"# NOTE: rows with atom {NATIVE_ATOM} run the same grouped design on this GPU's native "
                     "tensor-core atom (mma.m16n8k16): those show what the design does where the atom is real; "
                     "they are not V100 figures either")
    for name, (e, h, i, k, src) in SHAPES.items():
        lines.append(f"# shape {name}: E={e} experts, hidden={h}, intermediate={i}, top_k={k} ({src})")
    lines.append("# one row = one MoE layer's routed experts for `tokens` tokens; random top-k routing; "
                 "weights = random NVFP4 codes and scales")
    lines.append("# gbps = packed bytes of the experts the call selects / time; pct_read / pct_copy = share of "
                 "the ceilings measured in this run")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="CSV path (results/moe_bench_<gpu>_<date>.csv)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_T)), help="comma list of T (tokens per call)")
    ap.add_argument("--commit", default="", help="commit hash to record when the tree has no .git")
    ap.add_argument("--no-check", action="store_true", help="skip the check that the arms agree")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    ts = [int(v) for v in args.tokens.split(",")]
    cap = "".join(map(str, torch.cuda.get_device_capability(0)))
    ops.build(f"sm{cap}")
    moe.build(f"sm{cap}")
    if torch.cuda.get_device_capability(0) >= (8, 0):
        moe.build(f"sm{cap}", atom=NATIVE_ATOM)
    read, copy = ceilings()
    print(f"read ceiling {read:.1f} GB/s, copy ceiling {copy:.1f} GB/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cols = ["shape", "fmt", "e", "h", "i", "top_k", "tokens", "experts_used", "arm", "atom", "time_us",
            "weight_bytes", "gbps", "pct_read", "pct_copy"]
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    with open(args.out, "w") as f:  # rows written as each shape finishes: a cut-short run keeps them
        for line in _provenance(args):
            f.write(line + "\n")
        f.write(f"# read_ceiling_gbps: {read:.1f}\n# copy_ceiling_gbps: {copy:.1f}\n")
        f.write(",".join(cols) + "\n")
        for name in names:
            start = len(rows)
            bench_shape(name, ts, read, copy, rows, gen, check=not args.no_check)
            for r in rows[start:]:
                f.write(",".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + "\n")
            f.flush()
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
