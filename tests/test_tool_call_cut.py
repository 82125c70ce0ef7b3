"""Tool calls survive a cut (issue 40 item 5), below the server: fork_patches/api/tool_call_cut.py on the
engine's own classes. vLLM 0.32 (the cpu engine): its real OpenAIServingChat builds non-streamed and
streamed answers from results we feed it (only the constructor, which needs an engine client, is
stood in), with its real parsers and the test checkpoint's tokenizer; every test shows the engine
alone failing the case first. 1Cat-vLLM 1.2.2 and 1.3.0: the same answers through 1Cat's own
builders in a subprocess (tests/test_tool_call_cut_1cat.py), and their sources read here for the
shape the hooks rely on. The served cases are in tests/test_spec_tool_calls.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
from types import SimpleNamespace

import pytest

from tests._ci import onecat_text

pytestmark = [pytest.mark.fast]

serving_mod = pytest.importorskip("vllm.entrypoints.openai.chat_completion.serving")
hermes = pytest.importorskip("vllm.tool_parsers.hermes_tool_parser")
abstract_parser = pytest.importorskip("vllm.parser.abstract_parser")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.parser import ParserManager  # noqa: E402

from qpn.fork_patches.api import constrained_output as co  # noqa: E402
from qpn.fork_patches.engine import engine_lock  # noqa: E402
from qpn.fork_patches.api import tool_call_cut as tcc  # noqa: E402
from qpn.scripts.checkpoints import tiny_tokenizer  # noqa: E402

Chat = serving_mod.OpenAIServingChat
# the engine's functions as shipped (another test in this process may have loaded our plugin)
ENGINE_FULL = inspect.unwrap(Chat.chat_completion_full_generator)
ENGINE_STREAM = inspect.unwrap(Chat.chat_completion_stream_generator)
ENGINE_EXTRACT = inspect.unwrap(hermes.Hermes2ProToolParser.extract_tool_calls)
ENGINE_DELEGATE = inspect.unwrap(abstract_parser.DelegatingParser._extract_tool_calls)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.write_tokenizer(out, 512, 4096)
    return AutoTokenizer.from_pretrained(str(out))


def _hermes_parsers(hooked: bool, json_forced: bool = False):
    """The parser class vLLM 0.32 composes for ``--tool-call-parser hermes --reasoning-parser
    qwen3``: the engine's (``hooked``: with ours, and constrained-hermes-call-extent on the hermes
    parser as the plugin applies it) and, with ``json_forced``, a hermes parser that takes
    forced calls as JSON (vLLM's path with VLLM_ENFORCE_STRICT_TOOL_CALLING=0, 1Cat's always)."""
    extract = co.wrap_hermes_extract_tool_calls(ENGINE_EXTRACT) if hooked else ENGINE_EXTRACT
    tool_parser = type("Hermes", (hermes.Hermes2ProToolParser,), {"extract_tool_calls": extract})
    tool_parser.supports_required_and_named = json_forced  # after the engine's __init_subclass__
    base = ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name="qwen3",
                                    enable_auto_tools=True)
    delegate = tcc.wrap_extract_tool_calls(ENGINE_DELEGATE) if hooked else ENGINE_DELEGATE
    return type("Parser", (base,), {"tool_parser_cls": tool_parser, "_extract_tool_calls": delegate})


def _serving(hooked: bool, json_forced: bool = False):
    """vLLM 0.32's OpenAIServingChat as ``vllm serve --enable-auto-tool-choice --tool-call-parser
    hermes --reasoning-parser qwen3`` builds it (the attributes its answer builders read)."""
    cls = type("Chat", (Chat,), {
        "chat_completion_full_generator": tcc.wrap_full_generator(ENGINE_FULL) if hooked else ENGINE_FULL,
        "chat_completion_stream_generator": ENGINE_STREAM})  # vLLM 0.32 keeps length itself
    s = object.__new__(cls)
    s.__dict__.update(
        parser_cls=_hermes_parsers(hooked, json_forced), enable_auto_tools=True, response_role="assistant",
        _include_reasoning_tokens_details=True, enable_prompt_tokens_details=False,
        enable_per_request_metrics=False, system_fingerprint=None, enable_log_outputs=False,
        request_logger=None, enable_force_include_usage=False, enable_log_deltas=True, chat_template=None,
        chat_template_content_format="auto", default_chat_template_kwargs={},
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3")))
    return s


def _tool(name):
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}


NAMED = {"type": "function", "function": {"name": "a"}}


def _request(choice, stream=False, n=1):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=[_tool("a"), _tool("b"), _tool("c")], tool_choice=choice,
                                 stream=stream, max_tokens=200, n=n, parallel_tool_calls=True,
                                 chat_template_kwargs={"enable_thinking": False})


def _prompt_ids(tokenizer):
    # the prompt's end as the chat template writes it with thinking off: the reasoning has ended
    return tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)


async def _results(tokenizer, outputs, piece):
    """The engine's results for ``outputs`` [(text, finish_reason)]: the whole text at once when
    ``piece`` is None (a non-streamed request), else deltas of ``piece`` characters."""
    texts = [t for t, _ in outputs]
    cuts = [len(max(texts, key=len))] if piece is None else list(range(piece, max(map(len, texts)) + piece, piece))
    prev = 0
    for c in cuts:
        last = c >= max(map(len, texts))
        outs = [CompletionOutput(index=i, text=t[prev:c] if piece else t, token_ids=[5] * max(1, len(t[prev:c])),
                                 cumulative_logprob=None, logprobs=None,
                                 finish_reason=f if last else None)
                for i, (t, f) in enumerate(outputs) if prev < len(t) or last]
        yield RequestOutput(request_id="r", prompt="p", prompt_token_ids=_prompt_ids(tokenizer),
                            prompt_logprobs=None, outputs=outs, finished=last)
        prev = c


def plain(tokenizer, hooked, choice, outputs, json_forced=False):
    """The non-streamed answer: [(finish_reason, content, [(name, arguments)])] per choice."""
    s = _serving(hooked, json_forced)
    request = _request(choice, n=len(outputs))
    parser = s.parser_cls(tokenizer, request.tools, chat_template_kwargs={"enable_thinking": False},
                          model_config=None)
    resp = asyncio.run(s.chat_completion_full_generator(
        request, _results(tokenizer, outputs, None), "id", "m", [], tokenizer,
        SimpleNamespace(final_usage_info=None), parser=parser))
    return [(c.finish_reason, c.message.content,
             [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
            for c in resp.choices]


def streamed(tokenizer, hooked, choice, text, finish="length", piece=3):
    """The streamed answer, its deltas joined: (finish_reason, content, [(name, arguments)])."""
    s = _serving(hooked)

    async def run():
        return [line async for line in s.chat_completion_stream_generator(
            _request(choice, stream=True), _results(tokenizer, [(text, finish)], piece), "id", "m", [],
            tokenizer, SimpleNamespace(final_usage_info=None), chat_template_kwargs={"enable_thinking": False})]

    content, calls, finishes = "", {}, []
    for line in asyncio.run(run()):
        if line.startswith("data: {"):
            for ch in json.loads(line[6:]).get("choices") or []:
                d = ch.get("delta") or {}
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    entry = calls.setdefault(tc["index"], ["", ""])
                    entry[0] += (tc.get("function") or {}).get("name") or ""
                    entry[1] += (tc.get("function") or {}).get("arguments") or ""
                if ch.get("finish_reason"):
                    finishes.append(ch["finish_reason"])
    assert len(finishes) == 1, finishes
    return finishes[0], content, [tuple(calls[i]) for i in sorted(calls)]


def _call(name, city):
    return '<tool_call>\n{"name": "%s", "arguments": {"city": "%s"}}\n</tool_call>' % (name, city)


THREE = [("a", '{"city": "Paris"}'), ("b", '{"city": "Rome"}'), ("c", '{"city": "Oslo"}')]
CALLS = _call("a", "Paris") + _call("b", "Rome") + _call("c", "Oslo")
CUT_CALL = '<tool_call>\n{"name": "a", "arguments": {"city": "Ber'


# ---- the auditor's answer: three complete calls, then the limit -------------------------------

@pytest.mark.parametrize("choice", ["required", "auto", NAMED], ids=["required", "auto", "named"])
@pytest.mark.parametrize("before", ["", "Sure. "], ids=["calls-only", "text-first"])
@pytest.mark.parametrize("complete", [3, 0], ids=["three-calls", "no-call"])
def test_a_cut_answer_keeps_its_complete_calls(tokenizer, choice, before, complete):
    """On vLLM 0.32 hermes is the format of every choice (a forced call's grammar is its structural
    tag). The engine returns no call and the whole answer as content; hooked: the complete calls,
    the text before them as content, finish_reason length. The same text ended by the model
    (finish_reason stop: a malformed answer) is the engine's answer, hooked or not."""
    text = before + (CALLS if complete else "") + CUT_CALL
    ((finish, content, calls),) = plain(tokenizer, False, choice, [(text, "length")])
    assert (finish, calls) == ("length", []) and content == text  # the premise
    ((finish, content, calls),) = plain(tokenizer, True, choice, [(text, "length")])
    assert calls == THREE[:complete] and finish == "length"
    assert (content or "") == before
    for stopped in (text, before + CALLS, "Hi <", CALLS + "<tool_call>[1]"):
        assert plain(tokenizer, True, choice, [(stopped, "stop")]) == \
            plain(tokenizer, False, choice, [(stopped, "stop")])


