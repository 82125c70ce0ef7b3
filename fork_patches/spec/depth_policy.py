"""Speculative depth for ``K=auto``: pick the MTP depth k that commits the most tokens per ms.

Why this exists (issue 28). Today the depth of MTP speculation is fixed when the server boots,
but which depth is best depends on two things that change while it serves:

* the live context. Every sequential drafter step reads the whole KV cache, so a deep round
  gets dearer as the sequence grows; seed 000 (v100-skinny README) measured a drafter step at
  ~0.817 ms at short context and ~3.65 ms at ~65K, and k=7 falling from 127.4 tok/s at short
  context to 54.7 at ~65K, where k=3 reached 76.3 and plain decode 65.5;
* how predictable the text is. At the same short context the seed's seven workloads commit
  from 2.32 to 4.00 tokens a round at k=3 and prefer k=3, k=7 or k=15.

What it does. For each depth k of a ladder (by default 1, 3, 7, 15; 0, speculation off, may be
added), it predicts

    tokens per round  = 1 + sum_{i < k} p_i      (p_i: unconditional probability that draft
                                                 position i is accepted; the 1 is the token the
                                                 verify pass always commits)
    time per round    = F(ctx) + k * (drafter step(ctx) + verify row) [+ a wide-verify penalty]
                        (k = 0: one plain decode step; where the engine verifies the deepest
                        depth's width every round, 1Cat-vLLM, the verify rows are that depth's
                        and only the drafter steps scale with k: DepthPolicy.fixed_verify)

and picks the depth with the most tokens per millisecond; a tie goes to the shallower depth,
which costs less when the prediction is wrong. The cost constants are fitted to seed 000's
figures by :func:`fit_cost_constants` (the arithmetic is in the code, so the tests can check that
the model gives back the figures it was fitted on). The acceptance p_i comes from the engine's
own counters, blended with a prior fitted to the seed's short-context table
(:func:`estimate_acceptance`).

What the defaults do. Before any round has been observed, the prior (the seed's median
workload, mergesort) chooses k=7 up to 125,480 tokens of live context and k=3 from 125,481. The
seed's own long-context run accepted far less (1.55 tokens a round at k=3, 1.63 at k=7); fed
that, the policy chooses k=3 at every context, and at ~65K it beats speculation off, as the seed
measured. The prior is worth 32 rounds, so the live acceptance takes over within about a second.

Several running requests. vLLM drafts one depth for the whole batch, so one decision serves every
running sequence; the policy decides for the most demanding one, the longest live context. Deep
drafting hurts that sequence most (its drafter steps read the most KV), and the seed measured
single-stream decode only, so the model describes one sequence: deciding for the longest never
over-drafts any of them.

Not here: hysteresis (a caller that re-decides every round near a crossover may want some), the
batch-size dependence of the costs (not measured), and the engine hook that applies the depth.
Pure Python, standard library only, no torch, so that a launcher or a test can import it without
an engine.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Mapping, Sequence

# The deepest speculation the launcher serves: past K=15 the K+1 verify rows leave the QPN decode
# kernels' packed bands (8-row tile, two-tile variant up to 16 rows; docs/serving.md, "Supported
# depths"). The acceptance vectors below have one entry per draft position up to it.
MAX_DEPTH = 15

# Rows of one mma.sync m8n8k4 tile: verification of up to 8 rows (k <= 7) fills one tile, wider
# verification (k = 8..15) needs the two-tile path, which seed 000 measured to be slower for NVFP4.
VERIFY_TILE_ROWS = 8

# The owner's ladder when they write ``auto``: the depths seed 000 measured (3, 7, 15) plus 1, the
# cheapest speculation, for text where only the first draft survives.
DEFAULT_LADDER: tuple[int, ...] = (1, 3, 7, 15)

# Pseudo-rounds of the prior (the ``m`` of a Beta(m * p, m * (1 - p)) prior on each position):
# after 32 observed rounds the observation weighs as much as the prior, after a few hundred it
# dominates. 32 rounds are ~1 s of decode at the seed's 20-50 ms rounds, so a wrong prior costs
# about a second before the live acceptance takes over.
DEFAULT_PRIOR_ROUNDS = 32.0

# Two decisions whose tokens/ms agree to this relative precision are a tie (float noise, not a
# difference worth a deeper round).
_TIE_REL_TOL = 1e-9


# --------------------------------------------------------------------------------------------
# The figures the defaults are fitted on
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SeedFigures:
    """Figures measured by seed 000 (v100-skinny README) on 4x V100-SXM2-16GB, Qwen3.8-27B, TP4.

    Contexts are live tokens. The seed says "~0.5k" and "~65k"; we read them as 512 and 65,536
    (the latter is also a row of its declared-window table).
    """

    short_context: int = 512
    long_context: int = 65_536
    # "~0.817 ms" per sequential drafter step at short context, "~3.65 ms" at ~65K.
    drafter_step_short_ms: float = 0.817
    drafter_step_long_ms: float = 3.65
    # "+0.383 ms per extra draft row" of the verification batch.
    verify_row_ms: float = 0.383
    # Round latency at short context, by depth: the middles of the seed's bands 20.3-20.5,
    # 25.0-25.4 and 36.4-38.1 ms across its seven workload cells.
    round_short_ms: Mapping[int, float] = field(
        default_factory=lambda: {3: 20.4, 7: 25.2, 15: 37.25})
    # ~65K context: decode tok/s and accepted draft tokens per round, by depth.
    long_tok_per_s: Mapping[int, float] = field(default_factory=lambda: {3: 76.3, 7: 54.7})
    long_accepted_per_round: Mapping[int, float] = field(
        default_factory=lambda: {3: 1.55, 7: 1.63})
    # Speculation off: 86.3 tok/s at ~0.5K, 65.5 at ~65K.
    off_short_tok_per_s: float = 86.3
    off_long_tok_per_s: float = 65.5
    # k=7 at ~0.5K: 127.4 tok/s. The seed gives no acceptance for this run, so it is not fitted
    # on; the tests check only that the acceptance it implies is one the seed saw elsewhere.
    k7_short_tok_per_s: float = 127.4


SEED_000 = SeedFigures()

# Seed 000's short-context table: accepted draft tokens per round (its tau; a round commits
# tau + 1) at k = 3, 7, 15 for seven workloads, and the measured tok/s of each cell.
SEED_000_SHORT_CELLS: Mapping[str, Mapping[int, tuple[float, float]]] = {
    # cell: {k: (tok/s, accepted per round)}
    "doc2json": {3: (195.1, 3.00), 7: (309.5, 6.83), 15: (392.1, 13.88)},
    "log2json": {3: (195.6, 3.00), 7: (307.1, 6.81), 15: (391.4, 13.94)},
    "json": {3: (184.9, 2.77), 7: (268.6, 5.73), 15: (270.3, 8.93)},
    "mergesort": {3: (175.3, 2.56), 7: (226.9, 4.71), 15: (197.7, 6.27)},
    "code": {3: (173.1, 2.52), 7: (197.1, 3.93), 15: (155.0, 4.67)},
    "math": {3: (161.6, 2.30), 7: (187.0, 3.75), 15: (147.0, 4.46)},
    "prose": {3: (113.9, 1.32), 7: (101.7, 1.55), 15: (68.5, 1.49)},
}

# Its head-to-head run (AIME, k=7): 5.89 tokens committed per round. Not fitted on; the tests use
# it as an independent check of the prior.
SEED_000_K7_COMMITTED_PER_ROUND = 5.89


# --------------------------------------------------------------------------------------------
# The step-cost model
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostConstants:
    """Per-round costs in ms; ``ctx`` is the live context in tokens.

    drafter step  = a_ms + b_ms_per_token * ctx      (one sequential MTP step, reads the KV cache)
    verify row    = c_ms                             (each draft row added to the verify batch)
    fixed round   = fixed_ms + fixed_ms_per_token * ctx
                    (what a speculative round costs besides its k drafter steps and k extra rows:
                    the target's verify pass over the KV cache, sampling, rejection, bookkeeping)
    wide verify   = wide_verify_ms once the k + 1 verify rows exceed one 8-row tile
    off step      = off_ms + off_ms_per_token * ctx  (one plain decode step, one token)
    """

    a_ms: float
    b_ms_per_token: float
    c_ms: float
    fixed_ms: float
    fixed_ms_per_token: float
    wide_verify_ms: float
    off_ms: float
    off_ms_per_token: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"cost constant {f.name}={value!r} is not a number; give it in "
                                 f"ms (per token where the name says so)")
            if not math.isfinite(value):
                raise ValueError(f"cost constant {f.name}={value!r} is not finite; give a finite "
                                 f"number of ms")
            if value < 0:
                raise ValueError(f"cost constant {f.name}={value!r} is negative; a cost is >= 0 "
                                 f"(measure it again, or leave it at its default)")
        # A speculative round contains a plain decode step's work (the verify pass) and more, so
        # the off step may not cost more than a depth-1 round at any context. This is also what
        # makes zero acceptance choose the shallowest depth (or off) whatever the constants.
        if self.off_ms > self.fixed_ms + self.a_ms + self.c_ms:
            raise ValueError(
                f"cost constant off_ms={self.off_ms!r} exceeds a depth-1 round at zero context "
                f"(fixed_ms + a_ms + c_ms = {self.fixed_ms + self.a_ms + self.c_ms!r}); a plain "
                f"decode step cannot cost more than a round that contains one: lower off_ms or "
                f"raise fixed_ms")
        if self.off_ms_per_token > self.fixed_ms_per_token + self.b_ms_per_token:
            raise ValueError(
                f"cost constant off_ms_per_token={self.off_ms_per_token!r} exceeds the per-token "
                f"growth of a depth-1 round (fixed_ms_per_token + b_ms_per_token = "
                f"{self.fixed_ms_per_token + self.b_ms_per_token!r}); lower off_ms_per_token or "
                f"raise fixed_ms_per_token")

    def drafter_step_ms(self, context: int) -> float:
        return self.a_ms + self.b_ms_per_token * context

    def fixed_round_ms(self, context: int) -> float:
        return self.fixed_ms + self.fixed_ms_per_token * context

    def off_step_ms(self, context: int) -> float:
        return self.off_ms + self.off_ms_per_token * context

    def round_ms(self, k: int, context: int, verify_depth: int | None = None) -> float:
        """Time of one round at depth k (k = 0: one plain decode step).

        ``verify_depth``: the draft rows the verify batch holds when the engine verifies a fixed
        width whatever was drafted (1Cat-vLLM under K=auto: the ladder's deepest, see
        :class:`DepthPolicy`); None: it verifies the k drafted rows."""
        _check_depth(k, "k")
        _check_context(context)
        if k == 0:
            return self.off_step_ms(context)
        rows = k if verify_depth is None else verify_depth
        if rows < k:
            raise ValueError(f"verify_depth {rows} is below the drafted depth {k}: the verify "
                             "batch holds every drafted row")
        wide = self.wide_verify_ms if rows + 1 > VERIFY_TILE_ROWS else 0.0
        return (self.fixed_round_ms(context) + k * self.drafter_step_ms(context) + rows * self.c_ms
                + wide)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fit_cost_constants(figures: SeedFigures = SEED_000) -> CostConstants:
    """The cost constants from seed 000's figures; each step names the figures it uses.

    Every fitted figure is a mean or a two-point line, no solver: with the defaults the
    results are a ~0.7947 ms, b ~4.357e-5 ms/token, c 0.383 ms, F ~16.77 ms + ~5.83e-5 ms/token,
    wide ~2.45 ms, off ~11.56 ms + ~5.66e-5 ms/token.
    """
    short, long_ = figures.short_context, figures.long_context
    if not 0 <= short < long_:
        raise ValueError(f"short_context={short} must be >= 0 and below long_context={long_}")
    span = long_ - short

    # Drafter step: the line through 0.817 ms at ~0.5K and 3.65 ms at ~65K.
    #   b = (3.65 - 0.817) / (65536 - 512) ~ 4.357e-5 ms/token, a = 0.817 - 512 b ~ 0.7947 ms.
    b = (figures.drafter_step_long_ms - figures.drafter_step_short_ms) / span
    a = figures.drafter_step_short_ms - b * short
    # Verify row: the seed's +0.383 ms per extra row, as measured.
    c = figures.verify_row_ms

    # Fixed round cost at short context: each measured round time less its k depth costs, where a
    # depth costs one drafter step and one verify row (0.817 + 0.383 = 1.2 ms, which is also the
    # slope of the seed's k=3 -> k=7 round times: (25.2 - 20.4) / 4 = 1.2). Mean over k = 3, 7:
    #   20.4 - 3 * 1.2 = 16.8 and 25.2 - 7 * 1.2 = 16.8 -> 16.8 ms.
    # k = 15 is left out: its 16 rows need the two-tile verify path, priced separately below.
    per_depth_short = a + b * short + c
    narrow = [k for k in figures.round_short_ms if k + 1 <= VERIFY_TILE_ROWS]
    if not narrow:
        raise ValueError("round_short_ms needs at least one depth k <= 7 to fit the fixed cost")
    fixed_short = statistics.fmean(figures.round_short_ms[k] - k * per_depth_short
                                   for k in narrow)

    # Wide verify: what the k=15 round (middle of 36.4-38.1 = 37.25 ms) costs above the narrow
    # model's 16.8 + 15 * 1.2 = 34.8 ms -> 2.45 ms, the seed's "M=16 NVFP4 kernel gap".
    wide_ks = [k for k in figures.round_short_ms if k + 1 > VERIFY_TILE_ROWS]
    wide = (statistics.fmean(figures.round_short_ms[k] - fixed_short - k * per_depth_short
                             for k in wide_ks) if wide_ks else 0.0)
    wide = max(wide, 0.0)

    # Fixed round cost at ~65K: the measured round time is committed tokens / throughput,
    #   k=3: (1 + 1.55) / 76.3 tok/s = 33.42 ms, k=7: (1 + 1.63) / 54.7 tok/s = 48.08 ms,
    # less k depth costs at ~65K (3.65 + 0.383 = 4.033 ms each): 21.32 and 19.85 -> mean 20.59 ms.
    # The two disagree by ~1.5 ms; the mean leaves each of the two throughputs within ~2.5%.
    per_depth_long = a + b * long_ + c
    fixed_long = statistics.fmean(
        1000.0 * (1.0 + figures.long_accepted_per_round[k]) / figures.long_tok_per_s[k]
        - k * per_depth_long
        for k in figures.long_tok_per_s)
    # ... and F(ctx) is the line through the two: 16.8 ms at 512, 20.59 ms at 65,536.
    fixed_per_token = (fixed_long - fixed_short) / span
    fixed0 = fixed_short - fixed_per_token * short

    # Off: one token per step, the line through 1000 / 86.3 = 11.59 ms and 1000 / 65.5 = 15.27 ms.
    off_short = 1000.0 / figures.off_short_tok_per_s
    off_long = 1000.0 / figures.off_long_tok_per_s
    off_per_token = (off_long - off_short) / span
    off0 = off_short - off_per_token * short

    return CostConstants(a_ms=a, b_ms_per_token=b, c_ms=c, fixed_ms=fixed0,
                         fixed_ms_per_token=fixed_per_token, wide_verify_ms=wide,
                         off_ms=off0, off_ms_per_token=off_per_token)


DEFAULT_COSTS = fit_cost_constants(SEED_000)


# --------------------------------------------------------------------------------------------
# Acceptance per draft position
# --------------------------------------------------------------------------------------------

def _non_increasing(values: Iterable[float]) -> tuple[float, ...]:
    """Clamped to [0, 1], then a running minimum from position 0."""
    out: list[float] = []
    for v in values:
        v = min(max(v, 0.0), 1.0)
        out.append(min(v, out[-1]) if out else v)
    return tuple(out)


def fit_acceptance_prior(
        cells: Mapping[str, Mapping[int, tuple[float, float]]] = SEED_000_SHORT_CELLS,
) -> tuple[float, ...]:
    """A prior p_0..p_14 from per-depth accepted-tokens-per-round figures.

    Between two measured depths k' < k the positions k'..k-1 share the increment
    (tau_k - tau_k') / (k - k'), the median over the cells. With seed 000's table the median cell
    is mergesort at every depth (tau 2.56 / 4.71 / 6.27), a middling workload between extraction
    (near-perfect acceptance) and prose; the prior is then 0.853 for positions 0-2, 0.5375 for
    3-6 and 0.195 for 7-14. Positions past the deepest measured depth get 0.
    """
    depths = sorted({k for by_k in cells.values() for k in by_k})
    if not depths or depths[0] < 1 or depths[-1] > MAX_DEPTH:
        raise ValueError(f"cells need measured depths in 1..{MAX_DEPTH}, got {depths}")
    prior = [0.0] * MAX_DEPTH
    previous = 0
    for k in depths:
        increments = []
        for by_k in cells.values():
            if k not in by_k:
                continue
            tau_prev = 0.0 if previous == 0 else by_k.get(previous, (0.0, None))[1]
            if tau_prev is None:
                continue
            # A deeper depth can measure fewer accepted tokens than a shallower one (the seed's
            # prose: 1.55 at k=7, 1.49 at k=15): noise, since position acceptance is >= 0.
            increments.append(max(by_k[k][1] - tau_prev, 0.0) / (k - previous))
        p = min(statistics.median(increments), 1.0) if increments else 0.0
        for i in range(previous, k):
            prior[i] = p
        previous = k
    return _non_increasing(prior)


DEFAULT_ACCEPTANCE_PRIOR: tuple[float, ...] = fit_acceptance_prior(SEED_000_SHORT_CELLS)


@dataclass(frozen=True)
class AcceptanceCounters:
    """Cumulative speculation counters, per draft position i = 0..len-1.

    ``drafted[i]``: rounds in which position i was drafted; ``accepted[i]``: rounds in which it
    was accepted. At a fixed depth every round drafts every position, so ``drafted`` is the
    engine's ``vllm:spec_decode_num_drafts_total`` for all positions (:meth:`from_engine`). Under
    ``K=auto`` a round at depth k drafts positions 0..k-1 only; vLLM's drafts counter still counts
    it, so whoever applies the depth must count per-position drafts itself, or the deep positions
    read too low.
    """

    drafted: tuple[float, ...]
    accepted: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.drafted) != len(self.accepted):
            raise ValueError(f"drafted has {len(self.drafted)} positions, accepted "
                             f"{len(self.accepted)}; give one count per position in both")
        if len(self.drafted) > MAX_DEPTH:
            raise ValueError(f"{len(self.drafted)} positions exceed the deepest depth "
                             f"{MAX_DEPTH}")
        for name, counts in (("drafted", self.drafted), ("accepted", self.accepted)):
            for i, n in enumerate(counts):
                if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) \
                        or n < 0:
                    raise ValueError(f"{name}[{i}]={n!r}: a counter is a finite number >= 0")
        for i, (d, acc) in enumerate(zip(self.drafted, self.accepted)):
            if acc > d:
                raise ValueError(f"accepted[{i}]={acc!r} exceeds drafted[{i}]={d!r}; a position "
                                 f"cannot be accepted more often than it was drafted")

    @classmethod
    def from_engine(cls, drafts_total: float,
                    accepted_per_position: Sequence[float]) -> AcceptanceCounters:
        """vLLM's counters at a fixed depth: one drafts total, accepted per position."""
        return cls(drafted=tuple(drafts_total for _ in accepted_per_position),
                   accepted=tuple(accepted_per_position))

    def since(self, earlier: AcceptanceCounters) -> AcceptanceCounters:
        """The counts accrued after ``earlier`` (a window, so a changed workload shows quickly).

        A counter below its earlier value means the engine restarted (counters start again from
        zero), and then the current counts are the window.
        """
        n = max(len(self.drafted), len(earlier.drafted))
        now_d, now_a = _padded(self.drafted, n), _padded(self.accepted, n)
        was_d, was_a = _padded(earlier.drafted, n), _padded(earlier.accepted, n)
        if any(x < y for x, y in zip(now_d + now_a, was_d + was_a)):
            return self
        drafted = tuple(x - y for x, y in zip(now_d, was_d))
        accepted = tuple(min(x - y, d) for x, y, d in zip(now_a, was_a, drafted))
        return AcceptanceCounters(drafted=drafted, accepted=accepted)


def _padded(values: tuple[float, ...], n: int) -> tuple[float, ...]:
    return values + (0.0,) * (n - len(values))


_DRAFTS_METRIC = "vllm:spec_decode_num_drafts_total"
_ACCEPTED_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?"
                          r"\s+(?P<value>\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def counters_from_metrics(text: str) -> AcceptanceCounters:
    """:class:`AcceptanceCounters` from a vLLM ``/metrics`` page (Prometheus text format).

    Sums over the other labels (several engines or model names add up); assumes a fixed depth
    (see :class:`AcceptanceCounters`).
    """
    drafts = 0.0
    accepted: dict[int, float] = {}
    seen_drafts = False
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line.strip())
        if match is None or line.lstrip().startswith("#"):
            continue
        name = match["name"]
        if name not in (_DRAFTS_METRIC, _ACCEPTED_METRIC):
            continue
        value = float(match["value"])
        if name == _DRAFTS_METRIC:
            drafts += value
            seen_drafts = True
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if "position" not in labels:
            raise ValueError(f"{_ACCEPTED_METRIC} sample without a position label: {line!r}")
        position = int(labels["position"])
        accepted[position] = accepted.get(position, 0.0) + value
    if not seen_drafts or not accepted:
        raise ValueError(f"no {_DRAFTS_METRIC} or {_ACCEPTED_METRIC} samples on the metrics page; "
                         f"the server runs without speculation (K=0) or is not vLLM")
    if sorted(accepted) != list(range(len(accepted))):
        raise ValueError(f"{_ACCEPTED_METRIC} positions {sorted(accepted)} are not 0..n-1")
    return AcceptanceCounters.from_engine(drafts, [accepted[i] for i in range(len(accepted))])


