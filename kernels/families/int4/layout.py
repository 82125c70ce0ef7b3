"""The INT4 family's packed layout: fragment maps per atom, the packed weight, prepack, its exact
inverse and the proof of that inverse.

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

from ...atoms import LANE_ROW_M8N8K4, geometry, permutation
from ...prepack import (DEFAULT_ROWS_PER_CHUNK, PackedLayout, PrepackMismatch, chunk_rows, first_diff, from_blocks,
                        pad2d, to_blocks)
from .codec import check_source, pack_codes, unpack_codes
from .members import INT4, INT4_SYM

WORD_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble j of a word holds input 8w + WORD_ORDER[j]


# ------------------------------------------------------------------------- fragment maps
@lru_cache(maxsize=None)
def code_gather(atom: str) -> torch.Tensor:
    """Packed nibble p of a (tile, k-block) <- element code_gather[p] of the flattened
    [tile_n, k_block] source block (nibbles 2j / 2j+1 are the low / high nibble of byte j)."""
    geo = geometry(atom)
    flat = []
    if atom == "m8n8k4":
        for l in range(32):
            row = LANE_ROW_M8N8K4[l]
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
    return permutation(flat, f"{atom}/INT4 codes", size=geo.tile_n * geo.k_block)[0]


@lru_cache(maxsize=None)
def record_rows(atom: str) -> torch.Tensor:
    """Record slot s of a (tile, group) holds the scale (and zero) of tile row record_rows[s]."""
    if atom == "m8n8k4":
        rows = list(LANE_ROW_M8N8K4)
    elif atom == "m16n8k16":
        rows = [g + 8 * h for g in range(8) for h in range(2)]
    else:
        raise ValueError(f"no INT4 scale map for atom {atom!r}")
    return permutation(rows, f"{atom}/INT4 records", size=geometry(atom).tile_n)[0]


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

    fmt = INT4.family

    @property
    def format_key(self) -> str:
        """Which member of the family (formats.format_of asks this instead of the family name)."""
        return (INT4_SYM if self.symmetric else INT4).key

    @property
    def record_bytes(self) -> int:
        return 2 if self.symmetric else 4

    @property
    def groups_pad(self) -> int:
        return -(-self.k_pad // self.group_size)


def prepack(codes, group_scales, zero_points=None, atom: str = "m8n8k4",
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
    step = chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        rows, t0, t1 = r1 - r0, r0 // tile, r1 // tile
        q = pad2d(unpack_codes(codes[r0:min(r1, n)]), rows, k_pad)
        blk = to_blocks(q, tile, kbk).index_select(2, gather)
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
    q = from_blocks(nib.index_select(2, scatter), tile, kbk)[: r1 - r0, : packed.k]
    recs = packed.scales[t0 * gp * tile * rec: t1 * gp * tile * rec].view(t1 - t0, gp, tile, rec)
    recs = recs.permute(0, 2, 1, 3).index_select(1, torch.argsort(record_rows(packed.atom)).to(dev))
    recs = recs.reshape((t1 - t0) * tile, gp, rec)[: r1 - r0, : packed.k // packed.group_size]
    bits = recs[..., 0].to(torch.int32) | (recs[..., 1].to(torch.int32) << 8)
    bits = bits - ((bits >> 15) << 16)   # the same 16 bits as a signed value, so the int16 cast is exact
    s = bits.to(torch.int16).view(torch.float16).contiguous()
    z = None if packed.symmetric else recs[..., 2].contiguous()
    return pack_codes(q.contiguous()), s, z


def unprepack(packed: PackedINT4, rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> tuple:
    """PackedINT4 -> the canonical source, byte-identical to what was packed."""
    geo = geometry(packed.atom)
    dev = packed.codes.device
    cols = packed.k // packed.group_size
    codes = torch.empty((packed.n, packed.k // 2), dtype=torch.uint8, device=dev)
    s = torch.empty((packed.n, cols), dtype=torch.float16, device=dev)
    z = None if packed.symmetric else torch.empty((packed.n, cols), dtype=torch.uint8, device=dev)
    step = chunk_rows(rows_per_chunk, geo.tile_n)
    for r0 in range(0, packed.n, step):
        r1 = min(r0 + step, packed.n)
        c, sc, zz = _unprepack_rows(packed, r0, r1)
        codes[r0:r1], s[r0:r1] = c, sc
        if z is not None:
            z[r0:r1] = zz
    return (codes, s) if z is None else (codes, s, z)


_ONE_F32_BITS = 0x3F800000  # float32 1.0


def verify_roundtrip(packed: PackedINT4, codes, group_scales, zero_points=None,
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
    step = chunk_rows(rows_per_chunk, geometry(packed.atom).tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        c, s, z = _unprepack_rows(packed, r0, r1)
        pairs = [("codes", c, codes[r0:r1], k // 2),
                 ("group_scales (bits)", s.view(torch.int16), group_scales[r0:r1].view(torch.int16), k // g)]
        if z is not None:
            pairs.append(("zero_points", z, zero_points[r0:r1], k // g))
        for what, got, want, cols in pairs:
            d = first_diff(got, want.to(dev))
            if d is not None:
                off, a, b = d
                raise PrepackMismatch(f"INT4 {what} differ after round trip at row {r0 + off // cols}, "
                                      f"column {off % cols}: got {a:#x}, source {b:#x}")
