"""PNG charts from results CSVs written by the end-to-end suites.

    python -m qpn.benchmarks.plot RESULTS.csv [MORE.csv ...] [--out chart.png]

- domain-cell results: decode tok/s per cell, one bar group per file (so several runs at
  different speculation depths K sit side by side), both throughput conventions;
- context-sweep results: decode tok/s against live context, one line per file;
- five-seed reasoning results: decode tok/s per seed with the mean.

Several files must be of one kind. Each chart names the hardware class of its figures and
marks CPU figures as such in the title.
"""
from __future__ import annotations

import argparse
import os
import sys

from .results import read_results


def _float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _kind(rows_header) -> str:
    header, rows = rows_header
    cols = set(rows[0]) if rows else set()
    if "cell" in cols:
        return "cells"
    if "depth" in cols:
        return "context"
    if "seed" in cols:
        return "reasoning"
    return "unknown"


def _k_label(header: dict) -> str:
    k = header.get("K (speculation depth)", "?").split(" ")[0].rstrip(":")
    return f"K={k}"


def _device_note(headers: list[dict]) -> str:
    figs = {h.get("figures", "") for h in headers}
    if any(f.startswith("CPU") for f in figs):
        return "CPU figures (a CPU server; not GPU performance)"
    hw = "; ".join(sorted({h.get("hardware", "?") for h in headers}))
    return hw


def plot(csv_paths: list[str], out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = []
    for path in csv_paths:
        header, rows, _ = read_results(path)
        if not rows:
            raise SystemExit(f"error: {path} has no result rows to plot (a run that stopped before "
                             f"its first row); rerun the suite")
        loaded.append((path, header, rows))
    kinds = {_kind((h, r)) for _, h, r in loaded}
    if len(kinds) != 1 or "unknown" in kinds:
        raise SystemExit(f"error: cannot plot these files together (kinds: {sorted(kinds)}); pass "
                         f"files written by one suite (domain_cells, context_sweep or reasoning_seeds)")
    kind = kinds.pop()
    headers = [h for _, h, _ in loaded]
    fig, ax = plt.subplots(figsize=(10, 5.5))

    if kind == "cells":
        cells = []
        for _, _, rows in loaded:
            for r in rows:
                if r["cell"] not in cells:
                    cells.append(r["cell"])
        n = len(loaded)
        width = 0.8 / n
        for i, (path, header, rows) in enumerate(loaded):
            per_cell = {}
            for r in rows:
                v = _float(r.get("tok_s_round"))
                if v is None:
                    v = _float(r.get("tok_s_one_token"))
                per_cell.setdefault(r["cell"], []).append(v)
            means = [(sum(x for x in per_cell.get(c, []) if x is not None) /
                      max(1, len([x for x in per_cell.get(c, []) if x is not None])))
                     if per_cell.get(c) else 0.0 for c in cells]
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(cells))]
            bars = ax.bar(xs, means, width, label=f"{_k_label(header)} ({os.path.basename(path)})")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(cells)), cells)
        ax.set_ylabel("decode tok/s, (generated - (tau+1)) / decode_s")
        ax.set_title("Decode throughput per cell and depth")
    elif kind == "context":
        for path, header, rows in loaded:
            pts = sorted((int(r["live_context"]), _float(r["tg_tok_s"]), _float(r.get("tg_tok_s_sd")))
                         for r in rows if _float(r.get("tg_tok_s")) is not None)
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[p[2] or 0.0 for p in pts], marker="o",
                        capsize=3, label=f"{_k_label(header)} ({os.path.basename(path)})")
        ax.set_xlabel("live context at decode start (tokens)")
        ax.set_ylabel("decode tok/s (llama-benchy tg t/s)")
        ax.set_title("Decode speed against live context")
    else:  # reasoning
        for path, header, rows in loaded:
            seeds = [r["seed"] for r in rows]
            vals = [_float(r.get("tok_s_round")) or 0.0 for r in rows]
            bars = ax.bar(seeds, vals, label=f"{_k_label(header)} ({os.path.basename(path)})")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
            if vals:
                ax.axhline(sum(vals) / len(vals), linestyle="--", linewidth=1)
        ax.set_xlabel("seed")
        ax.set_ylabel("decode tok/s, (generated - (tau+1)) / decode_s")
        ax.set_title("Five-seed reasoning run")

    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    model = "; ".join(sorted({h.get("model id", "?") for h in headers}))
    commits = "; ".join(sorted({h.get("commit", "?")[:12] for h in headers}))
    dates = "; ".join(sorted({h.get("date", "?")[:10] for h in headers}))
    fig.suptitle(_device_note(headers), fontsize=10, color="darkred")
    fig.text(0.01, 0.01, f"model {model} | engine {headers[0].get('engine version', '?')} | "
             f"commit {commits} | {dates}", fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    out = out or os.path.splitext(csv_paths[0])[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qpn.benchmarks.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: first CSV with .png)")
    args = p.parse_args(argv)
    for path in args.csv:
        if not os.path.isfile(path):
            p.error(f"no such results file: {path}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: matplotlib is not installed; `pip install matplotlib` (or volta-qpn[bench])",
              file=sys.stderr)
        return 2
    print(plot(args.csv, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
