"""Bit-level codecs of the NVFP4 and FP8-e4m3 weight formats (the torch half of kernels/formats.py).

The format descriptions (qpn.kernels.formats: one object per format, what the rest of the code
asks) call these; ``formats.<name>`` forwards to this module, so older imports keep working.
Everything here runs on CPU tensors in torch and is exact: decoding goes through tables built
from the bit layouts (not through a lossy cast), so these functions are the reference every
kernel, the prepack and the checkpoint generator are checked against.

Layouts follow the ModelOpt checkpoints that vLLM's ``modelopt`` loader reads:

* NVFP4: ``weight`` uint8 [N, K/2], two e2m1 codes per byte, the element of even index in the
  LOW nibble; ``weight_scale`` float8_e4m3fn [N, K/16], one scale per 16 inputs;
  ``weight_scale_2`` float32 global scale. value = e2m1(code) * e4m3(group scale) * global.
* FP8: ``weight`` float8_e4m3fn [N, K]; ``weight_scale`` float32, per tensor (one element) or
  per output channel ([N] or [N, 1]). value = e4m3(byte) * scale.

e2m1: bit 3 is the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa; magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6. e4m3fn: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa,
no infinities, 0x7F / 0xFF are NaN, largest finite 448.
"""
from __future__ import annotations

import torch

from .formats import E2M1_MAX, E4M3_MAX, GROUP_SIZE, FormatError

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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise FormatError(msg)


def as_e4m3_bytes(t: torch.Tensor) -> torch.Tensor:
    """View float8_e4m3fn (or pass uint8) as its raw bytes, without any arithmetic."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    _require(t.dtype == torch.uint8,
             f"expected float8_e4m3fn or its uint8 bytes, got {t.dtype}; "
             "load the checkpoint tensor unchanged (no .to(float)) before passing it")
    return t


# ---------------------------------------------------------------------------------- e2m1 codes
def unpack_nvfp4_codes(weight_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]; code 2j is the low nibble of byte j."""
    _require(weight_u8.dtype == torch.uint8, f"NVFP4 weight must be uint8, got {weight_u8.dtype}")
    _require(weight_u8.dim() == 2, f"NVFP4 weight must be 2-D [N, K/2], got {tuple(weight_u8.shape)}")
    n, kh = weight_u8.shape
    out = torch.empty((n, kh * 2), dtype=torch.uint8, device=weight_u8.device)
    out[:, 0::2] = weight_u8 & 0x0F
    out[:, 1::2] = weight_u8 >> 4
    return out


