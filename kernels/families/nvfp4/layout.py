"""The NVFP4 family's packed layout: fragment maps per atom, the packed weight, prepack, its exact
inverse and the proof of that inverse.

Packed layout (both atoms; m8n8k4: 32-row tiles x 32-input k-blocks, m16n8k16: 16-row tiles x
64-input k-blocks):
  codes:  [tiles, k_blocks, tile_n * k_block / 2] bytes, two e2m1 codes per byte, in the order of
          ``code_maps``
  scales: [tiles, k_blocks, tile_n * k_block / 16] e4m3 bytes, in the order of ``scale_maps``
  global_scale: float32 [1], the checkpoint's weight_scale_2 unchanged
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ... import codecs
from ...atoms import LANE_ROW_M8N8K4, geometry, permutation
from ...prepack import (DEFAULT_ROWS_PER_CHUNK, PackedLayout, PrepackMismatch, chunk_rows, first_diff, from_blocks,
                        pad2d, to_blocks)
from . import codec
from .members import GROUP_SIZE, NVFP4


# ------------------------------------------------------------------------- fragment maps
@lru_cache(maxsize=None)
def code_maps(atom: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, scatter) over a flattened [tile_n, k_block] tile-block of e2m1 codes (packed
    nibble p <- source element gather[p]; nibbles 2j / 2j+1 are the low / high nibble of byte j).

    m8n8k4: a 32-bit word (little-endian, nibble i = bits 4i..4i+3) holds 8 codes of 8 consecutive
    k. The decoder builds the half2 (k0, k1) from nibbles 3 and 7 (the top nibble of each 16-bit
    half), then shifts the word left by 4 for (k2, k3), (k4, k5), (k6, k7); so nibbles 0..7 hold
    k6, k4, k2, k0, k7, k5, k3, k1. A lane's 16 bytes per k-block of 32 are its row's 32 codes.

    m16n8k16: MMA step s (0..3) is NVFP4 group s: k-slot 2t+j (j = 0, 1) is input 16s + 4t + j and
    k-slot 2t+8+j is input 16s + 4t + 2 + j. One group per MMA keeps products of different group
    scales out of one tensor-core sum (its limited alignment precision would round small products
    off next to large cancelling ones: the FP16-overflow trap). Word s of lane (g, t) feeds step s;
    the decoder builds half2 r from nibbles 3-r (low half) and 7-r (high half), half2 r being
    a0..a3 = (g, k0 k1), (g+8, k0 k1), (g, k2 k3), (g+8, k2 k3) with k0..k3 = 16s + 4t + 0..3.
    """
    geo = geometry(atom)
    flat = []
    if atom == "m8n8k4":
        word_order = (6, 4, 2, 0, 7, 5, 3, 1)
        for row in LANE_ROW_M8N8K4:
            flat += [row * geo.k_block + 8 * w + word_order[j] for w in range(4) for j in range(8)]
    elif atom == "m16n8k16":
        for l in range(32):
            g, t = l >> 2, l & 3
            flat += [(g + 8 * (j % 2 == 0)) * geo.k_block + 16 * s + 4 * t + (j >> 2) + 2 * ((j & 3) < 2)
                     for s in range(4) for j in range(8)]
    else:
        raise ValueError(f"no NVFP4 code map for atom {atom!r}")
    return permutation(flat, f"{atom}/NVFP4 codes")


