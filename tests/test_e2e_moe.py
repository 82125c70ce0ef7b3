"""End to end on the real cpu engine: a small ModelOpt MIXED_PRECISION checkpoint of the Qwen3.5
MoE family (qpn.scripts.checkpoints.make_moe_checkpoint: hybrid GDN/attention trunk, 8 experts per layer
with top-2 routing in NVFP4 -- and, as a second checkpoint, in FP8 (the QPN8 side) -- an NVFP4
shared expert, FP8 attention, NVFP4 lm_head) served by
vLLM 0.32 on CPU through the overlay, against the same checkpoint dequantized in float32 and
run in transformers (qpn.scripts.checkpoints.checkpoint_reference's decoders, transformers'
Qwen3_5MoeForCausalLM), compared by teacher-forced log-probabilities over 95 positions.

Tolerance, measured in the same run as the dense test does it. The engine computes in BF16
(vLLM's CPU gated-delta-net kernel accepts nothing else), the reference in float32. The floor is
the same reference run in BF16 against float32 over the same positions (here the MoE's top-k
boundary moves under BF16 rounding; measured 2026-11-30: 0.055 nat mean, 0.49 worst with a BF16
KV cache, 0.072 / 0.52 with the FP8 one). The served path must stay within twice that floor,
mean and worst; the factor 2 covers the engine rounding at other points than transformers does
(FP16 activations into every QPN GEMM). Where the engine keeps an FP8 KV cache (x86 with
AVX-512/AMX: the census says which KV path ran), the reference and its floor store K and V
through e4m3 the way the engine does (checkpoint_reference.fp8_kv_emulation).

Negative controls: ONE expert of ONE layer served wrongly (its neighbour's weights; its gate and
up exchanged; its codes with its neighbour's scales; NVFP4: its nibbles exchanged), computed by
the same reference, must fail the bound by more than the served run's own distance from the
reference, so that a server with that bug could not pass. The corrupted expert is the one the
router of the first MoE layer picks most often over these positions (its error then reaches every
later layer); the same bug in the last layer touches only the positions routed to it and can hide
inside the BF16 floor (measured: 0.07 nat mean, 0.9 worst for its neighbour's weights), which
is why the kernel-level MoE tests (tests/test_moe_reference.py, the GPU numerics) check every
expert exactly.

The census of the run must list every expert stack (2 per MoE layer) on the QPN MoE route,
every other quantized module on a QPN route, lm_head from the checkpoint's codes, no fallback.
"""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

from qpn.scripts.checkpoints import make_moe_checkpoint  # noqa: E402
from tests import _moe_e2e as e2e  # noqa: E402


@pytest.fixture(scope="module", params=["nvfp4", "fp8"], ids=["nvfp4_experts", "fp8_experts"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    summary = make_moe_checkpoint.make_moe_checkpoint(out, seed=0, expert_format=request.param)
    return out, summary


@pytest.fixture(scope="module")
def token_ids(checkpoint):
    return e2e.token_ids(checkpoint[0])


@pytest.fixture(scope="module")
def served(checkpoint, token_ids, tmp_path_factory):
    return e2e.serve(checkpoint[0], token_ids, "tiny-moe", tmp_path_factory.mktemp("census"))


@pytest.fixture(scope="module")
def reference(checkpoint, token_ids, served):
    return e2e.reference(checkpoint[0], token_ids, served)


def test_checkpoint_is_the_qwen35_moe_family(checkpoint):
    ckpt, summary = checkpoint
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["model_type"] == "qwen3_5_moe_text"
    assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2 and cfg["shared_expert_intermediate_size"] > 0
    assert "linear_attention" in cfg["layer_types"] and "full_attention" in cfg["layer_types"]
    layers = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    fmt = summary["expert_format"]
    assert layers["model.language_model.layers.0.mlp.experts.7.down_proj"]["quant_algo"] == fmt.upper()
    assert layers["model.language_model.layers.0.mlp.shared_expert.gate_proj"]["quant_algo"] == "NVFP4"
    assert "model.language_model.layers.0.mlp.gate" not in layers  # the router stays BF16
    assert summary["quantized_modules"][f"routed_expert_{fmt}"] == 8 * 3 * cfg["num_hidden_layers"]


def test_served_logprobs_match_the_float32_reference(served, reference, checkpoint):
    e2e.check_served(served, reference, f"MoE e2e ({checkpoint[1]['expert_format']} experts)")


def test_one_wrong_expert_in_one_layer_fails_the_bound(served, reference, checkpoint, token_ids):
    """Each single-expert bug (swapped nibbles only where the experts are NVFP4), computed by the
    reference on the same KV path, lies further from the float32 reference than the bound plus the
    served run's own distance: by the triangle inequality a server computing it would fail the bound."""
    ckpt, fmt = checkpoint[0], checkpoint[1]["expert_format"]
    expert = e2e.control_expert(reference)
    controls = {kind: {"corrupt_expert": (e2e.CONTROL_LAYER, expert, kind)}
                for kind in make_moe_checkpoint.EXPERT_CORRUPTIONS if fmt == "nvfp4" or kind != "swap-nibbles"}
    e2e.check_controls(served, reference, ckpt, token_ids, controls)


def test_census_lists_every_expert_stack_on_the_qpn_moe_route(served, checkpoint):
    e2e.check_census(served, checkpoint[0], checkpoint[1]["expert_format"])