def estimate_acceptance(counters: AcceptanceCounters | None = None, *,
                        prior: Sequence[float] = DEFAULT_ACCEPTANCE_PRIOR,
                        prior_rounds: float = DEFAULT_PRIOR_ROUNDS) -> tuple[float, ...]:
    """p_0..p_14: the probability that each draft position is accepted, prior and counters blended.

    Each position's estimate is the mean of a Beta posterior whose prior is worth
    ``prior_rounds`` rounds: (accepted_i + prior_rounds * prior_i) / (drafted_i + prior_rounds).
    With few rounds it stays near the prior, with many it is the observed ratio. A position never
    drafted (deeper than the served depth) keeps its prior.

    The result is made non-increasing by a running minimum from position 0: position i + 1 is
    accepted only if position i was, so a rise is noise or a prior too optimistic for this
    workload (a prior 0.195 at position 7 after an observed 0.02 at position 6). The minimum errs
    towards shallower speculation, whose cost is bounded.
    """
    prior = _check_probabilities(prior, "prior")
    if len(prior) < MAX_DEPTH:
        raise ValueError(f"prior has {len(prior)} positions; give {MAX_DEPTH}, one per position")
    if isinstance(prior_rounds, bool) or not isinstance(prior_rounds, (int, float)) \
            or not math.isfinite(prior_rounds) or prior_rounds <= 0:
        raise ValueError(f"prior_rounds={prior_rounds!r} must be a finite number > 0 (rounds the "
                         f"prior weighs; {DEFAULT_PRIOR_ROUNDS:g} by default)")
    estimate = list(prior[:MAX_DEPTH])
    if counters is not None:
        for i, (drafted, accepted) in enumerate(zip(counters.drafted, counters.accepted)):
            estimate[i] = (accepted + prior_rounds * prior[i]) / (drafted + prior_rounds)
    return _non_increasing(estimate)