@pytest.mark.parametrize("choice", ["required", "auto", NAMED], ids=["required", "auto", "named"])
def test_streamed_the_cut_call_is_announced_and_the_answer_says_length(tokenizer, choice):
    """Streamed (the engine's own path on vLLM 0.32, no hook): each call as it is written, the cut
    one too, content only the text before the first call, finish_reason length. The non-streamed
    answer's calls are the streamed ones less the cut call."""
    text = "Sure. " + CALLS + CUT_CALL
    finish, content, calls = streamed(tokenizer, True, choice, text)
    assert (finish, content) == ("length", "Sure. ")
    assert calls == THREE + [("a", '{"city": "Ber')]
    ((p_finish, p_content, p_calls),) = plain(tokenizer, True, choice, [(text, "length")])
    assert (p_finish, p_content, p_calls) == (finish, content, calls[:-1])


@pytest.mark.parametrize("tail, kept", [
    ("", 3),  # the cut fell right after a call
    ("\n", 3),
    ("<tool_c", 3),  # ... in the next call's tag
    ("<tool_call>", 3),
    ("<tool_call>\n", 3),
    ('<tool_call>\n{"name": "a"', 3),
    ('<tool_call>\n{"name": "a", "arguments": {"city": "B}}</tool_call>', 3),  # tags inside a string
    ('<tool_call>\n{"name": "a", "arguments": {"city": "Berlin"}}', 4),  # complete, no closing tag yet
    ('<tool_call>\n{"name": "a", "arguments": {"city": "Berlin"}}\n</tool_', 4),  # its tag cut
])
def test_the_cut_falls_anywhere(tokenizer, tail, kept):
    """Wherever the cut falls after three complete calls: those calls (and a fourth whose JSON was
    complete), no content, finish_reason length; with tool_choice auto the engine would say
    tool_calls where it reads the calls."""
    text = CALLS + tail
    engine = plain(tokenizer, False, "auto", [(text, "length")])
    ((finish, content, calls),) = plain(tokenizer, True, "auto", [(text, "length")])
    assert finish == "length" and content is None
    assert calls == (THREE + [("a", '{"city": "Berlin"}')])[:kept]
    if engine[0][2]:
        assert engine[0][0] == "tool_calls"  # the premise where the engine reads the calls


