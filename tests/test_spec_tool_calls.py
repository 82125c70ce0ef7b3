"""Tool calls under MTP on the cpu engine (issue 12 item 1): the request that killed the engine,
and the matrix around it, against real servers.

One server per depth K (0 = no speculation, the reference; 1, 3, 7), each booted once for the
module and stopped before the next boots. Every request runs greedy (temperature 0). Exact
equality with the answers without speculation is measured and recorded, not asserted (see
test_agreement_with_no_speculation); the exactness of the fixed state update itself is proved
below the server, against the engine's own kernels, in tests/test_spec_state.py.

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

import pytest

from tests._server import VllmServer, engine_python

pytestmark = [pytest.mark.engine, pytest.mark.slow]

openai = pytest.importorskip("openai")

DEPTHS = (1, 3, 7)
FAILING_REPEATS = 50
MATRIX_MAX_TOKENS = 48
FAILING_MAX_TOKENS = 96  # the crash needs a round that accepted a draft, then a trimmed round


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
    """{"status": HTTP status or "connection", "text": everything the answer carried}."""
    kw = dict(model=model, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
              tools=[_tool(case["strict"])], tool_choice=case["choice"], temperature=0,
              max_tokens=case["max_tokens"],
              extra_body={"chat_template_kwargs": {"enable_thinking": case["thinking"]}})
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
            r = client.chat.completions.create(**kw)
            m = r.choices[0].message
            text = {"content": m.content or "", "reasoning": getattr(m, "reasoning", None) or "",
                    "calls": [[c.function.name, c.function.arguments] for c in m.tool_calls or []],
                    "finish": r.choices[0].finish_reason}
        return {"status": 200, "text": text}
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
    with VllmServer(ckpt, extra_args=args, served_model_name="ckpt", boot_timeout_s=900) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
        for case, repeats in cases:
            results[_key(case)] = [_ask(client, "ckpt", case) for _ in range(repeats)]
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


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _agreement(k: int, results: dict, reference: dict) -> list[tuple[str, int, int, bool]]:
    """(case, common prefix chars, reference chars, identical) per request kind."""
    rows = []
    for case in [FAILING] + MATRIX:
        got = _flat(results[_key(case)][0]["text"])
        ref = _flat(reference[_key(case)][0]["text"])
        rows.append((_key(case), _common_prefix(got, ref), len(ref), got == ref))
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
    (a state the previous request left behind would change it)."""
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
    """Greedy answers against the same requests without speculation. The cpu engine's
    speculative GDN path (torch conv loop + fused multi-slot SSM op) and its plain decode path
    (C++ conv + single-slot op) round bf16 differently, and on random weights the top logits
    are close (bf16 logits: top-2 gaps come in steps of 1/16, with exact ties within the first
    tokens), so an exact match is not a property of this engine even for requests without any
    grammar. The test asserts that the grammar-constrained answer of the failing request equals the answer without speculation at
    every K, and records the agreement of the rest (printed; QPN_SPEC_AGREEMENT_DIR keeps the
    answers)."""
    k, results = served
    rows = _agreement(k, results, reference)
    print(f"K={k}: identical {sum(r[3] for r in rows)}/{len(rows)}; common prefix chars "
          + ", ".join(f"{r[1]}/{r[2]}" for r in rows))
    failing = next(r for r in rows if r[0] == _key(FAILING))
    assert failing[3], (f"K={k}: the failing request's answer differs from the answer without "
                        f"speculation after {failing[1]} of {failing[2]} chars")


def test_every_depth_gives_the_same_answers(ckpt, reference):
    """K=1, 3 and 7 trim drafts at different places under a grammar (a forced call trims where
    the drafts break the schema), so their rounds have different widths; with the GDN state
    kept right, the greedy answers with thinking off (the failing request and half the matrix)
    do not depend on K. Without the hook, K=3 died on the failing request, and a short row
    misplaces the conv history, which changes the text. With thinking on, the free reasoning
    text verifies K+1 rows at a time and can meet a bf16 near-tie differently at different K
    (seen: K=1 against K=3 and 7 after about 50 characters), so those are recorded only."""
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
