"""Route census: what every quantized module of this rank was admitted as, and which QPN route
served each of its calls. The launcher's boot gates read only this (never log text).

Each rank writes ``<QPN_CENSUS_DIR>/census_rank<R>.json`` (format and version: the typed schema
in ``census_schema.py``, which the boot gates read through as well): after weight loading, then whenever the counts changed (at most once per
second, from a background thread), and at exit. Every write goes to a temporary file in the
same folder that is then renamed over the old one, so a reader never sees a half-written file.

Each module's calls are counted per route name, beside the M band the route table gives that
route (``m_min``..``m_max`` rows per call; kernels/routes.py). Calls made while a CUDA graph is
being captured are counted under ``graph``, all others under ``eager``. A captured graph replays without running any Python, so replays are not counted:
``graph`` counts how many captures went through each route, ``eager`` counts real calls.

Besides the QPN modules the census records, per rank: the quantization config that claimed the
checkpoint (``quant_config``, set by the registered QPN config), the tensor-parallel size, the serving
settings the attention route depends on, what every attention layer actually uses (read from the
live layers the engine registered in its static forward context: the KV dtype string the
implementation hands its kernels and the dtype of the bound cache tensor), the engine's own
attention route decisions (``count_attention_route``, fed by the ``_record_route`` hook on
1Cat-vLLM), and hooks the plugin skipped.

``aggregate(census_dir)`` merges the ranks into one summary (``census_schema.CensusSummary``, versioned).
"""
from __future__ import annotations

import atexit
import datetime as _dt
import glob
import json
import os
import re
import tempfile
import threading
import time

from qpn.fork_patches.route_census.census_schema import RANK_SUMMARY_KEYS, SCHEMA_VERSION, SUMMARY_VERSION, validate_rank

SCHEMA = SCHEMA_VERSION
FLUSH_INTERVAL_S = 1.0
_FILE_RE = re.compile(r"census_rank(\d+)\.json$")


def census_dir() -> str:
    """Folder the census files go to: $QPN_CENSUS_DIR, else a folder under the temp dir."""
    return os.environ.get("QPN_CENSUS_DIR") or os.path.join(tempfile.gettempdir(), "qpn_census")


def census_path(rank: int, directory: str | None = None) -> str:
    return os.path.join(directory or census_dir(), f"census_rank{rank}.json")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _qpn_routes() -> frozenset:
    from qpn.kernels.routes import QPN_MOE_ROUTES, QPN_ROUTES

    return QPN_ROUTES | QPN_MOE_ROUTES


def _route_band(route) -> dict:
    """{"m_min", "m_max"} of a Route or route name in the route table; both None for any other
    name (a non-QPN route, which the gates report)."""
    from qpn.kernels import routes

    try:
        return routes.as_route(route).band()
    except ValueError:
        return {"m_min": None, "m_max": None}


def write_json_atomic(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".census-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _detect_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - no process group is a normal state
        pass
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _detect_platform() -> dict:
    info = {"engine_version": None, "platform": None, "device_capability": None, "backend": None}
    try:
        import vllm
        from vllm.platforms import current_platform

        info["engine_version"] = getattr(vllm, "__version__", None)
        if current_platform.is_cpu():
            info.update(platform="cpu", backend="reference")
        else:
            info["platform"] = "cuda" if current_platform.is_cuda() else str(current_platform.device_name)
            cap = current_platform.get_device_capability()
            info["device_capability"] = f"{cap.major}.{cap.minor}" if cap is not None else None
            info["backend"] = "cuda"
    except Exception:  # noqa: BLE001 - the census must be writable without an engine (tests)
        pass
    return info


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _bound_cache_tensor(layer):
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)):
        cache = cache[0] if cache else None
    if cache is None or not hasattr(cache, "dtype") or cache.numel() == 0:
        return None  # the placeholder vLLM keeps until bind_kv_cache
    return cache


def _window(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):  # (left, right) as some implementations keep it
        return None if tuple(value) == (-1, -1) else int(value[0]) + 1
    return int(value)


