"""Constrained output (issue 29 item 3, issue 40 item 2), below the server: our hooks in
fork_patches/api/constrained_output.py on the engine's own functions and xgrammar's own grammars, with
the test checkpoint's tokenizer, and the 1Cat archives read for the not_on reasons. The server-level
matrix is tests/test_constraint_matrix.py.
"""
from __future__ import annotations

import inspect
import itertools
import json
import random
import re
from types import SimpleNamespace

import pytest

from tests._ci import onecat_text

pytestmark = [pytest.mark.fast]

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
so_mod = pytest.importorskip("vllm.v1.structured_output")
bx = pytest.importorskip("vllm.v1.structured_output.backend_xgrammar")
hermes = pytest.importorskip("vllm.tool_parsers.hermes_tool_parser")
stags = pytest.importorskip("vllm.tool_parsers.structural_tag_registry")

from qpn.fork_patches.api import constrained_output as co  # noqa: E402
from qpn.scripts.checkpoints import tiny_tokenizer  # noqa: E402

Manager = so_mod.StructuredOutputManager
# the engine's functions as shipped (another test in this process may have loaded our plugin)
ENGINE_FILL = inspect.unwrap(Manager._fill_bitmasks)
ENGINE_GRAMMAR_INIT = inspect.unwrap(Manager.grammar_init)
ENGINE_EXTRACT = inspect.unwrap(hermes.Hermes2ProToolParser.extract_tool_calls)
ENGINE_PARAMS = inspect.unwrap(stags.get_function_parameters)
ENGINE_SPLIT = inspect.unwrap(hermes.Hermes2ProToolParser._extract_tool_call_jsons)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.write_tokenizer(out, 512, 4096)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512)
    return xgr.GrammarCompiler(info)


def _grammar(compiler, kind: str):
    if kind == "json_schema":
        ctx = compiler.compile_json_schema(json.dumps(SCHEMA))
    elif kind == "choice":
        ctx = compiler.compile_regex("(yes|no)")
    elif kind in ("forced_tool", "auto_tool"):
        tag = {"type": "tag", "begin": '<tool_call>{"name": "f", "arguments": ',
               "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "}</tool_call>"}
        fmt = ({"type": "tags_with_separator", "tags": [tag], "separator": "", "at_least_one": True,
                "stop_after_first": True} if kind == "forced_tool"
               else {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [tag]})
        ctx = compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
    else:
        raise ValueError(kind)
    return bx.XgrammarGrammar(vocab_size=512, matcher=xgr.GrammarMatcher(ctx), ctx=ctx)


def _manager(tokenizer, rows=2):
    return SimpleNamespace(_grammar_bitmask=xgr.allocate_token_bitmask(rows, 512),
                           _full_mask=torch.tensor(-1, dtype=torch.int32), tokenizer=tokenizer)


