"""The INT4 W4A16 family's numerics: unsigned 4-bit codes two per byte, one float16 scale per group
of 32, 64 or 128 inputs, and (asymmetric member) one uint4 zero point per group; the symmetric
member's zero point is the constant 8. value = (code - zero) * scale.

What the family is (roles, group sizes, route prefix, entry point names) is data in formats.py
(``INT4`` and ``INT4_SYM``); this module is its codec, the three checkpoint conventions' unpackers
into the canonical source, the packed layout with its proven inverse, and the CPU reference.
families.numerics(fmt) hands it out. The m8n8k4 (SM70) CUDA decoders are DecINT4Form in
csrc/qpn_family.cuh (entry points qpn4[_sym]_{mt1,mt2,reconstruct_ws}_m8n8k4); the m16n8k16
(sm_80+) ones are Frag16INT4Form and, in the tiled routes' kernels, Frag16INT4FoldForm (the group
scale applied to FP32 sums for groups of 64 and 128: the kernel multiplies the exact
(code - zero) * scale) in csrc/qpn_atom_m16n8k16.cuh; which kernel serves which route and layer
size is sm80_tables.SM80_ROUTE_KERNELS.
ops runs them through the family's routes (qpn4, qpn4_mt2, qpn4_chunked, qpn4_reconstruct:
routes.py); the loader's QPN4LinearMethod (fork_patches/quant/linear_method.py) serves AWQ, GPTQ and
compressed-tensors pack-quantized checkpoints through them. There are no INT4 MoE kernels.

Canonical source (what a checkpoint convention hands the family; roles in formats.py):
  codes         uint8   [N, K/2]  two unsigned 4-bit codes per byte, the even k in the LOW nibble
  group_scales  float16 [N, K/g]
  zero_points   uint8   [N, K/g]  values 0..15 (asymmetric member only)
The group size g is not a field of the source: it is K / group_scales.shape[1], and must be one of
``fmt.group_sizes``. A packed weight carries it (``PackedINT4.group_size``).

Packed layout (per warp tile of ``tile_n`` rows; the k-block of the atom as for NVFP4/FP8):
  codes:  [tiles, k_blocks, tile_n * k_block / 2] bytes; every lane owns 16 contiguous bytes (one
          16-byte load per k-block) = four 32-bit words of 8 nibbles each.
  scales: [tiles, groups_pad, tile_n, rec] bytes, rec = 4 (asymmetric: scale low byte, scale high
          byte, zero point, 0) or 2 (symmetric: the scale's two bytes); one record per row and
          group, in the atom's slot order, so a lane fetches its scale AND zero point with one
          aligned 32-bit load (or 16-bit, symmetric) once per group. groups_pad = ceil(k_pad / g).
Decoding a 32-bit word in registers (both atoms): half2 pair r (r = 0..3) comes from nibbles r and
r + 4, i.e. bits 4r..4r+3 of each 16-bit half: ``lop3((w >> 4r), 0x000F000F, 0x64006400)`` is the
half2 (1024 + c_lo, 1024 + c_hi) exactly; ``hsub2`` with (1024 + zero) leaves the exact integers
code - zero in FP16 and ``hmul2`` by the group scale rounds once: fp16((code - zero) * scale), the
operand the reference (``linear``) models. Per word the nibbles therefore hold, by position
0..7, the pairs' elements lo0 lo1 lo2 lo3 hi0 hi1 hi2 hi3.

Fragment map m8n8k4 (SM70 HMMA.884, weights on A, lane row = 8 * ((l >> 2) & 3) + (l & 3) +
4 * (l >> 4), the same rows as NVFP4): per k-block of 32 the lane's word w holds inputs 8w..8w+7
of its row with nibble j = input 8w + WORD_ORDER[j], WORD_ORDER = (0, 2, 4, 6, 1, 3, 5, 7), so pair
r is inputs (8w + 2r, 8w + 2r + 1) and MMA i (4 consecutive k: 4i..4i+3) takes pairs 2i, 2i+1 of
word i // 2. This is also AutoAWQ's nibble order within an int32 (its kernels decode the same
way). A group (>= 32) spans whole k-blocks: one record per lane per group; record slot s of a
(tile, group) is lane s's row.

Fragment map m16n8k16 (sm_80+, A registers a0..a3 = (g, k0 k1), (g+8, k0 k1), (g, k2 k3),
(g+8, k2 k3) for lane (g = l >> 2, t = l & 3)): the FP8 family's k-slot permutation (k-slots of
MMA step s are inputs 16t + 4s + 0..3, so lane t supplies token inputs 16t..16t+15 in one 32-byte
read). Word s of the lane feeds step s; pair r (nibbles r, r+4) is register a_r: row g + 8 * (r & 1),
inputs 16t + 4s + 2 * (r >> 1) + (0, 1). A lane's 16 inputs lie in one group (g is a multiple of
16); record slot 2g + h of a (tile, group) is row g + 8h, so lane (g, t) fetches its two rows'
records with one 64-bit (asymmetric) or 32-bit (symmetric) load.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import formats
from .atoms import geometry
from .formats import INT4, FormatError, MoeShapeError, WeightFormat
from .prepack import (DEFAULT_ROWS_PER_CHUNK, PackedLayout, PrepackMismatch, _chunk_rows, _first_diff,
                      _from_blocks, _pad2d, _to_blocks, split_gate_up)

WORD_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble j of a word holds input 8w + WORD_ORDER[j]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)         # AutoAWQ: nibble j of an int32 holds column 8c + AWQ_ORDER[j]
SYM_ZERO = 8                                 # the symmetric member's zero point (uint4b8)
_MAGIC = 1024                                 # 0x6400 as fp16: the decoder's exact integer offset
_RECORD_DTYPE = {False: torch.int32, True: torch.int16}   # symmetric? -> one record as one integer


class ActOrderError(FormatError):
    """A GPTQ / compressed-tensors g_idx that reorders inputs within groups (desc_act): the
    kernels read inputs in checkpoint order, so such a weight cannot be served as stored."""


def _fmt_for(zero_points) -> WeightFormat:
    return formats.INT4 if zero_points is not None else formats.INT4_SYM


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise FormatError(msg)


# ------------------------------------------------------------------------------------- codec
def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]; code 2j is the low nibble of byte j."""
    _require(codes.dtype == torch.uint8, f"INT4 codes must be uint8 [N, K/2], got {codes.dtype}")
    _require(codes.dim() == 2, f"INT4 codes must be 2-D [N, K/2], got {tuple(codes.shape)}")
    out = torch.empty((codes.shape[0], codes.shape[1] * 2), dtype=torch.uint8, device=codes.device)
    out[:, 0::2] = codes & 0x0F
    out[:, 1::2] = codes >> 4
    return out


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """integer codes [N, K] (0..15, any integer dtype) -> uint8 [N, K/2], even k in the low nibble."""
    _require(q.dim() == 2 and q.shape[1] % 2 == 0, f"codes must be 2-D with an even K, got {tuple(q.shape)}")
    if q.numel():
        _require(int(q.min()) >= 0 and int(q.max()) <= 15, "INT4 codes must be 0..15")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def group_size_of(codes: torch.Tensor, group_scales: torch.Tensor, fmt: WeightFormat = INT4) -> int:
    """The group size a canonical source implies (K / scale columns); FormatError unless it is one
    of the format's group sizes and divides K."""
    _require(group_scales.dim() == 2 and group_scales.shape[1] > 0,
             f"{fmt.title} group_scales must be 2-D [N, K/g], got {tuple(group_scales.shape)}")
    k, cols = codes.shape[1] * 2, group_scales.shape[1]
    g = k // cols
    _require(g * cols == k, f"{fmt.title}: K={k} is not a whole number of groups for {cols} scale columns "
                            f"(K must be a multiple of the group size, one of {fmt.group_sizes})")
    fmt.check_k(k, g)
    return g


