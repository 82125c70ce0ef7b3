"""The boot gates: is the server that came up the configuration that was asked for?

Every gate reads a structured source only: the route census the overlay writes per rank
(``qpn.fork_patches.route_census.census.aggregate``), the engine's Prometheus ``/metrics``, and the warm
request's API response. No gate reads log text. The engine profile says which gates apply on
an engine and what they expect; a gate that does not apply is reported as ``n/a`` with the
reason and, where there is one, the value observed.

Every gate is one entry of ``GATES`` at the end of this module: its name, what it expects on
each engine, and a function from the typed, versioned census summary
(``qpn.fork_patches.route_census.census_schema.CensusSummary``, the module the census writer validates
against) and the other boot inputs (``GateInputs``) to a verdict with expected and observed. The
table's order is the printed order; adding a gate is adding an entry. What each census gate proves:

- ``census_platform``: one census per tensor-parallel rank (ranks 0..TP-1, each reporting that TP),
  on the expected platform and backend;
- ``quant_config``: every rank's checkpoint was claimed by the registered QPN config ("qpn") when
  QPN serves the checkpoint (``qpn_config.claim``), and by the engine's own config otherwise;
- ``qpn_routes``: every module the checkpoint declares quantized (ModelOpt ``quantized_layers``;
  compressed-tensors ``config_groups`` less ``ignore``; AWQ / GPTQ: every module holding codes less
  the config's skips) is served on a QPN route on every rank (the loader records which checkpoint
  names each module serves), with zero fallbacks and route calls after the warm request;
- ``lm_head_from_codes``: where the checkpoint quantizes ``lm_head``, every rank's head reports
  what the loader did (codes and scales received from the checkpoint and proven byte-identical
  after prepacking); where it leaves the head unquantized (AutoAWQ, GPTQ and llm-compressor's
  W4A16 recipes do), no rank serves a head through QPN;
- ``served_depth``: the engine exports K draft positions and has proposed draft tokens since
  the warm request (speculation configured but not running fails);
- ``decode_attention_route``: XQA for decode and MTP verification wherever 1Cat's own conditions
  send them there for the served layers (``qpn.fork_patches.route_census.attention_routes``), per rank;
- ``skipped_hooks``: no hook the plugin skipped (its anchor missing) is one this checkpoint needs.

A gate that reads per-rank records requires every rank's to be right and names the ranks that are
not: one right rank never stands for another (which ranks must be there is ``census_platform``'s).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Callable

from qpn.fork_patches.spec.auto_depth import DRAFT_PER_POS_METRIC
from qpn.fork_patches.route_census.census_schema import CensusSchemaError, CensusSummary
from qpn.scripts.launcher.engine_profiles import EngineProfile

PASS, FAIL, NA = "PASS", "FAIL", "n/a"

# Gate names; GATES (the table, at the end) gives their printed order.
GATE_WARM = "warm_request"
GATE_DEPTH = "served_depth"
GATE_PLATFORM = "census_platform"
GATE_QUANT_CONFIG = "quant_config"
GATE_QPN_ROUTES = "qpn_routes"
GATE_LM_HEAD = "lm_head_from_codes"
GATE_KV = "kv_cache_dtype"
GATE_DECODE_ATTENTION = "decode_attention_route"
GATE_SKIPPED_HOOKS = "skipped_hooks"

# vLLM 0.32 (v1/spec_decode/metrics.py) registers one `position` label per draft slot at
# start-up, so the served depth is readable before any request is speculated.
DEPTH_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
DRAFT_TOKENS_METRIC = "vllm:spec_decode_num_draft_tokens_total"
DRAFTS_METRIC = "vllm:spec_decode_num_drafts_total"
_POSITION = re.compile(r'position="(\d+)"')
# Checkpoint modules that belong to the MTP drafter: loaded only when speculation is on.
DRAFTER_PREFIXES = ("mtp.",)


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


def rounds_per_depth(metrics_text: str) -> dict[int, int]:
    """{depth: rounds that drafted exactly that many tokens} from the per-position drafts counter
    of K=auto (fork_patches/spec/auto_depth.py): rounds at depth d drafted position d-1 but not d."""
    per_pos: dict[int, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(DRAFT_PER_POS_METRIC + "_total{"):
            match = _POSITION.search(line)
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            if match:
                pos = int(match.group(1))
                per_pos[pos] = per_pos.get(pos, 0.0) + value
    rounds = {d: int(per_pos.get(d - 1, 0.0) - per_pos.get(d, 0.0))
              for d in range(1, max(per_pos, default=-1) + 2)}
    return {d: n for d, n in rounds.items() if n > 0}


def counter_total(metrics_text: str, metric: str) -> float:
    """Sum of a Prometheus counter over all its label sets (0 when absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(metric + "{") or line.startswith(metric + " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


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


def declared_layers(quant_config: dict | None) -> dict:
    """The checkpoint's ``quantized_layers`` map (module name -> entry), {} when it has none."""
    if not quant_config:
        return {}
    layers = quant_config.get("quantized_layers")
    if layers is None:
        layers = quant_config.get("quantization", {}).get("quantized_layers", {})
    return dict(layers or {})


def declared_modules(ckpt: str) -> tuple[object | None, dict]:
    """(convention, {checkpoint module name: ModuleScheme}) of the modules the checkpoint's
    convention declares quantized (qpn.fork_patches.quant.conventions.declared_modules: ModelOpt
    ``quantized_layers``; compressed-tensors ``config_groups`` targets less ``ignore``, matched on
    the module names of the safetensors headers, a class target such as ``Linear`` expanded over
    the modules that hold its scheme's codes). Names the config lists itself come first, in its
    order (the order the engine keeps its renamed copy of ModelOpt's map in); AWQ / GPTQ: the
    modules holding codes less the config's skips. (None, {}) when the folder carries no
    quantization config of a known convention; a scheme QPN does not serve raises ConventionError
    naming the config group (the preflight refuses on it)."""
    from qpn.fork_patches.quant import conventions

    try:
        conventions.detect(ckpt)
    except (conventions.ConventionError, OSError, ValueError):
        return None, {}
    return conventions.declared_modules(ckpt)


def declared_regions(quant_config: dict | None) -> set[str]:
    """Regions (format families: 'nvfp4', 'fp8', the integer families) the checkpoint's
    quantization config declares (ModelOpt ``quantized_layers``, compressed-tensors
    ``config_groups``, AWQ / GPTQ: qpn.fork_patches.quant.conventions). An integer config QPN does
    not serve declares none (the preflight refuses it, or the engine's own kernels serve it)."""
    from qpn.fork_patches.quant import conventions

    integer = conventions.integer_convention_of(quant_config)
    if integer is not None:
        try:
            schemes = (conventions.integer_group_schemes(quant_config).values()
                       if integer.declared_by == "config_groups" else [integer.scheme(quant_config)])
        except conventions.ConventionError:
            return set()
        return {s.format.family for s in schemes}
    if isinstance(quant_config, dict) and quant_config.get("quant_method") == "compressed-tensors":
        return conventions.ct_declared_formats(quant_config)
    from qpn.kernels.formats import find_format  # torch-free: the format descriptions only

    regions = set()
    for entry in declared_layers(quant_config).values():
        fmt = find_format(entry.get("quant_algo", "") if isinstance(entry, dict) else entry)
        if fmt is not None:  # an algo QPN does not serve: the loader refuses it, naming the module
            regions.add(fmt.family)
    return regions


Census = "CensusSummary | dict"  # a gate takes the typed summary or the dict it is read from


def _summary(census: Census | None) -> CensusSummary:
    return CensusSummary.from_dict(census)


def total_calls(route_counts: dict) -> int:
    return sum(int(c.get("eager", 0)) + int(c.get("graph", 0)) for c in route_counts.values())


# ---- one function per gate -------------------------------------------------------------------

def gate_warm(warm: dict) -> GateResult:
    tokens = warm.get("completion_tokens", 0)
    ok = warm.get("ok", False) and tokens > 0
    observed = f"{tokens} completion tokens" if warm.get("ok") else warm.get("error", "no reply")
    if warm.get("ok") and warm.get("note"):  # K=auto: the long warm request's size (serve.py)
        observed += f"; {warm['note']}"
    return GateResult(GATE_WARM, PASS if ok else FAIL,
                      "greedy chat answered with > 0 completion tokens", observed)


@dataclass(frozen=True)
class AutoDepth:
    """What the launcher expects of K=auto after its warm requests: the ladder, and the depths
    the policy picks (from its prior) for the short and the long warm request's context."""

    ladder: tuple[int, ...]
    short: tuple[int, int]  # (context, depth)
    long: tuple[int, int]

    @property
    def expects_change(self) -> bool:
        return self.short[1] != self.long[1]


def census_depth_steps(census) -> dict[int, int]:
    """{depth: scheduling steps drafted at it} from the census summary (K=auto; counted on each
    rank where the drafter applies the policy's depth, fork_patches/spec/auto_depth.py); {} when the
    census is absent or holds none."""
    if census is None:
        return {}
    steps = _summary(census).draft_depth_steps or {}
    return {int(d): int(n) for d, n in steps.items() if int(n) > 0}


def gate_depth(k: int, metrics_text: str | None, auto: AutoDepth | None = None,
               census=None) -> GateResult:
    """Served depth; under K=auto also the depths drafted, read from the census's steps per
    drafted depth where it has them (both engines; the only source on 1Cat, which exports no
    per-position drafts), else from the per-position drafts counter on /metrics."""
    expected = f"{k} draft positions ({DEPTH_METRIC})" + (
        f", draft tokens proposed after the warm request ({DRAFT_TOKENS_METRIC} > 0)" if k else "")
    if auto is not None:
        expected = f"K=auto over {list(auto.ladder)}: " + expected + (
            f"; at least two depths drafted (census draft_depth_steps, else {DRAFT_PER_POS_METRIC}:"
            f" the policy picks {auto.short[1]} at {auto.short[0]} tokens, {auto.long[1]} at "
            f"{auto.long[0]})" if auto.expects_change else "")
    if metrics_text is None:
        return GateResult(GATE_DEPTH, FAIL, expected, "/metrics unreadable")
    served = served_depth(metrics_text)
    drafts = counter_total(metrics_text, DRAFTS_METRIC)
    draft_tokens = counter_total(metrics_text, DRAFT_TOKENS_METRIC)
    observed = f"{served} positions; {drafts:g} drafts, {draft_tokens:g} draft tokens"
    problems = []
    if served != k:
        problems.append(f"served depth {served}, asked {k}")
    if k and draft_tokens <= 0:
        problems.append("no draft token proposed: speculation is configured but not running")
    if auto is not None:
        steps = census_depth_steps(census)
        rounds = steps or rounds_per_depth(metrics_text)
        source = "steps per drafted depth (census)" if steps else "rounds per depth"
        observed += f"; {source} " + (", ".join(f"{d}: {n}" for d, n in sorted(rounds.items()))
                                      or "none recorded")
        outside = sorted(set(rounds) - set(auto.ladder))
        if not rounds and draft_tokens > 0:
            problems.append(f"no census draft_depth_steps and no {DRAFT_PER_POS_METRIC} counts: "
                            "the auto-depth-draft-depth and draft-per-position-metric hooks are "
                            "not active")
        elif outside:
            problems.append(f"drafted depth(s) {outside} outside the ladder")
        elif auto.expects_change and len(rounds) < 2:
            problems.append("the depth never changed")
        # the summary's steps are the lowest rank's: every other rank's own must stay in the ladder too
        for rank in (_summary(census).ranks if census is not None else []):
            off = sorted({int(d) for d, n in (rank.draft_depth_steps or {}).items() if int(n) > 0}
                         - set(auto.ladder))
            if off:
                problems.append(f"rank {rank.rank} drafted depth(s) {off} outside the ladder")
    if problems:
        observed += " -- " + "; ".join(problems)
    return GateResult(GATE_DEPTH, FAIL if problems else PASS, expected, observed)


def gate_platform(expect: dict, census: dict, tp: int | None = None) -> GateResult:
    """One census per tensor-parallel rank, each on the expected platform and backend. ``tp`` is
    the size the launcher asked for; None: the size the ranks themselves report."""
    ranks = _summary(census).ranks
    reported = sorted({r.tensor_parallel_size for r in ranks}, key=str)
    size = tp if tp is not None else (reported[0] if len(reported) == 1 and reported[0] else None)
    expected = _fmt(expect) + f"; one census per rank of TP={size if size else '?'}"
    if not ranks:
        return GateResult(GATE_PLATFORM, FAIL, expected, "no census written by any rank")
    seen = sorted({(str(r.platform), str(r.backend), str(r.device_capability)) for r in ranks})
    bad = [r for r in ranks if any(str(getattr(r, key, None)) != str(value)
                                   for key, value in expect.items())]
    have = sorted(r.rank for r in ranks)
    observed = f"ranks {have}: " + "; ".join(
        f"platform={p} backend={b}" + (f" capability={c}" if c != "None" else "")
        for p, b, c in seen)
    problems = []
    if bad:
        problems.append(f"rank(s) {sorted(r.rank for r in bad)} not on {_fmt(expect)}")
    if size is None:
        problems.append(f"tensor-parallel size unknown (ranks report {reported})")
    else:
        missing = sorted(set(range(size)) - set(have))
        extra = sorted(set(have) - set(range(size)))
        if missing:
            problems.append(f"no census from rank(s) {missing} of TP={size}")
        if extra or len(have) != len(set(have)):
            problems.append(f"census rank(s) {extra or have} outside TP={size}")
        wrong = sorted(r.rank for r in ranks if r.tensor_parallel_size != size)
        if wrong:
            problems.append(f"rank(s) {wrong} report TP {reported}, asked {size}")
    if problems:
        observed += " -- " + "; ".join(problems)
    return GateResult(GATE_PLATFORM, FAIL if problems else PASS, expected, observed)


def gate_quant_config(census: Census, qpn_claim: str | None, why_not: str = "") -> GateResult:
    """Which quantization config claimed the checkpoint, per rank (census ``quant_config``, recorded
    by the registered QPN config): "qpn" on every rank when QPN serves the checkpoint
    (``qpn_claim``: the convention qpn_config.claim gives it), never "qpn" when it does not
    (``why_not``: why the engine's own config serves it)."""
    from qpn.fork_patches.quant.qpn_config import QPN_NAME

    ranks = _summary(census).ranks
    # a list, not a dict by rank: two records of one rank must both be right
    claimed = sorted(((r.rank, r.quant_config) for r in ranks), key=lambda c: c[0])
    observed = "; ".join(f"rank {rid}: {name or 'no QPN config'}" for rid, name in claimed) \
        or "no census written by any rank"
    if qpn_claim is None:
        expected = "the engine's own quantization config" + (f" ({why_not})" if why_not else "")
        wrong = sorted({rid for rid, name in claimed if name == QPN_NAME})
        if wrong:
            observed += f" -- rank(s) {wrong} served through the QPN config, which should not claim it"
        return GateResult(GATE_QUANT_CONFIG, FAIL if wrong else PASS, expected, observed)
    expected = f'"{QPN_NAME}" on every rank (QPN claims this {qpn_claim} checkpoint)'
    off = sorted({rid for rid, name in claimed if name != QPN_NAME})
    problems = []
    if not ranks:
        problems.append("the QPN config reached no rank: the engine's own config claimed the checkpoint "
                        "(is the volta-qpn plugin installed in the engine's environment?)")
    elif off:
        problems.append(f"rank(s) {off} were not served through the QPN config: another quantization "
                        "config claimed the checkpoint there (--quantization given?)")
    if problems:
        observed += " -- " + "; ".join(problems)
    return GateResult(GATE_QUANT_CONFIG, FAIL if problems else PASS, expected, observed)


def _coverage_problems(census: CensusSummary, quantized_layers: dict | None = None,
                       checkpoint_modules: dict | None = None) -> list[str]:
    """Checkpoint modules the checkpoint declares quantized that are not served on QPN, per rank.
    Each checkpoint name is paired with the engine's name for it, which the per-module
    ``declared`` lists of the census carry. ModelOpt (``quantized_layers``): the engine renames
    the map's keys with the model's hf_to_vllm_mapper (``apply_dict``: same order, one name per
    name), so the checkpoint's n-th name is the engine's n-th name (``engine_quantized_layers``);
    a changed count is reported. Every other convention (compressed-tensors, AWQ, GPTQ;
    ``checkpoint_modules``: the modules ``declared_modules`` gives): the engine holds no list of
    module names, so the registered QPN config records one per rank, {checkpoint name: engine
    name}, renamed by the model's own mapper (qpn_config.record_checkpoint_modules; census
    ``checkpoint_modules``); a rank without it fails."""
    problems = []
    for rank in census.ranks:
        rid = rank.rank
        drafting = int((rank.serving or {}).get("num_speculative_tokens") or 0) > 0
        if quantized_layers:
            names = list(quantized_layers)
            engine = rank.engine_quantized_layers
            if engine is None:
                problems.append(f"rank {rid}: the census has no engine_quantized_layers (the "
                                "quant config never reached the QPN hook)")
                continue
            if len(engine) != len(names):
                problems.append(f"rank {rid}: the engine holds {len(engine)} quantized_layers "
                                f"names, the checkpoint lists {len(names)}")
                continue
            pairs = list(zip(names, engine))
            listed = "in quantized_layers"
        else:
            engine_of = rank.checkpoint_modules
            if engine_of is None:
                problems.append(f"rank {rid}: the census has no checkpoint_modules (the QPN "
                                "quant config never reached this rank, or could not read the "
                                "checkpoint: see the engine log)")
                continue
            unknown = [c for c in checkpoint_modules if c not in engine_of]
            if unknown:
                problems.append(f"rank {rid}: {len(unknown)} declared checkpoint module(s) missing from "
                                f"the engine's checkpoint_modules, e.g. {unknown[:3]}")
            pairs = [(c, engine_of[c]) for c in checkpoint_modules if c in engine_of]
            listed = "declared by the checkpoint's config"
        on, off = set(rank.declared_on_qpn), set(rank.declared_off_qpn)
        needed = [(c, e) for c, e in pairs
                  if drafting or not (c.startswith(DRAFTER_PREFIXES) or (e or "").startswith(DRAFTER_PREFIXES))]
        dropped = [c for c, e in needed if e is None]
        not_on = [c for c, e in needed if e is not None and e in off]
        absent = [c if c == e else f"{c} (engine: {e})" for c, e in needed
                  if e is not None and e not in on and e not in off]
        if dropped:
            problems.append(f"rank {rid}: {len(dropped)} declared checkpoint module(s) the engine's "
                            f"mapper drops, e.g. {dropped[:3]}")
        if not_on:
            problems.append(f"rank {rid}: {len(not_on)} checkpoint module(s) admitted but "
                            f"not on a QPN route, e.g. {not_on[:3]}")
        if absent:
            problems.append(f"rank {rid}: {len(absent)} of {len(needed)} checkpoint "
                            f"module(s) {listed} not in the census, e.g. {absent[:3]}")
    return problems


def gate_qpn_routes(census: Census, regions: set[str], known: frozenset[str] | None,
                    quantized_layers: dict | None = None,
                    checkpoint_modules: dict | None = None) -> GateResult:
    """``quantized_layers``: ModelOpt's map; ``checkpoint_modules``: the modules a
    compressed-tensors, AWQ or GPTQ checkpoint declares (``declared_modules``). Either makes the
    gate require each listed module on a QPN route on every rank (``_coverage_problems``)."""
    census = _summary(census)
    total, on_qpn = census.modules_total, census.modules_on_qpn
    by_region = dict(census.modules_by_region)
    route_counts = census.route_counts
    foreign = sorted(set(census.non_qpn_routes)
                     | {r for r in route_counts if not is_qpn_route(r, known)})
    fallback_calls, fallbacks = census.fallback_calls, census.fallbacks
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
    # The totals above are merged over the ranks: a rank with nothing admitted, or with modules
    # off QPN, is named here so that another rank's modules cannot stand for it.
    for rank in census.ranks:
        if total and rank.modules_total == 0:
            problems.append(f"rank {rank.rank}: no quantized module admitted (the QPN config did not "
                            "serve this rank's layers: see its engine log)")
        elif rank.modules_on_qpn != rank.modules_total:
            problems.append(f"rank {rank.rank}: {rank.modules_total - rank.modules_on_qpn} of "
                            f"{rank.modules_total} module(s) not on a QPN route")
    if quantized_layers or checkpoint_modules:
        problems += _coverage_problems(census, quantized_layers, checkpoint_modules)
    routes = ", ".join(f"{r}={total_calls({r: c})}" for r, c in sorted(route_counts.items()))
    observed = (f"{on_qpn}/{total} modules on QPN ({_fmt(by_region)}); calls: {routes or 'none'}"
                f"; fallbacks {fallback_calls}")
    if problems:
        observed += " -- " + "; ".join(problems)
    listed = (f"quantized_layers ({len(quantized_layers)})" if quantized_layers else
              f"declared modules ({len(checkpoint_modules)})" if checkpoint_modules else "quantized_layers")
    expected = (f"every module of the checkpoint's {listed} on a QPN route on "
                "every rank, 0 fallbacks" + (f", regions {sorted(regions)}" if regions else ""))
    return GateResult(GATE_QPN_ROUTES, FAIL if problems else PASS, expected, observed)


def head_declared(declared: dict | None) -> bool:
    """Whether the checkpoint declares ``lm_head`` quantized (``declared_modules`` or ModelOpt's
    ``quantized_layers``); None (nothing known of the checkpoint) counts as declared, the strict
    reading."""
    return declared is None or any(n == "lm_head" or n.endswith(".lm_head") for n in declared)


def gate_lm_head(census: Census, known: frozenset[str] | None, declared: dict | None = None) -> GateResult:
    """``declared``: the checkpoint's declared quantized modules: a head it leaves unquantized
    (the INT4 conventions' writers do) is the engine's to serve, and no rank may report one."""
    census = _summary(census)
    heads = census.lm_head
    ranks = census.ranks
    # census.aggregate lists one head per rank file, in rank order: the n-th is the n-th rank's
    ids = [r.rank for r in ranks] + [f"#{i}" for i in range(len(ranks), len(heads))]
    if not head_declared(declared):
        expected = "no QPN lm_head (the checkpoint leaves lm_head unquantized: the engine's own method)"
        served = [(rid, h) for rid, h in zip(ids, heads) if h is not None]
        return GateResult(GATE_LM_HEAD, FAIL if served else PASS, expected,
                          f"{len(served)} rank(s) report a QPN lm_head" + (
                              f": {served[0][1].get('module')} from {served[0][1].get('source')} "
                              f"(rank(s) {[rid for rid, _ in served]})" if served else ""))
    expected = "source=checkpoint_codes, no repack fallback, QPN route family (every rank)"
    if ranks and len(heads) > len(ranks):
        return GateResult(GATE_LM_HEAD, FAIL, expected,
                          f"{len(heads)} lm_head entries for {len(ranks)} rank(s): the census summary is "
                          "inconsistent (re-read it with census.aggregate)")
    if not heads or any(h is None for h in heads) or len(heads) < len(ranks):
        without = [rid for rid, h in zip(ids, heads) if h is None] + [r.rank for r in ranks[len(heads):]]
        return GateResult(GATE_LM_HEAD, FAIL, expected,
                          f"no lm_head entry in the census of {len(without) or 1} rank(s)"
                          + (f" {without}" if without else "")
                          + ": the head was not loaded through a QPN method")
    bad = [rid for rid, h in zip(ids, heads)
           if h.get("source") != "checkpoint_codes" or h.get("repack_fallback") is not False
           or not is_qpn_route(str(h.get("route_family", "")), known)]
    seen = sorted({(str(h.get("source")), str(h.get("route_family")),
                    str(h.get("repack_fallback"))) for h in heads})
    observed = "; ".join(f"source={s} route_family={f} repack_fallback={r}" for s, f, r in seen)
    if bad:
        observed += f" -- rank(s) {bad} not served from the checkpoint's codes on a QPN route"
    return GateResult(GATE_LM_HEAD, FAIL if bad else PASS, expected,
                      f"{len(heads)} rank(s): {observed}")


def kv_observed(census: Census) -> tuple[list[tuple[object, str]], str]:
    """([(rank, its resolved KV cache dtype)], the text the gate prints for them). census.aggregate
    lists ``kv_resolved`` one record per rank file, in rank order, so the n-th record is the n-th
    rank's; a record without a rank, or a rank without a record ("not recorded"), is listed too."""
    summary = _summary(census)
    records = list(summary.kv_resolved)
    ids = [r.rank for r in summary.ranks]
    per_rank = []
    for i in range(max(len(ids), len(records))):
        rid = ids[i] if i < len(ids) else f"#{i} (no rank summary)"
        rec = records[i] if i < len(records) else None
        value = rec.get("resolved") if isinstance(rec, dict) else rec
        per_rank.append((rid, "not recorded" if value is None else str(value)))
    return per_rank, "; ".join(f"rank {rid}: {v}" for rid, v in per_rank) or "not recorded"


def gate_kv(expect_applies: bool, expected: tuple[str, ...] | None, why_not: str,
            census: Census) -> GateResult:
    per_rank, observed = kv_observed(census)
    if not expect_applies:
        return GateResult(GATE_KV, NA, why_not, observed)
    want = " or ".join(expected)
    wrong = [rid for rid, v in per_rank if v not in expected]
    if not per_rank:
        observed += " -- no rank recorded its KV cache dtype"
    elif wrong:
        observed += (f" -- rank(s) {wrong} not on {want}: every rank's KV cache must be {want} (an "
                     "explicit --kv-cache-dtype wins over the SM70 FP16 policy: drop it)")
    return GateResult(GATE_KV, FAIL if wrong or not per_rank else PASS, want + " (every rank)", observed)


def _route_total(routes: dict, name: str, mode: str | None = None) -> int:
    slot = routes.get(name) or {}
    if isinstance(slot, int):
        return slot if mode in (None, "eager") else 0
    if mode is None:
        return int(slot.get("eager", 0)) + int(slot.get("graph", 0))
    return int(slot.get(mode, 0))


def gate_decode_attention(census: Census, k: int, env: dict | None = None) -> GateResult:
    """XQA for decode and MTP verification wherever 1Cat's own conditions send them there, per
    rank; prints why where they do not (attention_routes.xqa_verdicts)."""
    from qpn.fork_patches.route_census import attention_routes as ar

    expected = ("decode on XQA (0 scalar) where the engine's conditions hold at every context "
                "length; MTP verification on XQA in captured graphs where max_model_len reaches "
                "the engine's threshold")
    ranks = _summary(census).ranks
    if not ranks:
        return GateResult(GATE_DECODE_ATTENTION, FAIL, expected, "no census written by any rank")
    problems, notes, counts = [], [], []
    any_required = False
    for rank in ranks:
        rid = rank.rank
        routes = rank.attention_routes
        groups = rank.attention_layers
        serving = rank.serving or {}
        if not routes:
            problems.append(f"rank {rid}: no attention route recorded (the _record_route hook is "
                            "not active, or the engine is not on FLASH_ATTN_V100)")
            continue
        if not groups:
            problems.append(f"rank {rid}: the census has no attention layers")
            continue
        d_x, d_s = _route_total(routes, ar.DECODE_XQA), _route_total(routes, ar.DECODE_SCALAR)
        v_xg, v_sg = (_route_total(routes, ar.VERIFY_XQA, "graph"),
                      _route_total(routes, ar.VERIFY_SCALAR, "graph"))
        v_xe, v_se = (_route_total(routes, ar.VERIFY_XQA, "eager"),
                      _route_total(routes, ar.VERIFY_SCALAR, "eager"))
        counts.append(f"rank {rid}: decode xqa={d_x} scalar={d_s}; verify graph xqa={v_xg} "
                      f"scalar={v_sg}, eager xqa={v_xe} scalar={v_se}")
        mml = serving.get("max_model_len")
        graphs = serving.get("enforce_eager") is False
        for group in groups:
            decode, verify = ar.xqa_verdicts(group, rank.engine_version, env)
            where = f"rank {rid} {group.get('layers')} layer(s) {group.get('names', [])[:1]}"
            if decode.required:
                any_required = True
                if d_s:
                    problems.append(f"{where}: {d_s} decode call(s) on the scalar kernel although "
                                    f"{decode.why}")
                if not d_x:
                    problems.append(f"{where}: no decode call on XQA recorded ({decode.why})")
            else:
                notes.append(f"decode not required on XQA: {decode.why}")
            if k > 0:
                if (verify.context_min is not None and graphs and mml is not None
                        and int(mml) >= verify.context_min):
                    any_required = True
                    if not v_xg:
                        problems.append(f"{where}: no captured MTP verification on XQA although "
                                        f"max_model_len {mml} >= {verify.context_min} "
                                        f"({verify.why})")
                else:
                    mode = "graphs" if graphs else "eager mode"
                    notes.append(f"verification legitimately scalar here ({mode}, max_model_len "
                                 f"{mml}): {verify.why}")
                if v_se:
                    notes.append(f"{v_se} eager verification call(s) scalar, legitimately below "
                                 f"{verify.context_min} tokens of context (the engine's rule)")
    observed = "; ".join(counts) or "-"
    if problems:
        return GateResult(GATE_DECODE_ATTENTION, FAIL, expected,
                          observed + " -- " + "; ".join(problems))
    if notes:
        observed += " (" + "; ".join(sorted(set(notes))) + ")"
    if not any_required:
        return GateResult(GATE_DECODE_ATTENTION, NA, expected, observed)
    return GateResult(GATE_DECODE_ATTENTION, PASS, expected, observed)


# ---- hooks the plugin skipped (issue 11 failure policy; fork_patches/engine/plugin.py) ----------------
_EXPERTS = re.compile(r"\.experts(\.|$)")


def checkpoint_needs(quantized_layers: dict | None) -> set[str]:
    """What the checkpoint needs beyond every checkpoint's hooks: ``moe`` when the modules it
    declares quantized (``declared_modules``, either convention) include routed experts
    (``...mlp.experts...``)."""
    return {"moe"} if any(_EXPERTS.search(name) for name in (quantized_layers or {})) else set()


def gate_skipped_hooks(census: Census, declared: dict | None) -> GateResult:
    """FAIL when a hook the plugin skipped (its anchor was missing) is one this checkpoint needs
    (``declared``: the checkpoint's declared quantized modules, ``declared_modules``)."""
    skipped = _summary(census).hooks_skipped
    needs = checkpoint_needs(declared)
    expected = f"no skipped hook this checkpoint needs (it needs: {', '.join(sorted(needs)) or 'none beyond the always hooks'})"
    if not skipped:
        return GateResult(GATE_SKIPPED_HOOKS, PASS, expected, "no hook skipped")
    names = sorted({f"{s.get('hook')} (needed for {s.get('needed_for')}, engine {s.get('engine')})"
                    for s in skipped})
    needed: dict[str, set] = {}
    for s in skipped:
        if s.get("needed_for") in needs:
            needed.setdefault(str(s.get("hook")), set()).add(s.get("rank"))
    if needed:
        listed = ", ".join(f"{hook} (rank(s) {sorted(r for r in ranks if r is not None) or '?'})"
                           for hook, ranks in sorted(needed.items()))
        return GateResult(GATE_SKIPPED_HOOKS, FAIL, expected,
                          f"skipped but needed: {listed}; all skipped: {'; '.join(names)}")
    return GateResult(GATE_SKIPPED_HOOKS, PASS, expected, f"skipped, not needed here: {'; '.join(names)}")


def _fmt(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


# ---- the gate table ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GateExpectation:
    """What one gate expects on one engine; ``applies=False`` prints it as n/a with ``why_not``."""

    applies: bool = True
    expected: object = None
    why_not: str = ""


@dataclass(frozen=True)
class GateInputs:
    """Everything a gate may read, typed. ``census``: the versioned census summary (None: it did
    not validate, ``census_error`` says why, and every gate that reads it fails on that);
    ``tp``: the tensor-parallel size asked for (None: what the ranks report);
    ``quantized_layers``: ModelOpt's own map (the engine keeps a renamed copy the census pairs
    with it); ``checkpoint_modules``: a compressed-tensors, AWQ or GPTQ checkpoint's declared
    modules (paired through the census's ``checkpoint_modules``, see _coverage_problems);
    ``declared``: the modules the checkpoint's convention declares quantized
    (``declared_modules``), which say what it needs; ``env``: the server's environment (the
    engine's XQA switches and thresholds); ``qpn_claim``: the convention the registered QPN
    config claims the checkpoint as (qpn_config.claim under the server's environment; None: QPN
    does not claim it, and ``qpn_not_claimed`` says why)."""

    k: int
    warm: dict
    metrics_text: str | None
    census: CensusSummary | None
    regions: frozenset[str] = frozenset()
    tp: int | None = None
    quantized_layers: dict | None = None
    checkpoint_modules: dict | None = None
    declared: dict | None = None
    env: dict | None = None
    known_routes: frozenset[str] | None = None
    census_error: str = ""
    auto_depth: AutoDepth | None = None
    qpn_claim: str | None = None
    qpn_not_claimed: str = ""


@dataclass(frozen=True)
class Gate:
    """One boot gate: ``expect`` per engine profile name, ``check`` the verdict where it applies,
    ``observe_na`` what is still printed where it does not (default "-")."""

    name: str
    expect: dict[str, GateExpectation]
    check: Callable[[GateInputs, GateExpectation], GateResult]
    reads_census: bool = True
    observe_na: Callable[[GateInputs], str] | None = None


def _check_qpn_routes(i: GateInputs, e: GateExpectation) -> GateResult:
    result = gate_qpn_routes(i.census, set(i.regions), i.known_routes, i.quantized_layers,
                             i.checkpoint_modules)
    backend = (e.expected or {}).get("backend")
    wrong = sorted({str(r.backend) for r in i.census.ranks} - {backend})
    if backend and wrong and result.status == PASS:
        result.status = FAIL
        ranks = sorted(r.rank for r in i.census.ranks if str(r.backend) != backend)
        result.observed += f" -- backend {wrong} on rank(s) {ranks}, expected {backend}"
    return result


def _needs_from(i: GateInputs) -> dict | None:
    return i.declared if i.declared is not None else i.quantized_layers


_ALWAYS = {"cpu": GateExpectation(), "sm70": GateExpectation()}

GATES: tuple[Gate, ...] = (
    Gate(GATE_WARM, _ALWAYS, lambda i, e: gate_warm(i.warm), reads_census=False),
    # Reads the census only under K=auto (steps per drafted depth), so it does not need one.
    Gate(GATE_DEPTH, _ALWAYS, lambda i, e: gate_depth(i.k, i.metrics_text, i.auto_depth, i.census),
         reads_census=False),
    Gate(GATE_PLATFORM,
         {"cpu": GateExpectation(expected={"platform": "cpu", "backend": "reference"}),
          "sm70": GateExpectation(expected={"platform": "cuda", "backend": "cuda",
                                            "device_capability": "7.0"})},
         lambda i, e: gate_platform(e.expected, i.census, i.tp)),
    Gate(GATE_QUANT_CONFIG, _ALWAYS, lambda i, e: gate_quant_config(i.census, i.qpn_claim, i.qpn_not_claimed)),
    # On CPU the QPN routes run as the reference implementation over the packed buffers.
    Gate(GATE_QPN_ROUTES,
         {"cpu": GateExpectation(expected={"backend": "reference"}),
          "sm70": GateExpectation(expected={"backend": "cuda"})},
         _check_qpn_routes),
    Gate(GATE_LM_HEAD, _ALWAYS, lambda i, e: gate_lm_head(i.census, i.known_routes, _needs_from(i))),
    # vLLM's choice stands off SM70: reported, not required.
    Gate(GATE_KV,
         {"cpu": GateExpectation(False, None, "FP16 KV is an SM70 policy; cpu reports what resolved"),
          "sm70": GateExpectation(expected=("float16",))},
         lambda i, e: gate_kv(True, e.expected, e.why_not, i.census),
         observe_na=lambda i: kv_observed(i.census)[1]),
    # Observed through the census key "attention_routes" that the _record_route hook fills with
    # 1Cat's own route names; when XQA is required is the engine's rule
    # (qpn.fork_patches.route_census.attention_routes.xqa_verdicts), applied to the served layers.
    Gate(GATE_DECODE_ATTENTION,
         {"cpu": GateExpectation(False, None,
                                 "tensor-core decode attention exists only on the sm70 engine"),
          "sm70": GateExpectation(expected="engine XQA conditions")},
         lambda i, e: gate_decode_attention(i.census, i.k, i.env)),
    Gate(GATE_SKIPPED_HOOKS, _ALWAYS, lambda i, e: gate_skipped_hooks(i.census, _needs_from(i))),
)
GATE_ORDER = tuple(g.name for g in GATES)


def apply_gates(profile: EngineProfile, inputs: GateInputs,
              gates: tuple[Gate, ...] = GATES) -> list[GateResult]:
    """Every gate of the table, in its order, as ``profile`` expects it."""
    results = []
    for gate in gates:
        if profile.name not in gate.expect:
            raise KeyError(f"gate {gate.name} states no expectation for engine {profile.name}")
        expect = gate.expect[profile.name]
        if gate.reads_census and inputs.census is None:
            results.append(GateResult(gate.name, FAIL, expect.why_not or "a valid census summary",
                                      f"census summary unreadable: {inputs.census_error}"))
        elif not expect.applies:
            observed = gate.observe_na(inputs) if gate.observe_na else "-"
            results.append(GateResult(gate.name, NA, expect.why_not, observed))
        else:
            results.append(gate.check(inputs, expect))
    return results


def evaluate(profile: EngineProfile, k: int, warm: dict, metrics_text: str | None,
             census: Census | None, regions: set[str], *, tp: int | None = None,
             quantized_layers: dict | None = None, env: dict | None = None,
             declared: dict | None = None, checkpoint_modules: dict | None = None,
             auto_depth: AutoDepth | None = None, qpn_claim: str | None = None,
             qpn_not_claimed: str = "") -> list[GateResult]:
    """Every gate, over what the launcher gathered after the warm request (see GateInputs)."""
    try:
        summary, error = CensusSummary.from_dict(census), ""
    except CensusSchemaError as exc:
        summary, error = None, str(exc)
    inputs = GateInputs(k=k, warm=warm, metrics_text=metrics_text, census=summary,
                        regions=frozenset(regions), tp=tp, quantized_layers=quantized_layers,
                        checkpoint_modules=checkpoint_modules, declared=declared, env=env,
                        known_routes=qpn_route_names(), census_error=error,
                        auto_depth=auto_depth, qpn_claim=qpn_claim, qpn_not_claimed=qpn_not_claimed)
    return apply_gates(profile, inputs)


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
