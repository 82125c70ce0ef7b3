"""The INT8 family's numerics: its CPU reference (from the packed buffers the kernels read) and
``INT8Numerics``, the family's side of kernels/families/contract.py.
"""
from __future__ import annotations

import torch

from ... import reference
from ...atoms import geometry
from ...prepack import split_gate_up
from ...weight_format import FormatError, MoeShapeError, WeightFormat
from . import codec, layout
from .layout import PackedINT8
from .members import CHANNEL, INT8

_RECORD_DTYPE = {False: torch.int32, True: torch.int16}   # symmetric? -> one record as one integer


def decode_packed(packed: PackedINT8) -> torch.Tensor:
    """Packed INT8 -> float32 [N, K] = (code - zero) * scale, read from the packed buffers."""
    return codec.dequantize(*layout.unprepack(packed))


def linear(x: torch.Tensor, packed: PackedINT8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' semantics in float32: each weight is the FP16 operand the decoder makes,
    fp16((code - zero) * scale) (one rounding), products summed in FP32; FP16 output.
    (The row-by-row CPU batching rule of reference.py does not apply: this is not a serving path.)"""
    reference.check_x(x, packed.k)
    w = decode_packed(packed).to(torch.float16).to(torch.float32)
    return reference.finish(x.to(torch.float32) @ w.t(), bias)


def linear_f64(x: torch.Tensor, packed: PackedINT8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact float64 y (not rounded) from the exact weights (code - zero) * scale."""
    reference.check_x(x, packed.k)
    y = x.double() @ decode_packed(packed).double().t()
    return reference.finish_f64(y, bias)


class INT8Numerics:
    packed_type = PackedINT8

    def __init__(self, fmt: WeightFormat = INT8) -> None:
        self.fmt = fmt

    def _src(self, codes, scales, zero_points):
        if self.fmt.has_zero_points and zero_points is None:
            raise FormatError(f"{self.fmt.title} needs zero_points (roles {self.fmt.roles})")
        return (codes, scales, zero_points if self.fmt.has_zero_points else None)

    # a source is (codes uint8 [N, K], group_scales float16 [N, K/g] or [N, 1][, zero_points uint8, the same])
    def decode_f64(self, codes, scales, zero_points=None) -> torch.Tensor:
        return codec.dequantize_f64(*self._src(codes, scales, zero_points))

    def decode_f32(self, codes, scales, zero_points=None) -> torch.Tensor:
        """Exact in float32 (codec's docstring); the kernels' FP16 operand is its one rounding."""
        return codec.dequantize(*self._src(codes, scales, zero_points))

    def quantize(self, w: torch.Tensor, group_size: int | None = None) -> tuple:
        """``group_size``: one of the family's group sizes or members.CHANNEL (-1, per channel)."""
        return codec.quantize(w, group_size or self.fmt.group_size, symmetric=not self.fmt.has_zero_points)

    def prepack(self, codes, scales, zero_points=None, atom: str = "m8n8k4",
                rows_per_chunk: int | None = None) -> PackedINT8:
        return layout.prepack(*self._src(codes, scales, zero_points), atom=atom, rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed: PackedINT8) -> tuple:
        return layout.unprepack(packed)

    def verify_roundtrip(self, packed, codes, scales, zero_points=None,
                         rows_per_chunk: int | None = None) -> None:
        layout.verify_roundtrip(packed, *self._src(codes, scales, zero_points), rows_per_chunk=rows_per_chunk)

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        return linear(x, packed, bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        return linear_f64(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        w = decode_packed(packed)
        return w, torch.ones(packed.n, dtype=torch.float32, device=w.device)

    def packed_tensors(self, packed):
        """(codes, records, out_scale); the records as one integer per record (int32 asymmetric,
        int16 symmetric), the same bytes: the kernel tensors then say which member they are, which
        the ops record of a weight (family, not member) otherwise loses."""
        return packed.codes, packed.scales.view(_RECORD_DTYPE[packed.symmetric]), packed.out_scale

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom, group_size: int | None = None) -> PackedINT8:
        """A PackedINT8 around kernel tensors (the member from the records' dtype, packed_tensors;
        uint8 records: this numerics' member). The record span is not in the tensors' shapes alone,
        so it is matched against the records buffer's size for each of the family's group sizes and
        the per-channel span (layout.packed_group_size); pass ``group_size`` (a packed weight's
        inputs per record) to skip the search. Spans giving one size are one layout: a group as
        large as K is the per-channel record."""
        sym = not self.fmt.has_zero_points
        for member_sym, dtype in _RECORD_DTYPE.items():
            if scales.dtype == dtype:
                sym, scales = member_sym, scales.view(torch.uint8)
        probe = PackedINT8(codes, scales, chscale.reshape(1), n, k, 1, sym, atom)
        tile = geometry(atom).tile_n
        tiles = probe.n_pad // tile
        if group_size:
            spans = {group_size}
        else:
            spans = {layout.packed_group_size(k, g, atom) for g in (*self.fmt.group_sizes, CHANNEL)
                     if g == CHANNEL or k % g == 0}
        fits = sorted(g for g in spans
                      if scales.numel() == tiles * -(-probe.k_pad // g) * tile * probe.record_bytes)
        if len(fits) != 1:
            raise FormatError(f"{self.fmt.title}: a scales buffer of {scales.numel()} bytes fits record spans {fits} "
                              f"for N={n} K={k} on {atom}; pass group_size")
        probe.group_size = fits[0]
        return probe

    # ---- stacked expert tensors [E, ...] in the canonical layout (no MoE method serves INT8; these
    # keep the numerics interface whole for the tests and a future method)
    def expert_source(self, e, weight, weight_scale, weight_zero_point=None) -> tuple:
        if self.fmt.has_zero_points:
            if weight_zero_point is None:
                raise MoeShapeError(f"{self.fmt.title} experts need zero points")
            return weight[e], weight_scale[e], weight_zero_point[e]
        return weight[e], weight_scale[e]

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_zero_point, inter):
        sg, su = split_gate_up(w13_scale, inter)
        if not self.fmt.has_zero_points:
            return (wg, sg), (wu, su)
        zg, zu = split_gate_up(w13_zero_point, inter)
        return (wg, sg, zg), (wu, su, zu)

    def moe_down_source(self, w2, w2_scale, w2_zero_point=None) -> tuple:
        return (w2, w2_scale, w2_zero_point) if self.fmt.has_zero_points else (w2, w2_scale)


# The class implementing kernels/families/contract.py, as families.numerics hands it out.
NUMERICS = INT8Numerics
