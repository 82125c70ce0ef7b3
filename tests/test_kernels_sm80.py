"""The sm_80+ atom (m16n8k16) on the CPU: its prepack and verified inverse, the reference on its
packed buffers, a lane-by-lane replay of the kernel's decode through the PTX fragment layout of
mma.m16n8k16 (proves the fragment maps and the m16n8k16 decoders agree before any GPU time), the
split-K work partition, the NVRTC build for sm_80 / sm_90 (no spill, no local memory, HMMA.16816
in every GEMM kernel), and the opt-in switch for sm_80+ serving."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

from qpn.kernels import codecs, formats, jit, nvrtc, ops, prepack, routes, sm80_plan, sm80_tables
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.nvfp4 import numerics as nvfp4_numerics
from qpn.kernels.families.fp8 import codec as fp8_codec
from qpn.kernels.families.fp8 import layout as fp8_layout
from qpn.kernels.families.fp8 import numerics as fp8_numerics
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import layout as int4_layout
from qpn.kernels import families
from qpn.kernels.atoms import arch_for_atom, atom_for_arch, geometry
from tests import _format_cases as fc

ATOM = "m16n8k16"
M32 = 0xFFFFFFFF


@pytest.mark.fast
# ----------------------------------------------------------------------------- geometry
def test_geometry_is_a_permutation_with_the_sm70_block_sizes():
    g, g70 = geometry(ATOM), geometry("m8n8k4")
    assert (g.tile_n, g.k_block) == (16, 64)
    for maps in (nvfp4_layout.code_maps, nvfp4_layout.scale_maps, fp8_layout.code_maps):
        gather, scatter = maps(ATOM)
        assert sorted(gather.tolist()) == list(range(gather.numel()))
        assert torch.equal(gather[scatter], torch.arange(gather.numel()))
        assert gather.numel() == maps("m8n8k4")[0].numel()
    codes, _ = nvfp4_layout.code_maps(ATOM)
    row_of, k_of = (codes // g.k_block).tolist(), (codes % g.k_block).tolist()
    # NVFP4: MMA step s (word s of every lane) is exactly group s of the k-block, so one MMA never
    # adds products of two different group scales (the overflow trap's cancellation stays exact)
    for s in range(4):
        ks = [k_of[32 * lane + 8 * s + j] for lane in range(32) for j in range(8)]
        assert sorted(set(ks)) == list(range(16 * s, 16 * s + 16))
    scales, _ = nvfp4_layout.scale_maps(ATOM)
    gpb = g.k_block // 16
    for lane in range(32):
        assert set(row_of[32 * lane: 32 * lane + 32]) == {lane >> 2, (lane >> 2) + 8}
        # its 8 scale bytes (8g ..): (g, grp 0), (g+8, grp 0), (g, grp 1), ... -- one e4m3 pair per step
        gq = lane >> 2
        assert [divmod(int(scales[8 * gq + i]), gpb) for i in range(8)] == \
            [(gq + 8 * (i & 1), i >> 1) for i in range(8)]
    assert g70.tile_n == 32


@pytest.mark.fast
def test_atom_for_arch():
    assert atom_for_arch("sm70") == "m8n8k4" and atom_for_arch(75) == "m8n8k4"
    assert atom_for_arch("sm_80") == "m16n8k16" and atom_for_arch((9, 0)) == "m16n8k16"
    assert atom_for_arch("sm86") == "m16n8k16"
    with pytest.raises(ValueError, match="sm_61"):
        atom_for_arch(61)
    with pytest.raises(ValueError, match="architecture"):
        atom_for_arch("ampere")
    with pytest.raises(ValueError, match="unknown MMA atom"):
        geometry("m16n8k8")


@pytest.mark.fast
# ------------------------------------------------------------------------------ prepack
@pytest.mark.parametrize("n,k", [(1, 16), (15, 48), (16, 64), (17, 80), (33, 112), (100, 1008), (3, 2064)])
def test_nvfp4_roundtrip_byte_identical(n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    p = nvfp4_layout.prepack(w, s, torch.tensor(0.5), atom=ATOM, rows_per_chunk=32)
    assert p.atom == ATOM and p.n_pad % 16 == 0 and p.k_pad % 64 == 0
    assert p.codes.numel() == p.n_pad * p.k_pad // 2 and p.scales.numel() == p.n_pad * p.k_pad // 16
    nvfp4_layout.verify_roundtrip(p, w, s, rows_per_chunk=16)
    w2, s2 = nvfp4_layout.unprepack(p)
    assert torch.equal(w2, w) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    # a single flipped nibble is found and named (byte 0, high nibble: row 0, input 2)
    p.codes[0] ^= 0x10
    with pytest.raises(prepack.PrepackMismatch, match="row 0"):
        nvfp4_layout.verify_roundtrip(p, w, s)


@pytest.mark.fast
@pytest.mark.parametrize("n,k,per_channel", [(1, 1, False), (7, 3, True), (17, 65, False), (64, 100, True),
                                             (100, 1001, False)])
def test_fp8_roundtrip_byte_identical(n, k, per_channel):
    g = torch.Generator().manual_seed(n + 7 * k)
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=g) + 0.5 if per_channel else torch.tensor(0.01)
    p = fp8_layout.prepack(w, scale, atom=ATOM, rows_per_chunk=16)
    fp8_layout.verify_roundtrip(p, w, scale)
    w2, _ = fp8_layout.unprepack(p)
    assert torch.equal(w2.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.fast
def test_reference_on_m16n8k16_buffers_equals_the_sm70_atom_and_float64():
    g = torch.Generator().manual_seed(11)
    w = torch.randn((70, 320), generator=g) * 0.05
    q, s, gs = nvfp4_codec.quantize(w)
    x = torch.randn((9, 320), generator=g).half()
    x[:, 5] = 3000.0
    a, b = nvfp4_layout.prepack(q, s, gs), nvfp4_layout.prepack(q, s, gs, atom=ATOM)
    assert torch.equal(families.reference_linear_f64(x, a), families.reference_linear_f64(x, b))
    assert torch.equal(families.reference_linear_f64(x, b), x.double() @ nvfp4_codec.dequantize_f64(q, s, gs).t())
    # qpn_linear on CPU (the custom op, atom passed through) is the reference on those buffers
    assert torch.equal(ops.qpn_linear(x, b), nvfp4_numerics.linear(x, b))
    f, fs = fp8_codec.quantize(w, per_channel=True)
    c = fp8_layout.prepack(f, fs, atom=ATOM)
    assert torch.equal(ops.qpn_linear(x, c), fp8_numerics.linear(x, c))


# ------------------------------------------------- lane-level replay of the kernel's decode
def _words(raw: torch.Tensor) -> torch.Tensor:
    """[..., 4*W] bytes -> [..., W] little-endian u32 words (int64)."""
    b = raw.to(torch.int64).reshape(*raw.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _h2(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f16x2 register -> (low half, high half) as float64."""
    def half(u):
        u = torch.where(u >= 0x8000, u - 0x10000, u)
        return u.to(torch.int16).view(torch.float16).double()
    return half(word & 0xFFFF), half((word >> 16) & 0xFFFF)


