"""One policy for every route (issue 40 items 1 and 4): the request policy's route table
(scripts/launcher/request_limits.py ``ROUTES``) against the routes the engines really have, and a
sweep of every route of a served app with minimal, empty and one-token bodies, with and without the
key, at K = 0 and K = 3: no answer is a 5xx, no request kills the engine core, nothing generates
without the key.

Where the route lists come from: the cpu engine's app is built in this process from the very
argument list the launcher starts the server with (vLLM's own ``build_app``: the app's route list,
not a hand list); 1Cat-vLLM's routes are read from its two source archives (every ``@router.post``
/ ``get`` / ``api_route`` / ``add_api_route`` with a literal path under ``vllm/entrypoints``).
"""
from __future__ import annotations

import ast
import json
import os
import urllib.error
import urllib.request

import pytest

from qpn.scripts.launcher import request_limits
from qpn.scripts.launcher.request_limits import GENERATE, OFF, OPEN, ROUTES, route_for
from tests._ci import onecat_source

ENGINE_PYTHON = os.environ.get("QPN_ENGINE_PYTHON")
KEY = "route-sweep-key"


def launcher_args(k: int, tool_parser: str | None = "hermes", mml: int = 2048) -> list[str]:
    """The server's argument list as the launcher builds it (after ``-m <module>``)."""
    from qpn.scripts.launcher import serve

    launch = serve.Launch(
        ckpt="/nonexistent", extra_args=[], k=k, mns=4, mml=mml, gmu=None, tp=None,
        host="127.0.0.1", port=1, capture=None, python="python", profile=serve.PROFILES["cpu"],
        engine_version="0.32.0", served_name="m", tool_parser=tool_parser, thinking=True,
        api_key=KEY, run_dir="/nonexistent", boot_timeout=1, max_n=4)
    cmd = serve.server_command(launch)
    return cmd[cmd.index("-m") + 2:]


def app_routes(args: list[str]) -> dict[str, set[str]]:
    """path -> methods of the app vLLM builds for ``args`` (its own build_app and arg parser)."""
    pytest.importorskip("vllm.entrypoints.launchers.app")
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    app = build_app(parsed, ("generate",))
    routes: dict[str, set[str]] = {}
    for route in app.routes:
        methods = getattr(route, "methods", None) or {"WEBSOCKET" if "websocket" in type(
            route).__name__.lower() else "GET"}
        routes.setdefault(route.path, set()).update(methods - {"HEAD"})
    return routes


def source_routes(files) -> set[str]:
    """Literal route paths declared under vllm/entrypoints in an engine's source files."""
    found = set()
    for text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("post", "get", "put", "delete", "patch", "api_route",
                                           "add_api_route", "websocket")
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith("/")):
                found.add(node.args[0].value)
    return found


# ---- the table covers every route (fast) ---------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("k,tool_parser", [(0, None), (3, "hermes")])
def test_every_route_of_the_served_app_is_classified(k, tool_parser):
    """A route the app has and the table does not name would answer 501 at run time (fail
    closed); here it fails the suite, so that a new engine's generating route is classified on
    purpose. A plausible bug, a row dropped from the table, fails it (checked below)."""
    routes = app_routes(launcher_args(k, tool_parser))
    assert "/v1/chat/completions" in routes and "/invocations" in routes  # the list is real
    unclassified = sorted(p for p in routes if request_limits.route_template(p) is None)
    assert not unclassified, f"routes the request policy does not classify: {unclassified}"


@pytest.mark.fast
def test_a_dropped_row_is_caught(monkeypatch):
    routes = app_routes(launcher_args(3))
    monkeypatch.delitem(ROUTES, "/generative_scoring")
    assert [p for p in routes if request_limits.route_template(p) is None] == ["/generative_scoring"]


@pytest.mark.fast
@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_every_route_of_the_1cat_sources_is_classified(version):
    src = onecat_source(version)
    routes = source_routes(text for rel, text in src.files.items()
                           if rel.startswith("entrypoints/") and rel.endswith(".py"))
    assert {"/v1/chat/completions", "/invocations", "/generative_scoring"} <= routes
    unclassified = sorted(p for p in routes if request_limits.route_template(p) is None)
    assert not unclassified, f"1Cat {version} routes the policy does not classify: {unclassified}"


@pytest.mark.fast
def test_the_generating_routes_are_keyed_and_limited():
    """Every route that starts sequences is GENERATE (key and limits) or OFF; the probes that
    need no key generate nothing."""
    generating = {"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/completions",
                  "/v1/responses", "/generative_scoring", "/invocations", "/v1/messages",
                  "/inference/v1/generate", "/v1/systemone", "/cohere/v2/chat", "/generate"}
    for path in generating:
        assert ROUTES[path].access in (GENERATE, OFF), path
    assert {p for p, r in ROUTES.items() if r.access == OPEN} == {
        "/health", "/ping", "/version", "/load", "/metrics", "/ready", "/readyz"}
    assert route_for("/v1/responses/resp_9/cancel").access == "keyed"


# ---- the sweep on served apps (engine) -----------------------------------------------------------
def _request(url: str, method: str, body: bytes | None, key: str | None, timeout: float = 120):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _one_token_text(base: str, model: str) -> str:
    """A prompt the served tokenizer reads as one token (the issue's one-token prompt)."""
    for text in ("hi", "a", "the", "I", "x", "1"):
        status, raw = _request(base + "/tokenize", "POST", json.dumps(
            {"model": model, "prompt": text, "add_special_tokens": False}).encode(), KEY)
        assert status == 200, raw
        if json.loads(raw)["count"] == 1:
            return text
    raise AssertionError("no one-token prompt among the candidates")


