# SPDX-License-Identifier: MIT
# Wraps functions of vLLM (Apache-2.0, Copyright contributors to the vLLM project); see NOTICE.
"""Sampled (non-greedy) decoding under speculation on the cpu engine: the rejection sampler's inputs.

Speculative decoding promises the target model's distribution: a drafted token is kept with
probability ``p_target / p_draft`` (``p_draft = 1`` for our greedy drafter), and a rejected one is
replaced by a draw from the rest of the target distribution. The target distribution is the one the
request asks for: its temperature, top-k and top-p, applied per verified token. vLLM's
``rejection_sampler.apply_sampling_constraints`` expands those per-request values to one value per
drafted token (``expand_batch_to_tokens``), then masks and scales the drafted rows' logits.

Two faults of vLLM 0.32's CPU build break that, and only with speculation (found 2026-12-02):

- ``expand_batch_to_tokens`` runs the Triton ``expand_kernel``; without Triton the CPU platform
  replaces it with ``cpu_triton_utils._expand_kernel_impl``, which hands the C++ op
  ``_ensure_int64(output)``. For any output that is not int64 that is a *converted copy*: the op
  fills the copy and the real output stays the uninitialised ``new_empty`` it was. The input is
  converted too, so a temperature of 0.6 would become 0. Temperature and top-p are float32, top-k is
  int32 (``gpu_input_batch.py``): every drafted row is divided by garbage temperatures and masked
  with garbage top-k / top-p. The drafted tokens' logprobs sit near -25 where the top token is near
  -1.4, a seed does not reproduce, and ``temperature 0.01`` is not greedy. The bonus token (sampled
  by the plain ``Sampler``, no expansion) is right, which is why a reply's first token looks sane.
  ``wrap_expand_batch_to_tokens`` computes the expansion with torch for every dtype but int64,
  which the engine's op handles, so the float and int32 values arrive unchanged.
- A step whose requests carry no drafted token still runs the rejection sampler with zero target
  rows. With top-k and no top-p the CPU path takes ``apply_top_k_only``, whose ``k.max()`` has no
  maximum for an empty ``k``: ``RuntimeError: max(): Expected reduction dim to be specified for
  input.numel() == 0`` kills the engine core on the first request. ``wrap_apply_top_k_only``
  returns an empty batch unchanged (nothing to mask), and calls the engine's own function
  otherwise.

Neither fault reaches 1Cat-vLLM on a V100: both archives (1.2.2, 1.3.0) carry the same CPU code,
but on CUDA ``expand_batch_to_tokens`` launches the real Triton kernel and ``apply_top_k_top_p``
takes ``apply_top_k_only`` only on the CPU platform (``allow_cpu_sync``); tests/test_spec_sampling.py
proves both branches against the archives. The GPU rejection sampler's Triton kernels can only be
checked on a GPU.
"""
from __future__ import annotations

import functools

# Calls per hook since start, read by tests and the census.
STATS = {"expanded_in_torch": 0, "empty_top_k": 0}


def expand_in_torch(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """``x[b]`` repeated ``cu[b] - cu[b-1]`` times, ``replace_from`` values replaced by
    ``replace_to``, in ``x``'s dtype: what ``expand_kernel`` writes."""
    import torch

    counts = torch.diff(cu_num_tokens.to("cpu", torch.long),
                        prepend=torch.zeros(1, dtype=torch.long))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = values.repeat_interleave(counts.to(x.device))
    if out.numel() != num_tokens:
        raise ValueError(f"expand_batch_to_tokens: cu_num_tokens {cu_num_tokens.tolist()} ends at "
                         f"{out.numel()}, expected {num_tokens}")
    return out


def wrap_expand_batch_to_tokens(original):
    """``rejection_sampler.expand_batch_to_tokens``: expand non-int64 values in torch."""
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def expand_batch_to_tokens(*args, **kwargs):
        import torch

        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x, cu = a["x"], a["cu_num_tokens"]
        if x.dtype != torch.int64:
            STATS["expanded_in_torch"] += 1
            return expand_in_torch(x, cu, a["num_tokens"], a["replace_from"], a["replace_to"])
        # The engine's op writes cu[-1] values whatever the output's size: check first (CPU only,
        # no device sync to save).
        if (int(cu[-1]) if cu.numel() else 0) != a["num_tokens"]:
            raise ValueError(f"expand_batch_to_tokens: cu_num_tokens {cu.tolist()} ends at "
                             f"{int(cu[-1]) if cu.numel() else 0}, expected {a['num_tokens']}")
        return original(*args, **kwargs)

    return expand_batch_to_tokens


def wrap_apply_top_k_only(original):
    """``topk_topp_sampler.apply_top_k_only``: an empty batch has nothing to mask."""

    @functools.wraps(original)
    def apply_top_k_only(logits, k):
        if logits.shape[0] == 0 or k.numel() == 0:
            STATS["empty_top_k"] += 1
            return logits
        return original(logits, k)

    return apply_top_k_only
