"""Metric arithmetic of the benchmark harness on recorded streams, against hand-computed values.

The SSE lines below have the exact shape vLLM 0.32 streams (role chunk with empty content,
``reasoning`` deltas with a reasoning parser, a finish chunk, a usage chunk, ``[DONE]``);
the older-engine stream uses ``reasoning_content``. Timestamps are chosen by hand so that
every figure can be worked out on paper; the expected values are written as that arithmetic.
"""
import json

import pytest

from qpn.benchmarks import metrics
from qpn.benchmarks.client import StreamCut, parse_stream

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast


def _chunk(delta=None, finish=None):
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return "data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [choice]})


def _usage(prompt, completion, reasoning=None):
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return "data: " + json.dumps({"id": "c1", "choices": [], "usage": usage})


def _timed(pairs):
    out = []
    for t, line in pairs:
        out.append((t, line))
        out.append((t, ""))  # SSE event separator
    return out


# A thinking-on stream from vLLM 0.32: reasoning first, then the answer in content.
VLLM032_REASONING = _timed([
    (100.10, _chunk({"role": "assistant", "content": ""})),  # no text: not a token
    (100.50, _chunk({"reasoning": "Let"})),                   # first token (TTFT 0.50 s)
    (100.60, _chunk({"reasoning": " me think"})),
    (101.30, _chunk({"content": "The answer"})),
    (102.50, _chunk({"content": " is 42."}, finish="stop")),  # last token
    (102.51, _usage(30, 21, reasoning=9)),
    (102.52, "data: [DONE]"),
])

# The same timing from an older engine that names the field reasoning_content.
OLD_ENGINE_REASONING = [
    (t, line.replace('"reasoning"', '"reasoning_content"')) for t, line in VLLM032_REASONING
]

# Thinking off, no speculation: content only.
CONTENT_ONLY = _timed([
    (10.00 + 0.05, _chunk({"role": "assistant", "content": ""})),
    (10.25, _chunk({"content": "a"})),
    (10.75, _chunk({"content": "b"})),
    (11.25, _chunk({"content": "c"}, finish="length")),
    (11.26, _usage(12, 11)),
    (11.27, "data: [DONE]"),
])


def test_ttft_counts_the_first_reasoning_token_not_the_first_content_token():
    res = parse_stream(100.0, VLLM032_REASONING)
    assert res.ttft_s == pytest.approx(100.50 - 100.0)  # 0.50, not 1.30 (first content)
    assert res.decode_s == pytest.approx(102.50 - 100.50)
    assert res.e2e_s == pytest.approx(102.50 - 100.0)
    assert res.chunk_kinds == ["reasoning", "reasoning", "content", "content"]
    assert res.reasoning_text == "Let me think"
    assert res.content_text == "The answer is 42."
    assert (res.finish_reason, res.prompt_tokens, res.completion_tokens,
            res.reasoning_tokens) == ("stop", 30, 21, 9)
    assert res.done and res.complete


def test_old_engine_reasoning_content_field_reads_the_same():
    new = parse_stream(100.0, VLLM032_REASONING)
    old = parse_stream(100.0, OLD_ENGINE_REASONING)
    assert old.ttft_s == new.ttft_s and old.chunk_times == new.chunk_times
    assert old.reasoning_text == "Let me think"


def test_a_delta_carrying_both_reasoning_names_counts_once():
    both = [(t, line.replace('{"reasoning": "Let"}', '{"reasoning": "Let", "reasoning_content": "Let"}'))
            for t, line in VLLM032_REASONING]
    res = parse_stream(100.0, both)
    assert res.reasoning_text == "Let me think" and len(res.chunk_times) == 4


SCRAPE_BEFORE = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 6.0
vllm:generation_tokens_total{engine="0",model_name="m"} 500.0
"""
# five more rounds of K=3, 15 drafts accepted in all: tau = 15 / 5 = 3.0 (every draft accepted)
SCRAPE_AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 15.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 11.0
"""


def test_prometheus_counters_give_depth_and_delta():
    before = metrics.spec_counters(metrics.parse_prometheus(SCRAPE_BEFORE))
    after = metrics.spec_counters(metrics.parse_prometheus(SCRAPE_AFTER))
    assert before.depth == 3 and after.depth == 3
    d = metrics.counters_delta(before, after)
    assert (d.drafts, d.draft_tokens, d.accepted) == (5.0, 15.0, 15.0)
    assert d.accepted_per_pos == (5.0, 5.0, 5.0)


def test_counters_sum_over_engines_and_filter_by_model():
    text = SCRAPE_AFTER + SCRAPE_AFTER.replace('engine="0"', 'engine="1"') + \
        SCRAPE_AFTER.replace('model_name="m"', 'model_name="other"')
    c = metrics.spec_counters(metrics.parse_prometheus(text), model="m")
    assert (c.drafts, c.accepted) == (30.0, 80.0)