def _bodies(model: str, word: str) -> dict[str, bytes | None]:
    one = {"model": model, "prompt": word, "messages": [{"role": "user", "content": word}],
           "input": word, "query": word, "items": [word], "label_token_ids": [1, 2],
           "max_tokens": 2, "max_output_tokens": 2, "text": word}
    return {"empty": b"", "minimal": json.dumps({"model": model}).encode(),
            "one-token": json.dumps(one).encode()}


@pytest.fixture(scope="module", params=[0, 3], ids=["K0", "K3"])
def keyed_server(request, tmp_path_factory, mixed_checkpoint):
    if not ENGINE_PYTHON:
        pytest.skip("QPN_ENGINE_PYTHON (the cpu engine's python) is not set")
    from qpn.scripts.launcher.launched import LaunchedServer
    from tests._server import free_port, worker_cpu_bind

    k = request.param
    tmp = tmp_path_factory.mktemp(f"route-sweep-k{k}")
    env = {key: v for key, v in os.environ.items()
           if key not in ("HOST", "PORT", "K", "MNS", "MML", "CAPTURE", "ENGINE", "MAX_N")}
    env.update(QPN_ENGINE_PYTHON=ENGINE_PYTHON, K=str(k), MML="2048", VLLM_API_KEY=KEY,
               RUN_DIR=str(tmp / "run"), VLLM_CACHE_ROOT=str(tmp / "vllm"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PORT=str(free_port()),
               **worker_cpu_bind())
    server = LaunchedServer(str(mixed_checkpoint), env=env)
    server.start()
    yield k, server
    if server.proc.poll() is None:
        server.stop()


@pytest.mark.engine
@pytest.mark.slow
def test_every_route_answers_without_a_5xx_and_the_engine_lives(keyed_server):
    k, server = keyed_server
    base = server.url.removesuffix("/v1")
    word = _one_token_text(base, server.model)
    routes = app_routes(launcher_args(k))
    failures, unkeyed_served = [], []
    for path, methods in sorted(routes.items()):
        if "WEBSOCKET" in methods:
            continue
        url = base + path.replace("{response_id}", "resp_missing")
        for method in sorted(methods):
            bodies = _bodies(server.model, word) if method == "POST" else {"none": None}
            for name, body in bodies.items():
                for key in (KEY, None):
                    status, raw = _request(url, method, body, key)
                    if status >= 500 and status != 501:
                        failures.append(f"{method} {path} {name} key={bool(key)}: {status} {raw[:300]!r}")
                    if status == 501:
                        assert ROUTES[path].access == OFF, (path, raw)
                    if key is None and ROUTES[path].access not in (OPEN,) and status != 401:
                        unkeyed_served.append(f"{method} {path} {name}: {status}")
                    # the engine core is alive after every request
                    assert server.proc.poll() is None, (path, name, server.output[-3000:])
    assert _request(base + "/health", "GET", None, None)[0] == 200
    assert not failures, "\n".join(failures)
    assert not unkeyed_served, "answered without the key:\n" + "\n".join(unkeyed_served)


@pytest.mark.engine
@pytest.mark.slow
def test_the_requests_that_killed_the_engine_are_served(keyed_server):
    """The issue's three: /generative_scoring, logprob_token_ids on chat, a one-token prompt;
    each answered 200 with the named tokens' log-probabilities, and the server still serves."""
    k, server = keyed_server
    base = server.url.removesuffix("/v1")
    word = _one_token_text(base, server.model)
    status, raw = _request(base + "/generative_scoring", "POST", json.dumps(
        {"model": server.model, "query": word, "items": ["b"], "label_token_ids": [1, 2]}).encode(),
        KEY)
    assert status == 200, raw
    scores = json.loads(raw)
    assert scores["data"] and all(0.0 <= d["score"] <= 1.0 for d in scores["data"]), scores
    status, raw = _request(base + "/v1/chat/completions", "POST", json.dumps(
        {"model": server.model, "messages": [{"role": "user", "content": "Count: 1 2 3"}],
         "max_tokens": 6, "logprobs": True, "logprob_token_ids": [11, 12],
         "chat_template_kwargs": {"enable_thinking": False}}).encode(), KEY)
    assert status == 200, raw
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    assert content
    for step in content:
        ids = {t["token"] for t in step["top_logprobs"]}
        assert len(step["top_logprobs"]) >= 2, step  # the two named tokens (and the sampled one)
        assert all(lp["logprob"] <= 0.0 for lp in step["top_logprobs"]), step
        assert ids, step
    status, raw = _request(base + "/v1/completions", "POST", json.dumps(
        {"model": server.model, "prompt": word, "max_tokens": 8}).encode(), KEY)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["finish_reason"] in ("length", "stop")
    assert server.proc.poll() is None and _request(base + "/health", "GET", None, None)[0] == 200
    assert "API key required on every route but the probes" in server.output
    # and no generation without the key on the routes vLLM's own check leaves open
    for path in ("/generative_scoring", "/invocations"):
        assert _request(base + path, "POST", json.dumps({"model": server.model}).encode(),
                        None)[0] == 401