def _allowed(row) -> set[int]:
    return {t for t in range(512) if (int(row[t // 32]) >> (t % 32)) & 1}


def _ids(tokenizer, *tokens):
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in tokens]


# ---- reasoning rows: stop and tool-call tokens the grammar cannot begin with ---------------------

@pytest.mark.parametrize("kind, banned", [
    ("json_schema", ("<|im_end|>", "<tool_call>")),
    ("choice", ("<|im_end|>", "<tool_call>")),
    ("forced_tool", ("<|im_end|>",)),  # the forced call's grammar begins with <tool_call>
    ("auto_tool", ()),  # any text, a stop included, may come first
])
def test_reasoning_rows_lose_exactly_what_the_grammar_cannot_begin_with(tokenizer, compiler, kind, banned):
    fill = co.wrap_fill_bitmasks(ENGINE_FILL)
    m = _manager(tokenizer)
    g = _grammar(compiler, kind)
    fill(m, [(g, 0, False)])
    assert _allowed(m._grammar_bitmask[0]) == set(range(512)) - set(_ids(tokenizer, *banned))
    assert _ids(tokenizer, "</think>")[0] in _allowed(m._grammar_bitmask[0])  # the explicit end
    # the engine alone allows every token there: the premise of the hook
    m2 = _manager(tokenizer)
    ENGINE_FILL(m2, [(g, 0, False)])
    assert _allowed(m2._grammar_bitmask[0]) == set(range(512))


def test_constrained_rows_and_later_reasoning_rows_are_the_engines(tokenizer, compiler):
    fill = co.wrap_fill_bitmasks(ENGINE_FILL)
    g = _grammar(compiler, "json_schema")
    ours, engine = _manager(tokenizer, 3), _manager(tokenizer, 3)
    fill(ours, [(g, 0, True), (g, 1, False), (g, 2, False)])  # the cached bans serve row 2
    ENGINE_FILL(engine, [(g, 0, True)])
    assert torch.equal(ours._grammar_bitmask[0], engine._grammar_bitmask[0])
    assert torch.equal(ours._grammar_bitmask[1], ours._grammar_bitmask[2])
    eos = _ids(tokenizer, "<|im_end|>")[0]
    assert eos not in _allowed(ours._grammar_bitmask[2])
    # the grammar's own state is untouched: it still accepts the answer from its start
    for t in tokenizer.encode('{"city": "Paris"}'):
        assert g.accept_tokens("r", [t])


def test_a_ban_on_the_sign_bit_clears_that_bit_only():
    words = torch.full((2,), -1, dtype=torch.int32)
    co.clear_bits(words, [31, 32])
    assert int(words[0]) == 0x7FFFFFFF and int(words[1]) == -2


# ---- completions: constrained from the first token unless the prompt opens a reasoning block ----

class _Reasoner:
    reasoning_start_str = "<think>"


def _request(prompt, reasoning_ended=None):
    so = SimpleNamespace(reasoning_ended=reasoning_ended)
    return SimpleNamespace(structured_output_request=so, prompt_token_ids=prompt)


@pytest.mark.parametrize("prompt_tokens, front_end, expected", [
    (["J", "S"], None, True),  # /v1/completions, raw prompt
    (["<think>", "x"], None, None),  # a prompt that opens reasoning: the engine decides
    (["J"], False, False),  # the chat front end decided
    (["J"], True, True),
])
def test_grammar_init_marks_reasoning_ended_only_where_nobody_decided(tokenizer, prompt_tokens,
                                                                       front_end, expected):
    init = co.wrap_grammar_init(lambda self, request: None)
    m = SimpleNamespace(tokenizer=tokenizer, enable_in_reasoning=False, _get_reasoner=lambda r: _Reasoner())
    req = _request(_ids(tokenizer, *prompt_tokens), front_end)
    init(m, req)
    assert req.structured_output_request.reasoning_ended is expected


def test_grammar_init_leaves_requests_without_reasoner_or_grammar(tokenizer):
    init = co.wrap_grammar_init(lambda self, request: None)
    no_reasoner = SimpleNamespace(tokenizer=tokenizer, enable_in_reasoning=False, _get_reasoner=lambda r: None)
    req = _request(_ids(tokenizer, "J"))
    init(no_reasoner, req)
    assert req.structured_output_request.reasoning_ended is None
    init(no_reasoner, SimpleNamespace(structured_output_request=None, prompt_token_ids=[]))
    in_reasoning = SimpleNamespace(tokenizer=tokenizer, enable_in_reasoning=True,
                                   _get_reasoner=lambda r: _Reasoner())
    init(in_reasoning, req)
    assert req.structured_output_request.reasoning_ended is None


def test_the_engines_reasoner_names_its_start_token(tokenizer):
    from vllm.reasoning import ReasoningParserManager

    reasoner = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer=tokenizer)
    assert co.reasoning_start_id(SimpleNamespace(tokenizer=tokenizer), reasoner) == _ids(tokenizer, "<think>")[0]


# ---- non-strict tools' arguments: an object ----------------------------------------------------

def test_non_strict_tool_arguments_are_an_object_and_strict_ones_unchanged():
    wrapped = co.wrap_get_function_parameters(ENGINE_PARAMS)
    loose = SimpleNamespace(strict=False, parameters=SCHEMA)
    none = SimpleNamespace(strict=None, parameters=None)
    strict = SimpleNamespace(strict=True, parameters=SCHEMA)
    assert ENGINE_PARAMS(loose) is True and ENGINE_PARAMS(none) is True  # the premise
    assert wrapped(loose) == {"type": "object"} and wrapped(none) == {"type": "object"}
    assert wrapped(strict) == SCHEMA


def test_object_arguments_schema_refuses_scalars(compiler):
    g = xgr.Grammar.from_json_schema(json.dumps({"type": "object"}))
    for text, ok in [("{}", True), ('{"a": [1, "x"]}', True), ("false", False), ("10", False), ('"s"', False)]:
        assert xgr.testing._is_grammar_accept_string(g, text) is ok, text


# ---- the hermes parser: a call ends where its JSON ends; arguments are JSON ----------------------

@pytest.fixture(scope="module")
def parser(tokenizer):
    return hermes.Hermes2ProToolParser(tokenizer)


def _extract(parser, text):
    r = co.wrap_hermes_extract_tool_calls(ENGINE_EXTRACT)(parser, text, None)
    return r.tools_called, [(c.function.name, c.function.arguments) for c in r.tool_calls], r.content


def _strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def _random_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-10**6, 10**6)
    if kind == 1:
        return rng.uniform(-1e6, 1e6)
    if kind == 2:
        # every character a JSON string can carry escaped, the tags and non-ASCII included
        pool = [chr(c) for c in range(0, 128)] + ["</tool_call>", "<tool_call>", "é", "\u2028", "😀"]
        return "".join(rng.choice(pool) for _ in range(rng.randrange(8)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return ""
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(3))}


def test_ordinary_calls_come_out_exactly_as_the_engine_gives_them(parser):
    rng = random.Random(7)
    for i in range(300):
        args = {f"a{j}": _random_value(rng) for j in range(rng.randrange(4))}
        args = {k: v for k, v in args.items() if "</tool_call>" not in json.dumps(v)}
        call = json.dumps({"name": f"f{i % 3}", "arguments": args}, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1]))
        text = rng.choice(["", "Sure. "]) + f"<tool_call>\n{call}\n</tool_call>" + rng.choice(["", "\n"])
        engine = ENGINE_EXTRACT(parser, text, None)
        assert engine.tools_called, text
        assert _extract(parser, text) == (
            True, [(c.function.name, c.function.arguments) for c in engine.tool_calls], engine.content)


