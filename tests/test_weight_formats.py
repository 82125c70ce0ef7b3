"""The format descriptions (qpn.kernels.formats): one WeightFormat per numeric format, asked by
the rest of the code. Round trips over every code and scale byte a quantizer can write, the
prepack inverse of every format on both atoms, and the registry: every algo a convention knows
and every route name maps to exactly one format."""
from __future__ import annotations

import pytest
import torch

from qpn.kernels import codecs, families, formats, prepack
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.int4 import codec as int4_codec
from qpn.kernels.formats import FP8_CHANNEL, FP8_TENSOR, INT4, INT4_SYM, NVFP4, WEIGHT_FORMATS

pytestmark = pytest.mark.fast

E2M1 = torch.tensor(codecs.E2M1_VALUES, dtype=torch.float64)


def _e4m3_f64(b: torch.Tensor) -> torch.Tensor:
    """Independent oracle: torch's own float8 cast."""
    return b.view(torch.float8_e4m3fn).to(torch.float64)


def _nvfp4_every_byte():
    """A source holding every nonzero positive e4m3 scale byte a quantizer writes (0x01..0x7E,
    one group each) and every e2m1 code but -0 (which encodes as +0), with code 7 (6.0) in each
    group so the group amax pins the scale; global scale 2^-4."""
    scale_bytes = torch.arange(1, 0x7F, dtype=torch.int32).to(torch.uint8)   # 126 groups
    base = [c for c in range(16) if c != 8] + [7]                            # 16 codes
    rows = [base[r % 16:] + base[:r % 16] for r in range(scale_bytes.numel())]
    codes = torch.tensor(rows, dtype=torch.uint8)                            # [126, 16]
    return (nvfp4_codec.pack_codes(codes), scale_bytes.view(torch.float8_e4m3fn).reshape(-1, 1),
            torch.tensor(2.0 ** -4, dtype=torch.float32)), codes


