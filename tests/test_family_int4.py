"""INT4 W4A16 family (kernels/families/int4/): every code and zero point, groups 32/64/128, the
prepack inverse over every byte value, a lane-level replay of the documented fragment maps, the
three checkpoint conventions cross-checked against the engine's and compressed-tensors' own code
(skipped when a library is absent), act-order, and mutations of the family module that the checks
must catch."""
from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qpn.kernels import families, formats, prepack
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.families.int4 import checkpoint as int4_checkpoint
from qpn.kernels.families.int4 import layout as int4_layout
from qpn.kernels.formats import INT4, INT4_SYM

pytestmark = pytest.mark.fast
KERNELS = Path(__file__).resolve().parents[1] / "kernels"
FAMILY_DIR = KERNELS / "families" / "int4"
FAMILY_MODULES = ("codec", "checkpoint", "layout", "numerics")


def family_namespace(package: str) -> SimpleNamespace:
    """The public names of a family package's modules in one namespace, so that one set of checks
    runs on the real package and on a mutated copy of it."""
    names = {}
    for mod in FAMILY_MODULES:
        names.update({k: v for k, v in vars(importlib.import_module(f"{package}.{mod}")).items()
                      if not k.startswith("__")})
    return SimpleNamespace(**names)


INT4_FAMILY = family_namespace("qpn.kernels.families.int4")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _scales(n, cols, gen):
    return (torch.rand(n, cols, generator=gen) * 0.02 + 1e-3).half()


def _ints(shape, gen, hi=16):
    return torch.randint(0, hi, shape, generator=gen, dtype=torch.int32)


# ----------------------------------------------------------------------------- library fixtures
@pytest.fixture(scope="module")
def vllm_q():
    """vLLM's own INT4 helpers (CPU functions): pack/unpack, the reference quantizers, AutoAWQ's
    repack to the standard layout."""
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils",
                             reason="vLLM not installed")
    from vllm.model_executor.layers.quantization import auto_awq
    from vllm.scalar_type import scalar_types
    return SimpleNamespace(qu=qu, auto_awq=auto_awq, types=scalar_types)


@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    return SimpleNamespace(PQC=PackedQuantizationCompressor, pack=pack_to_int32, unpack=unpack_from_int32,
                           Args=QuantizationArgs, Scheme=QuantizationScheme, dequantize=dequantize)


def _awq_standard(E, qweight, qzeros, monkeypatch):
    """vLLM's AutoAWQ -> standard repack (auto_awq._convert_awq_to_standard_format) on a bare
    module; its parameters ask for the TP rank, which a test process has not set up."""
    import torch.nn as nn
    import vllm.model_executor.parameter as vparam

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    mod = nn.Module()
    mod.qweight = nn.Parameter(qweight.clone(), requires_grad=False)
    mod.qzeros = nn.Parameter(qzeros.clone(), requires_grad=False)
    E.auto_awq._convert_awq_to_standard_format(mod, "qweight", "qzeros", 4)
    u4 = E.types.uint4
    return (E.qu.unpack_quantized_values_into_int32(mod.qweight.data, u4, 0),    # [K, N]
            E.qu.unpack_quantized_values_into_int32(mod.qzeros.data, u4, 0))     # [N, G]


