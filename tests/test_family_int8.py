"""INT8 W8A16 family (kernels/families/int8/): every code 0..255 against every zero point 0..255,
groups 32/64/128 and per channel, quantize back from every positive float16 scale, the prepack
inverse over every byte value, a lane-level replay of the documented fragment maps, a CPU replay
of the CUDA decoders (their PRMT selectors and constants read from the family's headers) at the
kernels' own record addresses, the GPTQ and compressed-tensors unpackers against packers written
here and against vLLM's and compressed-tensors' own code (skipped when a library is absent),
act-order, and mutations of the family's modules and headers that the checks must catch."""
from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qpn.kernels import families, formats, ops, prepack, routes
from qpn.kernels.atoms import LANE_ROW_M8N8K4, geometry
from qpn.kernels.families.int8 import checkpoint as int8_checkpoint
from qpn.kernels.families.int8 import codec as int8_codec
from qpn.kernels.families.int8 import layout as int8_layout
from qpn.kernels.formats import INT8, INT8_SYM

pytestmark = pytest.mark.fast
KERNELS = Path(__file__).resolve().parents[1] / "kernels"
FAMILY_DIR = KERNELS / "families" / "int8"
FAMILY_MODULES = ("members", "codec", "checkpoint", "layout", "numerics")
CHANNEL = -1   # the checkpoints' group_size for one scale per output channel (members.CHANNEL)


def family_namespace(package: str) -> SimpleNamespace:
    """The public names of a family package's modules in one namespace, so that one set of checks
    runs on the real package and on a mutated copy of it."""
    names = {}
    for mod in FAMILY_MODULES:
        names.update({k: v for k, v in vars(importlib.import_module(f"{package}.{mod}")).items()
                      if not k.startswith("__")})
    return SimpleNamespace(**names)


INT8_FAMILY = family_namespace("qpn.kernels.families.int8")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _scales(rows, cols, gen):
    return (torch.rand(rows, cols, generator=gen) * 0.02 + 1e-3).half()


def _bytes_u8(shape, gen):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def _any_f16(shape, gen):
    """Any 16 bits as float16 (NaN and inf patterns too)."""
    bits = torch.randint(0, 1 << 16, shape, generator=gen, dtype=torch.int32)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)


def _oracle(codes, scales, zeros, g):
    """(code - zero) * scale in float64 from the integers and torch's own float16 cast: no family code."""
    z = torch.full(scales.shape, 128) if zeros is None else zeros
    cols = scales.shape[1]
    gs = codes.shape[1] // cols if g == CHANNEL or cols == 1 else g
    return (codes.double() - z.double().repeat_interleave(gs, 1)) * scales.double().repeat_interleave(gs, 1)


# ----------------------------------------------------------------------------- library fixtures
@pytest.fixture(scope="module")
def vllm_q():
    """vLLM's own GPTQ helpers (CPU functions): the reference quantizers and the row / column packers."""
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils",
                             reason="vLLM not installed")
    from vllm.scalar_type import scalar_types
    return SimpleNamespace(qu=qu, types=scalar_types)


@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    return SimpleNamespace(PQC=PackedQuantizationCompressor, pack=pack_to_int32, unpack=unpack_from_int32,
                           Args=QuantizationArgs, Scheme=QuantizationScheme, dequantize=dequantize)


# ------------------------------------------------------- packers written here (the independent side)
def _word(vals) -> int:
    """Four bytes -> one int32, byte i in bits 8i (as GPTQ and compressed-tensors write it)."""
    u = sum((int(v) & 0xFF) << (8 * i) for i, v in enumerate(vals))
    return u - (1 << 32) if u >= 1 << 31 else u


