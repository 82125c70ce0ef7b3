"""Tool calls under MTP on the cpu engine (issue 12 item 1): the request that killed the engine,
and the matrix around it, against real servers.

One server per depth K (0 = no speculation, the reference; 1, 3, 7), each booted once for the
module and stopped before the next boots. Every request runs greedy (temperature 0) and alone
on its server (MAX_NUM_SEQS says why). Against the answers
without speculation, the failing request must be identical and every other answer identical or
leaving them only at a bf16 near-tie with the logprobs before it within rounding noise
(test_agreement_with_no_speculation says why exact equality is not a property of this engine in
bf16, with the figures); the exactness of the fixed state update itself is proved below the
server, against the engine's own kernels, in tests/test_spec_state.py.

The failing request: ``tool_choice="required"``, thinking off, temperature 0, on a fresh ``K=3``
server (it died with ``causal_conv1d_update_cpu: num_accepted_tokens must be in [1, seqlen]`` on
AMX hosts, ``The size of tensor a (6) must match the size of tensor b (5)`` elsewhere). It runs
50 times. The matrix: strict and non-strict tool x auto and required x streamed or not x thinking
on and off, at every K.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests._server import VllmServer, engine_python

pytestmark = [pytest.mark.engine, pytest.mark.slow]

openai = pytest.importorskip("openai")

DEPTHS = (1, 3, 7)
FAILING_REPEATS = 50
MATRIX_MAX_TOKENS = 48
FAILING_MAX_TOKENS = 96  # the crash needs a round that accepted a draft, then a trimmed round
# One request at a time (--max-num-seqs 1). Sending 4 at a time took the K=3 matrix from 94 s
# to 23 s and matched the one-by-one answers in one measurement, but the batch a request lands
# in depends on timing, and the cpu engine's bf16 results depend on the batch: in a two-worker
# suite run the K=1 thinking-on answers, streamed and plain, came out different. Greedy answers
# that tests compare exactly must not depend on the machine's load.
MAX_NUM_SEQS = 1
TOP_LOGPROBS = 2
# Bounds for "differs from the server without speculation only by rounding" (see
# test_agreement_with_no_speculation). Logits are bf16 around 8-16 here, so logprob gaps come in
# steps of 1/16. Measured against K=0 (the 9 non-streamed kinds at K=1, 3 and 7, the same 7
# divergences at each; also two free chats and a plain completion at K=3): every first
# divergence swaps the two servers' top-2 pair with gaps <= 0.3125 on either side; before it,
# the shared tokens' logprobs differ by at most 0.26. With our gdn-spec-rows-full-width hook
# removed (K=3), the grammar-bound thinking-off answers leave at gaps of 1.4 to 9.2.
NEAR_TIE = 0.5
LOGPROB_NOISE = 0.5


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


def _case(strict: bool, choice: str, stream: bool, thinking: bool, max_tokens: int) -> dict:
    return {"strict": strict, "choice": choice, "stream": stream, "thinking": thinking,
            "max_tokens": max_tokens}


FAILING = _case(False, "required", False, False, FAILING_MAX_TOKENS)
MATRIX = [_case(*combo, MATRIX_MAX_TOKENS)
          for combo in itertools.product((False, True), ("auto", "required"), (False, True),
                                         (False, True))]


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
    logprobs = None
    try:
        if case["stream"]:
            content, reasoning, calls = [], [], {}
            for chunk in client.chat.completions.create(stream=True, **kw):
                for choice in chunk.choices:
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
                    "calls": [calls[i] for i in sorted(calls)]}
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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec-tools") / "ckpt"
    subprocess.run([engine_python(), "-m", "qpn.scripts.checkpoints.make_checkpoint", str(path), "--seed", "0"],
                   check=True, capture_output=True, timeout=600)
    return str(path)


def _serve_and_ask(ckpt: str, k: int, cases: list[tuple[dict, int]]) -> dict:
    from qpn.scripts.launcher.serve import tool_parser_for

    args = ["--no-enable-prefix-caching", "--reasoning-parser", "qwen3",
            "--enable-auto-tool-choice", "--tool-call-parser", tool_parser_for(ckpt) or "hermes"]
    if k:
        args += ["--speculative-config", json.dumps(
            {"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": "greedy"})]
    results: dict[str, list[dict]] = {}
    with VllmServer(ckpt, extra_args=args, served_model_name="ckpt", boot_timeout_s=900,
                    max_num_seqs=MAX_NUM_SEQS) as server:
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


@pytest.fixture(scope="module")
def reference(ckpt):
    return _serve_and_ask(ckpt, 0, [(FAILING, 1)] + [(c, 1) for c in MATRIX])


_RUNS: dict[int, dict] = {}  # K -> answers, kept for the cross-depth comparison


def _run_depth(ckpt: str, k: int) -> dict:
    if k not in _RUNS:
        repeats = FAILING_REPEATS if k == 3 else 1
        _RUNS[k] = _serve_and_ask(ckpt, k, [(FAILING, repeats)] + [(c, 1) for c in MATRIX])
    return _RUNS[k]


@pytest.fixture(scope="module", params=DEPTHS, ids=lambda k: f"K{k}")
def served(request, ckpt, reference):
    return request.param, _run_depth(ckpt, request.param)


def _no_5xx(results: list[dict], log: str) -> None:
    bad = [r for r in results if r["status"] != 200]
    assert not bad, f"{len(bad)} of {len(results)} failed: {bad[:3]}\nserver log tail:\n{log}"


def _flat(text: dict) -> str:
    """Everything an answer carried, in order: reasoning, content, tool calls."""
    return text["reasoning"] + text["content"] + "".join(n + a for n, a in text["calls"])


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
    traced); this test fails on that."""
    k, results = served
    answers = results[_key(FAILING)]
    _no_5xx(answers, results["_log"])
    first = answers[0]["text"]
    assert first["calls"] or first["content"], first
    for i, a in enumerate(answers):
        assert a["text"] == first, f"K={k} repeat {i}: {a['text']} != {first}"


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: "-".join(
    [("strict" if c["strict"] else "loose"), c["choice"], ("stream" if c["stream"] else "plain"),
     ("think" if c["thinking"] else "nothink")]))
