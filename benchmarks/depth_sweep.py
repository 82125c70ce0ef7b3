"""Depth by context: the context sweep at fixed depths and at K=auto side by side, and the auto
policy's step-cost constants fitted from the fixed-depth sweeps (issue 28 items 3 and 5).

    python -m qpn.benchmarks.depth_sweep --checkpoint CKPT [--arms 3,7,auto] \\
        [--depths 0,8192,32768,65536] [--pp 512] [--tg 128] [--runs 3] [--results-dir results]
    python -m qpn.benchmarks.depth_sweep --fit 3=sweep_k3.csv --fit 7=sweep_k7.csv [--fit 0=off.csv]

With ``--checkpoint`` every arm is served in turn by the launcher a user runs
(scripts/serve-qwen38-native.sh with ``K=<arm>``; every other launcher setting comes from the
environment, as for a plain launch) and measured by ``qpn.benchmarks.context_sweep``; each arm's
server is stopped before the next boots. The fixed arms run first; their sweeps fit the
constants (below), and the auto arm is served with those constants (``DEPTH_CONSTANTS``), which
is how an owner is meant to serve auto on their own box. Written, all with provenance:

- ``<name>_k<arm>.csv/.md``: each arm's context sweep;
- ``<name>.csv/.md``: the seed's table shape, one row per context, tok/s and tau per arm, the
  depth auto drafted there, and auto against the best fixed arm;
- ``<name>.png``: tok/s against context, one line per arm (qpn.benchmarks.plot);
- ``<name>_depth_constants.json``: the fitted constants, the residual per point, and the command
  that serves auto with them.

``--fit`` only fits, from sweep files already measured (``K=FILE``; K=0 is speculation off).

The fit (the model is fork_patches/spec/depth_policy.py's ``CostConstants``): a round at depth k
commits tau + 1 tokens, so its time is ``R = 1000 (1 + tau) / tok_s`` ms; a plain step (K=0) is
``1000 / tok_s``. At each context measured at two or more depths k <= 7, a line through R against
k gives the fixed round cost F (intercept) and the cost of one more depth d (slope); F and d are
then lines in the context (least squares; with one context only, the default slopes are kept).
d is one drafter step plus one verify row, ``a + b ctx + c``: round times cannot tell a from c,
so c keeps its default (seed 000's measured 0.383 ms per row) and a = d(0) - c. Depths with more
than 8 verify rows fit ``wide_verify_ms``; K=0 fits the off step. A constant the sweep does not
reach keeps its default, and the report says which. On the cpu engine these are CPU figures,
labelled as such; they exercise the method, not a V100.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from dataclasses import dataclass

from qpn.fork_patches.spec import depth_policy as DP

from . import context_sweep, plot
from .client import BenchError
from .results import Column, ResultsWriter, read_results

ARM_AUTO = "auto"
AUTO_SETTINGS = ("DEPTH_LADDER", "DEPTH_CONSTANTS", "DEPTH_PRIOR_ROUNDS", "DEPTH_WARM_WORDS")


# ------------------------------------------------------------------------------ sweep rows
@dataclass(frozen=True)
class SweepPoint:
    """One context of one fixed-depth arm: k = 0 is speculation off."""
    k: int
    context: int
    tok_s: float
    tau: float

    @property
    def round_ms(self) -> float:
        """One round (k = 0: one plain step) in ms: a round commits tau + 1 tokens."""
        return 1000.0 * (1.0 + (self.tau if self.k else 0.0)) / self.tok_s


def parse_arm(text: str) -> int | str:
    t = text.strip().lower()
    if t == ARM_AUTO:
        return ARM_AUTO
    try:
        k = int(t)
    except ValueError:
        raise ValueError(f"arm {text!r} is neither a depth K (0 = off, 1..{DP.MAX_DEPTH}) nor "
                         f"'auto'") from None
    if not 0 <= k <= DP.MAX_DEPTH:
        raise ValueError(f"arm K={k} is out of range: K is 0 (speculation off) to {DP.MAX_DEPTH}")
    return k


def sweep_points(k: int, rows: list[dict]) -> list[SweepPoint]:
    """The rows of one arm's context-sweep CSV that carry a decode figure. A speculative row
    needs its tau (the /metrics counters) to give a round time."""
    out = []
    for row in rows:
        if not row.get("tg_tok_s"):
            continue  # llama-benchy gave no tg figure at that depth; the sweep file says so
        tau = row.get("tau")
        if k and not tau:
            raise BenchError(f"K={k} row at live context {row.get('live_context')} has no tau: "
                             f"the fit needs the server's /metrics (rerun without --no-metrics)")
        out.append(SweepPoint(k, int(row["live_context"]), float(row["tg_tok_s"]),
                              float(tau or 0.0)))
    return out


# --------------------------------------------------------------------------------- the fit
@dataclass(frozen=True)
class DepthFit:
    constants: DP.CostConstants
    fitted: tuple[str, ...]       # the constants the sweeps determined
    kept: tuple[str, ...]         # the ones left at their default, each with why in notes
    notes: tuple[str, ...]
    residuals: tuple[dict, ...]   # per point: k, context, measured and modelled ms, error %


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _in_context(pairs: list[tuple[int, float]], base_slope: float, what: str, notes: list[str]
                ) -> tuple[float, float, bool]:
    """(value at context 0, per-token slope, whether the slope was fitted) of a cost measured
    at the (context, ms) ``pairs``."""
    ctxs = sorted({c for c, _ in pairs})
    mean = statistics.fmean(v for _, v in pairs)
    if len(ctxs) < 2:
        notes.append(f"{what}: measured at one context only ({ctxs[0]}); its per-token slope keeps "
                     f"the default {base_slope:.3g} ms/token")
        return mean - base_slope * ctxs[0], base_slope, False
    v0, slope = _line([c for c, _ in pairs], [v for _, v in pairs])
    if slope < 0:
        notes.append(f"{what}: its per-token slope came out negative ({slope:.3g} ms/token: noise "
                     f"over a short span of contexts); set to 0, the cost kept at its mean")
        return mean, 0.0, True
    return v0, slope, True


def fit_depth_constants(points: list[SweepPoint], base: DP.CostConstants = DP.DEFAULT_COSTS
                        ) -> DepthFit:
    """The policy's cost constants from fixed-depth sweeps; see the module docstring."""
    notes: list[str] = []
    fitted: list[str] = []
    narrow = [p for p in points if 1 <= p.k and p.k + 1 <= DP.VERIFY_TILE_ROWS]
    by_ctx: dict[int, list[SweepPoint]] = {}
    for p in narrow:
        by_ctx.setdefault(p.context, []).append(p)
    lines = {c: _line([p.k for p in ps], [p.round_ms for p in ps])
             for c, ps in by_ctx.items() if len({p.k for p in ps}) >= 2}
    if not lines:
        raise BenchError("the fit needs two depths k <= 7 measured at one same live context (for "
                         "example K=3 and K=7 over the same --depths); got "
                         + (", ".join(f"K={p.k} at {p.context}" for p in points) or "no rows"))
    fixed0, fixed_slope, f_fit = _in_context([(ctx, f) for ctx, (f, _) in lines.items()],
                                             base.fixed_ms_per_token, "fixed round cost", notes)
    d0, b, d_fit = _in_context([(ctx, d) for ctx, (_, d) in lines.items()],
                               base.b_ms_per_token, "cost per depth", notes)
    fitted += ["fixed_ms", "a_ms"] + (["fixed_ms_per_token"] if f_fit else []) + (["b_ms_per_token"] if d_fit else [])
    c_ms = base.c_ms
    if d0 < c_ms:
        notes.append(f"cost per depth at context 0 ({d0:.3f} ms) is below the default verify row "
                     f"({c_ms} ms): the whole of it is given to the verify row, the drafter step to 0")
        c_ms, a = max(d0, 0.0), 0.0
        fitted.append("c_ms")
    else:
        a = d0 - c_ms
        notes.append(f"c_ms keeps its default {c_ms} ms (seed 000's verify row): round times give "
                     f"only the sum a + c = {d0:.3f} ms")
    # collected as plain numbers: CostConstants checks its rules once, on the finished set
    v = dict(base.as_dict(), a_ms=a, b_ms_per_token=b, c_ms=c_ms, fixed_ms=max(fixed0, 0.0),
             fixed_ms_per_token=fixed_slope)
    fixed_at = lambda ctx: v["fixed_ms"] + v["fixed_ms_per_token"] * ctx  # noqa: E731
    depth_at = lambda ctx: v["a_ms"] + v["b_ms_per_token"] * ctx + v["c_ms"]  # noqa: E731
    wide = [p for p in points if p.k + 1 > DP.VERIFY_TILE_ROWS]
    if wide:
        extra = statistics.fmean(p.round_ms - fixed_at(p.context) - p.k * depth_at(p.context) for p in wide)
        v["wide_verify_ms"] = max(extra, 0.0)
        fitted.append("wide_verify_ms")
    else:
        notes.append(f"wide_verify_ms keeps its default {base.wide_verify_ms:.3f} ms: no arm with "
                     f"more than {DP.VERIFY_TILE_ROWS} verify rows (K >= {DP.VERIFY_TILE_ROWS})")
    off = [p for p in points if p.k == 0]
    if off:
        o0, o_slope, o_fit = _in_context([(p.context, p.round_ms) for p in off],
                                         base.off_ms_per_token, "off step", notes)
        v.update(off_ms=max(o0, 0.0), off_ms_per_token=o_slope)
        fitted += ["off_ms"] + (["off_ms_per_token"] if o_fit else [])
    else:
        # the defaults are V100 figures; a plain step may not cost more than a depth-1 round
        # (CostConstants' own rule), so on a faster box they are capped by the fit
        v["off_ms"] = min(base.off_ms, v["fixed_ms"] + v["a_ms"] + v["c_ms"])
        v["off_ms_per_token"] = min(base.off_ms_per_token, v["fixed_ms_per_token"] + v["b_ms_per_token"])
        notes.append(f"off_ms / off_ms_per_token: no K=0 arm; the defaults, capped at a depth-1 round "
                     f"of this fit: {v['off_ms']:.3f} ms + {v['off_ms_per_token']:.3g} ms/token")
    try:
        constants = DP.CostConstants(**v)
    except ValueError as e:
        raise BenchError(f"the fitted constants are inconsistent ({e}); the sweeps disagree with "
                         f"the model: rerun with more --runs, or over contexts further apart") from None
    residuals = tuple(dict(k=p.k, context=p.context, measured_ms=round(p.round_ms, 4),
                           model_ms=round(constants.round_ms(p.k, p.context), 4),
                           error_pct=round(100 * (constants.round_ms(p.k, p.context) / p.round_ms - 1), 2))
                      for p in sorted(points, key=lambda p: (p.k, p.context)))
    kept = tuple(n for n in constants.as_dict() if n not in fitted)
    return DepthFit(constants, tuple(fitted), kept, tuple(notes), residuals)


