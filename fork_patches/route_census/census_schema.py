"""The route census's file format, shared by its writer (``census.py``, one file per rank) and
its readers (``census.aggregate``, the boot gates in ``qpn.scripts.launcher.boot_gates``).

One module so that writer and gates cannot drift apart: every key the writer emits and every
key a gate reads is named here, with its type, and both sides validate against it. A file of
another schema version is refused by the reader with a message naming both versions.

Version history:
  1: modules, lm_head, fallbacks, kv_cache, platform fields.
  2: adds ``tensor_parallel_size``, ``serving`` (settings the attention route depends on),
     ``attention_layers`` (what each attention layer actually uses: impl, KV dtype string the
     kernel receives, cache tensor dtype, heads, head size, window), ``attention_routes``
     (the engine's own attention route decisions, eager and graph-capture counts apart),
     ``declared`` per module (the ``quantized_layers`` names the module serves, as the engine
     names them) and ``engine_quantized_layers`` (the engine's copy of the whole map's names),
     ``lm_head.loaded`` (what the loader received for the head) and ``hooks_skipped``.
  3: every module route count carries the route's M band (``m_min``, ``m_max``: the rows per
     call the route table gives that route; ``m_max`` null: no upper bound; both null for a
     route outside the table).
  4: adds ``checkpoint_modules`` ({checkpoint module name: the engine's name for it, null when the
     engine's mapper drops it}: the modules a compressed-tensors checkpoint declares quantized,
     renamed in the engine by the model's own mapper, so the gates can pair the checkpoint's
     names with the per-module ``declared`` names the engine records). AWQ and GPTQ checkpoints
     record it too, in the same form.
  5: adds ``draft_depth_steps`` ({depth as a string: scheduling steps whose drafter drafted that
     many tokens on this rank}; K=auto only, empty at a fixed depth), counted where the worker
     applies the depth the policy decided (fork_patches/spec/auto_depth.py).
  6: adds ``quant_config`` (the name, ``get_name()``, of the quantization config that claimed the
     served checkpoint, recorded by the registered QPN config when the engine first asks it for
     a layer's method (fork_patches/quant/qpn_config.py); null: no QPN config reached this rank, so
     the engine's own config (or none) claimed the checkpoint).

Summary version history (``CensusSummary``):
  1: the summary of schema 4.
  2: adds ``draft_depth_steps`` (the lowest rank's; every rank drafts the same steps) and each
     rank summary's own ``draft_depth_steps``.
  3: each rank summary carries its ``quant_config`` (schema 6).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 6


class CensusSchemaError(ValueError):
    """A census file or summary that does not follow this schema; names the field."""


@dataclass
class RouteCount:
    """Calls through one route: ``eager`` counts real calls, ``graph`` counts CUDA-graph
    captures (a replay runs no Python, so it is not counted)."""

    eager: int = 0
    graph: int = 0


@dataclass
class ModuleRouteCount:
    """Calls of one module through one QPN route (``eager`` and ``graph`` as in RouteCount) and
    the route's M band in the route table (kernels/routes.py): it serves m_min <= M <= m_max."""

    eager: int
    graph: int
    m_min: int | None  # None: not a route of the table (the gates then fail the module)
    m_max: int | None  # None: no upper bound (or not a route of the table)


@dataclass
class ModuleRecord:
    region: str  # "nvfp4" | "fp8"
    eligible: bool
    n: int  # output rows on this rank
    k: int  # input columns on this rank
    prepack_verified: bool
    routes: dict[str, ModuleRouteCount] = field(default_factory=dict)
    # the checkpoint's quantized_layers names this module serves (fused shards: several);
    # None when the loader did not say (then no checkpoint name counts as covered by it)
    declared: list[str] | None = None


@dataclass
class LmHeadRecord:
    module: str
    region: str
    # "checkpoint_codes" only when the loader received the head's codes and scales from the
    # checkpoint for every shard and the prepacked buffer proved byte-identical to them
    source: str
    route_family: str
    repack_fallback: bool


@dataclass
class KvCacheRecord:
    checkpoint_requested: str | None
    resolved: str  # the engine config's cache dtype string (after our policy)
    policy: str


