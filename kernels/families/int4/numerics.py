"""The INT4 family's numerics: its CPU reference (from the packed buffers the kernels read) and
``INT4Numerics``, the family's side of kernels/families/contract.py.
"""
from __future__ import annotations

import torch

from ...atoms import geometry
from ...weight_format import FormatError, WeightFormat
from .. import integer
from . import codec, layout
from .layout import PackedINT4
from .members import INT4


def linear(x: torch.Tensor, packed: PackedINT4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' semantics in float32 (integer.IntegerNumerics.reference_linear)."""
    return INT4Numerics().reference_linear(x, packed, bias)


def linear_f64(x: torch.Tensor, packed: PackedINT4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact float64 y (not rounded) from the exact weights (code - zero) * scale."""
    return INT4Numerics().reference_linear_f64(x, packed, bias)


class INT4Numerics(integer.IntegerNumerics):
    codec = codec
    layout = layout
    packed_type = PackedINT4

    def __init__(self, fmt: WeightFormat = INT4) -> None:
        super().__init__(fmt)

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom, group_size: int | None = None) -> PackedINT4:
        """A PackedINT4 around kernel tensors (the member from the records' dtype, packed_tensors;
        uint8 records: this numerics' member). The group size is not in the tensors' shapes
        alone for every K, so it is matched against the scales buffer's size for each of the
        format's group sizes; pass it to skip the search."""
        sym, scales = self.member_records(scales)
        probe = PackedINT4(codes, scales, chscale.reshape(1), n, k, 0, sym, atom)
        tiles = probe.n_pad // geometry(atom).tile_n
        fits = [g for g in ((group_size,) if group_size else self.fmt.group_sizes)
                if k % g == 0 and scales.numel() == tiles * -(-probe.k_pad // g) * geometry(atom).tile_n * probe.record_bytes]
        if len(fits) != 1:
            raise FormatError(f"{self.fmt.title}: a scales buffer of {scales.numel()} bytes fits group sizes {fits} "
                              f"for N={n} K={k} on {atom}; pass group_size")
        probe.group_size = fits[0]
        return probe


# The class implementing kernels/families/contract.py, as families.numerics hands it out.
NUMERICS = INT4Numerics
