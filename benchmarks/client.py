"""Streaming chat client for OpenAI-compatible endpoints, timed chunk by chunk.

Plain HTTP (httpx) and a hand-read SSE stream, so that the time of every chunk is the
time the bytes arrived, with no client library buffering in between. Every sampling field
is sent explicitly: an engine accepts unknown fields silently and fills missing ones from
the model card, so a request that leaves a field out measures whatever the server chose.

Text arrives in three delta fields: ``reasoning`` (vLLM 0.32 with a reasoning parser),
``reasoning_content`` (older engines, the SM70 one among them) and ``content``. The first
chunk carrying text in ANY of them is the first token: reading only ``content`` would put
time-to-first-token after the whole thinking phase.

The parse of a stream (``parse_stream``) is a pure function of timestamped SSE lines, so a
recorded stream can be replayed in tests without a server.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterable

TEXT_FIELDS = ("reasoning", "reasoning_content", "content")
REASONING_FIELDS = ("reasoning", "reasoning_content")


class BenchError(RuntimeError):
    """A failure the user can act on; the message names the problem and the fix."""


class ServerUnreachable(BenchError):
    pass


class ModelNotServed(BenchError):
    pass


class StreamCut(BenchError):
    pass


class MetricsUnavailable(BenchError):
    pass


@dataclass(frozen=True)
class Sampling:
    """Every field an engine would otherwise fill from its own defaults."""

    temperature: float
    top_p: float
    top_k: int  # -1 = disabled (accepted by old and new vLLM; 0.32 maps it to 0)
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    thinking: bool
    reasoning_effort: str | None = None

    def request_fields(self) -> dict:
        kwargs = {"enable_thinking": self.thinking}
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "chat_template_kwargs": kwargs,
        }

    def label(self) -> str:
        top_k = "disabled" if self.top_k in (-1, 0) else str(self.top_k)
        effort = f", reasoning_effort {self.reasoning_effort}" if self.reasoning_effort else ""
        return (f"temperature {self.temperature}, top_p {self.top_p}, top_k {top_k}, "
                f"presence_penalty {self.presence_penalty}, frequency_penalty "
                f"{self.frequency_penalty}, seed {self.seed}, max_tokens {self.max_tokens}, "
                f"thinking {'on' if self.thinking else 'off'}{effort}")

    def with_(self, **changes) -> "Sampling":
        fields = dict(self.__dict__)
        fields.update(changes)
        return Sampling(**fields)


@dataclass
class StreamResult:
    """One streamed completion. Times are seconds on one monotonic clock."""

    t_sent: float
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    chunk_kinds: list[str] = field(default_factory=list)  # "reasoning" | "content"
    reasoning_text: str = ""
    content_text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    done: bool = False  # the [DONE] sentinel arrived
    t_end: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.t_sent if self.chunk_times else None

    @property
    def decode_s(self) -> float | None:
        """First text chunk to last text chunk: decode only, prefill excluded."""
        if len(self.chunk_times) < 2:
            return None
        return self.chunk_times[-1] - self.chunk_times[0]

    @property
    def e2e_s(self) -> float | None:
        return (self.chunk_times[-1] - self.t_sent) if self.chunk_times else None

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None and self.completion_tokens is not None


def parse_stream(t_sent: float, lines: Iterable[tuple[float, str]]) -> StreamResult:
    """Fold timestamped SSE lines (``(t, "data: {...}")``) into a StreamResult.

    Blank lines, comments and non-data fields are ignored. An error object inside the stream
    (vLLM sends ``{"error": ...}`` when generation fails mid-way) raises StreamCut.
    """
    res = StreamResult(t_sent=t_sent)
    for t, line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            res.done = True
            res.t_end = t
            break
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as e:
            raise StreamCut(f"the server sent a malformed stream chunk ({e}): {payload[:200]!r}")
        if "error" in obj:
            err = obj["error"]
            text = err.get("message", err) if isinstance(err, dict) else err
            raise StreamCut(
                f"the server failed while generating and reported inside the stream: {text!r}. "
                f"The engine may have died: read the server log, restart the server and rerun; "
                f"rows finished before this one are kept.")
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            # Engines in the renaming period send the same text under both reasoning names:
            # take one of them, never both.
            reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
            content = delta.get("content") or ""
            if reasoning or content:
                res.chunk_times.append(t)
                res.chunk_kinds.append("content" if content else "reasoning")
                res.reasoning_text += reasoning
                res.content_text += content
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
        usage = obj.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens")
            details = usage.get("completion_tokens_details") or {}
            res.reasoning_tokens = details.get("reasoning_tokens")
        res.t_end = t
    return res


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /metrics and /version live)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class ChatClient:
    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 600.0):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def close(self) -> None:
        self._http.close()

    # -- endpoint discovery ------------------------------------------------------------
    def _get(self, url: str):
        import httpx

        try:
            return self._http.get(url)
        except httpx.ConnectError as e:
            raise ServerUnreachable(
                f"cannot reach the server at {url} ({e}). Start the server, or pass the right "
                f"--base-url (it ends in /v1, e.g. http://127.0.0.1:8000/v1).") from None
        except httpx.TimeoutException:
            raise ServerUnreachable(
                f"the server at {url} did not answer in time. Check that it finished booting "
                f"(GET /v1/models answers) and that --base-url points at it.") from None
        except httpx.TransportError as e:
            raise ServerUnreachable(
                f"the connection to {url} failed ({type(e).__name__}: {e}); the server stopped "
                f"answering. Check the server log, restart it and rerun.") from None

    def list_models(self) -> list[dict]:
        r = self._get(self.base_url + "/models")
        if r.status_code != 200:
            raise ServerUnreachable(
                f"GET {self.base_url}/models answered HTTP {r.status_code}: {r.text[:200]}. "
                f"--base-url must point at an OpenAI-compatible API root (ending in /v1).")
        return r.json().get("data", [])

    def check_model(self) -> dict:
        """The /v1/models entry of our model, or ModelNotServed naming what is served."""
        models = self.list_models()
        for m in models:
            if m.get("id") == self.model:
                return m
        served = ", ".join(repr(m.get("id")) for m in models) or "none"
        raise ModelNotServed(
            f"model {self.model!r} is not served at {self.base_url} (served: {served}). "
            f"Pass --model with one of the served names.")

    def engine_version(self) -> str:
        r = self._get(root_url(self.base_url) + "/version")
        if r.status_code == 200:
            try:
                return str(r.json().get("version", "unknown"))
            except ValueError:
                pass
        return f"unknown (GET /version answered HTTP {r.status_code})"

    # -- one streamed completion ------------------------------------------------------
    def stream_chat(self, messages: list[dict], sampling: Sampling) -> StreamResult:
        import httpx

        body = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling.request_fields(),
        }
        url = self.base_url + "/chat/completions"
        lines: list[tuple[float, str]] = []
        t_sent = time.perf_counter()
        try:
            with self._http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    text = r.read().decode(errors="replace")
                    if r.status_code == 404 and "model" in text.lower():
                        raise ModelNotServed(
                            f"the server rejected model {self.model!r} (HTTP 404: {text[:200]}). "
                            f"Pass --model with a name listed by GET {self.base_url}/models.")
                    if r.status_code == 400:
                        raise BenchError(
                            f"the server refused the request (HTTP 400: {text[:300]}). Usually "
                            f"prompt + --max-tokens exceeds the server's max model len, or a "
                            f"sampling value is out of range: lower --max-tokens or fix the field.")
                    raise BenchError(f"POST {url} answered HTTP {r.status_code}: {text[:300]}")
                for line in r.iter_lines():
                    lines.append((time.perf_counter(), line))
        except httpx.ConnectError as e:
            raise ServerUnreachable(
                f"cannot reach the server at {url} ({e}). Start the server, or pass the right "
                f"--base-url.") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            partial = parse_stream(t_sent, lines)
            raise StreamCut(
                f"the stream from {url} was cut after {len(partial.chunk_times)} text chunks "
                f"({type(e).__name__}: {e}); the server probably died or restarted. Check the "
                f"server log, restart it, and rerun; rows finished before this one are kept."
            ) from None
        except httpx.TimeoutException:
            raise StreamCut(
                f"the stream from {url} stalled past the client timeout after "
                f"{len(lines)} lines. Check the server log; raise --timeout if the model is "
                f"legitimately slow.") from None
        except httpx.TransportError as e:
            raise StreamCut(
                f"the request to {url} failed in transport ({type(e).__name__}: {e}) after "
                f"{len(lines)} stream lines; the server probably died. Check the server log and "
                f"rerun; rows finished before this one are kept.") from None
        res = parse_stream(t_sent, lines)
        if not res.done or not res.complete:
            missing = [n for n, ok in (("[DONE]", res.done), ("finish_reason", res.finish_reason),
                                       ("usage", res.completion_tokens is not None)) if not ok]
            raise StreamCut(
                f"the stream from {url} ended without {', '.join(missing)} after "
                f"{len(res.chunk_times)} text chunks; the server probably died mid-request "
                f"(usage needs stream_options.include_usage, which this client sends). Check "
                f"the server log and rerun; rows finished before this one are kept.")
        return res
