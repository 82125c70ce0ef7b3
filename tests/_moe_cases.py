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


def random_nvfp4_stack(experts: int, n: int, k: int, gen: torch.Generator, device="cpu"):
    """Random codes and positive e4m3 group scales over a wide range (some subnormal), global
    scale per expert sized so that a row's dot product stays O(1) for O(1) activations."""
    dev = torch.device(device)
    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    sc = torch.randint(0x28, 0x58, (experts, n, k // 16), dtype=torch.uint8, generator=gen, device=dev)
    sub = torch.rand((experts, n, k // 16), generator=gen, device=dev) < 0.05
    sc = torch.where(sub, torch.randint(1, 8, sc.shape, dtype=torch.uint8, generator=gen, device=dev), sc)
    gs = (0.25 / (k ** 0.5) / 8) * (0.5 + torch.rand(experts, generator=gen, device=dev))
    return codes, sc.view(torch.float8_e4m3fn), gs.to(torch.float32)


def random_fp8_stack(experts: int, n: int, k: int, gen: torch.Generator, per_channel: bool, device="cpu"):
    dev = torch.device(device)
    b = torch.randint(0, 256, (experts, n, k), dtype=torch.uint8, generator=gen, device=dev) & 0xDF
    if per_channel:
        scale = (torch.rand((experts, n), generator=gen, device=dev) + 0.5) * 0.02 / (k ** 0.5)
    else:
        scale = (torch.rand(experts, generator=gen, device=dev) + 0.5) * 0.03 / (k ** 0.5)
    return b.view(torch.float8_e4m3fn), scale


def random_moe(fmt: str, experts: int, hidden: int, inter: int, gen: torch.Generator, device="cpu",
               per_channel: bool = False, down_fmt: str | None = None, atom: str = "m8n8k4") -> moe.PackedMoE:
    """A PackedMoE of random expert weights (each expert's prepack inverse verified)."""
    dfmt = down_fmt or fmt

    def stack(f, n, k):
        if f == "nvfp4":
            return moe.prepack_expert_stack("nvfp4", *random_nvfp4_stack(experts, n, k, gen, device), atom=atom)
        return moe.prepack_expert_stack("fp8", *random_fp8_stack(experts, n, k, gen, per_channel, device),
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