# --------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CandidateScore:
    """One depth's prediction: tokens a round commits, what the round costs, and their ratio."""

    k: int
    tokens_per_round: float
    round_ms: float
    tokens_per_ms: float


@dataclass(frozen=True)
class DepthDecision:
    """The chosen depth, the context it was chosen for, and every candidate's score (for logs)."""

    k: int
    context: int
    candidates: tuple[CandidateScore, ...]

    def score(self, k: int) -> CandidateScore:
        for candidate in self.candidates:
            if candidate.k == k:
                return candidate
        raise KeyError(f"depth {k} is not in the ladder {[c.k for c in self.candidates]}")

    def log_line(self) -> str:
        scores = " ".join(f"k{c.k}={c.tokens_per_ms * 1000:.1f}" for c in self.candidates)
        return f"[depth] k={self.k} context={self.context} tok/s: {scores}"


def expected_tokens_per_round(k: int, acceptance: Sequence[float]) -> float:
    """1 + p_0 + ... + p_{k-1}: the verified token plus each draft position's acceptance."""
    _check_depth(k, "k")
    if len(acceptance) < k:
        raise ValueError(f"acceptance has {len(acceptance)} positions, depth {k} needs {k}")
    return 1.0 + math.fsum(acceptance[:k])


def choose_depth(contexts: int | Sequence[int], acceptance: Sequence[float], *,
                 ladder: Sequence[int] = DEFAULT_LADDER,
                 costs: CostConstants = DEFAULT_COSTS,
                 verify_depth: int | None = None) -> DepthDecision:
    """The ladder depth with the most expected tokens per ms at the longest of ``contexts``.

    ``contexts``: the live context (tokens) of each running request, or one int. One depth
    serves the whole batch, so it is chosen for the most demanding request, the longest context.
    ``acceptance``: p_i per draft position (:func:`estimate_acceptance`). Ties go to the
    shallower depth. ``verify_depth``: see :meth:`CostConstants.round_ms`.
    """
    ladder = validate_ladder(ladder)
    context = _longest_context(contexts)
    acceptance = _check_probabilities(acceptance, "acceptance")
    candidates = []
    for k in ladder:
        tokens = expected_tokens_per_round(k, acceptance)
        round_ms = costs.round_ms(k, context, verify_depth)
        candidates.append(CandidateScore(k=k, tokens_per_round=tokens, round_ms=round_ms,
                                         tokens_per_ms=tokens / round_ms if round_ms > 0
                                         else math.inf))
    best = candidates[0]
    for candidate in candidates[1:]:  # ascending depth: a deeper one must be strictly better
        if candidate.tokens_per_ms > best.tokens_per_ms and not math.isclose(
                candidate.tokens_per_ms, best.tokens_per_ms, rel_tol=_TIE_REL_TOL):
            best = candidate
    return DepthDecision(k=best.k, context=context, candidates=tuple(candidates))


