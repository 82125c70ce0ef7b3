"""Prepack: permute checkpoint bytes into the fragment order the QPN kernels read.

Only addresses move: every code (a nibble of NVFP4, a byte of FP8) and every scale byte of the
checkpoint appears exactly once in the packed buffer, unchanged, plus zero padding up to whole
warp tiles (``tile_n`` rows) and k-blocks (``k_block`` inputs). ``unprepack_*`` is the exact
inverse and ``verify_*_roundtrip`` proves it byte for byte before the loader frees a source tensor.

Packed layout (see atoms.py for the per-block permutation):
  codes:  [tiles, k_blocks, block_bytes]  flattened; block_bytes = 512 (NVFP4) / 1024 (FP8) for both
          atoms (m8n8k4: 32-row tiles x 32-input blocks; m16n8k16: 16-row tiles x 64-input blocks)
  scales: [tiles, k_blocks, 64]           NVFP4 only, e4m3 bytes
Work is done in row blocks written into a preallocated output, so a 5120 x 62,080 lm_head never
holds a second full copy of itself in any intermediate form.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import codecs, formats
from .atoms import block_maps, geometry

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


@dataclass
class PackedNVFP4(PackedLayout):
    codes: torch.Tensor         # uint8, flat, fragment order
    scales: torch.Tensor        # uint8 (e4m3 bytes), flat, fragment order
    global_scale: torch.Tensor  # float32, 1 element (weight_scale_2)
    n: int
    k: int
    atom: str = "m8n8k4"

    fmt = formats.NVFP4.family


@dataclass
class PackedFP8(PackedLayout):
    codes: torch.Tensor   # uint8 (e4m3 bytes), flat, fragment order
    scale: torch.Tensor   # float32 [1] (per tensor) or [N] (per channel)
    n: int
    k: int
    atom: str = "m8n8k4"

    fmt = formats.FP8_TENSOR.family

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() != 1



def _chunk_rows(rows_per_chunk: int | None, tile_n: int) -> int:
    if rows_per_chunk is None:
        rows_per_chunk = DEFAULT_ROWS_PER_CHUNK
    return max(tile_n, (int(rows_per_chunk) // tile_n) * tile_n)


def split_gate_up(w13: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused w13 [E, 2I, ...] holds gate (w1) in rows [0, I) and up (w3) in [I, 2I)."""
    if w13.shape[1] != 2 * inter:
        raise formats.MoeShapeError(f"w13 has {w13.shape[1]} rows per expert, expected 2 * "
                                    f"intermediate = {2 * inter}")
    return w13[:, :inter], w13[:, inter:]


