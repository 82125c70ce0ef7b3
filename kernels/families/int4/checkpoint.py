"""The INT4 family's checkpoint unpackers: AutoAWQ, AutoGPTQ / GPTQModel and compressed-tensors
pack-quantized tensors -> the canonical source (codec.py), exactly, and the g_idx rule.
"""
from __future__ import annotations

import torch

from ...weight_format import ActOrderError, FormatError, WeightFormat, require  # noqa: F401  (re-exported)
from .. import integer
from .codec import pack_codes
from .members import INT4, INT4_SYM

_TITLE = INT4.title.split()[0]  # "INT4": what the shared helpers' messages call the family

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)         # AutoAWQ: nibble j of an int32 holds column 8c + AWQ_ORDER[j]


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles, standard order (nibble i = bits 4i..4i+3), as a new axis
    right after ``dim`` (int64)."""
    return integer.word_values(words, dim, 4, _TITLE)


def _f16_scales(s: torch.Tensor, what: str) -> torch.Tensor:
    return integer.f16_scales(s, what, _TITLE)


def _group_size(group_size: int, k: int, fmt: WeightFormat, what: str) -> int:
    g = int(group_size)
    require(g > 0, f"{what}: group size {group_size} (per channel) is not an INT4 group size QPN packs "
                    f"({', '.join(map(str, fmt.group_sizes))})")
    fmt.check_k(k, g)
    return g


def apply_g_idx(group_scales, zero_points, g_idx, group_size: int, module: str | None = None):
    """kernels/families/integer.py apply_g_idx, named for this family."""
    return integer.apply_g_idx(group_scales, zero_points, g_idx, group_size, module, _TITLE)


def from_awq(qweight, qzeros, scales, group_size):
    """AutoAWQ (GEMM) -> canonical (codes, group_scales, zero_points).

    qweight int32 [K, N/8] and qzeros int32 [K/g, N/8] pack 8 output columns per word in AWQ's
    order (nibble j holds column 8c + AWQ_ORDER[j]); scales float16 [K/g, N]; w = (q - z) * s."""
    require(qweight.dim() == 2 and qzeros.dim() == 2 and scales.dim() == 2,
             "AWQ qweight, qzeros and scales must be 2-D")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = _group_size(group_size, k, INT4, "AWQ")
    require(tuple(scales.shape) == (k // g, n), f"AWQ scales must be [K/g, N] = {(k // g, n)}, got {tuple(scales.shape)}")
    require(tuple(qzeros.shape) == (k // g, n // 8),
             f"AWQ qzeros must be [K/g, N/8] = {(k // g, n // 8)}, got {tuple(qzeros.shape)}")
    # nibble j holds column AWQ_ORDER[j]: column i sits at nibble AWQ_ORDER.index(i)
    col_to_nibble = torch.tensor([AWQ_ORDER.index(i) for i in range(8)], device=qweight.device)
    q = _nibbles(qweight, 1).index_select(2, col_to_nibble).reshape(k, n)
    z = _nibbles(qzeros, 1).index_select(2, col_to_nibble).reshape(k // g, n)
    s = _f16_scales(scales, "AWQ scales").t().contiguous()
    return pack_codes(q.t()), s, z.t().to(torch.uint8).contiguous()


def from_gptq(qweight, qzeros, scales, g_idx, group_size, sym, *, v2: bool = False, module: str | None = None):
    """AutoGPTQ / GPTQModel -> canonical: (codes, group_scales) when ``sym``, else with zero_points.

    qweight int32 [K/8, N] packs 8 consecutive INPUTS per word (standard order: nibble i = input
    8r + i); qzeros int32 [K/g, N/8] packs 8 output columns (standard order); scales [K/g, N];
    g_idx int32 [K] or None. Symmetric (uint4b8): the zero point is 8 and qzeros is not read, as
    vLLM does. Asymmetric: the GPTQ v1 format stores zero - 1 (``v2=True``: the zero itself);
    a v1 nibble 15 (zero 16, AutoGPTQ's wrap of zero 0) is refused. Act-order: see apply_g_idx."""
    require(qweight.dim() == 2 and scales.dim() == 2, "GPTQ qweight and scales must be 2-D")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    fmt = INT4_SYM if sym else INT4
    g = _group_size(group_size, k, fmt, f"GPTQ{' ' + module if module else ''}")
    require(tuple(scales.shape) == (k // g, n), f"GPTQ scales must be [K/g, N] = {(k // g, n)}, got {tuple(scales.shape)}")
    q = _nibbles(qweight, 0).reshape(k, n)
    s = _f16_scales(scales, "GPTQ scales").t().contiguous()
    z = None
    if not sym:
        require(qzeros is not None and tuple(qzeros.shape) == (k // g, n // 8),
                 f"GPTQ qzeros must be [K/g, N/8] = {(k // g, n // 8)}, got "
                 f"{None if qzeros is None else tuple(qzeros.shape)}")
        z = _nibbles(qzeros, 1).reshape(k // g, n) + (0 if v2 else 1)
        if z.numel() and int(z.max()) > 15:
            raise FormatError(f"GPTQ v1 zero point 16 (stored nibble 15){' in ' + module if module else ''}: "
                              "AutoGPTQ's v1 packing wraps zero 0 to 15, ambiguous; convert to the v2 format")
        z = z.t().to(torch.uint8).contiguous()
    s, z = apply_g_idx(s, z, g_idx, g, module)
    codes = pack_codes(q.t())
    return (codes, s) if sym else (codes, s, z)


def from_pack_quantized(weight_packed, weight_scale, weight_zero_point, group_size, *, g_idx=None,
                        module: str | None = None):
    """compressed-tensors pack-quantized (num_bits 4, strategy group) -> canonical.

    weight_packed int32 [N, K/8]: nibble i of word j holds input 8j + i as the signed value + 8
    (compressed_tensors' pack_to_int32 offset), which is exactly the unsigned code; weight_scale
    [N, K/g]; weight_zero_point int32 [ceil(N/8), K/g] packed along N with the same +8 offset, or
    None when symmetric (then zero 8 = signed 0). w = (q_signed - z_signed) * s = (code - zero) * s."""
    require(weight_packed.dim() == 2 and weight_scale.dim() == 2,
             "compressed-tensors weight_packed and weight_scale must be 2-D")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    fmt = INT4 if weight_zero_point is not None else INT4_SYM
    g = _group_size(group_size, k, fmt, f"compressed-tensors{' ' + module if module else ''}")
    require(tuple(weight_scale.shape) == (n, k // g),
             f"compressed-tensors weight_scale must be [N, K/g] = {(n, k // g)}, got {tuple(weight_scale.shape)}")
    q = _nibbles(weight_packed, 1).reshape(n, k)
    s = _f16_scales(weight_scale, "compressed-tensors weight_scale")
    z = None
    if weight_zero_point is not None:
        require(tuple(weight_zero_point.shape) == (-(-n // 8), k // g),
                 f"compressed-tensors weight_zero_point must be [ceil(N/8), K/g] = {(-(-n // 8), k // g)}, "
                 f"got {tuple(weight_zero_point.shape)}")
        z = _nibbles(weight_zero_point, 0).reshape(-1, k // g)[:n].to(torch.uint8).contiguous()
    s, z = apply_g_idx(s, z, g_idx, g, module)
    codes = pack_codes(q)
    return (codes, s) if z is None else (codes, s, z)
