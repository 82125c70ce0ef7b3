"""Shared machinery of the end-to-end suites: command line, preflight, one measured request,
the results writer with provenance, and the error handling that keeps finished rows.

The suites themselves are ``qpn.benchmarks.domain_cells``, ``qpn.benchmarks.reasoning_seeds``
and ``qpn.benchmarks.context_sweep``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from dataclasses import dataclass

from . import health as H
from . import metrics as M
from . import provenance as P
from .client import BenchError, ChatClient, MetricsUnavailable, Sampling, ServerUnreachable, root_url
from .results import Column, ResultsWriter

# Seed 000's domain-table sampling: greedy and fully specified (top_k -1 = disabled).
GREEDY = Sampling(temperature=0.0, top_p=1.0, top_k=-1, presence_penalty=0.0,
                  frequency_penalty=0.0, seed=1001, max_tokens=2048, thinking=False,
                  reasoning_effort="medium")
# NInfer's published reasoning profile, as seed 000 applies it to both engines.
NINFER = Sampling(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.0,
                  frequency_penalty=0.0, seed=1001, max_tokens=8192, thinking=True,
                  reasoning_effort="medium")
NINFER_SEEDS = (1001, 2002, 3003, 4004, 5005)

# Columns every per-request table shares.
REQUEST_COLUMNS = [
    Column("prompt_tokens", "prompt tok"),
    Column("completion_tokens", "gen tok"),
    Column("reasoning_tokens", "reasoning tok"),
    Column("finish_reason", "finish"),
    Column("ttft_s", "TTFT s", 3),
    Column("decode_s", "decode s", 3),
    Column("e2e_s", "e2e s", 3),
    Column("text_chunks", "chunks"),
    Column("tau", "tau", 2),
    Column("rounds", "rounds", 0),
    Column("ms_per_round", "ms/round", 2),
    Column("tok_s_round", M.THROUGHPUT_ROUND_LABEL, 2),
    Column("tok_s_one_token", M.THROUGHPUT_ONE_TOKEN_LABEL, 2),
    Column("speculation", "spec"),
    Column("device", "device"),
    # output health beside the speed (benchmarks/health.py)
    Column("natural_stop", "natural stop"),
    Column("replacement_rate", "U+FFFD rate", 4),
    Column("distinct_4grams", "distinct 4-grams", 3),
    Column("longest_repeat", "longest repeat (words)", 0),
]


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True,
                   help="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="served model name (as GET /v1/models lists it)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint (default: <server root>/metrics)")
    p.add_argument("--no-metrics", action="store_true",
                   help="run without /metrics: tau, rounds and the round convention stay empty")
    p.add_argument("--results-dir", default=None,
                   help="where the CSV and Markdown results go (default: $QPN_RESULTS_DIR, else "
                   "$XDG_DATA_HOME/volta-qpn/results, i.e. ~/.local/share/volta-qpn/results); "
                   "the repository's tracked results/ folder only when named here")
    p.add_argument("--name", default=None, help="results file stem (default: e2e_<suite>_<device>_<date>)")
    p.add_argument("--revision", default=None, help="checkpoint revision, if the server cannot tell")
    p.add_argument("--hardware", default=None,
                   help="hardware description for a remote endpoint, e.g. '4x Tesla V100-SXM2-16GB'")
    p.add_argument("--k", type=int, default=None, help="declared speculation depth (checked against /metrics)")
    p.add_argument("--mml", type=int, default=None, help="declared --max-model-len (when /v1/models lacks it)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, seconds")
    p.add_argument("--warmup", type=int, default=1, help="short unmeasured requests before the first row")
    p.add_argument("--note", default=None, help="free text recorded in the results header")
    p.add_argument("--min-health", type=_health_bounds, default=None, metavar="BOUNDS",
                   help="fail the run (exit 3, rows kept) when a cell's mean output health breaks "
                   "a bound, e.g. 'natural_stop>=1,distinct_4grams>=0.5,replacement_rate<=0.001,"
                   "longest_repeat<=40' (benchmarks/health.py)")


def _health_bounds(text: str):
    try:
        return H.parse_bounds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass
class Preflight:
    model_entry: dict
    engine_version: str
    metrics_known: bool
    counters: M.SpecCounters | None
    device: str
    hardware: str


class Bench:
    """One endpoint + model, measured one request at a time (single stream)."""

    def __init__(self, args):
        self.args = args
        self.client = ChatClient(args.base_url, args.model, args.api_key, args.timeout)
        self.metrics_url = args.metrics_url or (root_url(args.base_url) + "/metrics")
        self.metrics_known = False

    def scrape(self) -> M.SpecCounters | None:
        import httpx

        try:
            r = self.client._http.get(self.metrics_url)
        except httpx.TransportError as e:  # refused, reset, disconnected, timed out
            raise ServerUnreachable(
                f"cannot read {self.metrics_url} ({type(e).__name__}: {e}); the server stopped "
                f"answering. Check the server log, restart it and rerun; rows already finished "
                f"are kept.") from None
        if r.status_code != 200:
            raise MetricsUnavailable(
                f"the metrics endpoint {self.metrics_url} answered HTTP {r.status_code}, so tau, "
                f"rounds and ms/round cannot be measured. vLLM serves /metrics on the API port by "
                f"default: pass --metrics-url if it lives elsewhere, or --no-metrics to run "
                f"without speculation figures (those columns stay empty).")
        return M.spec_counters(M.parse_prometheus(r.text))

    def preflight(self) -> Preflight:
        entry = self.client.check_model()
        version = self.client.engine_version()
        counters = None
        if not self.args.no_metrics:
            counters = self.scrape()
            self.metrics_known = True
        device, hw = P.hardware(self.args.base_url, self.args.hardware)
        return Preflight(entry, version, self.metrics_known, counters, device, hw)

    def request_field_check(self, sampling: Sampling) -> str:
        """Whether the server's own request schema knows every field we send (an engine
        accepts unknown fields silently, so a misspelt one would be ignored unnoticed)."""
        try:
            r = self.client._http.get(root_url(self.args.base_url) + "/openapi.json")
            spec = r.json()
            props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        except Exception:
            return "not checked (no /openapi.json with a ChatCompletionRequest schema)"
        sent = ["model", "messages", "stream", "stream_options", *sampling.request_fields()]
        unknown = [f for f in sent if f not in props]
        if unknown:
            msg = f"fields unknown to the server's schema (it may ignore them): {', '.join(unknown)}"
            print(f"warning: {msg}", file=sys.stderr)
            return msg
        return "every field sent is in the server's ChatCompletionRequest schema"

    def measure(self, messages: list[dict], sampling: Sampling):
        before = self.scrape() if self.metrics_known else None
        stream = self.client.stream_chat(messages, sampling)
        after = self.scrape() if self.metrics_known else None
        delta = M.counters_delta(before, after)
        figures = M.decode_figures(stream, delta, speculation_known=self.metrics_known)
        return stream, figures

    def warmup(self, sampling: Sampling) -> None:
        for _ in range(max(0, self.args.warmup)):
            self.client.stream_chat([{"role": "user", "content": "Say hello."}],
                                    sampling.with_(max_tokens=8, thinking=False))


def request_row(stream, figures: M.DecodeFigures, device: str) -> dict:
    return {
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": stream.completion_tokens,
        "reasoning_tokens": stream.reasoning_tokens,
        "finish_reason": stream.finish_reason,
        "ttft_s": figures.ttft_s,
        "decode_s": figures.decode_s,
        "e2e_s": figures.e2e_s,
        "text_chunks": len(stream.chunk_times),
        "tau": figures.tau,
        "rounds": figures.rounds,
        "ms_per_round": figures.ms_per_round,
        "tok_s_round": figures.tok_s_round,
        "tok_s_one_token": figures.tok_s_one_token,
        "speculation": figures.speculation,
        "device": device,
        **H.answer_health(stream.reasoning_text + stream.content_text, stream.finish_reason),
    }


def provenance_header(bench: Bench, pre: Preflight, sampling_text: str, extra: dict | None = None
                      ) -> dict[str, str]:
    args = bench.args
    mml = pre.model_entry.get("max_model_len")
    mml_text = (f"{mml} (from /v1/models)" if mml is not None else
                f"{args.mml} (given)" if args.mml is not None else "unknown (pass --mml)")
    header = {
        "figures": ("CPU figures from a CPU server: they test the harness, not GPU performance"
                    if pre.device == "cpu" else
                    "GPU figures" if pre.device == "gpu" else "hardware not read (remote endpoint)"),
        "endpoint": args.base_url,
        "model id": args.model,
        "checkpoint revision": P.checkpoint_revision(pre.model_entry, args.revision),
        "engine version": f"{pre.engine_version} (GET /version)",
        "hardware": pre.hardware,
        "K (speculation depth)": P.depth_label(pre.counters, pre.metrics_known, args.k),
        "MML (max model len)": mml_text,
        "sampling": sampling_text,
        "metric": (f"decode_s = first to last text chunk (reasoning, reasoning_content or "
                   f"content); tau = accepted / drafts from /metrics deltas; "
                   f"'{M.THROUGHPUT_ROUND_LABEL}' is seed 000's convention, "
                   f"'{M.THROUGHPUT_ONE_TOKEN_LABEL}' the one-token one; single stream, "
                   f"metrics deltas assume no other traffic"),
        "commit": P.git_commit(),
        "command": P.command_line(),
        "date": P.now_iso(),
    }
    header.update(extra or {})
    if args.note:
        header["note"] = args.note
    return header


def default_results_dir(environ=None) -> str:
    """A user's own folder: a run's figures never land among the project's evidence (the
    tracked results/) unless ``--results-dir results`` asks for it."""
    environ = os.environ if environ is None else environ
    if environ.get("QPN_RESULTS_DIR"):
        return environ["QPN_RESULTS_DIR"]
    data_home = environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(data_home, "volta-qpn", "results")


def results_prefix(args, suite: str, device: str) -> str:
    stem = args.name or f"e2e_{suite}_{device}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%SZ}"
    return os.path.join(args.results_dir or default_results_dir(), stem)


def run_main(body, args=None) -> int:
    """Run a suite body(writer_holder) turning BenchError into a clear exit, rows kept; then,
    with ``--min-health``, exit 3 when a cell's output health breaks a bound."""
    holder: dict = {}
    try:
        body(holder)
    except BenchError as e:
        w: ResultsWriter | None = holder.get("writer")
        if w is not None:
            w.fail(str(e))
            print(f"error: {e}\nrows finished before the error ({len(w.rows)}) are kept in "
                  f"{w.csv_path} and {w.md_path}", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        w = holder.get("writer")
        if w is not None:
            w.fail("interrupted by the user")
            print(f"interrupted; {len(w.rows)} finished rows kept in {w.csv_path}", file=sys.stderr)
        return 130
    w = holder.get("writer")
    if w is not None:
        print(f"wrote {w.csv_path} and {w.md_path} ({len(w.rows)} rows)")
    bounds = getattr(args, "min_health", None)
    if bounds and w is not None:
        broken = H.violations(w.rows, bounds)
        if broken:
            w.fail("output health below --min-health: " + "; ".join(broken))
            print("error: output health below --min-health:\n  " + "\n  ".join(broken), file=sys.stderr)
            return 3
        print(f"output health within --min-health ({', '.join(map(str, bounds))})")
    return 0


SUITES = {
    "domain_cells": "one greedy request per workload cell (doc2json, log2json, json, mergesort, "
                    "code, math, distinct50, prose), output health beside the speed",
    "reasoning_seeds": "one reasoning problem, NInfer sampling, five seeds: mean and sd",
    "context_sweep": "decode speed against live context, measured by llama-benchy",
    "plot": "PNG charts from results CSVs (both throughput conventions)",
}


def main(argv=None) -> int:
    """``python -m qpn.benchmarks.suite [SUITE [ARGS...]]``: lists the suites, or runs one."""
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        prog="python -m qpn.benchmarks.suite",
        description="End-to-end benchmarks of a running OpenAI-compatible server. Each suite is "
        "also its own command: python -m qpn.benchmarks.<suite> --help.",
        epilog="suites:\n" + "\n".join(f"  {name:16s} {what}" for name, what in SUITES.items())
        + f"\n\nresults go to {default_results_dir()} unless --results-dir says otherwise",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES), help="the suite to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own arguments")
    if not argv:
        p.print_help()
        return 2
    ns = p.parse_args(argv[:1])
    module = importlib.import_module(f"qpn.benchmarks.{ns.suite}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
