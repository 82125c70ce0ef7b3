"""CPU reference for the QPN routes, reading the SAME packed buffers the kernels read.

The weights are decoded from fragment order (packed codes and scales), not from the checkpoint
tensors, so a serving engine on CPU exercises the prepacked representation end to end.

Two levels:
* ``linear_nvfp4`` / ``linear_fp8``: float32 with the kernels' semantics, FP16 output. NVFP4: for
  every group of 16 inputs, the partial dot product of activations and e2m1 values is summed in
  FP32, then multiplied by the FP32 group scale fl32(e4m3 * global) and added into an FP32
  accumulator (the per-16 FP32 flush; no FP16 accumulation anywhere). FP8: FP32 dot product of
  activations and e4m3 values, times the FP32 per-tensor / per-channel scale.
* ``linear_nvfp4_f64`` / ``linear_fp8_f64``: exact float64 (every weight value is exact in f64), for
  the numerics tests; round the result to FP16 to compare with a kernel's output.
"""
from __future__ import annotations

import torch

from . import codecs, formats
from .atoms import block_maps, geometry
from .prepack import PackedFP8, PackedNVFP4, _from_blocks

_CHUNK_ELEMS = 8 * 1024 * 1024  # float32 elements of scratch per N-chunk (32 MB)


def _check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}; flatten the batch first")
    if x.shape[1] != k:
        raise ValueError(f"activations have K={x.shape[1]} but the weight expects K={k}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"activations must be fp16, bf16 or fp32, got {x.dtype}")
    return x


def decode_packed_nvfp4(packed: PackedNVFP4) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed NVFP4 -> (e2m1 values float32 [N, K], group scales float32 [N, K/16] = fl32(e4m3*global))."""
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    tiles, kblocks = packed.n_pad // tile, packed.k_pad // kbk
    _, scatter_c = block_maps(packed.atom, "nvfp4")
    raw = packed.codes.view(tiles, kblocks, tile * kbk // 2)
    table = codecs.e2m1_table().to(raw.device)
    nib = torch.empty((tiles, kblocks, tile * kbk), dtype=torch.float32, device=raw.device)
    nib[..., 0::2] = table[(raw & 0x0F).long()]
    nib[..., 1::2] = table[(raw >> 4).long()]
    vals = _from_blocks(nib.index_select(2, scatter_c.to(raw.device)), tile, kbk)[: packed.n, : packed.k]
    scales = codecs.decode_e4m3(_group_scale_bytes(packed)) * packed.global_scale.reshape(()).to(torch.float32)
    return vals, scales


def _group_scale_bytes(packed: PackedNVFP4) -> torch.Tensor:
    """The e4m3 group-scale bytes [N, K/16] of a packed NVFP4 weight, in checkpoint order."""
    g = geometry(packed.atom)
    gpb = g.k_block // formats.GROUP_SIZE
    tiles, kblocks = packed.n_pad // g.tile_n, packed.k_pad // g.k_block
    _, scatter_s = block_maps(packed.atom, "scale")
    sraw = packed.scales.view(tiles, kblocks, g.tile_n * gpb).index_select(2, scatter_s.to(packed.scales.device))
    return _from_blocks(sraw, g.tile_n, gpb)[: packed.n, : packed.k // formats.GROUP_SIZE]


def decode_packed_fp8(packed: PackedFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP8 -> (e4m3 values float32 [N, K], per-row scale float32 [N])."""
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    tiles, kblocks = packed.n_pad // tile, packed.k_pad // kbk
    _, scatter = block_maps(packed.atom, "fp8")
    raw = packed.codes.view(tiles, kblocks, tile * kbk).index_select(2, scatter.to(packed.codes.device))
    src = _from_blocks(raw, tile, kbk)[: packed.n, : packed.k]
    return codecs.decode_e4m3(src), codecs.fp8_channel_scales(packed.scale, packed.n)


def _finish(y32: torch.Tensor, bias) -> torch.Tensor:
    if bias is not None:
        y32 = y32 + bias.to(torch.float32).reshape(1, -1)
    return y32.to(torch.float16)


# On CPU, batches of up to this many rows (decode and speculative verification: sequences x
# (K+1)) are computed one row at a time. float32 matmul on CPU (MKL / oneDNN) sums in an order that
# depends on the batch shape (measured: with FP8 every row of a 2-64 row batch differs from the same
# row alone in float32, about 1% after the bf16 cast), and a speculating server must give each
# verified token the bits the server without speculation gives it alone (docs/serving.md). Larger
# batches (prefill) are the same on both servers and stay batched.
ROW_INVARIANT_MAX_M = 64


def _row_invariant(x: torch.Tensor, rows_fn):
    """``rows_fn(x)``, computed row by row for CPU batches of 2..ROW_INVARIANT_MAX_M rows."""
    m = x.shape[0]
    if x.device.type == "cpu" and 1 < m <= ROW_INVARIANT_MAX_M:
        return torch.cat([rows_fn(x[i:i + 1]) for i in range(m)])
    return rows_fn(x)


def linear_nvfp4(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T with the per-16 FP32 flush; x [M, K] fp16/bf16/fp32 -> fp16 [M, N]."""
    _check_x(x, packed.k)
    vals, scales = decode_packed_nvfp4(packed)
    k, n = packed.k, packed.n
    groups = k // formats.GROUP_SIZE

    def rows_y32(xr: torch.Tensor) -> torch.Tensor:
        m = xr.shape[0]
        xg = xr.to(torch.float32).reshape(m, groups, formats.GROUP_SIZE).transpose(0, 1)  # [G, M, 16]
        out = torch.empty((m, n), dtype=torch.float32, device=xr.device)
        nc = max(1, min(n, _CHUNK_ELEMS // max(1, groups * m)))
        for n0 in range(0, n, nc):
            n1 = min(n, n0 + nc)
            wg = vals[n0:n1].reshape(n1 - n0, groups, formats.GROUP_SIZE).permute(1, 2, 0)  # [G, 16, n]
            partial = torch.bmm(xg, wg)                                                       # [G, M, n] fp32
            partial *= scales[n0:n1].t().unsqueeze(1)                                         # flush: * scale
            out[:, n0:n1] = partial.sum(dim=0)
        return out

    return _finish(_row_invariant(x, rows_y32), bias)


def linear_fp8(x: torch.Tensor, packed: PackedFP8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (x @ e4m3^T) * scale in FP32; x [M, K] -> fp16 [M, N]."""
    _check_x(x, packed.k)
    vals, scale = decode_packed_fp8(packed)
    y32 = _row_invariant(x, lambda xr: xr.to(torch.float32) @ vals.t()) * scale.reshape(1, -1)
    return _finish(y32, bias)


def linear_nvfp4_f64(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact float64 y (not rounded): sum over k of x * e2m1 * e4m3 * global, in float64."""
    _check_x(x, packed.k)
    vals, _ = decode_packed_nvfp4(packed)
    s64 = codecs.decode_e4m3(_group_scale_bytes(packed)).double() * packed.global_scale.double().reshape(())
    w64 = (vals.double().view(packed.n, -1, formats.GROUP_SIZE) * s64.unsqueeze(-1)).view(packed.n, packed.k)
    y = x.double() @ w64.t()
    if bias is not None:
        y = y + bias.double().reshape(1, -1)
    return y


def linear_fp8_f64(x: torch.Tensor, packed: PackedFP8, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_x(x, packed.k)
    vals, scale = decode_packed_fp8(packed)
    y = (x.double() @ vals.double().t()) * scale.double().reshape(1, -1)
    if bias is not None:
        y = y + bias.double().reshape(1, -1)
    return y


def linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 reference of a packed dense weight of either family."""
    return _by_type(packed, linear_nvfp4, linear_fp8)(x, packed, bias)


def linear_f64(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The exact float64 reference of a packed dense weight of either family."""
    return _by_type(packed, linear_nvfp4_f64, linear_fp8_f64)(x, packed, bias)


def _by_type(packed, nvfp4, fp8):
    if isinstance(packed, PackedNVFP4):
        return nvfp4
    if isinstance(packed, PackedFP8):
        return fp8
    raise TypeError(f"expected PackedNVFP4 or PackedFP8, got {type(packed).__name__}")


def relative_error(y: torch.Tensor, y_ref64: torch.Tensor) -> float:
    """||y - fp16(y_ref)|| / ||fp16(y_ref)|| in float64 over the finite elements of fp16(y_ref)."""
    ref16 = y_ref64.to(torch.float16).double()
    yd = y.double()
    finite = torch.isfinite(ref16)
    num = (yd[finite] - ref16[finite]).norm()
    den = ref16[finite].norm()
    return float(num / den) if float(den) > 0 else float(num)