def _and_or(a, m, b):
    return (a & m) | b


def _e2m1x2_pair(v, r):          # csrc/qpn_family.cuh e2m1x2_pair<R>
    mag = (v >> 3) if r == 0 else ((v << (4 * r - 3)) & M32)
    return _and_or(mag, 0x0E000E00, ((v << (4 * r)) & M32) & 0x80008000)


def _e2m1x2_quad(v):             # csrc/qpn_family.cuh e2m1x2_quad (what Frag16NVFP4 runs)
    odd = v & 0xF0F0F0F0
    even = (v << 4) & 0xF0F0F0F0
    k = 0x8E008E00
    return [((odd >> 3) | odd) & k, ((even >> 3) | even) & k,
            (((odd << 5) & M32) | ((odd << 8) & M32)) & k, (((even << 5) & M32) | ((even << 8) & M32)) & k]


@pytest.mark.fast
def test_quad_decoder_equals_the_pair_decoder_on_every_nibble_pattern():
    g = torch.Generator().manual_seed(4)
    v = torch.randint(0, 2 ** 32, (200_000,), dtype=torch.int64, generator=g)
    v = torch.cat([v, torch.tensor([0, M32, 0x88888888, 0x77777777, 0x12345678, 0xF0F0F0F0, 0x0F0F0F0F])])
    for r, h in enumerate(_e2m1x2_quad(v)):
        assert torch.equal(h, _e2m1x2_pair(v, r))


def _e4m3x2_bits(t):             # csrc/qpn_family.cuh e4m3x2_bits
    return _and_or(t >> 1, 0x3F803F80, t & 0x80008000)


def _exact_f16_mul(a, b):
    """mul.rn.f16x2 of one half: the product must be representable (the decoders' claim)."""
    p = a * b
    assert torch.equal(p.half().double(), p), "an FP16 operand multiply rounded"
    return p


def _scales_sm89(sp, up):
    """Frag16NVFP4Scaled<up>::step_scales, sm_89+ path: cvt.rn.f16x2.e4m3x2 of the step's byte pair,
    times 2^up (up = 0: the scales as they are); the two halves (rows g, g+8) are then broadcast
    (dup_lo / dup_hi)."""
    e4 = codecs.e4m3_table(torch.float64)
    return _exact_f16_mul(e4[sp & 0xFF], 2.0 ** up), _exact_f16_mul(e4[(sp >> 8) & 0xFF], 2.0 ** up)


def _scales_sm80(sp, up):
    """Frag16NVFP4Scaled<up>::step_scales, sm_80 path: prmt the pair to bytes 1 and 3, e4m3x2_bits,
    * 2^(8 + up)."""
    b0, b1 = sp & 0xFF, (sp >> 8) & 0xFF
    lo, hi = _h2(_e4m3x2_bits((b0 << 8) | (b1 << 24)))
    return _exact_f16_mul(lo, 2.0 ** (8 + up)), _exact_f16_mul(hi, 2.0 ** (8 + up))


def _fp8_pair_sm80(w, sel):
    """cvt_e4m3x2_lo/hi, sm_80 path: prmt (0x1404 / 0x3424), e4m3x2_bits, * 2^8."""
    b = [(w >> (8 * i)) & 0xFF for i in range(4)]
    t = (b[0] << 8) | (b[1] << 24) if sel == "lo" else (b[2] << 8) | (b[3] << 24)
    lo, hi = _h2(_e4m3x2_bits(t))
    return _exact_f16_mul(lo, 256.0), _exact_f16_mul(hi, 256.0)