def pack_nvfp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (each < 16) -> uint8 [N, K/2], even element in the low nibble."""
    _require(codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}")
    _require(codes.dim() == 2 and codes.shape[1] % 2 == 0,
             f"codes must be 2-D with an even number of columns, got {tuple(codes.shape)}")
    _require(int(codes.max()) < 16 if codes.numel() else True, "codes must be 4-bit values (< 16)")
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes -> float32 values (exact)."""
    _require(codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}")
    return _E2M1_TABLE_F32.to(codes.device)[(codes & 0x0F).long()]


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn tensor (or its uint8 bytes) -> float32 values (exact, NaN for 0x7F/0xFF)."""
    return _E4M3_TABLE_F32.to(t.device)[as_e4m3_bytes(t).long()]


def _global_scale_f32(weight_scale_2) -> torch.Tensor:
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(-1)
    _require(gs.numel() == 1, f"weight_scale_2 must be one float32 value, got {gs.numel()} elements")
    return gs.reshape(())


def nvfp4_group_scales_f32(weight_scale: torch.Tensor, weight_scale_2) -> torch.Tensor:
    """Per-group float32 scale e4m3(group) * global, rounded once to float32 (what kernels use)."""
    return decode_e4m3(weight_scale) * _global_scale_f32(weight_scale_2).to(weight_scale.device)


def check_nvfp4(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2=None) -> tuple[int, int]:
    """Validate an NVFP4 triple; returns (N, K)."""
    _require(weight_u8.dtype == torch.uint8, f"NVFP4 weight must be uint8, got {weight_u8.dtype}")
    _require(weight_u8.dim() == 2, f"NVFP4 weight must be [N, K/2], got {tuple(weight_u8.shape)}")
    n, k = weight_u8.shape[0], weight_u8.shape[1] * 2
    _require(k % GROUP_SIZE == 0,
             f"NVFP4 needs K to be a multiple of {GROUP_SIZE} (one e4m3 scale per 16 inputs); got K={k}")
    ws = as_e4m3_bytes(weight_scale)
    _require(tuple(ws.shape) == (n, k // GROUP_SIZE),
             f"NVFP4 weight_scale must be [N, K/16] = {(n, k // GROUP_SIZE)}, got {tuple(ws.shape)}")
    if weight_scale_2 is not None:
        _global_scale_f32(weight_scale_2)
    return n, k


def dequantize_nvfp4(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2) -> torch.Tensor:
    """NVFP4 checkpoint triple -> float32 [N, K] = e2m1 * fl32(e4m3 * global)."""
    n, k = check_nvfp4(weight_u8, weight_scale, weight_scale_2)
    vals = decode_e2m1(unpack_nvfp4_codes(weight_u8)).view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = nvfp4_group_scales_f32(weight_scale, weight_scale_2)
    return (vals * scales.unsqueeze(-1)).view(n, k)


def dequantize_nvfp4_f64(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2) -> torch.Tensor:
    """Exact float64 dequantization (every product of an e2m1, an e4m3 and a float32 is exact in f64)."""
    n, k = check_nvfp4(weight_u8, weight_scale, weight_scale_2)
    vals = decode_e2m1(unpack_nvfp4_codes(weight_u8)).double().view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = decode_e4m3(weight_scale).double() * _global_scale_f32(weight_scale_2).double()
    return (vals * scales.unsqueeze(-1)).view(n, k)


def fp8_channel_scales(weight_scale, n: int) -> torch.Tensor:
    """float32 [N] scale vector from a per-tensor ([], [1]) or per-channel ([N], [N, 1]) scale."""
    s = torch.as_tensor(weight_scale, dtype=torch.float32)
    _require(s.numel() in (1, n),
             f"FP8 weight_scale must have 1 element (per tensor) or N={n} (per channel), got shape {tuple(s.shape)}")
    return s.reshape(-1).expand(n) if s.numel() == 1 else s.reshape(n)


def dequantize_fp8(weight_e4m3: torch.Tensor, weight_scale) -> torch.Tensor:
    """FP8 checkpoint pair -> float32 [N, K] = e4m3 * scale (scale per tensor or per row)."""
    w = as_e4m3_bytes(weight_e4m3)
    _require(w.dim() == 2, f"FP8 weight must be 2-D [N, K], got {tuple(w.shape)}")
    s = fp8_channel_scales(weight_scale, w.shape[0]).to(w.device)
    return decode_e4m3(w) * s.unsqueeze(1)


def dequantize_fp8_f64(weight_e4m3: torch.Tensor, weight_scale) -> torch.Tensor:
    w = as_e4m3_bytes(weight_e4m3)
    s = fp8_channel_scales(weight_scale, w.shape[0]).to(w.device).double()
    return decode_e4m3(w).double() * s.unsqueeze(1)


# ---------------------------------------------------------------------------------- encoders
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


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 f32).

    ModelOpt's convention: weight_scale_2 = amax / (6 * 448); per group, scale = group_amax /
    (6 * weight_scale_2), a zero scale set to 1, clamped to [2^-9, 448] and cast to e4m3 (round to
    nearest even); codes = e2m1_round(w / (e4m3(scale) * weight_scale_2)). An all-zero tensor
    (ModelOpt would divide by zero) gets weight_scale_2 = 1 / (6 * 448) and all-zero codes.
    """
    _require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    _require(k % GROUP_SIZE == 0, f"NVFP4 needs K to be a multiple of {GROUP_SIZE}, got K={k}")
    wf = w.detach().float().cpu()
    amax = wf.abs().max() if wf.numel() else torch.tensor(0.0)
    gs = (amax / (E2M1_MAX * E4M3_MAX)).float()
    if float(gs) == 0.0:
        gs = torch.tensor(1.0 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
    groups = wf.view(n, k // GROUP_SIZE, GROUP_SIZE)
    block_scale = groups.abs().amax(dim=-1) / (E2M1_MAX * gs)
    block_scale[block_scale == 0] = 1.0
    scale_e4m3 = block_scale.clamp(min=2.0 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale_e4m3.float() * gs).unsqueeze(-1)
    codes = round_to_e2m1_codes((groups / denom).view(n, k))
    return pack_nvfp4_codes(codes), scale_e4m3, gs.reshape(())


def quantize_fp8(w: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (weight float8_e4m3fn [N, K], weight_scale float32).

    scale = amax / 448 per tensor (a 0-d tensor) or per output row ([N], when per_channel);
    the weight is w / scale cast to e4m3 (round to nearest even, saturating at 448).
    """
    _require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    wf = w.detach().float().cpu()
    if per_channel:
        amax = wf.abs().amax(dim=1)
    else:
        amax = wf.abs().max() if wf.numel() else torch.tensor(0.0)
    scale = (amax / E4M3_MAX).float()
    scale = torch.where(scale == 0, torch.full_like(scale, 1.0 / E4M3_MAX), scale)
    div = scale.unsqueeze(1) if per_channel else scale
    q = (wf / div).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(-1) if per_channel else scale.reshape(())
