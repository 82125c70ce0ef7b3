# SPDX-License-Identifier: MIT
# Wraps functions of vLLM (Apache-2.0, Copyright contributors to the vLLM project); see NOTICE.
"""Tool calls survive a cut (issue 40 item 5): when ``max_tokens`` (or the model length) ends an
answer in the middle of a tool call, the calls written before it still come back as calls.

What the engines did (vLLM 0.32, the cpu engine; 1Cat-vLLM 1.2.2 and 1.3.0, read from their
sources). A chat answer is parsed only once it is whole (``chat_completion_full_generator``), by
parsers that take the text for finished:

- **hermes calls** (``<tool_call>{...}</tool_call>``; on vLLM 0.32 also the format of
  ``tool_choice: "required"`` and of a named tool, whose grammar is the parser's own structural
  tag): ``Hermes2ProToolParser.extract_tool_calls`` reads every call with one ``json.loads`` each
  inside a ``try``; the cut call fails it, so no call is returned, and its caller (vLLM 0.32's
  ``DelegatingParser._extract_tool_calls``, 1Cat's ``OpenAIServing._parse_tool_calls_from_content``)
  returns the whole answer, complete calls included, as ``content``.
- **the JSON array of ``tool_choice: "required"``** (1Cat's path for hermes, and vLLM 0.32's for
  parsers without a structural tag): the array ``[{"name": ..., "parameters": ...}, ...]`` is
  validated as a whole with pydantic (``TypeAdapter(list[FunctionDefinition])``, errors
  suppressed): a cut array fails, and the answer has no call and no content. A cut named call on
  that path comes back as a call whose arguments are the cut, invalid JSON.
- **finish_reason**: with ``tool_choice: "auto"`` any parsed call turns the finish reason into
  ``tool_calls`` (vLLM 0.32 and 1Cat, not streamed; 1Cat streamed as well, for every choice but a
  named tool), so a cut answer whose complete calls are returned would say it was not cut.

What the overlay does, only for an answer the engine ended with ``finish_reason: length``:

- ``wrap_full_generator`` (every engine) tells the reading below which of the request's answers
  were cut (a context variable, set while the engine's function runs, filled from the engine's
  own outputs as they pass), and afterwards puts ``length`` back where the engine wrote
  ``tool_calls`` for a cut answer;
- ``wrap_extract_tool_calls`` (vLLM 0.32: ``DelegatingParser._extract_tool_calls``) and
  ``wrap_parse_tool_calls_from_content`` (1Cat: the static
  ``OpenAIServing._parse_tool_calls_from_content``), where the answer's content becomes calls,
  hand the engine's code the content up to the end of the last complete call (``cut_content``):
  for the hermes parser the cut call (from its ``<tool_call>``), a cut ``</tool_call>`` after a
  complete call and a cut ``<tool_call>`` at the very end are left out; for the Qwen3.x XML calls
  (qwen3_coder / qwen3_xml, the launcher's parser for the Qwen3.x templates; their parsers return a
  cut call as a call with its cut parameters dropped) every call without its ``</tool_call>``;
  on the JSON path the
  array is closed after its last complete element, and a cut named call is no call. The engine's
  code then builds calls and content as for any answer (the content it returns when no call is
  left is this text too, not the whole answer);
- ``wrap_stream_generator`` (1Cat only) puts ``length`` back in the streamed final chunk where 1Cat
  wrote ``tool_calls``. vLLM 0.32 keeps ``length`` there itself.

So a client sees, for a cut answer (``finish_reason: length``): not streamed, ``tool_calls`` holds
every call whose JSON was complete, in order, and nothing of the cut call; ``content`` holds what
it holds for an uncut answer (the text before the first call, less a cut ``<tool_call>`` tag at its
end; for a forced call nothing); the cut
call's tokens are counted in ``usage.completion_tokens`` and listed in ``logprobs`` when asked for.
Streamed, calls arrive as they are written, so the cut call has already been announced (its name,
then part of its arguments) when the cut comes: the final chunk says ``length``, and the last call
of such a stream is the cut one unless its arguments are complete JSON. Content never carries
call text, streamed or not. An answer that ended on its own (``stop``) is the engine's, unchanged.

Which answer was cut: the context variable holds the request's outputs; with one output (n = 1)
that is the answer; with several, the output whose text holds the parsed text, and none when
outputs with different finish reasons hold it (then the engine's reading stands).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json

from qpn.fork_patches.api.constrained_output import skip_json_space


class Outputs:
    """The finish reason and text of each output of one request, as the engine's results pass."""

    def __init__(self) -> None:
        self.reasons: dict[int, str | None] = {}
        self.texts: dict[int, str] = {}

    def record(self, request_output) -> None:
        # a non-streamed request's one result holds each output's whole text; a stream's results
        # hold deltas, of which only the finish reason is read
        for out in getattr(request_output, "outputs", None) or ():
            self.reasons[out.index] = out.finish_reason
            self.texts[out.index] = out.text or ""

    def reason(self, index: int) -> str | None:
        return self.reasons.get(index)

    def cut(self, text: str) -> bool:
        """Whether the answer ``text`` was parsed from (a part of it) ended with ``length``."""
        if len(self.reasons) == 1:
            return next(iter(self.reasons.values())) == "length"
        hits = {self.reasons[i] for i, t in self.texts.items() if text in t}
        return hits == {"length"}


