"""The INT8 family's packed layout: fragment maps per atom, the packed weight, prepack, its exact
inverse and the proof of that inverse.

Packed layout (per warp tile of ``tile_n`` rows; the k-block of the atom as for FP8 and INT4):
  codes:  [tiles, k_blocks, tile_n * k_block] bytes; every lane owns 32 contiguous bytes (two
          16-byte loads per k-block) = eight 32-bit words of 4 codes each, the FP8 family's
          code bytes per lane.
  scales: [tiles, groups_pad, tile_n, rec] bytes, rec = 4 (asymmetric: scale low byte, scale high
          byte, zero point, 0) or 2 (symmetric: the scale's two bytes); one record per row and
          group, in the atom's slot order, so a lane fetches its scale AND zero point with one
          aligned 32-bit load (or 16-bit, symmetric): INT4's records, the same bytes and slots.
          groups_pad = ceil(k_pad / group_size).
``group_size`` of a packed weight is the inputs one record spans: the source's group, or for a
per-channel source (one scale column) ``record_span(k_pad)``, the padded K rounded up to a power
of two, so that both atoms' kernels map every k-block to record 0 (members.py says why).

Decoding a 32-bit word in registers (both atoms): code bytes b and b + 1 of a word become one
half2 with one PRMT, each byte under 0x64 as the low byte of a half: 0x64XX is 1024 + XX exactly
(FP16's spacing is 1 in [1024, 2048)); ``hsub2`` with (1024 + zero) leaves the exact integers
code - zero (-255..255) in FP16, and ``hmul2`` by the group scale rounds once: fp16((code - zero)
* scale), the operand the reference (``linear``) models.

Fragment map m8n8k4 (SM70 HMMA.884, weights on A, lane row = 8 * ((l >> 2) & 3) + (l & 3) +
4 * (l >> 4), as NVFP4, FP8 and INT4): per k-block of 32 the lane's 32 bytes are its row's 32
codes in input order, so word w holds inputs 4w .. 4w + 3 (byte j = input 4w + j) and MMA i (4
consecutive k) takes bytes (0, 1) and (2, 3) of word i as its two A registers. A group (>= 32)
spans whole k-blocks: one record per lane per group; record slot s of a (tile, group) is lane s's
row.

Fragment map m16n8k16 (sm_80+, A registers a0..a3 = (g, k0 k1), (g+8, k0 k1), (g, k2 k3),
(g+8, k2 k3) for lane (g = l >> 2, t = l & 3)): the FP8 family's map (k-slots of MMA step s are
inputs 16t + 4s + 0..3, so lane t supplies token inputs 16t .. 16t+15 in one 32-byte read). Step s
takes words 2s and 2s + 1: byte q of those 8 is row g + 8 ((q >> 1) & 1), input 16t + 4s + (q & 1)
+ 2 (q >> 2), so a0 = bytes 0-1, a1 = bytes 2-3, a2 = bytes 4-5, a3 = bytes 6-7. A lane's 16
inputs lie in one group (every group is a multiple of 16); record slot 2g + h of a (tile, group)
is row g + 8h, so lane (g, t) fetches its two rows' records with one 64-bit (asymmetric) or
32-bit (symmetric) load.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...atoms import LANE_ROW_M8N8K4, geometry, permutation
from ...prepack import (DEFAULT_ROWS_PER_CHUNK, PackedLayout, PrepackMismatch, chunk_rows, first_diff, from_blocks,
                        pad2d, to_blocks)
from .codec import CHANNEL, check_source
from .members import INT8, INT8_SYM


# ------------------------------------------------------------------------- fragment maps
@lru_cache(maxsize=None)
def code_gather(atom: str) -> torch.Tensor:
    """Packed byte p of a (tile, k-block) <- element code_gather[p] of the flattened
    [tile_n, k_block] source block."""
    geo = geometry(atom)
    flat = []
    if atom == "m8n8k4":
        for l in range(32):
            row = LANE_ROW_M8N8K4[l]
            flat += [row * geo.k_block + j for j in range(geo.k_block)]
    elif atom == "m16n8k16":
        for l in range(32):
            g, t = l >> 2, l & 3
            flat += [(g + 8 * ((q >> 1) & 1)) * geo.k_block + 16 * t + 4 * s + (q & 1) + 2 * (q >> 2)
                     for s in range(4) for q in range(8)]
    else:
        raise ValueError(f"no INT8 fragment map for atom {atom!r}")
    return permutation(flat, f"{atom}/INT8 codes", size=geo.tile_n * geo.k_block)[0]


@lru_cache(maxsize=None)
def record_rows(atom: str) -> torch.Tensor:
    """Record slot s of a (tile, group) holds the scale (and zero) of tile row record_rows[s]."""
    if atom == "m8n8k4":
        rows = list(LANE_ROW_M8N8K4)
    elif atom == "m16n8k16":
        rows = [g + 8 * h for g in range(8) for h in range(2)]
    else:
        raise ValueError(f"no INT8 record map for atom {atom!r}")
    return permutation(rows, f"{atom}/INT8 records", size=geometry(atom).tile_n)[0]


def record_span(k_pad: int) -> int:
    """Inputs the one record of a per-channel row spans: k_pad rounded up to a power of two (a
    power-of-two number of both atoms' lane runs, at least the padded K)."""
    return 1 << max(0, (k_pad - 1).bit_length())


# ---------------------------------------------------------------------------- packed weight
@dataclass
class PackedINT8(PackedLayout):
    codes: torch.Tensor       # uint8, flat, fragment order
    scales: torch.Tensor      # uint8, flat: per (tile, group) records (scale bytes [, zero, 0])
    out_scale: torch.Tensor   # float32 [1] = 1: the family has no output scale; kernels' epilogue reads one
    n: int
    k: int
    group_size: int           # inputs per record (a per-channel row: record_span(k_pad) >= K)
    symmetric: bool
    atom: str = "m8n8k4"

    fmt = INT8.family

    @property
    def format_key(self) -> str:
        """Which member of the family (formats.format_of asks this instead of the family name)."""
        return (INT8_SYM if self.symmetric else INT8).key

    @property
    def record_bytes(self) -> int:
        return 2 if self.symmetric else 4

    @property
    def groups_pad(self) -> int:
        return -(-self.k_pad // self.group_size)

    @property
    def scale_cols(self) -> int:
        """The source's scale columns: K / group, or 1 where the record spans all of K (per channel)."""
        return -(-self.k // self.group_size)

    @property
    def per_channel(self) -> bool:
        return self.scale_cols == 1


def packed_group_size(k: int, group_size: int, atom: str) -> int:
    """A packed weight's inputs per record for a source of K inputs and ``group_size`` (CHANNEL:
    the record spans the atom's padded K)."""
    if group_size != CHANNEL:
        return group_size
    b = geometry(atom).k_block
    return record_span(-(-k // b) * b)


def prepack(codes, group_scales, zero_points=None, atom: str = "m8n8k4",
            rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> PackedINT8:
    """Canonical source -> PackedINT8 on the source's device (only addresses move)."""
    n, k, g = check_source(codes, group_scales, zero_points)
    geo = geometry(atom)
    tile, kbk = geo.tile_n, geo.k_block
    sym = zero_points is None
    packed = PackedINT8(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8),
                        torch.ones(1, dtype=torch.float32, device=codes.device), n, k,
                        packed_group_size(k, g, atom), sym, atom)
    n_pad, k_pad, gp, rec = packed.n_pad, packed.k_pad, packed.groups_pad, packed.record_bytes
    tiles, kblocks = n_pad // tile, k_pad // kbk
    block = tile * kbk
    dev = codes.device
    gather = code_gather(atom).to(dev)
    rows_of = record_rows(atom).to(dev)
    codes_out = torch.empty(tiles * kblocks * block, dtype=torch.uint8, device=dev)
    scales_out = torch.empty(tiles * gp * tile * rec, dtype=torch.uint8, device=dev)
    bits = group_scales.view(torch.int16).to(torch.int32)
    step = chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        rows, t0, t1 = r1 - r0, r0 // tile, r1 // tile
        blk = to_blocks(pad2d(codes[r0:min(r1, n)], rows, k_pad), tile, kbk).index_select(2, gather)
        codes_out[t0 * kblocks * block: t1 * kblocks * block] = blk.reshape(-1)
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


def _unprepack_rows(packed: PackedINT8, r0: int, r1: int):
    """Canonical (codes, scales, zeros or None) of rows [r0, r1) (tile-aligned r0), r1 clipped to N."""
    geo = geometry(packed.atom)
    tile, kbk = geo.tile_n, geo.k_block
    kblocks, gp, rec = packed.k_pad // kbk, packed.groups_pad, packed.record_bytes
    block = tile * kbk
    t0, t1 = r0 // tile, -(-r1 // tile)
    dev = packed.codes.device
    raw = packed.codes[t0 * kblocks * block: t1 * kblocks * block].view(t1 - t0, kblocks, block)
    scatter = torch.argsort(code_gather(packed.atom)).to(dev)
    q = from_blocks(raw.index_select(2, scatter), tile, kbk)[: r1 - r0, : packed.k]
    recs = packed.scales[t0 * gp * tile * rec: t1 * gp * tile * rec].view(t1 - t0, gp, tile, rec)
    recs = recs.permute(0, 2, 1, 3).index_select(1, torch.argsort(record_rows(packed.atom)).to(dev))
    recs = recs.reshape((t1 - t0) * tile, gp, rec)[: r1 - r0, : packed.scale_cols]
    bits = recs[..., 0].to(torch.int32) | (recs[..., 1].to(torch.int32) << 8)
    bits = bits - ((bits >> 15) << 16)   # the same 16 bits as a signed value, so the int16 cast is exact
    s = bits.to(torch.int16).view(torch.float16).contiguous()
    z = None if packed.symmetric else recs[..., 2].contiguous()
    return q.contiguous(), s, z


def unprepack(packed: PackedINT8, rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> tuple:
    """PackedINT8 -> the canonical source, byte-identical to what was packed."""
    geo = geometry(packed.atom)
    dev = packed.codes.device
    cols = packed.scale_cols
    codes = torch.empty((packed.n, packed.k), dtype=torch.uint8, device=dev)
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


def verify_roundtrip(packed: PackedINT8, codes, group_scales, zero_points=None,
                     rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK) -> None:
    """Raise PrepackMismatch naming the first differing byte unless unprepack(packed) equals the
    source (codes, scale bits, zero points), the packed records span the source's groups and the
    output scale the kernels read is 1.0, before the loader frees the source."""
    n, k, g = check_source(codes, group_scales, zero_points)
    want_g = packed_group_size(k, g, packed.atom)
    if (n, k, want_g, zero_points is None) != (packed.n, packed.k, packed.group_size, packed.symmetric):
        raise PrepackMismatch(f"shape mismatch: packed is N={packed.n} K={packed.k} record span {packed.group_size} "
                              f"{'sym' if packed.symmetric else 'asym'}, source is N={n} K={k} record span {want_g} "
                              f"{'sym' if zero_points is None else 'asym'}")
    # The family has no output scale, but the kernels' epilogue multiplies by this one: anything
    # but float32 1.0 would scale every output, so it is compared like the source's own scales.
    out = packed.out_scale.reshape(-1)
    if out.numel() != 1 or out.dtype != torch.float32 or int(out.view(torch.int32)[0]) != _ONE_F32_BITS:
        raise PrepackMismatch(f"INT8 out_scale must be one float32 1.0 (the family has no output scale), "
                              f"the packed copy holds {out.tolist()} ({out.dtype}); re-pack from the source")
    dev = packed.codes.device
    cols = packed.scale_cols
    step = chunk_rows(rows_per_chunk, geometry(packed.atom).tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        c, s, z = _unprepack_rows(packed, r0, r1)
        pairs = [("codes", c, codes[r0:r1], k),
                 ("group_scales (bits)", s.view(torch.int16), group_scales[r0:r1].view(torch.int16), cols)]
        if z is not None:
            pairs.append(("zero_points", z, zero_points[r0:r1], cols))
        for what, got, want, width in pairs:
            d = first_diff(got, want.to(dev))
            if d is not None:
                off, a, b = d
                raise PrepackMismatch(f"INT8 {what} differ after round trip at row {r0 + off // width}, "
                                      f"column {off % width}: got {a:#x}, source {b:#x}")
