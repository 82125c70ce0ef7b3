"""The INT4 family's codec: the canonical source and its exact decoders and encoder.

Canonical source (what a checkpoint convention hands the family; roles in members.py):
  codes         uint8   [N, K/2]  two unsigned 4-bit codes per byte, the even k in the LOW nibble
  group_scales  float16 [N, K/g]
  zero_points   uint8   [N, K/g]  values 0..15 (asymmetric member only)
The group size g is not a field of the source: it is K / group_scales.shape[1], and must be one of
``fmt.group_sizes``. value = (code - zero) * scale; the symmetric member's zero is SYM_ZERO.
"""
from __future__ import annotations

import torch

from ...weight_format import WeightFormat, require
from .members import INT4, INT4_SYM

SYM_ZERO = 8                                 # the symmetric member's zero point (uint4b8)


def member_for(zero_points) -> WeightFormat:
    """The member a source is of: asymmetric with zero points, symmetric without."""
    return INT4 if zero_points is not None else INT4_SYM


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]; code 2j is the low nibble of byte j."""
    require(codes.dtype == torch.uint8, f"INT4 codes must be uint8 [N, K/2], got {codes.dtype}")
    require(codes.dim() == 2, f"INT4 codes must be 2-D [N, K/2], got {tuple(codes.shape)}")
    out = torch.empty((codes.shape[0], codes.shape[1] * 2), dtype=torch.uint8, device=codes.device)
    out[:, 0::2] = codes & 0x0F
    out[:, 1::2] = codes >> 4
    return out


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """integer codes [N, K] (0..15, any integer dtype) -> uint8 [N, K/2], even k in the low nibble."""
    require(q.dim() == 2 and q.shape[1] % 2 == 0, f"codes must be 2-D with an even K, got {tuple(q.shape)}")
    if q.numel():
        require(int(q.min()) >= 0 and int(q.max()) <= 15, "INT4 codes must be 0..15")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def group_size_of(codes: torch.Tensor, group_scales: torch.Tensor, fmt: WeightFormat = INT4) -> int:
    """The group size a canonical source implies (K / scale columns); FormatError unless it is one
    of the format's group sizes and divides K."""
    require(group_scales.dim() == 2 and group_scales.shape[1] > 0,
             f"{fmt.title} group_scales must be 2-D [N, K/g], got {tuple(group_scales.shape)}")
    k, cols = codes.shape[1] * 2, group_scales.shape[1]
    g = k // cols
    require(g * cols == k, f"{fmt.title}: K={k} is not a whole number of groups for {cols} scale columns "
                            f"(K must be a multiple of the group size, one of {fmt.group_sizes})")
    fmt.check_k(k, g)
    return g


def check_source(codes, group_scales, zero_points=None, fmt: WeightFormat | None = None) -> tuple[int, int, int]:
    """Validate a canonical source; returns (N, K, group size)."""
    fmt = fmt or member_for(zero_points)
    require(codes.dtype == torch.uint8 and codes.dim() == 2,
             f"{fmt.title} codes must be uint8 [N, K/2], got {codes.dtype} {tuple(codes.shape)}")
    require(group_scales.dtype == torch.float16,
             f"{fmt.title} group_scales must be float16, got {group_scales.dtype} (the convention unpackers "
             "convert bf16 / fp32 scales exactly)")
    n = codes.shape[0]
    require(group_scales.shape[0] == n, f"{fmt.title} group_scales must have N={n} rows, got {tuple(group_scales.shape)}")
    g = group_size_of(codes, group_scales, fmt)
    k = codes.shape[1] * 2
    if fmt.has_zero_points:
        require(zero_points is not None, f"{fmt.title} needs zero_points uint8 [N, K/g]")
        require(zero_points.dtype == torch.uint8 and tuple(zero_points.shape) == tuple(group_scales.shape),
                 f"{fmt.title} zero_points must be uint8 {tuple(group_scales.shape)}, got "
                 f"{zero_points.dtype} {tuple(zero_points.shape)}")
        if zero_points.numel():
            require(int(zero_points.max()) <= 15, f"{fmt.title} zero points must be 0..15, found {int(zero_points.max())}")
    else:
        require(zero_points is None, f"{fmt.title} has no zero_points (its zero point is {SYM_ZERO})")
    return n, k, g


def _zeros_or_sym(zero_points, like: torch.Tensor) -> torch.Tensor:
    if zero_points is None:
        return torch.full(like.shape, SYM_ZERO, dtype=torch.uint8, device=like.device)
    return zero_points


def dequantize(codes, group_scales, zero_points=None) -> torch.Tensor:
    """Canonical source -> float32 [N, K] = (code - zero) * scale, exact (|code - zero| <= 15 times
    a float16 fits float32's significand)."""
    n, k, g = check_source(codes, group_scales, zero_points)
    q = unpack_codes(codes).to(torch.float32).view(n, k // g, g)
    z = _zeros_or_sym(zero_points, group_scales).to(torch.float32)
    return ((q - z.unsqueeze(-1)) * group_scales.to(torch.float32).unsqueeze(-1)).view(n, k)


def dequantize_f64(codes, group_scales, zero_points=None) -> torch.Tensor:
    return dequantize(codes, group_scales, zero_points).double()  # already exact


def quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> tuple:
    """float [N, K] -> canonical source (min/max per group; the scale is rounded to float16 FIRST
    and the codes computed against that float16 scale, so the stored triple dequantizes to the
    nearest grid point of the scale it actually carries).

    asymmetric: scale = (max - min) / 15, zero = round(-min / scale) clamped to 0..15;
    symmetric:  scale = amax / 8 when the most negative value sets amax, else amax / 7 (the grid is
    -8..7 around the zero point 8). A group of zeros gets scale 1 (any positive scale encodes it)."""
    fmt = INT4_SYM if symmetric else INT4
    require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    fmt.check_k(k, group_size)
    wf = w.detach().float().cpu().view(n, k // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    if symmetric:
        scale = torch.maximum(hi / 7.0, -lo / 8.0)
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # the grid must hold 0 exactly
        scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)
    sf = scale.float().unsqueeze(-1)
    if symmetric:
        zero = torch.full_like(lo, SYM_ZERO)
    else:
        zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.clamp(torch.round(wf / sf) + zero.unsqueeze(-1), 0, 15).to(torch.uint8).view(n, k)
    codes = pack_codes(q)
    if symmetric:
        return codes, scale
    return codes, scale, zero.to(torch.uint8)
