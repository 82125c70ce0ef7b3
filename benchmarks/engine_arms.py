"""The installed engine's own NVFP4 linear kernels as benchmark arms beside QPN (issue 11 item 9).

1Cat-vLLM ships two NVFP4 weight-only paths for SM70 (read in the 1.2.2 and 1.3.0 sources):

- TurboMind (``vllm/model_executor/layers/quantization/sm70_turbomind.py``):
  ``prepare_nvfp4_linear(layer)`` repacks ``layer.weight`` (uint8 [N, K/2]), ``weight_scale``
  (e4m3 [N, K/16]) and ``weight_global_scale`` (float32, the value multiplier: ModelOpt's
  ``weight_scale_2``) through ``torch.ops._C.nvfp4_sm70_prepare``; ``apply_prepared_linear(layer,
  x, bias)`` runs ``torch.ops._C.nvfp4_gemm_sm70_out``.
- Marlin (``vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py``):
  ``prepare_fp4_layer_for_marlin(layer)`` (same three tensors plus ``output_size_per_partition``,
  ``input_size_per_partition``, ``params_dtype``) and ``apply_fp4_marlin_linear(input, weight,
  weight_scale, weight_global_scale, workspace, size_n, size_k)``; on SM70 only when the build
  has ``torch.ops._C.sm70_marlin_available()`` (``is_fp4_marlin_supported``). Seed 000's
  "Marlin backport" figures were measured on this path.

Nothing here is copied from the engine: the arms call its functions. ``detect()`` says, per arm,
whether the installed engine provides it and why not; it needs no GPU (module and op presence
only), so CI checks it against the imported 1Cat archive. ``build()`` needs a CUDA device.
"""
from __future__ import annotations
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec

import importlib
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable


@dataclass(frozen=True)
class EngineArm:
    name: str
    module: str
    functions: tuple[str, ...]
    ops: tuple[str, ...]  # torch.ops._C ops the built engine must register
    what: str


ARMS = (
    EngineArm("turbomind_nvfp4", "vllm.model_executor.layers.quantization.sm70_turbomind",
              ("prepare_nvfp4_linear", "apply_prepared_linear"),
              ("nvfp4_sm70_prepare", "nvfp4_gemm_sm70_out"),
              "1Cat SM70 TurboMind NVFP4 W4A16 GEMM"),
    EngineArm("marlin_nvfp4", "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4",
              ("prepare_fp4_layer_for_marlin", "apply_fp4_marlin_linear", "is_fp4_marlin_supported"),
              ("gptq_marlin_repack", "marlin_gemm", "sm70_marlin_available"),
              "1Cat Marlin NVFP4 W4A16 GEMM (seed 000's Marlin backport on SM70)"),
)


@dataclass
class ArmStatus:
    name: str
    python_entry_points: bool  # the engine's Python functions exist
    kernels_built: bool  # the engine's compiled ops are registered in torch.ops._C
    why: str  # what is missing, or "available"

    @property
    def available(self) -> bool:
        return self.python_entry_points and self.kernels_built


def _registered_ops() -> set[str] | None:
    try:
        import torch

        namespace = torch.ops._C
        return {name for name in dir(namespace) if not name.startswith("_")} | {
            name for name in ("nvfp4_sm70_prepare", "nvfp4_gemm_sm70_out", "gptq_marlin_repack",
                              "marlin_gemm", "sm70_marlin_available") if hasattr(namespace, name)}
    except Exception:  # noqa: BLE001 - no torch, no ops
        return None


def detect(arms=ARMS) -> list[ArmStatus]:
    """Which engine arms the installed engine provides (no GPU needed)."""
    ops = _registered_ops() or set()
    out = []
    for arm in arms:
        try:
            module = importlib.import_module(arm.module)
        except Exception as e:  # noqa: BLE001 - any import failure means: not this engine
            out.append(ArmStatus(arm.name, False, False, f"{arm.module} does not import ({e})"))
            continue
        missing = [f for f in arm.functions if not callable(getattr(module, f, None))]
        if missing:
            out.append(ArmStatus(arm.name, False, False, f"{arm.module} lacks {missing}"))
            continue
        absent = [o for o in arm.ops if o not in ops]
        if absent:
            out.append(ArmStatus(arm.name, True, False,
                                 f"engine Python present, compiled ops {absent} not registered in "
                                 "torch.ops._C (not a CUDA SM70 build of the engine)"))
            continue
        out.append(ArmStatus(arm.name, True, True, "available"))
    return out