# ------------------------------------------------------------------ checks (also run on mutants)
def check_awq(m, E, monkeypatch, k=128, n=32, g=32):
    gen = _gen(11)
    q, z, s = _ints((k, n), gen), _ints((k // g, n), gen), _scales(k // g, n, gen)
    qweight, qzeros = E.qu.awq_pack(q, 4, k, n), E.qu.awq_pack(z, 4, k // g, n)
    codes, gs, zp = m.from_awq(qweight, qzeros, s, g)
    assert torch.equal(m.unpack_codes(codes), q.t().to(torch.uint8)), "AWQ codes"
    assert torch.equal(zp, z.t().to(torch.uint8)), "AWQ zero points"
    assert torch.equal(gs, s.t()), "AWQ scales"
    std_q, std_z = _awq_standard(E, qweight, qzeros, monkeypatch)
    assert torch.equal(m.unpack_codes(codes).t().to(torch.int32), std_q), "vs vLLM's AWQ repack (codes)"
    assert torch.equal(zp.to(torch.int32), std_z), "vs vLLM's AWQ repack (zeros)"
    # the engine's reference quantizer: its dequantized weight, value for value
    w = (torch.randn(k, n, generator=gen) * 0.05).half()
    w_ref, w_q, w_s, w_zp = E.qu.quantize_weights(w, E.types.uint4, g, zero_points=True)
    src = m.from_awq(E.qu.awq_pack(w_q, 4, k, n), E.qu.awq_pack(w_zp, 4, k // g, n), w_s, g)
    assert torch.equal(m.dequantize(*src).half(), w_ref.t()), "AWQ dequantized weight"


def check_gptq(m, E, k=128, n=24, g=32):
    gen = _gen(12)
    w = (torch.randn(k, n, generator=gen) * 0.05).half()
    gi = (torch.arange(k) // g).to(torch.int32)
    # symmetric (uint4b8): vLLM's GPTQ quantizer and packer; qzeros of a v1 checkpoint hold 7
    w_ref, w_q, w_s = E.qu.gptq_quantize_weights(w, E.types.uint4b8, g)
    qweight = E.qu.gptq_pack(w_q, 4, k, n)
    qzeros = E.qu.pack_cols(torch.full((k // g, n), 7, dtype=torch.int32), 4, k // g, n)
    for g_idx in (None, gi):
        src = m.from_gptq(qweight, qzeros, w_s, g_idx, g, True)
        assert len(src) == 2 and torch.equal(m.dequantize(*src).half(), w_ref.t()), "GPTQ sym"
    assert torch.equal(m.unpack_codes(src[0]).t().to(torch.int32), w_q), "GPTQ codes"
    # asymmetric: v2 stores the zero, v1 zero - 1
    w_ref, w_q, w_s, zp = E.qu.quantize_weights(w, E.types.uint4, g, zero_points=True)
    assert int(zp.min()) >= 1, "test data: v1 cannot store zero 0"
    qweight = E.qu.pack_rows(w_q, 4, k, n)
    for v2, stored in ((True, zp), (False, zp - 1)):
        src = m.from_gptq(qweight, E.qu.pack_cols(stored, 4, k // g, n), w_s, gi, g, False, v2=v2)
        assert torch.equal(src[2].t().to(torch.int32), zp), f"GPTQ zero points (v2={v2})"
        assert torch.equal(m.dequantize(*src).half(), w_ref.t()), f"GPTQ asym (v2={v2})"


def check_ct(m, C, n=20, k=128, g=32):
    gen = _gen(13)
    for sym in (False, True):
        args = C.Args(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=g)
        scheme = C.Scheme(targets=["Linear"], weights=args)
        q = torch.randint(-8, 8, (n, k), generator=gen).to(torch.int8)
        zp = (torch.zeros(n, k // g) if sym else torch.randint(-8, 8, (n, k // g), generator=gen)).to(torch.int8)
        s = _scales(n, k // g, gen)
        q[0, :16] = torch.arange(-8, 8)                     # every code
        if not sym:
            zp[: min(n, 16), 0] = torch.arange(-8, 8)[: min(n, 16)]   # every zero point
        sd = {"weight": C.dequantize(q, s, zp, args), "weight_scale": s}
        if not sym:
            sd["weight_zero_point"] = zp
        out = C.PQC.compress(sd, scheme)   # the library's own checkpoint writer
        assert torch.equal(C.unpack(out["weight_packed"], 4, (n, k)), q), "test data: library round trip"
        src = m.from_pack_quantized(out["weight_packed"], out["weight_scale"], out.get("weight_zero_point"), g)
        assert len(src) == (2 if sym else 3)
        assert torch.equal(m.unpack_codes(src[0]).to(torch.int16), q.to(torch.int16) + 8), "CT codes (+8 offset)"
        if not sym:
            assert torch.equal(src[2].to(torch.int16), zp.to(torch.int16) + 8), "CT zero points"
        theirs = C.PQC.decompress(out, scheme)["weight"]
        assert torch.equal(m.dequantize(*src).half(), theirs), f"CT dequantized weight (sym={sym})"


def _lane_row_m8n8k4(l):
    return 8 * ((l >> 2) & 3) + (l & 3) + 4 * (l >> 4)


def replay(m, packed):
    """Decode a packed weight the way the documented lane decoder does, from the raw buffers:
    per (tile, k-block) lane l loads 16 bytes at 16 l, words w = 0..3, pair r = nibbles (r, r+4);
    per (tile, group) the lane's record(s). Returns (codes [N, K], scale bits [N, G], zeros [N, G])."""
    geo = m.geometry(packed.atom)
    tile, kb = geo.tile_n, geo.k_block
    kblocks, gp, rec = packed.k_pad // kb, packed.groups_pad, packed.record_bytes
    q = torch.full((packed.n_pad, packed.k_pad), 255, dtype=torch.int32)
    raw = packed.codes.to(torch.int64)
    for t in range(packed.n_pad // tile):
        for b in range(kblocks):
            base = (t * kblocks + b) * tile * kb // 2
            for l in range(32):
                by = raw[base + 16 * l: base + 16 * l + 16]
                for w in range(4):
                    word = int(by[4 * w]) | int(by[4 * w + 1]) << 8 | int(by[4 * w + 2]) << 16 | int(by[4 * w + 3]) << 24
                    for r in range(4):
                        lo, hi = (word >> (4 * r)) & 0xF, (word >> (4 * r + 16)) & 0xF
                        if packed.atom == "m8n8k4":
                            row, k0 = _lane_row_m8n8k4(l), 8 * w + 2 * r
                        else:
                            g4, t4 = l >> 2, l & 3
                            row, k0 = g4 + 8 * (r & 1), 16 * t4 + 4 * w + 2 * (r >> 1)
                        q[t * tile + row, b * kb + k0] = lo
                        q[t * tile + row, b * kb + k0 + 1] = hi
    assert int(q.max()) <= 15, "replay: some weight was never decoded"
    s = torch.zeros((packed.n_pad, gp), dtype=torch.int32)
    z = torch.zeros((packed.n_pad, gp), dtype=torch.int32)
    rb = packed.scales.to(torch.int32)
    for t in range(packed.n_pad // tile):
        for grp in range(gp):
            base = (t * gp + grp) * tile * rec
            for slot in range(tile):
                row = _lane_row_m8n8k4(slot) if packed.atom == "m8n8k4" else (slot >> 1) + 8 * (slot & 1)
                r0 = base + slot * rec
                s[t * tile + row, grp] = int(rb[r0]) | int(rb[r0 + 1]) << 8
                if rec == 4:
                    z[t * tile + row, grp] = int(rb[r0 + 2])
    cols = packed.k // packed.group_size
    return q[: packed.n, : packed.k], s[: packed.n, :cols], z[: packed.n, :cols]


def check_replay(m):
    gen = _gen(14)
    for atom in formats.ATOMS:
        for sym in (False, True):
            n, k, g = 37, 192, 64
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
            s = torch.randint(0, 1 << 16, (n, k // g), generator=gen, dtype=torch.int32)
            s = (s - ((s >> 15) << 16)).to(torch.int16).view(torch.float16)
            z = None if sym else torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.int32).to(torch.uint8)
            p = m.prepack(codes, s, z, atom=atom)
            rq, rs, rz = replay(m, p)
            assert torch.equal(rq, m.unpack_codes(codes).to(torch.int32)), f"{atom}: lane decode of codes"
            assert torch.equal(rs, s.view(torch.int16).to(torch.int32) & 0xFFFF), f"{atom}: lane scale records"
            if z is not None:
                assert torch.equal(rz, z.to(torch.int32)), f"{atom}: lane zero points"


# ------------------------------------------------------------------------------------- tests
def test_registry_data():
    assert families.numerics("int4").fmt is INT4 and families.numerics("int4_sym").fmt is INT4_SYM
    assert INT4.family == INT4_SYM.family == "int4" and INT4.route_prefix == INT4_SYM.route_prefix == "qpn4"
    assert INT4.roles == ("codes", "group_scales", "zero_points") and INT4_SYM.roles == ("codes", "group_scales")
    assert INT4.group_sizes == INT4_SYM.group_sizes == (32, 64, 128) and INT4.scale_dtype == "float16"
    # served, both members: the served lookups, routes and build lists know them; no MoE kernels
    assert {INT4, INT4_SYM} <= set(formats.WEIGHT_FORMATS) and formats.FAMILIES["int4"] is INT4
    assert formats.find_format("int4") is INT4 and formats.weight_format("int4_sym") is INT4_SYM
    assert formats.KERNEL_FAMILIES["int4"] is INT4 and {INT4, INT4_SYM} <= set(formats.KERNEL_FORMATS)
    assert INT4.kernel_atoms == INT4_SYM.kernel_atoms == ("m8n8k4", "m16n8k16") and not INT4.has_s7_form
    assert INT4.moe_atoms == INT4_SYM.moe_atoms == () and "int4" not in formats.MOE_FAMILIES
    assert INT4.moe_entry_points("m8n8k4") == () and INT4_SYM.moe_entry_points("m16n8k16") == ()
    prefixes = [f.route_prefix for f in formats.ALL_FAMILIES.values()]
    assert len(set(prefixes)) == len(prefixes)
    assert not any(a != b and b.startswith(a + "_") for a in prefixes for b in prefixes)
    assert INT4.bytes_per_weight == pytest.approx(0.5 + 2.5 / 128)
    assert INT4.dense_entry_points("m8n8k4") == ("qpn4_mt1_m8n8k4", "qpn4_mt2_m8n8k4", "qpn4_reconstruct_ws_m8n8k4")
    assert INT4_SYM.dense_entry_points("m8n8k4") == ("qpn4_sym_mt1_m8n8k4", "qpn4_sym_mt2_m8n8k4",
                                                     "qpn4_sym_reconstruct_ws_m8n8k4")
    # m16n8k16: the reconstruct pass here; the configured GEMM kernels are sm80_tables.SM80_ROUTE_KERNELS
    assert INT4.dense_entry_points("m16n8k16") == ("qpn4_reconstruct_ws_m16n8k16",)
    assert INT4_SYM.dense_entry_points("m16n8k16") == ("qpn4_sym_reconstruct_ws_m16n8k16",)


def test_no_runtime_code_branches_on_the_family_name():
    """Only the family's own package names it among kernels/ modules."""
    for path in KERNELS.glob("*.py"):
        assert not re.search(r"""["']int4(_sym)?["']""", path.read_text()), path.name


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_every_code_and_every_zero_point(sym):
    """Rows 0..15 hold zero point = row (asym); every group holds all 16 codes; the scales are
    powers of two and odd mantissas; decode = (code - zero) * scale exactly, from the source and
    from the packed buffers of both atoms."""
    n, k, g = 16, 256, 32
    codes = torch.arange(16).repeat(n, k // 16)
    codes = torch.stack([torch.roll(codes[r], r) for r in range(n)]).to(torch.uint8)
    z = torch.arange(16).view(16, 1).expand(n, k // g).to(torch.uint8).contiguous()
    s = torch.tensor([2.0 ** -e for e in range(k // g)]).repeat(n, 1) * (1 + torch.arange(n).view(-1, 1) / 16)
    s = s.half()
    src = (int4_codec.pack_codes(codes), s) if sym else (int4_codec.pack_codes(codes), s, z)
    zz = torch.full((n, k // g), 8) if sym else z
    want = (codes.double() - zz.double().repeat_interleave(g, 1)) * s.double().repeat_interleave(g, 1)
    num = families.numerics(INT4_SYM if sym else INT4)
    assert torch.equal(num.decode_f64(*src), want)
    assert torch.equal(num.decode_f32(*src).double(), want)
    assert set(codes.unique().tolist()) == set(range(16))
    for atom in formats.ATOMS:
        p = num.prepack(*src, atom=atom)
        w, ones = num.decode_packed(p)
        assert torch.equal(w.double(), want) and torch.equal(ones, torch.ones(n))
        x = torch.randn(3, k, generator=_gen(1)).half()
        assert torch.allclose(num.reference_linear_f64(x, p), x.double() @ want.t(), rtol=1e-12, atol=1e-12)
        y = num.reference_linear(x, p)
        assert y.dtype == torch.float16 and torch.equal(
            y, (x.float() @ want.half().float().t()).half())   # fp16 operands, fp32 sums


@pytest.mark.parametrize("atom", formats.ATOMS)
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_groups_quantize_prepack_reference(g, atom, sym):
    fmt = INT4_SYM if sym else INT4
    num = families.numerics(fmt)
    w = torch.randn(45, 384, generator=_gen(g)) * 0.05
    src = num.quantize(w, g)
    assert int4_codec.group_size_of(src[0], src[1], fmt) == g
    rel = float((num.decode_f32(*src) - w).norm() / w.norm())
    assert rel < 0.15, rel
    p = num.prepack(*src, atom=atom, rows_per_chunk=32)
    assert isinstance(p, num.packed_type) and formats.format_of(p) is fmt and p.group_size == g
    num.verify_roundtrip(p, *src)
    again = num.packed_from_tensors(*families.kernel_tensors(p), p.n, p.k, atom)
    assert again.group_size == g and torch.equal(again.scales, p.scales)
    x = torch.randn(4, 384, generator=_gen(3)).half()
    y64 = num.reference_linear_f64(x, p)
    assert torch.allclose(y64, x.double() @ num.decode_f64(*src).t(), rtol=1e-12, atol=1e-12)
    assert float((num.reference_linear(x, p).double() - y64).norm() / y64.norm()) < 2e-3
    moved = p.to("cpu")
    assert moved.group_size == g and moved.symmetric == sym and formats.format_of(moved) is fmt


def test_k_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(formats.FormatError, match="multiple of 128"):
        INT4.check_k(96)
    with pytest.raises(formats.FormatError, match="no group size 48"):
        INT4.check_k(96, 48)
    gen = _gen(4)
    with pytest.raises(formats.FormatError, match="multiple of 64"):   # AWQ K=96, g=64
        int4_checkpoint.from_awq(_ints((96, 2), gen), _ints((1, 2), gen), _scales(1, 16, gen), 64)
    with pytest.raises(formats.FormatError, match="whole number of groups"):
        int4_codec.check_source(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 5).half())
    with pytest.raises(formats.FormatError, match="per channel"):
        int4_checkpoint.from_gptq(_ints((16, 8), gen), None, _scales(1, 8, gen), None, -1, True)
    with pytest.raises(formats.FormatError, match="float16"):
        int4_codec.check_source(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1))
    with pytest.raises(formats.FormatError, match="0..15"):
        int4_codec.check_source(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1).half(),
                                 torch.full((4, 1), 16, dtype=torch.uint8))
    with pytest.raises(formats.FormatError, match="cannot represent exactly"):
        int4_checkpoint.from_pack_quantized(_ints((2, 4), gen), torch.tensor([[1e-9], [1.0]]), None, 32)


@pytest.mark.parametrize("n,k,g", [(1, 32, 32), (33, 64, 32), (45, 192, 64), (64, 256, 128), (100, 1024, 128),
                                   (7, 96, 32)])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_inverse_is_byte_identical_over_every_byte(n, k, g, sym):
    gen = _gen(n * k + g)
    count = n * k // 2
    codes = torch.arange(256).repeat(-(-count // 256))[:count]          # each byte value once per 256
    codes = codes[torch.randperm(count, generator=gen)].to(torch.uint8).view(n, k // 2)
    bits = torch.randint(0, 1 << 16, (n, k // g), generator=gen, dtype=torch.int32)
    s = (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)   # any 16 bits, NaN/inf patterns too
    z = None if sym else torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.int32).to(torch.uint8)
    if count >= 256:
        assert set(codes.unique().tolist()) == set(range(256))
    for atom in formats.ATOMS:
        p = int4_layout.prepack(codes, s, z, atom=atom, rows_per_chunk=32)
        back = int4_layout.unprepack(p, rows_per_chunk=64)
        assert torch.equal(back[0], codes) and torch.equal(back[1].view(torch.int16), s.view(torch.int16))
        assert (len(back) == 2) if sym else torch.equal(back[2], z)
        int4_layout.verify_roundtrip(p, codes, s, z, rows_per_chunk=32)
        # only addresses move: same nibbles plus zero padding
        hist = lambda t: torch.bincount(int4_codec.unpack_codes(t.reshape(1, -1)).reshape(-1).long(), minlength=16)
        want = hist(codes)
        want[0] += p.n_pad * p.k_pad - n * k
        assert torch.equal(hist(p.codes), want)
        for field, idx in (("codes", 3), ("scales", 1), ("scales", 2) if not sym else ("codes", 0)):
            bad = getattr(p, field).clone()
            bad[idx] ^= 0x01
            broken = int4_layout.PackedINT4(**{**{f: getattr(p, f) for f in
                                                  ("codes", "scales", "out_scale", "n", "k", "group_size", "symmetric", "atom")},
                                               field: bad})
            with pytest.raises(prepack.PrepackMismatch):
                int4_layout.verify_roundtrip(broken, codes, s, z)


def test_lane_replay_of_the_fragment_maps():
    check_replay(INT4_FAMILY)


def test_awq_against_vllm(vllm_q, monkeypatch):
    for g in (32, 64, 128):
        check_awq(INT4_FAMILY, vllm_q, monkeypatch, k=256, g=g)


def test_gptq_against_vllm(vllm_q):
    for g in (32, 64, 128):
        check_gptq(INT4_FAMILY, vllm_q, k=256, g=g)


def test_gptq_v1_zero_sixteen_is_refused(vllm_q):
    gen = _gen(5)
    qzeros = vllm_q.qu.pack_cols(torch.full((1, 8), 15, dtype=torch.int32), 4, 1, 8)
    with pytest.raises(formats.FormatError, match="zero point 16"):
        int4_checkpoint.from_gptq(_ints((4, 8), gen), qzeros, _scales(1, 8, gen), None, 32, False)


def test_pack_quantized_against_compressed_tensors(ct):
    for g in (32, 64, 128):
        check_ct(INT4_FAMILY, ct, k=256, g=g)


def test_act_order(ct):
    """Whole groups stored out of order (g_idx constant on every aligned block) are reordered at
    load, exactly: the dequantized weight equals the g_idx-indexed one (ours per input, and
    compressed-tensors' own dequantize with g_idx). A g_idx that mixes groups within a block
    (desc_act) is refused naming the module."""
    gen = _gen(6)
    n, k, g = 16, 256, 32
    groups = k // g
    q = torch.randint(-8, 8, (n, k), generator=gen).to(torch.int8)
    zp = torch.randint(-8, 8, (n, groups), generator=gen).to(torch.int8)
    s = _scales(n, groups, gen)
    perm = torch.randperm(groups, generator=gen)
    g_idx = perm.repeat_interleave(g).to(torch.int32)          # block b holds group perm[b]
    wp = ct.pack(q, 4)
    zpp = ct.pack(zp, 4, packed_dim=0)
    src = int4_checkpoint.from_pack_quantized(wp, s, zpp, g, g_idx=g_idx, module="model.layers.0.mlp.down_proj")
    gi = g_idx.long()
    want = (q.double() - zp.double()[:, gi]) * s.double()[:, gi]
    assert torch.equal(int4_codec.dequantize(*src).double(), want)
    theirs = ct.dequantize(q, s, zp, g_idx=g_idx)
    assert torch.equal(int4_codec.dequantize(*src).half(), theirs)
    trivial = int4_checkpoint.from_pack_quantized(wp, s, zpp, g, g_idx=torch.arange(k) // g)
    plain = int4_checkpoint.from_pack_quantized(wp, s, zpp, g)
    assert all(torch.equal(a, b) for a, b in zip(trivial, plain))
    desc = torch.randperm(k, generator=gen) // g
    with pytest.raises(int4_checkpoint.ActOrderError, match=r"model\.layers\.0\.mlp\.down_proj.*desc_act"):
        int4_checkpoint.from_pack_quantized(wp, s, zpp, g, g_idx=desc, module="model.layers.0.mlp.down_proj")
    assert issubclass(int4_checkpoint.ActOrderError, formats.FormatError)


# -------------------------------------------------------------------------------- mutations
def _mutant(tmp_path, monkeypatch, old, new):
    """A copy of the family's package with ``old`` replaced by ``new`` in the one module holding
    it, imported as qpn.kernels.families._int4_mutant (its relative imports resolve inside the copy
    and in qpn.kernels), as one namespace."""
    holders = [p.name for p in FAMILY_DIR.glob("*.py") if old in p.read_text()]
    assert len(holders) == 1 and (FAMILY_DIR / holders[0]).read_text().count(old) == 1, \
        f"mutation anchor not found once: {old!r} in {holders}"
    copy = tmp_path / "_int4_mutant"
    shutil.copytree(FAMILY_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / holders[0]).write_text((copy / holders[0]).read_text().replace(old, new))
    name = "qpn.kernels.families._int4_mutant"
    for stale in [k for k in sys.modules if k.startswith(name + ".")]:   # an earlier test's mutant
        del sys.modules[stale]
    spec = importlib.util.spec_from_file_location(name, copy / "__init__.py", submodule_search_locations=[str(copy)])
    pkg = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, pkg)   # dataclasses and relative imports look it up there
    spec.loader.exec_module(pkg)
    return family_namespace(name)


MUTATIONS = [
    ("swapped nibbles (canonical packer)", "(q[:, 0::2] | (q[:, 1::2] << 4))", "(q[:, 1::2] | (q[:, 0::2] << 4))", "ct"),
    ("wrong AWQ order", "AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)", "AWQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)", "awq"),
    ("AWQ order inverted the wrong way", "[AWQ_ORDER.index(i) for i in range(8)]", "[AWQ_ORDER[i] for i in range(8)]", "awq"),
    ("off-by-one GPTQ v1 zero point", "+ (0 if v2 else 1)", "+ (0 if v2 else 0)", "gptq"),
    ("transposed AWQ scales (reshape, not transpose)", 's = _f16_scales(scales, "AWQ scales").t().contiguous()',
     's = _f16_scales(scales, "AWQ scales").reshape(n, k // g)', "awq"),
    ("CT zero points unpacked along K", "z = _nibbles(weight_zero_point, 0).reshape(-1, k // g)[:n]",
     "z = _nibbles(weight_zero_point, 1).reshape(-1, k // g)[:n]", "ct"),
    ("word nibble order (m8n8k4 decoder pairs)", "WORD_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  ",
     "WORD_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)  ", "replay"),
    ("m16n8k16 record slots", "rows = [g + 8 * h for g in range(8) for h in range(2)]",
     "rows = [g + 8 * h for h in range(2) for g in range(8)]", "replay"),
]


@pytest.mark.parametrize("name,old,new,check", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(name, old, new, check, tmp_path, request, monkeypatch):
    runs = {"awq": lambda m: check_awq(m, request.getfixturevalue("vllm_q"), monkeypatch),
            "gptq": lambda m: check_gptq(m, request.getfixturevalue("vllm_q")),
            "ct": lambda m: check_ct(m, request.getfixturevalue("ct")),
            "replay": check_replay}
    runs[check](INT4_FAMILY)                       # control: the real module passes
    mutant = _mutant(tmp_path, monkeypatch, old, new)
    with pytest.raises((AssertionError, formats.FormatError, RuntimeError, IndexError)):
        runs[check](mutant)


@pytest.mark.parametrize("sym", [False, True])
def test_kernel_tensors_handed_out_per_call_match_the_eager_cache(sym):
    """packed_tensors views INT4's records afresh on every call; the eager launch cache
    (sm80_plan.eager_tiled) must see the same bytes there, not a replaced weight (else it re-plans
    every call), and must still see a replaced record tensor as replaced."""
    from qpn.kernels import sm80_plan

    w = torch.randn((16, 256), generator=torch.Generator().manual_seed(5)) * 0.02
    packed = int4_layout.prepack(*int4_codec.quantize(w, 128, symmetric=sym), atom="m16n8k16")
    num = families.numerics(packed)
    first, again = num.packed_tensors(packed), num.packed_tensors(packed)
    assert first[1] is not again[1]                       # a fresh view: identity alone would re-plan
    assert all(sm80_plan.same_tensor(a, b) for a, b in zip(first, again))
    packed.scales = packed.scales.clone()                 # the records replaced: a new plan is due
    assert not sm80_plan.same_tensor(first[1], num.packed_tensors(packed)[1])
