"""MoE on 1Cat-vLLM: the QPN MoE method is chosen where 1Cat chooses it, on each locked version.

1Cat has no ``RoutedExperts._get_quant_method`` (``RoutedExperts`` is an alias of ``FusedMoE``);
``FusedMoE.__init__`` asks ``quant_config.get_quant_method(layer, prefix)``, which the registered
QPN config answers. In a subprocess on the cpu engine's interpreter with the 1Cat archive's sources
first on the path, a real 1Cat ``FusedMoE`` is built under the QPN config over a ModelOpt mixed
config (tests/_onecat_moe_probe.py): it must get the QPN method, load the checkpoint's tensors
through 1Cat's own ``FusedMoE.weight_loader``, and compute the SwiGLU MoE of those tensors (float64
reference from the checkpoint tensors; swapping two experts' routing must break the match, so the
comparison can fail). 1Cat's real linear layers under that config get the QPN linear methods. In
the same process, a layer under the QPN config over a compressed-tensors config must get the QPN
method too and compute the experts compressed-tensors' own compressor wrote, loaded through 1Cat's
generic loader path."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qpn.fork_patches.engine import engine_source
from tests.test_engine_source import VERSIONS, _archive

from tests._ci import REPO  # noqa: E402


@pytest.mark.engine
@pytest.mark.parametrize("version", VERSIONS)
def test_1cat_fused_moe_gets_the_qpn_method_and_serves_the_checkpoint(version, tmp_path):
    engine_dir = engine_source.extract(_archive(version), tmp_path / "engine", version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(engine_dir), str(REPO)]), QPN_ENGINE="sm70",
               QPN_ENGINE_VERSION=version, VLLM_CACHE_ROOT=str(tmp_path / "cache"),
               QPN_CENSUS_DIR=str(tmp_path / "census"))
    proc = subprocess.run([os.environ.get("QPN_ENGINE_PYTHON", sys.executable),
                           str(REPO / "tests" / "_onecat_moe_probe.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("QPN_MOE_1CAT ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    out = json.loads(line[0][len("QPN_MOE_1CAT "):])
    assert out["method"] == "QPNModelOptMoEMethod" and out["algo"] == "NVFP4" and out["config"] == "qpn"
    assert out["dense_method"] == "UnquantizedFusedMoEMethod"  # experts not listed: 1Cat's own choice
    assert out["linear"] == {"model.layers.0.self_attn.o_proj": "QPNLinearMethod fp8",
                             "model.layers.1.self_attn.o_proj": "QPNLinearMethod nvfp4",
                             "model.layers.2.self_attn.o_proj": "UnquantizedLinearMethod"}
    tolerance = 0.01 * out["ref_max"]
    assert out["max_abs_err"] <= tolerance, out
    assert out["swapped_err"] > 10 * tolerance, out
    # compressed-tensors experts, through 1Cat's own loader
    assert out["ct_inner"] == "CompressedTensorsConfig" and out["ct_method"] == "QPNCompressedTensorsMoEMethod"
    ct_tolerance = 0.01 * out["ct_ref_max"]
    assert out["ct_max_abs_err"] <= ct_tolerance, out
    assert out["ct_swapped_err"] > 10 * ct_tolerance, out