def test_matrix_answers_and_stream_matches_plain(served, case):
    """Every combination answers 200 at every K, and the streamed answer carries the same
    generated text as the non-streamed one (same engine path, greedy). One difference is vLLM's
    parser's, not the engine's: a tool call cut by max_tokens comes back as raw ``<tool_call>``
    text without streaming and as a partial call when streamed; then the streamed call's name
    and arguments must be that raw text."""
    k, results = served
    (answer,) = results[_key(case)]
    _no_5xx([answer], results["_log"])
    twin = dict(case, stream=not case["stream"])
    (other,) = results[_key(twin)]
    plain, streamed = (other["text"], answer["text"]) if case["stream"] else (answer["text"], other["text"])
    same = (plain["content"], plain["reasoning"], plain["calls"]) == \
        (streamed["content"], streamed["reasoning"], streamed["calls"])
    if not same:
        assert plain["finish"] == "length" and not plain["calls"] and "<tool_call>" in plain["content"], \
            f"K={k}: streamed and plain answers differ: {plain} vs {streamed}"
        assert plain["reasoning"] == streamed["reasoning"]
        assert streamed["calls"], streamed
        for name, arguments in streamed["calls"]:
            assert f'"name": "{name}"' in plain["content"] and arguments in plain["content"], \
                f"K={k}: the streamed call is not the plain answer's text: {plain} vs {streamed}"


def test_agreement_with_no_speculation(served, reference):
    """Greedy answers against the same requests without speculation: equal, or leaving them only
    where bf16 rounding can. Exact equality is not a property of this engine in bf16: its
    speculative GDN path (torch conv loop, which rounds the conv output to bf16 before the SiLU,
    and the fused multi-slot SSM op) and its plain decode path (C++ conv rounding once,
    single-slot op) differ by 0.2 to 4.6 bf16 ulps per token on the same inputs (measured on the
    engine's own functions; the difference does not grow over 48 tokens and is bitwise the same
    for partly accepted rounds as for full ones), and random weights put exact top-2 ties inside
    the reference's own answers. float32 is not available to compare: the engine's CPU GDN op
    asserts bf16 activations (docs/serving.md).

    Asserted, per non-streamed request kind: the failing request's tokens equal the reference's
    (measured at every K); any other answer either equals the reference or (a) before the first
    differing token, the shared tokens' logprobs differ by at most LOGPROB_NOISE, and (b) at it,
    the two servers pick the two tokens of the same top-2 pair, each a near-tie (gap <=
    NEAR_TIE) on both servers. Measured: at K=1, 3 and 7, the same 2 of the 9 kinds identical
    and the same 7 first divergences (after 2 to 29 tokens, gaps <= 0.3125, logprobs before
    them within 0.26), tool_choice auto (no draft trimmed, the hook idle) included. A misplaced
    conv history fails this: with our gdn-spec-rows-full-width hook removed (K=3, measured), the
    three grammar-bound thinking-off answers (two identical with the hook, one leaving at token
    29 on a near-tie) leave the reference at tokens 3, 8 and 11 at top-2 gaps of 1.4 to 9.2, one
    not even a swap of the pair."""
    k, results = served
    rows = _agreement(k, results, reference)
    print(f"K={k}: identical {sum(d is None for _, d in rows)}/{len(rows)}; divergences: "
          + "; ".join(f"at {d['at']} gaps {d['gaps']} noise {d['noise']:.3f}"
                      for _, d in rows if d is not None))
    failing = dict(rows)[_key(FAILING)]
    assert failing is None, f"K={k}: the failing request's answer leaves the reference: {failing}"
    for key, d in rows:
        if d is None:
            continue
        assert d["noise"] <= LOGPROB_NOISE, f"K={k} {key}: logprobs moved by {d['noise']:.3f} " \
            f"before the first differing token (rounding moves them <= {LOGPROB_NOISE}): {d}"
        assert d["swap"] and max(d["gaps"]) <= NEAR_TIE, \
            f"K={k} {key}: the answer leaves the reference off a near-tie: {d}"


def test_every_depth_gives_the_same_answers(ckpt, reference):
    """K=1, 3 and 7 trim drafts at different places under a grammar (a forced call trims where
    the drafts break the schema), so their rounds have different widths; with the GDN state
    kept right, the greedy answers with thinking off (the failing request and half the matrix)
    do not depend on K. Without the hook, K=3 died on the failing request, and a short row
    misplaces the conv history, which changes the text. With thinking on, the free reasoning
    text verifies K+1 rows at a time and can meet a bf16 near-tie differently at different K
    (seen in an earlier session: K=1 against K=3 and 7 after about 50 characters; none in this
    session's runs), so those are recorded only."""
    runs = {k: _run_depth(ckpt, k) for k in DEPTHS}
    differing = []
    for case in [FAILING] + MATRIX:
        texts = {k: runs[k][_key(case)][0]["text"] for k in DEPTHS}
        first = texts[DEPTHS[0]]
        for k, text in texts.items():
            if text == first:
                continue
            assert case["thinking"], f"{_key(case)}: K={k} {text} != K={DEPTHS[0]} {first}"
            differing.append((_key(case), k))
    print(f"thinking-on answers that differ across K: {differing}")
