"""NVFP4 / FP8-e4m3 formats: exact decoding, packing, ModelOpt-convention encoders, and a
cross-check against an independent implementation (compressed-tensors' NVFP4 helpers)."""
from __future__ import annotations

import math

import pytest
import torch

from qpn.kernels import codecs, formats
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.fp8 import codec as fp8_codec

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast


def test_e2m1_table_from_bits():
    for code in range(16):
        s = -1.0 if code & 8 else 1.0
        e, m = (code >> 1) & 3, code & 1
        want = s * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
        assert codecs.E2M1_VALUES[code] == want
        assert math.copysign(1.0, codecs.E2M1_VALUES[code]) == s
    got = codecs.decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == list(codecs.E2M1_VALUES)


def test_decode_e4m3_matches_torch_for_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = codecs.decode_e4m3(b)
    theirs = b.view(torch.float8_e4m3fn).to(torch.float32)
    nan = torch.isnan(theirs)
    assert torch.equal(torch.isnan(ours), nan)
    assert nan.sum() == 2  # 0x7F and 0xFF
    assert torch.equal(ours[~nan], theirs[~nan])
    assert float(ours[0x7E]) == 448.0 and float(ours[0x01]) == 2.0 ** -9
    # the float8 dtype and its bytes decode alike
    assert torch.equal(codecs.decode_e4m3(b.view(torch.float8_e4m3fn))[~nan], ours[~nan])


def test_pack_unpack_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = nvfp4_codec.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(nvfp4_codec.unpack_codes(packed), codes)
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (37, 24), dtype=torch.uint8, generator=g)
    assert torch.equal(nvfp4_codec.pack_codes(nvfp4_codec.unpack_codes(raw)), raw)


def _nearest_e2m1_even(v: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest magnitude in the e2m1 grid, ties to the even mantissa, saturating."""
    grid = torch.tensor(codecs.E2M1_VALUES[:8])
    d = (v.abs().unsqueeze(-1) - grid).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    # among tied candidates prefer even index (mantissa bit 0)
    idx = torch.where(cand[..., 0::2].any(-1),
                      (cand * (torch.arange(8) % 2 == 0)).float().argmax(-1),
                      cand.float().argmax(-1))
    return idx.to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)


def test_quantize_nvfp4_modelopt_convention():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 96, generator=g) * 0.02
    w[3, 5] = 0.5  # an outlier sets amax
    w[7, 16:32] = 0.0  # an all-zero group: scale forced to 1 before the cast
    q, s, gs = nvfp4_codec.quantize(w)
    assert q.dtype == torch.uint8 and q.shape == (24, 48)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (24, 6)
    assert gs.dtype == torch.float32 and gs.numel() == 1
    assert float(gs) == pytest.approx(0.5 / (6 * 448), rel=1e-7)
    assert float(s.float()[7, 1]) == 1.0
    # the block that holds amax gets the largest scale, 448, and code 7 (6.0) at the outlier
    assert float(s.float()[3, 0]) == 448.0
    codes = nvfp4_codec.unpack_codes(q)
    assert int(codes[3, 5]) == 7
    # every code is the round-half-even nearest e2m1 of w / (scale * gs)
    denom = (s.float() * gs).repeat_interleave(16, dim=1)
    assert torch.equal(codes, _nearest_e2m1_even(w / denom))
    err = (nvfp4_codec.dequantize(q, s, gs) - w).abs()
    assert float(err.max()) <= float(denom.max()) * 1.0 + 1e-12  # half of the widest step (2) times scale


def test_e2m1_rounding_ties():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -0.0, 0.2, 100.0])
    want = [0, 2, 2, 4, 4, 6, 6, 7, 8 | 2, 0, 0, 7]
    assert codecs.round_to_e2m1_codes(v).tolist() == want


def test_quantize_fp8_per_tensor_and_channel():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 40, generator=g)
    q, s = fp8_codec.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    assert float(s) == pytest.approx(float(w.abs().max()) / 448, rel=1e-7)
    assert float(codecs.decode_e4m3(q).abs().max()) == 448.0
    rel = (fp8_codec.dequantize(q, s) - w).norm() / w.norm()
    assert rel < 0.05
    q2, s2 = fp8_codec.quantize(w, per_channel=True)
    assert s2.shape == (16,)
    assert torch.allclose(s2, w.abs().amax(1) / 448)
    assert torch.equal(fp8_codec.dequantize(q2, s2.reshape(16, 1)), fp8_codec.dequantize(q2, s2))


def test_dequantize_nvfp4_f64_is_exact_product():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 0x7E, (8, 4), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.tensor(3.7e-4)
    d64 = nvfp4_codec.dequantize_f64(q, s, gs)
    codes = nvfp4_codec.unpack_codes(q)
    for r, c in [(0, 0), (3, 17), (7, 63)]:
        want = codecs.E2M1_VALUES[int(codes[r, c])] * float(s.view(torch.uint8)[r, c // 16].view(torch.float8_e4m3fn).float()) * float(gs)
        assert float(d64[r, c]) == want


def test_bad_inputs_name_the_problem():
    with pytest.raises(formats.FormatError, match="multiple of 16"):
        nvfp4_codec.check_source(torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 0, dtype=torch.uint8))
    with pytest.raises(formats.FormatError, match=r"\[N, K/16\]"):
        nvfp4_codec.check_source(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(formats.FormatError, match="float8_e4m3fn"):
        codecs.decode_e4m3(torch.zeros(3))
    with pytest.raises(formats.FormatError, match="per channel"):
        fp8_codec.dequantize(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(3))


# ------------------------------------------------------------------ independent cross-check
def _ct_helpers():
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.nvfp4.helpers",
        reason="compressed-tensors not installed (pyproject [test] extra)")
    return helpers


def test_cross_check_against_compressed_tensors():
    h = _ct_helpers()
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (12, 64), dtype=torch.uint8, generator=g)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    ours_packed = nvfp4_codec.pack_codes(codes)
    values = codecs.decode_e2m1(codes)
    # their packer from values, their unpacker to values, against our codes and bytes
    assert torch.equal(h.pack_fp4_to_uint8(values), ours_packed)
    theirs = h.unpack_fp4_from_uint8(ours_packed, 12, 64, dtype=torch.float32)
    assert torch.equal(theirs, values)
    assert torch.equal(torch.signbit(theirs), torch.signbit(values))
