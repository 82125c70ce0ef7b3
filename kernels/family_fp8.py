"""The FP8 family's numerics: e4m3 codes one per byte, times a float32 scale per tensor or per
output channel (the two formats of the family differ only in that scale's shape).

What the family is lives as data in formats.py; this module is how its tensors are decoded,
encoded, prepacked and proven, computed on the CPU, and cut out of vLLM's stacked MoE tensors.
families.numerics(fmt) hands it out.
"""
from __future__ import annotations

import torch

from . import codecs, prepack, reference
from .formats import FP8_TENSOR, MoeShapeError, WeightFormat
from .prepack import PackedFP8


class FP8Numerics:
    packed_type = PackedFP8

    def __init__(self, fmt: WeightFormat = FP8_TENSOR) -> None:
        self.fmt = fmt

    # a source is (codes float8_e4m3fn [N, K], scale float32 [1] per tensor or [N] per channel)
    def decode_f64(self, codes, scale) -> torch.Tensor:
        return codecs.dequantize_fp8_f64(codes, scale)

    def decode_f32(self, codes, scale) -> torch.Tensor:
        return codecs.dequantize_fp8(codes, scale)

    def quantize(self, w: torch.Tensor) -> tuple:
        return codecs.quantize_fp8(w, per_channel=self.fmt.output_scale == "channel")

    def prepack(self, codes, scale, atom: str = "m8n8k4",
                rows_per_chunk: int | None = None) -> PackedFP8:
        return prepack.prepack_fp8(codes, scale, atom=atom, rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed: PackedFP8) -> tuple:
        return prepack.unprepack_fp8(packed)

    def verify_roundtrip(self, packed, codes, scale,
                         rows_per_chunk: int | None = None) -> None:
        prepack.verify_fp8_roundtrip(packed, codes, scale, rows_per_chunk=rows_per_chunk)

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        return reference.linear_fp8(x, packed, bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        return reference.linear_fp8_f64(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.decode_packed_fp8(packed)

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


# The family's numerics, as families.numerics hands them out (families.py finds this module by
# the family's name, formats.ALL_FAMILIES).
NUMERICS = FP8Numerics