def test_a_closing_tag_inside_a_string_keeps_the_call(parser):
    args = {"city": "Paris</tool_call>8[", "note": "<tool_call>"}
    text = '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(args) + "}</tool_call>"
    assert ENGINE_EXTRACT(parser, text, None).tools_called is False  # the premise: the engine drops it
    called, calls, content = _extract(parser, text)
    assert called and content is None
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", args)]


def test_two_calls_and_a_call_left_open(parser):
    text = ('Hi <tool_call>{"name": "a", "arguments": {"x": "</tool_call>"}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}')
    called, calls, content = _extract(parser, text)
    assert called and content == "Hi " and [(n, json.loads(a)) for n, a in calls] == [
        ("a", {"x": "</tool_call>"}), ("b", {})]


@pytest.mark.parametrize("number", ["1e999", "-1e999", "1" + "0" * 400 + ".5"])
def test_a_number_beyond_float_range_stays_json(parser, number):
    text = '<tool_call>{"name": "f", "arguments": {"n": ' + number + ', "s": "x"}}</tool_call>'
    engine = ENGINE_EXTRACT(parser, text, None)
    assert "Infinity" in engine.tool_calls[0].function.arguments  # the premise
    called, calls, _ = _extract(parser, text)
    assert called and calls[0][1] == '{"n": ' + number + ', "s": "x"}'
    _strict_json(calls[0][1])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>',  # not a call and nothing else
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>not json</tool_call>',
    '<tool_call>[1, 2]</tool_call>',
])
def test_text_that_is_not_a_call_is_left_to_the_engine(parser, text):
    engine = ENGINE_EXTRACT(parser, text, None)
    ours = co.wrap_hermes_extract_tool_calls(ENGINE_EXTRACT)(parser, text, None)
    assert (ours.tools_called, ours.content) == (engine.tools_called, engine.content) == (False, text)


# ---- xgrammar's own grammars refuse control characters in strings without a length bound -------
# (strings with one, and every other form, through the engine's backend with our hook: below)

def test_xgrammars_unbounded_strings_refuse_control_characters():
    tag = {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": "", "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": SCHEMA},
                  "end": "</tool_call>"}]}}
    grammars = {"json_schema": (xgr.Grammar.from_json_schema(json.dumps(SCHEMA)), "", ""),
                "builtin": (xgr.Grammar.builtin_json_grammar(), "", ""),
                "structural_tag": (xgr.Grammar.from_structural_tag(json.dumps(tag)), "<tool_call>", "</tool_call>")}
    for name, (g, pre, post) in grammars.items():
        assert xgr.testing._is_grammar_accept_string(g, pre + '{"city": "ab\\u0001"}' + post), name
        for c in itertools.chain(range(0x20), [0x7F]):
            text = pre + '{"city": "a' + chr(c) + 'b"}' + post
            assert xgr.testing._is_grammar_accept_string(g, text) is (c == 0x7F), (name, hex(c))


# ---- the 1Cat archives: where the hooks apply there, and why one does not ------------------------

