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

import contextlib
import json
import os
import time
import urllib.request

import pytest

from tests._agreement import deltas

pytestmark = [pytest.mark.slow, pytest.mark.engine]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

from qpn.scripts.checkpoints import checkpoint_reference, make_moe_checkpoint, tiny_tokenizer  # noqa: E402
from tests._server import VllmServer  # noqa: E402

POSITIONS = 95
FLOOR_FACTOR = 2.0
CONTROL_LAYER = 0   # first MoE layer: a wrong expert there reaches every later layer
MIN_CONTROL_PICKS = 16  # the corrupted expert must be used by the positions compared


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
    from qpn.fork_patches import census

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
    (kv,) = census.aggregate(str(census_dir))["kv_resolved"]
    return {"logprobs": logprobs, "text": resp["choices"][0]["text"], "census_dir": census_dir,
            "kv_resolved": kv["resolved"]}


def _kv_path(served) -> str:
    """The KV path the engine ran, as the reference names it."""
    return "fp8_e4m3" if served["kv_resolved"].startswith("fp8") else "auto"


def _run(model, ckpt, token_ids, kv: str) -> list[float]:
    ctx = checkpoint_reference.fp8_kv_emulation(model, ckpt) if kv == "fp8_e4m3" else contextlib.nullcontext()
    with ctx:
        return checkpoint_reference.teacher_forced_logprobs(model, token_ids)["token_logprobs"]


@pytest.fixture(scope="module")
def reference(checkpoint, token_ids, served):
    """float32 reference and its BF16 floor, on the KV path the engine ran."""
    torch.manual_seed(0)
    ckpt, kv = checkpoint[0], _kv_path(served)
    model = make_moe_checkpoint.load_reference_model(ckpt)
    use = make_moe_checkpoint.expert_use(model, token_ids, CONTROL_LAYER)
    out = {"kv": kv, "expert_use": use, "float32": _run(model, ckpt, token_ids, kv)}
    out["bfloat16"] = _run(model.to(torch.bfloat16), ckpt, token_ids, kv)
    return out





def _bound(reference):
    floor_mean, floor_max = deltas(reference["bfloat16"], reference["float32"])
    return FLOOR_FACTOR * floor_mean, FLOOR_FACTOR * floor_max, floor_mean, floor_max


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
    ref, got = reference["float32"], served["logprobs"]
    assert len(got) == len(ref) == POSITIONS
    tol_mean, tol_max, floor_mean, floor_max = _bound(reference)
    mean, worst = deltas(got, ref)
    report = (f"MoE e2e ({checkpoint[1]['expert_format']} experts, KV cache {served['kv_resolved']}, reference KV "
              f"path {reference['kv']}): served vs float32 over {POSITIONS} positions: mean {mean:.4f} worst "
              f"{worst:.4f} nat; bf16 floor mean {floor_mean:.4f} worst {floor_max:.4f}; bound {FLOOR_FACTOR:g}x")
    print("\n" + report)
    assert floor_max > 0, "the BF16 floor is zero: the reference did not run in BF16"
    assert mean <= tol_mean and worst <= tol_max, report


def test_one_wrong_expert_in_one_layer_fails_the_bound(served, reference, checkpoint, token_ids):
    """Each single-expert bug, computed by the reference on the same KV path, lies further from
    the float32 reference than the bound plus the served run's own distance (mean or worst): by
    the triangle inequality a server computing it would fail the bound."""
    ckpt, fmt = checkpoint[0], checkpoint[1]["expert_format"]
    use = reference["expert_use"]
    expert = max(range(len(use)), key=use.__getitem__)
    assert use[expert] >= MIN_CONTROL_PICKS, f"layer {CONTROL_LAYER} router picks {use}: control would prove nothing"
    tol_mean, tol_max, _, _ = _bound(reference)
    mean, worst = deltas(served["logprobs"], reference["float32"])
    kinds = [k for k in make_moe_checkpoint.EXPERT_CORRUPTIONS if fmt == "nvfp4" or k != "swap-nibbles"]
    lines, weak = [], []
    for kind in kinds:
        model = make_moe_checkpoint.load_reference_model(ckpt, corrupt_expert=(CONTROL_LAYER, expert, kind))
        c_mean, c_max = deltas(_run(model, ckpt, token_ids, reference["kv"]), reference["float32"])
        lines.append(f"{kind}: mean {c_mean:.3f} worst {c_max:.3f}")
        if not (c_mean > tol_mean + mean or c_max > tol_max + worst):
            weak.append(kind)
    report = (f"layer {CONTROL_LAYER} expert {expert} ({use[expert]} picks); bound mean {tol_mean:.3f} worst "
              f"{tol_max:.3f}, served mean {mean:.3f} worst {worst:.3f}; controls: " + "; ".join(lines))
    print("\n" + report)
    assert not weak, f"controls {weak} would pass the bound: {report}"


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
