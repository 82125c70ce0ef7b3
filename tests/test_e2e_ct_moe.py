"""End to end on the real cpu engine: a small compressed-tensors checkpoint of the Qwen3.5 MoE family
(qpn.scripts.checkpoints.make_ct_checkpoint --moe --fp8-experts 5,6:tensor: the MoE generator's
float model, 8 routed experts per layer with top-2 routing, NVFP4 in six layers and FP8 in two (per
channel in layer 5, per tensor in layer 6: both expert formats and both FP8 layouts in one boot),
an NVFP4 shared expert, FP8 attention per tensor and per channel, NVFP4 lm_head, in llm-compressor's
layout) served by vLLM 0.32 on CPU through the overlay
(the registered QPN config's linear and MoE methods), against the same checkpoint decoded by
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

The census of the run must list every expert stack (2 per MoE layer) on the QPN MoE route of its
layer's format (qpn2_moe, qpn8_moe), every other quantized module on a QPN route, lm_head from the
checkpoint's codes, no fallback; and every module the checkpoint's config_groups declare (243)
paired with its engine name and on a QPN route (the qpn_routes gate's per-module coverage), which
fails once one expert stack is taken out of the census."""
from __future__ import annotations

import json
import shutil

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qpn.scripts.checkpoints import make_ct_checkpoint, make_moe_checkpoint  # noqa: E402
from tests import _moe_e2e as e2e  # noqa: E402

SERVED = "tiny-ct-moe"
FP8_EXPERTS = {5: "channel", 6: "tensor"}  # the other MoE layers' experts are NVFP4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ct_moe") / "ckpt"
    summary = make_ct_checkpoint.make_ct_checkpoint(out, seed=0, moe=True, fp8_experts=FP8_EXPERTS)
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

    from qpn.fork_patches.quant import conventions as cv

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
    for layer in range(cfg["num_hidden_layers"]):
        e = f"model.language_model.layers.{layer}.mlp.experts.3"
        (got,) = conv.module_schemes(qcfg, [f"{e}.up_proj"]).values()
        want = ("fp8", FP8_EXPERTS[layer]) if layer in FP8_EXPERTS else ("nvfp4", "tensor")
        assert (got.fmt, got.fp8_scale) == want, layer
        codes = tensors[f"{e}.up_proj.weight" if layer in FP8_EXPERTS else f"{e}.up_proj.weight_packed"]
        assert codes.dtype == (torch.float8_e4m3fn if layer in FP8_EXPERTS else torch.uint8)
        if layer in FP8_EXPERTS:
            scale = tensors[f"{e}.up_proj.weight_scale"]
            assert scale.numel() == (1 if FP8_EXPERTS[layer] == "tensor" else codes.shape[0])


def test_served_logprobs_match_the_float32_reference(served, reference):
    e2e.check_served(served, reference, "compressed-tensors MoE e2e (NVFP4 and FP8 experts)")


def test_one_wrong_expert_and_the_modelopt_reading_fail_the_bound(served, reference, checkpoint, token_ids):
    expert = e2e.control_expert(reference)
    controls = {kind: {"corrupt_expert": (e2e.CONTROL_LAYER, expert, kind)}
                for kind in make_moe_checkpoint.EXPERT_CORRUPTIONS}
    controls["global-scale-as-multiplier"] = {"perturb": "global-scale-as-multiplier"}
    e2e.check_controls(served, reference, checkpoint[0], token_ids, controls)


def test_census_every_expert_stack_on_the_qpn_moe_route(served, checkpoint):
    n_layers = json.loads((checkpoint[0] / "config.json").read_text())["num_hidden_layers"]
    formats = {n: "fp8" if n in FP8_EXPERTS else "nvfp4" for n in range(n_layers)}
    modules = e2e.check_census(served, checkpoint[0], formats)
    n_experts = json.loads((checkpoint[0] / "config.json").read_text())["num_experts"]
    for name, m in modules.items():
        if name.endswith((".experts.w13", ".experts.w2")):
            assert m["declared"] and len(m["declared"]) == n_experts * (2 if name.endswith("w13") else 1), name
    fp8 = [n for n, m in modules.items() if m["region"] == "fp8" and ".mlp.experts." not in n]
    assert fp8 and all(set(modules[n]["routes"]) <= e2e.DENSE_ROUTES["fp8"] for n in fp8)


def test_every_declared_checkpoint_module_is_paired_and_on_a_qpn_route(served, checkpoint, tmp_path):
    """The qpn_routes gate's per-module coverage on a compressed-tensors boot: the overlay recorded
    every module the config_groups declare with the engine's name for it (the model's mapper drops
    model.language_model.), and each one is on a QPN route; the same census with one expert stack
    taken out fails naming the stack's checkpoint modules."""
    from qpn.fork_patches.route_census import census
    from qpn.scripts.launcher import boot_gates

    ckpt = checkpoint[0]
    conv, declared = boot_gates.declared_modules(str(ckpt))
    assert conv.name == "compressed-tensors" and len(declared) == 243
    (rank,) = census.read_rank_files(str(served["census_dir"]))
    assert rank["checkpoint_modules"] == {c: c.replace("model.language_model.", "model.", 1) for c in declared}
    known = boot_gates.qpn_route_names()
    gate = boot_gates.gate_qpn_routes(census.aggregate(str(served["census_dir"])), {"nvfp4", "fp8"}, known,
                                      checkpoint_modules=declared)
    print("\n" + gate.expected + ": " + gate.observed)
    assert gate.status == boot_gates.PASS and "declared modules (243)" in gate.expected, gate.observed
    # the control: one FP8 expert stack (layer 6's down projections) left off the census
    cut = tmp_path / "census"
    shutil.copytree(served["census_dir"], cut)
    (path,) = cut.glob("census_rank*.json")
    data = json.loads(path.read_text())
    del data["modules"]["model.layers.6.mlp.experts.w2"]
    path.write_text(json.dumps(data))
    gate = boot_gates.gate_qpn_routes(census.aggregate(str(cut)), {"nvfp4", "fp8"}, known,
                                      checkpoint_modules=declared)
    assert gate.failed and "8 of 243 checkpoint module(s) declared by the checkpoint's config not in the census" in gate.observed
    assert "model.language_model.layers.6.mlp.experts." in gate.observed, gate.observed