@dataclass
class AttentionLayerGroup:
    """Attention layers of one rank that share every field below (``layers`` of them)."""

    impl: str  # the attention implementation class
    kv_cache_dtype: str  # the string the implementation hands its kernels
    cache_tensor_dtype: str | None  # dtype of the bound KV-cache tensor (None before binding)
    head_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    sliding_window: int | None
    layers: int
    names: list[str] = field(default_factory=list)  # first few layer names, for messages


@dataclass
class ServingRecord:
    max_model_len: int | None
    enforce_eager: bool | None
    num_speculative_tokens: int  # 0: no speculation
    attention_backend: str | None


@dataclass
class HookSkipped:
    """A hook the plugin did not apply (failure policy: only hooks not every checkpoint needs)."""

    hook: str
    reason: str
    anchor: str | None = None
    engine: str | None = None
    engine_version: str | None = None
    needed_for: str | None = None


@dataclass
class RankCensus:
    schema: int
    rank: int
    pid: int
    engine_version: str | None
    platform: str | None
    device_capability: str | None
    backend: str | None
    updated: str
    tensor_parallel_size: int | None = None
    # the claiming quantization config's get_name() ("qpn"); None: no QPN config reached this rank
    quant_config: str | None = None
    serving: ServingRecord | None = None
    kv_cache: KvCacheRecord | None = None
    attention_layers: list[AttentionLayerGroup] = field(default_factory=list)
    attention_routes: dict[str, RouteCount] = field(default_factory=dict)
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    lm_head: LmHeadRecord | None = None
    # the config's quantized_layers names as the engine holds them (vLLM renames the
    # checkpoint's keys with the model's hf_to_vllm_mapper, keeping their order and count)
    engine_quantized_layers: list[str] | None = None
    # every convention but ModelOpt: {checkpoint module declared quantized: its engine name (None:
    # the engine's mapper drops the module)}, renamed in the engine (qpn_config.record_checkpoint_modules)
    checkpoint_modules: dict[str, str | None] | None = None
    fallbacks: list[dict] = field(default_factory=list)  # {module, reason, count}
    hooks_skipped: list[HookSkipped] = field(default_factory=list)
    # K=auto: {depth: scheduling steps drafted at that depth on this rank} (schema 5)
    draft_depth_steps: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- checking
_SCALARS = {int: (int,), str: (str,), bool: (bool,), float: (int, float)}


def _check(value: Any, typ: Any, where: str) -> None:
    """Raise CensusSchemaError unless ``value`` (parsed JSON) fits the annotation ``typ``."""
    import types
    import typing

    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(typ)
        errors = []
        for option in options:
            try:
                _check(value, option, where)
                return
            except CensusSchemaError as e:
                errors.append(str(e))
        raise CensusSchemaError("; ".join(errors))
    if typ is type(None):
        if value is not None:
            raise CensusSchemaError(f"{where}: expected null, found {value!r}")
        return
    if typ is Any:
        return
    if origin is list:
        if not isinstance(value, list):
            raise CensusSchemaError(f"{where}: expected a list, found {type(value).__name__}")
        (item,) = typing.get_args(typ) or (Any,)
        for i, v in enumerate(value):
            _check(v, item, f"{where}[{i}]")
        return
    if origin is dict or typ is dict:
        if not isinstance(value, dict):
            raise CensusSchemaError(f"{where}: expected an object, found {type(value).__name__}")
        args = typing.get_args(typ)
        if args:
            for k, v in value.items():
                _check(k, args[0], f"{where} key")
                _check(v, args[1], f"{where}[{k!r}]")
        return
    if hasattr(typ, "__dataclass_fields__"):
        if not isinstance(value, dict):
            raise CensusSchemaError(f"{where}: expected a {typ.__name__} object, found {value!r}")
        hints = typing.get_type_hints(typ)
        known = {f.name for f in fields(typ)}
        extra = sorted(set(value) - known)
        if extra:
            raise CensusSchemaError(f"{where}: unknown key(s) {extra} for {typ.__name__} "
                                    f"(schema {SCHEMA_VERSION})")
        for f in fields(typ):
            if f.name not in value:
                if _has_default(f):
                    continue
                raise CensusSchemaError(f"{where}: missing key {f.name!r} of {typ.__name__}")
            _check(value[f.name], hints[f.name], f"{where}.{f.name}")
        return
    if typ in _SCALARS:
        ok = isinstance(value, _SCALARS[typ]) and not (typ is not bool and isinstance(value, bool))
        if not ok:
            raise CensusSchemaError(f"{where}: expected {typ.__name__}, found {value!r}")
        return
    raise CensusSchemaError(f"{where}: no rule for type {typ!r}")


