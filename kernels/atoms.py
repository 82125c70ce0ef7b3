"""Fragment geometry of each tensor-core atom the QPN family is built on.

One warp owns a tile of ``TILE_N`` weight rows and walks K in blocks of ``K_BLOCK`` inputs. For
each (tile, k-block) the prepacked buffer holds a fixed permutation of that tile-block's codes and
scales, chosen so that every lane loads its operand bytes with one contiguous vector load and the
decoder's output registers ARE the operand registers of the MMA (no shuffle in the inner loop).

This module is the single description of those permutations on the Python side; the CUDA side
(csrc/qpn_family.cuh for m8n8k4, csrc/qpn_atom_m16n8k16.cuh for m16n8k16) derives the same
positions from the same rules. Prepack, unprepack and the
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

KNOWN_ATOMS = ("m8n8k4", "m16n8k16")


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
    # Inputs of one row a lane supplies contiguously per k-block in the layouts without an MMA per
    # group (FP8, INT4): the unit a group record index counts (INT4 groups are multiples of it).
    lane_run: int = 0


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
                        tuple(f8_k), tuple(sc_row), tuple(sc_g), lane_run=32)


def _m16n8k16() -> AtomGeometry:
    """sm_80+ ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``, weights on the A side.

    PTX fragment layout (g = lane >> 2, t = lane & 3): A (16x16, row-major) registers
    a0..a3 hold (row g, cols 2t..2t+1), (row g+8, cols 2t..2t+1), (row g, cols 2t+8..2t+9),
    (row g+8, cols 2t+8..2t+9); B (16x8, "col") registers b0, b1 hold (k 2t..2t+1, token g) and
    (k 2t+8..2t+9, token g); D (f32) c0..c3 hold (row g, tokens 2t, 2t+1), (row g+8, same).

    The MMA sums over its 16 k-slots, so any bijection from k-slots to real inputs that A and B
    share gives the same result. Per k-block of 64 inputs:
      * NVFP4: MMA step s (0..3) is NVFP4 group s: k-slot 2t+j (j = 0, 1) is input 16s + 4t + j and
        k-slot 2t+8+j is input 16s + 4t + 2 + j. One group per MMA keeps products of different
        group scales out of one tensor-core sum (its limited alignment precision would round small
        products off next to large cancelling ones: the FP16-overflow trap). Lane (g, t) supplies
        token g's inputs 16s + 4t .. +3 per step (four 8-byte activation reads per k-block) and
        needs the scales of its rows g, g+8 for all four groups: 8 bytes, laid out per (tile,
        k-block) so that lane l reads bytes 8g .. 8g+7 = (g, grp 0), (g+8, grp 0), (g, grp 1), ...
      * FP8 (no groups): k-slot 2t+j of step s is input 16t + 4s + j, k-slot 2t+8+j is 16t + 4s + 2 + j:
        lane (g, t) supplies token g's inputs 16t .. 16t+15, one contiguous 32-byte read.
    Per (16-row tile, k-block) a lane reads 16 bytes of NVFP4 codes (one 16-byte load: word s
    feeds step s) or 32 bytes of FP8 (two: words 2s, 2s+1 feed step s).
    """
    nv_row, nv_k, f8_row, f8_k = [], [], [], []
    for l in range(32):
        g, t = l >> 2, l & 3
        # NVFP4 word s, nibble j: the decoder builds half2 r from nibbles 3-r (low half) and
        # 7-r (high half) of the word; half2 r is a0..a3 = (g, k0 k1), (g+8, k0 k1),
        # (g, k2 k3), (g+8, k2 k3) with k0..k3 = 16s + 4t + 0..3.
        for s in range(4):
            for j in range(8):
                nv_row.append(g + 8 * (j % 2 == 0))
                nv_k.append(16 * s + 4 * t + (j >> 2) + 2 * ((j & 3) < 2))
        # FP8 step s, byte q of its 8 (words 2s, 2s+1, little-endian): a0 = bytes 0-1 (g, k0 k1),
        # a1 = bytes 2-3 (g+8, k0 k1), a2 = bytes 4-5 (g, k2 k3), a3 = bytes 6-7 (g+8, k2 k3).
        for s in range(4):
            for q in range(8):
                f8_row.append(g + 8 * ((q >> 1) & 1))
                f8_k.append(16 * t + 4 * s + (q & 1) + 2 * (q >> 2))
    sc_row, sc_g = [], []
    for g in range(8):
        for grp in range(4):
            for h in range(2):
                sc_row.append(g + 8 * h)
                sc_g.append(grp)
    return AtomGeometry("m16n8k16", 16, 64, 32, tuple(nv_row), tuple(nv_k), tuple(f8_row),
                        tuple(f8_k), tuple(sc_row), tuple(sc_g), lane_run=16)


# Which atom an architecture runs natively: m8n8k4 is HMMA.884 on sm_70/sm_75 and emulated on
# sm_80 and later, where m16n8k16 is the native FP16 tensor-core instruction.
def atom_for_arch(arch) -> str:
    """'sm70' / 'sm_90' / 86 / (8, 6) -> the atom its QPN kernels use."""
    if isinstance(arch, tuple):
        num = arch[0] * 10 + arch[1]
    elif isinstance(arch, int):
        num = arch
    else:
        s = str(arch).lower().replace("sm_", "").replace("sm", "")
        if not s.isdigit():
            raise ValueError(f"architecture must look like 'sm70', 'sm_90', 86 or (8, 6); got {arch!r}")
        num = int(s)
    if num < 70:
        raise ValueError(f"sm_{num} has no FP16 tensor-core MMA the QPN kernels can use (need sm_70 or later)")
    return "m8n8k4" if num < 80 else "m16n8k16"



def arch_for_atom(atom: str) -> str:
    """The route-table architecture key of an atom's kernels (the bands are the same today)."""
    return "sm70" if atom == "m8n8k4" else "sm80"

@lru_cache(maxsize=None)
def geometry(atom: str) -> AtomGeometry:
    if atom == "m8n8k4":
        return _m8n8k4()
    if atom == "m16n8k16":
        return _m16n8k16()
    raise ValueError(f"unknown MMA atom {atom!r}; known atoms: {', '.join(KNOWN_ATOMS)}")


@lru_cache(maxsize=None)
def block_maps(atom: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, scatter) index tensors over the flattened [tile_n * k_block] (codes) or
    [tile_n * groups_per_block] (scales) tile-block: packed = src_flat[gather];
    src_flat = packed[scatter]."""
    g = geometry(atom)
    if kind == "scale":
        gpb = g.k_block // 16
        flat = [r * gpb + q for r, q in zip(g.scale_row_of, g.scale_group_of)]
    elif hasattr(g, f"{kind}_row_of"):   # a family's code fragment: <family>_row_of / <family>_k_of
        flat = [r * g.k_block + k for r, k in zip(getattr(g, f"{kind}_row_of"), getattr(g, f"{kind}_k_of"))]
    else:
        raise ValueError(kind)
    gather = torch.tensor(flat, dtype=torch.long)
    if sorted(flat) != list(range(len(flat))):
        raise AssertionError(f"{atom}/{kind}: block map is not a permutation")
    scatter = torch.argsort(gather)
    return gather, scatter
