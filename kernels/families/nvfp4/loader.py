"""The NVFP4 family's loader schema (kernels/families/contract.py FamilyLoader): what a checkpoint
module stores and how its tensors become NVFP4 sources.

Stored per module: e2m1 codes two per byte (uint8 [N, K/2]), e4m3 group scales ([N, K/16]), one
global scale per fused output shard and one activation scale per shard (loaded, checked, dropped:
the kernels take FP16 activations). The convention names them and says whether the stored global
scale multiplies the group scales (ModelOpt weight_scale_2) or divides them (compressed-tensors
weight_global_scale): ``convention.global_scale_f32`` gives the float32 multiplier either way.

Shard fusion: runs of fused shards that share one global scale become one packed piece; shards
with different global scales are packed as separate pieces (their codes were made with their own
scale, so nothing is requantized and no maximum is taken).
"""
from __future__ import annotations

import torch

from ..contract import LoadError, StoredTensor
from .members import NVFP4

_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


class NVFP4Loader:
    def stored(self, names, convention, scheme) -> tuple[StoredTensor, ...]:
        g = f"K/{NVFP4.group_size}"
        out = [StoredTensor("codes", names.codes, ("N", "K/2"), torch.uint8, (torch.uint8,)),
               StoredTensor("group_scales", names.group_scales, ("N", g), torch.float8_e4m3fn,
                            (torch.float8_e4m3fn,), scale=True),
               StoredTensor("global_scale", names.global_scale, ("P",), torch.float32, _FLOAT_SCALES, scale=True)]
        if names.input_scale:
            out.append(StoredTensor("input_scale", names.input_scale, ("P",), torch.float32, _FLOAT_SCALES,
                                    required=False, scale=True))
        return tuple(out)

    def geometry_problem(self, parts, k, k_full, convention, scheme):
        g = NVFP4.group_size
        if k % g:
            return (f"K={k} input features is not a multiple of {g} (the NVFP4 group size: one e4m3 scale per "
                    f"{g} inputs); this checkpoint cannot be NVFP4 as declared")
        return None

    def value_problem(self, spec, t, rows, k_full, convention, scheme, module):
        return None

    def sources(self, tensors, parts, names, convention, scheme, module, extra):
        w, s, stored = tensors["codes"], tensors["group_scales"], tensors["global_scale"]
        if bool((stored == 0).any()):
            raise LoadError(f"{names.global_scale} (global scale) is 0 for a shard; re-export the checkpoint")
        s2 = convention.global_scale_f32(stored)  # one float32 multiplier per shard
        runs: list[list[int]] = []
        for i in range(len(parts)):
            if runs and torch.equal(s2[runs[-1][0]], s2[i]):
                runs[-1].append(i)
            else:
                runs.append([i])
        out = []
        for run in runs:
            r0, r1 = sum(parts[: run[0]]), sum(parts[: run[-1] + 1])
            out.append((r0, r1, (w[r0:r1], s[r0:r1], s2[run[0]].reshape(()))))
        return out


LOADER = NVFP4Loader()
