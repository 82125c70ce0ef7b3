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

from . import metrics as M
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


CONVENTIONS = (("tok_s_round", M.THROUGHPUT_ROUND_LABEL),
               ("tok_s_one_token", M.THROUGHPUT_ONE_TOKEN_LABEL))


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _cells_chart(ax, loaded, column: str) -> None:
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
            per_cell.setdefault(r["cell"], []).append(_float(r.get(column)))
        means = [_mean(per_cell.get(c, [])) for c in cells]
        missing = sum(m is None for m in means)
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(cells))]
        note = f", {missing} cell(s) without a figure" if missing else ""
        bars = ax.bar(xs, [m or 0.0 for m in means], width,
                      label=f"{_k_label(header)} ({os.path.basename(path)}{note})")
        ax.bar_label(bars, labels=["-" if m is None else f"{m:.1f}" for m in means], fontsize=7)
    ax.set_xticks(range(len(cells)), cells)


def _reasoning_chart(ax, loaded, column: str) -> None:
    for path, header, rows in loaded:
        seeds = [r["seed"] for r in rows]
        vals = [_float(r.get(column)) for r in rows]
        bars = ax.bar(seeds, [v or 0.0 for v in vals],
                      label=f"{_k_label(header)} ({os.path.basename(path)})")
        ax.bar_label(bars, labels=["-" if v is None else f"{v:.1f}" for v in vals], fontsize=7)
        if (m := _mean(vals)) is not None:
            ax.axhline(m, linestyle="--", linewidth=1)
    ax.set_xlabel("seed")


def plot(csv_paths: list[str], out: str | None = None) -> str:
    """Write the chart of ``csv_paths`` as a PNG; returns its path."""
    import matplotlib.pyplot as plt

    fig = make_figure(csv_paths)
    out = out or os.path.splitext(csv_paths[0])[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def make_figure(csv_paths: list[str]):
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

    if kind == "context":
        fig, ax = plt.subplots(figsize=(10, 5.5))
        for path, header, rows in loaded:
            pts = sorted((int(r["live_context"]), _float(r["tg_tok_s"]), _float(r.get("tg_tok_s_sd")))
                         for r in rows if _float(r.get("tg_tok_s")) is not None)
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[p[2] or 0.0 for p in pts], marker="o",
                        capsize=3, label=f"{_k_label(header)} ({os.path.basename(path)})")
        ax.set_xlabel("live context at decode start (tokens)")
        ax.set_ylabel("decode tok/s (llama-benchy tg t/s: its one convention)")
        ax.set_title("Decode speed against live context")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    else:
        # Both throughput conventions, side by side on one scale: the seed's (a whole round
        # subtracted) and one token subtracted. A convention a file has no figure for (no
        # /metrics: no tau) is drawn empty and says so in its legend.
        fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), sharey=True)
        for ax, (column, label) in zip(axes, CONVENTIONS):
            if kind == "cells":
                _cells_chart(ax, loaded, column)
                ax.set_title(f"Decode throughput per cell and depth\n{label}", fontsize=10)
            else:
                _reasoning_chart(ax, loaded, column)
                ax.set_title(f"Five-seed reasoning run\n{label}", fontsize=10)
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
    model = "; ".join(sorted({h.get("model id", "?") for h in headers}))
    commits = "; ".join(sorted({h.get("commit", "?")[:12] for h in headers}))
    dates = "; ".join(sorted({h.get("date", "?")[:10] for h in headers}))
    fig.suptitle(_device_note(headers), fontsize=10, color="darkred")
    fig.text(0.01, 0.01, f"model {model} | engine {headers[0].get('engine version', '?')} | "
             f"commit {commits} | {dates}", fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    return fig


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
