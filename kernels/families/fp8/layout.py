"""The FP8 family's packed layout: fragment maps per atom, the packed weight, prepack, its exact
inverse and the proof of that inverse.

Packed layout (both atoms): codes [tiles, k_blocks, tile_n * k_block] e4m3 bytes in the order of
``code_maps``; scale float32 [1] (per tensor) or [N] (per channel), the checkpoint's unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ... import codecs
from ...atoms import LANE_ROW_M8N8K4, geometry, permutation
from ...prepack import (DEFAULT_ROWS_PER_CHUNK, PackedLayout, PrepackMismatch, chunk_rows, first_diff, from_blocks,
                        pad2d, to_blocks)
from ...weight_format import FormatError
from . import codec
from .members import FP8_TENSOR


# ------------------------------------------------------------------------- fragment maps
@lru_cache(maxsize=None)
def code_maps(atom: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, scatter) over a flattened [tile_n, k_block] tile-block of e4m3 bytes (packed byte
    p <- source element gather[p]).

    m8n8k4: a 32-bit word holds 4 codes of 4 consecutive k; the decoder takes bytes (1, 3) for the
    half2 (k0, k1) and, after a left shift by 8, bytes (0, 2) for (k2, k3): bytes = k2, k0, k3, k1.
    A lane's 32 bytes per k-block of 32 are its row's 32 codes (two 16-byte loads).

    m16n8k16 (no groups): k-slot 2t+j of step s is input 16t + 4s + j, k-slot 2t+8+j is
    16t + 4s + 2 + j, so lane (g, t) supplies token g's inputs 16t .. 16t+15, one contiguous 32-byte
    read. Step s takes bytes q of its 8 (words 2s, 2s+1, little-endian): a0 = bytes 0-1 (g, k0 k1),
    a1 = bytes 2-3 (g+8, k0 k1), a2 = bytes 4-5 (g, k2 k3), a3 = bytes 6-7 (g+8, k2 k3).
    """
    geo = geometry(atom)
    flat = []
    if atom == "m8n8k4":
        word_order = (2, 0, 3, 1)
        for row in LANE_ROW_M8N8K4:
            flat += [row * geo.k_block + 4 * w + word_order[j] for w in range(8) for j in range(4)]
    elif atom == "m16n8k16":
        for l in range(32):
            g, t = l >> 2, l & 3
            flat += [(g + 8 * ((q >> 1) & 1)) * geo.k_block + 16 * t + 4 * s + (q & 1) + 2 * (q >> 2)
                     for s in range(4) for q in range(8)]
    else:
        raise ValueError(f"no FP8 code map for atom {atom!r}")
    return permutation(flat, f"{atom}/FP8 codes")


# ---------------------------------------------------------------------------- packed weight
@dataclass
class PackedFP8(PackedLayout):
    codes: torch.Tensor   # uint8 (e4m3 bytes), flat, fragment order
    scale: torch.Tensor   # float32 [1] (per tensor) or [N] (per channel)
    n: int
    k: int
    atom: str = "m8n8k4"

    fmt = FP8_TENSOR.family

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() != 1