def _method_source(src: str, name: str) -> str:
    """A method's source in a module's text: from its ``def`` to the next line at class level."""
    body = src[src.index(f"    def {name}("):]
    return body[: re.search(r"\n    [^\s)]", body[10:]).start() + 10].strip()


@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_1cat_fills_reasoning_rows_with_every_token_as_vllm_does(version):
    src = onecat_text(version, "v1/structured_output/__init__.py")
    engine = inspect.getsource(ENGINE_FILL)
    assert _method_source(src, "_fill_bitmasks") == engine.strip()
    # the chat front end decides reasoning_ended; completions does not (our completions hook's premise)
    chat = onecat_text(version, "entrypoints/openai/chat_completion/serving.py")
    completion = onecat_text(version, "entrypoints/openai/completion/serving.py")
    assert "reasoning_ended=reasoning_ended" in chat and "reasoning_ended" not in completion
    assert 'return "<think>"' in onecat_text(version, "reasoning/qwen3_reasoning_parser.py")
    # the hermes parser's two readings we hook are the cpu engine's, word for word
    parser_src = onecat_text(version, "tool_parsers/hermes_tool_parser.py")
    for engine_fn in (ENGINE_SPLIT, ENGINE_EXTRACT):
        assert _method_source(parser_src, engine_fn.__name__) == inspect.getsource(engine_fn).strip()


@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_1cat_has_no_structural_tag_with_free_json_arguments_for_our_parsers(version):
    registry = onecat_text(version, "tool_parsers/structural_tag_registry.py")
    # every use of the free-arguments schema is a qwen_xml parameter block (always an object) or
    # the DeepSeek V4 tag, a model family we do not serve
    builders = [b for b in registry.split("\ndef ") if "_get_function_parameters(function)" in b]
    assert {b.split("(", 1)[0] for b in builders} == {"get_deepseek_v4_structural_tag", "get_qwen_3_5_structural_tag"}
    qwen = next(b for b in builders if b.startswith("get_qwen_3_5_structural_tag"))
    assert qwen.count('style="qwen_xml"') == qwen.count("JSONSchemaFormat(") == 3
    assert "structural_tag" not in onecat_text(version, "tool_parsers/hermes_tool_parser.py")
    utils = onecat_text(version, "tool_parsers/utils.py")
    assert 'params = params if params else {"type": "object", "properties": {}}' in utils


def test_the_requests_own_stop_tokens_are_banned_in_reasoning(tokenizer, compiler):
    """The engine stops at the generation config's EOS list (<|endoftext|> too), xgrammar knows
    the tokenizer's EOS alone: grammar_bitmask tells each grammar its request's stop tokens."""
    g = _grammar(compiler, "json_schema")
    endoftext, im_end, tool_call = _ids(tokenizer, "<|endoftext|>", "<|im_end|>", "<tool_call>")
    assert endoftext not in g.ctx.tokenizer_info.stop_token_ids  # the premise
    m = _manager(tokenizer)
    request = SimpleNamespace(structured_output_request=SimpleNamespace(grammar=g),
                              sampling_params=SimpleNamespace(all_stop_token_ids={endoftext, im_end}))
    built = []
    co.wrap_grammar_bitmask(lambda self, reqs, ids, spec: built.append(ids) or "mask")(
        m, {"r": request}, ["r"], {})
    assert built == [["r"]] and getattr(g, co.STOP_ATTR) == {endoftext, im_end}
    co.wrap_fill_bitmasks(ENGINE_FILL)(m, [(g, 0, False)])
    assert set(range(512)) - _allowed(m._grammar_bitmask[0]) == {endoftext, im_end, tool_call}
    # a request whose grammar is still compiling, or failed, is skipped
    for pending in (None, ValueError("bad schema")):
        req = SimpleNamespace(structured_output_request=SimpleNamespace(grammar=pending), sampling_params=None)
        co.wrap_grammar_bitmask(lambda *a: None)(m, {"p": req}, ["p"], {})


