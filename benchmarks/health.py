# SPDX-License-Identifier: MIT
"""Output health beside every speed figure: a broken quantization can look fast, because
repetitive text is easy to predict (seed 002's point: its all-FP4 derivative named 4 distinct
entries out of 50, one of them 50 times, where the published checkpoint named 50 of 50).

Per answer (``answer_health``; reasoning and content together):

- ``natural_stop``: the engine stopped by itself (``finish_reason`` stop), not at ``max_tokens``;
- ``replacement_rate``: U+FFFD characters per character, the trace of byte-level tokens that do
  not form UTF-8;
- ``distinct_4grams``: distinct word 4-grams over all word 4-grams (1.0 below four words);
- ``longest_repeat``: the longest run of words that occurs at least twice, in words.

``--min-health`` bounds a run, per cell (the mean over the cell's rows), e.g.
``natural_stop>=1,distinct_4grams>=0.5,replacement_rate<=0.001,longest_repeat<=40``; a run with a
cell outside its bounds writes its rows, records why and exits 3 (``violations``).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

FIGURES = ("natural_stop", "replacement_rate", "distinct_4grams", "longest_repeat")
N = 4
_BOUND = re.compile(r"^\s*([a-z_0-9]+)\s*(>=|<=)\s*([0-9.eE+-]+)\s*$")


def distinct_ngram_share(words: list[str], n: int = N) -> float:
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_repeat(words: list[str]) -> int:
    """The longest word run that occurs twice (overlaps allowed), by binary search on its length:
    a run of length L repeating implies one of every length below L repeats."""
    def repeats(length: int) -> bool:
        seen = set()
        for i in range(len(words) - length + 1):
            gram = tuple(words[i:i + length])
            if gram in seen:
                return True
            seen.add(gram)
        return False

    lo, hi = 0, max(0, len(words) - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if repeats(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def answer_health(text: str, finish_reason: str | None) -> dict:
    words = text.split()
    return {
        "natural_stop": finish_reason == "stop",
        "replacement_rate": text.count("\ufffd") / len(text) if text else 0.0,
        "distinct_4grams": distinct_ngram_share(words),
        "longest_repeat": longest_repeat(words),
    }


@dataclass(frozen=True)
class Bound:
    figure: str
    op: str  # ">=" | "<="
    value: float

    def holds(self, observed: float) -> bool:
        return observed >= self.value if self.op == ">=" else observed <= self.value

    def __str__(self) -> str:
        return f"{self.figure}{self.op}{self.value:g}"


def parse_bounds(text: str) -> list[Bound]:
    """``natural_stop>=1,longest_repeat<=40`` -> bounds; ValueError naming the bad part."""
    bounds = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _BOUND.match(part)
        if not m:
            raise ValueError(f"bad health bound {part!r}: write FIGURE>=VALUE or FIGURE<=VALUE, "
                             f"FIGURE one of {', '.join(FIGURES)}")
        if m.group(1) not in FIGURES:
            raise ValueError(f"unknown health figure {m.group(1)!r}; choose from {', '.join(FIGURES)}")
        bounds.append(Bound(m.group(1), m.group(2), float(m.group(3))))
    if not bounds:
        raise ValueError("--min-health given with no bound")
    return bounds


def violations(rows: list[dict], bounds: list[Bound], group_key: str = "cell") -> list[str]:
    """For each group of rows (same ``group_key``; all rows when they have none), each bound its
    mean figure breaks, as one line naming the group, the figure and both values."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get(group_key, "all")), []).append(row)
    out = []
    for name, members in groups.items():
        for b in bounds:
            values = [float(r[b.figure]) for r in members if r.get(b.figure) is not None]
            if not values:
                out.append(f"{name}: {b.figure} not measured")
                continue
            mean = sum(values) / len(values)
            if not b.holds(mean):
                out.append(f"{name}: {b.figure} {mean:.4g} breaks {b} ({len(values)} row(s))")
    return out


def distinct_items(text: str) -> tuple[int, int, str | None, int]:
    """(entries, distinct entries, the most repeated entry, its count) of a one-per-line list;
    numbering, bullets and case are ignored."""
    entries = []
    for line in text.splitlines():
        item = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line).strip().strip(".").lower()
        if item:
            entries.append(item)
    counts = Counter(entries)
    top, top_count = counts.most_common(1)[0] if counts else (None, 0)
    return len(entries), len(counts), top, top_count