@contextlib.contextmanager
def _answer_cut():
    """As while the hooked answer builder runs for one answer the engine ended with length."""
    outputs = tcc.Outputs()
    outputs.reasons, outputs.texts = {0: "length"}, {0: ""}
    token = tcc.OUTPUTS.set(outputs)
    try:
        yield
    finally:
        tcc.OUTPUTS.reset(token)


def test_every_prefix_of_a_run_of_calls_keeps_the_calls_complete_in_it(tokenizer):
    """Every prefix of calls (tags and brackets inside their strings, text around them), read as a
    cut answer where vLLM 0.32 reads an answer's calls (DelegatingParser._extract_tool_calls,
    hooked): exactly the calls whose JSON is complete in the prefix, and the text before the first
    call as content, less a cut tag at its end (as the engine's stream holds it back:
    partial_tag_overlap)."""
    from vllm.tool_parsers.utils import partial_tag_overlap

    request = _request("auto")
    parser = _hermes_parsers(True)(tokenizer, request.tools, model_config=None)
    rng = random.Random(5)
    for _ in range(12):
        before = rng.choice(["", "Sure. ", "a <b "])
        text, calls, ends = before, [], []
        for i in range(rng.randrange(1, 4)):
            args = {"k": rng.choice(["x", "</tool_call>", "<tool_call>", '{["', "é"]) * rng.randrange(3),
                    "n": rng.randrange(100)}
            body = json.dumps({"name": f"f{i}", "arguments": args}, ensure_ascii=False)
            text += "<tool_call>\n" + body
            ends.append(len(text))
            text += "\n</tool_call>" + rng.choice(["", "\n", " x "])
            calls.append((f"f{i}", json.dumps(args, ensure_ascii=False)))
        for cut in range(len(text) + 1):
            part = text[:cut]
            with _answer_cut():
                got, content = parser._extract_tool_calls(part, request, enable_auto_tools=True)
            want = calls[: sum(e <= cut for e in ends)]
            assert [(c.name, c.arguments) for c in got or []] == want, part
            lead = part[: len(before)]
            lead = lead[: len(lead) - partial_tag_overlap(lead, "<tool_call>")] if cut <= len(before) else before
            assert (content or "") == lead, part
    # no answer being built (the Responses API, a direct call): no cut is known, the engine reads
    text = CALLS + CUT_CALL
    assert not tcc.answer_was_cut(text)
    assert parser._extract_tool_calls(text, request, enable_auto_tools=True) == (None, text)