def _replay(packed, x: torch.Tensor, sm80_paths: bool, up: int = 0) -> torch.Tensor:
    """y (float64) as the sm_80+ kernel computes it: per lane, the registers the decoders produce,
    placed into A / B of mma.m16n8k16 by the PTX fragment layout, D = A B summed over k-blocks.
    NVFP4: ``up`` is Frag16NVFP4Scaled's UP (0: Frag16NVFP4, 7: Frag16NVFP4S7)."""
    g = geometry(ATOM)
    tiles, kblocks = packed.n_pad // 16, packed.k_pad // 64
    m = x.shape[0]
    assert m <= 8
    xp = torch.zeros((8, packed.k_pad), dtype=torch.float64)
    xp[:m, : packed.k] = x.double()
    nv = isinstance(packed, nvfp4_layout.PackedNVFP4)
    words = _words(packed.codes.view(tiles, kblocks, 32, -1))           # [tiles, kb, lane, W]
    if nv:
        sc = packed.scales.view(tiles, kblocks, 8, 4, 2).to(torch.int64)   # [.., g, step, (row g, g+8)]
        sp = sc[..., 0] | (sc[..., 1] << 8)                              # [tiles, kb, g, step]
    A = torch.zeros((tiles, kblocks, 4, 16, 16), dtype=torch.float64)
    B = torch.zeros((kblocks, 4, 16, 8), dtype=torch.float64)
    e4 = codecs.e4m3_table(torch.float64)
    for lane in range(32):
        gq, t = lane >> 2, lane & 3
        for s in range(4):
            if nv:
                sg, sg8 = (_scales_sm80 if sm80_paths else _scales_sm89)(sp[:, :, gq, s], up)
                if sm80_paths:
                    assert torch.equal(torch.stack(_scales_sm89(sp[:, :, gq, s], up)), torch.stack((sg, sg8)))
                v = words[:, :, lane, s]
                regs = []
                for h, scale in zip(_e2m1x2_quad(v), (sg, sg8, sg, sg8)):
                    lo, hi = _h2(h)
                    regs.append((_exact_f16_mul(lo, scale), _exact_f16_mul(hi, scale)))
            else:
                w0, w1 = words[:, :, lane, 2 * s], words[:, :, lane, 2 * s + 1]
                if sm80_paths:
                    regs = [_fp8_pair_sm80(w0, "lo"), _fp8_pair_sm80(w0, "hi"),
                            _fp8_pair_sm80(w1, "lo"), _fp8_pair_sm80(w1, "hi")]
                else:
                    regs = [(e4[(w >> (8 * i)) & 0xFF], e4[(w >> (8 * i + 8)) & 0xFF])
                            for w, i in ((w0, 0), (w0, 2), (w1, 0), (w1, 2))]
            # PTX m16n8k16 A: reg0 (row g, cols 2t, 2t+1), reg1 (g+8, 2t..), reg2 (g, 2t+8..), reg3 (g+8, 2t+8..)
            for (row, col), (lo, hi) in zip(((gq, 2 * t), (gq + 8, 2 * t), (gq, 2 * t + 8), (gq + 8, 2 * t + 8)), regs):
                A[:, :, s, row, col] = lo
                A[:, :, s, row, col + 1] = hi
            # B: reg0 (k 2t, 2t+1; token g), reg1 (k 2t+8, 2t+9); the lane's activation words 2s, 2s+1:
            # inputs 16s + 4t .. +3 (NVFP4, Frag16NVFP4::load_x) or 16t + 4s .. +3 (FP8)
            base = torch.arange(kblocks) * 64 + ((16 * s + 4 * t) if nv else (16 * t + 4 * s))
            B[:, s, 2 * t, gq] = xp[gq, base]
            B[:, s, 2 * t + 1, gq] = xp[gq, base + 1]
            B[:, s, 2 * t + 8, gq] = xp[gq, base + 2]
            B[:, s, 2 * t + 9, gq] = xp[gq, base + 3]
    D = torch.einsum("tksij,ksjn->tin", A, B)                              # [tiles, 16 rows, 8 tokens]
    y = D.reshape(tiles * 16, 8).t()[:m, : packed.n]
    if nv:
        return y * (packed.global_scale.double() * 2.0 ** (14 - up))   # Frag16NVFP4Scaled<up>::OUT_MULT
    return y * fp8_codec.channel_scales(packed.scale, packed.n).double().reshape(1, -1)


