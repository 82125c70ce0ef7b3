"""Speculation counters from Prometheus /metrics, and the decode figures of one request.

Definitions (seed 000's metric contract, restated in our words):

- tau: drafted tokens accepted per verification round,
  ``delta(vllm:spec_decode_num_accepted_tokens_total) / delta(vllm:spec_decode_num_drafts_total)``
  over one request. It lies in [0, K]; each round emits tau + 1 tokens (the accepted drafts
  plus the target's own token).
- rounds: ``delta(vllm:spec_decode_num_drafts_total)``, the verification rounds the server
  counted. Without speculation (no spec-decode counters at all) every decode step is one
  round emitting one token: tau = 0 and rounds = generated - 1.
- decode seconds: first text chunk to last text chunk (prefill excluded).
- ms per round: decode seconds * 1000 / rounds.
- throughput, round convention (seed 000's, the conservative one):
  ``(generated - (tau + 1)) / decode_seconds`` - a whole round is subtracted.
- throughput, one-token convention: ``(generated - 1) / decode_seconds``. It reads higher by
  tau / decode_seconds. Both are reported, each under its own label.

All functions here are pure: they take scraped text or StreamResult objects.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# volta-qpn's own counter under K=auto (fork_patches/spec/auto_depth.py): rounds by drafted depth.
ROUNDS_PER_DEPTH = "qpn:spec_decode_rounds_per_depth_total"

THROUGHPUT_ROUND_LABEL = "tok/s (generated - (tau+1)) / decode_s"
THROUGHPUT_ONE_TOKEN_LABEL = "tok/s (generated - 1) / decode_s"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value). Comments skipped."""
    samples = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, _, label_text, value = m.group(1), m.group(2), m.group(3), m.group(4)
        labels = dict(_LABEL.findall(label_text or ""))
        try:
            samples.append((name, labels, float(value)))
        except ValueError:
            continue
    return samples


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: tuple[float, ...]  # index = draft position
    # (depth, rounds) for each depth drafted; empty unless the server exports ROUNDS_PER_DEPTH
    rounds_per_depth: tuple[tuple[int, float], ...] = ()

    @property
    def mean_drafted(self) -> float | None:
        """Draft tokens per round: the depth actually drafted (below K under K=auto)."""
        return self.draft_tokens / self.drafts if self.drafts else None

    @property
    def depth(self) -> int:
        """K: one position label per draft slot (present from start-up in vLLM 0.32)."""
        return len(self.accepted_per_pos)


def spec_counters(samples, model: str | None = None) -> SpecCounters | None:
    """Sum the spec-decode counters over engines; None when the server exposes none
    (speculation off). With ``model``, only samples labelled with that model_name count."""
    sums = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    seen = False
    per_pos: dict[int, float] = {}
    per_depth: dict[int, float] = {}
    for name, labels, value in samples:
        if model is not None and labels.get("model_name", model) != model:
            continue
        if name in sums:
            sums[name] += value
            seen = True
        elif name == ACCEPTED_PER_POS and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
            seen = True
        elif name == ROUNDS_PER_DEPTH and "depth" in labels:
            depth = int(labels["depth"])
            per_depth[depth] = per_depth.get(depth, 0.0) + value
    if not seen:
        return None
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(sums[DRAFTS], sums[DRAFT_TOKENS], sums[ACCEPTED], positions,
                        tuple(sorted(per_depth.items())))


def counters_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    if before is None or after is None:
        return None
    n = max(len(before.accepted_per_pos), len(after.accepted_per_pos))
    pad = lambda t: tuple(t) + (0.0,) * (n - len(t))  # noqa: E731
    return SpecCounters(
        after.drafts - before.drafts,
        after.draft_tokens - before.draft_tokens,
        after.accepted - before.accepted,
        tuple(a - b for a, b in zip(pad(after.accepted_per_pos), pad(before.accepted_per_pos))),
        _depth_delta(before.rounds_per_depth, after.rounds_per_depth),
    )


def _depth_delta(before, after) -> tuple[tuple[int, float], ...]:
    was = dict(before)
    return tuple((d, n - was.get(d, 0.0)) for d, n in after if n - was.get(d, 0.0) > 0)


def depth_text(counters: SpecCounters | None) -> str:
    """``"3:12 7:40"``: rounds per drafted depth, for a table cell; "" when not exported."""
    if counters is None:
        return ""
    return " ".join(f"{d}:{n:.0f}" for d, n in counters.rounds_per_depth)


@dataclass(frozen=True)
class DecodeFigures:
    generated: int
    ttft_s: float | None
    decode_s: float | None
    e2e_s: float | None
    tau: float | None
    rounds: float | None
    ms_per_round: float | None
    tok_s_round: float | None  # seed 000 convention: (generated - (tau+1)) / decode_s
    tok_s_one_token: float | None  # (generated - 1) / decode_s
    speculation: str  # "on" | "off" | "unknown"


def decode_figures(stream, delta: SpecCounters | None, speculation_known: bool = True
                   ) -> DecodeFigures:
    """Figures of one request from its stream and the spec-counter delta around it.

    ``delta`` None with ``speculation_known`` means the server has no spec-decode counters
    (speculation off: tau = 0). ``speculation_known`` False means /metrics could not be read:
    tau, rounds and the round convention stay empty rather than guessed.
    """
    generated = int(stream.completion_tokens or 0)
    decode_s = stream.decode_s
    if delta is not None:
        speculation = "on"
        tau = delta.accepted / delta.drafts if delta.drafts > 0 else None
        rounds = delta.drafts if delta.drafts > 0 else None
    elif speculation_known:
        speculation = "off"
        tau = 0.0
        rounds = float(generated - 1) if generated > 1 else None
    else:
        speculation = "unknown"
        tau = None
        rounds = None
    usable = decode_s is not None and decode_s > 0
    ms_per_round = decode_s * 1000.0 / rounds if usable and rounds else None
    tok_s_one = (generated - 1) / decode_s if usable and generated > 1 else None
    tok_s_round = (generated - (tau + 1.0)) / decode_s if usable and tau is not None else None
    return DecodeFigures(generated, stream.ttft_s, decode_s, stream.e2e_s, tau, rounds,
                         ms_per_round, tok_s_round, tok_s_one, speculation)


def mean_sd(values) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1) of the finite values; sd None below n=2."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


_BOXED = re.compile(r"\\boxed\{\s*([-+]?[\d,]+)\s*\}")
_ANSWER = re.compile(r"answer\s*(?:is|:|=)?\s*\**\s*([-+]?[\d,]+)", re.IGNORECASE)
_INT = re.compile(r"[-+]?\d[\d,]*")


def final_integer(text: str) -> int | None:
    """The final integer answer of a response: the last \\boxed{N}, else the last
    'answer: N', else the last integer in the text; None when there is none."""
    for pattern in (_BOXED, _ANSWER, _INT):
        found = pattern.findall(text or "")
        if found:
            try:
                return int(found[-1].replace(",", ""))
            except ValueError:
                continue
    return None
