"""The numeric weight formats QPN serves, one description each: NVFP4, FP8 per tensor, FP8 per
output channel. Everything that depends on a weight's format asks its ``WeightFormat`` here
instead of comparing format strings.

A description says what a checkpoint stores (code and scale dtypes, codes per byte, group size,
how the output scale applies) and which route family and kernels serve it, and it is the one
entry point to the format's numerics: ``decode_f64`` (exact), ``quantize`` (for the checkpoint
generators), ``prepack`` / ``unprepack`` / ``verify_roundtrip`` (the fragment-order buffers and
their proven inverse), ``reference_linear`` (the CPU reference over the packed bytes) and
``packed_tensors`` / ``kernel_tensors`` / ``packed_from_tensors`` (a packed weight as the three
buffers a kernel reads, and back).

A weight's *source* is the tuple of checkpoint tensors in the format's ``roles`` order:
NVFP4 (codes uint8 [N, K/2], group_scales float8_e4m3fn [N, K/16], global_scale float32, the
multiplier); FP8 (codes float8_e4m3fn [N, K], scale float32 [1] per tensor or [N] per channel).
Checkpoint conventions (fork_patches/conventions.py) map their tensor names onto these roles.

Lookup: ``weight_format(x)`` takes a format key ("nvfp4", "fp8_tensor", "fp8_channel"), a
kernel family name ("nvfp4", "fp8": the family's per-tensor member), a ModelOpt ``quant_algo``
("NVFP4", "W4A16_NVFP4", "FP8"), or a WeightFormat; ``format_of(packed)`` answers for a packed
weight; ``format_for_route(route)`` for a QPN route name.

This module imports no torch (the launcher's gates and the convention readers use it on configs
alone); the bit-level codecs live in kernels/codecs.py and are imported when a tensor is handled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ATOMS = ("m8n8k4", "m16n8k16")


class FormatError(ValueError):
    """A tensor does not have the shape or dtype its format requires."""


class UnknownFormat(FormatError):
    """A format name, quant algo or route that names no QPN weight format."""


@dataclass(frozen=True)
class WeightFormat:
    key: str               # unique name of this description
    family: str            # kernel family: packed layout, census region, route family ("nvfp4" | "fp8")
    route_prefix: str      # QPN route names of the family start with it ("qpn2" | "qpn8")
    algos: tuple[str, ...]  # ModelOpt quant_algo values that declare it
    roles: tuple[str, ...]  # the source tensors, in order
    code_dtype: str        # torch dtype name of the checkpoint codes
    codes_per_byte: int    # 2: two e2m1 codes per uint8; 1: one e4m3 byte per code
    group_size: int | None  # inputs per e4m3 group scale (None: no group scales)
    output_scale: str      # how the float32 output scale applies: "global" | "tensor" | "channel"
    title: str             # for messages: "NVFP4", "FP8 per tensor", ...

    # ------------------------------------------------------------------------- shapes
    @property
    def has_group_scales(self) -> bool:
        return self.group_size is not None

    @property
    def bytes_per_weight(self) -> float:
        """Bytes a kernel streams per weight element: codes plus group scales."""
        return 1 / self.codes_per_byte + (1 / self.group_size if self.group_size else 0.0)

    @property
    def moe_route(self) -> str:
        return self.route_prefix + "_moe"

    @property
    def method_family(self) -> str:
        """The route family's name in messages ("QPN2")."""
        return self.route_prefix.upper()

    def torch_code_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.code_dtype)

    def code_cols(self, k: int) -> int:
        """Columns of the checkpoint codes tensor for K inputs."""
        return k // self.codes_per_byte

    def group_scale_cols(self, k: int) -> int | None:
        return None if self.group_size is None else k // self.group_size

    def check_k(self, k: int) -> None:
        """Raise FormatError unless K inputs can be stored in this format."""
        if self.group_size is not None and k % self.group_size:
            raise FormatError(f"{self.title} needs K to be a multiple of {self.group_size} (one e4m3 "
                              f"scale per {self.group_size} inputs); got K={k}")

    # ----------------------------------------------------------------- kernel entry points
    def dense_entry_points(self, atom: str) -> tuple[str, ...]:
        """The dense kernels of the family on the m8n8k4 atom (one-tile, two-tile, their S7 forms
        for a grouped format, workspace reconstruction); on m16n8k16 the configured kernels are
        listed in kernels/jit.py."""
        p = self.route_prefix
        if atom == "m8n8k4":
            # a grouped format also has the S7 form of its two tiled kernels (ops.nvfp4_form)
            s7 = (f"{p}_mt1_s7_{atom}", f"{p}_mt2_s7_{atom}") if self.has_group_scales else ()
            return (f"{p}_mt1_{atom}", f"{p}_mt2_{atom}") + s7 + (f"{p}_reconstruct_ws_{atom}",)
        return (f"{p}_reconstruct_ws_{atom}",)

    def moe_entry_points(self, atom: str) -> tuple[str, ...]:
        p = self.route_prefix
        return (f"{p}_moe_gate_up_{atom}", f"{p}_moe_down_{atom}")

    # ------------------------------------------------------------------------ numerics
    # The family's torch implementations (codecs, prepack, reference), named in _IMPL.
    def decode_f64(self, *src) -> torch.Tensor:
        """Exact float64 [N, K] of a source."""
        return _impl(self.family, "decode_f64")(*src)

    def decode_f32(self, *src) -> torch.Tensor:
        """float32 [N, K] with the kernels' scale rounding."""
        return _impl(self.family, "decode_f32")(*src)

    def quantize(self, w: torch.Tensor) -> tuple:
        """float [N, K] -> a source tuple (the generators' encoder)."""
        raise NotImplementedError

    def prepack(self, *src, atom: str = "m8n8k4", rows_per_chunk: int | None = None):
        return _impl(self.family, "prepack")(*src, atom=atom, rows_per_chunk=_rows(rows_per_chunk))

    def unprepack(self, packed) -> tuple:
        """The exact inverse of ``prepack``: the source tuple back (scales as packed)."""
        return _impl(self.family, "unprepack")(packed)

    def verify_roundtrip(self, packed, *src, rows_per_chunk: int | None = None) -> None:
        """Raise prepack.PrepackMismatch naming the first differing byte unless ``packed`` gives
        ``src`` back byte for byte (a scalar NVFP4 global scale is not compared)."""
        n = _VERIFIED_ROLES[self.family]
        _impl(self.family, "verify")(packed, *src[:n], rows_per_chunk=_rows(rows_per_chunk))

    def packed_type(self) -> type:
        return _impl(self.family, "packed")

    def reference_linear(self, x: torch.Tensor, packed, bias=None) -> torch.Tensor:
        return _impl(self.family, "linear")(x, packed, bias)

    def reference_linear_f64(self, x: torch.Tensor, packed, bias=None) -> torch.Tensor:
        return _impl(self.family, "linear_f64")(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight values float32 [N, K] with group scales applied, float32 output scale per row
        [N]) from the packed bytes: y = (x @ values^T) * row_scale."""
        raise NotImplementedError

    def packed_tensors(self, packed) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The packed weight's own buffers in kernel-argument order: (codes, group scales or None,
        output scale as stored). The same tensor objects, no copies: kernels/ops.py builds a
        weight's operands from them and checks by identity that a cached launch still points
        at them."""
        raise NotImplementedError

    def kernel_tensors(self, packed) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(codes, group scales or None, float32 output scale: [1] or [N]) a kernel reads."""
        import torch

        codes, scales, out_scale = self.packed_tensors(packed)
        return codes, scales, out_scale.to(torch.float32).reshape(-1)

    def packed_from_tensors(self, codes, scales, chscale, n: int, k: int, atom: str):
        """The inverse of ``kernel_tensors``: a packed weight (views, no copy)."""
        raise NotImplementedError

    # ------------------------------------------------------------------- MoE source layout
    def expert_source(self, e: int, weight, weight_scale, weight_scale_2=None) -> tuple:
        """Source of expert ``e`` from stacked expert tensors [E, ...] (see kernels/moe.py)."""
        raise NotImplementedError

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_scale_2, inter: int) -> tuple[tuple, tuple]:
        """Stacked (gate, up) sources from vLLM's fused w13 scales (see kernels/moe.prepack_moe)."""
        raise NotImplementedError

    def moe_down_source(self, w2, w2_scale, w2_scale_2=None) -> tuple:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.key


