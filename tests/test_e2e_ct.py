"""End to end on the real vLLM 0.32 CPU engine, through the overlay: a compressed-tensors
checkpoint (qpn.scripts.checkpoints.make_ct_checkpoint: NVFP4 MLP + lm_head, FP8 attention per tensor and
per channel) is claimed by the registered QPN config and serves through the QPN methods, agrees with an
independent float32 reference decoded by compressed-tensors' own code, and the census accounts
for every quantized module on a QPN route with zero fallbacks.

The server harness, prompt and census helpers are tests/test_e2e_loader.py's (imported)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests._agreement import check_agreement

from test_e2e_loader import (  # noqa: F401  (the harness of the ModelOpt end-to-end test)
    PROMPT_TEXT,
    SERVED_NAME,
    Server,
    _kv_resolved,
    _run_engine_python,
    _served_prompt_logprobs,
    _tagged_pids,
)

pytestmark = pytest.mark.slow

GROSS_CONTROLS = ("swap-nibbles", "global-scale-as-multiplier")
CONTROLS = (*GROSS_CONTROLS, "collapse-fp8-shards")


@pytest.fixture(scope="module")
def ct_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e_ct")
    _run_engine_python(["-m", "qpn.scripts.checkpoints.make_ct_checkpoint", str(root / "ckpt"), "--seed", "0"])
    return root


def _serve(root: Path, kv: str):
    ckpt = root / "ckpt"
    census_dir = root / f"census-{kv}"
    server = Server(ckpt, census_dir, extra_args=[] if kv == "auto" else ["--kv-cache-dtype", kv])
    try:
        server.wait_ready()
        yield {"server": server, "ckpt": ckpt, "census_dir": census_dir, "tmp": root, "kv": kv}
    finally:
        server.stop()
        assert not _tagged_pids(server.tag), "server processes left behind"


@pytest.fixture(scope="module")
def served(ct_root):
    """The checkpoint as it asks to be served (--kv-cache-dtype auto)."""
    yield from _serve(ct_root, "auto")


@pytest.fixture
def served_fp8_kv(ct_root, served):
    """FP8 KV asked for explicitly, where the cpu engine has it (x86 with AVX-512/AMX): the
    checkpoint's self_attn.k_scale / v_scale must reach the cache. Up for its one test only (no
    more than one server idle beside the test's: tests/_engine_servers.py)."""
    from qpn.fork_patches.engine.kv_policy import cpu_lacks_fp8_kv

    if cpu_lacks_fp8_kv():
        pytest.skip("this CPU has no FP8 KV cache in vLLM 0.32 (needs AVX-512 or AMX)")
    yield from _serve(ct_root, "fp8_e4m3")


def _references(ckpt: Path, ids: list[int], tmp: Path, variants: list[str], kv: str) -> dict:
    out = tmp / f"ct-references-{kv}.json"
    _run_engine_python(["-m", "qpn.scripts.checkpoints.ct_reference", str(ckpt), "--token-ids", ",".join(map(str, ids)),
                        "--variants", ",".join(variants), "--kv-cache", kv, "--out", str(out)])
    return json.loads(out.read_text())


@pytest.mark.parametrize("kv_path", ["auto", "fp8_e4m3-forced"])
def test_served_logprobs_agree_with_float32_reference(kv_path, request):
    """Same bound as the ModelOpt test: twice the bf16 floor (the reference run in bfloat16 on the
    same positions), mean and max of |delta log-prob|; three decoding mistakes must land outside
    (the two gross ones beyond 5x the mean bound, as in the ModelOpt test).
    KV path: vLLM 0.32 does not read a compressed-tensors kv_cache_scheme, so --kv-cache-dtype auto
    keeps the model dtype; the test asserts that, and the reference has no FP8 KV emulation."""
    served = request.getfixturevalue("served" if kv_path == "auto" else "served_fp8_kv")
    server, ckpt, tmp = served["server"], served["ckpt"], served["tmp"]
    ids = server.post("/tokenize", {"model": SERVED_NAME, "prompt": PROMPT_TEXT, "add_special_tokens": False})["tokens"]
    assert len(ids) >= 65, "need at least 64 teacher-forced positions"
    got, top1 = _served_prompt_logprobs(server, ids)
    # 'auto' = the model dtype (bfloat16 on the cpu engine): the KV cache is not quantized
    assert _kv_resolved(served["census_dir"]) == served["kv"]
    if served["kv"] != "auto":  # vLLM warns and skips a checkpoint KV scale it cannot place
        skipped = [ln for ln in server.log_text().splitlines() if "_scale in the checkpoint" in ln]
        assert not skipped, skipped[:2]
    # every reference variant, the bf16 floor included, stores K/V the way the served run does
    refs = _references(ckpt, ids, tmp, ["float32", "bfloat16", *CONTROLS], served["kv"])
    # The subtle control (only the two full-attention q/k/v triples carry per-tensor FP8 scales
    # here; the GDN projections are per channel): the tolerance itself must reject it on both
    # measures. Measured 2026-11-30: mean 0.408 / max 1.915 against a bound of 0.207 / 0.963.
    check_agreement(got, top1, refs, f"compressed-tensors, KV {served['kv']}", gross=GROSS_CONTROLS,
                    subtle=("collapse-fp8-shards",))


