"""The NVFP4 family's codec: the canonical source (ModelOpt's checkpoint layout, which vLLM's
``modelopt`` loader reads) and its exact decoders and encoder.

Source: codes uint8 [N, K/2], two e2m1 codes per byte, the element of even index in the LOW
nibble; group_scales float8_e4m3fn [N, K/16], one scale per 16 inputs; global_scale float32 (one
value, ``weight_scale_2``). value = e2m1(code) * e4m3(group scale) * global.
"""
from __future__ import annotations

import torch

from ... import codecs
from ...weight_format import E2M1_MAX, E4M3_MAX, require
from .members import GROUP_SIZE


def unpack_codes(weight_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]; code 2j is the low nibble of byte j."""
    require(weight_u8.dtype == torch.uint8, f"NVFP4 weight must be uint8, got {weight_u8.dtype}")
    require(weight_u8.dim() == 2, f"NVFP4 weight must be 2-D [N, K/2], got {tuple(weight_u8.shape)}")
    n, kh = weight_u8.shape
    out = torch.empty((n, kh * 2), dtype=torch.uint8, device=weight_u8.device)
    out[:, 0::2] = weight_u8 & 0x0F
    out[:, 1::2] = weight_u8 >> 4
    return out


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (each < 16) -> uint8 [N, K/2], even element in the low nibble."""
    require(codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}")
    require(codes.dim() == 2 and codes.shape[1] % 2 == 0,
             f"codes must be 2-D with an even number of columns, got {tuple(codes.shape)}")
    require(int(codes.max()) < 16 if codes.numel() else True, "codes must be 4-bit values (< 16)")
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _global_scale_f32(weight_scale_2) -> torch.Tensor:
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(-1)
    require(gs.numel() == 1, f"weight_scale_2 must be one float32 value, got {gs.numel()} elements")
    return gs.reshape(())


def group_scales_f32(weight_scale: torch.Tensor, weight_scale_2) -> torch.Tensor:
    """Per-group float32 scale e4m3(group) * global, rounded once to float32 (what kernels use)."""
    return codecs.decode_e4m3(weight_scale) * _global_scale_f32(weight_scale_2).to(weight_scale.device)


def check_source(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2=None) -> tuple[int, int]:
    """Validate an NVFP4 triple; returns (N, K)."""
    require(weight_u8.dtype == torch.uint8, f"NVFP4 weight must be uint8, got {weight_u8.dtype}")
    require(weight_u8.dim() == 2, f"NVFP4 weight must be [N, K/2], got {tuple(weight_u8.shape)}")
    n, k = weight_u8.shape[0], weight_u8.shape[1] * 2
    require(k % GROUP_SIZE == 0,
             f"NVFP4 needs K to be a multiple of {GROUP_SIZE} (one e4m3 scale per 16 inputs); got K={k}")
    ws = codecs.as_e4m3_bytes(weight_scale)
    require(tuple(ws.shape) == (n, k // GROUP_SIZE),
             f"NVFP4 weight_scale must be [N, K/16] = {(n, k // GROUP_SIZE)}, got {tuple(ws.shape)}")
    if weight_scale_2 is not None:
        _global_scale_f32(weight_scale_2)
    return n, k


def dequantize(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2) -> torch.Tensor:
    """NVFP4 checkpoint triple -> float32 [N, K] = e2m1 * fl32(e4m3 * global)."""
    n, k = check_source(weight_u8, weight_scale, weight_scale_2)
    vals = codecs.decode_e2m1(unpack_codes(weight_u8)).view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = group_scales_f32(weight_scale, weight_scale_2)
    return (vals * scales.unsqueeze(-1)).view(n, k)


def dequantize_f64(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2) -> torch.Tensor:
    """Exact float64 dequantization (every product of an e2m1, an e4m3 and a float32 is exact in f64)."""
    n, k = check_source(weight_u8, weight_scale, weight_scale_2)
    vals = codecs.decode_e2m1(unpack_codes(weight_u8)).double().view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = codecs.decode_e4m3(weight_scale).double() * _global_scale_f32(weight_scale_2).double()
    return (vals * scales.unsqueeze(-1)).view(n, k)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 f32).

    ModelOpt's convention: weight_scale_2 = amax / (6 * 448); per group, scale = group_amax /
    (6 * weight_scale_2), a zero scale set to 1, clamped to [2^-9, 448] and cast to e4m3 (round to
    nearest even); codes = e2m1_round(w / (e4m3(scale) * weight_scale_2)). An all-zero tensor
    (ModelOpt would divide by zero) gets weight_scale_2 = 1 / (6 * 448) and all-zero codes.
    """
    require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    require(k % GROUP_SIZE == 0, f"NVFP4 needs K to be a multiple of {GROUP_SIZE}, got K={k}")
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
    codes = codecs.round_to_e2m1_codes((groups / denom).view(n, k))
    return pack_codes(codes), scale_e4m3, gs.reshape(())