def prepack(weight_e4m3: torch.Tensor, weight_scale, atom: str = "m8n8k4",
            rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> PackedFP8:
    """Checkpoint FP8 (e4m3 [N, K], float32 per-tensor or per-channel scale) -> PackedFP8."""
    w = codecs.as_e4m3_bytes(weight_e4m3)
    if w.dim() != 2:
        raise FormatError(f"FP8 weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    scale = codec.channel_scales(weight_scale, n)
    scale = scale[:1].clone() if torch.as_tensor(weight_scale).numel() == 1 else scale.clone()
    g = geometry(atom)
    tile, kbk = g.tile_n, g.k_block
    n_pad, k_pad = -(-n // tile) * tile, -(-k // kbk) * kbk
    tiles, kblocks = n_pad // tile, k_pad // kbk
    block = tile * kbk
    gather, _ = code_maps(atom)
    gather = gather.to(w.device)
    out = torch.empty(tiles * kblocks * block, dtype=torch.uint8, device=w.device)
    step = chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        src = pad2d(w[r0:min(r1, n)], r1 - r0, k_pad)
        blk = to_blocks(src, tile, kbk).index_select(2, gather)
        out[(r0 // tile) * kblocks * block: (r1 // tile) * kblocks * block] = blk.reshape(-1)
    return PackedFP8(out, scale.to(torch.float32).to(w.device), n, k, atom)


def _unprepack_rows(packed: PackedFP8, r0: int, r1: int) -> torch.Tensor:
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    kblocks = packed.k_pad // kbk
    block = tile * kbk
    _, scatter = code_maps(packed.atom)
    t0, t1 = r0 // tile, -(-r1 // tile)
    raw = packed.codes[t0 * kblocks * block: t1 * kblocks * block].view(t1 - t0, kblocks, block)
    src = from_blocks(raw.index_select(2, scatter.to(raw.device)), tile, kbk)
    return src[: r1 - r0, : packed.k].contiguous()


def unprepack(packed: PackedFP8, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """PackedFP8 -> (weight float8_e4m3fn [N, K], weight_scale float32 as stored: [1] or [N])."""
    g = geometry(packed.atom)
    w = torch.empty((packed.n, packed.k), dtype=torch.uint8, device=packed.codes.device)
    step = chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, packed.n, step):
        r1 = min(r0 + step, packed.n)
        w[r0:r1] = _unprepack_rows(packed, r0, r1)
    return w.view(torch.float8_e4m3fn), packed.scale.clone()


def verify_roundtrip(packed: PackedFP8, weight_e4m3: torch.Tensor, weight_scale,
                     rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> None:
    """Raise PrepackMismatch naming the first differing byte or scale unless unprepack(packed)
    equals the source: every code byte, and every scale (the one per-tensor value or each row's
    per-channel value), compared as float32 bits. The scale is required: a check without it
    would prove the codes and let a wrong scale through."""
    w_src = codecs.as_e4m3_bytes(weight_e4m3)
    n, k = w_src.shape
    if (n, k) != (packed.n, packed.k):
        raise PrepackMismatch(f"shape mismatch: packed is N={packed.n} K={packed.k}, source is N={n} K={k}")
    g = geometry(packed.atom)
    step = chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        d = first_diff(_unprepack_rows(packed, r0, r1), w_src[r0:r1].to(packed.codes.device))
        if d is not None:
            off, got, want = d
            raise PrepackMismatch(
                f"FP8 weight byte differs after round trip at offset {r0 * k + off} "
                f"(row {r0 + off // k}, column {off % k}): got 0x{got:02x}, source 0x{want:02x}")
    if weight_scale is None:
        raise PrepackMismatch("FP8 weight_scale not given: the round trip must compare the scale "
                              "as well as the codes; pass the source's weight_scale")
    src = torch.as_tensor(weight_scale, dtype=torch.float32).reshape(-1).to(packed.scale.device)
    held = packed.scale.reshape(-1)
    if src.numel() != held.numel():
        raise PrepackMismatch(f"FP8 weight_scale holds {src.numel()} value(s) in the source but "
                              f"{held.numel()} in the packed copy (1: per tensor, N={n}: per channel); "
                              "re-pack from the source")
    # bits, not values: -0.0 and NaN payloads must come back as they were stored
    d = first_diff(held.view(torch.int32), src.view(torch.int32))
    if d is not None:
        row = d[0]
        where = "per-tensor scale" if src.numel() == 1 else f"per-channel scale of row {row}"
        raise PrepackMismatch(
            f"FP8 weight_scale differs after round trip: {where} is {float(held[row])!r} in the "
            f"packed copy, {float(src[row])!r} in the source (bits 0x{d[1] & 0xFFFFFFFF:08x} vs "
            f"0x{d[2] & 0xFFFFFFFF:08x}); the packed copy must carry the checkpoint's scales unchanged")