# ---- the JSON path of forced calls (1Cat's for hermes; vLLM 0.32's without a structural tag) --

ARRAY = ('[{"name": "a", "parameters": {"city": "Paris"}}, {"name": "b", "parameters": {"city": "Rome"}}, '
         '{"name": "c", "parameters": {"city": "Oslo"}}, {"name": "a", "parameters": {"city": "Ber')


def test_a_cut_required_array_keeps_its_complete_elements(tokenizer):
    """The engine validates the array whole (pydantic): a cut one gives no call. Hooked, every
    prefix of an array (brackets and quotes inside its strings) gives the elements complete in it;
    a closed array, one the model ended, and text that is not an array are the engine's."""
    ((finish, content, calls),) = plain(tokenizer, False, "required", [(ARRAY, "length")], json_forced=True)
    assert (finish, content, calls) == ("length", "", [])  # the premise: pydantic refuses the cut array
    ((finish, content, calls),) = plain(tokenizer, True, "required", [(ARRAY, "length")], json_forced=True)
    assert (finish, content, calls) == ("length", "", THREE)

    elements = [{"name": "a", "parameters": {"s": "]},{\"x"}}, {"name": "b", "parameters": {"n": [1, {"m": 2}]}},
                {"name": "c", "parameters": {}}]
    text = " [" + ",\n ".join(json.dumps(e) for e in elements) + "]"
    ends = [text.index(json.dumps(e)) + len(json.dumps(e)) for e in elements]
    for cut in range(len(text) + 1):
        ((_, _, calls),) = plain(tokenizer, True, "required", [(text[:cut], "length")], json_forced=True)
        assert [(n, json.loads(a)) for n, a in calls] == \
            [(e["name"], e["parameters"]) for e in elements[:sum(e <= cut for e in ends)]], text[:cut]
    for stopped in (ARRAY, ARRAY[: ARRAY.rindex(", {")] + "]", text):
        assert plain(tokenizer, True, "required", [(stopped, "stop")], True) == \
            plain(tokenizer, False, "required", [(stopped, "stop")], True)
    assert tcc.complete_array_part('{"name": "a"') == '{"name": "a"'  # not an array: the engine's
    assert tcc.complete_array_part('[1, {"a"') == '[1, {"a"'


