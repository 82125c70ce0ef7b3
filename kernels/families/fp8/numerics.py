"""The FP8 family's numerics: its CPU reference, reading the packed buffers the kernels read, and
``FP8Numerics``, the family's side of kernels/families/contract.py.

value = e4m3(byte) * scale. The float32 reference: FP32 dot product of activations and e4m3
values, times the FP32 per-tensor / per-channel scale, FP16 output; the float64 one is exact.
"""
from __future__ import annotations

import torch

from ... import codecs, reference
from ...atoms import geometry
from ...prepack import from_blocks
from ...weight_format import MoeShapeError, WeightFormat
from . import codec, layout
from .layout import PackedFP8
from .members import FP8_TENSOR


# ------------------------------------------------------------------------------ CPU reference
def decode_packed(packed: PackedFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP8 -> (e4m3 values float32 [N, K], per-row scale float32 [N])."""
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    tiles, kblocks = packed.n_pad // tile, packed.k_pad // kbk
    _, scatter = layout.code_maps(packed.atom)
    raw = packed.codes.view(tiles, kblocks, tile * kbk).index_select(2, scatter.to(packed.codes.device))
    src = from_blocks(raw, tile, kbk)[: packed.n, : packed.k]
    return codecs.decode_e4m3(src), codec.channel_scales(packed.scale, packed.n)


def linear(x: torch.Tensor, packed: PackedFP8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (x @ e4m3^T) * scale in FP32; x [M, K] -> fp16 [M, N]."""
    reference.check_x(x, packed.k)
    vals, scale = decode_packed(packed)
    y32 = reference.row_invariant(x, lambda xr: xr.to(torch.float32) @ vals.t()) * scale.reshape(1, -1)
    return reference.finish(y32, bias)


def linear_f64(x: torch.Tensor, packed: PackedFP8, bias: torch.Tensor | None = None) -> torch.Tensor:
    reference.check_x(x, packed.k)
    vals, scale = decode_packed(packed)
    y = (x.double() @ vals.double().t()) * scale.double().reshape(1, -1)
    return reference.finish_f64(y, bias)


# ---------------------------------------------------------------------------------- numerics
class FP8Numerics:
    packed_type = PackedFP8

    def __init__(self, fmt: WeightFormat = FP8_TENSOR) -> None:
        self.fmt = fmt

    # a source is (codes float8_e4m3fn [N, K], scale float32 [1] per tensor or [N] per channel)
    def decode_f64(self, codes, scale) -> torch.Tensor:
        return codec.dequantize_f64(codes, scale)

    def decode_f32(self, codes, scale) -> torch.Tensor:
        return codec.dequantize(codes, scale)

    def quantize(self, w: torch.Tensor) -> tuple:
        return codec.quantize(w, per_channel=self.fmt.output_scale == "channel")

    def prepack(self, codes, scale, atom: str = "m8n8k4",
                rows_per_chunk: int | None = None) -> PackedFP8:
        return layout.prepack(codes, scale, atom=atom, rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed: PackedFP8) -> tuple:
        return layout.unprepack(packed)

    def verify_roundtrip(self, packed, codes, scale,
                         rows_per_chunk: int | None = None) -> None:
        layout.verify_roundtrip(packed, codes, scale, rows_per_chunk=rows_per_chunk)

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        return linear(x, packed, bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        return linear_f64(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_packed(packed)

    def packed_tensors(self, packed):
        return packed.codes, None, packed.scale

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom) -> PackedFP8:
        return PackedFP8(codes, chscale.reshape(-1), n, k, atom)

    # ---- vLLM's stacked expert tensors [E, ...] (kernels/moe.py)
    def expert_source(self, e, weight, weight_scale, weight_scale_2=None) -> tuple:
        e_count, n = weight.shape[0], weight.shape[1]
        ws = torch.as_tensor(weight_scale, dtype=torch.float32)
        if ws.numel() == 1:
            return weight[e], ws.reshape(())
        if ws.dim() >= 1 and ws.shape[0] == e_count:
            per = ws[e].reshape(-1)
            if per.numel() == 1:
                return weight[e], per.reshape(())
            if per.numel() == n:
                return weight[e], per
        raise MoeShapeError(f"FP8 expert weight_scale must be one value, [E={e_count}] (per tensor) or "
                            f"[E={e_count}, N={n}] (per channel); got shape {tuple(ws.shape)}")

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_scale_2, inter):
        e_count = wg.shape[0]
        s = torch.as_tensor(w13_scale, dtype=torch.float32)
        if s.dim() >= 2 and s.shape[1] == 2 * inter:     # per channel
            sg, su = s[:, :inter].reshape(e_count, inter), s[:, inter:].reshape(e_count, inter)
        else:                                            # per tensor: one per shard, or one per expert
            s = s.reshape(e_count, -1)
            sg, su = s[:, 0], s[:, -1]
        return (wg, sg), (wu, su)

    def moe_down_source(self, w2, w2_scale, w2_scale_2=None) -> tuple:
        ws = torch.as_tensor(w2_scale, dtype=torch.float32)
        return w2, (ws.reshape(w2.shape[0], -1) if ws.dim() >= 2 and ws.shape[1] != 1 else ws.reshape(-1))


# The class implementing kernels/families/contract.py, as families.numerics hands it out.
NUMERICS = FP8Numerics
