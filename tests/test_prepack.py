"""Prepack: only addresses move; the inverse gives the checkpoint bytes back, byte for byte."""
from __future__ import annotations

import pytest
import torch

from qpn.kernels import formats, prepack
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.nvfp4 import layout as nvfp4_layout
from qpn.kernels.families.fp8 import layout as fp8_layout
from qpn.kernels.families.int4 import layout as int4_layout
from qpn.kernels.atoms import geometry


def _nvfp4_bytes(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    return w, s


@pytest.mark.fast
@pytest.mark.parametrize("n,k", [(1, 16), (7, 32), (31, 48), (32, 64), (33, 80), (65, 112), (100, 1008),
                                 (3, 2064), (129, 16)])
def test_nvfp4_roundtrip_byte_identical(n, k):
    w, s = _nvfp4_bytes(n, k, n * 1000 + k)
    p = nvfp4_layout.prepack(w, s, torch.tensor(0.125), rows_per_chunk=64)
    assert p.n == n and p.k == k and p.n_pad % 32 == 0 and p.k_pad % 32 == 0
    assert p.codes.numel() == p.n_pad * p.k_pad // 2
    assert p.scales.numel() == p.n_pad * p.k_pad // 16
    nvfp4_layout.verify_roundtrip(p, w, s, rows_per_chunk=32)
    w2, s2 = nvfp4_layout.unprepack(p)
    assert torch.equal(w2, w) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    assert s2.dtype == torch.float8_e4m3fn
    # only addresses move: the packed buffer holds the same multiset of nibbles plus zero padding
    pad_nibbles = (p.n_pad * p.k_pad) - n * k
    src_hist = torch.bincount(nvfp4_codec.unpack_codes(w).reshape(-1).long(), minlength=16)
    dst_hist = torch.bincount(nvfp4_codec.unpack_codes(p.codes.view(1, -1)).reshape(-1).long(), minlength=16)
    src_hist[0] += pad_nibbles
    assert torch.equal(src_hist, dst_hist)


@pytest.mark.fast
@pytest.mark.parametrize("n,k,per_channel", [(1, 1, False), (7, 3, True), (33, 31, False), (64, 100, True),
                                             (100, 1001, False), (31, 33, True)])
def test_fp8_roundtrip_byte_identical(n, k, per_channel):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=g) + 0.5 if per_channel else torch.tensor(0.01)
    p = fp8_layout.prepack(w, scale, rows_per_chunk=32)
    assert p.per_channel == per_channel
    fp8_layout.verify_roundtrip(p, w, scale)
    w2, s2 = fp8_layout.unprepack(p)
    assert torch.equal(w2.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(s2.reshape(-1), torch.as_tensor(scale, dtype=torch.float32).reshape(-1))


@pytest.mark.fast
def test_chunking_does_not_change_the_packed_bytes():
    w, s = _nvfp4_bytes(200, 96, 7)
    a = nvfp4_layout.prepack(w, s, 1.0, rows_per_chunk=32)
    b = nvfp4_layout.prepack(w, s, 1.0, rows_per_chunk=10_000)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    f = w[:, :40].contiguous().view(torch.float8_e4m3fn)
    assert torch.equal(fp8_layout.prepack(f, 1.0, rows_per_chunk=32).codes,
                       fp8_layout.prepack(f, 1.0, rows_per_chunk=4096).codes)


@pytest.mark.fast
def test_fragment_positions_pin_the_kernel_contract():
    """Where single codes land: the CUDA decoders (kernels/families/<family>/m8n8k4.cuh) read exactly these places."""
    n, k = 32, 32
    codes = torch.zeros((n, k), dtype=torch.uint8)
    codes[0, 0], codes[0, 1], codes[0, 2], codes[0, 7] = 1, 2, 3, 5  # row 0 -> lane 0
    codes[4, 0] = 6                                                  # row 4 -> lane 16
    codes[8, 8] = 7                                                  # row 8 -> lane 4, second word
    p = nvfp4_layout.prepack(nvfp4_codec.pack_codes(codes), torch.zeros((n, 2), dtype=torch.uint8), 1.0)
    word = lambda lane, j: int.from_bytes(bytes(p.codes[16 * lane + 4 * j: 16 * lane + 4 * j + 4].tolist()), "little")
    nib = lambda v, i: (v >> (4 * i)) & 0xF
    w0 = word(0, 0)
    assert (nib(w0, 3), nib(w0, 7), nib(w0, 2), nib(w0, 4)) == (1, 2, 3, 5)  # k0, k1, k2, k7
    assert nib(word(16, 0), 3) == 6
    assert nib(word(4, 1), 3) == 7
    # FP8: bytes of a word hold k2, k0, k3, k1
    f = torch.zeros((32, 32), dtype=torch.uint8)
    f[0, 0:4] = torch.tensor([10, 11, 12, 13], dtype=torch.uint8)
    pf = fp8_layout.prepack(f.view(torch.float8_e4m3fn), 1.0)
    assert pf.codes[:4].tolist() == [12, 10, 13, 11]
    # scales: lane l holds (its row, group 0), (its row, group 1) at bytes 2l, 2l+1
    sc = torch.zeros((32, 2), dtype=torch.uint8)
    sc[4, 0], sc[4, 1], sc[9, 1] = 0x30, 0x31, 0x32  # row 4 -> lane 16, row 9 -> lane 5
    ps = nvfp4_layout.prepack(torch.zeros((32, 16), dtype=torch.uint8), sc, 1.0)
    assert ps.scales[32:34].tolist() == [0x30, 0x31] and int(ps.scales[11]) == 0x32


@pytest.mark.fast
def test_fragment_maps_are_permutations():
    for maps in (nvfp4_layout.code_maps, nvfp4_layout.scale_maps, fp8_layout.code_maps):
        gather, scatter = maps("m8n8k4")
        assert sorted(gather.tolist()) == list(range(gather.numel()))
        assert torch.equal(gather[scatter], torch.arange(gather.numel()))
    assert geometry("m8n8k4").tile_n == 32
    with pytest.raises(ValueError, match="unknown MMA atom"):
        geometry("m99")


@pytest.mark.fast
def test_verify_names_first_differing_byte():
    w, s = _nvfp4_bytes(64, 64, 11)
    p = nvfp4_layout.prepack(w, s, 1.0)
    bad = w.clone()
    bad[37, 5] ^= 0x10
    with pytest.raises(prepack.PrepackMismatch, match=r"row 37, byte 5"):
        nvfp4_layout.verify_roundtrip(p, bad, s)
    bad_s = s.view(torch.uint8).clone()
    bad_s[2, 3] ^= 1
    with pytest.raises(prepack.PrepackMismatch, match=r"row 2, group 3"):
        nvfp4_layout.verify_roundtrip(p, w, bad_s)
    assert issubclass(prepack.PrepackMismatch, ValueError)
    f = w.view(torch.float8_e4m3fn)
    pf = fp8_layout.prepack(f, 2.0)
    pf.codes[100] ^= 1
    with pytest.raises(prepack.PrepackMismatch, match="FP8 weight byte differs"):
        fp8_layout.verify_roundtrip(pf, f, 2.0)


@pytest.mark.fast
def test_nvfp4_k_must_be_multiple_of_16():
    with pytest.raises(formats.FormatError, match="multiple of 16"):
        nvfp4_layout.prepack(torch.zeros((4, 12), dtype=torch.uint8), torch.zeros((4, 1), dtype=torch.uint8), 1.0)


@pytest.mark.parametrize("n,k", [(8704, 5120), (5120, 4352)])
def test_real_per_rank_nvfp4_shapes(n, k):
    """TP4 per-rank MLP gate_up and down (Qwen3.8-27B, tests/test_tp_sharding.py)."""
    w, s = _nvfp4_bytes(n, k, 3)
    p = nvfp4_layout.prepack(w, s, 0.01)
    nvfp4_layout.verify_roundtrip(p, w, s)


@pytest.mark.fast
def test_real_per_rank_fp8_shapes():
    for n, k in [(4096, 5120), (5120, 1536)]:  # GDN in_proj_qkvz, out_proj per rank
        g = torch.Generator().manual_seed(n)
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        fp8_layout.verify_roundtrip(fp8_layout.prepack(w, 0.5), w, 0.5)


def test_lm_head_per_rank_chunked_without_second_full_copy():
    """5120 x 62,080 lm_head: prepack writes into one preallocated buffer in row blocks, so the
    largest temporary is a row block, not the matrix."""
    n, k = 62080, 5120
    w, s = _nvfp4_bytes(n, k, 9)
    p = nvfp4_layout.prepack(w, s, 0.02, rows_per_chunk=4096)
    assert p.codes.numel() == n * k // 2  # 62080 is a whole number of 32-row tiles
    nvfp4_layout.verify_roundtrip(p, w, s, rows_per_chunk=4096)


# ---- the verification compares every scale the packed copy carries (issue 40 item 8) ----------
# Each test hands verification the one wrong value a partial check (codes only, the first scale
# only, the per-tensor case only) would let through.

def _fp8_source(n, k, seed, per_channel):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    return w, (torch.rand(n, generator=g) + 0.5 if per_channel else torch.tensor(0.01))


@pytest.mark.fast
def test_fp8_verify_compares_every_per_channel_scale():
    w, scale = _fp8_source(70, 48, 5, per_channel=True)
    for row in (0, 37, 69):  # first, middle and last channel: no prefix of the vector is enough
        p = fp8_layout.prepack(w, scale, rows_per_chunk=32)
        p.scale[row] *= 2
        with pytest.raises(prepack.PrepackMismatch, match=rf"per-channel scale of row {row} is "):
            fp8_layout.verify_roundtrip(p, w, scale)
    p = fp8_layout.prepack(w, scale)
    with pytest.raises(prepack.PrepackMismatch, match=r"holds 1 value\(s\) in the source but 70"):
        fp8_layout.verify_roundtrip(p, w, scale[:1])  # a per-tensor scale against a per-channel copy
    with pytest.raises(prepack.PrepackMismatch, match="must compare the scale"):
        fp8_layout.verify_roundtrip(p, w, None)
    w1, one = _fp8_source(40, 48, 6, per_channel=False)
    p = fp8_layout.prepack(w1, one)
    p.scale[0] *= 3
    with pytest.raises(prepack.PrepackMismatch, match="per-tensor scale"):
        fp8_layout.verify_roundtrip(p, w1, one)


@pytest.mark.fast
def test_fp8_layer_whose_per_channel_scale_changed_after_packing_is_refused(monkeypatch):
    """The loader's own path: a prepack that changes one row's per-channel scale stops the load
    with an error naming the layer and the row, before the checkpoint's tensors are freed."""
    from types import SimpleNamespace

    from qpn.fork_patches.quant.conventions import COMPRESSED_TENSORS, ModuleScheme
    from qpn.fork_patches.quant.linear_method import QPNCheckpointError, qpn_linear_method

    w, scale = _fp8_source(96, 64, 7, per_channel=True)
    real = fp8_layout.prepack

    def changes_row_41(*a, **k):
        packed = real(*a, **k)
        packed.scale[41] = packed.scale[41] * 1.5
        return packed

    method = qpn_linear_method("model.layers.0.linear_attn.out_proj", ModuleScheme("fp8", "channel"),
                               {"backend": "reference"}, COMPRESSED_TENSORS)
    method.partition_sizes, method.n, method.k = [96], 96, 64
    layer = SimpleNamespace(weight=SimpleNamespace(data=w),
                            weight_scale=SimpleNamespace(data=scale.reshape(96, 1).clone()))
    method.prepack(layer)  # the untouched prepack is proven
    assert method.pieces[0][2].per_channel
    monkeypatch.setattr(fp8_layout, "prepack", changes_row_41)
    with pytest.raises(QPNCheckpointError,
                       match=r"model\.layers\.0\.linear_attn\.out_proj .*prepack inverse is not "
                             r"byte-identical.*per-channel scale of row 41"):
        method.prepack(layer)


@pytest.mark.fast
def test_nvfp4_verify_compares_the_global_scale(monkeypatch):
    """The global scale is copied, not permuted, yet the kernels multiply by the packed copy: a
    fused layer whose shards' global scales differ, packed with the wrong one, is refused."""
    from types import SimpleNamespace

    from qpn.fork_patches.quant.linear_method import QPNCheckpointError, qpn_linear_method
    from qpn.kernels import families

    w, s = _nvfp4_bytes(64, 64, 12)
    num = families.numerics(formats.NVFP4)
    p = num.prepack(w, s, torch.tensor(0.25))
    num.verify_roundtrip(p, w, s, torch.tensor(0.25))
    p.global_scale[0] = 0.5
    with pytest.raises(prepack.PrepackMismatch, match=r"weight_scale_2 \(global scale\) differs.*0\.5 in the "
                                                      r"packed copy, 0\.25 in the source"):
        num.verify_roundtrip(p, w, s, torch.tensor(0.25))
    with pytest.raises(prepack.PrepackMismatch, match="global scale.*not given"):
        num.verify_roundtrip(p, w, s, None)

    # the loader's path: gate and up shards with different global scales, the second packed with
    # the first shard's (what a prepack that reads weight_scale_2[0] for every piece would do)
    real = nvfp4_layout.prepack

    def first_shards_global(wt, st, gs, *a, **k):
        return real(wt, st, torch.tensor(0.125), *a, **k)

    method = qpn_linear_method("model.layers.0.mlp.gate_up_proj", "NVFP4", {"backend": "reference"})
    method.partition_sizes, method.n, method.k = [32, 32], 64, 64
    layer = SimpleNamespace(weight=SimpleNamespace(data=w), weight_scale=SimpleNamespace(data=s),
                            weight_scale_2=SimpleNamespace(data=torch.tensor([0.125, 0.375])))
    method.prepack(layer)
    assert len(method.pieces) == 2
    monkeypatch.setattr(nvfp4_layout, "prepack", first_shards_global)
    with pytest.raises(QPNCheckpointError, match=r"model\.layers\.0\.mlp\.gate_up_proj .*rows 32-63.*"
                                                 r"global scale\) differs"):
        method.prepack(layer)


@pytest.mark.fast
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_int4_verify_compares_every_scale_and_zero_and_the_output_scale(sym):
    """Every group scale and zero point of the last row too, and the output scale the kernels'
    epilogue multiplies by (the family has none: it must stay 1.0)."""
    import dataclasses


    n, k, g = 40, 128, 32
    gen = torch.Generator().manual_seed(13)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) + 0.5).to(torch.float16)
    z = None if sym else torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
    p = int4_layout.prepack(codes, s, z)
    int4_layout.verify_roundtrip(p, codes, s, z)
    last = s.clone()
    last[n - 1, k // g - 1] *= 2
    with pytest.raises(prepack.PrepackMismatch, match=rf"group_scales \(bits\) differ .* row {n - 1}, column {k // g - 1}"):
        int4_layout.verify_roundtrip(p, codes, last, z)
    if not sym:
        zz = z.clone()
        zz[n - 1, k // g - 1] ^= 1
        with pytest.raises(prepack.PrepackMismatch, match=rf"zero_points differ .* row {n - 1}"):
            int4_layout.verify_roundtrip(p, codes, s, zz)
    scaled = dataclasses.replace(p, out_scale=torch.full((1,), 2.0))
    with pytest.raises(prepack.PrepackMismatch, match=r"out_scale must be one float32 1\.0.*\[2\.0\]"):
        int4_layout.verify_roundtrip(scaled, codes, s, z)