def test_a_cut_named_call_on_the_json_path_is_no_call(tokenizer):
    ((_, _, calls),) = plain(tokenizer, False, NAMED, [('{"city": "Ber', "length")], json_forced=True)
    assert calls == [("a", '{"city": "Ber')]  # the premise: the cut arguments as a call
    assert plain(tokenizer, True, NAMED, [('{"city": "Ber', "length")], json_forced=True) == [("length", "", [])]
    whole = plain(tokenizer, True, NAMED, [('{"city": "Berlin"}', "length")], json_forced=True)
    assert whole == [("length", "", [("a", '{"city": "Berlin"}')])]


# ---- several choices, and 1Cat's stream --------------------------------------------------

def test_with_several_choices_each_answer_is_judged_by_its_own_finish(tokenizer):
    """n = 2: the cut answer gets its calls (the engine: none), the one the model ended is the
    engine's."""
    cut, whole = "Sure. " + CALLS + CUT_CALL, "Hi. " + CALLS + "<tool_call>[1]"
    got = plain(tokenizer, True, "auto", [(cut, "length"), (whole, "stop")])
    assert got[0] == ("length", "Sure. ", THREE)
    assert got[1] == plain(tokenizer, False, "auto", [(cut, "length"), (whole, "stop")])[1]


def test_keep_length_rewrites_only_a_cut_choices_tool_calls_finish():
    """tool-call-cut-stream's rewrite of 1Cat's events (1Cat's own stream: tests/test_tool_call_cut_1cat.py)."""
    outputs = tcc.Outputs()
    outputs.reasons = {0: "length", 1: "stop"}
    line = 'data: {"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    assert tcc.keep_length(line, outputs) == line.replace('"tool_calls"', '"length"')
    other = line.replace('"index":0', '"index":1')
    assert tcc.keep_length(other, outputs) == other
    for unchanged in ("data: [DONE]\n\n", line.replace("tool_calls", "stop"),
                      'data: {"choices":[{"index":0,"delta":{"content":"\\"finish_reason\\":\\"tool_calls\\""}}]}\n\n'):
        assert tcc.keep_length(unchanged, outputs) == unchanged


# ---- 1Cat-vLLM 1.2.2 and 1.3.0 ----------------------------------------------------------------------

VERSIONS = engine_lock.versions("sm70")


