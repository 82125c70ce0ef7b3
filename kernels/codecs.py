"""The minifloats the families store, bit by bit: e2m1 (4-bit) and e4m3fn (8-bit) tables, exact
decoders and the e2m1 round-to-nearest-even encoder. Number formats, not weight families: each
family's codec (kernels/families/<family>/codec.py) builds on them.

Everything here runs on tensors in torch and is exact: decoding goes through tables built from the
bit layouts (not through a lossy cast), so these functions are the reference every kernel, the
prepack and the checkpoint generator are checked against.

e2m1: bit 3 is the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa; magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6. e4m3fn: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa,
no infinities, 0x7F / 0xFF are NaN, largest finite 448.
"""
from __future__ import annotations

import torch

from .weight_format import require

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)

# Round-to-nearest-even decision points between consecutive e2m1 magnitudes; a magnitude equal
# to a point goes to the neighbour with an even mantissa bit (ModelOpt's _cast_fp4 does the same:
# ties at 0.25, 1.25, 2.5, 5 round down, ties at 0.75, 1.75, 3.5 round up).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)


def _e4m3_table() -> torch.Tensor:
    """float32 value of every e4m3fn byte, computed from the bit layout."""
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp = (b >> 3) & 0xF
        man = b & 0x7
        if exp == 0xF and man == 0x7:
            vals.append(float("nan"))
        elif exp == 0:
            vals.append(sign * (man / 8.0) * 2.0 ** -6)
        else:
            vals.append(sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float32)


_E2M1_TABLE_F32 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E4M3_TABLE_F32 = _e4m3_table()


def e2m1_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 e2m1 values indexed by code (a copy in ``dtype``)."""
    return _E2M1_TABLE_F32.to(dtype)


def e4m3_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 256 e4m3fn values indexed by byte (a copy in ``dtype``; float64 keeps them exact too)."""
    return _E4M3_TABLE_F32.to(dtype)


def as_e4m3_bytes(t: torch.Tensor) -> torch.Tensor:
    """View float8_e4m3fn (or pass uint8) as its raw bytes, without any arithmetic."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    require(t.dtype == torch.uint8,
             f"expected float8_e4m3fn or its uint8 bytes, got {t.dtype}; "
             "load the checkpoint tensor unchanged (no .to(float)) before passing it")
    return t


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes -> float32 values (exact)."""
    require(codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}")
    return _E2M1_TABLE_F32.to(codes.device)[(codes & 0x0F).long()]


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn tensor (or its uint8 bytes) -> float32 values (exact, NaN for 0x7F/0xFF)."""
    return _E4M3_TABLE_F32.to(t.device)[as_e4m3_bytes(t).long()]


# ---------------------------------------------------------------------------------- encoder
def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float tensor (already divided by its scale) -> uint8 e2m1 codes, round half to even,
    magnitudes above 6 saturate to 6; the sign bit is set for x < 0 (so -0.0 encodes as +0)."""
    xf = x.float()
    sign = (xf < 0).to(torch.uint8)
    mag = xf.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    idx = torch.searchsorted(bounds, mag.contiguous(), right=False).to(torch.uint8)
    ties_up = torch.zeros_like(idx)
    for b in _E2M1_TIES_UP:
        ties_up |= (mag == b).to(torch.uint8)
    idx = torch.clamp(idx + ties_up, max=7)
    return (sign << 3) | idx
