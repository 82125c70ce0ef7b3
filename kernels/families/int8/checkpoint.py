"""The INT8 family's checkpoint unpackers: GPTQ (AutoGPTQ / GPTQModel) and compressed-tensors
pack-quantized 8-bit tensors -> the canonical source (codec.py), exactly, and the g_idx rule.

Both pack four 8-bit values per int32 word, value i of a word in bits 8i .. 8i + 7 (little-endian
bytes), read from the packers' own source:
* GPTQModel (github.com/ModelCloud/GPTQModel at f4c327a, gptqmodel/nn_modules/qlinear/__init__.py,
  BaseQuantLinear.pack_block): each block of 32 input rows becomes 8 qweight rows, row r holding
  inputs 4r + i shifted by 8i; qzeros packs 4 output columns per word the same way (column 4c + j
  at 8j); its v1 export (gptqmodel/utils/model.py, convert_gptq_v2_to_v1_format_module) subtracts
  0x01010101 from every qzeros word, i.e. stores zero - 1 per byte;
* compressed-tensors (0.17.0, compressors/pack_quantized/helpers.py pack_to_int32 and base.py
  PackedQuantizationCompressor.compress): the signed 8-bit value plus 128 (its unsigned offset)
  in bits 8i of word j for input 4j + i of a row; the zero points of the group and channel
  strategies packed the same way along the OUTPUT axis (packed_dim 0), [ceil(N/4), K/g].
"""
from __future__ import annotations

import torch

from ...weight_format import ActOrderError, FormatError, WeightFormat, require  # noqa: F401  (re-exported)
from .. import integer
from .members import CHANNEL, INT8, INT8_SYM

_TITLE = INT8.title.split()[0]  # "INT8": what the shared helpers' messages call the family


def _bytes(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 4 bytes, little-endian (byte i = bits 8i .. 8i + 7), as a new axis right
    after ``dim`` (int64)."""
    return integer.word_values(words, dim, 8, _TITLE)


def _f16_scales(s: torch.Tensor, what: str) -> torch.Tensor:
    return integer.f16_scales(s, what, _TITLE)


def _group_size(group_size, k: int, fmt: WeightFormat, what: str) -> int:
    """The inputs per scale column: the checkpoint's group, or K for per channel (-1 / None)."""
    if group_size is None or int(group_size) == CHANNEL:
        return k
    g = int(group_size)
    require(g > 0, f"{what}: group size {group_size} is not an INT8 group size QPN packs "
                    f"({', '.join(map(str, fmt.group_sizes))}, or {CHANNEL} per channel)")
    fmt.check_k(k, g)
    return g


def apply_g_idx(group_scales, zero_points, g_idx, group_size: int, module: str | None = None):
    """kernels/families/integer.py apply_g_idx, named for this family."""
    return integer.apply_g_idx(group_scales, zero_points, g_idx, group_size, module, _TITLE)


def from_gptq(qweight, qzeros, scales, g_idx, group_size, sym, *, v2: bool = False, module: str | None = None):
    """GPTQ 8-bit (AutoGPTQ / GPTQModel) -> canonical: (codes, group_scales) when ``sym``, else with
    zero_points.

    qweight int32 [K/4, N] packs 4 consecutive INPUTS per word (byte i = input 4r + i); qzeros
    int32 [K/g, N/4] packs 4 output columns (byte j = column 4c + j); scales [K/g, N]; g_idx int32
    [K] or None; group_size -1 is per channel (scales [1, N]). Symmetric (uint8b128): the zero point
    is 128 and qzeros is not read, as vLLM does. Asymmetric: the GPTQ v1 format stores zero - 1 per
    byte (``v2=True``: the zero itself); a v1 byte 255 (zero 256, the wrap of zero 0, which also
    borrows from the next byte of the word) is refused. Act-order: see apply_g_idx."""
    require(qweight.dim() == 2 and scales.dim() == 2, "GPTQ qweight and scales must be 2-D")
    k, n = qweight.shape[0] * 4, qweight.shape[1]
    fmt = INT8_SYM if sym else INT8
    g = _group_size(group_size, k, fmt, f"GPTQ{' ' + module if module else ''}")
    require(tuple(scales.shape) == (k // g, n), f"GPTQ scales must be [K/g, N] = {(k // g, n)}, got {tuple(scales.shape)}")
    q = _bytes(qweight, 0).reshape(k, n)
    s = _f16_scales(scales, "GPTQ scales").t().contiguous()
    z = None
    if not sym:
        require(qzeros is not None and tuple(qzeros.shape) == (k // g, -(-n // 4)),
                 f"GPTQ qzeros must be [K/g, N/4] = {(k // g, -(-n // 4))}, got "
                 f"{None if qzeros is None else tuple(qzeros.shape)}")
        z = _bytes(qzeros, 1).reshape(k // g, -1)[:, :n] + (0 if v2 else 1)
        if z.numel() and int(z.max()) > 255:
            raise FormatError(f"GPTQ v1 zero point 256 (stored byte 255){' in ' + module if module else ''}: "
                              "the v1 packing wraps zero 0 to 255, ambiguous; convert to the v2 format")
        z = z.t().to(torch.uint8).contiguous()
    s, z = apply_g_idx(s, z, g_idx, g, module)
    codes = q.t().to(torch.uint8).contiguous()
    return (codes, s) if sym else (codes, s, z)


def from_pack_quantized(weight_packed, weight_scale, weight_zero_point, group_size, *, g_idx=None,
                        module: str | None = None):
    """compressed-tensors pack-quantized (num_bits 8, strategy group or channel) -> canonical.

    weight_packed int32 [N, K/4]: byte i of word j holds input 4j + i as the signed value + 128
    (pack_to_int32's offset), which is exactly the unsigned code; weight_scale [N, K/g] ([N, 1] per
    channel: group_size None or -1); weight_zero_point int32 [ceil(N/4), K/g] packed along N with
    the same +128 offset, or None when symmetric (then zero 128 = signed 0).
    w = (q_signed - z_signed) * s = (code - zero) * s."""
    require(weight_packed.dim() == 2 and weight_scale.dim() == 2,
             "compressed-tensors weight_packed and weight_scale must be 2-D")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 4
    fmt = INT8 if weight_zero_point is not None else INT8_SYM
    g = _group_size(group_size, k, fmt, f"compressed-tensors{' ' + module if module else ''}")
    require(tuple(weight_scale.shape) == (n, k // g),
             f"compressed-tensors weight_scale must be [N, K/g] = {(n, k // g)}, got {tuple(weight_scale.shape)}")
    q = _bytes(weight_packed, 1).reshape(n, k)
    s = _f16_scales(weight_scale, "compressed-tensors weight_scale")
    z = None
    if weight_zero_point is not None:
        require(tuple(weight_zero_point.shape) == (-(-n // 4), k // g),
                 f"compressed-tensors weight_zero_point must be [ceil(N/4), K/g] = {(-(-n // 4), k // g)}, "
                 f"got {tuple(weight_zero_point.shape)}")
        z = _bytes(weight_zero_point, 0).reshape(-1, k // g)[:n].to(torch.uint8).contiguous()
    s, z = apply_g_idx(s, z, g_idx, g, module)
    codes = q.to(torch.uint8).contiguous()
    return (codes, s) if z is None else (codes, s, z)
