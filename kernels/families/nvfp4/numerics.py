"""The NVFP4 family's numerics: its CPU reference, reading the packed buffers the kernels read,
and ``NVFP4Numerics``, the family's side of kernels/families/contract.py.

value = e2m1(code) * e4m3(group scale) * global. The float32 reference has the kernels'
semantics, FP16 output: for every group of 16 inputs, the partial dot product of activations and
e2m1 values is summed in FP32, then multiplied by the FP32 group scale fl32(e4m3 * global) and
added into an FP32 accumulator (the per-16 FP32 flush; no FP16 accumulation anywhere). The
float64 one is exact (every weight value is exact in float64).
"""
from __future__ import annotations

import torch

from ... import codecs, reference
from ...atoms import geometry
from ...prepack import PrepackMismatch, from_blocks, split_gate_up
from ...weight_format import MoeShapeError, WeightFormat
from . import codec, layout
from .layout import PackedNVFP4
from .members import GROUP_SIZE, NVFP4


# ------------------------------------------------------------------------------ CPU reference
def decode_packed(packed: PackedNVFP4) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed NVFP4 -> (e2m1 values float32 [N, K], group scales float32 [N, K/16] = fl32(e4m3*global))."""
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    tiles, kblocks = packed.n_pad // tile, packed.k_pad // kbk
    _, scatter_c = layout.code_maps(packed.atom)
    raw = packed.codes.view(tiles, kblocks, tile * kbk // 2)
    table = codecs.e2m1_table().to(raw.device)
    nib = torch.empty((tiles, kblocks, tile * kbk), dtype=torch.float32, device=raw.device)
    nib[..., 0::2] = table[(raw & 0x0F).long()]
    nib[..., 1::2] = table[(raw >> 4).long()]
    vals = from_blocks(nib.index_select(2, scatter_c.to(raw.device)), tile, kbk)[: packed.n, : packed.k]
    scales = codecs.decode_e4m3(group_scale_bytes(packed)) * packed.global_scale.reshape(()).to(torch.float32)
    return vals, scales


def group_scale_bytes(packed: PackedNVFP4) -> torch.Tensor:
    """The e4m3 group-scale bytes [N, K/16] of a packed NVFP4 weight, in checkpoint order."""
    g = geometry(packed.atom)
    gpb = g.k_block // GROUP_SIZE
    tiles, kblocks = packed.n_pad // g.tile_n, packed.k_pad // g.k_block
    _, scatter_s = layout.scale_maps(packed.atom)
    sraw = packed.scales.view(tiles, kblocks, g.tile_n * gpb).index_select(2, scatter_s.to(packed.scales.device))
    return from_blocks(sraw, g.tile_n, gpb)[: packed.n, : packed.k // GROUP_SIZE]


def linear(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T with the per-16 FP32 flush; x [M, K] fp16/bf16/fp32 -> fp16 [M, N]."""
    reference.check_x(x, packed.k)
    vals, scales = decode_packed(packed)
    k, n = packed.k, packed.n
    groups = k // GROUP_SIZE

    def rows_y32(xr: torch.Tensor) -> torch.Tensor:
        m = xr.shape[0]
        xg = xr.to(torch.float32).reshape(m, groups, GROUP_SIZE).transpose(0, 1)  # [G, M, 16]
        out = torch.empty((m, n), dtype=torch.float32, device=xr.device)
        nc = max(1, min(n, reference.CHUNK_ELEMS // max(1, groups * m)))
        for n0 in range(0, n, nc):
            n1 = min(n, n0 + nc)
            wg = vals[n0:n1].reshape(n1 - n0, groups, GROUP_SIZE).permute(1, 2, 0)  # [G, 16, n]
            partial = torch.bmm(xg, wg)                                                       # [G, M, n] fp32
            partial *= scales[n0:n1].t().unsqueeze(1)                                         # flush: * scale
            out[:, n0:n1] = partial.sum(dim=0)
        return out

    return reference.finish(reference.row_invariant(x, rows_y32), bias)


def linear_f64(x: torch.Tensor, packed: PackedNVFP4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact float64 y (not rounded): sum over k of x * e2m1 * e4m3 * global, in float64."""
    reference.check_x(x, packed.k)
    vals, _ = decode_packed(packed)
    s64 = codecs.decode_e4m3(group_scale_bytes(packed)).double() * packed.global_scale.double().reshape(())
    w64 = (vals.double().view(packed.n, -1, GROUP_SIZE) * s64.unsqueeze(-1)).view(packed.n, packed.k)
    y = x.double() @ w64.t()
    return reference.finish_f64(y, bias)


# ---------------------------------------------------------------------------------- numerics
def _expert_scalars(t, e_count: int, what: str) -> torch.Tensor:
    s = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
    if s.numel() == 1:
        s = s.expand(e_count)
    if s.numel() != e_count:
        raise MoeShapeError(f"{what} must hold one float32 value per expert ({e_count}), got {s.numel()} values")
    return s


class NVFP4Numerics:
    packed_type = PackedNVFP4

    def __init__(self, fmt: WeightFormat = NVFP4) -> None:
        self.fmt = fmt

    # a source is (codes uint8 [N, K/2], group scales e4m3 [N, K/16], global scale float32)
    def decode_f64(self, codes, scales, global_scale) -> torch.Tensor:
        return codec.dequantize_f64(codes, scales, global_scale)

    def decode_f32(self, codes, scales, global_scale) -> torch.Tensor:
        return codec.dequantize(codes, scales, global_scale)

    def quantize(self, w: torch.Tensor) -> tuple:
        return codec.quantize(w)

    def prepack(self, codes, scales, global_scale, atom: str = "m8n8k4",
                rows_per_chunk: int | None = None) -> PackedNVFP4:
        return layout.prepack(codes, scales, global_scale, atom=atom,
                                     rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed: PackedNVFP4) -> tuple:
        return (*layout.unprepack(packed), packed.global_scale.reshape(()))

    def verify_roundtrip(self, packed, codes, scales, global_scale,
                         rows_per_chunk: int | None = None) -> None:
        # The global scale is copied, not permuted, but the kernels multiply by the packed copy:
        # it is compared like every code and group scale, so it is required here.
        if global_scale is None:
            raise PrepackMismatch("NVFP4 weight_scale_2 (global scale) not given: the round "
                                          "trip must compare it as well; pass the source's value")
        layout.verify_roundtrip(packed, codes, scales, global_scale, rows_per_chunk=rows_per_chunk)

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        return linear(x, packed, bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        return linear_f64(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        vals, gscales = decode_packed(packed)
        group = self.fmt.group_size
        w = (vals.view(packed.n, -1, group) * gscales.unsqueeze(-1)).view(packed.n, packed.k)
        return w, torch.ones(packed.n, dtype=torch.float32, device=w.device)

    def packed_tensors(self, packed):
        return packed.codes, packed.scales, packed.global_scale

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom) -> PackedNVFP4:
        return PackedNVFP4(codes, scales, chscale.reshape(1), n, k, atom)

    # ---- vLLM's stacked expert tensors [E, ...] (kernels/moe.py)
    def expert_source(self, e, weight, weight_scale, weight_scale_2=None) -> tuple:
        gs = _expert_scalars(weight_scale_2, weight.shape[0], "weight_scale_2")
        return weight[e], weight_scale[e], gs[e]

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_scale_2, inter):
        sg, su = split_gate_up(w13_scale, inter)
        s2 = torch.as_tensor(w13_scale_2, dtype=torch.float32).reshape(wg.shape[0], -1)
        return (wg, sg, s2[:, 0]), (wu, su, s2[:, -1])

    def moe_down_source(self, w2, w2_scale, w2_scale_2=None) -> tuple:
        return w2, w2_scale, w2_scale_2


# The class implementing kernels/families/contract.py, as families.numerics hands it out.
NUMERICS = NVFP4Numerics