def build(name: str, weight_u8, weight_scale, weight_scale_2) -> Callable:
    """An ``x -> y`` callable running the engine's own kernel on this NVFP4 weight (CUDA only).
    ``weight_scale_2`` is ModelOpt's global scale (value = e2m1 x e4m3 x global)."""
    import torch

    arm = next(a for a in ARMS if a.name == name)
    module = importlib.import_module(arm.module)
    n, k = int(weight_u8.shape[0]), int(weight_u8.shape[1]) * 2
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight_u8.device).reshape(())
    layer = SimpleNamespace(
        weight=torch.nn.Parameter(weight_u8.clone(), requires_grad=False),
        weight_scale=torch.nn.Parameter(weight_scale.clone(), requires_grad=False),
        weight_global_scale=torch.nn.Parameter(gs.clone(), requires_grad=False),
        output_size_per_partition=n, input_size_per_partition=k, params_dtype=torch.float16,
        bias=None)
    if name == "turbomind_nvfp4":
        module.prepare_nvfp4_linear(layer)
        return lambda x: module.apply_prepared_linear(layer, x, None)
    if name == "marlin_nvfp4":
        if not module.is_fp4_marlin_supported():
            raise RuntimeError("the engine's is_fp4_marlin_supported() is False on this device")
        module.prepare_fp4_layer_for_marlin(layer)
        return lambda x: module.apply_fp4_marlin_linear(
            x, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.workspace, n, k)
    raise KeyError(name)


def bench(shapes: dict[str, tuple[str, int, int]], ms: list[int], out_rows: list[dict],
          writer=None) -> list[dict]:
    """Time every available engine arm on the NVFP4 ``shapes`` ({name: (fmt, N, K)}) at each M,
    with kernel_matched_bench's own timers and row format (arm name = the engine arm), and record
    each arm's worst relative error against the dequantized weight (float32)."""
    import torch

    from qpn.benchmarks import kernel_matched_bench as kmb

    status = {s.name: s for s in detect()}
    read, copy = kmb.ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, (fmt, n, k) in shapes.items():
        if fmt != "nvfp4":
            continue
        w, s, gs = kmb._weights("nvfp4", n, k, gen)
        reference = nvfp4_codec.dequantize(w, s, gs).float()
        for arm in ARMS:
            if not status[arm.name].available:
                print(f"{shape}: engine arm {arm.name} skipped: {status[arm.name].why}", flush=True)
                continue
            fn = build(arm.name, w, s, gs)
            for m in ms:
                x = torch.randn((m, k), device="cuda", generator=gen).to(torch.float16)
                err = float(((fn(x).float() - x.float() @ reference.t()).abs().max()
                             / (x.float() @ reference.t()).abs().max().clamp_min(1e-6)))
                te = kmb.time_eager(lambda i: fn(x))
                tg = kmb.time_graph(lambda i: fn(x))
                row = kmb._row(shape, fmt, n, k, m, arm.name, arm.what, n * k // 2 + n * k // 16,
                               te, tg, read, copy)
                row["max_rel_err"] = err
                out_rows.append(row)
                if writer:
                    writer(row)
                print(f"{shape:22s} M={m:3d} {arm.name:16s} graph {row['graph_us']:9.1f} us "
                      f"{row['graph_pct_read']:5.1f}% read, max rel err {err:.2e}", flush=True)
    return out_rows


def main(argv=None) -> int:
    """``python -m qpn.benchmarks.engine_arms --out CSV [--shapes tp1,tp4] [--m 1,8,16]``: time the
    engine's own NVFP4 arms (those it provides) on kernel_matched_bench's NVFP4 shapes; the CSV
    starts with provenance comment lines and the detection of every arm."""
    import argparse
    import csv

    ap = argparse.ArgumentParser(prog="engine_arms")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="tp1,tp4", help="shape names or prefixes (kernel_matched_bench)")
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--detect", action="store_true", help="only print what the engine provides")
    args = ap.parse_args(argv)
    status = detect()
    for s in status:
        print(f"{s.name}: {s.why}", flush=True)
    if args.detect:
        return 0
    from qpn.benchmarks import kernel_matched_bench as kmb
    from qpn.benchmarks import provenance

    wanted = [w for w in args.shapes.split(",") if w]
    shapes = {n: v for n, v in kmb.SHAPES.items()
              if any(n == w or n.startswith(w + "_") for w in wanted) and v[0] == "nvfp4"}
    cols = kmb.COLS + ["max_rel_err"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        for line in provenance.comment_lines(provenance.run_record()):
            f.write(line + "\n")
        for s in status:
            f.write(f"# engine_arm {s.name}: {s.why}\n")
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        if any(s.available for s in status):
            bench(shapes, [int(m) for m in args.m.split(",")], [],
                  writer=lambda r: (w.writerow(r), f.flush()))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