def _rows(rows_per_chunk):
    from . import prepack

    return prepack.DEFAULT_ROWS_PER_CHUNK if rows_per_chunk is None else rows_per_chunk


# The torch functions that implement each kernel family, by "module.function" in this package.
# Resolved at every call (not bound once), so a test that patches a module function is obeyed.
_IMPL: dict[str, dict[str, str]] = {
    "nvfp4": dict(decode_f64="codecs.dequantize_nvfp4_f64", decode_f32="codecs.dequantize_nvfp4",
                  prepack="prepack.prepack_nvfp4", unprepack="prepack.unprepack_nvfp4",
                  verify="prepack.verify_nvfp4_roundtrip", packed="prepack.PackedNVFP4",
                  linear="reference.linear_nvfp4", linear_f64="reference.linear_nvfp4_f64"),
    "fp8": dict(decode_f64="codecs.dequantize_fp8_f64", decode_f32="codecs.dequantize_fp8",
                prepack="prepack.prepack_fp8", unprepack="prepack.unprepack_fp8",
                verify="prepack.verify_fp8_roundtrip", packed="prepack.PackedFP8",
                linear="reference.linear_fp8", linear_f64="reference.linear_fp8_f64"),
}
# Source roles the byte-for-byte prepack check compares (NVFP4's scalar global scale is copied).
_VERIFIED_ROLES = {"nvfp4": 2, "fp8": 2}