@lru_cache(maxsize=None)
def scale_maps(atom: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, scatter) over a flattened [tile_n, k_block / 16] tile-block of e4m3 group scales.

    m8n8k4: the group scale is folded into the lane's A operand (m8n8k4.cuh), so lane l
    needs, per k-block, the two group scales of ITS row: bytes 2l (group 0), 2l+1 (group 1).
    m16n8k16: lane (g, t) needs the scales of rows g, g+8 for all four groups of the k-block:
    bytes 8g .. 8g+7 = (g, grp 0), (g+8, grp 0), (g, grp 1), ...
    """
    gpb = geometry(atom).k_block // GROUP_SIZE
    if atom == "m8n8k4":
        flat = [row * gpb + j for row in LANE_ROW_M8N8K4 for j in range(gpb)]
    elif atom == "m16n8k16":
        flat = [(g + 8 * h) * gpb + grp for g in range(8) for grp in range(4) for h in range(2)]
    else:
        raise ValueError(f"no NVFP4 scale map for atom {atom!r}")
    return permutation(flat, f"{atom}/NVFP4 scales")


# ---------------------------------------------------------------------------- packed weight
@dataclass
class PackedNVFP4(PackedLayout):
    codes: torch.Tensor         # uint8, flat, fragment order
    scales: torch.Tensor        # uint8 (e4m3 bytes), flat, fragment order
    global_scale: torch.Tensor  # float32, 1 element (weight_scale_2)
    n: int
    k: int
    atom: str = "m8n8k4"

    fmt = NVFP4.family


def prepack(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
            atom: str = "m8n8k4", rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> PackedNVFP4:
    """Checkpoint NVFP4 (uint8 [N, K/2], e4m3 [N, K/16], float32 scalar) -> PackedNVFP4 (same device)."""
    n, k = codec.check_source(weight_u8, weight_scale, weight_scale_2)
    g = geometry(atom)
    tile, kbk = g.tile_n, g.k_block
    gpb = kbk // GROUP_SIZE
    n_pad, k_pad = -(-n // tile) * tile, -(-k // kbk) * kbk
    tiles, kblocks = n_pad // tile, k_pad // kbk
    code_bytes = tile * kbk // 2
    scale_bytes = tile * gpb
    gather_c, _ = code_maps(atom)
    gather_s, _ = scale_maps(atom)
    dev = weight_u8.device
    gather_c, gather_s = gather_c.to(dev), gather_s.to(dev)
    codes_out = torch.empty(tiles * kblocks * code_bytes, dtype=torch.uint8, device=dev)
    scales_out = torch.empty(tiles * kblocks * scale_bytes, dtype=torch.uint8, device=dev)
    sc_src = codecs.as_e4m3_bytes(weight_scale)
    step = chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        rows = r1 - r0
        t0 = r0 // tile
        codes = codec.unpack_codes(weight_u8[r0:min(r1, n)])
        codes = pad2d(codes, rows, k_pad)
        blk = to_blocks(codes, tile, kbk).index_select(2, gather_c)      # [t, kb, 1024] nibbles
        packed = blk[..., 0::2] | (blk[..., 1::2] << 4)
        codes_out[t0 * kblocks * code_bytes: (r1 // tile) * kblocks * code_bytes] = packed.reshape(-1)
        sc = pad2d(sc_src[r0:min(r1, n)], rows, k_pad // GROUP_SIZE)
        sblk = to_blocks(sc, tile, gpb).index_select(2, gather_s)
        scales_out[t0 * kblocks * scale_bytes: (r1 // tile) * kblocks * scale_bytes] = sblk.reshape(-1)
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(1).clone().to(dev)
    return PackedNVFP4(codes_out, scales_out, gs, n, k, atom)


def _unprepack_rows(packed: PackedNVFP4, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source bytes of rows [r0, r1) (tile-aligned r0); r1 clipped to N."""
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    gpb = kbk // GROUP_SIZE
    kblocks = packed.k_pad // kbk
    code_bytes, scale_bytes = tile * kbk // 2, tile * gpb
    _, scatter_c = code_maps(packed.atom)
    _, scatter_s = scale_maps(packed.atom)
    t0, t1 = r0 // tile, -(-r1 // tile)
    raw = packed.codes[t0 * kblocks * code_bytes: t1 * kblocks * code_bytes].view(t1 - t0, kblocks, code_bytes)
    nib = torch.empty((t1 - t0, kblocks, code_bytes * 2), dtype=torch.uint8, device=raw.device)
    nib[..., 0::2] = raw & 0x0F
    nib[..., 1::2] = raw >> 4
    codes = from_blocks(nib.index_select(2, scatter_c.to(raw.device)), tile, kbk)
    codes = codes[: r1 - r0, : packed.k]
    sraw = packed.scales[t0 * kblocks * scale_bytes: t1 * kblocks * scale_bytes].view(t1 - t0, kblocks, scale_bytes)
    sc = from_blocks(sraw.index_select(2, scatter_s.to(raw.device)), tile, gpb)
    sc = sc[: r1 - r0, : packed.k // GROUP_SIZE]
    return codec.pack_codes(codes.contiguous()), sc.contiguous()


def unprepack(packed: PackedNVFP4, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """PackedNVFP4 -> (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16]), byte-identical."""
    g = geometry(packed.atom)
    w = torch.empty((packed.n, packed.k // 2), dtype=torch.uint8, device=packed.codes.device)
    s = torch.empty((packed.n, packed.k // GROUP_SIZE), dtype=torch.uint8, device=packed.codes.device)
    step = chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, packed.n, step):
        r1 = min(r0 + step, packed.n)
        w[r0:r1], s[r0:r1] = _unprepack_rows(packed, r0, r1)
    return w, s.view(torch.float8_e4m3fn)


def _check_global_scale(packed: PackedNVFP4, weight_scale_2) -> None:
    src = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(-1).to(packed.global_scale.device)
    held = packed.global_scale.reshape(-1)
    if src.numel() != 1 or held.numel() != 1:
        raise PrepackMismatch(f"NVFP4 weight_scale_2 must be one float32 value, got {src.numel()} in the "
                              f"source and {held.numel()} in the packed copy")
    # bits, not values: the kernels multiply by exactly this float32
    if not torch.equal(src.view(torch.int32), held.view(torch.int32)):
        raise PrepackMismatch(
            f"NVFP4 weight_scale_2 (global scale) differs after round trip: {float(held[0])!r} in the "
            f"packed copy, {float(src[0])!r} in the source; the packed copy must carry the "
            "checkpoint's global scale unchanged")


def verify_roundtrip(packed: PackedNVFP4, weight_u8: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2=None, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> None:
    """Raise PrepackMismatch naming the first differing byte unless unprepack(packed) equals the
    source: every code byte, every group-scale byte and, when ``weight_scale_2`` is given, the
    global scale's float32 bits. The loader and the MoE path always give it (through
    NVFP4Numerics.verify_roundtrip, which requires it); callers that check the permutation
    alone may leave it out."""
    n, k = codec.check_source(weight_u8, weight_scale)
    if (n, k) != (packed.n, packed.k):
        raise PrepackMismatch(f"shape mismatch: packed is N={packed.n} K={packed.k}, source is N={n} K={k}")
    if weight_scale_2 is not None:
        _check_global_scale(packed, weight_scale_2)
    sc_src = codecs.as_e4m3_bytes(weight_scale)
    g = geometry(packed.atom)
    step = chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        w, s = _unprepack_rows(packed, r0, r1)
        d = first_diff(w, weight_u8[r0:r1].to(w.device))
        if d is not None:
            off, got, want = d
            row, col = r0 + off // (k // 2), off % (k // 2)
            raise PrepackMismatch(
                f"NVFP4 weight byte differs after round trip at offset {r0 * (k // 2) + off} "
                f"(row {row}, byte {col}): got 0x{got:02x}, source 0x{want:02x}")
        d = first_diff(s, sc_src[r0:r1].to(s.device))
        if d is not None:
            off, got, want = d
            gpr = k // GROUP_SIZE
            raise PrepackMismatch(
                f"NVFP4 weight_scale byte differs after round trip at offset {r0 * gpr + off} "
                f"(row {r0 + off // gpr}, group {off % gpr}): got 0x{got:02x}, source 0x{want:02x}")
