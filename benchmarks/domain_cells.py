"""Domain cells: one greedy, fully specified request per workload, speed beside output health.

    python -m qpn.benchmarks.domain_cells --base-url http://127.0.0.1:8000/v1 --model NAME \
        [--cells doc2json,log2json,json,mergesort,code,math,distinct50,prose] [--repeat 1] [--max-tokens 2048] \
        [--min-health natural_stop>=1,distinct_4grams>=0.5]

Sampling is seed 000's domain-table contract: temperature 0, top_p 1, top_k disabled, no
penalties, seed 1001, thinking off except the math cell (thinking on), reasoning_effort medium.
"""
from __future__ import annotations

import argparse
import sys

from .prompts import CELLS
from .results import Column, ResultsWriter
from .suite import (GREEDY, REQUEST_COLUMNS, Bench, add_common_args, provenance_header,
                    request_row, results_prefix, run_main)

COLUMNS = [
    Column("cell", "cell"),
    Column("repeat", "rep"),
    Column("thinking", "thinking"),
    *REQUEST_COLUMNS,
    Column("check", "check"),
    Column("check_detail", "check detail"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m qpn.benchmarks.domain_cells", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--cells", default=",".join(CELLS),
                   help=f"comma-separated subset of: {', '.join(CELLS)}")
    p.add_argument("--repeat", type=int, default=1, help="requests per cell")
    p.add_argument("--max-tokens", type=int, default=GREEDY.max_tokens)
    args = p.parse_args(argv)
    names = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [n for n in names if n not in CELLS]
    if unknown or not names:
        p.error(f"unknown cell(s) {unknown or names}; choose from {', '.join(CELLS)}")
    args.cell_names = names
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def body(holder):
        bench = Bench(args)
        pre = bench.preflight()
        base = GREEDY.with_(max_tokens=args.max_tokens)
        sampling_text = (f"{base.label()}; the math cell sends thinking on "
                         f"(seed 000 domain-table contract)")
        header = provenance_header(bench, pre, sampling_text, {
            "request fields": bench.request_field_check(base),
            "cells": ", ".join(args.cell_names) + f" x {args.repeat}",
            "warmup": f"{args.warmup} unmeasured request(s) of 8 tokens",
        })
        title = ("Domain cells, end to end" +
                 (" - CPU figures (not GPU performance)" if pre.device == "cpu" else ""))
        writer = ResultsWriter(results_prefix(args, "cells", pre.device), title, header, COLUMNS)
        holder["writer"] = writer
        bench.warmup(base)
        for name in args.cell_names:
            cell = CELLS[name]
            sampling = base.with_(thinking=cell.thinking)
            for rep in range(args.repeat):
                stream, fig = bench.measure([{"role": "user", "content": cell.prompt}], sampling)
                check = cell.check(stream.content_text)
                writer.add_row({
                    "cell": name, "repeat": rep, "thinking": "on" if cell.thinking else "off",
                    **request_row(stream, fig, pre.device),
                    "check": check.status, "check_detail": check.detail,
                })
                print(f"{name}[{rep}]: {stream.completion_tokens} tok, "
                      f"{fig.tok_s_round if fig.tok_s_round is not None else float('nan'):.2f} "
                      f"tok/s (round), tau {fig.tau}, finish {stream.finish_reason}, "
                      f"check {check.status}", flush=True)
        bench.client.close()

    return run_main(body, args)


if __name__ == "__main__":
    sys.exit(main())
