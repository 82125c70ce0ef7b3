"""Tool calls under MTP on the cpu engine (issue 12 item 1): the request that killed the engine,
and the matrix around it, against real servers.

One server per depth K (0 = no speculation, the reference; 1, 3, 7), each booted once and
stopped before the next boots; tests/test_sampled_serving.py asks the same servers, so each K
boots once for both files, this file's requests first on the fresh server (tests/_mtp_servers.py).
Every request runs greedy (temperature 0) and alone on its server (MAX_NUM_SEQS says why). Every answer, streamed or not, must be identical to the
answer without speculation: the same text, and for non-streamed answers the same tokens with the
same log-probabilities, bit for bit. That holds because every step of the cpu engine gives a
verified token the bits the one-token decode gives it (our hooks in fork_patches/spec/spec_identity.py
and the row-by-row QPN CPU linear; tests/test_spec_state.py proves each step below the server).

The failing request: ``tool_choice="required"``, thinking off, temperature 0, on a fresh ``K=3``
server (it died with ``causal_conv1d_update_cpu: num_accepted_tokens must be in [1, seqlen]`` on
AMX hosts, ``The size of tensor a (6) must match the size of tensor b (5)`` elsewhere). It runs
50 times. The matrix: strict and non-strict tool x auto and required x streamed or not x thinking
on and off, at every K.

The cut (issue 40 item 5): three strict tools, parallel calls, ``max_tokens`` reached in the middle
of a call after complete ones (``min_tokens`` equal to it, so the model cannot stop first), with
``tool_choice`` required (on the server without speculation and at K=3) and auto (hermes
``<tool_call>`` blocks, without speculation), streamed and not (fork_patches/api/tool_call_cut.py; below
the server: tests/test_tool_call_cut.py).
"""
from __future__ import annotations

import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import _mtp_servers

pytestmark = [pytest.mark.engine, pytest.mark.slow]

openai = pytest.importorskip("openai")

DEPTHS = (1, 3, 7)
FAILING_REPEATS = 50
MATRIX_MAX_TOKENS = 48
FAILING_MAX_TOKENS = 96  # the crash needs a round that accepted a draft, then a trimmed round
# One request at a time (--max-num-seqs 1). Sending 4 at a time took the K=3 matrix from 94 s
# to 23 s, but then one request's prefill can share an engine step with another's decode, and a
# batch of more than 64 rows runs the QPN CPU linear batched (kernels/reference.py
# ROW_INVARIANT_MAX_M), whose float32 sums depend on the batch: answers would depend on timing.
MAX_NUM_SEQS = 1
TOP_LOGPROBS = 2
CUT_MAX_TOKENS = 160  # with the cut tools' short arguments, a few complete calls and a cut one
TOOL_CALL_BIAS = 3  # logit bias on <tool_call> for tool_choice auto: the random model calls tools
# The cut cases run on these servers only (CI time): required at K=0 and K=3, auto (which needs the
# logit bias, refused under speculation: "The min_p and logit_bias sampling parameters are not yet
# supported with speculative decoding") at K=0.
CUT_RUNS = (("required", 0), ("required", 3), ("auto", 0))


