# SPDX-License-Identifier: MIT
# Wraps functions of vLLM (Apache-2.0, Copyright contributors to the vLLM project); see NOTICE.
"""Constrained output kept: what the server returns under a JSON schema, a choice, a regex or a
forced tool call is valid for its constraint, or it says it is not (``finish_reason: length``).

vLLM applies a request's grammar only to the answer, not to the reasoning before it: while the
model thinks, every token is allowed, and the grammar starts after the reasoning ends. Four faults
of the engines we serve follow from that, and from the tool-call paths (found 2026-12-02 on the cpu
engine, vLLM 0.32, with the issue-29 matrix; docs/serving.md "Constrained output" lists them); a
fifth is xgrammar's own:

- **A stop or a tool-call token inside the reasoning.** The qwen3 reasoning parser takes
  ``<tool_call>`` as an implicit end of reasoning and hands that token to the grammar as the
  answer's first token; a JSON schema or a choice cannot take it, the scheduler logs ``grammar
  rejected tokens [508]`` and ends the request with a 500. A stop token inside the reasoning ends
  the request with ``finish_reason: stop`` and no answer at all: an empty, invalid 200.
  ``wrap_fill_bitmasks`` (told each request's stop tokens by ``wrap_grammar_bitmask``) keeps, in
  the rows the grammar does not constrain yet (reasoning), every token but those two kinds where
  the grammar could not begin with them: a stop token when the grammar needs content, the
  tool-call token when the grammar cannot start with it (a forced tool call's grammar starts with
  it and keeps it). ``</think>``, the explicit end, stays allowed.
- **/v1/completions is never constrained from its first token.** The engine decides from the
  prompt whether the reasoning has ended; the chat front end passes its decision, the completions
  front end passes none, and a raw prompt holds no ``</think>``, so the whole completion counts as
  reasoning and stays unconstrained. ``wrap_grammar_init`` marks the reasoning as ended for a
  request whose front end decided nothing and whose prompt opens no reasoning block.
- **A non-strict tool's arguments need not be an object.** vLLM 0.32 builds a forced call's
  structural tag with ``get_function_parameters``, which gives ``True`` (any JSON value) for a tool
  without ``strict``: arguments such as ``false`` or ``10``. ``wrap_get_function_parameters`` turns
  ``True`` into ``{"type": "object"}``: the arguments stay free, but an object.
- **The hermes parser drops a complete call, or re-serializes it as non-JSON.** Its regex ends a
  call at the first ``</tool_call>``, also one inside a JSON string, so the JSON is cut, the parse
  fails, no call is returned and the raw text lands in ``content``; and it re-serializes the
  arguments with ``json.dumps``, which writes a number too large for a float (``1e999``) as
  ``Infinity``. ``wrap_hermes_extract_tool_calls`` reads each call with the JSON decoder itself
  (the call ends where its JSON ends) and keeps the model's own text for arguments that
  ``json.dumps`` could not write as JSON. Streamed, the parser splits the text so far into calls
  at the first ``</tool_call>`` too; ``wrap_hermes_tool_call_jsons`` hides the ones inside strings
  from that split.
- **Raw control characters inside JSON strings** (U+0000-U+001F, which JSON allows only escaped;
  issue 40 item 2). xgrammar 0.2.8 keeps them out of a plain ``{"type": "string"}`` but writes a
  string with ``minLength`` or ``maxLength`` (anywhere in a schema, a strict tool's parameters
  included) from a character class that lets 30 of the 32 through raw and takes no escape, and
  its ``json-pointer`` formats take them with raw quotes and backslashes: strict answers ended
  ``stop`` with invalid JSON. ``wrap_xgrammar_backend_init`` wraps the backend's compiler in
  ``C0SafeCompiler``, which replaces those classes in the grammar it compiles. The forms
  tests/test_constrained_output.py compiles through the engine's backend are listed in
  docs/serving.md "Constrained output". (Raw control characters seen before issue 40 in answers
  to unbounded strings came from the drafted rows' garbage temperatures that
  fork_patches/spec/spec_sampling.py fixes.)
"""
from __future__ import annotations