def _stream(parser_cls, tokenizer, text, split=None, pieces=7):
    """Feed ``text`` to a fresh parser's streaming path in ``pieces`` chunks; the arguments it
    streamed per call."""
    p = parser_cls(tokenizer)
    if split is not None:
        p._extract_tool_call_jsons = split.__get__(p)
    args: dict[int, str] = {}
    cuts = sorted({len(text) * i // pieces for i in range(1, pieces)} | {len(text)})
    prev = ""
    for cut in cuts:
        cur = text[:cut]
        delta = p.extract_tool_calls_streaming(prev, cur, cur[len(prev):], [], [], [], None)
        for tc in (delta.tool_calls if delta else []) or []:
            fn = tc.function if isinstance(tc.function, dict) else tc.function.model_dump()
            args[tc.index] = args.get(tc.index, "") + (fn.get("arguments") or "")
        prev = cur
    return [args[i] for i in sorted(args)]


def test_streamed_arguments_keep_a_closing_tag_inside_a_string(tokenizer):
    args = {"city": "Paris</tool_call>8[", "n": 1}
    text = '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(args) + "}</tool_call>"
    cls = hermes.Hermes2ProToolParser
    engine = _stream(cls, tokenizer, text, ENGINE_SPLIT)
    assert engine != [json.dumps(args)]  # the premise: cut at the tag inside the string
    ours = _stream(cls, tokenizer, text, co.wrap_hermes_tool_call_jsons(ENGINE_SPLIT))
    assert [json.loads(a) for a in ours] == [args]


def test_streamed_split_is_the_engines_where_no_tag_is_inside_a_string(parser):
    split = co.wrap_hermes_tool_call_jsons(ENGINE_SPLIT)
    rng = random.Random(3)
    for i in range(200):
        args = {f"a{j}": _random_value(rng) for j in range(rng.randrange(3))}
        body = json.dumps({"name": "f", "arguments": args}, ensure_ascii=False)
        if "</tool_call>" in body:
            continue  # a tag inside a string: the case the hook changes
        text = "x <tool_call>\n" + body + "\n</tool_call>" + rng.choice(["", " <tool_call>{\"name\": \"g\""])
        for cut in range(0, len(text) + 1, max(1, len(text) // 9)):
            part = text[:cut]
            assert split(parser, part) == ENGINE_SPLIT(parser, part), part


def test_mask_hides_only_tags_inside_strings():
    text = '<tool_call>{"a": "x</tool_call>", "b": "\\"</tool_call>"}</tool_call> "</tool_call>"'
    masked = co.mask_end_tags_in_strings(text, "<tool_call>", "</tool_call>")
    assert len(masked) == len(text) and masked.count(co.SENTINEL) == 2
    assert masked.replace(co.SENTINEL, "<") == text
    assert masked.find("</tool_call>") == text.index('}</tool_call>') + 1


# ---- JSON strings keep raw control characters out, in every form (issue 40 item 2) ---------------
# Each schema is compiled as the engine's structured-output backend compiles it (XgrammarBackend,
# its compile_grammar, the test checkpoint's tokenizer); a raw U+0000-U+001F is then refused at every
# position inside every string of a valid answer, by the matcher and in the engine's token bitmask,
# while the escapes a JSON string writes them with are accepted where the form takes escapes.

ENGINE_BACKEND_INIT = inspect.unwrap(bx.XgrammarBackend.__post_init__)
SO = pytest.importorskip("vllm.v1.structured_output.backend_types").StructuredOutputOptions
utils = pytest.importorskip("vllm.tool_parsers.utils")
protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")


def _string(**bounds) -> dict:
    return {"type": "string", **bounds}


# every format xgrammar 0.2.8 builds (vLLM's STRING_SUPPORTED_FORMATS), each with a valid value
FORMAT_EXAMPLES = {
    "email": "ab.c@example.org", "date": "2026-12-02", "time": "12:34:56Z",
    "date-time": "2026-12-02T12:34:56+01:00", "duration": "P1DT2H", "ipv4": "192.168.0.1",
    "ipv6": "2001:db8::1", "hostname": "example.org", "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "uri": "https://example.org/a?b=c", "uri-reference": "../a/b", "uri-template": "https://example.org/{id}",
    "json-pointer": "/a/b~1c", "relative-json-pointer": "1/a"}
ESCAPES = "\\n\\u0001"  # a newline and U+0001 as a JSON string writes them: two characters
BOUNDED_PARAMS = {"type": "object",
                  "properties": {"city": _string(minLength=1, maxLength=12), "days": {"type": "integer"},
                                 "tags": {"type": "array", "items": _string(maxLength=4)}},
                  "required": ["city"], "additionalProperties": False}

# name: (schema, a valid answer, a valid answer with ESCAPES inside a string, or None where the
# form takes no escape: xgrammar matches pattern and format strings on their raw characters and
# writes no backslash in them, and enum/const strings are the schema's own, escapes included)
STRING_FORMS = {
    "string": (_string(), '"ab c"', f'"a{ESCAPES}"'),
    "maxLength": (_string(maxLength=6), '"ab c"', f'"a{ESCAPES}b"'),
    "minLength": (_string(minLength=2), '"ab c"', f'"{ESCAPES}"'),
    "minLength and maxLength": (_string(minLength=1, maxLength=3), '"abc"', f'"{ESCAPES}"'),
    "maxLength 1": (_string(maxLength=1), '"a"', '"\\n"'),
    "pattern": (_string(pattern="^[a-z ]+$"), '"ab c"', None),
    "pattern with any character": (_string(pattern="^a.*$"), '"a b"', None),
    **{f"format {f}": (_string(format=f), json.dumps(v), None) for f, v in FORMAT_EXAMPLES.items()},
    "enum": ({"type": "string", "enum": ["ab", "c\u0001\nd"]}, '"ab"', '"c\\u0001\\nd"'),
    "const": ({"const": "a\nb"}, '"a\\nb"', '"a\\nb"'),
    "type list": ({"type": ["string", "null"], "maxLength": 4}, '"ab"', f'"{ESCAPES}"'),
    "anyOf": ({"anyOf": [_string(minLength=2), {"type": "integer"}]}, '"ab"', f'"{ESCAPES}"'),
    "$ref": ({"$defs": {"s": _string(maxLength=5)}, "$ref": "#/$defs/s"}, '"ab"', f'"{ESCAPES}"'),
    "object properties": (BOUNDED_PARAMS, '{"city": "Paris", "days": 2, "tags": ["a", "bc"]}',
                          f'{{"city": "P{ESCAPES}", "tags": ["{ESCAPES}"]}}'),
    "nested object and array": (
        {"type": "object", "properties": {"a": {"type": "array", "items": {
            "type": "object", "properties": {"b": _string(minLength=1), "c": _string(pattern="^x+$")},
            "required": ["b", "c"]}}}, "required": ["a"]},
        '{"a": [{"b": "ab", "c": "xx"}]}', f'{{"a": [{{"b": "{ESCAPES}", "c": "x"}}]}}'),
    "prefixItems": ({"type": "array", "prefixItems": [_string(maxLength=3), _string(format="date")],
                     "items": False}, '["ab", "2026-12-02"]', f'["{ESCAPES}", "2026-12-02"]'),
    "additionalProperties": ({"type": "object", "additionalProperties": _string(maxLength=3)},
                             '{"k": "ab"}', f'{{"k{ESCAPES}": "{ESCAPES}"}}'),
    "propertyNames with maxLength": ({"type": "object", "propertyNames": {"maxLength": 4}},
                                     '{"ab": 1}', f'{{"{ESCAPES}": 1}}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^k[0-9]*$": _string(minLength=1)}},
                          '{"k1": "ab"}', None),
}


def _in_string_positions(text: str) -> list[int]:
    """The indices ``i`` at which ``text[:i]`` ends inside a JSON string (past its opening quote,
    not inside an escape): where a raw control character would be a string character."""
    positions, in_string, i = [], False, 0
    while i < len(text):
        c = text[i]
        if in_string:
            positions.append(i)
            if c == "\\":
                i += 2 if text[i + 1] != "u" else 6
                continue
            in_string = c != '"'
        elif c == '"':
            in_string = True
        i += 1
    return positions


def _backend(tokenizer, hooked: bool, compact: bool = False):
    """The engine's XgrammarBackend, built as the engine builds it, with our hook or without."""
    init = co.wrap_xgrammar_backend_init(ENGINE_BACKEND_INIT) if hooked else ENGINE_BACKEND_INIT
    cls = type("Backend", (bx.XgrammarBackend,), {"__post_init__": init})
    config = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=compact),
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3")),
                             speculative_config=None)
    return cls(vllm_config=config, tokenizer=tokenizer, vocab_size=512)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return _backend(tokenizer, hooked=True)


@pytest.fixture(scope="module")
def control_tokens(tokenizer):
    """Tokens whose bytes hold a C0 character: the 32 single-byte ones of the byte-level vocabulary."""
    vocab = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512).decoded_vocab
    tokens = {t for t, raw in enumerate(vocab) if any(b < 0x20 for b in raw)}
    assert len(tokens) >= 32  # the premise: the model can sample every one of them
    return tokens


def _control_characters_admitted(ctx, text: str, control_tokens: set[int]) -> list[str]:
    """Where a compiled grammar lets a raw control character into a string of ``text``, a valid
    answer: by the matcher (each character at each in-string position) and by the bitmask the
    engine samples under (tokens holding one)."""
    assert xgr.GrammarMatcher(ctx).accept_string(text), f"the valid answer itself is refused: {text!r}"
    found = []
    walker, mask, done = xgr.GrammarMatcher(ctx), xgr.allocate_token_bitmask(1, 512), 0
    for i in _in_string_positions(text):
        assert walker.accept_string(text[done:i])
        done = i
        walker.fill_next_token_bitmask(mask, 0)
        leaked = control_tokens & _allowed(mask[0])
        if leaked:
            found.append(f"tokens {sorted(leaked)[:4]}... after {text[:i]!r}")
        found += [f"U+{c:04X} after {text[:i]!r}" for c in range(0x20) if walker.fork().accept_string(chr(c))]
    return found


@pytest.mark.parametrize("form", list(STRING_FORMS))
def test_no_json_string_form_admits_a_raw_control_character(backend, control_tokens, form):
    schema, answer, escaped = STRING_FORMS[form]
    ctx = backend.compile_grammar(SO.JSON, json.dumps(schema)).ctx
    assert not _control_characters_admitted(ctx, answer, control_tokens)
    if escaped is not None:
        assert not _control_characters_admitted(ctx, escaped, control_tokens)
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(escaped), schema)  # the escaped answer is one the schema allows


