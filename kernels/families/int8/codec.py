"""The INT8 family's codec: the canonical source and its exact decoders and encoder.

Canonical source (what a checkpoint convention hands the family; roles in members.py):
  codes         uint8   [N, K]    one unsigned 8-bit code per byte, in input order
  group_scales  float16 [N, K/g]  or [N, 1]: one scale per output channel
  zero_points   uint8   [N, K/g]  (asymmetric member only; same shape as group_scales)
The group size g is not a field of the source: it is K / group_scales.shape[1], one of
``fmt.group_sizes``; a source with ONE scale column is per channel whatever K is (members.py says
how the kernels run it). value = (code - zero) * scale; the symmetric member's zero is SYM_ZERO.

|code - zero| <= 255 (8 bits) times a float16 (11 significant bits) fits float32's 24: the
float32 decode is exact, and the kernels' FP16 operand is its one rounding, fp16(value).
"""
from __future__ import annotations

import torch

from ...weight_format import WeightFormat, require
from .members import CHANNEL, GROUP_SIZES, INT8, INT8_SYM

SYM_ZERO = 128                               # the symmetric member's zero point (uint8b128)
CODE_MAX = 255


def member_for(zero_points) -> WeightFormat:
    """The member a source is of: asymmetric with zero points, symmetric without."""
    return INT8 if zero_points is not None else INT8_SYM


def group_size_of(codes: torch.Tensor, group_scales: torch.Tensor, fmt: WeightFormat = INT8) -> int:
    """The group size a canonical source implies: K / scale columns, or CHANNEL for one column.
    FormatError unless it is one of the format's group sizes, or K is not a multiple of the
    smallest group (the route table's requirement, routes.route_for, per channel too)."""
    require(group_scales.dim() == 2 and group_scales.shape[1] > 0,
             f"{fmt.title} group_scales must be 2-D [N, K/g] or [N, 1], got {tuple(group_scales.shape)}")
    k, cols = codes.shape[1], group_scales.shape[1]
    require(k > 0 and k % min(GROUP_SIZES) == 0,
             f"{fmt.title} needs K to be a multiple of {min(GROUP_SIZES)} (the smallest group; the route "
             f"table asks it of every weight of the family), got K={k}")
    if cols == 1:
        return CHANNEL
    g = k // cols
    require(g * cols == k, f"{fmt.title}: K={k} is not a whole number of groups for {cols} scale columns "
                            f"(one column per channel, or groups of {', '.join(map(str, fmt.group_sizes))})")
    fmt.check_k(k, g)
    return g


def scale_cols(k: int, group_size: int) -> int:
    """Scale columns of a source of K inputs with ``group_size`` (CHANNEL: one)."""
    return 1 if group_size == CHANNEL else k // group_size


def check_source(codes, group_scales, zero_points=None, fmt: WeightFormat | None = None) -> tuple[int, int, int]:
    """Validate a canonical source; returns (N, K, group size or CHANNEL)."""
    fmt = fmt or member_for(zero_points)
    require(codes.dtype == torch.uint8 and codes.dim() == 2,
             f"{fmt.title} codes must be uint8 [N, K], got {codes.dtype} {tuple(codes.shape)}")
    require(group_scales.dtype == torch.float16,
             f"{fmt.title} group_scales must be float16, got {group_scales.dtype} (the convention unpackers "
             "convert bf16 / fp32 scales exactly)")
    n = codes.shape[0]
    require(group_scales.shape[0] == n, f"{fmt.title} group_scales must have N={n} rows, got {tuple(group_scales.shape)}")
    g = group_size_of(codes, group_scales, fmt)
    if fmt.has_zero_points:
        require(zero_points is not None, f"{fmt.title} needs zero_points uint8 [N, K/g]")
        require(zero_points.dtype == torch.uint8 and tuple(zero_points.shape) == tuple(group_scales.shape),
                 f"{fmt.title} zero_points must be uint8 {tuple(group_scales.shape)}, got "
                 f"{zero_points.dtype} {tuple(zero_points.shape)}")
    else:
        require(zero_points is None, f"{fmt.title} has no zero_points (its zero point is {SYM_ZERO})")
    return n, codes.shape[1], g


def _zeros_or_sym(zero_points, like: torch.Tensor) -> torch.Tensor:
    if zero_points is None:
        return torch.full(like.shape, SYM_ZERO, dtype=torch.uint8, device=like.device)
    return zero_points


def dequantize(codes, group_scales, zero_points=None) -> torch.Tensor:
    """Canonical source -> float32 [N, K] = (code - zero) * scale, exact (module docstring)."""
    n, k, g = check_source(codes, group_scales, zero_points)
    cols = scale_cols(k, g)
    q = codes.to(torch.float32).view(n, cols, k // cols)
    z = _zeros_or_sym(zero_points, group_scales).to(torch.float32)
    return ((q - z.unsqueeze(-1)) * group_scales.to(torch.float32).unsqueeze(-1)).view(n, k)


def dequantize_f64(codes, group_scales, zero_points=None) -> torch.Tensor:
    return dequantize(codes, group_scales, zero_points).double()  # already exact


def quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> tuple:
    """float [N, K] -> canonical source, groups of ``group_size`` inputs (one of GROUP_SIZES) or
    CHANNEL (one per row). Min/max per group as GPTQ's and vLLM's reference quantizers; the scale
    is rounded to float16 FIRST and the codes computed against that float16 scale, so the stored
    triple dequantizes to the nearest grid point of the scale it actually carries.

    asymmetric: scale = (max - min) / 255 with the range stretched to hold 0, zero = round(-min /
    scale) clamped to 0..255; symmetric: scale = max(max / 127, -min / 128), the tightest scale
    whose grid -128..127 around the zero point 128 holds the group (vLLM's uint8b128 quantizer;
    compressed-tensors' own divides amax by 127.5 instead, which its checkpoints then carry). A
    group of zeros gets scale 1 (any positive scale encodes it)."""
    fmt = INT8_SYM if symmetric else INT8
    require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    require(group_size == CHANNEL or group_size in GROUP_SIZES,
             f"{fmt.title} has no group size {group_size}; it stores groups of "
             f"{', '.join(map(str, GROUP_SIZES))} inputs or one scale per channel ({CHANNEL})")
    g = k if group_size == CHANNEL else group_size
    require(k > 0 and k % min(GROUP_SIZES) == 0 and k % g == 0,
             f"{fmt.title} needs K to be a multiple of {max(g, min(GROUP_SIZES))}, got K={k}")
    wf = w.detach().float().cpu().view(n, k // g, g)
    lo, hi = wf.amin(-1), wf.amax(-1)
    if symmetric:
        scale = torch.maximum(hi / 127.0, -lo / 128.0)
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # the grid must hold 0 exactly
        scale = (hi - lo) / float(CODE_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)
    sf = scale.float().unsqueeze(-1)
    if symmetric:
        zero = torch.full_like(lo, SYM_ZERO)
    else:
        zero = torch.round(-lo / scale.float()).clamp(0, CODE_MAX)
    q = torch.clamp(torch.round(wf / sf) + zero.unsqueeze(-1), 0, CODE_MAX).to(torch.uint8).view(n, k)
    if symmetric:
        return q, scale
    return q, scale, zero.to(torch.uint8)