@dataclass(frozen=True)
class DepthPolicy:
    """An owner's ``K=auto`` settings: ladder, cost constants, acceptance prior and its weight."""

    ladder: tuple[int, ...] = DEFAULT_LADDER
    costs: CostConstants = DEFAULT_COSTS
    prior: tuple[float, ...] = DEFAULT_ACCEPTANCE_PRIOR
    prior_rounds: float = DEFAULT_PRIOR_ROUNDS
    # True where the engine drafts the chosen depth but verifies the deepest one's width every
    # round (1Cat-vLLM: fork_patches/spec/auto_depth.py, "On 1Cat-vLLM"): a round at depth k then
    # pays k drafter steps but max_depth verify rows, and cannot be 0 (speculation off).
    fixed_verify: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ladder", validate_ladder(self.ladder))
        object.__setattr__(self, "prior", tuple(self.prior))  # frozen and hashable, like the rest
        # Validates prior and prior_rounds (raises on a bad one).
        estimate_acceptance(None, prior=self.prior, prior_rounds=self.prior_rounds)
        if self.fixed_verify and 0 in self.ladder:
            raise ValueError(f"ladder {list(self.ladder)} holds 0 (speculation off), which this "
                             "engine cannot switch to per step: it drafts at least one token and "
                             "verifies the deepest depth's width every round; drop the 0")

    @property
    def verify_depth(self) -> int | None:
        """The draft rows every verify batch holds (None: the drafted depth's)."""
        return self.max_depth if self.fixed_verify else None

    def acceptance(self, counters: AcceptanceCounters | None = None) -> tuple[float, ...]:
        return estimate_acceptance(counters, prior=self.prior, prior_rounds=self.prior_rounds)

    def decide(self, contexts: int | Sequence[int],
               counters: AcceptanceCounters | None = None) -> DepthDecision:
        """The depth for the running requests' ``contexts``, given the engine's counters."""
        return choose_depth(contexts, self.acceptance(counters), ladder=self.ladder,
                            costs=self.costs, verify_depth=self.verify_depth)

    @property
    def max_depth(self) -> int:
        """The depth the engine must be able to draft (its ``num_speculative_tokens``)."""
        return self.ladder[-1]


