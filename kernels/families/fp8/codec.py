"""The FP8 family's codec: the canonical source and its exact decoders and encoder.

Source: codes float8_e4m3fn [N, K]; scale float32, per tensor (one element) or per output channel
([N] or [N, 1]). value = e4m3(byte) * scale.
"""
from __future__ import annotations

import torch

from ... import codecs
from ...weight_format import E4M3_MAX, require


def channel_scales(weight_scale, n: int) -> torch.Tensor:
    """float32 [N] scale vector from a per-tensor ([], [1]) or per-channel ([N], [N, 1]) scale."""
    s = torch.as_tensor(weight_scale, dtype=torch.float32)
    require(s.numel() in (1, n),
             f"FP8 weight_scale must have 1 element (per tensor) or N={n} (per channel), got shape {tuple(s.shape)}")
    return s.reshape(-1).expand(n) if s.numel() == 1 else s.reshape(n)


def dequantize(weight_e4m3: torch.Tensor, weight_scale) -> torch.Tensor:
    """FP8 checkpoint pair -> float32 [N, K] = e4m3 * scale (scale per tensor or per row)."""
    w = codecs.as_e4m3_bytes(weight_e4m3)
    require(w.dim() == 2, f"FP8 weight must be 2-D [N, K], got {tuple(w.shape)}")
    s = channel_scales(weight_scale, w.shape[0]).to(w.device)
    return codecs.decode_e4m3(w) * s.unsqueeze(1)


def dequantize_f64(weight_e4m3: torch.Tensor, weight_scale) -> torch.Tensor:
    w = codecs.as_e4m3_bytes(weight_e4m3)
    s = channel_scales(weight_scale, w.shape[0]).to(w.device).double()
    return codecs.decode_e4m3(w).double() * s.unsqueeze(1)


def quantize(w: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (weight float8_e4m3fn [N, K], weight_scale float32).

    scale = amax / 448 per tensor (a 0-d tensor) or per output row ([N], when per_channel);
    the weight is w / scale cast to e4m3 (round to nearest even, saturating at 448).
    """
    require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
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
