"""Five-seed reasoning run: seconds to answer, decode tok/s and completion tokens, mean and sd.

    python -m qpn.benchmarks.reasoning_seeds --base-url http://127.0.0.1:8000/v1 --model NAME \
        [--seeds 1001,2002,3003,4004,5005] [--max-tokens 8192]

Sampling is NInfer's published profile as seed 000 applies it: temperature 0.6, top_p 0.95,
top_k 20, presence_penalty 1.0, frequency_penalty 0, thinking on, reasoning_effort medium,
one request per seed. The problem is our own, with a known integer answer; each row says
whether the final answer (last \\boxed{N} of the content) matches it.

Seconds to answer is decode only (first to last token), prefill excluded, as in seed 000's
table; TTFT and end-to-end seconds stand beside it.
"""
from __future__ import annotations

import argparse
import math
import sys

from . import metrics as M
from .prompts import REASONING_ANSWER, REASONING_PROBLEM, integer_check
from .results import Column, ResultsWriter
from .suite import (NINFER, NINFER_SEEDS, REQUEST_COLUMNS, Bench, add_common_args,
                    provenance_header, request_row, results_prefix, run_main)

COLUMNS = [
    Column("seed", "seed"),
    *REQUEST_COLUMNS,
    Column("answer", "answer"),
    Column("expected", "expected"),
    Column("correct", "correct"),
]

SUMMARY_FIELDS = [
    ("decode_s", "seconds to answer (decode only)", 2),
    ("e2e_s", "seconds end to end", 2),
    ("tok_s_round", M.THROUGHPUT_ROUND_LABEL, 2),
    ("tok_s_one_token", M.THROUGHPUT_ONE_TOKEN_LABEL, 2),
    ("completion_tokens", "completion tokens", 0),
    ("tau", "tau", 2),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m qpn.benchmarks.reasoning_seeds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--seeds", default=",".join(str(s) for s in NINFER_SEEDS))
    p.add_argument("--max-tokens", type=int, default=NINFER.max_tokens)
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    return args


def summarize(rows: list[dict]) -> list[str]:
    """Mean and sample sd (n-1) lines of the per-seed rows."""
    n = len(rows)
    lines = []
    for key, label, digits in SUMMARY_FIELDS:
        values = [r.get(key) for r in rows]
        mean, sd = M.mean_sd(values)
        # a seed whose answer came in fewer than two text chunks has no decode time (nor the
        # figures made from it): n counts the seeds that have the figure, and says who had none
        have = sum(1 for v in values if v is not None and math.isfinite(float(v)))
        missing = f"; {n - have} of {n} seeds have none" if have < n else ""
        if mean is None:
            lines.append(f"{label}: no values{missing}")
            continue
        sd_text = f"{sd:.{digits}f}" if sd is not None else "n/a (one value)"
        lines.append(f"{label}: {mean:.{digits}f} ± {sd_text} (mean ± sd, n={have}{missing})")
    correct = sum(1 for r in rows if r.get("correct"))
    natural = sum(1 for r in rows if r.get("natural_stop"))
    lines.append(f"final answer correct: {correct}/{n} (expected {REASONING_ANSWER}); "
                 f"natural stop: {natural}/{n}; capped at max_tokens: "
                 f"{sum(1 for r in rows if r.get('finish_reason') == 'length')}/{n}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)

    def body(holder):
        bench = Bench(args)
        pre = bench.preflight()
        base = NINFER.with_(max_tokens=args.max_tokens)
        header = provenance_header(bench, pre, (
            f"{base.label().replace('seed 1001', 'seed per row')} (NInfer profile as seed 000 "
            f"applies it); seeds {', '.join(map(str, args.seed_list))}"), {
            "request fields": bench.request_field_check(base),
            "problem": f"{REASONING_PROBLEM} (expected answer {REASONING_ANSWER})",
            "warmup": f"{args.warmup} unmeasured request(s) of 8 tokens",
        })
        title = ("Five-seed reasoning run" +
                 (" - CPU figures (not GPU performance)" if pre.device == "cpu" else ""))
        writer = ResultsWriter(results_prefix(args, "reasoning", pre.device), title, header, COLUMNS)
        holder["writer"] = writer
        bench.warmup(base)
        check = integer_check(REASONING_ANSWER)
        for seed in args.seed_list:
            stream, fig = bench.measure([{"role": "user", "content": REASONING_PROBLEM}],
                                        base.with_(seed=seed))
            answer = M.final_integer(stream.content_text)
            writer.add_row({
                "seed": seed, **request_row(stream, fig, pre.device),
                "answer": answer, "expected": REASONING_ANSWER,
                "correct": check(stream.content_text).status == "pass",
            })
            print(f"seed {seed}: {stream.completion_tokens} tok in {fig.decode_s} s decode, "
                  f"answer {answer} (expected {REASONING_ANSWER})", flush=True)
        for line in summarize(writer.rows):
            writer.add_note(line)
            print(line)
        bench.client.close()

    return run_main(body, args)


if __name__ == "__main__":
    sys.exit(main())
