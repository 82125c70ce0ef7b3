"""End to end on the real vLLM 0.32 CPU engine, through the overlay: the generated mixed
NVFP4/FP8 checkpoint serves as written, agrees with an independent float32 reference, the route
census accounts for every quantized module on a QPN route with zero fallbacks, and malformed
checkpoints fail cleanly (module named, no server left, no half-written file).

The server is ``$QPN_ENGINE_PYTHON -m vllm.entrypoints.openai.api_server`` (default: this
Python), on a free loopback port, with caches and sockets in a temporary folder, stopped with
SIGTERM to its process group. Every process it starts carries a unique environment tag, and the
teardown checks that no process with that tag is left.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._agreement import check_agreement

from tests._server import VllmServer
from tests._server import tagged_pids as _tagged_pids  # the name tests/test_e2e_tp.py imports

pytestmark = pytest.mark.slow

BOOT_TIMEOUT_S = 420
ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON", sys.executable)
SERVED_NAME = "tiny-qwen35-mixed"

# A prompt in the checkpoint's chat format with reasoning and a tool call: > 64 positions.
PROMPT_TEXT = (
    "<|im_start|>user\nPlease think step by step about the weather in Paris, then call the tool "
    "get_weather with the city name and report the temperature in Celsius.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe user wants the weather. I should call the tool first and "
    "then answer briefly.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>")


def Server(model_dir: Path, census_dir: Path, extra_args=()) -> VllmServer:
    """The end-to-end configuration of the tests' one server harness (tests/_server.py), launched:
    ``wait_ready()`` or ``wait_exit()`` next. Tagged processes, census folder, log tail on failure."""
    return VllmServer(model_dir, extra_args, served_model_name=SERVED_NAME, census_dir=census_dir,
                      max_model_len=1024, max_num_seqs=None, boot_timeout_s=BOOT_TIMEOUT_S).launch()


def _run_engine_python(args: list[str], timeout: float = 600) -> str:
    r = subprocess.run([ENGINE_PYTHON, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return r.stdout


def _make_checkpoint(out: Path, malformed: str | None = None) -> Path:
    args = ["-m", "qpn.scripts.checkpoints.make_checkpoint", str(out), "--seed", "0"]
    if malformed:
        args += ["--malformed", malformed]
    _run_engine_python(args)
    return out


def _references(ckpt: Path, ids: list[int], tmp: Path, variants: list[str], kv_cache: str) -> dict:
    """Independent references in one engine-python process (one transformers import)."""
    out = tmp / f"references-{kv_cache}.json"
    _run_engine_python(["-m", "qpn.scripts.checkpoints.checkpoint_reference", str(ckpt), "--token-ids", ",".join(map(str, ids)),
                        "--variants", ",".join(variants), "--kv-cache", kv_cache, "--out", str(out)])
    return json.loads(out.read_text())


# The KV-cache path the main server runs: "checkpoint" lets the engine resolve the checkpoint's
# FP8 directive (an FP8 cache on x86 with AVX-512/AMX, the model dtype elsewhere); any other value
# is passed as --kv-cache-dtype, so QPN_TEST_KV_CACHE=bfloat16 forces the bf16 path on any host.
KV_SETTING = os.environ.get("QPN_TEST_KV_CACHE", "checkpoint")


def _serve(root: Path, kv_setting: str, ckpt: Path, label: str = ""):
    census_dir = root / f"census-{label or kv_setting}"
    kv_args = [] if kv_setting == "checkpoint" else ["--kv-cache-dtype", kv_setting]
    # Served the way the launcher serves the real model: tool calls and reasoning parsed.
    server = Server(ckpt, census_dir, extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                                  "--reasoning-parser", "qwen3", *kv_args])
    try:
        server.wait_ready()
        yield {"server": server, "ckpt": ckpt, "census_dir": census_dir, "tmp": root, "kv_setting": kv_setting}
    finally:
        server.stop()
        assert not _tagged_pids(server.tag), "server processes left behind"


@pytest.fixture(scope="module")
def e2e_root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def served(e2e_root, mixed_checkpoint):
    """One server on the good checkpoint (the session's, tests/conftest.py) for the agreement, census
    and chat tests."""
    yield from _serve(e2e_root, KV_SETTING, mixed_checkpoint)


@pytest.fixture
def served_bf16_kv(e2e_root, served, mixed_checkpoint):
    """A second server forced onto the bf16 KV path, where the main one keeps an FP8 cache, so
    both KV paths are proven on a host that has both. Up for its one test only, as the next one
    is: the main server stays up for the module, and no more than one is idle beside the test's
    (tests/_engine_servers.py)."""
    if _kv_resolved(served["census_dir"]) == "bfloat16":
        pytest.skip("the main server already runs the bf16 KV path on this host "
                    f"(QPN_TEST_KV_CACHE={KV_SETTING}); nothing more to prove here")
    yield from _serve(e2e_root, "bfloat16", mixed_checkpoint)


@pytest.fixture
def served_embedded_without_layers(e2e_root, mixed_checkpoint):
    """The same checkpoint bytes in the form whose config.json embeds MIXED_PRECISION without its
    quantized_layers map (ModelOpt keeps it in hf_quant_config.json only): vLLM reads the file for
    this form only under the name modelopt_mixed, so under "qpn" the registered config must read it
    from the folder itself (qpn_config.QPNConfig.maybe_update_config)."""
    import shutil

    from qpn.scripts.checkpoints.make_checkpoint import embedded_quantization_config

    ckpt = e2e_root / "embedded-without-layers"
    shutil.copytree(mixed_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    embedded = embedded_quantization_config(json.loads((ckpt / "hf_quant_config.json").read_text()))
    del embedded["quantized_layers"]
    config["quantization_config"] = embedded
    (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    yield from _serve(e2e_root, "checkpoint", ckpt, label="embedded-without-layers")


def _served_prompt_logprobs(server: Server, ids: list[int]) -> tuple[list[float], list[int]]:
    r = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1,
                                        "temperature": 0, "prompt_logprobs": 1})
    pl = r["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    chosen = [pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    top1 = [int(min(pl[i].items(), key=lambda kv: kv[1]["rank"])[0]) for i in range(1, len(ids))]
    return chosen, top1


def _kv_resolved(census_dir: Path) -> str:
    from qpn.fork_patches.route_census.census import aggregate

    (kv,) = aggregate(str(census_dir))["kv_resolved"]
    return kv["resolved"]


@pytest.mark.parametrize("kv_path", ["main", "bf16-forced", "embedded-without-layers"])
def test_served_logprobs_agree_with_float32_reference(kv_path, request):
    """Tolerance, and why: vLLM's CPU engine runs this model in bfloat16 (its gated-delta-net
    kernel accepts nothing else), which keeps 8 significant bits, so even an exact bf16
    implementation departs from float32. We measure that floor on the same positions by running
    the very reference in bfloat16, and allow twice it (mean and max of |delta log-prob| over the
    positions); the factor 2 covers the engine rounding at other points than transformers does.
    Two single decoding mistakes (NVFP4 nibbles swapped; fused FP8 shards collapsed to one scale
    without requantizing) are computed too and must land far outside the tolerance, so the
    tolerance is shown to catch the errors a loader can make.

    KV paths: where the engine keeps the checkpoint's FP8 KV cache (x86 with AVX-512/AMX), every
    reference variant, the bf16 floor included, stores K and V through e4m3 exactly as the engine
    does (scale, saturation, rounding toward zero: tests/test_kv_fp8_emulation.py pins that to the
    engine's op), so the floor is measured on the same KV path as the served run and the bound
    stays 2x that floor. The "bf16-forced" case serves the same checkpoint with
    --kv-cache-dtype bfloat16, so both paths are proven on such a host. "embedded-without-layers"
    serves the same bytes with config.json embedding the mixed config without its quantized_layers
    map: the registered QPN config must claim it, read the map from hf_quant_config.json and serve
    every listed module on QPN."""
    served = request.getfixturevalue({"main": "served", "bf16-forced": "served_bf16_kv",
                                      "embedded-without-layers": "served_embedded_without_layers"}[kv_path])
    server, ckpt, tmp = served["server"], served["ckpt"], served["tmp"]
    ids = server.post("/tokenize", {"model": SERVED_NAME, "prompt": PROMPT_TEXT, "add_special_tokens": False})["tokens"]
    assert len(ids) >= 65, "need at least 64 teacher-forced positions"
    got, top1 = _served_prompt_logprobs(server, ids)

    resolved = _kv_resolved(served["census_dir"])
    kv = "fp8_e4m3" if resolved.startswith("fp8") else "auto"
    assert resolved in ("fp8_e4m3", "bfloat16"), f"KV path {resolved!r} has no reference model"
    controls = ("swap-nibbles", "collapse-fp8-shards")
    refs = _references(ckpt, ids, tmp, ["float32", "bfloat16", *controls], kv)
    check_agreement(got, top1, refs, f"KV path {resolved} ({served['kv_setting']})", gross=controls)
    from qpn.fork_patches.route_census.census import aggregate

    (rank,) = aggregate(str(served["census_dir"]))["ranks"]
    layers = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert rank["quant_config"] == "qpn"  # claimed by the registered QPN config
    assert len(rank["engine_quantized_layers"]) == len(layers) and rank["declared_off_qpn"] == []


def test_census_every_quantized_module_on_qpn_and_zero_fallbacks(served):
    from qpn.fork_patches.route_census.census import aggregate
    from qpn.fork_patches.engine.kv_policy import cpu_lacks_fp8_kv
    from qpn.kernels.routes import QPN_ROUTES

    server, ckpt, census_dir = served["server"], served["ckpt"], served["census_dir"]
    # One prompt per route band (M = tokens in the step): 1-8, 9-16, 17-96, > 96, distinct so that
    # no prefix is shared, each followed by one decode step (M = 1).
    words = "north south east west river stone cloud field light music paper window".split()
    for n in (5, 12, 40, 130):
        ids = server.post("/tokenize", {"model": SERVED_NAME, "prompt": " ".join(words * 20),
                                        "add_special_tokens": False})["tokens"][:n]
        ids[0] = (ids[0] + n) % 400  # distinct first token: no prefix-cache hit between prompts
        server.post("/v1/completions", {"model": SERVED_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0})
    time.sleep(2.5)  # the census thread writes at most once per second
    agg = aggregate(str(census_dir))

    config = json.loads((ckpt / "config.json").read_text())
    n_gdn = config["layer_types"].count("linear_attention")
    n_attn = config["layer_types"].count("full_attention")
    expected = {"fp8": 2 * n_gdn + 2 * n_attn,  # in_proj_qkvz + out_proj | qkv_proj + o_proj
                "nvfp4": 2 * config["num_hidden_layers"] + 1}  # gate_up_proj + down_proj, lm_head
    print(json.dumps({k: agg[k] for k in ("modules_by_region", "modules_on_qpn", "modules_total",
                                          "route_counts", "fallback_calls", "lm_head", "kv_resolved")}, indent=1))
    (rank,) = agg["ranks"]
    assert rank["platform"] == "cpu" and rank["backend"] == "reference" and rank["engine_version"] == "0.32.0"
    assert rank["quant_config"] == "qpn"  # the registered QPN config claimed the checkpoint
    assert agg["modules_by_region"] == expected
    assert agg["modules_on_qpn"] == agg["modules_total"] == sum(expected.values())
    assert agg["fallback_calls"] == 0 and agg["fallbacks"] == [] and agg["non_qpn_routes"] == []
    assert set(agg["route_counts"]) <= QPN_ROUTES
    for family in ("qpn2", "qpn8"):
        for band in ("", "_mt2", "_chunked", "_reconstruct"):
            assert agg["route_counts"].get(family + band, {}).get("eager", 0) > 0, family + band
    assert all(c["graph"] == 0 for c in agg["route_counts"].values())  # --enforce-eager: no capture
    assert agg["lm_head"] == [{"module": "lm_head", "region": "nvfp4", "source": "checkpoint_codes",
                               "route_family": "qpn2", "repack_fallback": False}]
    (kv,) = agg["kv_resolved"]
    assert kv["checkpoint_requested"] == "fp8_e4m3"
    if KV_SETTING == "checkpoint":
        assert kv["resolved"] == ("bfloat16" if cpu_lacks_fp8_kv() else "fp8_e4m3")
    else:
        assert kv["resolved"] == KV_SETTING
    assert kv["policy"]


def test_chat_template_with_tools_and_thinking_switch(served):
    server = served["server"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    usage = {}
    for thinking in (True, False):
        r = server.post("/v1/chat/completions", {"model": SERVED_NAME, "messages": msgs, "tools": tools,
                                                 "max_tokens": 4, "temperature": 0,
                                                 "chat_template_kwargs": {"enable_thinking": thinking}})
        assert r["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
        usage[thinking] = r["usage"]["prompt_tokens"]
    # thinking off pre-fills "<think>\n\n</think>\n\n": a few more prompt tokens
    assert usage[False] > usage[True]


# Every kind is checked in-process, naming module and problem, by
# tests/test_loader_methods.py::test_malformed_checkpoint_fails_naming_module_and_problem. A real
# server boot (exit code, no process, port or partial file left) is paid once per stage at which
# the loader refuses: the quant-method choice (unknown-algo), create_weights (k-not-multiple),
# the per-shard completeness check (missing-scale) and the per-tensor dtype/shape/value check
# before prepack (nan-scale); wrong-scale-shape and inf-scale fail in that same per-tensor check.
MALFORMED_KINDS = ["missing-scale", "nan-scale", "unknown-algo", "k-not-multiple"]


def _boot_malformed(root: Path, kind: str) -> dict:
    """Write the malformed checkpoint, boot a server on it, wait for it to exit, stop it; what the
    test asserts on is collected here (exit code, log, leftover processes, whether the port still
    answers), after the server's own stop."""
    folder = root / kind
    folder.mkdir()
    ckpt = _make_checkpoint(folder / kind, malformed=kind)
    census_dir = folder / "census"
    server = Server(ckpt, census_dir)
    try:
        code = server.wait_exit()
        log = server.log_text()
    finally:
        server.stop()
    with socket.socket() as s:
        port_answers = s.connect_ex(("127.0.0.1", server.port)) == 0
    return {"code": code, "log": log, "leftover": _tagged_pids(server.tag), "port_answers": port_answers,
            "census_dir": census_dir, "folder": folder}


@pytest.fixture(scope="module")
def malformed_boots(tmp_path_factory) -> dict:
    """The four must-fail boots, two at a time: a boot that fails at load is mostly single-threaded
    interpreter start-up in three processes, so two overlap on a 2-core host at little more than
    the cost of one. Each kind still gets its own checkpoint, server, port and census folder."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("malformed")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {kind: pool.submit(_boot_malformed, root, kind) for kind in MALFORMED_KINDS}
        return {kind: f.result() for kind, f in futures.items()}


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_checkpoint_fails_cleanly(malformed_boots, kind):
    from qpn.scripts.checkpoints.make_checkpoint import MALFORMED

    bad = MALFORMED[kind]
    boot = malformed_boots[kind]
    code, log, census_dir = boot["code"], boot["log"], boot["census_dir"]
    assert code != 0, f"server exited 0 on a malformed checkpoint:\n{log[-4000:]}"
    assert "QPNCheckpointError" in log, log[-4000:]
    line = next(ln for ln in log.splitlines() if "QPNCheckpointError" in ln and bad.module in ln)
    assert bad.problem.lower() in line.lower(), line
    assert not boot["leftover"], "processes left behind"
    assert not boot["port_answers"]  # nothing listens on the port any more
    # The census folder holds no partial file; whatever it holds is complete JSON.
    if census_dir.exists():
        for f in census_dir.iterdir():
            assert not f.name.endswith(".tmp"), f
            json.loads(f.read_text())
    # The checkpoint folder is exactly what the generator wrote (no partial sibling).
    assert [p.name for p in boot["folder"].iterdir() if ".partial-" in p.name] == []
