"""End to end on the real cpu engine: a small compressed-tensors checkpoint of the Qwen3.5 MoE family
(qpn.scripts.checkpoints.make_ct_checkpoint --moe: the MoE generator's float model, 8 NVFP4 routed
experts per layer with top-2 routing, an NVFP4 shared expert, FP8 attention per tensor and per
channel, NVFP4 lm_head, in llm-compressor's layout) served by vLLM 0.32 on CPU through the overlay
(hooks ct-qpn-linear-methods and ct-qpn-moe-method), against the same checkpoint decoded by
compressed-tensors' own code in float32 and run in transformers' Qwen3_5MoeForCausalLM, compared by
teacher-forced log-probabilities over 95 positions. One server boot.

Tolerance as in tests/test_e2e_moe.py (the ModelOpt MoE proof), measured in the same run: the
floor is the same reference in BF16 against float32 over the same positions; the served path must
stay within twice that floor, mean and worst. vLLM 0.32 ignores a compressed-tensors
kv_cache_scheme, so the engine keeps a BF16 KV cache; the census says which KV path ran and the
reference follows it.

Negative controls, computed by the same reference (no extra boot), must land further from the
float32 reference than the bound plus the served run's own distance, so that a server computing
them would fail: ONE expert of ONE layer served wrongly (its neighbour's weights; its gate and up
exchanged; its codes with its neighbour's scales; its nibbles exchanged), and the whole checkpoint
read the ModelOpt way (weight_global_scale taken as a multiplier instead of a divisor: the
mistake a loader that ignores the convention makes). The corrupted expert is the one the router of
the first MoE layer picks most often over these positions.

The census of the run must list every expert stack (2 per MoE layer) on the QPN MoE route, every
other quantized module on a QPN route, lm_head from the checkpoint's codes, no fallback."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qpn.scripts.checkpoints import make_ct_checkpoint, make_moe_checkpoint  # noqa: E402
from tests import _moe_e2e as e2e  # noqa: E402

SERVED = "tiny-ct-moe"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ct_moe") / "ckpt"
    summary = make_ct_checkpoint.make_ct_checkpoint(out, seed=0, moe=True)
    return out, summary


@pytest.fixture(scope="module")
def token_ids(checkpoint):
    return e2e.token_ids(checkpoint[0])


@pytest.fixture(scope="module")
def served(checkpoint, token_ids, tmp_path_factory):
    return e2e.serve(checkpoint[0], token_ids, SERVED, tmp_path_factory.mktemp("census"))


@pytest.fixture(scope="module")
def reference(checkpoint, token_ids, served):
    """float32 reference (compressed-tensors' decode) and its BF16 floor, on the KV path the engine ran."""
    return e2e.reference(checkpoint[0], token_ids, served)


def test_checkpoint_is_a_compressed_tensors_qwen35_moe(checkpoint):
    from safetensors.torch import load_file

    from qpn.fork_patches import conventions as cv

    ckpt, summary = checkpoint
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["num_experts"] == 8
    assert not (ckpt / "hf_quant_config.json").exists()
    conv, qcfg = cv.detect(ckpt)
    assert conv is cv.COMPRESSED_TENSORS
    p = "model.language_model.layers.0.mlp"
    schemes = conv.module_schemes(qcfg, [f"{p}.experts.7.down_proj", f"{p}.shared_expert.up_proj", f"{p}.gate",
                                         f"{p}.shared_expert_gate", "lm_head"])
    assert [s.fmt if s else None for s in schemes.values()] == ["nvfp4", "nvfp4", None, None, "nvfp4"]
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert f"{p}.experts.7.down_proj.weight_packed" in tensors and f"{p}.gate.weight" in tensors
    assert not any(k.endswith(("weight_scale_2", "k_proj.k_scale")) for k in tensors)
    assert summary["architecture"] == "Qwen3_5MoeForCausalLM"


def test_served_logprobs_match_the_float32_reference(served, reference):
    e2e.check_served(served, reference, "compressed-tensors MoE e2e (NVFP4 experts)")


def test_one_wrong_expert_and_the_modelopt_reading_fail_the_bound(served, reference, checkpoint, token_ids):
    expert = e2e.control_expert(reference)
    controls = {kind: {"corrupt_expert": (e2e.CONTROL_LAYER, expert, kind)}
                for kind in make_moe_checkpoint.EXPERT_CORRUPTIONS}
    controls["global-scale-as-multiplier"] = {"perturb": "global-scale-as-multiplier"}
    e2e.check_controls(served, reference, checkpoint[0], token_ids, controls)


def test_census_every_expert_stack_on_the_qpn_moe_route(served, checkpoint):
    modules = e2e.check_census(served, checkpoint[0], "nvfp4")
    n_experts = json.loads((checkpoint[0] / "config.json").read_text())["num_experts"]
    for name, m in modules.items():
        if name.endswith((".experts.w13", ".experts.w2")):
            assert m["declared"] and len(m["declared"]) == n_experts * (2 if name.endswith("w13") else 1), name
    fp8 = [n for n, m in modules.items() if m["region"] == "fp8"]
    assert fp8 and all(set(modules[n]["routes"]) <= e2e.DENSE_ROUTES["fp8"] for n in fp8)
