"""The one request policy of the OpenAI server: who may call which route, and what one request may
ask for. An ASGI middleware the launcher passes to vLLM
(``--middleware qpn.scripts.launcher.request_limits.RequestLimits``: vLLM's own extension point in
0.32 and both 1Cat builds, no engine code changed). It runs outside vLLM's own middleware, so every
request meets it first.

**Routes** (``ROUTES``, one table for every route of vLLM 0.32 and of 1Cat-vLLM 1.2.2 / 1.3.0):

- ``OPEN``: health and metrics probes, answered without the key;
- ``KEYED``: need the key, generate nothing (model list, tokenizer, stored responses, templates);
- ``GENERATE``: need the key and meet the limits below, read as that route's body is
  (chat, chat batch, completions with prompt arrays, responses, generative scoring);
- ``OFF``: answered 501 naming the route and what to use instead: admin and developer routes,
  other APIs whose bodies this policy does not read (SageMaker ``/invocations``, Anthropic
  ``/v1/messages``, token-in-token-out, structured decisions), and tasks the served models do not
  have (pooling, audio).

vLLM's own key check (``--api-key`` / ``VLLM_API_KEY``) covers the ``/v1``, ``/v2`` and
``/inference`` prefixes only, so ``/invocations`` and ``/generative_scoring`` generated for anyone;
with a key set, this middleware asks for it on every route but the ``OPEN`` ones. A route the app
has and the table does not name is ``OFF`` until it is classified (fail closed);
tests/test_route_policy.py builds the app's own route list and fails on any such route.

**Limits** of a generating request:

- sequences (``n`` or ``best_of``, times the prompts of a completions prompt array, the
  conversations of a chat batch, or the items of a scoring request) at most ``QPN_MAX_N`` (the
  launcher's ``MAX_N``, default 4). vLLM's own cap (``VLLM_MAX_N_SEQUENCES``, default 16384)
  lets one request occupy the server with thousands of sequences; the launcher also sets that
  variable to the same value, so the engine refuses what gets past here;
- ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` an integer, at most the model
  length (``QPN_MAX_MODEL_LEN``, the launcher's ``MML``). vLLM silently lowers a larger value to
  what the context leaves, and reads ``true`` as 1;
- chat messages as OpenAI's chat API defines them: a known role; ``content`` on system, developer,
  user and tool messages, and on an assistant message without tool calls; ``tool_call_id`` on a
  tool message. vLLM accepts all of these silently;
- the older guided-decoding fields (``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``, ...): the engines ignore them silently; refused, naming the
  ``structured_outputs`` key to send instead.

A refused request gets an OpenAI-style error body naming the parameter (400), the route (501) or
the missing key (401). Bodies that are not JSON go to vLLM untouched, which answers them itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass

# ---- the route table ------------------------------------------------------------------------
OPEN, KEYED, GENERATE, OFF = "open", "keyed", "generate", "off"


@dataclass(frozen=True)
class Route:
    access: str  # OPEN | KEYED | GENERATE | OFF
    body: str | None = None  # GENERATE: how the body is read (a key of BODY_READERS)
    why: str = ""  # OFF: why, and what to use instead


_ADMIN = Route(OFF, why="an engine administration route (vLLM's developer mode); this server "
                        "exposes no administration over HTTP: restart it through the launcher")
_NO_TASK = Route(OFF, why="a task the served model does not have (pooling / audio); the "
                          "launcher serves text generation: use /v1/chat/completions")
_USE_CHAT = "use /v1/chat/completions or /v1/completions, which meet this server's key and limits"

ROUTES: dict[str, Route] = {
    # probes: no key, nothing generated, nothing private
    **{p: Route(OPEN) for p in ("/health", "/ping", "/version", "/load", "/metrics", "/ready",
                                "/readyz")},
    # key needed, nothing generated
    **{p: Route(KEYED) for p in (
        "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info", "/server_info",
        "/get_world_size", "/is_paused", "/is_sleeping", "/is_scaling_elastic_ep",
        "/kv_event_sources", "/fault_tolerance/status", "/weight_info",
        "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
        "/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render",
        "/v1/messages/render", "/cohere/v2/chat/render", "/v1/chat/completions/derender",
        "/v1/completions/derender", "/v1/messages/count_tokens",
        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")},
    # generating: key and limits
    "/v1/chat/completions": Route(GENERATE, "chat"),
    "/v1/chat/completions/batch": Route(GENERATE, "chat_batch"),
    "/v1/completions": Route(GENERATE, "completion"),
    "/v1/responses": Route(GENERATE, "responses"),
    "/generative_scoring": Route(GENERATE, "scoring"),
    # generating routes whose bodies this policy does not read: off
    "/invocations": Route(OFF, why="SageMaker's dispatcher to the chat and completions handlers; "
                                   + _USE_CHAT),
    "/v1/messages": Route(OFF, why="Anthropic's messages API; " + _USE_CHAT),
    "/cohere/v2/chat": Route(OFF, why="Cohere's chat API; " + _USE_CHAT),
    "/inference/v1/generate": Route(OFF, why="token-in-token-out generation; " + _USE_CHAT),
    "/inference/v1/abort_requests": _ADMIN,
    "/generate": Route(OFF, why="the legacy demo server's route; " + _USE_CHAT),
    "/v1/systemone": Route(OFF, why="vLLM's structured-decisions API; " + _USE_CHAT
                                    + " with structured_outputs"),
    **{p: _NO_TASK for p in (
        "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
        "/v1/embeddings", "/v2/embed", "/v1/audio/transcriptions", "/v1/audio/translations",
        "/v1/realtime")},
    **{p: _ADMIN for p in (
        "/abort_requests", "/collective_rpc", "/pause", "/resume", "/sleep", "/wake_up",
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/start_profile",
        "/stop_profile", "/update_weights", "/start_weight_update", "/finish_weight_update",
        "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
        "/start_draft_weight_update", "/update_weight_version", "/weight_checker",
        "/release_kv_cache_memory", "/scale_elastic_ep", "/fault_tolerance/apply",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter")},
}

_UNCLASSIFIED = Route(OFF, why="a route volta-qpn's request policy does not classify yet "
                               "(scripts/launcher/request_limits.py ROUTES), so it is off")


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$")


_TEMPLATES = [(_template_regex(t), t) for t in ROUTES if "{" in t]


def route_template(path: str) -> str | None:
    """The table's template for a request path (``/v1/responses/abc`` -> ``/v1/responses/{response_id}``)."""
    if path in ROUTES:
        return path
    return next((t for rx, t in _TEMPLATES if rx.match(path)), None)


