"""The boot gates: is the server that came up the configuration that was asked for?

Every gate reads a structured source only: the route census the overlay writes per rank
(``qpn.fork_patches.census.aggregate``), the engine's Prometheus ``/metrics``, and the warm
request's API response. No gate reads log text. The engine profile says which gates apply on
an engine and what they expect; a gate that does not apply is reported as ``n/a`` with the
reason and, where there is one, the value observed.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from qpn.scripts.engine_profiles import (
    GATE_DECODE_ATTENTION, GATE_DEPTH, GATE_KV, GATE_LM_HEAD, GATE_ORDER, GATE_PLATFORM,
    GATE_QPN_ROUTES, GATE_WARM, EngineProfile,
)

PASS, FAIL, NA = "PASS", "FAIL", "n/a"

# vLLM 0.32 (v1/spec_decode/metrics.py) registers one `position` label per draft slot at
# start-up, so the served depth is readable before any request is speculated.
DEPTH_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class GateResult:
    name: str
    status: str  # PASS | FAIL | n/a
    expected: str
    observed: str

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def served_depth(metrics_text: str) -> int:
    """Number of distinct draft positions the engine exports (0: speculation off)."""
    positions = set()
    for line in metrics_text.splitlines():
        if line.startswith(DEPTH_METRIC + "{"):
            match = _POSITION.search(line)
            if match:
                positions.add(int(match.group(1)))
    return len(positions)


def qpn_route_names() -> frozenset[str] | None:
    """The kernels' route table names, when the kernel package is importable."""
    try:
        from qpn.kernels.routes import QPN_MOE_ROUTES, QPN_ROUTES
    except ImportError:
        return None
    return frozenset(QPN_ROUTES | QPN_MOE_ROUTES)


def is_qpn_route(route: str, known: frozenset[str] | None) -> bool:
    if known is not None:
        return route in known
    return route.startswith("qpn")


def declared_regions(quant_config: dict | None) -> set[str]:
    """Regions ('nvfp4', 'fp8') the checkpoint's quantization map declares."""
    if not quant_config:
        return set()
    layers = quant_config.get("quantized_layers")
    if layers is None:
        layers = quant_config.get("quantization", {}).get("quantized_layers", {})
    regions = set()
    for entry in (layers or {}).values():
        algo = str(entry.get("quant_algo", "") if isinstance(entry, dict) else entry).lower()
        if "nvfp4" in algo:
            regions.add("nvfp4")
        elif "fp8" in algo:
            regions.add("fp8")
    return regions


def _rank_dicts(census: dict) -> list[dict]:
    return [r for r in census.get("ranks", []) if isinstance(r, dict)]


def total_calls(route_counts: dict) -> int:
    return sum(int(c.get("eager", 0)) + int(c.get("graph", 0)) for c in route_counts.values())


# ---- one function per gate -------------------------------------------------------------------

def gate_warm(warm: dict) -> GateResult:
    tokens = warm.get("completion_tokens", 0)
    ok = warm.get("ok", False) and tokens > 0
    observed = f"{tokens} completion tokens" if warm.get("ok") else warm.get("error", "no reply")
    return GateResult(GATE_WARM, PASS if ok else FAIL,
                      "greedy chat answered with > 0 completion tokens", observed)


def gate_depth(k: int, metrics_text: str | None) -> GateResult:
    if metrics_text is None:
        return GateResult(GATE_DEPTH, FAIL, f"{k} draft positions in /metrics",
                          "/metrics unreadable")
    served = served_depth(metrics_text)
    return GateResult(GATE_DEPTH, PASS if served == k else FAIL,
                      f"{k} draft positions ({DEPTH_METRIC})", f"{served} positions")


def gate_platform(expect: dict, census: dict) -> GateResult:
    ranks = _rank_dicts(census)
    if not ranks:
        return GateResult(GATE_PLATFORM, FAIL, _fmt(expect), "no census written by any rank")
    seen = sorted({(str(r.get("platform")), str(r.get("backend")),
                    str(r.get("device_capability"))) for r in ranks})
    bad = [r for r in ranks if any(str(r.get(key)) != str(value) for key, value in expect.items())]
    observed = f"{len(ranks)} rank(s): " + "; ".join(
        f"platform={p} backend={b}" + (f" capability={c}" if c != "None" else "")
        for p, b, c in seen)
    return GateResult(GATE_PLATFORM, FAIL if bad else PASS, _fmt(expect), observed)


def gate_qpn_routes(census: dict, regions: set[str], known: frozenset[str] | None
                    ) -> GateResult:
    total = int(census.get("modules_total", 0))
    on_qpn = int(census.get("modules_on_qpn", 0))
    by_region = {k: int(v) for k, v in census.get("modules_by_region", {}).items()}
    route_counts = census.get("route_counts", {})
    foreign = sorted(set(census.get("non_qpn_routes", []))
                     | {r for r in route_counts if not is_qpn_route(r, known)})
    fallback_calls = int(census.get("fallback_calls", 0))
    fallbacks = census.get("fallbacks", [])
    missing_regions = sorted(r for r in regions if by_region.get(r, 0) == 0)
    calls = total_calls(route_counts)
    problems = []
    if total == 0:
        problems.append("no quantized module admitted")
    if on_qpn != total:
        problems.append(f"{total - on_qpn} module(s) not on a QPN route")
    if foreign:
        problems.append(f"non-QPN routes {foreign}")
    if fallback_calls or fallbacks:
        names = sorted({f.get("module", "?") for f in fallbacks})[:5]
        problems.append(f"{fallback_calls} fallback call(s) {names}")
    if missing_regions:
        problems.append(f"declared region(s) {missing_regions} have no admitted module")
    if total and calls == 0:
        problems.append("no QPN route calls recorded after the warm request")
    routes = ", ".join(f"{r}={total_calls({r: c})}" for r, c in sorted(route_counts.items()))
    observed = (f"{on_qpn}/{total} modules on QPN ({_fmt(by_region)}); calls: {routes or 'none'}"
                f"; fallbacks {fallback_calls}")
    if problems:
        observed += " -- " + "; ".join(problems)
    return GateResult(GATE_QPN_ROUTES, FAIL if problems else PASS,
                      "every quantized module on a QPN route, 0 fallbacks" +
                      (f", regions {sorted(regions)}" if regions else ""), observed)