def serve_command(constants: DP.CostConstants, checkpoint: str, ladder: str = "") -> str:
    env = {"K": "auto", "DEPTH_CONSTANTS": json.dumps(constants.as_dict(), separators=(",", ":"))}
    if ladder:
        env["DEPTH_LADDER"] = ladder
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + \
        f" bash scripts/serve-qwen38-native.sh {shlex.quote(checkpoint)}"


def write_fit(path: str, fit: DepthFit, checkpoint: str, sources: dict, ladder: str = "") -> None:
    from . import provenance as P
    doc = {"provenance": {"command": P.command_line("qpn.benchmarks.depth_sweep"),
                          "commit": P.git_commit(), "date": P.now_iso(), "sources": sources},
           "model": "fork_patches/spec/depth_policy.py CostConstants (round = fixed + k (a + b ctx + c) [+ wide])",
           "constants": fit.constants.as_dict(), "fitted": list(fit.fitted), "kept_default": list(fit.kept),
           "notes": list(fit.notes), "residuals": list(fit.residuals),
           "serve": serve_command(fit.constants, checkpoint, ladder)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------- arms side by side
def arm_label(arm) -> str:
    return "auto" if arm == ARM_AUTO else ("off" if arm == 0 else f"K={arm}")


def side_by_side(arms: dict, results: dict[object, list[dict]]) -> tuple[list[Column], list[dict]]:
    """One row per live context: tok/s and tau per arm, what auto drafted, auto / best fixed."""
    cols = [Column("live_context", "live context")]
    for arm in arms:
        key = arm_label(arm).replace("=", "").lower()
        cols += [Column(f"{key}_tok_s", f"{arm_label(arm)} tok/s", 2)]
        if arm != 0:
            cols += [Column(f"{key}_tau", f"{arm_label(arm)} tau", 2)]
    if ARM_AUTO in arms:
        cols += [Column("auto_drafted", "auto drafted/round", 2), Column("auto_depths", "auto rounds per depth"),
                 Column("auto_vs_best_fixed", "auto / best fixed", 3)]
    contexts = sorted({int(r["live_context"]) for rows in results.values() for r in rows})
    out = []
    for ctx in contexts:
        row: dict = {"live_context": ctx}
        best = None
        for arm in arms:
            key = arm_label(arm).replace("=", "").lower()
            r = next((r for r in results.get(arm, []) if int(r["live_context"]) == ctx), None)
            tok = float(r["tg_tok_s"]) if r and r.get("tg_tok_s") else None
            row[f"{key}_tok_s"] = tok
            if arm != 0:
                row[f"{key}_tau"] = float(r["tau"]) if r and r.get("tau") else None
            if arm == ARM_AUTO:
                row["auto_drafted"] = float(r["drafted"]) if r and r.get("drafted") else None
                row["auto_depths"] = (r or {}).get("rounds_per_depth", "")
            elif tok is not None:
                best = tok if best is None else max(best, tok)
        if ARM_AUTO in arms:
            auto = row.get("auto_tok_s")
            row["auto_vs_best_fixed"] = auto / best if auto and best else None
        out.append(row)
    return cols, out


# ------------------------------------------------------------------------------ the runs
def run_arm(arm, checkpoint: str, prefix: str, sweep_args: list[str], env: dict,
            echo: bool = True) -> str:
    """Serve ``checkpoint`` with K=arm through the launcher, sweep it, stop it; the sweep's CSV."""
    from qpn.scripts.launcher.launched import LaunchedServer

    if arm != ARM_AUTO:  # the launcher refuses the auto settings beside a fixed K
        env = {k: v for k, v in env.items() if k not in AUTO_SETTINGS}
    server = LaunchedServer(checkpoint, env={**env, "K": str(arm)}, echo=echo)
    print(f"[depth-sweep] {arm_label(arm)}: starting the server", flush=True)
    server.start()
    try:
        print(f"[depth-sweep] {arm_label(arm)}: READY at {server.url}; sweeping", flush=True)
        rc = context_sweep.main(["--base-url", server.url, "--model", server.model,
                                 "--tokenizer", checkpoint, *sweep_args,
                                 "--results-dir", os.path.dirname(prefix) or ".",
                                 "--name", os.path.basename(prefix)])
        if rc != 0:
            raise BenchError(f"the context sweep of {arm_label(arm)} failed (exit {rc}); its rows "
                             f"so far are in {prefix}.csv")
    finally:
        server.stop()
    return prefix + ".csv"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m qpn.benchmarks.depth_sweep",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", help="serve and sweep this checkpoint folder, one arm at a time")
    p.add_argument("--arms", default="3,7,auto", help="K per arm: depths (0 = off) and/or auto")
    p.add_argument("--fit", action="append", default=[], metavar="K=CSV",
                   help="only fit, from context-sweep files already measured at fixed K (repeat)")
    p.add_argument("--depths", default="0,8192,32768,65536", help="context depths (tokens) to sweep")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--name", default="", help="file name (default: depth_sweep_<device>_<UTC stamp>)")
    p.add_argument("--out", default="", help="with --fit: the constants file (default: stdout only)")
    return p.parse_args(argv)