def _has_default(f) -> bool:
    from dataclasses import MISSING

    return f.default is not MISSING or f.default_factory is not MISSING


def validate_rank(data: dict, where: str = "census") -> dict:
    """Check one rank file's parsed JSON against the schema; returns it unchanged."""
    if not isinstance(data, dict):
        raise CensusSchemaError(f"{where}: not a JSON object")
    if data.get("schema") != SCHEMA_VERSION:
        raise CensusSchemaError(f"{where}: census schema {data.get('schema')!r}, this reader knows "
                                f"{SCHEMA_VERSION} (the census writer and the gates come from "
                                "different volta-qpn versions; reinstall one checkout)")
    _check(data, RankCensus, where)
    return data


def to_json_dict(record: Any) -> dict:
    """A dataclass record as plain JSON data (nested records included)."""
    return asdict(record)


# ----------------------------------------------------------------------- the summary the gates read
# census.aggregate()'s result, typed: the boot gates read a CensusSummary and nothing else. Each
# rank file was validated against RankCensus when it was read, so the nested records a rank
# summary carries (serving, kv_cache, attention layers and routes) stay plain JSON objects here.
SUMMARY_VERSION = 3


@dataclass
class RankSummary:
    rank: int
    pid: int | None = None
    engine_version: str | None = None
    platform: str | None = None
    device_capability: str | None = None
    backend: str | None = None
    updated: str | None = None
    tensor_parallel_size: int | None = None
    quant_config: str | None = None
    serving: dict | None = None
    kv_cache: dict | None = None
    attention_layers: list[dict] = field(default_factory=list)
    attention_routes: dict = field(default_factory=dict)
    hooks_skipped: list[dict] = field(default_factory=list)
    declared_on_qpn: list[str] = field(default_factory=list)  # quantized_layers names served on QPN
    declared_off_qpn: list[str] = field(default_factory=list)  # ... and those that are not
    modules_total: int = 0
    modules_on_qpn: int = 0
    engine_quantized_layers: list[str] | None = None
    checkpoint_modules: dict[str, str | None] | None = None
    draft_depth_steps: dict[str, int] = field(default_factory=dict)


@dataclass
class CensusSummary:
    summary_version: int = SUMMARY_VERSION
    ranks: list[RankSummary] = field(default_factory=list)
    modules_by_region: dict[str, int] = field(default_factory=dict)
    modules_on_qpn: int = 0
    modules_total: int = 0
    route_counts: dict[str, dict] = field(default_factory=dict)  # route -> eager, graph, m_min, m_max
    non_qpn_routes: list[str] = field(default_factory=list)
    fallback_calls: int = 0
    fallbacks: list[dict] = field(default_factory=list)  # {module, reason, count, rank}
    lm_head: list[dict | None] = field(default_factory=list)  # one per rank (None: no QPN head)
    kv_resolved: list[dict | None] = field(default_factory=list)  # each rank's KvCacheRecord
    hooks_skipped: list[dict] = field(default_factory=list)  # HookSkipped + rank
    # K=auto: {depth: scheduling steps drafted at that depth} (summary version 2)
    draft_depth_steps: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: "dict | CensusSummary | None") -> "CensusSummary":
        """The summary ``census.aggregate`` returns (or a hand-made part of one: absent keys take
        the empty census's values), checked key by key; CensusSchemaError names what is wrong."""
        if isinstance(data, CensusSummary):
            return data
        data = dict(data or {})
        version = data.setdefault("summary_version", SUMMARY_VERSION)
        if version != SUMMARY_VERSION:
            raise CensusSchemaError(f"census summary version {version!r}, the gates read "
                                    f"{SUMMARY_VERSION} (reinstall one volta-qpn checkout)")
        if isinstance(data.get("lm_head"), dict):  # one rank's head given alone
            data["lm_head"] = [data["lm_head"]]
        _check(data, cls, "census summary")
        ranks = [RankSummary(**r) for r in data.pop("ranks", [])]
        return cls(**data, ranks=ranks)


SUMMARY_KEYS = tuple(f.name for f in fields(CensusSummary))
RANK_SUMMARY_KEYS = tuple(f.name for f in fields(RankSummary))