def test_no_spec_counters_means_speculation_off():
    assert metrics.spec_counters(metrics.parse_prometheus(
        'vllm:generation_tokens_total{engine="0"} 5.0\n')) is None


def test_figures_with_reasoning_and_known_tau():
    res = parse_stream(100.0, VLLM032_REASONING)
    d = metrics.counters_delta(metrics.spec_counters(metrics.parse_prometheus(SCRAPE_BEFORE)),
                               metrics.spec_counters(metrics.parse_prometheus(SCRAPE_AFTER)))
    f = metrics.decode_figures(res, d)
    # generated 21, decode 2.0 s, tau 3.0, 5 rounds
    assert f.speculation == "on"
    assert f.tau == pytest.approx(3.0)
    assert f.rounds == 5
    assert f.ms_per_round == pytest.approx(2000.0 / 5)  # 400 ms
    assert f.tok_s_round == pytest.approx((21 - (3.0 + 1)) / 2.0)  # 8.5
    assert f.tok_s_one_token == pytest.approx((21 - 1) / 2.0)  # 10.0
    # the one-token convention reads higher by exactly tau / decode_s
    assert f.tok_s_one_token - f.tok_s_round == pytest.approx(3.0 / 2.0)


def test_figures_with_fractional_tau():
    res = parse_stream(100.0, VLLM032_REASONING)
    delta = metrics.SpecCounters(drafts=8, draft_tokens=24, accepted=10, accepted_per_pos=(5, 3, 2))
    f = metrics.decode_figures(res, delta)
    assert f.tau == pytest.approx(1.25)
    assert f.tok_s_round == pytest.approx((21 - 2.25) / 2.0)  # 9.375
    assert f.ms_per_round == pytest.approx(250.0)


def test_figures_without_reasoning_and_without_speculation():
    res = parse_stream(10.0, CONTENT_ONLY)
    f = metrics.decode_figures(res, None, speculation_known=True)
    # 11 tokens, decode 11.25 - 10.25 = 1.0 s; off: tau 0, 10 single-token rounds
    assert res.ttft_s == pytest.approx(0.25)
    assert f.speculation == "off" and f.tau == 0.0 and f.rounds == 10
    assert f.tok_s_round == pytest.approx(10.0) and f.tok_s_one_token == pytest.approx(10.0)
    assert f.ms_per_round == pytest.approx(100.0)


def test_figures_when_metrics_unreadable_leave_round_figures_empty():
    f = metrics.decode_figures(parse_stream(10.0, CONTENT_ONLY), None, speculation_known=False)
    assert f.speculation == "unknown"
    assert f.tau is None and f.rounds is None and f.tok_s_round is None
    assert f.tok_s_one_token == pytest.approx(10.0)


def test_stream_without_done_is_incomplete_and_error_chunk_raises():
    cut = parse_stream(100.0, VLLM032_REASONING[:6])  # stops after the first content chunk
    assert not cut.done and not cut.complete and cut.finish_reason is None
    with pytest.raises(StreamCut, match="reported inside the stream"):
        parse_stream(0.0, [(1.0, 'data: {"error": {"message": "engine dead"}}')])


def test_mean_and_sample_sd():
    assert metrics.mean_sd([10.0, 12.0, 14.0]) == (pytest.approx(12.0), pytest.approx(2.0))
    assert metrics.mean_sd([5.0]) == (5.0, None)
    assert metrics.mean_sd([None]) == (None, None)


@pytest.mark.parametrize("text,expected", [
    ("so the total is \\boxed{130}.", 130),
    ("first 12 then \\boxed{1,024} and later 7", 1024),
    ("The answer is 77.", 77),
    ("we have 3 then 5 then 9", 9),
    ("no digits here", None),
])
def test_final_integer(text, expected):
    assert metrics.final_integer(text) == expected


def test_reasoning_summary_counts_only_the_seeds_with_a_figure():
    # seed 2 answered within one text chunk: no decode time, and the summary must neither
    # average it as zero nor call the one value n=2
    from qpn.benchmarks.reasoning_seeds import summarize

    rows = [{"decode_s": 2.0, "e2e_s": 3.0, "completion_tokens": 10, "correct": True},
            {"decode_s": None, "e2e_s": 1.0, "completion_tokens": 1, "correct": False},
            {"decode_s": 4.0, "e2e_s": 5.0, "completion_tokens": 12, "correct": False}]
    lines = summarize(rows)
    decode = next(l for l in lines if l.startswith("seconds to answer"))
    assert decode == "seconds to answer (decode only): 3.00 ± 1.41 (mean ± sd, n=2; 1 of 3 seeds have none)"
    e2e = next(l for l in lines if l.startswith("seconds end to end"))
    assert e2e == "seconds end to end: 3.00 ± 2.00 (mean ± sd, n=3)"
    assert next(l for l in lines if l.startswith("tau")) == "tau: no values; 3 of 3 seeds have none"
    assert lines[-1].startswith("final answer correct: 1/3")