def pack_gptq(codes_nk, zeros_ng, g, v2):
    """(qweight [K/4, N], qzeros [G, N/4]) of codes [N, K] and zeros [N, G], one word at a time;
    v1 stores each zero minus 1 (GPTQModel subtracts 0x01010101 from every word)."""
    n, k = codes_nk.shape
    qweight = torch.tensor([[_word(codes_nk[c, 4 * r + i] for i in range(4)) for c in range(n)]
                            for r in range(k // 4)], dtype=torch.int32)
    if zeros_ng is None:
        return qweight, None
    groups = zeros_ng.shape[1]
    qzeros = [[(_word(zeros_ng[4 * c + j, grp] for j in range(4)) - (0 if v2 else 0x01010101))
               for c in range(n // 4)] for grp in range(groups)]
    qzeros = [[w + (1 << 32) if w < -(1 << 31) else w for w in row] for row in qzeros]
    return qweight, torch.tensor(qzeros, dtype=torch.int32)


def pack_ct(codes_nk, zeros_ng):
    """compressed-tensors pack-quantized: (weight_packed [N, K/4], weight_zero_point [ceil(N/4), G])."""
    n, k = codes_nk.shape
    packed = torch.tensor([[_word(codes_nk[r, 4 * j + i] for i in range(4)) for j in range(k // 4)]
                           for r in range(n)], dtype=torch.int32)
    if zeros_ng is None:
        return packed, None
    groups = zeros_ng.shape[1]
    zpad = torch.zeros((-(-n // 4) * 4, groups), dtype=torch.int64)
    zpad[:n] = zeros_ng.long()
    zp = torch.tensor([[_word(zpad[4 * c + j, grp] for j in range(4)) for grp in range(groups)]
                       for c in range(zpad.shape[0] // 4)], dtype=torch.int32)
    return packed, zp


# ------------------------------------------------------------------ checks (also run on mutants)
def check_codec(m):
    """Every code 0..255 against every zero point 0..255 (row r has zero r in every group and holds
    every code, rotated by r), asymmetric and symmetric, decoded against the float64 oracle."""
    n, k, g = 256, 256, 32
    codes = torch.stack([torch.roll(torch.arange(256), r) for r in range(n)]).to(torch.uint8)
    zeros = torch.arange(n).view(n, 1).expand(n, k // g).to(torch.uint8).contiguous()
    scales = (torch.exp2(-torch.arange(k // g).double()).repeat(n, 1) * (1 + (torch.arange(n).view(-1, 1) % 16) / 16)).half()
    for zp in (zeros, None):
        want = _oracle(codes, scales, zp, g)
        src = (codes, scales) if zp is None else (codes, scales, zp)
        assert torch.equal(m.dequantize_f64(*src), want), "decode vs oracle"
        assert torch.equal(m.dequantize(*src).double(), want), "float32 decode is exact"


def check_gptq(m, k=128, n=24):
    gen = _gen(12)
    for g in (32, 128, CHANNEL):
        cols = 1 if g == CHANNEL else k // g
        codes = _bytes_u8((n, k), gen)
        codes[0, :] = torch.arange(k) % 256
        codes[1, :k] = 255 - torch.arange(k) % 256
        s = _scales(cols, n, gen)                                   # GPTQ stores scales [K/g, N]
        z = torch.randint(1, 256, (n, cols), generator=gen, dtype=torch.int32).to(torch.uint8)
        z[: min(n, 2), 0] = torch.tensor([1, 255])[: min(n, 2)]
        for v2 in (True, False):
            qweight, qzeros = pack_gptq(codes, z, g, v2)
            src = m.from_gptq(qweight, qzeros, s, None, g, False, v2=v2)
            assert torch.equal(src[0], codes), f"GPTQ codes (g={g})"
            assert torch.equal(src[2], z), f"GPTQ zero points (g={g}, v2={v2})"
            assert torch.equal(src[1], s.t()), f"GPTQ scales (g={g})"
        qweight, _ = pack_gptq(codes, None, g, True)
        sym = m.from_gptq(qweight, None, s, None, g, True)
        assert len(sym) == 2 and torch.equal(sym[0], codes), "GPTQ symmetric codes"
        want = _oracle(codes, s.t(), None, g)
        assert torch.equal(m.dequantize_f64(*sym), want), "GPTQ symmetric: zero 128"


def check_ct_packing(m, n=22, k=128):
    """pack-quantized with packers written here: codes as stored (q + 128), zero points packed along N."""
    gen = _gen(13)
    for g in (32, 64, CHANNEL):
        cols = 1 if g == CHANNEL else k // g
        codes = _bytes_u8((n, k), gen)
        z = _bytes_u8((n, cols), gen)
        s = _scales(n, cols, gen)
        wp, zp = pack_ct(codes, z)
        src = m.from_pack_quantized(wp, s, zp, None if g == CHANNEL else g)
        assert torch.equal(src[0], codes) and torch.equal(src[2], z) and torch.equal(src[1], s), f"CT g={g}"
        sym = m.from_pack_quantized(wp, s, None, None if g == CHANNEL else g)
        assert len(sym) == 2 and torch.equal(sym[0], codes)


def _lane_row_m16(slot):
    return (slot >> 1) + 8 * (slot & 1)


def replay(m, packed):
    """Decode a packed weight the way the documented lane decoder does, from the raw buffers:
    per (tile, k-block) lane l loads 32 bytes at 32 l; m8n8k4: byte b is its row's input b;
    m16n8k16: byte b = 8 s + q is row g + 8 ((q >> 1) & 1), input 16 t + 4 s + (q & 1) + 2 (q >> 2);
    per (tile, group) the lane's record(s). Returns (codes [N, K], scale bits [N, G], zeros [N, G])."""
    geo = geometry(packed.atom)
    tile, kb = geo.tile_n, geo.k_block
    kblocks, gp, rec = packed.k_pad // kb, packed.groups_pad, packed.record_bytes
    q = torch.full((packed.n_pad, packed.k_pad), 999, dtype=torch.int32)
    raw = packed.codes.to(torch.int32)
    for t in range(packed.n_pad // tile):
        for b in range(kblocks):
            base = (t * kblocks + b) * tile * kb
            for l in range(32):
                lane_bytes = raw[base + 32 * l: base + 32 * l + 32]
                for i in range(32):
                    if packed.atom == "m8n8k4":
                        row, col = LANE_ROW_M8N8K4[l], i
                    else:
                        s, qq, g4, t4 = i >> 3, i & 7, l >> 2, l & 3
                        row, col = g4 + 8 * ((qq >> 1) & 1), 16 * t4 + 4 * s + (qq & 1) + 2 * (qq >> 2)
                    q[t * tile + row, b * kb + col] = lane_bytes[i]
    assert int(q.max()) <= 255, "replay: some weight was never decoded"
    s = torch.zeros((packed.n_pad, gp), dtype=torch.int32)
    z = torch.zeros((packed.n_pad, gp), dtype=torch.int32)
    rb = packed.scales.to(torch.int32)
    for t in range(packed.n_pad // tile):
        for grp in range(gp):
            base = (t * gp + grp) * tile * rec
            for slot in range(tile):
                row = LANE_ROW_M8N8K4[slot] if packed.atom == "m8n8k4" else _lane_row_m16(slot)
                r0 = base + slot * rec
                s[t * tile + row, grp] = int(rb[r0]) | int(rb[r0 + 1]) << 8
                if rec == 4:
                    z[t * tile + row, grp] = int(rb[r0 + 2])
    cols = packed.scale_cols
    return q[: packed.n, : packed.k], s[: packed.n, :cols], z[: packed.n, :cols]


def check_replay(m):
    gen = _gen(14)
    for atom in formats.ATOMS:
        for sym in (False, True):
            for n, k, g in ((37, 192, 64), (20, 96, CHANNEL)):
                cols = 1 if g == CHANNEL else k // g
                codes = _bytes_u8((n, k), gen)
                s = _any_f16((n, cols), gen)
                z = None if sym else _bytes_u8((n, cols), gen)
                p = m.prepack(codes, s, z, atom=atom)
                rq, rs, rz = replay(m, p)
                assert torch.equal(rq, codes.to(torch.int32)), f"{atom}: lane decode of codes"
                assert torch.equal(rs, s.view(torch.int16).to(torch.int32) & 0xFFFF), f"{atom}: lane scale records"
                if z is not None:
                    assert torch.equal(rz, z.to(torch.int32)), f"{atom}: lane zero points"


# ----------------------------------------------------- the CUDA decoders, replayed on the CPU
def _hex(pattern: str, text: str, what: str) -> int:
    found = re.findall(pattern, text)
    assert len(found) == 1, f"{what}: {pattern!r} found {len(found)} times in the header"
    return int(found[0], 16)


def header_constants(m8: str, m16: str) -> dict:
    """The constants the decoders compute with, read from the headers' code (not their comments):
    the PRMT selectors of a code word's two halves, of the zero bias and of the scale, and the
    symmetric member's zero bias."""
    code = {a: re.sub(r"//[^\n]*", "", t) for a, t in (("m8n8k4", m8), ("m16n8k16", m16))}
    out = {}
    for atom, text in code.items():
        sel = re.findall(r"prmt\(word, 0x64u, h \? (0x[0-9a-fA-F]+)u : (0x[0-9a-fA-F]+)u\)", text)
        assert len(sel) == 1, f"{atom}: the code-word PRMT"
        out[atom, "half1"], out[atom, "half0"] = (int(v, 16) for v in sel[0])
        out[atom, "sym_zero"] = _hex(r"SYM \? (0x[0-9a-fA-F]+)u : prmt\((?:rec|sc\[h\]), 0x64u", text, atom)
    out["m8n8k4", "zero_scale"] = _hex(r"zero_bias\(u32 rec\) \{ return SYM \? 0x[0-9a-fA-F]+u : prmt\(rec, 0x64u, "
                                       r"(0x[0-9a-fA-F]+)u\)", code["m8n8k4"], "m8n8k4 zero bias")
    out["m8n8k4", "sym_scale"] = _hex(r"scale2\(u32 rec\) \{ return SYM \? prmt\(rec, 0u, (0x[0-9a-fA-F]+)u\)",
                                      code["m8n8k4"], "m8n8k4 scale")
    out["m16n8k16", "zero"] = _hex(r"prmt\(sc\[h\], 0x64u, (0x[0-9a-fA-F]+)u\)", code["m16n8k16"], "m16 zero")
    return out


def _prmt(a: torch.Tensor, b: int, sel: int) -> torch.Tensor:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b, a}."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [torch.full_like(a, (b >> (8 * i)) & 0xFF) for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        pick = (sel >> (4 * i)) & 7
        out |= src[pick] << (8 * i)
    return out


def _halves(v: torch.Tensor):
    """(low half, high half) of 32-bit values as float16."""
    def f16(x):
        x = x & 0xFFFF
        return (x - ((x >> 15) << 16)).to(torch.int16).view(torch.float16)
    return f16(v), f16(v >> 16)


def replay_decoder(packed, consts: dict, fold: bool = False) -> torch.Tensor:
    """The FP16 operands [N_pad, K_pad] (float64) the kernels of ``packed.atom`` hand the MMA,
    computed as DecINT8Form / Frag16INT8Form do: the lane's code words, its record loaded at the
    kernel's own address (group shift from ops.kernel_member), the header's PRMT selectors,
    FP16 subtract and multiply (torch's float16 ops round once, as HADD2 / HMUL2). ``fold``
    (m16n8k16): Frag16INT8FoldForm's exact integers code - zero times the record's scale in FP64."""
    atom = packed.atom
    geo = geometry(atom)
    tile, kbk = geo.tile_n, geo.k_block
    tiles, kblocks = packed.n_pad // tile, packed.k_pad // kbk
    # the group shift as ops.kernel_member derives it (asked below of the real package's weights;
    # a mutant's packed class is not the registry's)
    runs = packed.group_size // geo.lane_run
    assert runs >= 1 and runs & (runs - 1) == 0 and packed.group_size % geo.lane_run == 0, \
        f"record span {packed.group_size} is not a power-of-two number of {atom} lane runs"
    gs = runs.bit_length() - 1
    if isinstance(packed, int8_layout.PackedINT8):
        assert ops.kernel_member(ops.operands(packed))[1] == gs
    rec = packed.record_bytes
    sym = packed.symmetric
    raw = packed.codes.to(torch.int64).view(tiles, kblocks, 32, 8, 4)
    words = sum(raw[..., i] << (8 * i) for i in range(4))                     # [tiles, kb, lane, 8]
    sb = packed.scales.to(torch.int64)
    out = torch.full((packed.n_pad, packed.k_pad), float("nan"), dtype=torch.float64)
    ti = torch.arange(tiles).view(-1, 1)
    kb = torch.arange(kblocks).view(1, -1)

    def load(off, nbytes):
        return sum(sb[off + i] << (8 * i) for i in range(nbytes))

    def operand(word, h, zb, scale):
        biased = _prmt(word, 0x64, consts[atom, "half1" if h else "half0"])
        lo, hi = _halves(biased)
        zlo, zhi = _halves(zb)
        if fold:
            return [(lo - zlo).double() * scale[0], (hi - zhi).double() * scale[1]]
        return [((lo - zlo) * scale[0]).double(), ((hi - zhi) * scale[1]).double()]

    for lane in range(32):
        if atom == "m8n8k4":
            groups = (kblocks + (1 << gs) - 1) >> gs
            r = load((ti * groups * 32 + lane) * rec + (kb >> gs) * 32 * rec, rec)
            if sym:
                zb = torch.full_like(r, consts[atom, "sym_zero"])
                sc = _halves(_prmt(r, 0, consts[atom, "sym_scale"]))
            else:   # one register: (1024 + zero) low, the scale high, broadcast by the half selectors
                both = _prmt(r, 0x64, consts[atom, "zero_scale"])
                zlo, sc_hi = _halves(both)
                zb = (both & 0xFFFF) | ((both & 0xFFFF) << 16)
                sc = (sc_hi, sc_hi)
            row = LANE_ROW_M8N8K4[lane]
            for w in range(8):
                for h in range(2):
                    a = operand(words[:, :, lane, w], h, zb, sc)
                    for e in range(2):
                        cols = (kb * 32 + 4 * w + 2 * h + e).expand(tiles, -1)
                        out[(ti * tile + row).expand(-1, kblocks), cols] = a[e]
        else:
            g4, t4 = lane >> 2, lane & 3
            groups = (4 * kblocks + (1 << gs) - 1) >> gs
            base = (ti * groups + (t4 >> gs)) * (16 * rec) + g4 * (2 * rec) + ((4 * kb) >> gs) * (16 * rec)
            if sym:
                both = load(base, 4)
                s_g, s_g8 = _halves(both)
                recs = [(torch.full_like(both, consts[atom, "sym_zero"]), (s_g, s_g)),
                        (torch.full_like(both, consts[atom, "sym_zero"]), (s_g8, s_g8))]
            else:
                recs = []
                for h in range(2):
                    r = load(base + h * rec, 4)
                    s_h = _halves(r)[0]
                    recs.append((_prmt(r, 0x64, consts[atom, "zero"]), (s_h, s_h)))
            for s in range(4):
                for wq in range(2):          # word 2s + wq: the step's inputs 0, 1 (wq = 0) or 2, 3
                    for h in range(2):       # bytes 2h, 2h + 1: row g (h = 0) or g + 8
                        zb, sc = recs[h]
                        a = operand(words[:, :, lane, 2 * s + wq], h, zb, sc)
                        for e in range(2):
                            col = (kb * 64 + 16 * t4 + 4 * s + 2 * wq + e).expand(tiles, -1)
                            out[(ti * tile + g4 + 8 * h).expand(-1, kblocks), col] = a[e]
    assert not bool(out.isnan().any()), "replay: some operand was never made"
    return out


def check_decoders(m, consts):
    """The replayed operands are fp16((code - zero) * scale) for every weight (the folded form: the
    exact (code - zero) * scale) on both atoms, both members, groups of 32 / 128 and per channel
    (K not a multiple of either k-block, an odd number of k-blocks): the fragment maps, the record
    addresses and slots, the per-channel group shift and the header's selectors agree."""
    gen = _gen(15)
    for atom in formats.ATOMS:
        for sym in (False, True):
            for n, k, g in ((40, 224, 32), (33, 384, 128), (17, 160, CHANNEL)):
                cols = 1 if g == CHANNEL else k // g
                codes = _bytes_u8((n, k), gen)
                codes[0, :] = torch.arange(k) % 256
                s = (torch.exp2(torch.randint(-14, -2, (n, cols), generator=gen).float())
                     * (1 + torch.randint(0, 1024, (n, cols), generator=gen).float() / 1024)).half()
                z = None if sym else _bytes_u8((n, cols), gen)
                src = (codes, s) if sym else (codes, s, z)
                p = m.prepack(*src, atom=atom)
                exact = _oracle(codes, s, z, g)
                got = replay_decoder(p, consts)[:n, :k]
                assert torch.equal(got, exact.half().double()), f"{atom} sym={sym} g={g}: decoded operands"
                if atom == "m16n8k16":
                    assert torch.equal(replay_decoder(p, consts, fold=True)[:n, :k], exact), \
                        f"sym={sym} g={g}: folded operands times the record's scale"


# ------------------------------------------------------------------------------------- tests
def test_registry_data():
    assert families.numerics("int8").fmt is INT8 and families.numerics("int8_sym").fmt is INT8_SYM
    assert INT8.family == INT8_SYM.family == "int8" and INT8.route_prefix == INT8_SYM.route_prefix == "qpn8i"
    assert INT8.roles == ("codes", "group_scales", "zero_points") and INT8_SYM.roles == ("codes", "group_scales")
    assert INT8.group_sizes == INT8_SYM.group_sizes == (32, 64, 128) and INT8.scale_dtype == "float16"
    assert INT8.codes_per_byte == 1 and INT8.code_dtype == "uint8" and INT8.output_scale == "none"
    # served: the lookups, routes, census and gates name it; integer codes, per-channel groups too
    assert INT8.served and INT8_SYM.served and INT8.code_type == INT8_SYM.code_type == "int"
    assert INT8.channel_groups and formats.integer_family(8) == "int8"
    assert {INT8, INT8_SYM} <= set(formats.KERNEL_FORMATS) and {INT8, INT8_SYM} <= set(formats.WEIGHT_FORMATS)
    assert formats.KERNEL_FAMILIES["int8"] is INT8 and formats.FAMILIES["int8"] is INT8
    assert formats.find_format("int8") is INT8 and formats.weight_format("int8_sym") is INT8_SYM
    assert INT8.kernel_atoms == INT8_SYM.kernel_atoms == ("m8n8k4", "m16n8k16") and not INT8.has_s7_form
    assert INT8.moe_atoms == INT8_SYM.moe_atoms == () and INT8.moe_entry_points("m8n8k4") == ()
    # route prefixes: unique, none is another's prefix followed by "_" (how routes and kernels are owned)
    prefixes = [f.route_prefix for f in formats.ALL_FAMILIES.values()]
    assert len(set(prefixes)) == len(prefixes)
    assert not any(a != b and b.startswith(a + "_") for a in prefixes for b in prefixes)
    assert formats.format_for_route("qpn8i_mt2") is INT8
    assert formats.format_for_route("qpn8_mt2") is formats.FP8_TENSOR
    assert routes.as_route("qpn8i_chunked").format == "int8" and routes.as_route("qpn8_chunked").format == "fp8"
    # one byte per code, a float16 scale and (asymmetric) a byte-wide zero point per group of 128
    assert INT8.bytes_per_weight == pytest.approx(1 + 3 / 128) and INT8_SYM.bytes_per_weight == pytest.approx(1 + 2 / 128)
    assert INT8.dense_entry_points("m8n8k4") == ("qpn8i_mt1_m8n8k4", "qpn8i_mt2_m8n8k4", "qpn8i_reconstruct_ws_m8n8k4")
    assert INT8_SYM.dense_entry_points("m8n8k4") == ("qpn8i_sym_mt1_m8n8k4", "qpn8i_sym_mt2_m8n8k4",
                                                     "qpn8i_sym_reconstruct_ws_m8n8k4")
    assert INT8.dense_entry_points("m16n8k16") == ("qpn8i_reconstruct_ws_m16n8k16",)
    assert [k.decoder for k in INT8.m8n8k4_kernels()] == ["DecINT8"] * 3
    assert [k.decoder for k in INT8_SYM.m8n8k4_kernels()] == ["DecINT8Sym"] * 3


def test_no_runtime_code_branches_on_the_family_name():
    """Only the family's own package names it among kernels/ modules."""
    for path in KERNELS.glob("*.py"):
        assert not re.search(r"""["']int8(_sym)?["']|qpn8i""", path.read_text()), path.name


def test_every_code_and_every_zero_point():
    check_codec(INT8_FAMILY)


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_every_code_and_zero_point_through_the_packed_buffers_and_references(sym):
    """The same source (every code against every zero point) through prepack on both atoms: the
    packed decode, the float64 reference and the float32 one with FP16 operands."""
    n, k, g = 256, 256, 32
    codes = torch.stack([torch.roll(torch.arange(256), r) for r in range(n)]).to(torch.uint8)
    z = torch.arange(n).view(n, 1).expand(n, k // g).to(torch.uint8).contiguous()
    s = (torch.exp2(-torch.arange(k // g).double()).repeat(n, 1) * (1 + (torch.arange(n).view(-1, 1) % 16) / 16)).half()
    src = (codes, s) if sym else (codes, s, z)
    want = _oracle(codes, s, None if sym else z, g)
    num = families.numerics(INT8_SYM if sym else INT8)
    assert torch.equal(num.decode_f64(*src), want) and torch.equal(num.decode_f32(*src).double(), want)
    x = torch.randn(3, k, generator=_gen(1)).half()
    for atom in formats.ATOMS:
        p = num.prepack(*src, atom=atom)
        w, ones = num.decode_packed(p)
        assert torch.equal(w.double(), want) and torch.equal(ones, torch.ones(n))
        assert torch.allclose(num.reference_linear_f64(x, p), x.double() @ want.t(), rtol=1e-12, atol=1e-12)
        y = num.reference_linear(x, p)
        assert y.dtype == torch.float16 and torch.equal(y, (x.float() @ want.half().float().t()).half())
        assert torch.equal(ops.qpn_linear(x, p), y)   # the CPU path of the custom op: the reference


def test_the_decoder_arithmetic_is_exact_for_every_code_and_zero_point():
    """What both atoms' decoders compute per weight, for every code c and zero point z (0..255) and
    scales over every binade (subnormals, and large enough that (c - z) * scale overflows): the
    byte under 0x64 is the FP16 1024 + c, the FP16 difference with 1024 + z is exactly c - z, and
    one FP16 multiply gives fp16((c - z) * scale), the operand the reference rounds to."""
    c = torch.arange(256).view(-1, 1).expand(256, 256).reshape(-1)
    z = torch.arange(256).view(1, -1).expand(256, 256).reshape(-1)
    biased = (0x6400 | c).to(torch.int16).view(torch.float16)
    assert torch.equal(biased.double(), 1024.0 + c.double())
    diff = biased - (0x6400 | z).to(torch.int16).view(torch.float16)
    assert torch.equal(diff.double(), (c - z).double())
    for e in range(-24, 16):
        for mant in (1.0, 1.5, 1.9990234375):
            s = torch.tensor(mant * 2.0 ** e, dtype=torch.float64)
            s16 = s.half()
            if not bool(torch.isfinite(s16)) or float(s16) == 0:
                continue
            got = diff * s16
            want = ((c - z).double() * float(s16)).half()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (e, mant)


@pytest.mark.parametrize("fmt", [INT8, INT8_SYM], ids=lambda f: f.key)
def test_decode_and_quantize_round_trip_every_zero_point_and_scale(fmt):
    """A source holding every positive finite float16 scale (0x0001..0x7BFF, subnormals included,
    one group each), codes 0 and 255 in every group (so min/max quantization is pinned) and every
    code elsewhere, and, asymmetric, every zero point 0..255 (zero = group index mod 256):
    quantizing the decoded weight gives the source back, bit for bit."""
    sym = fmt is INT8_SYM
    scale_bits = torch.arange(1, 0x7C00, dtype=torch.int32)                  # 31743 groups
    groups, g, per_row = scale_bits.numel(), 32, 16
    rows = -(-groups // per_row)
    bits = torch.cat([scale_bits, torch.full((rows * per_row - groups,), 0x3C00, dtype=torch.int32)])
    scales = bits.to(torch.int16).view(torch.float16).view(rows, per_row)
    gi = torch.arange(rows * per_row).view(rows, per_row, 1)
    codes = (torch.arange(g).view(1, 1, g) * 8 + gi) % 256
    codes[..., 0], codes[..., 1] = 0, 255
    codes = codes.reshape(rows, per_row * g).to(torch.uint8)
    zeros = None if sym else (gi.view(rows, per_row) % 256).to(torch.uint8)
    src = (codes, scales) if sym else (codes, scales, zeros)
    num = families.numerics(fmt)
    assert set(codes.unique().tolist()) == set(range(256))
    if not sym:
        assert set(zeros.unique().tolist()) == set(range(256))
    w64 = num.decode_f64(*src)
    assert torch.equal(w64, _oracle(codes, scales, zeros, g))
    q = num.quantize(w64.float(), g)
    assert len(q) == len(fmt.roles) == len(src)
    assert torch.equal(q[0], codes)
    assert torch.equal(q[1].view(torch.int16), scales.view(torch.int16))
    if not sym:
        assert torch.equal(q[2], zeros)


@pytest.mark.parametrize("atom", formats.ATOMS)
@pytest.mark.parametrize("g", [32, 64, 128, CHANNEL], ids=["g32", "g64", "g128", "channel"])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_groups_quantize_prepack_reference(g, atom, sym):
    fmt = INT8_SYM if sym else INT8
    num = families.numerics(fmt)
    w = torch.randn(45, 384, generator=_gen(abs(g))) * 0.05
    src = num.quantize(w, g)
    assert src[1].shape == (45, 1 if g == CHANNEL else 384 // g)
    assert int8_codec.group_size_of(src[0], src[1], fmt) == g
    rel = float((num.decode_f32(*src) - w).norm() / w.norm())
    assert rel < (0.02 if g == CHANNEL else 0.01), rel
    p = num.prepack(*src, atom=atom, rows_per_chunk=32)
    span = int8_layout.record_span(p.k_pad) if g == CHANNEL else g
    assert isinstance(p, num.packed_type) and formats.format_of(p) is fmt and p.group_size == span
    assert p.per_channel == (g == CHANNEL) and (p.groups_pad == 1 or g != CHANNEL)
    num.verify_roundtrip(p, *src)
    again = num.packed_from_tensors(*families.kernel_tensors(p), p.n, p.k, atom)
    assert again.group_size == span and again.symmetric == sym and torch.equal(again.scales, p.scales)
    # the group shift the kernels get: a power-of-two number of lane runs per record, and for a
    # per-channel weight enough that every k-block of the padded K maps to record 0
    member, shift = ops.kernel_member(ops.operands(p))
    assert member is fmt and (geometry(atom).lane_run << shift) == span
    if g == CHANNEL:
        runs = p.k_pad // geometry(atom).lane_run
        assert ((runs - 1) >> shift) == 0
    x = torch.randn(4, 384, generator=_gen(3)).half()
    y64 = num.reference_linear_f64(x, p)
    assert torch.allclose(y64, x.double() @ num.decode_f64(*src).t(), rtol=1e-12, atol=1e-12)
    assert float((num.reference_linear(x, p).double() - y64).norm() / y64.norm()) < 2e-3
    moved = p.to("cpu")
    assert moved.group_size == span and moved.symmetric == sym and formats.format_of(moved) is fmt


def test_per_channel_is_one_group_spanning_k():
    """A source with one scale column is per channel whatever K is: with K one of the group sizes
    it is the same source as that group (so the same packed bytes), otherwise its record spans
    the padded K rounded up to a power of two."""
    w = torch.randn(8, 128, generator=_gen(5))
    ch, grp = int8_codec.quantize(w, CHANNEL), int8_codec.quantize(w, 128)
    assert all(torch.equal(a, b) for a, b in zip(ch, grp))
    for atom in formats.ATOMS:
        a, b = int8_layout.prepack(*ch, atom=atom), int8_layout.prepack(*grp, atom=atom)
        assert a.group_size == b.group_size == 128 and torch.equal(a.scales, b.scales)
    assert [int8_layout.record_span(k) for k in (32, 64, 96, 128, 160, 4096, 4160)] == [32, 64, 128, 128, 256, 4096, 8192]
    p = int8_layout.prepack(*int8_codec.quantize(torch.randn(8, 96, generator=_gen(6)), CHANNEL), atom="m16n8k16")
    assert (p.k_pad, p.group_size, p.groups_pad, p.scale_cols) == (128, 128, 1, 1)
    # K = 32 per channel on m16n8k16 (one 64-input k-block): one record, not two groups of 32
    p32 = int8_layout.prepack(*int8_codec.quantize(torch.randn(8, 32, generator=_gen(7)), CHANNEL), atom="m16n8k16")
    assert (p32.group_size, p32.groups_pad) == (64, 1)
    assert families.numerics(INT8).packed_from_tensors(*families.kernel_tensors(p32), 8, 32, "m16n8k16").group_size == 64


def test_malformed_sources_are_refused():
    with pytest.raises(formats.FormatError, match="multiple of 32"):
        int8_codec.check_source(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1).half())
    with pytest.raises(formats.FormatError, match="whole number of groups"):
        int8_codec.check_source(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 5).half())
    with pytest.raises(formats.FormatError, match="no group size 48"):
        int8_codec.check_source(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 2).half())
    with pytest.raises(formats.FormatError, match="float16"):
        int8_codec.check_source(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 1))
    with pytest.raises(formats.FormatError, match="zero_points must be uint8"):
        int8_codec.check_source(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2).half(),
                                torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(formats.FormatError, match="no group size 16"):
        int8_codec.quantize(torch.zeros(4, 64), 16)
    with pytest.raises(formats.FormatError, match="cannot represent exactly"):
        int8_checkpoint.from_pack_quantized(torch.zeros(2, 8, dtype=torch.int32), torch.tensor([[1e-9], [1.0]]), None, None)
    with pytest.raises(formats.FormatError, match="int32"):
        int8_checkpoint.from_gptq(torch.zeros(8, 4, dtype=torch.int64), None, torch.ones(1, 4).half(), None, -1, True)


@pytest.mark.parametrize("n,k,g", [(1, 32, 32), (33, 64, 32), (45, 192, 64), (64, 256, 128), (100, 1024, 128),
                                   (7, 96, 32), (9, 160, CHANNEL), (40, 4096, CHANNEL)])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_inverse_is_byte_identical_over_every_byte(n, k, g, sym):
    gen = _gen(n * k + abs(g))
    cols = 1 if g == CHANNEL else k // g
    count = n * k
    codes = torch.arange(256).repeat(-(-count // 256))[:count]          # each byte value once per 256
    codes = codes[torch.randperm(count, generator=gen)].to(torch.uint8).view(n, k)
    s = _any_f16((n, cols), gen)
    z = None if sym else _bytes_u8((n, cols), gen)
    if count >= 256:
        assert set(codes.unique().tolist()) == set(range(256))
    for atom in formats.ATOMS:
        p = int8_layout.prepack(codes, s, z, atom=atom, rows_per_chunk=32)
        back = int8_layout.unprepack(p, rows_per_chunk=64)
        assert torch.equal(back[0], codes) and torch.equal(back[1].view(torch.int16), s.view(torch.int16))
        assert (len(back) == 2) if sym else torch.equal(back[2], z)
        int8_layout.verify_roundtrip(p, codes, s, z, rows_per_chunk=32)
        # only addresses move: the same bytes plus zero padding
        want = torch.bincount(codes.reshape(-1).long(), minlength=256)
        want[0] += p.n_pad * p.k_pad - n * k
        assert torch.equal(torch.bincount(p.codes.long(), minlength=256), want)
        # bytes of row 0 on both atoms (lane 0's first bytes, slot 0's record): real data at any N
        for field, idx in (("codes", 0), ("scales", 1), ("scales", 2) if not sym else ("codes", 1)):
            bad = getattr(p, field).clone()
            bad[idx] ^= 0x01
            broken = int8_layout.PackedINT8(**{**{f: getattr(p, f) for f in
                                                  ("codes", "scales", "out_scale", "n", "k", "group_size", "symmetric", "atom")},
                                               field: bad})
            with pytest.raises(prepack.PrepackMismatch):
                int8_layout.verify_roundtrip(broken, codes, s, z)
    # a packed weight whose records span another group than the source's is refused too
    if g != CHANNEL and k % (2 * g) == 0 and 2 * g <= 128:
        p = int8_layout.prepack(codes, s, z)
        wrong = int8_layout.PackedINT8(p.codes, p.scales, p.out_scale, n, k, 2 * g, sym, p.atom)
        with pytest.raises(prepack.PrepackMismatch, match="shape mismatch"):
            int8_layout.verify_roundtrip(wrong, codes, s, z)


def test_lane_replay_of_the_fragment_maps():
    check_replay(INT8_FAMILY)


def _headers():
    return (FAMILY_DIR / "m8n8k4.cuh").read_text(), (FAMILY_DIR / "m16n8k16.cuh").read_text()


def test_cpu_replay_of_the_cuda_decoders():
    check_decoders(INT8_FAMILY, header_constants(*_headers()))


def test_gptq_packing():
    check_gptq(INT8_FAMILY)


def test_pack_quantized_packing():
    check_ct_packing(INT8_FAMILY)


def test_gptq_against_vllm(vllm_q):
    """vLLM's own 8-bit GPTQ quantizers and packers (uint8b128 symmetric; uint8 with zero points,
    stored as v2 and as v1, zero - 1): our unpacked source dequantizes to vLLM's reference weight,
    value for value, and its codes are vLLM's."""
    E = vllm_q
    k, n = 256, 32
    gen = _gen(21)
    for g in (32, 64, 128, CHANNEL):
        cols = 1 if g == CHANNEL else k // g
        w = (torch.randn(k, n, generator=gen) * 0.05).half()
        gi = (torch.arange(k) // (k if g == CHANNEL else g)).to(torch.int32)
        w_ref, w_q, w_s = E.qu.gptq_quantize_weights(w, E.types.uint8b128, g)
        qweight = E.qu.gptq_pack(w_q, 8, k, n)
        for g_idx in (None, gi):
            src = INT8_FAMILY.from_gptq(qweight, None, w_s, g_idx, g, True)
            assert len(src) == 2 and torch.equal(INT8_FAMILY.dequantize(*src).half(), w_ref.t()), f"GPTQ sym g={g}"
        assert torch.equal(src[0].t().to(torch.int32), w_q), "GPTQ codes"
        w_ref, w_q, w_s, zp = E.qu.quantize_weights(w, E.types.uint8, g, zero_points=True)
        assert int(zp.min()) >= 1, "test data: v1 cannot store zero 0"
        qweight = E.qu.pack_rows(w_q, 8, k, n)
        for v2, stored in ((True, zp), (False, zp - 1)):
            src = INT8_FAMILY.from_gptq(qweight, E.qu.pack_cols(stored, 8, cols, n), w_s, gi, g, False, v2=v2)
            assert torch.equal(src[2].t().to(torch.int32), zp), f"GPTQ zero points (g={g}, v2={v2})"
            assert torch.equal(INT8_FAMILY.dequantize(*src).half(), w_ref.t()), f"GPTQ asym (g={g}, v2={v2})"


def test_gptq_v1_zero_256_is_refused():
    gen = _gen(5)
    qzeros = torch.tensor([[_word([7, 255, 9, 1])]], dtype=torch.int32)
    with pytest.raises(formats.FormatError, match="zero point 256"):
        int8_checkpoint.from_gptq(torch.zeros(8, 4, dtype=torch.int32), qzeros, _scales(1, 4, gen), None, 32, False)
    # the same word as v2 is four valid zero points
    src = int8_checkpoint.from_gptq(torch.zeros(8, 4, dtype=torch.int32), qzeros, _scales(1, 4, gen), None, 32,
                                    False, v2=True)
    assert src[2].reshape(-1).tolist() == [7, 255, 9, 1]


def test_pack_quantized_against_compressed_tensors(ct):
    """compressed-tensors' own compressor writes 8-bit pack-quantized tensors (groups and channel,
    with and without zero points) and its own decompressor reads them: our source holds its codes
    plus 128 and decodes, rounded once to FP16, to its dequantized weight."""
    gen = _gen(13)
    n, k = 20, 256
    for strategy, g in (("group", 32), ("group", 128), ("channel", None)):
        cols = 1 if g is None else k // g
        for sym in (False, True):
            args = ct.Args(num_bits=8, type="int", symmetric=sym, strategy=strategy,
                           **({"group_size": g} if g else {}))
            scheme = ct.Scheme(targets=["Linear"], weights=args)
            q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
            zp = (torch.zeros(n, cols) if sym else torch.randint(-128, 128, (n, cols), generator=gen)).to(torch.int8)
            s = _scales(n, cols, gen)
            q[0, :] = (torch.arange(k) % 256 - 128).to(torch.int8)     # every code
            if not sym:
                zp[: min(n, 2), 0] = torch.tensor([-128, 127], dtype=torch.int8)[: min(n, 2)]
            sd = {"weight": ct.dequantize(q, s, zp, args), "weight_scale": s}
            if not sym:
                sd["weight_zero_point"] = zp
            out = ct.PQC.compress(sd, scheme)
            assert torch.equal(ct.unpack(out["weight_packed"], 8, (n, k)), q), "test data: library round trip"
            src = INT8_FAMILY.from_pack_quantized(out["weight_packed"], out["weight_scale"],
                                                  out.get("weight_zero_point"), g)
            assert len(src) == (2 if sym else 3)
            assert torch.equal(src[0].to(torch.int16), q.to(torch.int16) + 128), f"CT codes ({strategy})"
            if not sym:
                assert torch.equal(src[2].to(torch.int16), zp.to(torch.int16) + 128), f"CT zero points ({strategy})"
            theirs = ct.PQC.decompress(out, scheme)["weight"]
            assert torch.equal(INT8_FAMILY.dequantize(*src).half(), theirs), f"CT weight ({strategy}, sym={sym})"


def test_act_order():
    """Whole groups stored out of order (g_idx constant on every aligned block) are reordered at
    load, exactly; a g_idx that mixes groups within a block (desc_act) is refused naming the module."""
    gen = _gen(6)
    n, k, g = 16, 256, 32
    groups = k // g
    codes = _bytes_u8((n, k), gen)
    z = _bytes_u8((n, groups), gen)
    s = _scales(n, groups, gen)
    perm = torch.randperm(groups, generator=gen)
    g_idx = perm.repeat_interleave(g).to(torch.int32)          # block b holds group perm[b]
    wp, zp = pack_ct(codes, z)
    src = int8_checkpoint.from_pack_quantized(wp, s, zp, g, g_idx=g_idx, module="model.layers.0.mlp.down_proj")
    gi = g_idx.long()
    want = (codes.double() - z.double()[:, gi]) * s.double()[:, gi]
    assert torch.equal(int8_codec.dequantize(*src).double(), want)
    trivial = int8_checkpoint.from_pack_quantized(wp, s, zp, g, g_idx=torch.arange(k) // g)
    plain = int8_checkpoint.from_pack_quantized(wp, s, zp, g)
    assert all(torch.equal(a, b) for a, b in zip(trivial, plain))
    desc = torch.randperm(k, generator=gen) // g
    with pytest.raises(int8_checkpoint.ActOrderError, match=r"model\.layers\.0\.mlp\.down_proj.*desc_act"):
        int8_checkpoint.from_pack_quantized(wp, s, zp, g, g_idx=desc, module="model.layers.0.mlp.down_proj")
    assert issubclass(int8_checkpoint.ActOrderError, formats.FormatError)


@pytest.mark.parametrize("sym", [False, True])
def test_kernel_tensors_handed_out_per_call_match_the_eager_cache(sym):
    """packed_tensors views the records afresh on every call; the eager launch cache
    (sm80_plan.eager_tiled) must see the same bytes there, and a replaced record tensor as replaced."""
    from qpn.kernels import sm80_plan

    w = torch.randn((16, 256), generator=_gen(5)) * 0.02
    packed = int8_layout.prepack(*int8_codec.quantize(w, 128, symmetric=sym), atom="m16n8k16")
    num = families.numerics(packed)
    first, again = num.packed_tensors(packed), num.packed_tensors(packed)
    assert first[1] is not again[1] and first[1].dtype == (torch.int16 if sym else torch.int32)
    assert all(sm80_plan.same_tensor(a, b) for a, b in zip(first, again))
    packed.scales = packed.scales.clone()
    assert not sm80_plan.same_tensor(first[1], num.packed_tensors(packed)[1])


# -------------------------------------------------------------------------------- mutations
def _mutant(tmp_path, monkeypatch, old, new):
    """A copy of the family's package with ``old`` replaced by ``new`` in the one module holding it,
    imported as qpn.kernels.families._int8_mutant, as one namespace."""
    holders = [p.name for p in FAMILY_DIR.glob("*.py") if old in p.read_text()]
    assert len(holders) == 1 and (FAMILY_DIR / holders[0]).read_text().count(old) == 1, \
        f"mutation anchor not found once: {old!r} in {holders}"
    copy = tmp_path / "_int8_mutant"
    shutil.copytree(FAMILY_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / holders[0]).write_text((copy / holders[0]).read_text().replace(old, new))
    name = "qpn.kernels.families._int8_mutant"
    for stale in [k for k in sys.modules if k.startswith(name + ".")]:   # an earlier test's mutant
        del sys.modules[stale]
    spec = importlib.util.spec_from_file_location(name, copy / "__init__.py", submodule_search_locations=[str(copy)])
    pkg = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, pkg)   # dataclasses and relative imports look it up there
    spec.loader.exec_module(pkg)
    return family_namespace(name)


MUTATIONS = [
    ("big-endian words (both unpackers)", "integer.word_values(words, dim, 8, _TITLE)",
     "integer.word_values(words, dim, 8, _TITLE).flip(dim + 1)",
     "gptq"),
    ("off-by-one GPTQ v1 zero point", "+ (0 if v2 else 1)", "+ (0 if v2 else 0)", "gptq"),
    ("GPTQ scales reshaped, not transposed", 's = _f16_scales(scales, "GPTQ scales").t().contiguous()',
     's = _f16_scales(scales, "GPTQ scales").reshape(n, -1)', "gptq"),
    ("CT zero points unpacked along K", "z = _bytes(weight_zero_point, 0).reshape(-1, k // g)[:n]",
     "z = _bytes(weight_zero_point, 1).reshape(-1, k // g)[:n]", "ct"),
    ("symmetric zero point 127", "SYM_ZERO = 128 ", "SYM_ZERO = 127 ", "codec"),
    ("m8n8k4 code bytes swapped in pairs", "flat += [row * geo.k_block + j for j in range(geo.k_block)]",
     "flat += [row * geo.k_block + (j ^ 1) for j in range(geo.k_block)]", "replay"),
    ("m16n8k16 rows of a word's halves swapped", "(g + 8 * ((q >> 1) & 1)) * geo.k_block",
     "(g + 8 * (1 - ((q >> 1) & 1))) * geo.k_block", "replay"),
    ("m16n8k16 record slots", "rows = [g + 8 * h for g in range(8) for h in range(2)]",
     "rows = [g + 8 * h for h in range(2) for g in range(8)]", "replay"),
    ("per-channel record spans only the padded K", "return 1 << max(0, (k_pad - 1).bit_length())",
     "return k_pad", "decoders"),
]


@pytest.mark.parametrize("name,old,new,check", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(name, old, new, check, tmp_path, monkeypatch):
    consts = header_constants(*_headers())
    runs = {"gptq": check_gptq, "ct": check_ct_packing, "codec": check_codec, "replay": check_replay,
            "decoders": lambda m: check_decoders(m, consts)}
    runs[check](INT8_FAMILY)                       # control: the real package passes
    mutant = _mutant(tmp_path, monkeypatch, old, new)
    with pytest.raises((AssertionError, formats.FormatError, RuntimeError, IndexError, ValueError)):
        runs[check](mutant)


HEADER_MUTATIONS = [
    ("m8n8k4: a word's halves swapped", 0, "h ? 0x4342u : 0x4140u", "h ? 0x4140u : 0x4342u"),
    ("m8n8k4: bytes of a half swapped", 0, "h ? 0x4342u : 0x4140u", "h ? 0x4243u : 0x4041u"),
    ("m8n8k4: zero bias reads the pad byte", 0, "prmt(rec, 0x64u, 0x1042u); }\n  QPN_DEV static u32 scale2",
     "prmt(rec, 0x64u, 0x1043u); }\n  QPN_DEV static u32 scale2"),
    ("m8n8k4: symmetric zero point 127", 0, "SYM ? 0x64806480u", "SYM ? 0x647F647Fu"),
    ("m16n8k16: a word's halves swapped", 1, "h ? 0x4342u : 0x4140u", "h ? 0x4140u : 0x4342u"),
    ("m16n8k16: zero bias reads the scale's high byte", 1, "prmt(sc[h], 0x64u, 0x4242u)", "prmt(sc[h], 0x64u, 0x4141u)"),
]


@pytest.mark.parametrize("name,which,old,new", HEADER_MUTATIONS, ids=[m[0] for m in HEADER_MUTATIONS])
def test_a_decoder_header_mutation_is_caught(name, which, old, new):
    """The CPU replay reads its constants from the headers, so a wrong selector or constant there
    fails it (the GPU tests would too, on a GPU)."""
    texts = list(_headers())
    assert texts[which].count(old) == 1, f"mutation anchor not found once: {old!r}"
    texts[which] = texts[which].replace(old, new)
    with pytest.raises(AssertionError):
        check_decoders(INT8_FAMILY, header_constants(*texts))