import functools
import json
import logging
import sys

# The tag the qwen3 reasoning parsers of vLLM 0.32 and 1Cat-vLLM 1.2.2/1.3.0 take as an implicit end
# of reasoning (qwen3_reasoning_parser.py, parser/qwen3.py); the Qwen3.x chat templates' tool call.
TOOL_CALL_TAG = "<tool_call>"
BAN_ATTR = "_qpn_reasoning_bans"
STOP_ATTR = "_qpn_stop_token_ids"

logger = logging.getLogger(__name__)


def _token_id(manager, text: str) -> int | None:
    """The id of ``text`` as one token of the manager's tokenizer, or None; looked up once per
    manager (a large vocabulary's ``get_vocab()`` is a fresh dict each call)."""
    cache = manager.__dict__.setdefault("_qpn_token_ids", {})
    if text not in cache:
        tokenizer = getattr(manager, "tokenizer", None)
        cache[text] = None if tokenizer is None else tokenizer.get_vocab().get(text)
    return cache[text]


def _banned_in_reasoning(manager, grammar, row) -> list[int]:
    """Stop and tool-call tokens the grammar cannot begin with, read from the grammar's own mask at
    its start, which is filled into ``row`` for the reading and the row then given back every token
    (as the engine left it). Cached per grammar: during the reasoning the grammar has accepted
    nothing, so its start mask is the mask now."""
    bans = getattr(grammar, BAN_ATTR, None)
    if bans is not None:
        return bans
    candidates = set(getattr(grammar, STOP_ATTR, ()))
    ctx = getattr(grammar, "ctx", None)
    info = getattr(ctx, "tokenizer_info", None)
    candidates.update(getattr(info, "stop_token_ids", None) or ())
    tool_call = _token_id(manager, TOOL_CALL_TAG)
    if tool_call is not None:
        candidates.add(tool_call)
    grammar.fill_bitmask(manager._grammar_bitmask, row)
    words = manager._grammar_bitmask[row]
    bans = sorted(t for t in candidates
                  if t // 32 < words.numel() and not (int(words[t // 32]) >> (t % 32)) & 1)
    words.fill_(manager._full_mask)
    setattr(grammar, BAN_ATTR, bans)
    return bans


def clear_bits(words, tokens) -> None:
    for t in tokens:
        bit = 1 << (t % 32)
        if bit >= 1 << 31:
            bit -= 1 << 32  # int32 words: the sign bit
        words[t // 32] &= ~bit


def wrap_fill_bitmasks(original):
    """``StructuredOutputManager._fill_bitmasks(batch)``: rows of ``(grammar, index, apply)``;
    ``apply`` False is a row before the grammar starts (the reasoning), which the engine fills with
    every token allowed. Those rows lose the stop and tool-call tokens the grammar cannot begin with
    (module doc); constrained rows and terminated grammars are the engine's."""

    @functools.wraps(original)
    def _fill_bitmasks(self, batch):
        batch = list(batch)
        original(self, batch)
        for grammar, index, apply_bitmask in batch:
            if apply_bitmask or grammar.is_terminated():
                continue
            bans = _banned_in_reasoning(self, grammar, index)
            if bans:
                clear_bits(self._grammar_bitmask[index], bans)

    return _fill_bitmasks


def wrap_grammar_bitmask(original):
    """``StructuredOutputManager.grammar_bitmask(requests, ids, spec_tokens)``: each request's
    grammar learns the request's stop tokens (``sampling_params.all_stop_token_ids``: the model's
    EOS list and the request's own), which ``wrap_fill_bitmasks`` reads; the grammar object is all
    that reaches ``_fill_bitmasks``. xgrammar's own stop list is the tokenizer's EOS alone, while
    the engine also stops at the generation config's (``<|endoftext|>`` for Qwen3.x)."""

    @functools.wraps(original)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        for request_id in structured_output_request_ids:
            request = requests[request_id]
            so = request.structured_output_request
            grammar = so.grammar if so is not None else None
            if grammar is not None and not isinstance(grammar, BaseException) and not hasattr(grammar, STOP_ATTR):
                setattr(grammar, STOP_ATTR, frozenset(request.sampling_params.all_stop_token_ids or ()))
        return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)

    return grammar_bitmask


def reasoning_start_id(manager, reasoner) -> int | None:
    start = getattr(reasoner, "reasoning_start_str", None) or getattr(reasoner, "start_token", None)
    return _token_id(manager, start) if isinstance(start, str) else None


def wrap_grammar_init(original):
    """``StructuredOutputManager.grammar_init(request)``: after the engine's, a request whose front
    end did not decide whether its reasoning has ended (``reasoning_ended`` None: /v1/completions)
    and whose prompt opens no reasoning block is constrained from its first token."""

    @functools.wraps(original)
    def grammar_init(self, request):
        original(self, request)
        so = request.structured_output_request
        if so is None or so.reasoning_ended is not None or getattr(self, "enable_in_reasoning", False):
            return
        reasoner = self._get_reasoner(request)
        if reasoner is None:
            return
        start = reasoning_start_id(self, reasoner)
        if start is not None and start not in (request.prompt_token_ids or ()):
            so.reasoning_ended = True

    return grammar_init


def wrap_get_function_parameters(original):
    """``structural_tag_registry.get_function_parameters(function)``: ``True`` (any JSON value)
    becomes any JSON object."""

    @functools.wraps(original)
    def get_function_parameters(function):
        schema = original(function)
        return {"type": "object"} if schema is True else schema

    return get_function_parameters


_DECODER = json.JSONDecoder()


def skip_json_space(text: str, i: int) -> int:
    """Past the JSON whitespace at ``text[i]``, by the json module's own rule."""
    return json.decoder.WHITESPACE.match(text, i).end()


def read_tool_call(text: str, start: int) -> tuple[dict, str | None, int] | None:
    """The hermes call whose JSON begins at or after ``text[start]`` (after ``<tool_call>``):
    ``(call, raw_arguments, end)``, ``end`` just past the JSON, or None when no JSON object begins
    there. ``raw_arguments`` is the model's own text of the ``arguments`` value. Read with the JSON
    decoder, so a ``</tool_call>`` inside a string does not end the call."""
    i = skip_json_space(text, start)
    if i >= len(text) or text[i] != "{":
        return None
    try:
        call, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    # the top level again, key by key, to find where the arguments' own text lies
    raw_arguments, j = None, skip_json_space(text, i + 1)
    while j < end and text[j] == '"':
        key, j = _DECODER.raw_decode(text, j)
        j = skip_json_space(text, skip_json_space(text, j) + 1)  # past ':'
        value_start = j
        _, j = _DECODER.raw_decode(text, j)
        if key == "arguments":
            raw_arguments = text[value_start:j]
        j = skip_json_space(text, j)
        if j < end and text[j] == ",":
            j = skip_json_space(text, j + 1)
    return call, raw_arguments, end


def arguments_text(call: dict, raw_arguments: str | None) -> str:
    """What the engine writes (``json.dumps``, its spacing), unless that is not JSON (a non-finite
    float): then the model's own text, which the decoder read as JSON."""
    try:
        return json.dumps(call["arguments"], ensure_ascii=False, allow_nan=False)
    except ValueError:
        if raw_arguments is None:
            raise
        return raw_arguments


def wrap_hermes_extract_tool_calls(original):
    """``Hermes2ProToolParser.extract_tool_calls(self, model_output, request)``: every call read
    with ``read_tool_call``, each followed by nothing but space and ``</tool_call>`` (or the end of
    the text), and the result built as the engine builds it (its classes, ``json.dumps`` spacing);
    the engine's own function when a call cannot be read that way (it then returns the text as
    content, as before)."""
    engine = sys.modules[original.__module__]  # the parser module's own result classes

    @functools.wraps(original)
    def extract_tool_calls(self, model_output, request):
        tag, end_tag = self.tool_call_start_token, self.tool_call_end_token
        if tag not in model_output:
            return original(self, model_output, request)
        calls, at = [], model_output.find(tag)
        while at != -1:
            read = read_tool_call(model_output, at + len(tag))
            if read is None or "name" not in read[0] or "arguments" not in read[0]:
                return original(self, model_output, request)
            after = skip_json_space(model_output, read[2])
            if after < len(model_output):
                if not model_output.startswith(end_tag, after):
                    return original(self, model_output, request)
                after += len(end_tag)
            calls.append(read)
            at = model_output.find(tag, after)
        try:
            texts = [arguments_text(call, raw) for call, raw, _ in calls]
        except ValueError:
            return original(self, model_output, request)
        content = model_output[: model_output.find(tag)]
        return engine.ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[engine.ToolCall(type="function",
                                        function=engine.FunctionCall(name=call["name"], arguments=text))
                        for (call, _, _), text in zip(calls, texts)],
            content=content if content else None)

    return extract_tool_calls


