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

import contextlib
import json
import time

import pytest

from tests._agreement import deltas

pytestmark = [pytest.mark.slow, pytest.mark.engine]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qpn.scripts.checkpoints import (  # noqa: E402
    checkpoint_reference,
    make_ct_checkpoint,
    make_moe_checkpoint,
    tiny_tokenizer,
)
from tests._server import VllmServer  # noqa: E402

POSITIONS = 95
FLOOR_FACTOR = 2.0
CONTROL_LAYER = 0   # first MoE layer: a wrong expert there reaches every later layer
MIN_CONTROL_PICKS = 16  # the corrupted expert must be used by the positions compared
SERVED = "tiny-ct-moe"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ct_moe") / "ckpt"
    summary = make_ct_checkpoint.make_ct_checkpoint(out, seed=0, moe=True)
    return out, summary


@pytest.fixture(scope="module")
def token_ids(checkpoint):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(checkpoint[0] / "tokenizer.json")).encode(" ".join(tiny_tokenizer._CORPUS)).ids
    assert len(ids) > POSITIONS
    return ids[: POSITIONS + 1]


@pytest.fixture(scope="module")
def served(checkpoint, token_ids, tmp_path_factory):
    from qpn.fork_patches import census

    ckpt, _ = checkpoint
    census_dir = tmp_path_factory.mktemp("census")
    with VllmServer(str(ckpt), served_model_name=SERVED, census_dir=str(census_dir)) as srv:
        resp = srv.post("/v1/completions", {"model": SERVED, "prompt": token_ids, "max_tokens": 4,
                                            "temperature": 0, "prompt_logprobs": 0})
        time.sleep(2.5)  # the census flushes at most once per second
    plp = resp["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(token_ids)
    logprobs = [float(entry[str(tok)]["logprob"]) for entry, tok in zip(plp[1:], token_ids[1:])]
    (kv,) = census.aggregate(str(census_dir))["kv_resolved"]
    return {"logprobs": logprobs, "census_dir": census_dir, "kv_resolved": kv["resolved"]}


def _kv_path(served) -> str:
    return "fp8_e4m3" if served["kv_resolved"].startswith("fp8") else "auto"


def _run(model, ckpt, token_ids, kv: str) -> list[float]:
    ctx = checkpoint_reference.fp8_kv_emulation(model, ckpt) if kv == "fp8_e4m3" else contextlib.nullcontext()
    with ctx:
        return checkpoint_reference.teacher_forced_logprobs(model, token_ids)["token_logprobs"]


@pytest.fixture(scope="module")
def reference(checkpoint, token_ids, served):
    """float32 reference (compressed-tensors' decode) and its BF16 floor, on the KV path the engine ran."""
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
    ref, got = reference["float32"], served["logprobs"]
    assert len(got) == len(ref) == POSITIONS
    tol_mean, tol_max, floor_mean, floor_max = _bound(reference)
    mean, worst = deltas(got, ref)
    report = (f"compressed-tensors MoE e2e (NVFP4 experts, KV cache {served['kv_resolved']}, reference KV path "
              f"{reference['kv']}): served vs float32 over {POSITIONS} positions: mean {mean:.4f} worst "
              f"{worst:.4f} nat; bf16 floor mean {floor_mean:.4f} worst {floor_max:.4f}; bound {FLOOR_FACTOR:g}x")
    print("\n" + report)
    assert floor_max > 0, "the BF16 floor is zero: the reference did not run in BF16"
    assert mean <= tol_mean and worst <= tol_max, report


def test_one_wrong_expert_and_the_modelopt_reading_fail_the_bound(served, reference, checkpoint, token_ids):
    ckpt = checkpoint[0]
    use = reference["expert_use"]
    expert = max(range(len(use)), key=use.__getitem__)
    assert use[expert] >= MIN_CONTROL_PICKS, f"layer {CONTROL_LAYER} router picks {use}: control would prove nothing"
    tol_mean, tol_max, _, _ = _bound(reference)
    mean, worst = deltas(served["logprobs"], reference["float32"])
    controls = {kind: {"corrupt_expert": (CONTROL_LAYER, expert, kind)}
                for kind in make_moe_checkpoint.EXPERT_CORRUPTIONS}
    controls["global-scale-as-multiplier"] = {"perturb": "global-scale-as-multiplier"}
    lines, weak = [], []
    for name, kwargs in controls.items():
        model = make_moe_checkpoint.load_reference_model(ckpt, **kwargs)
        c_mean, c_max = deltas(_run(model, ckpt, token_ids, reference["kv"]), reference["float32"])
        lines.append(f"{name}: mean {c_mean:.3f} worst {c_max:.3f}")
        if not (c_mean > tol_mean + mean or c_max > tol_max + worst):
            weak.append(name)
    report = (f"layer {CONTROL_LAYER} expert {expert} ({use[expert]} picks); bound mean {tol_mean:.3f} worst "
              f"{tol_max:.3f}, served mean {mean:.3f} worst {worst:.3f}; controls: " + "; ".join(lines))
    print("\n" + report)
    assert not weak, f"controls {weak} would pass the bound: {report}"


def test_census_every_expert_stack_on_the_qpn_moe_route(served, checkpoint):
    from qpn.fork_patches import census

    agg = census.aggregate(str(served["census_dir"]))
    cfg = json.loads((checkpoint[0] / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    assert agg["modules_on_qpn"] == agg["modules_total"] > 0
    assert agg["fallback_calls"] == 0 and not agg["non_qpn_routes"]
    assert agg["route_counts"]["qpn2_moe"]["eager"] >= 2 * n_layers
    modules = census.read_rank_files(str(served["census_dir"]))[0]["modules"]
    stacks = {name: m for name, m in modules.items() if name.endswith((".experts.w13", ".experts.w2"))}
    assert len(stacks) == 2 * n_layers
    for name, m in stacks.items():
        assert m["region"] == "nvfp4" and m["eligible"] and m["prepack_verified"], name
        assert set(m["routes"]) == {"qpn2_moe"} and m["routes"]["qpn2_moe"]["eager"] >= 1, name
        assert m["declared"] and len(m["declared"]) == cfg["num_experts"] * (2 if name.endswith("w13") else 1), name
    w13 = modules["model.layers.0.mlp.experts.w13"]
    assert (w13["n"], w13["k"]) == (2 * cfg["moe_intermediate_size"], cfg["hidden_size"])
    shared = [n for n in modules if ".shared_expert." in n]
    assert len(shared) == 2 * n_layers and all(set(modules[n]["routes"]) <= {"qpn2", "qpn2_mt2", "qpn2_chunked",
                                                                           "qpn2_reconstruct"} for n in shared)
    fp8 = [n for n, m in modules.items() if m["region"] == "fp8"]
    assert fp8 and all(set(modules[n]["routes"]) <= {"qpn8", "qpn8_mt2", "qpn8_chunked", "qpn8_reconstruct"}
                       for n in fp8)
    assert agg["lm_head"][0]["source"] == "checkpoint_codes"
