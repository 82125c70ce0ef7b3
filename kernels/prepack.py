"""Prepack, the part every family shares: permute checkpoint bytes into the fragment order the
QPN kernels read.

Only addresses move: every code and every scale byte of the checkpoint appears exactly once in
the packed buffer, unchanged, plus zero padding up to whole warp tiles (``tile_n`` rows) and
k-blocks (``k_block`` inputs). Each family's layout (kernels/families/<family>/layout.py) is its
packed class, its fragment maps per atom, its prepack, the exact inverse, and the proof of that
inverse, byte for byte, run before the loader frees a source tensor. They share what is here: the
base class of packed weights, the tile-block reshapes, the row chunking and the first-difference
finder their proofs report with.

Work is done in row blocks written into a preallocated output, so a 5120 x 62,080 lm_head never
holds a second full copy of itself in any intermediate form.
"""
from __future__ import annotations

import dataclasses

import torch

from . import formats
from .atoms import geometry

DEFAULT_ROWS_PER_CHUNK = 2048


class PrepackMismatch(ValueError):
    """The inverse permutation did not give the source bytes back."""


class PackedLayout:
    """What every packed weight (and expert stack) answers alike from its ``n``, ``k``, ``atom``
    and its tensor fields: sizes padded to its atom's tiles, its device, its WeightFormat, its
    buffers and their size, and a copy on another device."""

    n: int
    k: int
    atom: str

    @property
    def n_pad(self) -> int:
        t = geometry(self.atom).tile_n
        return -(-self.n // t) * t

    @property
    def k_pad(self) -> int:
        b = geometry(self.atom).k_block
        return -(-self.k // b) * b

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def format(self) -> formats.WeightFormat:
        return formats.format_of(self)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors it holds (codes, scales, output scale), by field name."""
        return {f.name: t for f in dataclasses.fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)}

    @property
    def nbytes(self) -> int:
        """Bytes of all its buffers (what a kernel reads for the whole weight)."""
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    def to(self, device):
        """The same packed weight with every buffer on ``device``."""
        return dataclasses.replace(self, **{name: t.to(device) for name, t in self.buffers().items()})



def chunk_rows(rows_per_chunk: int | None, tile_n: int) -> int:
    """Rows per chunk of a prepack or proof: whole tiles, at least one."""
    if rows_per_chunk is None:
        rows_per_chunk = DEFAULT_ROWS_PER_CHUNK
    return max(tile_n, (int(rows_per_chunk) // tile_n) * tile_n)


def split_gate_up(w13: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused w13 [E, 2I, ...] holds gate (w1) in rows [0, I) and up (w3) in [I, 2I)."""
    if w13.shape[1] != 2 * inter:
        raise formats.MoeShapeError(f"w13 has {w13.shape[1]} rows per expert, expected 2 * "
                                    f"intermediate = {2 * inter}")
    return w13[:, :inter], w13[:, inter:]


def pad2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` zero-padded to [rows, cols] (itself when it already is)."""
    if t.shape == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def to_blocks(src: torch.Tensor, tile_n: int, block_cols: int) -> torch.Tensor:
    """[R, C] (R, C multiples of the tile) -> [R/tile_n, C/block_cols, tile_n*block_cols]: the
    tile-blocks a fragment map permutes."""
    r, c = src.shape
    return (src.view(r // tile_n, tile_n, c // block_cols, block_cols)
               .permute(0, 2, 1, 3).reshape(r // tile_n, c // block_cols, tile_n * block_cols))


def from_blocks(blk: torch.Tensor, tile_n: int, block_cols: int) -> torch.Tensor:
    """The inverse of ``to_blocks``."""
    t, kb, _ = blk.shape
    return (blk.view(t, kb, tile_n, block_cols).permute(0, 2, 1, 3)
               .reshape(t * tile_n, kb * block_cols))


def first_diff(a: torch.Tensor, b: torch.Tensor):
    """(flat index, a value, b value) of the first element where ``a`` and ``b`` differ; None if equal."""
    neq = (a != b)
    if not bool(neq.any()):
        return None
    idx = int(torch.nonzero(neq.reshape(-1))[0])
    return idx, int(a.reshape(-1)[idx]), int(b.reshape(-1)[idx])