def _pad2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _to_blocks(src: torch.Tensor, tile_n: int, block_cols: int) -> torch.Tensor:
    """[R, C] (R, C multiples of the tile) -> [R/tile_n, C/block_cols, tile_n*block_cols]."""
    r, c = src.shape
    return (src.view(r // tile_n, tile_n, c // block_cols, block_cols)
               .permute(0, 2, 1, 3).reshape(r // tile_n, c // block_cols, tile_n * block_cols))


def _from_blocks(blk: torch.Tensor, tile_n: int, block_cols: int) -> torch.Tensor:
    t, kb, _ = blk.shape
    return (blk.view(t, kb, tile_n, block_cols).permute(0, 2, 1, 3)
               .reshape(t * tile_n, kb * block_cols))


# ------------------------------------------------------------------------------------- NVFP4
def prepack_nvfp4(weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
                  atom: str = "m8n8k4", rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> PackedNVFP4:
    """Checkpoint NVFP4 (uint8 [N, K/2], e4m3 [N, K/16], float32 scalar) -> PackedNVFP4 (same device)."""
    n, k = codecs.check_nvfp4(weight_u8, weight_scale, weight_scale_2)
    g = geometry(atom)
    tile, kbk = g.tile_n, g.k_block
    gpb = kbk // formats.GROUP_SIZE
    n_pad, k_pad = -(-n // tile) * tile, -(-k // kbk) * kbk
    tiles, kblocks = n_pad // tile, k_pad // kbk
    code_bytes = tile * kbk // 2
    scale_bytes = tile * gpb
    gather_c, _ = block_maps(atom, "nvfp4")
    gather_s, _ = block_maps(atom, "scale")
    dev = weight_u8.device
    gather_c, gather_s = gather_c.to(dev), gather_s.to(dev)
    codes_out = torch.empty(tiles * kblocks * code_bytes, dtype=torch.uint8, device=dev)
    scales_out = torch.empty(tiles * kblocks * scale_bytes, dtype=torch.uint8, device=dev)
    sc_src = codecs.as_e4m3_bytes(weight_scale)
    step = _chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        rows = r1 - r0
        t0 = r0 // tile
        codes = codecs.unpack_nvfp4_codes(weight_u8[r0:min(r1, n)])
        codes = _pad2d(codes, rows, k_pad)
        blk = _to_blocks(codes, tile, kbk).index_select(2, gather_c)      # [t, kb, 1024] nibbles
        packed = blk[..., 0::2] | (blk[..., 1::2] << 4)
        codes_out[t0 * kblocks * code_bytes: (r1 // tile) * kblocks * code_bytes] = packed.reshape(-1)
        sc = _pad2d(sc_src[r0:min(r1, n)], rows, k_pad // formats.GROUP_SIZE)
        sblk = _to_blocks(sc, tile, gpb).index_select(2, gather_s)
        scales_out[t0 * kblocks * scale_bytes: (r1 // tile) * kblocks * scale_bytes] = sblk.reshape(-1)
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(1).clone().to(dev)
    return PackedNVFP4(codes_out, scales_out, gs, n, k, atom)


def _unprepack_nvfp4_rows(packed: PackedNVFP4, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source bytes of rows [r0, r1) (tile-aligned r0); r1 clipped to N."""
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    gpb = kbk // formats.GROUP_SIZE
    kblocks = packed.k_pad // kbk
    code_bytes, scale_bytes = tile * kbk // 2, tile * gpb
    _, scatter_c = block_maps(packed.atom, "nvfp4")
    _, scatter_s = block_maps(packed.atom, "scale")
    t0, t1 = r0 // tile, -(-r1 // tile)
    raw = packed.codes[t0 * kblocks * code_bytes: t1 * kblocks * code_bytes].view(t1 - t0, kblocks, code_bytes)
    nib = torch.empty((t1 - t0, kblocks, code_bytes * 2), dtype=torch.uint8, device=raw.device)
    nib[..., 0::2] = raw & 0x0F
    nib[..., 1::2] = raw >> 4
    codes = _from_blocks(nib.index_select(2, scatter_c.to(raw.device)), tile, kbk)
    codes = codes[: r1 - r0, : packed.k]
    sraw = packed.scales[t0 * kblocks * scale_bytes: t1 * kblocks * scale_bytes].view(t1 - t0, kblocks, scale_bytes)
    sc = _from_blocks(sraw.index_select(2, scatter_s.to(raw.device)), tile, gpb)
    sc = sc[: r1 - r0, : packed.k // formats.GROUP_SIZE]
    return codecs.pack_nvfp4_codes(codes.contiguous()), sc.contiguous()


def unprepack_nvfp4(packed: PackedNVFP4, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """PackedNVFP4 -> (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16]), byte-identical."""
    g = geometry(packed.atom)
    w = torch.empty((packed.n, packed.k // 2), dtype=torch.uint8, device=packed.codes.device)
    s = torch.empty((packed.n, packed.k // formats.GROUP_SIZE), dtype=torch.uint8, device=packed.codes.device)
    step = _chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, packed.n, step):
        r1 = min(r0 + step, packed.n)
        w[r0:r1], s[r0:r1] = _unprepack_nvfp4_rows(packed, r0, r1)
    return w, s.view(torch.float8_e4m3fn)


def _first_diff(a: torch.Tensor, b: torch.Tensor):
    neq = (a != b)
    if not bool(neq.any()):
        return None
    idx = int(torch.nonzero(neq.reshape(-1))[0])
    return idx, int(a.reshape(-1)[idx]), int(b.reshape(-1)[idx])


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


def verify_nvfp4_roundtrip(packed: PackedNVFP4, weight_u8: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2=None, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> None:
    """Raise PrepackMismatch naming the first differing byte unless unprepack(packed) equals the
    source: every code byte, every group-scale byte and, when ``weight_scale_2`` is given, the
    global scale's float32 bits. The loader and the MoE path always give it (through
    NVFP4Numerics.verify_roundtrip, which requires it); callers that check the permutation
    alone may leave it out."""
    n, k = codecs.check_nvfp4(weight_u8, weight_scale)
    if (n, k) != (packed.n, packed.k):
        raise PrepackMismatch(f"shape mismatch: packed is N={packed.n} K={packed.k}, source is N={n} K={k}")
    if weight_scale_2 is not None:
        _check_global_scale(packed, weight_scale_2)
    sc_src = codecs.as_e4m3_bytes(weight_scale)
    g = geometry(packed.atom)
    step = _chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        w, s = _unprepack_nvfp4_rows(packed, r0, r1)
        d = _first_diff(w, weight_u8[r0:r1].to(w.device))
        if d is not None:
            off, got, want = d
            row, col = r0 + off // (k // 2), off % (k // 2)
            raise PrepackMismatch(
                f"NVFP4 weight byte differs after round trip at offset {r0 * (k // 2) + off} "
                f"(row {row}, byte {col}): got 0x{got:02x}, source 0x{want:02x}")
        d = _first_diff(s, sc_src[r0:r1].to(s.device))
        if d is not None:
            off, got, want = d
            gpr = k // formats.GROUP_SIZE
            raise PrepackMismatch(
                f"NVFP4 weight_scale byte differs after round trip at offset {r0 * gpr + off} "
                f"(row {r0 + off // gpr}, group {off % gpr}): got 0x{got:02x}, source 0x{want:02x}")


# --------------------------------------------------------------------------------------- FP8
def prepack_fp8(weight_e4m3: torch.Tensor, weight_scale, atom: str = "m8n8k4",
                rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK) -> PackedFP8:
    """Checkpoint FP8 (e4m3 [N, K], float32 per-tensor or per-channel scale) -> PackedFP8."""
    w = codecs.as_e4m3_bytes(weight_e4m3)
    if w.dim() != 2:
        raise formats.FormatError(f"FP8 weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    scale = codecs.fp8_channel_scales(weight_scale, n)
    scale = scale[:1].clone() if torch.as_tensor(weight_scale).numel() == 1 else scale.clone()
    g = geometry(atom)
    tile, kbk = g.tile_n, g.k_block
    n_pad, k_pad = -(-n // tile) * tile, -(-k // kbk) * kbk
    tiles, kblocks = n_pad // tile, k_pad // kbk
    block = tile * kbk
    gather, _ = block_maps(atom, "fp8")
    gather = gather.to(w.device)
    out = torch.empty(tiles * kblocks * block, dtype=torch.uint8, device=w.device)
    step = _chunk_rows(rows_per_chunk, tile)
    for r0 in range(0, n_pad, step):
        r1 = min(r0 + step, n_pad)
        src = _pad2d(w[r0:min(r1, n)], r1 - r0, k_pad)
        blk = _to_blocks(src, tile, kbk).index_select(2, gather)
        out[(r0 // tile) * kblocks * block: (r1 // tile) * kblocks * block] = blk.reshape(-1)
    return PackedFP8(out, scale.to(torch.float32).to(w.device), n, k, atom)


def _unprepack_fp8_rows(packed: PackedFP8, r0: int, r1: int) -> torch.Tensor:
    g = geometry(packed.atom)
    tile, kbk = g.tile_n, g.k_block
    kblocks = packed.k_pad // kbk
    block = tile * kbk
    _, scatter = block_maps(packed.atom, "fp8")
    t0, t1 = r0 // tile, -(-r1 // tile)
    raw = packed.codes[t0 * kblocks * block: t1 * kblocks * block].view(t1 - t0, kblocks, block)
    src = _from_blocks(raw.index_select(2, scatter.to(raw.device)), tile, kbk)
    return src[: r1 - r0, : packed.k].contiguous()


def unprepack_fp8(packed: PackedFP8, rows_per_chunk: int = DEFAULT_ROWS_PER_CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """PackedFP8 -> (weight float8_e4m3fn [N, K], weight_scale float32 as stored: [1] or [N])."""
    g = geometry(packed.atom)
    w = torch.empty((packed.n, packed.k), dtype=torch.uint8, device=packed.codes.device)
    step = _chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, packed.n, step):
        r1 = min(r0 + step, packed.n)
        w[r0:r1] = _unprepack_fp8_rows(packed, r0, r1)
    return w.view(torch.float8_e4m3fn), packed.scale.clone()


def verify_fp8_roundtrip(packed: PackedFP8, weight_e4m3: torch.Tensor, weight_scale,
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
    step = _chunk_rows(rows_per_chunk, g.tile_n)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        d = _first_diff(_unprepack_fp8_rows(packed, r0, r1), w_src[r0:r1].to(packed.codes.device))
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
    d = _first_diff(held.view(torch.int32), src.view(torch.int32))
    if d is not None:
        row = d[0]
        where = "per-tensor scale" if src.numel() == 1 else f"per-channel scale of row {row}"
        raise PrepackMismatch(
            f"FP8 weight_scale differs after round trip: {where} is {float(held[row])!r} in the "
            f"packed copy, {float(src[row])!r} in the source (bits 0x{d[1] & 0xFFFFFFFF:08x} vs "
            f"0x{d[2] & 0xFFFFFFFF:08x}); the packed copy must carry the checkpoint's scales unchanged")
