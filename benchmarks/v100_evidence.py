"""One command for a V100 owner (issue 11 item 9): the GPU numerics tests, the kernel benchmark
with the engine's own NVFP4 arms beside QPN, and the end-to-end cells, into one results bundle
with provenance, ready to attach to an issue.

    bash scripts/v100-evidence.sh [--out DIR] [--base-url URL --model NAME] [--only STEP,...]
    bash scripts/v100-evidence.sh --only depth --checkpoint ./Qwen3.8-27B-NVFP4

Steps (each a subprocess; its output goes to ``logs/<step>.log`` and its exit status to the
manifest; a failing step does not stop the others):

- ``numerics``: the GPU numerics tests (tests/test_gpu_kernels.py, tests/test_gpu_moe.py), with
  CI=true so that nothing skips silently, and their case-by-case reports (``numerics.md``,
  ``moe_numerics.md``; the first also records whether this GPU passes the subnormal-operand probe
  that picks the form of the NVFP4 kernels, ops.nvfp4_form);
- ``kernels``: benchmarks/kernel_matched_bench.py on the TP1 and TP4 shapes (QPN, torch FP16,
  _scaled_mm, dequantize-then-matmul), with its CSV, targets table and chart;
- ``model_check``: the V100 estimate (benchmarks/v100_estimate.py: the performance model calibrated
  on published V100 measurements, benchmarks/v100_calibration.py) checked against the kernels
  step's times: its error per route, and the constants (the fixed cost per call above all) that
  this V100 run fits by itself, so the first owner who runs it corrects the model;
- ``moe``: benchmarks/moe_bench.py, the grouped MoE kernels the estimate does not model, timed;
- ``engine_arms``: the installed engine's own NVFP4 kernels (1Cat TurboMind ``nvfp4_gemm_sm70``,
  Marlin; benchmarks/engine_arms.py) on the same NVFP4 shapes and timers, where the engine
  provides them (the manifest says which, and why not);
- ``cells``: the end-to-end workload cells (benchmarks/domain_cells.py) against a server the
  owner started with scripts/serve-qwen38-native.sh (``--base-url``/``--model``; left out, the
  step is recorded as not run, with the reason);
- ``depth``: depth by context (benchmarks/depth_sweep.py): the checkpoint (``--checkpoint``) served
  in turn at K=0, 3 and 7 by the launcher, each swept over live contexts; the K=auto policy's
  step-cost constants fitted from those sweeps (drafter step, verify row, fixed round cost, each
  against the context) and auto served and swept with them. The bundle gets the constants file
  with the command that serves auto with them (SUMMARY.md repeats it). It boots its own servers
  on the GPUs, so it does not run beside ``--base-url`` (run it on its own: ``--only depth``).

The bundle: ``manifest.json`` (provenance from benchmarks/provenance.py, the GPU, every step's
command, exit status, seconds, log and outputs, the engine-arm detection), ``SUMMARY.md`` (the
same for a human, pasteable into an issue), ``logs/``, the step outputs, and ``<bundle>.tar.gz``
beside the folder. It refuses to run without a CUDA GPU (exit 2, saying so), and labels the
bundle when the GPU is not a V100 (``--allow-other-gpu``), because a figure from another GPU is
not a V100 figure.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("numerics", "kernels", "model_check", "moe", "engine_arms", "cells", "depth")
DEPTH_FILES = ("depth/depth_sweep.csv", "depth/depth_sweep.md", "depth/depth_sweep.png",
               "depth/depth_sweep_depth_constants.json")
MANIFEST_SCHEMA = 1


class NoGpu(RuntimeError):
    """This host cannot produce V100 evidence (no CUDA GPU, or not a V100 without the flag)."""


@dataclass
class Step:
    name: str
    command: list[str]
    outputs: list[str] = field(default_factory=list)  # paths relative to the bundle
    skip_reason: str | None = None  # set: recorded as not run, with this reason
    env: dict = field(default_factory=dict)  # added to the step's environment


@dataclass
class StepResult:
    name: str
    command: str
    status: str  # "ok" | "failed" | "not run"
    returncode: int | None
    seconds: float
    log: str | None
    outputs: list[str]
    reason: str | None = None


def gpu_check(allow_other_gpu: bool = False) -> dict:
    """The CUDA device this run measures; NoGpu when there is none, or when it is not a V100
    (capability 7.0) and ``allow_other_gpu`` is not set."""
    try:
        import torch
    except ImportError as e:
        raise NoGpu(f"torch is not importable here ({e}); run this with the sm70 engine's python "
                    "(ENV_PREFIX=<engine venv> bash scripts/v100-evidence.sh)") from e
    if not torch.cuda.is_available():
        raise NoGpu("no CUDA GPU visible to torch (torch.cuda.is_available() is False; torch "
                    f"{torch.__version__}, CUDA build {torch.version.cuda}): this command measures "
                    "a V100, run it on the V100 box with the sm70 engine's python")
    props = torch.cuda.get_device_properties(0)
    cap = f"{props.major}.{props.minor}"
    info = {"gpu": props.name, "capability": cap, "count": torch.cuda.device_count(),
            "memory_mib": props.total_memory // 2**20, "is_v100": cap == "7.0"}
    if not info["is_v100"] and not allow_other_gpu:
        raise NoGpu(f"GPU 0 is {props.name} (capability {cap}), not a V100 (7.0): its figures "
                    "would not be V100 evidence. Pass --allow-other-gpu to run anyway; the bundle "
                    "is then labelled with the GPU it ran on")
    return info


def plan(args, bundle: str) -> list[Step]:
    py = sys.executable
    steps = [
        Step("numerics", [py, "-m", "pytest", "-q", "-rs", "tests/test_gpu_kernels.py",
                          "tests/test_gpu_moe.py", f"--junitxml={bundle}/numerics.xml"],
             ["numerics.xml", "numerics.md", "moe_numerics.md"],
             env={"QPN_NUMERICS_REPORT": f"{bundle}/numerics.md",
                  "QPN_MOE_NUMERICS_REPORT": f"{bundle}/moe_numerics.md"}),
        Step("kernels", [py, "-m", "qpn.benchmarks.kernel_matched_bench",
                         "--out", f"{bundle}/kernel_matched.csv", "--targets", f"{bundle}/targets.md",
                         "--plot", f"{bundle}/kernel_matched.png", "--shapes", args.shapes],
             ["kernel_matched.csv", "targets.md", "kernel_matched.png"]),
        Step("model_check", [py, "-m", "qpn.benchmarks.perf_model", "--check-m8n8k4", f"{bundle}/kernel_matched.csv",
                             "--out-dir", bundle, "--stamp", "bundle"],
             ["perf_model_v100_check_bundle.md", "perf_model_v100_check_bundle.csv"]),
        Step("moe", [py, "-m", "qpn.benchmarks.moe_bench", "--out", f"{bundle}/moe_bench.csv"], ["moe_bench.csv"]),
        Step("engine_arms", [py, "-m", "qpn.benchmarks.engine_arms", "--out",
                             f"{bundle}/engine_arms.csv", "--shapes", args.shapes],
             ["engine_arms.csv"]),
    ]
    if args.base_url and args.model:
        steps.append(Step("cells", [py, "-m", "qpn.benchmarks.domain_cells", "--base-url",
                                    args.base_url, "--model", args.model, "--results-dir",
                                    f"{bundle}/cells"], ["cells"]))
    else:
        steps.append(Step("cells", [], [], "no --base-url/--model: start the server with "
                          "scripts/serve-qwen38-native.sh and pass its URL and model name"))
    depth_cmd = [py, "-m", "qpn.benchmarks.depth_sweep", "--checkpoint", args.checkpoint, "--arms",
                 "0,3,7,auto", "--depths", args.depth_contexts, "--results-dir", f"{bundle}/depth",
                 "--name", "depth_sweep"]
    if not args.checkpoint:
        steps.append(Step("depth", [], [], "no --checkpoint: give the checkpoint folder; the step "
                          "serves it itself, one depth at a time"))
    elif args.base_url:
        steps.append(Step("depth", depth_cmd, list(DEPTH_FILES),
                          "the depth step serves the checkpoint itself on the GPUs the --base-url "
                          "server holds: stop that server and run --only depth --checkpoint CKPT"))
    else:
        steps.append(Step("depth", depth_cmd, list(DEPTH_FILES)))
    only = set(args.only.split(",")) if args.only else set(STEPS)
    unknown = only - set(STEPS)
    if unknown:
        raise SystemExit(f"--only: unknown step(s) {sorted(unknown)}; steps are {', '.join(STEPS)}")
    for s in steps:
        if s.name not in only and s.skip_reason is None:
            s.skip_reason = "left out by --only"
    return steps


def run_steps(steps: list[Step], bundle: str, env: dict | None = None) -> list[StepResult]:
    os.makedirs(os.path.join(bundle, "logs"), exist_ok=True)
    results = []
    for s in steps:
        if s.skip_reason:
            results.append(StepResult(s.name, shlex.join(s.command), "not run", None, 0.0, None, [],
                                      s.skip_reason))
            continue
        log = os.path.join("logs", f"{s.name}.log")
        t0 = time.monotonic()
        print(f"[v100-evidence] {s.name}: {shlex.join(s.command)}", flush=True)
        with open(os.path.join(bundle, log), "w") as f:
            rc = subprocess.call(s.command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                 env={**os.environ, "CI": "true", **(env or {}), **s.env})
        seconds = time.monotonic() - t0
        outputs = [o for o in s.outputs if os.path.exists(os.path.join(bundle, o))]
        missing = [o for o in s.outputs if o not in outputs]
        status = "ok" if rc == 0 and not missing else "failed"
        reason = None if status == "ok" else (
            f"exit {rc}" + (f"; expected output(s) missing: {missing}" if missing else ""))
        results.append(StepResult(s.name, shlex.join(s.command), status, rc, round(seconds, 1), log,
                                  outputs, reason))
        print(f"[v100-evidence] {s.name}: {status} ({seconds:.0f} s)", flush=True)
    return results


def summary_markdown(manifest: dict) -> str:
    gpu = manifest["gpu"]
    lines = [f"# V100 evidence bundle {manifest['bundle']}", ""]
    if not gpu.get("is_v100"):
        lines += [f"**Not a V100**: measured on {gpu.get('gpu')} (capability {gpu.get('capability')}); "
                  "these are not V100 figures.", ""]
    lines += ["| step | status | seconds | outputs | note |", "|---|---|---|---|---|"]
    for r in manifest["steps"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']} | {', '.join(r['outputs']) or '-'} "
                     f"| {r['reason'] or ''} |")
    if manifest.get("depth_serve"):
        lines += ["", "Serve K=auto with the step costs this box measured (depth step):", "",
                  f"    {manifest['depth_serve']}"]
    lines += ["", "Engine NVFP4 arms:", ""]
    for a in manifest["engine_arms"]:
        lines.append(f"- {a['name']}: {a['why']}")
    lines += [""]
    lines += ["Provenance (written by benchmarks/provenance.py, not by hand):", ""]
    lines += [f"- {k}: {'' if v is None else v}" for k, v in manifest["provenance"].items()]
    return "\n".join(lines) + "\n"


def write_bundle(bundle: str, gpu: dict, results: list[StepResult], arms: list[dict],
                 provenance: dict) -> tuple[str, str]:
    """manifest.json + SUMMARY.md in ``bundle``, and ``<bundle>.tar.gz`` beside it."""
    constants = os.path.join(bundle, DEPTH_FILES[-1])
    depth_serve = json.load(open(constants))["serve"] if os.path.exists(constants) else None
    manifest = {"schema": MANIFEST_SCHEMA, "bundle": os.path.basename(bundle.rstrip("/")),
                "gpu": gpu, "provenance": provenance, "engine_arms": arms, "depth_serve": depth_serve,
                "steps": [asdict(r) for r in results],
                "passed": all(r.status == "ok" for r in results if r.status != "not run")}
    with open(os.path.join(bundle, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(os.path.join(bundle, "SUMMARY.md"), "w") as f:
        f.write(summary_markdown(manifest))
    archive = bundle.rstrip("/") + ".tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(bundle, arcname=os.path.basename(bundle.rstrip("/")))
    return os.path.join(bundle, "manifest.json"), archive


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v100-evidence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="bundle folder (default results/v100-evidence-<UTC>)")
    ap.add_argument("--shapes", default="tp1,tp4", help="kernel benchmark shapes (its --shapes)")
    ap.add_argument("--base-url", default="", help="a running server for the end-to-end cells")
    ap.add_argument("--model", default="", help="its served model name")
    ap.add_argument("--checkpoint", default="", help="the checkpoint folder, for the depth step")
    ap.add_argument("--depth-contexts", default="0,8192,32768,65536",
                    help="live contexts (tokens) the depth step sweeps")
    ap.add_argument("--only", default="", help=f"comma list of steps ({', '.join(STEPS)})")
    ap.add_argument("--allow-other-gpu", action="store_true",
                    help="run on a GPU that is not a V100 (the bundle says which GPU it was)")
    args = ap.parse_args(argv)
    try:
        gpu = gpu_check(args.allow_other_gpu)
    except NoGpu as e:
        print(f"[v100-evidence] REFUSED: {e}", file=sys.stderr, flush=True)
        return 2
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    bundle = os.path.abspath(args.out or os.path.join(REPO, "results", f"v100-evidence-{stamp}"))
    if os.path.exists(bundle) and os.listdir(bundle):
        print(f"[v100-evidence] REFUSED: {bundle} is not empty; choose a new --out", file=sys.stderr)
        return 2
    os.makedirs(bundle, exist_ok=True)
    from qpn.benchmarks import engine_arms, provenance

    arms = [asdict(a) | {"available": a.available} for a in engine_arms.detect()]
    results = run_steps(plan(args, bundle), bundle)
    manifest, archive = write_bundle(bundle, gpu, results, arms, provenance.run_record())
    failed = [r.name for r in results if r.status == "failed"]
    print(f"[v100-evidence] bundle {bundle} ({archive}); manifest {manifest}; "
          + (f"FAILED steps: {failed}" if failed else "every step that ran passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