def check_source(codes, group_scales, zero_points=None, fmt: WeightFormat | None = None) -> tuple[int, int, int]:
    """Validate a canonical source; returns (N, K, group size)."""
    fmt = fmt or _fmt_for(zero_points)
    _require(codes.dtype == torch.uint8 and codes.dim() == 2,
             f"{fmt.title} codes must be uint8 [N, K/2], got {codes.dtype} {tuple(codes.shape)}")
    _require(group_scales.dtype == torch.float16,
             f"{fmt.title} group_scales must be float16, got {group_scales.dtype} (the convention unpackers "
             "convert bf16 / fp32 scales exactly)")
    n = codes.shape[0]
    _require(group_scales.shape[0] == n, f"{fmt.title} group_scales must have N={n} rows, got {tuple(group_scales.shape)}")
    g = group_size_of(codes, group_scales, fmt)
    k = codes.shape[1] * 2
    if fmt.has_zero_points:
        _require(zero_points is not None, f"{fmt.title} needs zero_points uint8 [N, K/g]")
        _require(zero_points.dtype == torch.uint8 and tuple(zero_points.shape) == tuple(group_scales.shape),
                 f"{fmt.title} zero_points must be uint8 {tuple(group_scales.shape)}, got "
                 f"{zero_points.dtype} {tuple(zero_points.shape)}")
        if zero_points.numel():
            _require(int(zero_points.max()) <= 15, f"{fmt.title} zero points must be 0..15, found {int(zero_points.max())}")
    else:
        _require(zero_points is None, f"{fmt.title} has no zero_points (its zero point is {SYM_ZERO})")
    return n, k, g