@pytest.mark.parametrize("version", VERSIONS)
def test_1cat_builds_answers_where_the_hooks_wrap(version):
    """The hooks wrap, on 1Cat, the functions where it builds answers, and those have the shape the
    hooks rely on: the answer builders take the engine's results third; forced hermes calls go
    through the pydantic array (hermes has no structural tag there); the streamed finish says
    tool_calls whenever calls were streamed."""
    from qpn.fork_patches.engine.hooks import by_name

    key, hooks = f"sm70@{version}", ("tool-call-cut-plain", "tool-call-cut-parse", "tool-call-cut-stream")
    assert [by_name(n).anchor_for(key).rsplit(".", 1)[-1] for n in hooks] == [
        "chat_completion_full_generator", "_parse_tool_calls_from_content", "chat_completion_stream_generator"]
    assert all(by_name(n).applies_to(key) for n in hooks)
    chat = onecat_text(version, "entrypoints/openai/chat_completion/serving.py")
    for name in ("chat_completion_full_generator", "chat_completion_stream_generator"):
        head = chat[chat.index(f"async def {name}("):]
        head = head[: head.index(")")]
        assert [p.split(":")[0].strip() for p in head.split("(", 1)[1].split(",")][:3] == \
            ["self", "request", "result_generator"], head
    assert "self._parse_tool_calls_from_content(" in chat
    streamed_finish = "auto_tools_called\n" + " " * 28 + "or (tools_streamed[i] and not tool_choice_function_name)"
    assert streamed_finish in chat
    engine = onecat_text(version, "entrypoints/openai/engine/serving.py")
    assert "TypeAdapter(list[FunctionDefinition]).validate_json(" in engine
    assert "structural_tag_model" not in onecat_text(version, "tool_parsers/hermes_tool_parser.py")
    assert "json.loads(match[0] if match[0] else match[1])" in \
        onecat_text(version, "tool_parsers/hermes_tool_parser.py")


# ---- the Qwen3.x XML calls (qwen3_coder / qwen3_xml: the launcher's parser for those templates) --

def _xml_call(city: str) -> str:
    return (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            "</function>\n</tool_call>")


XML_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_a_cut_xml_call_is_no_call_and_the_complete_ones_stay(tokenizer):
    """vLLM 0.32's qwen3_coder parser returns the cut call as a call with its cut parameter dropped
    (get_weather with arguments {}): a client would run it. Through ``cut_content`` every prefix of
    a run of XML calls gives exactly the calls whose </tool_call> is in it, and the text before
    the first call as content."""
    xml = pytest.importorskip("vllm.tool_parsers.qwen3_engine_tool_parser")
    parser = xml.Qwen3EngineToolParser(tokenizer)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    tools=XML_TOOLS)
    cities = ["Paris", "Rome", "Oslo"]
    text = "Sure.\n" + "\n".join(_xml_call(c) for c in cities)
    cut = text[: text.index("Oslo") + 2]
    premise = parser.extract_tool_calls(cut, request)
    assert [json.loads(c.function.arguments) for c in premise.tool_calls][-1] == {}  # the bogus call
    ends = [text.index(_xml_call(c)) + len(_xml_call(c)) for c in cities]
    for n in range(len(text) + 1):
        kept = tcc.cut_content(text[:n], request, xml.Qwen3EngineToolParser, False)
        got = parser.extract_tool_calls(kept, request)
        want = cities[: sum(e <= n for e in ends)]
        assert [json.loads(c.function.arguments)["city"] for c in got.tool_calls] == want, text[:n]
        if want:
            assert (got.content or "").strip() == "Sure.", text[:n]
        assert "<tool_call" not in (got.content or "") and "<function" not in (got.content or "")


@pytest.mark.parametrize("version", ["cpu", *VERSIONS])
def test_the_xml_call_parsers_are_the_ones_named(version):
    """qwen3_coder and qwen3_xml resolve to classes XML_CALL_PARSERS names, in vLLM 0.32 and in both
    1Cat archives (whose parsers read calls by the same <tool_call> tags)."""
    if version == "cpu":
        import vllm.tool_parsers as registry_mod

        text = inspect.getsource(registry_mod)
    else:
        text = onecat_text(version, "tool_parsers/__init__.py")
    for name in ("qwen3_coder", "qwen3_xml"):
        block = text[text.index(f'"{name}": ('):]
        cls = block[: block.index(")")].split(",")[1].strip().strip('"')
        assert cls in tcc.XML_CALL_PARSERS, (version, name, cls)
    if version != "cpu":
        parser = onecat_text(version, "tool_parsers/qwen3coder_tool_parser.py")
        assert 'self.tool_call_start_token: str = "<tool_call>"' in parser
        assert 'self.tool_call_end_token: str = "</tool_call>"' in parser