OUTPUTS: contextvars.ContextVar[Outputs | None] = contextvars.ContextVar("qpn_tool_call_cut", default=None)


def answer_was_cut(text: str | None) -> bool:
    """True while the engine builds a chat answer whose output ``text`` belongs to was cut
    (``finish_reason: length``); False outside ``wrap_full_generator`` (streaming, other APIs)."""
    outputs = OUTPUTS.get()
    return outputs is not None and outputs.cut(text or "")


async def _recording(result_generator, outputs: Outputs):
    """The engine's results, unchanged, each recorded in ``outputs`` before it is passed on."""
    async for res in result_generator:
        outputs.record(res)
        yield res


# ---- where the complete part of a cut answer ends ---------------------------------------------

def json_end(text: str, i: int) -> int | None:
    """Just past the JSON object or array that opens at ``text[i]``, by brackets outside strings;
    None when the text ends first (the value was cut). The value is not validated."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest proper prefix of ``tag`` that ends ``text`` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def complete_hermes_part(text: str, tag: str = "<tool_call>", end_tag: str = "</tool_call>") -> str:
    """``text`` (a cut answer) up to the end of its last complete hermes call: from the cut call's
    ``tag`` on, a cut ``end_tag`` after a complete call, or a cut ``tag`` at the very end, nothing
    is kept. Text the scan cannot read as calls (a call that is not a JSON object) is returned
    from there on unchanged, for the engine to judge."""
    at = text.find(tag)
    if at == -1:
        return text[: len(text) - _tag_prefix_at_end(text, tag)]
    while at != -1:
        i = skip_json_space(text, at + len(tag))
        if i == len(text):
            return text[:at]  # the cut came right after the tag
        if text[i] != "{":
            return text
        end = json_end(text, i)
        if end is None:
            return text[:at]  # the cut call
        after = skip_json_space(text, end)
        if after == len(text):
            return text
        if text.startswith(end_tag, after):
            after += len(end_tag)
        elif end_tag.startswith(text[after:]):
            return text[:end]  # a complete call whose closing tag was cut
        else:
            return text
        nxt = text.find(tag, after)
        if nxt == -1:
            return text[: len(text) - _tag_prefix_at_end(text[after:], tag)]
        at = nxt
    return text


# The parsers of the XML calls Qwen3.x chat templates ask for (``<tool_call><function=NAME>
# <parameter=P>...</parameter></function></tool_call>``), which the launcher picks as qwen3_coder:
# vLLM 0.32 maps qwen3_coder and qwen3_xml to Qwen3EngineToolParser; 1Cat 1.2.2 / 1.3.0 to
# Qwen3CoderToolParser and Qwen3XMLToolParser (tests/test_tool_call_cut.py reads both registries).
# Each returns a cut call as a call, its cut or missing parameters dropped (vLLM 0.32 gave
# get_weather with arguments {} for a call cut inside its first value).
XML_CALL_PARSERS = ("Qwen3EngineToolParser", "Qwen3CoderToolParser", "Qwen3XMLToolParser")
XML_CALL_TAGS = ("<tool_call>", "</tool_call>")


def complete_xml_part(text: str, tag: str = XML_CALL_TAGS[0], end_tag: str = XML_CALL_TAGS[1]) -> str:
    """``text`` (a cut answer) up to the end of its last complete XML call: a call counts only
    with its closing ``end_tag``; from the first call without one on (the cut call), or a cut
    ``tag`` at the very end, nothing is kept."""
    at = text.find(tag)
    kept = 0 if at == -1 else at  # the end of the text to keep so far
    while at != -1:
        end = text.find(end_tag, at + len(tag))
        if end == -1:
            return text[:kept]  # the cut call
        kept = end + len(end_tag)
        at = text.find(tag, kept)
    return text[: len(text) - _tag_prefix_at_end(text[kept:], tag)]


def _is_xml_calls(tool_parser_cls) -> bool:
    return isinstance(tool_parser_cls, type) and any(
        c.__name__ in XML_CALL_PARSERS for c in tool_parser_cls.__mro__)


def complete_array_part(text: str) -> str:
    """``text`` (a cut ``tool_choice: "required"`` answer, a JSON array of calls) closed after its
    last complete element: ``[{...}, {...}, {"na`` gives ``[{...}, {...}]``, and an array with no
    complete element ``[]``. A closed array, or text that is not such an array, is returned
    unchanged."""
    start = skip_json_space(text, 0)
    if start == len(text) or text[start] != "[":
        return text
    j, last = start + 1, None
    while True:
        j = skip_json_space(text, j)
        if j == len(text):
            break
        c = text[j]
        if c == "]":
            return text
        if c == "," and last is not None:
            j += 1
            continue
        if c != "{":
            return text
        end = json_end(text, j)
        if end is None:
            break
        last = j = end
    return text[:last] + "]" if last is not None else text[:start] + "[]"


def _named_chat_choice(tool_choice) -> bool:
    """A chat request's named function choice (``{"type": "function", "function": {...}}``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

    return isinstance(tool_choice, ChatCompletionNamedToolChoiceParam)


def forced_complete_part(content: str | None, request) -> str | None:
    """The content the engine's JSON path for a forced call should read from a cut answer: for
    ``required``, the array closed after its last complete element; for a named function, the
    arguments object if it is complete, else None (no call)."""
    if content is None:
        return None
    if request.tool_choice == "required":
        return complete_array_part(content)
    if _named_chat_choice(request.tool_choice):
        i = skip_json_space(content, 0)
        if i == len(content) or (content[i] in "{[" and json_end(content, i) is None):
            return None
    return content


# ---- the wrappers ----------------------------------------------------------------------------

def wrap_full_generator(original):
    """``OpenAIServingChat.chat_completion_full_generator(self, request, result_generator, ...)``
    (vLLM 0.32 and 1Cat: the engine's results are the third parameter): the engine's function,
    with the results recorded as they pass and readable by the parsers (``answer_was_cut``)
    while it runs; then a cut answer's ``tool_calls`` finish reason goes back to ``length``."""

    @functools.wraps(original)
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        outputs = Outputs()
        token = OUTPUTS.set(outputs)
        try:
            response = await original(self, request, _recording(result_generator, outputs), *args, **kwargs)
        finally:
            OUTPUTS.reset(token)
        for choice in getattr(response, "choices", None) or ():
            if choice.finish_reason == "tool_calls" and outputs.reason(choice.index) == "length":
                choice.finish_reason = "length"
        return response

    return chat_completion_full_generator


def _is_hermes(tool_parser_cls) -> bool:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    return isinstance(tool_parser_cls, type) and issubclass(tool_parser_cls, Hermes2ProToolParser)


def cut_content(content: str | None, request, tool_parser_cls, json_forced: bool) -> str | None:
    """What the engine's tool-call reading should get of a cut answer's ``content``: on the JSON
    path of forced calls (``json_forced``: the parser takes them as JSON) ``forced_complete_part``;
    for the hermes parser the text up to its last complete call (``complete_hermes_part``), for the
    Qwen3.x XML-call parsers likewise (``complete_xml_part``); else,
    and for ``tool_choice: "none"``, the content as it is."""
    if content is None or request.tool_choice == "none":
        return content
    if json_forced and (request.tool_choice == "required" or _named_chat_choice(request.tool_choice)):
        return forced_complete_part(content, request)
    if _is_hermes(tool_parser_cls):
        return complete_hermes_part(content, tool_parser_cls.tool_call_start_token,
                                    tool_parser_cls.tool_call_end_token)
    if _is_xml_calls(tool_parser_cls):
        return complete_xml_part(content)
    return content


def wrap_extract_tool_calls(original):
    """vLLM 0.32's ``DelegatingParser._extract_tool_calls(self, content, request,
    enable_auto_tools=False)``, where a whole answer's content (after the reasoning) becomes tool
    calls and content: for a cut answer, the engine's code reads ``cut_content``."""

    @functools.wraps(original)
    def _extract_tool_calls(self, content, request, enable_auto_tools=False):
        parser = getattr(self, "_tool_parser", None)
        if parser is not None and answer_was_cut(content):
            content = cut_content(content, request, type(parser), parser.supports_required_and_named)
        return original(self, content, request, enable_auto_tools)

    return _extract_tool_calls


def wrap_parse_tool_calls_from_content(original):
    """1Cat's static ``OpenAIServing._parse_tool_calls_from_content(request, tokenizer,
    enable_auto_tools, tool_parser_cls, content=None)``: as ``wrap_extract_tool_calls`` (1Cat's
    JSON path for forced calls is taken where the class supports it, or there is none)."""
    func = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(func)
    def _parse_tool_calls_from_content(request, tokenizer, enable_auto_tools, tool_parser_cls, content=None):
        if answer_was_cut(content):
            json_forced = tool_parser_cls is None or tool_parser_cls.supports_required_and_named
            content = cut_content(content, request, tool_parser_cls, json_forced)
        return func(request, tokenizer, enable_auto_tools, tool_parser_cls, content)

    return staticmethod(_parse_tool_calls_from_content)


_TOOL_CALLS_FINISH = '"finish_reason":"tool_calls"'


def keep_length(line: str, outputs: Outputs) -> str:
    """A server-sent event of the chat stream with ``finish_reason: tool_calls`` turned back into
    ``length`` for each choice whose output the engine ended with ``length``; else unchanged."""
    if _TOOL_CALLS_FINISH not in line or not line.startswith("data: "):
        return line
    chunk = json.loads(line[len("data: "):])
    changed = False
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason") == "tool_calls" and outputs.reason(choice.get("index")) == "length":
            choice["finish_reason"] = "length"
            changed = True
    if not changed:
        return line
    return "data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def wrap_stream_generator(original):
    """1Cat's ``OpenAIServingChat.chat_completion_stream_generator(self, request,
    result_generator, ...)``: the engine's events, the engine's results recorded as they pass, and
    the final chunk of a cut answer saying ``length`` (``keep_length``)."""

    @functools.wraps(original)
    async def chat_completion_stream_generator(self, request, result_generator, *args, **kwargs):
        outputs = Outputs()
        events = original(self, request, _recording(result_generator, outputs), *args, **kwargs)
        async with contextlib.aclosing(events):
            async for line in events:
                yield keep_length(line, outputs)

    return chat_completion_stream_generator