@pytest.mark.parametrize("form", ["maxLength", "minLength", "minLength and maxLength", "type list",
                                  "anyOf", "$ref", "object properties", "propertyNames with maxLength"])
def test_the_engine_alone_admits_control_characters_and_no_escape_in_bounded_strings(tokenizer, control_tokens,
                                                                                      form):
    """The premise: the engine's own backend lets 30 of the 32 C0 characters into a string with a
    length bound, and takes no escape there."""
    schema, answer, escaped = STRING_FORMS[form]
    ctx = _backend(tokenizer, hooked=False).compile_grammar(SO.JSON, json.dumps(schema)).ctx
    admitted = _control_characters_admitted(ctx, answer, control_tokens)
    assert sum(f.startswith("U+") for f in admitted) >= 30
    assert not xgr.GrammarMatcher(ctx).accept_string(escaped)


@pytest.mark.parametrize("fmt, prefix", [("json-pointer", '"/a'), ("relative-json-pointer", '"1/a')])
def test_json_pointer_strings_take_no_raw_control_character_quote_or_backslash(tokenizer, backend, fmt, prefix):
    """xgrammar writes these formats' characters from RFC 6901's raw ranges (%x00-2E, %x30-7D):
    the engine alone takes a control character, a backslash and a quote that does not end the
    string."""
    schema = json.dumps(_string(format=fmt))
    engine = _backend(tokenizer, hooked=False).compile_grammar(SO.JSON, schema).ctx
    ours = backend.compile_grammar(SO.JSON, schema).ctx
    for raw in ("\x01", "\x1f", "\\", '"b'):
        assert xgr.GrammarMatcher(engine).accept_string(prefix + raw), raw  # the premise
        assert not xgr.GrammarMatcher(ours).accept_string(prefix + raw), raw
    assert _complete(ours, prefix + ' b~1c/~0!#-.0-[]-}\x7fé"')


