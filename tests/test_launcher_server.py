"""The launcher and the demonstration against a real vLLM server on the cpu engine.

Boots three servers in all, to keep CI time down: the demonstration (which also writes the
checkpoint the other tests reuse), one server whose boot gate must fail, and one module-scoped
server for the API features and the load test. Every server is started through
serve-qwen38-native.sh and must leave no process behind.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import urllib.error
import urllib.request

import pytest

from qpn.scripts.launcher.engine_profiles import EngineNotFound, detect_engine
from qpn.scripts.launcher.launched import REPO_ROOT, LaunchedServer, group_alive
from tests._server import free_port, worker_cpu_bind

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON") or os.path.join(REPO_ROOT, ".venv-cpu",
                                                                     "bin", "python")
API_KEY = "launcher-test-key"


def _engine_or_skip() -> str:
    try:
        profile, _ = detect_engine(ENGINE_PYTHON)
    except EngineNotFound as exc:
        pytest.skip(f"no cpu engine: {exc}")
    if profile.name != "cpu":
        pytest.skip(f"these tests serve on the cpu engine, {ENGINE_PYTHON} has {profile.name}")
    return ENGINE_PYTHON


def _env(tmp: str, **over) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOST", "PORT", "K", "MNS", "MML", "CAPTURE", "VLLM_API_KEY", "ENGINE")}
    env.update(QPN_ENGINE_PYTHON=_engine_or_skip(), VLLM_CACHE_ROOT=os.path.join(tmp, "vllm"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               # a free port, not the launcher's default 8000: another test file's server may be up
               # at the same time (scripts/test.sh runs two files side by side)
               PORT=str(free_port()), **worker_cpu_bind(int(over.get("TP", 1))))
    env.update(over)
    return env


# ---- the demonstration -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("demo"))
    env = _env(tmp, ENV_PREFIX=os.path.dirname(os.path.dirname(ENGINE_PYTHON)),
               DEMO_DIR=tmp, K="3")
    env.pop("QPN_ENGINE_PYTHON")  # the demonstration finds its engine the way a user's does
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "demo.sh")],
                          capture_output=True, text=True, env=env, timeout=1500)
    return proc, tmp


@pytest.fixture(scope="module")
def ckpt(demo):
    path = os.path.join(demo[1], "qwen38-mini-mixed")
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.fail(f"the demonstration wrote no checkpoint:\n{demo[0].stdout}{demo[0].stderr}")
    return path


def test_demonstration_path(demo):
    proc, _ = demo
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # MTP at K=3, depth read from the server's /metrics
    assert re.search(r"served_depth\s+PASS\s.*\s3 positions", out), out
    for gate in ("warm_request", "census_platform", "qpn_routes", "lm_head_from_codes"):
        assert re.search(rf"^{gate}\s+PASS\s", out, re.M), (gate, out)
    # both requests answered, census summary printed
    answer = re.search(r"answer \((\d+) tokens", out)
    assert answer and int(answer.group(1)) > 0, out
    streamed = re.search(r"streamed (\d+) chunks", out)
    assert streamed and int(streamed.group(1)) > 0, out
    assert re.search(r"quantized modules: \d+ \(fp8 \d+, nvfp4 \d+\), on a QPN route", out)
    assert "fallback calls: 0" in out
    # clean shutdown, nothing of the server group left
    pid = int(re.search(r"server pid (\d+) and its children are gone", out).group(1))
    assert not group_alive(pid)


# ---- a boot gate that fails ------------------------------------------------------------------

def test_depth_the_server_does_not_serve_fails_the_gate(ckpt, tmp_path_factory):
    # Ask for K=3, but let a pass-through argument (last one wins in vLLM's parser) make the
    # engine serve 2 draft tokens: the gate reads the depth from /metrics and must catch it.
    # A short folder name: the engine's ZMQ socket lives in the run directory, and a Unix socket
    # path must stay under 108 bytes (tmp_path's test-named folder under an xdist worker is not).
    tmp_path = tmp_path_factory.mktemp("depth")
    env = _env(str(tmp_path), K="3", RUN_DIR=str(tmp_path / "run"))
    override = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    server = LaunchedServer(ckpt, env=env, extra_args=["--speculative-config", override])
    with pytest.raises(RuntimeError, match="did not report READY"):
        server.start()
    out = server.output
    assert server.proc.returncode == 1, out
    assert "GATE FAILED: served_depth" in out and "2 positions" in out, out
    assert "BOOT GATES FAILED" in out
    assert server.server_pid is not None and not server.leftover(), out
    gates = json.loads((tmp_path / "run" / "gates.json").read_text())
    assert gates["passed"] is False
    assert {g["name"]: g["status"] for g in gates["gates"]}["served_depth"] == "FAIL"


# ---- API features and load on one server -----------------------------------------------------

@pytest.fixture(scope="module")
def api(ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    env = _env(str(tmp), K="2", MNS="4", RUN_DIR=str(tmp / "run"), VLLM_API_KEY=API_KEY)
    server = LaunchedServer(ckpt, env=env)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.stop()


@pytest.fixture(scope="module")
def client(api):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=api.url, api_key=API_KEY, max_retries=0, timeout=300)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "strict": True,  # vLLM then holds the arguments to the schema
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _args_ok(arguments: str) -> None:
    parsed = json.loads(arguments)
    assert set(parsed) == {"city"} and parsed["city"] in ("Paris", "Rome"), arguments


def test_api_server_gates_passed_at_depth_2(api):
    with open(api.gates_json) as f:
        gates = json.load(f)
    assert gates["passed"] is True and gates["k"] == 2 and gates["capture_sizes"] == [3, 6, 9, 12]
    depth = {g["name"]: g for g in gates["gates"]}["served_depth"]
    # the gate reports the served depth and the drafts proposed since the warm request
    m = re.fullmatch(r"2 positions; (\d+) drafts, (\d+) draft tokens", depth["observed"])
    assert depth["status"] == "PASS" and m and int(m.group(2)) > 0, depth["observed"]
    assert "capture sizes: [3, 6, 9, 12]" in api.output  # printed at launch


def test_api_key_guards_v1(api):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(api.url + "/models", timeout=10)
    assert err.value.code == 401


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_call_non_streaming(client, api, choice):
    reply = client.chat.completions.create(
        model=api.model, messages=ASK, tools=[WEATHER], tool_choice=choice,
        parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=3,
        extra_body=NO_THINKING)
    calls = reply.choices[0].message.tool_calls
    assert calls and len(calls) == 1, reply
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert calls[0].id
    _args_ok(calls[0].function.arguments)
    assert reply.choices[0].finish_reason in ("tool_calls", "stop")


def test_tool_call_streaming(client, api):
    stream = client.chat.completions.create(
        model=api.model, messages=ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=3, stream=True,
        extra_body=NO_THINKING)
    names: dict[int, list] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            names.setdefault(call.index, []).append(call.function.name if call.function else None)
            if call.function and call.function.arguments:
                arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    assert list(names) == [0], names
    # the name arrives once, first, and is never the empty string some parsers stream
    assert names[0][0] == "get_weather"
    assert all(n is None for n in names[0][1:]), names[0]
    _args_ok(arguments[0])
    assert finish == "tool_calls"


def test_json_schema_output_is_valid(client, api):
    schema = {"type": "object",
              "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                             "celsius": {"type": "integer", "minimum": -50, "maximum": 60}},
              "required": ["city", "celsius"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=api.model, messages=ASK, max_tokens=400, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "weather",
                                                               "schema": schema}},
        extra_body=NO_THINKING)
    assert reply.choices[0].finish_reason == "stop", reply
    doc = json.loads(reply.choices[0].message.content)
    assert set(doc) == {"city", "celsius"} and doc["city"] in ("Paris", "Rome")
    assert isinstance(doc["celsius"], int) and -50 <= doc["celsius"] <= 60


def test_sixteen_concurrent_streams(client, api):
    results: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            chunks, finish = 0, None
            stream = client.chat.completions.create(
                model=api.model, messages=[{"role": "user", "content": f"Story number {i}."}],
                max_tokens=24, temperature=0.8, seed=i, stream=True)
            for chunk in stream:
                if chunk.choices:
                    chunks += 1
                    finish = chunk.choices[0].finish_reason or finish
            results[i] = (chunks, finish)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sorted(results) == list(range(16))
    errors = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not errors, errors
    assert all(chunks > 0 and finish in ("stop", "length") for chunks, finish in results.values())
    assert api.proc.poll() is None  # the launcher (and so the server) is still up
    assert client.models.list().data[0].id == api.model


def test_api_server_stops_cleanly(api):
    # last in this module: the launcher stops its server on SIGTERM and exits 0
    assert api.stop() == 0, api.output
    assert "no process of its group is left" in api.output
    assert not api.leftover()
