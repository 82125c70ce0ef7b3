"""The plugin's failure policy, on the cpu engine with one anchor removed in a scratch copy.

vLLM loads general plugins in ``EngineArgs.__post_init__`` outside any error handling, so what
``register()`` raises ends the process before a model is read. A required hook whose anchor is
missing must end it with one message naming hook, anchor, engine version and the fix; a hook
only MoE checkpoints need is skipped with a warning, recorded, and the boot gate fails when the
served checkpoint has routed experts. The scratch engine is a tree of symlinks into the cpu
engine's ``vllm`` package with real copies only of the edited files: the engine is never touched.

No hook of the registry is MoE-only since the QPN MoE methods come from the registered QPN config
(qpn_config.py; the engines' call sites are proven by engine_source.verify_registration), so the
MoE policy is proven with a probe entry added to the registry in the booted process: a hook
written like the old MoE hooks, whose anchor the scratch engine lacks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qpn.fork_patches.engine.hooks import by_name

from tests._ci import REPO  # noqa: E402
ENGINE_PY = os.environ.get("QPN_ENGINE_PYTHON", sys.executable)
CONVERTOR = "transformers_utils/model_arch_config_convertor.py"
ROUTED = "model_executor/layers/fused_moe/routed_experts.py"
QUANTIZATION = "model_executor/layers/quantization/__init__.py"


def _engine_vllm() -> Path:
    out = subprocess.run([ENGINE_PY, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    vllm = Path(out) / "vllm"
    if not vllm.is_dir():
        pytest.skip("no cpu engine for QPN_ENGINE_PYTHON")
    return vllm


def _scratch_engine(root: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """``root/vllm``: symlinks to the engine's files except the edited ones (real copies)."""
    src = _engine_vllm()
    real_dirs = {Path("")}
    for rel in edits:
        for parent in Path(rel).parents:
            real_dirs.add(parent)
    for d in sorted(real_dirs, key=lambda p: len(p.parts)):
        (root / "vllm" / d).mkdir(parents=True, exist_ok=True)
        for entry in (src / d).iterdir():
            rel = d / entry.name
            if rel in real_dirs or str(rel) in edits:
                continue
            (root / "vllm" / rel).symlink_to(entry)
    for rel, (old, new) in edits.items():
        text = (src / rel).read_text()
        pristine = src / (rel + ".pre_bootstrap")
        if pristine.exists():
            text = pristine.read_text()
        assert text.count(old) >= 1, f"{old!r} not in {rel}"
        (root / "vllm" / rel).write_text(text.replace(old, new))
    return root


_BOOT = r'''
import json, os, sys
from qpn.fork_patches.engine import hooks
if os.environ.get("QPN_TEST_MOE_PROBE_HOOK"):
    hooks.REGISTRY.append(hooks.Hook(
        name="moe-probe", kind="runtime", needed_for="moe",
        anchor="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts._get_quant_method",
        what="probe", why="probe", how="probe", remove_when="probe", apply="qpn.fork_patches.engine.plugin:register"))
from vllm.engine.arg_utils import EngineArgs
try:
    EngineArgs(model="/nonexistent-checkpoint")  # __post_init__ loads the general plugins
except BaseException as e:
    print("QPN_RAISED " + type(e).__name__, flush=True)
    raise
from qpn.fork_patches.engine import plugin
from qpn.fork_patches.route_census.census import CENSUS
print("QPN_RESULT " + json.dumps({"skipped": plugin.skipped_hooks(),
                                  "census": CENSUS.hooks_skipped, "engine": plugin.engine_key()}))
'''


def _boot(engine_root: Path, tmp_path: Path, **extra_env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(engine_root), str(REPO)]),
               VLLM_CACHE_ROOT=str(tmp_path / "cache"), QPN_CENSUS_DIR=str(tmp_path / "census"), **extra_env)
    env.pop("QPN_ENGINE", None)
    env.pop("QPN_ENGINE_VERSION", None)
    return subprocess.run([ENGINE_PY, "-c", _BOOT], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.engine
def test_required_anchor_missing_stops_the_engine_with_one_message(tmp_path):
    root = _scratch_engine(tmp_path / "engine", {CONVERTOR: (
        "def _normalize_quantization_config(self", "def _normalise_quantization_config(self")})
    proc = _boot(root, tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    assert "QPN_RAISED EngineMismatch" in proc.stdout
    hook = by_name("modelopt-mixed-precision-file-form")
    last = proc.stderr.strip().splitlines()
    message = proc.stderr[proc.stderr.rindex("EngineMismatch: "):]
    assert message.count("volta-qpn cannot run on vLLM") == 1, message
    assert f"hook {hook.name}: anchor {hook.anchor} not found" in message
    assert "engine cpu@0.32.0" in message and "vLLM 0.32.0" in message
    assert "Fix: install a locked cpu engine (0.32.0" in message and "qpn.fork_patches.engine.engine_source" in message
    # only the missing hook is named: the others of this engine were found
    assert "1 required hook(s)" in message and "kv-cache-fp16-on-sm70" not in message
    assert last[-1].startswith("Fix:")


@pytest.mark.engine
def test_moe_hook_anchor_missing_is_skipped_recorded_and_gated(tmp_path):
    root = _scratch_engine(tmp_path / "engine", {ROUTED: ("_get_quant_method", "_choose_quant_method")})
    proc = _boot(root, tmp_path, QPN_TEST_MOE_PROBE_HOOK="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("QPN_RESULT "))
    result = json.loads(line[len("QPN_RESULT "):])
    hook = SimpleNamespace(name="moe-probe",
                           anchor="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts._get_quant_method")
    assert [s["hook"] for s in result["skipped"]] == [hook.name]
    skipped = result["skipped"][0]
    assert skipped["needed_for"] == "moe" and skipped["engine"] == "cpu@0.32.0"
    assert skipped["anchor"] == hook.anchor and "has no attribute _get_quant_method" in skipped["reason"]
    assert result["census"][hook.name]["needed_for"] == "moe"
    assert f"hook {hook.name} skipped" in proc.stderr  # the warning

    from qpn.scripts.launcher.boot_gates import FAIL, PASS, gate_skipped_hooks

    census = {"hooks_skipped": [dict(skipped, rank=0)]}
    moe_layers = {"model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"},
                  "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}}
    dense_layers = {"model.layers.0.mlp.gate_proj": {"quant_algo": "NVFP4"}}
    failed = gate_skipped_hooks(census, moe_layers)
    assert failed.status == FAIL and hook.name in failed.observed
    dense = gate_skipped_hooks(census, dense_layers)
    assert dense.status == PASS and hook.name in dense.observed  # reported, not needed
    assert gate_skipped_hooks({"hooks_skipped": []}, moe_layers).status == PASS


@pytest.mark.engine
def test_an_engine_without_the_quantization_registry_stops_with_one_message(tmp_path):
    """The QPN methods reach the engine only through the registered QPN config: an engine whose
    quantization package has no register_quantization_config cannot serve QPN, and says so."""
    root = _scratch_engine(tmp_path / "engine", {QUANTIZATION: (
        "def register_quantization_config(", "def register_quant_config(")})
    proc = _boot(root, tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    assert "QPN_RAISED EngineMismatch" in proc.stdout
    message = proc.stderr[proc.stderr.rindex("EngineMismatch: "):]
    assert "volta-qpn cannot register its quantization method on vLLM 0.32.0 (engine cpu@0.32.0)" in message
    assert "register_quantization_config" in message and "required hook" not in message
    assert message.strip().splitlines()[-1].startswith("Fix: install a locked cpu engine")