SENTINEL = "\ue000"  # a private-use character standing in for the '<' of a tag inside a string


def mask_end_tags_in_strings(text: str, start_tag: str, end_tag: str) -> str:
    """``text`` with the ``<`` of every ``end_tag`` that lies inside a JSON string of a call (after
    ``start_tag``) replaced by ``SENTINEL``: the same length, so the engine's search for the end
    tag finds the real one. A call's JSON is followed by depth of brackets outside strings; the scan
    of a call stops where its JSON closes, or at an end tag outside any string."""
    out = list(text)
    i = text.find(start_tag)
    while i != -1:
        i += len(start_tag)
        depth, in_string, escaped = 0, False, False
        while i < len(text):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
                elif text.startswith(end_tag, i):
                    out[i] = SENTINEL
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    i += 1
                    break
            elif text.startswith(end_tag, i):
                break
            i += 1
        i = text.find(start_tag, i)
    return "".join(out)


def wrap_hermes_tool_call_jsons(original):
    """``Hermes2ProToolParser._extract_tool_call_jsons(self, text)``, the streaming parser's split
    of the text so far into calls: the engine's, run on the text with end tags inside strings
    masked (``mask_end_tags_in_strings``), its answers unmasked. Text that already holds the
    sentinel character goes to the engine as it is."""

    @functools.wraps(original)
    def _extract_tool_call_jsons(self, text):
        if SENTINEL in text:
            return original(self, text)
        masked = mask_end_tags_in_strings(text, self.tool_call_start_token, self.tool_call_end_token)
        if masked == text:
            return original(self, text)
        return [(body.replace(SENTINEL, "<"), complete) for body, complete in original(self, masked)]

    return _extract_tool_call_jsons


