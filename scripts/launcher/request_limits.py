"""Per-request limits for the OpenAI server, as an ASGI middleware the launcher passes to vLLM
(``--middleware qpn.scripts.launcher.request_limits.RequestLimits``: vLLM's own extension point in 0.32 and
both 1Cat builds, no engine code changed).

What one request may ask for:

- ``n`` and ``best_of`` at most ``QPN_MAX_N`` (the launcher's ``MAX_N``, default 4). vLLM's own
  cap (``VLLM_MAX_N_SEQUENCES``, default 16384) lets one request occupy the server with
  thousands of sequences; the launcher also sets that variable to the same value, so the engine
  refuses what gets past here. vLLM 0.32's chat endpoint ignores ``best_of``; a large value is
  still refused so that a client learns it asked for work it will not get.
- ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` at most the model length
  (``QPN_MAX_MODEL_LEN``, the launcher's ``MML``). vLLM silently lowers a larger value to what
  the context leaves; a request that asks for more than the whole context is a client error.
- the prompt: vLLM itself refuses a prompt longer than the model length with a 400 naming both;
- a ``tool`` message without ``tool_call_id``: OpenAI's chat API requires it, vLLM accepts the
  message silently and the chat template then cannot tie the result to its call;
- the older guided-decoding fields (``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``, ...): the engines ignore them silently; refused, naming the
  ``structured_outputs`` key to send instead.

A refused request gets HTTP 400 with an OpenAI-style error body naming the parameter, the
value, the limit and the setting that changes it. Anything else (bodies that are not JSON,
other paths) goes to vLLM untouched.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets

LIMITED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
DEFAULT_MAX_N = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# The older guided-decoding fields: vLLM 0.32 and both 1Cat builds no longer read them on these
# endpoints (not in their request models) and accept them silently, so a client that sends one gets
# unconstrained output. Each is refused naming the structured_outputs key that does the same.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
                 "guided_decoding_backend": None}


def as_count(value: object) -> int | None:
    """``value`` read as the engine's pydantic model reads an integer field in lax mode: an int, a
    float with no fraction, or a string of an int (``"5"``); None for anything else (bools too),
    which the engine then refuses itself."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else None


class Limits:
    def __init__(self, max_n: int = DEFAULT_MAX_N, max_model_len: int | None = None):
        self.max_n = max_n
        self.max_model_len = max_model_len

    @classmethod
    def from_env(cls) -> "Limits":
        max_n = _env_int("QPN_MAX_N")
        return cls(DEFAULT_MAX_N if max_n is None else max_n, _env_int("QPN_MAX_MODEL_LEN"))

    def problem(self, body: object) -> tuple[str, str] | None:
        """(parameter, message) for the first limit the request breaks, else None."""
        if not isinstance(body, dict):
            return None
        for name, key in GUIDED_FIELDS.items():
            if name in body:
                fix = (f'send "structured_outputs": {{"{key}": ...}} instead' if key else
                       "the server chooses the backend (vLLM's --structured-outputs-config); "
                       "drop the field")
                return name, (f"{name} is ignored by this engine, so the output would not be "
                              f"constrained; {fix}")
        messages = body.get("messages")
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(m, dict) and m.get("role") == "tool" and not m.get("tool_call_id"):
                return f"messages[{i}].tool_call_id", (
                    f"messages[{i}] has role 'tool' but no tool_call_id; give the id of the "
                    "assistant's tool call this message answers (OpenAI's chat API requires it)")
        for name in ("n", "best_of"):
            value = as_count(body.get(name))
            if value is not None and value > self.max_n:
                return name, (f"{name}={value} is more than this server serves per request "
                              f"(at most {self.max_n}); send several requests, or start the "
                              f"server with a higher MAX_N")
        if self.max_model_len:
            for name in TOKEN_FIELDS:
                value = as_count(body.get(name))
                if value is not None and value > self.max_model_len:
                    return name, (f"{name}={value} is more than the model length "
                                  f"({self.max_model_len} tokens, prompt included); ask for at "
                                  f"most {self.max_model_len} or start the server with a "
                                  "larger MML")
        return None


def error_body(param: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}, "object": "error", "message": message,
                       "type": "BadRequestError", "param": param, "code": 400}).encode()


def authorised(scope, api_keys: list[str]) -> bool:
    """The check vLLM's own AuthenticationMiddleware makes (``Authorization: Bearer <key>``, the
    scheme in any case), so that limits are judged only for requests vLLM would serve."""
    if not api_keys:
        return True
    value = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode("utf-8")).digest())
               for k in api_keys)


class RequestLimits:
    """Pure ASGI middleware: buffers the body of a POST to a generation endpoint, refuses it with
    400 when it breaks a limit, else hands vLLM the same bytes. vLLM adds this middleware outside
    its own authentication, so a request without the server's key (``VLLM_API_KEY``, the launcher's
    way to set one) goes to vLLM untouched and gets vLLM's 401, never a limit message."""

    def __init__(self, app, limits: Limits | None = None, api_keys: list[str] | None = None):
        self.app = app
        self.limits = limits or Limits.from_env()
        self.api_keys = ([k for k in [os.environ.get("VLLM_API_KEY", "")] if k]
                         if api_keys is None else api_keys)

    async def __call__(self, scope, receive, send):
        if (scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in LIMITED_PATHS or not authorised(scope, self.api_keys)):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            found = self.limits.problem(json.loads(body))
        except RecursionError:  # nested deeper than the interpreter parses: a client error
            found = ("body", "the request body nests JSON deeper than this server parses; "
                            "send a flatter body")
        except ValueError:
            found = None  # not JSON: vLLM answers that itself
        if found is not None:
            payload = error_body(*found)
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
