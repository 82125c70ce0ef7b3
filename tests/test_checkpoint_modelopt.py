"""Cross-check of the generator against NVIDIA ModelOpt 0.47, the tool that produced the real
checkpoint: the same float weights exported by both give the same codes and scales.

ModelOpt runs in its own Python (``$QPN_MODELOPT_PYTHON``: a virtualenv with
``nvidia-modelopt==0.47.*``, ``transformers`` and ``requests``), never in the engine venv: beyond
torch and transformers it brings about 200 MB (scipy, pulp, omegaconf, modelopt itself) and pins
of its own. Without it the test skips and says why, and fails under CI=true (scripts/test.sh builds
that venv, and refuses to go on in CI when it cannot). It needs no GPU: ModelOpt's max calibration
and ``export_hf_checkpoint`` run on CPU (measured here, 2026-11-29).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

pytest.importorskip("safetensors")

MODELOPT_PYTHON = os.environ.get("QPN_MODELOPT_PYTHON")


def _modelopt_version() -> str | None:
    if not MODELOPT_PYTHON:
        return None
    r = subprocess.run([MODELOPT_PYTHON, "-c", "import importlib.metadata as m; print(m.version('nvidia-modelopt'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


@pytest.fixture(scope="module")
def modelopt_version() -> str:
    from tests._ci import unavailable

    version = _modelopt_version()
    if version is None:
        unavailable("nvidia-modelopt 0.47", f"QPN_MODELOPT_PYTHON={MODELOPT_PYTHON!r} has no nvidia-modelopt",
                    "bash scripts/test.sh builds it; or python -m venv V && V/bin/pip install "
                    "'nvidia-modelopt==0.47.*' transformers requests safetensors, then QPN_MODELOPT_PYTHON=V/bin/python")
    return version


def test_modelopt_and_generator_write_identical_quantized_tensors(tmp_path, repo_root, modelopt_version):
    from safetensors.torch import load_file

    from qpn.scripts.checkpoints.make_checkpoint import make_checkpoint

    assert modelopt_version.startswith("0.47"), modelopt_version
    theirs, ours = tmp_path / "modelopt", tmp_path / "ours"
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    subprocess.run([MODELOPT_PYTHON, "-m", "qpn.scripts.checkpoints.modelopt_export", str(theirs), "--seed", "0"],
                   check=True, env=env, capture_output=True, timeout=900)
    make_checkpoint(ours, seed=0)

    q_theirs = json.loads((theirs / "hf_quant_config.json").read_text())["quantization"]
    q_ours = json.loads((ours / "hf_quant_config.json").read_text())["quantization"]
    assert q_theirs["quant_algo"] == q_ours["quant_algo"] == "MIXED_PRECISION"
    assert q_theirs["kv_cache_quant_algo"] == q_ours["kv_cache_quant_algo"] == "FP8"
    assert q_theirs["quantized_layers"] == q_ours["quantized_layers"]

    t_theirs, t_ours = load_file(str(theirs / "model.safetensors")), load_file(str(ours / "model.safetensors"))
    # ModelOpt's transformers model has no MTP head; everything else has the same names.
    assert set(t_theirs) == {k for k in t_ours if not k.startswith("mtp.")}
    compared = 0
    for name, a in t_theirs.items():
        b = t_ours[name]
        if b.dtype == torch.bfloat16:  # unquantized: ModelOpt kept float32, we store bfloat16
            assert torch.equal(a.to(torch.bfloat16), b), name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
        compared += 1
    # codes + scales of 51 modules (FP8: 3 tensors, NVFP4: 4) and the 4 KV scales
    assert compared == 26 * 3 + 25 * 4 + 4