def gate_lm_head(census: dict, known: frozenset[str] | None) -> GateResult:
    heads = census.get("lm_head") or []
    if isinstance(heads, dict):
        heads = [heads]
    expected = "source=checkpoint_codes, no repack fallback, QPN route family (every rank)"
    if not heads:
        return GateResult(GATE_LM_HEAD, FAIL, expected, "no lm_head entry in the census")
    bad = [h for h in heads
           if h.get("source") != "checkpoint_codes" or h.get("repack_fallback") is not False
           or not is_qpn_route(str(h.get("route_family", "")), known)]
    seen = sorted({(str(h.get("source")), str(h.get("route_family")),
                    str(h.get("repack_fallback"))) for h in heads})
    observed = "; ".join(f"source={s} route_family={f} repack_fallback={r}" for s, f, r in seen)
    return GateResult(GATE_LM_HEAD, FAIL if bad else PASS, expected,
                      f"{len(heads)} rank(s): {observed}")


def gate_kv(expect_applies: bool, expected: tuple[str, ...] | None, why_not: str,
            census: dict) -> GateResult:
    resolved = [str(v.get("resolved") if isinstance(v, dict) else v)
                for v in census.get("kv_resolved", [])]
    observed = ", ".join(sorted(set(resolved))) or "not recorded"
    if not expect_applies:
        return GateResult(GATE_KV, NA, why_not, observed)
    ok = bool(resolved) and all(v in expected for v in resolved)
    return GateResult(GATE_KV, PASS if ok else FAIL, " or ".join(expected), observed)


def gate_decode_attention(expect: dict, census: dict) -> GateResult:
    counts: dict[str, int] = {}
    for rank in _rank_dicts(census):
        for route, calls in (rank.get("attention_routes") or {}).items():
            counts[route] = counts.get(route, 0) + int(calls)
    expected = (f"calls on a tensor-core route {list(expect['tensor_core_prefixes'])}, "
                f"0 on {list(expect['forbidden'])}")
    if not counts:
        return GateResult(GATE_DECODE_ATTENTION, FAIL, expected,
                          "no attention_routes recorded in the census")
    tensor_core = sum(c for r, c in counts.items()
                      if r.startswith(tuple(expect["tensor_core_prefixes"])))
    forbidden = sum(c for r, c in counts.items() if r in expect["forbidden"])
    ok = tensor_core > 0 and forbidden == 0
    return GateResult(GATE_DECODE_ATTENTION, PASS if ok else FAIL, expected, _fmt(counts))


def _fmt(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


# ---- all gates -------------------------------------------------------------------------------

def evaluate(profile: EngineProfile, k: int, warm: dict, metrics_text: str | None,
             census: dict | None, regions: set[str]) -> list[GateResult]:
    census = census or {}
    known = qpn_route_names()
    results: dict[str, GateResult] = {}
    for name in GATE_ORDER:
        spec = profile.gates[name]
        if name == GATE_KV:
            results[name] = gate_kv(spec.applies, spec.expected, spec.why_not, census)
            continue
        if not spec.applies:
            results[name] = GateResult(name, NA, spec.why_not, "-")
            continue
        if name == GATE_WARM:
            results[name] = gate_warm(warm)
        elif name == GATE_DEPTH:
            results[name] = gate_depth(k, metrics_text)
        elif name == GATE_PLATFORM:
            results[name] = gate_platform(spec.expected, census)
        elif name == GATE_QPN_ROUTES:
            result = gate_qpn_routes(census, regions, known)
            backend = (spec.expected or {}).get("backend")
            wrong = sorted({str(r.get("backend")) for r in _rank_dicts(census)} - {backend})
            if backend and wrong and result.status == PASS:
                result.status = FAIL
                result.observed += f" -- backend {wrong}, expected {backend}"
            results[name] = result
        elif name == GATE_LM_HEAD:
            results[name] = gate_lm_head(census, known)
        elif name == GATE_DECODE_ATTENTION:
            results[name] = gate_decode_attention(spec.expected, census)
    return [results[name] for name in GATE_ORDER]


def format_table(results: list[GateResult]) -> str:
    rows = [("gate", "status", "expected", "observed")]
    rows += [(r.name, r.status, r.expected, r.observed) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3]))
                     + "  " + row[3])
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 8)
    return "\n".join(lines)


def to_json(results: list[GateResult], **context: object) -> str:
    return json.dumps({**context, "passed": not any(r.failed for r in results),
                       "gates": [asdict(r) for r in results]}, indent=2)
