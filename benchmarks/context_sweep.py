"""Context sweep: decode speed against live context, driven through the llama-benchy package.

    python -m qpn.benchmarks.context_sweep --base-url http://127.0.0.1:8000/v1 --model NAME \
        --tokenizer /path/to/checkpoint [--depths 0,8192,32768,65536] [--pp 512] [--tg 128]

llama-benchy (PyPI, 0.4.0) does the measuring; this module runs it once per depth so that
each finished depth is a row on disk before the next starts, and adds what it lacks:
provenance, the speculation counters around each depth, and no network. By default
llama-benchy downloads a book as its corpus and, without a local tokenizer, a tokenizer from
the hub. Here it gets the checkpoint's own tokenizer folder (``--tokenizer``; by default the
served model's root folder when the server is local) and a corpus served from this machine
by a throwaway HTTP server (``--book-url http://127.0.0.1:<port>/...``). The corpus is the
text of this repository's own source files unless ``--corpus FILE`` names another; its
sha256 goes into the header. Its cache (normally ~/.cache/llama-benchy) goes to a temporary
HOME that is removed afterwards.

Figures per depth are llama-benchy's: its tg t/s (tokens after the first over the decode
time, its own definition) and pp t/s, mean ± sd over ``--runs``. tau is read from /metrics
around the whole llama-benchy invocation (warm-up included), so it is the acceptance of that
depth's traffic, not of one request.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from . import metrics as M
from .client import BenchError
from .results import Column, ResultsWriter
from .suite import Bench, add_common_args, provenance_header, results_prefix, run_main

COLUMNS = [
    Column("depth", "depth (context tok)"),
    Column("pp", "prompt tok"),
    Column("tg", "gen tok"),
    Column("live_context", "live context at decode start"),
    Column("tg_tok_s", "llama-benchy tg t/s", 2),
    Column("tg_tok_s_sd", "tg sd", 2),
    Column("pp_tok_s", "llama-benchy pp t/s", 2),
    Column("pp_tok_s_sd", "pp sd", 2),
    Column("e2e_ttft_ms", "e2e TTFT ms", 1),
    Column("runs", "runs"),
    Column("tau", "tau (whole depth)", 2),
    Column("rounds", "rounds (whole depth)", 0),
    Column("drafted", "drafted per round", 2),
    Column("rounds_per_depth", "rounds per drafted depth"),
    Column("speculation", "spec"),
    Column("device", "device"),
]

_CORPUS_DIRS = ("benchmarks", "fork_patches", "kernels", "scripts", "docs", "tests")
_CORPUS_SUFFIXES = (".py", ".md", ".txt", ".cu", ".cuh", ".toml", ".sh")


def repository_corpus() -> str:
    """The text of the repository's own source files, in a fixed (sorted) order."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = []
    for top in _CORPUS_DIRS:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
            for name in sorted(filenames):
                if name.endswith(_CORPUS_SUFFIXES):
                    with open(os.path.join(dirpath, name), errors="replace") as f:
                        parts.append(f.read())
    text = "\n\n".join(parts)
    if len(text) < 10_000:
        raise BenchError(f"the repository corpus under {root} is only {len(text)} characters; "
                         f"pass --corpus FILE with a larger text file")
    return text


class LocalFileServer:
    """Serve one folder on 127.0.0.1 at a free port, in a thread; stop() shuts it down."""

    def __init__(self, folder: str):
        handler = functools.partial(_QuietHandler, directory=folder)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m qpn.benchmarks.context_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--tokenizer", default=None,
                   help="the checkpoint's tokenizer folder (default: the served model's local root)")
    p.add_argument("--depths", default="0,4096,16384,32768,65536")
    p.add_argument("--pp", type=int, default=512, help="prompt tokens after the context")
    p.add_argument("--tg", type=int, default=128, help="generated tokens (exact: min_tokens + ignore_eos)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--corpus", default=None, help="corpus text file (default: this repository's sources)")
    p.add_argument("--llama-benchy", default=None,
                   help="llama-benchy command (default: this python -m llama_benchy)")
    args = p.parse_args(argv)
    try:
        args.depth_list = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        p.error(f"--depths must be comma-separated integers, got {args.depths!r}")
    return args


def _resolve_tokenizer(args, model_entry: dict) -> str:
    cand = args.tokenizer or model_entry.get("root") or ""
    if os.path.isfile(os.path.join(cand, "tokenizer.json")) or os.path.isfile(cand):
        return cand
    raise BenchError(
        f"no local tokenizer at {cand!r}: llama-benchy would download one from the hub, and this "
        f"sweep runs without network. Pass --tokenizer with the checkpoint folder (the one that "
        f"holds tokenizer.json).")


def _benchy_cmd(args) -> list[str]:
    if args.llama_benchy:
        return args.llama_benchy.split()
    try:
        import llama_benchy  # noqa: F401
    except ImportError:
        raise BenchError("llama-benchy is not installed in this python. Install it with "
                         "`pip install llama-benchy==0.4.0` (or `pip install volta-qpn[bench]`), "
                         "or pass --llama-benchy with its command.") from None
    return [sys.executable, "-m", "llama_benchy"]


def _metric(run: dict, key: str):
    m = run.get(key) or {}
    return m.get("mean"), m.get("std")