def attention_layer_groups(forward_context: dict) -> list[dict]:
    """The attention layers of ``forward_context`` (vLLM's ``static_forward_context``: layer
    name -> layer), grouped by everything the attention route depends on."""
    groups: dict[tuple, dict] = {}
    for name, layer in sorted(list(forward_context.items()), key=lambda kv: str(kv[0])):
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(impl, "kv_cache_dtype") or not hasattr(layer, "head_size"):
            continue  # not an attention layer (gated-delta-net and other state layers)
        cache = _bound_cache_tensor(layer)
        entry = {
            "impl": type(impl).__name__,
            "kv_cache_dtype": str(impl.kv_cache_dtype),
            "cache_tensor_dtype": _dtype_name(cache.dtype) if cache is not None else None,
            "head_size": int(layer.head_size),
            "num_heads": int(layer.num_heads),
            "num_kv_heads": int(layer.num_kv_heads),
            "sliding_window": _window(getattr(layer, "sliding_window", None)),
        }
        key = tuple(sorted(entry.items()))
        group = groups.setdefault(key, {**entry, "layers": 0, "names": []})
        group["layers"] += 1
        if len(group["names"]) < 3:
            group["names"].append(str(name))
    return list(groups.values())


def _engine_facts(vllm_config) -> dict:
    """Tensor-parallel size, serving settings and attention layers, from the engine's config."""
    if vllm_config is None:
        return {"tensor_parallel_size": None, "serving": None, "attention_layers": []}
    parallel = getattr(vllm_config, "parallel_config", None)
    model = getattr(vllm_config, "model_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    compilation = getattr(vllm_config, "compilation_config", None)
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None) if attention is not None else None
    try:
        layers = attention_layer_groups(getattr(compilation, "static_forward_context", {}) or {})
    except RuntimeError:  # the engine is still adding layers; the next flush reads them
        layers = []
    return {
        "tensor_parallel_size": int(parallel.tensor_parallel_size) if parallel is not None else None,
        "serving": {
            "max_model_len": int(model.max_model_len) if model is not None else None,
            "enforce_eager": bool(model.enforce_eager) if model is not None else None,
            "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0),
            "attention_backend": None if backend is None else str(getattr(backend, "name", backend)),
        },
        "attention_layers": layers,
    }


