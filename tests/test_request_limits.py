"""The request policy (issue 12 item 3, issue 40 items 4 and 6) at the ASGI layer: who may call which
route, what is refused with which message, and that an accepted request reaches vLLM byte for byte.
The same middleware against real servers: tests/test_launcher_api.py, tests/test_route_policy.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from qpn.scripts.launcher.request_limits import DEFAULT_MAX_N, Limits, RequestLimits

pytestmark = pytest.mark.fast


def _call(mw_limits: Limits, body: bytes, path="/v1/chat/completions", api_keys=(), headers=()):
    seen = {}

    async def app(scope, receive, send):
        got, more = [], True
        while more:
            m = await receive()
            got.append(m.get("body", b""))
            more = m.get("more_body", False)
        seen["body"] = b"".join(got)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[: len(body) // 2], body[len(body) // 2:]]  # the body arrives in two reads
    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
             for i, p in enumerate(parts)]

    async def receive():
        return queue.pop(0)

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
    asyncio.run(RequestLimits(app, mw_limits, api_keys=list(api_keys))(scope, receive, send))
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, payload, seen.get("body")


@pytest.mark.parametrize("field,value", [("n", 50), ("n", 1000), ("best_of", 5)])
def test_n_and_best_of_capped(field, value):
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", field: value}).encode())
    assert status == 400 and forwarded is None
    err = json.loads(payload)["error"]
    assert err["param"] == field and f"{field}={value}" in err["message"]
    assert "at most 4" in err["message"] and "MAX_N" in err["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_max_tokens_bounded_by_model_length(field):
    status, payload, _ = _call(Limits(max_n=4, max_model_len=4096),
                               json.dumps({field: 4097}).encode())
    assert status == 400
    err = json.loads(payload)["error"]
    assert err["param"] == field and "4096" in err["message"] and "MML" in err["message"]


def test_within_limits_passes_unchanged():
    body = json.dumps({"model": "m", "n": 4, "best_of": 4, "max_tokens": 4096,
                       "messages": [{"role": "user", "content": "x" * 1000}]}).encode()
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096), body)
    assert (status, payload, forwarded) == (200, b"ok", body)


def test_other_paths_and_non_json_untouched():
    status, _, forwarded = _call(Limits(max_n=1), b'{"n": 9}', path="/tokenize")
    assert status == 200 and forwarded == b'{"n": 9}'
    status, _, forwarded = _call(Limits(max_n=1), b"not json{")
    assert status == 200 and forwarded == b"not json{"
    # a path the app has no route for goes to vLLM (its 404), key or not
    status, _, forwarded = _call(Limits(max_n=1), b'{"n": 9}', path="/no/such/route",
                                 api_keys=["k"])
    assert status == 200 and forwarded == b'{"n": 9}'
    # a missing model length leaves max_tokens to vLLM
    assert Limits(max_n=1).problem({"max_tokens": 10 ** 9}) is None


def test_defaults_from_env(monkeypatch):
    monkeypatch.delenv("QPN_MAX_N", raising=False)
    monkeypatch.delenv("QPN_MAX_MODEL_LEN", raising=False)
    lim = Limits.from_env()
    assert (lim.max_n, lim.max_model_len) == (DEFAULT_MAX_N, None)
    monkeypatch.setenv("QPN_MAX_N", "2")
    monkeypatch.setenv("QPN_MAX_MODEL_LEN", "1024")
    lim = Limits.from_env()
    assert (lim.max_n, lim.max_model_len) == (2, 1024)


def test_launcher_passes_the_middleware_and_limits(tmp_path):
    from qpn.scripts.launcher import serve

    launch = serve.Launch(
        ckpt=str(tmp_path), extra_args=[], k=0, mns=1, mml=2048, gmu=None, tp=None,
        host="127.0.0.1", port=1, capture=None, python="python",
        profile=serve.PROFILES["cpu"], engine_version="0.32.0", served_name="m",
        tool_parser=None, thinking=True, api_key=None, run_dir=str(tmp_path), boot_timeout=1,
        max_n=3)
    cmd = serve.server_command(launch)
    assert cmd[cmd.index("--middleware") + 1] == "qpn.scripts.launcher.request_limits.RequestLimits"
    env = serve.server_env(launch)
    assert env["QPN_MAX_N"] == env["VLLM_MAX_N_SEQUENCES"] == "3"
    assert env["QPN_MAX_MODEL_LEN"] == "2048"


@pytest.mark.parametrize("value,refused", [("5", True), (" 5 ", True), (5.0, True), ("4", False),
                                           (4.0, False), ("five", True), (True, True),
                                           (False, True), (4.5, True), ([4], True), (None, False)])
def test_counts_are_read_as_the_engine_reads_them(value, refused):
    """A numeric string or an integral float is a count to the engine (pydantic lax mode), so
    it is one to the limit too; anything else that is not an integer (true, 4.5, "five") is
    refused naming the field: the engine would read true as 1 and serve it."""
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", "n": value}).encode())
    assert (status == 400) is refused, (value, payload)
    assert (forwarded is None) is refused
    if refused:
        assert json.loads(payload)["error"]["param"] == "n"


@pytest.mark.parametrize("depth", [2000, 10000])
def test_a_deeply_nested_body_gets_a_400_not_a_500(depth):
    body = ('{"model": "m", "messages": ' + "[" * depth + "]" * depth + "}").encode()
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096), body)
    assert status == 400 and forwarded is None
    assert "nests JSON deeper" in json.loads(payload)["error"]["message"]


@pytest.mark.parametrize("header,authorised", [
    (None, False), (b"Bearer wrong", False), (b"Basic s3cret", False), (b"Bearer s3cret ", False),
    (b"Bearer s3cret", True), (b"bearer s3cret", True)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generative_scoring",
                                  "/v1/chat/completions/batch", "/tokenize", "/invocations"])
def test_the_key_guards_every_route_but_the_probes(header, authorised, path):
    """With a key set, a request without it (no key, another key, another scheme) gets 401 on
    every route that is not a probe, /generative_scoring and /invocations included (vLLM's own
    check guards /v1, /v2 and /inference only); no limit message reaches it. With the key, the
    limits judge it (or the route answers 501 when it is off)."""
    headers = [(b"authorization", header)] if header else []
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", "n": 50}).encode(),
                                       api_keys=["s3cret"], headers=headers, path=path)
    assert forwarded is None or path == "/tokenize", (path, header, payload)
    if not authorised:
        assert (status, json.loads(payload)) == (401, {"error": "Unauthorized"})
    elif path == "/tokenize":
        assert status == 200
    elif path == "/invocations":
        assert status == 501 and "/v1/chat/completions" in json.loads(payload)["error"]["message"]
    else:
        assert status == 400, payload
    for probe in ("/health", "/ping", "/metrics", "/version"):
        assert _call(Limits(), b"", api_keys=["s3cret"], headers=headers, path=probe)[0] == 200


@pytest.mark.parametrize("field,key", [("guided_json", "json"), ("guided_regex", "regex"),
                                       ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                                       ("guided_whitespace_pattern", "whitespace_pattern"),
                                       ("guided_decoding_backend", None)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_ignored_guided_fields_are_refused_naming_the_replacement(field, key, path):
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", field: ["a", "b"]}).encode(), path=path)
    assert status == 400 and forwarded is None
    err = json.loads(payload)["error"]
    assert err["param"] == field and "ignored" in err["message"]
    if key:
        assert f'"structured_outputs": {{"{key}"' in err["message"]


def test_the_engines_request_models_do_not_read_the_guided_fields():
    """The premise, on the installed engine: no chat or completion request field is named
    guided_* except the batch chat request's guided_decoding_backend."""
    chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    for model in (chat.ChatCompletionRequest, completion.CompletionRequest):
        assert not [f for f in model.model_fields if f.startswith("guided_")], model


