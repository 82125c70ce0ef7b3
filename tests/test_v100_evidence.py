"""scripts/v100-evidence.sh (issue 11 item 9), the parts a CPU host can prove: it refuses without
a GPU with a clear message, the bundle's layout and manifest (steps run, failed, not run), every
step's command names flags its tool really has, and the engine-arm detection against the
imported 1Cat archives (entry points present, kernels not built here) and the cpu engine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from tests._ci import onecat_archive
from types import SimpleNamespace

import pytest

from qpn.benchmarks import v100_evidence as ev

from tests._ci import REPO  # noqa: E402
ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON", sys.executable)


def test_refuses_without_a_gpu_naming_the_problem(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / "v100-evidence.sh"), "--out", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHON": ENGINE_PYTHON, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "REFUSED: no CUDA GPU visible to torch" in r.stderr and "V100 box" in r.stderr
    assert not (tmp_path / "b").exists()  # nothing half-made


def test_bundle_layout_manifest_and_archive(tmp_path):
    bundle = tmp_path / "v100-evidence-test"
    bundle.mkdir()
    py = sys.executable
    steps = [
        ev.Step("numerics", [py, "-c", "import os; open(os.environ['QPN_NUMERICS_REPORT'], 'w').write('# r'); "
                                       f"open({str(bundle / 'numerics.xml')!r}, 'w').write('<x/>'); print('ok')"],
                ["numerics.xml", "numerics.md"], env={"QPN_NUMERICS_REPORT": str(bundle / "numerics.md")}),
        ev.Step("kernels", [py, "-c", "import sys; print('boom'); sys.exit(3)"], ["kernel_matched.csv"]),
        ev.Step("model_check", [py, "-c", "print('needs kernel_matched.csv')"], ["perf_model_v100_check_bundle.md"]),
        ev.Step("moe", [py, "-c", f"open({str(bundle / 'moe_bench.csv')!r}, 'w').write('# commit: x')"],
                ["moe_bench.csv"]),
        ev.Step("engine_arms", [py, "-c", "print('no output file')"], ["engine_arms.csv"]),
        ev.Step("cells", [], [], "no --base-url/--model"),
        ev.Step("depth", [py, "-c", "import json, os; "
                                    f"[open(os.path.join({str(bundle)!r}, f), 'w').write('x') for f in {ev.DEPTH_FILES[:-1]!r}]; "
                                    f"json.dump({{'serve': 'K=auto DEPTH_CONSTANTS={{}} bash scripts/serve-qwen38-native.sh C'}}, "
                                    f"open(os.path.join({str(bundle)!r}, {ev.DEPTH_FILES[-1]!r}), 'w'))"],
                list(ev.DEPTH_FILES)),
    ]
    (bundle / "depth").mkdir()
    results = ev.run_steps(steps, str(bundle))
    by = {r.name: r for r in results}
    assert by["numerics"].status == "ok" and by["numerics"].outputs == ["numerics.xml", "numerics.md"]
    assert by["kernels"].status == "failed" and by["kernels"].returncode == 3
    assert by["moe"].status == "ok" and by["moe"].outputs == ["moe_bench.csv"]
    assert by["engine_arms"].status == "failed" and "missing: ['engine_arms.csv']" in by["engine_arms"].reason
    assert by["cells"].status == "not run" and by["cells"].reason == "no --base-url/--model"
    assert (bundle / "logs" / "kernels.log").read_text().strip() == "boom"
    gpu = {"gpu": "Tesla T4", "capability": "7.5", "is_v100": False}
    arms = [{"name": "turbomind_nvfp4", "why": "not built", "available": False}]
    manifest_path, archive = ev.write_bundle(str(bundle), gpu, results, arms, {"commit": "abc", "date": "d"})
    manifest = json.loads(Path(manifest_path).read_text())
    assert manifest["schema"] == ev.MANIFEST_SCHEMA and manifest["passed"] is False
    assert [s["name"] for s in manifest["steps"]] == list(ev.STEPS)
    assert manifest["provenance"]["commit"] == "abc" and manifest["engine_arms"] == arms
    summary = (bundle / "SUMMARY.md").read_text()
    assert "**Not a V100**" in summary and "| kernels | failed |" in summary
    assert by["depth"].status == "ok", by["depth"]
    # the owner is handed the command that serves auto with the costs their box measured
    assert manifest["depth_serve"].startswith("K=auto DEPTH_CONSTANTS=")
    assert manifest["depth_serve"] in summary
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {f"{bundle.name}/manifest.json", f"{bundle.name}/SUMMARY.md",
            f"{bundle.name}/logs/kernels.log", f"{bundle.name}/numerics.xml"} <= names


def _help(module: str) -> str:
    r = subprocess.run([ENGINE_PYTHON, "-m", module, "--help"], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_every_step_calls_flags_its_tool_has(tmp_path):
    def ns(**kw):
        return SimpleNamespace(**{"shapes": "tp4", "base_url": "", "model": "", "only": "", "checkpoint": "",
                                  "depth_contexts": "0,8192", **kw})

    args = ns(base_url="http://127.0.0.1:8000/v1", model="m")
    steps = {s.name: s for s in ev.plan(args, str(tmp_path))}
    assert [s for s in steps] == list(ev.STEPS)
    assert not any(s.skip_reason for n, s in steps.items() if n != "depth")
    assert "--checkpoint" in steps["depth"].skip_reason
    # the depth step boots its own servers: not beside the owner's, and it says how to run it
    beside = {s.name: s for s in ev.plan(ns(base_url="http://127.0.0.1:8000/v1", model="m",
                                            checkpoint="/c"), str(tmp_path))}
    assert "--only depth" in beside["depth"].skip_reason
    depth = {s.name: s for s in ev.plan(ns(checkpoint="/c"), str(tmp_path))}["depth"]
    assert depth.skip_reason is None and depth.command[depth.command.index("--checkpoint") + 1] == "/c"
    assert "0,3,7,auto" in depth.command and "0,8192" in depth.command
    steps["depth"] = depth
    for path in steps["numerics"].command:
        if path.startswith("tests/"):
            assert (REPO / path).is_file(), path
    # the numerics step writes both case reports into the bundle and expects them there
    reports = {v: k for k, v in steps["numerics"].env.items()}
    assert set(reports.values()) == {"QPN_NUMERICS_REPORT", "QPN_MOE_NUMERICS_REPORT"}
    assert {os.path.relpath(p, tmp_path) for p in reports} <= set(steps["numerics"].outputs)
    for var in reports.values():
        assert var in (REPO / "tests" / ("test_gpu_moe.py" if "MOE" in var else "test_gpu_kernels.py")).read_text()
    for name, module in (("kernels", "qpn.benchmarks.kernel_matched_bench"),
                         ("model_check", "qpn.benchmarks.perf_model"),
                         ("moe", "qpn.benchmarks.moe_bench"),
                         ("engine_arms", "qpn.benchmarks.engine_arms"),
                         ("cells", "qpn.benchmarks.domain_cells"),
                         ("depth", "qpn.benchmarks.depth_sweep")):
        cmd = steps[name].command
        assert cmd[1:3] == ["-m", module]
        text = _help(module)
        for flag in (a for a in cmd if a.startswith("--")):
            assert flag in text, f"{module} has no {flag}"
    no_server = {s.name: s for s in ev.plan(ns(), str(tmp_path))}
    assert "serve-qwen38-native.sh" in no_server["cells"].skip_reason
    only = {s.name: s for s in ev.plan(ns(only="kernels"), str(tmp_path))}
    assert only["numerics"].skip_reason == "left out by --only" and only["kernels"].skip_reason is None
    with pytest.raises(SystemExit, match="unknown step"):
        ev.plan(ns(only="kernel"), str(tmp_path))


def _detect(pythonpath: list[str]) -> dict:
    code = ("import json; from qpn.benchmarks import engine_arms as a; "
            "print(json.dumps([{'name': s.name, 'py': s.python_entry_points, 'built': s.kernels_built,"
            " 'why': s.why} for s in a.detect()]))")
    r = subprocess.run([ENGINE_PYTHON, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath + [str(REPO)])})
    assert r.returncode == 0, r.stderr[-3000:]
    return {d["name"]: d for d in json.loads(r.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_engine_arm_detection_against_the_1cat_archive(version, tmp_path):
    from qpn.fork_patches.engine.engine_source import extract

    extract(onecat_archive(version), tmp_path, version)
    found = _detect([str(tmp_path)])
    for name in ("turbomind_nvfp4", "marlin_nvfp4"):
        assert found[name]["py"] is True, found[name]  # the engine's Python entry points exist
        assert found[name]["built"] is False and "not registered in torch.ops._C" in found[name]["why"]


def test_engine_arm_detection_on_the_cpu_engine():
    found = _detect([])
    assert found["turbomind_nvfp4"]["py"] is False and "does not import" in found["turbomind_nvfp4"]["why"]
    assert found["marlin_nvfp4"]["built"] is False