class Census:
    """One rank's census. Thread-safe; every method is cheap enough to call per linear call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.modules: dict[str, dict] = {}
        self._layer_names: dict[int, str] = {}
        self.fallbacks: dict[tuple[str, str], int] = {}
        self.lm_head: dict | None = None
        self.kv_cache: dict | None = None
        self.platform: dict | None = None
        self.rank: int | None = None
        self.attention_routes: dict[str, dict[str, int]] = {}
        self.hooks_skipped: dict[str, dict] = {}
        self._engine_config = None  # the engine's VllmConfig, read at snapshot time
        self.quant_config: str | None = None
        self.engine_quantized_layers: list[str] | None = None
        self.checkpoint_modules: dict[str, str | None] | None = None
        self.draft_depth_steps: dict[str, int] = {}  # K=auto: depth -> steps drafted at it
        self._dirty = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._atexit = False
        self.directory: str | None = None

    # ---------------------------------------------------------------------------- recording
    def register_module(self, layer, name: str, region: str, n: int, k: int,
                        eligible: bool = True, prepack_verified: bool = False,
                        declared: list[str] | None = None) -> str:
        """Admit a module; returns the census name (made unique if two layers share a prefix)."""
        with self._lock:
            known = self._layer_names.get(id(layer))
            if known is None:
                known, i = name, 1
                while known in self.modules:
                    i += 1
                    known = f"{name}#{i}"
                self._layer_names[id(layer)] = known
            self.modules[known] = {
                "region": region, "eligible": bool(eligible), "n": int(n), "k": int(k),
                "prepack_verified": bool(prepack_verified),
                "routes": self.modules.get(known, {}).get("routes", {}),
                "declared": sorted(declared) if declared is not None else None,
            }
            self._mark_dirty()
            return known

    def set_prepack_verified(self, name: str, verified: bool = True) -> None:
        with self._lock:
            self.modules[name]["prepack_verified"] = bool(verified)
            self._mark_dirty()

    def count(self, name: str, route, graph: bool = False, calls: int = 1) -> None:
        """One call of module ``name`` through ``route`` (a kernels.routes.Route, or a route name)."""
        key = str(route)
        with self._lock:
            routes = self.modules[name]["routes"]
            slot = routes.get(key)
            if slot is None:
                slot = routes[key] = {"eager": 0, "graph": 0, **_route_band(route)}
            slot["graph" if graph else "eager"] += calls
            self._mark_dirty()

    def fallback(self, name: str, reason: str, calls: int = 1) -> None:
        with self._lock:
            self.fallbacks[(name, reason)] = self.fallbacks.get((name, reason), 0) + calls
            self._mark_dirty()

    def set_lm_head(self, module: str, region: str, source: str, route_family: str,
                    repack_fallback: bool = False) -> None:
        with self._lock:
            if self.lm_head is not None:
                return  # the target model's head comes first; a drafter's own head is a module only
            self.lm_head = {"module": module, "region": region, "source": source,
                            "route_family": route_family, "repack_fallback": bool(repack_fallback)}
            self._mark_dirty()

    def count_attention_route(self, route: str, graph: bool = False, calls: int = 1) -> None:
        """One attention route decision of the engine (1Cat-vLLM's ``_record_route``)."""
        with self._lock:
            slot = self.attention_routes.get(route)
            if slot is None:
                slot = self.attention_routes[route] = {"eager": 0, "graph": 0}
            slot["graph" if graph else "eager"] += calls
            self._mark_dirty()

    def count_draft_depth(self, depth: int, steps: int = 1) -> None:
        """K=auto: one scheduling step whose drafter drafted ``depth`` tokens on this rank
        (fork_patches/spec/auto_depth.py, hook auto-depth-draft-depth)."""
        key = str(int(depth))
        with self._lock:
            self.draft_depth_steps[key] = self.draft_depth_steps.get(key, 0) + steps
            self._mark_dirty()

    def skip_hook(self, hook: str, reason: str, **details) -> None:
        """A hook the plugin did not apply (the gates fail if the checkpoint needs it); details:
        anchor, engine, engine_version, needed_for (census_schema.HookSkipped)."""
        with self._lock:
            self.hooks_skipped[hook] = {"hook": hook, "reason": reason, **details}
            self._mark_dirty()

    def watch_engine(self, vllm_config) -> None:
        """Keep the engine's config: each snapshot reads the tensor-parallel size, the serving
        settings and the live attention layers (static forward context) from it."""
        with self._lock:
            if self._engine_config is None:
                self._engine_config = vllm_config
                self._mark_dirty()

    def set_quant_config(self, name: str) -> None:
        """The name of the quantization config that claimed the served checkpoint (qpn_config)."""
        with self._lock:
            self.quant_config = str(name)
            self._mark_dirty()

    def set_quantized_layers(self, names) -> None:
        """The quant config's quantized_layers names as the engine holds them (in order)."""
        with self._lock:
            self.engine_quantized_layers = [str(n) for n in names]
            self._mark_dirty()

    def set_checkpoint_modules(self, names: dict) -> None:
        """{checkpoint module name: the engine's name for it (None: dropped by the mapper)} of the
        modules a compressed-tensors, AWQ or GPTQ checkpoint declares quantized
        (qpn_config.record_checkpoint_modules)."""
        with self._lock:
            self.checkpoint_modules = {str(k): (None if v is None else str(v)) for k, v in names.items()}
            self._mark_dirty()

    def set_kv_cache(self, checkpoint_requested: str | None, resolved: str, policy: str) -> None:
        with self._lock:
            self.kv_cache = {"checkpoint_requested": checkpoint_requested, "resolved": resolved,
                             "policy": policy}
            self._mark_dirty()

    # ------------------------------------------------------------------------------ writing
    def snapshot(self) -> dict:
        if self.platform is None:
            self.platform = _detect_platform()
        if self.rank is None:
            self.rank = _detect_rank()
        engine = _engine_facts(self._engine_config)
        with self._lock:
            return {
                "schema": SCHEMA,
                "rank": self.rank,
                "pid": os.getpid(),
                **self.platform,
                **engine,
                "quant_config": self.quant_config,
                "kv_cache": dict(self.kv_cache) if self.kv_cache else None,
                "attention_routes": json.loads(json.dumps(self.attention_routes)),
                "modules": json.loads(json.dumps(self.modules)),
                "lm_head": dict(self.lm_head) if self.lm_head else None,
                "engine_quantized_layers": (list(self.engine_quantized_layers)
                                            if self.engine_quantized_layers is not None else None),
                "checkpoint_modules": (dict(self.checkpoint_modules)
                                       if self.checkpoint_modules is not None else None),
                "fallbacks": [{"module": m, "reason": r, "count": c}
                              for (m, r), c in sorted(self.fallbacks.items())],
                "hooks_skipped": [dict(v) for _, v in sorted(self.hooks_skipped.items())],
                "draft_depth_steps": dict(sorted(self.draft_depth_steps.items(),
                                                 key=lambda kv: int(kv[0]))),
                "updated": _now(),
            }

    def flush(self) -> str:
        """Write this rank's file now; returns its path."""
        with self._lock:
            self._dirty = False
        data = validate_rank(self.snapshot(), "census being written")
        path = census_path(data["rank"], self.directory)
        write_json_atomic(path, data)
        return path

    def _mark_dirty(self) -> None:  # called with the lock held
        self._dirty = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._flusher, name="qpn-census", daemon=True)
            self._thread.start()
        if not self._atexit:
            atexit.register(self._flush_at_exit)
            self._atexit = True

    def _flusher(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            if self._dirty:
                try:
                    self.flush()
                except OSError:
                    pass  # a full or vanished disk must not take the engine down; retried next tick
                except ValueError as e:  # CensusSchemaError: a writer bug; no file, gates fail
                    _report_schema_error(e)

    def _flush_at_exit(self) -> None:
        self._stop.set()
        if self.modules or self.kv_cache or self.fallbacks or self.attention_routes:
            try:
                self.flush()
            except OSError:
                pass
            except ValueError as e:
                _report_schema_error(e)


_SCHEMA_ERRORS: set[str] = set()


def _report_schema_error(error: Exception) -> None:
    """Say once per message that this rank's census cannot be written (the gates then report
    no census from this rank)."""
    import logging

    if str(error) not in _SCHEMA_ERRORS:
        _SCHEMA_ERRORS.add(str(error))
        logging.getLogger("vllm.qpn.census").error(
            "volta-qpn: this rank's census is not written, it does not follow the census schema: "
            "%s", error)


CENSUS = Census()


# ------------------------------------------------------------------------------------ reading
def read_rank_files(directory: str) -> list[dict]:
    """Every complete census file of ``directory``, by rank, each checked against the schema
    (CensusSchemaError, a ValueError, names the file and the field)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "census_rank*.json"))):
        if not _FILE_RE.search(os.path.basename(path)):
            continue
        with open(path) as f:
            data = json.load(f)
        out.append(validate_rank(data, path))
    return sorted(out, key=lambda d: d["rank"])


def module_on_qpn(name: str, mod: dict, failed: set, qpn_routes: frozenset) -> bool:
    """Admitted on QPN, prepack proven, no fallback, and every call on a QPN route."""
    return bool(mod.get("eligible") and mod.get("prepack_verified") and name not in failed
                and all(route in qpn_routes for route in mod.get("routes", {})))


def aggregate(census_dir: str) -> dict:
    """Merge the ranks' census files of ``census_dir`` into one summary (see module doc)."""
    qpn_routes = _qpn_routes()
    ranks = read_rank_files(census_dir)
    by_region: dict[str, int] = {}
    route_counts: dict[str, dict[str, int | None]] = {}
    on_qpn = total = 0
    fallbacks = []
    rank_summaries = []
    for r in ranks:
        failed = {f["module"] for f in r.get("fallbacks", [])}
        declared_on: set[str] = set()
        declared_off: set[str] = set()
        rank_total = rank_on = 0
        for name, mod in r.get("modules", {}).items():
            total += 1
            rank_total += 1
            by_region[mod["region"]] = by_region.get(mod["region"], 0) + 1
            routes = mod.get("routes", {})
            for route, c in routes.items():
                slot = route_counts.setdefault(route, {"eager": 0, "graph": 0, "m_min": c.get("m_min"),
                                                       "m_max": c.get("m_max")})
                slot["eager"] += c.get("eager", 0)
                slot["graph"] += c.get("graph", 0)
            good = module_on_qpn(name, mod, failed, qpn_routes)
            on_qpn += good
            rank_on += good
            (declared_on if good else declared_off).update(mod.get("declared") or [])
        for f in r.get("fallbacks", []):
            fallbacks.append({**f, "rank": r["rank"]})
        summary = {k: r[k] for k in RANK_SUMMARY_KEYS if r.get(k) is not None}
        summary.update(declared_on_qpn=sorted(declared_on - declared_off),
                       declared_off_qpn=sorted(declared_off), modules_total=rank_total,
                       modules_on_qpn=rank_on)
        rank_summaries.append(summary)
    return {
        "summary_version": SUMMARY_VERSION,
        "ranks": rank_summaries,
        "modules_by_region": by_region,
        "modules_on_qpn": on_qpn,
        "modules_total": total,
        "route_counts": route_counts,
        "non_qpn_routes": sorted(set(route_counts) - set(qpn_routes)),
        "fallback_calls": sum(f["count"] for f in fallbacks),
        "fallbacks": fallbacks,
        "lm_head": [r.get("lm_head") for r in ranks],
        "kv_resolved": [r.get("kv_cache") for r in ranks],
        "hooks_skipped": [{**h, "rank": r["rank"]} for r in ranks for h in r.get("hooks_skipped", [])],
        # Every rank drafts the same steps (one SchedulerOutput reaches them all): the lowest
        # rank's counts stand for the server; each rank's own are in its rank summary.
        "draft_depth_steps": dict(ranks[0].get("draft_depth_steps") or {}) if ranks else {},
    }