def test_length_bounds_still_hold_and_an_escape_counts_as_one_character(backend):
    ctx = backend.compile_grammar(SO.JSON, json.dumps(_string(minLength=2, maxLength=3))).ctx
    for text, ok in [('"ab"', True), ('"abc"', True), ('"abcd"', False), ('"a"', False),
                     ('"\\n\\t"', True), ('"\\u0001\\"\\\\"', True), ('"\\n\\n\\n\\n"', False),
                     ('"\\x"', False), ('"\\u00g1"', False)]:
        assert _complete(ctx, text) is ok, text


def _complete(ctx, text: str) -> bool:
    m = xgr.GrammarMatcher(ctx)
    return m.accept_string(text) and m.is_completed()


def test_compact_separators_and_json_object_keep_control_characters_out(tokenizer, control_tokens):
    compact = _backend(tokenizer, hooked=True, compact=True)
    schema, answer, escaped = STRING_FORMS["object properties"]
    ctx = compact.compile_grammar(SO.JSON, json.dumps(schema)).ctx
    for text in (answer, escaped):
        assert not _control_characters_admitted(ctx, text.replace(": ", ":").replace(", ", ","), control_tokens)
    ctx = compact.compile_grammar(SO.JSON_OBJECT, "").ctx  # xgrammar 0.2.8 keeps ", " here
    assert not _control_characters_admitted(ctx, f'{{"k{ESCAPES}":["a", {{"b":"c"}}], "d":"e"}}', control_tokens)