def _print_fit(fit: DepthFit) -> None:
    print("[depth-sweep] fitted step-cost constants (ms; per token where named):")
    for k, v in fit.constants.as_dict().items():
        print(f"  {k:20s} {v:.6g}  ({'fitted' if k in fit.fitted else 'default'})")
    for n in fit.notes:
        print(f"  note: {n}")
    worst = max(fit.residuals, key=lambda r: abs(r["error_pct"]))
    print(f"  worst residual: K={worst['k']} at {worst['context']}: {worst['error_pct']:+.1f}%")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.fit:
            pts = []
            for item in args.fit:
                k_text, _, path = item.partition("=")
                k = parse_arm(k_text)
                if k == ARM_AUTO or not path:
                    raise BenchError(f"--fit {item!r}: give K=CSV with a fixed K (auto has no fixed depth)")
                pts += sweep_points(k, read_results(path)[1])
            fit = fit_depth_constants(pts)
            _print_fit(fit)
            if args.out:
                write_fit(args.out, fit, "CKPT", {f"K={i.split('=')[0]}": i.split("=", 1)[1] for i in args.fit})
                print(f"[depth-sweep] wrote {args.out}")
            return 0
        if not args.checkpoint:
            raise BenchError("give --checkpoint (serve and sweep) or --fit K=CSV (fit only)")
        return _sweep(args)
    except (BenchError, ValueError, RuntimeError) as e:
        print(f"[depth-sweep] ERROR: {e}", file=sys.stderr)
        return 2


