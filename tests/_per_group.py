"""Per-position probe: every (row, input) of a weight checked EXACTLY through a kernel or reference.

Token i of a probe call carries one nonzero activation, 1.0 at input k_i (a different input per
token), so y[i, n] is exactly one weight value W[n, k_i] = e2m1 * e4m3(group scale) * global for
NVFP4, e4m3 * channel scale for FP8: no sum, so no norm can hide a wrong group among others and no
outlier channel can dominate it. With a power-of-two global scale (NVFP4) and per-channel scales
of at most 3 significant bits (FP8), every such value is exact in FP16, so the kernel's FP16
output must equal it bit for bit. Enough calls cover every input of every row: every code
position of every tile and every (row, group) scale byte.

``probe`` returns the mismatching (row, input) positions; ``groups_of`` folds them into NVFP4
(row, group) pairs. A test that corrupts one packed scale byte must see exactly one (row, group)
reported (or, for FP8, one row).
"""
from __future__ import annotations

import torch

from qpn.kernels import formats
from qpn.kernels.families.nvfp4 import codec as nvfp4_codec
from qpn.kernels.families.fp8 import codec as fp8_codec

POW2_GLOBAL = 2.0 ** -8   # 6 * 448 * 2^-8 = 10.5 and 0.5 * 2^-9 * 2^-8 = 2^-18: all exact in FP16


def nvfp4_probe_weight(n: int, k: int, gen: torch.Generator, scale_bytes: torch.Tensor | None = None):
    """Codes over all 16 values; every (row, group) gets a nonzero code (so its scale is seen);
    scales drawn from `scale_bytes` (default: every positive finite e4m3 byte, 0x01 .. 0x7E);
    global scale a power of two."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    codes[:, ::16] = torch.randint(1, 8, (n, k // 16), dtype=torch.uint8, generator=gen) | \
        (torch.randint(0, 2, (n, k // 16), dtype=torch.uint8, generator=gen) << 3)   # a nonzero code per group
    pool = scale_bytes if scale_bytes is not None else torch.arange(0x01, 0x7F, dtype=torch.uint8)
    sc = pool[torch.randint(0, pool.numel(), (n, k // 16), generator=gen)]
    return nvfp4_codec.pack_codes(codes), sc.view(torch.float8_e4m3fn), torch.tensor(POW2_GLOBAL)


def fp8_probe_weight(n: int, k: int, gen: torch.Generator, per_channel: bool):
    """All finite e4m3 bytes; channel scales 2^-e * (1 + j/4) (distinct neighbours, <= 3 bits)."""
    bytes_ = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    w = bytes_[torch.randint(0, bytes_.numel(), (n, k), generator=gen)]
    w.view(-1)[: bytes_.numel()] = bytes_ if n * k >= bytes_.numel() else bytes_[: n * k]
    if per_channel:
        r = torch.arange(n)
        scale = (2.0 ** -(6 + r % 5)) * (1 + (r % 4) / 4)
    else:
        scale = torch.tensor(2.0 ** -7)
    return w.view(torch.float8_e4m3fn), scale.float()


def exact_weight(fmt: str, weight) -> torch.Tensor:
    """float64 [N, K] of the checkpoint tensors (formats' own tables, not the packed buffers)."""
    return nvfp4_codec.dequantize_f64(*weight) if fmt == "nvfp4" else fp8_codec.dequantize_f64(*weight)


def probe(run, w64: torch.Tensor, tokens_per_call: int, positions=None) -> list[tuple[int, int]]:
    """run(x fp16 [M, K]) -> y [M, N] (any float dtype). Returns the (row, input) pairs where
    y differs from fp16(W[row, input]) (checked to be exact in FP16 first)."""
    n, k = w64.shape
    want16 = w64.to(torch.float16)
    assert torch.equal(want16.double(), w64), "probe weights must be exact in FP16 (see module docstring)"
    ks = list(range(k)) if positions is None else list(positions)
    bad = []
    for c0 in range(0, len(ks), tokens_per_call):
        sel = ks[c0:c0 + tokens_per_call]
        x = torch.zeros((len(sel), k), dtype=torch.float16)
        x[torch.arange(len(sel)), torch.tensor(sel)] = 1.0
        y = run(x).to(torch.float64).cpu()
        got = y.to(torch.float16).double()
        exp = want16.t()[torch.tensor(sel)].double()          # [M, N]
        diff = (got != exp) & ~(torch.isnan(got) & torch.isnan(exp))
        for i, nn in zip(*torch.nonzero(diff, as_tuple=True)):
            bad.append((int(nn), sel[int(i)]))
    return bad


def groups_of(bad: list[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(r, kk // formats.NVFP4.group_size) for r, kk in bad}