def app_has_route(app, scope) -> bool:
    """Whether the app the request reached (Starlette puts it in the scope) has a route for it."""
    router = getattr(app, "router", None)
    from starlette.routing import Match

    for route in getattr(router, "routes", ()):
        try:
            match, _ = route.matches(scope)
        except Exception:  # a route kind that cannot judge this scope
            continue
        if match != Match.NONE:
            return True
    return False


def route_for(path: str, scope=None) -> Route | None:
    """The policy of a request path; ``None`` for a path the app has no route for (vLLM answers
    404 itself); ``_UNCLASSIFIED`` (off) for a route the app has and the table does not name."""
    template = route_template(path)
    if template is not None:
        return ROUTES[template]
    app = (scope or {}).get("app")
    if app is not None and app_has_route(app, scope):
        return _UNCLASSIFIED
    return None


# ---- the limits --------------------------------------------------------------------------------
DEFAULT_MAX_N = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
COUNT_FIELDS = ("n", "best_of") + TOKEN_FIELDS
# The older guided-decoding fields: vLLM 0.32 and both 1Cat builds no longer read them on these
# endpoints (not in their request models) and accept them silently, so a client that sends one gets
# unconstrained output. Each is refused naming the structured_outputs key that does the same.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
                 "guided_decoding_backend": None}
# OpenAI's chat roles (function: the deprecated form of tool); the chat templates know no others.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Roles whose message must carry content (an assistant's may be tool calls instead).
CONTENT_REQUIRED = ("system", "developer", "user", "tool", "function")


def as_count(value: object) -> int | None:
    """``value`` read as the engine's pydantic model reads an integer field in lax mode: an int, a
    float with no fraction, or a string of an int (``"5"``); None for anything else (bools too)."""
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


Problem = tuple[str, str]  # (parameter, message)


def _chat_messages(messages: object, where: str) -> Problem | None:
    """OpenAI's rules for a conversation's messages, which vLLM does not enforce."""
    if not isinstance(messages, list):
        return None  # vLLM's request model refuses a non-list itself
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            continue  # vLLM's request model refuses it
        role = m.get("role")
        if role not in CHAT_ROLES:
            return f"{at}.role", (f"{at} has role {json.dumps(role)}, which is not a chat role; use "
                                  f"one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if content is None and (role in CONTENT_REQUIRED or not (
                m.get("tool_calls") or m.get("function_call"))):
            need = ("content" if role in CONTENT_REQUIRED else "content or tool_calls")
            return f"{at}.content", (f"{at} ({role}) has no {need}; OpenAI's chat API requires it "
                                     "(send an empty string for an empty message)")
        if role == "tool" and not m.get("tool_call_id"):
            return f"{at}.tool_call_id", (
                f"{at} has role 'tool' but no tool_call_id; give the id of the assistant's tool "
                "call this message answers (OpenAI's chat API requires it)")
    return None