# ---- JSON strings: no raw control characters, in every form ----------------------------------------

# xgrammar 0.2.8 writes the characters of a JSON-schema string itself in two forms that take raw
# control characters (JSON allows none: U+0000-U+001F must be escaped). The classes below are as
# its EBNF printer writes them; each is replaced, as a whole class outside string literals, by its
# safe form (tests/test_constrained_output.py compiles every string form through the engine's
# backend and finds no other).
#
# A string with minLength or maxLength (anywhere: a property, an array's items, a $ref, a type
# list, propertyNames, a strict tool's parameters) is '"' X_characters{m, n} '"' with
# X_characters ::= [^"\\\r\n]: 30 of the 32 C0 characters pass raw and no escape can be written.
UNSAFE_STRING_CLASS = r'[^\"\\\r\n]'
# One JSON string character, as its unbounded strings (basic_string_sub) take them: anything but
# '"', '\' and U+0000-U+001F, or one escape (which counts as one character of the bound).
SAFE_STRING_CHARACTER = (r'(([^\0-\x1f\"\\]) | ("\\" (([\"\\/bfnrt]) | '
                         r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))')
# The json-pointer and relative-json-pointer formats take RFC 6901's unescaped ranges
# %x00-2E / %x30-7D raw, U+0000-U+001F, '"' and '\' included; like every format string, they
# take no escape, so those three go.
SAFE_CLASSES = {
    UNSAFE_STRING_CLASS: SAFE_STRING_CHARACTER,
    r"[\0-.]": r"[ !#-.]",
    r"[0-}]": r"[0-[\]-}]",
}


