"""CPU reference for the grouped MoE kernels, reading the SAME packed expert stacks.

Two levels, as for the dense routes (reference.py):

* ``moe_reference``: FP32 with the kernels' semantics and FP16 output. This is what a CPU engine
  serves. Only the experts that some pair selects are decoded (from fragment order, through
  reference.decode_packed_*), once per call, and each is applied to all its pairs in one matrix
  product; nothing is cached, so no FP16 or FP32 copy of a weight outlives the call.
* ``moe_reference_f64``: float64, exact up to the one rounding the design makes on purpose:
  the SwiGLU output (the down projection's activations) is rounded to FP16, because that is
  what enters the down GEMM, exactly as any activation entering a QPN GEMM is FP16. The weights
  come from the packed buffers through the verified inverse permutation (prepack.unprepack_*)
  and are exact in float64. Round the result to FP16 to compare with a kernel's output.

Routing: ``topk_ids`` [T, top_k] and ``topk_weights`` [T, top_k]; an id outside [0, E)
contributes nothing; a repeated id counts once per slot. The loop below runs over the experts
that are in use (at most min(E, T * top_k) iterations), never over elements.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from . import families
from .formats import MoeShapeError

if TYPE_CHECKING:  # the packed stacks are kernels/moe.py's; this module reads their fields only
    from .moe import PackedExpertStack, PackedMoE

# Experts one grouped MoE launch can index: the align kernel keeps 4 ints of shared memory per
# expert within the 48 KiB every architecture gives without opting in. The reference accepts
# what the kernels accept.
MAX_EXPERTS = 2048


def _weight_f32(stack: PackedExpertStack, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, K] float32, per-row result scale [N] float32) of expert e, from the packed bytes
    (WeightFormat.decode_packed: NVFP4 values carry their group and global scales, row scale 1,
    the semantics of the NVFP4 family's reference linear; FP8 values are e4m3, row scale per tensor / channel)."""
    return families.numerics(stack.format).decode_packed(stack.expert(e))


def _weight_f64(stack: PackedExpertStack, e: int, cache: Optional[dict] = None) -> torch.Tensor:
    """Exact float64 [N, K] of expert e, through the verified inverse of the prepack. ``cache``
    (a dict the caller owns, for tests that call the reference many times) keeps decoded experts."""
    if cache is not None:
        key = (id(stack.codes), e)
        w = cache.get(key)
        if w is None:
            w = cache[key] = _weight_f64(stack, e)
        return w
    p = stack.expert(e)
    num = families.numerics(p.format)
    return num.decode_f64(*num.unprepack(p))


def _linear32(x32: torch.Tensor, stack: PackedExpertStack, e: int) -> torch.Tensor:
    w, row_scale = _weight_f32(stack, e)
    return (x32 @ w.t()) * row_scale.unsqueeze(0)


def _pairs(topk_ids: torch.Tensor, num_experts: int):
    ids = topk_ids.reshape(-1).to(torch.long)
    valid = (ids >= 0) & (ids < num_experts)
    return ids, valid


def _routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedMoE,
            f64: bool, want_h: bool = False, cache: Optional[dict] = None):
    """Sum over slots of weight * down(SwiGLU) per token, float32 or float64 [T, H]; with want_h
    also the FP16-rounded SwiGLU activations per pair [P, I] (NaN rows for unused pairs)."""
    tokens, top_k = topk_ids.shape
    ids, valid = _pairs(topk_ids, packed.num_experts)
    dt = torch.float64 if f64 else torch.float32
    w = topk_weights.reshape(-1).to(dt)
    tok_of_pair = torch.arange(ids.numel(), device=x.device) // max(top_k, 1)
    out = torch.zeros((tokens, packed.hidden), dtype=dt, device=x.device)
    h_all = torch.full((ids.numel(), packed.intermediate), float("nan"), dtype=torch.float16,
                       device=x.device) if want_h else None
    xd = x.to(dt)
    for e in torch.unique(ids[valid]).tolist():
        sel = torch.nonzero(valid & (ids == e)).reshape(-1)
        xe = xd.index_select(0, tok_of_pair[sel])
        if f64:
            g = xe @ _weight_f64(packed.gate, e, cache).t()
            u = xe @ _weight_f64(packed.up, e, cache).t()
            h = (g / (1.0 + torch.exp(-g)) * u).to(torch.float16)
            d = h.double() @ _weight_f64(packed.down, e, cache).t()
        else:
            g = _linear32(xe, packed.gate, e)
            u = _linear32(xe, packed.up, e)
            h = (torch.nn.functional.silu(g) * u).to(torch.float16)
            d = _linear32(h.float(), packed.down, e)
        if want_h:
            h_all[sel] = h
        out.index_add_(0, tok_of_pair[sel], d * w[sel].unsqueeze(1))
    return out, h_all


