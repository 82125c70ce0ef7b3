"""Constrained output (issue 29 item 3), below the server: our hooks in
fork_patches/constrained_output.py on the engine's own functions and xgrammar's own grammars, with
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

from qpn.fork_patches import constrained_output as co  # noqa: E402
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
    co._clear_bits(words, [31, 32])
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
    assert co._reasoning_start_id(SimpleNamespace(tokenizer=tokenizer), reasoner) == _ids(tokenizer, "<think>")[0]


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


# ---- xgrammar's grammars refuse control characters in strings (the premise of the module doc) ---

def test_every_json_grammar_refuses_control_characters_in_strings():
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
