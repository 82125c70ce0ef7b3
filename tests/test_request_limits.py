"""Request limits (issue 12 item 3) at the ASGI layer: what is refused, with which message, and
that an accepted request reaches vLLM byte for byte. The same middleware against a real server:
tests/test_launcher_api.py."""
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
    # booleans are not counts; a missing model length leaves max_tokens to vLLM
    assert Limits(max_n=1).problem({"n": True, "max_tokens": 10 ** 9}) is None


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
                                           (4.0, False), ("five", False), (True, False),
                                           (4.5, False), (None, False)])
def test_counts_are_read_as_the_engine_reads_them(value, refused):
    """A numeric string or an integral float is a count to the engine (pydantic lax mode), so
    it is one to the limit too; what the engine refuses anyway passes to it untouched."""
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", "n": value}).encode())
    assert (status == 400) is refused, (value, payload)
    assert (forwarded is None) is refused


@pytest.mark.parametrize("depth", [2000, 10000])
def test_a_deeply_nested_body_gets_a_400_not_a_500(depth):
    body = ('{"model": "m", "messages": ' + "[" * depth + "]" * depth + "}").encode()
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096), body)
    assert status == 400 and forwarded is None
    assert "nests JSON deeper" in json.loads(payload)["error"]["message"]


@pytest.mark.parametrize("header,limited", [
    (None, False), (b"Bearer wrong", False), (b"Basic s3cret", False), (b"Bearer s3cret ", False),
    (b"Bearer s3cret", True), (b"bearer s3cret", True)])
def test_only_an_authorised_request_meets_the_limits(header, limited):
    """With a key set, a request vLLM would refuse (no key, another key, another scheme) passes to
    vLLM untouched, whose authentication answers 401; only a request with the key is judged."""
    headers = [(b"authorization", header)] if header else []
    status, payload, forwarded = _call(Limits(max_n=4, max_model_len=4096),
                                       json.dumps({"model": "m", "n": 50}).encode(),
                                       api_keys=["s3cret"], headers=headers)
    assert (status == 400) is limited and (forwarded is None) is limited, (header, payload)


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
