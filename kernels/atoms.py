"""Fragment geometry of each tensor-core atom the QPN family is built on.

One warp owns a tile of ``TILE_N`` weight rows and walks K in blocks of ``K_BLOCK`` inputs. For
each (tile, k-block) the prepacked buffer holds a fixed permutation of that tile-block's codes and
scales, chosen so that every lane loads its operand bytes with one contiguous vector load and the
decoder's output registers ARE the operand registers of the MMA (no shuffle in the inner loop).

This module is the single description of those permutations on the Python side; the CUDA side
(csrc/qpn_atoms.cuh) derives the same positions from the same rules. Prepack, unprepack and the
CPU reference all read the maps built here, so an atom is added by adding one geometry, not by
forking prepack, decoder or dispatch.

m8n8k4 (SM70 ``mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32``), weights on the A side:
  * a warp issues four independent 8x8x4 MMAs, one per quadpair (lanes 4q..4q+3 and 4q+16..4q+19);
    all four take the SAME activation fragment (B: 4 k x 8 tokens) and different weight rows, so
    the warp tile is 4 x 8 = 32 weight rows by 8 tokens;
  * A (row-major 8x4): lane l holds row (l % 4) + 4 * (l >= 16) of its quadpair, 4 consecutive k;
    so lane l of the warp owns weight row ``8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4)``;
  * accumulator (f32): lane l holds rows (l & 1) + (i & 2) (+4 for l >= 16) and tokens
    (i & 4) + (l & 2) + (i & 1) for its 8 values i = 0..7.
  Per k-block of 32 a lane consumes 8 MMAs = 32 codes of its row: 16 bytes of NVFP4 (one 16-byte
  load) or 32 bytes of FP8 (two), in the order the decoder emits half2 pairs, and (NVFP4) the two
  e4m3 group scales of its row (one 16-bit load).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

KNOWN_ATOMS = ("m8n8k4",)


@dataclass(frozen=True)
class AtomGeometry:
    name: str
    tile_n: int          # weight rows per warp tile
    k_block: int         # inputs per k-block (one vector load of codes per lane)
    lanes: int           # 32
    # Per (tile, k-block): element p of the packed block comes from (row_of[p], k_of[p]) of the
    # tile-block's [tile_n, k_block] source; NVFP4 packs elements 2j (low) and 2j+1 (high) in byte j.
    nvfp4_row_of: tuple
    nvfp4_k_of: tuple
    fp8_row_of: tuple
    fp8_k_of: tuple
    # NVFP4 scales per (tile, k-block): byte p holds the scale of (row, group-in-block).
    scale_row_of: tuple
    scale_group_of: tuple


def _m8n8k4() -> AtomGeometry:
    lane_row = [8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4) for l in range(32)]
    # NVFP4: a 32-bit word (little-endian, nibble i = bits 4i..4i+3) holds 8 codes of 8
    # consecutive k. The decoder builds the half2 (k0, k1) from nibbles 3 and 7 (the top nibble of
    # each 16-bit half), then shifts the word left by 4 for (k2, k3), (k4, k5), (k6, k7); so
    # nibbles 0..7 hold k6, k4, k2, k0, k7, k5, k3, k1.
    word_order_fp4 = [6, 4, 2, 0, 7, 5, 3, 1]
    fp4_slot_k = [8 * w + word_order_fp4[j] for w in range(4) for j in range(8)]
    # FP8: a 32-bit word holds 4 codes of 4 consecutive k; the decoder takes bytes (1, 3) for the
    # half2 (k0, k1) and, after a left shift by 8, bytes (0, 2) for (k2, k3): bytes = k2, k0, k3, k1.
    word_order_fp8 = [2, 0, 3, 1]
    fp8_slot_k = [4 * w + word_order_fp8[j] for w in range(8) for j in range(4)]
    nv_row, nv_k, f8_row, f8_k = [], [], [], []
    for l in range(32):
        for s in range(32):
            nv_row.append(lane_row[l]); nv_k.append(fp4_slot_k[s])
            f8_row.append(lane_row[l]); f8_k.append(fp8_slot_k[s])
    # Scales: the group scale is folded into the lane's A operand (see csrc/qpn_family.cuh), so
    # lane l needs, per k-block, the two group scales of ITS row: bytes 2l (group 0), 2l+1 (group 1).
    sc_row, sc_g = [], []
    for l in range(32):
        for j in range(2):
            sc_row.append(lane_row[l]); sc_g.append(j)
    return AtomGeometry("m8n8k4", 32, 32, 32, tuple(nv_row), tuple(nv_k), tuple(f8_row),
                        tuple(f8_k), tuple(sc_row), tuple(sc_g))


@lru_cache(maxsize=None)
def geometry(atom: str) -> AtomGeometry:
    if atom == "m8n8k4":
        return _m8n8k4()
    raise ValueError(f"unknown MMA atom {atom!r}; known atoms: {', '.join(KNOWN_ATOMS)}")


@lru_cache(maxsize=None)
def block_maps(atom: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, scatter) index tensors over the flattened [tile_n * k_block] (codes) or
    [tile_n * groups_per_block] (scales) tile-block: packed = src_flat[gather];
    src_flat = packed[scatter]."""
    g = geometry(atom)
    if kind == "nvfp4":
        flat = [r * g.k_block + k for r, k in zip(g.nvfp4_row_of, g.nvfp4_k_of)]
    elif kind == "fp8":
        flat = [r * g.k_block + k for r, k in zip(g.fp8_row_of, g.fp8_k_of)]
    elif kind == "scale":
        gpb = g.k_block // 16
        flat = [r * gpb + q for r, q in zip(g.scale_row_of, g.scale_group_of)]
    else:
        raise ValueError(kind)
    gather = torch.tensor(flat, dtype=torch.long)
    if sorted(flat) != list(range(len(flat))):
        raise AssertionError(f"{atom}/{kind}: block map is not a permutation")
    scatter = torch.argsort(gather)
    return gather, scatter