@pytest.mark.parametrize("tool_msg,refused", [
    ({"role": "tool", "content": "18C"}, True), ({"role": "tool", "content": "18C", "tool_call_id": ""}, True),
    ({"role": "tool", "content": "18C", "tool_call_id": "call_1"}, False),
    ({"role": "user", "content": "hi"}, False)])
def test_a_tool_message_needs_its_call_id(tool_msg, refused):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": "w", "arguments": "{}"}}]},
                tool_msg]
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", "messages": messages}).encode())
    assert (status == 400) is refused and (forwarded is None) is refused
    if refused:
        assert json.loads(payload)["error"]["param"] == "messages[2].tool_call_id"


@pytest.mark.parametrize("path,body,param,sequences", [
    ("/v1/completions", {"prompt": ["a"] * 50, "n": 4}, "prompt", 200),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 3}, "prompt", 6),
    ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "a"}]] * 40},
     "messages", 40),
    ("/generative_scoring", {"query": "a", "items": ["b"] * 9, "label_token_ids": [1, 2]},
     "items", 9)])
def test_sequences_are_counted_across_prompts_conversations_and_items(path, body, param, sequences):
    """50 prompts x n=4 are 200 sequences, not 4: every generating route counts what it starts."""
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", **body}).encode(), path=path)
    assert status == 400 and forwarded is None
    err = json.loads(payload)["error"]
    assert err["param"] == param and f"{sequences} sequences" in err["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2}),
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6], "n": 4}),  # one prompt of token ids
    ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "a"}]] * 4}),
    ("/generative_scoring", {"query": "a", "items": ["b"] * 4, "label_token_ids": [1, 2]})])
