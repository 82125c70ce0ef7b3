"""Fragment geometry of each tensor-core atom the QPN kernels are built on.

One warp owns a tile of ``tile_n`` weight rows and walks K in blocks of ``k_block`` inputs. For
each (tile, k-block) the prepacked buffer holds a fixed permutation of that tile-block's codes and
scales, chosen so that every lane loads its operand bytes with one contiguous vector load and the
decoder's output registers ARE the operand registers of the MMA (no shuffle in the inner loop).

This module holds what every family shares per atom (tile, k-block, the lanes' rows); each
family's layout (kernels/families/<family>/layout.py) builds its own permutation from them, and
the CUDA decoders of the family derive the same positions from the same rules.

m8n8k4 (SM70 ``mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32``), weights on the A side:
  * a warp issues four independent 8x8x4 MMAs, one per quadpair (lanes 4q..4q+3 and 4q+16..4q+19);
    all four take the SAME activation fragment (B: 4 k x 8 tokens) and different weight rows, so
    the warp tile is 4 x 8 = 32 weight rows by 8 tokens;
  * A (row-major 8x4): lane l holds row (l % 4) + 4 * (l >= 16) of its quadpair, 4 consecutive k;
    so lane l of the warp owns weight row ``8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4)``;
  * accumulator (f32): lane l holds rows (l & 1) + (i & 2) (+4 for l >= 16) and tokens
    (i & 4) + (l & 2) + (i & 1) for its 8 values i = 0..7.
  Per k-block of 32 a lane consumes 8 MMAs = 32 inputs of its row, in the order its family's
  decoder emits half2 pairs.
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
    # Inputs of one row a lane supplies contiguously per k-block in the layouts without an MMA per
    # group (FP8, INT4): the unit a group record index counts (INT4 groups are multiples of it).
    lane_run: int = 0


# m8n8k4: lane l owns weight row LANE_ROW_M8N8K4[l] of the warp tile (the A operand's rows).
LANE_ROW_M8N8K4 = tuple(8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4) for l in range(32))

_GEOMETRY = {
    "m8n8k4": AtomGeometry("m8n8k4", tile_n=32, k_block=32, lanes=32, lane_run=32),
    # sm_80+ ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``, weights on the A side. PTX
    # fragment layout (g = lane >> 2, t = lane & 3): A (16x16, row-major) registers a0..a3 hold
    # (row g, cols 2t..2t+1), (row g+8, cols 2t..2t+1), (row g, cols 2t+8..2t+9), (row g+8,
    # cols 2t+8..2t+9); B (16x8, "col") b0, b1 hold (k 2t..2t+1, token g), (k 2t+8..2t+9, token g);
    # D (f32) c0..c3 hold (row g, tokens 2t, 2t+1), (row g+8, same). The MMA sums over its 16
    # k-slots, so any bijection from k-slots to real inputs that A and B share gives the same
    # result: each family's layout picks its own (kernels/families/<family>/layout.py).
    "m16n8k16": AtomGeometry("m16n8k16", tile_n=16, k_block=64, lanes=32, lane_run=16),
}


def permutation(flat: list[int], what: str, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, scatter) index tensors of a fragment map over a flattened tile-block:
    packed = src_flat[gather]; src_flat = packed[scatter]. AssertionError unless ``flat`` is a
    permutation of 0..size-1 (default: of its own length; ``what`` names the map in the message)."""
    if sorted(flat) != list(range(len(flat) if size is None else size)):
        raise AssertionError(f"{what}: block map is not a permutation")
    gather = torch.tensor(flat, dtype=torch.long)
    return gather, torch.argsort(gather)


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
    if atom not in _GEOMETRY:
        raise ValueError(f"unknown MMA atom {atom!r}; known atoms: {', '.join(KNOWN_ATOMS)}")
    return _GEOMETRY[atom]
