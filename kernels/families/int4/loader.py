"""The INT4 family's loader schema (kernels/families/contract.py FamilyLoader): what an AutoAWQ,
GPTQ or compressed-tensors module stores and how its tensors become INT4 sources.

Stored per module: the convention's tensors as stored, placed by its layout (which axis is N or K,
which one is packed eight per int32, which one holds one entry per group: ``convention.layout``,
symbols of contract.StoredTensor). A symmetric GPTQ checkpoint still carries qzeros (unread), and
GPTQ a trivial g_idx: every tensor the convention may store is registered, so that the engine's
loader finds a parameter for each; ``convention.roles(scheme)`` says which are required. Scales
are registered in float32 (any fp16 / bf16 / fp32 checkpoint value fits exactly) and refused as
they load if float16, which the kernels read, cannot hold them.

Sources: the convention's unpacker (checkpoint.py, through ``convention.int4_inputs``) makes the
canonical source; written back in the convention's layout it must equal the loaded words, so a
misread nibble order or zero point refuses the module. Each fused shard's g_idx (this rank's
slice) then moves its group scales (apply_g_idx; an act-ordered map is refused). One piece.
"""
from __future__ import annotations

import dataclasses

import torch

from ...weight_format import FormatError
from ..contract import LoadError, StoredTensor
from .checkpoint import apply_g_idx
from .codec import unpack_codes
from .members import STORED_DTYPES

_TORCH_DTYPE = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                "F32": torch.float32}
_REGISTERED = {"codes": torch.int32, "zero_points": torch.int32, "g_idx": torch.int32, "shape": torch.int64,
               "group_scales": torch.float32}
WORD = 8  # 4-bit values per int32 word: the "/8" of a layout symbol


def pack_words(values: torch.Tensor, dim: int, order) -> torch.Tensor:
    """Integer values 0..15 -> int32 words of eight along ``dim``, nibble j = element 8c + order[j]:
    the convention's own packing, so the loaded words can be compared with what was served."""
    v = values.to(torch.int64)
    if dim == 0:
        return pack_words(v.t(), 1, order).t().contiguous()
    rows, cols = v.shape
    if cols % WORD:
        v = torch.cat([v, v.new_zeros(rows, -cols % WORD)], 1)
    v = v.view(rows, -1, WORD)
    word = torch.zeros(v.shape[:2], dtype=torch.int64, device=v.device)
    for j, src in enumerate(order):
        word |= v[:, :, src] << (4 * j)
    return (word - ((word >> 31) << 32)).to(torch.int32)


class INT4Loader:
    def stored(self, names, convention, scheme) -> tuple[StoredTensor, ...]:
        required = convention.roles(scheme)
        out = []
        for role, name in names.roles().items():
            syms = getattr(convention.layout, role)
            packed = WORD if any(s.endswith(f"/{WORD}") for s in syms) and _REGISTERED[role] is torch.int32 else 0
            out.append(StoredTensor(role, name, syms, _REGISTERED[role],
                                    tuple(_TORCH_DTYPE[d] for d in STORED_DTYPES[role]),
                                    required=required.get(role, False), scale=role == "group_scales",
                                    packed_factor=packed))
        return tuple(out)

    def geometry_problem(self, parts, k, k_full, convention, scheme):
        g = scheme.group_size
        if k % g:
            if k != k_full:
                tp = k_full // k if k else 0
                fits = [t for t in range(1, 9) if k_full % t == 0 and (k_full // t) % g == 0]
                return (f"row-parallel K={k_full} split over TP={tp} gives {k} inputs per rank, which breaks an "
                        f"INT4 group of {g} inputs (one scale{'' if scheme.symmetric else ' and zero point'} per "
                        f"group); fix: serve at a TP size that keeps whole groups (TP in {fits}) or use a "
                        f"checkpoint quantized with a group size that divides {k}")
            return f"K={k} input features is not a multiple of the group size {g}"
        if convention.packs_outputs(scheme):
            for idx, rows in enumerate(parts):
                if rows % WORD:
                    return (f"output shard {idx} has {rows} rows on this rank; {convention.name} packs {WORD} "
                            f"output rows per int32 word, so every shard on every rank needs a multiple of "
                            f"{WORD} rows (fix: a TP size that keeps it)")
        return None

    def value_problem(self, spec, t, rows, k_full, convention, scheme, module):
        if spec.role == "shape" and [int(v) for v in t.reshape(-1)] != [rows, k_full]:
            return (f"says the module is {[int(v) for v in t.reshape(-1)]}, the layer expects [{rows}, {k_full}] "
                    "for this shard")
        if spec.role == "g_idx":
            try:
                convention.check_g_idx(module, t, k_full, scheme)
            except ValueError as e:
                return str(e)
        if spec.role == "group_scales" and not bool((t.to(torch.float16).to(t.dtype) == t).all()):
            return (f"({t.dtype}) holds values float16 cannot represent exactly; the INT4 kernels read float16 "
                    "scales and would change the weights")
        return None

    def _layout_tensors(self, codes, scales, zeros, names, convention, scheme) -> dict[str, torch.Tensor]:
        """The canonical source written back in the convention's layout."""
        lay = convention.layout

        def orient(t, syms):  # canonical tensors are [N, *]; a layout may store [K, N]
            return t.t() if syms[0].startswith("K") else t

        def words(values, syms):
            v = orient(values, syms)
            return pack_words(v, next(i for i, s in enumerate(syms) if s.endswith(f"/{WORD}")), lay.nibble_order)

        out = {names.codes: words(unpack_codes(codes), lay.codes),
               names.group_scales: orient(scales, lay.group_scales).float()}
        if zeros is not None:
            out[names.zero_points] = words(zeros.to(torch.int64) - scheme.zero_offset, lay.zero_points)
        return out

    def sources(self, tensors, parts, names, convention, scheme, module, extra):
        keep = ["codes", "group_scales"] + ([] if scheme.symmetric else ["zero_points"])
        by_name = {getattr(names, r): tensors[r] for r in keep}
        try:  # g_idx is applied per shard below (fused shards each carry their own)
            src = convention.int4_inputs(by_name, module, dataclasses.replace(scheme, act_order=False))
        except ValueError as e:
            raise LoadError(f"cannot unpack: {e}") from e
        codes, scales = src[0], src[1]
        zeros = None if scheme.symmetric else src[2]
        for name, want in self._layout_tensors(codes, scales, zeros, names, convention, scheme).items():
            got = by_name[name]
            if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
                raise LoadError(f"the unpacked {name} does not give the loaded tensor back; the checkpoint does "
                                f"not follow the {convention.name} layout")
        g_idx = extra.get("g_idx") or {}
        if g_idx:
            scales, zeros = scales.clone(), None if zeros is None else zeros.clone()
            first = extra.get("first_group", 0)  # a rank of a row-parallel layer starts at its own group
            for idx, gi in sorted(g_idx.items()):
                r0 = sum(parts[:idx])
                r1 = r0 + parts[idx]
                try:
                    s, z = apply_g_idx(scales[r0:r1], None if zeros is None else zeros[r0:r1],
                                       gi.to(torch.int64) - first, scheme.group_size, module)
                except FormatError as e:
                    raise LoadError(f"output shard {idx}: {e}") from e
                scales[r0:r1] = s
                if zeros is not None:
                    zeros[r0:r1] = z
        src = (codes, scales) if zeros is None else (codes, scales, zeros)
        return [(0, sum(parts), src)]


LOADER = INT4Loader()