def _strict_tool(parameters=BOUNDED_PARAMS):
    return protocol.ChatCompletionToolsParam(type="function", function={
        "name": "get_weather", "parameters": parameters, "strict": True})


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_forced_strict_tool_call_keeps_control_characters_out_of_its_arguments(backend, control_tokens,
                                                                                 tool_choice):
    """vLLM 0.32 forces a hermes call with a structural tag built from the tool's parameters
    (structural_tag_registry, serialized as the chat front end does)."""
    choice = tool_choice if tool_choice == "required" else protocol.ChatCompletionNamedToolChoiceParam(
        type="function", function={"name": "get_weather"})
    tag = stags.get_model_structural_tag("hermes", [_strict_tool()], choice, reasoning=False)
    ctx = backend.compile_grammar(SO.STRUCTURAL_TAG, json.dumps(tag.model_dump())).ctx
    for args in (STRING_FORMS["object properties"][1], STRING_FORMS["object properties"][2]):
        call = '<tool_call>\n{"name": "get_weather", "arguments": ' + args + "}\n</tool_call>"
        assert not _control_characters_admitted(ctx, call, control_tokens)
    engine_ctx = _backend(backend.tokenizer, hooked=False).compile_grammar(
        SO.STRUCTURAL_TAG, json.dumps(tag.model_dump())).ctx
    assert xgr.GrammarMatcher(engine_ctx).accept_string('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\x01')


def test_a_required_call_through_the_json_schema_array_keeps_control_characters_out(backend, control_tokens):
    """The other forced-call path (1Cat's for hermes, and vLLM 0.32's without structural tags):
    a JSON schema of an array of {name, parameters}."""
    schema = utils.get_json_schema_from_tools(tool_choice="required", tools=[_strict_tool()])
    ctx = backend.compile_grammar(SO.JSON, json.dumps(schema)).ctx
    args = STRING_FORMS["object properties"][2]
    assert not _control_characters_admitted(ctx, f'[{{"name": "get_weather", "parameters": {args}}}]', control_tokens)


def test_the_legacy_structural_tag_form_keeps_control_characters_out(backend, control_tokens):
    spec = {"type": "structural_tag", "triggers": ["<f>"],
            "structures": [{"begin": "<f>", "schema": BOUNDED_PARAMS, "end": "</f>"}]}
    ctx = backend.compile_grammar(SO.STRUCTURAL_TAG, json.dumps(spec)).ctx
    assert not _control_characters_admitted(ctx, 'x <f>{"city": "P' + ESCAPES + '"}</f>', control_tokens)


def test_grammars_without_a_bounded_string_are_xgrammars_own(backend):
    """Only the unsafe class changes: a grammar without one is compiled by xgrammar's own method,
    and the rewrite leaves literals (tag texts, enum values, Regex patterns) alone."""
    calls = []
    inner = backend.compiler._qpn_compiler
    spy = SimpleNamespace(compile_json_schema=lambda *a, **k: calls.append("json") or inner.compile_json_schema(*a, **k),
                          compile_grammar=lambda *a, **k: calls.append("ebnf") or inner.compile_grammar(*a, **k))
    safe = co.C0SafeCompiler(spy)
    safe.compile_json_schema(json.dumps(SCHEMA))
    safe.compile_json_schema(json.dumps(_string(maxLength=3)))
    assert calls == ["json", "ebnf"]
    literal = 'root ::= "[^\\"\\\\\\r\\n]" [^\\"\\\\\\r\\n] Regex("[^\\"\\\\\\r\\n]")'
    assert co.UNSAFE_STRING_CLASS in literal
    assert co.c0_safe_ebnf(literal) == ('root ::= "[^\\"\\\\\\r\\n]" ' + co.SAFE_STRING_CHARACTER
                                        + ' Regex("[^\\"\\\\\\r\\n]")')


@pytest.mark.parametrize("version", ["1.2.2", "1.3.0"])
def test_1cat_compiles_json_schemas_and_structural_tags_through_the_backends_compiler(version):
    """The hook's premise on 1Cat: its XgrammarBackend makes self.compiler (an xgrammar
    GrammarCompiler) in __post_init__ and compiles JSON schemas, json_object and structural tags
    (both forms) with that compiler's compile_json_schema and compile_structural_tag."""
    src = onecat_text(version, "v1/structured_output/backend_xgrammar.py")
    init, compile_ = _method_source(src, "__post_init__"), _method_source(src, "compile_grammar")
    assert "self.compiler = xgr.GrammarCompiler(" in init
    assert compile_.count("self.compiler.compile_json_schema(") == 2
    assert compile_.count("self.compiler.compile_structural_tag(") == 2
    assert "xgr.Grammar." not in compile_ and "compile_builtin_json_grammar" not in compile_