def test_sequences_within_the_limit_pass(path, body):
    raw = json.dumps({"model": "m", **body}).encode()
    assert _call(Limits(max_n=4, max_model_len=4096), raw, path=path) == (200, b"ok", raw)


@pytest.mark.parametrize("path", ["/v1/chat/completions/batch", "/generative_scoring"])
def test_guided_fields_are_refused_on_every_generating_route(path):
    status, payload, forwarded = _call(Limits(), json.dumps(
        {"model": "m", "guided_choice": ["a"], "messages": [[{"role": "user", "content": "a"}]],
         "items": ["b"]}).encode(), path=path)
    assert status == 400 and json.loads(payload)["error"]["param"] == "guided_choice"


@pytest.mark.parametrize("messages,param", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system", "content": "s"}, {"role": "developer"}], "messages[1].content"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "messages[1].content"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c"}], "messages[2].content")])
def test_chat_messages_follow_the_chat_api(messages, param):
    status, payload, forwarded = _call(Limits(), json.dumps({"model": "m", "messages": messages}).encode())
    assert status == 400 and forwarded is None, payload
    assert json.loads(payload)["error"]["param"] == param
    batch = _call(Limits(), json.dumps({"model": "m", "messages": [messages]}).encode(),
                  path="/v1/chat/completions/batch")
    assert batch[0] == 400 and json.loads(batch[1])["error"]["param"] == param.replace(
        "messages[", "messages[0][", 1)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "c", "content": "18C"}, {"role": "assistant", "content": "ok"}]])
def test_well_formed_conversations_pass(messages):
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    assert _call(Limits(), raw) == (200, b"ok", raw)


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("max_tokens", "many"),
                                         ("max_completion_tokens", 1.5),
                                         ("max_output_tokens", False)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_token_counts_must_be_integers(field, value, path):
    status, payload, forwarded = _call(Limits(), json.dumps(
        {"model": "m", field: value, "messages": [{"role": "user", "content": "a"}]}).encode(),
        path=path)
    assert status == 400 and forwarded is None
    err = json.loads(payload)["error"]
    assert err["param"] == field and "not an integer" in err["message"]


@pytest.mark.parametrize("path,why", [("/invocations", "/v1/chat/completions"),
                                      ("/v1/messages", "/v1/chat/completions"),
                                      ("/collective_rpc", "administration"),
                                      ("/v1/embeddings", "task")])
def test_routes_that_are_off_answer_501_naming_the_route(path, why):
    status, payload, forwarded = _call(Limits(), b'{"model": "m"}', path=path)
    assert status == 501 and forwarded is None
    message = json.loads(payload)["error"]["message"]
    assert message.startswith(f"{path} is turned off") and why in message


def test_a_route_the_table_does_not_name_is_off():
    """Fail closed: a route the app has (Starlette puts the app in the scope) that the table
    does not classify answers 501; a path the app has no route for still reaches vLLM's 404."""
    from fastapi import FastAPI

    from qpn.scripts.launcher.request_limits import route_for

    app = FastAPI()

    @app.post("/v9/new_generate")
    async def new_generate():
        return {}

    scope = {"type": "http", "method": "POST", "path": "/v9/new_generate", "app": app}
    assert route_for("/v9/new_generate", scope).access == "off"
    assert route_for("/v9/other", {**scope, "path": "/v9/other"}) is None
    assert route_for("/v1/responses/resp_1").access == "keyed"