def _sweep(args) -> int:
    import datetime as _dt

    arms = [parse_arm(a) for a in args.arms.split(",") if a.strip()]
    if len(set(arms)) != len(arms):
        raise BenchError(f"--arms {args.arms!r} names an arm twice")
    fixed = [a for a in arms if a != ARM_AUTO]
    if ARM_AUTO in arms and len([a for a in fixed if a]) < 2:
        raise BenchError("the auto arm is served with constants fitted from the fixed arms: give at "
                         "least two fixed depths, e.g. --arms 3,7,auto")
    name = args.name or f"depth_sweep_{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    prefix = os.path.join(args.results_dir, name)
    sweep_args = ["--depths", args.depths, "--pp", str(args.pp), "--tg", str(args.tg),
                  "--runs", str(args.runs)]
    env = dict(os.environ)
    files: dict = {}
    points: list[SweepPoint] = []
    for arm in fixed:
        files[arm] = run_arm(arm, args.checkpoint, f"{prefix}_k{arm}", sweep_args, env)
        points += sweep_points(arm, read_results(files[arm])[1])
    fit = None
    if len({p.k for p in points if p.k}) >= 2:
        fit = fit_depth_constants(points)
        _print_fit(fit)
        write_fit(prefix + "_depth_constants.json", fit, args.checkpoint,
                  {arm_label(a): f for a, f in files.items()}, env.get("DEPTH_LADDER", ""))
    if ARM_AUTO in arms:
        env = {**env, "DEPTH_CONSTANTS": json.dumps(fit.constants.as_dict())}
        files[ARM_AUTO] = run_arm(ARM_AUTO, args.checkpoint, f"{prefix}_kauto", sweep_args, env)
    results = {arm: read_results(path)[1] for arm, path in files.items()}
    header = dict(read_results(files[arms[0]])[0])
    header["K (speculation depth)"] = ", ".join(arm_label(a) for a in arms) + " (one server per arm, in turn)"
    from . import provenance as P
    header["command"] = P.command_line("qpn.benchmarks.depth_sweep")
    header["arms"] = "; ".join(f"{arm_label(a)}: {os.path.basename(f)}" for a, f in files.items())
    if fit is not None:
        header["auto constants"] = f"fitted from the fixed arms: {os.path.basename(prefix)}_depth_constants.json"
    cols, rows = side_by_side(arms, results)
    cpu = header.get("figures", "").startswith("CPU")
    writer = ResultsWriter(prefix, "Depth by context: fixed K and K=auto side by side"
                           + (" - CPU figures (not GPU performance)" if cpu else ""), header, cols)
    for row in rows:
        writer.add_row(row)
    plot.main([*files.values(), "--out", prefix + ".png"])
    print(f"[depth-sweep] wrote {prefix}.csv, {prefix}.md, {prefix}.png"
          + (f", {prefix}_depth_constants.json" if fit else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