def _prompt_count(prompt: object) -> int:
    """Prompts in a completions ``prompt``: a string or a token list is one, a list of them many."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _per_prompt(body: dict) -> int:
    counts = [as_count(body.get(name)) for name in ("n", "best_of")]
    return max([c for c in counts if c is not None] + [1])


# How each generating route's body says how many sequences it asks for: (parameter, count).
def _chat_sequences(body: dict) -> tuple[str, int]:
    return "n", _per_prompt(body)


def _batch_sequences(body: dict) -> tuple[str, int]:
    conversations = body.get("messages")
    return "messages", (len(conversations) if isinstance(conversations, list) else 1) * _per_prompt(body)


def _completion_sequences(body: dict) -> tuple[str, int]:
    prompts = _prompt_count(body.get("prompt"))
    return ("prompt" if prompts > 1 else "n"), prompts * _per_prompt(body)


def _scoring_sequences(body: dict) -> tuple[str, int]:
    items = body.get("items")
    return "items", len(items) if isinstance(items, list) else 1


BODY_READERS = {"chat": _chat_sequences, "chat_batch": _batch_sequences,
                "completion": _completion_sequences, "responses": lambda body: ("n", 1),
                "scoring": _scoring_sequences}


class Limits:
    def __init__(self, max_n: int = DEFAULT_MAX_N, max_model_len: int | None = None):
        self.max_n = max_n
        self.max_model_len = max_model_len

    @classmethod
    def from_env(cls) -> "Limits":
        max_n = _env_int("QPN_MAX_N")
        return cls(DEFAULT_MAX_N if max_n is None else max_n, _env_int("QPN_MAX_MODEL_LEN"))

    def problem(self, body: object, kind: str = "chat") -> Problem | None:
        """(parameter, message) for the first rule a ``kind`` request body breaks, else None."""
        if not isinstance(body, dict):
            return None
        for name, key in GUIDED_FIELDS.items():
            if name in body:
                fix = (f'send "structured_outputs": {{"{key}": ...}} instead' if key else
                       "the server chooses the backend (vLLM's --structured-outputs-config); "
                       "drop the field")
                return name, (f"{name} is ignored by this engine, so the output would not be "
                              f"constrained; {fix}")
        for name in COUNT_FIELDS:
            value = body.get(name)
            if value is not None and as_count(value) is None:
                return name, f"{name}={json.dumps(value)} is not an integer; send a whole number"
        if kind == "chat":
            found = _chat_messages(body.get("messages"), "messages")
            if found:
                return found
        elif kind == "chat_batch" and isinstance(body.get("messages"), list):
            for c, conversation in enumerate(body["messages"]):
                found = _chat_messages(conversation, f"messages[{c}]")
                if found:
                    return found
        for name in ("n", "best_of"):
            value = as_count(body.get(name))
            if value is not None and value > self.max_n:
                return name, (f"{name}={value} is more than this server serves per request "
                              f"(at most {self.max_n}); send several requests, or start the "
                              f"server with a higher MAX_N")
        param, sequences = BODY_READERS[kind](body)
        if sequences > self.max_n:
            return param, (f"this request asks for {sequences} sequences ({param} times n), more "
                           f"than this server serves per request (at most {self.max_n}); send "
                           "several requests, or start the server with a higher MAX_N")
        if self.max_model_len:
            for name in TOKEN_FIELDS:
                value = as_count(body.get(name))
                if value is not None and value > self.max_model_len:
                    return name, (f"{name}={value} is more than the model length "
                                  f"({self.max_model_len} tokens, prompt included); ask for at "
                                  f"most {self.max_model_len} or start the server with a "
                                  "larger MML")
        return None


def error_body(param: str | None, message: str, status: int = 400,
               kind: str = "BadRequestError") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}, "object": "error", "message": message,
                       "type": kind, "param": param, "code": status}).encode()


def authorised(scope, api_keys: list[str]) -> bool:
    """The check vLLM's own AuthenticationMiddleware makes (``Authorization: Bearer <key>``, the
    scheme in any case), applied here to every route that is not a probe."""
    if not api_keys:
        return True
    value = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode("utf-8")).digest())
               for k in api_keys)


async def _answer(send, status: int, payload: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class RequestLimits:
    """Pure ASGI middleware: the route's access first (401 without the key, 501 for a route that
    is off), then, for a POST to a generating route, the body buffered and judged (400 naming the
    parameter), else vLLM gets the same bytes."""

    def __init__(self, app, limits: Limits | None = None, api_keys: list[str] | None = None):
        self.app = app
        self.limits = limits or Limits.from_env()
        self.api_keys = ([k for k in [os.environ.get("VLLM_API_KEY", "")] if k]
                         if api_keys is None else api_keys)

    async def __call__(self, scope, receive, send):
        if scope.get("type") not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", "") or "") or "/"
        route = route_for(path, scope)
        if route is None or route.access == OPEN:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # only /v1/realtime, which is off
            if route.access == OFF or not authorised(scope, self.api_keys):
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if not authorised(scope, self.api_keys):
            await _answer(send, 401, json.dumps({"error": "Unauthorized"}).encode())
            return
        if route.access == OFF:
            message = f"{path} is turned off on this server: {route.why}"
            await _answer(send, 501, error_body(None, message, 501, "NotImplementedError"))
            return
        if route.access != GENERATE or scope.get("method") != "POST":
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
            found = self.limits.problem(json.loads(body), route.body)
        except RecursionError:  # nested deeper than the interpreter parses: a client error
            found = ("body", "the request body nests JSON deeper than this server parses; "
                            "send a flatter body")
        except ValueError:
            found = None  # not JSON: vLLM answers that itself
        if found is not None:
            await _answer(send, 400, error_body(*found))
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
