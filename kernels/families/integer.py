"""The loader schema every integer family shares (each family's loader.py builds one with its code
width, unpackers and codec): unsigned codes of ``bits`` bits that AWQ, GPTQ and compressed-tensors
pack-quantized store p = 32 / bits to an int32 word, float16 group scales (one per output row for a
per-channel scheme) and, asymmetric, zero points packed like the codes.

What a module stores is the convention's tensors as stored, placed by its layout (which axis is N or
K, which one is packed p per int32, which one holds one entry per group: ``convention.layout``,
symbols of contract.StoredTensor). A symmetric GPTQ checkpoint still carries qzeros (unread), and
GPTQ a trivial g_idx: every tensor the convention may store is registered, so that the engine's
loader finds a parameter for each; ``convention.roles(scheme)`` says which are required. Scales are
registered in float32 (any fp16 / bf16 / fp32 checkpoint value fits exactly) and refused as they
load if float16, which the kernels read, cannot hold them.

Sources: the convention's unpacker (the family's checkpoint.py) makes the canonical source; written
back in the convention's layout it must equal the loaded words, so a misread word order or zero
point refuses the module. Each fused shard's g_idx (this rank's slice) then moves its group scales
(the family's apply_g_idx; an act-ordered map is refused). One piece.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .. import reference
from ..prepack import split_gate_up
from ..weight_format import ActOrderError, FormatError, MoeShapeError, require
from .contract import LoadError, StoredTensor

_TORCH_DTYPE = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                "F32": torch.float32}
_REGISTERED = {"codes": torch.int32, "zero_points": torch.int32, "g_idx": torch.int32, "shape": torch.int64,
               "group_scales": torch.float32}


# --------------------------------------------- what every integer family's unpackers share
def word_values(words: torch.Tensor, dim: int, bits: int, title: str) -> torch.Tensor:
    """int32 words -> their 32 / bits values, value i = bits bits*i .. (little-endian), as a new
    axis right after ``dim`` (int64). Arithmetic shifts of negative words are masked, so sign is
    moot."""
    require(words.dtype == torch.int32, f"packed {title} tensors must be int32, got {words.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    w = words.unsqueeze(dim + 1)
    view = [1] * w.dim()
    view[dim + 1] = per_word
    return ((w >> shifts.view(view)) & ((1 << bits) - 1)).to(torch.int64)


def f16_scales(s: torch.Tensor, what: str, title: str) -> torch.Tensor:
    """Scales as float16, refusing any value float16 does not hold exactly (bf16 / fp32 scales
    of real checkpoints fit; a silent rounding would change every weight of the group)."""
    s = torch.as_tensor(s)
    require(s.is_floating_point(), f"{what} must be floating point, got {s.dtype}")
    if s.dtype == torch.float16:
        return s.contiguous()
    s16 = s.to(torch.float16)
    require(bool((s16.to(s.dtype) == s).all()),
             f"{what} ({s.dtype}) holds values float16 cannot represent exactly; QPN's {title} kernels "
             "read float16 scales and would change the weights")
    return s16.contiguous()


def apply_g_idx(group_scales, zero_points, g_idx, group_size: int, module: str | None = None,
                title: str = "integer"):
    """Scales [N, G] and zeros (or None) indexed by a checkpoint's g_idx (input -> group) ->
    the same in input order, group b covering inputs b*g .. b*g+g-1.

    A g_idx that is constant on every aligned block of g inputs (the trivial i // g, or whole
    groups stored out of order) only moves scale columns: exact, no runtime cost. One that
    scatters inputs of a group across blocks (GPTQ desc_act / act-order "group") would need the
    activations permuted in every forward, which the kernels do not do: ActOrderError."""
    if g_idx is None:
        return group_scales, zero_points
    gi = torch.as_tensor(g_idx).to(torch.int64).reshape(-1).cpu()
    cols = group_scales.shape[1]
    k = cols * group_size
    where = f" in {module}" if module else ""
    require(gi.numel() == k, f"g_idx{where} has {gi.numel()} entries, expected K={k}")
    require(gi.numel() == 0 or (int(gi.min()) >= 0 and int(gi.max()) < cols),
             f"g_idx{where} names groups outside 0..{cols - 1}")
    blocks = gi.view(cols, group_size)
    first = blocks[:, :1]
    if not bool((blocks == first).all()):
        b = int(torch.nonzero((blocks != first).any(1))[0])
        raise ActOrderError(
            f"activation-ordered {title} weight{where}: g_idx mixes groups inside inputs {b * group_size}.."
            f"{b * group_size + group_size - 1} (desc_act / actorder=group). QPN's kernels read inputs in "
            "checkpoint order and cannot permute activations; re-export without act-order (static / "
            "desc_act=False) or serve this module unquantized")
    order = first.reshape(-1).to(group_scales.device)
    if torch.equal(order.cpu(), torch.arange(cols)):
        return group_scales, zero_points
    s = group_scales.index_select(1, order).contiguous()
    z = None if zero_points is None else zero_points.index_select(1, order).contiguous()
    return s, z


# ------------------------------------------------------------------------ the numerics
class IntegerNumerics:
    """kernels/families/contract.py for an integer family, all but ``packed_from_tensors`` (each
    family finds its record span its own way). A family's numerics class sets ``codec`` and
    ``layout`` (its modules: dequantize / dequantize_f64 / quantize, prepack / unprepack /
    verify_roundtrip) and ``packed_type``; a source is (codes, float16 group scales[, uint8 zero
    points]), value = (code - zero) * scale."""

    codec = None
    layout = None
    packed_type: type = object
    # symmetric? -> one record as one integer (int32 asymmetric, int16 symmetric)
    RECORD_DTYPE = {False: torch.int32, True: torch.int16}

    def __init__(self, fmt) -> None:
        self.fmt = fmt

    def _src(self, codes, scales, zero_points):
        if self.fmt.has_zero_points and zero_points is None:
            raise FormatError(f"{self.fmt.title} needs zero_points (roles {self.fmt.roles})")
        return (codes, scales, zero_points if self.fmt.has_zero_points else None)

    def decode_f64(self, codes, scales, zero_points=None) -> torch.Tensor:
        return self.codec.dequantize_f64(*self._src(codes, scales, zero_points))

    def decode_f32(self, codes, scales, zero_points=None) -> torch.Tensor:
        """Exact in float32 (the codec's docstring); the kernels' FP16 operand is its one rounding."""
        return self.codec.dequantize(*self._src(codes, scales, zero_points))

    def quantize(self, w: torch.Tensor, group_size: int | None = None) -> tuple:
        return self.codec.quantize(w, group_size or self.fmt.group_size, symmetric=not self.fmt.has_zero_points)

    def prepack(self, codes, scales, zero_points=None, atom: str = "m8n8k4", rows_per_chunk: int | None = None):
        return self.layout.prepack(*self._src(codes, scales, zero_points), atom=atom, rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed) -> tuple:
        return self.layout.unprepack(packed)

    def verify_roundtrip(self, packed, codes, scales, zero_points=None, rows_per_chunk: int | None = None) -> None:
        self.layout.verify_roundtrip(packed, *self._src(codes, scales, zero_points), rows_per_chunk=rows_per_chunk)

    def weights(self, packed) -> torch.Tensor:
        """float32 [N, K] = (code - zero) * scale, read from the packed buffers."""
        return self.codec.dequantize(*self.layout.unprepack(packed))

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        """The kernels' semantics in float32: each weight is the FP16 operand the decoder makes,
        fp16((code - zero) * scale) (one rounding), products summed in FP32; FP16 output."""
        reference.check_x(x, packed.k)
        w = self.weights(packed).to(torch.float16).to(torch.float32)
        return reference.finish(x.to(torch.float32) @ w.t(), bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        """Exact float64 y (not rounded) from the exact weights (code - zero) * scale."""
        reference.check_x(x, packed.k)
        return reference.finish_f64(x.double() @ self.weights(packed).double().t(), bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weights(packed)
        return w, torch.ones(packed.n, dtype=torch.float32, device=w.device)

    def packed_tensors(self, packed):
        """(codes, records, out_scale); the records as one integer per record, the same bytes: the
        kernel tensors then say which member they are, which the ops record of a weight (family,
        not member) otherwise loses."""
        return packed.codes, packed.scales.view(self.RECORD_DTYPE[packed.symmetric]), packed.out_scale

    def member_records(self, scales) -> tuple[bool, torch.Tensor]:
        """(symmetric, the records as bytes) of kernel records (packed_tensors; uint8 records: this
        numerics' member)."""
        for member_sym, dtype in self.RECORD_DTYPE.items():
            if scales.dtype == dtype:
                return member_sym, scales.view(torch.uint8)
        return not self.fmt.has_zero_points, scales

    # ---- stacked expert tensors [E, ...] in the canonical layout (no MoE method serves an integer
    # family; these keep the numerics interface whole for the tests and a future method)
    def expert_source(self, e, weight, weight_scale, weight_zero_point=None) -> tuple:
        if self.fmt.has_zero_points:
            if weight_zero_point is None:
                raise MoeShapeError(f"{self.fmt.title} experts need zero points")
            return weight[e], weight_scale[e], weight_zero_point[e]
        return weight[e], weight_scale[e]

    def moe_gate_up_sources(self, wg, wu, w13_scale, w13_zero_point, inter):
        sg, su = split_gate_up(w13_scale, inter)
        if not self.fmt.has_zero_points:
            return (wg, sg), (wu, su)
        zg, zu = split_gate_up(w13_zero_point, inter)
        return (wg, sg, zg), (wu, su, zu)

    def moe_down_source(self, w2, w2_scale, w2_zero_point=None) -> tuple:
        return (w2, w2_scale, w2_zero_point) if self.fmt.has_zero_points else (w2, w2_scale)


# ---------------------------------------------------------------------- the loader schema
def pack_words(values: torch.Tensor, dim: int, order, bits: int) -> torch.Tensor:
    """Integer values -> int32 words of p = 32 / bits along ``dim``, value j of a word = element
    p*c + order[j] in bits bits*j ..: a convention's own packing, so the loaded words can be
    compared with what is served."""
    p = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        return pack_words(v.t(), 1, order, bits).t().contiguous()
    rows, cols = v.shape
    if cols % p:
        v = torch.cat([v, v.new_zeros(rows, -cols % p)], 1)
    v = v.view(rows, -1, p)
    word = torch.zeros(v.shape[:2], dtype=torch.int64, device=v.device)
    for j, src in enumerate(order):
        word |= v[:, :, src] << (bits * j)
    return (word - ((word >> 31) << 32)).to(torch.int32)


@dataclasses.dataclass(frozen=True)
class IntegerLoader:
    bits: int                                         # code width
    checkpoint: object                                # the family's checkpoint.py (unpackers, apply_g_idx)
    to_values: Callable[[torch.Tensor], torch.Tensor]  # canonical codes -> one integer per input [N, K]
    stored_dtypes: dict                               # {role: safetensors dtypes}, the family's members.py

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def _symbols(self, convention, role: str, scheme) -> tuple[str, ...]:
        syms = convention.layout.symbols(role, self.per_word)
        # per channel: one scale (and zero point) per output row, not split with the inputs
        return tuple("1" if s == "K/g" else s for s in syms) if scheme.group_size == -1 else syms

    def stored(self, names, convention, scheme) -> tuple[StoredTensor, ...]:
        required = convention.roles(scheme)
        out = []
        for role, name in names.roles().items():
            syms = self._symbols(convention, role, scheme)
            packed = _REGISTERED[role] is torch.int32 and any(s.endswith(f"/{self.per_word}") for s in syms)
            out.append(StoredTensor(role, name, syms, _REGISTERED[role],
                                    tuple(_TORCH_DTYPE[d] for d in self.stored_dtypes[role]),
                                    required=required.get(role, False), scale=role == "group_scales",
                                    packed_factor=self.per_word if packed else 0))
        return tuple(out)

    def geometry_problem(self, parts, k, k_full, convention, scheme):
        g, p = scheme.group_size, self.per_word
        title = scheme.format.title
        if g > 0 and k % g:
            if k != k_full:
                tp = k_full // k if k else 0
                fits = [t for t in range(1, 9) if k_full % t == 0 and (k_full // t) % g == 0]
                return (f"row-parallel K={k_full} split over TP={tp} gives {k} inputs per rank, which breaks the "
                        f"{title} groups of {g} inputs (one scale{'' if scheme.symmetric else ' and zero point'} "
                        f"per group); fix: serve at a TP size that keeps whole groups (TP in {fits}) or use a "
                        f"checkpoint quantized with a group size that divides {k}")
            return f"K={k} input features is not a multiple of the group size {g}"
        if k % p and any(s.startswith("K/") and s != "K/g" for s in convention.layout.codes):
            return f"K={k} input features is not a multiple of {p}, the {title} codes per int32 word"
        if convention.packs_outputs(scheme):
            for idx, rows in enumerate(parts):
                if rows % p:
                    return (f"output shard {idx} has {rows} rows on this rank; {convention.name} packs {p} "
                            f"output rows per int32 word, so every shard on every rank needs a multiple of "
                            f"{p} rows (fix: a TP size that keeps it)")
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
            return (f"({t.dtype}) holds values float16 cannot represent exactly; the {scheme.format.title} "
                    "kernels read float16 scales and would change the weights")
        return None

    # ------------------------------------------------------------------------- unpacking
    def unpack(self, unpacker: str, t: dict, scheme, module: str) -> tuple:
        """The canonical source from a module's tensors by role, by the convention's unpacker of
        the family's checkpoint.py; FormatError (ActOrderError for an act-ordered g_idx) names
        the problem."""
        fn = getattr(self.checkpoint, unpacker, None)
        if fn is None:
            raise FormatError(f"{scheme.format.title} has no {unpacker} unpacker: this convention does not "
                              "store the family")
        g = scheme.group_size
        if unpacker == "from_awq":
            return fn(t["codes"], t["zero_points"], t["group_scales"], g)
        if unpacker == "from_gptq":
            return fn(t["codes"], t.get("zero_points"), t["group_scales"], t.get("g_idx"), g, scheme.symmetric,
                      v2=scheme.zero_offset == 0, module=module)
        return fn(t["codes"], t["group_scales"], None if scheme.symmetric else t["zero_points"], g,
                  g_idx=t.get("g_idx"), module=module)

    def check_g_idx(self, g_idx, k: int, group_size: int, module: str) -> None:
        """ActOrderError unless ``g_idx`` only moves whole groups (the family's apply_g_idx)."""
        g = group_size if group_size > 0 else k  # per channel: one group of every input
        self.checkpoint.apply_g_idx(torch.zeros((1, k // g), dtype=torch.float16), None, g_idx, g, module)

    def _layout_tensors(self, codes, scales, zeros, names, convention, scheme) -> dict[str, torch.Tensor]:
        """The canonical source written back in the convention's layout."""
        p = self.per_word
        order = convention.layout.order(p)

        def orient(t, syms):  # canonical tensors are [N, *]; a layout may store [K, N]
            return t.t() if syms[0].startswith("K") else t

        def words(values, role):
            syms = convention.layout.symbols(role, p)
            v = orient(values, syms)
            return pack_words(v, next(i for i, s in enumerate(syms) if s.endswith(f"/{p}")), order, self.bits)

        out = {names.codes: words(self.to_values(codes), "codes"),
               names.group_scales: orient(scales, convention.layout.group_scales).float()}
        if zeros is not None:
            out[names.zero_points] = words(zeros.to(torch.int64) - scheme.zero_offset, "zero_points")
        return out

    def sources(self, tensors, parts, names, convention, scheme, module, extra):
        keep = ["codes", "group_scales"] + ([] if scheme.symmetric else ["zero_points"])
        t = {r: tensors[r] for r in keep}
        try:  # g_idx is applied per shard below (fused shards each carry their own)
            src = self.unpack(convention.unpacker, t, dataclasses.replace(scheme, act_order=False), module)
        except FormatError as e:
            raise LoadError(f"cannot unpack: {e}") from e
        codes, scales = src[0], src[1]
        zeros = None if scheme.symmetric else src[2]
        for name, want in self._layout_tensors(codes, scales, zeros, names, convention, scheme).items():
            got = t[next(r for r in keep if getattr(names, r) == name)]
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
                    g = scheme.group_size if scheme.group_size > 0 else gi.numel()  # per channel: all inputs
                    s, z = self.checkpoint.apply_g_idx(scales[r0:r1], None if zeros is None else zeros[r0:r1],
                                                       gi.to(torch.int64) - first, g, module)
                except FormatError as e:
                    raise LoadError(f"output shard {idx}: {e}") from e
                scales[r0:r1] = s
                if zeros is not None:
                    zeros[r0:r1] = z
        src = (codes, scales) if zeros is None else (codes, scales, zeros)
        return [(0, sum(parts), src)]