def _tool(strict: bool) -> dict:
    params = {"type": "object",
              "properties": {"city": {"type": "string"},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city"]}
    fn = {"name": "get_weather", "description": "Current weather for a city", "parameters": params}
    if strict:
        params["additionalProperties"] = False
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _cut_tools() -> list[dict]:
    """Three strict tools whose arguments are short (a bounded string and an enum), so that a few
    calls complete within CUT_MAX_TOKENS."""
    params = {"type": "object",
              "properties": {"city": {"type": "string", "maxLength": 6},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    return [{"type": "function", "function": {"name": name, "description": desc, "strict": True,
                                              "parameters": params}}
            for name, desc in (("get_weather", "Current weather"), ("get_time", "Local time"),
                               ("get_news", "Headlines"))]


def _case(strict: bool, choice: str, stream: bool, thinking: bool, max_tokens: int) -> dict:
    return {"strict": strict, "choice": choice, "stream": stream, "thinking": thinking,
            "max_tokens": max_tokens}


def _cut_case(choice: str, stream: bool) -> dict:
    return dict(_case(True, choice, stream, False, CUT_MAX_TOKENS), cut=True)


FAILING = _case(False, "required", False, False, FAILING_MAX_TOKENS)
MATRIX = [_case(*combo, MATRIX_MAX_TOKENS)
          for combo in itertools.product((False, True), ("auto", "required"), (False, True),
                                         (False, True))]


def _cut_cases(k: int) -> list[dict]:
    return [_cut_case(choice, stream) for choice, depth in CUT_RUNS if depth == k for stream in (False, True)]


_TOOL_CALL_TOKEN: list[int] = []  # the checkpoint's <tool_call> token id (set with its server)


def _key(case: dict) -> str:
    return json.dumps(case, sort_keys=True)


def _ask(client, model: str, case: dict) -> dict:
    """{"status": HTTP status or "connection", "text": everything the answer carried,
    "logprobs": per generated token [token, logprob, top-2 [[token, logprob], ...]] (non-streamed
    answers only)}."""
    kw = dict(model=model, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
              tools=[_tool(case["strict"])], tool_choice=case["choice"], temperature=0,
              max_tokens=case["max_tokens"],
              extra_body={"chat_template_kwargs": {"enable_thinking": case["thinking"]}})
    if case.get("cut"):
        kw.update(messages=[{"role": "user", "content": "Weather, time and news for Paris?"}],
                  tools=_cut_tools(), parallel_tool_calls=True)
        kw["extra_body"]["min_tokens"] = case["max_tokens"]
        if case["choice"] == "auto":
            kw["logit_bias"] = {str(_TOOL_CALL_TOKEN[0]): TOOL_CALL_BIAS}
    logprobs = None
    try:
        if case["stream"]:
            content, reasoning, calls, finish = [], [], {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    d = choice.delta
                    content.append(d.content or "")
                    reasoning.append(getattr(d, "reasoning", None) or "")
                    for tc in d.tool_calls or []:
                        entry = calls.setdefault(tc.index, ["", ""])
                        if tc.function and tc.function.name:
                            entry[0] += tc.function.name
                        if tc.function and tc.function.arguments:
                            entry[1] += tc.function.arguments
            text = {"content": "".join(content), "reasoning": "".join(reasoning),
                    "calls": [calls[i] for i in sorted(calls)], "finish": finish}
        else:
            r = client.chat.completions.create(logprobs=True, top_logprobs=TOP_LOGPROBS, **kw)
            m = r.choices[0].message
            logprobs = [[t.token, t.logprob, [[x.token, x.logprob] for x in t.top_logprobs]]
                        for t in r.choices[0].logprobs.content or []]
            text = {"content": m.content or "", "reasoning": getattr(m, "reasoning", None) or "",
                    "calls": [[c.function.name, c.function.arguments] for c in m.tool_calls or []],
                    "finish": r.choices[0].finish_reason}
        return {"status": 200, "text": text, "logprobs": logprobs}
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "text": str(exc)[:300]}
    except openai.APIConnectionError as exc:
        return {"status": "connection", "text": str(exc)[:300]}
    except openai.APIError as exc:  # an error event inside a stream
        return {"status": "stream error", "text": str(exc)[:300]}


def _tool_call_token(ckpt: str) -> int:
    with open(os.path.join(ckpt, "tokenizer.json")) as f:
        (token,) = [t["id"] for t in json.load(f)["added_tokens"] if t["content"] == "<tool_call>"]
    return token


def _battery(server, k: int) -> dict:
    """This file's requests to the fresh K=``k`` server (the failing request first, as reported;
    FAILING_REPEATS times at K=3), one at a time: case key -> answers, "_log" -> the log tail."""
    assert server.max_num_seqs == MAX_NUM_SEQS
    _TOOL_CALL_TOKEN[:] = [_tool_call_token(server.model_dir)]
    cases = [(FAILING, FAILING_REPEATS if k == 3 else 1)] + [(c, 1) for c in MATRIX + _cut_cases(k)]
    results: dict[str, list[dict]] = {}
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
    # the first request on the fresh server is the failing request, as reported
    (first_case, repeats), rest = cases[0], cases[1:]
    first = _ask(client, "ckpt", first_case)
    jobs = [first_case] * (repeats - 1) + [case for case, n in rest for _ in range(n)]
    with ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        answers = list(pool.map(lambda case: _ask(client, "ckpt", case), jobs))
    for case, answer in zip([first_case] + jobs, [first] + answers):
        results.setdefault(_key(case), []).append(answer)
    results["_log"] = server.log_tail(60)
    return results


_mtp_servers.register("tool calls", _battery, __file__, first=True)


def _run_depth(ckpt, k: int) -> dict:
    return _mtp_servers.results(ckpt, k, "tool calls")


@pytest.fixture(scope="module")
def reference(mixed_checkpoint):
    return _run_depth(mixed_checkpoint, 0)


@pytest.fixture(scope="module", params=DEPTHS, ids=lambda k: f"K{k}")
def served(request, mixed_checkpoint, reference):
    return request.param, _run_depth(mixed_checkpoint, request.param)


def _no_5xx(results: list[dict], log: str) -> None:
    bad = [r for r in results if r["status"] != 200]
    assert not bad, f"{len(bad)} of {len(results)} failed: {bad[:3]}\nserver log tail:\n{log}"


def divergence(got: list, ref: list) -> dict | None:
    """Where a greedy answer leaves the reference, from both answers' per-token logprobs
    (``[token, logprob, top-2]``): None when the token sequences are equal, else the first
    differing position, both servers' top-2 there and the largest logprob difference of the
    shared tokens before it."""
    shared = 0
    for g, r in zip(got, ref):
        if g[0] != r[0]:
            break
        shared += 1
    if shared == len(got) == len(ref):
        return None
    noise = max((abs(g[1] - r[1]) for g, r in zip(got[:shared], ref[:shared])), default=0.0)
    if shared == min(len(got), len(ref)):  # one answer stopped early: no choice to compare
        return {"at": shared, "noise": noise, "swap": False, "gaps": None}
    top_g, top_r = got[shared][2], ref[shared][2]

    def gap(top):
        return top[0][1] - top[1][1] if len(top) > 1 else float("inf")

    swap = ({t for t, _ in top_g[:2]} == {t for t, _ in top_r[:2]} and
            top_g[0][0] == got[shared][0] and top_r[0][0] == ref[shared][0])
    return {"at": shared, "noise": noise, "swap": swap, "gaps": (gap(top_r), gap(top_g)),
            "tokens": (ref[shared][0], got[shared][0])}


def _non_streamed() -> list[dict]:
    return [FAILING] + [c for c in MATRIX if not c["stream"]]


def _agreement(k: int, results: dict, reference: dict) -> list[tuple[str, dict | None]]:
    """(case, divergence from the reference or None) per non-streamed request kind (a streamed
    answer's text equals its non-streamed twin's: test_matrix_answers_and_stream_matches_plain)."""
    rows = [(_key(case), divergence(results[_key(case)][0]["logprobs"],
                                    reference[_key(case)][0]["logprobs"]))
            for case in _non_streamed()]
    dump = os.environ.get("QPN_SPEC_AGREEMENT_DIR")
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"agreement_K{k}.json"), "w") as f:
            json.dump({"rows": rows, "answers": {key: v[0] for key, v in results.items()
                                                  if key != "_log"},
                       "reference": {key: v[0] for key, v in reference.items() if key != "_log"}},
                      f, indent=1)
    return rows


def test_reference_answers(reference):
    for key, results in reference.items():
        if key != "_log":
            _no_5xx(results, reference["_log"])


def test_failing_request_never_kills_the_engine(served):
    """50 times at K=3 (once at K=1 and 7): every answer 200, every repeat the same greedy text
    (a state the previous request left behind would change it). Measured with our
    gdn-spec-rows-full-width hook removed, on a fresh K=3 server of this checkpoint (19:38 UTC
    2026-11-30): the engine did not die in 3 repeats, but gave 3 different answers (a raw
    ``<tool_call>``, two calls with arguments ``Infinity`` and ``false``, a third text): the
    misplaced history can read conv columns the previous request left (our reading, not
    traced); this test fails on that. An answer cut in its first call has neither a call nor
    content (fork_patches/api/tool_call_cut.py), and says length."""
    k, results = served
    answers = results[_key(FAILING)]
    _no_5xx(answers, results["_log"])
    first = answers[0]["text"]
    assert first["calls"] or first["content"] or first["finish"] == "length", first
    for i, a in enumerate(answers):
        assert a["text"] == first, f"K={k} repeat {i}: {a['text']} != {first}"


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: "-".join(
    [("strict" if c["strict"] else "loose"), c["choice"], ("stream" if c["stream"] else "plain"),
     ("think" if c["thinking"] else "nothink")]))
def test_matrix_answers_and_stream_matches_plain(served, case):
    """Every combination answers 200 at every K, and the streamed answer carries the same
    generated text as the non-streamed one (same engine path, greedy). Three differences are
    allowed. An answer cut in the middle of a call (finish_reason length): the stream announced the
    cut call before the cut came, the plain answer has only the calls complete before it
    (fork_patches/api/tool_call_cut.py), the same content. Two are vLLM's hermes parser's (both seen
    with vLLM 0.32's parser replayed on such texts, 2026-12-02): a ``<tool_call>`` region the plain
    parser cannot read (malformed) comes back as raw text without streaming and as a partial call
    when streamed, whose name and arguments must be that raw text; and streamed content stops at
    the first ``<tool_call>`` or before a trailing prefix of that tag, which the plain answer
    returns as content. Nothing else may differ. Which text the random-weight model writes
    depends on the host's numerics, so the verdict must not (issue 29 item 6: red on an AMX host
    before the rule on content)."""
    k, results = served
    (answer,) = results[_key(case)]
    _no_5xx([answer], results["_log"])
    twin = dict(case, stream=not case["stream"])
    (other,) = results[_key(twin)]
    plain, streamed = (other["text"], answer["text"]) if case["stream"] else (answer["text"], other["text"])
    same = (plain["content"], plain["reasoning"], plain["calls"]) == \
        (streamed["content"], streamed["reasoning"], streamed["calls"])
    if not same and not plain["calls"] and not streamed["calls"]:
        # vLLM 0.32's hermes parser streams content only up to the first <tool_call> and holds back
        # a trailing prefix of that tag (waiting for the rest, never sent when the answer ends);
        # without streaming, text whose <tool_call> region does not parse is all content. Which
        # text a random-weight model writes depends on the host's numerics (on AMX hosts the
        # strict/auto/no-thinking answer ends in such text), so exactly these differences pass.
        rest = plain["content"][len(streamed["content"]):]
        assert plain["content"].startswith(streamed["content"]) and rest and (
            "<tool_call>".startswith(rest) or rest.startswith("<tool_call>")), \
            f"K={k}: streamed and plain answers differ: {plain} vs {streamed}"
        assert plain["reasoning"] == streamed["reasoning"]
    elif not same and plain["finish"] == "length" and "<tool_call>" not in plain["content"]:
        _cut_answers_agree(k, plain, streamed)
    elif not same:
        # a <tool_call> region the plain parser could not read (malformed): the streaming parser
        # still sends the name and arguments it finds in it
        assert not plain["calls"] and "<tool_call>" in plain["content"], \
            f"K={k}: streamed and plain answers differ: {plain} vs {streamed}"
        assert plain["reasoning"] == streamed["reasoning"]
        assert streamed["calls"], streamed
        for name, arguments in streamed["calls"]:
            assert f'"name": "{name}"' in plain["content"] and arguments in plain["content"], \
                f"K={k}: the streamed call is not the plain answer's text: {plain} vs {streamed}"


def _same_call(plain_call: list, streamed_call: list) -> bool:
    """One call, as the plain answer gives it (the engine writes the arguments with json.dumps) and
    as the stream gave it (the model's own text)."""
    try:
        return plain_call[0] == streamed_call[0] and json.loads(plain_call[1]) == json.loads(streamed_call[1])
    except ValueError:
        return False


def _cut_answers_agree(k: int, plain: dict, streamed: dict) -> None:
    """A cut answer (finish_reason length), plain and streamed: the stream announces each call as it
    is written, the cut one too; every streamed call but the last is complete, so the plain answer
    has each of them, in order, and the last one exactly when its JSON was complete; the same
    content, without call text; both say length (fork_patches/api/tool_call_cut.py)."""
    assert plain["finish"] == streamed["finish"] == "length", (plain, streamed)
    assert (plain["content"], plain["reasoning"]) == (streamed["content"], streamed["reasoning"]), \
        f"K={k}: {plain} vs {streamed}"
    assert "<tool_call>" not in plain["content"], plain
    assert len(streamed["calls"]) - 1 <= len(plain["calls"]) <= len(streamed["calls"]), \
        f"K={k}: the plain answer does not have the calls complete before the cut: {plain} vs {streamed}"
    for p, s in zip(plain["calls"], streamed["calls"]):
        assert _same_call(p, s), f"K={k}: plain call {p} is not the streamed {s}"


@pytest.mark.parametrize("choice, k", CUT_RUNS, ids=lambda v: f"K{v}" if isinstance(v, int) else v)
def test_a_cut_answer_keeps_its_complete_calls(mixed_checkpoint, reference, choice, k):
    """Issue 40 item 5: three strict tools, parallel calls, max_tokens reached in the middle of a
    call after complete ones (min_tokens holds the model from stopping first; tool_choice auto
    biased to <tool_call>, the hermes path). Measured before fork_patches/api/tool_call_cut.py (this
    checkpoint, K=0, 200 tokens): required gave three complete calls, the limit inside the fourth
    call's tag, and 0 tool_calls with the whole answer in content; auto the same with its text
    before the calls. Now the plain answer has every complete call (arguments a JSON object of the
    tool's two keys), content only the text before the first call, finish_reason length, and
    agrees with the stream (``_cut_answers_agree``); at K=3 both are the answers without
    speculation."""
    results = reference if k == 0 else _run_depth(mixed_checkpoint, k)
    answers = [results[_key(_cut_case(choice, stream))][0] for stream in (False, True)]
    _no_5xx(answers, results["_log"])
    plain, streamed = (a["text"] for a in answers)
    assert len(streamed["calls"]) >= 2, \
        f"the answer must hold a complete call before the cut to show anything: {streamed}"
    _cut_answers_agree(k, plain, streamed)
    assert plain["calls"], plain
    names = {t["function"]["name"] for t in _cut_tools()}
    for name, arguments in plain["calls"]:
        assert name in names and set(json.loads(arguments)) == {"city", "unit"}, (name, arguments)
    if k:
        for stream, answer in zip((False, True), answers):
            want = reference[_key(_cut_case(choice, stream))][0]["text"]
            assert answer["text"] == want, f"K={k}: {answer['text']} != without speculation {want}"


def test_identical_to_no_speculation(served, reference):
    """Every answer at K = 1, 3 and 7 is the answer without speculation: the failing request and
    all 16 matrix kinds (strict and non-strict tool x auto and required x streamed or not x
    thinking on and off), the same text; for the 9 non-streamed kinds also the same tokens with
    bitwise the same log-probabilities and top-2 alternatives (any rounding difference in any
    step moves them). Measured before the identity hooks (this checkpoint, same requests): 2 of
    the 9 non-streamed kinds identical at every K, the others leaving the reference after 2 to
    29 tokens at bf16 near-ties (top-2 gaps <= 0.3125), logprobs before that apart by up to
    0.26. A misplaced conv history (gdn-spec-rows-full-width removed, K=3) left at top-2 gaps of
    1.4 to 9.2. Identical also means the same across depths, whose grammar-trimmed rounds have
    different widths."""
    k, results = served
    rows = _agreement(k, results, reference)
    print(f"K={k}: token sequences identical {sum(d is None for _, d in rows)}/{len(rows)}")
    for key, d in rows:
        assert d is None, f"K={k} {key}: the answer leaves the answer without speculation: {d}"
    for case in [FAILING] + MATRIX:
        got, want = results[_key(case)][0], reference[_key(case)][0]
        _no_5xx([got], results["_log"])
        assert got["text"] == want["text"], \
            f"K={k} {_key(case)}: {got['text']} != without speculation {want['text']}"
        if got["logprobs"] is not None:
            assert got["logprobs"] == want["logprobs"], \
                f"K={k} {_key(case)}: same tokens, log-probabilities not bitwise equal"