def crossover_context(shallow: int, deep: int, acceptance: Sequence[float], *,
                      costs: CostConstants = DEFAULT_COSTS, limit: int = 1 << 22) -> int | None:
    """The first context at which depth ``deep`` no longer beats ``shallow`` (None: not below
    ``limit``). Assumes one crossing, as the linear costs give: the deep round's cost grows
    faster with context, its tokens do not."""
    _check_depth(shallow, "shallow")
    _check_depth(deep, "deep")

    def deep_wins(context: int) -> bool:
        return choose_depth(context, acceptance, ladder=(shallow, deep), costs=costs).k == deep

    if not deep_wins(0):
        return 0
    if deep_wins(limit):
        return None
    lo, hi = 0, limit  # deep wins at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if deep_wins(mid) else (lo, mid)
    return hi


# --------------------------------------------------------------------------------------------
# An owner's settings
# --------------------------------------------------------------------------------------------

def parse_ladder(text: str) -> tuple[int, ...]:
    """``"auto"`` (the default ladder) or comma-separated depths, e.g. ``"0,3,7"``."""
    if not isinstance(text, str):
        raise ValueError(f"ladder={text!r} must be a string such as '1,3,7,15' or 'auto'")
    stripped = text.strip()
    if stripped.lower() == "auto":
        return DEFAULT_LADDER
    if not stripped:
        raise ValueError("ladder is empty; give depths such as '1,3,7,15', or 'auto'")
    depths = []
    for position, entry in enumerate(stripped.split(",")):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"ladder {text!r}: entry {position + 1} is empty; write depths "
                             f"separated by single commas, e.g. '1,3,7,15'")
        if not re.fullmatch(r"[+-]?\d+", entry):
            raise ValueError(f"ladder {text!r}: entry {entry!r} is not a whole number; depths are "
                             f"integers 0..{MAX_DEPTH}")
        depths.append(int(entry))
    return validate_ladder(depths)