def main(argv=None) -> int:
    args = parse_args(argv)

    def body(holder):
        bench = Bench(args)
        pre = bench.preflight()
        tokenizer = _resolve_tokenizer(args, pre.model_entry)
        benchy = _benchy_cmd(args)
        work = tempfile.mkdtemp(prefix="qpn_ctx_sweep_")
        holder["cleanup"] = work
        try:
            corpus_text = (open(args.corpus, errors="replace").read() if args.corpus
                           else repository_corpus())
            with open(os.path.join(work, "corpus.txt"), "w") as f:
                f.write(corpus_text)
            digest = hashlib.sha256(corpus_text.encode()).hexdigest()
            version = subprocess.run([*benchy, "--version"], capture_output=True, text=True,
                                     timeout=120).stdout.strip()
            version = f"llama-benchy {version.split()[-1]}" if version else "llama-benchy (version unknown)"
            extra_body = ["temperature=0.0", "top_p=1.0", "top_k=-1", "presence_penalty=0.0",
                          "frequency_penalty=0.0", "seed=1001",
                          'chat_template_kwargs={"enable_thinking":false}']
            header = provenance_header(bench, pre, (
                "temperature 0.0, top_p 1.0, top_k disabled, presence/frequency penalty 0, "
                "seed 1001, thinking off (sent through llama-benchy --extra-body); exact tg "
                "(min_tokens + ignore_eos)"), {
                "driver": f"{version} (python package), once per depth, --runs {args.runs}, "
                          f"--no-cache, --skip-coherence, --exact-tg",
                "tokenizer": f"{tokenizer} (local; no hub download)",
                "corpus": (f"{args.corpus or 'repository sources'}, {len(corpus_text)} chars, "
                           f"sha256 {digest[:16]}, served from 127.0.0.1 during the run"),
            })
            title = ("Context sweep (decode speed against live context)" +
                     (" - CPU figures (not GPU performance)" if pre.device == "cpu" else ""))
            writer = ResultsWriter(results_prefix(args, "context", pre.device), title, header,
                                   COLUMNS)
            holder["writer"] = writer
            env = dict(os.environ, HOME=work, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       HF_HOME=os.path.join(work, "hf"))
            with LocalFileServer(work) as files:
                book_url = f"http://127.0.0.1:{files.port}/corpus.txt"
                for depth in args.depth_list:
                    bench.client.check_model()  # a dead server is named before llama-benchy runs
                    before = bench.scrape() if bench.metrics_known else None
                    out_json = os.path.join(work, f"depth_{depth}.json")
                    cmd = [*benchy, "--base-url", args.base_url, "--model", args.model,
                           "--tokenizer", tokenizer, "--pp", str(args.pp), "--tg", str(args.tg),
                           "--depth", str(depth), "--runs", str(args.runs), "--book-url", book_url,
                           "--skip-coherence", "--no-cache", "--exact-tg", "--exit-on-first-fail",
                           "--format", "json", "--save-result", out_json]
                    if args.api_key:
                        cmd += ["--api-key", args.api_key]
                    for item in extra_body:
                        cmd += ["--extra-body", item]
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work,
                                          timeout=args.timeout * max(1, args.runs + 2))
                    if proc.returncode != 0 or not os.path.exists(out_json):
                        tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
                        raise BenchError(
                            f"llama-benchy failed at depth {depth} (exit {proc.returncode}): "
                            + " / ".join(tail) + ". If the server died, read its log and rerun; "
                            "if the context does not fit, lower --depths below the server's MML.")
                    after = bench.scrape() if bench.metrics_known else None
                    with open(out_json) as f:
                        report = json.load(f)
                    runs = [r for r in report.get("benchmarks", [])
                            if not r.get("is_context_prefill_phase")]
                    if not runs:
                        raise BenchError(f"llama-benchy wrote no decode result at depth {depth}")
                    run = runs[0]
                    tg, tg_sd = _metric(run, "tg_throughput")
                    pp, pp_sd = _metric(run, "pp_throughput")
                    ttft, _ = _metric(run, "e2e_ttft")
                    delta = M.counters_delta(before, after)
                    if delta is not None:
                        tau = delta.accepted / delta.drafts if delta.drafts else None
                        rounds, spec = delta.drafts, "on"
                    else:
                        tau, rounds = (0.0, None) if bench.metrics_known else (None, None)
                        spec = "off" if bench.metrics_known else "unknown"
                    # Under K=auto the depth drafted varies with the context: say which.
                    drafted = delta.mean_drafted if delta is not None else None
                    writer.add_row({
                        "depth": depth, "pp": run.get("prompt_size", args.pp),
                        "tg": run.get("response_size", args.tg),
                        "live_context": depth + int(run.get("prompt_size", args.pp)),
                        "tg_tok_s": tg, "tg_tok_s_sd": tg_sd, "pp_tok_s": pp, "pp_tok_s_sd": pp_sd,
                        "e2e_ttft_ms": ttft, "runs": args.runs, "tau": tau, "rounds": rounds,
                        "drafted": drafted, "rounds_per_depth": M.depth_text(delta),
                        "speculation": spec, "device": pre.device,
                    })
                    if tg is None:
                        writer.add_note(
                            f"depth {depth}: llama-benchy reported no tg figure: it times tokens "
                            f"by network read, and every token after the first arrived in the "
                            f"same read as the first; raise --tg")
                    if pp is None:
                        writer.add_note(
                            f"depth {depth}: llama-benchy reported no pp figure: it takes the "
                            f"prefill time as the time to the first response less the network "
                            f"latency it measured once before the run, and that latency was at "
                            f"least the time to the first response (a short prompt on a busy "
                            f"host); e2e_ttft_ms stands, or raise --pp")
                    print(f"depth {depth}: tg {tg} t/s, pp {pp} t/s, tau {tau}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        bench.client.close()

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
