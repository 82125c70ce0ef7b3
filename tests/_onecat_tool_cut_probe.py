# Appended to engine_source's import probe (plugin registered against a 1Cat-vLLM source tree
# first on sys.path, QPN_ENGINE=sm70): 1Cat's own chat answer builders, non-streamed and streamed,
# on an answer max_tokens cut after complete tool calls, with our tool-call-cut hooks (as the plugin
# applied them) and without (the engine's functions unwrapped: the parse-level hooks then see no
# cut and pass through). Stand-ins only for the serving object's constructor (its engine client).
# Prints one JSON line QPN_TOOL_CUT_1CAT (tests/test_tool_call_cut.py).
import asyncio
import inspect
import json
import tempfile
from types import SimpleNamespace

from transformers import AutoTokenizer

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.parser import ParserManager
from vllm.reasoning import ReasoningParserManager  # noqa: F401 (registers the parsers)

from qpn.scripts.checkpoints import tiny_tokenizer

_tok_dir = tempfile.mkdtemp()
tiny_tokenizer.write_tokenizer(_tok_dir, 512, 4096)
tokenizer = AutoTokenizer.from_pretrained(_tok_dir)
# the prompt's end as the chat template writes it with thinking off: the reasoning has ended
PROMPT_IDS = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)

serving = object.__new__(OpenAIServingChat)
serving.__dict__.update(
    response_role="assistant", enable_auto_tools=True, use_harmony=False, tool_call_id_type="random",
    tool_parser=ParserManager.get_tool_parser(tool_parser_name="hermes", enable_auto_tools=True, model_name="m"),
    parser_cls=ParserManager.get_parser(tool_parser_name="hermes", reasoning_parser_name="qwen3",
                                        enable_auto_tools=True, model_name="m"),
    reasoning_parser_cls=ParserManager.get_reasoning_parser(reasoning_parser_name="qwen3"),
    enable_prompt_tokens_details=False, enable_force_include_usage=False, enable_log_outputs=False,
    enable_log_deltas=True, request_logger=None, system_fingerprint=None, chat_template=None,
    chat_template_content_format="auto", default_chat_template_kwargs={},
    return_tokens_as_token_ids=False)

HOOKED = {"full": OpenAIServingChat.chat_completion_full_generator,
          "stream": OpenAIServingChat.chat_completion_stream_generator}
ENGINE = {k: inspect.unwrap(v) for k, v in HOOKED.items()}


def _tool(name):
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}


def _request(choice, stream):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=[_tool("a"), _tool("b"), _tool("c")], tool_choice=choice,
                                 stream=stream, max_tokens=200, parallel_tool_calls=True,
                                 chat_template_kwargs={"enable_thinking": False})


async def _results(text, finish, pieces):
    cuts = sorted({len(text) * i // pieces for i in range(1, pieces)} | {len(text)})
    prev = 0
    for c in cuts:
        last = c == len(text)
        yield RequestOutput(request_id="r", prompt="p", prompt_token_ids=PROMPT_IDS, prompt_logprobs=None,
                            outputs=[CompletionOutput(index=0, text=text[prev:c], token_ids=[5] * (c - prev),
                                                      cumulative_logprob=None, logprobs=None,
                                                      finish_reason=finish if last else None)],
                            finished=last)
        prev = c


async def _plain(which, choice, text, finish):
    reasoning_parser = serving.reasoning_parser_cls(tokenizer, chat_template_kwargs={"enable_thinking": False})
    resp = await ENGINE["full"](serving, _request(choice, False), _results(text, finish, 1), "id", "m", [],
                                tokenizer, SimpleNamespace(final_usage_info=None), reasoning_parser) \
        if which == "engine" else \
        await HOOKED["full"](serving, _request(choice, False), _results(text, finish, 1), "id", "m", [],
                             tokenizer, SimpleNamespace(final_usage_info=None), reasoning_parser)
    c = resp.choices[0]
    return {"finish": c.finish_reason, "content": c.message.content,
            "calls": [[t.function.name, t.function.arguments] for t in c.message.tool_calls or []]}


async def _stream(which, choice, text, finish):
    fn = ENGINE["stream"] if which == "engine" else HOOKED["stream"]
    content, calls, finishes = "", {}, []
    async for line in fn(serving, _request(choice, True), _results(text, finish, len(text) // 2), "id", "m", [], tokenizer,
                         SimpleNamespace(final_usage_info=None), None, {"enable_thinking": False}):
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:]).get("choices") or []:
            d = ch.get("delta") or {}
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], ["", ""])
                f = tc.get("function") or {}
                entry[0] += f.get("name") or ""
                entry[1] += f.get("arguments") or ""
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
    return {"finish": finishes, "content": content, "calls": [calls[i] for i in sorted(calls)]}


def _hermes(name, city):
    return '<tool_call>\n{"name": "%s", "arguments": {"city": "%s"}}\n</tool_call>' % (name, city)


HERMES = "Sure. " + _hermes("a", "Paris") + _hermes("b", "Rome") + _hermes("c", "Oslo") + \
    '<tool_call>\n{"name": "a", "arguments": {"city": "Ber'
ARRAY = '[{"name": "a", "parameters": {"city": "Paris"}}, {"name": "b", "parameters": {"city": "Rome"}}, ' \
    '{"name": "c", "parameters": {"city": "Oslo"}}, {"name": "a", "parameters": {"city": "Ber'
NAMED = '{"city": "Ber'
CASES = {"auto": ("auto", HERMES), "required": ("required", ARRAY),
         "named": ({"type": "function", "function": {"name": "a"}}, NAMED)}

out = {"chains": {k: plugin.hooks_on_chain(v) for k, v in HOOKED.items()},  # noqa: F821 (the probe's)
       "required_supported": serving.tool_parser.supports_required_and_named, "cases": {}}
for label, (choice, text) in CASES.items():
    row = {}
    for which in ("engine", "hooked"):
        row[which] = {"plain": asyncio.run(_plain(which, choice, text, "length")),
                      "stream": asyncio.run(_stream(which, choice, text, "length"))}
    # the same answer ended by the model itself: the engine's reading, hooked or not
    complete = {"auto": HERMES[: HERMES.rindex("<tool_call>")], "required": ARRAY[: ARRAY.rindex(", {")] + "]",
                "named": '{"city": "Berlin"}'}[label]
    row["stop"] = {which: asyncio.run(_plain(which, choice, complete, "stop")) for which in ("engine", "hooked")}
    out["cases"][label] = row
print("QPN_TOOL_CUT_1CAT " + json.dumps(out))