def validate_ladder(depths: Sequence[int]) -> tuple[int, ...]:
    """The depths, checked and sorted ascending (so that ties can go to the shallower)."""
    if isinstance(depths, str):
        return parse_ladder(depths)
    depths = list(depths)
    if not depths:
        raise ValueError("ladder is empty; give depths such as '1,3,7,15', or 'auto'")
    seen: set[int] = set()
    for k in depths:
        _check_depth(k, "ladder entry")
        if k in seen:
            raise ValueError(f"ladder entry {k} appears twice; list each depth once")
        seen.add(k)
    if max(depths) == 0:
        raise ValueError("ladder holds only 0 (speculation off); serve with K=0 instead, or add "
                         "a depth 1..15")
    return tuple(sorted(depths))


def parse_cost_overrides(overrides: str | Mapping[str, float] | None,
                         base: CostConstants = DEFAULT_COSTS) -> CostConstants:
    """``base`` with an owner's constants replaced: a mapping, or a JSON object as text.

    Keys are :class:`CostConstants` fields (a_ms, b_ms_per_token, c_ms, fixed_ms,
    fixed_ms_per_token, wide_verify_ms, off_ms, off_ms_per_token); units are in their names.
    """
    if overrides is None:
        return base
    if isinstance(overrides, str):
        if not overrides.strip():
            return base
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost constants are not valid JSON ({exc.msg} at character "
                             f"{exc.pos}); write an object such as "
                             f'{{"a_ms": 0.8, "c_ms": 0.4}}') from None
    if not isinstance(overrides, Mapping):
        raise ValueError(f"cost constants must be a JSON object / mapping of name to number, got "
                         f"{type(overrides).__name__}")
    known = {f.name for f in fields(CostConstants)}
    unknown = sorted((name for name in overrides if name not in known), key=str)
    if unknown:
        raise ValueError(f"unknown cost constant {unknown[0]!r}; the names are "
                         f"{', '.join(sorted(known))}")
    return replace(base, **dict(overrides))


