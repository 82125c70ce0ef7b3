"""End to end at tensor parallel 2 on the real vLLM 0.32 CPU engine (issue 11 item 10): the
generated mixed NVFP4/FP8 checkpoint served over two ranks with MTP speculation on agrees with
the independent float32 reference within the TP=1 tolerance, every rank writes its census, and
the boot gates pass over both ranks.

The harness (server, checkpoint generator, reference, teacher-forced prompt logprobs) is the TP=1
end-to-end test's (tests/test_e2e_loader.py), imported, not copied. Each rank's OpenMP threads get
their own core group, derived by the launcher's own rule (engine_profiles.tp_env).

KV cache: the server is given ``--kv-cache-dtype bfloat16`` explicitly and the reference runs with
an unquantized cache, so this test compares the tensor-parallel split alone; the FP8-KV path of
AVX-512 hosts is the TP=1 test's subject.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from tests._agreement import check_agreement

from qpn.scripts.launcher import boot_gates
from qpn.scripts.launcher.engine_profiles import CPU, tp_env
from tests.test_e2e_loader import (
    PROMPT_TEXT, SERVED_NAME, Server, _references, _served_prompt_logprobs,
    _tagged_pids,
)

pytestmark = pytest.mark.slow

TP = 2
K = 2  # MTP draft tokens


@pytest.fixture(scope="module")
def served_tp2(tmp_path_factory, mixed_checkpoint):
    env = tp_env(CPU, TP)  # raises on a host with fewer cores than ranks
    root = tmp_path_factory.mktemp("e2e-tp2")
    ckpt = mixed_checkpoint  # the session's (tests/conftest.py): read, never written
    census_dir = root / "census"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the Server copies os.environ when it starts the engine
    try:
        spec = {"method": "mtp", "num_speculative_tokens": K, "draft_sample_method": "greedy"}
        server = Server(ckpt, census_dir, extra_args=[
            "--tensor-parallel-size", str(TP), "--kv-cache-dtype", "bfloat16",
            "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec)])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        server.wait_ready()
        yield {"server": server, "ckpt": ckpt, "census_dir": census_dir, "tmp": root, "env": env}
    finally:
        server.stop()
        assert not _tagged_pids(server.tag), "server processes left behind"



def test_tp2_logprobs_agree_with_float32_reference(served_tp2):
    """Same tolerance rule as TP=1 (test_e2e_loader): twice the bfloat16 floor of the reference
    itself, mean and max over the teacher-forced positions; the two single decoding mistakes of
    the TP=1 test must land far outside it."""
    server, ckpt, tmp = served_tp2["server"], served_tp2["ckpt"], served_tp2["tmp"]
    ids = server.post("/tokenize", {"model": SERVED_NAME, "prompt": PROMPT_TEXT,
                                    "add_special_tokens": False})["tokens"]
    assert len(ids) >= 65
    got, top1 = _served_prompt_logprobs(server, ids)
    controls = ("swap-nibbles", "collapse-fp8-shards")
    refs = _references(ckpt, ids, tmp, ["float32", "bfloat16", *controls], "auto")
    check_agreement(got, top1, refs, f"TP={TP}", gross=controls)


def test_tp2_census_per_rank_and_gates_over_both_ranks(served_tp2):
    from qpn.fork_patches.route_census.census import aggregate

    server, ckpt, census_dir = served_tp2["server"], served_tp2["ckpt"], served_tp2["census_dir"]
    reply = server.post("/v1/chat/completions", {
        "model": SERVED_NAME, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Count from one to twenty in words."}]})
    warm = {"ok": True, "completion_tokens": int(reply["usage"]["completion_tokens"])}
    time.sleep(2.5)  # each rank's census thread writes at most once a second
    agg = aggregate(str(census_dir))
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as r:
        metrics = r.read().decode()
    quant = json.loads((Path(ckpt) / "hf_quant_config.json").read_text())
    layers = boot_gates.declared_layers(quant)
    from qpn.fork_patches.quant.qpn_config import claim

    results = boot_gates.evaluate(CPU, K, warm, metrics, agg, boot_gates.declared_regions(quant),
                                  tp=TP, quantized_layers=layers, env=served_tp2["env"],
                                  qpn_claim=claim(quant, served_tp2["env"]))
    table = boot_gates.format_table(results)
    print(table)
    assert not any(r.failed for r in results), table
    ranks = agg["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["quant_config"] for r in ranks] == ["qpn", "qpn"]  # both ranks through the registered config
    assert all(r["tensor_parallel_size"] == TP for r in ranks)
    assert all(r["serving"]["num_speculative_tokens"] == K for r in ranks)
    for r in ranks:
        # every module of the checkpoint's quantized_layers (as the engine renames them: same
        # count, same order) is on QPN on this rank
        engine_names = r["engine_quantized_layers"]
        assert len(engine_names) == len(layers)
        assert set(r["declared_on_qpn"]) == set(engine_names), sorted(set(engine_names) - set(r["declared_on_qpn"]))
        assert r["declared_off_qpn"] == []
        assert r["modules_total"] == r["modules_on_qpn"] > 0
        # what the attention layers actually use: the bf16 cache asked for
        assert {g["kv_cache_dtype"] for g in r["attention_layers"]} == {"bfloat16"}
        assert {g["cache_tensor_dtype"] for g in r["attention_layers"]} == {"bfloat16"}
    config = json.loads((Path(ckpt) / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert {(g["num_heads"], g["num_kv_heads"]) for r in ranks for g in r["attention_layers"]} == {
        (heads // TP, kv_heads // TP)}
    assert len(agg["lm_head"]) == TP and all(h["source"] == "checkpoint_codes" for h in agg["lm_head"])
