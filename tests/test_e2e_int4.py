"""INT4 end to end through the registered QPN config on the real vLLM 0.32 CPU engine: the tiny
model in AutoAWQ form (qpn.scripts.checkpoints.make_int4_checkpoint) loaded by the engine's own
model loader in one process (tests/_int4_engine_probe.py), with formats.INT4's served flag stood in
(the family is flipped to served by another change). What must hold: the "qpn" config claims it,
every INT4 module the checkpoint declares is served by QPN4 on a QPN route (census), and the
teacher-forced log-probabilities agree with a float32 reference built here from the checkpoint
tensors (decoded by tests/test_int4_linear_method.decode_checkpoint, written from the format's
description, run in transformers' Qwen3_5ForCausalLM) within twice the bfloat16 floor, while the
same reference decoded with the standard nibble order instead of AutoAWQ's lands far outside it.
With QPN_INT4=0 the engine's own AWQ config and kernels serve the same checkpoint and no QPN config
reaches the census."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._agreement import check_agreement
from tests.test_e2e_loader import PROMPT_TEXT

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON", sys.executable)
GROUP = 64


def _engine_run(ckpt: Path, tmp: Path, label: str, **env) -> dict:
    census = tmp / f"census-{label}"
    proc = subprocess.run([ENGINE_PYTHON, str(REPO / "tests" / "_int4_engine_probe.py"), str(ckpt), PROMPT_TEXT],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, QPN_TEST_INT4_READY="1", QPN_CENSUS_DIR=str(census),
                                   VLLM_CACHE_ROOT=str(tmp / "vllm-cache"), VLLM_CPU_KVCACHE_SPACE="1", **env))
    line = [x for x in proc.stdout.splitlines() if x.startswith("QPN_INT4_ENGINE ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return {**json.loads(line[0][len("QPN_INT4_ENGINE "):]), "census": census}


def _awq_reference_model(ckpt, perturb="none"):
    """transformers' float model holding the AWQ checkpoint's weights decoded in float32;
    ``perturb="standard-nibbles"`` decodes AutoAWQ's words in the plain nibble order instead."""
    from safetensors.torch import load_file

    from qpn.scripts.checkpoints.checkpoint_reference import float_model
    from tests import test_int4_linear_method as t4

    tensors = load_file(str(Path(ckpt) / "model.safetensors"))
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".qweight")}
    order = t4.AWQ_NIBBLES
    t4.AWQ_NIBBLES = tuple(range(8)) if perturb == "standard-nibbles" else order
    try:
        state = {f"{m}.weight": t4.decode_checkpoint("awq", {k: tensors[f"{m}.{k}"] for k in ("qweight", "qzeros", "scales")},
                                                     GROUP) for m in modules}
    finally:
        t4.AWQ_NIBBLES = order
    state.update({n: t.float() for n, t in tensors.items()
                  if n.rsplit(".", 1)[0] not in modules and not n.startswith("mtp.")})
    hub = "model.language_model."
    return float_model(ckpt, {("model." + k[len(hub):] if k.startswith(hub) else k): v for k, v in state.items()})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from qpn.scripts.checkpoints.make_int4_checkpoint import make_int4_checkpoint

    tmp = tmp_path_factory.mktemp("e2e-int4")
    ckpt = tmp / "awq"
    make_int4_checkpoint(ckpt, "awq", group_size=GROUP)
    qpn = _engine_run(ckpt, tmp, "qpn")
    engine = _engine_run(ckpt, tmp, "engine", QPN_INT4="0")
    return {"ckpt": ckpt, "qpn": qpn, "engine": engine}


def test_qpn_claims_the_awq_checkpoint_and_serves_every_int4_module(runs):
    from qpn.fork_patches import conventions
    from qpn.fork_patches.census import aggregate
    from qpn.kernels import formats
    from qpn.kernels.routes import QPN_ROUTES, UNSERVED_ROUTES

    assert runs["qpn"]["quant_config"] == "qpn"
    agg = aggregate(str(runs["qpn"]["census"]))
    (rank,) = agg["ranks"]
    assert rank["quant_config"] == "qpn"
    _, declared = conventions.int4_declared_modules(runs["ckpt"])
    trunk = [m for m in declared if not m.startswith("mtp.")]  # the drafter is not loaded without speculation
    # fused shards (q/k/v, gate/up, in_proj_qkv/z) are one engine module each
    fused = sum(1 for m in trunk if m.endswith((".k_proj", ".v_proj", ".up_proj", ".in_proj_z")))
    assert agg["modules_by_region"] == {"int4": len(trunk) - fused}
    assert agg["fallback_calls"] == 0 and agg["fallbacks"] == []
    modules = [m for r in [json.loads(f.read_text()) for f in runs["qpn"]["census"].glob("census_rank*.json")]
               for m in r["modules"].values()]
    assert modules and all(m["eligible"] and m["prepack_verified"] and m["routes"] for m in modules)
    # every call on one of the INT4 family's QPN routes; those join the served list (QPN_ROUTES, and so
    # the census's on-QPN count and the qpn_routes gate) when formats.INT4 is served
    int4_routes = {name for name, r in UNSERVED_ROUTES.items() if r.format == "int4"} | (
        QPN_ROUTES if formats.INT4.served else set())
    # the prompt (M = 117: reconstruct) and one decode step (M = 1)
    assert {"qpn4_reconstruct", "qpn4"} <= set(agg["route_counts"]) <= int4_routes, agg["route_counts"]
    assert agg["modules_on_qpn"] == (agg["modules_total"] if formats.INT4.served else 0)


def test_qpn_int4_agrees_with_a_float32_reference_of_the_checkpoint(runs):
    from qpn.scripts.checkpoints.checkpoint_reference import reference_variants

    run = runs["qpn"]
    refs = reference_variants(runs["ckpt"], run["ids"], ["float32", "bfloat16", "standard-nibbles"],
                              load_model=_awq_reference_model, perturbations=("none", "standard-nibbles"))
    check_agreement(run["logprobs"], run["top1"], refs, "QPN4 (AWQ, in-process engine)", gross=("standard-nibbles",))
    assert torch.tensor(run["logprobs"]).isfinite().all()


def test_qpn_int4_0_leaves_the_checkpoint_to_the_engines_own_config(runs):
    from vllm.model_executor.layers.quantization import get_quantization_config

    engine = runs["engine"]
    assert engine["quant_config"] != "qpn"
    assert get_quantization_config(engine["quant_config"]).__name__ == "AutoAWQConfig"
    census = engine["census"]
    assert not census.exists() or not list(census.glob("census_rank*.json")), "no QPN config may reach a rank"
    assert engine["ids"] == runs["qpn"]["ids"]
