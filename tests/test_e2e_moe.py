"""End to end on the real cpu engine: a small ModelOpt MIXED_PRECISION checkpoint of the Qwen3.5
MoE family (qpn.scripts.make_moe_checkpoint: hybrid GDN/attention trunk, 8 experts per layer
with top-2 routing in NVFP4 -- and, as a second checkpoint, in FP8 (the QPN8 side) -- an NVFP4
shared expert, FP8 attention, NVFP4 lm_head) served by
vLLM 0.32 on CPU through the overlay, against the same checkpoint dequantized in float32 and
run in transformers (qpn.scripts.checkpoint_reference's decoders, transformers'
Qwen3_5MoeForCausalLM), compared by teacher-forced log-probabilities over 95 positions.

Tolerance. The engine computes in BF16 (vLLM's CPU gated-delta-net kernel accepts nothing
else), the reference in float32. For this model, transformers itself in BF16 against float32
(same float weights, no quantization, these 95 positions) differs by 0.084 nat on average and
0.50 at worst (the MoE's top-k boundary moves under BF16 rounding; measured 2026-11-29). The
served path adds FP16 activations into every QPN GEMM; measured here: 0.072 mean, 0.78 worst
(FP8 experts: 0.061 mean, 0.41 worst).
Bounds: mean |delta| <= 0.25 nat, worst <= 2.0 nat. Negative controls computed by the same
reference (NVFP4 nibbles swapped: 2.2 nat mean; gate and up exchanged in every expert: 1.2;
every expert given its neighbour's weights: 1.4; shared expert removed: 1.5) must each be at
least twice the mean bound away, so the bounds reject a wrong expert path.

The census of the run must list every expert stack (2 per MoE layer) on the QPN MoE route,
every other quantized module on a QPN route, lm_head from the checkpoint's codes, no fallback.
"""
from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.engine]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

from qpn.scripts import checkpoint_reference, make_moe_checkpoint, tiny_tokenizer  # noqa: E402
from tests._server import VllmServer  # noqa: E402

MEAN_BOUND = 0.25
MAX_BOUND = 2.0
POSITIONS = 95


@pytest.fixture(scope="module", params=["nvfp4", "fp8"], ids=["nvfp4_experts", "fp8_experts"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    summary = make_moe_checkpoint.make_moe_checkpoint(out, seed=0, expert_format=request.param)
    return out, summary


@pytest.fixture(scope="module")
def token_ids(checkpoint):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(checkpoint[0] / "tokenizer.json")).encode(" ".join(tiny_tokenizer._CORPUS)).ids
    assert len(ids) > POSITIONS
    return ids[: POSITIONS + 1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def served(checkpoint, token_ids, tmp_path_factory):
    ckpt, _ = checkpoint
    census_dir = tmp_path_factory.mktemp("census")
    old = os.environ.get("QPN_CENSUS_DIR")
    os.environ["QPN_CENSUS_DIR"] = str(census_dir)
    try:
        with VllmServer(str(ckpt), served_model_name="tiny-moe") as srv:
            resp = _post(srv.base_url + "/completions", {
                "model": "tiny-moe", "prompt": token_ids, "max_tokens": 4, "temperature": 0,
                "prompt_logprobs": 0})
            time.sleep(2.5)  # the census flushes at most once per second
    finally:
        if old is None:
            os.environ.pop("QPN_CENSUS_DIR", None)
        else:
            os.environ["QPN_CENSUS_DIR"] = old
    plp = resp["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(token_ids)
    logprobs = [float(entry[str(tok)]["logprob"]) for entry, tok in zip(plp[1:], token_ids[1:])]
    return {"logprobs": logprobs, "text": resp["choices"][0]["text"], "census_dir": census_dir}


@pytest.fixture(scope="module")
def reference(checkpoint, token_ids):
    torch.manual_seed(0)
    model = make_moe_checkpoint.load_reference_model(checkpoint[0])
    return checkpoint_reference.teacher_forced_logprobs(model, token_ids)


def _deltas(a, b):
    d = [abs(x - y) for x, y in zip(a, b)]
    return statistics.mean(d), max(d)


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


def test_served_logprobs_match_the_float32_reference(served, reference, checkpoint, token_ids):
    ref = reference["token_logprobs"]
    got = served["logprobs"]
    assert len(got) == len(ref) == POSITIONS
    mean, worst = _deltas(got, ref)
    print(f"\nMoE e2e: served vs float32 reference over {POSITIONS} positions: mean |delta| {mean:.4f} nat, "
          f"worst {worst:.4f} nat")
    assert mean <= MEAN_BOUND and worst <= MAX_BOUND, (mean, worst)
    if checkpoint[1]["expert_format"] != "nvfp4":
        return  # the negative controls are properties of the reference; once is enough
    controls = {}
    for perturb, moe_perturb in (("swap-nibbles", "none"), ("none", "swap-gate-up"),
                                 ("none", "shift-experts"), ("none", "drop-shared-expert")):
        model = make_moe_checkpoint.load_reference_model(checkpoint[0], perturb, moe_perturb)
        lp = checkpoint_reference.teacher_forced_logprobs(model, token_ids)["token_logprobs"]
        controls[f"{perturb}/{moe_perturb}"] = _deltas(lp, ref)[0]
    print("negative controls (mean |delta| vs reference): " +
          ", ".join(f"{k} {v:.3f}" for k, v in controls.items()))
    for name, d in controls.items():
        assert d >= 2 * MEAN_BOUND, f"control {name} is only {d:.3f} nat from the reference: the bound is not sharp"


def test_census_lists_every_expert_stack_on_the_qpn_moe_route(served, checkpoint):
    from qpn.fork_patches import census

    agg = census.aggregate(str(served["census_dir"]))
    cfg = json.loads((checkpoint[0] / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    assert agg["modules_on_qpn"] == agg["modules_total"] > 0
    assert agg["fallback_calls"] == 0 and not agg["non_qpn_routes"]
    route = {"nvfp4": "qpn2_moe", "fp8": "qpn8_moe"}[checkpoint[1]["expert_format"]]
    assert agg["route_counts"][route]["eager"] >= 2 * n_layers
    ranks = census.read_rank_files(str(served["census_dir"]))
    modules = ranks[0]["modules"]
    stacks = {name: m for name, m in modules.items() if name.endswith((".experts.w13", ".experts.w2"))}
    assert len(stacks) == 2 * n_layers
    for name, m in stacks.items():
        assert m["region"] == checkpoint[1]["expert_format"] and m["eligible"] and m["prepack_verified"]
        assert set(m["routes"]) == {route} and m["routes"][route]["eager"] >= 1, name
    w13 = modules["model.layers.0.mlp.experts.w13"]
    assert (w13["n"], w13["k"]) == (2 * cfg["moe_intermediate_size"], cfg["hidden_size"])
    shared = [n for n in modules if ".shared_expert." in n]
    assert len(shared) == 2 * n_layers and all(set(modules[n]["routes"]) <= {"qpn2", "qpn2_mt2", "qpn2_chunked",
                                                                           "qpn2_reconstruct"} for n in shared)
    assert agg["lm_head"][0]["source"] == "checkpoint_codes"