def _impl(family: str, what: str):
    import importlib

    module, name = _IMPL[family][what].split(".")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _expert_scalars(t, e_count: int, what: str):
    import torch

    s = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
    if s.numel() == 1:
        s = s.expand(e_count)
    if s.numel() != e_count:
        from .moe import MoeShapeError

        raise MoeShapeError(f"{what} must hold one float32 value per expert ({e_count}), got {s.numel()} values")
    return s


@dataclass(frozen=True)
class NVFP4Format(WeightFormat):
    """e2m1 codes, two per byte (even element in the low nibble), one e4m3 scale per 16 inputs
    and one float32 global multiplier: value = e2m1(code) * e4m3(group scale) * global."""

    def quantize(self, w):
        from . import codecs

        return codecs.quantize_nvfp4(w)

    def unprepack(self, packed):
        return (*super().unprepack(packed), packed.global_scale.reshape(()))

    def decode_packed(self, packed):
        import torch

        from . import reference

        vals, gscales = reference.decode_packed_nvfp4(packed)
        w = (vals.view(packed.n, -1, self.group_size) * gscales.unsqueeze(-1)).view(packed.n, packed.k)
        return w, torch.ones(packed.n, dtype=torch.float32, device=w.device)

    def packed_tensors(self, packed):
        return packed.codes, packed.scales, packed.global_scale

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom):
        from .prepack import PackedNVFP4

        return PackedNVFP4(codes, scales, chscale.reshape(1), n, k, atom)

    def expert_source(self, e, weight, weight_scale, weight_scale_2=None):
        gs = _expert_scalars(weight_scale_2, weight.shape[0], "weight_scale_2")
        return weight[e], weight_scale[e], gs[e]

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_scale_2, inter):
        import torch

        from .moe import split_gate_up

        sg, su = split_gate_up(w13_scale, inter)
        s2 = torch.as_tensor(w13_scale_2, dtype=torch.float32).reshape(wg.shape[0], -1)
        return (wg, sg, s2[:, 0]), (wu, su, s2[:, -1])

    def moe_down_source(self, w2, w2_scale, w2_scale_2=None):
        return w2, w2_scale, w2_scale_2


@dataclass(frozen=True)
class FP8Format(WeightFormat):
    """e4m3 codes, one byte each, times a float32 scale per tensor or per output channel."""

    def quantize(self, w):
        from . import codecs

        return codecs.quantize_fp8(w, per_channel=self.output_scale == "channel")

    def decode_packed(self, packed):
        from . import reference

        return reference.decode_packed_fp8(packed)

    def packed_tensors(self, packed):
        return packed.codes, None, packed.scale

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom):
        from .prepack import PackedFP8

        return PackedFP8(codes, chscale.reshape(-1), n, k, atom)

    def expert_source(self, e, weight, weight_scale, weight_scale_2=None):
        import torch

        from .moe import MoeShapeError

        e_count, n = weight.shape[0], weight.shape[1]
        ws = torch.as_tensor(weight_scale, dtype=torch.float32)
        if ws.numel() == 1:
            return weight[e], ws.reshape(())
        if ws.dim() >= 1 and ws.shape[0] == e_count:
            per = ws[e].reshape(-1)
            if per.numel() == 1:
                return weight[e], per.reshape(())
            if per.numel() == n:
                return weight[e], per
        raise MoeShapeError(f"FP8 expert weight_scale must be one value, [E={e_count}] (per tensor) or "
                            f"[E={e_count}, N={n}] (per channel); got shape {tuple(ws.shape)}")

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_scale_2, inter):
        import torch

        e_count = wg.shape[0]
        s = torch.as_tensor(w13_scale, dtype=torch.float32)
        if s.dim() >= 2 and s.shape[1] == 2 * inter:     # per channel
            sg, su = s[:, :inter].reshape(e_count, inter), s[:, inter:].reshape(e_count, inter)
        else:                                            # per tensor: one per shard, or one per expert
            s = s.reshape(e_count, -1)
            sg, su = s[:, 0], s[:, -1]
        return (wg, sg), (wu, su)

    def moe_down_source(self, w2, w2_scale, w2_scale_2=None):
        import torch

        ws = torch.as_tensor(w2_scale, dtype=torch.float32)
        return w2, (ws.reshape(w2.shape[0], -1) if ws.dim() >= 2 and ws.shape[1] != 1 else ws.reshape(-1))