def _zeros_or_sym(zero_points, like: torch.Tensor) -> torch.Tensor:
    if zero_points is None:
        return torch.full(like.shape, SYM_ZERO, dtype=torch.uint8, device=like.device)
    return zero_points


def dequantize(codes, group_scales, zero_points=None) -> torch.Tensor:
    """Canonical source -> float32 [N, K] = (code - zero) * scale, exact (|code - zero| <= 15 times
    a float16 fits float32's significand)."""
    n, k, g = check_source(codes, group_scales, zero_points)
    q = unpack_codes(codes).to(torch.float32).view(n, k // g, g)
    z = _zeros_or_sym(zero_points, group_scales).to(torch.float32)
    return ((q - z.unsqueeze(-1)) * group_scales.to(torch.float32).unsqueeze(-1)).view(n, k)


def dequantize_f64(codes, group_scales, zero_points=None) -> torch.Tensor:
    return dequantize(codes, group_scales, zero_points).double()  # already exact


def quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> tuple:
    """float [N, K] -> canonical source (min/max per group; the scale is rounded to float16 FIRST
    and the codes computed against that float16 scale, so the stored triple dequantizes to the
    nearest grid point of the scale it actually carries).

    asymmetric: scale = (max - min) / 15, zero = round(-min / scale) clamped to 0..15;
    symmetric:  scale = amax / 8 when the most negative value sets amax, else amax / 7 (the grid is
    -8..7 around the zero point 8). A group of zeros gets scale 1 (any positive scale encodes it)."""
    fmt = formats.INT4_SYM if symmetric else formats.INT4
    _require(w.dim() == 2, f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    fmt.check_k(k, group_size)
    wf = w.detach().float().cpu().view(n, k // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    if symmetric:
        scale = torch.maximum(hi / 7.0, -lo / 8.0)
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # the grid must hold 0 exactly
        scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)
    sf = scale.float().unsqueeze(-1)
    if symmetric:
        zero = torch.full_like(lo, SYM_ZERO)
    else:
        zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.clamp(torch.round(wf / sf) + zero.unsqueeze(-1), 0, 15).to(torch.uint8).view(n, k)
    codes = pack_codes(q)
    if symmetric:
        return codes, scale
    return codes, scale, zero.to(torch.uint8)


# ------------------------------------------------------------------- checkpoint conventions
def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles, standard order (nibble i = bits 4i..4i+3), as a new axis
    right after ``dim`` (int64). Arithmetic shifts of negative words are masked, so sign is moot."""
    _require(words.dtype == torch.int32, f"packed INT4 tensors must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    w = words.unsqueeze(dim + 1)
    view = [1] * w.dim()
    view[dim + 1] = 8
    return ((w >> shifts.view(view)) & 0xF).to(torch.int64)


def _f16_scales(s: torch.Tensor, what: str) -> torch.Tensor:
    """Scales as float16, refusing any value float16 does not hold exactly (bf16 / fp32 scales
    of real checkpoints fit; a silent rounding would change every weight of the group)."""
    s = torch.as_tensor(s)
    _require(s.is_floating_point(), f"{what} must be floating point, got {s.dtype}")
    if s.dtype == torch.float16:
        return s.contiguous()
    s16 = s.to(torch.float16)
    _require(bool((s16.to(s.dtype) == s).all()),
             f"{what} ({s.dtype}) holds values float16 cannot represent exactly; QPN's INT4 kernels "
             "read float16 scales and would change the weights")
    return s16.contiguous()


def _group_size(group_size: int, k: int, fmt: WeightFormat, what: str) -> int:
    g = int(group_size)
    _require(g > 0, f"{what}: group size {group_size} (per channel) is not an INT4 group size QPN packs "
                    f"({', '.join(map(str, fmt.group_sizes))})")
    fmt.check_k(k, g)
    return g


def apply_g_idx(group_scales, zero_points, g_idx, group_size: int, module: str | None = None):
    """Scales [N, G] and zeros (or None) indexed by a checkpoint's g_idx (input -> group) ->
    the same in input order, group b covering inputs b*g .. b*g+g-1.

    A g_idx that is constant on every aligned block of g inputs (the trivial i // g, or whole
    groups stored out of order) only moves scale columns: exact, no runtime cost. One that
    scatters inputs of a group across blocks (GPTQ desc_act / act-order "group") would need the
    activations permuted in every forward, which the kernels do not do: ActOrderError."""
    if g_idx is None:
        return group_scales, zero_points
    gi = torch.as_tensor(g_idx).to(torch.int64).reshape(-1).cpu()
    n, cols = group_scales.shape
    k = cols * group_size
    where = f" in {module}" if module else ""
    _require(gi.numel() == k, f"g_idx{where} has {gi.numel()} entries, expected K={k}")
    _require(gi.numel() == 0 or (int(gi.min()) >= 0 and int(gi.max()) < cols),
             f"g_idx{where} names groups outside 0..{cols - 1}")
    blocks = gi.view(cols, group_size)
    first = blocks[:, :1]
    if not bool((blocks == first).all()):
        b = int(torch.nonzero((blocks != first).any(1))[0])
        raise ActOrderError(
            f"activation-ordered INT4 weight{where}: g_idx mixes groups inside inputs {b * group_size}.."
            f"{b * group_size + group_size - 1} (desc_act / actorder=group). QPN's kernels read inputs in "
            "checkpoint order and cannot permute activations; re-export without act-order (static / "
            "desc_act=False) or serve this module unquantized")
    order = first.reshape(-1).to(group_scales.device)
    if torch.equal(order.cpu(), torch.arange(cols)):
        return group_scales, zero_points
    s = group_scales.index_select(1, order).contiguous()
    z = None if zero_points is None else zero_points.index_select(1, order).contiguous()
    return s, z


def from_awq(qweight, qzeros, scales, group_size):
    """AutoAWQ (GEMM) -> canonical (codes, group_scales, zero_points).

    qweight int32 [K, N/8] and qzeros int32 [K/g, N/8] pack 8 output columns per word in AWQ's
    order (nibble j holds column 8c + AWQ_ORDER[j]); scales float16 [K/g, N]; w = (q - z) * s."""
    _require(qweight.dim() == 2 and qzeros.dim() == 2 and scales.dim() == 2,
             "AWQ qweight, qzeros and scales must be 2-D")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = _group_size(group_size, k, formats.INT4, "AWQ")
    _require(tuple(scales.shape) == (k // g, n), f"AWQ scales must be [K/g, N] = {(k // g, n)}, got {tuple(scales.shape)}")
    _require(tuple(qzeros.shape) == (k // g, n // 8),
             f"AWQ qzeros must be [K/g, N/8] = {(k // g, n // 8)}, got {tuple(qzeros.shape)}")
    # nibble j holds column AWQ_ORDER[j]: column i sits at nibble AWQ_ORDER.index(i)
    col_to_nibble = torch.tensor([AWQ_ORDER.index(i) for i in range(8)], device=qweight.device)
    q = _nibbles(qweight, 1).index_select(2, col_to_nibble).reshape(k, n)
    z = _nibbles(qzeros, 1).index_select(2, col_to_nibble).reshape(k // g, n)
    s = _f16_scales(scales, "AWQ scales").t().contiguous()
    return pack_codes(q.t()), s, z.t().to(torch.uint8).contiguous()


def from_gptq(qweight, qzeros, scales, g_idx, group_size, sym, *, v2: bool = False, module: str | None = None):
    """AutoGPTQ / GPTQModel -> canonical: (codes, group_scales) when ``sym``, else with zero_points.

    qweight int32 [K/8, N] packs 8 consecutive INPUTS per word (standard order: nibble i = input
    8r + i); qzeros int32 [K/g, N/8] packs 8 output columns (standard order); scales [K/g, N];
    g_idx int32 [K] or None. Symmetric (uint4b8): the zero point is 8 and qzeros is not read, as
    vLLM does. Asymmetric: the GPTQ v1 format stores zero - 1 (``v2=True``: the zero itself);
    a v1 nibble 15 (zero 16, AutoGPTQ's wrap of zero 0) is refused. Act-order: see apply_g_idx."""
    _require(qweight.dim() == 2 and scales.dim() == 2, "GPTQ qweight and scales must be 2-D")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    fmt = formats.INT4_SYM if sym else formats.INT4
    g = _group_size(group_size, k, fmt, f"GPTQ{' ' + module if module else ''}")
    _require(tuple(scales.shape) == (k // g, n), f"GPTQ scales must be [K/g, N] = {(k // g, n)}, got {tuple(scales.shape)}")
    q = _nibbles(qweight, 0).reshape(k, n)
    s = _f16_scales(scales, "GPTQ scales").t().contiguous()
    z = None
    if not sym:
        _require(qzeros is not None and tuple(qzeros.shape) == (k // g, n // 8),
                 f"GPTQ qzeros must be [K/g, N/8] = {(k // g, n // 8)}, got "
                 f"{None if qzeros is None else tuple(qzeros.shape)}")
        z = _nibbles(qzeros, 1).reshape(k // g, n) + (0 if v2 else 1)
        if z.numel() and int(z.max()) > 15:
            raise FormatError(f"GPTQ v1 zero point 16 (stored nibble 15){' in ' + module if module else ''}: "
                              "AutoGPTQ's v1 packing wraps zero 0 to 15, ambiguous; convert to the v2 format")
        z = z.t().to(torch.uint8).contiguous()
    s, z = apply_g_idx(s, z, g_idx, g, module)
    codes = pack_codes(q.t())
    return (codes, s) if sym else (codes, s, z)


def from_pack_quantized(weight_packed, weight_scale, weight_zero_point, group_size, *, g_idx=None,
                        module: str | None = None):
    """compressed-tensors pack-quantized (num_bits 4, strategy group) -> canonical.

    weight_packed int32 [N, K/8]: nibble i of word j holds input 8j + i as the signed value + 8
    (compressed_tensors' pack_to_int32 offset), which is exactly the unsigned code; weight_scale
    [N, K/g]; weight_zero_point int32 [ceil(N/8), K/g] packed along N with the same +8 offset, or
    None when symmetric (then zero 8 = signed 0). w = (q_signed - z_signed) * s = (code - zero) * s."""
    _require(weight_packed.dim() == 2 and weight_scale.dim() == 2,
             "compressed-tensors weight_packed and weight_scale must be 2-D")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    fmt = formats.INT4 if weight_zero_point is not None else formats.INT4_SYM
    g = _group_size(group_size, k, fmt, f"compressed-tensors{' ' + module if module else ''}")
    _require(tuple(weight_scale.shape) == (n, k // g),
             f"compressed-tensors weight_scale must be [N, K/g] = {(n, k // g)}, got {tuple(weight_scale.shape)}")
    q = _nibbles(weight_packed, 1).reshape(n, k)
    s = _f16_scales(weight_scale, "compressed-tensors weight_scale")
    z = None
    if weight_zero_point is not None:
        _require(tuple(weight_zero_point.shape) == (-(-n // 8), k // g),
                 f"compressed-tensors weight_zero_point must be [ceil(N/8), K/g] = {(-(-n // 8), k // g)}, "
                 f"got {tuple(weight_zero_point.shape)}")
        z = _nibbles(weight_zero_point, 0).reshape(-1, k // g)[:n].to(torch.uint8).contiguous()
    s, z = apply_g_idx(s, z, g_idx, g, module)
    codes = pack_codes(q)
    return (codes, s) if z is None else (codes, s, z)


# ------------------------------------------------------------------------- fragment maps
@lru_cache(maxsize=None)
def code_gather(atom: str) -> torch.Tensor:
    """Packed nibble p of a (tile, k-block) <- element code_gather[p] of the flattened
    [tile_n, k_block] source block (nibbles 2j / 2j+1 are the low / high nibble of byte j)."""
    geo = geometry(atom)
    flat = []
    if atom == "m8n8k4":
        for l in range(32):
            row = 8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4)
            for w in range(4):
                for j in range(8):
                    flat.append(row * geo.k_block + 8 * w + WORD_ORDER[j])
    elif atom == "m16n8k16":
        for l in range(32):
            g, t = l >> 2, l & 3
            for s in range(4):
                for j in range(8):
                    r, hi = j & 3, j >> 2
                    flat.append((g + 8 * (r & 1)) * geo.k_block + 16 * t + 4 * s + 2 * (r >> 1) + hi)
    else:
        raise ValueError(f"no INT4 fragment map for atom {atom!r}")
    if sorted(flat) != list(range(geo.tile_n * geo.k_block)):
        raise AssertionError(f"{atom}: INT4 code map is not a permutation")
    return torch.tensor(flat, dtype=torch.long)


@lru_cache(maxsize=None)
def record_rows(atom: str) -> torch.Tensor:
    """Record slot s of a (tile, group) holds the scale (and zero) of tile row record_rows[s]."""
    if atom == "m8n8k4":
        rows = [8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4) for l in range(32)]
    elif atom == "m16n8k16":
        rows = [g + 8 * h for g in range(8) for h in range(2)]
    else:
        raise ValueError(f"no INT4 scale map for atom {atom!r}")
    if sorted(rows) != list(range(geometry(atom).tile_n)):
        raise AssertionError(f"{atom}: INT4 record map is not a permutation")
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------- packed weight
@dataclass
class PackedINT4(PackedLayout):
    codes: torch.Tensor       # uint8, flat, fragment order
    scales: torch.Tensor      # uint8, flat: per (tile, group) records (scale bytes [, zero, 0])
    out_scale: torch.Tensor   # float32 [1] = 1: the family has no output scale; kernels' epilogue reads one
    n: int
    k: int
    group_size: int
    symmetric: bool
    atom: str = "m8n8k4"

    fmt = formats.INT4.family

    @property
    def format_key(self) -> str:
        """Which member of the family (formats.format_of asks this instead of the family name)."""
        return (formats.INT4_SYM if self.symmetric else formats.INT4).key

    @property
    def record_bytes(self) -> int:
        return 2 if self.symmetric else 4

    @property
    def groups_pad(self) -> int:
        return -(-self.k_pad // self.group_size)


def prepack_int4(codes, group_scales, zero_points=None, atom: str = "m8n8k4",
                 rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> PackedINT4:
    """Canonical source -> PackedINT4 on the source's device (only addresses move)."""
    n, k, g = check_source(codes, group_scales, zero_points)
    geo = geometry(atom)
    tile, kbk = geo.tile_n, geo.k_block
    sym = zero_points is None
    packed = PackedINT4(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8),
                        torch.ones(1, dtype=torch.float32, device=codes.device), n, k, g, sym, atom)
    n_pad, k_pad, gp, rec = packed.n_pad, packed.k_pad, packed.groups_pad, packed.record_bytes
    tiles, kblocks = n_pad // tile, k_pad // kbk
    code_bytes = tile * kbk // 2
    dev = codes.device
    gather = code_gather(atom).to(dev)
    rows_of = record_rows(atom).to(dev)
    codes_out = torch.empty(tiles * kblocks * code_bytes, dtype=torch.uint8, device=dev)
    scales_out = torch.empty(tiles * gp * tile * rec, dtype=torch.uint8, device=dev)
    bits = group_scales.view(torch.int16).to(torch.int32)
    step = _chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        rows, t0, t1 = r1 - r0, r0 // tile, r1 // tile
        q = _pad2d(unpack_codes(codes[r0:min(r1, n)]), rows, k_pad)
        blk = _to_blocks(q, tile, kbk).index_select(2, gather)
        codes_out[t0 * kblocks * code_bytes: t1 * kblocks * code_bytes] = \
            (blk[..., 0::2] | (blk[..., 1::2] << 4)).reshape(-1)
        recs = torch.zeros((rows, gp, rec), dtype=torch.uint8, device=dev)
        b = bits[r0:min(r1, n)]
        recs[: b.shape[0], : b.shape[1], 0] = (b & 0xFF).to(torch.uint8)
        recs[: b.shape[0], : b.shape[1], 1] = ((b >> 8) & 0xFF).to(torch.uint8)
        if not sym:
            recs[: b.shape[0], : b.shape[1], 2] = zero_points[r0:min(r1, n)]
        recs = recs.view(t1 - t0, tile, gp, rec).index_select(1, rows_of).permute(0, 2, 1, 3)
        scales_out[t0 * gp * tile * rec: t1 * gp * tile * rec] = recs.reshape(-1)
    packed.codes, packed.scales = codes_out, scales_out
    return packed


def _unprepack_rows(packed: PackedINT4, r0: int, r1: int):
    """Canonical (codes, scales, zeros or None) of rows [r0, r1) (tile-aligned r0), r1 clipped to N."""
    geo = geometry(packed.atom)
    tile, kbk = geo.tile_n, geo.k_block
    kblocks, gp, rec = packed.k_pad // kbk, packed.groups_pad, packed.record_bytes
    code_bytes = tile * kbk // 2
    t0, t1 = r0 // tile, -(-r1 // tile)
    dev = packed.codes.device
    raw = packed.codes[t0 * kblocks * code_bytes: t1 * kblocks * code_bytes].view(t1 - t0, kblocks, code_bytes)
    nib = torch.empty((t1 - t0, kblocks, code_bytes * 2), dtype=torch.uint8, device=dev)
    nib[..., 0::2] = raw & 0x0F
    nib[..., 1::2] = raw >> 4
    scatter = torch.argsort(code_gather(packed.atom)).to(dev)
    q = _from_blocks(nib.index_select(2, scatter), tile, kbk)[: r1 - r0, : packed.k]
    recs = packed.scales[t0 * gp * tile * rec: t1 * gp * tile * rec].view(t1 - t0, gp, tile, rec)
    recs = recs.permute(0, 2, 1, 3).index_select(1, torch.argsort(record_rows(packed.atom)).to(dev))
    recs = recs.reshape((t1 - t0) * tile, gp, rec)[: r1 - r0, : packed.k // packed.group_size]
    bits = recs[..., 0].to(torch.int32) | (recs[..., 1].to(torch.int32) << 8)
    bits = bits - ((bits >> 15) << 16)   # the same 16 bits as a signed value, so the int16 cast is exact
    s = bits.to(torch.int16).view(torch.float16).contiguous()
    z = None if packed.symmetric else recs[..., 2].contiguous()
    return pack_codes(q.contiguous()), s, z


def unprepack_int4(packed: PackedINT4, rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> tuple:
    """PackedINT4 -> the canonical source, byte-identical to what was packed."""
    geo = geometry(packed.atom)
    dev = packed.codes.device
    cols = packed.k // packed.group_size
    codes = torch.empty((packed.n, packed.k // 2), dtype=torch.uint8, device=dev)
    s = torch.empty((packed.n, cols), dtype=torch.float16, device=dev)
    z = None if packed.symmetric else torch.empty((packed.n, cols), dtype=torch.uint8, device=dev)
    step = _chunk_rows(rows_per_chunk, geo.tile_n)
    for r0 in range(0, packed.n, step):
        r1 = min(r0 + step, packed.n)
        c, sc, zz = _unprepack_rows(packed, r0, r1)
        codes[r0:r1], s[r0:r1] = c, sc
        if z is not None:
            z[r0:r1] = zz
    return (codes, s) if z is None else (codes, s, z)


_ONE_F32_BITS = 0x3F800000  # float32 1.0


def verify_int4_roundtrip(packed: PackedINT4, codes, group_scales, zero_points=None,
                          rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> None:
    """Raise PrepackMismatch naming the first differing byte unless unprepack(packed) equals the
    source (codes, scale bits, zero points) and the output scale the kernels read is 1.0, before
    the loader frees the source."""
    n, k, g = check_source(codes, group_scales, zero_points)
    if (n, k, g, zero_points is None) != (packed.n, packed.k, packed.group_size, packed.symmetric):
        raise PrepackMismatch(f"shape mismatch: packed is N={packed.n} K={packed.k} g={packed.group_size} "
                              f"{'sym' if packed.symmetric else 'asym'}, source is N={n} K={k} g={g} "
                              f"{'sym' if zero_points is None else 'asym'}")
    # The family has no output scale, but the kernels' epilogue multiplies by this one: anything
    # but float32 1.0 would scale every output, so it is compared like the source's own scales.
    out = packed.out_scale.reshape(-1)
    if out.numel() != 1 or out.dtype != torch.float32 or int(out.view(torch.int32)[0]) != _ONE_F32_BITS:
        raise PrepackMismatch(f"INT4 out_scale must be one float32 1.0 (the family has no output scale), "
                              f"the packed copy holds {out.tolist()} ({out.dtype}); re-pack from the source")
    dev = packed.codes.device
    step = _chunk_rows(rows_per_chunk, geometry(packed.atom).tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        c, s, z = _unprepack_rows(packed, r0, r1)
        pairs = [("codes", c, codes[r0:r1], k // 2),
                 ("group_scales (bits)", s.view(torch.int16), group_scales[r0:r1].view(torch.int16), k // g)]
        if z is not None:
            pairs.append(("zero_points", z, zero_points[r0:r1], k // g))
        for what, got, want, cols in pairs:
            d = _first_diff(got, want.to(dev))
            if d is not None:
                off, a, b = d
                raise PrepackMismatch(f"INT4 {what} differ after round trip at row {r0 + off // cols}, "
                                      f"column {off % cols}: got {a:#x}, source {b:#x}")


# ------------------------------------------------------------------------------ CPU reference
def decode_packed_int4(packed: PackedINT4) -> torch.Tensor:
    """Packed INT4 -> float32 [N, K] = (code - zero) * scale, read from the packed buffers."""
    return dequantize(*unprepack_int4(packed))


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"activations must be 2-D [M, K={k}], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"activations must be fp16, bf16 or fp32, got {x.dtype}")


def linear_int4(x: torch.Tensor, packed: PackedINT4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' semantics in float32: each weight is the FP16 operand the decoder makes,
    fp16((code - zero) * scale) (one rounding), products summed in FP32; FP16 output.
    (The row-by-row CPU batching rule of reference.py does not apply: this is not a serving path.)"""
    _check_x(x, packed.k)
    w = decode_packed_int4(packed).to(torch.float16).to(torch.float32)
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32).reshape(1, -1)
    return y.to(torch.float16)


def linear_int4_f64(x: torch.Tensor, packed: PackedINT4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact float64 y (not rounded) from the exact weights (code - zero) * scale."""
    _check_x(x, packed.k)
    y = x.double() @ decode_packed_int4(packed).double().t()
    if bias is not None:
        y = y + bias.double().reshape(1, -1)
    return y


# ---------------------------------------------------------------------------------- numerics
class INT4Numerics:
    packed_type = PackedINT4

    def __init__(self, fmt: WeightFormat = INT4) -> None:
        self.fmt = fmt

    def _src(self, codes, scales, zero_points):
        if self.fmt.has_zero_points and zero_points is None:
            raise FormatError(f"{self.fmt.title} needs zero_points (roles {self.fmt.roles})")
        return (codes, scales, zero_points if self.fmt.has_zero_points else None)

    # a source is (codes uint8 [N, K/2], group_scales float16 [N, K/g][, zero_points uint8 [N, K/g]])
    def decode_f64(self, codes, scales, zero_points=None) -> torch.Tensor:
        return dequantize_f64(*self._src(codes, scales, zero_points))

    def decode_f32(self, codes, scales, zero_points=None) -> torch.Tensor:
        return dequantize(*self._src(codes, scales, zero_points))

    def quantize(self, w: torch.Tensor, group_size: int | None = None) -> tuple:
        return quantize(w, group_size or self.fmt.group_size, symmetric=not self.fmt.has_zero_points)

    def prepack(self, codes, scales, zero_points=None, atom: str = "m8n8k4",
                rows_per_chunk: int | None = None) -> PackedINT4:
        return prepack_int4(*self._src(codes, scales, zero_points), atom=atom, rows_per_chunk=rows_per_chunk)

    def unprepack(self, packed: PackedINT4) -> tuple:
        return unprepack_int4(packed)

    def verify_roundtrip(self, packed, codes, scales, zero_points=None,
                         rows_per_chunk: int | None = None) -> None:
        verify_int4_roundtrip(packed, *self._src(codes, scales, zero_points), rows_per_chunk=rows_per_chunk)

    def reference_linear(self, x, packed, bias=None) -> torch.Tensor:
        return linear_int4(x, packed, bias)

    def reference_linear_f64(self, x, packed, bias=None) -> torch.Tensor:
        return linear_int4_f64(x, packed, bias)

    def decode_packed(self, packed) -> tuple[torch.Tensor, torch.Tensor]:
        w = decode_packed_int4(packed)
        return w, torch.ones(packed.n, dtype=torch.float32, device=w.device)

    def packed_tensors(self, packed):
        """(codes, records, out_scale); the records as one integer per record (int32 asymmetric,
        int16 symmetric), the same bytes: the kernel tensors then say which member they are, which
        the ops record of a weight (family, not member) otherwise loses."""
        return packed.codes, packed.scales.view(_RECORD_DTYPE[packed.symmetric]), packed.out_scale

    def packed_from_tensors(self, codes, scales, chscale, n, k, atom, group_size: int | None = None) -> PackedINT4:
        """A PackedINT4 around kernel tensors (the member from the records' dtype, packed_tensors;
        uint8 records: this numerics' member). The group size is not in the tensors' shapes
        alone for every K, so it is matched against the scales buffer's size for each of the
        format's group sizes; pass it to skip the search."""
        sym = not self.fmt.has_zero_points
        for member_sym, dtype in _RECORD_DTYPE.items():
            if scales.dtype == dtype:
                sym, scales = member_sym, scales.view(torch.uint8)
        probe = PackedINT4(codes, scales, chscale.reshape(1), n, k, 0, sym, atom)
        tiles = probe.n_pad // geometry(atom).tile_n
        fits = [g for g in ((group_size,) if group_size else self.fmt.group_sizes)
                if k % g == 0 and scales.numel() == tiles * -(-probe.k_pad // g) * geometry(atom).tile_n * probe.record_bytes]
        if len(fits) != 1:
            raise FormatError(f"{self.fmt.title}: a scales buffer of {scales.numel()} bytes fits group sizes {fits} "
                              f"for N={n} K={k} on {atom}; pass group_size")
        probe.group_size = fits[0]
        return probe

    # ---- stacked expert tensors [E, ...] in the canonical layout (the MoE methods do not serve
    # INT4 yet; these keep the numerics interface whole for the tests and the future methods)
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


# The family's numerics, as families.numerics hands them out (families.py finds this module by
# the family's name, formats.ALL_FAMILIES).
NUMERICS = INT4Numerics