def policy_from_settings(ladder: str | Sequence[int] = "auto",
                         constants: str | Mapping[str, float] | None = None,
                         prior_rounds: float = DEFAULT_PRIOR_ROUNDS,
                         fixed_verify: bool = False) -> DepthPolicy:
    """The policy for an owner's ``K=auto`` settings; a ValueError names what is wrong."""
    depths = parse_ladder(ladder) if isinstance(ladder, str) else validate_ladder(ladder)
    return DepthPolicy(ladder=depths, costs=parse_cost_overrides(constants),
                       prior_rounds=prior_rounds, fixed_verify=fixed_verify)


# --------------------------------------------------------------------------------------------
# Checks shared by the above
# --------------------------------------------------------------------------------------------

def _check_depth(k: object, what: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"{what} {k!r} is not an integer depth 0..{MAX_DEPTH}")
    if k < 0:
        raise ValueError(f"{what} {k} is negative; depths are 0 (off) to {MAX_DEPTH}")
    if k > MAX_DEPTH:
        raise ValueError(f"{what} {k} exceeds {MAX_DEPTH}: past K={MAX_DEPTH} the K+1 verify rows "
                         f"leave the QPN decode kernels' 16-row bands; use a depth <= {MAX_DEPTH}")


def _check_context(context: object) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context {context!r} must be a whole number of tokens >= 0")


def _longest_context(contexts: int | Sequence[int]) -> int:
    if isinstance(contexts, int) and not isinstance(contexts, bool):
        _check_context(contexts)
        return contexts
    contexts = list(contexts)
    if not contexts:
        raise ValueError("no running requests (empty contexts): there is no depth to decide")
    for context in contexts:
        _check_context(context)
    return max(contexts)


def _check_probabilities(values: Sequence[float], what: str) -> tuple[float, ...]:
    out = tuple(values)
    for i, p in enumerate(out):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"{what}[{i}]={p!r} is not a probability in [0, 1]")
    return out
