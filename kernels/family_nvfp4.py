"""The NVFP4 family's numerics: e2m1 codes two per byte, one e4m3 scale per 16 inputs, one float32
global multiplier (value = e2m1(code) * e4m3(group scale) * global).

What the family is (its bits, group size, roles, entry point names) is data in formats.py; this
module is how a tensor of the family is decoded, encoded, prepacked and proven, computed on the
CPU, and cut out of vLLM's stacked MoE tensors. families.numerics(fmt) hands it out.
"""
from __future__ import annotations

import torch

from . import codecs, prepack, reference
from .formats import NVFP4, MoeShapeError, WeightFormat
from .prepack import PackedNVFP4, split_gate_up


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
        return codecs.dequantize_nvfp4_f64(codes, scales, global_scale)

    def decode_f32(self, codes, scales, global_scale) -> torch.Tensor:
        return codecs.dequantize_nvfp4(codes, scales, global_scale)

    def quantize(self, w: torch.Tensor) -> tuple:
        return codecs.quantize_nvfp4(w)

    def prepack(self, codes, scales, global_scale, atom: str = "m8n8k4",
                rows_per_chunk: int | None = None) -> PackedNVFP4:
        return prepack.prepack_nvfp4(codes, scales, global_scale, atom=atom,
                                     rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed: PackedNVFP4) -> tuple:
        return (*prepack.unprepack_nvfp4(packed), packed.global_scale.reshape(()))

    def verify_roundtrip(self, packed, codes, scales, global_scale,
                         rows_per_chunk: int | None = None) -> None:
        # The global scale is copied, not permuted, but the kernels multiply by the packed copy:
        # it is compared like every code and group scale, so it is required here.
        if global_scale is None:
            raise prepack.PrepackMismatch("NVFP4 weight_scale_2 (global scale) not given: the round "
                                          "trip must compare it as well; pass the source's value")
        prepack.verify_nvfp4_roundtrip(packed, codes, scales, global_scale, rows_per_chunk=rows_per_chunk)

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        return reference.linear_nvfp4(x, packed, bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        return reference.linear_nvfp4_f64(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        vals, gscales = reference.decode_packed_nvfp4(packed)
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


# The family's numerics, as families.numerics hands them out (families.py finds this module by
# the family's name, formats.ALL_FAMILIES).
NUMERICS = NVFP4Numerics
