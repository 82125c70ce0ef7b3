"""The INT8 family's numerics: its CPU reference (from the packed buffers the kernels read) and
``INT8Numerics``, the family's side of kernels/families/contract.py.
"""
from __future__ import annotations

import torch

from ...atoms import geometry
from ...weight_format import FormatError, WeightFormat
from .. import integer
from . import codec, layout
from .layout import PackedINT8
from .members import CHANNEL, INT8


def linear(x: torch.Tensor, packed: PackedINT8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' semantics in float32 (integer.IntegerNumerics.reference_linear)."""
    return INT8Numerics().reference_linear(x, packed, bias)


def linear_f64(x: torch.Tensor, packed: PackedINT8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact float64 y (not rounded) from the exact weights (code - zero) * scale."""
    return INT8Numerics().reference_linear_f64(x, packed, bias)


class INT8Numerics(integer.IntegerNumerics):
    codec = codec
    layout = layout
    packed_type = PackedINT8

    def __init__(self, fmt: WeightFormat = INT8) -> None:
        super().__init__(fmt)

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom, group_size: int | None = None) -> PackedINT8:
        """A PackedINT8 around kernel tensors (the member from the records' dtype, packed_tensors;
        uint8 records: this numerics' member). The record span is not in the tensors' shapes alone,
        so it is matched against the records buffer's size for each of the family's group sizes and
        the per-channel span (layout.packed_group_size); pass ``group_size`` (a packed weight's
        inputs per record) to skip the search. Spans giving one size are one layout: a group as
        large as K is the per-channel record."""
        sym, scales = self.member_records(scales)
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


# The class implementing kernels/families/contract.py, as families.numerics hands it out.
NUMERICS = INT8Numerics