def _fp8_every_byte(per_channel: bool):
    """Every finite e4m3 byte (254 of them, -0 included), each row holding +-448 so that its
    amax pins the scale: per tensor scale 1, per channel 2^-3 * (row % 3 + 1) / 2^k exact."""
    finite = [b for b in range(256) if b not in (0x7F, 0xFF)]
    k = 32
    rows = []
    for r in range(-(-len(finite) // (k - 1))):
        part = finite[r * (k - 1):(r + 1) * (k - 1)]
        part = part + [0x00] * (k - 1 - len(part)) + [0x7E if r % 2 else 0xFE]
        rows.append(part)
    codes = torch.tensor(rows, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    n = codes.shape[0]
    if per_channel:
        scale = torch.tensor([2.0 ** -(3 + r % 5) for r in range(n)], dtype=torch.float32)
    else:
        scale = torch.tensor(1.0, dtype=torch.float32)
    return codes, scale


def test_nvfp4_decode_and_quantize_round_trip_every_byte():
    src, codes = _nvfp4_every_byte()
    w64 = families.numerics(NVFP4).decode_f64(*src)
    want = (E2M1[codes.long()] * _e4m3_f64(src[1].view(torch.uint8)) * 2.0 ** -4)
    assert torch.equal(w64, want)
    q = families.numerics(NVFP4).quantize(w64.float())
    assert torch.equal(q[0], src[0])
    assert torch.equal(q[1].view(torch.uint8), src[1].view(torch.uint8))
    assert float(q[2]) == float(src[2])
    assert torch.equal(families.numerics(NVFP4).decode_f32(*src).double(), w64)  # every value exact in float32 here


@pytest.mark.parametrize("fmt", [FP8_TENSOR, FP8_CHANNEL], ids=lambda f: f.key)
def test_fp8_decode_and_quantize_round_trip_every_byte(fmt):
    codes, scale = _fp8_every_byte(fmt.output_scale == "channel")
    w64 = families.numerics(fmt).decode_f64(codes, scale)
    want = _e4m3_f64(codes.view(torch.uint8)) * scale.double().reshape(-1, 1)
    assert torch.equal(w64, want)
    q_codes, q_scale = families.numerics(fmt).quantize(w64.float())
    assert torch.equal(q_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(q_scale.reshape(-1), scale.reshape(-1))
    assert q_scale.numel() == (codes.shape[0] if fmt is FP8_CHANNEL else 1)


@pytest.mark.parametrize("fmt", [INT4, INT4_SYM], ids=lambda f: f.key)
def test_int4_decode_and_quantize_round_trip_every_code_zero_point_and_scale(fmt):
    src, codes, zeros = _int4_every_code_zero_and_scale(fmt is INT4_SYM)
    num = families.numerics(fmt)
    assert set(codes.unique().tolist()) == set(range(16)) and set(zeros.unique().tolist()) == set(
        range(16) if fmt is INT4 else [8])
    w64 = num.decode_f64(*src)
    # oracle: the integers and torch's own float16 -> float64 cast, no family code
    g = codes.shape[-1]
    want = ((codes.double() - zeros.double().unsqueeze(-1)) * src[1].double().unsqueeze(-1)).reshape(w64.shape)
    assert torch.equal(w64, want)
    assert torch.equal(num.decode_f32(*src).double(), w64)  # (code - zero) * float16 is exact in float32
    q = num.quantize(w64.float(), g)
    assert len(q) == len(fmt.roles) == len(src)
    assert torch.equal(q[0], src[0])
    assert torch.equal(q[1].view(torch.int16), src[1].view(torch.int16))
    if fmt.has_zero_points:
        assert torch.equal(q[2], src[2])


def _int4_every_code_zero_and_scale(symmetric: bool):
    """A source holding every positive finite float16 scale (0x0001..0x7BFF, subnormals included,
    one group each), every code in every group (each group holds 0..15 twice, rotated per group so
    that every code meets every position) and, asymmetric, every zero point 0..15 (zero = group
    index mod 16, so each zero point meets about 2000 scales). Codes 0 and 15 pin each group's
    min and max, so min/max quantization of the decoded weight must give this source back."""
    scale_bits = torch.arange(1, 0x7C00, dtype=torch.int32)                  # 31743 groups
    groups, g, per_row = scale_bits.numel(), 32, 16
    rows = -(-groups // per_row)
    bits = torch.cat([scale_bits, torch.full((rows * per_row - groups,), 0x3C00, dtype=torch.int32)])
    scales = bits.to(torch.int16).view(torch.float16).view(rows, per_row)
    gi = torch.arange(rows * per_row).view(rows, per_row, 1)
    codes = (torch.arange(g).view(1, 1, g) + gi) % 16                       # [rows, groups, 32]
    q = int4_codec.pack_codes(codes.reshape(rows, per_row * g))
    if symmetric:
        return (q, scales), codes, torch.full((rows, per_row), 8)
    zeros = (gi.view(rows, per_row) % 16).to(torch.uint8)
    return (q, scales, zeros), codes, zeros


def _random_source(fmt, n=45, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a format whose weights choose their group size (INT4): its smallest, which divides K = 96
    size = {"group_size": min(fmt.group_sizes)} if fmt.group_sizes else {}
    return families.numerics(fmt).quantize(torch.randn(n, k, generator=g) * 0.05, **size)


# Every format with numerics, served or staged (formats.ALL_FORMATS: INT8 waits for a loader).
@pytest.mark.parametrize("atom", formats.ATOMS)
@pytest.mark.parametrize("fmt", formats.ALL_FORMATS, ids=lambda f: f.key)
def test_prepack_inverse_per_format(fmt, atom):
    src = _random_source(fmt)
    packed = families.numerics(fmt).prepack(*src, atom=atom)
    assert isinstance(packed, families.numerics(fmt).packed_type)
    assert formats.format_of(packed) is fmt
    back = families.numerics(fmt).unprepack(packed)
    assert len(back) == len(fmt.roles) == len(src)
    for a, b in zip(back, src):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.dtype in (torch.float8_e4m3fn, torch.uint8):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            assert torch.equal(a.reshape(-1), b.float().reshape(-1))
    families.numerics(fmt).verify_roundtrip(packed, *src)
    bad = packed.codes.clone()
    bad[7] ^= 0x11
    broken = families.numerics(fmt).packed_from_tensors(bad, *families.kernel_tensors(packed)[1:], packed.n, packed.k, atom)
    with pytest.raises(prepack.PrepackMismatch):
        families.numerics(fmt).verify_roundtrip(broken, *src)


@pytest.mark.parametrize("fmt", formats.ALL_FORMATS, ids=lambda f: f.key)
def test_kernel_tensors_and_reference_agree_with_decode(fmt):
    src = _random_source(fmt, n=40, k=64, seed=1)
    packed = families.numerics(fmt).prepack(*src)
    again = families.numerics(fmt).packed_from_tensors(*families.kernel_tensors(packed), packed.n, packed.k, packed.atom)
    assert formats.format_of(again) is fmt
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).half()
    y64 = families.numerics(fmt).reference_linear_f64(x, again)
    assert torch.allclose(y64, x.double() @ families.numerics(fmt).decode_f64(*src).t(), rtol=1e-12, atol=1e-12)
    vals, row_scale = families.numerics(fmt).decode_packed(packed)
    assert torch.equal((vals.double() * row_scale.double().reshape(-1, 1)), families.numerics(fmt).decode_f32(*src).double()) \
        or torch.allclose(vals.double() * row_scale.double().reshape(-1, 1), families.numerics(fmt).decode_f64(*src), rtol=2 ** -23)
    y = families.numerics(fmt).reference_linear(x, packed)
    assert y.dtype == torch.float16 and y.shape == (5, 40)


# Each family's packed buffers by field name: codes, group scales (or per-row records), output scale.
PACKED_BUFFERS = {"nvfp4": ("codes", "scales", "global_scale"), "fp8": ("codes", None, "scale"),
                  "int4": ("codes", "scales", "out_scale"), "int8": ("codes", "scales", "out_scale")}


@pytest.mark.parametrize("fmt", formats.ALL_FORMATS, ids=lambda f: f.key)
def test_packed_tensors_buffers_size_and_copy(fmt):
    """A packed weight's own buffers in kernel order (the same memory: a family may hand its
    records out as a view of another dtype, INT4 does, so the eager launch cache compares bytes),
    its size in bytes, and a copy through ``to`` that keeps every field and copies no buffer twice;
    an expert stack copies alike where the format has MoE kernels, and is refused where it has none."""
    from qpn.kernels import moe

    packed = families.numerics(fmt).prepack(*_random_source(fmt, n=40, k=64, seed=3))
    codes, scales, out_scale = families.numerics(fmt).packed_tensors(packed)
    names = PACKED_BUFFERS[fmt.family]
    assert set(packed.buffers()) == {n for n in names if n}
    for got, name in zip((codes, scales, out_scale), names):
        if name is None:
            assert got is None
            continue
        own = getattr(packed, name)
        assert got.data_ptr() == own.data_ptr() and got.nbytes == own.nbytes, name
        assert torch.equal(got if got.dtype == own.dtype else got.view(own.dtype).reshape(own.shape), own), name
    assert (scales is not None) == (fmt.has_group_scales or fmt.has_zero_points)
    kc, ks, ko = families.kernel_tensors(packed)
    assert ko.dtype == torch.float32 and ko.dim() == 1 and torch.equal(ko, out_scale.float().reshape(-1))
    want = codes.nbytes + (scales.nbytes if scales is not None else 0) + out_scale.nbytes
    assert packed.nbytes == want
    moved = packed.to("cpu")
    assert type(moved) is type(packed) and (moved.n, moved.k, moved.atom) == (packed.n, packed.k, packed.atom)
    for a, b in zip(families.numerics(fmt).packed_tensors(moved), families.numerics(fmt).packed_tensors(packed)):
        assert (a is None and b is None) or torch.equal(a, b)
    if not fmt.moe_atoms:
        with pytest.raises(formats.MoeShapeError, match="no QPN MoE kernels"):
            moe.prepack_expert_stack(fmt.key, torch.zeros(1, 8, 32, dtype=torch.uint8), torch.ones(1, 8, 1))
        return
    stack = moe.PackedExpertStack(fmt.family, codes[None], None if scales is None else scales[None],
                                  out_scale.float().reshape(1, -1), packed.n, packed.k, packed.atom)
    moved = stack.to("cpu")
    assert (moved.fmt, moved.n, moved.k, moved.atom) == (stack.fmt, stack.n, stack.k, stack.atom)
    assert torch.equal(moved.codes, stack.codes) and torch.equal(moved.chscale, stack.chscale)
    assert (moved.scales is None) == (scales is None)


def test_lookup_by_key_family_and_algo():
    assert formats.weight_format("nvfp4") is NVFP4
    assert formats.weight_format("NVFP4") is NVFP4 and formats.weight_format("w4a16_nvfp4") is NVFP4
    assert formats.weight_format("FP8") is FP8_TENSOR and formats.weight_format("fp8") is FP8_TENSOR
    assert formats.weight_format("fp8", output_scale="channel") is FP8_CHANNEL
    assert formats.weight_format("fp8_channel") is FP8_CHANNEL
    assert formats.weight_format(FP8_CHANNEL) is FP8_CHANNEL
    assert formats.weight_format("int4") is INT4 and formats.weight_format("INT4_SYM") is INT4_SYM
    assert formats.find_format("int4") is INT4   # the family name gives its first member
    assert formats.weight_format("int8") is formats.INT8 and formats.weight_format("int8_sym") is formats.INT8_SYM
    for bad in ("int2", "nvfp", "FP8_PB_WO", "", "qpn2", "qpn4", "qpn8i", "W4A16"):
        with pytest.raises(formats.UnknownFormat, match="QPN serves"):
            formats.weight_format(bad)
        assert formats.find_format(bad) is None
    with pytest.raises(formats.UnknownFormat):
        formats.weight_format("fp8", output_scale="block")


def test_every_modelopt_algo_maps_to_one_format():
    from qpn.fork_patches.quant.conventions import MODELOPT

    seen = {}
    for f in WEIGHT_FORMATS:
        for a in f.algos:
            assert a not in seen, f"{a} declared by {seen.get(a)} and {f.key}"
            seen[a] = f.key
    assert set(seen) == {"NVFP4", "W4A16_NVFP4", "FP8"}
    modules = [f"m{i}" for i in range(len(seen))]
    cfg = {"quantized_layers": {m: {"quant_algo": a} for m, a in zip(modules, seen)}}
    schemes = MODELOPT.module_schemes(cfg, modules)
    for m, a in zip(modules, seen):
        assert schemes[m].format is formats.weight_format(a)


def test_every_compressed_tensors_scheme_maps_to_one_format():
    """Each served format is what one compressed-tensors weights scheme declares: NVFP4 and FP8
    through ct_scheme_of, the integer families (pack-quantized) too."""
    from qpn.fork_patches.quant.conventions import ct_scheme_of

    cases = {
        NVFP4: {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True},
        FP8_TENSOR: {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
        FP8_CHANNEL: {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        INT4: {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False},
        INT4_SYM: {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
        formats.INT8: {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64, "symmetric": False},
        formats.INT8_SYM: {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
    }
    for want, w in cases.items():
        read = ct_scheme_of(w, "pack-quantized" if w["type"] == "int" else None, "test")
        assert read.format is want
    assert {f for f in cases} == set(WEIGHT_FORMATS)


def test_every_route_maps_to_one_format():
    from qpn.kernels import routes

    prefixes = [f.route_prefix for f in formats.FAMILIES.values()]
    assert len(set(prefixes)) == len(prefixes)
    assert not any(a != b and b.startswith(a + "_") for a in prefixes for b in prefixes)
    for f in WEIGHT_FORMATS:
        assert formats.FAMILIES[f.family].route_prefix == f.route_prefix
    names = set(routes.QPN_ROUTES) | set(routes.QPN_MOE_ROUTES)
    for r in names:
        owners = [f for f in formats.FAMILIES.values()
                  if r == f.route_prefix or r.startswith(f.route_prefix + "_")]
        assert owners == [formats.format_for_route(r)], r
    assert {formats.format_for_route(r).family for r in names} == set(formats.FAMILIES)
    with pytest.raises(formats.UnknownFormat):
        formats.format_for_route("qpn28")


def _instantiated(source: str) -> dict[str, tuple[str, ...]]:
    """``{entry point: macro arguments after the name}`` for every kernel a CUDA source defines:
    the ``*_ENTRY(name, ...)`` instantiations at the start of a line, and plain
    ``extern "C" __global__ void ... name(`` definitions."""
    import re

    from qpn.kernels import jit

    text = jit.kernel_sources()[source]
    found = {m.group(1): tuple(a.strip() for a in m.group(2).split(","))
             for m in re.finditer(r"^[A-Z0-9_]+_ENTRY\((\w+),\s*([^)]*)\)", text, re.M)}
    for m in re.finditer(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(', text, re.M):
        found[m.group(1)] = ()
    return found


def test_entry_points_are_the_kernels_the_sources_define():
    """The build lists (jit.ENTRY_POINTS, moe.MOE_ENTRY_POINTS, both from formats) against the CUDA
    sources themselves: every listed kernel is instantiated there, nothing instantiated is left
    out, and each is instantiated with its family's decoder and its tile count."""
    from qpn.kernels import jit, moe

    decoders = {"nvfp4": ("DecNVFP4", "DecNVFP4S7"), "fp8": ("DecFP8",), "int4": ("DecINT4", "DecINT4Sym"),
                "int8": ("DecINT8", "DecINT8Sym")}
    dense = _instantiated("qpn_kernels.cu")
    assert set(dense) == set(jit.ENTRY_POINTS["m8n8k4"]) | set(jit.UNSERVED_ENTRY_POINTS["m8n8k4"])
    assert not set(jit.ENTRY_POINTS["m8n8k4"]) & set(jit.UNSERVED_ENTRY_POINTS["m8n8k4"])
    for name, args in dense.items():
        family = formats.format_for_route(name.split("_", 1)[0], served_only=False).family
        assert args[0] == "AtomM8N8K4" and args[1] in decoders[family], (name, args)
        assert (args[1] == "DecNVFP4S7") == ("_s7_" in name), name
        assert args[1].endswith("Sym") == ("_sym_" in name), name   # INT4's and INT8's symmetric members
        if "_mt" in name:
            assert args[2] == name.split("_mt", 1)[1][0], (name, args)  # qpn2_mt2_... -> MT 2
    sparse = _instantiated("qpn_moe.cu")
    assert set(sparse) == set(moe.MOE_ENTRY_POINTS["m8n8k4"]) | set(moe.MOE_ENTRY_POINTS["common"])
    for name in moe.MOE_ENTRY_POINTS["m8n8k4"]:
        family = formats.format_for_route(name.split("_", 1)[0]).family
        assert sparse[name][1] in decoders[family] and sparse[name][2] == str("gate_up" in name).lower(), name
    assert set(_instantiated("qpn_moe_sm80.cu")) == set(moe.MOE_ENTRY_POINTS["m16n8k16"])
    assert {e for f in formats.FAMILIES.values() for e in f.dense_entry_points("m16n8k16")} <= \
        set(_instantiated("qpn_kernels_sm80.cu"))



def test_every_registered_decoder_is_a_cuda_decoder():
    """The decoder structs the formats name (the m8n8k4 entry lines are written with them) are
    defined in its family's m8n8k4.cuh (jit.decoder_source), as a struct or an alias of a decoder template; a misspelt one fails
    here rather than in NVRTC at run time."""
    import re

    from qpn.kernels import jit

    family = jit.decoder_source("m8n8k4")
    named = {k.decoder for f in formats.KERNEL_FORMATS for k in f.m8n8k4_kernels()}
    assert named >= {"DecNVFP4", "DecNVFP4S7", "DecFP8", "DecINT4", "DecINT4Sym", "DecINT8", "DecINT8Sym"}
    for decoder in sorted(named):
        assert re.search(rf"^(struct {decoder} \{{|using {decoder} = )", family, re.M), decoder
    with pytest.raises(ValueError, match="decoder"):
        formats.WeightFormat(key="probe", family="probe", route_prefix="qpn9", algos=(), roles=("codes",),
                             code_dtype="uint8", codes_per_byte=1, group_size=None, output_scale="none",
                             title="probe", kernel_atoms=("m8n8k4",))


def test_the_compiled_m8n8k4_kernels_are_the_registered_entry_points(nvrtc12):
    """What NVRTC builds from qpn_kernels.cu and the entry lines jit writes (jit.kernel_sources) is
    exactly the m8n8k4 entry points the formats register (jit.ENTRY_POINTS and
    UNSERVED_ENTRY_POINTS): none missing, none besides."""
    import re

    from qpn.kernels import jit

    ptx = nvrtc12.compile(jit.kernel_sources()[jit.MAIN_SOURCE], jit.MAIN_SOURCE, 70, list(jit.COMPILE_FLAGS),
                          want_cubin=False).ptx
    built = re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.M)
    assert sorted(built) == sorted(jit.ENTRY_POINTS["m8n8k4"] + jit.UNSERVED_ENTRY_POINTS["m8n8k4"])
    assert len(built) == len(set(built)) == 20   # 14 served, INT8's 6 staged

def test_descriptions_need_no_torch():
    import subprocess
    import sys

    code = ("import sys\n"
            "class B:\n"
            "    def find_spec(self, n, p=None, t=None):\n"
            "        if n == 'torch' or n.startswith('torch.'): raise ImportError('no torch')\n"
            "sys.meta_path.insert(0, B())\n"
            "from qpn.kernels import formats\n"
            "from qpn.fork_patches.quant import conventions\n"
            "print(formats.weight_format('W4A16_NVFP4').route_prefix)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "qpn2"
