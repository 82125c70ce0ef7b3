"""Weights and activations that cover the whole of both formats, for every kernel test (CPU
reference, lane replays, GPU numerics, MoE).

Two kinds of weight data, each for NVFP4 and FP8:

* ``all_bytes``: every code the format has, each many times, in random positions: FP8 draws from
  all 254 finite e4m3 bytes (both signs, zeros, the 7 subnormals per sign, 448 = 0x7E / 0xFE; only
  the NaN bytes 0x7F / 0xFF are left out), NVFP4 from all 16 e2m1 codes with group scales from
  every finite e4m3 byte of one sign (0x00 .. 0x7E: zero, subnormals, and the top binade where
  ModelOpt scales of real weights sit, 0x64 .. 0x7E) plus a share of negative scale bytes (the
  decoders keep the scale's sign bit; ModelOpt never writes one, but a kernel must not mangle it);
* ``gauss`` / ``heavy``: realistic weights (Gaussian; Student-t with 3 degrees of freedom, whose
  rare large entries set the group and tensor amax as real LLM weights do) quantized with the
  checkpoint generator's own functions (nvfp4_codec.quantize / quantize_fp8, ModelOpt's
  conventions, per tensor or per channel).

Activations come with or without outlier channels (a few channels of 2000-6000, as real
activations carry): every shape is run both ways, because outliers dominate a norm-wise error and
can hide a wrong group.
"""
from __future__ import annotations

import torch

from qpn.kernels import codecs
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.fp8 import codec as fp8_codec

WEIGHT_KINDS = ("all_bytes", "gauss", "heavy")
FP8_FINITE_BYTES = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
# Group-scale bytes: every non-negative finite e4m3 byte; negative ones are mixed in separately.
NVFP4_SCALE_BYTES = torch.arange(0x00, 0x7F, dtype=torch.uint8)


def _spread(values: torch.Tensor, shape, gen: torch.Generator) -> torch.Tensor:
    """A tensor of `shape` holding every entry of `values` as evenly as the size allows (each at
    least once when numel >= len(values)), in random positions."""
    n = 1
    for s in shape:
        n *= s
    reps = -(-n // values.numel())
    flat = values.to(gen.device).repeat(reps)[:n]
    perm = torch.randperm(n, generator=gen, device=gen.device)
    return flat[perm].reshape(shape)


def _realistic(n: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    dev = gen.device
    if kind == "gauss":
        return torch.randn((n, k), generator=gen, device=dev) * 0.02
    if kind == "heavy":   # Student-t, 3 degrees of freedom: z / sqrt(chi2_3 / 3)
        z = torch.randn((n, k), generator=gen, device=dev)
        chi = (torch.randn((n, k, 3), generator=gen, device=dev) ** 2).sum(-1) / 3.0
        return z / chi.sqrt() * 0.02
    raise ValueError(f"unknown weight kind {kind!r}; expected one of {WEIGHT_KINDS}")


def nvfp4_weight(n: int, k: int, kind: str, gen: torch.Generator, negative_scales: float = 0.1):
    """(weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32 scalar),
    on the generator's device."""
    dev = gen.device
    if kind != "all_bytes":
        q, s, gs = nvfp4_codec.quantize(_realistic(n, k, kind, gen))
        return q.to(dev), s.to(dev), gs
    codes = _spread(torch.arange(16, dtype=torch.uint8), (n, k), gen)
    sc = _spread(NVFP4_SCALE_BYTES, (n, k // 16), gen)
    if negative_scales:
        neg = torch.rand((n, k // 16), generator=gen, device=dev) < negative_scales
        sc = torch.where(neg, sc | 0x80, sc)
    # a global scale that keeps every output inside FP16 even against 6000-sized outlier channels
    gs = torch.tensor(0.25 / (k ** 0.5) / 64, dtype=torch.float32)
    return nvfp4_codec.pack_codes(codes), sc.view(torch.float8_e4m3fn), gs


def fp8_weight(n: int, k: int, kind: str, gen: torch.Generator, per_channel: bool):
    """(weight float8_e4m3fn [N, K], weight_scale float32: 0-d per tensor or [N] per channel), on
    the generator's device."""
    dev = gen.device
    if kind != "all_bytes":
        q, s = fp8_codec.quantize(_realistic(n, k, kind, gen), per_channel=per_channel)
        return q.to(dev), s.to(dev)
    b = _spread(FP8_FINITE_BYTES, (n, k), gen)
    if per_channel:
        scale = (torch.rand(n, generator=gen, device=dev) + 0.5) * 0.002 / (k ** 0.5)
    else:
        scale = torch.tensor(0.003 / (k ** 0.5), device=dev)
    return b.view(torch.float8_e4m3fn), scale.float()


def activations(m: int, k: int, gen: torch.Generator, outliers: bool, lo: float = 2000.0, hi: float = 6000.0):
    """FP16 [M, K] on the generator's device; with outliers, max(1, K // 512) channels of
    magnitude lo..hi, random signs."""
    dev = gen.device
    x = torch.randn((m, k), generator=gen, device=dev)
    if outliers:
        n_out = max(1, k // 512)
        ch = torch.randperm(k, generator=gen, device=dev)[:n_out]
        x[:, ch] = (torch.rand((m, n_out), generator=gen, device=dev) * (hi - lo) + lo) * \
            torch.where(torch.rand((m, n_out), generator=gen, device=dev) < 0.5, -1.0, 1.0)
    return x.to(torch.float16)


def exact_f64(x: torch.Tensor, fmt: str, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T in float64 from the CHECKPOINT tensors, |x| @ |W|^T): the exact product and the
    magnitude sum an accumulation error is measured against."""
    w = nvfp4_codec.dequantize_f64(*weight) if fmt == "nvfp4" else fp8_codec.dequantize_f64(*weight)
    xd = x.double()
    return xd @ w.t(), xd.abs() @ w.abs().t()


def covers_every_fp8_byte(weight_e4m3: torch.Tensor) -> bool:
    return set(codecs.as_e4m3_bytes(weight_e4m3).unique().tolist()) >= set(FP8_FINITE_BYTES.tolist())
