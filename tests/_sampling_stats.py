"""The target distribution a sampled request asks for, and a chi-square test of draws against it.

``target_probs`` follows vLLM's own definitions (``topk_topp_sampler.apply_top_k_top_p_pytorch``):
logits divided by the temperature; top-k keeps the k largest (ties at the k-th value kept);
top-p sorts ascending, drops every token whose ascending cumulative probability is <= 1 - p and
always keeps the largest. Computed in float64, independently of the engine's code.
"""
from __future__ import annotations

import math
from collections import Counter


def target_probs(logits, temperature: float, top_k: int | None = None,
                 top_p: float | None = None) -> dict[int, float]:
    """{token index: probability} of the request's distribution over ``logits`` (any sequence)."""
    z = [float(v) / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: z[i])  # ascending
    keep = set(order)
    if top_k is not None and top_k < len(z):
        kth = z[order[-top_k]]
        keep = {i for i in keep if z[i] >= kth}
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    total = sum(w.values())
    p = {i: w[i] / total for i in w}
    if top_p is not None:
        cum, dropped = 0.0, set()
        kept_sorted = [i for i in order if i in p]
        for i in kept_sorted[:-1]:
            cum += p[i]
            if cum <= 1 - top_p:
                dropped.add(i)
        p = {i: v for i, v in p.items() if i not in dropped}
        total = sum(p.values())
        p = {i: v / total for i, v in p.items()}
    return p


def chi_square(draws, probs: dict[int, float], min_expected: float = 5.0) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of ``draws`` against ``probs``. Categories whose
    expected count is below ``min_expected`` are pooled into one bin; a draw outside ``probs`` counts
    in that bin too, so a token the distribution forbids can only raise the statistic (and with no
    pooled bin it gets one of expected count ~0, which rejects)."""
    import torch

    n = len(draws)
    counts = Counter(draws)
    big = {t: q for t, q in probs.items() if q * n >= min_expected}
    pooled_p = 1.0 - sum(big.values())
    pooled_obs = n - sum(counts[t] for t in big)
    cells = [(counts[t], q * n) for t, q in big.items()]
    if pooled_obs or pooled_p * n > 1e-9:
        cells.append((pooled_obs, max(pooled_p * n, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    if df < 1:
        return stat, df, 1.0 if stat == 0 else 0.0
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p_value
