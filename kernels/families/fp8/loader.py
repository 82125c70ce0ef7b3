"""The FP8 family's loader schema (kernels/families/contract.py FamilyLoader): what a checkpoint
module stores and how its tensors become FP8 sources.

Stored per module: e4m3 codes ([N, K]), a float32 scale that multiplies them, per fused output
shard ([P], ``scheme.fp8_scale`` "tensor") or per output row ([N, 1], "channel"), and one
activation scale per shard (loaded, checked, dropped: the kernels take FP16 activations).

Shard fusion: one piece. Fused shards with different per-tensor scales get a per-output-channel
scale vector, each shard's scalar repeated over its rows (the codes untouched: nothing is
requantized).
"""
from __future__ import annotations

import torch

from ..contract import StoredTensor

_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


class FP8Loader:
    def stored(self, names, convention, scheme) -> tuple[StoredTensor, ...]:
        scale = ("N", "1") if scheme.fp8_scale == "channel" else ("P",)
        out = [StoredTensor("codes", names.codes, ("N", "K"), torch.float8_e4m3fn, (torch.float8_e4m3fn,)),
               StoredTensor("scale", names.scale, scale, torch.float32, _FLOAT_SCALES, scale=True)]
        if names.input_scale:
            out.append(StoredTensor("input_scale", names.input_scale, ("P",), torch.float32, _FLOAT_SCALES,
                                    required=False, scale=True))
        return tuple(out)

    def geometry_problem(self, parts, k, k_full, convention, scheme):
        return None

    def value_problem(self, spec, t, rows, k_full, convention, scheme, module):
        return None

    def sources(self, tensors, parts, names, convention, scheme, module, extra):
        w, ws = tensors["codes"], tensors["scale"].float()
        if scheme.fp8_scale == "channel":
            scale = ws.reshape(-1).contiguous()  # already one scale per output row
        elif bool((ws == ws[0]).all()):
            scale = ws[:1].clone()
        else:
            scale = torch.repeat_interleave(ws, torch.tensor(parts, device=ws.device)).contiguous()
        return [(0, sum(parts), (w, scale))]


LOADER = FP8Loader()