def _check(x, topk_ids, topk_weights, packed):
    check_routing(x, topk_ids, topk_weights, packed)


def check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedMoE) -> None:
    if x.dim() != 2 or x.shape[1] != packed.hidden:
        raise MoeShapeError(f"activations must be [tokens, hidden={packed.hidden}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise MoeShapeError(f"topk_ids must be [tokens={x.shape[0]}, top_k], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise MoeShapeError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise MoeShapeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if packed.num_experts > MAX_EXPERTS:
        raise MoeShapeError(f"{packed.num_experts} experts; the grouped kernels handle at most {MAX_EXPERTS}")
    for t, what in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
        if t.device != x.device:
            raise MoeShapeError(f"{what} on {t.device} but activations on {x.device}")
    if packed.device != x.device:
        raise MoeShapeError(f"activations on {x.device} but the packed experts on {packed.device}; "
                            "move them with packed.to(device) at load time")


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedMoE,
                  shared: Optional[PackedMoE] = None, shared_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MoE layer's routed experts (+ shared expert) in FP32, fp16 [T, H] out."""
    _check(x, topk_ids, topk_weights, packed)
    out, _ = _routed(x, topk_ids, topk_weights, packed, f64=False)
    if shared is not None:
        ones = torch.zeros((x.shape[0], 1), dtype=torch.long, device=x.device)
        sw = shared_weight.reshape(-1, 1).float() if shared_weight is not None else \
            torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        s, _ = _routed(x, ones, sw, shared, f64=False)
        out = out + s
    return out.to(torch.float16)


def moe_reference_f64(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedMoE,
                      shared: Optional[PackedMoE] = None, shared_weight: Optional[torch.Tensor] = None,
                      return_h: bool = False, cache: Optional[dict] = None):
    """float64 [T, H] (not rounded); with return_h also the FP16 SwiGLU activations per pair."""
    _check(x, topk_ids, topk_weights, packed)
    out, h = _routed(x, topk_ids, topk_weights, packed, f64=True, want_h=return_h, cache=cache)
    if shared is not None:
        zeros = torch.zeros((x.shape[0], 1), dtype=torch.long, device=x.device)
        sw = shared_weight.reshape(-1, 1).double() if shared_weight is not None else \
            torch.ones((x.shape[0], 1), dtype=torch.float64, device=x.device)
        s, _ = _routed(x, zeros, sw, shared, f64=True, cache=cache)
        out = out + s
    return (out, h) if return_h else out


def down_f64_from_h(h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedMoE,
                    cache: Optional[dict] = None) -> torch.Tensor:
    """float64 [T, H]: sum over slots of weight * down_e(h[pair]) for given FP16 SwiGLU activations
    per pair [P, I] (the kernel's own, say), so the down GEMM is checked on the input it really
    had: an FP16 h that lands one step away from the reference's own rounding (a legitimate
    difference, measured by the h check) then costs nothing in the y check."""
    tokens, top_k = topk_ids.shape
    ids, valid = _pairs(topk_ids, packed.num_experts)
    w = topk_weights.reshape(-1).double()
    tok_of_pair = torch.arange(ids.numel(), device=h.device) // max(top_k, 1)
    out = torch.zeros((tokens, packed.hidden), dtype=torch.float64, device=h.device)
    for e in torch.unique(ids[valid]).tolist():
        sel = torch.nonzero(valid & (ids == e)).reshape(-1)
        d = h.index_select(0, sel).double() @ _weight_f64(packed.down, e, cache).t()
        out.index_add_(0, tok_of_pair[sel], d * w[sel].unsqueeze(1))
    return out


def swiglu_f64(x: torch.Tensor, packed: PackedMoE, e: int) -> torch.Tensor:
    """Exact float64 silu(gate_e(x)) * up_e(x) for one expert, [rows, I] (no rounding)."""
    xd = x.double()
    g = xd @ _weight_f64(packed.gate, e).t()
    u = xd @ _weight_f64(packed.up, e).t()
    return g / (1.0 + torch.exp(-g)) * u