def c0_safe_ebnf(text: str) -> str:
    """``text`` (an EBNF grammar as xgrammar prints it) with every character class of
    ``SAFE_CLASSES`` replaced by its safe form; string literals (also those of ``Regex("...")``
    and tag texts) and every other class are left as they are."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            token = text[i:j + 1]
            out.append(SAFE_CLASSES.get(token, token) if c == "[" else token)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class C0SafeCompiler:
    """An ``xgrammar.GrammarCompiler`` whose JSON-schema and structural-tag grammars keep raw
    control characters out of every JSON string: the grammar xgrammar converts, with
    ``c0_safe_ebnf`` applied, compiled from its text. A grammar without the unsafe class (no
    length-bounded string) is compiled by xgrammar's own method, as before; so is one that xgrammar
    cannot convert (the engine's method then raises its own error). Anything else is the wrapped
    compiler's."""

    def __init__(self, compiler):
        self._qpn_compiler = compiler

    def __getattr__(self, name):
        return getattr(self.__dict__["_qpn_compiler"], name)

    def _compile(self, convert, original):
        import xgrammar as xgr

        try:
            text = str(convert(xgr.Grammar))
        except Exception:  # noqa: BLE001 - the engine's own method reports it
            return original()
        safe = c0_safe_ebnf(text)
        if safe == text:
            return original()
        try:
            return self._qpn_compiler.compile_grammar(safe)
        except Exception as exc:  # noqa: BLE001
            logger.warning("volta-qpn: the control-character-safe JSON grammar did not compile (%s); "
                           "compiling xgrammar's own, which admits raw control characters in "
                           "length-bounded strings", exc)
            return original()

    def compile_json_schema(self, schema, **kwargs):
        return self._compile(lambda g: g.from_json_schema(schema, **kwargs),
                             lambda: self._qpn_compiler.compile_json_schema(schema, **kwargs))

    def compile_structural_tag(self, *args, **kwargs):
        return self._compile(lambda g: g.from_structural_tag(*args, **kwargs),
                             lambda: self._qpn_compiler.compile_structural_tag(*args, **kwargs))


def bounded_string_admits_control_characters(compiler) -> bool:
    """Whether ``compiler`` (the backend's) lets a raw U+0001 into a string with maxLength: the
    check the hook runs once per backend, so an xgrammar that prints its grammars otherwise is
    named in the log rather than trusted."""
    import xgrammar as xgr

    ctx = compiler.compile_json_schema('{"type": "string", "maxLength": 4}')
    return xgr.GrammarMatcher(ctx).accept_string('"a\x01')


def wrap_xgrammar_backend_init(original):
    """``XgrammarBackend.__post_init__(self)``: after the engine's, the backend's compiler is
    wrapped in ``C0SafeCompiler``; a compiler that still lets a control character into a bounded
    string is logged."""

    @functools.wraps(original)
    def __post_init__(self):
        original(self)
        if not isinstance(self.compiler, C0SafeCompiler):
            self.compiler = C0SafeCompiler(self.compiler)
        try:
            unsafe = bounded_string_admits_control_characters(self.compiler)
        except Exception as exc:  # noqa: BLE001 - a check, never a reason not to serve
            logger.warning("volta-qpn: could not check JSON strings for control characters: %s", exc)
            return
        if unsafe:
            logger.warning("volta-qpn: this xgrammar's length-bounded JSON strings admit raw control "
                           "characters and the overlay does not recognise its grammar text; JSON "
                           "answers may be invalid")

    return __post_init__