NVFP4 = NVFP4Format(
    key="nvfp4", family="nvfp4", route_prefix="qpn2", algos=("NVFP4", "W4A16_NVFP4"),
    roles=("codes", "group_scales", "global_scale"), code_dtype="uint8", codes_per_byte=2,
    group_size=GROUP_SIZE, output_scale="global", title="NVFP4")
FP8_TENSOR = FP8Format(
    key="fp8_tensor", family="fp8", route_prefix="qpn8", algos=("FP8",),
    roles=("codes", "scale"), code_dtype="float8_e4m3fn", codes_per_byte=1,
    group_size=None, output_scale="tensor", title="FP8 per tensor")
# Not declared by any ModelOpt algo QPN serves (ModelOpt's per-channel FP8 is per-token dynamic in
# its activations); compressed-tensors declares it with weights strategy "channel".
FP8_CHANNEL = FP8Format(
    key="fp8_channel", family="fp8", route_prefix="qpn8", algos=(),
    roles=("codes", "scale"), code_dtype="float8_e4m3fn", codes_per_byte=1,
    group_size=None, output_scale="channel", title="FP8 per channel")

WEIGHT_FORMATS: tuple[WeightFormat, ...] = (NVFP4, FP8_TENSOR, FP8_CHANNEL)
# One member per kernel family: the formats that differ only in how the output scale is stored
# share the family's packed layout, routes and kernels.
FAMILIES: dict[str, WeightFormat] = {"nvfp4": NVFP4, "fp8": FP8_TENSOR}
MODELOPT_ALGOS: dict[str, WeightFormat] = {a: f for f in WEIGHT_FORMATS for a in f.algos}


def _names() -> str:
    return ", ".join([f.key for f in WEIGHT_FORMATS] + sorted(FAMILIES) + sorted(MODELOPT_ALGOS))


def find_format(name_or_algo: Any) -> WeightFormat | None:
    """The WeightFormat a key, family name or ModelOpt algo (any case) names; None if none."""
    if isinstance(name_or_algo, WeightFormat):
        return name_or_algo
    s = str(name_or_algo)
    for f in WEIGHT_FORMATS:
        if s.lower() == f.key:
            return f
    return FAMILIES.get(s.lower()) or MODELOPT_ALGOS.get(s.upper())


def weight_format(name_or_algo: Any, fp8_scale: str | None = None) -> WeightFormat:
    """The WeightFormat named; ``fp8_scale`` ("tensor" | "channel") picks the FP8 member."""
    f = find_format(name_or_algo)
    if f is None:
        raise UnknownFormat(f"unknown weight format or quant algo {name_or_algo!r}; QPN serves {_names()}")
    if fp8_scale is not None and f.family == "fp8":
        f = {"tensor": FP8_TENSOR, "channel": FP8_CHANNEL}.get(fp8_scale)
        if f is None:
            raise UnknownFormat(f"unknown FP8 scale layout {fp8_scale!r}; expected 'tensor' or 'channel'")
    return f


def format_of(packed) -> WeightFormat:
    """The WeightFormat of a packed weight or expert stack (by its ``fmt`` and scale layout)."""
    f = weight_format(packed.fmt)
    if f.family == "fp8" and getattr(packed, "per_channel", False):
        return FP8_CHANNEL
    return f


def format_for_route(route: str) -> WeightFormat:
    """The family member (``FAMILIES``) whose routes include ``route`` (by its prefix)."""
    for f in FAMILIES.values():
        if route == f.route_prefix or route.startswith(f.route_prefix + "_"):
            return f
    raise UnknownFormat(f"route {route!r} belongs to no QPN format (route prefixes: "
                        f"{', '.join(f.route_prefix for f in FAMILIES.values())})")