def test_census_every_quantized_module_on_qpn_and_zero_fallbacks(served):
    from qpn.fork_patches.route_census.census import aggregate
    from qpn.kernels.routes import QPN_ROUTES

    server, ckpt, census_dir = served["server"], served["ckpt"], served["census_dir"]
    words = "north south east west river stone cloud field light music paper window".split()
    for n in (5, 12, 40, 130):  # one prompt per route band, then a decode step
        ids = server.post("/tokenize", {"model": SERVED_NAME, "prompt": " ".join(words * 20),
                                        "add_special_tokens": False})["tokens"][:n]
        ids[0] = (ids[0] + n) % 400
        server.post("/v1/completions", {"model": SERVED_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0})
    time.sleep(2.5)
    agg = aggregate(str(census_dir))
    config = json.loads((ckpt / "config.json").read_text())
    n_gdn = config["layer_types"].count("linear_attention")
    n_attn = config["layer_types"].count("full_attention")
    expected = {"fp8": 2 * n_gdn + 2 * n_attn, "nvfp4": 2 * config["num_hidden_layers"] + 1}
    print(json.dumps({k: agg[k] for k in ("modules_by_region", "modules_on_qpn", "modules_total",
                                          "route_counts", "fallback_calls", "lm_head", "kv_resolved")}, indent=1))
    (rank,) = agg["ranks"]
    assert rank["platform"] == "cpu" and rank["backend"] == "reference"
    assert agg["modules_by_region"] == expected
    assert agg["modules_on_qpn"] == agg["modules_total"] == sum(expected.values())
    assert agg["fallback_calls"] == 0 and agg["fallbacks"] == [] and agg["non_qpn_routes"] == []
    assert set(agg["route_counts"]) <= QPN_ROUTES
    for family in ("qpn2", "qpn8"):
        for band in ("", "_mt2", "_chunked", "_reconstruct"):
            assert agg["route_counts"].get(family + band, {}).get("eager", 0) > 0, family + band
    assert agg["lm_head"] == [{"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes",
                               "route_family": "qpn2", "repack_fallback": False}]
    (kv,) = agg["kv_resolved"]
    assert kv["checkpoint_requested"] is None and kv["resolved"] == "auto"

    # the qpn_routes gate's per-module coverage: every module config_groups declares, recorded with
    # the engine's name for it (the model's mapper drops model.language_model.) and on QPN
    from qpn.scripts.launcher import boot_gates

    conv, declared = boot_gates.declared_modules(str(ckpt))
    # per checkpoint tensor, not per fused engine module: GDN in_proj_qkv / in_proj_z / out_proj,
    # attention q / k / v / o, MLP gate / up / down, and lm_head
    n_ckpt = 3 * n_gdn + 4 * n_attn + 3 * config["num_hidden_layers"] + 1
    assert conv.name == "compressed-tensors" and len(declared) == n_ckpt
    assert rank["checkpoint_modules"] == {c: c.replace("model.language_model.", "model.", 1) for c in declared}
    known = boot_gates.qpn_route_names()
    gate = boot_gates.gate_qpn_routes(agg, {"nvfp4", "fp8"}, known, checkpoint_modules=declared)
    assert gate.status == boot_gates.PASS and f"declared modules ({len(declared)})" in gate.expected, gate.observed
    # the controls: one declared module off QPN, then missing from the census: each fails the gate
    # naming the checkpoint module
    bad = next(c for c in declared if c.endswith("mlp.down_proj"))
    engine_name = rank["checkpoint_modules"][bad]
    off = json.loads(json.dumps(agg))
    r0 = off["ranks"][0]
    r0["declared_on_qpn"].remove(engine_name)
    r0["declared_off_qpn"] = [*(r0.get("declared_off_qpn") or []), engine_name]
    gate = boot_gates.gate_qpn_routes(off, {"nvfp4", "fp8"}, known, checkpoint_modules=declared)
    assert gate.failed and "not on a QPN route" in gate.observed and bad in gate.observed, gate.observed
    r0["declared_off_qpn"].remove(engine_name)
    gate = boot_gates.gate_qpn_routes(off, {"nvfp4", "fp8"}, known, checkpoint_modules=declared)
    assert gate.failed and "not in the census" in gate.observed and bad in gate.observed, gate.observed