@pytest.mark.fast
@pytest.mark.parametrize("up", [0, 7], ids=["unit_scale", "scale_x128"])
@pytest.mark.parametrize("sm80_paths", [False, True], ids=["sm89_cvt", "sm80_bits"])
@pytest.mark.parametrize("n,k,m", [(48, 1008, 5), (16, 64, 8), (33, 160, 1)])
def test_replayed_nvfp4_fragments_give_the_exact_product(n, k, m, sm80_paths, up):
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0x01, 0x7E, (n, k // 16), dtype=torch.uint8, generator=g)
    s[:, ::3] = torch.randint(1, 8, s[:, ::3].shape, dtype=torch.uint8, generator=g)   # e4m3 subnormals
    s[0, 0] = 0x7E                                                                      # 448
    p = nvfp4_layout.prepack(w, s.view(torch.float8_e4m3fn), torch.tensor(0.013), atom=ATOM)
    x = torch.randn((m, k), generator=g).half()
    y = _replay(p, x, sm80_paths, up)
    y64 = families.reference_linear_f64(x, p)
    assert float((y - y64).norm() / y64.norm()) < 1e-12


@pytest.mark.fast
@pytest.mark.parametrize("sm80_paths", [False, True], ids=["sm89_cvt", "sm80_bits"])
def test_replayed_fp8_fragments_give_the_exact_product(sm80_paths):
    g = torch.Generator().manual_seed(5)
    w, _ = fc.fp8_weight(40, 200, "all_bytes", g, per_channel=False)   # every finite e4m3 byte
    assert fc.covers_every_fp8_byte(w)
    scale = torch.rand(40, generator=g) + 0.5
    p = fp8_layout.prepack(w, scale, atom=ATOM)
    x = torch.randn((7, 200), generator=g).half()
    y = _replay(p, x, sm80_paths)
    y64 = families.reference_linear_f64(x, p)
    assert float((y - y64).norm() / y64.norm()) < 1e-12


@pytest.mark.fast
def test_replay_detects_a_wrong_layout():
    """The replay is not vacuous: the m8n8k4 bytes read as m16n8k16 give a different product."""
    g = torch.Generator().manual_seed(2)
    w = torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=g)
    s = torch.full((32, 8), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    wrong = nvfp4_layout.prepack(w, s, torch.tensor(1.0), atom="m8n8k4")
    as_sm80 = nvfp4_layout.PackedNVFP4(wrong.codes, wrong.scales, wrong.global_scale, 32, 128, ATOM)
    x = torch.randn((3, 128), generator=g).half()
    y = _replay(as_sm80, x, False)
    y64 = families.reference_linear_f64(x, nvfp4_layout.prepack(w, s, torch.tensor(1.0), atom=ATOM))
    assert float((y - y64).norm() / y64.norm()) > 0.1


def _f16_bits(bits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(bits.to(torch.int16).numpy()).view(torch.float16)


def _replay_int4(packed, x: torch.Tensor, fold: bool = False) -> torch.Tensor:
    """y (float64) as the INT4 m16n8k16 kernels compute it (Frag16INT4Form): the lane's records
    fetched at the kernel's own addresses (tile_records + record_step, group shift from
    ops.kernel_member), the four registers of each step decoded as fp16((code - zero) * scale),
    placed by the PTX fragment layout, with the lane's activations at inputs 16t + 4s .. +3.
    fold: Frag16INT4FoldForm's bit operations instead -- register r of word v takes the byte
    (v >> 8 (r >> 1)) of each half, its low nibble under 0x6400 minus (0x6400 | zero) for row g,
    its high nibble under 0x6400 minus (0x6400 | zero << 4) for row g + 8, both in FP16 -- and the
    fold's FP32 factors, scale for row g and scale * 0.0625 for row g + 8 (exact in float64)."""
    tiles, kblocks = packed.n_pad // 16, packed.k_pad // 64
    m = x.shape[0]
    assert m <= 8
    xp = torch.zeros((8, packed.k_pad), dtype=torch.float64)
    xp[:m, : packed.k] = x.double()
    words = _words(packed.codes.view(tiles, kblocks, 32, -1))           # [tiles, kb, lane, 4]
    _, gs = ops.kernel_member(ops.operands(packed))
    rec = packed.record_bytes
    groups = (4 * kblocks + (1 << gs) - 1) >> gs
    assert groups == packed.groups_pad
    sbytes = packed.scales.to(torch.int64)
    A = torch.zeros((tiles, kblocks, 4, 16, 16), dtype=torch.float64)
    B = torch.zeros((kblocks, 4, 16, 8), dtype=torch.float64)
    kb = torch.arange(kblocks)
    for lane in range(32):
        gq, t = lane >> 2, lane & 3
        # byte offsets of the lane's record of row g (h = 0) and g + 8 (h = 1), per (tile, k-block)
        base = ((torch.arange(tiles)[:, None] * groups + (t >> gs)) * (16 * rec) + gq * 2 * rec
                + ((4 * kb[None, :]) >> gs) * (16 * rec))
        scale, zero = [], []
        for h in range(2):
            o = base + h * rec
            bits = sbytes[o] | (sbytes[o + 1] << 8)
            scale.append(torch.tensor(bits.to(torch.int16).numpy()).view(torch.float16))
            zero.append(torch.full_like(bits, int4_codec.SYM_ZERO) if packed.symmetric else sbytes[o + 2])
        for s in range(4):
            v = words[:, :, lane, s]
            for r, (row, col) in enumerate(((gq, 2 * t), (gq + 8, 2 * t), (gq, 2 * t + 8), (gq + 8, 2 * t + 8))):
                h = r & 1
                for j in range(2):      # pair r: nibbles r (low half) and r + 4 (high half)
                    if fold:
                        byte = (v >> (8 * (r >> 1) + 16 * j)) & 0xFF
                        mask, zbits = (0xF0, 0x6400 | (zero[h] << 4)) if h else (0x0F, 0x6400 | zero[h])
                        op = _f16_bits(0x6400 | (byte & mask)) - _f16_bits(zbits)   # HSUB2
                        factor = scale[h].float() * (0.0625 if h else 1.0)
                        A[:, :, s, row, col + j] = op.double() * factor.double()
                        continue
                    code = (v >> (4 * (r + 4 * j))) & 0xF
                    w16 = ((code - zero[h]).to(torch.float16) * scale[h]).double()   # one FP16 rounding
                    A[:, :, s, row, col + j] = w16
            kx = kb * 64 + 16 * t + 4 * s
            B[:, s, 2 * t, gq] = xp[gq, kx]
            B[:, s, 2 * t + 1, gq] = xp[gq, kx + 1]
            B[:, s, 2 * t + 8, gq] = xp[gq, kx + 2]
            B[:, s, 2 * t + 9, gq] = xp[gq, kx + 3]
    D = torch.einsum("tksij,ksjn->tin", A, B)
    return D.reshape(tiles * 16, 8).t()[:m, : packed.n]


@pytest.mark.fast
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("n,k,g,m", [(48, 224, 32, 5), (16, 320, 64, 8), (33, 384, 128, 1), (40, 640, 128, 3)])
def test_replayed_int4_fragments_give_the_exact_product(n, k, g, m, sym):
    """Every code 0..15 and zero point 0..15; K not a multiple of the 64-input k-block (224, 320)
    and, at g = 128, an odd number of k-blocks (384: 6; 640: 10), so the last group record is half
    used. The product of the FP16 operands the decoder makes, exactly."""
    gen = torch.Generator().manual_seed(n + k + g + sym)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)
    q[:, :16] = torch.arange(16)
    s = (torch.rand((n, k // g), generator=gen) * 0.02 + 1e-3).half()
    z = None if sym else (torch.arange(n * (k // g)) % 16).reshape(n, k // g).to(torch.uint8)
    p = int4_layout.prepack(int4_codec.pack_codes(q), s, z, atom=ATOM)
    x = torch.randn((m, k), generator=gen).half()
    y = _replay_int4(p, x)
    w16 = int4_codec.dequantize(int4_codec.pack_codes(q), s, z).half().double()
    y64 = x.double() @ w16.t()
    assert float((y - y64).norm() / y64.norm()) < 1e-12
    # the folded decoder (groups of 64 and 128 on the route kernels): its operands and factors give
    # the product of the EXACT weights (code - zero) * scale, not of their FP16 roundings
    if g >= 64:
        exact = int4_codec.dequantize_f64(int4_codec.pack_codes(q), s, z)
        y_exact = x.double() @ exact.t()
        yf = _replay_int4(p, x, fold=True)
        assert float((yf - y_exact).norm() / y_exact.norm()) < 1e-12
        assert not torch.equal(exact, w16)   # the two differ, so the check above tells them apart
    # not vacuous: the records of the neighbouring group size (the wrong group shift) give another product
    if g < 128:
        wrong = int4_layout.PackedINT4(p.codes, p.scales, p.out_scale, n, k, 2 * g, sym, ATOM) if k % (2 * g) == 0 else None
        if wrong is not None and wrong.groups_pad * 16 * wrong.record_bytes * (p.n_pad // 16) <= p.scales.numel():
            assert float((_replay_int4(wrong, x) - y64).norm() / y64.norm()) > 0.01


# ------------------------------------------------------------- split-K work partition
def _kernel_partition(n_groups, kblocks, nwarps):
    """The kernel's integer logic (csrc/qpn_kernels_sm80.cu Qpn80::run), replayed."""
    items = n_groups * kblocks
    q, r = items // nwarps, items % nwarps
    lo = [i * q + min(i, r) for i in range(nwarps + 1)]
    b = r * (q + 1)
    warp_of = lambda x: x // (q + 1) if x < b else r + (x - b) // q  # noqa: E731
    segs = []
    for gw in range(nwarps):
        first = lo[gw] // kblocks
        item = lo[gw]
        while item < lo[gw + 1]:
            grp = item // kblocks
            kb0 = item - grp * kblocks
            kb1 = min(lo[gw + 1], (grp + 1) * kblocks) - grp * kblocks
            full = kb0 == 0 and kb1 == kblocks
            segs.append(dict(warp=gw, grp=grp, kb0=kb0, kb1=kb1, full=full, slot=0 if grp == first else 1,
                             fw=warp_of(grp * kblocks), lw=warp_of(grp * kblocks + kblocks - 1)))
            item = grp * kblocks + kb1
    return segs


@pytest.mark.fast
@pytest.mark.parametrize("n,kblocks,chunks,resident_blocks,min_items", [
    (5120, 96, 1, 264, 2), (16384, 80, 1, 264, 2), (5120, 24, 1, 264, 2), (48, 1, 1, 264, 2), (16, 128, 2, 8, 2)])
def test_block_cooperative_partition_gives_one_run_per_block(n, kblocks, chunks, resident_blocks, min_items):
    """Qpn80Coop: one run per block of WARPS warps, at least WARPS * min_items items per run (each
    warp of the block gets min_items), and as many runs as resident blocks at most."""
    grid, runs, n_groups = sm80_plan.sm80_partition(n, kblocks, 2, chunks, resident_blocks * ops.WARPS, min_items,
                                              unit_warps=ops.WARPS)
    items = n_groups * kblocks
    assert grid == runs * chunks                              # one block per run and plane
    assert 1 <= runs <= max(1, resident_blocks // chunks)
    assert runs == 1 or items // runs >= ops.WARPS * min_items
    per_warp = sm80_plan.sm80_partition(n, kblocks, 2, chunks, resident_blocks * ops.WARPS, min_items)
    assert per_warp[1] >= runs   # the same GPU holds WARPS times as many per-warp runs
    segs = _kernel_partition(n_groups, kblocks, runs)          # the same run arithmetic, per block
    covered = torch.zeros((n_groups, kblocks), dtype=torch.int32)
    for sg in segs:
        covered[sg["grp"], sg["kb0"]: sg["kb1"]] += 1
    assert bool((covered == 1).all())


@pytest.mark.parametrize("n,kblocks,tiles,chunks,resident,min_items", [
    *(pytest.param(*case, marks=pytest.mark.fast) for case in [
        (5120, 24, 2, 1, 2112, 4), (34816, 80, 2, 1, 2112, 4), (5120, 272, 2, 1, 2112, 2), (1, 1, 2, 1, 2112, 4),
        (31, 33, 2, 1, 2112, 4), (300, 17, 1, 6, 2112, 2), (16, 3, 4, 2, 64, 1)]),
    (248320, 80, 2, 1, 2112, 4)])  # the lm_head-sized case takes ~10 s: full tier only
def test_split_k_partition_covers_every_item_once(n, kblocks, tiles, chunks, resident, min_items):
    grid, nwarps, n_groups = sm80_plan.sm80_partition(n, kblocks, tiles, chunks, resident, min_items)
    items = n_groups * kblocks
    assert n_groups * tiles * 16 >= n > (n_groups - 1) * tiles * 16
    assert 1 <= nwarps <= items and nwarps * chunks <= max(resident, chunks)
    assert grid % chunks == 0 and (grid // chunks) * ops.WARPS >= nwarps
    segs = _kernel_partition(n_groups, kblocks, nwarps)
    covered = torch.zeros((n_groups, kblocks), dtype=torch.int32)
    for sg in segs:
        covered[sg["grp"], sg["kb0"]: sg["kb1"]] += 1
    assert bool((covered == 1).all())
    per_warp = {}
    for sg in segs:
        if not sg["full"]:
            per_warp.setdefault(sg["warp"], []).append(sg["slot"])
    assert all(len(v) <= 2 and len(set(v)) == len(v) for v in per_warp.values())   # slots never collide
    for grp in range(n_groups):
        touching = sorted(sg["warp"] for sg in segs if sg["grp"] == grp)
        parts = [sg for sg in segs if sg["grp"] == grp]
        if len(parts) == 1:
            assert parts[0]["full"]
        else:   # the counter's target lw - fw + 1 is exactly the set of contributors
            assert touching == list(range(parts[0]["fw"], parts[0]["lw"] + 1))
    sizes = [sum(sg["kb1"] - sg["kb0"] for sg in segs if sg["warp"] == w) for w in range(nwarps)]
    assert max(sizes) - min(sizes) <= 1   # balanced to one item


# ------------------------------------------------------------------------- NVRTC build
# NVRTC, ptxas and cuobjdump come from tests/conftest.py's fixtures: they skip naming the fix
# where a tool cannot be had, and fail under CI=true, so the SASS checks below never pass unrun.
@pytest.mark.parametrize("arch", [80, 90])
def test_sm80_source_builds_without_spills_and_uses_hmma16816(arch, tmp_path, capsys, nvrtc12, ptxas12, cuobjdump12):
    from qpn.kernels import sm70_check

    nv, ptxas, cuobjdump = nvrtc12, ptxas12, cuobjdump12
    src = jit.kernel_sources()[jit.ATOM_SOURCES[ATOM]]
    res = nv.compile(src, jit.ATOM_SOURCES[ATOM], arch, list(jit.COMPILE_FLAGS), want_cubin=True)
    for name in jit.ENTRY_POINTS[ATOM] + jit.UNSERVED_ENTRY_POINTS[ATOM]:   # INT4's too
        assert name.encode() + b"\0" in res.cubin, name
    (tmp_path / "k.ptx").write_text(res.ptx)
    r = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    reps = sm70_check.parse_ptxas(r.stdout + r.stderr)
    configured = sm80_plan.sm80_kernels()
    reconstruct = {"qpn2_reconstruct_ws_m16n8k16", "qpn8_reconstruct_ws_m16n8k16",
                   "qpn4_reconstruct_ws_m16n8k16", "qpn4_sym_reconstruct_ws_m16n8k16",
                   "qpn8i_reconstruct_ws_m16n8k16", "qpn8i_sym_reconstruct_ws_m16n8k16"}   # INT8: staged
    assert set(configured) | reconstruct == set(reps)
    assert len(configured) >= 20
    lines = []
    for name, rep in sorted(reps.items()):
        lines.append(f"  {name:34s} regs {rep.registers:3d} spill {rep.spill_stores}/{rep.spill_loads} stack {rep.stack_frame}")
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_frame == 0, name
        # within the register cap its blocks of 256 threads per SM leave (2 blocks: 128 registers;
        # 1 block, the M-band kernels at MT = 8: 255, the most a thread can address)
        blocks = configured[name].min_blocks if name in configured else 2
        assert 0 < rep.registers <= min(255, 65536 // (256 * blocks)), name
    with capsys.disabled():
        print(f"\nsm_{arch} (NVRTC {res.nvrtc_version[0]}.{res.nvrtc_version[1]}):\n" + "\n".join(lines))
    (tmp_path / "n.cubin").write_bytes(res.cubin)
    env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "n.cubin")], capture_output=True, text=True, env=env)
    assert sass.returncode == 0, sass.stderr
    counts, cur = {}, None
    for line in sass.stdout.splitlines():
        mm = re.search(r"Function : (\w+)", line)
        if mm:
            cur = mm.group(1)
            counts[cur] = {"hmma": 0, "local": 0}
        elif cur:
            counts[cur]["hmma"] += "HMMA.16816.F32" in line
            counts[cur]["local"] += bool(re.search(r"\b(LDL|STL)\b", line))
    for name, cfg in configured.items():
        assert counts[name]["local"] == 0, name
        assert (counts[name]["hmma"] > 0) == (cfg.variant not in (2, 3, 4)), name   # 2-4: no MMA


@pytest.mark.fast
def test_sm80_entry_lines_parse_by_macro_and_a_wrong_argument_count_fails(monkeypatch):
    from qpn.kernels.weight_format import KernelEntry

    entries = (KernelEntry("QPN80C_ENTRY", "k_coop", "Frag16FP8", (1, 2, 2, 3, 7)),
               KernelEntry("QPN80RX_ENTRY", "k_ring", "Frag16NVFP4", (2, 2, 4, 2, 0)),
               KernelEntry("QPN80_RECONSTRUCT_ENTRY", "k_recon", "Frag16FP8"))
    monkeypatch.setattr(sm80_tables, "SM80_ENTRIES", entries)
    got = sm80_plan.sm80_kernels()
    assert set(got) == {"k_coop", "k_ring"}
    # the lines jit writes into the source are these entries, macro by macro
    assert jit.sm80_entry_lines().splitlines()[2:] == ["QPN80C_ENTRY(k_coop, Frag16FP8, 1, 2, 2, 3, 7)",
                                                      "QPN80RX_ENTRY(k_ring, Frag16NVFP4, 2, 2, 4, 2, 0)",
                                                      "QPN80_RECONSTRUCT_ENTRY(k_recon, Frag16FP8)"]
    c, r = got["k_coop"], got["k_ring"]
    assert (c.mt, c.tiles, c.depth, c.min_blocks, c.variant, c.coop, c.stages) == (1, 2, 2, 3, 7, True, 0)
    assert (r.mt, r.tiles, r.stages, r.min_blocks, r.x_global, r.depth, r.coop) == (2, 2, 4, 2, True, 0, False)
    monkeypatch.setattr(sm80_tables, "SM80_ENTRIES", (KernelEntry("QPN80C_ENTRY", "k_bad", "Frag16FP8", (1, 2, 2, 0)),))
    with pytest.raises(jit.QpnBuildError, match="QPN80C_ENTRY.*k_bad.*4 numeric arguments.*expects 5"):
        sm80_plan.sm80_kernels()


@pytest.mark.fast
def test_sm80_kernel_table_and_route_kernels():
    configured = sm80_plan.sm80_kernels()
    # keyed by the family's WeightFormat, or by each member where the members have kernels of their
    # own (INT4); the kernel decodes that member's fragments (INT4: the folded decoder, which runs its
    # plain form on groups of 32)
    decoder = {formats.NVFP4: "Frag16NVFP4", formats.FP8_TENSOR: "Frag16FP8", formats.INT4: "Frag16INT4FoldAsym",
               formats.INT4_SYM: "Frag16INT4FoldSym", formats.INT8: "Frag16INT8FoldAsym",
               formats.INT8_SYM: "Frag16INT8FoldSym"}
    assert {fmt for fmt, _ in sm80_tables.SM80_ROUTE_KERNELS} == set(decoder)
    for (fmt, mt), name in sm80_tables.SM80_ROUTE_KERNELS.items():
        cfg = configured[name]
        assert fmt is formats.FAMILIES[fmt.family] or fmt.kernel_tag
        assert cfg.mt == mt and cfg.variant == 0 and name.startswith(fmt.kernel_prefix + "_mt")
        assert cfg.frag == decoder[fmt] and cfg.weight_format is fmt
    route = routes.as_route
    # the chunked route: the M-band kernel, one weight pass per 8 x MT rows; an MT = 2 kernel named
    # for it (how the route ran before) takes one pass per 16 rows
    for fmt, names in sm80_tables.SM80_BAND_KERNELS.items():
        cfgs = [configured[n] for n in names]
        assert all(c.band and c.variant == 0 and c.name.startswith(fmt.route_prefix) for c in cfgs)
        assert [c.mt for c in cfgs] == sorted(c.mt for c in cfgs) and len({c.mt for c in cfgs}) == len(cfgs)
        chunked = route(fmt.route_prefix + "_chunked")
        for m in (17, 32, 33, 48, 64, 65, 96):   # the fewest token tiles that hold M, else the widest
            fit = [c for c in cfgs if 8 * c.mt >= m]
            want = fit[0] if fit else cfgs[-1]
            assert sm80_plan.sm80_kernel_for(chunked, m) == (want.name, -(-m // (8 * want.mt))), m
        assert sm80_plan.sm80_kernel_for(chunked, 96)[1] == 2
        assert sm80_plan.sm80_chunks(chunked, 40, configured[sm80_tables.SM80_ROUTE_KERNELS[(fmt, 2)]]) == 3
        assert sm80_plan.sm80_chunks(route(fmt.route_prefix + "_mt2"), 16, cfgs[-1]) == 1
    # a family without band kernels (FP8: measured slower) keeps the MT = 2 kernel per 16-row chunk
    assert formats.NVFP4 in sm80_tables.SM80_BAND_KERNELS and formats.FP8_TENSOR not in sm80_tables.SM80_BAND_KERNELS
    assert sm80_plan.sm80_kernel_for(route("qpn8_chunked"), 40) == \
        (sm80_tables.SM80_ROUTE_KERNELS[(formats.FP8_TENSOR, 2)], 3)
    with pytest.raises(ValueError, match="M <= 8"):
        sm80_plan.sm80_kernel_for(route("qpn8"), 9)
    family_of_frag = {"Frag16NVFP4": "nvfp4", "Frag16FP8": "fp8", "Frag16INT4": "int4", "Frag16INT8": "int8"}
    assert all(c.fmt == next(f for p, f in family_of_frag.items() if c.frag.startswith(p)) for c in configured.values())
    # INT8: its route kernels, keyed by member as INT4's, decode with the member's folded decoder
    # (its plain form on groups of 32), are named for the member and need no shared memory
    assert not sm80_tables.SM80_UNSERVED_ROUTE_KERNELS
    for fmt, mt in ((f, mt) for f in (formats.INT8, formats.INT8_SYM) for mt in (1, 2)):
        name = sm80_tables.SM80_ROUTE_KERNELS[(fmt, mt)]
        assert configured[name].smem_bytes == 0 and sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM[(fmt, mt)] == name
        assert sm80_plan.sm80_kernel_for(routes.as_route("qpn8i" if mt == 1 else "qpn8i_mt2"), 8 * mt, 5120, fmt) == \
            (name, 1)
    assert sm80_plan.sm80_kernel_for(routes.as_route("qpn8i_chunked"), 40, 5120, formats.INT8_SYM) == \
        (sm80_tables.SM80_ROUTE_KERNELS[(formats.INT8_SYM, 2)], 3)
    with pytest.raises(jit.QpnBuildError, match="sm_80"):
        jit.compile_cubin(75, source=jit.ATOM_SOURCES[ATOM])
    assert jit.atoms_for_arch("sm70") == ("m8n8k4",) and jit.atoms_for_arch(90) == ("m8n8k4", ATOM)


def test_build_for_sm90_builds_both_atoms(tmp_path, monkeypatch, nvrtc12):
    monkeypatch.setenv("QPN_CACHE_DIR", str(tmp_path))
    p = ops.build("sm90")
    assert os.path.basename(p).startswith("qpn_sm80_sm90_")
    names = sorted(os.listdir(tmp_path))
    assert len([n for n in names if n.endswith(".cubin")]) == 2, names
    assert ops.build("sm90", atom="m8n8k4") != p


@pytest.mark.fast
# ------------------------------------------------------------------ routes and serving
def test_routes_are_the_same_names_on_sm80_and_sm90():
    for m in (1, 8, 9, 16, 17, 96, 97, 500):
        for fmt in ("nvfp4", "fp8"):
            assert routes.route_for(fmt, m, 5120, 5120, arch="sm90") == routes.route_for(fmt, m, 5120, 5120)
            assert str(routes.route_for(fmt, m, 5120, 5120, arch="sm80")) in routes.QPN_ROUTES
    assert arch_for_atom(ATOM) == "sm80" and arch_for_atom("m8n8k4") == "sm70"


@pytest.mark.fast
def test_sm80_opt_in_is_off_by_default(monkeypatch):
    monkeypatch.delenv(ops.SM80_OPT_IN_ENV, raising=False)
    assert not ops.sm80_opt_in()
    assert ops.serving_target((9, 0)) is None and ops.serving_target((8, 0)) is None
    assert ops.serving_target((7, 0)) == {"arch": "sm70", "atom": "m8n8k4"}
    assert ops.serving_target((7, 5)) is None
    monkeypatch.setenv(ops.SM80_OPT_IN_ENV, "1")
    assert ops.serving_target((9, 0)) == {"arch": "sm90", "atom": ATOM}
    assert ops.serving_target((8, 6)) == {"arch": "sm86", "atom": ATOM}
    monkeypatch.setenv(ops.SM80_OPT_IN_ENV, "0")
    assert ops.serving_target((9, 0)) is None
    monkeypatch.setenv(ops.SM80_OPT_IN_ENV, "maybe")
    with pytest.raises(ValueError, match="QPN_SM80_OPT_IN"):
        ops.sm80_opt_in()


def test_ring_kernels_shared_memory_fits_the_blocks_they_are_built_for():
    """Each shared-memory ring kernel's ring (sm80_plan.Sm80Kernel.smem_bytes, what ops launches with)
    fits one block's opt-in limit on sm_90 (227 KB) and its MINB blocks fit an SM (228 KB); a
    kernel whose launch bound promised more blocks than the ring allows would waste registers."""
    rings = {n: c for n, c in sm80_plan.sm80_kernels().items() if c.stages and not c.band}
    assert len(rings) >= 10
    for name, c in rings.items():
        assert c.smem_bytes % 16 == 0 and 0 < c.smem_bytes <= 227 * 1024, name
        assert c.min_blocks * (c.smem_bytes + 1024) <= 228 * 1024, (name, c.min_blocks, c.smem_bytes)
        # the slot layout: codes (+ NVFP4 scales) per tile, plus 1 KB of activations per token tile
        nvfp4 = c.frag.startswith("Frag16NVFP4")
        per_tile = 16 * 32 + 64 if nvfp4 else 32 * 32
        assert c.smem_bytes == 8 * c.stages * (c.tiles * per_tile + (0 if c.x_global else 1024 * c.mt)), name


def test_band_kernels_shared_memory_is_one_activation_ring_per_block():
    """Qpn80Band: S slots of MT token tiles x 1 KB (64 inputs x 8 tokens x 2 bytes), shared by the
    block's 8 warps; MINB blocks fit an SM, and the route's band kernels fit the default 48 KB of a
    block on any sm_80+ GPU (no opt-in, hence no fallback kernel: sm80_plan._sm80_plan)."""
    bands = {n: c for n, c in sm80_plan.sm80_kernels().items() if c.band}
    routed = {k for ks in sm80_tables.SM80_BAND_KERNELS.values() for k in ks}
    assert len(bands) >= 4 and routed <= set(bands)
    for name, c in bands.items():
        assert c.stages >= 2 and c.depth >= 0 and c.mt in (4, 8), name   # depth 0: weights in the ring
        weights = 0 if c.depth else 8 * c.tiles * (16 * 32 + 64 if c.frag.startswith("Frag16NVFP4") else 32 * 32)
        assert c.smem_bytes == c.stages * (c.mt * 1024 + weights) <= 227 * 1024, name
        assert c.min_blocks * (c.smem_bytes + 1024) <= 228 * 1024, name
        if name in routed:
            assert c.smem_bytes <= 48 * 1024, name


def _band_partition(n, kblocks, tiles, chunks, resident_blocks, min_items):
    """Qpn80Band's work split, replayed: ops' partition, then per block the run of items
    (csrc Qpn80::run_of, as _kernel_partition) and per warp w of the block its tiles
    T (8 g + w) + j of each item's group g. Returns (grid, runs, n_groups, segments)."""
    grid, runs, n_groups = sm80_plan.sm80_partition(n, kblocks, tiles * ops.WARPS, chunks, resident_blocks * ops.WARPS,
                                              min_items, unit_warps=ops.WARPS, warps_split_items=False)
    return grid, runs, n_groups, _kernel_partition(n_groups, kblocks, runs)


@pytest.mark.fast
@pytest.mark.parametrize("n,kblocks,tiles,chunks,resident_blocks,min_items", [
    (34816, 80, 1, 1, 132, 4), (5120, 96, 1, 2, 132, 2), (5120, 272, 2, 1, 132, 4), (48, 1, 1, 1, 132, 2),
    (16, 128, 1, 2, 8, 2), (1000, 65, 2, 1, 132, 4)])
def test_band_partition_covers_every_tile_and_k_block_once_per_chunk(n, kblocks, tiles, chunks, resident_blocks,
                                                                   min_items):
    """Each (16-row tile, k-block) of the layer is decoded by exactly one warp per chunk plane; a
    warp's split-K counter (plane chunk x 8 + warp, group g) is reached by exactly the blocks
    fw..lw its finish waits for; a block never has fewer than min_items items unless the layer
    has fewer items than blocks; the grid is one block per run and chunk."""
    grid, runs, n_groups, segs = _band_partition(n, kblocks, tiles, chunks, resident_blocks, min_items)
    n_tiles = -(-n // 16)
    items = n_groups * kblocks
    assert n_groups * tiles * ops.WARPS * 16 >= n > (n_groups - 1) * tiles * ops.WARPS * 16
    assert grid == runs * chunks and 1 <= runs <= max(1, resident_blocks // chunks)
    assert runs == 1 or items // runs >= min_items
    covered = torch.zeros((n_groups * ops.WARPS * tiles, kblocks), dtype=torch.int32)
    arrivals = {}
    for sg in segs:
        for w in range(ops.WARPS):
            t0 = (sg["grp"] * ops.WARPS + w) * tiles
            covered[t0: t0 + tiles, sg["kb0"]: sg["kb1"]] += 1
            if not sg["full"]:
                arrivals.setdefault((w, sg["grp"]), []).append(sg["warp"])
    assert bool((covered[:n_tiles] == 1).all())   # tiles past N are read as the last tile, never stored
    for (w, grp), blocks in arrivals.items():
        part = next(sg for sg in segs if sg["grp"] == grp)
        assert sorted(blocks) == list(range(part["fw"], part["lw"] + 1)), (w, grp)


def test_large_layers_get_the_large_n_kernel_and_ring_kernels_have_a_no_smem_fallback():
    small = sm80_plan.sm80_kernel_for(routes.as_route("qpn2"), 1, 5120)
    large_n = sm80_tables.SM80_LARGE_N[formats.NVFP4]
    assert sm80_plan.sm80_kernel_for(routes.as_route("qpn2"), 1, large_n - 1) == small
    large = sm80_plan.sm80_kernel_for(routes.as_route("qpn2"), 1, large_n)
    assert small == (sm80_tables.SM80_ROUTE_KERNELS[(formats.NVFP4, 1)], 1)
    assert large == (sm80_tables.SM80_LARGE_N_KERNELS[(formats.NVFP4, 1)], 1)
    # INT4: no large-N kernel; its members' own route kernel at every layer size, lm_head-sized included
    for member in (formats.INT4, formats.INT4_SYM):
        assert member not in sm80_tables.SM80_LARGE_N
        for n in (5120, 17408, 34816, large_n, 248320):
            assert sm80_plan.sm80_kernel_for(routes.as_route("qpn4"), 1, n, member) == \
                (sm80_tables.SM80_ROUTE_KERNELS[(member, 1)], 1), n
        # M 9-16 has no large-N kernel
        assert sm80_plan.sm80_kernel_for(routes.as_route("qpn4_mt2"), 16, 34816, member)[0] == \
            sm80_tables.SM80_ROUTE_KERNELS[(member, 2)]
    assert sm80_plan.sm80_kernel_for(routes.as_route("qpn8"), 1, 10 ** 6) == \
        (sm80_tables.SM80_ROUTE_KERNELS[(formats.FP8_TENSOR, 1)], 1)
    kernels = sm80_plan.sm80_kernels()
    for key, name in list(sm80_tables.SM80_ROUTE_KERNELS.items()) + list(sm80_tables.SM80_LARGE_N_KERNELS.items()):
        fb = kernels[sm80_tables.SM80_ROUTE_KERNELS_NO_SMEM[key]]
        assert fb.smem_bytes == 0 and fb.mt == kernels[name].mt and fb.variant == 0
        assert name in jit.ENTRY_POINTS[ATOM] and fb.name in jit.ENTRY_POINTS[ATOM]
