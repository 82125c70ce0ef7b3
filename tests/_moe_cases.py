"""Routings and expert weights for the MoE tests (CPU reference tests and GPU numerics alike).

Routing cases, each a (topk_ids [T, top_k] int32, topk_weights [T, top_k] float32) pair:
  random          distinct experts per token, as a real top-k gives
  unused_experts  only the first quarter of the experts is ever chosen
  one_expert      every token puts expert 0 in slot 0 (all tokens on one expert)
  all_same        every slot of every token is the same expert (largest group pressure)
  repeat_in_token slot 1 repeats slot 0's expert for every token (same expert twice, both kept)
  invalid_ids     a quarter of the slots carry -1 (expert not on this rank: contributes nothing)
"""
from __future__ import annotations

import torch

from qpn.kernels import moe

try:
    from tests import _format_cases as fc     # imported as tests._moe_cases
except ImportError:
    import _format_cases as fc                # imported from tests/ on sys.path

ROUTINGS = ("random", "unused_experts", "one_expert", "all_same", "repeat_in_token", "invalid_ids")


def routing(case: str, tokens: int, top_k: int, experts: int, gen: torch.Generator, device="cpu"):
    dev = torch.device(device)
    scores = torch.rand((tokens, experts), generator=gen, device=dev)
    if case == "unused_experts":
        scores[:, max(top_k, experts // 4):] = -1.0
    ids = torch.topk(scores, min(top_k, experts), dim=1).indices
    if ids.shape[1] < top_k:  # fewer experts than slots: repeat (only for tiny test layers)
        ids = ids.repeat(1, -(-top_k // ids.shape[1]))[:, :top_k]
    if case == "one_expert":
        ids[:, 0] = 0
    elif case == "all_same":
        ids[:] = experts // 2
    elif case == "repeat_in_token" and top_k > 1:
        ids[:, 1] = ids[:, 0]
    elif case == "invalid_ids":
        drop = torch.rand(ids.shape, generator=gen, device=dev) < 0.25
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    elif case not in ROUTINGS:
        raise ValueError(case)
    w = torch.softmax(torch.randn((tokens, top_k), generator=gen, device=dev), dim=1)
    return ids.to(torch.int32), w.to(torch.float32)


def random_nvfp4_stack(experts: int, n: int, k: int, gen: torch.Generator, device="cpu", kind: str = "all_bytes"):
    """(codes uint8 [E, N, K/2], scales e4m3 [E, N, K/16], global scales float32 [E]).

    all_bytes: every e2m1 code and group scales from every non-negative finite e4m3 byte (0x00 ..
    0x7E: zero, subnormals, and the top binade where real ModelOpt scales sit), the global scale
    per expert sized so that a row's dot product stays O(0.1) for O(1) activations. gauss / heavy:
    realistic weights quantized per expert with the checkpoint generator's convention
    (tests/_format_cases.py)."""
    dev = torch.device(device)
    if kind != "all_bytes":
        parts = [fc.nvfp4_weight(n, k, kind, gen) for _ in range(experts)]
        return (torch.stack([p[0] for p in parts]).to(dev), torch.stack([p[1] for p in parts]).to(dev),
                torch.stack([torch.as_tensor(p[2]).reshape(()) for p in parts]).to(dev))
    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    pool = fc.NVFP4_SCALE_BYTES.to(dev)
    sc = pool[torch.randint(0, pool.numel(), (experts, n, k // 16), generator=gen, device=dev)]
    gs = (0.25 / (k ** 0.5) / 256) * (0.5 + torch.rand(experts, generator=gen, device=dev))
    return codes, sc.view(torch.float8_e4m3fn), gs.to(torch.float32)


def random_fp8_stack(experts: int, n: int, k: int, gen: torch.Generator, per_channel: bool, device="cpu",
                     kind: str = "all_bytes"):
    """(weights e4m3 [E, N, K], scales float32 [E] or [E, N]); all_bytes draws every finite e4m3
    byte (both signs, subnormals, +-448; not the NaN bytes 0x7F / 0xFF)."""
    dev = torch.device(device)
    if kind != "all_bytes":
        parts = [fc.fp8_weight(n, k, kind, gen, per_channel) for _ in range(experts)]
        return (torch.stack([p[0].view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn).to(dev),
                torch.stack([torch.as_tensor(p[1]).reshape(-1) if per_channel else torch.as_tensor(p[1]).reshape(())
                             for p in parts]).to(dev))
    pool = fc.FP8_FINITE_BYTES.to(dev)
    b = pool[torch.randint(0, pool.numel(), (experts, n, k), generator=gen, device=dev)]
    if per_channel:
        scale = (torch.rand((experts, n), generator=gen, device=dev) + 0.5) * 0.002 / (k ** 0.5)
    else:
        scale = (torch.rand(experts, generator=gen, device=dev) + 0.5) * 0.003 / (k ** 0.5)
    return b.view(torch.float8_e4m3fn), scale


def random_moe(fmt: str, experts: int, hidden: int, inter: int, gen: torch.Generator, device="cpu",
               per_channel: bool = False, down_fmt: str | None = None, atom: str = "m8n8k4",
               kind: str = "all_bytes") -> moe.PackedMoE:
    """A PackedMoE of random expert weights (each expert's prepack inverse verified)."""
    dfmt = down_fmt or fmt

    def stack(f, n, k):
        if f == "nvfp4":
            return moe.prepack_expert_stack("nvfp4", *random_nvfp4_stack(experts, n, k, gen, device, kind), atom=atom)
        return moe.prepack_expert_stack("fp8", *random_fp8_stack(experts, n, k, gen, per_channel, device, kind),
                                        atom=atom)

    return moe.PackedMoE(stack(fmt, inter, hidden), stack(fmt, inter, hidden), stack(dfmt, hidden, inter))


def activations(tokens: int, k: int, gen: torch.Generator, device="cpu", outliers: bool = True,
                lo: float = 100.0, hi: float = 300.0):
    """FP16 activations; with outliers, a few channels of magnitude lo..hi (hundreds to
    thousands: large enough to overflow an FP16 accumulator, small enough that SwiGLU's
    product of two such projections stays inside FP16 for these random weights)."""
    dev = torch.device(device)
    x = torch.randn((tokens, k), generator=gen, device=dev)
    if outliers:
        n_out = max(1, k // 512)
        ch = torch.randperm(k, generator=gen, device=dev)[:n_out]
        x[:, ch] = (torch.rand((tokens, n_out), generator=gen, device=dev) * (hi - lo) + lo) * \
            torch.where(torch.rand((tokens, n_out), generator=gen, device=dev) < 0.5, -1.0, 1.0)
    return x.to(torch.float16)
